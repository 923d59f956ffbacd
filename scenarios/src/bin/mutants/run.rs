//! `mutants run`: each mutant of the list against only the tests that execute its lines.
//!
//! cargo-mutants generates the mutants (`cargo mutants --list --json --diff`) but cannot
//! take a list of tests per mutant, so this runs them: a scratch copy of the workspace's
//! sources (`<scratch>/tree`, brought up to date file by file, so its target dir,
//! `<scratch>/target`, stays warm from one run to the next), where every test binary is
//! built once unmutated; per mutant, its diff applied with `patch`, one `cargo test
//! --no-run` of only the test binaries that hold the mutated code and run a selected test
//! (plus `im-gateway::batch`, whose build makes cargo build the gateway binary in the same
//! invocation, with the same features), then `cargo nextest run --profile mutants` on the
//! binaries as built (`--binaries-metadata`: no build) with a filter naming the selected
//! tests, under a time limit, in two stages: the likeliest catchers first (the tests that
//! caught a mutant of the same function or file earlier in the run, then the quickest), the
//! rest only when none of those failed; the file is then written back.
//!
//! Before that, one schema build ([`schemata`]): every mutant to run written into the
//! scratch tree's files at once, each behind a switch read from `IMFAULT_MUTANT`, and every
//! test binary built from them; a mutant a build error is blamed on is taken out until the
//! tree builds. Each mutant the schema build holds then runs only its tests, with
//! `IMFAULT_MUTANT` set to its id (the harness passes it on to the gateways it starts) and
//! nothing built; the others (unviable ones, those inside a macro call, those whose value
//! cannot share a function with its body) run afterwards as above, the tree written back
//! to the sources. `--no-schemata` runs every mutant that way.
//! Writes `<out>/outcomes.json` in the shape of cargo-mutants' (read by `mutants report`),
//! each outcome with the tests it ran, and `<out>/diff/`, `<out>/log/`.
//!
//! Must not: judge (that is `mutants report`) or touch the workspace itself.

use crate::coverage::{CoverageMap, TestId};
use crate::schemata;
use anyhow::{bail, Context};
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// `cargo mutants --list --json --diff` output.
    #[arg(long)]
    list: PathBuf,
    /// The coverage map (scripts/mutants-coverage.sh).
    #[arg(long)]
    map: PathBuf,
    /// The committed list of equivalent mutants (they are not run).
    #[arg(long)]
    equivalent: PathBuf,
    /// Run only shard k of n (`k/n`, 0-based), round-robin over the list less the
    /// equivalent mutants.
    #[arg(long)]
    shard: Option<String>,
    /// The scratch directory: `tree/` (the sources) and `target/` (kept warm).
    #[arg(long)]
    scratch: PathBuf,
    /// Where the outcomes go.
    #[arg(long)]
    out: PathBuf,
    /// A mutant's test phase may take this many times the instrumented run's time of its
    /// selected tests, plus `timeout_extra_s`.
    #[arg(long, default_value_t = 3.0)]
    timeout_factor: f64,
    #[arg(long, default_value_t = 60.0)]
    timeout_extra_s: f64,
    #[arg(long, default_value = "cargo")]
    cargo: String,
    /// Build and run each mutant alone (its diff applied), without the schema build.
    #[arg(long)]
    no_schemata: bool,
}

/// The cargo arguments of every build and test command: always the same packages and
/// features, so that cargo never builds the dependencies again for another feature set.
const PACKAGES: [&str; 10] = [
    "-p",
    "im-gateway",
    "-p",
    "im-check",
    "-p",
    "harness",
    "-p",
    "scenarios",
    "--features",
    "im-gateway/faults",
];

/// cargo-mutants' summaries (the names `mutants report` reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
enum Summary {
    CaughtMutant,
    MissedMutant,
    Timeout,
    Unviable,
    Failure,
}

#[derive(Debug, Serialize)]
struct PhaseResult {
    phase: &'static str,
    duration: f64,
}

/// One outcome, as cargo-mutants' outcomes.json has it, plus the selection.
#[derive(Debug, Serialize)]
struct Outcome {
    scenario: BTreeMap<&'static str, Value>,
    summary: Summary,
    diff_path: String,
    log_path: String,
    phase_results: Vec<PhaseResult>,
    /// How many tests reach the mutated lines (and ran, if it built).
    selected_tests: usize,
    /// Those tests (`binary-id test-name`).
    tests: Vec<String>,
    /// Why it has this summary, when that is not a test's failure or pass.
    #[serde(skip_serializing_if = "Option::is_none")]
    note: Option<String>,
    /// When the tests of its lines missed it: the other tests that reach its function,
    /// run as its second chance (`Runner::widen`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    widened_tests: Vec<String>,
}

impl Outcome {
    /// A mutant's outcome before it runs: a failure until its build and tests say
    /// otherwise, with its list entry (less the diff) and the tests of its lines.
    fn new(raw: &Value, diff_path: String, log_path: String, tests: &[&TestId]) -> Outcome {
        let mut scenario = BTreeMap::new();
        let mut mutant = raw.clone();
        if let Some(o) = mutant.as_object_mut() {
            o.remove("diff");
        }
        scenario.insert("Mutant", mutant);
        Outcome {
            scenario,
            summary: Summary::Failure,
            diff_path,
            log_path,
            phase_results: Vec::new(),
            selected_tests: tests.len(),
            tests: tests
                .iter()
                .map(|t| format!("{} {}", t.binary_id, t.name))
                .collect(),
            note: None,
            widened_tests: Vec::new(),
        }
    }
}

