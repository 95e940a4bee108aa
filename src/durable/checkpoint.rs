//! Partial accumulators of output tiles still being computed, saved beside the output so that a
//! kill in the middle of a long tile loses minutes, not the tile.
//!
//! The journal ([`super::journal`]) records only finished tiles. A tile whose k loop takes an
//! hour would lose all of it on a kill, so while a lane computes a tile it downloads the
//! accumulator every `engine.checkpoint_every` (after a k-chunk, when at least one remains) and
//! writeback stores it here: `OUTPUT.partial/tile<seq>.ckpt`, one file per tile, the latest only,
//! written to a temporary file of its own (`store::atomic`), fsynced and renamed over the
//! previous one. A folder `OUTPUT.partial` that is a symbolic link is refused (its files would
//! be deleted and written wherever it points), and so is a file in its place — both up front,
//! before a run modifies anything ([`refuse_unusable_dir`]). A file starts with
//! one text line — `MGMCKPT1 <CRC-32C of the JSON, 8 hex digits> <JSON>` — whose JSON names the
//! tile (seq and block), the k-chunks done and in all, the accumulator's dtype, the CRC-32C of
//! the data and the step's journal fingerprint; the accumulator's bytes follow, exactly as the
//! device held them (the accumulation dtype, little-endian, row-major `rows×cols`).
//!
//! On resume ([`Checkpoints::scan`]) a file is used only if every one of those agrees with the
//! step and its data's CRC matches; anything else is deleted with a note and the tile is
//! recomputed from its first k-chunk. A used checkpoint puts the accumulator back on the device
//! and the tile continues at its next k-chunk — the k order, and where alpha, beta and C0 enter
//! (in k-chunk 0), are those of an uninterrupted run, so the bytes are identical. A tile's file
//! is removed once the tile is in the journal, and the directory when the step completes.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::journal::Fingerprint;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::plan::layout::Layout;
use crate::plan::schedule::{OutTile, Schedule};
use crate::store::atomic::{temp_writer, TempOutput};

const MAGIC: &str = "MGMCKPT1";
/// Longest header line accepted (the fingerprint names every input; a few KiB at most).
const MAX_HEADER: u64 = 1 << 20;

/// The checkpoint directory of `output`: `OUTPUT.partial` beside it.
pub(crate) fn partial_dir(output: &Path) -> PathBuf {
    let mut s = output.as_os_str().to_owned();
    s.push(".partial");
    PathBuf::from(s)
}

/// The checkpoints `run` would look at for `output`, read-only (for `plan`'s status line): for
/// each tile not in `done` with a readable checkpoint, (seq, k-chunks done, k-chunks in all).
/// Whether `run` then uses one is its own check ([`Checkpoints::scan`]: fingerprint, data CRC).
pub(crate) fn peek(output: &Path, done: &BTreeSet<u32>) -> Vec<(u32, u32, u32)> {
    let Ok(entries) = std::fs::read_dir(partial_dir(output)) else {
        return Vec::new();
    };
    let mut out: Vec<(u32, u32, u32)> = entries
        .flatten()
        .filter_map(|ent| {
            let (seq, tmp) = parse_name(&ent.file_name().to_string_lossy())?;
            if tmp || done.contains(&seq) {
                return None;
            }
            let mut r = BufReader::new(File::open(ent.path()).ok()?);
            let h = read_header(&mut r).ok()?;
            Some((seq, h.k_done, h.k_chunks))
        })
        .collect();
    out.sort_unstable();
    out
}

/// Refuse a checkpoint folder `dir` that a run cannot use: a symbolic link (its `tile*.ckpt`
/// files are deleted and rewritten there, which through a link would happen in whatever folder
/// it points at), or something else of that name that is not a folder. Asked before anything
/// is modified: among `run`'s up-front checks ([`crate::run::space`]) and when a step opens
/// its output, before its journal (`run --restart` had reset the journal of a complete output
/// before finding a file in the folder's place).
pub(crate) fn refuse_unusable_dir(dir: &Path) -> Result<()> {
    crate::store::fsutil::refuse_link(dir)?;
    match std::fs::metadata(dir) {
        Ok(m) if !m.is_dir() => Err(not_a_folder(dir)),
        _ => Ok(()),
    }
}

