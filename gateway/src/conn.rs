//! One WebSocket connection: its read loop (parse, authenticate, then hand each request to
//! its own task, at most IM_CONN_INFLIGHT_MAX at once), and its writer task (drains the
//! bounded queue, applies the reply/push fault points, sends overflow hints once drained,
//! closes). It owns no SQL (that is `store`) and never blocks anyone else: fan-out only ever
//! `try_send`s into its queue.
//!
//! Requests after `hello` run concurrently, so one slow request (say, waiting out the
//! database deadline) never delays the next one's answer; replies are matched by `rid` and
//! may leave in another order than the requests came.

use crate::bugs;
use crate::config::{SUB_CONVS_MAX, SYNC_LIMIT_DEFAULT};
use crate::error::WireError;
use crate::faults::{self, points, Fired};
use crate::hub::{ConnHandle, Kind, Out};
use crate::protocol::{self, Request};
use crate::server::State;
use crate::store::{self, Principal, SendOutcome, Sent, UncommittedHook};
use futures_util::{SinkExt, StreamExt};
use serde_json::json;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Semaphore};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;
use tokio_util::sync::CancellationToken;

type Sink = futures_util::stream::SplitSink<WebSocketStream<TcpStream>, Message>;
/// The connection's entry in the hub, once it subscribed; shared with the writer.
type HandleSlot = Arc<Mutex<Option<Arc<ConnHandle>>>>;

/// Serves one upgraded connection until the peer leaves, a fatal error, or shutdown.
pub async fn run(state: Arc<State>, ws: WebSocketStream<TcpStream>, id: u64, peer: String) {
    let (sink, mut stream) = ws.split();
    let (tx, rx) = mpsc::channel::<Out>(state.cfg.queue_frames_max);
    let slot: HandleSlot = Default::default();
    let write_timeout = Duration::from_millis(state.cfg.write_timeout_ms);
    // Cancelled when the writer gives up (write failed or timed out): the reader stops too.
    let writer_gone = CancellationToken::new();
    let writer = state.tracker.spawn(writer(
        sink,
        rx,
        slot.clone(),
        id,
        write_timeout,
        writer_gone.clone(),
    ));
    let hello_deadline =
        tokio::time::Instant::now() + Duration::from_millis(state.cfg.hello_timeout_ms);
    let inflight_max = state.cfg.conn_inflight_max;
    let inflight = Arc::new(Semaphore::new(inflight_max));
    // A request task cancels this to end the connection (after STALE_INSTALL, say).
    let close = CancellationToken::new();
    let close_code: Arc<Mutex<CloseCode>> = Arc::new(Mutex::new(CloseCode::Policy));
    tracing::info!(conn = id, %peer, "connection opened");

    let mut session: Option<Arc<Session>> = None;
    let code = loop {
        let msg = tokio::select! {
            _ = state.cancel.cancelled() => break CloseCode::Away,
            _ = writer_gone.cancelled() => break CloseCode::Abnormal,
            _ = close.cancelled() => break *close_code.lock().unwrap_or_else(|p| p.into_inner()),
            _ = tokio::time::sleep_until(hello_deadline), if session.is_none() => {
                tracing::info!(conn = id, "no hello within IM_HELLO_TIMEOUT_MS: closing");
                break CloseCode::Policy;
            }
            m = stream.next() => m,
        };
        let text = match msg {
            None => break CloseCode::Normal,
            Some(Ok(Message::Text(t))) => t,
            Some(Ok(Message::Binary(_))) => {
                let e = WireError::bad("binary frames are not accepted: send JSON text");
                reply(&tx, id, None, Err(e)).await;
                continue;
            }
            Some(Ok(Message::Close(_))) => break CloseCode::Normal,
            Some(Ok(_)) => continue, // ping/pong: tungstenite answers pings itself
            Some(Err(WsError::Capacity(_))) => {
                too_large(&tx, id, state.cfg.frame_max_bytes).await;
                break CloseCode::Size;
            }
            Some(Err(e)) => {
                tracing::info!(conn = id, error = %e, "connection read error");
                break CloseCode::Abnormal;
            }
        };
        if text.len() > state.cfg.frame_max_bytes {
            too_large(&tx, id, state.cfg.frame_max_bytes).await;
            break CloseCode::Size;
        }
        let inbound = protocol::parse(&text, state.cfg.body_max_bytes);
        let Some(s) = &session else {
            // Nothing but `hello` is served before hello, and hello is served inline.
            match hello(&state, &tx, id, inbound.rid.as_deref(), inbound.req).await {
                Ok(Some(who)) => {
                    session = Some(Arc::new(Session {
                        state: state.clone(),
                        id,
                        tx: tx.clone(),
                        who,
                        slot: slot.clone(),
                        close: close.clone(),
                        close_code: close_code.clone(),
                        sub_lock: tokio::sync::Mutex::new(()),
                    }))
                }
                Ok(None) => {}
                Err(code) => break code,
            }
            continue;
        };
        // Bounded concurrency per connection: past the limit the reader waits, which only
        // slows this connection.
        let Ok(permit) = inflight.clone().acquire_owned().await else {
            break CloseCode::Error;
        };
        let s = s.clone();
        state.tracker.spawn(async move {
            s.dispatch(inbound.rid.as_deref(), inbound.req).await;
            drop(permit);
        });
    };
    // Let in-flight requests finish and queue their replies before the close frame.
    let _ = inflight.acquire_many(inflight_max as u32).await;
    if let Some(h) = slot.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
        state.hub.remove(h);
    }
    let device = session
        .as_ref()
        .map(|s| s.who.device.clone())
        .unwrap_or_default();
    if code != CloseCode::Abnormal {
        let _ = tx
            .send(Out::new(Kind::Close(code.into()), String::new()))
            .await;
    }
    drop(session);
    drop(tx);
    slot.lock().unwrap_or_else(|p| p.into_inner()).take();
    let _ = writer.await;
    tracing::info!(conn = id, %peer, device, code = u16::from(code), "connection closed");
}

