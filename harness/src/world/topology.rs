//! The world's processes: its gateways (started, killed, restarted, waited for, armed
//! with faults through their control socket) and its database (crashed, restarted, cut
//! from power, failed over), each action recorded in the history.
//!
//! Must not: judge anything (`judge.rs`) or speak the admin commands (`admin.rs`).

use super::*;

impl World {
    /// The power cut (LazyFS), recorded as a nemesis action: every process of the cluster
    /// killed at once, unsynced writes thrown away, the layer remounted. Returns what the
    /// cut dropped. [`World::restart_pg`] then recovers on what remains.
    pub async fn power_cut_pg(&mut self) -> anyhow::Result<crate::lazyfs::Cut> {
        let id = self
            .hist
            .nemesis_start(Action::PgPowerCut(Outcome::default()));
        let r = self.pg.power_cut().await;
        self.hist
            .nemesis_end(id, Action::PgPowerCut(Outcome::of(&r, |cut| *cut)));
        r
    }

    /// A power cut ([`World::power_cut_pg`]) that first half writes the last page written
    /// and not synced (a torn write).
    pub async fn power_cut_pg_torn(&mut self) -> anyhow::Result<crate::lazyfs::Cut> {
        let id = self
            .hist
            .nemesis_start(Action::PgPowerCut(Outcome::default()));
        let r = self.pg.power_cut_with(true).await;
        self.hist
            .nemesis_end(id, Action::PgPowerCut(Outcome::of(&r, |cut| *cut)));
        r
    }

    /// Puts `faults` in force on the database's LazyFS layer (issue 21), recorded as a
    /// `disk-fault` period that [`World::end_disk_faults`] ends.
    pub fn start_disk_faults(
        &mut self,
        faults: crate::lazyfs::DiskFaults,
    ) -> anyhow::Result<DiskFaultPeriod> {
        self.pg.set_disk_faults(faults)?;
        let id = self.hist.nemesis_start(Action::DiskFault { faults });
        Ok(DiskFaultPeriod { id, faults })
    }

    /// Ends what [`World::start_disk_faults`] started: the layer has no fault from now on.
    pub fn end_disk_faults(&mut self, p: DiskFaultPeriod) -> anyhow::Result<()> {
        let r = self.pg.set_disk_faults(Default::default());
        self.hist
            .nemesis_end(p.id, Action::DiskFault { faults: p.faults });
        r
    }

    /// Failover (U2): the primary's machine dies (its replication link cut, every process
    /// SIGKILLed at once), the
    /// standby is promoted, and the database address (the proxy) moves to it, closing every
    /// connection to the old one. The gateway is not restarted. Returns the timings (ms).
    /// From then on [`World::pg`] is the promoted standby (the database faults act on it)
    /// and the failover's `standby` the dead primary.
    pub async fn failover(&mut self) -> anyhow::Result<Value> {
        let t0 = std::time::Instant::now();
        self.kill_primary().await?;
        let killed_ms = t0.elapsed().as_secs_f64() * 1000.0;
        let mut t = self.promote_standby().await?;
        t["primary_killed_ms"] = json!(killed_ms);
        t["standby_promoted_ms"] =
            json!(killed_ms + t["standby_promoted_ms"].as_f64().unwrap_or(0.0));
        t["address_switched_ms"] = json!(t0.elapsed().as_secs_f64() * 1000.0);
        Ok(t)
    }

    /// The first half of [`World::failover`] (the nemesis's failover faults start with it):
    /// the primary's machine dies, its replication link cut first (replication bytes still
    /// on their way never reach the standby), every process SIGKILLed at once.
    pub async fn kill_primary(&mut self) -> anyhow::Result<()> {
        let Some(f) = self.failover.as_ref() else {
            anyhow::bail!("failover: this world has no standby");
        };
        anyhow::ensure!(!f.promoted, "failover: the standby was promoted already");
        f.link.cut();
        self.hist.nemesis_instant(Action::ReplicationLinkCut {
            synchronous: Some(f.replication.synchronous),
        });
        let id = self
            .hist
            .nemesis_start(Action::PgPrimaryKill(Outcome::default()));
        let r = self.pg.kill_all().await;
        self.hist
            .nemesis_end(id, Action::PgPrimaryKill(Outcome::done(&r)));
        r
    }

