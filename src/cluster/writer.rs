//! The output sink of one shard: the step's output (`.mgt` or `.npy`) reopened for `pwrite`,
//! whose `finish` only makes this process's writes durable (`fsync`, with `durable = true`),
//! leaving the checksums (a `.mgt`'s table, a `.npy`'s sidecar and its real header) to
//! `finalize` — a shard knows only its own tiles.

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
    /// Reopen the prepared output `path` (whose header must be `hdr`) for `pwrite`s.
    pub(crate) fn open(path: &Path, hdr: Header) -> Result<ShardWriter> {
        Ok(ShardWriter {
            inner: reopen_output(path, hdr, WriteMode::Pwrite)?,
            path: path.to_path_buf(),
        })
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
    fn prefault(&self, _b: &Block) -> u64 {
        0
    }
    fn counts_dirty_pages(&self) -> bool {
        self.inner.counts_dirty_pages()
    }
    fn write_mode(&self) -> &'static str {
        WriteMode::Pwrite.name()
    }
    fn flush_block(&self, _b: &Block) -> Result<()> {
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
        Ok(())
    }
}