#[derive(Debug, Serialize)]
struct Outcomes {
    /// Written by `mutants run` (not cargo-mutants).
    selected_by: &'static str,
    wall_s: f64,
    outcomes: Vec<Outcome>,
}

fn secs(d: Duration) -> f64 {
    (d.as_secs_f64() * 10.0).round() / 10.0
}

/// The workspace's source files (tracked or not, less the ignored ones), relative.
fn source_files(root: &Path) -> anyhow::Result<BTreeSet<PathBuf>> {
    let out = Command::new("git")
        .args(["ls-files", "-z", "-co", "--exclude-standard"])
        .current_dir(root)
        .output()
        .context("run git ls-files")?;
    if !out.status.success() {
        bail!("git ls-files: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(out
        .stdout
        .split(|b| *b == 0)
        .filter(|p| !p.is_empty())
        .map(|p| PathBuf::from(String::from_utf8_lossy(p).into_owned()))
        .filter(|p| root.join(p).is_file())
        .collect())
}

/// Makes `tree` hold exactly the workspace's sources: a file is written only when its
/// content differs (a fresh mtime, so cargo rebuilds what it must and nothing else), and a
/// file the workspace no longer has is removed.
fn sync_tree(root: &Path, tree: &Path) -> anyhow::Result<usize> {
    let files = source_files(root)?;
    let mut written = 0;
    for f in &files {
        let want = std::fs::read(root.join(f)).with_context(|| format!("read {}", f.display()))?;
        let dst = tree.join(f);
        if std::fs::read(&dst).ok().as_ref() != Some(&want) {
            if let Some(d) = dst.parent() {
                std::fs::create_dir_all(d)?;
            }
            std::fs::write(&dst, &want).with_context(|| format!("write {}", dst.display()))?;
            written += 1;
        }
    }
    let mut stack = vec![tree.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir)? {
            let p = e?.path();
            if p.is_dir() {
                stack.push(p);
            } else if !files.contains(p.strip_prefix(tree)?) {
                std::fs::remove_file(&p)?;
            }
        }
    }
    Ok(written)
}

/// The cargo target options that build the test binaries `ids` live in.
fn target_args(ids: &BTreeSet<&str>) -> Vec<String> {
    let mut out = BTreeSet::new();
    // The gateway binary: built by cargo for the gateway's integration tests.
    out.insert("--test=batch".to_string());
    for id in ids {
        match id.split_once("::") {
            None => out.insert("--lib".to_string()),
            Some((_, t)) => match t.strip_prefix("bin/") {
                Some(b) => out.insert(format!("--bin={b}")),
                None => out.insert(format!("--test={t}")),
            },
        };
    }
    out.into_iter().collect()
}

/// The scenario test binaries (`scenarios::<name>`, `scenarios::bin/<name>`) whose source
/// mentions the gateway's library (`im_gateway::` outside a comment).
fn in_process_binaries(tree: &Path) -> anyhow::Result<BTreeSet<String>> {
    let mut out = BTreeSet::new();
    for (sub, prefix) in [
        ("scenarios/tests", "scenarios::"),
        ("scenarios/src/bin", "scenarios::bin/"),
    ] {
        in_process_in(tree, sub, prefix, &mut out)?;
    }
    Ok(out)
}

fn in_process_in(
    tree: &Path,
    sub: &str,
    prefix: &str,
    out: &mut BTreeSet<String>,
) -> anyhow::Result<()> {
    let dir = tree.join(sub);
    for e in std::fs::read_dir(&dir).with_context(|| format!("read {}", dir.display()))? {
        let p = e?.path();
        let (Some(stem), Some("rs")) = (
            p.file_stem().and_then(|s| s.to_str()),
            p.extension().and_then(|s| s.to_str()),
        ) else {
            continue;
        };
        let text = std::fs::read_to_string(&p)?;
        if text
            .lines()
            .any(|l| !l.trim_start().starts_with("//") && l.contains("im_gateway::"))
        {
            out.insert(format!("{prefix}{stem}"));
        }
    }
    Ok(())
}

/// nextest's filter naming exactly `tests`.
fn filter(tests: &[&TestId]) -> String {
    tests
        .iter()
        .map(|t| format!("(binary_id(={}) & test(={}))", t.binary_id, t.name))
        .collect::<Vec<_>>()
        .join(" | ")
}

