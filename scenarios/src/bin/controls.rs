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
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// Tests re-run in runs 2..N of a caught bug: the checks built to catch it (when they
/// caught it in run 1), then the quickest other catchers, this many in all.
const RERUN_TESTS_MAX: usize = 3;
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

/// The check built to catch each bug every time (not by winning a race): it is re-run in
/// runs 2..N whenever it caught the bug in run 1, so "caught in every run" measures it.
fn designed_catcher(bug: &str) -> &'static [&'static str] {
    match bug {
        "reply-before-commit" | "commit-after-reply" | "push-before-commit" => {
            &["im06_commit_held_open"]
        }
        "no-dedup" => &["im06_crash_api_after_send_commit", "im06_lost_reply_retry"],
        "cursor-overwrite" => &["im06_ack_monotonic_and_bounded"],
        "no-sweep" | "cursor-on-sync" => &["im06_lost_push_swept"],
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
        "no-epoch" => {
            &["an_async_failover_that_lost_held_messages_leaves_no_device_silently_wrong"]
        }
        "no-incarnation" => {
            &["a_crash_that_lost_unflushed_commits_leaves_no_device_silently_wrong"]
        }
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
}

/// One bug under the nemesis: seeds 1..=`seeds`, stopping at the first one that catches it.
fn nemesis_control(
    bug: &str,
    env: &[(&str, String)],
    seeds: u64,
    gateways: u32,
) -> anyhow::Result<Value> {
    let dir = target_dir()
        .join("imfault-controls")
        .join(format!("{bug}-nemesis"));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("clear {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir)?;
    let summary = dir.join("summary.json");
    let started = Instant::now();
    let mut cmd = Command::new(target_dir().join("debug/nemesis"));
    cmd.args([
        "--first-seed",
        "1",
        "--seeds",
        &seeds.to_string(),
        "--stop-at-first-failure",
        // As `make nemesis` runs them: 4 seeds at once (clean series at this concurrency
        // are in evidence/nemesis), so a bug no fault exposes costs 20 seeds / 4.
        "--jobs",
        "4",
        "--gateways",
        &gateways.to_string(),
    ])
    .arg("--out")
    .arg(&dir)
    .arg("--summary")
    .arg(&summary)
    .env("RUST_BACKTRACE", "0")
    .env_remove("IM_BUG")
    .env_remove("IM_GATEWAY_BIN")
    .current_dir(workspace());
    for (k, v) in env {
        cmd.env(k, v);
    }
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
    let runs = s["per_run"].as_array().cloned().unwrap_or_default();
    // The lowest failing seed (runs are listed in the order they finished).
    let catching = runs
        .iter()
        .filter(|r| r["verdict"] == Verdict::Fail)
        .min_by_key(|r| r["seed"].as_u64());
    let errors = runs
        .iter()
        .filter(|r| r["verdict"] == Verdict::Error)
        .count();
    Ok(json!({
        "result": if catching.is_some() { "CAUGHT" } else { "MISSED" },
        "seeds_run": runs.len(),
        "seeds_max": seeds,
        "gateways": gateways,
        "first_catching_seed": catching.map(|r| r["seed"].clone()),
        "anomaly_kinds": catching.map(|r| r["anomalies"].clone()),
        "repeat": catching.map(|r| r["repeat"].clone()),
        "runs_not_judged": errors,
        "wall_ms": started.elapsed().as_millis() as u64,
    }))
}

fn parse_args() -> Opts {
    let mut o: Opts = clap::Parser::parse();
    if let Some(only) = o.only.as_mut() {
        only.iter_mut().for_each(|s| *s = s.trim().to_string());
    }
    o
}

/// One nextest run: which tests passed and failed, and what the tests wrote.
struct RunResult {
    passed: Vec<String>,
    failed: Vec<String>,
    /// im-06 records by id.
    records: BTreeMap<String, Value>,
    /// Protocol tests' checker verdicts by test name.
    protocol: BTreeMap<String, Value>,
    wall_ms: u64,
}

fn run_suite(filter: &str, env: &[(&str, String)], label: &str) -> anyhow::Result<RunResult> {
    let dir = target_dir().join("imfault-controls").join(label);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("clear {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir)?;
    let started = Instant::now();
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
    ])
    .env("IMFAULT_EVIDENCE_DIR", &dir)
    .env("RUST_BACKTRACE", "0")
    // Failures are expected here, by the hundred: don't keep their clusters.
    .env("IMFAULT_KEEP_FAILED", "0")
    .env_remove("IM_BUG")
    .env_remove("IM_GATEWAY_BIN")
    .current_dir(workspace());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().context("run cargo nextest")?;
    let log = String::from_utf8_lossy(&out.stderr).to_string();
    std::fs::write(dir.join("nextest.log"), &log)?;
    let (mut passed, mut failed) = (Vec::new(), Vec::new());
    for line in log.lines() {
        let t = line.trim_start();
        let status = t.split_whitespace().next().unwrap_or("");
        if !t.contains('[') || !t.contains(']') {
            continue;
        }
        let name = t.rsplit(' ').next().unwrap_or("").to_string();
        match status {
            "PASS" => passed.push(name),
            "FAIL" | "TIMEOUT" | "SIGKILL" | "SIGABRT" | "SIGSEGV" | "ABORT" => failed.push(name),
            _ => {}
        }
    }
    if passed.is_empty() && failed.is_empty() {
        bail!(
            "nextest ran no test ({}); log: {}",
            out.status,
            dir.join("nextest.log").display()
        );
    }
    let mut records = BTreeMap::new();
    let mut protocol = BTreeMap::new();
    for (sub, map) in [("", &mut records), ("protocol", &mut protocol)] {
        let d = dir.join(sub);
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
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
    }
    Ok(RunResult {
        passed,
        failed,
        records,
        protocol,
        wall_ms: started.elapsed().as_millis() as u64,
    })
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
    let out = o
        .out
        .clone()
        .unwrap_or_else(|| workspace().join("evidence/controls/result.json"));
    let started = Instant::now();
    let bugs_bin = target_dir().join("debug/im-gateway-bugs");
    if !bugs_bin.is_file() {
        bail!(
            "{} not found: `make controls` builds it (cargo build -p im-gateway --features faults,bugs)",
            bugs_bin.display()
        );
    }
    let bugs = selected_bugs(&o, &bugs_bin)?;
    if o.nemesis_only {
        return nemesis_only(&o, &out, &bugs, &bugs_bin, started);
    }
    let mut eta = Eta::new(expected_times(&out, &bugs));
    eta.next_part();
    eprintln!("controls: the clean gateway, whole suite ({})", eta.line());
    let clean = run_suite(SUITE, &[], "clean")?;
    let clean_anomalies = anomalies_of(&clean);
    eprintln!(
        "  clean: {} passed, {} failed, {} anomalies ({} s)",
        clean.passed.len(),
        clean.failed.len(),
        clean_anomalies,
        clean.wall_ms / 1000
    );
    let mut controls = Vec::new();
    for (bug, side) in &bugs {
        eta.next_part();
        eprintln!("controls: {bug}: {}", eta.line());
        controls.push(control(&o, bug, side, &bugs_bin)?);
    }
    // --merge: keep the other bugs' entries of the existing file, as they were measured.
    let partial = if o.merge {
        merge_into(&out, &mut controls, &o)?
    } else {
        Vec::new()
    };
    let count = |r: &str| controls.iter().filter(|c| c["result"] == r).count();
    let nemesis_summary = nemesis_summary(&controls);
    let doc = json!({
        "schema_version": SCHEMA_VERSION,
        "generated_by": "make controls (scenarios/src/bin/controls.rs)",
        "environment": {
            "git_commit": git(&["rev-parse", "HEAD"]),
            "git_dirty": git(&["status", "--porcelain", "--", ".", ":(exclude)evidence"]).map(|s| !s.is_empty()),
            "generated_at": scenarios::rfc3339_now(),
            "host_cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "suite": SUITE,
            "runs_per_bug": o.runs,
            "nemesis_gateways": o.nemesis_gateways,
            "rerun_tests_max": RERUN_TESTS_MAX,
            "bugs_binary": "target/debug/im-gateway-bugs (--features faults,bugs)",
            "partial_runs": partial,
        },
        "clean": {
            "passed": clean.passed.len(),
            "failed": clean.failed,
            "anomalies": clean_anomalies,
            "wall_ms": clean.wall_ms,
        },
        "summary": {
            "bugs": controls.len(),
            "caught": count("CAUGHT"),
            "flaky": count("FLAKY"),
            "missed": count("MISSED"),
            "wall_ms": started.elapsed().as_millis() as u64,
            "nemesis": nemesis_summary,
        },
        "controls": controls,
    });
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = out.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(&doc)? + "\n")?;
    std::fs::rename(&tmp, &out)?;
    println!("\n{} ({} s)", out.display(), started.elapsed().as_secs());
    println!(
        "  clean gateway: {} passed, {} failed, {} anomalies",
        clean.passed.len(),
        clean.failed.len(),
        clean_anomalies
    );
    print_table(&doc);
    if !clean.failed.is_empty() || clean_anomalies > 0 {
        eprintln!("the clean gateway failed or showed anomalies: the controls mean nothing");
        std::process::exit(1);
    }
    Ok(())
}

