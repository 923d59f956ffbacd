//! Group commit's rules per row (issue 19), called directly on a migrated database (a
//! throwaway cluster from the harness; the gateway it also starts takes no part): within one
//! batch, P1 (consecutive seqs, taken only by rows that inserted), D2 (a resend in the same
//! batch or a later one inserts nothing and is answered with the original's seq), S1
//! (membership per row); and an ack batch answers every ack exactly as one ack would, with
//! GREATEST kept (D4). And the batcher itself, without a database: what a slot gathers
//! into one batch, and that one key always goes to one slot.

use harness::gateway::GatewayOpts;
use harness::world::World;
use im_gateway::error::WireError;
use im_gateway::store::{self, AckRow, BatchRow, Principal, RowOutcome, SendOutcome, Sent};

fn who(user: &str, device: &str, epoch: i64) -> Principal {
    Principal {
        user: user.into(),
        device: device.into(),
        epoch,
    }
}

fn row<'a>(who: &'a Principal, conv: &'a str, cmid: &'a str) -> BatchRow<'a> {
    BatchRow {
        who,
        conv,
        cmid,
        body: "x",
    }
}

/// alice (a1) and bob (b1) in c1, alice alone in c2, carol (k1) in neither.
async fn world() -> World {
    let w = World::start(GatewayOpts::default())
        .await
        .expect("start cluster and gateway");
    for u in ["alice", "bob", "carol"] {
        w.admin.add_user(u).await.unwrap();
    }
    for (d, u) in [("a1", "alice"), ("b1", "bob"), ("k1", "carol")] {
        w.admin.add_device(d, u).await.unwrap();
    }
    w.admin.add_conv("c1", &["alice", "bob"]).await.unwrap();
    w.admin.add_conv("c2", &["alice"]).await.unwrap();
    w
}

fn inserted(o: &RowOutcome) -> Option<&Sent> {
    match o {
        RowOutcome::Inserted(s) => Some(s),
        RowOutcome::NotInserted | RowOutcome::Busy => None,
    }
}

/// Each row's seq, `None` for a row that inserted nothing (or was busy).
fn seqs(out: &[RowOutcome]) -> Vec<Option<i64>> {
    out.iter().map(|o| inserted(o).map(|s| s.seq)).collect()
}

fn ack<'a>(who: &'a Principal, conv: &'a str, seq: i64) -> AckRow<'a> {
    AckRow { who, conv, seq }
}

async fn seqs_of(pool: &sqlx::PgPool, conv: &str) -> (i64, Vec<i64>) {
    let head: i64 = sqlx::query_scalar("SELECT next_seq - 1 FROM conversations WHERE conv_id = $1")
        .bind(conv)
        .fetch_one(pool)
        .await
        .unwrap();
    let seqs: Vec<i64> =
        sqlx::query_scalar("SELECT seq FROM events WHERE conv_id = $1 ORDER BY seq")
            .bind(conv)
            .fetch_all(pool)
            .await
            .unwrap();
    (head, seqs)
}

/// The two forms of a send batch: held open (BEGIN, `im_send_batch`, COMMIT: while a fault
/// point inside the transaction is armed) and one statement (production, issue 44). Both
/// must give every row the same outcome.
#[derive(Clone, Copy, Debug)]
enum Form {
    HeldOpen,
    Statement,
}

