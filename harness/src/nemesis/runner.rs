//! Runs one [`Schedule`] on the real gateway binary and a throwaway cluster (issue 10):
//! the workload's clients send and receive while the schedule's faults start and end at
//! their offsets, then every fault is healed, the outboxes are replayed, and the checker
//! judges the whole history (D5 after the heal).
//!
//! Owns: a [`World`] whose gateways reach PostgreSQL through a controlled proxy, a second
//! controlled proxy in front of the gateway for the clients (in front of HAProxy, itself in
//! front of the 2–3 gateways of `--gateways N`), each gateway's fault control socket
//! (`IM_FAULT_CONTROL`), one task per device, and the supervisor that restarts a gateway
//! that exited (a crash point fired) or was killed (after its down time).
//!
//! Must not: judge anything itself (the checker does), or retry a send on a client's
//! behalf except through the client's own outbox replay.

use super::faults::{CrashSwitch, CrashSwitches, FaultCtx, Package};
use super::outcome::Outcome;
use super::schedule::{Fault, Membership, Schedule};
use super::supervisor::{Started, Supervisor};
use crate::client::{Client, ClientError, ClientOptions, HintAck};
use crate::gateway::{self, GatewayOpts};
use crate::history::History;
use crate::world::{World, WorldOpts};
use anyhow::Context;
use im_check::history::{Action, Join};
use im_check::Report;
use im_check::Verdict;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Timeout of the clients' requests (sends, syncs, acks, hello).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Timeout of a harness query during the faults (a paused database answers nothing).
const QUERY_TIMEOUT: Duration = Duration::from_secs(1);
/// How often a membership change that failed (the database is away) is tried again.
const MEMBERSHIP_RETRY: Duration = Duration::from_millis(500);
/// The supervisor and the schedule's clock tick.
const TICK: Duration = Duration::from_millis(20);
/// Gateway database deadline during a nemesis run (`IM_DB_TIMEOUT_MS`).
const GW_DB_TIMEOUT_MS: u64 = 1000;

/// The state the device tasks share with the runner.
struct Shared {
    ws_url: String,
    /// user → conversations they are a member of now.
    membership: Mutex<BTreeMap<String, BTreeSet<String>>>,
    /// False from the heal on: no new messages, outboxes are still replayed.
    sending: AtomicBool,
    /// New messages sent and not answered yet ([`InFlight`]): the heal waits for them
    /// before it ends the faults, so what a tail fault lost has no later message to reveal
    /// it (a turn that began before the heal would otherwise send one more).
    sends_in_flight: AtomicUsize,
    /// Each conversation's epoch in the database, read during the heal of a schedule with
    /// a failover (issue 21): a device is settled only once it knows each of its
    /// conversations' (the epoch told it of the lost history, and it reconciled).
    db_epochs: Mutex<BTreeMap<String, i64>>,
}

impl Shared {
    /// Whether `c` knows every epoch the database has for its conversations.
    fn epochs_known(&self, c: &Client) -> bool {
        let db = self.db_epochs.lock().unwrap_or_else(|p| p.into_inner());
        c.epochs()
            .iter()
            .all(|(conv, e)| db.get(conv).is_none_or(|d| e >= d))
    }
}

/// One new message in flight ([`Shared::sends_in_flight`]), counted until it is dropped:
/// also when its turn is cut short (a crash, the stop).
struct InFlight<'a>(&'a AtomicUsize);

impl<'a> InFlight<'a> {
    fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::SeqCst);
        InFlight(n)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A device task's handle.
struct DeviceHandle {
    device: String,
    /// Connected, subscribed, outbox empty, and not sending new messages.
    settled: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<anyhow::Result<Option<Client>>>,
}

/// Runs `schedule` and writes its artefacts into `dir` (made if missing): `schedule.json`,
/// `history.jsonl`, `final.json`, `report.json` (the checker's), `result.json`,
/// `report.html` and the gateway logs. `repeat` is the command line that repeats it.
pub async fn run(schedule: &Schedule, dir: &Path, repeat: String) -> Outcome {
    let t0 = Instant::now();
    let mut log = Vec::new();
    let r = run_inner(schedule, dir, &repeat, t0, &mut log).await;
    let outcome = match r {
        Ok(o) => o,
        Err(e) => Outcome::error(schedule.seed, repeat, &e, t0.elapsed(), log),
    };
    let _ = crate::util::write_atomic(
        &dir.join("result.json"),
        format!(
            "{}\n",
            serde_json::to_string_pretty(&outcome).unwrap_or_default()
        )
        .as_bytes(),
    );
    if let Err(e) = super::report::write_html(dir, schedule, &outcome) {
        tracing::warn!(error = %format!("{e:#}"), "report.html not written");
    }
    outcome
}

