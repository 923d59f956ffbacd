//! The lean WebSocket client of the bench (SPEC 2 wire protocol): connect, `hello`, `sub`,
//! sequential requests, and the *lean receiver*.
//!
//! The lean receiver is what a careful device does, minus the durable state file of the
//! harness `Client` (which persists a file per event and cannot take thousands of frames a
//! second): its decisions (a contiguous cursor per conversation, acks coalesced every
//! `every` events or `after` after the first un-acked one, a sync on a gap or on a hint
//! ahead of its cursor) are the harness client's delivery core
//! ([`harness::client::Delivery`]), fed with the frames it reads. It records what it saw
//! for the bench to judge; it never decides anything itself.

use anyhow::{bail, Context};
use futures_util::{SinkExt, StreamExt};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use harness::client::delivery::{Hinted, NextPage, Pushed};
use harness::client::{is_retryable_code, Delivery, HintAck};
use im_protocol::wire::{Event, HintWhy, Reply, Request};

use crate::util::now_us;

pub type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

pub use im_protocol::wire::ConvHead as ConvState;
pub use im_protocol::ServerFrame;

/// A server frame, typed ([`ServerFrame::parse`]); `None` for one that is malformed.
pub fn parse(text: &str) -> Option<ServerFrame> {
    ServerFrame::parse(text).ok()
}

/// The `seq` and `dup` of a `sent` reply; `None` for any other frame.
pub fn sent(f: &ServerFrame) -> Option<(i64, bool)> {
    match f {
        ServerFrame::Reply {
            reply: Reply::Sent { seq, dup, .. },
            ..
        } => Some((*seq, *dup)),
        _ => None,
    }
}

/// What a frame was, for an error message: its kind, and an error's code.
pub fn answered(f: &ServerFrame) -> String {
    match f {
        ServerFrame::Reply {
            reply: Reply::Error(e),
            ..
        } => format!("error {}", e.code()),
        _ => format!("{:?}", f.kind()).to_lowercase(),
    }
}

/// Connects with Nagle off (the gateway sets TCP_NODELAY on its side too).
pub async fn connect(url: &str) -> anyhow::Result<Ws> {
    let fut = tokio_tungstenite::connect_async_with_config(url, None, true);
    let (ws, _) = tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .with_context(|| format!("connect {url}: timed out"))?
        .with_context(|| format!("connect {url}"))?;
    Ok(ws)
}

/// Writes a frame and reads until the reply with `rid` (other frames are skipped: on a
/// connection that has not subscribed there are none).
pub async fn request(
    ws: &mut Ws,
    text: String,
    rid: &str,
    timeout: Duration,
) -> anyhow::Result<ServerFrame> {
    ws.send(Message::text(text)).await.context("write frame")?;
    let deadline = Instant::now() + timeout;
    loop {
        let msg = tokio::time::timeout_at(deadline, ws.next())
            .await
            .with_context(|| format!("no reply to {rid} within {timeout:?}"))?;
        let Some(msg) = msg else {
            bail!("connection closed waiting for {rid}")
        };
        if let Message::Text(t) = msg.context("read frame")? {
            if let Some(f) = parse(t.as_str()) {
                if f.rid() == Some(rid) {
                    return Ok(f);
                }
            }
        }
    }
}

/// Connects and says hello; fails unless the reply is `welcome`.
pub async fn open(url: &str, device: &str, token: &str) -> anyhow::Result<Ws> {
    let mut ws = connect(url).await?;
    let r = request(
        &mut ws,
        hello_frame(device, token),
        "h",
        Duration::from_secs(10),
    )
    .await?;
    if !matches!(
        r,
        ServerFrame::Reply {
            reply: Reply::Welcome { .. },
            ..
        }
    ) {
        bail!("hello of {device} answered {}", answered(&r));
    }
    Ok(ws)
}

/// `sub`: the conversations with head and delivered.
pub async fn sub(ws: &mut Ws) -> anyhow::Result<Vec<ConvState>> {
    let r = request(
        ws,
        r#"{"t":"sub","rid":"sub"}"#.to_string(),
        "sub",
        Duration::from_secs(10),
    )
    .await?;
    match r {
        ServerFrame::Reply {
            reply: Reply::Subbed { convs, .. },
            ..
        } => Ok(convs),
        r => bail!("sub answered {}", answered(&r)),
    }
}

