//! A dense row-major matrix read in place: the [`MatrixSource`] behind `.npy` arrays and raw
//! binary files, so that data where users keep it needs no import pass.
//!
//! The file is one storage tile holding the whole matrix ([`Geometry::row_major`]). A row panel
//! (a block of whole rows) is one contiguous range; a column panel is strided, one segment per
//! row. Measured on the development VM, cold 32 KiB strided segments ran at 0.25 GB/s against
//! 1.4 GB/s for contiguous bands, so a strided run whose segments are short and cover a large
//! part of the file span is read as its whole band (`pread`s of ≤ [`IO_SPAN`] bytes, many in
//! flight on the rayon pool) and sliced in memory — unless its pages are already in the page
//! cache (checked with `mincore`), where slicing would only copy more. Readahead advice covers
//! the same band, so the other column panels of that band are then read from memory (copied out
//! of the file's map, where the cache holds the file: [`ReadFrom`]). A step
//! reads every column panel of its inputs, so when the page cache can likely hold the whole
//! file (at most half of the kernel's `MemAvailable` when it is opened), a band read first is
//! rarely wasted: later panels find it resident, unless other inputs and the output push it
//! out first (each file is judged alone). Then every short strided run is read as its band,
//! whatever the fraction (50000² f32 from a cold `.npy`, 32 KiB segments of 195 KiB rows, fell
//! under the fraction and took 18.9 s against 13.5 s as bands, docs/measurements/HISTORY.md §13).
//!
//! A file stored column-major (a Fortran-order `.npy`, a raw file with `order = "F"`) holds the
//! row-major transpose of the declared matrix: the source reports that stored shape and
//! [`MatrixSource::transposed`], and the plan reads the operand with `.T` flipped, so nothing is
//! copied. Integrity: `.npy` files written by `run` carry per-tile CRCs in a sidecar
//! ([`super::npy_sink`]), checked like a `.mgt` table; other files have none, and the journal
//! identifies them by size, modification time and a sample CRC ([`RowMajorFile::identity`]).
//!
//! Memory-map safety: as for `.mgt` inputs (see [`super::tiled`]), the read-only map relies on
//! the documented rule that inputs are not modified or truncated while a job runs.

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use memmap2::{Advice, Mmap, MmapOptions};
use rayon::prelude::*;

use super::block::Block;
use super::blockio::{convert_par, read_runs_with, supported, ReadFrom};
use super::runs::{runs, Geometry, Run, IO_SPAN};
use super::seam::{read_staged_in_passes, MappedBlock, MatrixSource};
use super::sidecar::{clip_tile, sidecar_path, TileCrcs};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::units::fmt_bytes_exact;

/// Strided segments shorter than this are candidates for whole-band reads.
const SHORT_SEGMENT: usize = 64 << 10;
/// A band read pays off when the wanted bytes are at least this fraction of the band
/// (0.25 / 1.4 GB/s measured, rounded down).
const BAND_FRACTION: f64 = 1.0 / 6.0;
/// Size of each sample of the identity CRC, and how many samples.
const SAMPLE: u64 = 64 << 10;
const SAMPLES: u64 = 8;

/// Where a row-major matrix lies and what it is.
#[derive(Clone, Debug)]
pub(crate) struct RowMajorSpec {
    /// Stored (row-major) shape.
    pub(crate) rows: u64,
    pub(crate) cols: u64,
    pub(crate) dtype: DType,
    pub(crate) data_offset: u64,
    /// The file stores the declared matrix's transpose (Fortran / column-major order).
    pub(crate) transposed: bool,
    /// How the format is described in `info` and in the journal identity (".npy v1.0", "raw").
    pub(crate) kind: String,
    /// The matrix is a region of a larger file (an `np.memmap`'s): the bytes before and after
    /// it are not its header, so the identity neither reads them nor samples them.
    pub(crate) region: bool,
}

/// The bytes of a band of rows (about: a whole number of rows and of pages), the unit the
/// direct path groups into its registrations (`pipeline::direct`'s chunks, 32 MiB, or an
/// eighth of a smaller lock budget), as a `.mgt`'s storage tiles are.
const BAND: u64 = 1 << 20;

