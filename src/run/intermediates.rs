//! Intermediates of a whole-expression chain held in host memory during an unsplit run.
//!
//! The plan marks the intermediates that fit in the chain's memory budget
//! ([`crate::plan::chain::memory_budget`]). In an unsplit run the step that produces one writes
//! into a [`MemoryMatrix`] instead of a temporary file — no journal, no checkpoint — and the
//! step that reads it gets it through [`StepSources`], the same seam the library API feeds
//! arrays in memory through. [`Held`] owns them for the run loop and drops each one as soon as
//! the step that reads it completes.
//!
//! Nothing of an intermediate in memory survives the process. A resumed chain therefore
//! computes it again — the same bytes, since the fingerprint pins the layout and backend —
//! before the step that reads it continues from its journal; and when that step (or the whole
//! chain) is already complete, it is not computed at all ([`Held::needed`]). Split runs
//! (`--shard`) never use this: other processes read the intermediates, so they stay files.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::{fail_over, RunOptions};
use crate::backend::Backend;
use crate::durable::sink::TileSink;
use crate::error::{Error, Result};
use crate::pipeline::{Engines, Pipeline, RunConfig, StepSources, Work};
use crate::plan::layout::Layout;
use crate::plan::schedule::{OutTile, Schedule};
use crate::plan::{Operand, Plan, Step};
use crate::progress::Progress;
use crate::report::{self, StepContext, StepReport};
use crate::store::memory::{MemoryMatrix, MemoryWriter};
use crate::store::MatrixSource;

/// The chain intermediates in memory, by the path of the temporary file each stands for.
#[derive(Default)]
pub(crate) struct Held {
    mats: HashMap<PathBuf, Arc<MemoryMatrix>>,
}

/// Records which tiles of an intermediate in memory are written, so that a device failover
/// redoes only the rest (there is no journal).
struct Written(Mutex<HashSet<u32>>);

impl TileSink for Written {
    fn tile_written(&self, tile: &OutTile, _crc: u32) -> Result<()> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(tile.seq);
        Ok(())
    }
}

impl Held {
    /// Whether `step` writes an intermediate that this run holds in memory.
    pub(crate) fn in_memory(step: &Step, opts: &RunOptions) -> bool {
        opts.shard.is_none() && step.output_in_memory()
    }

    /// The operands of `step`: an intermediate held here from memory, anything else opened
    /// from its file.
    pub(crate) fn sources(&self, step: &Step) -> Result<StepSources> {
        let open = |op: &Operand| -> Result<Arc<dyn MatrixSource>> {
            if let Some(m) = self.mats.get(&op.path).filter(|_| op.temp) {
                return Ok(m.clone());
            }
            if op.temp && !op.path.exists() {
                return Err(Error::format(
                    &op.path,
                    format!(
                        "step {}: this intermediate of the chain is neither in memory nor on disk; run the whole plan again (it recomputes the chain's intermediates)",
                        step.index + 1
                    ),
                ));
            }
            op.open()
        };
        Ok(StepSources {
            a: open(&step.a)?,
            b: open(&step.b)?,
            c0: step.c0.as_ref().map(open).transpose()?,
        })
    }

    /// After `step` completes (or was already complete): drop the intermediates it read.
    pub(crate) fn release(&mut self, step: &Step) {
        for op in [&step.a, &step.b] {
            if op.temp {
                self.mats.remove(&op.path);
            }
        }
    }

    /// Whether the in-memory intermediate that step `i` writes must be computed: its reader is
    /// another in-memory intermediate that is needed, or a step whose journal does not say it
    /// is complete for the same plan and inputs (`complete`).
    pub(crate) fn needed(
        plan: &Plan,
        opts: &RunOptions,
        i: usize,
        complete: &dyn Fn(usize) -> Result<bool>,
    ) -> Result<bool> {
        let out = &plan.steps[i].output;
        let reader = (i + 1..plan.steps.len()).find(|&j| {
            let s = &plan.steps[j];
            [&s.a, &s.b].iter().any(|o| o.temp && &o.path == out)
        });
        match reader {
            None => Ok(false),
            Some(j) if Self::in_memory(&plan.steps[j], opts) => {
                Self::needed(plan, opts, j, complete)
            }
            Some(j) => Ok(!complete(j)?),
        }
    }

    /// Compute `step`'s intermediate into memory and keep it for the step that reads it; a
    /// failed device's unfinished tiles are redone on the others, as for a file output.
    pub(crate) fn compute(
        &mut self,
        plan: &Plan,
        step: &Step,
        layout: &Layout,
        backend: &mut Box<dyn Backend>,
        opts: &RunOptions,
        progress: &Progress,
    ) -> Result<StepReport> {
        let e = &plan.engine;
        let tr = Instant::now();
        let out = Arc::new(MemoryMatrix::new(
            &step.output,
            (step.m, step.n),
            step.out_dtype,
            layout.out_tile,
        )?);
        let alloc_s = tr.elapsed().as_secs_f64();
        progress.note(&format!(
            "step {}: the intermediate {} ({}) stays in host memory",
            step.index + 1,
            step.chain.as_ref().map_or("", |c| c.text.as_str()),
            crate::units::fmt_bytes(out.bytes())
        ));
        let total = Schedule::new(step, layout).tiles.len() as u32;
        let written = Written(Mutex::new(HashSet::new()));
        loop {
            let done = written.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let todo: Vec<u32> = (0..total).filter(|s| !done.contains(s)).collect();
            let work = Work {
                writer: Box::new(MemoryWriter(out.clone())),
                done_before: (total as usize - todo.len()) as u64,
                todo: Some(todo),
            };
            let sources = self.sources(step)?;
            let engines = Engines::make(backend.as_ref(), layout, e, step.order(), &sources)?;
            let cfg = RunConfig {
                cancel: opts.cancel,
                ..RunConfig::from_engine(e)
            };
            let pipe = Pipeline::build_with(
                step,
                layout,
                backend.as_ref(),
                engines,
                work,
                cfg,
                &written,
                progress,
                sources,
            )?;
            match pipe.run() {
                Ok(stats) => {
                    let cx = StepContext::of(step, layout, backend.as_ref(), e);
                    let mut rep = report::step_report(&cx, stats);
                    rep.output = format!("{} (held in memory)", step.output.display());
                    rep.setup_s = vec![("alloc".into(), alloc_s)];
                    self.mats.insert(step.output.clone(), out);
                    return Ok(rep);
                }
                Err(err @ Error::Device { .. }) => {
                    *backend = fail_over(backend.as_ref(), err, step.index + 1, progress)?;
                }
                Err(err) => return Err(err),
            }
        }
    }
}
