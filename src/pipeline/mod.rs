//! The streaming pipeline that runs one step of a plan, identical for every backend.
//!
//! A [`Pipeline`] is a value: [`Pipeline::build`] takes the step, its layout, the backend's lanes
//! and the work left (all tiles, or what a resume left), allocates every pool from the layout,
//! and [`Pipeline::run`] starts the stages of [`stages`] in one `std::thread::scope` — per lane a
//! planner, a prefetch, a staging and a device-lane thread; shared outprep and writeback — waits,
//! and returns the raw [`RunStats`]. Turning stats into a report is [`crate::report`]'s job.
//! Backpressure comes only from bounded channels and the fixed pools. The first error cancels
//! every stage and is the one returned; a failed run never reports success.

pub mod control;
pub mod journal;
pub mod metrics;
pub mod pool;
pub mod stages;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::backend::{Backend, DeviceStats, Lane, MemorySpace};
use crate::error::{Error, Result};
use crate::plan::layout::Layout;
use crate::plan::schedule::Schedule;
use crate::plan::{Engine, Step};
use crate::progress::{Live, Progress};
use crate::store::{open_source, Header, MatrixSink};
use control::Control;
use metrics::{StageKind, StageMetrics, StageSnapshot};
use pool::Pool;
use stages::*;

