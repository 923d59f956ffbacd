//! `imfault-bench`: the load generator behind `make bench`. It starts a throwaway PostgreSQL
//! cluster (harness::pg::Cluster) and the real gateway as a child process (release build,
//! no fault points), measures the send path, fan-out, the sweep query, lost-push repair and
//! two gateways against one, each against a ceiling measured in the same run, and writes
//! one JSON result (`evidence/README.md`): flat `metrics` (the targets among them) plus
//! each part's detail, and the metrics on stdout. A run that loses an acknowledged
//! message reports FAIL and exits 1. Interpretation is for README.md and
//! evidence/README.md, not for this program.
//!
//! Modes: `full` (`make bench`, evidence/bench/result.json, under 5 minutes on 2 cores),
//! `quick` (`make bench-quick`, target/bench/quick.json, under a minute), `smoke` (the
//! nextest smoke test: tiny sizes, any gateway build; timings mean nothing).
//!
//! Internal subcommands (run by the bench itself): `repair-child` (part 4 with the fault
//! build, see `repair`) and `ws-ceiling-server` (the fan-out ceiling, see `fanout`).

mod conns;
mod cpu;
mod env;
mod fanout;
mod pgbench;
mod pgss;
mod provision;
mod repair;
mod result;
mod send;
mod sweep;
mod twogw;
mod util;
mod wire;

use anyhow::{bail, Context};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use env::Environment;
use result::{BenchResult, Params, Section, Verdict};
use util::progress;

/// Everything the parts share.
pub struct Ctx {
    pub cluster: harness::pg::Cluster,
    /// The bench's own pool (checks, provisioning, the sweep query).
    pub pool: sqlx::PgPool,
    /// Whether `pg_stat_statements` is loaded.
    pub pgss: bool,
    pub pgbench: Option<PathBuf>,
    pub params: Params,
    /// Scratch directory inside the cluster's work dir (pgbench scripts and logs).
    pub tmp: PathBuf,
    /// Extra `IM_*` variables for the gateway (`--gateway-env`); empty for the evidence.
    pub gateway_env: Vec<(String, String)>,
}

impl Ctx {
    /// Starts the gateway of the send and fan-out parts (defaults plus `--gateway-env`).
    pub async fn start_gateway(&self) -> anyhow::Result<harness::gateway::Gateway> {
        let opts = harness::gateway::GatewayOpts {
            env: self.gateway_env.clone(),
            ..Default::default()
        };
        harness::gateway::Gateway::start(&self.cluster.url(), &opts, &self.cluster.log_dir()).await
    }

    /// The gateway's batch slots: `IM_BATCH_SLOTS` from `--gateway-env`, else the gateway's
    /// own default (`im_gateway::config::ENV`, the one list its `--help` prints).
    pub fn batch_slots(&self) -> usize {
        let var = "IM_BATCH_SLOTS";
        let default = im_gateway::config::ENV
            .iter()
            .find(|v| v.name == var)
            .map(|v| v.default);
        self.gateway_env
            .iter()
            .rev()
            .find(|(k, _)| k == var)
            .map(|(_, v)| v.as_str())
            .or(default)
            .and_then(|v| v.parse().ok())
            .unwrap_or(1)
            .max(1)
    }

    pub fn probe(&self, gateway: Option<u32>) -> cpu::Probe {
        cpu::Probe {
            gateway,
            postmaster: cpu::postmaster_pid(self.cluster.work_dir()),
        }
    }
}

fn preset(mode: &str, seed: u64) -> anyhow::Result<Params> {
    let full = full_params(seed);
    Ok(match mode {
        "full" => full,
        "quick" => quick_params(full),
        "smoke" => smoke_params(full),
        other => bail!("unknown mode {other:?} (full, quick, smoke)"),
    })
}

/// The `full` mode's parameters: the design note's loads.
fn full_params(seed: u64) -> Params {
    Params {
        seed,
        send_concurrency: vec![1, 8, 32],
        send_conversations: 64,
        send_warmup_s: 1,
        send_duration_s: 2,
        send_rounds: 2,
        body_bytes: 100,
        fanout_user_pairs: 8,
        fanout_convs_per_pair: 2,
        fanout_receivers_per_user: [4, 3],
        fanout_senders_per_pair: 2,
        fanout_base_frames_per_s: 9067.0,
        fanout_start_multiplier: 1.0,
        fanout_up: vec![1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0],
        fanout_down: vec![0.5, 0.25, 0.125],
        fanout_step_s: 4.0,
        // Issue 12: push p99 <= 50 ms at the chapter-02 load (was 100 ms).
        fanout_p99_limit_ms: 50.0,
        fanout_diagnostic_env: vec!["IM_FANOUT_BATCH_MAX=16".into()],
        ws_ceiling_s: 2.0,
        sweep_devices: vec![1000, 10_000, 100_000],
        sweep_convs_per_device: 20,
        sweep_users_per_conversation: 10,
        sweep_lag_percents: vec![0.0, 1.0],
        sweep_repeats: 2,
        sweep_explain_max_devices: 10_000,
        sweep_set_based_max_devices: 50_000,
        repair_sweep_ms: vec![100, 500, 1000],
        repair_trials: vec![100, 100, 60],
        repair_lanes: 10,
        two_gateways_conversations: 16,
        two_gateways_receivers: 4,
        two_gateways_s: 3.0,
        conns_target: 50_000,
        conns_send_s: 5.0,
        conns_rate_per_s: 100.0,
    }
}

