//! `make evidence`: runs every im-06 check (tests/im06.rs) under cargo-nextest, one process
//! and one fresh cluster per check, collects the record each wrote, and writes
//! evidence/im-06/result.json (format: evidence/README.md). Exits non-zero if any check
//! failed or wrote no record. It never invents an observation: a check without a record is
//! a FAIL with that reason.

use anyhow::{bail, Context};
use scenarios::{git, rfc3339, target_dir, workspace};
use scenarios::{im06_not_run, Record, Verdict, IM06_CHECKS, SCHEMA_VERSION};
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use std::time::{Instant, SystemTime};

fn read_records(dir: &Path) -> anyhow::Result<Vec<Record>> {
    let mut out = Vec::new();
    if !dir.exists() {
        return Ok(out);
    }
    for entry in std::fs::read_dir(dir).with_context(|| format!("read {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "json")
            && !path
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        {
            let text = std::fs::read(&path).with_context(|| format!("read {}", path.display()))?;
            out.push(
                serde_json::from_slice(&text)
                    .with_context(|| format!("parse {}", path.display()))?,
            );
        }
    }
    Ok(out)
}

/// Every im-06 check under cargo-nextest, its records written to `records_dir`.
fn run_checks(
    cargo: &str,
    records_dir: &Path,
    root: &Path,
) -> anyhow::Result<std::process::ExitStatus> {
    Command::new(cargo)
        .args([
            "nextest",
            "run",
            "--workspace",
            "--features",
            "im-gateway/faults",
            "--no-fail-fast",
        ])
        .args(["-E", "binary(im06)"])
        .env("IMFAULT_EVIDENCE_DIR", records_dir)
        .env("RUST_BACKTRACE", "0")
        .current_dir(root)
        .status()
        .context("run cargo nextest (is cargo-nextest installed? `make setup`)")
}

/// evidence/im-06/result.json, in the order a reader wants it.
#[derive(serde::Serialize)]
struct Doc<'a> {
    schema_version: u32,
    summary: Value,
    suite: &'a str,
    design_note: &'a str,
    generated_by: &'a str,
    environment: Value,
    checks: &'a [Record],
}

/// Run every im-06 check under cargo-nextest (one process and one fresh cluster per check)
/// and write evidence/im-06/result.json (format: evidence/README.md). Exits 1 if any check
/// failed or wrote no record.
#[derive(clap::Parser, Debug)]
#[command(
    name = "evidence",
    after_help = concat!(
        include_str!("harness_env.txt"),
        "  CARGO                   the cargo that runs nextest [default: cargo]\n\
         (evidence sets IMFAULT_EVIDENCE_DIR for the checks it starts.)"
    )
)]
struct Args {
    /// Run nothing: judge the records an earlier run of the im-06 checks wrote to this
    /// directory (`IMFAULT_EVIDENCE_DIR` of that run: `make proof` runs the whole suite
    /// once with it and writes the evidence from that run). `nextest_exit_code` is then
    /// null and `environment.records_from` names the directory.
    #[arg(long, value_name = "DIR")]
    records: Option<std::path::PathBuf>,
}

/// This run's directory (each run keeps its records under its own; `latest` points at the
/// newest) and where the records are read from (`--records`, or the run's `records/`).
fn run_dirs(
    args: &Args,
    generated_at: &str,
) -> anyhow::Result<(std::path::PathBuf, std::path::PathBuf)> {
    let runs = target_dir().join("imfault-runs");
    let run_dir = runs.join(format!("evidence-{}", generated_at.replace([':', '-'], "")));
    let records_dir = args
        .records
        .clone()
        .unwrap_or_else(|| run_dir.join("records"));
    std::fs::create_dir_all(&records_dir)
        .with_context(|| format!("create {}", records_dir.display()))?;
    let latest = runs.join("latest");
    let _ = std::fs::remove_file(&latest);
    if let Err(e) = std::os::unix::fs::symlink(&run_dir, &latest) {
        eprintln!("evidence: could not link {}: {e}", latest.display());
    }
    eprintln!("evidence: this run's records: {}", run_dir.display());
    Ok((run_dir, records_dir))
}

/// One record per im-06 check, in the checks' order, from what `records_dir` holds: a
/// check without a record FAILs (its test did not run or crashed). `whole_suite`: the
/// directory holds every test's records, and only the im-06 checks' are kept; otherwise a
/// record with an unknown id is an error.
fn im06_records(records_dir: &std::path::Path, whole_suite: bool) -> anyhow::Result<Vec<Record>> {
    let mut found = read_records(records_dir)?;
    if whole_suite {
        found.retain(|r| IM06_CHECKS.iter().any(|c| c.id == r.id));
    }
    let mut checks: Vec<Record> = Vec::new();
    for info in IM06_CHECKS {
        let (id, test) = (info.id, info.test);
        match found.iter().position(|r| r.id == id) {
            Some(i) => {
                let mut r = found.swap_remove(i);
                r.invariants = info.invariants.iter().map(|s| s.to_string()).collect();
                r.what = info.what.to_string();
                checks.push(r)
            }
            None => {
                let mut r = Record {
                    id: id.to_string(),
                    kind: "unknown".into(),
                    invariants: info.invariants.iter().map(|s| s.to_string()).collect(),
                    what: info.what.to_string(),
                    fault: None,
                    expected: Default::default(),
                    observed: Default::default(),
                    result: Verdict::Fail,
                    reason: Some(format!("no record written: test {test} did not run or crashed before finishing (see the nextest output)")),
                    duration_ms: 0,
                    postgres: None,
                    checker: None,
                    kept: None,
                };
                r.observed.insert("record".into(), Value::Null);
                checks.push(r);
            }
        }
    }
    if !found.is_empty() {
        bail!(
            "records with unknown ids: {:?}",
            found.iter().map(|r| &r.id).collect::<Vec<_>>()
        );
    }
    Ok(checks)
}

