//! Part 3, the sweep: the database time of the gateway's own sweep queries
//! (`im_gateway::store::lagging_of_pairs` / `lagging_of_installs`, as `im_gateway::sweep`
//! calls them) for growing numbers of subscribed devices with 20 conversations each and 0% /
//! 1% of (device, conversation) pairs lagging:
//!
//! - the **regular sweep** (every `IM_SWEEP_MS`) asks only about the pairs pushed and not
//!   yet acked since the last sweep ([`CANDIDATES`] of them, see there) and hints the pairs it
//!   already knows to lag from memory; its wall time per interval is measured, and checked
//!   to find every lagging candidate;
//! - the **full pass** (at start, after a LISTEN loss, every
//!   `sweep::FULL_PASS_EVERY_INTERVALS`) asks about every install in pages of
//!   `sweep::PAGE_INSTALLS`; every page's wall time (the stale-install check and the
//!   lagging query) is measured, and the set of pairs it finds is compared with the set
//!   seeded: a missed or an extra pair fails the part.
//!
//! The devices are simulated: the queries' input arrays name them; no WebSocket connection
//! exists (0 real sockets: the in-memory half of the sweep, the hub and the hints, is not
//! measured here; `06-sweep-cost-at-target-scale` runs the same queries through the
//! gateway's module). The rows are provisioned with bulk SQL (generate_series, in key order,
//! foreign-key triggers off for the provisioning session only: the data is consistent by
//! construction).

use anyhow::{bail, Context};
use sqlx::{PgPool, Row};
use std::collections::BTreeSet;
use std::time::Instant;

use crate::pgss;
use crate::result::{Explain, FullPassRow, Sweep, SweepGrowth, SweepRow};
use crate::util::{progress, r3};
use crate::Ctx;
use im_gateway::sweep::PAGE_INSTALLS;

/// The gateway's default `IM_DB_TIMEOUT_MS`: the deadline of every sweep query.
const DB_TIMEOUT_MS: u64 = 5000;

/// Heads of the sweep's conversations; cursors sit at HEAD, lagging ones at HEAD - 1.
const HEAD: i64 = 10;

/// Candidate pairs of one regular sweep: pushes not yet acked when it runs. At the note's
/// chapter-02 load (9,067 push frames/s) this is about 110 ms of pushes, generous for acks
/// that take milliseconds. At 1% lagging they are drawn from the lagging pairs (lost pushes
/// to find); at 0% from pairs that caught up.
pub const CANDIDATES: usize = 1000;

