//! The per-test coverage map: which tests of the `mutants` profile execute each line of the
//! workspace's own code (scripts/mutants-coverage.sh measures it; `mutants coverage-map`
//! folds its per-test lcov files into `target/mutants/cov/map.json`), and the tests a
//! mutant's lines send it to.
//!
//! Must not: run anything. It reads files and answers questions about them.

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The format of map.json written by this version.
pub const MAP_SCHEMA_VERSION: u32 = 1;

/// One test as nextest names it: the filter `binary_id(=B) & test(=N)` picks it alone.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TestId {
    pub binary_id: String,
    pub name: String,
}

/// target/mutants/cov/map.json.
#[derive(Debug, Serialize, Deserialize)]
pub struct CoverageMap {
    pub schema_version: u32,
    /// What the map was taken of (scripts/mutants.sh: HEAD and a digest of the tree's
    /// changes); a map with another key is measured again.
    pub key: String,
    pub generated_at: String,
    /// Seconds: the instrumented build, the instrumented run of every test, the export.
    pub build_s: Option<f64>,
    pub run_s: Option<f64>,
    pub export_s: Option<f64>,
    /// Every test of the profile that ran; indices into this list below.
    pub tests: Vec<TestId>,
    /// Each test's duration in the instrumented run (seconds; null when not read).
    pub test_s: Vec<Option<f64>>,
    /// Workspace-relative file -> line -> the tests that executed it.
    pub files: BTreeMap<String, BTreeMap<usize, Vec<u32>>>,
}

impl CoverageMap {
    /// The tests that execute any line from `first` to `last` of `file` (inclusive).
    pub fn tests_reaching(&self, file: &str, first: usize, last: usize) -> BTreeSet<u32> {
        let mut out = BTreeSet::new();
        if let Some(lines) = self.files.get(file) {
            for tests in lines.range(first..=last).map(|(_, t)| t) {
                out.extend(tests.iter().copied());
            }
        }
        out
    }
}

/// `cargo nextest list --message-format json` (the fields read here).
#[derive(Debug, Deserialize)]
struct NextestList {
    #[serde(rename = "rust-suites")]
    rust_suites: BTreeMap<String, Suite>,
}

#[derive(Debug, Deserialize)]
struct Suite {
    #[serde(rename = "binary-path")]
    binary_path: PathBuf,
}

#[derive(clap::Args, Debug)]
pub struct MapArgs {
    /// `cargo nextest list --message-format json` of the instrumented build.
    #[arg(long)]
    tests: PathBuf,
    /// The directory of per-test lcov files, `<test binary file>/<test name>.lcov`.
    #[arg(long)]
    lcov: PathBuf,
    /// nextest's output of the instrumented run (its PASS lines give each test's time).
    #[arg(long)]
    run_log: Option<PathBuf>,
    /// The workspace root the lcov paths start with.
    #[arg(long)]
    workspace: PathBuf,
    #[arg(long, default_value = "")]
    key: String,
    #[arg(long)]
    build_s: Option<f64>,
    #[arg(long)]
    run_s: Option<f64>,
    #[arg(long)]
    export_s: Option<f64>,
    #[arg(long)]
    out: PathBuf,
}

/// Lines of one lcov file with a count above zero: workspace-relative file -> lines.
fn parse_lcov(text: &str, workspace: &Path) -> anyhow::Result<BTreeMap<String, Vec<usize>>> {
    let mut out: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    let mut file: Option<String> = None;
    for line in text.lines() {
        if let Some(path) = line.strip_prefix("SF:") {
            file = Path::new(path)
                .strip_prefix(workspace)
                .ok()
                .map(|p| p.to_string_lossy().into_owned());
        } else if let Some(da) = line.strip_prefix("DA:") {
            let Some(f) = &file else { continue };
            let mut parts = da.split(',');
            let (Some(n), Some(count)) = (parts.next(), parts.next()) else {
                bail!("bad lcov line {line:?}");
            };
            let n: usize = n.parse().with_context(|| format!("lcov line {line:?}"))?;
            // llvm-cov writes counts as integers; a count can exceed u64 only in theory.
            if count != "0" {
                out.entry(f.clone()).or_default().push(n);
            }
        } else if line == "end_of_record" {
            file = None;
        }
    }
    Ok(out)
}

/// Each test's seconds from nextest's `PASS [   1.234s] (…) binary-id test-name` lines.
fn durations(log: &str) -> BTreeMap<TestId, f64> {
    let mut out = BTreeMap::new();
    for line in log.lines() {
        let Some(rest) = line.trim_start().strip_prefix("PASS [") else {
            continue;
        };
        let Some((secs, rest)) = rest.split_once("s]") else {
            continue;
        };
        let Ok(secs) = secs.trim().parse::<f64>() else {
            continue;
        };
        // Skip the optional `(n/m)` counter.
        let rest = rest.trim_start();
        let rest = match rest.strip_prefix('(') {
            Some(r) => r.split_once(')').map_or(r, |(_, r)| r),
            None => rest,
        };
        let mut words = rest.split_whitespace();
        if let (Some(b), Some(n)) = (words.next(), words.next()) {
            let id = TestId {
                binary_id: b.to_string(),
                name: n.to_string(),
            };
            // A retried test passes once; keep the longest run seen.
            let e = out.entry(id).or_insert(0.0);
            *e = f64::max(*e, secs);
        }
    }
    out
}

