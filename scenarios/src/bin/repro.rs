//! `make repro FAULT='point:action[:skip[:count]]'`: reproduces one failure by hand. Starts a
//! throwaway cluster and the gateway with that IM_FAULT, provisions alice (device a1) and bob
//! (device b1, subscribed) in conversation c1, sends one message from a1 (bob acks what he
//! gets), and prints what happened: the reply, the gateway's exit status, rows, cursors, the
//! client state file and every log path. If the gateway died, a new client loaded from the
//! state file replays the outbox against a healthy gateway and that is printed too.
//! The cluster's work directory is kept for inspection.

use anyhow::Context;
use harness::client::Client;
use harness::gateway::GatewayOpts;
use harness::world::World;
use std::time::Duration;

const T: Duration = Duration::from_secs(3);

fn show(label: &str, r: &Result<serde_json::Value, harness::client::ClientError>) {
    match r {
        Ok(v) => println!("{label:<28} {v}"),
        Err(e) => println!("{label:<28} none: {e}"),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let fault = std::env::args().nth(1).unwrap_or_default();
    if fault.trim().is_empty() {
        anyhow::bail!(
            "usage: make repro FAULT='point:action[:skip[:count]]'\n  e.g. make repro FAULT='send.before_commit:halt'"
        );
    }
    let mut w = World::start(GatewayOpts {
        fault: Some(fault.clone()),
        sweep_ms: Some(500),
        db_timeout_ms: Some(2000),
        ..Default::default()
    })
    .await
    .context("start a cluster and the gateway with this IM_FAULT")?;
    w.pg.keep();
    println!("IM_FAULT                     {fault}");
    println!("cluster work dir (kept)      {}", w.pg.work_dir().display());
    println!("postgres url                 {}", w.pg.url());
    let (a, b) = scenarios::alice_and_bob(&w).await?;
    let state = a.state_path().to_path_buf();

    let r = a.send("c1", "repro-1", "hello", T).await;
    show("a1 send reply", &r);
    let exited = w.gw_mut().wait_exit(Duration::from_millis(1500)).await.ok();
    match exited {
        Some(s) => println!(
            "gateway exit status          {} ({s})",
            w.gw().exit_code().unwrap_or(-1)
        ),
        None => println!("gateway exit status          still running"),
    }
    if exited.is_none() {
        // Give pushes, hints and acks one sweep interval and a little to play out.
        let _ = b
            .wait_server_delivered("c1", 1, Duration::from_millis(1500))
            .await;
    }
    println!(
        "events rows in c1            {}",
        w.count_events("c1").await?
    );
    println!("head of c1                   {}", w.head("c1").await?);
    println!(
        "b1 delivered_seq             {:?}",
        w.cursor("b1", "c1").await?
    );
    println!("a1 outbox                    {:?}", a.outbox());
    println!(
        "b1 stats                     {}",
        serde_json::to_string(&b.stats())?
    );
    println!("a1 state file                {}", state.display());
    println!("b1 state file                {}", b.state_path().display());
    println!(
        "gateway log                  {}",
        w.gw().log_path().display()
    );
    let fired: Vec<String> = w
        .gw()
        .log_text()
        .lines()
        .filter(|l| l.starts_with("fault fired"))
        .map(str::to_string)
        .collect();
    println!("fault lines on stderr        {fired:?}");

    if exited.is_some() || !a.outbox().is_empty() {
        a.crash().await;
        w.restart_gateway(GatewayOpts::default()).await?;
        println!("-- replay: new client loaded from the state file, healthy gateway --");
        let mut again = Client::load(&state)?;
        again
            .connect(&w.ws_url())
            .await
            .map_err(|e| anyhow::anyhow!("reconnect: {e}"))?;
        for (i, r) in again.replay_outbox(T).await.iter().enumerate() {
            show(&format!("replay reply {i}"), r);
        }
        println!(
            "events rows in c1            {}",
            w.count_events("c1").await?
        );
        println!("a1 outbox                    {:?}", again.outbox());
        println!(
            "new gateway log              {}",
            w.gw().log_path().display()
        );
    }
    Ok(())
}
