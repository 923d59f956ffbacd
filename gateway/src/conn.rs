//! One WebSocket connection: its read loop (parse, authenticate, dispatch requests one at a
//! time), and its writer task (drains the bounded queue, applies the reply/push fault points,
//! sends overflow hints once drained, closes). It owns no SQL (that is `store`) and never
//! blocks anyone else: fan-out only ever `try_send`s into its queue.

use crate::config::{SUB_CONVS_MAX, SYNC_LIMIT_DEFAULT};
use crate::error::WireError;
use crate::faults::{self, points, Fired};
use crate::hub::{ConnHandle, Kind, Out};
use crate::protocol::{self, Request};
use crate::server::State;
use crate::store::{self, Principal, SendOutcome};
use futures_util::{SinkExt, StreamExt};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;

type Sink = futures_util::stream::SplitSink<WebSocketStream<TcpStream>, Message>;

/// Serves one upgraded connection until the peer leaves, a fatal error, or shutdown.
pub async fn run(state: Arc<State>, ws: WebSocketStream<TcpStream>, id: u64, peer: String) {
    let (sink, mut stream) = ws.split();
    let (tx, rx) = mpsc::channel::<Out>(state.cfg.queue_frames_max);
    let handle_slot: Arc<std::sync::Mutex<Option<Arc<ConnHandle>>>> = Default::default();
    let write_timeout = Duration::from_millis(state.cfg.write_timeout_ms);
    let writer = state
        .tracker
        .spawn(writer(sink, rx, handle_slot.clone(), id, write_timeout));
    let hello_deadline =
        tokio::time::Instant::now() + Duration::from_millis(state.cfg.hello_timeout_ms);
    tracing::info!(conn = id, %peer, "connection opened");

    let mut conn = Conn {
        state: state.clone(),
        id,
        tx: tx.clone(),
        who: None,
        handle: None,
    };
    let close_code = loop {
        let authenticated = conn.who.is_some();
        let msg = tokio::select! {
            _ = state.cancel.cancelled() => break CloseCode::Away,
            _ = tokio::time::sleep_until(hello_deadline), if !authenticated => {
                tracing::info!(conn = id, "no hello within IM_HELLO_TIMEOUT_MS: closing");
                break CloseCode::Policy;
            }
            m = stream.next() => m,
        };
        let text = match msg {
            None => break CloseCode::Normal,
            Some(Ok(Message::Text(t))) => t,
            Some(Ok(Message::Binary(_))) => {
                conn.reply(
                    None,
                    Err(WireError::bad(
                        "binary frames are not accepted: send JSON text",
                    )),
                )
                .await;
                continue;
            }
            Some(Ok(Message::Close(_))) => break CloseCode::Normal,
            Some(Ok(_)) => continue, // ping/pong: tungstenite answers pings itself
            Some(Err(WsError::Capacity(_))) => {
                conn.too_large().await;
                break CloseCode::Size;
            }
            Some(Err(e)) => {
                tracing::info!(conn = id, error = %e, "connection read error");
                break CloseCode::Abnormal;
            }
        };
        if text.len() > state.cfg.frame_max_bytes {
            conn.too_large().await;
            break CloseCode::Size;
        }
        let inbound = protocol::parse(&text, state.cfg.body_max_bytes);
        let keep = conn.dispatch(inbound.rid, inbound.req, &handle_slot).await;
        if let Some(code) = keep {
            break code;
        }
    };
    if let Some(h) = &conn.handle {
        state.hub.remove(h);
    }
    let device = conn
        .who
        .as_ref()
        .map(|w| w.device.clone())
        .unwrap_or_default();
    if close_code != CloseCode::Abnormal {
        let _ = tx
            .send(Out::new(Kind::Close(close_code.into()), String::new()))
            .await;
    }
    drop(conn);
    drop(tx);
    handle_slot.lock().unwrap_or_else(|p| p.into_inner()).take();
    let _ = writer.await;
    tracing::info!(conn = id, %peer, device, code = u16::from(close_code), "connection closed");
}

