//! `make repro FAULT='point:action[:skip[:count]]'`: reproduces one failure by hand. Starts a
//! throwaway cluster and the gateway with that IM_FAULT, provisions alice (device a1) and bob
//! (device b1, subscribed) in conversation c1, sends one message from a1 (bob acks what he
//! gets), and prints what happened as one JSON document: the reply, the gateway's exit
//! status, rows, cursors, the clients' outboxes and stats, the fault lines. If the gateway
//! died (or the send is still unanswered), a new client loaded from the state file replays
//! the outbox against a healthy gateway and that is in the document too. Then the history
//! checker and the database-wide checks judge the whole run, and the last line is the
//! verdict: which invariants held and which were broken.
//!
//! Exit status: 0 every invariant held, 1 one broke, 2 usage error, 3 the run could not be
//! made (no cluster, no gateway binary, ...). The work directory (cluster, gateway log,
//! history, client state files) is removed at the end unless `--keep` or `IMFAULT_KEEP=1`.

use anyhow::Context;
use clap::Parser;
use harness::client::{Client, ClientError};
use harness::gateway::GatewayOpts;
use harness::world::World;
use im_check::Report;
use serde_json::{json, Value};
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

const T: Duration = Duration::from_secs(3);

/// Every invariant of SPEC section 1, in verdict order.
const INVARIANTS: [&str; 8] = ["D1", "D2", "D3", "D4", "D5", "D6", "P1", "S1"];

/// Reproduce one failure: one send from a1 to b1 under IM_FAULT, judged by the checker.
#[derive(Parser, Debug)]
#[command(
    name = "repro",
    after_help = concat!(
        include_str!("harness_env.txt"),
        "
Output: one JSON document on stdout, then one line `verdict: HELD ...` or
`verdict: BROKEN ...; HELD ...` (with --keep, a line `kept: DIR` before it).
Exit status: 0 every invariant held, 1 one broke, 2 usage error, 3 the run could not be made.
Example: make repro FAULT='send.before_commit:halt'  (or: target/debug/repro --keep 'gw.push:drop')"
    )
)]
struct Args {
    /// The IM_FAULT of the gateway: point:action[:skip[:count]][,...] (`im-gateway faults`
    /// lists the points and actions).
    fault: String,
    /// Keep the work directory (cluster, gateway log, history, client state files) and
    /// print its path.
    #[arg(long)]
    keep: bool,
}

/// What `repro` prints, in reading order (a struct: a JSON map would sort its keys).
#[derive(serde::Serialize)]
struct Output {
    fault: String,
    /// a1's send under the fault: `{reply}` or `{reply: null, error}`.
    a1_send: Value,
    /// `{code, status}` when the gateway died, else `"still running"`.
    gateway_exit: Value,
    /// The gateway's `fault fired: …` lines (stderr).
    fault_lines: Vec<String>,
    events_rows_c1: i64,
    head_c1: i64,
    b1_delivered_seq: Option<i64>,
    a1_outbox: Value,
    b1_stats: Value,
    /// The outbox replayed by a client loaded from a1's state file, against a healthy
    /// gateway (when the gateway died or the send is unanswered), else null.
    replay: Value,
    /// The database-wide checks (P1, D4, S1): violations, empty when all hold.
    database_violations: Vec<String>,
    /// The history checker over the whole run.
    checker: Value,
    /// Paths of the kept work directory and its files (`--keep`), else null.
    kept: Value,
}

fn reply(r: &Result<Value, ClientError>) -> Value {
    match r {
        Ok(v) => json!({ "reply": v }),
        Err(ClientError::Server { frame, .. }) => json!({ "reply": frame }),
        Err(e) => json!({ "reply": null, "error": e.to_string() }),
    }
}

/// `verdict: HELD D1 …` or `verdict: BROKEN D2 (duplicated: 1); HELD D1 D3 …`, and whether
/// everything held. `violations` are the database-wide checks' lines, each `INV: …`.
fn verdict(report: &Report, violations: &[String]) -> (String, bool) {
    let mut broken: std::collections::BTreeMap<&str, Vec<String>> = Default::default();
    for (kind, n) in report.counts.iter().filter(|(_, n)| **n > 0) {
        for inv in kind.invariant().split('/') {
            broken
                .entry(inv)
                .or_default()
                .push(format!("{}: {n}", kind.as_str()));
        }
    }
    for v in violations {
        if let Some((inv, _)) = v.split_once(':') {
            if let Some(inv) = INVARIANTS.iter().find(|i| **i == inv) {
                broken.entry(inv).or_default().push("database check".into());
            }
        }
    }
    let held: Vec<&str> = INVARIANTS
        .iter()
        .copied()
        .filter(|i| !broken.contains_key(i))
        .collect();
    if broken.is_empty() {
        return (format!("verdict: HELD {}", held.join(" ")), true);
    }
    let b: Vec<String> = INVARIANTS
        .iter()
        .filter_map(|i| broken.get(i).map(|why| format!("{i} ({})", why.join(", "))))
        .collect();
    let mut line = format!("verdict: BROKEN {}", b.join(" "));
    if !held.is_empty() {
        line.push_str(&format!("; HELD {}", held.join(" ")));
    }
    (line, false)
}

