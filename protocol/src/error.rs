//! The wire errors of SPEC 2: one enum, one exhaustive `code()`. Nothing here may carry SQL,
//! I/O or other internal detail to a client; the `msg` strings are fixed and generic.
//! A client reads an `error` frame back into this type ([`WireError::from_wire`]).

use std::borrow::Cow;
use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum WireError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    /// The gateway's messages are fixed (`&'static`); a client reads any back (owned).
    Unauthenticated(Cow<'static, str>),
    #[error("device was reinstalled: this install is stale")]
    StaleInstall,
    #[error("not a member of this conversation")]
    NotMember,
    #[error("ack beyond the conversation head ({head})")]
    CursorAhead { head: i64 },
    #[error("cmid was already used for another conversation or body")]
    CmidConflict,
    #[error("{0}")]
    TooLarge(String),
    #[error("database unavailable, retry later")]
    Unavailable,
    /// A limit refused the request for now (failed hellos, connections per device): code
    /// UNAVAILABLE, the client may retry later.
    #[error("{0}")]
    Throttled(Cow<'static, str>),
    #[error("internal error")]
    Internal,
}

/// The message of a hello refused because its device or its address made too many failed
/// hellos (the gateway's `IM_HELLO_FAILS_PER_*` limits): the one `UNAVAILABLE` a checker
/// may hold to account, since only hellos the database refused may be charged.
pub const HELLO_THROTTLED: &str = "too many failed hellos: retry later";

impl WireError {
    /// A hello refused over the failed-hello limits ([`HELLO_THROTTLED`]).
    pub fn hello_throttled() -> WireError {
        WireError::Throttled(Cow::Borrowed(HELLO_THROTTLED))
    }

    /// The stable error code of SPEC 2.
    pub fn code(&self) -> &'static str {
        match self {
            WireError::BadRequest(_) => "BAD_REQUEST",
            WireError::Unauthenticated(_) => "UNAUTHENTICATED",
            WireError::StaleInstall => "STALE_INSTALL",
            WireError::NotMember => "NOT_MEMBER",
            WireError::CursorAhead { .. } => "CURSOR_AHEAD",
            WireError::CmidConflict => "CMID_CONFLICT",
            WireError::TooLarge(_) => "TOO_LARGE",
            WireError::Unavailable | WireError::Throttled(_) => "UNAVAILABLE",
            WireError::Internal => "INTERNAL",
        }
    }

    pub fn bad(msg: impl Into<String>) -> WireError {
        WireError::BadRequest(msg.into())
    }

    /// The error an `error{code,msg}` frame carries, as the gateway raised it: `msg` is
    /// part of the value where the variant holds text (or `CURSOR_AHEAD`'s head), and is
    /// otherwise fixed by the code. The `Err` names what does not fit: an unknown code, or a
    /// `CURSOR_AHEAD` whose `msg` does not hold the head.
    pub fn from_wire(code: &str, msg: &str) -> Result<WireError, String> {
        Ok(match code {
            "BAD_REQUEST" => WireError::BadRequest(msg.to_string()),
            "UNAUTHENTICATED" => WireError::Unauthenticated(Cow::Owned(msg.to_string())),
            "STALE_INSTALL" => WireError::StaleInstall,
            "NOT_MEMBER" => WireError::NotMember,
            "CURSOR_AHEAD" => {
                let head = msg
                    .strip_prefix(CURSOR_AHEAD_PREFIX)
                    .and_then(|r| r.strip_suffix(')'))
                    .and_then(|h| h.parse().ok())
                    .ok_or_else(|| {
                        format!("CURSOR_AHEAD error without its head in `msg` {msg:?}")
                    })?;
                WireError::CursorAhead { head }
            }
            "CMID_CONFLICT" => WireError::CmidConflict,
            "TOO_LARGE" => WireError::TooLarge(msg.to_string()),
            // UNAVAILABLE is two variants: the database's fixed message, or a limit's own.
            "UNAVAILABLE" if msg == WireError::Unavailable.to_string() => WireError::Unavailable,
            "UNAVAILABLE" => WireError::Throttled(Cow::Owned(msg.to_string())),
            "INTERNAL" => WireError::Internal,
            other => {
                return Err(format!(
                    "unknown error code {:?}",
                    other.chars().take(32).collect::<String>()
                ))
            }
        })
    }
}

/// What `CursorAhead`'s message starts with (its `#[error]` text, up to the head).
const CURSOR_AHEAD_PREFIX: &str = "ack beyond the conversation head (";
