//! What one nemesis run observed, as its `result.json` holds it: the [`Outcome`] the
//! runner ([`super::runner`]) writes and the report, the shrinker and the command line read.
//!
//! Owns: the outcome's fields and the outcome of a run that could not be carried out.
//! Must not: run or judge anything (the runner and the checker do), or read a run's files.

use im_check::{Anomaly, OpCounts, Quantiles, Verdict};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::time::Duration;

/// What one run observed, as `result.json` holds it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Outcome {
    pub seed: u64,
    /// `PASS` (no anomaly), `FAIL` (the checker found anomalies) or `ERROR` (the run could
    /// not be carried out or judged: `error` says why).
    pub verdict: Verdict,
    pub error: Option<String>,
    /// The repeat command (printed by every run).
    pub repeat: String,
    /// Anomalies by kind (only kinds with at least one).
    pub anomalies: BTreeMap<String, u64>,
    /// The first anomalies, with their history lines.
    pub first_anomalies: Vec<Anomaly>,
    /// Acknowledged messages an asynchronous failover lost, as that configuration allows
    /// (issue 21: reported, not anomalies).
    #[serde(default)]
    pub expected_loss: u64,
    /// Client operations by how they ended.
    pub ops: BTreeMap<String, OpCounts>,
    /// Faults carried out, by kind.
    pub faults: BTreeMap<String, u64>,
    /// Each fault as carried out: id, kind, target, planned and actual times, outcome.
    pub fault_log: Vec<Value>,
    /// Store time minus send-ok time of events that reached a device by sync (repairs).
    pub repair_ms: Quantiles,
    /// The same for every event delivered to another device.
    pub delivery_ms: Quantiles,
    /// Gateway processes started (1 + restarts).
    pub gateway_starts: u64,
    pub history_entries: u64,
    pub wall_ms: u64,
}

impl Outcome {
    pub fn failed(&self) -> bool {
        !self.verdict.is_pass()
    }

    /// A run that could not be carried out or judged; `fault_log` holds the faults
    /// carried out until then (each with its error, if it had one).
    pub fn error(
        seed: u64,
        repeat: String,
        e: &anyhow::Error,
        wall: Duration,
        fault_log: Vec<Value>,
    ) -> Outcome {
        Outcome {
            seed,
            verdict: Verdict::Error,
            error: Some(format!("{e:#}")),
            repeat,
            anomalies: BTreeMap::new(),
            first_anomalies: Vec::new(),
            expected_loss: 0,
            ops: BTreeMap::new(),
            faults: BTreeMap::new(),
            fault_log,
            repair_ms: Quantiles::default(),
            delivery_ms: Quantiles::default(),
            gateway_starts: 0,
            history_entries: 0,
            wall_ms: wall.as_millis() as u64,
        }
    }
}
