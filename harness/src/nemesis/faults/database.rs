//! The database package: faults on PostgreSQL itself (an immediate shutdown, a pause, a
//! power cut through the LazyFS layer) and on the gateway's sessions in it
//! (`pg_terminate_backend` on its LISTEN connection or on pool connections).
//!
//! Must not: touch the gateway process or the network.

use super::{Drawn, FaultCtx, Package, Targets};
use crate::nemesis::rng::Rng;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::time::Duration;

/// Timeout of a harness query during the faults (a paused database answers nothing).
const QUERY_TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum DatabaseFault {
    /// PostgreSQL immediate shutdown at `at_ms`, started again (recovery) at `end_ms`.
    PgCrash,
    /// SIGSTOP every PostgreSQL process at `at_ms`, SIGCONT at `end_ms`.
    PgPause,
    /// A power cut at `at_ms` (the LazyFS layer: every PostgreSQL process killed at once,
    /// writes not yet fsynced thrown away), started again (recovery) at `end_ms`. Needs
    /// FUSE: a schedule with one runs its cluster on the LazyFS layer.
    PgPowerCut,
    /// `pg_terminate_backend` on the gateway's LISTEN connection (instant).
    PgTerminateListen,
    /// `pg_terminate_backend` on `count` of the gateway's other connections (instant).
    PgTerminatePool { count: u64 },
}

const KINDS: &[&str] = &[
    "pg-crash",
    "pg-pause",
    "pg-power-cut",
    "pg-terminate-listen",
    "pg-terminate-pool",
];

impl Package for DatabaseFault {
    fn kinds() -> Vec<&'static str> {
        KINDS.to_vec()
    }

    fn draw(name: &str, r: &mut Rng, _on: &Targets) -> Option<Drawn<Self>> {
        let (kind, instant) = match name {
            "pg-crash" => (DatabaseFault::PgCrash, false),
            "pg-pause" => (DatabaseFault::PgPause, false),
            "pg-power-cut" => (DatabaseFault::PgPowerCut, false),
            "pg-terminate-listen" => (DatabaseFault::PgTerminateListen, true),
            "pg-terminate-pool" => (
                DatabaseFault::PgTerminatePool {
                    count: r.range(1, 4),
                },
                true,
            ),
            _ => return None,
        };
        Some(Drawn {
            kind,
            target: "postgres".into(),
            instant,
        })
    }

    /// The LISTEN connection cut: what is committed until the gateway listens again reaches
    /// its devices only through the regain pass.
    fn tail_kinds() -> Vec<&'static str> {
        vec!["pg-terminate-listen"]
    }

    fn name(&self) -> &'static str {
        match self {
            DatabaseFault::PgCrash => "pg-crash",
            DatabaseFault::PgPause => "pg-pause",
            DatabaseFault::PgPowerCut => "pg-power-cut",
            DatabaseFault::PgTerminateListen => "pg-terminate-listen",
            DatabaseFault::PgTerminatePool { .. } => "pg-terminate-pool",
        }
    }

    fn resource(&self, _target: &str) -> Option<String> {
        match self {
            DatabaseFault::PgCrash | DatabaseFault::PgPause | DatabaseFault::PgPowerCut => {
                Some("postgres".into())
            }
            DatabaseFault::PgTerminateListen | DatabaseFault::PgTerminatePool { .. } => None,
        }
    }

    /// Terminating backends needs the database up.
    fn requires(&self, _target: &str) -> Vec<String> {
        match self {
            DatabaseFault::PgTerminateListen | DatabaseFault::PgTerminatePool { .. } => {
                vec!["postgres".into()]
            }
            _ => Vec::new(),
        }
    }

    fn validate(&self) -> anyhow::Result<()> {
        if let DatabaseFault::PgTerminatePool { count } = self {
            anyhow::ensure!(
                (1..=64).contains(count),
                "pg-terminate-pool count {count} is not within 1..=64"
            );
        }
        Ok(())
    }

    fn needs_lazyfs(&self) -> bool {
        *self == DatabaseFault::PgPowerCut
    }

    /// A crash, a pause and a power cut act on the postmaster the harness runs.
    fn needs_own_cluster(&self) -> bool {
        matches!(
            self,
            DatabaseFault::PgCrash | DatabaseFault::PgPause | DatabaseFault::PgPowerCut
        )
    }

    fn leaves_the_sweep_alone(&self) -> bool {
        false
    }
}

impl DatabaseFault {
    pub async fn start(&self, cx: &mut FaultCtx<'_>, _target: &str) -> anyhow::Result<Value> {
        match self {
            DatabaseFault::PgCrash => {
                cx.crash_pg().await?;
                Ok(json!({"crashed": true}))
            }
            DatabaseFault::PgPause => {
                cx.pause_pg()?;
                Ok(json!({"stopped": true}))
            }
            DatabaseFault::PgPowerCut => {
                let cut = cx.power_cut_pg().await?;
                Ok(json!({"pages_dropped": cut.pages_dropped, "files_dropped": cut.files_dropped}))
            }
            DatabaseFault::PgTerminateListen => {
                let pids = cx.gateway_backends(true, QUERY_TIMEOUT).await?;
                Ok(json!({"terminated": terminate_all(cx, pids).await}))
            }
            DatabaseFault::PgTerminatePool { count } => {
                let mut pids = cx.gateway_backends(false, QUERY_TIMEOUT).await?;
                pids.truncate(*count as usize);
                Ok(json!({"terminated": terminate_all(cx, pids).await}))
            }
        }
    }

    pub async fn end(&self, cx: &mut FaultCtx<'_>, _target: &str) -> anyhow::Result<Value> {
        match self {
            DatabaseFault::PgCrash | DatabaseFault::PgPowerCut => {
                cx.restart_pg().await?;
                Ok(json!({"restarted": true}))
            }
            DatabaseFault::PgPause => {
                cx.resume_pg()?;
                Ok(json!({"continued": true}))
            }
            DatabaseFault::PgTerminateListen | DatabaseFault::PgTerminatePool { .. } => {
                Ok(Value::Null)
            }
        }
    }
}

/// `pg_terminate_backend` on each pid, each bounded (a paused database answers nothing):
/// (pid, whether it was terminated).
async fn terminate_all(cx: &FaultCtx<'_>, pids: Vec<i32>) -> Vec<(i32, bool)> {
    let mut done = Vec::new();
    for pid in pids {
        let ok = matches!(
            tokio::time::timeout(QUERY_TIMEOUT, cx.terminate_backend(pid)).await,
            Ok(Ok(true))
        );
        done.push((pid, ok));
    }
    done
}
