//! What proves an anomaly, as data: the conversation, seqs, devices, mids, history lines
//! and database rows involved, one shape per way an invariant breaks. The anomaly's
//! one-sentence explanation is generated from it ([`Witness::explain`]), so reports and
//! controls read the witness and the sentence can never say something the data does not.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::{list, CursorWrite, FinalEvent};

/// A message as a `sent` reply, a push or a row names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Named {
    pub conv: String,
    pub seq: i64,
    pub mid: String,
    /// The history line that named it.
    pub line: Option<u64>,
}

/// The proof of one anomaly.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "shape", rename_all = "kebab-case")]
pub enum Witness {
    /// `lost`: devices got `sent` for a message whose row is missing (`row` null) or holds
    /// another message.
    SentNotKept {
        devices: Vec<String>,
        sent: Named,
        row: Option<FinalEvent>,
    },
    /// `duplicated`: rows sharing one (sender user, cmid).
    RowsOfOneCmid {
        user: String,
        cmid: String,
        rows: Vec<FinalEvent>,
    },
    /// `duplicated`: one device's cmid answered `sent` with different messages.
    AnswersOfOneCmid {
        device: String,
        cmid: String,
        answers: Vec<Named>,
    },
    /// `unexpected`: a row no send of its device carried.
    RowNeverSent { row: FinalEvent },
    /// `p1-gap`: a conversation's rows are not exactly 1..=head.
    SeqGap {
        conv: String,
        head: i64,
        missing: Vec<i64>,
        extra: Vec<i64>,
    },
    /// `d3-ack-beyond-store`: an ack above what the device had stored contiguously.
    AckBeyondStore {
        device: String,
        conv: String,
        seq: i64,
        stored_through: i64,
        line: u64,
    },
    /// `d3-cursor-unexplained`: a cursor write no earlier ack of that seq explains.
    CursorUnexplained {
        write: CursorWrite,
        /// The device's first ack of that seq, if any (line, microseconds after the write).
        first_ack: Option<(u64, i64)>,
    },
    /// `d4-decrease`: a cursor written down.
    CursorWrittenDown { write: CursorWrite },
    /// `d4-decrease`: a device told a lower `delivered` than it had received before.
    DeliveredDecreased {
        device: String,
        conv: String,
        op: String,
        delivered: i64,
        invoked_line: u64,
        answered_line: u64,
        earlier: i64,
        earlier_line: u64,
    },
    /// `d4-decrease`: a final cursor outside 0..=head.
    CursorOutsideHead {
        device: String,
        conv: String,
        delivered: i64,
        head: i64,
    },
    /// `s1-outside`: events received (pushed, in a sync page, or named by a hint's head)
    /// outside the user's membership periods.
    OutsidePeriods {
        device: String,
        user: String,
        conv: String,
        seqs: Vec<i64>,
        how: String,
        line: u64,
        /// `[from, to)`, `to` null for an open period.
        periods: Vec<(i64, Option<i64>)>,
    },
    /// `d5-not-repaired`: a live device still lacks visible events after the wait.
    NotRepaired {
        device: String,
        conv: String,
        seqs: Vec<i64>,
        waited_ms: u64,
        bound_ms: u64,
    },
    /// `d5-sweep-late`: two consecutive sweep hints too far apart.
    SweepGap {
        device: String,
        conv: String,
        lines: (u64, u64),
        gap_ms: u64,
        sweep_ms: u64,
        allowed_ms: u64,
    },
    /// `d5-sweep-late`: the median gap between sweep hints too long.
    SweepMedian {
        device: String,
        conv: String,
        median_ms: u64,
        gaps: usize,
        sweep_ms: u64,
    },
    /// `store-mismatch`: one device received two messages for one (conv, seq).
    TwoMessagesAtOneSeq {
        device: String,
        first: Named,
        second: Named,
    },
    /// `store-mismatch`: a state file holds a message the database does not (`row` null:
    /// no row at that seq).
    StoredNotKept {
        device: String,
        stored: Named,
        row: Option<FinalEvent>,
    },
    /// `held-lost`: a device received a message the database does not have at that seq at
    /// the end (`row` null: no row), and no epoch change of the conversation reached it
    /// afterwards.
    HeldNotKept {
        device: String,
        held: Named,
        row: Option<FinalEvent>,
    },
    /// `d5-locked-out`: a hello refused over the failed-hello limit with no refused hello
    /// before it.
    LockedOut { device: String, line: u64 },
    /// `reply-before-commit` / `push-before-commit`: a probe right after the reply or push
    /// did not find the message.
    NotVisible {
        device: String,
        /// `sent reply` or `push`.
        what: String,
        expected: Named,
        found_mid: Option<String>,
        probe_line: u64,
    },
}