/// Page size the bands are multiples of (the direct path aligns registrations to it).
const PAGE: u64 = 4096;

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// A row-major matrix file opened for reading.
pub(crate) struct RowMajorFile {
    path: PathBuf,
    file: File,
    map: Mmap,
    spec: RowMajorSpec,
    geo: Geometry,
    len: u64,
    mtime_ns: i128,
    crcs: Option<TileCrcs>,
    /// Why a sidecar beside the file was not used (`info --check` says so).
    checksum_note: Option<String>,
    verified: OnceLock<Vec<AtomicBool>>,
    /// The page cache can likely hold the whole file (module doc): band reads are rarely wasted.
    cache_holds_file: bool,
    /// `mincore` tells which of the file's pages are cached ([`crate::store::fsutil::mincore_tells`]):
    /// where it does not, no page counts as cached.
    mincore_tells: bool,
    /// Whole bands of rows already advised (`will_need`), when the cache holds the file: every
    /// block of a band of rows advises the band's whole span, and a row-major A read in k-blocks
    /// asked for its bands again and again — 151.6 GB advised for 22.7 GB read at 53248² on an
    /// H200 (issue 35), 4.4 GB for 0.54 GB here (`store::rowmajor` test). Their pages stay
    /// cached, so once is enough.
    advised: std::sync::Mutex<Vec<std::ops::Range<u64>>>,
}

impl RowMajorFile {
    /// Open `path` holding `spec`; the file must be at least as long as the data. `crcs`, when
    /// given, must describe this shape (the caller validated the sidecar).
    pub(crate) fn open(
        path: &Path,
        spec: RowMajorSpec,
        crcs: Option<TileCrcs>,
    ) -> Result<RowMajorFile> {
        let file = File::open(path).map_err(|e| Error::io(path, "cannot open matrix file", e))?;
        let meta = file
            .metadata()
            .map_err(|e| Error::io(path, "cannot stat matrix file", e))?;
        if !meta.is_file() {
            return Err(Error::format(path, "is not a regular file"));
        }
        let len = meta.len();
        let need = data_end(&spec).ok_or_else(|| Error::format(path, "shape overflows"))?;
        if len < need {
            return Err(Error::format(
                path,
                format!(
                    "file is {len} bytes but {} {}×{} {} at offset {} needs {need}: truncated, or the declared shape is wrong",
                    spec.kind, spec.rows, spec.cols, spec.dtype, spec.data_offset
                ),
            ));
        }
        // SAFETY: read-only shared map of a regular file at most as long as it is now; inputs
        // are never written by the engine and must not be truncated while a job runs (module
        // doc). The map serves advice, residency checks, checksums, copies of cached runs
        // (`ReadFrom`) and direct uploads.
        let map = unsafe { MmapOptions::new().len(len as usize).map(&file) }
            .map_err(|e| Error::io(path, "cannot memory-map matrix file", e))?;
        let geo = Geometry::row_major(
            spec.rows,
            spec.cols,
            spec.dtype.size() as u64,
            spec.data_offset,
        );
        Ok(RowMajorFile {
            path: path.to_path_buf(),
            file,
            map,
            geo,
            len,
            mtime_ns: meta.mtime() as i128 * 1_000_000_000 + meta.mtime_nsec() as i128,
            spec,
            crcs,
            checksum_note: None,
            verified: OnceLock::new(),
            cache_holds_file: crate::store::fsutil::cache_holds(len),
            mincore_tells: crate::store::fsutil::mincore_tells(path, &meta),
            advised: Default::default(),
        })
    }

    /// The file with `note` saying why its sidecar of checksums was ignored.
    pub(crate) fn with_checksum_note(mut self, note: Option<String>) -> RowMajorFile {
        self.checksum_note = note;
        self
    }

    /// Whether the pages of file bytes `span` are (nearly all) in the page cache.
    fn resident(&self, span: std::ops::Range<u64>) -> bool {
        self.mincore_tells && crate::store::fsutil::resident(&self.map, span, 0.9)
    }

