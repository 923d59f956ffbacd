//! The client's side of the wire contract of SPEC 2: a typed [`Request`] rendered to the
//! frame text a client sends (with its `rid`), and a server frame's text parsed into a typed
//! [`ServerFrame`] (a reply with its `rid`, or a push). The inverse of the gateway's side in
//! [`crate::wire`]: whatever [`crate::wire::render`] writes, [`ServerFrame::parse`] reads back
//! equal, and whatever [`Request::to_frame`] writes, [`crate::wire::parse`] reads back equal.
//!
//! Must not: validate a request against the limits (the gateway does; a test may send what
//! it refuses), or do I/O. A frame the types cannot express (a hostile test's) is built as
//! JSON by the caller, not here.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::WireError;
use crate::wire::{ConvHead, Event, Frame, HintWhy, Kind, Push, Reply, Request};

impl Request {
    /// The frame's type, its `t` field.
    pub fn t(&self) -> &'static str {
        match self {
            Request::Hello { .. } => "hello",
            Request::Send { .. } => "send",
            Request::Ack { .. } => "ack",
            Request::Sub => "sub",
            Request::Sync { .. } => "sync",
        }
    }

    /// The request as the JSON object a client sends, with `rid`. A `sync` without a
    /// `limit` leaves the field out (the gateway's default applies).
    pub fn to_json(&self, rid: &str) -> Value {
        let mut v = match self {
            Request::Hello {
                device,
                token,
                epoch,
            } => json!({"t": "hello", "device": device, "token": token, "epoch": epoch}),
            Request::Send { conv, cmid, body } => {
                json!({"t": "send", "conv": conv, "cmid": cmid, "body": body})
            }
            Request::Ack { conv, seq } => json!({"t": "ack", "conv": conv, "seq": seq}),
            Request::Sub => json!({"t": "sub"}),
            Request::Sync { conv, after, limit } => {
                let mut v = json!({"t": "sync", "conv": conv, "after": after});
                if let Some(limit) = limit {
                    v["limit"] = json!(limit);
                }
                v
            }
        };
        v["rid"] = json!(rid);
        v
    }

    /// The request as the text of one frame (keys sorted, as `serde_json` orders them).
    pub fn to_frame(&self, rid: &str) -> String {
        self.to_json(rid).to_string()
    }
}

/// One frame from the server, typed: a reply (with the `rid` it echoes, when the request
/// had a valid one) or a push.
#[derive(Debug, Clone, PartialEq)]
pub enum ServerFrame {
    Reply {
        rid: Option<String>,
        reply: Reply,
    },
    Event(Event),
    Hint {
        conv: String,
        head: i64,
        why: HintWhy,
    },
}

/// Why a server frame could not be read, naming the part that is malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Not JSON, not an object, or a field of the wrong type (serde_json's message, which
    /// says what it expected and where).
    #[error("malformed frame: {0}")]
    Json(String),
    #[error("missing field `t`")]
    MissingType,
    #[error("unknown frame type {0:?}")]
    UnknownType(String),
    #[error("`{t}` frame without field `{field}`")]
    Missing {
        t: &'static str,
        field: &'static str,
    },
    #[error("`{t}` frame with a bad `{field}`: {why}")]
    Invalid {
        t: &'static str,
        field: &'static str,
        why: String,
    },
}

/// Every field a server frame may carry, read in one pass; [`ServerFrame::parse`] then
/// checks that the frame's type has the fields it needs. Other fields are ignored.
#[derive(Deserialize)]
struct RawFrame<'a> {
    #[serde(borrow)]
    t: Option<Cow<'a, str>>,
    rid: Option<String>,
    user: Option<String>,
    device: Option<String>,
    epoch: Option<i64>,
    conv: Option<String>,
    seq: Option<i64>,
    mid: Option<String>,
    dup: Option<bool>,
    delivered: Option<i64>,
    convs: Option<Vec<ConvHead>>,
    lineage: Option<i64>,
    events: Option<Vec<Event>>,
    head: Option<i64>,
    complete: Option<bool>,
    code: Option<String>,
    msg: Option<String>,
    ev: Option<Event>,
    why: Option<String>,
}

fn need<T>(v: Option<T>, t: &'static str, field: &'static str) -> Result<T, FrameError> {
    v.ok_or(FrameError::Missing { t, field })
}

