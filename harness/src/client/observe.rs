//! What a test client observed: statistics, recorded frames, the history lines it
//! writes (operations, pushes, stores), and deadline-bound waits on its state.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::bail;
use serde::Serialize;
use serde_json::{json, Value};

use super::{field_i64, field_str, Client, ClientError, Inner};
use crate::history::Type;

#[derive(Debug, Clone, Default, Serialize)]
pub struct ClientStats {
    /// Text frames received (any type).
    pub frames_received: u64,
    /// `event` pushes received (hints are counted in `hints_received`).
    pub pushes_received: u64,
    /// Pushes that stored an event the client did not have.
    pub pushes_applied: u64,
    /// Events stored from sync replies that the client did not have.
    pub events_synced: u64,
    /// Events (pushed or synced) the client already had.
    pub duplicates_ignored: u64,
    /// Pushes with `seq > cursor + 1`.
    pub gaps_detected: u64,
    /// `hint` pushes, by `why`.
    pub hints_received: BTreeMap<String, u64>,
    /// Sync pages requested by the client itself (pump and `sub`), not `sync_once`.
    pub syncs_run: u64,
    /// Sync pages that failed.
    pub sync_errors: u64,
    /// Ack frames sent (automatic, after `sub`, and explicit `ack`).
    pub acks_sent: u64,
    /// Acks that did not get an `acked` reply.
    pub ack_errors: u64,
    /// Pushes dropped because the pump queue was full.
    pub pushes_overflowed: u64,
    /// Pushes or replies that lacked required fields, and non-JSON frames.
    pub malformed_frames: u64,
    /// Times a reported `delivered` was lower than the one reported before (D4 says
    /// this never happens).
    pub delivered_decreases: u64,
    /// State file writes that failed (no ack is sent while the file is behind).
    pub persist_errors: u64,
}

/// every other outcome without a success reply is `info` (it may have happened).
const DEFINITE_ERROR_CODES: [&str; 7] = [
    "BAD_REQUEST",
    "NOT_MEMBER",
    "CMID_CONFLICT",
    "TOO_LARGE",
    "STALE_INSTALL",
    "UNAUTHENTICATED",
    "CURSOR_AHEAD",
];

/// The invoke value of a request frame: the frame without `t`, `rid`, secrets and bodies.
pub(super) fn invoke_value(frame: &Value) -> Value {
    let mut v = frame.clone();
    if let Some(o) = v.as_object_mut() {
        o.remove("t");
        o.remove("rid");
        o.remove("token");
        if let Some(body) = o.remove("body") {
            let len = body.as_str().map_or(0, str::len);
            o.insert("body_len".into(), json!(len));
        }
    }
    v
}

/// The pieces of an `ev` object the history keeps (no body, no time).
fn event_summary(ev: &Value) -> Value {
    json!({"conv": ev.get("conv"), "seq": ev.get("seq"), "mid": ev.get("mid"),
           "sender": ev.get("sender"), "cmid": ev.get("cmid")})
}

/// How a request ended, as a history line: its type and value.
pub(super) fn completion(r: &Result<Value, ClientError>) -> (Type, Value) {
    match r {
        Ok(reply) => {
            let mut v = reply.clone();
            if let Some(o) = v.as_object_mut() {
                o.remove("t");
                o.remove("rid");
                if let Some(Value::Array(evs)) = o.get_mut("events") {
                    for ev in evs.iter_mut() {
                        *ev = event_summary(ev);
                    }
                }
            }
            (Type::Ok, v)
        }
        Err(ClientError::Server { code, msg, .. })
            if DEFINITE_ERROR_CODES.contains(&code.as_str()) =>
        {
            (Type::Fail, json!({"code": code, "msg": msg}))
        }
        Err(ClientError::Server { code, .. }) => (Type::Info, json!({"why": code})),
        Err(ClientError::Timeout) => (Type::Info, json!({"why": "timeout"})),
        Err(ClientError::Disconnected) => (Type::Info, json!({"why": "disconnected"})),
        Err(ClientError::Other(e)) => {
            (Type::Info, json!({"why": "other", "msg": format!("{e:#}")}))
        }
    }
}

impl Inner {
    /// Appends a history line for this client (no-op without a history).
    pub(super) fn rec(
        &self,
        kind: Type,
        op: &str,
        op_id: Option<u64>,
        value: Value,
    ) -> Option<u64> {
        self.hist
            .as_ref()
            .map(|h| h.record(&self.device, self.instance, kind, op, op_id, value))
    }

    /// Records events just persisted (call right after a successful `persist`).
    pub(super) fn rec_store(&self, conv: &str, via: &str, events: &[(i64, Value)], cursor: i64) {
        if events.is_empty() {
            return;
        }
        let evs: Vec<Value> = events
            .iter()
            .map(|(seq, mid)| json!({"seq": seq, "mid": mid}))
            .collect();
        self.rec(
            Type::Store,
            "store",
            None,
            json!({"conv": conv, "via": via, "events": evs, "cursor": cursor}),
        );
    }

