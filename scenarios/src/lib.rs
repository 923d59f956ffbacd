//! Shared pieces of the scenario suite: the evidence [`Record`] every im-06 check writes,
//! the [`Check`] that accumulates expected-versus-observed values, and the database-wide
//! invariant checks (P1, D4, S1) run at the end of scenarios. No scenario logic lives here;
//! the scenarios are the tests in `tests/`.

pub mod site;

pub use im_check::Verdict;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Instant;

/// The evidence schema written by this version (see evidence/README.md).
pub const SCHEMA_VERSION: u32 = 2;

/// The workspace root (the scenarios crate's parent).
pub fn workspace() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// Where cargo puts what it builds: `$CARGO_TARGET_DIR` (relative to the workspace) or
/// `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) if std::path::Path::new(&d).is_absolute() => PathBuf::from(d),
        Some(d) => workspace().join(d),
        None => workspace().join("target"),
    }
}

/// `git ARGS` in the workspace, trimmed stdout; None outside git or on failure.
pub fn git(args: &[&str]) -> Option<String> {
    let out = std::process::Command::new("git")
        .args(args)
        .current_dir(workspace())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Where each check's record goes: `$IMFAULT_EVIDENCE_DIR` (set by the evidence runner),
/// else `target/imfault-records/`.
pub fn records_dir() -> PathBuf {
    match std::env::var_os("IMFAULT_EVIDENCE_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../target/imfault-records"
        )),
    }
}

/// One check of evidence/im-06/result.json.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    pub id: String,
    /// normal, failure, boundary, recovery, crash
    pub kind: String,
    /// PASS, FAIL or NOT_RUN.
    pub result: Verdict,
    /// Why it failed or was not run; null on PASS.
    pub reason: Option<String>,
    /// The invariants this check proves (its own assertions; the history checker judges all).
    #[serde(default)]
    pub invariants: Vec<String>,
    /// What the check does, in one sentence.
    #[serde(default)]
    pub what: String,
    /// The IM_FAULT the gateway ran with (or another fault injected), null for none.
    pub fault: Option<String>,
    /// What must be seen, by name: `observed[name] <op> value` (machine-checkable).
    pub expected: std::collections::BTreeMap<String, Expect>,
    /// What the harness saw, by name (every expected name plus extra observations).
    pub observed: serde_json::Map<String, Value>,
    /// Wall time of the check, milliseconds.
    pub duration_ms: u64,
    /// PostgreSQL the check ran against: version, fsync, synchronous_commit.
    pub postgres: Option<Value>,
    /// The history checker's verdict over the whole run (`im_check`): verdict,
    /// anomaly counts by kind, the first anomalies, statistics. Null if the check ended
    /// before it was judged.
    #[serde(default)]
    pub checker: Option<Value>,
    /// Where the run's cluster, gateway logs, history and client state files were kept
    /// (a failed check only); null on PASS.
    #[serde(default)]
    pub kept: Option<Vec<String>>,
}

/// How an observation is compared with its expected value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// Equal (JSON equality).
    Eq,
    /// Not equal.
    Ne,
    /// Numbers: observed >= value (and so on).
    Ge,
    Gt,
    Le,
    Lt,
    /// Arrays: every element of `value` is in the observed array.
    ContainsAll,
}

/// One expectation of a record: `observed <op> value`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Expect {
    pub op: Op,
    pub value: Value,
}

impl Expect {
    /// Whether `observed` meets this expectation (the same rule the check used, so the
    /// evidence can be re-derived from the file alone).
    pub fn holds(&self, observed: &Value) -> bool {
        let num = |v: &Value| v.as_f64();
        match self.op {
            Op::Eq => observed == &self.value,
            Op::Ne => observed != &self.value,
            Op::Ge | Op::Gt | Op::Le | Op::Lt => match (num(observed), num(&self.value)) {
                (Some(o), Some(v)) => match self.op {
                    Op::Ge => o >= v,
                    Op::Gt => o > v,
                    Op::Le => o <= v,
                    _ => o < v,
                },
                _ => false,
            },
            Op::ContainsAll => match (observed.as_array(), self.value.as_array()) {
                (Some(o), Some(v)) => v.iter().all(|x| o.contains(x)),
                _ => false,
            },
        }
    }
}

/// Accumulates a check's expectations and observations, then writes its record and fails
/// the test if any expectation was not met. A record is written even when the scenario
/// itself errors out, so a failing check still shows up in the evidence.
pub struct Check {
    rec: Record,
    failures: Vec<String>,
    started: Instant,
    /// Set by [`Check::not_run`]: the check could not run here, and says why.
    not_run: Option<String>,
    /// Set by [`Check::durability`] when a setting the verdict rests on is off: the check
    /// is then `NOT_RUN`, never `PASS` (a failure stays a `FAIL`).
    durability_off: Option<String>,
}

impl Check {
    /// Starts the check: the run is named after `id`, and its work directories (cluster,
    /// gateway logs, `history.jsonl`, client state files) are kept if it fails.
    pub fn new(id: &str, kind: &str, fault: Option<&str>) -> Check {
        harness::pg::begin_run(id);
        Check {
            rec: Record {
                id: id.to_string(),
                kind: kind.to_string(),
                invariants: Vec::new(),
                what: String::new(),
                fault: fault.map(str::to_string),
                expected: Default::default(),
                observed: Default::default(),
                result: Verdict::Fail,
                reason: None,
                duration_ms: 0,
                postgres: None,
                checker: None,
                kept: None,
            },
            failures: Vec::new(),
            started: Instant::now(),
            not_run: None,
            durability_off: None,
        }
    }

