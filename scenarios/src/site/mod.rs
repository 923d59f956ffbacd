//! The evidence as a static site (issue 22, `make report`): one self-contained page per
//! part (the im-06 checks, the nemesis, the controls, the bench, the durability matrix,
//! mutation testing, the proof record) and an index of their verdicts, when and at which
//! commit each was produced, and whether that provenance holds: STALE (older than the
//! code), UNKNOWN COMMIT, DIRTY, PATCHWORK. No script, no font, no request: inline CSS and
//! SVG only.
//!
//! Owns: reading the committed evidence files (their on-disk schema) and rendering them.
//! Must not: run anything, or ask git (the caller passes each part's [`Provenance`]), so
//! that rendering is a pure function of its inputs.

mod bench;
mod durability;
mod mutants;
mod pages;
mod proof;
pub mod svg;

use serde_json::Value;
use std::fmt::Write as _;
use std::path::Path;
use svg::esc;

/// One part of the evidence: its name, its page, its file below `evidence/`, and which
/// format that file has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartName {
    pub title: &'static str,
    pub page: &'static str,
    pub file: &'static str,
    pub kind: Kind,
    /// A part whose file may not exist yet (the proof record before the first `make
    /// proof`): then it is "not given", not an error.
    pub optional: bool,
}

/// A part's format (evidence/README.md), which says how it is judged and drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Checks,
    Nemesis,
    Controls,
    Bench,
    Durability,
    Mutants,
    Proof,
}

/// The parts, in the index's order.
pub const PARTS: [PartName; 9] = [
    PartName {
        title: "im-06 checks",
        page: "checks.html",
        file: "im-06/result.json",
        kind: Kind::Checks,
        optional: false,
    },
    PartName {
        title: "Nemesis",
        page: "nemesis.html",
        file: "nemesis/result.json",
        kind: Kind::Nemesis,
        optional: false,
    },
    PartName {
        title: "Controls",
        page: "controls.html",
        file: "controls/result.json",
        kind: Kind::Controls,
        optional: false,
    },
    PartName {
        title: "Bench",
        page: "bench.html",
        file: "bench/result.json",
        kind: Kind::Bench,
        optional: false,
    },
    PartName {
        title: "Nemesis, 3 gateways",
        page: "nemesis-3-gateways.html",
        file: "nemesis/gateways-3.json",
        kind: Kind::Nemesis,
        optional: false,
    },
    PartName {
        title: "Durability",
        page: "durability.html",
        file: "durability/result.json",
        kind: Kind::Durability,
        optional: false,
    },
    PartName {
        title: "Mutants",
        page: "mutants.html",
        file: "mutants/result.json",
        kind: Kind::Mutants,
        optional: false,
    },
    PartName {
        title: "Proof",
        page: "proof.html",
        file: "proof/result.json",
        kind: Kind::Proof,
        optional: true,
    },
    PartName {
        title: "Mutants since the whole run",
        page: "mutants-in-diff.html",
        file: "mutants/in-diff.json",
        kind: Kind::Mutants,
        optional: true,
    },
];

/// Where a part's file came from and whether that can be trusted: the commit it ran at,
/// the newest commit that changed its code after it (then the part is older than the
/// code), and what git could not vouch for. Made by the caller (`report` asks git); see
/// [`Provenance::flags`] for how each state reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Provenance {
    /// The commit the part ran at: the one its file records (shown even when git does not
    /// know it, see `unknown`); when the file records none, the commit that last wrote it.
    pub commit: Option<String>,
    /// Whether `commit` is the one the file records (false: the last writer's).
    pub recorded: bool,
    /// The newest commit that changed the part's code after any commit it ran at.
    pub newer_code: Option<String>,
    /// Recorded commits git cannot vouch for, each with why: not a commit of this
    /// repository, or not an ancestor of HEAD. Their staleness cannot be judged.
    pub unknown: Vec<(String, String)>,
    /// The file says it ran on a tree with uncommitted changes (`git_dirty` or `dirty`).
    pub dirty: bool,
    /// The other commits that parts of the file record (an entry's or a partial run's
    /// `git_commit` that is not the top-level one), each with where it is recorded.
    pub patchwork: Vec<(String, String)>,
    /// The code changed after the part ran, but a current run of another part covers that
    /// change (the mutants in the diff since a whole mutation run): what covers it. The
    /// part is then current, and says so.
    pub covered_by: Option<String>,
}

