//! The sync stage ([`Durable`]): (tile, CRC) from writeback → the tile flushed when the run is
//! durable and recorded through the [`TileSink`] (the resume journal), its checkpoints removed,
//! progress counted. One thread; it blocks on the flush and the journal's write, which is why it
//! is a thread of its own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Receiver;

use crate::durable::checkpoint::Checkpoints;
use crate::durable::sink::TileSink;
use crate::error::Result;
use crate::metrics::StageMetrics;
use crate::pipeline::control::Control;
use crate::plan::schedule::OutTile;
use crate::store::MatrixSink;

/// Makes written tiles durable (when asked) and records them in the journal, one after the
/// other, on its own thread: waiting for the disk to take tile `t` overlaps writeback writing
/// tile `t + 1` and the devices computing more, instead of stalling them.
pub(crate) struct Durable<'a> {
    pub(crate) writer: &'a dyn MatrixSink,
    pub(crate) rx: Receiver<(OutTile, u32)>,
    pub(crate) m: Arc<StageMetrics>,
    pub(crate) sink: &'a dyn TileSink,
    /// Checkpoints of tiles, removed once the tile is recorded.
    pub(crate) ckpt: Option<&'a Checkpoints>,
    pub(crate) tiles_done: &'a AtomicU64,
    pub(crate) flops_done: &'a AtomicU64,
    pub(crate) k: u64,
    /// Flush each tile's data before its journal record.
    pub(crate) durable: bool,
}

impl Durable<'_> {
    pub(crate) fn run(self, ctl: &Control) -> Result<()> {
        let r = self.record(ctl);
        // A stopped run is cancelled once everything the lanes sent is recorded.
        ctl.output_done();
        r
    }

    fn record(&self, ctl: &Control) -> Result<()> {
        while let Some((tile, crc)) = ctl.recv_timed(&self.rx, &self.m) {
            let t = Instant::now();
            let b = tile.block;
            if self.durable {
                self.writer.flush_block(&b)?;
            }
            self.sink.tile_written(&tile, crc)?;
            // Work done before this run (a resumed checkpoint) was counted at the start.
            let mut k = self.k;
            if let Some(c) = self.ckpt {
                c.finished(tile.seq)?;
                k -= c.k_before(tile.seq);
            }
            self.m.add_busy(t.elapsed());
            self.m.add_item(0);
            self.tiles_done.fetch_add(1, Ordering::Relaxed);
            self.flops_done
                .fetch_add(2 * b.rows * b.cols * k, Ordering::Relaxed);
        }
        Ok(())
    }
}
