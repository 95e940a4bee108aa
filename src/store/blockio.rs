//! Block I/O that every file format shares: a block's runs ([`super::runs`]) read with
//! parallel `pread`s or copied out of the file's map where cached ([`ReadFrom`]), handing each
//! piece to a visitor while it is in cache; written with `pwrite` or copied into a writable
//! map ([`BlockOut`]); dtype conversion and CRC-32C on the rayon pool; and the error a failed
//! reservation of an output's space gives.
//!
//! Below the formats: the `.mgt` reader and writer ([`super::tiled`]), the row-major reader
//! behind `.npy` and raw files ([`super::rowmajor`]) and the `.npy` writer ([`super::npy_sink`])
//! import it; it knows none of them.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use memmap2::MmapMut;
use rayon::prelude::*;

use super::block::Block;
use super::runs::{runs, Geometry, Run, IO_SPAN};
use crate::dtype::{self, DType};
use crate::error::{Error, Result};

/// Blocks bigger than this are copied by several threads.
const PAR_BYTES: usize = 1 << 20;
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

/// Where a block's runs are read from: the open file, with `pread`s, and — where the page cache
/// can likely hold the whole file ([`super::fsutil::cache_holds`]) and `mincore` tells its
/// cached pages ([`super::fsutil::mincore_tells`]), as the reader judges when it opens the
/// file — its read-only map, which a run whose pages are already cached is copied out of instead.
///
/// Why the map: on the H100 host a fresh map copied out by 16 threads ran at 85 GiB/s against
/// 48 GiB/s for `pread`s of the same cached file (`tools/bench/host_read_rates.py`,
/// docs/measurements/HISTORY.md §35), and a row-major file's narrow block is one `pread` per row
/// (64 KiB rows of a 32768-wide f64 `.npy`): staging's copies of such blocks were what the GPU
/// waited for in fp64 (§40). Only for files the cache holds: pages mapped into the process are
/// harder for the kernel to reclaim than cached ones, so a file larger than half of the memory
/// available (read more than once, from disk) is read with `pread`s only. The mapped pages stay
/// mapped until the file is closed: dropping them after each copy costs a TLB shootdown on every
/// thread of the process.
#[derive(Clone, Copy)]
pub(crate) struct ReadFrom<'a> {
    pub(crate) file: &'a File,
    pub(crate) map: Option<&'a [u8]>,
}

impl<'a> ReadFrom<'a> {
    /// `file`, and its `map` when `cached` (the page cache can hold the file) and
    /// `MGMM_READ_PREAD` does not ask for `pread`s only ([`crate::config::read_with_pread`]).
    pub(crate) fn new(file: &'a File, map: &'a [u8], cached: bool) -> ReadFrom<'a> {
        ReadFrom {
            file,
            map: (cached && !crate::config::read_with_pread()).then_some(map),
        }
    }

    /// The map to copy run `g` out of: when there is one and at least 90 % of the pages of the
    /// run's span are in the page cache (`mincore`).
    fn mapped(&self, g: &Run) -> Option<&'a [u8]> {
        self.map
            .filter(|m| g.file_span().end <= m.len() as u64)
            .filter(|m| super::fsutil::resident(m, g.file_span(), 0.9))
    }
}

/// Read every run of a block from `from` into `raw` (the dense block, file dtype), in parallel
/// on the rayon pool, one [`read_run_visiting`] per run.
pub(crate) fn read_runs(from: ReadFrom, rs: &[Run], raw: &mut [u8]) -> std::io::Result<()> {
    read_runs_with(from, rs, raw, |_| (), |_, _| ()).map(|_| ())
}

/// [`read_runs`], handing every piece read to `visit` with that run's state (made by `init`),
/// while the piece is still in cache; returns the runs' states in the order of `rs`.
pub(crate) fn read_runs_with<S: Send>(
    from: ReadFrom,
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
            let mut visit = |piece: &[u8]| visit(&mut state, piece);
            match from.mapped(g) {
                Some(map) => copy_run_visiting(map, g, span, &mut visit),
                None => read_run_visiting(from.file, g, span, scratch, &mut visit)?,
            }
            Ok(state)
        })
        .collect()
}

/// Bytes per `pread` in [`read_run_visiting`] (and per copy in [`copy_run_visiting`]): small
/// enough that the piece is still in the core's cache when it is checksummed, counted and (for
/// runs strided in the block) scattered.
const VISIT_PIECE: usize = 512 << 10;

