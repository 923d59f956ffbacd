//! `make controls`: the negative controls. Runs the scenario suite (the im-06 checks and
//! the protocol tests that judge their history) once against the clean gateway, then
//! against each deliberate bug (`IM_BUG`: the gateway's, from the controls build
//! `im-gateway-bugs`, and the test client's and harness's, `harness::client::bugs`), and
//! writes `evidence/controls/result.json` (format: evidence/README.md, "Controls"): per
//! bug, caught or missed, by which tests and anomaly kinds, in how many of the runs.
//!
//! Run 1 of a bug runs the whole suite; runs 2..N run the tests that caught it in run 1
//! (at most [`RERUN_TESTS_MAX`], the quickest), so "caught in each of N runs" costs
//! seconds, not minutes. A bug counts as caught only when every run caught it.
//! Nothing here judges an invariant: a test fails on its own assertions or on the
//! checker's anomalies, and this runner only reads what the tests wrote.

use anyhow::{bail, Context};
use harness::util::Eta;
use scenarios::{git, target_dir, workspace, Verdict};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// The tests a bug is run against, at most: the checks built to catch it among those that
/// caught it in its whole-suite run, else the quickest of those ([`pick`]). One reliable
/// catcher proves the bug caught; every further one multiplies the runs (measured at
/// 302a352+: no-sweep against its three catchers took 278 s for 10 runs, against the
/// quickest alone about 20).
const RERUN_TESTS_MAX: usize = 1;
/// Version of evidence/controls/result.json.
const SCHEMA_VERSION: u32 = 1;
/// The suite a control runs: every im-06 check, the protocol tests, the steady-state repair
/// and bounds checks, the hostile-peer tests, and the epoch checks (issue 21: without them
/// the suite cannot catch `no-epoch`; the first control of it, at 7b1d0ce, missed it so).
const SUITE: &str = "binary(im06) | binary(protocol) | binary(repair) | binary(bounds) \
                     | binary(hostile) | binary(epochs)";

/// What we know before running about the bugs only some faults can expose.
/// (`async-commit` is not among them: an asynchronous commit is acknowledged while its WAL
/// may still sit in PostgreSQL's WAL buffers, shared memory, so an immediate shutdown and a
/// failover lose it too, not only a power cut.)
fn known_limit(bug: &str) -> Option<&'static str> {
    match bug {
        "no-incarnation" => Some(
            "caught only with synchronous_commit=off: the normal checks and the nemesis run \
             with durable commits, where a restart loses nothing acknowledged and the \
             incarnation is rightly not part of the lineage; the epochs crash check runs \
             under off.",
        ),
        "fsync-off" => Some(
            "caught only by a power cut: with fsync=off the WAL is written to the OS at \
             commit but never flushed, so only losing the page cache loses it; a process \
             crash and an immediate shutdown keep the page cache. 06-power-loss-keeps-acked \
             (the LazyFS layer) is that fault; on a machine without FUSE it is NOT_RUN and \
             this bug is MISSED.",
        ),
        _ => None,
    }
}

/// What the nemesis would need to expose a bug it misses (issue 42: the reason in the
/// evidence, per bug it cannot catch): stated from the bug's mechanism, not measured.
/// Written into a bug's `nemesis.would_need` only when its series missed it; a series that
/// misses a bug with no statement here says so (`would_need: null`).
const NEMESIS_WOULD_NEED: &[(&str, &str)] = &[
    (
        "no-feed",
        "the last notification of a conversation lost (a dropped NOTIFY, a crash before \
         it) with no later send of that conversation before the heal: the workload's next \
         send brings a notification whose read finds the lost commit too. The tail fault \
         makes that likely, not certain (3 gateways: caught at seeds 5, 10 and 30 of 60)",
    ),
    (
        "read-fail-unrecorded",
        "a fan-out read that fails on the last sends of a conversation, with a receiver \
         of it on that gateway, and no later send of it: any later notification reads from \
         the same point and repairs it in milliseconds. The tail fault at `fanout.read` \
         (generator 9, one tail in six) is that state, and caught it at seeds 5 and 7 of \
         `--kinds gw-fault` on 3 gateways; a default series draws it by chance",
    ),
    (
        "sticky-member",
        "a check of cost, not of results: a user who left still takes the conversation's \
         row lock and then gets NOT_MEMBER, as it should. Needs the lock waits of a \
         non-member's send counted (the scripted check reads pg_locks)",
    ),
    (
        "forgetful-member",
        "a check of cost, not of results: every send reads the membership first and gets \
         the same answer. Needs the statements of a member's send counted (the scripted \
         check counts them)",
    ),
    (
        "stale-backlog",
        "reinstalls mid-run (a device's install replaced while pushes are queued for the \
         old one) and a check of what a stale install may still receive: the workload \
         never reinstalls",
    ),
    (
        "no-overflow-hint",
        "a slow reader whose outbound queue overflows (a small IM_QUEUE_FRAMES_MAX, a \
         client that stops reading) and a repair bound shorter than the sweep's: without \
         the hint the sweep still repairs within D5's bound, which is what is judged",
    ),
    (
        "no-close-drain",
        "graceful restarts (SIGTERM) under pipelined sends with input unread at the close, \
         and a check that a gracefully closed connection lost no reply it wrote: the \
         gateway faults are SIGKILL and crash points, after which lost replies are \
         expected and the outbox replays them",
    ),
    (
        "no-local-handoff",
        "a push-latency bound for the sending gateway's own devices while its LISTEN \
         connection is down: they get their pushes by the NOTIFY round trip instead, \
         milliseconds later, and the regain pass repairs the rest within D5's bound",
    ),
    (
        "batch-fails-innocents",
        "a check that a send fails only for its own reasons: a batch that failed answers \
         its innocent rows with the batch's error, their clients retry the same cmid (D2) \
         and nothing acknowledged is lost or doubled, so the checker sees no anomaly; \
         only a late retry that misses D5's bound is seen (d5-not-repaired, at seed 2 of \
         generator 6), by chance. It would need a fault on one row of a batch (a \
         conversation locked or a row refused) and the outcome of every other row judged",
    ),
    (
        "feed-gives-up",
        "a failed commit-feed look and then, in the same LISTEN session, the last \
         notification of a conversation lost with no later send of it before the heal, \
         as for no-feed: the feed is the only repair then. `gw-fault` at `fanout.feed` \
         (generator 9) fails a look, but never as the tail fault, so the lost last \
         notification after it comes by chance (caught at seeds 14 and 20 of earlier \
         series, missed in 20 seeds at c796964)",
    ),
    (
        "gone-device-stays",
        "devices removed in the workload (the nemesis never removes one) while their \
         gateway's LISTEN connection is lost, so that only the sweep's look-up can close \
         them, and a check that a removed device's connections close within D5's bound",
    ),
    (
        "feed-window",
        "a send whose transaction is open across a commit-feed look (a slow commit) and \
         whose notification is then lost, with no later send of its conversation before \
         the heal, as for no-feed: the workload's next send of the conversation brings a \
         notification whose read finds the skipped commit too",
    ),
    (
        "pushes-uncharged",
        "a slow reader sent messages large enough that its queue reaches the byte bound \
         long before the frame count (256), and a check of the bytes a connection's \
         queue holds, or of an overflow where only the byte bound can give one: the bug \
         loses nothing, the frame count still overflows the queue in the end",
    ),
    (
        "no-epoch",
        "an asynchronous failover (pg-failover-async) that loses messages a device already \
         holds: the nemesis catches it there (held-lost), measured at seeds 24 and 27 on 3 \
         gateways and seed 14 on 1, but the kind is drawn in 11 of 100 seeds on 3 gateways \
         and in none of seeds 1 to 20; a synchronous failover loses nothing, so no device \
         is wrong without the epoch",
    ),
    (
        "no-incarnation",
        "database restarts under synchronous_commit = off, where a crash loses \
         acknowledged commits: the nemesis runs the gateway with durable commits, under \
         which a restart loses nothing and the incarnation is rightly not part of the \
         lineage (seed 24 on 3 gateways, which catches no-epoch, passes with it)",
    ),
    (
        "replaced-install-acks",
        "reinstalls in the workload (the nemesis never reinstalls a device), an old \
         install that acks after its reinstall while nothing has closed it yet (its \
         gateway's LISTEN lost, or the ack racing the reinstall's notification), and a \
         check that every current install's cursor was written by an ack of that install",
    ),
];

fn nemesis_would_need(bug: &str) -> Option<&'static str> {
    NEMESIS_WOULD_NEED
        .iter()
        .find(|(b, _)| *b == bug)
        .map(|(_, why)| *why)
}

