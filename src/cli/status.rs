//! `status`: a plan's progress per step — per shard and who holds each shard for a split job,
//! tiles done and whether a run holds it for a step one process runs (`cluster::status`
//! computes it).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::cluster::status;
use crate::error::Result;
use crate::plan::Plan;

/// Show a plan's progress: per step, tiles done and left; for a split job the rate, ETA and who
/// holds each shard; for a step one process runs, whether a run is at it now and what waits in
/// checkpoints.
#[derive(Args, Debug)]
#[command(after_help = "Example:\n  watch -n 10 mgmm-stream status plan.toml")]
pub(crate) struct StatusArgs {
    /// The plan (a split run's or one process's; docs/CLUSTER.md).
    plan: PathBuf,
    /// Override an [engine] key of the plan (repeatable), as `run --set` (the same for every process of the split run).
    #[arg(long = "set", value_name = "engine.KEY=VALUE")]
    set: Vec<String>,
    /// Heartbeat age (seconds) after which a claim is shown as stale.
    #[arg(long, default_value_t = 120.0)]
    claim_timeout: f64,
}

impl StatusArgs {
    /// `status PLAN`: done/left/rate/ETA per step and per shard.
    pub(super) fn execute(self) -> Result<()> {
        let p = Plan::load_with(&self.plan, &self.set)?;
        let timeout = Duration::from_secs_f64(self.claim_timeout.max(0.5));
        let text = status::status_text(&p, timeout)?;
        print!("{}", crate::progress::wrap(&text));
        Ok(())
    }
}