fn periods_text(periods: &[(i64, Option<i64>)]) -> String {
    if periods.is_empty() {
        return "none".into();
    }
    periods
        .iter()
        .map(|(f, t)| match t {
            Some(t) => format!("[{f}, {t})"),
            None => format!("[{f}, ∞)"),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// What the final read has where a device holds a message.
fn row_text(row: &Option<FinalEvent>) -> String {
    match row {
        Some(r) => format!("the row has mid {}", r.mid),
        None => "the final read has no such row".to_string(),
    }
}

fn sent_not_kept(devices: &[String], sent: &Named, row: &Option<FinalEvent>) -> String {
    let Named {
        conv,
        seq,
        mid,
        line,
    } = sent;
    let who = devices.join(", ");
    let first = line.unwrap_or_default();
    match row {
        Some(r) => format!(
            "{who} got sent {conv}:{seq} (mid {mid}, line {first}) but row {conv}:{seq} has mid {}",
            r.mid
        ),
        None => format!(
            "{who} got sent {conv}:{seq} (mid {mid}, line {first}) but the final read has no row {conv}:{seq}"
        ),
    }
}

fn rows_of_one_cmid(user: &str, cmid: &str, rows: &[FinalEvent]) -> String {
    let names: Vec<String> = rows
        .iter()
        .map(|r| format!("{}:{} (mid {})", r.conv, r.seq, r.mid))
        .collect();
    format!(
        "{} rows for (sender {user}, cmid {cmid}): {}",
        rows.len(),
        names.join(", ")
    )
}

fn answers_of_one_cmid(device: &str, cmid: &str, answers: &[Named]) -> String {
    let names: Vec<String> = answers
        .iter()
        .map(|a| {
            let line = a.line.unwrap_or_default();
            format!("{}:{} (mid {}, line {line})", a.conv, a.seq, a.mid)
        })
        .collect();
    format!(
        "{device}'s cmid {cmid} was answered sent with {}",
        names.join(" and ")
    )
}

fn seq_gap(conv: &str, head: i64, missing: &[i64], extra: &[i64]) -> String {
    let mut msg = format!("{conv} has head {head} but");
    if !missing.is_empty() {
        let _ = write!(msg, " no rows for seqs {}", list(missing));
    }
    if !extra.is_empty() {
        if !missing.is_empty() {
            msg.push_str(" and");
        }
        let _ = write!(msg, " rows outside 1..={head}: {}", list(extra));
    }
    msg
}

fn cursor_unexplained(w: &CursorWrite, first_ack: Option<(u64, i64)>) -> String {
    let old = w.old.map_or("none".to_string(), |o| o.to_string());
    let mut msg = format!(
        "cursor of {} in {} moved {old} -> {} at wall_us {} with no earlier ack of {} by {}",
        w.device, w.conv, w.new, w.wall_us, w.new, w.device
    );
    if let Some((i, later)) = first_ack {
        let _ = write!(
            msg,
            " (its first ack of {} is line {i}, {later} us later)",
            w.new
        );
    }
    msg
}

impl Witness {
    /// The one-sentence explanation (the anomaly's `msg`): one sentence per shape, each
    /// written by the function named after it.
    pub fn explain(&self) -> String {
        match self {
            Witness::SentNotKept { devices, sent, row } => sent_not_kept(devices, sent, row),
            Witness::RowsOfOneCmid { user, cmid, rows } => rows_of_one_cmid(user, cmid, rows),
            Witness::AnswersOfOneCmid {
                device,
                cmid,
                answers,
            } => answers_of_one_cmid(device, cmid, answers),
            Witness::RowNeverSent { row: r } => format!(
                "row {}:{} (mid {}, sender {}/{}, cmid {}) was never sent by {}",
                r.conv, r.seq, r.mid, r.sender_user, r.sender_device, r.cmid, r.sender_device
            ),
            Witness::SeqGap {
                conv,
                head,
                missing,
                extra,
            } => seq_gap(conv, *head, missing, extra),
            Witness::AckBeyondStore {
                device,
                conv,
                seq,
                stored_through: through,
                line,
            } => format!(
                "{device} acked {conv}:{seq} while it had stored contiguously only through {through}, not {conv}:{} (line {line})",
                through + 1
            ),
            Witness::CursorUnexplained { write, first_ack } => {
                cursor_unexplained(write, *first_ack)
            }
            Witness::CursorWrittenDown { write: w } => format!(
                "cursor of {} in {} was written down from {} to {} at wall_us {}",
                w.device,
                w.conv,
                w.old.unwrap_or_default(),
                w.new,
                w.wall_us
            ),
            Witness::DeliveredDecreased {
                device,
                conv,
                op,
                delivered,
                invoked_line,
                answered_line,
                earlier,
                earlier_line,
            } => format!(
                "{device} got delivered {delivered} for {conv} from {op} (invoked line {invoked_line}, answered line {answered_line}) after it had received delivered {earlier} (line {earlier_line})"
            ),
            Witness::CursorOutsideHead {
                device,
                conv,
                delivered,
                head,
            } => format!(
                "final cursor of {device} in {conv} is {delivered}, outside 0..={head} (head)"
            ),
            w @ (Witness::OutsidePeriods { .. }
            | Witness::NotRepaired { .. }
            | Witness::SweepGap { .. }
            | Witness::SweepMedian { .. }) => w.explain_delivery(),
            Witness::LockedOut { device, line } => format!(
                "{device}'s hello at line {line} was refused as over the failed-hello limit, \
                 yet no hello of any device before it was refused UNAUTHENTICATED or \
                 STALE_INSTALL"
            ),
            w @ (Witness::TwoMessagesAtOneSeq { .. }
            | Witness::HeldNotKept { .. }
            | Witness::StoredNotKept { .. }
            | Witness::NotVisible { .. }) => w.explain_held(),
        }
    }

    /// [`Witness::explain`] of what a device was delivered and when (S1, D5).
    fn explain_delivery(&self) -> String {
        match self {
            Witness::OutsidePeriods {
                device,
                user,
                conv,
                seqs,
                how,
                line,
                periods,
            } if how == "hint" => format!(
                "{device} ({user}) was hinted at {conv} head {} at line {line}, outside {user}'s periods of {conv}: {}",
                list(seqs),
                periods_text(periods)
            ),
            Witness::OutsidePeriods {
                device,
                user,
                conv,
                seqs,
                how,
                line,
                periods,
            } => format!(
                "{device} ({user}) received {conv} seqs {} by {how} at line {line}, outside {user}'s periods of {conv}: {}",
                list(seqs),
                periods_text(periods)
            ),
            Witness::NotRepaired {
                device,
                conv,
                seqs,
                waited_ms,
                bound_ms,
            } => format!(
                "{device} still misses {conv} seqs {} after the judge waited {waited_ms} ms (bound {bound_ms} ms)",
                list(seqs)
            ),
            Witness::SweepGap {
                device,
                conv,
                lines: (a, b),
                gap_ms,
                sweep_ms,
                allowed_ms,
            } => format!(
                "{device} got sweep hints for {conv} at lines {a} and {b} {gap_ms} ms apart (sweep_ms {sweep_ms}, allowed {allowed_ms} ms)"
            ),
            Witness::SweepMedian {
                device,
                conv,
                median_ms,
                gaps,
                sweep_ms,
            } => format!(
                "{device}'s sweep hints for {conv} came every {median_ms} ms (median of {gaps} gaps), over {} × sweep_ms {sweep_ms}",
                super::sweep::SWEEP_MEDIAN_FACTOR
            ),
            other => unreachable!("not a delivery witness: {other:?}"),
        }
    }

    /// [`Witness::explain`] of what a device holds against the database (the store and
    /// the probes).
    fn explain_held(&self) -> String {
        match self {
            Witness::TwoMessagesAtOneSeq {
                device,
                first,
                second,
            } => format!(
                "{device} received {}:{} as mid {} (line {}) and as mid {} (line {})",
                first.conv,
                first.seq,
                first.mid,
                first.line.unwrap_or_default(),
                second.mid,
                second.line.unwrap_or_default()
            ),
            Witness::HeldNotKept { device, held, row } => format!(
                "{device} received {}:{} = mid {} (line {}) but {}, and no epoch change of {} \
                 reached it afterwards",
                held.conv,
                held.seq,
                held.mid,
                held.line.unwrap_or_default(),
                row_text(row),
                held.conv
            ),
            Witness::StoredNotKept {
                device,
                stored,
                row,
            } => {
                let when = stored
                    .line
                    .map_or(String::new(), |l| format!(" (stored at line {l})"));
                format!(
                    "{device}'s state file holds {}:{} = mid {}{when} but {}",
                    stored.conv,
                    stored.seq,
                    stored.mid,
                    row_text(row)
                )
            }
            Witness::NotVisible {
                device,
                what,
                expected,
                found_mid,
                probe_line,
            } => {
                let found = found_mid
                    .as_ref()
                    .map_or("no row".to_string(), |m| format!("mid {m}"));
                format!(
                    "{device}'s {what} {}:{} (mid {}, line {}) was not visible to another session: found {found} (probe line {probe_line})",
                    expected.conv,
                    expected.seq,
                    expected.mid,
                    expected.line.unwrap_or_default()
                )
            }
            other => unreachable!("not a witness of what a device holds: {other:?}"),
        }
    }

    /// The conversation the anomaly is about, when it is about one.
    pub fn conv(&self) -> Option<&str> {
        match self {
            Witness::SentNotKept { sent: n, .. }
            | Witness::TwoMessagesAtOneSeq { first: n, .. }
            | Witness::StoredNotKept { stored: n, .. }
            | Witness::HeldNotKept { held: n, .. }
            | Witness::NotVisible { expected: n, .. } => Some(&n.conv),
            Witness::RowNeverSent { row } => Some(&row.conv),
            Witness::CursorUnexplained { write, .. } | Witness::CursorWrittenDown { write } => {
                Some(&write.conv)
            }
            Witness::SeqGap { conv, .. }
            | Witness::AckBeyondStore { conv, .. }
            | Witness::DeliveredDecreased { conv, .. }
            | Witness::CursorOutsideHead { conv, .. }
            | Witness::OutsidePeriods { conv, .. }
            | Witness::NotRepaired { conv, .. }
            | Witness::SweepGap { conv, .. }
            | Witness::SweepMedian { conv, .. } => Some(conv),
            Witness::RowsOfOneCmid { rows, .. } => rows.first().map(|r| r.conv.as_str()),
            Witness::LockedOut { .. } => None,
            Witness::AnswersOfOneCmid { answers, .. } => answers.first().map(|a| a.conv.as_str()),
        }
    }

    /// The device the anomaly is about, when it is about one.
    pub fn device(&self) -> Option<&str> {
        match self {
            Witness::AnswersOfOneCmid { device, .. }
            | Witness::AckBeyondStore { device, .. }
            | Witness::DeliveredDecreased { device, .. }
            | Witness::CursorOutsideHead { device, .. }
            | Witness::OutsidePeriods { device, .. }
            | Witness::NotRepaired { device, .. }
            | Witness::SweepGap { device, .. }
            | Witness::SweepMedian { device, .. }
            | Witness::TwoMessagesAtOneSeq { device, .. }
            | Witness::StoredNotKept { device, .. }
            | Witness::HeldNotKept { device, .. }
            | Witness::NotVisible { device, .. }
            | Witness::LockedOut { device, .. } => Some(device),
            Witness::CursorUnexplained { write, .. } | Witness::CursorWrittenDown { write } => {
                Some(&write.device)
            }
            Witness::SentNotKept { devices, .. } => devices.first().map(String::as_str),
            Witness::RowNeverSent { row } => Some(&row.sender_device),
            Witness::RowsOfOneCmid { .. } | Witness::SeqGap { .. } => None,
        }
    }
}
