//! Group commit (issue 19): sends and acks from any connections of this gateway are
//! gathered into batches, one transaction (sends) or one statement (acks) each.
//!
//! Owns: the queues, the batch slots (tasks that each run one batch at a time), the order
//! of a batch, and the fallback row by row when a batch fails.
//! Must not: reply to a client itself (it answers the request's task through a oneshot,
//! and that task replies), or hold a batch open waiting for more: a batch takes what is
//! queued when a slot is free, never waits on a timer (no wait when idle).
//!
//! D1: a send's `Sent` is handed back only after its batch's COMMIT returned; a batch that
//! failed before or at COMMIT hands back nothing of its own: every row is sent again on
//! its own ([`store::send`]), where D2 answers a row that did commit with its seq (`dup`),
//! so no innocent row fails because another row broke the batch, and no row is answered
//! for a rolled-back insert.
//! P1, S1, D2 per row: `im_send_batch` (migrations 0004, 0005) applies the single send's
//! rules row by row in one transaction. A row whose conversation another transaction holds
//! is not waited for: the batch skips it (`Busy`) and it is sent on its own, off the slot,
//! so that no other row, and no later batch, waits for that lock.
//!
//! Bounded: a slot queues at most `queue` jobs; a request waits for its job at most until
//! its database deadline, and a job whose request stopped waiting is dropped before any
//! database work (a stall piles up nothing for requests that are gone).

use crate::bugs::{self, Bug};
use crate::error::WireError;
use crate::faults::{self, points};
use crate::store::{self, Notifier, Principal, RowOutcome, SendOutcome, Sent};
use sqlx::PgPool;
use std::future::Future;
use std::ops::ControlFlow;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// The batch slots, each with its own queue; a job goes to the slot its key picks.
///
/// One key, one slot: a conversation's sends (a device's acks) always go to the same slot,
/// so two batches of this gateway never contend for a conversation's row lock (and a
/// conversation held elsewhere only makes its own rows busy). Batches lock conversations in
/// one order. Two transactions can still wait on each other through the `(sender_user,
/// cmid)` unique index, when one cmid is sent to two conversations at once; PostgreSQL
/// breaks that deadlock, the batch it fails is sent again row by row, and every row still
/// gets its own answer.
pub struct Batcher<J> {
    slots: Vec<mpsc::Sender<J>>,
}

impl<J: Send + 'static> Batcher<J> {
    /// Starts `slots` tasks, each taking up to `max` jobs of its queue at a time and running
    /// `run` on them. At most `queue` jobs wait per slot; a submitter waits for room (its
    /// request's database deadline bounds that wait).
    pub fn start<F, Fut>(slots: usize, max: usize, queue: usize, run: F) -> Batcher<J>
    where
        F: Fn(Vec<J>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let run = Arc::new(run);
        let slots = (0..slots.max(1))
            .map(|_| {
                let (tx, mut rx) = mpsc::channel(queue.max(1));
                let run = run.clone();
                // Not in the gateway's task tracker: a slot lives as long as the process. A
                // request waiting on a batch is (its task is), so shutdown still waits for
                // every batch a request is waiting on.
                tokio::spawn(async move {
                    while let Some(jobs) = take(&mut rx, max.max(1)).await {
                        (*run)(jobs).await;
                    }
                });
                tx
            })
            .collect();
        Batcher { slots }
    }

    /// Queues one job on the slot of `key`; `Err(UNAVAILABLE)` when the slot is gone.
    pub async fn submit(&self, key: &str, job: J) -> Result<(), WireError> {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        key.hash(&mut h);
        let slot = &self.slots[(h.finish() % self.slots.len() as u64) as usize];
        slot.send(job).await.map_err(|_| WireError::Unavailable)
    }
}

/// The next batch: waits for one job, then takes what else is queued, up to `max`.
async fn take<J>(rx: &mut mpsc::Receiver<J>, max: usize) -> Option<Vec<J>> {
    let first = rx.recv().await?;
    let mut jobs = Vec::with_capacity(max.min(64));
    jobs.push(first);
    while jobs.len() < max {
        match rx.try_recv() {
            Ok(j) => jobs.push(j),
            Err(_) => break,
        }
    }
    Some(jobs)
}

/// One send waiting for its batch.
pub struct SendJob {
    pub who: Principal,
    pub conv: String,
    pub cmid: String,
    pub body: String,
    /// The connection saw this user's send to this conversation commit before
    /// (`store::SendCtx::known_member`), so no membership read came before this job; when
    /// the row is sent on its own, that send skips it too.
    pub known_member: bool,
    pub done: oneshot::Sender<Result<SendOutcome, WireError>>,
}

