//! Reports: what a finished step and a finished run measured, as the summary a person reads and
//! the JSON a script reads — both from the same figures.
//!
//! The pipeline hands back raw [`RunStats`]; this module interprets them against the step and its
//! layout: busy shares of every stage and device engine, the bottleneck, bytes read and written,
//! and the host memory actually held.

use serde::Serialize;

use crate::backend::{Caps, DeviceStats, MemorySpace};
use crate::metrics::{StageKind, StageSnapshot};
use crate::pipeline::{NonfiniteSeen, PoolReport, RunStats};
use crate::plan::layout::Layout;
use crate::plan::schedule::Src;
use crate::plan::{Precision, Step};
use crate::units::fmt_bytes;

/// The process clock lives with the timeline it starts ([`crate::trace`]); the command line
/// starts it and the run report reads it through here.
pub(crate) use crate::trace::{mark_process_start, process_age_s};

#[derive(Clone, Debug, Serialize)]
pub struct LaneReport {
    pub name: String,
    #[serde(flatten)]
    pub stats: DeviceStats,
}

/// One input that held NaN/Inf while a step staged it (the report's
/// `nonfinite_input_blocks`).
#[derive(Clone, Debug, Serialize)]
pub struct NonfiniteInput {
    /// The matrix as the plan names it (`A`, `C0`; an array handed to the Python package: `a`).
    pub input: String,
    /// Its file; `None` for an array handed in by the caller (the Python package).
    pub path: Option<String>,
    /// NaN/Inf values seen staging it (each block counted once, however often it was staged).
    pub values: u64,
    /// The first block holding one (the first in row-major order of its first element), in
    /// the matrix's own rows and columns (as numpy indexes the file, before the plan's `.T`):
    /// `[first row, first column, rows, columns]`.
    pub first_block: Option<[u64; 4]>,
    /// The first NaN/Inf in that block, `[row, column]` in the same terms (`None` where only
    /// the conversion to the computed type made one: a value past fp16's range).
    pub first_element: Option<[u64; 2]>,
    /// Whether it is the added matrix C0 (else a factor of the product).
    pub added: bool,
    /// Whether its NaN/Inf can reach the output: not for a factor of the product in a step
    /// whose alpha is 0, nor for C0 in a step whose beta is 0: as in BLAS, that term is not
    /// used.
    pub reaches_output: bool,
}

