//! All SQL of the request path: authentication, the send transaction, acks, sub, sync, the
//! fan-out read and the sweep query. Functions return wire errors (`WireError`) and log the
//! database detail themselves; they know nothing of sockets or frames.

use crate::bugs::{self, Bug};
use crate::config::SyncCommit;
use crate::error::{from_db, WireError};
use crate::faults::{self, points};
use crate::lineage::Lineage;
use crate::protocol::{ConvHead, Event, Reply};
use futures_util::TryStreamExt;
use sha2::{Digest, Sha256};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::Row;
use std::borrow::Cow;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

/// The authenticated side of a connection, fixed by `hello`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub user: String,
    pub device: String,
    /// The install epoch the device said hello with (== `devices.install_epoch` then).
    pub epoch: i64,
}

/// The NOTIFY channel of committed events (SPEC 3): the notifier ([`Notifier`]) sends
/// `conv:seq` lines on it after the send transaction committed.
pub const CHANNEL: &str = "im_events";

/// Most bytes of one notification payload (PostgreSQL refuses 8000 and more).
const PAYLOAD_MAX_BYTES: usize = 7_000;

/// The send path's handle on the notifier task (`fanout::notify_loop`): [`send`] hands it
/// every `(conv, seq)` it committed, only after COMMIT returned, and never waits. The
/// notifier sends them as NOTIFYs in their own statement, batched: no send transaction
/// holds NOTIFY's cluster-wide lock through its commit flush any more.
#[derive(Clone, Debug)]
pub struct Notifier {
    tx: tokio::sync::mpsc::UnboundedSender<(String, i64)>,
}

/// The notifier task's side of [`Notifier`]: committed `(conv, seq)` pairs.
pub type NotifierRx = tokio::sync::mpsc::UnboundedReceiver<(String, i64)>;

impl Notifier {
    pub fn new() -> (Notifier, NotifierRx) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (Notifier { tx }, rx)
    }

    /// `conv:seq` committed: to be notified. If the notifier is gone (shutdown), nothing
    /// is: every gateway's commit feed finds a notification that never happens (D5).
    pub fn committed(&self, conv: &str, seq: i64) {
        let _ = self.tx.send((conv.to_string(), seq));
    }
}