/// The header line's JSON.
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Header {
    seq: u32,
    r0: u64,
    c0: u64,
    rows: u64,
    cols: u64,
    k_done: u32,
    k_chunks: u32,
    dtype: String,
    data_crc32c: u32,
    fingerprint: Fingerprint,
}

/// The checkpoints of one step: where they live, what makes one valid, when to take the next,
/// and which tiles this run resumes from one.
pub(crate) struct Checkpoints {
    dir: PathBuf,
    fp: Fingerprint,
    /// Time between checkpoints of a tile; `None`: take none (existing ones are still used).
    every: Option<Duration>,
    dt: DType,
    gk: u64,
    tk: u64,
    k: u64,
    /// Tiles resumed from a checkpoint in this run: seq → k-chunks done before it.
    resume: BTreeMap<u32, u32>,
    /// Tiles whose file may exist (saved or resumed in this run), to remove once recorded.
    present: Mutex<BTreeSet<u32>>,
    /// Why saving a checkpoint failed (disk full, read-only directory): no more are taken in
    /// this run, which goes on; the caller says so once at the end of the step.
    failed: Mutex<Option<String>>,
    /// Set with `failed`, and never cleared: read on every GEMM without a lock.
    off: std::sync::atomic::AtomicBool,
    /// What this run saved so far ([`Checkpoints::saved`]).
    saves: AtomicU64,
    saved_bytes: AtomicU64,
    save_nanos: AtomicU64,
}

/// What a run's checkpoints cost ([`Checkpoints::saved`]), for the step's report: the saves
/// that succeeded (one that fails turns checkpoints off, and the run says why).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Saved {
    /// Checkpoints written (a tile saved five times counts five).
    pub(crate) count: u64,
    /// Their bytes (headers and accumulators).
    pub(crate) bytes: u64,
    /// Seconds spent writing and syncing them, the writeback threads together.
    pub(crate) secs: f64,
}

impl Saved {
    /// What was saved since `before` was read (one attempt of a step: a device failover
    /// makes another, with the same checkpoints).
    pub(crate) fn since(self, before: Saved) -> Saved {
        Saved {
            count: self.count - before.count,
            bytes: self.bytes - before.bytes,
            secs: self.secs - before.secs,
        }
    }
}

impl Checkpoints {
    /// The checkpoints of the step writing `output` (of depth `k`) under fingerprint `fp`, with
    /// the accumulators and k-chunks of `layout`, taken every `every`.
    pub(crate) fn new(
        output: &Path,
        fp: &Fingerprint,
        every: Option<Duration>,
        layout: &Layout,
        k: u64,
    ) -> Checkpoints {
        Checkpoints {
            dir: partial_dir(output),
            fp: fp.clone(),
            every,
            dt: layout.host_dt,
            gk: k.div_ceil(layout.tk),
            tk: layout.tk,
            k,
            resume: BTreeMap::new(),
            present: Mutex::new(BTreeSet::new()),
            failed: Mutex::new(None),
            off: std::sync::atomic::AtomicBool::new(false),
            saves: AtomicU64::new(0),
            saved_bytes: AtomicU64::new(0),
            save_nanos: AtomicU64::new(0),
        }
    }

    /// The checkpoints of `step` laid out as `layout`, under fingerprint `fp`, taken every
    /// `engine.checkpoint_every`: what a journaled target (a step's file, a shard) keeps.
    pub(crate) fn for_step(
        step: &crate::plan::Step,
        layout: &Layout,
        engine: &crate::plan::Engine,
        fp: &Fingerprint,
    ) -> Checkpoints {
        Checkpoints::new(&step.output, fp, engine.checkpoint_every, layout, step.k)
    }

    fn path(&self, seq: u32) -> PathBuf {
        self.dir.join(format!("tile{seq}.ckpt"))
    }

