//! The send path's observer: where the deliberate bugs that act inside a send become
//! behaviour, one match per step of the send transaction. Owns [`Observer`], set once in
//! `State` from the active bug, and the [`SendWatch`] it gives each send, which
//! `store::send` sees only as a `store::SendObserver` and `batch` only as "no group commit".
//!
//! Must not: act on any other bug (those stay at their own call sites, `bugs::active`), or
//! give a watch to anything in production: without the `bugs` feature [`Observer::watch`]
//! returns a constant `None`, so every send is SPEC 3's transaction, through group commit.
//! Knows nothing of `State` or connections beyond a reply's outbox and the hub.

use crate::bugs::{self, Bug};
use crate::hub::{Hub, Outbox};
use crate::protocol::{self, Event};
use crate::store::{self, SendObserver, Sent};
use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The send path's observer, set once in `State`.
pub struct Observer {
    /// The active bug if it acts inside a send (see [`acts_in_send`]); `None` in production.
    bug: Option<Bug>,
    /// Where `push-before-commit` finds the open members' subscribed connections.
    hub: Arc<Hub>,
}

/// Whether `bug` acts inside the send transaction (and so through [`SendWatch`]).
fn acts_in_send(bug: Bug) -> bool {
    matches!(
        bug,
        Bug::ReplyBeforeCommit
            | Bug::PushBeforeCommit
            | Bug::CommitAfterReply
            | Bug::SeqGap
            | Bug::NoDedup
    )
}

impl Observer {
    /// The observer of the active bug (`bugs::current`, installed before `serve`).
    pub fn new(hub: Arc<Hub>) -> Observer {
        Observer {
            bug: bugs::current().filter(|b| acts_in_send(*b)),
            hub,
        }
    }

    /// The watch for one send whose reply goes to `outbox` under `rid`: `None` (always
    /// without the `bugs` feature) for SPEC 3's transaction. A send with a watch bypasses
    /// group commit: the bugs it carries are written against the single send transaction.
    pub fn watch(&self, outbox: &Arc<Outbox>, rid: Option<&str>) -> Option<Arc<SendWatch>> {
        if !bugs::ENABLED {
            return None;
        }
        let bug = self.bug?;
        Some(Arc::new(SendWatch {
            bug,
            outbox: outbox.clone(),
            rid: rid.map(str::to_string),
            hub: self.hub.clone(),
            replied: AtomicBool::new(false),
        }))
    }
}

/// One send under a bug that acts inside it (the controls build only).
pub struct SendWatch {
    /// One of the bugs of [`acts_in_send`].
    bug: Bug,
    /// The sending connection's queue and the request's `rid`, for `reply-before-commit`.
    outbox: Arc<Outbox>,
    rid: Option<String>,
    /// For `push-before-commit`.
    hub: Arc<Hub>,
    /// `reply-before-commit` queued the reply: the caller must not send another.
    replied: AtomicBool,
}

impl SendWatch {
    /// Whether the reply already left before COMMIT (`reply-before-commit`): nothing more is
    /// said to the client about this send.
    pub fn replied(&self) -> bool {
        self.replied.load(Ordering::Acquire)
    }
}

impl SendObserver for SendWatch {
    fn seq_before_begin(&self) -> bool {
        // P1 broken: a rollback no longer gives the seq back.
        self.bug == Bug::SeqGap
    }

