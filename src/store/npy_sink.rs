//! `.npy` outputs written directly (`output = "C.npy"`): the [`MatrixSink`] that saves the
//! export pass.
//!
//! The file is a valid C-order `.npy` array of `<f4` or `<f8` whose header is padded so that the
//! data starts at byte 4096 (numpy needs only 64; 4096 keeps every row band page-aligned for the
//! writable map and for `np.load(..., mmap_mode="r")`). Blocks are written like a `.mgt`
//! output's — through a prefaulted writable map or with `pwrite` ([`WriteMode`]) — and the
//! per-tile CRCs that `.mgt` keeps in its table go to the sidecar `C.npy.crc32c`
//! ([`super::sidecar::Sidecar`]), written by `finish`. The sidecar's tiles are the output's
//! storage tiles; `info --check`, `verify` and later steps reading the array check them.
//!
//! Until the last tile is durable the file carries a header numpy refuses
//! ([`unfinished_header`], [`UNFINISHED`]): an output cut short by a kill is not an array a user
//! can load with zeros where tiles are missing. `finish` writes the real header last.
//!
//! Memory-map safety: as for `.mgt` outputs ([`super::tiled`]), the output is created or
//! reopened by this process and locked through its journal for the whole step.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use memmap2::{Advice, MmapMut, MmapOptions};
use rayon::prelude::*;

use super::atomic::TempOutput;
use super::block::Block;
use super::blockio::{size_error, BlockOut};
use super::fsutil;
use super::header::Header;
use super::npy_header::{read_header, NpyHeader, UNFINISHED};
use super::runs::Geometry;
use super::seam::{MatrixSink, WriteMode};
use super::sidecar::{clip_tile, sidecar_path, Sidecar, TileCrcs};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Where the data of every `.npy` output starts.
pub(crate) const DATA_OFFSET: u64 = 4096;

/// The 4096-byte header of a finished C-order `.npy` output.
pub(crate) fn header(dtype: DType, rows: u64, cols: u64) -> Result<Vec<u8>> {
    head(dtype, rows, cols, false)
}

/// The 4096-byte header an output carries until its last tile is durable: one numpy refuses
/// ([`UNFINISHED`]), the data at the same offset.
pub(crate) fn unfinished_header(dtype: DType, rows: u64, cols: u64) -> Result<Vec<u8>> {
    head(dtype, rows, cols, true)
}

