//! Direct uploads: the devices copy input blocks straight out of the files' pages.
//!
//! Staging used to copy every input block from the file's map into a pinned buffer, and only
//! then could the GPU copy it. With tensor-core precisions that copy was the bottleneck: on the
//! H200 host one thread copies from the page cache into pinned memory at 5.8 GB/s, sixteen at
//! 38–45 GB/s, and 32768² tf32 spent 0.55 s of its 0.7 s step staging while the GEMMs took
//! 0.17 s. The driver can instead page-lock the file's own pages (`cuMemHostRegister` with
//! `READ_ONLY` on the read-only map): one thread registers page-cache pages at 40–50 GB/s,
//! releases them at ~130 GB/s, and the GPU then copies from them at the pinned rate, 54.5 GB/s
//! (`tools/probes/h2d_from_page_cache.py`, docs/measurements/2026-12-02b-h200-1-probes.log).
//!
//! So for a block whose format has it ([`MatrixSource::mapped_block`]: a `.mgt` file of the
//! compute dtype), staging hands the lane the block's rectangles in the map and the page-locked
//! storage tiles behind them ([`DirectUpload`]); the lane copies each rectangle into the slot.
//! A storage tile is registered the first time a block needs it and stays registered for later
//! blocks until the registered total would pass the budget, when idle tiles are released — the
//! one needed again last first, where one lane's loads are known ahead ([`Foresight`]), else
//! the one used longest ago; everything is released when the step ends. Locked pages are host memory the kernel
//! cannot reclaim (under a cgroup limit — SLURM's `--mem`, a container — more than that is an OOM
//! kill), so the budget is part of `engine.host_memory`: what the step's pools leave of it, and at
//! most half the memory the host can spare when the step starts ([`limits`]). It is a bound, not
//! a goal: a block whose ranges do not fit beside those in use (which are never released) is
//! copied instead, so pools plus locked pages never pass `host_memory`. Storage tiles are page-aligned and `tile_stride` apart
//! (docs/FORMAT.md), so their ranges never overlap and each is registered once.
//!
//! Checks stay, off the devices' path: a storage tile's CRC is verified and NaN/Inf are counted
//! for every block uploaded, as the copy did, by a `check` stage that reads the pages while the
//! device copies them ([`CheckProgress`]). In the copy path these checks ride along with the
//! copy; here they would cost as much as it did (they, not the copy, were most of the staging
//! work: a first version that ran them before each upload was no faster than copying), so the
//! upload does not wait for them; instead no output tile is written until every check issued
//! before its last upload has passed, so a corrupt input still stops the run before any tile
//! computed from it is written or recorded. A lane that can check on its device
//! ([`crate::backend::check`]: a GPU's tf32/bf16/fp16 lanes) does so right after the copy, and
//! the `check` stage only compares what the device found with the checksum table, instead of
//! reading the pages again.
//!
//! When it is not used (`engine.staging`): `"copy"` never; `"auto"` (the default) for blocks
//! whose pages are all in the page cache — a block still on disk is read the usual way, whose
//! parallel reads run at the disk's speed, where registering would fault its pages in one by
//! one; `"direct"` for every block it can. A registration that fails (a kernel or driver that
//! refuses, memory locked elsewhere) turns direct uploads off for the rest of the step, and the
//! report says why. On the CPU the "registration" is nothing and the lane copies the
//! rectangles into its slot, which saves the staging copy there too.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use super::pool::Lease;
use crate::backend::check::DeviceCheck;
use crate::backend::{HostRun, InputPinner};
use crate::dtype::DType;
use crate::plan::StagingMode;
use crate::seam::DeviceCheckSpec;
use crate::store::runs::Run;
use crate::store::{Block, MappedBlock, MatrixSource};

/// The registry of page-locked storage tiles of one step's inputs, shared by its lanes.
pub(crate) struct DirectReads {
    pinner: Arc<dyn InputPinner>,
    mode: StagingMode,
    /// The rule `auto` copies by ([`Pinning::rule_for`]), and the files whose every block it
    /// copies ([`copied_files`]).
    rule: AutoCopies,
    copied: Vec<std::path::PathBuf>,
    /// Registered bytes allowed at once (idle ranges are released above it).
    budget: u64,
    /// Bytes registered at once: whole consecutive storage tiles, about [`CHUNK`] bytes.
    chunk: u64,
    /// Registered ranges by their first byte's address.
    entries: Mutex<HashMap<usize, Arc<Entry>>>,
    registered: AtomicU64,
    /// The most registered at once.
    peak: AtomicU64,
    tick: AtomicU64,
    /// Why direct uploads stopped, if a registration failed.
    failed: OnceLock<String>,
    /// The order of the step's loads, when known ([`Self::foresee`]): which range a full
    /// budget lets go of.
    foresight: OnceLock<Foresight>,
    /// Loads staged so far (every kind: direct, copied, from a GPU array), counted by the
    /// staging stage ([`Self::count_load`]): with one lane, the position in [`Foresight`]'s
    /// sequence of the load being staged, plus one.
    loads: AtomicU64,
    stats: Counts,
    /// The sources whose maps the entries point into: dropped only after every range is
    /// released ([`Drop`]).
    _sources: Vec<Arc<dyn MatrixSource>>,
}

#[derive(Default)]
struct Counts {
    bytes: AtomicU64,
    cold_blocks: AtomicU64,
    copied_blocks: AtomicU64,
    oversize_blocks: AtomicU64,
    full_blocks: AtomicU64,
    register_ns: AtomicU64,
    registered_bytes: AtomicU64,
    released_bytes: AtomicU64,
}

/// What direct uploads did in a step, for the report.
#[derive(Clone, Debug, Default)]
pub(crate) struct DirectStats {
    /// Input bytes uploaded straight from the files' pages.
    pub(crate) bytes: u64,
    /// Blocks copied instead because their pages were not all in memory (`auto`).
    pub(crate) cold_blocks: u64,
    /// Blocks copied instead by `auto`'s rule on a GPU ([`auto_copies`]): under fp64 every
    /// block, under fp32 and `fp64_emulated` those of row-major files at most half as wide as
    /// the file, whose bands of whole rows would be page-locked for them.
    pub(crate) copied_blocks: u64,
    /// Blocks copied instead because one range they lie in is larger than the budget (a large
    /// `.npy` or raw file is one range), and that budget.
    pub(crate) oversize_blocks: u64,
    /// Blocks copied instead because the ranges in use left no room for theirs in the budget.
    pub(crate) full_blocks: u64,
    pub(crate) budget: u64,
    /// The rule `auto` copied `copied_blocks` by.
    pub(crate) copy_rule: AutoCopies,
    /// The most bytes page-locked at once.
    pub(crate) peak_locked: u64,
    /// Bytes registered, and the seconds that took (all threads together).
    pub(crate) registered_bytes: u64,
    pub(crate) register_s: f64,
    /// Bytes released early to stay under the budget.
    pub(crate) released_bytes: u64,
    /// Why direct uploads stopped part-way, if they did.
    pub(crate) failed: Option<String>,
}

/// One registered range: a storage tile of an input file.
struct Entry {
    ptr: usize,
    len: usize,
    st: Mutex<EntryState>,
}

#[derive(Default)]
struct EntryState {
    /// Uploads in flight that use the range.
    users: usize,
    registered: bool,
    /// When it was last pinned (the registry's tick), for releasing the oldest first.
    last: u64,
}

/// A range kept registered while an upload (or its check) uses it.
pub(crate) struct Pin(Arc<Entry>);

/// Why a range could not be pinned.
enum PinError {
    /// The budget has no room for it beside the ranges in use: copy this block.
    Full,
    /// Registering failed (the driver's words): copy the rest of the step.
    Failed(String),
}

impl Clone for Pin {
    fn clone(&self) -> Pin {
        self.0.st.lock().unwrap_or_else(|e| e.into_inner()).users += 1;
        Pin(self.0.clone())
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        let mut st = self.0.st.lock().unwrap_or_else(|e| e.into_inner());
        st.users -= 1;
    }
}

/// A block ready to be copied by a lane straight from the page-locked map: its rectangles, the
/// pins that keep them registered, and a staging buffer leased as a token, so that no more
/// blocks are in flight than with copies (the pool's backpressure), until the copy is done.
pub(crate) struct DirectUpload {
    pub(crate) runs: Vec<HostRun>,
    /// The checks of this block: done once `progress` reaches the number.
    pub(crate) check: Option<(Arc<CheckProgress>, u64)>,
    /// Where the lane that copies the block sends its check on the device, and what to check
    /// ([`crate::backend::check`]); the check stage waits for it (or, the sender dropped,
    /// checks the block itself).
    pub(crate) device_check: Mutex<Option<(DeviceCheckTx, DeviceCheckSpec)>>,
    pins: Vec<Pin>,
    _token: Lease,
}

/// Lane → check stage: a block's check on the device, on its way.
pub(crate) type DeviceCheckTx = crossbeam_channel::Sender<Box<dyn DeviceCheck>>;

impl DirectUpload {
    /// A block of an array in GPU memory ([`MatrixSource::device_block`]): one rectangle the
    /// lane copies device to device into its slot, nothing registered or checked on the host.
    /// `token` is kept until the upload is done, as for a file's block.
    pub(crate) fn from_device(d: &crate::store::DeviceBlock, token: Lease) -> DirectUpload {
        DirectUpload {
            runs: vec![HostRun {
                host: d.addr as *const u8,
                device: true,
                host_pitch: d.pitch,
                dst_off: 0,
                dst_pitch: d.row_len,
                row_len: d.row_len,
                rows: d.rows,
            }],
            check: None,
            device_check: Mutex::new(None),
            pins: Vec::new(),
            _token: token,
        }
    }
    /// The block's ranges kept registered for as long as the returned pins live (its check
    /// holds them, so that the pages it reads cannot be released and evicted meanwhile).
    pub(crate) fn pins(&self) -> Vec<Pin> {
        self.pins.clone()
    }
}

