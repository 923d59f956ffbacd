//! The typed lines of `history.jsonl`: what each line may say, one Rust type per line
//! kind, written and read by the same serde derivation (format: evidence/README.md,
//! "History", `schema_version` [`super::SCHEMA_VERSION`]).
//!
//! Owns: the shape of every line: `{"type", "op", "value"}` plus, for nemesis lines,
//! `"phase"`. Every value struct refuses unknown fields and every field the checker reads
//! is required, so a line written by another version, or a field renamed, does not parse:
//! reading such a history fails loudly ([`super::read`]), and the judgement is ERROR,
//! never a rule that skips the line. Must not: record (the harness's `History` does) or
//! judge ([`crate::check`] does). A line is plain data: what the judge must know about a
//! fault (whether it leaves the sweep alone) is written in the line by whoever made the
//! fault, never looked up here.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use im_protocol::wire::{Event, Reply};
use im_protocol::{FaultPoint, FrameError, ServerFrame};

/// What a line is: the `type` tag, then the `op` and `value` of its kind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Line {
    /// A client operation started (its request frame is about to leave).
    Invoke(Invoke),
    /// The operation succeeded (a success reply).
    Ok(Done),
    /// A definite error reply: the operation did not happen.
    Fail(Completion<Refused>),
    /// No definite answer (timeout, connection lost, `UNAVAILABLE`, `INTERNAL`, a reply the
    /// client could not read): it may or may not have happened.
    Info(Completion<Unsure>),
    /// A push (`event`) or `hint` frame a client received.
    Recv(Recv),
    /// Events a client persisted to its state file (written before this line).
    Store(Store),
    /// The client's life: create, restart (loaded from its state file), disconnect, crash.
    Client(Life),
    /// A fault or nemesis action, with its phase: start / end (paired by `op_id`) or
    /// instant.
    Nemesis(Nemesis),
    /// A D1 probe: was the event of a `sent` reply or a push visible to another session?
    Probe(ProbeLine),
    /// Bookkeeping: `open` (first line), `final` (the final read was taken).
    Meta(Meta),
}

/// The `type` of a line, without its contents (statistics, timelines).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Type {
    Invoke,
    Ok,
    Fail,
    Info,
    Recv,
    Store,
    Client,
    Nemesis,
    Probe,
    Meta,
}

/// A client operation: the `op` of its invoke and completion lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OpName {
    Hello,
    Send,
    Ack,
    Sub,
    Sync,
    Connect,
    /// A frame the typed requests cannot express (hostile tests).
    Raw,
}

impl OpName {
    pub fn as_str(self) -> &'static str {
        match self {
            OpName::Hello => "hello",
            OpName::Send => "send",
            OpName::Ack => "ack",
            OpName::Sub => "sub",
            OpName::Sync => "sync",
            OpName::Connect => "connect",
            OpName::Raw => "raw",
        }
    }
}

/// An invoke: the request as the history keeps it (no `rid`, no token, a body's length
/// instead of the body).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "op",
    content = "value",
    rename_all = "kebab-case",
    deny_unknown_fields
)]
pub enum Invoke {
    Hello {
        device: String,
        epoch: i64,
    },
    Send {
        conv: String,
        cmid: String,
        body_len: usize,
    },
    /// `explicit`: a test acked on purpose, not the client's own logic; the checker holds
    /// only the client's own acks to D3.
    Ack {
        conv: String,
        seq: i64,
        explicit: bool,
    },
    Sub {},
    Sync {
        conv: String,
        after: Option<i64>,
        limit: Option<i64>,
    },
    /// Opening the WebSocket.
    Connect {
        url: String,
    },
    /// A request frame that is none of the above (a hostile test's frame), kept as sent
    /// without `rid`, token or body.
    Raw {
        frame: Value,
    },
}

impl Invoke {
    pub fn op(&self) -> OpName {
        match self {
            Invoke::Hello { .. } => OpName::Hello,
            Invoke::Send { .. } => OpName::Send,
            Invoke::Ack { .. } => OpName::Ack,
            Invoke::Sub {} => OpName::Sub,
            Invoke::Sync { .. } => OpName::Sync,
            Invoke::Connect { .. } => OpName::Connect,
            Invoke::Raw { .. } => OpName::Raw,
        }
    }

