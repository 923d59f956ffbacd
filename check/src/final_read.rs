//! The final read (`final.json`): what the judge read from the database and the clients'
//! state files at the end of a run.

use super::*;

// ---------------------------------------------------------------------------------------
// final.json
// ---------------------------------------------------------------------------------------

/// The final read (`final.json`), taken by the judge at the end of a scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Final {
    /// [`FINAL_SCHEMA_VERSION`].
    pub schema_version: u32,
    /// When the read was taken, on the history's monotonic clock (`Entry::t_ms`).
    pub t_ms: f64,
    /// When the read was taken, real-time clock (`Entry::wall_us`).
    pub wall_us: i64,
    /// `IM_SWEEP_MS` of the last gateway (fallback for D5 when no `gateway-start` precedes).
    pub sweep_ms: u64,
    /// Every row of `events`.
    pub events: Vec<FinalEvent>,
    /// conv → head (`next_seq - 1`).
    pub heads: BTreeMap<String, i64>,
    /// Every membership period.
    pub memberships: Vec<Membership>,
    /// device → user.
    pub devices: BTreeMap<String, String>,
    /// Every row of `device_cursors`.
    pub cursors: Vec<FinalCursor>,
    /// Every write of `device_cursors` over the run, in commit order.
    pub cursor_audit: Vec<CursorWrite>,
    /// device → conv → the events in that client's state file at the end.
    pub stores: BTreeMap<String, BTreeMap<String, Vec<StoredEvent>>>,
    /// Devices whose client is connected and subscribed at the end.
    pub live: Vec<String>,
    /// The D5 wait at the end: what live devices still missed after waiting.
    pub liveness: Liveness,
}

/// One row of `events`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FinalEvent {
    pub conv: String,
    pub seq: i64,
    pub mid: String,
    pub sender_user: String,
    pub sender_device: String,
    pub cmid: String,
}

/// A membership period: `seq` is visible to `user` iff `from_seq <= seq` and
/// (`to_seq` is null or `seq < to_seq`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Membership {
    pub conv: String,
    pub user: String,
    pub from_seq: i64,
    pub to_seq: Option<i64>,
}

/// One row of `device_cursors` at the end.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FinalCursor {
    pub device: String,
    pub conv: String,
    pub delivered: i64,
}

/// One write of `device_cursors` (`old` is null when the row was created).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CursorWrite {
    pub device: String,
    pub conv: String,
    pub old: Option<i64>,
    pub new: i64,
    /// Commit time of the write, same clock as `Entry::wall_us`.
    pub wall_us: i64,
}

/// One event of a client's state file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredEvent {
    pub seq: i64,
    pub mid: String,
}

/// The D5 wait at the end of a scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Liveness {
    /// How long a live device may take to repair a lost push.
    pub bound_ms: u64,
    /// How long the judge actually waited.
    pub waited_ms: f64,
    /// device → conv → visible seqs still not in that device's state file.
    pub missing: BTreeMap<String, BTreeMap<String, Vec<i64>>>,
}
