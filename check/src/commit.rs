//! Commit: a reply or a push leaves only after the transaction committed (D1 probes).

use super::*;

/// Rule 13, `reply-before-commit` / `push-before-commit` (D1: a `sent` reply, and a push,
/// leave only after the transaction committed): a probe on another database session,
/// taken right after the reply or push arrived, reads the same mid. Probes that could not
/// read are ignored, and so are probes that read another history than the one the reply
/// or push came from ([`OtherLineage`]).
pub(super) fn before_commit(cx: &Ctx, out: &mut Findings) {
    let other = OtherLineage::of(cx.h);
    for e in cx.h {
        // A probe that could not read (the database was down) proves nothing.
        let Line::Probe(ProbeLine::Probe {
            of,
            conv,
            seq,
            expect_mid: expect,
            found_mid,
            error: None,
        }) = &e.line
        else {
            continue;
        };
        let (of, found) = (*of, found_mid.as_deref());
        if found == Some(expect.as_str()) {
            continue;
        }
        let Some(src) = cx.line(of) else { continue };
        let (kind, what) = match &src.line {
            Line::Ok(Done::Send { .. }) => (Kind::ReplyBeforeCommit, "sent reply"),
            Line::Recv(Recv::Push(_)) => (Kind::PushBeforeCommit, "push"),
            _ => continue,
        };
        if other.read(src, e) {
            continue;
        }
        let w = Witness::NotVisible {
            device: src.process.clone(),
            what: what.to_string(),
            expected: named(conv, *seq, expect, Some(of)),
            found_mid: found.map(str::to_string),
            probe_line: e.i,
        };
        out.push(Anomaly::new(kind, w, vec![of, e.i]));
    }
}

/// Issue 21's asynchronous failover, as the probes meet it: the promoted standby may lack
/// what the old primary committed after the replication link was cut (the `lost` rule
/// reports such a message as the failover's expected loss). A probe taken after the
/// gateways' database address moved to the standby reads the standby's history; for a
/// reply or push that arrived before the move, under an older epoch than the newest its
/// conversation had (the old primary's history), finding nothing proves nothing about D1.
/// A probe taken before the move, a reply or push after it or of the newest epoch, and
/// any probe with a synchronous standby are judged as always. (Seen at 93c3f0d, nemesis
/// seed 40 on 3 gateways: the probe's own connection failed during the failover and
/// its retry read the promoted standby 800 ms later.)
struct OtherLineage<'a> {
    /// Lines where the database address moved, when the history has an asynchronous
    /// failover; empty otherwise.
    switches: Vec<u64>,
    newest: HashMap<&'a str, i64>,
}

impl<'a> OtherLineage<'a> {
    fn of(h: &'a [Entry]) -> OtherLineage<'a> {
        let switches = if async_failover(h) {
            h.iter()
                .filter(|e| {
                    matches!(
                        &e.line,
                        Line::Nemesis(Nemesis {
                            action: Action::DbAddressSwitch { .. },
                            ..
                        })
                    )
                })
                .map(|e| e.i)
                .collect()
        } else {
            Vec::new()
        };
        // The epochs matter only where the address moved.
        let newest = if switches.is_empty() {
            HashMap::new()
        } else {
            newest_epochs(h)
        };
        OtherLineage { switches, newest }
    }

    /// Whether `probe` read another history than the one `src` (a reply or push) came from.
    fn read(&self, src: &Entry, probe: &Entry) -> bool {
        let moved_between = self.switches.iter().any(|&s| src.i < s && s < probe.i);
        let epochs = epochs_in(src);
        let older = !epochs.is_empty()
            && epochs
                .iter()
                .all(|(conv, x)| self.newest.get(conv).is_some_and(|n| x < n));
        moved_between && older
    }
}
