//! `make nemesis`: seeded random fault schedules over a live workload (issue 10). Each seed's
//! schedule (`schedule.json`) is generated from the seed and the options alone, carried out
//! on the real gateway binary and a throwaway cluster, healed, and judged by the checker
//! over the whole history. A failing seed keeps its artefacts (`history.jsonl`,
//! `schedule.json`, `result.json`, `report.html`, logs) and, with `--shrink`, is shrunk to a
//! 1-minimal schedule (`minimal.json`); passing seeds keep nothing but their line in the
//! summary unless `--keep-passing`, so `--seeds 1000` does not fill the disk.
//!
//! Exit status: 0 every run passed, 1 a run failed (anomalies) or could not be judged,
//! 2 usage error, 3 nothing could be run.

use anyhow::{bail, Context};
use clap::Parser;
use harness::nemesis::shrink::{shrink, ShrinkOpts, Shrunk};
use harness::nemesis::{generate, run, Options, Outcome, Schedule};
use im_check::Verdict;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

/// Seeded random fault schedules over a live workload, judged by the history checker.
#[derive(Parser, Debug)]
#[command(
    name = "nemesis",
    after_help = concat!(
        include_str!("harness_env.txt"),
        "
Each run prints its seed and the one-line command that repeats it.
Output per run: OUT/seed-N/ (or OUT/replay-K/) with schedule.json, history.jsonl,
result.json, report.html, logs/; kept only for failing runs unless --keep-passing.
--summary FILE writes the summary of all runs (format: evidence/README.md, \"nemesis\").
Exit status: 0 every run passed, 1 a run failed or could not be judged, 2 usage error,
3 nothing could be run.
Examples: make nemesis  |  make nemesis SEEDS=1000  |  target/debug/nemesis --seed 7
          target/debug/nemesis --replay target/nemesis/seed-7/schedule.json --replays 10"
    )
)]
struct Args {
    /// Run exactly this seed (same as --first-seed S --seeds 1).
    #[arg(long, conflicts_with_all = ["first_seed", "replay"])]
    seed: Option<u64>,
    /// The first seed of a series.
    #[arg(long, default_value_t = 1)]
    first_seed: u64,
    /// How many seeds (default 20; 1 with --seed).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    seeds: Option<u64>,
    /// Length of the faulty phase of each run, milliseconds.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1000..=600_000))]
    duration: Option<u64>,
    /// Faults per schedule (at most).
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=200))]
    faults: Option<u32>,
    /// Only these fault kinds (comma-separated; default all): gw-kill, gw-crash-point,
    /// gw-pause, gw-fault, pg-crash, pg-pause, pg-power-cut, pg-terminate-listen,
    /// pg-terminate-pool, net-db, net-client, net-db-reset, net-client-reset, client-crash,
    /// disk-eio, disk-enospc, disk-slow-fsync, disk-torn-power-cut.
    #[arg(long, value_delimiter = ',')]
    kinds: Vec<String>,
    /// Gateways (1–3). With 2 or 3 they run behind HAProxy (Debian's `haproxy`, started by
    /// the harness) as the clients' one address, and each gateway fault hits one of them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=3))]
    gateways: u32,
    /// Run this schedule.json exactly (its seed and options are in it).
    #[arg(long, value_name = "FILE")]
    replay: Option<PathBuf>,
    /// With --replay: run it this many times and count how many fail.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    replays: u32,
    /// Shrink each failing run to a 1-minimal schedule (minimal.json).
    #[arg(long)]
    shrink: bool,
    /// Runs per shrink candidate (it still fails if any of them fails).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=20))]
    shrink_reps: u32,
    /// Runs a shrink may make in all.
    #[arg(long, default_value_t = 40, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    shrink_runs: u32,
    /// Stop at the first seed the checker fails (the controls' use: is this bug caught at
    /// all?); a run that could not be judged (ERROR) does not stop the series.
    #[arg(long)]
    stop_at_first_failure: bool,
    /// Where the runs' directories go.
    #[arg(long, default_value = "target/nemesis")]
    out: PathBuf,
    /// Write the summary of all runs here (make nemesis: evidence/nemesis/result.json).
    #[arg(long, value_name = "FILE")]
    summary: Option<PathBuf>,
    /// Keep the artefacts of passing runs too.
    #[arg(long)]
    keep_passing: bool,
    /// Runs at once, each in a process of its own with its own cluster, gateway and
    /// clients (seeds only; replays and shrinking run one at a time).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=32))]
    jobs: u32,
    /// Only shard K of N of the seeds (0-based: seeds whose index in the series is K modulo
    /// N), to spread a long series over machines.
    #[arg(long, value_name = "K/N", value_parser = parse_shard)]
    shard: Option<(u64, u64)>,
    /// Internal: run the one seed of --seed and keep its directory for the parent process
    /// of a --jobs series (no summary, no shrinking).
    #[arg(long, hide = true)]
    child: bool,
    /// Join these summaries (one per K of one --shard K/N series, all at one commit, with
    /// the same options) into the summary an unsharded series writes (--summary); runs
    /// nothing.
    #[arg(long, num_args = 1.., value_name = "FILE", requires = "summary",
          conflicts_with_all = ["seed", "replay", "shard", "child"])]
    join: Option<Vec<PathBuf>>,
}

