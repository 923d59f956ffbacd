//! Delivery rules: every acknowledged message kept once (`lost`, `duplicated`,
//! `unexpected`), what clients store is what the database kept (`store-mismatch`), and the
//! sends without a definite answer (statistics).

use super::*;

/// Rule 1, `lost` (D1/D6): every `sent` reply names a row that exists at the end with the
/// same mid: an acknowledged message survives every crash.
pub(super) fn lost(cx: &Ctx, out: &mut Findings) {
    // Issue 21: after an asynchronous standby's promotion (its replication link cut as its
    // primary died), a `sent` that names an older epoch than the newest its conversation
    // had was committed on the old primary, in the history the failover may lose, as that
    // configuration allows. (One naming the newest epoch was committed on the promoted
    // standby: it must be kept. With a synchronous standby nothing may be lost.)
    let async_failover = async_failover(cx.h);
    let newest = newest_epochs(cx.h);
    let mut old_lineage: HashSet<u64> = HashSet::new();
    for ok in &cx.send_oks {
        if async_failover && newest.get(ok.conv).is_some_and(|&n| ok.epoch < n) {
            old_lineage.insert(ok.line);
        }
    }
    let mut by: BTreeMap<ConvSeqMid, (Vec<u64>, BTreeSet<&str>)> = BTreeMap::new();
    for ok in &cx.send_oks {
        let g = by.entry((ok.conv, ok.seq, ok.mid)).or_default();
        g.0.push(ok.line);
        g.1.insert(ok.device);
    }
    for ((conv, seq, mid), (lines, devices)) in by {
        let row = cx.rows.get(&(conv, seq));
        if row.is_some_and(|r| r.mid == mid) {
            continue;
        }
        let w = Witness::SentNotKept {
            devices: devices.into_iter().map(str::to_string).collect(),
            sent: named(conv, seq, mid, lines.first().copied()),
            row: row.map(|r| (*r).clone()),
        };
        if lines.iter().all(|l| old_lineage.contains(l)) {
            out.expected_loss.push(w);
            continue;
        }
        out.push(Anomaly::new(Kind::Lost, w, lines));
    }
}

/// Rule 2, `duplicated` (D2): one row per (sender_user, cmid), and one device's cmid is
/// always answered with the same seq and mid (a resend answers `dup:true` with the
/// original).
pub(super) fn duplicated(cx: &Ctx, out: &mut Findings) {
    let mut rows: BTreeMap<(&str, &str), Vec<&FinalEvent>> = BTreeMap::new();
    for r in &cx.fin.events {
        rows.entry((&r.sender_user, &r.cmid)).or_default().push(r);
    }
    for ((user, cmid), rs) in rows {
        if rs.len() < 2 {
            continue;
        }
        let lines = rs.iter().flat_map(|r| cx.oks_at(&r.conv, r.seq)).collect();
        let w = Witness::RowsOfOneCmid {
            user: user.to_string(),
            cmid: cmid.to_string(),
            rows: rs.into_iter().cloned().collect(),
        };
        out.push(Anomaly::new(Kind::Duplicated, w, lines));
    }

    let mut answers: BTreeMap<Pair, BTreeMap<ConvSeqMid, u64>> = BTreeMap::new();
    for ok in &cx.send_oks {
        let Some(cmid) = ok.cmid else { continue };
        answers
            .entry((ok.device, cmid))
            .or_default()
            .entry((ok.conv, ok.seq, ok.mid))
            .or_insert(ok.line);
    }
    for ((device, cmid), distinct) in answers {
        if distinct.len() < 2 {
            continue;
        }
        let w = Witness::AnswersOfOneCmid {
            device: device.to_string(),
            cmid: cmid.to_string(),
            answers: distinct
                .iter()
                .map(|(&(conv, seq, mid), &line)| named(conv, seq, mid, Some(line)))
                .collect(),
        };
        out.push(Anomaly::new(
            Kind::Duplicated,
            w,
            distinct.into_values().collect(),
        ));
    }
}

/// Rule 3, `unexpected` (D2: exactly one row per send, hence none without a send): every
/// row's (sender_device, cmid) was sent by that device.
pub(super) fn unexpected(cx: &Ctx, out: &mut Findings) {
    let sent: HashSet<(&str, &str)> = cx
        .h
        .iter()
        .filter_map(|e| match &e.line {
            Line::Invoke(Invoke::Send { cmid, .. }) => Some((e.process.as_str(), cmid.as_str())),
            _ => None,
        })
        .collect();
    for r in &cx.fin.events {
        if sent.contains(&(r.sender_device.as_str(), r.cmid.as_str())) {
            continue;
        }
        let w = Witness::RowNeverSent { row: r.clone() };
        out.push(Anomaly::new(Kind::Unexpected, w, Vec::new()));
    }
}

/// Rule 4 (report only, D2's allowance): a send without a definite answer may or may not
/// have happened. Counts each (device, cmid) that never got an ok and at least once ended
/// in info (or never ended: the client died), and whether its row exists at the end.
pub(super) fn info_sends(cx: &Ctx) -> InfoSends {
    let mut by: BTreeMap<(&str, &str), (bool, bool)> = BTreeMap::new();
    for e in cx.h {
        let Line::Invoke(Invoke::Send { cmid, .. }) = &e.line else {
            continue;
        };
        let end = e
            .op_id
            .and_then(|id| cx.completions.get(&id))
            .map(|&p| cx.h[p].kind());
        let g = by.entry((&e.process, cmid.as_str())).or_default();
        match end {
            Some(Type::Ok) => g.0 = true,
            Some(Type::Fail) => {}
            _ => g.1 = true,
        }
    }
    let rows: HashSet<(&str, &str)> = cx
        .fin
        .events
        .iter()
        .map(|r| (r.sender_device.as_str(), r.cmid.as_str()))
        .collect();
    let mut r = InfoSends::default();
    for (key, (ok, unsure)) in by {
        if ok || !unsure {
            continue;
        }
        r.total += 1;
        if rows.contains(&key) {
            r.present += 1;
        } else {
            r.absent += 1;
        }
    }
    r
}

