//! The history writer of one scenario run: every client operation (invoke, then ok / fail /
//! info), every push and hint a client received, every event a client persisted, every
//! fault or nemesis action, and the D1 probes, one JSON object per line in
//! `history.jsonl`. The line types and the reader are the judge's (`im_check::history`;
//! format: evidence/README.md, "History", `schema_version`
//! [`im_check::history::SCHEMA_VERSION`]).
//!
//! Owns: the file, the entry numbering and the clocks (monotonic `t_ms` since the history
//! was opened, and `wall_us`, the machine's real-time clock, comparable with PostgreSQL's
//! `clock_timestamp()` on the same machine), the D1 probes (read through a pool of their
//! own) and the stall watchdog. Must not: judge anything (`im_check` does) or speak the
//! protocol (`crate::client` records through it).
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
use im_check::history::{
    read, Action, Entry, Line, Meta, Nemesis, Phase, ProbeLine, SCHEMA_VERSION,
};

/// A recorder that waited this long for the history (a write the kernel held up holds the
/// lock), or a watchdog tick this late (the process was not run), writes an
/// `observer-stall` line `{from_ms, to_ms, cause}`: what arrived in that window was
/// recorded late, so the checker judges no time bound across it. Seen once in 1,000
/// nemesis seeds at `--jobs 4` (seed 829): 1.7 s without a line, then every device's
/// queued hints at once.
pub const OBSERVER_STALL_MS: f64 = 250.0;

/// The watchdog's period ([`History::watch_stalls`]).
const WATCH_TICK: std::time::Duration = std::time::Duration::from_millis(50);

struct Writer {
    out: BufWriter<File>,
    next_i: u64,
    /// Lines that could not be written (the file is then not the history).
    write_errors: u64,
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
                    write_errors: 0,
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
            None,
            Line::Meta(Meta::Open {
                schema_version: SCHEMA_VERSION,
            }),
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
    pub fn record(&self, process: &str, instance: u64, op_id: Option<u64>, line: Line) -> u64 {
        let asked = self.now_ms();
        let mut w = self.inner.w.lock().unwrap_or_else(PoisonError::into_inner);
        let t_ms = self.now_ms();
        let entry = |process: &str, instance, op_id, line| Entry {
            i: 0,
            t_ms,
            wall_us: wall_us_now(),
            process: process.to_string(),
            instance,
            op_id,
            line,
        };
        if t_ms - asked > OBSERVER_STALL_MS {
            let stall = Line::Nemesis(Nemesis {
                phase: Phase::Instant,
                action: Action::ObserverStall {
                    from_ms: asked,
                    to_ms: t_ms,
                    cause: "waited for the history".into(),
                },
            });
            self.append(&mut w, entry("harness", 0, None, stall));
        }
        self.append(&mut w, entry(process, instance, op_id, line))
    }

