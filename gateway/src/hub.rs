//! The registry of live connections and their bounded outbound queues. Owns who is
//! authenticated (per device, for the per-device cap and for closing stale installs), who is
//! subscribed (per user, for fan-out and the sweep), each connection's byte budget and the
//! overflow rule. Does no I/O itself (the writer task in `conn` does) and never waits on
//! behalf of fan-out or the sweep: pushes only `try_send` into a queue and only try to
//! reserve budget, so a slow client never blocks delivery to anyone else.
//!
//! Who owns what of one connection: its task in `conn` owns the socket, the session, the
//! receiving end of its queue and of its close channel; everyone else holds a handle. Its
//! [`Outbox`] (the queue's sending side, the byte budget, and whether pushes are open,
//! paused by an overflow, or revoked: one `Pushes` state under one lock) is shared by
//! its request tasks and, through its [`ConnHandle`] in the hub, by fan-out and the sweep.
//! A close is asked for with a [`CloseRequest`] on the connection's channel.

use crate::bugs::{self, Bug};
use crate::error::WireError;
use crate::protocol::{self, Frame, HintWhy, Kind, Push, Reply};
use crate::store::Principal;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use tokio::sync::{mpsc, Semaphore};

/// One item of a connection's outbound queue.
#[derive(Debug)]
pub enum Out {
    /// A rendered frame.
    Frame(Queued),
    /// The last item: write a close frame with this code (`None`: none, the connection
    /// failed) and stop.
    Close(Option<u16>),
}

/// A frame rendered once (by [`protocol::render`]) waiting for the writer, with what the
/// writer decides by: its [`Kind`], read off the typed variant it was rendered from, and
/// the request's `rid` (an `error` fault on a reply answers UNAVAILABLE to that rid). It
/// holds its bytes of the connection's budget until the writer has written or dropped it.
#[derive(Debug)]
pub struct Queued {
    pub kind: Kind,
    pub rid: Option<String>,
    pub text: String,
    _budget: Option<Reserved>,
}

impl Queued {
    /// A reply, rendered.
    pub fn reply(rid: Option<&str>, reply: &Reply, budget: Option<Reserved>) -> Queued {
        let frame = Frame::Reply { rid, reply };
        Queued {
            kind: frame.kind(),
            rid: rid.map(str::to_string),
            text: protocol::render(&frame),
            _budget: budget,
        }
    }

