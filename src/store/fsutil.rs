//! Filesystem questions and reservations the engine asks before and while writing: free space,
//! read-only mounts, preallocation and exclusive locks; letting go of a finished output's map
//! off the critical path; and the kernel's dirty-page limits, which decide how fast an output
//! much larger than RAM's share for dirty pages can be written (docs/PLAN.md, `durable`).
//!
//! Outputs written in place (a `run`'s, which a later run resumes) are opened here, by
//! [`open_in_place`]: never through a symbolic link, and a new one is always a new file.
//!
//! These go through `rustix`, whose safe wrappers replace hand-written `libc` calls and their
//! `unsafe` blocks (zeroed C structs, raw descriptors, `errno` reads).

use std::fs::File;
use std::io;
use std::path::Path;

use rustix::fs::{FallocateFlags, FlockOperation, StatVfsMountFlags};

use crate::error::{Error, Result};

/// How a file is named in the journal's identity of an input: its canonical path (symlinks and
/// `..` resolved), so that the same file reached from another working directory, or through
/// another relative spelling of the plan's path, is recognised as the same input; the path as
/// given when it cannot be resolved.
pub(crate) fn identity_path(p: &Path) -> std::path::PathBuf {
    if let Ok(c) = std::fs::canonicalize(p) {
        return c;
    }
    // A file not written yet (a chain's intermediate): its folder's canonical path.
    let parent = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    match (std::fs::canonicalize(parent), p.file_name()) {
        (Ok(d), Some(f)) => d.join(f),
        _ => std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf()),
    }
}

/// Refuse `path` when it is a symbolic link. What the engine writes in place — an output, the
/// checkpoint folder beside it — is written, truncated and emptied by later runs, so through a
/// link it would change whatever the link points at (someone else's file, an input).
pub(crate) fn refuse_link(path: &Path) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => Err(link_error(path)),
        _ => Ok(()),
    }
}

fn link_error(path: &Path) -> Error {
    let to = std::fs::read_link(path)
        .map(|t| format!(" (to {})", t.display()))
        .unwrap_or_default();
    Error::Usage(format!(
        "{p}: is a symbolic link{to}; mgmm-stream writes and deletes here in place, so it will not go through a link — remove the link (`rm {p}`), or use the path it points to instead",
        p = path.display()
    ))
}

/// How [`open_in_place`] opens an output.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum InPlace {
    /// A new file at `path`. An existing regular file there is replaced — its directory entry
    /// removed first, so another hard link to it keeps its bytes; `run --restart` never writes
    /// into the old inode.
    New,
    /// The partly written file already at `path`, to resume it. A file with other hard links is
    /// refused: writing it in place would change the other names' bytes too.
    Existing,
}

/// Open the output at `path` for reading and writing, written in place (the one way the
/// engine does so: the `.mgt` and `.npy` writers call it). Never through a symbolic link — one
/// at `path` is refused, naming it (`O_NOFOLLOW` closes the race with a link planted after the
/// check) — and see [`InPlace`] for hard links.
pub(crate) fn open_in_place(path: &Path, how: InPlace) -> Result<File> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
    let what = match how {
        InPlace::New => {
            match std::fs::symlink_metadata(path) {
                Ok(m) if m.file_type().is_symlink() => return Err(link_error(path)),
                Ok(m) if !m.is_file() => {
                    return Err(Error::Usage(format!(
                        "{}: exists and is not a regular file (a directory, device or FIFO); move it away or choose another output path",
                        path.display()
                    )))
                }
                Ok(_) => std::fs::remove_file(path)
                    .map_err(|e| Error::io(path, "cannot replace output file", e))?,
                Err(_) => {}
            }
            opts.create_new(true).mode(0o666);
            "cannot create output file"
        }
        InPlace::Existing => "cannot reopen output file",
    };
    let file = opts.open(path).map_err(|e| {
        if e.raw_os_error() == Some(libc::ELOOP) {
            link_error(path)
        } else {
            Error::io(path, what, e)
        }
    })?;
    if how == InPlace::Existing {
        let links = file
            .metadata()
            .map_err(|e| Error::io(path, "cannot stat output file", e))?
            .nlink();
        if links > 1 {
            return Err(Error::Usage(format!(
                "{p}: has {links} names (hard links); resuming writes it in place, which would change the other names' bytes too — give it a copy of its own to resume (`cp {p} {p}.own && mv {p}.own {p}`), or rerun with --restart to write a new file",
                p = path.display()
            )));
        }
    }
    Ok(file)
}

