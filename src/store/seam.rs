//! The seam between the pipeline and matrix storage: [`MatrixSource`] for inputs, [`MatrixSink`]
//! for outputs, and how a sink writes ([`WriteMode`]).
//!
//! The pipeline reads and writes matrices only through these traits, so a new storage format
//! (a `.npy` array read in place, a raw binary file, a remote store) plugs in by implementing
//! them and adding a case to [`super::open_source`] or [`super::output`], without touching the
//! stages. The `.mgt` tiled file ([`super::TiledFile`], [`super::TiledWriter`]) is the first
//! implementation. Every method takes `&self` and the traits are `Send + Sync`: several stage
//! threads share one source or sink, and callers guarantee that concurrent writes go to
//! disjoint blocks.
//!
//! Below the formats and the dispatch that opens them (`source`, `output`), above the block and
//! its runs ([`super::block`], [`super::runs`]): every format imports this file, and it imports
//! none of them.

use std::path::Path;

use super::block::Block;
use super::runs::Run;
use crate::dtype::DType;
use crate::error::{Error, Result};

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
    /// What the pipeline's staging does with every input block: [`verify_block`] when
    /// `verify`, [`read_block`], and the count of NaN and Inf elements read (returned).
    /// Formats may do the three in one pass over the data ([`super::TiledFile`] does); this
    /// default runs them one after another.
    ///
    /// [`verify_block`]: Self::verify_block
    /// [`read_block`]: Self::read_block
    fn read_staged(&self, b: &Block, host: DType, dst: &mut [u8], verify: bool) -> Result<u64> {
        read_staged_in_passes(self, b, host, dst, verify)
    }
    /// What identifies the data for the resume journal's fingerprint: a journal written against
    /// a source with a different identity is not resumed. Cheap (no pass over the data).
    fn identity(&self) -> String;
    /// True for a chain's intermediate that the engine holds in host memory instead of a file:
    /// the report tells its bytes apart from file reads. (Arrays handed in by the Python
    /// package are not counted so: they may be memory maps of files.)
    fn in_memory(&self) -> bool {
        false
    }
    /// False for an array the caller hands in (the Python package's host and GPU arrays): the
    /// summary then says it read arrays, not files.
    fn is_file(&self) -> bool {
        true
    }
    /// Block `b` as rectangles of the file's read-only map, for a device to copy straight from
    /// the page cache (`engine.staging`, [`crate::pipeline::direct`]); `None` where the format
    /// cannot give them (another dtype than `host`, a source without a map of its own).
    fn mapped_block(&self, _b: &Block, _host: DType) -> Option<MappedBlock<'_>> {
        None
    }
    /// Block `b` as a rectangle of GPU memory, for a GPU lane to copy device to device (an
    /// array already on a GPU, handed in by the Python package); `None` for files and host
    /// memory, and where the stored dtype is not `host`. Such a block is not staged, checked or
    /// counted on the host: [`Self::read_block`] stays the way for everything else (a CPU lane,
    /// a conversion), through the host.
    fn device_block(&self, _b: &Block, _host: DType) -> Option<DeviceBlock> {
        None
    }
    /// For a block a device copies from the map ([`Self::mapped_block`]): what
    /// [`Self::read_staged`] checks without its copy — the checksums when `verify`, and the
    /// count of NaN and Inf elements (returned). Formats without a map never get here; the
    /// default checks and counts nothing more than [`Self::verify_block`].
    fn scan_mapped(&self, b: &Block, _host: DType, verify: bool) -> Result<u64> {
        if verify {
            self.verify_block(b)?;
        }
        Ok(0)
    }
    /// Where block `b`'s storage tiles lie, for a device to check the block it copied from the
    /// map ([`crate::backend::check`]); `None`: the host checks it ([`Self::scan_mapped`]).
    fn device_check_spec(&self, _b: &Block, _host: DType) -> Option<crate::seam::DeviceCheckSpec> {
        None
    }
    /// [`Self::scan_mapped`]'s verdict from a device's results for
    /// [`Self::device_check_spec`]: `[crc, nonfinite]` per storage tile. Returns the NaN/Inf
    /// count, or the error a checksum mismatch gives.
    fn settle_device_check(
        &self,
        b: &Block,
        host: DType,
        verify: bool,
        _results: &[[u32; 2]],
    ) -> Result<u64> {
        self.scan_mapped(b, host, verify)
    }
    /// True when the file stores the transpose of the matrix it holds (a Fortran-order `.npy`,
    /// a raw file with `order = "F"`): [`shape`](Self::shape) and blocks are those of the stored
    /// row-major transpose, and the plan reads the operand with `.T` flipped (no copy is made).
    fn transposed(&self) -> bool {
        false
    }
    /// The tile grid [`verify_block`](Self::verify_block) checks, when the file has checksums.
    fn checksum_tile(&self) -> Option<(u64, u64)> {
        None
    }
    /// Why checksums beside the file were not used (a `.npy` sidecar that does not fit it).
    fn checksum_note(&self) -> Option<&str> {
        None
    }
    /// What `info` prints about the file (several `key: value` lines).
    fn describe(&self) -> String {
        let (r, c) = self.shape();
        format!(
            "file:        {}\nshape:       {r} × {c}\ndtype:       {}\n",
            self.path().display(),
            self.dtype()
        )
    }
}

