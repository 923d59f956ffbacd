//! The delivery core of a careful device (SPEC section 5), without I/O: per
//! conversation a contiguous cursor, coalesced acks, and gap and hint handling.
//!
//! It is a state machine fed with what the server said (a pushed seq, a sync page, a
//! hint, an ack's outcome, the clock) that answers with what to do next (store or not,
//! sync after which seq, ack which seq now, when the next ack is due). It never writes
//! a frame or a file, never sleeps and never reads the clock itself, so one copy serves
//! the durable test client ([`crate::client::Client`], which awaits each request) and the
//! bench's lean receiver (which pipelines them).
//!
//! Invariants it keeps (the client halves of SPEC's D3 and D5):
//! - D3: an ack never names a seq above the cursor, and the cursor only covers stored
//!   events: every event visible to the device with `seq <= cursor` was stored (the
//!   caller stores an event before it acks, the core only decides *what* to ack);
//! - D5: a push above `cursor + 1` (a gap) and a hint whose head is above the cursor
//!   ask for a sync from the cursor; a hint says the server's delivered cursor is below
//!   its head, so (with [`HintAck::Again`]) whatever the core believed was acked is
//!   lowered and acked again.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// Smallest delay before an automatic ack that failed with a retryable error is tried
/// again (avoids a tight loop while the database is down).
pub const ACK_RETRY_MIN: Duration = Duration::from_millis(200);

/// When automatic acks are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckPolicy {
    /// Ack as soon as this many new events were stored since the last ack.
    pub every: usize,
    /// Ack at the latest this long after the first event that is not yet acked.
    pub after: Duration,
    /// When false nothing is ever acked automatically.
    pub auto: bool,
    /// What a hint whose head the cursor covers makes the core do.
    pub on_hint: HintAck,
}

/// What a `hint` whose head the cursor already covers makes the core do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HintAck {
    /// The server lost what it was told (an ack lost with a crashed database, say): lower
    /// what is believed acked below the head and ack the cursor right away; after a sync
    /// a hint asked for, ack right away too. The harness client: it repairs lost acks.
    Again,
    /// Ack only if no automatic ack is coalescing, and only what was never acked; after
    /// a sync, coalesce as usual. The bench's receiver: under load a sweep hint most often
    /// names an ack that is merely coalescing, and acking again would add the cursor
    /// writes the bench measures.
    IfIdle,
}

impl Default for AckPolicy {
    /// SPEC section 5's coalescing: every 4 events or 50 ms.
    fn default() -> Self {
        AckPolicy {
            every: 4,
            after: Duration::from_millis(50),
            auto: true,
            on_hint: HintAck::Again,
        }
    }
}

/// What to do after a push.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushed {
    /// Already stored (or covered by the cursor): ignore it.
    Duplicate,
    /// New: store it. `sync_after` is set when it opened a gap and no sync of the
    /// conversation is under way: sync from that seq (the cursor).
    New { gap: bool, sync_after: Option<i64> },
}

/// What to do after a sync page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    /// Indices (into the page's seqs) of the events to store.
    pub new: Vec<usize>,
    /// Duplicates in the page.
    pub duplicates: usize,
    pub next: NextPage,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NextPage {
    /// The server said `complete`: the sync is over.
    Done,
    /// Ask for the next page after this seq.
    After(i64),
    /// Not complete, and the page did not move past the request's `after`: a broken
    /// server; the sync is over (as failed).
    Stuck { after: i64 },
    /// D3, the client's mirror of the gateway's page assertion (`store::sync`): the page
    /// was not strictly ascending within (after, head]. Nothing of it was stored and the
    /// cursor did not move; the sync is over (as failed).
    Disordered { after: i64, head: i64 },
}

/// What to do after a hint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hinted {
    /// The server is ahead of the cursor: sync from this seq, then ack right away.
    Sync(i64),
    /// Ahead, but a sync is under way already: it will ack when it ends.
    SyncRunning,
    /// The cursor covers the head: ack right away ([`Delivery::begin_ack`]).
    Ack,
    /// The cursor covers the head and an automatic ack is coalescing ([`HintAck::IfIdle`]):
    /// nothing to do.
    AckComing,
}

/// One conversation's delivery state.
#[derive(Debug, Default, Clone)]
struct Track {
    /// Every event visible to this device with `seq <= cursor` is stored.
    cursor: i64,
    /// Stored seqs above the cursor (out of order, behind a gap).
    above: BTreeSet<i64>,
    /// Highest cursor the server is known to have (our acked seq, or its delivered).
    acked: i64,
    /// An automatic ack on its way: (seq, new events it covers).
    ack_inflight: Option<(i64, usize)>,
    /// New events stored since the last automatic ack.
    new_since_ack: usize,
    /// When an automatic ack is due (first un-acked event + `after`, or a retry).
    due_at: Option<Instant>,
    /// A sync of this conversation is under way; the `after` of its current page.
    sync_after: Option<i64>,
    /// A hint asked for an ack as soon as the running sync ends.
    ack_after_sync: bool,
}