async fn run_inner(
    schedule: &Schedule,
    dir: &Path,
    repeat: &str,
    t0: Instant,
    log: &mut Vec<Value>,
) -> anyhow::Result<Outcome> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    crate::util::write_atomic(&dir.join("schedule.json"), schedule.to_json().as_bytes())?;
    tokio::task::spawn_blocking(gateway::require_faults)
        .await
        .context("join the faults check")??;
    let sock_dir = tempfile::Builder::new()
        .prefix("imfault-nemesis-")
        .tempdir()
        .context("make the control socket directory")?;
    let gateways = gateway_options(schedule, sock_dir.path());
    check_needs(schedule, gateways.len())?;
    let mut w = World::start_with(
        WorldOpts {
            db_proxy: true,
            formation: schedule.needs_formation(),
            cluster: crate::pg::ClusterOpts {
                lazyfs: schedule.needs_lazyfs(),
                ..Default::default()
            },
            // A failover's standby (issue 21): asynchronous through a 50 ms link (its window
            // holds a few commits at this load), synchronous through 10 ms, as `make
            // durability` runs them.
            replication: schedule
                .needs_standby()
                .map(|synchronous| crate::world::Replication {
                    synchronous,
                    link_delay: std::time::Duration::from_millis(if synchronous { 10 } else { 50 }),
                }),
        },
        gateways[0].opts.clone(),
    )
    .await?;
    let result = drive(&mut w, schedule, gateways, repeat, t0, log).await;
    let passed = result.as_ref().is_ok_and(|o| o.verdict.is_pass());
    keep_artefacts(&w, dir, passed)?;
    result
}

/// Each gateway's options: the same but for its control socket (in `sock_dir`).
/// The gateways' `IM_HELLO_FAILS_PER_DEVICE_PER_MIN`: strict, as a deployment wary of
/// token guessing sets it, so that the few hellos a reconnecting device makes through one
/// database outage would lock it out if the gateway charged them (it must not: only a hello
/// the database refused is a failed one; `d5-locked-out`). The workload's devices never
/// present a wrong token, so the limit never refuses an honest hello.
const HELLO_FAILS_PER_DEVICE_PER_MIN: u32 = 3;

fn gateway_options(schedule: &Schedule, sock_dir: &Path) -> Vec<Started> {
    (0..schedule.options.gateways.max(1))
        .map(|i| {
            let control = match i {
                0 => sock_dir.join("fault.sock"),
                _ => sock_dir.join(format!("fault-{i}.sock")),
            };
            let opts = GatewayOpts {
                sweep_ms: Some(schedule.options.sweep_ms),
                db_timeout_ms: Some(GW_DB_TIMEOUT_MS),
                env: vec![
                    (
                        "IM_FAULT_CONTROL".to_string(),
                        control.to_string_lossy().to_string(),
                    ),
                    (
                        "IM_HELLO_FAILS_PER_DEVICE_PER_MIN".to_string(),
                        HELLO_FAILS_PER_DEVICE_PER_MIN.to_string(),
                    ),
                ],
                ..Default::default()
            };
            Started { opts, control }
        })
        .collect()
}

/// Refuses, before anything starts, a schedule this machine cannot run: several gateways
/// need haproxy, LazyFS faults the LazyFS layer, pg_auto_failover faults pg_autoctl.
fn check_needs(schedule: &Schedule, gateways: usize) -> anyhow::Result<()> {
    if gateways > 1 {
        crate::balancer::haproxy_bin()
            .map_err(|why| anyhow::anyhow!("--gateways {gateways}: {why}"))?;
    }
    if schedule.needs_lazyfs() {
        crate::lazyfs::LazyFs::available().map_err(|why| {
            let kinds: std::collections::BTreeSet<&str> = schedule
                .faults
                .iter()
                .filter(|f| f.kind.needs_lazyfs())
                .map(|f| f.kind.name())
                .collect();
            anyhow::anyhow!(
                "the schedule's {} fault(s) need the LazyFS layer: {why}",
                kinds.into_iter().collect::<Vec<_>>().join(", ")
            )
        })?;
    }
    if schedule.needs_formation() {
        crate::autofailover::available().map_err(|why| {
            anyhow::anyhow!("the schedule's pg_auto_failover fault(s) need pg_autoctl: {why}")
        })?;
    }
    Ok(())
}

