//! HAProxy in front of several gateways (issue 21): the clients' one address, as a
//! deployment has it. The harness starts Debian's `haproxy` as its own child process (in
//! the foreground, `-db`), in TCP mode with health checks every 200 ms, and points its
//! servers at the gateways; a gateway started again on another port is pointed at through
//! HAProxy's runtime API (its admin socket), so the clients' address never changes.
//!
//! Owns: the HAProxy process, its configuration and admin socket (in a temporary
//! directory), and the servers' addresses. Must not: start or stop gateways (the world
//! does), or look at the bytes it forwards.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use nix::sys::signal::Signal;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

use crate::process::set_parent_death_signal;

/// How often HAProxy checks each gateway, and after how many failures it stops sending new
/// connections there.
const CHECK_INTER_MS: u64 = 200;
const CHECK_FALL: u32 = 2;
/// How long HAProxy may take to listen (it takes about 40 ms here).
const START_WITHIN: Duration = Duration::from_secs(5);

/// The running balancer; killed on drop.
pub struct Balancer {
    child: Child,
    addr: SocketAddr,
    admin: PathBuf,
    servers: usize,
    _dir: tempfile::TempDir,
}

/// Where `haproxy` is, or why it cannot run here.
pub fn haproxy_bin() -> Result<PathBuf, String> {
    ["/usr/sbin/haproxy", "/usr/bin/haproxy", "/usr/local/sbin/haproxy"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .ok_or_else(|| {
            "haproxy is not installed (Debian: apt-get install -y haproxy; `make setup` installs it as root)"
                .to_string()
        })
}

/// Connections HAProxy may hold: two descriptors each, within this process's open-file
/// limit (which it inherits and refuses to exceed).
fn maxconn() -> u64 {
    let soft = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map_or(1024, |(soft, _)| soft);
    (soft.saturating_sub(100) / 2).clamp(256, 50_000)
}

/// The configuration for `backends` behind `port`, its admin socket at `admin`.
fn config(port: u16, admin: &Path, backends: &[SocketAddr]) -> String {
    let mut c = format!(
        "global\n  maxconn {}\n  stats socket {} mode 600 level admin\n\
         defaults\n  mode tcp\n  timeout connect 2s\n  timeout client 1h\n  timeout server 1h\n\
         frontend clients\n  bind 127.0.0.1:{port}\n  default_backend gateways\n\
         backend gateways\n  balance leastconn\n  option redispatch\n  retries 2\n",
        maxconn(),
        admin.display()
    );
    for (i, b) in backends.iter().enumerate() {
        c.push_str(&format!(
            "  server gw{i} {b} check inter {CHECK_INTER_MS}ms fall {CHECK_FALL} rise 1\n"
        ));
    }
    c
}

impl Balancer {
    /// Starts HAProxy in front of `backends` and waits until it accepts connections.
    pub async fn start(backends: &[SocketAddr]) -> anyhow::Result<Balancer> {
        let bin = haproxy_bin().map_err(|e| anyhow::anyhow!(e))?;
        anyhow::ensure!(
            !backends.is_empty(),
            "a balancer needs at least one gateway"
        );
        let dir = tempfile::Builder::new()
            .prefix("imfault-haproxy-")
            .tempdir()
            .context("make the HAProxy directory")?;
        let admin = dir.path().join("admin.sock");
        let port = crate::pg::free_port()?;
        let cfg = dir.path().join("haproxy.cfg");
        std::fs::write(&cfg, config(port, &admin, backends)).context("write haproxy.cfg")?;
        let log = std::fs::File::create(dir.path().join("haproxy.log"))?;
        let mut cmd = Command::new(&bin);
        cmd.arg("-db")
            .arg("-f")
            .arg(&cfg)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        set_parent_death_signal(&mut cmd, Signal::SIGKILL);
        let child = cmd
            .spawn()
            .with_context(|| format!("start {}", bin.display()))?;
        let mut b = Balancer {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            admin,
            servers: backends.len(),
            _dir: dir,
        };
        let deadline = Instant::now() + START_WITHIN;
        loop {
            if let Some(status) = b.child.try_wait()? {
                anyhow::bail!(
                    "haproxy exited at start ({status}): {}",
                    std::fs::read_to_string(b._dir.path().join("haproxy.log")).unwrap_or_default()
                );
            }
            let listens = tokio::net::TcpStream::connect(b.addr).await.is_ok();
            if listens && b.admin.exists() {
                return Ok(b);
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "haproxy (pid {}, {}) did not listen within {START_WITHIN:?}: port {} {}, admin \
                 socket {}; its log:\n{}",
                b.child.id(),
                process_state(b.child.id()),
                b.addr.port(),
                if listens { "answers" } else { "refused" },
                if b.admin.exists() { "there" } else { "missing" },
                std::fs::read_to_string(b._dir.path().join("haproxy.log")).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The clients' address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `ws://ADDR/ws` through the balancer.
    pub fn ws_url(&self) -> String {
        format!("ws://{}/ws", self.addr)
    }

    /// One command on the runtime API; its answer.
    pub async fn admin(&self, cmd: &str) -> anyhow::Result<String> {
        let mut s = UnixStream::connect(&self.admin)
            .await
            .context("connect to the HAProxy admin socket")?;
        s.write_all(format!("{cmd}\n").as_bytes()).await?;
        let mut out = String::new();
        let mut r = BufReader::new(s);
        while r.read_line(&mut out).await? > 0 {}
        Ok(out)
    }

    /// Points server `i` (gateway `i`) at `addr`, e.g. after that gateway started again on
    /// another port.
    pub async fn set_server(&self, i: usize, addr: SocketAddr) -> anyhow::Result<()> {
        anyhow::ensure!(
            i < self.servers,
            "no server gw{i} (there are {})",
            self.servers
        );
        let r = self
            .admin(&format!(
                "set server gateways/gw{i} addr {} port {}",
                addr.ip(),
                addr.port()
            ))
            .await?;
        anyhow::ensure!(
            !r.to_lowercase().contains("error") && !r.contains("No such"),
            "haproxy refused the address of gw{i}: {r}"
        );
        Ok(())
    }

    /// Each server's health as HAProxy sees it: (name, `UP`/`DOWN`/…).
    pub async fn states(&self) -> anyhow::Result<Vec<(String, String)>> {
        let csv = self.admin("show stat").await?;
        Ok(csv
            .lines()
            .filter(|l| l.starts_with("gateways,gw"))
            .filter_map(|l| {
                let f: Vec<&str> = l.split(',').collect();
                Some((f.get(1)?.to_string(), f.get(17)?.to_string()))
            })
            .collect())
    }
}

/// A process's state as `/proc/PID/stat` has it (`R` running, `S` sleeping, `T` stopped...),
/// for an error that must say why a child did not do what it was started for.
fn process_state(pid: u32) -> String {
    match crate::process::stat(pid) {
        Ok(Some((_, _, state))) => format!("state {state}"),
        Ok(None) => "state ?".to_string(),
        Err(e) => format!("no /proc entry: {e}"),
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configuration_names_each_gateway_with_its_health_check() {
        let a: SocketAddr = "127.0.0.1:4001".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:4002".parse().unwrap();
        let c = config(9000, Path::new("/tmp/x.sock"), &[a, b]);
        assert!(c.contains("bind 127.0.0.1:9000"));
        assert!(c.contains("server gw0 127.0.0.1:4001 check inter 200ms fall 2 rise 1"));
        assert!(c.contains("server gw1 127.0.0.1:4002 check"));
        assert!(c.contains("stats socket /tmp/x.sock mode 600 level admin"));
    }

    /// The balancer forwards to a live backend, sees a dead one DOWN within its checks,
    /// and follows a server moved through the runtime API.
    #[tokio::test]
    async fn forwards_checks_and_follows_a_moved_server() {
        if haproxy_bin().is_err() {
            println!("SKIPPED: {}", haproxy_bin().unwrap_err());
            return;
        }
        let echo = |greeting: &'static [u8]| async move {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            let task = tokio::spawn(async move {
                while let Ok((mut s, _)) = l.accept().await {
                    let _ = s.write_all(greeting).await;
                }
            });
            (addr, task)
        };
        let (a, ta) = echo(b"A").await;
        let (dead, td) = echo(b"D").await;
        td.abort();
        let _ = td.await;
        let bal = Balancer::start(&[dead, a]).await.unwrap();
        let read_one = |addr: SocketAddr| async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
            let mut buf = [0u8; 1];
            tokio::time::timeout(
                Duration::from_secs(2),
                tokio::io::AsyncReadExt::read_exact(&mut s, &mut buf),
            )
            .await
            .ok()?
            .ok()?;
            Some(buf[0])
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let st = bal.states().await.unwrap();
            if st.iter().any(|(n, s)| n == "gw0" && s == "DOWN") {
                break;
            }
            assert!(Instant::now() < deadline, "gw0 never DOWN: {st:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for _ in 0..4 {
            assert_eq!(read_one(bal.addr()).await, Some(b'A'));
        }
        // gw0 moved to a live backend: it comes UP and takes connections again.
        let (b, tb) = echo(b"B").await;
        bal.set_server(0, b).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut seen_b = false;
        while !seen_b {
            seen_b = read_one(bal.addr()).await == Some(b'B');
            assert!(Instant::now() < deadline, "gw0 never served after its move");
        }
        assert!(bal.set_server(2, b).await.is_err());
        ta.abort();
        tb.abort();
    }
}
