//! Connection scale (issue 19, item 6): one gateway holding many subscribed, idle WebSocket
//! connections. The bench raises its own open-file limit to the hard limit (the gateway,
//! its child, inherits it), connects from source addresses spread over 127.0.0.0/8 (past
//! the ephemeral ports of one address and the gateway's per-address cap), says `hello` and
//! `sub` on each, and measures: hellos/s while connecting, the gateway's resident memory
//! per connection (from `/proc/PID/status`, before and after), push latency to an active
//! set of 1% of the connections while all are connected, and the sweep's database time per
//! interval at that count (`pg_stat_statements`). What stopped it short of the target (the
//! open-file limit, a refused connection) is recorded, never hidden.

use anyhow::{bail, Context};
use futures_util::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpSocket;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::MaybeTlsStream;

use im_protocol::wire::{Reply, Request};

use crate::provision::{self, Device};
use crate::util::{progress, r3, summarize_us, unix_us, Latency};
use crate::wire::{self, Ws};
use crate::Ctx;

/// Connections per source address (under the gateway's `IM_CONNS_PER_ADDR_MAX`, 256).
const PER_ADDR: usize = 200;
/// Open files kept for everything else (the pool, the gateway's own, logs).
const FD_MARGIN: u64 = 512;
/// Members of one idle conversation; active conversations have this many receivers too.
const CONV_MEMBERS: usize = 10;
/// The gateway's sweep interval here (its default).
const SWEEP_MS: u64 = 1000;
/// Most time one connection may take to connect, upgrade, hello and sub.
const OPEN_WITHIN: Duration = Duration::from_secs(30);
/// Handshakes in flight at once while connecting.
const CONNECTING_AT_ONCE: usize = 64;

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Conns {
    /// Connections asked for.
    pub target: usize,
    /// Connections that said hello, subscribed and stayed open to the end.
    pub held: usize,
    /// Why fewer than `target` were opened (`None` when all were).
    pub short_because: Option<String>,
    /// The bench's open-file limit (soft, hard) after raising the soft one.
    pub nofile_soft: u64,
    pub nofile_hard: u64,
    /// Hellos (connect, upgrade, hello, sub) per second over the whole connecting phase.
    pub hellos_per_s: f64,
    /// The gateway's VmRSS before the first connection and with all of them open, KiB.
    pub rss_before_kib: u64,
    pub rss_after_kib: u64,
    /// `(after - before) / held`, KiB.
    pub rss_per_conn_kib: f64,
    /// Receivers of the active set (1% of `held`) and the messages sent to them.
    pub active_receivers: usize,
    pub messages: u64,
    /// Push latency (send to receipt) at the active set, all connections open.
    pub push_latency: Latency,
    /// Pushes expected at the active set and pushes that did not come.
    pub pushes_expected: u64,
    pub pushes_missing: u64,
    /// The sweep's database time per interval with all connections open (`None` without
    /// `pg_stat_statements`).
    pub sweep_db_ms_per_interval: Option<f64>,
}

/// Raises the soft open-file limit to the hard one; returns (soft, hard).
fn raise_nofile() -> (u64, u64) {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) => {
            if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
                (hard, hard)
            } else {
                (soft, hard)
            }
        }
        Err(_) => (0, 0),
    }
}

/// VmRSS of `pid`, KiB.
fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("read /proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .context("no VmRSS line")
}

/// The `i`-th source address: 127.1.0.1, 127.1.0.2, … (never 127.0.0.1, the bench's own).
fn source(i: usize) -> Ipv4Addr {
    let n = (i / PER_ADDR) as u32 + 1;
    Ipv4Addr::new(127, 1 + (n >> 16) as u8, (n >> 8) as u8, n as u8)
}

