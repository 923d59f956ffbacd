//! The bench instrument works end to end: `imfault-bench --mode smoke` (a real throwaway
//! cluster, the real gateway binary, pgbench when installed, tiny sizes) must write a result
//! with every section measured and no acknowledged message missing from the database.
//!
//! This is a smoke test of the instrument, never a timing assertion: it runs the debug
//! gateway `make build` made (with fault points, which the repair part needs anyway) and on a
//! machine busy with other tests, so no figure in the file is checked against a bound.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn smoke_run_measures_every_part_and_loses_no_acknowledged_message() {
    let bench = env!("CARGO_BIN_EXE_imfault-bench");
    // The harness's look-up: target/debug/im-gateway, refused when missing or stale.
    let gateway = harness::gateway::gateway_bin().expect("the gateway binary (run `make build`)");
    let out: PathBuf =
        std::env::temp_dir().join(format!("imfault-bench-smoke-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&out);
    let started = Instant::now();
    let run = Command::new(bench)
        .args(["--mode", "smoke", "--allow-faults-gateway", "--out"])
        .arg(&out)
        .arg("--gateway-bin")
        .arg(&gateway)
        .arg("--fault-gateway-bin")
        .arg(&gateway)
        .env_remove("IM_GATEWAY_BIN")
        .output()
        .expect("run imfault-bench");
    let took = started.elapsed();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    let text = std::fs::read_to_string(&out).unwrap_or_else(|e| {
        panic!(
            "no result at {} ({e}); stdout:\n{stdout}\nstderr:\n{stderr}",
            out.display()
        )
    });
    let r: serde_json::Value = serde_json::from_str(&text).expect("the result is JSON");
    assert_eq!(r["schema_version"], 3, "{text}");
    assert_eq!(r["mode"], "smoke");
    assert!(
        run.status.success() && r["data_integrity"] == "PASS",
        "the smoke run failed ({}): {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        run.status,
        r["failures"]
    );
    // Targets are judged and reported, never asserted here (timings mean nothing in smoke
    // mode), and never change the exit status.
    assert!(
        ["PASS", "FAIL", "NOT_RUN"].contains(&r["targets_met"].as_str().unwrap_or("")),
        "targets_met: {}",
        r["targets_met"]
    );
    check_metrics(&r);
    check_environment(&r);
    check_sections(&r);
    // Not a timing assertion: only a guard that the smoke sizes stay small.
    assert!(
        took < Duration::from_secs(100),
        "the smoke run took {took:?}"
    );
    let _ = std::fs::remove_file(&out);
}

/// The flat metrics: each has a name and a unit; a target (an `op`) has a limit and is
/// judged exactly when it has a value, a measurement is never judged; targets_met and
/// targets_missed follow from them alone. The two-gateway figures are there and positive.
fn check_metrics(r: &serde_json::Value) {
    let metrics = r["metrics"].as_array().expect("metrics");
    assert!(metrics.len() >= 10, "{}", r["metrics"]);
    let mut missed = 0;
    for m in metrics {
        assert!(
            m["name"].as_str().is_some_and(|n| !n.is_empty())
                && m["unit"].as_str().is_some_and(|u| !u.is_empty()),
            "{m}"
        );
        match m["op"].as_str() {
            Some(op) => {
                assert!(["le", "ge"].contains(&op) && m["limit"].is_number(), "{m}");
                let (v, l) = (m["value"].as_f64(), m["limit"].as_f64().unwrap_or(0.0));
                let want = v.map(|v| if op == "le" { v <= l } else { v >= l });
                assert_eq!(m["met"].as_bool(), want, "{m}");
                missed += usize::from(want == Some(false));
            }
            None => assert!(m["met"].is_null(), "{m}"),
        }
    }
    assert_eq!(
        r["targets_missed"].as_array().map(Vec::len),
        Some(missed),
        "{}",
        r["targets_missed"]
    );
    assert_eq!(r["targets_met"] == "FAIL", missed > 0);
    for name in [
        "two_gateways.one.sends_per_s",
        "two_gateways.two.sends_per_s",
        "two_gateways.sends_two_vs_one",
        "two_gateways.pushes_two_vs_one",
    ] {
        assert!(
            metrics
                .iter()
                .any(|m| m["name"] == name && m["value"].as_f64().is_some_and(|v| v > 0.0)),
            "{name} missing or zero"
        );
    }
}

/// The environment names what the run ran on.
fn check_environment(r: &serde_json::Value) {
    let env = &r["environment"];
    for field in [
        "postgres_version",
        "fsync",
        "synchronous_commit",
        "git_commit",
        "started_at",
    ] {
        assert!(
            env[field].as_str().is_some_and(|s| !s.is_empty()),
            "environment.{field} missing"
        );
    }
    assert_eq!(env["host_cores"].as_u64().map(|n| n > 0), Some(true));
    assert!(env["load_avg_start"]
        .as_array()
        .is_some_and(|a| a.len() == 3));
    assert!(env["load_avg_end"].as_array().is_some_and(|a| a.len() == 3));
}

/// Every section measured, and no acknowledged message missing from the database.
fn check_sections(r: &serde_json::Value) {
    for section in ["send_path", "fanout", "sweep", "repair", "two_gateways"] {
        assert_eq!(
            r[section]["status"], "ok",
            "{section}: {}",
            r[section]["reason"]
        );
        assert!(r[section]["data"].is_object(), "{section} has no data");
    }
    // No data loss anywhere: every acknowledged message is a row.
    for section in ["send_path", "fanout", "repair", "two_gateways"] {
        let c = &r[section]["data"]["data_check"];
        assert_eq!(c["result"], "PASS", "{section}: {c}");
        assert_eq!(c["lost"], 0, "{section}: {c}");
        assert!(
            c["acknowledged"].as_u64().is_some_and(|n| n > 0),
            "{section} acknowledged nothing: {c}"
        );
    }
    check_send(r);
    check_other_parts(r);
}

/// The send path measured the gateway and, where pgbench is installed, pgbench with
/// NOTIFY, whose rows all landed.
fn check_send(r: &serde_json::Value) {
    let send = &r["send_path"]["data"];
    assert!(!send["levels"].as_array().expect("levels").is_empty());
    assert!(send["levels"][0]["gateway"]["ops"]
        .as_u64()
        .is_some_and(|n| n > 0));
    if r["environment"]["pgbench_bin"]
        .as_str()
        .is_none_or(|s| s != "none")
    {
        assert_eq!(
            send["pgbench_check"]["result"], "PASS",
            "{}",
            send["pgbench_check"]
        );
        assert!(send["levels"][0]["pgbench_notify"]["ops"]
            .as_u64()
            .is_some_and(|n| n > 0));
    }
}

/// Fan-out received frames and took its ceiling, the sweep returned rows, every lost push
/// was repaired, and pushes crossed between two gateways.
fn check_other_parts(r: &serde_json::Value) {
    let fanout = &r["fanout"]["data"];
    assert!(fanout["steps"].as_array().is_some_and(|s| !s.is_empty()));
    assert!(fanout["steps"][0]["frames_received"]
        .as_u64()
        .is_some_and(|n| n > 0));
    assert!(fanout["ws_ceiling"]["frames_per_s"]
        .as_f64()
        .is_some_and(|f| f > 0.0));
    let sweep = &r["sweep"]["data"];
    let rows = sweep["rows"].as_array().expect("sweep rows");
    assert!(
        rows.len() >= 2
            && rows
                .iter()
                .any(|row| row["rows_returned"].as_u64() > Some(0))
    );
    let repair = &r["repair"]["data"];
    for i in repair["intervals"].as_array().expect("repair intervals") {
        assert_eq!(i["unrepaired"], 0, "a lost push was never repaired: {i}");
        assert_eq!(
            i["pushes_received"], 0,
            "gw.push:drop let a push through: {i}"
        );
    }
    let two = &r["two_gateways"]["data"];
    assert_eq!(
        (
            two["one"]["gateways"].as_u64(),
            two["two"]["gateways"].as_u64()
        ),
        (Some(1), Some(2))
    );
    assert!(
        two["two"]["pushes"].as_u64().is_some_and(|n| n > 0),
        "{two}"
    );
}