    /// Records a received `event` (and probes it, D1) or `hint` in the history.
    pub(super) fn rec_push(&self, v: &Value) {
        match field_str(v, "t") {
            Some("event") => {
                let ev = v.get("ev").cloned().unwrap_or(Value::Null);
                let line = self.rec(Type::Recv, "push", None, event_summary(&ev));
                if let (Some(h), Some(i)) = (&self.hist, line) {
                    if let (Some(conv), Some(seq), Some(mid)) = (
                        field_str(&ev, "conv"),
                        field_i64(&ev, "seq"),
                        field_str(&ev, "mid"),
                    ) {
                        h.probe(i, conv, seq, mid);
                    }
                }
            }
            Some("hint") => {
                self.rec(
                    Type::Recv,
                    "hint",
                    None,
                    json!({"conv": v.get("conv"), "head": v.get("head"), "why": v.get("why")}),
                );
            }
            _ => {}
        }
    }
}

impl Client {
    /// Highest seq through which every visible event is stored (0 if none).
    pub fn cursor(&self, conv: &str) -> i64 {
        self.inner.lock().cursor(conv)
    }

    /// Last `delivered` the server reported for this device and `conv`.
    pub fn server_delivered(&self, conv: &str) -> Option<i64> {
        self.inner
            .lock()
            .file
            .convs
            .get(conv)
            .and_then(|c| c.server_delivered)
    }

    /// Highest head the server reported for `conv` (subbed, synced, hint).
    pub fn head_seen(&self, conv: &str) -> Option<i64> {
        self.inner.lock().heads.get(conv).copied()
    }

    /// Stored events of `conv` (`ev` objects), ascending by seq.
    pub fn stored(&self, conv: &str) -> Vec<Value> {
        self.inner
            .lock()
            .file
            .convs
            .get(conv)
            .map(|c| c.events.values().cloned().collect())
            .unwrap_or_default()
    }

    pub fn stored_seqs(&self, conv: &str) -> Vec<i64> {
        self.inner
            .lock()
            .file
            .convs
            .get(conv)
            .map(|c| c.events.keys().copied().collect())
            .unwrap_or_default()
    }

    /// Conversations the client has any state for.
    pub fn convs(&self) -> Vec<String> {
        self.inner.lock().file.convs.keys().cloned().collect()
    }

    pub fn stats(&self) -> ClientStats {
        self.inner.lock().stats.clone()
    }

    /// Received frames with arrival times, oldest first (bounded by `frames_max`).
    /// Besides JSON frames: `{"t":"_close","code","reason"}` for a close frame,
    /// `{"t":"_nonjson","raw"}` and `{"t":"_binary","len"}`.
    pub fn frames(&self) -> Vec<(Instant, Value)> {
        self.inner.lock().frames.iter().cloned().collect()
    }

    /// Frames this client sent (requests with their `rid`; raw text as a JSON string).
    pub fn sent_frames(&self) -> Vec<(Instant, Value)> {
        self.inner.lock().sent_frames.iter().cloned().collect()
    }

    /// Waits until `f` holds, re-checking after every change of the client's state,
    /// until `within` passed. Returns the time waited.
    pub async fn wait_for<F: Fn(&Client) -> bool>(
        &self,
        what: &str,
        within: Duration,
        f: F,
    ) -> anyhow::Result<Duration> {
        let start = Instant::now();
        let deadline = tokio::time::Instant::now() + within;
        let mut changes = self.inner.changed.subscribe();
        loop {
            if f(self) {
                return Ok(start.elapsed());
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => bail!("client state channel closed while waiting for {what}"),
                Err(_) => {
                    if f(self) {
                        return Ok(start.elapsed());
                    }
                    bail!(
                        "timed out after {within:?} waiting for {what} (connected: {}, stats: {:?})",
                        self.is_connected(),
                        self.stats()
                    );
                }
            }
        }
    }

    pub async fn wait_cursor(
        &self,
        conv: &str,
        at_least: i64,
        within: Duration,
    ) -> anyhow::Result<Duration> {
        self.wait_for(&format!("cursor of {conv} >= {at_least}"), within, |c| {
            c.cursor(conv) >= at_least
        })
        .await
    }

    pub async fn wait_server_delivered(
        &self,
        conv: &str,
        at_least: i64,
        within: Duration,
    ) -> anyhow::Result<Duration> {
        self.wait_for(
            &format!("server delivered of {conv} >= {at_least}"),
            within,
            |c| c.server_delivered(conv).is_some_and(|d| d >= at_least),
        )
        .await
    }

    /// Waits until the connection is closed (by the server, or broken).
    pub async fn wait_closed(&self, within: Duration) -> anyhow::Result<()> {
        self.wait_for("the connection to close", within, |c| !c.is_connected())
            .await
            .map(|_| ())
    }

    pub fn is_connected(&self) -> bool {
        self.inner.lock().conn.is_some()
    }

    /// True after a successful `sub` on the current connection.
    pub fn is_subscribed(&self) -> bool {
        self.inner.lock().subscribed
    }
}
