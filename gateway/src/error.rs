//! The wire errors of SPEC 2: one enum, one exhaustive `code()`. Nothing here may carry SQL,
//! I/O or other internal detail to a client; the `msg` strings are fixed and generic.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum WireError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Unauthenticated(&'static str),
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
    Throttled(&'static str),
    #[error("internal error")]
    Internal,
}

impl WireError {
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
}

/// Classifies a database error: a statement the database refused for a reason of its own
/// (constraint, syntax, type) or a row we could not decode is INTERNAL, a bug; everything
/// else (I/O, pool timeouts, connection, shutdown and recovery states) is UNAVAILABLE, which
/// the client may retry. The detail is logged where the request is handled, never sent.
pub fn from_db(e: &sqlx::Error) -> WireError {
    match e {
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            // 08: connection exception; 57P: operator intervention (shutdown, crash
            // recovery); 53: insufficient resources; 40001/40P01: retryable conflicts;
            // 57014/55P03: statement_timeout / lock_timeout (the database deadline).
            let retryable = code.starts_with("08")
                || code.starts_with("57P")
                || code == "57014"
                || code == "55P03"
                || code.starts_with("53")
                || code == "40001"
                || code == "40P01";
            if retryable {
                WireError::Unavailable
            } else {
                WireError::Internal
            }
        }
        sqlx::Error::RowNotFound
        | sqlx::Error::TypeNotFound { .. }
        | sqlx::Error::ColumnIndexOutOfBounds { .. }
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::Encode(_)
        | sqlx::Error::Decode(_)
        | sqlx::Error::Configuration(_) => WireError::Internal,
        _ => WireError::Unavailable,
    }
}
