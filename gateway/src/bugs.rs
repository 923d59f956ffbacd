//! Deliberate bugs: the negative controls a test suite runs to prove it catches a broken
//! invariant. Owns the list of bugs (the [`Bug`] enum, each bug named once, below) and the
//! `IM_BUG` parser; the call sites in `store`, `batch`, `conn`, `fanout`, `sweep` and `main`
//! decide where each one acts, by variant, except the bugs that act inside a send: those
//! are one match in `observer`, the send path's observer.
//!
//! Must not be compiled into anything but the controls build (`--features faults,bugs`, a
//! debug build): without the `bugs` feature [`active`] is a constant `false`, so every bug
//! branch compiles away, and [`install`] refuses a non-empty `IM_BUG`. A release build with
//! the feature does not compile at all. Imports nothing from the crate.

use std::fmt;
use std::str::FromStr;

/// Declares [`Bug`] with each bug's kebab-case name (what `IM_BUG` takes) and one-line
/// description (what `im-gateway bugs` prints), so a bug is listed once and [`Bug::ALL`]
/// cannot miss one.
macro_rules! bugs {
    ($(
        $(#[$doc:meta])*
        $variant:ident = $name:literal, $what:literal;
    )+) => {
        /// A deliberate bug; its doc says what it does and which invariant it breaks.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Bug {
            $($(#[$doc])* $variant,)+
        }

        impl Bug {
            /// Every bug, in the order `im-gateway bugs` lists them.
            pub const ALL: &'static [Bug] = &[$(Bug::$variant),+];

            /// The name `IM_BUG` takes and `im-gateway bugs` prints (kebab-case).
            pub const fn name(self) -> &'static str {
                match self {
                    $(Bug::$variant => $name,)+
                }
            }

            /// One line: the invariant it breaks, then how (`im-gateway bugs` prints it).
            pub const fn describe(self) -> &'static str {
                match self {
                    $(Bug::$variant => $what,)+
                }
            }
        }
    };
}