/// The `quick` mode: `full` with fewer, shorter rounds and smaller sizes.
fn quick_params(full: Params) -> Params {
    Params {
        send_concurrency: vec![1, 8],
        send_duration_s: 1,
        send_rounds: 1,
        fanout_user_pairs: 4,
        fanout_start_multiplier: 0.25,
        fanout_up: vec![0.5],
        fanout_down: vec![0.125],
        fanout_diagnostic_env: vec![],
        fanout_step_s: 2.0,
        ws_ceiling_s: 1.0,
        sweep_devices: vec![1000, 3000],
        sweep_repeats: 1,
        sweep_explain_max_devices: 3000,
        sweep_set_based_max_devices: 3000,
        repair_trials: vec![20, 8, 4],
        repair_lanes: 4,
        two_gateways_s: 2.0,
        conns_target: 2_000,
        conns_send_s: 2.0,
        ..full
    }
}

/// The `smoke` mode: `full` cut to the least that still runs every part.
fn smoke_params(full: Params) -> Params {
    Params {
        send_concurrency: vec![2],
        send_conversations: 8,
        send_warmup_s: 0,
        send_duration_s: 1,
        send_rounds: 1,
        fanout_user_pairs: 2,
        fanout_convs_per_pair: 1,
        fanout_start_multiplier: 0.02,
        fanout_up: vec![],
        fanout_down: vec![],
        fanout_diagnostic_env: vec![],
        fanout_step_s: 1.0,
        ws_ceiling_s: 0.5,
        sweep_devices: vec![100, 300],
        sweep_repeats: 1,
        sweep_explain_max_devices: 300,
        sweep_set_based_max_devices: 300,
        repair_sweep_ms: vec![100, 200],
        repair_trials: vec![4, 2],
        repair_lanes: 2,
        two_gateways_conversations: 4,
        two_gateways_receivers: 2,
        two_gateways_s: 1.0,
        conns_target: 50,
        conns_send_s: 1.0,
        conns_rate_per_s: 20.0,
        ..full
    }
}

/// The load generator behind `make bench`: the real gateway against a throwaway
/// PostgreSQL cluster (send path, fan-out, sweep, lost-push repair), each part measured
/// against a ceiling taken in the same run. Writes one JSON result (evidence/README.md).
#[derive(clap::Parser, Debug)]
#[command(
    name = "imfault-bench",
    after_help = "\
Environment:
  CARGO_TARGET_DIR     where the default gateway binaries are [default: target]
  IMFAULT_PG_BIN_DIR   PostgreSQL server programs [default: newest /usr/lib/postgresql/*/bin, else PATH]
  IMFAULT_KEEP=1       keep the clusters' work directories [default: unset; kept anyway on data loss]
  PATH                 where pgbench is looked for after /usr/lib/postgresql/*/bin
  (IM_GATEWAY_BIN is set by the bench itself, from --gateway-bin, for the harness.)

Exit status: 0 when data_integrity is PASS and every part ran; 1 when an acknowledged
message was lost or doubled, a lost push was never repaired, or a part did not run or
errored; 2 usage error. Missed performance targets (targets_met) never change it.
Internal subcommands (run by the bench itself): ws-ceiling-server, repair-child."
)]
struct Cli {
    #[command(flatten)]
    run: Args,
}

#[derive(clap::Args, Debug)]
struct Args {
    /// full (`make bench`), quick (`make bench-quick`) or smoke (the nextest smoke test).
    #[arg(long, default_value = "full", value_parser = ["full", "quick", "smoke"])]
    mode: String,
    /// Same as --mode quick.
    #[arg(long)]
    quick: bool,
    /// Where to write the result [default: evidence/bench/result.json in full mode, else
    /// $CARGO_TARGET_DIR/bench/quick.json].
    #[arg(long)]
    out: Option<PathBuf>,
    /// The gateway of the send, fan-out and sweep parts [default:
    /// $CARGO_TARGET_DIR/release/im-gateway].
    #[arg(long)]
    gateway_bin: Option<PathBuf>,
    /// The gateway with fault points, for the repair part [default:
    /// $CARGO_TARGET_DIR/debug/im-gateway].
    #[arg(long)]
    fault_gateway_bin: Option<PathBuf>,
    /// Accept a gateway with fault points for every part (the smoke test).
    #[arg(long)]
    allow_faults_gateway: bool,
    /// Seed of every random pick and jitter.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Parts to run (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "send,fanout,sweep,repair,two_gateways,conns",
          value_parser = ["send", "fanout", "sweep", "repair", "two_gateways", "conns"])]
    only: Vec<String>,
    /// An extra IM_NAME=VALUE for the send and fan-out gateway (repeatable; experiments).
    #[arg(long = "gateway-env", value_name = "IM_NAME=VALUE", value_parser = parse_env)]
    gateway_env: Vec<(String, String)>,
}

