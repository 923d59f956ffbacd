//! `report.html` of one nemesis run (issue 10): a self-contained page (no script, no
//! network, inline SVG) with a timeline of operations per client, the fault periods as
//! shaded bands, send and push latency over time, and each anomaly linked to its history
//! lines. Written from `history.jsonl` and the run's [`Outcome`]; it judges nothing.

use super::faults::Package as _;
use super::outcome::Outcome;
use super::schedule::Schedule;
use im_check::history::{Action, Done, Entry, Invoke, Line, Nemesis, Phase, Recv, Type};
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
                let kind = fault.kind.clone();
                let label = format!("#{} {kind} {}", fault.id, fault.target);
                (kind, label)
            }
            _ => {
                let name = action.name();
                let label = format!("# {name} ");
                (name, label)
            }
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
    let h = im_check::history::read(&dir.join("history.jsonl")).unwrap_or_default();
    let html = render(&h, schedule, o);
    crate::util::write_atomic(&dir.join("report.html"), html.as_bytes())
}

/// The page, from the history, the schedule and the outcome.
pub fn render(h: &[Entry], schedule: &Schedule, o: &Outcome) -> String {
    let end = h.last().map_or(1.0, |e| e.t_ms.max(1.0));
    let scale = Scale { end };
    let bands = bands(h, end);
    let mut s = head(schedule, o);
    s.push_str(&timeline(h, &bands, scale));
    s.push_str(&legend(&bands));
    s.push_str(&latency(h, &bands, scale));
    s.push_str(&faults_table(schedule, o));
    let (anomalies, mut shown) = anomalies(o);
    s.push_str(&anomalies);
    // The history lines the anomalies name (with context), and every fault line.
    for e in h.iter().filter(|e| e.kind() == Type::Nemesis) {
        shown.insert(e.i);
    }
    s.push_str(&history_lines(h, &shown));
    s.push_str(
        "<p>The whole history is <code>history.jsonl</code> beside this page.</p></body></html>\n",
    );
    s
}

/// Time on the horizontal axis: the run's milliseconds onto the drawing's width.
#[derive(Clone, Copy)]
struct Scale {
    end: f64,
}

impl Scale {
    fn x(self, t: f64) -> f64 {
        LEFT + (t / self.end) * (WIDTH - LEFT - 10.0)
    }

    /// Tick labels every tenth of the run, at the bottom `y`.
    fn ticks(self, y: f64) -> String {
        let mut s = String::new();
        for t in 0..=10 {
            let tt = self.end * t as f64 / 10.0;
            let _ = write!(
                s,
                "<text x=\"{:.1}\" y=\"{y:.1}\" font-size=\"10\">{:.1}s</text>",
                self.x(tt) - 8.0,
                tt / 1000.0
            );
        }
        s
    }

    /// The fault bands over a drawing `height` high from `top`.
    fn bands(self, bands: &[Band], top: f64, height: f64, opacity: f64) -> String {
        let mut s = String::new();
        for b in bands {
            let _ = write!(
                s,
                "<rect x=\"{:.1}\" y=\"{top}\" width=\"{:.1}\" height=\"{height:.1}\" fill=\"{}\" fill-opacity=\"{opacity}\"><title>{} ({:.0}–{:.0} ms)</title></rect>",
                self.x(b.from),
                (self.x(b.to) - self.x(b.from)).max(1.5),
                colour(&b.kind),
                esc(&b.label),
                b.from,
                b.to
            );
        }
        s
    }
}

