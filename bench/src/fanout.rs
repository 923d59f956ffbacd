//! Part 2, fan-out: push frames per second delivered to subscribed devices and push latency
//! (the event's commit-side `at` to receipt), at the design note's chapter-02 load (9,067
//! frames/s) and then stepped up until p99 passes the limit, frames are lost, or the gateway
//! no longer keeps up. Each conversation has two users with several subscribed devices each
//! (lean receivers, coalesced acks) and one unsubscribed sender device per user; senders are
//! open loop (paced, pipelined), so a slow gateway shows as latency, not as a slower load.
//!
//! The ceiling is a WebSocket push server in a child process (this binary,
//! `ws-ceiling-server`) that writes the same event frames as fast as it can to the same
//! number of lean receivers: the most frames per second this machine moves from one process
//! to them, without a database.

use anyhow::{bail, Context};
use futures_util::{SinkExt, StreamExt};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncBufReadExt;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::Message;

use crate::cpu::{self, per_op};
use crate::pgss;
use crate::provision::{self, Device};
use crate::result::{
    DataCheck, Fanout, FanoutDiagnostic, FanoutRatios, FanoutStep, WsCeiling,
    DELIVERED_MIN_FRACTION,
};
use crate::util::{now_us, progress, r3, ratio, secs, summarize_us, Rng};
use crate::wire::{self, RecvLog};
use crate::Ctx;
use im_protocol::wire::{reply_frame, ConvHead, Reply, Request};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Pace {
    Pause,
    Rate(f64),
    Quit,
}

#[derive(Default)]
struct SendLog {
    /// (conversation index, seq, reply time, latency µs) of every `sent`.
    replies: Vec<(usize, i64, i64, i64)>,
    errors: u64,
    skipped: u64,
    acked: Vec<(String, String)>,
}

struct Sender {
    log: Mutex<SendLog>,
    inflight: AtomicU64,
}

/// One paced sender: a send every `1/rate` seconds whatever the replies do, at most
/// `max_inflight` unanswered (beyond that a slot is skipped and counted).
#[allow(clippy::too_many_arguments)]
async fn open_loop(
    ws: wire::Ws,
    idx: usize,
    convs: Vec<(usize, String)>,
    user: String,
    body: Arc<String>,
    pace: watch::Receiver<Pace>,
    me: Arc<Sender>,
    rng: Rng,
) {
    let (sink, stream) = ws.split();
    let reader = read_replies(stream, idx, user, me.clone());
    let writer = pace_sends(sink, idx, convs, body, pace, me, rng);
    let reader = tokio::spawn(reader);
    let mut sink = writer.await;
    // Give the last replies a moment, then close.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _ = sink.close().await;
    let _ = tokio::time::timeout(Duration::from_secs(2), reader).await;
}

/// The sender's reader: counts each reply off `inflight` and logs a `sent` (seq, reply
/// time, latency from the send time in its rid) or an error.
async fn read_replies(
    mut stream: futures_util::stream::SplitStream<wire::Ws>,
    idx: usize,
    user: String,
    me: Arc<Sender>,
) {
    while let Some(Ok(msg)) = stream.next().await {
        let Message::Text(t) = msg else { continue };
        let now = now_us();
        let Some(f) = wire::parse(t.as_str()) else {
            continue;
        };
        // rid = s<n>-<send time µs>-<cmid n>-<conversation index>
        let mut parts = f.rid().unwrap_or("").split('-');
        let (_, sent_at, n, ci) = (parts.next(), parts.next(), parts.next(), parts.next());
        let sent_at: i64 = sent_at.and_then(|s| s.parse().ok()).unwrap_or(now);
        let conv_idx: usize = ci.and_then(|s| s.parse().ok()).unwrap_or(usize::MAX);
        me.inflight.fetch_sub(1, Ordering::Relaxed);
        let mut l = me.log.lock().unwrap_or_else(|p| p.into_inner());
        match wire::sent(&f) {
            // A dup reply means a cmid was reused: nothing new was stored.
            Some((seq, false)) => {
                l.replies.push((conv_idx, seq, now, now - sent_at));
                l.acked
                    .push((user.clone(), format!("f{idx}-{}", n.unwrap_or("?"))));
            }
            _ => l.errors += 1,
        }
    }
}

