//! One WebSocket connection: its read loop (parse, authenticate, then hand each request to
//! its own task, at most IM_CONN_INFLIGHT_MAX at once), and its writer task (drains the
//! bounded queue, applies the reply/push fault points, sends overflow hints once drained,
//! pings when asked, closes). It owns no SQL (that is `store`) and never blocks anyone else:
//! fan-out only ever `try_send`s into its queue.
//!
//! Memory per connection is bounded in bytes (`IM_QUEUE_BYTES_MAX`, [`hub::Budget`]): every
//! frame queued for the writer holds its length from the budget until it is written; a sync
//! reserves its largest page before reading it, so the budget covers the replies being
//! built as well as the queue. A reply that does not fit waits (that slows only this
//! connection: its requests, then its reader, stop); a push that does not fit overflows
//! (`hub`), and D5's repair path (overflow hint, then sync) brings the client back.
//!
//! Requests after `hello` run concurrently, so one slow request (say, waiting out the
//! database deadline) never delays the next one's answer; replies are matched by `rid` and
//! may leave in another order than the requests came.
//!
//! Closing keeps replies: the reader waits for in-flight requests, queues the close frame
//! behind their replies, then keeps reading (and discarding) until the peer's close frame,
//! EOF, or a short linger, so unread client data never makes the kernel reset the
//! connection and discard what was queued (RFC 6455 section 7.1.1: the server closes TCP
//! after the close handshake).

use crate::batch;
use crate::bugs::{self, Bug};
use crate::config::{SUB_CONVS_MAX, SYNC_LIMIT_DEFAULT};
use crate::error::WireError;
use crate::faults::{self, points};
use crate::hub::{self, CloseRequest, ConnHandle, Out, Outbox, Reserved};
use crate::protocol::{self, Frame, HintWhy, Kind, Push, Reply, Request};
use crate::state::State;
use crate::store::{self, Principal, SendObserver, SendOutcome};
use futures_util::{SinkExt, StreamExt};
use std::net::SocketAddr;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message, Utf8Bytes};
use tokio_tungstenite::WebSocketStream;
use tokio_util::sync::CancellationToken;

type Sink = futures_util::stream::SplitSink<WebSocketStream<TcpStream>, Message>;

/// After the writer wrote the close frame, how long the reader keeps draining the peer's
/// data waiting for its close frame before it drops the socket.
const CLOSE_LINGER: Duration = Duration::from_secs(2);

/// What a JSON frame around a sync page adds to the events' own JSON (type, conv, head,
/// complete, an escaped rid).
const SYNC_FRAME_OVERHEAD_BYTES: usize = 1024;

/// Most bytes one byte of a string takes in JSON (a control character: `\u0001`).
const JSON_ESCAPE_MAX: usize = 6;

/// What one event's JSON adds to its escaped body: an escaped cmid, the conversation and
/// sender ids, and 192 bytes for the rest. The rest of the worst event is 154 bytes (the
/// 36-byte mid, `seq` and `at` as 19 and 20 characters, kind `msg`, the keys and the comma
/// between events; `a_sync_reserves_at_least_the_largest_frame_it_can_produce` renders
/// it): a reservation too small would only be given back and taken anew (`Outbox::reply`),
/// but the reservation is what bounds a page while it is read.
const EVENT_OVERHEAD_BYTES: usize =
    protocol::CMID_MAX_BYTES * JSON_ESCAPE_MAX + 2 * protocol::ID_MAX_BYTES + 192;

/// The largest `synced` frame a sync with `limit` can produce (what it reserves of the
/// connection's byte budget before the page is read): `limit` events of `body_max` bytes,
/// each escaped to the worst, but a page stops at `page_max` bytes of events, keeping at
/// least one (`store::sync`).
fn largest_synced_frame(limit: i64, body_max: usize, page_max: usize) -> usize {
    let event_max = body_max * JSON_ESCAPE_MAX + EVENT_OVERHEAD_BYTES;
    usize::try_from(limit.max(1))
        .unwrap_or(usize::MAX)
        .saturating_mul(event_max)
        .min(page_max.max(event_max))
        + SYNC_FRAME_OVERHEAD_BYTES
}

/// Serves one upgraded connection until the peer leaves, a fatal error, or shutdown: the
/// reader ([`Reader::read`]) until a close, then the close that keeps replies
/// ([`Reader::close`]).
pub async fn run(state: Arc<State>, ws: WebSocketStream<TcpStream>, id: u64, peer: SocketAddr) {
    let (sink, mut stream) = ws.split();
    let (outbox, rx) = Outbox::new(id, state.cfg.queue_frames_max, state.cfg.queue_bytes_max);
    // Close requests from outside the reader (a stale install, a STALE_INSTALL reply): the
    // first one wins. The reader keeps a sender, so `recv` never ends.
    let (close_tx, close_rx) = hub::close_channel();
    // The reader asks the writer for a ping (after half of IM_READ_IDLE_MS of silence).
    let ping = Arc::new(Notify::new());
    let write_timeout = Duration::from_millis(state.cfg.write_timeout_ms);
    // Cancelled when the writer gives up (write failed or timed out): the reader stops too.
    let writer_gone = CancellationToken::new();
    let writer = state.tracker.spawn(writer(
        sink,
        rx,
        outbox.clone(),
        ping.clone(),
        id,
        write_timeout,
        writer_gone.clone(),
    ));
    let inflight_max = state.cfg.conn_inflight_max;
    tracing::info!(conn = id, %peer, "connection opened");
    let reader = Reader {
        inflight: Arc::new(Semaphore::new(inflight_max)),
        inflight_max,
        state,
        id,
        peer,
        outbox,
        close_tx,
        ping,
        writer_gone,
    };
    let (code, last_error, session) = reader.read(&mut stream, close_rx).await;
    reader
        .close(code, last_error, session, stream, writer)
        .await;
}

