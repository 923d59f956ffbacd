//! Wire types of SPEC 2, the server's side: parsing inbound frames into [`Request`], and the
//! outbound frames as typed values ([`Reply`], [`Push`], [`Frame`]) rendered to JSON in one
//! place ([`render`]). No I/O, no SQL, no state. Every malformed input is a
//! [`WireError::BadRequest`], never a panic. The client's side of the same types (a request
//! rendered, a server frame parsed) is [`crate::client`].

use crate::error::WireError;
use serde::Deserialize;
use serde_json::{json, Map, Value};

/// Longest `rid` a client may send (SPEC 2).
pub const RID_MAX_BYTES: usize = 64;
/// Longest `token` accepted in a `hello`.
pub const TOKEN_MAX_BYTES: usize = 256;
/// Longest `cmid` accepted (the `events.cmid` CHECK agrees).
pub const CMID_MAX_BYTES: usize = 128;
/// Longest user, device or conversation id (the CHECKs in migrations agree).
pub const ID_MAX_BYTES: usize = 64;

#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    Hello {
        device: String,
        token: String,
        epoch: i64,
    },
    Send {
        conv: String,
        cmid: String,
        body: String,
    },
    Ack {
        conv: String,
        seq: i64,
    },
    Sub,
    Sync {
        conv: String,
        after: i64,
        limit: Option<i64>,
    },
}

/// One parsed inbound frame: its `rid` (when it had a valid one) and the request or the
/// reason it was refused.
#[derive(Debug)]
pub struct Inbound {
    pub rid: Option<String>,
    pub req: Result<Request, WireError>,
}

fn str_field(o: &Map<String, Value>, name: &str, max: usize) -> Result<String, WireError> {
    match o.get(name) {
        Some(Value::String(s)) if s.is_empty() => {
            Err(WireError::bad(format!("field `{name}` must not be empty")))
        }
        Some(Value::String(s)) if s.len() > max => Err(WireError::bad(format!(
            "field `{name}` is longer than {max} bytes"
        ))),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(WireError::bad(format!("field `{name}` must be a string"))),
        None => Err(WireError::bad(format!("missing field `{name}`"))),
    }
}

/// A user, device or conversation id: 1 to 64 characters of `A-Za-z0-9._-` (the CHECKs in
/// migrations agree), so anything else is refused here and never reaches the database.
fn id_field(o: &Map<String, Value>, name: &str) -> Result<String, WireError> {
    let s = str_field(o, name, ID_MAX_BYTES)?;
    if !s
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    {
        return Err(WireError::bad(format!(
            "field `{name}` may only hold A-Z a-z 0-9 . _ -"
        )));
    }
    Ok(s)
}

/// PostgreSQL text cannot hold NUL: refuse it as bad input, not as an internal error.
fn no_nul(name: &str, s: String) -> Result<String, WireError> {
    if s.contains('\0') {
        return Err(WireError::bad(format!(
            "field `{name}` must not contain NUL"
        )));
    }
    Ok(s)
}

fn int_field(o: &Map<String, Value>, name: &str) -> Result<Option<i64>, WireError> {
    match o.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n
            .as_i64()
            .map(Some)
            .ok_or_else(|| WireError::bad(format!("field `{name}` must be an integer"))),
        Some(_) => Err(WireError::bad(format!("field `{name}` must be an integer"))),
    }
}

fn req_int(o: &Map<String, Value>, name: &str) -> Result<i64, WireError> {
    int_field(o, name)?.ok_or_else(|| WireError::bad(format!("missing field `{name}`")))
}

/// Parses one text frame. The body of a `send` is checked against `body_max_bytes` here so
/// an oversize body is refused before any database work.
pub fn parse(text: &str, body_max_bytes: usize) -> Inbound {
    let v: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(_) => {
            return Inbound {
                rid: None,
                req: Err(WireError::bad("frame is not valid JSON")),
            }
        }
    };
    let Value::Object(o) = v else {
        return Inbound {
            rid: None,
            req: Err(WireError::bad("frame must be a JSON object")),
        };
    };
    let rid = match o.get("rid") {
        None => None,
        Some(Value::String(s)) if !s.is_empty() && s.len() <= RID_MAX_BYTES => Some(s.clone()),
        Some(_) => {
            return Inbound {
                rid: None,
                req: Err(WireError::bad(format!(
                    "`rid` must be a non-empty string of at most {RID_MAX_BYTES} bytes"
                ))),
            }
        }
    };
    let req = parse_object(&o, rid.is_some(), body_max_bytes);
    Inbound { rid, req }
}

