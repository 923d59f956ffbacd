//! `serve`: the root that wires the gateway together. It builds the shared [`State`], starts
//! the fan-out and sweep loops and one `conn::run` per connection, runs the accept loop with
//! its limits, and shuts down gracefully.
//!
//! Admission, in order: a place for the source address (`IM_CONNS_PER_ADDR_MAX`, counting
//! handshakes and connections), a place in the handshake pool (`IM_HANDSHAKES_MAX`), the
//! handshake within `IM_HANDSHAKE_TIMEOUT_MS`, and only once the upgrade request is complete
//! a connection slot (`IM_MAX_CONNECTIONS`, 503 when none is free). Unfinished handshakes
//! (slowloris) therefore never take the slots of finished connections, and handshake tasks
//! end at once on shutdown. It owns task lifetimes (one root `CancellationToken`, one
//! `TaskTracker`), not protocol logic (`conn`) nor SQL (`store`).

use crate::config::Config;
use crate::hub::Hub;
use crate::limits::{AddrCounts, HelloThrottle};
use crate::lineage::Lineage;
use crate::observer::Observer;
use crate::state::{State, FANOUT_POOL_MAX};
use crate::{batch, conn, fanout, store, sweep};
use sqlx::PgPool;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::StatusCode;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::WebSocketStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Bytes of each connection's WebSocket read buffer.
const WS_READ_BUFFER: usize = 8 * 1024;

/// Refusals (fixed 503s) being written at once; past it a refused socket is just closed.
const REFUSALS_MAX: usize = 64;

/// Writes a fixed 503 without reading the request or running a handshake, at most one
/// second spent on it, at most [`REFUSALS_MAX`] at once.
fn refuse(state: &State, refusals: &Arc<Semaphore>, tcp: tokio::net::TcpStream, why: &'static str) {
    let Ok(permit) = refusals.clone().try_acquire_owned() else {
        return;
    };
    state.tracker.spawn(async move {
        use tokio::io::AsyncWriteExt;
        let mut tcp = tcp;
        let body = format!("{why}\n");
        let head = format!(
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        let refuse = async {
            tcp.write_all(head.as_bytes()).await?;
            tcp.write_all(body.as_bytes()).await?;
            tcp.shutdown().await
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), refuse).await;
        drop(permit);
    });
}

