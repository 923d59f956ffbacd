//! The world's admin side ([`Admin`], `World::admin`): users, devices, conversations and
//! membership through the gateway's admin commands; look-ups in the database (events,
//! cursors, heads) through the check pool; the clients' state files and the clients that
//! record into the history.
//!
//! Owns: the database address the admin commands and look-ups use, the check pool, and
//! where the clients' state files live. Must not: start, stop or fault a process
//! (`topology.rs`).

use super::*;

/// The admin side of a world: what a scenario does to the data and reads from it, beside
/// the processes ([`World`]'s own methods).
pub struct Admin {
    /// The database address the admin commands and the checks use: the primary's, or the
    /// failover proxy's in a replicated world (never the gateway's controlled proxy).
    db_url: String,
    /// Check pool, made on first use (survives a database crash: sqlx replaces
    /// broken connections on acquire).
    pool: tokio::sync::OnceCell<sqlx::PgPool>,
    /// Where the clients' state files go (`clients/` of the run's files).
    work_dir: PathBuf,
    /// The run's history: membership changes and reinstalls are recorded there, and
    /// clients made here record into it.
    hist: History,
}

impl Admin {
    pub(super) fn new(
        db_url: String,
        pool: sqlx::PgPool,
        work_dir: PathBuf,
        hist: History,
    ) -> Admin {
        Admin {
            db_url,
            pool: tokio::sync::OnceCell::new_with(Some(pool)),
            work_dir,
            hist,
        }
    }

    /// The database address the admin commands and the checks use.
    pub fn db_url(&self) -> &str {
        &self.db_url
    }

    /// A new client for `device` with its state file at [`Admin::state_path`]`(name)`,
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
            Some(self.hist.clone()),
        )
    }

    /// Loads a client from its state file (a restarted device), recorded in the history.
    pub fn load_client(&self, state: &std::path::Path) -> anyhow::Result<Client> {
        Client::load(state, Some(self.hist.clone()))
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
        let dir = self.work_dir.join("clients");
        // start() made it; a failure here shows up when the client writes its file.
        let _ = std::fs::create_dir_all(&dir);
        dir.join(format!("{name}.json"))
    }
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

/// An admin command that prints a token must print exactly one non-empty line.
fn single_line_token(out: String, command: &str) -> anyhow::Result<String> {
    if out.is_empty() || out.contains(char::is_whitespace) {
        anyhow::bail!("`im-gateway admin {command}` printed {out:?}, expected one token");
    }
    Ok(out)
}
