//! Fan-out: the notifier, one dedicated LISTEN connection on `im_events`, the commit feed,
//! and the delivery task.
//!
//! The notifier ([`notify_loop`]) gets every `(conv, seq)` the send path committed, after
//! COMMIT returned (`store::send`), and NOTIFYs them in a statement of its own: whatever
//! arrived while the previous NOTIFY ran goes in the next one, as `conv:seq` lines. No send
//! transaction holds NOTIFY's cluster-wide lock through its commit flush any more, and one
//! NOTIFY carries as many commits as the load brings. Before each NOTIFY it hands the same
//! commits to this gateway's delivery task directly (the local hand-off): this gateway's
//! own devices need no NOTIFY round trip, and the notification that follows finds them
//! pushed. Only other gateways depend on the NOTIFY.
//!
//! The commit feed ([`feed`]) is how every gateway learns of a notification that never
//! happens (a crash between COMMIT and the notifier, a NOTIFY that failed or was never
//! sent): each sweep interval it asks the database which events committed since it last
//! looked and hands them to the delivery task like notifications (D5). While NOTIFY works,
//! the delivery task has pushed them already and the feed costs one query an interval.
//!
//! A notification carries only `conv:seq`. The delivery task ([`deliver`]) takes every
//! notification waiting, turns them into one range per conversation (from the last seq it
//! pushed in this LISTEN session to the highest notified: every seq below a committed one
//! is committed, P1), reads all ranges and their audiences in one query on the fan-out's
//! own connections (`State::fanout_pool`, never queued behind requests), and offers each
//! event to the subscribed connections of the users who may see it now (S1), in seq order
//! per conversation. A notification at or below what was pushed already (another gateway's
//! or a late one of this gateway) reads nothing; one that comes before the ones below it
//! pulls them in with its range, so notifications arriving out of order cost no push.
//!
//! The same connection listens on `im_admin` (`store::ADMIN_CHANNEL`), where a trigger
//! (migration 0002) announces every reinstall or removal of a device in the transaction
//! that commits it: the gateway then closes that device's connections whose install is no
//! longer current (`Hub::revoke_stale`). Fan-out itself reads the audience's current
//! installs in the same query as the events, so nothing reaches a stale install between the
//! commit and the notification.
//!
//! Notifications sent while the LISTEN connection is down are gone for good (and sqlx's
//! listener sometimes reports a reset as an error): any error or loss of the connection
//! rebuilds the listener and runs a full pass of the sweep at once (D5), which finds every
//! device left behind and every install that became stale meanwhile; the commit feed pauses
//! while the connection is down and starts afresh with the new session.
//!
//! Fault points: `fanout.notify` (the NOTIFY), `fanout.read` (a fan-out read),
//! `fanout.listen` (an attempt to regain LISTEN).

use crate::bugs::{self, Bug};
use crate::faults::{self, points};
use crate::state::State;
use crate::store;
use sqlx::postgres::PgListener;
use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// A LISTEN connection and the commit feed's mark taken on it just before its LISTEN: every
/// commit after the mark is found by the feed from the mark on (and those after the LISTEN
/// are notified to this session too); what committed before it is the full pass's.
pub struct Listening {
    listener: PgListener,
    mark: store::FeedMark,
}

/// Connects the LISTEN connection (called once before `listening on`, then on every loss)
/// and takes the commit feed's mark on it (its last statement stays the LISTEN, which is how
/// `pg_stat_activity` tells it).
pub async fn listen(pool: &sqlx::PgPool) -> Result<Listening, sqlx::Error> {
    let mut l = PgListener::connect_with(pool).await?;
    l.ignore_pool_close_event(true);
    // A lost connection is rebuilt by `run` (which then sweeps), not inside `try_recv`.
    l.eager_reconnect(false);
    let mark = store::feed_mark(&mut l).await?;
    l.listen_all([store::CHANNEL, store::ADMIN_CHANNEL]).await?;
    Ok(Listening { listener: l, mark })
}

