//! The checker's unit tests: hand-built histories, one per rule and per exception.

use super::*;
use serde_json::json;

/// Builds a history line by line; the clock advances 1 ms per line unless told.
struct B {
    h: Vec<Entry>,
    t: f64,
    op: u64,
}

const WALL0: i64 = 1_700_000_000_000_000;

impl B {
    fn new() -> B {
        let mut b = B {
            h: Vec::new(),
            t: 0.0,
            op: 0,
        };
        b.line(
            "harness",
            0,
            Type::Meta,
            "open",
            None,
            json!({"schema_version": crate::history::SCHEMA_VERSION}),
        );
        b
    }

    fn line(
        &mut self,
        process: &str,
        instance: u64,
        kind: Type,
        op: &str,
        op_id: Option<u64>,
        value: Value,
    ) -> u64 {
        self.t += 1.0;
        let i = self.h.len() as u64;
        // Written as a line of history.jsonl and parsed as the checker's reader parses
        // it: a test line of the wrong shape fails here, loudly.
        let mut value = value;
        let mut line = json!({
            "i": i, "t_ms": self.t, "wall_us": WALL0 + (self.t * 1000.0) as i64,
            "process": process, "instance": instance, "type": kind, "op": op,
            "op_id": op_id,
        });
        if kind == Type::Nemesis {
            let phase = value
                .as_object_mut()
                .and_then(|o| o.remove("phase"))
                .unwrap_or(json!("instant"));
            line["phase"] = phase;
        }
        line["value"] = value;
        let e: Entry = serde_json::from_value(line.clone())
            .unwrap_or_else(|err| panic!("test line {line} does not parse: {err}"));
        self.h.push(e);
        i
    }

    fn wait(&mut self, ms: f64) {
        self.t += ms;
    }

    fn wall(&self, line: u64) -> i64 {
        self.h[line as usize].wall_us
    }

    /// An invoke; returns its op id.
    fn invoke(&mut self, dev: &str, op: &str, v: Value) -> u64 {
        self.op += 1;
        let id = self.op;
        self.line(dev, 1, Type::Invoke, op, Some(id), v);
        id
    }

    fn done(&mut self, dev: &str, kind: Type, op: &str, id: u64, v: Value) -> u64 {
        self.line(dev, 1, kind, op, Some(id), v)
    }

    /// A send answered `sent`; returns the ok line.
    fn send(&mut self, dev: &str, conv: &str, cmid: &str, seq: i64, mid: &str) -> u64 {
        let id = self.invoke(
            dev,
            "send",
            json!({"conv": conv, "cmid": cmid, "body_len": 1}),
        );
        self.done(
            dev,
            Type::Ok,
            "send",
            id,
            json!({"conv": conv, "seq": seq, "mid": mid, "dup": false, "epoch": 1}),
        )
    }

    /// A send that timed out.
    fn send_info(&mut self, dev: &str, conv: &str, cmid: &str) {
        let id = self.invoke(
            dev,
            "send",
            json!({"conv": conv, "cmid": cmid, "body_len": 1}),
        );
        self.done(dev, Type::Info, "send", id, json!({"why": "timeout"}));
    }

    /// A non-overlapping ack; returns (invoke line, ok line).
    fn ack(
        &mut self,
        dev: &str,
        conv: &str,
        seq: i64,
        explicit: bool,
        delivered: i64,
    ) -> (u64, u64) {
        let id = self.invoke(
            dev,
            "ack",
            json!({"conv": conv, "seq": seq, "explicit": explicit}),
        );
        let inv = self.h.len() as u64 - 1;
        let ok = self.done(
            dev,
            Type::Ok,
            "ack",
            id,
            json!({"conv": conv, "delivered": delivered}),
        );
        (inv, ok)
    }

    fn push(&mut self, dev: &str, conv: &str, seq: i64, mid: &str) -> u64 {
        self.line(
            dev,
            1,
            Type::Recv,
            "push",
            None,
            json!({"conv": conv, "seq": seq, "mid": mid, "sender": "alice", "cmid": "x"}),
        )
    }

    fn hint(&mut self, dev: &str, conv: &str, head: i64, why: &str) -> u64 {
        self.line(
            dev,
            1,
            Type::Recv,
            "hint",
            None,
            json!({"conv": conv, "head": head, "why": why}),
        )
    }

    fn store(&mut self, dev: &str, via: &str, conv: &str, evs: &[(i64, &str)]) -> u64 {
        let events: Vec<Value> = evs
            .iter()
            .map(|(q, m)| json!({"seq": q, "mid": m}))
            .collect();
        let cursor = evs.last().map_or(0, |e| e.0);
        self.line(
            dev,
            1,
            Type::Store,
            "store",
            None,
            json!({"conv": conv, "via": via, "events": events, "cursor": cursor}),
        )
    }

    fn sync(&mut self, dev: &str, conv: &str, after: i64, evs: &[(i64, &str)], head: i64) -> u64 {
        let id = self.invoke(
            dev,
            "sync",
            json!({"conv": conv, "after": after, "limit": 100}),
        );
        let events: Vec<Value> = evs
            .iter()
            .map(|(q, m)| json!({"conv": conv, "seq": q, "mid": m, "sender": "alice", "cmid": "x"}))
            .collect();
        self.done(
            dev,
            Type::Ok,
            "sync",
            id,
            json!({"conv": conv, "head": head, "complete": true, "events": events}),
        )
    }

    fn client(&mut self, dev: &str, op: &str) -> u64 {
        self.line(dev, 1, Type::Client, op, None, json!({}))
    }

    fn gateway_start(&mut self, sweep_ms: u64) -> u64 {
        self.line(
            "harness",
            0,
            Type::Nemesis,
            "gateway-start",
            None,
            json!({"gateway": 0, "fault": null, "sweep_ms": sweep_ms, "bug": null, "phase": "instant"}),
        )
    }

    fn probe(
        &mut self,
        of: u64,
        conv: &str,
        seq: i64,
        expect: &str,
        found: Option<&str>,
        error: Option<&str>,
    ) -> u64 {
        self.line("probe", 0, Type::Probe, "probe", None, json!({"of": of, "conv": conv, "seq": seq, "expect_mid": expect, "found_mid": found, "error": error}))
    }
}

/// A final read: users alice (a1) and bob (b1), both members of c1 from seq 1, with
/// `rows` (conv, seq, mid, sender_device, cmid) and heads from them.
fn fin(rows: &[(&str, i64, &str, &str, &str)]) -> Final {
    let user = |d: &str| if d.starts_with('a') { "alice" } else { "bob" };
    let mut heads = BTreeMap::from([("c1".to_string(), 0)]);
    for r in rows {
        let h = heads.entry(r.0.to_string()).or_insert(0);
        *h = (*h).max(r.1);
    }
    Final {
        schema_version: 1,
        t_ms: 0.0,
        wall_us: 0,
        sweep_ms: 1000,
        events: rows
            .iter()
            .map(|r| FinalEvent {
                conv: r.0.into(),
                seq: r.1,
                mid: r.2.into(),
                sender_user: user(r.3).into(),
                sender_device: r.3.into(),
                cmid: r.4.into(),
            })
            .collect(),
        heads,
        memberships: ["alice", "bob"]
            .iter()
            .map(|u| Membership {
                conv: "c1".into(),
                user: (*u).into(),
                from_seq: 1,
                to_seq: None,
            })
            .collect(),
        devices: BTreeMap::from([
            ("a1".to_string(), "alice".to_string()),
            ("b1".to_string(), "bob".to_string()),
        ]),
        cursors: Vec::new(),
        cursor_audit: Vec::new(),
        stores: BTreeMap::new(),
        live: vec!["a1".into(), "b1".into()],
        liveness: Liveness {
            bound_ms: 2000,
            waited_ms: 0.0,
            missing: BTreeMap::new(),
        },
    }
}

/// A cursor write of `dev` in c1.
fn audit(dev: &str, old: Option<i64>, new: i64, wall_us: i64) -> CursorWrite {
    CursorWrite {
        device: dev.into(),
        conv: "c1".into(),
        old,
        new,
        wall_us,
    }
}

fn cursor(dev: &str, conv: &str, delivered: i64) -> FinalCursor {
    FinalCursor {
        device: dev.into(),
        conv: conv.into(),
        delivered,
    }
}

/// Puts `evs` as `dev`'s state file for c1.
fn state_file(f: &mut Final, dev: &str, evs: &[(i64, &str)]) {
    let evs = evs
        .iter()
        .map(|(seq, mid)| StoredEvent {
            seq: *seq,
            mid: (*mid).into(),
        })
        .collect();
    f.stores
        .insert(dev.into(), BTreeMap::from([("c1".to_string(), evs)]));
}

/// The kinds found, in report order.
fn kinds(b: &B, f: &Final) -> Vec<&'static str> {
    check(&b.h, f)
        .anomalies
        .iter()
        .map(|a| a.kind.as_str())
        .collect()
}

fn only(b: &B, f: &Final, kind: Kind) -> Vec<Anomaly> {
    check(&b.h, f)
        .anomalies
        .into_iter()
        .filter(|a| a.kind == kind)
        .collect()
}

/// Two rows m1, m2 of c1 sent by a1 (cmids x1, x2).
fn two_rows() -> Final {
    fin(&[("c1", 1, "m1", "a1", "x1"), ("c1", 2, "m2", "a1", "x2")])
}

#[test]
fn a_clean_realistic_history_passes_with_every_count_zero() {
    let (b, f) = realistic();
    let r = check(&b.h, &f);
    assert_eq!(r.anomalies, vec![], "{}", r.summary());
    assert_eq!(r.verdict, Verdict::Pass);
    assert_eq!(r.counts.len(), 15);
    assert!(Kind::ALL.iter().all(|k| r.counts[k] == 0));
    let json = serde_json::to_value(&r).unwrap();
    for k in Kind::ALL {
        assert_eq!(json["counts"][k.as_str()], json!(0), "{k}");
    }
    assert_eq!(json["verdict"], json!("PASS"));
    assert_eq!(
        r.summary(),
        format!("PASS, 0 anomalies over {} entries", b.h.len())
    );
    assert_eq!(
        r.stats.ops["send"],
        OpCounts {
            invoke: 2,
            ok: 2,
            fail: 0,
            info: 0
        }
    );
    assert_eq!(r.stats.ops["ack"].ok, 4);
    assert_eq!((r.stats.pushes, r.stats.hints, r.stats.stores), (3, 1, 4));
    assert_eq!(
        r.stats.probes,
        ProbeCounts {
            total: 3,
            visible: 3,
            errors: 0
        }
    );
    assert_eq!(r.stats.delivery_ms.n, 4);
    assert_eq!(r.stats.repair_ms.n, 1);
    assert!(r.stats.repair_ms.p50.unwrap() > 900.0);
    assert_eq!(
        r.stats.sweep_hint_gaps_ms,
        GapQuantiles {
            n: 0,
            p50: None,
            max: None
        }
    );
    let back: Report = serde_json::from_value(json).unwrap();
    assert_eq!(back, r);
}