    /// The invoke of a request frame (a JSON object with `t`): the typed request when the
    /// frame is one, else [`Invoke::Raw`]. Drops `rid` and `token`; a `body` becomes
    /// `body_len`.
    pub fn of_frame(frame: &Value) -> Invoke {
        let mut v = frame.clone();
        let mut t = None;
        if let Some(o) = v.as_object_mut() {
            t = o.remove("t");
            o.remove("rid");
            o.remove("token");
            if let Some(body) = o.remove("body") {
                let len = body.as_str().map_or(0, str::len);
                o.insert("body_len".into(), len.into());
            }
        }
        let typed = t
            .as_ref()
            .and_then(Value::as_str)
            .filter(|t| !matches!(*t, "connect" | "raw"));
        if let (Some(op), Value::Object(o)) = (typed, &v) {
            let mut o = o.clone();
            // `sync` may leave out `after` and `limit`; an ack sent as a raw frame is not
            // marked explicit (the checker holds it to D3 like the client's own).
            if op == "sync" {
                o.entry("after").or_insert(Value::Null);
                o.entry("limit").or_insert(Value::Null);
            }
            if op == "ack" {
                o.entry("explicit").or_insert(Value::Bool(false));
            }
            let tagged = serde_json::json!({"op": op, "value": o});
            if let Ok(inv) = serde_json::from_value(tagged) {
                return inv;
            }
        }
        if let (Some(t), Some(o)) = (t, v.as_object_mut()) {
            o.insert("t".into(), t);
        }
        Invoke::Raw { frame: v }
    }
}

/// An `ok` completion: the success reply as the history keeps it (no `t`, no `rid`,
/// events without body or time).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "op",
    content = "value",
    rename_all = "kebab-case",
    deny_unknown_fields
)]
pub enum Done {
    Hello {
        user: String,
        device: String,
        epoch: i64,
    },
    Send {
        conv: String,
        seq: i64,
        mid: String,
        dup: bool,
        epoch: i64,
    },
    Ack {
        conv: String,
        delivered: i64,
    },
    Sub {
        convs: Vec<SubConv>,
    },
    Sync {
        conv: String,
        events: Vec<EventRef>,
        head: i64,
        complete: bool,
    },
    Connect {},
    /// The reply to a [`Invoke::Raw`] request, as received (without `rid`).
    Raw {
        reply: Value,
    },
}

impl Done {
    pub fn op(&self) -> OpName {
        match self {
            Done::Hello { .. } => OpName::Hello,
            Done::Send { .. } => OpName::Send,
            Done::Ack { .. } => OpName::Ack,
            Done::Sub { .. } => OpName::Sub,
            Done::Sync { .. } => OpName::Sync,
            Done::Connect {} => OpName::Connect,
            Done::Raw { .. } => OpName::Raw,
        }
    }

    /// The `ok` line of `op` for a success reply, from its typed reading (`frame`; a
    /// [`OpName::Raw`] request records the reply as received, `value`, without `rid`). Err
    /// (the reply's defect) when the frame does not parse or is not the reply `op` is
    /// answered with.
    pub fn of_frame(
        op: OpName,
        value: &Value,
        frame: &Result<ServerFrame, FrameError>,
    ) -> Result<Done, String> {
        if op == OpName::Raw {
            let mut reply = value.clone();
            if let Some(o) = reply.as_object_mut() {
                o.remove("rid");
            }
            return Ok(Done::Raw { reply });
        }
        let unexpected = |why: String| format!("unexpected {} reply: {why}", op.as_str());
        let reply = match frame {
            Ok(ServerFrame::Reply { reply, .. }) => reply,
            Ok(ServerFrame::Event(_)) => return Err(unexpected("an event push".into())),
            Ok(ServerFrame::Hint { .. }) => return Err(unexpected("a hint push".into())),
            Err(e) => return Err(unexpected(e.to_string())),
        };
        Ok(match (op, reply) {
            (
                OpName::Hello,
                Reply::Welcome {
                    user,
                    device,
                    epoch,
                },
            ) => Done::Hello {
                user: user.clone(),
                device: device.clone(),
                epoch: *epoch,
            },
            (
                OpName::Send,
                Reply::Sent {
                    conv,
                    seq,
                    mid,
                    dup,
                    epoch,
                },
            ) => Done::Send {
                conv: conv.clone(),
                seq: *seq,
                mid: mid.clone(),
                dup: *dup,
                epoch: *epoch,
            },
            (OpName::Ack, Reply::Acked { conv, delivered }) => Done::Ack {
                conv: conv.clone(),
                delivered: *delivered,
            },
            (OpName::Sub, Reply::Subbed { convs, .. }) => Done::Sub {
                convs: convs
                    .iter()
                    .map(|c| SubConv {
                        conv: c.conv.clone(),
                        head: c.head,
                        delivered: c.delivered,
                        epoch: Some(c.epoch),
                    })
                    .collect(),
            },
            (
                OpName::Sync,
                Reply::Synced {
                    conv,
                    events,
                    head,
                    complete,
                },
            ) => Done::Sync {
                conv: conv.clone(),
                events: events.iter().map(EventRef::of).collect(),
                head: *head,
                complete: *complete,
            },
            (_, other) => {
                let name = match other {
                    Reply::Welcome { .. } => "welcome",
                    Reply::Sent { .. } => "sent",
                    Reply::Acked { .. } => "acked",
                    Reply::Subbed { .. } => "subbed",
                    Reply::Synced { .. } => "synced",
                    Reply::Error(_) => "error",
                };
                return Err(unexpected(format!("a `{name}` frame")));
            }
        })
    }
}

