//! The nemesis in `make test` (issue 10): one short seed as a smoke test, on the real gateway
//! and a throwaway cluster. `make nemesis` runs 20 full seeds; `make controls` runs each
//! deliberate bug under it.

use harness::nemesis::faults::Package as _;
use harness::nemesis::{generate, run, Options, Schedule};

/// The smoke options: a 4 s faulty phase with 4 faults.
fn smoke_options() -> Options {
    Options {
        duration_ms: 4000,
        faults: 4,
        ..Options::default()
    }
}

/// The first seed whose schedule arms a fault point through the control socket and acts
/// on the database, so the smoke run exercises both paths (chosen from the generator
/// alone: the same seed every time).
fn smoke_seed(o: &Options) -> (u64, Schedule) {
    (1..1000)
        .map(|seed| (seed, generate(seed, o).expect("generate")))
        .find(|(_, s)| {
            let has = |k: &[&str]| s.faults.iter().any(|f| k.contains(&f.kind.name()));
            // On a plain data directory (the disk faults and the power cuts have checks
            // of their own, NOT_RUN where FUSE is missing).
            has(&["gw-crash-point", "gw-fault"])
                && has(&["pg-crash", "pg-pause", "net-db"])
                && !s.needs_lazyfs()
                && !s.needs_formation()
        })
        .expect("a seed with a control-socket fault and a database fault")
}

/// The run's directory when it passed; otherwise the test fails, its artefacts kept.
fn passed_or_kept(
    seed: u64,
    out: &harness::nemesis::Outcome,
    dir: tempfile::TempDir,
) -> tempfile::TempDir {
    if !out.verdict.is_pass() {
        let kept = dir.keep();
        panic!(
            "seed {seed}: {} {:?} {:?}; first anomalies: {:#?}; artefacts kept in {}",
            out.verdict,
            out.error,
            out.anomalies,
            out.first_anomalies,
            kept.display()
        );
    }
    dir
}

/// D1–D6, P1, S1 under a random schedule: one seed's workload under its faults, healed and
/// judged by the checker over the whole history, shows no anomaly; every fault was carried
/// out (the control socket answered `ok`); the artefacts are written and `schedule.json`
/// is byte for byte the schedule the seed generates.
#[tokio::test]
async fn nemesis_smoke_one_short_seed() {
    let o = smoke_options();
    let (seed, schedule) = smoke_seed(&o);
    let dir = tempfile::tempdir().expect("tempdir");
    let out = run(&schedule, dir.path(), format!("smoke seed {seed}")).await;
    let dir = passed_or_kept(seed, &out, dir);
    for name in [
        "schedule.json",
        "history.jsonl",
        "result.json",
        "report.html",
        "final.json",
    ] {
        assert!(dir.path().join(name).is_file(), "{name} missing");
    }
    let written = std::fs::read_to_string(dir.path().join("schedule.json")).unwrap();
    assert_eq!(written, generate(seed, &o).unwrap().to_json());
    assert_eq!(Schedule::from_json(&written).unwrap(), schedule);
    assert_eq!(out.fault_log.len(), schedule.faults.len());
    for (f, l) in schedule.faults.iter().zip(&out.fault_log) {
        assert!(
            l["start"].get("error").is_none(),
            "fault {} ({}) was not carried out: {l}",
            f.id,
            f.kind.name()
        );
        if matches!(f.kind.name(), "gw-crash-point" | "gw-fault") {
            let r = l["start"]["control"].as_str().unwrap_or("");
            assert!(r.starts_with("ok armed"), "control socket: {l}");
        }
    }
    let html = std::fs::read_to_string(dir.path().join("report.html")).unwrap();
    assert!(
        html.contains("<svg") && html.contains("PASS"),
        "report.html"
    );
    assert!(
        out.ops.get("send").is_some_and(|c| c.ok > 10),
        "{:?}",
        out.ops
    );
}

