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

/// The code every part that runs the gateway through the harness depends on: the gateway,
/// its protocol and schema, the harness, and the checker that judges its histories.
const COMMON: &[&str] = &[
    "gateway",
    "protocol",
    "migrations",
    "harness",
    "check",
    "Cargo.lock",
];

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
        "mutants/result.json" | "mutants/in-diff.json" => (
            false,
            &[
                "scenarios/src/bin/mutants",
                "scripts/mutants.sh",
                "scripts/mutants-coverage.sh",
                "scripts/mutants-cov-runner.sh",
                "scripts/cov-rustc.sh",
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
    // entries may have been replaced since): shown as PATCHWORK, not judged here; where a
    // controls entry's catchers were chosen is its input, only listed.
    for (c, _) in rec
        .nested
        .iter()
        .filter(|(_, at)| !site::is_run_record(at) && !site::is_input_record(at))
    {
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
        covered_by: None,
    }
}

/// Mutants (issue 41): a whole mutation run (`mutants/result.json` with no shard and no
/// in-diff) is about the code of its commit, and `make proof` runs the mutants in the diff
/// since that commit (`mutants/in-diff.json`, whose `in_diff` names it; `since_base` is
/// that name as git resolves it). When that run is current (`since_prov` has no flag),
/// not a shard, and took every file the whole run took (a file added since is new code,
/// in the diff), every change after the whole run has had its mutants run: the whole run
/// then counts as current, and this says by what. None otherwise.
fn covered_by(
    whole: &serde_json::Value,
    since: &serde_json::Value,
    since_prov: &Provenance,
    since_base: Option<&str>,
) -> Option<String> {
    let whole_commit = whole["commit"].as_str()?;
    let since_commit = since_prov.commit.as_deref()?;
    let whole_run = whole["shard"].is_null() && whole["in_diff"].is_null();
    let files = |v: &serde_json::Value| -> Vec<String> {
        v["files"]
            .as_array()
            .into_iter()
            .flatten()
            .map(site::text)
            .collect()
    };
    let since_files = files(since);
    let covers = since["shard"].is_null()
        && files(whole).iter().all(|f| since_files.contains(f))
        && since_base == Some(whole_commit)
        && since_prov.flags().is_empty();
    (whole_run && covers).then(|| {
        format!(
            "the code changed since {} had its mutants run at {} (mutants/in-diff.json)",
            &whole_commit[..whole_commit.len().min(10)],
            &since_commit[..since_commit.len().min(10)]
        )
    })
}

/// Applies [`covered_by`] to the whole mutation run's provenance.
fn cover_mutants(parts: &[site::Loaded], prov: &mut [Provenance]) {
    let at = |file: &str| PARTS.iter().position(|p| p.file == file);
    let (Some(w), Some(d)) = (at("mutants/result.json"), at("mutants/in-diff.json")) else {
        return;
    };
    if prov[w].newer_code.is_none() {
        return;
    }
    let (Some(Ok(whole)), Some(Ok(since))) = (parts.get(w), parts.get(d)) else {
        return;
    };
    let base = since["in_diff"]
        .as_str()
        .and_then(|r| git(&["rev-parse", "--verify", &format!("{r}^{{commit}}")]));
    if let Some(by) = covered_by(whole, since, &prov[d], base.as_deref()) {
        prov[w].newer_code = None;
        prov[w].covered_by = Some(by);
    }
}

fn main() -> anyhow::Result<()> {
    let a: Args = clap::Parser::parse();
    let evidence = a.evidence.unwrap_or_else(|| workspace().join("evidence"));
    let out = a.out.unwrap_or_else(|| target_dir().join("report"));
    let parts = site::load(&evidence);
    let mut prov: Vec<Provenance> = PARTS
        .iter()
        .zip(&parts)
        .map(|(p, loaded)| provenance(p.file, loaded))
        .collect();
    cover_mutants(&parts, &mut prov);
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

    /// The whole mutation run counts as current only when the run of the diff since it is
    /// current, whole, over the same files, and starts at the whole run's commit; a shard,
    /// another base, other files or a stale in-diff run leave it STALE.
    #[test]
    fn a_whole_mutation_run_is_covered_only_by_a_current_run_of_the_diff_since_it() {
        use serde_json::json;
        let (w, d) = ("a".repeat(40), "b".repeat(40));
        let whole =
            json!({"commit": w, "shard": null, "in_diff": null, "files": ["gateway/src/*.rs"]});
        let since =
            json!({"commit": d, "shard": null, "in_diff": "a", "files": ["gateway/src/*.rs"]});
        let current = Provenance {
            commit: Some(d.clone()),
            recorded: true,
            ..Provenance::default()
        };
        let by = covered_by(&whole, &since, &current, Some(&w)).expect("covered");
        assert!(
            by.contains("aaaaaaaaaa") && by.contains("bbbbbbbbbb"),
            "{by}"
        );
        // Another base: the changes between the two commits had no mutants run.
        assert_eq!(covered_by(&whole, &since, &current, Some(&d)), None);
        assert_eq!(covered_by(&whole, &since, &current, None), None);
        // The in-diff run is itself stale, or dirty.
        let stale = Provenance {
            newer_code: Some("c".repeat(40)),
            ..current.clone()
        };
        assert_eq!(covered_by(&whole, &since, &stale, Some(&w)), None);
        let dirty = Provenance {
            dirty: true,
            ..current.clone()
        };
        assert_eq!(covered_by(&whole, &since, &dirty, Some(&w)), None);
        // A shard on either side, or other files.
        let mut shard = since.clone();
        shard["shard"] = json!("0/2");
        assert_eq!(covered_by(&whole, &shard, &current, Some(&w)), None);
        let mut whole_shard = whole.clone();
        whole_shard["shard"] = json!("0/3");
        assert_eq!(covered_by(&whole_shard, &since, &current, Some(&w)), None);
        let mut other = since.clone();
        other["files"] = json!(["gateway/src/store.rs"]);
        assert_eq!(covered_by(&whole, &other, &current, Some(&w)), None);
        // More files than the whole run (one added since) still cover it.
        let mut more = since.clone();
        more["files"] = json!(["gateway/src/*.rs", "gateway/src/new.rs"]);
        assert!(covered_by(&whole, &more, &current, Some(&w)).is_some());
    }
}
