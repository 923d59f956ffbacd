//! Issue 20: a fault kind is one package plus one line of the registry.

use super::*;
use crate::nemesis::schedule::{draw_faults, validate_faults, Fault, Options};

/// A made-up package, as a new file beside `process.rs` would hold it: one kind,
/// `disk-full`, that fills the database's disk to `percent` for a while. It holds the
/// database as a crash does, and its start and end are its own.
mod made_up {
    use super::super::{Drawn, FaultCtx, Package, Targets};
    use crate::nemesis::rng::Rng;
    use serde::{Deserialize, Serialize};
    use serde_json::{json, Value};

    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(tag = "kind", rename_all = "kebab-case")]
    pub enum DiskFault {
        DiskFull { percent: u64 },
    }

    impl Package for DiskFault {
        fn kinds() -> Vec<&'static str> {
            vec!["disk-full"]
        }
        fn draw(name: &str, r: &mut Rng, _on: &Targets) -> Option<Drawn<Self>> {
            (name == "disk-full").then(|| Drawn {
                kind: DiskFault::DiskFull {
                    percent: r.range(90, 100),
                },
                target: "postgres".into(),
                instant: false,
            })
        }
        fn name(&self) -> &'static str {
            "disk-full"
        }
        fn resource(&self, _target: &str) -> Option<String> {
            Some("postgres".into())
        }
        fn requires(&self, _target: &str) -> Vec<String> {
            Vec::new()
        }
        fn validate(&self) -> anyhow::Result<()> {
            let DiskFault::DiskFull { percent } = self;
            anyhow::ensure!(*percent <= 100, "percent {percent} > 100");
            Ok(())
        }
        fn im_fault(&self) -> Option<String> {
            None
        }
        fn needs_lazyfs(&self) -> bool {
            true
        }
        fn leaves_the_sweep_alone(&self) -> bool {
            false
        }
    }

    impl DiskFault {
        pub async fn start(&self, _cx: &mut FaultCtx<'_>, _target: &str) -> anyhow::Result<Value> {
            Ok(json!({"filled": true}))
        }
        pub async fn end(&self, _cx: &mut FaultCtx<'_>, _target: &str) -> anyhow::Result<Value> {
            Ok(json!({"freed": true}))
        }
    }
}

/// The nemesis's registry plus the made-up package: the one line a new family adds. Its
/// `start` and `end` (made by the registry, calling the package's) are compiled but not
/// run here: they need a live world, and the runner runs the nemesis's own registry.
mod extended {
    #![allow(dead_code)]
    use super::super::{client, database, disk, failover, network, process};
    use super::made_up;

    registry! {
        pub enum Extended {
            Process(process::ProcessFault),
            Database(database::DatabaseFault),
            Network(network::NetworkFault),
            Client(client::ClientFault),
            Disk(disk::DiskFault),
            Failover(failover::FailoverFault),
            MadeUp(made_up::DiskFault),
        }
    }
}
use extended::Extended;

fn devices() -> Vec<String> {
    ["u1d1", "u1d2", "u2d1"].map(String::from).to_vec()
}

/// The test's devices and one gateway.
fn on(devices: &[String]) -> Targets<'_> {
    Targets {
        devices,
        gateways: 1,
    }
}

fn faults_json<K: Package>(seed: u64, opts: &Options) -> String {
    let f: Vec<Fault<K>> = draw_faults(&mut Rng::new(seed), opts, &on(&devices())).unwrap();
    serde_json::to_string(&f).unwrap()
}

