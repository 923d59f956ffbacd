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
    /// `IM_SWEEP_PAGE_INSTALLS`: installs per page of the sweep's full pass (one query each).
    pub sweep_page_installs: usize,
    /// `IM_DB_TIMEOUT_MS`: a request whose database work takes longer answers UNAVAILABLE.
    pub db_timeout_ms: u64,
    /// `IM_DB_POOL_MAX`: connections for requests and the sweep (fan-out has its own) (the pool has
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
    /// `IM_FANOUT_BATCH_MAX`: most notifications one fan-out read covers (one query).
    pub fanout_inflight_max: usize,
    /// `IM_SEND_BATCH_MAX`: most sends one group commit (one transaction) takes; 1 turns
    /// group commit into one transaction per send.
    pub send_batch_max: usize,
    /// `IM_BATCH_SLOTS`: batches of sends (and, apart, of acks) running at once; while a
    /// batch commits, the next gathers in its slot's queue. Default 1, from measurement
    /// (issue 44): one slot gathers about half the waiting senders per batch (3.9 rows at
    /// 8 senders against 2.1 with two slots), and fewer, larger batches cost the gateway and
    /// PostgreSQL less per send.
    pub batch_slots: usize,
    /// `IM_SYNCHRONOUS_COMMIT`: `synchronous_commit` of every pool session (D6 holds with
    /// `on` and stronger; issue 21's durability matrix measures what each loses).
    pub synchronous_commit: SyncCommit,
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

/// One environment variable the gateway reads: its name, its default (`""`: unset by
/// default) and what it sets. [`ENV`] is the single list: [`Config::from_env`] takes every
/// default from it and `im-gateway --help` prints it, so the help cannot go stale (a unit
/// test checks that every `IM_*` name in the gateway's sources is listed).
#[derive(Clone, Copy, Debug)]
pub struct EnvVar {
    pub name: &'static str,
    pub default: &'static str,
    pub meaning: &'static str,
}

const fn v(name: &'static str, default: &'static str, meaning: &'static str) -> EnvVar {
    EnvVar {
        name,
        default,
        meaning,
    }
}

/// Every `IM_*` variable, in the order `--help` prints them.
pub const ENV: &[EnvVar] = &[
    v("IM_DATABASE_URL", "", "PostgreSQL URL, required by migrate, admin and serve (postgres://USER[:PASSWORD]@HOST:PORT/DB)"),
    v("IM_DB_TIMEOUT_MS", "5000", "connect timeout; a request whose database work takes longer answers UNAVAILABLE"),
    v("IM_LISTEN", "127.0.0.1:8080", "address serve binds (port 0 picks one)"),
    v("IM_SWEEP_MS", "1000", "period of the redelivery sweep (D5)"),
    v("IM_SWEEP_PAGE_INSTALLS", "500", "installs per page (one query) of the sweep's full pass"),
    v("IM_FAULT", "", "fault points to arm: point:action[:skip[:count]][,...] (see `im-gateway faults`)"),
    v("IM_FAULT_CONTROL", "", "faults build: a Unix socket path where fault points are armed and disarmed while serve runs (arm SPEC | disarm POINT|all | list)"),
    v("IM_BUG", "", "deliberate bug to activate, controls build only (see `im-gateway bugs`)"),
    v("IM_DB_POOL_MAX", "16", "database connections for requests and sweep (+1 for LISTEN; fan-out has 3 of its own)"),
    v("IM_MAX_CONNECTIONS", "10000", "WebSocket connections served at once; more get 503"),
    v("IM_HANDSHAKES_MAX", "1024", "upgrade handshakes in progress at once"),
    v("IM_HANDSHAKE_TIMEOUT_MS", "3000", "an upgrade request not complete by then is dropped"),
    v("IM_CONNS_PER_ADDR_MAX", "256", "handshakes plus connections from one source IP address"),
    v("IM_CONNS_PER_DEVICE_MAX", "8", "authenticated connections of one device"),
    v("IM_QUEUE_FRAMES_MAX", "256", "outbound frames queued per connection before pushes overflow"),
    v("IM_QUEUE_BYTES_MAX", "2097152", "bytes of one connection's outbound frames (>= IM_SYNC_PAGE_MAX_BYTES)"),
    v("IM_FRAME_MAX_BYTES", "65536", "largest inbound text frame (larger: TOO_LARGE and a close)"),
    v("IM_BODY_MAX_BYTES", "16384", "largest message body (larger: TOO_LARGE)"),
    v("IM_SYNC_LIMIT_MAX", "500", "largest sync page; a larger limit is clamped"),
    v("IM_SYNC_PAGE_MAX_BYTES", "1048576", "a sync page also ends (complete:false) past this much JSON"),
    v("IM_CONN_INFLIGHT_MAX", "8", "requests of one connection served at once"),
    v("IM_FANOUT_BATCH_MAX", "256", "most notifications one fan-out read covers (one query)"),
    v("IM_SEND_BATCH_MAX", "64", "most sends (and acks) one group commit takes; 1: one transaction per send"),
    v("IM_BATCH_SLOTS", "1", "batches of sends (and of acks) running at once"),
    v("IM_WORKER_THREADS", "0", "tokio worker threads (0: one per CPU, tokio's own default)"),
    v("IM_SYNCHRONOUS_COMMIT", "on", "synchronous_commit of every database session: on, remote_apply, remote_write, local or off (anything but on or remote_apply is logged as a warning: D6 then rests on it)"),
    v("IM_HELLO_TIMEOUT_MS", "10000", "a connection without a good hello by then is closed"),
    v("IM_HELLO_FAILS_PER_ADDR_PER_MIN", "30", "failed hellos one source address may make per minute"),
    v("IM_HELLO_FAILS_PER_DEVICE_PER_MIN", "10", "failed hellos per device id per minute"),
    v("IM_READ_IDLE_MS", "90000", "a silent peer is closed after this (pinged at half of it)"),
    v("IM_WRITE_TIMEOUT_MS", "10000", "a frame the peer does not take by then ends the connection"),
    v("IM_SHUTDOWN_GRACE_MS", "10000", "how long a graceful shutdown waits for connections"),
];

