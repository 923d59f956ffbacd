//! The redelivery sweep (D5): every `IM_SWEEP_MS` it hints every subscribed connection
//! about each conversation where its device's cursor is below the visible head. Read-only:
//! it never writes cursors (only acks do, D3).
//!
//! It costs what lags, not what is subscribed. A pair's lag (cursor below visible head)
//! changes only when the conversation's head moves (a committed send, which fan-out is
//! notified of and pushes), when the device acks (the cursor moves, D4: only upwards), or
//! when the install changes (its connections are closed). Membership changes never move a
//! visible head by themselves: a `leave` ends the period at the current head, a `join`
//! starts after it. So every interval the sweep asks the database only about:
//!
//! - the pairs fan-out pushed to since the last sweep and that were not acked up to the
//!   pushed seq since (`changes::Changes`: a lost push is one of them);
//! - every conversation whose notified event fan-out could not read (all its members);
//! - the installs of connections that subscribed since the last sweep (all their pairs);
//!
//! and keeps, in memory, every pair it found lagging until an ack reaches the visible head
//! it found. That set is hinted every interval without a query: a device whose push was lost
//! while nothing else changes is hinted again every interval until it acks (D5).
//!
//! A **full pass** asks about every subscribed install, in keyset pages of
//! [`PAGE_INSTALLS`] installs (one bounded query each, well inside `IM_DB_TIMEOUT_MS`), and
//! replaces what the sweep knew of each page's installs. It runs at start, after the LISTEN
//! connection was lost and regained (`State::sweep_now`: notifications in between are gone,
//! so the record of changes is incomplete), after a sweep query failed or the record
//! overflowed (urgent: pages may use half of each interval), and as a safety net
//! [`FULL_PASS_EVERY_INTERVALS`] intervals after the previous one ended (routine: pages
//! may use a tenth of each interval). The safety net repairs what no record of this gateway
//! sees: an ack or a commit whose notification never came through another gateway on the
//! same database, which would otherwise keep a pair hinted, or unhinted, until then. The
//! regular sweep keeps running every interval while a full pass is under way.

use crate::bugs::{self, Bug};
use crate::changes::{Drained, PairKey};
use crate::hub::ConnHandle;
use crate::protocol::HintWhy;
use crate::state::State;
use crate::store::{self, LaggingRow};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Intervals between the end of one full pass and the start of the next routine one (the
/// safety net; start, LISTEN loss and a failed query start one at once). At the default
/// 1 s interval a routine pass starts a minute after the last one ended.
pub const FULL_PASS_EVERY_INTERVALS: u64 = 60;

/// Installs per full-pass page by default (`IM_SWEEP_PAGE_INSTALLS`; each page is one query
/// over their conversations: about 10k pairs at 20 conversations per device, a few hundred
/// milliseconds on a loaded machine, far inside `IM_DB_TIMEOUT_MS`). Newly subscribed
/// installs are asked about in pages of this size too.
pub const PAGE_INSTALLS: usize = 500;

/// Candidate pairs per query of the regular sweep (same bound as a page).
pub const PAGE_PAIRS: usize = 10_000;

/// An install: device id and install epoch.
type Install = (String, i64);

/// A full pass under way: the last install of the last page done (keyset).
#[derive(Debug)]
struct FullPass {
    after: Option<Install>,
    urgent: bool,
    /// Why it started (logged when it ends).
    why: &'static str,
    /// Pages and installs asked about so far.
    pages: usize,
    installs: usize,
    began: Instant,
}

impl FullPass {
    fn new(urgent: bool, why: &'static str) -> FullPass {
        FullPass {
            after: None,
            urgent,
            why,
            pages: 0,
            installs: 0,
            began: Instant::now(),
        }
    }
}

/// What one interval did (logged at debug level; the tests read it).
#[derive(Debug, Default, Clone, Copy)]
pub struct Interval {
    /// Candidate pairs and installs asked about (regular sweep).
    pub candidate_pairs: usize,
    pub candidate_installs: usize,
    /// Full-pass pages run in this interval, and whether the pass ended in it.
    pub pages: usize,
    pub full_pass_ended: bool,
    /// Time spent waiting for the database.
    pub db: Duration,
    /// Hints queued.
    pub hints: usize,
}

/// The sweep's memory between intervals.
#[derive(Debug, Default)]
pub struct Sweeper {
    /// D5: the pairs found lagging (install → conversation → visible head found) and not
    /// acked up to that head since. Hinted every interval, with no query.
    lagging: HashMap<Install, BTreeMap<String, i64>>,
    /// Connections subscribed at the last interval: a connection not among them is new,
    /// and its install is asked about whole.
    known: HashSet<u64>,
    /// The full pass under way, if any.
    full: Option<FullPass>,
    /// Intervals since the last full pass ended.
    since_full: u64,
    /// Whether the first interval ran (it starts a full pass).
    started: bool,
}

/// D5: a lost push is found here within one interval; the hint makes the client sync and
/// ack, after which the cursor equals the head and the hints stop.
pub async fn run(state: Arc<State>) {
    if bugs::active(Bug::NoSweep) {
        return;
    }
    let every = if bugs::active(Bug::SlowSweep) {
        state.cfg.sweep_interval_ms * 3
    } else {
        state.cfg.sweep_interval_ms
    };
    let mut tick = tokio::time::interval(Duration::from_millis(every));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sweeper = Sweeper::default();
    let mut failing = false;
    loop {
        // Fan-out notifies `sweep_now` only after it lost (and regained) LISTEN.
        let listen_lost = tokio::select! {
            _ = state.cancel.cancelled() => return,
            _ = tick.tick() => false,
            _ = state.sweep_now.notified() => true,
        };
        match sweeper.interval(&state, listen_lost, every).await {
            Ok(i) => {
                if failing {
                    tracing::info!("sweep works again");
                    failing = false;
                }
                tracing::debug!(?i, "sweep");
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, "sweep failed; retrying every interval (full pass)");
                    failing = true;
                }
            }
        }
    }
}

