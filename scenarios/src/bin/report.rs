//! `make report` (issue 22): the committed evidence as a static site in `target/report/`
//! (`index.html` and one page per part), with each part's provenance from git: the commit
//! that last wrote its file, and the newest commit since that changed the code it depends
//! on ([`code_of`]; the part is then STALE). Failing nemesis runs whose artefacts are kept get their timeline page
//! copied beside the site.
//!
//! `target/debug/report [--evidence DIR] [--out DIR]`.

use anyhow::Context;
use scenarios::site::{self, Provenance, PARTS};
use scenarios::{git, target_dir, workspace};
use std::path::PathBuf;

/// The code every part depends on: the gateway, its schema, the protocol, the harness.
const COMMON: &[&str] = &["gateway", "protocol", "migrations", "harness", "Cargo.lock"];

/// The paths whose change makes a part's evidence older than the code: [`COMMON`] and
/// what produces that part (the site's own code changes no evidence).
fn code_of(file: &str) -> Vec<&'static str> {
    let own: &[&str] = match file {
        "im-06/result.json" => &[
            "scenarios/tests/im06.rs",
            "scenarios/src/lib.rs",
            "scenarios/src/bin/evidence.rs",
        ],
        "nemesis/result.json" | "nemesis/gateways-3.json" => &["scenarios/src/bin/nemesis.rs"],
        "controls/result.json" => &[
            "scenarios/tests",
            "scenarios/src/lib.rs",
            "scenarios/src/bin/controls.rs",
            "scenarios/src/bin/nemesis.rs",
        ],
        _ => &["bench"],
    };
    COMMON.iter().chain(own).copied().collect()
}

#[derive(clap::Parser)]
#[command(about = "Renders evidence/ as a static site (no network, no script).")]
struct Args {
    /// The evidence directory.
    #[arg(long)]
    evidence: Option<PathBuf>,
    /// Where the site goes.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The commit a part ran at: the one its file records (`environment.git_commit`, or
/// `git_commit` at the top), when this repository has it; else the commit that last wrote
/// the file (a file committed after code changed may still have run before the change).
fn provenance(file: &str, loaded: &site::Loaded) -> Provenance {
    let path = format!("evidence/{file}");
    let recorded = loaded.as_ref().ok().and_then(|v| {
        v.pointer("/environment/git_commit")
            .or_else(|| v.get("git_commit"))
            .and_then(|c| c.as_str())
            .map(str::to_string)
    });
    let known = |c: &String| git(&["cat-file", "-e", &format!("{c}^{{commit}}")]).is_some();
    let commit = recorded
        .filter(known)
        .or_else(|| git(&["log", "-1", "--format=%H", "--", &path]).filter(|c| !c.is_empty()));
    let newer_code = commit.as_ref().and_then(|c| {
        let mut args = vec!["log", "-1", "--format=%H"];
        let range = format!("{c}..HEAD");
        args.push(&range);
        args.push("--");
        args.extend(code_of(file));
        // What changes no evidence: the site's own files and fixtures, unit-test modules,
        // and the nemesis run's page (it renders `report.html`, not `result.json`).
        args.push(":(exclude)scenarios/tests/site.rs");
        args.push(":(exclude)scenarios/tests/fixtures");
        args.push(":(exclude,glob)**/tests.rs");
        args.push(":(exclude)harness/src/nemesis/report.rs");
        git(&args).filter(|n| !n.is_empty())
    });
    Provenance { commit, newer_code }
}

fn main() -> anyhow::Result<()> {
    let a: Args = clap::Parser::parse();
    let evidence = a.evidence.unwrap_or_else(|| workspace().join("evidence"));
    let out = a.out.unwrap_or_else(|| target_dir().join("report"));
    let parts = site::load(&evidence);
    let prov: Vec<Provenance> = PARTS
        .iter()
        .zip(&parts)
        .map(|(p, loaded)| provenance(p.file, loaded))
        .collect();
    let pages = site::render(&parts, &prov);
    site::write(&out, &pages)?;
    // Timelines of the failing nemesis runs whose artefacts are still here.
    if let Some(Ok(n)) = parts.get(1) {
        for r in n["per_run"].as_array().into_iter().flatten() {
            let (Some(dir), Some(seed)) = (r["dir"].as_str(), r["seed"].as_u64()) else {
                continue;
            };
            let from = workspace().join(dir).join("report.html");
            if from.is_file() {
                let to = out.join(format!("runs/seed-{seed}"));
                std::fs::create_dir_all(&to)?;
                std::fs::copy(&from, to.join("report.html"))
                    .with_context(|| format!("copy {}", from.display()))?;
            }
        }
    }
    println!("report: {} pages in {}", pages.len(), out.display());
    for (i, p) in PARTS.iter().enumerate() {
        let state = match (&parts[i], &prov[i].newer_code) {
            (Err(e), _) => format!("unreadable: {e}"),
            (Ok(_), Some(c)) => format!("STALE (code changed at {})", &c[..c.len().min(10)]),
            (Ok(_), None) => "current".into(),
        };
        println!("  {:<14} {state}", p.title);
    }
    Ok(())
}