#[test]
fn a_made_up_kind_is_one_package_and_one_registry_line() {
    // The registry knows the new kind after the others; the nemesis's does not.
    let mut expected = kinds();
    expected.push("disk-full");
    assert_eq!(<Extended as Package>::kinds(), expected);
    assert!(!kinds().contains(&"disk-full"));

    // The generator draws it, and the rules of its package hold: it holds the database,
    // so no crash, pause or power cut overlaps it, and nothing that needs the database
    // (a backend terminated, a gateway fault) starts during it.
    let opts = Options::default();
    let mut drawn = 0;
    for seed in 0..300 {
        let f: Vec<Fault<Extended>> =
            draw_faults(&mut Rng::new(seed), &opts, &on(&devices())).unwrap();
        validate_faults(&f, opts.duration_ms).unwrap();
        for d in f.iter().filter(|d| d.kind.name() == "disk-full") {
            drawn += 1;
            assert!(d.kind.needs_lazyfs());
            for o in f.iter().filter(|o| o.id != d.id) {
                let holds_db = o.kind.resource(&o.target).as_deref() == Some("postgres");
                let overlaps = o.at_ms < d.end_ms && d.at_ms < o.end_ms.max(o.at_ms + 1);
                assert!(!(holds_db && overlaps), "seed {seed}: {o:?} overlaps {d:?}");
                let needs_db = o.kind.requires(&o.target).iter().any(|r| r == "postgres");
                let starts_during = d.at_ms <= o.at_ms && o.at_ms < d.end_ms;
                assert!(
                    !(needs_db && starts_during),
                    "seed {seed}: {o:?} during {d:?}"
                );
            }
        }
    }
    assert!(drawn > 30, "disk-full drawn {drawn} times in 300 seeds");

    // It is written and read back flat, like every kind; its package refuses a bad one.
    let f = Fault {
        id: 3,
        at_ms: 10,
        end_ms: 20,
        target: "postgres".into(),
        kind: Extended::MadeUp(made_up::DiskFault::DiskFull { percent: 95 }),
    };
    let text = serde_json::to_string(&f).unwrap();
    assert_eq!(
        text,
        r#"{"id":3,"at_ms":10,"end_ms":20,"target":"postgres","kind":"disk-full","percent":95}"#
    );
    assert_eq!(serde_json::from_str::<Fault<Extended>>(&text).unwrap(), f);
    let bad = Fault {
        kind: Extended::MadeUp(made_up::DiskFault::DiskFull { percent: 101 }),
        ..f.clone()
    };
    let e = validate_faults(&[bad], 100).unwrap_err();
    assert!(format!("{e:#}").contains("percent 101"), "{e:#}");
    // The nemesis's registry refuses it by name.
    let e = serde_json::from_str::<Fault>(&text)
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown fault kind \"disk-full\""), "{e}");

    // Seeds drawing only the existing kinds keep their faults; drawing from all, some seed
    // draws another schedule: that is why a new kind needs a new GENERATOR_VERSION (the
    // pinned digest of `schedule.rs` fails until it has one).
    let old = Options {
        kinds: kinds().iter().map(|k| k.to_string()).collect(),
        ..Options::default()
    };
    let mut changed = 0;
    for seed in 1..=50 {
        assert_eq!(
            faults_json::<Extended>(seed, &old),
            faults_json::<FaultKind>(seed, &old),
            "seed {seed}"
        );
        changed += usize::from(
            faults_json::<Extended>(seed, &opts) != faults_json::<FaultKind>(seed, &opts),
        );
    }
    assert!(changed > 40, "{changed}");
}

/// Every kind's `name` is the `kind` it is written with, and reads back as itself.
#[test]
fn every_kind_is_written_under_its_name_and_reads_back() {
    let mut r = Rng::new(5);
    for name in kinds() {
        for _ in 0..20 {
            let d = FaultKind::draw(name, &mut r, &on(&devices())).unwrap();
            assert_eq!(d.kind.name(), name);
            d.kind.validate().unwrap();
            let v = serde_json::to_value(&d.kind).unwrap();
            assert_eq!(v["kind"], name, "{v}");
            assert_eq!(serde_json::from_value::<FaultKind>(v).unwrap(), d.kind);
            // What each package declares beyond its draw.
            assert_eq!(
                d.kind.needs_lazyfs(),
                name == "pg-power-cut" || name.starts_with("disk-"),
                "{name}"
            );
            let spec = d.kind.im_fault();
            match &d.kind {
                FaultKind::Process(process::ProcessFault::GwCrashPoint { point, skip }) => {
                    assert_eq!(spec, Some(format!("{point}:halt:{skip}:1")))
                }
                FaultKind::Process(process::ProcessFault::GwFault { point, action }) => {
                    assert_eq!(spec, Some(format!("{point}:{action}")))
                }
                _ => assert_eq!(spec, None, "{name}"),
            }
            assert_eq!(
                d.instant,
                d.kind.resource(&d.target).is_none(),
                "{name}: an instant holds nothing, a period holds something"
            );
        }
    }
    assert!(FaultKind::draw("gw-explode", &mut r, &on(&devices())).is_none());
    let e = serde_json::from_str::<FaultKind>(r#"{"kind":"gw-kill","extra":1}"#);
    assert!(e.is_ok(), "unit kinds ignore extra fields as before: {e:?}");
    let e = serde_json::from_str::<FaultKind>(r#"{"kind":"gw-crash-point"}"#).unwrap_err();
    assert!(e.to_string().contains("point"), "{e}");
    let e = serde_json::from_str::<FaultKind>(r#"{"target":"x"}"#).unwrap_err();
    assert!(e.to_string().contains("kind"), "{e}");
}

/// A crash switch counts each crash started (not a second `on`, not an `off`), so a crash
/// started and ended before its device looked is still carried out.
#[test]
fn a_crash_switch_counts_the_crashes_started() {
    let mut s = CrashSwitch::default();
    for on in [true, true, false, false, true, false] {
        s.set(on);
    }
    assert_eq!(
        s,
        CrashSwitch {
            crashed: false,
            crashes: 2
        }
    );
}