fn parse_env(kv: &str) -> Result<(String, String), String> {
    let (k, v) = kv
        .split_once('=')
        .ok_or_else(|| format!("{kv:?}: expected NAME=VALUE"))?;
    Ok((k.to_string(), v.to_string()))
}

impl Args {
    /// Fills the defaults that depend on the mode and the target directory.
    fn resolve(mut self) -> Args {
        let target = env::target_dir();
        if self.quick {
            self.mode = "quick".into();
        }
        self.gateway_bin
            .get_or_insert_with(|| target.join("release").join("im-gateway"));
        self.fault_gateway_bin
            .get_or_insert_with(|| target.join("debug").join("im-gateway"));
        if self.out.is_none() {
            self.out = Some(if self.mode == "full" {
                env::workspace_dir()
                    .join("evidence")
                    .join("bench")
                    .join("result.json")
            } else {
                target.join("bench").join("quick.json")
            });
        }
        self
    }

    fn out(&self) -> &std::path::Path {
        self.out.as_deref().expect("resolved")
    }

    fn gateway_bin(&self) -> &std::path::Path {
        self.gateway_bin.as_deref().expect("resolved")
    }

    fn fault_gateway_bin(&self) -> &std::path::Path {
        self.fault_gateway_bin.as_deref().expect("resolved")
    }
}

