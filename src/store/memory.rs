//! A matrix held in host memory: an intermediate of a whole-expression chain small enough not
//! to go through the disk.
//!
//! One [`MemoryMatrix`] is both ends of the storage seam: the step that produces the
//! intermediate writes blocks into it through a [`MemoryWriter`] (a [`MatrixSink`]), and the
//! next step reads blocks from it as a [`MatrixSource`] (handed to the pipeline through
//! [`crate::pipeline::StepSources`], the seam the library API already uses for arrays in
//! memory). It stores exactly what the temporary `.mgt` file would store — the same dtype, the
//! same conversions on the way in and out — so a chain computes the same bytes either way.
//!
//! The data is cut into the producing step's output tiles, each behind its own `RwLock`: the
//! pipeline's writeback threads write disjoint tiles concurrently and the next step's lanes read
//! concurrently, all in safe code. The run loop of the chain owns the matrix (an `Arc`) and drops
//! it when the step that reads it completes; nothing of it survives the process, so a resumed
//! chain computes it again ([`crate::run`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use rayon::prelude::*;

use super::block::Block;
use super::blockio::par_crc32c;
use super::seam::{MatrixSink, MatrixSource};
use crate::dtype::{self, DType};
use crate::error::{Error, Result};

/// A row-major matrix in host memory, stored as a grid of tiles.
pub(crate) struct MemoryMatrix {
    /// The temporary file it stands in for, for messages.
    label: PathBuf,
    rows: u64,
    cols: u64,
    dtype: DType,
    /// Tile edge (rows, cols); edge tiles are smaller.
    tile: (u64, u64),
    /// Tiles in row-major grid order, each a dense row-major array of its own shape.
    tiles: Vec<RwLock<Vec<u8>>>,
}

impl MemoryMatrix {
    /// A zeroed `rows × cols` matrix of `dtype` in `tile`-sized pieces, standing for `label`.
    /// An allocation the host cannot make is an error, not an abort.
    pub(crate) fn new(
        label: &Path,
        (rows, cols): (u64, u64),
        dtype: DType,
        tile: (u64, u64),
    ) -> Result<MemoryMatrix> {
        let tile = (tile.0.clamp(1, rows.max(1)), tile.1.clamp(1, cols.max(1)));
        let (gr, gc) = (rows.div_ceil(tile.0), cols.div_ceil(tile.1));
        let mut tiles = Vec::with_capacity((gr * gc) as usize);
        for ti in 0..gr {
            for tj in 0..gc {
                let h = tile.0.min(rows - ti * tile.0);
                let w = tile.1.min(cols - tj * tile.1);
                let bytes = (h * w) as usize * dtype.size();
                let mut v = Vec::new();
                v.try_reserve_exact(bytes).map_err(|_| {
                    Error::format(
                        label,
                        format!(
                            "cannot allocate {} bytes of host memory for this intermediate of the chain; lower engine.host_memory so that it goes to a temporary file instead",
                            rows * cols * dtype.size() as u64
                        ),
                    )
                })?;
                v.resize(bytes, 0);
                tiles.push(RwLock::new(v));
            }
        }
        Ok(MemoryMatrix {
            label: label.to_path_buf(),
            rows,
            cols,
            dtype,
            tile,
            tiles,
        })
    }

    /// Bytes of data held.
    pub(crate) fn bytes(&self) -> u64 {
        self.rows * self.cols * self.dtype.size() as u64
    }

    fn check(&self, b: &Block) -> Result<()> {
        b.check_inside(&self.label, (self.rows, self.cols))
    }

    /// The tile columns that columns `c0..c0+cols` touch, each with the columns it holds:
    /// (tile column, first matrix column, columns).
    fn col_spans(&self, c0: u64, cols: u64) -> Vec<(u64, u64, u64)> {
        let mut out = Vec::new();
        let mut c = c0;
        while c < c0 + cols {
            let tj = c / self.tile.1;
            let end = ((tj + 1) * self.tile.1).min(c0 + cols);
            out.push((tj, c, end - c));
            c = end;
        }
        out
    }

    /// Width of the tiles in tile column `tj`.
    fn tile_width(&self, tj: u64) -> u64 {
        self.tile.1.min(self.cols - tj * self.tile.1)
    }

