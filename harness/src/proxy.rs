//! A TCP proxy of the harness (issue 11, failover): "the database address" that can move.
//!
//! Owns: a listener on 127.0.0.1 (port 0), one upstream address that [`Proxy::switch`]
//! replaces (resetting every connection made to the old one, as a virtual IP moving to a
//! promoted standby does), and an optional one-way delay per direction (a replication link
//! with latency). It runs on its own thread with its own tokio runtime, so a test blocking
//! its own thread, or a current-thread test runtime, never stalls the bytes.
//!
//! A proxy started with [`Proxy::start_controlled`] also takes a [`Condition`] at any time
//! (issue 10, the nemesis's network faults on the gateway↔PostgreSQL and client↔gateway
//! paths): added latency, a blackhole (bytes and new connections held, not refused, until
//! the condition ends, as a partition that heals without resetting TCP), or a bandwidth
//! limit; [`Proxy::cut`] is the connection reset.
//!
//! Must not: look at the bytes (it is PostgreSQL's wire protocol or anything else).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

/// Bytes in flight per direction of a delayed connection, in chunks.
const DELAY_QUEUE_CHUNKS: usize = 1024;

/// What a controlled proxy does to the bytes now ([`Proxy::set_condition`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum Condition {
    /// Forward as they come.
    #[default]
    Pass,
    /// Hold every chunk this long (one way), in order.
    Latency { ms: u64 },
    /// Forward nothing, and connect nothing upstream, until the condition changes; the
    /// bytes are kept and go on afterwards (a partition that heals).
    Blackhole,
    /// At most this many bytes per second per direction of each connection.
    Bandwidth { bytes_per_s: u64 },
}

struct Shared {
    /// The current condition (controlled proxies only).
    condition: tokio::sync::watch::Sender<Condition>,
    /// Whether every connection goes through the condition-aware pipe.
    controlled: bool,
    /// Where new connections go.
    upstream: Mutex<SocketAddr>,
    /// Bumped by a switch: every connection opened under an older value is closed.
    generation: tokio::sync::watch::Sender<u64>,
    /// One-way delay added to every chunk, both directions.
    delay: Duration,
    /// Connections accepted.
    accepted: AtomicU64,
    /// Connections closed by a switch.
    reset: AtomicU64,
    /// Connections whose upstream refused or failed to connect.
    refused: AtomicU64,
}