/// Runs `cmd`, its output appended to `log`, killed after `limit`: the exit code (None
/// when killed at the limit).
fn run_logged(mut cmd: Command, log: &Path, limit: Duration) -> anyhow::Result<Option<i32>> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    writeln!(f, "$ {cmd:?}")?;
    let out = f.try_clone()?;
    let err = f.try_clone()?;
    let mut child = cmd
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .spawn()
        .with_context(|| format!("spawn {cmd:?}"))?;
    let deadline = Instant::now() + limit;
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(Some(s.code().unwrap_or(-1)));
        }
        if Instant::now() > deadline {
            // The whole tree: cargo, nextest, the tests (each in a process group of its
            // own, which a signal to this group misses: they kept running, spinning on a
            // mutant's endless loop), their gateways and clusters.
            harness::process::kill_tree(child.id());
            let _ = child.wait();
            writeln!(f, "(killed at the time limit, {limit:?})")?;
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

use std::os::unix::process::CommandExt as _;

struct Runner<'a> {
    a: &'a RunArgs,
    tree: PathBuf,
    target: PathBuf,
    map: CoverageMap,
    /// Scenario test binaries that call the gateway's library in their own process (not
    /// only through the gateway binary): a gateway mutant rebuilds them too.
    in_process: BTreeSet<String>,
    /// Every test that caught a mutant so far in this run, with that mutant's file and
    /// function: the likeliest catchers of the next mutant there ([`first_stage`]).
    killers: std::cell::RefCell<Vec<Killer>>,
    /// The file and function of the mutant being run.
    current: std::cell::RefCell<(String, String)>,
    /// The mutants the tree's schema build holds ([`Runner::schematize`]).
    switched: BTreeSet<usize>,
    /// The switched mutant being run: its tests run with [`schemata::VAR`] naming it, and
    /// nothing is built for it.
    active: std::cell::Cell<Option<usize>>,
}

/// A test that caught a mutant of `file`, in `function`.
#[derive(Debug, Clone)]
struct Killer {
    file: String,
    function: String,
    test: TestId,
}

/// At most this many builds look for a schema build that builds ([`Runner::schematize`]);
/// the last but one takes out every mutant of the files the errors are in.
const SCHEMA_ROUNDS: usize = 12;

/// A place a build error names: a file relative to the tree, a byte offset in it, and the
/// error's code (`E0004`...) when it has one.
struct BuildError {
    file: String,
    at: usize,
    code: Option<String>,
}

fn append(log: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    f.write_all(text.as_bytes())?;
    Ok(())
}

/// At most this many tests run first, the likeliest catchers; the rest only when none of
/// them fails.
const FIRST_STAGE_MAX: usize = 6;

/// Splits a mutant's tests in two stages, the likeliest catchers first, so that a mutant
/// that is caught (most are) usually costs a handful of tests, not every test that reaches
/// it (a gateway function run at start-up is reached by a hundred): first the tests that
/// caught a mutant of the same function, then of the same file, then any mutant, each
/// group quickest first, then the rest quickest first. A mutant that survives runs both
/// stages, so every selected test still runs before it is called missed; a short selection
/// (at most `FIRST_STAGE_MAX` + 2 tests) runs in one stage.
fn first_stage<'t>(
    tests: &[&'t TestId],
    killers: &[Killer],
    (file, function): (&str, &str),
    seconds: impl Fn(&TestId) -> f64,
) -> (Vec<&'t TestId>, Vec<&'t TestId>) {
    let class = |t: &TestId| {
        let mut c = 3u8;
        for k in killers.iter().filter(|k| k.test == *t) {
            let here = if k.file != file {
                2
            } else if k.function != function {
                1
            } else {
                0
            };
            c = c.min(here);
        }
        c
    };
    let mut sorted = tests.to_vec();
    sorted.sort_by(|a, b| {
        class(a)
            .cmp(&class(b))
            .then(seconds(a).total_cmp(&seconds(b)))
            .then(a.cmp(b))
    });
    if sorted.len() <= FIRST_STAGE_MAX + 2 {
        return (sorted, Vec::new());
    }
    let rest = sorted.split_off(FIRST_STAGE_MAX);
    (sorted, rest)
}

/// The tests of `tests` that nextest reports failed in `log` (a `FAIL` status line ending
/// with the test's binary id and name).
fn failed_in(log: &str, tests: &[&TestId]) -> Vec<TestId> {
    tests
        .iter()
        .filter(|t| {
            let tail = format!("{} {}", t.binary_id, t.name);
            log.lines()
                .any(|l| l.contains("FAIL [") && l.trim_end().ends_with(&tail))
        })
        .map(|t| (*t).clone())
        .collect()
}

