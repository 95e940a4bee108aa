//! The `.mgt` reader: [`TiledFile`] reads arbitrary row/column blocks of an input with parallel
//! `pread`s of the block's contiguous runs — or copies of them out of its read-only map, where
//! their pages are cached ([`ReadFrom`]) — checking storage-tile checksums on the pieces it
//! reads ([`TiledFile::read_staged`]) or with `pread`s of their own; the map also serves
//! readahead advice, the checksum table and direct uploads. Format and map safety: [`super`].

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use memmap2::{Advice, Mmap, MmapOptions};
use rayon::prelude::*;

use crate::dtype::{self, DType};
use crate::error::{Error, Result};
use crate::store::block::Block;
use crate::store::blockio::{
    convert_par, read_prefix, read_runs, read_runs_with, supported, ReadFrom,
};
use crate::store::fsutil;
use crate::store::header::Header;
use crate::store::runs::{runs, Geometry, Run, IO_SPAN};
use crate::store::seam::{read_staged_in_passes, MappedBlock, MatrixSource};

/// `madvise(WILLNEED)` is capped by the readahead window; issue it in pieces of at most this.
const ADVISE_CHUNK: u64 = 8 << 20;

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

/// An input matrix file, validated, read with `pread` and mapped read-only for advice and its
/// checksum table.
pub struct TiledFile {
    path: PathBuf,
    file: File,
    map: Mmap,
    /// The validated header.
    pub hdr: Header,
    pub(super) geo: Geometry,
    /// Per storage tile: its checksum was verified (allocated on first verification).
    verified: OnceLock<Vec<AtomicBool>>,
    /// The page cache can likely hold the whole file: cached runs are copied out of the map
    /// ([`ReadFrom`]).
    cache_holds_file: bool,
    /// `mincore` tells which of the file's pages are cached ([`fsutil::mincore_tells`]).
    mincore_tells: bool,
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
        // The whole first page: the header's fields, its CRC and the reserved bytes.
        let mut head = [0u8; 4096];
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
            cache_holds_file: crate::store::fsutil::cache_holds(len),
            mincore_tells: crate::store::fsutil::mincore_tells(path, &meta),
            hdr,
            verified: OnceLock::new(),
        })
    }

    /// Where blocks are read from: the file, and its map where the cache holds the file.
    fn from(&self) -> ReadFrom<'_> {
        ReadFrom::new(
            &self.file,
            &self.map,
            self.cache_holds_file && self.mincore_tells,
        )
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
    pub(super) fn marks(&self) -> &[AtomicBool] {
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
            return read_runs(self.from(), &rs, dst).map_err(io_err);
        }
        let mut scratch = vec![0u8; b.elems() * h.elem()];
        read_runs(self.from(), &rs, &mut scratch).map_err(io_err)?;
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
            return read_staged_in_passes(self, b, host, dst, verify);
        }
        b.check_inside(&self.path, (h.rows, h.cols))?;
        assert_eq!(dst.len(), b.elems() * host.size(), "read_staged: dst size");
        let marks = (verify && h.has_checksums()).then(|| self.marks());
        let rs: Vec<Run> = runs(&self.geo, b, IO_SPAN).collect();
        let geo = self.geo;
        // Per run: its nonfinite count, and the CRC piece it makes for a tile still unchecked.
        let per_run: Vec<(u64, Option<Piece>)> = read_runs_with(
            self.from(),
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
            fsutil::identity_path(&self.path).display()
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
    fn mapped_block(&self, b: &Block, host: DType) -> Option<MappedBlock<'_>> {
        if self.hdr.dtype != host
            || b.check_inside(&self.path, (self.hdr.rows, self.hdr.cols))
                .is_err()
        {
            return None;
        }
        let geo = self.geo;
        Some(MappedBlock {
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
            whole_rows: false,
            cache_known: self.mincore_tells,
        })
    }
    fn identity(&self) -> String {
        TiledFile::identity(self)
    }
    fn checksum_tile(&self) -> Option<(u64, u64)> {
        Some((self.hdr.tile_rows, self.hdr.tile_cols))
    }
}