    /// The check cannot run on this machine (e.g. no FUSE): its record says `NOT_RUN` with
    /// `reason`, and the test passes. Call [`Check::finish`] right after.
    pub fn not_run(&mut self, reason: impl Into<String>) {
        self.not_run = Some(reason.into());
    }

    /// The durability guard (issue 11): records the settings the run's verdict rests on
    /// (`name -> value`, e.g. `server.fsync -> on`, `gateway_session.synchronous_commit ->
    /// on`) as observation `durability`; any value `off` (or a missing one) makes a check
    /// that met every expectation `NOT_RUN` instead of `PASS`: "survives a crash" means
    /// nothing on a cluster that does not flush.
    pub fn durability(&mut self, settings: &std::collections::BTreeMap<String, String>) {
        self.observe("durability", settings);
        let off: Vec<String> = settings
            .iter()
            .filter(|(_, v)| v.as_str() == "off" || v.is_empty())
            .map(|(k, v)| format!("{k}={}", if v.is_empty() { "unknown" } else { v }))
            .collect();
        let needed = [
            "server.fsync",
            "server.synchronous_commit",
            "server.full_page_writes",
            "gateway_session.synchronous_commit",
        ];
        let missing: Vec<String> = needed
            .iter()
            .filter(|k| !settings.contains_key(**k))
            .map(|k| format!("{k}=unknown"))
            .collect();
        let bad: Vec<String> = off.into_iter().chain(missing).collect();
        if !bad.is_empty() {
            self.durability_off = Some(format!(
                "durability off ({}): a crash or power-loss verdict means nothing on a \
                 cluster or session that does not flush, so this check is not a PASS",
                bad.join(", ")
            ));
        }
    }

    /// Expects `observed <op> value` under `name`: the one place a verdict is computed, by
    /// the same rule ([`Expect::holds`]) a reader can re-apply to the evidence file.
    pub fn expect_op(
        &mut self,
        name: &str,
        op: Op,
        value: impl Serialize,
        observed: impl Serialize,
    ) {
        let e = Expect {
            op,
            value: json!(value),
        };
        let o = json!(observed);
        if !e.holds(&o) {
            self.failures.push(format!(
                "{name}: expected {:?} {}, observed {o}",
                e.op, e.value
            ));
        }
        self.rec.expected.insert(name.to_string(), e);
        self.rec.observed.insert(name.to_string(), o);
    }

    /// Expects `observed == expected` under `name`.
    pub fn expect(&mut self, name: &str, expected: impl Serialize, observed: impl Serialize) {
        self.expect_op(name, Op::Eq, expected, observed);
    }

    pub fn expect_ne(&mut self, name: &str, other: impl Serialize, observed: impl Serialize) {
        self.expect_op(name, Op::Ne, other, observed);
    }

    pub fn expect_ge(&mut self, name: &str, min: impl Serialize, observed: impl Serialize) {
        self.expect_op(name, Op::Ge, min, observed);
    }

    pub fn expect_le(&mut self, name: &str, max: impl Serialize, observed: impl Serialize) {
        self.expect_op(name, Op::Le, max, observed);
    }

    pub fn expect_lt(&mut self, name: &str, bound: impl Serialize, observed: impl Serialize) {
        self.expect_op(name, Op::Lt, bound, observed);
    }

    /// Expects every element of `items` in the observed array.
    pub fn expect_contains_all(
        &mut self,
        name: &str,
        items: impl Serialize,
        observed: impl Serialize,
    ) {
        self.expect_op(name, Op::ContainsAll, items, observed);
    }

    /// An observation with no expectation attached (context for a reviewer).
    pub fn observe(&mut self, name: &str, observed: impl Serialize) {
        self.rec.observed.insert(name.to_string(), json!(observed));
    }

    pub fn set_postgres(&mut self, v: Value) {
        self.rec.postgres = Some(v);
    }

    /// The checker's verdict over this run's history (see [`judge`]).
    pub fn set_checker(&mut self, v: Value) {
        self.rec.checker = Some(v);
    }

    /// Writes the record and panics (failing the test) unless every expectation held and
    /// the scenario returned Ok.
    pub fn finish(mut self, outcome: anyhow::Result<()>) {
        if let Err(e) = outcome {
            self.failures.push(format!("scenario error: {e:#}"));
        }
        if let (Some(why), true) = (self.not_run.take(), self.failures.is_empty()) {
            self.rec.result = Verdict::NotRun;
            self.rec.reason = Some(why);
            self.rec.duration_ms = self.started.elapsed().as_millis() as u64;
            harness::pg::finish_run(false);
            self.write();
            return;
        }
        if self.rec.expected.is_empty() && self.failures.is_empty() {
            self.failures.push("no expectation was checked".into());
        }
        self.rec.duration_ms = self.started.elapsed().as_millis() as u64;
        let failed = !self.failures.is_empty();
        let dirs = harness::pg::finish_run(failed);
        if failed {
            self.rec.kept = Some(dirs.iter().map(|d| d.display().to_string()).collect());
            for d in &dirs {
                self.failures.push(format!(
                    "kept for inspection (cluster, logs/, history.jsonl, final.json, report.json, clients/): {}",
                    d.display()
                ));
            }
        }
        if self.failures.is_empty() {
            match self.durability_off.take() {
                Some(why) => {
                    self.rec.result = Verdict::NotRun;
                    self.rec.reason = Some(why);
                }
                None => self.rec.result = Verdict::Pass,
            }
        } else {
            self.rec.result = Verdict::Fail;
            let mut reason = self.failures.join("; ");
            if let Some(why) = &self.durability_off {
                reason.push_str(&format!("; note: {why}"));
            }
            self.rec.reason = Some(reason);
        }
        self.write();
        assert!(
            self.failures.is_empty(),
            "check {} failed:\n  {}",
            self.rec.id,
            self.failures.join("\n  ")
        );
    }

