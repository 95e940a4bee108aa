//! A tally of NaN/Inf values met while a step runs, and where the first was: the staging and
//! check stages keep one per input (A, B, C0) as they read its blocks, the writeback stage one
//! for the output as it writes its tiles. The summary's notes name the input and the block, so
//! that a user can find the value (a bare count named neither: new-user trial). A block read
//! again (an input tile staged once per output tile row that needs it) is counted once, so the
//! count is the values' (it counted every staging: 4 for 2 NaN, new-user trial).

use std::collections::HashSet;
use std::sync::Mutex;

use crate::store::Block;

/// NaN/Inf values counted, the blocks they were counted in, and the first block (in row-major
/// order of its first element) that held one.
#[derive(Default)]
pub(crate) struct Nonfinite(Mutex<Tally>);

#[derive(Default)]
struct Tally {
    count: u64,
    seen: HashSet<(u64, u64, u64, u64)>,
    first: Option<Block>,
}

impl Nonfinite {
    /// Count the `n` values of block `b`, once per block (nothing for `n = 0`; blocks of one
    /// tally are of one grid, so a block read twice has the same corner and size).
    pub(crate) fn add(&self, b: &Block, n: u64) {
        if n == 0 {
            return;
        }
        let mut t = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if !t.seen.insert((b.r0, b.c0, b.rows, b.cols)) {
            return;
        }
        t.count += n;
        if t.first.is_none_or(|f| (b.r0, b.c0) < (f.r0, f.c0)) {
            t.first = Some(*b);
        }
    }

    /// The count and the first block with one.
    pub(crate) fn get(&self) -> (u64, Option<Block>) {
        let t = self.0.lock().unwrap_or_else(|e| e.into_inner());
        (t.count, t.first)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_count_once_per_block_and_the_first_block_in_row_major_order() {
        let t = Nonfinite::default();
        let blk = |r0, c0| Block {
            r0,
            c0,
            rows: 4,
            cols: 4,
        };
        assert_eq!(t.get(), (0, None));
        t.add(&blk(4, 0), 0);
        assert_eq!(t.get(), (0, None), "a block with none is not the first");
        t.add(&blk(4, 8), 2);
        t.add(&blk(0, 12), 1);
        t.add(&blk(4, 4), 5);
        assert_eq!(t.get(), (8, Some(blk(0, 12))));
        t.add(&blk(4, 8), 2);
        assert_eq!(
            t.get(),
            (8, Some(blk(0, 12))),
            "a block read again counts once"
        );
    }
}
