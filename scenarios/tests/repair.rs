//! Steady-state repair checks (issue 18): every path by which a lost push is repaired (D5),
//! each where the receiver has been subscribed and idle for several sweep intervals before
//! the fault, so that only the mechanism under test can repair it within D5's bound (sweep
//! interval + 1 s): a new subscription's pass ran long before, the routine full pass is 60
//! intervals away, and nothing else is pending. Each path runs on one gateway and on two
//! (sender on gateway 0, receiver on gateway 1, one database). Faults are armed on the
//! running gateway through its control socket, after the idle time, and recorded in the
//! history; the history checker judges every run.
//!
//! | path | fault | mechanism | how the receiver gets the event |
//! |---|---|---|---|
//! | dropped push | `gw.push:drop:0:1` (receiver's gateway) | the sweep asks about pushed, unacked pairs | sweep hint, sync |
//! | dropped NOTIFY | `send.after_commit_before_notify:drop:0:1` (sender's) | the commit feed | push |
//! | failed NOTIFY | `fanout.notify:error:0:1` (sender's) | the commit feed | push |
//! | commit in flight at a look | `send.before_commit:delay(1000):0:1` and `send.after_commit_before_notify:drop:0:1` (sender's) | the commit feed's window: a look leaves what is in flight to the next | push |
//! | failed feed look | `fanout.feed:error:0:1` (receiver's), then m1's NOTIFY dropped (sender's) | the commit feed, which goes on after a failed look | push |
//! | failed fan-out read | `fanout.read:error` (receiver's) | the sweep asks about the conversation | sweep hint, sync |
//! | failed sweep query | `gw.push:drop:0:1`, `device_cursors` locked until the sweep's question fails (receiver's) | the full pass the failure asks for | sweep hint, sync |
//! | lost LISTEN | LISTEN backend terminated, `fanout.listen:error` (receiver's); on one gateway also `fanout.notify:drop:0:1` (its local hand-off) | full pass when LISTEN is regained | sweep hint, sync |
//! | stale install | the same, and the receiver reinstalled meanwhile | full pass closes the stale install | close; the new install syncs |
//! | stale request | the same; the old install sends before any pass | the request's own install check | STALE_INSTALL, close |
//! | removed device | the same, and b1 removed (its rows deleted) instead of reinstalled | full pass finds a device with no row stale | close |
//! | stale ack | the same; the old install acks a message it never got | the ack statement's own install check (D3) | STALE_INSTALL, cursor unmoved; the new install syncs |
//! | overflow | `gw.push:delay(40)`, 4 queued frames (receiver's) | overflow hint once the queue drained | overflow hint, sync |
//! | overflow by bytes | the same with 256 queued frames and a 4 KiB byte budget, 1 KB messages | the pushes' charge to the byte budget | overflow hint, sync |

use harness::client::{Client, ClientStats};
use harness::gateway::GatewayOpts;
use harness::util::wait_until;
use harness::world::World;
use scenarios::{db_invariant_violations, judge_test, reconnect_after_lineage_move};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(10);
/// The sweep interval of every check (and of the commit feed).
const SWEEP_MS: u64 = 250;
/// How long the receiver idles before the fault, in sweep intervals.
const IDLE_INTERVALS: u32 = 4;
/// Most time the gateway may take to try LISTEN again once `fanout.listen` is disarmed (its
/// reconnect backoff tops out at 1 s).
const RELISTEN_MAX: Duration = Duration::from_secs(1);

/// D5's bound: one sweep interval and one sync round trip.
fn bound() -> Duration {
    Duration::from_millis(SWEEP_MS + 1000)
}

/// The world of one check: alice (`a1`, the sender) on gateway 0, bob (`b1`, the receiver)
/// on gateway `rx` (1 when there are two), both members of `c1`. Only the receiver
/// subscribes: the sender's own pushes would share its gateway's faults (a slowed writer
/// would slow its replies too) and add an install to every sweep.
struct Steady {
    w: World,
    a: Client,
    b: Client,
    rx: usize,
}

impl Steady {
    /// Starts the gateways (with `env` on the receiver's), provisions, connects, idles two
    /// intervals, sends one message through the normal path (pushed and acked), then idles.
    async fn start(two: bool, env: &[(&str, &str)]) -> anyhow::Result<Steady> {
        let opts = |env: &[(&str, &str)]| GatewayOpts {
            sweep_ms: Some(SWEEP_MS),
            control: true,
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        };
        let mut w = World::start(opts(if two { &[] } else { env })).await?;
        let rx = if two {
            w.start_gateway(opts(env)).await?
        } else {
            0
        };
        w.admin.add_user("alice").await?;
        w.admin.add_user("bob").await?;
        let ta = w.admin.add_device("a1", "alice").await?;
        let tb = w.admin.add_device("b1", "bob").await?;
        w.admin.add_conv("c1", &["alice", "bob"]).await?;
        let a = join(&w, 0, "a1", &ta, false).await?;
        let b = join(&w, rx, "b1", &tb, true).await?;
        let s = Steady { w, a, b, rx };
        // The receiver's new-subscription pass first (its first sweep interval): run after
        // the warm-up commits and before its push, it would hint and the warm-up would come
        // by sync (seen on a loaded machine).
        s.idle(2).await;
        let (seq, _) = s.send("warm-up").await?;
        s.b.wait_server_delivered("c1", seq, T).await?;
        anyhow::ensure!(
            s.b.stats().pushes_applied == 1,
            "the warm-up message came by push: {:?}",
            s.b.stats()
        );
        s.idle(IDLE_INTERVALS).await;
        Ok(s)
    }

