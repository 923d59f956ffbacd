//! Membership: a device sees only events inside its user's periods (S1).

use super::*;

/// Rule 9, `s1-outside` (S1: a device sees only events inside its user's membership
/// periods): every pushed event and every event of a sync reply lies in one of the
/// periods of the receiving device's user, and so does the head of every hint (issue 42):
/// a hint names the last event its device may see (0: none), so a hint past a member's
/// leave points at an event they may not see, their sync finds nothing and the sweep hints
/// them about it for ever. A device the final read does not know has no periods.
///
/// A hint carries no epoch: it is judged only while its device's newest view of the
/// conversation is the conversation's newest epoch (the final read's periods are that
/// lineage's), and not at all where the history shows no epoch for it.
pub(super) fn s1_outside(cx: &Ctx, out: &mut Findings) {
    // Issue 21: the newest epoch of each conversation the history saw. An event read under
    // an older one belongs to a history the database lost (a failover): the periods the
    // final read knows are the new lineage's, so it is not judged here (`held-lost` judges
    // whether its device was told).
    let newest = newest_epochs(cx.h);
    let current = |ev: &EventRef| {
        ev.epoch
            .is_none_or(|e| newest.get(ev.conv.as_str()).is_none_or(|&n| e >= n))
    };
    // Each device's newest epoch of each conversation, as its lines showed it so far.
    let mut seen: HashMap<(&str, &str), i64> = HashMap::new();
    for e in cx.h {
        for (conv, x) in epochs_in(e) {
            let n = seen.entry((e.process.as_str(), conv)).or_insert(x);
            *n = (*n).max(x);
        }
        let (how, events): (&str, Vec<(&str, i64)>) = match &e.line {
            Line::Recv(Recv::Push(ev)) if current(ev) => ("push", vec![(&ev.conv, ev.seq)]),
            Line::Recv(Recv::Hint { conv, head, .. })
                if *head > 0
                    && seen
                        .get(&(e.process.as_str(), conv.as_str()))
                        .is_some_and(|x| newest.get(conv.as_str()) == Some(x)) =>
            {
                ("hint", vec![(conv.as_str(), *head)])
            }
            Line::Ok(Done::Sync { events, .. }) => (
                "sync",
                events
                    .iter()
                    .filter(|ev| current(ev))
                    .map(|ev| (ev.conv.as_str(), ev.seq))
                    .collect(),
            ),
            _ => continue,
        };
        let device = e.process.as_str();
        let user = cx.user(device).unwrap_or("(unknown user)");
        let mut outside: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
        for (conv, seq) in events {
            if !inside(cx.periods_of(device, conv).unwrap_or(&[]), seq) {
                outside.entry(conv).or_default().push(seq);
            }
        }
        for (conv, seqs) in outside {
            let w = Witness::OutsidePeriods {
                device: device.to_string(),
                user: user.to_string(),
                conv: conv.to_string(),
                seqs,
                how: how.to_string(),
                line: e.i,
                periods: cx.periods_of(device, conv).unwrap_or(&[]).to_vec(),
            };
            out.push(Anomaly::new(Kind::S1Outside, w, vec![e.i]));
        }
    }
}