fn parse_object(
    o: &Map<String, Value>,
    has_rid: bool,
    body_max_bytes: usize,
) -> Result<Request, WireError> {
    let t = match o.get("t") {
        Some(Value::String(t)) => t.as_str(),
        Some(_) => return Err(WireError::bad("field `t` must be a string")),
        None => return Err(WireError::bad("missing field `t`")),
    };
    let known = matches!(t, "hello" | "send" | "ack" | "sub" | "sync");
    if !known {
        return Err(WireError::bad(format!(
            "unknown frame type {:?} (expected hello, send, ack, sub or sync)",
            t.chars().take(32).collect::<String>()
        )));
    }
    if !has_rid {
        return Err(WireError::bad("missing field `rid`"));
    }
    match t {
        "hello" => Ok(Request::Hello {
            device: id_field(o, "device")?,
            token: str_field(o, "token", TOKEN_MAX_BYTES)?,
            epoch: req_int(o, "epoch")?,
        }),
        "send" => {
            let conv = id_field(o, "conv")?;
            let cmid = no_nul("cmid", str_field(o, "cmid", CMID_MAX_BYTES)?)?;
            let body = match o.get("body") {
                Some(Value::String(s)) => no_nul("body", s.clone())?,
                Some(_) => return Err(WireError::bad("field `body` must be a string")),
                None => return Err(WireError::bad("missing field `body`")),
            };
            if body.len() > body_max_bytes {
                return Err(WireError::TooLarge(format!(
                    "body is longer than {body_max_bytes} bytes"
                )));
            }
            Ok(Request::Send { conv, cmid, body })
        }
        "ack" => {
            let conv = id_field(o, "conv")?;
            let seq = req_int(o, "seq")?;
            if seq < 0 {
                return Err(WireError::bad("`seq` must not be negative"));
            }
            Ok(Request::Ack { conv, seq })
        }
        "sub" => Ok(Request::Sub),
        "sync" => {
            let conv = id_field(o, "conv")?;
            let after = int_field(o, "after")?.unwrap_or(0);
            if after < 0 {
                return Err(WireError::bad("`after` must not be negative"));
            }
            let limit = int_field(o, "limit")?;
            if matches!(limit, Some(l) if l < 1) {
                return Err(WireError::bad("`limit` must be at least 1"));
            }
            Ok(Request::Sync { conv, after, limit })
        }
        _ => unreachable!("checked by `known` above"),
    }
}

/// One stored event as it travels in `event` pushes and `synced` pages. (`Deserialize` is
/// the client's reading of it, [`crate::client::ServerFrame`]; [`Event::to_json`] writes it.)
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Event {
    pub conv: String,
    pub seq: i64,
    pub kind: String,
    pub mid: String,
    pub sender: String,
    pub cmid: String,
    pub body: String,
    /// Commit-side timestamp, milliseconds since the Unix epoch.
    #[serde(rename = "at")]
    pub at_ms: i64,
    /// The conversation's sequence epoch when the gateway read the event (issue 21): it
    /// moves when the database may have lost history (a new lineage, migration 0006), and
    /// a device that sees it move discards what it holds of the conversation and syncs
    /// again.
    pub epoch: i64,
}

impl Event {
    /// The event as a JSON object (inside `event` pushes and `synced` pages; `store::sync`
    /// also measures pages with it).
    pub fn to_json(&self) -> Value {
        json!({
            "conv": self.conv, "seq": self.seq, "kind": self.kind, "mid": self.mid,
            "sender": self.sender, "cmid": self.cmid, "body": self.body, "at": self.at_ms,
            "epoch": self.epoch,
        })
    }
}

/// One conversation in a `subbed` reply.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ConvHead {
    pub conv: String,
    /// The user's visible head (SPEC: head = next_seq - 1, bounded by membership periods).
    pub head: i64,
    /// The device's cursor (`delivered_seq`, 0 without a row).
    pub delivered: i64,
    /// The conversation's sequence epoch (see [`Event::epoch`]).
    pub epoch: i64,
}