/// The output header a step writes.
pub fn output_header(step: &Step, layout: &Layout) -> Header {
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
pub struct Work {
    /// The output, created or reopened by the caller.
    pub writer: Box<dyn MatrixSink>,
    /// Output tiles to compute (schedule sequence numbers, in schedule order); `None` = all.
    pub todo: Option<Vec<u32>>,
    /// Output tiles already finished before this run (resume), for progress.
    pub done_before: u64,
}

/// Settings of a run that are not part of the layout.
#[derive(Clone, Copy, Debug)]
pub struct RunConfig {
    pub verify_inputs: bool,
    pub durable: bool,
    /// A flag set from outside (Ctrl-C) that cancels the run; `None`: only errors cancel.
    pub cancel: Option<&'static std::sync::atomic::AtomicBool>,
}

impl RunConfig {
    pub fn from_engine(e: &Engine) -> RunConfig {
        RunConfig {
            verify_inputs: e.verify_inputs,
            durable: e.durable,
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
}

/// What one run of a pipeline measured; no interpretation (see [`crate::report`]).
#[derive(Clone, Debug)]
pub struct RunStats {
    pub wall_s: f64,
    pub flush_s: f64,
    pub stages: Vec<StageSnapshot>,
    pub lanes: Vec<(String, DeviceStats)>,
    pub pools: Vec<PoolReport>,
    pub tiles_total: u64,
    pub tiles_computed: u64,
    /// FLOPs of the tiles computed in this run.
    pub flops: f64,
    pub nonfinite_inputs: u64,
}

/// One step, ready to run: inputs opened, output open, pools allocated, lanes made.
pub struct Pipeline<'a> {
    step: &'a Step,
    layout: &'a Layout,
    sched: Schedule,
    inputs: Inputs,
    writer: Option<Box<dyn MatrixSink>>,
    queue: TileQueue,
    staging_pools: Vec<Pool>,
    out_pool: Pool,
    lanes: Vec<Box<dyn Lane>>,
    show_devices: bool,
    cfg: RunConfig,
    sink: &'a dyn TileSink,
    progress: &'a Progress,
    done_before: u64,
}

/// Counters shared by the stages and the progress display.
struct Counters {
    tiles_done: AtomicU64,
    flops_done: AtomicU64,
    flops_issued: AtomicU64,
    lane_live: Vec<Mutex<DeviceStats>>,
}

impl<'a> Pipeline<'a> {
    #[allow(clippy::too_many_arguments)]
    pub fn build(
        step: &'a Step,
        layout: &'a Layout,
        backend: &dyn Backend,
        lanes: Vec<Box<dyn Lane>>,
        work: Work,
        cfg: RunConfig,
        sink: &'a dyn TileSink,
        progress: &'a Progress,
    ) -> Result<Pipeline<'a>> {
        let l = layout;
        let sched = Schedule::new(step, l);
        let open = |p: &std::path::Path| open_source(p);
        let inputs = Inputs::new(
            open(&step.a.path)?,
            open(&step.b.path)?,
            step.c0.as_ref().map(|c| open(&c.path)).transpose()?,
            cfg.verify_inputs,
        );
        let order = work
            .todo
            .unwrap_or_else(|| (0..sched.tiles.len() as u32).collect());
        let nlanes = lanes.len();
        let queue = TileQueue::new(order, nlanes);
        let staging_pools = (0..nlanes)
            .map(|_| {
                Pool::new(
                    "staging",
                    backend,
                    l.staging_bufs,
                    l.staging_buf_bytes as usize,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let out_pool = Pool::new(
            "output",
            backend,
            l.out_bufs * nlanes,
            l.out_buf_bytes as usize,
        )?;
        Ok(Pipeline {
            step,
            layout,
            sched,
            inputs,
            writer: Some(work.writer),
            queue,
            staging_pools,
            out_pool,
            lanes,
            show_devices: backend.caps().memory == MemorySpace::Device,
            cfg,
            sink,
            progress,
            done_before: work.done_before,
        })
    }

    /// Run every stage to the end (or the first error), then finish the output.
    pub fn run(mut self) -> Result<RunStats> {
        let nlanes = self.lanes.len();
        let all_flops = self.tile_flops(0..self.sched.tiles.len() as u32);
        let todo_flops = self.tile_flops(self.queue.order().iter().copied());
        let c = Counters {
            tiles_done: AtomicU64::new(self.done_before),
            flops_done: AtomicU64::new(all_flops - todo_flops),
            flops_issued: AtomicU64::new(0),
            lane_live: (0..nlanes).map(|_| Default::default()).collect(),
        };
        let ctl = Control::new();
        let lane_names: Vec<String> = self.lanes.iter().map(|l| l.name()).collect();
        let t0 = Instant::now();
        let metrics = self.run_stages(&ctl, &c, &lane_names, all_flops, t0);
        let lane_stats: Vec<DeviceStats> = self.lanes.iter_mut().map(|l| l.stats()).collect();
        drop(std::mem::take(&mut self.lanes));
        if let Some(e) = ctl.take_error() {
            return Err(e);
        }
        if ctl.is_cancelled() {
            return Err(Error::Cancelled);
        }
        let computed = c.tiles_done.load(Ordering::Relaxed) - self.done_before;
        if computed != self.queue.len() as u64 {
            return Err(Error::Usage(format!(
                "internal error: {computed} of {} output tiles were written",
                self.queue.len()
            )));
        }
        let tf = Instant::now();
        let writer = self.writer.take().expect("the writer is finished once");
        writer.finish(self.cfg.durable)?;
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
            nonfinite_inputs: self.inputs.nonfinite.load(Ordering::Relaxed),
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
        t0: Instant,
    ) -> Vec<Arc<StageMetrics>> {
        let (l, step) = (self.layout, self.step);
        let nlanes = self.lanes.len();
        let depth = l.staging_bufs.max(2);
        let (done_tx, done_rx) = crossbeam_channel::bounded::<Done>(l.out_bufs * nlanes);
        let (outprep_tx, outprep_rx) =
            crossbeam_channel::bounded::<crate::store::Block>(4 * nlanes);
        // Populating output pages is kernel work that one thread does at a few GB/s; with
        // several lanes the devices outrun it, so give it a thread per lane (up to 4).
        let outprep_threads = nlanes.clamp(1, 4);
        let mut all_metrics: Vec<Arc<StageMetrics>> = Vec::new();
        let live = Live {
            started: t0,
            step: step.index,
            output: step.output.display().to_string(),
            tiles_total: self.queue.len() as u64 + self.done_before,
            flops_total: all_flops,
            flops_before: all_flops - self.tile_flops(self.queue.order().iter().copied()),
            tiles_done: &c.tiles_done,
            flops_done: &c.flops_done,
            flops_issued: &c.flops_issued,
            cancel: self.cfg.cancel,
            show_devices: self.show_devices,
            lanes: lane_names.iter().cloned().zip(c.lane_live.iter()).collect(),
        };
        let writer: &dyn MatrixSink = self
            .writer
            .as_deref()
            .expect("writer is open until run ends");
        let (sched, queue, inputs) = (&self.sched, &self.queue, &self.inputs);
        let (sink, progress, cfg) = (self.sink, self.progress, self.cfg);
        let (staging_pools, out_pool) = (&self.staging_pools, &self.out_pool);
        std::thread::scope(|s| {
            let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
            let mut handles = Vec::new();
            for (i, lane) in self.lanes.iter_mut().enumerate() {
                let (plan_tx, plan_rx) = crossbeam_channel::bounded::<PlanOp>(16);
                let (pre_tx, pre_rx) = crossbeam_channel::bounded::<PlanOp>(4 * depth);
                let (lane_tx, lane_rx) = crossbeam_channel::bounded::<LaneOp>(depth);
                let m = |k| StageMetrics::new(k, i, nlanes);
                let (pm, fm, sm, dm) = (
                    m(StageKind::Planner),
                    m(StageKind::Prefetch),
                    m(StageKind::Staging),
                    m(StageKind::Lane),
                );
                all_metrics.extend([pm.clone(), fm.clone(), sm.clone(), dm.clone()]);
                let planner = Planner {
                    lane: i,
                    outprep: outprep_tx.clone(),
                    sched,
                    queue,
                    slots: l.slots,
                    accs: l.accs,
                    alpha: step.alpha,
                    beta: step.beta,
                    has_c0: step.c0.is_some(),
                    out: plan_tx,
                    m: pm,
                };
                let prefetch = Prefetch {
                    inputs,
                    rx: plan_rx,
                    out: pre_tx,
                    m: fm,
                };
                let staging = Staging {
                    inputs,
                    pool: staging_pools[i].clone(),
                    host_dt: l.host_dt,
                    rx: pre_rx,
                    out: lane_tx,
                    m: sm,
                };
                let dlane = DeviceLane {
                    lane: lane.as_mut(),
                    out_pool: out_pool.clone(),
                    host_dt: l.host_dt,
                    rx: lane_rx,
                    out: done_tx.clone(),
                    m: dm,
                    flops_issued: &c.flops_issued,
                    live: &c.lane_live[i],
                };
                handles.push(s.spawn(move || ctl.guard(|| planner.run(ctl))));
                handles.push(s.spawn(move || ctl.guard(|| prefetch.run(ctl))));
                handles.push(s.spawn(move || ctl.guard(|| staging.run(ctl))));
                handles.push(s.spawn(move || ctl.guard(|| dlane.run(ctl))));
            }
            drop(done_tx);
            drop(outprep_tx);
            for i in 0..outprep_threads {
                let m = StageMetrics::new(StageKind::OutPrep, i, outprep_threads);
                all_metrics.push(m.clone());
                let outprep = OutPrep {
                    writer,
                    rx: outprep_rx.clone(),
                    m,
                };
                handles.push(s.spawn(move || ctl.guard(|| outprep.run(ctl))));
            }
            drop(outprep_rx);
            let wb_m = StageMetrics::new(StageKind::Writeback, 0, 1);
            all_metrics.push(wb_m.clone());
            let wb = Writeback {
                writer,
                host_dt: l.host_dt,
                rx: done_rx,
                m: wb_m,
                sink,
                tiles_done: &c.tiles_done,
                flops_done: &c.flops_done,
                k: step.k,
                durable: cfg.durable,
            };
            handles.push(s.spawn(move || ctl.guard(|| wb.run(ctl))));
            let metrics = all_metrics.clone();
            let live = &live;
            if let Some(flag) = cfg.cancel {
                // Ctrl-C: poll the flag until the stages are done, and cancel them when set.
                let stop = stop_rx.clone();
                s.spawn(move || loop {
                    if flag.load(Ordering::Relaxed) {
                        ctl.cancel();
                        break;
                    }
                    if let Err(crossbeam_channel::RecvTimeoutError::Disconnected) =
                        stop.recv_timeout(std::time::Duration::from_millis(50))
                    {
                        break;
                    }
                });
            }
            let reporter = s.spawn(move || progress.watch(live, &metrics, &stop_rx));
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
        all_metrics
    }
}