/// The run's artefacts into `dir`, whatever happened: the history, final read and report,
/// the gateways' logs, and when the run did not pass the server's log and a formation's
/// node logs (why a restart failed).
fn keep_artefacts(w: &World, dir: &Path, passed: bool) -> anyhow::Result<()> {
    let work = w.work_dir().to_path_buf();
    for name in ["history.jsonl", "final.json", "report.json"] {
        let from = work.join(name);
        if from.exists() {
            std::fs::copy(&from, dir.join(name))
                .with_context(|| format!("copy {}", from.display()))?;
        }
    }
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs)?;
    if let Ok(entries) = std::fs::read_dir(w.log_dir()) {
        for e in entries.flatten() {
            let name = e.file_name();
            let name_s = name.to_string_lossy();
            if name_s.starts_with("gateway-") || (!passed && name_s == "postgres.log") {
                let _ = std::fs::copy(e.path(), logs.join(&name));
            }
        }
    }
    if !passed {
        if let Some(Ok(entries)) = w.formation_log_dir().map(std::fs::read_dir) {
            for e in entries.flatten() {
                let to = logs.join(format!("formation-{}", e.file_name().to_string_lossy()));
                let _ = std::fs::copy(e.path(), to);
            }
        }
    }
    Ok(())
}

/// The faulty phase, the heal and the judgement.
async fn drive(
    w: &mut World,
    schedule: &Schedule,
    mut gateways: Vec<Started>,
    repeat: &str,
    t0: Instant,
    log: &mut Vec<Value>,
) -> anyhow::Result<Outcome> {
    let hist = w.history().clone();
    hist.nemesis_instant(Action::NemesisStart {
        seed: schedule.seed,
        repeat: repeat.to_string(),
        faults: schedule.faults.len(),
    });
    // Several seeds share two cores (`--jobs`): a moment this process is not run is
    // recorded, and no time bound is judged across it.
    hist.watch_stalls();
    let more = gateways.split_off(1);
    let first = gateways.pop().context("no gateway to start")?;
    let mut sup = Supervisor::new(w, first)?;
    sup.start_more(w, more).await?;
    let shared = Arc::new(Shared {
        ws_url: sup.ws_url(),
        membership: Mutex::new(BTreeMap::new()),
        db_epochs: Mutex::new(BTreeMap::new()),
        sending: AtomicBool::new(true),
        sends_in_flight: AtomicUsize::new(0),
    });
    let tokens = provision(w, schedule, &shared).await?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let (devices, crash_switches) = spawn_devices(w, schedule, &shared, tokens, &stop_rx)?;
    *log = vec![Value::Null; schedule.faults.len()];
    let mut run = Run {
        w,
        schedule,
        hist,
        sup,
        crash_switches,
        log,
        active: BTreeMap::new(),
        not_carried_out: Vec::new(),
        pending_membership: Vec::new(),
        shared,
    };
    run.faulty_phase().await;
    let heal_error = run.heal(&devices).await;
    // Stop the device tasks; their clients stay connected for the judge (D5).
    let _ = stop_tx.send(true);
    let mut clients = Vec::new();
    for d in devices {
        match d.task.await {
            Ok(Ok(Some(c))) => clients.push(c),
            Ok(Ok(None)) => {}
            Ok(Err(e)) => anyhow::bail!("device {}: {e:#}", d.device),
            Err(e) => anyhow::bail!("device {} task: {e}", d.device),
        }
    }
    let judged = run.w.judge().await?;
    for c in clients {
        c.close().await;
    }
    // Faults the schedule names that could not be started: the run did not test what its
    // schedule says, so it is an ERROR, not a pass.
    let not_carried_out = (!run.not_carried_out.is_empty()).then(|| run.not_carried_out.join("; "));
    let mut outcome = outcome_of(schedule, &judged.report, heal_error.or(not_carried_out));
    outcome.repeat = repeat.to_string();
    outcome.fault_log = std::mem::take(run.log);
    outcome.gateway_starts = run.sup.gateway_starts();
    outcome.wall_ms = t0.elapsed().as_millis() as u64;
    Ok(outcome)
}

