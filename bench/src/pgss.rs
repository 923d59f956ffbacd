//! Per-statement database time from `pg_stat_statements`, loaded into the bench's own
//! throwaway cluster (ALTER SYSTEM + restart: the harness's settings are not touched).
//! Each run resets the view first and reads it afterwards; statements are labelled by what
//! they are in the gateway (or pgbench) so the result can say where the time goes.

use anyhow::Context;
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, Row};

/// Loads `pg_stat_statements`: sets `shared_preload_libraries`, restarts the cluster, creates
/// the extension (its defaults track top-level statements and utility statements: COMMIT).
pub async fn enable(cluster: &mut harness::pg::Cluster) -> anyhow::Result<()> {
    {
        let pool = cluster.pool().await?;
        sqlx::query("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
            .execute(&pool)
            .await
            .context("ALTER SYSTEM SET shared_preload_libraries")?;
        pool.close().await;
    }
    cluster.stop().await?;
    cluster.restart().await?;
    let pool = cluster.pool().await?;
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(&pool)
        .await
        .context("CREATE EXTENSION pg_stat_statements")?;
    pool.close().await;
    Ok(())
}

pub async fn reset(pool: &PgPool) {
    let _ = sqlx::query("SELECT pg_stat_statements_reset()")
        .execute(pool)
        .await;
}

/// One statement's totals over a run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StmtStat {
    /// What the statement is (see `label`).
    pub label: String,
    /// The normalised text, cut to 100 characters.
    pub query: String,
    pub calls: u64,
    pub total_ms: f64,
    pub mean_ms: f64,
}

/// Names a statement by its text: the gateway's and pgbench's statements of the send path,
/// the fan-out read, the ack upsert, the sweep, and the rest.
pub fn label(q: &str) -> &'static str {
    let q = q.trim_start();
    let has = |s: &str| q.contains(s);
    // Most specific first: several statements share fragments (e.g. `FROM devices`).
    if q.eq_ignore_ascii_case("commit") || q.eq_ignore_ascii_case("end") {
        "commit"
    } else if q.eq_ignore_ascii_case("begin") || q.starts_with("BEGIN") {
        "begin"
    } else if q.eq_ignore_ascii_case("rollback") {
        "rollback"
    } else if has("im_send_batch") {
        "send_batch"
    } else if has("UPDATE conversations SET next_seq") {
        "seq_update"
    } else if has("INSERT INTO events") && has("pg_notify") {
        "event_insert_notify"
    } else if has("INSERT INTO events") {
        "event_insert"
    } else if has("count(pg_notify(") {
        "notify"
    } else if has("FROM events e JOIN conversations c") {
        "dup_lookup"
    } else if has("INSERT INTO device_cursors") {
        "ack_upsert"
    } else if has("ARRAY(SELECT DISTINCT m.user_id") {
        "fanout_read"
    } else if has("WITH subs AS") || has("WITH pairs AS") {
        "sweep"
    } else if has("FROM events e") && has("ORDER BY e.seq LIMIT") {
        "sync_page"
    } else if has("im_visible_head($1, $2)") {
        "sync_head"
    } else if has("LEFT JOIN device_cursors dc ON dc.device_id = $2") {
        "sub_states"
    } else if has("token_sha256 FROM devices") {
        "hello_auth"
    } else if has("FROM devices WHERE device_id") {
        "epoch_check"
    } else if has("to_seq IS NULL)") && has("SELECT EXISTS") {
        "member_check"
    } else if has("LISTEN") {
        "listen"
    } else {
        "other"
    }
}

/// The statements of the last run, largest total time first (the bench's own reads and
/// `pg_stat_statements` itself excluded).
pub async fn snapshot(pool: &PgPool) -> Vec<StmtStat> {
    let rows = sqlx::query(
        "SELECT query, calls, total_exec_time, mean_exec_time FROM pg_stat_statements
         WHERE query NOT LIKE '%pg_stat_statements%' AND query NOT LIKE '%imfault-bench%'
         ORDER BY total_exec_time DESC LIMIT 20",
    )
    .fetch_all(pool)
    .await;
    let Ok(rows) = rows else { return Vec::new() };
    rows.iter()
        .map(|r| {
            let q: String = r.get(0);
            let calls: i64 = r.get(1);
            let total: f64 = r.get(2);
            let mean: f64 = r.get(3);
            StmtStat {
                label: label(&q).to_string(),
                query: q
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ")
                    .chars()
                    .take(100)
                    .collect(),
                calls: calls.max(0) as u64,
                total_ms: crate::util::r3(total),
                mean_ms: crate::util::r3(mean),
            }
        })
        .collect()
}

/// Total time and calls of the statements with this label.
pub fn by_label(stats: &[StmtStat], label: &str) -> (f64, u64) {
    stats
        .iter()
        .filter(|s| s.label == label)
        .fold((0.0, 0), |(t, c), s| (t + s.total_ms, c + s.calls))
}

#[cfg(test)]
mod tests {
    #[test]
    fn labels_gateway_statements() {
        assert_eq!(super::label("COMMIT"), "commit");
        assert_eq!(super::label("END"), "commit");
        assert_eq!(
            super::label("UPDATE conversations SET next_seq = next_seq + $1 WHERE conv_id = $2"),
            "seq_update"
        );
        assert_eq!(
            super::label("WITH ins AS (INSERT INTO events (a) VALUES ($1)) SELECT ins.mid, pg_notify($7, $1)"),
            "event_insert_notify"
        );
        assert_eq!(
            super::label("SELECT count(pg_notify($1, p)) FROM unnest($2::text[]) AS p"),
            "notify"
        );
    }
}
