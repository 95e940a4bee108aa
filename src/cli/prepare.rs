//! `prepare`: before a cluster job starts, generate missing inputs and create each split
//! step's output once (docs/CLUSTER.md); `--restart` throws away every step's state first.

use std::path::PathBuf;

use clap::Args;

use crate::cluster::{self, prepare, prepare::Prepared};
use crate::error::Result;
use crate::plan::Plan;
use crate::progress::Progress;
use crate::run;

/// Create a split step's output once before a cluster job starts (docs/CLUSTER.md).
#[derive(Args, Debug)]
#[command(
    after_help = "Example:\n  mgmm-stream prepare plan.toml && sbatch examples/cluster/sbatch.sh"
)]
pub(crate) struct PrepareArgs {
    /// The plan to lay out for a split run (docs/CLUSTER.md).
    plan: PathBuf,
    /// Override an [engine] key of the plan (repeatable), as `run --set` (the same for every process of the split run).
    #[arg(long = "set", value_name = "engine.KEY=VALUE")]
    set: Vec<String>,
    /// Throw away the outputs, journals and shard state of every step and start over.
    #[arg(long)]
    restart: bool,
}

impl PrepareArgs {
    /// `prepare PLAN`: generate missing inputs and create the first step's output (and every
    /// step whose inputs already exist) for a split run, once, before the job starts.
    pub(super) fn execute(self) -> Result<()> {
        let mut p = Plan::load_with(&self.plan, &self.set)?;
        cluster::for_split(&mut p);
        run::init_threads(p.engine.threads);
        let progress = Progress::new(false, run::default_log_every());
        for done in prepare::prepare_plan(&p, self.restart, &progress)? {
            match done {
                Prepared::Waiting { step, input } => println!(
                    "step {}: prepared when its input {} is finalized (a step before writes it)",
                    step + 1,
                    input.display()
                ),
                Prepared::Ready {
                    step,
                    output,
                    manifest: m,
                } => println!(
                    "step {}: {} ready for a split run: {} output tiles ({}×{} grid of {}×{})",
                    step + 1,
                    output.display(),
                    m.tiles,
                    m.m.div_ceil(m.tm),
                    m.gn,
                    m.tm,
                    m.tn
                ),
            }
        }
        Ok(())
    }
}