bugs! {
    /// `sent` is queued to the client right after the INSERT, before the `send.before_commit`
    /// point and COMMIT; the normal reply is not sent again. Breaks D1: a client holds a `sent`
    /// for a transaction that may still roll back (or die with the process).
    ReplyBeforeCommit = "reply-before-commit",
        "D1: `sent` is queued after the INSERT, before send.before_commit and COMMIT";
    /// The `send.before_commit` point and COMMIT run in a spawned task; the send returns without
    /// waiting for them. Breaks D1: the reply can leave before (or without) the commit.
    CommitAfterReply = "commit-after-reply",
        "D1: send.before_commit and COMMIT run in a spawned task after the reply";
    /// After the INSERT, before the `send.before_commit` point and COMMIT, the event is pushed to
    /// the open members' subscribed connections (read in the same transaction). Breaks D1 for
    /// pushes: a device can see an event that never commits.
    PushBeforeCommit = "push-before-commit",
        "D1: the event is pushed to open members before send.before_commit and COMMIT";
    /// `serve` drops the `(sender_user, cmid)` unique constraint and the send INSERT has no
    /// `ON CONFLICT`. Breaks D2: a resend inserts a second row (new seq, `dup:false`).
    NoDedup = "no-dedup",
        "D2: no (sender_user, cmid) constraint; a resend gets a new seq and dup:false";
    /// The ack upsert overwrites `delivered_seq` instead of taking GREATEST. Breaks D4: an ack
    /// of a lower seq lowers the cursor.
    CursorOverwrite = "cursor-overwrite",
        "D4: ack sets delivered_seq to the acked seq (no GREATEST); cursors can go down";
    /// The sweep never runs, so it never hints. Breaks D5: a lost push is never repaired.
    NoSweep = "no-sweep",
        "D5: the sweep never runs, so nothing is hinted";
    /// The seq is taken by `UPDATE conversations … RETURNING` autocommitted on the pool before
    /// the transaction begins. Breaks P1: a rollback (or a duplicate) leaves a gap.
    SeqGap = "seq-gap",
        "P1: the seq is taken in its own autocommitted statement; rollbacks leave gaps";
    /// Fan-out's audience is every user who ever had a membership period in the conversation.
    /// Breaks S1: users who left still get pushes.
    S1Leak = "s1-leak",
        "S1: fan-out pushes to every user who ever was a member, left or not";
    /// Pool connections run with `synchronous_commit = off`. Breaks D6: a replied send can be
    /// lost with its WAL not yet flushed (a power cut), or not yet even written out of
    /// PostgreSQL's shared WAL buffers (an immediate shutdown, a failover).
    AsyncCommit = "async-commit",
        "D6: synchronous_commit=off (loses replied sends on power loss, immediate shutdown, failover)";
    /// Serving a sync page with events moves the device's cursor to the page's last seq.
    /// Breaks D3: the cursor moves without a device ack.
    CursorOnSync = "cursor-on-sync",
        "D3: serving a sync page moves the device cursor to the page's last seq";
    /// The sweep runs every 3 × `IM_SWEEP_MS`. Breaks D5's bound: a lost push is found only
    /// after up to three intervals.
    SlowSweep = "slow-sweep",
        "D5 bound: the sweep runs every 3 x IM_SWEEP_MS";
    /// The commit feed hands nothing to fan-out. Breaks D5: a commit whose NOTIFY failed or was
    /// never sent (or whose gateway died before it) is found only by a full pass, 60 intervals
    /// later, on every gateway.
    NoFeed = "no-feed",
        "D5: the commit feed hands nothing on (un-notified commits wait for a full pass)";
    /// A lost LISTEN connection, once regained, starts no full pass. Breaks D5: what committed
    /// while the gateway was not listening waits for the routine full pass.
    NoRegainPass = "no-regain-pass",
        "D5: a regained LISTEN connection starts no full pass";
    /// A fan-out read that failed records nothing for the sweep. Breaks D5: its events wait for
    /// the next notification of their conversation or a full pass.
    ReadFailUnrecorded = "read-fail-unrecorded",
        "D5: a failed fan-out read records nothing for the sweep";
    /// A connection never forgets that its user was a member of a conversation. Breaks the lock
    /// guarantee of `send`: a user who left queues on the conversation's row lock with every send.
    StickyMember = "sticky-member",
        "send: a connection never forgets a membership (a user who left takes the lock)";
    /// Pushes queued for an install before it became stale are still written. Breaks the
    /// reinstall's promise: a cut-off install gets what was on its way.
    StaleBacklog = "stale-backlog",
        "reinstall: pushes queued before an install became stale are still written";
    /// An overflowed connection's queue drains without the overflow hints. Breaks the overflow
    /// repair: the device learns of what it missed only from the sweep.
    NoOverflowHint = "no-overflow-hint",
        "overflow: the drained queue sends no overflow hints";
    /// A closing connection lets its socket go as soon as its writer is done, without reading
    /// what the peer still sends. Breaks the close's promise: with input unread the kernel resets
    /// the connection and throws away what was written but not yet taken, the last replies
    /// and the close frame.
    NoCloseDrain = "no-close-drain",
        "close: the socket is let go unread (a reset loses the last replies and the close)";
    /// A connection remembers no conversation its user sent to. Breaks the members' fast path
    /// of `send`: every send reads the membership before its transaction.
    ForgetfulMember = "forgetful-member",
        "send: a connection remembers no membership (every send reads it first)";
    /// Group commit: a batch whose COMMIT did not happen (the `send.batch.before_commit` point
    /// failed it, or COMMIT failed) still answers its rows with the seqs and mids of the
    /// rolled-back inserts. Breaks D1: a `sent` for a message that was never stored.
    BatchReplyRolledBack = "batch-reply-rolled-back",
        "D1: a batch that did not commit still answers its rows with their rolled-back seqs";
    /// Group commit: a batch that failed answers every row with its error instead of sending
    /// each again on its own. Breaks the batch's promise: a send fails for another row's fault
    /// (or for the batch's), though alone it would have been stored.
    BatchFailsInnocents = "batch-fails-innocents",
        "group commit: a failed batch fails every row instead of sending each again alone";
    /// The notifier hands its commits to no local delivery (issue 19's local hand-off is gone):
    /// this gateway's own devices wait for the NOTIFY round trip, and while its LISTEN
    /// connection is lost they get nothing until a pass. Breaks the hand-off's promise.
    NoLocalHandoff = "no-local-handoff",
        "fan-out: the notifier hands nothing to its own gateway's devices (NOTIFY only)";
    /// New connections do not check the database's lineage (issue 21): after a failover to a
    /// standby that lost history, no conversation's epoch moves and no connection is closed.
    /// Breaks the epoch's promise: devices keep, silently, messages the database no longer
    /// has, and get another message at the same seq.
    NoEpoch = "no-epoch",
        "epochs: a new lineage (a promoted standby) moves no epoch; devices stay silently wrong";
    /// New connections check the database's lineage before they set their session's
    /// `synchronous_commit`, so the check sees the server's default (`on`) and never the
    /// incarnation (migration 0007). Breaks the epoch's promise under `synchronous_commit =
    /// off`: a crash that lost acknowledged commits moves no epoch, and devices keep what
    /// the database lost.
    NoIncarnation = "no-incarnation",
        "epochs: with synchronous_commit=off a crash that lost commits moves no epoch";
    /// A hello the database could not check (UNAVAILABLE: it is down or slow) is charged to
    /// the failed-hello throttle as if it had been refused. Breaks the throttle's promise
    /// (issue 42): an outage puts every device that says hello during it in debt, and honest
    /// devices are locked out for minutes after the database is back.
    OutageChargesHello = "outage-charges-hello",
        "hello throttle: a hello the database could not check is charged as a failed one";
    /// The ack statements (the batched one production runs, and the single one its fallback
    /// runs) write the cursor of an ack whose install was replaced; the ack is still answered
    /// STALE_INSTALL. Breaks D3 (only the device's own install's ack moves its cursor) and so
    /// D5 for the new install (issue 42): the cursor it inherits stands past messages it
    /// never got, so neither its `sub` nor the sweep ever brings them.
    ReplacedInstallAcks = "replaced-install-acks",
        "D3: an ack from a replaced install moves the device's cursor (answered STALE_INSTALL)";
    /// The sweep's visible head of a member who left is one past the last event of their
    /// period (`to_seq` instead of `to_seq - 1`). Breaks D5 for members who left (issue 42):
    /// they are hinted at an event they may not see, can never ack it (CURSOR_AHEAD), and
    /// are hinted about it for ever.
    HintPastLeave = "hint-past-leave",
        "D5: the sweep hints a member who left at one past the last event they may see";
    /// After one failed look, the commit feed stops for the rest of its LISTEN session (it
    /// forgets its mark instead of asking again from it). Breaks D5 (issue 42): a commit whose
    /// notification is lost after that is found only by the routine full pass, 60 sweep
    /// intervals later.
    FeedGivesUp = "feed-gives-up",
        "D5: after one failed look the commit feed stops until LISTEN is regained";
    /// The sweep's stale-install look-up compares epochs with `<>`, so a device that no longer
    /// exists (NULL) is never found stale. Breaks the install rule (issue 42, S1's guard): a
    /// removed device whose removal notification was lost keeps its open connections.
    GoneDeviceStays = "gone-device-stays",
        "installs: the sweep never finds a removed device stale; its connections stay open";
    /// A push or hint is offered to the byte budget at no cost, so only the frame count
    /// (`IM_QUEUE_FRAMES_MAX`) bounds what a slow reader's queue holds. Breaks the byte bound
    /// (issue 42): 256 large pushes can queue where `IM_QUEUE_BYTES_MAX` allows a few.
    PushesUncharged = "pushes-uncharged",
        "bounds: pushes are not charged to the byte budget; only the frame count bounds them";
    /// The commit feed takes every transaction id below its mark's `xmax` as seen, so a
    /// transaction in flight when the feed looked is never reported once it commits. Breaks
    /// D5 (issue 42): such a commit whose notification is lost is found only by the routine
    /// full pass, 60 sweep intervals later.
    FeedWindow = "feed-window",
        "D5: the commit feed skips a commit that was in flight when it looked";
}