impl Track {
    /// What the server has or is about to have: acks at or below it are pointless.
    fn ack_floor(&self) -> i64 {
        self.ack_inflight
            .map_or(self.acked, |(s, _)| s.max(self.acked))
    }

    /// Drops stored seqs the cursor now covers and moves the cursor over those that
    /// continue it contiguously (unless `jump_only`, the `cursor-max` bug).
    fn settle(&mut self, jump_only: bool) {
        if self
            .above
            .first()
            .is_some_and(|&first| first <= self.cursor)
        {
            self.above = self.above.split_off(&(self.cursor.saturating_add(1)));
        }
        if jump_only {
            return;
        }
        while let Some(next) = self.cursor.checked_add(1) {
            if !self.above.remove(&next) {
                break;
            }
            self.cursor = next;
        }
    }
}

/// The delivery state of one device, by conversation.
#[derive(Debug, Clone)]
pub struct Delivery {
    policy: AckPolicy,
    /// The `cursor-max` client bug (`crate::client::bugs::CURSOR_MAX`): the cursor is the
    /// highest seq seen, gaps are never synced.
    cursor_max: bool,
    convs: HashMap<String, Track>,
}

impl Delivery {
    pub fn new(policy: AckPolicy, cursor_max: bool) -> Delivery {
        Delivery {
            policy,
            cursor_max,
            convs: HashMap::new(),
        }
    }

    pub fn set_policy(&mut self, policy: AckPolicy) {
        self.policy = policy;
    }

    fn track(&mut self, conv: &str) -> &mut Track {
        if !self.convs.contains_key(conv) {
            self.convs.insert(conv.to_string(), Track::default());
        }
        self.convs.get_mut(conv).expect("inserted above")
    }

    /// Restores a conversation from durable state: its cursor, the stored seqs (any;
    /// those above the cursor matter) and the last `delivered` the server reported.
    pub fn restore(
        &mut self,
        conv: &str,
        cursor: i64,
        stored: impl IntoIterator<Item = i64>,
        delivered: Option<i64>,
    ) {
        let t = self.track(conv);
        t.cursor = cursor;
        t.above = stored.into_iter().filter(|&s| s > cursor).collect();
        t.acked = delivered.unwrap_or(0);
    }

    /// Issue 21: the conversation's epoch moved (the database may have lost history): the
    /// core forgets it (cursor 0, nothing stored, acked or on its way), as for a
    /// conversation never seen.
    pub fn forget(&mut self, conv: &str) {
        self.convs.remove(conv);
    }

    /// Highest seq through which every visible event is stored (0 if none).
    pub fn cursor(&self, conv: &str) -> i64 {
        self.convs.get(conv).map_or(0, |t| t.cursor)
    }

    /// How many stored seqs above the cursor the core remembers for `conv`: its memory of
    /// a conversation, never more than the events stored above the cursor (those it has
    /// covered are forgotten).
    pub fn held(&self, conv: &str) -> usize {
        self.convs.get(conv).map_or(0, |t| t.above.len())
    }

    /// What the core believes the server's delivered cursor is (acked or reported).
    pub fn acked(&self, conv: &str) -> i64 {
        self.convs.get(conv).map_or(0, |t| t.acked)
    }

    /// The server reported `delivered` in a `subbed` reply: that is what it has.
    pub fn subscribed(&mut self, conv: &str, delivered: i64) {
        let t = self.track(conv);
        t.acked = delivered;
        t.ack_inflight = None;
    }

    /// An `event` push of `seq` (SPEC section 5: contiguous cursor, duplicates, gaps).
    pub fn push(&mut self, conv: &str, seq: i64) -> Pushed {
        let cursor_max = self.cursor_max;
        let t = self.track(conv);
        if seq <= t.cursor || t.above.contains(&seq) {
            return Pushed::Duplicate;
        }
        t.new_since_ack += 1;
        if cursor_max {
            // The `cursor-max` bug: jump to the highest seq seen, never sync a gap.
            t.cursor = t.cursor.max(seq);
            t.settle(true);
            return Pushed::New {
                gap: false,
                sync_after: None,
            };
        }
        let gap = Some(seq) != t.cursor.checked_add(1);
        if gap {
            t.above.insert(seq);
        } else {
            // The common case (in order): no set to touch unless events wait behind it.
            t.cursor = seq;
            if !t.above.is_empty() {
                t.settle(false);
            }
        }
        let sync_after = (gap && t.sync_after.is_none()).then(|| {
            t.sync_after = Some(t.cursor);
            t.cursor
        });
        Pushed::New { gap, sync_after }
    }

    /// Starts a sync of `conv` from `from` clamped to the cursor; returns the `after` of
    /// the first page.
    pub fn sync_begin(&mut self, conv: &str, from: i64) -> i64 {
        let t = self.track(conv);
        let after = from.min(t.cursor);
        t.sync_after = Some(after);
        after
    }

