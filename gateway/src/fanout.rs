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

use crate::state::State;
use crate::store;
use futures_util::StreamExt;
use sqlx::postgres::PgListener;
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

pub async fn run(state: Arc<State>, first: PgListener) {
    let (tx, rx) = mpsc::channel::<(String, i64)>(4096);
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
                    Some(item) => {
                        if tx.send(item).await.is_err() {
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

/// Reads each notified event with its audience and offers it to the audience's connections.
async fn deliver(state: Arc<State>, rx: mpsc::Receiver<(String, i64)>) {
    let inflight = state.cfg.fanout_inflight_max;
    let reads =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) })
            .map(|(conv, seq)| {
                let pool = state.pool.clone();
                async move {
                    let r = store::event_with_audience(&pool, &conv, seq).await;
                    (conv, seq, r)
                }
            })
            .buffered(inflight);
    tokio::pin!(reads);
    loop {
        let next = tokio::select! {
            _ = state.cancel.cancelled() => return,
            n = reads.next() => n,
        };
        let Some((conv, seq, r)) = next else { return };
        match r {
            Ok(Some((ev, audience))) => {
                let frame = crate::protocol::event_frame(&ev);
                for c in state.hub.conns_of(&audience.users) {
                    // Only current installs (read with the audience): a stale one gets nothing.
                    if audience.installs.contains(&c.install_key()) {
                        c.push(&ev, &frame);
                    }
                }
            }
            Ok(None) => tracing::warn!(conv, seq, "notified event not found"),
            // The sweep repairs whatever this push would have delivered.
            Err(e) => {
                tracing::warn!(conv, seq, error = %e, "fan-out read failed; the sweep will hint")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn payload_is_conv_colon_seq() {
        assert_eq!(super::parse_payload("c-ab:7"), Some(("c-ab".into(), 7)));
        assert_eq!(super::parse_payload("a:b:12"), Some(("a:b".into(), 12)));
        assert_eq!(super::parse_payload("nope"), None);
        assert_eq!(super::parse_payload("c:x"), None);
    }
}
