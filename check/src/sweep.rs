//! Repair: a lost push is found by the sweep within its interval and repaired in bounded
//! time (D5).

use super::*;

/// Slack added to the sweep interval before a gap between two sweep hints is late (D5).
const SWEEP_SLACK_MS: f64 = 1000.0;
/// A device's median gap between sweep hints may not exceed this many sweep intervals.
pub(super) const SWEEP_MEDIAN_FACTOR: f64 = 1.5;
/// The median rule needs at least this many gaps of one device and conversation.
const SWEEP_MEDIAN_MIN_GAPS: usize = 3;

/// Rule 10, `d5-not-repaired` (D5: a lost push is repaired within a bounded time): at the
/// end, no live device still misses a visible event after the judge waited the bound.
pub(super) fn d5_not_repaired(cx: &Ctx, out: &mut Findings) {
    let l = &cx.fin.liveness;
    for (device, convs) in &l.missing {
        for (conv, seqs) in convs {
            if seqs.is_empty() {
                continue;
            }
            let lines = seqs.iter().flat_map(|&q| cx.oks_at(conv, q)).collect();
            let w = Witness::NotRepaired {
                device: device.clone(),
                conv: conv.clone(),
                seqs: seqs.clone(),
                waited_ms: l.waited_ms.round() as u64,
                bound_ms: l.bound_ms,
            };
            out.push(Anomaly::new(Kind::D5NotRepaired, w, lines));
        }
    }
}

/// Rule 14, `d5-locked-out` (D5: nothing a device lacks is repaired while it cannot get
/// in): a hello refused over the failed-hello limit ([`im_protocol::error::HELLO_THROTTLED`])
/// must have been earned. The gateway charges only the hellos the database refused
/// (`UNAUTHENTICATED`, `STALE_INSTALL`); one it could not check (`UNAVAILABLE`, an outage)
/// is not charged, or every device that reconnects through an outage is locked out after
/// it. The limits are per device and per source address, and every client of a run may
/// share one address, so a throttle is earned by a refused hello of any device anywhere
/// before it: the rule flags only a throttle with no refused hello at all before it in the
/// history. A refusal the client never saw (its connection lost first) is not in the
/// history; an honest device is refused only for a stale install or a removal, which a
/// workload that does neither never has.
pub(super) fn d5_locked_out(cx: &Ctx, out: &mut Findings) {
    let mut refused_before = false;
    for e in cx.h {
        match &e.line {
            Line::Fail(c)
                if c.op == OpName::Hello
                    && matches!(
                        c.value.code.as_deref(),
                        Some("UNAUTHENTICATED" | "STALE_INSTALL")
                    ) =>
            {
                refused_before = true;
            }
            Line::Info(c)
                if c.op == OpName::Hello
                    && c.value.why == "UNAVAILABLE"
                    && c.value.msg.as_deref() == Some(im_protocol::error::HELLO_THROTTLED)
                    && !refused_before =>
            {
                let w = Witness::LockedOut {
                    device: e.process.clone(),
                    line: e.i,
                };
                out.push(Anomaly::new(Kind::D5LockedOut, w, vec![e.i]));
            }
            _ => {}
        }
    }
}

/// A sweep hint waiting for the next one.
pub(super) struct PendingHint {
    t_ms: f64,
    line: u64,
    head: i64,
    sweep_ms: u64,
}

