//! Files that appear whole or not at all.
//!
//! `gen` and `export` write a new file from start to end. Written in place, a full disk, a
//! file-size limit or a Ctrl-C would leave a file at the final name with a valid header and
//! missing data, and a later `gen` would refuse to replace it ("already exists"). Instead the
//! free space is checked first, the bytes go to `NAME.<pid>.partial` in the same directory
//! (same filesystem, so the rename is atomic), and only a finished, synced file is renamed onto
//! the final name. On any error, or when the [`TempOutput`] is dropped unfinished, the
//! partial file is removed. Replacing an existing file (`--force`) swaps the directory entry:
//! the old file's inode — which may be a hard link or a symlink target of something else — is
//! never opened for writing.

use std::path::{Path, PathBuf};

use super::fsutil;
/// Where a new file goes (asked of [`fsutil`], below this module); also reachable here, beside
/// the files it places.
pub(crate) use super::fsutil::parent_dir;
use crate::error::{Error, Result};
use crate::units::fmt_bytes;

/// Refuse when the filesystem holding `dir` has less than `need` bytes free for us. Filesystems
/// that cannot be asked pass (the write itself then reports ENOSPC, and the partial file goes).
pub(crate) fn ensure_space(dst: &Path, dir: &Path, need: u64) -> Result<()> {
    if let Some(free) = fsutil::free_bytes(dir) {
        if free < need {
            return Err(Error::Usage(format!(
                "not enough disk space for {}: it needs {} but {} has {} free; free some space or write it elsewhere",
                dst.display(),
                fmt_bytes(need),
                dir.display(),
                fmt_bytes(free)
            )));
        }
    }
    Ok(())
}

/// Remove `NAME.<pid>.partial` files in `dir` whose writer is gone: a `gen`, `export` or
/// `import` killed outright (SIGKILL, a crash, a node that went down) cannot remove its own, and
/// each may be as large as the matrix. Only a file untouched for an hour whose pid is not a
/// process here: a pid still alive (another write of the same name going on now) is left alone,
/// and so is a recent file, which may belong to a writer this `/proc` cannot see (another
/// container or host sharing the folder). Says what it removed.
fn sweep_dead_partials(dir: &Path, name: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for ent in entries.flatten() {
        let file = ent.file_name().to_string_lossy().into_owned();
        let Some(pid) = (file.strip_prefix(name))
            .and_then(|r| r.strip_prefix('.'))
            .and_then(|r| r.strip_suffix(".partial"))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        // Its pid gone here, and untouched for an hour: a writer in another PID namespace or
        // on another host sharing the folder (whose pid this /proc cannot see) keeps writing
        // it, so its time stays recent.
        let stale = ent
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age.as_secs() >= 3600);
        if pid == std::process::id() || !stale || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let len = ent.metadata().map_or(0, |m| m.len());
        if std::fs::remove_file(ent.path()).is_ok() {
            crate::diagln!(
                "note: removed {} ({}), left by an earlier write of {name} that was killed",
                ent.path().display(),
                crate::units::fmt_bytes(len)
            );
        }
    }
}

/// A file being written under a temporary name next to its final one.
pub(crate) struct TempOutput {
    tmp: PathBuf,
    dst: PathBuf,
    committed: bool,
}

impl TempOutput {
    /// Check that `need` bytes fit beside `dst`, and choose the temporary name. Nothing is
    /// created yet: the caller creates [`TempOutput::path`].
    pub(crate) fn new(dst: &Path, need: u64) -> Result<TempOutput> {
        let dir = parent_dir(dst);
        let name = dst.file_name().ok_or_else(|| {
            Error::Usage(format!("{}: not a file name to write to", dst.display()))
        })?;
        if !dir.is_dir() {
            return Err(Error::Usage(format!(
                "{}: its directory {} does not exist; create it first",
                dst.display(),
                dir.display()
            )));
        }
        sweep_dead_partials(&dir, &name.to_string_lossy());
        ensure_space(dst, &dir, need)?;
        let mut tmp_name = name.to_os_string();
        tmp_name.push(format!(".{}.partial", std::process::id()));
        Ok(TempOutput {
            tmp: dir.join(tmp_name),
            dst: dst.to_path_buf(),
            committed: false,
        })
    }

    /// Where to write the bytes.
    pub(crate) fn path(&self) -> &Path {
        &self.tmp
    }

    /// Move the finished (and already synced) file onto its final name, and sync the
    /// directory so the rename survives a crash.
    pub(crate) fn commit(mut self) -> Result<()> {
        std::fs::rename(&self.tmp, &self.dst)
            .map_err(|e| Error::io(&self.dst, "cannot move the finished file into place", e))?;
        self.committed = true;
        if let Ok(d) = std::fs::File::open(parent_dir(&self.dst)) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

impl Drop for TempOutput {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A killed writer's partial file (its pid gone, an hour old) is removed by the next write
    /// of the same name; a recent one, one of a live process, or of another name, is not.
    #[test]
    fn partial_files_of_killed_writers_are_swept() {
        let d = tempfile::tempdir().unwrap();
        let dst = d.path().join("x.mgt");
        // Past the kernel's pid_max (at most 2^22): no such process.
        let dead = d.path().join("x.mgt.4194399.partial");
        let live = d
            .path()
            .join(format!("x.mgt.{}.partial", std::process::id()));
        let other = d.path().join("y.mgt.4194399.partial");
        let recent = d.path().join("x.mgt.4194398.partial");
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(7200);
        for f in [&dead, &other, &recent] {
            std::fs::write(f, b"left").unwrap();
        }
        for f in [&dead, &other] {
            std::fs::File::options()
                .write(true)
                .open(f)
                .unwrap()
                .set_modified(old)
                .unwrap();
        }
        let t = TempOutput::new(&dst, 10).unwrap();
        // A recent one may be a writer in another PID namespace: kept.
        assert!(!dead.exists() && other.exists() && recent.exists());
        assert_eq!(t.path(), live);
    }

    #[test]
    fn partial_files_go_and_finished_ones_appear() {
        let d = tempfile::tempdir().unwrap();
        let dst = d.path().join("x.mgt");
        let t = TempOutput::new(&dst, 10).unwrap();
        std::fs::write(t.path(), b"partial").unwrap();
        let tmp = t.path().to_path_buf();
        assert!(tmp
            .file_name()
            .unwrap()
            .to_string_lossy()
            .ends_with(".partial"));
        drop(t);
        assert!(
            !tmp.exists() && !dst.exists(),
            "an unfinished file is removed"
        );
        let t = TempOutput::new(&dst, 10).unwrap();
        std::fs::write(t.path(), b"whole").unwrap();
        t.commit().unwrap();
        assert_eq!(std::fs::read(&dst).unwrap(), b"whole");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
    }

    #[test]
    fn too_little_space_is_refused_with_the_numbers() {
        let d = tempfile::tempdir().unwrap();
        let dst = d.path().join("big.mgt");
        let e = TempOutput::new(&dst, u64::MAX / 2)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("not enough disk space") && e.contains("big.mgt"),
            "{e}"
        );
        assert!(!dst.exists());
    }
}