    /// The second half of [`World::failover`]: the standby promoted, the database address
    /// moved to it (every connection to the old one closed), and the promoted standby made
    /// [`World::pg`]. Returns the timings (ms).
    pub async fn promote_standby(&mut self) -> anyhow::Result<Value> {
        let t0 = std::time::Instant::now();
        let Some(f) = self.failover.as_mut() else {
            anyhow::bail!("failover: this world has no standby");
        };
        anyhow::ensure!(!f.promoted, "failover: the standby was promoted already");
        let id = self
            .hist
            .nemesis_start(Action::PgPromote(Outcome::default()));
        let r = f.standby.promote().await;
        self.hist
            .nemesis_end(id, Action::PgPromote(Outcome::done(&r)));
        r?;
        f.promoted = true;
        let promoted_ms = t0.elapsed().as_secs_f64() * 1000.0;
        let to = std::net::SocketAddr::from(([127, 0, 0, 1], f.standby.port()));
        f.proxy.switch(to);
        std::mem::swap(&mut self.pg, &mut f.standby);
        self.hist.nemesis_instant(Action::DbAddressSwitch {
            to: to.to_string(),
            port: None,
            by: None,
        });
        Ok(json!({
            "standby_promoted_ms": promoted_ms,
            "address_switched_ms": t0.elapsed().as_secs_f64() * 1000.0,
        }))
    }

