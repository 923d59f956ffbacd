//! Small helpers every crate of the workspace shares: deadline-bound waits
//! ([`wait_until`]), nearest-rank percentiles, and RFC 3339 time stamps. No dependency
//! on the rest of the harness.

use std::fmt;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// First pause between two polls of [`wait_until`]; it doubles up to [`POLL_MAX`].
const POLL_MIN: Duration = Duration::from_millis(5);
/// Longest pause between two polls of [`wait_until`].
const POLL_MAX: Duration = Duration::from_millis(100);

/// When a wait gives up: a time span from now, or an instant.
pub trait IntoDeadline {
    fn into_deadline(self) -> Instant;
}

impl IntoDeadline for Duration {
    fn into_deadline(self) -> Instant {
        Instant::now() + self
    }
}

impl IntoDeadline for Instant {
    fn into_deadline(self) -> Instant {
        self
    }
}

impl IntoDeadline for tokio::time::Instant {
    fn into_deadline(self) -> Instant {
        self.into_std()
    }
}

/// Polls `f` until it returns `Ok(value)`, at most until `deadline`; returns the value.
/// `Err(state)` means "not yet", with what was observed: on timeout the error names
/// `what`, the time waited and the last state (`()` for none). Polls come quickly at
/// first and then at most every 100 ms, so a cheap condition is seen at once and an
/// expensive one (a query, a request) is not hammered. The only sleep is between polls.
pub async fn wait_until<T, S: fmt::Debug>(
    what: &str,
    deadline: impl IntoDeadline,
    mut f: impl AsyncFnMut() -> Result<T, S>,
) -> anyhow::Result<T> {
    let start = Instant::now();
    let deadline = deadline.into_deadline();
    let mut pause = POLL_MIN;
    loop {
        let state = match f().await {
            Ok(v) => return Ok(v),
            Err(state) => state,
        };
        let now = Instant::now();
        if now >= deadline {
            let waited = now.duration_since(start);
            let state = format!("{state:?}");
            if state == "()" {
                anyhow::bail!("timed out after {waited:?} waiting for {what}");
            }
            anyhow::bail!("timed out after {waited:?} waiting for {what}; last seen: {state}");
        }
        tokio::time::sleep(pause.min(deadline - now)).await;
        pause = (pause * 2).min(POLL_MAX);
    }
}

/// One poll of a [`wait_until`] whose condition is known at once: done when `cond`
/// holds, else not yet, having seen `seen` (`()` for nothing worth reporting).
pub fn poll<S>(cond: bool, seen: S) -> std::future::Ready<Result<(), S>> {
    std::future::ready(if cond { Ok(()) } else { Err(seen) })
}

/// The `q`-quantile (0..=1) of `xs` by nearest rank ([`im_check::nearest_rank`], on a
/// sorted copy); `None` when empty.
pub fn percentile(xs: &[f64], q: f64) -> Option<f64> {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    im_check::nearest_rank(&v, q)
}

/// Issue 41: evidence is published only from a committed tree. When `path` lies in the
/// `evidence/` directory of a git work tree whose files (`evidence/` aside) differ from
/// HEAD, the file goes to the same place under `target/unpublished/` instead, and a line
/// says so: a run on a dirty tree names no commit that holds its code, so it is not
/// evidence. Any other path is returned as it is.
pub fn publish_path(path: &std::path::Path) -> std::path::PathBuf {
    let git = |dir: &std::path::Path, args: &[&str]| -> Option<String> {
        let out = std::process::Command::new("git")
            .args(args)
            .current_dir(dir)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        match std::env::current_dir() {
            Ok(d) => d.join(path),
            Err(_) => return path.to_path_buf(),
        }
    };
    // The nearest existing ancestor tells the work tree.
    let Some(dir) = abs.ancestors().skip(1).find(|d| d.is_dir()) else {
        return path.to_path_buf();
    };
    let Some(top) = git(dir, &["rev-parse", "--show-toplevel"]).map(std::path::PathBuf::from)
    else {
        return path.to_path_buf();
    };
    let Ok(rel) = abs.strip_prefix(&top) else {
        return path.to_path_buf();
    };
    if rel.components().next() != Some(std::path::Component::Normal("evidence".as_ref())) {
        return path.to_path_buf();
    }
    let dirty = git(
        &top,
        &["status", "--porcelain", "--", ".", ":(exclude)evidence"],
    )
    .is_none_or(|s| !s.is_empty());
    if !dirty {
        return path.to_path_buf();
    }
    let to = top.join("target/unpublished").join(rel);
    eprintln!(
        "the tree differs from HEAD (git status, evidence/ aside): {} is not published; \
         written to {} instead (commit, then run again to publish)",
        rel.display(),
        to.display()
    );
    if let Some(d) = to.parent() {
        let _ = std::fs::create_dir_all(d);
    }
    to
}