/// The document's head, the verdict, the repeat command and the run's figures.
fn head(schedule: &Schedule, o: &Outcome) -> String {
    let mut s = String::new();
    let v = esc(o.verdict.as_str());
    let _ = write!(
        s,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>nemesis seed {seed}: {v}</title>\
         <style>body{{font:13px sans-serif;margin:16px}}table{{border-collapse:collapse}}\
         td,th{{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}}\
         .FAIL,.ERROR{{color:#b00;font-weight:bold}}.PASS{{color:#070;font-weight:bold}}\
         .err{{color:#b00}}code{{background:#f4f4f4}}tr:target{{background:#ffd}}\
         .sw{{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;vertical-align:middle}}\
         </style></head><body>",
        seed = o.seed,
    );
    let _ = write!(
        s,
        "<h1>Nemesis seed {} <span class=\"{v}\">{v}</span></h1><p>Repeat: <code>{}</code></p>",
        o.seed,
        esc(&o.repeat),
    );
    if let Some(e) = &o.error {
        let _ = write!(s, "<p class=\"ERROR\">{}</p>", esc(e));
    }
    let _ = write!(
        s,
        "<p>{} history lines, {} faults, {} gateway starts, wall {} ms. Options: {}</p>",
        o.history_entries,
        schedule.faults.len(),
        o.gateway_starts,
        o.wall_ms,
        esc(&kv(
            &serde_json::to_value(&schedule.options).unwrap_or_default()
        ))
    );
    s
}

/// One lane per client (and the harness's), a dot per event, the fault periods as bands.
fn timeline(h: &[Entry], bands: &[Band], scale: Scale) -> String {
    let devices: BTreeSet<&str> = h
        .iter()
        .filter(|e| {
            matches!(
                e.kind(),
                Type::Invoke | Type::Ok | Type::Info | Type::Fail | Type::Recv | Type::Client
            )
        })
        .map(|e| e.process.as_str())
        .collect();
    let lane: HashMap<&str, usize> = devices
        .iter()
        .enumerate()
        .map(|(i, d)| (*d, i + 1))
        .collect();
    let lanes = devices.len() + 1;
    let height = 30.0 + lanes as f64 * LANE + 20.0;
    let mut s = String::new();
    let _ = write!(s, "<h2>Timeline</h2><svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\">");
    s.push_str(&scale.bands(bands, 20.0, lanes as f64 * LANE, 0.35));
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
    s.push_str(&scale.ticks(height - 4.0));
    for e in h {
        let Some((colour, r, what)) = dot(e) else {
            continue;
        };
        let row = if e.kind() == Type::Nemesis {
            Some(&0)
        } else {
            lane.get(e.process.as_str())
        };
        let Some(row) = row else { continue };
        let _ = write!(
            s,
            "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"{r}\" fill=\"{colour}\"><title>line {}: {what} {}</title></circle>",
            scale.x(e.t_ms),
            20.0 + LANE * (*row as f64 + 0.5),
            e.i,
            esc(&e.value_text().chars().take(200).collect::<String>())
        );
    }
    s.push_str("</svg>");
    s
}

/// What the timeline draws for a line: (colour, radius, name), or nothing.
fn dot(e: &Entry) -> Option<(&'static str, f64, &'static str)> {
    DOTS.iter()
        .find(|(t, op, ..)| *t == e.kind() && *op == e.op())
        .map(|(_, _, colour, r, what)| (*colour, *r, *what))
}

/// The timeline's dots: (line type, op, colour, radius, name), also its legend.
const DOTS: &[(Type, &str, &str, f64, &str)] = &[
    (Type::Ok, "send", "#2a2", 2.0, "sent"),
    (Type::Info, "send", "#e80", 3.0, "send without answer"),
    (Type::Fail, "send", "#888", 2.0, "send refused"),
    (Type::Recv, "push", "#36c", 1.5, "push"),
    (Type::Recv, "hint", "#a3c", 2.0, "hint"),
    (Type::Client, "crash", "#d00", 4.0, "client crash"),
    (Type::Client, "restart", "#000", 4.0, "client restart"),
    (Type::Client, "disconnect", "#c66", 2.5, "disconnect"),
    (Type::Nemesis, "gateway-start", "#000", 4.0, "gateway start"),
    (Type::Nemesis, "gateway-exit", "#d00", 4.0, "gateway exit"),
];

/// The colours of the fault kinds that occur, and of the dots.
fn legend(bands: &[Band]) -> String {
    let kinds: BTreeSet<&str> = bands.iter().map(|b| b.kind.as_str()).collect();
    let mut s = String::from("<p>Bands (fault periods):");
    for k in &kinds {
        let _ = write!(
            s,
            "<span class=\"sw\" style=\"background:{}\"></span>{}",
            colour(k),
            esc(k)
        );
    }
    if kinds.is_empty() {
        s.push_str(" none");
    }
    s.push_str(".<br>Dots:");
    for (_, _, colour, _, what) in DOTS {
        let _ = write!(
            s,
            "<span class=\"sw\" style=\"background:{colour};border-radius:6px\"></span>{what}"
        );
    }
    s.push_str(".</p>");
    s
}

/// Send latency (send frame to `sent`) and push latency (the sender's `sent` to the push at
/// another device) over time, on a log scale so that the body of the distribution shows
/// beside the outliers a fault makes.
fn latency(h: &[Entry], bands: &[Band], scale: Scale) -> String {
    let (send_lat, push_lat) = latencies(h);
    let lat_h = 220.0;
    let top = 10.0;
    let ymax = send_lat
        .iter()
        .chain(push_lat.iter())
        .map(|p| p.1)
        .fold(10.0f64, f64::max)
        .min(60_000.0);
    let decades = ymax.log10().ceil().max(1.0);
    // 1 ms at the bottom (anything faster drawn there), 10^decades at the top.
    let y = |v: f64| top + lat_h - (v.max(1.0).log10() / decades) * lat_h;
    let mut s = String::new();
    let _ = write!(s, "<h2>Latency over time</h2><svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{}\">", lat_h + 40.0);
    s.push_str(&scale.bands(bands, top, lat_h, 0.25));
    for d in 0..=decades as u32 {
        let v = 10f64.powi(d as i32);
        let _ = write!(
            s,
            "<line x1=\"{LEFT}\" x2=\"{:.1}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" stroke=\"#ddd\"/><text x=\"4\" y=\"{:.1}\">{v} ms</text>",
            WIDTH - 10.0,
            y(v) + 4.0,
            yy = y(v),
        );
    }
    for (points, colour, r) in [(&send_lat, "#2a2", 1.8), (&push_lat, "#36c", 1.4)] {
        for (t, v) in points {
            let _ = write!(
                s,
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"{r}\" fill=\"{colour}\"/>",
                scale.x(*t),
                y(*v)
            );
        }
    }
    s.push_str(&scale.ticks(lat_h + 36.0));
    let _ = write!(
        s,
        "</svg><p>Log scale. <span class=\"sw\" style=\"background:#2a2\"></span>send latency (send frame to <code>sent</code>), {} sends; p50 {}, p99 {}. <span class=\"sw\" style=\"background:#36c\"></span>push latency (the sender's <code>sent</code> to the push at another device), {} pushes; p50 {}, p99 {}.</p>",
        send_lat.len(),
        quantile_ms(&send_lat, 0.5),
        quantile_ms(&send_lat, 0.99),
        push_lat.len(),
        quantile_ms(&push_lat, 0.5),
        quantile_ms(&push_lat, 0.99),
    );
    s
}

/// (time, latency) of every answered send and of every push whose `sent` the history holds.
#[allow(clippy::type_complexity)]
fn latencies(h: &[Entry]) -> (Vec<(f64, f64)>, Vec<(f64, f64)>) {
    let mut send_lat = Vec::new();
    let mut push_lat = Vec::new();
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
    (send_lat, push_lat)
}

/// The `q`-quantile of the latencies, as text (`-` when there are none).
fn quantile_ms(points: &[(f64, f64)], q: f64) -> String {
    let mut v: Vec<f64> = points.iter().map(|p| p.1).collect();
    v.sort_by(f64::total_cmp);
    im_check::nearest_rank(&v, q).map_or("-".into(), |x| format!("{x:.0} ms"))
}

/// Each fault as planned and as carried out: kind, target, times, its parameters and what
/// its start and end did, as `name=value` text.
fn faults_table(schedule: &Schedule, o: &Outcome) -> String {
    let mut s = String::from("<h2>Faults</h2><table><tr><th>id</th><th>kind</th><th>target</th><th>parameters</th><th>planned (ms from the clock's start)</th><th>carried out (history ms)</th><th>start</th><th>end</th></tr>");
    let none = serde_json::Value::Null;
    for (f, l) in schedule
        .faults
        .iter()
        .zip(o.fault_log.iter().chain(std::iter::repeat(&none)))
    {
        let mut params = serde_json::to_value(&f.kind).unwrap_or_default();
        if let Some(m) = params.as_object_mut() {
            m.remove("kind");
        }
        let ms = |k: &str| {
            l.get(k)
                .and_then(|v| v.as_f64())
                .map_or("-".into(), |v| format!("{v:.0}"))
        };
        let outcome = |k: &str| {
            let v = l.get(k).unwrap_or(&none);
            let class = if v.get("error").is_some() {
                " class=\"err\""
            } else {
                ""
            };
            format!("<td{class}>{}</td>", esc(&kv(v)))
        };
        let _ = write!(
            s,
            "<tr><td>{}</td><td><span class=\"sw\" style=\"background:{}\"></span>{}</td><td>{}</td><td>{}</td><td>{}–{} ms</td><td>{}–{} ms</td>{}{}</tr>",
            f.id,
            colour(f.kind.name()),
            esc(f.kind.name()),
            esc(&f.target),
            esc(&kv(&params)),
            f.at_ms,
            f.end_ms,
            ms("started_ms"),
            ms("ended_ms"),
            outcome("start"),
            outcome("end"),
        );
    }
    s.push_str("</table>");
    s
}

/// A JSON value as `name=value` text: objects flattened (`condition.mode=latency`), strings
/// unquoted, arrays in brackets, nothing as `-`.
fn kv(v: &serde_json::Value) -> String {
    fn walk(prefix: &str, v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, x) in m {
                    let name = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&name, x, out);
                }
            }
            serde_json::Value::String(x) if prefix.is_empty() => out.push(x.clone()),
            serde_json::Value::String(x) => out.push(format!("{prefix}={x}")),
            x if prefix.is_empty() => out.push(x.to_string()),
            x => out.push(format!("{prefix}={x}")),
        }
    }
    let mut out = Vec::new();
    walk("", v, &mut out);
    if out.is_empty() || v.is_null() {
        "-".into()
    } else {
        out.join(", ")
    }
}

