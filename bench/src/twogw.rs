//! Part `two_gateways` (issue 12, item 4): the same closed-loop load against one gateway
//! and spread over two gateway processes on the same database, in one run, in ABBA order
//! (one, two, two, one; half the time each round) so a drifting machine load weighs on both
//! alike.
//! Each conversation has one sending device (not subscribed) and `receivers` subscribed
//! devices (the lean receiver of `wire`); with two gateways, senders and receivers
//! alternate between them, so most pushes cross from one gateway to the other (through
//! PostgreSQL's NOTIFY). Reports acknowledged sends/s and pushes/s of each and their ratio,
//! and checks that every acknowledged send is one row, seqs gapless (P1).

use anyhow::{bail, Context};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

use crate::provision::{self, Device};
use crate::result::{DataCheck, TwoGateways, TwoGatewaysRun};
use crate::util::{progress, r3, secs};
use crate::{wire, Ctx};

/// Provisions round `k`'s conversations, each with one sending and `receivers` receiving
/// users and devices; returns the conversations, the senders and the receivers.
async fn provision_round(
    ctx: &Ctx,
    k: usize,
) -> anyhow::Result<(Vec<String>, Vec<Device>, Vec<Device>)> {
    let p = &ctx.params;
    let (nc, nr) = (p.two_gateways_conversations, p.two_gateways_receivers);
    let convs: Vec<String> = (0..nc).map(|c| format!("tg{k}-c{c}")).collect();
    let mut users = Vec::new();
    let mut senders = Vec::new();
    let mut receivers = Vec::new();
    let mut world = Vec::new();
    for (c, conv) in convs.iter().enumerate() {
        let su = format!("tg{k}-s{c}");
        senders.push(Device::new(format!("tg{k}-sd{c}"), &su));
        let mut members = vec![su.clone()];
        users.push(su);
        for r in 0..nr {
            let ru = format!("tg{k}-r{c}-{r}");
            receivers.push(Device::new(format!("tg{k}-rd{c}-{r}"), &ru));
            members.push(ru.clone());
            users.push(ru);
        }
        world.push((conv.clone(), members));
    }
    let devices: Vec<Device> = senders.iter().chain(&receivers).cloned().collect();
    provision::world(&ctx.pool, &users, &devices, &world).await?;
    Ok((convs, senders, receivers))
}

/// One closed-loop sender: sends to `conv` and waits for the reply until `stop`, logging
/// each new acknowledged cmid in `acked` and anything else in `errors`.
async fn send_loop(
    mut ws: wire::Ws,
    conv: &str,
    user: &str,
    body: &str,
    stop: &AtomicBool,
    errors: &Mutex<u64>,
    acked: &Mutex<Vec<(String, String)>>,
) {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let (rid, cmid) = (format!("r{n}"), format!("tg-{n}"));
        n += 1;
        let frame = wire::send_frame(&rid, conv, &cmid, body);
        match wire::request(&mut ws, frame, &rid, Duration::from_secs(10)).await {
            Ok(f) if wire::sent(&f).is_some_and(|(_, dup)| !dup) => {
                acked.lock().unwrap().push((user.to_owned(), cmid))
            }
            _ => *errors.lock().unwrap() += 1,
        }
    }
}