/// Connects from `from`, upgrades, says hello and subscribes.
async fn open_from(from: Ipv4Addr, to: SocketAddr, url: &str, d: &Device) -> anyhow::Result<Ws> {
    let sock = TcpSocket::new_v4()?;
    sock.bind(SocketAddr::new(from.into(), 0))
        .with_context(|| format!("bind {from}"))?;
    let tcp = sock
        .connect(to)
        .await
        .with_context(|| format!("connect from {from}"))?;
    tcp.set_nodelay(true)?;
    // Small read buffers: tungstenite's default (128 KiB, filled to capacity) would cost the
    // bench gigabytes at this count.
    let config = WebSocketConfig::default().read_buffer_size(4096);
    let (mut ws, _) =
        tokio_tungstenite::client_async_with_config(url, MaybeTlsStream::Plain(tcp), Some(config))
            .await
            .context("upgrade")?;
    let hello = wire::hello_frame(&d.id, &d.token);
    let r = wire::request(&mut ws, hello, "h", Duration::from_secs(30)).await?;
    if !matches!(
        r,
        wire::ServerFrame::Reply {
            reply: Reply::Welcome { .. },
            ..
        }
    ) {
        bail!("hello of {} answered {}", d.id, wire::answered(&r));
    }
    wire::sub(&mut ws).await?;
    Ok(ws)
}

/// An idle connection: read (answers pings) until it closes; counts it closed.
fn idle(mut ws: Ws, closed: Arc<Mutex<usize>>) {
    tokio::spawn(async move {
        while let Some(Ok(_)) = ws.next().await {}
        *closed.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    });
}

/// An active receiver: acks every push and records its latency from the send time in its
/// body (unix µs).
fn receive(mut ws: Ws, lat: Arc<Mutex<Vec<i64>>>, closed: Arc<Mutex<usize>>) {
    tokio::spawn(async move {
        while let Some(Ok(msg)) = ws.next().await {
            let Message::Text(t) = msg else { continue };
            let Some(wire::ServerFrame::Event(ev)) = wire::parse(t.as_str()) else {
                continue;
            };
            if let Ok(sent_us) = ev.body.parse::<i64>() {
                lat.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(unix_us() - sent_us);
            }
            let rid = format!("a-{}-{}", ev.conv, ev.seq);
            let ack = Request::Ack {
                conv: ev.conv,
                seq: ev.seq,
            };
            if ws.send(Message::text(ack.to_frame(&rid))).await.is_err() {
                break;
            }
        }
        *closed.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    });
}

/// Who is connected in the part: one user per device plus the sender; the first
/// `active_n` devices' conversations get the sender's messages, the others stay idle.
struct Plan {
    devices: Vec<Device>,
    sender: Device,
    /// (conversation, receivers in it) of every active conversation.
    active_convs: Vec<(String, usize)>,
    active_n: usize,
}

impl Plan {
    /// The devices and conversations for `n` connections, provisioned.
    async fn provision(ctx: &Ctx, n: usize) -> anyhow::Result<Plan> {
        let active_n = (n / 100).max(CONV_MEMBERS);
        let devices: Vec<Device> = (0..n)
            .map(|i| Device::new(format!("cn-d{i}"), &format!("cn-u{i}")))
            .collect();
        let mut users: Vec<String> = devices.iter().map(|d| d.user.clone()).collect();
        users.push("cn-sender".into());
        let sender = Device::new("cn-ds".into(), "cn-sender");
        let mut all = devices.clone();
        all.push(sender.clone());
        // Active conversations: the first `active_n` devices, CONV_MEMBERS receivers each,
        // and the sender. Idle conversations: the rest, CONV_MEMBERS members each.
        let mut convs: Vec<(String, Vec<String>)> = Vec::new();
        let mut active_convs = Vec::new();
        for (k, chunk) in devices[..active_n].chunks(CONV_MEMBERS).enumerate() {
            let id = format!("cn-a{k}");
            let mut members: Vec<String> = chunk.iter().map(|d| d.user.clone()).collect();
            members.push("cn-sender".into());
            active_convs.push((id.clone(), chunk.len()));
            convs.push((id, members));
        }
        for (k, chunk) in devices[active_n..].chunks(CONV_MEMBERS).enumerate() {
            let members = chunk.iter().map(|d| d.user.clone()).collect();
            convs.push((format!("cn-i{k}"), members));
        }
        progress(&format!("[conns] provisioning {n} devices"));
        provision::world(&ctx.pool, &users, &all, &convs).await?;
        Ok(Plan {
            devices,
            sender,
            active_convs,
            active_n,
        })
    }
}