impl Provenance {
    /// Each way this provenance falls short, as the words `report` prints and the site
    /// shows (a caller may grep for STALE, UNKNOWN, DIRTY, PATCHWORK); empty when current.
    pub fn flags(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (c, why) in &self.unknown {
            out.push(format!("UNKNOWN COMMIT {} ({why})", short_commit(Some(c))));
        }
        if self.dirty {
            out.push("DIRTY (ran on a tree with uncommitted changes)".into());
        }
        let flagged: Vec<&(String, String)> = self
            .patchwork
            .iter()
            .filter(|(_, at)| !is_input_record(at))
            .collect();
        if !flagged.is_empty() {
            let distinct = |run_records: bool, top: Option<&str>| {
                let mut cs: Vec<&str> = flagged
                    .iter()
                    .filter(|(_, at)| is_run_record(at) == run_records)
                    .map(|(c, _)| c.as_str())
                    .chain(top)
                    .collect();
                cs.sort_unstable();
                cs.dedup();
                cs.len()
            };
            let mut f = format!(
                "PATCHWORK (entries from {} commits",
                distinct(false, self.commit.as_deref())
            );
            if flagged.iter().any(|(_, at)| is_run_record(at)) {
                let _ = write!(f, ", partial runs from {}", distinct(true, None));
            }
            f.push(')');
            out.push(f);
        }
        if let Some(c) = &self.newer_code {
            out.push(format!("STALE (code changed at {})", short_commit(Some(c))));
        }
        out
    }
}

/// What a part's file says about where it ran: its commit (`environment.git_commit`,
/// `git_commit` or `commit` at the top), whether the tree was dirty, and every other
/// `git_commit` below the top (an entry's, a partial run's) with where it is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recorded {
    pub commit: Option<String>,
    pub dirty: bool,
    pub nested: Vec<(String, String)>,
}

/// Reads [`Recorded`] from a part's file.
pub fn recorded(v: &Value) -> Recorded {
    const TOP: [&str; 3] = ["/environment/git_commit", "/git_commit", "/commit"];
    let commit = TOP
        .iter()
        .find_map(|p| v.pointer(p).and_then(Value::as_str))
        .map(str::to_string);
    let dirty = [
        "/environment/git_dirty",
        "/git_dirty",
        "/environment/dirty",
        "/dirty",
    ]
    .iter()
    .any(|p| v.pointer(p).and_then(Value::as_bool) == Some(true));
    let mut nested = Vec::new();
    nested_commits(v, "", &mut nested);
    nested.retain(|(c, _)| Some(c) != commit.as_ref());
    Recorded {
        commit,
        dirty,
        nested,
    }
}

/// Whether a nested commit's place (see [`Recorded::nested`]) is a record of an earlier
/// partial run (`environment.partial_runs[]`, the controls'): history whose entries later
/// runs may have replaced, rather than an entry the file shows.
pub fn is_run_record(at: &str) -> bool {
    at.contains("/partial_runs/")
}

/// Whether a nested commit's place is where a controls entry's catchers were chosen
/// (`controls[].whole_run_catchers`: the whole-suite run whose failing tests the targeted
/// runs re-run, issue 41). An input of the entry, not a result: the entry's verdict was
/// observed at its own commit, against the bug and the clean gateway there. Listed on the
/// page, neither judged (STALE, UNKNOWN COMMIT) nor flagged (PATCHWORK).
pub fn is_input_record(at: &str) -> bool {
    at.contains("/whole_run_catchers/")
}