/// The first anomalies, each with where it is (from its witness), its sentence, its
/// witness's data and links to its history lines; and the lines to show around them.
fn anomalies(o: &Outcome) -> (String, BTreeSet<u64>) {
    let mut s = String::new();
    let _ = write!(
        s,
        "<h2>Anomalies ({})</h2>",
        o.anomalies.values().sum::<u64>()
    );
    let mut shown: BTreeSet<u64> = BTreeSet::new();
    if o.first_anomalies.is_empty() {
        s.push_str("<p>None.</p>");
        return (s, shown);
    }
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
            "<li><b>{}</b> ({}) <i>{}</i>: {} — lines {}<br><small>witness: {}</small></li>",
            esc(a.kind.as_str()),
            esc(&a.invariant),
            esc(&at),
            esc(&a.msg),
            links.join(", "),
            esc(&kv(&serde_json::to_value(&a.witness).unwrap_or_default()))
        );
        for i in &a.entries {
            for j in i.saturating_sub(CONTEXT_LINES)..=i + CONTEXT_LINES {
                shown.insert(j);
            }
        }
    }
    s.push_str("</ol>");
    (s, shown)
}

/// The history lines in `shown` (at most [`HISTORY_ROWS_MAX`]), each an anchor.
fn history_lines(h: &[Entry], shown: &BTreeSet<u64>) -> String {
    let by_i: BTreeMap<u64, &Entry> = h.iter().map(|e| (e.i, e)).collect();
    let mut s = String::new();
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
            esc(&e.op()),
            esc(&e.value_text())
        );
    }
    s.push_str("</table>");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::History;
    use crate::nemesis::schedule::{generate, Options};
    use im_check::Verdict;

    /// Issue 22 (the nemesis page made readable): a legend names each fault kind that
    /// occurs; faults are a table whose parameters and results are `name=value` text, not
    /// JSON; latency is drawn on a log scale with its quantiles.
    #[test]
    fn the_page_has_a_legend_a_fault_table_and_a_log_latency_scale() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("history.jsonl");
        let schedule = generate(3, &Options::default()).unwrap();
        let f = schedule
            .faults
            .iter()
            .find(|f| f.kind.name() == "net-db" || f.kind.name() == "gw-fault")
            .or(schedule.faults.first())
            .unwrap()
            .clone();
        {
            let h = History::create(&path).unwrap();
            let id = h.nemesis_start(Action::Fault {
                fault: f.to_line(),
                healed: false,
            });
            h.nemesis_end(
                id,
                Action::Fault {
                    fault: f.to_line(),
                    healed: false,
                },
            );
        }
        let h = im_check::history::read(&path).unwrap();
        let mut o = Outcome::error(
            schedule.seed,
            "nemesis --seed 3".into(),
            &anyhow::anyhow!("x"),
            std::time::Duration::from_millis(5),
            vec![serde_json::json!({"started_ms": 10.0, "ended_ms": 20.0,
                "start": {"control": "ok"}, "end": {"error": "gone"}})],
        );
        o.verdict = Verdict::Pass;
        o.error = None;
        let page = render(&h, &schedule, &o);
        let legend = page.split("Bands (fault periods):").nth(1).unwrap();
        assert!(
            legend.split("</p>").next().unwrap().contains(f.kind.name()),
            "{legend}"
        );
        let table = page.split("<h2>Faults</h2>").nth(1).unwrap();
        let table = table.split("</table>").next().unwrap();
        assert!(!table.contains('{'), "JSON in the fault table: {table}");
        assert!(table.contains("control=ok"), "{table}");
        assert!(table.contains("class=\"err\">error=gone"), "{table}");
        assert!(page.contains("Log scale."), "no log scale");
        assert!(page.contains(">1 ms</text>") && page.contains(">10 ms</text>"));
    }

    #[test]
    fn kv_flattens_objects() {
        let v = serde_json::json!({"condition": {"mode": "latency", "ms": 20}, "skip": 3,
                                   "pids": [1, 2], "none": null});
        assert_eq!(
            kv(&v),
            "condition.mode=latency, condition.ms=20, none=null, pids=[1,2], skip=3"
        );
        assert_eq!(kv(&serde_json::Value::Null), "-");
        assert_eq!(kv(&serde_json::json!("x")), "x");
    }
}