/// The check built to catch each bug every time (not by winning a race): it is re-run in
/// runs 2..N whenever it caught the bug in run 1, so "caught in every run" measures it.
fn designed_catcher(bug: &str) -> &'static [&'static str] {
    match bug {
        "reply-before-commit" | "commit-after-reply" | "push-before-commit" => {
            &["im06_commit_held_open"]
        }
        "no-dedup" => &["im06_crash_api_after_send_commit", "im06_lost_reply_retry"],
        "cursor-overwrite" => &["im06_ack_monotonic_and_bounded"],
        // A lost ack is re-hinted only by the sweep: the quickest check of it.
        "no-sweep" => &["im06_lost_ack_swept", "im06_lost_push_swept"],
        // A sync moving the cursor: the quickest sync after a lost push (0.7 s; the sweep's
        // 30-trial distribution test catches it too, in 16 s).
        "cursor-on-sync" => &["im06_lost_push_gap_synced"],
        "seq-gap" => &["im06_crash_send_before_commit"],
        "s1-leak" => &["membership_periods_bound_what_a_device_sees_s1"],
        "slow-sweep" => &["im06_sweep_hint_cadence"],
        "ack-before-persist" => &["im06_receiver_crash_after_ack"],
        "cursor-max" => &["im06_lost_push_gap_synced"],
        "no-feed" => &[
            "repair_dropped_notify_one_gateway",
            "repair_dropped_notify_two_gateways",
        ],
        "no-regain-pass" => &[
            "repair_lost_listen_one_gateway",
            "repair_lost_listen_two_gateways",
        ],
        "read-fail-unrecorded" => &[
            "repair_failed_read_one_gateway",
            "repair_failed_read_two_gateways",
        ],
        "sticky-member" => &["a_user_who_left_waits_on_the_conversation_lock_at_most_once"],
        "stale-backlog" => &["a_stale_install_gets_nothing_queued_before_its_reinstall"],
        "no-close-drain" => &["sigterm_with_unread_input_still_delivers_all_it_wrote"],
        "forgetful-member" => &["a_members_send_skips_the_membership_read"],
        "no-local-handoff" => &["local_devices_get_pushes_without_the_listen_connection"],
        "batch-reply-rolled-back" | "batch-fails-innocents" => {
            &["a_failed_batch_fails_no_send_and_answers_only_what_committed"]
        }
        "no-overflow-hint" => &[
            "repair_overflow_one_gateway",
            "repair_overflow_two_gateways",
        ],
        // The lineage check skipped: any new lineage shows it, the crash that lost unflushed
        // commits (11 s) as well as the asynchronous failover (25 s).
        "no-epoch" => &["a_crash_that_lost_unflushed_commits_leaves_no_device_silently_wrong"],
        "no-incarnation" => {
            &["a_crash_that_lost_unflushed_commits_leaves_no_device_silently_wrong"]
        }
        "outage-charges-hello" => &["a_database_outage_charges_no_failed_hello"],
        "replaced-install-acks" => &[
            "repair_stale_ack_one_gateway",
            "repair_stale_ack_two_gateways",
        ],
        "hint-past-leave" => &["the_sweep_hints_a_member_who_left_at_the_last_event_they_may_see"],
        "feed-gives-up" => &[
            "repair_failed_feed_look_one_gateway",
            "repair_failed_feed_look_two_gateways",
        ],
        "gone-device-stays" => &[
            "repair_removed_device_one_gateway",
            "repair_removed_device_two_gateways",
        ],
        "feed-window" => &[
            "repair_feed_window_one_gateway",
            "repair_feed_window_two_gateways",
        ],
        "pushes-uncharged" => &[
            "repair_overflow_by_bytes_one_gateway",
            "repair_overflow_by_bytes_two_gateways",
        ],
        _ => &[],
    }
}

/// The negative controls: run the suite against the clean gateway and against each
/// deliberate bug, and write evidence/controls/result.json (format: evidence/README.md).
#[derive(clap::Parser, Debug)]
#[command(
    name = "controls",
    after_help = concat!(
        include_str!("harness_env.txt"),
        "  CARGO                   the cargo that runs nextest [default: cargo]\n\
         (controls sets IM_BUG and IMFAULT_KEEP_FAILED=0 for the runs it starts.)\n\
         Needs target/debug/im-gateway-bugs: run it as `make controls`."
    )
)]
struct Opts {
    /// Runs per bug (a bug counts as caught only when every run caught it).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    runs: u32,
    /// Only these bugs (comma-separated names, as `im-gateway bugs` and the client list them).
    #[arg(long, value_delimiter = ',')]
    only: Option<Vec<String>>,
    /// Where to write the result [default: evidence/controls/result.json].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Replace only the --only bugs' entries of an existing result file (each entry keeps
    /// the commit it ran at), after a clean baseline at the current commit.
    #[arg(long, requires = "only")]
    merge: bool,
    /// Also run each bug under the nemesis (issue 10): seeds 1..=N of `nemesis` (default
    /// options), stopping at the first seed that catches it; 0 skips this part.
    #[arg(long, default_value_t = 20)]
    nemesis_seeds: u64,
    /// Gateways of each nemesis run (`nemesis --gateways`): 3 behind HAProxy, as deployed
    /// (issue 21: a bug of the repair across gateways, `no-feed`, shows only there); 1 runs
    /// the one-gateway schedules.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=3))]
    nemesis_gateways: u32,
    /// Run only the nemesis part: keep every suite result of the existing file (as
    /// measured, with its commit) and replace only the bugs' `nemesis` entries.
    #[arg(long)]
    nemesis_only: bool,
    /// Places for the suite parts at once: one holds the clean side, the others the bugs'
    /// (each its own nextest, running its one test at a time: four scenarios at once, as the
    /// suite runs them; measured at two at once, the load average stayed near 0.5 on two
    /// cores, the tests waiting on sweeps and timeouts).
    /// The nemesis parts run one after the other (each series is 7 seeds at once, as `make
    /// nemesis` runs them).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=8))]
    parallel: u32,
    /// Run every bug's run 1 on the whole suite (recording its catchers anew) instead of
    /// the catchers the record names.
    #[arg(long)]
    whole: bool,
    /// The result file whose recorded catchers and nemesis seeds pick what runs
    /// [default: evidence/controls/result.json].
    #[arg(long)]
    record: Option<PathBuf>,
    /// Only shard K of N of the bugs (0-based, round-robin over the list, after --only): bugs
    /// whose index is K modulo N. Writes target/controls/shard-K-of-N.json unless --out says
    /// otherwise; `--join` makes the shards one record.
    #[arg(long, value_name = "K/N", value_parser = parse_shard, conflicts_with_all = ["merge", "nemesis_only"])]
    shard: Option<(usize, usize)>,
    /// Join these shard files (one per K of one N, all at one commit) into the record an
    /// unsharded run writes (--out, default evidence/controls/result.json); runs nothing.
    #[arg(long, num_args = 1.., value_name = "FILE", conflicts_with_all = ["only", "shard", "merge", "nemesis_only"])]
    join: Option<Vec<PathBuf>>,
}

fn parse_shard(s: &str) -> Result<(usize, usize), String> {
    let (k, n) = s.split_once('/').ok_or("a shard is K/N, e.g. 0/2")?;
    let k: usize = k
        .trim()
        .parse()
        .map_err(|e| format!("shard K {k:?}: {e}"))?;
    let n: usize = n
        .trim()
        .parse()
        .map_err(|e| format!("shard N {n:?}: {e}"))?;
    if n == 0 || k >= n {
        return Err(format!("shard {k}/{n}: need 0 <= K < N"));
    }
    Ok((k, n))
}

/// Seeds of the nemesis at once, as `make nemesis` runs them (clean series at this
/// concurrency are in evidence/nemesis), across the bugs ([`nemesis_part`]).
const NEMESIS_JOBS: usize = 7;

/// A clean directory at `dir`: whatever an earlier run left there is removed first.
fn fresh_dir(dir: &Path) -> anyhow::Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("clear {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir)?;
    Ok(())
}

