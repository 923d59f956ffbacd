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
//! A failover ends the primary's lineage: at most one per schedule, and no fault that needs
//! the LazyFS layer starts after it (the promoted standby does not run on one)
//! ([`Package::ends_the_primary`]). It holds the database from the kill to the promotion.
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
}

const KINDS: &[&str] = &["pg-failover-async", "pg-failover-sync"];

impl Package for FailoverFault {
    fn kinds() -> Vec<&'static str> {
        KINDS.to_vec()
    }

    fn draw(name: &str, _r: &mut Rng, _on: &Targets) -> Option<Drawn<Self>> {
        let kind = match name {
            "pg-failover-async" => FailoverFault::PgFailoverAsync,
            "pg-failover-sync" => FailoverFault::PgFailoverSync,
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
        }
    }

    /// The database, from the kill to the promotion.
    fn resource(&self, _target: &str) -> Option<String> {
        Some("postgres".into())
    }

    fn requires(&self, _target: &str) -> Vec<String> {
        Vec::new()
    }

    fn needs_standby(&self) -> Option<bool> {
        Some(*self == FailoverFault::PgFailoverSync)
    }

    fn ends_the_primary(&self) -> bool {
        true
    }

    fn leaves_the_sweep_alone(&self) -> bool {
        false
    }
}

impl FailoverFault {
    pub async fn start(&self, cx: &mut FaultCtx<'_>, _target: &str) -> anyhow::Result<Value> {
        cx.w.kill_primary().await?;
        Ok(json!({"primary_killed": true}))
    }

    pub async fn end(&self, cx: &mut FaultCtx<'_>, _target: &str) -> anyhow::Result<Value> {
        Ok(json!({"promoted": cx.w.promote_standby().await?}))
    }
}
