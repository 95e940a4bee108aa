//! The streaming pipeline that runs one step of a plan, identical for every backend.
//!
//! A [`Pipeline`] is a value: [`Pipeline::build_with`] takes the step, its layout, the backend's lanes
//! and the work left (all tiles, or what a resume left), allocates every pool from the layout,
//! and [`Pipeline::run`] starts the stages of [`stages`] in one `std::thread::scope` — per lane a
//! planner, a prefetch, a staging and a device-lane thread; shared outprep and writeback — waits,
//! and returns the raw [`RunStats`]. Turning stats into a report is [`crate::report`]'s job.
//! Backpressure comes only from bounded channels and the fixed pools. The first error cancels
//! every stage and is the one returned; a failed run never reports success.

pub(crate) mod control;
pub(crate) mod direct;

pub(crate) mod pool;
pub(crate) mod shared;
pub(crate) mod stages;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::RecvTimeoutError;

use crate::backend::{Backend, DeviceStats, Lane, MemorySpace};
use crate::durable::sink::TileSink;
use crate::error::{Error, Result};
use crate::metrics::{StageKind, StageMetrics, StageSnapshot};
use crate::plan::layout::Layout;
use crate::plan::schedule::{Schedule, Src};
use crate::plan::{Engine, Step};
use crate::progress::{Live, Progress};
use crate::store::fsutil::DirtyLimits;
use crate::store::{Header, MatrixSink, MatrixSource};
use control::Control;
use pool::Pool;
pub(crate) use stages::NonfiniteSeen;
use stages::*;

/// The output header a step writes.
pub(crate) fn output_header(step: &Step, layout: &Layout) -> Header {
    Header::new(
        step.out_dtype,
        step.m,
        step.n,
        layout.out_tile.0,
        layout.out_tile.1,
        true,
    )
}

/// What is left to compute of a step, and where it goes.
pub(crate) struct Work {
    /// The output, created or reopened by the caller.
    pub(crate) writer: Box<dyn MatrixSink>,
    /// Output tiles to compute (schedule sequence numbers, in schedule order); `None` = all.
    pub(crate) todo: Option<Vec<u32>>,
    /// Output tiles already finished before this run (resume), for progress.
    pub(crate) done_before: u64,
}

/// The operands of a step, opened: A, B and the added matrix C0 if the step has one.
#[derive(Clone)]
pub struct StepSources {
    /// The left operand A.
    pub a: Arc<dyn MatrixSource>,
    /// The right operand B.
    pub b: Arc<dyn MatrixSource>,
    /// The added matrix C0, if the step has one.
    pub c0: Option<Arc<dyn MatrixSource>>,
}

/// Settings of a run that are not part of the layout.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RunConfig {
    pub(crate) verify_inputs: bool,
    pub(crate) durable: bool,
    /// How input blocks reach the lanes (`engine.staging`).
    pub(crate) staging: crate::plan::StagingMode,
    /// Worker threads of the run (`engine.threads` resolved: 0 means every core).
    pub(crate) threads: usize,
    /// `engine.host_memory`: the pools and the input pages page-locked for direct uploads
    /// together stay within it ([`direct::limits`]).
    pub(crate) host_memory: u64,
    /// A flag set from outside (Ctrl-C) that cancels the run; `None`: only errors cancel.
    pub(crate) cancel: Option<&'static std::sync::atomic::AtomicBool>,
}

impl RunConfig {
    pub(crate) fn from_engine(e: &Engine) -> RunConfig {
        RunConfig {
            verify_inputs: e.verify_inputs,
            durable: e.durable,
            staging: e.staging,
            threads: crate::backend::resolve_threads(e.threads),
            host_memory: e.host_memory,
            cancel: None,
        }
    }
}

/// A pool's size and how much of it was ever in use.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PoolReport {
    pub name: String,
    pub buffers: usize,
    pub buffer_bytes: u64,
    pub high_water: usize,
    /// Buffers given memory: all of them, unless `lazy` (made only for blocks copied).
    pub allocated: usize,
    pub lazy: bool,
}

/// What one run of a pipeline measured; no interpretation (see [`crate::report`]).
#[derive(Clone, Debug)]
pub(crate) struct RunStats {
    pub(crate) wall_s: f64,
    pub(crate) flush_s: f64,
    pub(crate) stages: Vec<StageSnapshot>,
    pub(crate) lanes: Vec<(String, DeviceStats)>,
    pub(crate) pools: Vec<PoolReport>,
    pub(crate) tiles_total: u64,
    pub(crate) tiles_computed: u64,
    /// FLOPs of the tiles computed in this run.
    pub(crate) flops: f64,
    /// NaN/Inf values seen staging each input that held any, and the first block with one.
    pub(crate) nonfinite_inputs: Vec<NonfiniteSeen>,
    /// NaN/Inf elements in the output tiles written (as stored), and the first tile with one.
    pub(crate) nonfinite_outputs: (u64, Option<crate::store::Block>),
    /// Input bytes one lane took from another lane's read instead of reading them.
    pub(crate) shared_read_bytes: u64,
    /// Of the bytes staged, those from sources held in memory.
    pub(crate) memory_read_bytes: u64,
    /// Where the inputs came from, for the summary: "files", "arrays" or "files and arrays".
    pub(crate) inputs_from: &'static str,
    /// Of the directly uploaded bytes, those checked on the devices ([`crate::backend::check`]).
    pub(crate) device_checked_bytes: u64,
    /// Seconds from the start of the stages to the first GEMM issued on any lane.
    pub(crate) first_gemm_s: Option<f64>,
    /// The kernel's dirty-page limits when the output is a disk-backed file (for the report).
    pub(crate) dirty: Option<DirtyLimits>,
    /// Whether those limits pace this run's writing: dirty pages pile up (not `durable`) and
    /// are created in parallel through the map (not one `pwrite`r, whose ~3 GB/s binds first).
    pub(crate) dirty_paced: bool,
    /// How the output was written ([`MatrixSink::write_mode`]).
    pub(crate) write_mode: &'static str,
    /// What uploads straight from the files' pages did (`None`: not used in this run).
    pub(crate) direct: Option<direct::DirectStats>,
}