/// Seed `seed` of the nemesis, its run under `dir` and its summary in `summary`, in the
/// bug's environment `env`. `--jobs` only makes the nemesis run the seed in a child
/// process, as each seed of its own series runs; the queue across the bugs
/// ([`nemesis_part`]) is what runs [`NEMESIS_JOBS`] at once.
fn nemesis_command(
    dir: &Path,
    summary: &Path,
    seed: u64,
    gateways: u32,
    env: &[(&str, String)],
) -> Command {
    let mut cmd = Command::new(target_dir().join("debug/nemesis"));
    cmd.args([
        "--first-seed",
        &seed.to_string(),
        "--seeds",
        "1",
        "--jobs",
        &NEMESIS_JOBS.to_string(),
        "--gateways",
        &gateways.to_string(),
    ])
    .arg("--out")
    .arg(dir)
    .arg("--summary")
    .arg(summary)
    .env("RUST_BACKTRACE", "0")
    .env_remove("IM_BUG")
    .env_remove("IM_GATEWAY_BIN")
    .current_dir(workspace());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// One seed of the nemesis against `bug`, as it ended.
#[derive(Debug)]
struct SeedRun {
    seed: u64,
    /// The checker failed the run.
    caught: bool,
    /// The run could not be judged (`ERROR`: a heal that did not finish).
    not_judged: bool,
    /// Its anomaly kinds and the command that runs it again (null unless `caught`).
    anomalies: Value,
    repeat: Value,
    started: Instant,
    ended: Instant,
}

/// Seed `seed` of the nemesis against `bug` (environment `env`), its run under
/// `{bug}-nemesis/seed-{seed}`.
fn nemesis_run(
    bug: &str,
    env: &[(&str, String)],
    seed: u64,
    gateways: u32,
) -> anyhow::Result<SeedRun> {
    let dir = nemesis_dir(bug).join(format!("seed-{seed}"));
    fresh_dir(&dir)?;
    let summary = dir.join("summary.json");
    let started = Instant::now();
    let mut cmd = nemesis_command(&dir, &summary, seed, gateways, env);
    let out = cmd.output().context("run target/debug/nemesis")?;
    std::fs::write(dir.join("nemesis.log"), &out.stdout)?;
    let s: Value = serde_json::from_slice(&std::fs::read(&summary).with_context(|| {
        format!(
            "nemesis wrote no summary ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .chars()
                .take(2000)
                .collect::<String>()
        )
    })?)?;
    let run = s["per_run"]
        .as_array()
        .and_then(|r| r.first())
        .cloned()
        .with_context(|| format!("nemesis seed {seed} of {bug}: its summary lists no run"))?;
    let caught = run["verdict"] == Verdict::Fail;
    Ok(SeedRun {
        seed,
        caught,
        not_judged: run["verdict"] == Verdict::Error,
        anomalies: if caught {
            run["anomalies"].clone()
        } else {
            Value::Null
        },
        repeat: if caught {
            run["repeat"].clone()
        } else {
            Value::Null
        },
        started,
        ended: Instant::now(),
    })
}

/// Where `bug`'s nemesis runs go.
fn nemesis_dir(bug: &str) -> PathBuf {
    target_dir()
        .join("imfault-controls")
        .join(format!("{bug}-nemesis"))
}

/// A bug's `nemesis` entry from its runs of seeds `first..=last` (`runs`, not empty):
/// caught by the lowest seed that caught it; `wall_ms` from the first run's start to the
/// last one's end (the runs of other bugs beside them).
fn nemesis_entry(runs: &[SeedRun], first: u64, last: u64, gateways: u32) -> Value {
    let catching = runs.iter().filter(|r| r.caught).min_by_key(|r| r.seed);
    let start = runs.iter().map(|r| r.started).min();
    let end = runs.iter().map(|r| r.ended).max();
    let wall = match (start, end) {
        (Some(s), Some(e)) => e.duration_since(s).as_millis() as u64,
        _ => 0,
    };
    json!({
        "result": if catching.is_some() { "CAUGHT" } else { "MISSED" },
        "seeds_run": runs.len(),
        "first_seed": first,
        "seeds_max": last,
        "gateways": gateways,
        "first_catching_seed": catching.map(|r| r.seed),
        "anomaly_kinds": catching.map(|r| r.anomalies.clone()),
        "repeat": catching.map(|r| r.repeat.clone()),
        "runs_not_judged": runs.iter().filter(|r| r.not_judged).count(),
        "wall_ms": wall,
    })
}

fn parse_args() -> Opts {
    let mut o: Opts = clap::Parser::parse();
    if let Some(only) = o.only.as_mut() {
        only.iter_mut().for_each(|s| *s = s.trim().to_string());
    }
    o
}

/// One iteration of a nextest run: which tests passed and failed.
#[derive(Default, Clone)]
struct Iteration {
    passed: Vec<String>,
    failed: Vec<String>,
}

/// One nextest run (`runs` iterations with `--stress-count`): which tests passed and failed
/// in each, how long each test took, and what the tests wrote (the last iteration's).
struct RunResult {
    iterations: Vec<Iteration>,
    /// Each test's longest duration over the iterations, from nextest's status lines.
    duration_ms: BTreeMap<String, u64>,
    /// im-06 records by id.
    records: BTreeMap<String, Value>,
    /// Protocol tests' checker verdicts by test name.
    protocol: BTreeMap<String, Value>,
    wall_ms: u64,
}

impl RunResult {
    /// The first (for a whole-suite run, the only) iteration.
    fn first(&self) -> &Iteration {
        &self.iterations[0]
    }
}

/// One status line of nextest's output, `STATUS [ 1.234s] [i/N] (k/m) <binary> <test>`
/// (`[i/N]` only under `--stress-count`): (status, iteration from 1, seconds, test name).
fn status_line(line: &str) -> Option<(&str, usize, f64, String)> {
    let t = line.trim_start();
    let (status, rest) = t.split_once(' ')?;
    let rest = rest.trim_start().strip_prefix('[')?;
    let (secs, rest) = rest.split_once(']')?;
    let secs: f64 = secs.trim().trim_end_matches('s').parse().ok()?;
    let rest = rest.trim_start();
    let iteration = match rest.strip_prefix('[') {
        Some(r) => r.split_once('/')?.0.trim().parse().ok()?,
        None => 1,
    };
    let name = t.rsplit(' ').next()?.to_string();
    Some((status, iteration, secs, name))
}

/// cargo nextest over the tests `filter` selects, `runs` iterations of them, every status
/// line on stderr, the tests' records written to `dir`, in the bug's environment `env`.
fn nextest_command(filter: &str, env: &[(&str, String)], dir: &Path, runs: u32) -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.args([
        "nextest",
        "run",
        "--workspace",
        "--features",
        "im-gateway/faults",
        "--no-fail-fast",
        "--status-level",
        "all",
        "--final-status-level",
        "none",
        "-E",
        filter,
    ]);
    if runs > 1 {
        cmd.args(["--stress-count", &runs.to_string()]);
    }
    cmd.env("IMFAULT_EVIDENCE_DIR", dir)
        .env("RUST_BACKTRACE", "0")
        // Failures are expected here, by the hundred: don't keep their clusters.
        .env("IMFAULT_KEEP_FAILED", "0")
        .env_remove("IM_BUG")
        .env_remove("IM_GATEWAY_BIN")
        .current_dir(workspace());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Reads nextest's status lines: which tests passed and failed in each of the `runs`
/// iterations, and each test's longest duration.
fn read_log(log: &str, runs: u32) -> (Vec<Iteration>, BTreeMap<String, u64>) {
    let mut iterations = vec![Iteration::default(); runs.max(1) as usize];
    let mut duration_ms: BTreeMap<String, u64> = BTreeMap::new();
    for line in log.lines() {
        let Some((status, i, secs, name)) = status_line(line) else {
            continue;
        };
        let Some(it) = iterations.get_mut(i.saturating_sub(1)) else {
            continue;
        };
        let bucket = match status {
            "PASS" => &mut it.passed,
            "FAIL" | "TIMEOUT" | "SIGKILL" | "SIGABRT" | "SIGSEGV" | "ABORT" => &mut it.failed,
            _ => continue,
        };
        let ms = (secs * 1000.0).round() as u64;
        let d = duration_ms.entry(name.clone()).or_insert(0);
        *d = (*d).max(ms);
        bucket.push(name);
    }
    (iterations, duration_ms)
}

fn run_suite(
    filter: &str,
    env: &[(&str, String)],
    label: &str,
    runs: u32,
) -> anyhow::Result<RunResult> {
    let dir = target_dir().join("imfault-controls").join(label);
    fresh_dir(&dir)?;
    let started = Instant::now();
    let mut cmd = nextest_command(filter, env, &dir, runs);
    let out = cmd.output().context("run cargo nextest")?;
    let log = String::from_utf8_lossy(&out.stderr).to_string();
    std::fs::write(dir.join("nextest.log"), &log)?;
    let (iterations, duration_ms) = read_log(&log, runs);
    if iterations
        .iter()
        .any(|it| it.passed.is_empty() && it.failed.is_empty())
    {
        bail!(
            "nextest ran no test ({}); log: {}",
            out.status,
            dir.join("nextest.log").display()
        );
    }
    let records = read_json_records(&dir)?;
    let protocol = read_json_records(&dir.join("protocol"))?;
    Ok(RunResult {
        iterations,
        duration_ms,
        records,
        protocol,
        wall_ms: started.elapsed().as_millis() as u64,
    })
}

/// The JSON records a run's tests wrote to `dir` (none if it does not exist), by their
/// `id` (or `test`).
fn read_json_records(dir: &Path) -> anyhow::Result<BTreeMap<String, Value>> {
    let mut map = BTreeMap::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Ok(map);
    };
    for e in rd {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "json") {
            let v: Value = serde_json::from_slice(&std::fs::read(&p)?)
                .with_context(|| format!("parse {}", p.display()))?;
            let key = v["id"]
                .as_str()
                .or(v["test"].as_str())
                .unwrap_or("?")
                .to_string();
            map.insert(key, v);
        }
    }
    Ok(map)
}

/// How a failing test caught the bug: the checker's anomaly kinds (if it judged), and
/// whether its own assertions failed.
fn how_caught(r: &RunResult, test: &str) -> Value {
    let rec = r
        .records
        .values()
        .find(|v| {
            scenarios::IM06_CHECKS
                .iter()
                .any(|c| c.test == test && v["id"] == c.id)
        })
        .or_else(|| r.protocol.get(test));
    let kinds: Vec<String> = rec
        .and_then(|v| {
            v.pointer("/checker/anomalies_by_kind")
                .or(v.get("anomalies_by_kind"))
        })
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter(|(_, n)| n.as_u64().unwrap_or(0) > 0)
                .map(|(k, _)| k.clone())
                .collect()
        })
        .unwrap_or_default();
    let reason = rec
        .and_then(|v| v["reason"].as_str())
        .map(|s| s.chars().take(400).collect::<String>());
    // What a durability bug cost: acknowledged messages missing after the fault.
    let acked_lost = rec.and_then(|v| {
        v.pointer("/observed/acknowledged_missing_after_recovery")
            .or(v.pointer("/observed/acknowledged_lost_in_failover"))
            .cloned()
    });
    json!({
        "test": test,
        "acknowledged_lost": acked_lost,
        "anomaly_kinds": kinds,
        "duration_ms": rec.and_then(|v| v["duration_ms"].as_u64()),
        "failure": reason,
    })
}

