//! Reading and writing `.mgt` tiled matrix files: the first [`MatrixSource`] and [`MatrixSink`].
//!
//! [`TiledFile`] reads arbitrary row/column blocks of an input with parallel `pread`s of the
//! block's contiguous runs ([`super::runs`]), checking storage-tile checksums on the pieces it
//! reads ([`TiledFile::read_staged`]) or with `pread`s of their own; it keeps a read-only map
//! for readahead advice and the checksum table. [`TiledWriter`] creates an output at its full
//! length and writes blocks either by copying into a writable map whose pages a prefault stage
//! populated, or by `pwrite` ([`WriteMode`]); `finish` fills in the checksum table and makes
//! the data durable.
//!
//! Measured choices (docs/GPU.md): input blocks are read with `pread` (21.5 GB/s into pinned
//! memory on the H200 host, against 19.4 for registering the map with CUDA, and 2.12 s against
//! 2.85 s end to end for copying through the map); output blocks go through the prefaulted map by
//! default (1.92 s against 2.31 s for `pwrite`).
//!
//! Memory-map safety: a map of a file that another process truncates raises SIGBUS, and one that
//! another process writes is undefined behaviour. The engine never writes its inputs (outputs
//! are always different files, which `plan` checks) and the docs tell users not to modify input
//! files while a job runs; that is the guarantee every `unsafe` map below relies on.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use memmap2::{Advice, Mmap, MmapMut, MmapOptions};
use rayon::prelude::*;

use super::fsutil;
use super::header::Header;
use super::runs::{runs, Geometry, Run, IO_SPAN};
use super::source::{Block, MatrixSink, MatrixSource, WriteMode};
use crate::dtype::{self, DType};
use crate::error::{Error, Result};

/// Blocks bigger than this are copied by several threads.
const PAR_BYTES: usize = 1 << 20;
/// `madvise(WILLNEED)` is capped by the readahead window; issue it in pieces of at most this.
const ADVISE_CHUNK: u64 = 8 << 20;
/// Run span for copies into the output map: small enough that a single storage tile's rows
/// spread over the whole rayon pool.
pub(crate) const MAP_COPY_SPAN: u64 = 512 << 10;
/// Elements converted per parallel task.
const CONVERT_ELEMS: usize = 1 << 16;

/// CRC-32C of `data`, computed by several threads and combined.
pub fn par_crc32c(data: &[u8]) -> u32 {
    const CHUNK: usize = 8 << 20;
    if data.len() <= CHUNK {
        return crc32c::crc32c(data);
    }
    let parts: Vec<(u32, usize)> = data
        .par_chunks(CHUNK)
        .map(|c| (crc32c::crc32c(c), c.len()))
        .collect();
    parts
        .into_iter()
        .fold(0u32, |acc, (c, l)| crc32c::crc32c_combine(acc, c, l))
}

/// Convert a dense array between dtypes on the rayon pool.
pub(crate) fn convert_par(from: DType, src: &[u8], to: DType, dst: &mut [u8]) {
    src.par_chunks(CONVERT_ELEMS * from.size())
        .zip(dst.par_chunks_mut(CONVERT_ELEMS * to.size()))
        .for_each(|(s, d)| {
            dtype::convert(from, s, to, d);
        });
}

/// Read every run of a block from `file` into `raw` (the dense block, file dtype), in parallel
/// on the rayon pool, one [`read_run_visiting`] per run.
pub(crate) fn read_runs(file: &File, rs: &[Run], raw: &mut [u8]) -> std::io::Result<()> {
    read_runs_with(file, rs, raw, |_| (), |_, _| ()).map(|_| ())
}

/// [`read_runs`], handing every piece read to `visit` with that run's state (made by `init`),
/// while the piece is still in cache; returns the runs' states in the order of `rs`.
pub(crate) fn read_runs_with<S: Send>(
    file: &File,
    rs: &[Run],
    raw: &mut [u8],
    init: impl Fn(&Run) -> S + Sync,
    visit: impl Fn(&mut S, &[u8]) + Sync,
) -> std::io::Result<Vec<S>> {
    let base = SendPtr(raw.as_mut_ptr());
    let raw_len = raw.len();
    rs.par_iter()
        .map_init(Vec::new, |scratch: &mut Vec<u8>, g| {
            let span = g.buf_span();
            assert!(span.end <= raw_len);
            // SAFETY: runs of one block cover disjoint bytes of the dense block buffer (each
            // element lies in exactly one run), `span` lies inside it (asserted), and `raw`
            // outlives this loop.
            let span =
                unsafe { std::slice::from_raw_parts_mut(base.get().add(span.start), span.len()) };
            let mut state = init(g);
            read_run_visiting(file, g, span, scratch, &mut |piece| {
                visit(&mut state, piece)
            })?;
            Ok(state)
        })
        .collect()
}

/// Bytes per `pread` in [`read_run_visiting`]: small enough that the piece is still in the
/// core's cache when it is checksummed, counted and (for runs strided in the block) scattered.
const VISIT_PIECE: usize = 512 << 10;

/// The CRC-32C of part of a storage tile, computed while reading it ([`TiledFile::read_staged`]).
#[derive(Clone, Copy, Debug)]
struct Piece {
    /// Index of the storage tile in the checksum table.
    tile: usize,
    /// File offset and length of the bytes covered.
    start: u64,
    len: u64,
    crc: u32,
}

impl Piece {
    /// The piece run `g` makes with CRC `crc` (0 when it is computed later), when it is wanted:
    /// checksums are checked (`marks`), its tile is not yet verified, and its bytes are back to
    /// back in the file (a run across part of a tile's width makes none).
    fn wanted(geo: &Geometry, g: &Run, marks: Option<&[AtomicBool]>, crc: u32) -> Option<Piece> {
        let tile = ((g.file_off - geo.data_offset) / geo.tile_stride) as usize;
        let want = g.file_contiguous() && marks.is_some_and(|m| !m[tile].load(Ordering::Relaxed));
        want.then_some(Piece {
            tile,
            start: g.file_off,
            len: g.bytes() as u64,
            crc,
        })
    }
}

/// Read run `g` into `span` (its bytes of the dense block buffer, file dtype) with `pread`s of
/// at most [`VISIT_PIECE`] bytes, handing each piece to `visit` in file order right after it is
/// read. Rows that are not back to back in the file are read, and visited, one by one.
fn read_run_visiting(
    file: &File,
    g: &Run,
    span: &mut [u8],
    scratch: &mut Vec<u8>,
    visit: &mut impl FnMut(&[u8]),
) -> std::io::Result<()> {
    if g.file_contiguous() && g.buf_contiguous() {
        let bytes = g.bytes();
        let mut o = 0;
        while o < bytes {
            let piece = &mut span[o..bytes.min(o + VISIT_PIECE)];
            file.read_exact_at(piece, g.file_off + o as u64)?;
            visit(piece);
            o += piece.len();
        }
    } else if g.file_contiguous() {
        let per = (VISIT_PIECE / g.row_len.max(1)).max(1);
        let mut r = 0;
        while r < g.rows {
            let n = per.min(g.rows - r);
            scratch.resize(n * g.row_len, 0);
            file.read_exact_at(scratch, g.file_off + (r * g.row_len) as u64)?;
            visit(scratch);
            for (i, row) in scratch.chunks_exact(g.row_len).enumerate() {
                let o = (r + i) * g.buf_pitch;
                span[o..o + g.row_len].copy_from_slice(row);
            }
            r += n;
        }
    } else {
        for r in 0..g.rows {
            let d = &mut span[r * g.buf_pitch..r * g.buf_pitch + g.row_len];
            file.read_exact_at(d, g.file_off + r as u64 * g.file_pitch)?;
            visit(d);
        }
    }
    Ok(())
}

/// `crc` continued over the file bytes `range`, read with `pread` in 128 KiB pieces (small:
/// several tiles are checked at once, and the buffer is heap outside the pools).
fn crc32c_file_range(
    file: &File,
    mut crc: u32,
    range: std::ops::Range<u64>,
) -> std::io::Result<u32> {
    let mut buf = vec![0u8; (range.end - range.start).min(128 << 10) as usize];
    let mut at = range.start;
    while at < range.end {
        let l = ((range.end - at) as usize).min(buf.len());
        file.read_exact_at(&mut buf[..l], at)?;
        crc = crc32c::crc32c_append(crc, &buf[..l]);
        at += l as u64;
    }
    Ok(crc)
}

