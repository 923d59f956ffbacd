//! `make mutants`'s runner, reader and judge (scripts/mutants.sh lists the mutants with
//! cargo-mutants, then runs this).
//!
//! - `mutants coverage-map` ([`coverage`]): folds the per-test coverage of
//!   scripts/mutants-coverage.sh into the map of which tests execute each line.
//! - `mutants run` ([`run`]): runs each mutant of the list against only the tests that
//!   execute its lines, in a scratch copy of the workspace; writes outcomes in the shape of
//!   cargo-mutants' own.
//! - `mutants exclude`: from the mutant list (`cargo mutants --list --json`) and the
//!   committed list of equivalent mutants (`mutants/equivalent.txt`), the `--exclude-re`
//!   that keeps equivalent mutants from being run.
//! - `mutants report`: reads one or more `mutants.out/outcomes.json` (several shards, from
//!   this machine or others), classifies every mutant of the list (caught, missed, timeout,
//!   unviable, equivalent, not run), and writes `evidence/mutants/result.json` (format:
//!   evidence/README.md). Exit status 0 when the verdict is PASS (no missed mutant outside the
//!   equivalent list, and a kill rate of at least [`KILL_RATE_MIN`]), 1 on FAIL, 2 on a usage
//!   or read error.
//!
//! The equivalent list: one entry per mutant that cannot change behaviour, as
//! `cargo mutants --list --line-col=false` names it, then indented lines `where: TEXT` (a
//! piece of the mutated source line, needed when the name alone matches several mutants)
//! and `because: REASON` (required). Lines starting with `#` are comments.

mod coverage;
mod run;
mod schemata;

use anyhow::{bail, Context};
use im_check::Verdict;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The format of evidence/mutants/result.json written by this version.
/// 2 added `selection`, `coverage`, `runs[]`, `selected_tests` and `note` (runs by
/// `mutants run`); 1 was written for cargo-mutants' own runs of the whole profile.
const SCHEMA_VERSION: u32 = 2;

/// The verdict's kill-rate floor (issue 18): caught + timeout over everything that ran and
/// built.
const KILL_RATE_MIN: f64 = 0.9;

/// Mutation testing's reader and judge (`make mutants` runs it; see scripts/mutants.sh).
#[derive(clap::Parser, Debug)]
#[command(
    name = "mutants",
    after_help = "Reads no environment variables.\n\
                  Exit status: 0 PASS (or exclude printed, or every mutant run judged), \
                  1 FAIL (or a mutant run not judged), 2 usage or read error."
)]
enum Cmd {
    /// Print the --exclude-re that skips the equivalent mutants of LIST (nothing if none).
    Exclude {
        /// `cargo mutants --list --json` output.
        #[arg(long)]
        list: PathBuf,
        /// The committed list of equivalent mutants.
        #[arg(long)]
        equivalent: PathBuf,
    },
    /// Judge the outcomes and write the evidence.
    Report(ReportArgs),
    /// Fold per-test lcov files into the coverage map (scripts/mutants-coverage.sh).
    CoverageMap(coverage::MapArgs),
    /// Run each mutant against the tests that reach its lines.
    Run(run::RunArgs),
}

#[derive(clap::Args, Debug)]
struct ReportArgs {
    /// `cargo mutants --list --json` output: every mutant the run was asked about.
    #[arg(long)]
    list: PathBuf,
    /// The committed list of equivalent mutants.
    #[arg(long)]
    equivalent: PathBuf,
    /// A `mutants.out` directory (repeat it to merge shards).
    #[arg(long = "outcomes", required = true)]
    outcomes: Vec<PathBuf>,
    /// Where the evidence goes.
    #[arg(long)]
    out: PathBuf,
    /// The shard the run was (`k/n`), recorded as is.
    #[arg(long)]
    shard: Option<String>,
    /// The git revision `--in-diff` compared against, recorded as is.
    #[arg(long)]
    in_diff: Option<String>,
    /// The `--file` globs the run examined, recorded as is.
    #[arg(long = "file")]
    files: Vec<String>,
    /// Seconds the unmutated baseline of the `mutants` test profile took.
    #[arg(long)]
    baseline_s: Option<f64>,
    /// Wall-clock seconds of the whole cargo-mutants run.
    #[arg(long)]
    wall_s: Option<f64>,
    /// When the run started (RFC 3339).
    #[arg(long)]
    started_at: Option<String>,
    /// cargo-mutants' version line.
    #[arg(long)]
    tool: Option<String>,
    /// The commit the mutants ran at, and whether the tree differed from it, as taken when
    /// the run started (scripts/mutants.sh): a commit made during a long run must not be
    /// named as the one it tested. Without them, HEAD and the tree as the report finds them.
    #[arg(long)]
    commit: Option<String>,
    #[arg(long)]
    dirty: Option<bool>,
    /// The coverage map the run selected its tests by (its timing is recorded).
    #[arg(long)]
    coverage_map: Option<PathBuf>,
}

