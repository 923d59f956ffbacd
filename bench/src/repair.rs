//! Part 4, lost-push repair (D5): how long after a send was acknowledged a device whose push
//! was lost holds the event, at several `IM_SWEEP_MS`. Every push is lost (`IM_FAULT=
//! gw.push:drop`), so every send is one trial: the receiver only learns of it from the
//! sweep's hint, syncs, and acks. Trials run in parallel lanes (one conversation, one sender,
//! one receiver each); each lane waits a seeded random time in `[0, interval)` before each
//! send, so send times are spread uniformly over the sweep's phase.
//!
//! The fault points exist only in the debug build with the `faults` feature, and the harness
//! picks its gateway binary once per process: this part therefore runs in a child process
//! (`imfault-bench repair-child`) with `IM_GATEWAY_BIN` set to that binary.

use anyhow::{bail, Context};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

use crate::provision::{self, Device};
use crate::result::{DataCheck, Repair, RepairInterval};
use crate::util::{now_us, progress, r3, summarize_us, Rng};
use crate::wire::{self, RecvLog};

pub const FAULT: &str = "gw.push:drop";

/// What the parent passes to the child.
pub struct ChildArgs {
    pub out: PathBuf,
    pub seed: u64,
    pub intervals: Vec<u64>,
    pub trials: Vec<usize>,
    pub lanes: usize,
}

impl ChildArgs {
    pub fn to_args(&self) -> Vec<String> {
        let join = |v: Vec<String>| v.join(",");
        vec![
            "repair-child".into(),
            self.out.display().to_string(),
            self.seed.to_string(),
            join(self.intervals.iter().map(|x| x.to_string()).collect()),
            join(self.trials.iter().map(|x| x.to_string()).collect()),
            self.lanes.to_string(),
        ]
    }

    pub fn parse(args: &[String]) -> anyhow::Result<ChildArgs> {
        let [out, seed, intervals, trials, lanes] = args else {
            bail!("usage: imfault-bench repair-child OUT SEED INTERVALS TRIALS LANES");
        };
        let list = |s: &str| -> anyhow::Result<Vec<u64>> {
            s.split(',')
                .map(|x| x.parse::<u64>().context("a number"))
                .collect()
        };
        Ok(ChildArgs {
            out: PathBuf::from(out),
            seed: seed.parse()?,
            intervals: list(intervals)?,
            trials: list(trials)?.into_iter().map(|x| x as usize).collect(),
            lanes: lanes.parse()?,
        })
    }
}

/// Runs the child with `bin` as the gateway and reads its result.
pub async fn run_child(bin: &Path, version: &str, args: ChildArgs) -> anyhow::Result<Repair> {
    let exe = std::env::current_exe().context("find the bench executable")?;
    let out_path = args.out.clone();
    let _ = std::fs::remove_file(&out_path);
    let mut child = tokio::process::Command::new(exe)
        .args(args.to_args())
        .env("IM_GATEWAY_BIN", bin)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("spawn the repair child")?;
    let status = tokio::time::timeout(Duration::from_secs(600), child.wait())
        .await
        .context("the repair child ran for more than 600 s")??;
    if !status.success() {
        bail!("the repair child failed ({status}); see its stderr above");
    }
    let text = std::fs::read_to_string(&out_path)
        .with_context(|| format!("read {}", out_path.display()))?;
    let mut r: Repair = serde_json::from_str(&text).context("parse the repair child's result")?;
    r.gateway_bin = bin.display().to_string();
    r.gateway_version = version.to_string();
    Ok(r)
}

struct Lane {
    conv: String,
    sender: Device,
    receiver: Device,
}

struct Trial {
    repair_us: Option<i64>,
    detect_us: Option<i64>,
    acked_us: Option<i64>,
}

/// What one lane needs: its sender connection and the receiver's log and cursor.
struct LaneRun {
    ws: wire::Ws,
    lane: usize,
    conv: String,
    /// The sender's user (for the data check).
    user: String,
    trials: usize,
    interval_ms: u64,
    rng: Rng,
    log: Arc<Mutex<RecvLog>>,
    /// The receiver's last `acked.delivered`.
    delivered: watch::Receiver<i64>,
    /// Every acknowledged (user, cmid) of the part.
    acked: Arc<Mutex<Vec<(String, String)>>>,
}

