//! Where the bytes of a block lie in a file: tile-grid geometry and the one iterator that cuts a
//! block into contiguous file runs.
//!
//! Compute tiles are independent of storage tiles, so a block may straddle any number of storage
//! tiles, and edge tiles are partial. Every block read, write, advice, prefault, flush and
//! checksum in [`super`] goes through [`Geometry`] and [`runs`], so the tile-range arithmetic
//! lives in one place. A row-major file (a `.npy` array, a raw binary matrix) is the special case
//! of one storage tile that holds the whole matrix ([`Geometry::row_major`]).

use std::ops::Range;

use super::block::Block;

/// The usual limit on a run's file span for `pread`/`pwrite`: large enough for full-speed I/O,
/// small enough that one block's runs spread over the rayon pool.
pub(crate) const IO_SPAN: u64 = 4 << 20;

/// How a matrix is laid out in its file: a grid of `tile_rows × tile_cols` storage tiles stored
/// row-major within each tile, tiles in grid row-major order, `tile_stride` bytes apart from
/// `data_offset` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub(crate) rows: u64,
    pub(crate) cols: u64,
    pub(crate) tile_rows: u64,
    pub(crate) tile_cols: u64,
    /// Bytes per element in the file.
    pub(crate) elem: u64,
    pub(crate) data_offset: u64,
    pub(crate) tile_stride: u64,
}

impl Geometry {
    /// A plain row-major matrix at `data_offset`: one storage tile holding the whole matrix.
    #[cfg_attr(not(test), allow(dead_code))] // the row-major sources of a later issue use it
    pub(crate) fn row_major(rows: u64, cols: u64, elem: u64, data_offset: u64) -> Geometry {
        Geometry {
            rows,
            cols,
            tile_rows: rows,
            tile_cols: cols,
            elem,
            data_offset,
            tile_stride: rows * cols * elem,
        }
    }

    pub(crate) fn grid_cols(&self) -> u64 {
        self.cols.div_ceil(self.tile_cols)
    }

    /// Index of storage tile (ti, tj) in grid row-major order (the checksum table's order).
    pub(crate) fn tile_index(&self, ti: u64, tj: u64) -> usize {
        (ti * self.grid_cols() + tj) as usize
    }

    pub(crate) fn tile_offset(&self, ti: u64, tj: u64) -> u64 {
        self.data_offset + (ti * self.grid_cols() + tj) * self.tile_stride
    }

    /// Storage tiles that `b` touches, as (tile-row, tile-column) ranges.
    pub(crate) fn tiles_of(&self, b: &Block) -> (Range<u64>, Range<u64>) {
        (
            b.r0 / self.tile_rows..(b.r0 + b.rows).div_ceil(self.tile_rows),
            b.c0 / self.tile_cols..(b.c0 + b.cols).div_ceil(self.tile_cols),
        )
    }

    /// Every storage tile `b` touches, in grid row-major order.
    pub(crate) fn tiles_iter(&self, b: &Block) -> impl Iterator<Item = (u64, u64)> {
        let (tis, tjs) = self.tiles_of(b);
        tis.flat_map(move |ti| tjs.clone().map(move |tj| (ti, tj)))
    }

    /// Whether `b` covers every element of storage tile (ti, tj) (edge tiles are partial).
    pub(crate) fn covers_tile(&self, b: &Block, ti: u64, tj: u64) -> bool {
        let (tr0, tc0) = (ti * self.tile_rows, tj * self.tile_cols);
        let tr1 = ((ti + 1) * self.tile_rows).min(self.rows);
        let tc1 = ((tj + 1) * self.tile_cols).min(self.cols);
        b.r0 <= tr0 && b.r0 + b.rows >= tr1 && b.c0 <= tc0 && b.c0 + b.cols >= tc1
    }

    /// Whether `b` is exactly storage tile (ti, tj) at its full (unclipped) size.
    pub(crate) fn is_exact_tile(&self, b: &Block, ti: u64, tj: u64) -> bool {
        (b.r0, b.c0, b.rows, b.cols)
            == (
                ti * self.tile_rows,
                tj * self.tile_cols,
                self.tile_rows,
                self.tile_cols,
            )
    }

    /// Per tile-row of `b`, the byte range from the first to the end of the last storage tile
    /// `b` touches in that row (contiguous in the file): what prefault and flush operate on.
    pub(crate) fn tile_row_spans(&self, b: &Block) -> impl Iterator<Item = Range<u64>> + '_ {
        let (tis, tjs) = self.tiles_of(b);
        tis.map(move |ti| {
            self.tile_offset(ti, tjs.start)..self.tile_offset(ti, tjs.end - 1) + self.tile_stride
        })
    }
}

/// The part of a block inside one storage tile, as a run of rows: `rows` rows of `row_len`
/// bytes, starting at `file_off` (rows `file_pitch` apart in the file) and at `buf_off` (rows
/// `buf_pitch` apart in the dense row-major block buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) file_off: u64,
    pub(crate) file_pitch: u64,
    pub(crate) buf_off: usize,
    pub(crate) buf_pitch: usize,
    pub(crate) row_len: usize,
    pub(crate) rows: usize,
}

