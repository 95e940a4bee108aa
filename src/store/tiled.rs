//! Reading and writing `.mgt` tiled matrix files through memory maps.
//!
//! [`TiledFile`] maps an input read-only and copies arbitrary row/column blocks out of it —
//! compute tiles are independent of storage tiles, so a block may straddle any number of
//! storage tiles, and edge tiles are partial. [`TiledWriter`] creates an output at its full
//! length and writes blocks into a writable map; `finish` fills in the checksum table and makes
//! the data durable. Both split large blocks across the rayon pool by rows.
//!
//! Memory-map safety: a map of a file that another process truncates raises SIGBUS, and one that
//! another process writes is undefined behaviour. The engine never writes its inputs (outputs
//! are always different files, which `plan` checks) and the docs tell users not to modify input
//! files while a job runs; that is the guarantee every `unsafe` map below relies on.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use memmap2::{Advice, Mmap, MmapMut, MmapOptions};
use rayon::prelude::*;

use super::header::{Header, ALIGN};
use crate::dtype::{self, DType};
use crate::error::{Error, Result};

/// Blocks bigger than this are copied by several threads.
const PAR_BYTES: usize = 1 << 20;
/// `madvise(WILLNEED)` is capped by the readahead window; issue it in chunks of this size.
const ADVISE_CHUNK: u64 = 8 << 20;

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

/// How output blocks are written: memcpy into the writable map, whose pages a prefault stage
/// populated ahead of time (the default), or `pwrite` (`MGMM_WRITE=pwrite`). Buffered writes to
/// one file serialise on the inode lock; copies into prefaulted pages do not.
pub fn use_pwrite() -> bool {
    static MODE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| {
        std::env::var("MGMM_WRITE")
            .map(|v| v == "pwrite")
            .unwrap_or(false)
    })
}

/// How input blocks are read: positioned reads (`pread`, the default) or memcpy through the
/// memory map (`MGMM_IO=mmap`, kept for comparison; docs/GPU.md has the measurement).
pub fn use_mmap_io() -> bool {
    static MODE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| {
        std::env::var("MGMM_IO")
            .map(|v| v == "mmap")
            .unwrap_or(false)
    })
}

/// The part of a block inside one storage tile, as a run of rows: `rows` rows of `row_len`
/// bytes, starting at `file_off` (rows `file_pitch` apart in the file) and at `buf_off` (rows
/// `buf_pitch` apart in the dense block buffer). Large runs are split by rows (≤ 4 MiB each).
#[derive(Clone, Copy, Debug)]
struct Group {
    file_off: u64,
    file_pitch: u64,
    buf_off: usize,
    buf_pitch: usize,
    row_len: usize,
    rows: usize,
}

fn groups(h: &Header, b: &Block) -> Vec<Group> {
    let es = h.elem() as u64;
    let mut out = Vec::new();
    let (tr, tc) = (h.tile_rows, h.tile_cols);
    for ti in b.r0 / tr..(b.r0 + b.rows).div_ceil(tr) {
        let ra = b.r0.max(ti * tr);
        let rb = (b.r0 + b.rows).min((ti + 1) * tr);
        for tj in b.c0 / tc..(b.c0 + b.cols).div_ceil(tc) {
            let ca = b.c0.max(tj * tc);
            let cb = (b.c0 + b.cols).min((tj + 1) * tc);
            let g = Group {
                file_off: h.tile_offset(ti, tj) + ((ra - ti * tr) * tc + (ca - tj * tc)) * es,
                file_pitch: tc * es,
                buf_off: (((ra - b.r0) * b.cols + (ca - b.c0)) * es) as usize,
                buf_pitch: (b.cols * es) as usize,
                row_len: ((cb - ca) * es) as usize,
                rows: (rb - ra) as usize,
            };
            let per = ((4usize << 20) / g.file_pitch.max(1) as usize).max(1);
            let mut r = 0;
            while r < g.rows {
                let n = per.min(g.rows - r);
                out.push(Group {
                    file_off: g.file_off + r as u64 * g.file_pitch,
                    buf_off: g.buf_off + r * g.buf_pitch,
                    rows: n,
                    ..g
                });
                r += n;
            }
        }
    }
    out
}

impl Group {
    fn file_contiguous(&self) -> bool {
        self.rows == 1 || self.row_len as u64 == self.file_pitch
    }
    fn buf_contiguous(&self) -> bool {
        self.rows == 1 || self.row_len == self.buf_pitch
    }
    fn bytes(&self) -> usize {
        self.rows * self.row_len
    }
}