/// Users, devices (their tokens: device → (user, token)) and conversations, before the
/// clock starts; with a power cut in the schedule, settled on disk.
async fn provision(
    w: &mut World,
    schedule: &Schedule,
    shared: &Shared,
) -> anyhow::Result<BTreeMap<String, (String, String)>> {
    let mut tokens = BTreeMap::new();
    for u in &schedule.workload.users {
        w.admin.add_user(&u.name).await?;
        for d in &u.devices {
            tokens.insert(
                d.clone(),
                (u.name.clone(), w.admin.add_device(d, &u.name).await?),
            );
        }
    }
    for c in &schedule.workload.convs {
        let members: Vec<&str> = c.members.iter().map(String::as_str).collect();
        w.admin.add_conv(&c.id, &members).await?;
        let mut m = shared.membership.lock().unwrap_or_else(|p| p.into_inner());
        for u in &c.members {
            m.entry(u.clone()).or_default().insert(c.id.clone());
        }
    }
    if schedule.needs_lazyfs() {
        // The schema and the provisioning are on disk before the clock starts, as on a
        // server that has run for a while: a power cut judges what the run writes.
        w.pg.settle().await?;
    }
    if schedule.needs_standby().is_some() {
        // Likewise on the standby: a failover judges what the run writes.
        w.standby_caught_up().await?;
    }
    Ok(tokens)
}

/// One task per device ([`device_loop`]), and each device's crash switch.
fn spawn_devices(
    w: &World,
    schedule: &Schedule,
    shared: &Arc<Shared>,
    tokens: BTreeMap<String, (String, String)>,
    stop_rx: &watch::Receiver<bool>,
) -> anyhow::Result<(Vec<DeviceHandle>, CrashSwitches)> {
    let mut devices = Vec::new();
    let mut crash_switches = BTreeMap::new();
    for (device, seed) in &schedule.workload.device_seeds {
        let (user, token) = tokens
            .get(device)
            .cloned()
            .with_context(|| format!("device {device} of device_seeds is no user's"))?;
        let (crashed, crashed_rx) = watch::channel(CrashSwitch::default());
        let settled = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(device_loop(DeviceArgs {
            device: device.clone(),
            user,
            token,
            seed: *seed,
            state: w.admin.state_path(device),
            think_ms: schedule.options.think_ms,
            client: client_options(schedule, device),
            stale_ack_one_in: schedule
                .workload
                .stale_acks
                .iter()
                .find(|a| a.device == *device)
                .map(|a| a.one_in),
            reconnect_one_in: schedule
                .workload
                .reconnects
                .iter()
                .find(|r| r.device == *device)
                .map(|r| r.one_in),
            shared: shared.clone(),
            crashed: crashed_rx,
            stop: stop_rx.clone(),
            settled: settled.clone(),
            hist: w.history().clone(),
        }));
        crash_switches.insert(device.clone(), crashed);
        devices.push(DeviceHandle {
            device: device.clone(),
            settled,
            task,
        });
    }
    Ok((devices, crash_switches))
}

/// The run's state from the clock's start to the heal's end.
struct Run<'a> {
    w: &'a mut World,
    schedule: &'a Schedule,
    hist: History,
    sup: Supervisor,
    crash_switches: CrashSwitches,
    /// Each fault as carried out (`fault_log`), by its index in the schedule.
    log: &'a mut Vec<Value>,
    /// Faults started and not ended: index → history op id.
    active: BTreeMap<usize, u64>,
    /// Faults that could not be started, and why.
    not_carried_out: Vec<String>,
    /// Membership changes due and not applied yet (the database was away).
    pending_membership: Vec<usize>,
    shared: Arc<Shared>,
}