struct Conn {
    state: Arc<State>,
    id: u64,
    tx: mpsc::Sender<Out>,
    /// Set by a successful `hello`; nothing but `hello` is served before it.
    who: Option<Principal>,
    /// Set by the first `sub`: the connection's entry in the hub.
    handle: Option<Arc<ConnHandle>>,
}

impl Conn {
    async fn queue(&self, kind: Kind, text: String) {
        // Replies wait for queue space: that only slows this connection's own reads.
        let _ = self.tx.send(Out::new(kind, text)).await;
    }

    async fn reply(&self, rid: Option<&str>, r: Result<serde_json::Value, WireError>) {
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
                self.queue(kind, v.to_string()).await;
            }
            Err(e) => {
                if matches!(e, WireError::Internal) {
                    tracing::error!(conn = self.id, "request failed with INTERNAL");
                }
                self.queue(Kind::Reply, protocol::error_frame(rid, &e))
                    .await
            }
        }
    }

    async fn too_large(&self) {
        let e = WireError::TooLarge(format!(
            "frame is larger than {} bytes",
            self.state.cfg.frame_max_bytes
        ));
        tracing::info!(conn = self.id, "frame over the size limit: closing");
        self.queue(Kind::Reply, protocol::error_frame(None, &e))
            .await;
    }

    /// Handles one request; `Some(code)` ends the connection after the reply.
    async fn dispatch(
        &mut self,
        rid: Option<String>,
        req: Result<Request, WireError>,
        slot: &std::sync::Mutex<Option<Arc<ConnHandle>>>,
    ) -> Option<CloseCode> {
        let rid = rid.as_deref();
        let req = match req {
            Ok(r) => r,
            Err(e) => {
                self.reply(rid, Err(e)).await;
                return None;
            }
        };
        let st = &self.state;
        let Some(who) = self.who.clone() else {
            let Request::Hello {
                device,
                token,
                epoch,
            } = req
            else {
                self.reply(rid, Err(WireError::Unauthenticated("say hello first")))
                    .await;
                return None;
            };
            let r =
                st.db(move |pool| async move {
                    store::authenticate(&pool, &device, &token, epoch).await
                })
                .await;
            return match r {
                Ok(p) => {
                    let v = json!({"t": "welcome", "user": p.user, "device": p.device, "epoch": p.epoch});
                    tracing::debug!(conn = self.id, user = %p.user, device = %p.device, "authenticated");
                    self.who = Some(p);
                    self.reply(rid, Ok(v)).await;
                    None
                }
                Err(e) => {
                    let fatal =
                        matches!(e, WireError::Unauthenticated(_) | WireError::StaleInstall);
                    self.reply(rid, Err(e)).await;
                    fatal.then_some(CloseCode::Policy)
                }
            };
        };
        match req {
            Request::Hello { .. } => {
                self.reply(rid, Err(WireError::bad("already authenticated")))
                    .await;
                None
            }
            Request::Send { conv, cmid, body } => {
                let w = who.clone();
                let c = conv.clone();
                let r = st
                    .db(move |pool| async move { store::send(&pool, &w, &c, &cmid, &body).await })
                    .await;
                let sent = match r {
                    Ok(SendOutcome::Reply(s)) => s,
                    Ok(SendOutcome::NoReply) => return None,
                    Err(e) => {
                        self.reply(rid, Err(e)).await;
                        return None;
                    }
                };
                // D1: we get here only after COMMIT returned (or for a committed duplicate).
                match faults::check(points::API_AFTER_SEND_COMMIT).await {
                    Fired::Pass => {}
                    Fired::Drop => return None,
                    Fired::Error => {
                        self.reply(rid, Err(WireError::Unavailable)).await;
                        return None;
                    }
                }
                let v = json!({"t": "sent", "conv": conv, "seq": sent.seq, "mid": sent.mid,
                               "dup": sent.dup, "epoch": sent.epoch});
                self.reply(rid, Ok(v)).await;
                None
            }
            Request::Ack { conv, seq } => {
                match faults::check(points::GW_RECV_ACK).await {
                    Fired::Pass => {}
                    Fired::Drop => return None,
                    Fired::Error => {
                        self.reply(rid, Err(WireError::Unavailable)).await;
                        return None;
                    }
                }
                let w = who.clone();
                let c = conv.clone();
                let r = st
                    .db(move |pool| async move { store::ack(&pool, &w, &c, seq).await })
                    .await;
                let stale = matches!(r, Err(WireError::StaleInstall));
                self.reply(
                    rid,
                    r.map(|d| json!({"t": "acked", "conv": conv, "delivered": d})),
                )
                .await;
                stale.then_some(CloseCode::Policy)
            }
            Request::Sub => {
                // Register before reading the state, so no event falls between the two.
                let h = match &self.handle {
                    Some(h) => h.clone(),
                    None => {
                        let h = Arc::new(ConnHandle::new(self.id, who.clone(), self.tx.clone()));
                        *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(h.clone());
                        self.handle = Some(h.clone());
                        h
                    }
                };
                self.state.hub.subscribe(&h);
                let w = who.clone();
                let max = SUB_CONVS_MAX;
                let r = st
                    .db(move |pool| async move { store::conv_states(&pool, &w, max).await })
                    .await;
                let r = r.map(|convs| {
                    let convs: Vec<_> = convs
                        .iter()
                        .map(|c| json!({"conv": c.conv, "head": c.head, "delivered": c.delivered}))
                        .collect();
                    json!({"t": "subbed", "convs": convs})
                });
                self.reply(rid, r).await;
                None
            }
            Request::Sync { conv, after, limit } => {
                let limit = limit
                    .unwrap_or(SYNC_LIMIT_DEFAULT)
                    .min(self.state.cfg.sync_limit_max);
                let w = who.clone();
                let c = conv.clone();
                let r = st
                    .db(move |pool| async move { store::sync(&pool, &w, &c, after, limit).await })
                    .await;
                let r = r.map(|p| {
                    let events: Vec<_> = p.events.iter().map(|e| e.to_json()).collect();
                    json!({"t": "synced", "conv": conv, "events": events, "head": p.head,
                           "complete": p.complete})
                });
                self.reply(rid, r).await;
                None
            }
        }
    }
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

