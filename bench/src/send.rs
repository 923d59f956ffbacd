//! Part 1, the send path: acknowledged sends per second and send latency through the real
//! gateway at 1, 8 and 32 concurrent senders (each its own connection and device, picking
//! one of many conversations at random, closed loop), against pgbench running the same
//! transaction shape on the same cluster without and with NOTIFY. The gateway is stopped
//! while pgbench runs, so neither competes with the other for the two cores.

use anyhow::Context;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use crate::cpu::{self, per_op};
use crate::pgss;
use crate::provision::{self, Device};
use crate::result::{DataCheck, PgbenchCheck, SendLevel, SendPath, SendRatios, SendRun, Verdict};
use crate::util::{now_us, progress, ratio, summarize_us, Latency, Rng};
use crate::wire;
use crate::Ctx;

struct SenderOut {
    lat_us: Vec<i64>,
    errors: u64,
    acked: Vec<(String, String)>,
}

/// One sender: send, wait for the reply, repeat, until `end`.
#[allow(clippy::too_many_arguments)]
async fn closed_loop(
    mut ws: wire::Ws,
    idx: usize,
    user: String,
    convs: Arc<Vec<String>>,
    body: Arc<String>,
    mut rng: Rng,
    warm: Instant,
    end: Instant,
    counter: Arc<AtomicU64>,
) -> SenderOut {
    let mut out = SenderOut {
        lat_us: Vec::new(),
        errors: 0,
        acked: Vec::new(),
    };
    let mut n: u64 = 0;
    while Instant::now() < end {
        n += 1;
        let conv = &convs[rng.below(convs.len() as u64) as usize];
        // `idx` is unique per level and sender: a reused cmid would be a duplicate (D2).
        let cmid = format!("g{idx}-{n}");
        let rid = format!("s{n}");
        let started = Instant::now();
        let t0 = now_us();
        let frame = wire::send_frame(&rid, conv, &cmid, &body);
        match wire::request(&mut ws, frame, &rid, Duration::from_secs(10)).await {
            Ok(f) if wire::sent(&f).is_some_and(|(_, dup)| !dup) => {
                let dt = now_us() - t0;
                counter.fetch_add(1, Ordering::Relaxed);
                out.acked.push((user.clone(), cmid));
                if started >= warm && Instant::now() <= end {
                    out.lat_us.push(dt);
                }
            }
            Ok(_) => out.errors += 1,
            Err(_) => {
                out.errors += 1;
                break; // the connection is unusable
            }
        }
    }
    let _ = ws.close(None).await;
    out
}

/// Ticks the progress line while a timed run goes on.
pub fn ticker(label: String, total_s: f64, counter: Arc<AtomicU64>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if !crate::util::ticking() {
            return;
        }
        let t0 = Instant::now();
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            progress(&format!(
                "{label}  {:>4.1}/{total_s:.0} s  {} done",
                t0.elapsed().as_secs_f64(),
                counter.load(Ordering::Relaxed)
            ));
        }
    })
}

fn db_per_op(stmts: &[pgss::StmtStat], ops: u64) -> (Option<f64>, BTreeMap<String, f64>) {
    if ops == 0 || stmts.is_empty() {
        return (None, BTreeMap::new());
    }
    let mut by: BTreeMap<String, f64> = BTreeMap::new();
    for s in stmts {
        *by.entry(s.label.clone()).or_default() += s.total_ms / ops as f64;
    }
    let total: f64 = by.values().sum();
    for v in by.values_mut() {
        *v = crate::util::r3(*v);
    }
    (Some(crate::util::r3(total)), by)
}

/// One measured run of one driver (a round); a level's rounds are merged per driver.
#[derive(Clone, Default)]
struct Round {
    /// Latencies inside the measured window, µs.
    lat_us: Vec<i64>,
    errors: u64,
    ops_total: u64,
    cpu: cpu::CpuUse,
    stmts: Vec<pgss::StmtStat>,
}

