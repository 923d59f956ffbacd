//! The shape of `evidence/bench/result.json` (documented field by field in
//! `evidence/README.md`; bump [`SCHEMA_VERSION`] on any incompatible change). Plain
//! structs: no `flatten`, no `untagged`.

pub use im_check::Verdict;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::cpu::{CpuPerOp, CpuUse};
use crate::env::Environment;
use crate::pgss::StmtStat;
use crate::util::{r3, ratio, Latency};

/// 2: the single `result` became `data_integrity` and `targets_met` (with `targets`).
/// 3: flat `metrics` (name, value, unit, limit, ratio, met) replace `targets` and the prose
/// `findings`; part `two_gateways` added.
pub const SCHEMA_VERSION: u32 = 3;

/// The design note's budget of cursor writes per push (acks coalesced every 4 events).
pub const CURSOR_WRITES_PER_PUSH_BUDGET: f64 = 0.25;
/// Issue 19: a fan-out step passes only when at least this fraction of its offered frames
/// per second was delivered (with push and send p99 within the limit and no event reaching
/// a device by sync before its push).
pub const DELIVERED_MIN_FRACTION: f64 = 0.98;
/// Issue 19: headroom over the chapter-02 load. The first failing step of the ladder must be
/// at 3x or above, so every step up to this multiplier passes.
pub const HEADROOM_PASSING_MULTIPLIER: f64 = 2.0;
/// Issues 19 and 44: acknowledged sends/s against pgbench running one message per
/// transaction without NOTIFY, at least [`send_vs_plain_min`], at each concurrency of
/// [`SEND_RATIO_AT`]: group commit beats that naive ceiling wherever more than one sender
/// waits, and comes close to it with 1.
pub const SEND_RATIO_AT: [usize; 3] = [1, 8, 32];

/// The bound of [`SEND_RATIO_AT`]'s target at `c` senders (issue 44: 0.9 at 1, 1.2 at 8,
/// 1.5 at 32; issue 19's were 0.8, 1.2 and 1.2).
pub fn send_vs_plain_min(c: usize) -> f64 {
    match c {
        0 | 1 => 0.9,
        2..=8 => 1.2,
        _ => 1.5,
    }
}

/// Issue 44: the concurrency at which one send's CPU is judged against its budgets.
pub const SEND_CPU_AT: usize = 8;
/// Issue 44: the gateway's CPU per acknowledged send at [`SEND_CPU_AT`] senders, at most
/// this (µs).
pub const GATEWAY_US_PER_SEND_MAX: f64 = 60.0;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchResult {
    pub schema_version: u32,
    pub tool: String,
    pub mode: String,
    /// `PASS` when nothing acknowledged was lost or doubled (every data check and the
    /// pgbench check passed) and every lost push of the repair part was repaired; `FAIL`
    /// otherwise, or when a part that checks data errored (nothing can be vouched for).
    #[serde(default)]
    pub data_integrity: Verdict,
    /// `FAIL` when a target of [`BenchResult::targets`] was missed, `PASS` when every one
    /// was judged and met, `NOT_RUN` otherwise (some could not be judged, none missed).
    #[serde(default)]
    pub targets_met: Verdict,
    /// The missed targets, each with its figure (`name: value > limit unit`).
    #[serde(default)]
    pub targets_missed: Vec<String>,
    /// Why the run is incomplete or its data is in doubt (exit status 1 when not empty).
    pub failures: Vec<String>,
    /// Every figure of the run as one flat list; the targets are the metrics with a limit
    /// and an `op` (judged: `met`), never the exit status.
    #[serde(default)]
    pub metrics: Vec<Metric>,
    pub environment: Environment,
    pub parameters: Params,
    pub send_path: Section<SendPath>,
    pub fanout: Section<Fanout>,
    pub sweep: Section<Sweep>,
    pub repair: Section<Repair>,
    pub two_gateways: Section<TwoGateways>,
    /// Part `conns` (issue 19): one gateway holding many idle connections.
    #[serde(default = "not_selected")]
    pub conns: Section<crate::conns::Conns>,
}

fn not_selected<T>() -> Section<T> {
    Section::not_run("not in this result")
}

/// Issue 19: the gateway's resident memory per idle connection at most this, KiB.
pub const RSS_PER_CONN_MAX_KIB: f64 = 20.0;

