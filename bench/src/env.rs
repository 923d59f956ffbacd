//! The environment block of the result (where and on what the figures were taken) and the
//! binaries the bench runs: the release gateway without fault points, the debug gateway with
//! them (repair only), and pgbench. A missing, stale or wrongly built binary is an error
//! that says which `cargo build` fixes it.

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root and the cargo target directory: the harness's look-up.
pub use harness::gateway::{target_dir, workspace_dir};

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Environment {
    /// `SHOW server_version` of the bench's cluster.
    pub postgres_version: String,
    /// Durability settings of that cluster (the harness's: both `on`).
    pub fsync: String,
    pub synchronous_commit: String,
    pub full_page_writes: String,
    pub wal_sync_method: String,
    pub shared_buffers: String,
    pub max_connections: String,
    /// Whether `pg_stat_statements` was loaded (per-statement DB time in the result).
    pub pg_stat_statements: bool,
    /// `git rev-parse HEAD` of the workspace, or `unknown`.
    pub git_commit: String,
    /// Files `git status --porcelain` lists (uncommitted changes the run included).
    pub git_dirty_files: u64,
    /// RFC 3339 UTC.
    pub started_at: String,
    pub finished_at: String,
    /// Wall time of the whole run, seconds.
    pub wall_s: f64,
    /// `available_parallelism()`.
    pub host_cores: u64,
    /// `model name` of /proc/cpuinfo.
    pub cpu_model: String,
    pub mem_total_mb: u64,
    /// `/proc/sys/kernel/osrelease`.
    pub kernel: String,
    /// `/proc/loadavg` (1, 5, 15 minutes) when the run started and when it ended.
    pub load_avg_start: [f64; 3],
    pub load_avg_end: [f64; 3],
    /// The gateway of the send, fan-out and sweep parts and its `version` line.
    pub gateway_bin: String,
    pub gateway_version: String,
    /// Extra gateway variables given with `--gateway-env` (empty: the gateway's defaults).
    pub gateway_env: Vec<String>,
    /// The gateway of the repair part (debug build with fault points).
    pub fault_gateway_bin: String,
    pub fault_gateway_version: String,
    /// pgbench used for the send-path ceiling (`none` when not found).
    pub pgbench_bin: String,
    pub pgbench_version: String,
    /// How the bench itself was compiled: `release` or `debug`.
    pub bench_build: String,
    /// The clock note: how latencies across processes are compared.
    pub clock: String,
}

pub fn load_avg() -> [f64; 3] {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let v: Vec<f64> = text
        .split_whitespace()
        .take(3)
        .filter_map(|s| s.parse().ok())
        .collect();
    [
        v.first().copied().unwrap_or(0.0),
        v.get(1).copied().unwrap_or(0.0),
        v.get(2).copied().unwrap_or(0.0),
    ]
}

fn cmd_out(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Fills what does not need the database.
pub fn host() -> Environment {
    let ws = workspace_dir();
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kb: u64 = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Environment {
        git_commit: cmd_out(
            Command::new("git")
                .arg("-C")
                .arg(&ws)
                .args(["rev-parse", "HEAD"]),
        )
        .unwrap_or_else(|| "unknown".into()),
        git_dirty_files: cmd_out(
            Command::new("git")
                .arg("-C")
                .arg(&ws)
                .args(["status", "--porcelain"]),
        )
        .map(|s| s.lines().filter(|l| !l.trim().is_empty()).count() as u64)
        .unwrap_or(0),
        started_at: crate::util::rfc3339(crate::util::unix_us() / 1_000_000),
        host_cores: std::thread::available_parallelism()
            .map(|n| n.get() as u64)
            .unwrap_or(0),
        cpu_model: cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split(':').nth(1))
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
        mem_total_mb: mem_kb / 1024,
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string(),
        load_avg_start: load_avg(),
        bench_build: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
        .into(),
        clock: "latencies inside one process use a monotonic clock; push latency compares the \
                receiver's clock with the event's `at` (PostgreSQL clock_timestamp() at INSERT, \
                whole ms) on the same machine"
            .into(),
        pgbench_bin: "none".into(),
        ..Environment::default()
    }
}

/// Reads the PostgreSQL side of the environment from the cluster.
pub async fn fill_postgres(env: &mut Environment, cluster: &harness::pg::Cluster) {
    env.postgres_version = cluster
        .server_version()
        .await
        .unwrap_or_else(|e| format!("error: {e:#}"));
    for (name, slot) in [
        ("fsync", &mut env.fsync),
        ("synchronous_commit", &mut env.synchronous_commit),
        ("full_page_writes", &mut env.full_page_writes),
        ("wal_sync_method", &mut env.wal_sync_method),
        ("shared_buffers", &mut env.shared_buffers),
        ("max_connections", &mut env.max_connections),
    ] {
        *slot = cluster
            .setting(name)
            .await
            .unwrap_or_else(|e| format!("error: {e:#}"));
    }
}

/// `im-gateway version`, e.g. `im-gateway 0.1.0 faults=off`.
pub fn gateway_version(bin: &Path) -> anyhow::Result<String> {
    let out = Command::new(bin)
        .arg("version")
        .env_clear()
        .output()
        .with_context(|| format!("run {} version", bin.display()))?;
    if !out.status.success() {
        bail!("{} version failed ({})", bin.display(), out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Checks a gateway binary: it exists, is not older than the gateway's sources, and was
/// built with (`Some(true)`) or without (`Some(false)`) the fault points (`None`: either).
/// Returns its `version` line.
pub fn check_gateway(
    bin: &Path,
    want_faults: Option<bool>,
    build_hint: &str,
) -> anyhow::Result<String> {
    let built = std::fs::metadata(bin)
        .and_then(|m| m.modified())
        .map_err(|e| anyhow::anyhow!("{} not found ({e}): run `{build_hint}`", bin.display()))?;
    // The harness's staleness rule, on this binary.
    if let Some((newest, src)) = harness::gateway::newest_source()? {
        if newest > built {
            bail!(
                "{} is stale: {} is newer: run `{build_hint}`",
                bin.display(),
                src.display()
            );
        }
    }
    let version = gateway_version(bin)?;
    let faults_on = version.contains("faults=on");
    if let Some(want) = want_faults.filter(|w| *w != faults_on) {
        bail!(
            "{} says `{version}` but this part needs faults={}: run `{build_hint}`",
            bin.display(),
            if want { "on" } else { "off" }
        );
    }
    Ok(version)
}

/// pgbench: on PATH, or in the newest `/usr/lib/postgresql/*/bin`.
pub fn find_pgbench() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"))
        .collect();
    dirs.sort_by_key(|d| {
        d.parent()
            .and_then(|p| p.file_name())
            .and_then(|n| n.to_str())
            .and_then(|n| n.parse::<u32>().ok())
            .unwrap_or(0)
    });
    dirs.reverse();
    if let Some(path) = std::env::var_os("PATH") {
        dirs.extend(std::env::split_paths(&path));
    }
    dirs.into_iter()
        .map(|d| d.join("pgbench"))
        .find(|p| p.is_file())
}

pub fn pgbench_version(bin: &Path) -> String {
    cmd_out(Command::new(bin).arg("--version")).unwrap_or_else(|| "unknown".into())
}