/// One conversation of a `subbed` reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubConv {
    pub conv: String,
    pub head: i64,
    pub delivered: i64,
    /// The conversation's sequence epoch (issue 21; absent in older histories).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<i64>,
}

/// An event as the history names it (pushes and sync pages): no body, no time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventRef {
    pub conv: String,
    pub seq: i64,
    pub mid: String,
    pub sender: String,
    pub cmid: String,
    /// The conversation's sequence epoch the gateway sent with it (issue 21; absent in
    /// older histories).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<i64>,
}

impl EventRef {
    /// The history's name of an event.
    pub fn of(ev: &Event) -> EventRef {
        EventRef {
            epoch: Some(ev.epoch),
            conv: ev.conv.clone(),
            seq: ev.seq,
            mid: ev.mid.clone(),
            sender: ev.sender.clone(),
            cmid: ev.cmid.clone(),
        }
    }
}

/// A completion line that is not `ok`: the operation and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Completion<V> {
    pub op: OpName,
    pub value: V,
}

/// A definite error reply (or a WebSocket that could not be opened).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Refused {
    /// The error code; None for a failed `connect`.
    pub code: Option<String>,
    pub msg: String,
}

/// The `why` of a success reply the client could not read ([`Done::of_reply`]).
pub const MALFORMED_REPLY: &str = "malformed-reply";

/// No definite answer: `why` is the error code, `timeout`, `disconnected`,
/// [`MALFORMED_REPLY`] or `other`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Unsure {
    pub why: String,
    pub msg: Option<String>,
}

/// Why the gateway sent a `hint`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HintWhy {
    Sweep,
    Overflow,
    /// SPEC 2 names it; this gateway does not send it.
    Resync,
}

impl From<im_protocol::wire::HintWhy> for HintWhy {
    fn from(w: im_protocol::wire::HintWhy) -> HintWhy {
        match w {
            im_protocol::wire::HintWhy::Sweep => HintWhy::Sweep,
            im_protocol::wire::HintWhy::Overflow => HintWhy::Overflow,
            im_protocol::wire::HintWhy::Resync => HintWhy::Resync,
        }
    }
}

/// A frame a client received unasked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "op",
    content = "value",
    rename_all = "kebab-case",
    deny_unknown_fields
)]
pub enum Recv {
    Push(EventRef),
    Hint {
        conv: String,
        head: i64,
        why: HintWhy,
    },
    /// A push the client could not read (missing fields, an unknown `why`): counted, not
    /// applied.
    Malformed {
        frame: Value,
    },
}

/// How stored events arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Via {
    Push,
    Sync,
}

/// One event in a `store` line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredRef {
    pub seq: i64,
    pub mid: String,
}

/// Events a client persisted: the `op` is always `store`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "op",
    content = "value",
    rename_all = "kebab-case",
    deny_unknown_fields
)]
pub enum Store {
    Store {
        conv: String,
        via: Via,
        events: Vec<StoredRef>,
        /// The client's cursor after the store.
        cursor: i64,
    },
    /// Issue 21: the conversation's sequence epoch moved from the one this device knew (the
    /// database may have lost history it holds): it discarded what it held of the
    /// conversation (`dropped` events, its cursor) and syncs again from 0. The op is
    /// `epoch`.
    Epoch {
        conv: String,
        from: i64,
        to: i64,
        dropped: usize,
    },
}

/// The client's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    tag = "op",
    content = "value",
    rename_all = "kebab-case",
    deny_unknown_fields
)]
pub enum Life {
    Create {},
    /// Loaded again from its state file.
    Restart {},
    /// The connection was lost (the client did not close it).
    Disconnect {},
    /// Killed without flushing.
    Crash {},
}

