//! The writeback stage: [`Done`] → (tile, CRC) to the sync stage: a finished tile written into
//! the output (or a checkpoint saved), its buffer back to the output pool. `threads / 8`, 1 to 4
//! threads, each with its own channel; a tile's messages all go to one
//! ([`ToWriteback`](super::messages::ToWriteback)). It blocks on the checks of directly uploaded
//! inputs the tile depends on, on writing, and on its output channel to sync. It counts the
//! NaN/Inf of each finished tile as written (a [`Nonfinite`] tally), for the report's note on an
//! output that overflowed.

use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

use super::messages::Done;
use super::nonfinite::Nonfinite;
use crate::dtype::DType;
use crate::durable::checkpoint::Checkpoints;
use crate::error::Result;
use crate::metrics::StageMetrics;
use crate::pipeline::control::Control;
use crate::plan::schedule::OutTile;
use crate::store::{Block, MatrixSink};

/// Bytes of a tile one thread counts NaN/Inf in at a time ([`count_in_pieces`]).
const COUNT_PIECE: usize = 1 << 20;

pub(crate) struct Writeback<'a> {
    pub(crate) writer: &'a dyn MatrixSink,
    /// Where checkpoints (partial accumulators) are saved.
    pub(crate) ckpt: Option<&'a Checkpoints>,
    pub(crate) host_dt: DType,
    /// The output's NaN/Inf as stored (a value beyond the output dtype's range counts: it is
    /// stored as Inf), counted on the tile's bytes just before they are written, one compare per
    /// element ([`crate::dtype::count_nonfinite_as`]): a 4096² f32 output (64 MiB) took 2.3–2.5
    /// ms at opt-level 3 (35 ms at the dev profile's opt-level 1), against 2.2–3.9 s for the
    /// whole 4096² CPU step on the 2-core development VM — under 0.1 % in a release build.
    pub(crate) nonfinite: &'a Nonfinite,
    pub(crate) rx: Receiver<Done>,
    /// Written tiles (with their CRC) on their way to being made durable and recorded.
    pub(crate) out: Sender<(OutTile, u32)>,
    pub(crate) m: Arc<StageMetrics>,
}

impl Writeback<'_> {
    pub(crate) fn run(self, ctl: &Control) -> Result<()> {
        while let Some(d) = ctl.recv_timed(&self.rx, &self.m) {
            if let Some((progress, n)) = &d.checks {
                // Nothing computed from an input block is written before its checks passed.
                let t = Instant::now();
                progress.wait_for(*n, ctl)?;
                self.m.add_wait_in(t.elapsed());
            }
            let t = Instant::now();
            let b = d.tile.block;
            if let Some(k_done) = d.partial {
                let c = self.ckpt.expect("only a run with checkpoints takes them");
                let data = &d.buf.buf().bytes()[..b.elems() * self.host_dt.size()];
                // A checkpoint that cannot be saved (disk full, read-only directory) only
                // means a kill would lose more: the run goes on without further checkpoints.
                if let Err(e) = c.save(&d.tile, k_done, data) {
                    c.give_up(&e);
                }
                drop(d.buf);
                self.m.add_busy(t.elapsed());
                continue;
            }
            let crc = match d.into {
                // The lane wrote it into the output itself and its download is done: count
                // what it holds where it lies — on every core, since for the last tile of a
                // step this is all that is left to do; a GPU's memory is not read from here,
                // its NaN/Inf go uncounted — and let the sink say it is there.
                Some(r) => {
                    let rows: Vec<&[u8]> = match r.gpu {
                        // SAFETY: the sink's rectangle for this block, alive for the step; the
                        // lane's copy into it has ended and nothing else writes it.
                        None => unsafe { r.rows() }.collect(),
                        Some(_) => Vec::new(),
                    };
                    self.count_nonfinite(&b, &rows);
                    self.writer.wrote_in_place(&b)?
                }
                None => {
                    let data = &d.buf.buf().bytes()[..b.elems() * self.host_dt.size()];
                    // Populate the block's pages here too: when output is all the work (the
                    // 43 GB chain) writeback overtakes outprep, and copying into unpopulated
                    // pages takes a fault per 4 KiB while outprep populates the same tiles
                    // beside it. On two H200s the chain took 3.55–3.69 s so against 6.87–7.24
                    // s (docs/decisions/0005-writeback-threads-populate.md); pages outprep
                    // already made cost a walk of their page table.
                    self.writer.prefault(&b);
                    self.count_nonfinite(&b, &[data]);
                    self.writer.write_block(&b, self.host_dt, data)?
                }
            };
            drop(d.buf);
            // Out of this process's map now that it is written (still in the page cache):
            // resident memory holds the tiles in flight, not the output.
            self.writer.release(&b);
            self.m.add_busy(t.elapsed());
            self.m
                .add_item(b.elems() as u64 * self.writer.dtype().size() as u64);
            ctl.send_timed(&self.out, (d.tile, crc), &self.m)?;
        }
        Ok(())
    }

    /// Count the NaN/Inf of block `b`, given as `parts` of its bytes in the host dtype, as the
    /// output stores them ([`count_in_pieces`]).
    fn count_nonfinite(&self, b: &Block, parts: &[&[u8]]) {
        let n = count_in_pieces(self.host_dt, self.writer.dtype(), parts);
        if n > 0 {
            self.nonfinite.add(b, n);
        }
    }
}

/// The NaN/Inf among `parts` (elements of `from`, as `to` stores them), counted on every core
/// in pieces of [`COUNT_PIECE`] bytes, also when there is one part. One thread reads at memory
/// speed only: a 256 MiB f32 tile took 31 ms on the development VM, most of the 48 ms the last
/// tile of 32768² fp32 spent in writeback after the GPU's last GEMM on one H100 (`MGMM_TRACE`,
/// docs/measurements/2026-12-06d-h100-1-traces-head.log); counted in pieces, the step took
/// 1.422–1.425 s against 1.463–1.467 s, tf32 0.70–0.78 s against 1.00–1.01 s (…-2-ab-count-rows.log).
fn count_in_pieces(from: DType, to: DType, parts: &[&[u8]]) -> u64 {
    use rayon::prelude::*;
    let piece = COUNT_PIECE / from.size() * from.size();
    (parts.par_iter())
        .map(|p| {
            (p.par_chunks(piece))
                .map(|c| crate::dtype::count_nonfinite_as(from, to, c))
                .sum::<u64>()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerocopy::IntoBytes;

    /// Counted in pieces, a tile's NaN/Inf are all found: at a piece's first and last element,
    /// in a part shorter than a piece, and a value finite in f32 but beyond bf16's range.
    #[test]
    fn nonfinite_counted_in_pieces_across_their_edges() {
        let per = COUNT_PIECE / 4;
        let mut big = vec![1.0f32; 3 * per + 5];
        for i in [0, per - 1, per, 2 * per + 7, 3 * per + 4] {
            big[i] = if i % 2 == 0 {
                f32::NAN
            } else {
                f32::NEG_INFINITY
            };
        }
        let mut small = vec![2.0f32; 9];
        small[8] = f32::INFINITY;
        small[3] = 3.4e38;
        let (b, s) = (big.as_slice().as_bytes(), small.as_slice().as_bytes());
        assert_eq!(count_in_pieces(DType::F32, DType::F32, &[b, s]), 6);
        assert_eq!(count_in_pieces(DType::F32, DType::BF16, &[b, s]), 7);
        assert_eq!(count_in_pieces(DType::F32, DType::F32, &[b]), 5);
    }
}
