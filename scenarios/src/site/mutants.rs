//! Mutation testing's page (`evidence/mutants/result.json`, `make mutants`): what ran
//! (files, shard, in-diff), the totals and the verdict, each file's counts, the timing,
//! every missed and timed-out mutant with its diff, and the equivalent list.
//!
//! Must not: judge the mutants again (the verdict and kill rate are `mutants report`'s);
//! it only says how much of the list a partial run (a shard, an in-diff run) covered.

use super::svg::esc;
use super::{text, verdict as word};
use serde_json::Value;
use std::fmt::Write as _;

/// The columns of `totals` and of each `per_file` entry, in the README's order.
const COUNTS: [&str; 8] = [
    "mutants",
    "caught",
    "missed",
    "timeout",
    "unviable",
    "equivalent",
    "not_run",
    "kill_rate",
];

/// The file's verdict, with the counts and how much of the list ran.
pub fn verdict(v: &Value) -> (String, String) {
    let n = |k: &str| text(&v["totals"][k]);
    (
        text(&v["verdict"]),
        format!(
            "{} caught, {} missed, {} timeout of {} mutants (kill rate {}; {} unviable, {} \
             equivalent, {} not run){}",
            n("caught"),
            n("missed"),
            n("timeout"),
            n("mutants"),
            n("kill_rate"),
            n("unviable"),
            n("equivalent"),
            n("not_run"),
            scope(v)
        ),
    )
}

/// What part of the list ran: a shard, the mutants in a diff, or all.
fn scope(v: &Value) -> String {
    let mut s = String::new();
    if let Some(k) = v["shard"].as_str() {
        let _ = write!(s, "; shard {k} only");
    }
    if let Some(r) = v["in_diff"].as_str() {
        let _ = write!(s, "; only the lines changed since {r}");
    }
    s
}

/// The page.
pub fn page(v: &Value) -> String {
    let files: Vec<String> = v["files"]
        .as_array()
        .map(|a| a.iter().map(text).collect())
        .unwrap_or_default();
    let reasons: Vec<String> = v["reasons"]
        .as_array()
        .map(|a| a.iter().map(text).collect())
        .unwrap_or_default();
    let mut s = format!(
        "<p>cargo-mutants changes the examined code one mutant at a time; nextest's \
         <code>{}</code> profile judges each (<code>{}</code>). A missed mutant is a change no \
         test noticed. Verdict {}{}: PASS needs no missed mutant outside \
         <code>mutants/equivalent.txt</code> and a kill rate of at least {}.</p>\
         <p>Scope: {}{}. Started {}.</p>",
        esc(&text(&v["nextest_profile"])),
        esc(&text(&v["tool"])),
        word(&text(&v["verdict"])),
        if reasons.is_empty() {
            String::new()
        } else {
            format!(" ({})", esc(&reasons.join("; ")))
        },
        esc(&text(&v["kill_rate_min"])),
        esc(&files.join(", ")),
        esc(&scope(v)),
        esc(&text(&v["started_at"])),
    );
    s.push_str("<h2>Totals and each file</h2><table><tr><th>file</th>");
    for c in COUNTS {
        let _ = write!(s, "<th>{c}</th>");
    }
    s.push_str("</tr>");
    s.push_str(&counts_row("<b>all</b>", &v["totals"]));
    for (f, m) in v["per_file"].as_object().into_iter().flatten() {
        s.push_str(&counts_row(&format!("<code>{}</code>", esc(f)), m));
    }
    s.push_str("</table>");
    let t = |k: &str| esc(&text(&v["timing"][k]));
    let _ = write!(
        s,
        "<h2>Timing</h2><p>{} s for {} mutants ({} s each); median build {} s, median test {} s; \
         the unmutated profile took {} s.</p>",
        t("wall_s"),
        t("mutants_run"),
        t("per_mutant_wall_s"),
        t("build_s_median"),
        t("test_s_median"),
        t("baseline_test_s"),
    );
    s.push_str(&mutant_list("Missed", &v["missed"]));
    s.push_str(&mutant_list("Timed out (counted as caught)", &v["timeout"]));
    s.push_str(&mutant_list("Equivalent (not run)", &v["equivalent"]));
    if v["stale_equivalent"]
        .as_array()
        .is_some_and(|a| !a.is_empty())
    {
        s.push_str(&mutant_list(
            "Equivalent-list entries that match no mutant any more",
            &v["stale_equivalent"],
        ));
    }
    s
}

/// One row of counts.
fn counts_row(name: &str, m: &Value) -> String {
    let mut s = format!("<tr><td>{name}</td>");
    for c in COUNTS {
        let cell = text(&m[c]);
        let class = if c == "missed" && m[c].as_u64().is_some_and(|n| n > 0) {
            " class=\"MISSED\""
        } else {
            ""
        };
        let _ = write!(
            s,
            "<td{class} style=\"text-align:right\">{}</td>",
            esc(&cell)
        );
    }
    s.push_str("</tr>");
    s
}

/// A list of mutants, each with why it is equivalent (when the list says) and its diff.
fn mutant_list(title: &str, list: &Value) -> String {
    let items: Vec<&Value> = list.as_array().into_iter().flatten().collect();
    let mut s = format!("<h2>{} ({})</h2>", esc(title), items.len());
    if items.is_empty() {
        s.push_str("<p>None.</p>");
        return s;
    }
    s.push_str("<ul>");
    for m in items {
        let name = match m {
            Value::String(n) => n.clone(),
            _ => text(&m["name"]),
        };
        let because = m["because"].as_str().map_or(String::new(), |b| {
            format!("<br><span class=\"small\">{}</span>", esc(b))
        });
        let diff = m["diff"].as_str().map_or(String::new(), |d| {
            format!(
                "<details><summary>diff</summary><pre>{}</pre></details>",
                esc(d)
            )
        });
        let _ = write!(s, "<li><code>{}</code>{because}{diff}</li>", esc(&name));
    }
    s.push_str("</ul>");
    s
}
