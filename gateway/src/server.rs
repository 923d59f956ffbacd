//! `serve`: shared state, the accept loop with its connection cap, the per-request database
//! deadline, and graceful shutdown. It owns task lifetimes (one root `CancellationToken`, one
//! `TaskTracker`), not protocol logic (`conn`) nor SQL (`store`).

use crate::config::Config;
use crate::error::WireError;
use crate::hub::Hub;
use crate::{conn, fanout, sweep};
use sqlx::postgres::PgListener;
use sqlx::PgPool;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore};
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::StatusCode;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub struct State {
    pub cfg: Config,
    pub pool: PgPool,
    pub hub: Hub,
    /// Every task of the gateway, waited for (bounded) at shutdown.
    pub tracker: TaskTracker,
    /// The root token: cancelled on SIGTERM/SIGINT.
    pub cancel: CancellationToken,
    /// Wakes the sweep at once (after the LISTEN connection was lost and regained).
    pub sweep_now: Notify,
}

impl State {
    /// Runs database work for a request with the `IM_DB_TIMEOUT_MS` deadline. The work runs
    /// in its own task, so when the deadline passes the client gets UNAVAILABLE at once while
    /// the transaction still finishes or rolls back on its own: it is never cancelled halfway.
    pub async fn db<T, F, W>(&self, work: W) -> Result<T, WireError>
    where
        W: FnOnce(PgPool) -> F,
        F: Future<Output = Result<T, WireError>> + Send + 'static,
        T: Send + 'static,
    {
        let task = self.tracker.spawn(work(self.pool.clone()));
        match tokio::time::timeout(self.cfg.db_work_deadline(), task).await {
            Ok(Ok(r)) => r,
            Ok(Err(join)) => {
                tracing::error!(error = %join, "request task failed");
                Err(WireError::Internal)
            }
            Err(_) => {
                tracing::warn!(
                    timeout_ms = self.cfg.db_timeout_ms,
                    "database deadline passed: UNAVAILABLE"
                );
                Err(WireError::Unavailable)
            }
        }
    }
}

/// Serves on an already bound listener until `cancel` fires, then shuts down gracefully:
/// stop accepting, close every connection with a close frame after its in-flight request,
/// wait (bounded) for every task.
pub async fn serve(
    listener: TcpListener,
    cfg: Config,
    pool: PgPool,
    pg_listener: PgListener,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let state = Arc::new(State {
        cfg,
        pool,
        hub: Hub::default(),
        tracker: TaskTracker::new(),
        cancel: cancel.clone(),
        sweep_now: Notify::new(),
    });
    state.tracker.spawn(fanout::run(state.clone(), pg_listener));
    state.tracker.spawn(sweep::run(state.clone()));

    let slots = Arc::new(Semaphore::new(state.cfg.connections_max));
    let next_id = AtomicU64::new(1);
    let ws_config = WebSocketConfig::default()
        // Hard cap for tungstenite; frames between frame_max and this get a TOO_LARGE reply.
        .max_message_size(Some(state.cfg.frame_max_bytes * 2))
        .max_frame_size(Some(state.cfg.frame_max_bytes * 2));
    loop {
        let (tcp, peer) = tokio::select! {
            _ = cancel.cancelled() => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            // Over IM_MAX_CONNECTIONS: a fixed 503, written without reading the request or
            // running a handshake, and at most one second spent on it.
            state.tracker.spawn(async move {
                use tokio::io::AsyncWriteExt;
                let mut tcp = tcp;
                let refuse = async {
                    tcp.write_all(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 25\r\nConnection: close\r\n\r\nconnection limit reached\n").await?;
                    tcp.shutdown().await
                };
                let _ = tokio::time::timeout(Duration::from_secs(1), refuse).await;
            });
            tracing::info!(%peer, "connection limit reached: refused");
            continue;
        };
        let id = next_id.fetch_add(1, Ordering::Relaxed);
        let st = state.clone();
        state.tracker.spawn(async move {
            // The callback's signature is tungstenite's; its error type is not ours to shrink.
            #[allow(clippy::result_large_err)]
            let check = |req: &Request, resp: Response| -> Result<Response, ErrorResponse> {
                let refuse = |code: StatusCode, why: &str| {
                    let mut r = ErrorResponse::new(Some(why.to_string()));
                    *r.status_mut() = code;
                    r
                };
                if req.uri().path() != "/ws" {
                    return Err(refuse(
                        StatusCode::NOT_FOUND,
                        "the WebSocket endpoint is /ws",
                    ));
                }
                Ok(resp)
            };
            let hs = tokio_tungstenite::accept_hdr_async_with_config(tcp, check, Some(ws_config));
            let ws = match tokio::time::timeout(Duration::from_secs(10), hs).await {
                Ok(Ok(ws)) => ws,
                Ok(Err(e)) => {
                    tracing::info!(conn = id, %peer, error = %e, "handshake refused or failed");
                    return;
                }
                Err(_) => {
                    tracing::info!(conn = id, %peer, "handshake timed out");
                    return;
                }
            };
            conn::run(st, ws, id, peer.to_string()).await;
            drop(permit);
        });
    }
    drop(listener);
    tracing::info!("shutting down: no longer accepting");
    state.tracker.close();
    let grace = Duration::from_millis(state.cfg.shutdown_grace_ms);
    if tokio::time::timeout(grace, state.tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            grace_ms = state.cfg.shutdown_grace_ms,
            "shutdown grace exceeded; exiting anyway"
        );
    }
    // close() waits for every checked-out connection: bounded, like the rest of shutdown.
    if tokio::time::timeout(grace, state.pool.close())
        .await
        .is_err()
    {
        tracing::warn!("database pool did not close within the grace period");
    }
    tracing::info!("stopped");
    Ok(())
}