/// What a pipeline runs on: the backend's lanes (on a GPU: context, streams, device buffers,
/// cuBLAS handle) and the host pools (pinned staging and output buffers), allocated before the
/// stages start.
///
/// The two do not depend on each other and each takes tenths of a second on a GPU machine, so
/// [`Engines::make`] makes them on two threads at once: for 32768² fp32 on one H200, 1.04–1.80 s
/// one after the other became 0.55–0.77 s together (docs/decisions/0009-early-start.md; they still contend in the
/// driver, a lane's calls waiting while pool buffers are registered), 0.16–0.21 s once the
/// pools' memory was populated before the backend started (the CUDA backend's prefill, §15),
/// and 0.01–0.02 s once the backend had registered it and run the lanes' warm-up GEMM before
/// returning (§16).
/// Every buffer is allocated before the stages start: growing the pinned pools while the
/// stages ran was tried, and `cuMemHostAlloc` then stalled both GPUs' GEMMs (32768² fp32 on 2
/// GPUs went from 1.2 to 2.5 s, docs/measurements/2026-11-30-keepup-*.log). The exception is a
/// lazy staging pool ([`Pool::lazy`]), made when every input block is expected to go straight
/// from the files' pages: its buffers are made only for blocks copied after all (few, if the
/// expectation holds: an input evicted meanwhile; a step with an added matrix `C0`, always
/// copied, is never lazy).
pub(crate) struct Engines {
    lanes: Vec<Box<dyn Lane>>,
    staging_pools: Vec<Pool>,
    out_pool: Pool,
    /// The kind of rectangle the lanes download finished tiles into, when they write the
    /// output in place ([`writes_in_place`]).
    out_in_place: Option<crate::seam::OutRect>,
    /// Seconds taken: both together, the lanes alone, the pools alone.
    pub(crate) times: [(&'static str, f64); 3],
    /// The rule `auto` copies by and the input files whose every block it copies
    /// ([`direct::copied_sources`]): decided once here, for the lazy pool and for the staging
    /// stage alike.
    copied: (direct::AutoCopies, Vec<std::path::PathBuf>),
}

impl Engines {
    /// The lanes of `backend` for `layout` in `e`'s precision, and the pools `layout` asks for,
    /// for the plan step `step` at `order` (`Step::order`; `(0, 0)` for a lone product) reading
    /// `sources`: when their blocks are all expected to go
    /// straight from the files' pages ([`direct::expected`], by `e.staging`, judged on the
    /// first output tile's blocks), the staging pools' buffers are made only if a block is
    /// copied after all ([`Pool::lazy`]); writing into `writer`, whose tiles need no output
    /// buffers when the lanes write it in place ([`writes_in_place`]).
    pub(crate) fn make(
        backend: &dyn Backend,
        layout: &Layout,
        e: &crate::plan::Engine,
        step: &Step,
        order: (usize, usize),
        sources: &StepSources,
        writer: &dyn MatrixSink,
    ) -> Result<Engines> {
        let t = Instant::now();
        let n = backend.caps().lanes.max(1);
        let p = e.precision;
        let (a, b) = Schedule::first_blocks(step, layout);
        let mode = backend.caps().staging(e.staging);
        let pinning = (backend.input_pinner()).map(|p| {
            let limits = direct::limits(p.limits(), e.host_memory, layout.host_bytes);
            direct::Pinning::new(limits, p.locks(), e.precision)
        });
        let firsts = [(&*sources.a, a), (&*sources.b, b)];
        let copied = pinning.map_or_else(Default::default, |p| {
            direct::copied_sources(mode, p, &firsts, layout.host_dt)
        });
        let lazy = direct::expected(
            mode,
            pinning,
            &firsts,
            &copied.1,
            sources.c0.is_some(),
            layout.host_dt,
        )
        .then(|| backend.shared())
        .flatten();
        // Tiles downloaded into the output itself need no output buffers: made only for a
        // checkpoint or a resumed tile.
        let out_in_place = writes_in_place(writer, backend.caps(), layout.host_dt);
        let out_lazy = out_in_place.and_then(|_| backend.shared());
        let (lanes, pools) = std::thread::scope(|s| {
            let (lazy, out_lazy) = (lazy.clone(), out_lazy.clone());
            let pools = s.spawn(move || {
                let t = Instant::now();
                let r = Self::pools(backend, layout, n, lazy, out_lazy);
                crate::trace::span("start-up", "pools", t, Instant::now());
                r.map(|p| (p, t.elapsed().as_secs_f64()))
            });
            let t = Instant::now();
            let lanes = backend.lanes(layout, p);
            crate::trace::span("start-up", "lanes", t, Instant::now());
            let lanes = lanes.map(|l| (l, t.elapsed().as_secs_f64()));
            let pools = pools.join().unwrap_or_else(|_| {
                Err(Error::Usage(
                    "allocating the host pools panicked (this is a bug; please report it)".into(),
                ))
            });
            (lanes, pools)
        });
        let (lanes, lanes_s) = lanes?;
        let ((mut staging_pools, mut out_pool), mut pools_s) = pools?;
        if lanes.len() != n {
            // A backend whose lane count differs from what its caps said: size the pools again.
            let t = Instant::now();
            (staging_pools, out_pool) = Self::pools(backend, layout, lanes.len(), lazy, out_lazy)?;
            pools_s += t.elapsed().as_secs_f64();
        }
        backend.pools_made(order);
        Ok(Engines {
            lanes,
            staging_pools,
            out_pool,
            out_in_place,
            times: [
                ("engines", t.elapsed().as_secs_f64()),
                ("lanes", lanes_s),
                ("pools", pools_s),
            ],
            copied,
        })
    }

    /// One staging pool per lane (lazy when `lazy` gives the allocator) and the output pool
    /// they share (lazy when `out_lazy` does).
    fn pools(
        alloc: &dyn Backend,
        l: &Layout,
        nlanes: usize,
        lazy: Option<Arc<dyn crate::backend::HostAlloc>>,
        out_lazy: Option<Arc<dyn crate::backend::HostAlloc>>,
    ) -> Result<(Vec<Pool>, Pool)> {
        let (count, bytes) = (l.staging_bufs, l.staging_buf_bytes as usize);
        let staging = (0..nlanes)
            .map(|_| match &lazy {
                Some(a) => Ok(Pool::lazy("staging", a.clone(), count, bytes)),
                None => Pool::new("staging", alloc, count, bytes),
            })
            .collect::<Result<Vec<_>>>()?;
        let (count, bytes) = (l.out_bufs * nlanes, l.out_buf_bytes as usize);
        let out = match out_lazy {
            Some(a) => Pool::lazy("output", a, count, bytes),
            None => Pool::new("output", alloc, count, bytes)?,
        };
        Ok((staging, out))
    }
}

/// One step, ready to run: inputs opened, output open, pools allocated, lanes made.
pub(crate) struct Pipeline<'a> {
    step: &'a Step,
    layout: &'a Layout,
    sched: Schedule,
    inputs: Inputs,
    /// One read of each input block for all lanes.
    shared: shared::SharedReads,
    writer: Option<Box<dyn MatrixSink>>,
    queue: TileQueue,
    staging_pools: Vec<Pool>,
    out_pool: Pool,
    lanes: Vec<Box<dyn Lane>>,
    /// Page-locked input tiles the lanes copy from directly; declared after `lanes`, so
    /// dropped (released) after them.
    direct: Option<direct::DirectReads>,
    show_devices: bool,
    cfg: RunConfig,
    sink: &'a dyn TileSink,
    progress: &'a Progress,
    done_before: u64,
    /// Partial accumulators: saved while tiles are computed, resumed from at the start.
    ckpt: Option<&'a crate::durable::checkpoint::Checkpoints>,
    /// The output tiles this run answers for (a shard's), when not the whole step: progress
    /// counts within them.
    scope: Option<std::ops::Range<u32>>,
    /// The kernel's dirty-page limits when the output is a disk-backed file, read when the
    /// pipeline is built (for the report's note on outputs larger than them).
    dirty: Option<DirtyLimits>,
    /// NaN/Inf in the output tiles written, counted by writeback.
    out_nonfinite: Nonfinite,
    /// The lanes download finished tiles straight into the output ([`writes_in_place`]).
    out_in_place: Option<crate::seam::OutRect>,
}

/// The rectangle `writer` offers for its first element computed in `host`
/// ([`MatrixSink::direct_rect`]): of what kind its memory is, when it offers to be written in
/// place at all.
pub(crate) fn first_rect(
    writer: &dyn MatrixSink,
    host: crate::dtype::DType,
) -> Option<crate::seam::OutRect> {
    writer.direct_rect(&crate::store::Block::FIRST, host)
}

/// Whether the lanes of a backend with `caps` will download finished tiles (computed in
/// `host`) straight into `writer`'s memory ([`first_rect`],
/// [`Caps::writes_directly`](crate::seam::Caps::writes_directly)) — and so need output
/// buffers only for checkpoints and resumed tiles ([`Engines::make`]): the rectangle of the
/// output's first element when they will (every block's must be of the same kind, see
/// [`same_kind`]).
pub(crate) fn writes_in_place(
    writer: &dyn MatrixSink,
    caps: &crate::seam::Caps,
    host: crate::dtype::DType,
) -> Option<crate::seam::OutRect> {
    first_rect(writer, host).filter(|r| caps.writes_directly(r))
}

/// Whether `r`, offered for block `b` of `host` elements, is a rectangle of the same kind of
/// memory as `kind` (the one [`writes_in_place`] approved) and of `b`'s shape: a lane writes
/// nothing else in place.
pub(crate) fn same_kind(
    r: &crate::seam::OutRect,
    kind: &crate::seam::OutRect,
    b: &crate::store::Block,
    host: crate::dtype::DType,
) -> bool {
    r.page_locked == kind.page_locked
        && r.gpu == kind.gpu
        && r.rows as u64 == b.rows
        && r.row_len as u64 == b.cols * host.size() as u64
        && r.pitch >= r.row_len
}

/// Counters shared by the stages and the progress display.
struct Counters {
    /// Nanoseconds after the start when the first GEMM was issued (`u64::MAX`: none yet).
    first_gemm_ns: AtomicU64,
    tiles_done: AtomicU64,
    flops_done: AtomicU64,
    flops_issued: AtomicU64,
    lane_live: Vec<Mutex<DeviceStats>>,
}

impl<'a> Pipeline<'a> {
    /// Build the pipeline of `step`, reading its operands from `sources`, opened by the caller
    /// (files, arrays in memory, a chain's intermediates held in memory).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn build_with(
        step: &'a Step,
        layout: &'a Layout,
        backend: &dyn Backend,
        engines: Engines,
        work: Work,
        cfg: RunConfig,
        sink: &'a dyn TileSink,
        progress: &'a Progress,
        sources: StepSources,
    ) -> Result<Pipeline<'a>> {
        let l = layout;
        let sched = Schedule::new(step, l);
        let inputs = Inputs::new(sources.a, sources.b, sources.c0, cfg.verify_inputs);
        let order = work
            .todo
            .unwrap_or_else(|| (0..sched.tiles.len() as u32).collect());
        let Engines {
            lanes,
            staging_pools,
            out_pool,
            out_in_place,
            copied,
            ..
        } = engines;
        let nlanes = lanes.len();
        let queue = TileQueue::new(&sched, order, nlanes, l.squares_fit(step, nlanes));
        let direct = match backend.input_pinner() {
            Some(pinner) if lanes.iter().any(|l| l.uploads_runs()) => {
                let srcs = [Some(&inputs.a), Some(&inputs.b), inputs.c0.as_ref()];
                let limits = direct::limits(pinner.limits(), cfg.host_memory, l.host_bytes);
                let mode = backend.caps().staging(cfg.staging);
                direct::DirectReads::new(
                    mode,
                    pinner,
                    srcs.into_iter().flatten().cloned().collect(),
                    limits,
                    copied,
                )
            }
            _ => None,
        };
        let dirty = (work.writer.counts_dirty_pages())
            .then(crate::store::fsutil::dirty_limits)
            .flatten();
        Ok(Pipeline {
            out_in_place,
            step,
            layout,
            sched,
            inputs,
            shared: shared::SharedReads::new(nlanes, l.staging_bufs * nlanes),
            writer: Some(work.writer),
            queue,
            staging_pools,
            out_pool,
            lanes,
            direct,
            show_devices: backend.caps().memory == MemorySpace::Device,
            cfg,
            sink,
            progress,
            done_before: work.done_before,
            ckpt: None,
            scope: None,
            dirty,
            out_nonfinite: Default::default(),
        })
    }

    /// Count progress within `tiles` (a shard of the step) instead of the whole step, so that
    /// a fresh shard starts at 0 %, not at the share the other shards hold.
    pub(crate) fn with_scope(mut self, tiles: std::ops::Range<u32>) -> Self {
        self.scope = Some(tiles);
        self
    }

    /// Save partial accumulators in `ckpt` as its interval says, and start the tiles it
    /// resumes from their checkpoints (which [`crate::durable::checkpoint::Checkpoints::scan`] accepted for
    /// exactly this step).
    pub(crate) fn with_checkpoints(
        mut self,
        ckpt: &'a crate::durable::checkpoint::Checkpoints,
    ) -> Self {
        self.ckpt = Some(ckpt);
        self
    }

    /// FLOPs of the tiles left to compute, less what their checkpoints already hold.
    fn todo_flops(&self) -> u64 {
        let mut f = self.tile_flops(self.queue.order().iter().copied());
        if let Some(c) = self.ckpt {
            for &seq in c.resumed().keys() {
                let b = &self.sched.tiles[seq as usize].block;
                f -= 2 * b.rows * b.cols * c.k_before(seq);
            }
        }
        f
    }

    /// Run every stage to the end (or the first error), then finish the output. What the step
    /// leaves behind is let go here, timed for the trace (in the report it is the step's
    /// `drop`, outside its wall time): 32768² tf32 on one H200 released its 8 GiB of
    /// page-locked inputs in 84–104 ms and unmapped them in about 20 ms (docs/decisions/0015-what-a-step-leaves-behind.md).
    pub(crate) fn run(mut self) -> Result<RunStats> {
        let r = self.run_stages_and_finish();
        let t = Instant::now();
        drop(self.direct.take());
        crate::trace::span("start-up", "drop: registered inputs", t, Instant::now());
        let t = Instant::now();
        drop(self);
        crate::trace::span("start-up", "drop: the pipeline", t, Instant::now());
        r
    }

    fn run_stages_and_finish(&mut self) -> Result<RunStats> {
        let nlanes = self.lanes.len();
        let scope = (self.scope.clone()).unwrap_or(0..self.sched.tiles.len() as u32);
        let all_flops = self.tile_flops(scope.clone());
        let todo_flops = self.todo_flops();
        debug_assert!(
            (self.scope.as_ref()).is_none_or(|r| self.queue.order().iter().all(|s| r.contains(s))),
            "a shard's tiles to compute lie inside its scope"
        );
        // Tiles of the scope finished before this run.
        let done_start = match &self.scope {
            Some(r) => (r.len() as u64).saturating_sub(self.queue.len() as u64),
            None => self.done_before,
        };
        let c = Counters {
            first_gemm_ns: AtomicU64::new(u64::MAX),
            tiles_done: AtomicU64::new(done_start),
            flops_done: AtomicU64::new(all_flops - todo_flops),
            flops_issued: AtomicU64::new(0),
            lane_live: (0..nlanes).map(|_| Default::default()).collect(),
        };
        let ctl = Control::new();
        let lane_names: Vec<String> = self.lanes.iter().map(|l| l.name()).collect();
        let t0 = Instant::now();
        let metrics = self.run_stages(&ctl, &c, &lane_names, all_flops, done_start, t0);
        let tl = Instant::now();
        let lane_stats: Vec<DeviceStats> = self.lanes.iter_mut().map(|l| l.stats()).collect();
        drop(std::mem::take(&mut self.lanes));
        crate::trace::span("start-up", "lanes drop", tl, Instant::now());
        if let Some(e) = ctl.take_error() {
            return Err(e);
        }
        let computed = c.tiles_done.load(Ordering::Relaxed) - done_start;
        // A stopped run whose last tiles were all recorded meanwhile is finished.
        if (ctl.is_cancelled() && !ctl.is_stopping())
            || (ctl.is_stopping() && computed != self.queue.len() as u64)
        {
            return Err(Error::Cancelled);
        }
        if computed != self.queue.len() as u64 {
            return Err(Error::Usage(format!(
                "internal error: {computed} of {} output tiles were written",
                self.queue.len()
            )));
        }
        let tf = Instant::now();
        let writer = self.writer.take().expect("the writer is finished once");
        let write_mode = writer.write_mode();
        writer.finish(self.cfg.durable)?;
        crate::trace::span("start-up", "output finish", tf, Instant::now());
        let flush_s = tf.elapsed().as_secs_f64();
        let pools = self
            .staging_pools
            .iter()
            .chain(std::iter::once(&self.out_pool))
            .map(|p| PoolReport {
                name: p.name().into(),
                buffers: p.count(),
                buffer_bytes: p.buf_bytes() as u64,
                high_water: p.high_water(),
                allocated: p.allocated(),
                lazy: p.is_lazy(),
            })
            .collect();
        Ok(RunStats {
            wall_s: t0.elapsed().as_secs_f64(),
            flush_s,
            stages: metrics.iter().map(|m| m.snapshot()).collect(),
            lanes: lane_names.into_iter().zip(lane_stats).collect(),
            pools,
            tiles_total: self.sched.tiles.len() as u64,
            tiles_computed: computed,
            flops: todo_flops as f64,
            nonfinite_inputs: self.inputs.nonfinite_seen(),
            nonfinite_outputs: self.out_nonfinite.get(),
            shared_read_bytes: self.shared.shared_bytes.load(Ordering::Relaxed),
            memory_read_bytes: self.inputs.memory_bytes.load(Ordering::Relaxed),
            inputs_from: self.inputs.origin(),
            device_checked_bytes: self.inputs.device_checked.load(Ordering::Relaxed),
            first_gemm_s: match c.first_gemm_ns.load(Ordering::Relaxed) {
                u64::MAX => None,
                ns => Some(ns as f64 * 1e-9),
            },
            dirty: self.dirty,
            dirty_paced: self.dirty.is_some()
                && !self.cfg.durable
                && write_mode == crate::store::WriteMode::Mmap.name(),
            write_mode,
            direct: self.direct.as_ref().map(|d| d.stats()),
        })
    }

    fn tile_flops(&self, seqs: impl Iterator<Item = u32>) -> u64 {
        seqs.map(|i| {
            let b = &self.sched.tiles[i as usize].block;
            2 * b.rows * b.cols * self.step.k
        })
        .sum()
    }

    /// Spawn every stage, wait for all of them, and return their metrics.
    fn run_stages(
        &mut self,
        ctl: &Control,
        c: &Counters,
        lane_names: &[String],
        all_flops: u64,
        done_start: u64,
        t0: Instant,
    ) -> Vec<Arc<StageMetrics>> {
        let step = self.step;
        let live = Live {
            started: t0,
            step: step.index,
            part: step.chain.as_ref().map(|c| (c.part, c.parts)),
            output: step.output_label(),
            tiles_total: self.queue.len() as u64 + done_start,
            flops_total: all_flops,
            flops_before: all_flops - self.todo_flops(),
            tiles_done: &c.tiles_done,
            flops_done: &c.flops_done,
            flops_issued: &c.flops_issued,
            cancel: self.cfg.cancel,
            show_devices: self.show_devices,
            lanes: lane_names.iter().cloned().zip(c.lane_live.iter()).collect(),
        };
        let progress = self.progress;
        // Who may cancel the run from outside: the binary's Ctrl-C flag, or a library caller's.
        let flags: Vec<&AtomicBool> = (self.cfg.cancel.into_iter())
            .chain(progress.cancel_flag().map(|f| &**f))
            .collect();
        let mut metrics = Vec::new();
        let stages = self.wire(c, t0, &mut metrics);
        std::thread::scope(|s| {
            let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
            let handles: Vec<_> = stages
                .into_iter()
                .map(|st| s.spawn(move || ctl.guard(|| st.run_boxed(ctl))))
                .collect();
            if !flags.is_empty() {
                // Cancel flags are polled, because whoever sets them (a signal handler, Python)
                // may not be able to do more than store a bool. A flag set stops the run
                // (`Control::stop`: the lanes save what they hold), which is then cancelled once
                // the output stages have written and recorded it, or after `STOP_GRACE`.
                let stop = stop_rx.clone();
                let flags = &flags;
                s.spawn(move || {
                    let mut since: Option<Instant> = None;
                    while let Err(RecvTimeoutError::Timeout) =
                        stop.recv_timeout(Duration::from_millis(20))
                    {
                        match since {
                            None if flags.iter().any(|f| f.load(Ordering::SeqCst)) => {
                                ctl.stop();
                                since = Some(Instant::now());
                            }
                            Some(t) if ctl.is_output_done() || t.elapsed() >= STOP_GRACE => {
                                ctl.cancel();
                                break;
                            }
                            _ => {}
                        }
                    }
                });
            }
            let (live, shown) = (&live, metrics.clone());
            let reporter = s.spawn(move || progress.watch(live, &shown, &stop_rx));
            for h in handles {
                if h.join().is_err() {
                    ctl.fail(Error::Usage(
                        "a pipeline thread panicked (this is a bug; please report it)".into(),
                    ));
                }
            }
            drop(stop_tx);
            let _ = reporter.join();
        });
        metrics
    }

    /// Every stage of the run, connected by bounded channels, ready to be spawned; their
    /// metrics are appended to `metrics` in display order.
    fn wire<'p>(
        &'p mut self,
        c: &'p Counters,
        t0: Instant,
        metrics: &mut Vec<Arc<StageMetrics>>,
    ) -> Vec<Box<dyn StageRun + 'p>> {
        let Pipeline {
            step,
            layout: l,
            sched,
            inputs,
            shared,
            writer,
            queue,
            staging_pools,
            out_pool,
            lanes,
            direct,
            cfg,
            sink,
            ckpt,
            out_nonfinite,
            out_in_place,
            ..
        } = self;
        let (step, l, sink, ckpt) = (*step, *l, *sink, *ckpt);
        let writer: &dyn MatrixSink = writer.as_deref().expect("writer is open until run ends");
        let nlanes = lanes.len();
        let depth = l.staging_bufs.max(2);
        let wb_threads = writeback_threads(cfg.threads);
        let (done_tx, done_rx): (Vec<_>, Vec<_>) = (0..wb_threads)
            .map(|_| crossbeam_channel::bounded::<Done>(l.out_bufs * nlanes))
            .unzip();
        let done_tx = stages::ToWriteback(done_tx);
        let (outprep_tx, outprep_rx) =
            crossbeam_channel::bounded::<crate::store::Block>(4 * nlanes);
        let mut stages: Vec<Box<dyn StageRun + 'p>> = Vec::new();
        let per_lane = LaneWiring {
            step,
            layout: l,
            sched,
            queue,
            inputs,
            shared,
            direct: direct.as_ref(),
            ckpt,
            out_pool,
            outprep: outprep_tx,
            done: done_tx,
            direct_out: out_in_place.map(|kind| (writer, kind)),
            lanes: nlanes,
            depth,
        };
        per_lane.foresee();
        for (i, lane) in lanes.iter_mut().enumerate() {
            let pool = staging_pools[i].clone();
            stages.extend(per_lane.stages(i, lane.as_mut(), pool, c, t0, metrics));
        }
        drop(per_lane);
        let out = OutputWiring {
            writer,
            layout: l,
            lanes: nlanes,
            done_rx,
            outprep_rx,
            sink,
            ckpt,
            durable: cfg.durable,
            threads: cfg.threads,
            k: step.k,
            nonfinite: out_nonfinite,
        };
        stages.extend(out.stages(c, metrics));
        stages
    }
}