/// Copy run `g` out of `map` (the file's read-only map; the run lies inside it) into `span`
/// (its bytes of the dense block buffer), handing each piece to `visit` in file order right
/// after it is copied, as [`read_run_visiting`] does: a row at a time, in pieces of at most
/// [`VISIT_PIECE`] bytes (a run whose rows are back to back in both is one row).
fn copy_run_visiting(map: &[u8], g: &Run, span: &mut [u8], visit: &mut impl FnMut(&[u8])) {
    let (rows, row_len) = if g.file_contiguous() && g.buf_contiguous() {
        (1, g.bytes())
    } else {
        (g.rows, g.row_len)
    };
    for r in 0..rows {
        let f = (g.file_off + r as u64 * g.file_pitch) as usize;
        let b = r * g.buf_pitch;
        let mut o = 0;
        while o < row_len {
            let l = (row_len - o).min(VISIT_PIECE);
            let d = &mut span[b + o..b + o + l];
            d.copy_from_slice(&map[f + o..f + o + l]);
            visit(d);
            o += l;
        }
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

/// Read `f` from its start into `buf` until `buf` is full or the file ends: the bytes read.
pub(crate) fn read_prefix(f: &File, buf: &mut [u8]) -> std::io::Result<usize> {
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

/// A failed write of the `len`-byte file `path`: a full disk, the file-size limit or a quota
/// said as [`size_error`] says it, anything else as it is.
pub(crate) fn write_error(path: &Path, len: u64, e: std::io::Error) -> Error {
    use rustix::io::Errno;
    let code = e.raw_os_error();
    if [Errno::NOSPC, Errno::FBIG, Errno::DQUOT]
        .iter()
        .any(|c| code == Some(c.raw_os_error()))
    {
        size_error(path, len, e)
    } else {
        Error::io(path, "cannot write", e)
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

    /// Every block of `geo` in `bh × bw` blocks (edges partial).
    fn blocks(geo: &Geometry, bh: u64, bw: u64) -> Vec<Block> {
        let mut v = Vec::new();
        for r0 in (0..geo.rows).step_by(bh as usize) {
            for c0 in (0..geo.cols).step_by(bw as usize) {
                v.push(Block {
                    r0,
                    c0,
                    rows: bh.min(geo.rows - r0),
                    cols: bw.min(geo.cols - c0),
                });
            }
        }
        v
    }

    /// Copies out of the map give the bytes `pread`s give, and hand the visitor the same pieces'
    /// bytes in the same order (the CRC of each run, which the `.mgt` reader's checks rely on):
    /// row-major and tiled layouts, blocks straddling storage tiles, runs back to back in the
    /// file, in the buffer, in both and in neither, and runs cut by a small span.
    #[test]
    fn copies_out_of_the_map_match_preads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.bin");
        let bytes: Vec<u8> = (0..300_000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        std::fs::write(&path, &bytes).unwrap();
        let file = File::open(&path).unwrap();
        // SAFETY: a read-only map of a file this test wrote and does not change.
        let map = unsafe { memmap2::Mmap::map(&file).unwrap() };
        let _ = std::fs::read(&path).unwrap(); // in the page cache
        let layouts = [
            Geometry::row_major(37, 211, 4, 100),
            Geometry::row_major(211, 37, 8, 8),
            Geometry {
                rows: 45,
                cols: 70,
                tile_rows: 16,
                tile_cols: 24,
                elem: 4,
                data_offset: 4096,
                tile_stride: 16 * 24 * 4 + 64,
            },
        ];
        let mut mapped_runs = 0;
        for geo in &layouts {
            for (bh, bw) in [(geo.rows, geo.cols), (10, 13), (17, 70), (45, 5)] {
                for span in [IO_SPAN, 300] {
                    for b in blocks(geo, bh, bw) {
                        let rs: Vec<Run> = runs(geo, &b, span).collect();
                        let n = b.elems() * geo.elem as usize;
                        let (mut a, mut m) = (vec![0u8; n], vec![1u8; n]);
                        let crc = |c: &mut u32, p: &[u8]| *c = crc32c::crc32c_append(*c, p);
                        let pread = ReadFrom {
                            file: &file,
                            map: None,
                        };
                        let ca = read_runs_with(pread, &rs, &mut a, |_| 0u32, crc).unwrap();
                        let from = ReadFrom::new(&file, &map, true);
                        mapped_runs += rs.iter().filter(|g| from.mapped(g).is_some()).count();
                        let cm = read_runs_with(from, &rs, &mut m, |_| 0u32, crc).unwrap();
                        assert_eq!(a, m, "{geo:?} {b:?} span {span}");
                        assert_eq!(ca, cm, "{geo:?} {b:?} span {span}");
                        // And the bytes are the file's.
                        for (i, g) in rs.iter().enumerate() {
                            let mut want = 0u32;
                            for r in 0..g.rows {
                                let (fo, _) = g.row(r);
                                crc(&mut want, &bytes[fo as usize..fo as usize + g.row_len]);
                            }
                            assert_eq!(ca[i], want, "{geo:?} {b:?} run {i}");
                        }
                    }
                }
            }
        }
        if !crate::config::read_with_pread() {
            assert!(mapped_runs > 0, "no run was copied out of the map");
        }
        // Without the cache's room (or a map), every run is read with `pread`.
        let g = runs(&layouts[0], &blocks(&layouts[0], 10, 13)[0], IO_SPAN)
            .next()
            .unwrap();
        assert!(ReadFrom::new(&file, &map, false).mapped(&g).is_none());
    }
}