/// A D1 probe: the op is always `probe`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "op",
    content = "value",
    rename_all = "kebab-case",
    deny_unknown_fields
)]
pub enum ProbeLine {
    Probe {
        /// The line (`Entry::i`) of the `sent` reply or push probed.
        of: u64,
        conv: String,
        seq: i64,
        expect_mid: String,
        found_mid: Option<String>,
        /// The probe could not read (the database was down): ignored.
        error: Option<String>,
    },
}

/// Bookkeeping lines.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "op",
    content = "value",
    rename_all = "kebab-case",
    deny_unknown_fields
)]
pub enum Meta {
    /// The first line.
    Open { schema_version: u32 },
    /// The judge took the final read.
    Final {},
}

/// Start and end of a nemesis period (paired by `op_id`), or an instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Start,
    End,
    Instant,
}

/// A nemesis line: its phase and what was done.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Nemesis {
    pub phase: Phase,
    #[serde(flatten)]
    pub action: Action,
}

/// How a database action went (null on a start line).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Outcome {
    pub ok: Option<bool>,
    pub error: Option<String>,
    /// The node acted on (a formation's primary).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// What a power cut threw away (`LazyFs`'s report).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut: Option<Value>,
}

impl Outcome {
    pub fn of<T, U: Serialize>(r: &anyhow::Result<T>, cut: impl FnOnce(&T) -> U) -> Outcome {
        Outcome {
            ok: Some(r.is_ok()),
            error: r.as_ref().err().map(|e| format!("{e:#}")),
            node: None,
            cut: r
                .as_ref()
                .ok()
                .and_then(|t| serde_json::to_value(cut(t)).ok()),
        }
    }

    /// A finished action that reports nothing but success or its error.
    pub fn done<T>(r: &anyhow::Result<T>) -> Outcome {
        Outcome {
            cut: None,
            ..Outcome::of(r, |_| ())
        }
    }
}

/// A fault of a nemesis schedule as the history keeps it: plain data, written by the
/// nemesis from its schedule's fault (same fields as in `schedule.json`, plus what the judge
/// must know). The judge reads only `leaves_the_sweep_alone` (and the line's phase and op
/// id); `kind`, `target` and the parameters are for people (the run's report), and the
/// judge makes no decision by them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultLine {
    /// Position in the generated schedule.
    pub id: u32,
    /// Start and end, offsets from the start of the workload (`end_ms == at_ms`: an
    /// instant).
    pub at_ms: u64,
    pub end_ms: u64,
    /// What it acts on: `gateway`, `postgres`, `gateway->postgres`, a device id...
    pub target: String,
    /// The fault's kind, as `schedule.json` names it (`gw-kill`, `net-db`...).
    pub kind: String,
    /// The kind's parameters (`point`, `skip`, `action`...), beside `kind` as
    /// `schedule.json` writes them; opaque to the judge.
    #[serde(flatten)]
    pub params: serde_json::Map<String, Value>,
    /// Whether the fault can neither delay the sweep's pass or its hints nor move a cursor
    /// without the client hearing of it (a client crash; a frame dropped or refused at any
    /// point but the ack's reply), decided by the fault's package when the line is
    /// written: `d5-sweep-late` still judges hint gaps while it is in force. Required since
    /// schema_version 3 (the reader fills it in for version 2).
    pub leaves_the_sweep_alone: bool,
}

/// Disk faults in force on the database's LazyFS layer (issue 21). The default is none.
/// The layer (the harness's `lazyfs`) is switched with this type; the history records it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskFaults {
    /// `fsync` fails with `EIO` and the file's unsynced pages are thrown away.
    pub fsync_eio: bool,
    /// A write that would extend a file fails with `ENOSPC`.
    pub enospc: bool,
    /// Every `fsync` is answered this much later.
    pub fsync_delay_ms: u64,
}

/// A membership change made by the harness.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Join {
    Join,
    Leave,
}