    /// Lets `n` sweep intervals pass with nothing sent (the state is set up by time passing,
    /// not awaited as a condition).
    async fn idle(&self, n: u32) {
        tokio::time::sleep(Duration::from_millis(SWEEP_MS) * n).await;
    }

    /// One message from a1; its seq and when its `sent` reply came.
    async fn send(&self, cmid: &str) -> anyhow::Result<(i64, Instant)> {
        let r = self
            .a
            .send("c1", cmid, "steady state", T)
            .await
            .map_err(|e| anyhow::anyhow!("send {cmid}: {e}"))?;
        let seq = r["seq"]
            .as_i64()
            .ok_or_else(|| anyhow::anyhow!("no seq in {r}"))?;
        Ok((seq, Instant::now()))
    }

    /// D5: the receiver stored and acknowledged `seq` within `within` of `t0`.
    async fn repaired(&self, seq: i64, t0: Instant, within: Duration) -> anyhow::Result<Duration> {
        let left = within.saturating_sub(t0.elapsed());
        self.b
            .wait_server_delivered("c1", seq, left)
            .await
            .map_err(|e| anyhow::anyhow!("D5: seq {seq} not repaired within {within:?}: {e}"))?;
        Ok(t0.elapsed())
    }

    /// The database invariants and the history checker over the whole run.
    async fn judge(&self) -> anyhow::Result<()> {
        let v = db_invariant_violations(&self.w.admin.pool().await?).await?;
        anyhow::ensure!(v.is_empty(), "database invariants violated: {v:?}");
        let r = judge_test(&self.w).await?;
        anyhow::ensure!(
            r.anomalies.is_empty(),
            "the history checker found anomalies (history in {}): {}",
            self.w.work_dir().display(),
            serde_json::to_string_pretty(&r.anomalies).unwrap_or_default()
        );
        Ok(())
    }

    /// Kills the receiver's gateway's LISTEN connection with `fanout.listen:error` armed, so
    /// it stays lost until [`World::disarm_fault`]; waits until the gateway noticed.
    async fn lose_listen(&self) -> anyhow::Result<harness::world::ArmedFault> {
        let f = self.w.arm_fault(self.rx, "fanout.listen:error").await?;
        let pid = self
            .w
            .listen_backend(self.rx)
            .await?
            .ok_or_else(|| anyhow::anyhow!("gateway {} has no LISTEN backend", self.rx))?;
        anyhow::ensure!(self.w.terminate_backend(pid).await?, "terminate {pid}");
        let gw = self.w.gateways.at(self.rx);
        wait_until(
            "the gateway to notice the lost LISTEN connection",
            T,
            async || {
                let log = gw.log_text();
                if log.contains("LISTEN connection lost")
                    || log.contains("LISTEN connection failed")
                {
                    Ok(())
                } else {
                    Err(())
                }
            },
        )
        .await?;
        Ok(f)
    }
}

/// A client for `device` on gateway `i`, connected (and subscribed if `sub`).
async fn join(w: &World, i: usize, device: &str, token: &str, sub: bool) -> anyhow::Result<Client> {
    let mut c = w.admin.create_client(device, device, token, 1)?;
    c.connect(&w.gateways.ws_url_at(i))
        .await
        .map_err(|e| anyhow::anyhow!("connect {device} to gateway {i}: {e}"))?;
    if sub {
        c.sub()
            .await
            .map_err(|e| anyhow::anyhow!("sub {device} on gateway {i}: {e}"))?;
    }
    Ok(c)
}

/// What changed in a client's statistics between two readings.
struct Delta {
    pushes: u64,
    synced: u64,
    sweep_hints: u64,
    overflow_hints: u64,
}

fn delta(before: &ClientStats, after: &ClientStats) -> Delta {
    let hints = |s: &ClientStats, why: &str| s.hints_received.get(why).copied().unwrap_or(0);
    Delta {
        pushes: after.pushes_received - before.pushes_received,
        synced: after.events_synced - before.events_synced,
        sweep_hints: hints(after, "sweep") - hints(before, "sweep"),
        overflow_hints: hints(after, "overflow") - hints(before, "overflow"),
    }
}

/// The push was dropped (none arrived since `before`), and the event came by a sweep hint
/// and one sync.
fn swept_not_pushed(s: &Steady, before: &ClientStats) -> anyhow::Result<()> {
    let d = delta(before, &s.b.stats());
    anyhow::ensure!(
        d.pushes == 0,
        "the push was dropped, yet {} arrived",
        d.pushes
    );
    anyhow::ensure!(
        d.sweep_hints >= 1 && d.synced == 1,
        "hint and sync: {:?}",
        s.b.stats()
    );
    Ok(())
}