/// Sums rounds into one run: samples pooled, CPU and statement totals added.
fn merge(driver: &str, rounds: Vec<Round>, measured_s: u64, client_is_child: bool) -> SendRun {
    let mut lat = Vec::new();
    let (mut errors, mut ops_total) = (0, 0);
    let mut c = cpu::CpuUse::default();
    let mut busy_weighted = 0.0;
    let mut by_query: BTreeMap<String, pgss::StmtStat> = BTreeMap::new();
    for r in rounds {
        lat.extend(r.lat_us);
        errors += r.errors;
        ops_total += r.ops_total;
        c.wall_s += r.cpu.wall_s;
        c.gateway_ms += r.cpu.gateway_ms;
        c.postgres_ms += r.cpu.postgres_ms;
        c.bench_ms += r.cpu.bench_ms;
        c.bench_children_ms += r.cpu.bench_children_ms;
        c.others_ms += r.cpu.others_ms;
        busy_weighted += r.cpu.machine_busy_pct * r.cpu.wall_s;
        for st in r.stmts {
            let e = by_query
                .entry(st.query.clone())
                .or_insert_with(|| pgss::StmtStat {
                    label: st.label.clone(),
                    query: st.query.clone(),
                    ..Default::default()
                });
            e.calls += st.calls;
            e.total_ms += st.total_ms;
        }
    }
    round_cpu(&mut c, busy_weighted);
    let stmts = merged_stmts(by_query);
    let ops = lat.len() as u64;
    let (db, by) = db_per_op(&stmts, ops_total);
    let rows_per_batch = (driver == "gateway")
        .then(|| rows_per_batch(&stmts, ops_total))
        .flatten();
    SendRun {
        driver: driver.into(),
        ops,
        ops_per_s: crate::util::r3(ops as f64 / measured_s.max(1) as f64),
        latency: summarize_us(&mut lat),
        errors,
        ops_total,
        cpu_per_op: per_op(&c, ops_total, client_is_child),
        cpu: c,
        statements: stmts,
        db_ms_per_op: db,
        db_ms_per_op_by_label: by,
        rows_per_batch,
    }
}

/// Operations per call of the `send_batch` statement (sends per group commit); `None`
/// when no such call was recorded.
fn rows_per_batch(stmts: &[pgss::StmtStat], ops_total: u64) -> Option<f64> {
    let batches: u64 = stmts
        .iter()
        .filter(|s| s.label == "send_batch")
        .map(|s| s.calls)
        .sum();
    (batches > 0).then(|| crate::util::r3(ops_total as f64 / batches as f64))
}

/// The merged CPU use: machine busy weighted by each round's wall time, every total
/// rounded.
fn round_cpu(c: &mut cpu::CpuUse, busy_weighted: f64) {
    c.machine_busy_pct = if c.wall_s > 0.0 {
        crate::util::r3(busy_weighted / c.wall_s)
    } else {
        0.0
    };
    for x in [
        &mut c.wall_s,
        &mut c.gateway_ms,
        &mut c.postgres_ms,
        &mut c.bench_ms,
        &mut c.bench_children_ms,
        &mut c.others_ms,
    ] {
        *x = crate::util::r3(*x);
    }
}

/// The merged statements, totals and means rounded, the costliest first.
fn merged_stmts(by_query: BTreeMap<String, pgss::StmtStat>) -> Vec<pgss::StmtStat> {
    let mut stmts: Vec<pgss::StmtStat> = by_query
        .into_values()
        .map(|mut s| {
            s.total_ms = crate::util::r3(s.total_ms);
            s.mean_ms = if s.calls > 0 {
                crate::util::r3(s.total_ms / s.calls as f64)
            } else {
                0.0
            };
            s
        })
        .collect();
    stmts.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms));
    stmts
}

/// One gateway round: a fresh gateway, `c` closed-loop senders, then SIGTERM. Returns the
/// round and every acknowledged (user, cmid).
#[allow(clippy::too_many_arguments)]
async fn gateway_round(
    ctx: &Ctx,
    devices: &[Device],
    users: &[String],
    convs: &Arc<Vec<String>>,
    body: &Arc<String>,
    c: usize,
    id_base: usize,
    label: &str,
) -> anyhow::Result<(Round, Vec<(String, String)>)> {
    let p = &ctx.params;
    let mut gw = ctx.start_gateway().await?;
    let url = gw.ws_url();
    let conns = futures_util::future::try_join_all(
        devices
            .iter()
            .take(c)
            .map(|d| wire::open(&url, &d.id, &d.token)),
    )
    .await
    .context("open sender connections")?;
    let probe = ctx.probe(Some(gw.pid()));
    if ctx.pgss {
        pgss::reset(&ctx.pool).await;
    }
    let before = probe.sample();
    let start = Instant::now();
    let warm = start + Duration::from_secs(p.send_warmup_s);
    let end = warm + Duration::from_secs(p.send_duration_s);
    let counter = Arc::new(AtomicU64::new(0));
    let window = p.send_warmup_s as f64 + p.send_duration_s as f64;
    let tick = ticker(label.to_string(), window, counter.clone());
    let mut tasks = Vec::new();
    for (i, ws) in conns.into_iter().enumerate() {
        tasks.push(tokio::spawn(closed_loop(
            ws,
            // Unique per level, round and sender: a reused cmid would be a duplicate (D2).
            id_base + i,
            users[i].clone(),
            convs.clone(),
            body.clone(),
            Rng::new(p.seed ^ ((id_base as u64) << 20) ^ i as u64),
            warm,
            end,
            counter.clone(),
        )));
    }
    let mut round = Round::default();
    let mut acked = Vec::new();
    for t in tasks {
        let o = t.await.context("join a sender")?;
        round.lat_us.extend(o.lat_us);
        round.errors += o.errors;
        round.ops_total += o.acked.len() as u64;
        acked.extend(o.acked);
    }
    tick.abort();
    let after = probe.sample();
    round.stmts = if ctx.pgss {
        pgss::snapshot(&ctx.pool).await
    } else {
        Vec::new()
    };
    round.cpu = cpu::delta(&before, &after);
    let _ = gw.terminate(Duration::from_secs(10)).await;
    Ok((round, acked))
}

