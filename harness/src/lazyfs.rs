//! A FUSE layer that forgets unsynced writes (LazyFS semantics, issue 11): the power cut.
//!
//! Owns: one mount of a backing directory (the "disk") at a mountpoint, served by a
//! [`fuser`] session thread of this process; a page cache (4 KiB pages) that holds every
//! written byte until `fsync`/`fdatasync` of that file reaches it; and the power cut, which
//! throws that cache away, unmounts (so the kernel's own page cache of the mount goes too)
//! and mounts again over what the backing directory holds.
//!
//! Must not: kill processes (the cluster owning the data does that before a cut), or
//! block a tokio worker (mounting and unmounting are blocking: call them from
//! `spawn_blocking` or a test's own thread).
//!
//! What reaches the "disk" and what does not (decided here, documented in evidence/README.md):
//! - File data: only through `fsync`/`fdatasync` of the file (either, LazyFS does the same),
//!   a write through a handle opened with `O_SYNC`/`O_DSYNC`, or a writeback when the cache
//!   passes [`CACHE_PAGES_MAX`] (the file with the most cached pages is written back, as a
//!   kernel would under memory pressure; counted in [`Stats::writebacks`]).
//! - `sync_file_range` is not a barrier: it never reaches a FUSE filesystem, and PostgreSQL
//!   uses it only as a writeback hint.
//! - Metadata (create, mkdir, unlink, rename, truncate, chmod, chown) goes to the backing
//!   directory at once, as a journalling file system that orders metadata would keep it;
//!   the cut loses data, not names. A file created and written but never synced comes back
//!   with its size on the backing directory (0 when never synced).
//! - No torn writes by default: a synced page is written whole. A power cut with
//!   `torn: true` ([`LazyFs::power_cut_with`]) writes the first half (four 512-byte sectors)
//!   of the last page written and not synced before it forgets the rest: a write the power
//!   cut caught half done.
//! - `fsync` of the layer copies the pages into the backing files without a real `fsync`:
//!   the machine does not lose power, only the layer pretends to.
//!
//! Disk faults (issue 21, [`DiskFaults`], switched while the layer runs with
//! [`LazyFs::set_faults`]; a power cut clears them, as a new boot would):
//! - `fsync_eio`: `fsync`/`fdatasync` (and a write through an `O_SYNC` handle) fail with
//!   `EIO`, and the file's unsynced pages are thrown away, as Linux marks the pages of a
//!   failed writeback clean ("fsyncgate"): a retried `fsync` then succeeds without the data.
//!   PostgreSQL must PANIC on the first failure, not retry.
//! - `enospc`: a write that would extend a file fails with `ENOSPC` (a full disk; writes
//!   inside a file's size still succeed, as on a real file system with its blocks
//!   allocated).
//! - `fsync_delay_ms`: every `fsync` is answered that much later (a slow disk), on a thread
//!   of its own, so reads and writes of the layer go on meanwhile.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{DirEntryExt, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner,
    MountOption, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, SessionACL, TimeOrNow,
    WriteFlags,
};
use nix::mount::MntFlags;
use nix::sys::time::TimeSpec;

/// Page size of the layer's cache.
const PAGE: u64 = 4096;
/// At most this many cached pages (64 MiB); past it the file with the most pages is
/// written back to the backing directory.
pub const CACHE_PAGES_MAX: usize = 16 * 1024;
/// How long the kernel may cache attributes and names: the kernel's own writes keep its
/// view of sizes current, and a power cut remounts (dropping everything the kernel cached).
const TTL: Duration = Duration::from_secs(1);
/// Attempts at unmounting while the last closes drain.
const UMOUNT_ATTEMPTS: u32 = 50;

/// Counters of one layer, across power cuts (all monotonic).
#[derive(Debug, Default)]
pub struct Stats {
    /// `write` requests served.
    pub writes: AtomicU64,
    /// Bytes written by them (into the cache).
    pub bytes_written: AtomicU64,
    /// `fsync`/`fdatasync` requests served (each a durability barrier for one file).
    pub fsyncs: AtomicU64,
    /// Pages written to the backing directory by a sync, an `O_SYNC` write or a writeback.
    pub pages_synced: AtomicU64,
    /// Writebacks forced by [`CACHE_PAGES_MAX`].
    pub writebacks: AtomicU64,
    /// Power cuts.
    pub power_cuts: AtomicU64,
    /// Pages (written, never synced) thrown away by the power cuts.
    pub pages_dropped: AtomicU64,
    /// Files that had unsynced pages at a power cut.
    pub files_dropped: AtomicU64,
    /// `fsync`s (and `O_SYNC` writes) failed with `EIO` by [`DiskFaults::fsync_eio`].
    pub fsync_errors: AtomicU64,
    /// Pages thrown away by those failures.
    pub pages_dropped_by_fsync_errors: AtomicU64,
    /// Writes failed with `ENOSPC` by [`DiskFaults::enospc`].
    pub enospc_errors: AtomicU64,
    /// `fsync`s answered late by [`DiskFaults::fsync_delay_ms`].
    pub fsyncs_delayed: AtomicU64,
    /// Pages half written by torn power cuts.
    pub pages_torn: AtomicU64,
}

