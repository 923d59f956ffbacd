//! The nemesis (issue 10): seeded random fault schedules over a live workload, on the real
//! gateway binary and a throwaway cluster; exact replay of a recorded schedule; shrinking
//! of a failing one; a timeline report per run.
//!
//! - [`schedule`] holds the schedule as data, generated only from the seed and the options;
//! - [`faults`] holds the fault packages (process, database, network, client) and their
//!   registry: each kind's draw, resources, start and end, and what the checker must know;
//! - [`rng`] is the random source the generator and the packages draw from;
//! - [`supervisor`] keeps the gateway running (and down while a `gw-kill` holds it);
//! - [`runner`] carries out one schedule and has the checker judge it;
//! - [`outcome`] is what a run observed (`result.json`);
//! - [`shrink`] reduces a failing schedule to a 1-minimal one (`minimal.json`);
//! - [`report`] writes `report.html`.
//!
//! `scenarios/src/bin/nemesis.rs` (`make nemesis`) is the command line over these.

pub mod faults;
pub mod outcome;
pub mod report;
pub mod rng;
pub mod runner;
pub mod schedule;
pub mod shrink;
pub mod supervisor;
pub mod targets;

pub use outcome::Outcome;
pub use runner::run;
pub use schedule::{generate, Options, Schedule};
