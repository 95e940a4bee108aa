//! The outprep stage: output blocks the planners just scheduled → populated pages of the output
//! (no message out). Several threads share one channel (an eighth of `threads`, 2 to 8, at
//! least one per lane). Its input is a hint: planners drop a block rather than wait when it is
//! behind; it blocks only on the page faults it takes.

use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Receiver;

use crate::error::Result;
use crate::metrics::StageMetrics;
use crate::pipeline::control::Control;
use crate::store::{Block, MatrixSink};

/// Populates the output file's pages for tiles the planners just scheduled, so writeback copies
/// into memory that is already mapped instead of taking a page fault per 4 KiB.
pub(crate) struct OutPrep<'a> {
    pub(crate) writer: &'a dyn MatrixSink,
    pub(crate) rx: Receiver<Block>,
    pub(crate) m: Arc<StageMetrics>,
}

impl OutPrep<'_> {
    pub(crate) fn run(self, ctl: &Control) -> Result<()> {
        while let Some(b) = ctl.recv_timed(&self.rx, &self.m) {
            let t = Instant::now();
            let n = self.writer.prefault(&b);
            self.m.add_busy(t.elapsed());
            self.m.add_item(n);
        }
        Ok(())
    }
}