fn parse_shard(s: &str) -> Result<(u64, u64), String> {
    let (k, n) = s.split_once('/').ok_or("a shard is K/N")?;
    let k: u64 = k.parse().map_err(|_| "K is not a number")?;
    let n: u64 = n.parse().map_err(|_| "N is not a number")?;
    if n == 0 || k >= n {
        return Err(format!("shard {k}/{n}: K must be below N"));
    }
    Ok((k, n))
}

/// One run in the summary.
#[derive(Serialize, Deserialize, Clone)]
struct RunLine {
    seed: u64,
    verdict: Verdict,
    error: Option<String>,
    repeat: String,
    anomalies: BTreeMap<String, u64>,
    /// Acknowledged messages an asynchronous failover lost, as allowed (not anomalies).
    expected_loss: u64,
    faults: BTreeMap<String, u64>,
    /// Client operations by how they ended.
    ops: BTreeMap<String, im_check::OpCounts>,
    gateway_starts: u64,
    repair_ms: im_check::Quantiles,
    wall_ms: u64,
    /// The run's directory, when kept.
    dir: Option<String>,
}

#[derive(Serialize, Deserialize, Clone)]
struct ShrinkLine {
    seed: u64,
    minimal: String,
    faults: Vec<Value>,
    duration_ms: u64,
    one_minimal: bool,
    /// `one-minimal`, `budget-spent` or `not-reproduced` (nothing failed again).
    finding: harness::nemesis::shrink::Finding,
    runs: u32,
    repro: Option<String>,
    repeat: String,
}

#[derive(Serialize, Deserialize)]
struct Summary {
    schema_version: u32,
    /// `PASS` when every run passed.
    verdict: Verdict,
    generated_at: String,
    command: String,
    /// The commit the series ran at, and whether code differed from it (evidence/ aside).
    git_commit: Option<String>,
    git_dirty: Option<bool>,
    /// The deliberate bug of this process (`IM_BUG`), if any.
    bug: Option<String>,
    /// The schedule generator's version: which schedule each seed gave.
    generator: u32,
    options: Options,
    runs: u64,
    pass: u64,
    fail: u64,
    error: u64,
    wall_s: f64,
    /// Runs at once (--jobs) and the shard of the series (--shard K/N), if any.
    jobs: u32,
    shard: Option<String>,
    /// runs / wall_s, per hour.
    seeds_per_hour: f64,
    anomalies_by_kind: BTreeMap<String, u64>,
    /// Acknowledged messages asynchronous failovers lost over the series, as allowed
    /// (issue 21), and in how many runs.
    expected_loss: Value,
    faults_by_kind: BTreeMap<String, u64>,
    /// Client operations over all runs, by how they ended.
    ops: BTreeMap<String, BTreeMap<String, u64>>,
    /// Repair time (store by sync minus send ok) over runs: the per-run p50s' median and
    /// the largest per-run maximum, in ms, and how many repairs.
    repair_ms: Value,
    per_run: Vec<RunLine>,
    shrunk: Vec<ShrinkLine>,
    /// A joined summary (`--join`): each shard's `shard`, `jobs`, `wall_s`,
    /// `generated_at`, `runs` and file; absent for a series run as one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    shards: Option<Vec<Value>>,
}

