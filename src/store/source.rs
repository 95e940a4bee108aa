//! The seam between the pipeline and matrix storage: [`MatrixSource`] for inputs, [`MatrixSink`]
//! for outputs, and the [`Block`] they exchange.
//!
//! The pipeline reads and writes matrices only through these traits, so a new storage format
//! (a `.npy` array read in place, a raw binary file, a remote store) plugs in by implementing
//! them and adding a case to [`open_source`], without touching the stages. The `.mgt` tiled file
//! ([`super::TiledFile`], [`super::TiledWriter`]) is the first implementation. Every method takes
//! `&self` and the traits are `Send + Sync`: several stage threads share one source or sink, and
//! callers guarantee that concurrent writes go to disjoint blocks.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::dtype::DType;
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
    /// Block `b` as rectangles of the file's read-only map, for a device to copy straight from
    /// the page cache (`engine.staging`, [`crate::pipeline::direct`]); `None` where the format
    /// cannot give them (another dtype than `host`, a source without a map of its own).
    fn mapped_block(&self, _b: &Block, _host: DType) -> Option<MappedBlock<'_>> {
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
    pub(crate) runs: Vec<super::runs::Run>,
    /// The file ranges that hold the runs, one per storage tile: page-aligned, disjoint, and
    /// the same for every block that touches the tile.
    pub(crate) spans: Vec<std::ops::Range<u64>>,
    /// The file's tile data (`data_offset` to the end of the last tile) and the bytes from one
    /// storage tile to the next: spans are `stride` apart from `data.start`, so ranges of whole
    /// consecutive tiles can be page-locked together.
    pub(crate) data: std::ops::Range<u64>,
    pub(crate) stride: u64,
    /// The whole file's map (page-aligned; index = file offset).
    pub(crate) map: &'a [u8],
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
    /// Complete the file (checksum table, trailer) and, if `durable`, sync it to disk.
    fn finish(self: Box<Self>, durable: bool) -> Result<()>;
}

/// Open a matrix file for reading, choosing the implementation by its first bytes: `.mgt`
/// (`MGMTILE1`) or `.npy` (`\x93NUMPY`). A raw binary file has no header and must be described
/// ([`SourceSpec::Raw`]).
pub fn open_source(path: &Path) -> Result<Arc<dyn MatrixSource>> {
    let meta =
        std::fs::metadata(path).map_err(|e| Error::io(path, "cannot open matrix file", e))?;
    if !meta.is_file() {
        return Err(Error::format(path, "is not a regular file"));
    }
    let mut magic = [0u8; 8];
    let n = std::fs::File::open(path)
        .and_then(|f| {
            use std::os::unix::fs::FileExt;
            f.read_at(&mut magic, 0)
        })
        .map_err(|e| Error::io(path, "cannot open matrix file", e))?;
    if n >= 6 && &magic[..6] == b"\x93NUMPY" {
        return Ok(Arc::new(super::npy_source::open(path)?));
    }
    if n == 8 && &magic == b"MGMTILE1" {
        return Ok(Arc::new(super::TiledFile::open(path)?));
    }
    Err(Error::format(
        path,
        "wrong magic: neither a .mgt file (MGMTILE1) nor a .npy array (\\x93NUMPY); a raw binary matrix must be declared with format = \"raw\", rows, cols and dtype (in a plan), or as raw:rows=R,cols=C,dtype=f32:PATH (on the command line)",
    ))
}

/// A dense C-order `rows × cols` matrix of `dtype` stored at byte `offset` of `path`, the rest
/// of the file being anything (an `np.memmap`'s region, handed in by the Python package): read
/// in place as a row-major source, so its blocks take the same paths as a `.npy` file's (band
/// reads from disk, uploads straight from the page cache).
pub fn open_region(
    path: &Path,
    (rows, cols): (u64, u64),
    dtype: crate::dtype::DType,
    offset: u64,
) -> Result<Arc<dyn MatrixSource>> {
    if rows == 0 || cols == 0 {
        return Err(Error::format(
            path,
            format!("the matrix at offset {offset} is empty ({rows}×{cols})"),
        ));
    }
    let spec = super::rowmajor::RowMajorSpec {
        rows,
        cols,
        dtype,
        data_offset: offset,
        transposed: false,
        kind: "file region".into(),
        region: true,
    };
    Ok(Arc::new(super::rowmajor::RowMajorFile::open(
        path, spec, None,
    )?))
}

/// What `info --check` found in a `.npy` or raw file ([`inspect`]).
pub(crate) enum Checked {
    /// Every tile matches: the `check:` line.
    Ok(String),
    /// Nothing to check against (no checksums, or a sidecar that does not fit): why.
    NotPossible(Error),
    /// The storage tiles that do not match their checksums, in tile order.
    Corrupt(Vec<Error>),
}

