//! The durability matrix's page (`evidence/durability/result.json`, `make durability`):
//! one row per `synchronous_commit` setting, one column per topology and fault, each cell
//! its acknowledged messages lost of those acknowledged and its verdict.
//!
//! Must not: judge a cell again; the verdicts are the file's (the promise each setting
//! makes is `durability.rs`'s to know). Rows and columns come in the file's order.

use super::svg::esc;
use super::{text, verdict as word};
use serde_json::Value;
use std::fmt::Write as _;

/// The part's verdict: FAIL when a cell failed, ERROR when one could not be carried out,
/// NOT_RUN when the matrix is incomplete, else PASS; with the cells' counts.
pub fn verdict(v: &Value) -> (String, String) {
    let n = |p: &str| v.pointer(p).and_then(Value::as_u64).unwrap_or(0);
    let (cells, pass, fail, error) = (
        n("/summary/cells"),
        n("/summary/pass"),
        n("/summary/fail"),
        n("/summary/error"),
    );
    let complete = v.pointer("/environment/complete").and_then(Value::as_bool) == Some(true);
    let w = if fail > 0 {
        "FAIL"
    } else if error > 0 {
        "ERROR"
    } else if !complete || cells == 0 {
        "NOT_RUN"
    } else {
        "PASS"
    };
    let lost = cells_of(v)
        .iter()
        .filter(|c| lost_of(c).is_some_and(|(l, _)| l > 0))
        .count();
    (
        w.into(),
        format!(
            "{cells} cells: {pass} PASS, {fail} FAIL, {error} ERROR; acknowledged messages lost \
             in {lost}{}",
            if complete { "" } else { " (matrix incomplete)" }
        ),
    )
}

fn cells_of(v: &Value) -> Vec<&Value> {
    v["cells"].as_array().into_iter().flatten().collect()
}

/// (acknowledged lost or moved to another seq, acknowledged) of an applicable cell.
fn lost_of(c: &Value) -> Option<(u64, u64)> {
    let m = c.get("summary")?;
    let lost = m["acknowledged_lost"].as_u64()? + m["acknowledged_other_seq"].as_u64().unwrap_or(0);
    Some((lost, m["acknowledged"].as_u64()?))
}

/// The distinct values of `key` over the cells, in the order they first appear.
fn axis<'a>(cells: &[&'a Value], key: &[&str]) -> Vec<Vec<&'a str>> {
    let mut out: Vec<Vec<&str>> = Vec::new();
    for c in cells {
        let k: Vec<&str> = key.iter().map(|k| c[*k].as_str().unwrap_or("-")).collect();
        if !out.contains(&k) {
            out.push(k);
        }
    }
    out
}

/// One cell of the table: n/a with why, or lost of acknowledged, what the receivers held,
/// whether the setting promises no loss, and the verdict.
fn cell(c: Option<&&Value>) -> String {
    let Some(c) = c else {
        return "<td class=\"small\">not run</td>".into();
    };
    if c["applicable"] == false {
        return format!("<td class=\"small\">n/a: {}</td>", esc(&text(&c["why"])));
    }
    let m = &c["summary"];
    let mut s = match lost_of(c) {
        Some((lost, acked)) => format!("<b>{lost}</b> of {acked} lost"),
        None => "-".into(),
    };
    let held = m["receivers_holding_what_the_database_lost"]
        .as_u64()
        .unwrap_or(0);
    if held > 0 {
        let _ = write!(s, "<br>{held} held wrong");
        if let Some(after) = m["receivers_holding_what_the_database_lost_with_epoch"].as_u64() {
            let _ = write!(s, " ({after} after the epoch)");
        }
    }
    let promise = match c["promises_no_loss"].as_bool() {
        Some(true) => "promises no loss",
        Some(false) => "may lose",
        None => "promise -",
    };
    let errors = m["errors"].as_u64().unwrap_or(0);
    let _ = write!(
        s,
        "<br><span class=\"small\">{promise}{}</span> {}",
        if errors > 0 {
            format!(", {errors} run errors")
        } else {
            String::new()
        },
        word(&text(&c["verdict"]))
    );
    format!("<td>{s}</td>")
}

/// The page: what ran, the matrix, then every applicable cell's summary.
pub fn page(v: &Value) -> String {
    let n = |p: &str| text(v.pointer(p).unwrap_or(&Value::Null));
    let mut s = format!(
        "<p>Each cell: the gateway's sessions under one <code>synchronous_commit</code>, one \
         topology, one fault, {} runs under load ({} sends acknowledged before the fault per \
         run): acknowledged messages lost (no row, or a row at another seq) of those \
         acknowledged, and events the receivers held that the database lost. A loss the \
         setting allows is the measurement (PASS); a loss it promises against is FAIL. \
         {} cells: {} PASS, {} FAIL, {} ERROR; complete: {}; {} s.</p><p class=\"small\">{}</p>",
        n("/environment/runs_per_cell"),
        n("/environment/acknowledged_before_fault"),
        n("/summary/cells"),
        n("/summary/pass"),
        n("/summary/fail"),
        n("/summary/error"),
        n("/environment/complete"),
        n("/environment/wall_s"),
        esc(&n("/durability_deliberately_weakened")),
    );
    let cells = cells_of(v);
    let cols = axis(&cells, &["topology", "fault"]);
    let rows = axis(&cells, &["synchronous_commit"]);
    s.push_str("<table><tr><th><code>synchronous_commit</code></th>");
    for c in &cols {
        let _ = write!(s, "<th>{}<br>{}</th>", esc(c[0]), esc(c[1]));
    }
    s.push_str("</tr>");
    for r in &rows {
        let _ = write!(s, "<tr><th><code>{}</code></th>", esc(r[0]));
        for c in &cols {
            let found = cells.iter().find(|x| {
                x["synchronous_commit"] == r[0] && x["topology"] == c[0] && x["fault"] == c[1]
            });
            s.push_str(&cell(found));
        }
        s.push_str("</tr>");
    }
    s.push_str("</table>");
    s.push_str(&cell_summaries(&cells));
    s
}

/// Every applicable cell's summary, expandable to its runs.
fn cell_summaries(cells: &[&Value]) -> String {
    let mut s = String::from(
        "<h2>Each cell</h2><table class=\"small\"><tr><th>setting</th><th>topology</th>\
         <th>fault</th><th>verdict</th><th>runs (errors)</th><th>acknowledged lost / other seq / of</th>\
         <th>runs with loss</th><th>held wrong (after the epoch)</th><th>converged, ms max</th></tr>",
    );
    for c in cells.iter().filter(|c| c["applicable"] != false) {
        let m = &c["summary"];
        let runs = serde_json::to_string_pretty(&c["runs"]).unwrap_or_default();
        let _ = write!(
            s,
            "<tr><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td><td>{} ({})</td>\
             <td>{} / {} / {}</td><td>{}</td><td>{} ({})</td><td>{}<details><summary>runs</summary>\
             <pre>{}</pre></details></td></tr>",
            esc(&text(&c["synchronous_commit"])),
            esc(&text(&c["topology"])),
            esc(&text(&c["fault"])),
            word(&text(&c["verdict"])),
            text(&m["runs"]),
            text(&m["errors"]),
            text(&m["acknowledged_lost"]),
            text(&m["acknowledged_other_seq"]),
            text(&m["acknowledged"]),
            text(&m["runs_with_loss"]),
            text(&m["receivers_holding_what_the_database_lost"]),
            text(&m["receivers_holding_what_the_database_lost_with_epoch"]),
            esc(&text(&m["converged_ms_max"])),
            esc(&runs),
        );
    }
    s.push_str("</table>");
    s
}