impl ServerFrame {
    /// Parses the text of one server frame.
    pub fn parse(text: &str) -> Result<ServerFrame, FrameError> {
        let f: RawFrame =
            serde_json::from_str(text).map_err(|e| FrameError::Json(e.to_string()))?;
        let t = f.t.as_deref().ok_or(FrameError::MissingType)?;
        let reply = match t {
            "welcome" => Reply::Welcome {
                user: need(f.user, "welcome", "user")?,
                device: need(f.device, "welcome", "device")?,
                epoch: need(f.epoch, "welcome", "epoch")?,
            },
            "sent" => Reply::Sent {
                conv: need(f.conv, "sent", "conv")?,
                seq: need(f.seq, "sent", "seq")?,
                mid: need(f.mid, "sent", "mid")?,
                dup: need(f.dup, "sent", "dup")?,
                epoch: need(f.epoch, "sent", "epoch")?,
            },
            "acked" => Reply::Acked {
                conv: need(f.conv, "acked", "conv")?,
                delivered: need(f.delivered, "acked", "delivered")?,
            },
            "subbed" => Reply::Subbed {
                convs: need(f.convs, "subbed", "convs")?,
                lineage: need(f.lineage, "subbed", "lineage")?,
            },
            "synced" => Reply::Synced {
                conv: need(f.conv, "synced", "conv")?,
                events: need(f.events, "synced", "events")?,
                head: need(f.head, "synced", "head")?,
                complete: need(f.complete, "synced", "complete")?,
            },
            "error" => {
                let code = need(f.code, "error", "code")?;
                let msg = need(f.msg, "error", "msg")?;
                let e = WireError::from_wire(&code, &msg).map_err(|why| FrameError::Invalid {
                    t: "error",
                    field: "code",
                    why,
                })?;
                Reply::Error(e)
            }
            "event" => return Ok(ServerFrame::Event(need(f.ev, "event", "ev")?)),
            "hint" => {
                let why = match need(f.why, "hint", "why")?.as_str() {
                    "sweep" => HintWhy::Sweep,
                    "overflow" => HintWhy::Overflow,
                    "resync" => HintWhy::Resync,
                    other => {
                        return Err(FrameError::Invalid {
                            t: "hint",
                            field: "why",
                            why: format!(
                                "{:?} is none of sweep, overflow, resync",
                                other.chars().take(32).collect::<String>()
                            ),
                        })
                    }
                };
                return Ok(ServerFrame::Hint {
                    conv: need(f.conv, "hint", "conv")?,
                    head: need(f.head, "hint", "head")?,
                    why,
                });
            }
            other => {
                return Err(FrameError::UnknownType(
                    other.chars().take(32).collect::<String>(),
                ))
            }
        };
        Ok(ServerFrame::Reply { rid: f.rid, reply })
    }

    /// The `rid` a reply echoes (`None` for a push and a reply to a frame without one).
    pub fn rid(&self) -> Option<&str> {
        match self {
            ServerFrame::Reply { rid, .. } => rid.as_deref(),
            ServerFrame::Event(_) | ServerFrame::Hint { .. } => None,
        }
    }