    /// A `synced` page: `seqs` as listed, the server's `head` and `complete`. `have`
    /// tells whether a seq at or below the cursor is stored (the caller's store decides
    /// there; above the cursor the core knows). Every visible event in (after, last]
    /// was returned, so the store holds everything visible through the page's last
    /// seq; `complete` extends that to `head` (events this user may not see are not
    /// holes).
    pub fn synced(
        &mut self,
        conv: &str,
        seqs: &[i64],
        head: i64,
        complete: bool,
        have: impl Fn(i64) -> bool,
    ) -> Page {
        let cursor_max = self.cursor_max;
        let t = self.track(conv);
        let after = t.sync_after.unwrap_or(t.cursor);
        // The lower bound only when this core knows the request's `after` (`sync_begin`,
        // or the previous page); a caller that pipelines syncs without telling it (the
        // bench) gets the order and the upper bound checked.
        let floor = t.sync_after.unwrap_or(i64::MIN);
        let ordered = seqs.windows(2).all(|w| w[0] < w[1])
            && seqs.iter().all(|&seq| seq > floor && seq <= head);
        if !ordered {
            t.sync_after = None;
            return Page {
                new: Vec::new(),
                duplicates: 0,
                next: NextPage::Disordered { after, head },
            };
        }
        let mut new = Vec::new();
        let mut duplicates = 0;
        let mut last: Option<i64> = None;
        // The page is strictly ascending (checked above), so no seq comes twice in it, and
        // the cursor moves to its last seq below: nothing of it needs keeping in `above`.
        for (i, &seq) in seqs.iter().enumerate() {
            last = Some(last.map_or(seq, |l| l.max(seq)));
            let stored = if seq <= t.cursor {
                have(seq)
            } else {
                t.above.contains(&seq)
            };
            if stored {
                duplicates += 1;
            } else {
                new.push(i);
            }
        }
        if let Some(last) = last {
            t.cursor = t.cursor.max(last);
        }
        if complete {
            t.cursor = t.cursor.max(head);
        }
        t.settle(cursor_max);
        t.new_since_ack += new.len();
        let next = if complete {
            NextPage::Done
        } else {
            match last {
                Some(l) if l > after => NextPage::After(l),
                _ => NextPage::Stuck { after },
            }
        };
        t.sync_after = match next {
            NextPage::After(l) => Some(l),
            NextPage::Done | NextPage::Stuck { .. } | NextPage::Disordered { .. } => None,
        };
        Page {
            new,
            duplicates,
            next,
        }
    }

    /// A sync request of `conv` failed (no page): the sync is over.
    pub fn sync_failed(&mut self, conv: &str) {
        self.track(conv).sync_after = None;
    }

    /// A sync of `conv` ended (done, stuck or failed): true when an ack is due right
    /// now, because a hint asked for one (then [`Delivery::begin_ack`]), else as after
    /// new events ([`Delivery::stored`]).
    pub fn sync_ended(&mut self, conv: &str, now: Instant) -> bool {
        let t = self.track(conv);
        t.sync_after = None;
        if std::mem::take(&mut t.ack_after_sync) {
            self.policy.auto
        } else {
            self.stored(conv, now)
        }
    }

    /// After new events of `conv` were stored: arms the ack timer, and returns true when
    /// `every` events piled up, so an ack is due now (then [`Delivery::begin_ack`]).
    pub fn stored(&mut self, conv: &str, now: Instant) -> bool {
        let policy = self.policy;
        if !policy.auto {
            return false;
        }
        let t = self.track(conv);
        if t.cursor <= t.ack_floor() {
            return false;
        }
        if t.due_at.is_none() {
            t.due_at = Some(now + policy.after);
        }
        t.new_since_ack >= policy.every.max(1)
    }

    /// A `hint{conv, head}`: the server's delivered cursor is below `head`. Ahead of the
    /// cursor it asks for a sync; covered by it, for an ack as [`HintAck`] says.
    pub fn hint(&mut self, conv: &str, head: i64) -> Hinted {
        let again = self.policy.on_hint == HintAck::Again;
        let t = self.track(conv);
        if again {
            t.acked = t.acked.min(head.saturating_sub(1));
        }
        if head <= t.cursor {
            return if again || t.due_at.is_none() {
                Hinted::Ack
            } else {
                Hinted::AckComing
            };
        }
        t.ack_after_sync = again;
        if t.sync_after.is_some() {
            return Hinted::SyncRunning;
        }
        t.sync_after = Some(t.cursor);
        Hinted::Sync(t.cursor)
    }

    /// Starts an automatic ack of `conv`: returns the seq to ack (the cursor) if it is
    /// above what the server has and no automatic ack of `conv` is on its way, and clears
    /// the timer either way (the answer to the ack on its way re-arms it,
    /// [`Delivery::ack_ok`] / [`Delivery::ack_failed`]). D3: never above the cursor. The
    /// caller reports the outcome with [`Delivery::ack_ok`] or [`Delivery::ack_failed`].
    pub fn begin_ack(&mut self, conv: &str, _now: Instant) -> Option<i64> {
        if !self.policy.auto {
            return None;
        }
        let t = self.track(conv);
        t.due_at = None;
        if t.ack_inflight.is_some() || t.cursor <= t.ack_floor() {
            return None;
        }
        let counted = std::mem::take(&mut t.new_since_ack);
        t.ack_inflight = Some((t.cursor, counted));
        Some(t.cursor)
    }