/// Read every group of a block from `file` into `raw` (the dense block, file dtype): one pread
/// per group when the rows are contiguous in the file (scattered into the block from a scratch
/// buffer if they are not contiguous there), one pread per row otherwise.
fn read_groups(file: &File, gs: &[Group], raw: &mut [u8]) -> std::io::Result<()> {
    let base = SendPtr(raw.as_mut_ptr());
    let raw_len = raw.len();
    gs.par_iter()
        .try_for_each_init(Vec::new, |scratch: &mut Vec<u8>, g| {
            let end = g.buf_off + (g.rows - 1) * g.buf_pitch + g.row_len;
            assert!(end <= raw_len);
            // SAFETY: groups of one block cover disjoint bytes of the dense block buffer (each
            // element lies in exactly one storage tile), and `raw` outlives this loop.
            let span = unsafe {
                std::slice::from_raw_parts_mut(base.get().add(g.buf_off), end - g.buf_off)
            };
            if g.file_contiguous() && g.buf_contiguous() {
                file.read_exact_at(&mut span[..g.bytes()], g.file_off)
            } else if g.file_contiguous() {
                scratch.resize(g.bytes(), 0);
                file.read_exact_at(scratch, g.file_off)?;
                for (r, row) in scratch.chunks_exact(g.row_len).enumerate() {
                    span[r * g.buf_pitch..r * g.buf_pitch + g.row_len].copy_from_slice(row);
                }
                Ok(())
            } else {
                for r in 0..g.rows {
                    let d = &mut span[r * g.buf_pitch..r * g.buf_pitch + g.row_len];
                    file.read_exact_at(d, g.file_off + r as u64 * g.file_pitch)?;
                }
                Ok(())
            }
        })
}

/// Write every group of a block from `raw` (dense block, file dtype) into `file`.
fn write_groups(file: &File, gs: &[Group], raw: &[u8]) -> std::io::Result<()> {
    // Buffered writes to one file serialise on the inode lock in most filesystems, so by default
    // a block is written by one thread in large sequential pieces; MGMM_WRITE_THREADS=par
    // spreads pieces over the pool instead (docs/GPU.md has the measurement).
    static PAR: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let par = *PAR.get_or_init(|| {
        std::env::var("MGMM_WRITE_THREADS")
            .map(|v| v == "par")
            .unwrap_or(false)
    });
    let one = |scratch: &mut Vec<u8>, g: &Group| -> std::io::Result<()> {
        let src = &raw[g.buf_off..g.buf_off + (g.rows - 1) * g.buf_pitch + g.row_len];
        if g.file_contiguous() && g.buf_contiguous() {
            file.write_all_at(&src[..g.bytes()], g.file_off)
        } else if g.file_contiguous() {
            scratch.clear();
            for r in 0..g.rows {
                scratch.extend_from_slice(&src[r * g.buf_pitch..r * g.buf_pitch + g.row_len]);
            }
            file.write_all_at(scratch, g.file_off)
        } else {
            for r in 0..g.rows {
                file.write_all_at(
                    &src[r * g.buf_pitch..r * g.buf_pitch + g.row_len],
                    g.file_off + r as u64 * g.file_pitch,
                )?;
            }
            Ok(())
        }
    };
    if par {
        gs.par_iter().try_for_each_init(Vec::new, |s, g| one(s, g))
    } else {
        let mut scratch = Vec::new();
        gs.iter().try_for_each(|g| one(&mut scratch, g))
    }
}

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

/// The pieces of row `r` of block `b` in a tiled file: (file offset, byte offset of the piece
/// within the block's row, elements), one per storage tile the row crosses.
fn row_pieces<'a>(
    h: &'a Header,
    b: &'a Block,
    r: u64,
) -> impl Iterator<Item = (usize, usize, usize)> + 'a {
    let (ti, rr) = (r / h.tile_rows, r % h.tile_rows);
    let es = h.elem() as u64;
    let end = b.c0 + b.cols;
    let mut c = b.c0;
    std::iter::from_fn(move || {
        if c >= end {
            return None;
        }
        let (tj, cc) = (c / h.tile_cols, c % h.tile_cols);
        let n = (h.tile_cols - cc).min(end - c);
        let off = (h.tile_offset(ti, tj) + (rr * h.tile_cols + cc) * es) as usize;
        let item = (off, (c - b.c0) as usize, n as usize);
        c += n;
        Some(item)
    })
}

