//! The state every task of a running gateway shares: configuration, the database pool,
//! the [`Hub`] of live connections, the failed-hello throttle, the send path's observer,
//! and the task lifetimes (one root `CancellationToken`, one `TaskTracker`), plus the
//! per-request database deadline.
//!
//! A leaf: it imports nothing from `conn`, `fanout`, `sweep` or `server`. Those three take
//! an `Arc<State>`; `server` builds it and is the only module that starts their `run`.

use crate::config::Config;
use crate::error::WireError;
use crate::hub::Hub;
use crate::limits::HelloThrottle;
use crate::observer::Observer;
use crate::store::Notifier;
use sqlx::PgPool;
use std::future::Future;
use std::sync::Arc;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub struct State {
    /// The configuration read at start (`IM_*`).
    pub cfg: Config,
    /// Request and sweep work (the LISTEN connection is taken from it once, by `fanout`).
    pub pool: PgPool,
    /// Who is connected, authenticated and subscribed.
    pub hub: Arc<Hub>,
    /// The database lineage this gateway serves from (issue 21, [`crate::lineage`]).
    pub lineage: Arc<crate::lineage::Lineage>,
    /// Every task of the gateway, waited for (bounded) at shutdown.
    pub tracker: TaskTracker,
    /// The root token: cancelled on SIGTERM/SIGINT.
    pub cancel: CancellationToken,
    /// Wakes the sweep at once (after the LISTEN connection was lost and regained).
    pub sweep_now: Notify,
    /// Failed hellos per source address and per device id.
    pub hello_throttle: HelloThrottle,
    /// The fan-out's own connections (the notifier's NOTIFYs, the fan-out reads and the
    /// commit feed, [`FANOUT_POOL_MAX`]): they never queue behind requests for `pool`.
    pub fanout_pool: PgPool,
    /// Where the send path hands every committed `(conv, seq)` (after COMMIT returned).
    pub notifier: Notifier,
    /// What fan-out pushed and acks merged since the last sweep: the sweep's candidates (D5).
    pub changes: crate::changes::Changes,
    /// Group commit of sends (`batch`).
    pub sends: crate::batch::Sends,
    /// Batches of acks (`batch`).
    pub acks: crate::batch::Acks,
    /// The send path's observer: watches no send in production (`observer`).
    pub observer: Observer,
}

/// Connections of [`State::fanout_pool`]: one each for the notifier, the fan-out reads and
/// the commit feed.
pub const FANOUT_POOL_MAX: u32 = 3;

impl State {
    /// Runs database work for a request with the `IM_DB_TIMEOUT_MS` deadline. The work runs
    /// in its own task, so when the deadline passes the client gets UNAVAILABLE at once while
    /// the transaction still finishes or rolls back on its own: it is never cancelled halfway.
    pub async fn db<T, F, W>(&self, work: W) -> Result<T, WireError>
    where
        W: FnOnce(PgPool) -> F,
        F: Future<Output = Result<T, WireError>> + Send + 'static,
        T: Send + 'static,
    {
        let task = self.tracker.spawn(work(self.pool.clone()));
        match tokio::time::timeout(self.cfg.db_work_deadline(), task).await {
            Ok(Ok(r)) => r,
            // Only in the library's tests: the binary's panic hook (`invariant`) ends the
            // process before a panicking task can be joined.
            Ok(Err(join)) => {
                tracing::error!(error = %join, "request task failed");
                Err(WireError::Internal)
            }
            Err(_) => {
                tracing::warn!(
                    timeout_ms = self.cfg.db_timeout_ms,
                    "database deadline passed: UNAVAILABLE"
                );
                Err(WireError::Unavailable)
            }
        }
    }
}