impl Run<'_> {
    /// The schedule's events at their offsets, membership changes retried while the
    /// database is away, the gateway supervised, until the workload's end.
    async fn faulty_phase(&mut self) {
        let events = timeline(self.schedule);
        let start = Instant::now();
        let mut next = 0;
        let mut next_membership_try: Option<Instant> = None;
        loop {
            let now_ms = start.elapsed().as_millis() as u64;
            while next < events.len() && events[next].0 <= now_ms {
                match events[next].1 {
                    Event::Start(i) => self.start_fault(i).await,
                    Event::End(i) => self.end_fault(i, false).await,
                    Event::Membership(i) => self.pending_membership.push(i),
                }
                next += 1;
            }
            // Membership changes go through the admin command, which needs the database:
            // one that fails (the database is down) is tried again, at most one attempt per
            // MEMBERSHIP_RETRY, each bounded: the schedule's clock must not wait on a
            // database that a fault took away.
            if next_membership_try.is_none_or(|t| Instant::now() >= t)
                && !self.apply_pending_membership().await
            {
                next_membership_try = Some(Instant::now() + MEMBERSHIP_RETRY);
            }
            self.sup.supervise(self.w).await;
            if next >= events.len() && now_ms >= self.schedule.options.duration_ms {
                break;
            }
            tokio::time::sleep(TICK).await;
        }
    }

    /// Applies every pending membership change once; true when none is left.
    async fn apply_pending_membership(&mut self) -> bool {
        for i in std::mem::take(&mut self.pending_membership) {
            let m = &self.schedule.workload.membership[i];
            if !apply_membership(self.w, &self.shared, m).await {
                self.pending_membership.push(i);
            }
        }
        self.pending_membership.is_empty()
    }

    /// Starts fault `i` (its package's `start`), recorded as a nemesis period (an instant
    /// ends at once); one that could not start is noted (the run is then an ERROR).
    async fn start_fault(&mut self, i: usize) {
        let f = &self.schedule.faults[i];
        let id = self.hist.nemesis_start(fault_action(f, false));
        let t = self.hist.now_ms();
        let mut cx = FaultCtx::new(self.w, &mut self.sup, &self.crash_switches);
        let r = f.kind.start(&mut cx, &f.target).await;
        if let Err(e) = &r {
            self.not_carried_out.push(format!(
                "fault {} ({} on {}) did not start: {e:#}",
                f.id,
                f.kind.name(),
                f.target
            ));
        }
        self.log[i] = json!({"id": f.id, "kind": f.kind.name(), "target": f.target,
            "fault": f, "started_ms": t,
            "start": r.unwrap_or_else(|e| json!({"error": format!("{e:#}")}))});
        if f.end_ms > f.at_ms {
            self.active.insert(i, id);
        } else {
            self.hist.nemesis_end(id, fault_action(f, false));
            self.log[i]["ended_ms"] = json!(self.hist.now_ms());
        }
    }

    /// Ends fault `i` if it is in force (its package's `end`); `healed`: by the heal. One
    /// that could not end is noted (the run is then an ERROR, as for a start).
    async fn end_fault(&mut self, i: usize, healed: bool) {
        let Some(id) = self.active.remove(&i) else {
            return;
        };
        let f = &self.schedule.faults[i];
        let mut cx = FaultCtx::new(self.w, &mut self.sup, &self.crash_switches);
        let r = f.kind.end(&mut cx, &f.target).await;
        if let Err(e) = &r {
            self.not_carried_out.push(format!(
                "fault {} ({} on {}) did not end: {e:#}",
                f.id,
                f.kind.name(),
                f.target
            ));
        }
        self.hist.nemesis_end(id, fault_action(f, healed));
        self.log[i]["ended_ms"] = json!(self.hist.now_ms());
        self.log[i]["end"] = r.unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
    }

    /// Issue 21: reads each conversation's epoch in the database into the shared state (a
    /// read that fails or times out keeps the last one).
    async fn read_db_epochs(&self) {
        let read = async {
            let pool = self.w.admin.pool().await?;
            let rows: Vec<(String, i32)> =
                sqlx::query_as("SELECT conv_id, epoch FROM conversations")
                    .fetch_all(&pool)
                    .await?;
            anyhow::Ok(rows)
        };
        if let Ok(Ok(rows)) = tokio::time::timeout(Duration::from_secs(1), read).await {
            *self
                .shared
                .db_epochs
                .lock()
                .unwrap_or_else(|p| p.into_inner()) =
                rows.into_iter().map(|(c, e)| (c, i64::from(e))).collect();
        }
    }

    /// The heal: every fault still in force ends (latest first), no new messages, the
    /// gateway is up, the clients reconnect and replay their outboxes, within `heal_ms`.
    /// Returns why it did not finish, if it did not.
    async fn heal(&mut self, devices: &[DeviceHandle]) -> Option<String> {
        self.shared.sending.store(false, Ordering::SeqCst);
        // The last new messages answered first (bounded: a send a fault holds is answered
        // only once the fault ends), so the faults end on a quiet workload.
        let quiet_by = Instant::now() + REQUEST_TIMEOUT;
        while self.shared.sends_in_flight.load(Ordering::SeqCst) > 0 && Instant::now() < quiet_by {
            tokio::time::sleep(TICK).await;
        }
        let active: Vec<usize> = self.active.keys().rev().copied().collect();
        for i in active {
            self.end_fault(i, true).await;
        }
        let heal_id = self.hist.nemesis_start(Action::Heal { unsettled: vec![] });
        let heal_deadline = Instant::now() + Duration::from_millis(self.schedule.options.heal_ms);
        let mut unsettled: Vec<String>;
        let mut next_sweep = Instant::now();
        loop {
            self.sup.supervise(self.w).await;
            if self.schedule.has_failover() {
                self.read_db_epochs().await;
            }
            if Instant::now() >= next_sweep {
                next_sweep = Instant::now() + STALE_FAULT_SWEEP;
                self.sup.disarm_stale(self.w).await;
            }
            let memberships_done = self.apply_pending_membership().await;
            unsettled = devices
                .iter()
                .filter(|d| !d.settled.load(Ordering::SeqCst))
                .map(|d| d.device.clone())
                .collect();
            if unsettled.is_empty() && self.sup.all_up(self.w) && memberships_done {
                break;
            }
            if Instant::now() >= heal_deadline {
                break;
            }
            tokio::time::sleep(TICK).await;
        }
        self.hist.nemesis_end(
            heal_id,
            Action::Heal {
                unsettled: unsettled.clone(),
            },
        );
        (!unsettled.is_empty()).then(|| {
            format!(
                "the heal did not finish within {} ms: devices not back (connected, \
                 subscribed, outbox replayed): {}",
                self.schedule.options.heal_ms,
                unsettled.join(", ")
            )
        })
    }
}