/// Writes `bytes` to `path` atomically: to a temporary file in the same directory, then
/// renamed over `path` (`tempfile`), so a reader sees the old file or the new one, never
/// a part. No fsync: it survives a crash of the process, not a power cut. The file is
/// readable by everyone (0644), like one `std::fs::write` creates.
pub fn write_atomic(path: &std::path::Path, bytes: &[u8]) -> anyhow::Result<()> {
    use anyhow::Context as _;
    use std::io::Write as _;
    use std::os::unix::fs::PermissionsExt as _;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .with_context(|| format!("{} has no file name", path.display()))?;
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}.tmp-"))
        .permissions(std::fs::Permissions::from_mode(0o644))
        .tempfile_in(dir)
        .with_context(|| format!("create a temporary file in {}", dir.display()))?;
    tmp.write_all(bytes)
        .with_context(|| format!("write {}", tmp.path().display()))?;
    tmp.persist(path)
        .map_err(|e| anyhow::Error::new(e.error))
        .with_context(|| format!("rename a temporary file over {}", path.display()))?;
    Ok(())
}

/// The variables a child started with a cleared environment still inherits from ours:
/// `PATH`, `LLVM_PROFILE_FILE` (set only by the per-test coverage run of `make
/// mutants`, scripts/mutants-coverage.sh: an instrumented gateway must write its profile
/// where the test that started it says, or its lines would count for no test) and
/// `IMFAULT_MUTANT` (set only by `make mutants`' runs of a schema build: the mutant a
/// gateway built with every mutant switches on; without it, none).
pub fn inherit_allowed(cmd: &mut std::process::Command) {
    for name in ["PATH", "LLVM_PROFILE_FILE", "IMFAULT_MUTANT"] {
        if let Some(value) = std::env::var_os(name) {
            cmd.env(name, value);
        }
    }
}

