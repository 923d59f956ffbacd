//! Part 3, the sweep query: wall time of one `im_gateway::store::lagging` call (the query
//! the gateway runs every `IM_SWEEP_MS`) and its database time (`pg_stat_statements` for the
//! same call, and `EXPLAIN (ANALYZE, BUFFERS)`), for growing numbers of subscribed devices
//! with 20 conversations each and 0% / 1% of (device, conversation) pairs lagging.
//!
//! The devices are simulated: the query's input arrays name them; no WebSocket connection
//! exists. The rows are provisioned with bulk SQL (generate_series, in key order, foreign-key
//! triggers off for the provisioning session only: the data is consistent by construction).
//!
//! The ceiling is the same question asked set-based (one join and GROUP BY instead of one
//! `im_visible_head` call per pair); it must return the same rows.

use anyhow::{bail, Context};
use sqlx::{PgPool, Row};
use std::time::Instant;

use crate::pgss;
use crate::result::{Explain, Sweep, SweepGrowth, SweepRow};
use crate::util::{progress, r3, ratio};
use crate::Ctx;

/// Heads of the sweep's conversations; cursors sit at HEAD, lagging ones at HEAD - 1.
const HEAD: i64 = 10;

/// The gateway's source, to EXPLAIN exactly the query `store::lagging` runs.
const STORE_RS: &str = include_str!("../../gateway/src/store.rs");

/// The SQL text of `store::lagging`, cut out of `gateway/src/store.rs`.
pub fn lagging_sql() -> anyhow::Result<String> {
    let f = STORE_RS
        .find("pub async fn lagging")
        .context("store.rs has no `pub async fn lagging`")?;
    let rest = &STORE_RS[f..];
    let q = rest
        .find("sqlx::query(")
        .context("lagging: no sqlx::query(")?;
    let rest = &rest[q..];
    let open = rest.find('"').context("lagging: no string literal")?;
    let body = &rest[open + 1..];
    let close = body
        .find('"')
        .context("lagging: unterminated string literal")?;
    let sql = &body[..close];
    if sql.contains('\\') || !sql.contains("$1") {
        bail!("lagging: the query literal has escapes or no $1; update the bench's extraction");
    }
    Ok(sql.to_string())
}

/// The same rows as `store::lagging`, computed with one join and GROUP BY (no per-pair call
/// of `im_visible_head`): the visible head is the largest period end that is not before the
/// period's start, 0 when there is none.
const SET_BASED: &str = "
WITH subs AS (SELECT DISTINCT * FROM unnest($1::text[], $2::text[]) AS s(device_id, user_id)),
     per AS (
         SELECT s.device_id, m.conv_id, m.from_seq,
                LEAST(c.next_seq - 1, COALESCE(m.to_seq - 1, c.next_seq - 1)) AS last_seq
         FROM subs s JOIN memberships m ON m.user_id = s.user_id
         JOIN conversations c ON c.conv_id = m.conv_id),
     heads AS (
         SELECT device_id, conv_id,
                COALESCE(MAX(last_seq) FILTER (WHERE from_seq <= last_seq), 0) AS vhead
         FROM per GROUP BY device_id, conv_id)
SELECT h.device_id, h.conv_id, h.vhead FROM heads h
LEFT JOIN device_cursors dc ON dc.device_id = h.device_id AND dc.conv_id = h.conv_id
WHERE COALESCE(dc.delivered_seq, 0) < h.vhead";

fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i:07}")).collect()
}

/// Adds devices `from..to` (each its own user), their groups' conversations, memberships and
/// cursors at HEAD.
async fn grow(pool: &PgPool, from: usize, to: usize, k: usize, g: usize) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET LOCAL session_replication_role = replica")
        .execute(&mut *tx)
        .await?;
    let (from, to, k, g) = (from as i64, to as i64, k as i64, g as i64);
    let stmts = [
        "INSERT INTO users (user_id)
         SELECT 'sw-u' || lpad(i::text, 7, '0') FROM generate_series($1::bigint, $2::bigint - 1) i",
        "INSERT INTO devices (device_id, user_id, install_epoch, token_sha256)
         SELECT 'sw-d' || lpad(i::text, 7, '0'), 'sw-u' || lpad(i::text, 7, '0'), 1, repeat('0', 64)
         FROM generate_series($1::bigint, $2::bigint - 1) i",
        "INSERT INTO conversations (conv_id, next_seq)
         SELECT 'sw-c' || lpad(j::text, 7, '0'), $5::bigint + 1
         FROM generate_series($1::bigint / $4::bigint * $3::bigint, $2::bigint / $4::bigint * $3::bigint - 1) j",
        "INSERT INTO memberships (conv_id, user_id, from_seq)
         SELECT 'sw-c' || lpad(j::text, 7, '0'), 'sw-u' || lpad(((j / $3::bigint) * $4::bigint + m)::text, 7, '0'), 1
         FROM generate_series($1::bigint / $4::bigint * $3::bigint, $2::bigint / $4::bigint * $3::bigint - 1) j,
              generate_series(0, $4::bigint - 1) m
         ORDER BY 1, 2",
        "INSERT INTO device_cursors (device_id, conv_id, install_epoch, delivered_seq)
         SELECT 'sw-d' || lpad(i::text, 7, '0'), 'sw-c' || lpad(((i / $4::bigint) * $3::bigint + c)::text, 7, '0'), 1, $5::bigint
         FROM generate_series($1::bigint, $2::bigint - 1) i, generate_series(0, $3::bigint - 1) c
         ORDER BY 1, 2",
    ];
    for s in stmts {
        // Bind $1..$n where n is the highest parameter the statement uses.
        let n = (1..=5)
            .rev()
            .find(|i| s.contains(&format!("${i}")))
            .unwrap_or(0);
        let mut q = sqlx::query(s);
        for v in [from, to, k, g, HEAD].into_iter().take(n) {
            q = q.bind(v);
        }
        q.execute(&mut *tx)
            .await
            .with_context(|| format!("provision sweep rows: {}", &s[..40]))?;
    }
    tx.commit().await?;
    for t in [
        "users",
        "devices",
        "conversations",
        "memberships",
        "device_cursors",
    ] {
        sqlx::query(&format!("VACUUM (ANALYZE) {t}"))
            .execute(pool)
            .await?;
    }
    Ok(())
}