/// The outcome the checker's `report` gives `schedule` (`error`: why the run itself did
/// not do what it should); the caller fills in what only the run knows (the repeat
/// command, the fault log, gateway starts, wall time).
fn outcome_of(schedule: &Schedule, report: &Report, error: Option<String>) -> Outcome {
    let mut faults = BTreeMap::new();
    for f in &schedule.faults {
        *faults.entry(f.kind.name().to_string()).or_insert(0u64) += 1;
    }
    let anomalies: BTreeMap<String, u64> = report
        .counts
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(k, n)| (k.as_str().to_string(), *n))
        .collect();
    // A history that could not be judged is an ERROR, never a pass.
    let error = report.error.clone().or(error);
    let verdict = if !anomalies.is_empty() {
        Verdict::Fail
    } else if error.is_some() {
        Verdict::Error
    } else {
        Verdict::Pass
    };
    Outcome {
        seed: schedule.seed,
        verdict,
        error,
        repeat: String::new(),
        anomalies,
        first_anomalies: report.anomalies.iter().take(20).cloned().collect(),
        expected_loss: report.expected_loss.len() as u64,
        ops: report.stats.ops.clone(),
        faults,
        fault_log: Vec::new(),
        repair_ms: report.stats.repair_ms.clone(),
        delivery_ms: report.stats.delivery_ms.clone(),
        gateway_starts: 0,
        history_entries: report.stats.entries,
        wall_ms: 0,
    }
}

/// One membership change through the admin command (bounded: the database may be away),
/// then in the workload's view of who may send where. True once applied. An attempt cut
/// off by the timeout may still have been applied: the retry then finds it done, and it is
/// recorded as such.
async fn apply_membership(w: &World, shared: &Shared, m: &Membership) -> bool {
    let join = m.op == "join";
    let r = tokio::time::timeout(QUERY_TIMEOUT, async {
        if join {
            w.admin.join(&m.conv, &m.user).await
        } else {
            w.admin.leave(&m.conv, &m.user).await
        }
    })
    .await;
    let applied = match r {
        Ok(Ok(())) => true,
        Ok(Err(e)) => {
            let t = format!("{e:#}");
            let earlier = t.contains("is already a member") || t.contains("is not a member");
            if earlier {
                w.history().nemesis_instant(Action::Membership {
                    action: if join { Join::Join } else { Join::Leave },
                    conv: m.conv.clone(),
                    user: m.user.clone(),
                    applied_by_an_earlier_attempt: true,
                });
            }
            earlier
        }
        Err(_) => false,
    };
    if applied {
        let mut mm = shared.membership.lock().unwrap_or_else(|p| p.into_inner());
        let set = mm.entry(m.user.clone()).or_default();
        if join {
            set.insert(m.conv.clone());
        } else {
            set.remove(&m.conv);
        }
    }
    applied
}

/// The history's record of a schedule fault (its start and its end carry the same).
/// What happens at one instant of the schedule's clock. At equal times, ends come first
/// (a resource is free again), then membership changes, then starts (the variant order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// The end of the fault at this index of `schedule.faults`.
    End(usize),
    /// The membership change at this index of `workload.membership`.
    Membership(usize),
    /// The start of the fault at this index.
    Start(usize),
}

