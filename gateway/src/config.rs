//! Configuration of `serve`, read from the environment (SPEC 2b). Owns the limits and their
//! defaults; it validates values but opens no sockets and touches no database.

use anyhow::{bail, Context};
use std::time::Duration;

/// Every limit the gateway enforces, with the variable that sets it.
#[derive(Clone, Debug)]
pub struct Config {
    /// `IM_DATABASE_URL`: the PostgreSQL the gateway stores everything in.
    pub database_url: String,
    /// `IM_LISTEN`: the address `serve` binds (port 0 picks one).
    pub listen: String,
    /// `IM_SWEEP_MS`: period of the redelivery sweep (D5).
    pub sweep_interval_ms: u64,
    /// `IM_DB_TIMEOUT_MS`: a request whose database work takes longer answers UNAVAILABLE.
    pub db_timeout_ms: u64,
    /// `IM_DB_POOL_MAX`: connections for requests, fan-out reads and the sweep (the pool has
    /// one more, for the LISTEN connection).
    pub db_pool_max: u32,
    /// `IM_MAX_CONNECTIONS`: WebSocket connections served at once (handshake finished); more
    /// are refused with 503. Handshakes in progress do not count (`handshakes_max` does).
    pub connections_max: usize,
    /// `IM_HANDSHAKES_MAX`: upgrade handshakes in progress at once, a pool of its own so that
    /// unfinished handshakes (slowloris) never take the slots of finished connections.
    pub handshakes_max: usize,
    /// `IM_HANDSHAKE_TIMEOUT_MS`: an upgrade request not complete by then is dropped.
    pub handshake_timeout_ms: u64,
    /// `IM_CONNS_PER_ADDR_MAX`: handshakes plus connections from one source IP address.
    pub conns_per_addr_max: usize,
    /// `IM_CONNS_PER_DEVICE_MAX`: authenticated connections of one device; the next `hello`
    /// gets UNAVAILABLE and a close.
    pub conns_per_device_max: usize,
    /// `IM_QUEUE_FRAMES_MAX`: outbound frames queued per connection before pushes overflow.
    pub queue_frames_max: usize,
    /// `IM_QUEUE_BYTES_MAX`: bytes of one connection's outbound frames, queued or being built
    /// (a sync page reserves its size before it is read). A reply that does not fit waits
    /// (only that connection slows); a push that does not fit overflows. Never below
    /// `sync_page_max_bytes`.
    pub queue_bytes_max: usize,
    /// `IM_FRAME_MAX_BYTES`: largest inbound text frame; larger gets TOO_LARGE and a close.
    pub frame_max_bytes: usize,
    /// `IM_BODY_MAX_BYTES`: largest message body; larger gets TOO_LARGE (connection stays).
    pub body_max_bytes: usize,
    /// `IM_SYNC_LIMIT_MAX`: largest sync page; a larger `limit` is clamped to it.
    pub sync_limit_max: i64,
    /// `IM_SYNC_PAGE_MAX_BYTES`: a sync page also ends (`complete:false`) past this much JSON.
    pub sync_page_max_bytes: usize,
    /// `IM_CONN_INFLIGHT_MAX`: requests of one connection served at once.
    pub conn_inflight_max: usize,
    /// `IM_FANOUT_BATCH_MAX`: notifications whose event reads may be in flight at once.
    pub fanout_inflight_max: usize,
    /// `IM_HELLO_TIMEOUT_MS`: a connection that has not said a good `hello` by then is closed.
    pub hello_timeout_ms: u64,
    /// `IM_HELLO_FAILS_PER_ADDR_PER_MIN`: failed hellos one source address may make per
    /// minute (a token bucket of this size refilled over a minute); past it a `hello` is
    /// answered UNAVAILABLE without checking anything.
    pub hello_fails_per_addr_per_min: u32,
    /// `IM_HELLO_FAILS_PER_DEVICE_PER_MIN`: the same per device id (known or not).
    pub hello_fails_per_device_per_min: u32,
    /// `IM_READ_IDLE_MS`: a peer from which nothing (not even a pong) arrived for this long
    /// is closed; after half of it in silence the gateway sends a ping.
    pub read_idle_ms: u64,
    /// `IM_WRITE_TIMEOUT_MS`: a frame the peer does not take within this time ends the
    /// connection (a client that stopped reading cannot pin a task forever).
    pub write_timeout_ms: u64,
    /// `IM_SHUTDOWN_GRACE_MS`: how long a graceful shutdown waits for connections to finish.
    pub shutdown_grace_ms: u64,
    /// `IM_FAULT`: fault specification (SPEC 4); empty means none.
    pub fault: String,
}

/// Most conversations listed in one `subbed` reply.
pub const SUB_CONVS_MAX: i64 = 10_000;

