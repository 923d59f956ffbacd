//! The proof record's page (`evidence/proof/result.json`, `make proof`, issue 41): the
//! whole proof at one commit, each part's verdict, seconds, exit status and log, and why a
//! part did not run.
//!
//! Must not: judge the parts again; the verdicts are the ones `scripts/proof.sh` recorded.
//! A part links to the site's page for the evidence it writes (that page has its own
//! provenance, which may be another commit's than the proof's).

use super::svg::esc;
use super::{text, verdict as word, PARTS};
use serde_json::Value;
use std::fmt::Write as _;

/// The page on this site of the evidence a proof part writes, if it writes any.
fn page_of(part: &str) -> Option<&'static str> {
    let file = match part {
        "im-06" => "im-06/result.json",
        "controls" => "controls/result.json",
        "mutants" => "mutants/result.json",
        "nemesis-1" => "nemesis/result.json",
        "nemesis-3" => "nemesis/gateways-3.json",
        "durability" => "durability/result.json",
        "bench" => "bench/result.json",
        "site" => return Some("index.html"),
        _ => return None,
    };
    PARTS.iter().find(|p| p.file == file).map(|p| p.page)
}

fn parts(v: &Value) -> Vec<&Value> {
    v["parts"].as_array().into_iter().flatten().collect()
}

/// The file's verdict, with the parts by verdict and the total time.
pub fn verdict(v: &Value) -> (String, String) {
    let count = |w: &str| parts(v).iter().filter(|p| p["verdict"] == w).count();
    (
        text(&v["verdict"]),
        format!(
            "{} parts: {} PASS, {} FAIL, {} NOT_RUN; {} s",
            parts(v).len(),
            count("PASS"),
            count("FAIL"),
            count("NOT_RUN"),
            text(&v["total_s"])
        ),
    )
}

/// The page.
pub fn page(v: &Value) -> String {
    let mut s = format!(
        "<p><code>{}</code> ran these parts in order at one commit, on a committed tree, \
         {} cores: verdict {} in {} s. Parts asked for: <code>{}</code>. A failing part does \
         not stop the later ones.</p><table><tr><th>part</th><th>verdict</th><th>seconds</th>\
         <th>exit status</th><th>log or reason</th><th>evidence</th></tr>",
        esc(&text(&v["generated_by"])),
        esc(&text(&v["host_cores"])),
        word(&text(&v["verdict"])),
        esc(&text(&v["total_s"])),
        esc(&text(&v["parts_run"])),
    );
    for p in parts(v) {
        let name = text(&p["part"]);
        let why = match (p["log"].as_str(), p["reason"].as_str()) {
            (_, Some(r)) => esc(r),
            (Some(l), None) => format!("<code>{}</code>", esc(l)),
            (None, None) => "-".into(),
        };
        let link = page_of(&name).map_or("-".into(), |pg| format!("<a href=\"{pg}\">{pg}</a>"));
        let _ = write!(
            s,
            "<tr><td><b>{}</b></td><td>{}</td><td style=\"text-align:right\">{}</td><td>{}</td><td>{why}</td><td>{link}</td></tr>",
            esc(&name),
            word(&text(&p["verdict"])),
            esc(&text(&p["seconds"])),
            esc(&text(&p["exit_status"])),
        );
    }
    s.push_str("</table>");
    s
}