    /// The frame as the gateway's [`Frame`], borrowed: what [`crate::wire::render`] takes.
    pub fn as_frame(&self) -> Frame<'_> {
        match self {
            ServerFrame::Reply { rid, reply } => Frame::Reply {
                rid: rid.as_deref(),
                reply,
            },
            ServerFrame::Event(ev) => Frame::Push(Push::Event(ev)),
            ServerFrame::Hint { conv, head, why } => Frame::Push(Push::Hint {
                conv,
                head: *head,
                why: *why,
            }),
        }
    }

    pub fn kind(&self) -> Kind {
        self.as_frame().kind()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{parse, render, reply_frame};

    fn ev(seq: i64, body: &str) -> Event {
        Event {
            conv: "c1".into(),
            seq,
            kind: "msg".into(),
            mid: "m-1".into(),
            sender: "alice".into(),
            cmid: "k\"1".into(),
            body: body.into(),
            at_ms: 1_700_000_000_123,
            epoch: 1,
        }
    }

    /// One of every reply, every error variant included.
    fn replies() -> Vec<Reply> {
        let mut out = vec![
            Reply::Welcome {
                user: "alice".into(),
                device: "a1".into(),
                epoch: 2,
            },
            Reply::Sent {
                conv: "c1".into(),
                seq: 3,
                mid: "m-1".into(),
                dup: true,
                epoch: 1,
            },
            Reply::Acked {
                conv: "c1".into(),
                delivered: 7,
            },
            Reply::Subbed {
                convs: vec![],
                lineage: 0,
            },
            Reply::Subbed {
                convs: vec![ConvHead {
                    conv: "c1".into(),
                    head: 4,
                    delivered: 2,
                    epoch: 1,
                }],
                lineage: 1,
            },
            Reply::Synced {
                conv: "c1".into(),
                events: vec![ev(4, "hé \n \u{1}"), ev(5, "")],
                head: 9,
                complete: false,
            },
        ];
        for e in [
            WireError::bad("missing field `t`"),
            WireError::Unauthenticated("say hello first".into()),
            WireError::StaleInstall,
            WireError::NotMember,
            WireError::CursorAhead { head: 5 },
            WireError::CursorAhead { head: -1 },
            WireError::CmidConflict,
            WireError::TooLarge("body is longer than 10 bytes".into()),
            WireError::Unavailable,
            WireError::hello_throttled(),
            WireError::Internal,
        ] {
            out.push(Reply::Error(e));
        }
        out
    }

    /// Proves the client reads what the gateway writes: every reply (with a rid and
    /// without) and every push, rendered by `render`, parses back equal, and renders again
    /// to the same bytes.
    #[test]
    fn every_rendered_server_frame_parses_back_equal() {
        for reply in replies() {
            for rid in [None, Some("r\"1")] {
                let text = reply_frame(rid, &reply);
                let back = ServerFrame::parse(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
                assert_eq!(
                    back,
                    ServerFrame::Reply {
                        rid: rid.map(str::to_string),
                        reply: reply.clone()
                    },
                    "{text}"
                );
                assert_eq!(back.rid(), rid);
                assert_eq!(render(&back.as_frame()), text);
            }
        }
        let e = ev(3, "x");
        let text = render(&Frame::Push(Push::Event(&e)));
        assert_eq!(ServerFrame::parse(&text), Ok(ServerFrame::Event(e)));
        for why in [HintWhy::Sweep, HintWhy::Overflow, HintWhy::Resync] {
            let text = render(&Frame::Push(Push::Hint {
                conv: "c1",
                head: 6,
                why,
            }));
            let back = ServerFrame::parse(&text).unwrap();
            assert_eq!(
                back,
                ServerFrame::Hint {
                    conv: "c1".into(),
                    head: 6,
                    why
                }
            );
            assert_eq!(back.kind(), Kind::Hint);
            assert_eq!(render(&back.as_frame()), text);
        }
    }

    /// Proves the gateway reads what the client writes: every request rendered with a
    /// rid parses back equal (with that rid) through the gateway's `parse`.
    #[test]
    fn every_rendered_request_parses_back_equal() {
        let requests = [
            Request::Hello {
                device: "d1".into(),
                token: "t\"ok".into(),
                epoch: 3,
            },
            Request::Send {
                conv: "c1".into(),
                cmid: "m-1".into(),
                body: "hé \n \u{1}".into(),
            },
            Request::Send {
                conv: "c1".into(),
                cmid: "m-2".into(),
                body: String::new(),
            },
            Request::Ack {
                conv: "c1".into(),
                seq: 0,
            },
            Request::Sub,
            Request::Sync {
                conv: "c1".into(),
                after: 4,
                limit: Some(500),
            },
            Request::Sync {
                conv: "c1".into(),
                after: 0,
                limit: None,
            },
        ];
        for req in requests {
            let text = req.to_frame("r-1");
            let back = parse(&text, 1024);
            assert_eq!(back.rid.as_deref(), Some("r-1"), "{text}");
            assert_eq!(back.req, Ok(req.clone()), "{text}");
            assert_eq!(req.to_json("r-1")["t"], req.t());
        }
    }

    /// The frames the harness client and the bench wrote with `json!` before requests were
    /// typed, byte for byte.
    #[test]
    fn requests_render_as_before() {
        let send = Request::Send {
            conv: "c".into(),
            cmid: "m".into(),
            body: "b".into(),
        };
        assert_eq!(
            send.to_frame("c2"),
            r#"{"body":"b","cmid":"m","conv":"c","rid":"c2","t":"send"}"#
        );
        let sync = Request::Sync {
            conv: "c".into(),
            after: 3,
            limit: Some(100),
        };
        assert_eq!(
            sync.to_frame("c3"),
            json!({"t": "sync", "conv": "c", "after": 3, "limit": 100, "rid": "c3"}).to_string()
        );
        assert_eq!(Request::Sub.to_frame("c4"), r#"{"rid":"c4","t":"sub"}"#);
    }

    /// A malformed server frame is an error that names the malformed part, never a panic.
    #[test]
    fn malformed_server_frames_name_what_is_wrong() {
        let err = |text: &str| ServerFrame::parse(text).unwrap_err().to_string();
        assert!(err("not json").contains("malformed frame"));
        assert!(err("[1]").contains("malformed frame"));
        assert_eq!(err(r#"{"rid":"1"}"#), "missing field `t`");
        assert!(err(r#"{"t":"nope"}"#).contains("\"nope\""));
        assert_eq!(
            err(r#"{"t":"sent","rid":"1","conv":"c","seq":1,"mid":"m","epoch":1}"#),
            "`sent` frame without field `dup`"
        );
        assert!(err(r#"{"t":"acked","conv":"c","delivered":"x"}"#).contains("expected i64"));
        assert!(err(r#"{"t":"event","ev":{"conv":"c","seq":1}}"#).contains("missing field"));
        assert!(err(r#"{"t":"hint","conv":"c","head":1,"why":"nap"}"#).contains("`why`"));
        assert!(err(r#"{"t":"error","code":"OOPS","msg":"x"}"#).contains("OOPS"));
        assert!(err(r#"{"t":"error","code":"CURSOR_AHEAD","msg":"x"}"#).contains("head"));
    }
}
