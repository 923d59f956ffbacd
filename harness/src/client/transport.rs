//! The connection of a test client: one WebSocket at a time, a reader that routes
//! replies to waiting requests by `rid` and queues pushes for the pump, a writer task,
//! and per-request timeouts.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context as _};
use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use im_protocol::wire::Request;
use im_protocol::ServerFrame;

use super::observe::completion;
use super::received::Received;
use super::{field_str, pump, push_bounded, Client, ClientError, Inner};
use crate::history::History;
use im_check::history::{Completion, Done, Invoke, Life, Line, OpName, Refused};

/// Pushes waiting for the pump. When full, further pushes are dropped and counted
/// (`pushes_overflowed`): the protocol repairs lost pushes (gap detection, sweep
/// hints), and a reader that never blocks keeps replies flowing to waiting requests.
const PUSH_QUEUE_FRAMES_MAX: usize = 10_000;
/// Frames waiting for the writer task.
const OUT_QUEUE_FRAMES_MAX: usize = 1_024;

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// The live connection as seen by requests.
pub(super) struct ConnLink {
    /// Distinguishes connections so a stale reader cannot clobber a newer one.
    pub(super) id: u64,
    /// Frames for the writer task.
    pub(super) out: mpsc::Sender<Message>,
}

/// A request frame as it is handed to the connection: typed (every request the client
/// makes itself), or raw JSON for what the types cannot express (a hostile test's frame,
/// [`Client::request`]). Either way the connection adds the `rid`.
pub(super) enum Outgoing {
    Typed(Request),
    Raw(Value),
}

impl From<Request> for Outgoing {
    fn from(r: Request) -> Outgoing {
        Outgoing::Typed(r)
    }
}

impl From<Value> for Outgoing {
    fn from(v: Value) -> Outgoing {
        Outgoing::Raw(v)
    }
}

impl Outgoing {
    /// The history's invoke line: for a typed request, the one [`Invoke::of_frame`] gives
    /// for its frame (a test pins that they agree); an `ack` is not `explicit`.
    pub(super) fn invoke(&self) -> Invoke {
        let req = match self {
            Outgoing::Raw(frame) => return Invoke::of_frame(frame),
            Outgoing::Typed(req) => req,
        };
        match req.clone() {
            Request::Hello { device, epoch, .. } => Invoke::Hello { device, epoch },
            Request::Send { conv, cmid, body } => Invoke::Send {
                conv,
                cmid,
                body_len: body.len(),
            },
            Request::Ack { conv, seq } => Invoke::Ack {
                conv,
                seq,
                explicit: false,
            },
            Request::Sub => Invoke::Sub {},
            Request::Sync { conv, after, limit } => Invoke::Sync {
                conv,
                after: Some(after),
                limit,
            },
        }
    }

    /// The frame with `rid`, as the JSON object that is sent (and kept in `frames()`).
    pub(super) fn with_rid(self, rid: &str) -> Result<Value, ClientError> {
        match self {
            Outgoing::Typed(req) => Ok(req.to_json(rid)),
            Outgoing::Raw(mut frame) => {
                let obj = frame.as_object_mut().ok_or_else(|| {
                    ClientError::Other(anyhow!("a request frame must be a JSON object"))
                })?;
                obj.insert("rid".into(), Value::String(rid.to_string()));
                Ok(frame)
            }
        }
    }
}

/// A request waiting for its reply.
pub(super) struct Pending {
    pub(super) conn: u64,
    pub(super) tx: oneshot::Sender<Result<Received, ClientError>>,
}

impl Inner {
    /// Sends `frame` with a fresh `rid` and waits for the reply until `timeout`; records
    /// the invoke and its completion in the history.
    pub(super) async fn request(
        &self,
        frame: impl Into<Outgoing>,
        timeout: Duration,
    ) -> Result<Received, ClientError> {
        let frame = frame.into();
        let invoke = frame.invoke();
        self.request_rec(frame, timeout, invoke).await
    }