    /// Waits (20 s at most) until the standby has replayed everything the primary wrote
    /// so far: what was provisioned survives a failover.
    pub async fn standby_caught_up(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.failover.is_some(), "this world has no standby");
        let pool = self.pg.pool().await?;
        let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
            .fetch_one(&pool)
            .await?;
        let r = crate::util::wait_until(
            "the standby to replay the primary's WAL",
            Duration::from_secs(20),
            async || {
                let ok: Option<bool> = sqlx::query_scalar(
                    "SELECT replay_lsn >= $1::pg_lsn FROM pg_stat_replication
                     WHERE application_name = 'standby'",
                )
                .bind(&lsn)
                .fetch_optional(&pool)
                .await
                .map_err(|e| e.to_string())?
                .flatten();
                ok.filter(|b| *b).ok_or(format!("{ok:?}"))
            },
        )
        .await;
        pool.close().await;
        r.map(|_| ())
    }

    /// A pg_auto_failover formation's primary dies (every process of its node SIGKILLed at
    /// once), recorded as the failover of [`World::kill_primary`] is: the replication link
    /// cut (synchronous as the primary's settings and `pg_stat_replication` said just
    /// before: pg_auto_failover chooses, the history records what it chose), then the
    /// kill. Detecting it and promoting the secondary are the monitor's:
    /// [`World::formation_promoted`] waits for that.
    pub async fn formation_kill_primary(&mut self) -> anyhow::Result<Value> {
        let Some(m) = self.formation.as_mut() else {
            anyhow::bail!("this world runs no pg_auto_failover formation");
        };
        anyhow::ensure!(
            m.primary_down.is_none(),
            "the formation's primary is down already"
        );
        let replication = m.formation.replication().await?;
        let synchronous = replication["mode"] == "synchronous";
        self.hist.nemesis_instant(Action::ReplicationLinkCut {
            synchronous: Some(synchronous),
        });
        let id = self.hist.nemesis_start(Action::PgPrimaryKill(Outcome {
            node: replication["primary"].as_str().map(str::to_string),
            ..Outcome::default()
        }));
        let crash = m.formation.crash_primary().await;
        self.hist.nemesis_end(
            id,
            Action::PgPrimaryKill(Outcome {
                node: crash.as_ref().ok().map(|c| c.node.clone()),
                ..Outcome::done(&crash)
            }),
        );
        let crash = crash?;
        let out = json!({"node": crash.node, "processes_killed": crash.processes,
                         "replication": replication});
        m.primary_down = Some(crash);
        Ok(out)
    }

    /// Waits (`within` at most) until the formation's monitor named another primary than
    /// the one [`World::formation_kill_primary`] killed and the address followed, recorded
    /// as the address switch; Err if it did not.
    pub async fn formation_promoted(&mut self, within: Duration) -> anyhow::Result<Value> {
        let Some(m) = self.formation.as_mut() else {
            anyhow::bail!("this world runs no pg_auto_failover formation");
        };
        let Some(crash) = m.primary_down.as_ref() else {
            anyhow::bail!("the formation's primary was not killed");
        };
        let Some(switch) = m.formation.wait_switch(crash.port, within).await else {
            anyhow::bail!(
                "the monitor named no other primary within {within:?} of {}'s death; monitor \
                 states: {}",
                crash.node,
                json!(m.formation.timeline(crash.at))
            );
        };
        let after_ms = switch.at.saturating_duration_since(crash.at).as_secs_f64() * 1000.0;
        self.hist.nemesis_instant(Action::DbAddressSwitch {
            to: switch.node.clone(),
            port: Some(switch.port),
            by: Some("the monitor's get_primary()".into()),
        });
        m.primary_down = None;
        Ok(json!({"promoted": switch.node, "after_ms": after_ms}))
    }

    /// The formation's monitor dies (every process of it SIGKILLed); the data nodes run on.
    pub async fn formation_kill_monitor(&mut self) -> anyhow::Result<Value> {
        let Some(m) = self.formation.as_mut() else {
            anyhow::bail!("this world runs no pg_auto_failover formation");
        };
        let crash = m.formation.crash_monitor().await?;
        let out = json!({"processes_killed": crash.processes});
        m.monitor_down = Some(crash);
        Ok(out)
    }

    /// The killed monitor started again (its configuration put back if the kill tore it:
    /// `config_restored`); waits until it answers.
    pub async fn formation_restart_monitor(&mut self) -> anyhow::Result<Value> {
        let Some(m) = self.formation.as_mut() else {
            anyhow::bail!("this world runs no pg_auto_failover formation");
        };
        let Some(crash) = m.monitor_down.take() else {
            anyhow::bail!("the formation's monitor was not killed");
        };
        let restart = m.formation.restart_monitor().await?;
        Ok(json!({
            "down_ms": crash.at.elapsed().as_secs_f64() * 1000.0,
            "config_restored": restart.config_restored,
        }))
    }

    /// The formation's logs directory (one file per node), if the world runs one.
    pub fn formation_log_dir(&self) -> Option<std::path::PathBuf> {
        self.formation
            .as_ref()
            .map(|m| m.formation.work_dir().join("logs"))
    }

    /// Waits for the current gateway to exit (a halt at a fault point) and records it.
    pub async fn wait_gateway_exit(
        &mut self,
        within: Duration,
    ) -> anyhow::Result<std::process::ExitStatus> {
        self.wait_gateway_exit_at(0, within).await
    }

    /// Waits for gateway `i` to exit (a halt at a fault point) and records it.
    pub async fn wait_gateway_exit_at(
        &mut self,
        i: usize,
        within: Duration,
    ) -> anyhow::Result<std::process::ExitStatus> {
        let status = self.gateways.at_mut(i).wait_exit(within).await?;
        self.hist.nemesis_instant(Action::GatewayExit {
            gateway: Some(i),
            status: self.gateways.at(i).exit_code(),
            raw: status.to_string(),
        });
        Ok(status)
    }

    /// Crashes PostgreSQL (immediate shutdown), recorded as a nemesis action.
    pub async fn crash_pg(&mut self) -> anyhow::Result<()> {
        let id = self.hist.nemesis_start(Action::PgCrash(Outcome::default()));
        let r = self.pg.crash().await;
        self.hist
            .nemesis_end(id, Action::PgCrash(Outcome::done(&r)));
        r
    }

    /// Starts PostgreSQL again after a crash (recovery), recorded as a nemesis action.
    pub async fn restart_pg(&mut self) -> anyhow::Result<()> {
        let id = self
            .hist
            .nemesis_start(Action::PgRestart(Outcome::default()));
        let r = self.pg.restart().await;
        self.hist
            .nemesis_end(id, Action::PgRestart(Outcome::done(&r)));
        r
    }

    /// `pg_terminate_backend(pid)`, recorded as a nemesis action; returns its result.
    pub async fn terminate_backend(&self, pid: i32) -> anyhow::Result<bool> {
        let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .fetch_one(&self.admin.pool().await?)
            .await
            .context("pg_terminate_backend")?;
        self.hist.nemesis_instant(Action::PgTerminateBackend {
            pid,
            terminated: killed,
        });
        Ok(killed)
    }

    /// Kills the current gateway (if it still runs) and starts a new one with `opts` on
    /// the same cluster.
    pub async fn restart_gateway(&mut self, opts: GatewayOpts) -> anyhow::Result<()> {
        self.restart_gateway_at(0, opts).await
    }

    /// Starts one more gateway process with `opts` on the same database (issue 12: several
    /// gateways on one PostgreSQL); returns its index for the `*_at` methods (1, 2, …).
    pub async fn start_gateway(&mut self, opts: GatewayOpts) -> anyhow::Result<usize> {
        if opts.fault.is_some() {
            tokio::task::spawn_blocking(gateway::require_faults)
                .await
                .context("join the faults check")??;
        }
        let i = self.gateways.count();
        let gw_db_url = gateway_db_url(&self.db_proxy, &self.db_url, i);
        let gw = Gateway::start(&gw_db_url, &opts, self.log_dir()).await?;
        record_gateway_start(&self.hist, i, &opts);
        Ok(self.gateways.push(gw, opts))
    }

    /// Arms `spec` (`point:action[:skip[:count]]`, `IM_FAULT` syntax) on gateway `i` through
    /// its fault control socket ([`GatewayOpts::control`]), recorded in the history as a
    /// `gw-fault` period that [`World::disarm_fault`] ends.
    pub async fn arm_fault(&self, i: usize, spec: &str) -> anyhow::Result<ArmedFault> {
        let mut parts = spec.split(':');
        let point: FaultPoint = parts
            .next()
            .unwrap_or_default()
            .parse()
            .with_context(|| format!("fault spec {spec:?}"))?;
        let action = parts
            .next()
            .context("a fault spec is point:action…")?
            .to_string();
        self.gateways.at(i).control(&format!("arm {spec}")).await?;
        let armed = Action::GwFault {
            leaves_the_sweep_alone: gateway::frame_fault_leaves_the_sweep_alone(point, &action),
            point,
            action,
            spec: spec.to_string(),
            gateway: i,
        };
        let id = self.hist.nemesis_start(armed.clone());
        Ok(ArmedFault {
            gateway: i,
            point,
            id,
            armed,
        })
    }

    /// Disarms what [`World::arm_fault`] armed and ends its history period.
    pub async fn disarm_fault(&self, f: ArmedFault) -> anyhow::Result<()> {
        self.gateways
            .at(f.gateway)
            .control(&format!("disarm {}", f.point))
            .await?;
        self.hist.nemesis_end(f.id, f.armed);
        Ok(())
    }

    /// The backend of gateway `i`'s LISTEN connection, if it has one now.
    pub async fn listen_backend(&self, i: usize) -> anyhow::Result<Option<i32>> {
        let pool = self.admin.pool().await?;
        Ok(sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND query ILIKE 'listen%'",
        )
        .bind(gateway_app_name(i))
        .fetch_optional(&pool)
        .await?)
    }

    /// SIGKILLs gateway `i` if it is there and still runs, recorded as a nemesis action.
    pub fn kill_gateway_at(&mut self, i: usize) {
        if self.gateways.up_at(i) {
            let id = self.hist.nemesis_start(Action::GatewayKill { gateway: i });
            self.gateways.at_mut(i).kill();
            self.hist
                .nemesis_end(id, Action::GatewayKill { gateway: i });
        }
    }

    /// Kills gateway `i` (if it still runs) and starts a new one with `opts` in its place,
    /// on the same database; index `i` then names the new process.
    pub async fn restart_gateway_at(&mut self, i: usize, opts: GatewayOpts) -> anyhow::Result<()> {
        if opts.fault.is_some() {
            tokio::task::spawn_blocking(gateway::require_faults)
                .await
                .context("join the faults check")??;
        }
        if self.gateways.has_at(i) {
            self.kill_gateway_at(i);
        }
        let gw_db_url = gateway_db_url(&self.db_proxy, &self.db_url, i);
        let gw = Gateway::start(&gw_db_url, &opts, self.log_dir()).await?;
        record_gateway_start(&self.hist, i, &opts);
        self.gateways.replace(i, gw, opts);
        Ok(())
    }

    /// The current gateway. Panics if a test took it out of `gw`.
    pub fn gw(&self) -> &Gateway {
        self.gateways.at(0)
    }

    /// The current gateway, mutably. Panics if a test took it out of `gw`.
    pub fn gw_mut(&mut self) -> &mut Gateway {
        self.gateways.at_mut(0)
    }

    /// The current gateway's `ws://ADDR/ws`.
    pub fn ws_url(&self) -> String {
        self.gw().ws_url()
    }
}