impl Stats {
    /// A JSON snapshot for evidence.
    pub fn snapshot(&self) -> serde_json::Value {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        serde_json::json!({
            "writes": g(&self.writes),
            "bytes_written": g(&self.bytes_written),
            "fsyncs": g(&self.fsyncs),
            "pages_synced": g(&self.pages_synced),
            "writebacks": g(&self.writebacks),
            "power_cuts": g(&self.power_cuts),
            "pages_dropped": g(&self.pages_dropped),
            "files_dropped": g(&self.files_dropped),
            "fsync_errors": g(&self.fsync_errors),
            "pages_dropped_by_fsync_errors": g(&self.pages_dropped_by_fsync_errors),
            "enospc_errors": g(&self.enospc_errors),
            "fsyncs_delayed": g(&self.fsyncs_delayed),
            "pages_torn": g(&self.pages_torn),
        })
    }
}

/// What one power cut threw away.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Cut {
    /// Unsynced pages dropped.
    pub pages_dropped: u64,
    /// Files they belonged to.
    pub files_dropped: u64,
    /// Pages half written instead (a torn cut: 0 or 1).
    pub pages_torn: u64,
}

/// Disk faults in force on the layer (see the module's documentation). The default is none.
/// One type with the history's `disk-fault` lines, which record it: defined beside them, in
/// the judge's crate (`im_check::history`), which depends on nothing of the harness.
pub use im_check::history::DiskFaults;

/// The bytes of a page a torn cut writes: the first four 512-byte sectors.
const TORN_BYTES: u64 = PAGE / 2;

/// A mounted layer. Dropping it unmounts (the processes using the mount must be gone).
pub struct LazyFs {
    /// The "disk": what survives a power cut.
    backing: PathBuf,
    /// Where the layer is mounted.
    mountpoint: PathBuf,
    /// The running session; `None` between unmount and mount.
    session: Option<fuser::BackgroundSession>,
    /// The state the session serves, shared so a cut can drop and a settle can flush it.
    state: Arc<Mutex<State>>,
    /// Counters across cuts.
    stats: Arc<Stats>,
}

impl LazyFs {
    /// Whether this machine can mount the layer at all: `/dev/fuse` must open read-write.
    /// `Err` carries the reason (for a `NOT_RUN` record).
    pub fn available() -> Result<(), String> {
        match OpenOptions::new().read(true).write(true).open("/dev/fuse") {
            Ok(_) => Ok(()),
            Err(e) => Err(format!("cannot open /dev/fuse: {e}")),
        }
    }

