//! How a schedule names its gateways (`gateway`, or `gateway-0`, `gateway-1`…): the one
//! naming the fault packages draw and the supervisor reads, a leaf both depend on.

use anyhow::Context as _;

/// The target naming gateway `i` of `gateways`: `gateway` when there is one (the schedules
/// of one gateway are those of generator 2, byte for byte), `gateway-I` when there are more.
pub fn gateway_target(i: u32, gateways: u32) -> String {
    if gateways <= 1 {
        "gateway".into()
    } else {
        format!("gateway-{i}")
    }
}

/// The gateway a target names ([`gateway_target`]): `gateway` is gateway 0.
pub fn gateway_index(target: &str) -> anyhow::Result<usize> {
    if target == "gateway" {
        return Ok(0);
    }
    target
        .strip_prefix("gateway-")
        .and_then(|i| i.parse().ok())
        .with_context(|| format!("{target:?} names no gateway (gateway, gateway-0, gateway-1, …)"))
}