impl Sweeper {
    /// One interval: ask the database about what changed (and a share of a full pass, if
    /// one is under way), then hint every pair known to lag. `full_now`: start a full pass
    /// at once. A failed query ends the interval's queries and asks for a full pass; the
    /// hints still go out.
    pub async fn interval(
        &mut self,
        state: &State,
        full_now: bool,
        interval_ms: u64,
    ) -> anyhow::Result<Interval> {
        let mut by_install: HashMap<Install, Vec<Arc<ConnHandle>>> = HashMap::new();
        let mut fresh = BTreeSet::new();
        let mut ids = HashSet::new();
        for c in state.hub.all() {
            let key = (c.who.device.clone(), c.who.epoch);
            if !self.known.contains(&c.id) {
                fresh.insert(key.clone());
            }
            ids.insert(c.id);
            by_install.entry(key).or_default().push(c);
        }
        self.known = ids;
        self.lagging.retain(|k, _| by_install.contains_key(k));

        let drained = state.changes.take();
        let urgent = if !self.started {
            Some("start")
        } else if full_now {
            Some("LISTEN connection lost")
        } else if drained.full {
            Some("record overflowed or a query failed")
        } else {
            None
        };
        if let Some(why) = urgent {
            self.full = Some(FullPass::new(true, why));
        } else if self.full.is_none() && self.since_full >= FULL_PASS_EVERY_INTERVALS {
            self.full = Some(FullPass::new(false, "routine"));
        }
        self.started = true;
        if self.full.is_none() {
            self.since_full += 1;
        }
        let mut report = Interval::default();
        let asked = self
            .ask(state, &by_install, fresh, drained, interval_ms, &mut report)
            .await;
        if asked.is_err() {
            // What was drained is gone with the failed query: only a full pass is sure.
            state.changes.ask_full();
        }
        // After the queries: an ack that landed while one ran still ends the pair's hints.
        self.apply_acks(&state.changes.take_acks());
        for ((device, epoch), convs) in &self.lagging {
            for c in by_install
                .get(&(device.clone(), *epoch))
                .into_iter()
                .flatten()
            {
                for (conv, head) in convs {
                    c.hint(conv, *head, HintWhy::Sweep);
                    report.hints += 1;
                }
            }
        }
        asked.map(|()| report)
    }

