//! The gateway under a nemesis run: one gateway process kept running behind the clients'
//! proxy, started again when it exits (a crash point fired) unless a `gw-kill` holds it
//! down, and the fault control socket through which faults are armed.
//!
//! Owns: the gateway's options, its control socket path, the clients' proxy, and whether
//! the gateway is held down. The [`World`] owns the process itself; only this type replaces
//! or drops it during a run.
//!
//! Must not: decide which faults happen (the schedule does) or judge anything.

use crate::gateway::{self, GatewayOpts};
use crate::history::Action;
use crate::proxy::{Condition, Proxy};
use crate::world::World;
use anyhow::Context;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Keeps one gateway running behind the clients' proxy.
pub struct Supervisor {
    opts: GatewayOpts,
    control: PathBuf,
    client_proxy: Proxy,
    /// A `gw-kill` holds the gateway down until its end.
    down: bool,
    gateway_starts: u64,
    /// When a failed start may be tried again.
    next_restart: Option<Instant>,
}

/// How long a gateway fault's start waits for a gateway that is being started again (after
/// a crash point fired, or while its restart waits for the database).
const GATEWAY_BACK_WITHIN: Duration = Duration::from_secs(3);

impl Supervisor {
    /// During the heal nothing may stay armed, yet an `arm` the harness gave up on (it
    /// timed out while the gateway was paused: seed 248 of a 1,000-seed run) can still take
    /// effect once the gateway runs again, after that fault's end disarmed it: its command
    /// waited in the control socket. Anything armed now is recorded and disarmed.
    pub async fn disarm_stale(&self, w: &World) {
        if !w.has_gateway() {
            return;
        }
        let Ok(listed) = gateway::fault_control(&self.control, "list").await else {
            return;
        };
        let armed = listed.trim_start_matches("ok").trim();
        if armed.is_empty() {
            return;
        }
        let r = gateway::fault_control(&self.control, "disarm all").await;
        w.history().nemesis_instant(Action::StaleFaultDisarmed {
            armed: armed.to_string(),
            disarm: r.unwrap_or_else(|e| format!("{e:#}")),
        });
    }

    /// Restarts the gateway if it exited (a crash point fired) or is missing, unless a
    /// `gw-kill` holds it down. A start that fails (the database is away) is retried.
    pub async fn supervise(&mut self, w: &mut World) {
        if self.down {
            return;
        }
        if w.has_gateway() {
            let Some(status) = w.take_exited_gateway() else {
                return;
            };
            w.history().nemesis_instant(Action::GatewayExit {
                gateway: None,
                status: status.code(),
                raw: status.to_string(),
            });
        }
        if self.next_restart.is_some_and(|t| Instant::now() < t) {
            return;
        }
        match w.restart_gateway(self.opts.clone()).await {
            Ok(()) => {
                self.gateway_starts += 1;
                self.next_restart = None;
                self.client_proxy.switch(w.gw().addr());
            }
            Err(e) => {
                tracing::info!(error = %format!("{e:#}"), "nemesis: gateway start failed; retrying");
                w.take_gateway();
                self.next_restart = Some(Instant::now() + Duration::from_millis(200));
            }
        }
    }

    pub fn new(opts: GatewayOpts, control: PathBuf, client_proxy: Proxy) -> Supervisor {
        Supervisor {
            opts,
            control,
            client_proxy,
            down: false,
            gateway_starts: 1,
            next_restart: None,
        }
    }

    /// Gateways started so far, the first included.
    pub fn gateway_starts(&self) -> u64 {
        self.gateway_starts
    }

    /// Kills the gateway (SIGKILL) and holds it down until [`Supervisor::release`].
    pub fn hold_down(&mut self, w: &mut World) {
        self.down = true;
        if let Some(mut gw) = w.take_gateway() {
            gw.kill();
        }
    }

    /// Ends a [`Supervisor::hold_down`]: the gateway is started again now. True when it runs.
    pub async fn release(&mut self, w: &mut World) -> bool {
        self.down = false;
        self.next_restart = None;
        self.supervise(w).await;
        w.has_gateway()
    }

    /// Sends `cmd` once to the control socket, whatever runs (a disarm after the gateway may
    /// have exited or been replaced: nothing is then armed).
    pub async fn control_once(&self, cmd: &str) -> anyhow::Result<String> {
        gateway::fault_control(&self.control, cmd).await
    }

    /// The clients↔gateway path's condition.
    pub fn set_client_condition(&self, c: Condition) {
        self.client_proxy.set_condition(c);
    }

    /// Resets every client↔gateway connection.
    pub fn cut_clients(&self) {
        self.client_proxy.cut();
    }

    /// Makes sure a gateway runs before a fault that acts on it starts: one that exited or is
    /// being restarted is started now (bounded by [`GATEWAY_BACK_WITHIN`]). Err when none could
    /// be: the fault cannot start, and the run is then an ERROR.
    pub async fn ensure_gateway(&mut self, w: &mut World) -> anyhow::Result<()> {
        let deadline = Instant::now() + GATEWAY_BACK_WITHIN;
        loop {
            if w.gateway_up() {
                return Ok(());
            }
            anyhow::ensure!(!self.down, "no gateway running: a gw-kill holds it down");
            anyhow::ensure!(
                Instant::now() < deadline,
                "no gateway running: it could not be started again within {GATEWAY_BACK_WITHIN:?}"
            );
            self.next_restart = None;
            let left = deadline.saturating_duration_since(Instant::now());
            let _ = tokio::time::timeout(left, self.supervise(w)).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends `cmd` to the gateway's fault control socket once a gateway runs
    /// ([`ensure_gateway`]); a gateway that has just started may not listen on it yet, so a
    /// refused command is tried again until [`GATEWAY_BACK_WITHIN`] passed.
    pub async fn control(&mut self, w: &mut World, cmd: &str) -> anyhow::Result<String> {
        let deadline = Instant::now() + GATEWAY_BACK_WITHIN;
        loop {
            self.ensure_gateway(w).await?;
            match gateway::fault_control(&self.control, cmd).await {
                Ok(r) => return Ok(r),
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    pub fn signal_gateway(&self, w: &World, sig: nix::sys::signal::Signal) -> anyhow::Result<()> {
        let pid = w.gateway_pid().context("no gateway running")?;
        let pid = nix::unistd::Pid::from_raw(i32::try_from(pid)?);
        nix::sys::signal::kill(pid, sig).with_context(|| format!("kill({pid}, {sig})"))
    }
}