/// The default of `name` in [`ENV`]. Panics on a name missing from the table: a unit test
/// reads every name once.
pub fn default_of(name: &str) -> &'static str {
    match ENV.iter().find(|e| e.name == name) {
        Some(e) => e.default,
        None => panic!("{name} is missing from config::ENV"),
    }
}

/// The environment section of `--help`: every variable of [`ENV`] with its default.
pub fn env_help() -> String {
    let width = ENV.iter().map(|e| e.name.len()).max().unwrap_or(0);
    let shown = |e: &EnvVar| match (e.name, e.default) {
        ("IM_DATABASE_URL", _) => "required",
        (_, "") => "unset",
        (_, d) => d,
    };
    let dw = ENV.iter().map(|e| shown(e).len()).max().unwrap_or(0);
    let mut out = format!(
        "Environment (serve reads every one; migrate and admin read IM_DATABASE_URL and \
         IM_DB_TIMEOUT_MS):\n  {:<width$}  {:<dw$}  MEANING\n",
        "NAME", "DEFAULT"
    );
    for e in ENV {
        out.push_str(&format!(
            "  {:<width$}  {:<dw$}  {}\n",
            e.name,
            shown(e),
            e.meaning
        ));
    }
    out.push_str(&format!(
        "  {:<width$}  {:<dw$}  log filter of the stderr log\n  {:<width$}  {:<dw$}  refused \
         (exit 2): faults are armed with IM_FAULT, not with the fail crate's variable\n",
        "RUST_LOG", "info,sqlx=warn", "FAILPOINTS", "must be unset"
    ));
    out
}

/// Most conversations listed in one `subbed` reply.
pub const SUB_CONVS_MAX: i64 = 10_000;