/// A reply to one request (SPEC 2), typed until [`render`] turns it into JSON.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Welcome {
        user: String,
        device: String,
        epoch: i64,
    },
    Sent {
        conv: String,
        seq: i64,
        mid: String,
        dup: bool,
        /// The conversation's sequence epoch.
        epoch: i64,
    },
    Acked {
        conv: String,
        /// The merged cursor (GREATEST), not the request's value.
        delivered: i64,
    },
    Subbed {
        convs: Vec<ConvHead>,
        /// How many times the database's lineage moved (`db_lineage.moves`, issue 21):
        /// each move moved every conversation's epoch by one, so a device that holds a
        /// conversation this reply does not list (its user's membership went with the old
        /// lineage) learns that its epoch moved too, and by how much.
        lineage: i64,
    },
    Synced {
        conv: String,
        events: Vec<Event>,
        head: i64,
        complete: bool,
    },
    Error(WireError),
}

/// Why a `hint` is sent (its `why` field).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HintWhy {
    /// The sweep found the device's cursor below the head (D5).
    Sweep,
    /// Pushes were not queued while the connection's queue was full.
    Overflow,
    /// SPEC 2 names it for a client to act on; this gateway does not send it.
    Resync,
}

impl HintWhy {
    pub fn as_str(self) -> &'static str {
        match self {
            HintWhy::Sweep => "sweep",
            HintWhy::Overflow => "overflow",
            HintWhy::Resync => "resync",
        }
    }
}

/// A frame the server sends unasked (SPEC 2). Borrowed: a push is rendered at once, once
/// per event, never stored typed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Push<'a> {
    Event(&'a Event),
    Hint {
        conv: &'a str,
        head: i64,
        why: HintWhy,
    },
}

/// Every outbound frame: a reply (with the request's `rid`, when it had a valid one) or a
/// push.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Frame<'a> {
    Reply {
        rid: Option<&'a str>,
        reply: &'a Reply,
    },
    Push(Push<'a>),
}

/// What a frame is, read off its variant: what the writer decides by (which fault point
/// applies, what an `error` action does, what a revoked install still gets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Welcome,
    Sent,
    Acked,
    Subbed,
    Synced,
    Error,
    Event,
    Hint,
}

impl Frame<'_> {
    pub fn kind(&self) -> Kind {
        match self {
            Frame::Reply { reply, .. } => match reply {
                Reply::Welcome { .. } => Kind::Welcome,
                Reply::Sent { .. } => Kind::Sent,
                Reply::Acked { .. } => Kind::Acked,
                Reply::Subbed { .. } => Kind::Subbed,
                Reply::Synced { .. } => Kind::Synced,
                Reply::Error(_) => Kind::Error,
            },
            Frame::Push(Push::Event(_)) => Kind::Event,
            Frame::Push(Push::Hint { .. }) => Kind::Hint,
        }
    }
}

/// Renders an outbound frame as the JSON text that goes on the wire: the one place frames
/// become JSON. (The object's keys come out sorted, as `serde_json` orders them.)
pub fn render(frame: &Frame) -> String {
    let (rid, mut v) = match *frame {
        Frame::Reply { rid, reply } => {
            let v = match reply {
                Reply::Welcome {
                    user,
                    device,
                    epoch,
                } => json!({"t": "welcome", "user": user, "device": device, "epoch": epoch}),
                Reply::Sent {
                    conv,
                    seq,
                    mid,
                    dup,
                    epoch,
                } => json!({"t": "sent", "conv": conv, "seq": seq, "mid": mid,
                            "dup": dup, "epoch": epoch}),
                Reply::Acked { conv, delivered } => {
                    json!({"t": "acked", "conv": conv, "delivered": delivered})
                }
                Reply::Subbed { convs, lineage } => {
                    let convs: Vec<_> = convs
                        .iter()
                        .map(|c| {
                            json!({"conv": c.conv, "head": c.head, "delivered": c.delivered,
                                   "epoch": c.epoch})
                        })
                        .collect();
                    json!({"t": "subbed", "convs": convs, "lineage": lineage})
                }
                Reply::Synced {
                    conv,
                    events,
                    head,
                    complete,
                } => {
                    let events: Vec<_> = events.iter().map(Event::to_json).collect();
                    json!({"t": "synced", "conv": conv, "events": events, "head": head,
                           "complete": complete})
                }
                Reply::Error(e) => json!({"t": "error", "code": e.code(), "msg": e.to_string()}),
            };
            (rid, v)
        }
        Frame::Push(Push::Event(ev)) => (None, json!({"t": "event", "ev": ev.to_json()})),
        Frame::Push(Push::Hint { conv, head, why }) => (
            None,
            json!({"t": "hint", "conv": conv, "head": head, "why": why.as_str()}),
        ),
    };
    if let Some(rid) = rid {
        v["rid"] = json!(rid);
    }
    v.to_string()
}

