//! The output sink of one shard: the step's output (`.mgt` or `.npy`) reopened for writing,
//! whose `finish` only makes this process's writes durable (`fsync`, with `durable = true`, or
//! off a local disk), leaving the checksums (a `.mgt`'s table, a `.npy`'s sidecar and its real
//! header) to `finalize` — a shard knows only its own tiles.
//!
//! On a local disk a shard writes as one process does (`engine.write`, `auto`: through a shared
//! map whose pages the outprep threads populate): the processes of a node share its page cache,
//! so another shard's and `finalize`'s reads see the bytes. Everywhere else (NFS, Lustre, GPFS,
//! …) with `pwrite`: NFS gives only close-to-open coherence, and a mapping on one client is not
//! seen by another. With `pwrite` a 32768² f32 shard on one H100 was bound by its writeback
//! threads (buffered `pwrite`s to one file serialise on its inode lock, 3.3–3.6 GB/s): its step
//! took 2.7–3.0 s against 1.6 s for the same product in one process.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::store::{reopen_output, Block, Header, MatrixSink, WriteMode};

pub(crate) struct ShardWriter {
    inner: Box<dyn MatrixSink>,
    path: PathBuf,
}

impl ShardWriter {
    /// Reopen the prepared output `path` (whose header must be `hdr`) to write through its map
    /// when `mode` (resolved as one process would) says so and the file is on a local disk,
    /// else with `pwrite`s.
    pub(crate) fn open(path: &Path, hdr: Header, mode: WriteMode) -> Result<ShardWriter> {
        let mode = match mode {
            WriteMode::Mmap if crate::store::fsutil::path_on_local_disk(path) => WriteMode::Mmap,
            _ => WriteMode::Pwrite,
        };
        Ok(ShardWriter {
            inner: reopen_output(path, hdr, mode)?,
            path: path.to_path_buf(),
        })
    }

    /// Whether the writer writes through its map (it falls back to `pwrite` where the file
    /// cannot be preallocated).
    fn mapped(&self) -> bool {
        self.inner.write_mode() == WriteMode::Mmap.name()
    }
}

impl MatrixSink for ShardWriter {
    fn path(&self) -> &Path {
        &self.path
    }
    fn shape(&self) -> (u64, u64) {
        self.inner.shape()
    }
    fn dtype(&self) -> DType {
        self.inner.dtype()
    }
    fn storage_tile(&self) -> (u64, u64) {
        self.inner.storage_tile()
    }
    fn write_block(&self, b: &Block, host: DType, src: &[u8]) -> Result<u32> {
        self.inner.write_block(b, host, src)
    }
    fn prefault(&self, b: &Block) -> u64 {
        self.inner.prefault(b)
    }
    fn release(&self, b: &Block) -> u64 {
        self.inner.release(b)
    }
    fn release_written(&self, on: bool) {
        self.inner.release_written(on)
    }
    fn counts_dirty_pages(&self) -> bool {
        self.inner.counts_dirty_pages()
    }
    fn write_mode(&self) -> &'static str {
        self.inner.write_mode()
    }
    fn flush_block(&self, b: &Block) -> Result<()> {
        if self.mapped() {
            // A local disk: the block's range of the map, as one process flushes it.
            return self.inner.flush_block(b);
        }
        // `pwrite`s go through the page cache; fdatasync the file (on NFS this also sends the
        // data to the server, so another node's finalize sees it).
        File::open(&self.path)
            .and_then(|f| f.sync_data())
            .map_err(|e| Error::io(&self.path, "cannot flush output tile to disk", e))
    }
    fn forget_checksums(&self) {
        self.inner.forget_checksums()
    }
    fn finish(self: Box<Self>, durable: bool) -> Result<()> {
        // The inner writer is dropped unfinished: its checksums and a `.npy`'s real header are
        // `finalize`'s. Synced with `durable = true`, and on any filesystem not known to be
        // local (NFS, Lustre, GPFS, …): there a lost write (a full server, a quota, EIO) shows
        // only at `fsync` or at a close whose result a drop ignores, and closing an NFS file
        // waits for the server anyway. On a local disk with `durable = false` the next reader
        // (another process of the node: `finalize`) reads the page cache, and a tile that never
        // reached the file does not hold the bytes its journal records, which `finalize` says.
        // The sync wrote the whole output to disk inside the step there (4 GiB at the GPU
        // machine's 1.3 GB/s is about 3 s; a Dask task's 32768² f32 product took 6.5 s against
        // the command line's 2.5 s on one H100 with `durable = false`).
        let f = File::open(&self.path)
            .map_err(|e| Error::io(&self.path, "cannot open output to sync it", e))?;
        if durable || !crate::store::fsutil::on_local_disk(&f) {
            f.sync_all()
                .map_err(|e| Error::io(&self.path, "cannot sync output to disk", e))?;
        }
        // Tearing down a populated map's page tables takes a while (0.12 s for 4 GiB): not on
        // the way to `finalize`, which reads the file through the page cache anyway.
        let mapped = self.mapped();
        let inner = self.inner;
        if mapped {
            let spawned = std::thread::Builder::new()
                .name("mgmm-unmap".into())
                .spawn(move || drop(inner));
            // Without a thread, the writer was dropped with the closure: here, as before.
            drop(spawned);
        }
        Ok(())
    }
}