    /// The interval's queries: candidates first, then full-pass pages within the budget.
    async fn ask(
        &mut self,
        state: &State,
        by_install: &HashMap<Install, Vec<Arc<ConnHandle>>>,
        fresh: BTreeSet<Install>,
        drained: Drained,
        interval_ms: u64,
        report: &mut Interval,
    ) -> anyhow::Result<()> {
        let user = |k: &Install| by_install.get(k).map(|cs| cs[0].who.user.clone());
        // Newly subscribed installs: every pair (and whether the install is still current).
        let fresh: Vec<(Install, String)> = fresh
            .into_iter()
            .filter_map(|k| user(&k).map(|u| (k, u)))
            .collect();
        for page in fresh.chunks(state.cfg.sweep_page_installs) {
            report.candidate_installs += page.len();
            self.ask_installs(state, page, report).await?;
        }
        // Pairs pushed and not acked since the last sweep (ordered: the indexes are read in
        // order).
        let mut pairs: Vec<(PairKey, i64)> = drained
            .pushed
            .into_iter()
            .filter(|((d, e, _), _)| by_install.contains_key(&(d.clone(), *e)))
            .collect();
        pairs.sort_unstable();
        for page in pairs.chunks(PAGE_PAIRS) {
            report.candidate_pairs += page.len();
            let devices: Vec<String> = page.iter().map(|p| p.0 .0.clone()).collect();
            let epochs: Vec<i64> = page.iter().map(|p| p.0 .1).collect();
            let convs: Vec<String> = page.iter().map(|p| p.0 .2.clone()).collect();
            let seqs: Vec<i64> = page.iter().map(|p| p.1).collect();
            let t = Instant::now();
            let rows = db(
                state,
                "sweep query (pairs)",
                store::lagging_of_pairs(&state.pool, &devices, &epochs, &convs, &seqs),
            )
            .await?;
            report.db += t.elapsed();
            let asked = page
                .iter()
                .map(|((d, e, conv), seq)| ((d.clone(), *e), conv.as_str(), *seq));
            self.apply_pairs(asked, rows);
        }
        // Conversations whose notified event could not be read: all their members.
        if !drained.convs.is_empty() {
            let convs: Vec<String> = drained.convs.into_iter().collect();
            for page in convs.chunks(PAGE_PAIRS / 100) {
                let t = Instant::now();
                let rows = db(
                    state,
                    "sweep query (conversations)",
                    store::lagging_in_convs(&state.pool, page),
                )
                .await?;
                report.db += t.elapsed();
                self.apply_convs(page, rows, |k| by_install.contains_key(k));
            }
        }
        self.full_pass_pages(state, by_install, interval_ms, report)
            .await
    }

    /// The full pass under way, page by page in install order (keyset: each page starts
    /// after the last install of the one before, so a pass asks about each install once),
    /// within its share of the interval (one page at least). Logs its end.
    async fn full_pass_pages(
        &mut self,
        state: &State,
        by_install: &HashMap<Install, Vec<Arc<ConnHandle>>>,
        interval_ms: u64,
        report: &mut Interval,
    ) -> anyhow::Result<()> {
        let Some(pass) = &self.full else {
            return Ok(());
        };
        let budget = Duration::from_millis(if pass.urgent {
            interval_ms / 2
        } else {
            interval_ms / 10
        });
        let begun = Instant::now();
        let mut order: Vec<&Install> = by_install.keys().collect();
        order.sort_unstable();
        let user = |k: &Install| by_install.get(k).map(|cs| cs[0].who.user.clone());
        loop {
            let Some(pass) = &self.full else {
                return Ok(());
            };
            let from = match &pass.after {
                Some(a) => order.partition_point(|k| *k <= a),
                None => 0,
            };
            let page: Vec<(Install, String)> = order[from..]
                .iter()
                .take(state.cfg.sweep_page_installs)
                .filter_map(|&k| user(k).map(|u| (k.clone(), u)))
                .collect();
            let Some(last) = page.last().map(|p| p.0.clone()) else {
                if let Some(p) = self.full.take() {
                    tracing::info!(
                        why = p.why,
                        pages = p.pages,
                        installs = p.installs,
                        took_ms = p.began.elapsed().as_millis() as u64,
                        "sweep: full pass ended"
                    );
                }
                self.since_full = 0;
                report.full_pass_ended = true;
                return Ok(());
            };
            self.ask_installs(state, &page, report).await?;
            report.pages += 1;
            if let Some(p) = &mut self.full {
                p.after = Some(last);
                p.pages += 1;
                p.installs += page.len();
            }
            if begun.elapsed() >= budget {
                return Ok(());
            }
        }
    }

