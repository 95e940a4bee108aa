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

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use super::target::MemoryTarget;
use super::PlanStep;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::pipeline::StepSources;
use crate::plan::{Operand, Plan, Step};
use crate::report::StepReport;
use crate::store::memory::{MemoryMatrix, MemoryWriter};
use crate::store::{MatrixSink, MatrixSource};

/// The chain intermediates in memory, by the path of the temporary file each stands for.
#[derive(Default)]
pub(crate) struct Held {
    mats: HashMap<PathBuf, Arc<MemoryMatrix>>,
}

impl Held {
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
            Some(j) if plan.steps[j].output_in_memory() => Self::needed(plan, j, complete),
            Some(j) => Ok(!complete(j)?),
        }
    }

    /// Compute `step`'s intermediate into memory and keep it for the step that reads it; a
    /// failed device's unfinished tiles are redone on the others, as for a file output.
    pub(crate) fn compute(
        &mut self,
        cx: &PlanStep<'_>,
        backend: &mut Box<dyn Backend>,
    ) -> Result<StepReport> {
        let (step, layout) = (cx.step, cx.layout);
        let tr = Instant::now();
        let out = Arc::new(MemoryMatrix::new(
            &step.output,
            (step.m, step.n),
            step.out_dtype,
            layout.out_tile,
        )?);
        let alloc_s = tr.elapsed().as_secs_f64();
        cx.progress.note(&format!(
            "step {}: the intermediate {} ({}) stays in host memory",
            step.index + 1,
            step.chain.as_ref().map_or("", |c| c.text.as_str()),
            crate::units::fmt_bytes(out.bytes())
        ));
        let make = || Ok(Box::new(MemoryWriter(out.clone())) as Box<dyn MatrixSink>);
        let target = MemoryTarget::new(step, layout, Box::new(make));
        let sources = || self.sources(step);
        let rep = cx
            .step_run(Box::new(target), &sources)
            .run(backend, cx.progress)?;
        let mut rep = rep.expect("an output in memory is never complete before it is computed");
        rep.setup_s.insert(0, ("alloc".into(), alloc_s));
        self.mats.insert(step.output.clone(), out);
        Ok(rep)
    }
}
