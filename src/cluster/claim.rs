//! Claim files: at most one process works a shard at a time, decided by the filesystem alone.
//!
//! A claim is created with `O_CREAT|O_EXCL` (atomic on local filesystems, NFSv3+ and Lustre)
//! and holds `host pid start-time`. While the owner works, a heartbeat thread touches its mtime
//! every `timeout / 4`; a claim is stale when its owner is a dead process on this host, or its
//! mtime is older than `timeout` (a node that died or lost the filesystem). A stale claim is
//! taken over by renaming it aside — `rename` is atomic, so of two processes that both judged it
//! stale exactly one wins — and creating a fresh one. Correctness of the output never rests on
//! claims: every journal record is checked against the tile's bytes before it is believed
//! (at finalize, all but the finalizing process's own when no other record disagrees), and
//! tiles are computed bit-identically by any process, so even two writers of one shard (a
//! heartbeat stalled longer than the timeout) would write the same bytes.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::identity::host;
use crate::error::{Error, Result};

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Who holds a claim, as its file says, and how fresh its heartbeat is.
#[derive(Debug, Clone)]
pub(crate) struct Holder {
    pub(crate) host: String,
    pub(crate) pid: u32,
    /// Unix time the claim was made.
    pub(crate) since: u64,
    /// Seconds since the last heartbeat (the file's mtime).
    pub(crate) age_s: f64,
}

impl Holder {
    pub(crate) fn describe(&self) -> String {
        format!(
            "{} pid {} (heartbeat {:.0} s ago)",
            self.host, self.pid, self.age_s
        )
    }
}

/// Read a claim file; `None` if it is not there.
pub(crate) fn read(path: &Path) -> Option<Holder> {
    let text = std::fs::read_to_string(path).ok()?;
    let meta = std::fs::metadata(path).ok()?;
    let age_s = meta
        .modified()
        .ok()
        .and_then(|m| SystemTime::now().duration_since(m).ok())
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let mut w = text.split_whitespace();
    Some(Holder {
        host: w.next().unwrap_or("?").to_string(),
        pid: w.next().and_then(|p| p.parse().ok()).unwrap_or(0),
        since: w.next().and_then(|p| p.parse().ok()).unwrap_or(0),
        age_s,
    })
}

/// Whether a holder can be presumed gone: a process of this host that no longer exists, or a
/// heartbeat older than `timeout`.
pub(crate) fn is_stale(h: &Holder, timeout: Duration) -> bool {
    let dead_here =
        h.host == host() && h.pid != 0 && !Path::new(&format!("/proc/{}", h.pid)).exists();
    dead_here || h.age_s > timeout.as_secs_f64()
}

/// A claim this process holds; its heartbeat runs until it is dropped or [`Claim::release`]d.
pub(crate) struct Claim {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    lost: Arc<AtomicBool>,
    beat: Option<std::thread::JoinHandle<()>>,
}

/// Outcome of trying to claim.
pub(crate) enum Try {
    Got(Claim),
    /// Someone else holds it and looks alive.
    Held(Holder),
}

fn create(path: &Path) -> std::io::Result<bool> {
    match OpenOptions::new().write(true).create_new(true).open(path) {
        Ok(mut f) => {
            let line = format!("{} {} {}\n", host(), std::process::id(), now_s());
            f.write_all(line.as_bytes())?;
            f.sync_all()?;
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e),
    }
}

/// Try to claim `path`, taking over a stale claim. `timeout` is the heartbeat age after which
/// a holder is presumed dead.
pub(crate) fn try_claim(path: &Path, timeout: Duration) -> Result<Try> {
    let err = |e| Error::io(path, "cannot create claim file", e);
    for _ in 0..3 {
        if create(path).map_err(err)? {
            return Ok(Try::Got(Claim::start(path, timeout)));
        }
        let Some(h) = read(path) else { continue }; // released meanwhile: try again
        if !is_stale(&h, timeout) {
            return Ok(Try::Held(h));
        }
        // Take the stale claim aside; only one contender's rename succeeds.
        let aside = path.with_extension(format!("stale-{}-{}", host(), std::process::id()));
        if std::fs::rename(path, &aside).is_ok() {
            let _ = std::fs::remove_file(&aside);
        }
    }
    match read(path) {
        Some(h) => Ok(Try::Held(h)),
        None => Err(Error::Usage(format!(
            "{}: could not claim it (it kept changing hands); try again",
            path.display()
        ))),
    }
}

