//! What changed since the last sweep, as fan-out and acks saw it: the sweep's candidates
//! (D5). Fan-out records every (install, conversation) it pushed to and every conversation
//! whose event it could not read; a successful ack records the merged cursor. The sweep
//! drains the record every interval and asks the database only about these pairs, instead
//! of about every (subscribed device, conversation) pair.
//!
//! A leaf: no I/O, no database, nothing from `conn`, `fanout`, `sweep` or `server`. Bounded:
//! past [`PAIRS_MAX`] entries it forgets them and asks the sweep for a full pass instead
//! (which finds every lagging pair whatever was recorded).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

/// Most pushed pairs (and, separately, acked pairs) remembered between two sweeps; past it
/// the record is dropped and a full pass is asked for (never wrong, only slower).
pub const PAIRS_MAX: usize = 1_000_000;

/// An install (`device`, `install_epoch`) and a conversation.
pub type PairKey = (String, i64, String);

/// What one drain hands the sweep (see [`Changes::take`]).
#[derive(Debug, Default)]
pub struct Drained {
    /// Pairs pushed since the last drain and not acked up to the pushed seq since.
    pub pushed: HashMap<PairKey, i64>,
    /// Conversations whose notified event could not be read (its audience is unknown).
    pub convs: HashSet<String>,
    /// The record overflowed: only a full pass is sure to find everything.
    pub full: bool,
}

#[derive(Debug, Default)]
struct Inner {
    pushed: HashMap<PairKey, i64>,
    acked: HashMap<PairKey, i64>,
    convs: HashSet<String>,
    full: bool,
}

/// The record itself, shared through `State::changes`.
#[derive(Debug)]
pub struct Changes {
    inner: Mutex<Inner>,
    /// Most entries of each of its three records ([`PAIRS_MAX`]).
    max: usize,
}

impl Default for Changes {
    fn default() -> Self {
        Changes::with_max(PAIRS_MAX)
    }
}

impl Changes {
    /// A record of at most `max` entries each of pushed pairs, acked pairs and failed
    /// conversations.
    pub fn with_max(max: usize) -> Changes {
        Changes {
            inner: Mutex::default(),
            max,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fan-out offered `conv:seq` to connections of these installs (before the push is
    /// queued, so the client cannot ack it before it is recorded). D5: a pair pushed and not
    /// acked by the next sweep is verified there, so a lost push is found within one interval.
    pub fn pushed<'a>(
        &self,
        installs: impl IntoIterator<Item = (&'a str, i64)>,
        conv: &str,
        seq: i64,
    ) {
        let mut g = self.lock();
        for (device, epoch) in installs {
            let s = g
                .pushed
                .entry((device.to_string(), epoch, conv.to_string()))
                .or_insert(seq);
            *s = (*s).max(seq);
        }
        if g.pushed.len() > self.max {
            g.pushed.clear();
            g.full = true;
        }
    }

    /// Fan-out could not read `conv`'s notified event: every subscribed member of `conv`
    /// is a candidate of the next sweep.
    pub fn read_failed(&self, conv: &str) {
        let mut g = self.lock();
        g.convs.insert(conv.to_string());
        if g.convs.len() > self.max {
            g.convs.clear();
            g.full = true;
        }
    }

    /// An ack of this install merged its cursor to `delivered` (the database's answer). A
    /// push up to it needs no verification any more, and the sweep stops hinting the pair
    /// once its visible head is reached.
    pub fn acked(&self, device: &str, epoch: i64, conv: &str, delivered: i64) {
        let mut g = self.lock();
        let key = (device.to_string(), epoch, conv.to_string());
        if g.pushed.get(&key).is_some_and(|&s| s <= delivered) {
            g.pushed.remove(&key);
        }
        let d = g.acked.entry(key).or_insert(delivered);
        *d = (*d).max(delivered);
        if g.acked.len() > self.max {
            g.acked.clear();
            g.full = true;
        }
    }

    /// Asks for a full pass (the record cannot be trusted: e.g. a sweep query failed after
    /// it was drained).
    pub fn ask_full(&self) {
        self.lock().full = true;
    }

    /// The candidates recorded since the last call (the acks stay: see [`Changes::take_acks`]).
    pub fn take(&self) -> Drained {
        let mut g = self.lock();
        Drained {
            pushed: std::mem::take(&mut g.pushed),
            convs: std::mem::take(&mut g.convs),
            full: std::mem::take(&mut g.full),
        }
    }

    /// The acks recorded since the last call. The sweep takes them after its queries, so an
    /// ack that lands while a query runs still ends the pair's hints (the query may have
    /// read the cursor before it).
    pub fn take_acks(&self) -> HashMap<PairKey, i64> {
        std::mem::take(&mut self.lock().acked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ack_up_to_the_push_removes_the_candidate() {
        let c = Changes::default();
        c.pushed([("d1", 1), ("d2", 1)], "c1", 5);
        c.acked("d1", 1, "c1", 5);
        c.acked("d2", 1, "c1", 4);
        let d = c.take();
        assert_eq!(d.pushed.len(), 1);
        assert_eq!(d.pushed.get(&("d2".into(), 1, "c1".into())), Some(&5));
        assert_eq!(c.take_acks().len(), 2);
        assert!(c.take().pushed.is_empty() && c.take_acks().is_empty());
    }

    #[test]
    fn the_newest_push_wins_and_another_install_is_another_pair() {
        let c = Changes::default();
        c.pushed([("d1", 1)], "c1", 5);
        c.pushed([("d1", 1)], "c1", 3);
        c.pushed([("d1", 2)], "c1", 6);
        c.acked("d1", 1, "c1", 4);
        let d = c.take();
        assert_eq!(d.pushed.get(&("d1".into(), 1, "c1".into())), Some(&5));
        assert_eq!(d.pushed.get(&("d1".into(), 2, "c1".into())), Some(&6));
    }

    /// Each record holds at most its limit: at the limit nothing is lost; one entry more
    /// and the record is dropped and a full pass asked for (never wrong, only slower).
    /// Pushed pairs, acked pairs and failed conversations alike.
    #[test]
    fn each_record_holds_its_limit_and_one_more_asks_for_a_full_pass() {
        let max = 50;
        let fill = |c: &Changes, what: &str, n: usize| {
            for i in 0..n {
                let d = format!("d{i}");
                match what {
                    "pushed" => c.pushed([(d.as_str(), 1)], "c", 1),
                    "acked" => c.acked(&d, 1, "c", 1),
                    _ => c.read_failed(&d),
                }
            }
        };
        for what in ["pushed", "acked", "convs"] {
            let c = Changes::with_max(max);
            fill(&c, what, max);
            let d = c.take();
            let acks = c.take_acks();
            let kept = match what {
                "pushed" => d.pushed.len(),
                "acked" => acks.len(),
                _ => d.convs.len(),
            };
            assert_eq!((kept, d.full), (max, false), "{what} at its limit");
            fill(&c, what, max + 1);
            let d = c.take();
            let acks = c.take_acks();
            assert!(d.full, "{what}: one more asks for a full pass");
            assert!(
                d.pushed.is_empty() && d.convs.is_empty() && acks.is_empty(),
                "{what}"
            );
        }
        assert_eq!(Changes::default().max, PAIRS_MAX);
    }
}
