//! Small tools every part of the bench shares: one clock comparable with the database's
//! (`now_us`), a seeded PRNG (no `rand` dependency), latency summaries, the progress line
//! on stderr, and RFC 3339 time stamps. No I/O besides the progress line.

use im_check::nearest_rank;
use serde::{Deserialize, Serialize};
use std::io::{IsTerminal, Write};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Microseconds since the Unix epoch, monotonic within this process: the wall clock read
/// once, advanced by `Instant`. The gateway's `at` field (PostgreSQL's `clock_timestamp()`
/// in ms) is read from the same machine clock, so the two are comparable.
pub fn now_us() -> i64 {
    static BASE: OnceLock<(Instant, i64)> = OnceLock::new();
    let (i0, w0) = BASE.get_or_init(|| (Instant::now(), unix_us()));
    w0 + i0.elapsed().as_micros() as i64
}

/// The wall clock, microseconds since the Unix epoch.
pub fn unix_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

/// `2026-11-30T09:38:33Z` for a Unix time in seconds: the workspace's one helper.
pub use harness::util::rfc3339;

/// SplitMix64: a seeded, reproducible generator for picks and jitter.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A latency distribution in milliseconds (nearest-rank percentiles).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Latency {
    /// Samples summarised.
    pub count: u64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Rounds to 3 decimals (what the result file keeps).
pub fn r3(x: f64) -> f64 {
    if x.is_finite() {
        round3(x)
    } else {
        0.0
    }
}

/// Summarises samples given in microseconds (sorted in place). Negative samples are kept
/// as they are (a push can beat the sender's reply).
pub fn summarize_us(samples: &mut [i64]) -> Latency {
    if samples.is_empty() {
        return Latency::default();
    }
    samples.sort_unstable();
    let n = samples.len();
    let pick = |p: f64| nearest_rank(samples, p).unwrap_or(0) as f64 / 1000.0;
    let sum: f64 = samples.iter().map(|&v| v as f64).sum();
    Latency {
        count: n as u64,
        p50_ms: r3(pick(0.50)),
        p95_ms: r3(pick(0.95)),
        p99_ms: r3(pick(0.99)),
        max_ms: r3(samples[n - 1] as f64 / 1000.0),
        mean_ms: r3(sum / n as f64 / 1000.0),
    }
}

/// Ratio `a / b` rounded to 3 decimals; `None` when `b` is not positive.
pub fn ratio(a: f64, b: f64) -> Option<f64> {
    (b > 0.0 && a.is_finite()).then(|| r3(a / b))
}

/// The progress line on stderr: rewritten in place on a terminal, one line per call
/// otherwise (CI logs).
pub fn progress(msg: &str) {
    let mut err = std::io::stderr().lock();
    if std::io::stderr().is_terminal() {
        let _ = write!(err, "\r\x1b[2K{msg}");
    } else {
        let _ = writeln!(err, "{msg}");
    }
    let _ = err.flush();
}

/// Ends the in-place progress line (a newline on a terminal, nothing otherwise).
pub fn progress_done() {
    if std::io::stderr().is_terminal() {
        let mut err = std::io::stderr().lock();
        let _ = writeln!(err);
    }
}

/// Whether the in-place ticker should run (only on a terminal; CI logs stay short).
pub fn ticking() -> bool {
    std::io::stderr().is_terminal()
}

/// Seconds as a `Duration` (negative or NaN counts as zero).
pub fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(if s.is_finite() && s > 0.0 { s } else { 0.0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<i64> = (1..=100).map(|x| x * 1000).collect();
        let l = summarize_us(&mut v);
        assert_eq!(
            (l.count, l.p50_ms, l.p99_ms, l.max_ms),
            (100, 50.0, 99.0, 100.0)
        );
        assert_eq!(summarize_us(&mut []).count, 0);
    }

    #[test]
    fn rng_is_seeded() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        assert_eq!(a.next_u64(), b.next_u64());
        assert!(a.unit() < 1.0);
    }
}
