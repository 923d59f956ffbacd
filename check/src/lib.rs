//! `im-check`, the judge: judges one scenario run from its history (`history.jsonl`, read
//! by [`history`]) and the final read of the database and of every client's state file
//! (`final.json`, the [`Final`] type here), and says which invariants (D1…D6, P1, S1) the
//! run broke, with the history lines that prove it ([`Report`]).
//!
//! A library that knows only histories, in the manner of Elle: the harness writes a history
//! and takes the final read, then calls [`check`]; `imfault-check DIR` calls [`judge_dir`]
//! on a kept run; a reader can learn the rules without learning the system that produced
//! the history. Whatever a rule must know about a fault comes in the fault's line.
//!
//! Owns: the history's line types and reader ([`history`]), the `final.json` format
//! ([`Final`], `final_read.rs`), the report format ([`Report`], [`Anomaly`], `report.rs`),
//! the verdict type of every record the project writes ([`verdict`]), the table of anomaly
//! kinds (`kinds.rs`), the witnesses that prove them (`witness.rs`) and the rules of the
//! checker contract ([`RULES`]), one small function each, one file per family:
//! `delivery.rs`, `order.rs`, `cursor.rs`, `membership.rs`, `sweep.rs`, `commit.rs`;
//! `stats.rs` counts.
//! Must not: do I/O other than reading files ([`history::read`], [`load_dir`]), speak the
//! protocol, touch the database, or depend on anything that does (its dependencies are the
//! protocol's types, serde and anyhow). [`check`] is a pure function of its two arguments,
//! so a run can be judged again, later, from its files.
//!
//! Cost: every rule is one or two walks over the history with hash maps keyed by device,
//! conversation and seq, so a history of tens of thousands of lines is judged in
//! milliseconds.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::history::{
    Action, Done, Entry, EventRef, HintWhy, Invoke, Life, Line, Nemesis, OpName, Phase, ProbeLine,
    Recv, Store, Type, Via, MALFORMED_REPLY,
};

/// Version of the `final.json` format; [`load_dir`] refuses any other.
pub const FINAL_SCHEMA_VERSION: u32 = 1;
/// Version of the report format. 2: verdict ERROR with `error`, `stats.malformed`.
pub const REPORT_SCHEMA_VERSION: u32 = 2;

/// Longest list of seqs spelled out in a message.
const LIST_MAX: usize = 10;

pub mod history;
pub mod verdict;

mod commit;
mod cursor;
mod delivery;
mod final_read;
mod kinds;
mod membership;
mod order;
mod report;
mod stats;
mod sweep;
#[cfg(test)]
mod tests;
mod witness;

pub use final_read::*;
pub use kinds::Kind;
pub use report::*;
pub use stats::nearest_rank;
pub use witness::{Named, Witness};

// ---------------------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------------------