/// How a summary came about, beside its runs.
struct Meta {
    command: String,
    git_commit: Option<String>,
    git_dirty: Option<bool>,
    bug: Option<String>,
    generator: u32,
    jobs: u32,
    shard: Option<String>,
    wall_s: f64,
    shards: Option<Vec<Value>>,
}

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("nemesis: cannot start the runtime: {e}");
            return ExitCode::from(3);
        }
    };
    if let Some(files) = &args.join {
        return match join(files, args.summary.as_deref().unwrap_or(Path::new(""))) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::from(1),
            Err(e) => {
                eprintln!("nemesis: {e:#}");
                ExitCode::from(2)
            }
        };
    }
    match rt.block_on(main_async(args)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("nemesis: {e:#}");
            ExitCode::from(3)
        }
    }
}

fn options(args: &Args) -> Options {
    let mut o = Options::default();
    if let Some(d) = args.duration {
        o.duration_ms = d;
    }
    if let Some(f) = args.faults {
        o.faults = f;
    }
    o.kinds = args.kinds.clone();
    o.gateways = args.gateways;
    o
}

/// The command that generates the same schedule and runs it again.
fn repeat_seed(seed: u64, o: &Options) -> String {
    let d = Options::default();
    let mut s = String::new();
    if let Ok(bug) = std::env::var("IM_BUG") {
        if !bug.trim().is_empty() {
            s.push_str(&format!("IM_BUG={} ", bug.trim()));
        }
    }
    s.push_str(&format!("target/debug/nemesis --seed {seed}"));
    if o.duration_ms != d.duration_ms {
        s.push_str(&format!(" --duration {}", o.duration_ms));
    }
    if o.faults != d.faults {
        s.push_str(&format!(" --faults {}", o.faults));
    }
    if !o.kinds.is_empty() {
        s.push_str(&format!(" --kinds {}", o.kinds.join(",")));
    }
    if o.gateways != d.gateways {
        s.push_str(&format!(" --gateways {}", o.gateways));
    }
    s
}

fn repeat_replay(file: &Path) -> String {
    let mut s = String::new();
    if let Ok(bug) = std::env::var("IM_BUG") {
        if !bug.trim().is_empty() {
            s.push_str(&format!("IM_BUG={} ", bug.trim()));
        }
    }
    s.push_str(&format!("target/debug/nemesis --replay {}", file.display()));
    s
}

fn kinds_of(o: &Outcome) -> BTreeSet<String> {
    o.anomalies.keys().cloned().collect()
}

/// One run to make: its directory name, schedule and repeat command.
struct Planned {
    name: String,
    schedule: Schedule,
    repeat: String,
}

/// The runs of this invocation: a replay's repetitions, or the seeds (of the shard).
fn plan(args: &Args, opts: &Options) -> anyhow::Result<Vec<Planned>> {
    let mut plan = Vec::new();
    if let Some(file) = &args.replay {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("read {}", file.display()))?;
        let s = Schedule::from_json(&text).with_context(|| format!("{}", file.display()))?;
        // Copy it first: the run directories below may be where it came from.
        let kept = args.out.join(format!("replayed-seed-{}.json", s.seed));
        std::fs::write(&kept, s.to_json())?;
        for k in 1..=args.replays {
            plan.push(Planned {
                name: format!("replay-{k}"),
                schedule: s.clone(),
                repeat: repeat_replay(&kept),
            });
        }
        return Ok(plan);
    }
    let (first, n) = match args.seed {
        Some(s) => (s, args.seeds.unwrap_or(1)),
        None => (args.first_seed, args.seeds.unwrap_or(20)),
    };
    let (k, m) = args.shard.unwrap_or((0, 1));
    for (i, seed) in (first..first.saturating_add(n)).enumerate() {
        if i as u64 % m != k {
            continue;
        }
        plan.push(Planned {
            name: format!("seed-{seed}"),
            schedule: generate(seed, opts)?,
            repeat: repeat_seed(seed, opts),
        });
    }
    Ok(plan)
}

