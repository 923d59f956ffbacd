//! Cursors: a cursor moves only on a device ack of what it stored (D3) and never goes
//! down (D4).

use super::*;

/// What one device has persisted of one conversation, and how far that is contiguous.
pub(super) struct Persisted<'a> {
    seqs: HashSet<i64>,
    /// Every visible seq `<= through` is in `seqs` (only grows: `seqs` only grows).
    through: i64,
    /// The user's periods; None when the device is unknown (every seq counts as visible).
    periods: Option<&'a [Period]>,
}

impl Persisted<'_> {
    /// Advances `through` as far as the persisted set allows, up to `head`.
    fn advance(&mut self, head: i64) -> i64 {
        while self.through < head {
            let next = self.through + 1;
            let visible = self.periods.is_none_or(|p| inside(p, next));
            if visible && !self.seqs.contains(&next) {
                break;
            }
            self.through = next;
        }
        self.through
    }
}

/// Rule 6, `d3-ack-beyond-store` (D3: `delivered_seq` means "this device stored every
/// visible event with seq <= delivered_seq"): the client's own (non-explicit) acks never
/// exceed what it had persisted contiguously, counting only seqs visible to its user, when
/// the ack left. One walk, keeping each device's persisted set.
pub(super) fn d3_ack_beyond_store(cx: &Ctx, out: &mut Findings) {
    let mut st: HashMap<Pair, Persisted> = HashMap::new();
    let persisted = |device, conv| Persisted {
        seqs: HashSet::new(),
        through: 0,
        periods: cx.periods_of(device, conv),
    };
    // Issue 21: the epoch each device last saw of each conversation. An ack made under an
    // older one than the newest of the history acked a seq of a lost history: the final
    // read's head (the new lineage's) cannot judge it.
    let newest = newest_epochs(cx.h);
    let mut seen_epoch: HashMap<Pair, i64> = HashMap::new();
    for e in cx.h {
        let device = e.process.as_str();
        for (conv, x) in epochs_in(e) {
            let k = seen_epoch.entry((device, conv)).or_insert(x);
            *k = (*k).max(x);
        }
        match &e.line {
            Line::Invoke(Invoke::Ack { conv, .. })
                if seen_epoch
                    .get(&(device, conv.as_str()))
                    .is_some_and(|x| newest.get(conv.as_str()).is_some_and(|n| x < n)) => {}
            Line::Store(Store::Store { conv, events, .. }) => {
                let p = st
                    .entry((device, conv))
                    .or_insert_with(|| persisted(device, conv));
                p.seqs.extend(events.iter().map(|ev| ev.seq));
            }
            // Issue 21: the device discarded what it held of the conversation.
            Line::Store(Store::Epoch { conv, .. }) => {
                st.insert((device, conv), persisted(device, conv));
            }
            Line::Invoke(Invoke::Ack {
                conv,
                seq,
                explicit: false,
            }) => {
                let (conv, seq) = (conv.as_str(), *seq);
                let p = st
                    .entry((device, conv))
                    .or_insert_with(|| persisted(device, conv));
                let through = p.advance(cx.head(conv));
                if seq > through {
                    let w = Witness::AckBeyondStore {
                        device: device.to_string(),
                        conv: conv.to_string(),
                        seq,
                        stored_through: through,
                        line: e.i,
                    };
                    out.push(Anomaly::new(Kind::D3AckBeyondStore, w, vec![e.i]));
                }
            }
            _ => {}
        }
    }
}

/// Rule 7, `d3-cursor-unexplained` (D3: `delivered_seq` advances only on a device ack):
/// every cursor increase to `new` follows (by wall clock) an ack of exactly `new` by that
/// device in that conversation.
pub(super) fn d3_cursor_unexplained(cx: &Ctx, out: &mut Findings) {
    let mut acks: HashMap<DevSeq, Vec<(i64, u64)>> = HashMap::new();
    for e in cx.h {
        if let Line::Invoke(Invoke::Ack { conv, seq, .. }) = &e.line {
            acks.entry((&e.process, conv, *seq))
                .or_default()
                .push((e.wall_us, e.i));
        }
    }
    for w in &cx.fin.cursor_audit {
        if w.new <= w.old.unwrap_or(0) {
            continue;
        }
        let found = acks.get(&(w.device.as_str(), w.conv.as_str(), w.new));
        if found.is_some_and(|a| a.iter().any(|&(wall, _)| wall < w.wall_us)) {
            continue;
        }
        let later: Vec<u64> = found
            .map(|a| a.iter().map(|&(_, i)| i).collect())
            .unwrap_or_default();
        let first_ack = found
            .and_then(|a| a.first())
            .map(|&(wall, i)| (i, wall - w.wall_us));
        let witness = Witness::CursorUnexplained {
            write: w.clone(),
            first_ack,
        };
        out.push(Anomaly::new(Kind::D3CursorUnexplained, witness, later));
    }
}