#[derive(Clone, Debug, Serialize)]
/// What one step did: shape, tiles, time, traffic, memory, stages and lanes.
pub struct StepReport {
    /// Step number (1-based).
    pub step: usize,
    /// The expression.
    pub expr: String,
    /// Output file.
    pub output: String,
    /// Output rows.
    pub m: u64,
    /// Output columns.
    pub n: u64,
    /// Inner dimension.
    pub k: u64,
    /// Backend name.
    pub backend: String,
    /// GEMM precision.
    pub precision: String,
    /// Compute tile (m, n, k).
    pub tile: [u64; 3],
    /// Output tiles in the step.
    pub tiles_total: u64,
    /// Output tiles computed by this run (the rest were resumed).
    pub tiles_computed: u64,
    /// Wall-clock seconds.
    pub wall_s: f64,
    /// Floating-point operations computed.
    pub flops: f64,
    /// Achieved GFLOP/s.
    pub gflops_per_s: f64,
    /// Bytes of input read (file dtype): from the input files, and from a chain's
    /// intermediates held in memory (`memory_read_bytes` of them).
    pub read_bytes: u64,
    /// Of `read_bytes`, those read from intermediates held in host memory.
    pub memory_read_bytes: u64,
    /// Where the inputs came from: "files", "arrays" (the Python package's) or "files and
    /// arrays".
    pub inputs_from: String,
    /// What `plan`'s traffic model predicted for `read_bytes` (for the whole step: compare only
    /// when `tiles_computed == tiles_total`).
    pub predicted_read_bytes: u64,
    /// Input bytes a lane took from another lane's read (the shared reader) instead of reading.
    pub shared_read_bytes: u64,
    /// Bytes every input must at least be read (each input once).
    pub min_read_bytes: u64,
    /// Of `read_bytes`, those the lanes copied straight from the files' pages instead of from
    /// staging buffers (`engine.staging`, docs/GPU.md).
    pub direct_bytes: u64,
    /// Of `direct_bytes`, those whose checks (CRC, NaN/Inf count) the devices that copied them
    /// did (kernels/check.cu); the host read the rest again to check it.
    #[serde(default)]
    pub direct_device_checked_bytes: u64,
    /// Bytes of the input files page-locked for those copies (a storage tile released to stay
    /// under the budget and needed again counts again).
    pub direct_registered_bytes: u64,
    /// Seconds page-locking took, all staging threads together (0 on the CPU: nothing to lock).
    pub direct_register_s: f64,
    /// Page-locked bytes released before the step's end to stay under the budget
    /// (`direct_budget_bytes`).
    pub direct_released_bytes: u64,
    /// Input blocks staged by copy under `staging = "auto"` because their pages were not all
    /// in memory.
    pub direct_cold_blocks: u64,
    /// Input blocks staged by copy under `staging = "auto"` on a GPU by its rule for the
    /// precision: under fp64 every block (docs/decisions/0025-fp64-copies-every-block.md); under
    /// fp32 and `fp64_emulated` those of row-major files (`.npy`, raw) at most half as wide as
    /// their file, since page-locking would lock the bands of whole rows they lie in
    /// (docs/decisions/0023-copy-narrow-blocks-of-row-major-files.md). The name is kept from
    /// when only the second rule existed.
    #[serde(default)]
    pub direct_narrow_blocks: u64,
    /// The rule `direct_narrow_blocks` were copied by: `"narrow"` (row-major files' narrow
    /// blocks, fp32 and `fp64_emulated`), `"every"` (fp64), `"overflow"` (every file, where
    /// the files the narrow rule would lock are larger together than `direct_budget_bytes`:
    /// docs/decisions/0026-copy-inputs-larger-than-the-lock-budget.md); empty when none applied.
    #[serde(default)]
    pub direct_copy_rule: String,
    /// Input blocks staged by copy because the file range they lie in is larger than the
    /// page-locking budget (`direct_budget_bytes`); a `.npy` or raw file is one range.
    pub direct_oversize_blocks: u64,
    /// Input blocks staged by copy because the ranges in use left no room for theirs in the
    /// page-locking budget.
    #[serde(default)]
    pub direct_full_blocks: u64,
    /// That budget, in bytes (0 when direct uploads were not set up): what the pools
    /// (`host_pool_bytes`) leave of `host_budget_bytes` (`engine.host_memory`), and at most half
    /// the memory the host could spare when the step started.
    pub direct_budget_bytes: u64,
    /// The most bytes of the input files page-locked at once (at most `direct_budget_bytes`):
    /// host memory the kernel cannot reclaim, beside the pools.
    #[serde(default)]
    pub peak_locked_bytes: u64,
    /// Why uploads from the files' pages stopped part-way through the step, if they did.
    pub direct_failed: Option<String>,
    /// Bytes written to the output.
    pub write_bytes: u64,
    /// Seconds from the step's start to its first GEMM.
    pub first_gemm_s: Option<f64>,
    /// The process's peak resident memory so far (getrusage), bytes.
    pub peak_rss_bytes: u64,
    /// Host memory budget in bytes.
    pub host_budget_bytes: u64,
    /// Bytes of the host buffer pools.
    pub host_pool_bytes: u64,
    /// Peak bytes leased from the host pools.
    pub host_peak_bytes: u64,
    /// Device memory each lane allocated (tile cache, accumulators, landing buffers); 0 when the
    /// lanes compute in host memory (then it is part of the host figures).
    pub device_bytes_per_lane: u64,
    /// Per-pool use.
    pub pools: Vec<PoolReport>,
    /// Per-stage counters.
    pub stages: Vec<StageSnapshot>,
    /// Per-lane device statistics.
    pub lanes: Vec<LaneReport>,
    /// (name, busy share of wall time) for every stage and device engine, largest first.
    pub busy_shares: Vec<(String, f64)>,
    /// The stage that bound the step.
    pub bottleneck: String,
    /// NaN/Inf elements seen in the inputs (each block counted once, however often staged).
    pub nonfinite_inputs: u64,
    /// Each input that held NaN/Inf: how many values were seen and the first block holding
    /// one; empty when the inputs were all finite.
    #[serde(default)]
    pub nonfinite_input_blocks: Vec<NonfiniteInput>,
    /// NaN/Inf elements in the output tiles this run wrote, as stored (a value beyond the
    /// output type's range is stored as Inf and counts).
    #[serde(default)]
    pub nonfinite_outputs: u64,
    /// The first compute tile (tile row, tile column, of `tile`'s grid) in row-major order
    /// that holds one of them.
    #[serde(default)]
    pub first_nonfinite_tile: Option<[u64; 2]>,
    /// Seconds spent flushing the output at the end.
    pub flush_s: f64,
    /// How the output was written: `"mmap"`, `"pwrite"` (what `write = "auto"` chose, or the
    /// plan's `write`) or `"memory"` (a chain's intermediate, the Python API's arrays).
    pub write_mode: String,
    /// The kernel's limit on dirty page-cache pages, in bytes (approximate: `vm.dirty_bytes`,
    /// or `vm.dirty_ratio` of free and file memory; a memory cgroup's own limit is not seen),
    /// when the output is a disk-backed file; `None` for memory and tmpfs outputs.
    pub dirty_limit_bytes: Option<u64>,
    /// Where the kernel starts making this run's writers wait for the disk (half-way between
    /// its background threshold and its limit), where that can pace the run: dirty pages piling up
    /// (`durable = false`) and created in parallel through the output's map (`write = "mmap"`);
    /// `None` otherwise (each tile flushed, one `pwrite`r, tmpfs, memory).
    pub dirty_throttle_bytes: Option<u64>,
    /// Seconds outside the step's `wall_s` that the step cost, by phase: loading the resume
    /// state, making the lanes (contexts, device memory, kernels), building the pipeline
    /// (opening files, allocating pinned pools) and dropping it afterwards.
    pub setup_s: Vec<(String, f64)>,
    /// The run's backend was kept from an earlier library call of the process (its GPUs'
    /// contexts, libraries and page-locked pools ready: `mgmm_stream.empty_cache()` lets them
    /// go); always `false` on the command line, which keeps none (docs/PYTHON.md).
    #[serde(default)]
    pub backend_reused: bool,
    /// What `precision = "fp64_emulated"` did, all lanes together; `None` under the other
    /// precisions.
    pub emulation: Option<EmulationReport>,
    /// Checkpoints of partial tiles this run saved (`engine.checkpoint_every`,
    /// docs/RESILIENCE.md; each save counts, the last attempt's after a device failover).
    #[serde(default)]
    pub checkpoints_saved: u64,
    /// Bytes of those checkpoints (headers and accumulators).
    #[serde(default)]
    pub checkpoint_bytes: u64,
    /// Seconds writeback spent writing and syncing them (all its threads together).
    #[serde(default)]
    pub checkpoint_s: f64,
    /// `engine.checkpoint_every` in seconds; `None`: `"off"`, or an output that keeps no
    /// checkpoints (a chain's intermediate in memory, a Python result array).
    #[serde(default)]
    pub checkpoint_every_s: Option<f64>,
    /// Output tiles this run continued from a checkpoint an earlier run saved (their first
    /// k-chunks not computed again, their blocks not read again).
    #[serde(default)]
    pub checkpoint_resumed_tiles: u64,
}

impl StepReport {
    /// Add what the step's checkpoints cost (`saved`, taken every `every`).
    pub(crate) fn with_checkpoints(
        &mut self,
        saved: crate::durable::checkpoint::Saved,
        every: Option<std::time::Duration>,
        resumed: usize,
    ) {
        self.checkpoint_resumed_tiles = resumed as u64;
        self.checkpoints_saved = saved.count;
        self.checkpoint_bytes = saved.bytes;
        self.checkpoint_s = saved.secs;
        self.checkpoint_every_s = every.map(|d| d.as_secs_f64());
    }
}