    /// Mounts `backing` at `mountpoint` (an empty directory). Blocking.
    pub fn mount(backing: &Path, mountpoint: &Path) -> anyhow::Result<LazyFs> {
        let stats = Arc::new(Stats::default());
        let state = Arc::new(Mutex::new(State::new(backing, stats.clone())?));
        let mut fs = LazyFs {
            backing: backing.to_path_buf(),
            mountpoint: mountpoint.to_path_buf(),
            session: None,
            state,
            stats,
        };
        fs.spawn_session()?;
        Ok(fs)
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    /// Pages written and not yet synced.
    pub fn unsynced_pages(&self) -> usize {
        lock(&self.state).cached_pages
    }

    /// Writes every cached page to the backing directory, as if the kernel had written
    /// back everything dirty (`sync(1)`). Used once after set-up, so a cut loses the run's
    /// unsynced writes, not the set-up's.
    pub fn settle(&self) -> anyhow::Result<()> {
        let mut st = lock(&self.state);
        let inos: Vec<u64> = st.caches.keys().copied().collect();
        for ino in inos {
            st.flush(ino).context("settle: write back")?;
        }
        Ok(())
    }

    /// The disk faults in force from now on (replacing the previous ones).
    pub fn set_faults(&self, faults: DiskFaults) {
        lock(&self.state).faults = faults;
    }

    /// The disk faults in force.
    pub fn faults(&self) -> DiskFaults {
        lock(&self.state).faults
    }

    /// The power cut: throws away every unsynced write, unmounts (the kernel forgets its
    /// page cache of the mount) and mounts again on what the backing directory holds.
    /// Every process using the mount must already be dead. Blocking.
    pub fn power_cut(&mut self) -> anyhow::Result<Cut> {
        self.power_cut_with(false)
    }

    /// [`LazyFs::power_cut`]; with `torn`, the last page written and not synced is first
    /// half written to the backing file (a write the cut caught half done).
    pub fn power_cut_with(&mut self, torn: bool) -> anyhow::Result<Cut> {
        let cut = {
            let mut st = lock(&self.state);
            let pages_torn = if torn { st.tear_last_page()? } else { 0 };
            let cut = Cut {
                pages_dropped: st.cached_pages as u64 - pages_torn,
                files_dropped: st.caches.len() as u64,
                pages_torn,
            };
            st.caches.clear();
            st.cached_pages = 0;
            st.handles.clear();
            cut
        };
        self.stats.power_cuts.fetch_add(1, Ordering::Relaxed);
        self.stats
            .pages_dropped
            .fetch_add(cut.pages_dropped, Ordering::Relaxed);
        self.stats
            .files_dropped
            .fetch_add(cut.files_dropped, Ordering::Relaxed);
        self.stats
            .pages_torn
            .fetch_add(cut.pages_torn, Ordering::Relaxed);
        self.unmount()?;
        self.state = Arc::new(Mutex::new(State::new(&self.backing, self.stats.clone())?));
        self.spawn_session()?;
        Ok(cut)
    }

    fn spawn_session(&mut self) -> anyhow::Result<()> {
        let mut config = fuser::Config::default();
        config.mount_options = vec![
            MountOption::FSName("imfault-lazyfs".into()),
            MountOption::Subtype("lazyfs".into()),
            // The kernel checks permissions from the attributes we report (the backing
            // files' owners and modes), so the postgres user sees what it would see on the
            // backing directory.
            MountOption::DefaultPermissions,
        ];
        // allow_other: the postmaster runs as another user than the mounter.
        config.acl = SessionACL::All;
        config.n_threads = Some(1);
        let fs = Fs {
            state: self.state.clone(),
        };
        let session = fuser::spawn_mount(fs, &self.mountpoint, &config)
            .with_context(|| format!("mount the lazyfs layer at {}", self.mountpoint.display()))?;
        self.session = Some(session);
        Ok(())
    }

    fn unmount(&mut self) -> anyhow::Result<()> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        // Our own umount: a busy mount (a process still closing) is retried, then detached.
        let path = self.mountpoint.as_path();
        let mut last = None;
        for _ in 0..UMOUNT_ATTEMPTS {
            match nix::mount::umount2(path, MntFlags::empty()) {
                // Done, or not mounted (any more).
                Ok(()) | Err(nix::errno::Errno::EINVAL) => {
                    last = None;
                    break;
                }
                Err(e) => last = Some(std::io::Error::from(e)),
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some(e) = last {
            let _ = nix::mount::umount2(path, MntFlags::MNT_DETACH);
            drop(session);
            bail!("unmount {}: {e} (detached)", self.mountpoint.display());
        }
        // The kernel ended the connection: the session thread returns.
        session
            .join()
            .with_context(|| format!("join the lazyfs session of {}", self.mountpoint.display()))
    }
}

impl Drop for LazyFs {
    fn drop(&mut self) {
        if let Err(e) = self.unmount() {
            eprintln!("imfault: lazyfs: {e:#}");
        }
    }
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

/// The session's filesystem: every request locks the state (one session thread anyway).
struct Fs {
    state: Arc<Mutex<State>>,
}

/// One open file.
struct Handle {
    ino: u64,
    file: Arc<File>,
    /// Opened with O_SYNC or O_DSYNC: every write is synced.
    sync: bool,
}

/// The unsynced pages of one file.
struct FileCache {
    /// Where a sync writes them (a handle that may outlive the name).
    file: Arc<File>,
    pages: BTreeMap<u64, Box<[u8]>>,
    /// The file's size as its users see it (cached writes may extend the backing file).
    size: u64,
    /// The last write into this cache: (the layer's write count then, its last page).
    last: (u64, u64),
}

struct State {
    backing: PathBuf,
    /// The backing root's inode number: reported as FUSE inode 1.
    root_st_ino: u64,
    /// FUSE inode -> path relative to the backing root (the last name it was seen under).
    paths: HashMap<u64, PathBuf>,
    handles: HashMap<u64, Handle>,
    next_fh: u64,
    caches: HashMap<u64, FileCache>,
    cached_pages: usize,
    stats: Arc<Stats>,
    /// The disk faults in force.
    faults: DiskFaults,
    /// Writes into the cache so far (orders [`FileCache::last`]).
    write_count: u64,
}

fn errno(e: &std::io::Error) -> Errno {
    Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))
}

/// `Ok` or the reply's error, as `?` inside the request handlers.
type R<T> = Result<T, Errno>;

fn io<T>(r: std::io::Result<T>) -> R<T> {
    r.map_err(|e| errno(&e))
}

impl State {
    fn new(backing: &Path, stats: Arc<Stats>) -> anyhow::Result<State> {
        let md = fs::metadata(backing).with_context(|| format!("stat {}", backing.display()))?;
        let mut paths = HashMap::new();
        paths.insert(1, PathBuf::new());
        Ok(State {
            backing: backing.to_path_buf(),
            root_st_ino: md.ino(),
            paths,
            handles: HashMap::new(),
            next_fh: 1,
            caches: HashMap::new(),
            cached_pages: 0,
            stats,
            faults: DiskFaults::default(),
            write_count: 0,
        })
    }

    /// A torn cut: the first [`TORN_BYTES`] of the last page written among those still
    /// unsynced reach the backing file. Returns the pages torn (0 when none is unsynced).
    fn tear_last_page(&mut self) -> std::io::Result<u64> {
        let Some(c) = self.caches.values().max_by_key(|c| c.last.0) else {
            return Ok(0);
        };
        let pno = c.last.1;
        let Some(page) = c.pages.get(&pno) else {
            return Ok(0);
        };
        let start = pno * PAGE;
        let n = c.size.saturating_sub(start).min(TORN_BYTES) as usize;
        if n == 0 {
            return Ok(0);
        }
        c.file.write_all_at(&page[..n], start)?;
        Ok(1)
    }