/// Splits committed `(conv, seq)` pairs into notification payloads: `conv:seq` lines
/// (ids are `A-Za-z0-9._-` only, `protocol`, and the database CHECKs agree: never a newline), each payload at most
/// [`PAYLOAD_MAX_BYTES`].
pub fn payloads(pairs: &[(String, i64)]) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for (conv, seq) in pairs {
        let line = format!("{conv}:{seq}");
        if !cur.is_empty() && cur.len() + 1 + line.len() > PAYLOAD_MAX_BYTES {
            out.push(std::mem::take(&mut cur));
        }
        if !cur.is_empty() {
            cur.push('\n');
        }
        cur.push_str(&line);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Sends the payloads on [`CHANNEL`], one statement (autocommitted: no row is written, so
/// its commit waits for no WAL flush).
pub async fn notify(pool: &PgPool, payloads: &[String]) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT count(pg_notify($1, p)) FROM unnest($2::text[]) AS p")
        .bind(CHANNEL)
        .bind(payloads)
        .execute(pool)
        .await?;
    Ok(())
}

/// The NOTIFY channel of install changes: `device:ID`, sent by a trigger on `devices`
/// (migration 0002) whenever an install epoch changes or a device is removed.
pub const ADMIN_CHANNEL: &str = "im_admin";

/// Set on every pool connection (`$1`: the statement timeout in ms, `$2`:
/// `IM_SYNCHRONOUS_COMMIT`).
const CONNECT_SQL: &str = "SELECT set_config('statement_timeout', $1, false),
                            set_config('synchronous_commit', $2, false)";

/// A pool connection idle this long is pinged before it is handed out ([`connect`]).
const IDLE_PING: Duration = Duration::from_secs(1);

/// Opens a pool. Every connection gets `synchronous_commit` = `sync` (`on` by default: D6
/// must not depend on a server or role default), and, with `statement_timeout`, that
/// timeout, so statements left running after a request's deadline (see `state::State::db`)
/// cannot pin connections. With `lineage` (the serving gateway's pools), every new
/// connection checks the database's lineage before it serves anything and moves every
/// conversation's epoch if it changed ([`crate::lineage`], migrations 0006 and 0007).
pub async fn connect(
    url: &str,
    max: u32,
    acquire_timeout: Duration,
    statement_timeout: Option<Duration>,
    sync: SyncCommit,
    lineage: Option<Arc<Lineage>>,
) -> anyhow::Result<PgPool> {
    use anyhow::Context;
    // 0 = no timeout (PostgreSQL's default).
    let timeout_ms = statement_timeout
        .map_or(0, |t| t.as_millis().max(1))
        .to_string();
    let sync = if bugs::active(Bug::AsyncCommit) {
        SyncCommit::Off
    } else {
        sync
    };
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(acquire_timeout)
        // Issue 19: no liveness round trip on every acquire, only for a connection that sat
        // idle for IDLE_PING or more (one that may have died unseen); a busy connection that
        // died fails its statement, which the request answers UNAVAILABLE (the client sends
        // again under its cmid), and the pool drops it.
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= IDLE_PING {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
        .after_connect(move |conn, _meta| {
            let timeout_ms = timeout_ms.clone();
            let lineage = lineage.clone();
            Box::pin(async move {
                // The `no-incarnation` bug checks the lineage first, under the server's
                // default `synchronous_commit`: the incarnation is never seen.
                let early = bugs::active(Bug::NoIncarnation);
                if let (true, Some(l)) = (early, &lineage) {
                    check_lineage(conn, l).await?;
                }
                sqlx::query(CONNECT_SQL)
                    .bind(timeout_ms)
                    .bind(sync.as_str())
                    .execute(&mut *conn)
                    .await?;
                if let (false, Some(l)) = (early, &lineage) {
                    check_lineage(conn, l).await?;
                }
                Ok(())
            })
        })
        .connect(url)
        .await
        .context("connect to PostgreSQL (IM_DATABASE_URL)")
}

/// Issue 21, item 3: `im_check_lineage()` on a new connection (it moves every
/// conversation's epoch when the database's lineage changed), and what it found told to
/// `lineage`. A schema without the function (not migrated: `serve` refuses it with a
/// message right after) is not checked. The `no-epoch` bug skips the check.
async fn check_lineage(conn: &mut sqlx::PgConnection, lineage: &Lineage) -> sqlx::Result<()> {
    if bugs::active(Bug::NoEpoch) {
        return Ok(());
    }
    let r: Result<(String, i32, Option<String>, bool), _> = sqlx::query_as(
        "SELECT system_identifier, timeline, incarnation, moved FROM im_check_lineage()",
    )
    .fetch_one(&mut *conn)
    .await;
    match r {
        Ok((system_identifier, timeline, incarnation, moved)) => {
            let id = crate::lineage::Id {
                system_identifier,
                timeline,
                incarnation,
            };
            lineage.observe(id, moved);
            Ok(())
        }
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42883") => Ok(()),
        Err(e) => Err(e),
    }
}

/// The durability settings a pool connection runs under, as the server reports them to
/// that session: `(synchronous_commit, fsync, full_page_writes)`. Logged once at start so
/// a harness can tell what D6 rests on (issue 11's durability guard).
pub async fn session_durability(pool: &PgPool) -> anyhow::Result<(String, String, String)> {
    use anyhow::Context;
    sqlx::query_as(
        "SELECT current_setting('synchronous_commit'), current_setting('fsync'),
                current_setting('full_page_writes')",
    )
    .fetch_one(pool)
    .await
    .context("read the session's durability settings")
}

pub fn token_sha256(token: &str) -> String {
    let digest = Sha256::digest(token.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Constant-time comparison of two hex digests of equal length.
fn digest_eq(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

fn db(op: &'static str) -> impl Fn(sqlx::Error) -> WireError {
    move |e| {
        let w = from_db(&e);
        tracing::warn!(op, code = w.code(), error = %e, "database error");
        w
    }
}

/// A digest no token has (compared against when the device is unknown, so an unknown
/// device costs the same work as a wrong token).
const NO_DIGEST: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// `hello`. Welcome only for the current install's token at the current epoch. STALE_INSTALL
/// only for a client that proves it held an older install: the token of that install at
/// that epoch (`device_installs`, migration 0002). Everything else (unknown device, wrong
/// token at any epoch, a future epoch, a token of another epoch) is the same
/// UNAUTHENTICATED, so a hello reveals neither whether a device exists nor its epoch.
pub async fn authenticate(
    pool: &PgPool,
    device: &str,
    token: &str,
    epoch: i64,
) -> Result<Principal, WireError> {
    let row = sqlx::query(
        "SELECT d.user_id, d.install_epoch::bigint, d.token_sha256,
                (SELECT i.token_sha256 FROM device_installs i
                 WHERE i.device_id = d.device_id AND i.install_epoch = $2)
         FROM devices d WHERE d.device_id = $1",
    )
    .bind(device)
    .bind(epoch)
    .fetch_optional(pool)
    .await
    .map_err(db("authenticate"))?;
    let digest = token_sha256(token);
    let refused = WireError::Unauthenticated("unknown device or wrong token".into());
    let Some(row) = row else {
        let _ = digest_eq(&digest, NO_DIGEST);
        return Err(refused);
    };
    let user: String = row.get(0);
    let install_epoch: i64 = row.get(1);
    let current: String = row.get(2);
    let that_install: Option<String> = row.get(3);
    if epoch == install_epoch && digest_eq(&digest, &current) {
        return Ok(Principal {
            user,
            device: device.to_string(),
            epoch,
        });
    }
    let proves_older =
        epoch < install_epoch && that_install.is_some_and(|older| digest_eq(&digest, &older));
    if proves_older {
        return Err(WireError::StaleInstall);
    }
    Err(refused)
}

/// The device's current install epoch (`None`: the device is gone).
pub async fn install_epoch(pool: &PgPool, device: &str) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar("SELECT install_epoch::bigint FROM devices WHERE device_id = $1")
        .bind(device)
        .fetch_optional(pool)
        .await
}

/// [`stale_installs`]: a device that is gone has no row, so its epoch is NULL, which only
/// `IS DISTINCT FROM` tells apart from the install's.
const STALE_INSTALLS_SQL: &str = "SELECT s.device_id, d.install_epoch::bigint
         FROM unnest($1::text[], $2::bigint[]) AS s(device_id, epoch)
         LEFT JOIN devices d ON d.device_id = s.device_id
         WHERE d.install_epoch IS DISTINCT FROM s.epoch";

/// What the `gone-device-stays` bug changes in [`STALE_INSTALLS_SQL`].
const GONE_DEVICE_STAYS_EDITS: &[(&str, &str)] = &[(
    "d.install_epoch IS DISTINCT FROM s.epoch",
    "d.install_epoch <> s.epoch",
)];

/// Of these `(device, epoch)` installs, the ones that are no longer current, with the
/// current epoch (`None`: the device is gone). The sweep closes their connections, which
/// covers a reinstall notification lost with the LISTEN connection.
pub async fn stale_installs(
    pool: &PgPool,
    devices: &[String],
    epochs: &[i64],
) -> Result<Vec<(String, Option<i64>)>, sqlx::Error> {
    let sql: Cow<'static, str> = if bugs::active(Bug::GoneDeviceStays) {
        bugs::rewrite(STALE_INSTALLS_SQL, GONE_DEVICE_STAYS_EDITS).into()
    } else {
        STALE_INSTALLS_SQL.into()
    };
    let rows = sqlx::query(&sql)
        .bind(devices)
        .bind(epochs)
        .fetch_all(pool)
        .await?;
    Ok(rows.into_iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// STALE_INSTALL if the device was reinstalled (or removed) since this connection's hello.
async fn check_install(pool: &PgPool, who: &Principal) -> Result<(), WireError> {
    let current: Option<i64> =
        sqlx::query_scalar("SELECT install_epoch::bigint FROM devices WHERE device_id = $1")
            .bind(&who.device)
            .fetch_optional(pool)
            .await
            .map_err(db("install_epoch"))?;
    match current {
        Some(e) if e == who.epoch => Ok(()),
        Some(_) => Err(WireError::StaleInstall),
        None => Err(WireError::Unauthenticated("device no longer exists".into())),
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sent {
    pub seq: i64,
    pub mid: String,
    pub dup: bool,
    /// The conversation's sequence epoch.
    pub epoch: i64,
}

impl Sent {
    /// The `sent` reply to a send to `conv`.
    pub fn reply(&self, conv: &str) -> Reply {
        Reply::Sent {
            conv: conv.to_string(),
            seq: self.seq,
            mid: self.mid.clone(),
            dup: self.dup,
            epoch: self.epoch,
        }
    }
}

/// The outcome of a send: a reply, or (after a `drop` fault) none at all.
#[derive(Debug)]
pub enum SendOutcome {
    Reply(Sent),
    NoReply,
}

/// Looks up an earlier send of `(user, cmid)`: `Some(Ok)` when it is the same message (a
/// duplicate, D2), `Some(Err(CMID_CONFLICT))` when the cmid was used for something else.
async fn earlier_send(
    pool: &PgPool,
    user: &str,
    conv: &str,
    cmid: &str,
    body: &str,
) -> Result<Option<Result<Sent, WireError>>, WireError> {
    let row = sqlx::query(
        "SELECT e.conv_id, e.seq, e.mid, e.body, c.epoch::bigint
         FROM events e JOIN conversations c ON c.conv_id = e.conv_id
         WHERE e.sender_user = $1 AND e.cmid = $2",
    )
    .bind(user)
    .bind(cmid)
    .fetch_optional(pool)
    .await
    .map_err(db("send.lookup"))?;
    Ok(row.map(|r| {
        let (c, b): (String, String) = (r.get(0), r.get(3));
        if c == conv && b == body {
            Ok(Sent {
                seq: r.get(1),
                mid: r.get(2),
                dup: true,
                epoch: r.get(4),
            })
        } else {
            Err(WireError::CmidConflict)
        }
    }))
}

/// Takes the next seq of a conversation and its epoch (and, in a transaction, its row lock).
const TAKE_SEQ_SQL: &str = "UPDATE conversations SET next_seq = next_seq + 1 WHERE conv_id = $1
         RETURNING next_seq - 1, epoch::bigint";

/// The send INSERT (see [`send`]).
pub(crate) const SEND_INSERT_SQL: &str = "WITH ins AS (
                     INSERT INTO events (conv_id, seq, sender_user, sender_device, cmid, body)
                     SELECT $1, $2, $3, $4, $5, $6
                     WHERE EXISTS (SELECT 1 FROM memberships
                                   WHERE conv_id = $1 AND user_id = $3 AND to_seq IS NULL)
                       AND EXISTS (SELECT 1 FROM devices
                                   WHERE device_id = $4 AND install_epoch = $7)
                     ON CONFLICT (sender_user, cmid) DO NOTHING
                     RETURNING mid)
                 SELECT ins.mid FROM ins";

/// What the `no-dedup` bug removes from [`SEND_INSERT_SQL`] (with the constraint gone, the
/// `ON CONFLICT` would be an error).
pub(crate) const NO_DEDUP_EDITS: &[(&str, &str)] =
    &[("ON CONFLICT (sender_user, cmid) DO NOTHING", "")];

/// The name PostgreSQL gave `UNIQUE (sender_user, cmid)` of `events` (migration 0001).
const DEDUP_CONSTRAINT: &str = "events_sender_user_cmid_key";

/// The `no-dedup` bug, run once by `serve` in the controls build: drops D2's unique
/// constraint from the database (for good: the database is a throwaway one).
pub async fn drop_dedup_constraint(pool: &PgPool) -> anyhow::Result<()> {
    use anyhow::Context;
    sqlx::raw_sql(&format!(
        "ALTER TABLE events DROP CONSTRAINT IF EXISTS {DEDUP_CONSTRAINT}"
    ))
    .execute(pool)
    .await
    .context("drop the (sender_user, cmid) constraint for the no-dedup bug")?;
    Ok(())
}

/// What may watch a send between its INSERT and its COMMIT and bend the transaction around
/// it: the one seam of [`send`] for the deliberate bugs that act inside a send (the
/// controls build's `crate::observer`, set once in `State`). Every default is SPEC 3's
/// transaction; production passes none ([`Unobserved`]), which overrides nothing.
pub trait SendObserver: Send + Sync {
    /// Whether the seq is taken before BEGIN, in a statement of its own (autocommitted),
    /// instead of in the transaction (P1).
    fn seq_before_begin(&self) -> bool {
        false
    }

    /// The INSERT to run: [`SEND_INSERT_SQL`] (D2, S1).
    fn insert_sql(&self) -> Cow<'static, str> {
        Cow::Borrowed(SEND_INSERT_SQL)
    }

    /// Whether [`Self::uncommitted`] is to be called (it costs a read in the transaction).
    fn watches_uncommitted(&self) -> bool {
        false
    }

    /// Called between the INSERT and the `send.before_commit` point, with the reply-to-be,
    /// the event as inserted and the users with an open membership (read in the same
    /// transaction).
    fn uncommitted(&self, _sent: &Sent, _event: &Event, _audience: &[String]) {}

    /// Whether the `send.before_commit` point and COMMIT run in a task of their own, the
    /// send answering without waiting for them (D1 requires waiting).
    fn commit_after_reply(&self) -> bool {
        false
    }
}

/// Production's [`SendObserver`]: watches nothing and bends nothing.
pub struct Unobserved;

impl SendObserver for Unobserved {}

/// Why a send inserted nothing: a stale install, or an earlier send of `(user, cmid)` (a
/// duplicate, D2, or CMID_CONFLICT), else NOT_MEMBER (no such conversation or no open
/// period).
pub async fn not_inserted(
    pool: &PgPool,
    who: &Principal,
    conv: &str,
    cmid: &str,
    body: &str,
) -> Result<SendOutcome, WireError> {
    check_install(pool, who).await?;
    match earlier_send(pool, &who.user, conv, cmid, body).await? {
        Some(earlier) => earlier.map(SendOutcome::Reply),
        None => Err(WireError::NotMember),
    }
}

/// The membership read before a send's transaction, without any lock: `None` for a user
/// with an open period in `conv`; otherwise the send's answer (NOT_MEMBER, STALE_INSTALL or
/// an earlier send's `dup`), given without queueing on the conversation's row lock.
pub async fn outsider(
    pool: &PgPool,
    who: &Principal,
    conv: &str,
    cmid: &str,
    body: &str,
) -> Option<Result<SendOutcome, WireError>> {
    let member = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM memberships
                        WHERE conv_id = $1 AND user_id = $2 AND to_seq IS NULL)",
    )
    .bind(conv)
    .bind(&who.user)
    .fetch_one(pool)
    .await
    .map_err(db("send.member"));
    match member {
        Ok(true) => None,
        Ok(false) => Some(not_inserted(pool, who, conv, cmid, body).await),
        Err(e) => Some(Err(e)),
    }
}

/// What [`send`] needs besides the message.
pub struct SendCtx<'a> {
    /// `None` (SPEC 3's transaction) except for the deliberate bugs that act inside a send.
    pub observer: Option<&'a dyn SendObserver>,
    /// Told every committed `(conv, seq)`, after COMMIT returned.
    pub notifier: &'a Notifier,
    /// The connection saw this user's send to this conversation commit before: the
    /// membership read before the transaction is skipped (only a hint: the INSERT's test
    /// after the row lock decides, S1).
    pub known_member: bool,
}

/// The send transaction of SPEC 3, in four round trips: BEGIN; `UPDATE conversations …
/// RETURNING` (takes the seq and the conversation row lock); one statement that inserts the
/// event only if the sender has an open membership period and only if `(sender_user, cmid)`
/// is new; COMMIT. Then, after COMMIT returned and outside the transaction, the committed
/// `(conv, seq)` goes to the `notifier`, which NOTIFYs it in a statement of its own
/// (batched with others): NOTIFY's cluster-wide lock is no longer held through the send's
/// commit flush. A notification that never happens (a crash at
/// `send.after_commit_before_notify`, a NOTIFY that failed) is found by every gateway's
/// commit feed ([`commits_since`]) within one sweep interval (D5).
///
/// D1: the caller replies only with what this returns, and this returns only after COMMIT
/// returned. No push before its commit: fan-out pushes only what a notification names, and
/// the notification is sent only after COMMIT returned. D2: `(sender_user, cmid)` is unique; a resend, or a concurrent duplicate that
/// loses the unique race (its INSERT does nothing), rolls back and answers `dup:true` with
/// the winner's seq and mid. P1: the seq comes from `UPDATE conversations … RETURNING` in the
/// same transaction, so a rollback gives it back and the row lock orders commits per
/// conversation: seqs are gapless. S1: the INSERT runs after the row lock was granted and
/// `admin leave` takes the same lock, so its membership test sees any committed leave.
///
/// Membership is read once before the transaction, without any lock: a user with no open
/// period is answered (NOT_MEMBER, STALE_INSTALL or the earlier send's `dup`) without ever
/// queueing on the conversation's row lock, so outsiders cannot slow a conversation's
/// members. The check after the lock (in the INSERT) stays: it is the one S1 relies on. A
/// connection whose user's send to the conversation committed before skips that read
/// (`SendCtx::known_member`, one round trip less) until a NOT_MEMBER forgets it.
pub async fn send(
    pool: &PgPool,
    who: &Principal,
    conv: &str,
    cmid: &str,
    body: &str,
    ctx: SendCtx<'_>,
) -> Result<SendOutcome, WireError> {
    let SendCtx {
        observer,
        notifier,
        known_member,
    } = ctx;
    let observer = observer.unwrap_or(&Unobserved);
    if !known_member {
        if let Some(answer) = outsider(pool, who, conv, cmid, body).await {
            return answer;
        }
    }
    let (mut tx, taken) = begin_taking_seq(pool, conv, observer).await?;
    let inserted = match taken {
        None => None,
        Some(taken) => {
            let (seq, conv_epoch): (i64, i64) = (taken.get(0), taken.get(1));
            if let ControlFlow::Break(r) = faults::gate(
                points::SEND_BEFORE_INSERT,
                Ok(SendOutcome::NoReply),
                Err(WireError::Unavailable),
            )
            .await
            {
                return r;
            }
            let row = sqlx::query(&observer.insert_sql())
                .bind(conv)
                .bind(seq)
                .bind(&who.user)
                .bind(&who.device)
                .bind(cmid)
                .bind(body)
                .bind(who.epoch)
                .fetch_optional(&mut *tx)
                .await
                .map_err(db("send.insert"))?;
            row.map(|r| (seq, conv_epoch, r.get::<String, _>(0)))
        }
    };
    let Some((seq, conv_epoch, mid)) = inserted else {
        // Nothing inserted: a stale install, no such conversation, no open membership, or
        // `(user, cmid)` was used before (or by a concurrent send that just committed). Roll
        // back (the seq is given back, P1) and tell which, looking the earlier send up.
        drop(tx);
        return not_inserted(pool, who, conv, cmid, body).await;
    };
    let sent = Sent {
        seq,
        mid,
        dup: false,
        epoch: conv_epoch,
    };
    if observer.watches_uncommitted() {
        show_uncommitted(&mut tx, conv, &sent, observer).await?;
    }
    if observer.commit_after_reply() {
        commit_detached(tx, notifier.clone(), conv.to_string(), seq);
        return Ok(SendOutcome::Reply(sent));
    }
    if let ControlFlow::Break(r) = faults::gate(
        points::SEND_BEFORE_COMMIT,
        Ok(SendOutcome::NoReply),
        Err(WireError::Unavailable),
    )
    .await
    {
        return r;
    }
    tx.commit().await.map_err(db("send.commit"))?;
    // Committed: from here on the message is durable whatever happens to this process, and
    // only now may anyone be told of it (no push before its commit).
    let point = faults::gate(points::SEND_AFTER_COMMIT_BEFORE_NOTIFY, (), ()).await;
    if point.is_continue() {
        notifier.committed(conv, seq);
    } else {
        tracing::info!(
            conv,
            seq,
            "notification skipped (fault); the commit feed finds it"
        );
    }
    Ok(SendOutcome::Reply(sent))
}

/// BEGIN, and the seq with the conversation's row lock taken in the transaction (P1):
/// `None` for no such conversation. A [`SendObserver`] may have the seq taken before BEGIN
/// instead, autocommitted on the pool, so that a rollback no longer gives it back.
async fn begin_taking_seq(
    pool: &PgPool,
    conv: &str,
    observer: &dyn SendObserver,
) -> Result<
    (
        sqlx::Transaction<'static, sqlx::Postgres>,
        Option<sqlx::postgres::PgRow>,
    ),
    WireError,
> {
    let taken_early = if observer.seq_before_begin() {
        let taken = sqlx::query(TAKE_SEQ_SQL)
            .bind(conv)
            .fetch_optional(pool)
            .await
            .map_err(db("send.seq"))?;
        Some(taken)
    } else {
        None
    };
    let mut tx = pool.begin().await.map_err(db("send.begin"))?;
    let taken = match taken_early {
        Some(taken) => taken,
        None => sqlx::query(TAKE_SEQ_SQL)
            .bind(conv)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db("send.seq"))?,
    };
    Ok((tx, taken))
}

/// Shows a [`SendObserver`] the event `sent` inserted, before COMMIT, with the users with an
/// open membership, read in the transaction.
async fn show_uncommitted(
    tx: &mut sqlx::PgConnection,
    conv: &str,
    sent: &Sent,
    observer: &dyn SendObserver,
) -> Result<(), WireError> {
    let row = sqlx::query(&format!(
        "SELECT {EVENT_COLUMNS},
                ARRAY(SELECT DISTINCT m.user_id FROM memberships m
                      WHERE m.conv_id = e.conv_id AND m.to_seq IS NULL)
         FROM events e WHERE e.conv_id = $1 AND e.seq = $2"
    ))
    .bind(conv)
    .bind(sent.seq)
    .fetch_one(tx)
    .await
    .map_err(db("send.uncommitted"))?;
    observer.uncommitted(sent, &event_from(&row), &row.get::<Vec<String>, _>(9));
    Ok(())
}

/// The `send.before_commit` point and COMMIT of `tx`, in a task of their own that nobody
/// waits for (a [`SendObserver`] that breaks D1 asked for it); the notifier is told after
/// COMMIT returned, as in [`send`].
fn commit_detached(
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
    notifier: Notifier,
    conv: String,
    seq: i64,
) {
    tokio::spawn(async move {
        let point = faults::gate(points::SEND_BEFORE_COMMIT, (), ()).await;
        if point.is_continue() {
            match tx.commit().await {
                Ok(()) => notifier.committed(&conv, seq),
                Err(e) => tracing::warn!(error = %e, "commit after the reply failed"),
            }
        }
    });
}

/// The ack statement (see [`ack`]).
const ACK_SQL: &str = "WITH chk AS (
             SELECT d.install_epoch::bigint AS install_epoch,
                    EXISTS (SELECT 1 FROM memberships m
                            WHERE m.conv_id = $2 AND m.user_id = d.user_id) AS member,
                    im_visible_head($2, d.user_id) AS vhead
             FROM devices d WHERE d.device_id = $1),
         up AS (
             INSERT INTO device_cursors (device_id, conv_id, install_epoch, delivered_seq)
             SELECT $1, $2, $4::integer, $3 FROM chk
             WHERE chk.install_epoch = $4 AND chk.member AND $3 <= chk.vhead
             ON CONFLICT (device_id, conv_id) DO UPDATE
                 SET delivered_seq = GREATEST(device_cursors.delivered_seq, EXCLUDED.delivered_seq),
                     install_epoch = EXCLUDED.install_epoch,
                     updated_at = clock_timestamp()
             RETURNING delivered_seq)
         SELECT chk.install_epoch, chk.member, chk.vhead, (SELECT delivered_seq FROM up)
         FROM chk";

