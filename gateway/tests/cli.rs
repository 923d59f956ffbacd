//! The gateway's command line (issue 9, item 2), run as the binary cargo built for this
//! test (`CARGO_BIN_EXE_im-gateway`, never a stale one): `--help` never starts anything and
//! lists every `IM_*` variable with its default; usage errors exit 2 without a backtrace; a
//! set `FAILPOINTS` is refused pointing to `IM_FAULT`; a database that cannot be reached is
//! named (host, port, cause) once, in one line, quickly; `im-gateway faults` lists every
//! point and action.
//!
//! Being an integration test of the `im-gateway` package, it also makes cargo build the
//! binary itself whenever the package's tests are built, with the features of that build:
//! `cargo nextest run --workspace --features im-gateway/faults` (and every `make mutants`
//! mutant) thereby leaves a fresh `target/debug/im-gateway` with fault points for the
//! scenario tests that run it.

use std::path::PathBuf;
use std::time::Duration;

/// The binary cargo built for this test.
fn gateway() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_im-gateway"))
}

/// [`harness::util::run_cleared`].
use harness::util::run_cleared as run;

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A TCP port on 127.0.0.1 nobody listens on (bound, then released).
fn dead_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    drop(l);
    port
}

/// `--help` on the gateway and on every command exits 0, prints usage and every `IM_*`
/// variable with its default (from `config::ENV`), and starts nothing: no database is
/// configured, so a server that started would fail, and no readiness line appears.
#[test]
fn gateway_help_exits_0_lists_every_variable_and_starts_nothing() {
    let bin = gateway();
    for args in [
        &["--help"][..],
        &["-h"],
        &["help"],
        &["serve", "--help"],
        &["--help", "serve"],
        &["migrate", "--help"],
        &["admin", "--help"],
        &["admin", "help"],
        &["admin", "add-device", "--help"],
        &["faults", "--help"],
        &["help", "serve"],
    ] {
        // IM_LISTEN on a port we hold: a gateway that tried to serve could not bind it.
        let held = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let listen = held.local_addr().expect("addr").to_string();
        let (out, _) = run(
            &bin,
            args,
            &[("IM_LISTEN", &listen)],
            Duration::from_secs(10),
        );
        let stdout = text(&out.stdout);
        assert!(
            out.status.success(),
            "{args:?}: {} {}",
            out.status,
            text(&out.stderr)
        );
        assert!(stdout.contains("Usage:"), "{args:?}: {stdout}");
        assert!(
            !stdout.lines().any(|l| l.starts_with("listening on")),
            "{args:?} started a server"
        );
        for v in im_gateway::config::ENV {
            let line = stdout
                .lines()
                .find(|l| l.trim_start().starts_with(&format!("{} ", v.name)))
                .unwrap_or_else(|| panic!("{args:?}: {} not listed:\n{stdout}", v.name));
            if !v.default.is_empty() {
                assert!(line.contains(v.default), "{args:?}: {line}");
            }
        }
    }
}

/// Usage errors print clap's message and exit 2, never a backtrace; flags go in any order.
#[test]
fn gateway_usage_errors_exit_2_without_a_backtrace() {
    let bin = gateway();
    for args in [
        &["bogus"][..],
        &["serve", "--bogus"],
        &["admin", "frobnicate"],
        &["admin", "add-device", "d1"],
        &["admin"],
        &[],
    ] {
        let (out, _) = run(
            &bin,
            args,
            &[("RUST_BACKTRACE", "1")],
            Duration::from_secs(10),
        );
        let all = text(&out.stdout) + &text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {all}");
        assert!(
            !all.contains("backtrace") && !all.contains("panicked"),
            "{args:?}: {all}"
        );
        assert!(all.contains("Usage:"), "{args:?}: {all}");
    }
    let (out, _) = run(&bin, &["admin", "frobnicate"], &[], Duration::from_secs(10));
    assert!(text(&out.stderr).contains("unknown or malformed admin command"));
    // Only an admin command with words after `admin` that clap refused says so: not a
    // bare `admin`, not another command's usage error, not a help request.
    for args in [
        &["admin"][..],
        &["serve", "--bogus", "x"],
        &["admin", "--help"],
        &["admin", "add-user", "--help"],
    ] {
        let (out, _) = run(&bin, args, &[], Duration::from_secs(10));
        let stderr = text(&out.stderr);
        assert!(
            !stderr.contains("unknown or malformed admin command"),
            "{args:?}: {stderr}"
        );
    }
    let (out, _) = run(&bin, &["version"], &[], Duration::from_secs(10));
    assert!(out.status.success());
    let (out2, _) = run(&bin, &["--version"], &[], Duration::from_secs(10));
    assert_eq!(text(&out.stdout), text(&out2.stdout));
    assert!(text(&out.stdout).starts_with("im-gateway "));
}

/// An armed `IM_FAULT` is announced on stderr before anything else (the faults build; the
/// build without fault points refuses it, exit 2), so an operator sees that a gateway runs
/// with fault points; without `IM_FAULT` nothing is announced.
#[test]
fn armed_fault_points_are_announced_before_anything_else() {
    let bin = gateway();
    let url = format!("postgres://im@127.0.0.1:{}/im", dead_port());
    let spec = "send.before_commit:halt";
    let env = [
        ("IM_DATABASE_URL", url.as_str()),
        ("IM_LISTEN", "127.0.0.1:0"),
    ];
    let (out, _) = run(
        &bin,
        &["serve"],
        &[env[0], env[1], ("IM_FAULT", spec)],
        Duration::from_secs(10),
    );
    let stderr = text(&out.stderr);
    if cfg!(feature = "faults") {
        let first = format!("im-gateway: fault points armed: {spec}");
        assert_eq!(stderr.lines().next(), Some(first.as_str()), "{stderr}");
        assert_eq!(out.status.code(), Some(1), "then the database: {stderr}");
    } else {
        assert_eq!(out.status.code(), Some(2), "{stderr}");
    }
    let (out, _) = run(&bin, &["serve"], &env, Duration::from_secs(10));
    let stderr = text(&out.stderr);
    assert!(!stderr.contains("fault points armed"), "{stderr}");
    assert_eq!(out.status.code(), Some(1), "{stderr}");
}

