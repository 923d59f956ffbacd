//! The pages of the im-06 checks, the nemesis series and the controls.

use super::svg::{esc, Plot, Series};
use super::{text, verdict};
use serde_json::Value;
use std::fmt::Write as _;

/// One row per check: its invariants, fault, expected against observed, the checker's
/// verdict and its own; each expandable to its whole record.
pub fn checks(v: &Value) -> String {
    let n = |p: &str| text(v.pointer(p).unwrap_or(&Value::Null));
    let mut s = format!(
        "<p>{} checks: {} PASS, {} FAIL, {} NOT_RUN. Each is a test against a real gateway \
         process and a real PostgreSQL cluster (design note 06, sections 8 and 9).</p>\
         <table><tr><th>check</th><th>invariants</th><th>fault</th><th>expected / observed</th>\
         <th>checker</th><th>result</th></tr>",
        n("/summary/total"),
        n("/summary/pass"),
        n("/summary/fail"),
        n("/summary/not_run")
    );
    for c in v["checks"].as_array().into_iter().flatten() {
        let mut rows = String::new();
        if let Some(exp) = c["expected"].as_object() {
            for (name, e) in exp {
                let _ = write!(
                    rows,
                    "<code>{}</code> {} {} / {}<br>",
                    esc(name),
                    esc(&text(&e["op"])),
                    esc(&e["value"].to_string()),
                    esc(&c["observed"].get(name).map_or("-".into(), Value::to_string))
                );
            }
        }
        let invariants: Vec<String> = c["invariants"]
            .as_array()
            .map(|a| a.iter().map(text).collect())
            .unwrap_or_default();
        let checker = c
            .pointer("/checker/anomalies_total")
            .and_then(Value::as_u64)
            .map_or("-".into(), |k| {
                if k == 0 {
                    verdict("PASS")
                } else {
                    format!("{} ({k} anomalies)", verdict("FAIL"))
                }
            });
        let record = serde_json::to_string_pretty(c).unwrap_or_default();
        let _ = write!(
            s,
            "<tr><td><details><summary><b>{id}</b></summary><p>{what}</p><pre>{rec}</pre></details></td>\
             <td>{inv}</td><td><code>{fault}</code></td><td class=\"small\">{rows}</td><td>{checker}</td><td>{res}{why}</td></tr>",
            id = esc(&text(&c["id"])),
            what = esc(&text(&c["what"])),
            rec = esc(&record),
            inv = esc(&invariants.join(", ")),
            fault = esc(&text(&c["fault"])),
            res = verdict(&text(&c["result"])),
            why = c["reason"]
                .as_str()
                .map_or(String::new(), |r| format!("<br>{}", esc(r))),
        );
    }
    s.push_str("</table>");
    s
}

/// The series: runs and verdicts, faults and anomalies by kind, the repair-time
/// distribution over runs, and every run that did not pass.
pub fn nemesis(v: &Value) -> String {
    let n = |p: &str| text(v.pointer(p).unwrap_or(&Value::Null));
    let mut s = format!(
        "<p>{} seeded runs (generator {}, {} at once): {} PASS, {} FAIL, {} ERROR; {} s, \
         {} seeds/hour. Options: <code>{}</code>.</p>",
        n("/runs"),
        n("/generator"),
        n("/jobs"),
        n("/pass"),
        n("/fail"),
        n("/error"),
        n("/wall_s"),
        n("/seeds_per_hour"),
        esc(&v["options"].to_string())
    );
    s.push_str(&counts_table(
        "Faults by kind",
        &v["faults_by_kind"],
        "#79c",
    ));
    let anomalies = &v["anomalies_by_kind"];
    if anomalies.as_object().is_some_and(|m| !m.is_empty()) {
        s.push_str(&counts_table("Anomalies by kind", anomalies, "#c55"));
    } else {
        s.push_str("<h2>Anomalies by kind</h2><p>None in any run.</p>");
    }
    // Repair time: the distribution over runs of each run's median and maximum.
    let runs: Vec<&Value> = v["per_run"].as_array().into_iter().flatten().collect();
    repair_time(&mut s, &runs, n);
    failed_runs(&mut s, &runs);
    s
}

