//! The delivery core ([`super::delivery`]) driven with I/O: the pump applies pushes and
//! hints one at a time, runs the syncs they ask for page by page, persists what it stores
//! before any ack that covers it (D3), and sends the coalesced acks when they are due.

use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use anyhow::anyhow;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::delivery::{Hinted, NextPage, Pushed};
use super::received::Received;
use super::{bugs, ClientError, CrashAt, Inner, State, SYNC_PAGES_MAX};
use im_check::history::{Invoke, Line, Store, Via};
use im_protocol::wire::{Event, HintWhy, Reply, Request};
use im_protocol::ServerFrame;

/// What a conversation's epoch in a frame means to this device (issue 21).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum EpochSeen {
    /// The epoch it knows (or the first it hears of).
    Same,
    /// A newer one: what it held of the conversation is discarded; sync again from 0.
    Moved,
    /// An older one: the frame was read before the move; ignore what it carries.
    Stale,
}

/// What [`Inner::apply_page`] made of a sync page.
enum Applied {
    /// The epoch moved, or the page was read under another: sync again from 0.
    Restart,
    /// The page was applied: what to ask next, and what it stored (still to persist when
    /// `defer_persist`, the `ack-before-persist` client bug).
    Page {
        next: NextPage,
        stored: Vec<(i64, Value)>,
        defer_persist: bool,
    },
}

impl Inner {
    /// Issue 21: the server named `epoch` for `conv`. When it moved from the one this device
    /// knew, the database may have lost history the device holds, and another message may
    /// now stand at a seq it has: it discards every event it holds of the conversation and
    /// its cursor (the delivery core forgets it), records an `epoch` line, and the caller
    /// syncs again from 0, so the device holds what the database has and its cursor
    /// follows. Persisted by the caller's next write.
    pub(super) fn see_epoch(&self, st: &mut super::State, conv: &str, epoch: i64) -> EpochSeen {
        let c = st.file.convs.entry(conv.to_string()).or_default();
        match c.epoch {
            None => {
                c.epoch = Some(epoch);
                EpochSeen::Same
            }
            Some(known) if known == epoch => EpochSeen::Same,
            Some(known) if epoch < known => {
                st.stats.stale_epoch_frames += 1;
                EpochSeen::Stale
            }
            Some(known) => {
                let dropped = c.events.len();
                c.events.clear();
                c.cursor = 0;
                c.server_delivered = None;
                c.epoch = Some(epoch);
                st.delivery.forget(conv);
                st.heads.remove(conv);
                st.stats.epoch_moves += 1;
                st.resync.insert(conv.to_string());
                self.rec(
                    None,
                    Line::Store(Store::Epoch {
                        conv: conv.to_string(),
                        from: known,
                        to: epoch,
                        dropped,
                    }),
                );
                EpochSeen::Moved
            }
        }
    }

    /// Sends an ack of the cursor before persisting `events` (the `ack-before-persist`
    /// client bug), then persists them, unless the crash point struck in between.
    pub(super) async fn ack_then_persist(&self, conv: &str, via: Via, events: Vec<(i64, Value)>) {
        let (cursor, timeout) = {
            let st = self.lock();
            (st.cursor(conv), st.opts.request_timeout)
        };
        if self.lock().opts.auto_ack {
            let _ = self.send_ack(conv, cursor, timeout, false).await;
            let mut st = self.lock();
            st.auto_acks_done += 1;
            let n = st.auto_acks_done;
            if self.crash_point(&mut st, CrashAt::AfterAck(n)) {
                return;
            }
        }
        let mut st = self.lock();
        if self.persist(&mut st).is_ok() {
            self.rec_store(conv, via, &events, cursor);
        }
    }

    /// Sends an ack and records the reported `delivered`.
    /// `explicit`: a test acks on purpose (`Client::ack`), not the client's own logic; the
    /// checker holds only the client's own acks to D3.
    pub(super) async fn send_ack(
        &self,
        conv: &str,
        seq: i64,
        timeout: Duration,
        explicit: bool,
    ) -> Result<Value, ClientError> {
        let now = self.epoch_of(conv);
        self.send_ack_under(conv, seq, timeout, explicit, now).await
    }

    /// The conversation's epoch as this client knows it.
    fn epoch_of(&self, conv: &str) -> Option<i64> {
        self.lock().file.convs.get(conv).and_then(|c| c.epoch)
    }

