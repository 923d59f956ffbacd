//! The shape of `evidence/bench/result.json` (documented field by field in
//! `evidence/README.md`; bump [`SCHEMA_VERSION`] on any incompatible change). Plain
//! structs: no `flatten`, no `untagged`.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::cpu::{CpuPerOp, CpuUse};
use crate::env::Environment;
use crate::pgss::StmtStat;
use crate::util::Latency;

/// 2: the single `result` became `data_integrity` and `targets_met` (with `targets`).
pub const SCHEMA_VERSION: u32 = 2;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchResult {
    pub schema_version: u32,
    pub tool: String,
    pub mode: String,
    /// `PASS` when nothing acknowledged was lost or doubled (every data check and the
    /// pgbench check passed) and every lost push of the repair part was repaired; `FAIL`
    /// otherwise, or when a part that checks data errored (nothing can be vouched for).
    #[serde(default)]
    pub data_integrity: String,
    /// `FAIL` when a target of [`BenchResult::targets`] was missed, `PASS` when every one
    /// was judged and met, `NOT_RUN` otherwise (some could not be judged, none missed).
    #[serde(default)]
    pub targets_met: String,
    /// The ids of the missed targets, each with its figure (`id: observed > limit unit`).
    #[serde(default)]
    pub targets_missed: Vec<String>,
    /// Why the run is incomplete or its data is in doubt (exit status 1 when not empty).
    pub failures: Vec<String>,
    /// The performance targets, each judged against its limit (never the exit status).
    #[serde(default)]
    pub targets: Vec<Target>,
    pub environment: Environment,
    pub parameters: Params,
    pub send_path: Section<SendPath>,
    pub fanout: Section<Fanout>,
    pub sweep: Section<Sweep>,
    pub repair: Section<Repair>,
    pub findings: Vec<Finding>,
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
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct DataCheck {
    /// `PASS` when every acknowledged message is a row, `FAIL` otherwise.
    pub result: String,
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
            result: if lost == 0 && seqs_gapless {
                "PASS"
            } else {
                "FAIL"
            }
            .into(),
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
    pub result: String,
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
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SendRatios {
    pub gateway_vs_pgbench_notify_throughput: Option<f64>,
    pub gateway_vs_pgbench_plain_throughput: Option<f64>,
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

// ---------------------------------------------------------------- targets

/// One performance target: a limit from the design note or the gateway's configuration,
/// and the figure of this run it is judged on.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Target {
    pub id: String,
    /// `push`, `sweep` or `repair`.
    pub path: String,
    /// The target in one sentence, with where its limit comes from.
    pub what: String,
    /// `le` (observed <= limit) or `ge` (observed >= limit).
    pub op: String,
    pub limit: f64,
    /// The figure judged; `null` when the target could not be judged (`NOT_RUN`).
    pub observed: Option<f64>,
    pub unit: String,
    /// `MET`, `MISSED` or `NOT_RUN`.
    pub result: String,
    /// Why `NOT_RUN`, or what else the reader should know (the step's verdict), else `null`.
    pub detail: Option<String>,
}

impl Target {
    /// Judges `observed` against `limit` with `op`.
    pub fn judge(mut self) -> Target {
        self.result = match self.observed {
            None => "NOT_RUN",
            Some(v)
                if (self.op == "le" && v <= self.limit) || (self.op == "ge" && v >= self.limit) =>
            {
                "MET"
            }
            Some(_) => "MISSED",
        }
        .into();
        self
    }
}

// ---------------------------------------------------------------- findings

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Finding {
    pub id: String,
    /// `send`, `push`, `sweep`, `repair` or `gateway`.
    pub path: String,
    pub claim: String,
    pub figures: BTreeMap<String, f64>,
}