impl fmt::Display for Bug {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

/// A name that is no bug's: the error names the bad value and lists every valid name.
impl FromStr for Bug {
    type Err = String;

    fn from_str(name: &str) -> Result<Bug, String> {
        Bug::ALL
            .iter()
            .copied()
            .find(|b| b.name() == name)
            .ok_or_else(|| {
                format!(
                    "IM_BUG: unknown bug {name:?}\n  valid bugs: {}\n  \
                     (`im-gateway bugs` describes them)",
                    valid_names()
                )
            })
    }
}

#[cfg(all(feature = "bugs", not(debug_assertions)))]
compile_error!("the `bugs` feature must never be in a release build");

/// Whether this binary has the deliberate bugs compiled in.
pub const ENABLED: bool = cfg!(feature = "bugs");

fn valid_names() -> String {
    Bug::ALL
        .iter()
        .map(|b| b.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Parses an `IM_BUG` value without arming anything: `None` when empty, else the one bug
/// it names. The error names the bad value and lists every valid name.
pub fn parse(spec: &str) -> Result<Option<Bug>, String> {
    let spec = spec.trim();
    if spec.is_empty() {
        return Ok(None);
    }
    if spec.contains(',') {
        return Err(format!(
            "IM_BUG={spec:?}: only one bug at a time\n  valid bugs: {}",
            valid_names()
        ));
    }
    spec.parse().map(Some)
}

/// Validates `IM_BUG` and activates the bug it names (at most one, once per process).
/// Refuses a non-empty value when the binary was built without the `bugs` feature.
pub fn install(spec: &str) -> Result<Option<Bug>, String> {
    if !spec.trim().is_empty() && !ENABLED {
        return Err(
            "IM_BUG is set but this im-gateway was built without the `bugs` feature \
             (the controls build is `--features faults,bugs`)"
                .to_string(),
        );
    }
    let bug = parse(spec)?;
    #[cfg(feature = "bugs")]
    if let Some(bug) = bug {
        imp::activate(bug)?;
    }
    Ok(bug)
}

/// Whether `bug` is the active bug. Without the `bugs` feature: always `false`, a constant.
#[cfg(not(feature = "bugs"))]
#[inline(always)]
pub const fn active(_bug: Bug) -> bool {
    false
}

/// Whether `bug` is the active bug: one load and a compare.
#[cfg(feature = "bugs")]
#[inline]
pub fn active(bug: Bug) -> bool {
    imp::ACTIVE.get() == Some(&bug)
}

/// The active bug, if any. Without the `bugs` feature: always `None`, a constant.
#[cfg(not(feature = "bugs"))]
#[inline(always)]
pub const fn current() -> Option<Bug> {
    None
}

/// The active bug, if any.
#[cfg(feature = "bugs")]
#[inline]
pub fn current() -> Option<Bug> {
    imp::ACTIVE.get().copied()
}

/// Rewrites a statement for a bug: every `(from, to)` replaces a fragment that must occur
/// exactly once in `sql` (so a bug can never silently stop applying after an edit).
pub fn rewrite(sql: &str, edits: &[(&str, &str)]) -> String {
    let mut out = sql.to_string();
    for (from, to) in edits {
        assert_eq!(
            out.matches(from).count(),
            1,
            "bug rewrite: {from:?} must occur exactly once in {sql:?}"
        );
        out = out.replacen(from, to, 1);
    }
    out
}

#[cfg(feature = "bugs")]
mod imp {
    use super::Bug;
    use std::sync::OnceLock;

    pub(super) static ACTIVE: OnceLock<Bug> = OnceLock::new();

    pub(super) fn activate(bug: Bug) -> Result<(), String> {
        let now = *ACTIVE.get_or_init(|| bug);
        if now != bug {
            return Err(format!(
                "IM_BUG: bug {now} is already active; only one bug at a time"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_parse() {
        for (i, b) in Bug::ALL.iter().enumerate() {
            let (n, d) = (b.name(), b.describe());
            assert!(!d.is_empty() && !d.contains('\n'), "{n}");
            assert!(
                Bug::ALL[..i].iter().all(|m| m.name() != n),
                "{n} listed twice"
            );
            assert_eq!(parse(n).unwrap(), Some(*b));
            assert_eq!(parse(&format!("  {n}\n")).unwrap(), Some(*b));
            assert_eq!(n.parse::<Bug>(), Ok(*b));
            assert_eq!(b.to_string(), n);
        }
        assert_eq!(parse("no-dedup").unwrap(), Some(Bug::NoDedup));
    }

    /// The names stay what `IM_BUG`, `im-gateway bugs` and the evidence of `make controls`
    /// have always called them (a renamed variant must not rename its bug).
    #[test]
    fn names_are_kebab_case_and_stable() {
        for b in Bug::ALL {
            let n = b.name();
            assert!(
                n.bytes()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-'),
                "{n}"
            );
        }
        assert_eq!(Bug::ALL.len(), 31);
        assert_eq!(Bug::ALL[0].name(), "reply-before-commit");
        assert_eq!(Bug::S1Leak.name(), "s1-leak");
        assert_eq!(Bug::NoLocalHandoff.name(), "no-local-handoff");
        assert_eq!(Bug::NoEpoch.name(), "no-epoch");
        assert_eq!(Bug::NoIncarnation.name(), "no-incarnation");
        assert_eq!(Bug::ReplacedInstallAcks.name(), "replaced-install-acks");
        assert_eq!(Bug::HintPastLeave.name(), "hint-past-leave");
        assert_eq!(Bug::FeedGivesUp.name(), "feed-gives-up");
        assert_eq!(Bug::GoneDeviceStays.name(), "gone-device-stays");
        assert_eq!(Bug::PushesUncharged.name(), "pushes-uncharged");
        assert_eq!(Bug::FeedWindow.name(), "feed-window");
    }

    #[test]
    fn empty_is_none() {
        assert_eq!(parse("").unwrap(), None);
        assert_eq!(parse("  \n").unwrap(), None);
        // Nothing is activated by an empty value, in either build.
        assert_eq!(install("").unwrap(), None);
        assert_eq!(install(" ").unwrap(), None);
    }

    #[test]
    fn unknown_name_lists_the_valid_ones() {
        let e = parse("no-dedupe").unwrap_err();
        assert!(e.contains("\"no-dedupe\""), "{e}");
        for b in Bug::ALL {
            assert!(e.contains(b.name()), "{b} missing from: {e}");
        }
        assert_eq!("no-dedupe".parse::<Bug>().unwrap_err(), e);
        let e = parse("no-dedup,no-sweep").unwrap_err();
        assert!(e.contains("one bug at a time"), "{e}");
    }

    /// A build without the `bugs` feature has no bug code and refuses to pretend it has.
    #[cfg(not(feature = "bugs"))]
    #[test]
    fn build_without_bugs_refuses_a_name() {
        let e = install("no-dedup").unwrap_err();
        assert!(e.contains("without the `bugs` feature"), "{e}");
        let e = install("nope").unwrap_err();
        assert!(e.contains("without the `bugs` feature"), "{e}");
        const { assert!(!ENABLED) };
        const { assert!(!active(Bug::NoDedup)) };
        assert!(Bug::ALL.iter().all(|b| !active(*b)));
        assert_eq!(current(), None);
    }

    /// With the feature an unknown name is still refused before anything is activated.
    #[cfg(feature = "bugs")]
    #[test]
    fn build_with_bugs_refuses_an_unknown_name() {
        const { assert!(ENABLED) };
        let e = install("nope").unwrap_err();
        assert!(e.contains("unknown bug") && e.contains("seq-gap"), "{e}");
        assert!(Bug::ALL.iter().all(|b| !active(*b)));
        assert_eq!(current(), None);
    }

    #[test]
    fn rewrite_replaces_one_fragment() {
        assert_eq!(rewrite("a b c", &[("b", "x"), ("c", "")]), "a x ");
    }

    #[test]
    #[should_panic(expected = "exactly once")]
    fn rewrite_refuses_a_missing_fragment() {
        rewrite("a b c", &[("d", "x")]);
    }
}
