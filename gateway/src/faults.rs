//! Named fault points and the `IM_FAULT` parser (SPEC 4). Owns the validation of a spec and
//! what each action does when a point fires; the list of points and actions is the protocol
//! crate's ([`im_protocol::fault`]), so the harness arms the same names. It never decides
//! *where* a point is: the call sites in `store`, `conn` and `server` do, by name.
//!
//! Points are evaluated through the `fail` crate, compiled in only with the `faults`
//! feature. Without it [`gate`] is a no-op and [`install`] refuses a non-empty spec.
//! Every action is non-blocking: `delay` is an async sleep done by the caller, `halt`
//! is `_exit(137)`; the crate's own `sleep`/`pause`/`panic` actions are never used.

use std::ops::ControlFlow;

/// Every fault point, by the name `IM_FAULT` uses. Listed once, in the protocol crate
/// ([`FaultPoint`], whose variants say what each point stops); these names derive from it.
pub mod points {
    use im_protocol::FaultPoint;

    pub const SEND_BEFORE_INSERT: &str = FaultPoint::SendBeforeInsert.name();
    pub const SEND_BEFORE_COMMIT: &str = FaultPoint::SendBeforeCommit.name();
    pub const SEND_BATCH_BEFORE_COMMIT: &str = FaultPoint::SendBatchBeforeCommit.name();
    pub const SEND_BATCH_AFTER_COMMIT: &str = FaultPoint::SendBatchAfterCommit.name();
    pub const SEND_AFTER_COMMIT_BEFORE_NOTIFY: &str =
        FaultPoint::SendAfterCommitBeforeNotify.name();
    pub const API_AFTER_SEND_COMMIT: &str = FaultPoint::ApiAfterSendCommit.name();
    pub const GW_REPLY_SEND: &str = FaultPoint::GwReplySend.name();
    pub const GW_REPLY_ACK: &str = FaultPoint::GwReplyAck.name();
    pub const GW_PUSH: &str = FaultPoint::GwPush.name();
    pub const GW_RECV_ACK: &str = FaultPoint::GwRecvAck.name();
    pub const FANOUT_NOTIFY: &str = FaultPoint::FanoutNotify.name();
    pub const FANOUT_READ: &str = FaultPoint::FanoutRead.name();
    pub const FANOUT_LISTEN: &str = FaultPoint::FanoutListen.name();
    pub const FANOUT_FEED: &str = FaultPoint::FanoutFeed.name();

    /// Every name, in the order of [`FaultPoint::ALL`].
    pub const ALL: &[&str] = &FaultPoint::NAMES;
}

/// `im-gateway faults`: every point with what happens there and where it sits in the code,
/// in the order of [`points::ALL`].
pub const POINT_DOCS: &[(&str, &str, &str)] = &[
    (
        points::SEND_BEFORE_INSERT,
        "store::send (send transaction); batch (per row, before the batch)",
        "after the seq was taken, before the INSERT",
    ),
    (
        points::SEND_BEFORE_COMMIT,
        "store::send (send transaction); batch (per inserted row, in the batch's transaction)",
        "after the INSERT, before COMMIT",
    ),
    (
        points::SEND_BATCH_BEFORE_COMMIT,
        "store::send_batch (group commit)",
        "after a batch's rows were inserted, before its COMMIT (drop: rolled back, no replies; error: each row sent again alone)",
    ),
    (
        points::SEND_BATCH_AFTER_COMMIT,
        "batch::send_batch (group commit)",
        "after a batch's COMMIT returned, before its rows are answered and notified",
    ),
    (
        points::SEND_AFTER_COMMIT_BEFORE_NOTIFY,
        "store::send (after the send transaction)",
        "after COMMIT returned, before the notifier is told (drop/error: no notification, the reply still goes)",
    ),
    (
        points::API_AFTER_SEND_COMMIT,
        "conn (request handler)",
        "after COMMIT returned, before the `sent` reply is queued",
    ),
    (
        points::GW_REPLY_SEND,
        "conn (connection writer)",
        "the `sent` frame, as it is about to be written",
    ),
    (
        points::GW_REPLY_ACK,
        "conn (connection writer)",
        "the `acked` frame, as it is about to be written",
    ),
    (
        points::GW_PUSH,
        "conn (connection writer)",
        "an `event` push, as it is about to be written (hints are not pushes)",
    ),
    (
        points::GW_RECV_ACK,
        "conn (connection reader)",
        "an inbound `ack`, as it is read, before it reaches the database",
    ),
    (
        points::FANOUT_NOTIFY,
        "fanout::notify_loop (the notifier)",
        "the NOTIFY of a batch of commits and its local hand-off, about to be sent (drop: not sent; error: fails)",
    ),
    (
        points::FANOUT_READ,
        "fanout (delivery task)",
        "a fan-out read of notified events, about to run (drop/error: it fails)",
    ),
    (
        points::FANOUT_LISTEN,
        "fanout::run (LISTEN loop)",
        "an attempt to regain the lost LISTEN connection (drop/error: it fails)",
    ),
    (
        points::FANOUT_FEED,
        "fanout::feed (the commit feed)",
        "a look of the commit feed, about to run (drop/error: skipped, the next asks again)",
    ),
];

