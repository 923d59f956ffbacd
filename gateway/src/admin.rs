//! The `admin` commands of SPEC 2b: provisioning users, devices, conversations and
//! membership periods. Each command is one transaction; bad input is a clear error message,
//! never a partial write. Not used by `serve`.

use crate::store::token_sha256;
use anyhow::{bail, Context};
use sqlx::PgPool;

/// One admin command (`im-gateway admin …`); ids are 1 to 64 characters of
/// `A-Z a-z 0-9 . _ -`.
#[derive(Clone, Debug, clap::Subcommand)]
pub enum Command {
    /// Create a user.
    AddUser { user: String },
    /// Create a device of USER and print its token once on stdout.
    AddDevice {
        device: String,
        #[arg(long)]
        user: String,
    },
    /// Create a conversation with open memberships for the members.
    AddConv {
        conv: String,
        /// Comma-separated user ids: U1,U2,...
        #[arg(long)]
        members: String,
    },
    /// Open a membership period of USER in CONV, from the next seq.
    Join { conv: String, user: String },
    /// Close USER's open membership period in CONV at the next seq.
    Leave { conv: String, user: String },
    /// Raise DEVICE's install epoch and print its new token once (older installs get
    /// STALE_INSTALL).
    ReinstallDevice { device: String },
}

fn check_id(kind: &str, id: &str) -> anyhow::Result<()> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if !ok {
        bail!("invalid {kind} id {id:?}: use 1 to 64 characters of A-Z a-z 0-9 . _ -");
    }
    Ok(())
}

fn new_token() -> anyhow::Result<String> {
    let mut buf = [0u8; 32];
    getrandom::getrandom(&mut buf).map_err(|e| anyhow::anyhow!("no randomness: {e}"))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

async fn exists(pool: &PgPool, sql: &str, id: &str) -> anyhow::Result<bool> {
    Ok(sqlx::query_scalar::<_, bool>(sql)
        .bind(id)
        .fetch_one(pool)
        .await?)
}

async fn need_user(pool: &PgPool, user: &str) -> anyhow::Result<()> {
    if !exists(
        pool,
        "SELECT EXISTS (SELECT 1 FROM users WHERE user_id = $1)",
        user,
    )
    .await?
    {
        bail!("unknown user {user:?} (create it with `admin add-user`)");
    }
    Ok(())
}

/// Runs one admin command; returns what to print on stdout (a token, or nothing).
pub async fn run(pool: &PgPool, cmd: &Command) -> anyhow::Result<Option<String>> {
    match cmd {
        Command::AddUser { user } => add_user(pool, user).await.map(|()| None),
        Command::AddDevice { device, user } => add_device(pool, device, user).await.map(Some),
        Command::AddConv { conv, members } => add_conv(pool, conv, members).await.map(|()| None),
        Command::Join { conv, user } => move_period(pool, conv, user, true).await.map(|()| None),
        Command::Leave { conv, user } => move_period(pool, conv, user, false).await.map(|()| None),
        Command::ReinstallDevice { device } => reinstall(pool, device).await.map(Some),
    }
}

async fn add_user(pool: &PgPool, user: &str) -> anyhow::Result<()> {
    check_id("user", user)?;
    let r = sqlx::query("INSERT INTO users (user_id) VALUES ($1) ON CONFLICT DO NOTHING")
        .bind(user)
        .execute(pool)
        .await
        .context("insert user")?;
    if r.rows_affected() == 0 {
        bail!("user {user:?} already exists");
    }
    Ok(())
}

/// A new device of `user`, install 1; returns its token (stored only as its SHA-256).
async fn add_device(pool: &PgPool, device: &str, user: &str) -> anyhow::Result<String> {
    check_id("device", device)?;
    need_user(pool, user).await?;
    let token = new_token()?;
    let r = sqlx::query(
        "INSERT INTO devices (device_id, user_id, install_epoch, token_sha256)
         VALUES ($1, $2, 1, $3) ON CONFLICT DO NOTHING",
    )
    .bind(device)
    .bind(user)
    .bind(token_sha256(&token))
    .execute(pool)
    .await
    .context("insert device")?;
    if r.rows_affected() == 0 {
        bail!("device {device:?} already exists");
    }
    Ok(token)
}

/// A new conversation whose `members` (comma-separated users) are members from seq 1.
async fn add_conv(pool: &PgPool, conv: &str, members: &str) -> anyhow::Result<()> {
    check_id("conversation", conv)?;
    let members: Vec<&str> = members.split(',').filter(|m| !m.is_empty()).collect();
    if members.is_empty() {
        bail!("--members needs at least one user");
    }
    for m in &members {
        check_id("user", m)?;
        need_user(pool, m).await?;
    }
    let mut tx = pool.begin().await?;
    let r = sqlx::query("INSERT INTO conversations (conv_id) VALUES ($1) ON CONFLICT DO NOTHING")
        .bind(conv)
        .execute(&mut *tx)
        .await
        .context("insert conversation")?;
    if r.rows_affected() == 0 {
        bail!("conversation {conv:?} already exists");
    }
    for m in members {
        sqlx::query(
            "INSERT INTO memberships (conv_id, user_id, from_seq) VALUES ($1, $2, 1)
             ON CONFLICT DO NOTHING",
        )
        .bind(conv)
        .bind(m)
        .execute(&mut *tx)
        .await
        .context("insert membership")?;
    }
    tx.commit().await?;
    Ok(())
}

/// `join` (a period of `user` in `conv` opens at the next seq) or `leave` (the open period
/// ends there).
async fn move_period(pool: &PgPool, conv: &str, user: &str, join: bool) -> anyhow::Result<()> {
    check_id("conversation", conv)?;
    check_id("user", user)?;
    need_user(pool, user).await?;
    let mut tx = pool.begin().await?;
    // Lock the conversation row as a send does: a period boundary and a seq never race (S1).
    let next: Option<i64> =
        sqlx::query_scalar("SELECT next_seq FROM conversations WHERE conv_id = $1 FOR UPDATE")
            .bind(conv)
            .fetch_optional(&mut *tx)
            .await?;
    let Some(next) = next else {
        bail!("unknown conversation {conv:?}");
    };
    let open: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM memberships WHERE conv_id = $1 AND user_id = $2 AND to_seq IS NULL)",
    )
    .bind(conv)
    .bind(user)
    .fetch_one(&mut *tx)
    .await?;
    match (join, open) {
        (true, true) => bail!("{user:?} is already a member of {conv:?}"),
        (false, false) => bail!("{user:?} is not a member of {conv:?}"),
        (true, false) => open_period(&mut tx, conv, user, next).await?,
        (false, true) => {
            sqlx::query(
                "UPDATE memberships SET to_seq = $3 WHERE conv_id = $1 AND user_id = $2 AND to_seq IS NULL",
            )
            .bind(conv)
            .bind(user)
            .bind(next)
            .execute(&mut *tx)
            .await?;
        }
    }
    tx.commit().await?;
    Ok(())
}