/// One lane's trials: jitter, send, wait for the receiver's ack, repeat.
async fn lane_trials(run: LaneRun) -> Vec<Trial> {
    let LaneRun {
        mut ws,
        lane,
        conv,
        user,
        trials,
        interval_ms,
        mut rng,
        log,
        mut delivered,
        acked,
    } = run;
    let mut out = Vec::new();
    for t in 0..trials {
        let jitter = Duration::from_micros((rng.unit() * interval_ms as f64 * 1000.0) as u64);
        tokio::time::sleep(jitter).await;
        let cmid = format!("r{lane}-{interval_ms}-{t}");
        let rid = format!("s{t}");
        let frame = wire::send_frame(&rid, &conv, &cmid, "repair");
        let reply = wire::request(&mut ws, frame, &rid, Duration::from_secs(10)).await;
        let reply_us = now_us();
        let seq = match reply.as_ref().ok().and_then(wire::sent) {
            Some((seq, _)) => seq,
            None => {
                out.push(Trial {
                    repair_us: None,
                    detect_us: None,
                    acked_us: None,
                });
                continue;
            }
        };
        acked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((user.clone(), cmid));
        let deadline = Duration::from_millis(interval_ms * 3 + 5000);
        let waited = tokio::time::timeout(deadline, delivered.wait_for(|d| *d >= seq)).await;
        let acked_at = now_us();
        let l = log.lock().unwrap_or_else(|p| p.into_inner());
        let got = l.got.iter().find(|g| g.seq == seq).map(|g| g.recv_us);
        let hint = l
            .hint_times
            .iter()
            .find(|(head, at)| *head >= seq && *at >= reply_us - 1000)
            .map(|h| h.1);
        out.push(Trial {
            repair_us: got.map(|g| g - reply_us),
            detect_us: hint.map(|h| h - reply_us),
            acked_us: matches!(waited, Ok(Ok(_))).then_some(acked_at - reply_us),
        });
    }
    out
}

/// `imfault-bench repair-child …`: the whole part, against its own cluster.
/// The lanes: conversation rp-c{l} of sender rp-s{l} and receiver rp-r{l}, one device
/// each, provisioned.
async fn provision_lanes(pool: &sqlx::PgPool, n: usize) -> anyhow::Result<Vec<Lane>> {
    let lanes: Vec<Lane> = (0..n)
        .map(|l| Lane {
            conv: format!("rp-c{l}"),
            sender: Device::new(format!("rp-s{l}-d"), &format!("rp-s{l}")),
            receiver: Device::new(format!("rp-r{l}-d"), &format!("rp-r{l}")),
        })
        .collect();
    let users: Vec<String> = lanes
        .iter()
        .flat_map(|l| [l.sender.user.clone(), l.receiver.user.clone()])
        .collect();
    let devices: Vec<Device> = lanes
        .iter()
        .flat_map(|l| [l.sender.clone(), l.receiver.clone()])
        .collect();
    let world: Vec<(String, Vec<String>)> = lanes
        .iter()
        .map(|l| {
            (
                l.conv.clone(),
                vec![l.sender.user.clone(), l.receiver.user.clone()],
            )
        })
        .collect();
    provision::world(pool, &users, &devices, &world).await?;
    Ok(lanes)
}

/// `trials` lost pushes spread over the lanes, on a gateway that drops every push and
/// sweeps every `interval` ms: each trial, the pushes the receivers got, and every sync's
/// round trip (µs).
async fn interval_trials(
    cluster: &harness::pg::Cluster,
    lanes: &[Lane],
    args: &ChildArgs,
    interval: u64,
    trials: usize,
    acked: &Arc<Mutex<Vec<(String, String)>>>,
) -> anyhow::Result<(Vec<Trial>, u64, Vec<i64>)> {
    let opts = harness::gateway::GatewayOpts {
        fault: Some(FAULT.into()),
        sweep_ms: Some(interval),
        ..Default::default()
    };
    let mut gw =
        harness::gateway::Gateway::start(&cluster.url(), &opts, &cluster.log_dir()).await?;
    let url = gw.ws_url();
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = Vec::new();
    let mut logs = Vec::new();
    for (l, lane) in lanes.iter().enumerate() {
        let mut rws = wire::open(&url, &lane.receiver.id, &lane.receiver.token).await?;
        let states = wire::sub(&mut rws).await?;
        let start = states.iter().map(|s| s.head).max().unwrap_or(0);
        let log = Arc::new(Mutex::new(RecvLog::default()));
        let (dtx, drx) = watch::channel(start);
        let recv = tokio::spawn(wire::receiver(
            rws,
            states,
            wire::ack_policy(),
            log.clone(),
            dtx,
            stop_rx.clone(),
        ));
        let sws = wire::open(&url, &lane.sender.id, &lane.sender.token).await?;
        let n = trials / lanes.len() + usize::from(l < trials % lanes.len());
        let rng = Rng::new(args.seed ^ (interval << 20) ^ l as u64);
        tasks.push(tokio::spawn(lane_trials(LaneRun {
            ws: sws,
            lane: l,
            conv: lane.conv.clone(),
            user: lane.sender.user.clone(),
            trials: n,
            interval_ms: interval,
            rng,
            log: log.clone(),
            delivered: drx,
            acked: acked.clone(),
        })));
        logs.push((log, recv));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.context("join a lane")?);
    }
    stop_tx.send_replace(true);
    let mut pushes = 0;
    let mut rtt = Vec::new();
    for (log, recv) in logs {
        let _ = tokio::time::timeout(Duration::from_secs(2), recv).await;
        let l = log.lock().unwrap_or_else(|p| p.into_inner());
        pushes += l.pushes;
        rtt.extend(l.sync_rtt_us.iter().copied());
    }
    let _ = gw.terminate(Duration::from_secs(10)).await;
    drop(gw);
    Ok((all, pushes, rtt))
}