/// Queues a frame. Replies wait for queue space: that only slows this connection.
async fn queue(tx: &mpsc::Sender<Out>, kind: Kind, text: String) {
    let _ = tx.send(Out::new(kind, text)).await;
}

async fn reply(
    tx: &mpsc::Sender<Out>,
    id: u64,
    rid: Option<&str>,
    r: Result<serde_json::Value, WireError>,
) {
    match r {
        Ok(mut v) => {
            let kind = match v["t"].as_str() {
                Some("sent") => Kind::Sent,
                Some("acked") => Kind::Acked,
                _ => Kind::Reply,
            };
            if let Some(rid) = rid {
                v["rid"] = json!(rid);
            }
            queue(tx, kind, v.to_string()).await;
        }
        Err(e) => {
            if matches!(e, WireError::Internal) {
                tracing::error!(conn = id, "request failed with INTERNAL");
            }
            queue(tx, Kind::Reply, protocol::error_frame(rid, &e)).await
        }
    }
}

async fn too_large(tx: &mpsc::Sender<Out>, id: u64, frame_max_bytes: usize) {
    let e = WireError::TooLarge(format!("frame is larger than {frame_max_bytes} bytes"));
    tracing::info!(conn = id, "frame over the size limit: closing");
    queue(tx, Kind::Reply, protocol::error_frame(None, &e)).await;
}