fn parse_line(p: &str) -> Option<(String, i64)> {
    let (conv, seq) = p.rsplit_once(':')?;
    Some((conv.to_string(), seq.parse().ok()?))
}

/// Most committed pairs one NOTIFY statement carries (in payloads of at most 7000 bytes).
const NOTIFY_BATCH_MAX: usize = 4096;

/// The notifier: NOTIFYs every `(conv, seq)` the send path committed, batched (whatever
/// arrived while the previous NOTIFY ran), on the fan-out's own connections. Ends when every
/// [`store::Notifier`] is gone or at shutdown, after notifying what it already has. A NOTIFY
/// that fails is not retried: every gateway's commit feed ([`feed`]) finds those commits
/// within one sweep interval (D5).
pub async fn notify_loop(
    state: Arc<State>,
    mut rx: store::NotifierRx,
    local: mpsc::Sender<Notified>,
) {
    let mut batch: Vec<(String, i64)> = Vec::new();
    let no_handoff = bugs::active(Bug::NoLocalHandoff);
    loop {
        let first = tokio::select! {
            // At shutdown, notify what already committed (the feed would find it anyway).
            _ = state.cancel.cancelled() => rx.try_recv().ok(),
            x = rx.recv() => x,
        };
        let Some(first) = first else { return };
        batch.push(first);
        while batch.len() < NOTIFY_BATCH_MAX {
            match rx.try_recv() {
                Ok(x) => batch.push(x),
                Err(_) => break,
            }
        }
        let sent = match faults::gate(points::FANOUT_NOTIFY, "dropped", "failed").await {
            ControlFlow::Break(why) => Err(format!("fault point {}: {why}", points::FANOUT_NOTIFY)),
            ControlFlow::Continue(()) => {
                // Local hand-off (issue 19): this gateway's own devices need no NOTIFY round
                // trip; the delivery task takes these as notifications at once, and the
                // NOTIFY that follows finds them pushed (`Order`). Never waits: when the
                // delivery task is behind, the NOTIFY brings them a moment later.
                for (conv, seq) in batch.iter().filter(|_| !no_handoff) {
                    let _ = local.try_send(Notified::Event(conv.clone(), *seq));
                }
                let payloads = store::payloads(&batch);
                match tokio::time::timeout(
                    state.cfg.db_timeout(),
                    store::notify(&state.fanout_pool, &payloads),
                )
                .await
                {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err("timed out".to_string()),
                }
            }
        };
        if let Err(e) = sent {
            tracing::warn!(
                events = batch.len(),
                error = %e,
                "NOTIFY failed; the commit feed finds these commits"
            );
        }
        batch.clear();
    }
}

/// Most conversations one look of the commit feed hands to fan-out; past it, the sweep runs
/// a full pass instead (which finds every lagging pair whatever the feed missed).
pub const FEED_CONVS_MAX: usize = 10_000;