impl Run {
    /// The run's rows are back to back in the file.
    pub(crate) fn file_contiguous(&self) -> bool {
        self.rows == 1 || self.row_len as u64 == self.file_pitch
    }
    /// The run's rows are back to back in the block buffer.
    pub(crate) fn buf_contiguous(&self) -> bool {
        self.rows == 1 || self.row_len == self.buf_pitch
    }
    /// Bytes of matrix data in the run.
    pub(crate) fn bytes(&self) -> usize {
        self.rows * self.row_len
    }
    /// The file bytes from the run's first to its last element.
    pub(crate) fn file_span(&self) -> Range<u64> {
        self.file_off
            ..self.file_off + (self.rows as u64 - 1) * self.file_pitch + self.row_len as u64
    }
    /// The block-buffer bytes from the run's first to its last element.
    pub(crate) fn buf_span(&self) -> Range<usize> {
        self.buf_off..self.buf_off + (self.rows - 1) * self.buf_pitch + self.row_len
    }
    /// Row `r` of the run: (file offset, block-buffer offset), each `row_len` bytes long.
    pub(crate) fn row(&self, r: usize) -> (u64, usize) {
        (
            self.file_off + r as u64 * self.file_pitch,
            self.buf_off + r * self.buf_pitch,
        )
    }
}