/// A block that can go direct, decided before anything is leased or registered
/// ([`DirectReads::eligible`]).
pub(crate) struct Eligible<'f> {
    mb: MappedBlock<'f>,
    ranges: Vec<std::ops::Range<u64>>,
}

/// The loads of a step's one lane in the order its planner issues them, worked out before the
/// step starts by running the planner's model ahead ([`DirectReads::foresee`]), so that a full
/// budget releases the idle range needed again last — none again first — instead of the one
/// used longest ago. Least-recently-used is the worst choice for the cyclic reuse of a
/// product's inputs: 32768² fp64 from `.npy` on one H200 with `host_memory = "16GiB"` (11.5 GiB
/// to lock, 16 GiB of inputs, each block registering its whole band of rows) registered 23.6 GB
/// to upload 17.2 — 11.3 GB released and registered again — and its staging thread, which
/// registers, set the pace (2.70 s against 1.23 s of GEMMs; docs/measurements/2026-12-05b-h200-3-roofline-gpu-arrays-dask.log).
/// Releasing by next use is Belady's rule, optimal for a known sequence.
struct Foresight {
    /// Positions of the loads that use each range, by the range's address.
    uses: HashMap<usize, Vec<u32>>,
}

impl Foresight {
    /// The position of the next load from `now` on (the load being staged included: a block
    /// pinning its ranges one by one must not let go of its own) that uses the range at `ptr`;
    /// `u32::MAX` when none does.
    fn next_use(&self, ptr: usize, now: u64) -> u32 {
        let now = now.min(u32::MAX as u64) as u32;
        (self.uses.get(&ptr))
            .and_then(|u| u.get(u.partition_point(|&p| p < now)).copied())
            .unwrap_or(u32::MAX)
    }
}

/// How many of a lane's checks (CRC, NaN/Inf count) of directly uploaded blocks have passed, in
/// the order they were issued; writeback waits on it before writing a tile.
#[derive(Default)]
pub(crate) struct CheckProgress {
    /// Checks passed, and whether the check stage has stopped.
    done: Mutex<(u64, bool)>,
    cv: std::sync::Condvar,
}

impl CheckProgress {
    /// Checks `0..n` have passed.
    pub(crate) fn set(&self, n: u64) {
        self.done.lock().unwrap_or_else(|e| e.into_inner()).0 = n;
        self.cv.notify_all();
    }
    /// The check stage has stopped (its end, an error or a panic): checks not passed by now
    /// never will be, and whoever waits for them is told so instead of waiting forever.
    pub(crate) fn close(&self) {
        self.done.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        self.cv.notify_all();
    }
    /// Wait until checks `0..n` have passed; `Err(Cancelled)` once the run is cancelled (a
    /// failed check cancels it).
    pub(crate) fn wait_for(
        &self,
        n: u64,
        ctl: &super::control::Control,
    ) -> crate::error::Result<()> {
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        while done.0 < n {
            if ctl.is_cancelled() {
                return Err(crate::error::Error::Cancelled);
            }
            if done.1 {
                return Err(crate::error::Error::Usage(
                    "the check stage stopped before checking every input block uploaded (this is a bug; please report it)".into(),
                ));
            }
            done = (self.cv)
                .wait_timeout(done, std::time::Duration::from_millis(10))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }
}

/// The registered bytes allowed when nothing says otherwise (no `/proc/meminfo`).
const DEFAULT_BUDGET: u64 = 8 << 30;

/// How much is registered at once. A registration costs about 0.25 ms beside its 40–50 GB/s,
/// so registering each 4 MiB storage tile of a 32768² file (2048 calls) took 0.70 s for its
/// 8 GiB and releasing them 0.20 s (docs/measurements/2026-12-02b-h200-3-*.log); 64 chunks of
/// 128 MiB took 0.24 s and 0.08 s. But a block registers the whole chunks its tiles lie in,
/// and with 128 MiB (a whole band of 32 tiles) the first blocks registered 4× their size
/// before the first GEMM could start (0.07–0.08 s after the step's start against 0.04 s
/// with copies, call 5). Consecutive storage tiles are contiguous in the file, so a chunk is a
/// run of them, the next blocks of the same band use its other tiles, and 32 MiB — the eight
/// 4 MiB tiles of an 8192-wide block's row, aligned — keeps both costs small.
const CHUNK: u64 = 32 << 20;

/// The page size registrations are aligned to (4 KiB on the machines here; a larger page
/// size is a multiple of it, and the driver rounds to its own pages).
const PAGE: u64 = 4096;

/// Bytes that may be page-locked at once: half the memory the host can spare now.
fn budget() -> u64 {
    crate::store::fsutil::memory_headroom()
        .map(|h| h / 2)
        .unwrap_or(DEFAULT_BUDGET)
}

/// The registration budget and range size of a step whose pools take `pools` bytes of
/// `host_memory`, registering through a pinner with limits `fixed` (the simulated devices'
/// tests fix them; `None`: half the memory the host can spare, and [`CHUNK`]): what the pools
/// leave of `host_memory`, and at most that cap ([`lock_budget`]); ranges of at most an eighth
/// of it, so that a small budget still holds several.
pub(crate) fn limits(fixed: Option<(u64, u64)>, host_memory: u64, pools: u64) -> (u64, u64) {
    let (cap, chunk) = fixed.unwrap_or_else(|| (budget(), CHUNK));
    let b = lock_budget(host_memory, pools, cap);
    (b, chunk.min((b / 8).max(PAGE)))
}

/// Bytes of the input files that may be page-locked at once: `host_memory` less the step's
/// pools (`pools`, the layout's `host_bytes`: every host buffer the step may allocate, lazy
/// ones included), and at most `cap`. Pools plus locked pages never pass `host_memory`.
pub(crate) fn lock_budget(host_memory: u64, pools: u64, cap: u64) -> u64 {
    host_memory.saturating_sub(pools).min(cap)
}

/// `runs` cut so that no piece crosses a boundary `data + c·per` (where one registered range ends
/// and the next begins, [`DirectReads::ranges`]): rows wholly inside one range stay together,
/// a row that crosses a boundary becomes two one-row pieces. The pieces cover exactly the bytes
/// of `runs` and land where they did.
fn split_at_ranges(runs: &[Run], data: u64, per: u64) -> Vec<Run> {
    let range = |off: u64| (off - data) / per;
    let mut out = Vec::with_capacity(runs.len());
    for r in runs {
        let last_byte = |i: usize| r.file_off + i as u64 * r.file_pitch + r.row_len as u64 - 1;
        if range(r.file_off) == range(last_byte(r.rows - 1)) {
            out.push(*r);
            continue;
        }
        let mut i = 0;
        while i < r.rows {
            let (off, buf) = r.row(i);
            let c = range(off);
            if range(last_byte(i)) != c {
                // This row crosses into the next range: cut it at the boundary.
                let cut = (data + (c + 1) * per - off) as usize;
                let one = |file_off: u64, buf_off: usize, row_len: usize| Run {
                    file_off,
                    file_pitch: r.file_pitch,
                    buf_off,
                    buf_pitch: r.buf_pitch,
                    row_len,
                    rows: 1,
                };
                out.push(one(off, buf, cut));
                out.push(one(off + cut as u64, buf + cut, r.row_len - cut));
                i += 1;
                continue;
            }
            // Rows i.. while each lies wholly inside range c.
            let mut n = 1;
            while i + n < r.rows && range(r.row(i + n).0) == c && range(last_byte(i + n)) == c {
                n += 1;
            }
            out.push(Run {
                file_off: off,
                buf_off: buf,
                rows: n,
                ..*r
            });
            i += n;
        }
    }
    out
}

/// The ranges of `mb`'s file that its block registers, in ranges of about `chunk` bytes
/// ([`DirectReads::ranges`]): whole storage tiles of a `.mgt`, whole-row bands of a row-major
/// file, at least one, each clipped to the file's data and starting on a page.
pub(crate) fn block_ranges(chunk: u64, mb: &MappedBlock) -> Vec<std::ops::Range<u64>> {
    let per = range_per(chunk, mb);
    let mut idx: Vec<u64> = (mb.spans.iter())
        .map(|s| (s.start - mb.data.start) / per)
        .collect();
    idx.sort_unstable();
    idx.dedup();
    // Registration takes whole pages: a `.mgt`'s tiles start on one, a row-major file's data
    // (one range) may not.
    let page = PAGE - 1;
    idx.into_iter()
        .map(|c| {
            let start = mb.data.start + c * per;
            start & !page..(start + per).min(mb.data.end)
        })
        .collect()
}

/// The bytes of one registered range of `mb`'s file before it is clipped to the data: the
/// whole tiles or row bands in about `chunk` bytes, at least one.
fn range_per(chunk: u64, mb: &MappedBlock) -> u64 {
    (chunk / mb.stride).max(1) * mb.stride
}

/// The bytes of every range [`block_ranges`] gives `mb`'s block: what the block holds
/// registered at once.
pub(crate) fn block_range_bytes(chunk: u64, mb: &MappedBlock) -> u64 {
    (block_ranges(chunk, mb).iter())
        .map(|r| r.end - r.start)
        .sum()
}

/// The largest range [`block_ranges`] gives `mb`'s block.
pub(crate) fn largest_range(chunk: u64, mb: &MappedBlock) -> u64 {
    (block_ranges(chunk, mb).iter())
        .map(|r| r.end - r.start)
        .max()
        .unwrap_or(0)
}

/// Whether every block of `sources` (a step's A and B, each with its first block) is expected
/// to go straight from the files' pages, so that the staging pool's leases need no memory
/// unless a block is copied after all ([`super::pool::Pool::lazy`]): `staging` is not `copy`,
/// the backend uploads from maps (`pinner`: [`Pinning`]), the step has no added matrix
/// (`added`: staging always copies C0, once per output tile), each source maps its blocks at
/// `host` in ranges the budget can hold, it is not one of the `copied` files, whose blocks are
/// all copied ([`copied_sources`]) and its data looks in the page cache now (1024 pages sampled: a
/// guess, and a wrong one only costs buffers made while the step runs). Arrays on a GPU
/// ([`MatrixSource::device_block`]) go device to device whatever `staging` says (a lane on
/// another GPU, or a CPU lane, reads them through a pool buffer made then).
pub(crate) fn expected(
    mode: StagingMode,
    pinner: Option<Pinning>,
    sources: &[(&dyn MatrixSource, Block)],
    copied: &[std::path::PathBuf],
    added: bool,
    host: DType,
) -> bool {
    if added {
        return false;
    }
    let pinner = pinner.filter(|_| mode != StagingMode::Copy);
    sources.iter().all(|&(f, first)| {
        if f.device_block(&Block::FIRST, host).is_some() {
            return true;
        }
        let Some(p) = pinner else {
            return false;
        };
        !copied.iter().any(|n| n == f.path())
            && f.mapped_block(&first, host).is_some_and(|mb| {
                p.holds(&mb)
                    && (mode == StagingMode::Direct || mb.cached_sampled(mb.data.clone(), 1024))
            })
    })
}

/// How a backend's [`InputPinner`] registers, for [`expected`]: the budget and range size
/// ([`limits`]), and which files' blocks `auto` copies ([`auto_copies`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pinning {
    pub(crate) budget: u64,
    pub(crate) chunk: u64,
    pub(crate) copies: AutoCopies,
}