/// The sender's writer: a send every `1/rate` seconds while the pace says `Rate`, a
/// skipped slot when `MAX_INFLIGHT` are unanswered; returns the sink on `Quit` or when the
/// socket or the pace channel closes.
async fn pace_sends(
    mut sink: futures_util::stream::SplitSink<wire::Ws, Message>,
    idx: usize,
    convs: Vec<(usize, String)>,
    body: Arc<String>,
    mut pace: watch::Receiver<Pace>,
    me: Arc<Sender>,
    mut rng: Rng,
) -> futures_util::stream::SplitSink<wire::Ws, Message> {
    const MAX_INFLIGHT: u64 = 64;
    let mut n: u64 = 0;
    loop {
        let current = *pace.borrow_and_update();
        let rate = match current {
            Pace::Quit => break,
            Pace::Pause => {
                if pace.changed().await.is_err() {
                    break;
                }
                continue;
            }
            Pace::Rate(r) => r,
        };
        let period = Duration::from_secs_f64(1.0 / rate.max(0.001));
        // A random phase per sender so the senders do not fire in lockstep.
        let mut next = Instant::now() + period.mul_f64(rng.unit());
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(next) => {}
                r = pace.changed() => {
                    if r.is_err() { return sink; }
                    break;
                }
            }
            next += period;
            if me.inflight.load(Ordering::Relaxed) >= MAX_INFLIGHT {
                me.log.lock().unwrap_or_else(|p| p.into_inner()).skipped += 1;
                continue;
            }
            n += 1;
            // Round robin over the pair's conversations.
            let (ci, conv) = &convs[(n as usize) % convs.len()];
            let rid = format!("s{n}-{}-{n}-{ci}", now_us());
            let frame = wire::send_frame(&rid, conv, &format!("f{idx}-{n}"), &body);
            me.inflight.fetch_add(1, Ordering::Relaxed);
            if sink.send(Message::text(frame)).await.is_err() {
                return sink;
            }
        }
    }
    sink
}

struct Receiver {
    /// Global conversation index of each entry of the receiver's `sub` list.
    globals: Vec<usize>,
    log: Arc<Mutex<RecvLog>>,
    task: tokio::task::JoinHandle<()>,
}

async fn heads(pool: &sqlx::PgPool, convs: &[String]) -> anyhow::Result<Vec<i64>> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT conv_id, next_seq - 1 FROM conversations WHERE conv_id = ANY($1::text[])",
    )
    .bind(convs)
    .fetch_all(pool)
    .await
    .context("read heads")?;
    let m: HashMap<String, i64> = rows.into_iter().collect();
    Ok(convs
        .iter()
        .map(|c| m.get(c).copied().unwrap_or(0))
        .collect())
}

/// The connected load: receivers, paced senders, and what a step needs to judge itself.
struct Rig {
    convs: Vec<String>,
    receivers: Vec<Receiver>,
    senders: Vec<Arc<Sender>>,
    pace_tx: watch::Sender<Pace>,
    gw_pid: u32,
    per_conv: usize,
}

impl Rig {
    fn pushes_total(&self) -> u64 {
        self.receivers
            .iter()
            .map(|r| r.log.lock().unwrap_or_else(|p| p.into_inner()).pushes)
            .sum()
    }

    fn count_in_range(&self, before: &[i64], after: &[i64]) -> u64 {
        self.receivers
            .iter()
            .map(|r| {
                r.log
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .got
                    .iter()
                    .filter(|g| {
                        let k = r.globals[g.conv as usize];
                        g.seq > before[k] && g.seq <= after[k]
                    })
                    .count() as u64
            })
            .sum()
    }

    /// Waits until no push has arrived for 500 ms (at most `within`): the gateway's fan-out
    /// backlog of the previous step must not spill into the next one.
    async fn quiesce(&self, within: Duration) {
        let deadline = Instant::now() + within;
        let mut last = (self.pushes_total(), Instant::now());
        while Instant::now() < deadline && last.1.elapsed() < Duration::from_millis(500) {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let n = self.pushes_total();
            if n != last.0 {
                last = (n, Instant::now());
            }
        }
    }

    /// One step at `mult` times the chapter-02 frame rate: pace, stop, drain, judge.
    async fn step(
        &self,
        ctx: &Ctx,
        mult: f64,
        label: &str,
    ) -> anyhow::Result<(FanoutStep, Vec<(String, String)>)> {
        let p = &ctx.params;
        let target_frames = p.fanout_base_frames_per_s * mult;
        let target_msgs = target_frames / self.per_conv as f64;
        let run = self.run_step(ctx, target_msgs, label).await?;
        let received = run.got.received;
        let by = db_ms_by_label(&run.stmts, received);
        let ack_db = ctx.pgss.then(|| pgss::by_label(&run.stmts, "ack_upsert").1);
        let Received {
            mut push_lat,
            mut after_reply,
            agg,
            via_sync,
            pushed_in_range,
            ..
        } = run.got;
        let mut send_lat: Vec<i64> = run.sent.replies.iter().map(|r| r.3).collect();
        let msgs = run.sent.replies.len() as u64;
        let mut step = FanoutStep {
            multiplier: mult,
            target_frames_per_s: r3(target_frames),
            target_messages_per_s: r3(target_msgs),
            events_per_device_conversation_per_s: r3(target_msgs / self.convs.len().max(1) as f64),
            duration_s: r3(run.step_s),
            messages_acked: msgs,
            messages_per_s: r3(msgs as f64 / run.step_s),
            send_errors: run.sent.errors,
            sends_skipped: run.sent.skipped,
            send_latency: summarize_us(&mut send_lat),
            frames_expected: run.expected,
            frames_received: received,
            frames_pushed: agg.pushes,
            events_via_sync: via_sync,
            events_never_pushed: run.expected.saturating_sub(pushed_in_range),
            frames_lost: run.expected.saturating_sub(received),
            frames_per_s: r3(received as f64 / run.step_s),
            push_latency: summarize_us(&mut push_lat),
            push_after_sent_reply: summarize_us(&mut after_reply),
            acks_sent: agg.acks_sent,
            acked_replies: agg.acked,
            ack_errors: agg.ack_errors,
            cursor_writes_per_push: ratio(agg.acks_sent as f64, received as f64),
            ack_upserts_db: ack_db,
            hints_sweep: agg.hints_sweep,
            hints_overflow: agg.hints_overflow,
            hints_ahead: agg.hints_ahead,
            syncs: agg.syncs,
            gaps: agg.gaps,
            duplicates: agg.duplicates,
            cpu_per_frame: per_op(&run.cpu_use, received, false),
            cpu: run.cpu_use,
            statements: run.stmts,
            db_ms_per_frame_by_label: by,
            passed: false,
            verdict: String::new(),
        };
        judge(&mut step, p, target_frames);
        Ok((step, run.sent.acked))
    }

