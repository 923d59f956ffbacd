//! The database's lineage (issue 21, item 3; migrations 0006 and 0007): the server's system
//! identifier and WAL timeline, and, while the gateway's sessions commit without waiting
//! for the flush (`synchronous_commit = off` or `fsync = off`), the postmaster's start time
//! (the incarnation). A promoted standby starts a new timeline, a cluster rebuilt elsewhere
//! has another identifier, and a restart of a server that acknowledged unflushed commits
//! may have lost some: each may have lost history devices already hold.
//!
//! Every new pool connection calls `im_check_lineage()` before it serves anything
//! ([`crate::store::connect`]): the first connection on a new lineage moves every
//! conversation's sequence epoch in the transaction that records the lineage (several
//! gateways race: the row lock makes one of them do it), so no reply or push is ever read
//! from a new lineage under the old epoch. This module remembers the lineage this gateway
//! has served from; when a connection finds another one, it counts a move ([`Lineage::moved`]),
//! and the task `crate::server` starts on it closes every connection of the gateway (1012,
//! service restart): each device reconnects, and its `subbed` names the new epochs, so an
//! idle device learns of the change too.
//!
//! Owns: the lineage this process has seen, and the count of its moves. Must not: move
//! epochs itself (the database function does, once per lineage), or reach the gateway's
//! shared state or connections (`crate::server` wires the move to them): this module sits
//! below `state` and `store`, and imports neither.

use std::sync::Mutex;
use tokio::sync::watch;

/// A server's lineage, as `im_check_lineage()` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Id {
    pub system_identifier: String,
    pub timeline: i32,
    /// The postmaster's start time while commits are acknowledged before they are
    /// flushed; `None` while they are durable (a restart then loses nothing acknowledged).
    pub incarnation: Option<String>,
}

impl Id {
    /// Whether going from `self` to `next` may have lost history: the rule of
    /// `im_check_lineage()` (migration 0007). Another identifier or timeline; or two known
    /// incarnations that differ. An incarnation appearing or vanishing (durability turned
    /// off or on) is no move.
    pub fn moved_to(&self, next: &Id) -> bool {
        self.system_identifier != next.system_identifier
            || self.timeline != next.timeline
            || matches!((&self.incarnation, &next.incarnation), (Some(a), Some(b)) if a != b)
    }
}

/// The lineage this gateway has served from, and a count of the times it moved.
#[derive(Debug)]
pub struct Lineage {
    seen: Mutex<Option<Id>>,
    moves: watch::Sender<u64>,
}

impl Default for Lineage {
    fn default() -> Self {
        Lineage {
            seen: Mutex::new(None),
            moves: watch::channel(0).0,
        }
    }
}

impl Lineage {
    /// A connection found the database on lineage `id` (`moved`: its own call moved the
    /// epochs). Returns whether that is a change for this gateway.
    pub fn observe(&self, id: Id, moved: bool) -> bool {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let changed = seen.as_ref().is_some_and(|s| s.moved_to(&id));
        if changed || moved {
            tracing::warn!(
                system_identifier = %id.system_identifier,
                timeline = id.timeline,
                incarnation = ?id.incarnation,
                before = ?*seen,
                epochs_moved_here = moved,
                "the database's lineage changed (a promoted standby, another cluster, or a \
                 restart after commits acknowledged unflushed): every conversation's epoch \
                 moved; closing every connection so devices reconcile"
            );
        }
        *seen = Some(id);
        drop(seen);
        if changed || moved {
            self.moves.send_modify(|n| *n += 1);
        }
        changed || moved
    }

    /// How many times the lineage moved under this gateway.
    pub fn moves(&self) -> u64 {
        *self.moves.borrow()
    }

    /// The count of moves, to wait on: it changes each time the lineage moves.
    pub fn moved(&self) -> watch::Receiver<u64> {
        self.moves.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first lineage seen is no change; another one is, once; a move made here is one
    /// even on the first connection (the gateway started on a lineage it then recorded).
    #[test]
    fn a_change_is_counted_once() {
        let l = Lineage::default();
        assert!(!l.observe(id("a", 1, None), false));
        assert!(!l.observe(id("a", 1, None), false));
        assert_eq!(l.moves(), 0);
        assert!(l.observe(id("a", 2, None), false));
        assert!(!l.observe(id("a", 2, None), false));
        assert_eq!(l.moves(), 1);
        let fresh = Lineage::default();
        assert!(fresh.observe(id("b", 1, None), true));
        assert_eq!(fresh.moves(), 1);
    }

    fn id(system: &str, timeline: i32, incarnation: Option<&str>) -> Id {
        Id {
            system_identifier: system.into(),
            timeline,
            incarnation: incarnation.map(str::to_string),
        }
    }

    /// Migration 0007's rule: a new incarnation is a move only when both are known (commits
    /// acknowledged unflushed before and after the restart); durability turned off or on
    /// is none.
    #[test]
    fn a_new_incarnation_moves_only_between_two_known_ones() {
        let l = Lineage::default();
        assert!(!l.observe(id("a", 1, None), false));
        assert!(
            !l.observe(id("a", 1, Some("t1")), false),
            "durability turned off"
        );
        assert!(!l.observe(id("a", 1, Some("t1")), false));
        assert!(
            l.observe(id("a", 1, Some("t2")), false),
            "a restart while off"
        );
        assert!(!l.observe(id("a", 1, None), false), "durability turned on");
        assert!(!l.observe(id("a", 1, Some("t3")), false), "and off again");
        assert_eq!(l.moves(), 1);
    }
}