    /// `fsync` of one file under the disk faults: `EIO` (the unsynced pages thrown away)
    /// under [`DiskFaults::fsync_eio`], else the pages written to the backing file.
    fn sync_file(&mut self, ino: u64) -> std::io::Result<()> {
        if self.faults.fsync_eio {
            self.stats.fsync_errors.fetch_add(1, Ordering::Relaxed);
            if let Some(c) = self.caches.remove(&ino) {
                self.cached_pages -= c.pages.len();
                self.stats
                    .pages_dropped_by_fsync_errors
                    .fetch_add(c.pages.len() as u64, Ordering::Relaxed);
            }
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        self.flush(ino)
    }

    /// FUSE inode numbers are the backing inode numbers, with the root's swapped with 1.
    fn fuse_ino(&self, st_ino: u64) -> u64 {
        if st_ino == self.root_st_ino {
            1
        } else if st_ino == 1 {
            self.root_st_ino
        } else {
            st_ino
        }
    }

    fn rel(&self, ino: u64) -> R<PathBuf> {
        self.paths.get(&ino).cloned().ok_or(Errno::ENOENT)
    }

    fn abs(&self, rel: &Path) -> PathBuf {
        if rel.as_os_str().is_empty() {
            self.backing.clone()
        } else {
            self.backing.join(rel)
        }
    }

    fn attr(&self, ino: u64, md: &fs::Metadata) -> FileAttr {
        let t = |s: i64, ns: i64| {
            if s >= 0 {
                UNIX_EPOCH + Duration::new(s as u64, ns as u32)
            } else {
                UNIX_EPOCH
            }
        };
        let ft = md.file_type();
        use std::os::unix::fs::FileTypeExt;
        let kind = if ft.is_dir() {
            FileType::Directory
        } else if ft.is_symlink() {
            FileType::Symlink
        } else if ft.is_fifo() {
            FileType::NamedPipe
        } else if ft.is_socket() {
            FileType::Socket
        } else if ft.is_char_device() {
            FileType::CharDevice
        } else if ft.is_block_device() {
            FileType::BlockDevice
        } else {
            FileType::RegularFile
        };
        let size = self.caches.get(&ino).map_or(md.len(), |c| c.size);
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: md.blocks().max(size.div_ceil(512)),
            atime: t(md.atime(), md.atime_nsec()),
            mtime: t(md.mtime(), md.mtime_nsec()),
            ctime: t(md.ctime(), md.ctime_nsec()),
            crtime: UNIX_EPOCH,
            kind,
            perm: (md.mode() & 0o7777) as u16,
            nlink: md.nlink() as u32,
            uid: md.uid(),
            gid: md.gid(),
            rdev: md.rdev() as u32,
            blksize: PAGE as u32,
            flags: 0,
        }
    }

    /// lstat of `rel`, registering its inode under that name.
    fn lookup_rel(&mut self, rel: PathBuf) -> R<FileAttr> {
        let md = io(fs::symlink_metadata(self.abs(&rel)))?;
        let ino = self.fuse_ino(md.ino());
        self.paths.insert(ino, rel);
        Ok(self.attr(ino, &md))
    }

    fn getattr(&self, ino: u64, fh: Option<u64>) -> R<FileAttr> {
        if let Some(h) = fh.and_then(|fh| self.handles.get(&fh)) {
            let md = io(h.file.metadata())?;
            return Ok(self.attr(ino, &md));
        }
        let md = io(fs::symlink_metadata(self.abs(&self.rel(ino)?)))?;
        Ok(self.attr(ino, &md))
    }

    fn child(&self, parent: u64, name: &OsStr) -> R<PathBuf> {
        Ok(self.rel(parent)?.join(name))
    }

    fn chown(&self, path: &Path, req: &Request) -> R<()> {
        io(std::os::unix::fs::lchown(
            path,
            Some(req.uid()),
            Some(req.gid()),
        ))
    }

    fn new_handle(&mut self, ino: u64, file: File, flags: i32) -> u64 {
        let fh = self.next_fh;
        self.next_fh += 1;
        let sync = flags & (libc::O_SYNC | libc::O_DSYNC) != 0;
        self.handles.insert(
            fh,
            Handle {
                ino,
                file: Arc::new(file),
                sync,
            },
        );
        fh
    }

    /// Drops the cache of an inode whose last name is gone and that no handle holds.
    fn forget_if_orphan(&mut self, ino: u64, nlink_left: u64) {
        if nlink_left == 0 && !self.handles.values().any(|h| h.ino == ino) {
            if let Some(c) = self.caches.remove(&ino) {
                self.cached_pages -= c.pages.len();
            }
            self.paths.remove(&ino);
        }
    }

