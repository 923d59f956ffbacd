//! The process package: faults on a gateway process (kill, crash at a fault point, pause)
//! and on what it does at a fault point (a frame or a notification dropped, failed or
//! delayed), through its control socket (`IM_FAULT_CONTROL`). With several gateways
//! (`--gateways N`) each fault is drawn onto one of them: its target names which
//! ([`gateway_target`]).
//!
//! Must not: touch the database or the network.

use super::{Drawn, FaultCtx, Package, Targets};
use crate::gateway::frame_fault_leaves_the_sweep_alone;
use crate::nemesis::rng::Rng;
use crate::nemesis::targets::{gateway_index, gateway_target};
use im_protocol::FaultPoint;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Fault points a crash may be armed at (`gw-crash-point`): the send path.
pub const CRASH_POINTS: &[FaultPoint] = &[
    FaultPoint::SendBeforeInsert,
    FaultPoint::SendBeforeCommit,
    FaultPoint::SendBatchBeforeCommit,
    FaultPoint::SendBatchAfterCommit,
    FaultPoint::SendAfterCommitBeforeNotify,
    FaultPoint::ApiAfterSendCommit,
    FaultPoint::GwReplySend,
    FaultPoint::GwPush,
    FaultPoint::GwRecvAck,
];

/// Points a drop, delay or error may be armed at (`gw-fault`): the frames, the
/// notification after a commit (a drop there is a NOTIFY that never happens), and the
/// fan-out's own steps (issue 42: the NOTIFY with its local hand-off, a fan-out read, a
/// look of the commit feed), so that each repair path is exercised by a failure of the
/// step it repairs.
pub const FRAME_POINTS: &[FaultPoint] = &[
    FaultPoint::GwReplySend,
    FaultPoint::GwReplyAck,
    FaultPoint::GwPush,
    FaultPoint::GwRecvAck,
    FaultPoint::SendAfterCommitBeforeNotify,
    FaultPoint::SendBatchBeforeCommit,
    FaultPoint::SendBatchAfterCommit,
    FaultPoint::FanoutNotify,
    FaultPoint::FanoutRead,
    FaultPoint::FanoutFeed,
];

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum ProcessFault {
    /// SIGKILL the gateway at `at_ms`; it stays down until `end_ms`, then starts again.
    GwKill,
    /// Arm `point:halt:skip:1` at `at_ms` (control socket): the gateway exits 137 on the
    /// `skip + 1`-th hit and is restarted at once; disarmed at `end_ms` if it never fired.
    GwCrashPoint { point: FaultPoint, skip: u64 },
    /// SIGSTOP the gateway at `at_ms`, SIGCONT at `end_ms`.
    GwPause,
    /// Arm a frame fault (`drop`, `error` or `delay(MS)`) from `at_ms` to `end_ms`.
    GwFault { point: FaultPoint, action: String },
}

const KINDS: &[&str] = &["gw-kill", "gw-crash-point", "gw-pause", "gw-fault"];

/// Points a tail fault is armed at: the notification after a commit (a NOTIFY that never
/// happens: only the commit feed and the local handoff bring the message to connected
/// devices), the NOTIFY with its local hand-off (only the commit feed brings it), the
/// push (only the sweep brings it again) and a fan-out read (only the sweep's question
/// about a conversation whose read failed brings it: the workload falls quiet at the heal,
/// so no later notification reads it again).
pub const TAIL_POINTS: &[FaultPoint] = &[
    FaultPoint::SendAfterCommitBeforeNotify,
    FaultPoint::GwPush,
    FaultPoint::FanoutNotify,
    FaultPoint::FanoutRead,
];

/// The gateway a fault acts on, drawn after the kind's parameters and only with several
/// gateways: one gateway's schedules keep every draw they had.
fn on_a_gateway(kind: ProcessFault, r: &mut Rng, on: &Targets) -> Drawn<ProcessFault> {
    let i = if on.gateways > 1 {
        r.range(0, u64::from(on.gateways) - 1) as u32
    } else {
        0
    };
    Drawn {
        kind,
        target: gateway_target(i, on.gateways),
        instant: false,
    }
}