/// Runs the im-06 checks, or with `--records` runs nothing and judges that directory:
/// nextest's exit status, or none when nothing ran.
fn run_unless_given(
    args: &Args,
    cargo: &str,
    records_dir: &Path,
    root: &Path,
) -> anyhow::Result<Option<std::process::ExitStatus>> {
    Ok(if let Some(dir) = &args.records {
        eprintln!(
            "evidence: judging the records of {} (nothing run)",
            dir.display()
        );
        None
    } else {
        eprintln!(
            "evidence: running {} im-06 checks under cargo-nextest",
            IM06_CHECKS.len()
        );
        Some(run_checks(cargo, records_dir, root)?)
    })
}

/// The PostgreSQL the checks' clusters reported: the same for all, else a mark that it
/// differs per check, or null when no check reported one.
fn reported_postgres(checks: &[Record]) -> Value {
    // The environment is what the clusters reported, not what we configured.
    let pg: Vec<&Value> = checks.iter().filter_map(|r| r.postgres.as_ref()).collect();
    match pg.first() {
        Some(first) if pg.iter().all(|p| p == first) => (*first).clone(),
        Some(_) => json!({"differs_per_check": true}),
        None => Value::Null,
    }
}

/// Writes evidence/im-06/result.json, atomically, where this run publishes (creating
/// its directory), and returns that path.
fn write_doc(doc: &Doc, root: &Path) -> anyhow::Result<std::path::PathBuf> {
    let out = harness::util::publish_path(&root.join("evidence/im-06/result.json"));
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    harness::util::write_atomic(&out, (serde_json::to_string_pretty(doc)? + "\n").as_bytes())?;
    Ok(out)
}

/// Prints where the result went and how long the run took, then one line per check:
/// its result, id and reason.
fn print_checks(out: &Path, root: &Path, started: Instant, checks: &[Record]) {
    println!(
        "\n{} ({} s)",
        out.strip_prefix(root).unwrap_or(out).display(),
        started.elapsed().as_secs()
    );
    for r in checks {
        println!(
            "  {:<8} {:<34} {}",
            r.result,
            r.id,
            r.reason.as_deref().unwrap_or("")
        );
    }
}

fn main() -> anyhow::Result<()> {
    let args: Args = clap::Parser::parse();
    let started = Instant::now();
    let generated_at = rfc3339(SystemTime::now());
    let root = workspace();
    let (run_dir, records_dir) = run_dirs(&args, &generated_at)?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = run_unless_given(&args, &cargo, &records_dir, &root)?;

    let mut checks = im06_records(&records_dir, args.records.is_some())?;
    let postgres = reported_postgres(&checks);
    checks.extend(im06_not_run());
    let count = |v: Verdict| checks.iter().filter(|r| r.result == v).count();
    let (pass, fail, not_run) = (
        count(Verdict::Pass),
        count(Verdict::Fail),
        count(Verdict::NotRun),
    );
    let dirty =
        git(&["status", "--porcelain", "--", ".", ":(exclude)evidence"]).map(|s| !s.is_empty());
    // Summary first: a reader (or `head`) sees the verdict before the details (a struct,
    // because a JSON map would sort its keys).
    let doc = Doc {
        schema_version: SCHEMA_VERSION,
        summary: json!({
            "total": checks.len(), "pass": pass, "fail": fail, "not_run": not_run,
            "wall_ms": started.elapsed().as_millis() as u64,
            "nextest_exit_code": status.and_then(|s| s.code()),
        }),
        suite: "im-06",
        design_note: "shared/seed/06-send-ack-and-recoverable-delivery.zh.md (sections 8 and 9)",
        generated_by: "make evidence (scenarios/src/bin/evidence.rs)",
        environment: json!({
            "postgres": postgres,
            "git_commit": git(&["rev-parse", "HEAD"]),
            "git_dirty": dirty,
            "generated_at": generated_at,
            "host_cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "os": std::env::consts::OS,
            "arch": std::env::consts::ARCH,
            "gateway_binary": "target/debug/im-gateway (built with --features faults)",
            "run_dir": run_dir.strip_prefix(&root).unwrap_or(&run_dir),
            "records_from": args.records.as_ref().map(|d| d.strip_prefix(&root).unwrap_or(d).display().to_string()),
        }),
        checks: &checks,
    };
    let out = write_doc(&doc, &root)?;

    print_checks(&out, &root, started, &checks);
    println!("  {pass} PASS, {fail} FAIL, {not_run} NOT_RUN");
    if fail > 0 || status.is_some_and(|s| !s.success()) {
        std::process::exit(1);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn rfc3339_known_instants() {
        use std::time::{Duration, UNIX_EPOCH};
        assert_eq!(scenarios::rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        assert_eq!(
            scenarios::rfc3339(UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "2000-02-29T00:00:00Z"
        );
        assert_eq!(
            scenarios::rfc3339(UNIX_EPOCH + Duration::from_secs(1_796_031_218)),
            "2026-11-30T09:33:38Z"
        );
    }
}