/// `hello` with rid `h` and epoch 1.
pub fn hello_frame(device: &str, token: &str) -> String {
    Request::Hello {
        device: device.to_string(),
        token: token.to_string(),
        epoch: 1,
    }
    .to_frame("h")
}

pub fn send_frame(rid: &str, conv: &str, cmid: &str, body: &str) -> String {
    Request::Send {
        conv: conv.to_string(),
        cmid: cmid.to_string(),
        body: body.to_string(),
    }
    .to_frame(rid)
}

/// One event a receiver got (push or sync).
#[derive(Clone, Copy, Debug)]
pub struct Got {
    /// Index of the conversation in the receiver's `sub` list.
    pub conv: u32,
    pub seq: i64,
    /// Receipt time (`now_us`).
    pub recv_us: i64,
    /// The event's `at` (ms).
    pub at_ms: i64,
    /// True for a push, false for a sync page.
    pub pushed: bool,
}

/// What one receiver saw since its log was last taken.
#[derive(Debug, Default)]
pub struct RecvLog {
    /// New events in receipt order (duplicates excluded; a push behind a gap counts when
    /// it arrives, and its sync later returns it as a duplicate).
    pub got: Vec<Got>,
    /// Event frames received (pushes, including duplicates and gaps).
    pub pushes: u64,
    /// Every push frame (duplicates and gaps included), for push latency.
    pub pushed: Vec<Got>,
    pub duplicates: u64,
    /// Pushes with `seq > cursor + 1`.
    pub gaps: u64,
    pub acks_sent: u64,
    pub acked: u64,
    pub ack_errors: u64,
    pub other_errors: u64,
    pub hints_sweep: u64,
    pub hints_overflow: u64,
    pub hints_other: u64,
    /// Hints whose head was above the receiver's contiguous cursor when they arrived.
    pub hints_ahead: u64,
    /// (head, receipt time) of every hint, for the repair part.
    pub hint_times: Vec<(i64, i64)>,
    pub syncs: u64,
    /// Round trips of sync requests, µs.
    pub sync_rtt_us: Vec<i64>,
}

impl RecvLog {
    pub fn take(&mut self) -> RecvLog {
        std::mem::take(self)
    }
}

pub use harness::client::AckPolicy;

/// The receivers' ack policy: SPEC 5's coalescing (every 4 events or 50 ms); a hint the
/// cursor covers is acked only when no ack is coalescing ([`HintAck::IfIdle`]).
pub fn ack_policy() -> AckPolicy {
    AckPolicy {
        on_hint: HintAck::IfIdle,
        ..AckPolicy::default()
    }
}

/// Spawns [`receiver`] with the default ack policy for a caller that does not watch the
/// delivered cursor; returns its log and task.
pub fn spawn_receiver(
    ws: Ws,
    convs: Vec<ConvState>,
    stop: watch::Receiver<bool>,
) -> (Arc<Mutex<RecvLog>>, tokio::task::JoinHandle<()>) {
    let log = Arc::new(Mutex::new(RecvLog::default()));
    let (delivered, _) = watch::channel(0i64);
    let task = tokio::spawn(receiver(
        ws,
        convs,
        ack_policy(),
        log.clone(),
        delivered,
        stop,
    ));
    (log, task)
}

/// Frames a receiver sends: acks and syncs, with rids that say what they were for
/// (`a<n>-<conv index>-<seq>`, `y<n>-<sent µs>-<conv index>`).
struct Out {
    next_rid: u64,
    frames: Vec<String>,
}

impl Out {
    fn ack(&mut self, i: usize, conv: &str, seq: i64) {
        self.next_rid += 1;
        self.frames.push(format!(
            r#"{{"t":"ack","rid":"a{}-{i}-{seq}","conv":"{conv}","seq":{seq}}}"#,
            self.next_rid
        ));
    }

    fn sync(&mut self, i: usize, conv: &str, after: i64) {
        self.next_rid += 1;
        self.frames.push(format!(
            r#"{{"t":"sync","rid":"y{}-{}-{i}","conv":"{conv}","after":{after},"limit":500}}"#,
            self.next_rid,
            now_us(),
        ));
    }
}