/// Opens a period of `user` in `conv` at seq `next`; one that would start where the last
/// one ended is merged back into it.
async fn open_period(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    conv: &str,
    user: &str,
    next: i64,
) -> anyhow::Result<()> {
    let reopened = sqlx::query(
        "UPDATE memberships SET to_seq = NULL
         WHERE conv_id = $1 AND user_id = $2 AND to_seq = $3",
    )
    .bind(conv)
    .bind(user)
    .bind(next)
    .execute(&mut **tx)
    .await?;
    if reopened.rows_affected() == 0 {
        sqlx::query("INSERT INTO memberships (conv_id, user_id, from_seq) VALUES ($1, $2, $3)")
            .bind(conv)
            .bind(user)
            .bind(next)
            .execute(&mut **tx)
            .await
            .context("insert membership")?;
    }
    Ok(())
}

/// A new install of `device`: its install epoch moves on and it gets a new token.
async fn reinstall(pool: &PgPool, device: &str) -> anyhow::Result<String> {
    check_id("device", device)?;
    let token = new_token()?;
    let r = sqlx::query(
        "UPDATE devices SET install_epoch = install_epoch + 1, token_sha256 = $2
         WHERE device_id = $1",
    )
    .bind(device)
    .bind(token_sha256(&token))
    .execute(pool)
    .await?;
    if r.rows_affected() == 0 {
        bail!("unknown device {device:?}");
    }
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An id is 1 to 64 characters of `A-Z a-z 0-9 . _ -` (the admin CLI refuses any
    /// other): each bound on its own, the empty id and one a character too long included.
    #[test]
    fn an_id_is_one_to_sixty_four_allowed_characters() {
        for ok in ["a", "A.z_0-9", &"a".repeat(64)] {
            assert!(check_id("user", ok).is_ok(), "{ok:?} refused");
        }
        for bad in ["", &"a".repeat(65), "a b", "a/b", "\u{e9}"] {
            assert!(check_id("user", bad).is_err(), "{bad:?} taken");
        }
    }
}