/// What the fp64 emulation did in a step (`emulation.fallback_tiles` and the rest).
#[derive(Clone, Debug, Serialize)]
pub struct EmulationReport {
    /// `engine.emulation_moduli`: `"auto"` or the count forced.
    pub setting: String,
    #[serde(flatten)]
    pub stats: crate::seam::EmulationStats,
}

impl EmulationReport {
    fn of(p: Precision, lanes: &[LaneReport]) -> Option<EmulationReport> {
        let Precision::Fp64Emulated(m) = p else {
            return None;
        };
        let mut stats = crate::seam::EmulationStats::default();
        for l in lanes {
            stats.add(&l.stats.emulation);
        }
        Some(EmulationReport {
            setting: match m {
                crate::seam::EmulationModuli::Auto => "auto".into(),
                crate::seam::EmulationModuli::Fixed(n) => n.to_string(),
            },
            stats,
        })
    }
}

/// The summary's `emulation:` line: moduli used, integer GEMMs, blocks left to native fp64
/// and why, and blocks a forced count left outside the bound.
fn emulation_line(r: &StepReport) -> String {
    r.emulation.as_ref().map_or(String::new(), emulation_text)
}

fn emulation_text(e: &EmulationReport) -> String {
    use crate::progress::count;
    let s = &e.stats;
    let used = match (s.moduli_min, s.moduli_max) {
        (0, _) => "no moduli needed".to_string(),
        (a, b) if a == b => count(a as u64, "modulus", "moduli"),
        (a, b) => format!("{a}–{b} moduli"),
    };
    let mut line = format!(
        "  emulation (moduli {}): {} emulated with {used}, {}",
        e.setting,
        count(s.blocks, "block", "blocks"),
        count(s.int_gemms, "integer GEMM", "integer GEMMs")
    );
    let why: Vec<String> = [
        (s.fallback_nonfinite, "NaN/Inf in the block"),
        (s.fallback_bound, "exponent range too wide for the bound"),
        (s.fallback_short, "one element deep"),
    ]
    .iter()
    .filter(|(n, _)| *n > 0)
    .map(|(n, w)| format!("{w}: {n}"))
    .collect();
    line += &format!(
        "; fallback_tiles {} (native fp64{})",
        s.fallback_tiles,
        if why.is_empty() {
            String::new()
        } else {
            format!("; {}", why.join(", "))
        }
    );
    if s.bound_unmet > 0 {
        line += &format!(
            "; {} outside the accuracy bound at the forced count",
            count(s.bound_unmet, "block", "blocks")
        );
    }
    line + "\n"
}

#[derive(Debug, Serialize)]
/// What a whole `run` did.
pub struct RunReport {
    /// The plan file.
    pub plan: String,
    /// Backend name.
    pub backend: String,
    /// Input files generated before running.
    pub generated: Vec<String>,
    /// One report per step run.
    pub steps: Vec<StepReport>,
    /// Wall time of the whole run (all steps, with backend start-up and input generation).
    pub wall_s: f64,
    /// Seconds from the start of the command to the end of the run (its start-up included;
    /// `None` through the library); compare with the steps' `wall_s` to see what
    /// start-up costs.
    pub process_wall_s: Option<f64>,
    /// Seconds before the first step, by phase: choosing and starting the backend (device
    /// discovery, the first context), sizing the steps and checking space, generating inputs.
    pub startup_s: Vec<(String, f64)>,
}

/// A byte rate in MB/s below 1 GB/s, else in GB/s.
fn fmt_rate(bytes_per_s: f64) -> String {
    if bytes_per_s >= 999.5e6 {
        format!("{:.1} GB/s", bytes_per_s / 1e9)
    } else {
        format!("{:.0} MB/s", bytes_per_s / 1e6)
    }
}

/// Everything about the run of one step that is not in its stats.
pub(crate) struct StepContext<'a> {
    pub(crate) step: &'a Step,
    pub(crate) layout: &'a Layout,
    pub(crate) caps: &'a Caps,
    pub(crate) backend: String,
    pub(crate) precision: Precision,
    pub(crate) host_budget: u64,
}

impl<'a> StepContext<'a> {
    /// The context of `step` run on `backend` under `engine`: what every caller of
    /// [`step_report`] (the run loop, chain intermediates, the Python API) passes.
    pub(crate) fn of(
        step: &'a Step,
        layout: &'a Layout,
        backend: &'a dyn crate::backend::Backend,
        engine: &crate::plan::Engine,
    ) -> StepContext<'a> {
        StepContext {
            step,
            layout,
            caps: backend.caps(),
            backend: backend.name(),
            precision: engine.precision,
            host_budget: engine.host_memory,
        }
    }
}

fn sum_bytes(stages: &[StageSnapshot], kind: StageKind) -> u64 {
    stages
        .iter()
        .filter(|s| s.kind == kind)
        .map(|s| s.bytes)
        .sum()
}

/// Busy share of wall time of every stage and device engine, largest first.
fn busy_shares(st: &RunStats, devices: bool) -> Vec<(String, f64)> {
    let wall = st.wall_s.max(1e-12);
    let mut shares: Vec<(String, f64)> = st
        .stages
        .iter()
        .map(|s| (s.name.clone(), s.busy_s / wall))
        .collect();
    if devices {
        for (name, d) in &st.lanes {
            shares.push((format!("{name} gemm"), d.gemm_s / wall));
            shares.push((format!("{name} h2d"), d.h2d_s / wall));
            shares.push((format!("{name} d2h"), d.d2h_s / wall));
        }
    }
    shares.push(("flush".into(), st.flush_s / wall));
    shares.sort_by(|a, b| b.1.total_cmp(&a.1));
    shares
}