/// What the `cursor-overwrite` bug changes in [`ACK_SQL`]: the GREATEST merge of D4.
const CURSOR_OVERWRITE_EDITS: &[(&str, &str)] = &[(
    "GREATEST(device_cursors.delivered_seq, EXCLUDED.delivered_seq)",
    "EXCLUDED.delivered_seq",
)];

/// What the `replaced-install-acks` bug changes in [`ACK_SQL`]: the install check of the
/// write (the answer's check, in [`ack_answer`], stays).
const REPLACED_INSTALL_ACK_EDITS: &[(&str, &str)] = &[(
    "WHERE chk.install_epoch = $4 AND chk.member",
    "WHERE chk.member",
)];

/// The same in [`ACK_BATCH_SQL`].
const REPLACED_INSTALL_ACK_BATCH_EDITS: &[(&str, &str)] =
    &[("WHERE install_epoch = epoch AND member", "WHERE member")];

/// An ack statement as the build runs it: `sql`, or in the controls build with
/// `cursor-overwrite` or `replaced-install-acks` active, that bug's rewrite of it
/// (`replaced` is the latter's edit of this statement).
fn ack_sql(sql: &'static str, replaced: &[(&str, &str)]) -> Cow<'static, str> {
    if bugs::active(Bug::CursorOverwrite) {
        bugs::rewrite(sql, CURSOR_OVERWRITE_EDITS).into()
    } else if bugs::active(Bug::ReplacedInstallAcks) {
        bugs::rewrite(sql, replaced).into()
    } else {
        sql.into()
    }
}

/// `ack`: one statement that checks the install epoch, membership and the head, and upserts
/// the cursor with GREATEST, returning the merged value.
///
/// D3: this is the only writer of `delivered_seq`, and it runs only on a device ack.
/// D4: GREATEST never lowers it; an ack above the user's visible head is CURSOR_AHEAD and
/// writes nothing. S1: a user without any membership period gets NOT_MEMBER.
pub async fn ack(pool: &PgPool, who: &Principal, conv: &str, seq: i64) -> Result<i64, WireError> {
    let sql = ack_sql(ACK_SQL, REPLACED_INSTALL_ACK_EDITS);
    let row = sqlx::query(&sql)
        .bind(&who.device)
        .bind(conv)
        .bind(seq)
        .bind(who.epoch)
        .fetch_optional(pool)
        .await
        .map_err(db("ack"))?;
    let Some(row) = row else {
        return Err(WireError::Unauthenticated("device no longer exists".into()));
    };
    ack_answer(who, seq, row.get(0), row.get(1), row.get(2), row.get(3))
}

/// One ack's answer from what its statement found: the device's install epoch, whether the
/// user has any membership period, the user's visible head and the merged cursor (`None`
/// when nothing was written).
fn ack_answer(
    who: &Principal,
    seq: i64,
    install_epoch: i64,
    member: bool,
    vhead: i64,
    delivered: Option<i64>,
) -> Result<i64, WireError> {
    if install_epoch != who.epoch {
        return Err(WireError::StaleInstall);
    }
    if !member {
        return Err(WireError::NotMember);
    }
    if seq > vhead {
        return Err(WireError::CursorAhead { head: vhead });
    }
    match delivered {
        Some(d) => {
            // D4 as a hard assertion: the merged cursor is at least what was acked (GREATEST
            // never lowers it). A panic ends the process (`invariant`), not only this task.
            assert!(d >= seq, "D4 broken: merged cursor {d} below acked {seq}");
            Ok(d)
        }
        None => Err(WireError::Internal),
    }
}

/// One row of a send batch ([`send_batch`]).
pub struct BatchRow<'a> {
    pub who: &'a Principal,
    pub conv: &'a str,
    pub cmid: &'a str,
    pub body: &'a str,
}

