//! Commit: a reply or a push leaves only after the transaction committed (D1 probes).

use super::*;

/// Rule 13, `reply-before-commit` / `push-before-commit` (D1: a `sent` reply, and a push,
/// leave only after the transaction committed): a probe on another database session,
/// taken right after the reply or push arrived, reads the same mid. Probes that could not
/// read are ignored.
pub(super) fn before_commit(cx: &Ctx, out: &mut Findings) {
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