    /// k-chunks of a tile.
    pub(crate) fn k_chunks(&self) -> u64 {
        self.gk
    }

    /// Saving failed with `e`: take no more checkpoints in this run (the tiles are still
    /// computed and written; only what a kill would lose grows back to whole tiles).
    pub(crate) fn give_up(&self, e: &Error) {
        self.off.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut f = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        f.get_or_insert_with(|| e.to_string());
    }

    /// Why checkpoints were given up in this run, once.
    pub(crate) fn take_failure(&self) -> Option<String> {
        self.failed.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// The checkpoints this run saved so far, and what they cost.
    pub(crate) fn saved(&self) -> Saved {
        Saved {
            count: self.saves.load(Ordering::Relaxed),
            bytes: self.saved_bytes.load(Ordering::Relaxed),
            secs: self.save_nanos.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }

    /// Whether a tile last saved (or started) at `mark` is due for a checkpoint.
    pub(crate) fn due(&self, mark: Instant) -> bool {
        self.every.is_some_and(|e| mark.elapsed() >= e)
            && !self.off.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the run takes checkpoints (`engine.checkpoint_every` is not `"off"` and saving
    /// has not failed): a stopped run then saves its tiles in flight, whatever the interval.
    pub(crate) fn saving(&self) -> bool {
        self.every.is_some() && !self.off.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Tiles this run resumes from a checkpoint: seq → k-chunks already done.
    pub(crate) fn resumed(&self) -> &BTreeMap<u32, u32> {
        &self.resume
    }

    /// Elements of K that `chunks` k-chunks cover.
    pub(crate) fn k_elems(&self, chunks: u32) -> u64 {
        (chunks as u64 * self.tk).min(self.k)
    }

    /// Elements of K a tile had done before this run (0 unless resumed from a checkpoint).
    pub(crate) fn k_before(&self, seq: u32) -> u64 {
        self.resume.get(&seq).map_or(0, |&c| self.k_elems(c))
    }

    /// Delete every checkpoint of the step (`--restart`, or the step is complete).
    pub(crate) fn discard_all(&self) -> Result<()> {
        self.refuse_unusable_dir()?;
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(list_error(&self.dir, e)),
        };
        for ent in entries.flatten() {
            if parse_name(&ent.file_name().to_string_lossy()).is_some() {
                remove(&ent.path())?;
            }
        }
        self.remove_dir_if_empty();
        self.present.lock().unwrap().clear();
        Ok(())
    }

    /// [`refuse_unusable_dir`] of this step's folder.
    pub(crate) fn refuse_unusable_dir(&self) -> Result<()> {
        refuse_unusable_dir(&self.dir)
    }

    /// Remove the directory when nothing is left in it (another process of a split step may
    /// still have checkpoints there: then it stays).
    pub(crate) fn remove_dir_if_empty(&self) {
        let _ = std::fs::remove_dir(&self.dir);
    }

    /// Look at the checkpoints on disk of the tiles `mine` (all of the step's, or a shard's):
    /// keep the valid ones of tiles in `todo` (they are resumed), delete the rest. Returns a
    /// note for each one ignored.
    pub(crate) fn scan(
        &mut self,
        sched: &Schedule,
        todo: &BTreeSet<u32>,
        mine: std::ops::Range<u32>,
    ) -> Result<Vec<String>> {
        self.resume.clear();
        self.refuse_unusable_dir()?;
        let mut notes = Vec::new();
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(notes),
            Err(e) => return Err(list_error(&self.dir, e)),
        };
        let mut files: Vec<(u32, PathBuf)> = Vec::new();
        for ent in entries.flatten() {
            let name = ent.file_name().to_string_lossy().to_string();
            let Some((seq, tmp)) = parse_name(&name) else {
                continue;
            };
            if !mine.contains(&seq) || seq as usize >= sched.tiles.len() {
                continue; // another process's tile of a split step (or not ours to judge)
            }
            if tmp {
                // Left by a kill while a checkpoint was being written.
                remove(&ent.path())?;
            } else {
                files.push((seq, ent.path()));
            }
        }
        files.sort();
        for (seq, path) in files {
            if !todo.contains(&seq) {
                // The tile was recorded finished: killed before its checkpoint was removed.
                remove(&path)?;
                continue;
            }
            match self.check(&path, &sched.tiles[seq as usize]) {
                Ok(k_done) => {
                    self.resume.insert(seq, k_done);
                    self.present.lock().unwrap().insert(seq);
                }
                Err(why) => {
                    notes.push(format!(
                        "ignoring the checkpoint {} of output tile {seq}: {why}; the tile is computed from its start",
                        path.display()
                    ));
                    remove(&path)?;
                }
            }
        }
        Ok(notes)
    }

    /// The k-chunks done that the checkpoint at `path` of `tile` holds, when it is valid for this
    /// step; else why not.
    fn check(&self, path: &Path, tile: &OutTile) -> std::result::Result<u32, String> {
        let f = File::open(path).map_err(|e| format!("cannot open it ({e})"))?;
        let mut r = BufReader::with_capacity(1 << 20, f);
        let h = read_header(&mut r)?;
        self.matches(&h, tile)?;
        let crc = crc_of(&mut r, self.data_len(tile))?;
        if crc != h.data_crc32c {
            return Err(format!(
                "its data's CRC-32C is {crc:08x}, the header says {:08x} (corrupt)",
                h.data_crc32c
            ));
        }
        Ok(h.k_done)
    }

    fn data_len(&self, tile: &OutTile) -> u64 {
        tile.block.elems() as u64 * self.dt.size() as u64
    }

    /// Whether header `h` describes a checkpoint of `tile` in this step.
    fn matches(&self, h: &Header, tile: &OutTile) -> std::result::Result<(), String> {
        let b = &tile.block;
        if !crate::durable::journal::same_fingerprint(&h.fingerprint, &self.fp) {
            return Err("it is from a different plan or different inputs".into());
        }
        if (h.seq, h.r0, h.c0, h.rows, h.cols) != (tile.seq, b.r0, b.c0, b.rows, b.cols) {
            return Err("it describes a different output tile".into());
        }
        if h.dtype != self.dt.name() {
            return Err(format!("its dtype is {}, not {}", h.dtype, self.dt));
        }
        if h.k_chunks as u64 != self.gk || h.k_done == 0 || h.k_done as u64 >= self.gk {
            return Err(format!(
                "it says {} of {} k-chunks are done, for a tile of {} k-chunks",
                h.k_done, h.k_chunks, self.gk
            ));
        }
        Ok(())
    }

    /// Read the accumulator of resumed `tile` into `dst` (its first `elems·size` bytes),
    /// checking again that the file is the one [`Checkpoints::scan`] accepted. A file changed
    /// since then is deleted and is an error (the next run recomputes the tile).
    pub(crate) fn read_into(&self, tile: &OutTile, dst: &mut [u8]) -> Result<()> {
        let path = self.path(tile.seq);
        let want = self.resume.get(&tile.seq).copied();
        let r = (|| -> std::result::Result<(), String> {
            let f = File::open(&path).map_err(|e| format!("cannot open it ({e})"))?;
            let mut r = BufReader::with_capacity(1 << 20, f);
            let h = read_header(&mut r)?;
            self.matches(&h, tile)?;
            if Some(h.k_done) != want {
                return Err("it changed since the run started".into());
            }
            let n = self.data_len(tile) as usize;
            let dst = &mut dst[..n];
            r.read_exact(dst)
                .map_err(|e| format!("cannot read its data ({e})"))?;
            let crc = crate::store::tiled::par_crc32c(dst);
            if crc != h.data_crc32c {
                return Err("its data changed since the run started (CRC mismatch)".into());
            }
            Ok(())
        })();
        r.map_err(|why| {
            let _ = std::fs::remove_file(&path);
            Error::Usage(format!(
                "{}: checkpoint of output tile {}: {why}; it was deleted, run the same command again to recompute the tile",
                path.display(),
                tile.seq
            ))
        })
    }

    /// Save `data` (the accumulator of `tile` after `k_done` k-chunks) as the tile's
    /// checkpoint: temporary file, fsync, rename over the previous one, fsync the directory.
    pub(crate) fn save(&self, tile: &OutTile, k_done: u32, data: &[u8]) -> Result<()> {
        let t = Instant::now();
        let n = self.data_len(tile) as usize;
        let data = &data[..n];
        let b = &tile.block;
        let h = Header {
            seq: tile.seq,
            r0: b.r0,
            c0: b.c0,
            rows: b.rows,
            cols: b.cols,
            k_done,
            k_chunks: self.gk as u32,
            dtype: self.dt.name().into(),
            data_crc32c: crate::store::tiled::par_crc32c(data),
            fingerprint: self.fp.clone(),
        };
        let json = serde_json::to_string(&h).expect("checkpoint header serializes");
        let line = format!("{MAGIC} {:08x} {json}\n", crc32c::crc32c(json.as_bytes()));
        self.refuse_unusable_dir()?;
        if !self.dir.is_dir() {
            std::fs::create_dir_all(&self.dir)
                .map_err(|e| Error::io(&self.dir, "cannot create the checkpoint directory", e))?;
            crate::store::fsutil::sync_parent(&self.dir)?;
        }
        let path = self.path(tile.seq);
        // A temporary file of its own (never through a link), synced, renamed over the last
        // checkpoint; the directory is synced by the rename (`TempOutput::commit`).
        let tmp = TempOutput::new(&path, (line.len() + n) as u64)?;
        let mut f = tmp.file();
        (f.write_all(line.as_bytes()))
            .and_then(|_| f.write_all(data))
            .map_err(|e| Error::io(&path, "cannot write the tile's checkpoint", e))?;
        tmp.commit()?;
        self.present.lock().unwrap().insert(tile.seq);
        let took = t.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        self.saves.fetch_add(1, Ordering::Relaxed);
        (self.saved_bytes).fetch_add((line.len() + n) as u64, Ordering::Relaxed);
        self.save_nanos.fetch_add(took, Ordering::Relaxed);
        Ok(())
    }

    /// The tile `seq` is recorded in the journal: its checkpoint has served.
    pub(crate) fn finished(&self, seq: u32) -> Result<()> {
        if self.present.lock().unwrap().remove(&seq) {
            remove(&self.path(seq))?;
        }
        Ok(())
    }
}

/// The tile of a checkpoint's file name, and whether it is a temporary file
/// (`tile<seq>.ckpt`, or `tile<seq>.ckpt.<pid>.<random>.partial` being written — earlier
/// versions wrote `tile<seq>.ckpt.tmp<pid>`); `None` for any other name.
fn parse_name(name: &str) -> Option<(u32, bool)> {
    let (seq, rest) = name.strip_prefix("tile")?.split_once(".ckpt")?;
    let seq = seq.parse().ok()?;
    match rest {
        "" => Some((seq, false)),
        r if r.starts_with(".tmp") => Some((seq, true)),
        _ => temp_writer(name, &format!("tile{seq}.ckpt")).map(|_| (seq, true)),
    }
}

/// Remove a checkpoint file; a directory of that name is not ours and stays.
fn remove(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::IsADirectory || path.is_dir() => Ok(()),
        Err(e) => Err(Error::io(path, "cannot remove a checkpoint", e)),
    }
}

/// The header line of a checkpoint, checked against its own CRC.
fn read_header(r: &mut impl BufRead) -> std::result::Result<Header, String> {
    let mut line = Vec::new();
    r.take(MAX_HEADER)
        .read_until(b'\n', &mut line)
        .map_err(|e| format!("cannot read it ({e})"))?;
    let text = std::str::from_utf8(&line).map_err(|_| "its header is not text".to_string())?;
    let rest = text
        .strip_suffix('\n')
        .and_then(|t| t.strip_prefix(MAGIC))
        .and_then(|t| t.strip_prefix(' '))
        .ok_or("it is not a checkpoint this version understands")?;
    let (crc, json) = rest.split_once(' ').ok_or("its header is cut short")?;
    if u32::from_str_radix(crc, 16).ok() != Some(crc32c::crc32c(json.as_bytes())) {
        return Err("its header does not match its CRC (corrupt)".into());
    }
    serde_json::from_str(json).map_err(|e| format!("its header is unreadable ({e})"))
}

/// CRC-32C of exactly the next `len` bytes of `r`, which must then be at its end.
fn crc_of(r: &mut impl Read, len: u64) -> std::result::Result<u32, String> {
    let mut crc = 0u32;
    let mut left = len;
    let mut buf = vec![0u8; 1 << 20];
    while left > 0 {
        let want = left.min(buf.len() as u64) as usize;
        let got = r
            .read(&mut buf[..want])
            .map_err(|e| format!("cannot read its data ({e})"))?;
        if got == 0 {
            return Err(format!(
                "its data is cut short ({} of {len} bytes)",
                len - left
            ));
        }
        crc = crc32c::crc32c_append(crc, &buf[..got]);
        left -= got as u64;
    }
    if r.read(&mut buf[..1]).map_err(|e| e.to_string())? != 0 {
        return Err("it is longer than its header says".into());
    }
    Ok(crc)
}

/// The error for a checkpoint folder that cannot be listed, with what to do when something
/// else has its name.
fn list_error(dir: &Path, e: std::io::Error) -> Error {
    if dir.exists() && !dir.is_dir() {
        return not_a_folder(dir);
    }
    Error::io(dir, "cannot list checkpoints", e)
}

/// The error for something at the checkpoint folder's name that is not a folder.
fn not_a_folder(dir: &Path) -> Error {
    Error::Usage(format!(
        "{}: is not a folder, but run keeps the step's checkpoints there; move or delete it and rerun",
        dir.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Block;

    /// The checkpoints of a step of 4 k-chunks writing `output`, taken every time.
    fn ckpts(output: &Path) -> Checkpoints {
        Checkpoints {
            dir: partial_dir(output),
            fp: [("expr".to_string(), "A @ B".to_string())].into(),
            every: Some(Duration::ZERO),
            dt: DType::F32,
            gk: 4,
            tk: 1,
            k: 4,
            resume: BTreeMap::new(),
            present: Mutex::new(BTreeSet::new()),
            failed: Mutex::new(None),
            off: std::sync::atomic::AtomicBool::new(false),
            saves: AtomicU64::new(0),
            saved_bytes: AtomicU64::new(0),
            save_nanos: AtomicU64::new(0),
        }
    }

    fn tile(seq: u32) -> OutTile {
        OutTile {
            seq,
            ti: 0,
            tj: seq as u64,
            block: Block {
                r0: 0,
                c0: 2 * seq as u64,
                rows: 2,
                cols: 2,
            },
        }
    }

    /// A link planted where a checkpoint's temporary file went (`tile<seq>.ckpt.tmp<pid>`, the
    /// name earlier versions used) after the run's scan is never followed: its target keeps its
    /// bytes and the checkpoint is a regular file.
    #[test]
    fn a_link_at_a_temporary_name_is_never_followed() {
        let d = tempfile::tempdir().unwrap();
        let c = ckpts(&d.path().join("C.mgt"));
        let victim = d.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        std::fs::create_dir(&c.dir).unwrap();
        let planted = c.dir.join(format!("tile0.ckpt.tmp{}", std::process::id()));
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        c.save(&tile(0), 2, &[7u8; 16]).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert!(std::fs::symlink_metadata(c.path(0)).unwrap().is_file());
        // Temporary names, this version's and earlier ones', are told from checkpoints.
        assert_eq!(parse_name("tile3.ckpt"), Some((3, false)));
        assert_eq!(parse_name("tile3.ckpt.tmp12"), Some((3, true)));
        assert_eq!(
            parse_name("tile3.ckpt.12.aB3xYz9Q.partial"),
            Some((3, true))
        );
        assert_eq!(parse_name("tile3.ckpt.other"), None);
    }
}