/// Every storage tile of `s` checked against its stored checksum, in parallel: the mismatches,
/// in tile order (other errors, such as a failed read, are returned as such).
pub(crate) fn bad_tiles(s: &dyn MatrixSource) -> Result<Vec<Error>> {
    use rayon::prelude::*;
    let Some((tr, tc)) = s.checksum_tile() else {
        return Ok(Vec::new());
    };
    let (rows, cols) = s.shape();
    let gc = cols.div_ceil(tc);
    let found: Vec<Option<Error>> = (0..rows.div_ceil(tr) * gc)
        .into_par_iter()
        .map(|i| {
            let (ti, tj) = (i / gc, i % gc);
            let b = Block {
                r0: ti * tr,
                c0: tj * tc,
                rows: tr.min(rows - ti * tr),
                cols: tc.min(cols - tj * tc),
            };
            match s.verify_block(&b) {
                Ok(()) => Ok(None),
                Err(e @ Error::Checksum { .. }) => Ok(Some(e)),
                Err(e) => Err(e),
            }
        })
        .collect::<Result<_>>()?;
    Ok(found.into_iter().flatten().collect())
}

/// `info` for anything that is not a `.mgt` file (`None` for a `.mgt`, which the caller prints
/// from its header): a `.npy` array or a `raw:…` descriptor, described, and with `check` every
/// sidecar tile's CRC verified. The description comes back whatever the check finds, so that it
/// is printed before the check's verdict (`None` without `check`).
pub(crate) fn inspect(arg: &Path, check: bool) -> Result<Option<(String, Option<Checked>)>> {
    let spec = SourceSpec::parse_arg(&arg.to_string_lossy())?;
    if let SourceSpec::File(p) = &spec {
        // Opening a FIFO for reading would wait for a writer forever.
        if std::fs::metadata(p).is_ok_and(|m| !m.is_file()) {
            return Err(Error::format(p, "is not a regular file"));
        }
        let mut magic = [0u8; 8];
        let is_mgt = std::fs::File::open(p)
            .and_then(|f| {
                use std::os::unix::fs::FileExt;
                f.read_at(&mut magic, 0)
            })
            .is_ok_and(|n| n == 8 && &magic == b"MGMTILE1");
        if is_mgt {
            return Ok(None);
        }
    }
    let s = spec.open()?;
    let out = s.describe();
    if !check {
        return Ok(Some((out, None)));
    }
    if s.checksum_tile().is_none() {
        // A sidecar that is there but does not fit says why it was ignored.
        let why = match (s.checksum_note(), &spec) {
            (Some(note), _) => format!(
                "its {note}; nothing to check (delete the sidecar if the array was changed on purpose)"
            ),
            (None, SourceSpec::Raw(_)) => "a raw file has no checksums; nothing to check".into(),
            (None, _) => "has no checksums (only .npy files written by `run` have a sidecar of tile CRCs); nothing to check".into(),
        };
        let e = Error::format(spec.path(), why);
        return Ok(Some((out, Some(Checked::NotPossible(e)))));
    }
    let t = std::time::Instant::now();
    let bad = bad_tiles(s.as_ref())?;
    let checked = match bad.is_empty() {
        true => Checked::Ok(format!(
            "check:       all tiles OK ({:.2} s)\n",
            t.elapsed().as_secs_f64()
        )),
        false => Checked::Corrupt(bad),
    };
    Ok(Some((out, Some(checked))))
}

/// Where a matrix comes from: a self-describing file (`.mgt`, `.npy`), or a raw binary file
/// and its declared layout.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum SourceSpec {
    File(PathBuf),
    Raw(super::raw::RawSpec),
}

impl SourceSpec {
    /// A command-line argument: `raw:rows=R,cols=C,dtype=D[,order=F][,offset=N]:PATH`, or a path.
    pub(crate) fn parse_arg(arg: &str) -> Result<SourceSpec> {
        match arg.strip_prefix("raw:") {
            Some(rest) => Ok(SourceSpec::Raw(super::raw::RawSpec::parse_arg(rest)?)),
            None => Ok(SourceSpec::File(PathBuf::from(arg))),
        }
    }
    pub(crate) fn path(&self) -> &Path {
        match self {
            SourceSpec::File(p) => p,
            SourceSpec::Raw(r) => &r.path,
        }
    }
    pub(crate) fn open(&self) -> Result<Arc<dyn MatrixSource>> {
        match self {
            SourceSpec::File(p) => open_source(p),
            SourceSpec::Raw(r) => Ok(Arc::new(r.open()?)),
        }
    }
}

/// What an output file holds: chosen by the output path's extension (`.npy`, else `.mgt`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OutputFormat {
    Mgt,
    Npy,
}

impl OutputFormat {
    pub(crate) fn of(path: &Path) -> OutputFormat {
        match path.extension().and_then(|e| e.to_str()) {
            Some(e) if e.eq_ignore_ascii_case("npy") => OutputFormat::Npy,
            _ => OutputFormat::Mgt,
        }
    }
}

