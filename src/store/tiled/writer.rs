//! The `.mgt` writer: [`TiledWriter`] creates an output at its full length and writes blocks
//! either by copying into a writable map whose pages a prefault stage populated, or by
//! `pwrite` ([`WriteMode`]); `finish` fills in the checksum table and makes the data durable.
//! Format and map safety: [`super`].

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use memmap2::{Advice, MmapMut, MmapOptions};
use rayon::prelude::*;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::store::atomic::TempOutput;
use crate::store::block::Block;
use crate::store::blockio::{par_crc32c, read_prefix, size_error, BlockOut};
use crate::store::fsutil;
use crate::store::header::Header;
use crate::store::runs::Geometry;
use crate::store::seam::{MatrixSink, WriteMode};

/// Zero every storage tile's padding ([`Header::padding`]) of the reopened output `file` where
/// it is not: no tile write covers those bytes, and the checksums computed when the run ends
/// assume them zero (or read them), so a byte damaged there would stay — a repaired file
/// would differ from a clean run — or be blessed by the new table. Read with `pread` (a page
/// or less per tile for most outputs); the rare fix is a `pwrite`.
fn clear_padding(path: &Path, file: &File, hdr: &Header) -> Result<()> {
    let io = |e| Error::io(path, "cannot clear the padding of the output's tiles", e);
    let mut buf = Vec::new();
    for (ti, tj) in (0..hdr.grid_rows()).flat_map(|ti| (0..hdr.grid_cols()).map(move |tj| (ti, tj)))
    {
        for r in hdr.padding(ti, tj) {
            let mut at = r.start;
            while at < r.end {
                let n = ((r.end - at) as usize).min(1 << 20);
                buf.resize(n, 0);
                file.read_exact_at(&mut buf, at).map_err(io)?;
                if buf.iter().any(|&x| x != 0) {
                    buf.fill(0);
                    file.write_all_at(&buf, at).map_err(io)?;
                }
                at += n as u64;
            }
        }
    }
    Ok(())
}

/// An output matrix file being written.
pub(crate) struct TiledWriter {
    path: PathBuf,
    file: File,
    pub(super) map: MmapMut,
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
    /// [`TiledWriter::create_with`] the default write mode (the tests').
    #[cfg(test)]
    pub(crate) fn create(path: &Path, hdr: Header) -> Result<TiledWriter> {
        Self::create_with(path, hdr, WriteMode::default())
    }

    /// [`TiledWriter::create`] with an explicit write mode: `path` as a new file (an existing
    /// one's directory entry is replaced, a link is refused: [`fsutil::open_in_place`]) at its
    /// full length, zero-filled. The header, the file's size and its name in the directory are
    /// synced before any tile is written: a journal record never points into a file that a
    /// power cut could leave headerless (read as zeros) or unnamed.
    pub(crate) fn create_with(path: &Path, hdr: Header, mode: WriteMode) -> Result<TiledWriter> {
        let file = fsutil::open_in_place(path, fsutil::InPlace::New)?;
        let w = Self::init(path, file, hdr, true, mode)?;
        fsutil::sync_file(&w.file, path)?;
        fsutil::sync_parent(path)?;
        Ok(w)
    }

    /// Create the file in the temporary `tmp` (renamed into place by the caller when finished).
    pub(crate) fn create_temp(
        tmp: &TempOutput,
        hdr: Header,
        mode: WriteMode,
    ) -> Result<TiledWriter> {
        let file = (tmp.file().try_clone())
            .map_err(|e| Error::io(tmp.dst(), "cannot create output file", e))?;
        Self::init(tmp.dst(), file, hdr, true, mode)
    }

    /// [`TiledWriter::reopen`] with an explicit write mode.
    pub(crate) fn reopen_with(path: &Path, hdr: Header, mode: WriteMode) -> Result<TiledWriter> {
        let file = fsutil::open_in_place(path, fsutil::InPlace::Existing)?;
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
        } else {
            clear_padding(path, &file, &hdr)?;
        }
        // Reserve every block now: running out of space becomes an error here, before any
        // work, instead of a SIGBUS from a write through the map hours later.
        let prealloc = fsutil::preallocate(&file, hdr.file_len())
            .map_err(|e| size_error(path, hdr.file_len(), e))?;
        // SAFETY: the output is a file this process just created or reopened for writing; the
        // engine holds it for the duration of the job and nothing else may write or truncate
        // it (the job takes an exclusive lock on it, see durable::journal).
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
    fn know_checksum(&self, b: &Block, crc: u32) {
        // Only a block that is exactly one whole storage tile: any other (an edge tile, a
        // compute tile that is not the storage tile) would be read again here, one by one on
        // the caller's thread, where `finish` reads what is left on every core.
        let exact = self
            .geo
            .tiles_iter(b)
            .any(|(ti, tj)| self.geo.is_exact_tile(b, ti, tj));
        if exact {
            let len = b.elems() * self.hdr.dtype.size();
            self.note_checksums(b, Some((crc, len)));
        }
    }
    fn finish(self: Box<Self>, durable: bool) -> Result<()> {
        TiledWriter::finish(*self, durable)
    }
}