/// Drains the queue to the socket. The `gw.reply.send`, `gw.reply.ack` and `gw.push` fault
/// points act here, on the frame about to be written. Once the queue is empty it sends the
/// overflow hints (`why:"overflow"`) the fan-out recorded while it was full.
async fn writer(
    mut sink: Sink,
    mut rx: mpsc::Receiver<Out>,
    handle: Arc<std::sync::Mutex<Option<Arc<ConnHandle>>>>,
    id: u64,
    limit: Duration,
) {
    while let Some(out) = rx.recv().await {
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
        let mut text = out.text;
        if let Some(point) = point {
            match faults::check(point).await {
                Fired::Pass => {}
                Fired::Drop => continue,
                Fired::Error if out.kind == Kind::Push => continue,
                Fired::Error => {
                    // The operation already committed; the client sees UNAVAILABLE and retries.
                    let rid = serde_json::from_str::<serde_json::Value>(&text)
                        .ok()
                        .and_then(|v| v["rid"].as_str().map(str::to_string));
                    text = protocol::error_frame(rid.as_deref(), &WireError::Unavailable);
                }
            }
        }
        if let Err(e) = write(&mut sink, text, limit).await {
            tracing::info!(conn = id, error = %e, "write failed: abandoning the connection");
            return;
        }
        if rx.is_empty() {
            let h = handle.lock().unwrap_or_else(|p| p.into_inner()).clone();
            if let Some(pending) = h.and_then(|h| h.take_overflow()) {
                for (conv, head) in pending {
                    if write(
                        &mut sink,
                        protocol::hint_frame(&conv, head, "overflow"),
                        limit,
                    )
                    .await
                    .is_err()
                    {
                        return;
                    }
                }
            }
        }
    }
}