/// What the nemesis (or a scripted check) did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "op",
    content = "value",
    rename_all = "kebab-case",
    deny_unknown_fields
)]
pub enum Action {
    /// The nemesis runner began a schedule.
    NemesisStart {
        seed: u64,
        /// Which run of the seed (`--repeat`).
        repeat: String,
        faults: usize,
    },
    /// A gateway process started (`sweep_ms` bounds D5 from here).
    GatewayStart {
        gateway: usize,
        fault: Option<String>,
        sweep_ms: u64,
        bug: Option<String>,
    },
    /// A gateway process exited (a crash point fired, or it was killed).
    GatewayExit {
        gateway: Option<usize>,
        status: Option<i32>,
        raw: String,
    },
    GatewayKill {
        gateway: usize,
    },
    PgCrash(Outcome),
    PgRestart(Outcome),
    PgPowerCut(Outcome),
    PgPrimaryKill(Outcome),
    PgPromote(Outcome),
    /// The primary's replication link cut as its machine died: what the standby had not
    /// received is gone. `synchronous`: the standby was synchronous (absent in older
    /// histories); an asynchronous one may lose acknowledged messages, as its configuration
    /// says (the checker reports them as the expected loss, not as anomalies).
    ReplicationLinkCut {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        synchronous: Option<bool>,
    },
    /// The gateways' database address moved (to a promoted standby).
    DbAddressSwitch {
        to: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        port: Option<u16>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        by: Option<String>,
    },
    PgTerminateBackend {
        pid: i32,
        terminated: bool,
    },
    /// Disk faults on the database's LazyFS layer (issue 21): a period, its start and end
    /// carrying the same faults.
    DiskFault {
        faults: DiskFaults,
    },
    /// A fault of a nemesis schedule (start and end carry the same fault; `healed`: ended
    /// by the heal, not by its schedule).
    Fault {
        fault: FaultLine,
        healed: bool,
    },
    /// A frame fault a scripted check armed on gateway `gateway` (`spec` in `IM_FAULT`
    /// syntax). `leaves_the_sweep_alone` as in [`FaultLine`], decided by whoever armed it
    /// (schema_version 3).
    GwFault {
        point: FaultPoint,
        action: String,
        spec: String,
        gateway: usize,
        leaves_the_sweep_alone: bool,
    },
    Membership {
        action: Join,
        conv: String,
        user: String,
        /// The change was found already made (an earlier attempt committed).
        applied_by_an_earlier_attempt: bool,
    },
    /// A device was given a new install (its old one is stale).
    Reinstall {
        device: String,
    },
    /// The heal: every fault ended, every device brought back.
    Heal {
        unsettled: Vec<String>,
    },
    /// A fault found still armed during the heal, and disarmed.
    StaleFaultDisarmed {
        /// The control socket's `list`.
        armed: String,
        /// Its answer to `disarm all`.
        disarm: String,
    },
    /// The harness itself was not run on time: what it recorded in `[from_ms, to_ms]` was
    /// recorded late.
    ObserverStall {
        from_ms: f64,
        to_ms: f64,
        cause: String,
    },
}

impl Action {
    /// The `op` of the line: the name serde writes for the variant (the enum's
    /// `rename_all`), so what a report calls a line is what its history says.
    pub fn name(&self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v.get("op").and_then(Value::as_str).map(str::to_string))
            .unwrap_or_default()
    }
}

impl Line {
    pub fn kind(&self) -> Type {
        match self {
            Line::Invoke(_) => Type::Invoke,
            Line::Ok(_) => Type::Ok,
            Line::Fail(_) => Type::Fail,
            Line::Info(_) => Type::Info,
            Line::Recv(_) => Type::Recv,
            Line::Store(_) => Type::Store,
            Line::Client(_) => Type::Client,
            Line::Nemesis(_) => Type::Nemesis,
            Line::Probe(_) => Type::Probe,
            Line::Meta(_) => Type::Meta,
        }
    }

    /// The `op` of the line, as written.
    pub fn op(&self) -> Cow<'static, str> {
        Cow::Borrowed(match self {
            Line::Invoke(i) => i.op().as_str(),
            Line::Ok(d) => d.op().as_str(),
            Line::Fail(c) => c.op.as_str(),
            Line::Info(c) => c.op.as_str(),
            Line::Recv(Recv::Push(_)) => "push",
            Line::Recv(Recv::Hint { .. }) => "hint",
            Line::Recv(Recv::Malformed { .. }) => "malformed",
            Line::Store(_) => "store",
            Line::Client(Life::Create {}) => "create",
            Line::Client(Life::Restart {}) => "restart",
            Line::Client(Life::Disconnect {}) => "disconnect",
            Line::Client(Life::Crash {}) => "crash",
            Line::Nemesis(n) => return Cow::Owned(n.action.name()),
            Line::Probe(_) => "probe",
            Line::Meta(Meta::Open { .. }) => "open",
            Line::Meta(Meta::Final {}) => "final",
        })
    }

    /// The client operation of an invoke or completion line.
    pub fn client_op(&self) -> Option<OpName> {
        match self {
            Line::Invoke(i) => Some(i.op()),
            Line::Ok(d) => Some(d.op()),
            Line::Fail(c) => Some(c.op),
            Line::Info(c) => Some(c.op),
            _ => None,
        }
    }
}