/// One mutant as `cargo mutants --list --json` and outcomes.json describe it (the fields
/// read here; the rest is ignored).
#[derive(Debug, Clone, Deserialize)]
struct Mutant {
    name: String,
    file: String,
    function: Option<Function>,
    span: Span,
    replacement: String,
    genre: String,
}

#[derive(Debug, Clone, Deserialize)]
struct Function {
    function_name: String,
    /// The whole function's lines (cargo-mutants gives them; optional for the tests' sake).
    #[serde(default)]
    span: Option<Span>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
struct Span {
    start: LineCol,
    /// Always given by cargo-mutants; optional for the tests' sake.
    #[serde(default)]
    end: Option<LineCol>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
struct LineCol {
    line: usize,
    /// 1-based; optional for the tests' sake.
    #[serde(default)]
    column: usize,
}

/// outcomes.json (the fields read here).
#[derive(Debug, Deserialize)]
struct Outcomes {
    outcomes: Vec<Outcome>,
    /// `mutants run` only: its wall-clock seconds.
    #[serde(default)]
    wall_s: Option<f64>,
}

#[derive(Debug, Deserialize)]
struct Outcome {
    scenario: Scenario,
    summary: Summary,
    diff_path: Option<String>,
    phase_results: Vec<PhaseResult>,
    /// `mutants run` only: how many tests reach the mutated lines.
    #[serde(default)]
    selected_tests: Option<usize>,
    /// `mutants run` only: why, when not a test's verdict ("no test reaches it").
    #[serde(default)]
    note: Option<String>,
}

#[derive(Debug, Deserialize)]
enum Scenario {
    Baseline,
    Mutant(Mutant),
}

/// cargo-mutants' summary of one scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
enum Summary {
    Success,
    CaughtMutant,
    MissedMutant,
    Timeout,
    Unviable,
    Failure,
}

#[derive(Debug, Deserialize)]
struct PhaseResult {
    phase: String,
    duration: f64,
}

/// What became of one mutant, as the evidence reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
enum Fate {
    Caught,
    Missed,
    Timeout,
    Unviable,
    /// In the equivalent list (not run).
    Equivalent,
    /// Listed but in no outcomes given (another shard, or the run was cut short).
    NotRun,
}

/// One entry of the equivalent list.
#[derive(Debug, Clone)]
struct Equivalent {
    /// The name without line and column.
    name: String,
    /// A piece of the mutated line, if the entry gives one.
    at: Option<String>,
    because: String,
}

fn parse_equivalent(text: &str) -> anyhow::Result<Vec<Equivalent>> {
    let mut out: Vec<Equivalent> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim_end();
        if line.trim().is_empty() || line.trim_start().starts_with('#') {
            continue;
        }
        if !line.starts_with(char::is_whitespace) {
            out.push(Equivalent {
                name: line.to_string(),
                at: None,
                because: String::new(),
            });
            continue;
        }
        let Some(e) = out.last_mut() else {
            bail!("line {}: an indented line before any mutant", i + 1);
        };
        let l = line.trim_start();
        if let Some(w) = l.strip_prefix("where:") {
            e.at = Some(w.trim().to_string());
        } else if let Some(b) = l.strip_prefix("because:") {
            e.because = b.trim().to_string();
        } else if !e.because.is_empty() {
            e.because.push(' ');
            e.because.push_str(l);
        } else {
            bail!("line {}: expected `where:` or `because:`", i + 1);
        }
    }
    if let Some(e) = out.iter().find(|e| e.because.is_empty()) {
        bail!(
            "{}: no `because:` (every equivalent mutant says why)",
            e.name
        );
    }
    Ok(out)
}

/// `gateway/src/x.rs:12:5: replace …` → `gateway/src/x.rs: replace …`.
fn name_without_position(m: &Mutant) -> String {
    let rest = m.name.strip_prefix(&m.file).unwrap_or(&m.name);
    let desc = rest.splitn(4, ':').nth(3).unwrap_or(rest).trim_start();
    format!("{}: {desc}", m.file)
}

/// The source line a mutant changes (read from the workspace), if it can be read.
fn source_line(root: &Path, m: &Mutant) -> Option<String> {
    let text = std::fs::read_to_string(root.join(&m.file)).ok()?;
    text.lines()
        .nth(m.span.start.line.checked_sub(1)?)
        .map(str::to_string)
}

/// For each mutant, the equivalent-list entry it matches (index into `list`), and the
/// entries of the listed mutants' files that match no mutant (stale: the code changed
/// under them). An entry of a file no mutant of the list is in (a run of other files) is
/// not judged.
fn match_equivalents(
    root: &Path,
    mutants: &[Mutant],
    list: &[Equivalent],
) -> (BTreeMap<String, usize>, Vec<usize>) {
    let mut hit = BTreeMap::new();
    let mut used = vec![false; list.len()];
    for m in mutants {
        let name = name_without_position(m);
        let line = source_line(root, m).unwrap_or_default();
        let found = list.iter().position(|e| {
            e.name == name && e.at.as_ref().is_none_or(|w| line.contains(w.as_str()))
        });
        if let Some(i) = found {
            used[i] = true;
            hit.insert(m.name.clone(), i);
        }
    }
    let files: BTreeSet<&str> = mutants.iter().map(|m| m.file.as_str()).collect();
    let examined = |e: &Equivalent| {
        e.name
            .split_once(": ")
            .is_some_and(|(file, _)| files.contains(file))
    };
    let stale = (0..list.len())
        .filter(|i| !used[*i] && examined(&list[*i]))
        .collect();
    (hit, stale)
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> anyhow::Result<T> {
    let bytes = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
    serde_json::from_slice(&bytes).with_context(|| format!("parse {}", path.display()))
}

fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn exclude(list: &Path, equivalent: &Path) -> anyhow::Result<()> {
    let mutants: Vec<Mutant> = read_json(list)?;
    let text = std::fs::read_to_string(equivalent)
        .with_context(|| format!("read {}", equivalent.display()))?;
    let eq = parse_equivalent(&text).with_context(|| format!("{}", equivalent.display()))?;
    let (hit, _) = match_equivalents(&scenarios::workspace(), &mutants, &eq);
    if hit.is_empty() {
        return Ok(());
    }
    let names: Vec<String> = hit.keys().map(|n| regex_escape(n)).collect();
    println!("^({})$", names.join("|"));
    Ok(())
}

/// One mutant as the evidence lists it.
#[derive(Debug, Serialize)]
struct Listed {
    name: String,
    file: String,
    line: usize,
    function: Option<String>,
    genre: String,
    replacement: String,
    /// The diff cargo-mutants applied (missed and timed-out mutants).
    #[serde(skip_serializing_if = "Option::is_none")]
    diff: Option<String>,
    /// Why it cannot change behaviour (equivalent mutants).
    #[serde(skip_serializing_if = "Option::is_none")]
    because: Option<String>,
    /// How many tests reach its lines (runs with test selection).
    #[serde(skip_serializing_if = "Option::is_none")]
    selected_tests: Option<usize>,
    /// Why it has its fate when no test decided it ("no test reaches it").
    #[serde(skip_serializing_if = "Option::is_none")]
    note: Option<String>,
}

/// One mutant that ran, as `runs[]` lists it.
#[derive(Debug, Serialize)]
struct RunEntry {
    name: String,
    fate: Fate,
    selected_tests: Option<usize>,
    build_s: f64,
    test_s: f64,
}

/// Counts per file (and in total).
#[derive(Debug, Default, Clone, Serialize)]
struct Counts {
    mutants: usize,
    caught: usize,
    missed: usize,
    timeout: usize,
    unviable: usize,
    equivalent: usize,
    not_run: usize,
    /// (caught + timeout) / (caught + missed + timeout); null when none of them ran.
    kill_rate: Option<f64>,
}

impl Counts {
    fn add(&mut self, f: Fate) {
        self.mutants += 1;
        match f {
            Fate::Caught => self.caught += 1,
            Fate::Missed => self.missed += 1,
            Fate::Timeout => self.timeout += 1,
            Fate::Unviable => self.unviable += 1,
            Fate::Equivalent => self.equivalent += 1,
            Fate::NotRun => self.not_run += 1,
        }
        let ran = self.caught + self.missed + self.timeout;
        self.kill_rate = (ran > 0)
            .then(|| ((self.caught + self.timeout) as f64 / ran as f64 * 1e4).round() / 1e4);
    }
}

/// What one outcome cost, in seconds, and what selected its tests.
#[derive(Debug, Clone, Default)]
struct Cost {
    build_s: f64,
    test_s: f64,
    selected_tests: Option<usize>,
    note: Option<String>,
}

/// Timing figures of the run (seconds).
#[derive(Debug, Serialize)]
struct Timing {
    /// Wall-clock time of the cargo-mutants run (null when not given).
    wall_s: Option<f64>,
    /// Mutants that ran (built or failed to build).
    mutants_run: usize,
    /// wall_s / mutants_run.
    per_mutant_wall_s: Option<f64>,
    build_s_median: Option<f64>,
    test_s_median: Option<f64>,
    /// The unmutated `mutants` test profile, run once before the mutants (null when the
    /// instrumented run of the coverage map stood for it).
    baseline_test_s: Option<f64>,
    /// Median over the mutants that built of the tests selected for each.
    selected_tests_median: Option<f64>,
}

/// The coverage map a selecting run used (seconds as measured when it was taken).
#[derive(Debug, Serialize)]
struct CoverageInfo {
    generated_at: String,
    key: String,
    tests: usize,
    build_s: Option<f64>,
    run_s: Option<f64>,
    export_s: Option<f64>,
}

fn median(mut xs: Vec<f64>) -> Option<f64> {
    xs.sort_by(f64::total_cmp);
    let v = *xs.get(xs.len() / 2)?;
    Some((v * 10.0).round() / 10.0)
}

/// evidence/mutants/result.json.
#[derive(Debug, Serialize)]
struct Doc {
    schema_version: u32,
    generated_by: &'static str,
    generated_at: String,
    started_at: Option<String>,
    commit: Option<String>,
    /// Whether the working tree had uncommitted changes when the report was written.
    dirty: bool,
    tool: Option<String>,
    nextest_profile: &'static str,
    /// `coverage` (each mutant ran the tests that reach its lines, `mutants run`) or
    /// `whole profile` (cargo-mutants ran the whole profile for each).
    selection: &'static str,
    coverage: Option<CoverageInfo>,
    files: Vec<String>,
    shard: Option<String>,
    in_diff: Option<String>,
    /// PASS or FAIL, with the reasons of a FAIL.
    verdict: Verdict,
    reasons: Vec<String>,
    kill_rate_min: f64,
    totals: Counts,
    per_file: BTreeMap<String, Counts>,
    timing: Timing,
    missed: Vec<Listed>,
    timeout: Vec<Listed>,
    equivalent: Vec<Listed>,
    /// Every mutant that ran, with its fate, selection and cost.
    runs: Vec<RunEntry>,
    /// Equivalent-list entries that matched no mutant of the list (the code moved on).
    stale_equivalent: Vec<String>,
}

fn fate_of(s: Summary) -> Option<Fate> {
    match s {
        Summary::CaughtMutant => Some(Fate::Caught),
        Summary::MissedMutant => Some(Fate::Missed),
        Summary::Timeout => Some(Fate::Timeout),
        Summary::Unviable => Some(Fate::Unviable),
        Summary::Success | Summary::Failure => None,
    }
}

/// Every mutant's outcome (by name) and cost, and its diff, from the outcomes directories.
type Ran = BTreeMap<String, (Fate, Cost, Option<String>)>;

/// What the outcome directories say about the whole: whether `mutants run` wrote them, and
/// the wall-clock seconds it recorded (summed over directories).
#[derive(Debug, Default)]
struct RunsInfo {
    selected: bool,
    wall_s: Option<f64>,
}

/// The mutants to report: the list, and any mutant the outcomes name that the list lacks
/// (a tree that changed between the list and the run): nothing that ran goes uncounted.
fn all_mutants(mut list: Vec<Mutant>, outcome_mutants: Vec<Mutant>) -> Vec<Mutant> {
    let known: std::collections::BTreeSet<String> = list.iter().map(|m| m.name.clone()).collect();
    list.extend(
        outcome_mutants
            .into_iter()
            .filter(|m| !known.contains(&m.name)),
    );
    list
}

fn read_outcomes(dirs: &[PathBuf]) -> anyhow::Result<(Ran, Vec<Mutant>, RunsInfo)> {
    let mut ran = Ran::new();
    let mut mutants = Vec::new();
    let mut info = RunsInfo::default();
    for dir in dirs {
        let o: Outcomes = read_json(&dir.join("outcomes.json"))?;
        if let Some(w) = o.wall_s {
            info.selected = true;
            info.wall_s = Some(info.wall_s.unwrap_or(0.0) + w);
        }
        for out in o.outcomes {
            let Scenario::Mutant(m) = out.scenario else {
                continue;
            };
            if out.summary == Summary::Failure && out.selected_tests.is_some() {
                // `mutants run` could not judge it (nextest ended otherwise than pass or
                // fail): reported as not run, with the reason on stderr.
                eprintln!(
                    "mutants: {}: not judged ({})",
                    m.name,
                    out.note.as_deref().unwrap_or("failure")
                );
                continue;
            }
            let Some(fate) = fate_of(out.summary) else {
                bail!(
                    "{}: {} has summary {:?}",
                    dir.display(),
                    m.name,
                    out.summary
                );
            };
            let mut cost = Cost {
                selected_tests: out.selected_tests,
                note: out.note,
                ..Cost::default()
            };
            for p in &out.phase_results {
                match p.phase.as_str() {
                    "Test" => cost.test_s += p.duration,
                    _ => cost.build_s += p.duration,
                }
            }
            let diff = match out.diff_path {
                Some(d) => Some(
                    std::fs::read_to_string(dir.join(&d))
                        .with_context(|| format!("read {}", dir.join(&d).display()))?,
                ),
                None => None,
            };
            ran.insert(m.name.clone(), (fate, cost, diff));
            mutants.push(m);
        }
    }
    Ok((ran, mutants, info))
}

fn listed(
    m: &Mutant,
    diff: Option<String>,
    because: Option<String>,
    cost: Option<&Cost>,
) -> Listed {
    Listed {
        selected_tests: cost.and_then(|c| c.selected_tests),
        note: cost.and_then(|c| c.note.clone()),
        name: m.name.clone(),
        file: m.file.clone(),
        line: m.span.start.line,
        function: m.function.as_ref().map(|f| f.function_name.clone()),
        genre: m.genre.clone(),
        replacement: m.replacement.clone(),
        diff,
        because,
    }
}

/// The mutants sorted by fate: the counts in total and per file, the lists the
/// evidence names, and the costs the timing figures are taken from.
#[derive(Default)]
struct Tally {
    totals: Counts,
    per_file: BTreeMap<String, Counts>,
    missed: Vec<Listed>,
    timeout: Vec<Listed>,
    equivalent: Vec<Listed>,
    builds: Vec<f64>,
    tests: Vec<f64>,
    selected: Vec<f64>,
    runs: Vec<RunEntry>,
}

/// Gives every mutant its fate (its outcome, else equivalent when the list explains it,
/// else not run) and adds it to the tally.
fn tally(
    mutants: &[Mutant],
    ran: &Ran,
    eq_hit: &BTreeMap<String, usize>,
    eq: &[Equivalent],
) -> Tally {
    let mut t = Tally::default();
    for m in mutants {
        let outcome = ran.get(&m.name);
        let fate = match (outcome, eq_hit.get(&m.name)) {
            (Some((f, _, _)), _) => *f,
            (None, Some(_)) => Fate::Equivalent,
            (None, None) => Fate::NotRun,
        };
        t.totals.add(fate);
        t.per_file.entry(m.file.clone()).or_default().add(fate);
        if let Some((_, cost, _)) = outcome {
            t.builds.push(cost.build_s);
            if fate != Fate::Unviable {
                t.tests.push(cost.test_s);
                t.selected.extend(cost.selected_tests.map(|n| n as f64));
            }
            t.runs.push(RunEntry {
                name: m.name.clone(),
                fate,
                selected_tests: cost.selected_tests,
                build_s: cost.build_s,
                test_s: cost.test_s,
            });
        }
        let diff = || outcome.and_then(|o| o.2.clone());
        let cost = outcome.map(|o| &o.1);
        let because = eq_hit.get(&m.name).map(|i| eq[*i].because.clone());
        match fate {
            Fate::Missed => t.missed.push(listed(m, diff(), because, cost)),
            Fate::Timeout => t.timeout.push(listed(m, diff(), None, cost)),
            Fate::Equivalent => t.equivalent.push(listed(m, None, because, None)),
            _ => {}
        }
    }
    t
}

fn report(a: ReportArgs) -> anyhow::Result<bool> {
    let (ran, ran_mutants, info) = read_outcomes(&a.outcomes)?;
    let mutants = all_mutants(read_json(&a.list)?, ran_mutants);
    let text = std::fs::read_to_string(&a.equivalent)
        .with_context(|| format!("read {}", a.equivalent.display()))?;
    let eq = parse_equivalent(&text).with_context(|| format!("{}", a.equivalent.display()))?;
    let (eq_hit, stale) = match_equivalents(&scenarios::workspace(), &mutants, &eq);
    let t = tally(&mutants, &ran, &eq_hit, &eq);
    let reasons = failures(&t.missed, &t.totals);
    let mutants_run = ran.len();
    let coverage = a.coverage_map.as_deref().map(coverage_info).transpose()?;
    let wall_s = a.wall_s.or(info.wall_s);
    let doc = Doc {
        schema_version: SCHEMA_VERSION,
        generated_by: "make mutants",
        generated_at: scenarios::rfc3339_now(),
        started_at: a.started_at,
        commit: a.commit.or_else(|| scenarios::git(&["rev-parse", "HEAD"])),
        dirty: a.dirty.unwrap_or_else(|| {
            scenarios::git(&["status", "--porcelain"]).is_some_and(|s| !s.is_empty())
        }),
        tool: a.tool,
        nextest_profile: "mutants",
        selection: if info.selected {
            "coverage"
        } else {
            "whole profile"
        },
        coverage,
        files: a.files,
        shard: a.shard,
        in_diff: a.in_diff,
        verdict: Verdict::of(reasons.is_empty()),
        reasons,
        kill_rate_min: KILL_RATE_MIN,
        totals: t.totals.clone(),
        per_file: t.per_file,
        timing: Timing {
            wall_s,
            mutants_run,
            per_mutant_wall_s: wall_s
                .filter(|_| mutants_run > 0)
                .map(|w| (w / mutants_run as f64 * 10.0).round() / 10.0),
            build_s_median: median(t.builds),
            test_s_median: median(t.tests),
            baseline_test_s: a.baseline_s,
            selected_tests_median: median(t.selected),
        },
        missed: t.missed,
        timeout: t.timeout,
        equivalent: t.equivalent,
        runs: t.runs,
        stale_equivalent: stale.iter().map(|i| eq[*i].name.clone()).collect(),
    };
    let out = write_doc(&doc, &a.out)?;
    print_summary(&doc, &out);
    Ok(doc.verdict.is_pass())
}

/// Writes the report, atomically, where the run publishes (creating its directory),
/// and returns that path.
fn write_doc(doc: &Doc, out: &Path) -> anyhow::Result<PathBuf> {
    let json = serde_json::to_string_pretty(doc)? + "\n";
    let out = harness::util::publish_path(out);
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    harness::util::write_atomic(&out, json.as_bytes())?;
    Ok(out)
}

/// Why a run fails (empty: it passes): a missed mutant the equivalent list does not
/// explain (one it does explain was run anyway and is no failure), a kill rate below
/// [`KILL_RATE_MIN`], or no mutant run at all.
fn failures(missed: &[Listed], totals: &Counts) -> Vec<String> {
    let mut reasons = Vec::new();
    let unexplained = missed.iter().filter(|l| l.because.is_none()).count();
    if unexplained > 0 {
        reasons.push(format!(
            "{unexplained} missed mutant(s) not in the equivalent list"
        ));
    }
    match totals.kill_rate {
        Some(r) if r < KILL_RATE_MIN => {
            reasons.push(format!("kill rate {r} below {KILL_RATE_MIN}"))
        }
        None => reasons.push("no mutant ran".into()),
        _ => {}
    }
    reasons
}

/// What the coverage map at `path` says of itself (when tests were selected by it).
fn coverage_info(path: &Path) -> anyhow::Result<CoverageInfo> {
    let map: coverage::CoverageMap = read_json(path)?;
    Ok(CoverageInfo {
        generated_at: map.generated_at,
        key: map.key,
        tests: map.tests.len(),
        build_s: map.build_s,
        run_s: map.run_s,
        export_s: map.export_s,
    })
}

fn print_summary(doc: &Doc, out: &Path) {
    let t = &doc.totals;
    eprintln!(
        "mutants: {} mutants: {} caught, {} missed, {} timeout, {} unviable, {} equivalent, {} not run; kill rate {}",
        t.mutants,
        t.caught,
        t.missed,
        t.timeout,
        t.unviable,
        t.equivalent,
        t.not_run,
        t.kill_rate.map_or("n/a".into(), |r| format!("{r}"))
    );
    for m in &doc.missed {
        match &m.note {
            Some(n) => eprintln!("  missed ({n}): {}", m.name),
            None => eprintln!("  missed: {}", m.name),
        }
    }
    for s in &doc.stale_equivalent {
        eprintln!("  stale equivalent entry (matches no mutant): {s}");
    }
    eprintln!("mutants: {} ({})", doc.verdict, out.display());
}

fn main() -> ExitCode {
    let cmd: Cmd = clap::Parser::parse();
    let r = match cmd {
        Cmd::Exclude { list, equivalent } => exclude(&list, &equivalent).map(|()| true),
        Cmd::Report(a) => report(a),
        Cmd::CoverageMap(a) => coverage::build_map(a).map(|()| true),
        Cmd::Run(a) => run::run(a),
    };
    match r {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("mutants: {e:#}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mutant(name: &str, file: &str, line: usize) -> Mutant {
        Mutant {
            name: name.into(),
            file: file.into(),
            function: None,
            span: Span {
                start: LineCol { line, column: 1 },
                end: None,
            },
            replacement: String::new(),
            genre: String::new(),
        }
    }

    #[test]
    fn names_lose_their_position() {
        let m = mutant("a/b.rs:12:5: replace x with y in F::g", "a/b.rs", 12);
        assert_eq!(
            name_without_position(&m),
            "a/b.rs: replace x with y in F::g"
        );
    }

    #[test]
    fn equivalent_entries_need_a_reason_and_match_by_line_text() {
        let text =
            "# c\na/b.rs: replace < with <= in f\n  where: x < y\n  because: one\n  and two\n";
        let eq = parse_equivalent(text).unwrap();
        assert_eq!(eq.len(), 1);
        assert_eq!(eq[0].because, "one and two");
        assert!(parse_equivalent("a/b.rs: replace x\n").is_err());
        assert!(parse_equivalent("  because: x\n").is_err());
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("a")).unwrap();
        std::fs::write(dir.path().join("a/b.rs"), "fn f() {\n  x < y\n  p < q\n}\n").unwrap();
        let ms = [
            mutant("a/b.rs:2:5: replace < with <= in f", "a/b.rs", 2),
            mutant("a/b.rs:3:5: replace < with <= in f", "a/b.rs", 3),
        ];
        let (hit, stale) = match_equivalents(dir.path(), &ms, &eq);
        assert_eq!(hit.keys().collect::<Vec<_>>(), vec![&ms[0].name]);
        assert!(stale.is_empty());
        let (hit, stale) = match_equivalents(dir.path(), &ms[1..], &eq);
        assert!(hit.is_empty() && stale == vec![0]);
        // A run of another file does not judge the entry.
        let other = [mutant("c/d.rs:1:1: replace < with <= in h", "c/d.rs", 1)];
        let (hit, stale) = match_equivalents(dir.path(), &other, &eq);
        assert!(hit.is_empty() && stale.is_empty(), "{stale:?}");
    }

    #[test]
    fn kill_rate_counts_timeouts_as_caught_and_ignores_the_rest() {
        let mut c = Counts::default();
        for f in [
            Fate::Caught,
            Fate::Caught,
            Fate::Timeout,
            Fate::Missed,
            Fate::Unviable,
            Fate::Equivalent,
            Fate::NotRun,
        ] {
            c.add(f);
        }
        assert_eq!(c.kill_rate, Some(0.75));
        assert_eq!(c.mutants, 7);
    }

    #[test]
    fn regex_escapes_metacharacters() {
        assert_eq!(regex_escape("a.b(c) -> D<'_>"), "a\\.b\\(c\\) \\-> D<'_>");
    }
}
