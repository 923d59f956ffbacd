//! The durable state file of a test client: device credentials, the outbox, the event
//! store, per-conversation cursors and the last `delivered` the server reported.
//!
//! Every change is written to a temporary file in the same directory and renamed over
//! the old one ([`crate::util::write_atomic`]), so a reader always sees a complete file. There is
//! no fsync: the file survives a crash of the *process* (what the scenarios do), not a
//! power loss.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context as _};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Version of the state file layout; `load` refuses any other.
pub(super) const STATE_VERSION: u32 = 1;

/// A state file's events: conv -> `[(seq, mid)]`, ascending.
pub type StoredEvents = BTreeMap<String, Vec<(i64, String)>>;

/// A message the client has tried to send and not yet seen answered for good.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutboxEntry {
    pub conv: String,
    pub cmid: String,
    pub body: String,
}

/// Per-conversation part of the state file.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct ConvFile {
    /// Every event visible to this device with `seq <= cursor` is in `events` (a copy
    /// of the delivery core's cursor, taken at every write).
    pub(super) cursor: i64,
    /// Last `delivered` the server reported for this device (subbed or acked).
    pub(super) server_delivered: Option<i64>,
    /// Stored events (`ev` objects as received), by seq.
    pub(super) events: BTreeMap<i64, Value>,
    /// The conversation's sequence epoch these events belong to (issue 21; `None` until
    /// the server first named it).
    #[serde(default)]
    pub(super) epoch: Option<i64>,
}

/// The durable state file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct StateFile {
    pub(super) version: u32,
    pub(super) device: String,
    pub(super) token: String,
    pub(super) epoch: i64,
    /// Sends not yet answered for good, in the order they were first sent.
    pub(super) outbox: Vec<OutboxEntry>,
    pub(super) convs: BTreeMap<String, ConvFile>,
    /// The database's lineage moves the last `subbed` reported (issue 21; `None` before
    /// the first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) lineage: Option<i64>,
}

impl StateFile {
    pub(super) fn new(device: &str, token: &str, epoch: i64) -> StateFile {
        StateFile {
            version: STATE_VERSION,
            device: device.to_string(),
            token: token.to_string(),
            epoch,
            outbox: Vec::new(),
            convs: BTreeMap::new(),
            lineage: None,
        }
    }

    /// Reads and parses `path` (any version).
    pub(super) fn read_any(path: &Path) -> anyhow::Result<StateFile> {
        let bytes = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
        serde_json::from_slice(&bytes)
            .with_context(|| format!("parse client state {}", path.display()))
    }

    /// Reads `path`, refusing a layout version other than [`STATE_VERSION`].
    pub(super) fn read(path: &Path) -> anyhow::Result<StateFile> {
        let file = StateFile::read_any(path)?;
        if file.version != STATE_VERSION {
            bail!(
                "client state {} has version {}, expected {STATE_VERSION}",
                path.display(),
                file.version
            );
        }
        Ok(file)
    }

    /// Writes the file to a temporary file beside `path` and renames it over `path`
    /// (atomic on POSIX file systems; no fsync, see the module doc).
    pub(super) fn write(&self, path: &Path) -> anyhow::Result<()> {
        let bytes = serde_json::to_vec(self).context("encode client state")?;
        crate::util::write_atomic(path, &bytes)
    }

    /// The events, as the judge reads them: conv -> `[(seq, mid)]`.
    pub(super) fn stored_events(&self) -> StoredEvents {
        self.convs
            .iter()
            .map(|(conv, c)| {
                let evs = c
                    .events
                    .iter()
                    .map(|(seq, ev)| {
                        let mid = ev.get("mid").and_then(Value::as_str).unwrap_or("");
                        (*seq, mid.to_string())
                    })
                    .collect();
                (conv.clone(), evs)
            })
            .collect()
    }
}
