//! The bench page: each part's figures as plots with their ceilings and limits drawn on
//! them, and each target's MET/MISSED beside its plot.

use super::svg::{esc, short, Mark, Plot, Series};
use super::{text, verdict};
use serde_json::Value;
use std::fmt::Write as _;

const LIMIT: &str = "#b00";
const LOAD: &str = "#070";

fn f(v: &Value, p: &str) -> Option<f64> {
    v.pointer(p).and_then(Value::as_f64)
}

fn points(rows: &[Value], x: &str, y: &str) -> Vec<(f64, f64)> {
    rows.iter()
        .filter_map(|r| Some((f(r, x)?, f(r, y)?)))
        .collect()
}

fn rows<'a>(b: &'a Value, p: &str) -> &'a [Value] {
    b.pointer(p)
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

/// The fanout steps in order of offered load.
fn steps(b: &Value) -> Vec<Value> {
    let mut s = rows(b, "/fanout/data/steps").to_vec();
    s.sort_by(|a, c| {
        f(a, "/target_frames_per_s")
            .unwrap_or(0.0)
            .total_cmp(&f(c, "/target_frames_per_s").unwrap_or(0.0))
    });
    s
}

/// At what offered load push p99 passes 50 ms, in one sentence.
pub fn push_p99_crossing(b: &Value) -> String {
    let limit = f(b, "/fanout/data/p99_limit_ms").unwrap_or(50.0);
    let s = steps(b);
    let note = f(b, "/fanout/data/base_frames_per_s").map_or(String::new(), |l| {
        format!("; the note's load is {} frames/s", short(l))
    });
    let mut below: Option<f64> = None;
    for st in &s {
        let (Some(load), Some(p99)) =
            (f(st, "/target_frames_per_s"), f(st, "/push_latency/p99_ms"))
        else {
            continue;
        };
        if p99 > limit {
            return match below {
                Some(b) => format!(
                    "Push p99 passes {limit} ms between {} and {} frames/s offered ({p99:.1} ms at the latter{note})",
                    short(b),
                    short(load)
                ),
                None => format!(
                    "Push p99 is over {limit} ms already at the lowest load tried, {} frames/s ({p99:.1} ms{note})",
                    short(load)
                ),
            };
        }
        below = Some(load);
    }
    match below {
        Some(b) => format!(
            "Push p99 stays under {limit} ms at every load tried, up to {} frames/s offered{note}",
            short(b)
        ),
        None => "Push p99 against load was not measured".into(),
    }
}

/// The targets whose name starts with `prefix`, with MET/MISSED/NOT_RUN.
fn targets(b: &Value, prefix: &str) -> String {
    let mut s =
        String::from("<table><tr><th>target</th><th>value</th><th>limit</th><th></th></tr>");
    let mut any = false;
    for m in rows(b, "/metrics") {
        let name = text(&m["name"]);
        if !name.starts_with(prefix) || m["op"].is_null() {
            continue;
        }
        any = true;
        let word = match m["met"].as_bool() {
            Some(true) => "MET",
            Some(false) => "MISSED",
            None => "NOT_RUN",
        };
        let op = if m["op"] == "le" { "≤" } else { "≥" };
        let _ = write!(
            s,
            "<tr><td><code>{}</code></td><td>{} {}</td><td>{op} {}</td><td>{}</td></tr>",
            esc(&name),
            esc(&text(&m["value"])),
            esc(&text(&m["unit"])),
            esc(&text(&m["limit"])),
            verdict(word)
        );
    }
    s.push_str("</table>");
    if any {
        s
    } else {
        String::new()
    }
}

fn section(title: &str, status: &Value, plots: &[Plot], b: &Value, prefix: &str) -> String {
    let mut s = format!("<h2>{}</h2>", esc(title));
    if status["status"] != "ok" {
        let _ = write!(
            s,
            "<p>{}: {}</p>",
            verdict("NOT_RUN"),
            esc(&text(&status["reason"]))
        );
    }
    s.push_str("<div class=\"plots\">");
    for p in plots {
        let _ = write!(s, "<div class=\"plot-box\">{}</div>", p.svg());
    }
    let _ = write!(s, "<div>{}</div></div>", targets(b, prefix));
    s
}

