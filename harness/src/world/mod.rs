//! One scenario's world: a migrated throwaway cluster plus a gateway on it, and the
//! admin and database look-ups scenarios need (users, devices, conversations, event
//! counts, cursors, heads).
//!
//! Owns: the pairing of one `pg::Cluster` with its gateways (the first, `gw`, and any
//! further ones on the same database, issue 12: [`World::start_gateway`]), their drop
//! order (gateways first), a cached check pool, the run's history (`history.jsonl` in
//! the cluster's work dir: every nemesis action taken through the world is recorded
//! there, and every client made through the world records into it), the cursor audit the
//! checker reads, and the final read that the checker judges ([`World::judge`]).
//! Must not: speak the WebSocket protocol (`crate::client`).
//!
//! In three parts besides the construction here: `topology.rs` (the processes: gateways,
//! the database, failover, fault arming), `admin.rs` (admin commands, look-ups, clients)
//! `judge.rs` (the final read and the checker) and `gateways.rs` (the gateway processes
//! by index, [`Gateways`]). A supervisor replaces a gateway only through
//! [`Gateways::take_exited_at`], [`Gateways::take_at`] and [`World::restart_gateway_at`].

use std::path::PathBuf;

use anyhow::Context;

use crate::client::Client;
use crate::gateway::{self, Gateway, GatewayOpts};
use crate::history::{self, History};
use crate::pg::{Cluster, ClusterOpts};
use crate::proxy::Proxy;
use im_check::history::{Action, Done, Join, Life, Line, Meta, Outcome};
use im_check::{self as checker, Report};
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
    /// The gateway processes: gateway 0 and any further ones on the same database
    /// ([`World::start_gateway`]), each with the options it was started with.
    pub gateways: Gateways,
    /// The standby and the proxies of a replicated world (dropped before the primary).
    pub failover: Option<Failover>,
    /// A pg_auto_failover formation the database is (issue 21): [`World::pg`] is then its
    /// address, a proxy that follows the monitor's primary.
    formation: Option<ManagedFormation>,
    /// The gateway's own path to the database ([`WorldOpts::db_proxy`]): a controlled
    /// proxy whose condition the nemesis sets; the checks, admin commands and the judge go
    /// around it.
    pub db_proxy: Option<Proxy>,
    /// The database address the gateways use (behind [`World::db_proxy`] when there is
    /// one): the primary's, or the failover proxy's in a replicated world.
    db_url: String,
    /// Users, devices, conversations, look-ups and clients ([`Admin`]).
    pub admin: Admin,
    /// The database, dropped last: the primary (after [`World::failover`], the promoted
    /// standby).
    pub pg: Cluster,
    /// The run's files (history, client state files, judge's output): the first
    /// primary's work directory, whatever the primary is now.
    work_dir: std::path::PathBuf,
    /// Where the gateways and the first primary log.
    log_dir: std::path::PathBuf,
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
    /// The database is a pg_auto_failover formation (monitor, primary, secondary) behind
    /// an address that follows its monitor, not a cluster the harness runs itself: neither
    /// `cluster` nor `replication` then applies.
    pub formation: bool,
}

/// A world's pg_auto_failover formation and what the nemesis did to it.
pub struct ManagedFormation {
    pub formation: crate::autofailover::Formation,
    /// The data node killed last, until the monitor named another primary.
    pub primary_down: Option<crate::autofailover::Crash>,
    /// The monitor's kill, until it was started again.
    pub monitor_down: Option<crate::autofailover::Crash>,
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
    /// The standby (after [`World::failover`]: the dead primary; the promoted standby is
    /// then [`World::pg`]).
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

/// Disk faults in force on the database's layer ([`World::start_disk_faults`]).
#[derive(Debug)]
pub struct DiskFaultPeriod {
    /// Its history period.
    id: u64,
    faults: crate::lazyfs::DiskFaults,
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
        check_gateway_binary(&opts).await?;
        let (pg, formation) = if wopts.formation {
            anyhow::ensure!(
                wopts.replication.is_none() && !wopts.cluster.lazyfs,
                "a pg_auto_failover formation has its own standby and runs on no LazyFS layer"
            );
            let (pg, f) = start_formation().await?;
            (pg, Some(f))
        } else {
            (
                Cluster::start_migrated_with(wopts.cluster.clone()).await?,
                None,
            )
        };
        let hist = open_history(&pg)?;
        {
            // Before the standby's base backup, which then holds it.
            let pool = pg.pool().await?;
            install_cursor_audit(&pool).await?;
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
            gateways: Gateways::new(gw, opts),
            failover,
            formation,
            db_proxy,
            admin: Admin::new(
                db_url.clone(),
                pool,
                pg.work_dir().to_path_buf(),
                hist.clone(),
            ),
            db_url,
            work_dir: pg.work_dir().to_path_buf(),
            log_dir: pg.log_dir(),
            pg,
            hist,
        })
    }

    /// The run's files: history, client state files, the judge's output.
    pub fn work_dir(&self) -> &std::path::Path {
        &self.work_dir
    }

    /// Where the gateways (and the first primary) log.
    pub fn log_dir(&self) -> &std::path::Path {
        &self.log_dir
    }

    /// This run's history.
    pub fn history(&self) -> &History {
        &self.hist
    }

    /// The options the current gateway was started with.
    pub fn opts(&self) -> &GatewayOpts {
        self.gateways.opts_at(0)
    }
}