/// Provisions `tg<k>-*` (conversations, senders, receivers) and runs the load for
/// `duration` against `gateways` (device `i` of each role on gateway `i % n`); returns the
/// round's counts and its length, seconds.
async fn one_run(
    ctx: &Ctx,
    k: usize,
    gateways: &[harness::gateway::Gateway],
    duration: Duration,
    acked_all: &Arc<Mutex<Vec<(String, String)>>>,
) -> anyhow::Result<(TwoGatewaysRun, f64)> {
    let p = &ctx.params;
    let (convs, senders, receivers) = provision_round(ctx, k).await?;
    let url = |i: usize| gateways[i % gateways.len()].ws_url();

    let (stop_tx, stop_rx) = watch::channel(false);
    let mut logs = Vec::new();
    let mut tasks = Vec::new();
    for (i, d) in receivers.iter().enumerate() {
        let mut ws = wire::open(&url(i), &d.id, &d.token).await?;
        let subbed = wire::sub(&mut ws).await?;
        let (log, task) = wire::spawn_receiver(ws, subbed, stop_rx.clone());
        logs.push(log);
        tasks.push(task);
    }
    let mut conns = Vec::new();
    for (i, d) in senders.iter().enumerate() {
        conns.push(wire::open(&url(i + 1), &d.id, &d.token).await?);
    }
    let stop = AtomicBool::new(false);
    let errors = Mutex::new(0u64);
    let body = "x".repeat(p.body_bytes);
    let acked = Mutex::new(Vec::new());
    for l in &logs {
        l.lock().unwrap().take();
    }
    let t0 = std::time::Instant::now();
    let loops = conns.into_iter().enumerate().map(|(c, ws)| {
        let (stop, errors, acked, body, convs, senders) =
            (&stop, &errors, &acked, &body, &convs, &senders);
        send_loop(ws, &convs[c], &senders[c].user, body, stop, errors, acked)
    });
    let timer = async {
        tokio::time::sleep(duration).await;
        stop.store(true, Ordering::Relaxed);
    };
    let (_, _) = tokio::join!(futures_util::future::join_all(loops), timer);
    let elapsed = t0.elapsed().as_secs_f64();
    let pushes: u64 = logs.iter().map(|l| l.lock().unwrap().take().pushes).sum();
    let _ = stop_tx.send(true);
    for t in tasks {
        // A receiver that ended on its own (connection lost) ended its log too.
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    let acked = acked.into_inner().unwrap();
    let sends_acked = acked.len() as u64;
    acked_all.lock().unwrap().extend(acked);
    let run = TwoGatewaysRun {
        gateways: gateways.len(),
        sends_acked,
        pushes,
        send_errors: errors.into_inner().unwrap(),
        ..Default::default()
    };
    Ok((run, elapsed))
}

pub async fn run(ctx: &Ctx) -> anyhow::Result<TwoGateways> {
    let p = &ctx.params;
    let acked_all = Arc::new(Mutex::new(Vec::new()));
    let round = secs(p.two_gateways_s / 2.0);
    // (counts, seconds) per configuration, summed over its two rounds.
    let mut sums = [
        (TwoGatewaysRun::default(), 0.0f64),
        (TwoGatewaysRun::default(), 0.0f64),
    ];
    for (k, n) in [1usize, 2, 2, 1].into_iter().enumerate() {
        progress(&format!(
            "[two_gateways {}/4] {n} gateway(s) on the database",
            k + 1
        ));
        let mut gateways = Vec::new();
        for _ in 0..n {
            gateways.push(ctx.start_gateway().await?);
        }
        let (r, s) = one_run(ctx, k + 1, &gateways, round, &acked_all).await?;
        let (sum, t) = &mut sums[n - 1];
        sum.gateways = n;
        sum.sends_acked += r.sends_acked;
        sum.pushes += r.pushes;
        sum.send_errors += r.send_errors;
        *t += s;
    }
    let [one, two] = sums.map(|(mut r, t)| {
        r.sends_per_s = r3(r.sends_acked as f64 / t);
        r.pushes_per_s = r3(r.pushes as f64 / t);
        r
    });
    if one.sends_acked == 0 || two.sends_acked == 0 {
        bail!("no send acknowledged (one gateway: {one:?}, two: {two:?})");
    }
    let acked = acked_all.lock().unwrap().clone();
    let found = provision::count_present(&ctx.pool, &acked)
        .await
        .context("two_gateways data check")?;
    let gapless = provision::gapless(&ctx.pool, "tg").await?;
    let n = acked.len() as u64;
    Ok(TwoGateways {
        conversations: p.two_gateways_conversations,
        receivers_per_conversation: p.two_gateways_receivers,
        duration_s: p.two_gateways_s,
        one,
        two,
        data_check: DataCheck::new(n, found, n.saturating_sub(found), gapless),
    })
}
