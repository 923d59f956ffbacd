//! The history of one scenario run as the judge reads it: `history.jsonl`, one typed line
//! per JSON object (format: evidence/README.md, "History", `schema_version`
//! [`SCHEMA_VERSION`]): every client operation (invoke, then ok / fail / info), every push
//! and hint a client received, every event a client persisted, every fault or action taken
//! against the system, and the D1 probes.
//!
//! Owns: the line types (`line.rs`), the entry that carries them ([`Entry`]), and the
//! reader ([`read`], [`parse`]). Must not: write a history (the harness's `History` does,
//! with its clocks and its database probes) or judge one (`crate::check` does). Knows
//! nothing of the system that produced the history: whatever the judge must know about a
//! line is in the line.

use std::path::Path;

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;

mod line;
pub use line::*;

/// Version of the history line format; the reader reads this one and, upgraded as
/// `upgrade_v2` says, version 2. 2: typed lines (every value a fixed shape, unknown
/// fields refused), `phase` beside `op` on nemesis lines, `raw` requests, `gw-fault` for
/// faults a scripted check arms. 3: a fault line is plain data that says itself whether it
/// leaves the sweep alone (`leaves_the_sweep_alone` on `fault` and `gw-fault` values), so
/// the judge needs no knowledge of the fault kinds.
pub const SCHEMA_VERSION: u32 = 3;

/// The oldest version [`parse`] reads.
pub const SCHEMA_VERSION_OLDEST: u32 = 2;

/// One line of `history.jsonl`: where and when, then what ([`Line`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// Position in the file, from 0.
    pub i: u64,
    /// Monotonic milliseconds since the history was opened.
    pub t_ms: f64,
    /// Real-time clock, microseconds since the Unix epoch.
    pub wall_us: i64,
    /// The device id for client lines, `harness` for nemesis and meta lines, `probe` for
    /// probes.
    pub process: String,
    /// Client instance: 1 for the first client of a device, +1 each time it is loaded
    /// again from its state file. 0 for non-client lines.
    pub instance: u64,
    /// Pairs an invoke with its completion, and a nemesis start with its end. Required
    /// (null when there is none): a line without it does not parse.
    #[serde(deserialize_with = "Option::deserialize")]
    pub op_id: Option<u64>,
    #[serde(flatten)]
    pub line: Line,
}

impl Entry {
    /// The line's `type`.
    pub fn kind(&self) -> Type {
        self.line.kind()
    }

    /// The line's `op`, as written.
    pub fn op(&self) -> std::borrow::Cow<'static, str> {
        self.line.op()
    }

    /// The line's `value`, as written (for display).
    pub fn value_text(&self) -> String {
        serde_json::to_value(&self.line)
            .ok()
            .and_then(|v| v.get("value").cloned())
            .unwrap_or_default()
            .to_string()
    }
}

/// Reads a `history.jsonl`: every line must parse as a typed [`Entry`], and the first
/// must be the `open` line of a version this reader reads ([`SCHEMA_VERSION`], or an older
/// one it upgrades). Any other line is an error naming the line and what is wrong with it,
/// never a line skipped: a checker that skipped what it cannot read would judge a history
/// it has not seen.
pub fn read(path: &Path) -> anyhow::Result<Vec<Entry>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    parse(&text).with_context(|| format!("history {}", path.display()))
}

/// [`read`] of a history's text.
pub fn parse(text: &str) -> anyhow::Result<Vec<Entry>> {
    let mut out = Vec::new();
    let mut version = SCHEMA_VERSION;
    for (n, line) in text.lines().enumerate() {
        if n == 0 {
            version = open_version(line)?;
        }
        let e: Entry = if version == 2 {
            serde_json::from_str::<Value>(line)
                .map(upgrade_v2)
                .and_then(serde_json::from_value)
        } else {
            serde_json::from_str(line)
        }
        .with_context(|| format!("line {} is not a history entry: {line:.300}", n + 1))?;
        anyhow::ensure!(
            e.i == n as u64,
            "line {} is numbered i={} (lines are numbered from 0 in order)",
            n + 1,
            e.i
        );
        if n == 0 {
            anyhow::ensure!(
                matches!(e.line, Line::Meta(Meta::Open { .. })),
                "line 1 is not the `open` line"
            );
        }
        out.push(e);
    }
    anyhow::ensure!(!out.is_empty(), "the history is empty (no `open` line)");
    Ok(out)
}

/// The `schema_version` of the `open` line, if this reader reads it.
fn open_version(line: &str) -> anyhow::Result<u32> {
    let v: Value =
        serde_json::from_str(line).with_context(|| format!("line 1 is not JSON: {line:.200}"))?;
    let version = v
        .get("value")
        .and_then(|v| v.get("schema_version"))
        .and_then(Value::as_u64);
    match version.and_then(|v| u32::try_from(v).ok()) {
        Some(v) if (SCHEMA_VERSION_OLDEST..=SCHEMA_VERSION).contains(&v) => Ok(v),
        _ => anyhow::bail!(
            "line 1: history schema_version {version:?}, this checker reads \
             {SCHEMA_VERSION_OLDEST} to {SCHEMA_VERSION}"
        ),
    }
}

/// A line of a version-2 history as version 3 writes it: its `fault` and `gw-fault` values
/// gain `leaves_the_sweep_alone`, as the harness of version 2 decided it when it judged
/// (frozen here: it describes what a version-2 history meant, and is not the rule of any
/// later harness). A `client-crash` leaves the sweep alone; so does a frame fault (a
/// `gw-fault`) that drops or refuses frames (`drop`, `error`) at any point but
/// `gw.reply.ack`; every other fault may delay it. Any other line is left as it is.
fn upgrade_v2(mut line: Value) -> Value {
    let kind = line.get("type").and_then(|t| Type::deserialize(t).ok());
    if kind != Some(Type::Nemesis) {
        return line;
    }
    let op = line
        .get("op")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let frame_fault = |v: &Value| {
        let action = v.get("action").and_then(Value::as_str);
        let point = v.get("point").and_then(Value::as_str);
        matches!(action, Some("drop" | "error")) && point.is_some() && point != Some("gw.reply.ack")
    };
    let value = line.get_mut("value").and_then(Value::as_object_mut);
    match (op.as_str(), value) {
        ("fault", Some(v)) => {
            if let Some(Value::Object(f)) = v.get_mut("fault") {
                let leaves = match f.get("kind").and_then(Value::as_str) {
                    Some("client-crash") => true,
                    Some("gw-fault") => frame_fault(&Value::Object(f.clone())),
                    _ => false,
                };
                f.insert("leaves_the_sweep_alone".into(), leaves.into());
            }
        }
        ("gw-fault", Some(v)) => {
            let leaves = frame_fault(&Value::Object(v.clone()));
            v.insert("leaves_the_sweep_alone".into(), leaves.into());
        }
        _ => {}
    }
    line
}