/// A reply to `rid`, rendered.
pub fn reply_frame(rid: Option<&str>, reply: &Reply) -> String {
    render(&Frame::Reply { rid, reply })
}

/// An `event` push, rendered (fan-out renders it once per event, not once per recipient).
pub fn event_frame(ev: &Event) -> String {
    render(&Frame::Push(Push::Event(ev)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(text: &str) -> (Option<String>, &'static str) {
        let i = parse(text, 10);
        (i.rid, i.req.err().map(|e| e.code()).unwrap_or("OK"))
    }

    #[test]
    fn malformed_frames_are_bad_request_never_panic() {
        assert_eq!(code("not json"), (None, "BAD_REQUEST"));
        assert_eq!(code("[1,2]"), (None, "BAD_REQUEST"));
        assert_eq!(
            code(r#"{"t":"nope","rid":"1"}"#),
            (Some("1".into()), "BAD_REQUEST")
        );
        assert_eq!(code(r#"{"t":5,"rid":"1"}"#).1, "BAD_REQUEST");
        assert_eq!(
            code(r#"{"t":"ack","rid":"1","conv":"c","seq":"x"}"#).1,
            "BAD_REQUEST"
        );
        assert_eq!(
            code(r#"{"t":"ack","rid":"1","conv":"c","seq":-1}"#).1,
            "BAD_REQUEST"
        );
        assert_eq!(
            code(r#"{"t":"ack","rid":"1","conv":"c","seq":1.5}"#).1,
            "BAD_REQUEST"
        );
        assert_eq!(
            code(r#"{"t":"send","rid":"1","conv":"c","cmid":"m"}"#).1,
            "BAD_REQUEST"
        );
        assert_eq!(
            code(&format!(r#"{{"t":"sub","rid":"{}"}}"#, "r".repeat(65))),
            (None, "BAD_REQUEST")
        );
        assert_eq!(
            code(r#"{"t":"sync","rid":"1","conv":"c","limit":0}"#).1,
            "BAD_REQUEST"
        );
        for bad in [
            r#"{"t":"sync","rid":"1","conv":"bad id!"}"#,
            r#"{"t":"send","rid":"1","conv":"c","cmid":"a\u0000b","body":"x"}"#,
            r#"{"t":"send","rid":"1","conv":"c","cmid":"m","body":"\u0000"}"#,
            r#"{"t":"hello","rid":"1","device":"d/1","token":"t","epoch":1}"#,
        ] {
            assert_eq!(code(bad).1, "BAD_REQUEST", "{bad}");
        }
    }

    #[test]
    fn oversize_body_is_too_large() {
        let (_, c) = code(r#"{"t":"send","rid":"1","conv":"c","cmid":"m","body":"12345678901"}"#);
        assert_eq!(c, "TOO_LARGE");
        let (_, c) = code(r#"{"t":"send","rid":"1","conv":"c","cmid":"m","body":"1234567890"}"#);
        assert_eq!(c, "OK");
    }

    fn ev(seq: i64) -> Event {
        Event {
            conv: "c1".into(),
            seq,
            kind: "msg".into(),
            mid: "m-1".into(),
            sender: "alice".into(),
            cmid: "k\"1".into(),
            body: "hé \n \u{1}".into(),
            at_ms: 1_700_000_000_123,
            epoch: 1,
        }
    }

    /// The wire format is byte-for-byte what the gateway wrote before frames were typed
    /// (the untyped `json!` shapes, kept here as the reference; keys sorted), rid or not.
    #[test]
    fn rendering_is_the_wire_format() {
        let e = ev(3);
        let sent = Reply::Sent {
            conv: "c1".into(),
            seq: 3,
            mid: "m-1".into(),
            dup: true,
            epoch: 1,
        };
        assert_eq!(
            reply_frame(Some("r\"1"), &sent),
            r#"{"conv":"c1","dup":true,"epoch":1,"mid":"m-1","rid":"r\"1","seq":3,"t":"sent"}"#
        );
        let with_rid = |mut v: Value, rid: Option<&str>| {
            if let Some(rid) = rid {
                v["rid"] = json!(rid);
            }
            v.to_string()
        };
        let cases: Vec<(Reply, Value)> = vec![
            (
                Reply::Welcome {
                    user: "alice".into(),
                    device: "a1".into(),
                    epoch: 2,
                },
                json!({"t": "welcome", "user": "alice", "device": "a1", "epoch": 2}),
            ),
            (
                sent,
                json!({"t": "sent", "conv": "c1", "seq": 3, "mid": "m-1", "dup": true, "epoch": 1}),
            ),
            (
                Reply::Acked {
                    conv: "c1".into(),
                    delivered: 7,
                },
                json!({"t": "acked", "conv": "c1", "delivered": 7}),
            ),
            (
                Reply::Subbed {
                    convs: vec![ConvHead {
                        conv: "c1".into(),
                        head: 4,
                        delivered: 2,
                        epoch: 1,
                    }],
                    lineage: 0,
                },
                json!({"t": "subbed", "convs": [{"conv": "c1", "head": 4, "delivered": 2, "epoch": 1}],
                       "lineage": 0}),
            ),
            (
                Reply::Subbed {
                    convs: vec![],
                    lineage: 2,
                },
                json!({"t": "subbed", "convs": [], "lineage": 2}),
            ),
            (
                Reply::Synced {
                    conv: "c1".into(),
                    events: vec![e.clone(), ev(4)],
                    head: 9,
                    complete: false,
                },
                json!({"t": "synced", "conv": "c1", "events": [e.to_json(), ev(4).to_json()],
                       "head": 9, "complete": false}),
            ),
            (
                Reply::Error(WireError::CursorAhead { head: 5 }),
                json!({"t": "error", "code": "CURSOR_AHEAD",
                       "msg": "ack beyond the conversation head (5)"}),
            ),
        ];
        for (reply, old) in &cases {
            for rid in [None, Some("rid-1")] {
                assert_eq!(reply_frame(rid, reply), with_rid(old.clone(), rid));
            }
        }
        assert_eq!(
            event_frame(&e),
            json!({"t": "event", "ev": e.to_json()}).to_string()
        );
        assert_eq!(
            event_frame(&e),
            r#"{"ev":{"at":1700000000123,"body":"hé \n \u0001","cmid":"k\"1","conv":"c1","epoch":1,"kind":"msg","mid":"m-1","sender":"alice","seq":3},"t":"event"}"#
        );
        for why in [HintWhy::Sweep, HintWhy::Overflow] {
            let hint = Frame::Push(Push::Hint {
                conv: "c1",
                head: 6,
                why,
            });
            assert_eq!(
                render(&hint),
                json!({"t": "hint", "conv": "c1", "head": 6, "why": why.as_str()}).to_string()
            );
        }
        assert_eq!(
            render(&Frame::Push(Push::Hint {
                conv: "c1",
                head: 6,
                why: HintWhy::Overflow
            })),
            r#"{"conv":"c1","head":6,"t":"hint","why":"overflow"}"#
        );
    }

    /// The writer decides by the variant: each reply and push has its own kind.
    #[test]
    fn kinds_follow_the_variant() {
        let e = ev(1);
        let kind = |reply: &Reply| Frame::Reply { rid: None, reply }.kind();
        assert_eq!(kind(&Reply::Error(WireError::Unavailable)), Kind::Error);
        assert_eq!(
            kind(&Reply::Acked {
                conv: "c".into(),
                delivered: 1
            }),
            Kind::Acked
        );
        assert_eq!(Frame::Push(Push::Event(&e)).kind(), Kind::Event);
    }

    #[test]
    fn well_formed_requests_parse() {
        let i = parse(r#"{"t":"sync","rid":"r","conv":"c","after":3}"#, 10);
        assert_eq!(
            i.req.unwrap(),
            Request::Sync {
                conv: "c".into(),
                after: 3,
                limit: None
            }
        );
    }
}