    fn cache(&mut self, ino: u64, file: &Arc<File>) -> std::io::Result<&mut FileCache> {
        Ok(match self.caches.entry(ino) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let size = file.metadata()?.len();
                e.insert(FileCache {
                    file: file.clone(),
                    pages: BTreeMap::new(),
                    size,
                    last: (0, 0),
                })
            }
        })
    }

    fn write(
        &mut self,
        ino: u64,
        file: &Arc<File>,
        offset: u64,
        data: &[u8],
    ) -> std::io::Result<()> {
        let end = offset + data.len() as u64;
        if self.faults.enospc {
            let size = match self.caches.get(&ino) {
                Some(c) => c.size,
                None => file.metadata()?.len(),
            };
            if end > size {
                self.stats.enospc_errors.fetch_add(1, Ordering::Relaxed);
                return Err(std::io::Error::from_raw_os_error(libc::ENOSPC));
            }
        }
        let mut added = 0;
        {
            let c = self.cache(ino, file)?;
            let mut pos = offset;
            while pos < end {
                let pno = pos / PAGE;
                let in_page = (pos % PAGE) as usize;
                let n = ((PAGE - pos % PAGE).min(end - pos)) as usize;
                let page = match c.pages.entry(pno) {
                    std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::btree_map::Entry::Vacant(e) => {
                        let mut buf = vec![0u8; PAGE as usize].into_boxed_slice();
                        if n < PAGE as usize && pno * PAGE < c.size {
                            // A partial page: what the file holds around the write.
                            read_full_at(&c.file, &mut buf, pno * PAGE)?;
                            let valid = (c.size - pno * PAGE).min(PAGE) as usize;
                            buf[valid..].fill(0);
                        }
                        added += 1;
                        e.insert(buf)
                    }
                };
                let from = (pos - offset) as usize;
                page[in_page..in_page + n].copy_from_slice(&data[from..from + n]);
                pos += n as u64;
            }
            c.size = c.size.max(end);
        }
        self.write_count += 1;
        if !data.is_empty() {
            let count = self.write_count;
            if let Some(c) = self.caches.get_mut(&ino) {
                c.last = (count, (end - 1) / PAGE);
            }
        }
        self.cached_pages += added;
        self.stats.writes.fetch_add(1, Ordering::Relaxed);
        self.stats
            .bytes_written
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        if self.cached_pages > CACHE_PAGES_MAX {
            let biggest = self
                .caches
                .iter()
                .max_by_key(|(_, c)| c.pages.len())
                .map(|(i, _)| *i);
            if let Some(victim) = biggest {
                self.flush(victim)?;
                self.stats.writebacks.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    fn read(&self, ino: u64, file: &File, offset: u64, size: u32) -> std::io::Result<Vec<u8>> {
        let cache = self.caches.get(&ino);
        let len = match cache {
            Some(c) => c.size,
            None => file.metadata()?.len(),
        };
        if offset >= len {
            return Ok(Vec::new());
        }
        let end = (offset + u64::from(size)).min(len);
        let mut buf = vec![0u8; (end - offset) as usize];
        read_full_at(file, &mut buf, offset)?;
        if let Some(c) = cache {
            for (pno, page) in c.pages.range(offset / PAGE..=(end - 1) / PAGE) {
                let p0 = pno * PAGE;
                let from = p0.max(offset);
                let to = (p0 + PAGE).min(end);
                buf[(from - offset) as usize..(to - offset) as usize]
                    .copy_from_slice(&page[(from - p0) as usize..(to - p0) as usize]);
            }
        }
        Ok(buf)
    }

    /// Writes a file's cached pages to the backing file (the durability barrier).
    fn flush(&mut self, ino: u64) -> std::io::Result<()> {
        let Some(c) = self.caches.remove(&ino) else {
            return Ok(());
        };
        self.cached_pages -= c.pages.len();
        let mut n_pages = 0;
        for (pno, page) in &c.pages {
            let start = pno * PAGE;
            if start >= c.size {
                continue;
            }
            let n = (c.size - start).min(PAGE) as usize;
            c.file.write_all_at(&page[..n], start)?;
            n_pages += 1;
        }
        if c.file.metadata()?.len() < c.size {
            c.file.set_len(c.size)?;
        }
        self.stats
            .pages_synced
            .fetch_add(n_pages, Ordering::Relaxed);
        Ok(())
    }

    /// A truncate already applied to the backing file: the cache follows it.
    fn truncate_cache(&mut self, ino: u64, size: u64) {
        let Some(c) = self.caches.get_mut(&ino) else {
            return;
        };
        let first_gone = size.div_ceil(PAGE);
        let gone: Vec<u64> = c.pages.range(first_gone..).map(|(p, _)| *p).collect();
        for p in &gone {
            c.pages.remove(p);
        }
        if !size.is_multiple_of(PAGE) {
            if let Some(page) = c.pages.get_mut(&(size / PAGE)) {
                page[(size % PAGE) as usize..].fill(0);
            }
        }
        c.size = size;
        self.cached_pages -= gone.len();
    }

    fn open_backing(&self, path: &Path, flags: i32) -> std::io::Result<File> {
        // Always read-write when the file allows it (we are the mounter; the kernel has
        // checked the caller's permissions): a later sync writes through this handle.
        let custom = flags & (libc::O_NOFOLLOW | libc::O_NOATIME);
        match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(custom)
            .open(path)
        {
            Ok(f) => Ok(f),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EACCES | libc::EROFS | libc::EISDIR | libc::ETXTBSY)
                ) =>
            {
                OpenOptions::new()
                    .read(true)
                    .custom_flags(custom)
                    .open(path)
            }
            Err(e) => Err(e),
        }
    }
}