type Stream = futures_util::stream::SplitStream<WebSocketStream<TcpStream>>;

/// One connection's reader and what it shares with the writer and the request tasks.
struct Reader {
    state: Arc<State>,
    id: u64,
    peer: SocketAddr,
    outbox: Arc<Outbox>,
    close_tx: mpsc::Sender<CloseRequest>,
    ping: Arc<Notify>,
    writer_gone: CancellationToken,
    /// Bounded concurrency per connection: past the limit the reader waits, which only
    /// slows this connection.
    inflight: Arc<Semaphore>,
    inflight_max: usize,
}

/// What the reader does with one read from the socket ([`classify`]).
enum Read {
    /// A text frame to parse and serve.
    Text(Utf8Bytes),
    /// Nothing to answer (a ping or pong: tungstenite answers pings itself).
    Skip,
    /// A binary frame: answered with this error; the connection stays.
    Refused(WireError),
    /// The connection ends with this code, after this error frame if any.
    End(CloseCode, Option<WireError>),
}

/// What one read from the socket means: `hello_done` when the connection said hello.
fn classify(
    msg: Option<Result<Message, WsError>>,
    frame_max: usize,
    id: u64,
    hello_done: bool,
) -> Read {
    let too_big = || {
        tracing::info!(conn = id, "frame over the size limit: closing");
        Read::End(CloseCode::Size, Some(too_large(frame_max)))
    };
    match msg {
        None => Read::End(CloseCode::Normal, None),
        Some(Ok(Message::Text(t))) if t.len() > frame_max => too_big(),
        Some(Ok(Message::Text(t))) => Read::Text(t),
        Some(Ok(Message::Binary(b))) if b.len() > frame_max => too_big(),
        Some(Ok(Message::Binary(_))) if hello_done => Read::Refused(WireError::bad(
            "binary frames are not accepted: send JSON text",
        )),
        Some(Ok(Message::Binary(_))) => {
            Read::Refused(WireError::Unauthenticated("say hello first".into()))
        }
        Some(Ok(Message::Close(_))) => Read::End(CloseCode::Normal, None),
        Some(Ok(_)) => Read::Skip,
        Some(Err(WsError::Capacity(_))) => too_big(),
        Some(Err(WsError::Utf8)) => {
            tracing::info!(conn = id, "text frame is not UTF-8: closing (1007)");
            Read::End(CloseCode::Invalid, None)
        }
        Some(Err(WsError::Protocol(e))) => {
            tracing::info!(conn = id, error = %e, "protocol violation: closing (1002)");
            Read::End(CloseCode::Protocol, None)
        }
        Some(Err(e)) => {
            tracing::info!(conn = id, error = %e, "connection read error");
            Read::End(CloseCode::Abnormal, None)
        }
    }
}

impl Reader {
    /// Reads until the connection is to close: the close code, an error frame to send
    /// before the close frame, and the session if the connection said hello.
    async fn read(
        &self,
        stream: &mut Stream,
        mut close_rx: mpsc::Receiver<CloseRequest>,
    ) -> (CloseCode, Option<WireError>, Option<Arc<Session>>) {
        let (state, id) = (&self.state, self.id);
        let hello_deadline =
            tokio::time::Instant::now() + Duration::from_millis(state.cfg.hello_timeout_ms);
        let read_idle = Duration::from_millis(state.cfg.read_idle_ms);
        let mut last_read = tokio::time::Instant::now();
        let mut ping_asked = false;
        let mut session: Option<Arc<Session>> = None;
        let (code, last_error) = loop {
            let msg = tokio::select! {
                _ = state.cancel.cancelled() => break (CloseCode::Away, None),
                _ = self.writer_gone.cancelled() => break (CloseCode::Abnormal, None),
                r = close_rx.recv() => {
                    let (code, e) = r.unwrap_or((1008, None));
                    break (CloseCode::from(code), e);
                }
                _ = tokio::time::sleep_until(hello_deadline), if session.is_none() => {
                    tracing::info!(conn = id, "no hello within IM_HELLO_TIMEOUT_MS: closing");
                    break (CloseCode::Policy, None);
                }
                _ = tokio::time::sleep_until(last_read + read_idle / 2), if !ping_asked => {
                    // Half the idle time in silence: a ping, which a live peer answers.
                    self.ping.notify_one();
                    ping_asked = true;
                    continue;
                }
                _ = tokio::time::sleep_until(last_read + read_idle) => {
                    tracing::info!(conn = id, "nothing read within IM_READ_IDLE_MS: closing");
                    break (CloseCode::Away, None);
                }
                m = stream.next() => {
                    last_read = tokio::time::Instant::now();
                    ping_asked = false;
                    m
                }
            };
            let text = match classify(msg, state.cfg.frame_max_bytes, id, session.is_some()) {
                Read::Text(t) => t,
                Read::Skip => continue,
                Read::Refused(e) => {
                    reply(&self.outbox, id, None, Err(e), None).await;
                    continue;
                }
                Read::End(code, e) => break (code, e),
            };
            if let Err(code) = self.serve(&text, &mut session).await {
                break (code, None);
            }
        };
        (code, last_error, session)
    }