fn gateway_bugs(bin: &Path) -> anyhow::Result<Vec<String>> {
    let out = Command::new(bin)
        .arg("bugs")
        .output()
        .with_context(|| format!("run {} bugs", bin.display()))?;
    if !out.status.success() {
        bail!(
            "`{} bugs` failed: {}",
            bin.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect())
}

fn main() -> anyhow::Result<()> {
    let o = parse_args();
    let started = Instant::now();
    if let Some(files) = &o.join {
        let out = o
            .out
            .clone()
            .unwrap_or_else(|| workspace().join("evidence/controls/result.json"));
        return join_shards(files, &out);
    }
    let out = o.out.clone().unwrap_or_else(|| match o.shard {
        Some((k, n)) => target_dir().join(format!("controls/shard-{k}-of-{n}.json")),
        None => workspace().join("evidence/controls/result.json"),
    });
    let bugs_bin = bugs_binary()?;
    let bugs = selected_bugs(&o, &bugs_bin)?;
    if o.nemesis_only {
        return nemesis_only(&o, &out, &bugs, &bugs_bin, started);
    }
    // What the last run recorded: the committed result, unless --record names another.
    let record_file = o
        .record
        .clone()
        .unwrap_or_else(|| workspace().join("evidence/controls/result.json"));
    let record = recorded(&record_file);
    let expected = expected_times(&record_file, &bugs, o.nemesis_seeds > 0);
    let mut eta = Eta::new(expected.clone());
    // The clean side of the tests the record says the bugs will run, beside the bugs' runs
    // (in one of their `--parallel` places): both mostly wait on sweeps and timeouts.
    let anticipated = anticipated_clean_tests(&o, &bugs, &record);
    let (controls, early_clean) = bugs_beside_clean(
        &o,
        &bugs,
        &bugs_bin,
        &record,
        &expected,
        &mut eta,
        &anticipated,
    );
    let mut controls = controls?;
    nemesis_controls(&o, &bugs, &bugs_bin, &record, &mut controls, &mut eta)?;
    // A bug that fell back to the whole suite may run tests the record did not name: their
    // clean side now.
    let late: BTreeSet<String> = rerun_tests(&controls)
        .difference(&anticipated)
        .cloned()
        .collect();
    let clean = summed_clean(&[&early_clean?, &clean_side(&o, &late)?]);
    judge_against_clean(&mut controls, &clean);
    // --merge: keep the other bugs' entries of the existing file, as they were measured.
    let partial = if o.merge {
        merge_into(&out, &mut controls, &o)?
    } else {
        Vec::new()
    };
    let environment = environment(&o, &record_file, partial, &bugs_bin)?;
    let doc = document(
        environment,
        controls,
        clean,
        started.elapsed().as_millis() as u64,
    );
    let written = publish(&out, &doc)?;
    println!(
        "\n{} ({} s)",
        written.display(),
        started.elapsed().as_secs()
    );
    finish(&doc)
}

/// The gateway built with its deliberate bugs, which `make controls` builds.
fn bugs_binary() -> anyhow::Result<PathBuf> {
    let bin = target_dir().join("debug/im-gateway-bugs");
    if !bin.is_file() {
        bail!(
            "{} not found: `make controls` builds it (the gateway with --features faults,bugs)",
            bin.display()
        );
    }
    Ok(bin)
}

/// The bugs' suite parts in `--parallel - 1` places, and the clean side of `anticipated`
/// in the last place, at once; each part's own result.
fn bugs_beside_clean(
    o: &Opts,
    bugs: &[(String, &str)],
    bugs_bin: &Path,
    record: &BTreeMap<String, Recorded>,
    expected: &[f64],
    eta: &mut Eta,
    anticipated: &BTreeSet<String>,
) -> (anyhow::Result<Vec<Value>>, anyhow::Result<Value>) {
    std::thread::scope(|s| {
        let early = s.spawn(|| clean_side(o, anticipated));
        let places = o.parallel.saturating_sub(1).max(1);
        let c = suite_controls(o, places, bugs, bugs_bin, record, expected, eta);
        let early = early
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the clean side's thread panicked")));
        (c, early)
    })
}

/// The run's `environment`: the commit, the host, the options, where the catchers came
/// from, the partial runs merged in, and the shard.
fn environment(
    o: &Opts,
    record_file: &Path,
    partial: Vec<Value>,
    bugs_bin: &Path,
) -> anyhow::Result<Value> {
    Ok(json!({
        "git_commit": git(&["rev-parse", "HEAD"]),
        "git_dirty": git(&["status", "--porcelain", "--", ".", ":(exclude)evidence"]).map(|s| !s.is_empty()),
        "generated_at": scenarios::rfc3339_now(),
        "host_cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "suite": SUITE,
        "runs_per_bug": o.runs,
        "nemesis_gateways": o.nemesis_gateways,
        "nemesis_seeds": o.nemesis_seeds,
        "rerun_tests_max": RERUN_TESTS_MAX,
        "bugs_binary": "target/debug/im-gateway-bugs (--features faults,bugs)",
        "catchers_from": record_file.strip_prefix(workspace()).unwrap_or(record_file).display().to_string(),
        "whole": o.whole,
        "partial_runs": partial,
        "shard": o.shard.map(|(k, n)| format!("{k}/{n}")),
        "bugs_total": o.shard.map(|_| unsharded_bugs(o, bugs_bin).map(|b| b.len())).transpose()?,
    }))
}

/// Writes `doc` as pretty JSON, atomically, where this run publishes `out`, and returns
/// that path.
fn publish(out: &Path, doc: &Value) -> anyhow::Result<PathBuf> {
    let written = harness::util::publish_path(out);
    harness::util::write_atomic(
        &written,
        (serde_json::to_string_pretty(doc)? + "\n").as_bytes(),
    )?;
    Ok(written)
}

/// The tests each bug will run against itself, as its record picks them ([`pick`]): none
/// under `--whole` (every bug then runs the whole suite first).
fn anticipated_clean_tests(
    o: &Opts,
    bugs: &[(String, &str)],
    record: &BTreeMap<String, Recorded>,
) -> BTreeSet<String> {
    if o.whole {
        return BTreeSet::new();
    }
    bugs.iter()
        .filter_map(|(bug, _)| {
            record
                .get(bug)
                .map(|r| pick(&r.catchers, designed_catcher(bug)))
        })
        .flatten()
        .map(|(t, _)| t)
        .collect()
}

/// Every test a bug was run against (`rerun_tests`).
fn rerun_tests(controls: &[Value]) -> BTreeSet<String> {
    controls
        .iter()
        .flat_map(|c| c["rerun_tests"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t.as_str().map(str::to_string))
        .collect()
}

/// The clean side: these tests, as many runs as a bug's, on the clean gateway.
fn clean_side(o: &Opts, tests: &BTreeSet<String>) -> anyhow::Result<Value> {
    if tests.is_empty() {
        return Ok(empty_clean());
    }
    eprintln!(
        "controls: the clean gateway, {} runs of {} tests the bugs run",
        o.runs,
        tests.len(),
    );
    let r = run_suite(&filter_of(tests), &[], "clean", o.runs)?;
    let mut failed: BTreeMap<String, u32> = BTreeMap::new();
    for it in &r.iterations {
        for t in &it.failed {
            *failed.entry(t.clone()).or_insert(0) += 1;
        }
    }
    eprintln!(
        "  clean gateway: {} of {} tests failed in some run",
        failed.len(),
        tests.len()
    );
    Ok(json!({
        "tests": tests,
        "runs": o.runs,
        "failed": failed,
        "anomalies": anomalies_of(&r),
        "wall_ms": r.wall_ms,
    }))
}

/// A clean side that ran nothing.
fn empty_clean() -> Value {
    json!({"tests": [], "runs": 0, "failed": {}, "anomalies": 0, "wall_ms": 0})
}

/// Clean sides as one: the tests of all, failures, anomalies and wall times summed (the
/// sides ran one after another, or on separate machines); `runs` from the first side that
/// ran anything.
fn summed_clean(sides: &[&Value]) -> Value {
    let mut tests: BTreeSet<String> = BTreeSet::new();
    let mut failed: BTreeMap<String, u64> = BTreeMap::new();
    let (mut anomalies, mut wall) = (0u64, 0u64);
    for side in sides {
        tests.extend(
            side["tests"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t.as_str().map(str::to_string)),
        );
        for (t, n) in side["failed"].as_object().into_iter().flatten() {
            *failed.entry(t.clone()).or_insert(0) += n.as_u64().unwrap_or(0);
        }
        anomalies += side["anomalies"].as_u64().unwrap_or(0);
        wall += side["wall_ms"].as_u64().unwrap_or(0);
    }
    let ran = sides
        .iter()
        .find(|s| s["tests"].as_array().is_some_and(|t| !t.is_empty()))
        .or(sides.first());
    json!({
        "tests": tests,
        "runs": ran.map_or(json!(0), |s| s["runs"].clone()),
        "failed": failed,
        "anomalies": anomalies,
        "wall_ms": wall,
    })
}

/// A bug whose picked tests failed on the clean gateway too is not shown caught by them:
/// `CLEAN_FAILS`, whatever the bug runs said.
fn judge_against_clean(controls: &mut [Value], clean: &Value) {
    for c in controls.iter_mut() {
        let clean_failed: Vec<String> = c["rerun_tests"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .filter(|t| clean["failed"][t].as_u64().unwrap_or(0) > 0)
            .map(str::to_string)
            .collect();
        if !clean_failed.is_empty() {
            c["result"] = json!("CLEAN_FAILS");
        }
        c["clean_failed"] = json!(clean_failed);
    }
}

/// The whole result document, its summary computed from `controls` and `clean`.
fn document(environment: Value, controls: Vec<Value>, clean: Value, wall_ms: u64) -> Value {
    let count = |r: &str| controls.iter().filter(|c| c["result"] == r).count();
    json!({
        "schema_version": SCHEMA_VERSION,
        "generated_by": "make controls (scenarios/src/bin/controls.rs)",
        "environment": environment,
        "clean": clean,
        "summary": {
            "bugs": controls.len(),
            "caught": count("CAUGHT"),
            "flaky": count("FLAKY"),
            "missed": count("MISSED"),
            "clean_fails": count("CLEAN_FAILS"),
            "targeted": controls.iter().filter(|c| c["mode"] == "targeted").count(),
            "whole_suite": controls.iter().filter(|c| c["mode"] == "whole-suite").count(),
            "wall_ms": wall_ms,
            "nemesis": nemesis_summary(&controls),
        },
        "controls": controls,
    })
}

/// Prints the table; exit status 1 when the clean gateway failed a test or showed
/// anomalies (the controls then mean nothing) or a bug was not caught every time.
fn finish(doc: &Value) -> anyhow::Result<()> {
    let clean = &doc["clean"];
    let clean_failed = clean["failed"].as_object().map_or(0, |m| m.len());
    println!(
        "  clean gateway: {} tests x {} runs, {} failed, {} anomalies",
        clean["tests"].as_array().map_or(0, Vec::len),
        clean["runs"],
        clean_failed,
        clean["anomalies"]
    );
    print_table(doc);
    if clean_failed > 0 || clean["anomalies"].as_u64().unwrap_or(0) > 0 {
        eprintln!("the clean gateway failed or showed anomalies: the controls mean nothing");
        std::process::exit(1);
    }
    let s = &doc["summary"];
    if s["caught"] != s["bugs"] {
        eprintln!(
            "controls: {} of {} bugs caught in every run",
            s["caught"], s["bugs"]
        );
        std::process::exit(1);
    }
    Ok(())
}

/// The whole list back from round-robin shards: item i is item i / n of shard i % n.
fn interleave<T: Clone>(shards: &[Vec<T>]) -> anyhow::Result<Vec<T>> {
    let n = shards.len();
    let total: usize = shards.iter().map(Vec::len).sum();
    (0..total)
        .map(|i| {
            shards[i % n]
                .get(i / n)
                .cloned()
                .with_context(|| format!("shard {} is short of item {i}", i % n))
        })
        .collect()
}

/// `--join`: the shards' files (`--shard K/N` runs, one per K, all at one commit) as the
/// one record an unsharded run writes, bugs in the same order, with the shards' provenance
/// in `environment.shards`.
/// The shards in their order (0..n): every one of one count `n`, each exactly once, all
/// at one commit and one setting.
fn in_shard_order(docs: &[Value]) -> anyhow::Result<Vec<&Value>> {
    let shard_of = |v: &Value| -> anyhow::Result<(usize, usize)> {
        let s = v["environment"]["shard"]
            .as_str()
            .context("a file without environment.shard: not a shard")?;
        let (k, n) = s.split_once('/').context("shard is K/N")?;
        Ok((k.parse()?, n.parse()?))
    };
    let n = shard_of(&docs[0])?.1;
    let mut by_k: Vec<Option<&Value>> = vec![None; n];
    for d in docs {
        let (k, m) = shard_of(d)?;
        if m != n {
            bail!("shards of different counts: {m} and {n}");
        }
        if by_k[k].replace(d).is_some() {
            bail!("shard {k}/{n} given twice");
        }
    }
    if let Some(k) = by_k.iter().position(Option::is_none) {
        bail!("shard {k}/{n} is missing");
    }
    let shards: Vec<&Value> = by_k.into_iter().flatten().collect();
    let env0 = &shards[0]["environment"];
    for s in &shards {
        let e = &s["environment"];
        for key in [
            "git_commit",
            "runs_per_bug",
            "nemesis_seeds",
            "nemesis_gateways",
            "whole",
        ] {
            if e[key] != env0[key] {
                bail!(
                    "shards differ in {key} ({} and {}): one record needs one commit and one setting",
                    env0[key],
                    e[key]
                );
            }
        }
    }
    Ok(shards)
}

/// The shards' clean sides as one ([`summed_clean`]), and the shards' summed wall time.
fn joined_clean(shards: &[&Value]) -> (Value, u64) {
    let sides: Vec<&Value> = shards.iter().map(|s| &s["clean"]).collect();
    let wall = shards
        .iter()
        .map(|s| s["summary"]["wall_ms"].as_u64().unwrap_or(0))
        .sum();
    (summed_clean(&sides), wall)
}

fn join_shards(files: &[PathBuf], out: &Path) -> anyhow::Result<()> {
    let mut docs = Vec::new();
    for f in files {
        let v: Value = serde_json::from_slice(
            &std::fs::read(f).with_context(|| format!("read {}", f.display()))?,
        )
        .with_context(|| format!("parse {}", f.display()))?;
        docs.push(v);
    }
    let shards = in_shard_order(&docs)?;
    let env0 = &shards[0]["environment"];
    // Round-robin: bug i of the whole list is entry i / n of shard i % n.
    let lists: Vec<Vec<Value>> = shards
        .iter()
        .map(|s| s["controls"].as_array().cloned().unwrap_or_default())
        .collect();
    let total: usize = lists.iter().map(Vec::len).sum();
    let mut controls = interleave(&lists)?;
    let (clean, wall) = joined_clean(&shards);
    judge_against_clean(&mut controls, &clean);
    let mut environment = env0.clone();
    environment["shard"] = Value::Null;
    environment["bugs_total"] = Value::Null;
    environment["generated_at"] = json!(scenarios::rfc3339_now());
    environment["git_dirty"] = json!(shards.iter().any(|s| s["environment"]["git_dirty"] == true));
    environment["shards"] = json!(shards
        .iter()
        .zip(files)
        .map(|(s, f)| json!({
            "shard": s["environment"]["shard"],
            "file": f.display().to_string(),
            "generated_at": s["environment"]["generated_at"],
            "host_cores": s["environment"]["host_cores"],
            "bugs": s["controls"].as_array().map_or(0, Vec::len),
            "wall_ms": s["summary"]["wall_ms"],
        }))
        .collect::<Vec<_>>());
    if let Some(t) = env0["bugs_total"].as_u64() {
        if t as usize != total {
            bail!("the shards hold {total} bugs of {t}");
        }
    }
    let doc = document(environment, controls, clean, wall);
    let written = publish(out, &doc)?;
    println!(
        "\n{} (joined from {} shards)",
        written.display(),
        shards.len()
    );
    finish(&doc)
}

/// Each part's expected seconds for the estimate of time left: each bug's suite part, then
/// each bug's nemesis part, as the last run (the file about to be replaced) took them; 0
/// where unknown. The clean side runs beside the suite parts and is not counted.
fn expected_times(out: &Path, bugs: &[(String, &str)], nemesis: bool) -> Vec<f64> {
    let last: Value = std::fs::read(out)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null);
    let ms = |v: &Value| v.as_f64().unwrap_or(0.0) / 1000.0;
    let entry = |bug: &str| {
        last["controls"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["bug"] == bug))
            .cloned()
            .unwrap_or(Value::Null)
    };
    let mut times: Vec<f64> = bugs
        .iter()
        .map(|(bug, _)| {
            entry(bug)["run_wall_ms"]
                .as_array()
                .map_or(0.0, |w| w.iter().map(ms).sum())
        })
        .collect();
    if nemesis {
        times.extend(
            bugs.iter()
                .map(|(bug, _)| ms(&entry(bug)["nemesis"]["wall_ms"])),
        );
    }
    times
}

/// Every deliberate bug (the gateway's, as its binary lists them, then the client's and
/// the harness's) with its side, or those `--only` names (an unknown name is refused);
/// then of those, the `--shard`'s.
fn selected_bugs(o: &Opts, bugs_bin: &Path) -> anyhow::Result<Vec<(String, &'static str)>> {
    let bugs = unsharded_bugs(o, bugs_bin)?;
    Ok(match o.shard {
        Some((k, n)) => bugs
            .into_iter()
            .enumerate()
            .filter(|(i, _)| i % n == k)
            .map(|(_, b)| b)
            .collect(),
        None => bugs,
    })
}

/// Every deliberate bug, or those `--only` names, before any `--shard`.
fn unsharded_bugs(o: &Opts, bugs_bin: &Path) -> anyhow::Result<Vec<(String, &'static str)>> {
    let mut bugs = all_bugs(bugs_bin)?;
    if let Some(only) = &o.only {
        for name in only {
            if !bugs.iter().any(|(b, _)| b == name) {
                bail!(
                    "unknown bug {name:?}; known: {}",
                    bugs.iter()
                        .map(|(b, _)| b.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
        }
        bugs.retain(|(b, _)| only.contains(b));
    }
    Ok(bugs)
}

/// Every deliberate bug, in the order the controls run them.
fn all_bugs(bugs_bin: &Path) -> anyhow::Result<Vec<(String, &'static str)>> {
    let mut bugs: Vec<(String, &str)> = gateway_bugs(bugs_bin)?
        .into_iter()
        .map(|b| (b, "gateway"))
        .collect();
    for b in harness::client::bugs::ALL {
        let side = if *b == harness::client::bugs::FSYNC_OFF {
            "harness"
        } else {
            "client"
        };
        bugs.push((b.to_string(), side));
    }
    Ok(bugs)
}

/// The anomalies the checker found in a run of the suite.
fn anomalies_of(run: &RunResult) -> u64 {
    run.records
        .values()
        .chain(run.protocol.values())
        // 06-failover-u2-async's anomalies are its measurement (the U2 risk), not a verdict.
        .filter(|v| v.pointer("/observed/checker_anomalies_measured").is_none())
        .filter_map(|v| {
            v.pointer("/checker/anomalies_total")
                .or(v.pointer("/anomalies"))
                .map(|a| {
                    a.as_u64()
                        .unwrap_or_else(|| a.as_array().map_or(0, |x| x.len() as u64))
                })
        })
        .sum()
}

/// What an earlier run recorded of one bug: the tests that caught it in its last
/// whole-suite run (with their durations and that run's commit), and the nemesis seed
/// that caught it.
#[derive(Debug, Clone, Default)]
struct Recorded {
    /// (test, duration ms) of every test that failed in the whole-suite run.
    catchers: Vec<(String, u64)>,
    /// The commit of that whole-suite run.
    catchers_commit: Option<String>,
    nemesis_seed: Option<u64>,
}

/// Each bug's record in an earlier result file: `whole_run_catchers` where a run of this
/// version wrote it, else (a file of an earlier version) the entry's `caught_by`, whose
/// run 1 was always the whole suite.
fn recorded(file: &Path) -> BTreeMap<String, Recorded> {
    let Some(doc) = std::fs::read(file)
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
    else {
        return BTreeMap::new();
    };
    let mut out = BTreeMap::new();
    for c in doc["controls"].as_array().into_iter().flatten() {
        let Some(bug) = c["bug"].as_str() else {
            continue;
        };
        let (tests, commit) = match c.get("whole_run_catchers") {
            Some(w) if w.is_object() => (&w["tests"], w["git_commit"].clone()),
            _ => (&c["caught_by"], c["git_commit"].clone()),
        };
        let catchers = tests
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| {
                Some((
                    t["test"].as_str()?.to_string(),
                    t["duration_ms"].as_u64().unwrap_or(u64::MAX),
                ))
            })
            .collect();
        out.insert(
            bug.to_string(),
            Recorded {
                catchers,
                catchers_commit: commit.as_str().map(str::to_string),
                nemesis_seed: c["nemesis"]["first_catching_seed"].as_u64(),
            },
        );
    }
    out
}

/// The tests to run a bug against: its designed catchers among `catchers` (the quickest
/// first, [`RERUN_TESTS_MAX`] at most), or when none of them caught it, the quickest
/// catcher alone.
fn pick(catchers: &[(String, u64)], designed: &[&str]) -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = catchers.to_vec();
    v.sort_by_key(|(t, d)| (!designed.contains(&t.as_str()), *d));
    v.dedup_by(|a, b| a.0 == b.0);
    let designed_n = v
        .iter()
        .filter(|(t, _)| designed.contains(&t.as_str()))
        .count();
    v.truncate(designed_n.clamp(1, RERUN_TESTS_MAX));
    v
}

/// A catcher's duration as the evidence states it: `None` (null) for one no run measured
/// (recorded by an older runner), which [`pick`] sorts last as `u64::MAX`.
fn known_ms(ms: u64) -> Option<u64> {
    (ms != u64::MAX).then_some(ms)
}

/// A nextest filter naming exactly these tests.
fn filter_of<'a>(tests: impl IntoIterator<Item = &'a String>) -> String {
    tests
        .into_iter()
        .map(|t| format!("test(={t})"))
        .collect::<Vec<_>>()
        .join(" | ")
}

/// One deliberate bug (issue 41: targeted). With catchers recorded by an earlier
/// whole-suite run, `runs` runs of just those ([`pick`]) against the bug; only when none of
/// them catches it in any run (or nothing is recorded, or `--whole`), the whole suite once,
/// which records the catchers anew, then `runs - 1` runs of the picked ones. Then the
/// nemesis. Returns its entry of `controls[]`; the clean side of its tests is run once for
/// all bugs, beside the bugs' runs, in `main`.
fn control(
    o: &Opts,
    bug: &str,
    side: &str,
    bugs_bin: &Path,
    rec: Option<&Recorded>,
) -> anyhow::Result<Value> {
    let env = bug_env(bug, side, bugs_bin);
    let designed = designed_catcher(bug);
    let head = git(&["rev-parse", "HEAD"]);
    // The whole-suite catchers this entry rests on: recorded, or found below.
    let recorded = match rec.filter(|_| !o.whole) {
        Some(r) => (r.catchers.clone(), r.catchers_commit.clone()),
        None => (Vec::new(), None),
    };
    let (
        Runs {
            mode,
            caught_by,
            per_run_failed,
            run_walls,
            whole: (whole, whole_commit),
            selected,
        },
        targeted_missed,
    ) = bug_runs(o, bug, side, &env, designed, head.clone(), recorded)?;
    let runs = per_run_failed.len() as u32;
    let caught_runs = per_run_failed.iter().filter(|f| !f.is_empty()).count() as u32;
    // How often each picked test caught it (a racy catcher shows as k/N).
    let per_test = caught_runs_per_test(&selected, &per_run_failed);
    let caught = caught_runs == runs && caught_runs > 0;
    let first_detection_ms = caught_by
        .iter()
        .filter_map(|c| c["duration_ms"].as_u64())
        .min();
    eprintln!("  {bug}: caught in {caught_runs}/{runs} runs ({mode})");
    let kinds = anomaly_kinds(&caught_by);
    Ok(json!({
        "bug": bug,
        "git_commit": head,
        "side": side,
        "mode": mode,
        "result": if caught { "CAUGHT" } else if caught_runs > 0 { "FLAKY" } else { "MISSED" },
        "runs": runs,
        "caught_runs": caught_runs,
        "caught_rate": if runs == 0 { 0.0 } else { f64::from(caught_runs) / f64::from(runs) },
        "anomaly_kinds": kinds,
        "caught_by": caught_by,
        "rerun_tests": selected.iter().map(|(t, _)| t).collect::<Vec<_>>(),
        "designed_catchers": designed,
        "caught_runs_per_test": per_test,
        "failed_per_run": per_run_failed,
        "first_detection_ms": first_detection_ms,
        "run_wall_ms": run_walls,
        "whole_run_catchers": {
            "git_commit": whole_commit,
            "tests": whole.iter().map(|(t, d)| json!({"test": t, "duration_ms": known_ms(*d)})).collect::<Vec<_>>(),
        },
        "targeted_missed": targeted_missed,
        "known_limit": known_limit(bug),
        "nemesis": Value::Null,
    }))
}

/// The bug's runs: its recorded catchers when they still catch it ([`targeted_runs`]),
/// else the whole suite and the runs left ([`whole_suite_runs`]); with what the targeted
/// miss was, for the record.
fn bug_runs(
    o: &Opts,
    bug: &str,
    side: &str,
    env: &[(&str, String)],
    designed: &[&str],
    head: Option<String>,
    recorded: (Vec<(String, u64)>, Option<String>),
) -> anyhow::Result<(Runs, Value)> {
    let (targeted, targeted_missed) = targeted_runs(o, bug, side, env, &recorded);
    let runs = match targeted {
        Some(r) => {
            let selected = pick(&recorded.0, designed);
            Runs {
                mode: "targeted",
                caught_by: r.first().failed.iter().map(|t| how_caught(&r, t)).collect(),
                per_run_failed: r.iterations.iter().map(|it| it.failed.clone()).collect(),
                run_walls: vec![r.wall_ms],
                whole: recorded,
                selected,
            }
        }
        None => whole_suite_runs(o, bug, side, env, head)?,
    };
    Ok((runs, targeted_missed))
}

/// How many of the runs each picked test caught the bug in.
fn caught_runs_per_test<'a>(
    selected: &'a [(String, u64)],
    per_run_failed: &[Vec<String>],
) -> BTreeMap<&'a str, u32> {
    selected
        .iter()
        .map(|(t, _)| {
            let k = per_run_failed
                .iter()
                .filter(|f| f.iter().any(|x| x == t))
                .count() as u32;
            (t.as_str(), k)
        })
        .collect()
}