/// Write every run of a block from `raw` (dense block, file dtype) into `file` with `pwrite`,
/// from one thread in large sequential pieces: buffered writes to one file serialise on the
/// inode lock in most filesystems, so more threads would only queue.
pub(crate) fn pwrite_runs(file: &File, rs: &[Run], raw: &[u8]) -> std::io::Result<()> {
    let mut scratch = Vec::new();
    for g in rs {
        let src = &raw[g.buf_span()];
        if g.file_contiguous() && g.buf_contiguous() {
            file.write_all_at(&src[..g.bytes()], g.file_off)?;
        } else if g.file_contiguous() {
            scratch.clear();
            for r in 0..g.rows {
                scratch.extend_from_slice(&src[r * g.buf_pitch..r * g.buf_pitch + g.row_len]);
            }
            file.write_all_at(&scratch, g.file_off)?;
        } else {
            for r in 0..g.rows {
                file.write_all_at(
                    &src[r * g.buf_pitch..r * g.buf_pitch + g.row_len],
                    g.file_off + r as u64 * g.file_pitch,
                )?;
            }
        }
    }
    Ok(())
}

/// Where an output block goes: the file's geometry, and its map or (with `pwrite`) its file.
/// Shared by the `.mgt` and `.npy` writers.
pub(crate) struct BlockOut<'a> {
    pub(crate) geo: &'a Geometry,
    pub(crate) file: &'a File,
    pub(crate) map: &'a MmapMut,
    pub(crate) path: &'a Path,
    pub(crate) pwrite: bool,
}

impl BlockOut<'_> {
    /// Write dense row-major `src` (`b.elems()` elements of `from`) into block `b` as `to`
    /// (converting on the rayon pool when they differ); returns the CRC-32C and the length of
    /// the bytes written.
    pub(crate) fn write(
        &self,
        b: &Block,
        from: DType,
        to: DType,
        src: &[u8],
    ) -> Result<(u32, usize)> {
        assert_eq!(src.len(), b.elems() * from.size(), "write_block: src size");
        let converted;
        let raw: &[u8] = if from == to {
            src
        } else {
            let mut v = vec![0u8; b.elems() * to.size()];
            convert_par(from, src, to, &mut v);
            converted = v;
            &converted
        };
        let crc = par_crc32c(raw);
        if self.pwrite {
            let rs: Vec<Run> = runs(self.geo, b, IO_SPAN).collect();
            pwrite_runs(self.file, &rs, raw)
                .map_err(|e| Error::io(self.path, "cannot write output tile", e))?;
        } else {
            let rs: Vec<Run> = runs(self.geo, b, MAP_COPY_SPAN).collect();
            copy_runs_to_map(self.map, &rs, raw);
        }
        Ok((crc, raw.len()))
    }
}

/// Copy every run of a block from `raw` (dense block, file dtype) into the writable map,
/// in parallel when the block is large.
pub(crate) fn copy_runs_to_map(map: &MmapMut, rs: &[Run], raw: &[u8]) {
    let base = SendPtr(map.as_ptr() as *mut u8);
    let map_len = map.len();
    let one = |g: &Run| {
        assert!(
            g.file_span().end as usize <= map_len,
            "run ends past the output map"
        );
        // A run contiguous on both sides is one copy; otherwise one copy per row.
        let (pieces, len) = if g.file_contiguous() && g.buf_contiguous() {
            (1, g.bytes())
        } else {
            (g.rows, g.row_len)
        };
        for r in 0..pieces {
            let (fo, bo) = g.row(r);
            // SAFETY: `fo..fo+len` lies inside the run's file span, which ends inside the map
            // (asserted), and belongs to this run only; runs of one block are disjoint and
            // callers write disjoint blocks, so no two threads write the same bytes. `map`
            // outlives the call.
            let d = unsafe { std::slice::from_raw_parts_mut(base.get().add(fo as usize), len) };
            d.copy_from_slice(&raw[bo..bo + len]);
        }
    };
    if raw.len() >= PAR_BYTES && rs.len() > 1 {
        rs.par_iter().for_each(one);
    } else {
        rs.iter().for_each(one);
    }
}

fn read_prefix(f: &File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read_at(&mut buf[n..], n as u64)? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// A raw pointer that may cross threads; used only to write disjoint byte ranges of one buffer.
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: the pointer is only dereferenced for disjoint byte ranges (distinct runs of a block),
// so concurrent writers never alias.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    fn get(&self) -> *mut u8 {
        self.0
    }
}

pub(crate) fn supported(from: DType, to: DType) -> bool {
    from == to
        || matches!(
            (from, to),
            (DType::F16, DType::F32)
                | (DType::BF16, DType::F32)
                | (DType::F32, DType::F64)
                | (DType::F64, DType::F32)
        )
}

/// An input matrix file, validated, read with `pread` and mapped read-only for advice and its
/// checksum table.
pub struct TiledFile {
    path: PathBuf,
    file: File,
    map: Mmap,
    /// The validated header.
    pub hdr: Header,
    geo: Geometry,
    /// Per storage tile: its checksum was verified (allocated on first verification).
    verified: OnceLock<Vec<AtomicBool>>,
}

impl TiledFile {
    /// Open and validate the `.mgt` file at `path` (its whole length is checked against the header).
    pub fn open(path: &Path) -> Result<TiledFile> {
        let file = File::open(path).map_err(|e| Error::io(path, "cannot open matrix file", e))?;
        let meta = file
            .metadata()
            .map_err(|e| Error::io(path, "cannot stat matrix file", e))?;
        if !meta.is_file() {
            return Err(Error::format(path, "is not a regular file"));
        }
        let len = meta.len();
        let mut head = [0u8; 76];
        let n =
            read_prefix(&file, &mut head).map_err(|e| Error::io(path, "cannot read header", e))?;
        let hdr = Header::parse(path, &head[..n], len)?;
        // SAFETY: read-only shared map of a regular file whose length was just validated; inputs
        // are never written by the engine and must not be truncated while a job runs (module doc).
        let map = unsafe { MmapOptions::new().len(hdr.file_len() as usize).map(&file) }
            .map_err(|e| Error::io(path, "cannot memory-map matrix file", e))?;
        Ok(TiledFile {
            path: path.to_path_buf(),
            file,
            map,
            geo: hdr.geometry(),
            hdr,
            verified: OnceLock::new(),
        })
    }

    /// The open file.
    pub fn file(&self) -> &File {
        &self.file
    }
    /// Rows.
    pub fn rows(&self) -> u64 {
        self.hdr.rows
    }
    /// Columns.
    pub fn cols(&self) -> u64 {
        self.hdr.cols
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.hdr.dtype
    }

    /// The raw bytes of storage tile (ti, tj), `tile_stride` long.
    pub fn tile_bytes(&self, ti: u64, tj: u64) -> &[u8] {
        let off = self.hdr.tile_offset(ti, tj) as usize;
        &self.map[off..off + self.hdr.tile_stride as usize]
    }

    /// The stored checksum table, if the file has one.
    pub(crate) fn checksum_table(&self) -> Option<Vec<u32>> {
        if !self.hdr.has_checksums() {
            return None;
        }
        let off = self.hdr.checksum_table_offset as usize;
        let n = self.hdr.tiles() as usize;
        Some(
            self.map[off..off + 4 * n]
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        )
    }

    /// Verify storage tile (ti, tj) against the checksum table (no-op without one).
    pub fn verify_tile(&self, ti: u64, tj: u64) -> Result<()> {
        if !self.hdr.has_checksums() {
            return Ok(());
        }
        self.check_tile(ti, tj, &mut [])
    }

    /// The stored checksum of storage tile (ti, tj) (the file has a table).
    fn stored_crc(&self, ti: u64, tj: u64) -> u32 {
        let idx = self.geo.tile_index(ti, tj);
        let off = self.hdr.checksum_table_offset as usize + 4 * idx;
        u32::from_le_bytes(self.map[off..off + 4].try_into().unwrap())
    }