/// Rule 8, `d4-decrease` (D4: `delivered_seq` never decreases and never exceeds the head):
/// (a) no audited write lowers the cursor; (b) a device is never told a lower `delivered`
/// (ack or sub reply) than one it had already received before that op was invoked
/// (overlapping ops are not compared); (c) every final cursor is in `0..=head`.
pub(super) fn d4_decrease(cx: &Ctx, out: &mut Findings) {
    for w in &cx.fin.cursor_audit {
        if let Some(old) = w.old {
            if w.new < old {
                let witness = Witness::CursorWrittenDown { write: w.clone() };
                out.push(Anomaly::new(Kind::D4Decrease, witness, Vec::new()));
            }
        }
    }

    // (device, conv) → (position of a completion, max delivered received up to and
    // including it, the line that brought that max), ascending by position.
    let mut seen: HashMap<Pair, Vec<(usize, i64, u64)>> = HashMap::new();
    // Issue 21: the epoch each device last knew of each conversation. Across a move the
    // database is another history (a promoted standby's), whose cursors may be lower: a
    // `delivered` is compared only with those of the same epoch.
    let mut epochs: HashMap<Pair, i64> = HashMap::new();
    // A newer epoch of a conversation, in anything the device got, starts it afresh.
    fn note<'a, V>(
        epochs: &mut HashMap<Pair<'a>, i64>,
        seen: &mut HashMap<Pair<'a>, V>,
        key: Pair<'a>,
        epoch: i64,
    ) {
        let known = epochs.entry(key).or_insert(epoch);
        if epoch > *known {
            *known = epoch;
            seen.remove(&key);
        }
    }
    for (p, e) in cx.h.iter().enumerate() {
        let device = e.process.as_str();
        for (conv, x) in epochs_in(e) {
            note(&mut epochs, &mut seen, (device, conv), x);
        }
        let got: Vec<(&str, i64)> = match &e.line {
            Line::Ok(Done::Ack { conv, delivered }) => vec![(conv, *delivered)],
            Line::Ok(Done::Sub { convs }) => convs
                .iter()
                .map(|c| (c.conv.as_str(), c.delivered))
                .collect(),
            _ => continue,
        };
        let invoked = cx.invoke_pos(e);
        for (conv, d) in got {
            let list = seen.entry((&e.process, conv)).or_default();
            if let Some(ip) = invoked {
                let k = list.partition_point(|x| x.0 < ip);
                if let Some(&(_, max, max_line)) = k.checked_sub(1).map(|k| &list[k]) {
                    if d < max {
                        let inv = cx.h[ip].i;
                        let w = Witness::DeliveredDecreased {
                            device: e.process.clone(),
                            conv: conv.to_string(),
                            op: e.op().to_string(),
                            delivered: d,
                            invoked_line: inv,
                            answered_line: e.i,
                            earlier: max,
                            earlier_line: max_line,
                        };
                        out.push(Anomaly::new(Kind::D4Decrease, w, vec![max_line, inv, e.i]));
                    }
                }
            }
            let (max, max_line) = match list.last() {
                Some(&(_, m, l)) if m >= d => (m, l),
                _ => (d, e.i),
            };
            list.push((p, max, max_line));
        }
    }

    for c in &cx.fin.cursors {
        let head = cx.head(&c.conv);
        if c.delivered < 0 || c.delivered > head {
            let w = Witness::CursorOutsideHead {
                device: c.device.clone(),
                conv: c.conv.clone(),
                delivered: c.delivered,
                head,
            };
            out.push(Anomaly::new(Kind::D4Decrease, w, Vec::new()));
        }
    }
}