/// Rule 11, `d5-sweep-late` (D5: the sweep detects a lost push within its interval): while
/// a device stays connected to one gateway and does not catch up, the sweep re-hints it
/// every `sweep_ms`. Consecutive sweep hints of one (device, conv, instance) with no
/// disconnect / crash / restart of the device, no gateway start, no fault that took the
/// database away (`pg-crash`, `pg-power-cut`, `pg-primary-kill`: the sweep is a query, and
/// its interval runs while the database answers; hints received from such a fault until
/// a `pg-restart` succeeded or the address moved to a promoted standby are not judged), no
/// other nemesis action (a pause, a network fault, a killed backend: hints received while
/// one is in force are not judged; membership changes, the heal, a client crash and a
/// frame dropped or refused by the gateway other than an ack's reply leave the sweep
/// alone and do not count, `fault_leaves_the_sweep_alone`), no stall of the harness itself
/// (`observer-stall`: hints it recorded late) and no ack reply reaching
/// the first hint's head in between must be at most `sweep_ms + 1 s` apart, and, given at
/// least three gaps of one device and conv under one `sweep_ms`, their median at most
/// `1.5 × sweep_ms`. Keeps every gap for the statistics.
pub(super) fn d5_sweep_late(cx: &Ctx, out: &mut Findings) {
    let stalls = observer_stalls(cx.h);
    let mut disturbance = Disturbance::default();
    // device → (conv, instance) → the last sweep hint.
    let mut pending: HashMap<&str, HashMap<(&str, u64), PendingHint>> = HashMap::new();
    // (device, conv, sweep_ms) → (gaps, hint lines), for the median rule.
    let mut groups: Groups = BTreeMap::new();
    let mut all = Vec::new();
    for e in cx.h {
        let device = e.process.as_str();
        match &e.line {
            // Every nemesis line updates `disturbance`; some start a new series.
            Line::Nemesis(nem) if disturbance.starts_a_new_series(e.op_id, nem) => pending.clear(),
            Line::Recv(Recv::Hint { .. }) if disturbance.in_force() => {}
            Line::Client(Life::Disconnect {} | Life::Crash {} | Life::Restart {}) => {
                pending.remove(device);
            }
            Line::Ok(Done::Ack { conv, delivered }) => {
                if let Some(m) = pending.get_mut(device) {
                    m.retain(|(c, _), h| c != conv || h.head > *delivered);
                }
            }
            Line::Recv(Recv::Hint {
                conv,
                head,
                why: HintWhy::Sweep,
            }) => {
                let (conv, head) = (conv.as_str(), *head);
                let this = PendingHint {
                    t_ms: e.t_ms,
                    line: e.i,
                    head,
                    sweep_ms: disturbance.sweep_ms.unwrap_or(cx.fin.sweep_ms),
                };
                let prev = pending
                    .entry(device)
                    .or_default()
                    .insert((conv, e.instance), this);
                let Some(h1) = prev else { continue };
                let gap = e.t_ms - h1.t_ms;
                all.push(gap);
                if stalls
                    .iter()
                    .any(|&(from, to)| from < e.t_ms && to > h1.t_ms)
                {
                    // The harness itself was not running on time in between.
                    continue;
                }
                let g = groups.entry(((device, conv), h1.sweep_ms)).or_default();
                g.0.push(gap);
                g.1.extend([h1.line, e.i]);
                let allowed = h1.sweep_ms as f64 + SWEEP_SLACK_MS;
                if gap > allowed {
                    let w = Witness::SweepGap {
                        device: device.to_string(),
                        conv: conv.to_string(),
                        lines: (h1.line, e.i),
                        gap_ms: gap.round() as u64,
                        sweep_ms: h1.sweep_ms,
                        allowed_ms: allowed.round() as u64,
                    };
                    out.push(Anomaly::new(Kind::D5SweepLate, w, vec![h1.line, e.i]));
                }
            }
            _ => {}
        }
    }
    median_rule(groups, out);
    out.sweep_gaps = all;
}

/// (device, conv, sweep_ms) → (gaps, hint lines).
type Groups<'a> = BTreeMap<(Pair<'a>, u64), (Vec<f64>, BTreeSet<u64>)>;

/// The median half of rule 11: given at least three gaps of one device and conv under one
/// `sweep_ms`, their median is at most `1.5 × sweep_ms`.
fn median_rule(groups: Groups, out: &mut Findings) {
    for (((device, conv), sweep), (gaps, lines)) in groups {
        if gaps.len() < SWEEP_MEDIAN_MIN_GAPS {
            continue;
        }
        let n = gaps.len();
        let median = nearest_rank(&sorted(gaps), 0.5).unwrap_or(0.0);
        if median > SWEEP_MEDIAN_FACTOR * sweep as f64 {
            let w = Witness::SweepMedian {
                device: device.to_string(),
                conv: conv.to_string(),
                median_ms: median.round() as u64,
                gaps: n,
                sweep_ms: sweep,
            };
            out.push(Anomaly::new(
                Kind::D5SweepLate,
                w,
                lines.into_iter().collect(),
            ));
        }
    }
}