    /// An ack of `seq` (automatic or not) was answered with `delivered`.
    /// Events stored meanwhile are acked `after` from now, or at once when `every` of them
    /// piled up while the ack was on its way.
    pub fn ack_ok(&mut self, conv: &str, seq: i64, delivered: i64, now: Instant) {
        let (after, every) = (self.policy.after, self.policy.every.max(1));
        let t = self.track(conv);
        t.acked = t.acked.max(delivered).max(seq);
        if t.ack_inflight.is_some_and(|(s, _)| s <= t.acked) {
            t.ack_inflight = None;
        }
        if t.cursor > t.ack_floor() {
            let at = if t.new_since_ack >= every {
                now
            } else {
                now + after
            };
            t.due_at = Some(t.due_at.map_or(at, |d| d.min(at)));
        }
    }

    /// The automatic ack under way failed; `retryable` when the same ack may succeed
    /// later on the same connection (a timeout, `UNAVAILABLE`, `INTERNAL`): it is tried
    /// again after `max(after, ACK_RETRY_MIN)`.
    pub fn ack_failed(&mut self, conv: &str, retryable: bool, now: Instant) {
        let after = self.policy.after;
        let t = self.track(conv);
        if let Some((_, counted)) = t.ack_inflight.take() {
            t.new_since_ack += counted;
        }
        t.due_at = retryable.then(|| now + after.max(ACK_RETRY_MIN));
    }

    /// The due ack of `conv` cannot be sent now (the state file is behind memory): try it
    /// again after `max(after, ACK_RETRY_MIN)`, not in a busy loop.
    pub fn postpone_ack(&mut self, conv: &str, now: Instant) {
        let after = self.policy.after;
        let t = self.track(conv);
        if t.due_at.is_some() {
            t.due_at = Some(now + after.max(ACK_RETRY_MIN));
        }
    }

    /// When the next automatic ack is due, over all conversations.
    pub fn next_due(&self) -> Option<Instant> {
        if !self.policy.auto {
            return None;
        }
        self.convs.values().filter_map(|t| t.due_at).min()
    }