/// A block of a source as rectangles of its read-only file map ([`MatrixSource::mapped_block`]).
pub struct MappedBlock<'a> {
    /// The block's runs, whole (not split by I/O size), in file offsets.
    pub(crate) runs: Vec<Run>,
    /// The file ranges that hold the runs, one per storage tile: page-aligned, disjoint, and
    /// the same for every block that touches the tile.
    pub(crate) spans: Vec<std::ops::Range<u64>>,
    /// The file's tile data (`data_offset` to the end of the last tile) and the bytes from one
    /// storage tile to the next: spans are `stride` apart from `data.start`, so ranges of whole
    /// consecutive tiles can be page-locked together.
    pub(crate) data: std::ops::Range<u64>,
    pub(crate) stride: u64,
    /// The whole file's read-only map (page-aligned; index = file offset).
    pub(crate) map: &'a [u8],
    /// Whether the spans are bands of whole rows (a row-major file: `.npy`, raw), so that they
    /// hold the file's whole width whatever the block's ([`crate::pipeline::direct`] copies a
    /// narrow block of such a file under `auto`); false for a `.mgt`'s storage tiles.
    pub(crate) whole_rows: bool,
    /// Whether `mincore` tells this file's cached pages ([`super::fsutil::mincore_tells`]):
    /// where it does not, [`Self::cached`] says nothing is.
    pub(crate) cache_known: bool,
}

impl MappedBlock<'_> {
    /// Whether at least `fraction` of the pages of bytes `span` of the file are in the page
    /// cache ([`super::fsutil::resident`]); false where `mincore` cannot tell.
    pub(crate) fn cached(&self, span: std::ops::Range<u64>, fraction: f64) -> bool {
        self.cache_known && super::fsutil::resident(self.map, span, fraction)
    }

    /// [`Self::cached`] judged from `samples` pages of `span` ([`super::fsutil::resident_sampled`]).
    pub(crate) fn cached_sampled(&self, span: std::ops::Range<u64>, samples: u64) -> bool {
        self.cache_known && super::fsutil::resident_sampled(self.map, span, samples)
    }
}

/// A block of a matrix in GPU memory ([`MatrixSource::device_block`]): `rows` rows of
/// `row_len` bytes, `pitch` bytes apart from `addr`, a unified (UVA) address that every GPU of
/// the process can copy from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBlock {
    /// The block's first element (a unified address).
    pub addr: u64,
    /// Bytes from one row of the block to the next.
    pub pitch: usize,
    /// Bytes of one row of the block.
    pub row_len: usize,
    /// Rows of the block.
    pub rows: usize,
    /// The GPU whose memory holds it.
    pub device: usize,
}

/// CRC-32C of block `b` of `src` read as `dt` — the block's bytes row by row, what a journal
/// records for a written tile — read in bands of whole rows (8 MiB, or one row where a row is
/// longer) on the rayon pool, each into a buffer its thread keeps from band to band and block to
/// block, and combined in order. A block is checked without being held whole in memory:
/// `finalize` checks every tile of an output at once, and one buffer per tile (4 GiB for a
/// 32768² f32 output) cost a page fault per 4 KiB before the read.
pub(crate) fn block_crc<S: MatrixSource + ?Sized>(src: &S, b: &Block, dt: DType) -> Result<u32> {
    use rayon::prelude::*;
    use std::cell::RefCell;
    thread_local! {
        static BAND_BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    }
    const BAND: u64 = 8 << 20;
    let rows = (BAND / (b.cols * dt.size() as u64).max(1)).max(1);
    let bands: Vec<Block> = (0..b.rows.div_ceil(rows))
        .map(|i| Block {
            r0: b.r0 + i * rows,
            c0: b.c0,
            rows: rows.min(b.rows - i * rows),
            cols: b.cols,
        })
        .collect();
    let parts: Vec<Result<(u32, usize)>> = bands
        .par_iter()
        .map(|band| {
            // Taken out of the cell for the read, not borrowed through it: the read may run
            // rayon work of its own, and this thread may take another band meanwhile.
            let mut buf = BAND_BUF.take();
            buf.resize(band.elems() * dt.size(), 0);
            let r = src.read_block(band, dt, &mut buf);
            let out = r.map(|()| (crc32c::crc32c(&buf), buf.len()));
            BAND_BUF.set(buf);
            out
        })
        .collect();
    parts.into_iter().try_fold(0u32, |acc, p| {
        let (crc, len) = p?;
        Ok(crc32c::crc32c_combine(acc, crc, len))
    })
}