    /// The measured part of a step: quiesces and clears the logs, samples CPU and
    /// statements around the paced run and its drain, and collects the send and receive
    /// logs.
    async fn run_step(&self, ctx: &Ctx, target_msgs: f64, label: &str) -> anyhow::Result<StepRun> {
        progress(label);
        self.quiesce(Duration::from_secs(10)).await;
        for r in &self.receivers {
            r.log.lock().unwrap_or_else(|p| p.into_inner()).take();
        }
        let before_heads = heads(&ctx.pool, &self.convs).await?;
        let probe = ctx.probe(Some(self.gw_pid));
        if ctx.pgss {
            pgss::reset(&ctx.pool).await;
        }
        let before = probe.sample();
        let step_s = self.pace(ctx, target_msgs, label).await;
        let (expected, after_heads) = self.drain(ctx, &before_heads).await?;
        let after = probe.sample();
        let stmts = if ctx.pgss {
            pgss::snapshot(&ctx.pool).await
        } else {
            Vec::new()
        };
        let sent = self.take_send_logs();
        let got = self.take_recv_logs(&sent.replies, &before_heads, &after_heads);
        let cpu_use = cpu::delta(&before, &after);
        Ok(StepRun {
            step_s,
            expected,
            stmts,
            sent,
            got,
            cpu_use,
        })
    }

    /// Paces the senders at `target_msgs` messages per second for the step's duration,
    /// then pauses them; returns the seconds it ran.
    async fn pace(&self, ctx: &Ctx, target_msgs: f64, label: &str) -> f64 {
        let p = &ctx.params;
        self.pace_tx
            .send_replace(Pace::Rate(target_msgs / self.senders.len() as f64));
        let t0 = Instant::now();
        let ticking = crate::util::ticking();
        while t0.elapsed().as_secs_f64() < p.fanout_step_s {
            tokio::time::sleep(Duration::from_millis(250)).await;
            if ticking {
                let got: usize = self
                    .receivers
                    .iter()
                    .map(|r| r.log.lock().unwrap_or_else(|p| p.into_inner()).got.len())
                    .sum();
                progress(&format!(
                    "{label}  {:>4.1}/{:.0} s  {got} frames",
                    t0.elapsed().as_secs_f64(),
                    p.fanout_step_s
                ));
            }
        }
        self.pace_tx.send_replace(Pace::Pause);
        t0.elapsed().as_secs_f64()
    }