/// The send side of group commit.
pub type Sends = Batcher<SendJob>;

/// Starts the send batcher on `pool`; committed events go to `notifier`.
pub fn sends(pool: PgPool, notifier: Notifier, slots: usize, max: usize) -> Sends {
    Batcher::start(slots, max, max * 4, move |jobs| {
        send_batch(pool.clone(), notifier.clone(), jobs)
    })
}

/// Sends one message through the batcher and waits for its answer until `deadline` (the
/// request's database deadline): past it the request has answered UNAVAILABLE, so this
/// gives up too, and a batch that has not started the job yet drops it ([`gone`]):
/// nothing waits, and nothing runs, for a request that is no longer there.
pub async fn send(
    sends: &Sends,
    deadline: Instant,
    who: Principal,
    conv: String,
    cmid: String,
    body: String,
    known_member: bool,
) -> Result<SendOutcome, WireError> {
    let (done, answer) = oneshot::channel();
    let key = conv.clone();
    let job = SendJob {
        who,
        conv,
        cmid,
        body,
        known_member,
        done,
    };
    within(deadline, async move {
        sends.submit(&key, job).await?;
        answer.await.unwrap_or(Err(WireError::Unavailable))
    })
    .await
}

/// `work` until `deadline`; UNAVAILABLE past it.
async fn within<T>(
    deadline: Instant,
    work: impl Future<Output = Result<T, WireError>>,
) -> Result<T, WireError> {
    tokio::time::timeout_at(deadline, work)
        .await
        .unwrap_or(Err(WireError::Unavailable))
}

/// Whether a job's request has stopped waiting for it (its deadline passed, or the
/// connection went): a batch drops such a job before any database work for it, so a stall
/// cannot pile up work for requests that are gone.
fn gone<T>(done: &oneshot::Sender<T>) -> bool {
    done.is_closed()
}

/// Whether a batch holds its transaction open between its inserts and its COMMIT (three
/// round trips): only while a fault point that acts there is armed (`send.before_commit`,
/// `send.batch.before_commit`; never without the `faults` feature, one atomic load each
/// with it). Otherwise the batch is one statement in one round trip
/// ([`store::send_batch_statement`], issue 44): same rows, same answers, same D1.
fn holds_open() -> bool {
    faults::is_armed(points::SEND_BEFORE_COMMIT)
        || faults::is_armed(points::SEND_BATCH_BEFORE_COMMIT)
}

/// Runs one batch of sends: `send.before_insert` per row, then either the batch as one
/// statement ([`holds_open`] false) or its INSERTs, `send.before_commit` per inserted row
/// (inside the open transaction, as in the single send) and COMMIT; then the answers (and
/// the notifier) only after the commit returned (D1).
async fn send_batch(pool: PgPool, notifier: Notifier, jobs: Vec<SendJob>) {
    let mut rows = Vec::with_capacity(jobs.len());
    for job in jobs.into_iter().filter(|j| !gone(&j.done)) {
        // A row this point stops is answered (or not, `drop`) and never reaches the batch.
        if let Some(job) = pass(points::SEND_BEFORE_INSERT, job).await {
            rows.push(job);
        }
    }
    if rows.is_empty() {
        return;
    }
    // One order of row locks for every batch (stable: a conversation's rows keep theirs).
    rows.sort_by(|a, b| a.conv.cmp(&b.conv));
    let batch: Vec<store::BatchRow<'_>> = rows
        .iter()
        .map(|j| store::BatchRow {
            who: &j.who,
            conv: &j.conv,
            cmid: &j.cmid,
            body: &j.body,
        })
        .collect();
    if !holds_open() {
        let sent = store::send_batch_statement(&pool, &batch).await;
        drop(batch);
        return match sent {
            Ok(sent) => answer_committed(&pool, &notifier, rows, sent).await,
            Err(e) => failed(&pool, &notifier, rows, e).await,
        };
    }
    let inserted = store::send_batch_insert(&pool, &batch).await;
    drop(batch);
    let (tx, out) = match inserted {
        Ok(x) => x,
        Err(e) => return failed(&pool, &notifier, rows, e).await,
    };
    let gates = before_commit(&out).await;
    if gates.iter().any(ControlFlow::is_break) {
        drop(tx);
        return stopped(&pool, &notifier, rows, gates).await;
    }
    match store::send_batch_commit(tx, out).await {
        Ok(None) => {
            // `send.batch.before_commit:drop`: rolled back, and no row gets a reply.
            for job in rows {
                let _ = job.done.send(Ok(SendOutcome::NoReply));
            }
        }
        Ok(Some(sent)) => answer_committed(&pool, &notifier, rows, sent).await,
        Err(e) => failed(&pool, &notifier, rows, e).await,
    }
}