fn read_full_at(file: &File, buf: &mut [u8], mut offset: u64) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset) {
            Ok(0) => break, // past the end: the rest stays zero
            Ok(n) => {
                done += n;
                offset += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn set_times(path: &Path, atime: Option<TimeOrNow>, mtime: Option<TimeOrNow>) -> R<()> {
    if atime.is_none() && mtime.is_none() {
        return Ok(());
    }
    let ts = |t: Option<TimeOrNow>| match t {
        None => TimeSpec::UTIME_OMIT,
        Some(TimeOrNow::Now) => TimeSpec::UTIME_NOW,
        Some(TimeOrNow::SpecificTime(t)) => {
            TimeSpec::from_duration(t.duration_since(UNIX_EPOCH).unwrap_or_default())
        }
    };
    nix::sys::stat::utimensat(
        nix::fcntl::AT_FDCWD,
        path,
        &ts(atime),
        &ts(mtime),
        nix::sys::stat::UtimensatFlags::NoFollowSymlink,
    )
    .map_err(|e| errno(&std::io::Error::from(e)))
}

impl Fs {
    fn st(&self) -> std::sync::MutexGuard<'_, State> {
        lock(&self.state)
    }
}

impl Filesystem for Fs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let mut st = self.st();
        match st.child(parent.0, name).and_then(|p| st.lookup_rel(p)) {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.st().getattr(ino.0, fh.map(|f| f.0)) {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let mut st = self.st();
        let r = (|| -> R<FileAttr> {
            let path = st.abs(&st.rel(ino.0)?);
            if let Some(mode) = mode {
                io(fs::set_permissions(
                    &path,
                    fs::Permissions::from_mode(mode & 0o7777),
                ))?;
            }
            if uid.is_some() || gid.is_some() {
                io(std::os::unix::fs::lchown(&path, uid, gid))?;
            }
            if let Some(size) = size {
                let file = match fh.and_then(|f| st.handles.get(&f.0)) {
                    Some(h) => h.file.clone(),
                    None => Arc::new(io(OpenOptions::new().write(true).open(&path))?),
                };
                io(file.set_len(size))?;
                st.truncate_cache(ino.0, size);
            }
            set_times(&path, atime, mtime)?;
            st.getattr(ino.0, fh.map(|f| f.0))
        })();
        match r {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let st = self.st();
        match st.rel(ino.0).and_then(|p| io(fs::read_link(st.abs(&p)))) {
            Ok(t) => reply.data(t.as_os_str().as_encoded_bytes()),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let mut st = self.st();
        let r = (|| -> R<FileAttr> {
            let rel = st.child(parent.0, name)?;
            let path = st.abs(&rel);
            io(fs::create_dir(&path))?;
            io(fs::set_permissions(
                &path,
                fs::Permissions::from_mode(mode & !umask & 0o7777),
            ))?;
            st.chown(&path, req)?;
            st.lookup_rel(rel)
        })();
        match r {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut st = self.st();
        let r = (|| -> R<()> {
            let rel = st.child(parent.0, name)?;
            let path = st.abs(&rel);
            let md = io(fs::symlink_metadata(&path))?;
            io(fs::remove_file(&path))?;
            let ino = st.fuse_ino(md.ino());
            if st.paths.get(&ino) == Some(&rel) {
                st.paths.remove(&ino);
            }
            st.forget_if_orphan(ino, md.nlink().saturating_sub(1));
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut st = self.st();
        let r = (|| -> R<()> {
            let rel = st.child(parent.0, name)?;
            let path = st.abs(&rel);
            let md = io(fs::symlink_metadata(&path))?;
            io(fs::remove_dir(&path))?;
            let ino = st.fuse_ino(md.ino());
            st.paths.remove(&ino);
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let mut st = self.st();
        let r = (|| -> R<FileAttr> {
            let rel = st.child(parent.0, link_name)?;
            let path = st.abs(&rel);
            io(std::os::unix::fs::symlink(target, &path))?;
            st.chown(&path, req)?;
            st.lookup_rel(rel)
        })();
        match r {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let mut st = self.st();
        let r = (|| -> R<()> {
            if !flags.is_empty() {
                return Err(Errno::EINVAL);
            }
            let from = st.child(parent.0, name)?;
            let to = st.child(newparent.0, newname)?;
            let replaced = fs::symlink_metadata(st.abs(&to)).ok();
            io(fs::rename(st.abs(&from), st.abs(&to)))?;
            if let Some(md) = replaced {
                let ino = st.fuse_ino(md.ino());
                if st.paths.get(&ino) == Some(&to) {
                    st.paths.remove(&ino);
                }
                if !md.is_dir() {
                    st.forget_if_orphan(ino, md.nlink().saturating_sub(1));
                }
            }
            for p in st.paths.values_mut() {
                if let Ok(rest) = p.strip_prefix(&from) {
                    *p = if rest.as_os_str().is_empty() {
                        to.clone()
                    } else {
                        to.join(rest)
                    };
                }
            }
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let mut st = self.st();
        let r = (|| -> R<FileAttr> {
            let from = st.abs(&st.rel(ino.0)?);
            let rel = st.child(newparent.0, newname)?;
            io(fs::hard_link(from, st.abs(&rel)))?;
            st.lookup_rel(rel)
        })();
        match r {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let mut st = self.st();
        let r = (|| -> R<u64> {
            let path = st.abs(&st.rel(ino.0)?);
            let file = io(st.open_backing(&path, flags.0))?;
            if flags.0 & libc::O_TRUNC != 0 {
                io(file.set_len(0))?;
                st.truncate_cache(ino.0, 0);
            }
            Ok(st.new_handle(ino.0, file, flags.0))
        })();
        match r {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let st = self.st();
        let Some(h) = st.handles.get(&fh.0) else {
            reply.error(Errno::EBADF);
            return;
        };
        match st.read(ino.0, &h.file, offset, size) {
            Ok(buf) => reply.data(&buf),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let mut st = self.st();
        let Some((file, sync)) = st.handles.get(&fh.0).map(|h| (h.file.clone(), h.sync)) else {
            reply.error(Errno::EBADF);
            return;
        };
        let r = st.write(ino.0, &file, offset, data).and_then(|()| {
            if sync {
                st.sync_file(ino.0)
            } else {
                Ok(())
            }
        });
        match r {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // close(2) is not a durability barrier.
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let mut st = self.st();
        if let Some(h) = st.handles.remove(&fh.0) {
            let nlink = h.file.metadata().map_or(1, |m| m.nlink());
            st.forget_if_orphan(ino.0, nlink);
        }
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let mut st = self.st();
        st.stats.fsyncs.fetch_add(1, Ordering::Relaxed);
        let delay = Duration::from_millis(st.faults.fsync_delay_ms);
        if delay.is_zero() {
            match st.sync_file(ino.0) {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
            return;
        }
        // A slow disk: answered later, from a thread of its own, so the session goes on
        // serving reads and writes meanwhile (writes in between are synced too: more
        // durable than asked, never less).
        st.stats.fsyncs_delayed.fetch_add(1, Ordering::Relaxed);
        drop(st);
        let state = self.state.clone();
        std::thread::spawn(move || {
            std::thread::sleep(delay);
            match lock(&state).sync_file(ino.0) {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let st = self.st();
        let r = (|| -> R<Vec<(u64, FileType, std::ffi::OsString)>> {
            let path = st.abs(&st.rel(ino.0)?);
            let mut out = vec![
                (ino.0, FileType::Directory, ".".into()),
                (ino.0, FileType::Directory, "..".into()),
            ];
            for e in io(fs::read_dir(&path))? {
                let e = io(e)?;
                let ft = io(e.file_type())?;
                let kind = if ft.is_dir() {
                    FileType::Directory
                } else if ft.is_symlink() {
                    FileType::Symlink
                } else {
                    FileType::RegularFile
                };
                out.push((st.fuse_ino(e.ino()), kind, e.file_name()));
            }
            Ok(out)
        })();
        match r {
            Ok(entries) => {
                for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize)
                {
                    if reply.add(INodeNo(ino), (i + 1) as u64, kind, &name) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(e),
        }
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        // Metadata is on the backing directory already.
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let st = self.st();
        let s = match nix::sys::statvfs::statvfs(st.backing.as_path()) {
            Ok(s) => s,
            Err(e) => {
                reply.error(errno(&std::io::Error::from(e)));
                return;
            }
        };
        reply.statfs(
            s.blocks(),
            s.blocks_free(),
            s.blocks_available(),
            s.files(),
            s.files_free(),
            s.block_size() as u32,
            s.name_max() as u32,
            s.fragment_size() as u32,
        );
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        // default_permissions: the kernel has checked.
        reply.ok();
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let mut st = self.st();
        let r = (|| -> R<(FileAttr, u64)> {
            let rel = st.child(parent.0, name)?;
            let path = st.abs(&rel);
            let mut o = OpenOptions::new();
            o.read(true).write(true).mode(mode & !umask & 0o7777);
            if flags & libc::O_EXCL != 0 {
                o.create_new(true);
            } else {
                o.create(true);
            }
            let file = io(o.open(&path))?;
            st.chown(&path, req)?;
            let attr = st.lookup_rel(rel)?;
            if flags & libc::O_TRUNC != 0 {
                io(file.set_len(0))?;
                st.truncate_cache(attr.ino.0, 0);
            }
            let fh = st.new_handle(attr.ino.0, file, flags);
            Ok((attr, fh))
        })();
        match r {
            Ok((a, fh)) => {
                reply.created(&TTL, &a, Generation(0), FileHandle(fh), FopenFlags::empty())
            }
            Err(e) => reply.error(e),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The page cache without a mount.

    use super::*;

    fn state() -> (tempfile::TempDir, State) {
        let d = tempfile::Builder::new()
            .prefix("imfault-lazyfs-unit-")
            .tempdir()
            .unwrap();
        let st = State::new(d.path(), Arc::new(Stats::default())).unwrap();
        (d, st)
    }

    /// Proves unsynced writes are visible to reads but not on the backing file until the
    /// file is synced, and that partial-page writes keep the bytes around them.
    #[test]
    fn writes_reach_the_backing_file_only_on_sync() {
        let (d, mut st) = state();
        let path = d.path().join("f");
        std::fs::write(&path, vec![b'a'; 5000]).unwrap();
        let file = Arc::new(
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .unwrap(),
        );
        st.write(7, &file, 4090, b"XYZXYZXYZXYZ").unwrap();
        st.write(7, &file, 9000, b"tail").unwrap();
        let seen = st.read(7, &file, 4088, 20).unwrap();
        assert_eq!(&seen, b"aaXYZXYZXYZXYZaaaaaa");
        assert_eq!(st.caches[&7].size, 9004);
        assert_eq!(std::fs::read(&path).unwrap(), vec![b'a'; 5000]);
        st.flush(7).unwrap();
        let disk = std::fs::read(&path).unwrap();
        assert_eq!(disk.len(), 9004);
        assert_eq!(&disk[4088..4104], b"aaXYZXYZXYZXYZaa");
        assert!(disk[5000..9000].iter().all(|b| *b == 0));
        assert_eq!(&disk[9000..], b"tail");
        assert_eq!(st.cached_pages, 0);
    }

    /// Proves a truncate drops the cached pages beyond it and zeroes the cut page.
    #[test]
    fn truncate_trims_the_cache() {
        let (d, mut st) = state();
        let path = d.path().join("g");
        std::fs::write(&path, b"").unwrap();
        let file = Arc::new(
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .unwrap(),
        );
        st.write(3, &file, 0, &[1u8; 10_000]).unwrap();
        assert_eq!(st.cached_pages, 3);
        file.set_len(100).unwrap();
        st.truncate_cache(3, 100);
        assert_eq!(st.cached_pages, 1);
        st.write(3, &file, 200, &[2u8; 4]).unwrap();
        let seen = st.read(3, &file, 0, 300).unwrap();
        assert_eq!(seen.len(), 204);
        assert!(seen[..100].iter().all(|b| *b == 1));
        assert!(seen[100..200].iter().all(|b| *b == 0));
    }

    fn open_rw(path: &Path) -> Arc<File> {
        Arc::new(
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)
                .unwrap(),
        )
    }

    /// Issue 21, fsyncgate: under `fsync_eio` the sync fails with EIO and the file's
    /// unsynced pages are gone (a retried sync succeeds and writes nothing of them); the
    /// backing file keeps what it had.
    #[test]
    fn a_failed_fsync_throws_the_unsynced_pages_away() {
        let (d, mut st) = state();
        let path = d.path().join("wal");
        std::fs::write(&path, vec![b'a'; 8192]).unwrap();
        let file = open_rw(&path);
        st.write(5, &file, 0, b"commit").unwrap();
        st.faults.fsync_eio = true;
        let e = st.sync_file(5).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
        assert_eq!(st.cached_pages, 0);
        assert_eq!(
            st.stats
                .pages_dropped_by_fsync_errors
                .load(Ordering::Relaxed),
            1
        );
        st.faults.fsync_eio = false;
        st.sync_file(5).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), vec![b'a'; 8192]);
        assert_eq!(st.read(5, &file, 0, 6).unwrap(), b"aaaaaa");
    }

    /// Issue 21, a full disk: a write that would extend the file fails with ENOSPC and
    /// changes nothing; a write inside its size succeeds; once space is back, it extends.
    #[test]
    fn a_full_disk_refuses_what_would_grow_a_file() {
        let (d, mut st) = state();
        let path = d.path().join("rel");
        std::fs::write(&path, vec![0u8; 100]).unwrap();
        let file = open_rw(&path);
        st.faults.enospc = true;
        let e = st.write(9, &file, 98, b"grow").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        assert_eq!(st.cached_pages, 0);
        st.write(9, &file, 10, b"in place").unwrap();
        assert_eq!(st.caches[&9].size, 100);
        let e = st.write(9, &file, 100, b"x").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        assert_eq!(st.stats.enospc_errors.load(Ordering::Relaxed), 2);
        st.faults.enospc = false;
        st.write(9, &file, 98, b"grow").unwrap();
        assert_eq!(st.caches[&9].size, 102);
    }

    /// Issue 21, a torn write: the cut writes the first half of the last page written and
    /// not synced, nothing of the others; a page synced since is not torn.
    #[test]
    fn a_torn_cut_half_writes_the_last_unsynced_page() {
        let (d, mut st) = state();
        let path = d.path().join("seg");
        std::fs::write(&path, vec![b'o'; 3 * PAGE as usize]).unwrap();
        let file = open_rw(&path);
        st.write(4, &file, 0, &[b'n'; PAGE as usize]).unwrap();
        st.write(4, &file, 2 * PAGE, &[b'N'; PAGE as usize])
            .unwrap();
        assert_eq!(st.tear_last_page().unwrap(), 1);
        let disk = std::fs::read(&path).unwrap();
        let p = PAGE as usize;
        assert!(
            disk[..p].iter().all(|b| *b == b'o'),
            "an earlier page is not torn"
        );
        assert!(disk[2 * p..2 * p + p / 2].iter().all(|b| *b == b'N'));
        assert!(disk[2 * p + p / 2..].iter().all(|b| *b == b'o'));
        // Synced since: the last unsynced page of another file is the victim, or none.
        st.flush(4).unwrap();
        assert_eq!(
            st.tear_last_page().unwrap(),
            0,
            "nothing unsynced: nothing to tear"
        );
        let other = d.path().join("rel");
        std::fs::write(&other, vec![b'o'; PAGE as usize]).unwrap();
        let of = open_rw(&other);
        st.write(6, &of, 0, &[b'r'; PAGE as usize]).unwrap();
        st.write(4, &file, 0, &[b'w'; 16]).unwrap();
        st.sync_file(4).unwrap();
        assert_eq!(st.tear_last_page().unwrap(), 1);
        let disk = std::fs::read(&other).unwrap();
        assert!(disk[..p / 2].iter().all(|b| *b == b'r'));
        assert!(disk[p / 2..].iter().all(|b| *b == b'o'));
    }
}