/// What connecting everyone left behind.
struct Connected {
    held: usize,
    /// The first connection that failed to open, if any.
    failure: Option<String>,
    /// Receivers of each active conversation that connected (the pushes to expect).
    active_ok: Vec<usize>,
    connecting_s: f64,
    /// Push latencies (µs) the active receivers record, and how many connections closed.
    lat: Arc<Mutex<Vec<i64>>>,
    closed: Arc<Mutex<usize>>,
}

/// Connects every device of `plan`, CONNECTING_AT_ONCE at a time, until one fails.
async fn connect_all(plan: &Plan, addr: std::net::SocketAddr, url: &str) -> Connected {
    let n = plan.devices.len();
    let mut c = Connected {
        held: 0,
        failure: None,
        active_ok: vec![0usize; plan.active_convs.len()],
        connecting_s: 0.0,
        lat: Arc::new(Mutex::new(Vec::new())),
        closed: Arc::new(Mutex::new(0usize)),
    };
    let t0 = Instant::now();
    let mut next = 0usize;
    while next < n && c.failure.is_none() {
        let upto = (next + CONNECTING_AT_ONCE).min(n);
        let opened = futures_util::future::join_all((next..upto).map(|i| {
            let d = &plan.devices[i];
            async move {
                let r = tokio::time::timeout(OPEN_WITHIN, open_from(source(i), addr, url, d))
                    .await
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("not open within {OPEN_WITHIN:?}")));
                (i, r)
            }
        }))
        .await;
        for (i, r) in opened {
            match r {
                Ok(ws) if i < plan.active_n => {
                    c.held += 1;
                    c.active_ok[i / CONV_MEMBERS] += 1;
                    receive(ws, c.lat.clone(), c.closed.clone());
                }
                Ok(ws) => {
                    c.held += 1;
                    idle(ws, c.closed.clone());
                }
                Err(e) => {
                    c.failure
                        .get_or_insert_with(|| format!("connection {i}: {e:#}"));
                }
            }
        }
        next = upto;
        if next % 2000 < CONNECTING_AT_ONCE {
            progress(&format!("[conns] {} of {n} connected", c.held));
        }
    }
    c.connecting_s = t0.elapsed().as_secs_f64();
    c
}

/// The sender sends `total` messages to the active conversations round-robin, one every
/// `gap`; returns the pushes to expect.
async fn send_active(
    ws: &mut wire::Ws,
    plan: &Plan,
    active_ok: &[usize],
    total: u64,
    gap: Duration,
) -> anyhow::Result<u64> {
    let mut expected = 0u64;
    let start = Instant::now();
    for m in 0..total {
        tokio::time::sleep_until(start + gap * m as u32).await;
        let k = m as usize % plan.active_convs.len();
        let conv = &plan.active_convs[k].0;
        let rid = format!("s{m}");
        let frame = wire::send_frame(&rid, conv, &format!("cn-{m}"), &unix_us().to_string());
        let r = wire::request(ws, frame, &rid, Duration::from_secs(10)).await?;
        if wire::sent(&r).is_none() {
            bail!("send {m} answered {}", wire::answered(&r));
        }
        expected += active_ok[k] as u64;
    }
    Ok(expected)
}

/// Starts the gateway for `n` connections: room for them all, the bench's sweep interval,
/// and enough handshakes and connections per address to open them quickly.
async fn start_gateway(ctx: &Ctx, n: usize) -> anyhow::Result<harness::gateway::Gateway> {
    let max = (n + 1024).to_string();
    let mut env = ctx.gateway_env.clone();
    env.extend([
        ("IM_SWEEP_MS".to_string(), SWEEP_MS.to_string()),
        ("IM_MAX_CONNECTIONS".to_string(), max),
        ("IM_HANDSHAKES_MAX".to_string(), "1024".to_string()),
        (
            "IM_CONNS_PER_ADDR_MAX".to_string(),
            (PER_ADDR + 16).to_string(),
        ),
    ]);
    let opts = harness::gateway::GatewayOpts {
        env,
        ..Default::default()
    };
    harness::gateway::Gateway::start(&ctx.cluster.url(), &opts, &ctx.cluster.log_dir()).await
}