/// `im-gateway faults`: every action of `IM_FAULT` and what it does.
pub const ACTION_DOCS: &[(&str, &str)] = &[
    (
        "halt",
        "end the process at once, exit status 137 (no destructors, no flush, no close frame)",
    ),
    (
        "drop",
        "discard the frame (at a transaction point: roll back, no reply at all)",
    ),
    (
        "delay(MS)",
        "sleep MS milliseconds (async, at most 600000), then go on",
    ),
    (
        "error",
        "fail the operation with UNAVAILABLE (at gw.push: the push is dropped)",
    ),
];

/// The `IM_FAULT` syntax, as `im-gateway faults` and the parser's errors show it.
pub const SYNTAX: &str = "point:action[:skip[:count]][,...]";

/// What a point does when it fires: the protocol crate's, shared with whoever arms it.
pub use im_protocol::Action;

/// One `point:action[:skip[:count]]` of `IM_FAULT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultSpec {
    pub point: &'static str,
    pub action: Action,
    /// Hits that pass before the action first fires.
    pub skip: u64,
    /// How many times it fires; `None`: every hit after the skipped ones.
    pub count: Option<u64>,
}

fn valid_points() -> String {
    points::ALL.join(", ")
}

fn parse_action(s: &str) -> Result<Action, String> {
    s.parse()
}

/// Parses and validates a whole `IM_FAULT` value. The error names the bad part and lists the
/// valid points and actions.
pub fn parse(spec: &str) -> Result<Vec<FaultSpec>, String> {
    parse_specs(spec).map_err(|e| {
        format!(
            "IM_FAULT: {e}\n  syntax: point:action[:skip[:count]][,...]\n  valid points: {}\n  \
             valid actions: halt, drop, delay(MS), error",
            valid_points()
        )
    })
}

fn parse_specs(spec: &str) -> Result<Vec<FaultSpec>, String> {
    let mut out: Vec<FaultSpec> = Vec::new();
    if spec.trim().is_empty() {
        return Ok(out);
    }
    for part in spec.split(',') {
        let part = part.trim();
        let fields: Vec<&str> = part.split(':').collect();
        if part.is_empty() || fields.len() < 2 || fields.len() > 4 {
            return Err(format!(
                "malformed spec {part:?}: expected point:action[:skip[:count]]"
            ));
        }
        let point = fields[0]
            .parse::<im_protocol::FaultPoint>()
            .map_err(|e| format!("{e} in {part:?}"))?
            .name();
        let action = parse_action(fields[1]).map_err(|e| format!("{e} in {part:?}"))?;
        let number = |i: usize, what: &str| -> Result<Option<u64>, String> {
            fields
                .get(i)
                .map(|s| {
                    s.parse::<u64>()
                        .map_err(|_| format!("{what} {s:?} in {part:?} is not a whole number"))
                })
                .transpose()
        };
        let skip = number(2, "skip")?.unwrap_or(0);
        let count = number(3, "count")?;
        if count == Some(0) {
            return Err(format!("count 0 in {part:?} would never fire"));
        }
        if out.iter().any(|s| s.point == point) {
            return Err(format!("point {point} is given twice"));
        }
        out.push(FaultSpec {
            point,
            action,
            skip,
            count,
        });
    }
    Ok(out)
}

/// Whether this binary has fault points compiled in.
pub const ENABLED: bool = cfg!(feature = "faults");

/// Validates `IM_FAULT` and arms the points. Refuses a non-empty spec when the binary was
/// built without the `faults` feature.
pub fn install(spec: &str) -> Result<Vec<FaultSpec>, String> {
    let specs = parse(spec)?;
    if !specs.is_empty() && !ENABLED {
        return Err(
            "IM_FAULT is set but this im-gateway was built without fault points \
             (build with `--features faults`, as `make build` does)"
                .to_string(),
        );
    }
    #[cfg(feature = "faults")]
    for s in &specs {
        imp::arm(s)?;
    }
    Ok(specs)
}