/// The schedule's events in time order.
fn timeline(schedule: &Schedule) -> Vec<(u64, Event)> {
    let mut events = Vec::new();
    for (i, f) in schedule.faults.iter().enumerate() {
        events.push((f.at_ms, Event::Start(i)));
        if f.end_ms > f.at_ms {
            events.push((f.end_ms, Event::End(i)));
        }
    }
    for (i, m) in schedule.workload.membership.iter().enumerate() {
        events.push((m.at_ms, Event::Membership(i)));
    }
    events.sort();
    events
}

fn fault_action(f: &Fault, healed: bool) -> Action {
    Action::Fault {
        fault: f.to_line(),
        healed,
    }
}

/// How often the heal makes sure no fault is left armed.
const STALE_FAULT_SWEEP: Duration = Duration::from_secs(1);

struct DeviceArgs {
    device: String,
    user: String,
    token: String,
    seed: u64,
    state: PathBuf,
    think_ms: (u64, u64),
    client: ClientOptions,
    /// A stale acker's one-in ([`super::schedule::StaleAck`]).
    stale_ack_one_in: Option<u64>,
    /// A reconnecting device's one-in ([`super::schedule::Reconnects`]).
    reconnect_one_in: Option<u64>,
    shared: Arc<Shared>,
    crashed: watch::Receiver<CrashSwitch>,
    stop: watch::Receiver<bool>,
    settled: Arc<AtomicBool>,
    /// The run's history, which the device's clients record into.
    hist: History,
}

/// One device: connects (again after any loss), subscribes, replays its outbox, sends a
/// message to one of its user's conversations, thinks, and so on; crashes when told and
/// comes back from its state file. Returns its client, still connected, at the stop.
async fn device_loop(a: DeviceArgs) -> anyhow::Result<Option<Client>> {
    let DeviceArgs {
        device,
        user,
        token,
        seed,
        state,
        think_ms,
        client: copts,
        stale_ack_one_in,
        reconnect_one_in,
        shared,
        mut crashed,
        mut stop,
        settled,
        hist,
    } = a;
    let mut rng = super::schedule::Rng::new(seed);
    // A stream of its own: the think times and picks are as without it.
    let mut stale_rng = super::schedule::Rng::new(seed ^ 0x57A1_EAC4);
    let mut reconnect_rng = super::schedule::Rng::new(seed ^ 0x4EC0_22EC);
    let mut client =
        Some(Client::create(&state, &device, &token, 1, Some(hist.clone()))?.with_options(copts));
    let mut n: u64 = 0;
    // Crashes carried out: one started and already ended when this device looked is
    // carried out too (crashed, then loaded again at once).
    let mut crashes_done: u64 = 0;
    loop {
        if *stop.borrow() {
            return Ok(client);
        }
        let switch = *crashed.borrow();
        if switch.crashed || switch.crashes > crashes_done {
            crashes_done = switch.crashes;
            settled.store(false, Ordering::SeqCst);
            if let Some(c) = client.take() {
                c.crash().await;
            }
            // Dead until told to come back, or the run stops (then it stays dead).
            tokio::select! {
                _ = crashed.wait_for(|c| !c.crashed) => {}
                _ = stop.wait_for(|s| *s) => return Ok(None),
            }
            client = Some(Client::load(&state, Some(hist.clone()))?.with_options(copts));
            continue;
        }
        let c = client.as_mut().expect("a live client");
        let think = Duration::from_millis(rng.range(think_ms.0, think_ms.1));
        let pick = rng.next_u64();
        let stale_ack = stale_ack_one_in.is_some_and(|k| stale_rng.chance(1, k));
        let stale_pick = stale_rng.next_u64();
        let reconnect = reconnect_one_in.is_some_and(|k| reconnect_rng.chance(1, k));
        let convs: Vec<String> = shared
            .membership
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&user)
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default();
        let sending = shared.sending.load(Ordering::SeqCst);
        if sending && !convs.is_empty() {
            n += 1;
        }
        let turn = Turn {
            think,
            pick,
            n,
            convs,
            sending,
            stale_ack,
            stale_pick,
            reconnect,
        };
        let step = device_turn(c, turn, &settled, &shared);
        let failed = tokio::select! {
            r = step => r.is_err(),
            _ = crashed.changed() => false,
            _ = stop.changed() => false,
        };
        if failed {
            settled.store(false, Ordering::SeqCst);
            // Back off a little before the next attempt (any loss: reconnect).
            tokio::time::sleep(Duration::from_millis(50 + rng.range(0, 150))).await;
        }
    }
}