/// An input matrix file, validated and mapped read-only.
pub struct TiledFile {
    path: PathBuf,
    file: File,
    map: Mmap,
    pub hdr: Header,
}

impl TiledFile {
    pub fn open(path: &Path) -> Result<TiledFile> {
        let file = File::open(path).map_err(|e| Error::io(path, "cannot open matrix file", e))?;
        let meta = file
            .metadata()
            .map_err(|e| Error::io(path, "cannot stat matrix file", e))?;
        if !meta.is_file() {
            return Err(Error::format(path, "is not a regular file"));
        }
        let len = meta.len();
        let mut head = [0u8; 72];
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
            hdr,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn file(&self) -> &File {
        &self.file
    }
    pub fn rows(&self) -> u64 {
        self.hdr.rows
    }
    pub fn cols(&self) -> u64 {
        self.hdr.cols
    }
    pub fn dtype(&self) -> DType {
        self.hdr.dtype
    }

    /// The raw bytes of storage tile (ti, tj), `tile_stride` long.
    pub fn tile_bytes(&self, ti: u64, tj: u64) -> &[u8] {
        let off = self.hdr.tile_offset(ti, tj) as usize;
        &self.map[off..off + self.hdr.tile_stride as usize]
    }

    /// The stored checksum table, if the file has one.
    pub fn checksum_table(&self) -> Option<Vec<u32>> {
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
        let idx = (ti * self.hdr.grid_cols() + tj) as usize;
        let off = self.hdr.checksum_table_offset as usize + 4 * idx;
        let stored = u32::from_le_bytes(self.map[off..off + 4].try_into().unwrap());
        let computed = crc32c::crc32c(self.tile_bytes(ti, tj));
        // Unmap the tile behind us: verification is the only reader of input pages through the
        // map, and without this every verified page would count in the process's RSS (as page
        // cache, reclaimable, but alarming next to `host_memory`).
        let off = self.hdr.tile_offset(ti, tj) as usize;
        // SAFETY: DontNeed on a read-only shared file map only drops this process's page-table
        // entries; the slice borrowed for the CRC above is no longer used, and later reads
        // fault the same file data back in.
        let _ = unsafe {
            self.map.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                off,
                self.hdr.tile_stride as usize,
            )
        };
        if stored != computed {
            return Err(Error::Checksum {
                path: self.path.clone(),
                ti,
                tj,
                stored,
                computed,
            });
        }
        Ok(())
    }

    /// Storage tiles that `b` touches, as (ti, tj) ranges.
    pub fn tiles_of(&self, b: &Block) -> (std::ops::Range<u64>, std::ops::Range<u64>) {
        let h = &self.hdr;
        (
            b.r0 / h.tile_rows..(b.r0 + b.rows).div_ceil(h.tile_rows),
            b.c0 / h.tile_cols..(b.c0 + b.cols).div_ceil(h.tile_cols),
        )
    }

    /// Byte ranges of the map that `b` reads (whole tile rows), for madvise.
    fn ranges_of(&self, b: &Block) -> Vec<(u64, u64)> {
        let h = &self.hdr;
        let (tis, tjs) = self.tiles_of(b);
        let row_bytes = h.tile_cols * h.elem() as u64;
        let mut out = Vec::new();
        for ti in tis {
            let lo = b.r0.max(ti * h.tile_rows) - ti * h.tile_rows;
            let hi = (b.r0 + b.rows).min((ti + 1) * h.tile_rows) - ti * h.tile_rows;
            for tj in tjs.clone() {
                let off = h.tile_offset(ti, tj);
                out.push((off + lo * row_bytes, (hi - lo) * row_bytes));
            }
        }
        out
    }

    /// Ask the kernel to read `b` ahead (asynchronous). Returns bytes advised.
    pub fn will_need(&self, b: &Block) -> u64 {
        let mut total = 0;
        for (off, len) in self.ranges_of(b) {
            let mut o = off;
            while o < off + len {
                let l = ADVISE_CHUNK.min(off + len - o);
                // Advice failures are harmless (it is only a hint).
                let _ = self
                    .map
                    .advise_range(Advice::WillNeed, o as usize, l as usize);
                o += l;
            }
            total += len;
        }
        total
    }