/// A send batch's open transaction, between [`send_batch_insert`] and
/// [`send_batch_commit`]. Dropping it rolls the batch back.
pub type BatchTx = sqlx::Transaction<'static, sqlx::Postgres>;

/// What a send batch did with one of its rows ([`send_batch_insert`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowOutcome {
    /// Inserted its event, at this seq (answered once the batch committed, D1).
    Inserted(Sent),
    /// Inserted nothing: a resend (`dup`), CMID_CONFLICT, NOT_MEMBER or STALE_INSTALL, told
    /// apart after COMMIT ([`not_inserted`]).
    NotInserted,
    /// Its conversation was locked by another transaction: skipped, without a seq, to be
    /// sent on its own ([`send`]) so that no other row waits for that lock.
    Busy,
}

/// Group commit (issue 19), held open: BEGIN; `im_send_batch` (migrations 0004, 0005) with
/// the rows as arrays; COMMIT ([`send_batch_commit`]): three round trips and one WAL flush
/// for the whole batch. Returns the open transaction and, per row in the order given, what
/// the batch did with it ([`RowOutcome`]). P1, S1 and D2 hold per row inside
/// `im_send_batch` exactly as in [`send`]; a row whose conversation another transaction
/// holds is skipped (`Busy`), never waited for. An error: nothing of the batch was stored.
/// `batch` takes this form only while a fault point inside the transaction is armed;
/// otherwise [`send_batch_statement`], the same statement in one round trip.
pub async fn send_batch_insert(
    pool: &PgPool,
    rows: &[BatchRow<'_>],
) -> Result<(BatchTx, Vec<RowOutcome>), WireError> {
    let mut tx = pool.begin().await.map_err(db("batch.begin"))?;
    let inserted = batch_query(rows)
        .fetch_all(&mut *tx)
        .await
        .map_err(db("batch.insert"))?;
    Ok((tx, outcomes(rows.len(), inserted)?))
}

/// Group commit in one round trip (issue 44): `im_send_batch` as a single statement in its
/// own implicit transaction, which PostgreSQL commits (and, with `synchronous_commit = on`,
/// flushes) before it reports the statement done. D1: this returns only after sqlx read
/// the statement's ReadyForQuery, which comes after that commit; a failed commit is the
/// statement's error. An error: the batch's fate is unknown (the caller sends each row
/// again on its own, and D2 answers a row that did commit with its seq). Same rows, same
/// outcomes as [`send_batch_insert`] then [`send_batch_commit`], without the BEGIN and
/// COMMIT round trips.
pub async fn send_batch_statement(
    pool: &PgPool,
    rows: &[BatchRow<'_>],
) -> Result<Vec<RowOutcome>, WireError> {
    let inserted = batch_query(rows)
        .fetch_all(pool)
        .await
        .map_err(db("batch.statement"))?;
    outcomes(rows.len(), inserted)
}

/// `im_send_batch` over `rows`, as arrays in row order.
fn batch_query<'q>(
    rows: &[BatchRow<'q>],
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    let convs: Vec<&str> = rows.iter().map(|r| r.conv).collect();
    let users: Vec<&str> = rows.iter().map(|r| r.who.user.as_str()).collect();
    let devices: Vec<&str> = rows.iter().map(|r| r.who.device.as_str()).collect();
    let cmids: Vec<&str> = rows.iter().map(|r| r.cmid).collect();
    let bodies: Vec<&str> = rows.iter().map(|r| r.body).collect();
    let epochs: Vec<i64> = rows.iter().map(|r| r.who.epoch).collect();
    sqlx::query("SELECT k, seq, mid, conv_epoch FROM im_send_batch($1, $2, $3, $4, $5, $6)")
        .bind(convs)
        .bind(users)
        .bind(devices)
        .bind(epochs)
        .bind(cmids)
        .bind(bodies)
}

/// What `im_send_batch` did with each of `n` rows, in row order, from its result (`k` is
/// a row's 1-based place; a row it did not return inserted nothing; a null seq: busy).
fn outcomes(n: usize, inserted: Vec<sqlx::postgres::PgRow>) -> Result<Vec<RowOutcome>, WireError> {
    let mut out: Vec<RowOutcome> = vec![RowOutcome::NotInserted; n];
    for r in inserted {
        let k: i32 = r.get(0);
        let slot = usize::try_from(k - 1)
            .ok()
            .and_then(|i| out.get_mut(i))
            .ok_or(WireError::Internal)?;
        let seq: Option<i64> = r.get(1);
        *slot = match seq {
            Some(seq) => RowOutcome::Inserted(Sent {
                seq,
                mid: r.get(2),
                dup: false,
                epoch: r.get(3),
            }),
            None => RowOutcome::Busy,
        };
    }
    Ok(out)
}

/// The batch's COMMIT, behind the `send.batch.before_commit` point. Returns the rows of
/// [`send_batch_insert`] only after COMMIT returned (D1); `Ok(None)` when the point dropped
/// the batch (rolled back, no reply); an error when the point failed it or COMMIT failed
/// (rolled back, or unknown: the caller sends each row again on its own, and D2 answers a
/// row that did commit with its seq).
pub async fn send_batch_commit(
    tx: BatchTx,
    out: Vec<RowOutcome>,
) -> Result<Option<Vec<RowOutcome>>, WireError> {
    let rolled_back = match faults::gate(
        points::SEND_BATCH_BEFORE_COMMIT,
        Ok(None),
        Err(WireError::Unavailable),
    )
    .await
    {
        ControlFlow::Continue(()) => match tx.commit().await.map_err(db("batch.commit")) {
            Ok(()) => return Ok(Some(out)),
            Err(e) => Err(e),
        },
        // Dropping `tx` rolls the batch back.
        ControlFlow::Break(r) => r,
    };
    if bugs::active(Bug::BatchReplyRolledBack) {
        return Ok(Some(out));
    }
    rolled_back
}

/// [`send_batch_insert`] then [`send_batch_commit`].
pub async fn send_batch(
    pool: &PgPool,
    rows: &[BatchRow<'_>],
) -> Result<Option<Vec<RowOutcome>>, WireError> {
    let (tx, out) = send_batch_insert(pool, rows).await?;
    send_batch_commit(tx, out).await
}

/// One ack of an ack batch ([`ack_batch`]).
pub struct AckRow<'a> {
    pub who: &'a Principal,
    pub conv: &'a str,
    pub seq: i64,
}

/// The ack batch statement (see [`ack_batch`]): the rows as arrays, the install and
/// membership checks and the visible head set-based and inline (no function call per row),
/// one upsert per `(device, conversation)` with the highest valid seq, GREATEST kept.
const ACK_BATCH_SQL: &str = "WITH req AS (
             SELECT r.k::integer AS k, r.device_id, r.conv_id, r.seq, r.epoch
             FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[])
                  WITH ORDINALITY AS r(device_id, conv_id, seq, epoch, k)),
         chk AS (
             SELECT q.k, q.device_id, q.conv_id, q.seq, q.epoch,
                    d.install_epoch::bigint AS install_epoch,
                    COALESCE(v.member, false) AS member, COALESCE(v.vhead, 0) AS vhead
             FROM req q
             LEFT JOIN devices d ON d.device_id = q.device_id
             LEFT JOIN LATERAL (
                 SELECT count(*) > 0 AS member,
                        COALESCE(MAX(p.last_seq) FILTER (WHERE p.from_seq <= p.last_seq), 0)
                            AS vhead
                 FROM (SELECT LEAST(c.next_seq - 1, COALESCE(m.to_seq - 1, c.next_seq - 1))
                                  AS last_seq,
                              m.from_seq
                       FROM memberships m JOIN conversations c ON c.conv_id = m.conv_id
                       WHERE m.conv_id = q.conv_id AND m.user_id = d.user_id) p) v ON true),
         ok AS (
             SELECT device_id, conv_id, MAX(seq) AS seq, MAX(epoch) AS epoch
             FROM chk
             WHERE install_epoch = epoch AND member AND seq <= vhead
             GROUP BY device_id, conv_id),
         up AS (
             INSERT INTO device_cursors (device_id, conv_id, install_epoch, delivered_seq)
             SELECT device_id, conv_id, epoch::integer, seq FROM ok
             ORDER BY device_id, conv_id
             ON CONFLICT (device_id, conv_id) DO UPDATE
                 SET delivered_seq = GREATEST(device_cursors.delivered_seq, EXCLUDED.delivered_seq),
                     install_epoch = EXCLUDED.install_epoch,
                     updated_at = clock_timestamp()
             RETURNING device_id, conv_id, delivered_seq)
         SELECT c.k, c.install_epoch, c.member, c.vhead, u.delivered_seq
         FROM chk c LEFT JOIN up u ON u.device_id = c.device_id AND u.conv_id = c.conv_id
         ORDER BY c.k";