/// One interval's figures from its trials: repair, detect, sync and ack times, and the
/// share repaired within the interval plus the sync p99 (D5's bound).
fn interval_result(
    interval: u64,
    all: &[Trial],
    pushes: u64,
    rtt: &mut [i64],
    t0: std::time::Instant,
) -> RepairInterval {
    let mut repair: Vec<i64> = all.iter().filter_map(|t| t.repair_us).collect();
    let mut detect: Vec<i64> = all.iter().filter_map(|t| t.detect_us).collect();
    let mut to_acked: Vec<i64> = all.iter().filter_map(|t| t.acked_us).collect();
    let sync_rtt = summarize_us(rtt);
    let bound_ms = interval as f64 + sync_rtt.p99_ms;
    let within = repair
        .iter()
        .filter(|&&r| r as f64 / 1000.0 <= bound_ms)
        .count();
    let repaired = repair.len();
    let rep = summarize_us(&mut repair);
    RepairInterval {
        sweep_ms: interval,
        trials: all.len(),
        repaired,
        unrepaired: all.len() - repaired,
        pushes_received: pushes,
        p99_vs_interval: crate::util::ratio(rep.p99_ms, interval as f64),
        repair: rep,
        detect: summarize_us(&mut detect),
        sync_rtt,
        to_acked: summarize_us(&mut to_acked),
        d5_bound_ms: r3(bound_ms),
        within_bound: r3(within as f64 / all.len().max(1) as f64),
        wall_s: r3(t0.elapsed().as_secs_f64()),
    }
}

pub async fn child_main(args: ChildArgs) -> anyhow::Result<()> {
    if std::env::var_os("IM_GATEWAY_BIN").is_none() {
        bail!("repair-child needs IM_GATEWAY_BIN (the gateway built with faults)");
    }
    tokio::task::spawn_blocking(harness::gateway::require_faults)
        .await
        .context("join the faults check")??;
    let cluster = harness::pg::Cluster::start_migrated().await?;
    let pool = cluster.pool().await?;
    let lanes = provision_lanes(&pool, args.lanes).await?;
    let acked = Arc::new(Mutex::new(Vec::new()));
    let mut intervals = Vec::new();
    for (ii, &interval) in args.intervals.iter().enumerate() {
        let trials = args.trials.get(ii).copied().unwrap_or(10);
        progress(&format!(
            "[repair {}/{}] IM_SWEEP_MS={interval}: {trials} trials in {} lanes (debug gateway, {FAULT})",
            ii + 1,
            args.intervals.len(),
            lanes.len()
        ));
        let t0 = std::time::Instant::now();
        let (all, pushes, mut rtt) =
            interval_trials(&cluster, &lanes, &args, interval, trials, &acked).await?;
        intervals.push(interval_result(interval, &all, pushes, &mut rtt, t0));
    }
    let acked = std::mem::take(&mut *acked.lock().unwrap_or_else(|p| p.into_inner()));
    let found = provision::count_present(&pool, &acked).await?;
    let gapless = provision::gapless(&pool, "rp-c").await?;
    let lost = (acked.len() as u64).saturating_sub(found);
    let r = Repair {
        gateway_bin: String::new(),
        gateway_version: String::new(),
        fault: FAULT.into(),
        lanes: lanes.len(),
        seed: args.seed,
        definition: "repair = from the sender receiving `sent` (the commit is known) to the receiver \
                     holding the event from a sync page; detect = to the receiver getting the sweep's \
                     hint; sync_rtt = sync request to synced reply; to_acked = to the receiver's \
                     coalesced ack being answered (cursor written). Every push is dropped by the fault, \
                     so the sweep is the only way the event arrives"
            .into(),
        intervals,
        data_check: DataCheck::new(acked.len() as u64, found, lost, gapless),
    };
    pool.close().await;
    drop(cluster);
    std::fs::write(&args.out, serde_json::to_string_pretty(&r)?)
        .with_context(|| format!("write {}", args.out.display()))?;
    Ok(())
}