/// How long a stopped run waits for its lanes to save their tiles in flight and for the output
/// stages to write and record them before it is cancelled outright (SLURM's `KillWait` is 30 s
/// by default; a save is one download and one checkpoint file per tile in flight).
const STOP_GRACE: Duration = Duration::from_secs(15);

/// The most GEMMs of a step whose loads are worked out ahead for the direct-upload registry
/// ([`LaneWiring::foresee`]): the planner's model took 1.38 s for 2^20 GEMMs on the 2-core VM,
/// so about 0.1 s at this bound (a GPU step of 8192² tiles has a few thousand; past it, the
/// range used longest ago goes first).
const FORESEE_MAX: u64 = 1 << 16;

/// Writeback threads for `threads` worker threads (`engine.threads`): one per eight, 1 to 4.
/// One thread copied finished tiles into the output and checksummed them at 3.5–3.9 GB/s on
/// the two-H200 host, the bottleneck of every large output there (60000² fp64, 100 000² tf32,
/// the 43 GB chain: writeback 87–100 % busy, docs/decisions/0005-writeback-threads-populate.md). Blocks are disjoint, so their
/// writes need no order; a tile's own messages stay on one thread ([`stages::ToWriteback`]).
fn writeback_threads(threads: usize) -> usize {
    (threads / 8).clamp(1, 4)
}