/// The conversation index and acked seq an ack's rid names (`a<n>-<i>-<seq>`).
fn ack_rid(rid: &str) -> Option<(usize, i64)> {
    let mut parts = rid.strip_prefix('a')?.split('-').skip(1);
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// The send time (µs) and conversation index a sync's rid names (`y<n>-<µs>-<i>`).
fn sync_rid(rid: &str) -> Option<(i64, usize)> {
    let mut parts = rid.strip_prefix('y')?.split('-').skip(1);
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// Runs one subscribed connection until `stop` turns true or the connection ends.
/// `delivered` carries the highest `acked.delivered` seen (for the repair part).
///
/// The decisions (cursor, coalesced acks, gaps, hints) are the harness client's delivery
/// core ([`harness::client::Delivery`]); this loop only moves frames and keeps the log.
/// Unlike the harness client it does not wait for its syncs and acks: it sends them and
/// goes on reading, and the core knows a sync or an ack is under way.
pub async fn receiver(
    ws: Ws,
    convs: Vec<ConvState>,
    policy: AckPolicy,
    log: Arc<Mutex<RecvLog>>,
    delivered: watch::Sender<i64>,
    mut stop: watch::Receiver<bool>,
) {
    let (mut sink, mut stream) = ws.split();
    let mut r = Lean::new(convs, policy);
    loop {
        for text in r.out.frames.drain(..) {
            let is_ack = text.starts_with(r#"{"t":"ack""#);
            if sink.send(Message::text(text)).await.is_err() {
                return;
            }
            if is_ack {
                log.lock().unwrap_or_else(|p| p.into_inner()).acks_sent += 1;
            }
        }
        let due = r.core.next_due().map(Instant::from_std);
        let msg = tokio::select! {
            _ = stop.changed() => {
                if *stop.borrow() { return; }
                continue;
            }
            _ = async { tokio::time::sleep_until(due.unwrap_or_else(Instant::now)).await }, if due.is_some() => {
                let now = std::time::Instant::now();
                for conv in r.core.due(now) {
                    r.ack_now(r.index[&conv], &conv, now);
                }
                continue;
            }
            m = stream.next() => m,
        };
        let text = match msg {
            Some(Ok(Message::Text(t))) => t,
            Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
            Some(Ok(_)) => continue,
        };
        let at = (now_us(), std::time::Instant::now());
        let Some(f) = parse(text.as_str()) else {
            log.lock().unwrap_or_else(|p| p.into_inner()).other_errors += 1;
            continue;
        };
        let mut l = log.lock().unwrap_or_else(|p| p.into_inner());
        r.on_frame(f, &mut l, at, &delivered);
    }
}

/// The lean receiver's state: the delivery core, its conversations by name and index, and
/// the frames to send next. `at` below is when a frame was read: (µs since the epoch, the
/// core's clock).
struct Lean {
    core: Delivery,
    index: HashMap<String, usize>,
    names: Vec<String>,
    out: Out,
}

impl Lean {
    /// The receiver of `convs` as `sub` left them: everything up to the head at sub time
    /// counts as held (an earlier run's events); a delivered cursor below it (that run's
    /// last ack was coalescing) is acked first.
    fn new(convs: Vec<ConvState>, policy: AckPolicy) -> Lean {
        let mut r = Lean {
            core: Delivery::new(policy, false),
            index: HashMap::new(),
            names: Vec::new(),
            out: Out {
                next_rid: 0,
                frames: Vec::new(),
            },
        };
        let start = std::time::Instant::now();
        for c in convs {
            let i = r.names.len();
            r.index.insert(c.conv.clone(), i);
            r.core.restore(&c.conv, c.head, [], Some(c.delivered));
            r.ack_now(i, &c.conv, start);
            r.names.push(c.conv);
        }
        r
    }

    /// Acks conversation `i` now if the core wants an ack.
    fn ack_now(&mut self, i: usize, conv: &str, clock: std::time::Instant) {
        if let Some(seq) = self.core.begin_ack(conv, clock) {
            self.out.ack(i, conv, seq);
        }
    }

    /// Hands one server frame to its handler; an `acked` also raises `delivered` to the
    /// highest delivered cursor seen.
    fn on_frame(
        &mut self,
        f: ServerFrame,
        l: &mut RecvLog,
        at: (i64, std::time::Instant),
        delivered: &watch::Sender<i64>,
    ) {
        match f {
            ServerFrame::Event(ev) => self.on_event(&ev, l, at),
            ServerFrame::Reply {
                rid,
                reply:
                    Reply::Synced {
                        conv,
                        events,
                        head,
                        complete,
                    },
            } => self.on_synced(rid.as_deref(), &conv, &events, (head, complete), l, at),
            ServerFrame::Reply {
                rid,
                reply: Reply::Acked { delivered: d, .. },
            } => {
                l.acked += 1;
                if let Some((i, seq)) = rid.as_deref().and_then(ack_rid) {
                    self.core.ack_ok(&self.names[i], seq, d, at.1);
                }
                delivered.send_if_modified(|cur| {
                    let up = d > *cur;
                    if up {
                        *cur = d;
                    }
                    up
                });
            }
            ServerFrame::Hint { conv, head, why } => self.on_hint(&conv, head, why, l, at),
            ServerFrame::Reply {
                rid,
                reply: Reply::Error(e),
            } => self.on_error(rid.as_deref().unwrap_or(""), e.code(), l, at.1),
            _ => {}
        }
    }

    fn on_event(&mut self, ev: &Event, l: &mut RecvLog, (now, clock): (i64, std::time::Instant)) {
        l.pushes += 1;
        let Some(&i) = self.index.get(&ev.conv) else {
            return;
        };
        let got = Got {
            conv: i as u32,
            seq: ev.seq,
            recv_us: now,
            at_ms: ev.at_ms,
            pushed: true,
        };
        l.pushed.push(got);
        match self.core.push(&ev.conv, ev.seq) {
            Pushed::Duplicate => l.duplicates += 1,
            Pushed::New { gap, sync_after } => {
                l.got.push(got);
                if gap {
                    l.gaps += 1;
                }
                if let Some(after) = sync_after {
                    self.out.sync(i, &ev.conv, after);
                    l.syncs += 1;
                } else if self.core.stored(&ev.conv, clock) {
                    self.ack_now(i, &ev.conv, clock);
                }
            }
        }
    }

    fn on_synced(
        &mut self,
        rid: Option<&str>,
        conv: &str,
        events: &[Event],
        (head, complete): (i64, bool),
        l: &mut RecvLog,
        (now, clock): (i64, std::time::Instant),
    ) {
        let Some(&i) = self.index.get(conv) else {
            return;
        };
        if let Some((sent, _)) = rid.and_then(sync_rid) {
            l.sync_rtt_us.push(now - sent);
        }
        let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
        let page = self.core.synced(conv, &seqs, head, complete, |_| true);
        for j in page.new {
            l.got.push(Got {
                conv: i as u32,
                seq: events[j].seq,
                recv_us: now,
                at_ms: events[j].at_ms,
                pushed: false,
            });
        }
        match page.next {
            NextPage::After(after) => {
                self.out.sync(i, conv, after);
                l.syncs += 1;
            }
            NextPage::Done | NextPage::Stuck { .. } | NextPage::Disordered { .. } => {
                if self.core.sync_ended(conv, clock) {
                    self.ack_now(i, conv, clock);
                }
            }
        }
    }

    fn on_hint(
        &mut self,
        conv: &str,
        head: i64,
        why: HintWhy,
        l: &mut RecvLog,
        (now, clock): (i64, std::time::Instant),
    ) {
        match why {
            HintWhy::Sweep => l.hints_sweep += 1,
            HintWhy::Overflow => l.hints_overflow += 1,
            HintWhy::Resync => l.hints_other += 1,
        }
        l.hint_times.push((head, now));
        let Some(&i) = self.index.get(conv) else {
            return;
        };
        match self.core.hint(conv, head) {
            Hinted::Sync(after) => {
                l.hints_ahead += 1;
                self.out.sync(i, conv, after);
                l.syncs += 1;
            }
            Hinted::SyncRunning => l.hints_ahead += 1,
            Hinted::AckComing => {}
            // The server still lags what we hold: our ack may be coalescing or lost.
            Hinted::Ack => self.ack_now(i, conv, clock),
        }
    }

    /// An error reply: to an ack (the core retries it if `code` says it may succeed
    /// later) or to a sync (which ends it), or to anything else (counted).
    fn on_error(&mut self, rid: &str, code: &str, l: &mut RecvLog, clock: std::time::Instant) {
        if let Some((i, _)) = ack_rid(rid) {
            l.ack_errors += 1;
            let retryable = is_retryable_code(code);
            self.core.ack_failed(&self.names[i], retryable, clock);
        } else {
            l.other_errors += 1;
        }
        if let Some((_, i)) = sync_rid(rid) {
            let conv = self.names[i].clone();
            if self.core.sync_ended(&conv, clock) {
                self.ack_now(i, &conv, clock);
            }
        }
    }
}
