//! Plots as inline SVG, generated here (no plotting crate: the site needs lines, points,
//! reference lines and axes, about 200 lines; a crate would bring fonts and backends the
//! static pages do not use).
//!
//! Must not: read files or know what is plotted.

use std::fmt::Write as _;

const W: f64 = 640.0;
const H: f64 = 340.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 28.0;
const BOTTOM: f64 = 44.0;

/// One line of points.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub colour: &'static str,
    pub points: Vec<(f64, f64)>,
    pub dashed: bool,
}

/// A horizontal (a limit, a ceiling) or vertical (a load) reference line.
#[derive(Debug, Clone)]
pub struct Mark {
    pub at: f64,
    pub label: String,
    pub colour: &'static str,
}

/// A plot: series over two axes, linear or logarithmic, with reference lines.
#[derive(Debug, Clone, Default)]
pub struct Plot {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub x_log: bool,
    pub y_log: bool,
    pub series: Vec<Series>,
    pub hmarks: Vec<Mark>,
    pub vmarks: Vec<Mark>,
}

/// An axis: its range and whether it is logarithmic.
#[derive(Debug, Clone, Copy)]
struct Axis {
    lo: f64,
    hi: f64,
    log: bool,
}

impl Axis {
    fn of(values: impl Iterator<Item = f64>, log: bool) -> Axis {
        let vs: Vec<f64> = values
            .filter(|v| v.is_finite() && (!log || *v > 0.0))
            .collect();
        let (mut lo, mut hi) = vs
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
                (a.min(*v), b.max(*v))
            });
        if !lo.is_finite() {
            (lo, hi) = (if log { 1.0 } else { 0.0 }, 1.0);
        }
        if log {
            Axis {
                lo: 10f64.powf(lo.log10().floor()),
                hi: 10f64.powf(hi.log10().ceil().max(lo.log10().floor() + 1.0)),
                log,
            }
        } else {
            let lo = lo.min(0.0);
            let hi = if hi <= lo { lo + 1.0 } else { hi * 1.08 };
            Axis { lo, hi, log }
        }
    }

    /// 0..=1 along the axis.
    fn frac(self, v: f64) -> f64 {
        if self.log {
            (v.max(self.lo).log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10())
        } else {
            (v - self.lo) / (self.hi - self.lo)
        }
    }

    fn ticks(self) -> Vec<f64> {
        if self.log {
            let (a, b) = (
                self.lo.log10().round() as i32,
                self.hi.log10().round() as i32,
            );
            return (a..=b).map(|e| 10f64.powi(e)).collect();
        }
        let span = self.hi - self.lo;
        let raw = span / 5.0;
        let mag = 10f64.powf(raw.log10().floor());
        let step = [1.0, 2.0, 5.0, 10.0]
            .iter()
            .map(|m| m * mag)
            .find(|s| span / s <= 6.0)
            .unwrap_or(mag * 10.0);
        let mut t = (self.lo / step).ceil() * step;
        let mut out = Vec::new();
        while t <= self.hi + step * 1e-9 {
            out.push(t);
            t += step;
        }
        out
    }
}