/// What the nemesis lines so far say about the sweep: its interval, the faults in force
/// and whether the database is away.
#[derive(Default)]
struct Disturbance {
    /// `IM_SWEEP_MS` of the last gateway start.
    sweep_ms: Option<u64>,
    /// Nemesis periods in force (start seen, end not yet), by op id.
    disturbed: HashSet<u64>,
    /// From a crash (or power cut, or primary kill) of the database until it is back.
    db_down: bool,
}

impl Disturbance {
    /// Whether hints received now are not judged (a fault in force, the database away).
    fn in_force(&self) -> bool {
        !self.disturbed.is_empty() || self.db_down
    }

    /// Takes in one nemesis line; true when it starts a new series of hints (the gaps
    /// across it are not judged).
    fn starts_a_new_series(&mut self, op_id: Option<u64>, nem: &Nemesis) -> bool {
        let (phase, action) = (nem.phase, &nem.action);
        match action {
            Action::GatewayStart { sweep_ms, .. } => {
                self.sweep_ms = Some(*sweep_ms);
                true
            }
            Action::PgCrash(_) | Action::PgPowerCut(_) | Action::PgPrimaryKill(_) => {
                track_period(op_id, phase, &mut self.disturbed);
                self.db_down = true;
                true
            }
            // The database answers again once a restart succeeded or the address moved to
            // the promoted standby.
            Action::PgRestart(_) | Action::DbAddressSwitch { .. } => {
                track_period(op_id, phase, &mut self.disturbed);
                let restarted = match action {
                    Action::PgRestart(o) => phase == Phase::End && o.ok == Some(true),
                    _ => true,
                };
                if restarted {
                    self.db_down = false;
                }
                true
            }
            // A membership change, a reinstall or the heal does not slow the sweep.
            Action::Membership { .. } | Action::Reinstall { .. } | Action::Heal { .. } => false,
            // Nor does a fault that cannot delay a hint or move a cursor unseen: a device
            // killed (its own crash entry ends what it was waiting for), or frames dropped
            // or answered with an error by the gateway, except the ack's reply (the ack
            // took effect and the sweep stopped hinting, but the client never heard). Its
            // start and its end carry the same fault, so both are answered here.
            Action::Fault { .. } | Action::GwFault { .. }
                if fault_leaves_the_sweep_alone(action) =>
            {
                false
            }
            // Any other fault (a pause, network latency or blackhole, a killed backend, a
            // stall of the harness...) may delay the sweep: the rule judges only gaps with
            // no fault in force.
            _ => {
                track_period(op_id, phase, &mut self.disturbed);
                true
            }
        }
    }
}

/// Whether a fault (the start of its `fault` or `gw-fault` period) can neither delay the
/// sweep or its hints nor move a cursor without the client hearing of it: a `client-crash`,
/// or a frame fault that drops a frame or answers it with an error at any point but
/// `gw.reply.ack`. The judge does not decide it: the line says so
/// (`leaves_the_sweep_alone`, written by whoever made the fault: the nemesis's fault
/// packages, or a scripted check arming a frame fault, by one rule).
pub(super) fn fault_leaves_the_sweep_alone(action: &Action) -> bool {
    match action {
        Action::Fault { fault, .. } => fault.leaves_the_sweep_alone,
        Action::GwFault {
            leaves_the_sweep_alone,
            ..
        } => *leaves_the_sweep_alone,
        _ => false,
    }
}

/// Keeps the set of nemesis periods in force: a `start` line opens one (by op id), its
/// `end` closes it; instants open nothing.
/// The windows in which the harness itself was stalled (`observer-stall` lines, written by
/// `History`): what it recorded in them was recorded late, so no time bound is judged
/// across one. `(from_ms, to_ms)`.
pub(super) fn observer_stalls(h: &[Entry]) -> Vec<(f64, f64)> {
    h.iter()
        .filter_map(|e| match &e.line {
            Line::Nemesis(Nemesis {
                action: Action::ObserverStall { from_ms, to_ms, .. },
                ..
            }) => Some((*from_ms, *to_ms)),
            _ => None,
        })
        .collect()
}

pub(super) fn track_period(op_id: Option<u64>, phase: Phase, open: &mut HashSet<u64>) {
    let Some(id) = op_id else { return };
    match phase {
        Phase::Start => {
            open.insert(id);
        }
        Phase::End => {
            open.remove(&id);
        }
        Phase::Instant => {}
    }
}