/// The sweep statements' database milliseconds per sweep interval since `sweep_t0`, when
/// pg_stat_statements is on.
async fn sweep_db_ms_per_interval(ctx: &Ctx, sweep_t0: Instant) -> Option<f64> {
    if ctx.pgss {
        let stmts = crate::pgss::snapshot(&ctx.pool).await;
        let sweep_ms: f64 = stmts
            .iter()
            .filter(|s| s.label == "sweep")
            .map(|s| s.total_ms)
            .sum();
        let intervals = sweep_t0.elapsed().as_secs_f64() * 1000.0 / SWEEP_MS as f64;
        Some(r3(sweep_ms / intervals.max(1.0)))
    } else {
        None
    }
}

/// Opens up to `target` connections (fewer when the open-file limit is lower), measures,
/// and closes them.
pub async fn run(ctx: &Ctx, target: usize, send_s: f64, rate_per_s: f64) -> anyhow::Result<Conns> {
    let (soft, hard) = raise_nofile();
    let room = soft.saturating_sub(FD_MARGIN) as usize;
    let n = target.min(room);
    let short_because = (n < target).then(|| {
        format!(
            "the open-file limit: soft {soft}, hard {hard} (raising the hard limit needs \
             CAP_SYS_RESOURCE); {n} connections fit with {FD_MARGIN} files to spare"
        )
    });
    if n < 2 * CONV_MEMBERS {
        bail!("only {n} connections fit under the open-file limit (soft {soft}, hard {hard})");
    }
    let plan = Plan::provision(ctx, n).await?;
    let gw = start_gateway(ctx, n).await?;
    let (addr, url) = (gw.addr(), gw.ws_url());
    let rss_before_kib = rss_kib(gw.pid())?;
    let c = connect_all(&plan, addr, &url).await;
    let hellos_per_s = c.held as f64 / c.connecting_s.max(1e-9);
    let rss_after_kib = rss_kib(gw.pid())?;

    // The active set: the sender sends to the active conversations round-robin.
    let mut ws = wire::open(&url, &plan.sender.id, &plan.sender.token).await?;
    if ctx.pgss {
        crate::pgss::reset(&ctx.pool).await;
    }
    let sweep_t0 = Instant::now();
    let total = (send_s * rate_per_s).round() as u64;
    let gap = Duration::from_secs_f64(1.0 / rate_per_s.max(1.0));
    let expected = send_active(&mut ws, &plan, &c.active_ok, total, gap).await?;
    // Every push, or a deadline of 5 s after the last send.
    let deadline = Instant::now() + Duration::from_secs(5);
    while (c.lat.lock().unwrap_or_else(|p| p.into_inner()).len() as u64) < expected
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let sweep_db_ms_per_interval = sweep_db_ms_per_interval(ctx, sweep_t0).await;
    let mut samples = c.lat.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let got = samples.len() as u64;
    let closed_early = *c.closed.lock().unwrap_or_else(|p| p.into_inner());
    drop(ws);
    drop(gw);
    let held = c.held.saturating_sub(closed_early);
    Ok(Conns {
        target,
        held,
        short_because: match (short_because, c.failure) {
            (None, None) => None,
            (a, b) => Some([a, b].into_iter().flatten().collect::<Vec<_>>().join("; ")),
        },
        nofile_soft: soft,
        nofile_hard: hard,
        hellos_per_s: r3(hellos_per_s),
        rss_before_kib,
        rss_after_kib,
        rss_per_conn_kib: r3(
            rss_after_kib.saturating_sub(rss_before_kib) as f64 / held.max(1) as f64
        ),
        active_receivers: plan.active_n,
        messages: total,
        push_latency: summarize_us(&mut samples),
        pushes_expected: expected,
        pushes_missing: expected.saturating_sub(got),
        sweep_db_ms_per_interval,
    })
}