/// Serves a frame before hello. `Ok(Some)`: authenticated; `Ok(None)`: answered, go on;
/// `Err(code)`: answered, close with `code` (a failed hello).
async fn hello(
    state: &State,
    tx: &mpsc::Sender<Out>,
    id: u64,
    rid: Option<&str>,
    req: Result<Request, WireError>,
) -> Result<Option<Principal>, CloseCode> {
    let (device, token, epoch) = match req {
        Err(e) => {
            reply(tx, id, rid, Err(e)).await;
            return Ok(None);
        }
        Ok(Request::Hello {
            device,
            token,
            epoch,
        }) => (device, token, epoch),
        Ok(_) => {
            reply(
                tx,
                id,
                rid,
                Err(WireError::Unauthenticated("say hello first")),
            )
            .await;
            return Ok(None);
        }
    };
    let r = state
        .db(move |pool| async move { store::authenticate(&pool, &device, &token, epoch).await })
        .await;
    match r {
        Ok(p) => {
            let v = json!({"t": "welcome", "user": p.user, "device": p.device, "epoch": p.epoch});
            tracing::debug!(conn = id, user = %p.user, device = %p.device, "authenticated");
            reply(tx, id, rid, Ok(v)).await;
            Ok(Some(p))
        }
        Err(e) => {
            let fatal = matches!(e, WireError::Unauthenticated(_) | WireError::StaleInstall);
            reply(tx, id, rid, Err(e)).await;
            if fatal {
                Err(CloseCode::Policy)
            } else {
                Ok(None)
            }
        }
    }
}

/// An authenticated connection as its request tasks share it.
struct Session {
    state: Arc<State>,
    id: u64,
    tx: mpsc::Sender<Out>,
    /// Fixed by `hello`.
    who: Principal,
    slot: HandleSlot,
    /// Cancelled by a request that must end the connection; the reader then closes.
    close: CancellationToken,
    close_code: Arc<Mutex<CloseCode>>,
    /// Serialises `sub` requests, so a failing one cannot undo a succeeding one.
    sub_lock: tokio::sync::Mutex<()>,
}

impl Session {
    /// Replies; STALE_INSTALL (the device was reinstalled meanwhile) also ends the connection.
    async fn reply(&self, rid: Option<&str>, r: Result<serde_json::Value, WireError>) {
        let stale = matches!(r, Err(WireError::StaleInstall));
        reply(&self.tx, self.id, rid, r).await;
        if stale {
            self.close_with(CloseCode::Policy);
        }
    }

