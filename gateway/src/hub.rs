//! The registry of live connections and their bounded outbound queues. Owns who is
//! subscribed and the overflow rule; does no I/O itself (the writer task in `conn` does)
//! and never waits: fan-out and the sweep only `try_send`, so a slow client never blocks
//! delivery to anyone else.

use crate::protocol;
use crate::store::Principal;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use tokio::sync::mpsc;

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

#[derive(Debug)]
pub struct Out {
    pub kind: Kind,
    pub text: String,
}

impl Out {
    pub fn new(kind: Kind, text: String) -> Out {
        Out { kind, text }
    }
}

/// One connection as fan-out and the sweep see it.
pub struct ConnHandle {
    pub id: u64,
    pub who: Principal,
    /// The bounded outbound queue (IM_QUEUE_FRAMES_MAX); the writer task drains it.
    tx: mpsc::Sender<Out>,
    /// Set by `sub` (before its database read, so no event falls in between; cleared again
    /// if that read fails): only subscribed connections get pushes and hints.
    subscribed: AtomicBool,
    /// `Some` while overflowed: pushes are not queued, only the newest head per conversation
    /// is remembered, and the writer sends one `hint{why:"overflow"}` each once it drained.
    overflow: Mutex<Option<BTreeMap<String, i64>>>,
}

impl ConnHandle {
    pub fn new(id: u64, who: Principal, tx: mpsc::Sender<Out>) -> ConnHandle {
        ConnHandle {
            id,
            who,
            tx,
            subscribed: AtomicBool::new(false),
            overflow: Mutex::new(None),
        }
    }

    pub fn is_subscribed(&self) -> bool {
        self.subscribed.load(Ordering::Acquire)
    }

    fn offer(&self, conv: &str, head: i64, out: Out) {
        let mut overflow = self.overflow.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(pending) = overflow.as_mut() {
            let h = pending.entry(conv.to_string()).or_insert(head);
            *h = (*h).max(head);
            return;
        }
        match self.tx.try_send(out) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                tracing::info!(conn = self.id, device = %self.who.device, "outbound queue full: pushes paused until it drains");
                *overflow = Some(BTreeMap::from([(conv.to_string(), head)]));
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }

    /// Queues an `event` push (`frame`, rendered once per event by fan-out, not once per
    /// recipient) unless the queue is full or overflowed.
    pub fn push(&self, ev: &protocol::Event, frame: &str) {
        self.offer(&ev.conv, ev.seq, Out::new(Kind::Push, frame.to_string()));
    }

    /// Queues a `hint`.
    pub fn hint(&self, conv: &str, head: i64, why: &str) {
        self.offer(
            conv,
            head,
            Out::new(Kind::Hint, protocol::hint_frame(conv, head, why)),
        );
    }

    /// Called by the writer when its queue is empty: the overflow hints to send, if any.
    pub fn take_overflow(&self) -> Option<BTreeMap<String, i64>> {
        self.overflow
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

/// Subscribed connections by user, for fan-out (who may see an event is decided per user).
#[derive(Default)]
pub struct Hub {
    by_user: RwLock<HashMap<String, Vec<Arc<ConnHandle>>>>,
}

impl Hub {
    /// Marks the connection subscribed and makes it reachable by fan-out and the sweep.
    /// Returns false if it already was.
    pub fn subscribe(&self, h: &Arc<ConnHandle>) -> bool {
        if h.subscribed.swap(true, Ordering::AcqRel) {
            return false;
        }
        let mut m = self.by_user.write().unwrap_or_else(|p| p.into_inner());
        m.entry(h.who.user.clone()).or_default().push(h.clone());
        true
    }

    /// Takes the connection out of fan-out and the sweep (closed, or its `sub` failed).
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