/// Cut block `b` of a matrix laid out as `g` into contiguous file runs: one per storage tile the
/// block touches, split by rows so that no run spans more than `max_span` file bytes (but at
/// least one row). Runs cover disjoint bytes of both the file and the block buffer, and
/// together every element of the block exactly once.
pub(crate) fn runs(g: &Geometry, b: &Block, max_span: u64) -> impl Iterator<Item = Run> {
    let g = *g;
    let b = *b;
    g.tiles_iter(&b).flat_map(move |(ti, tj)| {
        let es = g.elem;
        let ra = b.r0.max(ti * g.tile_rows);
        let rb = (b.r0 + b.rows).min((ti + 1) * g.tile_rows);
        let ca = b.c0.max(tj * g.tile_cols);
        let cb = (b.c0 + b.cols).min((tj + 1) * g.tile_cols);
        let whole = Run {
            file_off: g.tile_offset(ti, tj)
                + ((ra - ti * g.tile_rows) * g.tile_cols + (ca - tj * g.tile_cols)) * es,
            file_pitch: g.tile_cols * es,
            buf_off: (((ra - b.r0) * b.cols + (ca - b.c0)) * es) as usize,
            buf_pitch: (b.cols * es) as usize,
            row_len: ((cb - ca) * es) as usize,
            rows: (rb - ra) as usize,
        };
        let per = (max_span / whole.file_pitch.max(1)).max(1) as usize;
        (0..whole.rows).step_by(per).map(move |r| {
            let (file_off, buf_off) = whole.row(r);
            Run {
                file_off,
                buf_off,
                rows: per.min(whole.rows - r),
                ..whole
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiled(rows: u64, cols: u64, tr: u64, tc: u64, elem: u64) -> Geometry {
        Geometry {
            rows,
            cols,
            tile_rows: tr,
            tile_cols: tc,
            elem,
            data_offset: 4096,
            tile_stride: (tr * tc * elem).div_ceil(4096) * 4096,
        }
    }

    /// The file offset of element (r, c) in `g`, computed the slow way.
    fn elem_offset(g: &Geometry, r: u64, c: u64) -> u64 {
        let (ti, tj) = (r / g.tile_rows, c / g.tile_cols);
        g.tile_offset(ti, tj) + ((r % g.tile_rows) * g.tile_cols + c % g.tile_cols) * g.elem
    }

    /// Every element of `b` is in exactly one run, at the right file and buffer offsets, and
    /// runs respect the span limit and stay inside one storage tile.
    fn check(g: &Geometry, b: Block) {
        let es = g.elem as usize;
        let mut seen = vec![0u8; b.elems()];
        let mut total = 0;
        for run in runs(g, &b, IO_SPAN) {
            assert!(run.rows >= 1 && run.row_len >= es, "{run:?}");
            assert!(
                run.rows == 1 || (run.rows as u64 - 1) * run.file_pitch < IO_SPAN,
                "{run:?} spans too much"
            );
            total += run.bytes();
            for r in 0..run.rows {
                let (fo, bo) = run.row(r);
                for e in 0..run.row_len / es {
                    let i = bo / es + e;
                    let (br, bc) = (i as u64 / b.cols, i as u64 % b.cols);
                    assert_eq!(fo + (e * es) as u64, elem_offset(g, b.r0 + br, b.c0 + bc));
                    seen[i] += 1;
                }
            }
        }
        assert_eq!(total, b.elems() * es);
        assert!(
            seen.iter().all(|&n| n == 1),
            "some element not covered once"
        );
    }

    #[test]
    fn blocks_straddling_tile_edges() {
        let g = tiled(100, 90, 16, 16, 4);
        for (r0, c0, rows, cols) in [
            (15, 15, 2, 2),
            (0, 0, 16, 16),
            (1, 1, 16, 16),
            (15, 0, 17, 90),
            (0, 0, 100, 90),
            (95, 80, 5, 10),
            (31, 47, 33, 33),
        ] {
            check(&g, Block { r0, c0, rows, cols });
        }
        // One block exactly one storage tile gives one contiguous run.
        let rs: Vec<Run> = runs(
            &g,
            &Block {
                r0: 16,
                c0: 32,
                rows: 16,
                cols: 16,
            },
            IO_SPAN,
        )
        .collect();
        assert_eq!(rs.len(), 1);
        assert!(rs[0].file_contiguous() && rs[0].buf_contiguous());
        assert_eq!(rs[0].file_off, g.tile_offset(1, 2));
    }

    #[test]
    fn one_by_n_and_n_by_one() {
        let g = tiled(1, 1000, 1, 64, 8);
        let rs: Vec<Run> = runs(
            &g,
            &Block {
                r0: 0,
                c0: 0,
                rows: 1,
                cols: 1000,
            },
            IO_SPAN,
        )
        .collect();
        assert_eq!(rs.len(), 1000usize.div_ceil(64));
        check(
            &g,
            Block {
                r0: 0,
                c0: 3,
                rows: 1,
                cols: 997,
            },
        );
        let g = tiled(1000, 1, 64, 1, 2);
        check(
            &g,
            Block {
                r0: 5,
                c0: 0,
                rows: 990,
                cols: 1,
            },
        );
    }

    #[test]
    fn prime_shapes_and_tiles() {
        for (rows, cols, tr, tc) in [(97, 89, 7, 13), (101, 103, 101, 1), (13, 211, 3, 211)] {
            let g = tiled(rows, cols, tr, tc, 4);
            for (r0, c0) in [(0, 0), (1, 2), (rows / 3, cols / 5)] {
                for (h, w) in [
                    (1, 1),
                    (rows - r0, cols - c0),
                    ((rows - r0).min(11), 17.min(cols - c0)),
                ] {
                    check(
                        &g,
                        Block {
                            r0,
                            c0,
                            rows: h,
                            cols: w,
                        },
                    );
                }
            }
        }
    }

    #[test]
    fn large_tiles_split_into_bounded_runs() {
        // 8192-wide f32 tile rows are 32 KiB: a 4 MiB run holds 128 of them.
        let g = tiled(1024, 8192, 1024, 8192, 4);
        let rs: Vec<Run> = runs(
            &g,
            &Block {
                r0: 0,
                c0: 0,
                rows: 1024,
                cols: 8192,
            },
            IO_SPAN,
        )
        .collect();
        assert_eq!(rs.len(), 8);
        assert!(rs.iter().all(|r| r.rows == 128 && r.file_contiguous()));
        check(
            &g,
            Block {
                r0: 3,
                c0: 100,
                rows: 1000,
                cols: 8000,
            },
        );
    }

    #[test]
    fn row_major_is_one_tile() {
        let g = Geometry::row_major(37, 41, 8, 128);
        let rs: Vec<Run> = runs(
            &g,
            &Block {
                r0: 2,
                c0: 3,
                rows: 5,
                cols: 7,
            },
            IO_SPAN,
        )
        .collect();
        assert_eq!(rs.len(), 1);
        assert_eq!(rs[0].file_off, 128 + (2 * 41 + 3) * 8);
        assert_eq!(rs[0].file_pitch, 41 * 8);
        check(
            &g,
            Block {
                r0: 0,
                c0: 0,
                rows: 37,
                cols: 41,
            },
        );
    }

    #[test]
    fn tile_helpers() {
        let g = tiled(100, 90, 16, 16, 4);
        let b = Block {
            r0: 15,
            c0: 16,
            rows: 2,
            cols: 32,
        };
        assert_eq!(g.tiles_of(&b), (0..2, 1..3));
        assert_eq!(g.tiles_iter(&b).count(), 4);
        // The last tile row and column are partial: a block reaching the edge covers them.
        assert!(g.covers_tile(
            &Block {
                r0: 96,
                c0: 80,
                rows: 4,
                cols: 10
            },
            6,
            5
        ));
        assert!(!g.covers_tile(
            &Block {
                r0: 96,
                c0: 80,
                rows: 3,
                cols: 10
            },
            6,
            5
        ));
        assert!(g.is_exact_tile(
            &Block {
                r0: 16,
                c0: 0,
                rows: 16,
                cols: 16
            },
            1,
            0
        ));
        let spans: Vec<_> = g.tile_row_spans(&b).collect();
        assert_eq!(
            spans[0],
            g.tile_offset(0, 1)..g.tile_offset(0, 2) + g.tile_stride
        );
    }
}