    /// Drains a paced step: replies, then events up to the heads, then the fan-out backlog.
    /// Returns the frames the receivers should have got and the heads after the step.
    async fn drain(&self, ctx: &Ctx, before_heads: &[i64]) -> anyhow::Result<(u64, Vec<i64>)> {
        let drain_deadline = Instant::now() + Duration::from_secs(10);
        while self
            .senders
            .iter()
            .any(|s| s.inflight.load(Ordering::Relaxed) > 0)
            && Instant::now() < drain_deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let after_heads = heads(&ctx.pool, &self.convs).await?;
        let expected_per_conv: Vec<u64> = before_heads
            .iter()
            .zip(&after_heads)
            .map(|(b, a)| (a - b).max(0) as u64)
            .collect();
        let expected: u64 = self
            .receivers
            .iter()
            .flat_map(|r| r.globals.iter().map(|&k| expected_per_conv[k]))
            .sum();
        let mut last = (
            self.count_in_range(before_heads, &after_heads),
            Instant::now(),
        );
        while last.0 < expected && Instant::now() < drain_deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let n = self.count_in_range(before_heads, &after_heads);
            if n != last.0 {
                last = (n, Instant::now());
            } else if last.1.elapsed() > Duration::from_secs(2) {
                break; // no progress for 2 s: what is missing is lost
            }
        }
        self.quiesce(Duration::from_secs(10)).await;
        Ok((expected, after_heads))
    }

    /// Every sender's log of the step, merged (and emptied).
    fn take_send_logs(&self) -> SendLog {
        let mut all = SendLog::default();
        for s in &self.senders {
            let mut l = s.log.lock().unwrap_or_else(|p| p.into_inner());
            let l = std::mem::take(&mut *l);
            all.replies.extend(l.replies);
            all.errors += l.errors;
            all.skipped += l.skipped;
            all.acked.extend(l.acked);
        }
        all
    }

    /// Every receiver's log of the step (emptied), counted over the events the step sent:
    /// those in `(before, after]` of their conversation's head.
    fn take_recv_logs(
        &self,
        replies: &[(usize, i64, i64, i64)],
        before_heads: &[i64],
        after_heads: &[i64],
    ) -> Received {
        let reply_at: HashMap<(usize, i64), i64> =
            replies.iter().map(|r| ((r.0, r.1), r.2)).collect();
        let mut out = Received::default();
        for r in &self.receivers {
            let l = r.log.lock().unwrap_or_else(|p| p.into_inner()).take();
            let global = |g: &wire::Got| r.globals[g.conv as usize];
            let in_range = |g: &wire::Got| {
                let k = global(g);
                g.seq > before_heads[k] && g.seq <= after_heads[k]
            };
            for g in l.got.iter().filter(|g| in_range(g)) {
                out.received += 1;
                if !g.pushed {
                    out.via_sync += 1;
                }
            }
            let mut seen = std::collections::HashSet::new();
            for g in l.pushed.iter().filter(|g| in_range(g)) {
                out.push_lat.push(g.recv_us - g.at_ms * 1000);
                if let Some(t) = reply_at.get(&(global(g), g.seq)) {
                    out.after_reply.push(g.recv_us - t);
                }
                seen.insert((g.conv, g.seq));
            }
            out.pushed_in_range += seen.len() as u64;
            let agg = &mut out.agg;
            agg.pushes += l.pushes;
            agg.duplicates += l.duplicates;
            agg.gaps += l.gaps;
            agg.acks_sent += l.acks_sent;
            agg.acked += l.acked;
            agg.ack_errors += l.ack_errors;
            agg.hints_sweep += l.hints_sweep;
            agg.hints_overflow += l.hints_overflow;
            agg.hints_ahead += l.hints_ahead;
            agg.syncs += l.syncs;
        }
        out
    }
}

/// What the receivers got of one step's events.
#[derive(Default)]
struct Received {
    received: u64,
    /// Events that reached a device by sync before their push.
    via_sync: u64,
    /// Distinct events pushed.
    pushed_in_range: u64,
    /// Push latency (µs from the message's `at`) of every push.
    push_lat: Vec<i64>,
    /// µs from the sender's `sent` reply to the push.
    after_reply: Vec<i64>,
    /// The receivers' counters, summed.
    agg: RecvLog,
}

/// Why a step failed (empty: it passed): frames lost or never pushed, overflow hints,
/// push or send p99 over the limit, too few frames delivered, events that came by sync.
/// What [`Rig::run_step`] measured, for [`Rig::step`] to turn into a [`FanoutStep`].
struct StepRun {
    step_s: f64,
    expected: u64,
    stmts: Vec<pgss::StmtStat>,
    sent: SendLog,
    got: Received,
    cpu_use: cpu::CpuUse,
}

/// Database milliseconds per received frame by statement label, rounded to 6 decimals;
/// empty when nothing was received.
fn db_ms_by_label(
    stmts: &[pgss::StmtStat],
    received: u64,
) -> std::collections::BTreeMap<String, f64> {
    let mut by = std::collections::BTreeMap::new();
    if received > 0 {
        for s in stmts {
            *by.entry(s.label.clone()).or_insert(0.0) += s.total_ms / received as f64;
        }
        for v in by.values_mut() {
            *v = (*v * 1e6).round() / 1e6;
        }
    }
    by
}

/// Sets the step's `passed` and `verdict` from [`step_failures`].
fn judge(step: &mut FanoutStep, p: &crate::result::Params, target_frames: f64) {
    let why = step_failures(step, p, target_frames);
    step.passed = why.is_empty();
    step.verdict = if step.passed {
        "pass".into()
    } else {
        why.join("; ")
    };
}

fn step_failures(step: &FanoutStep, p: &crate::result::Params, target_frames: f64) -> Vec<String> {
    let mut why = Vec::new();
    let lost = step.frames_lost;
    if lost > 0 {
        why.push(format!("{lost} frames lost"));
    }
    let not_pushed = step.events_never_pushed;
    if not_pushed > 0 {
        why.push(format!(
            "{not_pushed} events never pushed (repaired by sync)"
        ));
    }
    if step.hints_overflow > 0 {
        why.push(format!(
            "{} overflow hints (pushes paused)",
            step.hints_overflow
        ));
    }
    if step.push_latency.p99_ms > p.fanout_p99_limit_ms {
        why.push(format!(
            "push p99 {} ms > {} ms",
            step.push_latency.p99_ms, p.fanout_p99_limit_ms
        ));
    }
    let frames_per_s = step.frames_per_s;
    if frames_per_s < DELIVERED_MIN_FRACTION * target_frames {
        why.push(format!(
            "delivered {frames_per_s:.0} frames/s < {:.0}% of {target_frames:.0}",
            DELIVERED_MIN_FRACTION * 100.0
        ));
    }
    let via_sync = step.events_via_sync;
    if via_sync > 0 {
        why.push(format!(
            "{via_sync} events reached a device by sync before their push"
        ));
    }
    if step.send_latency.p99_ms > p.fanout_p99_limit_ms {
        why.push(format!(
            "send p99 {} ms > {} ms (senders queue)",
            step.send_latency.p99_ms, p.fanout_p99_limit_ms
        ));
    }
    why
}

