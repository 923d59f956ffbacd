//! A seeded fuzzer on stable Rust for the gateway's frame parser
//! (`im_protocol::wire::parse`, which the gateway re-exports as `protocol::parse`), and the frame generator the wire-level fuzz test
//! (`scenarios/tests/fuzz_wire.rs`) sends to the real binary.
//!
//! Owns: a reproducible input generator (one `u64` seed gives the same inputs on every
//! machine: random bytes, mutations of the corpus in `fuzz/corpus/frames.jsonl`, splices of
//! two corpus frames, and structured JSON with hostile field values), and the oracle that
//! judges one parse: it must not panic, must be deterministic, must take bounded time, and
//! whatever it accepts must satisfy the protocol's limits (SPEC 2) and survive a round
//! trip. Must not: open sockets or touch a database (the wire test does that).
//!
//! Why not cargo-fuzz: it needs a nightly toolchain, and this machine has only stable.
//! The generator is not coverage-guided; it makes up for it with structure (every field of
//! every request type, with values at and across each limit) and volume (`make fuzz` runs
//! ten million inputs).

use im_protocol::wire::{
    self as protocol, Request, CMID_MAX_BYTES, ID_MAX_BYTES, RID_MAX_BYTES, TOKEN_MAX_BYTES,
};
use im_protocol::WireError;
use serde_json::{json, Map, Value};
use std::time::{Duration, Instant};

/// The seed corpus: one frame per line (valid frames of every type and known edge cases).
pub const CORPUS: &str = include_str!("../corpus/frames.jsonl");

/// A parse slower than this is reported as a hang.
pub const HANG: Duration = Duration::from_millis(200);

/// Body limit the fuzzer parses with (small, so the TOO_LARGE edge is hit often).
pub const BODY_MAX: usize = 64;

/// xorshift64*: tiny, fast, and the same sequence everywhere for a given seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        // Avoid the all-zero state; mix the seed so nearby seeds diverge at once.
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    pub fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }

    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// The corpus frames, one per non-empty line.
pub fn corpus() -> Vec<&'static str> {
    CORPUS.lines().filter(|l| !l.trim().is_empty()).collect()
}

const KEYS: &[&str] = &[
    "t", "rid", "device", "token", "epoch", "conv", "cmid", "body", "seq", "after", "limit",
];
const TYPES: &[&str] = &["hello", "send", "ack", "sub", "sync"];
const TOKENS: &[&str] = &[
    "\"",
    "\\",
    "\\u0000",
    "\\ud800",
    "\\uDFFF",
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "1e999",
    "-0",
    "-",
    "9223372036854775808",
    "-9223372036854775809",
    "null",
    "true",
    "\u{feff}",
    "\u{0}",
    "é",
    "\u{10FFFF}",
    "💥",
];

/// A string of `len` characters drawn from an alphabet chosen at random: id characters,
/// characters ids refuse, multi-byte UTF-8, NUL and escapes.
fn string(rng: &mut Rng, len: usize) -> String {
    const ALPHABETS: &[&str] = &[
        "abcXYZ019._-",
        "abc def/:@!#",
        "éß字💥\u{feff}",
        "a\u{0}b",
        "\"\\\n\t",
    ];
    let alphabet: Vec<char> = rng.pick(ALPHABETS).chars().collect();
    (0..len).map(|_| *rng.pick(&alphabet)).collect()
}

/// A length near a limit of the protocol, or a small one.
fn length(rng: &mut Rng) -> usize {
    let limits = [
        0,
        1,
        2,
        ID_MAX_BYTES,
        ID_MAX_BYTES + 1,
        RID_MAX_BYTES,
        RID_MAX_BYTES + 1,
        CMID_MAX_BYTES,
        CMID_MAX_BYTES + 1,
        BODY_MAX,
        BODY_MAX + 1,
        256,
        257,
    ];
    if rng.chance(3) {
        rng.below(12)
    } else {
        let base = *rng.pick(&limits);
        // Multi-byte characters make byte length differ from char count: try both sides.
        base.saturating_sub(rng.below(2))
    }
}

