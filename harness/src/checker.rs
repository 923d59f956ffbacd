//! The checker: judges one scenario run from its history (`history.jsonl`, written by
//! [`crate::history`]) and the final read of the database and of every client's state file
//! (`final.json`, the [`Final`] type here), and says which invariants (D1…D6, P1, S1) the
//! run broke, with the history lines that prove it ([`Report`]).
//!
//! Owns: the `final.json` format ([`Final`]), the report format ([`Report`], [`Anomaly`],
//! [`Kind`]) and the thirteen rules of the checker contract, one small function each.
//! Must not: do I/O other than [`load_dir`], speak the protocol (`crate::client` does), or
//! touch the database (the judge that takes the final read does). [`check`] is a pure
//! function of its two arguments, so a run can be judged again, later, from its files.
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
    Action, Done, Entry, EventRef, HintWhy, Invoke, Life, Line, Nemesis, Phase, ProbeLine, Recv,
    Store, Type, Via, MALFORMED_REPLY,
};
use crate::nemesis::schedule::FaultKind;
use crate::util::nearest_rank;

/// Version of the `final.json` format; [`load_dir`] refuses any other.
pub const FINAL_SCHEMA_VERSION: u32 = 1;
/// Version of the report format. 2: verdict ERROR with `error`, `stats.malformed`.
pub const REPORT_SCHEMA_VERSION: u32 = 2;

/// Slack added to the sweep interval before a gap between two sweep hints is late (D5).
const SWEEP_SLACK_MS: f64 = 1000.0;
/// A device's median gap between sweep hints may not exceed this many sweep intervals.
const SWEEP_MEDIAN_FACTOR: f64 = 1.5;
/// The median rule needs at least this many gaps of one device and conversation.
const SWEEP_MEDIAN_MIN_GAPS: usize = 3;
/// Longest list of seqs spelled out in a message.
const LIST_MAX: usize = 10;

// ---------------------------------------------------------------------------------------
// final.json
// ---------------------------------------------------------------------------------------

/// The final read (`final.json`), taken by the judge at the end of a scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Final {
    /// [`FINAL_SCHEMA_VERSION`].
    pub schema_version: u32,
    /// When the read was taken, on the history's monotonic clock (`Entry::t_ms`).
    pub t_ms: f64,
    /// When the read was taken, real-time clock (`Entry::wall_us`).
    pub wall_us: i64,
    /// `IM_SWEEP_MS` of the last gateway (fallback for D5 when no `gateway-start` precedes).
    pub sweep_ms: u64,
    /// Every row of `events`.
    pub events: Vec<FinalEvent>,
    /// conv → head (`next_seq - 1`).
    pub heads: BTreeMap<String, i64>,
    /// Every membership period.
    pub memberships: Vec<Membership>,
    /// device → user.
    pub devices: BTreeMap<String, String>,
    /// Every row of `device_cursors`.
    pub cursors: Vec<FinalCursor>,
    /// Every write of `device_cursors` over the run, in commit order.
    pub cursor_audit: Vec<CursorWrite>,
    /// device → conv → the events in that client's state file at the end.
    pub stores: BTreeMap<String, BTreeMap<String, Vec<StoredEvent>>>,
    /// Devices whose client is connected and subscribed at the end.
    pub live: Vec<String>,
    /// The D5 wait at the end: what live devices still missed after waiting.
    pub liveness: Liveness,
}

/// One row of `events`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FinalEvent {
    pub conv: String,
    pub seq: i64,
    pub mid: String,
    pub sender_user: String,
    pub sender_device: String,
    pub cmid: String,
}

/// A membership period: `seq` is visible to `user` iff `from_seq <= seq` and
/// (`to_seq` is null or `seq < to_seq`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Membership {
    pub conv: String,
    pub user: String,
    pub from_seq: i64,
    pub to_seq: Option<i64>,
}

/// One row of `device_cursors` at the end.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FinalCursor {
    pub device: String,
    pub conv: String,
    pub delivered: i64,
}

/// One write of `device_cursors` (`old` is null when the row was created).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CursorWrite {
    pub device: String,
    pub conv: String,
    pub old: Option<i64>,
    pub new: i64,
    /// Commit time of the write, same clock as `Entry::wall_us`.
    pub wall_us: i64,
}

/// One event of a client's state file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredEvent {
    pub seq: i64,
    pub mid: String,
}

/// The D5 wait at the end of a scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Liveness {
    /// How long a live device may take to repair a lost push.
    pub bound_ms: u64,
    /// How long the judge actually waited.
    pub waited_ms: f64,
    /// device → conv → visible seqs still not in that device's state file.
    pub missing: BTreeMap<String, BTreeMap<String, Vec<i64>>>,
}

// ---------------------------------------------------------------------------------------
// The report
// ---------------------------------------------------------------------------------------

/// What an anomaly is. Serialised as the kebab-case names of the checker contract; the
/// declaration order is the report's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Kind {
    #[serde(rename = "lost")]
    Lost,
    #[serde(rename = "duplicated")]
    Duplicated,
    #[serde(rename = "unexpected")]
    Unexpected,
    #[serde(rename = "p1-gap")]
    P1Gap,
    #[serde(rename = "d3-ack-beyond-store")]
    D3AckBeyondStore,
    #[serde(rename = "d3-cursor-unexplained")]
    D3CursorUnexplained,
    #[serde(rename = "d4-decrease")]
    D4Decrease,
    #[serde(rename = "s1-outside")]
    S1Outside,
    #[serde(rename = "d5-not-repaired")]
    D5NotRepaired,
    #[serde(rename = "d5-sweep-late")]
    D5SweepLate,
    #[serde(rename = "store-mismatch")]
    StoreMismatch,
    #[serde(rename = "reply-before-commit")]
    ReplyBeforeCommit,
    #[serde(rename = "push-before-commit")]
    PushBeforeCommit,
}

impl Kind {
    /// Every kind, in report order.
    pub const ALL: [Kind; 13] = [
        Kind::Lost,
        Kind::Duplicated,
        Kind::Unexpected,
        Kind::P1Gap,
        Kind::D3AckBeyondStore,
        Kind::D3CursorUnexplained,
        Kind::D4Decrease,
        Kind::S1Outside,
        Kind::D5NotRepaired,
        Kind::D5SweepLate,
        Kind::StoreMismatch,
        Kind::ReplyBeforeCommit,
        Kind::PushBeforeCommit,
    ];

    /// The name in the report (same as the serialised form).
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Lost => "lost",
            Kind::Duplicated => "duplicated",
            Kind::Unexpected => "unexpected",
            Kind::P1Gap => "p1-gap",
            Kind::D3AckBeyondStore => "d3-ack-beyond-store",
            Kind::D3CursorUnexplained => "d3-cursor-unexplained",
            Kind::D4Decrease => "d4-decrease",
            Kind::S1Outside => "s1-outside",
            Kind::D5NotRepaired => "d5-not-repaired",
            Kind::D5SweepLate => "d5-sweep-late",
            Kind::StoreMismatch => "store-mismatch",
            Kind::ReplyBeforeCommit => "reply-before-commit",
            Kind::PushBeforeCommit => "push-before-commit",
        }
    }

    /// The invariant of SPEC section 1 this kind of anomaly breaks.
    pub fn invariant(self) -> &'static str {
        match self {
            Kind::Lost | Kind::StoreMismatch => "D1/D6",
            Kind::Duplicated | Kind::Unexpected => "D2",
            Kind::P1Gap => "P1",
            Kind::D3AckBeyondStore | Kind::D3CursorUnexplained => "D3",
            Kind::D4Decrease => "D4",
            Kind::S1Outside => "S1",
            Kind::D5NotRepaired | Kind::D5SweepLate => "D5",
            Kind::ReplyBeforeCommit | Kind::PushBeforeCommit => "D1",
        }
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One broken invariant, with the history lines that prove it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Anomaly {
    pub kind: Kind,
    /// The invariant broken ([`Kind::invariant`]).
    pub invariant: String,
    /// What happened, concretely (devices, conv:seq, mids, line numbers).
    pub msg: String,
    /// The history lines (`Entry::i`) that prove it, ascending; empty when only the final
    /// read proves it.
    pub entries: Vec<u64>,
}

impl Anomaly {
    fn new(kind: Kind, msg: String, mut entries: Vec<u64>) -> Anomaly {
        entries.sort_unstable();
        entries.dedup();
        Anomaly {
            kind,
            invariant: kind.invariant().to_string(),
            msg,
            entries,
        }
    }
}

/// PASS iff there is no anomaly; ERROR when the run could not be judged (its history
/// does not parse, a line could not be written).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verdict {
    #[serde(rename = "PASS")]
    Pass,
    #[serde(rename = "FAIL")]
    Fail,
    #[serde(rename = "ERROR")]
    Error,
}

/// The checker's judgement of one run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// [`REPORT_SCHEMA_VERSION`].
    pub schema_version: u32,
    pub verdict: Verdict,
    /// Ordered by kind ([`Kind::ALL`] order), then first entry (final-read-only last),
    /// then message.
    pub anomalies: Vec<Anomaly>,
    /// Every kind with its count, 0 included, so a reader sees what was checked.
    pub counts: BTreeMap<Kind, u64>,
    pub stats: Stats,
    /// Why the run could not be judged (verdict ERROR).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Report {
    /// One line: `PASS, 0 anomalies over N entries` or `FAIL: k anomalies: kind=n, ...`.
    /// The report of a run that could not be judged: verdict ERROR, nothing counted.
    pub fn error(why: String) -> Report {
        Report {
            schema_version: REPORT_SCHEMA_VERSION,
            verdict: Verdict::Error,
            anomalies: Vec::new(),
            counts: BTreeMap::new(),
            stats: Stats::default(),
            error: Some(why),
        }
    }

    pub fn summary(&self) -> String {
        if let Some(why) = &self.error {
            return format!("ERROR: the run could not be judged: {why}");
        }
        if self.verdict == Verdict::Pass {
            return format!("PASS, 0 anomalies over {} entries", self.stats.entries);
        }
        let kinds: Vec<String> = self
            .counts
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(k, n)| format!("{k}={n}"))
            .collect();
        format!(
            "FAIL: {} anomalies: {}",
            self.anomalies.len(),
            kinds.join(", ")
        )
    }
}

