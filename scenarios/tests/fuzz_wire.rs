//! The connection state machine of the real gateway, fuzzed over the wire: four
//! connections send frames in any order (hello or not, valid requests, the parser
//! fuzzer's hostile frames, binary frames, oversized frames) and after every frame wait
//! for the gateway's answer. Proves: no frame goes unanswered (every one gets a reply or a
//! close: zero hangs), the gateway never panics or dies, the database invariants hold, and
//! a well-behaved client is served normally afterwards.
//!
//! `IMFAULT_FUZZ_FRAMES` sets the number of frames (default 2,000 in `make test`; `make
//! fuzz` sends 100,000) and `IMFAULT_FUZZ_SEED` the seed (printed, so a failure repeats).

use futures_util::{SinkExt, StreamExt};
use harness::gateway::GatewayOpts;
use harness::world::World;
use imfault_fuzz::Rng;
use scenarios::{connect, db_invariant_violations};
use serde_json::{json, Value};
use std::time::Duration;
use tokio_tungstenite::tungstenite::Message;

/// How long one frame may wait for its answer before it counts as a hang.
const ANSWER_WITHIN: Duration = Duration::from_secs(5);
const CONNECTIONS: u64 = 4;

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.replace('_', "").parse().ok())
        .unwrap_or(default)
}

/// One frame to send: mostly the parser fuzzer's frames, with enough valid hellos and
/// requests that the authenticated half of the state machine is reached.
fn next_frame(rng: &mut Rng, corpus: &[&str], token: &str, authed: bool) -> Message {
    match rng.below(20) {
        0..=3 if !authed => Message::text(
            json!({"t": "hello", "rid": "h", "device": "a1", "token": token, "epoch": 1})
                .to_string(),
        ),
        4..=7 => {
            let rid = format!("v{}", rng.below(1000));
            let v = match rng.below(5) {
                0 => json!({"t": "sub", "rid": rid}),
                1 => json!({"t": "send", "rid": rid, "conv": "c1",
                            "cmid": format!("fz{}", rng.below(50)), "body": "fuzz"}),
                2 => json!({"t": "ack", "rid": rid, "conv": "c1", "seq": rng.below(20)}),
                3 => json!({"t": "sync", "rid": rid, "conv": "c1", "after": rng.below(10),
                            "limit": 1 + rng.below(600)}),
                _ => json!({"t": "hello", "rid": rid, "device": "a1", "token": token, "epoch": 1}),
            };
            Message::text(v.to_string())
        }
        8 => {
            let n = rng.below(64);
            Message::binary((0..n).map(|_| rng.next_u64() as u8).collect::<Vec<u8>>())
        }
        9 if rng.chance(10) => Message::text("x".repeat(70_000)), // over IM_FRAME_MAX_BYTES
        _ => {
            let bytes = imfault_fuzz::generate(rng, corpus);
            Message::text(String::from_utf8_lossy(&bytes).into_owned())
        }
    }
}

/// Waits for the answer to the frame just sent: a non-push frame, or the end of the
/// connection. `Ok(true)`: the connection is still open.
async fn answer(ws: &mut Ws) -> anyhow::Result<bool> {
    let deadline = tokio::time::Instant::now() + ANSWER_WITHIN;
    loop {
        let m = tokio::time::timeout_at(deadline, ws.next())
            .await
            .map_err(|_| anyhow::anyhow!("no answer within {ANSWER_WITHIN:?} (a hang)"))?;
        match m {
            None | Some(Err(_)) | Some(Ok(Message::Close(_))) => return Ok(false),
            Some(Ok(Message::Text(t))) => {
                let v: Value = serde_json::from_str(t.as_str()).unwrap_or(Value::Null);
                if !matches!(v["t"].as_str(), Some("event" | "hint")) {
                    return Ok(true);
                }
            }
            Some(Ok(_)) => {}
        }
    }
}

async fn fuzz_connections(
    url: String,
    token: String,
    seed: u64,
    frames: u64,
) -> anyhow::Result<(u64, u64)> {
    let corpus = imfault_fuzz::corpus();
    let mut rng = Rng::new(seed);
    let (mut sent, mut reconnects) = (0u64, 0u64);
    while sent < frames {
        let (mut ws, _) = tokio_tungstenite::connect_async(&url).await?;
        let mut authed = false;
        loop {
            if sent >= frames {
                break;
            }
            let frame = next_frame(&mut rng, &corpus, &token, authed);
            if let Message::Text(t) = &frame {
                authed |= t.as_str().contains("\"t\":\"hello\"") && t.as_str().contains(&token);
            }
            sent += 1;
            if ws.send(frame).await.is_err() {
                break;
            }
            match answer(&mut ws).await {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => anyhow::bail!("frame {sent} of seed {seed}: {e}"),
            }
        }
        reconnects += 1;
    }
    Ok((sent, reconnects))
}

#[tokio::test]
async fn wire_fuzz_every_frame_is_answered_and_the_gateway_survives() {
    let frames = env_u64("IMFAULT_FUZZ_FRAMES", 2_000);
    let seed = env_u64("IMFAULT_FUZZ_SEED", 0x5eed);
    eprintln!("wire fuzz: {frames} frames, seed {seed} (IMFAULT_FUZZ_FRAMES, IMFAULT_FUZZ_SEED)");
    let w = World::start(GatewayOpts::default())
        .await
        .expect("start cluster and gateway");
    let (ta, tb) = scenarios::provision_alice_and_bob(&w).await.unwrap();
    let url = w.ws_url();
    let runs = (0..CONNECTIONS).map(|i| {
        fuzz_connections(
            url.clone(),
            ta.clone(),
            seed.wrapping_add(i),
            frames / CONNECTIONS,
        )
    });
    let results = futures_util::future::join_all(runs).await;
    let (mut sent, mut reconnects) = (0, 0);
    for r in results {
        let (s, c) = r.expect("a fuzzing connection found a hang or could not connect");
        sent += s;
        reconnects += c;
    }
    eprintln!("wire fuzz: {sent} frames answered over {reconnects} connections");
    assert!(sent >= frames - CONNECTIONS, "sent {sent} of {frames}");
    let mut w = w;
    assert!(
        w.gw_mut().try_exit_status().is_none(),
        "the gateway died: {}",
        w.gw().log_text()
    );
    let log = w.gw().log_text();
    assert!(!log.contains("panicked"), "the gateway panicked:\n{log}");
    // A well-behaved client is still served.
    let a = connect(&w, "a1", &ta).await.unwrap();
    let b = connect(&w, "b1", &tb).await.unwrap();
    a.sub().await.unwrap();
    b.sub().await.unwrap();
    let sent = a
        .send("c1", "after-fuzz", "still here", Duration::from_secs(10))
        .await
        .expect("send after the fuzz");
    let seq = sent["seq"].as_i64().unwrap();
    b.wait_cursor("c1", seq, Duration::from_secs(10))
        .await
        .expect("the receiver gets it");
    let v = db_invariant_violations(&w.admin.pool().await.unwrap())
        .await
        .unwrap();
    assert!(v.is_empty(), "database invariants violated: {v:?}");
}
