//! The embedded migrations of `migrations/` (`sqlx::migrate!`, checked at build time) and
//! the schema check `serve` and `admin` run before they start. sqlx owns the
//! `_sqlx_migrations` bookkeeping table: each applied migration's version, description
//! and SHA-384 checksum. A migration edited after it was applied is refused, by `migrate`
//! and by the check, with a message naming it: migrations are append-only.

use std::collections::HashMap;

use anyhow::{bail, Context};
use sqlx::migrate::{MigrateError, Migrator};
use sqlx::PgPool;

/// `migrations/*.sql`, embedded at build time (`<version>_<description>.sql`). sqlx
/// applies each in its own transaction under an advisory lock, so two concurrent
/// `migrate` runs serialise.
pub static MIGRATOR: Migrator = sqlx::migrate!("../migrations");

/// Applies every missing migration. Idempotent. Returns the versions it applied.
pub async fn run(pool: &PgPool) -> anyhow::Result<Vec<i64>> {
    let before = applied(pool).await?;
    MIGRATOR.run(pool).await.map_err(|e| explain(&e))?;
    let after = applied(pool).await?;
    Ok(after
        .keys()
        .copied()
        .filter(|v| !before.contains_key(v))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect())
}

/// The migrations recorded as applied: version -> checksum (empty before the first
/// `migrate`).
async fn applied(pool: &PgPool) -> anyhow::Result<HashMap<i64, Vec<u8>>> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .fetch_one(pool)
        .await
        .context("read the schema version")?;
    if !exists {
        return Ok(HashMap::new());
    }
    let rows: Vec<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT version, checksum FROM _sqlx_migrations WHERE success")
            .fetch_all(pool)
            .await
            .context("read _sqlx_migrations")?;
    Ok(rows.into_iter().collect())
}

/// The file name of migration `version` (`0002_installs.sql`), for messages.
fn file_of(version: i64) -> String {
    MIGRATOR.iter().find(|m| m.version == version).map_or_else(
        || format!("version {version}"),
        |m| format!("{:04}_{}.sql", m.version, m.description.replace(' ', "_")),
    )
}

/// sqlx's migration errors, with the migration named and what to do.
fn explain(e: &MigrateError) -> anyhow::Error {
    match e {
        MigrateError::VersionMismatch(v) => anyhow::anyhow!(
            "migration {} was applied with another checksum: it was edited after it was \
             applied; migrations are append-only, add a new one instead",
            file_of(*v)
        ),
        MigrateError::VersionMissing(v) => anyhow::anyhow!(
            "the database has migration {v} applied, which this binary does not know: \
             it is newer than this binary"
        ),
        MigrateError::Dirty(v) => anyhow::anyhow!(
            "migration {} failed part way in an earlier run: repair the database by hand",
            file_of(*v)
        ),
        other => anyhow::anyhow!("apply migrations: {other}"),
    }
}

/// Refuses to serve on a schema that lacks an embedded migration or holds one whose
/// checksum differs from the embedded file's.
pub async fn check(pool: &PgPool) -> anyhow::Result<()> {
    let applied = applied(pool).await?;
    let mut missing = Vec::new();
    for m in MIGRATOR.iter() {
        match applied.get(&m.version) {
            None => missing.push(file_of(m.version)),
            Some(sum) if sum.as_slice() != &*m.checksum => {
                return Err(explain(&MigrateError::VersionMismatch(m.version)));
            }
            Some(_) => {}
        }
    }
    if !missing.is_empty() {
        bail!(
            "the database schema is not migrated (missing: {}): run `im-gateway migrate` first",
            missing.join(", ")
        );
    }
    Ok(())
}
