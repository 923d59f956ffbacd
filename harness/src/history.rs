//! The history of one scenario run: every client operation (invoke, then ok / fail / info),
//! every push and hint a client received, every event a client persisted, every fault or
//! nemesis action, and the D1 probes, one JSON object per line in `history.jsonl`
//! (format: evidence/README.md, "History", `schema_version` [`SCHEMA_VERSION`]).
//!
//! Owns: the file, the entry numbering and the clocks (monotonic `t_ms` since the history
//! was opened, and `wall_us`, the machine's real-time clock, comparable with PostgreSQL's
//! `clock_timestamp()` on the same machine). Must not: judge anything (`crate::checker`
//! does) or speak the protocol (`crate::client` records through it).
//!
//! Writes are serialised by one mutex and flushed line by line, so the order of lines is
//! the order in which the recorded things happened in this process, and a crash of the
//! test loses at most the line being written.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Version of the history line format; the checker refuses any other.
pub const SCHEMA_VERSION: u32 = 1;

/// A recorder that waited this long for the history (a write the kernel held up holds the
/// lock), or a watchdog tick this late (the process was not run), writes an
/// `observer-stall` line `{from_ms, to_ms, cause}`: what arrived in that window was
/// recorded late, so the checker judges no time bound across it. Seen once in 1,000
/// nemesis seeds at `--jobs 4` (seed 829): 1.7 s without a line, then every device's
/// queued hints at once.
pub const OBSERVER_STALL_MS: f64 = 250.0;

/// The watchdog's period ([`History::watch_stalls`]).
const WATCH_TICK: std::time::Duration = std::time::Duration::from_millis(50);

/// What kind of line an entry is (see evidence/README.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Type {
    /// A client operation started (its request frame is about to leave).
    Invoke,
    /// The operation succeeded (a success reply).
    Ok,
    /// A definite error reply: the operation did not happen.
    Fail,
    /// No definite answer (timeout, connection lost, UNAVAILABLE, INTERNAL): it may or
    /// may not have happened.
    Info,
    /// A push (`event`) or `hint` frame a client received.
    Recv,
    /// Events a client persisted to its state file (written before this line).
    Store,
    /// The client's life: create, restart (loaded from its state file), disconnect, crash.
    Client,
    /// A fault or nemesis action, with `value.phase` start / end (paired by `op_id`) or
    /// instant.
    Nemesis,
    /// A D1 probe: was the event of a `sent` reply or a push visible to another session?
    Probe,
    /// Bookkeeping: `open` (first line), `final` (the final read was taken).
    Meta,
}

/// One line of `history.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// Position in the file, from 0.
    pub i: u64,
    /// Monotonic milliseconds since the history was opened.
    pub t_ms: f64,
    /// Real-time clock, microseconds since the Unix epoch.
    pub wall_us: i64,
    /// The device id for client lines, `harness` for nemesis and meta lines, `probe` for
    /// probes.
    pub process: String,
    /// Client instance: 1 for the first client of a device, +1 each time it is loaded
    /// again from its state file. 0 for non-client lines.
    pub instance: u64,
    #[serde(rename = "type")]
    pub kind: Type,
    /// The operation: hello, send, ack, sync, sub, connect (client ops); push, hint
    /// (recv); store; create, restart, disconnect, crash (client); the nemesis action; probe.
    pub op: String,
    /// Pairs an invoke with its completion, and a nemesis start with its end.
    pub op_id: Option<u64>,
    pub value: Value,
}

struct Writer {
    out: BufWriter<File>,
    next_i: u64,
    /// Entries written, kept for in-process judging.
    entries: Vec<Entry>,
}

/// A history being written. Cheap to clone (shared).
#[derive(Clone)]
pub struct History {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    opened: Instant,
    next_op: AtomicU64,
    w: Mutex<Writer>,
    /// Client instances per device so far.
    instances: Mutex<std::collections::HashMap<String, u64>>,
    /// The pool D1 probes read through (another session than the gateway's).
    probe_pool: OnceLock<sqlx::PgPool>,
    /// Probes started and not yet recorded.
    probes_in_flight: AtomicU64,
}

/// The history of the scenario running in this process (one scenario = one process), set by
/// `World::start`. Clients made without an explicit history record here.
static CURRENT: OnceLock<Mutex<Option<History>>> = OnceLock::new();