/// Pools merged by name (one staging pool per lane is reported as one line).
fn merged_pools(pools: &[PoolReport]) -> Vec<PoolReport> {
    let mut out: Vec<PoolReport> = Vec::new();
    for p in pools {
        match out.iter_mut().find(|q| q.name == p.name) {
            Some(q) => {
                q.buffers += p.buffers;
                q.high_water += p.high_water;
                q.allocated += p.allocated;
                q.lazy |= p.lazy;
            }
            None => out.push(p.clone()),
        }
    }
    out
}

/// The process's peak resident set size so far (`ru_maxrss`), in bytes; 0 if unknown.
pub(crate) fn peak_rss_bytes() -> u64 {
    // SAFETY: getrusage fills a plain C struct of integers we own; all-zero bytes are a valid
    // value for it.
    unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut ru) == 0 {
            ru.ru_maxrss.max(0) as u64 * 1024
        } else {
            0
        }
    }
}

pub(crate) fn step_report(cx: &StepContext<'_>, st: RunStats) -> StepReport {
    let (step, l) = (cx.step, cx.layout);
    let predicted = crate::plan::schedule::traffic(step, l);
    let devices = cx.caps.memory == MemorySpace::Device;
    let shares = busy_shares(&st, devices);
    let pool_peak: u64 = st
        .pools
        .iter()
        // A lazy pool's leases out at once need not all have had memory.
        .map(|p| p.high_water.min(p.allocated) as u64 * p.buffer_bytes)
        .sum();
    // On a host-memory backend the lane's slots and accumulators are host memory too.
    let lane_host = match cx.caps.memory {
        MemorySpace::Host => l.slots as u64 * l.slot_bytes + l.accs as u64 * l.acc_bytes,
        MemorySpace::Device => 0,
    };
    let lanes: Vec<LaneReport> = st
        .lanes
        .into_iter()
        .map(|(name, stats)| LaneReport { name, stats })
        .collect();
    let inputs_nonfinite = nonfinite_inputs(step, &st.nonfinite_inputs);
    StepReport {
        emulation: EmulationReport::of(cx.precision, &lanes),
        lanes,
        step: step.index + 1,
        expr: step.expr.clone(),
        output: step.output_label(),
        m: step.m,
        n: step.n,
        k: step.k,
        backend: cx.backend.clone(),
        precision: cx.precision.name().into(),
        tile: [l.tm, l.tn, l.tk],
        tiles_total: st.tiles_total,
        tiles_computed: st.tiles_computed,
        wall_s: st.wall_s,
        flops: st.flops,
        gflops_per_s: st.flops / st.wall_s.max(1e-12) / 1e9,
        read_bytes: sum_bytes(&st.stages, StageKind::Staging),
        predicted_read_bytes: predicted.read_bytes,
        shared_read_bytes: st.shared_read_bytes,
        memory_read_bytes: st.memory_read_bytes,
        inputs_from: st.inputs_from.into(),
        min_read_bytes: predicted.min_read_bytes,
        direct_bytes: st.direct.as_ref().map_or(0, |d| d.bytes),
        direct_device_checked_bytes: st.device_checked_bytes,
        direct_registered_bytes: st.direct.as_ref().map_or(0, |d| d.registered_bytes),
        direct_register_s: st.direct.as_ref().map_or(0.0, |d| d.register_s),
        direct_released_bytes: st.direct.as_ref().map_or(0, |d| d.released_bytes),
        direct_cold_blocks: st.direct.as_ref().map_or(0, |d| d.cold_blocks),
        direct_narrow_blocks: st.direct.as_ref().map_or(0, |d| d.copied_blocks),
        direct_copy_rule: (st.direct.as_ref())
            .filter(|d| d.copied_blocks > 0)
            .map_or("", |d| d.copy_rule.name())
            .to_string(),
        direct_oversize_blocks: st.direct.as_ref().map_or(0, |d| d.oversize_blocks),
        direct_full_blocks: st.direct.as_ref().map_or(0, |d| d.full_blocks),
        direct_budget_bytes: st.direct.as_ref().map_or(0, |d| d.budget),
        peak_locked_bytes: st.direct.as_ref().map_or(0, |d| d.peak_locked),
        direct_failed: st.direct.as_ref().and_then(|d| d.failed.clone()),
        first_gemm_s: st.first_gemm_s,
        peak_rss_bytes: peak_rss_bytes(),
        write_bytes: sum_bytes(&st.stages, StageKind::Writeback),
        host_budget_bytes: cx.host_budget,
        host_pool_bytes: l.host_bytes,
        host_peak_bytes: pool_peak + lane_host,
        device_bytes_per_lane: l.device_bytes,
        pools: merged_pools(&st.pools),
        bottleneck: shares.first().map(|s| s.0.clone()).unwrap_or_default(),
        busy_shares: shares,
        stages: st.stages,
        nonfinite_inputs: inputs_nonfinite.iter().map(|i| i.values).sum(),
        nonfinite_input_blocks: inputs_nonfinite,
        nonfinite_outputs: st.nonfinite_outputs.0,
        first_nonfinite_tile: (st.nonfinite_outputs.1).map(|b| [b.r0 / l.tm, b.c0 / l.tn]),
        flush_s: st.flush_s,
        write_mode: st.write_mode.into(),
        dirty_limit_bytes: st.dirty.map(|d| d.limit),
        dirty_throttle_bytes: (st.dirty)
            .filter(|_| st.dirty_paced)
            .map(|d| (d.background + d.limit) / 2),
        setup_s: Vec::new(),
        backend_reused: false,
        checkpoints_saved: 0,
        checkpoint_bytes: 0,
        checkpoint_s: 0.0,
        checkpoint_every_s: None,
        checkpoint_resumed_tiles: 0,
    }
}

