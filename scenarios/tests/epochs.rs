//! Issue 21, item 3: epochs that mean something (D1/D6, the checker's `held-lost`).
//!
//! An asynchronous standby far behind its primary (a replication link that holds every
//! byte 1.5 s) is promoted after the receiver got messages the standby never had: the
//! database has lost history a device holds, and the next messages take the same seqs.
//! Only the epoch can tell the device: the gateway's first connection to the new primary
//! finds another lineage (migration 0006) and moves every conversation's epoch, the
//! gateway closes its connections, and the receiver, seeing the new epoch in `subbed`,
//! discards what it held and syncs again. The checker must then find no device holding
//! what the database lost (`held-lost`), no seq holding two messages (`store-mismatch`)
//! and no cursor going down (D4). With `IM_BUG=no-epoch` nothing moves and the same run is
//! `held-lost` and `store-mismatch`.

use harness::checker::Kind;
use harness::gateway::GatewayOpts;
use harness::util::wait_until;
use harness::world::{Replication, World, WorldOpts};
use scenarios::{connect, judge_test, provision_alice_and_bob};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(10);
/// The standby's lag: every replication byte is held this long on the link.
const LAG: Duration = Duration::from_millis(1500);
/// Messages sent before the standby is caught up with, and after (lost by the failover).
const KEPT: i64 = 3;
const LOST: i64 = 4;

/// D1/D6 under an asynchronous failover that lost what a device held: every device is
/// told (an epoch move), reconciles, and the checker finds none silently wrong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_failover_that_lost_held_messages_leaves_no_device_silently_wrong(
) -> anyhow::Result<()> {
    let mut w = World::start_with(
        WorldOpts {
            replication: Some(Replication {
                synchronous: false,
                link_delay: LAG,
            }),
            ..Default::default()
        },
        GatewayOpts {
            db_timeout_ms: Some(1000),
            ..Default::default()
        },
    )
    .await?;
    let (ta, tb) = provision_alice_and_bob(&w).await?;
    let a = connect(&w, "a1", &ta).await?;
    let mut b = connect(&w, "b1", &tb).await?;
    b.sub().await?;
    let send = async |n: i64| a.send("c1", &format!("x{n}"), &format!("m{n}"), T).await;
    for n in 1..=KEPT {
        send(n).await?;
    }
    b.wait_cursor("c1", KEPT, T).await?;
    w.standby_caught_up().await?;
    // Within the link's lag: acknowledged, pushed, stored by b1, never on the standby.
    for n in KEPT + 1..=KEPT + LOST {
        send(n).await?;
    }
    b.wait_cursor("c1", KEPT + LOST, T).await?;
    w.failover().await?;

    // The gateway finds the new lineage on its first connection to the new primary (its
    // LISTEN connection is rebuilt at once) and closes every connection.
    let closed = wait_until(
        "the gateway to close b1's connection",
        Instant::now() + T,
        async || {
            if b.is_connected() {
                Err(())
            } else {
                Ok(())
            }
        },
    )
    .await;
    if !b.is_connected() {
        b.connect(&w.ws_url()).await?;
        b.sub().await?;
    }
    let mut a = a;
    if !a.is_connected() {
        a.connect(&w.ws_url()).await?;
    }
    // New messages take the seqs the lost ones had.
    for n in 100..102 {
        a.send("c1", &format!("x{n}"), &format!("m{n}"), T).await?;
    }
    b.wait_cursor("c1", KEPT + 2, T).await?;
    let r = judge_test(&w).await?;
    let pool = w.pool().await?;
    let (epoch, moves): (i32, i32) = sqlx::query_as(
        "SELECT (SELECT epoch FROM conversations WHERE conv_id = 'c1'), moves FROM db_lineage",
    )
    .fetch_one(&pool)
    .await?;
    // The state where only the epoch can help: acknowledged messages b1 held are gone (the
    // asynchronous failover's expected loss, reported and not an anomaly).
    assert!(
        !r.expected_loss.is_empty(),
        "the failover lost nothing b1 held: the check proves nothing; {}",
        r.summary()
    );
    for k in [
        Kind::Lost,
        Kind::HeldLost,
        Kind::StoreMismatch,
        Kind::D4Decrease,
    ] {
        assert_eq!(r.counts[&k], 0, "{k}: {}", r.summary());
    }
    closed?;
    assert_eq!((epoch, moves), (2, 1), "c1's epoch and the lineage's moves");
    assert_eq!(b.stats().epoch_moves, 1, "{:?}", b.stats());
    Ok(())
}
