//! The client package: a device's client killed without flushing (its state file is what
//! it last wrote) and loaded again from that file.
//!
//! Must not: touch the gateway, the database or the network.

use super::{Drawn, FaultCtx, Package, Targets};
use crate::nemesis::rng::Rng;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum ClientFault {
    /// The device's client killed without flushing at `at_ms` (its state file is what it
    /// last wrote), loaded again from its state file at `end_ms`.
    ClientCrash,
}

impl Package for ClientFault {
    fn kinds() -> Vec<&'static str> {
        vec!["client-crash"]
    }

    fn draw(name: &str, r: &mut Rng, on: &Targets) -> Option<Drawn<Self>> {
        (name == "client-crash").then(|| Drawn {
            kind: ClientFault::ClientCrash,
            target: r.pick(on.devices).clone(),
            instant: false,
        })
    }

    fn name(&self) -> &'static str {
        "client-crash"
    }

    fn resource(&self, target: &str) -> Option<String> {
        Some(format!("device:{target}"))
    }

    fn requires(&self, _target: &str) -> Vec<String> {
        Vec::new()
    }

    fn check_target(&self, target: &str, on: &Targets) -> anyhow::Result<()> {
        anyhow::ensure!(
            on.devices.iter().any(|d| d == target),
            "client-crash on {target:?}: no device of the workload"
        );
        Ok(())
    }

    /// A crashed client neither slows the sweep nor its other devices.
    fn leaves_the_sweep_alone(&self) -> bool {
        true
    }
}

impl ClientFault {
    pub async fn start(&self, cx: &mut FaultCtx<'_>, target: &str) -> anyhow::Result<Value> {
        cx.switch_device(target, true)?;
        Ok(json!({"crashed": target}))
    }

    pub async fn end(&self, cx: &mut FaultCtx<'_>, target: &str) -> anyhow::Result<Value> {
        cx.switch_device(target, false)?;
        Ok(json!({"restarted": target}))
    }
}