    /// Serves one text frame: `hello` inline before the session exists (nothing else is
    /// served before it), every request after it in a task of its own.
    async fn serve(&self, text: &str, session: &mut Option<Arc<Session>>) -> Result<(), CloseCode> {
        let (state, id) = (&self.state, self.id);
        let inbound = protocol::parse(text, state.cfg.body_max_bytes);
        let Some(s) = session.as_ref() else {
            let ctx = Hello {
                state,
                outbox: &self.outbox,
                close: &self.close_tx,
                id,
                peer: self.peer,
            };
            if let Some(handle) = ctx.serve(inbound.rid.as_deref(), inbound.req).await? {
                *session = Some(Arc::new(Session {
                    state: state.clone(),
                    id,
                    who: handle.who.clone(),
                    handle,
                    sub_lock: tokio::sync::Mutex::new(()),
                    members: Members::default(),
                }));
            }
            return Ok(());
        };
        let Ok(permit) = self.inflight.clone().acquire_owned().await else {
            return Err(CloseCode::Error);
        };
        let s = s.clone();
        state.tracker.spawn(async move {
            s.dispatch(inbound.rid.as_deref(), inbound.req).await;
            drop(permit);
        });
        Ok(())
    }

    /// Closes keeping replies: lets in-flight requests finish and queue their replies,
    /// queues the error and close frames behind them, then drains the peer's input while
    /// the writer finishes (see the module's doc).
    async fn close(
        self,
        code: CloseCode,
        last_error: Option<WireError>,
        session: Option<Arc<Session>>,
        stream: Stream,
        writer: tokio::task::JoinHandle<Tally>,
    ) {
        let Reader {
            state,
            id,
            peer,
            outbox,
            inflight,
            inflight_max,
            ..
        } = self;
        // They cannot wait forever on the byte budget: the writer drains it, or closes it
        // when it gives up.
        let _ = inflight.acquire_many(inflight_max as u32).await;
        let device = match &session {
            Some(s) => {
                state.hub.unregister(&s.handle);
                s.who.device.clone()
            }
            None => String::new(),
        };
        if code == CloseCode::Abnormal {
            // The writer ends after what is queued, without a close frame.
            outbox.end(None).await;
        } else {
            if let Some(e) = &last_error {
                reply(&outbox, id, None, Err(e.clone()), None).await;
            }
            outbox.end(Some(code.into())).await;
        }
        drop(session);
        drop(outbox);
        let Tally { frames, flushes } = drain_while_writing(code, stream, writer).await;
        tracing::info!(conn = id, %peer, device, code = u16::from(code), frames, flushes, "connection closed");
    }
}

/// Drain: read (and discard) until the peer's close frame or EOF while the writer
/// finishes; then linger at most CLOSE_LINGER. Dropping the socket with unread data would
/// make the kernel send a reset, and the peer would lose what is still in flight.
async fn drain_while_writing(
    code: CloseCode,
    mut stream: Stream,
    writer: tokio::task::JoinHandle<Tally>,
) -> Tally {
    let drain = async {
        if code == CloseCode::Abnormal || bugs::active(Bug::NoCloseDrain) {
            return;
        }
        while let Some(m) = stream.next().await {
            if matches!(m, Ok(Message::Close(_)) | Err(_)) {
                break;
            }
        }
    };
    tokio::pin!(writer);
    tokio::pin!(drain);
    let linger = tokio::time::sleep(Duration::MAX / 4);
    tokio::pin!(linger);
    let mut writer_done = false;
    let mut tally = Tally::default();
    let mut drained = false;
    while !(writer_done && drained) {
        tokio::select! {
            written = &mut writer, if !writer_done => {
                writer_done = true;
                tally = written.unwrap_or_default();
                linger.as_mut().reset(tokio::time::Instant::now() + CLOSE_LINGER);
            }
            _ = &mut drain, if !drained => drained = true,
            _ = &mut linger, if writer_done => break,
        }
    }
    drop(stream);
    tally
}

fn too_large(frame_max_bytes: usize) -> WireError {
    WireError::TooLarge(format!("frame is larger than {frame_max_bytes} bytes"))
}