/// `IM_WORKER_THREADS` (issue 44) is read before the runtime starts: a value that is not a
/// number, or out of range, exits 2 naming it, before any connection.
#[test]
fn a_bad_worker_thread_count_is_refused_before_the_runtime_starts() {
    let url = format!("postgres://im@127.0.0.1:{}/im", dead_port());
    for bad in ["two", "-1", "1025"] {
        let (out, _) = run(
            &gateway(),
            &["serve"],
            &[("IM_WORKER_THREADS", bad), ("IM_DATABASE_URL", &url)],
            Duration::from_secs(10),
        );
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {stderr}");
        assert!(stderr.contains("IM_WORKER_THREADS"), "{bad}: {stderr}");
        assert!(!stderr.contains("cannot connect"), "{bad}: {stderr}");
    }
}

/// The fail crate's `FAILPOINTS` arms nothing here: it is refused (exit 2) with a message
/// naming `IM_FAULT`, before any connection.
#[test]
fn failpoints_is_refused_pointing_to_im_fault() {
    let bin = gateway();
    let url = format!("postgres://im@127.0.0.1:{}/im", dead_port());
    for args in [&["serve"][..], &["migrate"], &["admin", "add-user", "u1"]] {
        let (out, _) = run(
            &bin,
            args,
            &[("FAILPOINTS", "x"), ("IM_DATABASE_URL", &url)],
            Duration::from_secs(10),
        );
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains("FAILPOINTS") && stderr.contains("IM_FAULT"),
            "{stderr}"
        );
        assert!(
            !stderr.contains("cannot connect"),
            "it tried the database: {stderr}"
        );
    }
}

/// A wrong port answers at once, in one line naming host, port, database and the cause,
/// without the password and without a backtrace: not "pool timed out" after
/// IM_DB_TIMEOUT_MS (5 s by default).
#[test]
fn wrong_database_port_is_one_line_naming_host_port_and_cause() {
    let bin = gateway();
    let port = dead_port();
    let url = format!("postgres://im:s3cret-pw@127.0.0.1:{port}/imdb");
    for args in [&["serve"][..], &["migrate"], &["admin", "add-user", "u1"]] {
        let (out, took) = run(
            &bin,
            args,
            &[
                ("IM_DATABASE_URL", &url),
                ("IM_LISTEN", "127.0.0.1:0"),
                ("RUST_BACKTRACE", "1"),
            ],
            Duration::from_secs(10),
        );
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(took < Duration::from_secs(3), "{args:?} took {took:?}");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        let want = format!(
            "im-gateway: cannot connect to PostgreSQL at 127.0.0.1:{port} (database imdb): connection refused"
        );
        assert_eq!(lines, vec![want.as_str()], "{args:?}");
        assert!(!stderr.contains("s3cret-pw"));
        assert!(text(&out.stdout).is_empty(), "{args:?}");
    }
}

/// Issue 21: a `synchronous_commit` the gateway does not know is refused before anything
/// starts, naming the values it takes.
#[test]
fn an_unknown_synchronous_commit_is_refused_by_name() {
    let (out, _) = run(
        &gateway(),
        &["serve"],
        &[
            ("IM_DATABASE_URL", "postgres://im@127.0.0.1:1/imdb"),
            ("IM_LISTEN", "127.0.0.1:0"),
            ("IM_SYNCHRONOUS_COMMIT", "sometimes"),
        ],
        Duration::from_secs(10),
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("IM_SYNCHRONOUS_COMMIT=sometimes is not one of off, local, remote_write, on, remote_apply"),
        "{stderr}"
    );
}

/// `im-gateway bugs` lists every deliberate bug with its description, and a build without
/// the `bugs` feature says that it refuses `IM_BUG`.
#[test]
fn bugs_lists_every_bug_and_says_whether_this_build_has_them() {
    let (out, _) = run(&gateway(), &["bugs"], &[], Duration::from_secs(10));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    for b in im_gateway::bugs::Bug::ALL {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("{} ", b.name())))
            .unwrap_or_else(|| panic!("{b} missing:\n{stdout}"));
        assert!(line.contains(b.describe()), "{line}");
    }
    assert_eq!(
        stderr.contains("this build has no `bugs` feature: IM_BUG is refused"),
        !im_gateway::bugs::ENABLED,
        "{stderr}"
    );
}

/// `im-gateway faults` lists every point (what it does, where) and every action.
#[cfg(feature = "faults")]
#[test]
fn faults_lists_every_point_and_action() {
    let (out, _) = run(&gateway(), &["faults"], &[], Duration::from_secs(10));
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    for p in im_gateway::faults::points::ALL {
        let line = stdout
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{p} ")))
            .unwrap_or_else(|| panic!("{p} missing:\n{stdout}"));
        assert!(line.len() > p.len() + 20, "no description: {line}");
    }
    for a in ["halt", "drop", "delay(MS)", "error"] {
        assert!(
            stdout
                .lines()
                .any(|l| l.trim_start().starts_with(&format!("{a} "))),
            "{a} missing:\n{stdout}"
        );
    }
    assert!(stdout.contains("point:action[:skip[:count]]"));
}