impl Runner<'_> {
    /// `cargo nextest run` on the binaries built so far (no build: `warm` wrote their list).
    fn nextest_prebuilt(&self) -> Command {
        let mut c = Command::new(&self.a.cargo);
        c.args(["nextest", "run"])
            .current_dir(&self.tree)
            .env("CARGO_TARGET_DIR", &self.target)
            .env_remove("LLVM_PROFILE_FILE")
            .env_remove("RUSTC_WORKSPACE_WRAPPER")
            .env("NEXTEST_HIDE_PROGRESS_BAR", "1")
            .env_remove(schemata::VAR);
        if let Some(id) = self.active.get() {
            c.env(schemata::VAR, id.to_string());
        }
        c.arg("--binaries-metadata")
            .arg(self.a.out.join("binaries.json"))
            .arg("--cargo-metadata")
            .arg(self.a.out.join("cargo-metadata.json"));
        c
    }

    /// Builds every test binary of the profile from the unmutated tree, and writes the
    /// lists `nextest_prebuilt` runs from.
    fn warm(&self) -> anyhow::Result<()> {
        let log = self.a.out.join("log/warm.log");
        let mut list = self.cargo(&["nextest", "list"]);
        list.args(["--list-type", "binaries-only", "--message-format", "json"]);
        let out = list.stderr(std::fs::File::create(&log)?).output()?;
        if !out.status.success() {
            bail!("the unmutated tree does not build: {}", log.display());
        }
        std::fs::write(self.a.out.join("binaries.json"), &out.stdout)?;
        let meta = Command::new(&self.a.cargo)
            .args(["metadata", "--format-version", "1"])
            .current_dir(&self.tree)
            .output()?;
        if !meta.status.success() {
            bail!("cargo metadata: {}", String::from_utf8_lossy(&meta.stderr));
        }
        std::fs::write(self.a.out.join("cargo-metadata.json"), &meta.stdout)?;
        Ok(())
    }

    fn cargo(&self, sub: &[&str]) -> Command {
        let mut c = Command::new(&self.a.cargo);
        c.args(sub)
            .args(PACKAGES)
            .current_dir(&self.tree)
            .env("CARGO_TARGET_DIR", &self.target)
            .env_remove("LLVM_PROFILE_FILE")
            .env_remove("RUSTC_WORKSPACE_WRAPPER")
            .env("NEXTEST_HIDE_PROGRESS_BAR", "1");
        c
    }

    /// Writes the mutants of `todo` into the tree's files as schemata ([`schemata`]) and
    /// builds every test binary from them; a mutant a build error is blamed on is taken out
    /// and the files written again, until the tree builds (at most [`SCHEMA_ROUNDS`]
    /// builds). The mutants the built tree holds; none (and the tree as it was) when a
    /// build error is blamed on no mutant, or the rounds run out.
    fn schematize(
        &self,
        todo: &[usize],
        mutants: &[crate::Mutant],
    ) -> anyhow::Result<BTreeSet<usize>> {
        let log = self.a.out.join("log/schemata.log");
        let mut by_file: BTreeMap<&str, Vec<schemata::Want>> = BTreeMap::new();
        for &i in todo {
            let m = &mutants[i];
            let start = (m.span.start.line, m.span.start.column);
            by_file.entry(&m.file).or_default().push(schemata::Want {
                id: i,
                genre: m.genre.clone(),
                start,
                end: m.span.end.map_or(start, |e| (e.line, e.column)),
                replacement: m.replacement.clone(),
            });
        }
        let mut originals = BTreeMap::new();
        for file in by_file.keys() {
            let p = self.tree.join(file);
            originals.insert(
                *file,
                std::fs::read_to_string(&p).with_context(|| format!("read {}", p.display()))?,
            );
        }
        let restore = |originals: &BTreeMap<&str, String>| -> anyhow::Result<()> {
            for (file, text) in originals {
                std::fs::write(self.tree.join(file), text)?;
            }
            Ok(())
        };
        let mut out_of_it: BTreeSet<usize> = BTreeSet::new();
        for round in 1..=SCHEMA_ROUNDS {
            let mut placed = BTreeSet::new();
            let mut texts = BTreeMap::new();
            for (file, wants) in &by_file {
                let wants: Vec<_> = wants
                    .iter()
                    .filter(|w| !out_of_it.contains(&w.id))
                    .cloned()
                    .collect();
                match schemata::schema(&originals[file], &wants) {
                    Ok((text, ids)) => {
                        std::fs::write(self.tree.join(file), &text)?;
                        placed.extend(ids);
                        texts.insert(file.to_string(), text);
                    }
                    Err(e) => {
                        append(
                            &log,
                            &format!("{file}: no schema ({e:#}); its mutants run alone\n"),
                        )?;
                        std::fs::write(self.tree.join(file), &originals[file])?;
                    }
                }
            }
            let t0 = Instant::now();
            let errors = self.build_json(&log)?;
            append(
                &log,
                &format!(
                    "round {round}: {} mutants placed, built in {:.1} s, {} errors\n",
                    placed.len(),
                    t0.elapsed().as_secs_f64(),
                    errors.as_ref().map_or(0, Vec::len)
                ),
            )?;
            let Some(errors) = errors else {
                return Ok(placed);
            };
            let is_arm = |id: usize| mutants.get(id).is_some_and(|m| m.genre == "MatchArm");
            let mut blamed: BTreeSet<usize> = errors
                .iter()
                .filter_map(|e| {
                    let text = texts.get(&e.file)?;
                    match e.code.as_deref() {
                        Some("E0004") => schemata::blame_arm(text, e.at, is_arm),
                        _ => schemata::blame(text, e.at),
                    }
                })
                .collect();
            if blamed.is_empty() || round == SCHEMA_ROUNDS - 1 {
                // The last try: every mutant of the files the errors are in runs alone.
                let files: BTreeSet<&str> = errors.iter().map(|e| e.file.as_str()).collect();
                if files.iter().all(|f| !texts.contains_key(*f)) {
                    break;
                }
                for f in files {
                    blamed.extend(by_file.get(f).into_iter().flatten().map(|w| w.id));
                }
            }
            append(&log, &format!("round {round}: taken out {blamed:?}\n"))?;
            out_of_it.extend(blamed);
        }
        append(&log, "no schema build: every mutant runs alone\n")?;
        restore(&originals)?;
        Ok(BTreeSet::new())
    }

    /// `cargo test --no-run` of every test binary with JSON messages: `None` when it built,
    /// else each error's places.
    fn build_json(&self, log: &Path) -> anyhow::Result<Option<Vec<BuildError>>> {
        let mut build = self.cargo(&["test", "--no-run", "--message-format=json"]);
        let err = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        let out = build
            .stderr(err)
            .output()
            .context("run cargo test --no-run")?;
        if out.status.success() {
            return Ok(None);
        }
        let mut places = Vec::new();
        for line in out.stdout.split(|b| *b == b'\n') {
            let Ok(v) = serde_json::from_slice::<Value>(line) else {
                continue;
            };
            let msg = &v["message"];
            if v["reason"] != "compiler-message" || msg["level"] != "error" {
                continue;
            }
            // Not `rendered`: a schema file is one line, which rustc quotes whole.
            let first = msg["spans"].get(0);
            append(
                log,
                &format!(
                    "error: {} ({}, byte {})\n",
                    msg["message"].as_str().unwrap_or("?"),
                    first.and_then(|s| s["file_name"].as_str()).unwrap_or("?"),
                    first.and_then(|s| s["byte_start"].as_u64()).unwrap_or(0)
                ),
            )?;
            let mut spans: Vec<&Value> = msg["spans"].as_array().into_iter().flatten().collect();
            while let Some(sp) = spans.pop() {
                if let (Some(file), Some(at)) =
                    (sp["file_name"].as_str(), sp["byte_start"].as_u64())
                {
                    let file = Path::new(file);
                    let file = file.strip_prefix(&self.tree).unwrap_or(file);
                    places.push(BuildError {
                        file: file.to_string_lossy().into_owned(),
                        at: at as usize,
                        code: msg["code"]["code"].as_str().map(str::to_string),
                    });
                }
                if sp["expansion"]["span"].is_object() {
                    spans.push(&sp["expansion"]["span"]);
                }
            }
        }
        Ok(Some(places))
    }

    /// Records the file and function of the mutant about to run.
    fn set_current(&self, m: &crate::Mutant) {
        *self.current.borrow_mut() = (
            m.file.clone(),
            m.function
                .as_ref()
                .map(|f| f.function_name.clone())
                .unwrap_or_default(),
        );
    }

    /// One mutant: apply, build, test, restore.
    fn one(&self, i: usize, raw: &Value, m: &crate::Mutant) -> anyhow::Result<Outcome> {
        let diff = raw
            .get("diff")
            .and_then(Value::as_str)
            .with_context(|| format!("{}: no diff in the list (list with --diff)", m.name))?;
        let diff_path = format!("diff/{i}.diff");
        let log_path = format!("log/{i}.log");
        std::fs::write(self.a.out.join(&diff_path), diff)?;
        let log = self.a.out.join(&log_path);
        let last = m.span.end.map_or(m.span.start.line, |e| e.line);
        let selected = self.map.tests_reaching(&m.file, m.span.start.line, last);
        let tests: Vec<&TestId> = selected
            .iter()
            .map(|t| &self.map.tests[*t as usize])
            .collect();
        // A gateway mutant rebuilds the gateway binary and the test binaries that hold the
        // gateway's code; every other test binary, built from the unmutated tree before the
        // first mutant (`warm`), runs as it is. A harness mutant rebuilds every selected one
        // (harness mutants run after all gateway mutants, so no binary a harness mutant
        // rebuilt is run for a gateway mutant).
        let gateway = m.file.starts_with("gateway/");
        let targets_of = |tests: &[&TestId]| {
            let ids: BTreeSet<&str> = tests
                .iter()
                .map(|t| t.binary_id.as_str())
                .filter(|id| {
                    !gateway
                        || *id == "im-gateway"
                        || id.starts_with("im-gateway::")
                        || self.in_process.contains(*id)
                })
                .collect();
            target_args(&ids)
        };
        let targets = targets_of(&tests);
        // The second chance of a mutant its lines' tests miss: the other tests that reach its
        // function. Line coverage can put a decision on another line than the one a mutant
        // names (a match guard's test is counted on the `match` line), so a mutant that
        // makes a branch run where it did not is reached by tests the lines do not name.
        let wider = self.wider(m, &selected);
        let wider_targets = targets_of(&wider);
        let mut outcome = Outcome::new(raw, diff_path, log_path, &tests);

        self.set_current(m);
        if self.switched.contains(&i) {
            // In the schema build: switched on for its tests, nothing built.
            self.active.set(Some(i));
            let result = self
                .build_and_test(&mut outcome, &targets, &tests, &log)
                .and_then(|()| self.widen(&mut outcome, &wider_targets, &wider, &log));
            self.active.set(None);
            result?;
            return Ok(outcome);
        }
        let original = self.apply(m, &outcome.diff_path)?;
        let result = self
            .build_and_test(&mut outcome, &targets, &tests, &log)
            .and_then(|()| self.widen(&mut outcome, &wider_targets, &wider, &log));
        // Written back with a fresh mtime, so the next build cannot take the mutated
        // build for current.
        std::fs::write(self.tree.join(&m.file), &original)?;
        result?;
        Ok(outcome)
    }

    /// The tests that reach the mutant's function but none of its lines (its second
    /// chance: line coverage can put a decision on another line than the one a mutant
    /// names).
    fn wider(&self, m: &crate::Mutant, selected: &BTreeSet<u32>) -> Vec<&TestId> {
        m.function
            .as_ref()
            .and_then(|f| f.span)
            .map(|f| {
                let last = f.end.map_or(f.start.line, |e| e.line);
                self.map.tests_reaching(&m.file, f.start.line, last)
            })
            .unwrap_or_default()
            .difference(selected)
            .map(|t| &self.map.tests[*t as usize])
            .collect()
    }

    /// Applies the mutant's diff (written at `diff_path` under the output) to the tree;
    /// returns the file as it was, to be written back. A diff that does not apply leaves
    /// the file as it was.
    fn apply(&self, m: &crate::Mutant, diff_path: &str) -> anyhow::Result<Vec<u8>> {
        let original =
            std::fs::read(self.tree.join(&m.file)).with_context(|| format!("read {}", m.file))?;
        // cargo-mutants' diffs name the file on the `---` line only: give it to patch.
        let applied = Command::new("patch")
            .args(["--quiet", "--forward", "--no-backup-if-mismatch", "-r", "-"])
            .arg(&m.file)
            .arg("-i")
            .arg(self.a.out.join(diff_path))
            .current_dir(&self.tree)
            .status()
            .context("run patch")?;
        if !applied.success() {
            std::fs::write(self.tree.join(&m.file), &original)?;
            bail!("{}: the diff does not apply to the tree", m.name);
        }
        Ok(original)
    }

    /// Builds `targets` from the tree as it is: whether they built. Nothing to build for a
    /// switched mutant: the schema build holds it.
    fn build(&self, o: &mut Outcome, targets: &[String], log: &Path) -> anyhow::Result<bool> {
        if self.active.get().is_some() {
            return Ok(true);
        }
        let t0 = Instant::now();
        let mut build = self.cargo(&["test", "--no-run"]);
        build.args(targets);
        let built = run_logged(build, log, Duration::from_secs(1800))?;
        o.phase_results.push(PhaseResult {
            phase: "Build",
            duration: secs(t0.elapsed()),
        });
        Ok(built == Some(0))
    }

    fn build_and_test(
        &self,
        o: &mut Outcome,
        targets: &[String],
        tests: &[&TestId],
        log: &Path,
    ) -> anyhow::Result<()> {
        if !self.build(o, targets, log)? {
            o.summary = Summary::Unviable;
            return Ok(());
        }
        if tests.is_empty() {
            o.summary = Summary::MissedMutant;
            o.note = Some("no test reaches it".into());
            return Ok(());
        }
        o.summary = self.test(o, tests, log)?;
        Ok(())
    }

    /// A mutant its lines' tests missed: `wider` (the other tests that reach its function)
    /// built and run; caught when one of them fails.
    fn widen(
        &self,
        o: &mut Outcome,
        targets: &[String],
        wider: &[&TestId],
        log: &Path,
    ) -> anyhow::Result<()> {
        if o.summary != Summary::MissedMutant || wider.is_empty() {
            return Ok(());
        }
        let lines_had = o.selected_tests;
        o.widened_tests = wider
            .iter()
            .map(|t| format!("{} {}", t.binary_id, t.name))
            .collect();
        if !self.build(o, targets, log)? {
            o.summary = Summary::Failure;
            o.note = Some("the binaries of the tests reaching its function did not build".into());
            return Ok(());
        }
        o.summary = self.test(o, wider, log)?;
        o.note = Some(match o.summary {
            Summary::CaughtMutant => format!(
                "caught by a test that reaches its function, not its lines ({lines_had} \
                 reaching its lines passed; {} reach its function)",
                wider.len()
            ),
            _ => format!(
                "{lines_had} tests reach its lines and {} more its function: none failed",
                wider.len()
            ),
        });
        Ok(())
    }

    /// The instrumented run's time of `t` (30 s when it has none).
    fn seconds(&self, t: &TestId) -> f64 {
        let i = self.map.tests.iter().position(|x| x == t);
        i.and_then(|i| self.map.test_s[i]).unwrap_or(30.0)
    }

    /// Runs `tests` (built) in two stages ([`first_stage`]): caught when one fails, missed
    /// when all pass. The tests that failed are remembered as killers of this mutant's
    /// file and function.
    fn test(&self, o: &mut Outcome, tests: &[&TestId], log: &Path) -> anyhow::Result<Summary> {
        let (file, function) = self.current.borrow().clone();
        let (first, rest) = {
            let killers = self.killers.borrow();
            first_stage(tests, &killers, (&file, &function), |t| self.seconds(t))
        };
        for stage in [first, rest] {
            if stage.is_empty() {
                continue;
            }
            let before = std::fs::metadata(log).map_or(0, |m| m.len() as usize);
            let summary = self.test_stage(o, &stage, log)?;
            if summary == Summary::CaughtMutant {
                let text = std::fs::read(log).unwrap_or_default();
                let new = String::from_utf8_lossy(text.get(before..).unwrap_or_default());
                let mut killers = self.killers.borrow_mut();
                for test in failed_in(&new, &stage) {
                    killers.push(Killer {
                        file: file.clone(),
                        function: function.clone(),
                        test,
                    });
                }
            }
            if summary != Summary::MissedMutant {
                return Ok(summary);
            }
        }
        Ok(Summary::MissedMutant)
    }

    /// Runs one stage of `tests`: caught when one fails, missed when all pass.
    fn test_stage(
        &self,
        o: &mut Outcome,
        tests: &[&TestId],
        log: &Path,
    ) -> anyhow::Result<Summary> {
        let expected: f64 = tests.iter().map(|t| self.seconds(t)).sum();
        let limit =
            Duration::from_secs_f64(expected * self.a.timeout_factor + self.a.timeout_extra_s);
        let t0 = Instant::now();
        let mut test = self.nextest_prebuilt();
        // A mutant is caught by its first failing test (retried once): the tests still
        // running are stopped then, not waited for (a catch in 1 s waited 12 s for a slow
        // test beside it).
        test.args([
            "--profile",
            "mutants",
            "--no-tests=fail",
            "--max-fail=1:immediate",
            "-E",
        ])
        .arg(filter(tests));
        let status = run_logged(test, log, limit)?;
        o.phase_results.push(PhaseResult {
            phase: "Test",
            duration: secs(t0.elapsed()),
        });
        Ok(match status {
            Some(0) => Summary::MissedMutant,
            // nextest: 100 a test failed.
            Some(100) => Summary::CaughtMutant,
            None => Summary::Timeout,
            Some(c) => {
                o.note = Some(format!("cargo nextest exited {c}"));
                Summary::Failure
            }
        })
    }
}