/// What the series has seen so far.
struct Series {
    lines: Vec<RunLine>,
    shrunk: Vec<ShrinkLine>,
    /// Failing runs to shrink once the series is over: (schedule, outcome, directory).
    to_shrink: Vec<(Schedule, Outcome, PathBuf)>,
    total: usize,
    t0: Instant,
}

impl Series {
    /// Prints one finished run, keeps or removes its directory, and rewrites the summary.
    fn record(
        &mut self,
        args: &Args,
        opts: &Options,
        p: &Planned,
        o: Outcome,
    ) -> anyhow::Result<()> {
        let dir = args.out.join(&p.name);
        let keep = o.failed() || args.keep_passing;
        let done = self.lines.len() + 1;
        let elapsed = self.t0.elapsed().as_secs_f64();
        let eta = elapsed / done as f64 * (self.total - done) as f64;
        println!(
            "[{done:>4}/{}] seed {}: {}{} ({} faults, {} ops, {} gateway starts, {:.1} s) | {:.0} s elapsed, ~{:.0} s left",
            self.total,
            o.seed,
            o.verdict,
            match (o.anomalies.is_empty(), o.expected_loss) {
                (true, 0) => String::new(),
                (true, n) => format!(" ({n} acknowledged lost by an asynchronous failover, as allowed)"),
                (false, _) => format!(" {:?}", o.anomalies),
            },
            p.schedule.faults.len(),
            o.ops.values().map(|c| c.invoke).sum::<u64>(),
            o.gateway_starts,
            o.wall_ms as f64 / 1000.0,
            elapsed,
            eta
        );
        if let Some(e) = &o.error {
            println!("         error: {e}");
        }
        if keep {
            println!("         kept: {}", dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&dir);
        }
        self.lines.push(RunLine {
            seed: o.seed,
            verdict: o.verdict,
            error: o.error.clone(),
            repeat: o.repeat.clone(),
            anomalies: o.anomalies.clone(),
            expected_loss: o.expected_loss,
            faults: o.faults.clone(),
            ops: o.ops.clone(),
            gateway_starts: o.gateway_starts,
            repair_ms: o.repair_ms.clone(),
            wall_ms: o.wall_ms,
            dir: keep.then(|| dir.display().to_string()),
        });
        if o.verdict == Verdict::Fail && args.shrink && args.replay.is_none() {
            self.to_shrink.push((p.schedule.clone(), o, dir));
        }
        self.write(args, opts)
    }

    fn write(&self, args: &Args, opts: &Options) -> anyhow::Result<()> {
        match &args.summary {
            Some(path) => write_summary(path, args, opts, &self.lines, &self.shrunk, self.t0),
            None => Ok(()),
        }
    }
}

async fn main_async(args: Args) -> anyhow::Result<bool> {
    let opts = options(&args);
    // Validate the options once (a bad kind is a usage error before anything starts).
    generate(1, &opts)?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("create {}", args.out.display()))?;
    // A missing, stale or fault-less gateway binary stops everything before the first run.
    tokio::task::spawn_blocking(harness::gateway::require_faults)
        .await
        .context("join the gateway binary check")??;
    let plan = plan(&args, &opts)?;
    for p in &plan {
        let dir = args.out.join(&p.name);
        if dir.exists() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("remove {}", dir.display()))?;
        }
    }
    if args.child {
        for p in &plan {
            run(&p.schedule, &args.out.join(&p.name), p.repeat.clone()).await;
        }
        return Ok(true);
    }
    let mut series = Series {
        lines: Vec::new(),
        shrunk: Vec::new(),
        to_shrink: Vec::new(),
        total: plan.len(),
        t0: Instant::now(),
    };
    if args.jobs > 1 && args.replay.is_none() {
        run_parallel(&args, &opts, plan, &mut series).await?;
    } else {
        for p in plan {
            println!(
                "nemesis: seed {} ({}): {}",
                p.schedule.seed, p.name, p.repeat
            );
            let o = run(&p.schedule, &args.out.join(&p.name), p.repeat.clone()).await;
            let stop = o.verdict == Verdict::Fail && args.stop_at_first_failure;
            series.record(&args, &opts, &p, o)?;
            if stop {
                break;
            }
        }
    }
    for (schedule, o, dir) in std::mem::take(&mut series.to_shrink) {
        let s = do_shrink(&args, &schedule, &o, &dir).await?;
        series.shrunk.push(s);
        series.write(&args, &opts)?;
    }
    let fails = series.lines.iter().filter(|l| !l.verdict.is_pass()).count();
    let wall = series.t0.elapsed().as_secs_f64();
    println!(
        "nemesis: {} runs, {} passed, {} failed or not judged, {:.0} s ({:.0} seeds/hour at --jobs {}){}",
        series.lines.len(),
        series.lines.len() - fails,
        fails,
        wall,
        series.lines.len() as f64 / wall.max(1e-9) * 3600.0,
        args.jobs,
        args.summary
            .as_ref()
            .map(|p| format!("; summary: {}", p.display()))
            .unwrap_or_default()
    );
    Ok(fails == 0)
}