/// A hostile value for any field.
fn value(rng: &mut Rng, depth: usize) -> Value {
    match rng.below(if depth > 3 { 9 } else { 12 }) {
        0 => Value::Null,
        1 => Value::Bool(rng.chance(2)),
        2 => json!(*rng.pick(&[0i64, 1, -1, 2, i64::MAX, i64::MIN, 100, 500, 501, 10_000])),
        3 => json!(rng.next_u64()),
        4 => json!(*rng.pick(&[0.5f64, -0.0, 1e300, -1e-300, 7.0])),
        5..=8 => {
            let n = length(rng);
            Value::String(string(rng, n))
        }
        9 => Value::Array((0..rng.below(4)).map(|_| value(rng, depth + 1)).collect()),
        10 => Value::Object(object(rng, depth + 1)),
        _ => Value::String(rng.pick(TYPES).to_string()),
    }
}

/// An object with a random subset of the protocol's keys (usually a known `t` and a good
/// `rid`, so parsing goes deep), plus sometimes an unknown key.
fn object(rng: &mut Rng, depth: usize) -> Map<String, Value> {
    let mut o = Map::new();
    if !rng.chance(8) {
        let t = if rng.chance(10) {
            value(rng, depth + 1)
        } else {
            json!(rng.pick(TYPES))
        };
        o.insert("t".into(), t);
    }
    if !rng.chance(6) {
        let rid = if rng.chance(5) {
            value(rng, depth + 1)
        } else {
            json!(format!("r{}", rng.below(1000)))
        };
        o.insert("rid".into(), rid);
    }
    for key in KEYS.iter().skip(2) {
        if rng.chance(2) {
            let v = if rng.chance(2) {
                value(rng, depth + 1)
            } else {
                good_value(rng, key)
            };
            o.insert(key.to_string(), v);
        }
    }
    if rng.chance(10) {
        o.insert(string(rng, 3), value(rng, depth + 1));
    }
    o
}

/// A value the field accepts, so that one bad field among good ones is tried.
fn good_value(rng: &mut Rng, key: &str) -> Value {
    match key {
        "device" | "conv" => json!(format!("id{}", rng.below(100))),
        "token" => json!("tok"),
        "cmid" => json!(format!("m{}", rng.next_u64())),
        "body" => {
            let n = rng.below(BODY_MAX + 2);
            json!(string(rng, n))
        }
        "epoch" | "seq" | "after" => json!(rng.below(10)),
        "limit" => json!(1 + rng.below(600)),
        _ => Value::Null,
    }
}

fn mutate(rng: &mut Rng, mut b: Vec<u8>) -> Vec<u8> {
    for _ in 0..1 + rng.below(4) {
        let len = b.len();
        match rng.below(7) {
            0 if len > 0 => {
                let i = rng.below(len);
                b[i] ^= 1 << rng.below(8);
            }
            1 => {
                let i = rng.below(len + 1);
                b.insert(i, rng.next_u64() as u8);
            }
            2 if len > 0 => {
                let i = rng.below(len);
                let j = (i + 1 + rng.below(8)).min(len);
                b.drain(i..j);
            }
            3 if len > 0 => {
                let i = rng.below(len);
                let j = (i + 1 + rng.below(16)).min(len);
                let chunk = b[i..j].to_vec();
                let at = rng.below(len + 1);
                b.splice(at..at, chunk);
            }
            4 => {
                let i = rng.below(len + 1);
                let tok = rng.pick(TOKENS).as_bytes().to_vec();
                b.splice(i..i, tok);
            }
            5 if len > 0 => b.truncate(rng.below(len)),
            _ => {
                // Deep nesting: serde_json's recursion limit must turn it into an error.
                let depth = 100 + rng.below(200);
                let mut nested = "[".repeat(depth).into_bytes();
                nested.extend(std::iter::repeat_n(b']', depth));
                let i = rng.below(len + 1);
                b.splice(i..i, nested);
            }
        }
    }
    b
}