/// Arms the points of `spec` (IM_FAULT syntax) while the gateway runs (the control socket,
/// [`crate::fault_control`]): each named point replaces its previous arming and its hit
/// count starts again from 0, so `point:halt:N:1` fires on the N+1-th hit from now. Points
/// not named keep what they had. Refused without the `faults` feature.
pub fn arm(spec: &str) -> Result<Vec<FaultSpec>, String> {
    let specs = parse(spec)?;
    if !ENABLED {
        return Err("this im-gateway was built without fault points".to_string());
    }
    #[cfg(feature = "faults")]
    for s in &specs {
        imp::arm(s)?;
    }
    Ok(specs)
}

/// Disarms `point` (a name of [`points::ALL`]), or every point for `None`.
pub fn disarm(point: Option<&str>) -> Result<(), String> {
    if let Some(p) = point {
        if !points::ALL.contains(&p) {
            return Err(format!(
                "unknown fault point {p:?}; valid points: {}",
                valid_points()
            ));
        }
    }
    #[cfg(feature = "faults")]
    imp::disarm(point);
    Ok(())
}

/// Every armed point with its spec and the hits counted since it was armed.
pub fn armed() -> Vec<(String, u64)> {
    #[cfg(feature = "faults")]
    return imp::armed();
    #[cfg(not(feature = "faults"))]
    Vec::new()
}

/// Whether `point` is armed (one atomic load; always false without the `faults` feature).
/// The connection writer flushes what it holds before an armed point acts on a frame, so
/// that a fault at frame n acts on frame n, never on the frames written before it.
pub fn is_armed(point: &'static str) -> bool {
    #[cfg(feature = "faults")]
    return imp::is_armed(point);
    #[cfg(not(feature = "faults"))]
    {
        let _ = point;
        false
    }
}

/// Passes the point `point`: `Continue` when nothing fired (or a `delay` elapsed, slept
/// here, async), else `Break` with the caller's value for the action that fired, `on_drop`
/// (discard the frame, abandon the request without a reply) or `on_error` (fail with
/// UNAVAILABLE). `halt` never returns. The one match every fault point goes through:
///
/// ```ignore
/// if let ControlFlow::Break(r) = faults::gate(points::SEND_BEFORE_COMMIT, Ok(NoReply), Err(Unavailable)).await {
///     return r;
/// }
/// ```
pub async fn gate<T>(point: &'static str, on_drop: T, on_error: T) -> ControlFlow<T> {
    match hit(point) {
        None => ControlFlow::Continue(()),
        Some(Action::Delay(ms)) => {
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
            ControlFlow::Continue(())
        }
        Some(Action::Drop) => ControlFlow::Break(on_drop),
        Some(Action::Error) => ControlFlow::Break(on_error),
        Some(Action::Halt) => unreachable!("hit() halts the process itself"),
    }
}

#[cfg(not(feature = "faults"))]
fn hit(_point: &'static str) -> Option<Action> {
    None
}

#[cfg(feature = "faults")]
fn hit(point: &'static str) -> Option<Action> {
    imp::hit(point)
}

#[cfg(feature = "faults")]
mod imp {
    use super::{parse_action, points, Action, FaultSpec};
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    /// Hits per point (index in `points::ALL`), counted only for armed points.
    static HITS: [AtomicU64; points::ALL.len()] = [const { AtomicU64::new(0) }; points::ALL.len()];
    /// Which points `IM_FAULT` armed: an unarmed point costs one atomic load.
    static ARMED: [AtomicBool; points::ALL.len()] =
        [const { AtomicBool::new(false) }; points::ALL.len()];

    pub(super) fn arm(s: &FaultSpec) -> Result<(), String> {
        // The action travels through `fail` as the argument of `return(..)`; `delay(MS)`
        // is encoded without parentheses so fail's own parser cannot misread it.
        let token = match s.action {
            Action::Delay(ms) => format!("delay={ms}"),
            a => a.to_string(),
        };
        let mut actions = Vec::new();
        if s.skip > 0 {
            actions.push(format!("{}*off", s.skip));
        }
        match s.count {
            Some(n) => actions.push(format!("{n}*return({token})")),
            None => actions.push(format!("return({token})")),
        }
        fail::cfg(s.point, &actions.join("->")).map_err(|e| format!("IM_FAULT: {e}"))?;
        if let Some(idx) = points::ALL.iter().position(|p| *p == s.point) {
            HITS[idx].store(0, Ordering::SeqCst);
            *SPECS[idx].lock().unwrap_or_else(|p| p.into_inner()) = Some(spec_text(s));
            ARMED[idx].store(true, Ordering::SeqCst);
        }
        Ok(())
    }