pub fn run(mut a: RunArgs) -> anyhow::Result<bool> {
    let started = Instant::now();
    // cargo and patch run in the scratch tree: every path they are given is absolute.
    a.out = std::path::absolute(&a.out)?;
    a.scratch = std::path::absolute(&a.scratch)?;
    let raw: Vec<Value> = crate::read_json(&a.list)?;
    let mutants: Vec<crate::Mutant> = raw
        .iter()
        .map(|v| serde_json::from_value(v.clone()))
        .collect::<Result<_, _>>()
        .context("parse the mutant list")?;
    let map: CoverageMap = crate::read_json(&a.map)?;
    let text = std::fs::read_to_string(&a.equivalent)
        .with_context(|| format!("read {}", a.equivalent.display()))?;
    let eq = crate::parse_equivalent(&text)?;
    let root = scenarios::workspace();
    let (eq_hit, _) = crate::match_equivalents(&root, &mutants, &eq);
    let todo = to_run(
        &mutants,
        |m| eq_hit.contains_key(&m.name),
        a.shard.as_deref(),
    )?;
    let tree = a.scratch.join("tree");
    let target = a.scratch.join("target");
    std::fs::create_dir_all(&tree)?;
    for d in ["diff", "log"] {
        let p = a.out.join(d);
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p)?;
    }
    let written = sync_tree(&root, &tree)?;
    eprintln!(
        "mutants: scratch tree {} ({written} files written); {} mutants to run",
        tree.display(),
        todo.len()
    );
    let in_process = in_process_binaries(&tree)?;
    let mut r = Runner {
        a: &a,
        tree,
        target,
        map,
        in_process,
        killers: Default::default(),
        current: Default::default(),
        switched: BTreeSet::new(),
        active: Default::default(),
    };
    let t0 = Instant::now();
    if !a.no_schemata {
        r.switched = r.schematize(&todo, &mutants)?;
    }
    r.warm()?;
    eprintln!(
        "mutants: {} of {} mutants in one schema build, the test binaries built in {:.1} s \
         (log/schemata.log)",
        r.switched.len(),
        todo.len(),
        t0.elapsed().as_secs_f64()
    );
    let (switched, alone): (Vec<usize>, Vec<usize>) =
        todo.iter().partition(|i| r.switched.contains(i));
    let mut outcomes = Vec::new();
    let mut failures = run_each(&r, &switched, &raw, &mutants, started, &mut outcomes)?;
    if !alone.is_empty() {
        if !r.switched.is_empty() {
            let t0 = Instant::now();
            sync_tree(&root, &r.tree)?;
            r.warm()?;
            eprintln!(
                "mutants: unmutated test binaries built in {:.1} s for the {} mutants that run alone",
                t0.elapsed().as_secs_f64(),
                alone.len()
            );
        }
        failures += run_each(&r, &alone, &raw, &mutants, started, &mut outcomes)?;
    }
    write_outcomes(&r.a.out, secs(started.elapsed()), outcomes)?;
    Ok(failures == 0)
}

