//! Fan-out: one dedicated LISTEN connection on `im_events`. A notification carries only
//! `conv:seq`; for each one the gateway reads the event and its audience once (one query,
//! not one per recipient) and offers the push to every subscribed connection of every user
//! who may see it now (S1). Reads run a few at a time but pushes leave in notification order.
//!
//! The same connection listens on `im_admin` (`store::ADMIN_CHANNEL`), where a trigger
//! (migration 0002) announces every reinstall or removal of a device in the transaction
//! that commits it: the gateway then closes that device's connections whose install is no
//! longer current (`Hub::revoke_stale`). Fan-out itself reads the audience's current
//! installs in the same query as the event, so nothing reaches a stale install between the
//! commit and the notification.
//!
//! Notifications sent while the LISTEN connection is down are gone for good (and sqlx's
//! listener sometimes reports a reset as an error): any error or loss of the connection
//! rebuilds the listener and runs a sweep at once (D5), which finds every device left behind.

use crate::bugs;
use crate::state::State;
use crate::store;
use futures_util::StreamExt;
use sqlx::postgres::PgListener;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// Connects the LISTEN connection (called once before `listening on`, then on every loss).
pub async fn listen(pool: &sqlx::PgPool) -> Result<PgListener, sqlx::Error> {
    let mut l = PgListener::connect_with(pool).await?;
    l.ignore_pool_close_event(true);
    // A lost connection is rebuilt by `run` (which then sweeps), not inside `try_recv`.
    l.eager_reconnect(false);
    l.listen_all([store::CHANNEL, store::ADMIN_CHANNEL]).await?;
    Ok(l)
}

fn parse_payload(p: &str) -> Option<(String, i64)> {
    let (conv, seq) = p.rsplit_once(':')?;
    Some((conv.to_string(), seq.parse().ok()?))
}

/// What the listener hands to the delivery task, in the order it got it.
enum Notified {
    /// An `im_events` notification: `conv:seq` committed.
    Event(String, i64),
    /// The LISTEN connection was rebuilt: a new session (possibly on another server, a
    /// promoted standby), whose order starts afresh.
    NewSession,
}