    fn write(&self) {
        let dir = records_dir();
        let write = std::fs::create_dir_all(&dir)
            .map_err(anyhow::Error::from)
            .and_then(|_| {
                let path = dir.join(format!("{}.json", self.rec.id));
                harness::util::write_atomic(&path, &serde_json::to_vec_pretty(&self.rec)?)
            });
        if let Err(e) = write {
            panic!("cannot write the evidence record of {}: {e:#}", self.rec.id);
        }
    }
}

/// The checker's anomalies listed in a record (the rest are counted).
const ANOMALIES_IN_RECORD_MAX: usize = 20;

/// Runs the database-wide invariant checks and the history checker over the whole run
/// (`World::judge`), records both, and expects zero violations and zero anomalies.
pub async fn judge(c: &mut Check, w: &harness::world::World) -> anyhow::Result<im_check::Report> {
    let (report, kinds) = judged(c, w).await?;
    c.expect("checker_anomalies", 0, report.anomalies.len());
    c.observe("checker_anomaly_kinds", kinds);
    for a in report.anomalies.iter().take(5) {
        eprintln!("checker: {}", json!(a));
    }
    Ok(report)
}

/// [`judge`] for a check whose anomalies are its measurement (the asynchronous failover,
/// U2): the checker runs and is recorded the same way, its anomaly kinds are observed as
/// `checker_anomalies_measured`, with no expectation.
pub async fn judge_measure(
    c: &mut Check,
    w: &harness::world::World,
) -> anyhow::Result<im_check::Report> {
    let (report, kinds) = judged(c, w).await?;
    c.observe("checker_anomalies_measured", kinds);
    Ok(report)
}

/// The database-wide invariants (expected none) and the history checker over the whole
/// run, recorded in the check; returns the report and its non-zero kinds.
async fn judged(
    c: &mut Check,
    w: &harness::world::World,
) -> anyhow::Result<(im_check::Report, Value)> {
    let v = db_invariant_violations(&w.admin.pool().await?).await?;
    c.expect(
        "db_invariant_violations (P1, D4, S1)",
        Vec::<String>::new(),
        v,
    );
    let j = w.judge().await?;
    let r = j.report;
    let anomalies: Vec<Value> = r
        .anomalies
        .iter()
        .take(ANOMALIES_IN_RECORD_MAX)
        .map(|a| json!(a))
        .collect();
    c.set_checker(json!({
        "verdict": r.verdict,
        "anomalies_by_kind": r.counts,
        "anomalies": anomalies,
        "anomalies_total": r.anomalies.len(),
        "stats": r.stats,
    }));
    let kinds: std::collections::BTreeMap<&im_check::Kind, &u64> =
        r.counts.iter().filter(|(_, n)| **n > 0).collect();
    let kinds = json!(kinds);
    Ok((r, kinds))
}

/// The settings a durability verdict rests on, as the run saw them: the server's
/// `fsync`, `synchronous_commit` and `full_page_writes` (read through the world's
/// database address) and the gateway sessions' own (from the gateway's start-up line).
pub async fn durability_settings(
    w: &harness::world::World,
) -> anyhow::Result<std::collections::BTreeMap<String, String>> {
    let (fsync, sync_commit, fpw): (String, String, String) = sqlx::query_as(
        "SELECT current_setting('fsync'), current_setting('synchronous_commit'),
                current_setting('full_page_writes')",
    )
    .fetch_one(&w.admin.pool().await?)
    .await?;
    let mut m = std::collections::BTreeMap::new();
    m.insert("server.fsync".to_string(), fsync);
    m.insert("server.synchronous_commit".to_string(), sync_commit);
    m.insert("server.full_page_writes".to_string(), fpw);
    // Where the data directory is: a RAM file system under cargo-nextest when it has room
    // (`harness::pg::work_base`), where a flush reaches memory only.
    m.insert(
        "data_directory.file_system".to_string(),
        harness::util::file_system_of(w.work_dir()),
    );
    for (k, v) in w.gw().session_durability() {
        m.insert(format!("gateway_session.{k}"), v);
    }
    Ok(m)
}

/// For tests outside the im-06 evidence (the protocol tests): judges the run with the
/// history checker, writes `records_dir()/protocol/<test>.json` (the checker's verdict,
/// read by `make controls`), and returns the report.
pub async fn judge_test(w: &harness::world::World) -> anyhow::Result<im_check::Report> {
    judge_test_measuring(w, &[]).await
}

