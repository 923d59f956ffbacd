//! pgbench as the send path's ceiling: the same transaction shape as `store::send` (UPDATE …
//! RETURNING for the seq, INSERT … ON CONFLICT DO NOTHING RETURNING mid, commit), (a) without
//! and (b) with `pg_notify` inside, on the same cluster, prepared statements, one connection
//! and thread per client. Latencies come from pgbench's per-transaction log. (a) is the
//! targets' baseline (issue 44: the gateway at >= 0.9, 1.2 and 1.5 of it at 1, 8 and 32
//! senders); (b) is the gateway's shape
//! before issue 12 (NOTIFY in the transaction, its lock held through the commit flush), kept
//! as the measure of what that lock costs.

use anyhow::{bail, Context};
use std::path::{Path, PathBuf};

/// The custom script. `notify` adds `pg_notify('im_events', conv || ':' || seq)` to the
/// INSERT statement, where the gateway had it before its NOTIFY moved after the commit.
pub fn script(convs: usize, body: &str, notify: bool) -> String {
    let tag = if notify { "pb" } else { "pa" };
    let select = if notify {
        "SELECT ins.mid, pg_notify('im_events', 'sp-c' || :c || ':' || :seq) FROM ins"
    } else {
        "SELECT ins.mid FROM ins"
    };
    format!(
        "\\set c random(0, {last})\n\
         \\set r random(1, 4000000000000000000)\n\
         BEGIN;\n\
         UPDATE conversations SET next_seq = next_seq + 1 WHERE conv_id = 'sp-c' || :c RETURNING next_seq - 1 AS seq \\gset\n\
         WITH ins AS (INSERT INTO events (conv_id, seq, sender_user, sender_device, cmid, body) \
         VALUES ('sp-c' || :c, :seq, 'sp-u' || :client_id, 'sp-d' || :client_id, '{tag}-' || :client_id || '-' || :r, '{body}') \
         ON CONFLICT (sender_user, cmid) DO NOTHING RETURNING mid) {select};\n\
         END;\n",
        last = convs.saturating_sub(1),
    )
}

/// Issue 19's true ceiling: `rows` messages per transaction, the gateway's group commit
/// done by pgbench (one WAL flush for `rows` messages). Row `i` picks its conversation from
/// the `i`-th of `rows` equal ranges, so every transaction locks conversations in one order
/// (as the gateway's sorted batches do) and none deadlocks.
pub fn batch_script(convs: usize, body: &str, rows: usize) -> String {
    let rows = rows.max(1);
    let per = (convs / rows).max(1);
    let mut s = String::new();
    for i in 0..rows {
        let lo = (i * per).min(convs.saturating_sub(1));
        let hi = (lo + per - 1).min(convs.saturating_sub(1));
        s.push_str(&format!(
            "\\set c{i} random({lo}, {hi})\n\\set r{i} random(1, 4000000000000000000)\n"
        ));
    }
    s.push_str("BEGIN;\n");
    for i in 0..rows {
        s.push_str(&format!(
            "UPDATE conversations SET next_seq = next_seq + 1 WHERE conv_id = 'sp-c' || :c{i} RETURNING next_seq - 1 AS seq{i} \\gset\n\
             INSERT INTO events (conv_id, seq, sender_user, sender_device, cmid, body) \
             VALUES ('sp-c' || :c{i}, :seq{i}, 'sp-u' || :client_id, 'sp-d' || :client_id, 'pc-' || :client_id || '-' || :r{i}, '{body}') \
             ON CONFLICT (sender_user, cmid) DO NOTHING;\n"
        ));
    }
    s.push_str("END;\n");
    s
}

#[derive(Debug, Default)]
pub struct Out {
    /// Latencies of the transactions completed inside the measured window, µs.
    pub lat_us: Vec<i64>,
    /// Transactions logged as failed or skipped.
    pub errors: u64,
    /// Transactions logged as done over the whole run.
    pub ops_total: u64,
}