fn main() -> ExitCode {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let rt = || {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("build the tokio runtime")
    };
    // Internal subcommands.
    match raw.first().map(String::as_str) {
        Some("ws-ceiling-server") => {
            let body = raw.get(1).and_then(|b| b.parse().ok()).unwrap_or(100);
            return match rt().block_on(fanout::ceiling_server(body)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("ws-ceiling-server: {e:#}");
                    ExitCode::FAILURE
                }
            };
        }
        Some("repair-child") => {
            let r = repair::ChildArgs::parse(&raw[1..])
                .and_then(|a| rt().block_on(repair::child_main(a)));
            return match r {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("repair-child: {e:#}");
                    ExitCode::FAILURE
                }
            };
        }
        _ => {}
    }
    let cli: Cli = clap::Parser::parse();
    let args = cli.run.resolve();
    // The harness picks its gateway binary once per process, from IM_GATEWAY_BIN: set it
    // before anything (and before any other thread exists).
    // `--allow-faults-gateway` (the smoke test) accepts either build; the evidence needs
    // the release build without fault points.
    let want_faults = (!args.allow_faults_gateway).then_some(false);
    let gateway_version = match env::check_gateway(
        args.gateway_bin(),
        want_faults,
        "cargo build --release -p im-gateway",
    ) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("imfault-bench: {e:#}");
            return ExitCode::from(2);
        }
    };
    std::env::set_var("IM_GATEWAY_BIN", args.gateway_bin());
    match rt().block_on(bench(args, gateway_version)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            util::progress_done();
            eprintln!("imfault-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn timed<T, F: std::future::Future<Output = anyhow::Result<T>>>(f: F) -> Section<T> {
    let t = Instant::now();
    let r = f.await;
    Section::from(r, util::r3(t.elapsed().as_secs_f64()))
}

/// `shared_buffers` of the bench's cluster (the harness's test clusters keep 32MB): the
/// sweep part at 100,000 devices x 20 conversations holds about 2 million install and
/// cursor rows plus their indexes, a few hundred MB, which must stay in shared buffers for
/// the per-interval sweep to be judged on its query and not on the kernel's page cache.
/// Recorded as `environment.shared_buffers`.
const BENCH_SHARED_BUFFERS: &str = "1GB";

/// The parts in the order they run, each with its section in the result file.
const PARTS: [(&str, &str); 6] = [
    ("send", "send_path"),
    ("fanout", "fanout"),
    ("sweep", "sweep"),
    ("repair", "repair"),
    ("two_gateways", "two_gateways"),
    ("conns", "conns"),
];

/// The estimate of time left over the selected parts, from the last run's part times (the
/// result file about to be replaced), printed as each part starts (issue 22).
struct PartsEta {
    eta: harness::util::Eta,
}

impl PartsEta {
    fn new(last: &std::path::Path, only: &[String]) -> PartsEta {
        let last: serde_json::Value = std::fs::read(last)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        let expected = PARTS
            .iter()
            .filter(|(p, _)| only.iter().any(|o| o == p))
            .map(|(_, section)| last[section]["wall_s"].as_f64().unwrap_or(0.0))
            .collect();
        PartsEta {
            eta: harness::util::Eta::new(expected),
        }
    }

    /// A part starts: one line that stays (`[bench] fanout: 2 of 6, …, ~3 min left`).
    fn start(&mut self, part: &str) {
        self.eta.next_part();
        util::progress(&format!("[bench] {part}: {}", self.eta.line()));
        util::progress_done();
    }
}

/// A part `--only` left out.
fn not_selected<T>() -> Section<T> {
    Section::not_run("not selected (--only)")
}

/// Runs the bench; `Ok(true)` when `data_integrity` is PASS and every part ran.
async fn bench(args: Args, gateway_version: String) -> anyhow::Result<bool> {
    let started = Instant::now();
    let params = preset(&args.mode, args.seed)?;
    let (environment, fault_check) = describe(&args, gateway_version);
    let (ctx, environment) = prepare(&args, &params, environment).await?;
    let mut r = BenchResult {
        schema_version: result::SCHEMA_VERSION,
        tool: "imfault-bench".into(),
        mode: args.mode.clone(),
        // Both decided by `judge`, once every part ran.
        data_integrity: Verdict::NotRun,
        targets_met: Verdict::NotRun,
        targets_missed: Vec::new(),
        failures: Vec::new(),
        metrics: Vec::new(),
        environment,
        parameters: params,
        send_path: not_selected(),
        fanout: not_selected(),
        sweep: not_selected(),
        repair: not_selected(),
        two_gateways: not_selected(),
        conns: not_selected(),
    };
    run_parts(&args, &ctx, &fault_check, &mut r).await;
    let data_lost = judge(&mut r);
    r.metrics = result::metrics(&r);
    (r.targets_met, r.targets_missed) = result::targets_met(&r.metrics);
    r.environment.finished_at = util::rfc3339(util::unix_us() / 1_000_000);
    r.environment.wall_s = util::r3(started.elapsed().as_secs_f64());
    r.environment.load_avg_end = env::load_avg();

    let out = harness::util::publish_path(args.out());
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    let text = serde_json::to_string_pretty(&r)?;
    std::fs::write(&out, text + "\n").with_context(|| format!("write {}", out.display()))?;
    print_summary(&r, &out);
    let Ctx {
        mut cluster, pool, ..
    } = ctx;
    pool.close().await;
    if data_lost {
        cluster.keep();
    }
    // Exit status 1 when the data is in doubt or the run is incomplete; missed targets
    // never change it.
    Ok(r.data_integrity.is_pass() && r.failures.is_empty())
}

/// The host and the binaries the bench runs, and whether the gateway with fault points
/// is usable (the repair part needs it).
fn describe(args: &Args, gateway_version: String) -> (Environment, anyhow::Result<String>) {
    let mut environment = env::host();
    environment.gateway_bin = args.gateway_bin().display().to_string();
    environment.gateway_version = gateway_version;
    environment.fault_gateway_bin = args.fault_gateway_bin().display().to_string();
    let fault_check = env::check_gateway(
        args.fault_gateway_bin(),
        Some(true),
        "cargo build --workspace --bins --features im-gateway/faults (make build)",
    );
    environment.fault_gateway_version = match &fault_check {
        Ok(v) => v.clone(),
        Err(e) => format!("unusable: {e:#}"),
    };
    if let Some(b) = env::find_pgbench() {
        environment.pgbench_bin = b.display().to_string();
        environment.pgbench_version = env::pgbench_version(&b);
    }
    environment.gateway_env = args
        .gateway_env
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    (environment, fault_check)
}

/// The bench's PostgreSQL cluster (with `pg_stat_statements` when it loads), its pool and
/// scratch directory: what every part runs against.
async fn prepare(
    args: &Args,
    params: &Params,
    mut environment: Environment,
) -> anyhow::Result<(Ctx, Environment)> {
    progress(&format!(
        "[setup] {} mode: starting a PostgreSQL cluster",
        args.mode
    ));
    let mut cluster = harness::pg::Cluster::start_migrated_with(harness::pg::ClusterOpts {
        settings: vec![("shared_buffers".into(), BENCH_SHARED_BUFFERS.into())],
        ..Default::default()
    })
    .await?;
    let pgss = match pgss::enable(&mut cluster).await {
        Ok(()) => true,
        Err(e) => {
            eprintln!("imfault-bench: pg_stat_statements not loaded ({e:#}); per-statement figures omitted");
            if !cluster.is_running() {
                cluster.restart().await?;
            }
            false
        }
    };
    env::fill_postgres(&mut environment, &cluster).await;
    environment.pg_stat_statements = pgss;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(std::time::Duration::from_secs(30))
        .connect(&cluster.url())
        .await
        .context("connect the bench pool")?;
    let tmp = cluster.work_dir().join("bench");
    std::fs::create_dir_all(&tmp)?;
    let ctx = Ctx {
        cluster,
        pool,
        pgss,
        pgbench: env::find_pgbench(),
        params: params.clone(),
        tmp,
        gateway_env: args.gateway_env.clone(),
    };
    Ok((ctx, environment))
}

/// Runs the parts `--only` selected, in their order, into `r`.
async fn run_parts(
    args: &Args,
    ctx: &Ctx,
    fault_check: &anyhow::Result<String>,
    r: &mut BenchResult,
) {
    let on = |part: &str| args.only.iter().any(|o| o == part);
    let mut eta = PartsEta::new(args.out(), &args.only);
    if on("send") {
        eta.start("send");
        r.send_path = timed(send::run(ctx)).await;
    }
    if on("fanout") {
        eta.start("fanout");
        r.fanout = timed(fanout::run(ctx)).await;
    }
    if on("sweep") {
        eta.start("sweep");
        r.sweep = timed(sweep::run(ctx)).await;
    }
    if on("repair") {
        r.repair = match fault_check {
            Err(e) => Section::not_run(format!("no usable gateway with fault points: {e:#}")),
            Ok(v) => {
                eta.start("repair");
                let p = &ctx.params;
                let a = repair::ChildArgs {
                    out: ctx.tmp.join("repair.json"),
                    seed: p.seed,
                    intervals: p.repair_sweep_ms.clone(),
                    trials: p.repair_trials.clone(),
                    lanes: p.repair_lanes,
                };
                timed(repair::run_child(args.fault_gateway_bin(), v, a)).await
            }
        };
    }
    if on("two_gateways") {
        eta.start("two_gateways");
        r.two_gateways = timed(twogw::run(ctx)).await;
    }
    // Last: it raises the open-file limit and leaves tens of thousands of rows behind.
    if on("conns") {
        eta.start("conns");
        let p = &ctx.params;
        r.conns = timed(conns::run(
            ctx,
            p.conns_target,
            p.conns_send_s,
            p.conns_rate_per_s,
        ))
        .await;
    }
    util::progress_done();
}

/// Judges a finished run: the fan-out's second ceiling, every part that did not run or
/// lost data in `r.failures`, and `data_integrity`. True when acknowledged data is in doubt
/// (the cluster is then kept).
fn judge(r: &mut BenchResult) -> bool {
    // The fan-out's second ceiling: what pgbench with NOTIFY commits, times the frames each
    // message makes.
    if let (Some(fo), Some(sp)) = (r.fanout.data.as_mut(), r.send_path.data.as_ref()) {
        let best = sp
            .levels
            .iter()
            .filter_map(|l| l.pgbench_notify.as_ref().map(|b| b.ops_per_s))
            .fold(0.0, f64::max);
        fo.ratios.max_passing_vs_pgbench_notify_frames = fo
            .max_passing_frames_per_s
            .and_then(|m| util::ratio(m, best * fo.frames_per_message as f64));
    }
    let mut failures = Vec::new();
    for (name, status, reason) in [
        ("send_path", &r.send_path.status, &r.send_path.reason),
        ("fanout", &r.fanout.status, &r.fanout.reason),
        ("sweep", &r.sweep.status, &r.sweep.reason),
        ("repair", &r.repair.status, &r.repair.reason),
        (
            "two_gateways",
            &r.two_gateways.status,
            &r.two_gateways.reason,
        ),
        ("conns", &r.conns.status, &r.conns.reason),
    ] {
        if status != "ok" {
            failures.push(format!(
                "{name}: {status}: {}",
                reason.clone().unwrap_or_default()
            ));
        }
    }
    failures.extend(data_failures(r));
    let data_lost = failures.iter().any(|f| {
        f.contains("DATA LOSS") || f.contains("pgbench logged") || f.contains("NOT REPAIRED")
    });
    // A part that checks data and errored vouches for nothing.
    let unverified = [
        &r.send_path.status,
        &r.fanout.status,
        &r.repair.status,
        &r.two_gateways.status,
    ]
    .iter()
    .any(|s| s.as_str() == "error");
    r.data_integrity = Verdict::of(!data_lost && !unverified);
    r.failures = failures;
    data_lost
}

/// What the parts' own data checks found: acknowledged messages missing, pgbench's log
/// against its rows, and lost pushes the sweep never repaired.
fn data_failures(r: &BenchResult) -> Vec<String> {
    let mut failures = Vec::new();
    let checks = [
        (
            "send_path",
            r.send_path.data.as_ref().map(|d| &d.data_check),
        ),
        ("fanout", r.fanout.data.as_ref().map(|d| &d.data_check)),
        ("repair", r.repair.data.as_ref().map(|d| &d.data_check)),
        (
            "two_gateways",
            r.two_gateways.data.as_ref().map(|d| &d.data_check),
        ),
    ];
    for (name, c) in checks {
        if let Some(c) = c {
            if !c.result.is_pass() {
                failures.push(format!(
                    "{name}: DATA LOSS: {} of {} acknowledged messages missing, seqs gapless: {}",
                    c.lost, c.acknowledged, c.seqs_gapless
                ));
            }
        }
    }
    if let Some(sp) = &r.send_path.data {
        if !sp.pgbench_check.result.is_pass() {
            failures.push(format!(
                "send_path: pgbench logged {} messages but {} rows exist",
                sp.pgbench_check.logged, sp.pgbench_check.rows
            ));
        }
    }
    // Repair bounded: a lost push the sweep never repaired (within 3 intervals + 5 s) is a
    // delivery lost (D5), not a slow one.
    if let Some(rp) = &r.repair.data {
        for i in rp.intervals.iter().filter(|i| i.unrepaired > 0) {
            failures.push(format!(
                "repair: NOT REPAIRED: {} of {} lost pushes at IM_SWEEP_MS={} never reached their device",
                i.unrepaired, i.trials, i.sweep_ms
            ));
        }
    }
    failures
}

fn print_summary(r: &BenchResult, out: &std::path::Path) {
    let e = &r.environment;
    println!(
        "imfault-bench {} mode: data_integrity {}, targets_met {} in {:.0} s  (PostgreSQL {}, fsync={}, synchronous_commit={}, {} cores, load {:.2} -> {:.2})",
        r.mode, r.data_integrity, r.targets_met, e.wall_s, e.postgres_version, e.fsync, e.synchronous_commit, e.host_cores,
        e.load_avg_start[0], e.load_avg_end[0]
    );
    for m in &r.metrics {
        let value = m.value.map_or("n/a".into(), |v| format!("{v}"));
        let judged = match (&m.op, m.limit, m.met) {
            (Some(op), Some(l), met) => format!(
                "  [{} {l} {}] {}",
                if op == "le" { "<=" } else { ">=" },
                m.unit,
                match met {
                    Some(true) => "MET",
                    Some(false) => "MISSED",
                    None => "NOT_RUN",
                }
            ),
            (None, Some(l), _) => format!("  (of {l})"),
            _ => String::new(),
        };
        println!("  {:<58} {value:>12} {}{judged}", m.name, m.unit);
    }
    for f in &r.failures {
        println!("FAIL: {f}");
    }
    println!("result written to {}", out.display());
}

#[cfg(test)]
mod tests {
    use super::*;
    use result::*;

    /// A result with one element in every list, so every field name appears.
    fn sample() -> BenchResult {
        let run = SendRun {
            statements: vec![pgss::StmtStat::default()],
            ..Default::default()
        };
        let send = SendPath {
            levels: vec![SendLevel {
                gateway: run.clone(),
                pgbench_plain: Some(run.clone()),
                pgbench_notify: Some(run.clone()),
                pgbench_notify_async_commit: Some(run),
                ..Default::default()
            }],
            ..Default::default()
        };
        let fanout = Fanout {
            diagnostics: vec![FanoutDiagnostic::default()],
            steps: vec![FanoutStep {
                statements: vec![Default::default()],
                ..Default::default()
            }],
            ..Default::default()
        };
        let sweep = Sweep {
            rows: vec![SweepRow {
                explain: Some(Explain::default()),
                ..Default::default()
            }],
            growth: vec![SweepGrowth::default()],
            ..Default::default()
        };
        let repair = Repair {
            intervals: vec![RepairInterval::default()],
            ..Default::default()
        };
        fn ok<T>(d: T) -> Section<T> {
            Section {
                status: "ok".into(),
                reason: None,
                wall_s: 0.0,
                data: Some(d),
            }
        }
        BenchResult {
            schema_version: SCHEMA_VERSION,
            tool: "imfault-bench".into(),
            mode: "full".into(),
            data_integrity: Verdict::Pass,
            targets_met: Verdict::Fail,
            targets_missed: vec!["push.p99_ms_at_chapter02_load: 3697 > 100 ms".into()],
            failures: Vec::new(),
            metrics: vec![Metric::target(
                "x",
                Some(1.0),
                "ms",
                "le",
                2.0,
                Some(String::new()),
            )],
            environment: env::Environment::default(),
            parameters: preset("full", 1).expect("full preset"),
            send_path: ok(send),
            fanout: ok(fanout),
            sweep: ok(sweep),
            repair: ok(repair),
            two_gateways: ok(result::TwoGateways::default()),
            conns: ok(conns::Conns::default()),
        }
    }

    fn keys(v: &serde_json::Value, out: &mut std::collections::BTreeSet<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, x) in m {
                    out.insert(k.clone());
                    keys(x, out);
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|x| keys(x, out)),
            _ => {}
        }
    }

    #[test]
    fn every_field_of_the_result_is_documented_in_result_format_md() {
        let doc = include_str!("../../evidence/README.md");
        let mut all = std::collections::BTreeSet::new();
        keys(
            &serde_json::to_value(sample()).expect("serialise"),
            &mut all,
        );
        let missing: Vec<&String> = all
            .iter()
            .filter(|k| !doc.contains(&format!("`{k}`")) && !doc.contains(&format!(".{k}`")))
            .collect();
        assert!(
            missing.is_empty(),
            "fields missing from evidence/README.md: {missing:?}"
        );
    }

    #[test]
    fn the_command_line_takes_the_makefile_flags_in_any_order() {
        use clap::{CommandFactory, Parser};
        Cli::command().debug_assert();
        for args in [
            &["imfault-bench", "--mode", "quick", "--out", "x.json"][..],
            &["imfault-bench", "--out", "x.json", "--mode", "quick"],
            &["imfault-bench", "--quick", "--out", "x.json"],
        ] {
            let a = Cli::try_parse_from(args).expect("parses").run.resolve();
            assert_eq!(a.mode, "quick", "{args:?}");
            assert_eq!(a.out(), std::path::Path::new("x.json"));
        }
        let a = Cli::try_parse_from([
            "imfault-bench",
            "--only",
            "send,repair",
            "--gateway-env",
            "IM_FANOUT_BATCH_MAX=1024",
            "--gateway-env",
            "IM_SWEEP_MS=100",
        ])
        .expect("parses")
        .run
        .resolve();
        assert_eq!(a.only, ["send", "repair"]);
        assert_eq!(a.gateway_env.len(), 2);
        assert_eq!(a.mode, "full");
        assert!(a.out().ends_with("evidence/bench/result.json"));
        for bad in [
            &["imfault-bench", "--mode", "nope"][..],
            &["imfault-bench", "--only", "x"],
        ] {
            let e = Cli::try_parse_from(bad).expect_err("refused");
            assert_eq!(e.exit_code(), 2);
        }
    }

    /// Missed targets are reported (targets_met FAIL, with the figure), a target that
    /// could not be measured is never counted as met, and a measurement is never judged.
    #[test]
    fn targets_are_judged_from_the_figures() {
        let mut r = sample();
        let fo = r.fanout.data.as_mut().expect("fanout");
        fo.steps[0].multiplier = 1.0;
        fo.steps[0].push_latency.p99_ms = 3697.5;
        fo.steps[0].frames_per_s = 8957.0;
        fo.steps[0].cursor_writes_per_push = Some(0.03);
        fo.steps[0].send_latency.p99_ms = 50.5;
        fo.steps[0].events_via_sync = 0;
        // The ladder (issue 19): 1x and 1.5x pass, 2x fails, so the first failing step is
        // below 3x.
        let step = |m: f64, passed: bool| FanoutStep {
            multiplier: m,
            passed,
            ..Default::default()
        };
        fo.steps[0].passed = true;
        fo.steps.push(step(1.5, true));
        fo.steps.push(step(2.0, false));
        let m = result::metrics(&r);
        let get = |name: &str| m.iter().find(|x| x.name == name).expect(name).met;
        let value = |name: &str| m.iter().find(|x| x.name == name).expect(name).value;
        assert_eq!(get("push.p99_ms_at_chapter02_load"), Some(false));
        // 8957 frames/s of 9067 is 98.8%: at least the 98% delivered.
        assert_eq!(get("push.frames_per_s_at_chapter02_load"), Some(true));
        assert_eq!(get("push.send_p99_ms_at_chapter02_load"), Some(false));
        assert_eq!(get("push.events_via_sync_at_chapter02_load"), Some(true));
        assert_eq!(
            get("push.cursor_writes_per_push_at_chapter02_load"),
            Some(true)
        );
        assert_eq!(get("push.max_passing_multiplier"), Some(false));
        assert_eq!(value("push.max_passing_multiplier"), Some(1.5));
        // 2x passes and 3x fails: the first failing step is at 3x, met.
        {
            let fo = r.fanout.data.as_mut().expect("fanout");
            fo.steps[2].passed = true;
            fo.steps.push(step(3.0, false));
            fo.steps[0].frames_per_s = 8800.0; // 97%: under the 98% delivered
            fo.steps[0].events_via_sync = 1;
        }
        let m = result::metrics(&r);
        let get = |name: &str| m.iter().find(|x| x.name == name).expect(name).met;
        assert_eq!(get("push.max_passing_multiplier"), Some(true));
        assert_eq!(get("push.frames_per_s_at_chapter02_load"), Some(false));
        assert_eq!(get("push.events_via_sync_at_chapter02_load"), Some(false));
        r.fanout.data.as_mut().expect("fanout").steps.truncate(1);
        assert!(m.iter().filter(|x| !x.is_target()).all(|x| x.met.is_none()));
        let (met, missed) = result::targets_met(&m);
        assert_eq!(met, Verdict::Fail);
        assert!(missed.contains(&"push.p99_ms_at_chapter02_load: 3697.5 > 50 ms".to_string()));
        // No step at the chapter-02 load (quick mode): unmeasured, never met.
        r.fanout.data.as_mut().expect("fanout").steps[0].multiplier = 0.25;
        let m: Vec<Metric> = result::metrics(&r)
            .into_iter()
            .filter(|x| x.is_target() && x.name.starts_with("push."))
            .collect();
        assert_eq!(m.len(), 6);
        assert!(m.iter().all(|x| x.met.is_none() && x.note.is_some()));
        assert_eq!(result::targets_met(&m).0, Verdict::NotRun);
        // A part that did not run lists its targets unmeasured.
        r.send_path = Section::not_run("not selected (--only)");
        let m = result::metrics(&r);
        assert!(m
            .iter()
            .any(|x| x.name == "send.c32.gateway_vs_pgbench_plain" && x.met.is_none()));
    }

    /// Issue 44's send targets: the ratio to pgbench plain at 1, 8 and 32 senders against
    /// 0.9, 1.2 and 1.5 (each judged at its bound), and at 8 senders the gateway's CPU per
    /// send against 60 µs and PostgreSQL's against pgbench plain's in the same run.
    #[test]
    fn send_targets_are_issue_44s() {
        let level = |c: usize, ratio: f64, gateway_us: f64, pg_us: f64| {
            let mut l = SendLevel {
                concurrency: c,
                gateway: SendRun::default(),
                pgbench_plain: Some(SendRun::default()),
                ..Default::default()
            };
            l.ratios.gateway_vs_pgbench_plain_throughput = Some(ratio);
            l.gateway.cpu_per_op.gateway_us = Some(gateway_us);
            l.gateway.cpu_per_op.postgres_us = Some(pg_us);
            if let Some(p) = l.pgbench_plain.as_mut() {
                p.cpu_per_op.postgres_us = Some(200.0);
            }
            l
        };
        let judge = |levels: Vec<SendLevel>| {
            let m = SendPath {
                levels,
                ..Default::default()
            }
            .metrics();
            let get = |name: &str| m.iter().find(|x| x.name == name).map(|x| x.met);
            [
                get("send.c1.gateway_vs_pgbench_plain"),
                get("send.c8.gateway_vs_pgbench_plain"),
                get("send.c32.gateway_vs_pgbench_plain"),
                get("send.c8.gateway_cpu_us_per_send"),
                get("send.c8.postgres_cpu_us_per_send_vs_pgbench_plain"),
                get("send.c1.gateway_cpu_us_per_send"),
            ]
        };
        // The three levels, each ratio `short` below its bound, and level 8's CPU figures.
        let levels = |short: f64, gateway_us: f64, pg_us: f64| {
            vec![
                level(1, 0.9 - short, 500.0, 900.0),
                level(8, 1.2 - short, gateway_us, pg_us),
                level(32, 1.5 - short, 500.0, 900.0),
            ]
        };
        let met = Some(Some(true));
        assert_eq!(
            judge(levels(0.0, 60.0, 200.0)),
            [met, met, met, met, met, None]
        );
        let no = Some(Some(false));
        assert_eq!(
            judge(levels(0.001, 60.001, 200.2)),
            [no, no, no, no, no, None]
        );
        // No pgbench figure at 8: the PostgreSQL budget is unjudged, never met.
        let mut alone = level(8, 1.3, 10.0, 10.0);
        alone.pgbench_plain = None;
        assert_eq!(judge(vec![alone])[4], Some(None));
        // Level 8 not run (the smoke mode): both CPU budgets stay targets, unjudged.
        let unrun = judge(vec![level(2, 1.3, 10.0, 10.0)]);
        assert_eq!(unrun[3..5], [Some(None), Some(None)]);
    }

    #[test]
    fn presets_are_consistent() {
        for mode in ["full", "quick", "smoke"] {
            let p = preset(mode, 1).expect("preset");
            assert_eq!(p.repair_sweep_ms.len(), p.repair_trials.len(), "{mode}");
            assert!(
                p.sweep_devices
                    .iter()
                    .all(|n| n % p.sweep_users_per_conversation == 0),
                "{mode}"
            );
        }
        assert!(preset("nope", 1).is_err());
    }
}