/// Each part's expected seconds for the estimate of time left: the clean suite, then each
/// bug, as the last run (the file about to be replaced) took them; 0 where unknown.
fn expected_times(out: &Path, bugs: &[(String, &str)]) -> Vec<f64> {
    let last: Value = std::fs::read(out)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null);
    let ms = |v: &Value| v.as_f64().unwrap_or(0.0) / 1000.0;
    let mut times = vec![ms(&last["clean"]["wall_ms"])];
    for (bug, _) in bugs {
        let c = last["controls"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["bug"] == bug.as_str()));
        times.push(c.map_or(0.0, |c| {
            let runs: f64 = c["run_wall_ms"]
                .as_array()
                .map_or(0.0, |w| w.iter().map(ms).sum());
            runs + ms(&c["nemesis"]["wall_ms"])
        }));
    }
    times
}

/// Every deliberate bug (the gateway's, as its binary lists them, then the client's and
/// the harness's) with its side, or those `--only` names (an unknown name is refused).
fn selected_bugs(o: &Opts, bugs_bin: &Path) -> anyhow::Result<Vec<(String, &'static str)>> {
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

/// One deliberate bug: the whole suite once, the tests that caught it (designed catchers
/// first, then the quickest) `runs - 1` times more, then the nemesis; its entry of
/// `controls[]`.
fn control(o: &Opts, bug: &str, side: &str, bugs_bin: &Path) -> anyhow::Result<Value> {
    let mut env = vec![("IM_BUG", bug.to_string())];
    if side == "gateway" {
        env.push(("IM_GATEWAY_BIN", bugs_bin.display().to_string()));
    }
    eprintln!("controls: {bug} ({side}), run 1 of {}: whole suite", o.runs);
    let first = run_suite(SUITE, &env, &format!("{bug}-1"))?;
    let caught_by: Vec<Value> = first.failed.iter().map(|t| how_caught(&first, t)).collect();
    let mut caught_runs = u32::from(!first.failed.is_empty());
    let mut run_walls = vec![first.wall_ms];
    let mut rerun_tests: Vec<(String, u64)> = caught_by
        .iter()
        .map(|c| {
            (
                c["test"].as_str().unwrap_or("").to_string(),
                c["duration_ms"].as_u64().unwrap_or(u64::MAX),
            )
        })
        .collect();
    // Designed catchers first, then the quickest.
    let designed = designed_catcher(bug);
    rerun_tests.sort_by_key(|(t, d)| (!designed.contains(&t.as_str()), *d));
    rerun_tests.truncate(RERUN_TESTS_MAX);
    let mut per_run_failed = vec![first.failed.clone()];
    if !rerun_tests.is_empty() {
        let filter = rerun_tests
            .iter()
            .map(|(t, _)| format!("test(={t})"))
            .collect::<Vec<_>>()
            .join(" | ");
        for run in 2..=o.runs {
            let r = run_suite(&filter, &env, &format!("{bug}-{run}"))?;
            if !r.failed.is_empty() {
                caught_runs += 1;
            }
            run_walls.push(r.wall_ms);
            per_run_failed.push(r.failed);
        }
    }
    let runs = if rerun_tests.is_empty() { 1 } else { o.runs };
    // How often each re-run test caught it (a racy catcher shows as k/N).
    let per_test: BTreeMap<&str, u32> = rerun_tests
        .iter()
        .map(|(t, _)| {
            let k = per_run_failed
                .iter()
                .filter(|f| f.iter().any(|x| x == t))
                .count() as u32;
            (t.as_str(), k)
        })
        .collect();
    let caught = caught_runs == runs && caught_runs > 0;
    let first_detection_ms = caught_by
        .iter()
        .filter_map(|c| c["duration_ms"].as_u64())
        .min();
    eprintln!(
        "  {bug}: caught in {caught_runs}/{runs} runs by {} test(s)",
        first.failed.len()
    );
    let nemesis = if o.nemesis_seeds > 0 {
        eprintln!(
            "controls: {bug} under the nemesis, up to {} seeds",
            o.nemesis_seeds
        );
        let n = nemesis_control(bug, &env, o.nemesis_seeds, o.nemesis_gateways)?;
        eprintln!(
            "  {bug}: nemesis {} after {} seed(s)",
            n["result"], n["seeds_run"]
        );
        n
    } else {
        Value::Null
    };
    let mut kinds: Vec<String> = caught_by
        .iter()
        .flat_map(|c| c["anomaly_kinds"].as_array().cloned().unwrap_or_default())
        .filter_map(|k| k.as_str().map(str::to_string))
        .collect();
    kinds.sort();
    kinds.dedup();
    Ok(json!({
        "bug": bug,
        "git_commit": git(&["rev-parse", "HEAD"]),
        "side": side,
        "result": if caught { "CAUGHT" } else if caught_runs > 0 { "FLAKY" } else { "MISSED" },
        "runs": runs,
        "caught_runs": caught_runs,
        "caught_rate": f64::from(caught_runs) / f64::from(runs),
        "anomaly_kinds": kinds,
        "caught_by": caught_by,
        "rerun_tests": rerun_tests.iter().map(|(t, _)| t).collect::<Vec<_>>(),
        "designed_catchers": designed,
        "caught_runs_per_test": per_test,
        "failed_per_run": per_run_failed,
        "first_detection_ms": first_detection_ms,
        "run_wall_ms": run_walls,
        "known_limit": known_limit(bug),
        "nemesis": nemesis,
    }))
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
    for (bug, side) in bugs {
        let mut env = vec![("IM_BUG", bug.clone())];
        if *side == "gateway" {
            env.push(("IM_GATEWAY_BIN", bugs_bin.display().to_string()));
        }
        eprintln!(
            "controls: {bug} under the nemesis, up to {} seeds",
            o.nemesis_seeds
        );
        let mut n = nemesis_control(bug, &env, o.nemesis_seeds, o.nemesis_gateways)?;
        n["git_commit"] = json!(git(&["rev-parse", "HEAD"]));
        eprintln!(
            "  {bug}: nemesis {} after {} seed(s)",
            n["result"], n["seeds_run"]
        );
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
    harness::util::write_atomic(out, (serde_json::to_string_pretty(&doc)? + "\n").as_bytes())?;
    println!("\n{} ({} s)", out.display(), started.elapsed().as_secs());
    print_table(&doc);
    Ok(())
}
