//! CPU accounting from `/proc` (Linux): how much CPU the gateway, PostgreSQL, pgbench and
//! the bench itself used during one run, so a cost can be put on a process and not only on
//! a latency. Read-only; samples are cheap (one `/proc` scan for the postmaster's children).
//!
//! PostgreSQL: the postmaster's own time plus its reaped children's (`cutime`/`cstime`,
//! which covers backends that exited during the run) plus its live children's. The delta of
//! two samples is exact for backends that live across the run, start in it, or end in it.

use serde::{Deserialize, Serialize};
use std::path::Path;

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`, 100 on Linux).
fn ticks_per_s() -> f64 {
    match nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK) {
        Ok(Some(t)) if t > 0 => t as f64,
        _ => 100.0,
    }
}

/// (ppid, own ticks, reaped children's ticks) of one process.
fn stat(pid: u32) -> Option<(u32, u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces: fields start after the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // f[0] = state (field 3), f[1] = ppid, f[11..15] = utime stime cutime cstime.
    let num = |i: usize| f.get(i).and_then(|s| s.parse::<u64>().ok());
    Some((num(1)? as u32, num(11)? + num(12)?, num(13)? + num(14)?))
}

/// The postmaster's pid from `pgdata/postmaster.pid` (first line).
pub fn postmaster_pid(work_dir: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(work_dir.join("pgdata").join("postmaster.pid")).ok()?;
    text.lines().next()?.trim().parse().ok()
}

/// Ticks of the postmaster, its reaped children and its live children. A backend reaped
/// while the children are scanned would be missed (or counted twice): the postmaster's
/// reaped total is read before and after the scan, and the scan is repeated until it did
/// not change in between.
fn postgres_ticks(postmaster: u32) -> u64 {
    let mut result = 0;
    for _ in 0..10 {
        let Some((_, own, reaped)) = stat(postmaster) else {
            return 0;
        };
        let mut live = 0;
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for e in dir.flatten() {
                let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                    continue;
                };
                if let Some((ppid, t, _)) = stat(pid) {
                    if ppid == postmaster {
                        live += t;
                    }
                }
            }
        }
        result = own + reaped + live;
        match stat(postmaster) {
            Some((_, _, again)) if again == reaped => return result,
            Some(_) => continue,
            None => return result,
        }
    }
    result
}

/// (busy, total) ticks of the whole machine from the first line of `/proc/stat`.
fn machine_ticks() -> (u64, u64) {
    let Ok(text) = std::fs::read_to_string("/proc/stat") else {
        return (0, 0);
    };
    let Some(line) = text.lines().next() else {
        return (0, 0);
    };
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|s| s.parse().ok())
        .collect();
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total.saturating_sub(idle), total)
}

/// What to sample: the gateway process (if one runs) and the postmaster.
#[derive(Clone, Copy, Debug, Default)]
pub struct Probe {
    pub gateway: Option<u32>,
    pub postmaster: Option<u32>,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Sample {
    gateway: u64,
    postgres: u64,
    bench: u64,
    bench_children: u64,
    busy: u64,
    total: u64,
    at: Option<std::time::Instant>,
}

impl Probe {
    pub fn sample(&self) -> Sample {
        let me = std::process::id();
        let (_, bench, bench_children) = stat(me).unwrap_or((0, 0, 0));
        let (busy, total) = machine_ticks();
        Sample {
            gateway: self.gateway.and_then(stat).map(|s| s.1).unwrap_or(0),
            postgres: self.postmaster.map(postgres_ticks).unwrap_or(0),
            bench,
            bench_children,
            busy,
            total,
            at: Some(std::time::Instant::now()),
        }
    }
}

/// CPU used during one run, in milliseconds of CPU time.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct CpuUse {
    /// The wall time the figures cover, seconds.
    pub wall_s: f64,
    /// The gateway process (0 when none ran).
    pub gateway_ms: f64,
    /// The postmaster and all its backends.
    pub postgres_ms: f64,
    /// The bench process itself (load generator, receivers).
    pub bench_ms: f64,
    /// Child processes of the bench that exited during the run (pgbench, the WebSocket
    /// ceiling server).
    pub bench_children_ms: f64,
    /// Busy share of all cores of the machine, percent (includes other users' work).
    pub machine_busy_pct: f64,
    /// CPU the machine spent on anything but the processes above (other users' work):
    /// the interference this run suffered.
    pub others_ms: f64,
}

pub fn delta(a: &Sample, b: &Sample) -> CpuUse {
    let tick_ms = 1000.0 / ticks_per_s();
    let ms = |x: u64, y: u64| crate::util::r3(y.saturating_sub(x) as f64 * tick_ms);
    let wall_s = match (a.at, b.at) {
        (Some(x), Some(y)) => y.duration_since(x).as_secs_f64(),
        _ => 0.0,
    };
    let total = b.total.saturating_sub(a.total);
    let ours = [
        (a.gateway, b.gateway),
        (a.postgres, b.postgres),
        (a.bench, b.bench),
        (a.bench_children, b.bench_children),
    ]
    .iter()
    .map(|(x, y)| y.saturating_sub(*x))
    .sum::<u64>();
    CpuUse {
        others_ms: ms(ours, b.busy.saturating_sub(a.busy)),
        wall_s: crate::util::r3(wall_s),
        gateway_ms: ms(a.gateway, b.gateway),
        postgres_ms: ms(a.postgres, b.postgres),
        bench_ms: ms(a.bench, b.bench),
        bench_children_ms: ms(a.bench_children, b.bench_children),
        machine_busy_pct: if total > 0 {
            crate::util::r3(100.0 * b.busy.saturating_sub(a.busy) as f64 / total as f64)
        } else {
            0.0
        },
    }
}

/// CPU microseconds per operation for each process, `None` when no operation completed.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct CpuPerOp {
    pub gateway_us: Option<f64>,
    pub postgres_us: Option<f64>,
    /// The load generator: the bench process, or pgbench for pgbench runs.
    pub client_us: Option<f64>,
}

pub fn per_op(c: &CpuUse, ops: u64, client_is_child: bool) -> CpuPerOp {
    let f = |ms: f64| (ops > 0).then(|| crate::util::r3(ms * 1000.0 / ops as f64));
    CpuPerOp {
        gateway_us: f(c.gateway_ms),
        postgres_us: f(c.postgres_ms),
        client_us: f(if client_is_child {
            c.bench_children_ms
        } else {
            c.bench_ms
        }),
    }
}