/// A standby of `pg` through a replication link (a delaying proxy), streaming (and, when
/// synchronous, named in `synchronous_standby_names` and reported `sync`), plus the
/// database-address proxy, pointing at the primary for now.
pub(super) async fn start_standby(pg: &Cluster, r: Replication) -> anyhow::Result<Failover> {
    let primary = std::net::SocketAddr::from(([127, 0, 0, 1], pg.port()));
    let link = Proxy::start(primary, r.link_delay)?;
    let standby = Cluster::start_standby(pg, link.addr().port(), Vec::new()).await?;
    let pool = pg.pool().await?;
    if r.synchronous {
        // Only now: with no standby, every commit (the migrations') would wait for one.
        sqlx::raw_sql("ALTER SYSTEM SET synchronous_standby_names = 'standby'")
            .execute(&pool)
            .await
            .context("set synchronous_standby_names")?;
        sqlx::raw_sql("SELECT pg_reload_conf()")
            .execute(&pool)
            .await
            .context("reload the configuration")?;
    }
    let want = if r.synchronous { "sync" } else { "async" };
    let pool = &pool;
    crate::util::wait_until(
        &format!("the standby to stream ({want})"),
        Duration::from_secs(20),
        async || {
            let states: Vec<(String, String)> = match sqlx::query_as(
                "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = 'standby'",
            )
            .fetch_all(pool)
            .await
            {
                Ok(states) => states,
                // Not a reason to wait: end the wait with the error.
                Err(e) => return Ok(Err(e).context("read pg_stat_replication")),
            };
            if states.iter().any(|(s, ss)| s == "streaming" && ss == want) {
                Ok(Ok(()))
            } else {
                Err(states)
            }
        },
    )
    .await??;
    pool.close().await;
    let proxy = Proxy::start(primary, Duration::ZERO)?;
    Ok(Failover {
        proxy,
        link,
        standby,
        replication: r,
        promoted: false,
    })
}