/// A stage ready to run on a thread of its own: every stage struct of [`stages`] is one.
trait StageRun: Send {
    fn run_boxed(self: Box<Self>, ctl: &Control) -> Result<()>;
}

macro_rules! stage_run {
    ($($t:ident),*) => {
        $(impl StageRun for $t<'_> {
            fn run_boxed(self: Box<Self>, ctl: &Control) -> Result<()> {
                (*self).run(ctl)
            }
        })*
    };
}
stage_run!(Planner, Prefetch, Staging, Checker, DeviceLane, OutPrep, Writeback, Durable);

/// What the stages of each lane (planner, prefetch, check, staging, device lane) are connected
/// to; the channel ends it holds are cloned for each lane.
struct LaneWiring<'p> {
    step: &'p Step,
    layout: &'p Layout,
    sched: &'p Schedule,
    queue: &'p TileQueue,
    inputs: &'p Inputs,
    shared: &'p shared::SharedReads,
    /// Uploads straight from the files' pages, for the lanes that take them.
    direct: Option<&'p direct::DirectReads>,
    ckpt: Option<&'p crate::durable::checkpoint::Checkpoints>,
    out_pool: &'p Pool,
    /// Output blocks about to be computed, to outprep.
    outprep: crossbeam_channel::Sender<crate::store::Block>,
    /// Finished tiles and checkpoints, to the writeback threads.
    done: ToWriteback,
    /// The output, where the lanes download finished tiles straight into it, and the kind of
    /// rectangle approved ([`writes_in_place`]).
    direct_out: Option<(&'p dyn MatrixSink, crate::seam::OutRect)>,
    lanes: usize,
    /// Capacity of the staging → lane channel (prefetch → staging holds four times that).
    depth: usize,
}