    fn tile_index(&self, ti: u64, tj: u64) -> usize {
        (ti * self.cols.div_ceil(self.tile.1) + tj) as usize
    }
}

fn unsupported(label: &Path, from: DType, to: DType) -> Error {
    Error::format(
        label,
        format!("cannot convert {from} data to {to} in an intermediate held in memory"),
    )
}

impl MatrixSource for MemoryMatrix {
    fn path(&self) -> &Path {
        &self.label
    }
    fn in_memory(&self) -> bool {
        true
    }
    fn shape(&self) -> (u64, u64) {
        (self.rows, self.cols)
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn read_block(&self, b: &Block, host: DType, dst: &mut [u8]) -> Result<()> {
        self.check(b)?;
        let (es, hs) = (self.dtype.size(), host.size());
        let spans = self.col_spans(b.c0, b.cols);
        dst.par_chunks_mut(b.cols as usize * hs)
            .enumerate()
            .try_for_each(|(i, row)| {
                let r = b.r0 + i as u64;
                let (ti, tr) = (r / self.tile.0, r % self.tile.0);
                for &(tj, c, w) in &spans {
                    let t = self.tiles[self.tile_index(ti, tj)]
                        .read()
                        .unwrap_or_else(|p| p.into_inner());
                    let at = (tr * self.tile_width(tj) + (c - tj * self.tile.1)) as usize * es;
                    let src = &t[at..at + w as usize * es];
                    let d0 = (c - b.c0) as usize * hs;
                    let d = &mut row[d0..d0 + w as usize * hs];
                    if !dtype::convert(self.dtype, src, host, d) {
                        return Err(unsupported(&self.label, self.dtype, host));
                    }
                }
                Ok(())
            })
    }
    fn will_need(&self, _b: &Block) -> u64 {
        0
    }
    fn verify_block(&self, _b: &Block) -> Result<()> {
        Ok(())
    }
    fn identity(&self) -> String {
        format!(
            "intermediate {}×{} {} in memory for {}",
            self.rows,
            self.cols,
            self.dtype,
            super::fsutil::identity_path(&self.label).display()
        )
    }
}

/// The producing step's end of a [`MemoryMatrix`].
pub(crate) struct MemoryWriter(pub(crate) Arc<MemoryMatrix>);

impl MatrixSink for MemoryWriter {
    fn path(&self) -> &Path {
        &self.0.label
    }
    fn shape(&self) -> (u64, u64) {
        (self.0.rows, self.0.cols)
    }
    fn dtype(&self) -> DType {
        self.0.dtype
    }
    fn storage_tile(&self) -> (u64, u64) {
        self.0.tile
    }
    /// Converts `src` to the stored dtype (as the `.mgt` writer does), returns its CRC-32C and
    /// copies it into the tiles the block covers.
    fn write_block(&self, b: &Block, host: DType, src: &[u8]) -> Result<u32> {
        let m = &self.0;
        m.check(b)?;
        let es = m.dtype.size();
        let converted;
        let stored: &[u8] = if host == m.dtype {
            src
        } else {
            let mut v = vec![0u8; b.elems() * es];
            if !dtype::convert(host, src, m.dtype, &mut v) {
                return Err(unsupported(&m.label, host, m.dtype));
            }
            converted = v;
            &converted
        };
        let crc = par_crc32c(stored);
        let (t0, t1) = (b.r0 / m.tile.0, (b.r0 + b.rows).div_ceil(m.tile.0));
        let spans = m.col_spans(b.c0, b.cols);
        let pieces: Vec<(u64, (u64, u64, u64))> = (t0..t1)
            .flat_map(|ti| spans.iter().map(move |&s| (ti, s)))
            .collect();
        pieces.par_iter().for_each(|&(ti, (tj, c, w))| {
            let mut t = m.tiles[m.tile_index(ti, tj)]
                .write()
                .unwrap_or_else(|p| p.into_inner());
            let tw = m.tile_width(tj);
            let r_lo = (ti * m.tile.0).max(b.r0);
            let r_hi = ((ti + 1) * m.tile.0).min(b.r0 + b.rows);
            for r in r_lo..r_hi {
                let at = ((r - ti * m.tile.0) * tw + (c - tj * m.tile.1)) as usize * es;
                let from = ((r - b.r0) * b.cols + (c - b.c0)) as usize * es;
                let n = w as usize * es;
                t[at..at + n].copy_from_slice(&stored[from..from + n]);
            }
        });
        Ok(crc)
    }
    fn prefault(&self, _b: &Block) -> u64 {
        0
    }
    fn flush_block(&self, _b: &Block) -> Result<()> {
        Ok(())
    }
    fn forget_checksums(&self) {}
    fn finish(self: Box<Self>, _durable: bool) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Block `b` of the test matrix (element (r, c) = (r·cols + c) / 4) as f32 bytes.
    fn dense(b: &Block, cols: u64) -> Vec<u8> {
        (0..b.elems() as u64)
            .flat_map(|i| {
                let (r, c) = (b.r0 + i / b.cols, b.c0 + i % b.cols);
                ((r * cols + c) as f32 * 0.25).to_le_bytes()
            })
            .collect()
    }

