//! `make report` (issue 22): the committed evidence as a static site in `target/report/`
//! (`index.html` and one page per part), with each part's provenance from git: the commit
//! its file records (else the commit that last wrote it), and the newest commit since that
//! changed the code it depends on ([`code_of`]; the part is then STALE). A recorded commit
//! git does not have in HEAD's history is UNKNOWN COMMIT, a run on uncommitted changes is
//! DIRTY, a file whose entries record other commits is PATCHWORK: each is printed on the
//! part's status line, so a caller can grep for them. Failing nemesis runs whose artefacts
//! are kept get their timeline page copied beside the site.
//!
//! `target/debug/report [--evidence DIR] [--out DIR]`.

use anyhow::Context;
use scenarios::site::{self, Provenance, PARTS};
use scenarios::{git, target_dir, workspace};
use std::path::PathBuf;

/// The code every part depends on: the gateway, its schema, the protocol, the harness.
const COMMON: &[&str] = &["gateway", "protocol", "migrations", "harness", "Cargo.lock"];

/// The paths whose change makes a part's evidence older than the code: what produces that
/// part, and [`COMMON`] for the parts that run the gateway through the harness (the site's
/// own code changes no evidence, except the proof's: it runs `make report`).
fn code_of(file: &str) -> Vec<&'static str> {
    let (common, own): (bool, &[&str]) = match file {
        "im-06/result.json" => (
            true,
            &[
                "scenarios/tests/im06.rs",
                "scenarios/src/lib.rs",
                "scenarios/src/bin/evidence.rs",
            ],
        ),
        "nemesis/result.json" | "nemesis/gateways-3.json" => {
            (true, &["scenarios/src/bin/nemesis.rs"])
        }
        "controls/result.json" => (
            true,
            &[
                "scenarios/tests",
                "scenarios/src/lib.rs",
                "scenarios/src/bin/controls.rs",
                "scenarios/src/bin/nemesis.rs",
            ],
        ),
        "bench/result.json" => (true, &["bench"]),
        "durability/result.json" => (
            true,
            &["scenarios/src/bin/durability.rs", "scenarios/src/lib.rs"],
        ),
        // The mutated code and what runs and judges the mutants. Not [`COMMON`] as a whole:
        // the result is about the mutated files; a change to a test elsewhere can change it
        // too, and is not counted (the nextest profile names which tests run).
        "mutants/result.json" => (
            false,
            &[
                "scenarios/src/bin/mutants.rs",
                "scripts/mutants.sh",
                ".config/nextest.toml",
                "mutants/equivalent.txt",
                "gateway/src",
                "harness/src/client/delivery.rs",
            ],
        ),
        // Everything `scripts/proof.sh` runs: the build, the whole suite of every crate,
        // each part's make target and scripts, the site.
        "proof/result.json" => (
            true,
            &[
                "scripts",
                "Makefile",
                "Cargo.toml",
                ".config",
                "mutants",
                "scenarios",
                "bench",
                "fuzz",
            ],
        ),
        other => unreachable!("code_of: no entry for {other}: every part of PARTS needs one"),
    };
    let common: &[&str] = if common { COMMON } else { &[] };
    common.iter().chain(own).copied().collect()
}

/// What changes no part's evidence: the site's own files and fixtures, unit-test modules,
/// and the nemesis run's page (it renders `report.html`, not `result.json`). The proof
/// runs all of them (the suite, `make report`), so nothing is excluded for it.
fn excluded(file: &str) -> &'static [&'static str] {
    match file {
        "proof/result.json" => &[],
        _ => &[
            ":(exclude)scenarios/tests/site.rs",
            ":(exclude)scenarios/tests/fixtures",
            ":(exclude,glob)**/tests.rs",
            ":(exclude)harness/src/nemesis/report.rs",
            ":(exclude)scenarios/src/site",
            ":(exclude)scenarios/src/bin/report.rs",
        ],
    }
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

/// Why git cannot vouch for a recorded commit: it is not in this repository, or not an
/// ancestor of HEAD (None: it is in HEAD's history).
fn not_in_history(c: &str) -> Option<String> {
    if git(&["cat-file", "-e", &format!("{c}^{{commit}}")]).is_none() {
        return Some("not in this repository's history".into());
    }
    if git(&["merge-base", "--is-ancestor", c, "HEAD"]).is_none() {
        return Some("not an ancestor of HEAD".into());
    }
    None
}

/// The newest commit after `c` that changed code `file` depends on.
fn newer_code(file: &str, c: &str) -> Option<String> {
    let range = format!("{c}..HEAD");
    let mut args = vec!["log", "-1", "--format=%H", range.as_str(), "--"];
    args.extend(code_of(file));
    args.extend(excluded(file));
    git(&args).filter(|n| !n.is_empty())
}

/// A part's provenance: the commit its file records (at the top: `environment.git_commit`,
/// `git_commit` or `commit`) or, when it records none, the commit that last wrote the
/// file; what git cannot vouch for of every commit it ran at (its entries' too); whether
/// it ran dirty; and the newest code change after any commit it ran at.
fn provenance(file: &str, loaded: &site::Loaded) -> Provenance {
    let rec = loaded.as_ref().map(site::recorded).unwrap_or_default();
    let (commit, recorded) = match &rec.commit {
        Some(c) => (Some(c.clone()), true),
        None => (
            git(&[
                "log",
                "-1",
                "--format=%H",
                "--",
                &format!("evidence/{file}"),
            ])
            .filter(|c| !c.is_empty()),
            false,
        ),
    };
    let mut ran_at: Vec<&str> = commit.iter().map(String::as_str).collect();
    // An entry's commit is one the part ran at; a partial run's record is history (its
    // entries may have been replaced since): shown as PATCHWORK, not judged here.
    for (c, _) in rec.nested.iter().filter(|(_, at)| !site::is_run_record(at)) {
        if !ran_at.contains(&c.as_str()) {
            ran_at.push(c);
        }
    }
    let mut unknown = Vec::new();
    let mut known = Vec::new();
    for c in ran_at {
        match not_in_history(c) {
            Some(why) => unknown.push((c.to_string(), why)),
            None => known.push(c),
        }
    }
    // The code changed after the part ran when it changed after any of its commits.
    let newer_code = known.iter().find_map(|c| newer_code(file, c));
    Provenance {
        commit,
        recorded,
        newer_code,
        unknown,
        dirty: rec.dirty,
        patchwork: rec.nested,
    }
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
        println!(
            "  {:<20} {}",
            p.title,
            site::status(p, parts.get(i), &prov[i])
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every part has its code, and every path named there exists: a renamed file would
    /// otherwise silently stop making its part STALE.
    #[test]
    fn every_part_names_code_that_exists() {
        for p in PARTS {
            for path in code_of(p.file) {
                assert!(
                    workspace().join(path).exists(),
                    "{}: {path} does not exist",
                    p.file
                );
            }
        }
    }

    /// A commit git has never seen is UNKNOWN, and HEAD itself is not.
    #[test]
    fn a_commit_outside_the_history_is_named_as_such() {
        assert_eq!(
            not_in_history("0123456789abcdef0123456789abcdef01234567").as_deref(),
            Some("not in this repository's history")
        );
        let head = git(&["rev-parse", "HEAD"]).expect("a git checkout");
        assert_eq!(not_in_history(&head), None);
    }
}