    /// [`Inner::request`] with the history's invoke value given by the caller.
    pub(super) async fn request_rec(
        &self,
        frame: Outgoing,
        timeout: Duration,
        invoke: Invoke,
    ) -> Result<Received, ClientError> {
        self.request_rec_if(frame, timeout, invoke, |_| true).await
    }

    /// [`Inner::request_rec`], sent only if `still` holds of the state when the invoke is
    /// recorded, checked and recorded under one lock (else `Err(Other)`, nothing sent or
    /// recorded): what a request decided under the state is recorded before anything that
    /// changes it (issue 21: an ack chosen before its conversation's epoch moved).
    pub(super) async fn request_rec_if(
        &self,
        frame: Outgoing,
        timeout: Duration,
        invoke: Invoke,
        still: impl Fn(&super::State) -> bool,
    ) -> Result<Received, ClientError> {
        let op = invoke.op();
        let op_id = {
            let st = self.lock();
            if st.dead {
                return Err(ClientError::Disconnected);
            }
            if !still(&st) {
                return Err(ClientError::Other(anyhow::anyhow!(
                    "the state it was decided under changed before it left"
                )));
            }
            let op_id = self.hist.as_ref().map(History::next_op_id);
            self.rec(op_id, Line::Invoke(invoke));
            op_id
        };
        let r = self.request_inner(frame, timeout).await;
        let done = completion(op, &r);
        // D1 probe: a `sent` reply means the event is committed, so another session must
        // see it now.
        let probe = match &done {
            Line::Ok(Done::Send { conv, seq, mid, .. }) => Some((conv.clone(), *seq, mid.clone())),
            _ => None,
        };
        let line = self.rec(op_id, done);
        if let (Some(h), Some(i), Some((conv, seq, mid))) = (&self.hist, line, probe) {
            h.probe(i, &conv, seq, &mid);
        }
        r
    }