/// Each input's NaN/Inf tally as the report gives it: by the plan's name, with its file (none
/// for the caller's array), `X.T @ X`'s one matrix once (as A).
fn nonfinite_inputs(step: &Step, seen: &[NonfiniteSeen]) -> Vec<NonfiniteInput> {
    seen.iter()
        .filter(|i| !(i.src == Src::B && step.b.path == step.a.path))
        .map(|i| {
            let op = match i.src {
                Src::A => &step.a,
                Src::B => &step.b,
                Src::C0 => step
                    .c0
                    .as_ref()
                    .expect("C0 is only read when the step has one"),
            };
            NonfiniteInput {
                input: op.name.clone(),
                path: (!step.in_memory(&op.path)).then(|| op.path.display().to_string()),
                values: i.values,
                first_block: i.block.map(|b| [b.r0, b.c0, b.rows, b.cols]),
                first_element: i.at.map(|(r, c)| [r, c]),
                // A factor's reach the output unless alpha is 0, C0's unless beta is 0 (both
                // follow BLAS: the term is not used).
                added: i.src == Src::C0,
                reaches_output: match i.src {
                    Src::C0 => step.beta != 0.0,
                    _ => step.alpha != 0.0,
                },
            }
        })
        .collect()
}

/// How much of the input the lanes copied straight from the files' pages (empty when none
/// was and nothing needs saying).
fn direct_line(r: &StepReport) -> String {
    let mut parts = Vec::new();
    if r.direct_bytes > 0 {
        // Nothing is page-locked for the CPU's lanes, which copy from the maps themselves.
        let who = if r.direct_registered_bytes > 0 {
            "the devices"
        } else {
            "the lanes"
        };
        let mut p = format!(
            "{} of it copied by {who} straight from the files' pages",
            fmt_bytes(r.direct_bytes)
        );
        if r.direct_register_s >= 0.001 {
            p += &format!(
                " (page-locked {} in {:.2} s, at most {} at once{})",
                fmt_bytes(r.direct_registered_bytes),
                r.direct_register_s,
                fmt_bytes(r.peak_locked_bytes),
                if r.direct_released_bytes > 0 {
                    format!(
                        ", {} released early to stay under the budget",
                        fmt_bytes(r.direct_released_bytes)
                    )
                } else {
                    String::new()
                }
            );
        }
        if r.direct_device_checked_bytes > 0 {
            p += &format!(
                "; the devices checked {} of it themselves",
                fmt_bytes(r.direct_device_checked_bytes)
            );
        }
        if r.read_bytes > r.direct_bytes {
            p += &format!(
                ", the other {} staged by copy",
                fmt_bytes(r.read_bytes - r.direct_bytes)
            );
        }
        parts.push(p);
    }
    if r.direct_cold_blocks > 0 {
        parts.push(format!(
            "{} not wholly in the page cache staged by copy",
            crate::progress::count(r.direct_cold_blocks, "block", "blocks")
        ));
    }
    if r.direct_narrow_blocks > 0 {
        use crate::pipeline::direct::AutoCopies;
        let why = AutoCopies::from_name(&r.direct_copy_rule).staged(r.direct_budget_bytes);
        parts.push(format!(
            "{} {why} (staging = \"direct\" locks them)",
            crate::progress::count(r.direct_narrow_blocks, "block", "blocks")
        ));
    }
    // What the budget holds: page-locked ranges for a GPU's copies; on the CPU, whose lanes
    // read the maps themselves, nothing is page-locked (a new user read "page-locked" on a CPU
    // run), the ranges are only kept mapped.
    let held = match r.backend.starts_with("cpu") {
        true => "kept mapped",
        false => "page-locked",
    };
    if r.direct_oversize_blocks > 0 {
        parts.push(format!(
            "{} staged by copy: their file ranges are larger than the {} that may be {held} (what host_memory leaves beside the pools: `mgmm-stream plan` names a host_memory that reads them in place)",
            crate::progress::count(r.direct_oversize_blocks, "block", "blocks"),
            fmt_bytes(r.direct_budget_bytes)
        ));
    }
    if r.direct_full_blocks > 0 {
        parts.push(format!(
            "{} staged by copy while the {} that may be {held} was in use",
            crate::progress::count(r.direct_full_blocks, "block", "blocks"),
            fmt_bytes(r.direct_budget_bytes)
        ));
    }
    if let Some(why) = &r.direct_failed {
        parts.push(why.clone());
    }
    if parts.is_empty() {
        return String::new();
    }
    format!("  staging: {}\n", parts.join("; "))
}

fn device_lines(r: &StepReport) -> String {
    let mut s = String::new();
    for l in r
        .lanes
        .iter()
        .filter(|l| l.stats.h2d_s > 0.0 || l.stats.gemm_s > 0.0)
    {
        if r.busy_shares
            .iter()
            .any(|(n, _)| n == &format!("{} gemm", l.name))
        {
            s += &format!(
                "  {}: gemm {:.3} s ({} calls), H2D {} at {:.1} GB/s, D2H {} at {:.1} GB/s\n",
                l.name,
                l.stats.gemm_s,
                l.stats.gemms,
                fmt_bytes(l.stats.h2d_bytes),
                l.stats.h2d_bytes as f64 / l.stats.h2d_s.max(1e-9) / 1e9,
                fmt_bytes(l.stats.d2h_bytes),
                l.stats.d2h_bytes as f64 / l.stats.d2h_s.max(1e-9) / 1e9
            );
        }
    }
    s
}

