//! The table of anomaly kinds: each kind's name, the invariant it breaks and when it is
//! flagged, written once here. [`Kind`], [`Kind::ALL`], the names, the invariants and the
//! documentation (`Kind::flagged_when`, which evidence/README.md's checker table must
//! repeat word for word: a test holds them together) all come from this one table.

use serde::{Deserialize, Serialize};

macro_rules! kinds {
    ($( $(#[$doc:meta])* $variant:ident = $name:literal, $invariant:literal, $when:literal; )*) => {
        /// What an anomaly is. Serialised as the kebab-case names of the checker contract;
        /// the declaration order is the report's order.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        pub enum Kind {
            $( $(#[$doc])* #[serde(rename = $name)] $variant, )*
        }

        impl Kind {
            /// Every kind, in report order.
            pub const ALL: &'static [Kind] = &[$(Kind::$variant),*];

            /// The name in the report (same as the serialised form).
            pub fn as_str(self) -> &'static str {
                match self { $(Kind::$variant => $name,)* }
            }

            /// The invariant of SPEC section 1 this kind of anomaly breaks.
            pub fn invariant(self) -> &'static str {
                match self { $(Kind::$variant => $invariant,)* }
            }

            /// When it is flagged (the "flagged when" column of the checker's documentation).
            pub fn flagged_when(self) -> &'static str {
                match self { $(Kind::$variant => $when,)* }
            }
        }
    };
}

kinds! {
    Lost = "lost", "D1/D6",
        "a send answered `sent{seq, mid}` whose row `(conv, seq)` is missing or has another mid; after an asynchronous standby's promotion, one whose `sent` named an older epoch than the newest its conversation had (committed on the old primary) is the failover's expected loss, reported in `expected_loss`, not an anomaly";
    Duplicated = "duplicated", "D2",
        "two rows for one `(sender_user, cmid)`, or one `(device, cmid)` answered with two different seqs or mids";
    Unexpected = "unexpected", "D2",
        "a row whose `(sender_device, cmid)` no send of that device ever carried";
    P1Gap = "p1-gap", "P1",
        "a conversation's rows are not exactly seqs `1..=head`";
    D3AckBeyondStore = "d3-ack-beyond-store", "D3",
        "a client's own ack (not `explicit`) of a seq above the highest contiguous seq it had persisted (`store` lines before the ack's invoke; seqs invisible to its user are not holes)";
    D3CursorUnexplained = "d3-cursor-unexplained", "D3",
        "a cursor increase in `cursor_audit` not preceded (by wall clock) by an ack of that device of exactly that seq: something other than a device ack moved it";
    D4Decrease = "d4-decrease", "D4",
        "a cursor write lowering the cursor; a `delivered` a device saw lower than one it had already received before that request was sent; a final cursor above its head";
    S1Outside = "s1-outside", "S1",
        "a device received (push or sync) an event outside its user's membership periods (an event of an older epoch than the newest its conversation had in the history is not judged: the periods the final read knows are another lineage's)";
    D5NotRepaired = "d5-not-repaired", "D5",
        "after the judge's wait, a live device still lacks an event visible to it";
    D5SweepLate = "d5-sweep-late", "D5",
        "for a device that stayed behind (no ack reaching the hinted head in between), consecutive sweep hints more than sweep + 1000 ms apart, or (3+ gaps) a median gap over 1.5 x sweep. A reconnect of the device, a gateway start, or a fault that took the database away (`pg-crash`, `pg-power-cut`, `pg-primary-kill`: the sweep is a query; hints are not judged until a `pg-restart` succeeded or the address moved to the promoted standby) starts a new series. Hints received while any other fault is in force are not judged, except during a `client-crash` or a `gw-fault` that drops or refuses frames at a point other than `gw.reply.ack` (these leave the sweep alone; a dropped ack reply does not: the ack took effect unseen)";
    D5LockedOut = "d5-locked-out", "D5",
        "a hello refused over the failed-hello limit (`too many failed hellos`) although no hello of any device before it was refused `UNAUTHENTICATED` or `STALE_INSTALL`: only a hello the database refused may be charged, so an honest device was kept out (after an outage, say) and nothing it lacks can be repaired";
    StoreMismatch = "store-mismatch", "D1/D6",
        "a stored event whose row is missing or has another mid; one device received two different mids for one `(conv, seq)` within one epoch of the conversation (its `epoch` line starts another)";
    HeldLost = "held-lost", "D1/D6",
        "a device received (push or sync) an event whose row `(conv, seq)` is missing at the end or has another mid, and no later `epoch` line of that device moved that conversation's epoch (an epoch change excuses it only if it reached the device)";
    ReplyBeforeCommit = "reply-before-commit", "D1",
        "a probe after a `sent` reply did not find the event (not judged: a probe that read a promoted asynchronous standby after the database address moved, of an event that came before the move under an older epoch than its conversation's newest; the `lost` rule reports such a message as the failover's expected loss)";
    PushBeforeCommit = "push-before-commit", "D1",
        "a probe after a push did not find the event (not judged: a probe that read a promoted asynchronous standby after the database address moved, of an event that came before the move under an older epoch than its conversation's newest; the `lost` rule reports such a message as the failover's expected loss)";
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
