//! Files that appear whole or not at all, written under a temporary name no one can guess.
//!
//! `gen`, `export` and `import` write a new file from start to end; checkpoints, a merged
//! journal, a `.npy` output's checksum sidecar, a split step's manifest and the `--report` file
//! are written whole too. Written in place, a full disk, a file-size limit or a Ctrl-C would
//! leave a file at the final name with a valid header and missing data, and a later `gen` would
//! refuse to replace it ("already exists"). Instead the free space is checked first, the bytes
//! go to a temporary file in the same directory (same filesystem, so the rename is atomic), and
//! only a finished, synced file is renamed onto the final name. On any error, or when the
//! [`TempOutput`] is dropped unfinished, the temporary file is removed.
//!
//! The temporary file is `NAME.<pid>.<random>.partial`, created with
//! `O_CREAT|O_EXCL|O_NOFOLLOW` (the `tempfile` crate picks the random part and retries on a
//! clash): a symlink or file planted at a name the writer would use is never opened, let alone
//! written through, and nobody can plant one at the right name in advance. The pid stays in the
//! name so that the next write of NAME can tell a killed writer's leftovers from a live one's
//! ([`sweep_dead_partials`]). Replacing an existing file (`--force`) swaps the directory entry:
//! the old file's inode — which may be a hard link or a symlink target of something else — is
//! never opened for writing. This is the one way the engine creates a temporary file; outputs
//! written in place (a `run`'s, which resume) are opened by [`super::fsutil::open_in_place`].

use std::fs::File;
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

/// The pid of the writer of `file`, when it is a temporary file of `name`:
/// `NAME.<pid>.<random>.partial`, or `NAME.<pid>.partial` as earlier versions named them.
pub(crate) fn temp_writer(file: &str, name: &str) -> Option<u32> {
    let rest = file
        .strip_prefix(name)?
        .strip_prefix('.')?
        .strip_suffix(".partial")?;
    let pid = rest.split_once('.').map_or(rest, |(pid, _)| pid);
    pid.parse().ok()
}

/// Remove `NAME.<pid>[.<random>].partial` files in `dir` whose writer is gone: a `gen`, `export` or
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
        let Some(pid) = temp_writer(&file, name) else {
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
    file: File,
    tmp: tempfile::TempPath,
    dst: PathBuf,
}

impl TempOutput {
    /// Check that `need` bytes fit beside `dst`, and create the temporary file there (empty,
    /// new, never through a link).
    pub(crate) fn new(dst: &Path, need: u64) -> Result<TempOutput> {
        use std::os::unix::fs::OpenOptionsExt;
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
        let mut prefix = name.to_os_string();
        prefix.push(format!(".{}.", std::process::id()));
        let (file, tmp) = tempfile::Builder::new()
            .prefix(&prefix)
            .suffix(".partial")
            .rand_bytes(8)
            .make_in(&dir, |p| {
                // `create_new` is O_CREAT|O_EXCL; O_NOFOLLOW says it twice. Mode 0666 less the
                // umask, as any file the engine creates.
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                    .mode(0o666)
                    .open(p)
            })
            .map_err(|e| Error::io(dst, "cannot create a temporary file beside it", e))?
            .into_parts();
        Ok(TempOutput {
            file,
            tmp,
            dst: dst.to_path_buf(),
        })
    }

    /// Where the bytes go (the tests look there; writers use [`TempOutput::file`], and name
    /// [`TempOutput::dst`] in messages).
    #[cfg(test)]
    pub(crate) fn path(&self) -> &Path {
        &self.tmp
    }

    /// The final name, as the caller gave it: what messages about the file name (a user never
    /// asked for the temporary one).
    pub(crate) fn dst(&self) -> &Path {
        &self.dst
    }

    /// The temporary file, open for reading and writing.
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// Sync the finished file, move it onto its final name, replacing whatever directory entry
    /// is there (a file, a link: the entry, never what it points at), and sync the directory so
    /// the rename survives a crash ([`fsutil::sync_file`], [`fsutil::sync_parent`]: the one
    /// place every such sync goes through). A file its writer already synced costs a second
    /// `fsync` with nothing left to write.
    pub(crate) fn commit(self) -> Result<()> {
        self.commit_with(true)
    }