/// Runs each mutant of `todo`, one after the other, printing its line and writing the
/// outcomes so far (`outcomes`, which it adds to) after each; returns how many ended in
/// `Failure`.
fn run_each(
    r: &Runner<'_>,
    todo: &[usize],
    raw: &[Value],
    mutants: &[crate::Mutant],
    started: Instant,
    outcomes: &mut Vec<Outcome>,
) -> anyhow::Result<usize> {
    let mut failures = 0;
    for (done, i) in todo.iter().enumerate() {
        let m = &mutants[*i];
        let t0 = Instant::now();
        let o = r.one(*i, &raw[*i], m)?;
        if matches!(o.summary, Summary::Failure) {
            failures += 1;
        }
        eprintln!(
            "mutants: [{}/{}] {:?} {} ({} tests, {:.1} s)",
            done + 1,
            todo.len(),
            o.summary,
            m.name,
            o.selected_tests,
            t0.elapsed().as_secs_f64()
        );
        outcomes.push(o);
        // Written after every mutant: a run cut short still has what it did.
        *outcomes = write_outcomes(&r.a.out, secs(started.elapsed()), std::mem::take(outcomes))?;
    }
    Ok(failures)
}

/// The indices of the mutants this run runs: those not `equivalent`, of `shard` (`k/n`:
/// every n-th from the k-th) when given, the gateway's first (see `Runner::one`).
fn to_run(
    mutants: &[crate::Mutant],
    equivalent: impl Fn(&crate::Mutant) -> bool,
    shard: Option<&str>,
) -> anyhow::Result<Vec<usize>> {
    let (k, n) = match shard {
        Some(s) => {
            let (k, n) = s.split_once('/').context("--shard k/n")?;
            (k.parse::<usize>()?, n.parse::<usize>()?)
        }
        None => (0, 1),
    };
    if n == 0 || k >= n {
        bail!("--shard {k}/{n}: k must be below n");
    }
    let mut todo: Vec<usize> = (0..mutants.len())
        .filter(|i| !equivalent(&mutants[*i]))
        .enumerate()
        .filter(|(j, _)| j % n == k)
        .map(|(_, i)| i)
        .collect();
    todo.sort_by_key(|i| !mutants[*i].file.starts_with("gateway/"));
    Ok(todo)
}