/// Closes every connection of the gateway whenever the database's lineage moves
/// ([`Lineage::moved`], issue 21), until shutdown: each device reconnects (1012, service
/// restart) and its `subbed` names the new epochs.
async fn close_all_when_the_lineage_moves(state: Arc<State>) {
    let mut rx = state.lineage.moved();
    loop {
        tokio::select! {
            _ = state.cancel.cancelled() => return,
            r = rx.changed() => if r.is_err() { return },
        }
        let conns = state.hub.all();
        tracing::info!(
            connections = conns.len(),
            "lineage moved: closing connections"
        );
        for c in conns {
            c.close(1012, None);
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
    pg_listener: fanout::Listening,
    lineage: Arc<Lineage>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let state = start(cfg, pool, pg_listener, lineage, cancel).await?;
    accept(&state, listener).await;
    tracing::info!("shutting down: no longer accepting");
    shut_down(&state).await;
    tracing::info!("stopped");
    Ok(())
}

/// The gateway's state and its background tasks: fan-out, the sweep and the lineage watch.
async fn start(
    cfg: Config,
    pool: PgPool,
    pg_listener: fanout::Listening,
    lineage: Arc<Lineage>,
    cancel: CancellationToken,
) -> anyhow::Result<Arc<State>> {
    let fanout_pool = store::connect(
        &cfg.database_url,
        FANOUT_POOL_MAX,
        cfg.db_timeout(),
        Some(cfg.db_timeout()),
        cfg.synchronous_commit,
        Some(lineage.clone()),
    )
    .await?;
    let (notifier, notifier_rx) = store::Notifier::new();
    let sends = batch::sends(
        pool.clone(),
        notifier.clone(),
        cfg.batch_slots,
        cfg.send_batch_max,
    );
    let acks = batch::acks(pool.clone(), cfg.batch_slots, cfg.send_batch_max);
    let hub = Arc::new(Hub::default());
    let state = Arc::new(State {
        observer: Observer::new(hub.clone()),
        hub,
        sends,
        acks,
        pool,
        fanout_pool,
        notifier,
        tracker: TaskTracker::new(),
        cancel,
        sweep_now: Notify::new(),
        lineage,
        changes: Default::default(),
        hello_throttle: HelloThrottle::new(
            cfg.hello_fails_per_addr_per_min,
            cfg.hello_fails_per_device_per_min,
        ),
        cfg,
    });
    state
        .tracker
        .spawn(fanout::run(state.clone(), pg_listener, notifier_rx));
    state.tracker.spawn(sweep::run(state.clone()));
    state
        .tracker
        .spawn(close_all_when_the_lineage_moves(state.clone()));
    Ok(state)
}

/// The limits every accepted socket passes before it becomes a connection.
struct Gates {
    slots: Arc<Semaphore>,
    handshakes: Arc<Semaphore>,
    per_addr: Arc<AddrCounts>,
    refusals: Arc<Semaphore>,
    handshake_timeout: Duration,
    ws_config: WebSocketConfig,
}

/// Accepts until shutdown: each socket that passes the per-address and handshake limits is
/// upgraded in a task of its own ([`upgrade`]); the others are refused with a reason.
async fn accept(state: &Arc<State>, listener: TcpListener) {
    let gates = Gates {
        slots: Arc::new(Semaphore::new(state.cfg.connections_max)),
        handshakes: Arc::new(Semaphore::new(state.cfg.handshakes_max)),
        per_addr: AddrCounts::new(state.cfg.conns_per_addr_max),
        refusals: Arc::new(Semaphore::new(REFUSALS_MAX)),
        handshake_timeout: Duration::from_millis(state.cfg.handshake_timeout_ms),
        ws_config: WebSocketConfig::default()
            // Hard cap for tungstenite; frames between frame_max and this get a TOO_LARGE
            // reply.
            .max_message_size(Some(state.cfg.frame_max_bytes * 2))
            .max_frame_size(Some(state.cfg.frame_max_bytes * 2))
            // Issue 19: 8 KiB read buffers (tungstenite's default is 128 KiB, allocated per
            // connection): an idle connection costs tens of KiB, not hundreds; larger frames
            // still arrive whole, in several reads.
            .read_buffer_size(WS_READ_BUFFER),
    };
    let next_id = AtomicU64::new(1);
    loop {
        let (tcp, peer) = tokio::select! {
            _ = state.cancel.cancelled() => break,
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
        let Some(addr_slot) = gates.per_addr.admit(peer.ip()) else {
            tracing::info!(%peer, "IM_CONNS_PER_ADDR_MAX reached: refused");
            refuse(
                state,
                &gates.refusals,
                tcp,
                "too many connections from this address",
            );
            continue;
        };
        let Ok(handshake) = gates.handshakes.clone().try_acquire_owned() else {
            tracing::info!(%peer, "IM_HANDSHAKES_MAX reached: refused");
            refuse(
                state,
                &gates.refusals,
                tcp,
                "too many handshakes in progress",
            );
            continue;
        };
        let id = next_id.fetch_add(1, Ordering::Relaxed);
        let (st, slots) = (state.clone(), gates.slots.clone());
        let (timeout, config) = (gates.handshake_timeout, gates.ws_config);
        state.tracker.spawn(async move {
            let Some((ws, slot)) = upgrade(&st, tcp, peer, id, slots, timeout, config).await else {
                return;
            };
            drop(handshake);
            conn::run(st, ws, id, peer).await;
            drop(slot);
            drop(addr_slot);
        });
    }
    drop(listener);
}

/// The WebSocket handshake of one accepted socket, within `timeout`: only on `/ws`, and
/// only with a free connection slot, taken when the upgrade request is complete, never
/// before. `None` when it was refused, failed, timed out or shutdown came first.
async fn upgrade(
    state: &State,
    tcp: TcpStream,
    peer: SocketAddr,
    id: u64,
    slots: Arc<Semaphore>,
    timeout: Duration,
    config: WebSocketConfig,
) -> Option<(WebSocketStream<TcpStream>, OwnedSemaphorePermit)> {
    let mut slot = None;
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
        match slots.try_acquire_owned() {
            Ok(p) => {
                slot = Some(p);
                Ok(resp)
            }
            Err(_) => {
                tracing::info!(%peer, "connection limit reached: refused");
                Err(refuse(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "connection limit reached",
                ))
            }
        }
    };
    let hs = tokio_tungstenite::accept_hdr_async_with_config(tcp, check, Some(config));
    let ws = tokio::select! {
        _ = state.cancel.cancelled() => return None,
        r = tokio::time::timeout(timeout, hs) => match r {
            Ok(Ok(ws)) => ws,
            Ok(Err(e)) => {
                tracing::info!(conn = id, %peer, error = %e, "handshake refused or failed");
                return None;
            }
            Err(_) => {
                tracing::info!(conn = id, %peer, "handshake timed out (IM_HANDSHAKE_TIMEOUT_MS)");
                return None;
            }
        },
    };
    // A finished handshake took a slot.
    Some((ws, slot?))
}

/// Waits (bounded by IM_SHUTDOWN_GRACE_MS each) for every task, then for both pools to
/// close.
async fn shut_down(state: &State) {
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
    if tokio::time::timeout(grace, state.fanout_pool.close())
        .await
        .is_err()
    {
        tracing::warn!("fan-out pool did not close within the grace period");
    }
}
