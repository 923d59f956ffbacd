//! `report.html` of one nemesis run (issue 10): a self-contained page (no script, no
//! network, inline SVG) with a timeline of operations per client, the fault periods as
//! shaded bands, send and push latency over time, and each anomaly linked to its history
//! lines. Written from `history.jsonl` and the run's [`Outcome`]; it judges nothing.

use super::faults::Package as _;
use super::outcome::Outcome;
use super::schedule::Schedule;
use crate::history::{Action, Done, Entry, Invoke, Line, Nemesis, Phase, Recv, Type};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::path::Path;

const WIDTH: f64 = 1100.0;
const LEFT: f64 = 110.0;
const LANE: f64 = 18.0;
/// History lines shown around each anomaly's lines.
const CONTEXT_LINES: u64 = 2;
/// Lines of history shown at most.
const HISTORY_ROWS_MAX: usize = 2000;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A colour per fault kind (stable: from the name).
fn colour(kind: &str) -> String {
    let h = kind
        .bytes()
        .fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32));
    format!("hsl({}, 70%, 60%)", h % 360)
}

/// A fault period read back from the history.
struct Band {
    kind: String,
    label: String,
    from: f64,
    to: f64,
}

fn bands(h: &[Entry], end: f64) -> Vec<Band> {
    let mut open: HashMap<u64, (String, String, f64)> = HashMap::new();
    let mut out = Vec::new();
    // Markers, not periods: drawn on the harness lane instead.
    for e in h {
        let Line::Nemesis(Nemesis { phase, action }) = &e.line else {
            continue;
        };
        if matches!(
            action,
            Action::GatewayStart { .. } | Action::GatewayExit { .. } | Action::NemesisStart { .. }
        ) {
            continue;
        }
        let (kind, label) = match action {
            Action::Fault { fault, .. } => {
                let kind = fault.kind.name().to_string();
                let label = format!("#{} {kind} {}", fault.id, fault.target);
                (kind, label)
            }
            _ => (action.name().to_string(), format!("# {} ", action.name())),
        };
        match (phase, e.op_id) {
            (Phase::Start, Some(id)) => {
                open.insert(id, (kind, label, e.t_ms));
            }
            (Phase::End, Some(id)) => {
                if let Some((kind, label, from)) = open.remove(&id) {
                    out.push(Band {
                        kind,
                        label,
                        from,
                        to: e.t_ms.max(from + 1.0),
                    });
                }
            }
            _ => out.push(Band {
                kind: kind.clone(),
                label: format!("{kind} (instant)"),
                from: e.t_ms,
                to: e.t_ms + 1.0,
            }),
        }
    }
    for (_, (kind, label, from)) in open {
        out.push(Band {
            kind,
            label,
            from,
            to: end,
        });
    }
    out.sort_by(|a, b| a.from.total_cmp(&b.from));
    out
}

/// Writes `dir/report.html` for the run.
pub fn write_html(dir: &Path, schedule: &Schedule, o: &Outcome) -> anyhow::Result<()> {
    let h = crate::history::read(&dir.join("history.jsonl")).unwrap_or_default();
    let html = render(&h, schedule, o);
    crate::util::write_atomic(&dir.join("report.html"), html.as_bytes())
}