fn current_slot() -> &'static Mutex<Option<History>> {
    CURRENT.get_or_init(|| Mutex::new(None))
}

/// The process's current history, if a world opened one.
pub fn current() -> Option<History> {
    current_slot()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
}

/// Makes `h` the process's current history (clients made from now on record into it).
pub fn set_current(h: Option<History>) {
    *current_slot()
        .lock()
        .unwrap_or_else(PoisonError::into_inner) = h;
}

pub fn wall_us_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

impl History {
    /// Creates `path` (refuses to overwrite) and writes the `open` line.
    pub fn create(path: &Path) -> anyhow::Result<History> {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .with_context(|| format!("create history {}", path.display()))?;
        let h = History {
            inner: Arc::new(Inner {
                path: path.to_path_buf(),
                opened: Instant::now(),
                next_op: AtomicU64::new(1),
                w: Mutex::new(Writer {
                    out: BufWriter::new(file),
                    next_i: 0,
                    entries: Vec::new(),
                }),
                instances: Mutex::new(Default::default()),
                probe_pool: OnceLock::new(),
                probes_in_flight: AtomicU64::new(0),
            }),
        };
        h.record(
            "harness",
            0,
            Type::Meta,
            "open",
            None,
            json!({"schema_version": SCHEMA_VERSION}),
        );
        Ok(h)
    }

    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// A fresh id pairing an invoke with its completion (or a nemesis start with its end).
    pub fn next_op_id(&self) -> u64 {
        self.inner.next_op.fetch_add(1, Ordering::Relaxed)
    }

    /// Milliseconds since the history was opened.
    pub fn now_ms(&self) -> f64 {
        (self.inner.opened.elapsed().as_secs_f64() * 1e6).round() / 1e3
    }

    /// Appends one line and returns its index. A write error is reported once on stderr
    /// and the entry is still kept in memory (the in-process judge sees it).
    pub fn record(
        &self,
        process: &str,
        instance: u64,
        kind: Type,
        op: &str,
        op_id: Option<u64>,
        value: Value,
    ) -> u64 {
        let asked = self.now_ms();
        let mut w = self.inner.w.lock().unwrap_or_else(PoisonError::into_inner);
        let t_ms = self.now_ms();
        let line = |process: &str, instance, kind, op: &str, op_id, value| Entry {
            i: 0,
            t_ms,
            wall_us: wall_us_now(),
            process: process.to_string(),
            instance,
            kind,
            op: op.to_string(),
            op_id,
            value,
        };
        if t_ms - asked > OBSERVER_STALL_MS {
            let stall = json!({"phase": "instant", "from_ms": asked, "to_ms": t_ms,
                               "cause": "waited for the history"});
            let e = line("harness", 0, Type::Nemesis, "observer-stall", None, stall);
            self.append(&mut w, e);
        }
        self.append(&mut w, line(process, instance, kind, op, op_id, value))
    }