fn head(dtype: DType, rows: u64, cols: u64, unfinished: bool) -> Result<Vec<u8>> {
    let descr = match dtype {
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        other => {
            return Err(Error::Usage(format!(
                "cannot write {other} data to .npy (f32 and f64 only)"
            )))
        }
    };
    let mut dict =
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    if unfinished {
        dict = format!("'{UNFINISHED}', {dict}");
    }
    let mut out = Vec::with_capacity(DATA_OFFSET as usize);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&((DATA_OFFSET - 10) as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out.resize(DATA_OFFSET as usize - 1, b' ');
    out.push(b'\n');
    Ok(out)
}

/// File length of the `.npy` output for `hdr` (sidecar included).
pub(crate) fn file_len(hdr: &Header) -> u64 {
    let tiles = hdr.rows.div_ceil(hdr.tile_rows) * hdr.cols.div_ceil(hdr.tile_cols);
    npy_len(hdr) + 60 + 4 * tiles
}

/// The length of the `.npy` file alone, without its checksum sidecar.
pub(crate) fn npy_len(hdr: &Header) -> u64 {
    DATA_OFFSET + hdr.rows * hdr.cols * hdr.dtype.size() as u64
}

/// A `.npy` output being written.
pub(crate) struct NpyWriter {
    path: PathBuf,
    file: File,
    map: MmapMut,
    geo: Geometry,
    dtype: DType,
    tile: (u64, u64),
    len: u64,
    crcs: Mutex<Vec<Option<u32>>>,
    pwrite: bool,
    /// The finished array's header, written over the unfinished one by `finish`.
    head: Vec<u8>,
}

/// Why an existing `.npy` whose header is `found` is not the output `run` writes for an array
/// `want` = (dtype, rows, cols) (another shape or dtype, Fortran order, or its data elsewhere
/// than at [`DATA_OFFSET`]: a file rewritten by another program, such as numpy's `np.save` of
/// the array), or `None`.
pub(crate) fn not_as_written(found: &NpyHeader, want: (DType, u64, u64)) -> Option<String> {
    let (dtype, rows, cols) = want;
    let shape = |d: DType, r: u64, c: u64, f: bool| {
        format!("{r}×{c} {d}{}", if f { " in Fortran order" } else { "" })
    };
    if (found.dtype, found.rows, found.cols, found.fortran) != (dtype, rows, cols, false) {
        return Some(format!(
            "its header says {}, where this step writes {}",
            shape(found.dtype, found.rows, found.cols, found.fortran),
            shape(dtype, rows, cols, false)
        ));
    }
    (found.data_offset != DATA_OFFSET).then(|| {
        format!(
            "its data start at byte {}, not at {DATA_OFFSET} where `run` writes them: the file was rewritten by another program (numpy's `np.save`, say)",
            found.data_offset
        )
    })
}

/// [`not_as_written`] for the `.npy` at `path` (`None` also when it cannot be read: the
/// commands that open it say why).
pub(crate) fn not_as_written_at(path: &Path, want: (DType, u64, u64)) -> Option<String> {
    let f = std::fs::File::open(path).ok()?;
    not_as_written(&read_header(path, &mut &f).ok()?, want)
}

impl NpyWriter {
    /// Create `path` (replacing it and removing a stale sidecar) for the matrix `hdr` describes,
    /// with the header numpy refuses ([`unfinished_header`]) until `finish`. The header, the
    /// file's size and its name in the directory are synced before any tile is written, so a
    /// journal record never points into a file a power cut could leave headerless or unnamed.
    pub(crate) fn create(path: &Path, hdr: &Header, mode: WriteMode) -> Result<NpyWriter> {
        let _ = std::fs::remove_file(sidecar_path(path));
        let file = fsutil::open_in_place(path, fsutil::InPlace::New)?;
        let w = Self::start(path, file, hdr, mode)?;
        fsutil::sync_parent(path)?;
        Ok(w)
    }

    /// Create the array in the temporary `tmp` (renamed into place by the caller): a split
    /// step's output, which `prepare` makes whole before any shard writes.
    pub(crate) fn create_temp(
        tmp: &TempOutput,
        hdr: &Header,
        mode: WriteMode,
    ) -> Result<NpyWriter> {
        let file = (tmp.file().try_clone())
            .map_err(|e| Error::io(tmp.dst(), "cannot create output file", e))?;
        Self::start(tmp.dst(), file, hdr, mode)
    }

    /// The unfinished header, the file's size, synced.
    fn start(path: &Path, file: File, hdr: &Header, mode: WriteMode) -> Result<NpyWriter> {
        file.write_all_at(&unfinished_header(hdr.dtype, hdr.rows, hdr.cols)?, 0)
            .map_err(|e| Error::io(path, "cannot write .npy header", e))?;
        let w = Self::init(path, file, hdr, mode)?;
        fsutil::sync_file(&w.file, path)?;
        Ok(w)
    }

    /// Reopen a partly written output to resume it; its header must be the one `hdr` gives,
    /// unfinished or (an output being repaired, or one whose run was stopped between writing
    /// its header and the journal's completion record) finished — then it is marked
    /// unfinished again, and synced, before any tile is written.
    pub(crate) fn reopen(path: &Path, hdr: &Header, mode: WriteMode) -> Result<NpyWriter> {
        let file = fsutil::open_in_place(path, fsutil::InPlace::Existing)?;
        let found: NpyHeader = read_header(path, &mut &file)?;
        if let Some(why) = not_as_written(&found, (hdr.dtype, hdr.rows, hdr.cols)) {
            return Err(Error::format(
                path,
                format!("existing output: {why}; rerun with --restart"),
            ));
        }
        // Accepted for writing: the sidecar describes the array as it was, not as it will be.
        let _ = std::fs::remove_file(sidecar_path(path));
        if !found.unfinished {
            file.write_all_at(&unfinished_header(hdr.dtype, hdr.rows, hdr.cols)?, 0)
                .map_err(|e| Error::io(path, "cannot write .npy header", e))?;
            fsutil::sync_file(&file, path)?;
        }
        Self::init(path, file, hdr, mode)
    }

    fn init(path: &Path, file: File, hdr: &Header, mode: WriteMode) -> Result<NpyWriter> {
        let es = hdr.dtype.size() as u64;
        let len = DATA_OFFSET + hdr.rows * hdr.cols * es;
        file.set_len(len).map_err(|e| size_error(path, len, e))?;
        let prealloc = fsutil::preallocate(&file, len).map_err(|e| size_error(path, len, e))?;
        // SAFETY: the output is a file this process just created or reopened for writing and
        // sized to `len`; the job locks its journal, and nothing else may write or truncate it.
        let map = unsafe { MmapOptions::new().len(len as usize).map_mut(&file) }
            .map_err(|e| Error::io(path, "cannot memory-map output file", e))?;
        let tile = (hdr.tile_rows, hdr.tile_cols);
        let n = (hdr.rows.div_ceil(tile.0) * hdr.cols.div_ceil(tile.1)) as usize;
        Ok(NpyWriter {
            path: path.to_path_buf(),
            file,
            map,
            geo: Geometry::row_major(hdr.rows, hdr.cols, es, DATA_OFFSET),
            dtype: hdr.dtype,
            tile,
            len,
            crcs: Mutex::new(vec![None; n]),
            pwrite: mode == WriteMode::Pwrite || !prealloc,
            head: header(hdr.dtype, hdr.rows, hdr.cols)?,
        })
    }

    /// The checksum-tile grid as a geometry (for tile indices).
    fn tile_geo(&self) -> Geometry {
        Geometry {
            tile_rows: self.tile.0,
            tile_cols: self.tile.1,
            ..self.geo
        }
    }

    /// CRC-32C of checksum tile (ti, tj), row by row from the map.
    fn tile_crc(&self, ti: u64, tj: u64) -> u32 {
        let b = clip_tile(&self.geo, self.tile, ti, tj);
        let es = self.geo.elem;
        let mut crc = 0;
        for r in b.r0..b.r0 + b.rows {
            let off = (DATA_OFFSET + (r * self.geo.cols + b.c0) * es) as usize;
            crc = crc32c::crc32c_append(crc, &self.map[off..off + (b.cols * es) as usize]);
        }
        crc
    }

    /// File byte ranges holding block `b`: one span from its first to its last row.
    fn span(&self, b: &Block) -> (usize, usize) {
        let es = self.geo.elem;
        let a = DATA_OFFSET + (b.r0 * self.geo.cols + b.c0) * es;
        let e = DATA_OFFSET + ((b.r0 + b.rows - 1) * self.geo.cols + b.c0 + b.cols) * es;
        (a as usize, (e - a) as usize)
    }
}

impl MatrixSink for NpyWriter {
    fn path(&self) -> &Path {
        &self.path
    }
    fn shape(&self) -> (u64, u64) {
        (self.geo.rows, self.geo.cols)
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn storage_tile(&self) -> (u64, u64) {
        self.tile
    }
    fn write_block(&self, b: &Block, host: DType, src: &[u8]) -> Result<u32> {
        assert!(
            b.r0 + b.rows <= self.geo.rows && b.c0 + b.cols <= self.geo.cols,
            "write_block: outside"
        );
        let out = BlockOut {
            geo: &self.geo,
            file: &self.file,
            map: &self.map,
            path: &self.path,
            pwrite: self.pwrite,
        };
        let (crc, _) = out.write(b, host, self.dtype, src)?;
        self.know_checksum(b, crc);
        Ok(crc)
    }
    fn know_checksum(&self, b: &Block, crc: u32) {
        // A block that is exactly one checksum tile (clipped at the edges) has the tile's CRC.
        let tg = self.tile_geo();
        if b.r0.is_multiple_of(self.tile.0) && b.c0.is_multiple_of(self.tile.1) {
            let (ti, tj) = (b.r0 / self.tile.0, b.c0 / self.tile.1);
            if clip_tile(&self.geo, self.tile, ti, tj) == *b {
                self.crcs.lock().unwrap()[tg.tile_index(ti, tj)] = Some(crc);
            }
        }
    }
    fn prefault(&self, b: &Block) -> u64 {
        if self.pwrite {
            return 0;
        }
        let (a, len) = self.span(b);
        if self.map.advise_range(Advice::PopulateWrite, a, len).is_ok() {
            len as u64
        } else {
            0
        }
    }
    fn counts_dirty_pages(&self) -> bool {
        super::fsutil::counts_dirty_pages(&self.file)
    }
    fn write_mode(&self) -> &'static str {
        WriteMode::of_file(self.pwrite).name()
    }
    fn flush_block(&self, b: &Block) -> Result<()> {
        let (a, len) = self.span(b);
        self.map
            .flush_range(a, len)
            .map_err(|e| Error::io(&self.path, "cannot flush output tile to disk", e))
    }
    fn forget_checksums(&self) {
        self.crcs.lock().unwrap().iter_mut().for_each(|c| *c = None);
    }
    fn finish(self: Box<Self>, durable: bool) -> Result<()> {
        let known = std::mem::take(&mut *self.crcs.lock().unwrap());
        let gc = self.geo.cols.div_ceil(self.tile.1);
        let crcs: Vec<u32> = known
            .par_iter()
            .enumerate()
            .map(|(i, c)| c.unwrap_or_else(|| self.tile_crc(i as u64 / gc, i as u64 % gc)))
            .collect();
        if durable {
            self.map
                .flush()
                .map_err(|e| Error::io(&self.path, "cannot flush output to disk", e))?;
            fsutil::sync_file(&self.file, &self.path)?;
        }
        let side = Sidecar {
            dtype: self.dtype,
            rows: self.geo.rows,
            cols: self.geo.cols,
            data_offset: DATA_OFFSET,
            file_len: self.len,
            crcs: TileCrcs {
                tile: self.tile,
                crcs,
            },
        };
        let NpyWriter {
            path,
            map,
            file,
            head,
            ..
        } = *self;
        super::fsutil::unmap_in_background(map);
        write_sidecar(&path, &side, durable)?;
        // Last, once every tile (and, when durable, the data) is on disk: the real header,
        // which makes the file an array numpy loads.
        file.write_all_at(&head, 0)
            .map_err(|e| Error::io(&path, "cannot write .npy header", e))?;
        if durable {
            fsutil::sync_file(&file, &path)?;
        }
        Ok(())
    }
}

/// Write the sidecar of `npy` atomically (temporary file, then rename: [`TempOutput`]); synced
/// to disk only when `durable` (`engine.durable`).
pub(crate) fn write_sidecar(npy: &Path, side: &Sidecar, durable: bool) -> Result<()> {
    let sp = sidecar_path(npy);
    let bytes = side.encode();
    let tmp = TempOutput::new(&sp, bytes.len() as u64)?;
    tmp.file()
        .write_all_at(&bytes, 0)
        .map_err(|e| Error::io(&sp, "cannot write sidecar", e))?;
    tmp.commit_with(durable)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The unfinished header is the finished one's size, numpy would refuse it (the text after
    /// the 10-byte preamble is not a dict), and the engine reads it back as what it describes,
    /// marked unfinished.
    #[test]
    fn the_unfinished_header_reads_back_as_unfinished() {
        let (done, open) = (
            header(DType::F64, 70000, 3).unwrap(),
            unfinished_header(DType::F64, 70000, 3).unwrap(),
        );
        assert_eq!((done.len(), open.len()), (4096, 4096));
        assert_eq!(done[10], b'{');
        assert_eq!(open[10], b'\'');
        for (bytes, unfinished) in [(&done, false), (&open, true)] {
            let h = read_header(Path::new("C.npy"), &mut &bytes[..]).unwrap();
            assert_eq!(
                (h.dtype, h.rows, h.cols, h.data_offset, h.unfinished),
                (DType::F64, 70000, 3, DATA_OFFSET, unfinished)
            );
        }
    }
}