/// Runs pgbench for `warmup_s + duration_s` seconds and measures the window after the
/// warm-up (from the first transaction's start).
#[allow(clippy::too_many_arguments)]
pub async fn run(
    bin: &Path,
    port: u16,
    script_text: &str,
    clients: usize,
    warmup_s: u64,
    duration_s: u64,
    dir: &Path,
    tag: &str,
    async_commit: bool,
) -> anyhow::Result<Out> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let script_path = dir.join(format!("{tag}.sql"));
    std::fs::write(&script_path, script_text).context("write pgbench script")?;
    let prefix = dir.join(format!("log-{tag}"));
    let mut cmd = tokio::process::Command::new(bin);
    if async_commit {
        cmd.env("PGOPTIONS", "-c synchronous_commit=off");
    }
    let out = cmd
        .arg("-n")
        .arg("-f")
        .arg(&script_path)
        .args(["-M", "prepared"])
        .arg(format!("-c{clients}"))
        .arg(format!("-j{clients}"))
        .arg(format!("-T{}", warmup_s + duration_s))
        .arg("-l")
        .arg(format!("--log-prefix={}", prefix.display()))
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-U",
            "postgres",
            "postgres",
        ])
        .current_dir(dir)
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| format!("run {}", bin.display()))?;
    if !out.status.success() {
        bail!(
            "pgbench {tag} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        );
    }
    let (done, errors) = read_logs(dir, &prefix, tag)?;
    let first_start = done.iter().map(|(end, lat)| end - lat).min().unwrap_or(0);
    let from = first_start + warmup_s as i64 * 1_000_000;
    let to = from + duration_s as i64 * 1_000_000;
    let lat_us: Vec<i64> = done
        .iter()
        .filter(|(end, l)| end - l >= from && *end <= to)
        .map(|(_, l)| *l)
        .collect();
    Ok(Out {
        lat_us,
        errors,
        ops_total: done.len() as u64,
    })
}

/// pgbench's per-transaction logs (`<prefix>.<pid>` in `dir`), whose lines are
/// `client_id transaction_no time script_no time_epoch time_us`: (end µs, latency µs) of
/// every transaction done, and how many lines were not (failed or skipped).
fn read_logs(dir: &Path, prefix: &Path, tag: &str) -> anyhow::Result<(Vec<(i64, i64)>, u64)> {
    let mut done: Vec<(i64, i64)> = Vec::new();
    let mut errors = 0u64;
    let name = prefix
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_string();
    let logs: Vec<PathBuf> = std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&format!("{name}.")))
        })
        .collect();
    if logs.is_empty() {
        bail!("pgbench {tag} wrote no transaction log");
    }
    for path in logs {
        let text = std::fs::read_to_string(&path)?;
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 6 {
                continue;
            }
            match (
                f[2].parse::<i64>(),
                f[4].parse::<i64>(),
                f[5].parse::<i64>(),
            ) {
                (Ok(lat), Ok(s), Ok(us)) => done.push((s * 1_000_000 + us, lat)),
                _ => errors += 1,
            }
        }
    }
    Ok((done, errors))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_batch_script_locks_its_conversations_in_one_order() {
        let s = super::batch_script(64, "x", 4);
        for (i, range) in [
            "random(0, 15)",
            "random(16, 31)",
            "random(32, 47)",
            "random(48, 63)",
        ]
        .iter()
        .enumerate()
        {
            assert!(s.contains(&format!("\\set c{i} {range}")), "{s}");
        }
        assert_eq!(s.matches("INSERT INTO events").count(), 4);
        assert_eq!(s.matches("BEGIN;").count(), 1);
    }

    #[test]
    fn scripts_differ_only_by_notify() {
        let a = super::script(64, "x", false);
        let b = super::script(64, "x", true);
        assert!(a.contains("random(0, 63)") && !a.contains("pg_notify"));
        assert!(b.contains("pg_notify('im_events'"));
        assert_eq!(a.lines().count(), b.lines().count());
    }
}