impl<'p> LaneWiring<'p> {
    /// Lane `lane`'s planner, taking its tiles from `queue`.
    fn planner<'q>(
        &self,
        lane: usize,
        queue: &'q TileQueue,
        outprep: crossbeam_channel::Sender<crate::store::Block>,
        out: crossbeam_channel::Sender<PlanOp>,
        m: Arc<StageMetrics>,
    ) -> Planner<'q>
    where
        'p: 'q,
    {
        let (step, l) = (self.step, self.layout);
        Planner {
            lane,
            outprep,
            sched: self.sched,
            queue,
            slots: l.slots,
            accs: l.accs,
            start_group: l.start_group,
            row_group: l.row_group,
            alpha: step.alpha,
            beta: step.beta,
            has_c0: step.c0.is_some(),
            ckpt: self.ckpt,
            out,
            m,
        }
    }

    /// Tell the direct-upload registry the order of the loads to come
    /// ([`direct::DirectReads::foresee`]): the planner's model run ahead on a copy of the
    /// queue, exact when one lane runs the step (several lanes share out tiles as they go, and
    /// then the registry releases the range used longest ago). Skipped past [`FORESEE_MAX`]
    /// GEMMs (a step of small tiles, whose ranges a GPU's budget holds anyway).
    fn foresee(&self) {
        let Some(d) = self.direct else {
            return;
        };
        if self.lanes != 1
            || self.queue.len() as u64 * self.sched.gk > FORESEE_MAX
            || !d.may_release()
        {
            return;
        }
        let t = Instant::now();
        let queue = TileQueue::new(
            self.sched,
            self.queue.order().to_vec(),
            1,
            self.queue.grows(),
        );
        let (tx, rx) = crossbeam_channel::bounded(256);
        let (prep, _prep) = crossbeam_channel::unbounded();
        let m = StageMetrics::new(StageKind::Planner, 0, 1);
        let planner = self.planner(0, &queue, prep, tx, m);
        // The planner's ops drained as they come: only the loads are kept.
        let (ok, loads) = std::thread::scope(|s| {
            let run = s.spawn(move || planner.run(&Control::new()).is_ok());
            let loads: Vec<(Src, crate::store::Block)> = rx
                .iter()
                .filter_map(|op| match op {
                    PlanOp::Load { src, block, .. } => Some((src, block)),
                    _ => None,
                })
                .collect();
            (run.join().unwrap_or(false), loads)
        });
        if ok {
            let loads = loads.into_iter().map(|(src, b)| (self.inputs.file(src), b));
            d.foresee(loads, self.layout.host_dt);
        }
        crate::trace::span("start-up", "foresee loads", t, Instant::now());
    }

    /// The stages of lane `i`, which runs on `lane` and stages into `pool`, in display order.
    fn stages(
        &self,
        i: usize,
        lane: &'p mut dyn Lane,
        pool: Pool,
        c: &'p Counters,
        t0: Instant,
        metrics: &mut Vec<Arc<StageMetrics>>,
    ) -> Vec<Box<dyn StageRun + 'p>> {
        let (l, inputs, ckpt, depth) = (self.layout, self.inputs, self.ckpt, self.depth);
        let mut stages: Vec<Box<dyn StageRun + 'p>> = Vec::new();
        let (plan_tx, plan_rx) = crossbeam_channel::bounded::<PlanOp>(16);
        let (pre_tx, pre_rx) = crossbeam_channel::bounded::<PlanOp>(4 * depth);
        let (lane_tx, lane_rx) = crossbeam_channel::bounded::<LaneOp>(depth);
        let mut m = |k| {
            let m = StageMetrics::new(k, i, self.lanes);
            metrics.push(m.clone());
            m
        };
        stages.push(Box::new(self.planner(
            i,
            self.queue,
            self.outprep.clone(),
            plan_tx,
            m(StageKind::Planner),
        )));
        stages.push(Box::new(Prefetch {
            inputs,
            rx: plan_rx,
            out: pre_tx,
            m: m(StageKind::Prefetch),
        }));
        // Uploads straight from the files' pages, where the lane takes them, and the stage
        // that checks what they upload.
        let direct = match self.direct.filter(|_| lane.uploads_runs()) {
            Some(d) => {
                let (check_tx, check_rx) = crossbeam_channel::bounded(64);
                let progress = Arc::new(direct::CheckProgress::default());
                stages.push(Box::new(stages::Checker {
                    inputs,
                    host_dt: l.host_dt,
                    rx: check_rx,
                    progress: progress.clone(),
                    m: m(StageKind::Check),
                }));
                Some((d, check_tx, progress))
            }
            None => None,
        };
        stages.push(Box::new(Staging {
            lane: i,
            inputs,
            shared: self.shared,
            direct,
            checks_issued: std::cell::Cell::new(0),
            device_checks: lane.checks_uploads(),
            gpu: lane.gpu(),
            pool,
            host_dt: l.host_dt,
            rx: pre_rx,
            out: lane_tx,
            m: m(StageKind::Staging),
        }));
        let lane_gpu = lane.gpu();
        stages.push(Box::new(DeviceLane {
            lane,
            out_pool: self.out_pool.clone(),
            max_downs: l.out_bufs,
            host_dt: l.host_dt,
            rx: lane_rx,
            out: self.done.clone(),
            m: m(StageKind::Lane),
            flops_issued: &c.flops_issued,
            first_gemm: (t0, &c.first_gemm_ns),
            live: &c.lane_live[i],
            ckpt,
            checks: None,
            // An output in GPU memory only from a lane on that GPU: another may not have the
            // caller's memory mapped (torch's and CuPy's pools are not, unless granted); its
            // tiles go through output buffers and the sink's own copy.
            direct_out: (self.direct_out).filter(|(_, k)| k.gpu.is_none() || k.gpu == lane_gpu),
        }));
        stages
    }
}

