//! A band of stored rows as `verify`'s scatter passes read it: rows of a buffer the band was
//! copied into, or — where the file maps its blocks ([`MatrixSource::mapped_block`]) — pieces of
//! the file's read-only map, read in place.
//!
//! The scatter passes fold each element once, a few additions per element, so they run at the
//! rate memory is read. Copying each band into a buffer first doubled the traffic (the copy's
//! write, the fold's read), and on the hosts here memory traffic is what bounds them: one H100
//! host's 16 threads copy anonymous memory at 34 GiB/s but sum a fresh map of the page cache at
//! 96 (docs/measurements/2026-12-06e-h100-1-twins-lock-ahead-verify-read-rates.log). A mapped
//! band is the block's runs cut at the band's rows: rectangles of the map, each row of one
//! contiguous, so a fold takes a row's columns as a few slices (one per storage tile it
//! crosses) instead of one.

use std::ops::Range;

use zerocopy::FromBytes;

use super::kernel::Elem;
use crate::store::{Block, MatrixSource};

/// One rectangle of a mapped band: band rows `l0..l0 + rows`, columns `c0..c0 + w`, row `i` at
/// map offset `file_off + i·pitch`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rect {
    l0: usize,
    rows: usize,
    c0: usize,
    w: usize,
    file_off: usize,
    pitch: usize,
}

/// A band of stored rows `r0..r0 + h` of a file with `cols` columns, as `T`.
pub(crate) enum BandView<'a, T> {
    /// Row-major in a buffer: band row `l` at `m[l·cols..]`.
    Dense { m: &'a [T], cols: usize },
    /// Pieces of the file's map.
    Mapped {
        map: &'a [u8],
        /// By first row, then first column.
        rects: Vec<Rect>,
        /// Runs of `rects` that share their rows: (first row, end row, rects).
        bands: Vec<(usize, usize, Range<usize>)>,
    },
}

impl<'a, T: Elem> BandView<'a, T> {
    /// Stored rows `r0..r0 + h` of `file` read in place from its map, when the file maps them
    /// as `T` with every piece aligned for `T`; `None` otherwise (the caller copies).
    pub(crate) fn mapped(file: &'a dyn MatrixSource, r0: usize, h: usize) -> Option<Self> {
        let cols = file.shape().1 as usize;
        let b = Block {
            r0: r0 as u64,
            c0: 0,
            rows: h as u64,
            cols: cols as u64,
        };
        let mb = file.mapped_block(&b, T::DTYPE)?;
        let (size, align) = (std::mem::size_of::<T>(), std::mem::align_of::<T>());
        let rb = cols * size;
        let mut rects = Vec::new();
        for run in &mb.runs {
            // The usual run (rows of one storage tile, or a row-major band): rows one below the
            // other in the band, so one rectangle as it stands.
            let (l, c) = (run.buf_off / rb, run.buf_off % rb);
            if run.buf_pitch == rb && c + run.row_len <= rb {
                rects.push(Rect {
                    l0: l,
                    rows: run.rows,
                    c0: c / size,
                    w: run.row_len / size,
                    file_off: run.file_off as usize,
                    pitch: run.file_pitch as usize,
                });
                continue;
            }
            for i in 0..run.rows {
                let (fo, bo) = run.row(i);
                let (mut fo, mut bo, mut len) = (fo as usize, bo, run.row_len);
                // A run's row may cover several band rows (a row-major file's contiguous band):
                // cut it at the band's row ends.
                while len > 0 {
                    let (l, c) = (bo / rb, bo % rb);
                    if c == 0 && len >= rb {
                        let k = len / rb;
                        rects.push(Rect {
                            l0: l,
                            rows: k,
                            c0: 0,
                            w: cols,
                            file_off: fo,
                            pitch: rb,
                        });
                        (fo, bo, len) = (fo + k * rb, bo + k * rb, len - k * rb);
                        continue;
                    }
                    let take = len.min(rb - c);
                    rects.push(Rect {
                        l0: l,
                        rows: 1,
                        c0: c / size,
                        w: take / size,
                        file_off: fo,
                        pitch: 0,
                    });
                    (fo, bo, len) = (fo + take, bo + take, len - take);
                }
            }
        }
        // Rows of one run that lie one below the other in the file stay one rectangle: merge
        // the one-row pieces of a run back (a `.mgt` tile's rows in the band).
        rects = merge_rows(rects);
        let aligned = rects.iter().all(|r| {
            r.file_off.is_multiple_of(align) && (r.rows == 1 || r.pitch.is_multiple_of(align))
        });
        let inside = rects.iter().all(|r| {
            r.file_off + (r.rows - 1) * r.pitch + r.w * size <= mb.map.len() && r.l0 + r.rows <= h
        });
        if !aligned || !inside || !(mb.map.as_ptr() as usize).is_multiple_of(align) {
            return None;
        }
        // Pages still on disk are read the copying way: its large parallel `pread`s run at the
        // disk's speed, where faulting a map in would read it a page-cluster at a time.
        let lo = rects.iter().map(|r| r.file_off).min().unwrap_or(0) as u64;
        let hi = rects
            .iter()
            .map(|r| r.file_off + (r.rows - 1) * r.pitch + r.w * size);
        let hi = hi.max().unwrap_or(0) as u64;
        if !mb.cached_sampled(lo..hi, 64) {
            return None;
        }
        rects.sort_unstable_by_key(|r| (r.l0, r.c0));
        let mut bands: Vec<(usize, usize, Range<usize>)> = Vec::new();
        for (i, r) in rects.iter().enumerate() {
            match bands.last_mut() {
                Some(b) if b.0 == r.l0 && b.1 == r.l0 + r.rows => b.2.end = i + 1,
                _ => bands.push((r.l0, r.l0 + r.rows, i..i + 1)),
            }
        }
        Some(BandView::Mapped {
            map: mb.map,
            rects,
            bands,
        })
    }