/// Who is who in the fan-out: conversations, devices, and which pair each belongs to.
struct Topology {
    convs: Vec<String>,
    /// Per pair: (global index, id) of its conversations.
    pair_convs: Vec<Vec<(usize, String)>>,
    recv_devs: Vec<Device>,
    /// (pair, device) of every sender.
    send_devs: Vec<(usize, Device)>,
    conv_index: HashMap<String, usize>,
    /// Subscribed devices per pair = frames per message.
    per_conv: usize,
}

/// A gateway with every receiver and sender connected to it.
struct Session {
    gw: harness::gateway::Gateway,
    rig: Rig,
    sender_tasks: Vec<tokio::task::JoinHandle<()>>,
    stop_tx: watch::Sender<bool>,
}

impl Session {
    /// Starts a gateway (`env` on top of the bench's) and connects the topology to it.
    async fn open(
        ctx: &Ctx,
        topo: &Topology,
        env: &[(String, String)],
        session: usize,
    ) -> anyhow::Result<Session> {
        let p = &ctx.params;
        let mut opts_env = ctx.gateway_env.clone();
        opts_env.extend(env.iter().cloned());
        let opts = harness::gateway::GatewayOpts {
            env: opts_env,
            ..Default::default()
        };
        let gw =
            harness::gateway::Gateway::start(&ctx.cluster.url(), &opts, &ctx.cluster.log_dir())
                .await?;
        let url = gw.ws_url();
        progress(&format!(
            "[fanout] connecting {} receivers and {} senders",
            topo.recv_devs.len(),
            topo.send_devs.len()
        ));
        let (stop_tx, stop_rx) = watch::channel(false);
        let receivers = Self::open_receivers(topo, &url, &stop_rx).await?;
        let (pace_tx, pace_rx) = watch::channel(Pace::Pause);
        let (senders, sender_tasks) = Self::open_senders(p, topo, &url, session, &pace_rx).await?;
        let rig = Rig {
            convs: topo.convs.clone(),
            receivers,
            senders,
            pace_tx,
            gw_pid: gw.pid(),
            per_conv: topo.per_conv,
        };
        Ok(Session {
            gw,
            rig,
            sender_tasks,
            stop_tx,
        })
    }

    /// Connects and subscribes the receivers, 32 at a time, each with a task reading its
    /// pushes until `stop_rx` says stop.
    async fn open_receivers(
        topo: &Topology,
        url: &str,
        stop_rx: &watch::Receiver<bool>,
    ) -> anyhow::Result<Vec<Receiver>> {
        let mut receivers = Vec::new();
        for chunk in topo.recv_devs.chunks(32) {
            let opened = futures_util::future::try_join_all(chunk.iter().map(|d| {
                let url = url.to_owned();
                async move {
                    let mut ws = wire::open(&url, &d.id, &d.token).await?;
                    let states = wire::sub(&mut ws).await?;
                    anyhow::Ok((ws, states))
                }
            }))
            .await
            .context("open receivers")?;
            for (ws, states) in opened {
                let globals = states
                    .iter()
                    .map(|st| topo.conv_index.get(&st.conv).copied())
                    .collect::<Option<Vec<usize>>>()
                    .context("sub listed a conversation the bench did not make")?;
                let (log, task) = wire::spawn_receiver(ws, states, stop_rx.clone());
                receivers.push(Receiver { globals, log, task });
            }
        }
        Ok(receivers)
    }

    /// Connects the senders and starts one paced [`open_loop`] per sender, paused until
    /// `pace_rx` says a rate.
    async fn open_senders(
        p: &crate::result::Params,
        topo: &Topology,
        url: &str,
        session: usize,
        pace_rx: &watch::Receiver<Pace>,
    ) -> anyhow::Result<(Vec<Arc<Sender>>, Vec<tokio::task::JoinHandle<()>>)> {
        let body = Arc::new("x".repeat(p.body_bytes));
        let mut senders = Vec::new();
        let mut sender_tasks = Vec::new();
        let opened = futures_util::future::try_join_all(
            topo.send_devs
                .iter()
                .map(|(_, d)| wire::open(url, &d.id, &d.token)),
        )
        .await
        .context("open senders")?;
        for (i, ws) in opened.into_iter().enumerate() {
            let (k, d) = &topo.send_devs[i];
            let me = Arc::new(Sender {
                log: Mutex::new(SendLog::default()),
                inflight: AtomicU64::new(0),
            });
            sender_tasks.push(tokio::spawn(open_loop(
                ws,
                // Unique cmids across sessions: a reused cmid is a duplicate (D2), not a message.
                session * 10_000 + i,
                topo.pair_convs[*k].clone(),
                d.user.clone(),
                body.clone(),
                pace_rx.clone(),
                me.clone(),
                Rng::new(p.seed ^ 0xF0 ^ i as u64),
            )));
            senders.push(me);
        }
        Ok((senders, sender_tasks))
    }

