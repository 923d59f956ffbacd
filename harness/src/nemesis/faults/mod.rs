//! The nemesis's fault packages (issue 20), in the manner of Jepsen's nemesis packages:
//! one file per family ([`process`], [`database`], [`network`], [`client`], [`disk`],
//! [`failover`]), each declaring
//! its kinds, how the generator draws them, what each holds and needs, how to start and end
//! it, and what the checker must know about it (the [`Package`] trait and the `start`/`end`
//! methods the registry calls).
//!
//! The registry is [`FaultKind`], made by [`registry!`] from the packages in draw order.
//! Adding a kind touches its package alone (a variant, its draw, its arms); adding a family
//! touches a new file and one line of the registry. Either changes what existing seeds
//! draw, so it comes with a new `GENERATOR_VERSION` (the pinned schedule digest fails
//! until then). The test `a_made_up_kind_is_one_package_and_one_registry_line` adds a kind
//! that way.
//!
//! Must not: look at the clock, the environment or anything but the seed in `draw`; judge
//! anything.

mod ctx;
pub use ctx::FaultCtx;
pub mod client;
pub mod database;
pub mod disk;
pub mod failover;
pub mod network;
pub mod process;

use super::rng::Rng;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::collections::BTreeMap;
use tokio::sync::watch;

/// What a package declares about each of its kinds. The registry implements it too, by
/// asking the package a kind belongs to.
pub trait Package:
    Sized + Clone + std::fmt::Debug + PartialEq + Serialize + DeserializeOwned
{
    /// The kinds' names, as `--kinds` and `schedule.json` spell them, in draw order.
    fn kinds() -> Vec<&'static str>;
    /// The parameters of one fault of kind `name` and what it acts on (among `on`), drawn
    /// from `r`; `None` (and nothing drawn) when `name` is not one of [`Package::kinds`].
    fn draw(name: &str, r: &mut Rng, on: &Targets) -> Option<Drawn<Self>>;
    /// The kinds a schedule's tail fault may be (the last fault of every schedule, from
    /// the last 15% of the traffic to its end, `draw_faults`): those that silently lose
    /// something only a repair path brings back, since no later message will reveal it.
    /// A kind listed twice is drawn twice as often. None by default.
    fn tail_kinds() -> Vec<&'static str> {
        Vec::new()
    }
    /// A tail fault of kind `name` (one of [`Package::tail_kinds`]), its parameters drawn
    /// among those that lose something: by default as [`Package::draw`] draws them.
    fn draw_tail(name: &str, r: &mut Rng, on: &Targets) -> Option<Drawn<Self>> {
        Self::draw(name, r, on)
    }
    /// Its name in [`Package::kinds`].
    fn name(&self) -> &'static str;
    /// Faults that may not overlap share a resource (the gateway process, the database
    /// process, one proxy, one fault point, one device); an instant takes none.
    fn resource(&self, target: &str) -> Option<String>;
    /// Resources that must be free when it starts on `target`, though it does not hold
    /// them.
    fn requires(&self, target: &str) -> Vec<String>;
    /// A schedule read from a file is refused when one of its faults is not well formed
    /// (by default every drawn value is).
    fn validate(&self) -> anyhow::Result<()> {
        Ok(())
    }
    /// A schedule read from a file is refused when a fault's target is not one of `on`
    /// (by default any target is).
    fn check_target(&self, _target: &str, _on: &Targets) -> anyhow::Result<()> {
        Ok(())
    }
    /// The equivalent `IM_FAULT` spec when it is one fault point (`make repro FAULT=…`);
    /// none by default.
    fn im_fault(&self) -> Option<String> {
        None
    }
    /// Whether its cluster must run on the LazyFS layer (not by default).
    fn needs_lazyfs(&self) -> bool {
        false
    }
    /// Whether its cluster needs a streaming standby: `Some(synchronous)` (none by default).
    fn needs_standby(&self) -> Option<bool> {
        None
    }
    /// Whether its database must be a pg_auto_failover formation (`crate::autofailover`)
    /// rather than a cluster the harness runs (not by default).
    fn needs_formation(&self) -> bool {
        false
    }
    /// Whether it acts on a cluster the harness runs itself (crashes, pauses or cuts the
    /// power of its postmaster, needs its LazyFS layer or its standby): such a fault and
    /// one that needs a formation share no schedule. True for every kind that needs the
    /// LazyFS layer or a standby; false otherwise by default.
    fn needs_own_cluster(&self) -> bool {
        self.needs_lazyfs() || self.needs_standby().is_some()
    }
    /// Whether it ends the primary's lineage (a failover): at most one such fault per
    /// schedule, and none that needs the LazyFS layer starts after it (not by default).
    fn ends_the_primary(&self) -> bool {
        false
    }
    /// For the checker's `d5-sweep-late`: true when the fault cannot delay the sweep's
    /// pass, so a late hint during it is still the sweep's fault.
    fn leaves_the_sweep_alone(&self) -> bool;
}