/// The end-of-step summary a person reads, every line within 80 columns
/// ([`crate::progress::wrap`]): what ran, time and rate, input traffic, host memory, devices,
/// busy shares and the bottleneck.
pub(crate) fn format_summary(r: &StepReport) -> String {
    let expr = crate::plan::readable_expr(&r.expr);
    let mut s = format!("step {}: {} = {}\n", r.step, r.output, expr);
    s += &format!(
        "  {}×{}×{}, {}, {}{}, tile {}×{}×{}\n",
        r.m,
        r.n,
        r.k,
        r.precision,
        r.backend,
        if r.backend_reused {
            " (kept from an earlier call)"
        } else {
            ""
        },
        r.tile[0],
        r.tile[1],
        r.tile[2]
    );
    // Flush (making a file durable, README) is said of files only: an output in memory has
    // none.
    let flush = match r.write_mode.as_str() {
        "memory" => String::new(),
        _ => format!(", flush {:.3} s", r.flush_s),
    };
    s += &format!(
        "  wall {:.3} s, {:.2} GFLOP/s, written {} ({}){flush}\n",
        r.wall_s,
        r.gflops_per_s,
        fmt_bytes(r.write_bytes),
        r.write_mode,
    );
    s += &inputs_line(r);
    s += &direct_line(r);
    s += &format!(
        "  host memory: peak {} of {} budget; process peak RSS {}\n",
        fmt_bytes(r.host_peak_bytes),
        fmt_bytes(r.host_budget_bytes),
        fmt_bytes(r.peak_rss_bytes)
    );
    s += &pools_line(r);
    s += &device_lines(r);
    s += &emulation_line(r);
    s += &checkpoints_line(r);
    s += &busy_line(r);
    s += &format!("  bottleneck: {}", r.bottleneck);
    if let Some(note) = nonfinite_input_note(r) {
        s += &format!("\n  note: {note}");
    }
    if let Some(note) = nonfinite_output_note(r) {
        s += &format!("\n  note: {note}");
    }
    if let Some(note) = dirty_note(r.write_bytes, r.dirty_throttle_bytes) {
        s += &format!("\n  note: {note}");
    }
    crate::progress::wrap(&s)
}

/// What the summary says of NaN/Inf in the inputs: for each input holding any, how many values
/// and where the first block with one lies in its file, so that the value can be found (a
/// bare count named neither the input nor the place: new-user trial), and whether they reach the
/// output — a factor's do not in a step whose alpha is 0 (the note said "except with alpha = 0"
/// on such a step too). `None` when the inputs were all finite.
fn nonfinite_input_note(r: &StepReport) -> Option<String> {
    if r.nonfinite_inputs == 0 {
        return None;
    }
    let each = |i: &NonfiniteInput| {
        let at = match (i.first_element, i.first_block) {
            (Some([r, c]), _) => Some(format!("the first at row {r}, column {c}")),
            (None, Some([r0, c0, rows, cols])) => Some(format!(
                "the first in rows {r0}–{}, columns {c0}–{}",
                r0 + rows.max(1) - 1,
                c0 + cols.max(1) - 1
            )),
            (None, None) => None,
        };
        let about: Vec<String> = [i.path.clone(), at].into_iter().flatten().collect();
        match about.is_empty() {
            true => format!("{} in {}", i.values, i.input),
            false => format!("{} in {} ({})", i.values, i.input, about.join("; ")),
        }
    };
    let (reach, unused): (Vec<&NonfiniteInput>, Vec<&NonfiniteInput>) =
        (r.nonfinite_input_blocks.iter()).partition(|i| i.reaches_output);
    let names = |v: &[&NonfiniteInput]| v.iter().map(|i| i.input.clone()).collect::<Vec<_>>();
    let ieee = "as IEEE arithmetic says";
    // Which term is not used (BLAS): the product (alpha = 0), C0 (beta = 0), or both.
    let blas = match (
        unused.iter().any(|i| !i.added),
        unused.iter().any(|i| i.added),
    ) {
        (true, true) => {
            "this step's alpha and beta are 0, and, as in BLAS, neither the product nor C0 is used"
        }
        (false, true) => "this step's beta is 0, and, as in BLAS, C0 is not used",
        _ => "this step's alpha is 0, and, as in BLAS, the product is not used",
    };
    let fate = match (reach.is_empty(), unused.is_empty()) {
        (_, true) => format!("they reach the output {ieee}"),
        (true, false) => format!("they do not reach the output: {blas}"),
        (false, false) => format!(
            "those in {} reach the output {ieee}; those in {} do not: {blas}",
            names(&reach).join(", "),
            names(&unused).join(", ")
        ),
    };
    let each: Vec<String> = r.nonfinite_input_blocks.iter().map(each).collect();
    let each = match each.is_empty() {
        true => r.nonfinite_inputs.to_string(),
        false => each.join(", "),
    };
    Some(format!(
        "NaN/Inf values seen while staging the inputs: {each} — {fate}"
    ))
}

/// What the summary says of NaN/Inf in the output: how many, the first tile holding one, and
/// the likely cause — an overflow of the output type when the inputs were all finite (`alpha =
/// 3e38` on normal f32 data gave 88 % ±Inf and exited silently before, issue 33), or the
/// inputs' own NaN/Inf, which propagate as IEEE arithmetic says. `None` when there are none.
fn nonfinite_output_note(r: &StepReport) -> Option<String> {
    if r.nonfinite_outputs == 0 {
        return None;
    }
    let of = if r.tiles_computed == r.tiles_total {
        format!("of the {} output elements", r.m * r.n)
    } else {
        format!(
            "output elements of the {} tiles this run computed",
            r.tiles_computed
        )
    };
    let first = match r.first_nonfinite_tile {
        Some([ti, tj]) => {
            let (tm, tn) = (r.tile[0], r.tile[1]);
            let (r0, c0) = (ti * tm, tj * tn);
            format!(
                " (the first in tile ({ti}, {tj}): rows {r0}–{}, columns {c0}–{})",
                (r0 + tm).min(r.m) - 1,
                (c0 + tn).min(r.n) - 1
            )
        }
        None => String::new(),
    };
    let largest = if Precision::parse(&r.precision).is_some_and(Precision::is_f64) {
        "f64, largest about 1.8e308"
    } else {
        "f32, largest about 3.4e38"
    };
    let n = r.nonfinite_outputs;
    Some(if r.nonfinite_inputs == 0 {
        format!(
            "{n} {of} are NaN/Inf{first} although the inputs are all finite: the product overflowed the output's precision ({largest}). Scale alpha or the inputs down, or store the inputs as f64 and compute in fp64; then run --restart"
        )
    } else {
        format!(
            "{n} {of} are NaN/Inf{first}; the inputs hold NaN/Inf too (the note above), which IEEE arithmetic carries into the output — or the product overflowed the output's precision ({largest}). Look at the inputs' values; scale alpha or the inputs down, or compute in fp64"
        )
    })
}