/// Numbers about the run (not judgements).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// History lines.
    pub entries: u64,
    /// Client operation → how its lines ended.
    pub ops: BTreeMap<String, OpCounts>,
    /// `recv push` lines.
    pub pushes: u64,
    /// `recv hint` lines.
    pub hints: u64,
    /// `store` lines.
    pub stores: u64,
    pub info_sends: InfoSends,
    /// Ack invokes with `explicit: true` (skipped by `d3-ack-beyond-store`).
    pub explicit_acks: u64,
    /// Pushes (`recv malformed`) and replies (`info` with `why: malformed-reply`) the
    /// clients could not read.
    pub malformed: u64,
    pub probes: ProbeCounts,
    /// Per (device, conv, seq) with a send ok: first store line of that device holding the
    /// seq minus the (first) send ok line, `t_ms`. Negative when the recipient stored it
    /// before the sender read its reply.
    pub delivery_ms: Quantiles,
    /// The same, only where that first store line came from a sync (a repair).
    pub repair_ms: Quantiles,
    /// Gaps between consecutive sweep hints (see `d5-sweep-late`).
    pub sweep_hint_gaps_ms: GapQuantiles,
}

/// Lines of one client operation, by type.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpCounts {
    pub invoke: u64,
    pub ok: u64,
    pub fail: u64,
    pub info: u64,
}

/// Sends (device, cmid) that never got an ok, and at least once no definite answer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InfoSends {
    pub total: u64,
    /// A row with that (sender_device, cmid) is in the final read: the send happened.
    pub present: u64,
    /// No such row: the send did not happen (allowed: no reply promised anything).
    pub absent: u64,
}

/// D1 probes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeCounts {
    pub total: u64,
    /// Probes that read the expected mid.
    pub visible: u64,
    /// Probes that could not read (database down); ignored.
    pub errors: u64,
}

/// Nearest-rank quantiles in milliseconds; null when `n == 0`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Quantiles {
    pub n: u64,
    pub p50: Option<f64>,
    pub p95: Option<f64>,
    pub max: Option<f64>,
}

/// Nearest-rank median and maximum in milliseconds; null when `n == 0`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GapQuantiles {
    pub n: u64,
    pub p50: Option<f64>,
    pub max: Option<f64>,
}

fn sorted(mut xs: Vec<f64>) -> Vec<f64> {
    xs.sort_by(f64::total_cmp);
    xs
}

fn quantiles(xs: Vec<f64>) -> Quantiles {
    let xs = sorted(xs);
    Quantiles {
        n: xs.len() as u64,
        p50: nearest_rank(&xs, 0.50),
        p95: nearest_rank(&xs, 0.95),
        max: xs.last().copied(),
    }
}

// ---------------------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------------------

/// Reads `DIR/history.jsonl` (through [`crate::history::read`]) and `DIR/final.json`,
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

/// Judges one run: the thirteen rules of the checker contract over `history` and `fin`.
pub fn check(history: &[Entry], fin: &Final) -> Report {
    let cx = Ctx::new(history, fin);
    let mut out = Vec::new();
    lost(&cx, &mut out);
    duplicated(&cx, &mut out);
    unexpected(&cx, &mut out);
    let info_sends = info_sends(&cx);
    p1_gap(&cx, &mut out);
    d3_ack_beyond_store(&cx, &mut out);
    d3_cursor_unexplained(&cx, &mut out);
    d4_decrease(&cx, &mut out);
    s1_outside(&cx, &mut out);
    d5_not_repaired(&cx, &mut out);
    let gaps = d5_sweep_late(&cx, &mut out);
    store_mismatch(&cx, &mut out);
    before_commit(&cx, &mut out);

    out.sort_by(|a, b| {
        let first = |x: &Anomaly| x.entries.first().copied().unwrap_or(u64::MAX);
        (a.kind, first(a), &a.msg).cmp(&(b.kind, first(b), &b.msg))
    });
    let mut counts: BTreeMap<Kind, u64> = Kind::ALL.iter().map(|k| (*k, 0)).collect();
    for a in &out {
        *counts.entry(a.kind).or_default() += 1;
    }
    let stats = stats(&cx, info_sends, gaps);
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
type Named<'a> = (&'a str, i64, &'a str);

/// A membership period `[from, to)`, `to == None` open.
type Period = (i64, Option<i64>);

fn inside(periods: &[Period], seq: i64) -> bool {
    periods
        .iter()
        .any(|&(from, to)| from <= seq && to.is_none_or(|t| seq < t))
}

fn periods_text(periods: &[Period]) -> String {
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
            let Line::Ok(Done::Send { conv, seq, mid, .. }) = &e.line else {
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

/// Rule 1, `lost` (D1/D6): every `sent` reply names a row that exists at the end with the
/// same mid: an acknowledged message survives every crash.
fn lost(cx: &Ctx, out: &mut Vec<Anomaly>) {
    let mut by: BTreeMap<Named, (Vec<u64>, BTreeSet<&str>)> = BTreeMap::new();
    for ok in &cx.send_oks {
        let g = by.entry((ok.conv, ok.seq, ok.mid)).or_default();
        g.0.push(ok.line);
        g.1.insert(ok.device);
    }
    for ((conv, seq, mid), (lines, devices)) in by {
        let who = devices.into_iter().collect::<Vec<_>>().join(", ");
        let first = lines[0];
        let msg = match cx.rows.get(&(conv, seq)) {
            Some(r) if r.mid == mid => continue,
            Some(r) => format!(
                "{who} got sent {conv}:{seq} (mid {mid}, line {first}) but row {conv}:{seq} has mid {}",
                r.mid
            ),
            None => format!(
                "{who} got sent {conv}:{seq} (mid {mid}, line {first}) but the final read has no row {conv}:{seq}"
            ),
        };
        out.push(Anomaly::new(Kind::Lost, msg, lines));
    }
}

/// Rule 2, `duplicated` (D2): one row per (sender_user, cmid), and one device's cmid is
/// always answered with the same seq and mid (a resend answers `dup:true` with the
/// original).
fn duplicated(cx: &Ctx, out: &mut Vec<Anomaly>) {
    let mut rows: BTreeMap<(&str, &str), Vec<&FinalEvent>> = BTreeMap::new();
    for r in &cx.fin.events {
        rows.entry((&r.sender_user, &r.cmid)).or_default().push(r);
    }
    for ((user, cmid), rs) in rows {
        if rs.len() < 2 {
            continue;
        }
        let names: Vec<String> = rs
            .iter()
            .map(|r| format!("{}:{} (mid {})", r.conv, r.seq, r.mid))
            .collect();
        let lines = rs.iter().flat_map(|r| cx.oks_at(&r.conv, r.seq)).collect();
        let msg = format!(
            "{} rows for (sender {user}, cmid {cmid}): {}",
            rs.len(),
            names.join(", ")
        );
        out.push(Anomaly::new(Kind::Duplicated, msg, lines));
    }

    let mut answers: BTreeMap<Pair, BTreeMap<Named, u64>> = BTreeMap::new();
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
        let names: Vec<String> = distinct
            .iter()
            .map(|((conv, seq, mid), line)| format!("{conv}:{seq} (mid {mid}, line {line})"))
            .collect();
        let msg = format!(
            "{device}'s cmid {cmid} was answered sent with {}",
            names.join(" and ")
        );
        out.push(Anomaly::new(
            Kind::Duplicated,
            msg,
            distinct.into_values().collect(),
        ));
    }
}

/// Rule 3, `unexpected` (D2: exactly one row per send, hence none without a send): every
/// row's (sender_device, cmid) was sent by that device.
fn unexpected(cx: &Ctx, out: &mut Vec<Anomaly>) {
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
        let msg = format!(
            "row {}:{} (mid {}, sender {}/{}, cmid {}) was never sent by {}",
            r.conv, r.seq, r.mid, r.sender_user, r.sender_device, r.cmid, r.sender_device
        );
        out.push(Anomaly::new(Kind::Unexpected, msg, Vec::new()));
    }
}

/// Rule 4 (report only, D2's allowance): a send without a definite answer may or may not
/// have happened. Counts each (device, cmid) that never got an ok and at least once ended
/// in info (or never ended: the client died), and whether its row exists at the end.
fn info_sends(cx: &Ctx) -> InfoSends {
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

/// Rule 5, `p1-gap` (P1): the rows of every conversation are exactly seqs `1..=head`.
fn p1_gap(cx: &Ctx, out: &mut Vec<Anomaly>) {
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
        let mut msg = format!("{conv} has head {head} but");
        if !missing.is_empty() {
            let _ = write!(msg, " no rows for seqs {}", list(&missing));
        }
        if !extra.is_empty() {
            if !missing.is_empty() {
                msg.push_str(" and");
            }
            let _ = write!(msg, " rows outside 1..={head}: {}", list(&extra));
        }
        out.push(Anomaly::new(Kind::P1Gap, msg, Vec::new()));
    }
}

/// What one device has persisted of one conversation, and how far that is contiguous.
struct Persisted<'a> {
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
fn d3_ack_beyond_store(cx: &Ctx, out: &mut Vec<Anomaly>) {
    let mut st: HashMap<Pair, Persisted> = HashMap::new();
    let persisted = |device, conv| Persisted {
        seqs: HashSet::new(),
        through: 0,
        periods: cx.periods_of(device, conv),
    };
    for e in cx.h {
        let device = e.process.as_str();
        match &e.line {
            Line::Store(Store::Store { conv, events, .. }) => {
                let p = st
                    .entry((device, conv))
                    .or_insert_with(|| persisted(device, conv));
                p.seqs.extend(events.iter().map(|ev| ev.seq));
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
                    let msg = format!(
                        "{device} acked {conv}:{seq} while it had stored contiguously only through {through}, not {conv}:{} (line {})",
                        through + 1,
                        e.i
                    );
                    out.push(Anomaly::new(Kind::D3AckBeyondStore, msg, vec![e.i]));
                }
            }
            _ => {}
        }
    }
}

/// Rule 7, `d3-cursor-unexplained` (D3: `delivered_seq` advances only on a device ack):
/// every cursor increase to `new` follows (by wall clock) an ack of exactly `new` by that
/// device in that conversation.
fn d3_cursor_unexplained(cx: &Ctx, out: &mut Vec<Anomaly>) {
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
        let old = w.old.map_or("none".to_string(), |o| o.to_string());
        let mut msg = format!(
            "cursor of {} in {} moved {old} -> {} at wall_us {} with no earlier ack of {} by {}",
            w.device, w.conv, w.new, w.wall_us, w.new, w.device
        );
        let later: Vec<u64> = found
            .map(|a| a.iter().map(|&(_, i)| i).collect())
            .unwrap_or_default();
        if let Some(&(wall, i)) = found.and_then(|a| a.first()) {
            let _ = write!(
                msg,
                " (its first ack of {} is line {i}, {} us later)",
                w.new,
                wall - w.wall_us
            );
        }
        out.push(Anomaly::new(Kind::D3CursorUnexplained, msg, later));
    }
}