/// Acks in one statement (issue 19): per ack, in the order given, the answer [`ack`] would
/// give (`acked` with the merged cursor, CURSOR_AHEAD, NOT_MEMBER, STALE_INSTALL). D3/D4
/// as in [`ack`]: only acks write `delivered_seq`, and GREATEST never lowers it; two acks of
/// one `(device, conversation)` in a batch are merged into one upsert of the higher seq,
/// and both are answered with the merged cursor. An error fails the whole statement:
/// nothing was written, and the caller answers each ack on its own.
pub async fn ack_batch(
    pool: &PgPool,
    rows: &[AckRow<'_>],
) -> Result<Vec<Result<i64, WireError>>, WireError> {
    let sql = ack_sql(ACK_BATCH_SQL, REPLACED_INSTALL_ACK_BATCH_EDITS);
    let devices: Vec<&str> = rows.iter().map(|r| r.who.device.as_str()).collect();
    let convs: Vec<&str> = rows.iter().map(|r| r.conv).collect();
    let seqs: Vec<i64> = rows.iter().map(|r| r.seq).collect();
    let epochs: Vec<i64> = rows.iter().map(|r| r.who.epoch).collect();
    let found = sqlx::query(&sql)
        .bind(&devices)
        .bind(&convs)
        .bind(&seqs)
        .bind(&epochs)
        .fetch_all(pool)
        .await
        .map_err(db("ack.batch"))?;
    if found.len() != rows.len() {
        tracing::error!(
            rows = rows.len(),
            found = found.len(),
            "ack batch: one answer per ack expected"
        );
        return Err(WireError::Internal);
    }
    Ok(rows
        .iter()
        .zip(found)
        .map(|(r, f)| {
            let install_epoch: Option<i64> = f.get(1);
            match install_epoch {
                None => Err(WireError::Unauthenticated("device no longer exists".into())),
                Some(e) => ack_answer(r.who, r.seq, e, f.get(2), f.get(3), f.get(4)),
            }
        })
        .collect())
}

/// `sub`: every conversation the user has a membership period in, with head and cursor,
/// and how many times the database's lineage moved (issue 21: a device holding a
/// conversation not listed learns from it that the conversation's epoch moved). Every
/// connection of the pool checked the lineage of its server before serving anything
/// (`crate::lineage`), so the count read here is that of the server the epochs are read on.
pub async fn conv_states(
    pool: &PgPool,
    who: &Principal,
    max: i64,
) -> Result<(Vec<ConvHead>, i64), WireError> {
    check_install(pool, who).await?;
    let lineage: i64 = sqlx::query_scalar(
        "SELECT COALESCE((SELECT moves FROM db_lineage WHERE id = 1), 0)::bigint",
    )
    .fetch_one(pool)
    .await
    .map_err(db("sub.lineage"))?;
    let rows = sqlx::query(
        "SELECT m.conv_id, im_visible_head(m.conv_id, $1), COALESCE(dc.delivered_seq, 0),
                c.epoch::bigint
         FROM (SELECT DISTINCT conv_id FROM memberships WHERE user_id = $1) m
         JOIN conversations c ON c.conv_id = m.conv_id
         LEFT JOIN device_cursors dc ON dc.device_id = $2 AND dc.conv_id = m.conv_id
         ORDER BY m.conv_id LIMIT $3",
    )
    .bind(&who.user)
    .bind(&who.device)
    .bind(max)
    .fetch_all(pool)
    .await
    .map_err(db("sub"))?;
    let convs = rows
        .into_iter()
        .map(|r| ConvHead {
            conv: r.get(0),
            head: r.get(1),
            delivered: r.get(2),
            epoch: r.get(3),
        })
        .collect();
    Ok((convs, lineage))
}

/// An event's columns as [`event_from`] reads them: the row, and its conversation's epoch
/// as this statement reads it (issue 21).
const EVENT_COLUMNS: &str = "e.conv_id, e.seq, e.kind, e.mid, e.sender_user, e.cmid, e.body,
     (extract(epoch FROM e.at) * 1000)::bigint,
     (SELECT c.epoch::bigint FROM conversations c WHERE c.conv_id = e.conv_id)";

fn event_from(r: &sqlx::postgres::PgRow) -> Event {
    Event {
        conv: r.get(0),
        seq: r.get(1),
        kind: r.get(2),
        mid: r.get(3),
        sender: r.get(4),
        cmid: r.get(5),
        body: r.get(6),
        at_ms: r.get(7),
        epoch: r.get(8),
    }
}

/// A sync page: visible events with `seq > after`, ascending, at most `limit`.
#[derive(Debug)]
pub struct Page {
    pub events: Vec<Event>,
    pub head: i64,
    pub complete: bool,
}

/// `sync` (S1: only events inside the user's membership periods), at most `limit` events
/// and about `page_max_bytes` of JSON. The head is read first
/// and the page is bounded by it, so `complete` never claims an event committed after the
/// head was read: a client may set its cursor to `head` when `complete` is true.
pub async fn sync(
    pool: &PgPool,
    who: &Principal,
    conv: &str,
    after: i64,
    limit: i64,
    page_max_bytes: usize,
) -> Result<Page, WireError> {
    let row = sqlx::query(
        "SELECT EXISTS (SELECT 1 FROM memberships WHERE conv_id = $1 AND user_id = $2),
                im_visible_head($1, $2),
                (SELECT install_epoch::bigint FROM devices WHERE device_id = $3)",
    )
    .bind(conv)
    .bind(&who.user)
    .bind(&who.device)
    .fetch_one(pool)
    .await
    .map_err(db("sync.head"))?;
    let (member, head, epoch): (bool, i64, Option<i64>) = (row.get(0), row.get(1), row.get(2));
    if epoch != Some(who.epoch) {
        return Err(WireError::StaleInstall);
    }
    if !member {
        return Err(WireError::NotMember);
    }
    // Streamed, not fetched whole: 500 rows of 16 KB bodies would be 8 MB in memory at
    // once; the page stops at `page_max_bytes`, so at most that much is held (plus one row).
    let page_sql = format!(
        "SELECT {EVENT_COLUMNS} FROM events e
         WHERE e.conv_id = $1 AND e.seq > $2 AND e.seq <= $3
           AND EXISTS (SELECT 1 FROM memberships m
                       WHERE m.conv_id = e.conv_id AND m.user_id = $4 AND m.from_seq <= e.seq
                         AND (m.to_seq IS NULL OR e.seq < m.to_seq))
         ORDER BY e.seq LIMIT $5"
    );
    let mut rows = sqlx::query(&page_sql)
        .bind(conv)
        .bind(after)
        .bind(head)
        .bind(&who.user)
        .bind(limit + 1)
        .fetch(pool);
    let mut complete = true;
    let mut events = Vec::new();
    let mut bytes = 0usize;
    while let Some(r) = rows.try_next().await.map_err(db("sync.page"))? {
        if events.len() as i64 == limit {
            complete = false;
            break;
        }
        let ev = event_from(&r);
        // Bodies are at most IM_BODY_MAX_BYTES, but 500 of them (escaped) could make a frame
        // of tens of MB: a page also stops at `page_max_bytes`, always keeping one event.
        let len = ev.to_json().to_string().len();
        if bytes + len > page_max_bytes && !events.is_empty() {
            complete = false;
            break;
        }
        bytes += len;
        events.push(ev);
    }
    drop(rows);
    assert_page_order(&events, after, head);
    if bugs::active(Bug::CursorOnSync) {
        if let Some(last) = events.last() {
            // The server moves the cursor itself, without a device ack.
            sqlx::query(
                "INSERT INTO device_cursors (device_id, conv_id, install_epoch, delivered_seq)
                 VALUES ($1, $2, $3::integer, $4)
                 ON CONFLICT (device_id, conv_id) DO UPDATE
                     SET delivered_seq = GREATEST(device_cursors.delivered_seq, EXCLUDED.delivered_seq),
                         install_epoch = EXCLUDED.install_epoch,
                         updated_at = clock_timestamp()",
            )
            .bind(&who.device)
            .bind(conv)
            .bind(who.epoch)
            .bind(last.seq)
            .execute(pool)
            .await
            .map_err(db("sync.cursor"))?;
        }
    }
    Ok(Page {
        events,
        head,
        complete,
    })
}

/// D3, paired with the page query: a page holds events in strictly ascending seq order,
/// all within `(after, head]`. A client stores the page and acks up to its last event (or
/// `head` when complete): an event out of order or past the head read first would make it
/// ack what it does not hold. The query's `WHERE seq > after AND seq <= head ORDER BY seq`
/// and the `(conv_id, seq)` primary key guarantee it; a panic ends the process.
fn assert_page_order(events: &[Event], after: i64, head: i64) {
    let mut prev = after;
    for e in events {
        assert!(
            e.seq > prev && e.seq <= head,
            "D3 broken: sync page of {} after {after} up to head {head} holds seq {} after {prev}",
            e.conv,
            e.seq
        );
        prev = e.seq;
    }
}

/// What the `s1-leak` bug removes from the fan-out audience: the membership period test.
const S1_LEAK_EDITS: &[(&str, &str)] = &[
    ("AND m.from_seq <= e.seq", ""),
    ("AND (m.to_seq IS NULL OR e.seq < m.to_seq)", ""),
];

fn events_with_audience_sql() -> String {
    format!(
        "SELECT {EVENT_COLUMNS}, a.users,
                ARRAY(SELECT d.device_id || ':' || d.install_epoch FROM devices d
                      WHERE d.user_id = ANY (a.users))
         FROM unnest($1::text[], $2::bigint[], $3::bigint[]) AS r(conv_id, after, upto)
         CROSS JOIN LATERAL (
             SELECT * FROM events e
             WHERE e.conv_id = r.conv_id AND e.seq > r.after AND e.seq <= r.upto
             OFFSET 0) e
         CROSS JOIN LATERAL (
             SELECT ARRAY(SELECT DISTINCT m.user_id FROM memberships m
                          WHERE m.conv_id = e.conv_id AND m.from_seq <= e.seq
                            AND (m.to_seq IS NULL OR e.seq < m.to_seq)) AS users) a
         ORDER BY e.conv_id, e.seq"
    )
}

/// Who may get one event now: the users whose membership covers it (S1) and their
/// devices' current installs as `device:epoch`.
#[derive(Debug)]
pub struct Audience {
    pub users: Vec<String>,
    pub installs: std::collections::HashSet<String>,
}

/// One range of a fan-out read: the events of `conv` with `after < seq <= upto`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Range {
    pub conv: String,
    pub after: i64,
    pub upto: i64,
}