    /// Writes one line under the lock, numbering it (`e.i` is set here).
    fn append(&self, w: &mut Writer, mut e: Entry) -> u64 {
        e.i = w.next_i;
        w.next_i += 1;
        let line = serde_json::to_string(&e).unwrap_or_else(|_| "{}".into());
        let ok = writeln!(w.out, "{line}").and_then(|_| w.out.flush());
        if let Err(err) = ok {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                eprintln!(
                    "imfault: cannot write history {}: {err}",
                    self.inner.path.display()
                )
            });
        }
        let i = e.i;
        w.entries.push(e);
        i
    }

    /// Starts the stall watchdog on the current tokio runtime (nothing without one): a task
    /// that wakes every 50 ms and, woken more than [`OBSERVER_STALL_MS`] late (this process
    /// was not run, so nothing it observed meanwhile was recorded on time), writes an
    /// `observer-stall` line. It ends with the history.
    pub fn watch_stalls(&self) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let inner = Arc::downgrade(&self.inner);
        rt.spawn(async move {
            let mut due = Instant::now() + WATCH_TICK;
            loop {
                tokio::time::sleep_until(due.into()).await;
                let Some(inner) = inner.upgrade() else { return };
                let h = History { inner };
                let late = due.elapsed().as_secs_f64() * 1e3;
                if late > OBSERVER_STALL_MS {
                    let to_ms = h.now_ms();
                    h.nemesis_instant(
                        "observer-stall",
                        json!({"from_ms": to_ms - late, "to_ms": to_ms,
                               "cause": "the harness was not run"}),
                    );
                }
                due = Instant::now() + WATCH_TICK;
            }
        });
    }

    /// A nemesis action that has a duration: writes `start` now and returns the op id for
    /// [`History::nemesis_end`].
    pub fn nemesis_start(&self, op: &str, mut value: Value) -> u64 {
        let id = self.next_op_id();
        if let Some(o) = value.as_object_mut() {
            o.insert("phase".into(), json!("start"));
        }
        self.record("harness", 0, Type::Nemesis, op, Some(id), value);
        id
    }

    pub fn nemesis_end(&self, op: &str, id: u64, mut value: Value) {
        if let Some(o) = value.as_object_mut() {
            o.insert("phase".into(), json!("end"));
        }
        self.record("harness", 0, Type::Nemesis, op, Some(id), value);
    }

    /// A nemesis action without duration (a membership change, a backend terminated).
    pub fn nemesis_instant(&self, op: &str, mut value: Value) {
        if let Some(o) = value.as_object_mut() {
            o.insert("phase".into(), json!("instant"));
        }
        self.record("harness", 0, Type::Nemesis, op, None, value);
    }

    /// The next instance number of `device` (1 for its first client).
    pub fn next_instance(&self, device: &str) -> u64 {
        let mut m = self
            .inner
            .instances
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let n = m.entry(device.to_string()).or_insert(0);
        *n += 1;
        *n
    }

    /// Turns D1 probes on: they read through `pool`.
    pub fn set_probe_pool(&self, pool: sqlx::PgPool) {
        let _ = self.inner.probe_pool.set(pool);
    }

    /// D1 probe of history line `of` (a `sent` reply or a push of `conv:seq` with `mid`):
    /// reads the event row on another session at once and records what it found. A
    /// gateway that replies or pushes only after COMMIT returned is always found here.
    /// Needs a tokio runtime; does nothing without a probe pool.
    pub fn probe(&self, of: u64, conv: &str, seq: i64, mid: &str) {
        let Some(pool) = self.inner.probe_pool.get().cloned() else {
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let h = self.clone();
        let (conv, mid) = (conv.to_string(), mid.to_string());
        self.inner.probes_in_flight.fetch_add(1, Ordering::SeqCst);
        rt.spawn(async move {
            let read = tokio::time::timeout(
                std::time::Duration::from_secs(2),
                sqlx::query_scalar::<_, String>(
                    "SELECT mid FROM events WHERE conv_id = $1 AND seq = $2",
                )
                .bind(&conv)
                .bind(seq)
                .fetch_optional(&pool),
            )
            .await;
            let (found, error) = match read {
                Ok(Ok(found)) => (found, None),
                Ok(Err(e)) => (None, Some(e.to_string())),
                Err(_) => (None, Some("probe timed out".to_string())),
            };
            h.record(
                "probe",
                0,
                Type::Probe,
                "probe",
                None,
                json!({"of": of, "conv": conv, "seq": seq, "expect_mid": mid,
                       "found_mid": found, "error": error}),
            );
            h.inner.probes_in_flight.fetch_sub(1, Ordering::SeqCst);
        });
    }

    /// Waits (bounded by `within`) until every probe started so far is recorded.
    pub async fn wait_probes(&self, within: std::time::Duration) {
        // Bounded, not an error: a probe still running is recorded late, or not at all.
        let _ = crate::util::wait_until("the D1 probes to finish", within, async || {
            let n = self.inner.probes_in_flight.load(Ordering::SeqCst);
            if n == 0 {
                Ok(())
            } else {
                Err(n)
            }
        })
        .await;
    }

    /// Every entry written so far, in order.
    pub fn entries(&self) -> Vec<Entry> {
        self.inner
            .w
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entries
            .clone()
    }
}

impl std::fmt::Debug for History {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("History")
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

/// Reads a `history.jsonl` (refusing another schema version in its `open` line).
pub fn read(path: &Path) -> anyhow::Result<Vec<Entry>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let e: Entry = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not a history entry", path.display(), n + 1))?;
        if e.kind == Type::Meta && e.op == "open" {
            let v = e.value["schema_version"].as_u64();
            anyhow::ensure!(
                v == Some(u64::from(SCHEMA_VERSION)),
                "{}: history schema_version {v:?}, this checker reads {SCHEMA_VERSION}",
                path.display()
            );
        }
        out.push(e);
    }
    Ok(out)
}
