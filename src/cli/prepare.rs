//! `prepare`: before a cluster job starts, generate missing inputs and create each split
//! step's output once (docs/CLUSTER.md); `--restart` throws away every step's state first.

use std::path::PathBuf;

use clap::Args;

use crate::cluster::{self, prepare, ShardOptions, ShardSpec};
use crate::error::{Error, Result};
use crate::plan::layout::Layout;
use crate::plan::Plan;
use crate::progress::Progress;
use crate::run;

/// Create a split step's output once before a cluster job starts (docs/CLUSTER.md).
#[derive(Args, Debug)]
#[command(
    after_help = "Example:\n  mgmm-stream prepare plan.toml && sbatch examples/cluster/sbatch.sh"
)]
pub(crate) struct PrepareArgs {
    plan: PathBuf,
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
        // The shard processes see other GPU counts than this one: a tile that does not depend
        // on them (`Engine::even_rows`).
        p.engine.even_rows = false;
        run::init_threads(p.engine.threads);
        let progress = Progress::new(false, run::default_log_every());
        let sh = ShardOptions::new(ShardSpec::One { k: 0, s: 1 });
        let backend = crate::backend::select(&p.engine)?;
        if self.restart {
            // Finished outputs are kept when an input is found corrupt (as `run --restart`).
            run::check_before_restart(&p, &progress)?;
            for step in &p.steps {
                prepare::reset(&step.output)?;
            }
        }
        cluster::generate_shared(&p, &sh, &progress)?;
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
            let layout = Layout::new(&p.path, step, &p.engine, backend.caps())?;
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
}