/// Queues a reply (or error) to request `rid`, holding its length of the byte budget
/// (`reserved`, if the caller took it beforehand: see [`Outbox::reply`]).
async fn reply(
    outbox: &Outbox,
    id: u64,
    rid: Option<&str>,
    r: Result<Reply, WireError>,
    reserved: Option<Reserved>,
) {
    match r {
        Ok(reply) => outbox.reply(rid, &reply, reserved).await,
        Err(e) => {
            if matches!(e, WireError::Internal) {
                tracing::error!(conn = id, "request failed with INTERNAL");
            }
            drop(reserved);
            outbox.reply(rid, &Reply::Error(e), None).await
        }
    }
}

/// A connection before a good `hello`.
struct Hello<'a> {
    state: &'a Arc<State>,
    outbox: &'a Arc<Outbox>,
    close: &'a mpsc::Sender<CloseRequest>,
    id: u64,
    peer: SocketAddr,
}

impl Hello<'_> {
    /// Serves a frame before hello. `Ok(Some)`: authenticated and registered; `Ok(None)`:
    /// answered, go on; `Err(code)`: answered, close with `code` (a failed hello).
    ///
    /// Any frame but a well-formed `hello` gets UNAUTHENTICATED (SPEC 2), malformed ones
    /// included. A hello first takes a token from the failed-hello buckets of its source
    /// address and device id (`limits::HelloThrottle`): with either empty it is answered
    /// UNAVAILABLE and closed without any database work.
    async fn serve(
        &self,
        rid: Option<&str>,
        req: Result<Request, WireError>,
    ) -> Result<Option<Arc<ConnHandle>>, CloseCode> {
        let (state, outbox, id) = (self.state, &**self.outbox, self.id);
        let (device, token, epoch) = match req {
            Ok(Request::Hello {
                device,
                token,
                epoch,
            }) => (device, token, epoch),
            _ => {
                let e = WireError::Unauthenticated("say hello first".into());
                reply(outbox, id, rid, Err(e), None).await;
                return Ok(None);
            }
        };
        let ip = self.peer.ip();
        if !state.hello_throttle.attempt(ip, &device) {
            tracing::info!(conn = id, peer = %self.peer, device, "failed hellos over the limit: refused");
            let e = WireError::hello_throttled();
            reply(outbox, id, rid, Err(e), None).await;
            return Err(CloseCode::Again);
        }
        let d = device.clone();
        let r = state
            .db(move |pool| async move { store::authenticate(&pool, &d, &token, epoch).await })
            .await;
        // Only a hello the database refused is charged: one it could not check (UNAVAILABLE,
        // an outage) is not, or an outage would lock honest devices out after it.
        let failed = matches!(
            r,
            Err(WireError::Unauthenticated(_) | WireError::StaleInstall)
        ) || (bugs::active(Bug::OutageChargesHello) && r.is_err());
        if failed {
            state.hello_throttle.failed(ip, &device);
        }
        match r {
            Ok(p) => {
                let handle = Arc::new(ConnHandle::new(
                    id,
                    p.clone(),
                    self.outbox.clone(),
                    self.close.clone(),
                ));
                if state
                    .hub
                    .register(&handle, state.cfg.conns_per_device_max)
                    .is_err()
                {
                    tracing::info!(conn = id, device = %p.device, "IM_CONNS_PER_DEVICE_MAX reached: refused");
                    let e = WireError::Throttled("too many connections for this device".into());
                    reply(outbox, id, rid, Err(e), None).await;
                    return Err(CloseCode::Again);
                }
                let welcome = Reply::Welcome {
                    user: p.user.clone(),
                    device: p.device.clone(),
                    epoch: p.epoch,
                };
                tracing::debug!(conn = id, user = %p.user, device = %p.device, "authenticated");
                reply(outbox, id, rid, Ok(welcome), None).await;
                Ok(Some(handle))
            }
            Err(e) => {
                reply(outbox, id, rid, Err(e), None).await;
                if failed {
                    Err(CloseCode::Policy)
                } else {
                    Ok(None)
                }
            }
        }
    }
}

/// An authenticated connection as its request tasks share it.
struct Session {
    state: Arc<State>,
    id: u64,
    /// Fixed by `hello`.
    who: Principal,
    /// This connection in the hub (its outbound queue, its close channel, subscription).
    handle: Arc<ConnHandle>,
    /// Serialises `sub` requests, so a failing one cannot undo a succeeding one.
    sub_lock: tokio::sync::Mutex<()>,
    /// Conversations this connection's user sent to successfully (see [`Members`]).
    members: Members,
}

/// Most conversations a connection remembers as ones its user is a member of.
const MEMBERS_MAX: usize = 1024;

/// The conversations a connection's user was last seen a member of (a send committed):
/// their sends skip `store::send`'s membership read before the transaction. Only a hint:
/// the INSERT's membership test, after the row lock (S1), decides; a NOT_MEMBER or
/// STALE_INSTALL answer forgets the conversation, so a user who left queues on the
/// conversation's row lock at most once, and an outsider never does.
#[derive(Default)]
struct Members(std::sync::Mutex<std::collections::HashSet<String>>);

impl Members {
    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn known(&self, conv: &str) -> bool {
        self.lock().contains(conv)
    }

    fn seen(&self, conv: &str) {
        if bugs::active(Bug::ForgetfulMember) {
            return;
        }
        let mut m = self.lock();
        if m.len() >= MEMBERS_MAX {
            m.clear();
        }
        m.insert(conv.to_string());
    }

