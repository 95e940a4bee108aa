//! Filesystem questions and reservations the engine asks before and while writing: free space,
//! read-only mounts, preallocation and exclusive locks; and letting go of a finished output's
//! map off the critical path.
//!
//! These go through `rustix`, whose safe wrappers replace hand-written `libc` calls and their
//! `unsafe` blocks (zeroed C structs, raw descriptors, `errno` reads).

use std::fs::File;
use std::io;
use std::path::Path;

use rustix::fs::{FallocateFlags, FlockOperation, StatVfsMountFlags};

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
    match rustix::fs::flock(file, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(true),
        Err(e) if e == rustix::io::Errno::WOULDBLOCK => Ok(false),
        Err(e) => Err(e.into()),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