/// The commit feed's repair: m1 came by one push and no sync.
fn pushed_not_swept(s: &Steady, before: &ClientStats) -> anyhow::Result<()> {
    let d = delta(before, &s.b.stats());
    anyhow::ensure!(
        d.pushes == 1 && d.synced == 0,
        "the feed's push delivers m1: {:?}",
        s.b.stats()
    );
    Ok(())
}

/// Waits until gateway `i`'s log says the fault point `point` fired.
async fn fired(s: &Steady, i: usize, point: &str) -> anyhow::Result<()> {
    let gw = s.w.gateways.at(i);
    let line = format!("fault fired: point={point}");
    wait_until(&format!("{point} to fire on gateway {i}"), T, async || {
        if gw.log_text().contains(&line) {
            Ok(())
        } else {
            Err(())
        }
    })
    .await
}

/// Dropped push: the receiver's gateway drops the one push of m1. Only the sweep's check of
/// pairs fan-out pushed and no ack reached can find it (no notification was lost, nothing
/// failed): a sweep hint within one interval, then a sync.
async fn dropped_push(two: bool) -> anyhow::Result<()> {
    let s = Steady::start(two, &[]).await?;
    let before = s.b.stats();
    let f = s.w.arm_fault(s.rx, "gw.push:drop:0:1").await?;
    let (seq, t0) = s.send("m1").await?;
    s.repaired(seq, t0, bound()).await?;
    s.w.disarm_fault(f).await?;
    swept_not_pushed(&s, &before)?;
    s.judge().await
}

/// Dropped NOTIFY: the sender's gateway never tells its notifier of m1's commit
/// (`send.after_commit_before_notify:drop`). No gateway is notified; every gateway's commit
/// feed finds the commit at its next look and fan-out pushes it.
async fn dropped_notify(two: bool) -> anyhow::Result<()> {
    feed_repairs(two, "send.after_commit_before_notify:drop:0:1").await
}

/// Failed NOTIFY: the notifier's NOTIFY statement for m1 fails (`fanout.notify:error`).
/// As above: the commit feed finds it.
async fn failed_notify(two: bool) -> anyhow::Result<()> {
    feed_repairs(two, "fanout.notify:error:0:1").await
}

async fn feed_repairs(two: bool, spec: &str) -> anyhow::Result<()> {
    let s = Steady::start(two, &[]).await?;
    let before = s.b.stats();
    let f = s.w.arm_fault(0, spec).await?;
    let (seq, t0) = s.send("m1").await?;
    s.repaired(seq, t0, bound()).await?;
    s.w.disarm_fault(f).await?;
    let fired = format!("fault fired: point={}", f_point(spec));
    anyhow::ensure!(
        s.w.gateways.at(0).log_text().contains(&fired),
        "{spec} never fired"
    );
    pushed_not_swept(&s, &before)?;
    s.judge().await
}

/// The commit feed after a failed look: the receiver's gateway's feed fails one look
/// (`fanout.feed:error:0:1`); then m1's NOTIFY is dropped. The feed must go on looking, from
/// where the failed look would have, for the rest of its LISTEN session: it finds m1 at its
/// next look and fan-out pushes it within the bound. A feed that stopped (bug
/// `feed-gives-up`) leaves m1 to the routine full pass, 60 intervals away, and nothing else
/// can repair it sooner: the LISTEN connection stays up and b1 is idle.
async fn failed_feed_look(two: bool) -> anyhow::Result<()> {
    let s = Steady::start(two, &[]).await?;
    let before = s.b.stats();
    let look = s.w.arm_fault(s.rx, "fanout.feed:error:0:1").await?;
    fired(&s, s.rx, "fanout.feed").await?;
    s.w.disarm_fault(look).await?;
    let f =
        s.w.arm_fault(0, "send.after_commit_before_notify:drop:0:1")
            .await?;
    let (seq, t0) = s.send("m1").await?;
    s.repaired(seq, t0, bound()).await?;
    s.w.disarm_fault(f).await?;
    pushed_not_swept(&s, &before)?;
    s.judge().await
}

/// The commit feed's window: m1's transaction is held open for four sweep intervals before
/// its COMMIT (`send.before_commit:delay(1000):0:1`, sender's gateway), so every gateway's
/// feed looks while it is in flight, and its NOTIFY is then dropped
/// (`send.after_commit_before_notify:drop:0:1`); meanwhile another transaction commits, as
/// under any load, so the looks' marks list m1's as in flight below their xmax. A look must
/// leave a transaction in flight at its mark to the next look (visible in that snapshot or
/// not, not `xid >= xmax`): the first look after the COMMIT finds m1 and fan-out pushes it
/// within the bound of its reply. A feed that takes every id below its mark as seen (bug
/// `feed-window`) never reports it, and the routine full pass is 60 intervals away.
async fn feed_window(two: bool) -> anyhow::Result<()> {
    let s = Steady::start(two, &[]).await?;
    let before = s.b.stats();
    let held =
        s.w.arm_fault(0, "send.before_commit:delay(1000):0:1")
            .await?;
    let f =
        s.w.arm_fault(0, "send.after_commit_before_notify:drop:0:1")
            .await?;
    let pool = s.w.admin.pool().await?;
    let t_send = Instant::now();
    let other = async {
        fired(&s, 0, "send.before_commit").await?;
        // Another transaction takes an id after m1's and commits while m1's is open: a
        // snapshot's xmax is one past the latest completed id, so only then is m1's id
        // below the next look's xmax, listed as in flight.
        sqlx::query("SELECT pg_current_xact_id()")
            .execute(&pool)
            .await?;
        anyhow::Ok(())
    };
    let (sent, other) = tokio::join!(s.send("m1"), other);
    other?;
    let (seq, t0) = sent?;
    anyhow::ensure!(
        t_send.elapsed() >= Duration::from_millis(1000),
        "m1's commit was held ({:?})",
        t_send.elapsed()
    );
    s.repaired(seq, t0, bound()).await?;
    s.w.disarm_fault(f).await?;
    s.w.disarm_fault(held).await?;
    pushed_not_swept(&s, &before)?;
    s.judge().await
}