/// The anomaly kinds the catching tests saw, sorted, each once.
fn anomaly_kinds(caught_by: &[Value]) -> Vec<String> {
    let mut kinds: Vec<String> = caught_by
        .iter()
        .flat_map(|c| c["anomaly_kinds"].as_array().cloned().unwrap_or_default())
        .filter_map(|k| k.as_str().map(str::to_string))
        .collect();
    kinds.sort();
    kinds.dedup();
    kinds
}

/// What a bug's runs observed.
struct Runs {
    /// `targeted` (its recorded catchers) or `whole-suite`.
    mode: &'static str,
    /// How each test that failed in the first run caught it.
    caught_by: Vec<Value>,
    per_run_failed: Vec<Vec<String>>,
    run_walls: Vec<u64>,
    /// The whole-suite catchers and the commit that found them.
    whole: (Vec<(String, u64)>, Option<String>),
    /// The catchers re-run in every run.
    selected: Vec<(String, u64)>,
}

/// The bug's `o.runs` runs of its recorded catchers (`recorded`: the whole-suite catchers
/// and their commit), when it has any and they still catch it; otherwise what the miss
/// was, for the record (the bug then falls back to the whole suite).
fn targeted_runs(
    o: &Opts,
    bug: &str,
    side: &str,
    env: &[(&str, String)],
    recorded: &(Vec<(String, u64)>, Option<String>),
) -> (Option<RunResult>, Value) {
    let selected = pick(&recorded.0, designed_catcher(bug));
    if selected.is_empty() {
        return (None, Value::Null);
    }
    eprintln!(
        "controls: {bug} ({side}): {} runs of its {} recorded catcher(s)",
        o.runs,
        selected.len()
    );
    // A recorded catcher renamed or removed since matches no test: nextest runs nothing,
    // which is an error here, and the bug falls back to the whole suite like a miss.
    let r = run_suite(
        &filter_of(selected.iter().map(|(t, _)| t)),
        env,
        &format!("{bug}-targeted"),
        o.runs,
    );
    match r {
        Ok(r) if r.iterations.iter().any(|it| !it.failed.is_empty()) => (Some(r), Value::Null),
        r => {
            eprintln!("  {bug}: its recorded catchers no longer catch it: the whole suite");
            let missed = json!({
                "tests": selected.iter().map(|(t, _)| t).collect::<Vec<_>>(),
                "recorded_at": recorded.1,
                "runs": o.runs,
                "wall_ms": r.as_ref().map(|r| r.wall_ms).ok(),
                "error": r.as_ref().err().map(|e| format!("{e:#}")),
            });
            (None, missed)
        }
    }
}

