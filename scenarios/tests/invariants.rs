//! A broken invariant ends the gateway process (issue 9, item 3): the binary's panic hook
//! (`im_gateway::invariant`) turns an assertion that fires anywhere, a spawned request
//! task included, into one `invariant broken` line on stderr and an abort, never into an
//! INTERNAL reply from a gateway that goes on serving. One test = one process = one cluster.

use harness::client::ClientError;
use harness::gateway::GatewayOpts;
use harness::world::World;
use serde_json::{json, Value};
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

/// The exit status of a process ended by SIGABRT, as the harness records it (128 + 6).
const ABORTED: i32 = 134;

/// Proves that the D4 assertion in `store::ack` (the merged cursor is at least the acked
/// seq) ends the process when it fires inside a request task: a trigger makes the database
/// break D4 behind the gateway's back (every cursor write stored as 0), a device acks seq 1,
/// and the gateway aborts (status 134, `invariant broken` and the D4 message on stderr)
/// instead of answering INTERNAL. The device is not subscribed, so the only ack is this one.
#[tokio::test]
async fn broken_d4_ends_the_gateway_process() {
    let mut w = World::start(GatewayOpts::default())
        .await
        .expect("start cluster and gateway");
    w.admin.add_user("alice").await.unwrap();
    let token = w.admin.add_device("a1", "alice").await.unwrap();
    w.admin.add_conv("c1", &["alice"]).await.unwrap();

    let mut c = w.admin.create_client("a1", "a1", &token, 1).unwrap();
    c.connect_raw(&w.ws_url()).await.unwrap();
    let r = c
        .request(
            json!({"t":"hello","device":"a1","token":token,"epoch":1}),
            T,
        )
        .await
        .unwrap();
    assert_eq!(r["t"].as_str(), Some("welcome"), "{r}");
    let r = c
        .request(json!({"t":"send","conv":"c1","cmid":"k1","body":"one"}), T)
        .await
        .unwrap();
    assert_eq!(
        (r["t"].as_str(), r["seq"].as_i64()),
        (Some("sent"), Some(1))
    );

    let pool = w.admin.pool().await.unwrap();
    sqlx::raw_sql(
        "CREATE FUNCTION test_lower_cursor() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN NEW.delivered_seq := 0; RETURN NEW; END $$;
         CREATE TRIGGER test_lower_cursor BEFORE INSERT OR UPDATE ON device_cursors
         FOR EACH ROW EXECUTE FUNCTION test_lower_cursor();",
    )
    .execute(&pool)
    .await
    .expect("install the trigger that breaks D4");

    let r: Result<Value, ClientError> = c.request(json!({"t":"ack","conv":"c1","seq":1}), T).await;
    assert!(
        matches!(r, Err(ClientError::Disconnected)),
        "the ack must get no reply (the process ended), not {r:?}"
    );
    let status = w.wait_gateway_exit(T).await.expect("the gateway exits");
    let log = w.gw().log_text();
    assert_eq!(
        w.gw().exit_code(),
        Some(ABORTED),
        "exit status {status}; log:\n{log}"
    );
    assert!(
        log.contains("invariant broken")
            && log.contains("D4 broken: merged cursor 0 below acked 1"),
        "stderr must name the broken invariant; log:\n{log}"
    );
    assert!(
        !log.contains("INTERNAL"),
        "no INTERNAL reply was logged; log:\n{log}"
    );
}
