//! The command lines that need more than the gateway binary (issue 9, item 2; the
//! gateway's own are `gateway/tests/cli.rs`): a database that does not exist is named once;
//! the scenario binaries' `--help` and usage errors; `repro` prints JSON, ends with one
//! verdict line and cleans up.
//!
//! Each test runs the built binaries with `std::process::Command` (the gateway the harness
//! finds, refused when stale; the scenario binaries cargo built for this test).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

/// The gateway binary `make build` made (the harness's look-up).
fn gateway() -> PathBuf {
    harness::gateway::gateway_bin().expect("the gateway binary (run `make build`)")
}

/// [`harness::util::run_cleared`].
use harness::util::run_cleared as run;

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A database that does not exist on a running server is named as such, once.
#[tokio::test]
async fn missing_database_is_named() {
    let pg = harness::pg::Cluster::start().await.expect("a cluster");
    let url = format!("postgres://postgres@127.0.0.1:{}/nosuchdb", pg.port());
    let bin = gateway();
    let (out, took) = tokio::task::spawn_blocking(move || {
        run(
            &bin,
            &["migrate"],
            &[("IM_DATABASE_URL", &url)],
            Duration::from_secs(10),
        )
    })
    .await
    .expect("join");
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert_eq!(
        stderr.trim(),
        format!(
            "im-gateway: cannot connect to PostgreSQL at 127.0.0.1:{} (database nosuchdb): \
             database \"nosuchdb\" does not exist",
            pg.port()
        )
    );
}

/// The scenario binaries' `--help` starts nothing, exits 0, and lists the harness's
/// variables; a usage error exits 2.
#[test]
fn scenario_binaries_help_and_usage_errors() {
    for (bin, vars) in [
        (
            env!("CARGO_BIN_EXE_repro"),
            &["IMFAULT_KEEP", "IMFAULT_PG_BIN_DIR", "IM_GATEWAY_BIN"][..],
        ),
        (
            env!("CARGO_BIN_EXE_evidence"),
            &["IMFAULT_KEEP", "IMFAULT_KEEP_FAILED", "CARGO"],
        ),
        (
            env!("CARGO_BIN_EXE_controls"),
            &["IMFAULT_KEEP", "IMFAULT_PG_BIN_DIR", "CARGO"],
        ),
        (
            env!("CARGO_BIN_EXE_up"),
            &["IMFAULT_KEEP", "IMFAULT_PG_BIN_DIR"],
        ),
        (env!("CARGO_BIN_EXE_imfault-check"), &[]),
    ] {
        let bin = std::path::Path::new(bin);
        let (out, _) = run(bin, &["--help"], &[], Duration::from_secs(10));
        let stdout = text(&out.stdout);
        assert!(
            out.status.success(),
            "{}: {}",
            bin.display(),
            text(&out.stderr)
        );
        assert!(stdout.contains("Usage:"), "{}: {stdout}", bin.display());
        for v in vars {
            assert!(
                stdout.contains(v),
                "{}: {v} missing:\n{stdout}",
                bin.display()
            );
        }
        let (out, _) = run(bin, &["--no-such-flag"], &[], Duration::from_secs(10));
        assert_eq!(out.status.code(), Some(2), "{}", bin.display());
    }
    // repro checks its fault with the gateway's parser before starting anything.
    let (out, took) = run(
        std::path::Path::new(env!("CARGO_BIN_EXE_repro")),
        &["send.before_comit:halt"],
        &[],
        Duration::from_secs(10),
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("send.before_commit"));
    assert!(took < Duration::from_secs(3));
    // durability refuses a job count outside 1..=8 before starting anything.
    for jobs in ["0", "9"] {
        let (out, took) = run(
            std::path::Path::new(env!("CARGO_BIN_EXE_durability")),
            &["--jobs", jobs],
            &[],
            Duration::from_secs(10),
        );
        assert_eq!(out.status.code(), Some(2), "--jobs {jobs}");
        assert!(text(&out.stderr).contains("--jobs"), "--jobs {jobs}");
        assert!(took < Duration::from_secs(3));
    }
}

/// `repro` prints one JSON document, then one verdict line, exits 0 when every invariant
/// held, and removes its work directory (named after its pid) unless `--keep`.
#[test]
fn repro_prints_json_then_a_verdict_and_cleans_up() {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_repro"));
    let gw = gateway();
    let gw = gw.to_str().expect("utf-8 path");
    for keep in [false, true] {
        let mut args = vec!["gw.reply.send:drop:0:1"];
        if keep {
            args.insert(0, "--keep");
        }
        let mut cmd = Command::new(bin);
        cmd.args(&args)
            .env("IM_GATEWAY_BIN", gw)
            .env_remove("IMFAULT_KEEP")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = cmd.spawn().expect("spawn repro");
        let pid = child.id();
        let out = child.wait_with_output().expect("repro output");
        let stdout = text(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{stdout}\n{}",
            text(&out.stderr)
        );
        let lines: Vec<&str> = stdout.lines().collect();
        let verdict = *lines.last().expect("a last line");
        assert_eq!(verdict, "verdict: HELD D1 D2 D3 D4 D5 D6 P1 S1", "{stdout}");
        let json_end = lines
            .iter()
            .position(|l| *l == "}")
            .expect("the JSON document ends");
        let doc: serde_json::Value =
            serde_json::from_str(&lines[..=json_end].join("\n")).expect("the output is JSON");
        assert_eq!(doc["fault"], "gw.reply.send:drop:0:1");
        assert_eq!(doc["checker"]["verdict"], "PASS", "{doc}");
        assert_eq!(doc["events_rows_c1"], 1, "{doc}");
        let prefix = format!("imfault-{pid}-");
        // Where the harness made it: under cargo-nextest a RAM file system (`work_base`).
        let left: Vec<PathBuf> = std::fs::read_dir(harness::pg::work_base())
            .expect("list the temporary directory")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(&prefix))
            })
            .collect();
        if keep {
            let kept = doc["kept"]["work_dir"].as_str().expect("the kept path");
            assert!(
                lines.contains(&format!("kept: {kept}").as_str()),
                "{stdout}"
            );
            assert_eq!(left, vec![PathBuf::from(kept)]);
            std::fs::remove_dir_all(kept).expect("remove the kept directory");
        } else {
            assert!(doc["kept"].is_null(), "{doc}");
            assert!(left.is_empty(), "left behind: {left:?}");
        }
    }
}