/// The commit feed (D5): every sweep interval, asks the database which events committed
/// since its last look ([`store::commits_since`]) and hands them to the delivery task as
/// notifications. Fan-out ([`Order`]) reads only what no notification brought already, so
/// while NOTIFY works the feed costs one query an interval and no read. It finds what no
/// notification will ever bring: a NOTIFY that failed or was never sent (the fault points
/// `send.after_commit_before_notify` and `fanout.notify`), and a commit whose gateway died
/// before its NOTIFY, wherever the event's audience is connected.
///
/// It looks only while this gateway listens (`session` holds the LISTEN session and the
/// mark taken on its connection, `None` while the connection is down) and starts each new
/// session from that session's mark: a lost LISTEN connection may mean a new server (a
/// promoted standby, whose transaction ids may repeat the old primary's), and what
/// committed before the mark is the full pass's (the LISTEN loop asks for one at once).
pub async fn feed(
    state: Arc<State>,
    tx: mpsc::Sender<Notified>,
    mut session: tokio::sync::watch::Receiver<Option<store::FeedMark>>,
) {
    if bugs::active(Bug::NoFeed) {
        return;
    }
    let mut tick = tokio::time::interval(Duration::from_millis(state.cfg.sweep_interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut mark: Option<store::FeedMark> = session.borrow_and_update().clone();
    loop {
        tokio::select! {
            _ = state.cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        // A new session (a regained LISTEN connection) starts from its own mark.
        if session.has_changed().unwrap_or(false) {
            mark = session.borrow_and_update().clone();
        }
        let Some(since) = mark.take() else { continue };
        // The fault point fails the look as the database would (`drop` and `error` alike).
        let look = match faults::gate(points::FANOUT_FEED, (), ()).await {
            ControlFlow::Break(()) => Err("fault point fanout.feed".to_string()),
            ControlFlow::Continue(()) => tokio::time::timeout(
                state.cfg.db_timeout(),
                store::commits_since(&state.fanout_pool, &since, FEED_CONVS_MAX),
            )
            .await
            .map_err(|_| "timed out".to_string())
            .and_then(|r| r.map_err(|e| e.to_string())),
        };
        let (next, found) = match look {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(error = %e, "commit feed: look failed; again next interval");
                // D5: a failed look moves nothing; the next one asks again from the same
                // mark, for the rest of this LISTEN session.
                if !bugs::active(Bug::FeedGivesUp) {
                    mark = Some(since);
                }
                continue;
            }
        };
        // Unless the session changed meanwhile: the next tick takes its mark (or none).
        if !session.has_changed().unwrap_or(false) {
            mark = Some(next);
        }
        let Some(found) = found else {
            tracing::warn!(
                max = FEED_CONVS_MAX,
                "commit feed: more conversations committed than it hands on; full pass"
            );
            state.changes.ask_full();
            continue;
        };
        for (conv, low, high) in found {
            for seq in [low, high] {
                if tx.send(Notified::Event(conv.clone(), seq)).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// What the listener and the commit feed hand to the delivery task, in the order they got it.
pub enum Notified {
    /// An `im_events` notification: `conv:seq` committed.
    Event(String, i64),
    /// The LISTEN connection was rebuilt: a new session (possibly on another server, a
    /// promoted standby), whose order starts afresh.
    NewSession,
}

/// The LISTEN loop: starts the delivery task and the commit feed, hands every notification
/// on, and rebuilds the connection whenever it is lost (then sweeps at once, D5).
pub async fn run(state: Arc<State>, first: Listening, notifier_rx: store::NotifierRx) {
    let (tx, rx) = mpsc::channel::<Notified>(65_536);
    state.tracker.spawn(deliver(state.clone(), rx));
    state
        .tracker
        .spawn(notify_loop(state.clone(), notifier_rx, tx.clone()));
    // The LISTEN session's feed mark (`None` while the connection is down).
    let (session_tx, session_rx) = tokio::sync::watch::channel(Some(first.mark));
    state
        .tracker
        .spawn(feed(state.clone(), tx.clone(), session_rx));
    let mut listener = Some(first.listener);
    let mut backoff = Duration::from_millis(50);
    loop {
        let mut l = match listener.take() {
            Some(l) => l,
            None => {
                let r = tokio::select! {
                    _ = state.cancel.cancelled() => return,
                    r = relisten(&state) => r,
                };
                match r {
                    Ok(Listening { listener, mark }) => {
                        tracing::info!("LISTEN connection regained: sweeping at once");
                        backoff = Duration::from_millis(50);
                        if !bugs::active(Bug::NoRegainPass) {
                            state.sweep_now.notify_one();
                        }
                        if tx.send(Notified::NewSession).await.is_err() {
                            return;
                        }
                        let _ = session_tx.send(Some(mark));
                        listener
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "LISTEN reconnect failed");
                        tokio::select! {
                            _ = state.cancel.cancelled() => return,
                            _ = tokio::time::sleep(backoff) => {},
                        }
                        backoff = (backoff * 2).min(Duration::from_secs(1));
                        continue;
                    }
                }
            }
        };
        if !receive(&state, &mut l, &tx).await {
            return;
        }
        // Drop the old listener entirely and build a new one (a full pass follows once it
        // is regained: one now would miss whatever commits before then).
        drop(l);
        let _ = session_tx.send(None);
    }
}

/// One attempt to regain the LISTEN connection (the `fanout.listen` point can fail it).
async fn relisten(state: &State) -> anyhow::Result<Listening> {
    if faults::gate(points::FANOUT_LISTEN, (), ()).await.is_break() {
        anyhow::bail!("fault point {}", points::FANOUT_LISTEN);
    }
    Ok(listen(&state.pool).await?)
}

/// Hands on every notification of one LISTEN session until the connection is lost
/// (`true`) or the gateway stops (`false`).
async fn receive(state: &Arc<State>, l: &mut PgListener, tx: &mpsc::Sender<Notified>) -> bool {
    loop {
        let r = tokio::select! {
            _ = state.cancel.cancelled() => return false,
            r = l.try_recv() => r,
        };
        match r {
            Ok(Some(n)) if n.channel() == store::ADMIN_CHANNEL => {
                match n.payload().strip_prefix("device:") {
                    Some(device) => {
                        let (st, device) = (state.clone(), device.to_string());
                        state
                            .tracker
                            .spawn(async move { revoke(&st, &device).await });
                    }
                    None => {
                        tracing::warn!(payload = n.payload(), "unknown admin notification ignored")
                    }
                }
            }
            Ok(Some(n)) => {
                for line in n.payload().lines() {
                    match parse_line(line) {
                        Some((conv, seq)) => {
                            if tx.send(Notified::Event(conv, seq)).await.is_err() {
                                return false;
                            }
                        }
                        None => tracing::warn!(line, "malformed notification ignored"),
                    }
                }
            }
            Ok(None) => {
                tracing::warn!("LISTEN connection lost: notifications in between are gone");
                return true;
            }
            Err(e) => {
                tracing::warn!(error = %e, "LISTEN connection failed: notifications in between are gone");
                return true;
            }
        }
    }
}

/// A device was reinstalled or removed: close its connections whose install is no longer
/// current (STALE_INSTALL, then a close). If the read fails, the next sweep does it.
async fn revoke(state: &State, device: &str) {
    let read = tokio::time::timeout(
        state.cfg.db_timeout(),
        store::install_epoch(&state.pool, device),
    )
    .await;
    match read {
        Ok(Ok(current)) => {
            let n = state.hub.revoke_stale(device, current);
            tracing::info!(device, current, closed = n, "device install changed");
        }
        Ok(Err(e)) => {
            tracing::warn!(device, error = %e, "install read failed; the sweep will close stale installs")
        }
        Err(_) => tracing::warn!(
            device,
            "install read timed out; the sweep will close stale installs"
        ),
    }
}

/// Most conversations [`Order`] remembers; past it, it starts over (as a new session
/// would: the check gets weaker for a moment, never wrong).
const ORDER_CONVS_MAX: usize = 65_536;

/// Most events one range reads: a conversation further behind than this (a long stall of
/// the fan-out) gets its newest events pushed and the rest by the sweep's hint (D5).
const RANGE_EVENTS_MAX: i64 = 1024;

/// P1 for pushes, paired with the send transaction: within one LISTEN session, fan-out
/// pushes the events of one conversation in strictly increasing seq order, each at most
/// once. It remembers the last seq pushed per conversation; a notification at or below it
/// reads nothing, one above it reads the range from it ([`Order::ranges`]), and every event
/// pushed must be above it ([`Order::pushed`], a panic, which ends the process, if not).
/// Every connection's queue gets a subsequence of this stream, so the pushes of one
/// conversation in one queue are strictly increasing too, while the queue as a whole may
/// carry a seq again: a sync page after a hint re-delivers pushed events, and a reconnect
/// subscribes afresh.
///
/// Not checked across sessions (notifications lost with a LISTEN connection are gone, and
/// a promoted standby may hand out a seq the old primary notified but never replicated),
/// nor under the `seq-gap` bug, whose seq is taken outside the row lock: there a notified
/// seq does not mean the ones below it committed.
struct Order {
    last: HashMap<String, i64>,
    checked: bool,
}

impl Order {
    fn new() -> Order {
        Order {
            last: HashMap::new(),
            checked: !bugs::active(Bug::SeqGap),
        }
    }

    fn new_session(&mut self) {
        self.last.clear();
    }

    /// One range per conversation for these notifications: from the last seq pushed (if
    /// any; else from just below the lowest notified) to the highest notified, at most
    /// [`RANGE_EVENTS_MAX`] events. Notifications at or below the last push give none.
    fn ranges(&self, notified: &[(String, i64)]) -> Vec<store::Range> {
        let mut by: HashMap<&str, (i64, i64)> = HashMap::new();
        for (conv, seq) in notified {
            let last = self.last.get(conv.as_str()).copied();
            if last.is_some_and(|l| *seq <= l) {
                continue;
            }
            let from = last.unwrap_or(seq - 1);
            let e = by.entry(conv.as_str()).or_insert((from, *seq));
            e.0 = e.0.min(from);
            e.1 = e.1.max(*seq);
        }
        let mut out: Vec<store::Range> = by
            .into_iter()
            .map(|(conv, (after, upto))| store::Range {
                conv: conv.to_string(),
                after: after.max(upto - RANGE_EVENTS_MAX),
                upto,
            })
            .collect();
        out.sort_by(|a, b| a.conv.cmp(&b.conv));
        out
    }

    /// Records `conv:seq` as pushed; a panic (which ends the process) if it is not above
    /// the last seq pushed for `conv` in this session.
    fn pushed(&mut self, conv: &str, seq: i64) {
        if let Some(last) = self.last.get(conv) {
            assert!(
                !self.checked || seq > *last,
                "P1 broken: push {conv}:{seq} after {conv}:{last} in one LISTEN session"
            );
        }
        self.remember(conv, seq);
    }

    /// A range was read: nothing of it is read again in this session (an event missing
    /// from it, which only a promoted standby could cause, is left to the sweep).
    fn read(&mut self, r: &store::Range) {
        self.remember(&r.conv, r.upto);
    }

    /// `seq` of `conv` was pushed or read. At most [`ORDER_CONVS_MAX`] conversations are
    /// remembered: a new one past it starts over, as a new session would.
    fn remember(&mut self, conv: &str, seq: i64) {
        if let Some(last) = self.last.get_mut(conv) {
            *last = (*last).max(seq);
            return;
        }
        if self.last.len() >= ORDER_CONVS_MAX {
            self.last.clear();
        }
        self.last.insert(conv.to_string(), seq);
    }
}

/// Reads each batch of notified events with their audiences and offers them to the
/// audiences' connections.
async fn deliver(state: Arc<State>, mut rx: mpsc::Receiver<Notified>) {
    // IM_FANOUT_BATCH_MAX: most notifications one read covers.
    let batch_max = state.cfg.fanout_inflight_max.max(1);
    let mut order = Order::new();
    let mut notified: Vec<(String, i64)> = Vec::new();
    loop {
        let first = tokio::select! {
            _ = state.cancel.cancelled() => return,
            n = rx.recv() => n,
        };
        let Some(first) = first else { return };
        let mut next = Some(first);
        // Everything waiting, up to the first new session (handled after this batch).
        let mut new_session = false;
        while let Some(n) = next.take() {
            match n {
                Notified::NewSession => {
                    new_session = true;
                    break;
                }
                Notified::Event(conv, seq) => notified.push((conv, seq)),
            }
            if notified.len() < batch_max {
                next = rx.try_recv().ok();
            }
        }
        if !notified.is_empty() {
            deliver_batch(&state, &mut order, &notified).await;
            notified.clear();
        }
        if new_session {
            order.new_session();
        }
    }
}

/// One fan-out read for a batch of notifications, then the pushes in (conv, seq) order.
async fn deliver_batch(state: &State, order: &mut Order, notified: &[(String, i64)]) {
    let ranges = order.ranges(notified);
    if ranges.is_empty() {
        return;
    }
    if state.hub.none_subscribed() {
        // Nobody to push to: nothing to read. A connection that subscribes later gets these
        // events from its `sub` (head above its cursor, it syncs).
        for r in &ranges {
            tracing::debug!(conv = %r.conv, upto = r.upto, "nobody subscribed: not read");
            order.read(r);
        }
        return;
    }
    // A failed read and a timed-out one are the same to D5: one path records both.
    let read = match faults::gate(points::FANOUT_READ, (), ()).await {
        ControlFlow::Break(()) => Err(format!("fault point {}", points::FANOUT_READ)),
        ControlFlow::Continue(()) => match tokio::time::timeout(
            state.cfg.db_timeout(),
            store::events_with_audience(&state.fanout_pool, &ranges),
        )
        .await
        {
            Ok(read) => read.map_err(|e| e.to_string()),
            Err(_) => Err(format!(
                "timed out after IM_DB_TIMEOUT_MS ({} ms)",
                state.cfg.db_timeout().as_millis()
            )),
        },
    };
    let events = match read {
        Ok(events) => events,
        // Nothing recorded as read: a later notification of the same conversation reads
        // these again, and the sweep repairs whatever no later read covers.
        // D5: the sweep asks about these conversations at its next interval.
        Err(error) => {
            for r in ranges
                .iter()
                .filter(|_| !bugs::active(Bug::ReadFailUnrecorded))
            {
                state.changes.read_failed(&r.conv);
            }
            tracing::warn!(ranges = ranges.len(), %error, "fan-out read failed; the sweep will hint");
            return;
        }
    };
    for (ev, audience) in &events {
        order.pushed(&ev.conv, ev.seq);
        let frame = crate::protocol::event_frame(ev);
        // Only current installs (read with the audience): a stale one gets nothing.
        let to: Vec<_> = state
            .hub
            .conns_of(&audience.users)
            .into_iter()
            .filter(|c| audience.installs.contains(&c.install_key()))
            .collect();
        // D5: recorded before it is queued; the sweep verifies what is not acked.
        let installs = to.iter().map(|c| (c.who.device.as_str(), c.who.epoch));
        state.changes.pushed(installs, &ev.conv, ev.seq);
        for c in &to {
            c.push(ev, &frame);
        }
    }
    for r in &ranges {
        order.read(r);
    }
}

#[cfg(test)]
mod tests {
    use super::{Order, RANGE_EVENTS_MAX};
    use crate::store::Range;

    fn n(pairs: &[(&str, i64)]) -> Vec<(String, i64)> {
        pairs.iter().map(|(c, s)| (c.to_string(), *s)).collect()
    }

    fn r(conv: &str, after: i64, upto: i64) -> Range {
        Range {
            conv: conv.into(),
            after,
            upto,
        }
    }

    /// The P1 push check accepts increasing seqs per conversation (gaps included: a
    /// notification lost with nothing else is not a reorder), conversations interleaved,
    /// and anything after a new session.
    #[test]
    fn order_accepts_increasing_seqs_per_conversation() {
        let mut o = Order::new();
        for (conv, seq) in [("a", 1), ("b", 7), ("a", 2), ("a", 5), ("b", 8)] {
            o.pushed(conv, seq);
        }
        o.new_session();
        o.pushed("a", 1);
    }

    #[test]
    #[should_panic(expected = "P1 broken: push a:2 after a:2")]
    fn order_refuses_a_seq_twice() {
        let mut o = Order::new();
        o.pushed("a", 1);
        o.pushed("a", 2);
        o.pushed("a", 2);
    }

    /// Notifications become one range per conversation: from the last push (or below the
    /// lowest notified on first sight) to the highest notified; at or below the last push
    /// nothing; out of order, the higher one pulls the lower ones in and the late lower
    /// one reads nothing.
    #[test]
    fn ranges_cover_each_conversation_once_from_the_last_push() {
        let mut o = Order::new();
        let got = o.ranges(&n(&[("a", 5), ("b", 2), ("a", 7), ("a", 6)]));
        assert_eq!(got, vec![r("a", 4, 7), r("b", 1, 2)]);
        for x in &got {
            o.read(x);
        }
        // Late, lower, or equal notifications read nothing; a higher one reads the gap.
        assert_eq!(o.ranges(&n(&[("a", 6), ("a", 7), ("b", 1)])), vec![]);
        assert_eq!(o.ranges(&n(&[("a", 9), ("a", 8)])), vec![r("a", 7, 9)]);
        // Out of order across batches: 11 before 10 pulls 10 in; 10 then reads nothing.
        o.read(&r("a", 7, 9));
        let got = o.ranges(&n(&[("a", 11)]));
        assert_eq!(got, vec![r("a", 9, 11)]);
        o.read(&got[0]);
        assert_eq!(o.ranges(&n(&[("a", 10)])), vec![]);
        // A conversation far behind reads only its newest RANGE_EVENTS_MAX events.
        let far = 11 + RANGE_EVENTS_MAX + 500;
        assert_eq!(
            o.ranges(&n(&[("a", far)])),
            vec![r("a", far - RANGE_EVENTS_MAX, far)]
        );
    }

    /// The record is bounded: it holds up to ORDER_CONVS_MAX conversations, pushed or read,
    /// forgetting none of them (a forgotten one would be read and pushed again when the
    /// commit feed announces what NOTIFY already delivered); one more starts it over.
    #[test]
    fn order_remembers_at_most_its_bound_of_conversations() {
        let mut o = Order::new();
        for i in 0..super::ORDER_CONVS_MAX {
            if i % 2 == 0 {
                o.pushed(&format!("c{i}"), 3);
            } else {
                o.read(&r(&format!("c{i}"), 0, 3));
            }
        }
        assert_eq!(o.last.len(), super::ORDER_CONVS_MAX);
        assert_eq!(o.ranges(&n(&[("c0", 3), ("c1", 2)])), vec![]);
        o.read(&r("new", 0, 1));
        assert_eq!(o.last.len(), 1);
        assert_eq!(o.ranges(&n(&[("c0", 3)])), vec![r("c0", 2, 3)]);
    }

    /// A failed read records nothing: the next notification reads the range again.
    #[test]
    fn unread_ranges_are_read_again() {
        let mut o = Order::new();
        assert_eq!(o.ranges(&n(&[("a", 3)])), vec![r("a", 2, 3)]);
        o.pushed("a", 1);
        assert_eq!(o.ranges(&n(&[("a", 4)])), vec![r("a", 1, 4)]);
    }

    #[test]
    fn payload_lines_are_conv_colon_seq() {
        assert_eq!(super::parse_line("c-ab:7"), Some(("c-ab".into(), 7)));
        assert_eq!(super::parse_line("a:b:12"), Some(("a:b".into(), 12)));
        assert_eq!(super::parse_line("nope"), None);
        assert_eq!(super::parse_line("c:x"), None);
    }
}
