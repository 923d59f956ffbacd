//! Shrinking a failing schedule (issue 10): remove faults (halves, then quarters, down to
//! single faults, as delta debugging does), then membership changes, then shorten the
//! workload, re-running each candidate `reps` times (timing matters: a candidate keeps
//! failing if any of its runs shows an anomaly of a kind the original showed), until no
//! single fault can be removed without the anomaly disappearing (1-minimal).
//!
//! A schedule is called 1-minimal only when a run of it reproduced the anomaly: when no
//! candidate failed, the original is run again, and if that passes too the shrinker says
//! so ([`Finding::NotReproduced`]) instead of calling the untouched schedule minimal.
//!
//! The runs are the caller's ([`shrink`] takes a closure), so the search is tested here on
//! a model without processes.

use super::faults::Package as _;
use super::schedule::Schedule;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::future::Future;

/// How hard to try.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ShrinkOpts {
    /// Runs per candidate; the candidate fails if any run fails.
    pub reps: u32,
    /// Runs in all, at most.
    pub max_runs: u32,
}

impl Default for ShrinkOpts {
    fn default() -> Self {
        ShrinkOpts {
            reps: 2,
            max_runs: 40,
        }
    }
}

/// What the search could say of its result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Finding {
    /// A run of `minimal` reproduced the anomaly, and removing any single fault of it made
    /// the anomaly disappear in every run tried.
    OneMinimal,
    /// The run budget ended before every single fault was tried for removal.
    BudgetSpent,
    /// No run reproduced the anomaly, the original schedule's included: `minimal` is the
    /// original, untouched, and nothing is known about which of its faults matter.
    NotReproduced,
}

impl Finding {
    /// As printed after the shrink.
    pub fn describe(self) -> &'static str {
        match self {
            Finding::OneMinimal => "1-minimal",
            Finding::BudgetSpent => "run budget spent before every fault was tried",
            Finding::NotReproduced => {
                "not reproduced: no run failed again, the original's included"
            }
        }
    }
}

/// What the shrinker found.
#[derive(Debug, Clone, Serialize)]
pub struct Shrunk {
    /// The smallest schedule that still failed.
    pub minimal: Schedule,
    /// `finding == OneMinimal`: a run of `minimal` failed, and every single fault of it
    /// was tried for removal.
    pub one_minimal: bool,
    pub finding: Finding,
    pub runs: u32,
    /// Each candidate: its faults, duration, runs and whether it still failed.
    pub attempts: Vec<Value>,
    /// `make repro FAULT=…` when the minimal schedule is one fault point.
    pub repro: Option<String>,
}

/// Shrinks `original` (which failed with anomalies of `kinds`). `run` runs one schedule
/// and returns the anomaly kinds it observed (empty: it passed).
pub async fn shrink<F, Fut>(
    original: &Schedule,
    kinds: &BTreeSet<String>,
    opts: ShrinkOpts,
    run: F,
) -> Shrunk
where
    F: FnMut(Schedule) -> Fut,
    Fut: Future<Output = BTreeSet<String>>,
{
    let mut s = Shrinker {
        run,
        kinds,
        opts,
        runs: 0,
        attempts: Vec::new(),
    };
    // 1. Faults, by delta debugging.
    let (mut best, mut budget_out, mut reproduced) = s.ddmin(original.clone()).await;
    // No candidate failed: every removal passed, or there was nothing to remove. Only a
    // failing run of the schedule itself makes it 1-minimal rather than unreproduced.
    if !budget_out && !reproduced {
        match s.still_fails(&best).await {
            None => budget_out = true,
            Some(r) => reproduced = r,
        }
    }
    let finding = if budget_out {
        Finding::BudgetSpent
    } else if reproduced {
        Finding::OneMinimal
    } else {
        Finding::NotReproduced
    };
    // Nothing failed again: shortening or dropping membership would prove nothing.
    if !budget_out && finding != Finding::NotReproduced {
        // 2. Membership changes, all at once.
        if !best.workload.membership.is_empty() {
            let mut cand = best.clone();
            cand.workload.membership.clear();
            if s.still_fails(&cand).await == Some(true) {
                best = cand;
            }
        }
        // 3. A shorter workload.
        best = s.shorten(best).await;
    }
    let repro = match best.faults.as_slice() {
        [f] => f
            .kind
            .im_fault()
            .map(|spec| format!("make repro FAULT='{spec}'")),
        _ => None,
    };
    Shrunk {
        minimal: best,
        one_minimal: finding == Finding::OneMinimal,
        finding,
        runs: s.runs,
        attempts: s.attempts,
        repro,
    }
}

