//! `make up`: a throwaway PostgreSQL cluster and the gateway (the debug build `make build`
//! made), provisioned with two users, two devices and one conversation, kept running until
//! Ctrl-C (then both stop and the cluster directory is removed; `IMFAULT_KEEP=1` keeps it).
//! It prints the WebSocket URL, the database URL and both device tokens, then plays one
//! example exchange (hello, sub, send, push, ack) with two clients and prints every frame,
//! so a newcomer sees the protocol before writing a client.

use harness::gateway::GatewayOpts;
use harness::world::World;
use serde_json::Value;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

fn show(dir: &str, who: &str, v: &Value) {
    println!("  {who} {dir} {v}");
}

/// Start a throwaway PostgreSQL cluster and the gateway, provision alice (device a1) and
/// bob (device b1) in conversation c1, play one exchange, and run until Ctrl-C.
#[derive(clap::Parser, Debug)]
#[command(name = "up", after_help = include_str!("harness_env.txt"))]
struct Args {}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _: Args = clap::Parser::parse();
    eprintln!("up: starting a throwaway PostgreSQL cluster and the gateway ...");
    let w = World::start(GatewayOpts::default()).await?;
    let (ta, tb) = scenarios::provision_alice_and_bob(&w).await?;
    println!("gateway    {}", w.ws_url());
    println!("database   {}", w.pg.url());
    println!("users      alice (device a1), bob (device b1); conversation c1 with both");
    println!("token a1   {ta}");
    println!("token b1   {tb}");
    println!("work dir   {}", w.work_dir().display());
    println!();
    println!("An example exchange (each line: who, direction, frame):");
    let a = scenarios::connect(&w, "a1", &ta).await?;
    let b = scenarios::connect(&w, "b1", &tb).await?;
    a.sub().await.map_err(|e| anyhow::anyhow!("sub a1: {e}"))?;
    b.sub().await.map_err(|e| anyhow::anyhow!("sub b1: {e}"))?;
    let sent = a
        .send("c1", "hello-1", "hi bob", T)
        .await
        .map_err(|e| anyhow::anyhow!("send: {e}"))?;
    let seq = sent["seq"].as_i64().unwrap_or(1);
    b.wait_server_delivered("c1", seq, T).await?;
    let mut lines: Vec<(std::time::Instant, &str, &str, Value)> = Vec::new();
    for (who, c) in [("a1", &a), ("b1", &b)] {
        for (t, f) in c.sent_frames() {
            let mut f = f;
            if f.get("token").is_some() {
                f["token"] = Value::String("<token>".into());
            }
            lines.push((t, who, "->", f));
        }
        for (t, f) in c.frames() {
            lines.push((t, who, "<-", f));
        }
    }
    lines.sort_by_key(|l| l.0);
    for (_, who, dir, f) in &lines {
        show(dir, who, f);
    }
    println!();
    println!(
        "Connect your own client to {} (hello with a device and its token, epoch 1).",
        w.ws_url()
    );
    println!("Running until Ctrl-C (or SIGTERM).");
    a.close().await;
    b.close().await;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r?,
        _ = term.recv() => {}
    }
    eprintln!("up: stopping the gateway and the cluster");
    drop(w);
    Ok(())
}