/// Refuse `path` as the place of a JSON document a command writes (`what`: "--report ",
/// "MGMM_TRACE=") when something is there that is not one it wrote: only nothing, a symbolic
/// link (replaced, never written through), an empty file, or a report or timeline of an
/// earlier run (a JSON object whose first key is `plan`, `displayTimeUnit` or `traceEvents`)
/// may be replaced. A slip of the tab key (`--report A.npy`), a settings file, or
/// `MGMM_TRACE=/dev/null` (the device node was replaced by a regular file, as root) must not
/// lose what is there.
pub(crate) fn refuse_replacing(path: &Path, what: &str) -> Result<()> {
    let Ok(m) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    let eg = match what.starts_with("MGMM_TRACE") {
        true => "trace.json",
        false => "run.json",
    };
    if m.file_type().is_symlink() {
        return Ok(());
    }
    if !m.is_file() {
        return Err(Error::Usage(format!(
            "{what}{}: not a regular file (a folder, device or pipe), which the file written at the end would replace; give a file path, e.g. {eg}",
            path.display()
        )));
    }
    if m.len() == 0 {
        return Ok(());
    }
    let mut head = [0u8; 64];
    let n = File::open(path)
        .and_then(|mut f| std::io::Read::read(&mut f, &mut head))
        .unwrap_or(0);
    let text = String::from_utf8_lossy(&head[..n]);
    let t = text.trim_start();
    let ours = t.strip_prefix('{').is_some_and(|r| {
        let r = r.trim_start();
        ["\"plan\"", "\"displayTimeUnit\"", "\"traceEvents\""]
            .iter()
            .any(|k| r.starts_with(k))
    });
    match ours {
        true => Ok(()),
        false => Err(Error::Usage(format!(
            "{what}{}: that file exists and is not a report or timeline of mgmm-stream ({} bytes; it would be replaced); give a new path, e.g. {eg}",
            path.display(),
            m.len(),
        ))),
    }
}

/// The directory a new file at `path` goes into ("." for a bare name).
pub(crate) fn parent_dir(path: &Path) -> std::path::PathBuf {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    }
}

/// Make `file`'s data and metadata durable (`fsync`), its path named in the error. Every sync
/// of a file the engine creates or finishes goes through here or [`sync_dir`], so that the test
/// hook below can see them in order.
pub(crate) fn sync_file(file: &File, path: &Path) -> crate::error::Result<()> {
    file.sync_all()
        .map_err(|e| crate::error::Error::io(path, "cannot sync to disk", e))?;
    log_sync("file", path);
    Ok(())
}

/// Make the directory entries of `dir` durable (`fsync` on the directory): a file created,
/// linked or renamed there is found under its name after a power cut only once its directory
/// is synced. Filesystems that cannot sync a directory (`EINVAL`: some FUSE and network
/// mounts) are let pass — there is nothing more a process can do there.
pub(crate) fn sync_dir(dir: &Path) -> crate::error::Result<()> {
    let r = File::open(dir).and_then(|d| d.sync_all());
    match r {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
        Err(e) => return Err(crate::error::Error::io(dir, "cannot sync directory", e)),
    }
    log_sync("dir", dir);
    Ok(())
}

/// [`sync_dir`] of the directory holding `path`: after `path` was created, linked or renamed.
pub(crate) fn sync_parent(path: &Path) -> crate::error::Result<()> {
    sync_dir(&parent_dir(path))
}

/// Test hook (cargo feature `fault-injection`): where each sync and each journal record is
/// logged, one line each (`file PATH`, `dir PATH`, `record PATH`), so a test can check that
/// the output's header and directory entries were synced before the first tile was recorded —
/// what cannot be seen without a power cut. Set once by the command line from
/// `MGMM_FAULT_SYNC_LOG` ([`crate::config`]).
#[cfg(feature = "fault-injection")]
static SYNC_LOG: std::sync::OnceLock<std::sync::Mutex<File>> = std::sync::OnceLock::new();

