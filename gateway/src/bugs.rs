//! Deliberate bugs: the negative controls a test suite runs to prove it catches a broken
//! invariant. Owns the list of bugs (each named once, below) and the `IM_BUG` parser; the
//! call sites in `store`, `conn`, `sweep` and `main` decide where each one acts, by name.
//!
//! Must not be compiled into anything but the controls build (`--features faults,bugs`, a
//! debug build): without the `bugs` feature [`active`] is a constant `false`, so every bug
//! branch compiles away, and [`install`] refuses a non-empty `IM_BUG`. A release build with
//! the feature does not compile at all.

/// `sent` is queued to the client right after the INSERT, before the `send.before_commit`
/// point and COMMIT; the normal reply is not sent again. Breaks D1: a client holds a `sent`
/// for a transaction that may still roll back (or die with the process).
pub const REPLY_BEFORE_COMMIT: &str = "reply-before-commit";
/// The `send.before_commit` point and COMMIT run in a spawned task; the send returns without
/// waiting for them. Breaks D1: the reply can leave before (or without) the commit.
pub const COMMIT_AFTER_REPLY: &str = "commit-after-reply";
/// After the INSERT, before the `send.before_commit` point and COMMIT, the event is pushed to
/// the open members' subscribed connections (read in the same transaction). Breaks D1 for
/// pushes: a device can see an event that never commits.
pub const PUSH_BEFORE_COMMIT: &str = "push-before-commit";
/// `serve` drops the `(sender_user, cmid)` unique constraint and the send INSERT has no
/// `ON CONFLICT`. Breaks D2: a resend inserts a second row (new seq, `dup:false`).
pub const NO_DEDUP: &str = "no-dedup";
/// The ack upsert overwrites `delivered_seq` instead of taking GREATEST. Breaks D4: an ack
/// of a lower seq lowers the cursor.
pub const CURSOR_OVERWRITE: &str = "cursor-overwrite";
/// The sweep never runs, so it never hints. Breaks D5: a lost push is never repaired.
pub const NO_SWEEP: &str = "no-sweep";
/// The seq is taken by `UPDATE conversations … RETURNING` autocommitted on the pool before
/// the transaction begins. Breaks P1: a rollback (or a duplicate) leaves a gap.
pub const SEQ_GAP: &str = "seq-gap";
/// Fan-out's audience is every user who ever had a membership period in the conversation.
/// Breaks S1: users who left still get pushes.
pub const S1_LEAK: &str = "s1-leak";
/// Pool connections run with `synchronous_commit = off`. Breaks D6: a replied send can be
/// lost with its WAL not yet flushed (a power cut), or not yet even written out of
/// PostgreSQL's shared WAL buffers (an immediate shutdown, a failover).
pub const ASYNC_COMMIT: &str = "async-commit";
/// Serving a sync page with events moves the device's cursor to the page's last seq.
/// Breaks D3: the cursor moves without a device ack.
pub const CURSOR_ON_SYNC: &str = "cursor-on-sync";
/// The sweep runs every 3 × `IM_SWEEP_MS`. Breaks D5's bound: a lost push is found only
/// after up to three intervals.
pub const SLOW_SWEEP: &str = "slow-sweep";

/// The commit feed hands nothing to fan-out. Breaks D5: a commit whose NOTIFY failed or was
/// never sent (or whose gateway died before it) is found only by a full pass, 60 intervals
/// later, on every gateway.
pub const NO_FEED: &str = "no-feed";
/// A lost LISTEN connection, once regained, starts no full pass. Breaks D5: what committed
/// while the gateway was not listening waits for the routine full pass.
pub const NO_REGAIN_PASS: &str = "no-regain-pass";
/// A fan-out read that failed records nothing for the sweep. Breaks D5: its events wait for
/// the next notification of their conversation or a full pass.
pub const READ_FAIL_UNRECORDED: &str = "read-fail-unrecorded";
/// A connection never forgets that its user was a member of a conversation. Breaks the lock
/// guarantee of `send`: a user who left queues on the conversation's row lock with every send.
pub const STICKY_MEMBER: &str = "sticky-member";
/// Pushes queued for an install before it became stale are still written. Breaks the
/// reinstall's promise: a cut-off install gets what was on its way.
pub const STALE_BACKLOG: &str = "stale-backlog";
/// An overflowed connection's queue drains without the overflow hints. Breaks the overflow
/// repair: the device learns of what it missed only from the sweep.
pub const NO_OVERFLOW_HINT: &str = "no-overflow-hint";
/// A closing connection lets its socket go as soon as its writer is done, without reading
/// what the peer still sends. Breaks the close's promise: with input unread the kernel resets
/// the connection and throws away what was written but not yet taken, the last replies
/// and the close frame.
pub const NO_CLOSE_DRAIN: &str = "no-close-drain";
/// A connection remembers no conversation its user sent to. Breaks the members' fast path
/// of `send`: every send reads the membership before its transaction.
pub const FORGETFUL_MEMBER: &str = "forgetful-member";