/// Fan-out read, one query for a whole batch of notifications: the events of every range,
/// ordered by (conv, seq), each with every user who may see it now (S1) and their devices'
/// current installs: a connection of an install made stale by a reinstall that committed
/// before this read gets nothing, even before the reinstall's notification closed it.
///
/// A notified `conv:seq` is committed, and so is every lower seq of the conversation (P1:
/// seqs are taken under the row lock held until COMMIT, and a rollback gives its seq
/// back), so a range up to a notified seq reads only committed events. Each range is read
/// on its own through the `(conv_id, seq)` key (`OFFSET 0` keeps the planner from joining
/// the ranges with the whole table: a hash join over `events` took 170 ms a read).
pub async fn events_with_audience(
    pool: &PgPool,
    ranges: &[Range],
) -> Result<Vec<(Event, Audience)>, sqlx::Error> {
    let mut sql = events_with_audience_sql();
    if bugs::active(Bug::S1Leak) {
        sql = bugs::rewrite(&sql, S1_LEAK_EDITS);
    }
    let convs: Vec<&str> = ranges.iter().map(|r| r.conv.as_str()).collect();
    let after: Vec<i64> = ranges.iter().map(|r| r.after).collect();
    let upto: Vec<i64> = ranges.iter().map(|r| r.upto).collect();
    let rows = sqlx::query(&sql)
        .bind(&convs)
        .bind(&after)
        .bind(&upto)
        .fetch_all(pool)
        .await?;
    Ok(rows
        .iter()
        .map(|r| {
            let audience = Audience {
                users: r.get::<Vec<String>, _>(9),
                installs: r.get::<Vec<String>, _>(10).into_iter().collect(),
            };
            (event_from(r), audience)
        })
        .collect())
}