    /// Call `f(c, piece)` for the contiguous pieces of band row `l`'s columns `cs`, in column
    /// order (`piece` holds columns `c..c + piece.len()`).
    #[inline]
    pub(crate) fn pieces(&self, l: usize, cs: Range<usize>, mut f: impl FnMut(usize, &[T])) {
        match self {
            BandView::Dense { m, cols } => f(cs.start, &m[l * cols + cs.start..l * cols + cs.end]),
            BandView::Mapped { map, rects, bands } => {
                let size = std::mem::size_of::<T>();
                let from = bands.partition_point(|b| b.1 <= l);
                for b in bands[from..].iter().take_while(|b| b.0 <= l) {
                    if l >= b.1 {
                        continue;
                    }
                    // A band's rectangles are sorted by column and disjoint: start at the
                    // first that ends after `cs.start`, stop at the first past `cs.end`.
                    let rs = &rects[b.2.clone()];
                    let first = rs.partition_point(|r| r.c0 + r.w <= cs.start);
                    for r in rs[first..].iter().take_while(|r| r.c0 < cs.end) {
                        let (lo, hi) = (cs.start.max(r.c0), cs.end.min(r.c0 + r.w));
                        if lo >= hi {
                            continue;
                        }
                        let at = r.file_off + (l - r.l0) * r.pitch + (lo - r.c0) * size;
                        let bytes = &map[at..at + (hi - lo) * size];
                        let piece = <[T]>::ref_from_bytes(bytes)
                            .expect("rectangles checked aligned and inside the map");
                        f(lo, piece);
                    }
                }
            }
        }
    }