    /// Check storage tile (ti, tj) against its stored checksum, given the CRCs of `pieces` of
    /// it that a read already computed; the bytes between and around them are read here with
    /// `pread` (not through the map: faulting input pages into the process and dropping them
    /// again costs page-table work and TLB shootdowns on every thread of the process).
    fn check_tile(&self, ti: u64, tj: u64, pieces: &mut [Piece]) -> Result<()> {
        let t0 = self.hdr.tile_offset(ti, tj);
        let t1 = t0 + self.hdr.tile_stride;
        pieces.sort_unstable_by_key(|p| p.start);
        let io_err = |e| Error::io(&self.path, "cannot read tile data to verify it", e);
        let mut crc = 0u32;
        let mut at = t0;
        for p in pieces.iter() {
            debug_assert!(
                p.start >= at && p.start + p.len <= t1,
                "pieces lie inside the tile"
            );
            crc = crc32c_file_range(&self.file, crc, at..p.start).map_err(io_err)?;
            crc = crc32c::crc32c_combine(crc, p.crc, p.len as usize);
            at = p.start + p.len;
        }
        let computed = crc32c_file_range(&self.file, crc, at..t1).map_err(io_err)?;
        let stored = self.stored_crc(ti, tj);
        if stored != computed {
            return Err(Error::Checksum {
                path: self.path.clone(),
                ti,
                tj,
                stored,
                computed,
                sidecar: None,
            });
        }
        Ok(())
    }

    /// Per storage tile, whether this handle verified it already.
    fn marks(&self) -> &[AtomicBool] {
        self.verified.get_or_init(|| {
            (0..self.hdr.tiles())
                .map(|_| AtomicBool::new(false))
                .collect()
        })
    }

    /// Verify every storage tile `b` touches that this handle has not verified yet.
    pub(crate) fn verify_block(&self, b: &Block) -> Result<()> {
        if !self.hdr.has_checksums() {
            return Ok(());
        }
        let marks = self.marks();
        let todo: Vec<(u64, u64)> = self
            .geo
            .tiles_iter(b)
            .filter(|&(ti, tj)| !marks[self.geo.tile_index(ti, tj)].load(Ordering::Relaxed))
            .collect();
        todo.par_iter().try_for_each(|&(ti, tj)| {
            self.verify_tile(ti, tj)?;
            marks[self.geo.tile_index(ti, tj)].store(true, Ordering::Relaxed);
            Ok(())
        })
    }

    /// Ask the kernel to read `b` ahead (asynchronous). Returns bytes advised.
    pub(crate) fn will_need(&self, b: &Block) -> u64 {
        let mut total = 0;
        for run in runs(&self.geo, b, ADVISE_CHUNK) {
            let span = run.file_span();
            let mut o = span.start;
            while o < span.end {
                let l = ADVISE_CHUNK.min(span.end - o);
                // Advice failures are harmless (it is only a hint).
                let _ = self
                    .map
                    .advise_range(Advice::WillNeed, o as usize, l as usize);
                o += l;
            }
            total += span.end - span.start;
        }
        total
    }

    /// Copy block `b` into `dst` as a dense row-major `b.rows × b.cols` array of `out` elements:
    /// `pread` each contiguous run straight into `dst` (same dtype), or into a scratch block
    /// that is then converted.
    pub fn read_block(&self, b: &Block, out: DType, dst: &mut [u8]) -> Result<()> {
        let h = &self.hdr;
        b.check_inside(&self.path, (h.rows, h.cols))?;
        assert_eq!(dst.len(), b.elems() * out.size(), "read_block: dst size");
        if !supported(h.dtype, out) {
            return Err(Error::format(
                &self.path,
                format!("cannot read {} data as {}", h.dtype, out),
            ));
        }
        let rs: Vec<Run> = runs(&self.geo, b, IO_SPAN).collect();
        let io_err = |e| Error::io(&self.path, "cannot read tile data", e);
        if h.dtype == out {
            return read_runs(&self.file, &rs, dst).map_err(io_err);
        }
        let mut scratch = vec![0u8; b.elems() * h.elem()];
        read_runs(&self.file, &rs, &mut scratch).map_err(io_err)?;
        convert_par(h.dtype, &scratch, out, dst);
        Ok(())
    }

    /// Read `b` for the pipeline's staging in one pass over the data: the block is read in
    /// pieces small enough to stay in the core's cache, and each piece's CRC (for storage tiles
    /// not yet verified, when `verify`) and NaN/Inf count are taken while it is there, instead
    /// of a checksum pass through the map, the copy, and a counting pass over the copy (three
    /// trips through memory). Returns the number of non-finite elements read. Reading as
    /// another dtype falls back to those separate passes. Only runs whose rows are back to back
    /// in the file yield CRC pieces: a block narrower than a storage tile (or a tile's padding
    /// and the rows outside the block) is checked by reading the rest of the tile again.
    pub(crate) fn read_staged(
        &self,
        b: &Block,
        host: DType,
        dst: &mut [u8],
        verify: bool,
    ) -> Result<u64> {
        let h = &self.hdr;
        if h.dtype != host {
            return super::source::read_staged_in_passes(self, b, host, dst, verify);
        }
        b.check_inside(&self.path, (h.rows, h.cols))?;
        assert_eq!(dst.len(), b.elems() * host.size(), "read_staged: dst size");
        let marks = (verify && h.has_checksums()).then(|| self.marks());
        let rs: Vec<Run> = runs(&self.geo, b, IO_SPAN).collect();
        let geo = self.geo;
        // Per run: its nonfinite count, and the CRC piece it makes for a tile still unchecked.
        let per_run: Vec<(u64, Option<Piece>)> = read_runs_with(
            &self.file,
            &rs,
            dst,
            |g| (0, Piece::wanted(&geo, g, marks, 0)),
            |(nonfinite, piece), bytes| {
                if let Some(p) = piece {
                    p.crc = crc32c::crc32c_append(p.crc, bytes);
                }
                *nonfinite += dtype::count_nonfinite(host, bytes);
            },
        )
        .map_err(|e| Error::io(&self.path, "cannot read tile data", e))?;
        self.settle_checks(b, marks, per_run)
    }

    /// The end of a pass that computed, per run, its NaN/Inf count and (for runs inside a
    /// storage tile not yet verified) its CRC piece: verify those tiles, completing each from
    /// the file where the pieces leave gaps, mark them verified, and return the count.
    fn settle_checks(
        &self,
        b: &Block,
        marks: Option<&[AtomicBool]>,
        per_run: Vec<(u64, Option<Piece>)>,
    ) -> Result<u64> {
        let nonfinite = per_run.iter().map(|r| r.0).sum();
        if let Some(marks) = marks {
            let mut pieces: Vec<Piece> = per_run.into_iter().filter_map(|r| r.1).collect();
            pieces.sort_unstable_by_key(|p| (p.tile, p.start));
            let todo: Vec<(u64, u64)> = self
                .geo
                .tiles_iter(b)
                .filter(|&(ti, tj)| !marks[self.geo.tile_index(ti, tj)].load(Ordering::Relaxed))
                .collect();
            let mut groups: Vec<(u64, u64, Vec<Piece>)> = todo
                .into_iter()
                .map(|(ti, tj)| {
                    let idx = self.geo.tile_index(ti, tj);
                    let lo = pieces.partition_point(|p| p.tile < idx);
                    let hi = pieces.partition_point(|p| p.tile <= idx);
                    (ti, tj, pieces[lo..hi].to_vec())
                })
                .collect();
            groups.par_iter_mut().try_for_each(|(ti, tj, ps)| {
                self.check_tile(*ti, *tj, ps)?;
                marks[self.geo.tile_index(*ti, *tj)].store(true, Ordering::Relaxed);
                Ok::<(), Error>(())
            })?;
        }
        Ok(nonfinite)
    }

