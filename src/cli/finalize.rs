//! `finalize`: finish a plan's split steps (merge the shard journals, check every tile, write
//! the checksum tables; `cluster::finalize` does the work), optionally verifying after.

use std::path::PathBuf;

use clap::Args;

use crate::cluster::finalize;
use crate::config::Settings;
use crate::error::Result;
use crate::plan::Plan;
use crate::run;

/// Finish split steps: check every tile against its shard journal, write the checksum
/// table, merge the journals; refuses while shards are missing and names them.
#[derive(Args, Debug)]
#[command(after_help = "Example:\n  mgmm-stream finalize plan.toml --verify")]
pub(crate) struct FinalizeArgs {
    /// The plan of the split run to complete (docs/CLUSTER.md).
    plan: PathBuf,
    /// Override an [engine] key of the plan (repeatable), as `run --set` (the same for every process of the split run).
    #[arg(long = "set", value_name = "engine.KEY=VALUE")]
    set: Vec<String>,
    /// Run Freivalds' test on each output after (see `verify`).
    #[arg(long)]
    verify: bool,
}

impl FinalizeArgs {
    /// `finalize PLAN`: merge the shard journals of every split step, check the tiles, write
    /// the checksum tables; with `verify`, Freivalds' test after.
    pub(super) fn execute(self, settings: &Settings) -> Result<()> {
        let p = Plan::load_with(&self.plan, &self.set)?;
        run::init_threads(p.engine.threads);
        let verify = (self.verify)
            .then(|| crate::verify::Verifier::with_times(&p.engine, 2, 1, settings.verify_times));
        finalize::finalize_plan(&p, verify.as_ref(), &mut |l| crate::outln!("{l}"))
    }
}