fn f_point(spec: &str) -> &str {
    spec.split(':').next().unwrap_or(spec)
}

/// Failed fan-out read: every fan-out read of the receiver's gateway fails while m1 is
/// sent (`fanout.read:error`), so no push can bring it; only the sweep's question about
/// the conversations whose read failed can: a hint, then a sync (a sync is no fan-out read).
async fn failed_read(two: bool) -> anyhow::Result<()> {
    let s = Steady::start(two, &[]).await?;
    let before = s.b.stats();
    let f = s.w.arm_fault(s.rx, "fanout.read:error").await?;
    let (seq, t0) = s.send("m1").await?;
    s.repaired(seq, t0, bound()).await?;
    s.w.disarm_fault(f).await?;
    let d = delta(&before, &s.b.stats());
    anyhow::ensure!(d.pushes == 0, "no read succeeded, yet {} pushes", d.pushes);
    anyhow::ensure!(
        d.sweep_hints >= 1 && d.synced == 1,
        "hint and sync: {:?}",
        s.b.stats()
    );
    s.judge().await
}

/// Failed sweep query: the receiver's gateway drops the one push of m1, and the sweep's
/// question about that pair fails: the test holds `device_cursors` under an ACCESS
/// EXCLUSIVE lock (which neither the send nor the fan-out read touches) until the question
/// gave up at `IM_DB_TIMEOUT_MS`. What the sweep drained for it is gone with the failed
/// query; only the full pass the failure asks for can find the receiver now (the routine
/// one is 60 intervals away): a sweep hint within D5's bound of the lock's release, then a
/// sync.
async fn failed_sweep_query(two: bool) -> anyhow::Result<()> {
    let s = Steady::start(two, &[("IM_DB_TIMEOUT_MS", "500")]).await?;
    let before = s.b.stats();
    let pool = s.w.admin.pool().await?;
    let mut lock = pool.begin().await?;
    sqlx::query("LOCK TABLE device_cursors IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await?;
    let f = s.w.arm_fault(s.rx, "gw.push:drop:0:1").await?;
    let (seq, _) = s.send("m1").await?;
    let gw = s.w.gateways.at(s.rx);
    wait_until(
        "the sweep's question about the pair to fail",
        T,
        async || {
            // Either deadline may end it first: the gateway's own, or the server's
            // statement_timeout (the same IM_DB_TIMEOUT_MS).
            if gw.log_text().contains("sweep failed") {
                Ok(())
            } else {
                Err(())
            }
        },
    )
    .await?;
    let t0 = Instant::now();
    lock.rollback().await?;
    s.repaired(seq, t0, bound()).await?;
    s.w.disarm_fault(f).await?;
    swept_not_pushed(&s, &before)?;
    s.judge().await
}

/// Lost LISTEN: the receiver's gateway loses its LISTEN connection and cannot regain it
/// while m1 is sent (its notification is gone, its commit feed pauses). Once it may listen
/// again, the full pass it runs at once hints the receiver: within the reconnect backoff and
/// D5's bound of the disarm.
async fn lost_listen(two: bool) -> anyhow::Result<()> {
    let s = Steady::start(two, &[]).await?;
    let before = s.b.stats();
    let armed = Instant::now();
    let f = s.lose_listen().await?;
    // One gateway: its local hand-off would push m1 without any notification (issue 19),
    // so m1's notification and hand-off are dropped there; only the pass at the regained
    // LISTEN may repair it (the commit feed pauses while LISTEN is down).
    let quiet = if s.rx == 0 {
        Some(s.w.arm_fault(0, "fanout.notify:drop:0:1").await?)
    } else {
        None
    };
    let (seq, _) = s.send("m1").await?;
    s.idle(2).await;
    if let Some(q) = quiet {
        anyhow::ensure!(
            s.w.gw()
                .log_text()
                .contains("fault fired: point=fanout.notify action=drop"),
            "m1's hand-off was not dropped"
        );
        s.w.disarm_fault(q).await?;
    }
    let t0 = Instant::now();
    s.w.disarm_fault(f).await?;
    // Attempts to regain LISTEN back off (50 ms, doubling up to 1 s): at most 5 within the
    // first 1.55 s, then one a second, and one more in flight at the disarm. The gateway
    // must not hammer a database it cannot listen on.
    let attempts =
        s.w.gateways
            .at(s.rx)
            .log_text()
            .matches("fault fired: point=fanout.listen ")
            .count();
    let most = 7 + armed.elapsed().as_secs() as usize;
    anyhow::ensure!(
        (1..=most).contains(&attempts),
        "{attempts} attempts to regain LISTEN in {:?} (at most {most})",
        armed.elapsed()
    );
    s.repaired(seq, t0, RELISTEN_MAX + bound()).await?;
    let d = delta(&before, &s.b.stats());
    anyhow::ensure!(d.pushes == 0, "nobody listened, yet {} pushes", d.pushes);
    anyhow::ensure!(
        d.sweep_hints >= 1 && d.synced == 1,
        "hint and sync: {:?}",
        s.b.stats()
    );
    s.judge().await
}

/// Stale install: as above, and b1 is reinstalled while its gateway does not listen, so the
/// reinstall's notification is lost too. The full pass at the regained LISTEN closes the old
/// install's connection (STALE_INSTALL) within the bound, and the old install never gets m1
/// (no push, hint or sync after the reinstall); the new install gets it at its `sub`.
async fn stale_install(two: bool) -> anyhow::Result<()> {
    let mut s = Steady::start(two, &[]).await?;
    let before = s.b.stats();
    let f = s.lose_listen().await?;
    let token = s.w.admin.reinstall_device("b1").await?;
    let (seq, _) = s.send("m1").await?;
    s.idle(2).await;
    anyhow::ensure!(s.b.is_connected(), "the stale install is still connected");
    let t0 = Instant::now();
    s.w.disarm_fault(f).await?;
    s.b.wait_closed(RELISTEN_MAX + bound()).await?;
    let closed = t0.elapsed();
    let d = delta(&before, &s.b.stats());
    anyhow::ensure!(
        d.pushes == 0 && d.synced == 0 && d.sweep_hints == 0,
        "the stale install got nothing after the reinstall: {:?}",
        s.b.stats()
    );
    anyhow::ensure!(
        !s.b.stored_seqs("c1").contains(&seq),
        "stale install stored m1"
    );
    let stale =
        s.b.frames()
            .iter()
            .any(|(_, f)| f["t"] == "error" && f["code"] == "STALE_INSTALL");
    anyhow::ensure!(stale, "closed with STALE_INSTALL after {closed:?}");
    let fresh = s.w.admin.create_client("b1-new", "b1", &token, 2)?;
    let mut fresh = fresh;
    fresh
        .connect(&s.w.gateways.ws_url_at(s.rx))
        .await
        .map_err(|e| anyhow::anyhow!("connect the new install: {e}"))?;
    fresh.sub().await.map_err(|e| anyhow::anyhow!("sub: {e}"))?;
    fresh.wait_server_delivered("c1", seq, bound()).await?;
    s.b = fresh;
    s.judge().await
}

/// Removed device: as for the stale install, but b1 is removed (its cursor and device rows
/// deleted by SQL, as an operator would; the `im_admin` notification the removal sends is
/// lost with the LISTEN connection). The full pass at the regained LISTEN must find a
/// device that has no row stale and close its connection within the bound (bug
/// `gone-device-stays`: compared with `<>`, a NULL epoch is never stale, and the connection
/// of a device that no longer exists stays open, pushed to until it sends a request).
/// Nothing else closes it: b1 sends nothing. The history checker is not run: it has no line
/// for a cursor deleted by hand; the database invariants are checked.
async fn removed_device(two: bool) -> anyhow::Result<()> {
    let s = Steady::start(two, &[]).await?;
    let f = s.lose_listen().await?;
    let pool = s.w.admin.pool().await?;
    let mut tx = pool.begin().await?;
    sqlx::query("DELETE FROM device_cursors WHERE device_id = 'b1'")
        .execute(&mut *tx)
        .await?;
    let gone = sqlx::query("DELETE FROM devices WHERE device_id = 'b1'")
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    anyhow::ensure!(gone.rows_affected() == 1, "b1 removed");
    s.idle(2).await;
    anyhow::ensure!(
        s.b.is_connected(),
        "nothing but the sweep may close the removed device (its notification was lost)"
    );
    let t0 = Instant::now();
    s.w.disarm_fault(f).await?;
    s.b.wait_closed(RELISTEN_MAX + bound()).await.map_err(|e| {
        anyhow::anyhow!(
            "the removed device's connection after {:?}: {e}",
            t0.elapsed()
        )
    })?;
    let v = db_invariant_violations(&pool).await?;
    anyhow::ensure!(v.is_empty(), "database invariants violated: {v:?}");
    Ok(())
}

/// A stale install's request (S1): b1 is reinstalled while its gateway does not listen, so
/// no notification closes its old install and no full pass is due (the one at the regained
/// LISTEN waits for the disarm). The old install's next request must still be refused at
/// once, by the request's own check of the install: its send gets STALE_INSTALL (not
/// NOT_MEMBER or a `sent`), writes nothing, and its connection closes (1008) at once (the
/// routine full pass is still tens of intervals away).
async fn stale_request(two: bool) -> anyhow::Result<()> {
    let s = Steady::start(two, &[]).await?;
    let f = s.lose_listen().await?;
    s.w.admin.reinstall_device("b1").await?;
    s.idle(2).await;
    anyhow::ensure!(
        s.b.is_connected(),
        "nothing but the request may close the stale install"
    );
    let r = s.b.send("c1", "from-the-old-install", "stale", T).await;
    anyhow::ensure!(
        r.as_ref().err().and_then(|e| e.code()) == Some("STALE_INSTALL"),
        "the stale install's send: {r:?}"
    );
    let t0 = Instant::now();
    s.b.wait_closed(Duration::from_secs(2)).await?;
    anyhow::ensure!(
        s.b.frames()
            .iter()
            .any(|(_, f)| f["t"] == "_close" && f["code"] == 1008),
        "closed with 1008 after {:?}: {:?}",
        t0.elapsed(),
        s.b.frames()
    );
    anyhow::ensure!(
        s.w.admin.count_events("c1").await? == 1,
        "the stale install wrote nothing (only the warm-up is in c1)"
    );
    s.w.disarm_fault(f).await?;
    s.judge().await
}

/// A stale install's ack (D3, and D5 for the install that replaced it): b1 is reinstalled
/// while its gateway does not listen, so nothing closes its old install, and m1 is sent
/// after the reinstall, so the old install never gets it. The old install then acks m1. The
/// ack statement's own install check must refuse the write, not only the answer: the answer
/// is STALE_INSTALL either way, but a cursor written from a replaced install is the
/// device's cursor, which the new install inherits, so it would stand past m1 and neither
/// the new install's `sub` nor the sweep would ever bring m1 (bug `replaced-install-acks`).
/// Checked where only that check acts: in the database (the cursor stays at the warm-up),
/// and by D5 for the new install (it stores m1, by its `sub`'s sync, within the bound).
async fn stale_ack(two: bool) -> anyhow::Result<()> {
    let s = Steady::start(two, &[]).await?;
    let warm = s.w.admin.cursor("b1", "c1").await?;
    let f = s.lose_listen().await?;
    let token = s.w.admin.reinstall_device("b1").await?;
    let (seq, _) = s.send("m1").await?;
    s.idle(2).await;
    anyhow::ensure!(
        s.b.is_connected() && !s.b.stored_seqs("c1").contains(&seq),
        "the old install is connected and never got m1: {:?}",
        s.b.stats()
    );
    let r = s.b.ack("c1", seq, T).await;
    anyhow::ensure!(
        r.as_ref().err().and_then(|e| e.code()) == Some("STALE_INSTALL"),
        "the old install's ack of m1: {r:?}"
    );
    let after = s.w.admin.cursor("b1", "c1").await?;
    anyhow::ensure!(
        after == warm,
        "D3: the replaced install's ack moved b1's cursor in c1 from {warm:?} to {after:?}"
    );
    s.w.disarm_fault(f).await?;
    s.b.wait_closed(RELISTEN_MAX + bound()).await?;
    let mut fresh = s.w.admin.create_client("b1-new", "b1", &token, 2)?;
    fresh
        .connect(&s.w.gateways.ws_url_at(s.rx))
        .await
        .map_err(|e| anyhow::anyhow!("connect the new install: {e}"))?;
    let t0 = Instant::now();
    fresh.sub().await.map_err(|e| anyhow::anyhow!("sub: {e}"))?;
    wait_until("the new install to store m1", bound(), async || {
        if fresh.stored_seqs("c1").contains(&seq) {
            Ok(())
        } else {
            Err(())
        }
    })
    .await
    .map_err(|e| {
        anyhow::anyhow!(
            "D5: the new install has no m1 {:?} after its sub ({e}): {:?}",
            t0.elapsed(),
            fresh.stats()
        )
    })?;
    let mut s = s;
    s.b = fresh;
    s.judge().await
}

/// Overflow: the receiver's queue holds 4 frames and its pushes are slowed
/// (`gw.push:delay(40)`); a burst of 30 messages overflows it. Once the queue drained the
/// writer sends `hint{why:"overflow"}` and the receiver syncs: everything within D5's bound
/// of the last send, with at least one overflow hint and fewer pushes than messages.
async fn overflow(two: bool) -> anyhow::Result<()> {
    let total = 30;
    let s = Steady::start(two, &[("IM_QUEUE_FRAMES_MAX", "4")]).await?;
    let before = s.b.stats();
    let f = s.w.arm_fault(s.rx, "gw.push:delay(40)").await?;
    let mut last = (0, Instant::now());
    for i in 0..total {
        last = s.send(&format!("burst-{i}")).await?;
    }
    let (seq, t0) = last;
    s.repaired(seq, t0, bound()).await?;
    s.w.disarm_fault(f).await?;
    let d = delta(&before, &s.b.stats());
    anyhow::ensure!(d.overflow_hints >= 1, "an overflow hint: {:?}", s.b.stats());
    anyhow::ensure!(d.pushes < total, "the queue overflowed: {:?}", s.b.stats());
    anyhow::ensure!(
        s.b.stored_seqs("c1") == (1..=seq).collect::<Vec<_>>(),
        "every event stored: {:?}",
        s.b.stored_seqs("c1")
    );
    s.judge().await
}

/// Overflow by bytes: as above, but the frame count is the default (256) and the byte budget
/// its least (`IM_QUEUE_BYTES_MAX=4096`), and each message carries 1 KB: only the pushes'
/// charge to the byte budget can overflow the queue (bug `pushes-uncharged`: 30 such
/// pushes fit 256 frames, and the slow reader's queue holds 30 KB against a 4 KiB bound).
/// The pushes that fit are delivered, the rest by the overflow hint's sync, within D5's
/// bound.
async fn overflow_by_bytes(two: bool) -> anyhow::Result<()> {
    let total = 30;
    let s = Steady::start(
        two,
        &[
            ("IM_QUEUE_BYTES_MAX", "4096"),
            ("IM_SYNC_PAGE_MAX_BYTES", "2048"),
        ],
    )
    .await?;
    let before = s.b.stats();
    let f = s.w.arm_fault(s.rx, "gw.push:delay(40)").await?;
    let body = "b".repeat(1000);
    let mut last = (0, Instant::now());
    for i in 0..total {
        let r =
            s.a.send("c1", &format!("big-{i}"), &body, T)
                .await
                .map_err(|e| anyhow::anyhow!("send big-{i}: {e}"))?;
        let seq = r["seq"]
            .as_i64()
            .ok_or_else(|| anyhow::anyhow!("no seq in {r}"))?;
        last = (seq, Instant::now());
    }
    let (seq, t0) = last;
    s.repaired(seq, t0, bound()).await?;
    s.w.disarm_fault(f).await?;
    let d = delta(&before, &s.b.stats());
    anyhow::ensure!(
        d.overflow_hints >= 1 && d.pushes < total,
        "the byte budget overflowed the queue (an overflow hint, fewer pushes than \
         messages): {:?}",
        s.b.stats()
    );
    anyhow::ensure!(
        s.b.stored_seqs("c1") == (1..=seq).collect::<Vec<_>>(),
        "every event stored: {:?}",
        s.b.stored_seqs("c1")
    );
    s.judge().await
}

/// The commit feed after a promotion: the standby that replaces the primary never got the
/// primary's last 300 transactions (its replication link was cut before them), so it hands
/// out those transaction ids again. The gateway regains LISTEN on the new primary and its
/// commit feed starts from the mark taken on that connection: a commit whose notification
/// is then dropped (`send.after_commit_before_notify`), made while the feed's looks are
/// held (`fanout.feed:drop`, from before the failover), is found by the first look after
/// and pushed within D5's bound. A feed that went on from the old primary's snapshot would
/// take the reused id for a transaction it saw committed long ago, and never report it.
#[tokio::test]
async fn repair_dropped_notify_after_a_promotion() {
    use harness::world::{Replication, WorldOpts};
    let opts = GatewayOpts {
        sweep_ms: Some(SWEEP_MS),
        db_timeout_ms: Some(1000),
        control: true,
        ..Default::default()
    };
    let mut w = World::start_with(
        WorldOpts {
            replication: Some(Replication {
                synchronous: false,
                link_delay: Duration::from_millis(1),
            }),
            ..Default::default()
        },
        opts,
    )
    .await
    .unwrap();
    w.admin.add_user("alice").await.unwrap();
    w.admin.add_user("bob").await.unwrap();
    let ta = w.admin.add_device("a1", "alice").await.unwrap();
    let tb = w.admin.add_device("b1", "bob").await.unwrap();
    w.admin.add_conv("c1", &["alice", "bob"]).await.unwrap();
    let mut a = join(&w, 0, "a1", &ta, false).await.unwrap();
    let mut b = join(&w, 0, "b1", &tb, true).await.unwrap();
    a.send("c1", "m1", "replicated", T).await.unwrap();
    b.wait_server_delivered("c1", 1, T).await.unwrap();
    // Everything so far reaches the standby; then its link is cut.
    let standby = w.failover.as_ref().unwrap().standby.pool().await.unwrap();
    wait_until("the standby to hold the first message", T, async || {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
            .fetch_one(&standby)
            .await
            .map_err(|_| ())?;
        if n >= 1 {
            Ok(())
        } else {
            Err(())
        }
    })
    .await
    .unwrap();
    standby.close().await;
    // Cut for good: the link now leads nowhere (port 1 refuses), so the standby cannot
    // reconnect and fetch what follows.
    w.failover
        .as_ref()
        .unwrap()
        .link
        .switch(std::net::SocketAddr::from(([127, 0, 0, 1], 1)));
    // 300 transaction ids the standby will never know of, then the feed's next look.
    let pool = w.admin.pool().await.unwrap();
    for _ in 0..300 {
        sqlx::query("SELECT pg_current_xact_id()")
            .execute(&pool)
            .await
            .unwrap();
    }
    let burned_to: String =
        sqlx::query_scalar("SELECT pg_snapshot_xmax(pg_current_snapshot())::text")
            .fetch_one(&pool)
            .await
            .unwrap();
    tokio::time::sleep(Duration::from_millis(SWEEP_MS * 3)).await;
    // The feed's looks wait until m2 is in: its first look on the new primary must find
    // it from the new session's mark.
    let held = w.arm_fault(0, "fanout.feed:drop").await.unwrap();
    w.failover().await.unwrap();
    wait_until("the gateway to listen on the new primary", T, async || {
        if w.gw().log_text().contains("LISTEN connection regained") {
            Ok(())
        } else {
            Err(())
        }
    })
    .await
    .unwrap();
    // The new lineage closed every connection (issue 21): the devices connect again, the
    // receiver subscribed (its epoch moved: it discards m1 and syncs it again).
    for (c, sub) in [(&mut b, true), (&mut a, false)] {
        reconnect_after_lineage_move(&w, c, sub, T).await.unwrap();
    }
    // Idle: the pass at the regained LISTEN is long over.
    tokio::time::sleep(Duration::from_millis(SWEEP_MS * IDLE_INTERVALS as u64)).await;
    let before = b.stats();
    let f = w
        .arm_fault(0, "send.after_commit_before_notify:drop:0:1")
        .await
        .unwrap();
    let r = a.send("c1", "m2", "after the promotion", T).await.unwrap();
    let seq = r["seq"].as_i64().unwrap();
    let reused: bool =
        sqlx::query_scalar("SELECT xid < $1::text::xid8 FROM events WHERE cmid = 'm2'")
            .bind(&burned_to)
            .fetch_one(&w.admin.pool().await.unwrap())
            .await
            .unwrap();
    assert!(
        reused,
        "m2 took a transaction id the old primary had used (below {burned_to})"
    );
    let t0 = std::time::Instant::now();
    w.disarm_fault(held).await.unwrap();
    b.wait_server_delivered("c1", seq, bound()).await.unwrap();
    println!("found {:?} after the feed was let go", t0.elapsed());
    w.disarm_fault(f).await.unwrap();
    let d = delta(&before, &b.stats());
    assert!(
        d.pushes == 1 && d.synced == 0,
        "the feed's push: {:?}",
        b.stats()
    );
}

/// The local hand-off (issue 19): a gateway pushes its own commits to its own devices
/// without the NOTIFY round trip. With the one gateway's LISTEN connection lost (and kept
/// lost, `fanout.listen:error`), no notification reaches it, the commit feed pauses, and no
/// pass runs until LISTEN is back: m1 still reaches the receiver by push, at once. Pins
/// down a notifier that hands nothing to its own gateway's delivery task.
#[tokio::test]
async fn local_devices_get_pushes_without_the_listen_connection() {
    let s = Steady::start(false, &[]).await.unwrap();
    let before = s.b.stats();
    let f = s.lose_listen().await.unwrap();
    let (seq, t0) = s.send("m1").await.unwrap();
    let took = s.repaired(seq, t0, bound()).await.unwrap();
    let d = delta(&before, &s.b.stats());
    // A sweep hint may still come (m1 pushed, its ack not yet merged when the sweep asked):
    // the receiver then had it already, so it syncs nothing.
    assert!(
        d.pushes == 1 && d.synced == 0,
        "m1 came by push, in {took:?}: {:?}",
        s.b.stats()
    );
    s.w.disarm_fault(f).await.unwrap();
    s.judge().await.unwrap();
}

macro_rules! both {
    ($one:ident, $two:ident, $f:ident) => {
        #[tokio::test]
        async fn $one() {
            $f(false).await.unwrap();
        }
        #[tokio::test]
        async fn $two() {
            $f(true).await.unwrap();
        }
    };
}

both!(
    repair_dropped_push_one_gateway,
    repair_dropped_push_two_gateways,
    dropped_push
);
both!(
    repair_dropped_notify_one_gateway,
    repair_dropped_notify_two_gateways,
    dropped_notify
);
both!(
    repair_failed_notify_one_gateway,
    repair_failed_notify_two_gateways,
    failed_notify
);
both!(
    repair_feed_window_one_gateway,
    repair_feed_window_two_gateways,
    feed_window
);
both!(
    repair_failed_feed_look_one_gateway,
    repair_failed_feed_look_two_gateways,
    failed_feed_look
);
both!(
    repair_failed_read_one_gateway,
    repair_failed_read_two_gateways,
    failed_read
);
both!(
    repair_failed_sweep_query_one_gateway,
    repair_failed_sweep_query_two_gateways,
    failed_sweep_query
);
both!(
    repair_lost_listen_one_gateway,
    repair_lost_listen_two_gateways,
    lost_listen
);
both!(
    repair_stale_install_one_gateway,
    repair_stale_install_two_gateways,
    stale_install
);
both!(
    repair_removed_device_one_gateway,
    repair_removed_device_two_gateways,
    removed_device
);
both!(
    repair_stale_request_one_gateway,
    repair_stale_request_two_gateways,
    stale_request
);
both!(
    repair_stale_ack_one_gateway,
    repair_stale_ack_two_gateways,
    stale_ack
);
both!(
    repair_overflow_by_bytes_one_gateway,
    repair_overflow_by_bytes_two_gateways,
    overflow_by_bytes
);
both!(
    repair_overflow_one_gateway,
    repair_overflow_two_gateways,
    overflow
);
