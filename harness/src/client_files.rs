//! Where a work directory's client state files live: `work_dir/clients`, a link to a
//! directory on a RAM file system (`/dev/shm`) when there is one with room, else a plain
//! directory.
//!
//! Why (issue 41, a suite that does not flake): a test client writes its state file (a new
//! file renamed over the old, [`crate::util::write_atomic`]) on the test's runtime thread,
//! under its state lock, before it sends and after it stores. On this machine's disk (ext4,
//! mounted with `discard`, beside the clusters of three other tests) such a write once took
//! 2,275 ms: every client of the test stood still with it, the frames that arrived meanwhile
//! were recorded 2.3 s late, and the checker rightly read sweep hints 2,278 ms apart as
//! `d5-sweep-late` (`make flake` at dc5145d, `im06_lost_push_swept`; the gateway had sent
//! them every 500 ms). Another time a send's outbox write took 167 ms before the request
//! left. The files need to survive a crash of the client, never a power loss (the module
//! doc of `client/state_file.rs`), so a RAM file system loses nothing they promise.
//!
//! A kept work directory (a failed check, `IMFAULT_KEEP=1`) gets the files themselves in
//! place of the link ([`settle`]); a removed one takes its RAM directory with it.
//! `IMFAULT_CLIENTS_IN_RAM=0` keeps them on disk.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::Context as _;

/// The RAM file system the clients' directories go to (and, under cargo-nextest, the
/// work directories themselves: `pg::work_base`).
pub(crate) const RAM_FS: &str = "/dev/shm";
/// Room the RAM file system must have left for a new clients' directory.
const RAM_FREE_MIN: u64 = 1 << 30;
/// Name prefix of a clients' directory on the RAM file system: the id of the process that
/// made it, a dash and the work directory's name follow.
const PREFIX: &str = "imfault-clients-";

/// Makes `work_dir/clients` (see the module doc) and returns it.
pub fn make(work_dir: &Path) -> anyhow::Result<PathBuf> {
    let link = work_dir.join("clients");
    match ram_dir_for(work_dir) {
        Some(target) => {
            remove_orphans();
            fs::create_dir_all(&target).with_context(|| format!("create {}", target.display()))?;
            std::os::unix::fs::symlink(&target, &link)
                .with_context(|| format!("link {} to {}", link.display(), target.display()))?;
        }
        None => {
            fs::create_dir_all(&link).with_context(|| format!("create {}", link.display()))?;
        }
    }
    Ok(link)
}

/// Before `work_dir` is kept (`keep`) or removed: its clients' files copied from the RAM
/// file system into it in place of the link, when kept; the RAM directory removed either
/// way. Best effort (a drop cannot fail): what goes wrong is printed.
pub fn settle(work_dir: &Path, keep: bool) {
    let link = work_dir.join("clients");
    let Ok(target) = fs::read_link(&link) else {
        return;
    };
    if keep {
        let copied = fs::remove_file(&link)
            .map_err(anyhow::Error::from)
            .and_then(|()| copy_dir(&target, &link));
        if let Err(e) = copied {
            eprintln!(
                "imfault: could not keep the clients' files of {} ({}): {e:#}",
                work_dir.display(),
                target.display()
            );
            return;
        }
    }
    if let Err(e) = fs::remove_dir_all(&target) {
        if e.kind() != std::io::ErrorKind::NotFound {
            eprintln!("imfault: could not remove {}: {e}", target.display());
        }
    }
}

/// The RAM directory for `work_dir`'s clients, if they go to RAM.
fn ram_dir_for(work_dir: &Path) -> Option<PathBuf> {
    if std::env::var("IMFAULT_CLIENTS_IN_RAM").is_ok_and(|v| v == "0")
        || crate::util::file_system_of(work_dir) == "tmpfs"
    {
        return None;
    }
    let name = work_dir.file_name()?.to_str()?;
    let pid = std::process::id();
    crate::util::has_room(Path::new(RAM_FS), RAM_FREE_MIN)
        .then(|| Path::new(RAM_FS).join(format!("{PREFIX}{pid}-{name}")))
}

/// Removes the RAM directories whose process is gone (killed before its drops ran): they
/// would hold memory for ever. A process id used again keeps its predecessor's directory
/// until that one is gone too, which is harmless.
fn remove_orphans() {
    let Ok(entries) = fs::read_dir(RAM_FS) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<i32>().ok())
        else {
            continue;
        };
        let gone = matches!(
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
            Err(nix::errno::Errno::ESRCH)
        );
        if gone {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

/// Copies the directory `from` (its files and subdirectories) to `to`, made here.
fn copy_dir(from: &Path, to: &Path) -> anyhow::Result<()> {
    fs::create_dir_all(to).with_context(|| format!("create {}", to.display()))?;
    for e in fs::read_dir(from).with_context(|| format!("list {}", from.display()))? {
        let e = e?;
        let dest = to.join(e.file_name());
        if e.file_type()?.is_dir() {
            copy_dir(&e.path(), &dest)?;
        } else {
            fs::copy(e.path(), &dest)
                .with_context(|| format!("copy {} to {}", e.path().display(), dest.display()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The files a client wrote reach a kept work directory as files (no link into RAM
    /// left behind), and the RAM directory is gone whether the work directory is kept or
    /// not.
    #[test]
    fn a_kept_work_dir_gets_the_files_and_ram_is_freed_either_way() {
        for keep in [true, false] {
            let work = tempfile::Builder::new()
                .prefix("imfault-client-files-test-")
                .tempdir_in(std::env::temp_dir())
                .unwrap();
            let link = make(work.path()).unwrap();
            std::fs::write(link.join("a1.json"), b"{}").unwrap();
            let ram = fs::read_link(&link).ok();
            settle(work.path(), keep);
            if let Some(ram) = &ram {
                assert!(ram.starts_with(RAM_FS), "{}", ram.display());
                assert!(!ram.exists(), "{} is left in RAM", ram.display());
            }
            let kept = link.join("a1.json");
            if keep || ram.is_none() {
                assert!(fs::symlink_metadata(&link).unwrap().is_dir());
                assert_eq!(fs::read(&kept).unwrap(), b"{}");
            } else {
                assert!(!kept.exists());
            }
        }
    }

    /// A RAM directory whose process is gone is removed when another is made; one whose
    /// process lives stays.
    #[test]
    fn orphans_of_dead_processes_are_removed_and_the_living_keep_theirs() {
        if !Path::new(RAM_FS).is_dir() {
            return;
        }
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let orphan = Path::new(RAM_FS).join(format!("{PREFIX}{dead}-imfault-orphan-test"));
        let mine = Path::new(RAM_FS).join(format!(
            "{PREFIX}{}-imfault-living-test",
            std::process::id()
        ));
        for d in [&orphan, &mine] {
            fs::create_dir_all(d).unwrap();
        }
        remove_orphans();
        assert!(!orphan.exists(), "{} stayed", orphan.display());
        assert!(mine.exists(), "{} was removed", mine.display());
        fs::remove_dir_all(&mine).unwrap();
    }
}
