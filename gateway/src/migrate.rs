//! The embedded migrations of `migrations/` and the schema check `serve` runs before it
//! starts. Owns the `schema_migrations` bookkeeping table; nothing else.

use anyhow::{bail, Context};
use sqlx::PgPool;

/// `(version, name, sql)`, in order. Files are embedded at build time.
pub const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "0001_init",
        include_str!("../../migrations/0001_init.sql"),
    ),
    (
        2,
        "0002_installs",
        include_str!("../../migrations/0002_installs.sql"),
    ),
];

/// Arbitrary constant for `pg_advisory_xact_lock`: two concurrent `migrate` runs serialise.
const MIGRATE_LOCK_KEY: i64 = 0x1f_a017;

/// Applies every missing migration, each in its own transaction. Idempotent.
/// Returns the versions it applied.
pub async fn run(pool: &PgPool) -> anyhow::Result<Vec<i32>> {
    let mut applied = Vec::new();
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS schema_migrations (
             version integer PRIMARY KEY,
             name text NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(pool)
    .await
    .context("create schema_migrations")?;
    for (version, name, sql) in MIGRATIONS {
        let mut tx = pool.begin().await.context("begin migration")?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(MIGRATE_LOCK_KEY)
            .execute(&mut *tx)
            .await
            .context("take the migration lock")?;
        let done: Option<i32> =
            sqlx::query_scalar("SELECT version FROM schema_migrations WHERE version = $1")
                .bind(version)
                .fetch_optional(&mut *tx)
                .await
                .context("read schema_migrations")?;
        if done.is_some() {
            continue;
        }
        sqlx::raw_sql(sql)
            .execute(&mut *tx)
            .await
            .with_context(|| format!("apply migration {name}"))?;
        sqlx::query("INSERT INTO schema_migrations (version, name) VALUES ($1, $2)")
            .bind(version)
            .bind(name)
            .execute(&mut *tx)
            .await
            .context("record migration")?;
        tx.commit()
            .await
            .with_context(|| format!("commit migration {name}"))?;
        applied.push(*version);
    }
    Ok(applied)
}

/// Refuses to serve on a schema that lacks any embedded migration.
pub async fn check(pool: &PgPool) -> anyhow::Result<()> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('schema_migrations') IS NOT NULL")
        .fetch_one(pool)
        .await
        .context("read the schema version")?;
    let versions: Vec<i32> = if exists {
        sqlx::query_scalar("SELECT version FROM schema_migrations ORDER BY version")
            .fetch_all(pool)
            .await
            .context("read schema_migrations")?
    } else {
        Vec::new()
    };
    let missing: Vec<&str> = MIGRATIONS
        .iter()
        .filter(|(v, _, _)| !versions.contains(v))
        .map(|(_, n, _)| *n)
        .collect();
    if !missing.is_empty() {
        bail!(
            "the database schema is not migrated (missing: {}): run `im-gateway migrate` first",
            missing.join(", ")
        );
    }
    Ok(())
}
