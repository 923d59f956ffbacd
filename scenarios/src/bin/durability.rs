//! `make durability` (issue 21, item 5): the durability-contract matrix. For each
//! `synchronous_commit` the gateway's sessions run under (`IM_SYNCHRONOUS_COMMIT`: off,
//! local, remote_write, on, remote_apply), each topology (a standalone primary, an
//! asynchronous standby, a synchronous standby) and each fault (PostgreSQL crashed by an
//! immediate shutdown, a power cut through the LazyFS layer, the primary's machine killed
//! and the standby promoted), `--runs` runs under load: four senders (each message sent
//! again under its cmid until acknowledged) and two receivers. Per run: acknowledged
//! messages lost or moved to another seq, receivers left holding an event the database no
//! longer has at that seq, the checker's anomalies and repair times, and how long the
//! receivers took to hold the database's head again. Writes `evidence/durability/result.json`
//! (format: evidence/README.md); `--table` prints the README's table from it.
//!
//! This is the one target that runs with durability deliberately weakened; every run record
//! says what it ran under (`durability`, read back from the database and the gateway).
//!
//! Must not: judge a cell by anything but what its runs observed against the contract the
//! setting promises ([`Cell::promises_no_loss`]).

use anyhow::Context;
use harness::client::Client;
use harness::gateway::GatewayOpts;
use harness::pg::ClusterOpts;
use harness::world::{Replication, World, WorldOpts};
use im_check::Verdict;
use scenarios::{connect, durability_settings, git, workspace, Through};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const SETTINGS: [&str; 5] = ["off", "local", "remote_write", "on", "remote_apply"];
const TOPOLOGIES: [&str; 3] = ["standalone", "async-standby", "sync-standby"];
const FAULTS: [&str; 3] = ["pg-crash", "power-cut", "failover"];
/// Each request's timeout.
const T: Duration = Duration::from_secs(3);

#[derive(clap::Parser)]
#[command(
    about = "The durability-contract matrix: synchronous_commit x topology x fault, acknowledged \
             messages lost and receivers left wrong, per cell (issue 21)."
)]
struct Args {
    /// Runs per cell.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=50))]
    runs: u32,
    /// Only these synchronous_commit values (comma-separated; default all).
    #[arg(long, value_delimiter = ',')]
    settings: Vec<String>,
    /// Only these topologies: standalone, async-standby, sync-standby.
    #[arg(long, value_delimiter = ',')]
    topologies: Vec<String>,
    /// Only these faults: pg-crash, power-cut, failover.
    #[arg(long, value_delimiter = ',')]
    faults: Vec<String>,
    /// Acknowledged sends before the fault, per run.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(10..=100_000))]
    acked: u64,
    /// Runs at once (each its own clusters and gateway; a run mostly waits on PostgreSQL's
    /// crash and recovery, so two runs at once on two cores take 1.3 times one run's time).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=8))]
    jobs: u32,
    /// Where the result goes [default: evidence/durability/result.json].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print the README's table from the result file and run nothing.
    #[arg(long)]
    table: bool,
}

/// One cell of the matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cell {
    setting: &'static str,
    topology: &'static str,
    fault: &'static str,
}

impl Cell {
    /// Whether the configuration promises that an acknowledged message survives the fault:
    /// a crash keeps the OS page cache, so only WAL never written is lost (`off`); a power
    /// cut loses what was not flushed (`off`); a failover keeps only what the standby had
    /// received before the reply, which only a synchronous standby with `on`,
    /// `remote_apply` or `remote_write` waits for.
    fn promises_no_loss(self) -> bool {
        match self.fault {
            "failover" => {
                self.topology == "sync-standby"
                    && matches!(self.setting, "on" | "remote_apply" | "remote_write")
            }
            _ => self.setting != "off",
        }
    }

    /// Whether the gateway finds a new lineage after the fault, moves every epoch and
    /// closes its connections: a promoted standby (a new timeline), or, under `off`, a
    /// restarted server (a new incarnation, migration 0007).
    fn moves_the_lineage(self) -> bool {
        self.fault == "failover" || self.setting == "off"
    }

    fn applicable(self) -> bool {
        !(self.fault == "failover" && self.topology == "standalone")
    }
}