/// The `inputs:` line: what was read, in one bracket where the bytes came from, their rate over
/// the step and what `plan` predicted; the bytes shared between devices; the first GEMM's time.
fn inputs_line(r: &StepReport) -> String {
    // One bracket: where the bytes came from, their rate over the step, what `plan` predicted.
    let mut about = Vec::new();
    if r.memory_read_bytes > 0 {
        about.push(format!(
            "{} from {}, {} from memory",
            fmt_bytes(r.read_bytes - r.memory_read_bytes),
            r.inputs_from,
            fmt_bytes(r.memory_read_bytes)
        ));
    }
    // An average over the step, not the disk's speed; meaningless for a step of a few
    // milliseconds (a new user read "1 MB/s" off a tiny run), so left out there.
    if r.wall_s >= 0.05 && r.read_bytes > 0 {
        about.push(format!(
            "{} over the step",
            fmt_rate(r.read_bytes as f64 / r.wall_s)
        ));
    }
    // `plan`'s figures are for the whole step; a resumed run computes only part of it.
    // A tile continued from a checkpoint reads only its remaining k-chunks' blocks (a trial
    // saw 456 MiB read against a "minimum" of 512 MiB, unexplained).
    let from_checkpoints = match r.checkpoint_resumed_tiles {
        0 => String::new(),
        1 => " (1 continued from a checkpoint)".into(),
        n => format!(" ({n} continued from checkpoints)"),
    };
    let whole = if r.tiles_computed < r.tiles_total || r.checkpoint_resumed_tiles > 0 {
        format!(
            " for the whole step, of which this run computed {} of {} tiles{from_checkpoints}",
            r.tiles_computed, r.tiles_total
        )
    } else {
        String::new()
    };
    about.push(format!(
        "predicted {}, minimum {}{whole}",
        fmt_bytes(r.predicted_read_bytes),
        fmt_bytes(r.min_read_bytes)
    ));
    format!(
        "  inputs: read {}{} ({}){}; first GEMM after {}\n",
        fmt_bytes(r.read_bytes),
        if r.memory_read_bytes > 0 {
            String::new()
        } else {
            format!(" from {}", r.inputs_from)
        },
        about.join("; "),
        if r.shared_read_bytes > 0 {
            format!(
                ", {} shared between devices",
                fmt_bytes(r.shared_read_bytes)
            )
        } else {
            String::new()
        },
        r.first_gemm_s
            .map(|t| format!("{t:.2} s"))
            .unwrap_or_else(|| "-".into())
    )
}

/// Why a lazy pool made no buffer: what went around it.
fn lazy_why(pool: &str) -> &'static str {
    match pool {
        "output" => "finished tiles went straight into the output",
        _ => "blocks went straight from the files' pages",
    }
}

/// The `host pools:` line: each pool's buffers and how many were in use at most.
fn pools_line(r: &StepReport) -> String {
    let pools: Vec<String> = r
        .pools
        .iter()
        .map(|p| match p.lazy {
            // Leases without memory: the input blocks went straight from the files' pages
            // (staging), the finished tiles straight into the output (decision 0021).
            true if p.allocated == 0 => format!(
                "{} none of {}×{} allocated (the {}; peak {} in flight)",
                p.name,
                p.buffers,
                fmt_bytes(p.buffer_bytes),
                lazy_why(&p.name),
                p.high_water
            ),
            true => format!(
                "{} {}×{} as needed ({} allocated for {}, peak {} in flight)",
                p.name,
                p.buffers,
                fmt_bytes(p.buffer_bytes),
                p.allocated,
                if p.name == "output" {
                    "checkpoints and resumed tiles"
                } else {
                    "copied blocks"
                },
                p.high_water
            ),
            false => format!(
                "{} {}×{} (peak {})",
                p.name,
                p.buffers,
                fmt_bytes(p.buffer_bytes),
                p.high_water
            ),
        })
        .collect();
    format!("  host pools: {}\n", pools.join(", "))
}

/// The `checkpoints:` line, when the step saved any: how many, their size and writeback's
/// time for them, at which `checkpoint_every`; where writing them bound the step, that they did
/// (a trial's `checkpoint_every = "0s"` run named writeback its bottleneck, 98 % busy, and
/// said nothing of the 240 checkpoints behind it).
fn checkpoints_line(r: &StepReport) -> String {
    // Their time is the writeback threads' together; the bottleneck is one of them.
    let threads = (r.busy_shares.iter())
        .filter(|(n, _)| n.starts_with("writeback"))
        .count()
        .max(1);
    let paced =
        r.bottleneck.starts_with("writeback") && r.checkpoint_s / threads as f64 >= 0.25 * r.wall_s;
    let every = r.checkpoint_every_s;
    let (n, bytes, secs) = (r.checkpoints_saved, r.checkpoint_bytes, r.checkpoint_s);
    checkpoints_text(n, bytes, (secs, threads), every, paced)
}

/// [`checkpoints_line`] of `saved` checkpoints of `bytes` in `secs` of `threads` writeback
/// threads together, taken every `every` seconds (`None`: off), which set the step's pace or
/// not.
fn checkpoints_text(
    saved: u64,
    bytes: u64,
    (secs, threads): (f64, usize),
    every: Option<f64>,
    paced: bool,
) -> String {
    if saved == 0 {
        return String::new();
    }
    // The interval as a plan writes it ("5min", "30s", "250ms", "1.5h").
    let plan = |s: f64| match s {
        0.0 => "0s".to_string(),
        s if s < 1.0 => format!("{}ms", (s * 1e3 * 1e3).round() / 1e3),
        s if s % 3600.0 == 0.0 => format!("{}h", s / 3600.0),
        s if s % 60.0 == 0.0 => format!("{}min", s / 60.0),
        s => format!("{}s", (s * 1e3).round() / 1e3),
    };
    let every = match every {
        Some(0.0) => "after every k-chunk (engine.checkpoint_every = \"0s\")".into(),
        Some(s) => format!("every {} (engine.checkpoint_every)", plan(s)),
        None => "engine.checkpoint_every = \"off\"".into(),
    };
    let together = match threads {
        1 => String::new(),
        n => format!(" (its {n} threads together)"),
    };
    let default = plan(crate::plan::engine::DEFAULT_CHECKPOINT_EVERY.as_secs_f64());
    let paced = match paced {
        true => format!("; saving them set the pace: a longer engine.checkpoint_every saves less often (a kill loses at most about that much of a tile's work; \"{default}\" by default)"),
        false => String::new(),
    };
    format!(
        "  checkpoints: {saved} saved ({} of partial tiles) in {secs:.2} s of writeback{together}, {every}{paced}\n",
        fmt_bytes(bytes),
    )
}