    /// Copy block `b` into `dst` as a dense row-major `b.rows × b.cols` array of `out` elements.
    pub fn read_block(&self, b: &Block, out: DType, dst: &mut [u8]) -> Result<()> {
        let h = &self.hdr;
        if b.r0 + b.rows > h.rows || b.c0 + b.cols > h.cols {
            return Err(Error::format(
                &self.path,
                format!("block {b:?} is outside the {}×{} matrix", h.rows, h.cols),
            ));
        }
        let oe = out.size();
        let row_out = b.cols as usize * oe;
        assert_eq!(dst.len(), b.rows as usize * row_out, "read_block: dst size");
        if !supported(h.dtype, out) {
            return Err(Error::format(
                &self.path,
                format!("cannot read {} data as {}", h.dtype, out),
            ));
        }
        if !use_mmap_io() {
            // pread each contiguous piece straight into the destination (same dtype), or into
            // a scratch block that is then widened.
            let same = h.dtype == out;
            let mut scratch = if same {
                Vec::new()
            } else {
                vec![0u8; b.elems() * h.elem()]
            };
            {
                let raw: &mut [u8] = if same { &mut *dst } else { &mut scratch };
                read_groups(&self.file, &groups(h, b), raw)
                    .map_err(|e| Error::io(&self.path, "cannot read tile data", e))?;
            }
            if !same {
                let (ie, oe) = (h.elem(), out.size());
                const ELEMS: usize = 1 << 16;
                scratch
                    .par_chunks(ELEMS * ie)
                    .zip(dst.par_chunks_mut(ELEMS * oe))
                    .for_each(|(s, d)| {
                        dtype::convert(h.dtype, s, out, d);
                    });
            }
            return Ok(());
        }
        let copy_row = |r: u64, drow: &mut [u8]| {
            for (off, col, n) in row_pieces(h, b, r) {
                let src = &self.map[off..off + n * h.elem()];
                dtype::convert(h.dtype, src, out, &mut drow[col * oe..(col + n) * oe]);
            }
        };
        if dst.len() >= PAR_BYTES && b.rows > 1 {
            dst.par_chunks_mut(row_out)
                .enumerate()
                .for_each(|(i, drow)| copy_row(b.r0 + i as u64, drow));
        } else {
            for (i, drow) in dst.chunks_mut(row_out).enumerate() {
                copy_row(b.r0 + i as u64, drow);
            }
        }
        Ok(())
    }
}

fn supported(from: DType, to: DType) -> bool {
    from == to
        || matches!(
            (from, to),
            (DType::F16, DType::F32)
                | (DType::BF16, DType::F32)
                | (DType::F32, DType::F64)
                | (DType::F64, DType::F32)
        )
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

/// A raw pointer that may cross threads; used only to write disjoint row ranges of one map.
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: the pointer is only dereferenced for disjoint byte ranges (distinct rows of a block),
// so concurrent writers never alias.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    fn get(&self) -> *mut u8 {
        self.0
    }
}

/// An output matrix file being written.
pub struct TiledWriter {
    path: PathBuf,
    file: File,
    map: MmapMut,
    pub hdr: Header,
    /// Checksums of storage tiles already known (computed when a tile is written whole).
    crcs: Mutex<Vec<Option<u32>>>,
    /// The file's blocks are allocated (fallocate), so writes through the map cannot hit ENOSPC
    /// (which a map reports as SIGBUS). Without it, writes go through pwrite.
    prealloc: bool,
}

