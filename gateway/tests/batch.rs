//! Group commit's rules per row (issue 19), called directly on a migrated database (a
//! throwaway cluster from the harness; the gateway it also starts takes no part): within one
//! batch, P1 (consecutive seqs, taken only by rows that inserted), D2 (a resend in the same
//! batch or a later one inserts nothing and is answered with the original's seq), S1
//! (membership per row); and an ack batch answers every ack exactly as one ack would, with
//! GREATEST kept (D4).

use harness::gateway::GatewayOpts;
use harness::world::World;
use im_gateway::error::WireError;
use im_gateway::store::{self, AckRow, BatchRow, Principal, SendOutcome};

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
        w.add_user(u).await.unwrap();
    }
    for (d, u) in [("a1", "alice"), ("b1", "bob"), ("k1", "carol")] {
        w.add_device(d, u).await.unwrap();
    }
    w.add_conv("c1", &["alice", "bob"]).await.unwrap();
    w.add_conv("c2", &["alice"]).await.unwrap();
    w
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

/// P1, D2 and S1 per row of one batch, and of the batch after it.
#[tokio::test]
async fn a_batch_keeps_every_rule_of_a_single_send_per_row() {
    let w = world().await;
    let pool = w.pool().await.unwrap();
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
    let out = store::send_batch(&pool, &rows)
        .await
        .expect("the batch commits")
        .expect("no fault dropped it");
    let got: Vec<Option<i64>> = out.iter().map(|s| s.as_ref().map(|s| s.seq)).collect();
    assert_eq!(
        got,
        [Some(1), Some(2), None, None, Some(3), None, None, Some(1)]
    );
    assert!(out.iter().flatten().all(|s| !s.dup));
    assert_eq!(seqs_of(&pool, "c1").await, (3, vec![1, 2, 3]), "P1 in c1");
    assert_eq!(seqs_of(&pool, "c2").await, (1, vec![1]), "P1 in c2");

    // D2: the resend is answered, after COMMIT, as the original with its seq and mid.
    let first = out[0].clone().unwrap();
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
    let out = store::send_batch(&pool, &[row(&a, "c1", "m1"), row(&a, "c1", "m6")])
        .await
        .unwrap()
        .unwrap();
    let got: Vec<Option<i64>> = out.iter().map(|s| s.as_ref().map(|s| s.seq)).collect();
    assert_eq!(got, [None, Some(4)]);
    assert_eq!(
        seqs_of(&pool, "c1").await,
        (4, vec![1, 2, 3, 4]),
        "P1 in c1"
    );
}

/// Every ack of a batch gets the answer one ack would get; two acks of one cursor merge
/// into the higher; a later lower ack never lowers it (D4).
#[tokio::test]
async fn an_ack_batch_answers_each_ack_exactly() {
    let w = world().await;
    let pool = w.pool().await.unwrap();
    let (a, b, k) = (
        who("alice", "a1", 1),
        who("bob", "b1", 1),
        who("carol", "k1", 1),
    );
    let stale = who("bob", "b1", 2);
    store::send_batch(
        &pool,
        &[
            row(&a, "c1", "m1"),
            row(&a, "c1", "m2"),
            row(&a, "c1", "m3"),
        ],
    )
    .await
    .unwrap()
    .unwrap();
    let answers = store::ack_batch(
        &pool,
        &[
            ack(&b, "c1", 2),
            ack(&b, "c1", 1),
            ack(&b, "c1", 9),
            ack(&k, "c1", 1),
            ack(&stale, "c1", 1),
            ack(&a, "c1", 3),
        ],
    )
    .await
    .expect("the ack batch runs");
    assert_eq!(
        answers,
        [
            Ok(2),
            Ok(2),
            Err(WireError::CursorAhead { head: 3 }),
            Err(WireError::NotMember),
            Err(WireError::StaleInstall),
            Ok(3),
        ]
    );
    assert_eq!(w.cursor("b1", "c1").await.unwrap(), Some(2));
    assert_eq!(w.cursor("a1", "c1").await.unwrap(), Some(3));
    // D4: a later, lower ack is answered with the cursor it did not lower.
    let answers = store::ack_batch(&pool, &[ack(&b, "c1", 1)]).await.unwrap();
    assert_eq!(answers, [Ok(2)]);
    assert_eq!(w.cursor("b1", "c1").await.unwrap(), Some(2));
}