impl Package for ProcessFault {
    fn kinds() -> Vec<&'static str> {
        KINDS.to_vec()
    }

    fn draw(name: &str, r: &mut Rng, on: &Targets) -> Option<Drawn<Self>> {
        let kind = match name {
            "gw-kill" => ProcessFault::GwKill,
            "gw-crash-point" => ProcessFault::GwCrashPoint {
                point: *r.pick(CRASH_POINTS),
                skip: r.range(0, 20),
            },
            "gw-pause" => ProcessFault::GwPause,
            "gw-fault" => {
                let action = match r.range(0, 2) {
                    0 => "drop".to_string(),
                    1 => "error".to_string(),
                    _ => format!("delay({})", r.range(50, 1500)),
                };
                ProcessFault::GwFault {
                    point: *r.pick(FRAME_POINTS),
                    action,
                }
            }
            _ => return None,
        };
        Some(on_a_gateway(kind, r, on))
    }

    /// A crash just after a commit, before its notification, on one of its first hits; a
    /// notification, a push or a fan-out read dropped or failed. `gw-fault` is listed once
    /// per tail point, so that each way of losing a message is drawn as often as another.
    fn tail_kinds() -> Vec<&'static str> {
        let mut kinds = vec!["gw-crash-point"];
        kinds.extend(TAIL_POINTS.iter().map(|_| "gw-fault"));
        kinds
    }

    fn draw_tail(name: &str, r: &mut Rng, on: &Targets) -> Option<Drawn<Self>> {
        let kind = match name {
            "gw-crash-point" => ProcessFault::GwCrashPoint {
                point: FaultPoint::SendAfterCommitBeforeNotify,
                skip: r.range(0, 2),
            },
            "gw-fault" => ProcessFault::GwFault {
                point: *r.pick(TAIL_POINTS),
                action: r.pick(&["drop", "error"]).to_string(),
            },
            _ => return None,
        };
        Some(on_a_gateway(kind, r, on))
    }

    fn name(&self) -> &'static str {
        match self {
            ProcessFault::GwKill => "gw-kill",
            ProcessFault::GwCrashPoint { .. } => "gw-crash-point",
            ProcessFault::GwPause => "gw-pause",
            ProcessFault::GwFault { .. } => "gw-fault",
        }
    }

    /// Its gateway (the target), or one fault point of it.
    fn resource(&self, target: &str) -> Option<String> {
        match self {
            ProcessFault::GwFault { point, .. } => Some(format!("{target}/point:{point}")),
            _ => Some(target.into()),
        }
    }

    /// A fault acting on the gateway needs a gateway running, and one that was killed or
    /// crashed starts again only while the database answers (seed 62: a gw-pause while a
    /// pg-pause held the database after a gw-kill found no gateway); arming a frame fault
    /// also needs the gateway not held down.
    fn requires(&self, target: &str) -> Vec<String> {
        match self {
            ProcessFault::GwKill => Vec::new(),
            ProcessFault::GwPause | ProcessFault::GwCrashPoint { .. } => vec!["postgres".into()],
            ProcessFault::GwFault { .. } => vec![target.into(), "postgres".into()],
        }
    }

    fn check_target(&self, target: &str, on: &Targets) -> anyhow::Result<()> {
        let i = gateway_index(target)?;
        anyhow::ensure!(
            target == gateway_target(i as u32, on.gateways) && (i as u32) < on.gateways.max(1),
            "{} on {target:?}: the schedule has {} gateway(s), named {}",
            self.name(),
            on.gateways,
            (0..on.gateways.max(1))
                .map(|i| gateway_target(i, on.gateways))
                .collect::<Vec<_>>()
                .join(", ")
        );
        Ok(())
    }

    fn validate(&self) -> anyhow::Result<()> {
        match self {
            ProcessFault::GwCrashPoint { point, .. } | ProcessFault::GwFault { point, .. } => {
                anyhow::ensure!(
                    CRASH_POINTS.contains(point) || FRAME_POINTS.contains(point),
                    "point {point} is not one the nemesis arms"
                );
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn im_fault(&self) -> Option<String> {
        match self {
            ProcessFault::GwCrashPoint { point, skip } => Some(format!("{point}:halt:{skip}:1")),
            ProcessFault::GwFault { point, action } => Some(format!("{point}:{action}")),
            _ => None,
        }
    }

    fn leaves_the_sweep_alone(&self) -> bool {
        match self {
            ProcessFault::GwFault { point, action } => {
                frame_fault_leaves_the_sweep_alone(*point, action)
            }
            _ => false,
        }
    }
}

impl ProcessFault {
    pub async fn start(&self, cx: &mut FaultCtx<'_>, target: &str) -> anyhow::Result<Value> {
        use nix::sys::signal::Signal;
        let i = cx.gateway_index(target)?;
        match self {
            ProcessFault::GwKill => {
                cx.hold_down_gateway(i);
                Ok(json!({"killed": true}))
            }
            ProcessFault::GwCrashPoint { point, skip } => {
                let r = cx.control(i, &format!("arm {point}:halt:{skip}:1")).await?;
                Ok(json!({"control": r}))
            }
            ProcessFault::GwPause => {
                cx.ensure_gateway(i).await?;
                cx.signal_gateway(i, Signal::SIGSTOP)?;
                Ok(json!({"stopped": true}))
            }
            ProcessFault::GwFault { point, action } => {
                let r = cx.control(i, &format!("arm {point}:{action}")).await?;
                Ok(json!({"control": r}))
            }
        }
    }

    pub async fn end(&self, cx: &mut FaultCtx<'_>, target: &str) -> anyhow::Result<Value> {
        let i = cx.gateway_index(target)?;
        match self {
            ProcessFault::GwKill => Ok(json!({"restarted": cx.release_gateway(i).await})),
            ProcessFault::GwCrashPoint { point, .. } | ProcessFault::GwFault { point, .. } => {
                // The gateway may have exited (the halt fired) or been replaced: nothing armed.
                let r = cx.control_once(i, &format!("disarm {point}")).await;
                Ok(json!({"control": r.unwrap_or_else(|e| format!("{e:#}"))}))
            }
            ProcessFault::GwPause => {
                cx.signal_gateway(i, nix::sys::signal::Signal::SIGCONT)?;
                Ok(json!({"continued": true}))
            }
        }
    }
}
