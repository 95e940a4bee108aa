//! The command-line side of split runs: `run`'s shard flags, and the `prepare`, `finalize`,
//! `status` commands and `plan --nodes` (clap definitions stay in `cli.rs`; the work is here).

use std::path::Path;
use std::time::Duration;

use clap::Args;

use super::identity::{self, env_var};
use super::{finalize, model, prepare, status, ShardOptions};
use crate::error::{Error, Result};
use crate::plan::Plan;
use crate::progress::Progress;
use crate::run;

/// `run`'s flags for a step split across processes (docs/CLUSTER.md).
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct ShardArgs {
    /// Work shard K of S of every step and nothing else (e.g. one array task per shard).
    #[arg(long, value_name = "K/S")]
    pub(crate) shard: Option<String>,
    /// Cut each step into S shards; this process is one of the launcher's ranks (SLURM,
    /// Open MPI, PMI, or JOB_COMPLETION_INDEX, which needs it). Default: 1 per process when op(B) fits in half a GPU's tile cache, else 4 (docs/CLUSTER.md).
    #[arg(long, value_name = "S")]
    pub(crate) shards: Option<u32>,
    /// Ignore the launcher's variables: run the whole plan in this process.
    #[arg(long, conflicts_with_all = ["shard", "shards"])]
    pub(crate) no_split: bool,
    /// Seconds after which a shard claim without heartbeat is presumed dead and taken over.
    #[arg(long, default_value_t = 120.0, value_name = "SECS")]
    pub(crate) claim_timeout: f64,
    /// Seconds to wait for the output to be created or the previous step to be finalized.
    #[arg(long, default_value_t = 3600.0, value_name = "SECS")]
    pub(crate) wait_timeout: f64,
}

impl ShardArgs {
    /// This process's part, from the flags and the launcher's environment.
    pub(crate) fn options(&self) -> Result<Option<ShardOptions>> {
        if self.no_split {
            return Ok(None);
        }
        let spec = identity::detect(self.shard.as_deref(), self.shards, &env_var)?;
        Ok(spec.map(|spec| ShardOptions {
            spec,
            claim_timeout: Duration::from_secs_f64(self.claim_timeout.max(0.5)),
            wait: Duration::from_secs_f64(self.wait_timeout.max(0.0)),
        }))
    }

    /// `set` with `engine.devices=[i]` first when the launcher runs several processes per node
    /// without giving each its own `CUDA_VISIBLE_DEVICES` (then `SLURM_LOCALID` picks the GPU).
    pub(crate) fn with_local_gpu(&self, set: Vec<String>) -> Vec<String> {
        match (self.no_split, identity::local_gpu(&env_var)) {
            (false, Some(i)) => std::iter::once(format!("engine.devices=[{i}]"))
                .chain(set)
                .collect(),
            _ => set,
        }
    }
}

/// `plan`'s flags for the cluster time model.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct ModelArgs {
    /// Predict a split run on this many nodes (prints the cluster time model).
    #[arg(long)]
    pub(crate) nodes: Option<u64>,
    #[arg(long, default_value_t = 8)]
    pub(crate) gpus_per_node: u64,
    /// Aggregate shared-filesystem bandwidth, GB/s.
    #[arg(long, default_value_t = 100.0, value_name = "GB/s")]
    pub(crate) fs_bandwidth: f64,
    /// One node's link to the filesystem, GB/s (200 Gb/s InfiniBand ≈ 25).
    #[arg(long, default_value_t = 25.0, value_name = "GB/s")]
    pub(crate) node_bandwidth: f64,
    /// Sustained GEMM rate per GPU, TFLOP/s (47: cuBLAS SGEMM on an H200, BENCHMARKS.md).
    #[arg(long, default_value_t = 47.0)]
    pub(crate) gpu_tflops: f64,
    /// Host-to-device rate per GPU, GB/s (52: measured on the H200 host, docs/GPU.md).
    #[arg(long, default_value_t = 52.0, value_name = "GB/s")]
    pub(crate) pcie: f64,
    /// Device memory per GPU for the tile cache, GiB.
    #[arg(long, default_value_t = 120.0, value_name = "GiB")]
    pub(crate) gpu_memory: f64,
    /// Compute tile edge.
    #[arg(long, default_value_t = 8192)]
    pub(crate) tile: u64,
    /// Shards per step (default as `run` chooses: 1 or 4 per process).
    #[arg(long = "model-shards", value_name = "S")]
    pub(crate) shards: Option<u32>,
}

