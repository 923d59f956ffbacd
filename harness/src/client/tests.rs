//! These tests run against tiny in-process WebSocket servers that play the
//! gateway's part of the protocol, so they need neither PostgreSQL nor the binary.

use super::*;
use futures_util::{SinkExt, StreamExt};
use im_check::history::Invoke;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

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
        Some("hello") => vec![welcome(req)],
        Some("ack") => vec![reply(
            req,
            "acked",
            json!({"conv": req["conv"], "delivered": req["seq"]}),
        )],
        _ => other(req),
    })
}

/// The fake gateway's `welcome` to `req` (a `hello`): user `u1`, the device and epoch it named.
fn welcome(req: &Value) -> Value {
    reply(
        req,
        "welcome",
        json!({"user": "u1", "device": req["device"], "epoch": req["epoch"]}),
    )
}

fn ev(conv: &str, seq: i64) -> Value {
    json!({"conv": conv, "seq": seq, "kind": "msg", "mid": format!("m{seq}"), "sender": "u2",
           "cmid": format!("x{seq}"), "body": format!("b{seq}"), "at": 1_735_689_600_000_i64, "epoch": 1})
}

/// Event `seq` of `a` after its epoch moved to 2: another message (`new{seq}`).
fn moved(seq: i64) -> Value {
    let mut e = ev("a", seq);
    e["epoch"] = json!(2);
    e["mid"] = json!(format!("new{seq}"));
    e
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
struct TestDir(tempfile::TempDir);

impl TestDir {
    fn new(name: &str) -> anyhow::Result<TestDir> {
        Ok(TestDir(
            tempfile::Builder::new()
                .prefix(&format!("imfault-client-{name}-"))
                .tempdir()?,
        ))
    }
    fn state(&self) -> PathBuf {
        self.0.path().join("state.json")
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

    let mut c = Client::create(&path, "d1", "tok1", 1, None)?;
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
    let mut c2 = Client::load(&path, None)?;
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
    let mut c = Client::create(&dir.state(), "d1", "t", 1, None)?;
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
            json!({"convs": [{"conv": "a", "head": 0, "delivered": 0, "epoch": 1}], "lineage": 0}),
        )],
        _ => vec![],
    }))
    .await?;
    let opts = ClientOptions {
        auto_ack: false,
        ..ClientOptions::default()
    };
    let mut c = Client::create(&path, "d1", "t", 1, None)?.with_options(opts);
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

    let c2 = Client::load(&path, None)?;
    assert_eq!(c2.cursor("a"), 2);
    assert_eq!(c2.stored_seqs("a"), vec![1, 2]);
    assert_eq!(c2.stored("a")[1]["body"], json!("b2"));
    assert_eq!(c2.server_delivered("a"), Some(0));

    // Server 2: head 5, delivered 0; seqs 3 and 5 are not visible to this user.
    let mut s2 = fake(responder(|req| match field_str(req, "t") {
        Some("sub") => vec![reply(
            req,
            "subbed",
            json!({"convs": [{"conv": "a", "head": 5, "delivered": 0, "epoch": 1}], "lineage": 0}),
        )],
        Some("sync") => {
            let after = req.get("after").and_then(Value::as_i64).unwrap_or(0);
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

/// Issue 21: a conversation the device holds that `subbed` no longer lists (its user's
/// membership went with the old lineage) is discarded when `subbed` reports a lineage
/// move, its epoch moved by as many moves; with no move, it is kept (a user who left keeps
/// what it had). Mutant check: without the lineage rule in `sub`, the held events stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lineage_move_discards_a_conversation_subbed_no_longer_lists() -> anyhow::Result<()> {
    let dir = TestDir::new("lineage")?;
    let lineage = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(0));
    let listed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let (l2, listed2) = (lineage.clone(), listed.clone());
    let s = fake(responder(move |req| match field_str(req, "t") {
        Some("sub") => {
            let convs = if listed2.load(std::sync::atomic::Ordering::SeqCst) {
                json!([{"conv": "a", "head": 0, "delivered": 0, "epoch": 1}])
            } else {
                json!([])
            };
            let l = l2.load(std::sync::atomic::Ordering::SeqCst);
            vec![reply(req, "subbed", json!({"convs": convs, "lineage": l}))]
        }
        _ => vec![],
    }))
    .await?;
    let opts = ClientOptions {
        auto_ack: false,
        ..ClientOptions::default()
    };
    let mut c = Client::create(&dir.state(), "d1", "t", 1, None)?.with_options(opts);
    c.connect(&s.url).await?;
    c.sub().await?;
    s.push.send(push_ev("a", 1))?;
    s.push.send(push_ev("a", 2))?;
    c.wait_cursor("a", 2, WAIT).await?;
    // The user left: not listed, no lineage move: kept.
    listed.store(false, std::sync::atomic::Ordering::SeqCst);
    c.sub().await?;
    assert_eq!(c.stored_seqs("a"), vec![1, 2]);
    // The database's lineage moved twice: discarded, epoch 1 + 2.
    lineage.store(2, std::sync::atomic::Ordering::SeqCst);
    c.sub().await?;
    assert_eq!(c.stored_seqs("a"), Vec::<i64>::new());
    assert_eq!(c.cursor("a"), 0);
    assert_eq!(c.epochs().get("a"), Some(&3));
    Ok(())
}

/// A client of `d1` that syncs two events a page, connected to `url`.
async fn paging_client(dir: &TestDir, url: &str) -> anyhow::Result<Client> {
    let opts = ClientOptions {
        sync_limit: 2,
        ..ClientOptions::default()
    };
    let mut c = Client::create(&dir.state(), "d1", "t", 1, None)?.with_options(opts);
    c.connect(url).await?;
    Ok(c)
}

/// A page of conversation `a` (head 4, two events a page) after `after`.
fn page_of_a(req: &Value) -> Value {
    let after = req["after"].as_i64().unwrap_or(0);
    let events: Vec<Value> = (after + 1..=(after + 2).min(4))
        .map(|s| ev("a", s))
        .collect();
    let complete = after + 2 >= 4;
    reply(
        req,
        "synced",
        json!({"conv": "a", "events": events, "head": 4, "complete": complete}),
    )
}

/// D3: one sync of a conversation at a time. `sub` syncs `a` (head 4) from 0 while a
/// push of seq 4 (a gap) makes the pump repair it from 0 too. The fake holds the first
/// sync's first page until it has seen whether a second sync of `a` comes meanwhile: it
/// must not (two at once shared the core's page floor, and the second's first page was
/// refused as disordered: `im06_failover_pg_auto_failover`'s flake). Then both end, with
/// no sync error, every event stored once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_syncs_of_one_conversation_never_overlap() -> anyhow::Result<()> {
    let dir = TestDir::new("one-sync")?;
    let syncs = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let seen = syncs.clone();
    let mut s = fake(responder(move |req| match field_str(req, "t") {
        Some("sub") => vec![
            reply(
                req,
                "subbed",
                json!({"convs": [{"conv": "a", "head": 4, "delivered": 0, "epoch": 1}],
                       "lineage": 0}),
            ),
            push_ev("a", 4),
        ],
        // The first sync request waits for the test to answer it.
        Some("sync") if seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 => vec![],
        Some("sync") => vec![page_of_a(req)],
        _ => vec![],
    }))
    .await?;
    let c = paging_client(&dir, &s.url).await?;
    let (push, got) = (s.push.clone(), &mut s.got);
    let driver = async {
        let (_, first) = expect(got, WAIT, is("sync")).await?;
        expect_none(got, Duration::from_millis(500), is("sync")).await?;
        push.send(page_of_a(&first))?;
        anyhow::Ok(())
    };
    let (subbed, driven) = tokio::join!(c.sub(), driver);
    driven?;
    subbed?;
    c.wait_cursor("a", 4, WAIT).await?;
    assert_eq!(c.stored_seqs("a"), vec![1, 2, 3, 4]);
    assert_eq!(c.stats().sync_errors, 0, "{:?}", c.stats());
    Ok(())
}

/// A sync whose future is dropped (a caller's `select!` or timeout cancelled `sub`) ends
/// as a failed one: a later hint of the conversation syncs it again. The fake never
/// answers the first sync request; `sub` is cancelled while it waits; then a hint at head
/// 4 must bring a second sync and the events. Before, the delivery core kept the dropped
/// sync as running and answered every hint `SyncRunning` (nemesis seed 2 on three
/// gateways at 85cb913: a device missed 29 events for the rest of the run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_sync_lets_the_next_hint_sync_again() -> anyhow::Result<()> {
    let dir = TestDir::new("cancelled-sync")?;
    let syncs = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let seen = syncs.clone();
    let mut s = fake(responder(move |req| match field_str(req, "t") {
        Some("sub") => vec![reply(
            req,
            "subbed",
            json!({"convs": [{"conv": "a", "head": 4, "delivered": 0, "epoch": 1}],
                   "lineage": 0}),
        )],
        // The first sync request is never answered.
        Some("sync") if seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 => vec![],
        Some("sync") => vec![page_of_a(req)],
        _ => vec![],
    }))
    .await?;
    let c = paging_client(&dir, &s.url).await?;
    let got = &mut s.got;
    tokio::select! {
        r = c.sub() => bail!("sub ended though its sync was never answered: {r:?}"),
        r = expect(got, WAIT, is("sync")) => { r?; }
    }
    s.push
        .send(json!({"t": "hint", "conv": "a", "head": 4, "why": "sweep"}))?;
    let (_, again) = expect(&mut s.got, WAIT, is("sync")).await?;
    assert_eq!(again["after"], json!(0), "{again}");
    c.wait_cursor("a", 4, WAIT).await?;
    assert_eq!(c.stored_seqs("a"), vec![1, 2, 3, 4]);
    Ok(())
}