/// Group commit: a batch whose COMMIT did not happen (the `send.batch.before_commit` point
/// failed it, or COMMIT failed) still answers its rows with the seqs and mids of the
/// rolled-back inserts. Breaks D1: a `sent` for a message that was never stored.
pub const BATCH_REPLY_ROLLED_BACK: &str = "batch-reply-rolled-back";
/// Group commit: a batch that failed answers every row with its error instead of sending
/// each again on its own. Breaks the batch's promise: a send fails for another row's fault
/// (or for the batch's), though alone it would have been stored.
pub const BATCH_FAILS_INNOCENTS: &str = "batch-fails-innocents";

/// The notifier hands its commits to no local delivery (issue 19's local hand-off is gone):
/// this gateway's own devices wait for the NOTIFY round trip, and while its LISTEN
/// connection is lost they get nothing until a pass. Breaks the hand-off's promise.
pub const NO_LOCAL_HANDOFF: &str = "no-local-handoff";

/// Every bug with a one-line description (`im-gateway bugs` prints this).
pub const ALL: &[(&str, &str)] = &[
    (
        REPLY_BEFORE_COMMIT,
        "D1: `sent` is queued after the INSERT, before send.before_commit and COMMIT",
    ),
    (
        COMMIT_AFTER_REPLY,
        "D1: send.before_commit and COMMIT run in a spawned task after the reply",
    ),
    (
        PUSH_BEFORE_COMMIT,
        "D1: the event is pushed to open members before send.before_commit and COMMIT",
    ),
    (
        NO_DEDUP,
        "D2: no (sender_user, cmid) constraint; a resend gets a new seq and dup:false",
    ),
    (
        CURSOR_OVERWRITE,
        "D4: ack sets delivered_seq to the acked seq (no GREATEST); cursors can go down",
    ),
    (NO_SWEEP, "D5: the sweep never runs, so nothing is hinted"),
    (
        SEQ_GAP,
        "P1: the seq is taken in its own autocommitted statement; rollbacks leave gaps",
    ),
    (
        S1_LEAK,
        "S1: fan-out pushes to every user who ever was a member, left or not",
    ),
    (
        ASYNC_COMMIT,
        "D6: synchronous_commit=off (loses replied sends on power loss, immediate shutdown, failover)",
    ),
    (
        CURSOR_ON_SYNC,
        "D3: serving a sync page moves the device cursor to the page's last seq",
    ),
    (SLOW_SWEEP, "D5 bound: the sweep runs every 3 x IM_SWEEP_MS"),
    (
        NO_FEED,
        "D5: the commit feed hands nothing on (un-notified commits wait for a full pass)",
    ),
    (
        NO_REGAIN_PASS,
        "D5: a regained LISTEN connection starts no full pass",
    ),
    (
        READ_FAIL_UNRECORDED,
        "D5: a failed fan-out read records nothing for the sweep",
    ),
    (
        STICKY_MEMBER,
        "send: a connection never forgets a membership (a user who left takes the lock)",
    ),
    (
        STALE_BACKLOG,
        "reinstall: pushes queued before an install became stale are still written",
    ),
    (
        NO_OVERFLOW_HINT,
        "overflow: the drained queue sends no overflow hints",
    ),
    (
        NO_CLOSE_DRAIN,
        "close: the socket is let go unread (a reset loses the last replies and the close)",
    ),
    (
        FORGETFUL_MEMBER,
        "send: a connection remembers no membership (every send reads it first)",
    ),
    (
        BATCH_REPLY_ROLLED_BACK,
        "D1: a batch that did not commit still answers its rows with their rolled-back seqs",
    ),
    (
        BATCH_FAILS_INNOCENTS,
        "group commit: a failed batch fails every row instead of sending each again alone",
    ),
    (
        NO_LOCAL_HANDOFF,
        "fan-out: the notifier hands nothing to its own gateway's devices (NOTIFY only)",
    ),
];

