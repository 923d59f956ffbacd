//! What a fault may act on, and nothing more (issue 43): the fault packages reach the run
//! through [`FaultCtx`]'s methods, never through `World`'s own. The database side (the
//! cluster, its disk layer, its failover topology, the gateways' path to it), the gateway
//! side (the supervisor's processes, control sockets and the clients' path to them) and each
//! device's crash switch. Clients, the history, the admin's writes and the judge are out of
//! a fault's reach.

use std::time::Duration;

use anyhow::Context as _;
use serde_json::Value;

use super::CrashSwitches;
use crate::lazyfs::{Cut, DiskFaults};
use crate::nemesis::supervisor::Supervisor;
use crate::pg::Aftermath;
use crate::proxy::{Condition, Proxy};
use crate::world::World;

/// What a fault's `start` and `end` act on.
pub struct FaultCtx<'a> {
    w: &'a mut World,
    sup: &'a mut Supervisor,
    crash_switches: &'a CrashSwitches,
}

impl<'a> FaultCtx<'a> {
    pub fn new(
        w: &'a mut World,
        sup: &'a mut Supervisor,
        crash_switches: &'a CrashSwitches,
    ) -> FaultCtx<'a> {
        FaultCtx {
            w,
            sup,
            crash_switches,
        }
    }
}

/// The database side.
impl FaultCtx<'_> {
    /// `pg_ctl -m immediate`.
    pub async fn crash_pg(&mut self) -> anyhow::Result<()> {
        self.w.crash_pg().await
    }

    /// Starts the (crashed or stopped) database again.
    pub async fn restart_pg(&mut self) -> anyhow::Result<()> {
        self.w.restart_pg().await
    }

    /// SIGSTOP to the postmaster and its backends.
    pub fn pause_pg(&mut self) -> anyhow::Result<()> {
        self.w.pg.pause()
    }

    /// Ends [`FaultCtx::pause_pg`].
    pub fn resume_pg(&mut self) -> anyhow::Result<()> {
        self.w.pg.resume()
    }

    /// Whether the postmaster runs.
    pub fn pg_running(&mut self) -> bool {
        self.w.pg.is_running()
    }

    /// A power cut: unsynced writes thrown away (LazyFS).
    pub async fn power_cut_pg(&mut self) -> anyhow::Result<Cut> {
        self.w.power_cut_pg().await
    }

    /// A power cut that also tears the last unsynced page.
    pub async fn power_cut_pg_torn(&mut self) -> anyhow::Result<Cut> {
        self.w.power_cut_pg_torn().await
    }

    /// The disk faults in force on the database's LazyFS layer.
    pub fn set_disk_faults(&mut self, faults: DiskFaults) -> anyhow::Result<()> {
        self.w.pg.set_disk_faults(faults)
    }

    /// Where the database is in the aftermath of the last disk faults.
    pub fn disk_fault_aftermath(&self) -> Option<Aftermath> {
        self.w.pg.disk_fault_aftermath()
    }

    /// Whether the database answers `SELECT 1` within `within`.
    pub async fn pg_answers(&self, within: Duration) -> anyhow::Result<()> {
        let admin = &self.w.admin;
        let ok = async {
            let pool = admin.pool().await?;
            sqlx::query("SELECT 1").execute(&pool).await?;
            anyhow::Ok(())
        };
        tokio::time::timeout(within, ok)
            .await
            .map_err(|_| anyhow::anyhow!("no answer within {within:?}"))?
    }

    /// The pids of the gateways' backends (`application_name` `im-gateway-<i>`): the
    /// LISTEN ones or the others, read within `within`.
    pub async fn gateway_backends(
        &self,
        listen: bool,
        within: Duration,
    ) -> anyhow::Result<Vec<i32>> {
        let pool = tokio::time::timeout(within, self.w.admin.pool())
            .await
            .context("the check pool timed out")??;
        let sql = if listen {
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'im-gateway-%' \
             AND query ILIKE 'listen%' ORDER BY pid"
        } else {
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'im-gateway-%' \
             AND query NOT ILIKE 'listen%' ORDER BY pid"
        };
        tokio::time::timeout(within, sqlx::query_scalar(sql).fetch_all(&pool))
            .await
            .context("pg_stat_activity timed out")?
            .context("read pg_stat_activity")
    }

    /// `pg_terminate_backend(pid)`: whether it was terminated.
    pub async fn terminate_backend(&self, pid: i32) -> anyhow::Result<bool> {
        self.w.terminate_backend(pid).await
    }

    /// The proxy on the gateways↔database path.
    pub fn db_proxy(&self) -> anyhow::Result<&Proxy> {
        self.w.db_proxy.as_ref().context("no database proxy")
    }

    /// The primary of a primary/standby pair, killed.
    pub async fn kill_primary(&mut self) -> anyhow::Result<()> {
        self.w.kill_primary().await
    }

    /// The standby promoted.
    pub async fn promote_standby(&mut self) -> anyhow::Result<Value> {
        self.w.promote_standby().await
    }

    /// The formation's primary killed (pg_auto_failover).
    pub async fn formation_kill_primary(&mut self) -> anyhow::Result<Value> {
        self.w.formation_kill_primary().await
    }

    /// Waits until the formation promoted a new primary.
    pub async fn formation_promoted(&mut self, within: Duration) -> anyhow::Result<Value> {
        self.w.formation_promoted(within).await
    }

    /// The formation's monitor killed.
    pub async fn formation_kill_monitor(&mut self) -> anyhow::Result<Value> {
        self.w.formation_kill_monitor().await
    }

    /// The formation's monitor started again.
    pub async fn formation_restart_monitor(&mut self) -> anyhow::Result<Value> {
        self.w.formation_restart_monitor().await
    }
}