impl crate::conns::Conns {
    /// Held connections, hellos/s, RSS per connection (target), push p99 at the active
    /// set (target: the chapter-02 bound), missing pushes, sweep time at that count.
    pub fn metrics(&self, push_p99_limit_ms: f64) -> Vec<Metric> {
        let note = self.short_because.clone();
        // Nothing held or nothing received measures nothing: unmeasured, never met.
        let rss = (self.held > 0).then_some(self.rss_per_conn_kib);
        let p99 = (self.push_latency.count > 0).then_some(self.push_latency.p99_ms);
        let mut out = vec![
            Metric::value("conns.held", self.held as f64, "connections"),
            Metric::value("conns.hellos_per_s", self.hellos_per_s, "hellos/s"),
            Metric::target(
                "conns.rss_per_conn_kib",
                rss,
                "KiB",
                "le",
                RSS_PER_CONN_MAX_KIB,
                note.clone(),
            ),
            Metric::target(
                "conns.push_p99_ms",
                p99,
                "ms",
                "le",
                push_p99_limit_ms,
                note,
            ),
            Metric::value("conns.pushes_missing", self.pushes_missing as f64, "pushes"),
        ];
        if let Some(ms) = self.sweep_db_ms_per_interval {
            out.push(Metric::value("conns.sweep_db_ms_per_interval", ms, "ms"));
        }
        out
    }
}

/// One figure of the run. A target has `op` and `limit` and is judged (`met`); a plain
/// measurement has neither; a ratio against a reference measured in the same run has the
/// reference as `limit` and no `op` unless it is a target.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Metric {
    /// `<part>.<figure>`, e.g. `push.p99_ms_at_chapter02_load`.
    pub name: String,
    /// The figure; `null` when the run did not measure it (the `note` says why).
    pub value: Option<f64>,
    pub unit: String,
    /// The bound of a target, or the reference figure of a ratio; `null` otherwise.
    pub limit: Option<f64>,
    /// `le` (value <= limit) or `ge` (value >= limit) for a target; `null` otherwise.
    pub op: Option<String>,
    /// `value / limit`; `null` without both.
    pub ratio: Option<f64>,
    /// Whether a target was met; `null` for a measurement or a target not measured.
    pub met: Option<bool>,
    /// Where the limit comes from, or why there is no value; `null` when nothing to say.
    pub note: Option<String>,
}

impl Metric {
    /// A plain measurement.
    pub fn value(name: &str, value: f64, unit: &str) -> Metric {
        Metric {
            name: name.into(),
            value: Some(r3(value)),
            unit: unit.into(),
            ..Default::default()
        }
    }

    /// `a / b` as a measurement (unit `ratio`), with `b` as the reference.
    pub fn ratio_of(name: &str, a: f64, b: f64) -> Metric {
        Metric {
            name: name.into(),
            value: ratio(a, b),
            unit: "ratio".into(),
            ..Default::default()
        }
    }

    /// A target: `value op limit`, judged (`met` stays `null` without a value).
    pub fn target(
        name: &str,
        value: Option<f64>,
        unit: &str,
        op: &str,
        limit: f64,
        note: Option<String>,
    ) -> Metric {
        let value = value.map(r3);
        let met = value.map(|v| if op == "le" { v <= limit } else { v >= limit });
        Metric {
            name: name.into(),
            value,
            unit: unit.into(),
            limit: Some(r3(limit)),
            op: Some(op.into()),
            ratio: value.and_then(|v| ratio(v, limit)),
            met,
            note,
        }
    }

    pub fn is_target(&self) -> bool {
        self.op.is_some()
    }
}

/// `targets_met` and `targets_missed` from the metrics: `FAIL` when a target was missed,
/// `PASS` when every target was measured and met, `NOT_RUN` otherwise (a target that
/// could not be measured is never counted as met).
pub fn targets_met(metrics: &[Metric]) -> (Verdict, Vec<String>) {
    let targets: Vec<&Metric> = metrics.iter().filter(|m| m.is_target()).collect();
    let missed: Vec<String> = targets
        .iter()
        .filter(|m| m.met == Some(false))
        .map(|m| {
            format!(
                "{}: {} {} {} {}",
                m.name,
                m.value.map_or("?".into(), |v| format!("{v}")),
                if m.op.as_deref() == Some("le") {
                    ">"
                } else {
                    "<"
                },
                m.limit.unwrap_or_default(),
                m.unit
            )
        })
        .collect();
    let verdict = if !missed.is_empty() {
        Verdict::Fail
    } else if !targets.is_empty() && targets.iter().all(|m| m.met == Some(true)) {
        Verdict::Pass
    } else {
        Verdict::NotRun
    };
    (verdict, missed)
}

/// One part of the bench: whether it ran, why not, and its figures.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Section<T> {
    /// `ok`, `error` (it started and failed) or `not_run`.
    pub status: String,
    pub reason: Option<String>,
    /// Wall time of the part, seconds.
    pub wall_s: f64,
    pub data: Option<T>,
}

impl<T> Section<T> {
    pub fn not_run(reason: impl Into<String>) -> Section<T> {
        Section {
            status: "not_run".into(),
            reason: Some(reason.into()),
            wall_s: 0.0,
            data: None,
        }
    }

    pub fn from(r: anyhow::Result<T>, wall_s: f64) -> Section<T> {
        match r {
            Ok(d) => Section {
                status: "ok".into(),
                reason: None,
                wall_s,
                data: Some(d),
            },
            Err(e) => Section {
                status: "error".into(),
                reason: Some(format!("{e:#}")),
                wall_s,
                data: None,
            },
        }
    }
}

