//! The lean WebSocket client of the bench (SPEC 2 wire protocol): connect, `hello`, `sub`,
//! sequential requests, and the *lean receiver*.
//!
//! The lean receiver is what a careful device does, minus the durable state file of the
//! harness `Client` (which persists a file per event and cannot take thousands of frames a
//! second): it keeps a contiguous cursor per conversation, acks it coalesced (every
//! `ack_every` events or `ack_after` after the first un-acked one), and syncs when it sees a
//! gap or a hint ahead of its cursor. It records what it saw for the bench to judge; it
//! never decides anything itself. It assumes its user sees every seq of its conversations
//! (one open membership from seq 1, as the bench provisions): a hidden seq would look like a
//! gap forever.

use anyhow::{bail, Context};
use futures_util::{SinkExt, StreamExt};
use serde::Deserialize;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::util::now_us;

pub type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// Every field any server frame may carry that the bench reads; the rest is ignored.
#[derive(Debug, Deserialize)]
pub struct In {
    pub t: String,
    #[serde(default)]
    pub rid: Option<String>,
    #[serde(default)]
    pub conv: Option<String>,
    #[serde(default)]
    pub seq: Option<i64>,
    #[serde(default)]
    pub head: Option<i64>,
    #[serde(default)]
    pub why: Option<String>,
    #[serde(default)]
    pub delivered: Option<i64>,
    #[serde(default)]
    pub dup: Option<bool>,
    #[serde(default)]
    pub code: Option<String>,
    #[serde(default)]
    pub ev: Option<Ev>,
    #[serde(default)]
    pub events: Option<Vec<Ev>>,
    #[serde(default)]
    pub complete: Option<bool>,
    #[serde(default)]
    pub convs: Option<Vec<ConvState>>,
}

#[derive(Debug, Deserialize)]
pub struct Ev {
    pub conv: String,
    pub seq: i64,
    /// Commit-side clock of the event, ms since the epoch.
    #[serde(default)]
    pub at: i64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ConvState {
    pub conv: String,
    pub head: i64,
    pub delivered: i64,
}

pub fn parse(text: &str) -> Option<In> {
    serde_json::from_str(text).ok()
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
) -> anyhow::Result<In> {
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
                if f.rid.as_deref() == Some(rid) {
                    return Ok(f);
                }
            }
        }
    }
}

/// Connects and says hello; fails unless the reply is `welcome`.
pub async fn open(url: &str, device: &str, token: &str) -> anyhow::Result<Ws> {
    let mut ws = connect(url).await?;
    let hello = serde_json::json!({"t":"hello","rid":"h","device":device,"token":token,"epoch":1});
    let r = request(&mut ws, hello.to_string(), "h", Duration::from_secs(10)).await?;
    if r.t != "welcome" {
        bail!("hello of {device} answered {} {:?}", r.t, r.code);
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
    if r.t != "subbed" {
        bail!("sub answered {} {:?}", r.t, r.code);
    }
    Ok(r.convs.unwrap_or_default())
}

pub fn send_frame(rid: &str, conv: &str, cmid: &str, body: &str) -> String {
    serde_json::json!({"t":"send","rid":rid,"conv":conv,"cmid":cmid,"body":body}).to_string()
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
    /// New events in receipt order (duplicates and out-of-order pushes excluded).
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

#[derive(Clone, Copy, Debug)]
pub struct AckPolicy {
    pub every: u64,
    pub after: Duration,
}

impl Default for AckPolicy {
    /// SPEC 5's coalescing: every 4 events or 50 ms.
    fn default() -> Self {
        AckPolicy {
            every: 4,
            after: Duration::from_millis(50),
        }
    }
}

struct Track {
    name: String,
    /// Highest seq such that every seq up to it was received.
    contiguous: i64,
    /// What the last ack asked for.
    acked: i64,
    pending: u64,
    due: Option<Instant>,
    sync_inflight: bool,
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
        AckPolicy::default(),
        log.clone(),
        delivered,
        stop,
    ));
    (log, task)
}

