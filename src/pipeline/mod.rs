//! The streaming pipeline that runs one step of a plan, identical for every backend.
//!
//! [`run_step`] opens the inputs, creates the output, allocates every pool from the layout,
//! starts the stages of [`stages`] in one `std::thread::scope` — per lane a planner, a prefetch,
//! a staging and a device-lane thread; one shared writeback — and waits. Backpressure comes only
//! from bounded channels and the fixed pools. The first error cancels every stage and is the one
//! returned; a failed run never reports success.

pub mod control;
pub mod journal;
pub mod metrics;
pub mod pool;
pub mod stages;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::backend::{DeviceStats, HostAlloc, Lane};
use crate::error::{Error, Result};
use crate::plan::layout::Layout;
use crate::plan::schedule::{OutTile, Schedule};
use crate::plan::{Precision, Step};
use crate::progress::{Live, Progress};
use crate::store::{open_source, Header, TiledWriter};
use control::Control;
use metrics::{StageMetrics, StageSnapshot};
use pool::Pool;
use stages::*;

#[derive(Clone, Debug, Serialize)]
pub struct PoolReport {
    pub name: String,
    pub buffers: usize,
    pub buffer_bytes: u64,
    pub high_water: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct LaneReport {
    pub name: String,
    #[serde(flatten)]
    pub stats: DeviceStats,
}

#[derive(Clone, Debug, Serialize)]
pub struct StepReport {
    pub step: usize,
    pub expr: String,
    pub output: String,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub backend: String,
    pub precision: String,
    pub tile: [u64; 3],
    pub tiles_total: u64,
    pub tiles_computed: u64,
    pub wall_s: f64,
    pub flops: f64,
    pub gflops_per_s: f64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub host_budget_bytes: u64,
    pub host_pool_bytes: u64,
    pub host_peak_bytes: u64,
    pub pools: Vec<PoolReport>,
    pub stages: Vec<StageSnapshot>,
    pub lanes: Vec<LaneReport>,
    /// (name, busy share of wall time) for every stage and device engine, largest first.
    pub busy_shares: Vec<(String, f64)>,
    pub bottleneck: String,
    pub nonfinite_inputs: u64,
    pub flush_s: f64,
}

/// Everything a step run needs besides the step itself.
pub struct StepEnv<'a> {
    pub layout: &'a Layout,
    pub alloc: &'a dyn HostAlloc,
    pub lanes: Vec<Box<dyn Lane>>,
    pub backend_name: String,
    pub precision: Precision,
    /// Round inputs on the host (CPU emulation of tf32/bf16/fp16).
    pub host_rounding: bool,
    pub verify_inputs: bool,
    pub durable: bool,
    pub host_budget: u64,
    pub progress: &'a Progress,
    /// Output tiles to compute (in schedule order); `None` = all.
    pub todo: Option<Vec<u32>>,
    pub sink: &'a dyn TileSink,
    /// Writer for an output that already exists (resume); `None` creates it.
    pub writer: Option<TiledWriter>,
    /// Output tiles already finished before this run (resume), for progress.
    pub done_before: u64,
}

struct NoSink;
impl TileSink for NoSink {
    fn tile_written(&self, _: &OutTile, _: u32) -> Result<()> {
        Ok(())
    }
}
/// A sink that does nothing after each tile.
pub static NO_SINK: &(dyn TileSink + Sync) = &NoSink;

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

