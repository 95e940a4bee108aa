//! `plan`: resolve a plan and print what `run` would do, or with `--nodes` the time model of a
//! run split across a cluster ([`ModelArgs`], `cluster::model`).

use std::path::PathBuf;

use clap::Args;

use crate::cluster::model;
use crate::error::{Error, Result};
use crate::plan::Plan;
use crate::run;

/// Resolve a plan and print what `run` would do: shapes, tiles, memory budgets, bytes moved,
/// and the lower bound on time.
#[derive(Args, Debug)]
#[command(after_help = "Example:\n  mgmm-stream plan examples/quickstart.toml")]
pub(crate) struct PlanArgs {
    /// The plan file (TOML, docs/PLAN.md).
    plan: PathBuf,
    /// Override an [engine] key of the plan (repeatable), e.g. --set engine.host_memory=8GiB.
    #[arg(long = "set", value_name = "engine.KEY=VALUE")]
    set: Vec<String>,
    #[command(flatten)]
    cluster: ModelArgs,
}

/// `plan`'s flags for the cluster time model.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct ModelArgs {
    /// Predict a split run on this many nodes (prints the cluster time model).
    #[arg(long)]
    pub(crate) nodes: Option<u64>,
    /// GPUs per node in the predicted split run.
    #[arg(long, default_value_t = 8)]
    pub(crate) gpus_per_node: u64,
    /// Aggregate shared-filesystem bandwidth, GB/s.
    #[arg(long, default_value_t = 100.0, value_name = "GB/s")]
    pub(crate) fs_bandwidth: f64,
    /// One node's link to the filesystem, GB/s (200 Gb/s InfiniBand ≈ 25).
    #[arg(long, default_value_t = 25.0, value_name = "GB/s")]
    pub(crate) node_bandwidth: f64,
    /// Sustained GEMM rate per GPU in a step for the cluster model (--nodes), TFLOP/s (47: fp32 file to file on an H200, BENCHMARKS.md; plan's own lower bound uses cuBLAS in core, 54).
    #[arg(long, default_value_t = 47.0)]
    pub(crate) gpu_tflops: f64,
    /// Host-to-device rate per GPU for the cluster model (--nodes), GB/s (52: measured on the H200 host, docs/GPU.md).
    #[arg(long, default_value_t = 52.0, value_name = "GB/s")]
    pub(crate) pcie: f64,
    /// Device memory per GPU for the tile cache in the cluster model (--nodes), GiB.
    #[arg(long, default_value_t = 120.0, value_name = "GiB")]
    pub(crate) gpu_memory: f64,
    /// Compute tile edge in the cluster model (--nodes); the plan's own layout comes from [engine] tile.
    #[arg(long, default_value_t = 8192)]
    pub(crate) tile: u64,
    /// Shards per step (default as `run` chooses: 1 or 4 per process).
    #[arg(long = "model-shards", value_name = "S")]
    pub(crate) shards: Option<u32>,
}

impl PlanArgs {
    /// `plan PLAN`, or with `--nodes` the cluster time model.
    pub(super) fn execute(self) -> Result<()> {
        let p = Plan::load_with(&self.plan, &self.set)?;
        let m = &self.cluster;
        let Some(nodes) = m.nodes else {
            print!("{}", run::describe(&p)?);
            return Ok(());
        };
        let mc = m.machine(nodes)?;
        print!("{}", crate::progress::wrap(&model::predict(&p, &mc)?));
        Ok(())
    }
}

impl ModelArgs {
    /// The machine to predict for, on `nodes` nodes; every figure must be positive.
    fn machine(&self, nodes: u64) -> Result<model::Machine> {
        let m = self;
        for (flag, v) in [
            ("--fs-bandwidth", m.fs_bandwidth),
            ("--node-bandwidth", m.node_bandwidth),
            ("--gpu-tflops", m.gpu_tflops),
            ("--pcie", m.pcie),
            ("--gpu-memory", m.gpu_memory),
            ("--nodes", nodes as f64),
            ("--gpus-per-node", m.gpus_per_node as f64),
            ("--tile", m.tile as f64),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::Usage(format!(
                    "{flag} {v}: the time model needs a positive number"
                )));
            }
        }
        Ok(model::Machine {
            nodes,
            gpus_per_node: m.gpus_per_node,
            fs_bandwidth: m.fs_bandwidth * 1e9,
            node_bandwidth: m.node_bandwidth * 1e9,
            gpu_flops: m.gpu_tflops * 1e12,
            pcie: m.pcie * 1e9,
            gpu_memory: (m.gpu_memory * (1u64 << 30) as f64) as u64,
            tile: m.tile,
            shards: m.shards,
        })
    }
}