fn chosen(all: &[&'static str], only: &[String], what: &str) -> anyhow::Result<Vec<&'static str>> {
    for o in only {
        anyhow::ensure!(
            all.contains(&o.as_str()),
            "unknown {what} {o:?}; one of {}",
            all.join(", ")
        );
    }
    Ok(all
        .iter()
        .copied()
        .filter(|a| only.is_empty() || only.iter().any(|o| o == a))
        .collect())
}

/// What one run observed.
#[derive(Debug, Default, Serialize)]
struct Run {
    acknowledged: usize,
    acknowledged_lost: usize,
    acknowledged_other_seq: usize,
    acknowledged_lost_sample: Vec<String>,
    /// Stored events of the receivers, as they held them when the fault was over, whose seq
    /// the database now holds with another message, or not at all: what a device would
    /// keep if nothing told it (without the epoch).
    receivers_holding_what_the_database_lost: usize,
    /// The same, once the receivers caught up again: the epoch told them of a failover
    /// (issue 21: the gateway moves every epoch on a new lineage and closes its
    /// connections; the receivers connect again and reconcile). Must be 0 in every cell.
    receivers_holding_what_the_database_lost_with_epoch: usize,
    receivers_wrong: usize,
    /// Connections the gateway closed when it found the new lineage (failover).
    connections_closed_by_the_lineage_move: usize,
    /// From the database answering again to every receiver holding its head, ms.
    converged_ms: Option<f64>,
    /// The checker's anomalies by kind (lossy cells: the loss, seen by the history).
    anomalies: BTreeMap<String, u64>,
    /// The checker's repair times (events that reached a receiver by sync), ms.
    repair_ms: Value,
    fault_ms: Value,
    durability: BTreeMap<String, String>,
    wall_ms: u64,
    error: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let a: Args = clap::Parser::parse();
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| workspace().join("evidence/durability/result.json"));
    if a.table {
        let doc: Value = serde_json::from_slice(
            &std::fs::read(&out).with_context(|| format!("read {}", out.display()))?,
        )?;
        print!("{}", table(&doc));
        return Ok(());
    }
    let settings = chosen(&SETTINGS, &a.settings, "setting")?;
    let topologies = chosen(&TOPOLOGIES, &a.topologies, "topology")?;
    let faults = chosen(&FAULTS, &a.faults, "fault")?;
    let rt = tokio::runtime::Runtime::new()?;
    let started = Instant::now();
    let cells = matrix(&topologies, &faults, &settings);
    let runs = runs_at_once(&rt, &cells, &a, &out, started)?;
    let rows: Vec<Value> = cells.iter().zip(&runs).map(|(c, r)| row(*c, r)).collect();
    write(&out, &rows, &a, started, true)?;
    println!("{}", out.display());
    print!("{}", table(&serde_json::from_slice(&std::fs::read(&out)?)?));
    Ok(())
}

/// A cell's row: its runs judged, or why it has none.
fn row(cell: Cell, runs: &[Run]) -> Value {
    if cell.applicable() {
        cell_row(cell, runs)
    } else {
        json!({"synchronous_commit": cell.setting, "topology": cell.topology,
            "fault": cell.fault, "applicable": false, "why": "a failover needs a standby"})
    }
}

/// Every run of every applicable cell, `--jobs` at once (each on its own thread, blocking on
/// the one runtime), in the matrix's order; after each cell's last run, the cells finished
/// so far are written (`complete: false`), so a run cut short keeps what it measured.
fn runs_at_once(
    rt: &tokio::runtime::Runtime,
    cells: &[Cell],
    a: &Args,
    out: &std::path::Path,
    started: Instant,
) -> anyhow::Result<Vec<Vec<Run>>> {
    let work: Vec<(usize, u32)> = (0..cells.len())
        .filter(|&c| cells[c].applicable())
        .flat_map(|c| (1..=a.runs).map(move |i| (c, i)))
        .collect();
    let runs: std::sync::Mutex<Vec<Vec<Run>>> =
        std::sync::Mutex::new(cells.iter().map(|_| Vec::new()).collect());
    let written: std::sync::Mutex<anyhow::Result<()>> = std::sync::Mutex::new(Ok(()));
    scenarios::each_in_places(&work, a.jobs as usize, |k, &(c, i)| {
        let cell = cells[c];
        eprintln!(
            "durability: {} / {} / {} run {i} of {} ({} of {}, {} s elapsed)",
            cell.setting,
            cell.topology,
            cell.fault,
            a.runs,
            k + 1,
            work.len(),
            started.elapsed().as_secs()
        );
        let r = timed_run(rt, cell, a.acked);
        let mut all = runs.lock().unwrap_or_else(|p| p.into_inner());
        all[c].push(r);
        if all[c].len() == a.runs as usize {
            let done: Vec<Value> = cells
                .iter()
                .zip(all.iter())
                .filter(|(c, r)| c.applicable() && r.len() == a.runs as usize)
                .map(|(c, r)| row(*c, r))
                .collect();
            if let Err(e) = write(out, &done, a, started, false) {
                *written.lock().unwrap_or_else(|p| p.into_inner()) = Err(e);
            }
        }
    });
    written.into_inner().unwrap_or_else(|p| p.into_inner())?;
    Ok(runs.into_inner().unwrap_or_else(|p| p.into_inner()))
}

/// Every cell of the chosen topologies, faults and settings, in that nesting order.
fn matrix(
    topologies: &[&'static str],
    faults: &[&'static str],
    settings: &[&'static str],
) -> Vec<Cell> {
    let mut cells = Vec::new();
    for &topology in topologies {
        for &fault in faults {
            for &setting in settings {
                cells.push(Cell {
                    setting,
                    topology,
                    fault,
                });
            }
        }
    }
    cells
}

/// One run of `cell`, timed (a run that could not be made is a run with its error), and
/// its line on stderr.
fn timed_run(rt: &tokio::runtime::Runtime, cell: Cell, acked: u64) -> Run {
    let t = Instant::now();
    let mut r = rt.block_on(run(cell, acked)).unwrap_or_else(|e| Run {
        error: Some(format!("{e:#}")),
        ..Default::default()
    });
    r.wall_ms = t.elapsed().as_millis() as u64;
    eprintln!(
        "  {} / {} / {}: acknowledged {}, lost {}, receivers wrong {}{}",
        cell.setting,
        cell.topology,
        cell.fault,
        r.acknowledged,
        r.acknowledged_lost,
        r.receivers_wrong,
        r.error
            .as_deref()
            .map(|e| format!(", ERROR {e}"))
            .unwrap_or_default()
    );
    r
}

/// A cell's entry: its runs and what they add up to, judged against its promise.
fn cell_row(cell: Cell, runs: &[Run]) -> Value {
    let sum = |f: &dyn Fn(&Run) -> usize| runs.iter().map(f).sum::<usize>();
    let errors = runs.iter().filter(|r| r.error.is_some()).count();
    let lost = sum(&|r| r.acknowledged_lost + r.acknowledged_other_seq);
    let wrong_with_epoch = sum(&|r| r.receivers_holding_what_the_database_lost_with_epoch);
    let verdict = if errors > 0 {
        Verdict::Error
    } else if (cell.promises_no_loss() && lost > 0) || wrong_with_epoch > 0 {
        // A configuration may lose what it does not promise to keep; no device may be left
        // silently holding it.
        Verdict::Fail
    } else {
        Verdict::Pass
    };
    let converged: Vec<f64> = runs.iter().filter_map(|r| r.converged_ms).collect();
    json!({
        "synchronous_commit": cell.setting,
        "topology": cell.topology,
        "fault": cell.fault,
        "applicable": true,
        "promises_no_loss": cell.promises_no_loss(),
        "verdict": verdict,
        "summary": {
            "runs": runs.len(),
            "errors": errors,
            "acknowledged": sum(&|r| r.acknowledged),
            "acknowledged_lost": sum(&|r| r.acknowledged_lost),
            "acknowledged_other_seq": sum(&|r| r.acknowledged_other_seq),
            "runs_with_loss": runs.iter().filter(|r| r.acknowledged_lost + r.acknowledged_other_seq > 0).count(),
            "receivers_holding_what_the_database_lost": sum(&|r| r.receivers_holding_what_the_database_lost),
            "receivers_holding_what_the_database_lost_with_epoch": wrong_with_epoch,
            "converged_ms_max": converged.iter().copied().reduce(f64::max),
        },
        "runs": runs,
    })
}

fn write(
    out: &std::path::Path,
    rows: &[Value],
    a: &Args,
    started: Instant,
    complete: bool,
) -> anyhow::Result<()> {
    let count = |v: Verdict| rows.iter().filter(|r| r["verdict"] == json!(v)).count();
    let doc = json!({
        "schema_version": 1,
        "generated_by": "make durability (scenarios/src/bin/durability.rs)",
        "environment": {
            "git_commit": git(&["rev-parse", "HEAD"]),
            "git_dirty": git(&["status", "--porcelain", "--", ".", ":(exclude)evidence"]).map(|s| !s.is_empty()),
            "generated_at": scenarios::rfc3339_now(),
            "host_cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "runs_per_cell": a.runs,
            "jobs": a.jobs,
            "acknowledged_before_fault": a.acked,
            "complete": complete,
            "wall_s": started.elapsed().as_secs(),
        },
        "durability_deliberately_weakened": "this target alone runs the gateway with \
            IM_SYNCHRONOUS_COMMIT other than on; each run's `durability` says what it ran under",
        "epochs": "receivers_holding_what_the_database_lost counts what the receivers held when \
            the fault was over (what a device keeps if nothing tells it); \
            receivers_holding_what_the_database_lost_with_epoch what they held once caught up \
            again, after the epoch told them of the failover, or under off of the restart \
            (issue 21, migration 0007): a cell with any is FAIL",
        "summary": {
            "cells": rows.iter().filter(|r| r["applicable"] == true).count(),
            "pass": count(Verdict::Pass),
            "fail": count(Verdict::Fail),
            "error": count(Verdict::Error),
        },
        "cells": rows,
    });
    let out = harness::util::publish_path(out);
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    harness::util::write_atomic(
        &out,
        (serde_json::to_string_pretty(&doc)? + "\n").as_bytes(),
    )
}

/// The README's table: one row per setting, one column per (topology, fault); each cell
/// the acknowledged messages lost of those acknowledged, over its runs.
fn table(doc: &Value) -> String {
    let cells = doc["cells"].as_array().cloned().unwrap_or_default();
    let mut s = String::from("| `synchronous_commit` |");
    let mut cols = Vec::new();
    for t in TOPOLOGIES {
        for f in FAULTS {
            if cells.iter().any(|c| c["topology"] == t && c["fault"] == f) {
                cols.push((t, f));
                s.push_str(&format!(" {t}, {f} |"));
            }
        }
    }
    s.push_str("\n|---|");
    s.push_str(&"---|".repeat(cols.len()));
    s.push('\n');
    for set in SETTINGS {
        if !cells.iter().any(|c| c["synchronous_commit"] == set) {
            continue;
        }
        s.push_str(&format!("| `{set}` |"));
        for (t, f) in &cols {
            let c = cells.iter().find(|c| {
                c["synchronous_commit"] == set && c["topology"] == *t && c["fault"] == *f
            });
            let text = match c {
                None => "not run".to_string(),
                Some(c) if c["applicable"] == false => "n/a".to_string(),
                Some(c) => {
                    let m = &c["summary"];
                    let lost = m["acknowledged_lost"].as_u64().unwrap_or(0)
                        + m["acknowledged_other_seq"].as_u64().unwrap_or(0);
                    let wrong = m["receivers_holding_what_the_database_lost"]
                        .as_u64()
                        .unwrap_or(0);
                    let mut t = format!("{lost} of {} lost", m["acknowledged"]);
                    if wrong > 0 {
                        t.push_str(&format!(", {wrong} held wrong"));
                        // Issue 21: what they still held once the epoch told them.
                        if let Some(after) =
                            m["receivers_holding_what_the_database_lost_with_epoch"].as_u64()
                        {
                            t.push_str(&format!(" ({after} after the epoch)"));
                        }
                    }
                    match c["verdict"].as_str() {
                        Some("FAIL") => t.push_str(" **FAIL**"),
                        Some("ERROR") => t.push_str(" (ERROR)"),
                        _ => {}
                    }
                    t
                }
            };
            s.push_str(&format!(" {text} |"));
        }
        s.push('\n');
    }
    s
}

/// One run of `cell`: the world, the load, the fault, the recovery, the measurements.
async fn run(cell: Cell, acked_before: u64) -> anyhow::Result<Run> {
    let mut w = start(cell).await?;
    let mut r = Run {
        durability: durability_settings(&w).await?,
        ..Default::default()
    };
    let (mut senders, mut receivers) = provision(&w).await?;
    w.pg.settle().await?;
    let (acked, timings) = load_through_the_fault(&mut w, cell, &senders, acked_before).await?;
    r.fault_ms = timings;
    let recovered = Instant::now();
    let held_at_the_fault: Vec<Vec<Value>> = receivers.iter().map(|c| c.stored("c1")).collect();
    if cell.moves_the_lineage() {
        // The new lineage closes every connection: every device connects again, the
        // receivers subscribed (they learn the moved epoch and reconcile).
        let waits = std::iter::once(Duration::from_secs(5))
            .chain(std::iter::repeat(Duration::from_millis(200)));
        for ((c, sub), within) in receivers
            .iter_mut()
            .map(|c| (c, true))
            .chain(senders.iter_mut().map(|c| (c, false)))
            .zip(waits)
        {
            r.connections_closed_by_the_lineage_move +=
                usize::from(scenarios::reconnect_after_lineage_move(&w, c, sub, within).await?);
        }
    }
    // The in-flight sends replay under their cmids (not counted as acknowledged before).
    for s in &senders {
        let _ = harness::util::wait_until(
            "the outbox to replay",
            Duration::from_secs(20),
            async || {
                let rs = s.replay_outbox(T).await;
                if rs.iter().all(|r| r.is_ok()) {
                    Ok(())
                } else {
                    Err(rs.len())
                }
            },
        )
        .await;
    }
    let db = events_of_c1(&w).await?;
    count_acknowledged(&mut r, &acked, &db);
    receivers_against_the_database(&mut r, &receivers, &db, recovered).await;
    r.receivers_holding_what_the_database_lost = held_at_the_fault
        .iter()
        .map(|held| held_wrong(held, &db))
        .sum();
    let judged = w.judge().await?;
    r.anomalies = judged
        .report
        .counts
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(k, n)| (k.as_str().to_string(), *n))
        .collect();
    r.repair_ms = serde_json::to_value(&judged.report.stats.repair_ms)?;
    for c in senders.into_iter().chain(receivers) {
        c.close().await;
    }
    Ok(r)
}

/// The cell's world: its topology (a standby through a 50 ms link, or a synchronous one
/// through 10 ms), LazyFS under the primary for a power cut, and a gateway whose sessions
/// run under the cell's `synchronous_commit`.
async fn start(cell: Cell) -> anyhow::Result<World> {
    let replication = match cell.topology {
        "standalone" => None,
        t => Some(Replication {
            synchronous: t == "sync-standby",
            link_delay: Duration::from_millis(if t == "sync-standby" { 10 } else { 50 }),
        }),
    };
    World::start_with(
        WorldOpts {
            cluster: ClusterOpts {
                lazyfs: cell.fault == "power-cut",
                ..Default::default()
            },
            replication,
            ..Default::default()
        },
        GatewayOpts {
            db_timeout_ms: Some(1000),
            env: vec![(
                "IM_SYNCHRONOUS_COMMIT".to_string(),
                cell.setting.to_string(),
            )],
            ..Default::default()
        },
    )
    .await
}

/// Four senders and two receivers in `c1`, connected and subscribed.
async fn provision(w: &World) -> anyhow::Result<(Vec<Client>, Vec<Client>)> {
    let members: Vec<String> = (0..4)
        .map(|i| format!("s{i}"))
        .chain((0..2).map(|i| format!("r{i}")))
        .collect();
    for m in &members {
        w.admin.add_user(m).await?;
    }
    let refs: Vec<&str> = members.iter().map(String::as_str).collect();
    w.admin.add_conv("c1", &refs).await?;
    let (mut senders, mut receivers) = (Vec::new(), Vec::new());
    for m in &members {
        let dev = format!("{m}d");
        let token = w.admin.add_device(&dev, m).await?;
        let c = connect(w, &dev, &token).await?;
        c.sub()
            .await
            .map_err(|e| anyhow::anyhow!("sub {dev}: {e}"))?;
        if m.starts_with('s') {
            senders.push(c);
        } else {
            receivers.push(c);
        }
    }
    Ok((senders, receivers))
}

/// The senders send (each message again under its cmid until acknowledged: [`Through`])
/// until `acked_before` are acknowledged; then the cell's fault, and the database back
/// (restarted, or the standby promoted). Returns the acknowledged (cmid, seq) and the
/// fault's timings.
async fn load_through_the_fault(
    w: &mut World,
    cell: Cell,
    senders: &[Client],
    acked_before: u64,
) -> anyhow::Result<(Vec<(String, i64)>, Value)> {
    let load = Through::default();
    let fault = async {
        let r = fault_under_load(w, cell, &load, acked_before).await;
        load.stop.store(true, Ordering::SeqCst);
        r
    };
    let (_, timings) = tokio::join!(load.run(senders, Instant::now()), fault);
    Ok((load.acked_pairs(), timings?))
}

/// Once `acked_before` are acknowledged: the fault (new sends stop with it), and the
/// database back.
async fn fault_under_load(
    w: &mut World,
    cell: Cell,
    load: &Through,
    acked_before: u64,
) -> anyhow::Result<Value> {
    harness::util::wait_until(
        &format!("{acked_before} acknowledged"),
        Duration::from_secs(60),
        async || {
            let k = load.acked_since(0.0) as u64;
            harness::util::poll(k >= acked_before, k).await
        },
    )
    .await?;
    let stop = &load.stop;
    let t = Instant::now();
    Ok(match cell.fault {
        "pg-crash" => {
            w.crash_pg().await?;
            stop.store(true, Ordering::SeqCst);
            w.restart_pg().await?;
            json!({"restarted_ms": t.elapsed().as_millis() as u64})
        }
        "power-cut" => {
            let cut = w.power_cut_pg().await?;
            stop.store(true, Ordering::SeqCst);
            w.restart_pg().await?;
            json!({"pages_dropped": cut.pages_dropped, "restarted_ms": t.elapsed().as_millis() as u64})
        }
        _ => {
            let f = w.failover().await?;
            stop.store(true, Ordering::SeqCst);
            f
        }
    })
}

/// `c1`'s events after recovery: seq -> (mid, cmid).
async fn events_of_c1(w: &World) -> anyhow::Result<BTreeMap<i64, (String, Option<String>)>> {
    Ok(sqlx::query_as::<_, (i64, String, Option<String>)>(
        "SELECT seq, mid, cmid FROM events WHERE conv_id = 'c1'",
    )
    .fetch_all(&w.admin.pool().await?)
    .await?
    .into_iter()
    .map(|(seq, mid, cmid)| (seq, (mid, cmid)))
    .collect())
}

/// Each acknowledged send: its row, at the seq its reply said, or lost.
fn count_acknowledged(
    r: &mut Run,
    acked: &[(String, i64)],
    db: &BTreeMap<i64, (String, Option<String>)>,
) {
    r.acknowledged = acked.len();
    let by_cmid: BTreeMap<&str, i64> = db
        .iter()
        .filter_map(|(seq, (_, c))| c.as_deref().map(|c| (c, *seq)))
        .collect();
    for (cmid, seq) in acked {
        match by_cmid.get(cmid.as_str()) {
            None => {
                r.acknowledged_lost += 1;
                if r.acknowledged_lost_sample.len() < 10 {
                    r.acknowledged_lost_sample.push(cmid.clone());
                }
            }
            Some(s) if s != seq => r.acknowledged_other_seq += 1,
            Some(_) => {}
        }
    }
}

/// The receivers catch up with the database's head (by push, hint or sync; how long since
/// `recovered`), then what they hold is compared with what the database has at each seq.
async fn receivers_against_the_database(
    r: &mut Run,
    receivers: &[Client],
    db: &BTreeMap<i64, (String, Option<String>)>,
    recovered: Instant,
) {
    let head = db.keys().max().copied().unwrap_or(0);
    let caught_up = harness::util::wait_until(
        "the receivers to hold the head",
        Duration::from_secs(30),
        async || {
            let behind: Vec<i64> = receivers
                .iter()
                .map(|c| c.cursor("c1"))
                .filter(|c| *c < head)
                .collect();
            if behind.is_empty() {
                Ok(())
            } else {
                Err(behind)
            }
        },
    )
    .await;
    if caught_up.is_ok() {
        r.converged_ms = Some(recovered.elapsed().as_secs_f64() * 1000.0);
    }
    for c in receivers {
        let wrong = held_wrong(&c.stored("c1"), db);
        r.receivers_holding_what_the_database_lost_with_epoch += wrong;
        r.receivers_wrong += usize::from(wrong > 0);
    }
}

/// How many of `held` (stored events) the database does not hold at their seq.
fn held_wrong(held: &[Value], db: &BTreeMap<i64, (String, Option<String>)>) -> usize {
    held.iter()
        .filter(|ev| match (ev["seq"].as_i64(), ev["mid"].as_str()) {
            (Some(seq), Some(mid)) => db.get(&seq).is_none_or(|(m, _)| m != mid),
            _ => false,
        })
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(setting: &'static str, topology: &'static str, fault: &'static str) -> Cell {
        Cell {
            setting,
            topology,
            fault,
        }
    }

    /// The contract each cell is judged against: only `off` may lose on a crash or a power
    /// cut; a failover keeps what was acknowledged only with a synchronous standby and a
    /// setting that waits for it.
    #[test]
    fn the_promise_of_each_cell() {
        for s in SETTINGS {
            for t in TOPOLOGIES {
                for f in ["pg-crash", "power-cut"] {
                    assert_eq!(cell(s, t, f).promises_no_loss(), s != "off", "{s} {t} {f}");
                }
            }
            assert!(!cell(s, "async-standby", "failover").promises_no_loss());
            assert_eq!(
                cell(s, "sync-standby", "failover").promises_no_loss(),
                matches!(s, "on" | "remote_apply" | "remote_write"),
                "{s}"
            );
        }
        assert!(!cell("on", "standalone", "failover").applicable());
    }

    /// A loss where the cell promises none is a FAIL; one where it promises nothing is
    /// measured, not failed; a run that could not be carried out is an ERROR.
    #[test]
    fn cells_are_judged_against_their_promise() {
        let lossy = || Run {
            acknowledged: 200,
            acknowledged_lost: 3,
            ..Default::default()
        };
        let v = |c: Cell, r: Run| cell_row(c, &[r])["verdict"].clone();
        assert_eq!(
            v(cell("on", "sync-standby", "failover"), lossy()),
            json!("FAIL")
        );
        assert_eq!(
            v(cell("on", "async-standby", "failover"), lossy()),
            json!("PASS")
        );
        assert_eq!(
            v(cell("off", "standalone", "power-cut"), lossy()),
            json!("PASS")
        );
        let err = Run {
            error: Some("x".into()),
            ..Default::default()
        };
        assert_eq!(v(cell("on", "standalone", "pg-crash"), err), json!("ERROR"));
    }

    /// The README's table: one row per setting, one column per topology and fault; a
    /// failover without a standby is n/a; a broken promise says FAIL.
    #[test]
    fn the_table_shows_each_cell() {
        let lossy = Run {
            acknowledged: 200,
            acknowledged_lost: 3,
            receivers_holding_what_the_database_lost: 2,
            ..Default::default()
        };
        let doc = json!({"cells": [
            cell_row(cell("on", "sync-standby", "failover"), &[lossy]),
            json!({"synchronous_commit": "on", "topology": "standalone", "fault": "failover", "applicable": false}),
        ]});
        let t = table(&doc);
        assert!(
            t.starts_with(
                "| `synchronous_commit` | standalone, failover | sync-standby, failover |"
            ),
            "{t}"
        );
        assert!(
            t.contains("| `on` | n/a | 3 of 200 lost, 2 held wrong (0 after the epoch) **FAIL** |"),
            "{t}"
        );
        // Issue 21: a receiver still wrong once the epoch told it fails any cell, lossy by
        // contract or not.
        let unreconciled = Run {
            acknowledged: 200,
            acknowledged_lost: 3,
            receivers_holding_what_the_database_lost: 2,
            receivers_holding_what_the_database_lost_with_epoch: 1,
            ..Default::default()
        };
        let row = cell_row(cell("on", "async-standby", "failover"), &[unreconciled]);
        assert_eq!(row["verdict"], json!("FAIL"));
        assert!(chosen(&SETTINGS, &["sometimes".into()], "setting").is_err());
    }
}

/// The README's table is the committed evidence's (`--table`), or says NOT_RUN when there is
/// none: the README cannot claim what the file does not hold.
#[cfg(test)]
#[test]
fn the_readme_table_is_the_evidence_table() {
    let readme = std::fs::read_to_string(workspace().join("README.md")).unwrap();
    let (_, rest) = readme
        .split_once("<!-- durability-table -->\n")
        .expect("the README's durability table markers");
    let (block, _) = rest
        .split_once("<!-- /durability-table -->")
        .expect("the README's durability table end marker");
    match std::fs::read(workspace().join("evidence/durability/result.json")) {
        Ok(bytes) => {
            let doc: Value = serde_json::from_slice(&bytes).unwrap();
            assert_eq!(block, table(&doc), "run target/debug/durability --table");
        }
        Err(_) => assert!(block.starts_with("NOT_RUN"), "{block}"),
    }
}