/// Sets `pct` percent of the sweep's pairs to HEAD - 1 (a deterministic hash pick) and the
/// rest to HEAD. Returns the lagging pairs.
async fn set_lag(pool: &PgPool, pct: f64) -> anyhow::Result<u64> {
    sqlx::query(
        "UPDATE device_cursors SET delivered_seq = $1 WHERE device_id LIKE 'sw-%' AND delivered_seq <> $1",
    )
    .bind(HEAD)
    .execute(pool)
    .await?;
    if pct <= 0.0 {
        return Ok(0);
    }
    let r = sqlx::query(
        "UPDATE device_cursors SET delivered_seq = $1 - 1
         WHERE device_id LIKE 'sw-%' AND abs(hashtext(device_id || '/' || conv_id)) % 10000 < $2",
    )
    .bind(HEAD)
    .bind((pct * 100.0).round() as i32)
    .execute(pool)
    .await?;
    Ok(r.rows_affected())
}

async fn explain(
    pool: &PgPool,
    sql: &str,
    devices: &[String],
    users: &[String],
    epochs: &[i64],
) -> anyhow::Result<Explain> {
    let row = sqlx::query(&format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}"))
        .bind(devices)
        .bind(users)
        .bind(epochs)
        .fetch_one(pool)
        .await
        .context("EXPLAIN the sweep query")?;
    // json's binary form is its text; the type check is skipped on purpose.
    let text: String = row.try_get_unchecked(0).context("read EXPLAIN output")?;
    let v: serde_json::Value = serde_json::from_str(&text).context("parse EXPLAIN JSON")?;
    let top = &v[0];
    let plan = &top["Plan"];
    let n = |x: &serde_json::Value| x.as_u64().unwrap_or(0);
    Ok(Explain {
        execution_ms: r3(top["Execution Time"].as_f64().unwrap_or(0.0)),
        planning_ms: r3(top["Planning Time"].as_f64().unwrap_or(0.0)),
        shared_hit_blocks: n(&plan["Shared Hit Blocks"]),
        shared_read_blocks: n(&plan["Shared Read Blocks"]),
        temp_written_blocks: n(&plan["Temp Written Blocks"]),
        top_node: plan["Node Type"].as_str().unwrap_or("").to_string(),
    })
}