    /// [`Inner::send_ack`] of a seq chosen under epoch `chosen_under`: an automatic ack
    /// leaves only if the conversation's epoch is still that one when it is recorded
    /// (issue 21: a reconcile in between discarded what it covers).
    async fn send_ack_under(
        &self,
        conv: &str,
        seq: i64,
        timeout: Duration,
        explicit: bool,
        chosen_under: Option<i64>,
    ) -> Result<Value, ClientError> {
        self.lock().stats.acks_sent += 1;
        let r = self
            .request_rec_if(
                Request::Ack {
                    conv: conv.to_string(),
                    seq,
                }
                .into(),
                timeout,
                Invoke::Ack {
                    conv: conv.to_string(),
                    seq,
                    explicit,
                },
                |st| explicit || st.still_under(conv, chosen_under),
            )
            .await;
        {
            let mut st = self.lock();
            if !st.still_under(conv, chosen_under) {
                // Issue 21: the epoch moved while the ack was on its way; the core forgot
                // what it covered, and its answer is about a conversation that is gone.
                drop(st);
                self.notify();
                return r.map(|r| r.value);
            }
            match &r {
                Ok(reply) => match reply.reply() {
                    Some(&Reply::Acked { delivered, .. }) => {
                        st.record_delivered(conv, delivered);
                        st.delivery.ack_ok(conv, seq, delivered, Instant::now());
                        // Best effort: `server_delivered` is informational, a failed
                        // write is counted and logged by `persist`.
                        let _ = self.persist(&mut st);
                    }
                    _ => st.stats.malformed_frames += 1,
                },
                Err(_) => st.stats.ack_errors += 1,
            }
        }
        self.notify();
        r.map(|r| r.value)
    }

    /// Syncs `conv` from `from` (clamped to the cursor) until the server says
    /// `complete`, storing every event and moving the cursor (SPEC section 5). One sync
    /// of a conversation at a time: a second waits for the first to end. Two at once
    /// shared the core's page floor, and one's first page was judged against the other's
    /// progress (`im06_failover_pg_auto_failover`: `sub`'s sync from 0 beside a gap
    /// repair from 0 after the epoch moved, refused as "not strictly ascending").
    pub(super) async fn sync_until_complete(
        &self,
        conv: &str,
        from: i64,
    ) -> Result<(), ClientError> {
        self.sync_then(conv, from, |_| ()).await.0
    }

    /// [`Inner::sync_until_complete`], then `then` on the state, still inside the one
    /// sync of `conv`: what ends a sync in the delivery core (`sync_ended` clears its
    /// page floor) must not land after the next sync of `conv` began, or that sync's
    /// first page is judged against no floor at all: from the cursor, as "no progress"
    /// (`two_syncs_of_one_conversation_never_overlap` failed 6 times of 40 so).
    pub(super) async fn sync_then<R>(
        &self,
        conv: &str,
        from: i64,
        then: impl FnOnce(&mut State) -> R,
    ) -> (Result<(), ClientError>, R) {
        let one = {
            let mut syncing = self.syncing.lock().unwrap_or_else(PoisonError::into_inner);
            syncing.entry(conv.to_string()).or_default().clone()
        };
        let _one_at_a_time = one.lock().await;
        let cancelled = SyncCancelled {
            inner: self,
            conv,
            armed: true,
        };
        let r = self.sync_pages(conv, from).await;
        cancelled.disarm();
        let mut st = self.lock();
        if r.is_err() {
            sync_failed(&mut st, conv);
        } else {
            st.resync.remove(conv);
        }
        let after = then(&mut st);
        (r, after)
    }

    async fn sync_pages(&self, conv: &str, from: i64) -> Result<(), ClientError> {
        let (limit, timeout, mut after) = {
            let mut st = self.lock();
            (
                st.opts.sync_limit,
                st.opts.request_timeout,
                st.delivery.sync_begin(conv, from),
            )
        };
        for _ in 0..SYNC_PAGES_MAX {
            // Issue 21: the epoch this page is asked under. Another path (a `subbed`, a push)
            // may move it while the page is on its way: the page's `after` then belongs to
            // what was discarded, and the sync starts again from 0.
            let asked_under = self.epoch_of(conv);
            let reply = self.ask_page(conv, after, limit, timeout).await?;
            let Some(Reply::Synced {
                events,
                head,
                complete,
                ..
            }) = reply.reply()
            else {
                unreachable!("ask_page returns only `synced` replies");
            };
            let applied = self.apply_page(conv, asked_under, events, *head, *complete);
            self.notify();
            let (next, stored, defer_persist) = match applied? {
                Applied::Restart => {
                    after = self.lock().delivery.sync_begin(conv, 0);
                    continue;
                }
                Applied::Page {
                    next,
                    stored,
                    defer_persist,
                } => (next, stored, defer_persist),
            };
            if defer_persist {
                self.ack_then_persist(conv, Via::Sync, stored).await;
                if self.lock().dead {
                    return Err(ClientError::Disconnected);
                }
            }
            match next {
                NextPage::Done => return Ok(()),
                NextPage::After(l) => after = l,
                NextPage::Stuck { after } => {
                    self.lock().stats.sync_errors += 1;
                    return Err(ClientError::Other(anyhow!(
                        "sync of {conv} after {after} made no progress and is not complete"
                    )));
                }
                NextPage::Disordered { after, head } => {
                    self.lock().stats.sync_errors += 1;
                    return Err(ClientError::Other(anyhow!(
                        "D3: a sync page of {conv} was not strictly ascending within \
                         ({after}, {head}]: refused, nothing of it stored"
                    )));
                }
            }
        }
        Err(ClientError::Other(anyhow!(
            "sync of {conv} did not complete within {SYNC_PAGES_MAX} pages"
        )))
    }

