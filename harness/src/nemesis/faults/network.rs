//! The network package: conditions on the two paths the harness's proxies carry
//! (gateway↔PostgreSQL and clients↔gateway): latency, a blackhole, a bandwidth limit, and
//! resets of every connection.
//!
//! Must not: touch a process.

use super::{Drawn, FaultCtx, Package, Targets};
use crate::nemesis::rng::Rng;
use crate::proxy::Condition;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum NetworkFault {
    /// The gateway↔PostgreSQL path under `condition` from `at_ms` to `end_ms`.
    NetDb { condition: Condition },
    /// The clients↔gateway path under `condition` from `at_ms` to `end_ms`.
    NetClient { condition: Condition },
    /// Every gateway↔PostgreSQL connection reset (instant).
    NetDbReset,
    /// Every client↔gateway connection reset (instant).
    NetClientReset,
}

const KINDS: &[&str] = &["net-db", "net-client", "net-db-reset", "net-client-reset"];

/// The path a kind acts on, as the schedule's `target` names it.
const DB_PATH: &str = "gateway->postgres";
const CLIENT_PATH: &str = "clients->gateway";

fn condition(r: &mut Rng) -> Condition {
    match r.range(0, 2) {
        0 => Condition::Latency {
            ms: r.range(20, 400),
        },
        1 => Condition::Blackhole,
        _ => Condition::Bandwidth {
            bytes_per_s: r.range(2_000, 50_000),
        },
    }
}

impl Package for NetworkFault {
    fn kinds() -> Vec<&'static str> {
        KINDS.to_vec()
    }

    fn draw(name: &str, r: &mut Rng, _on: &Targets) -> Option<Drawn<Self>> {
        let (kind, target, instant) = match name {
            "net-db" => (
                NetworkFault::NetDb {
                    condition: condition(r),
                },
                DB_PATH,
                false,
            ),
            "net-client" => (
                NetworkFault::NetClient {
                    condition: condition(r),
                },
                CLIENT_PATH,
                false,
            ),
            "net-db-reset" => (NetworkFault::NetDbReset, DB_PATH, true),
            "net-client-reset" => (NetworkFault::NetClientReset, CLIENT_PATH, true),
            _ => return None,
        };
        Some(Drawn {
            kind,
            target: target.into(),
            instant,
        })
    }

    fn name(&self) -> &'static str {
        match self {
            NetworkFault::NetDb { .. } => "net-db",
            NetworkFault::NetClient { .. } => "net-client",
            NetworkFault::NetDbReset => "net-db-reset",
            NetworkFault::NetClientReset => "net-client-reset",
        }
    }

    fn resource(&self, _target: &str) -> Option<String> {
        match self {
            NetworkFault::NetDb { .. } => Some("net-db".into()),
            NetworkFault::NetClient { .. } => Some("net-client".into()),
            NetworkFault::NetDbReset | NetworkFault::NetClientReset => None,
        }
    }

    fn requires(&self, _target: &str) -> Vec<String> {
        Vec::new()
    }

    fn leaves_the_sweep_alone(&self) -> bool {
        false
    }
}

impl NetworkFault {
    pub async fn start(&self, cx: &mut FaultCtx<'_>, _target: &str) -> anyhow::Result<Value> {
        match self {
            NetworkFault::NetDb { condition } => {
                cx.db_proxy()?.set_condition(*condition);
                Ok(json!({"condition": condition}))
            }
            NetworkFault::NetClient { condition } => {
                cx.set_client_condition(*condition);
                Ok(json!({"condition": condition}))
            }
            NetworkFault::NetDbReset => {
                cx.db_proxy()?.cut();
                Ok(json!({"reset": true}))
            }
            NetworkFault::NetClientReset => {
                cx.cut_clients();
                Ok(json!({"reset": true}))
            }
        }
    }

    pub async fn end(&self, cx: &mut FaultCtx<'_>, _target: &str) -> anyhow::Result<Value> {
        match self {
            NetworkFault::NetDb { .. } => {
                cx.db_proxy()?.set_condition(Condition::Pass);
                Ok(json!({"condition": Condition::Pass}))
            }
            NetworkFault::NetClient { .. } => {
                cx.set_client_condition(Condition::Pass);
                Ok(json!({"condition": Condition::Pass}))
            }
            NetworkFault::NetDbReset | NetworkFault::NetClientReset => Ok(Value::Null),
        }
    }
}