/// What a schedule's faults may act on besides the database and the network paths: its
/// devices and its gateways (1: the target is `gateway`; 2 or 3: `gateway-0`, `gateway-1`…,
/// all behind one balancer).
#[derive(Debug, Clone, Copy)]
pub struct Targets<'a> {
    pub devices: &'a [String],
    pub gateways: u32,
}

/// One drawn fault: its kind, what it acts on, and whether it is an instant.
#[derive(Debug, Clone, PartialEq)]
pub struct Drawn<K> {
    pub kind: K,
    pub target: String,
    pub instant: bool,
}

impl<K> Drawn<K> {
    pub fn map<L>(self, f: impl FnOnce(K) -> L) -> Drawn<L> {
        Drawn {
            kind: f(self.kind),
            target: self.target,
            instant: self.instant,
        }
    }
}

/// A device's crash switch: `crashed` kills its client until set back to false;
/// `crashes` counts the crashes started, so that a crash started and ended before the
/// device looked still happens (a `watch` keeps only the last value: nemesis seed 2 on three
/// gateways at 85cb913 recorded a client crash whose start and end came 78 µs apart, late
/// behind a failover; the device saw only `false`, its turn was dropped mid-sync and it
/// never crashed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CrashSwitch {
    pub crashed: bool,
    pub crashes: u64,
}

impl CrashSwitch {
    /// Turned on (a crash starts, counted) or off.
    pub fn set(&mut self, crashed: bool) {
        if crashed && !self.crashed {
            self.crashes += 1;
        }
        self.crashed = crashed;
    }
}

/// Device id → its crash switch.
pub type CrashSwitches = BTreeMap<String, watch::Sender<CrashSwitch>>;