    fn forget(&self, conv: &str) {
        if bugs::active(Bug::StickyMember) {
            return;
        }
        self.lock().remove(conv);
    }
}

impl Session {
    /// Replies; STALE_INSTALL (the device was reinstalled meanwhile) also revokes the
    /// connection's pushes and ends it ([`ConnHandle::revoke_answered`]).
    async fn reply(&self, rid: Option<&str>, r: Result<Reply, WireError>) {
        self.reply_reserved(rid, r, None).await
    }

    async fn reply_reserved(
        &self,
        rid: Option<&str>,
        r: Result<Reply, WireError>,
        reserved: Option<Reserved>,
    ) {
        let stale = matches!(r, Err(WireError::StaleInstall));
        reply(&self.handle.outbox, self.id, rid, r, reserved).await;
        if stale {
            self.handle.revoke_answered();
        }
    }

    /// Passes a request's fault point: `false` when it fired `drop` (no reply at all) or
    /// `error` (answered UNAVAILABLE), and the request ends there.
    async fn pass(&self, rid: Option<&str>, point: &'static str) -> bool {
        match faults::gate(point, None, Some(WireError::Unavailable)).await {
            ControlFlow::Continue(()) => true,
            ControlFlow::Break(None) => false,
            ControlFlow::Break(Some(e)) => {
                self.reply(rid, Err(e)).await;
                false
            }
        }
    }

    /// Handles one request after hello, replies (or, after a `drop` fault, does not).
    async fn dispatch(&self, rid: Option<&str>, req: Result<Request, WireError>) {
        match req {
            Err(e) => self.reply(rid, Err(e)).await,
            Ok(Request::Hello { .. }) => {
                self.reply(rid, Err(WireError::bad("already authenticated")))
                    .await
            }
            Ok(Request::Send { conv, cmid, body }) => self.on_send(rid, conv, cmid, body).await,
            Ok(Request::Ack { conv, seq }) => self.on_ack(rid, conv, seq).await,
            Ok(Request::Sub) => self.on_sub(rid).await,
            Ok(Request::Sync { conv, after, limit }) => self.on_sync(rid, conv, after, limit).await,
        }
    }

    /// `send`: group commit (issue 19), unless a watch of a deliberate bug needs the single
    /// send transaction; the reply only after COMMIT (D1).
    async fn on_send(&self, rid: Option<&str>, conv: String, cmid: String, body: String) {
        let st = &self.state;
        let w = self.who.clone();
        let c = conv.clone();
        // `None` but for the deliberate bugs that act inside a send (`observer`).
        let watch = st.observer.watch(&self.handle.outbox, rid);
        let watched = watch.clone();
        let notifier = st.notifier.clone();
        let member = self.members.known(&conv);
        // Group commit, unless a watch needs the single send transaction.
        let sends = watch.is_none().then(|| st.clone());
        let deadline = tokio::time::Instant::now() + st.cfg.db_work_deadline();
        let r = st
            .db(move |pool| async move {
                if let Some(st) = sends {
                    // Group commit (issue 19): the membership read first, as below.
                    if !member {
                        if let Some(answer) = store::outsider(&pool, &w, &c, &cmid, &body).await {
                            return answer;
                        }
                    }
                    return batch::send(&st.sends, deadline, w, c, cmid, body, member).await;
                }
                let ctx = store::SendCtx {
                    observer: watched.as_deref().map(|w| w as &dyn SendObserver),
                    notifier: &notifier,
                    known_member: member,
                };
                store::send(&pool, &w, &c, &cmid, &body, ctx).await
            })
            .await;
        match &r {
            Ok(SendOutcome::Reply(s)) if !s.dup => self.members.seen(&conv),
            Err(WireError::NotMember | WireError::StaleInstall) => self.members.forget(&conv),
            _ => {}
        }
        if watch.is_some_and(|w| w.replied()) {
            // The reply already left, before COMMIT: nothing more is said.
            return;
        }
        let sent = match r {
            Ok(SendOutcome::Reply(s)) => s,
            Ok(SendOutcome::NoReply) => return,
            Err(e) => return self.reply(rid, Err(e)).await,
        };
        // D1: we get here only after COMMIT returned (or for a committed duplicate).
        if !self.pass(rid, points::API_AFTER_SEND_COMMIT).await {
            return;
        }
        self.reply(rid, Ok(sent.reply(&conv))).await
    }

    /// `ack`: through the batched acks; D4 (the cursor only grows) is the statement's.
    async fn on_ack(&self, rid: Option<&str>, conv: String, seq: i64) {
        if !self.pass(rid, points::GW_RECV_ACK).await {
            return;
        }
        let st = &self.state;
        let who = &self.who;
        let w = who.clone();
        let c = conv.clone();
        let acks = st.clone();
        let deadline = tokio::time::Instant::now() + st.cfg.db_work_deadline();
        let r = st
            .db(move |_pool| async move { batch::ack(&acks.acks, deadline, w, c, seq).await })
            .await;
        if let Ok(delivered) = r {
            // D5: the sweep stops hinting this pair once `delivered` reaches its head.
            st.changes.acked(&who.device, who.epoch, &conv, delivered);
        }
        let r = r.map(|delivered| Reply::Acked { conv, delivered });
        self.reply(rid, r).await
    }