    #[test]
    fn blocks_straddling_tiles_read_back_what_was_written() {
        let shape = (23, 17);
        let m = Arc::new(MemoryMatrix::new(Path::new("T.mgt"), shape, DType::F32, (8, 5)).unwrap());
        let w = MemoryWriter(m.clone());
        // Written in 7×6 blocks that straddle the 8×5 tiles, from f64 host data.
        for r0 in (0..shape.0).step_by(7) {
            for c0 in (0..shape.1).step_by(6) {
                let b = Block {
                    r0,
                    c0,
                    rows: 7.min(shape.0 - r0),
                    cols: 6.min(shape.1 - c0),
                };
                let f32s = dense(&b, shape.1);
                let mut f64s = vec![0u8; b.elems() * 8];
                assert!(dtype::convert(DType::F32, &f32s, DType::F64, &mut f64s));
                let crc = w.write_block(&b, DType::F64, &f64s).unwrap();
                assert_eq!(crc, crc32c::crc32c(&f32s));
            }
        }
        let all = Block {
            r0: 0,
            c0: 0,
            rows: shape.0,
            cols: shape.1,
        };
        let mut got = vec![0u8; all.elems() * 4];
        m.read_block(&all, DType::F32, &mut got).unwrap();
        assert_eq!(got, dense(&all, shape.1));
        let b = Block {
            r0: 3,
            c0: 4,
            rows: 11,
            cols: 9,
        };
        let mut got = vec![0u8; b.elems() * 4];
        m.read_block(&b, DType::F32, &mut got).unwrap();
        assert_eq!(got, dense(&b, shape.1));
        assert_eq!(m.bytes(), 23 * 17 * 4);
        let out = Block {
            r0: 20,
            c0: 0,
            rows: 4,
            cols: 1,
        };
        let err = m.read_block(&out, DType::F32, &mut [0u8; 16]).unwrap_err();
        assert!(err.to_string().contains("T.mgt"), "{err}");
    }

    /// `block_crc` reads a block in bands of at most 8 MiB and combines their CRCs: the same
    /// CRC as the whole block read at once, for a block of several bands with a short last one
    /// that straddles storage tiles.
    #[test]
    fn a_block_crc_read_in_bands_is_the_whole_block_crc() {
        let shape = (4200, 1030);
        let m = MemoryMatrix::new(Path::new("T.mgt"), shape, DType::F32, (1000, 600)).unwrap();
        let w = MemoryWriter(Arc::new(m));
        let all = Block {
            r0: 0,
            c0: 0,
            rows: shape.0,
            cols: shape.1,
        };
        w.write_block(&all, DType::F32, &dense(&all, shape.1))
            .unwrap();
        // 1024 f32 columns: 2048 rows per 8 MiB band, so three bands (2048, 2048, 5 rows).
        let b = Block {
            r0: 7,
            c0: 3,
            rows: 4101,
            cols: 1024,
        };
        let want = crc32c::crc32c(&dense(&b, shape.1));
        assert_eq!(
            crate::store::block_crc(&*w.0, &b, DType::F32).unwrap(),
            want
        );
        let one = Block { rows: 1, ..b };
        assert_eq!(
            crate::store::block_crc(&*w.0, &one, DType::F32).unwrap(),
            crc32c::crc32c(&dense(&one, shape.1))
        );
    }
}