/// Runs one subscribed connection until `stop` turns true or the connection ends.
/// `delivered` carries the highest `acked.delivered` seen (for the repair part).
pub async fn receiver(
    ws: Ws,
    convs: Vec<ConvState>,
    policy: AckPolicy,
    log: Arc<Mutex<RecvLog>>,
    delivered: watch::Sender<i64>,
    mut stop: watch::Receiver<bool>,
) {
    let (mut sink, mut stream) = ws.split();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut tracks: Vec<Track> = Vec::new();
    let mut kick: Vec<usize> = Vec::new();
    for c in convs {
        index.insert(c.conv.clone(), tracks.len());
        if c.delivered < c.head {
            kick.push(tracks.len());
        }
        tracks.push(Track {
            name: c.conv,
            contiguous: c.head,
            acked: c.delivered,
            pending: 0,
            due: None,
            sync_inflight: false,
        });
    }
    let mut next_rid: u64 = 0;
    let mut out: Vec<String> = Vec::new();
    // A cursor below the head at sub time (an earlier run's last ack): ack it now.
    for i in kick {
        let t = &mut tracks[i];
        next_rid += 1;
        out.push(format!(
            r#"{{"t":"ack","rid":"a{next_rid}","conv":"{}","seq":{}}}"#,
            t.name, t.contiguous
        ));
        t.acked = t.contiguous;
    }
    loop {
        for text in out.drain(..) {
            let is_ack = text.starts_with(r#"{"t":"ack""#);
            if sink.send(Message::text(text)).await.is_err() {
                return;
            }
            if is_ack {
                log.lock().unwrap_or_else(|p| p.into_inner()).acks_sent += 1;
            }
        }
        let due = tracks.iter().filter_map(|t| t.due).min();
        let msg = tokio::select! {
            _ = stop.changed() => {
                if *stop.borrow() { return; }
                continue;
            }
            _ = async { tokio::time::sleep_until(due.unwrap_or_else(Instant::now)).await }, if due.is_some() => {
                let now = Instant::now();
                for t in tracks.iter_mut() {
                    if t.due.is_some_and(|d| d <= now) {
                        ack(t, &mut next_rid, &mut out);
                    }
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
        let now = now_us();
        let Some(f) = parse(text.as_str()) else {
            log.lock().unwrap_or_else(|p| p.into_inner()).other_errors += 1;
            continue;
        };
        let mut l = log.lock().unwrap_or_else(|p| p.into_inner());
        match f.t.as_str() {
            "event" => {
                l.pushes += 1;
                let Some(ev) = f.ev else { continue };
                let Some(&i) = index.get(&ev.conv) else {
                    continue;
                };
                l.pushed.push(Got {
                    conv: i as u32,
                    seq: ev.seq,
                    recv_us: now,
                    at_ms: ev.at,
                    pushed: true,
                });
                let t = &mut tracks[i];
                if ev.seq == t.contiguous + 1 {
                    t.contiguous = ev.seq;
                    l.got.push(Got {
                        conv: i as u32,
                        seq: ev.seq,
                        recv_us: now,
                        at_ms: ev.at,
                        pushed: true,
                    });
                    stored(t, 1, policy, &mut next_rid, &mut out);
                } else if ev.seq <= t.contiguous {
                    l.duplicates += 1;
                } else {
                    l.gaps += 1;
                    if !t.sync_inflight {
                        sync(t, &mut next_rid, &mut out);
                        l.syncs += 1;
                    }
                }
            }
            "synced" => {
                let Some(conv) = f.conv.as_deref() else {
                    continue;
                };
                let Some(&i) = index.get(conv) else { continue };
                let t = &mut tracks[i];
                t.sync_inflight = false;
                if let Some(sent) = f
                    .rid
                    .as_deref()
                    .and_then(|r| r.strip_prefix('y'))
                    .and_then(|r| r.split('-').nth(1))
                    .and_then(|s| s.parse::<i64>().ok())
                {
                    l.sync_rtt_us.push(now - sent);
                }
                let mut n = 0;
                for ev in f.events.unwrap_or_default() {
                    if ev.seq == t.contiguous + 1 {
                        t.contiguous = ev.seq;
                        n += 1;
                        l.got.push(Got {
                            conv: i as u32,
                            seq: ev.seq,
                            recv_us: now,
                            at_ms: ev.at,
                            pushed: false,
                        });
                    }
                }
                if n > 0 {
                    stored(t, n, policy, &mut next_rid, &mut out);
                }
                if f.complete == Some(false) || f.head.is_some_and(|h| h > t.contiguous) {
                    sync(t, &mut next_rid, &mut out);
                    l.syncs += 1;
                }
            }
            "acked" => {
                l.acked += 1;
                if let Some(d) = f.delivered {
                    delivered.send_if_modified(|cur| {
                        let up = d > *cur;
                        if up {
                            *cur = d;
                        }
                        up
                    });
                }
            }
            "hint" => {
                match f.why.as_deref() {
                    Some("sweep") => l.hints_sweep += 1,
                    Some("overflow") => l.hints_overflow += 1,
                    _ => l.hints_other += 1,
                }
                let (Some(conv), Some(head)) = (f.conv.as_deref(), f.head) else {
                    continue;
                };
                l.hint_times.push((head, now));
                let Some(&i) = index.get(conv) else { continue };
                let t = &mut tracks[i];
                if head > t.contiguous {
                    l.hints_ahead += 1;
                    if !t.sync_inflight {
                        sync(t, &mut next_rid, &mut out);
                        l.syncs += 1;
                    }
                } else if t.acked < t.contiguous && t.due.is_none() {
                    // The server still lags what we hold: our ack may be coalescing or lost.
                    ack(t, &mut next_rid, &mut out);
                }
            }
            "error" => {
                if f.rid.as_deref().is_some_and(|r| r.starts_with('a')) {
                    l.ack_errors += 1;
                } else {
                    l.other_errors += 1;
                }
                if f.rid.as_deref().is_some_and(|r| r.starts_with('y')) {
                    if let Some(&i) = f.conv.as_deref().and_then(|c| index.get(c)) {
                        tracks[i].sync_inflight = false;
                    } else {
                        for t in tracks.iter_mut() {
                            t.sync_inflight = false;
                        }
                    }
                }
            }
            _ => {}
        }
    }
}

fn stored(t: &mut Track, n: u64, policy: AckPolicy, next_rid: &mut u64, out: &mut Vec<String>) {
    t.pending += n;
    if t.pending >= policy.every {
        ack(t, next_rid, out);
    } else if t.due.is_none() {
        t.due = Some(Instant::now() + policy.after);
    }
}

fn ack(t: &mut Track, next_rid: &mut u64, out: &mut Vec<String>) {
    t.pending = 0;
    t.due = None;
    if t.contiguous <= t.acked {
        return;
    }
    *next_rid += 1;
    out.push(format!(
        r#"{{"t":"ack","rid":"a{}","conv":"{}","seq":{}}}"#,
        next_rid, t.name, t.contiguous
    ));
    t.acked = t.contiguous;
}

fn sync(t: &mut Track, next_rid: &mut u64, out: &mut Vec<String>) {
    *next_rid += 1;
    t.sync_inflight = true;
    out.push(format!(
        r#"{{"t":"sync","rid":"y{}-{}","conv":"{}","after":{},"limit":500}}"#,
        next_rid,
        now_us(),
        t.name,
        t.contiguous
    ));
}