/// What `send.before_commit` says for each row of an open batch, in row order (each hit
/// counts; delays overlap): only inserted rows pass it.
async fn before_commit(out: &[RowOutcome]) -> Vec<ControlFlow<Result<SendOutcome, WireError>>> {
    futures_util::future::join_all(out.iter().map(|s| async move {
        match s {
            RowOutcome::Inserted(_) => {
                faults::gate(
                    points::SEND_BEFORE_COMMIT,
                    Ok(SendOutcome::NoReply),
                    Err(WireError::Unavailable),
                )
                .await
            }
            RowOutcome::NotInserted | RowOutcome::Busy => ControlFlow::Continue(()),
        }
    }))
    .await
}

/// `send.before_commit` stopped a row, and the batch was rolled back: that row is answered
/// as the point says, every other row is sent again on its own.
async fn stopped(
    pool: &PgPool,
    notifier: &Notifier,
    rows: Vec<SendJob>,
    gates: Vec<ControlFlow<Result<SendOutcome, WireError>>>,
) {
    let mut others = Vec::new();
    for (job, gate) in rows.into_iter().zip(gates) {
        match gate {
            ControlFlow::Break(r) => {
                let _ = job.done.send(r);
            }
            ControlFlow::Continue(()) => others.push(job),
        }
    }
    alone(pool, notifier, others).await
}

/// Answers a committed batch's rows (D1: only now). The point after the commit acts on
/// the whole batch's answers; rows that inserted nothing are told apart, and rows whose
/// conversation was busy are sent on their own.
async fn answer_committed(
    pool: &PgPool,
    notifier: &Notifier,
    rows: Vec<SendJob>,
    sent: Vec<RowOutcome>,
) {
    let answer = faults::gate(
        points::SEND_BATCH_AFTER_COMMIT,
        Ok(SendOutcome::NoReply),
        Err(WireError::Unavailable),
    )
    .await;
    let mut left = Vec::new();
    let mut busy = Vec::new();
    for (job, sent) in rows.into_iter().zip(sent) {
        match sent {
            RowOutcome::Inserted(s) => committed(notifier, job, s, &answer).await,
            RowOutcome::NotInserted => left.push(job),
            RowOutcome::Busy => busy.push(job),
        }
    }
    // Rows whose conversation another transaction holds: each sent on its own, where it
    // waits for that lock under its own deadline, off this slot, so that the batches
    // behind this one do not wait for it.
    if !busy.is_empty() {
        tracing::debug!(
            rows = busy.len(),
            "send batch: conversations busy, sent alone"
        );
        let (pool, notifier) = (pool.clone(), notifier.clone());
        tokio::spawn(async move { alone(&pool, &notifier, busy).await });
    }
    // Rows that inserted nothing: dup, CMID_CONFLICT, NOT_MEMBER or STALE_INSTALL, told
    // apart after COMMIT, as the single send does.
    futures_util::future::join_all(left.into_iter().map(|job| {
        let pool = pool.clone();
        async move {
            let r = store::not_inserted(&pool, &job.who, &job.conv, &job.cmid, &job.body).await;
            let _ = job.done.send(r);
        }
    }))
    .await;
}

/// A batch failed before or at its COMMIT (`e`): nothing of it is known to be stored, so
/// no row is answered from it; each row is sent again on its own.
async fn failed(pool: &PgPool, notifier: &Notifier, rows: Vec<SendJob>, e: WireError) {
    if bugs::active(Bug::BatchFailsInnocents) {
        for job in rows {
            let _ = job.done.send(Err(e.clone()));
        }
        return;
    }
    tracing::info!(
        rows = rows.len(),
        code = e.code(),
        "send batch failed: every row is sent again on its own"
    );
    alone(pool, notifier, rows).await
}