/// Proves gap repair: after seq 1, a push of seq 3 makes the client sync with
/// after=1, and the synced events close the gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_triggers_sync_from_cursor() -> anyhow::Result<()> {
    let dir = TestDir::new("gap")?;
    let mut s = fake(responder(|req| match field_str(req, "t") {
        Some("sync") => vec![reply(
            req,
            "synced",
            json!({"conv": "a", "events": [ev("a", 2), ev("a", 3)], "head": 3, "complete": true}),
        )],
        _ => vec![],
    }))
    .await?;
    let mut c = Client::create(&dir.state(), "d1", "t", 1, None)?;
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
            let after = req.get("after").and_then(Value::as_i64).unwrap_or(0);
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
    let c = paging_client(&dir, &s.url).await?;
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
    let mut c = Client::create(&dir.state(), "d1", "t", 1, None)?.with_options(opts);
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
    let mut c = Client::create(&dir.state(), "d1", "t", 1, None)?;
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

/// Proves `close` flushes a coalescing ack before its close frame: the options given
/// (`with_options`, an `ack_after` of 30 s) hold the ack back until the close, so the ack
/// that comes is the close's flush, not the default 50 ms coalescing timer's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_flushes_pending_ack() -> anyhow::Result<()> {
    let dir = TestDir::new("close")?;
    let mut s = fake(responder(|_| vec![])).await?;
    let opts = ClientOptions {
        ack_after: Duration::from_secs(30),
        ..ClientOptions::default()
    };
    let mut c = Client::create(&dir.state(), "d1", "t", 1, None)?.with_options(opts);
    c.connect(&s.url).await?;
    s.push.send(push_ev("a", 1))?;
    c.wait_cursor("a", 1, WAIT).await?;
    expect_none(&mut s.got, Duration::from_millis(300), is("ack")).await?;
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
    let mut c = Client::create(&dir.state(), "d1", "t", 1, None)?;
    assert!(Client::create(&dir.state(), "d1", "t", 1, None).is_err());
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