/// One pgbench round of the given script.
async fn pgbench_round(
    ctx: &Ctx,
    bin: &std::path::Path,
    script: &str,
    c: usize,
    async_commit: bool,
    tag: &str,
) -> anyhow::Result<Round> {
    let p = &ctx.params;
    let probe = ctx.probe(None);
    if ctx.pgss {
        pgss::reset(&ctx.pool).await;
    }
    let before = probe.sample();
    let o = crate::pgbench::run(
        bin,
        ctx.cluster.port(),
        script,
        c,
        p.send_warmup_s,
        p.send_duration_s,
        &ctx.tmp.join("pgbench"),
        tag,
        async_commit,
    )
    .await?;
    let after = probe.sample();
    Ok(Round {
        lat_us: o.lat_us,
        errors: o.errors,
        ops_total: o.ops_total,
        cpu: cpu::delta(&before, &after),
        stmts: if ctx.pgss {
            pgss::snapshot(&ctx.pool).await
        } else {
            Vec::new()
        },
    })
}

/// Round trips on one idle connection: a bare protocol Sync (what sqlx's `ping` sends,
/// which the gateway's pool does before handing out a connection idle for 1 s or more) and
/// a `SELECT 1`. Each costs what one extra round trip per request costs on this machine.
async fn round_trips(pool: &sqlx::PgPool, n: usize) -> anyhow::Result<(Latency, Latency)> {
    use sqlx::Connection;
    let mut conn = pool.acquire().await.context("acquire a connection")?;
    let (mut ping, mut select) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        let t = now_us();
        conn.ping().await.context("ping")?;
        ping.push(now_us() - t);
        let t = now_us();
        sqlx::query("SELECT 1")
            .execute(&mut *conn)
            .await
            .context("SELECT 1")?;
        select.push(now_us() - t);
    }
    Ok((summarize_us(&mut ping), summarize_us(&mut select)))
}

/// The send part's world: conversations every sender is a member of, one user and device
/// per sender at the highest concurrency, the body, and pgbench's scripts.
struct World {
    convs: Arc<Vec<String>>,
    users: Vec<String>,
    devices: Vec<Device>,
    body: Arc<String>,
    /// (a) one INSERT per transaction; (b) the same with NOTIFY.
    script_plain: String,
    script_notify: String,
}

impl World {
    async fn provision(ctx: &Ctx) -> anyhow::Result<World> {
        let p = &ctx.params;
        let max_c = p.send_concurrency.iter().copied().max().unwrap_or(1);
        let convs: Vec<String> = (0..p.send_conversations)
            .map(|i| format!("sp-c{i}"))
            .collect();
        let users: Vec<String> = (0..max_c).map(|i| format!("sp-u{i}")).collect();
        let devices: Vec<Device> = (0..max_c)
            .map(|i| Device::new(format!("sp-d{i}"), &users[i]))
            .collect();
        let world: Vec<(String, Vec<String>)> =
            convs.iter().map(|c| (c.clone(), users.clone())).collect();
        provision::world(&ctx.pool, &users, &devices, &world).await?;
        let body = Arc::new("x".repeat(p.body_bytes));
        Ok(World {
            script_plain: crate::pgbench::script(p.send_conversations, &body, false),
            script_notify: crate::pgbench::script(p.send_conversations, &body, true),
            convs: Arc::new(convs),
            users,
            devices,
            body,
        })
    }
}

/// What every level adds up: the messages the gateway acknowledged and those pgbench
/// logged (each must be a row at the end).
#[derive(Default)]
struct Tallies {
    acked: Vec<(String, String)>,
    pgbench_logged: u64,
}

