//! `plan --nodes N --gpus-per-node G --fs-bandwidth X`: the time model of a split run, for
//! sizes and machines one cannot try first.
//!
//! One process per GPU (P = N·G), S shards (default 4·P). Each shard is a run of the output
//! schedule, and its process reads exactly what the in-process cache model
//! ([`input_loads`]) says a one-lane run over that run of tiles reads — from the shared
//! filesystem, since nothing is shared between processes. The predicted time is the largest
//! of: FLOPs over the GPUs' sustained rate; the shared filesystem's read plus write traffic
//! over its aggregate bandwidth; each node's share of that traffic over its link; each GPU's
//! PCIe share over the link rate — plus `finalize`, which reads the output once on one node.
//! Every rate is an assumption printed beside its result (docs/CLUSTER.md).

use super::shard_range;
use crate::error::{Error, Result};
use crate::plan::schedule::{input_loads, Grid};
use crate::plan::{Plan, Step};
use crate::units::fmt_bytes;

/// The machine a prediction is for; every rate is per second.
#[derive(Clone, Debug)]
pub(crate) struct Machine {
    pub(crate) nodes: u64,
    pub(crate) gpus_per_node: u64,
    /// Aggregate shared-filesystem bandwidth, bytes/s (read and write share it).
    pub(crate) fs_bandwidth: f64,
    /// One node's link to the filesystem, bytes/s.
    pub(crate) node_bandwidth: f64,
    /// Sustained GEMM rate of one GPU, FLOP/s.
    pub(crate) gpu_flops: f64,
    /// Host-to-device rate per GPU, bytes/s.
    pub(crate) pcie: f64,
    /// Device memory per GPU for the tile cache, bytes.
    pub(crate) gpu_memory: u64,
    /// Square compute tile edge.
    pub(crate) tile: u64,
    /// Shards per step (`None`: as `run` chooses, 1 or 4 per process).
    pub(crate) shards: Option<u32>,
}

fn secs(x: f64) -> String {
    if x < 120.0 {
        format!("{x:.1} s")
    } else if x < 7200.0 {
        format!("{:.1} min", x / 60.0)
    } else {
        format!("{:.2} h", x / 3600.0)
    }
}

/// The text `plan --nodes …` prints.
pub(crate) fn predict(plan: &Plan, mc: &Machine) -> Result<String> {
    if mc.nodes == 0 || mc.gpus_per_node == 0 || mc.tile == 0 {
        return Err(Error::Usage(
            "--nodes, --gpus-per-node and --tile must be at least 1".into(),
        ));
    }
    let procs = mc.nodes * mc.gpus_per_node;
    let mut s = format!(
        "cluster model for {}: {} nodes × {} GPUs = {procs} processes (one per GPU)\nassumed: shared filesystem {:.0} GB/s aggregate, {:.1} GB/s per node; {:.1} TFLOP/s and PCIe {:.0} GB/s per GPU; {} of tile cache per GPU; compute tile {}²\n",
        plan.path.display(),
        mc.nodes,
        mc.gpus_per_node,
        mc.fs_bandwidth / 1e9,
        mc.node_bandwidth / 1e9,
        mc.gpu_flops / 1e12,
        mc.pcie / 1e9,
        fmt_bytes(mc.gpu_memory),
        mc.tile
    );
    let mut total = 0.0;
    for step in &plan.steps {
        let (text, time) = predict_step(step, mc, procs);
        s += &text;
        total += time;
    }
    s += &format!("plan: at least {}\n", secs(total));
    Ok(s)
}

