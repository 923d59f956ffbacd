//! One scenario's world: a migrated throwaway cluster plus a gateway on it, and the
//! admin and database look-ups scenarios need (users, devices, conversations, event
//! counts, cursors, heads).
//!
//! Owns: the pairing of one `pg::Cluster` with its gateways (the first, `gw`, and any
//! further ones on the same database, issue 12: [`World::start_gateway`]), their drop
//! order (gateways first), a cached check pool, the run's history (`history.jsonl` in
//! the cluster's work dir: every nemesis action taken through the world is recorded
//! there), the cursor audit the checker reads, and the final read that the checker judges
//! ([`World::judge`]). Must not: speak the WebSocket protocol (`crate::client`).

use std::path::PathBuf;

use anyhow::Context;

use crate::checker::{self, Report};
use crate::client::Client;
use crate::gateway::{self, Gateway, GatewayOpts};
use crate::history::{self, Action, Done, History, Join, Life, Line, Meta, Outcome};
use crate::pg::{Cluster, ClusterOpts};
use crate::proxy::Proxy;
use im_protocol::FaultPoint;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

/// The gateway's default `IM_SWEEP_MS` (SPEC 2b), for the liveness bound.
const SWEEP_MS_DEFAULT: u64 = 1000;

/// Audit of every `device_cursors` write (harness-owned, not part of the gateway's schema):
/// the checker holds each cursor increase against the acks the device really sent (D3).
const CURSOR_AUDIT_SQL: &str = "
CREATE TABLE imfault_cursor_audit (
    id        bigserial PRIMARY KEY,
    device_id text NOT NULL,
    conv_id   text NOT NULL,
    old_seq   bigint,
    new_seq   bigint NOT NULL,
    wall_us   bigint NOT NULL);
CREATE FUNCTION imfault_audit_cursor() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO imfault_cursor_audit (device_id, conv_id, old_seq, new_seq, wall_us)
    VALUES (NEW.device_id, NEW.conv_id,
            CASE WHEN TG_OP = 'UPDATE' THEN OLD.delivered_seq END, NEW.delivered_seq,
            (extract(epoch FROM clock_timestamp()) * 1000000)::bigint);
    RETURN NEW;
END $$;
CREATE TRIGGER imfault_cursor_audit AFTER INSERT OR UPDATE ON device_cursors
    FOR EACH ROW EXECUTE FUNCTION imfault_audit_cursor();";

/// A migrated cluster and a gateway serving it. Fields drop in declaration order: the
/// gateway is killed before the database goes away.
pub struct World {
    /// The current gateway (gateway 0); `None` only if a test took it out.
    pub gw: Option<Gateway>,
    /// Further gateway processes on the same database (gateways 1, 2, …), each with the
    /// options it was started with ([`World::start_gateway`]).
    more: Vec<(Gateway, GatewayOpts)>,
    /// The standby and the proxies of a replicated world (dropped before the primary).
    pub failover: Option<Failover>,
    /// The gateway's own path to the database ([`WorldOpts::db_proxy`]): a controlled
    /// proxy whose condition the nemesis sets; the checks, admin commands and the judge go
    /// around it.
    pub db_proxy: Option<Proxy>,
    /// The database address the gateway, the admin commands and the checks use: the
    /// primary's, or the failover proxy's in a replicated world.
    db_url: String,
    /// Check pool, made on first use (survives a database crash: sqlx replaces
    /// broken connections on acquire).
    pool: tokio::sync::OnceCell<sqlx::PgPool>,
    /// The database, dropped last.
    pub pg: Cluster,
    /// The options the current gateway was started with.
    opts: GatewayOpts,
    /// This run's history.
    hist: History,
}

/// How the world's database is set up (beyond [`GatewayOpts`]).
#[derive(Debug, Clone, Default)]
pub struct WorldOpts {
    /// The primary cluster's options (the LazyFS layer, extra settings).
    pub cluster: ClusterOpts,
    /// A streaming-replication standby behind a switchable proxy.
    pub replication: Option<Replication>,
    /// The gateway reaches the database through a controlled proxy ([`World::db_proxy`]).
    pub db_proxy: bool,
}