/// A shrink under way: the runner, what counts as failing again, the budget, and every
/// candidate tried.
struct Shrinker<'a, F> {
    run: F,
    kinds: &'a BTreeSet<String>,
    opts: ShrinkOpts,
    runs: u32,
    attempts: Vec<Value>,
}

impl<F, Fut> Shrinker<'_, F>
where
    F: FnMut(Schedule) -> Fut,
    Fut: Future<Output = BTreeSet<String>>,
{
    /// Whether `cand` still fails (one of `kinds` in up to `reps` runs), within the budget
    /// (None: the budget was spent before it ran at all).
    async fn still_fails(&mut self, cand: &Schedule) -> Option<bool> {
        let mut failed = false;
        let mut tried = 0;
        for _ in 0..self.opts.reps {
            if self.runs >= self.opts.max_runs {
                break;
            }
            self.runs += 1;
            tried += 1;
            let seen = (self.run)(cand.clone()).await;
            if seen.iter().any(|k| self.kinds.contains(k)) {
                failed = true;
                break;
            }
        }
        self.attempts.push(json!({
            "faults": cand.faults.iter().map(|f| f.id).collect::<Vec<_>>(),
            "membership_changes": cand.workload.membership.len(),
            "duration_ms": cand.options.duration_ms,
            "runs": tried,
            "still_fails": failed,
        }));
        (tried > 0).then_some(failed)
    }

    /// The faults by delta debugging (ddmin's complement step): the smallest schedule
    /// found, whether the budget ran out, and whether any candidate failed again.
    async fn ddmin(&mut self, mut best: Schedule) -> (Schedule, bool, bool) {
        let (mut n, mut reproduced) = (2usize, false);
        while !best.faults.is_empty() {
            let len = best.faults.len();
            let n_eff = n.min(len);
            let chunk = len.div_ceil(n_eff);
            let mut reduced = false;
            for c in 0..n_eff {
                let lo = c * chunk;
                if lo >= len {
                    break;
                }
                let hi = (lo + chunk).min(len);
                let mut cand = best.clone();
                cand.faults.drain(lo..hi);
                match self.still_fails(&cand).await {
                    None => return (best, true, reproduced),
                    Some(true) => {
                        reproduced = true;
                        best = cand;
                        n = (n_eff - 1).max(2);
                        reduced = true;
                        break;
                    }
                    Some(false) => {}
                }
            }
            if !reduced {
                if n_eff >= len {
                    break; // every single fault was tried: 1-minimal
                }
                n = (n_eff * 2).min(len);
            }
        }
        (best, false, reproduced)
    }

    /// Halves the workload while it still fails, never cutting a fault off.
    async fn shorten(&mut self, mut best: Schedule) -> Schedule {
        while self.runs < self.opts.max_runs {
            let last = best.faults.iter().map(|f| f.end_ms).max().unwrap_or(0);
            let target = (best.options.duration_ms / 2).max(last + 300).max(1000);
            if target >= best.options.duration_ms {
                break;
            }
            let mut cand = best.clone();
            cand.options.duration_ms = target;
            cand.workload.membership.retain(|m| m.at_ms < target);
            match self.still_fails(&cand).await {
                Some(true) => best = cand,
                _ => break,
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nemesis::schedule::{generate, Options};

    fn model(need: &'static [u32]) -> impl FnMut(Schedule) -> std::future::Ready<BTreeSet<String>> {
        move |s: Schedule| {
            let ids: BTreeSet<u32> = s.faults.iter().map(|f| f.id).collect();
            let fails = need.iter().all(|i| ids.contains(i));
            std::future::ready(if fails {
                BTreeSet::from(["lost".to_string()])
            } else {
                BTreeSet::new()
            })
        }
    }

    /// A failure that needs faults 1 and 4 together shrinks to exactly those two, with
    /// the workload shortened to just past them.
    #[tokio::test]
    async fn shrinks_to_the_faults_that_matter() {
        let opts = Options {
            faults: 8,
            ..Options::default()
        };
        let s = (0..100)
            .map(|seed| generate(seed, &opts).unwrap())
            .find(|s| s.faults.len() == 8)
            .expect("a seed with 8 faults");
        let kinds = BTreeSet::from(["lost".to_string()]);
        let r = shrink(
            &s,
            &kinds,
            ShrinkOpts {
                reps: 1,
                max_runs: 100,
            },
            model(&[1, 4]),
        )
        .await;
        let ids: Vec<u32> = r.minimal.faults.iter().map(|f| f.id).collect();
        assert_eq!(ids.len(), 2, "{ids:?}");
        assert!(ids.contains(&1) && ids.contains(&4), "{ids:?}");
        assert!(r.one_minimal);
        assert_eq!(r.finding, Finding::OneMinimal);
        assert!(r.minimal.workload.membership.is_empty());
        let last = r.minimal.faults.iter().map(|f| f.end_ms).max().unwrap();
        assert!(
            r.minimal.options.duration_ms < s.options.duration_ms
                || last + 300 >= s.options.duration_ms / 2
        );
        r.minimal.validate().unwrap();
        assert!(r.repro.is_none());
    }

    /// A failure of one fault point shrinks to it and names the repro line; a budget too
    /// small is reported as not 1-minimal; an anomaly of another kind does not count.
    #[tokio::test]
    async fn one_fault_gives_a_repro_line_and_budgets_hold() {
        let opts = Options {
            kinds: vec!["gw-crash-point".into(), "pg-pause".into(), "net-db".into()],
            faults: 6,
            ..Options::default()
        };
        let s = (0..200)
            .map(|seed| generate(seed, &opts).unwrap())
            .find(|s| {
                s.faults.len() >= 4 && s.faults.iter().any(|f| f.kind.name() == "gw-crash-point")
            })
            .expect("a seed with a crash point");
        let target = s
            .faults
            .iter()
            .find(|f| f.kind.name() == "gw-crash-point")
            .unwrap()
            .id;
        let need: &'static [u32] = Box::leak(vec![target].into_boxed_slice());
        let kinds = BTreeSet::from(["lost".to_string()]);
        let r = shrink(
            &s,
            &kinds,
            ShrinkOpts {
                reps: 1,
                max_runs: 100,
            },
            model(need),
        )
        .await;
        assert_eq!(r.minimal.faults.len(), 1);
        assert!(
            r.repro
                .as_deref()
                .unwrap()
                .starts_with("make repro FAULT='"),
            "{:?}",
            r.repro
        );
        let r = shrink(
            &s,
            &kinds,
            ShrinkOpts {
                reps: 1,
                max_runs: 1,
            },
            model(need),
        )
        .await;
        assert!(!r.one_minimal);
        assert_eq!(r.finding, Finding::BudgetSpent);
        assert_eq!(r.runs, 1);
        let other = BTreeSet::from(["duplicated".to_string()]);
        let r = shrink(
            &s,
            &other,
            ShrinkOpts {
                reps: 1,
                max_runs: 100,
            },
            model(need),
        )
        .await;
        assert_eq!(r.minimal.faults.len(), s.faults.len(), "nothing removable");
        // Issue 41: nothing reproduced, so the untouched schedule is not called 1-minimal.
        assert_eq!(r.finding, Finding::NotReproduced);
        assert!(!r.one_minimal);
        assert_eq!(r.minimal.options.duration_ms, s.options.duration_ms);
    }

    /// A schedule whose every single fault is needed: no candidate fails, the original
    /// is run once more and fails, so it is 1-minimal (not "not reproduced").
    #[tokio::test]
    async fn all_faults_needed_is_one_minimal_after_the_original_reproduces() {
        let opts = Options {
            faults: 3,
            ..Options::default()
        };
        let s = (0..100)
            .map(|seed| generate(seed, &opts).unwrap())
            .find(|s| s.faults.len() == 3)
            .expect("a seed with 3 faults");
        let need: &'static [u32] = Box::leak(
            s.faults
                .iter()
                .map(|f| f.id)
                .collect::<Vec<_>>()
                .into_boxed_slice(),
        );
        let kinds = BTreeSet::from(["lost".to_string()]);
        let r = shrink(
            &s,
            &kinds,
            ShrinkOpts {
                reps: 1,
                max_runs: 100,
            },
            model(need),
        )
        .await;
        assert_eq!(r.minimal.faults.len(), 3);
        assert_eq!(r.finding, Finding::OneMinimal);
        let last = r.attempts.last().unwrap();
        assert_eq!(last["still_fails"], true, "{:?}", r.attempts);
    }
}
