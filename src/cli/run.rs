//! `run`: run a plan (generate missing inputs, stream every step, write the outputs), with the
//! flags of a run split across processes ([`ShardArgs`], docs/CLUSTER.md), the `--report`
//! check made before any work, and the timeline (`MGMM_TRACE`) written at the end.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;

use super::interrupted;
use super::verify::verify_plan;
use crate::cluster::identity::{self, env_var};
use crate::cluster::ShardOptions;
use crate::config::Settings;
use crate::error::{Error, Result};
use crate::interrupt;
use crate::plan::Plan;
use crate::progress::{fmt_duration, Progress};
use crate::run::{self, RunOptions};

/// Run a plan: generate missing inputs, stream every step, write the outputs.
#[derive(Args, Debug)]
#[command(after_help = "Example:\n  mgmm-stream run examples/quickstart.toml --report run.json")]
pub(crate) struct RunArgs {
    /// The plan file (TOML, docs/PLAN.md).
    plan: PathBuf,
    /// Override an [engine] key of the plan (repeatable), e.g. --set engine.host_memory=8GiB.
    #[arg(long = "set", value_name = "engine.KEY=VALUE")]
    set: Vec<String>,
    /// Print nothing but errors.
    #[arg(long, short)]
    quiet: bool,
    /// Write the summary figures as JSON to this file.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Seconds between log lines when stderr is not a terminal.
    #[arg(long, default_value_t = 5.0)]
    log_every: f64,
    /// Ignore journals from earlier runs and recompute every step (outputs are overwritten).
    #[arg(long)]
    restart: bool,
    /// After the run, check every product with Freivalds' test (see `verify`).
    #[arg(long)]
    verify: bool,
    #[command(flatten)]
    split: ShardArgs,
}

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
            wait_for_held: false,
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

impl RunArgs {
    pub(super) fn execute(self, settings: &Settings) -> Result<()> {
        let RunArgs {
            plan,
            set,
            quiet,
            report,
            log_every,
            restart,
            verify,
            split,
        } = self;
        let mut p = Plan::load_with(&plan, &split.with_local_gpu(set))?;
        if split.options()?.is_some() {
            // As `prepare` laid the step out: a tile that does not depend on this process's GPUs.
            crate::cluster::for_split(&mut p);
        }
        super::refuse_job_files(&p, settings.trace.as_deref(), "MGMM_TRACE=")?;
        super::refuse_job_files(&p, report.as_deref(), "--report ")?;
        if let (Some(r), Some(t)) = (&report, &settings.trace) {
            if crate::plan::same_file(r, t) {
                return Err(Error::Usage(format!(
                    "--report {} and MGMM_TRACE={} name the same file: the timeline would replace the report; give them two paths",
                    r.display(),
                    t.display()
                )));
            }
        }
        crate::trace::init(settings.trace.as_deref())?;
        // A report path that cannot be written fails now, not after hours of work.
        if let Some(r) = &report {
            report_writable(r)?;
        }
        interrupt::install();
        let progress = Progress::new(quiet, Duration::from_secs_f64(log_every.max(0.1)));
        let opts = RunOptions {
            report: report.clone(),
            restart,
            cancel: Some(interrupt::flag()),
            // One plan per process: nothing to keep a backend for.
            keep_backend: false,
            #[cfg(feature = "fault-injection")]
            faults: crate::backend::fault::FaultConfig::from_env(),
        };
        let rep = match split.options()? {
            Some(sh) => crate::cluster::run_plan(&p, &opts, &sh, &progress),
            None => run::run_plan(&p, &opts, &progress),
        };
        crate::trace::write_at_end();
        // `--restart` again would discard what the stopped run kept (a trial lost a
        // checkpointed tile so, told to "run the same command again").
        // Without checkpoints the tiles in flight are lost (a trial read "finished tiles are
        // kept" as all the work kept, with 0 tiles finished and 61 % of one done).
        let again = match (restart, p.engine.checkpoint_every.is_some()) {
            (false, true) => "run the same command again to resume (finished tiles are kept, and the tiles in flight from their checkpoints)",
            (false, false) => "run the same command again to resume (finished tiles are kept; with engine.checkpoint_every = \"off\" the tiles in flight start again)",
            (true, _) => "run the same command again without --restart to resume (finished tiles and checkpoints are kept; --restart would discard them)",
        };
        let rep = rep.map_err(|e| interrupted(e, again))?;
        progress.result(&format!(
            "done in {} (process {})",
            fmt_duration(Some(rep.wall_s)),
            fmt_duration(rep.process_wall_s)
        ));
        if verify {
            verify_plan(&p, 2, 1, quiet, false, settings.verify_times)?;
        }
        Ok(())
    }
}

/// Whether `--report PATH` can be written: a path that is not a folder, device or FIFO, in a
/// folder where the report's temporary file can be created (tried now, and removed at once, so
/// a run killed before its end leaves no empty report behind; the report itself is written whole
/// at the end and renamed onto PATH, `run::write_report`: a link or a hard link there is
/// replaced, never written through).
fn report_writable(path: &Path) -> Result<()> {
    let err = |e| Error::io(path, "cannot write the report (--report)", e);
    // Not a folder, device or pipe, nor a file that is not an earlier report.
    crate::store::fsutil::refuse_replacing(path, "--report ")?;
    // Its folder is made as an output's is (`run` creates those too).
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(err)?;
    }
    let probe = crate::store::atomic::TempOutput::new(path, 0).map_err(|e| match e {
        Error::Io { source, .. } => err(source),
        e => e,
    })?;
    drop(probe);
    Ok(())
}