    /// Drop the band's pages from the process's page tables once it is folded (they stay in
    /// the page cache): left mapped, every file a check reads would count in its resident
    /// memory until the map goes, where a copied band costs two band buffers.
    pub(crate) fn release(&self) {
        if let BandView::Mapped { map, rects, .. } = self {
            let size = std::mem::size_of::<T>();
            let lo = rects.iter().map(|r| r.file_off).min().unwrap_or(0);
            let hi = rects
                .iter()
                .map(|r| r.file_off + (r.rows - 1) * r.pitch + r.w * size);
            let hi = hi.max().unwrap_or(0);
            if hi > lo {
                // SAFETY: `map` is a file's read-only map (`MappedBlock::map`) and `lo..hi`
                // lies inside it (checked when the view was made).
                unsafe { crate::store::fsutil::unmap_pages(map.as_ptr() as usize + lo, hi - lo) };
            }
        }
    }

    /// Element (band row `l`, column `c`).
    #[cfg(test)]
    pub(crate) fn at(&self, l: usize, c: usize) -> T {
        let mut v = T::default();
        self.pieces(l, c..c + 1, |_, p| v = p[0]);
        v
    }
}

/// Consecutive one-row rectangles that continue one another — the next band row, the same
/// columns, one file pitch further — joined into one.
fn merge_rows(rects: Vec<Rect>) -> Vec<Rect> {
    let mut out: Vec<Rect> = Vec::with_capacity(rects.len());
    for r in rects {
        if let Some(p) = out.last_mut() {
            if (r.rows == 1 || r.pitch == p.pitch)
                && p.c0 == r.c0
                && p.w == r.w
                && r.l0 == p.l0 + p.rows
            {
                let step = r.file_off.checked_sub(p.file_off);
                let fits = match (p.rows, step) {
                    (1, Some(s)) if s > 0 && r.rows == 1 => {
                        p.pitch = s;
                        true
                    }
                    (_, Some(s)) => s == p.rows * p.pitch,
                    _ => false,
                };
                if fits {
                    p.rows += r.rows;
                    continue;
                }
            }
        }
        out.push(r);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::TiledFile;

    /// A 37 × 45 f32 `.mgt` in 8 × 16 storage tiles (every edge partial), and the same
    /// matrix in memory.
    fn tiled(dir: &std::path::Path) -> (TiledFile, Vec<f32>) {
        use crate::store::tiled::TiledWriter;
        use crate::store::{Header, MatrixSink};
        let (rows, cols) = (37u64, 45u64);
        let data: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.5 - 7.0).collect();
        let p = dir.join("m.mgt");
        let w = TiledWriter::create(
            &p,
            Header::new(crate::dtype::DType::F32, rows, cols, 8, 16, true),
        )
        .unwrap();
        let all = Block {
            r0: 0,
            c0: 0,
            rows,
            cols,
        };
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        let sink: &dyn MatrixSink = &w;
        sink.write_block(&all, crate::dtype::DType::F32, &bytes)
            .unwrap();
        w.finish(false).unwrap();
        (TiledFile::open(&p).unwrap(), data)
    }

    #[test]
    fn a_mapped_band_gives_every_element_where_the_buffer_has_it() {
        let dir = tempfile::tempdir().unwrap();
        let (f, data) = tiled(dir.path());
        let cols = 45;
        for (r0, h) in [(0, 8), (0, 37), (8, 16), (5, 11), (32, 5)] {
            let v = BandView::<f32>::mapped(&f, r0, h).expect("an f32 .mgt maps as f32");
            for l in 0..h {
                for cs in [0..45, 3..29, 16..32, 44..45, 0..1] {
                    let mut got = Vec::new();
                    let mut next = cs.start;
                    v.pieces(l, cs.clone(), |c, p| {
                        assert_eq!(c, next, "pieces come in column order, without gaps");
                        next += p.len();
                        got.extend_from_slice(p);
                    });
                    assert_eq!(next, cs.end);
                    let want = &data[(r0 + l) * cols + cs.start..(r0 + l) * cols + cs.end];
                    assert_eq!(got, want, "rows {r0}+{l}, columns {cs:?}");
                }
                assert_eq!(v.at(l, 17), data[(r0 + l) * cols + 17]);
            }
        }
        assert!(
            BandView::<f64>::mapped(&f, 0, 8).is_none(),
            "f32 data is not mapped as f64"
        );
    }
}