/// [`MatrixSource::read_staged`] as three passes: checksums, the read (converting), the
/// NaN/Inf count over what was read. The default, and what one-pass readers fall back to when
/// the block is converted to another dtype.
pub(crate) fn read_staged_in_passes<S: MatrixSource + ?Sized>(
    src: &S,
    b: &Block,
    host: DType,
    dst: &mut [u8],
    verify: bool,
) -> Result<u64> {
    if verify {
        src.verify_block(b)?;
    }
    src.read_block(b, host, dst)?;
    Ok(crate::dtype::count_nonfinite_par(host, dst))
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
    /// Let go of block `b`'s storage once it is written (drop its pages from the process's
    /// map) if [`Self::release_written`] asked for it, so resident memory does not grow with
    /// the output. A hint: returns bytes released, 0 where it does not apply.
    fn release(&self, _b: &Block) -> u64 {
        0
    }
    /// Whether [`Self::release`] lets go of written blocks (off by default). Sinks that cannot
    /// ignore it; `write = "auto"` maps an output larger than `host_memory` only for a sink
    /// that can (a `.mgt` output, [`WriteMode::resolve`]).
    fn release_written(&self, _on: bool) {}
    /// Make the bytes of block `b` durable (before the journal records it).
    fn flush_block(&self, b: &Block) -> Result<()>;
    /// Whether written bytes become dirty pages of a disk-backed file, which the kernel lets
    /// pile up only to its dirty limit ([`super::fsutil::DirtyLimits`]); false for memory and
    /// for memory filesystems (tmpfs).
    fn counts_dirty_pages(&self) -> bool {
        false
    }
    /// How blocks reach the output, for the report: `"mmap"` (copied through a writable map
    /// whose pages the outprep threads create in parallel), `"pwrite"`, or `"memory"`.
    fn write_mode(&self) -> &'static str {
        "memory"
    }
    /// Forget what the sink learnt about blocks written so far (after a resume reopened a
    /// partially written output whose earlier contents it did not see being written).
    fn forget_checksums(&self);
    /// Tell the sink the CRC-32C of block `b`'s bytes as they lie in the file (in the stored
    /// dtype, row by row, as [`Self::write_block`] returns it), which the caller has just read
    /// and checked (`finalize`, against the shards' journals): `finish` then takes a storage
    /// tile that is exactly `b` from it instead of reading the tile again. A hint: a sink
    /// without a checksum table ignores it.
    fn know_checksum(&self, _b: &Block, _crc: u32) {}
    /// Where a lane may write block `b`, computed in `host`, itself: the block's rectangle in
    /// memory the sink writes in place anyway (an array handed in as `out=`), when it is stored
    /// as `host` (no conversion). `None` (the default: files, which checksum, convert and
    /// prefault what they write): the block goes through an output buffer and
    /// [`Self::write_block`]. A block written there is then announced with
    /// [`Self::wrote_in_place`] instead of written. The rectangle is made with the unsafe
    /// [`OutRect::new`](crate::seam::OutRect::new): the sink vouches that the memory is its
    /// block's, alive and written by no one else while the step runs.
    fn direct_rect(&self, _b: &Block, _host: DType) -> Option<crate::seam::OutRect> {
        None
    }
    /// Block `b` was written straight into [`Self::direct_rect`]'s rectangle (the copy is
    /// done): return its CRC-32C as [`Self::write_block`] would.
    fn wrote_in_place(&self, b: &Block) -> Result<u32> {
        Err(Error::Usage(format!(
            "{}: block at ({}, {}) was written in place, which this output never offered (a bug)",
            self.path().display(),
            b.r0,
            b.c0
        )))
    }
    /// Complete the file (checksum table, trailer) and, if `durable`, sync it to disk.
    fn finish(self: Box<Self>, durable: bool) -> Result<()>;
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
/// mapped pages then stay within the memory the plan grants) or when the sink drops each
/// written tile from its map ([`MatrixSink::release_written`]: a `.mgt` output, whose map then
/// holds only the tiles in flight), else `Pwrite`, so an output larger than the budget never
/// makes the process's resident memory grow with it. And `Pwrite` for an output on disk, not
/// flushed tile by tile (`durable = false`), larger than the kernel's limit for dirty pages,
/// where writers through the map are made to wait for the disk. One thread's `pwrite`s create
/// page-cache pages at 3–4 GB/s and `pwrite`s to one file serialise on its inode lock, while
/// the map's pages are created by the outprep threads in parallel: on two H200s 60000² fp64
/// (a 34 GB file, `host_memory = "32GiB"`) was bound by the one `pwrite` writer at 2.9 GB/s.
/// Measured (docs/decisions/0003-write-auto.md): over the limit the map lost — the 43 GB chain on one
/// H200's machine (limit about 25 GiB) 16.6–20.0 s against 13.6–16.2 s with `pwrite` (bar two
/// slow first runs), a 5 GiB output on the 2-core development VM (limit about 4.8 GB)
/// 11.9–17.4 s against 5.4–13.8 s (median 10.1); under it the map won — on two H200s (limit
/// estimated near 48 GB) the 43 GB chain 8.0 s against 13.1 s and 60000² fp64 (28.8 GB) 9.6 s
/// against 20.8 s, on the VM a 2 GiB output 1.3–1.9 s against 3.4–4.6 s.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WriteMode {
    #[default]
    /// Chosen by the file size and the host budget.
    Auto,
    /// Through a shared memory map.
    Mmap,
    /// With `pwrite`.
    Pwrite,
}