    /// Conversations whose automatic ack is due at `now`.
    pub fn due(&self, now: Instant) -> Vec<String> {
        if !self.policy.auto {
            return Vec::new();
        }
        self.convs
            .iter()
            .filter(|(_, t)| t.due_at.is_some_and(|d| d <= now))
            .map(|(c, _)| c.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn core() -> Delivery {
        Delivery::new(AckPolicy::default(), false)
    }

    #[test]
    fn contiguous_pushes_move_the_cursor_and_ack_every_four() {
        let mut d = core();
        let now = Instant::now();
        for seq in 1..=3 {
            assert_eq!(
                d.push("c", seq),
                Pushed::New {
                    gap: false,
                    sync_after: None
                }
            );
            assert!(!d.stored("c", now));
        }
        assert_eq!(d.next_due(), Some(now + Duration::from_millis(50)));
        assert_eq!(d.push("c", 2), Pushed::Duplicate);
        d.push("c", 4);
        assert!(d.stored("c", now));
        assert_eq!(d.begin_ack("c", now), Some(4));
        assert_eq!(d.cursor("c"), 4);
        assert_eq!(d.next_due(), None);
        d.ack_ok("c", 4, 4, now);
        assert_eq!(d.acked("c"), 4);
        assert_eq!(d.begin_ack("c", now), None);
    }

    #[test]
    fn a_gap_asks_for_one_sync_and_the_page_closes_it() {
        let mut d = core();
        d.push("c", 1);
        assert_eq!(
            d.push("c", 4),
            Pushed::New {
                gap: true,
                sync_after: Some(1)
            }
        );
        // A second gap while the sync runs asks for nothing more.
        assert_eq!(
            d.push("c", 6),
            Pushed::New {
                gap: true,
                sync_after: None
            }
        );
        assert_eq!(d.cursor("c"), 1);
        let page = d.synced("c", &[2, 3, 4], 6, false, |_| true);
        assert_eq!(page.new, vec![0, 1]);
        assert_eq!(page.duplicates, 1);
        assert_eq!(page.next, NextPage::After(4));
        assert_eq!(d.cursor("c"), 4);
        let page = d.synced("c", &[5, 6], 6, true, |_| true);
        assert_eq!(page.new, vec![0]);
        assert_eq!(page.next, NextPage::Done);
        assert_eq!(d.cursor("c"), 6);
    }

    /// D3's mirror: a page out of order, or outside (after, head], stores nothing and
    /// does not move the cursor.
    #[test]
    fn a_disordered_page_is_refused_and_the_cursor_stays() {
        let mut d = core();
        d.subscribed("c", 0);
        let after = d.sync_begin("c", 0);
        assert_eq!(after, 0);
        let page = d.synced("c", &[2, 1], 5, false, |_| true);
        assert_eq!(page.next, NextPage::Disordered { after: 0, head: 5 });
        assert!(page.new.is_empty());
        assert_eq!(d.cursor("c"), 0);
        d.sync_begin("c", 0);
        let page = d.synced("c", &[1, 6], 5, true, |_| true);
        assert_eq!(page.next, NextPage::Disordered { after: 0, head: 5 });
        assert_eq!(d.cursor("c"), 0);
        d.sync_begin("c", 0);
        let page = d.synced("c", &[1, 2], 5, true, |_| true);
        assert_eq!(page.next, NextPage::Done);
        assert_eq!(d.cursor("c"), 5);
    }

    /// A sync's acks are coalesced like a push's (SPEC section 5): a sync that stored
    /// fewer than `every` new events arms the timer instead of acking at once, one that
    /// stored `every` acks now, and with automatic acks off none is ever due.
    #[test]
    fn a_sync_acks_as_the_policy_says() {
        let mut d = core();
        let now = Instant::now();
        d.restore("c", 0, [], None);
        assert_eq!(d.sync_begin("c", 0), 0);
        let page = d.synced("c", &[1, 2], 2, true, |_| false);
        assert_eq!((page.new.len(), page.next), (2, NextPage::Done));
        assert!(!d.sync_ended("c", now), "2 of 4: coalesced, not due yet");
        assert!(d.due(now).is_empty());
        let later = now + AckPolicy::default().after;
        assert_eq!(d.due(later), vec!["c".to_string()], "due by the timer");
        d.sync_begin("c", 2);
        d.synced("c", &[3, 4], 4, true, |_| false);
        assert!(d.sync_ended("c", now), "4 of 4: due now");

        let mut off = Delivery::new(
            AckPolicy {
                auto: false,
                ..AckPolicy::default()
            },
            false,
        );
        off.restore("c", 0, [], None);
        off.sync_begin("c", 0);
        off.synced("c", &[1, 2, 3, 4, 5], 5, true, |_| false);
        assert!(!off.sync_ended("c", now), "automatic acks off");
        assert!(off.due(later).is_empty());
    }

    /// A page that does not go past the `after` it answers (here a page of old events
    /// handed to a core that was not told of the request, as the bench's pipelined syncs
    /// are) ends the sync as stuck: the next request never goes backwards, so every sync
    /// ends.
    #[test]
    fn a_page_below_its_after_ends_the_sync_as_stuck() {
        let mut d = core();
        d.restore("c", 10, 1..=10, Some(10));
        let page = d.synced("c", &[3, 4], 20, false, |_| true);
        assert_eq!(page.next, NextPage::Stuck { after: 10 });
        assert_eq!((page.new.len(), page.duplicates), (0, 2));
        assert_eq!(d.cursor("c"), 10);
    }

    /// The events of an ack that failed still count toward the next one: with `every` 4,
    /// an ack of 4 events that fails for good (not retryable) leaves them unacked, so the
    /// next stored event makes an ack due at once, not 4 events later.
    #[test]
    fn a_failed_acks_events_count_toward_the_next_ack() {
        let mut d = core();
        let now = Instant::now();
        for seq in 1..=4 {
            d.push("c", seq);
        }
        assert!(d.stored("c", now));
        assert_eq!(d.begin_ack("c", now), Some(4));
        d.ack_failed("c", false, now);
        assert_eq!(d.next_due(), None, "not retryable: no retry timer");
        d.push("c", 5);
        assert!(d.stored("c", now), "5 events unacked: due now");
        assert_eq!(d.begin_ack("c", now), Some(5));
    }

    /// A due ack that cannot be sent now (the state file is behind memory) is tried again
    /// `ACK_RETRY_MIN` later, not on the ack timer: a failing disk gets no retry storm.
    #[test]
    fn a_postponed_ack_waits_the_retry_minimum() {
        let mut d = core();
        let now = Instant::now();
        d.push("c", 1);
        assert!(!d.stored("c", now));
        let after = AckPolicy::default().after;
        assert!(after < ACK_RETRY_MIN);
        assert_eq!(d.due(now + after), vec!["c".to_string()]);
        d.postpone_ack("c", now + after);
        assert!(d.due(now + after + after).is_empty(), "postponed");
        assert_eq!(d.next_due(), Some(now + after + ACK_RETRY_MIN));
    }

    #[test]
    fn a_hint_lowers_acked_and_syncs_then_acks() {
        let mut d = core();
        let now = Instant::now();
        d.restore("c", 3, [1, 2, 3], Some(3));
        assert_eq!(d.hint("c", 3), Hinted::Ack);
        assert_eq!(d.begin_ack("c", now), Some(3));
        d.ack_ok("c", 3, 3, now);
        assert_eq!(d.hint("c", 5), Hinted::Sync(3));
        assert_eq!(d.hint("c", 5), Hinted::SyncRunning);
        let page = d.synced("c", &[4, 5], 5, true, |_| true);
        assert_eq!(page.next, NextPage::Done);
        assert!(d.sync_ended("c", now));
        assert_eq!(d.begin_ack("c", now), Some(5));
    }

    #[test]
    fn a_failed_ack_is_retried_not_before_the_minimum() {
        let mut d = core();
        let now = Instant::now();
        d.push("c", 1);
        assert!(!d.stored("c", now));
        assert_eq!(d.begin_ack("c", now), Some(1));
        d.ack_failed("c", true, now);
        assert_eq!(d.next_due(), Some(now + ACK_RETRY_MIN));
        assert_eq!(d.begin_ack("c", now), Some(1));
        d.ack_failed("c", false, now);
        assert_eq!(d.next_due(), None);
    }

    /// The pump does not wait for an ack's answer: a second ack of the conversation waits
    /// until the first one is answered, and the answer re-arms the timer.
    #[test]
    fn one_automatic_ack_per_conversation_is_on_its_way() {
        let mut d = core();
        let now = Instant::now();
        d.push("c", 1);
        assert_eq!(d.begin_ack("c", now), Some(1));
        d.push("c", 2);
        d.stored("c", now);
        assert_eq!(d.begin_ack("c", now), None);
        assert_eq!(d.next_due(), None);
        d.ack_ok("c", 1, 1, now);
        assert_eq!(d.next_due(), Some(now + Duration::from_millis(50)));
        // Four more while the next one is on its way: due the moment it is answered.
        assert_eq!(d.begin_ack("c", now), Some(2));
        for seq in 3..=6 {
            d.push("c", seq);
            d.stored("c", now);
        }
        assert_eq!(d.begin_ack("c", now), None);
        let later = now + Duration::from_millis(5);
        d.ack_ok("c", 2, 2, later);
        assert_eq!(d.next_due(), Some(later));
        assert_eq!(d.begin_ack("c", later), Some(6));
        d.ack_ok("c", 6, 6, later);
        d.push("c", 7);
        d.stored("c", now);
        assert_eq!(d.begin_ack("c", now), Some(7));
        d.ack_failed("c", true, now);
        assert_eq!(d.next_due(), Some(now + ACK_RETRY_MIN));
        assert_eq!(d.begin_ack("c", now), Some(7));
    }

    #[test]
    fn cursor_max_bug_jumps_and_never_syncs() {
        let mut d = Delivery::new(AckPolicy::default(), true);
        d.push("c", 1);
        assert_eq!(
            d.push("c", 5),
            Pushed::New {
                gap: false,
                sync_after: None
            }
        );
        assert_eq!(d.cursor("c"), 5);
    }

    #[test]
    fn if_idle_hints_leave_a_coalescing_ack_alone() {
        let policy = AckPolicy {
            on_hint: HintAck::IfIdle,
            ..AckPolicy::default()
        };
        let mut d = Delivery::new(policy, false);
        let now = Instant::now();
        d.push("c", 1);
        assert!(!d.stored("c", now));
        assert_eq!(d.hint("c", 1), Hinted::AckComing);
        assert_eq!(d.begin_ack("c", now), Some(1));
        d.ack_ok("c", 1, 1, now);
        // A stale hint after the ack landed: nothing was lost, nothing to ack.
        assert_eq!(d.hint("c", 1), Hinted::Ack);
        assert_eq!(d.begin_ack("c", now), None);
    }

    /// A seeded pseudo-random number generator (xorshift64*), for the random walks.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        /// Uniform in `0..n` (`n > 0`).
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }

        fn chance(&mut self, percent: u64) -> bool {
            self.below(100) < percent
        }
    }