/// [`judge_test`] for a test whose setting makes some anomalies its measurement, not a
/// verdict (a `lost` under `synchronous_commit = off`): their counts go into the record's
/// `observed.checker_anomalies_measured` too, so the controls' clean baseline does not
/// count them (as it does not count `06-failover-u2-async`'s). The test still asserts on
/// every kind itself.
pub async fn judge_test_measuring(
    w: &harness::world::World,
    measured: &[im_check::Kind],
) -> anyhow::Result<im_check::Report> {
    let j = w.judge().await?;
    let test = std::thread::current()
        .name()
        .unwrap_or("unnamed")
        .rsplit("::")
        .next()
        .unwrap_or("unnamed")
        .to_string();
    let dir = records_dir().join("protocol");
    std::fs::create_dir_all(&dir)?;
    let rec = json!({
        "test": test,
        "verdict": j.report.verdict,
        "anomalies_by_kind": j.report.counts,
        "anomalies": j.report.anomalies.iter().take(ANOMALIES_IN_RECORD_MAX).collect::<Vec<_>>(),
        "history": j.dir.join("history.jsonl"),
    });
    let mut rec = rec;
    if !measured.is_empty() {
        let counts: serde_json::Map<String, Value> = measured
            .iter()
            .map(|k| {
                (
                    k.as_str().to_string(),
                    json!(j.report.counts.get(k).copied().unwrap_or(0)),
                )
            })
            .collect();
        rec["observed"] = json!({ "checker_anomalies_measured": counts });
    }
    std::fs::write(
        dir.join(format!("{test}.json")),
        serde_json::to_vec_pretty(&rec)?,
    )?;
    Ok(j.report)
}

/// PostgreSQL's version and durability settings, as the cluster reports them.
pub async fn postgres_facts(pool: &sqlx::PgPool) -> anyhow::Result<Value> {
    let (version, fsync, sync_commit): (String, String, String) = sqlx::query_as(
        "SELECT current_setting('server_version'), current_setting('fsync'),
                current_setting('synchronous_commit')",
    )
    .fetch_one(pool)
    .await?;
    Ok(json!({"version": version, "fsync": fsync, "synchronous_commit": sync_commit}))
}

/// Database-wide invariants that must hold after any scenario, whatever it did:
/// P1 (every conversation's seqs are exactly 1..head), D4 (no cursor above its head, none
/// negative), S1 (no event from a sender outside an open period at its seq).
/// Returns the list of violations (empty when all hold).
pub async fn db_invariant_violations(pool: &sqlx::PgPool) -> anyhow::Result<Vec<String>> {
    let mut v = Vec::new();
    let p1: Vec<(String, i64, i64, Option<i64>)> = sqlx::query_as(
        "SELECT c.conv_id, c.next_seq - 1, count(e.seq), max(e.seq)
         FROM conversations c LEFT JOIN events e ON e.conv_id = c.conv_id
         GROUP BY c.conv_id, c.next_seq
         HAVING count(e.seq) <> c.next_seq - 1 OR COALESCE(max(e.seq), 0) <> c.next_seq - 1",
    )
    .fetch_all(pool)
    .await?;
    for (conv, head, n, max) in p1 {
        v.push(format!(
            "P1: {conv} head {head} but {n} events, max seq {max:?}"
        ));
    }
    let d4: Vec<(String, String, i64, i64)> = sqlx::query_as(
        "SELECT dc.device_id, dc.conv_id, dc.delivered_seq, c.next_seq - 1
         FROM device_cursors dc JOIN conversations c ON c.conv_id = dc.conv_id
         WHERE dc.delivered_seq > c.next_seq - 1 OR dc.delivered_seq < 0",
    )
    .fetch_all(pool)
    .await?;
    for (d, conv, cur, head) in d4 {
        v.push(format!("D4: cursor {d}/{conv} = {cur} above head {head}"));
    }
    let s1: Vec<(String, i64)> = sqlx::query_as(
        "SELECT e.conv_id, e.seq FROM events e
         WHERE NOT EXISTS (SELECT 1 FROM memberships m
                           WHERE m.conv_id = e.conv_id AND m.user_id = e.sender_user
                             AND m.from_seq <= e.seq AND (m.to_seq IS NULL OR e.seq < m.to_seq))",
    )
    .fetch_all(pool)
    .await?;
    for (conv, seq) in s1 {
        v.push(format!(
            "S1: event {conv}:{seq} sent outside the sender's membership"
        ));
    }
    Ok(v)
}

/// A client for `device`, with its state file in the world's work dir, connected and
/// authenticated (install epoch 1).
pub async fn connect(
    w: &harness::world::World,
    device: &str,
    token: &str,
) -> anyhow::Result<harness::client::Client> {
    let mut c = w.admin.create_client(device, device, token, 1)?;
    c.connect(&w.ws_url())
        .await
        .map_err(|e| anyhow::anyhow!("connect {device}: {e}"))?;
    Ok(c)
}

/// Issue 21: the gateway closes every connection when it finds the database on a new
/// lineage (a promoted standby; `gateway/src/lineage.rs`). Waits up to `within` for `c`'s
/// connection to close, then connects it again, as a device does, and subscribes it when
/// `sub` (its `subbed` names the moved epochs: the device reconciles). Returns whether the
/// gateway closed it; asserts nothing, so a check judges what follows either way.
pub async fn reconnect_after_lineage_move(
    w: &harness::world::World,
    c: &mut harness::client::Client,
    sub: bool,
    within: std::time::Duration,
) -> anyhow::Result<bool> {
    let closed = harness::util::wait_until(
        "the gateway to close the connection",
        std::time::Instant::now() + within,
        async || if c.is_connected() { Err(()) } else { Ok(()) },
    )
    .await
    .is_ok();
    if closed {
        c.connect(&w.ws_url())
            .await
            .map_err(|e| anyhow::anyhow!("reconnect {}: {e}", c.device()))?;
        if sub {
            c.sub()
                .await
                .map_err(|e| anyhow::anyhow!("sub {}: {e}", c.device()))?;
        }
    }
    Ok(closed)
}