    /// `sub`: one at a time per connection; registered before the state is read, so no
    /// event falls between the two.
    async fn on_sub(&self, rid: Option<&str>) {
        let st = &self.state;
        let _one_at_a_time = self.sub_lock.lock().await;
        let h = &self.handle;
        let newly = st.hub.subscribe(h);
        let w = self.who.clone();
        let r = st
            .db(move |pool| async move { store::conv_states(&pool, &w, SUB_CONVS_MAX).await })
            .await;
        let r = r.map(|(convs, lineage)| Reply::Subbed { convs, lineage });
        if r.is_err() && newly {
            // A failed `sub` takes no effect: the client was told it did not work.
            st.hub.remove(h);
        }
        self.reply(rid, r).await
    }

    /// `sync`: one page, its largest frame reserved of the byte budget before it is read,
    /// so pages being built count against the budget as much as queued ones do.
    async fn on_sync(&self, rid: Option<&str>, conv: String, after: i64, limit: Option<i64>) {
        let st = &self.state;
        let limit = limit
            .unwrap_or(SYNC_LIMIT_DEFAULT)
            .min(st.cfg.sync_limit_max);
        let w = self.who.clone();
        let c = conv.clone();
        let page_max = st.cfg.sync_page_max_bytes;
        let largest = largest_synced_frame(limit, st.cfg.body_max_bytes, page_max);
        let Some(reserved) = self.handle.outbox.budget.reserve(largest).await else {
            return; // the connection is gone
        };
        let r = st
            .db(move |pool| async move { store::sync(&pool, &w, &c, after, limit, page_max).await })
            .await;
        let r = r.map(|p| Reply::Synced {
            conv,
            events: p.events,
            head: p.head,
            complete: p.complete,
        });
        self.reply_reserved(rid, r, Some(reserved)).await
    }
}

/// What the writer does with a frame whose fault point fired.
enum Faulted {
    /// `drop`, or `error` on a push: the frame is not written.
    Skip,
    /// `error` on a reply: UNAVAILABLE to the same `rid` instead.
    Unavailable,
}

/// Writes one frame; a peer that does not take it within `limit` is an error (the
/// connection is then abandoned, so a half-written frame does not matter).
async fn write(
    sink: &mut Sink,
    msg: Message,
    limit: Duration,
    t: &mut Tally,
) -> Result<(), WsError> {
    t.frames += 1;
    t.flushes += 1;
    within(limit, sink.send(msg)).await
}

/// Queues one frame in the sink without flushing, within `limit` (the sink flushes on its
/// own once its buffer is full).
async fn feed(
    sink: &mut Sink,
    msg: Message,
    limit: Duration,
    t: &mut Tally,
) -> Result<(), WsError> {
    t.frames += 1;
    within(limit, sink.feed(msg)).await
}

/// Flushes what [`feed`] queued, within `limit`.
async fn flush(sink: &mut Sink, limit: Duration, t: &mut Tally) -> Result<(), WsError> {
    t.flushes += 1;
    within(limit, sink.flush()).await
}

/// What one connection's writer did: frames handed to the socket (replies, pushes, hints,
/// pings) and flushes (a [`write`] is one frame and one flush). Logged with "connection
/// closed"; `frames - flushes` is how many frames rode in another frame's flush (issue 19's
/// one flush per burst, which `a_burst_is_written_with_one_flush` checks).
#[derive(Default, Clone, Copy)]
struct Tally {
    frames: u64,
    flushes: u64,
}

/// `op`, or a timeout error once the peer did not read for `limit`.
async fn within(
    limit: Duration,
    op: impl std::future::Future<Output = Result<(), WsError>>,
) -> Result<(), WsError> {
    match tokio::time::timeout(limit, op).await {
        Ok(r) => r,
        Err(_) => Err(WsError::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "peer did not read within IM_WRITE_TIMEOUT_MS",
        ))),
    }
}

