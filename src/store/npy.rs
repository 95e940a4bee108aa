//! `.npy` import and export, streaming, so a 30 GB array never needs 30 GB of RAM.
//!
//! Import reads anything a source reads ([`SourceSpec`]) into a new `.mgt` file; export writes
//! any source as a `.npy` array that appears only when complete ([`super::atomic`]). The header
//! itself is parsed and written in [`super::npy_header`] (strictly: see there for what is
//! accepted), whose public names are re-exported here.

use std::io::{BufWriter, Write};
use std::path::Path;

use super::block::Block;
use super::blockio::write_error;
use super::header::Header;
use super::npy_header::header_bytes_order;
pub use super::npy_header::{header_bytes, read_header, NpyHeader};
use super::source::SourceSpec;
use super::tiled::TiledWriter;
use crate::error::{Error, Result};

/// Rows moved per chunk are sized to about this many bytes.
const CHUNK_BYTES: usize = 64 << 20;

/// Import `src` into a new tiled file `dst` with storage tiles `tile`. `src` is anything a
/// source reads: a `.npy` array (C or Fortran order, f16/f32/f64), a `.mgt` file, or a raw
/// descriptor `raw:rows=R,cols=C,dtype=D[,order=F][,offset=N]:PATH`.
pub(crate) fn import(src: &Path, dst: &Path, tile: (u64, u64)) -> Result<Header> {
    let spec = SourceSpec::parse_arg(&src.to_string_lossy())?;
    let s = spec.open(false)?;
    let (sr, sc) = s.shape();
    let t = s.transposed();
    let (rows, cols) = if t { (sc, sr) } else { (sr, sc) };
    let hdr = Header::new(
        s.dtype(),
        rows,
        cols,
        tile.0.min(rows).max(1),
        tile.1.min(cols).max(1),
        true,
    );
    // Written under a temporary name after a free-space check and renamed when complete, like
    // `gen` and `export`: a kill, a full disk or a file-size limit leaves nothing at `dst`, and
    // `--force` replaces its directory entry, never the file (or link target) it names.
    let tmp = super::atomic::TempOutput::new(dst, hdr.file_len())?;
    let w = TiledWriter::create_temp(&tmp, hdr, Default::default())?;
    let es = s.dtype().size();
    // Stored blocks: whole row bands for a C-order source; for a transposed one, blocks of
    // `tile.1` stored rows (output columns) so each transposed block fills whole output tiles.
    let band = if t {
        hdr.tile_cols
    } else {
        (CHUNK_BYTES / (sc as usize * es)).max(1) as u64
    };
    let width = if t {
        ((CHUNK_BYTES / (band as usize * es)) as u64 / hdr.tile_rows).max(1) * hdr.tile_rows
    } else {
        sc
    };
    let (mut buf, mut tr) = (Vec::new(), Vec::new());
    for r0 in (0..sr).step_by(band as usize) {
        if crate::interrupt::requested() {
            return Err(Error::Usage(format!(
                "interrupted; {} was not written (run the same command again)",
                dst.display()
            )));
        }
        for c0 in (0..sc).step_by(width as usize) {
            let b = Block {
                r0,
                c0,
                rows: band.min(sr - r0),
                cols: width.min(sc - c0),
            };
            s.verify_block(&b)?;
            buf.resize(b.elems() * es, 0);
            s.read_block(&b, s.dtype(), &mut buf)?;
            if !t {
                w.write_block(&b, s.dtype(), &buf)?;
                continue;
            }
            tr.resize(buf.len(), 0);
            transpose_bytes(&buf, b.rows as usize, b.cols as usize, es, &mut tr);
            let out = Block {
                r0: c0,
                c0: r0,
                rows: b.cols,
                cols: b.rows,
            };
            w.write_block(&out, s.dtype(), &tr)?;
        }
    }
    w.finish(true)?;
    tmp.commit()?;
    Ok(hdr)
}

/// Transpose a dense row-major `rows × cols` array of `es`-byte elements into `dst`.
fn transpose_bytes(src: &[u8], rows: usize, cols: usize, es: usize, dst: &mut [u8]) {
    const B: usize = 64;
    for i0 in (0..rows).step_by(B) {
        for j0 in (0..cols).step_by(B) {
            for i in i0..(i0 + B).min(rows) {
                for j in j0..(j0 + B).min(cols) {
                    let (s, d) = ((i * cols + j) * es, (j * rows + i) * es);
                    dst[d..d + es].copy_from_slice(&src[s..s + es]);
                }
            }
        }
    }
}

/// Export tiled file `src` to `dst` (.npy). 16-bit files are widened to f32. `dst` appears only
/// when complete. With `verify`, a tile whose checksum does not match stops it with an error
/// naming the tile (without: an unfinished output, whose missing tiles have no checksum yet).
pub(crate) fn export(src: &Path, dst: &Path, verify: bool) -> Result<()> {
    // Any source (.mgt, .npy, raw:…); a transposed (column-major) one is written as a
    // Fortran-order array, byte for byte its stored row-major transpose.
    let t = SourceSpec::parse_arg(&src.to_string_lossy())?.open(!verify)?;
    let (rows, cols) = t.shape();
    let out_dt = t.dtype().compute();
    let head = if t.transposed() {
        header_bytes_order(out_dt, cols, rows, true)?
    } else {
        header_bytes(out_dt, rows, cols)?
    };
    // Written under a temporary name after a free-space check and renamed when complete; on
    // any error (ENOSPC, EFBIG, Ctrl-C) the partial file is removed (`TempOutput`'s drop).
    let need = head.len() as u64 + rows * cols * out_dt.size() as u64;
    let tmp = super::atomic::TempOutput::new(dst, need)?;
    let mut w = BufWriter::with_capacity(8 << 20, tmp.file());
    w.write_all(&head).map_err(|e| write_error(dst, need, e))?;
    let row_bytes = (cols as usize) * out_dt.size();
    let chunk_rows = (CHUNK_BYTES / row_bytes).max(1) as u64;
    let mut buf = Vec::new();
    let mut r0 = 0;
    while r0 < rows {
        if crate::interrupt::requested() {
            return Err(Error::Usage(format!(
                "interrupted; {} was not written (run the same command again)",
                dst.display()
            )));
        }
        let n = chunk_rows.min(rows - r0);
        buf.resize(n as usize * row_bytes, 0);
        // Checked against the source's tile CRCs on the way (each tile once): a `.npy` has
        // none, so corruption exported here would travel on unnoticed.
        t.read_staged(
            &Block {
                r0,
                c0: 0,
                rows: n,
                cols,
            },
            out_dt,
            &mut buf,
            verify,
        )?;
        w.write_all(&buf).map_err(|e| write_error(dst, need, e))?;
        r0 += n;
    }
    let f = w
        .into_inner()
        .map_err(|e| write_error(dst, need, e.into_error()))?;
    f.sync_all().map_err(|e| Error::io(dst, "cannot sync", e))?;
    tmp.commit()
}
