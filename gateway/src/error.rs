//! Wire errors as the gateway raises them: the type and its codes are the protocol crate's
//! ([`im_protocol::error`]); this module adds the one mapping that needs the database driver,
//! [`from_db`]. Nothing here may carry SQL or I/O detail to a client.

pub use im_protocol::WireError;

/// Classifies a database error: a statement the database refused for a reason of its own
/// (constraint, syntax, type) or a row we could not decode is INTERNAL, a bug; everything
/// else (I/O, pool timeouts, connection, shutdown and recovery states) is UNAVAILABLE, which
/// the client may retry. The detail is logged where the request is handled, never sent.
pub fn from_db(e: &sqlx::Error) -> WireError {
    match e {
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            // 08: connection exception; 57P: operator intervention (shutdown, crash
            // recovery); 53: insufficient resources (53100: the disk is full); 58: system
            // error (58030: an I/O error of the server's disk, issue 21); 40001/40P01:
            // retryable conflicts; 57014/55P03: statement_timeout / lock_timeout (the
            // database deadline).
            let retryable = code.starts_with("08")
                || code.starts_with("57P")
                || code == "57014"
                || code == "55P03"
                || code.starts_with("53")
                || code.starts_with("58")
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
