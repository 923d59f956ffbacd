//! The failover package (issue 21, item 2): the primary's machine dies and its streaming
//! standby is promoted, the database address moving to it. A schedule with one runs its
//! cluster with a standby (asynchronous through a 50 ms replication link, or synchronous
//! through 10 ms: [`Package::needs_standby`]), provisioned and caught up before the clock
//! starts.
//!
//! - `pg-failover-async`: an asynchronous standby is behind its primary, so acknowledged
//!   messages may be lost; that is the configuration's contract, and the checker reports
//!   them as the run's expected loss, not as anomalies. What it must never leave is a device
//!   silently wrong: the new lineage moves every epoch (migration 0006) and devices
//!   reconcile (`held-lost` otherwise).
//! - `pg-failover-sync`: a synchronous standby has every acknowledged commit: nothing may be
//!   lost.
//!
//! - `pg-autofailover`: the database is a pg_auto_failover formation (monitor, primary,
//!   secondary: `crate::autofailover`) behind an address that follows the monitor; the
//!   primary's machine dies, and detecting it and promoting the secondary are the
//!   monitor's decisions. The fault ends when the monitor named the new primary (30 s at
//!   most, else the run is an ERROR). What may be lost follows the replication mode
//!   pg_auto_failover chose, read from the primary at the kill and recorded.
//! - `pg-autofailover-monitor`: the formation loses its monitor (every process SIGKILLed)
//!   and gets it back at the end: the data nodes run on, nothing fails over, nothing may be
//!   lost, and the database stays available.
//!
//! A failover ends the primary's lineage: at most one per schedule, and no fault that needs
//! the LazyFS layer starts after it (the promoted standby does not run on one)
//! ([`Package::ends_the_primary`]). It holds the database from the kill to the promotion.
//! A formation's kinds ([`Package::needs_formation`]) share no schedule with the kinds
//! that act on a cluster the harness runs itself ([`Package::needs_own_cluster`]).
//!
//! Must not: touch the gateway process or the network.

use super::{Drawn, FaultCtx, Package, Targets};
use crate::nemesis::rng::Rng;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum FailoverFault {
    /// At `at_ms` the primary's machine dies (its replication link cut, every process
    /// SIGKILLed); at `end_ms` the asynchronous standby is promoted and the address moves.
    PgFailoverAsync,
    /// The same with a synchronous standby.
    PgFailoverSync,
    /// At `at_ms` a pg_auto_failover formation's primary dies; the fault ends once its
    /// monitor named the promoted secondary (at or after `end_ms`).
    PgAutofailover,
    /// At `at_ms` the formation's monitor dies; at `end_ms` it is started again.
    PgAutofailoverMonitor,
}

const KINDS: &[&str] = &[
    "pg-failover-async",
    "pg-failover-sync",
    "pg-autofailover",
    "pg-autofailover-monitor",
];

/// How long the end of `pg-autofailover` waits for the monitor's promotion (measured in
/// `06-failover-pg-auto-failover`: about 4 s with the tuning of `crate::autofailover`).
const PROMOTION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

impl Package for FailoverFault {
    fn kinds() -> Vec<&'static str> {
        KINDS.to_vec()
    }

    fn draw(name: &str, _r: &mut Rng, _on: &Targets) -> Option<Drawn<Self>> {
        let kind = match name {
            "pg-failover-async" => FailoverFault::PgFailoverAsync,
            "pg-failover-sync" => FailoverFault::PgFailoverSync,
            "pg-autofailover" => FailoverFault::PgAutofailover,
            "pg-autofailover-monitor" => FailoverFault::PgAutofailoverMonitor,
            _ => return None,
        };
        Some(Drawn {
            kind,
            target: "postgres".into(),
            instant: false,
        })
    }

    fn name(&self) -> &'static str {
        match self {
            FailoverFault::PgFailoverAsync => "pg-failover-async",
            FailoverFault::PgFailoverSync => "pg-failover-sync",
            FailoverFault::PgAutofailover => "pg-autofailover",
            FailoverFault::PgAutofailoverMonitor => "pg-autofailover-monitor",
        }
    }

    /// The database, from the kill to the promotion (the monitor's loss too: a primary
    /// lost while the monitor is down would fail over only once it is back).
    fn resource(&self, _target: &str) -> Option<String> {
        Some("postgres".into())
    }

    fn requires(&self, _target: &str) -> Vec<String> {
        Vec::new()
    }

    fn needs_standby(&self) -> Option<bool> {
        match self {
            FailoverFault::PgFailoverAsync => Some(false),
            FailoverFault::PgFailoverSync => Some(true),
            FailoverFault::PgAutofailover | FailoverFault::PgAutofailoverMonitor => None,
        }
    }

    fn needs_formation(&self) -> bool {
        matches!(
            self,
            FailoverFault::PgAutofailover | FailoverFault::PgAutofailoverMonitor
        )
    }

    fn ends_the_primary(&self) -> bool {
        *self != FailoverFault::PgAutofailoverMonitor
    }

    fn leaves_the_sweep_alone(&self) -> bool {
        false
    }
}

impl FailoverFault {
    pub async fn start(&self, cx: &mut FaultCtx<'_>, _target: &str) -> anyhow::Result<Value> {
        match self {
            FailoverFault::PgFailoverAsync | FailoverFault::PgFailoverSync => {
                cx.kill_primary().await?;
                Ok(json!({"primary_killed": true}))
            }
            FailoverFault::PgAutofailover => {
                Ok(json!({"primary_killed": cx.formation_kill_primary().await?}))
            }
            FailoverFault::PgAutofailoverMonitor => {
                Ok(json!({"monitor_killed": cx.formation_kill_monitor().await?}))
            }
        }
    }

    pub async fn end(&self, cx: &mut FaultCtx<'_>, _target: &str) -> anyhow::Result<Value> {
        match self {
            FailoverFault::PgFailoverAsync | FailoverFault::PgFailoverSync => {
                Ok(json!({"promoted": cx.promote_standby().await?}))
            }
            FailoverFault::PgAutofailover => Ok(json!({
                "promoted": cx.formation_promoted(PROMOTION_TIMEOUT).await?
            })),
            FailoverFault::PgAutofailoverMonitor => Ok(json!({
                "monitor_restarted": cx.formation_restart_monitor().await?
            })),
        }
    }
}
