//! The gateways under a nemesis run: one gateway process (or 2–3 behind HAProxy,
//! `--gateways N`) kept running behind the clients' proxy, each started again when it exits
//! (a crash point fired) unless a `gw-kill` holds it down, and each one's fault control
//! socket through which faults are armed.
//!
//! Owns: each gateway's options, control socket path, whether it is held down and when a
//! failed start may be tried again; the clients' route to the gateways (the clients' proxy,
//! and the balancer behind it when there are several). The [`World`] owns the processes;
//! only this type replaces or drops them during a run.
//!
//! Must not: decide which faults happen (the schedule does) or judge anything.

use crate::balancer::Balancer;
use crate::gateway::{self, GatewayOpts};
use crate::proxy::{Condition, Proxy};
use crate::world::World;
use anyhow::Context;
use im_check::history::Action;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// One supervised gateway.
struct Slot {
    opts: GatewayOpts,
    control: PathBuf,
    /// A `gw-kill` holds it down until its end.
    down: bool,
    /// When a failed start may be tried again.
    next_restart: Option<Instant>,
}

/// Keeps the run's gateways running behind the clients' proxy.
pub struct Supervisor {
    slots: Vec<Slot>,
    /// The clients' proxy (whose condition the `net-client` faults set): it forwards to the
    /// one gateway, or to the balancer in front of several.
    proxy: Proxy,
    /// With several gateways, HAProxy (server `gwI` is gateway I): a restarted gateway is
    /// pointed at through its runtime API. With one, the proxy is switched to it.
    balancer: Option<Balancer>,
    gateway_starts: u64,
}

/// How long a gateway fault's start waits for a gateway that is being started again (after
/// a crash point fired, or while its restart waits for the database).
const GATEWAY_BACK_WITHIN: Duration = Duration::from_secs(3);

/// A gateway's start (what [`Supervisor::new`] and [`Supervisor::start_more`] are given):
/// its options and its control socket (`IM_FAULT_CONTROL` in `opts.env`).
pub struct Started {
    pub opts: GatewayOpts,
    pub control: PathBuf,
}

impl Supervisor {
    /// The supervisor of the world's gateway 0 (already started with `first.opts`), the
    /// clients reaching it through a controlled proxy.
    pub fn new(w: &World, first: Started) -> anyhow::Result<Supervisor> {
        let proxy = Proxy::start_controlled(w.gateways.at(0).addr())?;
        Ok(Supervisor {
            slots: vec![Slot {
                opts: first.opts,
                control: first.control,
                down: false,
                next_restart: None,
            }],
            proxy,
            balancer: None,
            gateway_starts: 1,
        })
    }

    /// Starts the `more` gateways (1, 2, …) on the world's database and puts all of them
    /// behind HAProxy, which the clients' proxy then forwards to.
    pub async fn start_more(&mut self, w: &mut World, more: Vec<Started>) -> anyhow::Result<()> {
        if more.is_empty() {
            return Ok(());
        }
        for s in more {
            let i = w.start_gateway(s.opts.clone()).await?;
            anyhow::ensure!(i == self.slots.len(), "gateway {i} started out of order");
            self.gateway_starts += 1;
            self.slots.push(Slot {
                opts: s.opts,
                control: s.control,
                down: false,
                next_restart: None,
            });
        }
        let addrs: Vec<_> = (0..self.slots.len())
            .map(|i| w.gateways.at(i).addr())
            .collect();
        let balancer = Balancer::start(&addrs).await?;
        self.proxy.switch(balancer.addr());
        self.balancer = Some(balancer);
        Ok(())
    }

    /// The clients' address.
    pub fn ws_url(&self) -> String {
        format!("ws://{}/ws", self.proxy.addr())
    }

    /// How many gateways run under it.
    pub fn gateways(&self) -> usize {
        self.slots.len()
    }

    /// The gateway a fault's target names (`gateway`, `gateway-I`), if this run has it.
    pub fn index_of(&self, target: &str) -> anyhow::Result<usize> {
        let i = super::targets::gateway_index(target)?;
        anyhow::ensure!(
            i < self.slots.len(),
            "{target}: this run has {} gateway(s)",
            self.slots.len()
        );
        Ok(i)
    }

    /// During the heal nothing may stay armed, yet an `arm` the harness gave up on (it
    /// timed out while the gateway was paused: seed 248 of a 1,000-seed run) can still take
    /// effect once the gateway runs again, after that fault's end disarmed it: its command
    /// waited in the control socket. Anything armed now is recorded and disarmed.
    pub async fn disarm_stale(&self, w: &World) {
        for (i, slot) in self.slots.iter().enumerate() {
            if !w.gateways.has_at(i) {
                continue;
            }
            let Ok(listed) = gateway::fault_control(&slot.control, "list").await else {
                continue;
            };
            let armed = listed.trim_start_matches("ok").trim();
            if armed.is_empty() {
                continue;
            }
            let r = gateway::fault_control(&slot.control, "disarm all").await;
            w.history().nemesis_instant(Action::StaleFaultDisarmed {
                armed: armed.to_string(),
                disarm: r.unwrap_or_else(|e| format!("{e:#}")),
            });
        }
    }

    /// Restarts every gateway that exited (a crash point fired) or is missing, unless a
    /// `gw-kill` holds it down. A start that fails (the database is away) is retried.
    pub async fn supervise(&mut self, w: &mut World) {
        for i in 0..self.slots.len() {
            self.supervise_one(w, i).await;
        }
    }