    /// Stops senders and receivers and the gateway; returns the acknowledged sends not yet
    /// collected by a step.
    async fn close(self) -> Vec<(String, String)> {
        let Session {
            mut gw,
            rig,
            sender_tasks,
            stop_tx,
        } = self;
        rig.pace_tx.send_replace(Pace::Quit);
        for t in sender_tasks {
            let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
        }
        stop_tx.send_replace(true);
        for r in rig.receivers {
            let _ = tokio::time::timeout(Duration::from_secs(2), r.task).await;
        }
        let _ = gw.terminate(Duration::from_secs(10)).await;
        drop(gw);
        let mut acked = Vec::new();
        for s in &rig.senders {
            acked.extend(std::mem::take(
                &mut s.log.lock().unwrap_or_else(|p| p.into_inner()).acked,
            ));
        }
        acked
    }
}

/// Runs the chapter-02 load and the steps above it.
pub async fn run(ctx: &Ctx) -> anyhow::Result<Fanout> {
    let p = &ctx.params;
    let n_pairs = p.fanout_user_pairs;
    let [ra, rb] = p.fanout_receivers_per_user;
    let per_conv = ra + rb;
    // --- the ceiling first, while nothing else runs
    progress("[fanout] WebSocket ceiling (no database)");
    let ceiling = ws_ceiling(ctx, n_pairs * per_conv).await?;
    let topo = Topology::provision(ctx).await?;
    let session = Session::open(ctx, &topo, &[], 0).await?;
    let rig = &session.rig;
    let (steps, mut acked_all, stop_reason) = ladder(ctx, rig).await?;
    let (n_receivers, n_senders) = (rig.receivers.len(), rig.senders.len());
    acked_all.extend(session.close().await);
    let diagnostics = diagnose(ctx, &topo, &mut acked_all).await?;
    let found = provision::count_present(&ctx.pool, &acked_all).await?;
    let gapless = provision::gapless(&ctx.pool, "fo-c").await?;
    let acknowledged = acked_all.len() as u64;
    let lost = acknowledged.saturating_sub(found);
    let max_passing = steps
        .iter()
        .filter(|s| s.passed)
        .map(|s| s.frames_per_s)
        .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))));
    Ok(Fanout {
        receiver: "lean receiver of the bench crate (tokio-tungstenite: hello, sub, contiguous cursor per \
                   conversation, acks coalesced every 4 events or 50 ms, sync on gap or on a hint ahead \
                   of its cursor, decided by the harness client's delivery core); not the harness Client \
                   itself, which persists a state file per event"
            .into(),
        user_pairs: n_pairs,
        conversations: topo.convs.len(),
        receivers: n_receivers,
        sender_connections: n_senders,
        frames_per_message: per_conv,
        base_frames_per_s: p.fanout_base_frames_per_s,
        p99_limit_ms: p.fanout_p99_limit_ms,
        gateway_sweep_ms: 1000,
        max_passing_frames_per_s: max_passing,
        stop_reason,
        ratios: FanoutRatios {
            max_passing_vs_ws_ceiling: max_passing.and_then(|m| ratio(m, ceiling.frames_per_s)),
            max_passing_vs_pgbench_notify_frames: None,
            base_load_vs_max_passing: max_passing.and_then(|m| ratio(p.fanout_base_frames_per_s, m)),
        },
        ws_ceiling: ceiling,
        steps,
        diagnostics,
        data_check: DataCheck::new(acknowledged, found, lost, gapless),
    })
}