/// One committed batch of `rows` in `form`.
async fn batch(form: Form, pool: &sqlx::PgPool, rows: &[BatchRow<'_>]) -> Vec<RowOutcome> {
    match form {
        Form::HeldOpen => store::send_batch(pool, rows)
            .await
            .expect("the batch commits")
            .expect("no fault dropped it"),
        Form::Statement => store::send_batch_statement(pool, rows)
            .await
            .expect("the batch commits"),
    }
}

/// P1, D2 and S1 per row of one batch, and of the batch after it.
#[tokio::test]
async fn a_batch_keeps_every_rule_of_a_single_send_per_row() {
    every_rule_per_row(Form::HeldOpen).await
}

/// The same in one statement: what production runs.
#[tokio::test]
async fn a_one_statement_batch_keeps_every_rule_of_a_single_send_per_row() {
    every_rule_per_row(Form::Statement).await
}

async fn every_rule_per_row(form: Form) {
    let w = world().await;
    let pool = w.admin.pool().await.unwrap();
    let (a, b, k) = (
        who("alice", "a1", 1),
        who("bob", "b1", 1),
        who("carol", "k1", 1),
    );
    let stale = who("alice", "a1", 2);
    let rows = [
        row(&a, "c1", "m1"),
        row(&b, "c1", "m1"),      // another user's cmid: its own message
        row(&a, "c1", "m1"),      // D2: a resend in the same batch
        row(&k, "c1", "k1"),      // S1: not a member
        row(&a, "c1", "m2"),      // P1: the seq after the last row that inserted
        row(&a, "nowhere", "m3"), // no such conversation
        row(&stale, "c1", "m4"),  // an install epoch that is not the current one
        row(&a, "c2", "m5"),      // another conversation: its own seqs
    ];
    let out = batch(form, &pool, &rows).await;
    assert_eq!(
        seqs(&out),
        [Some(1), Some(2), None, None, Some(3), None, None, Some(1)]
    );
    assert!(
        !out.contains(&RowOutcome::Busy),
        "nothing else holds a conversation"
    );
    assert!(out.iter().filter_map(inserted).all(|s| !s.dup));
    assert_eq!(seqs_of(&pool, "c1").await, (3, vec![1, 2, 3]), "P1 in c1");
    assert_eq!(seqs_of(&pool, "c2").await, (1, vec![1]), "P1 in c2");

    // D2: the resend is answered, after COMMIT, as the original with its seq and mid.
    let first = inserted(&out[0]).cloned().unwrap();
    match store::not_inserted(&pool, &a, "c1", "m1", "x").await {
        Ok(SendOutcome::Reply(s)) => {
            assert_eq!((s.seq, s.dup, s.mid), (1, true, first.mid.clone()))
        }
        other => panic!("the resend in the batch: {other:?}"),
    }
    // S1 and the stale install are told apart after COMMIT as a single send's are.
    assert_eq!(
        store::not_inserted(&pool, &k, "c1", "k1", "x").await.err(),
        Some(WireError::NotMember)
    );
    assert_eq!(
        store::not_inserted(&pool, &stale, "c1", "m4", "x")
            .await
            .err(),
        Some(WireError::StaleInstall)
    );

    // A later batch: the resend inserts nothing; the new message takes the next seq.
    let out = batch(form, &pool, &[row(&a, "c1", "m1"), row(&a, "c1", "m6")]).await;
    assert_eq!(seqs(&out), [None, Some(4)]);
    assert_eq!(
        seqs_of(&pool, "c1").await,
        (4, vec![1, 2, 3, 4]),
        "P1 in c1"
    );
}

/// A conversation another transaction holds (here an open transaction that locked its row,
/// as a send of another gateway or a long `admin` transaction would) makes only its own
/// rows busy: the batch does not wait for it, the other rows insert and commit at once, and
/// the busy rows take no seq (P1), so that the caller can send them on their own.
#[tokio::test]
async fn a_locked_conversation_makes_only_its_own_rows_busy() {
    only_locked_rows_busy(Form::HeldOpen).await
}

/// The same in one statement: what production runs.
#[tokio::test]
async fn a_locked_conversation_makes_only_its_own_rows_busy_in_one_statement() {
    only_locked_rows_busy(Form::Statement).await
}

async fn only_locked_rows_busy(form: Form) {
    let w = world().await;
    let pool = w.admin.pool().await.unwrap();
    let a = who("alice", "a1", 1);
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM conversations WHERE conv_id = 'c1' FOR NO KEY UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let rows = [
        row(&a, "c1", "m1"),
        row(&a, "c2", "m2"),
        row(&a, "c1", "m3"),
        row(&a, "nowhere", "m4"),
    ];
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        batch(form, &pool, &rows),
    )
    .await
    .expect("the batch does not wait for the held conversation");
    assert_eq!(out[0], RowOutcome::Busy);
    assert_eq!(seqs(&out[1..2]), [Some(1)], "c2 inserted");
    assert_eq!(out[2], RowOutcome::Busy);
    assert_eq!(
        out[3],
        RowOutcome::NotInserted,
        "no such conversation: not busy"
    );
    assert_eq!(seqs_of(&pool, "c2").await, (1, vec![1]));
    holder.rollback().await.unwrap();
    assert_eq!(
        seqs_of(&pool, "c1").await,
        (0, vec![]),
        "P1: busy rows took no seq"
    );
    // Once free, the same rows insert, at the conversation's first seqs.
    let out = batch(form, &pool, &[row(&a, "c1", "m1"), row(&a, "c1", "m3")]).await;
    assert_eq!(seqs(&out), [Some(1), Some(2)]);
}