/// Starts a throwaway cluster and the gateway with this IM_FAULT (a sweep every 500 ms,
/// database calls bounded at 2 s); `--keep` keeps the cluster's directory.
async fn start(fault: &str, keep: bool) -> anyhow::Result<World> {
    let mut w = World::start(GatewayOpts {
        fault: Some(fault.to_string()),
        sweep_ms: Some(500),
        db_timeout_ms: Some(2000),
        ..Default::default()
    })
    .await
    .context("start a cluster and the gateway with this IM_FAULT")?;
    if keep {
        w.pg.keep();
    }
    Ok(w)
}

/// The gateway's `fault fired: …` lines, from its log.
fn fault_lines(w: &World) -> Vec<String> {
    w.gw()
        .log_text()
        .lines()
        .filter(|l| l.starts_with("fault fired"))
        .map(str::to_string)
        .collect()
}

/// Crashes a1, restarts a healthy gateway, and has a new client loaded from a1's state
/// file replay the outbox against it: what it got, the rows of c1 and its outbox after.
async fn replay(w: &mut World, a: Client, state: &Path) -> anyhow::Result<Value> {
    a.crash().await;
    w.restart_gateway(GatewayOpts::default()).await?;
    let mut again = w.admin.load_client(state)?;
    again
        .connect(&w.ws_url())
        .await
        .map_err(|e| anyhow::anyhow!("reconnect: {e}"))?;
    let replies: Vec<Value> = again.replay_outbox(T).await.iter().map(reply).collect();
    Ok(json!({
        "what": "a new client loaded from a1's state file replays its outbox against a healthy gateway",
        "replies": replies,
        "events_rows_c1": w.admin.count_events("c1").await?,
        "a1_outbox": again.outbox(),
    }))
}

async fn run(args: &Args) -> anyhow::Result<(Output, String, bool)> {
    let fault = args.fault.clone();
    let mut w = start(&fault, args.keep).await?;
    let work_dir = w.work_dir().to_path_buf();
    let (a, b) = scenarios::alice_and_bob(&w).await?;
    let state = a.state_path().to_path_buf();

    let sent = a.send("c1", "repro-1", "hello", T).await;
    let exited = w.gw_mut().wait_exit(Duration::from_millis(1500)).await.ok();
    if exited.is_none() {
        // Give pushes, hints and acks one sweep interval and a little to play out.
        let _ = b
            .wait_server_delivered("c1", 1, Duration::from_millis(1500))
            .await;
    }
    let fired = fault_lines(&w);
    let mut doc = Output {
        fault,
        a1_send: reply(&sent),
        gateway_exit: match exited {
            Some(s) => json!({ "code": w.gw().exit_code(), "status": s.to_string() }),
            None => json!("still running"),
        },
        fault_lines: fired,
        events_rows_c1: w.admin.count_events("c1").await?,
        head_c1: w.admin.head("c1").await?,
        b1_delivered_seq: w.admin.cursor("b1", "c1").await?,
        a1_outbox: json!(a.outbox()),
        b1_stats: json!(b.stats()),
        replay: Value::Null,
        database_violations: Vec::new(),
        checker: Value::Null,
        kept: Value::Null,
    };

    if exited.is_some() || !a.outbox().is_empty() {
        doc.replay = replay(&mut w, a, &state).await?;
    }
    let violations = scenarios::db_invariant_violations(&w.admin.pool().await?).await?;
    let j = w.judge().await?;
    doc.checker = json!({
        "verdict": j.report.verdict,
        "summary": j.report.summary(),
        "anomalies": j.report.anomalies,
        "anomalies_by_kind": j.report.counts,
    });
    let (line, held) = verdict(&j.report, &violations);
    doc.database_violations = violations;
    doc.kept = if args.keep || harness_keeps() {
        json!({
            "work_dir": work_dir,
            "postgres_url": w.pg.url(),
            "gateway_log": w.gw().log_path(),
            "history": j.dir.join("history.jsonl"),
            "a1_state": state,
            "b1_state": b.state_path(),
        })
    } else {
        json!(null)
    };
    drop(b);
    drop(w);
    Ok((doc, line, held))
}

/// `IMFAULT_KEEP=1` keeps every work directory (the harness reads it too).
fn harness_keeps() -> bool {
    std::env::var("IMFAULT_KEEP").is_ok_and(|v| v == "1")
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = im_gateway::faults::parse(&args.fault) {
        eprintln!("repro: {e}");
        return ExitCode::from(2);
    }
    if args.fault.trim().is_empty() {
        eprintln!("repro: FAULT is empty: give one, e.g. 'send.before_commit:halt'");
        return ExitCode::from(2);
    }
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("repro: cannot start the runtime: {e}");
            return ExitCode::from(3);
        }
    };
    match rt.block_on(run(&args)) {
        Ok((doc, line, held)) => {
            match serde_json::to_string_pretty(&doc) {
                Ok(text) => println!("{text}"),
                Err(e) => eprintln!("repro: cannot print the result: {e}"),
            }
            if let Some(dir) = doc.kept["work_dir"].as_str() {
                println!("kept: {dir}");
            }
            println!("{line}");
            if held {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("repro: {e:#}");
            ExitCode::from(3)
        }
    }
}
