//! The redelivery sweep (D5): every `IM_SWEEP_MS`, and at once when fan-out asks (after the
//! LISTEN connection was regained), hint every subscribed connection about each
//! conversation where its device's cursor is below the head. Read-only: it never writes
//! cursors (only acks do, D3).

use crate::bugs;
use crate::protocol::HintWhy;
use crate::state::State;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// D5: a lost push is found here within one interval; the hint makes the client sync and
/// ack, after which the cursor equals the head and the hints stop.
pub async fn run(state: Arc<State>) {
    if bugs::active(bugs::NO_SWEEP) {
        return;
    }
    let every = if bugs::active(bugs::SLOW_SWEEP) {
        state.cfg.sweep_interval_ms * 3
    } else {
        state.cfg.sweep_interval_ms
    };
    let mut tick = tokio::time::interval(Duration::from_millis(every));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = state.cancel.cancelled() => return,
            _ = tick.tick() => {},
            _ = state.sweep_now.notified() => {},
        }
        match once(&state).await {
            Ok(n) => {
                if failing {
                    tracing::info!("sweep works again");
                    failing = false;
                }
                if n > 0 {
                    tracing::debug!(hints = n, "sweep sent hints");
                }
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, "sweep failed; retrying every interval");
                    failing = true;
                }
            }
        }
    }
}

/// One sweep: one query for all subscribed connections, for current installs only (read in
/// that query). Connections of installs that are no longer current are closed first (a
/// reinstall notification lost with the LISTEN connection). Returns the hints queued.
pub async fn once(state: &State) -> anyhow::Result<usize> {
    let conns = state.hub.all();
    if conns.is_empty() {
        return Ok(0);
    }
    let mut by_install: HashMap<(&str, i64), Vec<&crate::hub::ConnHandle>> = HashMap::new();
    for c in &conns {
        by_install
            .entry((c.who.device.as_str(), c.who.epoch))
            .or_default()
            .push(c);
    }
    let mut devices = Vec::with_capacity(by_install.len());
    let mut users = Vec::with_capacity(by_install.len());
    let mut epochs = Vec::with_capacity(by_install.len());
    for cs in by_install.values() {
        devices.push(cs[0].who.device.clone());
        users.push(cs[0].who.user.clone());
        epochs.push(cs[0].who.epoch);
    }
    // Read-only, so dropping them at the deadline is harmless.
    let stale = tokio::time::timeout(
        state.cfg.db_timeout(),
        crate::store::stale_installs(&state.pool, &devices, &epochs),
    )
    .await
    .map_err(|_| anyhow::anyhow!("stale-install query exceeded IM_DB_TIMEOUT_MS"))??;
    for (device, current) in stale {
        state.hub.revoke_stale(&device, current);
    }
    let rows = tokio::time::timeout(
        state.cfg.db_timeout(),
        crate::store::lagging(&state.pool, &devices, &users, &epochs),
    )
    .await
    .map_err(|_| anyhow::anyhow!("sweep query exceeded IM_DB_TIMEOUT_MS"))??;
    let mut n = 0;
    for (device, epoch, conv, head) in rows {
        for c in by_install
            .get(&(device.as_str(), epoch))
            .into_iter()
            .flatten()
        {
            c.hint(&conv, head, HintWhy::Sweep);
            n += 1;
        }
    }
    Ok(n)
}