/// A world on a database the harness does not run itself (issue 11, pg_auto_failover).
impl World {
    /// A world on `pg`, a database reached at its address ([`Cluster::at_address`]: a
    /// pg_auto_failover formation behind the harness's proxy): migrates it, installs the
    /// cursor audit, starts the history and a gateway with `opts` on `pg.url()`. The
    /// world's files (history, client state, gateway logs) live in `pg`'s work directory.
    /// Nemesis actions on the servers are the caller's (record them in [`World::history`]).
    pub async fn start_on(pg: Cluster, opts: GatewayOpts) -> anyhow::Result<World> {
        check_gateway_binary(&opts).await?;
        let db_url = pg.url();
        gateway::migrate(&db_url)
            .await
            .with_context(|| format!("migrate the database at {db_url}"))?;
        let hist = open_history(&pg)?;
        let pool = pool_at(&db_url).await?;
        install_cursor_audit(&pool).await?;
        hist.set_probe_pool(pool_at(&db_url).await?);
        let gw = Gateway::start(&db_url, &opts, &pg.log_dir()).await?;
        record_gateway_start(&hist, 0, &opts);
        Ok(World {
            gateways: Gateways::new(gw, opts),
            failover: None,
            formation: None,
            db_proxy: None,
            admin: Admin::new(
                db_url.clone(),
                pool,
                pg.work_dir().to_path_buf(),
                hist.clone(),
            ),
            db_url,
            work_dir: pg.work_dir().to_path_buf(),
            log_dir: pg.log_dir(),
            pg,
            hist,
        })
    }
}

/// A pg_auto_failover formation with the monitor's tuning of `crate::autofailover`, and
/// its address as a migrated cluster handle ([`Cluster::at_address`]).
async fn start_formation() -> anyhow::Result<(Cluster, ManagedFormation)> {
    let formation =
        crate::autofailover::Formation::start(crate::autofailover::Tuning::default()).await?;
    let pg = Cluster::at_address(formation.proxy_port())?;
    gateway::migrate(&pg.url())
        .await
        .with_context(|| format!("migrate the formation's database at {}", pg.url()))?;
    Ok((
        pg,
        ManagedFormation {
            formation,
            primary_down: None,
            monitor_down: None,
        },
    ))
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

/// Fails on a missing, stale or fault-less binary before a cluster is started.
async fn check_gateway_binary(opts: &GatewayOpts) -> anyhow::Result<()> {
    let needs_faults = opts.fault.is_some();
    tokio::task::spawn_blocking(move || {
        gateway::gateway_bin()?;
        if needs_faults {
            gateway::require_faults()?;
        }
        anyhow::Ok(())
    })
    .await
    .context("join the gateway binary check")?
}

/// The clients' directory ([`crate::client_files`]) and the history, in `pg`'s work
/// directory.
fn open_history(pg: &Cluster) -> anyhow::Result<History> {
    crate::client_files::make(pg.work_dir())?;
    History::create(&pg.work_dir().join("history.jsonl"))
}

/// The cursor audit the checker reads ([`CURSOR_AUDIT_SQL`]).
async fn install_cursor_audit(pool: &sqlx::PgPool) -> anyhow::Result<()> {
    sqlx::raw_sql(CURSOR_AUDIT_SQL)
        .execute(pool)
        .await
        .context("install the cursor audit")?;
    Ok(())
}

fn record_gateway_start(hist: &History, i: usize, opts: &GatewayOpts) {
    hist.nemesis_instant(Action::GatewayStart {
        gateway: i,
        fault: opts.fault.clone(),
        sweep_ms: opts.sweep_ms.unwrap_or(SWEEP_MS_DEFAULT),
        bug: gateway::gateway_bug(),
    });
}

mod admin;
pub use admin::Admin;
mod gateways;
pub use gateways::Gateways;
mod judge;
mod topology;

use topology::start_standby;