impl Topology {
    /// Provisions the fan-out's world. Pair k: users fo-a{k} and fo-b{k}, conversations
    /// fo-c{k}-{m} for m < convs_per_pair, receivers subscribed to all of them, one
    /// unsubscribed sender device per user.
    async fn provision(ctx: &Ctx) -> anyhow::Result<Topology> {
        let p = &ctx.params;
        let [ra, rb] = p.fanout_receivers_per_user;
        let m_per = p.fanout_convs_per_pair.max(1);
        let mut convs: Vec<String> = Vec::new();
        let mut pair_convs: Vec<Vec<(usize, String)>> = Vec::new();
        for k in 0..p.fanout_user_pairs {
            let mut mine = Vec::new();
            for m in 0..m_per {
                mine.push((convs.len(), format!("fo-c{k}-{m}")));
                convs.push(format!("fo-c{k}-{m}"));
            }
            pair_convs.push(mine);
        }
        let mut users = Vec::new();
        let mut devices = Vec::new();
        let mut world = Vec::new();
        let mut recv_devs: Vec<Device> = Vec::new();
        let mut send_devs: Vec<(usize, Device)> = Vec::new();
        for (k, mine) in pair_convs.iter().enumerate() {
            let a = format!("fo-a{k}");
            let b = format!("fo-b{k}");
            for (u, n) in [(&a, ra), (&b, rb)] {
                for r in 0..n {
                    let d = Device::new(format!("{u}-r{r}"), u);
                    recv_devs.push(d.clone());
                    devices.push(d);
                }
            }
            for u in [&a, &b]
                .into_iter()
                .take(p.fanout_senders_per_pair.clamp(1, 2))
            {
                let d = Device::new(format!("{u}-s"), u);
                send_devs.push((k, d.clone()));
                devices.push(d);
            }
            users.push(a.clone());
            users.push(b.clone());
            for (_, c) in mine {
                world.push((c.clone(), vec![a.clone(), b.clone()]));
            }
        }
        let conv_index: HashMap<String, usize> = convs
            .iter()
            .enumerate()
            .map(|(i, c)| (c.clone(), i))
            .collect();
        provision::world(&ctx.pool, &users, &devices, &world).await?;
        Ok(Topology {
            convs,
            pair_convs,
            recv_devs,
            send_devs,
            conv_index,
            per_conv: ra + rb,
        })
    }
}

/// The ladder: the chapter-02 load first; then up while it passes, or down until one
/// passes. Its steps, the messages acknowledged in them, and why it stopped.
async fn ladder(
    ctx: &Ctx,
    rig: &Rig,
) -> anyhow::Result<(Vec<FanoutStep>, Vec<(String, String)>, String)> {
    let p = &ctx.params;
    let mut steps: Vec<FanoutStep> = Vec::new();
    let mut acked_all: Vec<(String, String)> = Vec::new();
    let mut plan: std::collections::VecDeque<f64> = [p.fanout_start_multiplier].into();
    let mut direction: Option<bool> = None; // Some(true): stepping up
    let stop_reason = loop {
        let Some(mult) = plan.pop_front() else {
            break match direction {
                Some(true) => "every step up passed (no higher step configured)".to_string(),
                Some(false) => "no step down passed".to_string(),
                None => "one step configured".to_string(),
            };
        };
        let label = format!(
            "[fanout {}] {:.0} frames/s",
            steps.len() + 1,
            p.fanout_base_frames_per_s * mult
        );
        let (step, acked) = rig.step(ctx, mult, &label).await?;
        acked_all.extend(acked);
        let passed = step.passed;
        let verdict = step.verdict.clone();
        let target = step.target_frames_per_s;
        steps.push(step);
        match direction {
            None => {
                direction = Some(passed);
                plan = if passed {
                    p.fanout_up.clone().into()
                } else {
                    p.fanout_down.clone().into()
                };
            }
            Some(true) if !passed => {
                break format!("stepping up: {target:.0} frames/s failed: {verdict}");
            }
            Some(false) if passed => {
                break format!("stepping down: {target:.0} frames/s is the first that passed");
            }
            _ => {}
        }
    };
    Ok((steps, acked_all, stop_reason))
}

/// Diagnostics: the chapter-02 step again on a gateway with other settings (one per
/// `fanout_diagnostic_env` entry); what they acknowledged goes to `acked_all`.
async fn diagnose(
    ctx: &Ctx,
    topo: &Topology,
    acked_all: &mut Vec<(String, String)>,
) -> anyhow::Result<Vec<FanoutDiagnostic>> {
    let p = &ctx.params;
    let mut diagnostics = Vec::new();
    for (i, kv) in p.fanout_diagnostic_env.iter().enumerate() {
        let Some((k, v)) = kv.split_once('=') else {
            anyhow::bail!("fanout_diagnostic_env {kv:?}: NAME=VALUE");
        };
        let env = [(k.to_string(), v.to_string())];
        let session = Session::open(ctx, topo, &env, i + 1).await?;
        let label = format!(
            "[fanout diagnostic {}] {kv}: {:.0} frames/s",
            i + 1,
            p.fanout_base_frames_per_s
        );
        let r = session.rig.step(ctx, 1.0, &label).await;
        acked_all.extend(session.close().await);
        let (step, acked) = r?;
        acked_all.extend(acked);
        diagnostics.push(FanoutDiagnostic {
            gateway_env: vec![kv.clone()],
            step,
        });
    }
    Ok(diagnostics)
}