/// Proves that building requests as `Request`s changed nothing the gateway or the history
/// sees: each typed request the client makes is, with its rid, the same JSON (so the same
/// bytes) as the `json!` frame it replaced, and its history invoke is the one
/// `Invoke::of_frame` gives for that frame.
#[test]
fn typed_requests_are_the_frames_and_invokes_of_before() {
    use super::transport::Outgoing;
    use im_protocol::wire::Request;
    let cases = [
        (
            Request::Hello {
                device: "d1".into(),
                token: "tok\"1".into(),
                epoch: 2,
            },
            json!({"t": "hello", "device": "d1", "token": "tok\"1", "epoch": 2}),
        ),
        (
            Request::Send {
                conv: "c".into(),
                cmid: "m-1".into(),
                body: "hé\n".into(),
            },
            json!({"t": "send", "conv": "c", "cmid": "m-1", "body": "hé\n"}),
        ),
        (
            Request::Ack {
                conv: "c".into(),
                seq: 7,
            },
            json!({"t": "ack", "conv": "c", "seq": 7}),
        ),
        (Request::Sub, json!({"t": "sub"})),
        (
            Request::Sync {
                conv: "c".into(),
                after: 3,
                limit: Some(100),
            },
            json!({"t": "sync", "conv": "c", "after": 3, "limit": 100}),
        ),
    ];
    for (req, old) in cases {
        let typed = Outgoing::Typed(req);
        assert_eq!(typed.invoke(), Invoke::of_frame(&old), "{old}");
        let mut with_rid = old.clone();
        with_rid["rid"] = json!("c9");
        let sent = typed.with_rid("c9").unwrap();
        assert_eq!(sent, with_rid);
        assert_eq!(sent.to_string(), with_rid.to_string());
    }
}