/// Rule 12, `store-mismatch` (D1/D6: what a client was given is what the database kept):
/// every event in a client's state file at the end is a row with the same mid, and a
/// device never receives (push or sync) two different mids for one (conv, seq) within one
/// epoch of the conversation (issue 21: after an `epoch` line of the device, another
/// message at a seq it had is the point of the move).
pub(super) fn store_mismatch(cx: &Ctx, out: &mut Findings) {
    let mut stored_at: HashMap<DevSeq, u64> = HashMap::new();
    let mut received: HashMap<DevSeq, Vec<(&str, u64)>> = HashMap::new();
    // The newest epoch each device received of each conversation: an event of a newer one
    // starts the conversation afresh for it, even before its client recorded the move.
    let mut epochs: HashMap<(&str, &str), i64> = HashMap::new();
    for e in cx.h {
        let device = e.process.as_str();
        match &e.line {
            Line::Store(Store::Store { conv, events, .. }) => {
                for ev in events {
                    stored_at.insert((device, conv, ev.seq), e.i);
                }
            }
            Line::Store(Store::Epoch { conv, .. }) => {
                received.retain(|k, _| !(k.0 == device && k.1 == conv));
            }
            Line::Recv(Recv::Push(_)) | Line::Ok(Done::Sync { .. }) => {
                let evs: &[EventRef] = match &e.line {
                    Line::Recv(Recv::Push(ev)) => std::slice::from_ref(ev),
                    Line::Ok(Done::Sync { events, .. }) => events,
                    _ => &[],
                };
                for ev in evs {
                    let (conv, seq, mid) = (ev.conv.as_str(), ev.seq, ev.mid.as_str());
                    if let Some(epoch) = ev.epoch {
                        let known = epochs.entry((device, conv)).or_insert(epoch);
                        if epoch > *known {
                            *known = epoch;
                            received.retain(|k, _| !(k.0 == device && k.1 == conv));
                        }
                    }
                    let mids = received.entry((device, conv, seq)).or_default();
                    if mids.iter().any(|(m, _)| *m == mid) {
                        continue;
                    }
                    if let Some(&(m0, l0)) = mids.first() {
                        let w = Witness::TwoMessagesAtOneSeq {
                            device: device.to_string(),
                            first: named(conv, seq, m0, Some(l0)),
                            second: named(conv, seq, mid, Some(e.i)),
                        };
                        out.push(Anomaly::new(Kind::StoreMismatch, w, vec![l0, e.i]));
                    }
                    mids.push((mid, e.i));
                }
            }
            _ => {}
        }
    }
    for (device, convs) in &cx.fin.stores {
        for (conv, evs) in convs {
            for ev in evs {
                let row = cx.rows.get(&(conv.as_str(), ev.seq));
                if row.is_some_and(|r| r.mid == ev.mid) {
                    continue;
                }
                let line = stored_at
                    .get(&(device.as_str(), conv.as_str(), ev.seq))
                    .copied();
                let w = Witness::StoredNotKept {
                    device: device.clone(),
                    stored: named(conv, ev.seq, &ev.mid, line),
                    row: row.map(|r| (*r).clone()),
                };
                out.push(Anomaly::new(
                    Kind::StoreMismatch,
                    w,
                    line.into_iter().collect(),
                ));
            }
        }
    }
}

/// Rule 13, `held-lost` (D1/D6, issue 21: epochs that mean something): a device that
/// received an event (push or sync) the database does not have at that seq at the end
/// (the row missing, or another mid) was told, by an epoch change of the conversation
/// that reached it afterwards (an `epoch` line of that device). An asynchronous failover
/// may lose acknowledged messages, as its configuration says; it must leave no device
/// silently holding them.
pub(super) fn held_lost(cx: &Ctx, out: &mut Findings) {
    // The last epoch line of each device and conversation.
    let mut told: HashMap<(&str, &str), u64> = HashMap::new();
    for e in cx.h {
        if let Line::Store(Store::Epoch { conv, .. }) = &e.line {
            told.insert((e.process.as_str(), conv.as_str()), e.i);
        }
    }
    let mut flagged: HashSet<(&str, &str, i64, &str)> = HashSet::new();
    for e in cx.h {
        let device = e.process.as_str();
        let evs: &[EventRef] = match &e.line {
            Line::Recv(Recv::Push(ev)) => std::slice::from_ref(ev),
            Line::Ok(Done::Sync { events, .. }) => events,
            _ => continue,
        };
        for ev in evs {
            let (conv, seq, mid) = (ev.conv.as_str(), ev.seq, ev.mid.as_str());
            let row = cx.rows.get(&(conv, seq));
            if row.is_some_and(|r| r.mid == mid)
                || told.get(&(device, conv)).is_some_and(|&t| t > e.i)
                || !flagged.insert((device, conv, seq, mid))
            {
                continue;
            }
            let w = Witness::HeldNotKept {
                device: device.to_string(),
                held: named(conv, seq, mid, Some(e.i)),
                row: row.map(|r| (*r).clone()),
            };
            out.push(Anomaly::new(Kind::HeldLost, w, vec![e.i]));
        }
    }
}
