//! The judgement of a world's run: the D5 wait, the final read of the database and of
//! every client state file, `final.json` and `report.json`, and the checker over the
//! history as read back.
//!
//! Must not: change the world (no process, admin or client action).

use super::*;

impl World {
    /// Judges the run (issue: one history, one checker): waits (bounded) until every
    /// connected, subscribed device holds every event visible to it, at most until sweep
    /// interval + 1 s after the last fault or send (D5); takes the final read of the
    /// database and of every client state file; writes `final.json` and `report.json`
    /// beside `history.jsonl`; and runs the checker over the whole history as read back
    /// from `history.jsonl`. A history that does not parse is an error (`report.json` says
    /// ERROR and why): no caller can take it for a pass.
    pub async fn judge(&self) -> anyhow::Result<Judgement> {
        let hist = &self.hist;
        hist.wait_probes(Duration::from_secs(3)).await;
        // With several gateways, the slowest sweep bounds the repair.
        let sweep_ms = self
            .gateways
            .all_opts()
            .map(|o| o.sweep_ms.unwrap_or(SWEEP_MS_DEFAULT))
            .max()
            .unwrap_or(SWEEP_MS_DEFAULT);
        let bound_ms = sweep_ms + 1000;
        let entries = hist.entries();
        let live = live_devices(&entries);
        // The liveness clock starts at the last fault (nemesis) or acknowledged send.
        let from_ms = entries
            .iter()
            .filter(|e| matches!(e.line, Line::Nemesis(_) | Line::Ok(Done::Send { .. })))
            .map(|e| e.t_ms)
            .fold(0.0, f64::max);
        let deadline_ms = from_ms + bound_ms as f64;
        let wait_start = hist.now_ms();
        let pool = self.admin.pool().await?;
        let missing = loop {
            let missing = self.missing_events(&pool, &live).await?;
            if missing.is_empty() || hist.now_ms() >= deadline_ms {
                break missing;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        };
        let waited_ms = hist.now_ms() - wait_start;
        let fin = self
            .final_read(&pool, sweep_ms, &live, bound_ms, waited_ms, missing)
            .await?;
        hist.record("harness", 0, None, Line::Meta(Meta::Final {}));
        let dir = self.work_dir().to_path_buf();
        write_json(&dir.join("final.json"), &fin)?;
        let fin: checker::Final =
            serde_json::from_value(fin).context("the final read does not fit checker::Final")?;
        // The file a reviewer keeps is what is judged: a line that cannot be read back
        // makes the judgement ERROR, never a line a rule skips.
        let report = match hist.read_back() {
            Ok(entries) => checker::check(&entries, &fin),
            Err(e) => checker::Report::error(format!("{e:#}")),
        };
        write_json(&dir.join("report.json"), &report)?;
        if let Some(why) = &report.error {
            anyhow::bail!(
                "the run in {} could not be judged (verdict ERROR): {why}",
                dir.display()
            );
        }
        Ok(Judgement { report, dir })
    }

    /// Every client state file in `work_dir/clients`: device -> conv -> seq -> mid.
    fn stores(&self) -> anyhow::Result<Stores> {
        let dir = self.work_dir().join("clients");
        let mut out = Stores::new();
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(e).with_context(|| format!("list {}", dir.display())),
        };
        for entry in entries {
            let path = entry?.path();
            let name = path.file_name().map(|n| n.to_string_lossy().to_string());
            if path.extension().is_none_or(|x| x != "json")
                || name.is_some_and(|n| n.starts_with('.'))
            {
                continue;
            }
            let (device, convs) = Client::read_store(&path)?;
            let d = out.entry(device).or_default();
            for (conv, evs) in convs {
                d.entry(conv).or_default().extend(evs);
            }
        }
        Ok(out)
    }

    /// Events visible to each live device that its state file does not hold.
    async fn missing_events(
        &self,
        pool: &sqlx::PgPool,
        live: &BTreeSet<String>,
    ) -> anyhow::Result<BTreeMap<String, BTreeMap<String, Vec<i64>>>> {
        if live.is_empty() {
            return Ok(BTreeMap::new());
        }
        let devices: Vec<String> = live.iter().cloned().collect();
        let visible: Vec<(String, String, i64)> = sqlx::query_as(
            "SELECT DISTINCT d.device_id, e.conv_id, e.seq
             FROM devices d
             JOIN memberships m ON m.user_id = d.user_id
             JOIN events e ON e.conv_id = m.conv_id AND e.seq >= m.from_seq
                          AND (m.to_seq IS NULL OR e.seq < m.to_seq)
             WHERE d.device_id = ANY($1)
             ORDER BY 1, 2, 3",
        )
        .bind(&devices)
        .fetch_all(pool)
        .await
        .context("read the events visible to live devices")?;
        let stores = self.stores()?;
        let mut missing: BTreeMap<String, BTreeMap<String, Vec<i64>>> = BTreeMap::new();
        for (device, conv, seq) in visible {
            let held = stores
                .get(&device)
                .and_then(|c| c.get(&conv))
                .is_some_and(|evs| evs.contains_key(&seq));
            if !held {
                missing
                    .entry(device)
                    .or_default()
                    .entry(conv)
                    .or_default()
                    .push(seq);
            }
        }
        Ok(missing)
    }

