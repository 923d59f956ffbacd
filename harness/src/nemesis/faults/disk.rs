//! The disk package (issue 21): faults of the database's disk, through the LazyFS layer a
//! schedule with one of them runs its cluster on. `fsync` failing with `EIO` (the unsynced
//! pages thrown away, as Linux after a failed writeback), a full disk (writes that would
//! extend a file fail with `ENOSPC`), a slow `fsync`, and a power cut that tears the last
//! unsynced page.
//!
//! PostgreSQL PANICs on a failed `fsync`, and when its crash recovery fails on the same disk
//! the postmaster exits for good: the fault's end then starts it again, as its service
//! manager would, and every end waits (bounded) until the database answers and any crash
//! recovery the fault caused is over, so what follows is judged on a database that runs.
//!
//! Must not: touch the gateway process or the network.

use super::{Drawn, FaultCtx, Package, Targets};
use crate::lazyfs::DiskFaults;
use crate::nemesis::rng::Rng;
use crate::pg::Aftermath;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::time::Duration;

/// How long a disk fault's end waits for the database to answer again.
const BACK_WITHIN: Duration = Duration::from_secs(20);
/// How long a disk fault's end waits for the PANIC a failed `fsync` owes (the failing
/// process logs it as soon as it runs again; on a loaded machine that may take a while).
const PANIC_GRACE: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum DiskFault {
    /// Every `fsync` fails with `EIO` from `at_ms` to `end_ms`, the file's unsynced pages
    /// thrown away.
    DiskEio,
    /// Writes that would extend a file fail with `ENOSPC` from `at_ms` to `end_ms`.
    DiskEnospc,
    /// Every `fsync` is answered `delay_ms` late from `at_ms` to `end_ms`.
    DiskSlowFsync { delay_ms: u64 },
    /// A power cut at `at_ms` that first half writes the last page written and not synced
    /// (a torn write); started again (recovery) at `end_ms`.
    DiskTornPowerCut,
}

const KINDS: &[&str] = &[
    "disk-eio",
    "disk-enospc",
    "disk-slow-fsync",
    "disk-torn-power-cut",
];

impl Package for DiskFault {
    fn kinds() -> Vec<&'static str> {
        KINDS.to_vec()
    }

    fn draw(name: &str, r: &mut Rng, _on: &Targets) -> Option<Drawn<Self>> {
        let kind = match name {
            "disk-eio" => DiskFault::DiskEio,
            "disk-enospc" => DiskFault::DiskEnospc,
            "disk-slow-fsync" => DiskFault::DiskSlowFsync {
                delay_ms: r.range(50, 500),
            },
            "disk-torn-power-cut" => DiskFault::DiskTornPowerCut,
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
            DiskFault::DiskEio => "disk-eio",
            DiskFault::DiskEnospc => "disk-enospc",
            DiskFault::DiskSlowFsync { .. } => "disk-slow-fsync",
            DiskFault::DiskTornPowerCut => "disk-torn-power-cut",
        }
    }

    /// The database, as a crash holds it: a power cut or a crash would end the disk fault
    /// (a new boot), and nothing that needs the database starts during one.
    fn resource(&self, _target: &str) -> Option<String> {
        Some("postgres".into())
    }

    fn requires(&self, _target: &str) -> Vec<String> {
        Vec::new()
    }

    fn validate(&self) -> anyhow::Result<()> {
        if let DiskFault::DiskSlowFsync { delay_ms } = self {
            anyhow::ensure!(
                (1..=5000).contains(delay_ms),
                "disk-slow-fsync delay_ms {delay_ms} is not within 1..=5000"
            );
        }
        Ok(())
    }

    fn needs_lazyfs(&self) -> bool {
        true
    }

    fn leaves_the_sweep_alone(&self) -> bool {
        false
    }
}

impl DiskFault {
    pub async fn start(&self, cx: &mut FaultCtx<'_>, _target: &str) -> anyhow::Result<Value> {
        let faults = match self {
            DiskFault::DiskEio => DiskFaults {
                fsync_eio: true,
                ..Default::default()
            },
            DiskFault::DiskEnospc => DiskFaults {
                enospc: true,
                ..Default::default()
            },
            DiskFault::DiskSlowFsync { delay_ms } => DiskFaults {
                fsync_delay_ms: *delay_ms,
                ..Default::default()
            },
            DiskFault::DiskTornPowerCut => {
                let cut = cx.power_cut_pg_torn().await?;
                return Ok(json!({"pages_dropped": cut.pages_dropped,
                    "files_dropped": cut.files_dropped, "pages_torn": cut.pages_torn}));
            }
        };
        cx.set_disk_faults(faults)?;
        Ok(json!({"faults": faults}))
    }

    pub async fn end(&self, cx: &mut FaultCtx<'_>, _target: &str) -> anyhow::Result<Value> {
        match self {
            DiskFault::DiskTornPowerCut => cx.restart_pg().await?,
            _ => cx.set_disk_faults(DiskFaults::default())?,
        }
        let (waited, restarts, after) = back(cx).await?;
        Ok(
            json!({"postgres_restarts": restarts, "answered_after_ms": waited,
            "aftermath": after.map(|a| format!("{a:?}"))}),
        )
    }
}

/// Waits (at most [`BACK_WITHIN`]) until the database answers a query and any crash the
/// fault caused is over, starting the postmaster again whenever it is found gone (a crash
/// recovery that failed on the faulty disk, even one that fails after the fault ended, ends
/// it for good). "Answers" alone is not enough: PostgreSQL PANICs on a failed `fsync`, and
/// until the postmaster has ended every backend, one that did not fail still answers; a
/// crash recovery then follows the fault's end, and what the run does in it would be judged
/// as if the database were up ([`Aftermath`]). A PANIC owed by a failed `fsync` and not yet
/// logged is waited for [`PANIC_GRACE`] at most: not every `fsync` PostgreSQL makes is one
/// it PANICs on. Returns the wait (ms), the restarts it made and the last aftermath seen.
async fn back(cx: &mut FaultCtx<'_>) -> anyhow::Result<(u64, u32, Option<Aftermath>)> {
    let t = std::time::Instant::now();
    let mut restarts = 0;
    let mut last = String::new();
    while t.elapsed() < BACK_WITHIN {
        if !cx.pg_running() {
            cx.restart_pg().await?;
            restarts += 1;
        }
        let after = cx.disk_fault_aftermath();
        let settled = match after {
            None | Some(Aftermath::Over) => true,
            Some(Aftermath::PanicOwed) => t.elapsed() >= PANIC_GRACE,
            Some(Aftermath::Recovering) => false,
        };
        match cx.pg_answers(Duration::from_secs(1)).await {
            Ok(()) if settled => return Ok((t.elapsed().as_millis() as u64, restarts, after)),
            Ok(()) => last = format!("answers, but the crash is not over ({after:?})"),
            Err(e) => last = format!("{e:#}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!(
        "the database did not answer within {BACK_WITHIN:?} after a disk fault ({restarts} \
         restart(s)); last: {last}"
    )
}