/// One generated input (raw bytes: a WebSocket text frame after UTF-8 validation is what
/// `parse` sees, so callers turn it into a `str` lossily).
pub fn generate(rng: &mut Rng, corpus: &[&str]) -> Vec<u8> {
    match rng.below(10) {
        0 => (0..rng.below(64)).map(|_| rng.next_u64() as u8).collect(),
        1..=3 => {
            let base = rng.pick(corpus).as_bytes().to_vec();
            mutate(rng, base)
        }
        4 => {
            let a = rng.pick(corpus).as_bytes();
            let b = rng.pick(corpus).as_bytes();
            let (i, j) = (rng.below(a.len() + 1), rng.below(b.len() + 1));
            let mut out = a[..i].to_vec();
            out.extend_from_slice(&b[j..]);
            out
        }
        5 => {
            let base = Value::Object(object(rng, 0)).to_string().into_bytes();
            mutate(rng, base)
        }
        _ => Value::Object(object(rng, 0)).to_string().into_bytes(),
    }
}

/// What one parse gave, for statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Accepted(&'static str),
    Refused(&'static str),
}

fn is_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= ID_MAX_BYTES
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// The properties an accepted request must have (SPEC 2 and the limits of `protocol`).
fn accepted_ok(req: &Request) -> Result<&'static str, String> {
    match req {
        Request::Hello { device, token, .. } => {
            if !is_id(device) || token.is_empty() || token.len() > TOKEN_MAX_BYTES {
                return Err(format!("accepted a bad hello: {req:?}"));
            }
            Ok("hello")
        }
        Request::Send { conv, cmid, body } => {
            if !is_id(conv)
                || cmid.is_empty()
                || cmid.len() > CMID_MAX_BYTES
                || cmid.contains('\0')
                || body.len() > BODY_MAX
                || body.contains('\0')
            {
                return Err(format!("accepted a bad send: {req:?}"));
            }
            Ok("send")
        }
        Request::Ack { conv, seq } => {
            if !is_id(conv) || *seq < 0 {
                return Err(format!("accepted a bad ack: {req:?}"));
            }
            Ok("ack")
        }
        Request::Sub => Ok("sub"),
        Request::Sync { conv, after, limit } => {
            if !is_id(conv) || *after < 0 || limit.is_some_and(|l| l < 1) {
                return Err(format!("accepted a bad sync: {req:?}"));
            }
            Ok("sync")
        }
    }
}

/// Judges one input: `Err` describes a violated property (a panic included).
pub fn check_one(input: &[u8]) -> Result<Outcome, String> {
    let text = String::from_utf8_lossy(input);
    let started = Instant::now();
    let parsed = std::panic::catch_unwind(|| protocol::parse(&text, BODY_MAX))
        .map_err(|p| format!("parse panicked: {:?}", panic_text(&p)))?;
    let took = started.elapsed();
    if took > HANG {
        return Err(format!("parse took {took:?} (hang bound {HANG:?})"));
    }
    let again = protocol::parse(&text, BODY_MAX);
    if format!("{:?}{:?}", parsed.rid, parsed.req) != format!("{:?}{:?}", again.rid, again.req) {
        return Err("parse is not deterministic".into());
    }
    if let Some(rid) = &parsed.rid {
        if rid.is_empty() || rid.len() > RID_MAX_BYTES {
            return Err(format!("returned a bad rid {rid:?}"));
        }
    }
    match &parsed.req {
        Ok(req) => {
            let Some(rid) = &parsed.rid else {
                return Err(format!("accepted a request without rid: {req:?}"));
            };
            let kind = accepted_ok(req)?;
            // Round trip: what we accepted, written back as a client writes it (the protocol
            // crate's rendering), parses to the same request.
            let back = protocol::parse(&req.to_frame(rid), BODY_MAX);
            if back.rid.as_deref() != Some(rid.as_str()) || back.req.as_ref().ok() != Some(req) {
                return Err(format!("round trip changed {req:?} into {:?}", back.req));
            }
            Ok(Outcome::Accepted(kind))
        }
        Err(e) => {
            let code = e.code();
            if !matches!(e, WireError::BadRequest(_) | WireError::TooLarge(_)) {
                return Err(format!(
                    "parse refused with {code}, not BAD_REQUEST/TOO_LARGE"
                ));
            }
            let msg = e.to_string();
            if msg.len() > 512 {
                return Err(format!("error message of {} bytes", msg.len()));
            }
            Ok(Outcome::Refused(code))
        }
    }
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic".into())
}