/// Bytes the output `path` with (`.mgt`-style) header `hdr` takes on disk, sidecar included.
pub(crate) fn output_file_len(path: &Path, hdr: &super::Header) -> u64 {
    match OutputFormat::of(path) {
        OutputFormat::Mgt => hdr.file_len(),
        OutputFormat::Npy => super::npy_sink::file_len(hdr),
    }
}

/// The length the output file `path` itself has once complete: [`output_file_len`] less a
/// `.npy`'s checksum sidecar, which is another file.
pub(crate) fn output_main_len(path: &Path, hdr: &super::Header) -> u64 {
    match OutputFormat::of(path) {
        OutputFormat::Mgt => hdr.file_len(),
        OutputFormat::Npy => super::npy_sink::npy_len(hdr),
    }
}

/// Create the output `path` for the matrix `hdr` describes (its shape, dtype and storage tile;
/// a `.npy` output keeps the tile for its checksum sidecar).
pub(crate) fn create_output(
    path: &Path,
    hdr: super::Header,
    mode: WriteMode,
) -> Result<Box<dyn MatrixSink>> {
    Ok(match OutputFormat::of(path) {
        OutputFormat::Mgt => Box::new(super::TiledWriter::create_with(path, hdr, mode)?),
        OutputFormat::Npy => Box::new(super::npy_sink::NpyWriter::create(path, &hdr, mode)?),
    })
}

/// Reopen the partly written output `path` to resume it; it must match `hdr`.
pub(crate) fn reopen_output(
    path: &Path,
    hdr: super::Header,
    mode: WriteMode,
) -> Result<Box<dyn MatrixSink>> {
    Ok(match OutputFormat::of(path) {
        OutputFormat::Mgt => Box::new(super::TiledWriter::reopen_with(path, hdr, mode)?),
        OutputFormat::Npy => Box::new(super::npy_sink::NpyWriter::reopen(path, &hdr, mode)?),
    })
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
/// Measured (BENCHMARKS.md §12, §15): over the limit the map lost — the 43 GB chain on one
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

    /// A matrix in the middle of a file (an `np.memmap`'s region) reads in place, block by
    /// block, and has a map a device can copy from; a region past the file's end is refused
    /// with the file named, as is an empty one.
    #[test]
    fn a_file_region_reads_in_place() {
        use crate::dtype::DType;
        use crate::store::{open_region, Block};
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("region.bin");
        let (rows, cols, off) = (7u64, 5u64, 24u64);
        let vals: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.5 - 3.0).collect();
        let mut bytes = vec![0xabu8; off as usize];
        bytes.extend(vals.iter().flat_map(|v| v.to_le_bytes()));
        bytes.extend([0xcd; 9]);
        std::fs::write(&p, &bytes).unwrap();
        let s = open_region(&p, (rows, cols), DType::F32, off).unwrap();
        assert_eq!(
            (s.shape(), s.dtype(), s.transposed()),
            ((rows, cols), DType::F32, false)
        );
        let b = Block {
            r0: 2,
            c0: 1,
            rows: 4,
            cols: 3,
        };
        let mut dst = vec![0u8; 4 * 3 * 4];
        s.read_block(&b, DType::F32, &mut dst).unwrap();
        let got: Vec<f32> = dst
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let want: Vec<f32> = (2..6)
            .flat_map(|r| (1..4).map(move |c| (r * cols + c) as f32 * 0.5 - 3.0))
            .collect();
        assert_eq!(got, want);
        assert!(s.mapped_block(&b, DType::F32).is_some());
        // The journal identity reads the region, not the bytes before it (a region deep in a
        // large file would read them all): a changed prefix byte, same length and modification
        // time, leaves it; a changed byte of the region does not.
        let id = s.identity();
        let t = std::fs::metadata(&p).unwrap().modified().unwrap();
        let rewrite = |at: usize, v: u8| {
            let mut b = std::fs::read(&p).unwrap();
            b[at] = v;
            std::fs::write(&p, &b).unwrap();
            std::fs::File::options()
                .write(true)
                .open(&p)
                .unwrap()
                .set_modified(t)
                .unwrap();
            open_region(&p, (rows, cols), DType::F32, off)
                .unwrap()
                .identity()
        };
        assert_eq!(
            rewrite(3, 0x11),
            id,
            "the prefix is not part of the identity"
        );
        assert_ne!(
            rewrite(off as usize, 0x11),
            id,
            "the region's first bytes are"
        );
        let too_long = open_region(&p, (rows + 1, cols), DType::F32, off)
            .err()
            .unwrap();
        assert!(too_long.to_string().contains("region.bin"), "{too_long}");
        assert!(open_region(&p, (0, cols), DType::F32, off).is_err());
    }
}