    /// One page of installs: close the connections of installs no longer current, then
    /// replace what is known of the page's installs by what the database says.
    async fn ask_installs(
        &mut self,
        state: &State,
        page: &[(Install, String)],
        report: &mut Interval,
    ) -> anyhow::Result<()> {
        let devices: Vec<String> = page.iter().map(|p| p.0 .0.clone()).collect();
        let epochs: Vec<i64> = page.iter().map(|p| p.0 .1).collect();
        let users: Vec<String> = page.iter().map(|p| p.1.clone()).collect();
        let t = Instant::now();
        let (stale, rows) = installs_page(
            &state.pool,
            state.cfg.db_timeout(),
            &devices,
            &users,
            &epochs,
        )
        .await?;
        // A reinstall notification lost with the LISTEN connection is found here.
        for (device, current) in stale {
            state.hub.revoke_stale(&device, current);
        }
        report.db += t.elapsed();
        self.apply_installs(page.iter().map(|p| &p.0), rows);
        Ok(())
    }

    /// What the database said of whole installs: their known lagging pairs are replaced.
    fn apply_installs<'a>(
        &mut self,
        asked: impl Iterator<Item = &'a Install>,
        rows: Vec<LaggingRow>,
    ) {
        for k in asked {
            self.lagging.remove(k);
        }
        self.insert(rows);
    }

    /// What the database said of single pushed pairs: each answer speaks of heads up to the
    /// pushed seq only, so a head known from elsewhere (a full pass) above it is kept.
    fn apply_pairs<'a>(
        &mut self,
        asked: impl Iterator<Item = (Install, &'a str, i64)>,
        rows: Vec<LaggingRow>,
    ) {
        for (k, conv, seq) in asked {
            if let Some(m) = self.lagging.get_mut(&k) {
                if m.get(conv).is_some_and(|&head| head <= seq) {
                    m.remove(conv);
                }
            }
        }
        self.insert(rows);
    }

    /// What the database said of whole conversations, for the installs `subscribed` keeps.
    fn apply_convs(
        &mut self,
        convs: &[String],
        rows: Vec<LaggingRow>,
        subscribed: impl Fn(&Install) -> bool,
    ) {
        for m in self.lagging.values_mut() {
            for c in convs {
                m.remove(c);
            }
        }
        let rows = rows
            .into_iter()
            .filter(|r| subscribed(&(r.0.clone(), r.1)))
            .collect();
        self.insert(rows);
    }

    /// Adds lagging pairs; a pair already known keeps the higher head (each answer was
    /// emptied of what it replaces first).
    fn insert(&mut self, rows: Vec<LaggingRow>) {
        for (device, epoch, conv, head) in rows {
            let h = self
                .lagging
                .entry((device, epoch))
                .or_default()
                .entry(conv)
                .or_insert(head);
            *h = (*h).max(head);
        }
        self.lagging.retain(|_, m| !m.is_empty());
    }

    /// Acks merged since: a pair whose cursor reached the visible head found is caught up.
    fn apply_acks(&mut self, acks: &HashMap<crate::changes::PairKey, i64>) {
        for ((device, epoch, conv), delivered) in acks {
            let key = (device.clone(), *epoch);
            if let Some(m) = self.lagging.get_mut(&key) {
                if m.get(conv).is_some_and(|head| head <= delivered) {
                    m.remove(conv);
                }
                if m.is_empty() {
                    self.lagging.remove(&key);
                }
            }
        }
    }

    /// The pairs hinted every interval: `(device, epoch, conv, head)`, sorted.
    pub fn lagging(&self) -> Vec<LaggingRow> {
        let mut v: Vec<LaggingRow> = self
            .lagging
            .iter()
            .flat_map(|((d, e), m)| m.iter().map(|(c, h)| (d.clone(), *e, c.clone(), *h)))
            .collect();
        v.sort();
        v
    }
}

/// One page of installs (at most [`PAGE_INSTALLS`]), as the full pass and a new
/// subscription ask about it: the installs no longer current (with the current epoch,
/// `None`: the device is gone), then every lagging pair of the current ones (D5). Each
/// query has the `deadline` (`IM_DB_TIMEOUT_MS`). Public for the bench and the at-scale
/// check, which run the full pass through this function.
pub async fn installs_page(
    pool: &sqlx::PgPool,
    deadline: Duration,
    devices: &[String],
    users: &[String],
    epochs: &[i64],
) -> anyhow::Result<(Vec<(String, Option<i64>)>, Vec<LaggingRow>)> {
    let within = |what: &'static str| move |_| anyhow::anyhow!("{what} exceeded IM_DB_TIMEOUT_MS");
    let stale = tokio::time::timeout(deadline, store::stale_installs(pool, devices, epochs))
        .await
        .map_err(within("stale-install query"))??;
    let rows = tokio::time::timeout(
        deadline,
        store::lagging_of_installs(pool, devices, users, epochs),
    )
    .await
    .map_err(within("sweep query (installs)"))??;
    Ok((stale, rows))
}