/// Every size and duration of the run (the mode's preset).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Params {
    pub seed: u64,
    pub send_concurrency: Vec<usize>,
    pub send_conversations: usize,
    pub send_warmup_s: u64,
    pub send_duration_s: u64,
    pub send_rounds: usize,
    pub body_bytes: usize,
    pub fanout_user_pairs: usize,
    pub fanout_convs_per_pair: usize,
    pub fanout_receivers_per_user: [usize; 2],
    pub fanout_senders_per_pair: usize,
    pub fanout_base_frames_per_s: f64,
    pub fanout_start_multiplier: f64,
    pub fanout_up: Vec<f64>,
    pub fanout_down: Vec<f64>,
    pub fanout_step_s: f64,
    pub fanout_p99_limit_ms: f64,
    pub fanout_diagnostic_env: Vec<String>,
    pub ws_ceiling_s: f64,
    pub sweep_devices: Vec<usize>,
    pub sweep_convs_per_device: usize,
    pub sweep_users_per_conversation: usize,
    pub sweep_lag_percents: Vec<f64>,
    pub sweep_repeats: usize,
    pub sweep_explain_max_devices: usize,
    pub sweep_set_based_max_devices: usize,
    pub repair_sweep_ms: Vec<u64>,
    pub repair_trials: Vec<usize>,
    pub repair_lanes: usize,
    /// Part `two_gateways`: conversations (one sender each), subscribed receivers per
    /// conversation, and seconds of load per configuration.
    pub two_gateways_conversations: usize,
    pub two_gateways_receivers: usize,
    pub two_gateways_s: f64,
    /// Part `conns` (issue 19): connections asked for (fewer when the open-file limit is
    /// lower: the result says so), seconds of load at the active set and its messages/s.
    #[serde(default)]
    pub conns_target: usize,
    #[serde(default)]
    pub conns_send_s: f64,
    #[serde(default)]
    pub conns_rate_per_s: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct DataCheck {
    /// `PASS` when every acknowledged message is a row, `FAIL` otherwise.
    pub result: Verdict,
    pub acknowledged: u64,
    pub found: u64,
    pub lost: u64,
    /// P1 over the part's conversations (heads equal row counts and max seq).
    pub seqs_gapless: bool,
}

impl DataCheck {
    /// PASS only when nothing acknowledged is missing and the seqs are gapless.
    pub fn new(acknowledged: u64, found: u64, lost: u64, seqs_gapless: bool) -> DataCheck {
        DataCheck {
            result: Verdict::of(lost == 0 && seqs_gapless),
            acknowledged,
            found,
            lost,
            seqs_gapless,
        }
    }
}

