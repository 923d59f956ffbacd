//! What a test client observed: statistics, recorded frames, the history lines it
//! writes (operations, pushes, stores), and deadline-bound waits on its state.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::bail;
use serde::Serialize;
use serde_json::Value;

use super::received::Received;
use super::{field_str, Client, ClientError, Inner};
use im_check::history::{
    Completion, Done, EventRef, Line, OpName, Recv, Refused, Store, StoredRef, Unsure, Via,
    MALFORMED_REPLY,
};
use im_protocol::{FrameError, ServerFrame};

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
    /// Issue 21: conversations discarded and synced again because their epoch moved.
    pub epoch_moves: u64,
    /// Frames of an epoch older than the one this device knows (read before the move),
    /// ignored.
    pub stale_epoch_frames: u64,
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

/// How a request of `op` ended, as a history line. A success reply that is not the shape
/// `op` is answered with is `info` (`malformed-reply`): the client could not learn what
/// happened.
pub(super) fn completion(op: OpName, r: &Result<Received, ClientError>) -> Line {
    let unsure = |why: &str, msg: Option<String>| {
        Line::Info(Completion {
            op,
            value: Unsure {
                why: why.to_string(),
                msg,
            },
        })
    };
    match r {
        Ok(reply) => match Done::of_frame(op, &reply.value, &reply.frame) {
            Ok(done) => Line::Ok(done),
            Err(defect) => unsure(MALFORMED_REPLY, Some(defect)),
        },
        Err(ClientError::Server { code, msg, .. })
            if DEFINITE_ERROR_CODES.contains(&code.as_str()) =>
        {
            Line::Fail(Completion {
                op,
                value: Refused {
                    code: Some(code.clone()),
                    msg: msg.clone(),
                },
            })
        }
        // The message too: a limit's `UNAVAILABLE` names the limit (`d5-locked-out` reads it).
        Err(ClientError::Server { code, msg, .. }) => unsure(code, Some(msg.clone())),
        Err(ClientError::Timeout) => unsure("timeout", None),
        Err(ClientError::Disconnected) => unsure("disconnected", None),
        Err(ClientError::Other(e)) => unsure("other", Some(format!("{e:#}"))),
    }
}

impl Inner {
    /// Appends a history line for this client (no-op without a history).
    pub(super) fn rec(&self, op_id: Option<u64>, line: Line) -> Option<u64> {
        self.hist
            .as_ref()
            .map(|h| h.record(&self.device, self.instance, op_id, line))
    }

    /// Records events just persisted (call right after a successful `persist`).
    pub(super) fn rec_store(&self, conv: &str, via: Via, events: &[(i64, Value)], cursor: i64) {
        if events.is_empty() {
            return;
        }
        let events = events
            .iter()
            .map(|(seq, mid)| StoredRef {
                seq: *seq,
                mid: mid.as_str().unwrap_or_default().to_string(),
            })
            .collect();
        self.rec(
            None,
            Line::Store(Store::Store {
                conv: conv.to_string(),
                via,
                events,
                cursor,
            }),
        );
    }

    /// Records a received `event` (and probes it, D1) or `hint` in the history; a push
    /// the history cannot name is recorded as `malformed`.
    pub(super) fn rec_push(&self, v: &Value, frame: &Result<ServerFrame, FrameError>) {
        let recv = match (field_str(v, "t"), frame) {
            (Some("event"), Ok(ServerFrame::Event(ev))) => Recv::Push(EventRef::of(ev)),
            (Some("hint"), Ok(ServerFrame::Hint { conv, head, why })) => Recv::Hint {
                conv: conv.clone(),
                head: *head,
                why: (*why).into(),
            },
            (Some("event" | "hint"), _) => Recv::Malformed { frame: v.clone() },
            _ => return,
        };
        let probe = match &recv {
            Recv::Push(ev) => Some((ev.conv.clone(), ev.seq, ev.mid.clone())),
            _ => None,
        };
        let line = self.rec(None, Line::Recv(recv));
        if let (Some(h), Some(i), Some((conv, seq, mid))) = (&self.hist, line, probe) {
            h.probe(i, &conv, seq, &mid);
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

    /// Each conversation's sequence epoch as the client knows it (issue 21).
    pub fn epochs(&self) -> std::collections::BTreeMap<String, i64> {
        self.inner
            .lock()
            .file
            .convs
            .iter()
            .filter_map(|(conv, c)| c.epoch.map(|e| (conv.clone(), e)))
            .collect()
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