    pub(super) async fn request_inner(
        &self,
        frame: Outgoing,
        timeout: Duration,
    ) -> Result<Received, ClientError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let rid = format!("c{}", self.next_rid.fetch_add(1, Ordering::Relaxed) + 1);
        let frame = frame.with_rid(&rid)?;
        let text = frame.to_string();
        let (tx, rx) = oneshot::channel();
        let out = {
            let mut st = self.lock();
            let Some(link) = st.conn.as_ref() else {
                return Err(ClientError::Disconnected);
            };
            let (id, out) = (link.id, link.out.clone());
            st.pending.insert(rid.clone(), Pending { conn: id, tx });
            let max = st.opts.frames_max;
            push_bounded(&mut st.sent_frames, max, frame);
            out
        };
        // Removes the pending entry however this function ends (reply, timeout, or the
        // caller dropping the future).
        let _guard = PendingGuard {
            inner: self,
            rid: &rid,
        };
        let outcome = tokio::time::timeout_at(deadline, async {
            out.send(Message::text(text))
                .await
                .map_err(|_| ClientError::Disconnected)?;
            rx.await.unwrap_or(Err(ClientError::Disconnected))
        })
        .await;
        let reply = match outcome {
            Ok(r) => r?,
            Err(_) => return Err(ClientError::Timeout),
        };
        // An error frame is an error even when its code is one the types do not know.
        if field_str(&reply.value, "t") == Some("error") {
            return Err(ClientError::Server {
                code: field_str(&reply.value, "code").unwrap_or("").to_string(),
                msg: field_str(&reply.value, "msg").unwrap_or("").to_string(),
                frame: reply.value,
            });
        }
        Ok(reply)
    }

    /// Called by the reader for every text frame: record it, route replies to their
    /// request, queue pushes for the pump.
    pub(super) fn on_text(&self, text: &str, pushes: &mpsc::Sender<ServerFrame>) {
        let (v, parsed) = match serde_json::from_str::<Value>(text) {
            Ok(v) => (v, true),
            Err(_) => (json!({"t": "_nonjson", "raw": text}), false),
        };
        let frame = ServerFrame::parse(text);
        let route = {
            let mut st = self.lock();
            if st.dead {
                return;
            }
            st.stats.frames_received += 1;
            if !parsed {
                st.stats.malformed_frames += 1;
            }
            let max = st.opts.frames_max;
            push_bounded(&mut st.frames, max, v.clone());
            let waiting = field_str(&v, "rid").and_then(|rid| st.pending.remove(rid));
            if waiting.is_none() {
                self.rec_push(&v, &frame);
                match &frame {
                    Ok(push @ (ServerFrame::Event(_) | ServerFrame::Hint { .. })) => {
                        if let Err(mpsc::error::TrySendError::Full(_)) =
                            pushes.try_send(push.clone())
                        {
                            st.stats.pushes_overflowed += 1;
                        }
                    }
                    // A push the client cannot read is counted, never applied.
                    Err(_) if parsed => match field_str(&v, "t") {
                        Some("event") => {
                            st.stats.pushes_received += 1;
                            st.stats.malformed_frames += 1;
                        }
                        Some("hint") => st.stats.malformed_frames += 1,
                        _ => {}
                    },
                    _ => {}
                }
            }
            waiting
        };
        if let Some(p) = route {
            let _ = p.tx.send(Ok(Received { value: v, frame }));
        }
        self.notify();
    }

    pub(super) fn record_frame(&self, v: Value) {
        {
            let mut st = self.lock();
            let max = st.opts.frames_max;
            push_bounded(&mut st.frames, max, v);
        }
        self.notify();
    }

    /// The connection `conn_id` is gone: fail its pending requests with `Disconnected`.
    pub(super) fn on_disconnect(&self, conn_id: u64) {
        let failed: Vec<Pending> = {
            let mut st = self.lock();
            if st.conn.as_ref().is_some_and(|l| l.id == conn_id) {
                st.conn = None;
                st.subscribed = false;
                if !st.dead {
                    self.rec(None, Line::Client(Life::Disconnect {}));
                }
            }
            let rids: Vec<String> = st
                .pending
                .iter()
                .filter(|(_, p)| p.conn == conn_id)
                .map(|(r, _)| r.clone())
                .collect();
            rids.iter().filter_map(|r| st.pending.remove(r)).collect()
        };
        for p in failed {
            let _ = p.tx.send(Err(ClientError::Disconnected));
        }
        self.notify();
    }
}

struct PendingGuard<'a> {
    inner: &'a Inner,
    rid: &'a str,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.inner.lock().pending.remove(self.rid);
    }
}

async fn read_loop(
    inner: Arc<Inner>,
    conn_id: u64,
    mut stream: SplitStream<Ws>,
    pushes: mpsc::Sender<ServerFrame>,
) {
    while let Some(msg) = stream.next().await {
        match msg {
            Ok(Message::Text(t)) => inner.on_text(t.as_str(), &pushes),
            Ok(Message::Binary(b)) => inner.record_frame(json!({"t": "_binary", "len": b.len()})),
            Ok(Message::Close(cf)) => inner.record_frame(json!({
                "t": "_close",
                "code": cf.as_ref().map(|f| u16::from(f.code)),
                "reason": cf.as_ref().map(|f| f.reason.as_str().to_string()),
            })),
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(error = %e, "client connection read failed");
                break;
            }
        }
    }
    inner.on_disconnect(conn_id);
}

async fn write_loop(mut sink: SplitSink<Ws, Message>, mut out: mpsc::Receiver<Message>) {
    while let Some(m) = out.recv().await {
        if let Err(e) = sink.send(m).await {
            tracing::debug!(error = %e, "client connection write failed");
            break;
        }
    }
}

pub(super) struct ConnTasks {
    pub(super) conn_id: u64,
    reader: JoinHandle<()>,
    writer: JoinHandle<()>,
    pump: JoinHandle<()>,
}

impl ConnTasks {
    pub(super) fn abort(&self) {
        self.reader.abort();
        self.writer.abort();
        self.pump.abort();
    }
}