/// Issue 21: the nemesis on three gateways behind HAProxy (the clients' one address). The
/// first seed whose schedule kills or crashes a gateway other than the first and arms a
/// fault point through another gateway's control socket: it passes the checker (D5 judged
/// across gateways), every fault was carried out on the gateway it names, and the devices
/// were served by more than one gateway. Where HAProxy is not installed: SKIPPED.
#[tokio::test]
async fn nemesis_on_three_gateways_behind_haproxy() {
    if let Err(why) = harness::balancer::haproxy_bin() {
        println!("SKIPPED: {why}");
        return;
    }
    let o = Options {
        gateways: 3,
        ..smoke_options()
    };
    let (seed, schedule) = (1..1000)
        .map(|seed| (seed, generate(seed, &o).expect("generate")))
        .find(|(_, s)| {
            let on = |k: &[&str]| {
                s.faults
                    .iter()
                    .any(|f| k.contains(&f.kind.name()) && f.target != "gateway-0")
            };
            on(&["gw-kill", "gw-crash-point"])
                && on(&["gw-fault", "gw-crash-point"])
                && !s.needs_lazyfs()
                && !s.needs_formation()
        })
        .expect("a seed with faults on the other gateways");
    let dir = tempfile::tempdir().expect("tempdir");
    let out = run(
        &schedule,
        dir.path(),
        format!("three gateways, seed {seed}"),
    )
    .await;
    let dir = passed_or_kept(seed, &out, dir);
    for (f, l) in schedule.faults.iter().zip(&out.fault_log) {
        assert!(
            l["start"].get("error").is_none(),
            "fault {} ({} on {}) was not carried out: {l}",
            f.id,
            f.kind.name(),
            f.target
        );
    }
    let served: Vec<usize> = (0..3)
        .filter(|i| {
            std::fs::read_to_string(dir.path().join(format!("logs/gateway-{i}.log")))
                .is_ok_and(|log| log.contains("connection opened"))
        })
        .collect();
    assert!(
        served.len() >= 2,
        "devices served only by gateways {served:?}"
    );
    let written = std::fs::read_to_string(dir.path().join("schedule.json")).unwrap();
    assert!(
        written.contains("\"gateways\": 3"),
        "the schedule records its gateways"
    );
    assert_eq!(Schedule::from_json(&written).unwrap(), schedule);
}

/// Issue 21: the nemesis on a pg_auto_failover formation (monitor, primary, secondary; the
/// address follows the monitor). The first seed whose schedule loses both the primary
/// (`pg-autofailover`: the monitor must detect it and promote the secondary) and the
/// monitor (`pg-autofailover-monitor`: the data nodes run on), among gateway and network
/// faults: it passes the checker, each fault was carried out, the monitor promoted node2,
/// and with the synchronous standby pg_auto_failover set up nothing acknowledged was lost
/// (no expected loss either). Where pg_autoctl is not installed: SKIPPED.
#[tokio::test]
async fn nemesis_on_a_pg_auto_failover_formation() {
    if let Err(why) = harness::autofailover::available() {
        println!("SKIPPED: {why}");
        return;
    }
    let o = harness::nemesis::Options {
        faults: 4,
        kinds: [
            "pg-autofailover",
            "pg-autofailover-monitor",
            "gw-kill",
            "net-db",
        ]
        .map(String::from)
        .to_vec(),
        ..harness::nemesis::Options::default()
    };
    let (seed, schedule) = (1..1000)
        .map(|seed| (seed, generate(seed, &o).expect("generate")))
        .find(|(_, s)| {
            let has = |k: &str| s.faults.iter().any(|f| f.kind.name() == k);
            has("pg-autofailover") && has("pg-autofailover-monitor")
        })
        .expect("a seed that loses the primary and the monitor");
    let dir = tempfile::tempdir().expect("tempdir");
    let out = run(&schedule, dir.path(), format!("formation, seed {seed}")).await;
    let _dir = passed_or_kept(seed, &out, dir);
    let mut promoted = None;
    let mut synchronous = None;
    for (f, l) in schedule.faults.iter().zip(&out.fault_log) {
        assert!(
            l["start"].get("error").is_none() && l["end"].get("error").is_none(),
            "fault {} ({}) was not carried out: {l}",
            f.id,
            f.kind.name()
        );
        if f.kind.name() == "pg-autofailover" {
            promoted = l["end"]["promoted"]["promoted"]
                .as_str()
                .map(str::to_string);
            synchronous =
                Some(l["start"]["primary_killed"]["replication"]["mode"] == "synchronous");
        }
    }
    assert_eq!(promoted.as_deref(), Some("node2"), "{:?}", out.fault_log);
    if synchronous == Some(true) {
        assert_eq!(out.expected_loss, 0, "a synchronous standby loses nothing");
    }
}
