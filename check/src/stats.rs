//! The statistics of a report (numbers, not judgements).

use super::*;

/// The statistics of the report.
pub(super) fn stats(cx: &Ctx, info_sends: InfoSends, gaps: Vec<f64>) -> Stats {
    let mut ops: BTreeMap<String, OpCounts> = BTreeMap::new();
    let (mut pushes, mut hints, mut stores, mut explicit_acks) = (0, 0, 0, 0);
    let mut probes = ProbeCounts::default();
    let mut malformed = 0;
    for e in cx.h {
        if let Some(op) = e.line.client_op() {
            let c = ops.entry(op.as_str().to_string()).or_default();
            match e.kind() {
                Type::Invoke => c.invoke += 1,
                Type::Ok => c.ok += 1,
                Type::Fail => c.fail += 1,
                _ => c.info += 1,
            }
        }
        match &e.line {
            Line::Invoke(Invoke::Ack { explicit: true, .. }) => explicit_acks += 1,
            Line::Recv(Recv::Push(_)) => pushes += 1,
            Line::Recv(Recv::Hint { .. }) => hints += 1,
            Line::Recv(Recv::Malformed { .. }) => malformed += 1,
            Line::Info(c) if c.value.why == MALFORMED_REPLY => malformed += 1,
            Line::Store(_) => stores += 1,
            Line::Probe(ProbeLine::Probe {
                expect_mid,
                found_mid,
                error,
                ..
            }) => {
                probes.total += 1;
                if error.is_some() {
                    probes.errors += 1;
                } else if found_mid.as_ref() == Some(expect_mid) {
                    probes.visible += 1;
                }
            }
            _ => {}
        }
    }

    let mut sent_at: HashMap<(&str, i64), f64> = HashMap::new();
    for ok in &cx.send_oks {
        sent_at.entry((ok.conv, ok.seq)).or_insert(ok.t_ms);
    }
    let mut first_store: HashSet<DevSeq> = HashSet::new();
    let (mut delivery, mut repair) = (Vec::new(), Vec::new());
    for e in cx.h {
        let Line::Store(Store::Store {
            conv, via, events, ..
        }) = &e.line
        else {
            continue;
        };
        let via_sync = *via == Via::Sync;
        for q in events.iter().map(|ev| ev.seq) {
            if !first_store.insert((&e.process, conv, q)) {
                continue;
            }
            if let Some(t) = sent_at.get(&(conv, q)) {
                delivery.push(e.t_ms - t);
                if via_sync {
                    repair.push(e.t_ms - t);
                }
            }
        }
    }

    let gaps = sorted(gaps);
    Stats {
        entries: cx.h.len() as u64,
        ops,
        pushes,
        hints,
        stores,
        info_sends,
        explicit_acks,
        malformed,
        probes,
        delivery_ms: quantiles(delivery),
        repair_ms: quantiles(repair),
        sweep_hint_gaps_ms: GapQuantiles {
            n: gaps.len() as u64,
            p50: nearest_rank(&gaps, 0.5),
            max: gaps.last().copied(),
        },
    }
}

/// The `q`-quantile (0..=1) of already sorted values by nearest rank: the value at rank
/// `ceil(q * n)`, clamped to `1..=n`; `None` when empty.
pub fn nearest_rank<T: Copy>(sorted: &[T], q: f64) -> Option<T> {
    if sorted.is_empty() {
        return None;
    }
    let n = sorted.len();
    let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
    Some(sorted[rank - 1])
}