/// Runs the plan `--jobs` at a time, each in a child process of this binary (`--child`):
/// runs at once share nothing but the machine (each has its own cluster, gateway, clients
/// and history). A child's output goes to OUT/NAME.log, kept only when the run failed.
async fn run_parallel(
    args: &Args,
    opts: &Options,
    plan: Vec<Planned>,
    series: &mut Series,
) -> anyhow::Result<()> {
    let mut pending = plan.into_iter();
    let mut running = tokio::task::JoinSet::new();
    let mut stop = false;
    loop {
        while !stop && running.len() < args.jobs as usize {
            let Some(p) = pending.next() else { break };
            println!(
                "nemesis: seed {} ({}): {}",
                p.schedule.seed, p.name, p.repeat
            );
            let cmd = child_command(args, &p)?;
            let out = args.out.clone();
            running.spawn(async move {
                let o = run_child(cmd, &out, &p).await;
                (p, o)
            });
        }
        let Some(joined) = running.join_next().await else {
            return Ok(());
        };
        let (p, o) = joined.context("join a run")?;
        if o.verdict == Verdict::Fail && args.stop_at_first_failure {
            stop = true;
        }
        series.record(args, opts, &p, o)?;
    }
}

/// `nemesis --child --seed S --out OUT` with this series' options.
fn child_command(args: &Args, p: &Planned) -> anyhow::Result<tokio::process::Command> {
    let exe = std::env::current_exe().context("find this binary")?;
    let mut cmd = tokio::process::Command::new(exe);
    cmd.arg("--child")
        .arg("--seed")
        .arg(p.schedule.seed.to_string())
        .arg("--out")
        .arg(&args.out);
    if let Some(d) = args.duration {
        cmd.arg("--duration").arg(d.to_string());
    }
    if let Some(f) = args.faults {
        cmd.arg("--faults").arg(f.to_string());
    }
    if !args.kinds.is_empty() {
        cmd.arg("--kinds").arg(args.kinds.join(","));
    }
    cmd.arg("--gateways").arg(args.gateways.to_string());
    let log = args.out.join(format!("{}.log", p.name));
    let file = std::fs::File::create(&log).with_context(|| format!("create {}", log.display()))?;
    cmd.stdout(file.try_clone()?)
        .stderr(file)
        .kill_on_drop(true);
    Ok(cmd)
}

/// Waits for a child run and reads the outcome it wrote (an ERROR outcome if it wrote none).
async fn run_child(mut cmd: tokio::process::Command, out: &Path, p: &Planned) -> Outcome {
    let t0 = Instant::now();
    let log = out.join(format!("{}.log", p.name));
    let result = out.join(&p.name).join("result.json");
    let status = cmd.status().await;
    let read = std::fs::read_to_string(&result)
        .map_err(anyhow::Error::from)
        .and_then(|t| Ok(serde_json::from_str::<Outcome>(&t)?));
    match read {
        Ok(o) => {
            if !o.failed() {
                let _ = std::fs::remove_file(&log);
            }
            o
        }
        Err(e) => {
            let why = anyhow::anyhow!(
                "the child run ({status:?}) left no readable {}: {e:#}; its output: {}",
                result.display(),
                log.display()
            );
            Outcome::error(
                p.schedule.seed,
                p.repeat.clone(),
                &why,
                t0.elapsed(),
                Vec::new(),
            )
        }
    }
}