    /// Writes one line under the lock, numbering it (`e.i` is set here).
    fn append(&self, w: &mut Writer, mut e: Entry) -> u64 {
        e.i = w.next_i;
        w.next_i += 1;
        let ok = serde_json::to_string(&e)
            .map_err(std::io::Error::from)
            .and_then(|line| writeln!(w.out, "{line}"))
            .and_then(|_| w.out.flush());
        if ok.is_err() {
            w.write_errors += 1;
        }
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
                    h.nemesis_instant(Action::ObserverStall {
                        from_ms: to_ms - late,
                        to_ms,
                        cause: "the harness was not run".into(),
                    });
                }
                due = Instant::now() + WATCH_TICK;
            }
        });
    }

    /// A nemesis action that has a duration: writes `start` now and returns the op id for
    /// [`History::nemesis_end`].
    pub fn nemesis_start(&self, action: Action) -> u64 {
        let id = self.next_op_id();
        self.nemesis(Phase::Start, Some(id), action);
        id
    }

    /// The end of the period [`History::nemesis_start`] began (`id`).
    pub fn nemesis_end(&self, id: u64, action: Action) {
        self.nemesis(Phase::End, Some(id), action);
    }

    /// A nemesis action without duration (a membership change, a backend terminated).
    pub fn nemesis_instant(&self, action: Action) {
        self.nemesis(Phase::Instant, None, action);
    }

    fn nemesis(&self, phase: Phase, op_id: Option<u64>, action: Action) {
        self.record(
            "harness",
            0,
            op_id,
            Line::Nemesis(Nemesis { phase, action }),
        );
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
                None,
                Line::Probe(ProbeLine::Probe {
                    of,
                    conv,
                    seq,
                    expect_mid: mid,
                    found_mid: found,
                    error,
                }),
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

    /// The history as the file holds it: flushed, read back and parsed
    /// ([`im_check::history::read`]), under
    /// the writers' lock, so the judge judges exactly what a reviewer can judge again from
    /// the file. An error when a line could not be written or does not parse.
    pub fn read_back(&self) -> anyhow::Result<Vec<Entry>> {
        let mut w = self.inner.w.lock().unwrap_or_else(PoisonError::into_inner);
        w.out.flush().context("flush the history")?;
        anyhow::ensure!(
            w.write_errors == 0,
            "{} of {} history lines could not be written to {}",
            w.write_errors,
            w.next_i,
            self.inner.path.display()
        );
        let entries = read(&self.inner.path)?;
        anyhow::ensure!(
            entries.len() as u64 == w.next_i,
            "{} holds {} lines, {} were recorded",
            self.inner.path.display(),
            entries.len(),
            w.next_i
        );
        Ok(entries)
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

#[cfg(test)]
mod tests {
    use super::*;
    use im_check::history::{Done, HintWhy, Invoke, OpName, Outcome, Recv};
    use serde_json::json;

    /// What the recorders write is what the reader reads: every kind of line, from request
    /// frames and replies as the client sees them, read back from the file equal to the
    /// entries kept in memory; and the file is what is judged (`read_back`).
    #[test]
    fn recorded_lines_read_back_equal_and_frames_map_to_typed_requests() {
        let tmp = tempfile::tempdir().unwrap();
        let h = History::create(&tmp.path().join("history.jsonl")).unwrap();
        let frames = [
            json!({"t": "hello", "device": "a1", "token": "secret", "epoch": 1}),
            json!({"t": "send", "conv": "c1", "cmid": "k1", "body": "hé"}),
            json!({"t": "ack", "conv": "c1", "seq": -1}),
            json!({"t": "sync", "conv": "c1"}),
            json!({"t": "sub"}),
            json!({"t": "no-such-request", "rid": "x"}),
            json!({"t": "ack", "conv": "c1", "seq": "x"}),
        ];
        let invokes: Vec<Invoke> = frames.iter().map(Invoke::of_frame).collect();
        assert_eq!(
            invokes[0],
            Invoke::Hello {
                device: "a1".into(),
                epoch: 1
            }
        );
        assert_eq!(
            invokes[1],
            Invoke::Send {
                conv: "c1".into(),
                cmid: "k1".into(),
                body_len: 3
            }
        );
        assert_eq!(
            invokes[2],
            Invoke::Ack {
                conv: "c1".into(),
                seq: -1,
                explicit: false
            }
        );
        assert_eq!(
            invokes[3],
            Invoke::Sync {
                conv: "c1".into(),
                after: None,
                limit: None
            }
        );
        assert_eq!(
            invokes[5],
            Invoke::Raw {
                frame: json!({"t": "no-such-request"})
            }
        );
        assert_eq!(invokes[6].op(), OpName::Raw);
        for (n, inv) in invokes.into_iter().enumerate() {
            h.record("a1", 1, Some(n as u64), Line::Invoke(inv));
        }
        let sent = json!({"t": "sent", "rid": "c1", "conv": "c1", "seq": 1, "mid": "m",
                          "dup": false, "epoch": 1});
        let synced = json!({"t": "synced", "conv": "c1", "head": 1, "complete": true,
            "events": [{"conv": "c1", "seq": 1, "mid": "m", "sender": "alice", "cmid": "k1",
                        "kind": "msg", "body": "hé", "at": 5, "epoch": 1}]});
        let of = |op: OpName, v: &serde_json::Value| {
            Done::of_frame(op, v, &im_protocol::ServerFrame::parse(&v.to_string()))
        };
        for (op, reply) in [(OpName::Send, &sent), (OpName::Sync, &synced)] {
            let done = of(op, reply).unwrap();
            h.record("a1", 1, Some(9), Line::Ok(done));
        }
        let e = of(OpName::Send, &json!({"t": "sent", "conv": "c1"})).unwrap_err();
        assert!(e.contains("without field `seq`"), "{e}");
        let e = of(OpName::Send, &synced).unwrap_err();
        assert!(e.contains("unexpected send reply: a `synced` frame"), "{e}");
        assert_eq!(
            of(OpName::Raw, &json!({"t": "error", "rid": "x"})).unwrap(),
            Done::Raw {
                reply: json!({"t": "error"})
            }
        );
        let id = h.nemesis_start(Action::PgCrash(Outcome::default()));
        h.nemesis_end(
            id,
            Action::PgCrash(Outcome::done(&anyhow::Result::<()>::Ok(()))),
        );
        h.nemesis_instant(Action::Heal { unsettled: vec![] });
        h.record(
            "b1",
            2,
            None,
            Line::Recv(Recv::Hint {
                conv: "c1".into(),
                head: 3,
                why: HintWhy::Sweep,
            }),
        );
        let back = h.read_back().unwrap();
        assert_eq!(back, h.entries());
        assert_eq!(back.len(), 1 + 7 + 2 + 3 + 1);
        assert_eq!(back[0].op(), "open");
    }
}