/// Issue 21: a push whose conversation epoch moved makes the client discard what it held
/// of the conversation (events and cursor), sync again from 0, hold only what the new
/// epoch's server has (another message at a seq it had included), and ack it; a frame of
/// an older epoch afterwards is ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_epoch_discards_the_conversation_and_syncs_from_zero() -> anyhow::Result<()> {
    let dir = TestDir::new("epoch")?;
    let mut s = fake(responder(move |req| match field_str(req, "t") {
        Some("sync") => vec![reply(
            req,
            "synced",
            json!({"conv": "a", "events": [moved(1), moved(2)], "head": 2, "complete": true}),
        )],
        _ => vec![],
    }))
    .await?;
    let c = Client::create(&dir.state(), "d1", "t", 1, None)?;
    let mut c = c;
    c.connect(&s.url).await?;
    for seq in 1..=3 {
        s.push.send(push_ev("a", seq))?;
    }
    c.wait_cursor("a", 3, WAIT).await?;
    // Seq 2 now holds another message and 3 is gone: the database lost history.
    s.push.send(json!({"t": "event", "ev": moved(2)}))?;
    let (_, sync) = expect(&mut s.got, WAIT, is("sync")).await?;
    assert_eq!(sync["after"], json!(0));
    let (_, ack) = expect(&mut s.got, WAIT, |v| is("ack")(v) && v["seq"] == json!(2)).await?;
    assert_eq!(ack["conv"], json!("a"));
    assert_eq!(c.cursor("a"), 2);
    assert_eq!(c.stored_seqs("a"), vec![1, 2]);
    assert_eq!(c.stored("a")[1]["mid"], json!("new2"));
    // A push read before the move (epoch 1) is ignored.
    s.push.send(push_ev("a", 3))?;
    s.push.send(json!({"t": "event", "ev": moved(3)}))?;
    c.wait_cursor("a", 3, WAIT).await?;
    assert_eq!(c.stored("a")[2]["mid"], json!("new3"));
    let st = c.stats();
    assert_eq!((st.epoch_moves, st.stale_epoch_frames), (1, 1));
    // The move is durable: a restarted client knows epoch 2.
    c.crash().await;
    let c2 = Client::load(&dir.state(), None)?;
    assert_eq!(c2.stored_seqs("a"), vec![1, 2, 3]);
    Ok(())
}

