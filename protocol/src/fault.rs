//! The fault points and actions of SPEC 4, by the names `IM_FAULT` uses: one list, which the
//! gateway's `faults::points` and everything that arms a point (harness, nemesis, repro)
//! derive from, so a rename is a compile error, not a silent no-op.
//!
//! Must not: know where a point sits in the gateway or what firing does there (the gateway's
//! `faults` module documents that), or parse a whole `IM_FAULT` value (the gateway does,
//! with its own messages).

use std::fmt;
use std::str::FromStr;

/// Every fault point of the gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FaultPoint {
    /// In the send transaction, after the seq was taken, before the INSERT (group commit:
    /// per row, before the batch's transaction; a row it stops never reaches it).
    SendBeforeInsert,
    /// After the INSERT, before COMMIT (group commit: per inserted row, inside the batch's
    /// transaction; a row it stops rolls the batch back, and every other row of the batch
    /// is sent again on its own).
    SendBeforeCommit,
    /// Group commit: in a batch's transaction, after its rows were inserted, before its
    /// COMMIT. `drop` rolls the batch back and its rows get no reply at all; `error` fails
    /// it as a database error would: every row is then sent again on its own.
    SendBatchBeforeCommit,
    /// Group commit: after a batch's COMMIT returned, before any of its rows is answered or
    /// notified: `halt` leaves committed messages with no reply and no notification (a
    /// resend is `dup`, the commit feed repairs the push); `drop` sends no reply and
    /// `error` answers UNAVAILABLE, the notifications still go.
    SendBatchAfterCommit,
    /// After COMMIT returned, before the committed `conv:seq` is handed to the notifier:
    /// `halt` leaves a durable message nobody is notified of (the sweep repairs it, D5);
    /// `drop`/`error` skip that one notification and the reply still goes.
    SendAfterCommitBeforeNotify,
    /// After COMMIT returned, before the `sent` reply is queued.
    ApiAfterSendCommit,
    /// The `sent` frame, as it is about to be written to the socket.
    GwReplySend,
    /// The `acked` frame, as it is about to be written (the note's "lost ack" path).
    GwReplyAck,
    /// An `event` push, as it is about to be written (hints are not pushes).
    GwPush,
    /// An inbound `ack`, as it is read: `drop` loses it before it reaches the database
    /// (the note's "lost ack frame"; the sweep hints again and the device re-acks).
    GwRecvAck,
    /// The notifier's NOTIFY statement (and the local hand-off before it), about to be
    /// sent: `drop` sends nothing and hands nothing on (the notifications never happen),
    /// `error` fails it as a refused statement would; either way every gateway's commit
    /// feed repairs it (D5).
    FanoutNotify,
    /// A fan-out read (a batch of notified events with their audiences), about to run:
    /// `drop` and `error` fail it as a database error would (the sweep asks about those
    /// conversations, D5).
    FanoutRead,
    /// An attempt to regain the LISTEN connection after it was lost: `drop` and `error` fail
    /// the attempt (the next one follows after the backoff), so notifications, install
    /// changes included, stay lost for as long as it is armed.
    FanoutListen,
    /// A look of the commit feed, about to run: `drop` and `error` skip it (the next look
    /// asks from the same mark, so nothing is lost, only later).
    FanoutFeed,
}

impl FaultPoint {
    /// Every point, in the order `im-gateway faults` lists them.
    pub const ALL: [FaultPoint; 14] = [
        FaultPoint::SendBeforeInsert,
        FaultPoint::SendBeforeCommit,
        FaultPoint::SendBatchBeforeCommit,
        FaultPoint::SendBatchAfterCommit,
        FaultPoint::SendAfterCommitBeforeNotify,
        FaultPoint::ApiAfterSendCommit,
        FaultPoint::GwReplySend,
        FaultPoint::GwReplyAck,
        FaultPoint::GwPush,
        FaultPoint::GwRecvAck,
        FaultPoint::FanoutNotify,
        FaultPoint::FanoutRead,
        FaultPoint::FanoutListen,
        FaultPoint::FanoutFeed,
    ];