/// The bug against the whole suite once (its catchers found there, at `head`), then the
/// runs left against those catchers.
fn whole_suite_runs(
    o: &Opts,
    bug: &str,
    side: &str,
    env: &[(&str, String)],
    head: Option<String>,
) -> anyhow::Result<Runs> {
    eprintln!("controls: {bug} ({side}), run 1 of {}: whole suite", o.runs);
    let first = run_suite(SUITE, env, &format!("{bug}-1"), 1)?;
    let caught_by = first
        .first()
        .failed
        .iter()
        .map(|t| how_caught(&first, t))
        .collect();
    let whole: Vec<(String, u64)> = first
        .first()
        .failed
        .iter()
        .map(|t| {
            (
                t.clone(),
                first.duration_ms.get(t).copied().unwrap_or(u64::MAX),
            )
        })
        .collect();
    let selected = pick(&whole, designed_catcher(bug));
    let mut per_run_failed = vec![first.first().failed.clone()];
    let mut run_walls = vec![first.wall_ms];
    if !selected.is_empty() && o.runs > 1 {
        let r = run_suite(
            &filter_of(selected.iter().map(|(t, _)| t)),
            env,
            &format!("{bug}-rest"),
            o.runs - 1,
        )?;
        per_run_failed.extend(r.iterations.iter().map(|it| it.failed.clone()));
        run_walls.push(r.wall_ms);
    }
    Ok(Runs {
        mode: "whole-suite",
        caught_by,
        per_run_failed,
        run_walls,
        whole: (whole, head),
        selected,
    })
}

/// The bug's environment: `IM_BUG`, and the bugs binary for a gateway bug.
fn bug_env(bug: &str, side: &str, bugs_bin: &Path) -> Vec<(&'static str, String)> {
    let mut env = vec![("IM_BUG", bug.to_string())];
    if side == "gateway" {
        env.push(("IM_GATEWAY_BIN", bugs_bin.display().to_string()));
    }
    env
}

