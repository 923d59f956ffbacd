//! The durable test client: one device speaking the gateway's wire protocol
//! (SPEC section 2) the way SPEC section 5 says a careful client must.
//!
//! What it owns:
//! - one WebSocket connection at a time (`ws://…/ws`, JSON text frames) with `rid`
//!   correlation (`rid = "c<N>"` from a per-client counter) and per-request timeouts;
//! - a **state file** (JSON) holding the device credentials, the outbox, the event
//!   store, per-conversation cursors and the last `delivered` the server reported.
//!   Every change is written to a temporary file in the same directory and renamed over
//!   the old one, so a reader always sees a complete file. There is no fsync: the file
//!   survives a crash of the *process* (what the scenarios do), not a power loss;
//! - the outbox: an entry is persisted before the first `send` frame leaves and removed
//!   only on `sent` or a terminal error, so a restarted client can replay it with the
//!   same `cmid` (this is what lets the harness check D2);
//! - the event store and contiguous cursor: events are persisted before any ack that
//!   covers them, and an ack never exceeds the cursor (the client half of D3);
//! - a background pump that applies pushes (`event`, `hint`), repairs gaps with `sync`
//!   (the client half of D5) and sends coalesced acks.
//!
//! What it must not do: interpret the database, decide whether an invariant holds, or
//! retry sends on its own. Scenarios drive it and judge what it observed; it only
//! records (frames, statistics) and exposes deadline-bound waits.
//!
//! Concurrency: shared state sits behind one `std::sync::Mutex` that is never held
//! across an `.await`. The state file is written while that lock is held, so the order
//! of writes is the order of changes and anything visible through the accessors is
//! already on disk.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::history::{History, Type};

/// Version of the state file layout; `load` refuses any other.
const STATE_VERSION: u32 = 1;
/// Pushes waiting for the pump. When full, further pushes are dropped and counted
/// (`pushes_overflowed`): the protocol repairs lost pushes (gap detection, sweep
/// hints), and a reader that never blocks keeps replies flowing to waiting requests.
const PUSH_QUEUE_FRAMES_MAX: usize = 10_000;
/// Frames waiting for the writer task.
const OUT_QUEUE_FRAMES_MAX: usize = 1_024;
/// Upper bound on pages in one sync-until-complete run, so a misbehaving server
/// cannot keep the pump busy forever.
const SYNC_PAGES_MAX: usize = 10_000;
/// Smallest delay before an automatic ack that failed with a retryable error is tried
/// again (avoids a tight loop while the database is down).
const ACK_RETRY_MIN: Duration = Duration::from_millis(200);
/// Error codes after which a send is final: the outbox entry is removed.
pub const TERMINAL_SEND_CODES: [&str; 4] =
    ["BAD_REQUEST", "NOT_MEMBER", "CMID_CONFLICT", "TOO_LARGE"];

/// Distinguishes temp files of client instances in one process.
static INSTANCE_SEQ: AtomicU64 = AtomicU64::new(0);

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// Where a test client dies on purpose (`ClientOptions::crash_at`): it stops writing its
/// state file and sending frames at once, as a killed process would; the scenario then
/// calls [`Client::crash`] and [`Client::load`] (the restart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashAt {
    /// Right after the n-th automatic ack frame was written (1-based), before anything else
    /// is persisted. A correct client persisted every acked event before the ack (D3), so
    /// nothing acked is lost; a client that acks before persisting loses them.
    AfterAck(u32),
    /// In the middle of a sync: right after the n-th sync page (1-based) was persisted.
    AfterSyncPage(u32),
}

/// Deliberate bugs of the test client and the harness (negative controls, `make
/// controls`), chosen by `IM_BUG` like the gateway's; a name not listed here is the
/// gateway's (forwarded to it, which validates it).
pub mod bugs {
    /// D3, client side: acks a pushed or synced event before persisting it.
    pub const ACK_BEFORE_PERSIST: &str = "ack-before-persist";
    /// D3/D5, client side: the cursor is the highest seq seen; gaps are never synced.
    pub const CURSOR_MAX: &str = "cursor-max";
    /// D6, harness side: the throwaway cluster runs with `fsync=off` (loses commits only
    /// on a power cut, which the harness does not simulate yet).
    pub const FSYNC_OFF: &str = "fsync-off";
    pub const ALL: &[&str] = &[ACK_BEFORE_PERSIST, CURSOR_MAX, FSYNC_OFF];

    /// The client bug `IM_BUG` names in this process, if it names one.
    pub fn active() -> Option<&'static str> {
        let v = std::env::var("IM_BUG").ok()?;
        ALL.iter().copied().find(|b| *b == v.trim())
    }
}

/// Tunables of the client; `Default` gives the values of SPEC section 5.
#[derive(Debug, Clone, Copy)]
pub struct ClientOptions {
    /// Ack as soon as this many new events were stored since the last ack.
    pub ack_every: usize,
    /// Ack at the latest this long after the first event that is not yet acked.
    pub ack_after: Duration,
    /// When false the client stores events but never acks (models a device that
    /// crashed after storing and before acking).
    pub auto_ack: bool,
    /// `limit` of the sync requests the client makes by itself.
    pub sync_limit: i64,
    /// Timeout of requests the client makes by itself (sync, ack, hello) and of the
    /// WebSocket handshake. The pump awaits its own syncs and acks, so this is also how
    /// long a lost ack can hold up the handling of later pushes and hints.
    pub request_timeout: Duration,
    /// How many received (and sent) frames are kept for `frames()`.
    pub frames_max: usize,
    /// A crash point of this client (none by default).
    pub crash_at: Option<CrashAt>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            ack_every: 4,
            ack_after: Duration::from_millis(50),
            auto_ack: true,
            sync_limit: 100,
            request_timeout: Duration::from_secs(2),
            frames_max: 10_000,
            crash_at: None,
        }
    }
}

/// Why a request did not produce a success reply.
#[derive(Debug)]
pub enum ClientError {
    /// No reply within the request's timeout (the request may still have taken effect).
    Timeout,
    /// The connection was closed (or never open) before the reply arrived.
    Disconnected,
    /// The server answered `error{code,msg}`; `frame` is the whole error frame.
    Server {
        code: String,
        msg: String,
        frame: Value,
    },
    /// Anything else: a malformed reply, a state file that could not be written…
    Other(anyhow::Error),
}

impl ClientError {
    /// The server's error code, if the server answered with an error.
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Server { code, .. } => Some(code),
            _ => None,
        }
    }

    /// True when a send that failed this way must not be retried: the outbox entry
    /// is dropped (`TERMINAL_SEND_CODES`).
    pub fn is_terminal_for_send(&self) -> bool {
        self.code()
            .is_some_and(|c| TERMINAL_SEND_CODES.contains(&c))
    }

    /// True when the same request may succeed later on the same connection.
    fn is_retryable(&self) -> bool {
        match self {
            ClientError::Timeout => true,
            ClientError::Server { code, .. } => code == "UNAVAILABLE" || code == "INTERNAL",
            ClientError::Disconnected | ClientError::Other(_) => false,
        }
    }
}

impl fmt::Display for ClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientError::Timeout => write!(f, "request timed out"),
            ClientError::Disconnected => write!(f, "connection closed"),
            ClientError::Server { code, msg, .. } => write!(f, "server error {code}: {msg}"),
            ClientError::Other(e) => write!(f, "{e:#}"),
        }
    }
}

impl std::error::Error for ClientError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ClientError::Other(e) => Some(e.as_ref()),
            _ => None,
        }
    }
}

impl From<anyhow::Error> for ClientError {
    fn from(e: anyhow::Error) -> Self {
        ClientError::Other(e)
    }
}

/// A state file's events: conv -> `[(seq, mid)]`, ascending.
pub type StoredEvents = BTreeMap<String, Vec<(i64, String)>>;

/// A message the client has tried to send and not yet seen answered for good.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutboxEntry {
    pub conv: String,
    pub cmid: String,
    pub body: String,
}

/// What this client instance observed (not persisted: a loaded client starts at zero).
#[derive(Debug, Clone, Default, Serialize)]
pub struct ClientStats {
    /// Text frames received (any type).
    pub frames_received: u64,
    /// `event` pushes received (hints are counted in `hints_received`).
    pub pushes_received: u64,
    /// Pushes that stored an event the client did not have.
    pub pushes_applied: u64,
    /// Events stored from sync replies that the client did not have.
    pub events_synced: u64,
    /// Events (pushed or synced) the client already had.
    pub duplicates_ignored: u64,
    /// Pushes with `seq > cursor + 1`.
    pub gaps_detected: u64,
    /// `hint` pushes, by `why`.
    pub hints_received: BTreeMap<String, u64>,
    /// Sync pages requested by the client itself (pump and `sub`), not `sync_once`.
    pub syncs_run: u64,
    /// Sync pages that failed.
    pub sync_errors: u64,
    /// Ack frames sent (automatic, after `sub`, and explicit `ack`).
    pub acks_sent: u64,
    /// Acks that did not get an `acked` reply.
    pub ack_errors: u64,
    /// Pushes dropped because the pump queue was full.
    pub pushes_overflowed: u64,
    /// Pushes or replies that lacked required fields, and non-JSON frames.
    pub malformed_frames: u64,
    /// Times a reported `delivered` was lower than the one reported before (D4 says
    /// this never happens).
    pub delivered_decreases: u64,
    /// State file writes that failed (no ack is sent while the file is behind).
    pub persist_errors: u64,
}