pub fn run_step(step: &Step, env: StepEnv<'_>) -> Result<StepReport> {
    let l = env.layout;
    let sched = Schedule::new(step, l);
    let open = |p: &std::path::Path| open_source(p);
    let inputs = Inputs::new(
        open(&step.a.path)?,
        open(&step.b.path)?,
        step.c0.as_ref().map(|c| open(&c.path)).transpose()?,
        env.verify_inputs,
    );
    let writer = match env.writer {
        Some(w) => w,
        None => TiledWriter::create(&step.output, output_header(step, l))?,
    };
    let order: Vec<u32> = env
        .todo
        .unwrap_or_else(|| (0..sched.tiles.len() as u32).collect());
    let nlanes = env.lanes.len();
    let queue = TileQueue::new(order, nlanes);

    let mut staging_pools = Vec::new();
    for _ in 0..nlanes {
        staging_pools.push(Pool::new(
            "staging",
            env.alloc,
            l.staging_bufs,
            l.staging_buf_bytes as usize,
        )?);
    }
    let out_pool = Pool::new(
        "output",
        env.alloc,
        l.out_bufs * nlanes,
        l.out_buf_bytes as usize,
    )?;

    let ctl = Control::new();
    let all_flops: u64 = sched
        .tiles
        .iter()
        .map(|t| 2 * t.block.rows * t.block.cols * step.k)
        .sum();
    let todo_flops = queue_flops(&sched, &queue, step.k);
    let tiles_done = AtomicU64::new(env.done_before);
    let flops_done = AtomicU64::new(all_flops - todo_flops);
    let flops_issued = AtomicU64::new(0);
    let mut all_metrics: Vec<Arc<StageMetrics>> = Vec::new();
    let wb_m = StageMetrics::new("writeback");
    let depth = l.staging_bufs.max(2);
    let (done_tx, done_rx) = crossbeam_channel::bounded::<Done>(l.out_bufs * nlanes);
    let round = if env.host_rounding {
        Some(env.precision)
    } else {
        None
    };
    let mut lanes = env.lanes;
    let lane_names: Vec<String> = lanes.iter().map(|l| l.name()).collect();
    let t0 = Instant::now();
    let lane_live: Vec<std::sync::Mutex<DeviceStats>> =
        (0..nlanes).map(|_| Default::default()).collect();
    let live = Live {
        started: t0,
        tiles_total: queue.len() as u64 + env.done_before,
        flops_total: all_flops,
        tiles_done: &tiles_done,
        flops_done: &flops_done,
        lanes: lane_names.iter().cloned().zip(lane_live.iter()).collect(),
    };

    let mut lane_stats: Vec<DeviceStats> = vec![DeviceStats::default(); nlanes];
    let (outprep_tx, outprep_rx) = crossbeam_channel::bounded::<crate::store::Block>(4 * nlanes);
    // Populating output pages is kernel work that one thread does at a few GB/s; with several
    // lanes the GPUs outrun it, so give it a thread per lane (up to 4).
    let outprep_threads = nlanes.clamp(1, 4);
    let op_ms: Vec<Arc<StageMetrics>> = (0..outprep_threads)
        .map(|i| {
            StageMetrics::new(if outprep_threads > 1 {
                format!("outprep[{i}]")
            } else {
                "outprep".into()
            })
        })
        .collect();
    std::thread::scope(|s| {
        let ctl = &ctl;
        let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
        let mut handles = Vec::new();
        for (i, lane) in lanes.iter_mut().enumerate() {
            let suffix = if nlanes > 1 {
                format!("[{i}]")
            } else {
                String::new()
            };
            let (plan_tx, plan_rx) = crossbeam_channel::bounded::<PlanOp>(16);
            let (pre_tx, pre_rx) = crossbeam_channel::bounded::<PlanOp>(4 * depth);
            let (lane_tx, lane_rx) = crossbeam_channel::bounded::<LaneOp>(depth);
            let pm = StageMetrics::new(format!("planner{suffix}"));
            let fm = StageMetrics::new(format!("prefetch{suffix}"));
            let sm = StageMetrics::new(format!("staging{suffix}"));
            let dm = StageMetrics::new(format!("lane{suffix}"));
            all_metrics.extend([pm.clone(), fm.clone(), sm.clone(), dm.clone()]);
            let planner = Planner {
                lane: i,
                outprep: outprep_tx.clone(),
                sched: &sched,
                queue: &queue,
                slots: l.slots,
                accs: l.accs,
                alpha: step.alpha,
                beta: step.beta,
                has_c0: step.c0.is_some(),
                out: plan_tx,
                m: pm,
            };
            let prefetch = Prefetch {
                inputs: &inputs,
                rx: plan_rx,
                out: pre_tx,
                m: fm,
            };
            let staging = Staging {
                inputs: &inputs,
                pool: staging_pools[i].clone(),
                host_dt: l.host_dt,
                round,
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
                flops_issued: &flops_issued,
                live: &lane_live[i],
            };
            handles.push(s.spawn(move || ctl.guard(|| planner.run(ctl))));
            handles.push(s.spawn(move || ctl.guard(|| prefetch.run(ctl))));
            handles.push(s.spawn(move || ctl.guard(|| staging.run(ctl))));
            handles.push(s.spawn(move || ctl.guard(|| dlane.run(ctl))));
        }
        drop(done_tx);
        drop(outprep_tx);
        all_metrics.extend(op_ms.iter().cloned());
        all_metrics.push(wb_m.clone());
        for m in &op_ms {
            let outprep = OutPrep {
                writer: &writer,
                rx: outprep_rx.clone(),
                m: m.clone(),
            };
            handles.push(s.spawn(move || ctl.guard(|| outprep.run(ctl))));
        }
        drop(outprep_rx);
        let wb = Writeback {
            writer: &writer,
            host_dt: l.host_dt,
            rx: done_rx,
            m: wb_m.clone(),
            sink: env.sink,
            tiles_done: &tiles_done,
            flops_done: &flops_done,
            k: step.k,
            durable: env.durable,
        };
        handles.push(s.spawn(move || ctl.guard(|| wb.run(ctl))));
        let metrics = all_metrics.clone();
        let live = &live;
        let progress = env.progress;
        let label = format!("step {}", step.index + 1);
        let reporter = s.spawn(move || progress.watch(&label, live, &metrics, &stop_rx));
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
    for (i, lane) in lanes.iter_mut().enumerate() {
        lane_stats[i] = lane.stats();
    }
    drop(lanes);
    if let Some(e) = ctl.take_error() {
        return Err(e);
    }
    if ctl.is_cancelled() {
        return Err(Error::Cancelled);
    }
    let computed = tiles_done.load(Ordering::Relaxed) - env.done_before;
    if computed != queue.len() as u64 {
        return Err(Error::Usage(format!(
            "internal error: {computed} of {} output tiles were written",
            queue.len()
        )));
    }
    let tf = Instant::now();
    writer.finish(env.durable)?;
    let flush_s = tf.elapsed().as_secs_f64();
    let wall = t0.elapsed().as_secs_f64();

    let stages: Vec<StageSnapshot> = all_metrics.iter().map(|m| m.snapshot()).collect();
    let mut shares: Vec<(String, f64)> = stages
        .iter()
        .map(|s| (s.name.clone(), s.busy_s / wall))
        .collect();
    for (name, st) in lane_names.iter().zip(&lane_stats) {
        if name != "cpu" {
            shares.push((format!("{name} gemm"), st.gemm_s / wall));
            shares.push((format!("{name} h2d"), st.h2d_s / wall));
            shares.push((format!("{name} d2h"), st.d2h_s / wall));
        }
    }
    shares.push(("flush".into(), flush_s / wall));
    shares.sort_by(|a, b| b.1.total_cmp(&a.1));
    let bottleneck = shares.first().map(|s| s.0.clone()).unwrap_or_default();
    let read_bytes = stages
        .iter()
        .filter(|s| s.name.starts_with("staging"))
        .map(|s| s.bytes)
        .sum();
    let write_bytes = stages
        .iter()
        .filter(|s| s.name == "writeback")
        .map(|s| s.bytes)
        .sum();
    let mut pools: Vec<PoolReport> = staging_pools
        .iter()
        .chain(std::iter::once(&out_pool))
        .map(|p| PoolReport {
            name: p.name().into(),
            buffers: p.count(),
            buffer_bytes: p.buf_bytes() as u64,
            high_water: p.high_water(),
        })
        .collect();
    let host_peak: u64 = pools
        .iter()
        .map(|p| p.high_water as u64 * p.buffer_bytes)
        .sum::<u64>()
        + if env.backend_name.starts_with("cpu") {
            l.slots as u64 * l.slot_bytes + l.accs as u64 * l.acc_bytes
        } else {
            0
        };
    pools.dedup_by(|a, b| {
        if a.name == b.name {
            b.buffers += a.buffers;
            b.high_water += a.high_water;
            true
        } else {
            false
        }
    });
    let flops = todo_flops as f64;
    Ok(StepReport {
        step: step.index + 1,
        expr: step.expr.clone(),
        output: step.output.display().to_string(),
        m: step.m,
        n: step.n,
        k: step.k,
        backend: env.backend_name,
        precision: env.precision.name().into(),
        tile: [l.tm, l.tn, l.tk],
        tiles_total: sched.tiles.len() as u64,
        tiles_computed: computed,
        wall_s: wall,
        flops,
        gflops_per_s: flops / wall / 1e9,
        read_bytes,
        write_bytes,
        host_budget_bytes: env.host_budget,
        host_pool_bytes: l.host_bytes,
        host_peak_bytes: host_peak,
        pools,
        stages,
        lanes: lane_names
            .into_iter()
            .zip(lane_stats)
            .map(|(name, stats)| LaneReport { name, stats })
            .collect(),
        busy_shares: shares,
        bottleneck,
        nonfinite_inputs: inputs.nonfinite.load(Ordering::Relaxed),
        flush_s,
    })
}

/// Flops of the output tiles still in the queue (all of them, unless resuming).
fn queue_flops(s: &Schedule, q: &TileQueue, k: u64) -> u64 {
    q.order()
        .iter()
        .map(|&i| {
            let t = &s.tiles[i as usize];
            2 * t.block.rows * t.block.cols * k
        })
        .sum()
}
