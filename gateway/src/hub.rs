//! The registry of live connections and their bounded outbound queues. Owns who is
//! authenticated (per device, for the per-device cap and for closing stale installs), who is
//! subscribed (per user, for fan-out and the sweep), each connection's byte budget and the
//! overflow rule. Does no I/O itself (the writer task in `conn` does) and never waits on
//! behalf of fan-out or the sweep: pushes only `try_send` into a queue and only try to
//! reserve budget, so a slow client never blocks delivery to anyone else.

use crate::error::WireError;
use crate::protocol;
use crate::store::Principal;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio_util::sync::CancellationToken;

/// What a queued frame is, so the writer knows which fault point applies to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A `sent` reply (fault point `gw.reply.send`).
    Sent,
    /// An `acked` reply (fault point `gw.reply.ack`).
    Acked,
    /// Any other reply or error.
    Reply,
    /// An `event` push (fault point `gw.push`).
    Push,
    /// A `hint` (never subject to `gw.push`).
    Hint,
    /// Write a close frame with this code and stop.
    Close(u16),
}

/// One frame waiting for the writer, with the bytes of the connection's budget it holds
/// (given back when the writer has written or dropped it).
#[derive(Debug)]
pub struct Out {
    pub kind: Kind,
    pub text: String,
    _budget: Option<Reserved>,
}

impl Out {
    /// A frame outside the byte budget (close frames, and the controls build's bugs).
    pub fn new(kind: Kind, text: String) -> Out {
        Out {
            kind,
            text,
            _budget: None,
        }
    }

    /// A frame holding `budget` (at least its own length, or the whole budget).
    pub fn reserved(kind: Kind, text: String, budget: Reserved) -> Out {
        Out {
            kind,
            text,
            _budget: Some(budget),
        }
    }
}

/// One connection's byte budget (`IM_QUEUE_BYTES_MAX`): bytes of outbound frames queued or
/// being built. Replies wait for it, pushes only try; the writer gives bytes back as it
/// writes. Closed when the writer ends, so nothing waits for a connection that is gone.
#[derive(Debug)]
pub struct Budget {
    sem: Arc<Semaphore>,
    max: usize,
}

/// Bytes taken from a [`Budget`]; given back on drop.
#[derive(Debug)]
pub struct Reserved {
    sem: Arc<Semaphore>,
    bytes: usize,
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.sem.add_permits(self.bytes);
    }
}

impl Reserved {
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Gives back everything above `bytes` (at least one byte stays held).
    pub fn shrink_to(&mut self, bytes: usize) {
        let keep = bytes.max(1);
        if keep < self.bytes {
            self.sem.add_permits(self.bytes - keep);
            self.bytes = keep;
        }
    }
}

impl Budget {
    pub fn new(max: usize) -> Budget {
        let max = max.clamp(1, u32::MAX as usize);
        Budget {
            sem: Arc::new(Semaphore::new(max)),
            max,
        }
    }

    /// What a frame of `bytes` takes: its length, but never more than the whole budget (so
    /// an outsized frame still goes, alone).
    fn clamp(&self, bytes: usize) -> u32 {
        bytes.clamp(1, self.max) as u32
    }

    /// Waits for `bytes` (clamped to the budget). `None` once the connection is gone.
    /// Callers never hold another reservation while they wait (no hold-and-wait, no
    /// deadlock: only the writer gives bytes back, and it never waits for the budget).
    pub async fn reserve(&self, bytes: usize) -> Option<Reserved> {
        let n = self.clamp(bytes);
        let permit = self.sem.clone().acquire_many_owned(n).await.ok()?;
        permit.forget();
        Some(Reserved {
            sem: self.sem.clone(),
            bytes: n as usize,
        })
    }

    /// Takes `bytes` if they are free now.
    pub fn try_reserve(&self, bytes: usize) -> Option<Reserved> {
        let n = self.clamp(bytes);
        let permit = self.sem.clone().try_acquire_many_owned(n).ok()?;
        permit.forget();
        Some(Reserved {
            sem: self.sem.clone(),
            bytes: n as usize,
        })
    }

    /// The connection is gone: every waiting and later `reserve` returns `None`.
    pub fn close(&self) {
        self.sem.close();
    }
}