/// Every `git_commit` string below `v` (at `at`), with where it is: its JSON pointer and,
/// when its object names them, the bug or bugs it is about.
fn nested_commits(v: &Value, at: &str, out: &mut Vec<(String, String)>) {
    match v {
        Value::Object(m) => {
            if let Some(c) = m.get("git_commit").and_then(Value::as_str) {
                let about = match (m.get("bug"), m.get("bugs")) {
                    (Some(b), _) => format!(" ({})", text(b)),
                    (None, Some(Value::Array(bs))) => {
                        let names: Vec<String> = bs.iter().map(text).collect();
                        format!(" ({})", names.join(", "))
                    }
                    _ => String::new(),
                };
                out.push((c.to_string(), format!("{at}/git_commit{about}")));
            }
            for (k, x) in m {
                nested_commits(x, &format!("{at}/{k}"), out);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                nested_commits(x, &format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

/// Why a part's file could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotRead {
    /// There is no file.
    Missing(String),
    /// It could not be read or is not JSON.
    Invalid(String),
}

impl std::fmt::Display for NotRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotRead::Missing(why) | NotRead::Invalid(why) => f.write_str(why),
        }
    }
}

/// A part's file as read: its JSON, or why it could not be read.
pub type Loaded = Result<Value, NotRead>;

/// Reads every part's file below `evidence`.
pub fn load(evidence: &Path) -> Vec<Loaded> {
    PARTS
        .iter()
        .map(|p| {
            let path = evidence.join(p.file);
            let text = std::fs::read_to_string(&path).map_err(|e| {
                let why = format!("{}: {e}", path.display());
                if e.kind() == std::io::ErrorKind::NotFound {
                    NotRead::Missing(why)
                } else {
                    NotRead::Invalid(why)
                }
            })?;
            serde_json::from_str(&text)
                .map_err(|e| NotRead::Invalid(format!("{}: not JSON: {e}", path.display())))
        })
        .collect()
}

/// Whether a part counts as not given: an optional part with no file, or no part at all.
fn not_given(p: &PartName, l: Option<&Loaded>) -> bool {
    match l {
        None => true,
        Some(Err(NotRead::Missing(_))) => p.optional,
        Some(_) => false,
    }
}

/// A part's state in one line, as `report` prints it: `current`, its flags, `not given`
/// (an optional part with no file) or `unreadable: why`.
pub fn status(p: &PartName, l: Option<&Loaded>, prov: &Provenance) -> String {
    if not_given(p, l) {
        return "not given".into();
    }
    match l {
        Some(Err(e)) => format!("unreadable: {e}"),
        _ => {
            let flags = prov.flags();
            match (&prov.covered_by, flags.is_empty()) {
                (Some(by), true) => format!("current ({by})"),
                (None, true) => "current".into(),
                _ => flags.join("; "),
            }
        }
    }
}

/// The site: (file name, HTML) for the index and each part's page, from each part's file
/// (in [`PARTS`] order) and its provenance.
pub fn render(parts: &[Loaded], prov: &[Provenance]) -> Vec<(String, String)> {
    let none = Provenance::default();
    let mut out = vec![("index.html".to_string(), index(parts, prov))];
    for (i, p) in PARTS.iter().enumerate() {
        let body = match parts.get(i) {
            _ if not_given(p, parts.get(i)) => format!(
                "<p class=\"NOT_RUN\">Not given: there is no <code>evidence/{}</code> yet.</p>",
                esc(p.file)
            ),
            Some(Ok(v)) => match p.kind {
                Kind::Checks => pages::checks(v),
                Kind::Nemesis => pages::nemesis(v),
                Kind::Controls => pages::controls(v),
                Kind::Bench => bench::page(v),
                Kind::Durability => durability::page(v),
                Kind::Mutants => mutants::page(v),
                Kind::Proof => proof::page(v),
            },
            Some(Err(why)) => format!(
                "<p class=\"FAIL\">Not readable: {}</p>",
                esc(&why.to_string())
            ),
            None => unreachable!("not_given covers a missing part"),
        };
        let head = if not_given(p, parts.get(i)) {
            String::new()
        } else {
            provenance_line(parts.get(i), prov.get(i).unwrap_or(&none))
        };
        out.push((p.page.to_string(), page(p.title, &format!("{head}{body}"))));
    }
    out
}

/// Writes the site into `dir` (made if missing).
pub fn write(dir: &Path, site: &[(String, String)]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (name, html) in site {
        harness::util::write_atomic(&dir.join(name), html.as_bytes())?;
    }
    Ok(())
}

const STYLE: &str = "body{font:14px/1.45 sans-serif;margin:0;color:#222}\
main{max-width:1100px;margin:0 auto;padding:8px 20px 40px}\
nav{background:#223;padding:8px 20px}nav a{color:#fff;margin-right:18px;text-decoration:none}\
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 7px;text-align:left;vertical-align:top}\
th{background:#f3f3f3}.PASS,.MET,.CAUGHT{color:#070;font-weight:bold}\
.FAIL,.ERROR,.MISSED,.FLAKY{color:#b00;font-weight:bold}.NOT_RUN,.stale{color:#a60;font-weight:bold}\
code,pre{background:#f5f5f5}pre{padding:6px;overflow:auto;max-height:420px}\
details summary{cursor:pointer}.plots{display:flex;flex-wrap:wrap;gap:18px}\
.plot-box{border:1px solid #ddd;padding:6px}.small{color:#666;font-size:12px}";

/// A whole page: the navigation, the title, the body.
pub fn page(title: &str, body: &str) -> String {
    let mut nav = String::from("<a href=\"index.html\">Index</a>");
    for p in PARTS {
        let _ = write!(nav, "<a href=\"{}\">{}</a>", p.page, esc(p.title));
    }
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>imfault evidence: {t}</title><style>{STYLE}</style></head><body>\
         <nav>{nav}</nav><main><h1>{t}</h1>{body}</main></body></html>\n",
        t = esc(title)
    )
}