/// Two devices, two messages, one push lost and repaired by a sweep hint and a sync:
/// a history every rule passes, and its final read.
fn realistic() -> (B, Final) {
    let mut b = B::new();
    b.client("a1", "create");
    b.client("b1", "create");
    for d in ["a1", "b1"] {
        let id = b.invoke(d, "hello", json!({"device": d, "epoch": 1}));
        b.done(
            d,
            Type::Ok,
            "hello",
            id,
            json!({"user": "u", "device": d, "epoch": 1}),
        );
        let id = b.invoke(d, "sub", json!({}));
        b.done(
            d,
            Type::Ok,
            "sub",
            id,
            json!({"convs": [{"conv": "c1", "head": 0, "delivered": 0}]}),
        );
    }
    let ok1 = b.send("a1", "c1", "x1", 1, "m1");
    b.probe(ok1, "c1", 1, "m1", Some("m1"), None);
    for d in ["a1", "b1"] {
        let p = b.push(d, "c1", 1, "m1");
        b.probe(p, "c1", 1, "m1", Some("m1"), None);
        b.store(d, "push", "c1", &[(1, "m1")]);
        b.ack(d, "c1", 1, false, 1);
    }
    b.send("a1", "c1", "x2", 2, "m2");
    b.push("a1", "c1", 2, "m2");
    b.store("a1", "push", "c1", &[(2, "m2")]);
    let (a_ack2, _) = b.ack("a1", "c1", 2, false, 2);
    // b1 lost the push of 2: the sweep hints it, it syncs and acks.
    b.wait(900.0);
    b.hint("b1", "c1", 2, "sweep");
    b.sync("b1", "c1", 1, &[(2, "m2")], 2);
    b.store("b1", "sync", "c1", &[(2, "m2")]);
    let (b_ack2, _) = b.ack("b1", "c1", 2, false, 2);
    b.line("harness", 0, Type::Meta, "final", None, json!({}));

    let mut f = two_rows();
    f.cursor_audit = vec![
        audit("a1", None, 1, b.wall(a_ack2) - 10),
        audit("b1", None, 1, b.wall(a_ack2) - 5),
        audit("a1", Some(1), 2, b.wall(a_ack2) + 5),
        audit("b1", Some(1), 2, b.wall(b_ack2) + 5),
    ];
    for d in ["a1", "b1"] {
        f.cursors.push(cursor(d, "c1", 2));
        state_file(&mut f, d, &[(1, "m1"), (2, "m2")]);
    }
    f.liveness
        .missing
        .insert("b1".into(), BTreeMap::from([("c1".to_string(), vec![])]));
    (b, f)
}