/// Measures the WebSocket ceiling: `n` lean receivers against the push server child.
async fn ws_ceiling(ctx: &Ctx, n: usize) -> anyhow::Result<WsCeiling> {
    let p = &ctx.params;
    let exe = std::env::current_exe().context("find the bench executable")?;
    let mut child = tokio::process::Command::new(&exe)
        .arg("ws-ceiling-server")
        .arg(p.body_bytes.to_string())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("spawn the ceiling server")?;
    let stdout = child.stdout.take().context("ceiling server stdout")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await
        .context("ceiling server did not start")??
        .context("ceiling server closed stdout")?;
    let Some(addr) = line.strip_prefix("listening on ") else {
        bail!("ceiling server printed {line:?}");
    };
    let url = format!("ws://{}/ws", addr.trim());
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut logs = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..n {
        let mut ws = wire::open(&url, &format!("ceil-{i}"), "x").await?;
        let states = wire::sub(&mut ws).await?;
        let (log, task) = wire::spawn_receiver(ws, states, stop_rx.clone());
        tasks.push(task);
        logs.push(log);
    }
    // Skip the first half second (connection ramp), count over the window.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let from = now_us();
    tokio::time::sleep(secs(p.ws_ceiling_s)).await;
    let to = now_us();
    stop_tx.send_replace(true);
    let _ = child.kill().await;
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(2), t).await;
    }
    let frames: u64 = logs
        .iter()
        .map(|l| {
            l.lock()
                .unwrap_or_else(|p| p.into_inner())
                .got
                .iter()
                .filter(|g| g.recv_us >= from && g.recv_us < to)
                .count() as u64
        })
        .sum();
    Ok(WsCeiling {
        frames_per_s: r3(frames as f64 * 1e6 / (to - from).max(1) as f64),
        receivers: n,
        duration_s: r3((to - from) as f64 / 1e6),
        server:
            "imfault-bench ws-ceiling-server: answers hello and sub, then writes the gateway's \
                 event frames (im_protocol::wire::event_frame, same body size) one by one as fast \
                 as the socket takes them; no database"
                .into(),
    })
}

/// `imfault-bench ws-ceiling-server BODY_BYTES`: the ceiling's push server (child process).
pub async fn ceiling_server(body_bytes: usize) -> anyhow::Result<()> {
    use std::io::Write;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {addr}")?;
        out.flush()?;
    }
    let body = Arc::new("x".repeat(body_bytes));
    loop {
        let (tcp, _) = listener.accept().await?;
        let _ = tcp.set_nodelay(true);
        let body = body.clone();
        tokio::spawn(ceiling_conn(tcp, body));
    }
}

/// The ceiling server's socket halves.
type CeilSink = futures_util::stream::SplitSink<
    tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>,
    Message,
>;
type CeilStream =
    futures_util::stream::SplitStream<tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>>;

/// One ceiling connection: the handshake, then event frames as fast as the socket takes
/// them until it fails.
async fn ceiling_conn(tcp: tokio::net::TcpStream, body: Arc<String>) {
    let Ok(ws) = tokio_tungstenite::accept_async(tcp).await else {
        return;
    };
    let (mut sink, mut stream) = ws.split();
    let Some(conv) = ceiling_handshake(&mut sink, &mut stream).await else {
        return;
    };
    // Discard whatever the receiver sends (acks) from here on.
    tokio::spawn(async move { while let Some(Ok(_)) = stream.next().await {} });
    let mut seq = 0i64;
    loop {
        seq += 1;
        let ev = im_protocol::wire::Event {
            conv: conv.clone(),
            seq,
            kind: "msg".into(),
            mid: "00000000-0000-4000-8000-000000000000".into(),
            sender: "fo-a0".into(),
            cmid: format!("f0-{seq}"),
            body: body.to_string(),
            at_ms: now_us() / 1000,
            epoch: 1,
        };
        let frame = im_protocol::wire::event_frame(&ev);
        if sink.send(Message::text(frame)).await.is_err() {
            return;
        }
    }
}

/// Answers hello and then sub, ignoring anything else before; returns the conversation the
/// events go to, or `None` when a reply could not be sent.
async fn ceiling_handshake(sink: &mut CeilSink, stream: &mut CeilStream) -> Option<String> {
    let mut conv = String::from("ceil");
    // hello, then sub; anything else before is ignored.
    while let Some(Ok(msg)) = stream.next().await {
        let Message::Text(t) = msg else { continue };
        // A request, read as the gateway reads it.
        let f = im_protocol::wire::parse(t.as_str(), usize::MAX);
        let rid = f.rid.unwrap_or_default();
        match f.req {
            Ok(Request::Hello { .. }) => {
                conv = format!("ceil-{}", rid.len());
                let w = Reply::Welcome {
                    user: "u".into(),
                    device: "d".into(),
                    epoch: 1,
                };
                if sink
                    .send(Message::text(reply_frame(Some(&rid), &w)))
                    .await
                    .is_err()
                {
                    return None;
                }
            }
            Ok(Request::Sub) => {
                let s = Reply::Subbed {
                    convs: vec![ConvHead {
                        conv: conv.clone(),
                        head: 0,
                        delivered: 0,
                        epoch: 1,
                    }],
                    lineage: 0,
                };
                if sink
                    .send(Message::text(reply_frame(Some(&rid), &s)))
                    .await
                    .is_err()
                {
                    return None;
                }
                break;
            }
            _ => {}
        }
    }
    Some(conv)
}