/// The acks both ack tests make after alice sent m1..m3 to c1 (bob acks 2, 1, 9; carol, who
/// is not a member, acks 1; bob's stale install acks 1; alice acks 3), and the answer each
/// must get: two acks of one cursor merge into the higher, an ack above the head is
/// CURSOR_AHEAD, S1's NOT_MEMBER, the install check's STALE_INSTALL.
async fn ack_script(pool: &sqlx::PgPool) -> (Vec<(Principal, i64)>, Vec<Result<i64, WireError>>) {
    let (a, b, k) = (
        who("alice", "a1", 1),
        who("bob", "b1", 1),
        who("carol", "k1", 1),
    );
    store::send_batch(
        pool,
        &[
            row(&a, "c1", "m1"),
            row(&a, "c1", "m2"),
            row(&a, "c1", "m3"),
        ],
    )
    .await
    .unwrap()
    .unwrap();
    let acks = vec![
        (b.clone(), 2),
        (b.clone(), 1),
        (b.clone(), 9),
        (k, 1),
        (who("bob", "b1", 2), 1),
        (a, 3),
    ];
    let answers = vec![
        Ok(2),
        Ok(2),
        Err(WireError::CursorAhead { head: 3 }),
        Err(WireError::NotMember),
        Err(WireError::StaleInstall),
        Ok(3),
    ];
    (acks, answers)
}

/// Every ack of a batch gets the answer one ack would get; two acks of one cursor merge
/// into the higher; a later lower ack never lowers it (D4).
#[tokio::test]
async fn an_ack_batch_answers_each_ack_exactly() {
    let w = world().await;
    let pool = w.admin.pool().await.unwrap();
    let (acks, expected) = ack_script(&pool).await;
    let rows: Vec<AckRow<'_>> = acks.iter().map(|(p, seq)| ack(p, "c1", *seq)).collect();
    let answers = store::ack_batch(&pool, &rows)
        .await
        .expect("the ack batch runs");
    assert_eq!(answers, expected);
    assert_eq!(w.admin.cursor("b1", "c1").await.unwrap(), Some(2));
    assert_eq!(w.admin.cursor("a1", "c1").await.unwrap(), Some(3));
    // D4: a later, lower ack is answered with the cursor it did not lower.
    let b = who("bob", "b1", 1);
    let answers = store::ack_batch(&pool, &[ack(&b, "c1", 1)]).await.unwrap();
    assert_eq!(answers, [Ok(2)]);
    assert_eq!(w.admin.cursor("b1", "c1").await.unwrap(), Some(2));
}

/// The ack batch's fallback: when a batch statement fails, `batch::ack_batch` answers each
/// of its acks with `store::ack`, one statement per ack, so that one bad row cannot fail
/// the others. Each must get the answer the batch would have given (D3: the cursor written
/// only by an ack; D4: GREATEST; S1: NOT_MEMBER), and write the same cursors.
#[tokio::test]
async fn a_single_ack_answers_as_the_batch_would() {
    let w = world().await;
    let pool = w.admin.pool().await.unwrap();
    let (acks, expected) = ack_script(&pool).await;
    let mut answers = Vec::new();
    for (p, seq) in &acks {
        answers.push(store::ack(&pool, p, "c1", *seq).await);
    }
    assert_eq!(answers, expected);
    assert_eq!(w.admin.cursor("b1", "c1").await.unwrap(), Some(2));
    assert_eq!(w.admin.cursor("a1", "c1").await.unwrap(), Some(3));
    assert_eq!(
        w.admin.cursor("k1", "c1").await.unwrap(),
        None,
        "S1: nothing written"
    );
}