/// Per-conversation part of the state file.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct ConvFile {
    /// Every event visible to this device with `seq <= cursor` is in `events`.
    cursor: i64,
    /// Last `delivered` the server reported for this device (subbed or acked).
    server_delivered: Option<i64>,
    /// Stored events (`ev` objects as received), by seq.
    events: BTreeMap<i64, Value>,
}

/// The durable state file.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StateFile {
    version: u32,
    device: String,
    token: String,
    epoch: i64,
    /// Sends not yet answered for good, in the order they were first sent.
    outbox: Vec<OutboxEntry>,
    convs: BTreeMap<String, ConvFile>,
}

/// Coalescing state of automatic acks for one conversation (in memory only).
#[derive(Debug, Default)]
struct AckTrack {
    /// Highest cursor the server is known to have (our acked seq, or its delivered).
    acked: i64,
    /// New events stored since the last ack.
    new_since_ack: usize,
    /// When an automatic ack is due (first un-acked event + `ack_after`, or a retry).
    due_at: Option<Instant>,
}

/// The live connection as seen by requests.
struct ConnLink {
    /// Distinguishes connections so a stale reader cannot clobber a newer one.
    id: u64,
    /// Frames for the writer task.
    out: mpsc::Sender<Message>,
}

/// A request waiting for its reply.
struct Pending {
    conn: u64,
    tx: oneshot::Sender<Result<Value, ClientError>>,
}

struct State {
    file: StateFile,
    opts: ClientOptions,
    stats: ClientStats,
    /// Received frames with their arrival time, newest last, at most `opts.frames_max`.
    frames: VecDeque<(Instant, Value)>,
    /// Sent frames, likewise (a raw `send_text` is recorded as a JSON string).
    sent_frames: VecDeque<(Instant, Value)>,
    /// Last head the server reported per conversation (subbed, synced, hint).
    heads: HashMap<String, i64>,
    acks: HashMap<String, AckTrack>,
    pending: HashMap<String, Pending>,
    conn: Option<ConnLink>,
    conn_seq: u64,
    subscribed: bool,
    /// The last state file write failed: memory is ahead of the disk.
    dirty: bool,
    /// A crash point fired: this instance writes nothing and sends nothing any more.
    dead: bool,
    /// Automatic acks sent and sync pages persisted by this instance (for `crash_at`).
    auto_acks_done: u32,
    sync_pages_done: u32,
    /// The deliberate client bug of this process (`IM_BUG`), if any.
    bug: Option<&'static str>,
}

impl State {
    fn new(file: StateFile) -> Self {
        State {
            file,
            opts: ClientOptions::default(),
            stats: ClientStats::default(),
            frames: VecDeque::new(),
            sent_frames: VecDeque::new(),
            heads: HashMap::new(),
            acks: HashMap::new(),
            pending: HashMap::new(),
            conn: None,
            conn_seq: 0,
            subscribed: false,
            dirty: false,
            dead: false,
            auto_acks_done: 0,
            sync_pages_done: 0,
            bug: bugs::active(),
        }
    }

    fn bug(&self, name: &str) -> bool {
        self.bug == Some(name)
    }

    fn cursor(&self, conv: &str) -> i64 {
        self.file.convs.get(conv).map_or(0, |c| c.cursor)
    }

    /// The ack track of `conv`, created from the last known server `delivered`.
    fn ack_track(&mut self, conv: &str) -> &mut AckTrack {
        let known = self
            .file
            .convs
            .get(conv)
            .and_then(|c| c.server_delivered)
            .unwrap_or(0);
        self.acks
            .entry(conv.to_string())
            .or_insert_with(|| AckTrack {
                acked: known,
                ..AckTrack::default()
            })
    }

    fn record_delivered(&mut self, conv: &str, delivered: i64) {
        let c = self.file.convs.entry(conv.to_string()).or_default();
        if c.server_delivered.is_some_and(|old| delivered < old) {
            self.stats.delivered_decreases += 1;
        }
        c.server_delivered = Some(delivered);
    }

    fn note_head(&mut self, conv: &str, head: i64) {
        let h = self.heads.entry(conv.to_string()).or_insert(head);
        *h = (*h).max(head);
    }
}

/// Moves the cursor over stored events that continue it contiguously.
fn advance_contiguous(c: &mut ConvFile) {
    while let Some(next) = c.cursor.checked_add(1) {
        if !c.events.contains_key(&next) {
            break;
        }
        c.cursor = next;
    }
}

fn push_bounded(q: &mut VecDeque<(Instant, Value)>, max: usize, v: Value) {
    if max == 0 {
        return;
    }
    while q.len() >= max {
        q.pop_front();
    }
    q.push_back((Instant::now(), v));
}

/// Writes `file` to `tmp` and renames it over `path` (atomic on POSIX file systems;
/// no fsync, see the module doc).
fn write_state_file(path: &Path, tmp: &Path, file: &StateFile) -> anyhow::Result<()> {
    let bytes = serde_json::to_vec(file).context("encode client state")?;
    std::fs::write(tmp, bytes).with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(tmp, path)
        .with_context(|| format!("rename {} to {}", tmp.display(), path.display()))?;
    Ok(())
}

fn tmp_path_for(path: &Path) -> anyhow::Result<PathBuf> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| anyhow!("state path {} has no file name", path.display()))?;
    let instance = INSTANCE_SEQ.fetch_add(1, Ordering::Relaxed);
    Ok(path.with_file_name(format!(".{name}.tmp-{}-{instance}", std::process::id())))
}

fn field_str<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

fn field_i64(v: &Value, key: &str) -> Option<i64> {
    v.get(key).and_then(Value::as_i64)
}

/// Shared between the `Client` handle and its connection tasks.
struct Inner {
    state_path: PathBuf,
    tmp_path: PathBuf,
    next_rid: AtomicU64,
    st: Mutex<State>,
    /// Bumped after every change; `wait_for` sleeps on it.
    changed: watch::Sender<u64>,
    /// Where operations, pushes and stores are recorded (the world's history), if anywhere.
    hist: Option<History>,
    /// The device, as history lines name the process.
    device: String,
    /// This instance's number for the device (1 for `create`, +1 per `load`).
    instance: u64,
}

/// Error codes that say for certain the request did not take effect (history `fail`);
/// every other outcome without a success reply is `info` (it may have happened).
const DEFINITE_ERROR_CODES: [&str; 7] = [
    "BAD_REQUEST",
    "NOT_MEMBER",
    "CMID_CONFLICT",
    "TOO_LARGE",
    "STALE_INSTALL",
    "UNAUTHENTICATED",
    "CURSOR_AHEAD",
];

/// The invoke value of a request frame: the frame without `t`, `rid`, secrets and bodies.
fn invoke_value(frame: &Value) -> Value {
    let mut v = frame.clone();
    if let Some(o) = v.as_object_mut() {
        o.remove("t");
        o.remove("rid");
        o.remove("token");
        if let Some(body) = o.remove("body") {
            let len = body.as_str().map_or(0, str::len);
            o.insert("body_len".into(), json!(len));
        }
    }
    v
}

/// The pieces of an `ev` object the history keeps (no body, no time).
fn event_summary(ev: &Value) -> Value {
    json!({"conv": ev.get("conv"), "seq": ev.get("seq"), "mid": ev.get("mid"),
           "sender": ev.get("sender"), "cmid": ev.get("cmid")})
}