pub async fn run(state: Arc<State>, first: PgListener) {
    let (tx, rx) = mpsc::channel::<Notified>(4096);
    state.tracker.spawn(deliver(state.clone(), rx));
    let mut listener = Some(first);
    let mut backoff = Duration::from_millis(50);
    loop {
        let mut l = match listener.take() {
            Some(l) => l,
            None => {
                let r = tokio::select! {
                    _ = state.cancel.cancelled() => return,
                    r = listen(&state.pool) => r,
                };
                match r {
                    Ok(l) => {
                        tracing::info!("LISTEN connection regained: sweeping at once");
                        backoff = Duration::from_millis(50);
                        state.sweep_now.notify_one();
                        if tx.send(Notified::NewSession).await.is_err() {
                            return;
                        }
                        l
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
        loop {
            let r = tokio::select! {
                _ = state.cancel.cancelled() => return,
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
                        None => tracing::warn!(
                            payload = n.payload(),
                            "unknown admin notification ignored"
                        ),
                    }
                }
                Ok(Some(n)) => match parse_payload(n.payload()) {
                    Some((conv, seq)) => {
                        if tx.send(Notified::Event(conv, seq)).await.is_err() {
                            return;
                        }
                    }
                    None => tracing::warn!(payload = n.payload(), "malformed notification ignored"),
                },
                Ok(None) => {
                    tracing::warn!("LISTEN connection lost: notifications in between are gone");
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "LISTEN connection failed: notifications in between are gone");
                    break;
                }
            }
        }
        // Drop the old listener entirely and build a new one (then sweep).
        drop(l);
        state.sweep_now.notify_one();
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

/// Most conversations [`Order`] remembers; past it, it starts over (the check gets weaker
/// for a moment, never wrong).
const ORDER_CONVS_MAX: usize = 65_536;

/// P1, paired with the send transaction: within one LISTEN session, the notifications of
/// one conversation come in strictly increasing seq order. The seq is taken under the
/// conversation's row lock, held until COMMIT, and PostgreSQL delivers notifications in
/// commit order; the `(conv_id, seq)` primary key forbids a seq twice. Every connection's
/// queue gets a subsequence of this stream, so the pushes of one conversation in one queue
/// are strictly increasing too, while the queue as a whole may carry a seq again: a sync
/// page after a hint re-delivers pushed events, and a reconnect subscribes afresh.
///
/// Not checked across sessions (notifications lost with a LISTEN connection are gone, and
/// a promoted standby may hand out a seq the old primary notified but never replicated),
/// nor under the `seq-gap` bug, whose seq is taken outside the row lock so commits, and
/// their notifications, may come out of order.
struct Order {
    last: HashMap<String, i64>,
    checked: bool,
}

impl Order {
    fn new() -> Order {
        Order {
            last: HashMap::new(),
            checked: !bugs::active(bugs::SEQ_GAP),
        }
    }

    fn new_session(&mut self) {
        self.last.clear();
    }

    /// Records `conv:seq` as notified; a panic (which ends the process) if it is not above
    /// the last seq notified for `conv` in this session.
    fn notified(&mut self, conv: &str, seq: i64) {
        if !self.checked {
            return;
        }
        if let Some(last) = self.last.get_mut(conv) {
            assert!(
                seq > *last,
                "P1 broken: notification {conv}:{seq} after {conv}:{last} in one LISTEN session"
            );
            *last = seq;
            return;
        }
        if self.last.len() >= ORDER_CONVS_MAX {
            self.last.clear();
        }
        self.last.insert(conv.to_string(), seq);
    }
}

/// Reads each notified event with its audience and offers it to the audience's connections.
async fn deliver(state: Arc<State>, rx: mpsc::Receiver<Notified>) {
    let inflight = state.cfg.fanout_inflight_max;
    let reads =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) })
            .map(|item| {
                let pool = state.pool.clone();
                async move {
                    match item {
                        Notified::NewSession => None,
                        Notified::Event(conv, seq) => {
                            let r = store::event_with_audience(&pool, &conv, seq).await;
                            Some((conv, seq, r))
                        }
                    }
                }
            })
            .buffered(inflight);
    tokio::pin!(reads);
    let mut order = Order::new();
    loop {
        let next = tokio::select! {
            _ = state.cancel.cancelled() => return,
            n = reads.next() => n,
        };
        let Some(next) = next else { return };
        let Some((conv, seq, r)) = next else {
            order.new_session();
            continue;
        };
        order.notified(&conv, seq);
        match r {
            Ok(Some((ev, audience))) => {
                let frame = crate::protocol::event_frame(&ev);
                // Only current installs (read with the audience): a stale one gets nothing.
                let to: Vec<_> = state
                    .hub
                    .conns_of(&audience.users)
                    .into_iter()
                    .filter(|c| audience.installs.contains(&c.install_key()))
                    .collect();
                // D5: recorded before it is queued; the sweep verifies what is not acked.
                let installs = to.iter().map(|c| (c.who.device.as_str(), c.who.epoch));
                state.changes.pushed(installs, &conv, seq);
                for c in &to {
                    c.push(&ev, &frame);
                }
            }
            Ok(None) => tracing::warn!(conv, seq, "notified event not found"),
            // The sweep repairs whatever this push would have delivered.
            Err(e) => {
                state.changes.read_failed(&conv);
                tracing::warn!(conv, seq, error = %e, "fan-out read failed; the sweep will hint")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Order;

    /// The P1 order check accepts increasing seqs per conversation (gaps included: a
    /// notification lost with nothing else is not a reorder), conversations interleaved,
    /// and anything after a new session.
    #[test]
    fn order_accepts_increasing_seqs_per_conversation() {
        let mut o = Order::new();
        for (conv, seq) in [("a", 1), ("b", 7), ("a", 2), ("a", 5), ("b", 8)] {
            o.notified(conv, seq);
        }
        o.new_session();
        o.notified("a", 1);
    }

    #[test]
    #[should_panic(expected = "P1 broken: notification a:2 after a:2")]
    fn order_refuses_a_seq_twice() {
        let mut o = Order::new();
        o.notified("a", 1);
        o.notified("a", 2);
        o.notified("a", 2);
    }

    #[test]
    fn payload_is_conv_colon_seq() {
        assert_eq!(super::parse_payload("c-ab:7"), Some(("c-ab".into(), 7)));
        assert_eq!(super::parse_payload("a:b:12"), Some(("a:b".into(), 12)));
        assert_eq!(super::parse_payload("nope"), None);
        assert_eq!(super::parse_payload("c:x"), None);
    }
}