#[cfg(all(feature = "bugs", not(debug_assertions)))]
compile_error!("the `bugs` feature must never be in a release build");

/// Whether this binary has the deliberate bugs compiled in.
pub const ENABLED: bool = cfg!(feature = "bugs");

fn valid_names() -> String {
    ALL.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
}

/// Parses an `IM_BUG` value without arming anything: `None` when empty, else the one bug
/// it names. The error names the bad value and lists every valid name.
pub fn parse(spec: &str) -> Result<Option<&'static str>, String> {
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
    ALL.iter()
        .map(|(n, _)| *n)
        .find(|n| *n == spec)
        .map(Some)
        .ok_or_else(|| {
            format!(
                "IM_BUG: unknown bug {spec:?}\n  valid bugs: {}\n  \
                 (`im-gateway bugs` describes them)",
                valid_names()
            )
        })
}

/// Validates `IM_BUG` and activates the bug it names (at most one, once per process).
/// Refuses a non-empty value when the binary was built without the `bugs` feature.
pub fn install(spec: &str) -> Result<Option<&'static str>, String> {
    if !spec.trim().is_empty() && !ENABLED {
        return Err(
            "IM_BUG is set but this im-gateway was built without the `bugs` feature \
             (the controls build is `--features faults,bugs`)"
                .to_string(),
        );
    }
    let bug = parse(spec)?;
    #[cfg(feature = "bugs")]
    if let Some(name) = bug {
        imp::activate(name)?;
    }
    Ok(bug)
}

/// Whether `name` is the active bug. Without the `bugs` feature: always `false`, a constant.
#[cfg(not(feature = "bugs"))]
#[inline(always)]
pub const fn active(_name: &'static str) -> bool {
    false
}

/// Whether `name` is the active bug: one load (and a short string compare when one is set).
#[cfg(feature = "bugs")]
#[inline]
pub fn active(name: &'static str) -> bool {
    imp::ACTIVE.get().is_some_and(|a| *a == name)
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
    use std::sync::OnceLock;

    pub(super) static ACTIVE: OnceLock<&'static str> = OnceLock::new();

    pub(super) fn activate(name: &'static str) -> Result<(), String> {
        let now = *ACTIVE.get_or_init(|| name);
        if now != name {
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
        for (i, (n, d)) in ALL.iter().enumerate() {
            assert!(!d.is_empty() && !d.contains('\n'), "{n}");
            assert!(ALL[..i].iter().all(|(m, _)| m != n), "{n} listed twice");
            assert_eq!(parse(n).unwrap(), Some(*n));
            assert_eq!(parse(&format!("  {n}\n")).unwrap(), Some(*n));
        }
        assert_eq!(parse(NO_DEDUP).unwrap(), Some(NO_DEDUP));
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
        for (n, _) in ALL {
            assert!(e.contains(n), "{n} missing from: {e}");
        }
        let e = parse("no-dedup,no-sweep").unwrap_err();
        assert!(e.contains("one bug at a time"), "{e}");
    }

    /// A build without the `bugs` feature has no bug code and refuses to pretend it has.
    #[cfg(not(feature = "bugs"))]
    #[test]
    fn build_without_bugs_refuses_a_name() {
        let e = install(NO_DEDUP).unwrap_err();
        assert!(e.contains("without the `bugs` feature"), "{e}");
        let e = install("nope").unwrap_err();
        assert!(e.contains("without the `bugs` feature"), "{e}");
        const { assert!(!ENABLED) };
        for (n, _) in ALL {
            assert!(!active(n));
        }
    }

    /// With the feature an unknown name is still refused before anything is activated.
    #[cfg(feature = "bugs")]
    #[test]
    fn build_with_bugs_refuses_an_unknown_name() {
        const { assert!(ENABLED) };
        let e = install("nope").unwrap_err();
        assert!(e.contains("unknown bug") && e.contains(SEQ_GAP), "{e}");
        assert!(ALL.iter().all(|(n, _)| !active(n)));
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