    /// The hook `store::send` calls before COMMIT, for the deliberate bugs that break D1
    /// there (`None` otherwise, always without the `bugs` feature), and whether it replied.
    fn uncommitted_hook(
        &self,
        rid: Option<&str>,
    ) -> Option<(Arc<UncommittedHook>, Arc<AtomicBool>)> {
        let reply = bugs::active(bugs::REPLY_BEFORE_COMMIT);
        let push = bugs::active(bugs::PUSH_BEFORE_COMMIT);
        if !reply && !push {
            return None;
        }
        let replied = Arc::new(AtomicBool::new(false));
        let flag = replied.clone();
        let tx = self.tx.clone();
        let state = self.state.clone();
        let rid = rid.map(str::to_string);
        let hook = move |sent: &Sent, ev: &protocol::Event, audience: &[String]| {
            if reply {
                let mut v = sent_json(&ev.conv, sent);
                if let Some(rid) = &rid {
                    v["rid"] = json!(rid);
                }
                flag.store(true, Ordering::Release);
                if let Err(mpsc::error::TrySendError::Full(out)) =
                    tx.try_send(Out::new(Kind::Sent, v.to_string()))
                {
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        let _ = tx.send(out).await;
                    });
                }
            }
            if push {
                let frame = protocol::event_frame(ev);
                for c in state.hub.conns_of(audience) {
                    c.push(ev, &frame);
                }
            }
        };
        Some((Arc::new(hook), replied))
    }

    fn close_with(&self, code: CloseCode) {
        *self.close_code.lock().unwrap_or_else(|p| p.into_inner()) = code;
        self.close.cancel();
    }

    /// Handles one request after hello, replies (or, after a `drop` fault, does not).
    async fn dispatch(&self, rid: Option<&str>, req: Result<Request, WireError>) {
        let req = match req {
            Ok(r) => r,
            Err(e) => return self.reply(rid, Err(e)).await,
        };
        let st = &self.state;
        let who = &self.who;
        match req {
            Request::Hello { .. } => {
                self.reply(rid, Err(WireError::bad("already authenticated")))
                    .await
            }
            Request::Send { conv, cmid, body } => {
                let w = who.clone();
                let c = conv.clone();
                // `None` but for the deliberate bugs that act before COMMIT.
                let early = self.uncommitted_hook(rid);
                let hook = early.as_ref().map(|(h, _)| h.clone());
                let r = st
                    .db(move |pool| async move {
                        store::send(&pool, &w, &c, &cmid, &body, hook.as_deref()).await
                    })
                    .await;
                if early.is_some_and(|(_, replied)| replied.load(Ordering::Acquire)) {
                    // `reply-before-commit`: the reply already left; nothing more is said.
                    return;
                }
                let sent = match r {
                    Ok(SendOutcome::Reply(s)) => s,
                    Ok(SendOutcome::NoReply) => return,
                    Err(e) => return self.reply(rid, Err(e)).await,
                };
                // D1: we get here only after COMMIT returned (or for a committed duplicate).
                match faults::check(points::API_AFTER_SEND_COMMIT).await {
                    Fired::Pass => {}
                    Fired::Drop => return,
                    Fired::Error => return self.reply(rid, Err(WireError::Unavailable)).await,
                }
                self.reply(rid, Ok(sent_json(&conv, &sent))).await
            }
            Request::Ack { conv, seq } => {
                match faults::check(points::GW_RECV_ACK).await {
                    Fired::Pass => {}
                    Fired::Drop => return,
                    Fired::Error => return self.reply(rid, Err(WireError::Unavailable)).await,
                }
                let w = who.clone();
                let c = conv.clone();
                let r = st
                    .db(move |pool| async move { store::ack(&pool, &w, &c, seq).await })
                    .await;
                self.reply(
                    rid,
                    r.map(|d| json!({"t": "acked", "conv": conv, "delivered": d})),
                )
                .await
            }
            Request::Sub => {
                let _one_at_a_time = self.sub_lock.lock().await;
                // Register before reading the state, so no event falls between the two.
                let h = {
                    let mut slot = self.slot.lock().unwrap_or_else(|p| p.into_inner());
                    slot.get_or_insert_with(|| {
                        Arc::new(ConnHandle::new(self.id, who.clone(), self.tx.clone()))
                    })
                    .clone()
                };
                let newly = st.hub.subscribe(&h);
                let w = who.clone();
                let r = st
                    .db(move |pool| async move {
                        store::conv_states(&pool, &w, SUB_CONVS_MAX).await
                    })
                    .await;
                let r = r.map(|convs| {
                    let convs: Vec<_> = convs
                        .iter()
                        .map(|c| json!({"conv": c.conv, "head": c.head, "delivered": c.delivered}))
                        .collect();
                    json!({"t": "subbed", "convs": convs})
                });
                if r.is_err() && newly {
                    // A failed `sub` takes no effect: the client was told it did not work.
                    st.hub.remove(&h);
                }
                self.reply(rid, r).await
            }
            Request::Sync { conv, after, limit } => {
                let limit = limit
                    .unwrap_or(SYNC_LIMIT_DEFAULT)
                    .min(st.cfg.sync_limit_max);
                let w = who.clone();
                let c = conv.clone();
                let page_max = st.cfg.sync_page_max_bytes;
                let r = st
                    .db(move |pool| async move {
                        store::sync(&pool, &w, &c, after, limit, page_max).await
                    })
                    .await;
                let r = r.map(|p| {
                    let events: Vec<_> = p.events.iter().map(|e| e.to_json()).collect();
                    json!({"t": "synced", "conv": conv, "events": events, "head": p.head,
                           "complete": p.complete})
                });
                self.reply(rid, r).await
            }
        }
    }
}

