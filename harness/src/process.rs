//! Child processes as the harness runs them (the postmaster, `pg_autoctl` nodes, the
//! gateway): shared by `pg`, `autofailover` and `gateway`, which each own their own
//! processes.
//!
//! Owns: the parent-death signal a child is spawned with, sending a signal, reading the
//! process table (`/proc`) to stop and kill a whole process tree (PostgreSQL's backends run
//! in sessions of their own, so a group signal misses them), how an exit status is described,
//! and the tail of a process's log.
//!
//! Must not: know any program it runs (PostgreSQL, the gateway, pg_auto_failover), spawn or
//! wait for a process itself, or block beyond its scans of `/proc` and its reads of a log.

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Command, ExitStatus};

use anyhow::Context;
use nix::sys::signal::Signal;
use nix::unistd::Pid;

/// Has the kernel send `signal` to the child when the spawning thread dies (Linux only).
pub(crate) fn set_parent_death_signal(cmd: &mut Command, signal: Signal) {
    #[cfg(target_os = "linux")]
    {
        let parent = std::process::id();
        // SAFETY: `pre_exec` is unsafe by contract (the closure runs between fork and
        // exec); this one only makes async-signal-safe calls (prctl, getppid) and
        // allocates nothing. nix has no safe wrapper for a pre-exec hook.
        unsafe {
            cmd.pre_exec(move || {
                nix::sys::prctl::set_pdeathsig(signal)?;
                // The parent may have died before prctl took effect.
                if nix::unistd::getppid().as_raw() as u32 != parent {
                    return Err(nix::errno::Errno::ESRCH.into());
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (cmd, signal);
}

pub(crate) fn send_signal(pid: u32, signal: Signal) -> anyhow::Result<()> {
    let pid = i32::try_from(pid).context("pid out of range")?;
    nix::sys::signal::kill(Pid::from_raw(pid), signal)
        .with_context(|| format!("kill({pid}, {signal})"))
}

/// "exit status 1" or "signal 9 (SIGKILL)".
pub(crate) fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        (None, None) => status.to_string(),
    }
}

/// The last `lines` lines of a log file from byte `from` on; never fails (an error
/// reading the log is shown in its place).
pub(crate) fn log_tail(path: &Path, from: u64, lines: usize) -> String {
    let mut text = Vec::new();
    let read = File::open(path).and_then(|mut file| {
        let len = file.metadata()?.len();
        // At most the last 64 KiB: enough for `lines` lines of a log.
        let start = from.max(len.saturating_sub(64 * 1024));
        file.seek(SeekFrom::Start(start))?;
        file.read_to_end(&mut text)
    });
    if let Err(e) = read {
        return format!("<could not read {}: {e}>", path.display());
    }
    let text = String::from_utf8_lossy(&text);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `(pid, ppid, pgid, state)` of every process.
pub(crate) fn processes() -> Vec<(u32, u32, u32, char)> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let (ppid, pgid, state) = stat(pid).ok()??;
            Some((pid, ppid, pgid, state))
        })
        .collect()
}

/// `(ppid, pgid, state)` of process `pid` from `/proc/PID/stat`: an error when it has no
/// entry (gone, or reaped), `None` when the entry does not parse.
pub(crate) fn stat(pid: u32) -> std::io::Result<Option<(u32, u32, char)>> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // "pid (comm) S ppid pgrp ...": comm may hold spaces and parentheses.
    let parse = || {
        let rest = &stat[stat.rfind(')')? + 1..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        let state = f.first()?.chars().next()?;
        Some((f.get(1)?.parse().ok()?, f.get(2)?.parse().ok()?, state))
    };
    Ok(parse())
}

/// SIGSTOPs `root`, its process group and every descendant (PostgreSQL backends run in
/// sessions of their own, so a group signal misses them), rescanning until no new process
/// appears; returns them all. Stopped, none can fork, exit or act any more.
pub(crate) fn stop_tree(root: u32) -> BTreeSet<u32> {
    let mut found: BTreeSet<u32> = BTreeSet::new();
    loop {
        let procs = processes();
        let mut next = found.clone();
        next.insert(root);
        loop {
            let before = next.len();
            for &(pid, ppid, pgid, _) in &procs {
                if next.contains(&ppid) || pgid == root {
                    next.insert(pid);
                }
            }
            if next.len() == before {
                break;
            }
        }
        let new: Vec<u32> = next.difference(&found).copied().collect();
        if new.is_empty() {
            return found;
        }
        for &pid in &new {
            signal(pid, Signal::SIGSTOP);
        }
        found = next;
    }
}

/// SIGKILLs `root` and its whole tree as [`stop_tree`] finds it (its process group, every
/// descendant, also those in groups or sessions of their own, as nextest's test processes
/// and PostgreSQL's backends are); returns how many processes it signalled.
pub fn kill_tree(root: u32) -> usize {
    let pids = stop_tree(root);
    for &pid in &pids {
        signal(pid, Signal::SIGKILL);
    }
    pids.len()
}

/// `kill(pid, sig)`, ignoring a process that is already gone.
pub(crate) fn signal(pid: u32, sig: Signal) {
    if let Ok(pid) = i32::try_from(pid) {
        let _ = nix::sys::signal::kill(Pid::from_raw(pid), sig);
    }
}

/// Whether any of `pids` still exists and is not a zombie (one scan of /proc).
pub(crate) fn any_alive(pids: &BTreeSet<u32>) -> bool {
    processes()
        .iter()
        .any(|&(p, _, _, state)| pids.contains(&p) && state != 'Z' && state != 'X')
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::time::{Duration, Instant};

    /// Interval of the test's waits.
    const POLL: Duration = Duration::from_millis(20);
    /// How long the killed processes may take to be gone.
    const KILL_TIMEOUT: Duration = Duration::from_secs(10);

    /// Proves a node's crash reaches every process of it: a child of its own process group
    /// with a descendant in a session of its own (as PostgreSQL's backends are) is stopped
    /// and killed whole.
    #[test]
    fn stop_tree_finds_descendants_in_other_sessions() -> anyhow::Result<()> {
        let mut root = std::process::Command::new("sh")
            .args(["-c", "setsid sleep 30 & sleep 30"])
            .process_group(0)
            .spawn()?;
        let id = root.id();
        let deadline = Instant::now() + Duration::from_secs(5);
        // Both children there, one of them already in its own session (`setsid` forks,
        // then calls setsid(2): a moment in which it is still in the group's session).
        let ready = || {
            let children: Vec<_> = processes().into_iter().filter(|p| p.1 == id).collect();
            let sessions: BTreeSet<u32> = children.iter().map(|p| p.2).collect();
            children.len() >= 2 && sessions.len() >= 2
        };
        while !ready() && Instant::now() < deadline {
            std::thread::sleep(POLL);
        }
        let pids = stop_tree(id);
        let sessions: BTreeSet<u32> = processes()
            .iter()
            .filter(|p| pids.contains(&p.0))
            .map(|p| p.2)
            .collect();
        for &pid in &pids {
            signal(pid, Signal::SIGKILL);
        }
        root.wait()?;
        assert_eq!(pids.len(), 3, "sh and both sleeps: {pids:?}");
        assert_eq!(
            sessions.len(),
            2,
            "one descendant left the group: {sessions:?}"
        );
        let deadline = Instant::now() + KILL_TIMEOUT;
        while any_alive(&pids) && Instant::now() < deadline {
            std::thread::sleep(POLL);
        }
        assert!(!any_alive(&pids), "still alive: {pids:?}");
        Ok(())
    }
}