/// `plan PLAN`, or with `--nodes` the cluster time model.
pub(crate) fn plan_cmd(plan: &Path, set: &[String], m: &ModelArgs) -> Result<()> {
    let p = Plan::load_with(plan, set)?;
    let Some(nodes) = m.nodes else {
        print!("{}", run::describe(&p)?);
        return Ok(());
    };
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
    let mc = model::Machine {
        nodes,
        gpus_per_node: m.gpus_per_node,
        fs_bandwidth: m.fs_bandwidth * 1e9,
        node_bandwidth: m.node_bandwidth * 1e9,
        gpu_flops: m.gpu_tflops * 1e12,
        pcie: m.pcie * 1e9,
        gpu_memory: (m.gpu_memory * (1u64 << 30) as f64) as u64,
        tile: m.tile,
        shards: m.shards,
    };
    print!("{}", crate::progress::wrap(&model::predict(&p, &mc)?));
    Ok(())
}

/// `prepare PLAN`: generate missing inputs and create the first step's output (and every step
/// whose inputs already exist) for a split run, once, before the job starts.
pub(crate) fn prepare_cmd(plan: &Path, set: &[String], restart: bool) -> Result<()> {
    let mut p = Plan::load_with(plan, set)?;
    // The shard processes see other GPU counts than this one: a tile that does not depend on
    // them (`Engine::even_rows`).
    p.engine.even_rows = false;
    run::init_threads(p.engine.threads);
    let progress = Progress::new(false, run::default_log_every());
    let sh = ShardOptions::new(super::ShardSpec::One { k: 0, s: 1 });
    let backend = crate::backend::select(&p.engine)?;
    if restart {
        // Finished outputs are kept when an input is found corrupt (as `run --restart`).
        let layouts: Vec<_> = (p.steps.iter())
            .map(|s| crate::plan::layout::Layout::new(&p.path, s, &p.engine, backend.caps()))
            .collect::<Result<_>>()?;
        run::check_before_restart(&p, &layouts, backend.caps().kind, &progress)?;
        for step in &p.steps {
            prepare::reset(&step.output)?;
        }
    }
    super::generate_shared(&p, &sh, &progress)?;
    for step in &p.steps {
        let n = step.index + 1;
        let ins = [Some(&step.a), Some(&step.b), step.c0.as_ref()];
        if let Some(op) = ins.into_iter().flatten().find(|op| !op.path.exists()) {
            println!(
                "step {n}: prepared when its input {} exists (a step before finalizes it)",
                op.path.display()
            );
            continue;
        }
        if let Some(dir) = step.output.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| Error::io(dir, "cannot create output directory", e))?;
        }
        let layout = crate::plan::layout::Layout::new(&p.path, step, &p.engine, backend.caps())?;
        let fp = run::fingerprint(step, &layout, backend.caps().kind, p.engine.precision)?;
        let m = prepare::ensure(step, &layout, &fp, &sh, &progress)?;
        println!(
            "step {n}: {} ready for a split run: {} output tiles ({}×{} grid of {}×{})",
            step.output.display(),
            m.tiles,
            m.m.div_ceil(m.tm),
            m.gn,
            m.tm,
            m.tn
        );
    }
    Ok(())
}

/// `finalize PLAN`: merge the shard journals of every split step, check the tiles, write the
/// checksum tables; with `verify`, Freivalds' test after.
pub(crate) fn finalize_cmd(plan: &Path, set: &[String], verify: bool) -> Result<()> {
    let p = Plan::load_with(plan, set)?;
    run::init_threads(p.engine.threads);
    finalize::finalize_plan(&p, verify.then_some((p.engine.precision, 2, 1)))
}

/// `status PLAN`: done/left/rate/ETA per step and per shard.
pub(crate) fn status_cmd(plan: &Path, set: &[String], claim_timeout: f64) -> Result<()> {
    let p = Plan::load_with(plan, set)?;
    let text = status::status_text(&p, Duration::from_secs_f64(claim_timeout.max(0.5)))?;
    print!("{}", crate::progress::wrap(&text));
    Ok(())
}