/// Provisions users `alice` (device `a1`) and `bob` (device `b1`) and conversation `c1`
/// with both as members; returns the two device tokens.
pub async fn provision_alice_and_bob(
    w: &harness::world::World,
) -> anyhow::Result<(String, String)> {
    w.admin.add_user("alice").await?;
    w.admin.add_user("bob").await?;
    let ta = w.admin.add_device("a1", "alice").await?;
    let tb = w.admin.add_device("b1", "bob").await?;
    w.admin.add_conv("c1", &["alice", "bob"]).await?;
    Ok((ta, tb))
}

/// [`provision_alice_and_bob`], then both devices connected and subscribed.
pub async fn alice_and_bob(
    w: &harness::world::World,
) -> anyhow::Result<(harness::client::Client, harness::client::Client)> {
    let (ta, tb) = provision_alice_and_bob(w).await?;
    let a = connect(w, "a1", &ta).await?;
    let b = connect(w, "b1", &tb).await?;
    a.sub().await.map_err(|e| anyhow::anyhow!("sub a1: {e}"))?;
    b.sub().await.map_err(|e| anyhow::anyhow!("sub b1: {e}"))?;
    Ok((a, b))
}

/// RFC 3339 UTC time of `t` (whole seconds): [`harness::util::rfc3339_at`].
pub fn rfc3339(t: std::time::SystemTime) -> String {
    harness::util::rfc3339_at(t)
}

/// Now, as [`rfc3339`].
pub use harness::util::rfc3339_now;

/// The `q`-quantile (0..=1) of `xs` by nearest rank; `None` for an empty slice
/// ([`harness::util::percentile`]).
pub use harness::util::percentile as quantile;

/// The seqs of a `synced` page's events, in the order the page holds them (a panic on a
/// page without `events` or an event without `seq`).
pub fn page_seqs(page: &serde_json::Value) -> Vec<i64> {
    page["events"]
        .as_array()
        .unwrap_or_else(|| panic!("a page without events: {page}"))
        .iter()
        .map(|e| {
            e["seq"]
                .as_i64()
                .unwrap_or_else(|| panic!("an event without seq: {e}"))
        })
        .collect()
}

/// `work(k, &items[k])` for every item, at most `places` at once: each of `places` threads
/// takes the next item in order as soon as it is free, so a long item does not hold back
/// the places beside it. The results come back in `items`' order; a panic in `work` is
/// raised here once every thread has stopped.
pub fn each_in_places<T: Sync, R: Send>(
    items: &[T],
    places: usize,
    work: impl Fn(usize, &T) -> R + Sync,
) -> Vec<R> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done: std::sync::Mutex<Vec<(usize, R)>> = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..places.clamp(1, items.len().max(1)) {
            s.spawn(|| loop {
                let k = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let Some(item) = items.get(k) else {
                    return;
                };
                let r = work(k, item);
                done.lock().unwrap_or_else(|p| p.into_inner()).push((k, r));
            });
        }
    });
    let mut done = done.into_inner().unwrap_or_else(|p| p.into_inner());
    done.sort_by_key(|(k, _)| *k);
    done.into_iter().map(|(_, r)| r).collect()
}

/// Milliseconds with one decimal, for evidence.
pub fn ms(d: std::time::Duration) -> f64 {
    (d.as_secs_f64() * 10_000.0).round() / 10.0
}

/// One im-06 check: its evidence id, its test in tests/im06.rs, the invariants it proves
/// (besides the history checker's, which every check runs) and what it does, in one sentence.
#[derive(Debug, Clone, Copy)]
pub struct CheckInfo {
    pub id: &'static str,
    pub test: &'static str,
    pub invariants: &'static [&'static str],
    pub what: &'static str,
}