/// A verdict word with its class (`PASS`, `FAIL`, …).
pub fn verdict(v: &str) -> String {
    format!("<span class=\"{c}\">{t}</span>", c = esc(v), t = esc(v))
}

/// A JSON scalar as text (`-` when missing).
pub fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn provenance_line(part: Option<&Loaded>, p: &Provenance) -> String {
    let generated = part
        .and_then(|l| l.as_ref().ok())
        .map(generated_at)
        .unwrap_or_else(|| "-".into());
    let whose = if p.recorded {
        "the commit it records"
    } else {
        "no commit recorded: the commit that last wrote the file"
    };
    let flags = p.flags();
    let mut s = format!(
        "<p class=\"small\">Produced {} at commit <code>{}</code> ({whose}). {}</p>",
        esc(&generated),
        esc(&short_commit(p.commit.as_deref())),
        if let (true, Some(by)) = (flags.is_empty(), &p.covered_by) {
            format!(
                "Current: code it depends on changed since, and {}.",
                esc(by)
            )
        } else if flags.is_empty() {
            "Current: no code it depends on changed since.".to_string()
        } else {
            flag_spans(&flags)
        }
    );
    if !p.patchwork.is_empty() {
        // Grouped by commit, in the order they first appear.
        let mut by_commit: Vec<(&str, Vec<&str>)> = Vec::new();
        for (c, at) in &p.patchwork {
            match by_commit.iter_mut().find(|(x, _)| *x == c.as_str()) {
                Some((_, ats)) => ats.push(at.as_str()),
                None => by_commit.push((c.as_str(), vec![at.as_str()])),
            }
        }
        let _ = write!(
            s,
            "<details class=\"small\"><summary>{}{} other commits than <code>{}</code> \
             recorded in the file</summary><ul>",
            if flags.iter().any(|f| f.starts_with("PATCHWORK")) {
                "PATCHWORK: "
            } else {
                ""
            },
            by_commit.len(),
            esc(&short_commit(p.commit.as_deref()))
        );
        for (c, ats) in by_commit {
            let _ = write!(
                s,
                "<li><code>{}</code> at <code>{}</code></li>",
                esc(&short_commit(Some(c))),
                esc(&ats.join("; "))
            );
        }
        s.push_str("</ul></details>");
    }
    s
}

/// Provenance flags, each marked (`class="stale"`) and escaped.
fn flag_spans(flags: &[String]) -> String {
    let spans: Vec<String> = flags
        .iter()
        .map(|f| format!("<span class=\"stale\">{}</span>", esc(f)))
        .collect();
    spans.join("; ")
}

/// A commit's first 10 hex digits (`-` for none).
fn short_commit(c: Option<&str>) -> String {
    c.map_or("-".into(), |c| c.chars().take(10).collect())
}

/// When a part's file says it was produced.
fn generated_at(v: &Value) -> String {
    [
        "/generated_at",
        "/environment/generated_at",
        "/environment/finished_at",
    ]
    .iter()
    .find_map(|p| v.pointer(p).and_then(Value::as_str))
    .unwrap_or("-")
    .to_string()
}