/// Where the commit feed last looked: a snapshot as `pg_current_snapshot()` renders it
/// (`xmin:xmax:xip,…`), only ever handed back to [`commits_since`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeedMark(String);

/// What one look of the commit feed found: per conversation, the lowest and highest seq
/// committed since the previous mark.
pub type FeedRow = (String, i64, i64);

/// The commit feed's query. One statement, so its snapshot and the mark it returns are one:
/// the events whose transaction `$1` did not see (`pg_visible_in_snapshot`) and this
/// statement does, i.e. committed in between, exactly, whatever order transactions took
/// their xids or committed in. The `events_xid_idx` range scan starts at `$1`'s xmin (every
/// transaction `$1` did not see is at or above it). At most `$2` conversations (the caller
/// asks for one more to tell that the list was cut).
const COMMITS_SINCE_SQL: &str = "
SELECT pg_current_snapshot()::text, NULL::text, NULL::bigint, NULL::bigint
UNION ALL
(SELECT NULL, e.conv_id, min(e.seq), max(e.seq) FROM events e
 WHERE e.xid >= pg_snapshot_xmin($1::text::pg_snapshot)
   AND NOT pg_visible_in_snapshot(e.xid, $1::text::pg_snapshot)
 GROUP BY e.conv_id
 LIMIT $2)";

/// What the `feed-window` bug changes in [`COMMITS_SINCE_SQL`]: every transaction id below
/// the mark's `xmax` is taken as seen, those in flight when the mark was taken included.
const FEED_WINDOW_EDITS: &[(&str, &str)] = &[(
    "WHERE e.xid >= pg_snapshot_xmin($1::text::pg_snapshot)
   AND NOT pg_visible_in_snapshot(e.xid, $1::text::pg_snapshot)",
    "WHERE e.xid >= pg_snapshot_xmax($1::text::pg_snapshot)",
)];

/// The commit feed's first mark of a LISTEN session, taken on that connection just before
/// its LISTEN (`fanout::listen`).
pub async fn feed_mark(
    conn: impl sqlx::Executor<'_, Database = sqlx::Postgres>,
) -> Result<FeedMark, sqlx::Error> {
    let mark: String = sqlx::query_scalar("SELECT pg_current_snapshot()::text")
        .fetch_one(conn)
        .await?;
    Ok(FeedMark(mark))
}

/// The commit feed (D5, on every gateway): the events committed since `since` was taken,
/// as one [`FeedRow`] per conversation (at most `max`; `None` when more conversations than
/// that committed, so the caller must look some other way), and the mark to ask from next
/// time.
///
/// A notification that never came (the committing gateway's NOTIFY failed or was never
/// sent, or that gateway died between COMMIT and NOTIFY) is thereby found by every gateway,
/// wherever the event's audience is connected.
pub async fn commits_since(
    pool: &PgPool,
    since: &FeedMark,
    max: usize,
) -> Result<(FeedMark, Option<Vec<FeedRow>>), sqlx::Error> {
    let sql: Cow<'static, str> = if bugs::active(Bug::FeedWindow) {
        bugs::rewrite(COMMITS_SINCE_SQL, FEED_WINDOW_EDITS).into()
    } else {
        COMMITS_SINCE_SQL.into()
    };
    let rows = sqlx::query(&sql)
        .bind(&since.0)
        .bind(i64::try_from(max.saturating_add(1)).unwrap_or(i64::MAX))
        .fetch_all(pool)
        .await?;
    let mut mark = None;
    let mut found = Vec::new();
    for r in rows {
        match r.get::<Option<String>, _>(0) {
            Some(m) => mark = Some(FeedMark(m)),
            None => found.push((r.get(1), r.get(2), r.get(3))),
        }
    }
    let mark =
        mark.ok_or_else(|| sqlx::Error::Protocol("the commit feed returned no mark".into()))?;
    Ok((mark, (found.len() <= max).then_some(found)))
}

/// The tail every sweep query shares: from `pairs(device_id, epoch, user_id, conv_id)`
/// (current installs only), the pairs whose cursor is below the user's visible head (S1),
/// with that head. The visible head is `im_visible_head` asked set-based (one join and
/// GROUP BY over the pairs' periods instead of one function call per pair): the largest
/// period end not before the period's start, 0 when there is none. After a `leave` it stops
/// where the user's period ended, so no hint ever points past what the user could see.
const LAGGING_TAIL: &str = "
     heads AS (
         SELECT p.device_id, p.epoch, p.conv_id,
                COALESCE(MAX(LEAST(c.next_seq - 1, COALESCE(m.to_seq - 1, c.next_seq - 1)))
                         FILTER (WHERE m.from_seq <= LEAST(c.next_seq - 1, COALESCE(m.to_seq - 1, c.next_seq - 1))),
                         0) AS vhead
         FROM pairs p
         JOIN memberships m ON m.conv_id = p.conv_id AND m.user_id = p.user_id
         JOIN conversations c ON c.conv_id = p.conv_id
         GROUP BY p.device_id, p.epoch, p.conv_id)
SELECT h.device_id, h.epoch, h.conv_id, h.vhead FROM heads h
LEFT JOIN device_cursors dc ON dc.device_id = h.device_id AND dc.conv_id = h.conv_id
WHERE COALESCE(dc.delivered_seq, 0) < h.vhead";

/// `pairs` of [`lagging_of_installs`]: every conversation of each current install's user.
const INSTALLS_PAIRS: &str = "
WITH subs AS (SELECT DISTINCT * FROM unnest($1::text[], $2::text[], $3::bigint[]) AS s(device_id, user_id, epoch)),
     pairs AS (
         SELECT DISTINCT s.device_id, s.epoch, s.user_id, m.conv_id
         FROM subs s
         JOIN devices d ON d.device_id = s.device_id AND d.install_epoch = s.epoch
         JOIN memberships m ON m.user_id = s.user_id),";

/// `pairs` of [`lagging_in_convs`]: every current install of every member of the given
/// conversations.
const CONVS_PAIRS: &str = "
WITH pairs AS (
         SELECT DISTINCT d.device_id, d.install_epoch::bigint AS epoch, m.user_id, m.conv_id
         FROM memberships m JOIN devices d ON d.user_id = m.user_id
         WHERE m.conv_id = ANY ($1::text[])),";

/// What the `hint-past-leave` bug changes in [`LAGGING_TAIL`]: the end of a closed period
/// in the visible head (the filter that drops empty periods stays).
const HINT_PAST_LEAVE_EDITS: &[(&str, &str)] = &[(
    "MAX(LEAST(c.next_seq - 1, COALESCE(m.to_seq - 1,",
    "MAX(LEAST(c.next_seq - 1, COALESCE(m.to_seq,",
)];

/// The SQL of a sweep query: `pairs` (one of the three above) and [`LAGGING_TAIL`].
pub fn lagging_sql(pairs: &str) -> String {
    if bugs::active(Bug::HintPastLeave) {
        return format!(
            "{pairs}{}",
            bugs::rewrite(LAGGING_TAIL, HINT_PAST_LEAVE_EDITS)
        );
    }
    format!("{pairs}{LAGGING_TAIL}")
}

/// [`lagging_of_pairs`]: of the given pushed pairs, those of current installs whose cursor
/// is below the pushed seq. One probe of `devices` and one of `device_cursors` per pair: no
/// visible head is computed, since a pushed seq was visible to the user when fan-out read
/// its audience (S1), and a later `leave` ends the period at a head at or above it.
const PUSHED_SQL: &str = "
WITH pairs AS (SELECT device_id, epoch, conv_id, MAX(seq) AS seq
               FROM unnest($1::text[], $2::bigint[], $3::text[], $4::bigint[]) AS p(device_id, epoch, conv_id, seq)
               GROUP BY 1, 2, 3)