/// The repair-time section: the distribution over runs of each run's median and
/// maximum, plotted, with the series' own figures under it.
fn repair_time(s: &mut String, runs: &[&Value], n: impl Fn(&str) -> String) {
    let cdf = |key: &str| {
        let mut xs: Vec<f64> = runs
            .iter()
            .filter_map(|r| r["repair_ms"][key].as_f64())
            .collect();
        xs.sort_by(f64::total_cmp);
        let len = xs.len().max(1) as f64;
        xs.iter()
            .enumerate()
            .map(|(i, x)| (x.max(1.0), (i + 1) as f64 / len))
            .collect::<Vec<_>>()
    };
    let plot = Plot {
        title: "Repair time over runs (share of runs at or below)".into(),
        x_label: "repair time, ms (log)".into(),
        y_label: "share of runs".into(),
        x_log: true,
        series: vec![
            Series {
                name: "each run's median".into(),
                colour: "#36c",
                points: cdf("p50"),
                dashed: false,
            },
            Series {
                name: "each run's maximum".into(),
                colour: "#c63",
                points: cdf("max"),
                dashed: true,
            },
        ],
        ..Plot::default()
    };
    let _ = write!(
        s,
        "<h2>Repair time</h2><div class=\"plot-box\">{}</div><p class=\"small\">Repair: an event that reached a device by sync; its time from the sender's <code>sent</code> to the device's store. Median of the runs' medians {} ms, maximum {} ms, over {} repairs.</p>",
        plot.svg(),
        n("/repair_ms/median_of_run_p50"),
        n("/repair_ms/max"),
        n("/repair_ms/repairs")
    );
}

/// The runs that did not pass: seed, verdict, anomalies, error, a link to the
/// timeline when the run kept its directory, and the command that repeats it.
fn failed_runs(s: &mut String, runs: &[&Value]) {
    let failed: Vec<&&Value> = runs.iter().filter(|r| r["verdict"] != "PASS").collect();
    let _ = write!(s, "<h2>Runs that did not pass ({})</h2>", failed.len());
    if failed.is_empty() {
        s.push_str("<p>None.</p>");
    } else {
        s.push_str("<table><tr><th>seed</th><th>verdict</th><th>anomalies</th><th>error</th><th>timeline</th><th>repeat</th></tr>");
        for r in failed {
            let timeline = r["dir"].as_str().map_or("-".into(), |_| {
                format!(
                    "<a href=\"runs/seed-{}/report.html\">timeline</a>",
                    text(&r["seed"])
                )
            });
            let _ = write!(
                s,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{timeline}</td><td><code>{}</code></td></tr>",
                esc(&text(&r["seed"])),
                verdict(&text(&r["verdict"])),
                esc(&r["anomalies"].to_string()),
                esc(&text(&r["error"])),
                esc(&text(&r["repeat"]))
            );
        }
        s.push_str("</table>");
    }
}