    fn insert_sql(&self) -> Cow<'static, str> {
        match self.bug {
            // D2 broken: with the constraint dropped by `serve`, a resend is a new row.
            Bug::NoDedup => bugs::rewrite(store::SEND_INSERT_SQL, store::NO_DEDUP_EDITS).into(),
            _ => Cow::Borrowed(store::SEND_INSERT_SQL),
        }
    }

    fn watches_uncommitted(&self) -> bool {
        matches!(self.bug, Bug::ReplyBeforeCommit | Bug::PushBeforeCommit)
    }

    fn uncommitted(&self, sent: &Sent, ev: &Event, audience: &[String]) {
        match self.bug {
            // D1 broken: the client holds a `sent` for a transaction that may roll back.
            Bug::ReplyBeforeCommit => {
                self.replied.store(true, Ordering::Release);
                self.outbox
                    .reply_unbudgeted(self.rid.as_deref(), &sent.reply(&ev.conv));
            }
            // D1 broken for pushes: a device sees an event that may never commit.
            Bug::PushBeforeCommit => {
                let frame = protocol::event_frame(ev);
                for c in self.hub.conns_of(audience) {
                    c.push(ev, &frame);
                }
            }
            _ => {}
        }
    }

    fn commit_after_reply(&self) -> bool {
        // D1 broken: the reply can leave before (or without) the commit.
        self.bug == Bug::CommitAfterReply
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::Out;

    fn watch(bug: Bug) -> (SendWatch, tokio::sync::mpsc::Receiver<Out>) {
        let (outbox, rx) = Outbox::new(1, 8, 1 << 16);
        let w = SendWatch {
            bug,
            outbox,
            rid: Some("r1".to_string()),
            hub: Arc::new(Hub::default()),
            replied: AtomicBool::new(false),
        };
        (w, rx)
    }

    fn sent_and_event() -> (Sent, Event) {
        let sent = Sent {
            seq: 3,
            mid: "m3".into(),
            dup: false,
            epoch: 1,
        };
        let ev = Event {
            conv: "c1".into(),
            seq: 3,
            kind: "msg".into(),
            mid: "m3".into(),
            sender: "alice".into(),
            cmid: "x".into(),
            body: "hi".into(),
            at_ms: 0,
            epoch: 1,
        };
        (sent, ev)
    }

    /// Production has no watch: without the `bugs` feature no bug can be current, so every
    /// send is SPEC 3's transaction through group commit.
    #[cfg(not(feature = "bugs"))]
    #[test]
    fn production_watches_no_send() {
        let (outbox, _rx) = Outbox::new(1, 8, 1 << 16);
        let o = Observer::new(Arc::new(Hub::default()));
        assert!(o.bug.is_none());
        assert!(o.watch(&outbox, Some("r1")).is_none());
        let spec = store::Unobserved;
        assert!(!spec.seq_before_begin() && !spec.watches_uncommitted());
        assert!(!spec.commit_after_reply());
        assert_eq!(spec.insert_sql(), store::SEND_INSERT_SQL);
    }

    /// Exactly the five send-path bugs act through a watch; every other bug stays at its own
    /// call site.
    #[test]
    fn only_the_send_path_bugs_act_in_a_send() {
        let acting: Vec<&str> = Bug::ALL
            .iter()
            .filter(|b| acts_in_send(**b))
            .map(|b| b.name())
            .collect();
        assert_eq!(
            acting,
            [
                "reply-before-commit",
                "commit-after-reply",
                "push-before-commit",
                "no-dedup",
                "seq-gap"
            ]
        );
    }

    /// Each send-path bug bends exactly its own step of the transaction, and no other.
    #[test]
    fn each_bug_bends_its_own_step() {
        for bug in Bug::ALL.iter().copied().filter(|b| acts_in_send(*b)) {
            let (w, _rx) = watch(bug);
            assert_eq!(w.seq_before_begin(), bug == Bug::SeqGap, "{bug}");
            assert_eq!(
                w.insert_sql().contains("ON CONFLICT"),
                bug != Bug::NoDedup,
                "{bug}"
            );
            assert_eq!(
                w.watches_uncommitted(),
                matches!(bug, Bug::ReplyBeforeCommit | Bug::PushBeforeCommit),
                "{bug}"
            );
            assert_eq!(
                w.commit_after_reply(),
                bug == Bug::CommitAfterReply,
                "{bug}"
            );
        }
    }

    /// `reply-before-commit` queues the `sent` reply to the request's rid before COMMIT and
    /// says so; `push-before-commit` replies nothing.
    #[test]
    fn reply_before_commit_replies_once_from_the_watch() {
        let (sent, ev) = sent_and_event();
        let (w, mut rx) = watch(Bug::ReplyBeforeCommit);
        w.uncommitted(&sent, &ev, &["alice".to_string()]);
        assert!(w.replied());
        match rx.try_recv() {
            Ok(Out::Frame(q)) => {
                assert_eq!(q.rid.as_deref(), Some("r1"));
                assert!(q.text.contains("\"seq\":3"), "{}", q.text);
            }
            other => panic!("expected the sent reply, got {other:?}"),
        }
        let (w, mut rx) = watch(Bug::PushBeforeCommit);
        w.uncommitted(&sent, &ev, &["alice".to_string()]);
        assert!(!w.replied());
        assert!(rx.try_recv().is_err());
    }
}