impl Pinning {
    /// What `staging = mode` copies by rule ([`auto_copies`]): only `auto` has one.
    pub(crate) fn rule(&self, mode: StagingMode) -> AutoCopies {
        match mode {
            StagingMode::Auto => self.copies,
            _ => AutoCopies::Nothing,
        }
    }

    /// What `staging = mode` copies for a step reading its files as `roles`: [`Self::rule`],
    /// except that where it would lock files larger together than the budget, every file is
    /// copied ([`AutoCopies::Overflow`]). 65536² fp32 from `.mgt` (32 GiB of inputs) on one
    /// H100 with `host_memory = "16GiB"`: 12.16–12.21 s locking (18.2 GiB of ranges released
    /// and locked again, the GPU 88 % busy) against 10.72 s copying (99 %), and 10.92 s
    /// locking with `"32GiB"` (docs/decisions/0026-copy-inputs-larger-than-the-lock-budget.md).
    /// Measured for fp32 (`fp64_emulated`, on the same rule, follows unmeasured); fp64 copies
    /// every file already, and tf32/bf16/fp16 (whose copies set the pace in core) keep theirs.
    /// Only files the run would lock count ([`Role::lockable`]), each once, by its length.
    pub(crate) fn rule_for(&self, mode: StagingMode, roles: &[Role<'_>]) -> AutoCopies {
        let rule = self.rule(mode);
        if rule != AutoCopies::Narrow {
            return rule;
        }
        let locked = copied_files(rule, roles);
        let mut seen: Vec<&std::path::Path> = Vec::new();
        let mut bytes = 0u64;
        for r in roles {
            if r.lockable && !locked.iter().any(|p| p == r.path) && !seen.contains(&r.path) {
                seen.push(r.path);
                bytes = bytes.saturating_add(r.bytes);
            }
        }
        match bytes > self.budget {
            true => AutoCopies::Overflow,
            false => rule,
        }
    }

    /// Whether the budget holds each range `mb`'s block registers ([`block_ranges`]), as
    /// [`DirectReads::eligible`] judges it: if not, its blocks are copied
    /// (`direct_oversize_blocks`).
    pub(crate) fn holds(&self, mb: &MappedBlock) -> bool {
        largest_range(self.chunk, mb) <= self.budget
    }

    /// Registering in ranges of `limits` ([`limits`]: budget, chunk), through a pinner that
    /// locks pages or not (`locks`), for lanes computing in `p`.
    pub(crate) fn new(
        (budget, chunk): (u64, u64),
        locks: bool,
        p: crate::plan::Precision,
    ) -> Pinning {
        Pinning {
            budget,
            chunk,
            copies: auto_copies(locks, p),
        }
    }
}

/// Which input files `staging = "auto"` copies every block of, instead of page-locking them, on
/// a device that locks pages ([`copied_files`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum AutoCopies {
    /// None: every block goes straight from its file's pages where it can.
    #[default]
    Nothing,
    /// Files stored in bands of whole rows (`.npy`, raw) whose blocks are at most half as wide
    /// as the file: locking a block would lock the bands it lies in, the file's whole width.
    Narrow,
    /// Every input file.
    Every,
    /// B's file (the second of the roles), A's locked: staging's threads copy while the
    /// driver's one thread page-locks. Only by `MGMM_AUTO_COPIES=b`, to measure it.
    B,
    /// Every input file, where [`AutoCopies::Narrow`] would lock files larger together than
    /// what may be page-locked at once ([`Pinning::rule_for`]).
    Overflow,
}

impl AutoCopies {
    /// The rule's name in the report (`direct_copy_rule`); empty for [`AutoCopies::Nothing`].
    pub(crate) fn name(self) -> &'static str {
        match self {
            AutoCopies::Nothing => "",
            AutoCopies::Narrow => "narrow",
            AutoCopies::Every => "every",
            AutoCopies::B => "b",
            AutoCopies::Overflow => "overflow",
        }
    }

    /// The rule a report's `direct_copy_rule` names ([`Self::name`]); `Narrow` for an older
    /// report, which had no such field and only that rule.
    pub(crate) fn from_name(name: &str) -> AutoCopies {
        [AutoCopies::Every, AutoCopies::B, AutoCopies::Overflow]
            .into_iter()
            .find(|r| r.name() == name)
            .unwrap_or(AutoCopies::Narrow)
    }

    /// How the run's summary says why blocks were copied by the rule, after their count
    /// (`budget`: what might be page-locked).
    pub(crate) fn staged(self, budget: u64) -> String {
        match self {
            AutoCopies::Every => "staged by copy: under fp64 the copies feed the GEMMs sooner than page-locking the files".to_string(),
            AutoCopies::Overflow => format!("staged by copy: the input files together are larger than the {} that may be page-locked, and locking them would release and lock ranges again all through the step", crate::units::fmt_bytes(budget)),
            AutoCopies::B => "of B's file staged by copy (MGMM_AUTO_COPIES=b)".to_string(),
            AutoCopies::Narrow | AutoCopies::Nothing => "of row-major files staged by copy: locking the whole rows they lie in would take longer".to_string(),
        }
    }

    /// Why the rule copies a file's blocks, as `plan` says it on the file's line.
    pub(crate) fn why(self) -> &'static str {
        match self {
            AutoCopies::Every => "fp64 on a GPU: staging's copies feed the GEMMs sooner than page-locking the file",
            AutoCopies::Overflow => "the input files together are larger than what host_memory leaves beside the pools to keep page-locked: locking them would release and lock ranges again on the driver's one thread all through the step, where staging copies on every thread",
            AutoCopies::B => "MGMM_AUTO_COPIES=b: B's file copied, A's locked",
            AutoCopies::Narrow | AutoCopies::Nothing => "stored in whole rows, its blocks at most half their width: locking the rows for each would take longer",
        }
    }
}

/// What `staging = "auto"` copies ([`AutoCopies`]) for lanes computing in `p` through a pinner
/// that locks pages (`locks`, a GPU; the CPU locks nothing: [`AutoCopies::Nothing`]).
///
/// * `fp64`: every file. Its blocks are twice fp32's bytes for a GEMM of the same time, and
///   the driver page-locks a `.mgt`'s runs on one thread and checks them after: 32768² fp64
///   from `.mgt` on one H100, interleaved, 1.571 / 1.389 s copied against 1.977 / 1.831 s
///   locked (docs/decisions/0025-fp64-copies-every-block.md); its `.npy` blocks were copied
///   already (below).
/// * `fp32` and `fp64_emulated`: the narrow files of row-major storage. 32768² from `.npy` on
///   one H200, interleaved: fp32 1.434–1.435 s copied against 1.458–1.504 s locked, fp64
///   1.558–1.562 s against 1.818–2.118 s (then under this rule). A `.mgt` locks its storage
///   tiles, the block's own: fp32 from `.mgt` ran level either way on one H100 (1.424 / 1.418
///   s copied, 1.458 / 1.416 s locked).
/// * tf32, bf16, fp16: nothing. Their GEMMs are short and staging's copies set the pace:
///   tf32 0.527–0.567 s locked against 0.649–0.668 s copied, as with `.mgt` inputs (decision
///   0006) (docs/measurements/2026-12-06g-h200-3-npy-narrow-copies-twins.log).
pub(crate) fn auto_copies(locks: bool, p: crate::plan::Precision) -> AutoCopies {
    use crate::plan::Precision;
    match p {
        _ if !locks => AutoCopies::Nothing,
        _ if crate::config::auto_copies_b() => AutoCopies::B,
        Precision::Fp64 => AutoCopies::Every,
        Precision::Fp32 | Precision::Fp64Emulated(_) => AutoCopies::Narrow,
        _ => AutoCopies::Nothing,
    }
}