    /// What [`Self::read_staged`] checks, without the copy: the NaN/Inf count of block `b` and,
    /// with `verify`, the checksums of the storage tiles it touches not yet verified, in one
    /// parallel pass over the file's map (the pages a device copies straight from,
    /// `engine.staging`). `host` must be the file's dtype.
    pub(crate) fn scan_mapped(&self, b: &Block, host: DType, verify: bool) -> Result<u64> {
        let h = &self.hdr;
        assert_eq!(h.dtype, host, "scan_mapped: the map holds the file's dtype");
        b.check_inside(&self.path, (h.rows, h.cols))?;
        let marks = (verify && h.has_checksums()).then(|| self.marks());
        let geo = self.geo;
        let map: &[u8] = &self.map;
        let rs: Vec<Run> = runs(&geo, b, IO_SPAN).collect();
        let per_run: Vec<(u64, Option<Piece>)> = rs
            .par_iter()
            .map(|g| {
                let mut piece = Piece::wanted(&geo, g, marks, 0);
                let mut nonfinite = 0;
                for r in 0..g.rows {
                    let at = g.row(r).0 as usize;
                    let bytes = &map[at..at + g.row_len];
                    if let Some(p) = &mut piece {
                        p.crc = crc32c::crc32c_append(p.crc, bytes);
                    }
                    nonfinite += dtype::count_nonfinite(host, bytes);
                }
                (nonfinite, piece)
            })
            .collect();
        self.settle_checks(b, marks, per_run)
    }

    /// Where block `b`'s storage tiles lie in the dense block a device holds (the map holds
    /// the file's dtype, f32 or f64, as `host`).
    pub(crate) fn device_check_spec(
        &self,
        b: &Block,
        host: DType,
    ) -> Option<crate::seam::DeviceCheckSpec> {
        let h = &self.hdr;
        if h.dtype != host || !matches!(host, DType::F32 | DType::F64) {
            return None;
        }
        b.check_inside(&self.path, (h.rows, h.cols)).ok()?;
        let (tis, tjs) = self.geo.tiles_of(b);
        Some(crate::seam::DeviceCheckSpec {
            brows: b.rows,
            bcols: b.cols,
            br0: b.r0,
            bc0: b.c0,
            tile_rows: self.geo.tile_rows,
            tile_cols: self.geo.tile_cols,
            ti0: tis.start,
            tj0: tjs.start,
            nti: tis.end - tis.start,
            ntj: tjs.end - tjs.start,
            elem: host.size() as u32,
        })
    }

    /// [`Self::scan_mapped`]'s verdict from a device's `[crc, nonfinite]` per storage tile
    /// the block touches (in [`Self::device_check_spec`]'s order, which is
    /// [`Geometry::tiles_iter`]'s): the same pieces, one per tile, settled the same way.
    pub(crate) fn settle_device_check(
        &self,
        b: &Block,
        host: DType,
        verify: bool,
        results: &[[u32; 2]],
    ) -> Result<u64> {
        let h = &self.hdr;
        assert_eq!(
            h.dtype, host,
            "settle_device_check: the map holds the file's dtype"
        );
        let marks = (verify && h.has_checksums()).then(|| self.marks());
        let geo = self.geo;
        // One run per storage tile (no span limit), in tiles_iter order: the device's order.
        let rs: Vec<Run> = runs(&geo, b, u64::MAX).collect();
        if rs.len() != results.len() {
            return Err(Error::format(
                &self.path,
                format!(
                    "a device checked {} storage tiles of block {b:?}, which touches {} (a bug; please report it)",
                    results.len(),
                    rs.len()
                ),
            ));
        }
        let per_run: Vec<(u64, Option<Piece>)> = rs
            .iter()
            .zip(results)
            .map(|(g, &[crc, nonfinite])| (nonfinite as u64, Piece::wanted(&geo, g, marks, crc)))
            .collect();
        self.settle_checks(b, marks, per_run)
    }

    /// The journal's identity of this file: canonical path, length, header CRC and
    /// checksum-table CRC. The text is part of every journal's fingerprint, so it must not
    /// change between versions.
    pub(crate) fn identity(&self) -> String {
        let len = self.hdr.file_len();
        let head = crc32c::crc32c(&self.hdr.fields_block());
        let table = self
            .checksum_table()
            .map(|t| {
                let bytes: Vec<u8> = t.iter().flat_map(|c| c.to_le_bytes()).collect();
                format!("{:08x}", crc32c::crc32c(&bytes))
            })
            .unwrap_or_else(|| "none".into());
        format!(
            "{} ({len} bytes, header {head:08x}, tile checksums {table})",
            super::fsutil::identity_path(&self.path).display()
        )
    }
}

impl MatrixSource for TiledFile {
    fn path(&self) -> &Path {
        &self.path
    }
    fn shape(&self) -> (u64, u64) {
        (self.hdr.rows, self.hdr.cols)
    }
    fn dtype(&self) -> DType {
        self.hdr.dtype
    }
    fn read_block(&self, b: &Block, host: DType, dst: &mut [u8]) -> Result<()> {
        TiledFile::read_block(self, b, host, dst)
    }
    fn will_need(&self, b: &Block) -> u64 {
        TiledFile::will_need(self, b)
    }
    fn verify_block(&self, b: &Block) -> Result<()> {
        TiledFile::verify_block(self, b)
    }
    fn read_staged(&self, b: &Block, host: DType, dst: &mut [u8], verify: bool) -> Result<u64> {
        TiledFile::read_staged(self, b, host, dst, verify)
    }
    fn scan_mapped(&self, b: &Block, host: DType, verify: bool) -> Result<u64> {
        TiledFile::scan_mapped(self, b, host, verify)
    }
    fn device_check_spec(&self, b: &Block, host: DType) -> Option<crate::seam::DeviceCheckSpec> {
        TiledFile::device_check_spec(self, b, host)
    }
    fn settle_device_check(
        &self,
        b: &Block,
        host: DType,
        verify: bool,
        results: &[[u32; 2]],
    ) -> Result<u64> {
        TiledFile::settle_device_check(self, b, host, verify, results)
    }
    fn mapped_block(&self, b: &Block, host: DType) -> Option<super::source::MappedBlock<'_>> {
        if self.hdr.dtype != host
            || b.check_inside(&self.path, (self.hdr.rows, self.hdr.cols))
                .is_err()
        {
            return None;
        }
        let geo = self.geo;
        Some(super::source::MappedBlock {
            runs: runs(&geo, b, u64::MAX).collect(),
            spans: geo
                .tiles_iter(b)
                .map(|(ti, tj)| {
                    let at = geo.tile_offset(ti, tj);
                    at..at + geo.tile_stride
                })
                .collect(),
            data: geo.data_offset..self.hdr.data_end(),
            stride: geo.tile_stride,
            map: &self.map,
        })
    }
    fn identity(&self) -> String {
        TiledFile::identity(self)
    }
    fn checksum_tile(&self) -> Option<(u64, u64)> {
        Some((self.hdr.tile_rows, self.hdr.tile_cols))
    }
}

/// An output matrix file being written.
pub(crate) struct TiledWriter {
    path: PathBuf,
    file: File,
    map: MmapMut,
    pub(crate) hdr: Header,
    geo: Geometry,
    /// Checksums of storage tiles already known (computed when a tile is written whole).
    crcs: Mutex<Vec<Option<u32>>>,
    /// Blocks are written with `pwrite`: asked for ([`WriteMode::Pwrite`]), or forced because
    /// the filesystem cannot preallocate (`fallocate`), so writes through the map could hit
    /// ENOSPC, which a map reports as SIGBUS.
    pwrite: bool,
    /// Drop written tiles from the map ([`TiledWriter::release`]).
    release_written: AtomicBool,
    /// Per storage tile: elements written so far (counted while releasing); a tile whose count
    /// is complete was dropped from the map ([`TiledWriter::tile_written`]).
    filled: Vec<std::sync::atomic::AtomicU64>,
}

impl TiledWriter {
    /// Create `path` (replacing an existing file) at its full length, zero-filled, writing
    /// through the prefaulted map.
    pub(crate) fn create(path: &Path, hdr: Header) -> Result<TiledWriter> {
        Self::create_with(path, hdr, WriteMode::default())
    }