/// A standby for failover (issue 11, U2).
#[derive(Debug, Clone, Copy)]
pub struct Replication {
    /// `synchronous_standby_names = 'standby'` on the primary (its `synchronous_commit`
    /// stays `on`: a commit waits for the standby's flush).
    pub synchronous: bool,
    /// One-way delay of the replication link (a harness proxy between the standby and the
    /// primary): the window in which an asynchronous standby lags.
    pub link_delay: Duration,
}

/// The standby side of a replicated world.
pub struct Failover {
    /// "The database address": the gateway, admin commands and checks connect here.
    pub proxy: Proxy,
    /// The replication link, standby -> primary.
    pub link: Proxy,
    /// The standby (after [`World::failover`]: the new primary).
    pub standby: Cluster,
    /// How it was set up.
    pub replication: Replication,
    /// Whether the standby was promoted.
    pub promoted: bool,
}

/// device -> conv -> seq -> mid, as the client state files hold them.
type Stores = BTreeMap<String, BTreeMap<String, BTreeMap<i64, String>>>;

/// A fault armed on a running gateway ([`World::arm_fault`]).
#[derive(Debug)]
pub struct ArmedFault {
    pub gateway: usize,
    pub point: FaultPoint,
    /// Its history period.
    id: u64,
    /// What its start recorded (its end records the same).
    armed: Action,
}

/// What [`World::judge`] found.
pub struct Judgement {
    pub report: Report,
    /// The directory holding `history.jsonl`, `final.json` and `report.json`.
    pub dir: PathBuf,
}

impl World {
    /// A migrated cluster and a gateway started with `opts`. A fault in `opts` needs a
    /// binary built with the faults feature: that is checked first.
    pub async fn start(opts: GatewayOpts) -> anyhow::Result<World> {
        World::start_with(WorldOpts::default(), opts).await
    }

    /// [`World::start`] on a database set up as `wopts` says: a primary behind the LazyFS
    /// layer, or a primary with a streaming standby behind a switchable proxy.
    pub async fn start_with(wopts: WorldOpts, opts: GatewayOpts) -> anyhow::Result<World> {
        // Fail on a missing, stale or fault-less binary before starting a cluster.
        let needs_faults = opts.fault.is_some();
        tokio::task::spawn_blocking(move || {
            gateway::gateway_bin()?;
            if needs_faults {
                gateway::require_faults()?;
            }
            anyhow::Ok(())
        })
        .await
        .context("join the gateway binary check")??;
        let pg = Cluster::start_migrated_with(wopts.cluster.clone()).await?;
        let clients = pg.work_dir().join("clients");
        std::fs::create_dir_all(&clients)
            .with_context(|| format!("create {}", clients.display()))?;
        let hist = History::create(&pg.work_dir().join("history.jsonl"))?;
        {
            let pool = pg.pool().await?;
            sqlx::raw_sql(CURSOR_AUDIT_SQL)
                .execute(&pool)
                .await
                .context("install the cursor audit")?;
            pool.close().await;
        }
        let failover = match wopts.replication {
            Some(r) => Some(start_standby(&pg, r).await?),
            None => None,
        };
        let db_url = match &failover {
            Some(f) => url_at(f.proxy.addr().port()),
            None => pg.url(),
        };
        let pool = pool_at(&db_url).await?;
        hist.set_probe_pool(pool_at(&db_url).await?);
        let db_proxy = if wopts.db_proxy {
            let to = std::net::SocketAddr::from(([127, 0, 0, 1], url_port(&db_url)?));
            Some(Proxy::start_controlled(to)?)
        } else {
            None
        };
        let gw_db_url = gateway_db_url(&db_proxy, &db_url, 0);
        let gw = Gateway::start(&gw_db_url, &opts, &pg.log_dir()).await?;
        record_gateway_start(&hist, 0, &opts);
        Ok(World {
            gw: Some(gw),
            more: Vec::new(),
            failover,
            db_proxy,
            db_url,
            pool: tokio::sync::OnceCell::new_with(Some(pool)),
            pg,
            opts,
            hist,
        })
    }