/// What the output side of the pipeline (prefault, writeback, durability) is connected to.
struct OutputWiring<'p> {
    writer: &'p dyn MatrixSink,
    layout: &'p Layout,
    lanes: usize,
    /// One channel per writeback thread ([`stages::ToWriteback`]).
    done_rx: Vec<crossbeam_channel::Receiver<Done>>,
    outprep_rx: crossbeam_channel::Receiver<crate::store::Block>,
    sink: &'p dyn TileSink,
    ckpt: Option<&'p crate::durable::checkpoint::Checkpoints>,
    durable: bool,
    threads: usize,
    k: u64,
    nonfinite: &'p Nonfinite,
}

impl<'p> OutputWiring<'p> {
    fn stages(
        self,
        c: &'p Counters,
        metrics: &mut Vec<Arc<StageMetrics>>,
    ) -> Vec<Box<dyn StageRun + 'p>> {
        let OutputWiring {
            writer,
            layout: l,
            lanes: nlanes,
            done_rx,
            outprep_rx,
            sink,
            ckpt,
            durable,
            threads,
            k,
            nonfinite,
        } = self;
        let mut stages: Vec<Box<dyn StageRun + 'p>> = Vec::new();
        // Populating output pages is kernel work that one thread does at ~3.5 GB/s. In a
        // preallocated file (the writers fallocate) it scales with threads: 3.5, 8.7, 12.7 and
        // 14.5 GB/s with 1, 2, 4 and 8 on the 32-core H200 host (tools/probes/page_creation_rate.py,
        // docs/measurements), while an n = 32768 output is 4.3 GB (8.6 GB in f64). But its
        // threads take cores from staging's copies: on a 16-core H100 host 2 threads instead of 4
        // made fp64 from `.npy` 2-7 % faster (staging bound) and tf32 no slower, 8 gained
        // nothing (`MGMM_OUTPREP_THREADS`, 2026-12-07e). An eighth of the worker threads
        // (engine.threads), 2 to 8, at least one per lane.
        let outprep_threads = crate::config::outprep_threads()
            .unwrap_or_else(|| (threads / 8).clamp(2, 8).max(nlanes.min(8)));
        for i in 0..outprep_threads {
            let m = StageMetrics::new(StageKind::OutPrep, i, outprep_threads);
            metrics.push(m.clone());
            let rx = outprep_rx.clone();
            stages.push(Box::new(OutPrep { writer, rx, m }));
        }
        let (sync_tx, sync_rx) = crossbeam_channel::bounded(l.out_bufs * nlanes + 4);
        let n = done_rx.len();
        for (i, rx) in done_rx.into_iter().enumerate() {
            let m = StageMetrics::new(StageKind::Writeback, i, n);
            metrics.push(m.clone());
            stages.push(Box::new(Writeback {
                writer,
                ckpt,
                host_dt: l.host_dt,
                nonfinite,
                rx,
                out: sync_tx.clone(),
                m,
            }));
        }
        drop(sync_tx);
        let sync_m = StageMetrics::new(StageKind::Sync, 0, 1);
        metrics.push(sync_m.clone());
        stages.push(Box::new(Durable {
            writer,
            rx: sync_rx,
            m: sync_m,
            sink,
            ckpt,
            tiles_done: &c.tiles_done,
            flops_done: &c.flops_done,
            k,
            durable,
        }));
        stages
    }
}