/// The lines of one step of [`predict`] for `procs` processes, and the step's predicted time
/// (its bound plus `finalize`).
fn predict_step(step: &Step, mc: &Machine, procs: u64) -> (String, f64) {
    let t = mc.tile;
    let (gm, gn, gk) = (step.m.div_ceil(t), step.n.div_ceil(t), step.k.div_ceil(t));
    let tiles = (gm * gn) as u32;
    let ins = step.a.dtype.size() as u128;
    // As `run` chooses (cluster::per_process): one shard per process when op(B) and one row
    // panel of op(A) fit in a GPU's memory, else four.
    let b_fits = (step.k as u128 * step.n as u128 + t as u128 * step.k as u128) * ins
        <= mc.gpu_memory as u128;
    let per = if b_fits { 1 } else { 4 };
    let sh = mc
        .shards
        .unwrap_or((per * procs).min(u32::MAX as u64) as u32)
        .clamp(1, tiles.max(1));
    let (mut read, biggest) = shard_reads(step, mc, sh);
    let c0 = step
        .c0
        .as_ref()
        .map(|_| step.m as u128 * step.n as u128 * ins)
        .unwrap_or(0);
    read += c0;
    let write = step.m as u128 * step.n as u128 * step.out_dtype.size() as u128;
    let min_read = (step.m as u128 * step.k as u128 + step.k as u128 * step.n as u128) * ins + c0;
    let flops = step.flops();
    let t_gemm = flops / (mc.gpu_flops * procs as f64);
    let t_fs = (read + write) as f64 / mc.fs_bandwidth;
    let t_node = (read + write) as f64 / mc.nodes as f64 / mc.node_bandwidth;
    let h2d_gpu = read as f64 / procs as f64;
    let t_pcie = h2d_gpu / mc.pcie;
    let t_fin = write as f64 / mc.node_bandwidth.min(mc.fs_bandwidth);
    let bound = t_gemm.max(t_fs).max(t_node).max(t_pcie);
    let f = |b: u128| fmt_bytes(b.min(u64::MAX as u128) as u64);
    let mut s = format!(
        "step {}: {} = {} ({}×{}×{})\n  tiles: {gm}×{gn} = {tiles} output tiles of {t}², {gk} k-steps each; {sh} shards of up to {biggest} tiles{}\n",
        step.index + 1,
        step.output.display(),
        step.expr,
        step.m,
        step.k,
        step.n,
        if gm >= sh as u64 { " (whole rows of tiles)" } else { " (runs of tiles within rows)" }
    );
    s += &format!(
        "  compute: {flops:.3e} FLOP over {procs} GPUs = {}\n",
        secs(t_gemm)
    );
    s += &format!(
        "  shared filesystem: read {} (minimum {}, {:.1}× it), write {} => {} at {:.0} GB/s\n",
        f(read),
        f(min_read),
        read as f64 / min_read as f64,
        f(write),
        secs(t_fs),
        mc.fs_bandwidth / 1e9
    );
    s += &format!(
        "  per node: {} from the filesystem => {}; PCIe per GPU {} => {}\n",
        f((read + write) / mc.nodes as u128),
        secs(t_node),
        f(h2d_gpu as u128),
        secs(t_pcie)
    );
    s += &format!(
        "  finalize (one node reads the output once): {}\n  => step at least {} ({}-bound) + finalize\n",
        secs(t_fin),
        secs(bound),
        if bound == t_gemm { "compute" } else if bound == t_pcie { "PCIe" } else if bound == t_node { "node-link" } else { "filesystem" }
    );
    (s, bound + t_fin)
}

/// Bytes the `sh` shards of `step` read from the shared filesystem for A and B (each shard's
/// piece of every row band it touches, as its own one-lane run of the cache model), and the
/// largest shard in tiles.
fn shard_reads(step: &Step, mc: &Machine, sh: u32) -> (u128, usize) {
    let t = mc.tile;
    let (gm, gn) = (step.m.div_ceil(t), step.n.div_ceil(t));
    let tiles = (gm * gn) as u32;
    let tile_bytes = t * t * 4;
    let slots = (mc.gpu_memory.saturating_sub(2 * tile_bytes) / tile_bytes) as usize;
    let ins = step.a.dtype.size() as u128;
    let mut read: u128 = 0;
    let mut biggest = 0;
    for k in 0..sh {
        let r = shard_range(tiles, gn as u32, sh, k);
        biggest = biggest.max(r.len());
        // The shard's piece of each row band it touches, as its own one-lane run.
        let (mut q, end) = (r.start as u64, r.end as u64);
        while q < end {
            let band = q / gn;
            let cnt = end.min((band + 1) * gn) - q;
            let g = Grid {
                m: t.min(step.m - band * t),
                n: (cnt * t).min(step.n),
                k: step.k,
                tm: t,
                tn: t,
                tk: t,
                lanes: 1,
                slots,
            };
            read += input_loads(&g).elems * ins;
            q += cnt;
        }
    }
    (read, biggest)
}
