//! The report of a judgement: anomalies, counts, statistics and the verdict.

use super::*;

// ---------------------------------------------------------------------------------------
// The report
// ---------------------------------------------------------------------------------------

/// One broken invariant, with the history lines that prove it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Anomaly {
    pub kind: Kind,
    /// The invariant broken ([`Kind::invariant`]).
    pub invariant: String,
    /// What happened, in one sentence generated from the witness.
    pub msg: String,
    /// What proves it, as data (conversation, seqs, devices, mids, lines, rows).
    pub witness: Witness,
    /// The history lines (`Entry::i`) that prove it, ascending; empty when only the final
    /// read proves it.
    pub entries: Vec<u64>,
}

impl Anomaly {
    pub(super) fn new(kind: Kind, witness: Witness, mut entries: Vec<u64>) -> Anomaly {
        entries.sort_unstable();
        entries.dedup();
        Anomaly {
            kind,
            invariant: kind.invariant().to_string(),
            msg: witness.explain(),
            witness,
            entries,
        }
    }
}

/// The checker's verdict: PASS iff there is no anomaly; ERROR when the run could not be
/// judged (its history does not parse, a line could not be written); never NOT_RUN.
pub use crate::verdict::Verdict;

/// The checker's judgement of one run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// [`REPORT_SCHEMA_VERSION`].
    pub schema_version: u32,
    pub verdict: Verdict,
    /// Ordered by kind ([`Kind::ALL`] order), then first entry (final-read-only last),
    /// then message.
    pub anomalies: Vec<Anomaly>,
    /// Every kind with its count, 0 included, so a reader sees what was checked.
    pub counts: BTreeMap<Kind, u64>,
    pub stats: Stats,
    /// Issue 21: acknowledged messages an asynchronous failover lost, as that configuration
    /// allows (each a `lost` witness whose `sent` named an older epoch than the newest its
    /// conversation had: committed on the old primary). Reported, not counted as
    /// anomalies; empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expected_loss: Vec<super::Witness>,
    /// Why the run could not be judged (verdict ERROR).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Report {
    /// One line: `PASS, 0 anomalies over N entries` or `FAIL: k anomalies: kind=n, ...`.
    /// The report of a run that could not be judged: verdict ERROR, nothing counted.
    pub fn error(why: String) -> Report {
        Report {
            schema_version: REPORT_SCHEMA_VERSION,
            verdict: Verdict::Error,
            anomalies: Vec::new(),
            counts: BTreeMap::new(),
            stats: Stats::default(),
            expected_loss: Vec::new(),
            error: Some(why),
        }
    }

    pub fn summary(&self) -> String {
        if let Some(why) = &self.error {
            return format!("ERROR: the run could not be judged: {why}");
        }
        if self.verdict == Verdict::Pass {
            let expected = match self.expected_loss.len() {
                0 => String::new(),
                n => format!(" ({n} acknowledged lost by an asynchronous failover, as allowed)"),
            };
            return format!(
                "PASS, 0 anomalies over {} entries{expected}",
                self.stats.entries
            );
        }
        let kinds: Vec<String> = self
            .counts
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(k, n)| format!("{k}={n}"))
            .collect();
        format!(
            "FAIL: {} anomalies: {}",
            self.anomalies.len(),
            kinds.join(", ")
        )
    }
}

/// Numbers about the run (not judgements).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// History lines.
    pub entries: u64,
    /// Client operation → how its lines ended.
    pub ops: BTreeMap<String, OpCounts>,
    /// `recv push` lines.
    pub pushes: u64,
    /// `recv hint` lines.
    pub hints: u64,
    /// `store` lines.
    pub stores: u64,
    pub info_sends: InfoSends,
    /// Ack invokes with `explicit: true` (skipped by `d3-ack-beyond-store`).
    pub explicit_acks: u64,
    /// Pushes (`recv malformed`) and replies (`info` with `why: malformed-reply`) the
    /// clients could not read.
    pub malformed: u64,
    pub probes: ProbeCounts,
    /// Per (device, conv, seq) with a send ok: first store line of that device holding the
    /// seq minus the (first) send ok line, `t_ms`. Negative when the recipient stored it
    /// before the sender read its reply.
    pub delivery_ms: Quantiles,
    /// The same, only where that first store line came from a sync (a repair).
    pub repair_ms: Quantiles,
    /// Gaps between consecutive sweep hints (see `d5-sweep-late`).
    pub sweep_hint_gaps_ms: GapQuantiles,
}

/// Lines of one client operation, by type.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpCounts {
    pub invoke: u64,
    pub ok: u64,
    pub fail: u64,
    pub info: u64,
}

/// Sends (device, cmid) that never got an ok, and at least once no definite answer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InfoSends {
    pub total: u64,
    /// A row with that (sender_device, cmid) is in the final read: the send happened.
    pub present: u64,
    /// No such row: the send did not happen (allowed: no reply promised anything).
    pub absent: u64,
}

/// D1 probes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeCounts {
    pub total: u64,
    /// Probes that read the expected mid.
    pub visible: u64,
    /// Probes that could not read (database down); ignored.
    pub errors: u64,
}

/// Nearest-rank quantiles in milliseconds; null when `n == 0`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Quantiles {
    pub n: u64,
    pub p50: Option<f64>,
    pub p95: Option<f64>,
    pub max: Option<f64>,
}

/// Nearest-rank median and maximum in milliseconds; null when `n == 0`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GapQuantiles {
    pub n: u64,
    pub p50: Option<f64>,
    pub max: Option<f64>,
}

pub(super) fn sorted(mut xs: Vec<f64>) -> Vec<f64> {
    xs.sort_by(f64::total_cmp);
    xs
}

pub(super) fn quantiles(xs: Vec<f64>) -> Quantiles {
    let xs = sorted(xs);
    Quantiles {
        n: xs.len() as u64,
        p50: nearest_rank(&xs, 0.50),
        p95: nearest_rank(&xs, 0.95),
        max: xs.last().copied(),
    }
}