/// The client with automatic acks that never fire on their own (the test begins them),
/// connected to a fake whose sync answers the moved conversation `a` (epoch 2, seqs 1
/// and 2) and that answers acks only when the test pushes the reply; `a` holds seqs 1..=3
/// of epoch 1.
async fn moved_epoch_setup(dir: &TestDir) -> anyhow::Result<(Client, Fake)> {
    let s = fake(Arc::new(move |req: &Value| match field_str(req, "t") {
        Some("hello") => vec![welcome(req)],
        Some("sync") => vec![reply(
            req,
            "synced",
            json!({"conv": "a", "events": [moved(1), moved(2)], "head": 2, "complete": true}),
        )],
        _ => vec![],
    }))
    .await?;
    let mut c = Client::create(&dir.state(), "d1", "t", 1, None)?.with_options(ClientOptions {
        ack_every: 100,
        ack_after: Duration::from_secs(600),
        ..ClientOptions::default()
    });
    c.connect(&s.url).await?;
    for seq in 1..=3 {
        s.push.send(push_ev("a", seq))?;
    }
    c.wait_cursor("a", 3, WAIT).await?;
    Ok((c, s))
}

/// Moves `a` to epoch 2 (the fake's sync answers seqs 1 and 2 of it) and waits until
/// the client resynced.
async fn move_the_epoch(c: &Client, s: &mut Fake) -> anyhow::Result<()> {
    s.push.send(json!({"t": "event", "ev": moved(2)}))?;
    expect(&mut s.got, WAIT, is("sync")).await?;
    c.wait_for("the resync of epoch 2", WAIT, |c| {
        c.stats().epoch_moves == 1 && c.cursor("a") == 2 && c.stored_seqs("a") == vec![1, 2]
    })
    .await?;
    Ok(())
}

/// What the delivery core of `c` believes of `a`: (acked, an ack is due).
fn owed(c: &Client) -> (i64, bool) {
    let st = c.inner.lock();
    (st.delivery.acked("a"), st.delivery.next_due().is_some())
}

/// Issue 21 with an ack on its way: an automatic ack chosen under epoch 1 and answered
/// after the epoch moved is not the new epoch's ack. Its answer (`delivered` 3) must not
/// tell the forgotten-and-resynced conversation that the server has seq 3, or the new
/// epoch's seqs 1 and 2 are never acked (`a_moved_epoch_discards_the_conversation_and_
/// syncs_from_zero` once waited in vain for the ack of 2, in a whole suite under load).
#[tokio::test]
async fn an_ack_answered_after_the_epoch_moved_leaves_the_new_epochs_ack_owed() -> anyhow::Result<()>
{
    let dir = TestDir::new("epoch-ack-answered")?;
    let (c, mut s) = moved_epoch_setup(&dir).await?;
    let inner = c.inner.clone();
    let acking = tokio::spawn(async move { inner.auto_ack("a").await });
    let (_, ack) = expect(&mut s.got, WAIT, is("ack")).await?;
    assert_eq!(ack["seq"], json!(3), "the ack of epoch 1 left");
    move_the_epoch(&c, &mut s).await?;
    assert_eq!(
        owed(&c),
        (0, true),
        "epoch 2's ack is owed before the old answer"
    );
    s.push
        .send(reply(&ack, "acked", json!({"conv": "a", "delivered": 3})))?;
    acking.await?;
    assert_eq!(
        owed(&c),
        (0, true),
        "epoch 1's answer did not pay epoch 2's ack"
    );
    Ok(())
}

/// Issue 21 with an ack about to leave: an automatic ack chosen under epoch 1 does not
/// leave after the epoch moved, and its failure must not cancel the new epoch's
/// coalesced ack (a non-retryable failure clears the core's timer).
#[tokio::test]
async fn an_ack_chosen_before_the_epoch_moved_stays_home_and_cancels_nothing() -> anyhow::Result<()>
{
    let dir = TestDir::new("epoch-ack-chosen")?;
    let (c, mut s) = moved_epoch_setup(&dir).await?;
    let (target, timeout, epoch) = c.inner.begin_auto_ack("a").expect("an ack of 3 is due");
    assert_eq!((target, epoch), (3, Some(1)));
    move_the_epoch(&c, &mut s).await?;
    c.inner.finish_auto_ack("a", target, timeout, epoch).await;
    assert!(
        !c.sent_frames().iter().any(|(_, f)| is("ack")(f)),
        "the ack chosen under epoch 1 never left"
    );
    assert_eq!(owed(&c), (0, true), "epoch 2's ack is still owed");
    Ok(())
}