/// Sends each row on its own, in its own transaction ([`store::send`]), concurrently:
/// a row that did commit with a failed batch is answered `dup` with its seq (D2). A row
/// the connection did not know as a member's had its membership read before it joined the
/// batch; `store::send` reads it again (an outsider is answered without waiting for the
/// conversation's lock).
async fn alone(pool: &PgPool, notifier: &Notifier, rows: Vec<SendJob>) {
    let rows = rows.into_iter().filter(|j| !gone(&j.done));
    futures_util::future::join_all(rows.map(|job| async move {
        let ctx = store::SendCtx {
            observer: None,
            notifier,
            known_member: job.known_member,
        };
        let r = store::send(pool, &job.who, &job.conv, &job.cmid, &job.body, ctx).await;
        let _ = job.done.send(r);
    }))
    .await;
}

/// A row committed: the notifier is told (unless the fault point stops it), then the row's
/// request gets its `Sent`, or what `send.batch.after_commit` made of the batch's answers.
async fn committed(
    notifier: &Notifier,
    job: SendJob,
    sent: Sent,
    answer: &ControlFlow<Result<SendOutcome, WireError>>,
) {
    let point = faults::gate(points::SEND_AFTER_COMMIT_BEFORE_NOTIFY, (), ()).await;
    if point.is_continue() {
        notifier.committed(&job.conv, sent.seq);
    } else {
        tracing::info!(
            conv = job.conv,
            seq = sent.seq,
            "notification skipped (fault); the commit feed finds it"
        );
    }
    let r = match answer {
        ControlFlow::Continue(()) => Ok(SendOutcome::Reply(sent)),
        ControlFlow::Break(Ok(_)) => Ok(SendOutcome::NoReply),
        ControlFlow::Break(Err(e)) => Err(e.clone()),
    };
    let _ = job.done.send(r);
}

/// Passes one row through a fault point: `None` when the point stopped it (then it has
/// been answered: no reply for `drop`, UNAVAILABLE for `error`).
async fn pass(point: &'static str, job: SendJob) -> Option<SendJob> {
    match faults::gate(point, Ok(SendOutcome::NoReply), Err(WireError::Unavailable)).await {
        ControlFlow::Continue(()) => Some(job),
        ControlFlow::Break(r) => {
            let _ = job.done.send(r);
            None
        }
    }
}

/// One ack waiting for its batch.
pub struct AckJob {
    pub who: Principal,
    pub conv: String,
    pub seq: i64,
    pub done: oneshot::Sender<Result<i64, WireError>>,
}

/// The ack side: one statement per batch of acks.
pub type Acks = Batcher<AckJob>;

/// Starts the ack batcher on `pool`.
pub fn acks(pool: PgPool, slots: usize, max: usize) -> Acks {
    Batcher::start(slots, max, max * 4, move |jobs| {
        ack_batch(pool.clone(), jobs)
    })
}

/// Acks one cursor through the batcher and waits for its answer (the merged cursor), for
/// until `deadline`, as [`send`] does.
pub async fn ack(
    acks: &Acks,
    deadline: Instant,
    who: Principal,
    conv: String,
    seq: i64,
) -> Result<i64, WireError> {
    let (done, answer) = oneshot::channel();
    let key = who.device.clone();
    let job = AckJob {
        who,
        conv,
        seq,
        done,
    };
    within(deadline, async move {
        acks.submit(&key, job).await?;
        answer.await.unwrap_or(Err(WireError::Unavailable))
    })
    .await
}

/// Runs one batch of acks in one statement; if it fails, each ack on its own (so one bad
/// row cannot fail the others).
async fn ack_batch(pool: PgPool, mut jobs: Vec<AckJob>) {
    jobs.retain(|j| !gone(&j.done));
    if jobs.is_empty() {
        return;
    }
    let rows: Vec<store::AckRow<'_>> = jobs
        .iter()
        .map(|j| store::AckRow {
            who: &j.who,
            conv: &j.conv,
            seq: j.seq,
        })
        .collect();
    match store::ack_batch(&pool, &rows).await {
        Ok(answers) => {
            drop(rows);
            for (job, r) in jobs.into_iter().zip(answers) {
                let _ = job.done.send(r);
            }
        }
        Err(e) => {
            drop(rows);
            tracing::info!(
                rows = jobs.len(),
                code = e.code(),
                "ack batch failed: every ack is tried on its own"
            );
            futures_util::future::join_all(jobs.into_iter().map(|job| {
                let pool = pool.clone();
                async move {
                    let r = store::ack(&pool, &job.who, &job.conv, job.seq).await;
                    let _ = job.done.send(r);
                }
            }))
            .await;
        }
    }
}