/// Shrinks `schedule` under `work`, each candidate run `args.shrink_reps` times (at most
/// `args.shrink_runs` runs), keeping those that still show anomalies of `kinds`; prints
/// each try and removes its directory after it.
async fn try_shrinking(
    args: &Args,
    schedule: &Schedule,
    kinds: &BTreeSet<String>,
    work: &Path,
) -> Shrunk {
    let mut n = 0u32;
    shrink(
        schedule,
        kinds,
        ShrinkOpts {
            reps: args.shrink_reps,
            max_runs: args.shrink_runs,
        },
        |cand: Schedule| {
            n += 1;
            let d = work.join(format!("try-{n}"));
            async move {
                let o = run(&cand, &d, String::new()).await;
                let seen = kinds_of(&o);
                println!(
                    "  try {n}: faults {:?}, {} membership changes, {} ms: {} {:?}",
                    cand.faults.iter().map(|f| f.id).collect::<Vec<_>>(),
                    cand.workload.membership.len(),
                    cand.options.duration_ms,
                    o.verdict,
                    o.anomalies
                );
                let _ = std::fs::remove_dir_all(&d);
                seen
            }
        },
    )
    .await
}

/// Prints what the shrinking found: the minimal schedule's faults and length, how to
/// repeat it, and the one fault point that does the same, when there is one.
fn print_shrunk(
    schedule: &Schedule,
    r: &Shrunk,
    minimal_path: &Path,
    repeat: &str,
) -> anyhow::Result<()> {
    println!(
        "nemesis: seed {} shrunk to {} fault(s) in {} ms ({} runs, {}): {}",
        schedule.seed,
        r.minimal.faults.len(),
        r.minimal.options.duration_ms,
        r.runs,
        r.finding.describe(),
        minimal_path.display()
    );
    for f in &r.minimal.faults {
        println!("  {}", serde_json::to_string(f)?);
    }
    println!("  repeat: {repeat}");
    if let Some(line) = &r.repro {
        println!("  the same as one fault point: {line}");
    }
    Ok(())
}

async fn do_shrink(
    args: &Args,
    schedule: &Schedule,
    o: &Outcome,
    dir: &Path,
) -> anyhow::Result<ShrinkLine> {
    let kinds = kinds_of(o);
    println!(
        "nemesis: shrinking seed {} ({} faults; keeps anomalies of {:?}; {} runs per candidate, {} at most)",
        schedule.seed,
        schedule.faults.len(),
        kinds,
        args.shrink_reps,
        args.shrink_runs
    );
    let work = dir.join("shrink");
    let r: Shrunk = try_shrinking(args, schedule, &kinds, &work).await;
    let minimal_path = dir.join("minimal.json");
    std::fs::write(&minimal_path, r.minimal.to_json())?;
    std::fs::write(
        dir.join("shrink.json"),
        serde_json::to_string_pretty(
            &json!({"runs": r.runs, "one_minimal": r.one_minimal, "finding": r.finding,
            "attempts": r.attempts, "repro": r.repro}),
        )? + "\n",
    )?;
    let _ = std::fs::remove_dir_all(&work);
    let repeat = repeat_replay(&minimal_path);
    print_shrunk(schedule, &r, &minimal_path, &repeat)?;
    Ok(ShrinkLine {
        seed: schedule.seed,
        minimal: minimal_path.display().to_string(),
        faults: r
            .minimal
            .faults
            .iter()
            .map(|f| serde_json::to_value(f).unwrap_or(Value::Null))
            .collect(),
        duration_ms: r.minimal.options.duration_ms,
        one_minimal: r.one_minimal,
        finding: r.finding,
        runs: r.runs,
        repro: r.repro,
        repeat,
    })
}

fn write_summary(
    path: &Path,
    args: &Args,
    opts: &Options,
    lines: &[RunLine],
    shrunk: &[ShrinkLine],
    t0: Instant,
) -> anyhow::Result<()> {
    let meta = Meta {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        git_commit: scenarios::git(&["rev-parse", "HEAD"]),
        git_dirty: scenarios::git(&["status", "--porcelain", "--", ".", ":(exclude)evidence"])
            .map(|s| !s.is_empty()),
        bug: std::env::var("IM_BUG")
            .ok()
            .filter(|b| !b.trim().is_empty()),
        generator: harness::nemesis::schedule::GENERATOR_VERSION,
        jobs: args.jobs,
        shard: args.shard.map(|(k, n)| format!("{k}/{n}")),
        wall_s: (t0.elapsed().as_secs_f64() * 10.0).round() / 10.0,
        shards: None,
    };
    let s = summarize(meta, opts, lines, shrunk);
    write_json(path, &s).map(|_| ())
}