/// Runs `bin args` with a cleared environment plus [`inherit_allowed`] and `env`, stdin closed, killed
/// after `within`: its output and how long it took. An error if it cannot be started or
/// did not exit in time (then naming the command and what it printed). Its output must fit
/// in the pipes (it is read after the exit): for short outputs, such as a CLI's.
pub fn try_run_cleared(
    bin: &std::path::Path,
    args: &[&str],
    env: &[(&str, &str)],
    within: std::time::Duration,
) -> anyhow::Result<(std::process::Output, std::time::Duration)> {
    use anyhow::Context as _;
    use std::process::{Command, Stdio};
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    inherit_allowed(&mut cmd);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let started = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("spawn {}", bin.display()))?;
    let deadline = started + within;
    while child
        .try_wait()
        .with_context(|| format!("wait for {}", bin.display()))?
        .is_none()
    {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let out = child.wait_with_output().context("read its output")?;
            anyhow::bail!(
                "`{} {}` did not exit within {within:?}: stdout {} stderr {}",
                bin.display(),
                args.join(" "),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let took = started.elapsed();
    let out = child
        .wait_with_output()
        .with_context(|| format!("read the output of {}", bin.display()))?;
    Ok((out, took))
}

/// [`try_run_cleared`] for the command-line tests, which run the binaries as a user would:
/// a failure to start or to exit in time is a panic.
pub fn run_cleared(
    bin: &std::path::Path,
    args: &[&str],
    env: &[(&str, &str)],
    within: std::time::Duration,
) -> (std::process::Output, std::time::Duration) {
    try_run_cleared(bin, args, env, within).unwrap_or_else(|e| panic!("{e:#}"))
}

/// `2026-11-30T09:38:33Z` for a Unix time in seconds (UTC, whole seconds, no date
/// library: Howard Hinnant's civil_from_days).
pub fn rfc3339(unix_s: i64) -> String {
    let (days, secs) = (unix_s.div_euclid(86_400), unix_s.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        (secs / 60) % 60,
        secs % 60
    )
}

/// [`rfc3339`] of a system time (before the epoch counts as the epoch).
pub fn rfc3339_at(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    rfc3339(i64::try_from(secs).unwrap_or(i64::MAX))
}

/// Now, as [`rfc3339`].
pub fn rfc3339_now() -> String {
    rfc3339_at(SystemTime::now())
}

/// An estimate of the time left in a long run of parts (issue 22: `make bench`, `make
/// controls`): each part's expected duration (the last run's, where known), scaled by how
/// this run compares with those expectations so far.
#[derive(Debug, Clone)]
pub struct Eta {
    expected: Vec<f64>,
    actual: Vec<f64>,
    started: Instant,
    part_started: Instant,
    running: bool,
}

impl Eta {
    /// Parts expected to take these many seconds each (0 where unknown: the mean of the
    /// known ones stands in; 60 s when none is known).
    pub fn new(expected_s: Vec<f64>) -> Eta {
        let known: Vec<f64> = expected_s.iter().copied().filter(|x| *x > 0.0).collect();
        let fill = if known.is_empty() {
            60.0
        } else {
            known.iter().sum::<f64>() / known.len() as f64
        };
        let now = Instant::now();
        Eta {
            expected: expected_s
                .into_iter()
                .map(|x| if x > 0.0 { x } else { fill })
                .collect(),
            actual: Vec::new(),
            started: now,
            part_started: now,
            running: false,
        }
    }

    /// A part starts; the one running until now (if any) is done.
    pub fn next_part(&mut self) {
        if self.running && self.actual.len() < self.expected.len() {
            self.actual.push(self.part_started.elapsed().as_secs_f64());
        }
        self.running = true;
        self.part_started = Instant::now();
    }

    /// Seconds left: the remaining parts' expected time, times this run's pace so far
    /// (actual over expected of the finished parts), minus what the current part has run.
    pub fn left_s(&self) -> f64 {
        let done = self.actual.len();
        let pace = if done == 0 {
            1.0
        } else {
            self.actual.iter().sum::<f64>() / self.expected[..done].iter().sum::<f64>()
        };
        let remaining: f64 = self.expected[done.min(self.expected.len())..].iter().sum();
        (remaining * pace - self.part_started.elapsed().as_secs_f64()).max(0.0)
    }

    /// `k of n, 12 min elapsed, ~34 min left` (k counts the part now running).
    pub fn line(&self) -> String {
        let k = (self.actual.len() + 1).min(self.expected.len());
        format!(
            "{k} of {}, {} elapsed, ~{} left",
            self.expected.len(),
            human_s(self.started.elapsed().as_secs_f64()),
            human_s(self.left_s())
        )
    }
}

/// Seconds as `45 s` or `12 min`.
pub fn human_s(s: f64) -> String {
    if s < 120.0 {
        format!("{s:.0} s")
    } else {
        format!("{:.0} min", s / 60.0)
    }
}

/// Whether the file system of `dir` has at least `bytes` free.
pub fn has_room(dir: &std::path::Path, bytes: u64) -> bool {
    nix::sys::statvfs::statvfs(dir)
        .is_ok_and(|st| st.blocks_available().saturating_mul(st.fragment_size()) >= bytes)
}

/// The type of the file system `path` is on: `tmpfs`, `ext4`, `xfs`, `btrfs`, `overlay`,
/// `fuse`, else its magic number in hex.
pub fn file_system_of(path: &std::path::Path) -> String {
    use nix::sys::statfs as f;
    let Ok(st) = f::statfs(path) else {
        return "unknown".into();
    };
    let t = st.filesystem_type();
    let known = [
        (f::TMPFS_MAGIC, "tmpfs"),
        (f::EXT4_SUPER_MAGIC, "ext4"),
        (f::XFS_SUPER_MAGIC, "xfs"),
        (f::BTRFS_SUPER_MAGIC, "btrfs"),
        (f::OVERLAYFS_SUPER_MAGIC, "overlay"),
        (f::FUSE_SUPER_MAGIC, "fuse"),
    ];
    known
        .iter()
        .find(|(m, _)| *m == t)
        .map_or_else(|| format!("{:#x}", t.0), |(_, n)| n.to_string())
}

#[cfg(test)]
mod tests {
    /// Issue 41: evidence/ of a work tree is written only while the tree (evidence/ aside)
    /// matches HEAD; otherwise the file goes under target/unpublished/. Other paths are
    /// left alone.
    #[test]
    fn evidence_is_published_only_from_a_committed_tree() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let git = |args: &[&str]| {
            let ok = std::process::Command::new("git")
                .args([
                    "-c",
                    "user.name=t",
                    "-c",
                    "user.email=t@t",
                    "-c",
                    "commit.gpgsign=false",
                ])
                .args(args)
                .current_dir(root)
                .output()
                .unwrap()
                .status
                .success();
            assert!(ok, "git {args:?}");
        };
        git(&["init", "-q"]);
        std::fs::create_dir_all(root.join("evidence/x")).unwrap();
        std::fs::write(root.join("code.rs"), "fn a() {}\n").unwrap();
        std::fs::write(root.join("evidence/x/result.json"), "{}\n").unwrap();
        git(&["add", "-A"]);
        git(&["commit", "-qm", "one"]);
        let out = root.join("evidence/x/result.json");
        assert_eq!(super::publish_path(&out), out, "clean tree");
        // Evidence itself changing (a run writing it) keeps it publishable.
        std::fs::write(&out, "{\"new\": 1}\n").unwrap();
        assert_eq!(super::publish_path(&out), out, "only evidence/ differs");
        // Code differing from HEAD: not published.
        std::fs::write(root.join("code.rs"), "fn b() {}\n").unwrap();
        let to = super::publish_path(&out);
        assert_eq!(to, root.join("target/unpublished/evidence/x/result.json"));
        // An untracked file counts too; and a path outside evidence/ is never moved.
        git(&["checkout", "-q", "code.rs"]);
        std::fs::write(root.join("new.rs"), "").unwrap();
        assert_ne!(super::publish_path(&out), out, "untracked file");
        let elsewhere = root.join("target/report.json");
        assert_eq!(super::publish_path(&elsewhere), elsewhere);
    }

    /// Issue 22: the estimate follows this run's pace over the parts' expected times.
    #[test]
    fn eta_scales_the_remaining_parts_by_the_pace_so_far() {
        let mut e = super::Eta::new(vec![10.0, 0.0, 30.0]);
        // The unknown part stands in as the mean of the known ones.
        assert!((e.left_s() - 60.0).abs() < 1.0, "{}", e.left_s());
        assert!(
            e.line().starts_with("1 of 3, 0 s elapsed, ~60 s left"),
            "{}",
            e.line()
        );
        e.actual.push(20.0); // the first part took twice its expected time
        assert!((e.left_s() - 100.0).abs() < 1.0, "{}", e.left_s());
        assert!(e.line().starts_with("2 of 3"), "{}", e.line());
        assert_eq!(super::human_s(300.0), "5 min");
    }

    use super::*;

    #[test]
    fn rfc3339_known_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_764_495_513), "2025-11-30T09:38:33Z");
        assert_eq!(
            rfc3339_at(UNIX_EPOCH + Duration::from_secs(1_796_031_218)),
            rfc3339(1_796_031_218)
        );
    }

    #[test]
    fn nearest_rank_percentiles() {
        let xs: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&xs, 0.5), Some(50.0));
        assert_eq!(percentile(&xs, 0.99), Some(99.0));
        assert_eq!(percentile(&xs, 1.0), Some(100.0));
        assert_eq!(percentile(&xs, 0.0), Some(1.0));
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(im_check::nearest_rank(&[3_i64, 7], 0.5), Some(3));
    }

    #[tokio::test]
    async fn wait_until_returns_the_value_or_names_what_and_the_last_state() {
        let mut n = 0;
        let v = wait_until("n to reach 3", Duration::from_secs(5), || {
            n += 1;
            std::future::ready(if n >= 3 { Ok(n) } else { Err(n) })
        })
        .await
        .unwrap();
        assert_eq!(v, 3);
        let e = wait_until("never", Duration::from_millis(30), || {
            std::future::ready(Err::<(), _>("still 0"))
        })
        .await
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("waiting for never") && e.contains("last seen: \"still 0\""),
            "{e}"
        );
        let e = wait_until("nothing", Duration::from_millis(10), || poll(false, ()))
            .await
            .unwrap_err()
            .to_string();
        assert!(!e.contains("last seen"), "{e}");
    }
}