    /// [`TiledWriter::create`] with an explicit write mode.
    pub(crate) fn create_with(path: &Path, hdr: Header, mode: WriteMode) -> Result<TiledWriter> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| Error::io(path, "cannot create output file", e))?;
        Self::init(path, file, hdr, true, mode)
    }

    /// [`TiledWriter::reopen`] with an explicit write mode.
    pub(crate) fn reopen_with(path: &Path, hdr: Header, mode: WriteMode) -> Result<TiledWriter> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| Error::io(path, "cannot reopen output file", e))?;
        let len = file
            .metadata()
            .map_err(|e| Error::io(path, "cannot stat output file", e))?
            .len();
        let mut head = vec![0u8; 76];
        let n =
            read_prefix(&file, &mut head).map_err(|e| Error::io(path, "cannot read header", e))?;
        let found = Header::parse(path, &head[..n], len)?;
        if found != hdr {
            return Err(Error::format(
                path,
                "existing output has a different header than this plan produces; rerun with --restart",
            ));
        }
        Self::init(path, file, hdr, false, mode)
    }

    fn init(
        path: &Path,
        file: File,
        hdr: Header,
        fresh: bool,
        mode: WriteMode,
    ) -> Result<TiledWriter> {
        if fresh {
            file.write_all_at(&hdr.to_block(), 0)
                .map_err(|e| Error::io(path, "cannot write header", e))?;
            file.set_len(hdr.file_len())
                .map_err(|e| size_error(path, hdr.file_len(), e))?;
        }
        // Reserve every block now: running out of space becomes an error here, before any
        // work, instead of a SIGBUS from a write through the map hours later.
        let prealloc = fsutil::preallocate(&file, hdr.file_len())
            .map_err(|e| size_error(path, hdr.file_len(), e))?;
        // SAFETY: the output is a file this process just created or reopened for writing; the
        // engine holds it for the duration of the job and nothing else may write or truncate
        // it (the job takes an exclusive lock on it, see pipeline::journal).
        let map = unsafe {
            MmapOptions::new()
                .len(hdr.file_len() as usize)
                .map_mut(&file)
        }
        .map_err(|e| Error::io(path, "cannot memory-map output file", e))?;
        let n = hdr.tiles() as usize;
        Ok(TiledWriter {
            path: path.to_path_buf(),
            file,
            map,
            geo: hdr.geometry(),
            hdr,
            crcs: Mutex::new(vec![None; n]),
            pwrite: mode == WriteMode::Pwrite || !prealloc,
            release_written: AtomicBool::new(false),
            filled: (0..n).map(|_| Default::default()).collect(),
        })
    }

    /// Write dense row-major `src` (`b.rows × b.cols` elements of `from`) into block `b`, and
    /// return the CRC-32C of the block's bytes in the file's dtype (the resume journal records
    /// it; a storage tile that is exactly the block reuses it for the checksum table).
    /// Takes `&self`: concurrent calls must write disjoint blocks (the writeback stage
    /// guarantees that, one output tile per message).
    pub(crate) fn write_block(&self, b: &Block, from: DType, src: &[u8]) -> Result<u32> {
        let h = &self.hdr;
        assert!(
            b.r0 + b.rows <= h.rows && b.c0 + b.cols <= h.cols,
            "write_block: outside"
        );
        let out = BlockOut {
            geo: &self.geo,
            file: &self.file,
            map: &self.map,
            path: &self.path,
            pwrite: self.pwrite,
        };
        let (crc, len) = out.write(b, from, h.dtype, src)?;
        self.note_checksums(b, Some((crc, len)));
        Ok(crc)
    }

    /// Record checksums of storage tiles that block `b` covers entirely. With `raw` (the CRC
    /// and length of the block's bytes in file dtype) a tile that is exactly the block extends
    /// that CRC over its zero padding; otherwise the tile is read back through the map.
    fn note_checksums(&self, b: &Block, raw: Option<(u32, usize)>) {
        let h = &self.hdr;
        if !h.has_checksums() {
            return;
        }
        for (ti, tj) in self.geo.tiles_iter(b) {
            if !self.geo.covers_tile(b, ti, tj) {
                continue;
            }
            let crc = match raw {
                Some((c, len)) if self.geo.is_exact_tile(b, ti, tj) => {
                    let pad = h.tile_stride as usize - len;
                    crc32c::crc32c_append(c, &vec![0u8; pad])
                }
                _ => {
                    let off = h.tile_offset(ti, tj) as usize;
                    par_crc32c(&self.map[off..off + h.tile_stride as usize])
                }
            };
            self.crcs.lock().unwrap()[self.geo.tile_index(ti, tj)] = Some(crc);
        }
    }

    /// Populate (allocate and map for writing) the pages of the storage tiles block `b` will
    /// write, so that the later copy into them runs at memory speed. A hint: errors (an old
    /// kernel without MADV_POPULATE_WRITE) are ignored. Returns bytes populated; 0 when
    /// writing with `pwrite`, which does not use the map.
    pub(crate) fn prefault(&self, b: &Block) -> u64 {
        if self.pwrite {
            return 0;
        }
        let releasing = self.release_written.load(Ordering::Relaxed);
        let g = &self.geo;
        let done = |ti, tj| releasing && self.tile_written(ti, tj);
        let (_, tjs) = g.tiles_of(b);
        let mut total = 0;
        for (span, ti) in g.tile_row_spans(b).zip(g.tiles_of(b).0) {
            // A late prefault (outprep is behind writeback) of tiles already written and
            // dropped would map them again and dirty pages already on disk.
            if tjs.clone().all(|tj| done(ti, tj)) {
                continue;
            }
            let (a, len) = (span.start as usize, (span.end - span.start) as usize);
            if self.map.advise_range(Advice::PopulateWrite, a, len).is_ok() {
                total += len as u64;
            }
            // Dropped while this populated them: drop them again.
            for tj in tjs.clone().filter(|&tj| done(ti, tj)) {
                self.drop_tile(ti, tj);
            }
        }
        total
    }

    /// Count block `b` as written and, when [`MatrixSink::release_written`] asked for it, drop
    /// every storage tile it completes from this process's map. The pages stay in the page
    /// cache (dirty ones are still written back by the kernel; reading them through the map
    /// maps them again) but no longer count as the process's resident memory. Without it a
    /// mapped output's RSS grows with the output (38–50 GB for a 40 GB one), which is why
    /// `write = "auto"` used to map only outputs that fit `host_memory`; with it the map holds
    /// the tiles in flight. A storage tile is dropped once every one of its elements has been
    /// written, by however many blocks (a compute tile need not match the storage tile). Advice
    /// only: a failure changes nothing but memory. Returns bytes released; 0 when writing with
    /// `pwrite`.
    pub(crate) fn release(&self, b: &Block) -> u64 {
        if self.pwrite || !self.release_written.load(Ordering::Relaxed) {
            return 0;
        }
        let g = &self.geo;
        let mut total = 0;
        for (ti, tj) in g.tiles_iter(b) {
            let (r, c) = self.tile_span(ti, tj);
            let rows = (b.r0 + b.rows).min(r.end) - b.r0.max(r.start);
            let cols = (b.c0 + b.cols).min(c.end) - b.c0.max(c.start);
            let i = g.tile_index(ti, tj);
            let before = self.filled[i].fetch_add(rows * cols, Ordering::AcqRel);
            if before + rows * cols == (r.end - r.start) * (c.end - c.start) {
                total += self.drop_tile(ti, tj);
            }
        }
        total
    }

    /// Storage tile (ti, tj)'s rows and columns inside the matrix.
    fn tile_span(&self, ti: u64, tj: u64) -> (std::ops::Range<u64>, std::ops::Range<u64>) {
        let g = &self.geo;
        let (r0, c0) = (ti * g.tile_rows, tj * g.tile_cols);
        (
            r0..(r0 + g.tile_rows).min(g.rows),
            c0..(c0 + g.tile_cols).min(g.cols),
        )
    }

    /// Whether every element of storage tile (ti, tj) was counted by [`Self::release`] (so it
    /// was dropped from the map).
    fn tile_written(&self, ti: u64, tj: u64) -> bool {
        let (r, c) = self.tile_span(ti, tj);
        self.filled[self.geo.tile_index(ti, tj)].load(Ordering::Acquire)
            == (r.end - r.start) * (c.end - c.start)
    }

    /// Unmap storage tile (ti, tj)'s whole pages from this process (`MADV_DONTNEED`); bytes
    /// dropped.
    fn drop_tile(&self, ti: u64, tj: u64) -> u64 {
        let off = self.hdr.tile_offset(ti, tj) as usize;
        // Whole pages of the tile only: with pages larger than the 4 KiB that tiles are aligned
        // to (docs/FORMAT.md), the pages at its ends may hold a neighbour's bytes.
        // SAFETY: sysconf has no preconditions; it returns -1 only for an unknown name.
        let page = (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as usize;
        let start = off.next_multiple_of(page);
        let end = (off + self.hdr.tile_stride as usize) / page * page;
        if end <= start {
            return 0;
        }
        // SAFETY: MADV_DONTNEED on a shared file mapping only unmaps the range's pages: any
        // later access, by this thread or another, maps the file's current contents again (what
        // was written is in the page cache, marked dirty when its page table entry was
        // cleared), so no byte seen through the map changes — the argument holds even if
        // another thread were writing the range. The range is whole pages inside the map (a
        // storage tile of the header the map was sized from).
        let r = unsafe {
            self.map
                .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
        };
        if r.is_ok() {
            (end - start) as u64
        } else {
            0
        }
    }

    /// Write raw file bytes at `offset` (whole storage tiles, already laid out).
    pub(crate) fn write_raw(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        assert!(
            offset >= self.hdr.data_offset && offset + bytes.len() as u64 <= self.hdr.data_end()
        );
        self.file
            .write_all_at(bytes, offset)
            .map_err(|e| Error::io(&self.path, "cannot write matrix data", e))
    }

    /// Flush the bytes of block `b`'s storage tiles to disk (for the resume journal).
    pub(crate) fn flush_block(&self, b: &Block) -> Result<()> {
        for span in self.geo.tile_row_spans(b) {
            let (a, len) = (span.start as usize, (span.end - span.start) as usize);
            self.map
                .flush_range(a, len)
                .map_err(|e| Error::io(&self.path, "cannot flush output tile to disk", e))?;
            if self.pwrite || self.release_written.load(Ordering::Relaxed) {
                // The tile is on disk: drop its (now clean) pages from the page cache, so an
                // output larger than RAM does not push out the inputs still to be read (pages
                // still mapped, with `mmap`, are kept: writeback dropped the block's finished
                // tiles from the map before this). Advice only: a failure changes nothing but
                // speed.
                let _ = rustix::fs::fadvise(
                    &self.file,
                    a as u64,
                    std::num::NonZeroU64::new(len as u64),
                    rustix::fs::Advice::DontNeed,
                );
            }
        }
        Ok(())
    }

    /// Compute missing checksums, write the table, and (if `durable`) flush everything to disk.
    pub(crate) fn finish(mut self, durable: bool) -> Result<()> {
        let h = self.hdr;
        if h.has_checksums() {
            let known = std::mem::take(&mut *self.crcs.lock().unwrap());
            let gc = h.grid_cols();
            let this = &self;
            let releasing = self.release_written.load(Ordering::Relaxed) && !self.pwrite;
            let table: Vec<u32> = known
                .par_iter()
                .enumerate()
                .map(|(i, c)| {
                    c.unwrap_or_else(|| {
                        let (ti, tj) = (i as u64 / gc, i as u64 % gc);
                        let off = h.tile_offset(ti, tj) as usize;
                        let crc = par_crc32c(&this.map[off..off + h.tile_stride as usize]);
                        // Read through the map (a resumed run's earlier tiles): out again, so
                        // the table does not map the whole output back in.
                        if releasing {
                            this.drop_tile(ti, tj);
                        }
                        crc
                    })
                })
                .collect();
            let off = h.checksum_table_offset as usize;
            for (i, c) in table.iter().enumerate() {
                self.map[off + 4 * i..off + 4 * i + 4].copy_from_slice(&c.to_le_bytes());
            }
        }
        if durable {
            self.map
                .flush()
                .map_err(|e| Error::io(&self.path, "cannot flush output to disk", e))?;
            self.file
                .sync_all()
                .map_err(|e| Error::io(&self.path, "cannot sync output to disk", e))?;
        }
        fsutil::unmap_in_background(self.map);
        Ok(())
    }

    /// Mark storage tile checksums as unknown (after partial writes on resume).
    pub(crate) fn forget_checksums(&self) {
        self.crcs.lock().unwrap().iter_mut().for_each(|c| *c = None);
    }
}