    /// Where blocks are read from: the file, and its map where the cache holds the file.
    fn from(&self) -> ReadFrom<'_> {
        ReadFrom::new(
            &self.file,
            &self.map,
            self.cache_holds_file && self.mincore_tells,
        )
    }

    /// A strided run whose whole file span is cheaper to read than its segments.
    fn band_worthy(&self, run: &Run) -> bool {
        !run.file_contiguous()
            && run.row_len < SHORT_SEGMENT
            && (self.cache_holds_file
                || run.row_len as f64 >= BAND_FRACTION * run.file_pitch as f64)
    }

    /// Read `rs` into `raw` (dense block, file dtype): band-worthy runs not in the page cache
    /// as whole bands sliced in memory, the rest by [`read_runs_with`]; with `count`, the NaN and
    /// Inf elements of that dtype (stored = host) are counted on each piece while it is in
    /// cache (0 with `None`).
    fn read_into(&self, rs: &[Run], raw: &mut [u8], count: Option<DType>) -> std::io::Result<u64> {
        let tally = |piece: &[u8]| count.map_or(0, |dt| crate::dtype::count_nonfinite(dt, piece));
        let (bands, rest): (Vec<Run>, Vec<Run>) = rs
            .iter()
            .partition(|r| self.band_worthy(r) && !self.resident(r.file_span()));
        let in_rest: u64 = read_runs_with(self.from(), &rest, raw, |_| 0, |n, p| *n += tally(p))?
            .into_iter()
            .sum();
        if bands.is_empty() {
            return Ok(in_rest);
        }
        let base = SendPtr(raw.as_mut_ptr());
        let raw_len = raw.len();
        let in_bands: u64 = bands
            .par_iter()
            .map_init(Vec::new, |scratch: &mut Vec<u8>, g| {
                let fs = g.file_span();
                scratch.resize((fs.end - fs.start) as usize, 0);
                self.file.read_exact_at(scratch, fs.start)?;
                let span = g.buf_span();
                assert!(span.end <= raw_len);
                // SAFETY: runs of one block cover disjoint bytes of the block buffer, `span`
                // lies inside it (asserted) and `raw` outlives the loop.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(base.get().add(span.start), span.len())
                };
                let mut n = 0;
                for r in 0..g.rows {
                    let f = r * g.file_pitch as usize;
                    let b = r * g.buf_pitch;
                    let row = &mut dst[b..b + g.row_len];
                    row.copy_from_slice(&scratch[f..f + g.row_len]);
                    n += tally(row);
                }
                Ok(n)
            })
            .sum::<std::io::Result<u64>>()?;
        Ok(in_rest + in_bands)
    }

    /// CRC-32C of storage tile (ti, tj) of the checksum grid, row by row from the map.
    fn tile_crc(&self, tile: (u64, u64), ti: u64, tj: u64) -> u32 {
        let b = clip_tile(&self.geo, tile, ti, tj);
        let es = self.geo.elem;
        let mut crc = 0;
        for r in b.r0..b.r0 + b.rows {
            let off = (self.geo.data_offset + (r * self.geo.cols + b.c0) * es) as usize;
            crc = crc32c::crc32c_append(crc, &self.map[off..off + (b.cols * es) as usize]);
        }
        crc
    }

    /// Check every checksum tile `b` touches that this handle has not checked yet.
    fn verify_tiles(&self, b: &Block) -> Result<()> {
        let Some(t) = &self.crcs else { return Ok(()) };
        let tg = Geometry {
            tile_rows: t.tile.0,
            tile_cols: t.tile.1,
            ..self.geo
        };
        let marks = self
            .verified
            .get_or_init(|| t.crcs.iter().map(|_| AtomicBool::new(false)).collect());
        let todo: Vec<(u64, u64)> = tg
            .tiles_iter(b)
            .filter(|&(ti, tj)| !marks[tg.tile_index(ti, tj)].load(Ordering::Relaxed))
            .collect();
        todo.par_iter().try_for_each(|&(ti, tj)| {
            let i = tg.tile_index(ti, tj);
            let computed = self.tile_crc(t.tile, ti, tj);
            if computed != t.crcs[i] {
                return Err(Error::Checksum {
                    path: self.path.clone(),
                    ti,
                    tj,
                    stored: t.crcs[i],
                    computed,
                    sidecar: Some(sidecar_path(&self.path)),
                });
            }
            marks[i].store(true, Ordering::Relaxed);
            Ok(())
        })
    }

    /// The journal's identity: path, length, modification time, format and a CRC of the
    /// header plus [`SAMPLES`] samples of [`SAMPLE`] bytes spread over the data. Cheap, and it
    /// changes when the file is rewritten or resized; an in-place edit between samples that
    /// keeps the modification time is not seen (documented in docs/FORMAT.md).
    pub(crate) fn identity(&self) -> String {
        let (head, end) = match self.spec.region {
            // A region deep in a file: reading all before it took seconds per GiB.
            true => (0, data_end(&self.spec).unwrap_or(self.len).min(self.len)),
            false => (self.spec.data_offset as usize, self.len),
        };
        let mut crc = crc32c::crc32c(&self.map[..head]);
        let start = self.spec.data_offset;
        let span = end - start;
        for i in 0..SAMPLES {
            let at = start + (span.saturating_sub(SAMPLE)) * i / (SAMPLES - 1);
            let l = SAMPLE.min(end - at);
            crc = crc32c::crc32c_append(crc, &self.map[at as usize..(at + l) as usize]);
        }
        format!(
            "{} ({} bytes, mtime {} ns, {}, sample crc {crc:08x})",
            super::fsutil::identity_path(&self.path).display(),
            self.len,
            self.mtime_ns,
            self.spec.kind
        )
    }
}

