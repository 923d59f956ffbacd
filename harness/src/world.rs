//! One scenario's world: a migrated throwaway cluster plus a gateway on it, and the
//! admin and database look-ups scenarios need (users, devices, conversations, event
//! counts, cursors, heads).
//!
//! Owns: the pairing of one `pg::Cluster` with the current `gateway::Gateway`, their
//! drop order (gateway first), and a cached check pool. Must not: speak the WebSocket
//! protocol (`crate::client`) or judge invariants (the scenarios do).

use std::path::PathBuf;

use anyhow::Context;

use crate::gateway::{self, Gateway, GatewayOpts};
use crate::pg::Cluster;

/// A migrated cluster and a gateway serving it. Fields drop in declaration order: the
/// gateway is killed before the database goes away.
pub struct World {
    /// The current gateway; `None` only if a test took it out.
    pub gw: Option<Gateway>,
    /// Check pool, made on first use (survives a database crash: sqlx replaces
    /// broken connections on acquire).
    pool: tokio::sync::OnceCell<sqlx::PgPool>,
    /// The database, dropped last.
    pub pg: Cluster,
    /// The options the current gateway was started with.
    opts: GatewayOpts,
}

impl World {
    /// A migrated cluster and a gateway started with `opts`. A fault in `opts` needs a
    /// binary built with the faults feature: that is checked first.
    pub async fn start(opts: GatewayOpts) -> anyhow::Result<World> {
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
        let pg = Cluster::start_migrated().await?;
        let clients = pg.work_dir().join("clients");
        std::fs::create_dir_all(&clients)
            .with_context(|| format!("create {}", clients.display()))?;
        let gw = Gateway::start(&pg.url(), &opts, &pg.log_dir()).await?;
        Ok(World {
            gw: Some(gw),
            pool: tokio::sync::OnceCell::new(),
            pg,
            opts,
        })
    }

    /// Kills the current gateway (if it still runs) and starts a new one with `opts` on
    /// the same cluster.
    pub async fn restart_gateway(&mut self, opts: GatewayOpts) -> anyhow::Result<()> {
        if opts.fault.is_some() {
            tokio::task::spawn_blocking(gateway::require_faults)
                .await
                .context("join the faults check")??;
        }
        if let Some(mut old) = self.gw.take() {
            old.kill();
        }
        self.gw = Some(Gateway::start(&self.pg.url(), &opts, &self.pg.log_dir()).await?);
        self.opts = opts;
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
        gateway::admin(&self.pg.url(), &["add-user", user]).await?;
        Ok(())
    }

    /// `im-gateway admin add-device DEVICE --user USER`; returns the new token.
    pub async fn add_device(&self, device: &str, user: &str) -> anyhow::Result<String> {
        let token = gateway::admin(&self.pg.url(), &["add-device", device, "--user", user]).await?;
        single_line_token(token, "add-device")
    }

    /// `im-gateway admin add-conv CONV --members U1,U2,…`.
    pub async fn add_conv(&self, conv: &str, members: &[&str]) -> anyhow::Result<()> {
        let members = members.join(",");
        gateway::admin(&self.pg.url(), &["add-conv", conv, "--members", &members]).await?;
        Ok(())
    }

    /// `im-gateway admin join CONV USER`: opens a membership period.
    pub async fn join(&self, conv: &str, user: &str) -> anyhow::Result<()> {
        gateway::admin(&self.pg.url(), &["join", conv, user]).await?;
        Ok(())
    }

    /// `im-gateway admin leave CONV USER`: closes the open membership period.
    pub async fn leave(&self, conv: &str, user: &str) -> anyhow::Result<()> {
        gateway::admin(&self.pg.url(), &["leave", conv, user]).await?;
        Ok(())
    }

    /// `im-gateway admin reinstall-device DEVICE`; returns the new token.
    pub async fn reinstall_device(&self, device: &str) -> anyhow::Result<String> {
        let token = gateway::admin(&self.pg.url(), &["reinstall-device", device]).await?;
        single_line_token(token, "reinstall-device")
    }

    /// A check pool on the cluster, made once and then shared.
    pub async fn pool(&self) -> anyhow::Result<sqlx::PgPool> {
        self.pool.get_or_try_init(|| self.pg.pool()).await.cloned()
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

/// An admin command that prints a token must print exactly one non-empty line.
fn single_line_token(out: String, command: &str) -> anyhow::Result<String> {
    if out.is_empty() || out.contains(char::is_whitespace) {
        anyhow::bail!("`im-gateway admin {command}` printed {out:?}, expected one token");
    }
    Ok(out)
}