/// Rule 8, `d4-decrease` (D4: `delivered_seq` never decreases and never exceeds the head):
/// (a) no audited write lowers the cursor; (b) a device is never told a lower `delivered`
/// (ack or sub reply) than one it had already received before that op was invoked
/// (overlapping ops are not compared); (c) every final cursor is in `0..=head`.
fn d4_decrease(cx: &Ctx, out: &mut Vec<Anomaly>) {
    for w in &cx.fin.cursor_audit {
        if let Some(old) = w.old {
            if w.new < old {
                let msg = format!(
                    "cursor of {} in {} was written down from {old} to {} at wall_us {}",
                    w.device, w.conv, w.new, w.wall_us
                );
                out.push(Anomaly::new(Kind::D4Decrease, msg, Vec::new()));
            }
        }
    }

    // (device, conv) → (position of a completion, max delivered received up to and
    // including it, the line that brought that max), ascending by position.
    let mut seen: HashMap<Pair, Vec<(usize, i64, u64)>> = HashMap::new();
    for (p, e) in cx.h.iter().enumerate() {
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
                        let msg = format!(
                            "{} got delivered {d} for {conv} from {} (invoked line {inv}, answered line {}) after it had received delivered {max} (line {max_line})",
                            e.process,
                            e.op(),
                            e.i
                        );
                        out.push(Anomaly::new(
                            Kind::D4Decrease,
                            msg,
                            vec![max_line, inv, e.i],
                        ));
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
            let msg = format!(
                "final cursor of {} in {} is {}, outside 0..={head} (head)",
                c.device, c.conv, c.delivered
            );
            out.push(Anomaly::new(Kind::D4Decrease, msg, Vec::new()));
        }
    }
}

/// Rule 9, `s1-outside` (S1: a device sees only events inside its user's membership
/// periods): every pushed event and every event of a sync reply lies in one of the
/// periods of the receiving device's user. A device the final read does not know has no
/// periods.
fn s1_outside(cx: &Ctx, out: &mut Vec<Anomaly>) {
    for e in cx.h {
        let (how, events): (&str, Vec<(&str, i64)>) = match &e.line {
            Line::Recv(Recv::Push(ev)) => ("push", vec![(&ev.conv, ev.seq)]),
            Line::Ok(Done::Sync { events, .. }) => (
                "sync",
                events.iter().map(|ev| (ev.conv.as_str(), ev.seq)).collect(),
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
            let periods = periods_text(cx.periods_of(device, conv).unwrap_or(&[]));
            let msg = format!(
                "{device} ({user}) received {conv} seqs {} by {how} at line {}, outside {user}'s periods of {conv}: {periods}",
                list(&seqs),
                e.i
            );
            out.push(Anomaly::new(Kind::S1Outside, msg, vec![e.i]));
        }
    }
}

/// Rule 10, `d5-not-repaired` (D5: a lost push is repaired within a bounded time): at the
/// end, no live device still misses a visible event after the judge waited the bound.
fn d5_not_repaired(cx: &Ctx, out: &mut Vec<Anomaly>) {
    let l = &cx.fin.liveness;
    for (device, convs) in &l.missing {
        for (conv, seqs) in convs {
            if seqs.is_empty() {
                continue;
            }
            let lines = seqs.iter().flat_map(|&q| cx.oks_at(conv, q)).collect();
            let msg = format!(
                "{device} still misses {conv} seqs {} after the judge waited {:.0} ms (bound {} ms)",
                list(seqs),
                l.waited_ms,
                l.bound_ms
            );
            out.push(Anomaly::new(Kind::D5NotRepaired, msg, lines));
        }
    }
}

/// A sweep hint waiting for the next one.
struct PendingHint {
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
/// `1.5 × sweep_ms`. Returns every gap for the statistics.
fn d5_sweep_late(cx: &Ctx, out: &mut Vec<Anomaly>) -> Vec<f64> {
    let stalls = observer_stalls(cx.h);
    let mut sweep_ms: Option<u64> = None;
    // device → (conv, instance) → the last sweep hint.
    let mut pending: HashMap<&str, HashMap<(&str, u64), PendingHint>> = HashMap::new();
    // (device, conv, sweep_ms) → (gaps, hint lines), for the median rule.
    let mut groups: BTreeMap<(Pair, u64), (Vec<f64>, BTreeSet<u64>)> = BTreeMap::new();
    let mut all = Vec::new();
    // Nemesis periods in force (start seen, end not yet), by op id.
    let mut disturbed: HashSet<u64> = HashSet::new();
    // From a crash (or power cut, or primary kill) of the database until it is back.
    let mut db_down = false;
    // Nemesis faults (by op id) that leave the sweep alone.
    let mut harmless: HashSet<u64> = HashSet::new();
    for e in cx.h {
        let device = e.process.as_str();
        match &e.line {
            Line::Nemesis(nem) => {
                let (phase, action) = (nem.phase, &nem.action);
                match action {
                    Action::GatewayStart { sweep_ms: ms, .. } => {
                        sweep_ms = Some(*ms);
                        pending.clear();
                    }
                    Action::PgCrash(_) | Action::PgPowerCut(_) | Action::PgPrimaryKill(_) => {
                        pending.clear();
                        track_period(e.op_id, phase, &mut disturbed);
                        db_down = true;
                    }
                    // The database answers again once a restart succeeded or the address
                    // moved to the promoted standby.
                    Action::PgRestart(_) | Action::DbAddressSwitch { .. } => {
                        pending.clear();
                        track_period(e.op_id, phase, &mut disturbed);
                        let restarted = match action {
                            Action::PgRestart(o) => phase == Phase::End && o.ok == Some(true),
                            _ => true,
                        };
                        if restarted {
                            db_down = false;
                        }
                    }
                    // A membership change, a reinstall or the heal does not slow the sweep.
                    Action::Membership { .. } | Action::Reinstall { .. } | Action::Heal { .. } => {}
                    // Nor does a fault that cannot delay a hint or move a cursor unseen: a
                    // device killed (its own crash entry ends what it was waiting for), or
                    // frames dropped or answered with an error by the gateway, except the
                    // ack's reply (the ack took effect and the sweep stopped hinting, but the
                    // client never heard).
                    Action::Fault { .. } | Action::GwFault { .. }
                        if e.op_id.is_some_and(|id| harmless.contains(&id)) => {}
                    Action::Fault { .. } | Action::GwFault { .. }
                        if fault_leaves_the_sweep_alone(action) =>
                    {
                        harmless.extend(e.op_id);
                    }
                    // Any other fault (a pause, network latency or blackhole, a killed
                    // backend, a stall of the harness...) may delay the sweep: the rule
                    // judges only gaps with no fault in force.
                    _ => {
                        pending.clear();
                        track_period(e.op_id, phase, &mut disturbed);
                    }
                }
            }
            Line::Recv(Recv::Hint { .. }) if !disturbed.is_empty() || db_down => {}
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
                    sweep_ms: sweep_ms.unwrap_or(cx.fin.sweep_ms),
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
                    let msg = format!(
                        "{device} got sweep hints for {conv} at lines {} and {} {gap:.0} ms apart (sweep_ms {}, allowed {allowed:.0} ms)",
                        h1.line, e.i, h1.sweep_ms
                    );
                    out.push(Anomaly::new(Kind::D5SweepLate, msg, vec![h1.line, e.i]));
                }
            }
            _ => {}
        }
    }
    for (((device, conv), sweep), (gaps, lines)) in groups {
        if gaps.len() < SWEEP_MEDIAN_MIN_GAPS {
            continue;
        }
        let n = gaps.len();
        let median = nearest_rank(&sorted(gaps), 0.5).unwrap_or(0.0);
        if median > SWEEP_MEDIAN_FACTOR * sweep as f64 {
            let msg = format!(
                "{device}'s sweep hints for {conv} came every {median:.0} ms (median of {n} gaps), over {SWEEP_MEDIAN_FACTOR} × sweep_ms {sweep}"
            );
            out.push(Anomaly::new(
                Kind::D5SweepLate,
                msg,
                lines.into_iter().collect(),
            ));
        }
    }
    all
}

/// Whether a nemesis fault (the start of its `fault` period) can neither delay the sweep or
/// its hints nor move a cursor without the client hearing of it: a `client-crash`, or a
/// `gw-fault` that drops a frame or answers it with an error at any point but
/// `gw.reply.ack`.
fn fault_leaves_the_sweep_alone(action: &Action) -> bool {
    if let Action::Fault { fault, .. } = action {
        if fault.kind == FaultKind::ClientCrash {
            return true;
        }
    }
    action
        .frame_fault()
        .is_some_and(|(point, act)| matches!(act, "drop" | "error") && point != "gw.reply.ack")
}

