//! The prefetch stage: [`PlanOp`] → the same [`PlanOp`], after asking the kernel to read ahead
//! (`madvise(WILLNEED)`) the input blocks about to be staged. One thread per lane; it blocks only
//! on its channels (from the planner, to staging).

use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

use super::inputs::Inputs;
use super::messages::PlanOp;
use crate::error::Result;
use crate::metrics::StageMetrics;
use crate::pipeline::control::Control;
use crate::plan::schedule::Src;

pub(crate) struct Prefetch<'a> {
    pub(crate) inputs: &'a Inputs,
    pub(crate) rx: Receiver<PlanOp>,
    pub(crate) out: Sender<PlanOp>,
    pub(crate) m: Arc<StageMetrics>,
}

impl Prefetch<'_> {
    pub(crate) fn run(self, ctl: &Control) -> Result<()> {
        while let Some(op) = ctl.recv_timed(&self.rx, &self.m) {
            let t = Instant::now();
            match &op {
                PlanOp::Load { src, block, .. } => {
                    let n = self.inputs.file(*src).will_need(block);
                    self.m.add_item(n);
                }
                PlanOp::Begin {
                    c0: Some(block), ..
                } => {
                    let n = self.inputs.file(Src::C0).will_need(block);
                    self.m.add_item(n);
                }
                _ => {}
            }
            self.m.add_busy(t.elapsed());
            ctl.send_timed(&self.out, op, &self.m)?;
        }
        Ok(())
    }
}