/// Default sync page size when a request omits `limit` (SPEC 2).
pub const SYNC_LIMIT_DEFAULT: i64 = 100;

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// `name` as a number in `min..=max`; unset or blank: its default from [`ENV`].
fn num<T>(name: &str, min: T, max: T) -> anyhow::Result<T>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy,
{
    let Some(raw) = var(name) else {
        return default_of(name)
            .parse()
            .ok()
            .with_context(|| format!("{name}: the default in config::ENV is not a number"));
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

/// `IM_WORKER_THREADS`: the runtime's worker threads, `None` for tokio's default (one per
/// CPU). Read before the runtime exists, apart from [`Config`] (issue 44: on a 2-core
/// machine shared with PostgreSQL, one worker wakes less and answers a lone sender sooner).
pub fn worker_threads() -> anyhow::Result<Option<usize>> {
    Ok(Some(num("IM_WORKER_THREADS", 0, 1024)?).filter(|n| *n > 0))
}

/// PostgreSQL's `synchronous_commit`, as the gateway sets it on every session: what a
/// commit waits for before the gateway answers `sent` (D6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncCommit {
    /// The WAL flushed locally and applied on the synchronous standbys (if any).
    RemoteApply,
    /// The WAL flushed locally and on the synchronous standbys (if any): D6's default.
    On,
    /// The WAL flushed locally and written (not flushed) on the synchronous standbys.
    RemoteWrite,
    /// The WAL flushed locally only.
    Local,
    /// Nothing: the reply may leave before the WAL is on any disk (breaks D6).
    Off,
}

impl SyncCommit {
    pub const ALL: [SyncCommit; 5] = [
        SyncCommit::Off,
        SyncCommit::Local,
        SyncCommit::RemoteWrite,
        SyncCommit::On,
        SyncCommit::RemoteApply,
    ];

    /// PostgreSQL's name of the setting's value.
    pub fn as_str(self) -> &'static str {
        match self {
            SyncCommit::RemoteApply => "remote_apply",
            SyncCommit::On => "on",
            SyncCommit::RemoteWrite => "remote_write",
            SyncCommit::Local => "local",
            SyncCommit::Off => "off",
        }
    }

    /// Whether a commit is flushed to the primary's disk and to each synchronous standby's
    /// before the reply (D6 in any deployment): `on` and `remote_apply`.
    pub fn keeps_d6(self) -> bool {
        matches!(self, SyncCommit::On | SyncCommit::RemoteApply)
    }

    /// `IM_SYNCHRONOUS_COMMIT` (default `on`); another value is refused by name.
    pub fn from_env() -> anyhow::Result<SyncCommit> {
        let v = var("IM_SYNCHRONOUS_COMMIT")
            .unwrap_or_else(|| default_of("IM_SYNCHRONOUS_COMMIT").to_string());
        SyncCommit::ALL
            .into_iter()
            .find(|s| s.as_str() == v.trim())
            .with_context(|| {
                format!(
                    "IM_SYNCHRONOUS_COMMIT={v} is not one of {}",
                    SyncCommit::ALL.map(SyncCommit::as_str).join(", ")
                )
            })
    }
}

/// `IM_DATABASE_URL`, required by every command.
pub fn database_url() -> anyhow::Result<String> {
    var("IM_DATABASE_URL").context("IM_DATABASE_URL is not set (e.g. postgres://user@host:5432/db)")
}

/// `IM_DB_TIMEOUT_MS` (default 5000).
pub fn db_timeout() -> anyhow::Result<Duration> {
    Ok(Duration::from_millis(num("IM_DB_TIMEOUT_MS", 1, 600_000)?))
}

