//! Issue 21, first step: several gateways behind a real load balancer (Debian's HAProxy,
//! started and owned by the harness, health checks on) as the clients' one address. A
//! gateway dies; the devices reconnect through the same address, land on the gateway left,
//! and the flow goes on; the dead gateway started again on another port is pointed at
//! through HAProxy's runtime API and comes back UP. The checker judges the whole run
//! (D1–D6, P1, S1). Where HAProxy is not installed the test says SKIPPED with the reason.

use harness::balancer::{haproxy_bin, Balancer};
use harness::gateway::GatewayOpts;
use harness::util::wait_until;
use harness::world::World;
use scenarios::provision_alice_and_bob;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

/// Waits (bounded by `T`) until HAProxy reports `server` in a state starting with `want`.
async fn wait_state(bal: &Balancer, server: &str, want: &str) {
    wait_until(&format!("{server} {want}"), T, async || {
        let s = bal
            .states()
            .await
            .unwrap_or_default()
            .into_iter()
            .find(|(n, _)| n == server)
            .map(|(_, s)| s)
            .unwrap_or_default();
        if s.starts_with(want) {
            Ok(())
        } else {
            Err(s)
        }
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn devices_reconnect_through_haproxy_to_the_gateway_left() {
    if let Err(why) = haproxy_bin() {
        println!("SKIPPED: {why}");
        return;
    }
    let mut w = World::start(GatewayOpts::default()).await.unwrap();
    w.start_gateway(GatewayOpts::default()).await.unwrap();
    let bal = Balancer::start(&[w.gateways.at(0).addr(), w.gateways.at(1).addr()])
        .await
        .unwrap();
    let url = bal.ws_url();
    let (ta, tb) = provision_alice_and_bob(&w).await.unwrap();
    let mut a = w.admin.create_client("a1", "a1", &ta, 1).unwrap();
    let mut b = w.admin.create_client("b1", "b1", &tb, 1).unwrap();
    for c in [&mut a, &mut b] {
        c.connect(&url).await.unwrap();
        c.sub().await.unwrap();
    }
    a.send("c1", "m1", "before", T).await.unwrap();
    b.wait_server_delivered("c1", 1, T).await.unwrap();

    // Gateway 0 dies: HAProxy marks it DOWN within its checks.
    w.kill_gateway_at(0);
    wait_state(&bal, "gw0", "DOWN").await;
    // Both devices restart and come back through the same address, onto gateway 1.
    let (sa, sb) = (a.state_path().to_path_buf(), b.state_path().to_path_buf());
    a.crash().await;
    b.crash().await;
    let mut a = w.admin.load_client(&sa).unwrap();
    let mut b = w.admin.load_client(&sb).unwrap();
    for c in [&mut a, &mut b] {
        c.connect(&url).await.unwrap();
        c.sub().await.unwrap();
    }
    let sent = a.send("c1", "m2", "after", T).await.unwrap();
    assert_eq!(sent["seq"], 2, "{sent}");
    b.wait_server_delivered("c1", 2, T).await.unwrap();
    assert_eq!(b.cursor("c1"), 2);

    // Gateway 0 again, on another port: pointed at through the runtime API, it is UP.
    w.restart_gateway_at(0, GatewayOpts::default())
        .await
        .unwrap();
    bal.set_server(0, w.gateways.at(0).addr()).await.unwrap();
    wait_state(&bal, "gw0", "UP").await;
    let judged = w.judge().await.unwrap();
    assert!(
        judged.report.anomalies.is_empty(),
        "{:?}",
        judged.report.anomalies
    );
    a.close().await;
    b.close().await;
}