/// The `sent` reply (without `rid`).
fn sent_json(conv: &str, sent: &Sent) -> serde_json::Value {
    json!({"t": "sent", "conv": conv, "seq": sent.seq, "mid": sent.mid,
           "dup": sent.dup, "epoch": sent.epoch})
}

/// Writes one frame; a peer that does not take it within `limit` is an error (the
/// connection is then abandoned, so a half-written frame does not matter).
async fn write(sink: &mut Sink, text: String, limit: Duration) -> Result<(), WsError> {
    match tokio::time::timeout(limit, sink.send(Message::text(text))).await {
        Ok(r) => r,
        Err(_) => Err(WsError::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "peer did not read within IM_WRITE_TIMEOUT_MS",
        ))),
    }
}

/// A WebSocket ping this often when nothing else was written: a peer that vanished without
/// closing is then found by the write timeout or the kernel, not never.
const PING_INTERVAL: Duration = Duration::from_secs(30);

/// Drains the queue to the socket. The `gw.reply.send`, `gw.reply.ack` and `gw.push` fault
/// points act here, on the frame about to be written. Once the queue is empty it sends the
/// overflow hints (`why:"overflow"`) the fan-out recorded while it was full. If a write
/// fails or the peer stops reading for `limit`, it cancels `gone` so the reader ends the
/// connection too (its replies would have nowhere to go).
async fn writer(
    mut sink: Sink,
    mut rx: mpsc::Receiver<Out>,
    handle: HandleSlot,
    id: u64,
    limit: Duration,
    gone: CancellationToken,
) {
    let _gone = gone.drop_guard();
    loop {
        let out = tokio::select! {
            out = rx.recv() => match out {
                Some(out) => out,
                None => return,
            },
            _ = tokio::time::sleep(PING_INTERVAL) => {
                let ping = tokio::time::timeout(limit, sink.send(Message::Ping(Default::default())));
                if !matches!(ping.await, Ok(Ok(()))) {
                    tracing::info!(conn = id, "ping not taken: abandoning the connection");
                    return;
                }
                continue;
            }
        };
        let point = match out.kind {
            Kind::Close(code) => {
                let frame = CloseFrame {
                    code: CloseCode::from(code),
                    reason: "".into(),
                };
                let _ = tokio::time::timeout(limit, async {
                    let _ = sink.send(Message::Close(Some(frame))).await;
                    let _ = sink.close().await;
                })
                .await;
                return;
            }
            Kind::Sent => Some(points::GW_REPLY_SEND),
            Kind::Acked => Some(points::GW_REPLY_ACK),
            Kind::Push => Some(points::GW_PUSH),
            Kind::Reply | Kind::Hint => None,
        };
        let mut text = Some(out.text);
        if let Some(point) = point {
            match faults::check(point).await {
                Fired::Pass => {}
                Fired::Drop => text = None,
                Fired::Error if out.kind == Kind::Push => text = None,
                Fired::Error => {
                    // The operation already committed; the client sees UNAVAILABLE and retries.
                    let rid = text
                        .as_deref()
                        .and_then(|t| serde_json::from_str::<serde_json::Value>(t).ok())
                        .and_then(|v| v["rid"].as_str().map(str::to_string));
                    text = Some(protocol::error_frame(
                        rid.as_deref(),
                        &WireError::Unavailable,
                    ));
                }
            }
        }
        if let Some(text) = text {
            if let Err(e) = write(&mut sink, text, limit).await {
                tracing::info!(conn = id, error = %e, "write failed: abandoning the connection");
                return;
            }
        }
        // Also after a dropped frame: an overflowed connection must get its hints.
        if rx.is_empty() {
            let h = handle.lock().unwrap_or_else(|p| p.into_inner()).clone();
            if let Some(pending) = h.and_then(|h| h.take_overflow()) {
                for (conv, head) in pending {
                    let hint = protocol::hint_frame(&conv, head, "overflow");
                    if write(&mut sink, hint, limit).await.is_err() {
                        return;
                    }
                }
            }
        }
    }
}