    /// The world one random walk runs in: a server's conversation (events `1..=head`, some
    /// not visible to this device) and the device's store, with what the server believes
    /// the device acked.
    struct Model {
        head: i64,
        invisible: BTreeSet<i64>,
        store: BTreeSet<i64>,
        /// The server's `delivered` (GREATEST of the acks).
        delivered: i64,
        /// The `after` of the next page of a sync the core asked for.
        syncing: Option<i64>,
        /// An automatic ack the core started and the server has not answered.
        acking: Option<i64>,
        now: Instant,
    }

    impl Model {
        fn visible(&self, seq: i64) -> bool {
            seq >= 1 && seq <= self.head && !self.invisible.contains(&seq)
        }

        /// D3 and the memory bound, after every step: every visible event at or below the
        /// cursor is stored, the cursor never passes the head, and the core remembers no
        /// more than the stored events above the cursor.
        fn check(&self, d: &Delivery, step: &str) {
            let cursor = d.cursor("c");
            assert!(
                cursor <= self.head,
                "{step}: cursor {cursor} above head {}",
                self.head
            );
            for seq in 1..=cursor {
                assert!(
                    !self.visible(seq) || self.store.contains(&seq),
                    "{step}: D3: cursor {cursor} covers visible seq {seq}, not stored"
                );
            }
            let above = self.store.iter().filter(|&&s| s > cursor).count();
            assert_eq!(
                d.held("c"),
                above,
                "{step}: memory of seqs above the cursor"
            );
        }

        /// The visible seqs a sync page after `after` holds (at most `limit`), and whether
        /// it is complete.
        fn page(&self, after: i64, limit: usize) -> (Vec<i64>, bool) {
            let all: Vec<i64> = (after + 1..=self.head)
                .filter(|&s| self.visible(s))
                .collect();
            let page: Vec<i64> = all.iter().copied().take(limit).collect();
            (page, all.len() <= limit)
        }
    }