/// A running proxy; dropping it stops it and closes every connection.
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Proxy {
    /// Starts a proxy to `upstream` with `delay` added to every chunk in each direction.
    pub fn start(upstream: SocketAddr, delay: Duration) -> anyhow::Result<Proxy> {
        Proxy::start_inner(upstream, delay, false)
    }

    /// A proxy to `upstream` whose [`Condition`] can be changed while it runs.
    pub fn start_controlled(upstream: SocketAddr) -> anyhow::Result<Proxy> {
        Proxy::start_inner(upstream, Duration::ZERO, true)
    }

    /// Changes the condition of a controlled proxy (open connections included).
    pub fn set_condition(&self, c: Condition) {
        assert!(
            self.shared.controlled,
            "set_condition on a proxy not started with start_controlled"
        );
        self.shared.condition.send_replace(c);
    }

    /// The current condition.
    pub fn condition(&self) -> Condition {
        *self.shared.condition.borrow()
    }

    fn start_inner(
        upstream: SocketAddr,
        delay: Duration,
        controlled: bool,
    ) -> anyhow::Result<Proxy> {
        let std_listener =
            std::net::TcpListener::bind("127.0.0.1:0").context("bind the proxy listener")?;
        std_listener
            .set_nonblocking(true)
            .context("proxy listener non-blocking")?;
        let addr = std_listener.local_addr().context("proxy local_addr")?;
        let (generation, _) = tokio::sync::watch::channel(0u64);
        let shared = Arc::new(Shared {
            condition: tokio::sync::watch::channel(Condition::Pass).0,
            controlled,
            upstream: Mutex::new(upstream),
            generation,
            delay,
            accepted: AtomicU64::new(0),
            reset: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        });
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let s = shared.clone();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("build the proxy runtime")?;
        let thread = std::thread::Builder::new()
            .name(format!("proxy-{}", addr.port()))
            .spawn(move || {
                rt.block_on(async move {
                    let Ok(listener) = TcpListener::from_std(std_listener) else {
                        return;
                    };
                    tokio::select! {
                        _ = stop_rx => {}
                        _ = accept_loop(listener, s) => {}
                    }
                });
            })
            .context("spawn the proxy thread")?;
        Ok(Proxy {
            addr,
            shared,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// The proxy's own address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The upstream new connections go to.
    pub fn upstream(&self) -> SocketAddr {
        *self
            .shared
            .upstream
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Moves the address: new connections go to `upstream`, every open one is closed.
    pub fn switch(&self, upstream: SocketAddr) {
        *self
            .shared
            .upstream
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = upstream;
        self.shared.generation.send_modify(|g| *g += 1);
    }

    /// Closes every open connection at once, throwing away the bytes still held back by
    /// the delay (they had not left the machine that died); new connections still go to
    /// the same upstream.
    pub fn cut(&self) {
        self.shared.generation.send_modify(|g| *g += 1);
    }

    /// Counters: accepted, reset by a switch, refused by the upstream.
    pub fn stats(&self) -> serde_json::Value {
        serde_json::json!({
            "accepted": self.shared.accepted.load(Ordering::Relaxed),
            "reset_by_switch": self.shared.reset.load(Ordering::Relaxed),
            "upstream_refused": self.shared.refused.load(Ordering::Relaxed),
            "delay_ms": self.shared.delay.as_secs_f64() * 1000.0,
        })
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn accept_loop(listener: TcpListener, s: Arc<Shared>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        s.accepted.fetch_add(1, Ordering::Relaxed);
        let s = s.clone();
        tokio::spawn(async move {
            let mut gen = s.generation.subscribe();
            if s.controlled {
                // A blackhole holds new connections too (a SYN that gets no answer).
                let mut cond = s.condition.subscribe();
                let _ = cond.wait_for(|c| *c != Condition::Blackhole).await;
            }
            let upstream = *s.upstream.lock().unwrap_or_else(|p| p.into_inner());
            let server = match TcpStream::connect(upstream).await {
                Ok(server) => server,
                Err(_) => {
                    s.refused.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            let delay = s.delay;
            let piped = async {
                if s.controlled {
                    tokio::join!(
                        controlled_pipe(cr, sw, s.condition.subscribe()),
                        controlled_pipe(sr, cw, s.condition.subscribe())
                    );
                } else {
                    tokio::join!(pipe(cr, sw, delay), pipe(sr, cw, delay));
                }
            };
            tokio::select! {
                _ = piped => {}
                _ = gen.changed() => {
                    s.reset.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    }
}

/// Copies one direction until EOF or an error, each chunk held back `delay`.
async fn pipe(mut r: OwnedReadHalf, mut w: OwnedWriteHalf, delay: Duration) {
    if delay.is_zero() {
        let _ = tokio::io::copy(&mut r, &mut w).await;
        let _ = w.shutdown().await;
        return;
    }
    let (tx, mut rx) =
        tokio::sync::mpsc::channel::<(tokio::time::Instant, Vec<u8>)>(DELAY_QUEUE_CHUNKS);
    let reader = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let at = tokio::time::Instant::now() + delay;
                    if tx.send((at, buf[..n].to_vec())).await.is_err() {
                        break;
                    }
                }
            }
        }
    };
    let writer = async move {
        while let Some((at, chunk)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            if w.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = w.shutdown().await;
    };
    tokio::join!(reader, writer);
}

/// Copies one direction under the proxy's current [`Condition`]: each chunk is stamped
/// with the latency in force when it was read, then held while the proxy is a blackhole,
/// until its time, and paced to the bandwidth limit.
async fn controlled_pipe(
    mut r: OwnedReadHalf,
    mut w: OwnedWriteHalf,
    cond: tokio::sync::watch::Receiver<Condition>,
) {
    let (tx, mut rx) =
        tokio::sync::mpsc::channel::<(tokio::time::Instant, Vec<u8>)>(DELAY_QUEUE_CHUNKS);
    let reader_cond = cond.clone();
    let reader = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let latency = match *reader_cond.borrow() {
                        Condition::Latency { ms } => Duration::from_millis(ms),
                        _ => Duration::ZERO,
                    };
                    let at = tokio::time::Instant::now() + latency;
                    if tx.send((at, buf[..n].to_vec())).await.is_err() {
                        break;
                    }
                }
            }
        }
    };
    let writer = async move {
        let mut cond = cond;
        while let Some((at, chunk)) = rx.recv().await {
            if cond.wait_for(|c| *c != Condition::Blackhole).await.is_err() {
                return;
            }
            tokio::time::sleep_until(at).await;
            let limit = match *cond.borrow() {
                Condition::Bandwidth { bytes_per_s } if bytes_per_s > 0 => Some(bytes_per_s),
                _ => None,
            };
            match limit {
                None => {
                    if w.write_all(&chunk).await.is_err() {
                        return;
                    }
                }
                Some(bps) => {
                    // Paced in slices of a tenth of a second's budget.
                    let slice = (bps / 10).max(1) as usize;
                    for part in chunk.chunks(slice) {
                        if w.write_all(part).await.is_err() {
                            return;
                        }
                        let secs = part.len() as f64 / bps as f64;
                        tokio::time::sleep(Duration::from_secs_f64(secs)).await;
                    }
                }
            }
        }
        let _ = w.shutdown().await;
    };
    tokio::join!(reader, writer);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Proves bytes go through, a switch closes the open connection and new ones reach
    /// the new upstream, and the delay holds chunks back.
    #[tokio::test]
    async fn forwards_switches_and_delays() -> anyhow::Result<()> {
        async fn echo(tag: u8) -> anyhow::Result<SocketAddr> {
            let l = TcpListener::bind("127.0.0.1:0").await?;
            let addr = l.local_addr()?;
            tokio::spawn(async move {
                while let Ok((mut s, _)) = l.accept().await {
                    tokio::spawn(async move {
                        let mut b = [0u8; 1];
                        while let Ok(1) = s.read(&mut b).await {
                            if s.write_all(&[tag]).await.is_err() {
                                break;
                            }
                        }
                    });
                }
            });
            Ok(addr)
        }
        let (a, b) = (echo(b'a').await?, echo(b'b').await?);
        let p = Proxy::start(a, Duration::from_millis(30))?;
        let mut c = TcpStream::connect(p.addr()).await?;
        let t0 = std::time::Instant::now();
        c.write_all(b"x").await?;
        let mut r = [0u8; 1];
        c.read_exact(&mut r).await?;
        assert_eq!(&r, b"a");
        assert!(
            t0.elapsed() >= Duration::from_millis(60),
            "{:?}",
            t0.elapsed()
        );
        p.switch(b);
        let n = tokio::time::timeout(Duration::from_secs(2), c.read(&mut r)).await??;
        assert_eq!(n, 0, "the old connection was closed");
        let mut c = TcpStream::connect(p.addr()).await?;
        c.write_all(b"y").await?;
        c.read_exact(&mut r).await?;
        assert_eq!(&r, b"b");
        Ok(())
    }

    /// A controlled proxy holds bytes in a blackhole and lets them go when it heals, adds
    /// latency when told, and paces to a bandwidth limit.
    #[tokio::test]
    async fn controlled_blackhole_latency_bandwidth() -> anyhow::Result<()> {
        let l = TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.into_split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        let p = Proxy::start_controlled(addr)?;
        let mut c = TcpStream::connect(p.addr()).await?;
        let mut r = [0u8; 1];
        c.write_all(b"a").await?;
        c.read_exact(&mut r).await?;
        p.set_condition(Condition::Blackhole);
        c.write_all(b"b").await?;
        let held = tokio::time::timeout(Duration::from_millis(200), c.read_exact(&mut r)).await;
        assert!(held.is_err(), "a blackhole forwarded a byte");
        p.set_condition(Condition::Pass);
        tokio::time::timeout(Duration::from_secs(2), c.read_exact(&mut r)).await??;
        assert_eq!(&r, b"b", "the held byte goes on after the heal");
        p.set_condition(Condition::Latency { ms: 80 });
        let t0 = std::time::Instant::now();
        c.write_all(b"c").await?;
        c.read_exact(&mut r).await?;
        assert!(
            t0.elapsed() >= Duration::from_millis(160),
            "{:?}",
            t0.elapsed()
        );
        p.set_condition(Condition::Bandwidth {
            bytes_per_s: 20_000,
        });
        let t0 = std::time::Instant::now();
        let mut big = vec![0u8; 10_000];
        c.write_all(&big).await?;
        c.read_exact(&mut big).await?;
        assert!(
            t0.elapsed() >= Duration::from_millis(400),
            "{:?}",
            t0.elapsed()
        );
        Ok(())
    }
}