    /// The point's name in `IM_FAULT`.
    pub const fn name(self) -> &'static str {
        match self {
            FaultPoint::SendBeforeInsert => "send.before_insert",
            FaultPoint::SendBeforeCommit => "send.before_commit",
            FaultPoint::SendBatchBeforeCommit => "send.batch.before_commit",
            FaultPoint::SendBatchAfterCommit => "send.batch.after_commit",
            FaultPoint::SendAfterCommitBeforeNotify => "send.after_commit_before_notify",
            FaultPoint::ApiAfterSendCommit => "api.after_send_commit",
            FaultPoint::GwReplySend => "gw.reply.send",
            FaultPoint::GwReplyAck => "gw.reply.ack",
            FaultPoint::GwPush => "gw.push",
            FaultPoint::GwRecvAck => "gw.recv.ack",
            FaultPoint::FanoutNotify => "fanout.notify",
            FaultPoint::FanoutRead => "fanout.read",
            FaultPoint::FanoutListen => "fanout.listen",
            FaultPoint::FanoutFeed => "fanout.feed",
        }
    }

    /// Every name, in the order of [`FaultPoint::ALL`].
    pub const NAMES: [&'static str; 14] = {
        let mut names = [""; 14];
        let mut i = 0;
        while i < names.len() {
            names[i] = FaultPoint::ALL[i].name();
            i += 1;
        }
        names
    };
}

/// Serialised as its name (`"gw.push"`), as `IM_FAULT`, schedules and histories spell it.
impl serde::Serialize for FaultPoint {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for FaultPoint {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<FaultPoint, D::Error> {
        let name = <std::borrow::Cow<'de, str> as serde::Deserialize>::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for FaultPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is no fault point.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown fault point {0:?}")]
pub struct UnknownFaultPoint(pub String);

impl FromStr for FaultPoint {
    type Err = UnknownFaultPoint;

    fn from_str(s: &str) -> Result<FaultPoint, UnknownFaultPoint> {
        FaultPoint::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| UnknownFaultPoint(s.to_string()))
    }
}

/// What an armed point does when it fires (SPEC 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// End the process at once with exit status 137: no destructors, no flush, no close frame.
    Halt,
    /// Discard the frame (at a transaction point: roll back and send no reply at all).
    Drop,
    /// Sleep this many milliseconds (async), then go on.
    Delay(u64),
    /// Fail the operation with UNAVAILABLE.
    Error,
}

/// Longest `delay(MS)` accepted.
pub const DELAY_MAX_MS: u64 = 600_000;

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Halt => write!(f, "halt"),
            Action::Drop => write!(f, "drop"),
            Action::Delay(ms) => write!(f, "delay({ms})"),
            Action::Error => write!(f, "error"),
        }
    }
}

impl FromStr for Action {
    /// What is wrong with it, in the words `IM_FAULT`'s errors use.
    type Err = String;

    fn from_str(s: &str) -> Result<Action, String> {
        match s {
            "halt" => Ok(Action::Halt),
            "drop" => Ok(Action::Drop),
            "error" => Ok(Action::Error),
            _ => {
                if let Some(ms) = s.strip_prefix("delay(").and_then(|r| r.strip_suffix(')')) {
                    let ms: u64 = ms.parse().map_err(|_| {
                        format!("delay({ms}): MS must be a whole number of milliseconds")
                    })?;
                    if ms > DELAY_MAX_MS {
                        return Err(format!("delay({ms}): at most {DELAY_MAX_MS} ms"));
                    }
                    return Ok(Action::Delay(ms));
                }
                Err(format!("unknown action {s:?}"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every point's name parses back to the point, names are unique, and a typo is
    /// refused with the name it was given.
    #[test]
    fn names_round_trip_and_typos_are_refused() {
        for p in FaultPoint::ALL {
            assert_eq!(p.name().parse::<FaultPoint>(), Ok(p));
            assert_eq!(p.to_string(), p.name());
        }
        let mut names = FaultPoint::NAMES.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), FaultPoint::ALL.len());
        let e = "send.before_comit".parse::<FaultPoint>().unwrap_err();
        assert_eq!(e.to_string(), r#"unknown fault point "send.before_comit""#);
    }

    #[test]
    fn actions_round_trip() {
        for a in [Action::Halt, Action::Drop, Action::Delay(25), Action::Error] {
            assert_eq!(a.to_string().parse::<Action>(), Ok(a));
        }
        assert!("delay(600001)".parse::<Action>().is_err());
        assert!("delay(x)".parse::<Action>().is_err());
        assert_eq!(
            "explode".parse::<Action>().unwrap_err(),
            r#"unknown action "explode""#
        );
    }
}