/// The im-06 checks. The evidence runner expects one record per entry; a missing record is
/// a FAIL.
pub const IM06_CHECKS: &[CheckInfo] = &[
    CheckInfo {
        id: "06-crash-send.before_insert",
        test: "im06_crash_send_before_insert",
        invariants: &["D1", "D2", "P1"],
        what: "The gateway halts after taking the seq and before the INSERT: the sender gets no reply, no row exists, and the replayed outbox creates the message once (dup:false).",
    },
    CheckInfo {
        id: "06-crash-send.before_commit",
        test: "im06_crash_send_before_commit",
        invariants: &["D1", "D2", "P1"],
        what: "The gateway halts after the INSERT and before COMMIT: PostgreSQL rolls back, the seq is not consumed, and the replay creates the message once, with seq 1.",
    },
    CheckInfo {
        id: "06-crash-send.batch.before_commit",
        test: "im06_crash_send_batch_before_commit",
        invariants: &["D1", "D2", "P1"],
        what: "Group commit: the gateway halts after the batch's rows were inserted and before its COMMIT: PostgreSQL rolls the batch back, no seq is consumed, and the replay creates the message once, with seq 1.",
    },
    CheckInfo {
        id: "06-crash-send.batch.after_commit",
        test: "im06_crash_send_batch_after_commit",
        invariants: &["D1", "D2"],
        what: "Group commit: the gateway halts after the batch's COMMIT and before any reply or notification: the row exists, and the replay answers dup:true with the original seq and mid, still one row.",
    },
    CheckInfo {
        id: "06-crash-api.after_send_commit",
        test: "im06_crash_api_after_send_commit",
        invariants: &["D1", "D2"],
        what: "The gateway halts after COMMIT and before the reply: the row exists, and the replay answers dup:true with the original seq and mid, still one row.",
    },
    CheckInfo {
        id: "06-crash-send.after_commit_before_notify",
        test: "im06_crash_send_after_commit_before_notify",
        invariants: &["D1", "D2", "D5"],
        what: "The gateway halts after COMMIT and before the notifier is told: the row exists though nothing was pushed, the replay answers dup:true with the original seq, and the receiver gets it by sync; a notification skipped with the receiver online is found by the commit feed and pushed within sweep interval + 1 s.",
    },
    CheckInfo {
        id: "06-lost-reply-retry",
        test: "im06_lost_reply_retry",
        invariants: &["D2"],
        what: "The first sent reply is dropped: the client times out, resends the same cmid and gets dup:true with the original seq; one row.",
    },
    CheckInfo {
        id: "06-push-ack-advances-cursor",
        test: "im06_push_ack_advances_cursor",
        invariants: &["D3"],
        what: "Seven messages reach the receiver by push; it stores them, acks coalesced, and its delivered_seq becomes 7.",
    },
    CheckInfo {
        id: "06-ack-monotonic-and-bounded",
        test: "im06_ack_monotonic_and_bounded",
        invariants: &["D4"],
        what: "An ack of 1 after 7 leaves the cursor at 7, and an ack of 107 beyond the head is CURSOR_AHEAD and changes nothing.",
    },
    CheckInfo {
        id: "06-lost-push-swept",
        test: "im06_lost_push_swept",
        invariants: &["D5"],
        what: "Every push is dropped: in 30 trials the sweep's hint makes the receiver sync and ack within sweep interval + 1 s.",
    },
    CheckInfo {
        id: "06-db-immediate-stop-keeps-acked",
        test: "im06_db_immediate_stop_keeps_acked",
        invariants: &["D6", "D2", "P1"],
        what: "Four senders run until 200+ messages are acknowledged, then PostgreSQL is stopped immediately and restarted: every acknowledged message is there once, and the replayed in-flight sends end as one row each.",
    },
    CheckInfo {
        id: "06-lost-ack-swept",
        test: "im06_lost_ack_swept",
        invariants: &["D3", "D5"],
        what: "The receiver's first ack never reaches the database: the sweep hints again and the re-ack moves the cursor within sweep interval + 1 s.",
    },
    CheckInfo {
        id: "06-receiver-crash-before-ack",
        test: "im06_receiver_crash_before_ack",
        invariants: &["D3"],
        what: "The receiver crashes after storing 5 events and before acking: restarted from its state file, it syncs, drops the duplicates by seq and acks 5.",
    },
    CheckInfo {
        id: "06-listen-conn-killed-swept",
        test: "im06_listen_conn_killed_swept",
        invariants: &["D5"],
        what: "The LISTEN connection is terminated mid-stream: the gateway rebuilds it and sweeps at once, and the receiver ends with every message.",
    },
    CheckInfo {
        id: "06-queue-overflow-hint",
        test: "im06_queue_overflow_hint",
        invariants: &["D5"],
        what: "A slow receiver's queue overflows: pushes stop, an overflow hint follows once it drained, and the receiver syncs to every message.",
    },
    CheckInfo {
        id: "06-commit-held-open",
        test: "im06_commit_held_open",
        invariants: &["D1"],
        what: "Every commit is held open 300 ms: each sent reply and each push is probed on another session the moment it arrives, and its event is already committed.",
    },
    CheckInfo {
        id: "06-lost-push-gap-synced",
        test: "im06_lost_push_gap_synced",
        invariants: &["D3", "D5"],
        what: "The second push is dropped: the receiver sees the gap at the third, syncs it, and only then acks.",
    },
    CheckInfo {
        id: "06-sweep-hint-cadence",
        test: "im06_sweep_hint_cadence",
        invariants: &["D5"],
        what: "A receiver that never acks is hinted once per sweep interval: median gap at most 1.5 x the interval, none over interval + 1 s.",
    },
    CheckInfo {
        id: "06-sweep-cost-at-target-scale",
        test: "im06_sweep_cost_at_target_scale",
        invariants: &["D5"],
        what: "10,000 simulated subscribed devices x 20 conversations, 1% of the pairs lagging: the gateway's paged full pass finds exactly the lagging pairs, each page inside IM_DB_TIMEOUT_MS, and one interval's regular sweep (1,000 pushed-and-unacked candidates) finds every lagging one within the 1 s interval.",
    },
    CheckInfo {
        id: "06-receiver-crash-after-ack",
        test: "im06_receiver_crash_after_ack",
        invariants: &["D3"],
        what: "The receiver dies right after its first ack frame: whatever that ack covered is in its state file, and the restarted client catches up.",
    },
    CheckInfo {
        id: "06-receiver-crash-mid-sync",
        test: "im06_receiver_crash_mid_sync",
        invariants: &["D3", "D5"],
        what: "The receiver dies after persisting the first of three sync pages: restarted, it holds exactly that page, syncs the rest and acks the head.",
    },
    CheckInfo {
        id: "06-power-loss-keeps-acked",
        test: "im06_power_loss_keeps_acked",
        invariants: &["D6", "D2", "P1"],
        what: "Several senders run on a cluster whose data directory is a FUSE layer that forgets unsynced writes; after 200+ acknowledged messages the power is cut: every acknowledged message survives exactly once.",
    },
    CheckInfo {
        id: "06-power-loss-torn-write",
        test: "im06_power_loss_torn_write",
        invariants: &["D6", "D2", "P1"],
        what: "The power cut half writes the last page written and not synced (a torn write) before it forgets the rest: every acknowledged message survives exactly once.",
    },
    CheckInfo {
        id: "06-disk-fsync-eio",
        test: "im06_disk_fsync_eio",
        invariants: &["D6", "D2", "P1"],
        what: "Under load, fsync fails with EIO and the unsynced pages are thrown away (fsyncgate): the gateway answers UNAVAILABLE, never INTERNAL, recovers by itself once the disk works, and a power cut afterwards keeps every acknowledged message exactly once.",
    },
    CheckInfo {
        id: "06-disk-full",
        test: "im06_disk_full",
        invariants: &["D6", "D2", "P1"],
        what: "Under load, the disk is full (writes that extend a file fail with ENOSPC): the gateway answers UNAVAILABLE, never INTERNAL, recovers by itself once there is space, and a power cut afterwards keeps every acknowledged message exactly once.",
    },
    CheckInfo {
        id: "06-disk-slow-fsync",
        test: "im06_disk_slow_fsync",
        invariants: &["D6", "D2", "P1"],
        what: "Under load, every fsync takes 200 ms: sends slow down (p50 at least the delay) without failing, speed up again after, and a power cut afterwards keeps every acknowledged message exactly once.",
    },
    CheckInfo {
        id: "06-failover-u2-async",
        test: "im06_failover_u2_async",
        invariants: &["D6", "D2", "P1"],
        what: "Asynchronous streaming replication under load, the primary crashed, the standby promoted and the proxy switched: the acknowledged messages lost in the replication window are counted (the note's U2 risk, measured).",
    },
    CheckInfo {
        id: "06-failover-u2-sync",
        test: "im06_failover_u2_sync",
        invariants: &["D6", "D2", "P1"],
        what: "The same failover with synchronous replication: no acknowledged message is lost and the checker finds no anomaly.",
    },
    CheckInfo {
        id: "06-failover-pg-auto-failover",
        test: "im06_failover_pg_auto_failover",
        invariants: &["D6", "D2", "P1"],
        what: "A pg_auto_failover formation under load loses its primary node (every process SIGKILLed): its monitor detects it and promotes the secondary, the address follows the monitor, and the gateway recovers on its own; acknowledged messages lost are counted against the replication mode pg_auto_failover set up (synchronous: none).",
    },
    CheckInfo {
        id: "06-two-gateways",
        test: "im06_two_gateways",
        invariants: &["D1", "D2", "D5", "P1"],
        what: "Two gateways on one database: pushes cross between them by push, a resend through the other gateway is a dup, and one gateway halted at each send point while the other keeps serving; its devices move to the survivor, replay and catch up, with every acknowledged send one row.",
    },
];

