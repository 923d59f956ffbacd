//! PostgreSQL's dynamic shared memory segments that killed servers left behind.
//!
//! With `dynamic_shared_memory_type = posix` (the default) a server keeps its segments as
//! files `PostgreSQL.<n>` in `/dev/shm`. A clean shutdown removes them; a server that is
//! killed (the harness's crashes, power cuts and dropped throwaway clusters) never does,
//! and its data directory, which would let a restart clean them, is removed with the work
//! directory. Measured here after a day of suites and proofs: 4,050 such files, 2,023 of
//! them 1 MiB, 2.1 GB of a 24 GB RAM file system that [`crate::pg::work_base`] needs 4 GiB
//! of. [`sweep`] removes the ones no process maps any more.
//!
//! Owns: the sweep and its stamp. Must not: remove a segment any live process maps (a
//! running, paused or recovering server of this run or any other), or one younger than
//! [`MIN_AGE`] (a server may be between creating a segment and mapping it).

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fs;
use std::path::Path;
use std::time::{Duration, SystemTime};

/// Where the segments are.
pub(crate) const DIR: &str = "/dev/shm";
/// The segments' file name prefix.
const PREFIX: &str = "PostgreSQL.";
/// A segment younger than this is never removed.
const MIN_AGE: Duration = Duration::from_secs(60);
/// At most one sweep this often across every process of the machine (the stamp's age).
const EVERY: Duration = Duration::from_secs(60);
/// The stamp whose modification time is the last sweep's.
const STAMP: &str = "imfault-dsm-sweep.stamp";

/// Removes the orphaned segments in [`DIR`], at most once per [`EVERY`] on this machine;
/// returns how many it removed. Never fails: a segment it cannot remove stays.
pub(crate) fn sweep() -> usize {
    let dir = Path::new(DIR);
    let stamp = dir.join(STAMP);
    let recent = fs::metadata(&stamp)
        .and_then(|m| m.modified())
        .is_ok_and(|t| age(t) < EVERY);
    if recent || fs::write(&stamp, b"").is_err() {
        return 0;
    }
    remove_orphans(dir, &mapped(dir, PREFIX), MIN_AGE)
}

/// The `PostgreSQL.<n>` files in `dir` older than `min_age` that are not in `mapped`,
/// removed; how many.
fn remove_orphans(dir: &Path, mapped: &BTreeSet<OsString>, min_age: Duration) -> usize {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with(PREFIX))
        .filter(|e| !mapped.contains(&e.file_name()))
        .filter(|e| {
            e.metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| age(t) >= min_age)
        })
        .filter(|e| fs::remove_file(e.path()).is_ok())
        .count()
}

/// The names of the files in `dir` whose name starts with `prefix` that any live process
/// maps (`/proc/*/maps`).
fn mapped(dir: &Path, prefix: &str) -> BTreeSet<OsString> {
    let Ok(procs) = fs::read_dir("/proc") else {
        return BTreeSet::new();
    };
    let marker = format!("{}/{prefix}", dir.display());
    let skip = marker.len() - prefix.len();
    procs
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter_map(|e| fs::read_to_string(e.path().join("maps")).ok())
        .flat_map(|maps| {
            maps.lines()
                .filter_map(|l| l.find(&marker).map(|i| &l[i + skip..]))
                .filter_map(|name| name.split_whitespace().next())
                .map(OsString::from)
                .collect::<Vec<_>>()
        })
        .collect()
}

fn age(t: SystemTime) -> Duration {
    SystemTime::now().duration_since(t).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    /// Proves the sweep removes only orphans: in a directory of its own, an old segment no
    /// process maps goes; an old one this process maps, a young one and a file of another
    /// name stay. Then the maps scan finds a file this process maps.
    #[test]
    fn only_old_unmapped_segments_are_removed() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let old = SystemTime::now() - Duration::from_secs(600);
        let make = |name: &str, at: Option<SystemTime>| -> anyhow::Result<()> {
            let f = fs::File::create(dir.path().join(name))?;
            f.write_all_at(b"x", 0)?;
            if let Some(t) = at {
                f.set_modified(t)?;
            }
            Ok(())
        };
        make("PostgreSQL.1", Some(old))?;
        make("PostgreSQL.2", Some(old))?;
        make("PostgreSQL.3", None)?;
        make("other.4", Some(old))?;
        let in_use: BTreeSet<OsString> = [OsString::from("PostgreSQL.2")].into();
        assert_eq!(remove_orphans(dir.path(), &in_use, MIN_AGE), 1);
        let left: BTreeSet<String> = fs::read_dir(dir.path())?
            .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
            .collect::<anyhow::Result<_>>()?;
        let want: BTreeSet<String> = ["PostgreSQL.2", "PostgreSQL.3", "other.4"]
            .map(String::from)
            .into();
        assert_eq!(left, want);

        // What a live process maps is seen: this test's own executable.
        let exe = std::env::current_exe()?;
        let (exe_dir, exe_name) = (exe.parent().expect("a directory"), exe.file_name());
        let name = exe_name.expect("a name").to_string_lossy().into_owned();
        let seen = mapped(exe_dir, &name);
        assert!(
            seen.contains(&OsString::from(&name)),
            "{} is mapped by this process and was not seen: {seen:?}",
            exe.display()
        );
        Ok(())
    }
}