/// Every key of `v`, at any depth, as a path of keys and array indexes.
fn key_paths(v: &Value, at: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match v {
        Value::Object(o) => {
            for (k, x) in o {
                at.push(k.clone());
                out.push(at.clone());
                key_paths(x, at, out);
                at.pop();
            }
        }
        Value::Array(xs) => {
            for (i, x) in xs.iter().enumerate() {
                at.push(format!("[{i}]"));
                key_paths(x, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

/// Renames the last key of `path` in `v` (appends `_renamed`).
fn rename(v: &mut Value, path: &[String]) {
    let (last, parents) = path.split_last().unwrap();
    let mut at = v;
    for p in parents {
        at = match p.strip_prefix('[').and_then(|p| p.strip_suffix(']')) {
            Some(i) => &mut at[i.parse::<usize>().unwrap()],
            None => &mut at[p.as_str()],
        };
    }
    let o = at.as_object_mut().unwrap();
    let x = o.remove(last).unwrap();
    o.insert(format!("{last}_renamed"), x);
}

/// Issue 20: a history field renamed (by another version of the recorder, or by hand)
/// makes the judgement ERROR, not a rule that skips the line and passes. Every key of
/// every line of a history holding every kind of line the checker reads, at any depth,
/// is renamed in turn: each time the history no longer parses, naming the line; and
/// the judgement of the run directory is ERROR.
#[test]
fn a_renamed_history_field_makes_the_judgement_error_never_a_skip() {
    let (mut b, f) = realistic();
    b.gateway_start(1000);
    let fault = json!({"id": 3, "at_ms": 10, "end_ms": 20, "target": "gateway",
                       "kind": "gw-fault", "point": "gw.push", "action": "drop",
                       "leaves_the_sweep_alone": true});
    for phase in ["start", "end"] {
        let v = json!({"phase": phase, "fault": fault.clone(), "healed": false});
        b.line("harness", 0, Type::Nemesis, "fault", Some(90), v);
    }
    for v in [
        json!({"phase": "start"}),
        json!({"phase": "end", "ok": true, "error": null}),
    ] {
        b.line("harness", 0, Type::Nemesis, "pg-crash", Some(91), v);
    }
    b.line(
        "harness",
        0,
        Type::Nemesis,
        "observer-stall",
        None,
        json!({"from_ms": 1.0, "to_ms": 300.0, "cause": "test"}),
    );
    b.send_info("a1", "c1", "x9");
    b.probe(3, "c1", 1, "m1", None, Some("down"));
    let tmp = tempfile::Builder::new()
        .prefix("imfault-rename-")
        .tempdir()
        .unwrap();
    let dir = tmp.path();
    let lines: Vec<Value> =
        b.h.iter()
            .map(|e| serde_json::to_value(e).unwrap())
            .collect();
    let text = |lines: &[Value]| {
        lines
            .iter()
            .map(|l| l.to_string() + "\n")
            .collect::<String>()
    };
    std::fs::write(dir.join("history.jsonl"), text(&lines)).unwrap();
    std::fs::write(dir.join("final.json"), serde_json::to_string(&f).unwrap()).unwrap();
    assert_eq!(judge_dir(dir).verdict, Verdict::Pass);

    let mut renamed = 0;
    for (n, line) in lines.iter().enumerate() {
        let mut paths = Vec::new();
        key_paths(line, &mut Vec::new(), &mut paths);
        for path in paths {
            // A fault's parameters are opaque to the judge (it reads none of them, only
            // what the line says of the fault: issue 43): renaming one changes nothing.
            if path.len() == 3
                && path[..2] == ["value", "fault"]
                && ["point", "action"].contains(&path[2].as_str())
            {
                continue;
            }
            let mut edited = lines.clone();
            rename(&mut edited[n], &path);
            let e = format!("{:#}", crate::history::parse(&text(&edited)).unwrap_err());
            assert!(
                e.contains(&format!("line {}", n + 1)),
                "renaming {path:?} of line {}: {e}",
                n + 1
            );
            renamed += 1;
        }
    }
    assert!(renamed > 300, "{renamed}");

    // End to end, from the run directory: the mid of a `sent` reply renamed.
    let ok = lines
        .iter()
        .position(|l| l["type"] == "ok" && l["op"] == "send")
        .unwrap();
    let mut edited = lines.clone();
    rename(&mut edited[ok], &["value".into(), "mid".into()]);
    std::fs::write(dir.join("history.jsonl"), text(&edited)).unwrap();
    let r = judge_dir(dir);
    assert_eq!(r.verdict, Verdict::Error);
    let why = r.error.as_deref().unwrap();
    assert!(why.contains(&format!("line {}", ok + 1)), "{why}");
    assert!(r.summary().starts_with("ERROR"), "{}", r.summary());
    assert_eq!(serde_json::to_value(&r).unwrap()["verdict"], json!("ERROR"));
}

#[test]
fn kind_names_are_the_serialised_names() {
    for k in Kind::ALL {
        assert_eq!(serde_json::to_value(k).unwrap(), json!(k.as_str()));
    }
}

#[test]
fn nearest_rank_quantiles() {
    let q = quantiles(vec![5.0, 1.0, 4.0, 2.0, 3.0]);
    assert_eq!(
        (q.n, q.p50, q.p95, q.max),
        (5, Some(3.0), Some(5.0), Some(5.0))
    );
    let q = quantiles(vec![1.0, 2.0]);
    assert_eq!(q.p50, Some(1.0));
    assert_eq!(quantiles(vec![]), Quantiles::default());
}

#[test]
fn lost_when_an_acked_row_is_missing_or_has_another_mid() {
    let mut b = B::new();
    b.send("a1", "c1", "x1", 1, "m1");
    b.send("a1", "c1", "x2", 2, "m2");
    let f = fin(&[("c1", 2, "other", "a1", "x2")]);
    let lost = only(&b, &f, Kind::Lost);
    assert_eq!(lost.len(), 2, "{lost:?}");
    assert!(lost[0].msg.contains("no row c1:1"), "{}", lost[0].msg);
    assert!(lost[1].msg.contains("has mid other"), "{}", lost[1].msg);
    assert_eq!(lost[0].entries, vec![2]);
    assert_eq!(lost[0].invariant, "D1/D6");
}

/// Issue 20: an anomaly's proof is data: the conversation, seq, device and database row
/// are read from the witness (the sentence is generated from it, never the other way).
#[test]
fn the_witness_names_the_conversation_seq_device_and_row() {
    let mut b = B::new();
    b.send("a1", "c1", "x2", 2, "m2");
    let f = fin(&[("c1", 2, "other", "a1", "x2")]);
    let lost = only(&b, &f, Kind::Lost);
    let Witness::SentNotKept { devices, sent, row } = &lost[0].witness else {
        panic!("{:?}", lost[0].witness);
    };
    assert_eq!(devices, &vec!["a1".to_string()]);
    assert_eq!(
        (sent.conv.as_str(), sent.seq, sent.mid.as_str()),
        ("c1", 2, "m2")
    );
    assert_eq!(sent.line, Some(lost[0].entries[0]));
    assert_eq!(row.as_ref().map(|r| r.mid.as_str()), Some("other"));
    assert_eq!(lost[0].witness.conv(), Some("c1"));
    assert_eq!(lost[0].witness.device(), Some("a1"));
    assert_eq!(lost[0].msg, lost[0].witness.explain());
    let json = serde_json::to_value(&lost[0]).unwrap();
    assert_eq!(json["witness"]["shape"], json!("sent-not-kept"));
    assert_eq!(json["witness"]["row"]["mid"], json!("other"));
    let back: Anomaly = serde_json::from_value(json).unwrap();
    assert_eq!(back, lost[0]);
}

/// Issue 20: the rules table covers every kind, each kind from one family, and each
/// family is a file of `check/src/`.
#[test]
fn every_kind_is_reported_by_exactly_one_rule_family() {
    for k in Kind::ALL {
        let families: std::collections::BTreeSet<&str> = RULES
            .iter()
            .filter(|r| r.kinds.contains(k))
            .map(|r| r.family)
            .collect();
        assert_eq!(families.len(), 1, "{k}: {families:?}");
    }
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for r in RULES {
        assert!(
            dir.join(format!("{}.rs", r.family)).is_file(),
            "rule {} names family {}",
            r.name,
            r.family
        );
    }
}

/// Issue 20: the documentation of the kinds derives from the one table: evidence/README.md's
/// checker table has exactly one row per kind, holding the table's invariant and "flagged
/// when" word for word, and no row for a kind the table does not have.
#[test]
fn the_readme_checker_table_is_the_kinds_table() {
    let readme = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../evidence/README.md");
    let text = std::fs::read_to_string(readme).unwrap();
    let start = text.find("| kind | invariant | flagged when |").unwrap();
    let rows: Vec<&str> = text[start..]
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .collect();
    let want: Vec<String> = Kind::ALL
        .iter()
        .map(|k| {
            format!(
                "| `{}` | {} | {} |",
                k.as_str(),
                k.invariant(),
                k.flagged_when()
            )
        })
        .collect();
    assert_eq!(rows, want);
}

#[test]
fn an_info_send_absent_at_the_end_is_not_lost() {
    let mut b = B::new();
    b.send_info("a1", "c1", "x1");
    b.send_info("a1", "c1", "x2");
    let f = fin(&[("c1", 1, "m2", "a1", "x2")]);
    let r = check(&b.h, &f);
    assert_eq!(r.verdict, Verdict::Pass, "{:?}", r.anomalies);
    assert_eq!(
        r.stats.info_sends,
        InfoSends {
            total: 2,
            present: 1,
            absent: 1
        }
    );
}

#[test]
fn duplicated_rows_of_one_cmid_or_two_answers_for_one_cmid() {
    let mut b = B::new();
    b.send("a1", "c1", "x1", 1, "m1");
    b.send("a1", "c1", "x1", 2, "m2");
    let f = two_rows_same_cmid();
    let d = only(&b, &f, Kind::Duplicated);
    assert_eq!(d.len(), 2, "{d:?}");
    assert!(d
        .iter()
        .any(|a| a.msg.contains("2 rows for (sender alice, cmid x1)")));
    assert!(d
        .iter()
        .any(|a| a.msg.contains("a1's cmid x1 was answered sent with c1:1")));
}

fn two_rows_same_cmid() -> Final {
    fin(&[("c1", 1, "m1", "a1", "x1"), ("c1", 2, "m2", "a1", "x1")])
}

#[test]
fn a_dup_reply_with_the_original_seq_is_not_duplicated() {
    let mut b = B::new();
    b.send_info("a1", "c1", "x1");
    b.send("a1", "c1", "x1", 1, "m1");
    b.send("a1", "c1", "x1", 1, "m1");
    let f = fin(&[("c1", 1, "m1", "a1", "x1")]);
    assert_eq!(kinds(&b, &f), Vec::<&str>::new());
}

#[test]
fn unexpected_row_never_sent() {
    let mut b = B::new();
    b.send("a1", "c1", "x1", 1, "m1");
    let f = two_rows();
    let u = only(&b, &f, Kind::Unexpected);
    assert_eq!(u.len(), 1);
    assert!(u[0]
        .msg
        .contains("row c1:2 (mid m2, sender alice/a1, cmid x2) was never sent by a1"));
    assert!(u[0].entries.is_empty());
}

#[test]
fn a_row_from_an_info_send_is_expected() {
    let mut b = B::new();
    b.send_info("a1", "c1", "x1");
    let f = fin(&[("c1", 1, "m1", "a1", "x1")]);
    let r = check(&b.h, &f);
    assert_eq!(r.verdict, Verdict::Pass, "{:?}", r.anomalies);
    assert_eq!(
        r.stats.info_sends,
        InfoSends {
            total: 1,
            present: 1,
            absent: 0
        }
    );
}

#[test]
fn p1_gap_when_rows_are_not_one_to_head() {
    let mut b = B::new();
    b.send_info("a1", "c1", "x1");
    b.send_info("a1", "c1", "x3");
    let mut f = fin(&[("c1", 1, "m1", "a1", "x1"), ("c1", 3, "m3", "a1", "x3")]);
    let gap = only(&b, &f, Kind::P1Gap);
    assert_eq!(gap.len(), 1);
    assert_eq!(gap[0].msg, "c1 has head 3 but no rows for seqs 2");
    f.heads.insert("c1".into(), 1);
    let gap = only(&b, &f, Kind::P1Gap);
    assert_eq!(gap[0].msg, "c1 has head 1 but rows outside 1..=1: 3");
    // As many rows as the head, one of them outside: the holes are still named.
    f.heads.insert("c1".into(), 2);
    f.events.remove(0);
    let gap = only(&b, &f, Kind::P1Gap);
    assert_eq!(gap.len(), 1, "{gap:?}");
    assert!(
        gap[0].msg.contains("no rows for seqs 1, 2"),
        "{}",
        gap[0].msg
    );
}

#[test]
fn gapless_rows_are_not_a_p1_gap() {
    let mut b = B::new();
    b.send("a1", "c1", "x1", 1, "m1");
    b.send("a1", "c1", "x2", 2, "m2");
    let mut f = two_rows();
    f.heads.insert("c2".into(), 0);
    assert_eq!(kinds(&b, &f), Vec::<&str>::new());
}

#[test]
fn d3_ack_beyond_what_was_stored_before_the_invoke() {
    let mut b = B::new();
    b.store("b1", "push", "c1", &[(1, "m1")]);
    let id = b.invoke(
        "b1",
        "ack",
        json!({"conv": "c1", "seq": 2, "explicit": false}),
    );
    // Stored after the ack left: too late.
    b.store("b1", "push", "c1", &[(2, "m2")]);
    b.done(
        "b1",
        Type::Ok,
        "ack",
        id,
        json!({"conv": "c1", "delivered": 2}),
    );
    let f = two_rows();
    let d3 = only(&b, &f, Kind::D3AckBeyondStore);
    assert_eq!(d3.len(), 1, "{d3:?}");
    assert_eq!(
        d3[0].msg,
        "b1 acked c1:2 while it had stored contiguously only through 1, not c1:2 (line 2)"
    );
    assert_eq!(d3[0].entries, vec![2]);
}

#[test]
fn d3_a_hole_below_the_ack_is_flagged() {
    let mut b = B::new();
    b.store("b1", "push", "c1", &[(2, "m2")]);
    b.ack("b1", "c1", 2, false, 2);
    let d3 = only(&b, &two_rows(), Kind::D3AckBeyondStore);
    assert_eq!(d3.len(), 1);
    assert!(
        d3[0].msg.contains("only through 0, not c1:1"),
        "{}",
        d3[0].msg
    );
}

#[test]
fn an_explicit_ack_beyond_the_store_is_not_d3_but_counted() {
    let mut b = B::new();
    b.ack("b1", "c1", 2, true, 2);
    let r = check(&b.h, &two_rows());
    assert_eq!(r.counts[&Kind::D3AckBeyondStore], 0);
    assert_eq!(r.stats.explicit_acks, 1);
}

#[test]
fn a_seq_invisible_to_the_user_is_not_a_hole() {
    let mut b = B::new();
    b.store("b1", "sync", "c1", &[(2, "m2"), (4, "m4")]);
    b.ack("b1", "c1", 4, false, 4);
    let mut f = fin(&[
        ("c1", 1, "m1", "a1", "x1"),
        ("c1", 2, "m2", "a1", "x2"),
        ("c1", 3, "m3", "a1", "x3"),
        ("c1", 4, "m4", "a1", "x4"),
    ]);
    // bob joined at 2, left before 3, came back at 4.
    f.memberships[1] = Membership {
        conv: "c1".into(),
        user: "bob".into(),
        from_seq: 2,
        to_seq: Some(3),
    };
    f.memberships.push(Membership {
        conv: "c1".into(),
        user: "bob".into(),
        from_seq: 4,
        to_seq: None,
    });
    assert!(only(&b, &f, Kind::D3AckBeyondStore).is_empty());
    // The same ack with 2 not stored is a hole.
    let mut b = B::new();
    b.store("b1", "sync", "c1", &[(4, "m4")]);
    b.ack("b1", "c1", 4, false, 4);
    assert_eq!(only(&b, &f, Kind::D3AckBeyondStore).len(), 1);
}

/// Issue 21: an ack made under an older epoch than the conversation's newest acked a seq of
/// a lost history, which the final read cannot judge; an `epoch` line discards what the
/// device had stored, so an ack after it counts only what it stored since.
#[test]
fn d3_judges_acks_of_the_newest_epoch_against_what_was_stored_since_the_epoch_line() {
    let mut b = B::new();
    subbed(&mut b, "b1", "c1", 1);
    // Old lineage: nothing stored, acked 2. Not judged.
    b.ack("b1", "c1", 2, false, 2);
    b.store("b1", "push", "c1", &[(1, "m1"), (2, "m2")]);
    b.epoch("b1", "c1", 1, 2);
    // What was stored before the epoch line is gone.
    let (late, _) = b.ack("b1", "c1", 2, false, 2);
    let d3 = only(&b, &two_rows(), Kind::D3AckBeyondStore);
    assert_eq!(d3.len(), 1, "{d3:?}");
    assert_eq!(d3[0].entries, vec![late]);
    assert!(
        d3[0].msg.contains("only through 0, not c1:1"),
        "{}",
        d3[0].msg
    );
    // Stored again after it: clean.
    b.store("b1", "sync", "c1", &[(1, "m1"), (2, "m2")]);
    b.ack("b1", "c1", 2, false, 2);
    assert_eq!(only(&b, &two_rows(), Kind::D3AckBeyondStore).len(), 1);
}

/// Issue 21: a `sent` reply shows its sender the epoch its row was committed in, and that
/// alone can make a conversation's epoch the newest: an ack made under an older one is
/// then not judged against the final read.
#[test]
fn a_sent_reply_shows_the_newest_epoch() {
    for sent_epoch in [1, 2] {
        let mut b = B::new();
        subbed(&mut b, "b1", "c1", 1);
        b.ack("b1", "c1", 2, false, 2);
        let id = b.invoke(
            "a1",
            "send",
            json!({"conv": "c1", "cmid": "x2", "body_len": 1}),
        );
        b.done(
            "a1",
            Type::Ok,
            "send",
            id,
            json!({"conv": "c1", "seq": 2, "mid": "m2", "dup": false, "epoch": sent_epoch}),
        );
        let d3 = only(&b, &two_rows(), Kind::D3AckBeyondStore);
        assert_eq!(
            d3.len(),
            usize::from(sent_epoch == 1),
            "{sent_epoch}: {d3:?}"
        );
    }
}

/// Issue 21: so does an event of a sync page, to the device that synced it.
#[test]
fn a_synced_event_shows_the_newest_epoch() {
    for synced_epoch in [1, 2] {
        let mut b = B::new();
        subbed(&mut b, "b1", "c1", 1);
        b.ack("b1", "c1", 2, false, 2);
        let id = b.invoke(
            "a1",
            "sync",
            json!({"conv": "c1", "after": 1, "limit": 100}),
        );
        b.done(
            "a1",
            Type::Ok,
            "sync",
            id,
            json!({"conv": "c1", "head": 2, "complete": true, "events": [
                {"conv": "c1", "seq": 2, "mid": "m2", "sender": "alice", "cmid": "x2",
                 "epoch": synced_epoch}]}),
        );
        let d3 = only(&b, &two_rows(), Kind::D3AckBeyondStore);
        assert_eq!(
            d3.len(),
            usize::from(synced_epoch == 1),
            "{synced_epoch}: {d3:?}"
        );
    }
}

/// A line's `value_text` is its `value` as JSON (what the nemesis report shows).
#[test]
fn value_text_is_the_lines_value_as_json() {
    let mut b = B::new();
    b.push("b1", "c1", 2, "m2");
    let v: Value = serde_json::from_str(&b.h[1].value_text()).expect("JSON");
    assert_eq!(
        (&v["conv"], &v["seq"], &v["mid"]),
        (&json!("c1"), &json!(2), &json!("m2"))
    );
}

/// A request frame becomes its typed invoke (`rid` and token dropped, the body's length
/// kept, a sync's missing `after`/`limit` null, a raw ack not explicit); a frame naming
/// `connect` or `raw`, or of no known shape, stays raw, `t` and all.
#[test]
fn a_request_frame_becomes_its_typed_invoke() {
    let of = |v: Value| Invoke::of_frame(&v);
    assert_eq!(
        of(json!({"t": "send", "rid": "1", "conv": "c1", "cmid": "x", "body": "hello"})),
        Invoke::Send {
            conv: "c1".into(),
            cmid: "x".into(),
            body_len: 5
        }
    );
    assert_eq!(
        of(json!({"t": "sync", "rid": "2", "conv": "c1"})),
        Invoke::Sync {
            conv: "c1".into(),
            after: None,
            limit: None
        }
    );
    assert_eq!(
        of(json!({"t": "ack", "rid": "3", "conv": "c1", "seq": 4})),
        Invoke::Ack {
            conv: "c1".into(),
            seq: 4,
            explicit: false
        }
    );
    for raw in [
        json!({"t": "connect", "url": "ws://x"}),
        json!({"t": "send", "conv": "c1"}),
    ] {
        assert_eq!(of(raw.clone()), Invoke::Raw { frame: raw });
    }
}

/// A raw request's reply is kept as received, less its `rid`.
#[test]
fn a_raw_requests_reply_is_kept_as_received() {
    let reply = json!({"t": "error", "rid": "r1", "code": "BAD_REQUEST", "msg": "no"});
    let frame = im_protocol::ServerFrame::parse(&reply.to_string());
    let done = Done::of_frame(OpName::Raw, &reply, &frame).expect("a raw reply");
    let kept = json!({"t": "error", "code": "BAD_REQUEST", "msg": "no"});
    assert_eq!(done, Done::Raw { reply: kept });
}

/// How a database action went: success with what it reports, or its error; `done` reports
/// nothing beyond that.
#[test]
fn an_outcome_says_how_the_action_went() {
    let ok: anyhow::Result<i64> = Ok(5);
    let o = crate::history::Outcome::of(&ok, |x| x * 2);
    assert_eq!((o.ok, o.error, o.cut), (Some(true), None, Some(json!(10))));
    let err: anyhow::Result<i64> = Err(anyhow::anyhow!("inner").context("outer"));
    let o = crate::history::Outcome::of(&err, |x| x * 2);
    assert_eq!(
        (o.ok, o.error.as_deref(), o.cut),
        (Some(false), Some("outer: inner"), None)
    );
    let o = crate::history::Outcome::done(&ok);
    assert_eq!((o.ok, o.cut), (Some(true), None));
}

/// A nemesis line's `op` is the name serde writes for its action.
#[test]
fn a_nemesis_lines_op_is_its_actions_serialised_name() {
    let mut b = B::new();
    b.line(
        "harness",
        0,
        Type::Nemesis,
        "observer-stall",
        None,
        json!({"phase": "instant", "from_ms": 1.0, "to_ms": 2.0, "cause": "test"}),
    );
    assert_eq!(b.h[1].op(), "observer-stall");
}

/// A witness spells out at most `LIST_MAX` seqs and counts the rest.
#[test]
fn a_long_list_of_seqs_is_cut_at_list_max() {
    let seqs = |n: i64| (1..=n).collect::<Vec<_>>();
    let max = LIST_MAX as i64;
    assert_eq!(list(&seqs(3)), "1, 2, 3");
    assert_eq!(list(&seqs(max)), "1, 2, 3, 4, 5, 6, 7, 8, 9, 10");
    assert_eq!(
        list(&seqs(max + 1)),
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, … (1 more)"
    );
    assert_eq!(
        list(&seqs(max + 2)),
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, … (2 more)"
    );
}

/// D3: the contiguous run a device stored stops at the final head; an ack of a seq above
/// it acked an event the database does not have.
#[test]
fn d3_an_ack_above_the_final_head_is_beyond_the_store() {
    let mut b = B::new();
    b.store("b1", "push", "c1", &[(1, "m1"), (2, "m2"), (3, "m3")]);
    b.ack("b1", "c1", 3, false, 3);
    let d3 = only(&b, &two_rows(), Kind::D3AckBeyondStore);
    assert_eq!(d3.len(), 1, "{d3:?}");
    assert!(
        d3[0].msg.contains("only through 2, not c1:3"),
        "{}",
        d3[0].msg
    );
}

#[test]
fn d3_cursor_moved_without_an_earlier_ack() {
    let mut b = B::new();
    let (inv, _) = b.ack("b1", "c1", 1, true, 1);
    let mut f = two_rows();
    f.cursor_audit = vec![
        // No ack of 2 at all.
        audit("b1", None, 2, b.wall(inv) + 10),
        // The ack of 1 came after this write.
        audit("b1", Some(0), 1, b.wall(inv) - 10),
    ];
    let d3 = only(&b, &f, Kind::D3CursorUnexplained);
    assert_eq!(d3.len(), 2, "{d3:?}");
    // "Follows" is strict: an ack invoked in the write's own microsecond did not precede it.
    let mut same = f.clone();
    same.cursor_audit = vec![audit("b1", Some(0), 1, b.wall(inv))];
    assert_eq!(only(&b, &same, Kind::D3CursorUnexplained).len(), 1);
    assert_eq!(d3[0].entries, vec![inv]);
    assert!(d3[0].msg.contains("moved 0 -> 1"), "{}", d3[0].msg);
    assert!(
        d3[0]
            .msg
            .ends_with(&format!("(its first ack of 1 is line {inv}, 10 us later)")),
        "{}",
        d3[0].msg
    );
    assert!(d3[1].msg.contains("moved none -> 2"), "{}", d3[1].msg);
}

#[test]
fn a_cursor_increase_after_a_matching_ack_is_explained() {
    let mut b = B::new();
    let (inv, _) = b.ack("b1", "c1", 2, true, 2);
    let mut f = two_rows();
    f.cursor_audit = vec![
        audit("b1", None, 2, b.wall(inv) + 10),
        // Not an increase (GREATEST kept 2): nothing to explain.
        audit("b1", Some(2), 2, b.wall(inv) + 20),
    ];
    assert!(only(&b, &f, Kind::D3CursorUnexplained).is_empty());
}

#[test]
fn d4_a_later_ack_reply_below_an_earlier_one() {
    let mut b = B::new();
    let (_, ok5) = b.ack("b1", "c1", 2, true, 2);
    let (inv, ok) = b.ack("b1", "c1", 1, true, 1);
    let d4 = only(&b, &two_rows(), Kind::D4Decrease);
    assert_eq!(d4.len(), 1, "{d4:?}");
    assert_eq!(d4[0].entries, vec![ok5, inv, ok]);
    assert_eq!(
        d4[0].msg,
        "b1 got delivered 1 for c1 from ack (invoked line 3, answered line 4) after it had received delivered 2 (line 2)"
    );
}

#[test]
fn d4_a_sub_reply_below_an_earlier_ack() {
    let mut b = B::new();
    b.ack("b1", "c1", 2, true, 2);
    let id = b.invoke("b1", "sub", json!({}));
    b.done(
        "b1",
        Type::Ok,
        "sub",
        id,
        json!({"convs": [{"conv": "c1", "head": 2, "delivered": 0}]}),
    );
    assert_eq!(only(&b, &two_rows(), Kind::D4Decrease).len(), 1);
}

#[test]
fn overlapping_acks_answered_out_of_order_are_not_d4() {
    let mut b = B::new();
    let id1 = b.invoke(
        "b1",
        "ack",
        json!({"conv": "c1", "seq": 1, "explicit": true}),
    );
    let id2 = b.invoke(
        "b1",
        "ack",
        json!({"conv": "c1", "seq": 2, "explicit": true}),
    );
    b.done(
        "b1",
        Type::Ok,
        "ack",
        id2,
        json!({"conv": "c1", "delivered": 2}),
    );
    b.done(
        "b1",
        Type::Ok,
        "ack",
        id1,
        json!({"conv": "c1", "delivered": 1}),
    );
    // A later op is compared with both.
    b.ack("b1", "c1", 2, true, 2);
    assert!(only(&b, &two_rows(), Kind::D4Decrease).is_empty());
}

#[test]
fn d4_audit_decrease_and_final_cursor_outside_the_head() {
    let b = B::new();
    let mut f = two_rows();
    // A write that keeps the cursor where it was (GREATEST) lowers nothing.
    f.cursor_audit = vec![audit("b1", Some(2), 1, 5), audit("b1", Some(2), 2, 6)];
    f.cursors = vec![
        cursor("a1", "c1", 3),
        cursor("b1", "c1", -1),
        cursor("b1", "c2", 0),
    ];
    let d4 = only(&b, &f, Kind::D4Decrease);
    assert_eq!(d4.len(), 3, "{d4:?}");
    assert!(d4
        .iter()
        .any(|a| a.msg.contains("written down from 2 to 1")));
    assert!(d4
        .iter()
        .any(|a| a.msg == "final cursor of a1 in c1 is 3, outside 0..=2 (head)"));
    assert!(d4
        .iter()
        .any(|a| a.msg == "final cursor of b1 in c1 is -1, outside 0..=2 (head)"));
}

/// D4 (b) compares with the highest `delivered` received before the invoke, not the last:
/// after 2 then 1, another 1 is below the 2 again.
#[test]
fn d4_compares_with_the_highest_delivered_so_far() {
    let mut b = B::new();
    b.ack("b1", "c1", 2, true, 2);
    b.ack("b1", "c1", 1, true, 1);
    let (inv, ok) = b.ack("b1", "c1", 1, true, 1);
    let d4 = only(&b, &two_rows(), Kind::D4Decrease);
    assert_eq!(d4.len(), 2, "{d4:?}");
    assert_eq!(d4[1].entries, vec![2, inv, ok]);
}

/// Rule 4's count: a cmid that got `sent` at least once (even after an info) or only
/// definite failures is not in doubt; one that ended in info only is, present or absent.
#[test]
fn info_sends_counts_only_the_cmids_left_in_doubt() {
    let mut b = B::new();
    b.send("a1", "c1", "x1", 1, "m1");
    let id = b.invoke(
        "a1",
        "send",
        json!({"conv": "c1", "cmid": "x2", "body_len": 1}),
    );
    b.done(
        "a1",
        Type::Fail,
        "send",
        id,
        json!({"code": "NOT_MEMBER", "msg": "no"}),
    );
    b.send_info("a1", "c1", "x3");
    b.send_info("a1", "c1", "x4");
    b.send("a1", "c1", "x4", 2, "m2");
    b.send_info("a1", "c1", "x5");
    let f = fin(&[
        ("c1", 1, "m1", "a1", "x1"),
        ("c1", 2, "m2", "a1", "x4"),
        ("c1", 3, "m3", "a1", "x5"),
    ]);
    let r = check(&b.h, &f);
    assert_eq!(
        r.stats.info_sends,
        InfoSends {
            total: 2,
            present: 1,
            absent: 1
        }
    );
    // The statistics count each send line by how it ended.
    let send = OpCounts {
        invoke: 6,
        ok: 2,
        fail: 1,
        info: 3,
    };
    assert_eq!(r.stats.ops["send"], send);
}

/// Delivery time is a device's first store of a seq minus its `sent` reply's time; repair
/// time the same where that store came from a sync.
#[test]
fn delivery_and_repair_times_run_from_the_sent_reply_to_the_first_store() {
    let mut b = B::new();
    b.send("a1", "c1", "x1", 1, "m1");
    b.wait(9.0);
    b.store("b1", "push", "c1", &[(1, "m1")]);
    b.store("b1", "push", "c1", &[(1, "m1")]);
    b.send("a1", "c1", "x2", 2, "m2");
    b.wait(4.0);
    b.store("b1", "sync", "c1", &[(2, "m2")]);
    let st = check(&b.h, &two_rows()).stats;
    let q = |n, p50, max| Quantiles {
        n,
        p50: Some(p50),
        p95: Some(max),
        max: Some(max),
    };
    assert_eq!(st.delivery_ms, q(2, 5.0, 10.0));
    assert_eq!(st.repair_ms, q(1, 5.0, 5.0));
}

/// Both kinds of frame a client could not read are counted: a push (`recv malformed`) and
/// a reply (`info` with `why: malformed-reply`); an `info` for another reason is not (two of
/// them, so that counting the other reasons instead would not give the same total).
#[test]
fn malformed_pushes_and_replies_are_counted() {
    let mut b = B::new();
    b.line(
        "b1",
        1,
        Type::Recv,
        "malformed",
        None,
        json!({"frame": {"t": "zzz"}}),
    );
    let id = b.invoke(
        "a1",
        "send",
        json!({"conv": "c1", "cmid": "x1", "body_len": 1}),
    );
    b.done(
        "a1",
        Type::Info,
        "send",
        id,
        json!({"why": MALFORMED_REPLY}),
    );
    b.send_info("a1", "c1", "x2");
    b.send_info("a1", "c1", "x3");
    assert_eq!(check(&b.h, &two_rows()).stats.malformed, 2);
}

/// Rule 12: a state-file event the device stored names the line that stored it, and an
/// epoch line of one conversation starts only that conversation afresh for that device.
#[test]
fn store_mismatch_names_the_store_line_and_an_epoch_resets_only_its_conversation() {
    let mut b = B::new();
    let st = b.store("b1", "push", "c1", &[(2, "bad")]);
    let mut f = two_rows();
    state_file(&mut f, "b1", &[(2, "bad")]);
    let sm = only(&b, &f, Kind::StoreMismatch);
    assert_eq!(sm.len(), 1, "{sm:?}");
    assert_eq!(sm[0].entries, vec![st]);

    let mut b = B::new();
    let first = b.push("b1", "c2", 1, "one");
    b.push("b2", "c1", 1, "m1");
    b.epoch("b1", "c1", 1, 2);
    let second = b.push("b1", "c2", 1, "two");
    b.push("b2", "c1", 1, "other");
    let sm = only(&b, &two_rows(), Kind::StoreMismatch);
    assert_eq!(sm.len(), 2, "{sm:?}");
    assert_eq!(sm[0].entries, vec![first, second]);

    // The same when the move shows first in a push of the newer epoch.
    let mut b = B::new();
    let push = |b: &mut B, dev: &str, conv: &str, mid: &str, epoch: i64| {
        b.line(
            dev,
            1,
            Type::Recv,
            "push",
            None,
            json!({"conv": conv, "seq": 1, "mid": mid, "sender": "alice", "cmid": "x",
                   "epoch": epoch}),
        )
    };
    let first = push(&mut b, "b1", "c2", "one", 1);
    push(&mut b, "b1", "c1", "m1", 1);
    push(&mut b, "b2", "c1", "m1", 1);
    push(&mut b, "b1", "c1", "new", 2);
    let second = push(&mut b, "b1", "c2", "two", 1);
    push(&mut b, "b2", "c1", "other", 1);
    let sm = only(&b, &two_rows(), Kind::StoreMismatch);
    assert_eq!(sm.len(), 2, "{sm:?}");
    assert_eq!(sm[0].entries, vec![first, second]);
}

#[test]
fn s1_push_or_sync_event_outside_the_membership() {
    let mut b = B::new();
    let p = b.push("b1", "c1", 1, "m1");
    let s = b.sync("b1", "c1", 0, &[(1, "m1"), (2, "m2")], 2);
    let mut f = two_rows();
    f.memberships[1].from_seq = 2;
    let s1 = only(&b, &f, Kind::S1Outside);
    assert_eq!(s1.len(), 2, "{s1:?}");
    assert_eq!(s1[0].entries, vec![p]);
    assert_eq!(s1[1].entries, vec![s]);
    assert_eq!(
        s1[0].msg,
        "b1 (bob) received c1 seqs 1 by push at line 1, outside bob's periods of c1: [2, ∞)"
    );
}

#[test]
fn events_inside_the_membership_are_not_s1() {
    let mut b = B::new();
    b.push("b1", "c1", 2, "m2");
    b.sync("b1", "c1", 1, &[(2, "m2")], 2);
    let mut f = two_rows();
    f.memberships[1].from_seq = 2;
    assert!(only(&b, &f, Kind::S1Outside).is_empty());
}

/// A `subbed` of `dev` showing `conv` at `epoch`.
fn subbed(b: &mut B, dev: &str, conv: &str, epoch: i64) -> u64 {
    let id = b.invoke(dev, "sub", json!({}));
    b.done(
        dev,
        Type::Ok,
        "sub",
        id,
        json!({"convs": [{"conv": conv, "head": 0, "delivered": 0, "epoch": epoch}]}),
    )
}

/// Issue 42 (`hint-past-leave`): a hint's head is the last event its device may see, so
/// a hint one past a member's leave is S1-outside; the hint at the period's last event,
/// and a hint at 0 (nothing to see), are not.
#[test]
fn s1_a_hint_past_the_leave_is_outside_the_membership() {
    let mut b = B::new();
    subbed(&mut b, "b1", "c1", 1);
    b.hint("b1", "c1", 1, "sweep");
    b.hint("b1", "c1", 0, "sweep");
    let past = b.hint("b1", "c1", 2, "sweep");
    let mut f = two_rows();
    f.memberships[1].to_seq = Some(2);
    let s1 = only(&b, &f, Kind::S1Outside);
    assert_eq!(s1.len(), 1, "{s1:?}");
    assert_eq!(s1[0].entries, vec![past]);
    assert_eq!(
        s1[0].msg,
        format!(
            "b1 (bob) was hinted at c1 head 2 at line {past}, outside bob's periods of c1: [1, 2)"
        )
    );
}

/// A hint carries no epoch: judged only while its device's newest view of the
/// conversation is the conversation's newest epoch, and not where no epoch was seen.
#[test]
fn s1_judges_a_hint_only_under_the_newest_epoch_its_device_saw() {
    let mut f = two_rows();
    f.memberships[1].to_seq = Some(2);
    let mut b = B::new();
    b.hint("b1", "c1", 2, "sweep");
    subbed(&mut b, "b1", "c1", 1);
    b.hint("b1", "c1", 2, "sweep");
    subbed(&mut b, "a1", "c1", 2);
    assert!(only(&b, &f, Kind::S1Outside).is_empty());
    subbed(&mut b, "b1", "c1", 2);
    let judged = b.hint("b1", "c1", 2, "sweep");
    let s1 = only(&b, &f, Kind::S1Outside);
    assert_eq!(s1.len(), 1, "{s1:?}");
    assert_eq!(s1[0].entries, vec![judged]);
}

/// A hello of `dev` answered `kind` (`Info` or `Fail`) with `value`; returns that line.
fn hello_refused(b: &mut B, dev: &str, kind: Type, value: Value) -> u64 {
    let id = b.invoke(dev, "hello", json!({"device": dev, "epoch": 1}));
    b.done(dev, kind, "hello", id, value)
}

/// D5 (issue 42, `outage-charges-hello`): a hello refused over the failed-hello limit is an
/// anomaly unless some hello before it was refused by the database; an outage's
/// `UNAVAILABLE` earns nothing, and another limit's `UNAVAILABLE` is not this one.
#[test]
fn d5_a_hello_throttled_with_no_refused_hello_before_it_is_a_lockout() {
    let throttled = json!({"why": "UNAVAILABLE", "msg": im_protocol::error::HELLO_THROTTLED});
    let mut b = B::new();
    for _ in 0..3 {
        hello_refused(
            &mut b,
            "a1",
            Type::Info,
            json!({"why": "UNAVAILABLE", "msg": "database unavailable, retry later"}),
        );
    }
    hello_refused(
        &mut b,
        "a1",
        Type::Info,
        json!({"why": "UNAVAILABLE", "msg": "too many connections for this device"}),
    );
    let locked = hello_refused(&mut b, "a1", Type::Info, throttled.clone());
    let d5 = only(&b, &two_rows(), Kind::D5LockedOut);
    assert_eq!(d5.len(), 1, "{d5:?}");
    assert_eq!(d5[0].entries, vec![locked]);
    assert!(
        d5[0]
            .msg
            .starts_with(&format!("a1's hello at line {locked} was refused")),
        "{}",
        d5[0].msg
    );

    // Earned: another device's hello refused UNAUTHENTICATED first (the address's limit).
    for refused in ["UNAUTHENTICATED", "STALE_INSTALL"] {
        let mut b = B::new();
        hello_refused(
            &mut b,
            "x9",
            Type::Fail,
            json!({"code": refused, "msg": "no"}),
        );
        hello_refused(&mut b, "a1", Type::Info, throttled.clone());
        assert!(
            only(&b, &two_rows(), Kind::D5LockedOut).is_empty(),
            "{refused}"
        );
    }

    // Not earned: a hello failed for another reason, or another op refused UNAUTHENTICATED.
    for (op, code) in [("hello", "BAD_REQUEST"), ("send", "UNAUTHENTICATED")] {
        let mut b = B::new();
        let args = match op {
            "hello" => json!({"device": "x9", "epoch": 1}),
            _ => json!({"conv": "c1", "cmid": "y1", "body_len": 1}),
        };
        let id = b.invoke("x9", op, args);
        b.done("x9", Type::Fail, op, id, json!({"code": code, "msg": "no"}));
        hello_refused(&mut b, "a1", Type::Info, throttled.clone());
        assert_eq!(
            only(&b, &two_rows(), Kind::D5LockedOut).len(),
            1,
            "{op} {code}"
        );
    }
}

#[test]
fn d5_not_repaired_only_for_non_empty_missing_lists() {
    let mut b = B::new();
    let ok2 = b.send("a1", "c1", "x2", 2, "m2");
    let mut f = two_rows();
    f.liveness.waited_ms = 2500.0;
    f.liveness
        .missing
        .insert("a1".into(), BTreeMap::from([("c1".to_string(), vec![])]));
    assert!(only(&b, &f, Kind::D5NotRepaired).is_empty());
    f.liveness
        .missing
        .insert("b1".into(), BTreeMap::from([("c1".to_string(), vec![2])]));
    let d5 = only(&b, &f, Kind::D5NotRepaired);
    assert_eq!(d5.len(), 1);
    assert_eq!(
        d5[0].msg,
        "b1 still misses c1 seqs 2 after the judge waited 2500 ms (bound 2000 ms)"
    );
    assert_eq!(d5[0].entries, vec![ok2]);
}

#[test]
fn d5_sweep_hints_too_far_apart() {
    let mut b = B::new();
    b.gateway_start(1000);
    let h1 = b.hint("b1", "c1", 2, "sweep");
    b.wait(2500.0);
    let h2 = b.hint("b1", "c1", 2, "sweep");
    let r = check(&b.h, &two_rows());
    let late: Vec<_> = r
        .anomalies
        .iter()
        .filter(|a| a.kind == Kind::D5SweepLate)
        .collect();
    assert_eq!(late.len(), 1, "{late:?}");
    assert_eq!(late[0].entries, vec![h1, h2]);
    assert!(
        late[0]
            .msg
            .contains("2501 ms apart (sweep_ms 1000, allowed 2000 ms)"),
        "{}",
        late[0].msg
    );
    assert_eq!(
        r.stats.sweep_hint_gaps_ms,
        GapQuantiles {
            n: 1,
            p50: Some(2501.0),
            max: Some(2501.0)
        }
    );
}

/// Seed 829's shape: the harness stalled 1.7 s, then recorded the queued hints; its
/// watchdog's `observer-stall` line may come after them. The gap is not judged, and the
/// same gap with the stall elsewhere still is.
#[test]
fn d5_sweep_gap_across_an_observer_stall_is_not_judged() {
    // Where the stall is, relative to the two hints; only a stall that overlaps the open
    // interval between them excuses the gap (one that touches an end does not).
    for (stall_inside, want) in [
        ("inside", 0),
        ("after", 1),
        ("from the second", 1),
        ("to the first", 1),
    ] {
        let mut b = B::new();
        b.gateway_start(500);
        b.hint("b1", "c1", 2, "sweep");
        let t1 = b.t;
        b.wait(1900.0);
        b.hint("b1", "c1", 2, "sweep");
        let (from, to) = match stall_inside {
            "inside" => (t1 + 100.0, t1 + 1850.0),
            "after" => (b.t + 10.0, b.t + 400.0),
            "from the second" => (b.t, b.t + 400.0),
            _ => (t1 - 400.0, t1),
        };
        b.wait(500.0);
        b.line(
            "harness",
            0,
            Type::Nemesis,
            "observer-stall",
            None,
            json!({"phase": "instant", "from_ms": from, "to_ms": to,
                   "cause": "the harness was not run"}),
        );
        let r = check(&b.h, &two_rows());
        let late = r
            .anomalies
            .iter()
            .filter(|a| a.kind == Kind::D5SweepLate)
            .count();
        assert_eq!(
            late, want,
            "stall inside the gap: {stall_inside}: {:?}",
            r.anomalies
        );
    }
}

#[test]
fn d5_sweep_median_too_slow() {
    let mut b = B::new();
    b.gateway_start(1000);
    b.hint("b1", "c1", 2, "sweep");
    for _ in 0..3 {
        b.wait(1799.0);
        b.hint("b1", "c1", 2, "sweep");
    }
    let late = only(&b, &two_rows(), Kind::D5SweepLate);
    assert_eq!(late.len(), 1, "{late:?}");
    assert!(
        late[0].msg.contains("every 1800 ms (median of 3 gaps)"),
        "{}",
        late[0].msg
    );
    assert_eq!(late[0].entries.len(), 4);
}

/// The bounds themselves are allowed: a gap of exactly `sweep_ms` + 1000 ms, and a median
/// of exactly 1.5 × `sweep_ms`, are not late; a millisecond more is.
#[test]
fn d5_sweep_bounds_are_inclusive() {
    let late = |sweep_ms: u64, gap_ms: f64, gaps: usize| {
        let mut b = B::new();
        b.gateway_start(sweep_ms);
        b.hint("b1", "c1", 2, "sweep");
        for _ in 0..gaps {
            b.wait(gap_ms - 1.0);
            b.hint("b1", "c1", 2, "sweep");
        }
        only(&b, &two_rows(), Kind::D5SweepLate).len()
    };
    assert_eq!(late(500, 1500.0, 1), 0);
    assert_eq!(late(500, 1501.0, 1), 1);
    assert_eq!(late(1000, 1500.0, 3), 0);
    assert_eq!(late(1000, 1501.0, 3), 1);
}

#[test]
fn sweep_hints_are_not_late_across_an_ack_a_reconnect_or_a_gateway_start() {
    let mut b = B::new();
    b.gateway_start(1000);
    b.hint("b1", "c1", 2, "sweep");
    b.wait(5000.0);
    b.ack("b1", "c1", 2, false, 2); // caught up: the next hint is a new episode
    b.wait(5000.0);
    b.hint("b1", "c1", 3, "sweep");
    b.wait(5000.0);
    b.client("b1", "disconnect");
    b.hint("b1", "c1", 3, "sweep");
    b.wait(5000.0);
    b.gateway_start(1000);
    b.hint("b1", "c1", 3, "sweep");
    b.hint("b1", "c1", 3, "overflow"); // not a sweep hint
    b.hint("a1", "c1", 3, "sweep"); // another device
    b.wait(900.0);
    b.hint("b1", "c1", 3, "sweep");
    // An ack below the head does not end the episode, and the gap is fine.
    b.ack("b1", "c1", 2, false, 2);
    b.hint("b1", "c1", 3, "sweep");
    let r = check(&b.h, &two_rows());
    assert_eq!(r.counts[&Kind::D5SweepLate], 0, "{:?}", r.anomalies);
    assert_eq!(r.stats.sweep_hint_gaps_ms.n, 2);
}

/// A sweep hint before the database went away and the next one after it came back
/// are not one late interval (a failover under pg_auto_failover takes seconds); a gap
/// after the fault is judged again.
#[test]
fn sweep_hints_are_not_late_across_a_database_outage() {
    let mut b = B::new();
    b.gateway_start(1000);
    b.hint("b1", "c1", 2, "sweep");
    b.wait(100.0);
    b.line(
        "harness",
        0,
        Type::Nemesis,
        "pg-primary-kill",
        None,
        json!({"phase": "start"}),
    );
    b.wait(6900.0);
    b.hint("b1", "c1", 2, "sweep");
    b.wait(1500.0);
    b.hint("b1", "c1", 2, "sweep");
    // Until the address moves to the promoted standby, the sweep's queries time out.
    b.wait(2500.0);
    b.hint("b1", "c1", 2, "sweep");
    assert!(only(&b, &two_rows(), Kind::D5SweepLate).is_empty());
    b.line(
        "harness",
        0,
        Type::Nemesis,
        "db-address-switch",
        None,
        json!({"phase": "instant", "to": "127.0.0.1:5433"}),
    );
    b.hint("b1", "c1", 2, "sweep");
    b.wait(2500.0);
    let h = b.hint("b1", "c1", 2, "sweep");
    let late = only(&b, &two_rows(), Kind::D5SweepLate);
    assert_eq!(late.len(), 1, "{late:?}");
    assert_eq!(late[0].entries[1], h);
}

/// A crashed database is down until a restart succeeds: a failed restart excuses the
/// gaps after it too; after a successful one, gaps are judged again.
#[test]
fn sweep_hints_are_not_judged_until_the_database_is_restarted() {
    let mut b = B::new();
    b.gateway_start(200);
    let db_action = |b: &mut B, op: &str, id: u64, v: Value| {
        b.line("harness", 0, Type::Nemesis, op, Some(id), v);
    };
    db_action(&mut b, "pg-crash", 1, json!({"phase": "start"}));
    db_action(&mut b, "pg-crash", 1, json!({"phase": "end", "ok": true}));
    for _ in 0..4 {
        b.hint("b1", "c1", 2, "sweep");
        b.wait(1500.0);
    }
    db_action(&mut b, "pg-restart", 2, json!({"phase": "start"}));
    db_action(
        &mut b,
        "pg-restart",
        2,
        json!({"phase": "end", "ok": false}),
    );
    for _ in 0..4 {
        b.hint("b1", "c1", 2, "sweep");
        b.wait(1500.0);
    }
    assert!(only(&b, &two_rows(), Kind::D5SweepLate).is_empty());
    db_action(&mut b, "pg-restart", 3, json!({"phase": "start"}));
    db_action(&mut b, "pg-restart", 3, json!({"phase": "end", "ok": true}));
    b.hint("b1", "c1", 2, "sweep");
    b.wait(1500.0);
    let h = b.hint("b1", "c1", 2, "sweep");
    let late = only(&b, &two_rows(), Kind::D5SweepLate);
    assert_eq!(late.len(), 1, "{late:?}");
    assert_eq!(late[0].entries[1], h);
}

/// Issue 10: hints received while a nemesis fault is in force (here a gateway pause)
/// are not judged, nor a gap that spans its start or end; a membership change excuses
/// nothing; a late gap with no fault in force is still caught.
#[test]
fn sweep_hints_are_not_judged_while_a_fault_is_in_force() {
    let pause = json!({"id": 1, "at_ms": 100, "end_ms": 6100, "target": "gateway",
                       "kind": "gw-pause", "leaves_the_sweep_alone": false});
    let mut b = B::new();
    b.gateway_start(1000);
    b.hint("b1", "c1", 2, "sweep");
    b.wait(100.0);
    b.line(
        "harness",
        0,
        Type::Nemesis,
        "fault",
        Some(77),
        json!({"phase": "start", "fault": pause.clone(), "healed": false}),
    );
    b.wait(3000.0);
    b.hint("b1", "c1", 2, "sweep");
    b.wait(3000.0);
    b.hint("b1", "c1", 2, "sweep");
    b.line(
        "harness",
        0,
        Type::Nemesis,
        "fault",
        Some(77),
        json!({"phase": "end", "fault": pause, "healed": false}),
    );
    b.wait(900.0);
    b.hint("b1", "c1", 2, "sweep");
    b.wait(900.0);
    b.hint("b1", "c1", 2, "sweep");
    assert!(only(&b, &two_rows(), Kind::D5SweepLate).is_empty());
    b.line(
        "harness",
        0,
        Type::Nemesis,
        "membership",
        None,
        json!({"phase": "instant", "action": "join", "conv": "c1", "user": "carol",
               "applied_by_an_earlier_attempt": false}),
    );
    b.wait(2500.0);
    let h = b.hint("b1", "c1", 2, "sweep");
    let late = only(&b, &two_rows(), Kind::D5SweepLate);
    assert_eq!(late.len(), 1, "{late:?}");
    assert_eq!(late[0].entries[1], h);
}

/// Issue 10: a frame dropped by the gateway (a push, an ack before it takes effect)
/// leaves the sweep alone, so a late gap while it is in force is caught; a dropped
/// ack reply is not judged (the ack took effect and the sweep stopped hinting). Issue 20:
/// the same for a crashed client, as the client package declares. Issue 43: the judge
/// does not know the kinds: the fault's line says whether it leaves the sweep alone, as
/// the nemesis wrote it, and the same fault with the other answer is judged the other way.
#[test]
fn sweep_hints_are_judged_while_a_harmless_fault_is_in_force() {
    let fault = |b: &mut B, id: u64, point: &str, leaves: bool, phase: &str| {
        let f = json!({"id": id, "at_ms": 0, "end_ms": 2000, "target": "gateway",
                       "kind": "gw-fault", "point": point, "action": "drop",
                       "leaves_the_sweep_alone": leaves});
        let v = json!({"phase": phase, "fault": f, "healed": false});
        b.line("harness", 0, Type::Nemesis, "fault", Some(id), v);
    };
    let mut b = B::new();
    b.gateway_start(500);
    fault(&mut b, 5, "gw.recv.ack", true, "start");
    b.hint("b1", "c1", 2, "sweep");
    b.wait(1600.0);
    let h = b.hint("b1", "c1", 2, "sweep");
    fault(&mut b, 5, "gw.recv.ack", true, "end");
    let late = only(&b, &two_rows(), Kind::D5SweepLate);
    assert_eq!(late.len(), 1, "{late:?}");
    assert_eq!(late[0].entries[1], h);

    let mut b = B::new();
    b.gateway_start(500);
    fault(&mut b, 6, "gw.reply.ack", false, "start");
    b.hint("b1", "c1", 2, "sweep");
    b.wait(1600.0);
    b.hint("b1", "c1", 2, "sweep");
    fault(&mut b, 6, "gw.reply.ack", false, "end");
    assert!(only(&b, &two_rows(), Kind::D5SweepLate).is_empty());

    // The line decides, not the kind: the first fault again, said to disturb the sweep.
    let mut b = B::new();
    b.gateway_start(500);
    fault(&mut b, 5, "gw.recv.ack", false, "start");
    b.hint("b1", "c1", 2, "sweep");
    b.wait(1600.0);
    b.hint("b1", "c1", 2, "sweep");
    fault(&mut b, 5, "gw.recv.ack", false, "end");
    assert!(only(&b, &two_rows(), Kind::D5SweepLate).is_empty());

    // A crashed client (its package says it leaves the sweep alone) excuses nothing.
    let crash = json!({"id": 7, "at_ms": 0, "end_ms": 2000, "target": "a1",
                       "kind": "client-crash", "leaves_the_sweep_alone": true});
    let mut b = B::new();
    b.gateway_start(500);
    let v = |phase: &str| json!({"phase": phase, "fault": crash.clone(), "healed": false});
    b.line("harness", 0, Type::Nemesis, "fault", Some(7), v("start"));
    b.hint("b1", "c1", 2, "sweep");
    b.wait(1600.0);
    let h = b.hint("b1", "c1", 2, "sweep");
    b.line("harness", 0, Type::Nemesis, "fault", Some(7), v("end"));
    let late = only(&b, &two_rows(), Kind::D5SweepLate);
    assert_eq!(late.len(), 1, "{late:?}");
    assert_eq!(late[0].entries[1], h);
}

/// Issue 43: a history of schema_version 2 (fault lines without
/// `leaves_the_sweep_alone`) is still read, each fault line given the answer the harness
/// of version 2 gave when it judged: a `client-crash` and a frame dropped or refused at a
/// point other than `gw.reply.ack` leave the sweep alone, anything else does not. A
/// version-3 line without the field does not parse; a version the reader does not know is
/// refused by number.
#[test]
fn a_version_2_history_is_read_with_the_answers_of_version_2() {
    let open = |v: u32| {
        json!({"i": 0, "t_ms": 0.0, "wall_us": WALL0, "process": "harness", "instance": 0,
               "type": "meta", "op": "open", "op_id": null, "value": {"schema_version": v}})
    };
    let fault = |i: u64, kind: &str, point: Option<&str>, action: Option<&str>| {
        let mut f = json!({"id": i, "at_ms": 0, "end_ms": 10, "target": "gateway",
                           "kind": kind});
        if let (Some(p), Some(a)) = (point, action) {
            f["point"] = json!(p);
            f["action"] = json!(a);
        }
        json!({"i": i, "t_ms": i as f64, "wall_us": WALL0, "process": "harness",
               "instance": 0, "type": Type::Nemesis, "op": "fault", "phase": "start",
               "op_id": i, "value": {"fault": f, "healed": false}})
    };
    let gw = json!({"i": 6, "t_ms": 6.0, "wall_us": WALL0, "process": "harness",
                    "instance": 0, "type": Type::Nemesis, "op": "gw-fault", "phase": "start",
                    "op_id": 6, "value": {"point": "gw.push", "action": "error",
                    "spec": "gw.push:error", "gateway": 0}});
    let lines = [
        open(2),
        fault(1, "client-crash", None, None),
        fault(2, "gw-fault", Some("gw.push"), Some("drop")),
        fault(3, "gw-fault", Some("gw.reply.ack"), Some("drop")),
        fault(4, "gw-fault", Some("gw.push"), Some("delay(300)")),
        fault(5, "gw-pause", None, None),
        gw,
    ];
    let text = |lines: &[Value]| lines.iter().map(|l| format!("{l}\n")).collect::<String>();
    let h = crate::history::parse(&text(&lines)).unwrap();
    let leaves: Vec<bool> = h[1..]
        .iter()
        .map(|e| match &e.line {
            Line::Nemesis(n) => sweep::fault_leaves_the_sweep_alone(&n.action),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(leaves, [true, true, false, false, false, true]);
    // The params stay beside the kind, as the schedule wrote them.
    let Line::Nemesis(Nemesis {
        action: Action::Fault { fault, .. },
        ..
    }) = &h[2].line
    else {
        panic!("{:?}", h[2]);
    };
    assert_eq!(
        (fault.kind.as_str(), fault.target.as_str()),
        ("gw-fault", "gateway")
    );
    assert_eq!(fault.params["point"], json!("gw.push"));

    let mut v3 = lines.to_vec();
    v3[0] = open(3);
    let e = format!("{:#}", crate::history::parse(&text(&v3)).unwrap_err());
    assert!(
        e.contains("line 2") && e.contains("leaves_the_sweep_alone"),
        "{e}"
    );
    for v in [1, 4] {
        let mut other = lines.to_vec();
        other[0] = open(v);
        let e = format!("{:#}", crate::history::parse(&text(&other)).unwrap_err());
        assert!(e.contains(&format!("schema_version Some({v})")), "{e}");
    }
}

#[test]
fn sweep_ms_falls_back_to_the_final_read() {
    let mut b = B::new();
    b.hint("b1", "c1", 2, "sweep");
    b.wait(2500.0);
    b.hint("b1", "c1", 2, "sweep");
    let mut f = two_rows();
    assert_eq!(only(&b, &f, Kind::D5SweepLate).len(), 1);
    f.sweep_ms = 2000;
    assert!(only(&b, &f, Kind::D5SweepLate).is_empty());
}

#[test]
fn store_mismatch_state_file_or_two_mids_for_one_seq() {
    let mut b = B::new();
    let p1 = b.push("b1", "c1", 1, "m1");
    let st = b.store("b1", "push", "c1", &[(1, "m1")]);
    let s2 = b.sync("b1", "c1", 0, &[(1, "zz")], 2);
    let mut f = two_rows();
    state_file(&mut f, "b1", &[(1, "m1"), (2, "bad"), (3, "m3")]);
    let sm = only(&b, &f, Kind::StoreMismatch);
    assert_eq!(sm.len(), 3, "{sm:?}");
    assert_eq!(sm[0].entries, vec![p1, s2]);
    assert_eq!(
        sm[0].msg,
        format!("b1 received c1:1 as mid m1 (line {p1}) and as mid zz (line {s2})")
    );
    assert!(sm
        .iter()
        .any(|a| a.msg == "b1's state file holds c1:2 = mid bad but the row has mid m2"));
    assert!(
        sm.iter()
            .any(|a| a.msg
                == "b1's state file holds c1:3 = mid m3 but the final read has no such row")
    );
    assert!(st > p1);
}

#[test]
fn a_push_received_twice_with_one_mid_is_not_a_mismatch() {
    let mut b = B::new();
    b.push("b1", "c1", 1, "m1");
    b.push("b1", "c1", 1, "m1");
    b.store("b1", "push", "c1", &[(1, "m1")]);
    b.sync("b1", "c1", 0, &[(1, "m1")], 1);
    let mut f = fin(&[("c1", 1, "m1", "a1", "x1")]);
    state_file(&mut f, "b1", &[(1, "m1")]);
    let r = check(&b.h, &f);
    assert_eq!(r.counts[&Kind::StoreMismatch], 0, "{:?}", r.anomalies);
}

#[test]
fn reply_or_push_before_commit_when_a_probe_misses_the_row() {
    let mut b = B::new();
    let ok = b.send("a1", "c1", "x1", 1, "m1");
    let pr = b.probe(ok, "c1", 1, "m1", None, None);
    let p = b.push("b1", "c1", 1, "m1");
    let pp = b.probe(p, "c1", 1, "m1", Some("other"), None);
    let r = check(&b.h, &fin(&[("c1", 1, "m1", "a1", "x1")]));
    let k: Vec<_> = r
        .anomalies
        .iter()
        .map(|a| (a.kind, a.entries.clone()))
        .collect();
    assert_eq!(
        k,
        vec![
            (Kind::ReplyBeforeCommit, vec![ok, pr]),
            (Kind::PushBeforeCommit, vec![p, pp])
        ]
    );
    assert_eq!(
        r.anomalies[0].msg,
        format!("a1's sent reply c1:1 (mid m1, line {ok}) was not visible to another session: found no row (probe line {pr})")
    );
    assert_eq!(
        r.summary(),
        "FAIL: 2 anomalies: reply-before-commit=1, push-before-commit=1"
    );
}

#[test]
fn a_probe_with_an_error_is_ignored() {
    let mut b = B::new();
    let ok = b.send("a1", "c1", "x1", 1, "m1");
    b.probe(ok, "c1", 1, "m1", None, Some("connection refused"));
    let r = check(&b.h, &fin(&[("c1", 1, "m1", "a1", "x1")]));
    assert_eq!(r.verdict, Verdict::Pass, "{:?}", r.anomalies);
    assert_eq!(
        r.stats.probes,
        ProbeCounts {
            total: 1,
            visible: 0,
            errors: 1
        }
    );
}

#[test]
fn anomalies_are_ordered_by_kind_then_first_entry() {
    let mut b = B::new();
    let ok = b.send("a1", "c1", "x1", 1, "m1");
    b.probe(ok, "c1", 1, "m1", None, None);
    b.send("a1", "c1", "x9", 9, "m9");
    let f = fin(&[("c1", 1, "m1", "a1", "x1"), ("c1", 3, "m3", "z1", "q")]);
    let k = kinds(&b, &f);
    assert_eq!(
        k,
        vec!["lost", "unexpected", "p1-gap", "reply-before-commit"]
    );
}

#[test]
fn load_dir_reads_both_files_and_refuses_another_schema() {
    let tmp = tempfile::Builder::new()
        .prefix("imfault-checker-")
        .tempdir()
        .unwrap();
    let dir = tmp.path().to_path_buf();
    let mut b = B::new();
    b.send("a1", "c1", "x1", 1, "m1");
    let lines: Vec<String> =
        b.h.iter()
            .map(|e| serde_json::to_string(e).unwrap())
            .collect();
    std::fs::write(dir.join("history.jsonl"), lines.join("\n") + "\n").unwrap();
    let f = fin(&[("c1", 1, "m1", "a1", "x1")]);
    std::fs::write(dir.join("final.json"), serde_json::to_string(&f).unwrap()).unwrap();
    let (h, f2) = load_dir(&dir).unwrap();
    assert_eq!((h, f2), (b.h.clone(), f));

    std::fs::write(dir.join("final.json"), r#"{"schema_version": 2}"#).unwrap();
    let e = load_dir(&dir).unwrap_err().to_string();
    assert!(e.contains("schema_version Some(2)"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
    let e = format!("{:#}", load_dir(&dir).unwrap_err());
    assert!(e.contains("history.jsonl"), "{e}");
}

#[test]
fn a_history_of_twenty_thousand_lines_is_judged_quickly() {
    let mut b = B::new();
    let n = 3000;
    let mut rows = Vec::new();
    let mids: Vec<String> = (1..=n).map(|q| format!("m{q}")).collect();
    let cmids: Vec<String> = (1..=n).map(|q| format!("x{q}")).collect();
    for q in 1..=n {
        let (mid, cmid) = (&mids[q as usize - 1], &cmids[q as usize - 1]);
        let ok = b.send("a1", "c1", cmid, q, mid);
        b.probe(ok, "c1", q, mid, Some(mid), None);
        b.push("b1", "c1", q, mid);
        b.store("b1", "push", "c1", &[(q, mid)]);
        b.ack("b1", "c1", q, false, q);
        rows.push(("c1", q, mid.as_str(), "a1", cmid.as_str()));
    }
    assert!(b.h.len() > 20_000);
    let started = std::time::Instant::now();
    let r = check(&b.h, &fin(&rows));
    assert_eq!(r.verdict, Verdict::Pass, "{:?}", &r.anomalies[..1]);
    assert_eq!(r.stats.delivery_ms.n, n as u64);
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
}

impl B {
    /// The promoted standby's epoch (2) of c1, as a device saw it: a push of m1 to b1.
    fn promoted_epoch_seen(&mut self) -> u64 {
        self.line(
            "b1",
            1,
            Type::Recv,
            "push",
            None,
            json!({"conv": "c1", "seq": 1, "mid": "m1", "sender": "alice", "cmid": "x1",
                   "epoch": 2}),
        )
    }

    /// An `epoch` line: `dev` discarded what it held of `conv` (issue 21).
    fn epoch(&mut self, dev: &str, conv: &str, from: i64, to: i64) -> u64 {
        self.line(
            dev,
            1,
            Type::Store,
            "epoch",
            None,
            json!({"conv": conv, "from": from, "to": to, "dropped": 1}),
        )
    }
}

/// Issue 21: a device that received a message the database does not have at that seq is
/// an anomaly (`held-lost`) unless an epoch change of the conversation reached it after
/// the receipt; one before it does not excuse it.
#[test]
fn held_lost_unless_an_epoch_change_reached_the_device_afterwards() {
    let mut b = B::new();
    let p = b.push("b1", "c1", 2, "gone");
    let s = b.sync("b1", "c1", 2, &[(3, "never")], 3);
    let held = only(&b, &two_rows(), Kind::HeldLost);
    assert_eq!(held.len(), 2, "{held:?}");
    assert_eq!(held[0].entries, vec![p]);
    assert_eq!(
        held[0].msg,
        format!(
            "b1 received c1:2 = mid gone (line {p}) but the row has mid m2, and no epoch \
             change of c1 reached it afterwards"
        )
    );
    assert_eq!(held[1].entries, vec![s]);
    // Told afterwards: excused. Another device, or another conversation, is not told.
    b.epoch("b1", "c1", 1, 2);
    assert!(only(&b, &two_rows(), Kind::HeldLost).is_empty());
    b.push("b2", "c1", 2, "gone");
    b.epoch("b2", "c2", 1, 2);
    assert_eq!(only(&b, &two_rows(), Kind::HeldLost).len(), 1);
    // Told before the receipt: not excused.
    let mut b = B::new();
    b.epoch("b1", "c1", 1, 2);
    b.push("b1", "c1", 2, "gone");
    assert_eq!(only(&b, &two_rows(), Kind::HeldLost).len(), 1);
}

/// Issue 21: across an epoch change a device may get another message at a seq it had, and
/// a `delivered` below one it saw in the old epoch: neither is `store-mismatch` nor D4.
/// Without the change both are.
#[test]
fn an_epoch_change_starts_the_seqs_and_cursors_of_a_device_afresh() {
    let sub = |b: &mut B, epoch: i64| {
        let id = b.invoke("b1", "sub", json!({}));
        b.done(
            "b1",
            Type::Ok,
            "sub",
            id,
            json!({"convs": [{"conv": "c1", "head": 2, "delivered": 0, "epoch": epoch}]}),
        );
    };
    for moved in [false, true] {
        let mut b = B::new();
        sub(&mut b, 1);
        b.push("b1", "c1", 2, "old");
        b.ack("b1", "c1", 2, true, 2);
        sub(&mut b, if moved { 2 } else { 1 });
        if moved {
            b.epoch("b1", "c1", 1, 2);
        }
        b.push("b1", "c1", 2, "m2");
        let f = two_rows();
        let n = usize::from(!moved);
        assert_eq!(only(&b, &f, Kind::StoreMismatch).len(), n, "moved {moved}");
        assert_eq!(only(&b, &f, Kind::D4Decrease).len(), n, "moved {moved}");
        assert_eq!(only(&b, &f, Kind::HeldLost).len(), n, "moved {moved}");
    }
}

/// Issue 21: the transport records a push before the client applies it, so a push of a
/// newer epoch can precede the client's `epoch` line: it starts the conversation's seqs
/// afresh too. Two mids at one seq within one epoch stay a mismatch.
#[test]
fn a_push_of_a_newer_epoch_starts_the_seqs_afresh() {
    for (second_epoch, mismatches) in [(2, 0), (1, 1)] {
        let mut b = B::new();
        for (mid, epoch) in [("old", 1), ("m2", second_epoch)] {
            b.line(
                "b1",
                1,
                Type::Recv,
                "push",
                None,
                json!({"conv": "c1", "seq": 2, "mid": mid, "sender": "alice", "cmid": "x",
                       "epoch": epoch}),
            );
        }
        b.epoch("b1", "c1", 1, 2);
        let sm = only(&b, &two_rows(), Kind::StoreMismatch);
        assert_eq!(sm.len(), mismatches, "epoch {second_epoch}: {sm:?}");
    }
}

/// Issue 21: after an asynchronous standby's promotion, a `sent` naming an older epoch than
/// the newest its conversation had (committed on the old primary) and missing after is the
/// failover's expected loss, reported and not an anomaly, whenever its reply came; one
/// naming the newest epoch (committed on the promoted standby) is `lost`, and so is any
/// loss with a synchronous standby.
#[test]
fn an_asynchronous_failover_loss_is_expected_not_an_anomaly() {
    let f = fin(&[("c1", 1, "m1", "a1", "x1")]);
    let judged = |synchronous: bool, second_epoch: i64| {
        let mut b = B::new();
        b.send("a1", "c1", "x1", 1, "m1");
        b.line(
            "harness",
            0,
            Type::Nemesis,
            "replication-link-cut",
            None,
            json!({"phase": "instant", "synchronous": synchronous}),
        );
        // Answered after the cut, under the epoch it was committed in.
        let id = b.invoke(
            "a1",
            "send",
            json!({"conv": "c1", "cmid": "x2", "body_len": 1}),
        );
        b.done(
            "a1",
            Type::Ok,
            "send",
            id,
            json!({"conv": "c1", "seq": 2, "mid": "m2", "dup": false, "epoch": second_epoch}),
        );
        b.promoted_epoch_seen();
        check(&b.h, &f)
    };
    for (synchronous, second_epoch, lost, expected) in
        [(false, 1, 0, 1), (false, 2, 1, 0), (true, 1, 1, 0)]
    {
        let r = judged(synchronous, second_epoch);
        assert_eq!(
            r.counts[&Kind::Lost],
            lost,
            "{synchronous} {second_epoch}: {}",
            r.summary()
        );
        assert_eq!(r.expected_loss.len(), expected, "{:?}", r.expected_loss);
    }
}

/// Issue 21: an event read under an older epoch than the newest its conversation had
/// belongs to a lost history; the final read's periods are the new lineage's, so S1 does
/// not judge it. The same event in the newest epoch is judged.
#[test]
fn s1_does_not_judge_an_event_of_a_lost_history() {
    let push = |b: &mut B, epoch: i64| {
        b.line(
            "b1",
            1,
            Type::Recv,
            "push",
            None,
            json!({"conv": "c1", "seq": 1, "mid": "m1", "sender": "alice", "cmid": "x",
                   "epoch": epoch}),
        )
    };
    let mut f = two_rows();
    f.memberships[1].from_seq = 2;
    let mut b = B::new();
    push(&mut b, 1);
    push(&mut b, 2);
    let s1 = only(&b, &f, Kind::S1Outside);
    assert_eq!(s1.len(), 1, "{s1:?}");
    assert_eq!(s1[0].entries, vec![2]);
}

/// Issue 21 and D1: after an asynchronous standby's promotion, a probe taken once the
/// gateways' database address moved to the standby, that does not find the event of a
/// reply or push of the old epoch (committed on the old primary after the link was cut),
/// read another history: it is neither `reply-before-commit` nor `push-before-commit`. The
/// same probe before the move, with a synchronous standby, or of an event under the newest
/// epoch is judged.
#[test]
fn a_probe_of_the_promoted_standby_judges_no_event_of_the_old_primary() {
    let f = fin(&[("c1", 1, "m1", "a1", "x1")]);
    let nemesis = |b: &mut B, op: &str, v: Value| b.line("harness", 0, Type::Nemesis, op, None, v);
    let judged = |synchronous: bool, probe_after_move: bool, epoch: i64| {
        let mut b = B::new();
        nemesis(
            &mut b,
            "replication-link-cut",
            json!({"phase": "instant", "synchronous": synchronous}),
        );
        let id = b.invoke(
            "a1",
            "send",
            json!({"conv": "c1", "cmid": "x2", "body_len": 1}),
        );
        let ok = b.done(
            "a1",
            Type::Ok,
            "send",
            id,
            json!({"conv": "c1", "seq": 2, "mid": "m2", "dup": false, "epoch": epoch}),
        );
        let push = b.line(
            "b1",
            1,
            Type::Recv,
            "push",
            None,
            json!({"conv": "c1", "seq": 2, "mid": "m2", "sender": "alice", "cmid": "x2",
                   "epoch": epoch}),
        );
        let probes = |b: &mut B| {
            b.probe(ok, "c1", 2, "m2", None, None);
            b.probe(push, "c1", 2, "m2", None, None);
        };
        if !probe_after_move {
            probes(&mut b);
        }
        nemesis(
            &mut b,
            "db-address-switch",
            json!({"phase": "instant", "to": "127.0.0.1:2"}),
        );
        if probe_after_move {
            probes(&mut b);
        }
        b.promoted_epoch_seen();
        let r = check(&b.h, &f);
        (
            r.counts[&Kind::ReplyBeforeCommit],
            r.counts[&Kind::PushBeforeCommit],
        )
    };
    assert_eq!(judged(false, true, 1), (0, 0));
    assert_eq!(judged(false, false, 1), (1, 1), "probed before the move");
    assert_eq!(judged(true, true, 1), (1, 1), "a synchronous standby");
    assert_eq!(judged(false, true, 2), (1, 1), "the newest epoch");
}