/// The suite part of every bug, `places` bugs at a time (each its own nextest, one
/// scenario at a time: the cores are far from full), the results in the order of `bugs`.
/// A queue, not batches: each bug starts as soon as a place is free, the longest first
/// (`expected_s`, the last run's times; unknown ones first of all), so one slow bug does
/// not hold back the places beside it (in batches of 4, at 1ee376c, this part took about
/// 12 minutes, and its 28 bugs' run times add up to 23.5).
fn suite_controls(
    o: &Opts,
    places: u32,
    bugs: &[(String, &str)],
    bugs_bin: &Path,
    record: &BTreeMap<String, Recorded>,
    expected_s: &[f64],
    eta: &mut Eta,
) -> anyhow::Result<Vec<Value>> {
    let mut order: Vec<usize> = (0..bugs.len()).collect();
    let key = |i: &usize| {
        let t = expected_s.get(*i).copied().unwrap_or(0.0);
        if t > 0.0 {
            t
        } else {
            f64::INFINITY
        }
    };
    order.sort_by(|a, b| key(b).total_cmp(&key(a)));
    let eta = std::sync::Mutex::new(eta);
    let mut results: Vec<(usize, anyhow::Result<Value>)> =
        scenarios::each_in_places(&order, places as usize, |_, &i| {
            let (bug, side) = &bugs[i];
            {
                let mut e = eta.lock().unwrap_or_else(|p| p.into_inner());
                e.next_part();
                eprintln!("controls: {bug}: {}", e.line());
            }
            (i, control(o, bug, side, bugs_bin, record.get(bug)))
        });
    // Back in the bugs' order.
    results.sort_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, r)| r).collect()
}

/// The nemesis part of every bug ([`nemesis_part`]), with the seeds the record says
/// catch them, into each bug's entry.
fn nemesis_controls(
    o: &Opts,
    bugs: &[(String, &str)],
    bugs_bin: &Path,
    record: &BTreeMap<String, Recorded>,
    controls: &mut [Value],
    eta: &mut Eta,
) -> anyhow::Result<()> {
    if o.nemesis_seeds == 0 {
        return Ok(());
    }
    eta.next_part();
    eprintln!(
        "controls: {} bugs under the nemesis, up to {} seeds each ({})",
        bugs.len(),
        o.nemesis_seeds,
        eta.line()
    );
    let seed_of = |bug: &str| record.get(bug).and_then(|r| r.nemesis_seed);
    for (entry, n) in controls
        .iter_mut()
        .zip(nemesis_part(o, bugs, bugs_bin, &seed_of))
    {
        entry["nemesis"] = n?;
    }
    Ok(())
}

/// Every bug's nemesis part, in `bugs`' order, [`NEMESIS_JOBS`] seeds at once throughout:
/// 1. each bug's recorded catching seed (`seed_of`, within `--nemesis-seeds`), one run per
///    bug: 19 bugs caught by their recorded seed cost three waves, not 19 seeds one after
///    the other (about 380 s of the 1,808 s of the controls at 1b066a6);
/// 2. for every bug no recorded seed caught, seeds 1..=`--nemesis-seeds` as one queue,
///    seed by seed across the bugs, no more of a bug's seeds started once one caught it:
///    the seven places stay full from one bug's series to the next, where a series of its
///    own ended in a tail of one or two seeds (59 to 80 s for 20 seeds at 1b066a6, about
///    56 at the clean series' pace).
fn nemesis_part(
    o: &Opts,
    bugs: &[(String, &str)],
    bugs_bin: &Path,
    seed_of: &(dyn Fn(&str) -> Option<u64> + Sync),
) -> Vec<anyhow::Result<Value>> {
    let (seeds, gateways) = (o.nemesis_seeds, o.nemesis_gateways);
    let recorded = |i: usize| seed_of(&bugs[i].0).filter(|s| (1..=seeds).contains(s));
    let mut out: Vec<Option<anyhow::Result<Value>>> = (0..bugs.len()).map(|_| None).collect();
    for (i, (bug, _)) in bugs.iter().enumerate() {
        if let Err(e) = fresh_dir(&nemesis_dir(bug)) {
            out[i] = Some(Err(e));
        }
    }
    let tries: Vec<(usize, u64)> = (0..bugs.len())
        .filter(|&i| out[i].is_none())
        .filter_map(|i| Some((i, recorded(i)?)))
        .collect();
    let run = |i: usize, seed: u64| {
        let (bug, side) = &bugs[i];
        nemesis_run(bug, &bug_env(bug, side, bugs_bin), seed, gateways)
    };
    for (i, run) in runs_at_once(bugs.len(), NEMESIS_JOBS, &tries, run) {
        let seed = tries.iter().find(|t| t.0 == i).map(|t| t.1);
        out[i] = match run {
            Ok(r) if r.caught => {
                let mut n = nemesis_entry(std::slice::from_ref(&r), r.seed, r.seed, gateways);
                n["recorded_seed"] = json!(seed);
                Some(Ok(n))
            }
            Ok(_) => {
                eprintln!(
                    "  {}: recorded nemesis seed {} no longer catches it: seeds 1..={seeds}",
                    bugs[i].0,
                    seed.unwrap_or(0)
                );
                None
            }
            Err(e) => Some(Err(e)),
        };
    }
    let left: Vec<usize> = (0..bugs.len()).filter(|&i| out[i].is_none()).collect();
    let queue: Vec<(usize, u64)> = (1..=seeds)
        .flat_map(|s| left.iter().map(move |&i| (i, s)))
        .collect();
    let mut runs: BTreeMap<usize, anyhow::Result<Vec<SeedRun>>> =
        left.iter().map(|&i| (i, Ok(Vec::new()))).collect();
    for (i, run) in runs_at_once(bugs.len(), NEMESIS_JOBS, &queue, run) {
        let slot = runs.get_mut(&i).expect("a bug of the queue");
        match (slot.as_mut(), run) {
            (Ok(v), Ok(r)) => v.push(r),
            (Ok(_), Err(e)) => *slot = Err(e),
            (Err(_), _) => {}
        }
    }
    for (i, r) in runs {
        let (bug, recorded) = (&bugs[i].0, seed_of(&bugs[i].0));
        out[i] = Some(r.map(|v| series_entry(bug, &v, recorded, seeds, gateways)));
    }
    out.into_iter()
        .map(|n| n.unwrap_or_else(|| Err(anyhow::anyhow!("no nemesis run"))))
        .collect()
}

/// `bug`'s `nemesis` entry from its runs of seeds 1..=`seeds` (`runs`), with the seed the
/// record named (`recorded`) and, when missed, what the nemesis would need.
fn series_entry(
    bug: &str,
    runs: &[SeedRun],
    recorded: Option<u64>,
    seeds: u64,
    gateways: u32,
) -> Value {
    let mut n = nemesis_entry(runs, 1, seeds, gateways);
    if let Some(seed) = recorded {
        n["recorded_seed"] = json!(seed);
    }
    if n["result"] == "MISSED" {
        n["would_need"] = json!(nemesis_would_need(bug));
    }
    eprintln!(
        "  {bug}: nemesis {} after {} seed(s)",
        n["result"], n["seeds_run"]
    );
    n
}

/// `run(bug index, seed)` for each of `queue`, in its order, `places` at once; a bug's run
/// is not started once one of its runs caught it (or failed to run). The runs done, in
/// the order they were started.
fn runs_at_once(
    bugs: usize,
    places: usize,
    queue: &[(usize, u64)],
    run: impl Fn(usize, u64) -> anyhow::Result<SeedRun> + Sync,
) -> Vec<(usize, anyhow::Result<SeedRun>)> {
    use std::sync::atomic::{AtomicBool, Ordering};
    let done: Vec<AtomicBool> = (0..bugs).map(|_| AtomicBool::new(false)).collect();
    scenarios::each_in_places(queue, places, |_, &(i, seed)| {
        if done[i].load(Ordering::SeqCst) {
            return None;
        }
        let r = run(i, seed);
        if r.as_ref().map_or(true, |r| r.caught) {
            done[i].store(true, Ordering::SeqCst);
        }
        Some((i, r))
    })
    .into_iter()
    .flatten()
    .collect()
}