/// Log syncs to `path` from now on (the test hook of [`sync_file`] and [`sync_dir`]).
#[cfg(feature = "fault-injection")]
pub(crate) fn log_syncs_to(path: &Path) {
    if let Ok(f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = SYNC_LOG.set(std::sync::Mutex::new(f));
    }
}

/// One line in the sync log, when a test asked for it; nothing otherwise.
pub(crate) fn log_sync(what: &str, path: &Path) {
    #[cfg(feature = "fault-injection")]
    if let Some(f) = SYNC_LOG.get() {
        use std::io::Write;
        let line = format!("{what} {}\n", identity_path(path).display());
        let _ = f
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .write_all(line.as_bytes());
    }
    #[cfg(not(feature = "fault-injection"))]
    let _ = (what, path);
}

/// Free bytes for unprivileged writers on the filesystem holding `dir`; `None` if it cannot be
/// asked (then callers skip the check rather than refuse).
pub(crate) fn free_bytes(dir: &Path) -> Option<u64> {
    let st = rustix::fs::statvfs(dir).ok()?;
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

/// Whether the filesystem holding `dir` is mounted read-only (false if it cannot be asked).
pub(crate) fn read_only(dir: &Path) -> bool {
    rustix::fs::statvfs(dir)
        .map(|st| st.f_flag.contains(StatVfsMountFlags::RDONLY))
        .unwrap_or(false)
}

/// Reserve the blocks of `file`'s first `len` bytes, so that writes through a memory map cannot
/// fail for lack of space later (a map reports ENOSPC as SIGBUS). `Ok(false)` where the
/// filesystem does not support preallocation; other errors (ENOSPC, EFBIG, EDQUOT) are returned.
pub(crate) fn preallocate(file: &File, len: u64) -> io::Result<bool> {
    match rustix::fs::fallocate(file, FallocateFlags::empty(), 0, len) {
        Ok(()) => Ok(true),
        Err(e) if e == rustix::io::Errno::OPNOTSUPP || e == rustix::io::Errno::NOSYS => Ok(false),
        // 524 is the kernel's internal ENOTSUPP, which Lustre clients return to user space.
        Err(e) if e.raw_os_error() == 524 => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Take an exclusive advisory lock on `file` without waiting: `Ok(false)` if another process
/// holds it. The lock is released when the file is closed.
pub(crate) fn try_lock_exclusive(file: &File) -> io::Result<bool> {
    try_flock(file, FlockOperation::NonBlockingLockExclusive)
}

/// [`try_lock_exclusive`]'s shared twin: `Ok(false)` if another process holds the lock
/// exclusively (readers share it).
pub(crate) fn try_lock_shared(file: &File) -> io::Result<bool> {
    try_flock(file, FlockOperation::NonBlockingLockShared)
}

fn try_flock(file: &File, op: FlockOperation) -> io::Result<bool> {
    match rustix::fs::flock(file, op) {
        Ok(()) => Ok(true),
        Err(e) if e == rustix::io::Errno::WOULDBLOCK => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Who holds a `flock` on `file`, as the kernel lists it in `/proc/locks`: (pid, exclusive).
/// `None` where that is not known (no `/proc`, another pid namespace, an overlay filesystem
/// whose inode numbers differ from the kernel's): for messages only.
pub(crate) fn flock_holder(file: &File) -> Option<(u32, bool)> {
    use std::os::unix::fs::MetadataExt;
    let m = file.metadata().ok()?;
    let dev = m.dev();
    let want = format!(
        "{:02x}:{:02x}:{}",
        rustix::fs::major(dev),
        rustix::fs::minor(dev),
        m.ino()
    );
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    // `1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF`; waiters' lines have `->` after the
    // number.
    locks.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let f = f.get(1..)?;
        (f.first() == Some(&"FLOCK") && f.get(4) == Some(&want.as_str()))
            .then(|| Some((f.get(3)?.parse().ok()?, f.get(2) == Some(&"WRITE"))))
            .flatten()
    })
}

/// Unmap a finished output's map on a thread of its own. Tearing down the page tables of a
/// populated 4 GiB map takes about 0.1 s (the report's `flush` of a 32768² f32 step with
/// `durable = false` on the H200 host), and nothing waits for it: the data is in the page cache
/// (and, when durable, on disk) already, and later readers go through the file.
pub(crate) fn unmap_in_background(map: memmap2::MmapMut) {
    if map.len() < 64 << 20 {
        return drop(map);
    }
    let spawned = std::thread::Builder::new()
        .name("mgmm-unmap".into())
        .spawn(move || drop(map));
    // Without a thread, the map was dropped with the closure: unmapped here, as before.
    drop(spawned);
}

/// The kernel's thresholds for dirty page-cache pages (written by the process, not yet on
/// disk), in bytes. Below `background` the kernel leaves them alone; past it, it starts writing
/// them out; from half-way between the two towards `limit` it makes the writers wait for the
/// disk (`balance_dirty_pages`). On the one-H200 machine (126 GiB, the default
/// `vm.dirty_ratio = 20`) this computed a limit of about 25 GiB, and a 43 GB output written
/// through its map held `Dirty` at about 23 GB while the job wrote at the disk's pace
/// (docs/decisions/0003-write-auto.md).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct DirtyLimits {
    pub(crate) background: u64,
    pub(crate) limit: u64,
}

/// [`DirtyLimits`] as the kernel computes them, approximately: `vm.dirty_bytes` when set, else
/// `vm.dirty_ratio` percent of the memory that can hold dirty pages (free memory plus the file
/// pages, as `/proc/meminfo` says; the kernel also subtracts small reserves); the same for the
/// background threshold. `None` where `/proc` cannot be read. A memory cgroup's own, smaller
/// limits are not seen.
pub(crate) fn dirty_limits() -> Option<DirtyLimits> {
    let read = |name: &str| -> Option<u64> {
        std::fs::read_to_string(format!("/proc/sys/vm/{name}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    let vm = VmDirty {
        ratio: read("dirty_ratio")?,
        bytes: read("dirty_bytes").unwrap_or(0),
        background_ratio: read("dirty_background_ratio")?,
        background_bytes: read("dirty_background_bytes").unwrap_or(0),
    };
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    vm.limits(&meminfo)
}

/// The `vm.dirty_*` settings.
struct VmDirty {
    ratio: u64,
    bytes: u64,
    background_ratio: u64,
    background_bytes: u64,
}

impl VmDirty {
    fn limits(&self, meminfo: &str) -> Option<DirtyLimits> {
        let kib = |key: &str| -> Option<u64> {
            let line = meminfo.lines().find(|l| l.starts_with(key))?;
            line[key.len()..].split_whitespace().next()?.parse().ok()
        };
        let dirtyable = (kib("MemFree:")? + kib("Active(file):")? + kib("Inactive(file):")?) * 1024;
        let of = |bytes: u64, ratio: u64| {
            if bytes > 0 {
                bytes
            } else {
                dirtyable / 100 * ratio
            }
        };
        let limit = of(self.bytes, self.ratio);
        // The kernel caps the background threshold at half the limit when it is not lower.
        let mut background = of(self.background_bytes, self.background_ratio);
        if background >= limit {
            background = limit / 2;
        }
        Some(DirtyLimits { background, limit })
    }
}

/// [`counts_dirty_pages`] for a file `path` about to be created: asked of its folder.
pub(crate) fn dir_counts_dirty_pages(path: &Path) -> bool {
    match std::fs::File::open(parent_dir(path)) {
        Ok(f) => counts_dirty_pages(&f),
        Err(_) => true,
    }
}

/// `statfs` type numbers of the memory filesystems (`f_type`, linux/magic.h).
const TMPFS_MAGIC: u32 = 0x0102_1994;
const RAMFS_MAGIC: u32 = 0x8584_58f6;

/// Whether writes to `file` become dirty pages that the kernel limits (a disk-backed file), as
/// opposed to memory filesystems (tmpfs such as `/dev/shm`, ramfs), whose pages never go to a
/// disk and are not held back. True when it cannot be asked.
pub(crate) fn counts_dirty_pages(file: &File) -> bool {
    match rustix::fs::fstatfs(file) {
        Ok(st) => {
            // The magic numbers are 32-bit; `f_type` is signed, 32 or 64 bits by target.
            #[allow(clippy::unnecessary_cast)]
            let t = st.f_type as u32;
            t != TMPFS_MAGIC && t != RAMFS_MAGIC
        }
        Err(_) => true,
    }
}

/// `statfs` type numbers of the filesystems [`on_local_disk`] knows to be local.
const LOCAL_FS: [u32; 8] = [
    0xEF53,      // ext2/3/4
    0x5846_5342, // XFS
    0x9123_683E, // btrfs
    0x2FC1_2FC1, // ZFS
    0xF2F5_2010, // F2FS
    0x794C_7630, // overlayfs
    TMPFS_MAGIC,
    RAMFS_MAGIC,
];

/// Whether `file` lies on a filesystem known to be local to this node (ext4, XFS, btrfs, ZFS,
/// F2FS, overlayfs, tmpfs, ramfs), whose page cache every process of the node shares and whose
/// write errors a later `fsync` would not be the only place to hear of. False for anything
/// else — NFS, SMB, Lustre, GPFS, CephFS, FUSE, an unknown type, a failed `fstatfs` — where a
/// writer that must report a lost write (a full server, a quota) syncs before it says done.
pub(crate) fn on_local_disk(file: &File) -> bool {
    match rustix::fs::fstatfs(file) {
        // The magic numbers are 32-bit; `f_type` is signed, 32 or 64 bits by target.
        #[allow(clippy::unnecessary_cast)]
        Ok(st) => LOCAL_FS.contains(&(st.f_type as u32)),
        Err(_) => false,
    }
}

/// [`on_local_disk`] of the file at `path` (false when it cannot be opened).
pub(crate) fn path_on_local_disk(path: &Path) -> bool {
    File::open(path).is_ok_and(|f| on_local_disk(&f))
}

/// Whether at least `fraction` of the pages of bytes `span` of `map` (a live map of a file,
/// page-aligned at its start) are in the page cache, by `mincore(2)`. Where `mincore` fails,
/// false: callers then take the path that works without the pages.
pub(crate) fn resident(map: &[u8], span: std::ops::Range<u64>, fraction: f64) -> bool {
    // SAFETY: sysconf has no preconditions.
    let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        p if p > 0 => p as usize,
        _ => 4096,
    };
    let start = (span.start as usize / page) * page;
    let end = (span.end as usize).min(map.len());
    if end <= start {
        return true;
    }
    let pages = (end - start).div_ceil(page);
    let mut vec = vec![0u8; pages];
    // SAFETY: `start..end` lies inside the live map (clamped above), `start` is page-aligned
    // relative to the page-aligned map base, and `vec` has one byte per page of the range, as
    // mincore(2) requires.
    let rc = unsafe {
        libc::mincore(
            map.as_ptr().add(start) as *mut libc::c_void,
            end - start,
            vec.as_mut_ptr(),
        )
    };
    rc == 0 && vec.iter().filter(|&&v| v & 1 == 1).count() as f64 >= pages as f64 * fraction
}

/// Whether `mincore(2)` on a map of the file at `path` (with metadata `meta`) says which of its
/// pages are in the page cache. Since Linux 5.0 it does only for a file the process owns or may
/// write (the kernel's `can_do_mincore`); for any other file it reports every page resident,
/// so a cold dataset shared read-only by another user looked cached (cold review, session 33):
/// its blocks would be faulted in a page cluster at a time instead of read by large `pread`s.
/// Callers treat such a file as not cached.
pub(crate) fn mincore_tells(path: &Path, meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions.
    if meta.uid() == unsafe { libc::geteuid() } {
        return true;
    }
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: `c` is a valid NUL-terminated path; faccessat only reads it.
    unsafe { libc::faccessat(libc::AT_FDCWD, c.as_ptr(), libc::W_OK, libc::AT_EACCESS) == 0 }
}

/// Whether the pages of `span` of `map` look all in the page cache, judged from `samples` pages
/// spread evenly over it (one `mincore` each): a guess for whole files, where [`resident`]
/// over every page took 85–90 ms for 8 GiB on the H200 host.
pub(crate) fn resident_sampled(map: &[u8], span: std::ops::Range<u64>, samples: u64) -> bool {
    let end = span.end.min(map.len() as u64);
    if end <= span.start {
        return true;
    }
    let step = ((end - span.start) / samples.max(1)).max(1);
    (0..samples.max(1))
        .map(|i| span.start + i * step)
        .take_while(|&at| at < end)
        .all(|at| resident(map, at..(at + 1).min(end), 1.0))
}

/// Drop the whole pages of `len` bytes at `ptr` from this process's page tables; the pages stay
/// in the page cache. Reading or registering a range of a file's map faults its pages in, and
/// left mapped they count in the process's resident memory until the map goes. Only whole
/// pages inside the range: a page shared with the next range (which may be in use) is left.
///
/// # Safety
///
/// `ptr..ptr + len` must lie inside a live read-only mapping of a file: there `MADV_DONTNEED`
/// only unmaps, and a later read maps the same page-cache pages again, so no byte seen through
/// the map changes (a page still pinned by a driver stays in memory for its DMA). On anonymous
/// or private writable memory it would discard data.
pub(crate) unsafe fn unmap_pages(ptr: usize, len: usize) {
    // SAFETY: sysconf has no preconditions.
    let page = (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as usize;
    let start = ptr.next_multiple_of(page);
    let end = (ptr + len) / page * page;
    if end > start {
        // SAFETY: the caller guarantees a read-only file mapping (above).
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
    }
}

/// Whether the page cache can likely hold a whole file of `len` bytes: at most half of the
/// memory the kernel says is available ([`mem_available`]) when it is asked. A file the cache
/// holds is worth reading in whole bands (`store::rowmajor`) and copying out of its map
/// (`store::blockio::ReadFrom`); one larger is read from disk, maybe more than once.
pub(crate) fn cache_holds(len: u64) -> bool {
    mem_available().is_some_and(|m| len <= m / 2)
}

/// The kernel's estimate of memory available without swapping (`MemAvailable` in
/// /proc/meminfo), in bytes; `None` where it cannot be read.
pub(crate) fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Memory this process can still take before the kernel has to reclaim or kill: the host's
/// [`mem_available`], or less where a memory cgroup (Slurm, a container) limits the process —
/// the smallest `limit − usage` of its cgroup and every ancestor, cgroup v2 (`memory.max`,
/// `memory.current`) or v1 (`memory.limit_in_bytes`, `memory.usage_in_bytes`). `None` where
/// /proc/meminfo cannot be read.
pub(crate) fn memory_headroom() -> Option<u64> {
    let host = mem_available()?;
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    Some(host.min(cgroup_headroom(
        &cgroups,
        std::path::Path::new("/sys/fs/cgroup"),
    )))
}

/// The smallest `limit − usage` over the memory cgroups named in `cgroups` (the text of
/// /proc/self/cgroup) and their ancestors under `root`; `u64::MAX` without a limit.
fn cgroup_headroom(cgroups: &str, root: &std::path::Path) -> u64 {
    let read = |p: std::path::PathBuf| -> Option<u64> {
        std::fs::read_to_string(p).ok()?.trim().parse().ok()
    };
    let mut best = u64::MAX;
    for line in cgroups.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(ctrl), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let (base, max, cur) = match ctrl {
            "" => (root.to_path_buf(), "memory.max", "memory.current"),
            c if c.split(',').any(|c| c == "memory") => (
                root.join("memory"),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            ),
            _ => continue,
        };
        let mut dir = base.join(path.trim_start_matches('/'));
        loop {
            // "max" (v2) does not parse: no limit here.
            if let (Some(limit), Some(used)) = (read(dir.join(max)), read(dir.join(cur))) {
                best = best.min(limit.saturating_sub(used));
            }
            if dir == base || !dir.pop() {
                break;
            }
        }
    }
    best
}

/// Remove what is at `path` — a file, a symbolic link (itself, never what it points at) or a
/// folder with everything in it; nothing there is not an error.
pub(crate) fn remove_any(path: &Path) -> io::Result<()> {
    let r = match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) => Err(e),
    };
    match r {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

#[cfg(test)]
mod tests {
    /// A file in the system's temporary folder and one in `/dev/shm` are on local filesystems
    /// (the machines this runs on: ext4 and tmpfs); `/proc` (procfs) is not in the list, so a
    /// writer there would sync, as on NFS.
    #[test]
    fn local_filesystems_are_told_apart_from_unknown_ones() {
        let t = tempfile::NamedTempFile::new().unwrap();
        let tmp_type = rustix::fs::fstatfs(t.as_file()).unwrap().f_type;
        // Only asserted where the folder is one of the listed kinds (a CI box may differ).
        #[allow(clippy::unnecessary_cast)]
        if LOCAL_FS.contains(&(tmp_type as u32)) {
            assert!(on_local_disk(t.as_file()));
        }
        if let Ok(f) = File::open("/dev/shm") {
            assert!(on_local_disk(&f), "tmpfs is local");
        }
        let proc = File::open("/proc/self/stat").unwrap();
        assert!(!on_local_disk(&proc), "procfs is not a known local disk");
    }
    /// The cgroup limit that binds is the smallest headroom of the process's cgroup and its
    /// ancestors, in either cgroup version; "max" and a missing controller mean no limit.
    #[test]
    fn cgroup_headroom_takes_the_tightest_ancestor() {
        let root = tempfile::tempdir().unwrap();
        let put = |p: &str, v: &str| {
            let p = root.path().join(p);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, v).unwrap();
        };
        put("job/memory.max", "max\n");
        put("job/memory.current", "100\n");
        put("job/step/memory.max", "1000\n");
        put("job/step/memory.current", "400\n");
        assert_eq!(cgroup_headroom("0::/job/step\n", root.path()), 600);
        put("job/memory.max", "500\n");
        assert_eq!(cgroup_headroom("0::/job/step\n", root.path()), 400);
        put("memory/a/memory.limit_in_bytes", "9223372036854771712\n");
        put("memory/a/memory.usage_in_bytes", "7\n");
        put("memory/memory.limit_in_bytes", "300\n");
        put("memory/memory.usage_in_bytes", "100\n");
        assert_eq!(cgroup_headroom("4:memory:/a\n3:cpu:/\n", root.path()), 200);
        assert_eq!(cgroup_headroom("3:cpu:/\n", root.path()), u64::MAX);
        assert!(memory_headroom().is_some_and(|m| m > 0));
    }

    use super::*;

    /// `mincore` tells the cache of a file the process owns; of another user's file only where
    /// the process may write it (root may), as the kernel's `can_do_mincore` rules.
    #[test]
    fn mincore_tells_for_files_the_process_owns_or_may_write() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, b"x").unwrap();
        assert!(mincore_tells(&p, &std::fs::metadata(&p).unwrap()));
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        if root {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o444)).unwrap();
            std::os::unix::fs::chown(&p, Some(65534), Some(65534)).unwrap();
            let meta = std::fs::metadata(&p).unwrap();
            assert_ne!(std::os::unix::fs::MetadataExt::uid(&meta), 0);
            assert!(mincore_tells(&p, &meta), "root may write any file");
        } else {
            // Not ours and not writable: a system file.
            let sys = Path::new("/etc/passwd");
            assert!(!mincore_tells(sys, &std::fs::metadata(sys).unwrap()));
        }
    }

    /// An output written in place is never opened through a link: a symlink is refused for a
    /// new file and for a resume; a new file over one with another hard link is a new inode
    /// (the other name keeps its bytes); resuming a file with another hard link is refused.
    #[test]
    fn outputs_in_place_never_go_through_links() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let victim = d.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let out = d.path().join("C.mgt");
        std::os::unix::fs::symlink(&victim, &out).unwrap();
        for how in [InPlace::New, InPlace::Existing] {
            let e = open_in_place(&out, how).unwrap_err().to_string();
            assert!(e.contains("C.mgt") && e.contains("symbolic link"), "{e}");
            assert!(refuse_link(&out).is_err());
        }
        std::fs::remove_file(&out).unwrap();
        assert!(refuse_link(&out).is_ok());
        std::fs::hard_link(&victim, &out).unwrap();
        let e = open_in_place(&out, InPlace::Existing)
            .unwrap_err()
            .to_string();
        assert!(e.contains("hard links") && e.contains("--restart"), "{e}");
        let f = open_in_place(&out, InPlace::New).unwrap();
        f.set_len(100).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert_eq!(std::fs::metadata(&out).unwrap().nlink(), 1);
        drop(open_in_place(&out, InPlace::Existing).unwrap());
        std::fs::create_dir(d.path().join("D.mgt")).unwrap();
        assert!(open_in_place(&d.path().join("D.mgt"), InPlace::New).is_err());
    }

    #[test]
    fn statvfs_answers_for_a_temp_dir() {
        let d = tempfile::tempdir().unwrap();
        assert!(free_bytes(d.path()).is_some_and(|b| b > 0));
        assert!(!read_only(d.path()));
        assert_eq!(free_bytes(&d.path().join("missing/dir")), None);
    }

    #[test]
    fn preallocate_extends_and_lock_excludes() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        let f = File::create(&p).unwrap();
        if preallocate(&f, 1 << 20).unwrap() {
            assert_eq!(f.metadata().unwrap().len(), 1 << 20);
        }
        assert!(try_lock_exclusive(&f).unwrap());
        let g = File::open(&p).unwrap();
        assert!(!try_lock_exclusive(&g).unwrap(), "second lock must fail");
        drop(f);
        assert!(try_lock_exclusive(&g).unwrap(), "lock is released on close");
    }

    /// The limits from `vm.dirty_*` and `/proc/meminfo` as the kernel derives them: percent
    /// of free plus file memory, or the byte settings when set; background at most half.
    #[test]
    fn dirty_limits_follow_the_vm_settings() {
        let meminfo = "MemTotal:       131072000 kB\nMemFree:        80000000 kB\n\
                       MemAvailable:   120000000 kB\nActive(file):   10000000 kB\n\
                       Inactive(file): 10000000 kB\n";
        let dirtyable = 100_000_000u64 * 1024;
        let vm = |ratio, bytes, background_ratio, background_bytes| VmDirty {
            ratio,
            bytes,
            background_ratio,
            background_bytes,
        };
        assert_eq!(
            vm(20, 0, 10, 0).limits(meminfo),
            Some(DirtyLimits {
                background: dirtyable / 100 * 10,
                limit: dirtyable / 100 * 20
            })
        );
        assert_eq!(
            vm(20, 64 << 30, 10, 0).limits(meminfo),
            Some(DirtyLimits {
                background: dirtyable / 100 * 10,
                limit: 64 << 30
            })
        );
        let l = vm(10, 0, 30, 0).limits(meminfo).unwrap();
        assert_eq!(l.background, l.limit / 2);
        assert_eq!(vm(20, 0, 10, 0).limits("MemFree: 1 kB\n"), None);
        // This machine's own answer is consistent.
        if let Some(l) = dirty_limits() {
            assert!(l.background <= l.limit && l.limit > 0);
        }
    }

    /// A temporary directory on disk counts dirty pages, `/dev/shm` (tmpfs) does not.
    #[test]
    fn dirty_pages_counted_on_disk_not_in_tmpfs() {
        let d = tempfile::tempdir_in(".").unwrap();
        let f = File::create(d.path().join("f")).unwrap();
        if let Ok(st) = rustix::fs::fstatfs(&f) {
            #[allow(clippy::unnecessary_cast)]
            let tmpfs = st.f_type as u32 == TMPFS_MAGIC;
            assert_eq!(counts_dirty_pages(&f), !tmpfs);
        }
        if let Ok(shm) = tempfile::tempfile_in("/dev/shm") {
            assert!(!counts_dirty_pages(&shm));
        }
    }
}