/// Reads `DIR/history.jsonl` (through [`history::read`]) and `DIR/final.json`,
/// refusing another schema version of either.
pub fn load_dir(dir: &Path) -> anyhow::Result<(Vec<Entry>, Final)> {
    let history = crate::history::read(&dir.join("history.jsonl"))?;
    let path = dir.join("final.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    let raw: Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    let version = raw.get("schema_version").and_then(Value::as_u64);
    anyhow::ensure!(
        version == Some(u64::from(FINAL_SCHEMA_VERSION)),
        "{}: final read schema_version {version:?}, this checker reads {FINAL_SCHEMA_VERSION}",
        path.display()
    );
    let fin: Final = serde_json::from_value(raw)
        .with_context(|| format!("{}: not a final read", path.display()))?;
    Ok((history, fin))
}

/// Judges a kept run directory again ([`load_dir`], then [`check`]): a history or final
/// read that cannot be read is a report with verdict ERROR and the reason, never a pass.
pub fn judge_dir(dir: &Path) -> Report {
    match load_dir(dir) {
        Ok((history, fin)) => check(&history, &fin),
        Err(e) => Report::error(format!("{e:#}")),
    }
}

// ---------------------------------------------------------------------------------------
// Judging
// ---------------------------------------------------------------------------------------

/// One rule of the checker contract: where it lives, what it may report, and the walk
/// that finds it. [`check`] runs them in this order.
pub struct Rule {
    /// The rule's name (its function).
    pub name: &'static str,
    /// The file of `check/src/` it lives in: delivery, order, cursor, membership, sweep,
    /// commit.
    pub family: &'static str,
    /// The kinds of anomaly it may report.
    pub kinds: &'static [Kind],
    run: fn(&Ctx, &mut Findings),
}

/// The rules, in the order they run. Every kind of [`Kind::ALL`] is reported by exactly
/// one family (a test holds the table and the kinds together).
pub const RULES: &[Rule] = &[
    rule("lost", "delivery", &[Kind::Lost], delivery::lost),
    rule(
        "duplicated",
        "delivery",
        &[Kind::Duplicated],
        delivery::duplicated,
    ),
    rule(
        "unexpected",
        "delivery",
        &[Kind::Unexpected],
        delivery::unexpected,
    ),
    rule("p1_gap", "order", &[Kind::P1Gap], order::p1_gap),
    rule(
        "d3_ack_beyond_store",
        "cursor",
        &[Kind::D3AckBeyondStore],
        cursor::d3_ack_beyond_store,
    ),
    rule(
        "d3_cursor_unexplained",
        "cursor",
        &[Kind::D3CursorUnexplained],
        cursor::d3_cursor_unexplained,
    ),
    rule(
        "d4_decrease",
        "cursor",
        &[Kind::D4Decrease],
        cursor::d4_decrease,
    ),
    rule(
        "s1_outside",
        "membership",
        &[Kind::S1Outside],
        membership::s1_outside,
    ),
    rule(
        "d5_not_repaired",
        "sweep",
        &[Kind::D5NotRepaired],
        sweep::d5_not_repaired,
    ),
    rule(
        "d5_sweep_late",
        "sweep",
        &[Kind::D5SweepLate],
        sweep::d5_sweep_late,
    ),
    rule(
        "d5_locked_out",
        "sweep",
        &[Kind::D5LockedOut],
        sweep::d5_locked_out,
    ),
    rule(
        "store_mismatch",
        "delivery",
        &[Kind::StoreMismatch],
        delivery::store_mismatch,
    ),
    rule(
        "held_lost",
        "delivery",
        &[Kind::HeldLost],
        delivery::held_lost,
    ),
    rule(
        "before_commit",
        "commit",
        &[Kind::ReplyBeforeCommit, Kind::PushBeforeCommit],
        commit::before_commit,
    ),
];

const fn rule(
    name: &'static str,
    family: &'static str,
    kinds: &'static [Kind],
    run: fn(&Ctx, &mut Findings),
) -> Rule {
    Rule {
        name,
        family,
        kinds,
        run,
    }
}

/// What the rules found: the anomalies, and the sweep hint gaps for the statistics.
#[derive(Default)]
struct Findings {
    anomalies: Vec<Anomaly>,
    sweep_gaps: Vec<f64>,
    /// Sends lost as their configuration allows (issue 21): not anomalies.
    expected_loss: Vec<Witness>,
}

impl Findings {
    fn push(&mut self, a: Anomaly) {
        self.anomalies.push(a);
    }
}

/// Judges one run: the rules of the checker contract ([`RULES`]) over `history` and `fin`.
pub fn check(history: &[Entry], fin: &Final) -> Report {
    let cx = Ctx::new(history, fin);
    let mut found = Findings::default();
    for r in RULES {
        let before = found.anomalies.len();
        (r.run)(&cx, &mut found);
        debug_assert!(
            found.anomalies[before..]
                .iter()
                .all(|a| r.kinds.contains(&a.kind)),
            "rule {} reported a kind it does not declare",
            r.name
        );
    }
    let mut out = found.anomalies;
    out.sort_by(|a, b| {
        let first = |x: &Anomaly| x.entries.first().copied().unwrap_or(u64::MAX);
        (a.kind, first(a), &a.msg).cmp(&(b.kind, first(b), &b.msg))
    });
    let mut counts: BTreeMap<Kind, u64> = Kind::ALL.iter().map(|k| (*k, 0)).collect();
    for a in &out {
        *counts.entry(a.kind).or_default() += 1;
    }
    let stats = stats::stats(&cx, delivery::info_sends(&cx), found.sweep_gaps);
    Report {
        schema_version: REPORT_SCHEMA_VERSION,
        verdict: if out.is_empty() {
            Verdict::Pass
        } else {
            Verdict::Fail
        },
        anomalies: out,
        counts,
        stats,
        expected_loss: found.expected_loss,
        error: None,
    }
}

/// `1, 2, 3` with at most [`LIST_MAX`] items spelled out.
fn list(xs: &[i64]) -> String {
    let mut s = xs
        .iter()
        .take(LIST_MAX)
        .map(i64::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    if xs.len() > LIST_MAX {
        let _ = write!(s, ", … ({} more)", xs.len() - LIST_MAX);
    }
    s
}

/// (device, conv), or (device, cmid).
type Pair<'a> = (&'a str, &'a str);
/// (device, conv, seq).
type DevSeq<'a> = (&'a str, &'a str, i64);
/// (conv, seq, mid): an event as a reply, a push or a row names it.
type ConvSeqMid<'a> = (&'a str, i64, &'a str);

/// A membership period `[from, to)`, `to == None` open.
type Period = (i64, Option<i64>);

fn inside(periods: &[Period], seq: i64) -> bool {
    periods
        .iter()
        .any(|&(from, to)| from <= seq && to.is_none_or(|t| seq < t))
}

/// A message as a witness names it.
/// Issue 21: the conversations' sequence epochs a line shows its device (a `subbed`, a
/// `sent`, a push, a sync page, the client's `epoch` line).
fn epochs_in(e: &Entry) -> Vec<(&str, i64)> {
    match &e.line {
        Line::Ok(Done::Sub { convs }) => convs
            .iter()
            .filter_map(|c| c.epoch.map(|x| (c.conv.as_str(), x)))
            .collect(),
        Line::Ok(Done::Send { conv, epoch, .. }) => vec![(conv.as_str(), *epoch)],
        Line::Recv(Recv::Push(ev)) => ev
            .epoch
            .map(|x| (ev.conv.as_str(), x))
            .into_iter()
            .collect(),
        Line::Ok(Done::Sync { events, .. }) => events
            .iter()
            .filter_map(|ev| ev.epoch.map(|x| (ev.conv.as_str(), x)))
            .collect(),
        Line::Store(Store::Epoch { conv, to, .. }) => vec![(conv.as_str(), *to)],
        _ => Vec::new(),
    }
}

/// Whether the history has an asynchronous standby's promotion (issue 21): its replication
/// link was cut as its primary died, so what the standby had not received is gone, as that
/// configuration allows.
fn async_failover(h: &[Entry]) -> bool {
    h.iter().any(|e| {
        matches!(
            &e.line,
            Line::Nemesis(Nemesis {
                action: Action::ReplicationLinkCut {
                    synchronous: Some(false)
                },
                ..
            })
        )
    })
}

/// The newest epoch of each conversation anything in the history showed: what came under
/// an older one belongs to a history the database lost (a failover), and the final read
/// (heads, periods) is the new lineage's.
fn newest_epochs(h: &[Entry]) -> HashMap<&str, i64> {
    let mut newest: HashMap<&str, i64> = HashMap::new();
    for e in h {
        for (conv, x) in epochs_in(e) {
            let n = newest.entry(conv).or_insert(x);
            *n = (*n).max(x);
        }
    }
    newest
}

fn named(conv: &str, seq: i64, mid: &str, line: Option<u64>) -> Named {
    Named {
        conv: conv.to_string(),
        seq,
        mid: mid.to_string(),
        line,
    }
}

/// A send the gateway answered `sent`.
struct SendOk<'a> {
    line: u64,
    t_ms: f64,
    device: &'a str,
    /// From the invoke (None if the invoke line is missing).
    cmid: Option<&'a str>,
    conv: &'a str,
    seq: i64,
    mid: &'a str,
    /// The conversation's epoch the reply named (issue 21).
    epoch: i64,
}

/// Indexes shared by the rules, built once.
struct Ctx<'a> {
    h: &'a [Entry],
    fin: &'a Final,
    /// Line number (`Entry::i`) → position in `h`.
    pos: HashMap<u64, usize>,
    /// op_id → position of its invoke line.
    invokes: HashMap<u64, usize>,
    /// op_id → position of its completion line (ok / fail / info).
    completions: HashMap<u64, usize>,
    /// (conv, seq) → final row.
    rows: HashMap<(&'a str, i64), &'a FinalEvent>,
    /// conv → user → membership periods.
    periods: HashMap<&'a str, HashMap<&'a str, Vec<Period>>>,
    /// conv → highest seq among final rows.
    max_seq: HashMap<&'a str, i64>,
    /// Every send ok, in line order.
    send_oks: Vec<SendOk<'a>>,
    /// (conv, seq) → lines of send oks that named it.
    oks_at: HashMap<(&'a str, i64), Vec<u64>>,
}

impl<'a> Ctx<'a> {
    fn new(h: &'a [Entry], fin: &'a Final) -> Ctx<'a> {
        let mut pos = HashMap::with_capacity(h.len());
        let mut invokes = HashMap::new();
        let mut completions = HashMap::new();
        for (p, e) in h.iter().enumerate() {
            pos.insert(e.i, p);
            match (&e.line, e.op_id) {
                (Line::Invoke(_), Some(id)) => {
                    invokes.insert(id, p);
                }
                (Line::Ok(_) | Line::Fail(_) | Line::Info(_), Some(id)) => {
                    completions.entry(id).or_insert(p);
                }
                _ => {}
            }
        }
        let mut rows = HashMap::with_capacity(fin.events.len());
        let mut max_seq: HashMap<&str, i64> = HashMap::new();
        for r in &fin.events {
            rows.insert((r.conv.as_str(), r.seq), r);
            let m = max_seq.entry(r.conv.as_str()).or_insert(0);
            *m = (*m).max(r.seq);
        }
        let mut periods: HashMap<&str, HashMap<&str, Vec<Period>>> = HashMap::new();
        for m in &fin.memberships {
            periods
                .entry(m.conv.as_str())
                .or_default()
                .entry(m.user.as_str())
                .or_default()
                .push((m.from_seq, m.to_seq));
        }
        let mut cx = Ctx {
            h,
            fin,
            pos,
            invokes,
            completions,
            rows,
            periods,
            max_seq,
            send_oks: Vec::new(),
            oks_at: HashMap::new(),
        };
        for e in h {
            let Line::Ok(Done::Send {
                conv,
                seq,
                mid,
                epoch,
                ..
            }) = &e.line
            else {
                continue;
            };
            let (conv, seq, mid) = (conv.as_str(), *seq, mid.as_str());
            let cmid = cx.invoke_of(e).and_then(|inv| match &inv.line {
                Line::Invoke(Invoke::Send { cmid, .. }) => Some(cmid.as_str()),
                _ => None,
            });
            cx.oks_at.entry((conv, seq)).or_default().push(e.i);
            cx.send_oks.push(SendOk {
                line: e.i,
                t_ms: e.t_ms,
                device: &e.process,
                cmid,
                conv,
                seq,
                mid,
                epoch: *epoch,
            });
        }
        cx
    }

    fn invoke_pos(&self, completion: &Entry) -> Option<usize> {
        self.invokes.get(&completion.op_id?).copied()
    }

    fn invoke_of(&self, completion: &Entry) -> Option<&'a Entry> {
        self.invoke_pos(completion).map(|p| &self.h[p])
    }

    fn line(&self, i: u64) -> Option<&'a Entry> {
        self.pos.get(&i).map(|&p| &self.h[p])
    }

    /// The final head of `conv` (from `heads`; else its highest row; else 0).
    fn head(&self, conv: &str) -> i64 {
        self.fin
            .heads
            .get(conv)
            .copied()
            .or_else(|| self.max_seq.get(conv).copied())
            .unwrap_or(0)
    }

    fn user(&self, device: &str) -> Option<&'a str> {
        self.fin.devices.get(device).map(String::as_str)
    }

    /// The membership periods of `device`'s user in `conv`; None when the final read does
    /// not know the device.
    fn periods_of(&self, device: &str, conv: &str) -> Option<&[Period]> {
        let user = self.user(device)?;
        Some(
            self.periods
                .get(conv)
                .and_then(|by_user| by_user.get(user))
                .map(Vec::as_slice)
                .unwrap_or(&[]),
        )
    }

    fn oks_at(&self, conv: &str, seq: i64) -> Vec<u64> {
        self.oks_at.get(&(conv, seq)).cloned().unwrap_or_default()
    }
}