/// Totals of one fuzzing run.
#[derive(Debug, Default, Clone)]
pub struct Stats {
    pub inputs: u64,
    pub accepted: std::collections::BTreeMap<&'static str, u64>,
    pub refused: std::collections::BTreeMap<&'static str, u64>,
    pub slowest: Duration,
}

/// A property violation, with the input that shows it.
#[derive(Debug, Clone)]
pub struct Failure {
    pub index: u64,
    pub input: Vec<u8>,
    pub what: String,
}

/// Runs `n` inputs from `seed`; stops at the first violation.
pub fn run(seed: u64, n: u64) -> (Stats, Option<Failure>) {
    let corpus = corpus();
    let mut rng = Rng::new(seed);
    let mut stats = Stats::default();
    // Each corpus frame as it is, first.
    let mut inputs = corpus
        .iter()
        .map(|c| c.as_bytes().to_vec())
        .collect::<Vec<_>>();
    inputs.reverse();
    for index in 0..n {
        let input = inputs.pop().unwrap_or_else(|| generate(&mut rng, &corpus));
        let t0 = Instant::now();
        let r = check_one(&input);
        stats.slowest = stats.slowest.max(t0.elapsed());
        stats.inputs += 1;
        match r {
            Ok(Outcome::Accepted(k)) => *stats.accepted.entry(k).or_default() += 1,
            Ok(Outcome::Refused(c)) => *stats.refused.entry(c).or_default() += 1,
            Err(what) => {
                return (stats, Some(Failure { index, input, what }));
            }
        }
    }
    (stats, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The short pass `make test` runs: 200,000 generated inputs, no panic, no violated
    /// property, and every request type accepted at least once (the generator reaches
    /// deep into the parser, not only its JSON front door).
    #[test]
    fn short_pass_finds_nothing_and_reaches_every_request_type() {
        let (stats, failure) = run(0x1_f022, 200_000);
        if let Some(f) = failure {
            panic!(
                "input {} violates a property: {}\ninput: {:?}",
                f.index,
                f.what,
                String::from_utf8_lossy(&f.input)
            );
        }
        for t in TYPES {
            assert!(
                stats.accepted.get(t).copied().unwrap_or(0) > 0,
                "no {t} accepted: {stats:?}"
            );
        }
        assert!(stats.refused.get("TOO_LARGE").copied().unwrap_or(0) > 0);
        assert!(stats.refused.get("BAD_REQUEST").copied().unwrap_or(0) > 0);
    }

    /// The oracle has teeth: an input breaking a property is reported (a request accepted
    /// without its limits is what `accepted_ok` refuses).
    #[test]
    fn the_oracle_rejects_what_the_parser_must_not_accept() {
        let bad = Request::Send {
            conv: "c".into(),
            cmid: "m".into(),
            body: "x".repeat(BODY_MAX + 1),
        };
        assert!(accepted_ok(&bad).is_err());
        let bad = Request::Sync {
            conv: "bad id!".into(),
            after: 0,
            limit: None,
        };
        assert!(accepted_ok(&bad).is_err());
        assert!(accepted_ok(&Request::Ack {
            conv: "c".into(),
            seq: -1
        })
        .is_err());
    }

    #[test]
    fn same_seed_same_inputs() {
        let corpus = corpus();
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        for _ in 0..1000 {
            assert_eq!(generate(&mut a, &corpus), generate(&mut b, &corpus));
        }
    }
}