/// What the design note says was not run, and why it is not run here either: nothing any
/// more (`06-sweep-cost-at-target-scale` is measured since issue 12).
pub fn im06_not_run() -> Vec<Record> {
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::each_in_places;
    use super::Verdict;

    /// Every item once, its result in the items' order, never more than `places` at once
    /// and, with work that waits, as many as `places` at once.
    #[test]
    fn each_in_places_runs_every_item_in_at_most_its_places() {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        for places in [1, 3] {
            let (now, most) = (AtomicUsize::new(0), AtomicUsize::new(0));
            let items: Vec<u64> = (0..12).collect();
            let out = each_in_places(&items, places, |k, &x| {
                most.fetch_max(now.fetch_add(1, SeqCst) + 1, SeqCst);
                std::thread::sleep(std::time::Duration::from_millis(20 + (x % 3) * 10));
                now.fetch_sub(1, SeqCst);
                (k, x * 2)
            });
            let want: Vec<(usize, u64)> = (0..12).map(|k| (k, k as u64 * 2)).collect();
            assert_eq!(out, want);
            assert_eq!(most.load(SeqCst), places, "places {places}");
        }
        assert!(each_in_places(&[] as &[u8], 2, |_, _| ()).is_empty());
    }

    /// Evidence that reads itself: every PASS and FAIL of the committed
    /// evidence/im-06/result.json follows from its own `expected` and `observed` values by
    /// [`super::Expect::holds`], and every judged PASS has the checker's PASS too.
    #[test]
    fn committed_im06_evidence_rederives_from_its_values() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../evidence/im-06/result.json");
        let doc: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).expect("read the committed evidence"))
                .expect("parse it");
        assert_eq!(
            doc["schema_version"],
            super::SCHEMA_VERSION,
            "regenerate: make evidence"
        );
        let checks: Vec<super::Record> =
            serde_json::from_value(doc["checks"].clone()).expect("records");
        assert!(!checks.is_empty());
        for r in &checks {
            let failed: Vec<&String> = r
                .expected
                .iter()
                .filter(|(name, e)| {
                    !e.holds(r.observed.get(*name).unwrap_or(&serde_json::Value::Null))
                })
                .map(|(name, _)| name)
                .collect();
            match r.result {
                Verdict::Pass => {
                    assert!(
                        failed.is_empty(),
                        "{}: PASS but {failed:?} do not hold",
                        r.id
                    );
                    assert!(
                        !r.expected.is_empty(),
                        "{}: PASS without expectations",
                        r.id
                    );
                    assert!(
                        !r.invariants.is_empty() && !r.what.is_empty(),
                        "{}: unnamed",
                        r.id
                    );
                    // A check that expects no anomaly has the checker's PASS; one whose
                    // anomalies are its measurement (the async failover) observes them.
                    if let (Some(c), true) =
                        (&r.checker, r.expected.contains_key("checker_anomalies"))
                    {
                        assert_eq!(c["verdict"], Verdict::Pass, "{}", r.id);
                    }
                }
                Verdict::Fail => assert!(
                    !failed.is_empty() || r.reason.as_deref().is_some_and(|x| x.contains("error")),
                    "{}: FAIL with every expectation met and no error",
                    r.id
                ),
                Verdict::NotRun => assert!(r.reason.is_some(), "{}: NOT_RUN without reason", r.id),
                Verdict::Error => {
                    panic!("{}: result ERROR (a check is PASS, FAIL or NOT_RUN)", r.id)
                }
            }
        }
    }

    #[test]
    fn expectations_hold_by_their_op() {
        use super::{Expect, Op};
        use serde_json::json;
        let e = |op, v| Expect { op, value: v };
        assert!(e(Op::Ge, json!(200)).holds(&json!(201)));
        assert!(!e(Op::Ge, json!(200)).holds(&json!(199)));
        assert!(!e(Op::Ge, json!(200)).holds(&json!("lots")));
        assert!(e(Op::Lt, json!(40)).holds(&json!(39)));
        assert!(e(Op::Le, json!(450.0)).holds(&json!(450)));
        assert!(e(Op::Eq, json!([1, 2])).holds(&json!([1, 2])));
        assert!(e(Op::Ne, json!(7)).holds(&json!(null)));
        assert!(e(Op::ContainsAll, json!([1, 2])).holds(&json!([3, 2, 1])));
        assert!(!e(Op::ContainsAll, json!([1, 4])).holds(&json!([1, 2])));
    }

    #[test]
    fn quantile_is_nearest_rank() {
        let xs: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(super::quantile(&xs, 0.5), Some(50.0));
        assert_eq!(super::quantile(&xs, 0.95), Some(95.0));
        assert_eq!(super::quantile(&xs, 1.0), Some(100.0));
        assert_eq!(super::quantile(&[], 0.5), None);
    }
}