    /// Asks for the page of `conv` after `after`: a `synced` reply, or the error (counted;
    /// a reply that is not `synced` is malformed).
    async fn ask_page(
        &self,
        conv: &str,
        after: i64,
        limit: i64,
        timeout: Duration,
    ) -> Result<Received, ClientError> {
        let request = Request::Sync {
            conv: conv.to_string(),
            after,
            limit: Some(limit),
        };
        let r = self.request(request, timeout).await;
        let mut st = self.lock();
        let reply = match r {
            Ok(reply) if matches!(reply.reply(), Some(Reply::Synced { .. })) => return Ok(reply),
            Ok(reply) => reply,
            Err(e) => {
                st.stats.syncs_run += 1;
                st.stats.sync_errors += 1;
                return Err(e);
            }
        };
        st.stats.syncs_run += 1;
        st.stats.sync_errors += 1;
        st.stats.malformed_frames += 1;
        let why = match &reply.frame {
            Err(e) => e.to_string(),
            Ok(_) => "not a `synced` frame".into(),
        };
        Err(ClientError::Other(anyhow!(
            "malformed synced reply ({why}): {}",
            reply.value
        )))
    }

    /// Stores what a page asked under epoch `asked_under` holds that is new (D3: the
    /// delivery core moves the cursor only over stored events) and persists it, unless the
    /// epoch moved meanwhile or the page names another (then the sync starts again from
    /// 0, [`Applied::Restart`]).
    fn apply_page(
        &self,
        conv: &str,
        asked_under: Option<i64>,
        events: &[Event],
        head: i64,
        complete: bool,
    ) -> Result<Applied, ClientError> {
        let mut st = self.lock();
        let st = &mut *st;
        st.stats.syncs_run += 1;
        st.note_head(conv, head);
        if !st.still_under(conv, asked_under) {
            return Ok(Applied::Restart);
        }
        let mut page: Vec<(i64, &Event)> = Vec::with_capacity(events.len());
        let mut seen = EpochSeen::Same;
        for ev in events {
            if ev.conv != conv {
                st.stats.malformed_frames += 1;
                continue;
            }
            match self.see_epoch(st, conv, ev.epoch) {
                EpochSeen::Same => page.push((ev.seq, ev)),
                s => seen = s,
            }
        }
        if seen != EpochSeen::Same {
            // The epoch moved (what was held is gone: start again from 0), or the page was
            // read before a move (ask again).
            return Ok(Applied::Restart);
        }
        let seqs: Vec<i64> = page.iter().map(|(s, _)| *s).collect();
        let c = st.file.convs.entry(conv.to_string()).or_default();
        let outcome = st
            .delivery
            .synced(conv, &seqs, head, complete, |s| c.events.contains_key(&s));
        st.stats.duplicates_ignored += outcome.duplicates as u64;
        let mut stored: Vec<(i64, Value)> = Vec::new();
        for i in outcome.new {
            let (seq, ev) = page[i];
            c.events.insert(seq, ev.to_json());
            st.stats.events_synced += 1;
            stored.push((seq, Value::String(ev.mid.clone())));
        }
        let next = outcome.next;
        let cursor = st.cursor(conv);
        if st.bug(bugs::ACK_BEFORE_PERSIST) && !stored.is_empty() {
            return Ok(Applied::Page {
                next,
                stored,
                defer_persist: true,
            });
        }
        self.persist(st).map_err(ClientError::Other)?;
        self.rec_store(conv, Via::Sync, &stored, cursor);
        st.sync_pages_done += 1;
        let n = st.sync_pages_done;
        if self.crash_point(st, CrashAt::AfterSyncPage(n)) {
            return Err(ClientError::Disconnected);
        }
        Ok(Applied::Page {
            next,
            stored,
            defer_persist: false,
        })
    }