impl MatrixSink for TiledWriter {
    fn path(&self) -> &Path {
        &self.path
    }
    fn shape(&self) -> (u64, u64) {
        (self.hdr.rows, self.hdr.cols)
    }
    fn dtype(&self) -> DType {
        self.hdr.dtype
    }
    fn storage_tile(&self) -> (u64, u64) {
        (self.hdr.tile_rows, self.hdr.tile_cols)
    }
    fn write_block(&self, b: &Block, host: DType, src: &[u8]) -> Result<u32> {
        TiledWriter::write_block(self, b, host, src)
    }
    fn prefault(&self, b: &Block) -> u64 {
        TiledWriter::prefault(self, b)
    }
    fn release(&self, b: &Block) -> u64 {
        TiledWriter::release(self, b)
    }
    fn release_written(&self, on: bool) {
        self.release_written.store(on, Ordering::Relaxed);
    }
    fn counts_dirty_pages(&self) -> bool {
        fsutil::counts_dirty_pages(&self.file)
    }
    fn write_mode(&self) -> &'static str {
        WriteMode::of_file(self.pwrite).name()
    }
    fn flush_block(&self, b: &Block) -> Result<()> {
        TiledWriter::flush_block(self, b)
    }
    fn forget_checksums(&self) {
        TiledWriter::forget_checksums(self)
    }
    fn finish(self: Box<Self>, durable: bool) -> Result<()> {
        TiledWriter::finish(*self, durable)
    }
}

