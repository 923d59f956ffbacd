//! Order: the rows of a conversation are exactly seqs 1..=head (P1).

use super::*;

/// Rule 5, `p1-gap` (P1): the rows of every conversation are exactly seqs `1..=head`.
pub(super) fn p1_gap(cx: &Ctx, out: &mut Findings) {
    let mut seqs: HashMap<&str, BTreeSet<i64>> = HashMap::new();
    for r in &cx.fin.events {
        seqs.entry(&r.conv).or_default().insert(r.seq);
    }
    let empty = BTreeSet::new();
    for (conv, &head) in &cx.fin.heads {
        let have = seqs.get(conv.as_str()).unwrap_or(&empty);
        let extra: Vec<i64> = have
            .iter()
            .copied()
            .filter(|&q| q < 1 || q > head)
            .collect();
        let inside = have.len() - extra.len();
        let missing: Vec<i64> = if inside as i64 == head.max(0) {
            Vec::new()
        } else {
            (1..=head).filter(|q| !have.contains(q)).collect()
        };
        if missing.is_empty() && extra.is_empty() {
            continue;
        }
        let w = Witness::SeqGap {
            conv: conv.clone(),
            head,
            missing,
            extra,
        };
        out.push(Anomaly::new(Kind::P1Gap, w, Vec::new()));
    }
}