    /// The database address everything connects to (see [`World::start_with`]).
    pub fn db_url(&self) -> &str {
        &self.db_url
    }

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

    /// Failover (U2): the primary's machine dies (its replication link cut, every process
    /// SIGKILLed at once), the
    /// standby is promoted, and the database address (the proxy) moves to it, closing every
    /// connection to the old one. The gateway is not restarted. Returns the timings (ms).
    pub async fn failover(&mut self) -> anyhow::Result<Value> {
        let t0 = std::time::Instant::now();
        let Some(f) = self.failover.as_ref() else {
            anyhow::bail!("failover: this world has no standby");
        };
        // The machine's network goes with it: replication bytes still on their way (held
        // back by the link's delay) never reach the standby.
        f.link.cut();
        self.hist.nemesis_instant(Action::ReplicationLinkCut {});
        let id = self
            .hist
            .nemesis_start(Action::PgPrimaryKill(Outcome::default()));
        let r = self.pg.kill_all().await;
        self.hist
            .nemesis_end(id, Action::PgPrimaryKill(Outcome::done(&r)));
        r?;
        let killed_ms = t0.elapsed().as_secs_f64() * 1000.0;
        let f = self.failover.as_mut().expect("checked above");
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
        self.hist.nemesis_instant(Action::DbAddressSwitch {
            to: to.to_string(),
            port: None,
            by: None,
        });
        Ok(json!({
            "primary_killed_ms": killed_ms,
            "standby_promoted_ms": promoted_ms,
            "address_switched_ms": t0.elapsed().as_secs_f64() * 1000.0,
        }))
    }