impl Claim {
    fn start(path: &Path, timeout: Duration) -> Claim {
        let stop = Arc::new(AtomicBool::new(false));
        let lost = Arc::new(AtomicBool::new(false));
        let (p, s, l) = (path.to_path_buf(), stop.clone(), lost.clone());
        let mine = format!("{} {} ", host(), std::process::id());
        let every = (timeout / 4).max(Duration::from_millis(100));
        let beat = std::thread::spawn(move || {
            let mut last = std::time::Instant::now();
            while !s.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(50).min(every));
                if last.elapsed() < every {
                    continue;
                }
                last = std::time::Instant::now();
                let still = std::fs::read_to_string(&p).is_ok_and(|t| t.starts_with(&mine));
                if !still {
                    l.store(true, Ordering::Relaxed);
                    eprintln!(
                        "warning: {} was taken over by another process (this one's heartbeat was late); its tiles are written the same either way",
                        p.display()
                    );
                    return;
                }
                if let Ok(f) = OpenOptions::new().write(true).open(&p) {
                    let _ = f.set_modified(SystemTime::now());
                }
            }
        });
        Claim {
            path: path.to_path_buf(),
            stop,
            lost,
            beat: Some(beat),
        }
    }

    /// Whether another process took this claim over.
    pub(crate) fn lost(&self) -> bool {
        self.lost.load(Ordering::Relaxed)
    }

    fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.beat.take() {
            let _ = h.join();
        }
    }

    /// Whether the claim file still names this process: the heartbeat looks only every
    /// `timeout / 4`, and a takeover since its last look must not be renamed or removed under
    /// the process that now holds it (whose shard would then read as done while it writes).
    fn still_mine(&self) -> bool {
        let mine = format!("{} {} ", host(), std::process::id());
        !self.lost() && std::fs::read_to_string(&self.path).is_ok_and(|t| t.starts_with(&mine))
    }

    /// Stop the heartbeat and rename the claim to `to` (a shard's `.done` marker); nothing when
    /// another process has taken it over (its holder marks the shard done).
    pub(crate) fn finish_as(mut self, to: &Path) -> Result<()> {
        self.stop();
        if !self.still_mine() {
            return Ok(());
        }
        std::fs::rename(&self.path, to)
            .map_err(|e| Error::io(&self.path, "cannot mark the shard done", e))
    }

    /// Stop the heartbeat and remove the claim (not one another process has taken over).
    pub(crate) fn release(mut self) {
        self.stop();
        if self.still_mine() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        // An error unwinding past a claim leaves it in place (stale once its heartbeat stops,
        // or at once for a process of this host that exits).
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_claim_at_a_time_and_stale_ones_are_taken_over() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("s.claim");
        let t = Duration::from_secs(60);
        let Try::Got(c) = try_claim(&p, t).unwrap() else {
            panic!("first claim must succeed")
        };
        match try_claim(&p, t).unwrap() {
            Try::Held(h) => assert_eq!(h.pid, std::process::id()),
            Try::Got(_) => panic!("second claim must fail while the first is alive"),
        }
        c.release();
        assert!(!p.exists());
        // A claim by a process of this host that no longer exists is stale at once.
        std::fs::write(&p, format!("{} 4000000000 0\n", host())).unwrap();
        assert!(matches!(try_claim(&p, t).unwrap(), Try::Got(_)));
    }

    /// A claim another process took over since the heartbeat last looked is left to it: not
    /// renamed to `.done` (its shard would read as done while the new holder writes it), not
    /// removed.
    #[test]
    fn a_claim_taken_over_is_neither_marked_done_nor_removed() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("s.claim");
        let done = d.path().join("s.done");
        let t = Duration::from_secs(60);
        let Try::Got(c) = try_claim(&p, t).unwrap() else {
            panic!("first claim must succeed")
        };
        let other = "other-host 4242 0\n";
        std::fs::write(&p, other).unwrap();
        c.finish_as(&done).unwrap();
        assert!(!done.exists(), "a taken-over claim was marked done");
        assert_eq!(std::fs::read_to_string(&p).unwrap(), other);
        std::fs::remove_file(&p).unwrap();
        let Try::Got(c) = try_claim(&p, t).unwrap() else {
            panic!("claim after removal must succeed")
        };
        std::fs::write(&p, other).unwrap();
        c.release();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            other,
            "removed another's claim"
        );
        // Its own claim is marked done.
        std::fs::remove_file(&p).unwrap();
        let Try::Got(c) = try_claim(&p, t).unwrap() else {
            panic!("claim after removal must succeed")
        };
        c.finish_as(&done).unwrap();
        assert!(done.exists() && !p.exists());
    }
}