/// The `busy:` line: each stage's share of the step, largest first.
fn busy_line(r: &StepReport) -> String {
    // Largest first; the long tail under 1% (many of them with several lanes) is counted, not
    // listed (the JSON report has every share).
    let mut shares: Vec<String> = (r.busy_shares.iter().enumerate())
        .take_while(|&(i, (_, v))| i < 3 || *v >= 0.01)
        .map(|(_, (n, v))| format!("{n} {:.0}%", 100.0 * v))
        .collect();
    if shares.len() < r.busy_shares.len() {
        shares.push(format!(
            "{} more under 1%",
            r.busy_shares.len() - shares.len()
        ));
    }
    format!("  busy: {}\n", shares.join(" | "))
}

/// Why a step that wrote through the output's map (`write = "mmap"`, `durable = false`) past
/// the point where the kernel starts throttling dirty pages was bound by the disk. Measured on
/// one H200's host (126 GiB, `vm.dirty_ratio = 20`: a limit of about 25 GiB; docs/decisions/0003-write-auto.md):
/// the 43 GB chain so written held `Dirty` at about 23 GB from its 7th second on and took
/// 16.6–20.0 s, the disk's pace; into `/dev/shm` the same step took 4.0 s. The note says "can":
/// on the 2-core development VM a 5 GiB output so written was bound by the kernel's page work
/// on the CPU (outprep busy 90 %, `Dirty` at 2.4 GB, under the 3.45 GiB estimate). `None` when
/// it wrote less or the throttle does not pace the run (`throttle` is `None`).
fn dirty_note(write_bytes: u64, throttle: Option<u64>) -> Option<String> {
    let throttle = throttle.filter(|&l| write_bytes > l)?;
    Some(format!(
        "wrote {} through the output's map, more than the {} of dirty pages from which the kernel makes writers wait for the disk (half-way between vm.dirty_background_ratio and vm.dirty_ratio, estimated), so the disk can have set the pace. If so, faster: write = \"pwrite\", an output on tmpfs (/dev/shm), or a larger vm.dirty_bytes (docs/PLAN.md, durable)",
        fmt_bytes(write_bytes),
        fmt_bytes(throttle)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The summary's emulation line: moduli used, integer GEMMs, the fallback tiles with their
    /// reasons, and the blocks a forced count left outside the bound.
    #[test]
    fn the_emulation_line_names_moduli_fallbacks_and_unmet_bounds() {
        let mut stats = crate::seam::EmulationStats::default();
        stats.emulated(14, true);
        stats.emulated(15, true);
        let mut other = crate::seam::EmulationStats::default();
        other.emulated(0, true);
        other.fallback_tiles = 3;
        other.fallback_nonfinite = 2;
        other.fallback_bound = 1;
        stats.add(&other);
        let e = EmulationReport {
            setting: "auto".into(),
            stats,
        };
        let t = emulation_text(&e);
        assert_eq!(
            t,
            "  emulation (moduli auto): 3 blocks emulated with 14–15 moduli, 31 integer GEMMs; fallback_tiles 3 (native fp64; NaN/Inf in the block: 2, exponent range too wide for the bound: 1)\n"
        );
        let mut stats = crate::seam::EmulationStats::default();
        stats.emulated(6, false);
        let t = emulation_text(&EmulationReport {
            setting: "6".into(),
            stats,
        });
        assert!(
            t.contains("(moduli 6)")
                && t.contains("with 6 moduli")
                && t.contains("fallback_tiles 0 (native fp64)")
                && t.contains("1 block outside the accuracy bound at the forced count"),
            "{t}"
        );
    }

    /// The summary's checkpoints line: none without checkpoints; the interval as the plan says
    /// it; that they set the pace only when they did.
    #[test]
    fn the_checkpoints_line_says_how_many_and_whether_they_set_the_pace() {
        assert_eq!(checkpoints_text(0, 0, (0.0, 1), Some(300.0), false), "");
        let t = checkpoints_text(240, 15 << 28, (6.41, 2), Some(0.0), true);
        assert!(
            t.starts_with("  checkpoints: 240 saved (3.75 GiB of partial tiles) in 6.41 s of writeback (its 2 threads together), after every k-chunk (engine.checkpoint_every = \"0s\"); saving them set the pace: a longer engine.checkpoint_every")
                && t.ends_with("; \"5min\" by default)\n"),
            "{t}"
        );
        let t = checkpoints_text(1, 4096, (0.01, 1), Some(300.0), false);
        assert_eq!(
            t,
            "  checkpoints: 1 saved (4.00 KiB of partial tiles) in 0.01 s of writeback, every 5min (engine.checkpoint_every)\n"
        );
        let every = |s| checkpoints_text(2, 8, (0.0, 1), Some(s), false);
        assert!(every(0.25).contains("every 250ms ("));
        assert!(every(5400.0).contains("every 90min ("));
        assert!(every(7200.0).contains("every 2h ("));
        assert!(every(2.5).contains("every 2.5s ("));
    }

    #[test]
    fn the_dirty_note_appears_only_past_the_throttling_point() {
        let gb = 1_000_000_000;
        let n = dirty_note(43 * gb, Some(23 * gb)).expect("43 GB > 23 GB");
        assert!(n.contains("dirty pages") && n.contains("tmpfs"), "{n}");
        assert!(dirty_note(4 * gb, Some(23 * gb)).is_none());
        assert!(
            dirty_note(43 * gb, None).is_none(),
            "tmpfs or memory: no limit"
        );
    }
}