    /// [`TempOutput::commit`], with `sync = false` only renamed (no `fsync` of the file or its
    /// folder): still whole or absent for any reader and after a killed process, but not
    /// guaranteed past a power loss — what `durable = false` promises. An `fsync` waits for the
    /// disk's queue: behind the background writeback of a large output just written it took up
    /// to 0.38 s at the end of a 32768² fp64 `.npy` step on the H100 machine.
    pub(crate) fn commit_with(self, sync: bool) -> Result<()> {
        let TempOutput { file, tmp, dst } = self;
        if sync {
            fsutil::sync_file(&file, &tmp)?;
        }
        tmp.persist(&dst)
            .map_err(|e| Error::io(&dst, "cannot move the finished file into place", e.error))?;
        if sync {
            fsutil::sync_parent(&dst)?;
        }
        Ok(())
    }

    /// [`TempOutput::commit`], but only where nothing has the final name yet (a link, then
    /// the temporary name removed): `AlreadyExists` when something does.
    pub(crate) fn commit_new(self) -> Result<()> {
        let TempOutput { file, tmp, dst } = self;
        fsutil::sync_file(&file, &tmp)?;
        tmp.persist_noclobber(&dst)
            .map_err(|e| Error::io(&dst, "cannot put the new file in place", e.error))?;
        fsutil::sync_parent(&dst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A killed writer's partial file (its pid gone, an hour old; named as now or as earlier
    /// versions did) is removed by the next write of the same name; a recent one, one of a live
    /// process, or of another name, is not.
    #[test]
    fn partial_files_of_killed_writers_are_swept() {
        let d = tempfile::tempdir().unwrap();
        let dst = d.path().join("x.mgt");
        // Past the kernel's pid_max (at most 2^22): no such process.
        let dead = d.path().join("x.mgt.4194399.partial");
        let dead_new = d.path().join("x.mgt.4194399.Ab3dE9xZ.partial");
        let other = d.path().join("y.mgt.4194399.partial");
        let recent = d.path().join("x.mgt.4194398.q1w2e3r4.partial");
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(7200);
        for f in [&dead, &dead_new, &other, &recent] {
            std::fs::write(f, b"left").unwrap();
        }
        for f in [&dead, &dead_new, &other] {
            std::fs::File::options()
                .write(true)
                .open(f)
                .unwrap()
                .set_modified(old)
                .unwrap();
        }
        let t = TempOutput::new(&dst, 10).unwrap();
        // A recent one may be a writer in another PID namespace: kept.
        assert!(!dead.exists() && !dead_new.exists() && other.exists() && recent.exists());
        let mine = t.path().file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(temp_writer(&mine, "x.mgt"), Some(std::process::id()));
        assert_eq!(temp_writer("x.mgt.12.partial", "x.mgt"), Some(12));
        assert_eq!(temp_writer("x.mgt.12.ab.partial", "x.mgt"), Some(12));
        assert_eq!(temp_writer("x.mgt.journal", "x.mgt"), None);
        assert_eq!(temp_writer("x.mgtz.12.partial", "x.mgt"), None);
    }

    /// A symlink planted at the name earlier versions used (`NAME.<pid>.partial`) is never
    /// opened: its target keeps its bytes, the final name is a regular file, and two temporary
    /// files of one name in one process get different, unguessable names.
    #[test]
    fn a_planted_link_is_never_followed() {
        let d = tempfile::tempdir().unwrap();
        let dst = d.path().join("x.mgt");
        let victim = d.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let planted = d
            .path()
            .join(format!("x.mgt.{}.partial", std::process::id()));
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        let t = TempOutput::new(&dst, 10).unwrap();
        let u = TempOutput::new(&dst, 10).unwrap();
        assert!(t.path() != planted && t.path() != u.path());
        let meta = std::fs::symlink_metadata(t.path()).unwrap();
        assert!(meta.is_file() && meta.len() == 0);
        use std::io::Write;
        t.file().write_all(b"whole").unwrap();
        t.commit().unwrap();
        drop(u);
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert!(std::fs::symlink_metadata(&dst).unwrap().is_file());
        assert_eq!(std::fs::read(&dst).unwrap(), b"whole");
        // Committed over a link, the link is replaced, not written through.
        std::fs::remove_file(&dst).unwrap();
        std::os::unix::fs::symlink(&victim, &dst).unwrap();
        let t = TempOutput::new(&dst, 10).unwrap();
        t.file().write_all(b"new").unwrap();
        t.commit().unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert!(std::fs::symlink_metadata(&dst).unwrap().is_file());
        // commit_new leaves an existing name alone.
        let t = TempOutput::new(&dst, 10).unwrap();
        let tmp = t.path().to_path_buf();
        assert!(t.commit_new().is_err());
        assert_eq!(std::fs::read(&dst).unwrap(), b"new");
        assert!(!tmp.exists(), "the temporary file goes on failure too");
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