/// One way a step reads an input file, as [`copied_files`] judges it: the file, whether it is
/// stored in bands of whole rows (a `.npy` or raw file, [`MappedBlock::whole_rows`]), its
/// stored columns, and the stored block its first output tile's first k-block reads — a whole
/// tile's (the widest it reads), or the file's whole width where that is narrower.
#[derive(Clone, Debug)]
pub(crate) struct Role<'a> {
    pub(crate) path: &'a std::path::Path,
    pub(crate) whole_rows: bool,
    pub(crate) cols: u64,
    pub(crate) first: Block,
    /// Whether the run would page-lock the file's pages for its blocks at all (a map of the
    /// lanes' dtype, not an array already on a GPU), and the bytes locking all of it would
    /// take (a `.mgt`'s padded tiles and tables: the file's length).
    pub(crate) lockable: bool,
    pub(crate) bytes: u64,
}

impl Role<'_> {
    /// The bytes locking all of `f` would take: the file's length, or for a source that is no
    /// file (an array) its values.
    pub(crate) fn bytes_of(f: &dyn MatrixSource) -> u64 {
        let values = (f.shape().0)
            .saturating_mul(f.shape().1)
            .saturating_mul(f.dtype().size() as u64);
        match f.is_file() {
            true => std::fs::metadata(f.path()).map_or(values, |m| m.len()),
            false => values,
        }
    }
}