impl Config {
    pub fn from_env() -> anyhow::Result<Config> {
        let cfg = Config {
            database_url: database_url()?,
            listen: var("IM_LISTEN").unwrap_or_else(|| default_of("IM_LISTEN").to_string()),
            sweep_interval_ms: num("IM_SWEEP_MS", 10, 3_600_000)?,
            sweep_page_installs: num("IM_SWEEP_PAGE_INSTALLS", 1, 100_000)?,
            db_timeout_ms: db_timeout()?.as_millis() as u64,
            db_pool_max: num("IM_DB_POOL_MAX", 1, 1000)?,
            connections_max: num("IM_MAX_CONNECTIONS", 1, 1_000_000)?,
            handshakes_max: num("IM_HANDSHAKES_MAX", 1, 1_000_000)?,
            handshake_timeout_ms: num("IM_HANDSHAKE_TIMEOUT_MS", 10, 600_000)?,
            conns_per_addr_max: num("IM_CONNS_PER_ADDR_MAX", 1, 1_000_000)?,
            conns_per_device_max: num("IM_CONNS_PER_DEVICE_MAX", 1, 10_000)?,
            queue_frames_max: num("IM_QUEUE_FRAMES_MAX", 2, 1_000_000)?,
            queue_bytes_max: num("IM_QUEUE_BYTES_MAX", 4096, 1 << 30)?,
            frame_max_bytes: num("IM_FRAME_MAX_BYTES", 256, 16 << 20)?,
            body_max_bytes: num("IM_BODY_MAX_BYTES", 1, 8 << 20)?,
            sync_limit_max: num("IM_SYNC_LIMIT_MAX", 1, 10_000)?,
            sync_page_max_bytes: num("IM_SYNC_PAGE_MAX_BYTES", 1024, 64 << 20)?,
            conn_inflight_max: num("IM_CONN_INFLIGHT_MAX", 1, 1024)?,
            fanout_inflight_max: num("IM_FANOUT_BATCH_MAX", 1, 65_536)?,
            send_batch_max: num("IM_SEND_BATCH_MAX", 1, 1024)?,
            batch_slots: num("IM_BATCH_SLOTS", 1, 64)?,
            synchronous_commit: SyncCommit::from_env()?,
            hello_timeout_ms: num("IM_HELLO_TIMEOUT_MS", 10, 3_600_000)?,
            hello_fails_per_addr_per_min: num("IM_HELLO_FAILS_PER_ADDR_PER_MIN", 1, 1_000_000)?,
            hello_fails_per_device_per_min: num("IM_HELLO_FAILS_PER_DEVICE_PER_MIN", 1, 1_000_000)?,
            read_idle_ms: num("IM_READ_IDLE_MS", 100, 3_600_000)?,
            write_timeout_ms: num("IM_WRITE_TIMEOUT_MS", 10, 3_600_000)?,
            shutdown_grace_ms: num("IM_SHUTDOWN_GRACE_MS", 0, 600_000)?,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `IM_*` name anywhere in the gateway's sources (reads, messages, docs) is in
    /// [`ENV`] once, so `--help` lists every variable the binary reads.
    #[test]
    fn every_im_variable_of_the_sources_is_in_the_table() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut seen = std::collections::BTreeSet::new();
        for entry in std::fs::read_dir(&dir).expect("read gateway/src") {
            let path = entry.expect("dir entry").path();
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("read a source file");
            let b = text.as_bytes();
            let mut i = 0;
            while let Some(at) = text[i..].find("IM_") {
                let start = i + at;
                let word_start =
                    start == 0 || !(b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'_');
                let mut end = start + 3;
                while end < b.len()
                    && (b[end].is_ascii_uppercase() || b[end].is_ascii_digit() || b[end] == b'_')
                {
                    end += 1;
                }
                if word_start && end > start + 3 {
                    seen.insert(text[start..end].to_string());
                }
                i = end;
            }
        }
        assert!(seen.len() > 20, "found too few names: {seen:?}");
        let missing: Vec<&String> = seen
            .iter()
            .filter(|n| !ENV.iter().any(|e| e.name == n.as_str()))
            .collect();
        assert!(
            missing.is_empty(),
            "IM_* names missing from config::ENV: {missing:?}"
        );
        for e in ENV {
            assert_eq!(
                ENV.iter().filter(|x| x.name == e.name).count(),
                1,
                "{} twice",
                e.name
            );
            assert!(env_help().contains(e.name));
        }
    }

    /// A number at either end of its range is taken; one past either end is refused. (The
    /// variable's name is put together at run time: it is no `IM_*` name of the table.)
    #[test]
    fn a_number_at_either_bound_is_taken_and_one_past_it_refused() {
        let name = format!("IM_{}", "TEST_NUM_BOUNDS");
        for (raw, want) in [("5", Some(5)), ("9", Some(9)), ("4", None), ("10", None)] {
            std::env::set_var(&name, raw);
            assert_eq!(num::<u32>(&name, 5, 9).ok(), want, "{name}={raw}");
        }
        std::env::remove_var(&name);
    }

    /// `IM_WORKER_THREADS`: 0 (its default) leaves tokio's own count, any other is taken.
    #[test]
    fn worker_threads_zero_leaves_the_default_and_a_count_is_taken() {
        for (raw, want) in [("0", None), ("1", Some(1)), ("2", Some(2))] {
            std::env::set_var("IM_WORKER_THREADS", raw);
            assert_eq!(worker_threads().ok(), Some(want), "IM_WORKER_THREADS={raw}");
        }
        std::env::remove_var("IM_WORKER_THREADS");
        assert_eq!(worker_threads().ok(), Some(None));
    }

    /// The numeric defaults parse and lie in their ranges (`from_env` with nothing set).
    #[test]
    fn defaults_come_from_the_table() {
        assert_eq!(num::<u64>("IM_SWEEP_MS", 10, 3_600_000).ok(), Some(1000));
        assert_eq!(
            num::<usize>("IM_QUEUE_BYTES_MAX", 4096, 1 << 30).ok(),
            Some(2 << 20)
        );
        assert_eq!(default_of("IM_LISTEN"), "127.0.0.1:8080");
        let help = env_help();
        let line = help
            .lines()
            .find(|l| l.trim_start().starts_with("IM_SWEEP_MS "))
            .map(|l| l.split_whitespace().take(2).collect::<Vec<_>>());
        assert_eq!(line, Some(vec!["IM_SWEEP_MS", "1000"]));
    }
}