/// `--merge`: the existing file's entries with this run's in place of those it measured
/// (`controls` holds this run's and becomes the merged list); returns the partial runs so
/// far, this one appended.
fn merge_into(out: &Path, controls: &mut Vec<Value>, o: &Opts) -> anyhow::Result<Vec<Value>> {
    let old: Value = serde_json::from_slice(
        &std::fs::read(out).with_context(|| format!("read {} to merge", out.display()))?,
    )
    .context("parse the existing result to merge")?;
    let fresh: Vec<Value> = std::mem::take(controls);
    for c in old["controls"].as_array().into_iter().flatten() {
        match fresh.iter().find(|f| f["bug"] == c["bug"]) {
            Some(f) => controls.push(f.clone()),
            None => controls.push(c.clone()),
        }
    }
    for f in &fresh {
        if !controls.iter().any(|c| c["bug"] == f["bug"]) {
            controls.push(f.clone());
        }
    }
    let mut partial = old["environment"]["partial_runs"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    partial.push(json!({
        "bugs": o.only,
        "git_commit": git(&["rev-parse", "HEAD"]),
        "generated_at": scenarios::rfc3339_now(),
    }));
    Ok(partial)
}

/// Which bugs the scripted suite and the nemesis each caught, side by side.
fn nemesis_summary(controls: &[Value]) -> Value {
    let with: Vec<&Value> = controls
        .iter()
        .filter(|c| !c["nemesis"].is_null())
        .collect();
    let names = |f: &dyn Fn(&Value) -> bool| -> Vec<Value> {
        with.iter()
            .filter(|c| f(c))
            .map(|c| c["bug"].clone())
            .collect()
    };
    json!({
        "bugs_run": with.len(),
        "caught": names(&|c| c["nemesis"]["result"] == "CAUGHT").len(),
        "caught_only_by_nemesis": names(&|c| c["nemesis"]["result"] == "CAUGHT" && c["result"] != "CAUGHT"),
        "caught_only_by_scripted_checks": names(&|c| c["nemesis"]["result"] != "CAUGHT" && c["result"] == "CAUGHT"),
        "missed_by_both": names(&|c| c["nemesis"]["result"] != "CAUGHT" && c["result"] != "CAUGHT"),
    })
}

fn print_table(doc: &Value) {
    println!(
        "  {:<7} {:<20} {:<12} nemesis",
        "suite", "bug", "suite runs"
    );
    for c in doc["controls"].as_array().into_iter().flatten() {
        let n = &c["nemesis"];
        let nem = if n.is_null() {
            "-".to_string()
        } else {
            format!(
                "{} (seed {}, {} seeds run, {} gateway(s)) {}",
                n["result"].as_str().unwrap_or(""),
                n["first_catching_seed"],
                n["seeds_run"],
                n["gateways"].as_u64().unwrap_or(1),
                n["anomaly_kinds"]
            )
        };
        println!(
            "  {:<7} {:<20} {:<12} {nem}",
            c["result"].as_str().unwrap_or(""),
            c["bug"].as_str().unwrap_or(""),
            format!("{}/{}", c["caught_runs"], c["runs"]),
        );
    }
}

/// `--nemesis-only`: the nemesis part for the selected bugs, merged into the existing file
/// (its suite results stay as measured).
fn nemesis_only(
    o: &Opts,
    out: &Path,
    bugs: &[(String, &str)],
    bugs_bin: &Path,
    started: Instant,
) -> anyhow::Result<()> {
    if o.nemesis_seeds == 0 {
        bail!("--nemesis-only with --nemesis-seeds 0 would run nothing");
    }
    let mut doc: Value = serde_json::from_slice(
        &std::fs::read(out)
            .with_context(|| format!("read {} (run make controls first)", out.display()))?,
    )
    .context("parse the existing controls result")?;
    eprintln!(
        "controls: {} bugs under the nemesis, up to {} seeds each",
        bugs.len(),
        o.nemesis_seeds
    );
    for ((bug, _), n) in bugs.iter().zip(nemesis_part(o, bugs, bugs_bin, &|_| None)) {
        let mut n = n?;
        n["git_commit"] = json!(git(&["rev-parse", "HEAD"]));
        let entries = doc["controls"]
            .as_array_mut()
            .context("no controls in the file")?;
        match entries.iter_mut().find(|c| c["bug"] == json!(bug)) {
            Some(c) => c["nemesis"] = n,
            None => bail!(
                "{bug} has no entry in {}: run make controls ONLY={bug} MERGE=1 first",
                out.display()
            ),
        }
    }
    let controls = doc["controls"].as_array().cloned().unwrap_or_default();
    doc["summary"]["nemesis"] = nemesis_summary(&controls);
    let partial = &mut doc["environment"]["partial_runs"];
    if !partial.is_array() {
        *partial = json!([]);
    }
    if let Some(p) = partial.as_array_mut() {
        p.push(json!({
            "nemesis_only": true,
            "bugs": bugs.iter().map(|(b, _)| b).collect::<Vec<_>>(),
            "nemesis_seeds": o.nemesis_seeds,
            "nemesis_gateways": o.nemesis_gateways,
            "git_commit": git(&["rev-parse", "HEAD"]),
            "generated_at": scenarios::rfc3339_now(),
            "wall_ms": started.elapsed().as_millis() as u64,
        }));
    }
    publish(out, &doc)?;
    println!("\n{} ({} s)", out.display(), started.elapsed().as_secs());
    print_table(&doc);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seed_run(seed: u64, caught: bool) -> SeedRun {
        let now = Instant::now();
        SeedRun {
            seed,
            caught,
            not_judged: false,
            anomalies: if caught {
                json!({"lost": 1})
            } else {
                Value::Null
            },
            repeat: Value::Null,
            started: now,
            ended: now,
        }
    }

    /// The nemesis queue starts no more seeds of a bug once one caught it (or did not
    /// run), goes on with the others, and the entry names the lowest catching seed.
    #[test]
    fn the_nemesis_queue_stops_a_bug_at_its_catch_and_goes_on_with_the_others() {
        let queue: Vec<(usize, u64)> = (1..=5).flat_map(|s| [(0, s), (1, s), (2, s)]).collect();
        let runs = runs_at_once(3, 1, &queue, |i, seed| match (i, seed) {
            (0, 2) => Ok(seed_run(seed, true)),
            (2, 3) => Err(anyhow::anyhow!("no summary")),
            _ => Ok(seed_run(seed, false)),
        });
        let seeds = |bug: usize| -> Vec<u64> {
            runs.iter()
                .filter(|(i, _)| *i == bug)
                .map(|(_, r)| r.as_ref().map_or(0, |r| r.seed))
                .collect()
        };
        assert_eq!(seeds(0), vec![1, 2]);
        assert_eq!(seeds(1), vec![1, 2, 3, 4, 5]);
        assert_eq!(seeds(2), vec![1, 2, 0]);
        let mine: Vec<SeedRun> = [3, 1, 2].into_iter().map(|s| seed_run(s, s >= 2)).collect();
        let n = nemesis_entry(&mine, 1, 20, 3);
        assert_eq!(n["result"], "CAUGHT");
        assert_eq!(n["first_catching_seed"], 2);
        assert_eq!(n["seeds_run"], 3);
        assert_eq!(n["anomaly_kinds"], json!({"lost": 1}));
        let missed = nemesis_entry(&[seed_run(1, false)], 1, 20, 3);
        assert_eq!(missed["result"], "MISSED");
        assert_eq!(missed["first_catching_seed"], Value::Null);
    }

    /// nextest's status lines, with and without `--stress-count`'s iteration.
    #[test]
    fn status_lines_name_status_iteration_and_test() {
        let one = "        PASS [   2.635s] (12/340) scenarios::im06 im06_commit_held_open";
        assert_eq!(
            status_line(one),
            Some(("PASS", 1, 2.635, "im06_commit_held_open".to_string()))
        );
        let stress = "        FAIL [   0.620s] [33/40] (1/1) harness client::tests::two_syncs";
        assert_eq!(
            status_line(stress),
            Some(("FAIL", 33, 0.62, "client::tests::two_syncs".to_string()))
        );
        assert_eq!(status_line("   SLOW [> 30.000s] scenarios::im06 x"), None);
        assert_eq!(status_line("  TRY 2 FAIL [ 1.0s] (1/2) b t"), None);
    }

    /// Round-robin shards (item i in shard i % n) joined give the list back in order;
    /// a shard short of an item is refused.
    #[test]
    fn shards_interleave_back_into_the_whole_list() {
        let all: Vec<u32> = (0..27).collect();
        for n in 1..=5 {
            let shards: Vec<Vec<u32>> = (0..n)
                .map(|k| {
                    all.iter()
                        .copied()
                        .filter(|i| *i as usize % n == k)
                        .collect()
                })
                .collect();
            assert_eq!(interleave(&shards).unwrap(), all, "n = {n}");
        }
        assert!(interleave(&[vec![0, 2], vec![]]).is_err());
    }

    /// Issue 42: a statement of what the nemesis would need is only for a deliberate
    /// gateway bug that exists, and names what is missing.
    #[test]
    fn would_need_names_only_bugs_that_exist() {
        let names: Vec<&str> = im_gateway::bugs::Bug::ALL
            .iter()
            .map(|b| b.name())
            .collect();
        let stated: Vec<&str> = names
            .iter()
            .copied()
            .filter(|b| nemesis_would_need(b).is_some())
            .collect();
        assert!(stated.len() >= 9, "{stated:?}");
        for b in &stated {
            assert!(nemesis_would_need(b).unwrap().len() > 80, "{b}");
        }
        for b in ["no-such-bug", "cursor-overwrite", "no-dedup"] {
            assert_eq!(nemesis_would_need(b), None, "{b}");
        }
    }

    #[test]
    fn two_clean_sides_merge_into_one_that_keeps_every_failure() {
        let empty = empty_clean();
        let early = json!({"tests": ["a", "b"], "runs": 10, "failed": {"b": 1},
            "anomalies": 2, "wall_ms": 100});
        let late = json!({"tests": ["b", "c"], "runs": 10, "failed": {"b": 2, "c": 1},
            "anomalies": 0, "wall_ms": 50});
        assert_eq!(summed_clean(&[&early, &empty]), early);
        assert_eq!(summed_clean(&[&empty, &late]), late);
        let m = summed_clean(&[&early, &late]);
        assert_eq!(m["tests"], json!(["a", "b", "c"]));
        assert_eq!(m["failed"], json!({"b": 3, "c": 1}));
        assert_eq!(
            (m["anomalies"].as_u64(), m["wall_ms"].as_u64()),
            (Some(2), Some(150))
        );
    }

    /// The picked tests: the designed catchers that caught it (at most RERUN_TESTS_MAX),
    /// else the quickest catcher alone; each once.
    #[test]
    fn pick_prefers_designed_else_the_quickest() {
        let caught = vec![
            ("slow".to_string(), 9000),
            ("designed".to_string(), 20000),
            ("quick".to_string(), 100),
            ("mid".to_string(), 500),
            ("quick".to_string(), 100),
        ];
        let names = |v: Vec<(String, u64)>| v.into_iter().map(|(t, _)| t).collect::<Vec<_>>();
        assert_eq!(names(pick(&caught, &["designed"])), vec!["designed"]);
        assert_eq!(
            names(pick(&caught, &["designed", "mid", "slow"])),
            vec!["mid"]
        );
        assert_eq!(names(pick(&caught, &["absent"])), vec!["quick"]);
        assert!(pick(&[], &["designed"]).is_empty());
        // A duration no run measured is written as null, never as u64::MAX.
        assert_eq!(known_ms(u64::MAX), None);
        assert_eq!(known_ms(2098), Some(2098));
    }
}