/// The gateway side.
impl FaultCtx<'_> {
    /// The gateway a target names (`gateway`, `gateway-1`...).
    pub fn gateway_index(&self, target: &str) -> anyhow::Result<usize> {
        self.sup.index_of(target)
    }

    /// SIGKILL to gateway `i`, held down until [`FaultCtx::release_gateway`].
    pub fn hold_down_gateway(&mut self, i: usize) {
        self.sup.hold_down(self.w, i);
    }

    /// Ends a hold-down: gateway `i` started again now; true when it runs.
    pub async fn release_gateway(&mut self, i: usize) -> bool {
        self.sup.release(self.w, i).await
    }

    /// `cmd` to gateway `i`'s fault control socket once it runs.
    pub async fn control(&mut self, i: usize, cmd: &str) -> anyhow::Result<String> {
        self.sup.control(self.w, i, cmd).await
    }

    /// `cmd` to gateway `i`'s control socket once, whatever runs.
    pub async fn control_once(&self, i: usize, cmd: &str) -> anyhow::Result<String> {
        self.sup.control_once(i, cmd).await
    }

    /// Makes sure gateway `i` runs (started again if it exited).
    pub async fn ensure_gateway(&mut self, i: usize) -> anyhow::Result<()> {
        self.sup.ensure_gateway(self.w, i).await
    }

    /// A signal to gateway `i`.
    pub fn signal_gateway(&self, i: usize, sig: nix::sys::signal::Signal) -> anyhow::Result<()> {
        self.sup.signal_gateway(self.w, i, sig)
    }

    /// The clients↔gateways path's condition.
    pub fn set_client_condition(&self, c: Condition) {
        self.sup.set_client_condition(c);
    }

    /// Resets every client↔gateway connection.
    pub fn cut_clients(&self) {
        self.sup.cut_clients();
    }
}

/// The devices.
impl FaultCtx<'_> {
    /// Turns `device`'s crash switch on or off.
    pub fn switch_device(&self, device: &str, crashed: bool) -> anyhow::Result<()> {
        self.crash_switches
            .get(device)
            .with_context(|| format!("no device {device}"))?
            .send_modify(|s| s.set(crashed));
        Ok(())
    }
}