/// Default sync page size when a request omits `limit` (SPEC 2).
pub const SYNC_LIMIT_DEFAULT: i64 = 100;

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn num<T>(name: &str, default: T, min: T, max: T) -> anyhow::Result<T>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy,
{
    let Some(raw) = var(name) else {
        return Ok(default);
    };
    let v: T = raw
        .trim()
        .parse()
        .ok()
        .with_context(|| format!("{name}={raw:?} is not a number"))?;
    if v < min || v > max {
        bail!("{name}={v} is out of range {min}..={max}");
    }
    Ok(v)
}

/// `IM_DATABASE_URL`, required by every command.
pub fn database_url() -> anyhow::Result<String> {
    var("IM_DATABASE_URL").context("IM_DATABASE_URL is not set (e.g. postgres://user@host:5432/db)")
}

/// `IM_DB_TIMEOUT_MS` (default 5000).
pub fn db_timeout() -> anyhow::Result<Duration> {
    Ok(Duration::from_millis(num(
        "IM_DB_TIMEOUT_MS",
        5000u64,
        1,
        600_000,
    )?))
}

impl Config {
    pub fn from_env() -> anyhow::Result<Config> {
        let cfg = Config {
            database_url: database_url()?,
            listen: var("IM_LISTEN").unwrap_or_else(|| "127.0.0.1:8080".to_string()),
            sweep_interval_ms: num("IM_SWEEP_MS", 1000u64, 10, 3_600_000)?,
            db_timeout_ms: db_timeout()?.as_millis() as u64,
            db_pool_max: num("IM_DB_POOL_MAX", 16u32, 1, 1000)?,
            connections_max: num("IM_MAX_CONNECTIONS", 10_000usize, 1, 1_000_000)?,
            handshakes_max: num("IM_HANDSHAKES_MAX", 1024usize, 1, 1_000_000)?,
            handshake_timeout_ms: num("IM_HANDSHAKE_TIMEOUT_MS", 3000u64, 10, 600_000)?,
            conns_per_addr_max: num("IM_CONNS_PER_ADDR_MAX", 256usize, 1, 1_000_000)?,
            conns_per_device_max: num("IM_CONNS_PER_DEVICE_MAX", 8usize, 1, 10_000)?,
            queue_frames_max: num("IM_QUEUE_FRAMES_MAX", 256usize, 2, 1_000_000)?,
            queue_bytes_max: num("IM_QUEUE_BYTES_MAX", 2usize << 20, 4096, 1 << 30)?,
            frame_max_bytes: num("IM_FRAME_MAX_BYTES", 65_536usize, 256, 16 << 20)?,
            body_max_bytes: num("IM_BODY_MAX_BYTES", 16_384usize, 1, 8 << 20)?,
            sync_limit_max: num("IM_SYNC_LIMIT_MAX", 500i64, 1, 10_000)?,
            sync_page_max_bytes: num("IM_SYNC_PAGE_MAX_BYTES", 1usize << 20, 1024, 64 << 20)?,
            conn_inflight_max: num("IM_CONN_INFLIGHT_MAX", 8usize, 1, 1024)?,
            fanout_inflight_max: num("IM_FANOUT_BATCH_MAX", 16usize, 1, 1024)?,
            hello_timeout_ms: num("IM_HELLO_TIMEOUT_MS", 10_000u64, 10, 3_600_000)?,
            hello_fails_per_addr_per_min: num(
                "IM_HELLO_FAILS_PER_ADDR_PER_MIN",
                30u32,
                1,
                1_000_000,
            )?,
            hello_fails_per_device_per_min: num(
                "IM_HELLO_FAILS_PER_DEVICE_PER_MIN",
                10u32,
                1,
                1_000_000,
            )?,
            read_idle_ms: num("IM_READ_IDLE_MS", 90_000u64, 100, 3_600_000)?,
            write_timeout_ms: num("IM_WRITE_TIMEOUT_MS", 10_000u64, 10, 3_600_000)?,
            shutdown_grace_ms: num("IM_SHUTDOWN_GRACE_MS", 10_000u64, 0, 600_000)?,
            fault: std::env::var("IM_FAULT").unwrap_or_default(),
        };
        if cfg.sync_page_max_bytes > cfg.queue_bytes_max {
            bail!(
                "IM_SYNC_PAGE_MAX_BYTES={} is above IM_QUEUE_BYTES_MAX={}: a sync page must fit \
                 in a connection's byte budget",
                cfg.sync_page_max_bytes,
                cfg.queue_bytes_max
            );
        }
        Ok(cfg)
    }

    pub fn db_timeout(&self) -> Duration {
        Duration::from_millis(self.db_timeout_ms)
    }

    /// The deadline of a request's database work: 90% of `IM_DB_TIMEOUT_MS`, so the
    /// UNAVAILABLE reply is on the wire within `IM_DB_TIMEOUT_MS` even on a busy machine.
    pub fn db_work_deadline(&self) -> Duration {
        Duration::from_millis(self.db_timeout_ms * 9 / 10)
    }
}