/// Group commit gathers (D1's batches): a job that arrives at an idle slot starts a batch
/// at once, alone (no wait when idle); the jobs that arrive while a batch runs queue, and
/// the next batch takes all of them at once, up to the limit, in arrival order. Needs no
/// database: the batch here only records what it was given and waits for the test's gate.
#[tokio::test]
async fn a_slot_takes_everything_queued_up_to_the_limit_and_never_waits_when_idle() {
    use im_gateway::batch::Batcher;
    use std::sync::Arc;
    use std::time::Duration;
    use tokio::sync::{mpsc, Semaphore};

    let (seen_tx, mut seen) = mpsc::unbounded_channel::<Vec<u32>>();
    let gate = Arc::new(Semaphore::new(0));
    let g = gate.clone();
    let b = Batcher::start(1, 3, 16, move |jobs: Vec<u32>| {
        let seen_tx = seen_tx.clone();
        let g = g.clone();
        async move {
            seen_tx.send(jobs).unwrap();
            g.acquire().await.unwrap().forget();
        }
    });
    let mut next = async || {
        tokio::time::timeout(Duration::from_secs(10), seen.recv())
            .await
            .expect("a batch within 10 s")
            .expect("the slot is alive")
    };
    b.submit("k", 0).await.unwrap();
    assert_eq!(
        next().await,
        vec![0],
        "an idle slot runs a lone job at once"
    );
    // The slot is busy with [0] until the gate opens: these four queue behind it.
    for j in 1..=4 {
        b.submit("k", j).await.unwrap();
    }
    gate.add_permits(1);
    assert_eq!(
        next().await,
        vec![1, 2, 3],
        "the next batch takes what queued, up to 3"
    );
    gate.add_permits(1);
    assert_eq!(next().await, vec![4]);
    gate.add_permits(1);
}

/// One key, one slot: with several slots, the jobs of one key (a conversation's sends, a
/// device's acks) always land in the same slot's batches, so two batches of one gateway
/// never wait on each other's row locks; and the keys spread over the slots.
#[tokio::test]
async fn one_key_always_goes_to_one_slot() {
    use im_gateway::batch::Batcher;
    use std::collections::{HashMap, HashSet};
    use tokio::sync::mpsc;

    // Each slot is one task, which runs its batches: the task's id names the slot.
    let (seen_tx, mut seen) = mpsc::unbounded_channel::<(tokio::task::Id, String)>();
    let b = Batcher::start(4, 8, 64, move |jobs: Vec<String>| {
        let seen_tx = seen_tx.clone();
        async move {
            for key in jobs {
                seen_tx.send((tokio::task::id(), key)).unwrap();
            }
        }
    });
    let keys: Vec<String> = (0..40).map(|i| format!("conv-{i}")).collect();
    for _ in 0..5 {
        for k in &keys {
            b.submit(k, k.clone()).await.unwrap();
        }
    }
    let mut slot_of: HashMap<String, HashSet<tokio::task::Id>> = HashMap::new();
    for _ in 0..keys.len() * 5 {
        let (slot, key) = tokio::time::timeout(std::time::Duration::from_secs(10), seen.recv())
            .await
            .expect("every job runs within 10 s")
            .expect("the slots are alive");
        slot_of.entry(key).or_default().insert(slot);
    }
    for (key, slots) in &slot_of {
        assert_eq!(slots.len(), 1, "{key} ran in {} slots", slots.len());
    }
    let used: HashSet<_> = slot_of.values().flatten().collect();
    assert!(
        used.len() > 1,
        "40 keys over 4 slots used only {} slot",
        used.len()
    );
}
