//! Provisioning with bulk SQL: users, devices (with the token digest the gateway checks),
//! conversations and open membership periods, exactly the rows `im-gateway admin` would
//! write (`from_seq = 1`, `install_epoch = 1`), many per statement.

use anyhow::Context;
use sqlx::PgPool;

#[derive(Clone, Debug)]
pub struct Device {
    pub id: String,
    pub user: String,
    pub token: String,
}

impl Device {
    pub fn new(id: String, user: &str) -> Device {
        let token = format!("tok-{id}");
        Device {
            id,
            user: user.to_string(),
            token,
        }
    }
}

/// Creates `users`, then `devices`, then the conversations with their members.
pub async fn world(
    pool: &PgPool,
    users: &[String],
    devices: &[Device],
    convs: &[(String, Vec<String>)],
) -> anyhow::Result<()> {
    sqlx::query("INSERT INTO users (user_id) SELECT unnest($1::text[])")
        .bind(users)
        .execute(pool)
        .await
        .context("insert users")?;
    let ids: Vec<&str> = devices.iter().map(|d| d.id.as_str()).collect();
    let owners: Vec<&str> = devices.iter().map(|d| d.user.as_str()).collect();
    let digests: Vec<String> = devices
        .iter()
        .map(|d| im_gateway::store::token_sha256(&d.token))
        .collect();
    sqlx::query(
        "INSERT INTO devices (device_id, user_id, install_epoch, token_sha256)
         SELECT d.id, d.u, 1, d.h FROM unnest($1::text[], $2::text[], $3::text[]) AS d(id, u, h)",
    )
    .bind(&ids)
    .bind(&owners)
    .bind(&digests)
    .execute(pool)
    .await
    .context("insert devices")?;
    let conv_ids: Vec<&str> = convs.iter().map(|c| c.0.as_str()).collect();
    sqlx::query("INSERT INTO conversations (conv_id) SELECT unnest($1::text[])")
        .bind(&conv_ids)
        .execute(pool)
        .await
        .context("insert conversations")?;
    let (mut mc, mut mu) = (Vec::new(), Vec::new());
    for (c, members) in convs {
        for u in members {
            mc.push(c.as_str());
            mu.push(u.as_str());
        }
    }
    sqlx::query(
        "INSERT INTO memberships (conv_id, user_id, from_seq)
         SELECT c, u, 1 FROM unnest($1::text[], $2::text[]) AS m(c, u)",
    )
    .bind(&mc)
    .bind(&mu)
    .execute(pool)
    .await
    .context("insert memberships")?;
    Ok(())
}

/// How many of the acknowledged `(sender_user, cmid)` pairs are rows in `events`.
pub async fn count_present(pool: &PgPool, acked: &[(String, String)]) -> anyhow::Result<u64> {
    let mut found = 0u64;
    for chunk in acked.chunks(50_000) {
        let users: Vec<&str> = chunk.iter().map(|a| a.0.as_str()).collect();
        let cmids: Vec<&str> = chunk.iter().map(|a| a.1.as_str()).collect();
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM events e
             JOIN unnest($1::text[], $2::text[]) AS a(u, c) ON e.sender_user = a.u AND e.cmid = a.c",
        )
        .bind(&users)
        .bind(&cmids)
        .fetch_one(pool)
        .await
        .context("count acknowledged events")?;
        found += n.max(0) as u64;
    }
    Ok(found)
}

/// P1 over the conversations with this id prefix: every head equals the row count and the
/// highest seq (no gap, no extra row).
pub async fn gapless(pool: &PgPool, prefix: &str) -> anyhow::Result<bool> {
    let bad: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM conversations c
         LEFT JOIN (SELECT conv_id, count(*) AS n, max(seq) AS m FROM events GROUP BY conv_id) e
           ON e.conv_id = c.conv_id
         WHERE c.conv_id LIKE $1 || '%'
           AND (COALESCE(e.n, 0) <> c.next_seq - 1 OR COALESCE(e.m, 0) <> c.next_seq - 1)",
    )
    .bind(prefix)
    .fetch_one(pool)
    .await
    .context("check gapless seqs")?;
    Ok(bad == 0)
}