/// The files whose every block `auto` copies under `rule` ([`auto_copies`]), decided once for
/// the step from the ways it reads them (`roles`). With [`AutoCopies::Narrow`], those stored in
/// bands of whole rows whose blocks are at most half as wide as the file in each way the step
/// reads them (a file read two ways, one of them wide, has its bands locked anyway, so it is
/// locked). With [`AutoCopies::Every`] and [`AutoCopies::Overflow`], every file the step
/// reads. Locking a block of such a file locks the bands of whole rows it lies in — the
/// file's whole width, four times the block at 32768² in 8192² tiles — on the driver's one
/// thread, before its upload can start, where staging copies the block's own bytes on every
/// thread: 32768² fp32 from `.npy` on one H100 took 1.441–1.443 s copied against 1.531–1.533 s
/// locked, its first GEMM at 0.05 s against 0.11–0.13 s
/// (docs/measurements/2026-12-06g-h100-2-roofline-npy-copy-verify-sweep.log,
/// docs/decisions/0023-copy-narrow-blocks-of-row-major-files.md). Decided per file, not per
/// block: a narrower block at the matrix's edge of a file whose full blocks lock their bands
/// would only be copied from bands already locked. A `.mgt` locks its storage tiles, the
/// block's own.
pub(crate) fn copied_files(rule: AutoCopies, roles: &[Role<'_>]) -> Vec<std::path::PathBuf> {
    let narrow = |r: &Role<'_>| r.whole_rows && r.first.cols.saturating_mul(2) <= r.cols;
    let mut out: Vec<std::path::PathBuf> = Vec::new();
    for (i, r) in roles.iter().enumerate() {
        let copied = match rule {
            AutoCopies::Nothing => false,
            AutoCopies::Narrow => roles.iter().filter(|o| o.path == r.path).all(narrow),
            AutoCopies::Every | AutoCopies::Overflow => true,
            AutoCopies::B => i == 1,
        };
        if copied && !out.iter().any(|p| p == r.path) {
            out.push(r.path.to_path_buf());
        }
    }
    out
}

/// The rule `auto` applies ([`Pinning::rule_for`]) and the files it copies ([`copied_files`]),
/// for a step's open `sources` (each with its first block, read as `host`) under `mode`: none
/// but under `auto` through `p`.
pub(crate) fn copied_sources(
    mode: StagingMode,
    p: Pinning,
    sources: &[(&dyn MatrixSource, Block)],
    host: DType,
) -> (AutoCopies, Vec<std::path::PathBuf>) {
    let roles: Vec<Role<'_>> = (sources.iter())
        .map(|&(f, first)| {
            let mapped = f.mapped_block(&first, host);
            Role {
                path: f.path(),
                whole_rows: mapped.as_ref().is_some_and(|mb| mb.whole_rows),
                cols: f.shape().1,
                first,
                lockable: mapped.is_some() && f.device_block(&first, host).is_none(),
                bytes: Role::bytes_of(f),
            }
        })
        .collect();
    let rule = p.rule_for(mode, &roles);
    (rule, copied_files(rule, &roles))
}

impl DirectReads {
    /// A registry for `sources` (A, B, C0), registering through `pinner` at most `budget`
    /// bytes at once in ranges of `chunk` ([`limits`]), never for the files in `copied`
    /// ([`copied_sources`]: their blocks are copied); `None` for `copy`.
    pub(crate) fn new(
        mode: StagingMode,
        pinner: Arc<dyn InputPinner>,
        sources: Vec<Arc<dyn MatrixSource>>,
        (budget, chunk): (u64, u64),
        copied: (AutoCopies, Vec<std::path::PathBuf>),
    ) -> Option<DirectReads> {
        if mode == StagingMode::Copy {
            return None;
        }
        Some(Self::with_budget(mode, pinner, sources, budget, chunk).copying(copied))
    }

    /// The registry, the blocks of the `copied` files copied by its rule ([`copied_sources`]).
    fn copying(mut self, (rule, copied): (AutoCopies, Vec<std::path::PathBuf>)) -> DirectReads {
        self.rule = rule;
        self.copied = copied;
        self
    }

    fn with_budget(
        mode: StagingMode,
        pinner: Arc<dyn InputPinner>,
        sources: Vec<Arc<dyn MatrixSource>>,
        budget: u64,
        chunk: u64,
    ) -> DirectReads {
        DirectReads {
            pinner,
            mode,
            rule: AutoCopies::Nothing,
            copied: Vec::new(),
            budget,
            chunk,
            entries: Mutex::new(HashMap::new()),
            registered: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            tick: AtomicU64::new(0),
            failed: OnceLock::new(),
            foresight: OnceLock::new(),
            loads: AtomicU64::new(0),
            stats: Counts::default(),
            _sources: sources,
        }
    }

    /// Whether `block` of `f` can go direct: not when direct uploads failed earlier in the
    /// step, when the format has no map of the compute dtype, or under `auto` when the ranges
    /// it would register are not all in the page cache. Nothing is leased or registered yet, so
    /// a block that is copied instead loses nothing (the shared reader's buffers stay).
    pub(crate) fn eligible<'f>(
        &self,
        f: &'f dyn MatrixSource,
        block: &Block,
        host: DType,
    ) -> Option<Eligible<'f>> {
        if self.failed.get().is_some() {
            return None;
        }
        let mb = f.mapped_block(block, host)?;
        if self.copied.iter().any(|p| p == f.path()) {
            self.stats.copied_blocks.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let ranges = self.ranges(&mb);
        // A range that alone would pass the budget (a row-major file is one range) is copied:
        // locking it could take the memory the host needs.
        if ranges.iter().any(|r| r.end - r.start > self.budget) {
            self.stats.oversize_blocks.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        if self.mode == StagingMode::Auto && !ranges.iter().all(|r| mb.cached(r.clone(), 1.0)) {
            self.stats.cold_blocks.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(Eligible { mb, ranges })
    }

    /// Whether knowing the loads ahead can matter: registering locks memory (the CPU's lanes
    /// read the maps as they are, and nothing is ever released) and the inputs do not all fit
    /// the budget at once.
    pub(crate) fn may_release(&self) -> bool {
        let bytes: u64 = (self._sources.iter())
            .map(|f| f.shape().0 * f.shape().1 * f.dtype().size() as u64)
            .sum();
        self.pinner.locks() && bytes > self.budget
    }

    /// Learn the order of the step's loads, `loads` (the source and block of each, as the one
    /// lane's planner will issue them, which the staging stage counts: [`Self::count_load`]):
    /// from then on a full budget releases the idle range whose next use is furthest away
    /// ([`Foresight`]). Blocks with no map of `host` are left out.
    pub(crate) fn foresee<'s>(
        &self,
        loads: impl Iterator<Item = (&'s dyn MatrixSource, Block)>,
        host: DType,
    ) {
        let mut f = Foresight {
            uses: HashMap::new(),
        };
        for (i, (src, b)) in loads.enumerate() {
            let Some(mb) = src.mapped_block(&b, host) else {
                continue;
            };
            let base = mb.map.as_ptr() as usize;
            for r in self.ranges(&mb) {
                f.uses
                    .entry(base + r.start as usize)
                    .or_default()
                    .push(i as u32);
            }
        }
        let _ = self.foresight.set(f);
    }

    /// A load is being staged (called by the staging stage for each, before it is taken,
    /// copied or read from a GPU): the clock of [`Foresight`].
    pub(crate) fn count_load(&self) {
        self.loads.fetch_add(1, Ordering::Relaxed);
    }

    /// An eligible block of `f` as rectangles of its page-locked map; `None` when registering
    /// failed (direct uploads are then off for the rest of the step). `token` is kept until
    /// the upload is done. Its checks are the caller's ([`MatrixSource::scan_mapped`], on the
    /// `check` stage).
    pub(crate) fn take(
        &self,
        f: &dyn MatrixSource,
        e: Eligible<'_>,
        token: Lease,
    ) -> Option<DirectUpload> {
        let Eligible { mb, ranges } = e;
        let pins = self.pin_all(f, &mb, &ranges)?;
        // One copy may not span two registrations (the driver refuses it: CUDA_ERROR_INVALID_VALUE
        // on an H200 for a `.npy` block over several bands of rows), so the runs are cut where
        // one registered range ends and the next begins. A `.mgt`'s runs never cross one.
        let per = range_per(self.chunk, &mb);
        let runs: Vec<HostRun> = split_at_ranges(&mb.runs, mb.data.start, per)
            .into_iter()
            .map(|r| HostRun {
                // SAFETY: runs lie inside the file (checked by `mapped_block`), so inside the map.
                host: unsafe { mb.map.as_ptr().add(r.file_off as usize) },
                device: false,
                host_pitch: r.file_pitch as usize,
                dst_off: r.buf_off,
                dst_pitch: r.buf_pitch,
                row_len: r.row_len,
                rows: r.rows,
            })
            .collect();
        let bytes: usize = mb.runs.iter().map(|r| r.bytes()).sum();
        self.stats.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        Some(DirectUpload {
            runs,
            check: None,
            device_check: Mutex::new(None),
            pins,
            _token: token,
        })
    }

    /// [`Self::eligible`] then [`Self::take`].
    #[cfg(test)]
    fn prepare(
        &self,
        f: &dyn MatrixSource,
        block: &Block,
        host: DType,
        token: Lease,
    ) -> Option<DirectUpload> {
        let e = self.eligible(f, block, host)?;
        self.take(f, e, token)
    }

    /// The file ranges registered for `mb`: the chunks of whole consecutive storage tiles
    /// ([`CHUNK`]) that hold its tiles, each the same for every block that touches it, so
    /// registered once and never overlapping another.
    fn ranges(&self, mb: &MappedBlock<'_>) -> Vec<std::ops::Range<u64>> {
        block_ranges(self.chunk, mb)
    }

    /// Pins on `ranges` of `mb`'s map; `None` (and direct uploads off for the rest of the step,
    /// saying why) when a registration fails.
    fn pin_all(
        &self,
        f: &dyn MatrixSource,
        mb: &MappedBlock<'_>,
        ranges: &[std::ops::Range<u64>],
    ) -> Option<Vec<Pin>> {
        // A block whose ranges together pass the whole budget can never be held at once: copy
        // it without registering (and then releasing) any of them.
        if ranges.iter().map(|s| s.end - s.start).sum::<u64>() > self.budget {
            self.stats.full_blocks.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let mut pins = Vec::with_capacity(ranges.len());
        for s in ranges {
            let end = (s.end as usize).min(mb.map.len());
            let start = s.start as usize;
            // SAFETY: `start < end <= map.len()`: inside the map.
            let ptr = unsafe { mb.map.as_ptr().add(start) } as usize;
            match self.pin(ptr, end - start) {
                Ok(p) => pins.push(p),
                Err(PinError::Full) => {
                    // The pins taken so far go idle (and may be released for the next block).
                    self.stats.full_blocks.fetch_add(1, Ordering::Relaxed);
                    return None;
                }
                Err(PinError::Failed(why)) => {
                    // Off for the rest of the step: let go of what is idle now (the failure
                    // may be memory running short), not at the step's end.
                    drop(pins);
                    self.release_idle(u64::MAX);
                    let _ = self.failed.set(format!(
                        "registering {} of {} failed ({why}); the rest of the step copied its inputs",
                        crate::units::fmt_bytes(end as u64 - start as u64),
                        f.path().display()
                    ));
                    return None;
                }
            }
        }
        Some(pins)
    }

    /// Keep `len` bytes at `ptr` registered while the returned pin lives; `Full` when the
    /// budget has no room for it beside the ranges in use.
    fn pin(&self, ptr: usize, len: usize) -> Result<Pin, PinError> {
        let e = {
            let mut m = self.entries.lock().unwrap_or_else(|e| e.into_inner());
            m.entry(ptr)
                .or_insert_with(|| {
                    Arc::new(Entry {
                        ptr,
                        len,
                        st: Mutex::new(EntryState::default()),
                    })
                })
                .clone()
        };
        let mut st = e.st.lock().unwrap_or_else(|e| e.into_inner());
        st.last = self.tick.fetch_add(1, Ordering::Relaxed);
        if !st.registered && !self.pinner.locks() {
            st.registered = true;
        }
        if !st.registered {
            self.make_room(len as u64, ptr);
            if !self.reserve(len as u64) {
                return Err(PinError::Full);
            }
            let t = Instant::now();
            if let Err(why) = self.pinner.register(ptr as *const u8, len) {
                self.registered.fetch_sub(len as u64, Ordering::SeqCst);
                return Err(PinError::Failed(why));
            }
            let ns = t.elapsed().as_nanos() as u64;
            crate::trace::span("direct", "register", t, Instant::now());
            st.registered = true;
            self.stats.register_ns.fetch_add(ns, Ordering::Relaxed);
            self.stats
                .registered_bytes
                .fetch_add(len as u64, Ordering::Relaxed);
        }
        st.users += 1;
        drop(st);
        Ok(Pin(e))
    }

    /// Count `len` more bytes registered if they fit in the budget (checked and added at once:
    /// two threads cannot both take the last room); the peak follows.
    fn reserve(&self, len: u64) -> bool {
        let r = (self.registered).fetch_update(Ordering::SeqCst, Ordering::SeqCst, |r| {
            (r + len <= self.budget).then_some(r + len)
        });
        match r {
            Ok(before) => {
                self.peak.fetch_max(before + len, Ordering::SeqCst);
                true
            }
            Err(_) => false,
        }
    }

    /// Release idle ranges (the one needed again last first, [`Self::release_idle_except`]) until `len` more bytes fit in the budget (or
    /// nothing idle is left: ranges in use are never released). `except`: the range being
    /// registered (its lock is held by the caller).
    fn make_room(&self, len: u64, except: usize) {
        if self.registered.load(Ordering::Relaxed) + len <= self.budget {
            return;
        }
        self.release_idle_except(len, except);
    }

    /// Release every idle range when `len` is `u64::MAX`, else as [`Self::make_room`] does.
    fn release_idle(&self, len: u64) {
        self.release_idle_except(len, 0);
    }

    /// Idle ranges go in the order [`Foresight`] says (the one needed again last first), else —
    /// the order unknown, or between ranges needed next at the same load — used longest ago first.
    fn release_idle_except(&self, len: u64, except: usize) {
        let fs = self.foresight.get();
        // The load being staged: the count less one (it counted itself).
        let now = self.loads.load(Ordering::Relaxed).saturating_sub(1);
        let mut idle: Vec<(std::cmp::Reverse<u32>, u64, Arc<Entry>)> = {
            let m = self.entries.lock().unwrap_or_else(|e| e.into_inner());
            m.values()
                .filter(|e| e.ptr != except)
                .filter_map(|e| {
                    let st = e.st.try_lock().ok()?;
                    let next = fs.map_or(0, |f| f.next_use(e.ptr, now));
                    (st.registered && st.users == 0)
                        .then(|| (std::cmp::Reverse(next), st.last, e.clone()))
                })
                .collect()
        };
        idle.sort_unstable_by_key(|(next, last, _)| (*next, *last));
        for (_, _, e) in idle {
            if len != u64::MAX && self.registered.load(Ordering::Relaxed) + len <= self.budget {
                break;
            }
            // Skip a range someone holds the lock of (it is being pinned again).
            let Ok(mut st) = e.st.try_lock() else {
                continue;
            };
            if st.registered && st.users == 0 {
                self.pinner.unregister(e.ptr as *const u8);
                // Registering faulted its pages in; left mapped they would count in the
                // process's resident memory until the map goes (on an H200 a 65536² run with
                // `host_memory = "8GiB"` locked at most 5.75 GiB at once but peaked at 21.15
                // GiB RSS, issue 33 item 12).
                // SAFETY: the range was registered from a file's read-only map, which the
                // registry's sources keep alive.
                unsafe { crate::store::fsutil::unmap_pages(e.ptr, e.len) };
                st.registered = false;
                self.registered.fetch_sub(e.len as u64, Ordering::Relaxed);
                self.stats
                    .released_bytes
                    .fetch_add(e.len as u64, Ordering::Relaxed);
            }
        }
    }

    pub(crate) fn stats(&self) -> DirectStats {
        let c = &self.stats;
        DirectStats {
            bytes: c.bytes.load(Ordering::Relaxed),
            cold_blocks: c.cold_blocks.load(Ordering::Relaxed),
            copied_blocks: c.copied_blocks.load(Ordering::Relaxed),
            oversize_blocks: c.oversize_blocks.load(Ordering::Relaxed),
            full_blocks: c.full_blocks.load(Ordering::Relaxed),
            budget: self.budget,
            copy_rule: self.rule,
            peak_locked: self.peak.load(Ordering::Relaxed),
            registered_bytes: c.registered_bytes.load(Ordering::Relaxed),
            register_s: c.register_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            released_bytes: c.released_bytes.load(Ordering::Relaxed),
            failed: self.failed.get().cloned(),
        }
    }
}

impl Drop for DirectReads {
    /// Release every range still registered, before the maps can go (the sources are dropped
    /// after this). Every upload and check is over by now: they live on the stage threads,
    /// which have all ended, and the lanes, dropped before this, waited for their copies.
    fn drop(&mut self) {
        let t = Instant::now();
        let m = self.entries.get_mut().unwrap_or_else(|e| e.into_inner());
        for e in m.values() {
            let st = e.st.lock().unwrap_or_else(|e| e.into_inner());
            if st.registered {
                self.pinner.unregister(e.ptr as *const u8);
            }
        }
        crate::trace::span("direct", "release", t, Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{HostAlloc, HostBuf};
    use crate::pipeline::pool::Pool;
    use crate::store::gen::{generate, Dist, GenSpec};

    /// Records what is registered; refuses registrations once `fail` is set.
    #[derive(Default)]
    struct Recorder {
        held: Mutex<Vec<(usize, usize)>>,
        registrations: AtomicU64,
        fail: std::sync::atomic::AtomicBool,
    }

    impl InputPinner for Recorder {
        fn register(&self, ptr: *const u8, len: usize) -> Result<(), String> {
            if self.fail.load(Ordering::Relaxed) {
                return Err("refused by the test".into());
            }
            let mut h = self.held.lock().unwrap();
            assert!(
                h.iter()
                    .all(|&(p, l)| ptr as usize >= p + l || p >= ptr as usize + len),
                "a range overlapping one still registered"
            );
            assert_eq!(ptr as usize % 4096, 0, "registered ranges start on a page");
            h.push((ptr as usize, len));
            self.registrations.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        fn unregister(&self, ptr: *const u8) {
            let mut h = self.held.lock().unwrap();
            let i = h.iter().position(|&(p, _)| p == ptr as usize);
            h.swap_remove(i.expect("unregistering a range that is registered"));
        }
    }

    struct Heap;
    impl HostAlloc for Heap {
        fn alloc_host(&self, bytes: usize) -> crate::error::Result<HostBuf> {
            HostBuf::heap(bytes)
        }
    }

    /// A 64×64 f32 file in 16×16 storage tiles (1 KiB each, a 4 KiB stride).
    fn file(dir: &std::path::Path) -> Arc<dyn MatrixSource> {
        file_named(dir, "A.mgt")
    }

    /// [`file`] named `name`: a `.mgt`, or a `.npy` (row-major) for a name ending so.
    fn file_named(dir: &std::path::Path, name: &str) -> Arc<dyn MatrixSource> {
        let p = dir.join(name);
        let spec = GenSpec {
            rows: 64,
            cols: 64,
            dtype: DType::F32,
            tile: (16, 16),
            dist: Dist::Arange,
            seed: 1,
        };
        generate(&p, &spec).unwrap();
        crate::store::open_source(&p).unwrap()
    }

    fn block(r0: u64, c0: u64, rows: u64, cols: u64) -> Block {
        Block { r0, c0, rows, cols }
    }

    /// A file, a recording pinner and a pool of tokens.
    struct Fixture {
        _dir: tempfile::TempDir,
        f: Arc<dyn MatrixSource>,
        rec: Arc<Recorder>,
        pool: Pool,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let f = file(dir.path());
        let pool = Pool::new("staging", &Heap, 4, 64).unwrap();
        Fixture {
            _dir: dir,
            f,
            rec: Arc::new(Recorder::default()),
            pool,
        }
    }

    impl Fixture {
        fn reg(&self, mode: StagingMode, budget: u64, chunk: u64) -> DirectReads {
            DirectReads::with_budget(mode, self.rec.clone(), vec![self.f.clone()], budget, chunk)
        }
        fn up(&self, reg: &DirectReads, b: Block, dt: DType) -> Option<DirectUpload> {
            reg.prepare(&*self.f, &b, dt, self.pool.try_lease().unwrap())
        }
    }

    /// Whether the page at `addr` is in this process's page tables (`/proc/self/pagemap`, bit
    /// 63: present; readable by the process itself without privileges).
    fn mapped(addr: usize) -> bool {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::open("/proc/self/pagemap").unwrap();
        let mut e = [0u8; 8];
        f.read_exact_at(&mut e, (addr / 4096 * 8) as u64).unwrap();
        u64::from_le_bytes(e) >> 63 == 1
    }

    /// Knowing the loads ahead, a full budget lets go of the idle range needed again last —
    /// never one of the block being pinned: storage tiles 0, 1 and 5 (4 KiB each, one range
    /// each), room for two, loads {1, 5}, {0, 1}, {5}. Belady's four registrations (tile 0
    /// pushes out 5, not 1, which the same load is about to pin); a load copied instead still
    /// moves the clock. Five without counting the load being staged, as the first version did.
    #[test]
    fn a_full_budget_releases_the_range_needed_again_last() {
        let fx = fixture();
        let reg = fx.reg(StagingMode::Direct, 2 * 4096, 4096);
        let (l0, l1, l2) = (
            block(0, 16, 32, 16),
            block(0, 0, 16, 32),
            block(16, 16, 16, 16),
        );
        reg.foresee([l0, l1, l2].into_iter().map(|b| (&*fx.f, b)), DType::F32);
        for b in [l0, l1, l2] {
            reg.count_load();
            drop(fx.up(&reg, b, DType::F32).expect("fits the budget"));
        }
        assert_eq!(fx.rec.registrations.load(Ordering::Relaxed), 4);
        // Without the order: the range used longest ago goes first (tile 1, which {0, 1} then
        // registers again), five registrations.
        let fx = fixture();
        let reg = fx.reg(StagingMode::Direct, 2 * 4096, 4096);
        for b in [l0, l1, l2] {
            drop(fx.up(&reg, b, DType::F32).expect("fits the budget"));
        }
        assert_eq!(fx.rec.registrations.load(Ordering::Relaxed), 5);
    }

    #[test]
    fn tiles_are_registered_once_released_over_budget_and_at_the_end() {
        let fx = fixture();
        let rec = &fx.rec;
        // Room for four storage tiles (4 KiB strides), registered one by one.
        let reg = fx.reg(StagingMode::Direct, 4 * 4096, 4096);
        // A block straddling 2×2 storage tiles: four ranges, rectangles covering it exactly.
        let b = block(8, 8, 16, 16);
        let up = fx.up(&reg, b, DType::F32).unwrap();
        assert_eq!(rec.registrations.load(Ordering::Relaxed), 4);
        let covered: usize = up.runs.iter().map(|r| r.rows * r.row_len).sum();
        assert_eq!(covered, 16 * 16 * 4);
        // Element (8 + i, 8 + j) of the arange matrix is (8 + i)·64 + 8 + j.
        let mut dense = vec![0f32; 256];
        for r in &up.runs {
            for i in 0..r.rows {
                for j in 0..r.row_len / 4 {
                    // SAFETY: inside the file's map, kept alive by `f`.
                    let x = unsafe {
                        (r.host.add(i * r.host_pitch + 4 * j) as *const f32).read_unaligned()
                    };
                    dense[(r.dst_off + i * r.dst_pitch) / 4 + j] = x;
                }
            }
        }
        for (e, &x) in dense.iter().enumerate() {
            assert_eq!(x, ((8 + e / 16) * 64 + 8 + e % 16) as f32, "element {e}");
        }
        // The same tiles again: nothing new to register.
        let up2 = fx.up(&reg, b, DType::F32).unwrap();
        assert_eq!(rec.registrations.load(Ordering::Relaxed), 4);
        drop((up, up2));
        let first: Vec<(usize, usize)> = rec.held.lock().unwrap().clone();
        // Read above, so mapped in this process (the page tables say so).
        assert!(
            first.iter().all(|&(p, _)| mapped(p)),
            "pages read are mapped"
        );
        // Two new tiles: the budget holds four, so the two oldest idle ones go first.
        let up3 = fx.up(&reg, block(0, 32, 16, 32), DType::F32).unwrap();
        assert_eq!(rec.registrations.load(Ordering::Relaxed), 6);
        assert_eq!(rec.held.lock().unwrap().len(), 4);
        assert_eq!(reg.stats().released_bytes, 2 * 4096);
        // Released ranges leave the process's page tables (they would count in its RSS until
        // the map goes: issue 33 item 12); those still registered stay.
        let held = rec.held.lock().unwrap().clone();
        let (kept, gone): (Vec<_>, Vec<_>) = first.iter().partition(|r| held.contains(r));
        assert_eq!((kept.len(), gone.len()), (2, 2));
        assert!(
            gone.iter().all(|&&(p, _)| !mapped(p)),
            "released pages unmapped"
        );
        assert!(
            kept.iter().all(|&&(p, _)| mapped(p)),
            "registered pages left"
        );
        // Tiles in use are never released, and the budget is never passed: a block whose
        // ranges have no room beside them is copied instead (counted), taking nothing.
        assert!(fx.up(&reg, block(48, 0, 16, 64), DType::F32).is_none());
        assert_eq!(rec.held.lock().unwrap().len(), 4, "2 idle, 2 in use by up3");
        assert_eq!(reg.stats().full_blocks, 1);
        // Once up3 is done, its tiles are idle and the four the block needs fit.
        drop(up3);
        let up4 = fx.up(&reg, block(48, 0, 16, 64), DType::F32).unwrap();
        assert_eq!(rec.held.lock().unwrap().len(), 4, "all four in use by up4");
        drop(up4);
        let st = reg.stats();
        assert_eq!(st.bytes, (256 + 256 + 512 + 1024) * 4);
        assert_eq!(st.peak_locked, 4 * 4096, "never more than the budget");
        assert!(st.failed.is_none());
        drop(reg);
        assert!(
            rec.held.lock().unwrap().is_empty(),
            "all released at the end"
        );
    }

    /// Whether a step's blocks are expected to go direct (the staging pool then lazy): not
    /// with `copy`, nor without a pinner, nor for another dtype than the lanes take; under
    /// `auto` not when part of the file was evicted from the page cache.
    #[test]
    fn blocks_are_expected_direct_only_when_they_can_go() {
        const ON: Option<Pinning> = Some(Pinning {
            budget: 8 << 30,
            chunk: CHUNK,
            copies: AutoCopies::Narrow,
        });
        // (A `.mgt`: no file of it is narrow.)
        let fx = fixture();
        let f: &dyn MatrixSource = &*fx.f;
        let b = block(0, 0, 32, 32);
        let one = |m, p, added, dt| expected(m, p, &[(f, b)], &[], added, dt);
        assert!(expected(
            StagingMode::Auto,
            ON,
            &[(f, b), (f, b)],
            &[],
            false,
            DType::F32
        ));
        assert!(one(StagingMode::Direct, ON, false, DType::F32));
        assert!(!one(StagingMode::Copy, ON, false, DType::F32));
        assert!(!one(StagingMode::Auto, None, false, DType::F32));
        assert!(!one(StagingMode::Auto, ON, false, DType::F64));
        assert!(!one(StagingMode::Direct, ON, true, DType::F32), "with C0");
        // Evict the file's pages (written and synced by `generate`): `auto` no longer expects
        // its blocks to go direct; `direct` still does.
        let path = f.path().to_path_buf();
        let file = std::fs::File::open(&path).unwrap();
        file.sync_all().unwrap();
        use std::os::unix::io::AsRawFd;
        // SAFETY: posix_fadvise only reads its integer arguments; the descriptor is open.
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let reopened = crate::store::open_source(&path).unwrap();
        let again = |m| expected(m, ON, &[(&*reopened, b)], &[], false, DType::F32);
        if rc == 0 && !page_cached(&path) {
            assert!(!again(StagingMode::Auto));
        } else {
            eprintln!("the page cache kept the file (tmpfs?): the eviction case was not tested");
        }
        assert!(again(StagingMode::Direct));
    }

    /// A file stored in whole rows whose blocks are at most half as wide as the file has every
    /// block copied under `auto` on a device that locks pages, for fp32 and `fp64_emulated`
    /// (locking would take the bands of whole rows), counted, and is not expected direct; under
    /// fp64 every file is copied, a `.mgt` and wide blocks too;
    /// decided once per file, from its first (widest) block, so an edge block of a file whose
    /// full blocks are wide is locked. With `direct`, on the CPU (nothing locked), with
    /// tf32/bf16, or with blocks as wide as the file, blocks go direct; a `.mgt`'s too; a file
    /// read both narrow and wide (`A @ A` with other tile edges) is locked.
    #[test]
    fn auto_copies_narrow_files_and_under_fp64_every_file_on_a_gpu() {
        let dir = tempfile::tempdir().unwrap();
        let npy = file_named(dir.path(), "A.npy");
        use crate::plan::Precision;
        // The B rule (copy B's file, lock A's), for measuring only.
        let roles = [
            Role {
                path: npy.path(),
                whole_rows: true,
                cols: 64,
                first: block(0, 0, 64, 64),
                lockable: true,
                bytes: 64 * 64 * 4,
            },
            Role {
                path: std::path::Path::new("B.mgt"),
                whole_rows: false,
                cols: 64,
                first: block(0, 0, 64, 64),
                lockable: true,
                bytes: 64 * 64 * 4,
            },
        ];
        assert_eq!(
            copied_files(AutoCopies::B, &roles),
            vec![std::path::PathBuf::from("B.mgt")]
        );
        // Files that would be locked, larger together than the budget: every file is copied
        // under fp32 (decision 0026); within it, or under another rule, as before. The file
        // the narrow rule copies anyway does not count, nor a file read twice.
        let gib = 1u64 << 30;
        let big = |path: &'static str, whole_rows: bool, first: Block| Role {
            path: std::path::Path::new(path),
            whole_rows,
            cols: 65536,
            first,
            lockable: true,
            bytes: 16 * gib,
        };
        let tile = block(0, 0, 8192, 8192);
        let mgts = [big("A.mgt", false, tile), big("B.mgt", false, tile)];
        let fp32 = |budget| Pinning::new((budget, CHUNK), true, Precision::Fp32);
        let auto =
            |gibs: u64, roles: &[Role<'_>]| fp32(gibs * gib).rule_for(StagingMode::Auto, roles);
        assert_eq!(auto(12, &mgts), AutoCopies::Overflow);
        assert_eq!(copied_files(AutoCopies::Overflow, &mgts).len(), 2);
        // Each file fits alone, not both together.
        assert_eq!(auto(20, &mgts), AutoCopies::Overflow);
        assert_eq!(auto(32, &mgts), AutoCopies::Narrow);
        // A file the run would not lock (another dtype, an array on a GPU) does not count.
        let mut other = mgts.clone();
        other[0].lockable = false;
        assert_eq!(auto(20, &other), AutoCopies::Narrow);
        assert_eq!(
            fp32(12 * gib).rule_for(StagingMode::Direct, &mgts),
            AutoCopies::Nothing
        );
        let tf32 = Pinning::new((12 * gib, CHUNK), true, Precision::Tf32);
        assert_eq!(tf32.rule_for(StagingMode::Auto, &mgts), AutoCopies::Nothing);
        // The narrow rule copies the `.npy` anyway (only B.mgt would be locked); a file read
        // twice counts once.
        let narrow_npy = [big("A.npy", true, tile), big("B.mgt", false, tile)];
        assert_eq!(auto(20, &narrow_npy), AutoCopies::Narrow);
        let twice = [big("A.mgt", false, tile), big("A.mgt", false, tile)];
        assert_eq!(auto(20, &twice), AutoCopies::Narrow);
        // The report names the rule and the summary reads it back (an older report: narrow).
        for r in [
            AutoCopies::Narrow,
            AutoCopies::Every,
            AutoCopies::B,
            AutoCopies::Overflow,
        ] {
            assert_eq!(AutoCopies::from_name(r.name()), r);
        }
        assert_eq!(AutoCopies::from_name(""), AutoCopies::Narrow);
        assert!(AutoCopies::Overflow
            .staged(12 * gib)
            .contains("larger than the 12.00 GiB"));
        let cpu = Pinning::new((12 * gib, CHUNK), false, Precision::Fp32);
        assert_eq!(cpu.rule_for(StagingMode::Auto, &mgts), AutoCopies::Nothing);
        assert_eq!(auto_copies(true, Precision::Fp32), AutoCopies::Narrow);
        assert_eq!(auto_copies(true, Precision::Fp64), AutoCopies::Every);
        for p in [Precision::Fp32, Precision::Fp64] {
            assert_eq!(
                auto_copies(false, p),
                AutoCopies::Nothing,
                "the CPU locks nothing"
            );
        }
        for p in [Precision::Tf32, Precision::Bf16] {
            assert_eq!(auto_copies(true, p), AutoCopies::Nothing);
        }
        let pin = |p| Some(Pinning::new((8 << 30, CHUNK), true, p));
        let (narrow, half, wide) = (
            block(0, 0, 64, 16),
            block(0, 32, 64, 32),
            block(0, 0, 16, 64),
        );
        // As `Engines::make` asks: the copied files decided first, then the expectation.
        let judged = |m, p: Pinning, srcs: &[(&dyn MatrixSource, Block)]| {
            let copied = copied_sources(m, p, srcs, DType::F32);
            expected(m, Some(p), srcs, &copied.1, false, DType::F32)
        };
        let exp = |m, p, firsts: &[Block]| {
            let srcs: Vec<(&dyn MatrixSource, Block)> = firsts
                .iter()
                .map(|&b| (&*npy as &dyn MatrixSource, b))
                .collect();
            judged(m, pin(p).unwrap(), &srcs)
        };
        assert!(!exp(StagingMode::Auto, Precision::Fp32, &[narrow]));
        assert!(!exp(StagingMode::Auto, Precision::Fp32, &[half]));
        assert!(exp(StagingMode::Auto, Precision::Fp32, &[wide]));
        // fp64 copies every file, wide blocks and a `.mgt` too; `direct` still locks.
        assert!(!exp(StagingMode::Auto, Precision::Fp64, &[wide]));
        assert!(exp(StagingMode::Direct, Precision::Fp64, &[wide]));
        assert!(
            exp(StagingMode::Auto, Precision::Fp32, &[narrow, wide]),
            "read wide too"
        );
        assert!(exp(StagingMode::Direct, Precision::Fp32, &[narrow]));
        assert!(exp(StagingMode::Auto, Precision::Tf32, &[narrow]));
        let cpu = Pinning::new((8 << 30, CHUNK), false, Precision::Fp32);
        assert!(judged(StagingMode::Auto, cpu, &[(&*npy, narrow)]));
        let fx = fixture();
        let mgt: &dyn MatrixSource = &*fx.f;
        let gpu = pin(Precision::Fp32).unwrap();
        assert!(judged(StagingMode::Auto, gpu, &[(mgt, narrow)]));
        let gpu64 = pin(Precision::Fp64).unwrap();
        assert!(!judged(StagingMode::Auto, gpu64, &[(mgt, narrow)]));
        assert_eq!(
            copied_sources(
                StagingMode::Auto,
                gpu64,
                &[(mgt, narrow), (&*npy, wide)],
                DType::F32
            ),
            (
                AutoCopies::Every,
                vec![mgt.path().to_path_buf(), npy.path().to_path_buf()]
            )
        );

        let p = Pinning::new((8 << 30, CHUNK), true, Precision::Fp32);
        let reg = |mode, first| {
            let narrow = copied_sources(mode, p, &[(&*npy, first)], DType::F32);
            DirectReads::with_budget(mode, fx.rec.clone(), vec![npy.clone()], 8 << 30, CHUNK)
                .copying(narrow)
        };
        let token = || fx.pool.try_lease().unwrap();
        // Narrow from its first block: every block copied, a wide one too.
        let auto = reg(StagingMode::Auto, narrow);
        assert!(auto.prepare(&*npy, &narrow, DType::F32, token()).is_none());
        assert!(auto.prepare(&*npy, &wide, DType::F32, token()).is_none());
        assert_eq!(auto.stats().copied_blocks, 2);
        drop(auto);
        // Wide from its first block: a narrow (edge) block locks its bands.
        let auto = reg(StagingMode::Auto, wide);
        assert!(auto.prepare(&*npy, &narrow, DType::F32, token()).is_some());
        assert_eq!(auto.stats().copied_blocks, 0);
        // Its ranges released (the recorder refuses a second registration of one).
        drop(auto);
        let direct = reg(StagingMode::Direct, narrow);
        assert!(direct
            .prepare(&*npy, &narrow, DType::F32, token())
            .is_some());
        assert_eq!(direct.stats().copied_blocks, 0);
    }

    /// Whether the last page of `path` (tile data, not the header that opening reads) is in
    /// the page cache (a file system that keeps every page, tmpfs, cannot evict: the eviction
    /// case is then skipped).
    fn page_cached(path: &std::path::Path) -> bool {
        let f = std::fs::File::open(path).unwrap();
        // SAFETY: a read-only shared map of a file opened here, dropped at the end.
        let m = unsafe { memmap2::Mmap::map(&f) }.unwrap();
        let end = m.len() as u64;
        crate::store::fsutil::resident(&m, end - 4096..end, 1.0)
    }

    #[test]
    fn results_wait_for_the_checks_before_them_and_stop_on_a_cancel() {
        let p = Arc::new(CheckProgress::default());
        let ctl = crate::pipeline::control::Control::new();
        p.wait_for(0, &ctl).unwrap();
        let q = p.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(30));
            q.set(2);
        });
        let t0 = Instant::now();
        p.wait_for(2, &ctl).unwrap();
        assert!(t0.elapsed() >= std::time::Duration::from_millis(25));
        t.join().unwrap();
        ctl.cancel();
        assert!(matches!(
            p.wait_for(3, &ctl),
            Err(crate::error::Error::Cancelled)
        ));
    }

    #[test]
    fn runs_are_cut_where_registered_ranges_meet() {
        use crate::store::runs::Run;
        // Rows of a row-major file (pitch 3000, a 128-byte header before the first) in ranges
        // of 16 KiB from byte 0: rows cross range boundaries; the pieces must map exactly the
        // same bytes to the same places, none crossing a boundary.
        for (row_len, rows, file_off, buf_pitch) in [
            (1200, 50, 128 + 700, 1200),
            (3000, 40, 128, 3000),
            (200, 3, 16000, 256),
        ] {
            let r = Run {
                file_off,
                file_pitch: 3000,
                buf_off: 64,
                buf_pitch,
                row_len,
                rows,
            };
            let per = 16384;
            let pieces = super::split_at_ranges(&[r], 0, per);
            let map = |runs: &[Run]| {
                let mut m = std::collections::BTreeMap::new();
                for p in runs {
                    for i in 0..p.rows {
                        let (f, b) = p.row(i);
                        assert_eq!(
                            f / per,
                            (f + p.row_len as u64 - 1) / per,
                            "a piece crosses a boundary: {p:?}"
                        );
                        for k in 0..p.row_len {
                            assert!(m.insert(f + k as u64, b + k).is_none());
                        }
                    }
                }
                m
            };
            let whole = {
                let mut m = std::collections::BTreeMap::new();
                for i in 0..r.rows {
                    let (f, b) = r.row(i);
                    for k in 0..r.row_len {
                        m.insert(f + k as u64, b + k);
                    }
                }
                m
            };
            assert_eq!(map(&pieces), whole);
            assert!(
                pieces.len() < 3 * rows,
                "rows inside one range stay together"
            );
        }
        // A run inside one range is left as it is.
        let r = Run {
            file_off: 100,
            file_pitch: 1000,
            buf_off: 0,
            buf_pitch: 500,
            row_len: 500,
            rows: 4,
        };
        assert_eq!(super::split_at_ranges(&[r], 0, 16384), vec![r]);
    }

    #[test]
    fn consecutive_tiles_are_registered_together() {
        let fx = fixture();
        let rec = &fx.rec;
        // Chunks of three tiles (12 KiB): the grid's 16 tiles, in file order, in six chunks.
        let reg = fx.reg(StagingMode::Direct, 1 << 30, 3 * 4096);
        // Tiles (0, 1), (0, 2), (1, 1), (1, 2) = file tiles 1, 2, 5, 6: chunks 0 and 1 (tiles 0–5)
        // and 2 (6–8).
        let up = fx.up(&reg, block(8, 24, 24, 16), DType::F32).unwrap();
        let held = rec.held.lock().unwrap().clone();
        assert_eq!(held.len(), 3);
        assert!(held.iter().all(|&(_, len)| len == 3 * 4096));
        drop(up);
        // The whole matrix: the last chunk holds tile 15 alone (it ends with the tile data).
        let _up = fx.up(&reg, block(0, 0, 64, 64), DType::F32).unwrap();
        let held = rec.held.lock().unwrap().clone();
        assert_eq!(held.len(), 6);
        assert_eq!(held.iter().map(|h| h.1).sum::<usize>(), 16 * 4096);
    }

    /// 65536² f32 on one H200 with `host_memory = "8GiB"`, where the host could spare 30.8 GB:
    /// the budget used to be half of that (15.4 GB, and 19.9 GB were locked). Now the pools (six
    /// staging and three output buffers of an 8192² f32 tile) and the locked pages together
    /// stay within `host_memory`; a host with less to spare locks less; pools that take all of
    /// `host_memory` leave nothing to lock (every block is copied).
    #[test]
    fn locked_pages_share_host_memory_with_the_pools() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.toml");
        std::fs::write(
            &path,
            "[matrices.A]\npath = \"A.mgt\"\ngenerate = { rows = 65536, cols = 65536 }\n\
             [matrices.B]\npath = \"B.mgt\"\ngenerate = { rows = 65536, cols = 65536 }\n\
             [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n\
             [engine]\nbackend = \"cuda\"\nhost_memory = \"8GiB\"\n",
        )
        .unwrap();
        let plan = crate::plan::Plan::load(&path).unwrap();
        let caps = crate::backend::cuda::cuda_caps(1, 139 << 30);
        let l = crate::plan::layout::Layout::new(&plan.path, &plan.steps[0], &plan.engine, &caps)
            .unwrap();
        let host_memory = 8u64 << 30;
        assert_eq!(plan.engine.host_memory, host_memory);
        assert_eq!(l.host_bytes, 9 * (8192 * 8192 * 4), "the pools");
        let h200 = Some((15_400_000_000, CHUNK));
        let (budget, chunk) = limits(h200, host_memory, l.host_bytes);
        assert_eq!(budget, host_memory - l.host_bytes);
        assert_eq!(chunk, CHUNK);
        assert_eq!(
            limits(Some((1 << 30, CHUNK)), host_memory, l.host_bytes).0,
            1 << 30
        );
        assert_eq!(limits(h200, l.host_bytes, l.host_bytes).0, 0);
        // A small budget registers small ranges (an eighth of it), so that several fit.
        assert_eq!(limits(h200, 64 << 20, 32 << 20), (32 << 20, 4 << 20));
    }

    #[test]
    fn a_range_larger_than_the_budget_is_copied_and_counted() {
        let fx = fixture();
        // Chunks of two tiles (8 KiB) under a budget of one tile.
        let reg = fx.reg(StagingMode::Direct, 4096, 2 * 4096);
        assert!(fx.up(&reg, block(0, 0, 16, 16), DType::F32).is_none());
        let st = reg.stats();
        assert_eq!((st.oversize_blocks, st.budget, st.bytes), (1, 4096, 0));
        assert_eq!(fx.rec.registrations.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_failed_registration_turns_to_copies_and_says_why() {
        let fx = fixture();
        let rec = &fx.rec;
        rec.fail.store(true, Ordering::Relaxed);
        let reg = fx.reg(StagingMode::Auto, 1 << 30, 4096);
        assert!(fx.up(&reg, block(0, 0, 16, 16), DType::F32).is_none());
        rec.fail.store(false, Ordering::Relaxed);
        // Off for the rest of the step, even once registering would work.
        assert!(fx.up(&reg, block(0, 0, 16, 16), DType::F32).is_none());
        let why = reg.stats().failed.unwrap();
        assert!(
            why.contains("A.mgt") && why.contains("refused by the test"),
            "{why}"
        );
        // Another dtype than the file's has no rectangles: copied, without a failure.
        let reg = fx.reg(StagingMode::Direct, 1 << 30, 4096);
        assert!(fx.up(&reg, block(0, 0, 16, 16), DType::F64).is_none());
        assert!(reg.stats().failed.is_none());
        // The leases went back to the pool each time.
        assert!(fx.pool.try_lease().is_some());
    }
}