/// How a request ended, as a history line: its type and value.
fn completion(r: &Result<Value, ClientError>) -> (Type, Value) {
    match r {
        Ok(reply) => {
            let mut v = reply.clone();
            if let Some(o) = v.as_object_mut() {
                o.remove("t");
                o.remove("rid");
                if let Some(Value::Array(evs)) = o.get_mut("events") {
                    for ev in evs.iter_mut() {
                        *ev = event_summary(ev);
                    }
                }
            }
            (Type::Ok, v)
        }
        Err(ClientError::Server { code, msg, .. })
            if DEFINITE_ERROR_CODES.contains(&code.as_str()) =>
        {
            (Type::Fail, json!({"code": code, "msg": msg}))
        }
        Err(ClientError::Server { code, .. }) => (Type::Info, json!({"why": code})),
        Err(ClientError::Timeout) => (Type::Info, json!({"why": "timeout"})),
        Err(ClientError::Disconnected) => (Type::Info, json!({"why": "disconnected"})),
        Err(ClientError::Other(e)) => {
            (Type::Info, json!({"why": "other", "msg": format!("{e:#}")}))
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn notify(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Appends a history line for this client (no-op without a history).
    fn rec(&self, kind: Type, op: &str, op_id: Option<u64>, value: Value) -> Option<u64> {
        self.hist
            .as_ref()
            .map(|h| h.record(&self.device, self.instance, kind, op, op_id, value))
    }

    /// Records events just persisted (call right after a successful `persist`).
    fn rec_store(&self, conv: &str, via: &str, events: &[(i64, Value)], cursor: i64) {
        if events.is_empty() {
            return;
        }
        let evs: Vec<Value> = events
            .iter()
            .map(|(seq, mid)| json!({"seq": seq, "mid": mid}))
            .collect();
        self.rec(
            Type::Store,
            "store",
            None,
            json!({"conv": conv, "via": via, "events": evs, "cursor": cursor}),
        );
    }

    /// Fires crash point `AfterAck`/`AfterSyncPage` when its count is reached: from then on
    /// this instance persists and sends nothing. Returns true if it is dead.
    fn crash_point(&self, st: &mut State, at: CrashAt) -> bool {
        if st.opts.crash_at == Some(at) && !st.dead {
            st.dead = true;
            tracing::info!(device = %self.device, ?at, "client crash point fired");
        }
        st.dead
    }

    /// Sends an ack of the cursor before persisting `events` (the `ack-before-persist`
    /// client bug), then persists them, unless the crash point struck in between.
    async fn ack_then_persist(&self, conv: &str, via: &str, events: Vec<(i64, Value)>) {
        let (cursor, timeout) = {
            let st = self.lock();
            (st.cursor(conv), st.opts.request_timeout)
        };
        if self.lock().opts.auto_ack {
            let _ = self.send_ack(conv, cursor, timeout, false).await;
            let mut st = self.lock();
            st.auto_acks_done += 1;
            let n = st.auto_acks_done;
            if self.crash_point(&mut st, CrashAt::AfterAck(n)) {
                return;
            }
        }
        let mut st = self.lock();
        if self.persist(&mut st).is_ok() {
            self.rec_store(conv, via, &events, cursor);
        }
    }

    fn opts(&self) -> ClientOptions {
        self.lock().opts
    }

    /// Writes the state file; call with the lock held so writes follow changes in order.
    fn persist(&self, st: &mut State) -> anyhow::Result<()> {
        if st.dead {
            bail!("this client instance crashed at its crash point: nothing is written");
        }
        match write_state_file(&self.state_path, &self.tmp_path, &st.file) {
            Ok(()) => {
                st.dirty = false;
                Ok(())
            }
            Err(e) => {
                st.dirty = true;
                st.stats.persist_errors += 1;
                tracing::error!(error = %format!("{e:#}"), "client state file write failed");
                Err(e)
            }
        }
    }

    /// Sends `frame` with a fresh `rid` and waits for the reply until `timeout`; records
    /// the invoke and its completion in the history.
    async fn request(&self, frame: Value, timeout: Duration) -> Result<Value, ClientError> {
        let invoke = invoke_value(&frame);
        self.request_rec(frame, timeout, invoke).await
    }

    /// [`Inner::request`] with the history's invoke value given by the caller.
    async fn request_rec(
        &self,
        frame: Value,
        timeout: Duration,
        invoke: Value,
    ) -> Result<Value, ClientError> {
        if self.lock().dead {
            return Err(ClientError::Disconnected);
        }
        let op = field_str(&frame, "t").unwrap_or("?").to_string();
        let op_id = self.hist.as_ref().map(History::next_op_id);
        self.rec(Type::Invoke, &op, op_id, invoke);
        let r = self.request_inner(frame, timeout).await;
        let (kind, value) = completion(&r);
        let line = self.rec(kind, &op, op_id, value);
        // D1 probe: a `sent` reply means the event is committed, so another session must
        // see it now.
        if let (Some(h), Some(i), Ok(reply)) = (&self.hist, line, &r) {
            if op == "send" {
                if let (Some(conv), Some(seq), Some(mid)) = (
                    field_str(reply, "conv"),
                    field_i64(reply, "seq"),
                    field_str(reply, "mid"),
                ) {
                    h.probe(i, conv, seq, mid);
                }
            }
        }
        r
    }

    async fn request_inner(
        &self,
        mut frame: Value,
        timeout: Duration,
    ) -> Result<Value, ClientError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let rid = format!("c{}", self.next_rid.fetch_add(1, Ordering::Relaxed) + 1);
        let obj = frame
            .as_object_mut()
            .ok_or_else(|| ClientError::Other(anyhow!("a request frame must be a JSON object")))?;
        obj.insert("rid".into(), Value::String(rid.clone()));
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
        if field_str(&reply, "t") == Some("error") {
            return Err(ClientError::Server {
                code: field_str(&reply, "code").unwrap_or("").to_string(),
                msg: field_str(&reply, "msg").unwrap_or("").to_string(),
                frame: reply,
            });
        }
        Ok(reply)
    }

    /// Sends an ack and records the reported `delivered`.
    /// `explicit`: a test acks on purpose (`Client::ack`), not the client's own logic; the
    /// checker holds only the client's own acks to D3.
    async fn send_ack(
        &self,
        conv: &str,
        seq: i64,
        timeout: Duration,
        explicit: bool,
    ) -> Result<Value, ClientError> {
        self.lock().stats.acks_sent += 1;
        let r = self
            .request_rec(
                json!({"t": "ack", "conv": conv, "seq": seq}),
                timeout,
                json!({"conv": conv, "seq": seq, "explicit": explicit}),
            )
            .await;
        {
            let mut st = self.lock();
            match &r {
                Ok(reply) => match field_i64(reply, "delivered") {
                    Some(delivered) => {
                        st.record_delivered(conv, delivered);
                        let t = st.ack_track(conv);
                        t.acked = t.acked.max(delivered).max(seq);
                        // Best effort: `server_delivered` is informational, a failed
                        // write is counted and logged by `persist`.
                        let _ = self.persist(&mut st);
                    }
                    None => st.stats.malformed_frames += 1,
                },
                Err(_) => st.stats.ack_errors += 1,
            }
        }
        self.notify();
        r
    }

    /// Syncs `conv` from `from` (clamped to the cursor) until the server says
    /// `complete`, storing every event and moving the cursor (SPEC section 5).
    async fn sync_until_complete(&self, conv: &str, from: i64) -> Result<(), ClientError> {
        let (limit, timeout, mut after) = {
            let st = self.lock();
            (
                st.opts.sync_limit,
                st.opts.request_timeout,
                from.min(st.cursor(conv)),
            )
        };
        for _ in 0..SYNC_PAGES_MAX {
            let reply = match self
                .request(
                    json!({"t": "sync", "conv": conv, "after": after, "limit": limit}),
                    timeout,
                )
                .await
            {
                Ok(r) => r,
                Err(e) => {
                    let mut st = self.lock();
                    st.stats.syncs_run += 1;
                    st.stats.sync_errors += 1;
                    return Err(e);
                }
            };
            let events = reply.get("events").and_then(Value::as_array);
            let head = field_i64(&reply, "head");
            let complete = reply.get("complete").and_then(Value::as_bool);
            let (Some(events), Some(head), Some(complete)) = (events, head, complete) else {
                let mut st = self.lock();
                st.stats.syncs_run += 1;
                st.stats.sync_errors += 1;
                st.stats.malformed_frames += 1;
                return Err(ClientError::Other(anyhow!(
                    "malformed synced reply: {reply}"
                )));
            };
            let mut last: Option<i64> = None;
            let mut stored: Vec<(i64, Value)> = Vec::new();
            let mut defer_persist = false;
            let persisted = {
                let mut st = self.lock();
                let st = &mut *st;
                st.stats.syncs_run += 1;
                st.note_head(conv, head);
                let cursor_max = st.bug(bugs::CURSOR_MAX);
                let c = st.file.convs.entry(conv.to_string()).or_default();
                let mut new = 0usize;
                for ev in events {
                    let Some(seq) = field_i64(ev, "seq") else {
                        st.stats.malformed_frames += 1;
                        continue;
                    };
                    if field_str(ev, "conv").is_some_and(|c| c != conv) {
                        st.stats.malformed_frames += 1;
                        continue;
                    }
                    last = Some(last.map_or(seq, |l| l.max(seq)));
                    match c.events.entry(seq) {
                        std::collections::btree_map::Entry::Occupied(_) => {
                            st.stats.duplicates_ignored += 1;
                        }
                        std::collections::btree_map::Entry::Vacant(slot) => {
                            slot.insert(ev.clone());
                            st.stats.events_synced += 1;
                            stored.push((seq, ev.get("mid").cloned().unwrap_or(Value::Null)));
                            new += 1;
                        }
                    }
                }
                // Every visible event in (after, last] was returned, so the store holds
                // everything visible through `last`; `complete` extends that to `head`
                // (events this user may not see are not holes).
                if let Some(last) = last {
                    c.cursor = c.cursor.max(last);
                }
                if complete {
                    c.cursor = c.cursor.max(head);
                }
                if !cursor_max {
                    advance_contiguous(c);
                }
                let cursor = c.cursor;
                st.ack_track(conv).new_since_ack += new;
                if st.bug(bugs::ACK_BEFORE_PERSIST) && !stored.is_empty() {
                    defer_persist = true;
                    Ok(())
                } else {
                    let r = self.persist(st);
                    if r.is_ok() {
                        self.rec_store(conv, "sync", &stored, cursor);
                        st.sync_pages_done += 1;
                        let n = st.sync_pages_done;
                        if self.crash_point(st, CrashAt::AfterSyncPage(n)) {
                            return Err(ClientError::Disconnected);
                        }
                    }
                    r
                }
            };
            self.notify();
            if let Err(e) = persisted {
                return Err(ClientError::Other(e));
            }
            if defer_persist {
                self.ack_then_persist(conv, "sync", stored).await;
                if self.lock().dead {
                    return Err(ClientError::Disconnected);
                }
            }
            if complete {
                return Ok(());
            }
            match last {
                Some(l) if l > after => after = l,
                _ => {
                    self.lock().stats.sync_errors += 1;
                    return Err(ClientError::Other(anyhow!(
                        "sync of {conv} after {after} made no progress and is not complete"
                    )));
                }
            }
        }
        Err(ClientError::Other(anyhow!(
            "sync of {conv} did not complete within {SYNC_PAGES_MAX} pages"
        )))
    }

    /// Acks the cursor of `conv` now if it is above what the server has.
    /// Never acks beyond the cursor, never while the state file is behind memory.
    async fn auto_ack(&self, conv: &str) {
        let (target, counted, opts) = {
            let mut st = self.lock();
            if !st.opts.auto_ack {
                return;
            }
            if st.dirty && self.persist(&mut st).is_err() {
                return;
            }
            let cursor = st.cursor(conv);
            let opts = st.opts;
            let t = st.ack_track(conv);
            if cursor <= t.acked {
                t.due_at = None;
                return;
            }
            (cursor, t.new_since_ack, opts)
        };
        let r = self
            .send_ack(conv, target, opts.request_timeout, false)
            .await;
        {
            let mut st = self.lock();
            st.auto_acks_done += 1;
            let n = st.auto_acks_done;
            if self.crash_point(&mut st, CrashAt::AfterAck(n)) {
                return;
            }
            let cursor = st.cursor(conv);
            let t = st.ack_track(conv);
            match &r {
                Ok(_) => {
                    t.new_since_ack = t.new_since_ack.saturating_sub(counted);
                    t.due_at = (cursor > t.acked).then(|| Instant::now() + opts.ack_after);
                }
                Err(e) => {
                    tracing::debug!(conv, seq = target, error = %e, "automatic ack failed");
                    t.due_at = e
                        .is_retryable()
                        .then(|| Instant::now() + opts.ack_after.max(ACK_RETRY_MIN));
                }
            }
        }
        self.notify();
    }

    /// After new events for `conv`: arm the ack timer, or ack now if enough piled up.
    async fn maybe_ack(&self, conv: &str) {
        let now = {
            let mut st = self.lock();
            if !st.opts.auto_ack {
                return;
            }
            let opts = st.opts;
            let cursor = st.cursor(conv);
            let t = st.ack_track(conv);
            if cursor <= t.acked {
                return;
            }
            if t.due_at.is_none() {
                t.due_at = Some(Instant::now() + opts.ack_after);
            }
            t.new_since_ack >= opts.ack_every.max(1)
        };
        if now {
            self.auto_ack(conv).await;
        }
    }

    fn next_ack_deadline(&self) -> Option<Instant> {
        let st = self.lock();
        if !st.opts.auto_ack {
            return None;
        }
        st.acks.values().filter_map(|t| t.due_at).min()
    }

    async fn flush_due_acks(&self) {
        let now = Instant::now();
        let due: Vec<String> = {
            let st = self.lock();
            st.acks
                .iter()
                .filter(|(_, t)| t.due_at.is_some_and(|d| d <= now))
                .map(|(c, _)| c.clone())
                .collect()
        };
        for conv in due {
            self.auto_ack(&conv).await;
        }
    }

    /// Applies one `event` push (SPEC section 5: contiguous cursor, duplicates, gaps).
    async fn on_event_push(&self, frame: &Value) {
        let ev = frame.get("ev");
        let parsed =
            ev.and_then(|ev| Some((field_str(ev, "conv")?.to_string(), field_i64(ev, "seq")?)));
        let (Some(ev), Some((conv, seq))) = (ev, parsed) else {
            let mut st = self.lock();
            st.stats.pushes_received += 1;
            st.stats.malformed_frames += 1;
            return;
        };
        let mut deferred = None;
        let gap_from = {
            let mut st = self.lock();
            let st = &mut *st;
            st.stats.pushes_received += 1;
            let cursor_max = st.bug(bugs::CURSOR_MAX);
            let c = st.file.convs.entry(conv.clone()).or_default();
            let gap_from = if seq <= c.cursor || c.events.contains_key(&seq) {
                st.stats.duplicates_ignored += 1;
                None
            } else {
                c.events.insert(seq, ev.clone());
                st.stats.pushes_applied += 1;
                let gap = if cursor_max {
                    // The `cursor-max` bug: jump to the highest seq seen, never sync a gap.
                    c.cursor = c.cursor.max(seq);
                    None
                } else if Some(seq) == c.cursor.checked_add(1) {
                    advance_contiguous(c);
                    None
                } else {
                    st.stats.gaps_detected += 1;
                    Some(c.cursor)
                };
                let cursor = c.cursor;
                st.ack_track(&conv).new_since_ack += 1;
                let stored = vec![(seq, ev.get("mid").cloned().unwrap_or(Value::Null))];
                if st.bug(bugs::ACK_BEFORE_PERSIST) {
                    deferred = Some(stored);
                } else if self.persist(st).is_ok() {
                    self.rec_store(&conv, "push", &stored, cursor);
                }
                // A failed write is counted and blocks acks until a later write succeeds.
                gap
            };
            gap_from
        };
        self.notify();
        if let Some(stored) = deferred {
            self.ack_then_persist(&conv, "push", stored).await;
        }
        if let Some(from) = gap_from {
            if let Err(e) = self.sync_until_complete(&conv, from).await {
                tracing::debug!(conv, error = %e, "gap repair sync failed; waiting for a hint");
            }
        }
        self.maybe_ack(&conv).await;
    }

    /// Applies one `hint` push: sync when the server is ahead, then ack right away
    /// (the sweep hints only devices whose delivered cursor is below head). This is
    /// the client's half of D5: a lost push or a lost ack is repaired by the next hint.
    async fn on_hint(&self, frame: &Value) {
        let (Some(conv), Some(head)) = (field_str(frame, "conv"), field_i64(frame, "head")) else {
            self.lock().stats.malformed_frames += 1;
            return;
        };
        let why = field_str(frame, "why").unwrap_or("").to_string();
        let cursor = {
            let mut st = self.lock();
            *st.stats.hints_received.entry(why).or_insert(0) += 1;
            st.note_head(conv, head);
            // A hint means the server's delivered cursor is below `head`: whatever we
            // believed it had (an ack lost with a crashed database, say), ack again.
            let t = st.ack_track(conv);
            t.acked = t.acked.min(head.saturating_sub(1));
            st.cursor(conv)
        };
        self.notify();
        if head > cursor {
            if let Err(e) = self.sync_until_complete(conv, cursor).await {
                tracing::debug!(conv, error = %e, "hint sync failed; waiting for the next hint");
            }
        }
        self.auto_ack(conv).await;
    }

    /// Called by the reader for every text frame: record it, route replies to their
    /// request, queue pushes for the pump.
    fn on_text(&self, text: &str, pushes: &mpsc::Sender<Value>) {
        let (v, parsed) = match serde_json::from_str::<Value>(text) {
            Ok(v) => (v, true),
            Err(_) => (json!({"t": "_nonjson", "raw": text}), false),
        };
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
                self.rec_push(&v);
            }
            if waiting.is_none() && matches!(field_str(&v, "t"), Some("event" | "hint")) {
                if let Err(mpsc::error::TrySendError::Full(_)) = pushes.try_send(v.clone()) {
                    st.stats.pushes_overflowed += 1;
                }
            }
            waiting
        };
        if let Some(p) = route {
            let _ = p.tx.send(Ok(v));
        }
        self.notify();
    }

    /// Records a received `event` (and probes it, D1) or `hint` in the history.
    fn rec_push(&self, v: &Value) {
        match field_str(v, "t") {
            Some("event") => {
                let ev = v.get("ev").cloned().unwrap_or(Value::Null);
                let line = self.rec(Type::Recv, "push", None, event_summary(&ev));
                if let (Some(h), Some(i)) = (&self.hist, line) {
                    if let (Some(conv), Some(seq), Some(mid)) = (
                        field_str(&ev, "conv"),
                        field_i64(&ev, "seq"),
                        field_str(&ev, "mid"),
                    ) {
                        h.probe(i, conv, seq, mid);
                    }
                }
            }
            Some("hint") => {
                self.rec(
                    Type::Recv,
                    "hint",
                    None,
                    json!({"conv": v.get("conv"), "head": v.get("head"), "why": v.get("why")}),
                );
            }
            _ => {}
        }
    }

    fn record_frame(&self, v: Value) {
        {
            let mut st = self.lock();
            let max = st.opts.frames_max;
            push_bounded(&mut st.frames, max, v);
        }
        self.notify();
    }

    /// The connection `conn_id` is gone: fail its pending requests with `Disconnected`.
    fn on_disconnect(&self, conn_id: u64) {
        let failed: Vec<Pending> = {
            let mut st = self.lock();
            if st.conn.as_ref().is_some_and(|l| l.id == conn_id) {
                st.conn = None;
                st.subscribed = false;
                if !st.dead {
                    self.rec(Type::Client, "disconnect", None, json!({}));
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
    pushes: mpsc::Sender<Value>,
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

/// Applies pushes one at a time and sends coalesced acks when their timer is due.
async fn pump(inner: Arc<Inner>, mut pushes: mpsc::Receiver<Value>) {
    loop {
        let next = match inner.next_ack_deadline() {
            Some(at) => tokio::select! {
                p = pushes.recv() => p,
                () = tokio::time::sleep_until(at.into()) => {
                    inner.flush_due_acks().await;
                    continue;
                }
            },
            None => pushes.recv().await,
        };
        let Some(frame) = next else { break };
        match field_str(&frame, "t") {
            Some("event") => inner.on_event_push(&frame).await,
            Some("hint") => inner.on_hint(&frame).await,
            _ => {}
        }
    }
}

struct ConnTasks {
    conn_id: u64,
    reader: JoinHandle<()>,
    writer: JoinHandle<()>,
    pump: JoinHandle<()>,
}

impl ConnTasks {
    fn abort(&self) {
        self.reader.abort();
        self.writer.abort();
        self.pump.abort();
    }
}

/// One device: a state file plus at most one live connection. See the module doc.
pub struct Client {
    inner: Arc<Inner>,
    tasks: Option<ConnTasks>,
}

impl Client {
    /// Creates a new state file for `device` (refuses to overwrite an existing one).
    pub fn create(
        state_path: &Path,
        device: &str,
        token: &str,
        epoch: i64,
    ) -> anyhow::Result<Client> {
        if state_path.exists() {
            bail!(
                "client state file {} already exists; use Client::load",
                state_path.display()
            );
        }
        let file = StateFile {
            version: STATE_VERSION,
            device: device.to_string(),
            token: token.to_string(),
            epoch,
            outbox: Vec::new(),
            convs: BTreeMap::new(),
        };
        let client = Client::from_file(state_path, file)?;
        client.inner.rec(Type::Client, "create", None, json!({}));
        {
            let mut st = client.inner.lock();
            client
                .inner
                .persist(&mut st)
                .context("create client state file")?;
        }
        Ok(client)
    }

    /// Builds a client from an existing state file (a restarted device).
    pub fn load(state_path: &Path) -> anyhow::Result<Client> {
        let bytes =
            std::fs::read(state_path).with_context(|| format!("read {}", state_path.display()))?;
        let file: StateFile = serde_json::from_slice(&bytes)
            .with_context(|| format!("parse client state {}", state_path.display()))?;
        if file.version != STATE_VERSION {
            bail!(
                "client state {} has version {}, expected {STATE_VERSION}",
                state_path.display(),
                file.version
            );
        }
        let client = Client::from_file(state_path, file)?;
        client.inner.rec(Type::Client, "restart", None, json!({}));
        Ok(client)
    }

    /// The events a state file holds, as the judge reads it at the end of a scenario:
    /// `(device, conv -> [(seq, mid)])`.
    pub fn read_store(state_path: &Path) -> anyhow::Result<(String, StoredEvents)> {
        let bytes =
            std::fs::read(state_path).with_context(|| format!("read {}", state_path.display()))?;
        let file: StateFile = serde_json::from_slice(&bytes)
            .with_context(|| format!("parse client state {}", state_path.display()))?;
        let convs = file
            .convs
            .iter()
            .map(|(conv, c)| {
                let evs = c
                    .events
                    .iter()
                    .map(|(seq, ev)| (*seq, field_str(ev, "mid").unwrap_or("").to_string()))
                    .collect();
                (conv.clone(), evs)
            })
            .collect();
        Ok((file.device, convs))
    }

    /// Records into the process's current history (`crate::history::current`), if any.
    fn from_file(state_path: &Path, file: StateFile) -> anyhow::Result<Client> {
        let (changed, _) = watch::channel(0);
        let hist = crate::history::current();
        let device = file.device.clone();
        let instance = hist.as_ref().map_or(0, |h| h.next_instance(&device));
        Ok(Client {
            inner: Arc::new(Inner {
                state_path: state_path.to_path_buf(),
                tmp_path: tmp_path_for(state_path)?,
                next_rid: AtomicU64::new(0),
                st: Mutex::new(State::new(file)),
                changed,
                hist,
                device,
                instance,
            }),
            tasks: None,
        })
    }

    /// True once a crash point (`ClientOptions::crash_at`) fired: the scenario should
    /// `crash()` this instance and `load` a new one.
    pub fn is_dead(&self) -> bool {
        self.inner.lock().dead
    }

    pub fn with_options(self, o: ClientOptions) -> Self {
        self.inner.lock().opts = o;
        self
    }

    pub fn options(&self) -> ClientOptions {
        self.inner.opts()
    }

    pub fn state_path(&self) -> &Path {
        &self.inner.state_path
    }

    pub fn device(&self) -> String {
        self.inner.lock().file.device.clone()
    }

    /// Opens the WebSocket and says `hello{device,token,epoch}`; returns `welcome`.
    /// An open connection is dropped first (like `crash`).
    pub async fn connect(&mut self, ws_url: &str) -> Result<Value, ClientError> {
        self.connect_raw(ws_url).await?;
        let (hello, timeout) = {
            let st = self.inner.lock();
            let f = &st.file;
            (
                json!({"t": "hello", "device": f.device, "token": f.token, "epoch": f.epoch}),
                st.opts.request_timeout,
            )
        };
        self.inner.request(hello, timeout).await
    }

    /// Opens the WebSocket only (no hello) and starts the reader, writer and pump.
    pub async fn connect_raw(&mut self, ws_url: &str) -> anyhow::Result<()> {
        self.drop_connection().await;
        let timeout = self.inner.opts().request_timeout;
        let op_id = self.inner.hist.as_ref().map(History::next_op_id);
        self.inner
            .rec(Type::Invoke, "connect", op_id, json!({"url": ws_url}));
        let r = tokio::time::timeout(
            timeout,
            tokio_tungstenite::connect_async_with_config(ws_url, None, true),
        )
        .await
        .map_err(|_| anyhow!("WebSocket connect to {ws_url} timed out after {timeout:?}"))
        .and_then(|r| r.with_context(|| format!("WebSocket connect to {ws_url}")));
        let (ws, _response) = match r {
            Ok(x) => {
                self.inner.rec(Type::Ok, "connect", op_id, json!({}));
                x
            }
            Err(e) => {
                self.inner.rec(
                    Type::Fail,
                    "connect",
                    op_id,
                    json!({"msg": format!("{e:#}")}),
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
            pump: tokio::spawn(pump(self.inner.clone(), push_rx)),
        });
        self.inner.notify();
        Ok(())
    }

    /// Sends `frame` (a JSON object) with a fresh `rid`; `Ok` is the success reply,
    /// an `error` reply is `Err(ClientError::Server{..})`.
    pub async fn request(&self, frame: Value, timeout: Duration) -> Result<Value, ClientError> {
        self.inner.request(frame, timeout).await
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

    /// Sends a message through the outbox: the entry is persisted before the first
    /// frame, removed on `sent` or a terminal error, kept otherwise (timeout,
    /// disconnect, `UNAVAILABLE`, `INTERNAL`) for `replay_outbox`.
    pub async fn send(
        &self,
        conv: &str,
        cmid: &str,
        body: &str,
        timeout: Duration,
    ) -> Result<Value, ClientError> {
        let entry = OutboxEntry {
            conv: conv.to_string(),
            cmid: cmid.to_string(),
            body: body.to_string(),
        };
        {
            let mut st = self.inner.lock();
            if !st.file.outbox.contains(&entry) {
                st.file.outbox.push(entry.clone());
            }
            self.inner
                .persist(&mut st)
                .context("persist outbox before send")?;
        }
        self.inner.notify();
        self.send_entry(&entry, timeout).await
    }

    async fn send_entry(
        &self,
        entry: &OutboxEntry,
        timeout: Duration,
    ) -> Result<Value, ClientError> {
        let frame =
            json!({"t": "send", "conv": entry.conv, "cmid": entry.cmid, "body": entry.body});
        let r = match self.inner.request(frame, timeout).await {
            Ok(reply) if field_str(&reply, "t") != Some("sent") => Err(ClientError::Other(
                anyhow!("unexpected reply to send: {reply}"),
            )),
            r => r,
        };
        let done = match &r {
            Ok(_) => true,
            Err(e) => e.is_terminal_for_send(),
        };
        if done {
            {
                let mut st = self.inner.lock();
                st.file.outbox.retain(|e| e != entry);
                self.inner
                    .persist(&mut st)
                    .context("persist outbox after reply")?;
            }
            self.inner.notify();
        }
        r
    }

    /// Resends every outbox entry, in order, with its original `cmid`.
    pub async fn replay_outbox(&self, timeout: Duration) -> Vec<Result<Value, ClientError>> {
        let mut results = Vec::new();
        for entry in self.outbox() {
            results.push(self.send_entry(&entry, timeout).await);
        }
        results
    }

    pub fn outbox(&self) -> Vec<OutboxEntry> {
        self.inner.lock().file.outbox.clone()
    }

    /// An explicit ack of `seq` (not clamped to the cursor: protocol tests may ack
    /// beyond head on purpose). Records the reported `delivered`.
    pub async fn ack(&self, conv: &str, seq: i64, timeout: Duration) -> Result<Value, ClientError> {
        self.inner.send_ack(conv, seq, timeout, true).await
    }

    /// Subscribes. For every conversation whose server `delivered` is below head, syncs
    /// from `min(cursor, delivered)` until complete (duplicates are deduped by seq), then
    /// acks the cursor where it is above `delivered` (unless `auto_ack` is off).
    pub async fn sub(&self) -> Result<Value, ClientError> {
        let opts = self.inner.opts();
        let reply = self
            .inner
            .request(json!({"t": "sub"}), opts.request_timeout)
            .await?;
        let mut convs = Vec::new();
        for c in reply
            .get("convs")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default()
        {
            match (
                field_str(c, "conv"),
                field_i64(c, "head"),
                field_i64(c, "delivered"),
            ) {
                (Some(conv), Some(head), Some(delivered)) => {
                    convs.push((conv.to_string(), head, delivered))
                }
                _ => {
                    self.inner.lock().stats.malformed_frames += 1;
                    return Err(ClientError::Other(anyhow!(
                        "malformed subbed reply: {reply}"
                    )));
                }
            }
        }
        {
            let mut st = self.inner.lock();
            st.subscribed = true;
            for (conv, head, delivered) in &convs {
                st.note_head(conv, *head);
                st.record_delivered(conv, *delivered);
                st.ack_track(conv).acked = *delivered;
            }
            self.inner
                .persist(&mut st)
                .context("persist subbed cursors")?;
        }
        self.inner.notify();
        for (conv, head, delivered) in &convs {
            if delivered < head {
                let from = self.cursor(conv).min(*delivered);
                self.inner.sync_until_complete(conv, from).await?;
            }
            if opts.auto_ack {
                let cursor = self.cursor(conv);
                if cursor > *delivered {
                    self.inner
                        .send_ack(conv, cursor, opts.request_timeout, false)
                        .await?;
                }
            }
        }
        Ok(reply)
    }

    /// One raw `sync` request; stores nothing, moves nothing.
    pub async fn sync_once(
        &self,
        conv: &str,
        after: i64,
        limit: i64,
        timeout: Duration,
    ) -> Result<Value, ClientError> {
        self.inner
            .request(
                json!({"t": "sync", "conv": conv, "after": after, "limit": limit}),
                timeout,
            )
            .await
    }

    /// Highest seq through which every visible event is stored (0 if none).
    pub fn cursor(&self, conv: &str) -> i64 {
        self.inner.lock().cursor(conv)
    }

    /// Last `delivered` the server reported for this device and `conv`.
    pub fn server_delivered(&self, conv: &str) -> Option<i64> {
        self.inner
            .lock()
            .file
            .convs
            .get(conv)
            .and_then(|c| c.server_delivered)
    }

    /// Highest head the server reported for `conv` (subbed, synced, hint).
    pub fn head_seen(&self, conv: &str) -> Option<i64> {
        self.inner.lock().heads.get(conv).copied()
    }

    /// Stored events of `conv` (`ev` objects), ascending by seq.
    pub fn stored(&self, conv: &str) -> Vec<Value> {
        self.inner
            .lock()
            .file
            .convs
            .get(conv)
            .map(|c| c.events.values().cloned().collect())
            .unwrap_or_default()
    }

    pub fn stored_seqs(&self, conv: &str) -> Vec<i64> {
        self.inner
            .lock()
            .file
            .convs
            .get(conv)
            .map(|c| c.events.keys().copied().collect())
            .unwrap_or_default()
    }

    /// Conversations the client has any state for.
    pub fn convs(&self) -> Vec<String> {
        self.inner.lock().file.convs.keys().cloned().collect()
    }

    pub fn stats(&self) -> ClientStats {
        self.inner.lock().stats.clone()
    }

    /// Received frames with arrival times, oldest first (bounded by `frames_max`).
    /// Besides JSON frames: `{"t":"_close","code","reason"}` for a close frame,
    /// `{"t":"_nonjson","raw"}` and `{"t":"_binary","len"}`.
    pub fn frames(&self) -> Vec<(Instant, Value)> {
        self.inner.lock().frames.iter().cloned().collect()
    }

    /// Frames this client sent (requests with their `rid`; raw text as a JSON string).
    pub fn sent_frames(&self) -> Vec<(Instant, Value)> {
        self.inner.lock().sent_frames.iter().cloned().collect()
    }

    /// Waits until `f` holds, re-checking after every change of the client's state,
    /// until `within` passed. Returns the time waited.
    pub async fn wait_for<F: Fn(&Client) -> bool>(
        &self,
        what: &str,
        within: Duration,
        f: F,
    ) -> anyhow::Result<Duration> {
        let start = Instant::now();
        let deadline = tokio::time::Instant::now() + within;
        let mut changes = self.inner.changed.subscribe();
        loop {
            if f(self) {
                return Ok(start.elapsed());
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => bail!("client state channel closed while waiting for {what}"),
                Err(_) => {
                    if f(self) {
                        return Ok(start.elapsed());
                    }
                    bail!(
                        "timed out after {within:?} waiting for {what} (connected: {}, stats: {:?})",
                        self.is_connected(),
                        self.stats()
                    );
                }
            }
        }
    }

    pub async fn wait_cursor(
        &self,
        conv: &str,
        at_least: i64,
        within: Duration,
    ) -> anyhow::Result<Duration> {
        self.wait_for(&format!("cursor of {conv} >= {at_least}"), within, |c| {
            c.cursor(conv) >= at_least
        })
        .await
    }

    pub async fn wait_server_delivered(
        &self,
        conv: &str,
        at_least: i64,
        within: Duration,
    ) -> anyhow::Result<Duration> {
        self.wait_for(
            &format!("server delivered of {conv} >= {at_least}"),
            within,
            |c| c.server_delivered(conv).is_some_and(|d| d >= at_least),
        )
        .await
    }

    /// Waits until the connection is closed (by the server, or broken).
    pub async fn wait_closed(&self, within: Duration) -> anyhow::Result<()> {
        self.wait_for("the connection to close", within, |c| !c.is_connected())
            .await
            .map(|_| ())
    }

    pub fn is_connected(&self) -> bool {
        self.inner.lock().conn.is_some()
    }

    /// True after a successful `sub` on the current connection.
    pub fn is_subscribed(&self) -> bool {
        self.inner.lock().subscribed
    }

    /// Aborts the connection tasks and drops the socket: no close frame, no pending
    /// ack. The state file stays as it was; `Client::load` models the restart.
    pub async fn crash(mut self) {
        self.inner.lock().dead = true;
        self.inner.rec(Type::Client, "crash", None, json!({}));
        self.drop_connection().await;
    }

    /// Graceful close: sends the acks that are still coalescing, then a close frame,
    /// and waits (bounded) for the server to finish the close handshake.
    pub async fn close(mut self) {
        let opts = self.inner.opts();
        if self.is_connected() {
            if opts.auto_ack {
                for conv in self.convs() {
                    self.inner.auto_ack(&conv).await;
                }
            }
            let out = self.inner.lock().conn.as_ref().map(|l| l.out.clone());
            if let Some(out) = out {
                let bye = Message::Close(Some(CloseFrame {
                    code: CloseCode::Normal,
                    reason: "bye".into(),
                }));
                if out.send(bye).await.is_ok() {
                    if let Err(e) = self.wait_closed(opts.request_timeout).await {
                        tracing::debug!(error = %format!("{e:#}"), "server did not finish the close handshake");
                    }
                }
            }
        }
        self.drop_connection().await;
    }

    /// Aborts the tasks of the current connection (if any) and waits for them, so the
    /// socket is closed when this returns.
    async fn drop_connection(&mut self) {
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

impl Drop for Client {
    fn drop(&mut self) {
        if let Some(tasks) = self.tasks.take() {
            tasks.abort();
            self.inner.on_disconnect(tasks.conn_id);
        }
    }
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("state_path", &self.inner.state_path)
            .field("connected", &self.is_connected())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    //! These tests run against tiny in-process WebSocket servers that play the
    //! gateway's part of the protocol, so they need neither PostgreSQL nor the binary.

    use super::*;
    use tokio::net::TcpListener;

    const WAIT: Duration = Duration::from_secs(5);

    type Responder = Arc<dyn Fn(&Value) -> Vec<Value> + Send + Sync>;

    /// A fake gateway: answers each frame with `responder`, pushes what the test
    /// sends on `push`, and reports every received frame (plus `_eof{saw_close}` when
    /// a connection ends) on `got`. Connections are served one after the other.
    struct Fake {
        url: String,
        got: mpsc::UnboundedReceiver<(Instant, Value)>,
        push: mpsc::UnboundedSender<Value>,
        task: JoinHandle<()>,
    }

    impl Drop for Fake {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    async fn fake(responder: Responder) -> anyhow::Result<Fake> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (got_tx, got) = mpsc::unbounded_channel();
        let (push, mut push_rx) = mpsc::unbounded_channel::<Value>();
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let _ = tcp.set_nodelay(true);
                let Ok(ws) = tokio_tungstenite::accept_async(tcp).await else {
                    continue;
                };
                let (mut sink, mut stream) = ws.split();
                let mut saw_close = false;
                loop {
                    tokio::select! {
                        m = stream.next() => match m {
                            Some(Ok(Message::Text(t))) => {
                                let v: Value = serde_json::from_str(t.as_str()).unwrap_or(Value::Null);
                                let _ = got_tx.send((Instant::now(), v.clone()));
                                for r in responder(&v) {
                                    let m = if r.get("_close").is_some() { Message::Close(None) } else { Message::text(r.to_string()) };
                                    let _ = sink.send(m).await;
                                }
                            }
                            Some(Ok(Message::Close(_))) => saw_close = true,
                            Some(Ok(_)) => {}
                            Some(Err(_)) | None => break,
                        },
                        p = push_rx.recv() => match p {
                            Some(p) => { let _ = sink.send(Message::text(p.to_string())).await; }
                            None => break,
                        },
                    }
                }
                let _ = got_tx.send((Instant::now(), json!({"t": "_eof", "saw_close": saw_close})));
            }
        });
        Ok(Fake {
            url: format!("ws://{addr}/ws"),
            got,
            push,
            task,
        })
    }

    /// A reply to `req` of type `t` with the fields of `extra`, echoing the rid.
    fn reply(req: &Value, t: &str, extra: Value) -> Value {
        let mut r = if extra.is_object() { extra } else { json!({}) };
        r["t"] = json!(t);
        r["rid"] = req.get("rid").cloned().unwrap_or(Value::Null);
        r
    }

    /// The common part of the fake gateway: welcome, acked (delivered = seq), and
    /// `other` for everything else.
    fn responder(other: impl Fn(&Value) -> Vec<Value> + Send + Sync + 'static) -> Responder {
        Arc::new(move |req: &Value| match field_str(req, "t") {
            Some("hello") => vec![reply(
                req,
                "welcome",
                json!({"user": "u1", "device": req["device"], "epoch": req["epoch"]}),
            )],
            Some("ack") => vec![reply(
                req,
                "acked",
                json!({"conv": req["conv"], "delivered": req["seq"]}),
            )],
            _ => other(req),
        })
    }

    fn ev(conv: &str, seq: i64) -> Value {
        json!({"conv": conv, "seq": seq, "kind": "msg", "mid": format!("m{seq}"), "sender": "u2",
               "cmid": format!("x{seq}"), "body": format!("b{seq}"), "at": "2025-01-01T00:00:00Z"})
    }

    fn push_ev(conv: &str, seq: i64) -> Value {
        json!({"t": "event", "ev": ev(conv, seq)})
    }

    /// Next frame the fake received that matches `pred`, within `within`.
    async fn expect(
        got: &mut mpsc::UnboundedReceiver<(Instant, Value)>,
        within: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> anyhow::Result<(Instant, Value)> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, got.recv()).await {
                Ok(Some((at, v))) if pred(&v) => return Ok((at, v)),
                Ok(Some(_)) => {}
                Ok(None) => bail!("fake server stopped"),
                Err(_) => bail!("no matching frame within {within:?}"),
            }
        }
    }

    /// Fails if a frame matching `pred` arrives within `within` (a bounded negative check).
    async fn expect_none(
        got: &mut mpsc::UnboundedReceiver<(Instant, Value)>,
        within: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> anyhow::Result<()> {
        match expect(got, within, pred).await {
            Ok((_, v)) => bail!("unexpected frame {v}"),
            Err(_) => Ok(()),
        }
    }

    fn is(t: &'static str) -> impl Fn(&Value) -> bool {
        move |v| field_str(v, "t") == Some(t)
    }

    /// A temporary directory removed on drop.
    struct TestDir(PathBuf);

    impl TestDir {
        fn new(name: &str) -> anyhow::Result<TestDir> {
            static N: AtomicU64 = AtomicU64::new(0);
            let p = std::env::temp_dir().join(format!(
                "imfault-client-{name}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p)?;
            Ok(TestDir(p))
        }
        fn state(&self) -> PathBuf {
            self.0.join("state.json")
        }
    }

    impl Drop for TestDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn outbox_on_disk(path: &Path) -> anyhow::Result<Vec<OutboxEntry>> {
        let file: StateFile = serde_json::from_slice(&std::fs::read(path)?)?;
        Ok(file.outbox)
    }

    /// Proves the outbox is on disk before the first send frame leaves, survives a
    /// crash and `load`, and is cleared by a replay with the same cmid: server 1 checks
    /// the state file when the send arrives and never answers, server 2 answers `sent`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn outbox_persisted_before_send_and_replayed_after_load() -> anyhow::Result<()> {
        let dir = TestDir::new("outbox")?;
        let path = dir.state();
        let seen_on_disk: Arc<Mutex<Option<Vec<OutboxEntry>>>> = Arc::default();
        let (p, seen) = (path.clone(), seen_on_disk.clone());
        let mut s1 = fake(responder(move |req| {
            if field_str(req, "t") == Some("send") {
                *seen.lock().unwrap_or_else(PoisonError::into_inner) = outbox_on_disk(&p).ok();
            }
            vec![]
        }))
        .await?;

        let mut c = Client::create(&path, "d1", "tok1", 1)?;
        let welcome = c.connect(&s1.url).await?;
        assert_eq!(field_str(&welcome, "t"), Some("welcome"));
        let (_, hello) = expect(&mut s1.got, WAIT, is("hello")).await?;
        assert_eq!(
            hello,
            json!({"t": "hello", "rid": "c1", "device": "d1", "token": "tok1", "epoch": 1})
        );

        let r = c
            .send("conv1", "cm-1", "hi", Duration::from_millis(200))
            .await;
        assert!(matches!(r, Err(ClientError::Timeout)), "{r:?}");
        let entry = OutboxEntry {
            conv: "conv1".into(),
            cmid: "cm-1".into(),
            body: "hi".into(),
        };
        let (_, send) = expect(&mut s1.got, WAIT, is("send")).await?;
        assert_eq!(field_str(&send, "rid"), Some("c2"));
        assert_eq!(
            *seen_on_disk.lock().unwrap_or_else(PoisonError::into_inner),
            Some(vec![entry.clone()])
        );
        assert_eq!(c.outbox(), vec![entry.clone()]);
        c.crash().await;
        let (_, eof) = expect(&mut s1.got, WAIT, is("_eof")).await?;
        assert_eq!(
            eof["saw_close"],
            json!(false),
            "crash must not send a close frame"
        );

        let mut s2 = fake(responder(|req| match field_str(req, "t") {
            Some("send") => {
                vec![reply(
                    req,
                    "sent",
                    json!({"conv": req["conv"], "seq": 1, "mid": "mid-1", "dup": true, "epoch": 1}),
                )]
            }
            _ => vec![],
        }))
        .await?;
        let mut c2 = Client::load(&path)?;
        assert_eq!(c2.outbox(), vec![entry.clone()]);
        c2.connect(&s2.url).await?;
        let results = c2.replay_outbox(WAIT).await;
        assert_eq!(results.len(), 1);
        let sent = results
            .into_iter()
            .next()
            .ok_or_else(|| anyhow!("no result"))??;
        assert_eq!(sent["dup"], json!(true));
        let (_, resend) = expect(&mut s2.got, WAIT, is("send")).await?;
        assert_eq!(
            (
                resend["conv"].clone(),
                resend["cmid"].clone(),
                resend["body"].clone()
            ),
            (json!("conv1"), json!("cm-1"), json!("hi"))
        );
        assert!(c2.outbox().is_empty());
        assert!(outbox_on_disk(&path)?.is_empty());
        c2.close().await;
        let (_, eof) = expect(&mut s2.got, WAIT, is("_eof")).await?;
        assert_eq!(
            eof["saw_close"],
            json!(true),
            "close must send a close frame"
        );
        Ok(())
    }

    /// Proves which send errors end an outbox entry: terminal codes remove it,
    /// UNAVAILABLE and a disconnect keep it, and pending requests fail with
    /// Disconnected when the server closes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn send_errors_terminal_or_kept() -> anyhow::Result<()> {
        let dir = TestDir::new("senderr")?;
        let s = fake(responder(|req| {
            let err = |code: &str| vec![reply(req, "error", json!({"code": code, "msg": "no"}))];
            match field_str(req, "cmid") {
                Some("conflict") => err("CMID_CONFLICT"),
                Some("notmember") => err("NOT_MEMBER"),
                Some("unavailable") => err("UNAVAILABLE"),
                Some("close") => vec![json!({"_close": true})],
                _ => vec![],
            }
        }))
        .await?;
        let mut c = Client::create(&dir.state(), "d1", "t", 1)?;
        c.connect(&s.url).await?;
        let r = c.send("a", "conflict", "x", WAIT).await;
        assert_eq!(
            r.as_ref().err().and_then(ClientError::code),
            Some("CMID_CONFLICT")
        );
        let r = c.send("a", "notmember", "x", WAIT).await;
        assert_eq!(
            r.as_ref().err().and_then(ClientError::code),
            Some("NOT_MEMBER")
        );
        let r = c.send("a", "unavailable", "x", WAIT).await;
        assert_eq!(
            r.as_ref().err().and_then(ClientError::code),
            Some("UNAVAILABLE")
        );
        let r = c.send("a", "close", "x", WAIT).await;
        assert!(matches!(r, Err(ClientError::Disconnected)), "{r:?}");
        c.wait_closed(WAIT).await?;
        assert!(!c.is_connected());
        let cmids: Vec<String> = c.outbox().into_iter().map(|e| e.cmid).collect();
        assert_eq!(cmids, vec!["unavailable", "close"]);
        assert_eq!(outbox_on_disk(&dir.state())?.len(), 2);
        let r = c.request(json!({"t": "sub"}), WAIT).await;
        assert!(matches!(r, Err(ClientError::Disconnected)), "{r:?}");
        Ok(())
    }

    /// Proves the event store and cursor survive a crash and `load`, that
    /// `auto_ack: false` stores without acking, and that a restarted client's `sub`
    /// syncs from the server's delivered, dedupes by seq, treats invisible seqs as no
    /// holes (cursor jumps to head on `complete`) and acks its cursor.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn store_survives_restart_and_sub_dedupes() -> anyhow::Result<()> {
        let dir = TestDir::new("store")?;
        let path = dir.state();
        let mut s1 = fake(responder(|req| match field_str(req, "t") {
            Some("sub") => vec![reply(
                req,
                "subbed",
                json!({"convs": [{"conv": "a", "head": 0, "delivered": 0}]}),
            )],
            _ => vec![],
        }))
        .await?;
        let opts = ClientOptions {
            auto_ack: false,
            ..ClientOptions::default()
        };
        let mut c = Client::create(&path, "d1", "t", 1)?.with_options(opts);
        c.connect(&s1.url).await?;
        c.sub().await?;
        assert!(c.is_subscribed());
        s1.push.send(push_ev("a", 1))?;
        s1.push.send(push_ev("a", 2))?;
        c.wait_cursor("a", 2, WAIT).await?;
        c.crash().await;
        expect(&mut s1.got, WAIT, is("_eof")).await?;
        // Nothing in the channel is an ack: the client stored without acking.
        while let Ok((_, v)) = s1.got.try_recv() {
            assert_ne!(field_str(&v, "t"), Some("ack"), "{v}");
        }

        let c2 = Client::load(&path)?;
        assert_eq!(c2.cursor("a"), 2);
        assert_eq!(c2.stored_seqs("a"), vec![1, 2]);
        assert_eq!(c2.stored("a")[1]["body"], json!("b2"));
        assert_eq!(c2.server_delivered("a"), Some(0));

        // Server 2: head 5, delivered 0; seqs 3 and 5 are not visible to this user.
        let mut s2 = fake(responder(|req| match field_str(req, "t") {
            Some("sub") => vec![reply(
                req,
                "subbed",
                json!({"convs": [{"conv": "a", "head": 5, "delivered": 0}]}),
            )],
            Some("sync") => {
                let after = field_i64(req, "after").unwrap_or(0);
                let events: Vec<Value> = [1, 2, 4]
                    .iter()
                    .filter(|s| **s > after)
                    .map(|s| ev("a", *s))
                    .collect();
                vec![reply(
                    req,
                    "synced",
                    json!({"conv": "a", "events": events, "head": 5, "complete": true}),
                )]
            }
            _ => vec![],
        }))
        .await?;
        let mut c2 = c2;
        c2.connect(&s2.url).await?;
        c2.sub().await?;
        let (_, sync) = expect(&mut s2.got, WAIT, is("sync")).await?;
        assert_eq!(sync["after"], json!(0));
        let (_, ack) = expect(&mut s2.got, WAIT, is("ack")).await?;
        assert_eq!(ack["seq"], json!(5));
        assert_eq!(c2.cursor("a"), 5);
        assert_eq!(c2.stored_seqs("a"), vec![1, 2, 4]);
        assert_eq!(c2.server_delivered("a"), Some(5));
        let st = c2.stats();
        assert_eq!(
            (st.duplicates_ignored, st.events_synced, st.syncs_run),
            (2, 1, 1)
        );
        Ok(())
    }

    /// Proves gap repair: after seq 1, a push of seq 3 makes the client sync with
    /// after=1, and the synced events close the gap.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn gap_triggers_sync_from_cursor() -> anyhow::Result<()> {
        let dir = TestDir::new("gap")?;
        let mut s = fake(responder(|req| match field_str(req, "t") {
            Some("sync") => vec![reply(req, "synced", json!({"conv": "a", "events": [ev("a", 2), ev("a", 3)], "head": 3, "complete": true}))],
            _ => vec![],
        }))
        .await?;
        let mut c = Client::create(&dir.state(), "d1", "t", 1)?;
        c.connect(&s.url).await?;
        s.push.send(push_ev("a", 1))?;
        c.wait_cursor("a", 1, WAIT).await?;
        s.push.send(push_ev("a", 3))?;
        let (_, sync) = expect(&mut s.got, WAIT, is("sync")).await?;
        assert_eq!(
            (
                sync["conv"].clone(),
                sync["after"].clone(),
                sync["limit"].clone()
            ),
            (json!("a"), json!(1), json!(100))
        );
        c.wait_cursor("a", 3, WAIT).await?;
        assert_eq!(c.stored_seqs("a"), vec![1, 2, 3]);
        let st = c.stats();
        assert_eq!(
            (
                st.pushes_received,
                st.pushes_applied,
                st.gaps_detected,
                st.events_synced,
                st.duplicates_ignored
            ),
            (2, 2, 1, 1, 1)
        );
        c.wait_server_delivered("a", 3, WAIT).await?;
        Ok(())
    }

    /// Proves a hint whose head is above the cursor leads to a sync until complete
    /// (two pages here) and an ack of the new cursor.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hint_triggers_paged_sync_and_ack() -> anyhow::Result<()> {
        let dir = TestDir::new("hint")?;
        let mut s = fake(responder(|req| match field_str(req, "t") {
            Some("sync") => {
                let after = field_i64(req, "after").unwrap_or(0);
                let page: Vec<Value> = (after + 1..=(after + 2).min(3))
                    .map(|s| ev("a", s))
                    .collect();
                let complete = after + 2 >= 3;
                vec![reply(
                    req,
                    "synced",
                    json!({"conv": "a", "events": page, "head": 3, "complete": complete}),
                )]
            }
            _ => vec![],
        }))
        .await?;
        let opts = ClientOptions {
            sync_limit: 2,
            ..ClientOptions::default()
        };
        let mut c = Client::create(&dir.state(), "d1", "t", 1)?.with_options(opts);
        c.connect(&s.url).await?;
        s.push
            .send(json!({"t": "hint", "conv": "a", "head": 3, "why": "sweep"}))?;
        let (_, ack) = expect(&mut s.got, WAIT, is("ack")).await?;
        assert_eq!(ack["seq"], json!(3));
        c.wait_server_delivered("a", 3, WAIT).await?;
        let st = c.stats();
        assert_eq!(st.hints_received.get("sweep"), Some(&1));
        assert_eq!((st.syncs_run, st.events_synced), (2, 3));
        let afters: Vec<Value> = c
            .sent_frames()
            .into_iter()
            .filter(|(_, f)| is("sync")(f))
            .map(|(_, f)| f["after"].clone())
            .collect();
        assert_eq!(afters, vec![json!(0), json!(2)]);

        // A hint at head 3 while the cursor is 3 means the server lost the ack:
        // the client acks again without syncing.
        s.push
            .send(json!({"t": "hint", "conv": "a", "head": 3, "why": "resync"}))?;
        let (_, again) = expect(&mut s.got, WAIT, |v| is("ack")(v) || is("sync")(v)).await?;
        assert_eq!(
            (again["t"].clone(), again["seq"].clone()),
            (json!("ack"), json!(3))
        );
        assert_eq!(c.stats().syncs_run, 2);
        Ok(())
    }

    /// Proves count-based ack coalescing: 8 pushes give exactly two acks, of 4 and 8
    /// (`ack_after` is long here so only the count can trigger them).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn acks_coalesce_every_four() -> anyhow::Result<()> {
        let dir = TestDir::new("ack4")?;
        let mut s = fake(responder(|_| vec![])).await?;
        let opts = ClientOptions {
            ack_after: Duration::from_secs(30),
            ..ClientOptions::default()
        };
        let mut c = Client::create(&dir.state(), "d1", "t", 1)?.with_options(opts);
        c.connect(&s.url).await?;
        for seq in 1..=8 {
            s.push.send(push_ev("a", seq))?;
        }
        let (_, a1) = expect(&mut s.got, WAIT, is("ack")).await?;
        let (_, a2) = expect(&mut s.got, WAIT, is("ack")).await?;
        assert_eq!((a1["seq"].clone(), a2["seq"].clone()), (json!(4), json!(8)));
        expect_none(&mut s.got, Duration::from_millis(200), is("ack")).await?;
        c.wait_server_delivered("a", 8, WAIT).await?;
        assert_eq!(c.stats().acks_sent, 2);
        Ok(())
    }

    /// Proves time-based ack coalescing: one push is acked once, about `ack_after`
    /// (50 ms) after it arrived; and `crash` drops an ack that is still coalescing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn single_push_acked_after_delay_and_crash_drops_pending_ack() -> anyhow::Result<()> {
        let dir = TestDir::new("ack50")?;
        let mut s = fake(responder(|_| vec![])).await?;
        let mut c = Client::create(&dir.state(), "d1", "t", 1)?;
        c.connect(&s.url).await?;
        s.push.send(push_ev("a", 1))?;
        let (acked_at, ack) = expect(&mut s.got, WAIT, is("ack")).await?;
        assert_eq!(ack["seq"], json!(1));
        let pushed_at = c
            .frames()
            .into_iter()
            .find(|(_, f)| is("event")(f))
            .map(|(at, _)| at)
            .ok_or_else(|| anyhow!("push not recorded"))?;
        let waited = acked_at.duration_since(pushed_at);
        assert!(
            waited >= Duration::from_millis(45) && waited < Duration::from_secs(1),
            "ack after {waited:?}"
        );
        expect_none(&mut s.got, Duration::from_millis(200), is("ack")).await?;
        assert_eq!(c.stats().acks_sent, 1);

        // A second push, then a crash before its 50 ms are up: no ack, no close frame.
        let opts = ClientOptions {
            ack_after: Duration::from_secs(30),
            ..ClientOptions::default()
        };
        let c = c.with_options(opts);
        s.push.send(push_ev("a", 2))?;
        c.wait_cursor("a", 2, WAIT).await?;
        c.crash().await;
        let (_, eof) = expect(&mut s.got, WAIT, |v| is("ack")(v) || is("_eof")(v)).await?;
        assert_eq!(eof, json!({"t": "_eof", "saw_close": false}));
        Ok(())
    }

    /// Proves `close` flushes a coalescing ack before its close frame.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn close_flushes_pending_ack() -> anyhow::Result<()> {
        let dir = TestDir::new("close")?;
        let mut s = fake(responder(|_| vec![])).await?;
        let opts = ClientOptions {
            ack_after: Duration::from_secs(30),
            ..ClientOptions::default()
        };
        let mut c = Client::create(&dir.state(), "d1", "t", 1)?.with_options(opts);
        c.connect(&s.url).await?;
        s.push.send(push_ev("a", 1))?;
        c.wait_cursor("a", 1, WAIT).await?;
        c.close().await;
        let (_, ack) = expect(&mut s.got, WAIT, is("ack")).await?;
        assert_eq!(ack["seq"], json!(1));
        let (_, eof) = expect(&mut s.got, WAIT, is("_eof")).await?;
        assert_eq!(eof["saw_close"], json!(true));
        Ok(())
    }

    /// Proves raw frames work for protocol tests: a malformed frame's rid-less error
    /// shows up in `frames()`, and `create` refuses to overwrite a state file.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn raw_frames_and_create_refuses_overwrite() -> anyhow::Result<()> {
        let dir = TestDir::new("raw")?;
        let s = fake(Arc::new(|req: &Value| {
            if req.is_null() {
                vec![json!({"t": "error", "code": "BAD_REQUEST", "msg": "malformed frame"})]
            } else {
                vec![]
            }
        }))
        .await?;
        let mut c = Client::create(&dir.state(), "d1", "t", 1)?;
        assert!(Client::create(&dir.state(), "d1", "t", 1).is_err());
        c.connect_raw(&s.url).await?;
        c.send_text("{not json").await?;
        c.wait_for("a BAD_REQUEST frame", WAIT, |c| {
            c.frames()
                .iter()
                .any(|(_, f)| field_str(f, "code") == Some("BAD_REQUEST"))
        })
        .await?;
        Ok(())
    }
}