/// What a connection's writer shares with everyone who queues frames for it.
#[derive(Debug)]
pub struct Outbound {
    /// IM_QUEUE_BYTES_MAX for this connection.
    pub budget: Budget,
    /// `Some` while overflowed: pushes are not queued, only the newest head per conversation
    /// is remembered, and the writer sends one `hint{why:"overflow"}` each once it drained.
    overflow: Mutex<Option<BTreeMap<String, i64>>>,
    /// Set when the install became stale: the writer drops the pushes and hints still
    /// queued, and nothing new is offered.
    revoked: AtomicBool,
    /// The reader asks the writer for a ping (after half of IM_READ_IDLE_MS of silence).
    pub ping: Notify,
}

impl Outbound {
    pub fn new(budget_bytes: usize) -> Outbound {
        Outbound {
            budget: Budget::new(budget_bytes),
            overflow: Mutex::new(None),
            revoked: AtomicBool::new(false),
            ping: Notify::new(),
        }
    }

    pub fn is_revoked(&self) -> bool {
        self.revoked.load(Ordering::Acquire)
    }

    /// Called by the writer when its queue is empty: the overflow hints to send, if any.
    pub fn take_overflow(&self) -> Option<BTreeMap<String, i64>> {
        if self.is_revoked() {
            return None;
        }
        self.overflow
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

/// How a connection is asked to end by someone other than its reader.
#[derive(Debug, Default)]
pub struct Closer {
    token: CancellationToken,
    /// The close code, and an error frame to send before it.
    why: Mutex<Option<(u16, Option<WireError>)>>,
}

impl Closer {
    /// Asks the reader to close with `code` after `error` (the first request wins).
    pub fn close(&self, code: u16, error: Option<WireError>) {
        let mut why = self.why.lock().unwrap_or_else(|p| p.into_inner());
        if why.is_none() {
            *why = Some((code, error));
        }
        self.token.cancel();
    }

    pub async fn requested(&self) {
        self.token.cancelled().await
    }

    /// The close code and error frame asked for (`None` if nobody asked).
    pub fn take(&self) -> Option<(u16, Option<WireError>)> {
        self.why.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// One authenticated connection as fan-out, the sweep and revocation see it.
pub struct ConnHandle {
    pub id: u64,
    pub who: Principal,
    /// The bounded outbound queue (IM_QUEUE_FRAMES_MAX); the writer task drains it.
    tx: mpsc::Sender<Out>,
    /// The writer's shared side: byte budget, overflow, revocation, ping requests.
    pub out: Arc<Outbound>,
    /// Ends the connection from outside (a stale install).
    pub closer: Arc<Closer>,
    /// Set by `sub` (before its database read, so no event falls in between; cleared again
    /// if that read fails): only subscribed connections get pushes and hints.
    subscribed: AtomicBool,
}

impl ConnHandle {
    pub fn new(
        id: u64,
        who: Principal,
        tx: mpsc::Sender<Out>,
        out: Arc<Outbound>,
        closer: Arc<Closer>,
    ) -> ConnHandle {
        ConnHandle {
            id,
            who,
            tx,
            out,
            closer,
            subscribed: AtomicBool::new(false),
        }
    }

    pub fn is_subscribed(&self) -> bool {
        self.subscribed.load(Ordering::Acquire)
    }

    /// `device:epoch`, as fan-out's audience query names current installs.
    pub fn install_key(&self) -> String {
        format!("{}:{}", self.who.device, self.who.epoch)
    }

    fn offer(&self, conv: &str, head: i64, kind: Kind, text: String) {
        if self.out.is_revoked() {
            return;
        }
        let mut overflow = self.out.overflow.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(pending) = overflow.as_mut() {
            let h = pending.entry(conv.to_string()).or_insert(head);
            *h = (*h).max(head);
            return;
        }
        // A push that does not fit the frame count or the byte budget overflows: the
        // client is told by a hint once the queue drained, and syncs (D5's repair path).
        let full = match self.out.budget.try_reserve(text.len()) {
            None => true,
            Some(r) => match self.tx.try_send(Out::reserved(kind, text, r)) {
                Ok(()) => false,
                Err(mpsc::error::TrySendError::Full(_)) => true,
                Err(mpsc::error::TrySendError::Closed(_)) => false,
            },
        };
        if full {
            tracing::info!(conn = self.id, device = %self.who.device, "outbound queue full (frames or bytes): pushes paused until it drains");
            *overflow = Some(BTreeMap::from([(conv.to_string(), head)]));
        }
    }

    /// Queues an `event` push (`frame`, rendered once per event by fan-out, not once per
    /// recipient) unless the queue is full or overflowed.
    pub fn push(&self, ev: &protocol::Event, frame: &str) {
        self.offer(&ev.conv, ev.seq, Kind::Push, frame.to_string());
    }

    /// Queues a `hint`.
    pub fn hint(&self, conv: &str, head: i64, why: &str) {
        self.offer(
            conv,
            head,
            Kind::Hint,
            protocol::hint_frame(conv, head, why),
        );
    }

    /// The install is no longer current (reinstalled or removed): no push or hint is
    /// offered or written from now on, and the connection closes with STALE_INSTALL (1008).
    pub fn revoke(&self) {
        if !self.out.revoked.swap(true, Ordering::AcqRel) {
            tracing::info!(conn = self.id, device = %self.who.device, epoch = self.who.epoch, "install is stale: closing");
        }
        self.closer.close(1008, Some(WireError::StaleInstall));
    }
}

/// Why [`Hub::register`] refused a connection.
#[derive(Debug, PartialEq, Eq)]
pub struct DeviceFull;

/// Authenticated connections by device, subscribed ones by user.
#[derive(Default)]
pub struct Hub {
    by_user: RwLock<HashMap<String, Vec<Arc<ConnHandle>>>>,
    by_device: Mutex<HashMap<String, Vec<Arc<ConnHandle>>>>,
}

impl Hub {
    /// Registers an authenticated connection, unless its device already has `max`.
    pub fn register(&self, h: &Arc<ConnHandle>, max: usize) -> Result<(), DeviceFull> {
        let mut m = self.by_device.lock().unwrap_or_else(|p| p.into_inner());
        let v = m.entry(h.who.device.clone()).or_default();
        if v.len() >= max {
            return Err(DeviceFull);
        }
        v.push(h.clone());
        Ok(())
    }

    /// Takes the connection out of everything (it closed).
    pub fn unregister(&self, h: &ConnHandle) {
        self.remove(h);
        let mut m = self.by_device.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(v) = m.get_mut(&h.who.device) {
            v.retain(|c| c.id != h.id);
            if v.is_empty() {
                m.remove(&h.who.device);
            }
        }
    }

    /// Closes every connection of `device` whose install epoch is not `current` (`None`:
    /// the device is gone). Returns how many.
    pub fn revoke_stale(&self, device: &str, current: Option<i64>) -> usize {
        let stale: Vec<Arc<ConnHandle>> = {
            let m = self.by_device.lock().unwrap_or_else(|p| p.into_inner());
            m.get(device)
                .into_iter()
                .flatten()
                .filter(|c| Some(c.who.epoch) != current)
                .cloned()
                .collect()
        };
        for c in &stale {
            self.remove(c);
            c.revoke();
        }
        stale.len()
    }

    /// Marks the connection subscribed and makes it reachable by fan-out and the sweep.
    /// Returns false if it already was.
    pub fn subscribe(&self, h: &Arc<ConnHandle>) -> bool {
        if h.out.is_revoked() || h.subscribed.swap(true, Ordering::AcqRel) {
            return false;
        }
        let mut m = self.by_user.write().unwrap_or_else(|p| p.into_inner());
        m.entry(h.who.user.clone()).or_default().push(h.clone());
        true
    }

    /// Takes the connection out of fan-out and the sweep (closed, revoked, or its `sub`
    /// failed).
    pub fn remove(&self, h: &ConnHandle) {
        if !h.subscribed.swap(false, Ordering::AcqRel) {
            return;
        }
        let mut m = self.by_user.write().unwrap_or_else(|p| p.into_inner());
        if let Some(v) = m.get_mut(&h.who.user) {
            v.retain(|c| c.id != h.id);
            if v.is_empty() {
                m.remove(&h.who.user);
            }
        }
    }

    /// The subscribed connections of these users (the audience of one event).
    pub fn conns_of(&self, users: &[String]) -> Vec<Arc<ConnHandle>> {
        let m = self.by_user.read().unwrap_or_else(|p| p.into_inner());
        users
            .iter()
            .filter_map(|u| m.get(u))
            .flatten()
            .cloned()
            .collect()
    }

    /// Every subscribed connection (for the sweep).
    pub fn all(&self) -> Vec<Arc<ConnHandle>> {
        let m = self.by_user.read().unwrap_or_else(|p| p.into_inner());
        m.values().flatten().cloned().collect()
    }
}