    /// This run's history.
    pub fn history(&self) -> &History {
        &self.hist
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
        let status = self.gw_at_mut(i).wait_exit(within).await?;
        self.hist.nemesis_instant(Action::GatewayExit {
            gateway: Some(i),
            status: self.gw_at(i).exit_code(),
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
            .fetch_one(&self.pool().await?)
            .await
            .context("pg_terminate_backend")?;
        self.hist.nemesis_instant(Action::PgTerminateBackend {
            pid,
            terminated: killed,
        });
        Ok(killed)
    }

    /// A new client for `device` with its state file at [`World::state_path`]`(name)`,
    /// recording into this world's history.
    pub fn create_client(
        &self,
        name: &str,
        device: &str,
        token: &str,
        epoch: i64,
    ) -> anyhow::Result<Client> {
        Client::create(
            &self.state_path(name),
            device,
            token,
            epoch,
            Some(self.history().clone()),
        )
    }

    /// Loads a client from its state file (a restarted device), recorded in the history.
    pub fn load_client(&self, state: &std::path::Path) -> anyhow::Result<Client> {
        Client::load(state, Some(self.history().clone()))
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
        let i = self.more.len() + 1;
        let gw_db_url = gateway_db_url(&self.db_proxy, &self.db_url, i);
        let gw = Gateway::start(&gw_db_url, &opts, &self.pg.log_dir()).await?;
        record_gateway_start(&self.hist, i, &opts);
        self.more.push((gw, opts));
        Ok(i)
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
        self.gw_at(i).control(&format!("arm {spec}")).await?;
        let armed = Action::GwFault {
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
        self.gw_at(f.gateway)
            .control(&format!("disarm {}", f.point))
            .await?;
        self.hist.nemesis_end(f.id, f.armed);
        Ok(())
    }

    /// The backend of gateway `i`'s LISTEN connection, if it has one now.
    pub async fn listen_backend(&self, i: usize) -> anyhow::Result<Option<i32>> {
        let pool = self.pool().await?;
        Ok(sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND query ILIKE 'listen%'",
        )
        .bind(gateway_app_name(i))
        .fetch_optional(&pool)
        .await?)
    }

    /// How many gateways the world holds (the first one included).
    pub fn gateway_count(&self) -> usize {
        1 + self.more.len()
    }

    /// SIGKILLs gateway `i` if it still runs, recorded as a nemesis action.
    pub fn kill_gateway_at(&mut self, i: usize) {
        if self.gw_at_mut(i).try_exit_status().is_none() {
            let id = self.hist.nemesis_start(Action::GatewayKill { gateway: i });
            self.gw_at_mut(i).kill();
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
        if i == 0 && self.gw.is_none() {
            // A test took gateway 0 out: nothing to kill.
        } else {
            self.kill_gateway_at(i);
        }
        let gw_db_url = gateway_db_url(&self.db_proxy, &self.db_url, i);
        let gw = Gateway::start(&gw_db_url, &opts, &self.pg.log_dir()).await?;
        record_gateway_start(&self.hist, i, &opts);
        if i == 0 {
            self.gw = Some(gw);
            self.opts = opts;
        } else {
            // The old process was killed and reaped above; dropping it does nothing more.
            self.more[i - 1] = (gw, opts);
        }
        Ok(())
    }

    /// The current gateway. Panics if a test took it out of `gw`.
    pub fn gw(&self) -> &Gateway {
        self.gw
            .as_ref()
            .expect("World has no gateway (taken out of World::gw)")
    }

    /// The current gateway, mutably. Panics if a test took it out of `gw`.
    pub fn gw_mut(&mut self) -> &mut Gateway {
        self.gw
            .as_mut()
            .expect("World has no gateway (taken out of World::gw)")
    }

    /// Gateway `i`: 0 is [`World::gw`], 1.. the ones [`World::start_gateway`] started.
    /// Panics on an index the world never handed out.
    pub fn gw_at(&self, i: usize) -> &Gateway {
        match i {
            0 => self.gw(),
            _ => &self.more.get(i - 1).expect("no such gateway").0,
        }
    }

    /// Gateway `i`, mutably (see [`World::gw_at`]).
    pub fn gw_at_mut(&mut self, i: usize) -> &mut Gateway {
        match i {
            0 => self.gw_mut(),
            _ => &mut self.more.get_mut(i - 1).expect("no such gateway").0,
        }
    }

    /// Gateway `i`'s `ws://ADDR/ws`.
    pub fn ws_url_at(&self, i: usize) -> String {
        self.gw_at(i).ws_url()
    }

    /// The options the current gateway was started with.
    pub fn opts(&self) -> &GatewayOpts {
        &self.opts
    }

    /// The current gateway's `ws://ADDR/ws`.
    pub fn ws_url(&self) -> String {
        self.gw().ws_url()
    }

    /// `im-gateway admin add-user USER`.
    pub async fn add_user(&self, user: &str) -> anyhow::Result<()> {
        gateway::admin(&self.db_url, &["add-user", user]).await?;
        Ok(())
    }

    /// `im-gateway admin add-device DEVICE --user USER`; returns the new token.
    pub async fn add_device(&self, device: &str, user: &str) -> anyhow::Result<String> {
        let token = gateway::admin(&self.db_url, &["add-device", device, "--user", user]).await?;
        single_line_token(token, "add-device")
    }

    /// `im-gateway admin add-conv CONV --members U1,U2,…`.
    pub async fn add_conv(&self, conv: &str, members: &[&str]) -> anyhow::Result<()> {
        let members = members.join(",");
        gateway::admin(&self.db_url, &["add-conv", conv, "--members", &members]).await?;
        Ok(())
    }

    /// `im-gateway admin join CONV USER`: opens a membership period.
    pub async fn join(&self, conv: &str, user: &str) -> anyhow::Result<()> {
        gateway::admin(&self.db_url, &["join", conv, user]).await?;
        self.hist
            .nemesis_instant(membership(Join::Join, conv, user));
        Ok(())
    }

    /// `im-gateway admin leave CONV USER`: closes the open membership period.
    pub async fn leave(&self, conv: &str, user: &str) -> anyhow::Result<()> {
        gateway::admin(&self.db_url, &["leave", conv, user]).await?;
        self.hist
            .nemesis_instant(membership(Join::Leave, conv, user));
        Ok(())
    }

    /// `im-gateway admin reinstall-device DEVICE`; returns the new token.
    pub async fn reinstall_device(&self, device: &str) -> anyhow::Result<String> {
        let token = gateway::admin(&self.db_url, &["reinstall-device", device]).await?;
        self.hist.nemesis_instant(Action::Reinstall {
            device: device.to_string(),
        });
        single_line_token(token, "reinstall-device")
    }

    /// A check pool on the cluster, made once and then shared.
    pub async fn pool(&self) -> anyhow::Result<sqlx::PgPool> {
        self.pool
            .get_or_try_init(|| pool_at(&self.db_url))
            .await
            .cloned()
    }

    /// Rows in `events` for `conv`.
    pub async fn count_events(&self, conv: &str) -> anyhow::Result<i64> {
        let pool = self.pool().await?;
        sqlx::query_scalar("SELECT count(*) FROM events WHERE conv_id = $1")
            .bind(conv)
            .fetch_one(&pool)
            .await
            .with_context(|| format!("count events of {conv}"))
    }

    /// `device_cursors.delivered_seq` of (device, conv); `None` if there is no row.
    pub async fn cursor(&self, device: &str, conv: &str) -> anyhow::Result<Option<i64>> {
        let pool = self.pool().await?;
        sqlx::query_scalar(
            "SELECT delivered_seq FROM device_cursors WHERE device_id = $1 AND conv_id = $2",
        )
        .bind(device)
        .bind(conv)
        .fetch_optional(&pool)
        .await
        .with_context(|| format!("read the cursor of {device} in {conv}"))
    }

    /// The conversation head, `next_seq - 1`. An unknown conversation is an error.
    pub async fn head(&self, conv: &str) -> anyhow::Result<i64> {
        let pool = self.pool().await?;
        let head: Option<i64> =
            sqlx::query_scalar("SELECT next_seq - 1 FROM conversations WHERE conv_id = $1")
                .bind(conv)
                .fetch_optional(&pool)
                .await
                .with_context(|| format!("read the head of {conv}"))?;
        head.with_context(|| format!("no conversation {conv}"))
    }

    /// `work_dir/clients/<name>.json`: where a test client keeps its durable state.
    /// The directory is made by `start()` (and again here, best effort).
    pub fn state_path(&self, name: &str) -> PathBuf {
        assert!(
            !name.is_empty() && !name.contains('/') && name != "..",
            "client state name {name:?} must be a plain file name"
        );
        let dir = self.pg.work_dir().join("clients");
        // start() made it; a failure here shows up when the client writes its file.
        let _ = std::fs::create_dir_all(&dir);
        dir.join(format!("{name}.json"))
    }
}

/// `postgres://postgres@127.0.0.1:PORT/postgres`.
fn url_at(port: u16) -> String {
    format!("postgres://postgres@127.0.0.1:{port}/postgres")
}

/// Where gateway `i` connects: through the database proxy when there is one, else the
/// world's database address; named `im-gateway-<i>` in `pg_stat_activity`, so that a check
/// or the nemesis can terminate one gateway's backends (not the harness's, not another
/// gateway's).
fn gateway_db_url(proxy: &Option<Proxy>, db_url: &str, i: usize) -> String {
    let base = match proxy {
        Some(p) => url_at(p.addr().port()),
        None => db_url.to_string(),
    };
    format!("{base}?application_name={}", gateway_app_name(i))
}

/// Gateway `i`'s `application_name` ([`gateway_db_url`]).
pub fn gateway_app_name(i: usize) -> String {
    format!("im-gateway-{i}")
}

/// The port of a `postgres://…@HOST:PORT/…` URL.
fn url_port(url: &str) -> anyhow::Result<u16> {
    url.rsplit_once(':')
        .and_then(|(_, rest)| rest.split('/').next())
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("no port in {url}"))
}

/// A small check pool (as `Cluster::pool`) at `url`.
async fn pool_at(url: &str) -> anyhow::Result<sqlx::PgPool> {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .with_context(|| format!("connect a pool to {url}"))
}

/// A standby of `pg` through a replication link (a delaying proxy), streaming (and, when
/// synchronous, named in `synchronous_standby_names` and reported `sync`), plus the
/// database-address proxy, pointing at the primary for now.
async fn start_standby(pg: &Cluster, r: Replication) -> anyhow::Result<Failover> {
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

/// A membership change, as the history records it.
fn membership(action: Join, conv: &str, user: &str) -> Action {
    Action::Membership {
        action,
        conv: conv.to_string(),
        user: user.to_string(),
        applied_by_an_earlier_attempt: false,
    }
}

fn record_gateway_start(hist: &History, i: usize, opts: &GatewayOpts) {
    hist.nemesis_instant(Action::GatewayStart {
        gateway: i,
        fault: opts.fault.clone(),
        sweep_ms: opts.sweep_ms.unwrap_or(SWEEP_MS_DEFAULT),
        bug: gateway::gateway_bug(),
    });
}

/// Devices whose client is connected and subscribed at the end of the history: per device
/// and instance, `sub` ok subscribes, `connect` ok / `disconnect` / `crash` unsubscribe.
fn live_devices(entries: &[history::Entry]) -> BTreeSet<String> {
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
        let sweep_ms = std::iter::once(&self.opts)
            .chain(self.more.iter().map(|(_, o)| o))
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
        let pool = self.pool().await?;
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
        let dir = self.pg.work_dir().to_path_buf();
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
        let dir = self.pg.work_dir().join("clients");
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
            "schema_version": history::SCHEMA_VERSION,
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

fn write_json(path: &std::path::Path, v: &impl serde::Serialize) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(v).context("encode json")?;
    std::fs::write(path, text + "\n").with_context(|| format!("write {}", path.display()))
}

/// An admin command that prints a token must print exactly one non-empty line.
fn single_line_token(out: String, command: &str) -> anyhow::Result<String> {
    if out.is_empty() || out.contains(char::is_whitespace) {
        anyhow::bail!("`im-gateway admin {command}` printed {out:?}, expected one token");
    }
    Ok(out)
}

/// A world on a database the harness does not run itself (issue 11, pg_auto_failover).
impl World {
    /// A world on `pg`, a database reached at its address ([`Cluster::at_address`]: a
    /// pg_auto_failover formation behind the harness's proxy): migrates it, installs the
    /// cursor audit, starts the history and a gateway with `opts` on `pg.url()`. The
    /// world's files (history, client state, gateway logs) live in `pg`'s work directory.
    /// Nemesis actions on the servers are the caller's (record them in [`World::history`]).
    pub async fn start_on(pg: Cluster, opts: GatewayOpts) -> anyhow::Result<World> {
        let needs_faults = opts.fault.is_some();
        tokio::task::spawn_blocking(move || {
            gateway::gateway_bin()?;
            if needs_faults {
                gateway::require_faults()?;
            }
            anyhow::Ok(())
        })
        .await
        .context("join the gateway binary check")??;
        let db_url = pg.url();
        gateway::migrate(&db_url)
            .await
            .with_context(|| format!("migrate the database at {db_url}"))?;
        let clients = pg.work_dir().join("clients");
        std::fs::create_dir_all(&clients)
            .with_context(|| format!("create {}", clients.display()))?;
        let hist = History::create(&pg.work_dir().join("history.jsonl"))?;
        let pool = pool_at(&db_url).await?;
        sqlx::raw_sql(CURSOR_AUDIT_SQL)
            .execute(&pool)
            .await
            .context("install the cursor audit")?;
        hist.set_probe_pool(pool_at(&db_url).await?);
        let gw = Gateway::start(&db_url, &opts, &pg.log_dir()).await?;
        record_gateway_start(&hist, 0, &opts);
        Ok(World {
            gw: Some(gw),
            more: Vec::new(),
            failover: None,
            db_proxy: None,
            db_url,
            pool: tokio::sync::OnceCell::new_with(Some(pool)),
            pg,
            opts,
            hist,
        })
    }
}