/// Keeps the set of nemesis periods in force: a `start` line opens one (by op id), its
/// `end` closes it; instants open nothing.
/// The windows in which the harness itself was stalled (`observer-stall` lines, written by
/// `History`): what it recorded in them was recorded late, so no time bound is judged
/// across one. `(from_ms, to_ms)`.
fn observer_stalls(h: &[Entry]) -> Vec<(f64, f64)> {
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

fn track_period(op_id: Option<u64>, phase: Phase, open: &mut HashSet<u64>) {
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

/// Rule 12, `store-mismatch` (D1/D6: what a client was given is what the database kept):
/// every event in a client's state file at the end is a row with the same mid, and a
/// device never receives (push or sync) two different mids for one (conv, seq).
fn store_mismatch(cx: &Ctx, out: &mut Vec<Anomaly>) {
    let mut stored_at: HashMap<DevSeq, u64> = HashMap::new();
    let mut received: HashMap<DevSeq, Vec<(&str, u64)>> = HashMap::new();
    for e in cx.h {
        let device = e.process.as_str();
        match &e.line {
            Line::Store(Store::Store { conv, events, .. }) => {
                for ev in events {
                    stored_at.entry((device, conv, ev.seq)).or_insert(e.i);
                }
            }
            Line::Recv(Recv::Push(_)) | Line::Ok(Done::Sync { .. }) => {
                let evs: &[EventRef] = match &e.line {
                    Line::Recv(Recv::Push(ev)) => std::slice::from_ref(ev),
                    Line::Ok(Done::Sync { events, .. }) => events,
                    _ => &[],
                };
                for ev in evs {
                    let (conv, seq, mid) = (ev.conv.as_str(), ev.seq, ev.mid.as_str());
                    let mids = received.entry((device, conv, seq)).or_default();
                    if mids.iter().any(|(m, _)| *m == mid) {
                        continue;
                    }
                    if let Some(&(m0, l0)) = mids.first() {
                        let msg = format!(
                            "{device} received {conv}:{seq} as mid {m0} (line {l0}) and as mid {mid} (line {})",
                            e.i
                        );
                        out.push(Anomaly::new(Kind::StoreMismatch, msg, vec![l0, e.i]));
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
                let what = match row {
                    Some(r) if r.mid == ev.mid => continue,
                    Some(r) => format!("the row has mid {}", r.mid),
                    None => "the final read has no such row".to_string(),
                };
                let line = stored_at.get(&(device.as_str(), conv.as_str(), ev.seq));
                let when = line.map_or(String::new(), |l| format!(" (stored at line {l})"));
                let msg = format!(
                    "{device}'s state file holds {conv}:{} = mid {}{when} but {what}",
                    ev.seq, ev.mid
                );
                out.push(Anomaly::new(
                    Kind::StoreMismatch,
                    msg,
                    line.copied().into_iter().collect(),
                ));
            }
        }
    }
}

/// Rule 13, `reply-before-commit` / `push-before-commit` (D1: a `sent` reply, and a push,
/// leave only after the transaction committed): a probe on another database session,
/// taken right after the reply or push arrived, reads the same mid. Probes that could not
/// read are ignored.
fn before_commit(cx: &Ctx, out: &mut Vec<Anomaly>) {
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
        let found = found.map_or("no row".to_string(), |m| format!("mid {m}"));
        let msg = format!(
            "{}'s {what} {conv}:{seq} (mid {expect}, line {of}) was not visible to another session: found {found} (probe line {})",
            src.process, e.i
        );
        out.push(Anomaly::new(kind, msg, vec![of, e.i]));
    }
}

/// The statistics of the report.
fn stats(cx: &Ctx, info_sends: InfoSends, gaps: Vec<f64>) -> Stats {
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Builds a history line by line; the clock advances 1 ms per line unless told.
    struct B {
        h: Vec<Entry>,
        t: f64,
        op: u64,
    }

    const WALL0: i64 = 1_700_000_000_000_000;

    impl B {
        fn new() -> B {
            let mut b = B {
                h: Vec::new(),
                t: 0.0,
                op: 0,
            };
            b.line(
                "harness",
                0,
                Type::Meta,
                "open",
                None,
                json!({"schema_version": crate::history::SCHEMA_VERSION}),
            );
            b
        }

        fn line(
            &mut self,
            process: &str,
            instance: u64,
            kind: Type,
            op: &str,
            op_id: Option<u64>,
            value: Value,
        ) -> u64 {
            self.t += 1.0;
            let i = self.h.len() as u64;
            // Written as a line of history.jsonl and parsed as the checker's reader parses
            // it: a test line of the wrong shape fails here, loudly.
            let mut value = value;
            let mut line = json!({
                "i": i, "t_ms": self.t, "wall_us": WALL0 + (self.t * 1000.0) as i64,
                "process": process, "instance": instance, "type": kind, "op": op,
                "op_id": op_id,
            });
            if kind == Type::Nemesis {
                let phase = value
                    .as_object_mut()
                    .and_then(|o| o.remove("phase"))
                    .unwrap_or(json!("instant"));
                line["phase"] = phase;
            }
            line["value"] = value;
            let e: Entry = serde_json::from_value(line.clone())
                .unwrap_or_else(|err| panic!("test line {line} does not parse: {err}"));
            self.h.push(e);
            i
        }

        fn wait(&mut self, ms: f64) {
            self.t += ms;
        }

        fn wall(&self, line: u64) -> i64 {
            self.h[line as usize].wall_us
        }

        /// An invoke; returns its op id.
        fn invoke(&mut self, dev: &str, op: &str, v: Value) -> u64 {
            self.op += 1;
            let id = self.op;
            self.line(dev, 1, Type::Invoke, op, Some(id), v);
            id
        }

        fn done(&mut self, dev: &str, kind: Type, op: &str, id: u64, v: Value) -> u64 {
            self.line(dev, 1, kind, op, Some(id), v)
        }

        /// A send answered `sent`; returns the ok line.
        fn send(&mut self, dev: &str, conv: &str, cmid: &str, seq: i64, mid: &str) -> u64 {
            let id = self.invoke(
                dev,
                "send",
                json!({"conv": conv, "cmid": cmid, "body_len": 1}),
            );
            self.done(
                dev,
                Type::Ok,
                "send",
                id,
                json!({"conv": conv, "seq": seq, "mid": mid, "dup": false, "epoch": 1}),
            )
        }

        /// A send that timed out.
        fn send_info(&mut self, dev: &str, conv: &str, cmid: &str) {
            let id = self.invoke(
                dev,
                "send",
                json!({"conv": conv, "cmid": cmid, "body_len": 1}),
            );
            self.done(dev, Type::Info, "send", id, json!({"why": "timeout"}));
        }

        /// A non-overlapping ack; returns (invoke line, ok line).
        fn ack(
            &mut self,
            dev: &str,
            conv: &str,
            seq: i64,
            explicit: bool,
            delivered: i64,
        ) -> (u64, u64) {
            let id = self.invoke(
                dev,
                "ack",
                json!({"conv": conv, "seq": seq, "explicit": explicit}),
            );
            let inv = self.h.len() as u64 - 1;
            let ok = self.done(
                dev,
                Type::Ok,
                "ack",
                id,
                json!({"conv": conv, "delivered": delivered}),
            );
            (inv, ok)
        }

        fn push(&mut self, dev: &str, conv: &str, seq: i64, mid: &str) -> u64 {
            self.line(
                dev,
                1,
                Type::Recv,
                "push",
                None,
                json!({"conv": conv, "seq": seq, "mid": mid, "sender": "alice", "cmid": "x"}),
            )
        }

        fn hint(&mut self, dev: &str, conv: &str, head: i64, why: &str) -> u64 {
            self.line(
                dev,
                1,
                Type::Recv,
                "hint",
                None,
                json!({"conv": conv, "head": head, "why": why}),
            )
        }

        fn store(&mut self, dev: &str, via: &str, conv: &str, evs: &[(i64, &str)]) -> u64 {
            let events: Vec<Value> = evs
                .iter()
                .map(|(q, m)| json!({"seq": q, "mid": m}))
                .collect();
            let cursor = evs.last().map_or(0, |e| e.0);
            self.line(
                dev,
                1,
                Type::Store,
                "store",
                None,
                json!({"conv": conv, "via": via, "events": events, "cursor": cursor}),
            )
        }

        fn sync(
            &mut self,
            dev: &str,
            conv: &str,
            after: i64,
            evs: &[(i64, &str)],
            head: i64,
        ) -> u64 {
            let id = self.invoke(
                dev,
                "sync",
                json!({"conv": conv, "after": after, "limit": 100}),
            );
            let events: Vec<Value> = evs
                .iter()
                .map(|(q, m)| json!({"conv": conv, "seq": q, "mid": m, "sender": "alice", "cmid": "x"}))
                .collect();
            self.done(
                dev,
                Type::Ok,
                "sync",
                id,
                json!({"conv": conv, "head": head, "complete": true, "events": events}),
            )
        }

        fn client(&mut self, dev: &str, op: &str) -> u64 {
            self.line(dev, 1, Type::Client, op, None, json!({}))
        }

        fn gateway_start(&mut self, sweep_ms: u64) -> u64 {
            self.line(
                "harness",
                0,
                Type::Nemesis,
                "gateway-start",
                None,
                json!({"gateway": 0, "fault": null, "sweep_ms": sweep_ms, "bug": null, "phase": "instant"}),
            )
        }

        fn probe(
            &mut self,
            of: u64,
            conv: &str,
            seq: i64,
            expect: &str,
            found: Option<&str>,
            error: Option<&str>,
        ) -> u64 {
            self.line("probe", 0, Type::Probe, "probe", None, json!({"of": of, "conv": conv, "seq": seq, "expect_mid": expect, "found_mid": found, "error": error}))
        }
    }

    /// A final read: users alice (a1) and bob (b1), both members of c1 from seq 1, with
    /// `rows` (conv, seq, mid, sender_device, cmid) and heads from them.
    fn fin(rows: &[(&str, i64, &str, &str, &str)]) -> Final {
        let user = |d: &str| if d.starts_with('a') { "alice" } else { "bob" };
        let mut heads = BTreeMap::from([("c1".to_string(), 0)]);
        for r in rows {
            let h = heads.entry(r.0.to_string()).or_insert(0);
            *h = (*h).max(r.1);
        }
        Final {
            schema_version: 1,
            t_ms: 0.0,
            wall_us: 0,
            sweep_ms: 1000,
            events: rows
                .iter()
                .map(|r| FinalEvent {
                    conv: r.0.into(),
                    seq: r.1,
                    mid: r.2.into(),
                    sender_user: user(r.3).into(),
                    sender_device: r.3.into(),
                    cmid: r.4.into(),
                })
                .collect(),
            heads,
            memberships: ["alice", "bob"]
                .iter()
                .map(|u| Membership {
                    conv: "c1".into(),
                    user: (*u).into(),
                    from_seq: 1,
                    to_seq: None,
                })
                .collect(),
            devices: BTreeMap::from([
                ("a1".to_string(), "alice".to_string()),
                ("b1".to_string(), "bob".to_string()),
            ]),
            cursors: Vec::new(),
            cursor_audit: Vec::new(),
            stores: BTreeMap::new(),
            live: vec!["a1".into(), "b1".into()],
            liveness: Liveness {
                bound_ms: 2000,
                waited_ms: 0.0,
                missing: BTreeMap::new(),
            },
        }
    }

    /// A cursor write of `dev` in c1.
    fn audit(dev: &str, old: Option<i64>, new: i64, wall_us: i64) -> CursorWrite {
        CursorWrite {
            device: dev.into(),
            conv: "c1".into(),
            old,
            new,
            wall_us,
        }
    }

    fn cursor(dev: &str, conv: &str, delivered: i64) -> FinalCursor {
        FinalCursor {
            device: dev.into(),
            conv: conv.into(),
            delivered,
        }
    }

    /// Puts `evs` as `dev`'s state file for c1.
    fn state_file(f: &mut Final, dev: &str, evs: &[(i64, &str)]) {
        let evs = evs
            .iter()
            .map(|(seq, mid)| StoredEvent {
                seq: *seq,
                mid: (*mid).into(),
            })
            .collect();
        f.stores
            .insert(dev.into(), BTreeMap::from([("c1".to_string(), evs)]));
    }

    /// The kinds found, in report order.
    fn kinds(b: &B, f: &Final) -> Vec<&'static str> {
        check(&b.h, f)
            .anomalies
            .iter()
            .map(|a| a.kind.as_str())
            .collect()
    }

    fn only(b: &B, f: &Final, kind: Kind) -> Vec<Anomaly> {
        check(&b.h, f)
            .anomalies
            .into_iter()
            .filter(|a| a.kind == kind)
            .collect()
    }

    /// Two rows m1, m2 of c1 sent by a1 (cmids x1, x2).
    fn two_rows() -> Final {
        fin(&[("c1", 1, "m1", "a1", "x1"), ("c1", 2, "m2", "a1", "x2")])
    }

    #[test]
    fn a_clean_realistic_history_passes_with_every_count_zero() {
        let (b, f) = realistic();
        let r = check(&b.h, &f);
        assert_eq!(r.anomalies, vec![], "{}", r.summary());
        assert_eq!(r.verdict, Verdict::Pass);
        assert_eq!(r.counts.len(), 13);
        assert!(Kind::ALL.iter().all(|k| r.counts[k] == 0));
        let json = serde_json::to_value(&r).unwrap();
        for k in Kind::ALL {
            assert_eq!(json["counts"][k.as_str()], json!(0), "{k}");
        }
        assert_eq!(json["verdict"], json!("PASS"));
        assert_eq!(
            r.summary(),
            format!("PASS, 0 anomalies over {} entries", b.h.len())
        );
        assert_eq!(
            r.stats.ops["send"],
            OpCounts {
                invoke: 2,
                ok: 2,
                fail: 0,
                info: 0
            }
        );
        assert_eq!(r.stats.ops["ack"].ok, 4);
        assert_eq!((r.stats.pushes, r.stats.hints, r.stats.stores), (3, 1, 4));
        assert_eq!(
            r.stats.probes,
            ProbeCounts {
                total: 3,
                visible: 3,
                errors: 0
            }
        );
        assert_eq!(r.stats.delivery_ms.n, 4);
        assert_eq!(r.stats.repair_ms.n, 1);
        assert!(r.stats.repair_ms.p50.unwrap() > 900.0);
        assert_eq!(
            r.stats.sweep_hint_gaps_ms,
            GapQuantiles {
                n: 0,
                p50: None,
                max: None
            }
        );
        let back: Report = serde_json::from_value(json).unwrap();
        assert_eq!(back, r);
    }

    /// Two devices, two messages, one push lost and repaired by a sweep hint and a sync:
    /// a history every rule passes, and its final read.
    fn realistic() -> (B, Final) {
        let mut b = B::new();
        b.client("a1", "create");
        b.client("b1", "create");
        for d in ["a1", "b1"] {
            let id = b.invoke(d, "hello", json!({"device": d, "epoch": 1}));
            b.done(
                d,
                Type::Ok,
                "hello",
                id,
                json!({"user": "u", "device": d, "epoch": 1}),
            );
            let id = b.invoke(d, "sub", json!({}));
            b.done(
                d,
                Type::Ok,
                "sub",
                id,
                json!({"convs": [{"conv": "c1", "head": 0, "delivered": 0}]}),
            );
        }
        let ok1 = b.send("a1", "c1", "x1", 1, "m1");
        b.probe(ok1, "c1", 1, "m1", Some("m1"), None);
        for d in ["a1", "b1"] {
            let p = b.push(d, "c1", 1, "m1");
            b.probe(p, "c1", 1, "m1", Some("m1"), None);
            b.store(d, "push", "c1", &[(1, "m1")]);
            b.ack(d, "c1", 1, false, 1);
        }
        b.send("a1", "c1", "x2", 2, "m2");
        b.push("a1", "c1", 2, "m2");
        b.store("a1", "push", "c1", &[(2, "m2")]);
        let (a_ack2, _) = b.ack("a1", "c1", 2, false, 2);
        // b1 lost the push of 2: the sweep hints it, it syncs and acks.
        b.wait(900.0);
        b.hint("b1", "c1", 2, "sweep");
        b.sync("b1", "c1", 1, &[(2, "m2")], 2);
        b.store("b1", "sync", "c1", &[(2, "m2")]);
        let (b_ack2, _) = b.ack("b1", "c1", 2, false, 2);
        b.line("harness", 0, Type::Meta, "final", None, json!({}));

        let mut f = two_rows();
        f.cursor_audit = vec![
            audit("a1", None, 1, b.wall(a_ack2) - 10),
            audit("b1", None, 1, b.wall(a_ack2) - 5),
            audit("a1", Some(1), 2, b.wall(a_ack2) + 5),
            audit("b1", Some(1), 2, b.wall(b_ack2) + 5),
        ];
        for d in ["a1", "b1"] {
            f.cursors.push(cursor(d, "c1", 2));
            state_file(&mut f, d, &[(1, "m1"), (2, "m2")]);
        }
        f.liveness
            .missing
            .insert("b1".into(), BTreeMap::from([("c1".to_string(), vec![])]));
        (b, f)
    }

    /// Every key of `v`, at any depth, as a path of keys and array indexes.
    fn key_paths(v: &Value, at: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
        match v {
            Value::Object(o) => {
                for (k, x) in o {
                    at.push(k.clone());
                    out.push(at.clone());
                    key_paths(x, at, out);
                    at.pop();
                }
            }
            Value::Array(xs) => {
                for (i, x) in xs.iter().enumerate() {
                    at.push(format!("[{i}]"));
                    key_paths(x, at, out);
                    at.pop();
                }
            }
            _ => {}
        }
    }

    /// Renames the last key of `path` in `v` (appends `_renamed`).
    fn rename(v: &mut Value, path: &[String]) {
        let (last, parents) = path.split_last().unwrap();
        let mut at = v;
        for p in parents {
            at = match p.strip_prefix('[').and_then(|p| p.strip_suffix(']')) {
                Some(i) => &mut at[i.parse::<usize>().unwrap()],
                None => &mut at[p.as_str()],
            };
        }
        let o = at.as_object_mut().unwrap();
        let x = o.remove(last).unwrap();
        o.insert(format!("{last}_renamed"), x);
    }

    /// Issue 20: a history field renamed (by another version of the recorder, or by hand)
    /// makes the judgement ERROR, not a rule that skips the line and passes. Every key of
    /// every line of a history holding every kind of line the checker reads, at any depth,
    /// is renamed in turn: each time the history no longer parses, naming the line; and
    /// the judgement of the run directory is ERROR.
    #[test]
    fn a_renamed_history_field_makes_the_judgement_error_never_a_skip() {
        let (mut b, f) = realistic();
        b.gateway_start(1000);
        let fault = json!({"id": 3, "at_ms": 10, "end_ms": 20, "target": "gateway",
                           "kind": "gw-fault", "point": "gw.push", "action": "drop"});
        for phase in ["start", "end"] {
            let v = json!({"phase": phase, "fault": fault.clone(), "healed": false});
            b.line("harness", 0, Type::Nemesis, "fault", Some(90), v);
        }
        for v in [
            json!({"phase": "start"}),
            json!({"phase": "end", "ok": true, "error": null}),
        ] {
            b.line("harness", 0, Type::Nemesis, "pg-crash", Some(91), v);
        }
        b.line(
            "harness",
            0,
            Type::Nemesis,
            "observer-stall",
            None,
            json!({"from_ms": 1.0, "to_ms": 300.0, "cause": "test"}),
        );
        b.send_info("a1", "c1", "x9");
        b.probe(3, "c1", 1, "m1", None, Some("down"));
        let tmp = tempfile::Builder::new()
            .prefix("imfault-rename-")
            .tempdir()
            .unwrap();
        let dir = tmp.path();
        let lines: Vec<Value> =
            b.h.iter()
                .map(|e| serde_json::to_value(e).unwrap())
                .collect();
        let text = |lines: &[Value]| {
            lines
                .iter()
                .map(|l| l.to_string() + "\n")
                .collect::<String>()
        };
        std::fs::write(dir.join("history.jsonl"), text(&lines)).unwrap();
        std::fs::write(dir.join("final.json"), serde_json::to_string(&f).unwrap()).unwrap();
        assert_eq!(judge_dir(dir).verdict, Verdict::Pass);

        let mut renamed = 0;
        for (n, line) in lines.iter().enumerate() {
            let mut paths = Vec::new();
            key_paths(line, &mut Vec::new(), &mut paths);
            for path in paths {
                let mut edited = lines.clone();
                rename(&mut edited[n], &path);
                let e = format!("{:#}", crate::history::parse(&text(&edited)).unwrap_err());
                assert!(
                    e.contains(&format!("line {}", n + 1)),
                    "renaming {path:?} of line {}: {e}",
                    n + 1
                );
                renamed += 1;
            }
        }
        assert!(renamed > 300, "{renamed}");

        // End to end, from the run directory: the mid of a `sent` reply renamed.
        let ok = lines
            .iter()
            .position(|l| l["type"] == "ok" && l["op"] == "send")
            .unwrap();
        let mut edited = lines.clone();
        rename(&mut edited[ok], &["value".into(), "mid".into()]);
        std::fs::write(dir.join("history.jsonl"), text(&edited)).unwrap();
        let r = judge_dir(dir);
        assert_eq!(r.verdict, Verdict::Error);
        let why = r.error.as_deref().unwrap();
        assert!(why.contains(&format!("line {}", ok + 1)), "{why}");
        assert!(r.summary().starts_with("ERROR"), "{}", r.summary());
        assert_eq!(serde_json::to_value(&r).unwrap()["verdict"], json!("ERROR"));
    }

    #[test]
    fn kind_names_are_the_serialised_names() {
        for k in Kind::ALL {
            assert_eq!(serde_json::to_value(k).unwrap(), json!(k.as_str()));
        }
    }

    #[test]
    fn nearest_rank_quantiles() {
        let q = quantiles(vec![5.0, 1.0, 4.0, 2.0, 3.0]);
        assert_eq!(
            (q.n, q.p50, q.p95, q.max),
            (5, Some(3.0), Some(5.0), Some(5.0))
        );
        let q = quantiles(vec![1.0, 2.0]);
        assert_eq!(q.p50, Some(1.0));
        assert_eq!(quantiles(vec![]), Quantiles::default());
    }

    #[test]
    fn lost_when_an_acked_row_is_missing_or_has_another_mid() {
        let mut b = B::new();
        b.send("a1", "c1", "x1", 1, "m1");
        b.send("a1", "c1", "x2", 2, "m2");
        let f = fin(&[("c1", 2, "other", "a1", "x2")]);
        let lost = only(&b, &f, Kind::Lost);
        assert_eq!(lost.len(), 2, "{lost:?}");
        assert!(lost[0].msg.contains("no row c1:1"), "{}", lost[0].msg);
        assert!(lost[1].msg.contains("has mid other"), "{}", lost[1].msg);
        assert_eq!(lost[0].entries, vec![2]);
        assert_eq!(lost[0].invariant, "D1/D6");
    }

    #[test]
    fn an_info_send_absent_at_the_end_is_not_lost() {
        let mut b = B::new();
        b.send_info("a1", "c1", "x1");
        b.send_info("a1", "c1", "x2");
        let f = fin(&[("c1", 1, "m2", "a1", "x2")]);
        let r = check(&b.h, &f);
        assert_eq!(r.verdict, Verdict::Pass, "{:?}", r.anomalies);
        assert_eq!(
            r.stats.info_sends,
            InfoSends {
                total: 2,
                present: 1,
                absent: 1
            }
        );
    }

    #[test]
    fn duplicated_rows_of_one_cmid_or_two_answers_for_one_cmid() {
        let mut b = B::new();
        b.send("a1", "c1", "x1", 1, "m1");
        b.send("a1", "c1", "x1", 2, "m2");
        let f = two_rows_same_cmid();
        let d = only(&b, &f, Kind::Duplicated);
        assert_eq!(d.len(), 2, "{d:?}");
        assert!(d
            .iter()
            .any(|a| a.msg.contains("2 rows for (sender alice, cmid x1)")));
        assert!(d
            .iter()
            .any(|a| a.msg.contains("a1's cmid x1 was answered sent with c1:1")));
    }

    fn two_rows_same_cmid() -> Final {
        fin(&[("c1", 1, "m1", "a1", "x1"), ("c1", 2, "m2", "a1", "x1")])
    }

    #[test]
    fn a_dup_reply_with_the_original_seq_is_not_duplicated() {
        let mut b = B::new();
        b.send_info("a1", "c1", "x1");
        b.send("a1", "c1", "x1", 1, "m1");
        b.send("a1", "c1", "x1", 1, "m1");
        let f = fin(&[("c1", 1, "m1", "a1", "x1")]);
        assert_eq!(kinds(&b, &f), Vec::<&str>::new());
    }

    #[test]
    fn unexpected_row_never_sent() {
        let mut b = B::new();
        b.send("a1", "c1", "x1", 1, "m1");
        let f = two_rows();
        let u = only(&b, &f, Kind::Unexpected);
        assert_eq!(u.len(), 1);
        assert!(u[0]
            .msg
            .contains("row c1:2 (mid m2, sender alice/a1, cmid x2) was never sent by a1"));
        assert!(u[0].entries.is_empty());
    }

    #[test]
    fn a_row_from_an_info_send_is_expected() {
        let mut b = B::new();
        b.send_info("a1", "c1", "x1");
        let f = fin(&[("c1", 1, "m1", "a1", "x1")]);
        let r = check(&b.h, &f);
        assert_eq!(r.verdict, Verdict::Pass, "{:?}", r.anomalies);
        assert_eq!(
            r.stats.info_sends,
            InfoSends {
                total: 1,
                present: 1,
                absent: 0
            }
        );
    }

    #[test]
    fn p1_gap_when_rows_are_not_one_to_head() {
        let mut b = B::new();
        b.send_info("a1", "c1", "x1");
        b.send_info("a1", "c1", "x3");
        let mut f = fin(&[("c1", 1, "m1", "a1", "x1"), ("c1", 3, "m3", "a1", "x3")]);
        let gap = only(&b, &f, Kind::P1Gap);
        assert_eq!(gap.len(), 1);
        assert_eq!(gap[0].msg, "c1 has head 3 but no rows for seqs 2");
        f.heads.insert("c1".into(), 1);
        let gap = only(&b, &f, Kind::P1Gap);
        assert_eq!(gap[0].msg, "c1 has head 1 but rows outside 1..=1: 3");
    }

    #[test]
    fn gapless_rows_are_not_a_p1_gap() {
        let mut b = B::new();
        b.send("a1", "c1", "x1", 1, "m1");
        b.send("a1", "c1", "x2", 2, "m2");
        let mut f = two_rows();
        f.heads.insert("c2".into(), 0);
        assert_eq!(kinds(&b, &f), Vec::<&str>::new());
    }

    #[test]
    fn d3_ack_beyond_what_was_stored_before_the_invoke() {
        let mut b = B::new();
        b.store("b1", "push", "c1", &[(1, "m1")]);
        let id = b.invoke(
            "b1",
            "ack",
            json!({"conv": "c1", "seq": 2, "explicit": false}),
        );
        // Stored after the ack left: too late.
        b.store("b1", "push", "c1", &[(2, "m2")]);
        b.done(
            "b1",
            Type::Ok,
            "ack",
            id,
            json!({"conv": "c1", "delivered": 2}),
        );
        let f = two_rows();
        let d3 = only(&b, &f, Kind::D3AckBeyondStore);
        assert_eq!(d3.len(), 1, "{d3:?}");
        assert_eq!(
            d3[0].msg,
            "b1 acked c1:2 while it had stored contiguously only through 1, not c1:2 (line 2)"
        );
        assert_eq!(d3[0].entries, vec![2]);
    }

    #[test]
    fn d3_a_hole_below_the_ack_is_flagged() {
        let mut b = B::new();
        b.store("b1", "push", "c1", &[(2, "m2")]);
        b.ack("b1", "c1", 2, false, 2);
        let d3 = only(&b, &two_rows(), Kind::D3AckBeyondStore);
        assert_eq!(d3.len(), 1);
        assert!(
            d3[0].msg.contains("only through 0, not c1:1"),
            "{}",
            d3[0].msg
        );
    }

    #[test]
    fn an_explicit_ack_beyond_the_store_is_not_d3_but_counted() {
        let mut b = B::new();
        b.ack("b1", "c1", 2, true, 2);
        let r = check(&b.h, &two_rows());
        assert_eq!(r.counts[&Kind::D3AckBeyondStore], 0);
        assert_eq!(r.stats.explicit_acks, 1);
    }

    #[test]
    fn a_seq_invisible_to_the_user_is_not_a_hole() {
        let mut b = B::new();
        b.store("b1", "sync", "c1", &[(2, "m2"), (4, "m4")]);
        b.ack("b1", "c1", 4, false, 4);
        let mut f = fin(&[
            ("c1", 1, "m1", "a1", "x1"),
            ("c1", 2, "m2", "a1", "x2"),
            ("c1", 3, "m3", "a1", "x3"),
            ("c1", 4, "m4", "a1", "x4"),
        ]);
        // bob joined at 2, left before 3, came back at 4.
        f.memberships[1] = Membership {
            conv: "c1".into(),
            user: "bob".into(),
            from_seq: 2,
            to_seq: Some(3),
        };
        f.memberships.push(Membership {
            conv: "c1".into(),
            user: "bob".into(),
            from_seq: 4,
            to_seq: None,
        });
        assert!(only(&b, &f, Kind::D3AckBeyondStore).is_empty());
        // The same ack with 2 not stored is a hole.
        let mut b = B::new();
        b.store("b1", "sync", "c1", &[(4, "m4")]);
        b.ack("b1", "c1", 4, false, 4);
        assert_eq!(only(&b, &f, Kind::D3AckBeyondStore).len(), 1);
    }

    #[test]
    fn d3_cursor_moved_without_an_earlier_ack() {
        let mut b = B::new();
        let (inv, _) = b.ack("b1", "c1", 1, true, 1);
        let mut f = two_rows();
        f.cursor_audit = vec![
            // No ack of 2 at all.
            audit("b1", None, 2, b.wall(inv) + 10),
            // The ack of 1 came after this write.
            audit("b1", Some(0), 1, b.wall(inv) - 10),
        ];
        let d3 = only(&b, &f, Kind::D3CursorUnexplained);
        assert_eq!(d3.len(), 2, "{d3:?}");
        assert_eq!(d3[0].entries, vec![inv]);
        assert!(d3[0].msg.contains("moved 0 -> 1"), "{}", d3[0].msg);
        assert!(d3[1].msg.contains("moved none -> 2"), "{}", d3[1].msg);
    }

    #[test]
    fn a_cursor_increase_after_a_matching_ack_is_explained() {
        let mut b = B::new();
        let (inv, _) = b.ack("b1", "c1", 2, true, 2);
        let mut f = two_rows();
        f.cursor_audit = vec![
            audit("b1", None, 2, b.wall(inv) + 10),
            // Not an increase (GREATEST kept 2): nothing to explain.
            audit("b1", Some(2), 2, b.wall(inv) + 20),
        ];
        assert!(only(&b, &f, Kind::D3CursorUnexplained).is_empty());
    }

    #[test]
    fn d4_a_later_ack_reply_below_an_earlier_one() {
        let mut b = B::new();
        let (_, ok5) = b.ack("b1", "c1", 2, true, 2);
        let (inv, ok) = b.ack("b1", "c1", 1, true, 1);
        let d4 = only(&b, &two_rows(), Kind::D4Decrease);
        assert_eq!(d4.len(), 1, "{d4:?}");
        assert_eq!(d4[0].entries, vec![ok5, inv, ok]);
        assert_eq!(
            d4[0].msg,
            "b1 got delivered 1 for c1 from ack (invoked line 3, answered line 4) after it had received delivered 2 (line 2)"
        );
    }

    #[test]
    fn d4_a_sub_reply_below_an_earlier_ack() {
        let mut b = B::new();
        b.ack("b1", "c1", 2, true, 2);
        let id = b.invoke("b1", "sub", json!({}));
        b.done(
            "b1",
            Type::Ok,
            "sub",
            id,
            json!({"convs": [{"conv": "c1", "head": 2, "delivered": 0}]}),
        );
        assert_eq!(only(&b, &two_rows(), Kind::D4Decrease).len(), 1);
    }

    #[test]
    fn overlapping_acks_answered_out_of_order_are_not_d4() {
        let mut b = B::new();
        let id1 = b.invoke(
            "b1",
            "ack",
            json!({"conv": "c1", "seq": 1, "explicit": true}),
        );
        let id2 = b.invoke(
            "b1",
            "ack",
            json!({"conv": "c1", "seq": 2, "explicit": true}),
        );
        b.done(
            "b1",
            Type::Ok,
            "ack",
            id2,
            json!({"conv": "c1", "delivered": 2}),
        );
        b.done(
            "b1",
            Type::Ok,
            "ack",
            id1,
            json!({"conv": "c1", "delivered": 1}),
        );
        // A later op is compared with both.
        b.ack("b1", "c1", 2, true, 2);
        assert!(only(&b, &two_rows(), Kind::D4Decrease).is_empty());
    }

    #[test]
    fn d4_audit_decrease_and_final_cursor_outside_the_head() {
        let b = B::new();
        let mut f = two_rows();
        f.cursor_audit = vec![audit("b1", Some(2), 1, 5)];
        f.cursors = vec![
            cursor("a1", "c1", 3),
            cursor("b1", "c1", -1),
            cursor("b1", "c2", 0),
        ];
        let d4 = only(&b, &f, Kind::D4Decrease);
        assert_eq!(d4.len(), 3, "{d4:?}");
        assert!(d4
            .iter()
            .any(|a| a.msg.contains("written down from 2 to 1")));
        assert!(d4
            .iter()
            .any(|a| a.msg == "final cursor of a1 in c1 is 3, outside 0..=2 (head)"));
    }

    #[test]
    fn s1_push_or_sync_event_outside_the_membership() {
        let mut b = B::new();
        let p = b.push("b1", "c1", 1, "m1");
        let s = b.sync("b1", "c1", 0, &[(1, "m1"), (2, "m2")], 2);
        let mut f = two_rows();
        f.memberships[1].from_seq = 2;
        let s1 = only(&b, &f, Kind::S1Outside);
        assert_eq!(s1.len(), 2, "{s1:?}");
        assert_eq!(s1[0].entries, vec![p]);
        assert_eq!(s1[1].entries, vec![s]);
        assert_eq!(
            s1[0].msg,
            "b1 (bob) received c1 seqs 1 by push at line 1, outside bob's periods of c1: [2, ∞)"
        );
    }

    #[test]
    fn events_inside_the_membership_are_not_s1() {
        let mut b = B::new();
        b.push("b1", "c1", 2, "m2");
        b.sync("b1", "c1", 1, &[(2, "m2")], 2);
        let mut f = two_rows();
        f.memberships[1].from_seq = 2;
        assert!(only(&b, &f, Kind::S1Outside).is_empty());
    }

    #[test]
    fn d5_not_repaired_only_for_non_empty_missing_lists() {
        let mut b = B::new();
        let ok2 = b.send("a1", "c1", "x2", 2, "m2");
        let mut f = two_rows();
        f.liveness.waited_ms = 2500.0;
        f.liveness
            .missing
            .insert("a1".into(), BTreeMap::from([("c1".to_string(), vec![])]));
        assert!(only(&b, &f, Kind::D5NotRepaired).is_empty());
        f.liveness
            .missing
            .insert("b1".into(), BTreeMap::from([("c1".to_string(), vec![2])]));
        let d5 = only(&b, &f, Kind::D5NotRepaired);
        assert_eq!(d5.len(), 1);
        assert_eq!(
            d5[0].msg,
            "b1 still misses c1 seqs 2 after the judge waited 2500 ms (bound 2000 ms)"
        );
        assert_eq!(d5[0].entries, vec![ok2]);
    }

    #[test]
    fn d5_sweep_hints_too_far_apart() {
        let mut b = B::new();
        b.gateway_start(1000);
        let h1 = b.hint("b1", "c1", 2, "sweep");
        b.wait(2500.0);
        let h2 = b.hint("b1", "c1", 2, "sweep");
        let r = check(&b.h, &two_rows());
        let late: Vec<_> = r
            .anomalies
            .iter()
            .filter(|a| a.kind == Kind::D5SweepLate)
            .collect();
        assert_eq!(late.len(), 1, "{late:?}");
        assert_eq!(late[0].entries, vec![h1, h2]);
        assert!(
            late[0]
                .msg
                .contains("2501 ms apart (sweep_ms 1000, allowed 2000 ms)"),
            "{}",
            late[0].msg
        );
        assert_eq!(
            r.stats.sweep_hint_gaps_ms,
            GapQuantiles {
                n: 1,
                p50: Some(2501.0),
                max: Some(2501.0)
            }
        );
    }

    /// Seed 829's shape: the harness stalled 1.7 s, then recorded the queued hints; its
    /// watchdog's `observer-stall` line may come after them. The gap is not judged, and the
    /// same gap with the stall elsewhere still is.
    #[test]
    fn d5_sweep_gap_across_an_observer_stall_is_not_judged() {
        for (stall_inside, want) in [(true, 0), (false, 1)] {
            let mut b = B::new();
            b.gateway_start(500);
            b.hint("b1", "c1", 2, "sweep");
            let t1 = b.t;
            b.wait(1900.0);
            b.hint("b1", "c1", 2, "sweep");
            let (from, to) = if stall_inside {
                (t1 + 100.0, t1 + 1850.0)
            } else {
                (b.t + 10.0, b.t + 400.0)
            };
            b.wait(500.0);
            b.line(
                "harness",
                0,
                Type::Nemesis,
                "observer-stall",
                None,
                json!({"phase": "instant", "from_ms": from, "to_ms": to,
                       "cause": "the harness was not run"}),
            );
            let r = check(&b.h, &two_rows());
            let late = r
                .anomalies
                .iter()
                .filter(|a| a.kind == Kind::D5SweepLate)
                .count();
            assert_eq!(
                late, want,
                "stall inside the gap: {stall_inside}: {:?}",
                r.anomalies
            );
        }
    }

    #[test]
    fn d5_sweep_median_too_slow() {
        let mut b = B::new();
        b.gateway_start(1000);
        b.hint("b1", "c1", 2, "sweep");
        for _ in 0..3 {
            b.wait(1799.0);
            b.hint("b1", "c1", 2, "sweep");
        }
        let late = only(&b, &two_rows(), Kind::D5SweepLate);
        assert_eq!(late.len(), 1, "{late:?}");
        assert!(
            late[0].msg.contains("every 1800 ms (median of 3 gaps)"),
            "{}",
            late[0].msg
        );
        assert_eq!(late[0].entries.len(), 4);
    }

    #[test]
    fn sweep_hints_are_not_late_across_an_ack_a_reconnect_or_a_gateway_start() {
        let mut b = B::new();
        b.gateway_start(1000);
        b.hint("b1", "c1", 2, "sweep");
        b.wait(5000.0);
        b.ack("b1", "c1", 2, false, 2); // caught up: the next hint is a new episode
        b.wait(5000.0);
        b.hint("b1", "c1", 3, "sweep");
        b.wait(5000.0);
        b.client("b1", "disconnect");
        b.hint("b1", "c1", 3, "sweep");
        b.wait(5000.0);
        b.gateway_start(1000);
        b.hint("b1", "c1", 3, "sweep");
        b.hint("b1", "c1", 3, "overflow"); // not a sweep hint
        b.hint("a1", "c1", 3, "sweep"); // another device
        b.wait(900.0);
        b.hint("b1", "c1", 3, "sweep");
        // An ack below the head does not end the episode, and the gap is fine.
        b.ack("b1", "c1", 2, false, 2);
        b.hint("b1", "c1", 3, "sweep");
        let r = check(&b.h, &two_rows());
        assert_eq!(r.counts[&Kind::D5SweepLate], 0, "{:?}", r.anomalies);
        assert_eq!(r.stats.sweep_hint_gaps_ms.n, 2);
    }

    /// A sweep hint before the database went away and the next one after it came back
    /// are not one late interval (a failover under pg_auto_failover takes seconds); a gap
    /// after the fault is judged again.
    #[test]
    fn sweep_hints_are_not_late_across_a_database_outage() {
        let mut b = B::new();
        b.gateway_start(1000);
        b.hint("b1", "c1", 2, "sweep");
        b.wait(100.0);
        b.line(
            "harness",
            0,
            Type::Nemesis,
            "pg-primary-kill",
            None,
            json!({"phase": "start"}),
        );
        b.wait(6900.0);
        b.hint("b1", "c1", 2, "sweep");
        b.wait(1500.0);
        b.hint("b1", "c1", 2, "sweep");
        // Until the address moves to the promoted standby, the sweep's queries time out.
        b.wait(2500.0);
        b.hint("b1", "c1", 2, "sweep");
        assert!(only(&b, &two_rows(), Kind::D5SweepLate).is_empty());
        b.line(
            "harness",
            0,
            Type::Nemesis,
            "db-address-switch",
            None,
            json!({"phase": "instant", "to": "127.0.0.1:5433"}),
        );
        b.hint("b1", "c1", 2, "sweep");
        b.wait(2500.0);
        let h = b.hint("b1", "c1", 2, "sweep");
        let late = only(&b, &two_rows(), Kind::D5SweepLate);
        assert_eq!(late.len(), 1, "{late:?}");
        assert_eq!(late[0].entries[1], h);
    }

    /// A crashed database is down until a restart succeeds: a failed restart excuses the
    /// gaps after it too; after a successful one, gaps are judged again.
    #[test]
    fn sweep_hints_are_not_judged_until_the_database_is_restarted() {
        let mut b = B::new();
        b.gateway_start(200);
        let nemesis = |b: &mut B, op: &str, id: u64, v: Value| {
            b.line("harness", 0, Type::Nemesis, op, Some(id), v);
        };
        nemesis(&mut b, "pg-crash", 1, json!({"phase": "start"}));
        nemesis(&mut b, "pg-crash", 1, json!({"phase": "end", "ok": true}));
        for _ in 0..4 {
            b.hint("b1", "c1", 2, "sweep");
            b.wait(1500.0);
        }
        nemesis(&mut b, "pg-restart", 2, json!({"phase": "start"}));
        nemesis(
            &mut b,
            "pg-restart",
            2,
            json!({"phase": "end", "ok": false}),
        );
        for _ in 0..4 {
            b.hint("b1", "c1", 2, "sweep");
            b.wait(1500.0);
        }
        assert!(only(&b, &two_rows(), Kind::D5SweepLate).is_empty());
        nemesis(&mut b, "pg-restart", 3, json!({"phase": "start"}));
        nemesis(&mut b, "pg-restart", 3, json!({"phase": "end", "ok": true}));
        b.hint("b1", "c1", 2, "sweep");
        b.wait(1500.0);
        let h = b.hint("b1", "c1", 2, "sweep");
        let late = only(&b, &two_rows(), Kind::D5SweepLate);
        assert_eq!(late.len(), 1, "{late:?}");
        assert_eq!(late[0].entries[1], h);
    }

    /// Issue 10: hints received while a nemesis fault is in force (here a gateway pause)
    /// are not judged, nor a gap that spans its start or end; a membership change excuses
    /// nothing; a late gap with no fault in force is still caught.
    #[test]
    fn sweep_hints_are_not_judged_while_a_fault_is_in_force() {
        let pause = json!({"id": 1, "at_ms": 100, "end_ms": 6100, "target": "gateway",
                           "kind": "gw-pause"});
        let mut b = B::new();
        b.gateway_start(1000);
        b.hint("b1", "c1", 2, "sweep");
        b.wait(100.0);
        b.line(
            "harness",
            0,
            Type::Nemesis,
            "fault",
            Some(77),
            json!({"phase": "start", "fault": pause.clone(), "healed": false}),
        );
        b.wait(3000.0);
        b.hint("b1", "c1", 2, "sweep");
        b.wait(3000.0);
        b.hint("b1", "c1", 2, "sweep");
        b.line(
            "harness",
            0,
            Type::Nemesis,
            "fault",
            Some(77),
            json!({"phase": "end", "fault": pause, "healed": false}),
        );
        b.wait(900.0);
        b.hint("b1", "c1", 2, "sweep");
        b.wait(900.0);
        b.hint("b1", "c1", 2, "sweep");
        assert!(only(&b, &two_rows(), Kind::D5SweepLate).is_empty());
        b.line(
            "harness",
            0,
            Type::Nemesis,
            "membership",
            None,
            json!({"phase": "instant", "action": "join", "conv": "c1", "user": "carol",
                   "applied_by_an_earlier_attempt": false}),
        );
        b.wait(2500.0);
        let h = b.hint("b1", "c1", 2, "sweep");
        let late = only(&b, &two_rows(), Kind::D5SweepLate);
        assert_eq!(late.len(), 1, "{late:?}");
        assert_eq!(late[0].entries[1], h);
    }

    /// Issue 10: a frame dropped by the gateway (a push, an ack before it takes effect)
    /// leaves the sweep alone, so a late gap while it is in force is caught; a dropped
    /// ack reply is not judged (the ack took effect and the sweep stopped hinting).
    #[test]
    fn sweep_hints_are_judged_while_a_harmless_fault_is_in_force() {
        let fault = |b: &mut B, id: u64, point: &str, phase: &str| {
            let f = json!({"id": id, "at_ms": 0, "end_ms": 2000, "target": "gateway",
                           "kind": "gw-fault", "point": point, "action": "drop"});
            let v = json!({"phase": phase, "fault": f, "healed": false});
            b.line("harness", 0, Type::Nemesis, "fault", Some(id), v);
        };
        let mut b = B::new();
        b.gateway_start(500);
        fault(&mut b, 5, "gw.recv.ack", "start");
        b.hint("b1", "c1", 2, "sweep");
        b.wait(1600.0);
        let h = b.hint("b1", "c1", 2, "sweep");
        fault(&mut b, 5, "gw.recv.ack", "end");
        let late = only(&b, &two_rows(), Kind::D5SweepLate);
        assert_eq!(late.len(), 1, "{late:?}");
        assert_eq!(late[0].entries[1], h);

        let mut b = B::new();
        b.gateway_start(500);
        fault(&mut b, 6, "gw.reply.ack", "start");
        b.hint("b1", "c1", 2, "sweep");
        b.wait(1600.0);
        b.hint("b1", "c1", 2, "sweep");
        fault(&mut b, 6, "gw.reply.ack", "end");
        assert!(only(&b, &two_rows(), Kind::D5SweepLate).is_empty());
    }

    #[test]
    fn sweep_ms_falls_back_to_the_final_read() {
        let mut b = B::new();
        b.hint("b1", "c1", 2, "sweep");
        b.wait(2500.0);
        b.hint("b1", "c1", 2, "sweep");
        let mut f = two_rows();
        assert_eq!(only(&b, &f, Kind::D5SweepLate).len(), 1);
        f.sweep_ms = 2000;
        assert!(only(&b, &f, Kind::D5SweepLate).is_empty());
    }

    #[test]
    fn store_mismatch_state_file_or_two_mids_for_one_seq() {
        let mut b = B::new();
        let p1 = b.push("b1", "c1", 1, "m1");
        let st = b.store("b1", "push", "c1", &[(1, "m1")]);
        let s2 = b.sync("b1", "c1", 0, &[(1, "zz")], 2);
        let mut f = two_rows();
        state_file(&mut f, "b1", &[(1, "m1"), (2, "bad"), (3, "m3")]);
        let sm = only(&b, &f, Kind::StoreMismatch);
        assert_eq!(sm.len(), 3, "{sm:?}");
        assert_eq!(sm[0].entries, vec![p1, s2]);
        assert_eq!(
            sm[0].msg,
            format!("b1 received c1:1 as mid m1 (line {p1}) and as mid zz (line {s2})")
        );
        assert!(sm
            .iter()
            .any(|a| a.msg == "b1's state file holds c1:2 = mid bad but the row has mid m2"));
        assert!(sm
            .iter()
            .any(|a| a.msg
                == "b1's state file holds c1:3 = mid m3 but the final read has no such row"));
        assert!(st > p1);
    }

    #[test]
    fn a_push_received_twice_with_one_mid_is_not_a_mismatch() {
        let mut b = B::new();
        b.push("b1", "c1", 1, "m1");
        b.push("b1", "c1", 1, "m1");
        b.store("b1", "push", "c1", &[(1, "m1")]);
        b.sync("b1", "c1", 0, &[(1, "m1")], 1);
        let mut f = fin(&[("c1", 1, "m1", "a1", "x1")]);
        state_file(&mut f, "b1", &[(1, "m1")]);
        let r = check(&b.h, &f);
        assert_eq!(r.counts[&Kind::StoreMismatch], 0, "{:?}", r.anomalies);
    }

    #[test]
    fn reply_or_push_before_commit_when_a_probe_misses_the_row() {
        let mut b = B::new();
        let ok = b.send("a1", "c1", "x1", 1, "m1");
        let pr = b.probe(ok, "c1", 1, "m1", None, None);
        let p = b.push("b1", "c1", 1, "m1");
        let pp = b.probe(p, "c1", 1, "m1", Some("other"), None);
        let r = check(&b.h, &fin(&[("c1", 1, "m1", "a1", "x1")]));
        let k: Vec<_> = r
            .anomalies
            .iter()
            .map(|a| (a.kind, a.entries.clone()))
            .collect();
        assert_eq!(
            k,
            vec![
                (Kind::ReplyBeforeCommit, vec![ok, pr]),
                (Kind::PushBeforeCommit, vec![p, pp])
            ]
        );
        assert_eq!(
            r.anomalies[0].msg,
            format!("a1's sent reply c1:1 (mid m1, line {ok}) was not visible to another session: found no row (probe line {pr})")
        );
        assert_eq!(
            r.summary(),
            "FAIL: 2 anomalies: reply-before-commit=1, push-before-commit=1"
        );
    }

    #[test]
    fn a_probe_with_an_error_is_ignored() {
        let mut b = B::new();
        let ok = b.send("a1", "c1", "x1", 1, "m1");
        b.probe(ok, "c1", 1, "m1", None, Some("connection refused"));
        let r = check(&b.h, &fin(&[("c1", 1, "m1", "a1", "x1")]));
        assert_eq!(r.verdict, Verdict::Pass, "{:?}", r.anomalies);
        assert_eq!(
            r.stats.probes,
            ProbeCounts {
                total: 1,
                visible: 0,
                errors: 1
            }
        );
    }

    #[test]
    fn anomalies_are_ordered_by_kind_then_first_entry() {
        let mut b = B::new();
        let ok = b.send("a1", "c1", "x1", 1, "m1");
        b.probe(ok, "c1", 1, "m1", None, None);
        b.send("a1", "c1", "x9", 9, "m9");
        let f = fin(&[("c1", 1, "m1", "a1", "x1"), ("c1", 3, "m3", "z1", "q")]);
        let k = kinds(&b, &f);
        assert_eq!(
            k,
            vec!["lost", "unexpected", "p1-gap", "reply-before-commit"]
        );
    }

    #[test]
    fn load_dir_reads_both_files_and_refuses_another_schema() {
        let tmp = tempfile::Builder::new()
            .prefix("imfault-checker-")
            .tempdir()
            .unwrap();
        let dir = tmp.path().to_path_buf();
        let mut b = B::new();
        b.send("a1", "c1", "x1", 1, "m1");
        let lines: Vec<String> =
            b.h.iter()
                .map(|e| serde_json::to_string(e).unwrap())
                .collect();
        std::fs::write(dir.join("history.jsonl"), lines.join("\n") + "\n").unwrap();
        let f = fin(&[("c1", 1, "m1", "a1", "x1")]);
        std::fs::write(dir.join("final.json"), serde_json::to_string(&f).unwrap()).unwrap();
        let (h, f2) = load_dir(&dir).unwrap();
        assert_eq!((h, f2), (b.h.clone(), f));

        std::fs::write(dir.join("final.json"), r#"{"schema_version": 2}"#).unwrap();
        let e = load_dir(&dir).unwrap_err().to_string();
        assert!(e.contains("schema_version Some(2)"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
        let e = format!("{:#}", load_dir(&dir).unwrap_err());
        assert!(e.contains("history.jsonl"), "{e}");
    }

    #[test]
    fn a_history_of_twenty_thousand_lines_is_judged_quickly() {
        let mut b = B::new();
        let n = 3000;
        let mut rows = Vec::new();
        let mids: Vec<String> = (1..=n).map(|q| format!("m{q}")).collect();
        let cmids: Vec<String> = (1..=n).map(|q| format!("x{q}")).collect();
        for q in 1..=n {
            let (mid, cmid) = (&mids[q as usize - 1], &cmids[q as usize - 1]);
            let ok = b.send("a1", "c1", cmid, q, mid);
            b.probe(ok, "c1", q, mid, Some(mid), None);
            b.push("b1", "c1", q, mid);
            b.store("b1", "push", "c1", &[(q, mid)]);
            b.ack("b1", "c1", q, false, q);
            rows.push(("c1", q, mid.as_str(), "a1", cmid.as_str()));
        }
        assert!(b.h.len() > 20_000);
        let started = std::time::Instant::now();
        let r = check(&b.h, &fin(&rows));
        assert_eq!(r.verdict, Verdict::Pass, "{:?}", &r.anomalies[..1]);
        assert_eq!(r.stats.delivery_ms.n, n as u64);
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
    }
}