// ---------------------------------------------------------------- send path

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SendPath {
    pub conversations: usize,
    pub body_bytes: usize,
    pub warmup_s: u64,
    pub duration_s: u64,
    pub rounds: usize,
    /// Gateway settings that bound the send path (defaults of `serve`).
    pub gateway_db_pool_max: u32,
    pub round_trip_ping: Latency,
    pub round_trip_select1: Latency,
    pub pgbench_script_plain: String,
    pub pgbench_script_notify: String,
    pub levels: Vec<SendLevel>,
    pub data_check: DataCheck,
    pub pgbench_check: PgbenchCheck,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PgbenchCheck {
    /// `PASS` when every transaction pgbench logged as done is a row.
    pub result: Verdict,
    /// Transactions pgbench logged as done (all runs).
    pub logged: u64,
    /// Rows with a pgbench cmid in `events` afterwards.
    pub rows: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SendLevel {
    pub concurrency: usize,
    pub gateway: SendRun,
    pub pgbench_plain: Option<SendRun>,
    pub pgbench_notify: Option<SendRun>,
    /// (b) with `synchronous_commit=off` for pgbench's sessions: the cost of the WAL flush.
    pub pgbench_notify_async_commit: Option<SendRun>,
    /// (d) issue 19: `pgbench_batch_rows` messages per transaction (the gateway's batch
    /// size at this concurrency); `ops` and `ops_per_s` count messages.
    #[serde(default)]
    pub pgbench_batch: Option<SendRun>,
    #[serde(default)]
    pub pgbench_batch_rows: usize,
    pub ratios: SendRatios,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SendRun {
    /// `gateway`, `pgbench_plain` (a) or `pgbench_notify` (b).
    pub driver: String,
    /// Sends acknowledged (transactions done) inside the measured window.
    pub ops: u64,
    pub ops_per_s: f64,
    pub latency: Latency,
    /// Sends answered with an error or not answered (gateway), failed transactions (pgbench).
    pub errors: u64,
    /// Operations over the whole run, warm-up included (the CPU and statement figures' base).
    pub ops_total: u64,
    pub cpu: CpuUse,
    pub cpu_per_op: CpuPerOp,
    /// `pg_stat_statements` over the whole run, largest first.
    pub statements: Vec<StmtStat>,
    /// Sum of statement execution time per operation, ms.
    pub db_ms_per_op: Option<f64>,
    /// Per label: statement execution time per operation, ms.
    pub db_ms_per_op_by_label: BTreeMap<String, f64>,
    /// The gateway's sends per group commit: operations over the whole run per call of
    /// the `send_batch` statement (`None` for pgbench, or without `pg_stat_statements`).
    #[serde(default)]
    pub rows_per_batch: Option<f64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SendRatios {
    pub gateway_vs_pgbench_notify_throughput: Option<f64>,
    pub gateway_vs_pgbench_plain_throughput: Option<f64>,
    #[serde(default)]
    pub gateway_vs_pgbench_batch_throughput: Option<f64>,
    pub pgbench_notify_vs_plain_throughput: Option<f64>,
    pub pgbench_sync_vs_async_commit_throughput: Option<f64>,
    pub gateway_vs_pgbench_notify_p50_latency: Option<f64>,
    pub gateway_vs_pgbench_notify_p99_latency: Option<f64>,
}

// ---------------------------------------------------------------- fan-out

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Fanout {
    pub receiver: String,
    pub user_pairs: usize,
    pub conversations: usize,
    pub receivers: usize,
    pub sender_connections: usize,
    pub frames_per_message: usize,
    pub base_frames_per_s: f64,
    pub p99_limit_ms: f64,
    pub gateway_sweep_ms: u64,
    pub steps: Vec<FanoutStep>,
    /// The chapter-02 step again on a gateway with one setting changed.
    pub diagnostics: Vec<FanoutDiagnostic>,
    pub max_passing_frames_per_s: Option<f64>,
    pub stop_reason: String,
    pub ws_ceiling: WsCeiling,
    pub ratios: FanoutRatios,
    pub data_check: DataCheck,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FanoutStep {
    pub multiplier: f64,
    pub target_frames_per_s: f64,
    pub target_messages_per_s: f64,
    /// Events each (device, conversation) receives per second at the target rate: what
    /// decides how well acks coalesce (4 events inside 50 ms needs 80/s).
    pub events_per_device_conversation_per_s: f64,
    pub duration_s: f64,
    pub messages_acked: u64,
    pub messages_per_s: f64,
    pub send_errors: u64,
    pub sends_skipped: u64,
    pub send_latency: Latency,
    pub frames_expected: u64,
    pub frames_received: u64,
    pub frames_pushed: u64,
    pub events_via_sync: u64,
    pub events_never_pushed: u64,
    pub frames_lost: u64,
    pub frames_per_s: f64,
    pub push_latency: Latency,
    pub push_after_sent_reply: Latency,
    pub acks_sent: u64,
    pub acked_replies: u64,
    pub ack_errors: u64,
    pub cursor_writes_per_push: Option<f64>,
    pub ack_upserts_db: Option<u64>,
    pub hints_sweep: u64,
    pub hints_overflow: u64,
    pub hints_ahead: u64,
    pub syncs: u64,
    pub gaps: u64,
    pub duplicates: u64,
    pub cpu: CpuUse,
    pub cpu_per_frame: CpuPerOp,
    pub statements: Vec<StmtStat>,
    pub db_ms_per_frame_by_label: BTreeMap<String, f64>,
    pub passed: bool,
    pub verdict: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FanoutDiagnostic {
    /// `IM_NAME=VALUE` the gateway ran with on top of its defaults.
    pub gateway_env: Vec<String>,
    pub step: FanoutStep,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct WsCeiling {
    pub frames_per_s: f64,
    pub receivers: usize,
    pub duration_s: f64,
    pub server: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FanoutRatios {
    pub max_passing_vs_ws_ceiling: Option<f64>,
    pub max_passing_vs_pgbench_notify_frames: Option<f64>,
    pub base_load_vs_max_passing: Option<f64>,
}

// ---------------------------------------------------------------- sweep

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Sweep {
    pub simulated: String,
    pub convs_per_device: usize,
    pub users_per_conversation: usize,
    pub head: i64,
    pub rows: Vec<SweepRow>,
    pub growth: Vec<SweepGrowth>,
    pub gateway_sweep_interval_ms_default: u64,
    pub gateway_db_timeout_ms_default: u64,
    /// `im_gateway::sweep::FULL_PASS_EVERY_INTERVALS`.
    #[serde(default)]
    pub full_pass_every_intervals: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SweepRow {
    pub devices: usize,
    pub pairs: u64,
    pub lag_percent: f64,
    pub lagging_pairs: u64,
    pub rows_returned: u64,
    pub wall_ms: Vec<f64>,
    pub wall_ms_median: f64,
    pub db_exec_ms: Option<f64>,
    pub explain: Option<Explain>,
    pub us_per_pair: f64,
    pub set_based_wall_ms: Option<f64>,
    pub set_based_rows: Option<u64>,
    pub set_based_vs_gateway: Option<f64>,
    pub over_sweep_interval: bool,
    pub over_db_timeout: bool,
    pub provision_s: f64,
    /// Candidate pairs the regular sweep asked about (`wall_ms`: that query).
    #[serde(default)]
    pub interval_candidates: u64,
    /// Lagging pairs the regular sweep hints from memory (no query).
    #[serde(default)]
    pub hinted_from_memory: u64,
    /// The paged full pass, where it ran.
    #[serde(default)]
    pub full_pass: Option<FullPassRow>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FullPassRow {
    pub pages: usize,
    pub page_installs: usize,
    pub wall_ms: f64,
    pub page_ms_max: f64,
    /// `pg_stat_statements` total of its lagging queries.
    pub db_ms: Option<f64>,
    pub found: u64,
    /// Seeded lagging pairs not found / found but not seeded (both 0, else the part fails).
    pub missed: u64,
    pub extra: u64,
    pub us_per_pair: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Explain {
    pub execution_ms: f64,
    pub planning_ms: f64,
    pub shared_hit_blocks: u64,
    pub shared_read_blocks: u64,
    pub temp_written_blocks: u64,
    pub top_node: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SweepGrowth {
    pub lag_percent: f64,
    pub from_devices: usize,
    pub to_devices: usize,
    pub size_ratio: f64,
    pub wall_ratio: f64,
    /// `log(wall_ratio) / log(size_ratio)`: 1 is linear growth.
    pub exponent: f64,
}

// ---------------------------------------------------------------- repair

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Repair {
    pub gateway_bin: String,
    pub gateway_version: String,
    pub fault: String,
    pub lanes: usize,
    pub seed: u64,
    pub definition: String,
    pub intervals: Vec<RepairInterval>,
    pub data_check: DataCheck,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RepairInterval {
    pub sweep_ms: u64,
    pub trials: usize,
    pub repaired: usize,
    pub unrepaired: usize,
    pub pushes_received: u64,
    pub repair: Latency,
    pub detect: Latency,
    pub sync_rtt: Latency,
    pub to_acked: Latency,
    pub d5_bound_ms: f64,
    pub within_bound: f64,
    pub p99_vs_interval: Option<f64>,
    pub wall_s: f64,
}

// ---------------------------------------------------------------- two_gateways

/// One configuration's figures (part `two_gateways`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TwoGatewaysRun {
    pub gateways: usize,
    pub sends_acked: u64,
    pub sends_per_s: f64,
    pub pushes: u64,
    pub pushes_per_s: f64,
    pub send_errors: u64,
}

/// The part's figures: the two runs and the data check over both.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TwoGateways {
    pub conversations: usize,
    pub receivers_per_conversation: usize,
    pub duration_s: f64,
    pub one: TwoGatewaysRun,
    pub two: TwoGatewaysRun,
    pub data_check: DataCheck,
}

// ---------------------------------------------------------------- metrics

/// Why a part has no figures (`<part> <status>: <reason>`).
fn absent<T>(part: &str, s: &Section<T>) -> Option<String> {
    Some(format!(
        "{part} {}: {}",
        s.status,
        s.reason.clone().unwrap_or_default()
    ))
}

/// One send level's metrics: its sends/s and latency, the ratios against pgbench with
/// NOTIFY and batched, issue 44's target against pgbench without NOTIFY where one is set,
/// and its CPU budgets at [`SEND_CPU_AT`].
fn level_metrics(l: &SendLevel, out: &mut Vec<Metric>) {
    let c = l.concurrency;
    let g = &l.gateway;
    out.push(Metric::value(
        &format!("send.c{c}.sends_per_s"),
        g.ops_per_s,
        "sends/s",
    ));
    out.push(Metric::value(
        &format!("send.c{c}.p50_ms"),
        g.latency.p50_ms,
        "ms",
    ));
    out.push(Metric::value(
        &format!("send.c{c}.p99_ms"),
        g.latency.p99_ms,
        "ms",
    ));
    if let Some(r) = g.rows_per_batch {
        out.push(Metric::value(
            &format!("send.c{c}.rows_per_batch"),
            r,
            "sends/batch",
        ));
    }
    if let Some(b) = &l.pgbench_notify {
        let mut m = Metric::ratio_of(
            &format!("send.c{c}.gateway_vs_pgbench_notify"),
            g.ops_per_s,
            b.ops_per_s,
        );
        m.limit = Some(b.ops_per_s);
        out.push(m);
    }
    if let Some(d) = &l.pgbench_batch {
        let mut m = Metric::ratio_of(
            &format!("send.c{c}.gateway_vs_pgbench_batch"),
            g.ops_per_s,
            d.ops_per_s,
        );
        m.limit = Some(d.ops_per_s);
        out.push(m);
    }
    let plain = l.pgbench_plain.as_ref().map(|a| a.ops_per_s);
    if c == SEND_CPU_AT {
        cpu_metrics(Some(l), out);
    }
    if SEND_RATIO_AT.contains(&c) {
        let mut m = Metric::target(
                &format!("send.c{c}.gateway_vs_pgbench_plain"),
                l.ratios.gateway_vs_pgbench_plain_throughput,
                "ratio",
                "ge",
                send_vs_plain_min(c),
                Some("issue 44: acknowledged sends/s vs pgbench running one message per transaction without NOTIFY".into()),
            );
        if plain.is_none() {
            m.note = Some("no pgbench on this machine".into());
        }
        out.push(m);
    } else if let Some(a) = plain {
        out.push(Metric::ratio_of(
            &format!("send.c{c}.gateway_vs_pgbench_plain"),
            g.ops_per_s,
            a,
        ));
    }
}

/// Issue 44's CPU budgets of one send at [`SEND_CPU_AT`] senders: the gateway's at most
/// [`GATEWAY_US_PER_SEND_MAX`], PostgreSQL's no more than it spends on one of pgbench
/// plain's inserts in the same run (each over the whole run, warm-up included). Without
/// the level (a mode that does not run it) both stay targets, unmeasured, never met.
fn cpu_metrics(l: Option<&SendLevel>, out: &mut Vec<Metric>) {
    let c = SEND_CPU_AT;
    let why = |s: &str| match l {
        Some(_) => s.to_string(),
        None => format!("{c} senders not run in this mode"),
    };
    out.push(Metric::target(
        &format!("send.c{c}.gateway_cpu_us_per_send"),
        l.and_then(|l| l.gateway.cpu_per_op.gateway_us),
        "us",
        "le",
        GATEWAY_US_PER_SEND_MAX,
        Some(why("issue 44: the gateway's CPU per acknowledged send")),
    ));
    let plain = l
        .and_then(|l| l.pgbench_plain.as_ref())
        .and_then(|a| a.cpu_per_op.postgres_us);
    let mut m = Metric::target(
        &format!("send.c{c}.postgres_cpu_us_per_send_vs_pgbench_plain"),
        l.and_then(|l| l.gateway.cpu_per_op.postgres_us)
            .zip(plain)
            .and_then(|(g, p)| ratio(g, p)),
        "ratio",
        "le",
        1.0,
        Some(why(
            "issue 44: PostgreSQL's CPU per send over its CPU per pgbench plain insert",
        )),
    );
    if l.is_some() && plain.is_none() {
        m.note = Some("no pgbench on this machine".into());
    }
    out.push(m);
}

impl SendPath {
    /// Per concurrency: acknowledged sends/s, latency, the ratios against pgbench in the
    /// same run; the targets against pgbench without NOTIFY at [`SEND_RATIO_AT`] and the CPU
    /// budgets at [`SEND_CPU_AT`].
    pub fn metrics(&self) -> Vec<Metric> {
        let mut out = Vec::new();
        for l in &self.levels {
            level_metrics(l, &mut out);
        }
        for c in SEND_RATIO_AT {
            if !self.levels.iter().any(|l| l.concurrency == c) {
                out.push(Metric::target(
                    &format!("send.c{c}.gateway_vs_pgbench_plain"),
                    None,
                    "ratio",
                    "ge",
                    send_vs_plain_min(c),
                    Some(format!("{c} senders not run in this mode")),
                ));
            }
        }
        if !self.levels.iter().any(|l| l.concurrency == SEND_CPU_AT) {
            cpu_metrics(None, &mut out);
        }
        out
    }
}

impl Fanout {
    /// The chapter-02 targets (push p99, rate, cursor writes per push), the highest
    /// passing rate and the WebSocket ceiling.
    pub fn metrics(&self, p: &Params, mode: &str) -> Vec<Metric> {
        let base = self
            .steps
            .iter()
            .find(|s| (s.multiplier - 1.0).abs() < 1e-9);
        let why = match base {
            Some(s) => Some(format!("step verdict: {}", s.verdict)),
            None => Some(format!(
                "no step at the chapter-02 load in mode {mode} (first step at {} x)",
                p.fanout_start_multiplier
            )),
        };
        let rate = p.fanout_base_frames_per_s;
        let mut out = fanout_targets(base, p, why);
        out.push(self.headroom_target(p, mode));
        out.push(Metric::value("push.base_frames_per_s", rate, "frames/s"));
        if let Some(m) = self.max_passing_frames_per_s {
            let mut x = Metric::value("push.max_passing_frames_per_s", m, "frames/s");
            x.limit = Some(rate);
            x.ratio = ratio(m, rate);
            out.push(x);
        }
        let mut ws = Metric::value(
            "push.ws_ceiling_frames_per_s",
            self.ws_ceiling.frames_per_s,
            "frames/s",
        );
        ws.note = Some(self.ws_ceiling.server.clone());
        out.push(ws);
        for s in &self.steps {
            let name = format!("push.step_{}x", s.multiplier);
            out.push(Metric::value(
                &format!("{name}.frames_per_s"),
                s.frames_per_s,
                "frames/s",
            ));
            out.push(Metric::value(
                &format!("{name}.p99_ms"),
                s.push_latency.p99_ms,
                "ms",
            ));
            out.push(Metric::value(
                &format!("{name}.events_via_sync"),
                s.events_via_sync as f64,
                "events",
            ));
        }
        out
    }
}

impl Fanout {
    /// `push.max_passing_multiplier` (issue 19): the highest multiplier of the chapter-02
    /// load whose step passed, from 1x up without a failing step in between, at least
    /// [`HEADROOM_PASSING_MULTIPLIER`] (the first failing step at 3x or above). Unjudged
    /// when the ladder never reaches 1x or the step after the bound (a quick mode).
    fn headroom_target(&self, p: &Params, mode: &str) -> Metric {
        let mut up: Vec<&FanoutStep> = self
            .steps
            .iter()
            .filter(|s| s.multiplier >= 1.0 - 1e-9)
            .collect();
        up.sort_by(|a, b| a.multiplier.total_cmp(&b.multiplier));
        let reaches = p
            .fanout_up
            .iter()
            .any(|m| *m > HEADROOM_PASSING_MULTIPLIER + 1e-9);
        let mut passing = None;
        for s in &up {
            if !s.passed {
                break;
            }
            passing = Some(s.multiplier);
        }
        let first_failing = up.iter().find(|s| !s.passed);
        let (value, note) = if up.is_empty() || !reaches {
            (
                None,
                format!("mode {mode}: the ladder does not reach 1x and above 2x"),
            )
        } else {
            let note = match first_failing {
                Some(s) => format!(
                    "first failing step {}x ({:.0} frames/s offered): {}",
                    s.multiplier, s.target_frames_per_s, s.verdict
                ),
                None => "no step failed".to_string(),
            };
            (Some(passing.unwrap_or(0.0)), note)
        };
        Metric::target(
            "push.max_passing_multiplier",
            value,
            "x",
            "ge",
            HEADROOM_PASSING_MULTIPLIER,
            Some(note),
        )
    }
}

/// The chapter-02 push targets, judged on `base` (the 1x step) when there is one.
fn fanout_targets(base: Option<&FanoutStep>, p: &Params, why: Option<String>) -> Vec<Metric> {
    let rate = p.fanout_base_frames_per_s;
    vec![
        Metric::target(
            "push.p99_ms_at_chapter02_load",
            base.map(|s| s.push_latency.p99_ms),
            "ms",
            "le",
            p.fanout_p99_limit_ms,
            why.clone(),
        ),
        Metric::target(
            "push.frames_per_s_at_chapter02_load",
            base.map(|s| s.frames_per_s),
            "frames/s",
            "ge",
            DELIVERED_MIN_FRACTION * rate,
            why.clone(),
        ),
        Metric::target(
            "push.send_p99_ms_at_chapter02_load",
            base.map(|s| s.send_latency.p99_ms),
            "ms",
            "le",
            p.fanout_p99_limit_ms,
            why.clone(),
        ),
        Metric::target(
            "push.events_via_sync_at_chapter02_load",
            base.map(|s| s.events_via_sync as f64),
            "events",
            "le",
            0.0,
            why.clone(),
        ),
        Metric::target(
            "push.cursor_writes_per_push_at_chapter02_load",
            base.and_then(|s| s.cursor_writes_per_push),
            "writes/push",
            "le",
            CURSOR_WRITES_PER_PUSH_BUDGET,
            why,
        ),
    ]
}

impl Sweep {
    /// Per size and lag: the regular sweep's database time and the paged full pass; the
    /// targets at the largest size with lagging pairs ([`sweep_targets`]).
    pub fn metrics(&self) -> Vec<Metric> {
        let mut out = Vec::new();
        let big = self
            .rows
            .iter()
            .filter(|r| r.lag_percent > 0.0)
            .max_by_key(|r| r.devices);
        let note = big.map(|r| {
            format!(
                "{} devices x {} conversations, {}% lagging ({} candidates per interval)",
                r.devices, self.convs_per_device, r.lag_percent, r.interval_candidates
            )
        });
        let fp = big.and_then(|r| r.full_pass.as_ref());
        out.extend(sweep_targets(
            big.and_then(|r| r.db_exec_ms),
            fp.map(|f| f.page_ms_max),
            fp.map(|f| (f.missed + f.extra) as f64),
            self.gateway_db_timeout_ms_default as f64,
            note,
        ));
        for r in &self.rows {
            let name = format!("sweep.{}_devices_{}pct_lagging", r.devices, r.lag_percent);
            out.push(Metric::value(
                &format!("{name}.interval_wall_ms"),
                r.wall_ms_median,
                "ms",
            ));
            if let Some(db) = r.db_exec_ms {
                out.push(Metric::value(&format!("{name}.interval_db_ms"), db, "ms"));
            }
            if let Some(f) = &r.full_pass {
                out.push(Metric::value(
                    &format!("{name}.full_pass_wall_ms"),
                    f.wall_ms,
                    "ms",
                ));
                out.push(Metric::value(
                    &format!("{name}.full_pass_pages"),
                    f.pages as f64,
                    "pages",
                ));
                out.push(Metric::value(
                    &format!("{name}.full_pass_found"),
                    f.found as f64,
                    "pairs",
                ));
            }
        }
        out
    }
}

/// Issues 12 and 19: the regular sweep's database time per interval (at 100k devices,
/// 1% lagging); issue 19 lowered it from 20 ms to 10 ms.
pub const SWEEP_INTERVAL_DB_MS_LIMIT: f64 = 10.0;

/// The sweep targets (issue 12): the regular sweep's database time per interval at most
/// [`SWEEP_INTERVAL_DB_MS_LIMIT`], the paged full pass's largest page within the database
/// deadline, and no lagging pair missed (or invented) by the full pass.
fn sweep_targets(
    interval_db_ms: Option<f64>,
    page_ms_max: Option<f64>,
    missed: Option<f64>,
    timeout: f64,
    note: Option<String>,
) -> Vec<Metric> {
    vec![
        Metric::target(
            "sweep.interval_db_ms_at_largest",
            interval_db_ms,
            "ms",
            "le",
            SWEEP_INTERVAL_DB_MS_LIMIT,
            note.clone(),
        ),
        Metric::target(
            "sweep.full_pass_page_ms_max_at_largest",
            page_ms_max,
            "ms",
            "le",
            timeout,
            note.clone(),
        ),
        Metric::target(
            "sweep.full_pass_missed_pairs_at_largest",
            missed,
            "pairs",
            "le",
            0.0,
            note,
        ),
    ]
}

impl Repair {
    /// Per sweep interval: the lost-push repair p99 against D5's bound.
    pub fn metrics(&self) -> Vec<Metric> {
        self.intervals
            .iter()
            .map(|i| {
                Metric::target(
                    &format!("repair.p99_ms_at_sweep_{}ms", i.sweep_ms),
                    (i.repaired > 0).then_some(i.repair.p99_ms),
                    "ms",
                    "le",
                    i.d5_bound_ms,
                    Some("D5: the interval plus the sync round trip's p99".into()),
                )
            })
            .collect()
    }
}

impl TwoGateways {
    /// The flat metrics of this part (no limits: a measurement, two against one).
    pub fn metrics(&self) -> Vec<Metric> {
        let m = |name: &str, v: f64, unit: &str| Metric::value(name, v, unit);
        vec![
            m(
                "two_gateways.one.sends_per_s",
                self.one.sends_per_s,
                "sends/s",
            ),
            m(
                "two_gateways.two.sends_per_s",
                self.two.sends_per_s,
                "sends/s",
            ),
            Metric::ratio_of(
                "two_gateways.sends_two_vs_one",
                self.two.sends_per_s,
                self.one.sends_per_s,
            ),
            m(
                "two_gateways.one.pushes_per_s",
                self.one.pushes_per_s,
                "frames/s",
            ),
            m(
                "two_gateways.two.pushes_per_s",
                self.two.pushes_per_s,
                "frames/s",
            ),
            Metric::ratio_of(
                "two_gateways.pushes_two_vs_one",
                self.two.pushes_per_s,
                self.one.pushes_per_s,
            ),
        ]
    }
}

/// Every metric of a run. A part that did not run still lists its targets, unmeasured
/// (`NOT_RUN` overall, never `PASS`).
pub fn metrics(r: &BenchResult) -> Vec<Metric> {
    let p = &r.parameters;
    let mut out = Vec::new();
    match &r.send_path.data {
        Some(d) => out.extend(d.metrics()),
        None => out.extend(SEND_RATIO_AT.iter().map(|c| {
            Metric::target(
                &format!("send.c{c}.gateway_vs_pgbench_plain"),
                None,
                "ratio",
                "ge",
                send_vs_plain_min(*c),
                absent("send_path", &r.send_path),
            )
        })),
    }
    match &r.fanout.data {
        Some(d) => out.extend(d.metrics(p, &r.mode)),
        None => out.extend(fanout_targets(None, p, absent("fanout", &r.fanout))),
    }
    match &r.sweep.data {
        Some(d) => out.extend(d.metrics()),
        None => out.extend(sweep_targets(
            None,
            None,
            None,
            5000.0,
            absent("sweep", &r.sweep),
        )),
    }
    match &r.repair.data {
        Some(d) => out.extend(d.metrics()),
        None => out.push(Metric::target(
            "repair.p99_ms",
            None,
            "ms",
            "le",
            0.0,
            absent("repair", &r.repair),
        )),
    }
    if let Some(d) = &r.two_gateways.data {
        out.extend(d.metrics());
    }
    match &r.conns.data {
        Some(d) => out.extend(d.metrics(p.fanout_p99_limit_ms)),
        None => {
            for (name, unit, limit) in [
                ("conns.rss_per_conn_kib", "KiB", RSS_PER_CONN_MAX_KIB),
                ("conns.push_p99_ms", "ms", p.fanout_p99_limit_ms),
            ] {
                out.push(Metric::target(
                    name,
                    None,
                    unit,
                    "le",
                    limit,
                    absent("conns", &r.conns),
                ));
            }
        }
    }
    out
}