    /// The final read of the checker's contract (evidence/README.md, "Final read").
    async fn final_read(
        &self,
        pool: &sqlx::PgPool,
        sweep_ms: u64,
        live: &BTreeSet<String>,
        bound_ms: u64,
        waited_ms: f64,
        missing: BTreeMap<String, BTreeMap<String, Vec<i64>>>,
    ) -> anyhow::Result<Value> {
        let events: Vec<(String, i64, String, String, String, String)> = sqlx::query_as(
            "SELECT conv_id, seq, mid, sender_user, sender_device, cmid FROM events
             ORDER BY conv_id, seq",
        )
        .fetch_all(pool)
        .await
        .context("final read: events")?;
        let heads: Vec<(String, i64)> =
            sqlx::query_as("SELECT conv_id, next_seq - 1 FROM conversations ORDER BY conv_id")
                .fetch_all(pool)
                .await
                .context("final read: heads")?;
        let memberships: Vec<(String, String, i64, Option<i64>)> = sqlx::query_as(
            "SELECT conv_id, user_id, from_seq, to_seq FROM memberships ORDER BY 1, 2, 3",
        )
        .fetch_all(pool)
        .await
        .context("final read: memberships")?;
        let devices: Vec<(String, String)> =
            sqlx::query_as("SELECT device_id, user_id FROM devices ORDER BY 1")
                .fetch_all(pool)
                .await
                .context("final read: devices")?;
        let cursors: Vec<(String, String, i64)> = sqlx::query_as(
            "SELECT device_id, conv_id, delivered_seq FROM device_cursors ORDER BY 1, 2",
        )
        .fetch_all(pool)
        .await
        .context("final read: cursors")?;
        let audit: Vec<(String, String, Option<i64>, i64, i64)> = sqlx::query_as(
            "SELECT device_id, conv_id, old_seq, new_seq, wall_us FROM imfault_cursor_audit
             ORDER BY id",
        )
        .fetch_all(pool)
        .await
        .context("final read: cursor audit")?;
        let stores: BTreeMap<String, BTreeMap<String, Vec<Value>>> = self
            .stores()?
            .into_iter()
            .map(|(d, convs)| {
                let convs = convs
                    .into_iter()
                    .map(|(c, evs)| {
                        let evs = evs
                            .into_iter()
                            .map(|(seq, mid)| json!({"seq": seq, "mid": mid}))
                            .collect();
                        (c, evs)
                    })
                    .collect();
                (d, convs)
            })
            .collect();
        Ok(json!({
            "schema_version": checker::FINAL_SCHEMA_VERSION,
            "t_ms": self.hist.now_ms(),
            "wall_us": history::wall_us_now(),
            "sweep_ms": sweep_ms,
            "events": events.iter().map(|(c, s, m, u, d, cmid)| json!({
                "conv": c, "seq": s, "mid": m, "sender_user": u, "sender_device": d, "cmid": cmid
            })).collect::<Vec<_>>(),
            "heads": heads.into_iter().collect::<BTreeMap<_, _>>(),
            "memberships": memberships.iter().map(|(c, u, f, t)| json!({
                "conv": c, "user": u, "from_seq": f, "to_seq": t
            })).collect::<Vec<_>>(),
            "devices": devices.into_iter().collect::<BTreeMap<_, _>>(),
            "cursors": cursors.iter().map(|(d, c, v)| json!({
                "device": d, "conv": c, "delivered": v
            })).collect::<Vec<_>>(),
            "cursor_audit": audit.iter().map(|(d, c, o, n, w)| json!({
                "device": d, "conv": c, "old": o, "new": n, "wall_us": w
            })).collect::<Vec<_>>(),
            "stores": stores,
            "live": live,
            "liveness": {"bound_ms": bound_ms, "waited_ms": waited_ms, "missing": missing},
        }))
    }
}

/// Devices whose client is connected and subscribed at the end of the history: per device
/// and instance, `sub` ok subscribes, `connect` ok / `disconnect` / `crash` unsubscribe.
fn live_devices(entries: &[im_check::history::Entry]) -> BTreeSet<String> {
    let mut subscribed: HashMap<(String, u64), bool> = HashMap::new();
    for e in entries {
        let key = (e.process.clone(), e.instance);
        match &e.line {
            Line::Ok(Done::Sub { .. }) => {
                subscribed.insert(key, true);
            }
            Line::Ok(Done::Connect {}) | Line::Client(Life::Disconnect {} | Life::Crash {}) => {
                subscribed.insert(key, false);
            }
            _ => {}
        }
    }
    subscribed
        .into_iter()
        .filter(|(_, on)| *on)
        .map(|((d, _), _)| d)
        .collect()
}

fn write_json(path: &std::path::Path, v: &impl serde::Serialize) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(v).context("encode json")?;
    std::fs::write(path, text + "\n").with_context(|| format!("write {}", path.display()))
}
