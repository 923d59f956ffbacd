//! Wire types of SPEC 2 only: parsing inbound frames into [`Request`] and rendering outbound
//! frames. No I/O, no SQL, no state. Every malformed input is a [`WireError::BadRequest`],
//! never a panic.

use crate::error::WireError;
use serde_json::{json, Map, Value};

/// Longest `rid` a client may send (SPEC 2).
pub const RID_MAX_BYTES: usize = 64;
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
            token: str_field(o, "token", 256)?,
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

/// One stored event as it travels in `event` pushes and `synced` pages.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub conv: String,
    pub seq: i64,
    pub kind: String,
    pub mid: String,
    pub sender: String,
    pub cmid: String,
    pub body: String,
    /// Commit-side timestamp, milliseconds since the Unix epoch.
    pub at_ms: i64,
}

impl Event {
    pub fn to_json(&self) -> Value {
        json!({
            "conv": self.conv, "seq": self.seq, "kind": self.kind, "mid": self.mid,
            "sender": self.sender, "cmid": self.cmid, "body": self.body, "at": self.at_ms,
        })
    }
}

pub fn error_frame(rid: Option<&str>, e: &WireError) -> String {
    let mut o = json!({"t": "error", "code": e.code(), "msg": e.to_string()});
    if let Some(rid) = rid {
        o["rid"] = json!(rid);
    }
    o.to_string()
}

pub fn event_frame(ev: &Event) -> String {
    json!({"t": "event", "ev": ev.to_json()}).to_string()
}

pub fn hint_frame(conv: &str, head: i64, why: &str) -> String {
    json!({"t": "hint", "conv": conv, "head": head, "why": why}).to_string()
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