/// A number as a tick label: short, no needless decimals.
pub fn short(v: f64) -> String {
    let a = v.abs();
    if a >= 1e6 {
        format!("{:.3}M", v / 1e6)
            .trim_end_matches('0')
            .trim_end_matches('.')
            .replace(".M", "M")
    } else if a >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if a >= 100.0 || v == v.round() {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

pub fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

impl Plot {
    /// The plot as an `<svg>` element.
    pub fn svg(&self) -> String {
        let xs = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0));
        let ys = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1));
        let x = Axis::of(xs.chain(self.vmarks.iter().map(|m| m.at)), self.x_log);
        let y = Axis::of(ys.chain(self.hmarks.iter().map(|m| m.at)), self.y_log);
        let fr = Frame { x, y };
        let mut s = String::new();
        let _ = write!(
            s,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"plot\" width=\"{W}\" height=\"{H}\" \
             font-family=\"sans-serif\" font-size=\"11\" role=\"img\" aria-label=\"{t}\">\
             <text x=\"{LEFT}\" y=\"16\" font-size=\"13\" font-weight=\"bold\">{t}</text>",
            t = esc(&self.title)
        );
        s.push_str(&self.grid(fr));
        s.push_str(&self.marks(fr));
        s.push_str(&self.lines(fr));
        s.push_str("</svg>");
        s
    }

    /// The ticks, the frame and the axis labels.
    fn grid(&self, fr: Frame) -> String {
        let mut s = String::new();
        for t in fr.y.ticks() {
            let _ = write!(
                s,
                "<line x1=\"{LEFT}\" x2=\"{:.1}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" stroke=\"#e4e4e4\"/>\
                 <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
                W - RIGHT,
                LEFT - 4.0,
                fr.py(t) + 4.0,
                short(t),
                yy = fr.py(t)
            );
        }
        for t in fr.x.ticks() {
            let _ = write!(
                s,
                "<line x1=\"{xx:.1}\" x2=\"{xx:.1}\" y1=\"{TOP}\" y2=\"{:.1}\" stroke=\"#f0f0f0\"/>\
                 <text x=\"{xx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                H - BOTTOM,
                H - BOTTOM + 14.0,
                short(t),
                xx = fr.px(t)
            );
        }
        let _ = write!(
            s,
            "<rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"none\" stroke=\"#999\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\
             <text x=\"12\" y=\"{:.1}\" transform=\"rotate(-90 12 {:.1})\" text-anchor=\"middle\">{}</text>",
            W - LEFT - RIGHT,
            H - TOP - BOTTOM,
            (LEFT + W - RIGHT) / 2.0,
            H - 8.0,
            esc(&self.x_label),
            (TOP + H - BOTTOM) / 2.0,
            (TOP + H - BOTTOM) / 2.0,
            esc(&self.y_label)
        );
        s
    }

    /// The reference lines with their labels.
    fn marks(&self, fr: Frame) -> String {
        let mut s = String::new();
        for m in &self.hmarks {
            let _ = write!(
                s,
                "<line x1=\"{LEFT}\" x2=\"{:.1}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" stroke=\"{c}\" stroke-dasharray=\"6 3\"/>\
                 <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" fill=\"{c}\">{}</text>",
                W - RIGHT,
                W - RIGHT - 4.0,
                fr.py(m.at) - 4.0,
                esc(&m.label),
                yy = fr.py(m.at),
                c = m.colour
            );
        }
        for m in &self.vmarks {
            let _ = write!(
                s,
                "<line x1=\"{xx:.1}\" x2=\"{xx:.1}\" y1=\"{TOP}\" y2=\"{:.1}\" stroke=\"{c}\" stroke-dasharray=\"2 3\"/>\
                 <text x=\"{:.1}\" y=\"{:.1}\" fill=\"{c}\">{}</text>",
                H - BOTTOM,
                fr.px(m.at) + 4.0,
                TOP + 12.0,
                esc(&m.label),
                xx = fr.px(m.at),
                c = m.colour
            );
        }
        s
    }

    /// Each series as a line with its points, and the legend.
    fn lines(&self, fr: Frame) -> String {
        let mut s = String::new();
        for (i, se) in self.series.iter().enumerate() {
            let pts: Vec<String> = se
                .points
                .iter()
                .filter(|p| p.0.is_finite() && p.1.is_finite())
                .map(|p| format!("{:.1},{:.1}", fr.px(p.0), fr.py(p.1)))
                .collect();
            let dash = if se.dashed {
                " stroke-dasharray=\"5 3\""
            } else {
                ""
            };
            let _ = write!(
                s,
                "<polyline points=\"{}\" fill=\"none\" stroke=\"{c}\" stroke-width=\"2\"{dash}/>",
                pts.join(" "),
                c = se.colour
            );
            for p in &pts {
                let (a, b) = p.split_once(',').unwrap_or(("0", "0"));
                let _ = write!(
                    s,
                    "<circle cx=\"{a}\" cy=\"{b}\" r=\"3\" fill=\"{}\"/>",
                    se.colour
                );
            }
            let ly = TOP + 14.0 + 14.0 * i as f64;
            let _ = write!(
                s,
                "<line x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{ly:.1}\" y2=\"{ly:.1}\" stroke=\"{c}\" stroke-width=\"2\"{dash}/>\
                 <text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
                LEFT + 8.0,
                LEFT + 28.0,
                LEFT + 32.0,
                ly + 4.0,
                esc(&se.name),
                c = se.colour
            );
        }
        s
    }
}

/// The two axes placed on the drawing.
#[derive(Clone, Copy)]
struct Frame {
    x: Axis,
    y: Axis,
}

impl Frame {
    fn px(self, v: f64) -> f64 {
        LEFT + self.x.frac(v) * (W - LEFT - RIGHT)
    }

    fn py(self, v: f64) -> f64 {
        H - BOTTOM - self.y.frac(v) * (H - TOP - BOTTOM)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plot_draws_its_series_marks_and_ticks() {
        let p = Plot {
            title: "push p99".into(),
            x_label: "offered frames/s".into(),
            y_label: "ms".into(),
            y_log: true,
            series: vec![Series {
                name: "push p99".into(),
                colour: "#36c",
                points: vec![(9000.0, 13.0), (18000.0, 40.0), (27000.0, 70.0)],
                dashed: false,
            }],
            hmarks: vec![Mark {
                at: 50.0,
                label: "50 ms".into(),
                colour: "#b00",
            }],
            vmarks: vec![Mark {
                at: 9067.0,
                label: "the note's load".into(),
                colour: "#070",
            }],
            ..Plot::default()
        };
        let svg = p.svg();
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"));
        assert_eq!(svg.matches("<circle").count(), 3);
        assert!(svg.contains(">50 ms</text>") && svg.contains(">the note's load</text>"));
        // Log ticks are decades: 10 and 100 ms.
        assert!(
            svg.contains(">10</text>") && svg.contains(">100</text>"),
            "{svg}"
        );
    }

    #[test]
    fn linear_ticks_are_round() {
        let a = Axis::of([0.0, 23_000.0].into_iter(), false);
        let t = a.ticks();
        assert!(t.len() >= 3 && t.len() <= 7, "{t:?}");
        assert!(t.iter().all(|v| v % 5000.0 == 0.0), "{t:?}");
        assert_eq!(short(18_000.0), "18k");
        assert_eq!(short(0.25), "0.25");
    }
}