    /// One step: the core told to store `new` events now (after a push or a page).
    fn stored_now(d: &mut Delivery, m: &mut Model) {
        if d.stored("c", m.now) {
            begin_ack(d, m);
        }
    }

    /// Starts an automatic ack if the core wants one. An ack names the cursor (D3: never
    /// above what is stored) and only when it is above what the server has or is about to
    /// have (no pointless cursor writes).
    fn begin_ack(d: &mut Delivery, m: &mut Model) {
        let floor = d.acked("c");
        let inflight = m.acking.is_some();
        match d.begin_ack("c", m.now) {
            Some(seq) => {
                assert!(!inflight, "a second automatic ack while one is on its way");
                assert_eq!(seq, d.cursor("c"), "an ack names the cursor");
                assert!(
                    seq > floor,
                    "ack of {seq} at or below what the server has ({floor})"
                );
                m.acking = Some(seq);
            }
            None => assert!(
                inflight || d.cursor("c") <= floor,
                "no ack although cursor {} is above acked {floor}",
                d.cursor("c")
            ),
        }
    }

    /// One step of a walk, drawn from `r`.
    fn step(d: &mut Delivery, m: &mut Model, r: &mut Rng) {
        m.now += Duration::from_millis(r.below(30));
        match r.below(9) {
            0 | 1 => {
                m.head += 1;
                if r.chance(15) {
                    m.invisible.insert(m.head);
                }
            }
            2 | 3 => push(d, m, r),
            4 | 5 => page(d, m, r, true),
            6 => hint(d, m),
            7 => answer_ack(d, m, r),
            _ => restart(d, m, r),
        }
    }

    fn push(d: &mut Delivery, m: &mut Model, r: &mut Rng) {
        if m.head == 0 {
            return;
        }
        // Mostly recent events, sometimes an old one again.
        let back = if r.chance(70) {
            r.below(3)
        } else {
            r.below(m.head as u64)
        } as i64;
        let seq = (m.head - back).max(1);
        if !m.visible(seq) {
            return;
        }
        let cursor = d.cursor("c");
        let syncing = m.syncing.is_some();
        match d.push("c", seq) {
            Pushed::Duplicate => assert!(
                m.store.contains(&seq),
                "push {seq}: called a duplicate, not stored (cursor {cursor})"
            ),
            Pushed::New { gap, sync_after } => {
                assert!(
                    !m.store.contains(&seq),
                    "push {seq}: stored already, called new"
                );
                assert_eq!(
                    gap,
                    seq != cursor + 1,
                    "push {seq} after cursor {cursor}: gap"
                );
                match sync_after {
                    Some(after) => {
                        assert!(gap && !syncing, "push {seq}: a sync without a gap");
                        assert_eq!(after, cursor, "a gap syncs from the cursor");
                        m.syncing = Some(after);
                    }
                    None => assert!(!gap || syncing, "push {seq}: a gap and no sync"),
                }
                m.store.insert(seq);
                stored_now(d, m);
            }
        }
    }

    /// The next page of the sync under way; a `hostile` server sometimes fails the request
    /// or sends a broken page.
    fn page(d: &mut Delivery, m: &mut Model, r: &mut Rng, hostile: bool) {
        let Some(after) = m.syncing else { return };
        if hostile && r.chance(10) {
            d.sync_failed("c");
            m.syncing = None;
            return;
        }
        let (mut seqs, complete) = m.page(after, 1 + r.below(4) as usize);
        let corrupt = hostile && r.chance(10) && !seqs.is_empty();
        if corrupt {
            // A broken server: a seq again, one at `after`, or one past the head.
            match r.below(3) {
                0 => seqs.push(*seqs.last().unwrap_or(&0)),
                1 => seqs.insert(0, after),
                _ => seqs.push(m.head + 1),
            }
        }
        let before = (d.cursor("c"), m.store.clone());
        let store = m.store.clone();
        let p = d.synced("c", &seqs, m.head, complete, |s| store.contains(&s));
        if corrupt {
            assert_eq!(
                p.next,
                NextPage::Disordered {
                    after,
                    head: m.head
                },
                "{seqs:?}"
            );
            assert!(
                p.new.is_empty() && d.cursor("c") == before.0,
                "stored nothing"
            );
            m.syncing = None;
            return;
        }
        let new: Vec<i64> = p.new.iter().map(|&i| seqs[i]).collect();
        let want: Vec<i64> = seqs
            .iter()
            .copied()
            .filter(|s| !before.1.contains(s))
            .collect();
        assert_eq!(new, want, "page {seqs:?}: the events not stored");
        assert_eq!(p.duplicates, seqs.len() - want.len());
        m.store.extend(new);
        m.syncing = match p.next {
            NextPage::Done => {
                assert!(complete);
                assert_eq!(d.cursor("c"), m.head, "a complete sync reaches the head");
                None
            }
            NextPage::After(last) => {
                assert!(!complete);
                assert_eq!(Some(&last), seqs.last());
                Some(last)
            }
            other => panic!("page {seqs:?} after {after}: {other:?}"),
        };
        if m.syncing.is_none() {
            if d.sync_ended("c", m.now) {
                begin_ack(d, m);
            }
        } else {
            stored_now(d, m);
        }
    }