/// Drains the queue to the socket, one flush per burst: a frame with more waiting behind it
/// is only queued in the sink, and the last of the burst flushes them all. The `gw.reply.send`, `gw.reply.ack` and `gw.push` fault
/// points act here, on the frame about to be written, chosen by its [`Kind`]. Once the
/// queue is empty it sends the overflow hints (`why:"overflow"`) the fan-out recorded while
/// it was full. A frame gives its bytes back to the budget once written (or dropped).
/// Pushes and hints still queued when the install became stale are dropped. Pings when the
/// reader asks (the peer was silent for half of IM_READ_IDLE_MS). Ends at the queue's
/// [`Out::Close`]. If a write fails or the peer stops reading for `limit`, it cancels
/// `gone` so the reader ends the connection too (its replies would have nowhere to go); on
/// any exit it closes the budget so nobody waits for it. Returns what it wrote ([`Tally`]).
async fn writer(
    mut sink: Sink,
    mut rx: mpsc::Receiver<Out>,
    outbox: Arc<Outbox>,
    ping: Arc<Notify>,
    id: u64,
    limit: Duration,
    gone: CancellationToken,
) -> Tally {
    let _gone = gone.drop_guard();
    let mut tally = Tally::default();
    // The frame being written keeps its bytes of the budget until it is written or dropped.
    // Declared before the guard, so on any exit the budget is closed before those bytes
    // come back: no request still waiting for them gets them and runs for nobody.
    let mut writing: Option<hub::Queued> = None;
    let _closed = CloseBudget(&outbox);
    // Frames written but not yet flushed (issue 19: one flush per burst, not per frame).
    let mut dirty = false;
    loop {
        if dirty && rx.is_empty() {
            if !flushed(&mut sink, limit, &mut tally, id).await {
                return tally;
            }
            dirty = false;
        }
        let next = tokio::select! {
            biased;
            _ = ping.notified() => match pinged(&mut sink, limit, &mut tally, id).await {
                true => continue,
                false => return tally,
            },
            next = rx.recv() => next,
        };
        let next = match next {
            None | Some(Out::Close(None)) => {
                if dirty {
                    let _ = flush(&mut sink, limit, &mut tally).await;
                }
                return tally;
            }
            Some(Out::Close(Some(code))) => {
                close_frame(&mut sink, code, limit).await;
                return tally;
            }
            Some(Out::Frame(q)) => q,
        };
        // A stale install's queued pushes and hints are not written (STALE_INSTALL).
        if matches!(next.kind, Kind::Event | Kind::Hint)
            && outbox.is_revoked()
            && !bugs::active(Bug::StaleBacklog)
        {
            continue;
        }
        let next = writing.insert(next);
        let mut text = Some(next.text.as_str());
        let replaced;
        if let Some(point) = fault_point(next.kind) {
            // A fault acts on this frame only: what the burst queued before it reaches the
            // peer first (a `halt` here would otherwise take it down with the process).
            if dirty && faults::is_armed(point) {
                if !flushed(&mut sink, limit, &mut tally, id).await {
                    return tally;
                }
                dirty = false;
            }
            match through_fault(point, next).await {
                Gate::Write => {}
                Gate::Skip => text = None,
                Gate::Replace(frame) => {
                    replaced = frame;
                    text = Some(replaced.as_str());
                }
            }
        }
        if let Some(text) = text {
            // More frames waiting: queue this one in the sink, the last of the burst flushes.
            let r = if rx.is_empty() {
                write(&mut sink, Message::text(text), limit, &mut tally).await
            } else {
                feed(&mut sink, Message::text(text), limit, &mut tally).await
            };
            if let Err(e) = r {
                tracing::info!(conn = id, error = %e, "write failed: abandoning the connection");
                return tally;
            }
            dirty = !rx.is_empty();
        }
        writing = None;
        // Also after a dropped frame: an overflowed connection must get its hints.
        if rx.is_empty()
            && overflow_hints(&mut sink, &outbox, limit, &mut tally)
                .await
                .is_err()
        {
            return tally;
        }
    }
}

/// Flushes what the writer fed the sink; false (logged) when the flush failed and the
/// connection is to be abandoned.
async fn flushed(sink: &mut Sink, limit: Duration, tally: &mut Tally, id: u64) -> bool {
    match flush(sink, limit, tally).await {
        Ok(()) => true,
        Err(e) => {
            tracing::info!(conn = id, error = %e, "flush failed: abandoning the connection");
            false
        }
    }
}

/// Writes a ping (the reader asked for one); false (logged) when the peer did not take it
/// and the connection is to be abandoned.
async fn pinged(sink: &mut Sink, limit: Duration, tally: &mut Tally, id: u64) -> bool {
    let taken = write(sink, Message::Ping(Default::default()), limit, tally).await;
    if taken.is_err() {
        tracing::info!(conn = id, "ping not taken: abandoning the connection");
    }
    taken.is_ok()
}

/// The fault point a frame of `kind` passes in the writer, if any.
fn fault_point(kind: Kind) -> Option<&'static str> {
    match kind {
        Kind::Sent => Some(points::GW_REPLY_SEND),
        Kind::Acked => Some(points::GW_REPLY_ACK),
        Kind::Event => Some(points::GW_PUSH),
        Kind::Welcome | Kind::Subbed | Kind::Synced | Kind::Error | Kind::Hint => None,
    }
}

/// What the writer does with a frame after its fault point.
enum Gate {
    Write,
    Skip,
    /// Write this frame instead.
    Replace(String),
}

/// Passes `frame` through its fault `point`: `drop`, or `error` on a push, skips it;
/// `error` on a reply answers UNAVAILABLE to the same `rid` instead (the operation already
/// committed; the client sees UNAVAILABLE and retries).
async fn through_fault(point: &'static str, frame: &hub::Queued) -> Gate {
    let on_error = match frame.kind {
        Kind::Event => Faulted::Skip,
        _ => Faulted::Unavailable,
    };
    match faults::gate(point, Faulted::Skip, on_error).await {
        ControlFlow::Continue(()) => Gate::Write,
        ControlFlow::Break(Faulted::Skip) => Gate::Skip,
        ControlFlow::Break(Faulted::Unavailable) => {
            let error = Reply::Error(WireError::Unavailable);
            Gate::Replace(protocol::reply_frame(frame.rid.as_deref(), &error))
        }
    }
}