/// A part's verdict and one line saying why.
fn part_verdict(kind: Kind, v: &Value) -> (String, String) {
    let n = |p: &str| v.pointer(p).and_then(Value::as_u64).unwrap_or(0);
    match kind {
        Kind::Checks => {
            let (pass, fail, not_run) = (
                n("/summary/pass"),
                n("/summary/fail"),
                n("/summary/not_run"),
            );
            let word = if fail > 0 {
                "FAIL"
            } else if not_run > 0 {
                "NOT_RUN"
            } else {
                "PASS"
            };
            (
                word.into(),
                format!("{pass} PASS, {fail} FAIL, {not_run} NOT_RUN"),
            )
        }
        Kind::Nemesis => (
            text(&v["verdict"]),
            format!(
                "{} seeds: {} PASS, {} FAIL, {} ERROR (generator {})",
                n("/runs"),
                n("/pass"),
                n("/fail"),
                n("/error"),
                text(&v["generator"])
            ),
        ),
        Kind::Controls => {
            let (bugs, caught) = (n("/summary/bugs"), n("/summary/caught"));
            let clean_ok = v["clean"]["failed"].as_array().is_some_and(Vec::is_empty)
                && n("/clean/anomalies") == 0;
            let word = if caught == bugs && bugs > 0 && clean_ok {
                "PASS"
            } else {
                "FAIL"
            };
            (
                word.into(),
                format!(
                    "{caught} of {bugs} deliberate bugs caught in every run; clean gateway: {} passed, {} anomalies",
                    n("/clean/passed"),
                    n("/clean/anomalies")
                ),
            )
        }
        Kind::Bench => (
            text(&v["data_integrity"]),
            format!(
                "data integrity {}, targets {} ({} missed)",
                text(&v["data_integrity"]),
                text(&v["targets_met"]),
                v["targets_missed"].as_array().map_or(0, Vec::len)
            ),
        ),
        Kind::Durability => durability::verdict(v),
        Kind::Mutants => mutants::verdict(v),
        Kind::Proof => proof::verdict(v),
    }
}

fn index(parts: &[Loaded], prov: &[Provenance]) -> String {
    let none = Provenance::default();
    let mut s = String::from(
        "<p>What the project proves, from the committed files under <code>evidence/</code>. \
         A part is <span class=\"stale\">STALE</span> when code it depends on changed after \
         the commit it ran at, <span class=\"stale\">UNKNOWN COMMIT</span> when git does not \
         have that commit in HEAD's history, <span class=\"stale\">DIRTY</span> when it ran \
         on uncommitted changes, and <span class=\"stale\">PATCHWORK</span> when its entries \
         come from several commits.</p><table><tr><th>part</th><th>verdict</th><th>what</th>\
         <th>produced</th><th>commit</th><th>provenance</th></tr>",
    );
    for (i, p) in PARTS.iter().enumerate() {
        let pr = prov.get(i).unwrap_or(&none);
        let given = !not_given(p, parts.get(i));
        let (word, why, when) = match parts.get(i) {
            _ if !given => ("NOT_RUN".to_string(), "not given".into(), "-".into()),
            Some(Ok(v)) => {
                let (w, why) = part_verdict(p.kind, v);
                (w, why, generated_at(v))
            }
            Some(Err(e)) => ("ERROR".to_string(), e.to_string(), "-".into()),
            None => unreachable!("not_given covers a missing part"),
        };
        let flags = pr.flags();
        let state = if !given {
            "-".to_string()
        } else if flags.is_empty() {
            match &pr.covered_by {
                Some(by) => format!("current ({})", esc(by)),
                None => "current".into(),
            }
        } else {
            flag_spans(&flags)
        };
        let _ = write!(
            s,
            "<tr><td><a href=\"{}\">{}</a></td><td>{}</td><td>{}</td><td>{}</td><td><code>{}</code></td><td>{state}</td></tr>",
            p.page,
            esc(p.title),
            verdict(&word),
            esc(&why),
            esc(&when),
            esc(&short_commit(pr.commit.as_deref())),
        );
    }
    s.push_str("</table><h2>Answers</h2><ul>");
    if let Some(Ok(c)) = parts.get(2) {
        let only: Vec<String> = c
            .pointer("/summary/nemesis/caught_only_by_nemesis")
            .and_then(Value::as_array)
            .map(|a| a.iter().map(text).collect())
            .unwrap_or_default();
        let _ = write!(
            s,
            "<li>Deliberate bugs only the nemesis caught: {} (<a href=\"controls.html\">controls</a>).</li>",
            if only.is_empty() { "none".to_string() } else { esc(&only.join(", ")) }
        );
    }
    if let Some(Ok(b)) = parts.get(3) {
        let _ = write!(
            s,
            "<li>{} (<a href=\"bench.html\">bench</a>).</li>",
            esc(&bench::push_p99_crossing(b))
        );
    }
    s.push_str("</ul>");
    page("imfault evidence", &s)
}

#[cfg(test)]
mod tests;