    /// Acks the cursor of `conv` now if it is above what the server has (the delivery
    /// core decides, [`super::Delivery::begin_ack`]) and waits for the answer. Never acks
    /// beyond the cursor, never while the state file is behind memory (D3).
    pub(super) async fn auto_ack(&self, conv: &str) {
        if let Some((target, timeout, epoch)) = self.begin_auto_ack(conv) {
            self.finish_auto_ack(conv, target, timeout, epoch).await;
        }
    }

    /// The first half of [`Inner::auto_ack`]: the seq to ack, if any, and the timeout.
    pub(super) fn begin_auto_ack(&self, conv: &str) -> Option<(i64, Duration, Option<i64>)> {
        let mut st = self.lock();
        if !st.opts.auto_ack {
            return None;
        }
        if st.dirty && self.persist(&mut st).is_err() {
            st.delivery.postpone_ack(conv, Instant::now());
            return None;
        }
        let target = st.delivery.begin_ack(conv, Instant::now())?;
        let epoch = st.file.convs.get(conv).and_then(|c| c.epoch);
        Some((target, st.opts.request_timeout, epoch))
    }

    /// The second half of [`Inner::auto_ack`]: sends the ack [`Inner::begin_auto_ack`]
    /// chose and reports the answer to the delivery core.
    pub(super) async fn finish_auto_ack(
        &self,
        conv: &str,
        target: i64,
        timeout: Duration,
        chosen_under: Option<i64>,
    ) {
        let r = self
            .send_ack_under(conv, target, timeout, false, chosen_under)
            .await;
        {
            let mut st = self.lock();
            st.auto_acks_done += 1;
            let n = st.auto_acks_done;
            if self.crash_point(&mut st, CrashAt::AfterAck(n)) {
                return;
            }
            // An ack chosen under an epoch that has since moved failed because of the move
            // (it never left) or on its own; either way it is not the new epoch's ack, and
            // reporting it would cancel the new epoch's coalesced ack (the `ack_failed` of
            // a non-retryable error clears the timer): its seqs would never be acked.
            let moved = !st.still_under(conv, chosen_under);
            if let (Err(e), false) = (&r, moved) {
                tracing::debug!(conv, seq = target, error = %e, "automatic ack failed");
                st.delivery
                    .ack_failed(conv, e.is_retryable(), Instant::now());
            }
        }
        self.notify();
    }

    /// After new events for `conv`: arm the ack timer; true if enough piled up to ack now.
    fn maybe_ack(&self, conv: &str) -> bool {
        self.lock().delivery.stored(conv, Instant::now())
    }

    fn next_ack_deadline(&self) -> Option<Instant> {
        self.lock().delivery.next_due()
    }

    /// Conversations whose coalesced ack is due.
    fn due_acks(&self) -> Vec<String> {
        self.lock().delivery.due(Instant::now())
    }

    /// Runs the sync a push or a hint asked for; true if the core says to ack now.
    async fn repair(&self, conv: &str, from: i64, why: &str) -> bool {
        let (r, ack_now) = self
            .sync_then(conv, from, |st| {
                st.delivery.sync_ended(conv, Instant::now())
            })
            .await;
        if let Err(e) = r {
            tracing::debug!(conv, error = %e, "{why} sync failed; waiting for the next hint");
        }
        ack_now
    }

    /// Applies one `event` push (SPEC section 5: contiguous cursor, duplicates, gaps);
    /// returns its conversation if it is to be acked now.
    async fn on_event_push(&self, ev: &Event) -> Option<String> {
        let (conv, seq) = (ev.conv.clone(), ev.seq);
        let mut deferred = None;
        let sync_after = {
            let mut st = self.lock();
            let st = &mut *st;
            st.stats.pushes_received += 1;
            if self.see_epoch(st, &conv, ev.epoch) == EpochSeen::Stale {
                return None;
            }
            match st.delivery.push(&conv, seq) {
                Pushed::Duplicate => {
                    st.stats.duplicates_ignored += 1;
                    None
                }
                Pushed::New { gap, sync_after } => {
                    let c = st.file.convs.entry(conv.clone()).or_default();
                    c.events.insert(seq, ev.to_json());
                    st.stats.pushes_applied += 1;
                    if gap {
                        st.stats.gaps_detected += 1;
                    }
                    let cursor = st.cursor(&conv);
                    let stored = vec![(seq, Value::String(ev.mid.clone()))];
                    if st.bug(bugs::ACK_BEFORE_PERSIST) {
                        deferred = Some(stored);
                    } else if self.persist(st).is_ok() {
                        self.rec_store(&conv, Via::Push, &stored, cursor);
                    }
                    // A failed write is counted and blocks acks until a later write succeeds.
                    sync_after
                }
            }
        };
        self.notify();
        if let Some(stored) = deferred {
            self.ack_then_persist(&conv, Via::Push, stored).await;
        }
        let ack_now = match sync_after {
            Some(from) => self.repair(&conv, from, "gap repair").await,
            None => self.maybe_ack(&conv),
        };
        ack_now.then_some(conv)
    }