/// Writes an overflow hint for every conversation whose pushes the queue dropped (D5's
/// repair path), once the queue has drained.
async fn overflow_hints(
    sink: &mut Sink,
    outbox: &Outbox,
    limit: Duration,
    tally: &mut Tally,
) -> Result<(), WsError> {
    let Some(pending) = outbox.take_overflow() else {
        return Ok(());
    };
    let pending = pending
        .into_iter()
        .filter(|_| !bugs::active(Bug::NoOverflowHint));
    for (conv, head) in pending {
        let why = HintWhy::Overflow;
        let hint = protocol::render(&Frame::Push(Push::Hint {
            conv: &conv,
            head,
            why,
        }));
        write(sink, Message::text(hint), limit, tally).await?;
    }
    Ok(())
}

/// Writes the close frame with `code` and closes the sink, within `limit`.
async fn close_frame(sink: &mut Sink, code: u16, limit: Duration) {
    let frame = CloseFrame {
        code: CloseCode::from(code),
        reason: "".into(),
    };
    let _ = tokio::time::timeout(limit, async {
        let _ = sink.send(Message::Close(Some(frame))).await;
        let _ = sink.close().await;
    })
    .await;
}

/// Closes the budget when the writer ends, however it ends.
struct CloseBudget<'a>(&'a Outbox);

impl Drop for CloseBudget<'_> {
    fn drop(&mut self) {
        self.0.budget.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Event, CMID_MAX_BYTES, ID_MAX_BYTES, RID_MAX_BYTES};

    /// A binary frame is refused by what the connection has said: BAD_REQUEST after hello
    /// (send JSON text), UNAUTHENTICATED before it (say hello first); the connection stays
    /// either way. A frame of exactly the limit is served or refused as any other; one byte
    /// over it ends the connection (1009), whether or not it said hello.
    #[test]
    fn a_binary_frame_is_refused_by_what_the_connection_has_said() {
        let binary = |n: usize| Some(Ok(Message::Binary(vec![0u8; n].into())));
        let text = |n: usize| Some(Ok(Message::Text("x".repeat(n).into())));
        let code = |r: Read| match r {
            Read::Refused(e) => format!("refused {}", e.code()),
            Read::End(c, _) => format!("end {}", u16::from(c)),
            Read::Text(_) => "text".to_string(),
            Read::Skip => "skip".to_string(),
        };
        assert_eq!(
            code(classify(binary(4), 16, 1, true)),
            "refused BAD_REQUEST"
        );
        assert_eq!(
            code(classify(binary(4), 16, 1, false)),
            "refused UNAUTHENTICATED"
        );
        assert_eq!(code(classify(binary(17), 16, 1, true)), "end 1009");
        assert_eq!(code(classify(binary(17), 16, 1, false)), "end 1009");
        assert_eq!(
            code(classify(binary(16), 16, 1, true)),
            "refused BAD_REQUEST"
        );
        assert_eq!(code(classify(text(16), 16, 1, true)), "text");
        assert_eq!(code(classify(text(17), 16, 1, true)), "end 1009");
    }

    /// The byte budget's promise for syncs: what a sync reserves before its page is read is
    /// at least the frame it can produce, whatever the events hold. The worst page is built
    /// as `store::sync` builds one (events added while the page stays within `page_max`,
    /// at least one) from events whose body and cmid are control characters (each escaped
    /// to six bytes), with the longest ids, and rendered by the one renderer.
    #[test]
    fn a_sync_reserves_at_least_the_largest_frame_it_can_produce() {
        let ctl = |n: usize| "\u{1}".repeat(n);
        let id = |n: usize| "x".repeat(n);
        for body_max in [1, 100, 1000, 16_384] {
            for page_max in [1024, 4096, 65_536, 1 << 20] {
                for limit in [1, 2, 7, 100, 500] {
                    let ev = Event {
                        conv: id(ID_MAX_BYTES),
                        seq: i64::MAX,
                        kind: "msg".into(),
                        mid: "00000000-0000-0000-0000-000000000000".into(),
                        sender: id(ID_MAX_BYTES),
                        cmid: ctl(CMID_MAX_BYTES),
                        body: ctl(body_max),
                        at_ms: i64::MIN,
                        epoch: i64::MIN,
                    };
                    let len = ev.to_json().to_string().len();
                    let mut events = Vec::new();
                    let mut bytes = 0;
                    while events.len() < limit as usize
                        && (events.is_empty() || bytes + len <= page_max)
                    {
                        bytes += len;
                        events.push(ev.clone());
                    }
                    let frame = protocol::reply_frame(
                        Some(&ctl(RID_MAX_BYTES)),
                        &Reply::Synced {
                            conv: id(ID_MAX_BYTES),
                            events,
                            head: i64::MAX,
                            complete: false,
                        },
                    );
                    let reserved = largest_synced_frame(limit, body_max, page_max);
                    assert!(
                        frame.len() <= reserved,
                        "limit {limit}, body {body_max}, page {page_max}: frame {} > reserved {reserved}",
                        frame.len()
                    );
                }
            }
        }
    }
}