/// The tests whose coverage was read, and per source file, per line, the indices of the
/// tests that executed it.
type Lcov = (Vec<TestId>, BTreeMap<String, BTreeMap<usize, Vec<u32>>>);

/// Every test's lcov under `a.lcov` (a directory per test binary, a file per test), in
/// name order: the tests, and for each source line which of them (by index) executed it.
fn read_lcov(a: &MapArgs, by_file: &BTreeMap<String, String>) -> anyhow::Result<Lcov> {
    let mut tests = Vec::new();
    let mut files: BTreeMap<String, BTreeMap<usize, Vec<u32>>> = BTreeMap::new();
    let mut bins: Vec<_> = std::fs::read_dir(&a.lcov)
        .with_context(|| format!("read {}", a.lcov.display()))?
        .collect::<Result<_, _>>()?;
    bins.sort_by_key(|e| e.file_name());
    for bin in bins {
        let bin_file = bin.file_name().to_string_lossy().into_owned();
        let Some(binary_id) = by_file.get(&bin_file) else {
            bail!(
                "{bin_file}: no test binary of that name in {}",
                a.tests.display()
            );
        };
        let mut entries: Vec<_> = std::fs::read_dir(bin.path())?.collect::<Result<_, _>>()?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let file_name = e.file_name().to_string_lossy().into_owned();
            let Some(name) = file_name.strip_suffix(".lcov") else {
                continue;
            };
            // The runner wrote `/` in test names as `%` (a path separator otherwise).
            let id = TestId {
                binary_id: binary_id.clone(),
                name: name.replace('%', "/"),
            };
            let text = std::fs::read_to_string(e.path())
                .with_context(|| format!("read {}", e.path().display()))?;
            let index = u32::try_from(tests.len()).context("too many tests")?;
            for (file, lines) in parse_lcov(&text, &a.workspace)? {
                let per_line = files.entry(file).or_default();
                for n in lines {
                    per_line.entry(n).or_default().push(index);
                }
            }
            tests.push(id);
        }
    }
    Ok((tests, files))
}

pub fn build_map(a: MapArgs) -> anyhow::Result<()> {
    let list: NextestList = crate::read_json(&a.tests)?;
    let by_file: BTreeMap<String, String> = list
        .rust_suites
        .iter()
        .filter_map(|(id, s)| {
            let f = s.binary_path.file_name()?.to_string_lossy().into_owned();
            Some((f, id.clone()))
        })
        .collect();
    let times = match &a.run_log {
        Some(p) => {
            durations(&std::fs::read_to_string(p).with_context(|| format!("read {}", p.display()))?)
        }
        None => BTreeMap::new(),
    };
    let (tests, files) = read_lcov(&a, &by_file)?;
    if tests.is_empty() {
        bail!("{}: no test's coverage", a.lcov.display());
    }
    let test_s = tests.iter().map(|t| times.get(t).copied()).collect();
    let map = CoverageMap {
        schema_version: MAP_SCHEMA_VERSION,
        key: a.key,
        generated_at: scenarios::rfc3339_now(),
        build_s: a.build_s,
        run_s: a.run_s,
        export_s: a.export_s,
        tests,
        test_s,
        files,
    };
    let json = serde_json::to_string(&map)? + "\n";
    harness::util::write_atomic(&a.out, json.as_bytes())?;
    let lines: usize = map.files.values().map(BTreeMap::len).sum();
    eprintln!(
        "mutants: coverage map of {} tests, {} files, {} lines executed: {}",
        map.tests.len(),
        map.files.len(),
        lines,
        a.out.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lcov_keeps_executed_workspace_lines_only() {
        let text = "SF:/w/gateway/src/a.rs\nDA:3,0\nDA:4,12\nDA:9,1,abc\nend_of_record\n\
                    SF:/home/u/.cargo/registry/x.rs\nDA:1,5\nend_of_record\n";
        let got = parse_lcov(text, Path::new("/w")).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got["gateway/src/a.rs"], vec![4, 9]);
    }

    #[test]
    fn durations_read_nextest_pass_lines() {
        let log = "        PASS [   1.250s] (  3/212) scenarios::repair repair_x\n\
                   \x20       PASS [   0.010s] im-gateway store::tests::y\n\
                   \x20       FAIL [   2.000s] (4/212) scenarios::repair z\n";
        let d = durations(log);
        assert_eq!(d.len(), 2);
        let k = TestId {
            binary_id: "scenarios::repair".into(),
            name: "repair_x".into(),
        };
        assert_eq!(d[&k], 1.25);
    }

    #[test]
    fn a_span_reaches_the_tests_of_every_line_in_it() {
        let mut lines = BTreeMap::new();
        lines.insert(10, vec![0]);
        lines.insert(12, vec![1, 2]);
        lines.insert(20, vec![3]);
        let map = CoverageMap {
            schema_version: 1,
            key: String::new(),
            generated_at: String::new(),
            build_s: None,
            run_s: None,
            export_s: None,
            tests: Vec::new(),
            test_s: Vec::new(),
            files: [("f.rs".to_string(), lines)].into(),
        };
        assert_eq!(map.tests_reaching("f.rs", 11, 12), [1, 2].into());
        assert_eq!(map.tests_reaching("f.rs", 10, 19), [0, 1, 2].into());
        assert!(map.tests_reaching("f.rs", 13, 19).is_empty());
        assert!(map.tests_reaching("g.rs", 1, 99).is_empty());
    }
}