/// What one turn of a device's loop was drawn to do.
struct Turn {
    think: Duration,
    /// Which of `convs` to send to.
    pick: u64,
    /// The device's send count (its next cmid).
    n: u64,
    /// The user's conversations now.
    convs: Vec<String>,
    /// False from the heal on: replay the outbox and report whether settled instead.
    sending: bool,
    stale_ack: bool,
    stale_pick: u64,
    /// Drop the connection and connect again first (while sending only: after the heal a
    /// device must settle).
    reconnect: bool,
}

/// One turn of a device: reconnect and `sub` if needed (or drawn to), replay the outbox if it holds
/// anything, else send (and, for the stale acker, sometimes ack an old seq) or, after the
/// heal, report whether it is settled; then think.
async fn device_turn(
    c: &mut Client,
    t: Turn,
    settled: &AtomicBool,
    shared: &Shared,
) -> Result<(), ClientError> {
    if t.reconnect && t.sending && c.is_connected() {
        settled.store(false, Ordering::SeqCst);
        // `connect` drops the connection it has first, as a phone's network change does.
        c.connect(&shared.ws_url).await?;
        c.sub().await?;
    }
    if !c.is_connected() || !c.is_subscribed() {
        settled.store(false, Ordering::SeqCst);
        // Connected but no longer subscribed: a sync after an epoch move failed (issue 21),
        // and `sub` syncs it again.
        if !c.is_connected() {
            c.connect(&shared.ws_url).await?;
        }
        c.sub().await?;
    }
    if !c.outbox().is_empty() {
        settled.store(false, Ordering::SeqCst);
        for r in c.replay_outbox(REQUEST_TIMEOUT).await {
            if let Err(e) = r {
                if !e.is_terminal_for_send() {
                    return Err(e);
                }
            }
        }
        return Ok(());
    }
    if t.sending {
        if !t.convs.is_empty() {
            let conv = &t.convs[(t.pick % t.convs.len() as u64) as usize];
            let cmid = format!("{device}-{n}", device = c.device(), n = t.n);
            let _in_flight = InFlight::new(&shared.sends_in_flight);
            match c
                .send(conv, &cmid, &format!("m{}", t.n), REQUEST_TIMEOUT)
                .await
            {
                Ok(_) => {}
                Err(e) if e.is_terminal_for_send() => {}
                Err(e) => return Err(e),
            }
        }
        if t.stale_ack {
            stale_ack_once(c, &t.convs, t.stale_pick).await?;
        }
    } else {
        settled.store(
            c.is_connected()
                && c.is_subscribed()
                && c.outbox().is_empty()
                && shared.epochs_known(c),
            Ordering::SeqCst,
        );
    }
    tokio::time::sleep(t.think).await;
    Ok(())
}

/// A stale acker's old ack (issue 42, [`super::schedule::StaleAck`]): an explicit ack of a
/// seq below the last `delivered` the server reported, in one of `convs` (by `pick`) where
/// that is at least 2. The server's answer is in the history either way (D4 is judged on
/// it); an error answer (a user who left, a database away) is no reason to reconnect.
async fn stale_ack_once(c: &Client, convs: &[String], pick: u64) -> Result<(), ClientError> {
    let acked: Vec<(&String, i64)> = convs
        .iter()
        .filter_map(|conv| c.server_delivered(conv).map(|d| (conv, d)))
        .filter(|(_, d)| *d >= 2)
        .collect();
    if acked.is_empty() {
        return Ok(());
    }
    let (conv, delivered) = acked[(pick % acked.len() as u64) as usize];
    let seq = 1 + ((pick >> 8) % (delivered as u64 - 1)) as i64;
    match c.ack(conv, seq, REQUEST_TIMEOUT).await {
        Ok(_) | Err(ClientError::Server { .. }) => Ok(()),
        Err(e) => Err(e),
    }
}

/// The client options of `device`: the defaults, or a lazy acker's
/// ([`super::schedule::LazyAck`]).
fn client_options(schedule: &Schedule, device: &str) -> ClientOptions {
    let mut o = ClientOptions::default();
    if let Some(l) = schedule
        .workload
        .lazy_acks
        .iter()
        .find(|l| l.device == device)
    {
        o.ack_after = Duration::from_millis(l.after_ms);
        o.ack_every = super::schedule::LAZY_ACK_EVERY;
        o.hint_ack = HintAck::IfIdle;
    }
    o
}