    /// Applies one `hint` push: sync when the server is ahead, then ack right away
    /// (the sweep hints only devices whose delivered cursor is below head). This is
    /// the client's half of D5: a lost push or a lost ack is repaired by the next hint.
    /// Returns the conversation if it is to be acked now.
    async fn on_hint(&self, conv: &str, head: i64, why: HintWhy) -> Option<String> {
        let hinted = {
            let mut st = self.lock();
            *st.stats
                .hints_received
                .entry(why.as_str().to_string())
                .or_insert(0) += 1;
            st.note_head(conv, head);
            st.delivery.hint(conv, head)
        };
        self.notify();
        let ack_now = match hinted {
            Hinted::Sync(from) => self.repair(conv, from, "hint").await,
            // The pump runs one sync at a time and awaits it, so none is under way here.
            Hinted::SyncRunning | Hinted::AckComing => false,
            Hinted::Ack => true,
        };
        ack_now.then(|| conv.to_string())
    }
}

/// Applies pushes one at a time and sends coalesced acks when their timer is due.
///
/// Syncs run in the pump, one at a time; acks run beside it (at most one per conversation,
/// [`super::Delivery::begin_ack`]): an ack whose answer never comes (a dropped frame waits
/// for the request timeout) must not hold back the pushes and hints queued behind it. D5
/// bounds a repair by the sweep interval and one sync round trip, not by a timeout of
/// the client's. When the connection's pushes end, the acks still on their way finish on
/// their own (they fail as the connection is gone); aborting the pump aborts them too.
pub(super) async fn pump(inner: Arc<Inner>, mut pushes: mpsc::Receiver<ServerFrame>) {
    let mut acks: JoinSet<()> = JoinSet::new();
    loop {
        let deadline = inner.next_ack_deadline();
        let to_ack: Vec<String> = tokio::select! {
            p = pushes.recv() => {
                let Some(frame) = p else { break };
                let conv = match &frame {
                    ServerFrame::Event(ev) => inner.on_event_push(ev).await,
                    ServerFrame::Hint { conv, head, why } => inner.on_hint(conv, *head, *why).await,
                    ServerFrame::Reply { .. } => None,
                };
                conv.into_iter().collect()
            }
            () = sleep_until(deadline) => inner.due_acks(),
            Some(_) = acks.join_next(), if !acks.is_empty() => continue,
        };
        for conv in to_ack {
            if let Some((target, timeout, epoch)) = inner.begin_auto_ack(&conv) {
                let inner = inner.clone();
                acks.spawn(
                    async move { inner.finish_auto_ack(&conv, target, timeout, epoch).await },
                );
            }
        }
    }
    acks.detach_all();
}

/// Sleeps until `at`, or forever when there is none.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// A sync that failed (no page, or a page refused): the delivery core's sync of `conv` is
/// over, and a conversation that had to be synced again after its epoch moved makes the
/// client subscribe again.
fn sync_failed(st: &mut State, conv: &str) {
    st.delivery.sync_failed(conv);
    if st.resync.contains(conv) {
        st.subscribed = false;
    }
}

/// Ends, as failed, a sync whose future was dropped before it ended (a caller's `select!`
/// or timeout cancelled it). Without it the delivery core takes the conversation for still
/// syncing and answers every later hint `SyncRunning`, so nothing syncs it again: nemesis
/// seed 2 on three gateways at 85cb913, a device's turn dropped inside `sub`'s sync left
/// it missing 29 events for the rest of the run while the sweep hinted it every interval.
/// Armed only while the one sync of `conv` is held, so it never ends another's sync.
struct SyncCancelled<'a> {
    inner: &'a Inner,
    conv: &'a str,
    armed: bool,
}

impl SyncCancelled<'_> {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for SyncCancelled<'_> {
    fn drop(&mut self) {
        if self.armed {
            sync_failed(&mut self.inner.lock(), self.conv);
        }
    }
}