/// Makes a registry: an enum with one variant per package, in draw order, implementing
/// [`Package`] (by asking the package a kind belongs to), `serde` (flat: `{"kind": "gw-kill",
/// …}`; an unknown kind is refused by name), and `start`/`end` (each package's own).
macro_rules! registry {
    ($(#[$meta:meta])* $vis:vis enum $name:ident { $($(#[$vmeta:meta])* $var:ident($pkg:ty)),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq)]
        $vis enum $name {
            $($(#[$vmeta])* $var($pkg)),+
        }

        impl $crate::nemesis::faults::Package for $name {
            fn kinds() -> Vec<&'static str> {
                let mut all = Vec::new();
                $(all.extend(<$pkg as $crate::nemesis::faults::Package>::kinds());)+
                all
            }
            fn draw(
                name: &str,
                r: &mut $crate::nemesis::rng::Rng,
                on: &$crate::nemesis::faults::Targets,
            ) -> Option<$crate::nemesis::faults::Drawn<Self>> {
                $(if let Some(d) = <$pkg as $crate::nemesis::faults::Package>::draw(name, r, on) {
                    return Some(d.map($name::$var));
                })+
                None
            }
            fn tail_kinds() -> Vec<&'static str> {
                let mut all = Vec::new();
                $(all.extend(<$pkg as $crate::nemesis::faults::Package>::tail_kinds());)+
                all
            }
            fn draw_tail(
                name: &str,
                r: &mut $crate::nemesis::rng::Rng,
                on: &$crate::nemesis::faults::Targets,
            ) -> Option<$crate::nemesis::faults::Drawn<Self>> {
                $(if <$pkg as $crate::nemesis::faults::Package>::kinds().contains(&name) {
                    return <$pkg as $crate::nemesis::faults::Package>::draw_tail(name, r, on)
                        .map(|d| d.map($name::$var));
                })+
                None
            }
            fn name(&self) -> &'static str {
                match self { $($name::$var(k) => k.name()),+ }
            }
            fn resource(&self, target: &str) -> Option<String> {
                match self { $($name::$var(k) => k.resource(target)),+ }
            }
            fn requires(&self, target: &str) -> Vec<String> {
                match self { $($name::$var(k) => k.requires(target)),+ }
            }
            fn validate(&self) -> anyhow::Result<()> {
                match self { $($name::$var(k) => k.validate()),+ }
            }
            fn check_target(
                &self,
                target: &str,
                on: &$crate::nemesis::faults::Targets,
            ) -> anyhow::Result<()> {
                match self { $($name::$var(k) => k.check_target(target, on)),+ }
            }
            fn im_fault(&self) -> Option<String> {
                match self { $($name::$var(k) => k.im_fault()),+ }
            }
            fn needs_lazyfs(&self) -> bool {
                match self { $($name::$var(k) => k.needs_lazyfs()),+ }
            }
            fn needs_standby(&self) -> Option<bool> {
                match self { $($name::$var(k) => k.needs_standby()),+ }
            }
            fn needs_formation(&self) -> bool {
                match self { $($name::$var(k) => k.needs_formation()),+ }
            }
            fn needs_own_cluster(&self) -> bool {
                match self { $($name::$var(k) => k.needs_own_cluster()),+ }
            }
            fn ends_the_primary(&self) -> bool {
                match self { $($name::$var(k) => k.ends_the_primary()),+ }
            }
            fn leaves_the_sweep_alone(&self) -> bool {
                match self { $($name::$var(k) => k.leaves_the_sweep_alone()),+ }
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                match self { $($name::$var(k) => k.serialize(s)),+ }
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                use serde::de::Error;
                use $crate::nemesis::faults::Package;
                let map = serde_json::Map::<String, serde_json::Value>::deserialize(d)?;
                let kind = map
                    .get("kind")
                    .and_then(|k| k.as_str())
                    .ok_or_else(|| D::Error::custom("a fault without a string \"kind\""))?
                    .to_string();
                $(if <$pkg as Package>::kinds().contains(&kind.as_str()) {
                    return serde_json::from_value::<$pkg>(serde_json::Value::Object(map))
                        .map($name::$var)
                        .map_err(D::Error::custom);
                })+
                Err(D::Error::custom(format!(
                    "unknown fault kind {kind:?}; kinds: {}",
                    <Self as Package>::kinds().join(", ")
                )))
            }
        }

        impl $name {
            /// Starts the fault (its package's `start`): what happened, for the fault log;
            /// Err when it could not start (the run is then an ERROR).
            pub async fn start(
                &self,
                cx: &mut $crate::nemesis::faults::FaultCtx<'_>,
                target: &str,
            ) -> anyhow::Result<serde_json::Value> {
                match self { $($name::$var(k) => k.start(cx, target).await),+ }
            }

            /// Ends the fault (its package's `end`); an instant's end does nothing.
            pub async fn end(
                &self,
                cx: &mut $crate::nemesis::faults::FaultCtx<'_>,
                target: &str,
            ) -> anyhow::Result<serde_json::Value> {
                match self { $($name::$var(k) => k.end(cx, target).await),+ }
            }
        }
    };
}

registry! {
    /// Every fault kind the nemesis knows: the packages, in draw order (this order and each
    /// package's order of kinds are the generator's: see `GENERATOR_VERSION`).
    pub enum FaultKind {
        Process(process::ProcessFault),
        Database(database::DatabaseFault),
        Network(network::NetworkFault),
        Client(client::ClientFault),
        Disk(disk::DiskFault),
        Failover(failover::FailoverFault),
    }
}

/// Every fault kind's name, in draw order.
pub fn kinds() -> Vec<&'static str> {
    <FaultKind as Package>::kinds()
}

#[cfg(test)]
mod tests;