    fn spec_text(s: &FaultSpec) -> String {
        match s.count {
            Some(n) => format!("{}:{}:{}:{n}", s.point, s.action, s.skip),
            None => format!("{}:{}:{}", s.point, s.action, s.skip),
        }
    }

    /// What each point was armed with, for `armed()`.
    static SPECS: [std::sync::Mutex<Option<String>>; points::ALL.len()] =
        [const { std::sync::Mutex::new(None) }; points::ALL.len()];

    pub(super) fn disarm(point: Option<&str>) {
        for (idx, p) in points::ALL.iter().enumerate() {
            if point.is_none_or(|q| q == *p) {
                ARMED[idx].store(false, Ordering::SeqCst);
                fail::remove(p);
                *SPECS[idx].lock().unwrap_or_else(|p| p.into_inner()) = None;
            }
        }
    }

    pub(super) fn armed() -> Vec<(String, u64)> {
        points::ALL
            .iter()
            .enumerate()
            .filter(|(idx, _)| ARMED[*idx].load(Ordering::SeqCst))
            .filter_map(|(idx, _)| {
                let spec = SPECS[idx]
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone()?;
                Some((spec, HITS[idx].load(Ordering::SeqCst)))
            })
            .collect()
    }

    fn eval(point: &str) -> Option<String> {
        fail::fail_point!(point, |arg: Option<String>| arg);
        None
    }

    pub(super) fn is_armed(point: &'static str) -> bool {
        points::ALL
            .iter()
            .position(|p| *p == point)
            .is_some_and(|idx| ARMED[idx].load(Ordering::Relaxed))
    }

    pub(super) fn hit(point: &'static str) -> Option<Action> {
        let idx = points::ALL.iter().position(|p| *p == point)?;
        if !ARMED[idx].load(Ordering::Relaxed) {
            return None;
        }
        let n = HITS[idx].fetch_add(1, Ordering::SeqCst) + 1;
        let token = eval(point)?;
        let action = match token.strip_prefix("delay=") {
            Some(ms) => Action::Delay(ms.parse().ok()?),
            None => parse_action(&token).ok()?,
        };
        // One unbuffered line before acting (SPEC 4).
        let line = format!("fault fired: point={point} action={action} hit={n}\n");
        let mut err = std::io::stderr().lock();
        let _ = err.write_all(line.as_bytes());
        let _ = err.flush();
        if action == Action::Halt {
            // Like a crash: no destructors, no flushing of buffers, no WebSocket close. The
            // one `unsafe` of the gateway: neither `nix` (0.31) nor `rustix` wraps `_exit(2)`,
            // and std's `exit` flushes stdout and runs `atexit` handlers, `abort` is no 137.
            // SAFETY: `_exit` takes no pointers and does not return.
            unsafe { libc::_exit(137) };
        }
        Some(action)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_spec_syntax() {
        let s = parse("gw.reply.send:drop:0:1,gw.push:delay(25)").unwrap();
        assert_eq!(
            s,
            vec![
                FaultSpec {
                    point: points::GW_REPLY_SEND,
                    action: Action::Drop,
                    skip: 0,
                    count: Some(1)
                },
                FaultSpec {
                    point: points::GW_PUSH,
                    action: Action::Delay(25),
                    skip: 0,
                    count: None
                },
            ]
        );
        assert_eq!(parse("").unwrap(), vec![]);
    }

    /// A build without the `faults` feature has no fault points and refuses to pretend it
    /// has: a non-empty IM_FAULT is an error, an empty one is fine. (`make test` runs this
    /// module's tests in both builds.)
    #[cfg(not(feature = "faults"))]
    #[test]
    fn build_without_faults_refuses_a_spec() {
        let e = install("gw.push:drop").unwrap_err();
        assert!(e.contains("without fault points"), "{e}");
        assert!(install("").unwrap().is_empty());
    }

    #[test]
    fn rejects_typos_naming_the_bad_part() {
        let e = parse("send.before_comit:halt").unwrap_err();
        assert!(
            e.contains("send.before_comit") && e.contains("send.before_commit"),
            "{e}"
        );
        let e = parse("gw.push:explode").unwrap_err();
        assert!(e.contains("explode") && e.contains("delay(MS)"), "{e}");
        assert!(parse("gw.push").is_err());
        assert!(parse("gw.push:drop:x").is_err());
        assert!(parse("gw.push:drop:0:0").is_err());
        assert!(parse("gw.push:delay(abc)").is_err());
        assert!(parse("gw.push:drop:1:2:3").is_err());
        assert!(parse("gw.push:drop,gw.push:halt").is_err());
    }
}
