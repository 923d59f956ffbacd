//! The first connection of `migrate`, `admin` and `serve`: one direct connect attempt
//! before the pool is built, so a wrong host, port, password or database name is reported
//! once, in one line, with its real cause. (The pool's own `connect` retries until its
//! acquire timeout and then says only "pool timed out".) The password is never printed.

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::Connection;
use std::str::FromStr;
use std::time::Duration;

/// Connects once to `url` and closes again. The error is one line:
/// `cannot connect to PostgreSQL at HOST:PORT (database DB): CAUSE`.
pub async fn probe(url: &str, timeout: Duration) -> anyhow::Result<()> {
    let opts = PgConnectOptions::from_str(url).map_err(|e| {
        anyhow::anyhow!(
            "IM_DATABASE_URL is not a valid PostgreSQL URL: {}",
            cause(&e)
        )
    })?;
    let r = tokio::time::timeout(timeout, PgConnection::connect_with(&opts)).await;
    let err = match r {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            return Ok(());
        }
        Ok(Err(e)) => cause(&e),
        Err(_) => format!(
            "no answer within {} ms (IM_DB_TIMEOUT_MS)",
            timeout.as_millis()
        ),
    };
    Err(anyhow::anyhow!("{}: {err}", where_(&opts)))
}

/// `cannot connect to PostgreSQL at HOST:PORT (database DB)`, without user or password.
fn where_(o: &PgConnectOptions) -> String {
    let at = match o.get_socket() {
        Some(dir) => format!("socket {}/.s.PGSQL.{}", dir.display(), o.get_port()),
        None => format!("{}:{}", o.get_host(), o.get_port()),
    };
    let db = o.get_database().unwrap_or(o.get_username());
    format!("cannot connect to PostgreSQL at {at} (database {db})")
}

/// The cause of a failed connect in words: `connection refused`, `authentication failed:
/// …`, `database "x" does not exist`, …
fn cause(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::Io(io) => match io.kind() {
            std::io::ErrorKind::ConnectionRefused => "connection refused".into(),
            std::io::ErrorKind::TimedOut => "timed out".into(),
            std::io::ErrorKind::NotFound => format!("no such host or socket ({io})"),
            _ => io.to_string(),
        },
        sqlx::Error::Database(db) => {
            let msg = db.message();
            match db.code().as_deref() {
                Some("28P01") | Some("28000") => format!("authentication failed: {msg}"),
                _ => msg.to_string(),
            }
        }
        sqlx::Error::Tls(t) => format!("TLS: {t}"),
        sqlx::Error::Configuration(c) => c.to_string(),
        other => other.to_string(),
    }
}