SELECT p.device_id, p.epoch, p.conv_id, p.seq FROM pairs p
JOIN devices d ON d.device_id = p.device_id AND d.install_epoch = p.epoch
LEFT JOIN device_cursors dc ON dc.device_id = p.device_id AND dc.conv_id = p.conv_id
WHERE COALESCE(dc.delivered_seq, 0) < p.seq";

/// The statements of the sweep (for the bench's EXPLAIN and `pg_stat_statements` labels).
pub fn sweep_sql() -> [(&'static str, String); 3] {
    [
        ("installs", lagging_sql(INSTALLS_PAIRS)),
        ("pairs", PUSHED_SQL.to_string()),
        ("convs", lagging_sql(CONVS_PAIRS)),
    ]
}

/// One lagging pair as the sweep queries return it: device, install epoch, conversation,
/// visible head.
pub type LaggingRow = (String, i64, String, i64);

fn lagging_rows(rows: Vec<sqlx::postgres::PgRow>) -> Vec<LaggingRow> {
    rows.into_iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect()
}

/// Sweep (D5), by install: for the given `(device, user, epoch)` installs (a page of the
/// full pass, or newly subscribed ones), every conversation where the device's cursor is
/// below the user's visible head, for installs that are still current (read in the same
/// query, so a reinstall committed before it gets no hint).
pub async fn lagging_of_installs(
    pool: &PgPool,
    devices: &[String],
    users: &[String],
    epochs: &[i64],
) -> Result<Vec<LaggingRow>, sqlx::Error> {
    let rows = sqlx::query(&lagging_sql(INSTALLS_PAIRS))
        .bind(devices)
        .bind(users)
        .bind(epochs)
        .fetch_all(pool)
        .await?;
    Ok(lagging_rows(rows))
}

/// Sweep (D5), by pair: of the given `(device, epoch, conv, seq)` pairs (fan-out pushed
/// `seq` and no ack reached it since the last sweep), those still lagging: the install is
/// current and its cursor is below the pushed seq, returned as the head to hint (see
/// `PUSHED_SQL`). Ordered input (by device, conversation) reads the indexes in order.
pub async fn lagging_of_pairs(
    pool: &PgPool,
    devices: &[String],
    epochs: &[i64],
    convs: &[String],
    seqs: &[i64],
) -> Result<Vec<LaggingRow>, sqlx::Error> {
    let rows = sqlx::query(PUSHED_SQL)
        .bind(devices)
        .bind(epochs)
        .bind(convs)
        .bind(seqs)
        .fetch_all(pool)
        .await?;
    Ok(lagging_rows(rows))
}

/// Sweep (D5), by conversation: in the given conversations (whose notified event fan-out
/// could not read), every lagging pair of every member's current install. The caller keeps
/// the subscribed ones.
pub async fn lagging_in_convs(
    pool: &PgPool,
    convs: &[String],
) -> Result<Vec<LaggingRow>, sqlx::Error> {
    let rows = sqlx::query(&lagging_sql(CONVS_PAIRS))
        .bind(convs)
        .fetch_all(pool)
        .await?;
    Ok(lagging_rows(rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(seqs: &[i64]) -> Vec<Event> {
        seqs.iter()
            .map(|&seq| Event {
                conv: "c1".into(),
                seq,
                kind: "msg".into(),
                mid: String::new(),
                sender: "u".into(),
                cmid: String::new(),
                body: String::new(),
                at_ms: 0,
                epoch: 1,
            })
            .collect()
    }

    /// D3's paired check accepts what the page query returns (ascending, gaps where the
    /// user could not see, within `(after, head]`, or nothing) and refuses anything else.
    #[test]
    fn page_order_is_ascending_within_after_and_head() {
        assert_page_order(&page(&[3, 4, 7]), 2, 7);
        assert_page_order(&page(&[]), 9, 4);
        for (seqs, after, head) in [
            (&[3, 3][..], 0, 5),
            (&[4, 3][..], 0, 5),
            (&[2][..], 2, 5),
            (&[6][..], 2, 5),
        ] {
            let r = std::panic::catch_unwind(|| assert_page_order(&page(seqs), after, head));
            assert!(
                r.is_err(),
                "{seqs:?} after {after} head {head} must be refused"
            );
        }
    }

    /// Notification payloads: `conv:seq` lines, in the order given, none over the limit,
    /// every pair in exactly one payload.
    #[test]
    fn payloads_are_lines_within_the_limit() {
        assert!(payloads(&[]).is_empty());
        let p = payloads(&[("c1".into(), 7), ("c-2".into(), 1), ("c1".into(), 8)]);
        assert_eq!(p, vec!["c1:7\nc-2:1\nc1:8".to_string()]);
        let many: Vec<(String, i64)> = (0..2000).map(|i| (format!("conv-{i}"), i)).collect();
        let p = payloads(&many);
        assert!(p.len() > 1 && p.iter().all(|x| x.len() <= PAYLOAD_MAX_BYTES));
        let back: Vec<String> = p.iter().flat_map(|x| x.lines()).map(String::from).collect();
        let want: Vec<String> = many.iter().map(|(c, s)| format!("{c}:{s}")).collect();
        assert_eq!(back, want);
    }

    /// Payloads are as full as the limit allows and never over it: for random lists of
    /// `conv:seq` lines (ids of every length the protocol allows), every payload is at
    /// most [`PAYLOAD_MAX_BYTES`] and could not have taken the next payload's first line
    /// too, and the lines come back in order, each once.
    #[test]
    fn payloads_fill_up_to_the_limit_and_never_past_it() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for _ in 0..200 {
            let pairs: Vec<(String, i64)> = (0..(1 + next(3000)))
                .map(|_| ("c".repeat(1 + next(64) as usize), next(1 << 40) as i64))
                .collect();
            let p = payloads(&pairs);
            for (i, x) in p.iter().enumerate() {
                assert!(
                    x.len() <= PAYLOAD_MAX_BYTES,
                    "payload {i}: {} bytes",
                    x.len()
                );
                if let Some(following) = p.get(i + 1) {
                    let first = following.lines().next().unwrap_or_default();
                    assert!(
                        x.len() + 1 + first.len() > PAYLOAD_MAX_BYTES,
                        "payload {i} ({} bytes) had room for {first:?}",
                        x.len()
                    );
                }
            }
            let back: Vec<String> = p.iter().flat_map(|x| x.lines()).map(String::from).collect();
            let want: Vec<String> = pairs.iter().map(|(c, s)| format!("{c}:{s}")).collect();
            assert_eq!(back, want);
        }
    }

    /// Every bug's rewrite still applies to the statement it edits (each fragment exactly
    /// once), in both builds, so an edit of the SQL cannot silently disarm a bug.
    #[test]
    fn bug_rewrites_apply() {
        let s = bugs::rewrite(SEND_INSERT_SQL, NO_DEDUP_EDITS);
        assert!(!s.contains("ON CONFLICT"), "{s}");
        let s = bugs::rewrite(ACK_SQL, CURSOR_OVERWRITE_EDITS);
        assert!(
            !s.contains("GREATEST") && s.contains("SET delivered_seq = EXCLUDED.delivered_seq")
        );
        for (sql, edits) in [
            (ACK_SQL, REPLACED_INSTALL_ACK_EDITS),
            (ACK_BATCH_SQL, REPLACED_INSTALL_ACK_BATCH_EDITS),
        ] {
            let s = bugs::rewrite(sql, CURSOR_OVERWRITE_EDITS);
            assert!(!s.contains("GREATEST"), "{s}");
            let s = bugs::rewrite(sql, edits);
            assert!(
                s.contains("WHERE") && !s.contains("= epoch AND") && !s.contains("= $4 AND"),
                "{s}"
            );
        }
        let s = bugs::rewrite(COMMITS_SINCE_SQL, FEED_WINDOW_EDITS);
        assert!(!s.contains("pg_visible_in_snapshot"), "{s}");
        let s = bugs::rewrite(STALE_INSTALLS_SQL, GONE_DEVICE_STAYS_EDITS);
        assert!(!s.contains("DISTINCT"), "{s}");
        let s = bugs::rewrite(LAGGING_TAIL, HINT_PAST_LEAVE_EDITS);
        assert!(s.contains("COALESCE(m.to_seq, c.next_seq - 1)))"), "{s}");
        let s = bugs::rewrite(&events_with_audience_sql(), S1_LEAK_EDITS);
        assert!(!s.contains("from_seq") && !s.contains("to_seq"), "{s}");
    }
}