    /// A push already rendered (fan-out renders an event once, for every recipient).
    fn push(kind: Kind, text: String, budget: Reserved) -> Queued {
        Queued {
            kind,
            rid: None,
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

/// Whether pushes (and hints) are queued for a connection: one state under one lock.
#[derive(Debug)]
enum Pushes {
    Open,
    /// The queue was full (frames or bytes): pushes are not queued, only the newest head
    /// per conversation is remembered, and the writer sends one `hint{why:"overflow"}` each
    /// once it drained.
    Overflowed(BTreeMap<String, i64>),
    /// The install became stale: nothing is offered any more and the writer drops the
    /// pushes and hints still queued.
    Revoked,
}

/// The producer side of one connection's bounded outbound queue (IM_QUEUE_FRAMES_MAX
/// frames, IM_QUEUE_BYTES_MAX bytes): what everyone who queues frames for the connection
/// holds (its request tasks; fan-out and the sweep through its [`ConnHandle`]). The
/// connection's writer task (`conn`) owns the receiving side and alone writes the socket.
#[derive(Debug)]
pub struct Outbox {
    /// The connection's id (for logs).
    id: u64,
    tx: mpsc::Sender<Out>,
    /// IM_QUEUE_BYTES_MAX for this connection.
    pub budget: Budget,
    pushes: Mutex<Pushes>,
}

impl Outbox {
    /// A connection's queue: the shared producer side and the writer's receiver.
    pub fn new(id: u64, frames_max: usize, bytes_max: usize) -> (Arc<Outbox>, mpsc::Receiver<Out>) {
        let (tx, rx) = mpsc::channel(frames_max);
        let outbox = Outbox {
            id,
            tx,
            budget: Budget::new(bytes_max),
            pushes: Mutex::new(Pushes::Open),
        };
        (Arc::new(outbox), rx)
    }

    fn pushes(&self) -> std::sync::MutexGuard<'_, Pushes> {
        self.pushes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a reply or error to request `rid`, holding its length of the byte budget
    /// (`reserved`, if the caller took it beforehand, is shrunk to the frame or, if too
    /// small, given back and taken anew: no reservation is held while waiting for another).
    /// Waits for budget and queue space: that only slows this connection. Nothing is queued
    /// once the connection is gone.
    pub async fn reply(&self, rid: Option<&str>, reply: &Reply, reserved: Option<Reserved>) {
        let mut q = Queued::reply(rid, reply, None);
        let held = match reserved {
            Some(mut r) if r.bytes() >= q.text.len() => {
                r.shrink_to(q.text.len());
                Some(r)
            }
            r => {
                drop(r);
                self.budget.reserve(q.text.len()).await
            }
        };
        let Some(held) = held else { return };
        q._budget = Some(held);
        let _ = self.tx.send(Out::Frame(q)).await;
    }

    /// Queues the last item (outside the byte budget), behind everything queued: the
    /// writer writes a close frame with `code` (none for `None`) and stops.
    pub async fn end(&self, code: Option<u16>) {
        let _ = self.tx.send(Out::Close(code)).await;
    }

    /// Queues a reply outside the byte budget without waiting (a task waits if the queue
    /// is full). Only the controls build's `reply-before-commit` bug uses it.
    pub fn reply_unbudgeted(&self, rid: Option<&str>, reply: &Reply) {
        let q = Queued::reply(rid, reply, None);
        if let Err(mpsc::error::TrySendError::Full(out)) = self.tx.try_send(Out::Frame(q)) {
            let tx = self.tx.clone();
            tokio::spawn(async move {
                let _ = tx.send(out).await;
            });
        }
    }

    pub fn is_revoked(&self) -> bool {
        matches!(*self.pushes(), Pushes::Revoked)
    }

    /// Called by the writer when its queue is empty: the overflow hints to send, if any
    /// (pushes are queued again from now on).
    pub fn take_overflow(&self) -> Option<BTreeMap<String, i64>> {
        let mut pushes = self.pushes();
        match std::mem::replace(&mut *pushes, Pushes::Open) {
            Pushes::Overflowed(pending) => Some(pending),
            other => {
                *pushes = other;
                None
            }
        }
    }

    /// Offers a push or hint: queued if it fits the frame count and the byte budget, else
    /// the connection overflows. Never waits.
    fn offer(&self, conv: &str, head: i64, kind: Kind, text: String) {
        let mut pushes = self.pushes();
        match &mut *pushes {
            Pushes::Revoked => return,
            Pushes::Overflowed(pending) => {
                let h = pending.entry(conv.to_string()).or_insert(head);
                *h = (*h).max(head);
                return;
            }
            Pushes::Open => {}
        }
        // A push that does not fit the frame count or the byte budget overflows: the
        // client is told by a hint once the queue drained, and syncs (D5's repair path).
        let charge = if bugs::active(Bug::PushesUncharged) {
            0
        } else {
            text.len()
        };
        let full = match self.budget.try_reserve(charge) {
            None => true,
            Some(r) => match self.tx.try_send(Out::Frame(Queued::push(kind, text, r))) {
                Ok(()) => false,
                Err(mpsc::error::TrySendError::Full(_)) => true,
                Err(mpsc::error::TrySendError::Closed(_)) => false,
            },
        };
        if full {
            tracing::info!(
                conn = self.id,
                "outbound queue full (frames or bytes): pushes paused until it drains"
            );
            *pushes = Pushes::Overflowed(BTreeMap::from([(conv.to_string(), head)]));
        }
    }

    /// No push or hint is offered or written from now on. Returns whether it was not yet.
    fn revoke(&self) -> bool {
        !matches!(
            std::mem::replace(&mut *self.pushes(), Pushes::Revoked),
            Pushes::Revoked
        )
    }
}

/// Asks a connection's reader to close, with a close code and an error frame to send
/// before the close frame.
pub type CloseRequest = (u16, Option<WireError>);

/// The channel on which a connection's reader receives [`CloseRequest`]s: room for one,
/// so the first request wins and later ones are no-ops.
pub fn close_channel() -> (mpsc::Sender<CloseRequest>, mpsc::Receiver<CloseRequest>) {
    mpsc::channel(1)
}

/// One authenticated connection as fan-out, the sweep and revocation see it: a handle,
/// not the connection's state. The connection's task owns its state (socket, session,
/// close code); the hub reaches it only through its queue ([`Outbox`]) and by asking it
/// to close (a [`CloseRequest`] on its channel).
pub struct ConnHandle {
    pub id: u64,
    pub who: Principal,
    /// The connection's outbound queue (shared with its request tasks).
    pub outbox: Arc<Outbox>,
    /// Ends the connection from outside (a stale install).
    close: mpsc::Sender<CloseRequest>,
    /// Set by `sub` (before its database read, so no event falls in between; cleared again
    /// if that read fails): only subscribed connections get pushes and hints.
    subscribed: AtomicBool,
}

impl ConnHandle {
    pub fn new(
        id: u64,
        who: Principal,
        outbox: Arc<Outbox>,
        close: mpsc::Sender<CloseRequest>,
    ) -> ConnHandle {
        ConnHandle {
            id,
            who,
            outbox,
            close,
            subscribed: AtomicBool::new(false),
        }
    }

    /// `device:epoch`, as fan-out's audience query names current installs.
    pub fn install_key(&self) -> String {
        format!("{}:{}", self.who.device, self.who.epoch)
    }

    /// Asks the connection to close with `code` after `error` (the first request wins).
    pub fn close(&self, code: u16, error: Option<WireError>) {
        let _ = self.close.try_send((code, error));
    }

    /// Queues an `event` push (`frame`, rendered once per event by fan-out, not once per
    /// recipient) unless the queue is full or overflowed.
    pub fn push(&self, ev: &protocol::Event, frame: &str) {
        self.outbox
            .offer(&ev.conv, ev.seq, Kind::Event, frame.to_string());
    }

    /// Queues a `hint`.
    pub fn hint(&self, conv: &str, head: i64, why: HintWhy) {
        let text = protocol::render(&Frame::Push(Push::Hint { conv, head, why }));
        self.outbox.offer(conv, head, Kind::Hint, text);
    }

    /// The install is no longer current (reinstalled or removed): no push or hint is
    /// offered or written from now on, and the connection closes with STALE_INSTALL (1008).
    pub fn revoke(&self) {
        self.revoke_with(Some(WireError::StaleInstall));
    }

    /// As [`ConnHandle::revoke`], for a connection whose own request was just answered
    /// STALE_INSTALL (that answer is its error frame). The answer may come first: the
    /// connection then leaves the hub before the install notification looks for it, so
    /// this is the only revocation it gets, and without it the pushes still queued (the
    /// backlog a reinstall cuts off) would be written before the close.
    pub fn revoke_answered(&self) {
        self.revoke_with(None);
    }

    fn revoke_with(&self, error: Option<WireError>) {
        if self.outbox.revoke() {
            tracing::info!(conn = self.id, device = %self.who.device, epoch = self.who.epoch, "install is stale: closing");
        }
        self.close(1008, error);
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
        if h.outbox.is_revoked() || h.subscribed.swap(true, Ordering::AcqRel) {
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

    /// Whether no connection is subscribed (fan-out then has nobody to read for).
    pub fn none_subscribed(&self) -> bool {
        self.by_user
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty()
    }

    /// Every subscribed connection (for the sweep).
    pub fn all(&self) -> Vec<Arc<ConnHandle>> {
        let m = self.by_user.read().unwrap_or_else(|p| p.into_inner());
        m.values().flatten().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle() -> (
        Arc<ConnHandle>,
        mpsc::Receiver<Out>,
        mpsc::Receiver<CloseRequest>,
    ) {
        let (outbox, rx) = Outbox::new(1, 8, 1 << 16);
        let (close_tx, close_rx) = close_channel();
        let who = Principal {
            user: "bob".into(),
            device: "b1".into(),
            epoch: 1,
        };
        (
            Arc::new(ConnHandle::new(1, who, outbox, close_tx)),
            rx,
            close_rx,
        )
    }

    /// A STALE_INSTALL answer revokes the connection's pushes as the install notification
    /// does (the writer then skips the backlog), and closes with 1008 without a second
    /// error frame.
    #[test]
    fn a_stale_install_answer_revokes_pushes_and_closes_quietly() {
        let (h, _rx, mut close_rx) = handle();
        h.revoke_answered();
        assert!(
            h.outbox.is_revoked(),
            "pushes still open after STALE_INSTALL"
        );
        assert_eq!(close_rx.try_recv().unwrap(), (1008, None));
    }

    /// The notification's revocation closes with the STALE_INSTALL error frame.
    #[test]
    fn a_revoked_install_closes_with_its_error() {
        let (h, _rx, mut close_rx) = handle();
        h.revoke();
        assert!(h.outbox.is_revoked());
        assert_eq!(
            close_rx.try_recv().unwrap(),
            (1008, Some(WireError::StaleInstall))
        );
    }
}