pub(crate) fn size_error(path: &Path, len: u64, e: std::io::Error) -> Error {
    use rustix::io::Errno;
    let code = e.raw_os_error();
    let is = |errno: Errno| code == Some(errno.raw_os_error());
    let hint = match () {
        _ if is(Errno::NOSPC) => format!("not enough disk space for the output ({len} bytes); free space or write the output elsewhere"),
        _ if is(Errno::FBIG) => format!("the output ({len} bytes) exceeds the file-size limit (ulimit -f) or the filesystem's maximum"),
        _ if is(Errno::DQUOT) => format!("disk quota exceeded reserving {len} bytes for the output"),
        _ => format!("cannot reserve {len} bytes for the output"),
    };
    Error::Format {
        path: path.to_path_buf(),
        msg: format!("{hint}: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::open_source;

    const ROWS: u64 = 50;
    const COLS: u64 = 37;

    /// Element (r, c) of the test matrix.
    fn val(r: u64, c: u64) -> f64 {
        (r * COLS + c) as f64 * 0.5 - 100.0
    }

    /// Block `b` of the test matrix as dense bytes of `dt`.
    fn dense(b: &Block, dt: DType) -> Vec<u8> {
        let mut out = vec![0u8; b.elems() * dt.size()];
        for (i, d) in out.chunks_exact_mut(dt.size()).enumerate() {
            let (r, c) = (i as u64 / b.cols, i as u64 % b.cols);
            dtype::put(dt, val(b.r0 + r, b.c0 + c), d);
        }
        out
    }

    /// Write the whole test matrix in 13×11 blocks (straddling the 16×8 storage tiles).
    fn write_matrix(path: &Path, mode: WriteMode, host: DType) {
        let hdr = Header::new(DType::F32, ROWS, COLS, 16, 8, true);
        let w = TiledWriter::create_with(path, hdr, mode).unwrap();
        for r0 in (0..ROWS).step_by(13) {
            for c0 in (0..COLS).step_by(11) {
                let b = Block {
                    r0,
                    c0,
                    rows: 13.min(ROWS - r0),
                    cols: 11.min(COLS - c0),
                };
                let sink: &dyn MatrixSink = &w;
                sink.prefault(&b);
                let crc = sink.write_block(&b, host, &dense(&b, host)).unwrap();
                assert_eq!(crc, crc32c::crc32c(&dense(&b, DType::F32)), "{b:?}");
                sink.flush_block(&b).unwrap();
            }
        }
        w.finish(false).unwrap();
    }

    /// The resident size (kB) of the mapping starting at `addr`, from /proc/self/smaps.
    fn mapped_rss_kb(addr: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let head = format!("{addr:x}-");
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&head));
        assert!(lines.next().is_some(), "no mapping at {head}");
        let rss = lines.find(|l| l.starts_with("Rss:")).unwrap();
        rss.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    /// A `rows × cols` matrix in 96×112 blocks, which straddle 128×128 storage tiles.
    fn blocks_96x112(rows: u64, cols: u64) -> Vec<Block> {
        (0..rows)
            .step_by(96)
            .flat_map(|r0| {
                (0..cols).step_by(112).map(move |c0| Block {
                    r0,
                    c0,
                    rows: 96.min(rows - r0),
                    cols: 112.min(cols - c0),
                })
            })
            .collect()
    }

    /// An output larger than its budget drops each storage tile from the map once all of it is
    /// written, by blocks that do not line up with the storage tiles, written on several
    /// threads: nothing stays resident, and the file is byte for byte what `pwrite` writes.
    #[test]
    fn released_tiles_leave_the_map_and_keep_their_bytes() {
        let d = tempfile::tempdir().unwrap();
        let (rows, cols) = (1000u64, 900u64);
        let write = |path: &Path, mode: WriteMode| {
            let hdr = Header::new(DType::F32, rows, cols, 128, 128, true);
            let w = TiledWriter::create_with(path, hdr, mode).unwrap();
            w.release_written(true);
            let blocks = blocks_96x112(rows, cols);
            blocks.par_iter().for_each(|b| {
                let sink: &dyn MatrixSink = &w;
                sink.prefault(b);
                sink.write_block(b, DType::F32, &dense(b, DType::F32))
                    .unwrap();
                sink.release(b);
            });
            // A late prefault of a finished block does not map it back.
            w.prefault(&blocks[0]);
            let rss = if mode == WriteMode::Mmap {
                mapped_rss_kb(w.map.as_ptr() as usize)
            } else {
                0
            };
            w.finish(false).unwrap();
            rss
        };
        let (pm, pp) = (d.path().join("m.mgt"), d.path().join("p.mgt"));
        let rss = write(&pm, WriteMode::Mmap);
        write(&pp, WriteMode::Pwrite);
        // The header page and the checksum table are not tiles; every tile's pages are gone.
        assert!(
            rss <= 8,
            "{rss} kB of a {} kB output still mapped",
            std::fs::metadata(&pm).unwrap().len() >> 10
        );
        assert_eq!(std::fs::read(&pm).unwrap(), std::fs::read(&pp).unwrap());
        open_source(&pm)
            .unwrap()
            .verify_block(&Block {
                r0: 0,
                c0: 0,
                rows,
                cols,
            })
            .unwrap();
    }

    /// A resumed run: blocks an earlier run wrote (here: the first half, by a writer that
    /// never finished) are counted as written when the output is reopened, as the resume does
    /// (`run::resume`), so storage tiles that both runs wrote part of leave the map once this
    /// run writes the rest, not only when `finish` reads them.
    #[test]
    fn a_reopened_output_drops_tiles_an_earlier_run_wrote_part_of() {
        let d = tempfile::tempdir().unwrap();
        let (rows, cols) = (1000u64, 900u64);
        let hdr = Header::new(DType::F32, rows, cols, 128, 128, true);
        let blocks = blocks_96x112(rows, cols);
        let (before, after) = blocks.split_at(blocks.len() / 2);
        let path = d.path().join("r.mgt");
        {
            let w = TiledWriter::create_with(&path, hdr, WriteMode::Pwrite).unwrap();
            for b in before {
                w.write_block(b, DType::F32, &dense(b, DType::F32)).unwrap();
            }
            // Killed here: no finish.
        }
        let run = |count_earlier: bool| {
            let w = TiledWriter::reopen_with(&path, hdr, WriteMode::Mmap).unwrap();
            let sink: &dyn MatrixSink = &w;
            sink.forget_checksums();
            sink.release_written(true);
            if count_earlier {
                before.iter().for_each(|b| {
                    sink.release(b);
                });
            }
            after.par_iter().for_each(|b| {
                let sink: &dyn MatrixSink = &w;
                sink.prefault(b);
                sink.write_block(b, DType::F32, &dense(b, DType::F32))
                    .unwrap();
                sink.release(b);
            });
            let rss = mapped_rss_kb(w.map.as_ptr() as usize);
            w.finish(false).unwrap();
            rss
        };
        // Without counting the earlier blocks, the straddled storage tiles stay mapped.
        let stuck = run(false);
        assert!(
            stuck > 64,
            "only {stuck} kB mapped: the test no longer straddles tiles"
        );
        let rss = run(true);
        assert!(rss <= 8, "{rss} kB still mapped after a resumed run");
        let full = d.path().join("p.mgt");
        let w = TiledWriter::create_with(&full, hdr, WriteMode::Pwrite).unwrap();
        for b in &blocks {
            w.write_block(b, DType::F32, &dense(b, DType::F32)).unwrap();
        }
        w.finish(false).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), std::fs::read(&full).unwrap());
    }

    #[test]
    fn write_modes_give_identical_files_that_read_back() {
        let d = tempfile::tempdir().unwrap();
        let (pm, pp) = (d.path().join("m.mgt"), d.path().join("p.mgt"));
        write_matrix(&pm, WriteMode::Mmap, DType::F32);
        write_matrix(&pp, WriteMode::Pwrite, DType::F64);
        assert_eq!(std::fs::read(&pm).unwrap(), std::fs::read(&pp).unwrap());
        let f = open_source(&pm).unwrap();
        assert_eq!((f.shape(), f.dtype()), ((ROWS, COLS), DType::F32));
        let all = Block {
            r0: 0,
            c0: 0,
            rows: ROWS,
            cols: COLS,
        };
        f.verify_block(&all).unwrap();
        for b in [
            all,
            Block {
                r0: 5,
                c0: 3,
                rows: 20,
                cols: 30,
            },
            Block {
                r0: 49,
                c0: 0,
                rows: 1,
                cols: 37,
            },
            Block {
                r0: 0,
                c0: 36,
                rows: 50,
                cols: 1,
            },
        ] {
            for host in [DType::F32, DType::F64] {
                let mut got = vec![0u8; b.elems() * host.size()];
                f.read_block(&b, host, &mut got).unwrap();
                assert_eq!(got, dense(&b, host), "{b:?} as {host}");
            }
        }
        let mut buf = vec![0u8; 4 * 4];
        let outside = Block {
            r0: 48,
            c0: 0,
            rows: 4,
            cols: 1,
        };
        let e = f.read_block(&outside, DType::F32, &mut buf).unwrap_err();
        assert!(e.to_string().contains("outside"), "{e}");
    }

    /// An f32 .mgt of `rows × cols` (element (r, c) = `r·cols + c`) in `tr × tc` storage tiles.
    fn write_grid(path: &Path, rows: u64, cols: u64, tr: u64, tc: u64) -> Header {
        let hdr = Header::new(DType::F32, rows, cols, tr, tc, true);
        let w = TiledWriter::create(path, hdr).unwrap();
        let all = Block {
            r0: 0,
            c0: 0,
            rows,
            cols,
        };
        let data: Vec<u8> = (0..rows * cols)
            .flat_map(|i| (i as f32).to_le_bytes())
            .collect();
        let sink: &dyn MatrixSink = &w;
        sink.write_block(&all, DType::F32, &data).unwrap();
        w.finish(false).unwrap();
        hdr
    }

    /// A block as (r0, c0, rows, cols).
    type Tile4 = (u64, u64, u64, u64);

    /// Read each `(r0, c0, rows, cols)` block of the f32 file `p` with `read_staged` (checking
    /// checksums) by a fresh handle: no NaN, the bytes of `read_block`, and every tile the block
    /// touches marked as checked.
    fn staged_matches_read_block(p: &Path, blocks: &[Tile4]) {
        for &(r0, c0, rows, cols) in blocks {
            let b = Block { r0, c0, rows, cols };
            let f = TiledFile::open(p).unwrap();
            let mut want = vec![0u8; b.elems() * 4];
            f.read_block(&b, DType::F32, &mut want).unwrap();
            let mut got = vec![0u8; b.elems() * 4];
            assert_eq!(f.read_staged(&b, DType::F32, &mut got, true).unwrap(), 0);
            assert_eq!(got, want, "{b:?}");
            for (ti, tj) in f.geo.tiles_iter(&b) {
                assert!(f.marks()[f.geo.tile_index(ti, tj)].load(Ordering::Relaxed));
            }
        }
    }

    /// Storage tiles of 4.3 MiB, more than a run's `IO_SPAN`: one tile's CRC is combined from
    /// several runs' pieces (and from `pread`s of what the block leaves out).
    #[test]
    fn read_staged_combines_several_runs_of_a_tile() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("big.mgt");
        let (rows, cols) = (2100u64, 1200u64);
        write_grid(&p, rows, cols, 1024, 1100);
        staged_matches_read_block(
            &p,
            &[
                (0, 0, 1024, 1200),
                (3, 0, 1500, 1100),
                (0, 0, rows, cols),
                (1000, 0, 1100, 1100),
            ],
        );
        // A damaged byte in the second run of tile (0, 0) is found through the combined CRC.
        let hdr = TiledFile::open(&p).unwrap().hdr;
        let off = hdr.tile_offset(0, 0) + 1000 * 1100 * 4;
        let e = staged_error_after_damage(&p, off, (0, 0, 1024, 1100));
        assert!(matches!(e, Error::Checksum { ti: 0, tj: 0, .. }), "{e}");
    }

    /// Write four bytes of damage at `off` of `p`, then read block `(r0, c0, rows, cols)`
    /// staged, with checks, through a fresh handle: the error it must give.
    fn staged_error_after_damage(p: &Path, off: u64, (r0, c0, rows, cols): Tile4) -> Error {
        OpenOptions::new()
            .write(true)
            .open(p)
            .unwrap()
            .write_all_at(&[0x7f; 4], off)
            .unwrap();
        let b = Block { r0, c0, rows, cols };
        let mut buf = vec![0u8; b.elems() * 4];
        TiledFile::open(p)
            .unwrap()
            .read_staged(&b, DType::F32, &mut buf, true)
            .unwrap_err()
    }

    #[test]
    fn read_staged_reads_checks_and_counts_in_one_pass() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("s.mgt");
        // 768 KiB storage tiles (pieces of 512 KiB split them), partial edge tiles, padding.
        let (rows, cols) = (701u64, 653u64);
        let hdr = write_grid(&p, rows, cols, 512, 384);
        let blocks = [
            (0, 0, rows, cols),
            (3, 5, 509, 389),
            (512, 384, 189, 269),
            (0, 0, 512, 384),
            (100, 0, 1, cols),
            (0, 652, rows, 1),
            (511, 383, 2, 2),
        ];
        staged_matches_read_block(&p, &blocks);
        // And read_block itself reads the test matrix (element (r, c) = r·cols + c).
        let f = TiledFile::open(&p).unwrap();
        for &(r0, c0, r, c) in &blocks {
            let b = Block {
                r0,
                c0,
                rows: r,
                cols: c,
            };
            let mut got = vec![0u8; b.elems() * 4];
            f.read_block(&b, DType::F32, &mut got).unwrap();
            let first = f32::from_le_bytes(got[..4].try_into().unwrap());
            assert_eq!(first, (r0 * cols + c0) as f32, "{b:?}");
        }
        // Damage in a tile's data, and in its padding, is found and names the tile; NaN and
        // Inf are counted.
        let poke = |off: u64, v: f32| {
            let f = OpenOptions::new().write(true).open(&p).unwrap();
            f.write_all_at(&v.to_le_bytes(), off).unwrap();
        };
        let b = Block {
            r0: 500,
            c0: 370,
            rows: 30,
            cols: 30,
        };
        let f = TiledFile::open(&p).unwrap();
        let mut buf = vec![0u8; b.elems() * 4];
        f.read_staged(&b, DType::F32, &mut buf, true).unwrap();
        // Element (510, 380) lies in tile (0, 0), row 510, column 380.
        poke(hdr.tile_offset(0, 0) + (510 * 384 + 380) * 4, f32::NAN);
        // Element (520, 390): tile (1, 1), row 8, column 6.
        poke(hdr.tile_offset(1, 1) + (8 * 384 + 6) * 4, f32::NEG_INFINITY);
        // Checked once per handle: this one verified both tiles before the damage.
        assert_eq!(f.read_staged(&b, DType::F32, &mut buf, true).unwrap(), 2);
        let e = TiledFile::open(&p)
            .unwrap()
            .read_staged(&b, DType::F32, &mut buf, true)
            .unwrap_err();
        assert!(matches!(e, Error::Checksum { .. }), "{e}");
        let no_check = TiledFile::open(&p).unwrap();
        assert_eq!(
            no_check
                .read_staged(&b, DType::F32, &mut buf, false)
                .unwrap(),
            2
        );
        // Padding after tile (1, 0)'s last valid row (row 701 - 512 = 189 of 512).
        write_grid(&p, rows, cols, 512, 384);
        let pad = hdr.tile_offset(1, 0) + 300 * 384 * 4;
        let e = staged_error_after_damage(&p, pad, (600, 0, 10, 10));
        assert!(
            matches!(e, Error::Checksum { ti: 1, tj: 0, .. }),
            "expected tile (1, 0): {e}"
        );
    }

    #[test]
    fn verify_block_finds_a_corrupt_tile_and_checks_each_tile_once() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("v.mgt");
        write_matrix(&p, WriteMode::Mmap, DType::F32);
        let hdr = TiledFile::open(&p).unwrap().hdr;
        let corrupt = |ti, tj| {
            let f = OpenOptions::new().write(true).open(&p).unwrap();
            f.write_all_at(&[0xff; 4], hdr.tile_offset(ti, tj) + 8)
                .unwrap();
        };
        let first = Block {
            r0: 0,
            c0: 0,
            rows: 16,
            cols: 8,
        };
        let f = TiledFile::open(&p).unwrap();
        f.verify_block(&first).unwrap();
        // Tile (0, 0) was verified by this handle: later damage is not re-checked by it.
        corrupt(0, 0);
        f.verify_block(&first).unwrap();
        corrupt(1, 2);
        let clear = Block {
            r0: 0,
            c0: 8,
            rows: 16,
            cols: 29,
        };
        f.verify_block(&clear).unwrap();
        let e = f
            .verify_block(&Block {
                r0: 15,
                c0: 15,
                rows: 2,
                cols: 2,
            })
            .unwrap_err();
        assert!(
            matches!(e, Error::Checksum { ti: 1, tj: 2, .. }),
            "expected tile (1, 2): {e}"
        );
        // A fresh handle checks (0, 0) again.
        let e = TiledFile::open(&p)
            .unwrap()
            .verify_block(&first)
            .unwrap_err();
        assert!(matches!(e, Error::Checksum { ti: 0, tj: 0, .. }), "{e}");
    }

    #[test]
    fn identity_is_the_journal_text() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("i.mgt");
        write_matrix(&p, WriteMode::Mmap, DType::F32);
        let f = TiledFile::open(&p).unwrap();
        let len = std::fs::metadata(&p).unwrap().len();
        let id = MatrixSource::identity(&f);
        let prefix = format!("{} ({len} bytes, header ", p.display());
        assert!(id.starts_with(&prefix), "{id}");
        let rest = &id[prefix.len()..];
        assert_eq!(&rest[8..25], ", tile checksums ", "{id}");
        assert!(rest[..8]
            .chars()
            .chain(rest[25..33].chars())
            .all(|c| c.is_ascii_hexdigit()));
        assert_eq!(&rest[33..], ")");
    }
}
