//! A block of a matrix: the unit every read, write and check of matrix storage is cut into.
//!
//! The bottom of `store`: [`super::runs`] cuts a block into file runs, and the traits of
//! [`super::seam`] exchange blocks with the pipeline; this file imports nothing of `store`.

use std::path::Path;

use crate::error::{Error, Result};

/// A block of a matrix: rows `r0..r0+rows`, columns `c0..c0+cols`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Block {
    /// First row.
    pub r0: u64,
    /// First column.
    pub c0: u64,
    /// Rows.
    pub rows: u64,
    /// Columns.
    pub cols: u64,
}

impl Block {
    /// The matrix's first element: what a source or sink is asked about when the question is how
    /// it keeps its blocks (in a file map, in GPU memory, in the caller's array), before any
    /// block is read or written.
    pub const FIRST: Block = Block {
        r0: 0,
        c0: 0,
        rows: 1,
        cols: 1,
    };

    /// Elements in the block.
    pub fn elems(&self) -> usize {
        (self.rows * self.cols) as usize
    }

    /// `Ok` when the block lies inside a `shape.0 × shape.1` matrix; else an error naming
    /// `path` (what every source's `read_block` checks first).
    pub fn check_inside(&self, path: &Path, shape: (u64, u64)) -> Result<()> {
        if self.r0 + self.rows > shape.0 || self.c0 + self.cols > shape.1 {
            return Err(Error::format(
                path,
                format!(
                    "block {}..{} × {}..{} is outside the {}×{} matrix",
                    self.r0,
                    self.r0 + self.rows,
                    self.c0,
                    self.c0 + self.cols,
                    shape.0,
                    shape.1
                ),
            ));
        }
        Ok(())
    }
}