impl WriteMode {
    /// The concrete mode for an output of `output_bytes` under a host budget of `host_memory`.
    /// `dirty_limit`: the kernel's limit for dirty pages, for an output on disk written with
    /// `durable = false` (else `None`). `releases`: the sink drops written tiles from its map
    /// ([`MatrixSink::release_written`]), so the map's resident memory does not grow with the
    /// output.
    pub(crate) fn resolve(
        self,
        output_bytes: u64,
        host_memory: u64,
        dirty_limit: Option<u64>,
        releases: bool,
    ) -> WriteMode {
        let under_limit = dirty_limit.is_none_or(|l| output_bytes <= l);
        let fits = output_bytes <= host_memory || releases;
        match self {
            WriteMode::Auto if fits && under_limit => WriteMode::Mmap,
            WriteMode::Auto => WriteMode::Pwrite,
            m => m,
        }
    }
    /// The mode a file writer that writes with `pwrite` (or not: through its map) uses.
    pub(crate) fn of_file(pwrite: bool) -> WriteMode {
        if pwrite {
            WriteMode::Pwrite
        } else {
            WriteMode::Mmap
        }
    }
    /// The plan's spelling (`"auto"`, `"mmap"`, `"pwrite"`), also what the report says.
    pub(crate) fn name(self) -> &'static str {
        match self {
            WriteMode::Auto => "auto",
            WriteMode::Mmap => "mmap",
            WriteMode::Pwrite => "pwrite",
        }
    }
    pub(crate) fn parse(s: &str) -> Option<WriteMode> {
        match s {
            "auto" => Some(WriteMode::Auto),
            "mmap" => Some(WriteMode::Mmap),
            "pwrite" => Some(WriteMode::Pwrite),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::WriteMode::{self, *};

    /// `auto` maps an output that fits the host budget (or whose sink releases written tiles)
    /// and, on disk without `durable`, the kernel's limit for dirty pages; anything else is
    /// written with `pwrite`. An explicit mode stays.
    #[test]
    fn auto_maps_only_outputs_under_the_budget_and_the_dirty_threshold() {
        let gib = 1u64 << 30;
        assert_eq!(Auto.resolve(4 * gib, 16 * gib, None, false), Mmap);
        assert_eq!(Auto.resolve(4 * gib, 16 * gib, Some(12 * gib), false), Mmap);
        assert_eq!(
            Auto.resolve(20 * gib, 32 * gib, Some(12 * gib), false),
            Pwrite
        );
        assert_eq!(Auto.resolve(20 * gib, 16 * gib, None, false), Pwrite);
        assert_eq!(Mmap.resolve(20 * gib, 16 * gib, Some(gib), false), Mmap);
        assert_eq!(WriteMode::Pwrite.resolve(1, 16 * gib, None, false), Pwrite);
        // A sink that releases written tiles: the budget no longer decides, the dirty limit does.
        assert_eq!(Auto.resolve(34 * gib, 32 * gib, Some(49 * gib), true), Mmap);
        assert_eq!(Auto.resolve(20 * gib, 16 * gib, None, true), Mmap);
        assert_eq!(
            Auto.resolve(43 * gib, 16 * gib, Some(25 * gib), true),
            Pwrite
        );
        assert_eq!(WriteMode::Pwrite.resolve(1, 16 * gib, None, true), Pwrite);
    }
}