/// Writes `outcomes.json` under `out`; gives the outcomes back.
fn write_outcomes(out: &Path, wall_s: f64, outcomes: Vec<Outcome>) -> anyhow::Result<Vec<Outcome>> {
    let doc = Outcomes {
        selected_by: "mutants run",
        wall_s,
        outcomes,
    };
    let json = serde_json::to_string_pretty(&doc)? + "\n";
    harness::util::write_atomic(&out.join("outcomes.json"), json.as_bytes())?;
    Ok(doc.outcomes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A command killed at its time limit leaves nothing running: not even a process in a
    /// group and session of its own, as nextest runs each test (a mutant's endless loop
    /// went on spinning after the group kill this replaced, and slowed every later build).
    #[test]
    fn a_command_killed_at_its_limit_leaves_no_process_behind() -> anyhow::Result<()> {
        let marker = format!("{}.{}", 60 + std::process::id() % 1000, 7);
        let dir = tempfile::tempdir()?;
        let mut cmd = Command::new("sh");
        cmd.args(["-c", &format!("setsid sleep {marker} & sleep {marker}")]);
        let code = run_logged(cmd, &dir.path().join("log"), Duration::from_millis(500))?;
        assert_eq!(code, None, "not killed at the limit");
        let left = || {
            std::fs::read_dir("/proc")
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
                .filter(|c| c == format!("sleep\0{marker}\0").as_bytes())
                .count()
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while left() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(left(), 0, "a sleep {marker} is still running");
        Ok(())
    }

    #[test]
    fn targets_follow_binary_ids() {
        let ids: BTreeSet<&str> = ["im-gateway", "scenarios::repair", "scenarios::bin/mutants"]
            .into_iter()
            .collect();
        assert_eq!(
            target_args(&ids),
            vec!["--bin=mutants", "--lib", "--test=batch", "--test=repair"]
        );
    }

    fn t(name: &str) -> TestId {
        TestId {
            binary_id: "scenarios::x".into(),
            name: name.into(),
        }
    }

    /// The likeliest catchers first (same function, same file, any), each group quickest
    /// first; a short selection in one stage; nothing is left out.
    #[test]
    fn the_first_stage_is_the_likeliest_catchers() {
        let tests: Vec<TestId> = (0..12).map(|i| t(&format!("t{i}"))).collect();
        let refs: Vec<&TestId> = tests.iter().collect();
        let k = |file: &str, function: &str, i: usize| Killer {
            file: file.into(),
            function: function.into(),
            test: tests[i].clone(),
        };
        let killers = vec![k("a.rs", "g", 9), k("a.rs", "f", 11), k("b.rs", "f", 10)];
        // t0 is the quickest; the killers are the slowest.
        let secs = |x: &TestId| x.name[1..].parse::<f64>().unwrap();
        let (first, rest) = first_stage(&refs, &killers, ("a.rs", "f"), secs);
        let names = |v: &[&TestId]| v.iter().map(|x| x.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&first), ["t11", "t9", "t10", "t0", "t1", "t2"]);
        assert_eq!(names(&rest), ["t3", "t4", "t5", "t6", "t7", "t8"]);
        let (first, rest) = first_stage(&refs[..8], &killers, ("a.rs", "f"), secs);
        assert_eq!(first.len(), 8);
        assert!(rest.is_empty());
    }

    /// A test is a killer when its FAIL line names it; a pass or another test's failure
    /// does not count.
    #[test]
    fn failed_in_reads_the_fail_lines() {
        let (a, b, c) = (t("a"), t("b"), t("c"));
        let log = "        PASS [   1.0s] scenarios::x a\n        FAIL [   2.0s] scenarios::x b\n";
        assert_eq!(failed_in(log, &[&a, &b, &c]), vec![b.clone()]);
    }

    #[test]
    fn the_filter_names_each_test_in_its_binary() {
        let t = TestId {
            binary_id: "scenarios::repair".into(),
            name: "a::b".into(),
        };
        assert_eq!(
            filter(&[&t, &t]),
            "(binary_id(=scenarios::repair) & test(=a::b)) | (binary_id(=scenarios::repair) & test(=a::b))"
        );
    }
}