/// A table of counts by name, each with a bar.
fn counts_table(title: &str, m: &Value, colour: &str) -> String {
    let entries: Vec<(String, u64)> = m
        .as_object()
        .map(|o| {
            o.iter()
                .map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default();
    let max = entries.iter().map(|e| e.1).max().unwrap_or(1).max(1);
    let mut s = format!("<h2>{}</h2><table>", esc(title));
    for (k, n) in entries {
        let _ = write!(
            s,
            "<tr><td>{}</td><td style=\"text-align:right\">{n}</td><td style=\"width:320px\"><div style=\"background:{colour};height:10px;width:{:.0}%\"></div></td></tr>",
            esc(&k),
            n as f64 * 100.0 / max as f64
        );
    }
    s.push_str("</table>");
    s
}

/// The matrix: one column per bug, one row per test that caught any (most bugs first), a
/// mark where that test caught that bug, and a last row with the nemesis seed that did.
fn matrix(v: &Value) -> String {
    let controls: Vec<&Value> = v["controls"].as_array().into_iter().flatten().collect();
    let caught = |c: &Value| -> Vec<String> {
        c["caught_by"]
            .as_array()
            .map(|a| a.iter().map(|t| text(&t["test"])).collect())
            .unwrap_or_default()
    };
    let mut tests: Vec<(String, usize)> = Vec::new();
    for c in &controls {
        for t in caught(c) {
            match tests.iter_mut().find(|(n, _)| *n == t) {
                Some(e) => e.1 += 1,
                None => tests.push((t, 1)),
            }
        }
    }
    tests.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut s = String::from(
        "<h2>Which check caught which bug</h2><div style=\"overflow-x:auto\"><table class=\"small\"><tr><th>test \\ bug</th>",
    );
    for c in &controls {
        let _ = write!(
            s,
            "<th style=\"writing-mode:vertical-rl\">{}</th>",
            esc(&text(&c["bug"]))
        );
    }
    s.push_str("</tr>");
    for (t, n) in &tests {
        let _ = write!(
            s,
            "<tr><td>{} <span class=\"small\">({n})</span></td>",
            esc(t)
        );
        for c in &controls {
            let hit = caught(c).iter().any(|x| x == t);
            s.push_str(if hit {
                "<td class=\"CAUGHT\">●</td>"
            } else {
                "<td></td>"
            });
        }
        s.push_str("</tr>");
    }
    s.push_str("<tr><td><b>nemesis (seed)</b></td>");
    for c in &controls {
        let cell = match c["nemesis"]["first_catching_seed"].as_u64() {
            Some(seed) => format!("<td class=\"CAUGHT\">{seed}</td>"),
            None if c["nemesis"].is_null() => "<td>-</td>".into(),
            None => "<td class=\"MISSED\">✗</td>".into(),
        };
        s.push_str(&cell);
    }
    s.push_str("</tr></table></div>");
    s
}

/// The deliberate bugs: how often the suite caught each, by which tests, and whether the
/// nemesis caught it (at which seed).
pub fn controls(v: &Value) -> String {
    let n = |p: &str| text(v.pointer(p).unwrap_or(&Value::Null));
    let list = |p: &str| {
        let xs: Vec<String> = v
            .pointer(p)
            .and_then(Value::as_array)
            .map(|a| a.iter().map(text).collect())
            .unwrap_or_default();
        if xs.is_empty() {
            "none".to_string()
        } else {
            esc(&xs.join(", "))
        }
    };
    let mut s = format!(
        "<p>Each deliberate bug (<code>IM_BUG</code>) runs the whole suite, then the tests that \
         caught it {} times in all; CAUGHT means every run caught it. Then the nemesis runs \
         seeds under it until one fails. Clean gateway: {} passed, {} anomalies.</p>\
         <p>{} of {} bugs caught ({} flaky, {} missed). Only the nemesis caught: <b>{}</b>. \
         Only the scripted checks caught: {}. Missed by both: {}.</p>",
        n("/environment/runs_per_bug"),
        n("/clean/passed"),
        n("/clean/anomalies"),
        n("/summary/caught"),
        n("/summary/bugs"),
        n("/summary/flaky"),
        n("/summary/missed"),
        list("/summary/nemesis/caught_only_by_nemesis"),
        list("/summary/nemesis/caught_only_by_scripted_checks"),
        list("/summary/nemesis/missed_by_both"),
    );
    s.push_str(&matrix(v));
    s.push_str("<h2>Each bug</h2><table><tr><th>bug</th><th>side</th><th>suite</th><th>runs</th><th>anomaly kinds</th><th>catching tests</th><th>nemesis</th></tr>");
    for c in v["controls"].as_array().into_iter().flatten() {
        control_row(&mut s, c);
    }
    s.push_str("</table>");
    s
}

/// One bug's row: its side, the suite's result, how many runs caught it, the anomaly
/// kinds, the catching tests (folded) and what the nemesis did.
fn control_row(s: &mut String, c: &Value) {
    let tests: Vec<String> = c["caught_by"]
        .as_array()
        .map(|a| a.iter().map(|t| text(&t["test"])).collect())
        .unwrap_or_default();
    let kinds: Vec<String> = c["anomaly_kinds"]
        .as_array()
        .map(|a| a.iter().map(text).collect())
        .unwrap_or_default();
    let nem = &c["nemesis"];
    let nemesis = if nem.is_null() {
        "not run".to_string()
    } else {
        format!(
            "{} {}",
            verdict(&text(&nem["result"])),
            match nem["first_catching_seed"].as_u64() {
                Some(seed) => format!("at seed {seed}"),
                None => format!("after {} seeds", text(&nem["seeds_run"])),
            }
        )
    };
    let _ = write!(
        s,
        "<tr><td><b>{}</b></td><td>{}</td><td>{}</td><td>{}/{}</td><td>{}</td><td><details><summary>{} test(s)</summary>{}</details></td><td>{nemesis}</td></tr>",
        esc(&text(&c["bug"])),
        esc(&text(&c["side"])),
        verdict(&text(&c["result"])),
        text(&c["caught_runs"]),
        text(&c["runs"]),
        esc(&kinds.join(", ")),
        tests.len(),
        esc(&tests.join(", ")),
    );
}