pub async fn run(ctx: &Ctx) -> anyhow::Result<Sweep> {
    let p = &ctx.params;
    let sql = lagging_sql()?;
    let (k, g) = (p.sweep_convs_per_device, p.sweep_users_per_conversation);
    let mut sizes: Vec<usize> = p.sweep_devices.iter().map(|&n| n.div_ceil(g) * g).collect();
    sizes.sort_unstable();
    sizes.dedup();
    // Bulk provisioning writes about a million rows at 50k devices; unlogged tables skip
    // their WAL (reads go through the same buffers). Nothing after this part needs these
    // two tables to survive a crash: the repair part has its own cluster.
    for t in ["memberships", "device_cursors"] {
        sqlx::query(&format!("ALTER TABLE {t} SET UNLOGGED"))
            .execute(&ctx.pool)
            .await
            .with_context(|| format!("ALTER TABLE {t} SET UNLOGGED"))?;
    }
    let mut rows = Vec::new();
    let mut have = 0usize;
    for (si, &n) in sizes.iter().enumerate() {
        progress(&format!(
            "[sweep {}/{}] provisioning {n} devices x {k} conversations",
            si + 1,
            sizes.len()
        ));
        let t = Instant::now();
        grow(&ctx.pool, have, n, k, g).await?;
        have = n;
        let provision_s = r3(t.elapsed().as_secs_f64());
        let devices = ids("sw-d", n);
        let users = ids("sw-u", n);
        // Every simulated device is at its first install (the sweep serves current ones).
        let epochs = vec![1i64; n];
        let pairs = (n * k) as u64;
        for (li, &lag) in p.sweep_lag_percents.iter().enumerate() {
            let lagging_pairs = set_lag(&ctx.pool, lag).await?;
            // Repeats up to 2,000 devices; one call above (a call there takes seconds).
            let repeats = if n <= 2_000 {
                p.sweep_repeats.max(1)
            } else {
                1
            };
            let mut wall = Vec::new();
            let mut returned = 0u64;
            if ctx.pgss {
                pgss::reset(&ctx.pool).await;
            }
            for r in 0..repeats {
                progress(&format!(
                    "[sweep {}/{}] {n} devices, {lag}% lagging: sweep query {}/{repeats}",
                    si + 1,
                    sizes.len(),
                    r + 1
                ));
                let t = Instant::now();
                let got = im_gateway::store::lagging(&ctx.pool, &devices, &users, &epochs)
                    .await
                    .context("store::lagging")?;
                wall.push(r3(t.elapsed().as_secs_f64() * 1000.0));
                returned = got.len() as u64;
            }
            let db_exec_ms = if ctx.pgss {
                let stmts = pgss::snapshot(&ctx.pool).await;
                let (total, calls) = pgss::by_label(&stmts, "sweep");
                (calls > 0).then(|| r3(total / calls as f64))
            } else {
                None
            };
            let last_lag = li + 1 == p.sweep_lag_percents.len();
            // EXPLAIN once per size, with the lagging rows in place (the last lag).
            let explain = if last_lag && n <= p.sweep_explain_max_devices {
                progress(&format!(
                    "[sweep {}/{}] {n} devices, {lag}% lagging: EXPLAIN ANALYZE",
                    si + 1,
                    sizes.len()
                ));
                Some(explain(&ctx.pool, &sql, &devices, &users, &epochs).await?)
            } else {
                None
            };
            let (set_ms, set_rows) = if last_lag && n <= p.sweep_set_based_max_devices {
                progress(&format!(
                    "[sweep {}/{}] {n} devices: set-based ceiling",
                    si + 1,
                    sizes.len()
                ));
                let t = Instant::now();
                let got = sqlx::query(SET_BASED)
                    .bind(&devices)
                    .bind(&users)
                    .fetch_all(&ctx.pool)
                    .await
                    .context("set-based sweep")?;
                (
                    Some(r3(t.elapsed().as_secs_f64() * 1000.0)),
                    Some(got.len() as u64),
                )
            } else {
                (None, None)
            };
            let mut sorted = wall.clone();
            sorted.sort_by(|a, b| a.total_cmp(b));
            let median = sorted[sorted.len() / 2];
            rows.push(SweepRow {
                devices: n,
                pairs,
                lag_percent: lag,
                lagging_pairs,
                rows_returned: returned,
                wall_ms_median: median,
                wall_ms: wall,
                db_exec_ms,
                explain,
                us_per_pair: r3(median * 1000.0 / pairs.max(1) as f64),
                set_based_vs_gateway: set_ms.and_then(|s| ratio(s, median)),
                set_based_wall_ms: set_ms,
                set_based_rows: set_rows,
                over_sweep_interval: median > 1000.0,
                over_db_timeout: median > 5000.0,
                provision_s: if li == 0 { provision_s } else { 0.0 },
            });
        }
        set_lag(&ctx.pool, 0.0).await?;
    }
    let mut growth = Vec::new();
    for &lag in &p.sweep_lag_percents {
        let rs: Vec<&SweepRow> = rows.iter().filter(|r| r.lag_percent == lag).collect();
        for w in rs.windows(2) {
            let size_ratio = w[1].devices as f64 / w[0].devices as f64;
            let wall_ratio = w[1].wall_ms_median / w[0].wall_ms_median.max(0.001);
            growth.push(SweepGrowth {
                lag_percent: lag,
                from_devices: w[0].devices,
                to_devices: w[1].devices,
                size_ratio: r3(size_ratio),
                wall_ratio: r3(wall_ratio),
                exponent: r3(wall_ratio.ln() / size_ratio.ln()),
            });
        }
    }
    Ok(Sweep {
        simulated: format!(
            "subscribed devices are simulated: the query's input arrays name N devices (each its own \
             user, {k} conversations each, {g} users per conversation); no WebSocket connections"
        ),
        convs_per_device: k,
        users_per_conversation: g,
        head: HEAD,
        rows,
        growth,
        gateway_sweep_interval_ms_default: 1000,
        gateway_db_timeout_ms_default: 5000,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_lagging_query_is_found_in_store_rs() {
        let sql = super::lagging_sql().unwrap();
        assert!(
            sql.contains("im_visible_head") && sql.contains("$2::text[]"),
            "{sql}"
        );
    }
}