pub async fn run(ctx: &Ctx) -> anyhow::Result<SendPath> {
    let p = &ctx.params;
    let (round_trip_ping, round_trip_select1) = round_trips(&ctx.pool, 300).await?;
    let w = World::provision(ctx).await?;
    let mut t = Tallies::default();
    let mut levels = Vec::new();
    for (li, &c) in p.send_concurrency.iter().enumerate() {
        levels.push(level(ctx, &w, li, c, &mut t).await?);
    }
    // --- every acknowledged send is a row
    let found = provision::count_present(&ctx.pool, &t.acked).await?;
    let gapless = provision::gapless(&ctx.pool, "sp-c").await?;
    let acknowledged = t.acked.len() as u64;
    let lost = acknowledged.saturating_sub(found);
    let rows: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM events WHERE conv_id LIKE 'sp-c%'
           AND (cmid LIKE 'pa-%' OR cmid LIKE 'pb-%' OR cmid LIKE 'pc-%')",
    )
    .fetch_one(&ctx.pool)
    .await
    .context("count pgbench rows")?;
    let rows = rows.max(0) as u64;
    Ok(SendPath {
        conversations: p.send_conversations,
        body_bytes: p.body_bytes,
        warmup_s: p.send_warmup_s,
        duration_s: p.send_duration_s,
        rounds: p.send_rounds.max(1),
        gateway_db_pool_max: 16,
        round_trip_ping,
        round_trip_select1,
        pgbench_script_plain: w.script_plain,
        pgbench_script_notify: w.script_notify,
        levels,
        data_check: DataCheck::new(acknowledged, found, lost, gapless),
        pgbench_check: PgbenchCheck {
            result: Verdict::of(rows >= t.pgbench_logged),
            logged: t.pgbench_logged,
            rows,
        },
    })
}

/// One concurrency level `c` (the `li`-th): every driver's rounds, merged, and the ratios.
async fn level(
    ctx: &Ctx,
    w: &World,
    li: usize,
    c: usize,
    t: &mut Tallies,
) -> anyhow::Result<SendLevel> {
    let p = &ctx.params;
    let rounds = p.send_rounds.max(1);
    // (d) issue 19's true ceiling: pgbench committing the gateway's batch size, as the
    // gateway would gather it (its senders spread over IM_BATCH_SLOTS slots).
    let batch_rows = (c / ctx.batch_slots()).max(1);
    let script_d = crate::pgbench::batch_script(p.send_conversations, &w.body, batch_rows);
    let drivers = drivers(w, &script_d);
    // Rounds in ABBA order (gateway, a, b, c, then c, b, a, gateway, ...): a load that
    // drifts during the level weighs on every driver alike, so the ratios hold.
    let mut got: Vec<Vec<Round>> = vec![Vec::new(); drivers.len()];
    for r in 0..rounds {
        let order: Vec<usize> = if r % 2 == 0 {
            vec![0, 1, 2, 3, 4]
        } else {
            vec![4, 3, 2, 1, 0]
        };
        for d in order {
            let (tag, script) = drivers[d];
            let label = format!(
                "[send {}/{} round {}/{rounds}] {tag}, {c} clients",
                li + 1,
                p.send_concurrency.len(),
                r + 1
            );
            progress(&label);
            let round = match script {
                None => {
                    let id_base = (li * rounds + r) * 1000;
                    let (round, acked) = gateway_round(
                        ctx, &w.devices, &w.users, &w.convs, &w.body, c, id_base, &label,
                    )
                    .await?;
                    t.acked.extend(acked);
                    round
                }
                Some((script, async_commit)) => {
                    let Some(bin) = ctx.pgbench.as_ref() else {
                        continue;
                    };
                    pgbench_driver_round(ctx, bin, tag, script, async_commit, c, r, batch_rows, t)
                        .await?
                }
            };
            got[d].push(round);
        }
    }
    let runs = merge_drivers(got, &drivers, p.send_duration_s * rounds as u64);
    level_of(c, runs, batch_rows)
}

/// A driver's tag and, for pgbench, its script and whether its sessions commit
/// asynchronously.
type Driver<'a> = (&'static str, Option<(&'a String, bool)>);

/// The level's drivers, in the order of [`level_of`]: the gateway, then pgbench (a) plain,
/// (b) with NOTIFY, (c) (b) with asynchronous commit, (d) the gateway's batches.
fn drivers<'a>(w: &'a World, script_d: &'a String) -> [Driver<'a>; 5] {
    [
        ("gateway", None),
        ("pgbench_plain", Some((&w.script_plain, false))),
        ("pgbench_notify", Some((&w.script_notify, false))),
        // (c) is (b) with synchronous_commit=off for pgbench's sessions only: what the
        // WAL flush at commit costs (the server setting stays on).
        (
            "pgbench_notify_async_commit",
            Some((&w.script_notify, true)),
        ),
        ("pgbench_batch", Some((script_d, false))),
    ]
}