/// The page, from the history, the schedule and the outcome.
pub fn render(h: &[Entry], schedule: &Schedule, o: &Outcome) -> String {
    let end = h.last().map_or(1.0, |e| e.t_ms.max(1.0));
    let x = |t: f64| LEFT + (t / end) * (WIDTH - LEFT - 10.0);
    let devices: Vec<String> = {
        let mut d: BTreeSet<String> = BTreeSet::new();
        for e in h {
            if matches!(
                e.kind(),
                Type::Invoke | Type::Ok | Type::Info | Type::Fail | Type::Recv | Type::Client
            ) {
                d.insert(e.process.clone());
            }
        }
        d.into_iter().collect()
    };
    let lane: HashMap<&str, usize> = devices
        .iter()
        .enumerate()
        .map(|(i, d)| (d.as_str(), i + 1))
        .collect();
    let lanes = devices.len() + 1;
    let height = 30.0 + lanes as f64 * LANE + 20.0;
    let bands = bands(h, end);
    let mut s = String::new();
    let _ = write!(
        s,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>nemesis seed {seed}: {v}</title>\
         <style>body{{font:13px sans-serif;margin:16px}}table{{border-collapse:collapse}}\
         td,th{{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}}\
         .FAIL,.ERROR{{color:#b00;font-weight:bold}}.PASS{{color:#070;font-weight:bold}}\
         code{{background:#f4f4f4}}tr:target{{background:#ffd}}</style></head><body>",
        seed = o.seed,
        v = esc(o.verdict.as_str())
    );
    let _ = write!(
        s,
        "<h1>Nemesis seed {} <span class=\"{v}\">{v}</span></h1><p>Repeat: <code>{}</code></p>",
        o.seed,
        esc(&o.repeat),
        v = esc(o.verdict.as_str())
    );
    if let Some(e) = &o.error {
        let _ = write!(s, "<p class=\"ERROR\">{}</p>", esc(e));
    }
    let _ = write!(
        s,
        "<p>{} history lines, {} faults, {} gateway starts, wall {} ms. Options: <code>{}</code></p>",
        o.history_entries,
        schedule.faults.len(),
        o.gateway_starts,
        o.wall_ms,
        esc(&serde_json::to_string(&schedule.options).unwrap_or_default())
    );
    // Timeline.
    let _ = write!(s, "<h2>Timeline</h2><svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\">");
    for b in &bands {
        let _ = write!(
            s,
            "<rect x=\"{:.1}\" y=\"20\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\" fill-opacity=\"0.35\"><title>{} ({:.0}–{:.0} ms)</title></rect>",
            x(b.from),
            (x(b.to) - x(b.from)).max(1.5),
            lanes as f64 * LANE,
            colour(&b.kind),
            esc(&b.label),
            b.from,
            b.to
        );
    }
    let _ = write!(
        s,
        "<text x=\"4\" y=\"{:.1}\">harness</text>",
        20.0 + LANE * 0.7
    );
    for (d, i) in &lane {
        let _ = write!(
            s,
            "<text x=\"4\" y=\"{:.1}\">{}</text>",
            20.0 + LANE * (*i as f64 + 0.7),
            esc(d)
        );
    }
    for t in 0..=10 {
        let tt = end * t as f64 / 10.0;
        let _ = write!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\">{:.1}s</text>",
            x(tt) - 8.0,
            height - 4.0,
            tt / 1000.0
        );
    }
    for e in h {
        let (row, colour, r, what) = match (e.kind(), e.op()) {
            (Type::Ok, "send") => (lane.get(e.process.as_str()), "#2a2", 2.0, "sent"),
            (Type::Info, "send") => (lane.get(e.process.as_str()), "#e80", 3.0, "send info"),
            (Type::Fail, "send") => (lane.get(e.process.as_str()), "#888", 2.0, "send fail"),
            (Type::Recv, "push") => (lane.get(e.process.as_str()), "#36c", 1.5, "push"),
            (Type::Recv, "hint") => (lane.get(e.process.as_str()), "#a3c", 2.0, "hint"),
            (Type::Client, "crash") => (lane.get(e.process.as_str()), "#d00", 4.0, "client crash"),
            (Type::Client, "restart") => {
                (lane.get(e.process.as_str()), "#000", 4.0, "client restart")
            }
            (Type::Client, "disconnect") => {
                (lane.get(e.process.as_str()), "#c66", 2.5, "disconnect")
            }
            (Type::Nemesis, "gateway-start") => (Some(&0), "#000", 4.0, "gateway start"),
            (Type::Nemesis, "gateway-exit") => (Some(&0), "#d00", 4.0, "gateway exit"),
            _ => (None, "", 0.0, ""),
        };
        let Some(row) = row else { continue };
        let _ = write!(
            s,
            "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"{r}\" fill=\"{colour}\"><title>line {}: {what} {}</title></circle>",
            x(e.t_ms),
            20.0 + LANE * (*row as f64 + 0.5),
            e.i,
            esc(&e.value_text().chars().take(200).collect::<String>())
        );
    }
    s.push_str("</svg><p>Bands: fault periods (hover for kind and target). Dots: green sent, orange send without answer, grey send refused, blue push, purple hint, red crash/exit, black (re)start.</p>");

    // Latency.
    let mut send_lat: Vec<(f64, f64)> = Vec::new();
    let mut push_lat: Vec<(f64, f64)> = Vec::new();
    let mut invoked: HashMap<(String, u64), f64> = HashMap::new();
    let mut sent_at: HashMap<(String, i64), f64> = HashMap::new();
    for e in h {
        match &e.line {
            Line::Invoke(Invoke::Send { .. }) => {
                if let Some(id) = e.op_id {
                    invoked.insert((e.process.clone(), id), e.t_ms);
                }
            }
            Line::Ok(Done::Send { conv, seq, .. }) => {
                if let Some(t0) = e.op_id.and_then(|id| invoked.get(&(e.process.clone(), id))) {
                    send_lat.push((e.t_ms, e.t_ms - t0));
                }
                sent_at.entry((conv.clone(), *seq)).or_insert(e.t_ms);
            }
            Line::Recv(Recv::Push(ev)) => {
                if let Some(t0) = sent_at.get(&(ev.conv.clone(), ev.seq)) {
                    push_lat.push((e.t_ms, (e.t_ms - t0).max(0.0)));
                }
            }
            _ => {}
        }
    }
    let lat_h = 220.0;
    let ymax = send_lat
        .iter()
        .chain(push_lat.iter())
        .map(|p| p.1)
        .fold(10.0f64, f64::max)
        .min(10_000.0);
    let y = |v: f64| 10.0 + lat_h - (v.min(ymax) / ymax) * lat_h;
    let _ = write!(s, "<h2>Latency over time</h2><svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{}\">", lat_h + 40.0);
    for b in &bands {
        let _ = write!(
            s,
            "<rect x=\"{:.1}\" y=\"10\" width=\"{:.1}\" height=\"{lat_h}\" fill=\"{}\" fill-opacity=\"0.25\"><title>{}</title></rect>",
            x(b.from),
            (x(b.to) - x(b.from)).max(1.5),
            colour(&b.kind),
            esc(&b.label)
        );
    }
    let _ = write!(
        s,
        "<text x=\"4\" y=\"16\">{ymax:.0} ms</text><text x=\"4\" y=\"{:.1}\">0</text>",
        lat_h + 10.0
    );
    for (t, v) in &send_lat {
        let _ = write!(
            s,
            "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"1.8\" fill=\"#2a2\"/>",
            x(*t),
            y(*v)
        );
    }
    for (t, v) in &push_lat {
        let _ = write!(
            s,
            "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"1.4\" fill=\"#36c\"/>",
            x(*t),
            y(*v)
        );
    }
    let _ = write!(
        s,
        "</svg><p>Green: send latency (send frame to <code>sent</code>), {} sends. Blue: push latency (the sender's <code>sent</code> to the push at another device), {} pushes. Values above {ymax:.0} ms are drawn at the top.</p>",
        send_lat.len(),
        push_lat.len()
    );

    // Faults as carried out.
    s.push_str("<h2>Faults</h2><table><tr><th>id</th><th>kind</th><th>target</th><th>planned</th><th>carried out</th><th>result</th></tr>");
    for (f, l) in schedule.faults.iter().zip(
        o.fault_log
            .iter()
            .chain(std::iter::repeat(&serde_json::Value::Null)),
    ) {
        let _ = write!(
            s,
            "<tr><td>{}</td><td style=\"background:{}\">{}</td><td>{}</td><td>{}–{} ms</td><td>{}–{} ms</td><td><code>{}</code></td></tr>",
            f.id,
            colour(f.kind.name()),
            esc(f.kind.name()),
            esc(&f.target),
            f.at_ms,
            f.end_ms,
            l.get("started_ms").and_then(|v| v.as_f64()).map_or("-".into(), |v| format!("{v:.0}")),
            l.get("ended_ms").and_then(|v| v.as_f64()).map_or("-".into(), |v| format!("{v:.0}")),
            esc(&serde_json::to_string(&serde_json::json!({"fault": f.kind, "start": l.get("start"), "end": l.get("end")})).unwrap_or_default())
        );
    }
    s.push_str("</table>");

    // Anomalies, linked to the history lines.
    let _ = write!(
        s,
        "<h2>Anomalies ({})</h2>",
        o.anomalies.values().sum::<u64>()
    );
    let mut shown: BTreeSet<u64> = BTreeSet::new();
    if o.first_anomalies.is_empty() {
        s.push_str("<p>None.</p>");
    } else {
        s.push_str("<ol>");
        for a in &o.first_anomalies {
            let links: Vec<String> = a
                .entries
                .iter()
                .map(|i| format!("<a href=\"#h{i}\">{i}</a>"))
                .collect();
            // Where, read from the witness (the data), then the sentence made from it.
            let at = [a.witness.device(), a.witness.conv()]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join(" in ");
            let _ = write!(
                s,
                "<li><b>{}</b> ({}) <i>{}</i>: {} — lines {}</li>",
                esc(a.kind.as_str()),
                esc(&a.invariant),
                esc(&at),
                esc(&a.msg),
                links.join(", ")
            );
            for i in &a.entries {
                for j in i.saturating_sub(CONTEXT_LINES)..=i + CONTEXT_LINES {
                    shown.insert(j);
                }
            }
        }
        s.push_str("</ol>");
    }
    // The history lines the anomalies name (with context), and every fault line.
    for e in h.iter().filter(|e| e.kind() == Type::Nemesis) {
        shown.insert(e.i);
    }
    let by_i: BTreeMap<u64, &Entry> = h.iter().map(|e| (e.i, e)).collect();
    let _ = write!(s, "<h2>History lines (the anomalies' lines with {CONTEXT_LINES} around them, and every nemesis line)</h2><table><tr><th>line</th><th>t ms</th><th>process</th><th>type</th><th>op</th><th>value</th></tr>");
    for i in shown.iter().take(HISTORY_ROWS_MAX) {
        let Some(e) = by_i.get(i) else { continue };
        let _ = write!(
            s,
            "<tr id=\"h{}\"><td>{}</td><td>{:.1}</td><td>{}#{}</td><td>{:?}</td><td>{}</td><td><code>{}</code></td></tr>",
            e.i,
            e.i,
            e.t_ms,
            esc(&e.process),
            e.instance,
            e.kind(),
            esc(e.op()),
            esc(&e.value_text())
        );
    }
    s.push_str("</table><p>The whole history is <code>history.jsonl</code> beside this page.</p></body></html>\n");
    s
}