/// One series per (name, colour, y pointer, dashed), all over `rows` against `x`.
fn lines(rows: &[Value], x: &str, spec: &[(&str, &'static str, &str, bool)]) -> Vec<Series> {
    spec.iter()
        .map(|(name, colour, y, dashed)| line(name, colour, points(rows, x, y), *dashed))
        .collect()
}

fn line(name: &str, colour: &'static str, points: Vec<(f64, f64)>, dashed: bool) -> Series {
    Series {
        name: name.into(),
        colour,
        points,
        dashed,
    }
}

fn mark(at: Option<f64>, label: String, colour: &'static str) -> Vec<Mark> {
    at.map(|at| Mark { at, label, colour })
        .into_iter()
        .collect()
}

/// The page.
pub fn page(b: &Value) -> String {
    let env = &b["environment"];
    let mut s = format!(
        "<p>Mode {}, PostgreSQL {} (fsync {}, synchronous_commit {}), {} cores, load {} → {}. \
         Data integrity {}, targets {}.</p><p>{}.</p>",
        esc(&text(&b["mode"])),
        esc(&text(&env["postgres_version"])),
        esc(&text(&env["fsync"])),
        esc(&text(&env["synchronous_commit"])),
        esc(&text(&env["host_cores"])),
        esc(&text(&env["load_avg_start"][0])),
        esc(&text(&env["load_avg_end"][0])),
        verdict(&text(&b["data_integrity"])),
        verdict(&text(&b["targets_met"])),
        esc(&push_p99_crossing(b)),
    );
    s.push_str(&section(
        "Send path",
        &b["send_path"],
        &[sends(b)],
        b,
        "send.",
    ));
    s.push_str(&section("Fan-out", &b["fanout"], &fanout(b), b, "push."));
    s.push_str(&section("Sweep", &b["sweep"], &[sweep(b)], b, "sweep."));
    s.push_str(&section("Repair", &b["repair"], &[repair(b)], b, "repair."));
    s.push_str(&section("Connections", &b["conns"], &[], b, "conns."));
    if let Some(missed) = b["targets_missed"].as_array().filter(|m| !m.is_empty()) {
        let items: Vec<String> = missed
            .iter()
            .map(|m| format!("<li>{}</li>", esc(&text(m))))
            .collect();
        let _ = write!(s, "<h2>Targets missed</h2><ul>{}</ul>", items.join(""));
    }
    s
}

/// Sends/s against senders, with both pgbench ceilings.
fn sends(b: &Value) -> Plot {
    let levels = rows(b, "/send_path/data/levels");
    Plot {
        title: "Sends/s against concurrent senders".into(),
        x_label: "senders (log)".into(),
        y_label: "sends/s".into(),
        x_log: true,
        series: lines(
            levels,
            "/concurrency",
            &[
                ("gateway", "#36c", "/gateway/ops_per_s", false),
                (
                    "pgbench: the send's SQL",
                    "#888",
                    "/pgbench_plain/ops_per_s",
                    true,
                ),
                (
                    "pgbench: with pg_notify",
                    "#c63",
                    "/pgbench_notify/ops_per_s",
                    true,
                ),
            ],
        ),
        ..Plot::default()
    }
}

/// Push p99 (with the limit) and delivered frames/s against offered load, the note's load
/// marked on both.
fn fanout(b: &Value) -> [Plot; 2] {
    let st = steps(b);
    let note = f(b, "/fanout/data/base_frames_per_s");
    let limit = f(b, "/fanout/data/p99_limit_ms").unwrap_or(50.0);
    let p99 = Plot {
        title: "Push p99 against offered load".into(),
        x_label: "offered frames/s".into(),
        y_label: "ms (log)".into(),
        y_log: true,
        series: lines(
            &st,
            "/target_frames_per_s",
            &[
                ("push p99", "#36c", "/push_latency/p99_ms", false),
                ("send p99", "#c63", "/send_latency/p99_ms", true),
            ],
        ),
        hmarks: mark(Some(limit), format!("{limit} ms"), LIMIT),
        vmarks: mark(note, "the note's load".into(), LOAD),
        ..Plot::default()
    };
    let offered: Vec<(f64, f64)> = st
        .iter()
        .filter_map(|r| f(r, "/target_frames_per_s").map(|x| (x, x)))
        .collect();
    let delivered = Plot {
        title: "Delivered frames/s against offered load".into(),
        x_label: "offered frames/s".into(),
        y_label: "delivered frames/s".into(),
        series: vec![
            line(
                "delivered",
                "#36c",
                points(&st, "/target_frames_per_s", "/frames_per_s"),
                false,
            ),
            line("offered", "#aaa", offered, true),
        ],
        vmarks: mark(note, "the note's load".into(), LOAD),
        ..Plot::default()
    };
    [p99, delivered]
}

/// Sweep database time per interval against devices, one line per share lagging, with the
/// target.
fn sweep(b: &Value) -> Plot {
    let sweep_rows = rows(b, "/sweep/data/rows");
    let mut lags: Vec<f64> = sweep_rows
        .iter()
        .filter_map(|r| f(r, "/lag_percent"))
        .collect();
    lags.sort_by(f64::total_cmp);
    lags.dedup();
    let colours = ["#36c", "#c63", "#393", "#939"];
    Plot {
        title: "Sweep database time per interval against devices".into(),
        x_label: "subscribed devices (log)".into(),
        y_label: "ms per interval".into(),
        x_log: true,
        series: lags
            .iter()
            .enumerate()
            .map(|(i, lag)| {
                let rs: Vec<Value> = sweep_rows
                    .iter()
                    .filter(|r| f(r, "/lag_percent") == Some(*lag))
                    .cloned()
                    .collect();
                line(
                    &format!("{lag}% lagging"),
                    colours[i % colours.len()],
                    points(&rs, "/devices", "/db_exec_ms"),
                    false,
                )
            })
            .collect(),
        hmarks: rows(b, "/metrics")
            .iter()
            .filter(|m| m["name"] == "sweep.interval_db_ms_at_largest")
            .filter_map(|m| f(m, "/limit"))
            .map(|l| Mark {
                at: l,
                label: format!("target {l} ms"),
                colour: LIMIT,
            })
            .collect(),
        ..Plot::default()
    }
}

/// Repair time of a lost push against the sweep interval, with D5's bound.
fn repair(b: &Value) -> Plot {
    let iv = rows(b, "/repair/data/intervals");
    Plot {
        title: "Repair time of a lost push against the sweep interval".into(),
        x_label: "IM_SWEEP_MS".into(),
        y_label: "ms".into(),
        series: lines(
            iv,
            "/sweep_ms",
            &[
                ("p50", "#36c", "/repair/p50_ms", false),
                ("p99", "#c63", "/repair/p99_ms", false),
                ("D5 bound", LIMIT, "/d5_bound_ms", true),
            ],
        ),
        ..Plot::default()
    }
}