/// Round `r` of pgbench driver `tag` at `c` clients; adds the messages it stored to
/// `t.pgbench_logged`.
#[allow(clippy::too_many_arguments)]
async fn pgbench_driver_round(
    ctx: &Ctx,
    bin: &std::path::Path,
    tag: &str,
    script: &str,
    async_commit: bool,
    c: usize,
    r: usize,
    batch_rows: usize,
    t: &mut Tallies,
) -> anyhow::Result<Round> {
    // (d) runs as many transactions at once as the gateway runs batches
    // (its slots), each of the batch the gateway gathers; a batch
    // transaction stores `batch_rows` messages.
    let (clients, per_tx) = if tag == "pgbench_batch" {
        (c.min(ctx.batch_slots()), batch_rows)
    } else {
        (c, 1)
    };
    let name = format!("{tag}-c{c}-r{r}");
    let round = pgbench_round(ctx, bin, script, clients, async_commit, &name).await?;
    t.pgbench_logged += round.ops_total * per_tx as u64;
    Ok(round)
}

/// Each driver's rounds merged into one run (`None` for a driver that never ran).
fn merge_drivers(
    got: Vec<Vec<Round>>,
    drivers: &[Driver<'_>],
    measured_s: u64,
) -> Vec<Option<SendRun>> {
    got.into_iter()
        .zip(drivers.iter())
        .map(|(rs, (tag, script))| {
            (!rs.is_empty()).then(|| merge(tag, rs, measured_s, script.is_some()))
        })
        .collect()
}

/// A level from its drivers' merged runs (in `level`'s driver order), with the ratios.
fn level_of(
    c: usize,
    mut runs: Vec<Option<SendRun>>,
    batch_rows: usize,
) -> anyhow::Result<SendLevel> {
    let pgbench_batch = runs.pop().flatten().map(|mut r| {
        // Messages, not transactions (latency and the per-op figures stay per
        // transaction of `batch_rows` messages).
        r.ops *= batch_rows as u64;
        r.ops_per_s = crate::util::r3(r.ops_per_s * batch_rows as f64);
        r
    });
    let pgbench_notify_async_commit = runs.pop().flatten();
    let pgbench_notify = runs.pop().flatten();
    let pgbench_plain = runs.pop().flatten();
    let gateway = runs.pop().flatten().context("no gateway round")?;
    let tps = |r: &Option<SendRun>| r.as_ref().map(|r| r.ops_per_s).unwrap_or(0.0);
    let ratios = SendRatios {
        gateway_vs_pgbench_notify_throughput: ratio(gateway.ops_per_s, tps(&pgbench_notify)),
        gateway_vs_pgbench_plain_throughput: ratio(gateway.ops_per_s, tps(&pgbench_plain)),
        gateway_vs_pgbench_batch_throughput: ratio(gateway.ops_per_s, tps(&pgbench_batch)),
        pgbench_notify_vs_plain_throughput: ratio(tps(&pgbench_notify), tps(&pgbench_plain)),
        pgbench_sync_vs_async_commit_throughput: ratio(
            tps(&pgbench_notify),
            tps(&pgbench_notify_async_commit),
        ),
        gateway_vs_pgbench_notify_p50_latency: pgbench_notify
            .as_ref()
            .and_then(|r| ratio(gateway.latency.p50_ms, r.latency.p50_ms)),
        gateway_vs_pgbench_notify_p99_latency: pgbench_notify
            .as_ref()
            .and_then(|r| ratio(gateway.latency.p99_ms, r.latency.p99_ms)),
    };
    Ok(SendLevel {
        concurrency: c,
        gateway,
        pgbench_plain,
        pgbench_notify,
        pgbench_notify_async_commit,
        pgbench_batch,
        pgbench_batch_rows: batch_rows,
        ratios,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sends per group commit: operations over the calls of `send_batch` only (the
    /// notify and member checks do not count), none without such a call.
    #[test]
    fn rows_per_batch_counts_send_batch_calls_only() {
        let stat = |label: &str, calls: u64| pgss::StmtStat {
            label: label.into(),
            calls,
            ..Default::default()
        };
        let stmts = [
            stat("send_batch", 400),
            stat("notify", 390),
            stat("other", 5),
        ];
        assert_eq!(rows_per_batch(&stmts, 1000), Some(2.5));
        assert_eq!(rows_per_batch(&stmts[1..], 1000), None);
    }
}