    async fn supervise_one(&mut self, w: &mut World, i: usize) {
        if self.slots[i].down {
            return;
        }
        if w.gateways.has_at(i) {
            let Some(status) = w.gateways.take_exited_at(i) else {
                return;
            };
            w.history().nemesis_instant(Action::GatewayExit {
                // One gateway's history reads as it always did.
                gateway: (self.slots.len() > 1).then_some(i),
                status: status.code(),
                raw: status.to_string(),
            });
        }
        if self.slots[i]
            .next_restart
            .is_some_and(|t| Instant::now() < t)
        {
            return;
        }
        match w.restart_gateway_at(i, self.slots[i].opts.clone()).await {
            Ok(()) => {
                self.gateway_starts += 1;
                self.slots[i].next_restart = None;
                let addr = w.gateways.at(i).addr();
                match &self.balancer {
                    None => self.proxy.switch(addr),
                    Some(b) => {
                        if let Err(e) = b.set_server(i, addr).await {
                            // Its health checks keep it DOWN: the clients go to the others.
                            tracing::warn!(error = %format!("{e:#}"), gateway = i, "nemesis: balancer not pointed at the restarted gateway");
                        }
                    }
                }
            }
            Err(e) => {
                tracing::info!(error = %format!("{e:#}"), gateway = i, "nemesis: gateway start failed; retrying");
                w.gateways.take_at(i);
                self.slots[i].next_restart = Some(Instant::now() + Duration::from_millis(200));
            }
        }
    }

    /// Gateways started so far, the first ones included.
    pub fn gateway_starts(&self) -> u64 {
        self.gateway_starts
    }

    /// Whether every gateway runs.
    pub fn all_up(&self, w: &mut World) -> bool {
        (0..self.slots.len()).all(|i| w.gateways.up_at(i))
    }

    /// Kills gateway `i` (SIGKILL) and holds it down until [`Supervisor::release`].
    pub fn hold_down(&mut self, w: &mut World, i: usize) {
        self.slots[i].down = true;
        if let Some(mut gw) = w.gateways.take_at(i) {
            gw.kill();
        }
    }

    /// Ends a [`Supervisor::hold_down`]: gateway `i` is started again now. True when it
    /// runs.
    pub async fn release(&mut self, w: &mut World, i: usize) -> bool {
        self.slots[i].down = false;
        self.slots[i].next_restart = None;
        self.supervise_one(w, i).await;
        w.gateways.has_at(i)
    }

    /// Sends `cmd` once to gateway `i`'s control socket, whatever runs (a disarm after the
    /// gateway may have exited or been replaced: nothing is then armed).
    pub async fn control_once(&self, i: usize, cmd: &str) -> anyhow::Result<String> {
        gateway::fault_control(&self.slots[i].control, cmd).await
    }

    /// The clients↔gateways path's condition.
    pub fn set_client_condition(&self, c: Condition) {
        self.proxy.set_condition(c);
    }

    /// Resets every client↔gateway connection.
    pub fn cut_clients(&self) {
        self.proxy.cut();
    }

    /// Makes sure gateway `i` runs before a fault that acts on it starts: one that exited or
    /// is being restarted is started now (bounded by [`GATEWAY_BACK_WITHIN`]). Err when it
    /// could not be: the fault cannot start, and the run is then an ERROR.
    pub async fn ensure_gateway(&mut self, w: &mut World, i: usize) -> anyhow::Result<()> {
        let deadline = Instant::now() + GATEWAY_BACK_WITHIN;
        loop {
            if w.gateways.up_at(i) {
                return Ok(());
            }
            anyhow::ensure!(
                !self.slots[i].down,
                "gateway {i} not running: a gw-kill holds it down"
            );
            anyhow::ensure!(
                Instant::now() < deadline,
                "gateway {i} not running: it could not be started again within {GATEWAY_BACK_WITHIN:?}"
            );
            self.slots[i].next_restart = None;
            let left = deadline.saturating_duration_since(Instant::now());
            let _ = tokio::time::timeout(left, self.supervise_one(w, i)).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends `cmd` to gateway `i`'s fault control socket once it runs ([`ensure_gateway`]);
    /// a gateway that has just started may not listen on it yet, so a refused command is
    /// tried again until [`GATEWAY_BACK_WITHIN`] passed.
    pub async fn control(&mut self, w: &mut World, i: usize, cmd: &str) -> anyhow::Result<String> {
        let deadline = Instant::now() + GATEWAY_BACK_WITHIN;
        loop {
            self.ensure_gateway(w, i).await?;
            match gateway::fault_control(&self.slots[i].control, cmd).await {
                Ok(r) => return Ok(r),
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// Sends `sig` to gateway `i`.
    pub fn signal_gateway(
        &self,
        w: &World,
        i: usize,
        sig: nix::sys::signal::Signal,
    ) -> anyhow::Result<()> {
        let pid = w
            .gateways
            .pid_at(i)
            .with_context(|| format!("gateway {i} not running"))?;
        let pid = nix::unistd::Pid::from_raw(i32::try_from(pid)?);
        nix::sys::signal::kill(pid, sig).with_context(|| format!("kill({pid}, {sig})"))
    }
}