fn ids(prefix: &str, from: usize, to: usize) -> Vec<String> {
    (from..to).map(|i| format!("{prefix}{i:07}")).collect()
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

/// EXPLAIN ANALYZE of the regular sweep's query on these candidates.
async fn explain(pool: &PgPool, c: &Candidates) -> anyhow::Result<Explain> {
    let sql = im_gateway::store::sweep_sql()
        .into_iter()
        .find(|(name, _)| *name == "pairs")
        .map(|(_, sql)| sql)
        .context("store::sweep_sql has no `pairs` query")?;
    let row = sqlx::query(&format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}"))
        .bind(&c.devices)
        .bind(&c.epochs)
        .bind(&c.convs)
        .bind(&c.seqs)
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

/// The pairs seeded lagging, as `(device, conv)`.
async fn seeded(pool: &PgPool) -> anyhow::Result<BTreeSet<(String, String)>> {
    let rows = sqlx::query(
        "SELECT device_id, conv_id FROM device_cursors
         WHERE device_id LIKE 'sw-%' AND delivered_seq < $1",
    )
    .bind(HEAD)
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// One regular sweep's input: candidate pairs as `store::lagging_of_pairs` takes them
/// (pushed seq: the head), ordered as the gateway orders them.
#[derive(Default)]
struct Candidates {
    devices: Vec<String>,
    epochs: Vec<i64>,
    convs: Vec<String>,
    seqs: Vec<i64>,
}

impl Candidates {
    fn from(mut pairs: Vec<(usize, usize)>) -> Candidates {
        pairs.sort_unstable();
        let mut c = Candidates::default();
        for (device, conv) in pairs {
            c.devices.push(format!("sw-d{device:07}"));
            c.epochs.push(1);
            c.convs.push(format!("sw-c{conv:07}"));
            c.seqs.push(HEAD);
        }
        c
    }
}

/// A deterministic pseudo-random sequence (splitmix64).
fn next(seed: &mut u64) -> u64 {
    *seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *seed;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Device index of `sw-dNNNNNNN` / conversation index of `sw-cNNNNNNN`.
fn index(id: &str) -> usize {
    id[4..].parse().unwrap_or(0)
}

/// The regular sweep's candidates: drawn from the lagging pairs when there are any, else
/// from every pair (device i's conversations are (i / g) * k .. + k).
fn candidates(
    lagging: &BTreeSet<(String, String)>,
    n: usize,
    k: usize,
    g: usize,
    seed: &mut u64,
) -> Candidates {
    let mut pairs = Vec::new();
    if lagging.is_empty() {
        for _ in 0..CANDIDATES.min(n * k) {
            let d = (next(seed) % n as u64) as usize;
            let conv = (d / g) * k + (next(seed) % k as u64) as usize;
            pairs.push((d, conv));
        }
    } else {
        let all: Vec<&(String, String)> = lagging.iter().collect();
        for _ in 0..CANDIDATES.min(all.len()) {
            let (d, conv) = all[(next(seed) % all.len() as u64) as usize];
            pairs.push((index(d), index(conv)));
        }
    }
    Candidates::from(pairs)
}

/// One full pass over devices `0..n`, page by page as the gateway's sweep runs it (the
/// stale-install check, then the lagging query). Returns the pairs found and each page's
/// wall time.
async fn full_pass(
    pool: &PgPool,
    n: usize,
) -> anyhow::Result<(BTreeSet<(String, String)>, Vec<f64>)> {
    let mut found = BTreeSet::new();
    let mut pages = Vec::new();
    let mut from = 0;
    while from < n {
        let to = (from + PAGE_INSTALLS).min(n);
        let devices = ids("sw-d", from, to);
        let users = ids("sw-u", from, to);
        let epochs = vec![1i64; to - from];
        let t = Instant::now();
        let (stale, rows) = im_gateway::sweep::installs_page(
            pool,
            std::time::Duration::from_millis(DB_TIMEOUT_MS),
            &devices,
            &users,
            &epochs,
        )
        .await
        .context("sweep::installs_page")?;
        pages.push(r3(t.elapsed().as_secs_f64() * 1000.0));
        if !stale.is_empty() {
            bail!(
                "full pass: {} simulated installs reported stale",
                stale.len()
            );
        }
        for (d, e, conv, head) in rows {
            if e != 1 || head != HEAD {
                bail!("full pass: {d}/{conv} epoch {e} head {head}, expected epoch 1 head {HEAD}");
            }
            found.insert((d, conv));
        }
        from = to;
    }
    Ok((found, pages))
}

type Pairs = BTreeSet<(String, String)>;

pub async fn run(ctx: &Ctx) -> anyhow::Result<Sweep> {
    let p = &ctx.params;
    let (k, g) = (p.sweep_convs_per_device, p.sweep_users_per_conversation);
    let mut sizes: Vec<usize> = p.sweep_devices.iter().map(|&n| n.div_ceil(g) * g).collect();
    sizes.sort_unstable();
    sizes.dedup();
    set_unlogged(&ctx.pool).await?;
    let mut seed = ctx.params.seed;
    let mut rows = Vec::new();
    let mut have = 0usize;
    for (si, &n) in sizes.iter().enumerate() {
        let step = |what: &str| {
            progress(&format!(
                "[sweep {}/{}] {n} devices: {what}",
                si + 1,
                sizes.len()
            ))
        };
        step(&format!("provisioning x {k} conversations"));
        let t = Instant::now();
        grow(&ctx.pool, have, n, k, g).await?;
        have = n;
        let provision_s = r3(t.elapsed().as_secs_f64());
        let pairs = (n * k) as u64;
        for (li, &lag) in p.sweep_lag_percents.iter().enumerate() {
            rows.push(lag_row(ctx, n, li, lag, pairs, provision_s, &mut seed, &step).await?);
        }
        set_lag(&ctx.pool, 0.0).await?;
    }
    let growth = growth(&rows, &p.sweep_lag_percents);
    Ok(Sweep {
        simulated: format!(
            "0 real sockets: subscribed devices are simulated, named in the sweep queries' input \
             arrays (each its own user, {k} conversations each, {g} users per conversation). The \
             regular sweep asks about {CANDIDATES} candidate pairs per interval (pushes not yet \
             acked; at 1% lagging all lagging, the rest of the lagging set hinted from memory, no \
             query); the full pass asks about every install in pages of {PAGE_INSTALLS}"
        ),
        convs_per_device: k,
        users_per_conversation: g,
        head: HEAD,
        rows,
        growth,
        gateway_sweep_interval_ms_default: 1000,
        gateway_db_timeout_ms_default: DB_TIMEOUT_MS,
        full_pass_every_intervals: im_gateway::sweep::FULL_PASS_EVERY_INTERVALS,
    })
}

/// Bulk provisioning writes about four million rows at 100k devices; unlogged tables
/// skip their WAL (reads go through the same buffers). Nothing after this part needs
/// these two tables to survive a crash: the repair part has its own cluster.
async fn set_unlogged(pool: &sqlx::PgPool) -> anyhow::Result<()> {
    for t in ["memberships", "device_cursors"] {
        sqlx::query(&format!("ALTER TABLE {t} SET UNLOGGED"))
            .execute(pool)
            .await
            .with_context(|| format!("ALTER TABLE {t} SET UNLOGGED"))?;
    }
    Ok(())
}

/// One row of the sweep: `n` devices with `lag`% of their pairs lagging, measured by a
/// full pass (when due), the regular sweep and, at the last lag, EXPLAIN ANALYZE.
#[allow(clippy::too_many_arguments)]
async fn lag_row(
    ctx: &Ctx,
    n: usize,
    li: usize,
    lag: f64,
    pairs: u64,
    provision_s: f64,
    seed: &mut u64,
    step: &dyn Fn(&str),
) -> anyhow::Result<SweepRow> {
    let p = &ctx.params;
    let (k, g) = (p.sweep_convs_per_device, p.sweep_users_per_conversation);
    set_lag(&ctx.pool, lag).await?;
    let lagging = seeded(&ctx.pool).await?;
    let last_lag = li + 1 == p.sweep_lag_percents.len();
    // The full pass: at every lag up to 10k devices, at the last lag above.
    let full = if last_lag || n <= 10_000 {
        step(&format!("{lag}% lagging: full pass"));
        Some(measure_full_pass(ctx, n, lag, pairs, &lagging).await?)
    } else {
        None
    };
    // The regular sweep: one interval's candidates, repeated.
    let cands = candidates(&lagging, n, k, g, seed);
    let (wall, returned, db_exec_ms) = measure_regular(ctx, n, lag, &cands, &lagging, step).await?;
    let explain = if last_lag && n <= p.sweep_explain_max_devices {
        step(&format!("{lag}% lagging: EXPLAIN ANALYZE"));
        Some(explain(&ctx.pool, &cands).await?)
    } else {
        None
    };
    let mut sorted = wall.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let median = sorted[sorted.len() / 2];
    let page_max = full.as_ref().map_or(0.0, |f| f.page_ms_max);
    Ok(SweepRow {
        devices: n,
        pairs,
        lag_percent: lag,
        lagging_pairs: lagging.len() as u64,
        rows_returned: returned,
        wall_ms_median: median,
        wall_ms: wall,
        db_exec_ms,
        explain,
        us_per_pair: full.as_ref().map_or(0.0, |f| f.us_per_pair),
        set_based_wall_ms: None,
        set_based_rows: None,
        set_based_vs_gateway: None,
        over_sweep_interval: median > 1000.0,
        over_db_timeout: median > DB_TIMEOUT_MS as f64 || page_max > DB_TIMEOUT_MS as f64,
        provision_s: if li == 0 { provision_s } else { 0.0 },
        interval_candidates: cands.devices.len() as u64,
        hinted_from_memory: lagging.len() as u64,
        full_pass: full,
    })
}

/// One full pass over `n` devices with `lag`% of their pairs lagging: it must find exactly
/// the `lagging` pairs.
async fn measure_full_pass(
    ctx: &Ctx,
    n: usize,
    lag: f64,
    pairs: u64,
    lagging: &Pairs,
) -> anyhow::Result<FullPassRow> {
    if ctx.pgss {
        pgss::reset(&ctx.pool).await;
    }
    let t = Instant::now();
    let (found, pages) = full_pass(&ctx.pool, n).await?;
    let wall_ms = r3(t.elapsed().as_secs_f64() * 1000.0);
    let missed = lagging.difference(&found).count() as u64;
    let extra = found.difference(lagging).count() as u64;
    if missed > 0 || extra > 0 {
        bail!(
            "full pass at {n} devices, {lag}% lagging: {missed} lagging pairs missed, \
             {extra} found that were not seeded (of {} seeded)",
            lagging.len()
        );
    }
    let db_ms = if ctx.pgss {
        let stmts = pgss::snapshot(&ctx.pool).await;
        let (total, calls) = pgss::by_label(&stmts, "sweep");
        (calls > 0).then(|| r3(total))
    } else {
        None
    };
    Ok(FullPassRow {
        pages: pages.len(),
        page_installs: PAGE_INSTALLS,
        wall_ms,
        page_ms_max: pages.iter().copied().fold(0.0, f64::max),
        db_ms,
        found: found.len() as u64,
        missed,
        extra,
        us_per_pair: r3(wall_ms * 1000.0 / pairs.max(1) as f64),
    })
}

/// The regular sweep's query on one interval's candidates, `sweep_repeats` times: it must
/// return exactly the candidates that lag. Each run's wall time (ms), the rows it returned,
/// and the database's mean execution time (with `pg_stat_statements`).
async fn measure_regular(
    ctx: &Ctx,
    n: usize,
    lag: f64,
    cands: &Candidates,
    lagging: &Pairs,
    step: &dyn Fn(&str),
) -> anyhow::Result<(Vec<f64>, u64, Option<f64>)> {
    let expect: Pairs = cands
        .devices
        .iter()
        .zip(&cands.convs)
        .map(|(d, c)| (d.clone(), c.clone()))
        .filter(|x| lagging.contains(x))
        .collect();
    let repeats = ctx.params.sweep_repeats.max(1);
    let mut wall = Vec::new();
    let mut returned = 0u64;
    if ctx.pgss {
        pgss::reset(&ctx.pool).await;
    }
    for r in 0..repeats {
        step(&format!(
            "{lag}% lagging: regular sweep {}/{repeats}",
            r + 1
        ));
        let t = Instant::now();
        let got = im_gateway::store::lagging_of_pairs(
            &ctx.pool,
            &cands.devices,
            &cands.epochs,
            &cands.convs,
            &cands.seqs,
        )
        .await
        .context("store::lagging_of_pairs")?;
        wall.push(r3(t.elapsed().as_secs_f64() * 1000.0));
        let got: Pairs = got.into_iter().map(|(d, _, c, _)| (d, c)).collect();
        if got != expect {
            bail!(
                "regular sweep at {n} devices, {lag}% lagging: found {} of {} lagging candidates \
                 ({} not lagging among them)",
                got.intersection(&expect).count(),
                expect.len(),
                got.difference(&expect).count()
            );
        }
        returned = got.len() as u64;
    }
    let db_exec_ms = if ctx.pgss {
        let stmts = pgss::snapshot(&ctx.pool).await;
        let (total, calls) = pgss::by_label(&stmts, "sweep");
        (calls > 0).then(|| r3(total / calls as f64))
    } else {
        None
    };
    Ok((wall, returned, db_exec_ms))
}

/// How the regular sweep's median grows from one size to the next, at each lag.
fn growth(rows: &[SweepRow], lags: &[f64]) -> Vec<SweepGrowth> {
    let mut growth = Vec::new();
    for &lag in lags {
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
    growth
}

#[cfg(test)]
mod tests {
    #[test]
    fn candidates_name_pairs_that_exist() {
        let (n, k, g) = (100, 20, 10);
        let mut seed = 1;
        let c = super::candidates(&Default::default(), n, k, g, &mut seed);
        assert_eq!(c.devices.len(), super::CANDIDATES);
        for (d, conv) in c.devices.iter().zip(&c.convs) {
            let (d, conv) = (super::index(d), super::index(conv));
            assert!(d < n && conv / k == d / g, "{d} {conv}");
        }
    }
}