    /// The sweep hints only a device whose delivered cursor is below the visible head.
    fn hint(d: &mut Delivery, m: &mut Model) {
        let head = (1..=m.head).rev().find(|&s| m.visible(s)).unwrap_or(0);
        if m.delivered >= head {
            return;
        }
        let cursor = d.cursor("c");
        let syncing = m.syncing.is_some();
        match d.hint("c", head) {
            Hinted::Ack => {
                assert!(
                    head <= cursor,
                    "hint {head}: an ack though cursor is {cursor}"
                );
                assert!(d.acked("c") < head, "the hint says the server lacks {head}");
                begin_ack(d, m);
            }
            Hinted::Sync(after) => {
                assert!(head > cursor && !syncing);
                assert_eq!(after, cursor, "a hint syncs from the cursor");
                m.syncing = Some(after);
            }
            Hinted::SyncRunning => assert!(head > cursor && syncing),
            Hinted::AckComing => panic!("HintAck::Again never leaves an ack coalescing"),
        }
    }

    fn answer_ack(d: &mut Delivery, m: &mut Model, r: &mut Rng) {
        let Some(seq) = m.acking.take() else {
            if d.due(m.now).contains(&"c".to_string()) || r.chance(30) {
                begin_ack(d, m);
            }
            return;
        };
        if r.chance(20) {
            d.ack_failed("c", r.chance(50), m.now);
            return;
        }
        m.delivered = m.delivered.max(seq);
        let before = d.acked("c");
        d.ack_ok("c", seq, m.delivered, m.now);
        assert_eq!(
            d.acked("c"),
            before.max(m.delivered).max(seq),
            "acked after ack_ok"
        );
    }

    /// The device restarts: a new core restored from the store, then `sub` reports what
    /// the server has.
    fn restart(d: &mut Delivery, m: &mut Model, r: &mut Rng) {
        if !r.chance(30) {
            return;
        }
        let cursor = d.cursor("c");
        let mut fresh = core();
        // The state file's `delivered` may lag what the server has (an ack answered after
        // the last write), or be missing.
        let persisted = (!r.chance(30)).then(|| (m.delivered - r.below(3) as i64).max(0));
        fresh.restore("c", cursor, m.store.iter().copied(), persisted);
        assert_eq!(fresh.cursor("c"), cursor);
        fresh.subscribed("c", m.delivered);
        assert_eq!(
            fresh.acked("c"),
            m.delivered,
            "sub reports what the server has"
        );
        m.syncing = None;
        m.acking = None;
        *d = fresh;
        // After `sub` the client syncs from its cursor, as the pump does.
        m.syncing = Some(d.sync_begin("c", cursor));
    }

    /// Random walks over the core against a model of the server and the store: after every
    /// step D3 holds (the cursor covers only stored events, an ack names the cursor and
    /// never what the server has already), duplicates are recognised, a gap or a hint above
    /// the cursor asks for one sync from the cursor, a broken page is refused whole, acks
    /// follow what the server answered, and the core's memory is the events stored above
    /// the cursor. Each walk ends with a sync to completion and an ack: the device then
    /// holds every visible event and the server knows it (D5's end state).
    #[test]
    fn random_walks_keep_d3_and_converge() {
        for seed in 1..=400u64 {
            let mut r = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let mut d = core();
            let mut m = Model {
                head: 0,
                invisible: BTreeSet::new(),
                store: BTreeSet::new(),
                delivered: 0,
                syncing: None,
                acking: None,
                now: Instant::now(),
            };
            for i in 0..200 {
                step(&mut d, &mut m, &mut r);
                m.check(&d, &format!("seed {seed} step {i}"));
            }
            // Heal: answer any ack, sync to completion, ack.
            if let Some(seq) = m.acking.take() {
                m.delivered = m.delivered.max(seq);
                d.ack_ok("c", seq, m.delivered, m.now);
            }
            let after = match m.syncing {
                Some(a) => a,
                None => d.sync_begin("c", d.cursor("c")),
            };
            m.syncing = Some(after);
            while m.syncing.is_some() {
                let before = m.syncing;
                page(&mut d, &mut m, &mut r, false);
                assert_ne!(m.syncing, before, "seed {seed}: the sync makes progress");
            }
            m.check(&d, &format!("seed {seed} healed"));
            assert_eq!(d.cursor("c"), m.head, "seed {seed}: cursor at the head");
            if let Some(seq) = m.acking.take() {
                m.delivered = m.delivered.max(seq);
                d.ack_ok("c", seq, m.delivered, m.now);
            }
            if d.cursor("c") > d.acked("c") {
                assert_eq!(d.begin_ack("c", m.now), Some(m.head), "seed {seed}");
            }
        }
    }
}