/// Writes the summary as pretty JSON, atomically, where this run publishes `path`
/// (creating its directory), and returns that path.
fn write_json(path: &Path, s: &Summary) -> anyhow::Result<PathBuf> {
    let path = &harness::util::publish_path(path);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    harness::util::write_atomic(path, (serde_json::to_string_pretty(s)? + "\n").as_bytes())?;
    Ok(path.clone())
}

/// What the runs add up to: anomalies, faults and client operations by kind, and the
/// repair times (each run's median, the maximum over all, how many repairs).
#[derive(Default)]
struct Totals {
    anomalies: BTreeMap<String, u64>,
    faults: BTreeMap<String, u64>,
    ops: BTreeMap<String, BTreeMap<String, u64>>,
    p50s: Vec<f64>,
    max: Option<f64>,
    repairs: u64,
}

/// Adds up the runs of `lines` (the medians unsorted).
fn totals(lines: &[RunLine]) -> Totals {
    let mut t = Totals::default();
    for l in lines {
        for (k, n) in &l.anomalies {
            *t.anomalies.entry(k.clone()).or_insert(0) += n;
        }
        for (k, n) in &l.faults {
            *t.faults.entry(k.clone()).or_insert(0) += n;
        }
        for (op, c) in &l.ops {
            let e = t.ops.entry(op.clone()).or_default();
            for (how, n) in [
                ("invoke", c.invoke),
                ("ok", c.ok),
                ("fail", c.fail),
                ("info", c.info),
            ] {
                *e.entry(how.to_string()).or_insert(0) += n;
            }
        }
        t.repairs += l.repair_ms.n;
        if let Some(p) = l.repair_ms.p50 {
            t.p50s.push(p);
        }
        if let Some(m) = l.repair_ms.max {
            t.max = Some(t.max.map_or(m, |x: f64| x.max(m)));
        }
    }
    t
}

/// The summary of `lines`: counts, aggregates, and the runs themselves.
fn summarize(meta: Meta, opts: &Options, lines: &[RunLine], shrunk: &[ShrinkLine]) -> Summary {
    let Totals {
        anomalies,
        faults,
        ops,
        mut p50s,
        max,
        repairs,
    } = totals(lines);
    p50s.sort_by(f64::total_cmp);
    let count = |v: Verdict| lines.iter().filter(|l| l.verdict == v).count() as u64;
    let (pass, fail, error) = (
        count(Verdict::Pass),
        count(Verdict::Fail),
        count(Verdict::Error),
    );
    Summary {
        schema_version: 1,
        verdict: Verdict::of(pass == lines.len() as u64),
        generated_at: harness::util::rfc3339_now(),
        command: meta.command,
        git_commit: meta.git_commit,
        git_dirty: meta.git_dirty,
        bug: meta.bug,
        generator: meta.generator,
        options: opts.clone(),
        runs: lines.len() as u64,
        pass,
        fail,
        error,
        wall_s: meta.wall_s,
        jobs: meta.jobs,
        shard: meta.shard,
        seeds_per_hour: (lines.len() as f64 / meta.wall_s.max(1e-9) * 3600.0).round(),
        anomalies_by_kind: anomalies,
        expected_loss: json!({
            "messages": lines.iter().map(|l| l.expected_loss).sum::<u64>(),
            "runs": lines.iter().filter(|l| l.expected_loss > 0).count(),
        }),
        faults_by_kind: faults,
        ops,
        repair_ms: json!({"repairs": repairs,
            "median_of_run_p50": im_check::nearest_rank(&p50s, 0.5),
            "max": max}),
        per_run: lines.to_vec(),
        shrunk: shrunk.to_vec(),
        shards: meta.shards,
    }
}