impl Client {
    /// Opens the WebSocket and says `hello{device,token,epoch}`; returns `welcome`.
    /// An open connection is dropped first (like `crash`).
    pub async fn connect(&mut self, ws_url: &str) -> Result<Value, ClientError> {
        self.connect_raw(ws_url).await?;
        let (hello, timeout) = {
            let st = self.inner.lock();
            let f = &st.file;
            let hello = Request::Hello {
                device: f.device.clone(),
                token: f.token.clone(),
                epoch: f.epoch,
            };
            (hello, st.opts.request_timeout)
        };
        self.inner.request(hello, timeout).await.map(|r| r.value)
    }

    /// Opens the WebSocket only (no hello) and starts the reader, writer and pump.
    pub async fn connect_raw(&mut self, ws_url: &str) -> anyhow::Result<()> {
        self.drop_connection().await;
        let timeout = self.inner.opts().request_timeout;
        let op_id = self.inner.hist.as_ref().map(History::next_op_id);
        self.inner.rec(
            op_id,
            Line::Invoke(Invoke::Connect {
                url: ws_url.to_string(),
            }),
        );
        let r = tokio::time::timeout(
            timeout,
            tokio_tungstenite::connect_async_with_config(ws_url, None, true),
        )
        .await
        .map_err(|_| anyhow!("WebSocket connect to {ws_url} timed out after {timeout:?}"))
        .and_then(|r| r.with_context(|| format!("WebSocket connect to {ws_url}")));
        let (ws, _response) = match r {
            Ok(x) => {
                self.inner.rec(op_id, Line::Ok(Done::Connect {}));
                x
            }
            Err(e) => {
                self.inner.rec(
                    op_id,
                    Line::Fail(Completion {
                        op: OpName::Connect,
                        value: Refused {
                            code: None,
                            msg: format!("{e:#}"),
                        },
                    }),
                );
                return Err(e);
            }
        };
        let (sink, stream) = ws.split();
        let (out_tx, out_rx) = mpsc::channel(OUT_QUEUE_FRAMES_MAX);
        let (push_tx, push_rx) = mpsc::channel(PUSH_QUEUE_FRAMES_MAX);
        let conn_id = {
            let mut st = self.inner.lock();
            st.conn_seq += 1;
            let id = st.conn_seq;
            st.conn = Some(ConnLink { id, out: out_tx });
            st.subscribed = false;
            id
        };
        self.tasks = Some(ConnTasks {
            conn_id,
            writer: tokio::spawn(write_loop(sink, out_rx)),
            reader: tokio::spawn(read_loop(self.inner.clone(), conn_id, stream, push_tx)),
            pump: tokio::spawn(pump::pump(self.inner.clone(), push_rx)),
        });
        self.inner.notify();
        Ok(())
    }

    /// Sends a raw text frame (for malformed-input tests). Replies to it carry no
    /// `rid` the client knows, so they only show up in `frames()`.
    pub async fn send_text(&self, text: &str) -> anyhow::Result<()> {
        let out = {
            let mut st = self.inner.lock();
            let out = st
                .conn
                .as_ref()
                .map(|l| l.out.clone())
                .ok_or_else(|| anyhow!("not connected"))?;
            let max = st.opts.frames_max;
            push_bounded(&mut st.sent_frames, max, Value::String(text.to_string()));
            out
        };
        out.send(Message::text(text))
            .await
            .map_err(|_| anyhow!("connection closed"))
    }

    /// Aborts the tasks of the current connection (if any) and waits for them, so the
    /// socket is closed when this returns.
    pub(super) async fn drop_connection(&mut self) {
        if let Some(tasks) = self.tasks.take() {
            tasks.abort();
            let ConnTasks {
                conn_id,
                reader,
                writer,
                pump,
            } = tasks;
            // Cancellation errors are expected here; a panic in a task would be a bug
            // that the test already saw in its output.
            let _ = reader.await;
            let _ = writer.await;
            let _ = pump.await;
            self.inner.on_disconnect(conn_id);
        }
    }
}