/// A sweep query with the `IM_DB_TIMEOUT_MS` deadline (read-only: dropping it there is
/// harmless).
async fn db<T>(
    state: &State,
    what: &str,
    q: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> anyhow::Result<T> {
    Ok(tokio::time::timeout(state.cfg.db_timeout(), q)
        .await
        .map_err(|_| anyhow::anyhow!("{what} exceeded IM_DB_TIMEOUT_MS"))??)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The configuration table's default of `IM_SWEEP_PAGE_INSTALLS` is [`PAGE_INSTALLS`].
    #[test]
    fn the_configured_page_default_is_page_installs() {
        assert_eq!(
            crate::config::default_of("IM_SWEEP_PAGE_INSTALLS"),
            PAGE_INSTALLS.to_string()
        );
    }

    fn row(d: &str, conv: &str, head: i64) -> LaggingRow {
        (d.into(), 1, conv.into(), head)
    }

    fn install(d: &str) -> Install {
        (d.into(), 1)
    }

    /// D5: a pair found lagging stays hinted, interval after interval, while nothing
    /// changes (no query asks about it again); an ack below the head found does not end
    /// it, an ack reaching it does.
    #[test]
    fn a_lagging_pair_stays_until_an_ack_reaches_its_head() {
        let mut s = Sweeper::default();
        let d1 = install("d1");
        s.apply_installs(
            [&d1].into_iter(),
            vec![row("d1", "c1", 3), row("d1", "c2", 7)],
        );
        s.apply_acks(&HashMap::new());
        assert_eq!(s.lagging(), vec![row("d1", "c1", 3), row("d1", "c2", 7)]);
        s.apply_acks(&HashMap::from([(("d1".into(), 1, "c2".into()), 6)]));
        assert_eq!(s.lagging(), vec![row("d1", "c1", 3), row("d1", "c2", 7)]);
        s.apply_acks(&HashMap::from([
            (("d1".into(), 1, "c2".into()), 7),
            (("d1".into(), 2, "c1".into()), 9),
        ]));
        assert_eq!(s.lagging(), vec![row("d1", "c1", 3)]);
        s.apply_acks(&HashMap::from([(("d1".into(), 1, "c1".into()), 3)]));
        assert!(s.lagging().is_empty());
        assert!(s.lagging.is_empty());
    }

    /// What the database says of a pair, an install or a conversation replaces what was
    /// known of exactly that scope, and nothing else.
    #[test]
    fn answers_replace_their_scope_only() {
        let mut s = Sweeper::default();
        let (d1, d2) = (install("d1"), install("d2"));
        s.apply_installs(
            [&d1, &d2].into_iter(),
            vec![row("d1", "c1", 3), row("d1", "c2", 4), row("d2", "c1", 3)],
        );
        // The pair d1/c1 caught up, d2/c2 newly lags; d1/c2 was not asked about.
        s.apply_pairs(
            [(d1.clone(), "c1", 3), (d2.clone(), "c2", 5)].into_iter(),
            vec![row("d2", "c2", 5)],
        );
        assert_eq!(
            s.lagging(),
            vec![row("d1", "c2", 4), row("d2", "c1", 3), row("d2", "c2", 5)]
        );
        // A push of 3 acked says nothing of the head 4 a full pass found for d1/c2.
        s.apply_pairs([(d1.clone(), "c2", 3)].into_iter(), vec![]);
        assert_eq!(
            s.lagging(),
            vec![row("d1", "c2", 4), row("d2", "c1", 3), row("d2", "c2", 5)]
        );
        // The conversation c1: d2 still lags (a newer head), d3 is not subscribed here.
        s.apply_convs(
            &["c1".to_string()],
            vec![row("d2", "c1", 6), row("d3", "c1", 6)],
            |k| k.0 != "d3",
        );
        assert_eq!(
            s.lagging(),
            vec![row("d1", "c2", 4), row("d2", "c1", 6), row("d2", "c2", 5)]
        );
        // A page of installs answering nothing: all of d1 caught up.
        s.apply_installs([&d1].into_iter(), vec![]);
        assert_eq!(s.lagging(), vec![row("d2", "c1", 6), row("d2", "c2", 5)]);
    }
}