/// Four senders that keep sending through a fault: each cmid is sent again (after 50 ms)
/// until it is acknowledged, every answer recorded with its time, until `stop`.
#[derive(Default)]
pub struct Through {
    /// (cmid, seq, ms since the load began, send latency ms).
    pub acked: std::sync::Mutex<Vec<(String, i64, f64, f64)>>,
    /// (error: the code, `timeout` or `disconnected`; ms since the load began).
    pub errors: std::sync::Mutex<Vec<(String, f64)>>,
    pub stop: std::sync::atomic::AtomicBool,
}

impl Through {
    /// Sends until `stop` (or a sender's terminal answer), each sender's cmids `s<i>-<n>`
    /// in `c1`; times are ms since `t0`.
    pub async fn run(&self, senders: &[harness::client::Client], t0: std::time::Instant) {
        use harness::client::ClientError;
        use std::sync::atomic::Ordering::SeqCst;
        use std::time::Duration;
        let runs = senders.iter().enumerate().map(|(i, s)| async move {
            let mut n = 0;
            while !self.stop.load(SeqCst) {
                let cmid = format!("s{i}-{n}");
                let t = Instant::now();
                match s.send("c1", &cmid, "keep me", Duration::from_secs(3)).await {
                    Ok(r) => {
                        n += 1;
                        self.acked.lock().unwrap().push((
                            cmid,
                            r["seq"].as_i64().unwrap_or(-1),
                            ms(t0.elapsed()),
                            ms(t.elapsed()),
                        ));
                    }
                    Err(e) => {
                        let what = match &e {
                            ClientError::Timeout => "timeout".to_string(),
                            ClientError::Disconnected => "disconnected".to_string(),
                            e => e.code().unwrap_or("other").to_string(),
                        };
                        self.errors.lock().unwrap().push((what, ms(t0.elapsed())));
                        if e.is_terminal_for_send() || matches!(e, ClientError::Disconnected) {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
        futures_util::future::join_all(runs).await;
    }

    /// The acknowledged sends so far: (cmid, seq).
    pub fn acked_pairs(&self) -> Vec<(String, i64)> {
        self.acked
            .lock()
            .unwrap()
            .iter()
            .map(|a| (a.0.clone(), a.1))
            .collect()
    }

    /// Sends acknowledged at or after `from_ms`.
    pub fn acked_since(&self, from_ms: f64) -> usize {
        self.acked
            .lock()
            .unwrap()
            .iter()
            .filter(|a| a.2 >= from_ms)
            .count()
    }

    /// Failed sends answered `what` between `from_ms` and `to_ms`.
    pub fn errors_between(&self, what: &str, from_ms: f64, to_ms: f64) -> usize {
        self.errors
            .lock()
            .unwrap()
            .iter()
            .filter(|(w, t)| w == what && *t >= from_ms && *t <= to_ms)
            .count()
    }
}