impl TiledWriter {
    /// Create `path` (replacing an existing file) at its full length, zero-filled.
    pub fn create(path: &Path, hdr: Header) -> Result<TiledWriter> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| Error::io(path, "cannot create output file", e))?;
        Self::init(path, file, hdr, true)
    }

    /// Open an existing output with header `hdr` to continue writing it (resume).
    pub fn reopen(path: &Path, hdr: Header) -> Result<TiledWriter> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| Error::io(path, "cannot reopen output file", e))?;
        let len = file
            .metadata()
            .map_err(|e| Error::io(path, "cannot stat output file", e))?
            .len();
        let mut head = vec![0u8; 72];
        let n =
            read_prefix(&file, &mut head).map_err(|e| Error::io(path, "cannot read header", e))?;
        let found = Header::parse(path, &head[..n], len)?;
        if found != hdr {
            return Err(Error::format(
                path,
                "existing output has a different header than this plan produces; rerun with --restart",
            ));
        }
        Self::init(path, file, hdr, false)
    }

    fn init(path: &Path, file: File, hdr: Header, fresh: bool) -> Result<TiledWriter> {
        if fresh {
            file.write_all_at(&hdr.to_block(), 0)
                .map_err(|e| Error::io(path, "cannot write header", e))?;
            file.set_len(hdr.file_len())
                .map_err(|e| size_error(path, hdr.file_len(), e))?;
        }
        // Reserve every block now: running out of space becomes an error here, before any
        // work, instead of a SIGBUS from a write through the map hours later.
        use std::os::fd::AsRawFd;
        // SAFETY: fallocate on a descriptor we own, within the file's length; no memory involved.
        let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, hdr.file_len() as libc::off_t) };
        let prealloc = if r == 0 {
            true
        } else {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => false,
                _ => return Err(size_error(path, hdr.file_len(), e)),
            }
        };
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
            hdr,
            crcs: Mutex::new(vec![None; n]),
            prealloc,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Write dense row-major `src` (`b.rows × b.cols` elements of `from`) into block `b`, and
    /// return the CRC-32C of the block's bytes in the file's dtype (the resume journal records
    /// it; a storage tile that is exactly the block reuses it for the checksum table).
    /// Takes `&self`: concurrent calls must write disjoint blocks (the writeback stage
    /// guarantees that, one output tile per message).
    pub fn write_block(&self, b: &Block, from: DType, src: &[u8]) -> Result<u32> {
        let h = &self.hdr;
        assert!(
            b.r0 + b.rows <= h.rows && b.c0 + b.cols <= h.cols,
            "write_block: outside"
        );
        assert_eq!(src.len(), b.elems() * from.size(), "write_block: src size");
        let converted;
        let raw: &[u8] = if from == h.dtype {
            src
        } else {
            let mut v = vec![0u8; b.elems() * h.elem()];
            const ELEMS: usize = 1 << 16;
            src.par_chunks(ELEMS * from.size())
                .zip(v.par_chunks_mut(ELEMS * h.elem()))
                .for_each(|(s, d)| {
                    dtype::convert(from, s, h.dtype, d);
                });
            converted = v;
            &converted
        };
        let crc = par_crc32c(raw);
        if use_pwrite() || !self.prealloc {
            write_groups(&self.file, &groups(h, b), raw)
                .map_err(|e| Error::io(&self.path, "cannot write output tile", e))?;
        } else {
            let base = SendPtr(self.map.as_ptr() as *mut u8);
            let map_len = self.map.len();
            let row = b.cols as usize * h.elem();
            let write_row = |r: u64, srow: &[u8]| {
                for (off, col, n) in row_pieces(h, b, r) {
                    let len = n * h.elem();
                    assert!(off + len <= map_len);
                    // SAFETY: `off..off+len` lies inside the map (asserted) and belongs to row
                    // `r` of this block only; callers write disjoint blocks, and rows of one
                    // block are disjoint, so no two threads write the same bytes. The map is
                    // kept alive by `self` for the duration of the call.
                    let d = unsafe { std::slice::from_raw_parts_mut(base.get().add(off), len) };
                    d.copy_from_slice(&srow[col * h.elem()..col * h.elem() + len]);
                }
            };
            if raw.len() >= PAR_BYTES && b.rows > 1 {
                raw.par_chunks(row)
                    .enumerate()
                    .for_each(|(i, s)| write_row(b.r0 + i as u64, s));
            } else {
                for (i, s) in raw.chunks(row).enumerate() {
                    write_row(b.r0 + i as u64, s);
                }
            }
        }
        self.note_checksums(b, Some((crc, raw.len())));
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
        let tis = b.r0 / h.tile_rows..(b.r0 + b.rows).div_ceil(h.tile_rows);
        let tjs = b.c0 / h.tile_cols..(b.c0 + b.cols).div_ceil(h.tile_cols);
        for ti in tis {
            for tj in tjs.clone() {
                let (tr0, tc0) = (ti * h.tile_rows, tj * h.tile_cols);
                let (tr1, tc1) = (
                    ((ti + 1) * h.tile_rows).min(h.rows),
                    ((tj + 1) * h.tile_cols).min(h.cols),
                );
                let full_r = b.r0 <= tr0 && b.r0 + b.rows >= tr1;
                let full_c = b.c0 <= tc0 && b.c0 + b.cols >= tc1;
                if !(full_r && full_c) {
                    continue;
                }
                let exact = (b.r0, b.c0, b.rows, b.cols) == (tr0, tc0, h.tile_rows, h.tile_cols);
                let crc = match raw {
                    Some((c, len)) if exact => {
                        let pad = h.tile_stride as usize - len;
                        crc32c::crc32c_append(c, &vec![0u8; pad])
                    }
                    _ => {
                        let off = h.tile_offset(ti, tj) as usize;
                        par_crc32c(&self.map[off..off + h.tile_stride as usize])
                    }
                };
                self.crcs.lock().unwrap()[(ti * h.grid_cols() + tj) as usize] = Some(crc);
            }
        }
    }

    /// Populate (allocate and map for writing) the pages of the storage tiles block `b` will
    /// write, so that the later copy into them runs at memory speed. A hint: errors (an old
    /// kernel without MADV_POPULATE_WRITE) are ignored. Returns bytes populated.
    pub fn prefault(&self, b: &Block) -> u64 {
        if use_pwrite() || !self.prealloc {
            return 0;
        }
        let h = &self.hdr;
        let tis = b.r0 / h.tile_rows..(b.r0 + b.rows).div_ceil(h.tile_rows);
        let tjs = b.c0 / h.tile_cols..(b.c0 + b.cols).div_ceil(h.tile_cols);
        let mut total = 0;
        for ti in tis {
            let a = h.tile_offset(ti, tjs.start) as usize;
            let z = h.tile_offset(ti, tjs.end - 1) as usize + h.tile_stride as usize;
            if self
                .map
                .advise_range(Advice::PopulateWrite, a, z - a)
                .is_ok()
            {
                total += (z - a) as u64;
            }
        }
        total
    }

    /// Write raw file bytes at `offset` (whole storage tiles, already laid out).
    pub fn write_raw(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        assert!(
            offset >= self.hdr.data_offset && offset + bytes.len() as u64 <= self.hdr.data_end()
        );
        self.file
            .write_all_at(bytes, offset)
            .map_err(|e| Error::io(&self.path, "cannot write matrix data", e))
    }

    /// Flush the bytes of block `b`'s storage tiles to disk (for the resume journal).
    pub fn flush_block(&self, b: &Block) -> Result<()> {
        let h = &self.hdr;
        let tis = b.r0 / h.tile_rows..(b.r0 + b.rows).div_ceil(h.tile_rows);
        let tjs = b.c0 / h.tile_cols..(b.c0 + b.cols).div_ceil(h.tile_cols);
        for ti in tis {
            let a = h.tile_offset(ti, tjs.start) as usize;
            let z = h.tile_offset(ti, tjs.end - 1) as usize + h.tile_stride as usize;
            self.map
                .flush_range(a, z - a)
                .map_err(|e| Error::io(&self.path, "cannot flush output tile to disk", e))?;
        }
        Ok(())
    }

    /// Compute missing checksums, write the table, and (if `durable`) flush everything to disk.
    pub fn finish(mut self, durable: bool) -> Result<()> {
        let h = self.hdr;
        if h.has_checksums() {
            let known = std::mem::take(&mut *self.crcs.lock().unwrap());
            let gc = h.grid_cols();
            let map = &self.map;
            let table: Vec<u32> = known
                .par_iter()
                .enumerate()
                .map(|(i, c)| {
                    c.unwrap_or_else(|| {
                        let off = h.tile_offset(i as u64 / gc, i as u64 % gc) as usize;
                        par_crc32c(&map[off..off + h.tile_stride as usize])
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
        Ok(())
    }

    /// Mark storage tile checksums as unknown (after partial writes on resume).
    pub fn forget_checksums(&self) {
        self.crcs.lock().unwrap().iter_mut().for_each(|c| *c = None);
    }
}

fn size_error(path: &Path, len: u64, e: std::io::Error) -> Error {
    let hint = match e.raw_os_error() {
        Some(libc::ENOSPC) => format!("not enough disk space for the output ({len} bytes); free space or write the output elsewhere"),
        Some(libc::EFBIG) => format!("the output ({len} bytes) exceeds the file-size limit (ulimit -f) or the filesystem's maximum"),
        Some(libc::EDQUOT) => format!("disk quota exceeded reserving {len} bytes for the output"),
        _ => format!("cannot reserve {len} bytes for the output"),
    };
    Error::Format {
        path: path.to_path_buf(),
        msg: format!("{hint}: {e}"),
    }
}

/// Round a byte count to the format's alignment.
pub fn aligned(x: u64) -> u64 {
    super::header::round_up(x, ALIGN)
}
