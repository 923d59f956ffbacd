//! The evidence as a static site (issue 22, `make report`): one self-contained page per
//! part (the im-06 checks, the nemesis, the controls, the bench) and an index of their
//! verdicts, when and at which commit each was produced, and which are older than the
//! code. No script, no font, no request: inline CSS and SVG only.
//!
//! Owns: reading the committed evidence files (their on-disk schema) and rendering them.
//! Must not: run anything, or ask git (the caller passes each part's [`Provenance`]), so
//! that rendering is a pure function of its inputs.

mod bench;
mod pages;
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
}

/// A part's format (evidence/README.md), which says how it is judged and drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Checks,
    Nemesis,
    Controls,
    Bench,
}

/// The parts, in the index's order.
pub const PARTS: [PartName; 5] = [
    PartName {
        title: "im-06 checks",
        page: "checks.html",
        file: "im-06/result.json",
        kind: Kind::Checks,
    },
    PartName {
        title: "Nemesis",
        page: "nemesis.html",
        file: "nemesis/result.json",
        kind: Kind::Nemesis,
    },
    PartName {
        title: "Controls",
        page: "controls.html",
        file: "controls/result.json",
        kind: Kind::Controls,
    },
    PartName {
        title: "Bench",
        page: "bench.html",
        file: "bench/result.json",
        kind: Kind::Bench,
    },
    PartName {
        title: "Nemesis, 3 gateways",
        page: "nemesis-3-gateways.html",
        file: "nemesis/gateways-3.json",
        kind: Kind::Nemesis,
    },
];

/// Where a part's file came from: the commit that last wrote it, and the newest commit
/// that changed code after it (then the part is older than the code).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Provenance {
    pub commit: Option<String>,
    pub newer_code: Option<String>,
}

/// A part's file as read: its JSON, or why it could not be read (missing, not JSON).
pub type Loaded = Result<Value, String>;

/// Reads every part's file below `evidence`.
pub fn load(evidence: &Path) -> Vec<Loaded> {
    PARTS
        .iter()
        .map(|p| {
            let path = evidence.join(p.file);
            let text =
                std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", path.display()))
        })
        .collect()
}

/// The site: (file name, HTML) for the index and each part's page, from each part's file
/// (in [`PARTS`] order) and its provenance.
pub fn render(parts: &[Loaded], prov: &[Provenance]) -> Vec<(String, String)> {
    let none = Provenance::default();
    let mut out = vec![("index.html".to_string(), index(parts, prov))];
    for (i, p) in PARTS.iter().enumerate() {
        let body = match parts.get(i) {
            Some(Ok(v)) => match p.kind {
                Kind::Checks => pages::checks(v),
                Kind::Nemesis => pages::nemesis(v),
                Kind::Controls => pages::controls(v),
                Kind::Bench => bench::page(v),
            },
            Some(Err(why)) => format!("<p class=\"FAIL\">Not readable: {}</p>", esc(why)),
            None => "<p>Not given.</p>".into(),
        };
        let head = provenance_line(parts.get(i), prov.get(i).unwrap_or(&none));
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
    let commit = short_commit(p.commit.as_deref());
    let stale = match &p.newer_code {
        Some(c) => format!(
            " <span class=\"stale\">STALE</span>: code changed after it (commit {})",
            esc(&short_commit(Some(c)))
        ),
        None => String::new(),
    };
    format!(
        "<p class=\"small\">Produced {} (commit <code>{}</code>){stale}.</p>",
        esc(&generated),
        esc(&commit)
    )
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
    }
}

fn index(parts: &[Loaded], prov: &[Provenance]) -> String {
    let none = Provenance::default();
    let mut s = String::from(
        "<p>What the project proves, from the committed files under <code>evidence/</code>. \
         A part is <span class=\"stale\">STALE</span> when code changed after the commit that \
         wrote it.</p><table><tr><th>part</th><th>verdict</th><th>what</th><th>produced</th>\
         <th>commit</th><th>older than the code</th></tr>",
    );
    for (i, p) in PARTS.iter().enumerate() {
        let pr = prov.get(i).unwrap_or(&none);
        let (word, why, when) = match parts.get(i) {
            Some(Ok(v)) => {
                let (w, why) = part_verdict(p.kind, v);
                (w, why, generated_at(v))
            }
            Some(Err(e)) => ("ERROR".to_string(), e.clone(), "-".into()),
            None => ("NOT_RUN".to_string(), "no file".into(), "-".into()),
        };
        let stale = pr.newer_code.as_deref().map_or("no".into(), |c| {
            format!(
                "<span class=\"stale\">STALE</span> (code at {})",
                esc(&short_commit(Some(c)))
            )
        });
        let _ = write!(
            s,
            "<tr><td><a href=\"{}\">{}</a></td><td>{}</td><td>{}</td><td>{}</td><td><code>{}</code></td><td>{stale}</td></tr>",
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