/// The shards' summaries, each with its file.
fn read_summaries(files: &[PathBuf]) -> anyhow::Result<Vec<(PathBuf, Summary)>> {
    let mut parts: Vec<(PathBuf, Summary)> = Vec::new();
    for f in files {
        let text = std::fs::read(f).with_context(|| format!("read {}", f.display()))?;
        let s: Summary =
            serde_json::from_slice(&text).with_context(|| format!("parse {}", f.display()))?;
        parts.push((f.clone(), s));
    }
    Ok(parts)
}

/// Sorts the parts by shard and checks they are shards K/N for every K of one N, of one
/// series (commit, generator, options, bug); returns N.
fn check_shards(parts: &mut [(PathBuf, Summary)]) -> anyhow::Result<u64> {
    let shard_of = |s: &Summary| -> anyhow::Result<(u64, u64)> {
        let sh = s
            .shard
            .as_deref()
            .context("a summary without `shard`: not a shard")?;
        parse_shard(sh).map_err(|e| anyhow::anyhow!(e))
    };
    parts.sort_by_key(|(_, s)| shard_of(s).map(|(k, _)| k).unwrap_or(u64::MAX));
    let n = shard_of(&parts[0].1)?.1;
    for (i, (f, s)) in parts.iter().enumerate() {
        let (k, m) = shard_of(s)?;
        if m != n || k != i as u64 {
            bail!(
                "{}: shard {k}/{m}, expected {i}/{n}: give every shard of one series once",
                f.display()
            );
        }
        let first = &parts[0].1;
        if s.git_commit != first.git_commit
            || s.generator != first.generator
            || s.options != first.options
            || s.bug != first.bug
        {
            bail!(
                "{}: not the same series as {} (commit, generator, options or bug differ)",
                f.display(),
                parts[0].0.display()
            );
        }
    }
    if parts.len() as u64 != n {
        bail!("{} shard(s) of {n}", parts.len());
    }
    Ok(n)
}

/// The joined series' provenance: the first shard's commit, generator and bug, dirty if
/// any shard was (or did not say), the shards' walls added, and each shard's own.
fn joined_meta(parts: &[(PathBuf, Summary)]) -> Meta {
    let first = &parts[0].1;
    Meta {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        git_commit: first.git_commit.clone(),
        git_dirty: Some(parts.iter().any(|(_, s)| s.git_dirty != Some(false))),
        bug: first.bug.clone(),
        generator: first.generator,
        jobs: first.jobs,
        shard: None,
        // The series' work: the shards' walls added (they may have run side by side).
        wall_s: parts.iter().map(|(_, s)| s.wall_s).sum(),
        shards: Some(
            parts
                .iter()
                .map(|(f, s)| {
                    json!({"shard": s.shard, "jobs": s.jobs, "wall_s": s.wall_s,
                           "generated_at": s.generated_at, "runs": s.runs,
                           "file": f.display().to_string()})
                })
                .collect(),
        ),
    }
}

/// `--join`: the shards' summaries as the one an unsharded series writes: their runs by
/// seed, the counts and aggregates computed again, each shard's provenance in `shards`.
/// Refused unless the files are shards K/N for every K of one N, at one commit, with one
/// generator, options and bug. Ok(true) when every run passed.
fn join(files: &[PathBuf], out: &Path) -> anyhow::Result<bool> {
    let mut parts = read_summaries(files)?;
    let n = check_shards(&mut parts)?;
    let mut lines: Vec<RunLine> = parts.iter().flat_map(|(_, s)| s.per_run.clone()).collect();
    lines.sort_by_key(|l| l.seed);
    let mut shrunk: Vec<ShrinkLine> = parts.iter().flat_map(|(_, s)| s.shrunk.clone()).collect();
    shrunk.sort_by_key(|l| l.seed);
    let first = &parts[0].1;
    let meta = joined_meta(&parts);
    let opts = first.options.clone();
    let s = summarize(meta, &opts, &lines, &shrunk);
    let out = &write_json(out, &s)?;
    println!(
        "nemesis: joined {} shards: {} runs, {} PASS, {} FAIL, {} ERROR: {}",
        n,
        s.runs,
        s.pass,
        s.fail,
        s.error,
        out.display()
    );
    Ok(s.verdict == Verdict::Pass)
}