/// End of the data: offset + rows·cols·element size, or `None` on overflow.
pub(crate) fn data_end(spec: &RowMajorSpec) -> Option<u64> {
    spec.rows
        .checked_mul(spec.cols)
        .and_then(|n| n.checked_mul(spec.dtype.size() as u64))
        .and_then(|n| n.checked_add(spec.data_offset))
}

/// A raw pointer that may cross threads; used only to write disjoint byte ranges of one buffer.
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: only dereferenced for disjoint byte ranges (distinct runs of a block).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(&self) -> *mut u8 {
        self.0
    }
}

impl MatrixSource for RowMajorFile {
    fn path(&self) -> &Path {
        &self.path
    }
    fn shape(&self) -> (u64, u64) {
        (self.spec.rows, self.spec.cols)
    }
    fn dtype(&self) -> DType {
        self.spec.dtype
    }
    fn read_block(&self, b: &Block, host: DType, dst: &mut [u8]) -> Result<()> {
        b.check_inside(&self.path, (self.spec.rows, self.spec.cols))?;
        assert_eq!(dst.len(), b.elems() * host.size(), "read_block: dst size");
        let dt = self.spec.dtype;
        if !supported(dt, host) {
            return Err(Error::format(
                &self.path,
                format!("cannot read {dt} data as {host}"),
            ));
        }
        let rs: Vec<Run> = runs(&self.geo, b, IO_SPAN).collect();
        let io_err = |e| Error::io(&self.path, "cannot read matrix data", e);
        if dt == host {
            return self.read_into(&rs, dst, None).map(|_| ()).map_err(io_err);
        }
        let mut scratch = vec![0u8; b.elems() * dt.size()];
        self.read_into(&rs, &mut scratch, None).map_err(io_err)?;
        convert_par(dt, &scratch, host, dst);
        Ok(())
    }
    fn will_need(&self, b: &Block) -> u64 {
        let mut total = 0;
        for run in runs(&self.geo, b, IO_SPAN) {
            let spans: Vec<std::ops::Range<u64>> =
                if !run.file_contiguous() && self.band_worthy(&run) && self.cache_holds_file {
                    // The band of whole rows under the run (every block of that band asks
                    // for it, at other columns): advised once.
                    let data = self.spec.data_offset;
                    let start = run.file_off - (run.file_off - data) % run.file_pitch;
                    let span = start..(start + run.rows as u64 * run.file_pitch).min(self.len);
                    let mut done = self.advised.lock().unwrap_or_else(|e| e.into_inner());
                    if done
                        .iter()
                        .any(|d| d.start <= span.start && span.end <= d.end)
                    {
                        Vec::new()
                    } else {
                        done.push(span.clone());
                        vec![span]
                    }
                } else if run.file_contiguous() || self.band_worthy(&run) {
                    vec![run.file_span()]
                } else if run.row_len >= SHORT_SEGMENT {
                    (0..run.rows)
                        .map(|r| {
                            let o = run.row(r).0;
                            o..o + run.row_len as u64
                        })
                        .collect()
                } else {
                    Vec::new()
                };
            for s in spans {
                let l = (s.end - s.start) as usize;
                let _ = self.map.advise_range(Advice::WillNeed, s.start as usize, l);
                total += l as u64;
            }
        }
        total
    }
    fn verify_block(&self, b: &Block) -> Result<()> {
        self.verify_tiles(b)
    }
    fn read_staged(&self, b: &Block, host: DType, dst: &mut [u8], verify: bool) -> Result<u64> {
        if self.spec.dtype != host {
            return read_staged_in_passes(self, b, host, dst, verify);
        }
        if verify {
            self.verify_tiles(b)?;
        }
        b.check_inside(&self.path, (self.spec.rows, self.spec.cols))?;
        assert_eq!(dst.len(), b.elems() * host.size(), "read_staged: dst size");
        let rs: Vec<Run> = runs(&self.geo, b, IO_SPAN).collect();
        self.read_into(&rs, dst, Some(host))
            .map_err(|e| Error::io(&self.path, "cannot read matrix data", e))
    }
    fn mapped_block(&self, b: &Block, host: DType) -> Option<MappedBlock<'_>> {
        if self.spec.dtype != host || b.check_inside(&self.path, self.shape()).is_err() {
            return None;
        }
        // Page-locked in bands of whole rows, as a `.mgt` in runs of whole tiles: each band the
        // same for every block that touches it (a row-major block's rows span the whole width
        // of the file), `stride` bytes from the data's start and a multiple of a page, so the
        // registrations of consecutive bands neither overlap nor leave a gap (the direct path
        // rounds a range's start down to a page). Registering the whole matrix at once, as
        // before, made the first block wait for all of it: the `.npy` run's first GEMM came
        // 1.07 s into the step at 53248² on an H200, the `.mgt`'s at 0.024 s (issue 35); and a
        // file larger than the lock budget never went direct at all.
        // The bands start at the page holding the data's first byte (a numpy header need not
        // end on a page), so every band starts on a page and ends where the next starts.
        let data = self.geo.data_offset;
        let (start, end) = (data - data % PAGE, data + self.geo.tile_stride);
        let pitch = self.geo.cols * self.geo.elem;
        let page_rows = PAGE / gcd(pitch, PAGE);
        let rows = ((BAND / pitch.max(1)).max(1)).div_ceil(page_rows) * page_rows;
        let stride = rows * pitch;
        let lead = data - start;
        let first = (lead + b.r0 * pitch) / stride;
        let last = (lead + (b.r0 + b.rows) * pitch - 1) / stride;
        let spans = (first..=last)
            .map(|i| start + i * stride..(start + (i + 1) * stride).min(end))
            .collect();
        Some(MappedBlock {
            runs: runs(&self.geo, b, u64::MAX).collect(),
            spans,
            data: start..end,
            stride,
            map: &self.map,
            whole_rows: true,
            cache_known: self.mincore_tells,
        })
    }
    fn scan_mapped(&self, b: &Block, host: DType, verify: bool) -> Result<u64> {
        if verify {
            self.verify_tiles(b)?;
        }
        let map: &[u8] = &self.map;
        let rs: Vec<Run> = runs(&self.geo, b, IO_SPAN).collect();
        Ok(rs
            .par_iter()
            .map(|g| {
                (0..g.rows)
                    .map(|r| {
                        let at = g.row(r).0 as usize;
                        crate::dtype::count_nonfinite(host, &map[at..at + g.row_len])
                    })
                    .sum::<u64>()
            })
            .sum())
    }
    fn identity(&self) -> String {
        RowMajorFile::identity(self)
    }
    fn transposed(&self) -> bool {
        self.spec.transposed
    }
    fn checksum_note(&self) -> Option<&str> {
        self.checksum_note.as_deref()
    }
    fn checksum_tile(&self) -> Option<(u64, u64)> {
        self.crcs.as_ref().map(|c| c.tile)
    }
    fn describe(&self) -> String {
        let s = &self.spec;
        let order = if s.transposed {
            format!(
                "column-major (Fortran): the transpose of a row-major {}×{}",
                s.rows, s.cols
            )
        } else {
            "row-major (C order)".into()
        };
        let (r, c) = if s.transposed {
            (s.cols, s.rows)
        } else {
            (s.rows, s.cols)
        };
        let checks = match &self.crcs {
            Some(t) => format!(
                "CRC-32C per {}×{} tile in the sidecar ({})",
                t.tile.0,
                t.tile.1,
                crate::units::count(t.crcs.len() as u64, "tile", "tiles")
            ),
            None => match &self.checksum_note {
                Some(n) => format!(
                    "none: the {n} (the journal identifies it by size, mtime and a sample CRC)"
                ),
                None => "none (the journal identifies it by size, mtime and a sample CRC)".into(),
            },
        };
        format!(
            "file:        {}\nformat:      {}, dtype {}\nshape:       {r} × {c}\norder:       {order}\ndata:        offset {}, {} of values\nchecksums:   {checks}\nsize:        {}\n",
            self.path.display(),
            s.kind,
            s.dtype,
            s.data_offset,
            fmt_bytes_exact(s.rows * s.cols * s.dtype.size() as u64),
            fmt_bytes_exact(self.len)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MatrixSource;

    /// A row-major file read in k-blocks (A of A·B, whose blocks are narrower than its rows)
    /// is advised band by band, each band once: the bytes advised are the file's, not the
    /// file's times the blocks along a row (8× here; 6.7× at 53248² on an H200, issue 35).
    /// The bands a `.npy`'s blocks are page-locked in start on a page and follow each other
    /// without overlap (a numpy header of 128 bytes included), whatever the row pitch, and a
    /// block's bands hold all of its rows.
    #[test]
    fn bands_are_whole_pages_and_cover_the_blocks() {
        let dir = tempfile::tempdir().unwrap();
        for (cols, offset) in [(1536u64, 128u64), (1000, 128), (53, 4096), (4096, 0)] {
            let rows = 700u64;
            let path = dir.path().join(format!("X{cols}.raw"));
            std::fs::write(&path, vec![0u8; (offset + rows * cols * 4) as usize]).unwrap();
            let spec = RowMajorSpec {
                rows,
                cols,
                dtype: DType::F32,
                data_offset: offset,
                transposed: false,
                kind: "raw".into(),
                region: false,
            };
            let f = RowMajorFile::open(&path, spec, None).unwrap();
            for (r0, n) in [(0u64, 1u64), (0, 700), (333, 100), (699, 1)] {
                let b = Block {
                    r0,
                    c0: 0,
                    rows: n,
                    cols: 1,
                };
                let mb = f.mapped_block(&b, DType::F32).unwrap();
                assert_eq!(mb.stride % PAGE, 0, "cols {cols}");
                assert_eq!(mb.data.start % PAGE, 0);
                for s in &mb.spans {
                    assert_eq!((s.start - mb.data.start) % mb.stride, 0);
                }
                let (lo, hi) = (offset + r0 * cols * 4, offset + (r0 + n) * cols * 4);
                assert!(mb.spans[0].start <= lo && hi <= mb.spans.last().unwrap().end);
            }
        }
    }

    #[test]
    fn narrow_blocks_advise_each_band_of_rows_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("A.raw");
        let (rows, cols) = (256u64, 2048u64);
        std::fs::write(&path, vec![0u8; (rows * cols * 4) as usize]).unwrap();
        let spec = RowMajorSpec {
            rows,
            cols,
            dtype: DType::F32,
            data_offset: 0,
            transposed: false,
            kind: "raw".into(),
            region: false,
        };
        let f = RowMajorFile::open(&path, spec, None).unwrap();
        if !f.cache_holds_file {
            return; // a machine without the memory to say so: the rule does not apply
        }
        let mut advised = 0;
        for r0 in (0..rows).step_by(128) {
            for c0 in (0..cols).step_by(256) {
                let b = Block {
                    r0,
                    c0,
                    rows: 128,
                    cols: 256,
                };
                advised += f.will_need(&b);
            }
        }
        assert_eq!(advised, rows * cols * 4, "each band of rows advised once");
    }
}
