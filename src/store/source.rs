//! The seam between the pipeline and matrix storage: [`MatrixSource`] for inputs, [`MatrixSink`]
//! for outputs, and the [`Block`] they exchange.
//!
//! The pipeline reads and writes matrices only through these traits, so a new storage format
//! (a `.npy` array read in place, a raw binary file, a remote store) plugs in by implementing
//! them and adding a case to [`open_source`], without touching the stages. The `.mgt` tiled file
//! ([`super::TiledFile`], [`super::TiledWriter`]) is the first implementation. Every method takes
//! `&self` and the traits are `Send + Sync`: several stage threads share one source or sink, and
//! callers guarantee that concurrent writes go to disjoint blocks.

use std::path::Path;
use std::sync::Arc;

use crate::dtype::DType;
use crate::error::Result;

/// A block of a matrix: rows `r0..r0+rows`, columns `c0..c0+cols`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Block {
    pub r0: u64,
    pub c0: u64,
    pub rows: u64,
    pub cols: u64,
}

impl Block {
    pub fn elems(&self) -> usize {
        (self.rows * self.cols) as usize
    }
}

/// A matrix the engine reads blocks of.
pub trait MatrixSource: Send + Sync {
    /// The file it reads, for error messages and reports.
    fn path(&self) -> &Path;
    /// (rows, cols).
    fn shape(&self) -> (u64, u64);
    /// The element type as stored.
    fn dtype(&self) -> DType;
    /// Copy block `b` into `dst`, a dense row-major `b.rows × b.cols` array of `host` elements
    /// (`dst.len() == b.elems() * host.size()`), converting from the stored dtype. Blocks the
    /// calling thread; may use the rayon pool.
    fn read_block(&self, b: &Block, host: DType, dst: &mut [u8]) -> Result<()>;
    /// Hint that `b` will be read soon (asynchronous readahead). Returns the bytes advised, for
    /// the prefetch stage's metrics; errors are ignored (it is only a hint).
    fn will_need(&self, b: &Block) -> u64;
    /// Check the stored checksums of the data behind `b`, each piece at most once per source.
    /// `Ok(())` for formats without checksums.
    fn verify_block(&self, b: &Block) -> Result<()>;
    /// What identifies the data for the resume journal's fingerprint: a journal written against
    /// a source with a different identity is not resumed. Cheap (no pass over the data).
    fn identity(&self) -> String;
}

/// A matrix the engine writes blocks of.
pub trait MatrixSink: Send + Sync {
    /// The file it writes, for error messages and reports.
    fn path(&self) -> &Path;
    /// (rows, cols).
    fn shape(&self) -> (u64, u64);
    /// The element type as stored.
    fn dtype(&self) -> DType;
    /// The storage tile (rows, cols); a row-major file is one tile of the whole matrix.
    fn storage_tile(&self) -> (u64, u64);
    /// Write dense row-major `src` (`b.rows × b.cols` elements of `host`) into block `b`,
    /// converting to the stored dtype, and return the CRC-32C of the block's bytes in the stored
    /// dtype (the resume journal records it). Concurrent calls must write disjoint blocks.
    fn write_block(&self, b: &Block, host: DType, src: &[u8]) -> Result<u32>;
    /// Prepare the storage `b` will be written to (populate pages) so the later write runs at
    /// memory speed. A hint: returns bytes prepared, 0 where it does not apply.
    fn prefault(&self, b: &Block) -> u64;
    /// Make the bytes of block `b` durable (before the journal records it).
    fn flush_block(&self, b: &Block) -> Result<()>;
    /// Forget what the sink learnt about blocks written so far (after a resume reopened a
    /// partially written output whose earlier contents it did not see being written).
    fn forget_checksums(&self);
    /// Complete the file (checksum table, trailer) and, if `durable`, sync it to disk.
    fn finish(self: Box<Self>, durable: bool) -> Result<()>;
}

/// Open a matrix file for reading, choosing the implementation by its format.
pub fn open_source(path: &Path) -> Result<Arc<dyn MatrixSource>> {
    Ok(Arc::new(super::TiledFile::open(path)?))
}

/// How a sink moves output blocks into its file (plan key `engine.write`).
///
/// `Mmap` (the default) copies into a writable memory map whose pages a prefault stage populated
/// ahead of time (`MADV_POPULATE_WRITE`): on the H200 host it wrote an n = 32768 output in
/// 1.92 s against 2.31 s for `pwrite` (docs/GPU.md), because buffered writes to one file
/// serialise on the inode lock. `Pwrite` keeps resident memory bounded by the buffers in flight
/// and suits filesystems where shared writable maps are slow or unsupported (cluster and network
/// filesystems); the writer also falls back to it where `fallocate` is unsupported.
///
/// `Auto` (the default) picks per output: `Mmap` when the output fits in `host_memory` (its
/// mapped pages then stay within the memory the plan grants), else `Pwrite`, so an output larger
/// than the budget never makes the process's resident memory grow with it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WriteMode {
    #[default]
    Auto,
    Mmap,
    Pwrite,
}

impl WriteMode {
    /// The concrete mode for an output of `output_bytes` under a host budget of `host_memory`.
    pub fn resolve(self, output_bytes: u64, host_memory: u64) -> WriteMode {
        match self {
            WriteMode::Auto if output_bytes <= host_memory => WriteMode::Mmap,
            WriteMode::Auto => WriteMode::Pwrite,
            m => m,
        }
    }
    pub fn parse(s: &str) -> Option<WriteMode> {
        match s {
            "auto" => Some(WriteMode::Auto),
            "mmap" => Some(WriteMode::Mmap),
            "pwrite" => Some(WriteMode::Pwrite),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            WriteMode::Auto => "auto",
            WriteMode::Mmap => "mmap",
            WriteMode::Pwrite => "pwrite",
        }
    }
}
