//! The streaming passes of `verify`: every matrix is read once, in bands of stored rows that are
//! read in parallel pieces while the previous band is folded, kept in their stored type (f32 or
//! f64) and widened in registers, and folded into small per-row accumulators, so memory stays
//! O(n·groups + band) however big the files are and the passes run near memory bandwidth.
//!
//! Two kinds of pass exist. A *scatter* pass folds op(M) against random ±1 vectors that are cut
//! into column groups ([`Groups`]): for each op row t and group g it sums M·x, M² and |M| over the
//! group's columns (what the residual, the statistical tolerance and the rigorous bound need).
//! A *dense* pass multiplies op(A) by the K-row results of a scatter pass over op(B), one GEMM
//! over the whole pool per band. Signed sums are kept in double-double ([`Dd`]) for f64 data, so
//! that the check is more precise than the product, and in f64 otherwise; the tolerance sums
//! need no such care. NaN/Inf elements are never multiplied: they are recorded (rows, columns,
//! cells) and left out of every sum.

use std::ops::Range;
use std::sync::Mutex;

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use rayon::prelude::*;
use zerocopy::IntoBytes;

use crate::backend::fold::{FoldDevice, FoldSpec, FoldSums};
use crate::dtype::DType;
use crate::error::Result;
use crate::plan::Precision;
use crate::store::{Block, MatrixSource};

use super::device::{Device, Staging};
/// Double-double sums are part of what a pass returns ([`Sums`]); named here for its callers.
pub(crate) use super::kernel::Dd;
use super::kernel::{self, Elem};
use super::view::BandView;

/// One operand as a pass sees it: op(M) of a stored file, optionally rounded to the GEMM's
/// input precision exactly as the CPU backend rounds it (so a value beyond fp16's range is
/// infinite here too).
#[derive(Clone, Copy)]
pub(crate) struct Op<'a> {
    pub(crate) file: &'a dyn MatrixSource,
    pub(crate) trans: bool,
    pub(crate) round: Option<Precision>,
    /// Check the file's stored checksums as it is read ([`read_band`]).
    pub(crate) check: bool,
    /// Report each pass over it (time, input rate) on stderr (`MGMM_VERIFY_TIMES`, read once
    /// where the command starts: [`crate::config::Settings`]).
    pub(crate) times: bool,
}

impl Op<'_> {
    /// Shape of op(M).
    pub(crate) fn shape(&self) -> (usize, usize) {
        let (r, c) = (self.file.shape().0 as usize, self.file.shape().1 as usize);
        if self.trans {
            (c, r)
        } else {
            (r, c)
        }
    }
}

/// Contiguous index ranges that residuals are summed over (column groups for row residuals).
/// Each group lies inside one storage tile when there are fewer tiles than groups wanted, and
/// spans whole tiles otherwise, so a failing group names its tiles.
#[derive(Clone, Debug)]
pub(crate) struct Groups {
    pub(crate) starts: Vec<usize>,
    of: Vec<u32>,
}

impl Groups {
    pub(crate) fn new(len: usize, tile: usize, want: usize) -> Groups {
        let tile = tile.clamp(1, len.max(1));
        let tiles = len.div_ceil(tile);
        let mut starts = Vec::new();
        if tiles >= want {
            for g in 0..want {
                starts.push(g * tiles / want * tile);
            }
        } else {
            let per = want.div_ceil(tiles).max(1);
            for t in 0..tiles {
                let (a, b) = (t * tile, ((t + 1) * tile).min(len));
                let parts = per.min(b - a);
                for p in 0..parts {
                    starts.push(a + p * (b - a) / parts);
                }
            }
        }
        starts.dedup();
        starts.push(len);
        let mut of = vec![0u32; len];
        for g in 0..starts.len() - 1 {
            of[starts[g]..starts[g + 1]].fill(g as u32);
        }
        Groups { starts, of }
    }
    pub(crate) fn count(&self) -> usize {
        self.starts.len() - 1
    }
    pub(crate) fn of(&self, j: usize) -> usize {
        self.of[j] as usize
    }
    pub(crate) fn range(&self, g: usize) -> std::ops::Range<usize> {
        self.starts[g]..self.starts[g + 1]
    }
}

/// Per op-row sums over column groups. Index `[t * rg + rho * g + grp]` for signed sums
/// (rg = rounds·groups), `[t * g + grp]` for the others.
pub(crate) struct Sums {
    pub(crate) rounds: usize,
    pub(crate) groups: usize,
    pub(crate) signed: Vec<Dd>,
    pub(crate) sq: Vec<f64>,
    pub(crate) abs: Vec<f64>,
    /// NaN/Inf elements met in columns that are not excluded, per (row, group).
    pub(crate) nonfinite: Vec<u32>,
    pub(crate) bad_row: Vec<bool>,
    pub(crate) bad_col: Vec<bool>,
}

/// Stored bytes of one band of rows; two bands are in memory at once (the next one is read
/// while the current one is folded). The unit tests use small bands, so that their small
/// matrices are read in several.
const BAND_BYTES: usize = if cfg!(test) { 4 << 10 } else { 32 << 20 };

/// Read stored rows `r0..r0 + h` (all columns) into `buf`, checking the stored checksums of the
/// storage tiles they touch as they are read.
///
/// A file with checksums, when `op.check`, is read with [`MatrixSource::read_staged`], which
/// takes each piece's CRC while the piece is in the core's cache: one pass over the data. The
/// check used to read each tile once more before the copy (`verify_block`), and on one H100
/// host the passes ran at 12–14 GB/s where 16 threads read the page cache at 48–96
/// (docs/measurements/2026-12-06e-h100-1-twins-lock-ahead-verify-read-rates.log). A tile's
/// check still ends before its band is folded (the call returns its error first), so an
/// input changed in place after `run` computed the output is named as such — its file and
/// tile — instead of being blamed on the output's tiles by the residuals (or passing them,
/// for a flip in a low bit). A tile the band covers only in part is read once more, whole, to
/// complete its CRC, the first time a band touches it. Other files are read in parallel pieces
/// of rows.
fn read_band<T: Elem>(op: &Op, r0: usize, h: usize, buf: &mut [T]) -> Result<()> {
    let cols = op.file.shape().1 as usize;
    let dst = &mut buf[..h * cols];
    if op.check && op.file.checksum_tile().is_some() {
        let b = Block {
            r0: r0 as u64,
            c0: 0,
            rows: h as u64,
            cols: cols as u64,
        };
        op.file
            .read_staged(&b, T::DTYPE, dst.as_mut_bytes(), true)?;
        if let Some(p) = op.round {
            dst.par_chunks_mut(1 << 16)
                .for_each(|part| T::round(p, part));
        }
        return Ok(());
    }
    let sub = h.div_ceil(rayon::current_num_threads().max(1) * 2).max(1);
    dst.par_chunks_mut(sub * cols)
        .enumerate()
        .try_for_each(|(i, part)| {
            let b = Block {
                r0: (r0 + i * sub) as u64,
                c0: 0,
                rows: (part.len() / cols) as u64,
                cols: cols as u64,
            };
            op.file.read_block(&b, T::DTYPE, part.as_mut_bytes())?;
            if let Some(p) = op.round {
                T::round(p, part);
            }
            Ok(())
        })
}

/// Stored rows `r0..r0 + h` of op's file as a view of its read-only map
/// ([`BandView::mapped`]), the storage tiles they touch checked first when `op.check`
/// ([`MatrixSource::verify_block`]: each tile once, nothing for tiles already checked or a file
/// without checksums; a band is never read before its tiles passed); `None` where the file
/// does not map them so.
fn mapped_checked<'a, T: Elem>(
    op: &Op<'a>,
    r0: usize,
    h: usize,
) -> Result<Option<BandView<'a, T>>> {
    let Some(v) = BandView::<T>::mapped(op.file, r0, h) else {
        return Ok(None);
    };
    if op.check {
        op.file.verify_block(&Block {
            r0: r0 as u64,
            c0: 0,
            rows: h as u64,
            cols: op.file.shape().1,
        })?;
    }
    Ok(Some(v))
}

/// Stored rows `r0..r0 + h` copied into `buf` from the file's read-only map, the storage tiles
/// they touch checked first when `op.check` ([`MatrixSource::verify_block`], each tile once);
/// false, with nothing copied, where the file does not map them so ([`BandView::mapped`]) or
/// values are rounded. For the dense pass on a device, whose bands must be copied (into
/// page-locked buffers, for the device's copies): one copy from the page cache's pages, where
/// [`read_band`]'s `pread` into a piece buffer and then into the band is two (its reads ran at
/// 20–22 GB/s on one H100 host whose 16 threads copy a map at 85 GiB/s).
fn copy_mapped<T: Elem>(op: &Op, r0: usize, h: usize, buf: &mut [T]) -> Result<bool> {
    let cols = op.file.shape().1 as usize;
    if op.round.is_some() || cols == 0 {
        return Ok(false);
    }
    let Some(v) = mapped_checked::<T>(op, r0, h)? else {
        return Ok(false);
    };
    buf[..h * cols]
        .par_chunks_mut(cols)
        .enumerate()
        .for_each(|(l, row)| v.pieces(l, 0..cols, |c, p| row[c..c + p.len()].copy_from_slice(p)));
    v.release();
    Ok(true)
}

/// Stored rows per band of `op` read as `T` (the whole file when smaller): about
/// [`BAND_BYTES`]. (Rounded up to whole storage tile rows, so that each tile's CRC is taken in
/// the one read of its band, the dense pass took 0.90–1.01 s on one H100 against 0.52–0.55 —
/// four times the rows per band for the widening, the GEMM and the device's cross-checks — and
/// 2.79 s against 0.99 on the CPU: docs/measurements/2026-12-06e-h100-2-verify-in-place.log.)
fn band_rows<T>(op: &Op) -> usize {
    let (rows, cols) = (op.file.shape().0 as usize, op.file.shape().1 as usize);
    (BAND_BYTES / (cols.max(1) * std::mem::size_of::<T>())).clamp(1, rows.max(1))
}

/// Call `f(r0, h, band)` for consecutive bands of stored rows of `op`, reading the next band
/// while `f` works on the current one.
fn bands<T: Elem>(op: &Op, mut f: impl FnMut(usize, usize, &[T]) + Send) -> Result<()> {
    let len = band_rows::<T>(op) * op.file.shape().1 as usize;
    let (mut a, mut b) = (vec![T::default(); len], vec![T::default(); len]);
    bands_in(
        op,
        band_rows::<T>(op),
        false,
        [&mut a, &mut b],
        |r0, h, m| {
            f(r0, h, m);
            true
        },
    )
}

/// [`bands`] of `band` rows into the caller's two buffers (a device may have page-locked them),
/// each at least that many rows; `f` returns whether to go on (false: no band is read after the one being
/// read).
fn bands_in<T: Elem>(
    op: &Op,
    band: usize,
    from_map: bool,
    bufs: [&mut [T]; 2],
    mut f: impl FnMut(usize, usize, &[T]) -> bool + Send,
) -> Result<()> {
    let (rows, cols) = (op.file.shape().0 as usize, op.file.shape().1 as usize);
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let h_at = |r0: usize| band.min(rows - r0);
    let [mut cur, mut next] = bufs;
    let read = |r0: usize, buf: &mut [T]| {
        let t = std::time::Instant::now();
        let r = match from_map && copy_mapped(op, r0, h_at(r0), buf)? {
            true => Ok(()),
            false => read_band(op, r0, h_at(r0), buf),
        };
        crate::trace::span("verify: reads", "band", t, std::time::Instant::now());
        r
    };
    read(0, cur)?;
    let mut r0 = 0;
    loop {
        let n0 = r0 + h_at(r0);
        let (read, go_on) = rayon::join(
            || match n0 < rows {
                true => read(n0, next),
                false => Ok(()),
            },
            || f(r0, h_at(r0), &cur[..h_at(r0) * cols]),
        );
        read?;
        if n0 >= rows || !go_on {
            return Ok(());
        }
        std::mem::swap(&mut cur, &mut next);
        r0 = n0;
    }
}

/// Pieces of work per rayon thread, so that uneven pieces still balance.
fn pieces() -> usize {
    rayon::current_num_threads().max(1) * 2
}

/// The sums of consecutive op rows `t0..t0 + len`, owned by one parallel task.
struct Rows<'a> {
    t0: usize,
    signed: &'a mut [Dd],
    sq: &'a mut [f64],
    abs: &'a mut [f64],
    nonfinite: &'a mut [u32],
    bad: &'a mut [bool],
}

impl Sums {
    fn new(rows: usize, cols: usize, rounds: usize, groups: usize) -> Sums {
        Sums {
            rounds,
            groups,
            signed: kernel::zeros(rows * rounds * groups),
            sq: kernel::zeros(rows * groups),
            abs: kernel::zeros(rows * groups),
            nonfinite: kernel::zeros(rows * groups),
            bad_row: vec![false; rows],
            bad_col: vec![false; cols],
        }
    }

    /// Op rows `lo..hi` cut into tasks of `per` rows.
    fn pieces(
        &mut self,
        lo: usize,
        hi: usize,
        per: usize,
    ) -> impl ParallelIterator<Item = Rows<'_>> {
        let (rg, g) = (self.rounds * self.groups, self.groups);
        self.signed[lo * rg..hi * rg]
            .par_chunks_mut(per * rg)
            .zip(self.sq[lo * g..hi * g].par_chunks_mut(per * g))
            .zip(self.abs[lo * g..hi * g].par_chunks_mut(per * g))
            .zip(self.nonfinite[lo * g..hi * g].par_chunks_mut(per * g))
            .zip(self.bad_row[lo..hi].par_chunks_mut(per))
            .enumerate()
            .map(move |(i, ((((signed, sq), abs), nonfinite), bad))| Rows {
                t0: lo + i * per,
                signed,
                sq,
                abs,
                nonfinite,
                bad,
            })
    }
}

impl<'a> Rows<'a> {
    fn len(&self) -> usize {
        self.bad.len()
    }
    fn row(&mut self, l: usize) -> RowSums<'_> {
        let g = self.sq.len() / self.len();
        let rg = self.signed.len() / self.len();
        RowSums {
            signed: &mut self.signed[l * rg..(l + 1) * rg],
            sq: &mut self.sq[l * g..(l + 1) * g],
            abs: &mut self.abs[l * g..(l + 1) * g],
            nonfinite: &mut self.nonfinite[l * g..(l + 1) * g],
            bad: &mut self.bad[l],
        }
    }
}

/// What a scatter pass folds against.
struct Scat<'a> {
    groups: &'a Groups,
    x: &'a [Vec<f64>],
    exact: bool,
    bad_cols: Mutex<Vec<usize>>,
}

/// The accumulators of one op row during a scatter pass.
struct RowSums<'a> {
    signed: &'a mut [Dd],
    sq: &'a mut [f64],
    abs: &'a mut [f64],
    nonfinite: &'a mut [u32],
    bad: &'a mut bool,
}

impl RowSums<'_> {
    /// Fold element `v` of op column `s` (in group `g`) one at a time: the careful path, for
    /// groups holding NaN/Inf (or squares beyond f64's range).
    fn visit(&mut self, s: usize, v: f64, x: &[Vec<f64>], g: usize, bad_cols: &mut Vec<usize>) {
        let gs = self.sq.len();
        if !v.is_finite() {
            *self.bad = true;
            bad_cols.push(s);
            if x[0][s] != 0.0 {
                self.nonfinite[g] += 1;
            }
            return;
        }
        if x[0][s] == 0.0 {
            return;
        }
        self.sq[g] += v * v;
        self.abs[g] += v.abs();
        for (rho, xr) in x.iter().enumerate() {
            // x is ±1: the product is exact.
            self.signed[rho * gs + g].add(v * xr[s]);
        }
    }

    /// Fold op columns `s0..s0 + v.len()` (all in group `g`) with the vectorised kernels, or
    /// element by element when the segment holds a value that is not finite.
    fn segment<T: Elem>(&mut self, g: usize, v: &[T], s0: usize, sc: &Scat, bc: &mut Vec<usize>) {
        let (x, gs, r) = (sc.x, self.sq.len(), s0..s0 + v.len());
        let (s, q, a) = kernel::first(v, &x[0][r.clone()]);
        if !q.is_finite() {
            for (i, e) in v.iter().enumerate() {
                self.visit(s0 + i, e.wide(), x, g, bc);
            }
            return;
        }
        self.sq[g] += q;
        self.abs[g] += a;
        for (rho, xr) in x.iter().enumerate() {
            let d = match (sc.exact, rho) {
                (true, _) => kernel::dot_dd(v, &xr[r.clone()]),
                (false, 0) => Dd { hi: s, lo: 0.0 },
                (false, _) => Dd {
                    hi: kernel::dot(v, &xr[r.clone()]),
                    lo: 0.0,
                },
            };
            self.signed[rho * gs + g].add_dd(d);
        }
    }
}

/// Fold op(M) (T × S) against the round vectors `x` (each of length S; 0 marks an excluded
/// column, whose NaN/Inf are expected and not counted) over column groups; signed sums in
/// double-double when `exact`, in f64 otherwise.
pub(crate) fn scatter(op: &Op, groups: &Groups, x: &[Vec<f64>], exact: bool) -> Result<Sums> {
    timed("scatter", op, || match op.file.dtype() {
        DType::F64 => scatter_t::<f64>(op, groups, x, exact),
        _ => scatter_t::<f32>(op, groups, x, exact),
    })
}

/// Run one pass, and with `op.times` (`MGMM_VERIFY_TIMES`) report its time and input rate on
/// stderr.
fn timed<R>(what: &str, op: &Op, f: impl FnOnce() -> R) -> R {
    let t0 = std::time::Instant::now();
    let r = f();
    report_time(what, op, t0, None);
    r
}

/// With `op.times`, the line of [`timed`] for a pass begun at `t0` (on device `on`); the pass
/// as a span of the timeline (`MGMM_TRACE`) either way.
fn report_time(what: &str, op: &Op, t0: std::time::Instant, on: Option<&str>) {
    if crate::trace::enabled() {
        let name = format!("{what} {}", op.file.path().display());
        crate::trace::span("verify", &name, t0, std::time::Instant::now());
    }
    if op.times {
        let (rows, cols) = op.file.shape();
        let bytes = (rows * cols) as f64 * op.file.dtype().size() as f64;
        let s = t0.elapsed().as_secs_f64();
        eprintln!(
            "verify: {what} {}{} {rows}×{cols} {}{}: {s:.3} s, {:.2} GB/s",
            op.file.path().display(),
            if op.trans { " (transposed)" } else { "" },
            op.file.dtype(),
            on.map(|d| format!(" on {d}")).unwrap_or_default(),
            bytes / s / 1e9
        );
    }
}

fn scatter_t<T: Elem>(op: &Op, groups: &Groups, x: &[Vec<f64>], exact: bool) -> Result<Sums> {
    let (t_rows, s_cols) = op.shape();
    let mut out = Sums::new(t_rows, s_cols, x.len(), groups.count());
    let sc = Scat {
        groups,
        x,
        exact,
        bad_cols: Mutex::new(Vec::new()),
    };
    let cols = op.file.shape().1 as usize;
    let fold = |out: &mut Sums, r0: usize, h: usize, v: &BandView<T>| match op.trans {
        true => scatter_cols(out, &sc, r0, h, v),
        false => scatter_rows(out, &sc, r0, h, v),
    };
    if !in_place::<T>(op, |r0, h, v| fold(&mut out, r0, h, v))? {
        bands::<T>(op, |r0, h, m| {
            fold(&mut out, r0, h, &BandView::Dense { m, cols })
        })?;
    }
    for s in sc.bad_cols.into_inner().unwrap_or_else(|e| e.into_inner()) {
        out.bad_col[s] = true;
    }
    Ok(out)
}

/// Call `f(r0, h, band)` for consecutive bands of stored rows of `op` read in place from the
/// file's map ([`BandView::mapped`]), the storage tiles of each checked first when `op.check`
/// ([`MatrixSource::verify_block`]: each tile once, nothing for tiles already checked or a
/// file without checksums; a band is never folded before its tiles passed); false, with nothing folded, where the first band cannot be read
/// so (another dtype than `T`, values to round, no map, pages not in memory): the caller
/// copies ([`bands`]). A later band that cannot is copied into a buffer of its own.
fn in_place<T: Elem>(op: &Op, mut f: impl FnMut(usize, usize, &BandView<T>)) -> Result<bool> {
    let (rows, cols) = (op.file.shape().0 as usize, op.file.shape().1 as usize);
    if op.round.is_some() || rows == 0 || cols == 0 {
        return Ok(false);
    }
    let band = band_rows::<T>(op);
    let (mut r0, mut spare) = (0, Vec::new());
    while r0 < rows {
        let h = band.min(rows - r0);
        match mapped_checked::<T>(op, r0, h)? {
            Some(v) => {
                f(r0, h, &v);
                v.release();
            }
            None if r0 == 0 => return Ok(false),
            None => {
                spare.resize(h * cols, T::default());
                read_band(op, r0, h, &mut spare)?;
                f(r0, h, &BandView::Dense { m: &spare, cols });
            }
        }
        r0 += h;
    }
    Ok(true)
}

/// A band of stored rows `r0..r0 + h` = op rows (op(M) = M): each task owns whole rows.
fn scatter_rows<T: Elem>(out: &mut Sums, sc: &Scat, r0: usize, h: usize, v: &BandView<T>) {
    let per = h.div_ceil(pieces()).max(1);
    out.pieces(r0, r0 + h, per).for_each(|mut rows| {
        let mut bc = Vec::new();
        for l in 0..rows.len() {
            let t = rows.t0 + l - r0;
            let mut acc = rows.row(l);
            for g in 0..sc.groups.count() {
                v.pieces(t, sc.groups.range(g), |c, p| {
                    acc.segment(g, p, c, sc, &mut bc)
                });
            }
        }
        if !bc.is_empty() {
            sc.bad_cols
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(bc);
        }
    });
}

/// Per-column sums of one task's strip of op rows over a run of stored rows in one group.
struct Strip {
    tw: usize,
    s: Vec<f64>,
    dd: Vec<Dd>,
    q: Vec<f64>,
    a: Vec<f64>,
    redo: Vec<bool>,
}

impl Strip {
    fn new(tw: usize, rounds: usize, exact: bool) -> Strip {
        Strip {
            tw,
            s: vec![0.0; tw * rounds],
            dd: vec![Dd::default(); if exact { tw * rounds } else { 0 }],
            q: vec![0.0; tw],
            a: vec![0.0; tw],
            redo: vec![false; tw],
        }
    }

    /// Fold a piece `v` of stored row `s`: the strip's op rows `off..off + v.len()`.
    fn fold<T: Elem>(&mut self, v: &[T], off: usize, s: usize, sc: &Scat) {
        let (tw, x, n) = (self.tw, sc.x, v.len());
        let at = off..off + n;
        if x[0][s] == 0.0 {
            // An excluded column of op(M): only its NaN/Inf matter (the careful path counts them).
            v.iter()
                .zip(&mut self.redo[at])
                .for_each(|(e, r)| *r |= !e.wide().is_finite());
            return;
        }
        let (q, a) = (&mut self.q[at.clone()], &mut self.a[at.clone()]);
        kernel::axpy_first(v, x[0][s], &mut self.s[at], q, a);
        if sc.exact {
            for (rho, xr) in x.iter().enumerate() {
                kernel::axpy_dd(v, xr[s], &mut self.dd[rho * tw + off..rho * tw + off + n]);
            }
        } else {
            for (rho, xr) in x.iter().enumerate().skip(1) {
                kernel::axpy(v, xr[s], &mut self.s[rho * tw + off..rho * tw + off + n]);
            }
        }
    }

    /// Add the sums of stored rows `rs` (group `g`) to `rows` and start afresh; op rows whose
    /// sums are not finite are folded again element by element, from `band` (the band of
    /// stored rows from `band.1` on), each in the order of its stored rows.
    fn flush<T: Elem>(
        &mut self,
        rows: &mut Rows,
        g: usize,
        rs: Range<usize>,
        band: (&BandView<T>, usize),
        sc: &Scat,
        bc: &mut Vec<usize>,
    ) {
        let (tw, t0) = (self.tw, rows.t0);
        let again: Vec<usize> = (0..tw)
            .filter(|&l| self.redo[l] || !self.q[l].is_finite())
            .collect();
        if !again.is_empty() {
            let (v, r0) = band;
            for s in rs {
                v.pieces(s - r0, t0..t0 + tw, |c, p| {
                    let from = again.partition_point(|&l| t0 + l < c);
                    for &l in again[from..].iter().take_while(|&&l| t0 + l < c + p.len()) {
                        rows.row(l).visit(s, p[t0 + l - c].wide(), sc.x, g, bc);
                    }
                });
            }
        }
        for l in 0..tw {
            if again.binary_search(&l).is_ok() {
                continue;
            }
            let acc = rows.row(l);
            let gs = acc.sq.len();
            acc.sq[g] += self.q[l];
            acc.abs[g] += self.a[l];
            for rho in 0..sc.x.len() {
                let d = match sc.exact {
                    true => self.dd[rho * tw + l],
                    false => Dd {
                        hi: self.s[rho * tw + l],
                        lo: 0.0,
                    },
                };
                acc.signed[rho * gs + g].add_dd(d);
            }
        }
        self.s.fill(0.0);
        self.dd.fill(Dd::default());
        self.q.fill(0.0);
        self.a.fill(0.0);
        self.redo.fill(false);
    }
}

/// A band of stored rows `r0..` of a file with `cols` columns.
struct Band<'a, T> {
    m: &'a [T],
    r0: usize,
    cols: usize,
}

impl<T: Elem> Band<'_, T> {
    /// Stored row `s`, columns `c0..c0 + w`.
    fn row(&self, s: usize, c0: usize, w: usize) -> &[T] {
        let at = (s - self.r0) * self.cols + c0;
        &self.m[at..at + w]
    }
}

/// A band of stored rows `r0..r0 + h` = op columns (op(M) = Mᵀ): each task owns a strip of op
/// rows (stored columns) and walks the band's rows, the strip's pieces of each.
fn scatter_cols<T: Elem>(out: &mut Sums, sc: &Scat, r0: usize, h: usize, v: &BandView<T>) {
    let cols = out.bad_row.len();
    let per = cols.div_ceil(pieces()).max(16);
    out.pieces(0, cols, per).for_each(|mut rows| {
        let (tw, t0) = (rows.len(), rows.t0);
        let mut acc = Strip::new(tw, sc.x.len(), sc.exact);
        let mut bc = Vec::new();
        let (mut g, mut from) = (sc.groups.of(r0), r0);
        for s in r0..r0 + h {
            if sc.groups.of(s) != g {
                acc.flush(&mut rows, g, from..s, (v, r0), sc, &mut bc);
                (g, from) = (sc.groups.of(s), s);
            }
            v.pieces(s - r0, t0..t0 + tw, |c, p| acc.fold(p, c - t0, s, sc));
        }
        acc.flush(&mut rows, g, from..r0 + h, (v, r0), sc, &mut bc);
        if !bc.is_empty() {
            sc.bad_cols
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(bc);
        }
    });
}

/// The right-hand side of a dense pass: the K-row sums of the scatter pass over op(B).
struct Rhs<'a> {
    rg: usize,
    g: usize,
    /// Signed sums as f64 (K × rg), when the pass is not exact.
    signed: Vec<f64>,
    /// Signed sums in double-double (K × rg), when it is: their high and low parts apart
    /// (the dense loop runs along a row of each).
    dd_hi: Vec<f64>,
    dd_lo: Vec<f64>,
    sq: &'a [f64],
    abs: &'a [f64],
}

impl<'a> Rhs<'a> {
    /// The right-hand side of a dense pass keeping its signed sums as `S`.
    fn new<S: Signed>(z: &'a Sums) -> Rhs<'a> {
        let plain = std::any::TypeId::of::<S>() == std::any::TypeId::of::<f64>();
        let part = |f: fn(&Dd) -> f64, want: bool| match want {
            true => z.signed.iter().map(f).collect(),
            false => Vec::new(),
        };
        Rhs {
            rg: z.rounds * z.groups,
            g: z.groups,
            signed: part(|d| d.value(), plain),
            dd_hi: part(|d| d.hi, !plain),
            dd_lo: part(|d| d.lo, !plain),
            sq: &z.sq,
            abs: &z.abs,
        }
    }
}

/// How a dense pass keeps its signed sums: f64 through faer, or double-double.
trait Signed: Send + Sync + Copy + Default + 'static {
    /// `dst (a.nrows() × rg) += a · Z[k0..k0 + a.ncols()]`, over the whole pool.
    fn add(dst: &mut [Self], a: MatRef<f64>, z: &Rhs, k0: usize);
    fn into_dd(v: Vec<Self>) -> Vec<Dd>;
}

impl Signed for f64 {
    fn add(dst: &mut [f64], a: MatRef<f64>, z: &Rhs, k0: usize) {
        gemm(dst, a, &z.signed, z.rg, k0);
    }
    fn into_dd(v: Vec<f64>) -> Vec<Dd> {
        v.into_iter().map(|hi| Dd { hi, lo: 0.0 }).collect()
    }
}

/// Rows of op(A) a task of the double-double dense loop takes together, and the K rows of Z
/// it runs through at once: a chunk of Z (128 × rg double-doubles, 128 KiB at rg = 64) stays in
/// cache for the block's eight rows, where each row streamed all of Z before (4 MiB a row at
/// K = 4096, 32 MiB at 32768: the loop ran at memory speed).
const DD_ROWS: usize = 8;
const DD_KC: usize = 128;

impl Signed for Dd {
    /// Each element's sum runs over k in order, [`Dd::add_scaled`] by [`kernel::dd_axpy`]: the
    /// same sums as one row at a time.
    fn add(dst: &mut [Dd], a: MatRef<f64>, z: &Rhs, k0: usize) {
        let rg = z.rg;
        dst.par_chunks_mut(DD_ROWS * rg)
            .enumerate()
            .for_each(|(b, o)| {
                let rows = o.len() / rg;
                let mut hi: Vec<f64> = o.iter().map(|d| d.hi).collect();
                let mut lo: Vec<f64> = o.iter().map(|d| d.lo).collect();
                for c0 in (0..a.ncols()).step_by(DD_KC) {
                    let c1 = (c0 + DD_KC).min(a.ncols());
                    for r in 0..rows {
                        let i = b * DD_ROWS + r;
                        let (h, l) = (&mut hi[r * rg..][..rg], &mut lo[r * rg..][..rg]);
                        for kk in c0..c1 {
                            let av = a[(i, kk)];
                            if av != 0.0 {
                                let zr = (k0 + kk) * rg;
                                kernel::dd_axpy(
                                    av,
                                    &z.dd_hi[zr..zr + rg],
                                    &z.dd_lo[zr..zr + rg],
                                    h,
                                    l,
                                );
                            }
                        }
                    }
                }
                for (d, (&hi, &lo)) in o.iter_mut().zip(hi.iter().zip(&lo)) {
                    *d = Dd { hi, lo };
                }
            });
    }
    fn into_dd(v: Vec<Dd>) -> Vec<Dd> {
        v
    }
}

/// op(A)·Z for the sums `z` of a scatter pass over op(B) (K rows): signed sums in
/// double-double when `exact` (f64 data), in f64 otherwise (f32 products are exact in f64 and
/// the f64 sums' own error is counted by the model) — through faer on the CPU, or on `dev`
/// ([`crate::backend::fold`]) where the data is not f64 and a device is open; `sq` columns are
/// multiplied by op(A)∘op(A), `abs` by |op(A)|. Rows of op(A) holding NaN/Inf are marked in
/// `bad_row` (their values count as 0, so they spoil no other row).
///
/// A device's sums of the first and of the last band are checked against the CPU's sums of the
/// same bands on sampled rows ([`Sample`], [`agree`]: equal up to the f64 rounding of either
/// order of addition, every row's NaN/Inf marks, the rows outside the band unchanged) before
/// the pass is trusted: the first catches a device that computes wrongly, the last one that
/// places a band wrongly (its offsets into the sums, its rows' NaN/Inf marks). On a difference, or any
/// error or panic of the device, the pass is done on the CPU and the device is not used again
/// ([`Device`]'s note says why). An error reading the file is the pass's, not the device's.
pub(crate) fn dense(op: &Op, z: &Sums, exact: bool, dev: &Device) -> Result<Sums> {
    if op.file.dtype() != DType::F64 && !exact {
        if let Some(mut d) = dev.take() {
            let name = d.name();
            let t0 = std::time::Instant::now();
            match dense_on(d.as_mut(), op, z, dev.take_staging()) {
                Ok(sums) => {
                    report_time("dense", op, t0, Some(&name));
                    dev.give_back(d, true);
                    return Ok(sums);
                }
                Err(Fail::Read(e)) => {
                    dev.give_back(d, false);
                    return Err(e);
                }
                Err(Fail::Device(why)) => dev.fail(&name, why),
            }
        }
    }
    timed("dense", op, || match (op.file.dtype(), exact) {
        (DType::F64, true) => dense_t::<f64, Dd>(op, z),
        (DType::F64, false) => dense_t::<f64, f64>(op, z),
        (_, true) => dense_t::<f32, Dd>(op, z),
        (_, false) => dense_t::<f32, f64>(op, z),
    })
}

/// Why a pass on a device stopped: reading the file (the pass's error), or the device.
enum Fail {
    Read(crate::error::Error),
    Device(String),
}

/// [`dense`] on a device, for data read as f32, into `staging` when it is large enough (made
/// and locked by [`prepare`]), else into buffers made now.
fn dense_on(
    dev: &mut dyn FoldDevice,
    op: &Op,
    z: &Sums,
    staging: Option<Staging>,
) -> std::result::Result<Sums, Fail> {
    let (m_rows, k) = op.shape();
    let (rg, g) = (z.rounds * z.groups, z.groups);
    let rhs = Rhs::new::<f64>(z);
    let spec = FoldSpec {
        m: m_rows,
        k,
        rg,
        g,
        trans: op.trans,
        signed: &rhs.signed,
        abs: &z.abs,
        sq: &z.sq,
    };
    let rows = op.file.shape().0 as usize;
    let band_h = device_band_rows(op);
    let band = band_h * op.file.shape().1 as usize;
    let device = |e: crate::error::Error| Fail::Device(e.to_string());
    let t = std::time::Instant::now();
    if let Err(e) = dev.begin(&spec, band) {
        // `staging` is locked by the device: let go of it before it is freed.
        if staging.is_some() {
            dev.unpin();
        }
        return Err(device(e));
    }
    let now = std::time::Instant::now();
    crate::trace::span("verify: device", "begin (the sums up)", t, now);
    let mut st = match staging {
        Some(st) if st.elems >= band => st,
        other => {
            // Locked by the device, if at all: let go of before they are freed.
            if other.is_some() {
                dev.unpin();
            }
            drop(other);
            let st = staging_for(band).map_err(Fail::Read)?;
            let [b0, b1] = &st.bufs;
            dev.pin(&[as_f32(b0, band), as_f32(b1, band)]);
            st
        }
    };
    crate::trace::span(
        "verify: device",
        "host buffers",
        now,
        std::time::Instant::now(),
    );
    let [b0, b1] = &mut st.bufs;
    let (s0, s1) = (as_f32_mut(b0, band), as_f32_mut(b1, band));
    let mut failed = None;
    // The device's sums after the last band, which its check downloaded.
    let mut last = None;
    let looped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        bands_in::<f32>(op, band_h, true, [s0, s1], |r0, h, m| {
            let mut step = || -> std::result::Result<(), String> {
                let e = |e: crate::error::Error| e.to_string();
                // The first band, and the last, are checked against the CPU's sums of them.
                let checked = r0 == 0 || r0 + h == rows;
                let before = match checked && r0 > 0 {
                    true => Some(dev.sums().map_err(e)?),
                    false => None,
                };
                let t = std::time::Instant::now();
                dev.fold(r0, h, m).map_err(e)?;
                let now = std::time::Instant::now();
                crate::trace::span("verify: device", "fold (to the copy's end)", t, now);
                if checked {
                    // The CPU's sample while the device works on the band.
                    let smp = Sample::of(op, &rhs, r0, h, m);
                    let kk = if op.trans { h } else { k };
                    let after = dev.sums().map_err(e)?;
                    crate::trace::span(
                        "verify: device",
                        "cross-check",
                        now,
                        std::time::Instant::now(),
                    );
                    agree(&after, before.as_ref(), &smp, (z.rounds, g), kk).map_err(|why| {
                        format!(
                            "its sums of rows {r0}..{} of {} differ from the CPU's: {why}",
                            r0 + h,
                            op.file.path().display()
                        )
                    })?;
                    if r0 + h == rows {
                        last = Some(after);
                    }
                }
                Ok(())
            };
            match step() {
                Ok(()) => true,
                Err(e) => {
                    failed = Some(e);
                    false
                }
            }
        })
    }));
    // Before the buffers go: the device waits for its copies from them and lets go of them.
    let t = std::time::Instant::now();
    dev.unpin();
    drop(st);
    crate::trace::span(
        "verify: device",
        "unpin, free",
        t,
        std::time::Instant::now(),
    );
    match looped {
        Err(_) => return Err(Fail::Device("it panicked".into())),
        Ok(r) => {
            if let Some(why) = failed {
                return Err(Fail::Device(why));
            }
            r.map_err(Fail::Read)?;
        }
    }
    let d = match last {
        Some(d) => d,
        None => dev.sums().map_err(device)?,
    };
    Ok(Sums {
        rounds: z.rounds,
        groups: g,
        signed: d.signed.into_iter().map(|hi| Dd { hi, lo: 0.0 }).collect(),
        sq: d.sq,
        abs: d.abs,
        nonfinite: kernel::zeros(m_rows * g),
        bad_row: d.bad,
        bad_col: vec![false; k],
    })
}

/// Get `dev`'s device ready for [`dense`] over `op` with `rounds` × `groups` signed sums
/// ([`FoldDevice::prepare`]: its buffers, and each kernel run once), while the pass over op(B)
/// computes the sums it needs. Nothing where the pass will not run on a device (f64 data, the
/// exact sums, no device); a device that fails here is let go, as in [`dense`].
pub(crate) fn prepare(op: &Op, rounds: usize, groups: usize, exact: bool, dev: &Device) {
    if op.file.dtype() == DType::F64 || exact || !dev.may_have_device() {
        return;
    }
    // The host buffers first: their pages are made while the GPU is still opening (or those
    // of an earlier step, already locked, when large enough).
    let t = std::time::Instant::now();
    let band_h = device_band_rows(op);
    let cols = op.file.shape().1 as usize;
    let old = dev.take_staging();
    let (old, fresh) = match old {
        Some(o) if o.elems >= band_h * cols => (Some(o), None),
        o => match staging_for(band_h * cols) {
            Ok(st) => (o, Some(st)),
            Err(_) => {
                dev.keep_staging_opt(o);
                return;
            }
        },
    };
    crate::trace::span(
        "verify: device",
        "host buffers",
        t,
        std::time::Instant::now(),
    );
    let Some(mut d) = dev.take() else {
        // No device (any earlier one was let go, and let go of what it locked).
        return;
    };
    let t = std::time::Instant::now();
    let (m, k) = op.shape();
    let spec = FoldSpec {
        m,
        k,
        rg: rounds * groups,
        g: groups,
        trans: op.trans,
        signed: &[],
        abs: &[],
        sq: &[],
    };
    let st = match fresh {
        Some(st) => {
            // Buffers of an earlier step too small: let go of them before they are freed.
            if old.is_some() {
                d.unpin();
            }
            drop(old);
            st
        }
        None => old.expect("kept when no fresh buffers were made"),
    };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        d.prepare(&spec, band_h, cols)?;
        let [b0, b1] = &st.bufs;
        d.pin(&[as_f32(b0, st.elems), as_f32(b1, st.elems)]);
        Ok::<(), crate::error::Error>(())
    }));
    crate::trace::span("verify: device", "prepare", t, std::time::Instant::now());
    match r {
        Ok(Ok(())) => {
            dev.give_back(d, false);
            dev.keep_staging(st);
        }
        // The device lets go of what it locked as it is dropped, before the buffers are.
        Ok(Err(e)) => dev.fail(&d.name(), e.to_string()),
        Err(_) => dev.fail(&d.name(), "it panicked".into()),
    }
}

/// Most bytes of one band of the dense pass on a device (each of its two host buffers, and
/// of the device's two band buffers).
const DEVICE_BAND_MAX: usize = if cfg!(test) { 16 << 10 } else { 128 << 20 };

/// Stored rows per band of the dense pass on a device: [`band_rows`], rounded up to whole
/// rows of storage tiles when their checksums are checked as the file is read (within
/// [`DEVICE_BAND_MAX`]). A band that covers a tile in part reads the rest of the tile again to
/// complete its checksum, so 32 MiB bands of a file of 1024-row tiles read 1.75 times its
/// bytes: 1.7 ms a band against 1.0 for a band whose tiles were checked, on one H100
/// (docs/measurements/2026-12-06f-h100-1-head-verify-trace.log). On the CPU the larger band
/// was slower (its widening and products, 2.79 s against 0.99: 9cb375c); the device's cost
/// per band is a copy at the PCIe rate and a few milliseconds of kernels at any height.
fn device_band_rows(op: &Op) -> usize {
    let (rows, cols) = (op.file.shape().0 as usize, op.file.shape().1 as usize);
    let b = band_rows::<f32>(op);
    match (op.check, op.file.checksum_tile()) {
        (true, Some((tr, _))) if tr > 0 => {
            let tr = tr as usize;
            let r = b.div_ceil(tr) * tr;
            match r * cols * 4 <= DEVICE_BAND_MAX {
                true => r.min(rows.max(1)),
                false => b,
            }
        }
        _ => b,
    }
}

/// The first `len` f32 of a page-aligned host buffer.
fn as_f32_mut(b: &mut crate::backend::HostBuf, len: usize) -> &mut [f32] {
    let bytes = &mut b.bytes_mut()[..len * 4];
    <[f32] as zerocopy::FromBytes>::mut_from_bytes(bytes).expect("4096-aligned, 4·len bytes")
}

/// [`as_f32_mut`], read only.
fn as_f32(b: &crate::backend::HostBuf, len: usize) -> &[f32] {
    let bytes = &b.bytes()[..len * 4];
    <[f32] as zerocopy::FromBytes>::ref_from_bytes(bytes).expect("4096-aligned, 4·len bytes")
}

/// Two host buffers of `elems` f32 for a dense pass on a device: page-aligned and of whole
/// pages (the device may page-lock them: no page shared with other memory), their pages made
/// now (zeroed).
fn staging_for(elems: usize) -> Result<Staging> {
    let alloc = || crate::backend::HostBuf::heap(elems * 4);
    Ok(Staging {
        bufs: [alloc()?, alloc()?],
        elems,
    })
}

/// Op rows of a band whose sums the CPU computes to check a device's: at most this many,
/// spread evenly over the op rows the band adds to (its first and last among them).
const SAMPLE_ROWS: usize = 16;

/// The CPU's sums of one band of stored rows for a sample of op rows ([`SAMPLE_ROWS`]), and
/// the band's NaN/Inf marks of every op row: what [`agree`] checks a device's sums against.
///
/// A device that computes wrongly (a DGEMM's layout, a kernel), or places a band wrongly (its
/// offset into the sums), is wrong on every op row the band adds to, so a sample finds it as
/// the whole band would. The whole band took the CPU 90–115 ms per check (32768 columns, two
/// checks per pass: 0.19–0.22 s of a 0.66–0.71 s dense pass on one H100,
/// docs/measurements/2026-12-06f-h100-1-head-verify-trace.log); the sample takes a few.
struct Sample {
    /// The op rows the band adds to (all of them for op(A) = Aᵀ): the others must be as they
    /// were, bit for bit.
    span: Range<usize>,
    rows: Vec<usize>,
    /// Per sampled row: rg signed sums, then g abs and g sq sums.
    signed: Vec<f64>,
    abs: Vec<f64>,
    sq: Vec<f64>,
    /// Op rows (all M) that the band holds NaN/Inf in.
    bad: Vec<bool>,
}

impl Sample {
    /// Stored rows `r0..r0 + h` of op's file (`band`, row-major h × cols) against `rhs`.
    fn of(op: &Op, rhs: &Rhs, r0: usize, h: usize, band: &[f32]) -> Sample {
        let (m, _) = op.shape();
        let cols = band.len() / h.max(1);
        let (rg, g) = (rhs.rg, rhs.g);
        // The op rows this band adds to, and its K range: op(A) = A, rows r0..r0 + h over all
        // of K; op(A) = Aᵀ, every op row (a stored column) over k = r0..r0 + h.
        let (lo, n, k0, kk) = match op.trans {
            true => (0, m, r0, h),
            false => (r0, h, 0, cols),
        };
        let count = SAMPLE_ROWS.min(n);
        let rows: Vec<usize> = (0..count)
            .map(|j| {
                lo + if count > 1 {
                    j * (n - 1) / (count - 1)
                } else {
                    0
                }
            })
            .collect();
        let at = |i: usize, l: usize| match op.trans {
            true => band[l * cols + i],
            false => band[(i - r0) * cols + l],
        };
        let sums: Vec<(Vec<f64>, Vec<f64>, Vec<f64>)> = rows
            .par_iter()
            .map(|&i| {
                let (mut sg, mut ab, mut sq) = (vec![0.0; rg], vec![0.0; g], vec![0.0; g]);
                for l in 0..kk {
                    let v = at(i, l);
                    if !v.is_finite() {
                        continue;
                    }
                    let (a, k) = (v as f64, k0 + l);
                    let z = &rhs.signed[k * rg..(k + 1) * rg];
                    sg.iter_mut().zip(z).for_each(|(s, z)| *s += a * z);
                    let (za, zq) = (&rhs.abs[k * g..(k + 1) * g], &rhs.sq[k * g..(k + 1) * g]);
                    for gr in 0..g {
                        ab[gr] += a.abs() * za[gr];
                        sq[gr] += a * a * zq[gr];
                    }
                }
                (sg, ab, sq)
            })
            .collect();
        // Flags, not a list of elements: a band all NaN marks every op row once.
        let flags: Vec<std::sync::atomic::AtomicBool> =
            (0..m).map(|_| Default::default()).collect();
        let mark = |i: usize| flags[i].store(true, std::sync::atomic::Ordering::Relaxed);
        band.par_chunks(cols.max(1))
            .enumerate()
            .for_each(|(l, row)| match op.trans {
                true => (row.iter().enumerate())
                    .filter(|(_, v)| !v.is_finite())
                    .for_each(|(c, _)| mark(c)),
                false => {
                    if !row.iter().all(|v| v.is_finite()) {
                        mark(r0 + l)
                    }
                }
            });
        let bad: Vec<bool> = flags.into_iter().map(|f| f.into_inner()).collect();
        let (mut signed, mut abs, mut sq) = (Vec::new(), Vec::new(), Vec::new());
        for (sg, ab, q) in sums {
            signed.extend(sg);
            abs.extend(ab);
            sq.extend(q);
        }
        Sample {
            span: lo..lo + n,
            rows,
            signed,
            abs,
            sq,
            bad,
        }
    }
}

/// Whether a device's sums after one band (`d`; `before` it, or zero) are those before plus
/// the CPU's sums of the band on `smp`'s rows, up to the f64 rounding of `kk` terms added in
/// any order onto what was there: |error| ≤ (kk + 1)·u·(Σ|terms| + |before|) for each sum, and
/// the signed sums' terms are bounded by the abs sums' (|Σ±b| ≤ Σ|b|). Here 4·(kk + 2)·ε. The
/// NaN/Inf marks must be those before or the band's, on every op row.
fn agree(
    d: &FoldSums,
    before: Option<&FoldSums>,
    smp: &Sample,
    (rounds, g): (usize, usize),
    kk: usize,
) -> std::result::Result<(), String> {
    let rg = rounds * g;
    let m = smp.bad.len();
    let shaped = |f: &FoldSums| {
        f.signed.len() == m * rg && f.abs.len() == m * g && f.sq.len() == m * g && f.bad.len() == m
    };
    if !shaped(d) || before.is_some_and(|b| !shaped(b)) {
        return Err("the device returned sums of the wrong shape".into());
    }
    let at0 = |v: fn(&FoldSums) -> &Vec<f64>, i: usize| before.map_or(0.0, |b| v(b)[i]);
    let rel = 4.0 * (kk as f64 + 2.0) * f64::EPSILON;
    // `x` against `was + y`, whose terms' magnitudes add up to `scale`.
    let close = |x: f64, was: f64, y: f64, scale: f64| {
        let want = was + y;
        x == want || (x - want).abs() <= rel * (scale + was.abs()) + f64::MIN_POSITIVE
    };
    for i in 0..m {
        let was_bad = before.is_some_and(|b| b.bad[i]);
        if d.bad[i] != (was_bad || smp.bad[i]) {
            return Err(format!("row {i}'s NaN/Inf mark"));
        }
    }
    // Rows the band does not add to: unchanged (a DGEMM writing one row too many, or at a wrong
    // leading dimension, changes them; the sample inside the band might not see it).
    for i in (0..m).filter(|i| !smp.span.contains(i)) {
        let same = |x: &[f64], b: Option<&[f64]>, w: usize| match b {
            Some(b) => x[i * w..(i + 1) * w] == b[i * w..(i + 1) * w],
            None => x[i * w..(i + 1) * w].iter().all(|&v| v == 0.0),
        };
        if !same(&d.signed, before.map(|b| &b.signed[..]), rg)
            || !same(&d.abs, before.map(|b| &b.abs[..]), g)
            || !same(&d.sq, before.map(|b| &b.sq[..]), g)
        {
            return Err(format!("row {i}, outside the band, changed"));
        }
    }
    for (j, &i) in smp.rows.iter().enumerate() {
        for gr in 0..g {
            let (at, mine) = (i * g + gr, j * g + gr);
            let scale = smp.abs[mine];
            let (wa, wq) = (at0(|f| &f.abs, at), at0(|f| &f.sq, at));
            if !close(d.abs[at], wa, smp.abs[mine], scale)
                || !close(d.sq[at], wq, smp.sq[mine], smp.sq[mine])
            {
                return Err(format!(
                    "row {i}, group {gr}: tolerance sums {:e}, {:e} against {:e}, {:e}",
                    d.abs[at],
                    d.sq[at],
                    wa + smp.abs[mine],
                    wq + smp.sq[mine]
                ));
            }
            for rho in 0..rounds {
                let (s, t) = (i * rg + rho * g + gr, j * rg + rho * g + gr);
                let ws = at0(|f| &f.signed, s);
                if !close(d.signed[s], ws, smp.signed[t], scale) {
                    return Err(format!(
                        "row {i}, group {gr}, round {rho}: {:e} against {:e}",
                        d.signed[s],
                        ws + smp.signed[t]
                    ));
                }
            }
        }
    }
    Ok(())
}

fn dense_t<T: Elem, S: Signed>(op: &Op, z: &Sums) -> Result<Sums> {
    let (m_rows, k) = op.shape();
    let rhs = Rhs::new::<S>(z);
    let mut out = Sums::new(m_rows, k, z.rounds, z.groups);
    let mut signed = kernel::zeros::<S>(m_rows * rhs.rg);
    let mut a = Vec::new();
    bands::<T>(op, |r0, h, m| {
        fold_band(op, &rhs, r0, h, m, &mut a, &mut out, &mut signed)
    })?;
    out.signed = S::into_dd(signed);
    Ok(out)
}

/// Fold stored rows `r0..r0 + h` of op's file (`m`) into `out`'s tolerance sums and row marks
/// and into `signed`, widened through `a` (reused from band to band).
#[allow(clippy::too_many_arguments)]
fn fold_band<T: Elem, S: Signed>(
    op: &Op,
    rhs: &Rhs,
    r0: usize,
    h: usize,
    m: &[T],
    a: &mut Vec<f64>,
    out: &mut Sums,
    signed: &mut [S],
) {
    let (m_rows, _) = op.shape();
    let (rg, g) = (rhs.rg, rhs.g);
    let band = Band {
        m,
        r0,
        cols: m.len() / h,
    };
    let lay = widen_band(&band, h, op.trans, a, &mut out.bad_row);
    // op(A) = A: the band is op rows r0..r0 + h over all of K. op(A) = Aᵀ: it is all op
    // rows over k = r0..r0 + h.
    let (rows, k0) = match op.trans {
        true => (0..m_rows, r0),
        false => (r0..r0 + h, 0),
    };
    S::add(
        &mut signed[rows.start * rg..rows.end * rg],
        lay.of(a),
        rhs,
        k0,
    );
    let (sq, abs) = (
        &mut out.sq[rows.start * g..rows.end * g],
        &mut out.abs[rows.start * g..rows.end * g],
    );
    tolerance(a, lay, rhs, k0, sq, abs);
}

/// `dst (a.nrows() × w) += a · Z[k0..k0 + a.ncols()]` for a K × w row-major `z`, over the
/// whole pool.
///
/// A band of op(A) = A is short (a few hundred rows) and very wide (all of K), and Z is narrow
/// (w ≤ 128): faer's own parallel split of that shape kept 32 cores at ~90 GFLOP/s (the GPU
/// host, n = 32768, docs/measurements/2026-11-30-keepup-4-final.log). So such a band is cut
/// along K instead: each task multiplies one K range on one core into its own partial result,
/// and the partials are added in order (the same sum whatever the scheduling).
fn gemm(dst: &mut [f64], a: MatRef<f64>, z: &[f64], w: usize, k0: usize) {
    let rhs = MatRef::from_row_major_slice(z, z.len() / w, w).subrows(k0, a.ncols());
    let (m, kk) = (a.nrows(), a.ncols());
    let threads = rayon::current_num_threads().max(1);
    if threads == 1 || m >= 64 * threads || kk < 1024 {
        let dst = MatMut::from_row_major_slice_mut(dst, m, w);
        matmul(dst, Accum::Add, a, rhs, 1.0, Par::rayon(threads));
        return;
    }
    gemm_ksplit(dst, a, rhs, threads);
}

/// `dst += a · rhs` in K ranges of one task each (see [`gemm`]), for `threads` threads.
fn gemm_ksplit(dst: &mut [f64], a: MatRef<f64>, rhs: MatRef<f64>, threads: usize) {
    let (m, kk, w) = (a.nrows(), a.ncols(), rhs.ncols());
    let chunk = kk.div_ceil(2 * threads).max(256);
    let starts: Vec<usize> = (0..kk).step_by(chunk).collect();
    let partials: Vec<Vec<f64>> = starts
        .par_iter()
        .map(|&c0| {
            let len = chunk.min(kk - c0);
            let mut part = vec![0.0; m * w];
            let out = MatMut::from_row_major_slice_mut(&mut part, m, w);
            let (lhs, r) = (a.subcols(c0, len), rhs.subrows(c0, len));
            matmul(out, Accum::Replace, lhs, r, 1.0, Par::Seq);
            part
        })
        .collect();
    for part in &partials {
        dst.par_chunks_mut(1 << 14)
            .zip(part.par_chunks(1 << 14))
            .for_each(|(d, p)| d.iter_mut().zip(p).for_each(|(d, p)| *d += p));
    }
}

/// How the widened band (row-major `rows × cols`) is seen as a piece of op(A): as it is, or
/// transposed.
#[derive(Clone, Copy)]
struct Layout {
    rows: usize,
    cols: usize,
    trans: bool,
}

impl Layout {
    fn of(self, v: &[f64]) -> MatRef<'_, f64> {
        let m = MatRef::from_row_major_slice(v, self.rows, self.cols);
        if self.trans {
            m.transpose()
        } else {
            m
        }
    }
}

/// Widen `band` (h stored rows) into `a`, reused from band to band, with NaN/Inf set to 0 and
/// their op rows marked in `bad` (stored rows when op(A) = A, stored columns when Aᵀ).
fn widen_band<T: Elem>(
    band: &Band<T>,
    h: usize,
    trans: bool,
    a: &mut Vec<f64>,
    bad: &mut [bool],
) -> Layout {
    let cols = band.cols;
    a.resize(h * cols, 0.0);
    let bad_ops = Mutex::new(Vec::new());
    let per = h.div_ceil(pieces()).max(1);
    a.par_chunks_mut(per * cols)
        .enumerate()
        .for_each(|(p, dst)| {
            for (l, d) in dst.chunks_mut(cols).enumerate() {
                if kernel::widen(band.row(band.r0 + p * per + l, 0, cols), d) {
                    continue;
                }
                let mut found = Vec::new();
                for (c, v) in d.iter_mut().enumerate() {
                    if !v.is_finite() {
                        *v = 0.0;
                        found.push(c);
                    }
                }
                if !trans {
                    found = vec![band.r0 + p * per + l];
                }
                bad_ops
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend(found);
            }
        });
    for i in bad_ops.into_inner().unwrap_or_else(|e| e.into_inner()) {
        bad[i] = true;
    }
    Layout {
        rows: h,
        cols,
        trans,
    }
}

/// Add |a|·Z_abs and (a∘a)·Z_sq; `a` may be overwritten.
fn tolerance(a: &mut [f64], lay: Layout, z: &Rhs, k0: usize, sq: &mut [f64], abs: &mut [f64]) {
    let threads = rayon::current_num_threads().max(1);
    if !lay.trans && threads > 1 && lay.rows < 64 * threads && lay.cols >= 1024 {
        return tolerance_ksplit(a, lay, z, k0, sq, abs, threads);
    }
    a.par_chunks_mut(1 << 16)
        .for_each(|c| c.iter_mut().for_each(|v| *v = v.abs()));
    gemm(abs, lay.of(a), z.abs, z.g, k0);
    a.par_chunks_mut(1 << 16)
        .for_each(|c| c.iter_mut().for_each(|v| *v *= *v));
    gemm(sq, lay.of(a), z.sq, z.g, k0);
}

/// [`tolerance`] for a short, wide band of op(A) = A, cut along K like [`gemm`]: each task
/// takes |a| and a∘a of its K range into a buffer of its own (cache-sized, instead of two more
/// passes over the whole band) and multiplies them on one core; partials are added in order.
fn tolerance_ksplit(
    a: &[f64],
    lay: Layout,
    z: &Rhs,
    k0: usize,
    sq: &mut [f64],
    abs: &mut [f64],
    threads: usize,
) {
    let (m, kk, g) = (lay.rows, lay.cols, z.g);
    let chunk = kk.div_ceil(2 * threads).max(256);
    let starts: Vec<usize> = (0..kk).step_by(chunk).collect();
    fn rhs(v: &[f64], g: usize, k: usize, len: usize) -> MatRef<'_, f64> {
        MatRef::from_row_major_slice(v, v.len() / g, g).subrows(k, len)
    }
    let parts: Vec<(Vec<f64>, Vec<f64>)> = starts
        .par_iter()
        .map(|&c0| {
            let len = chunk.min(kk - c0);
            let mut loc = vec![0.0; m * len];
            for (i, d) in loc.chunks_mut(len).enumerate() {
                let src = &a[i * kk + c0..i * kk + c0 + len];
                d.iter_mut().zip(src).for_each(|(d, s)| *d = s.abs());
            }
            let (mut pa, mut ps) = (vec![0.0; m * g], vec![0.0; m * g]);
            let lhs = MatRef::from_row_major_slice(&loc, m, len);
            let out = MatMut::from_row_major_slice_mut(&mut pa, m, g);
            matmul(
                out,
                Accum::Replace,
                lhs,
                rhs(z.abs, g, k0 + c0, len),
                1.0,
                Par::Seq,
            );
            loc.iter_mut().for_each(|v| *v *= *v);
            let lhs = MatRef::from_row_major_slice(&loc, m, len);
            let out = MatMut::from_row_major_slice_mut(&mut ps, m, g);
            matmul(
                out,
                Accum::Replace,
                lhs,
                rhs(z.sq, g, k0 + c0, len),
                1.0,
                Par::Seq,
            );
            (pa, ps)
        })
        .collect();
    for (pa, ps) in &parts {
        abs.iter_mut().zip(pa).for_each(|(d, p)| *d += p);
        sq.iter_mut().zip(ps).for_each(|(d, p)| *d += p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u64) -> Vec<f64> {
        let mut g = crate::store::gen::Rng::new(seed, 0);
        (0..n)
            .map(|_| (g.next_u64() >> 11) as f64 / (1u64 << 53) as f64 - 0.5)
            .collect()
    }

    /// The double-double dense loop (blocks of rows, chunks of K, high and low parts apart,
    /// AVX2 + FMA where the CPU has them) gives exactly the sums of [`Dd::add_scaled`] one row
    /// at a time, k in order: on shapes that straddle its blocks (rows not a multiple of 8, K
    /// not of 128, an offset k0, zeros in A skipped) and starting from non-zero sums.
    #[test]
    fn the_blocked_double_double_loop_gives_the_row_by_row_sums_bit_for_bit() {
        for (m, kk, rg, k0) in [
            (19usize, 300usize, 64usize, 0usize),
            (8, 128, 6, 5),
            (3, 1, 1, 0),
        ] {
            let mut av = data(m * kk, 1);
            for x in av.iter_mut().step_by(7) {
                *x = 0.0;
            }
            let a = MatRef::from_row_major_slice(&av, m, kk);
            let zk = k0 + kk;
            let (zh, zl) = (data(zk * rg, 2), data(zk * rg, 3));
            let zdd: Vec<Dd> = zh
                .iter()
                .zip(&zl)
                .map(|(&hi, &lo)| Dd { hi, lo: lo * 1e-17 })
                .collect();
            let rhs = Rhs {
                rg,
                g: 1,
                signed: Vec::new(),
                dd_hi: zdd.iter().map(|d| d.hi).collect(),
                dd_lo: zdd.iter().map(|d| d.lo).collect(),
                sq: &[],
                abs: &[],
            };
            let start: Vec<Dd> = data(m * rg, 4)
                .into_iter()
                .map(|hi| Dd { hi, lo: hi * 1e-18 })
                .collect();
            let mut got = start.clone();
            <Dd as Signed>::add(&mut got, a, &rhs, k0);
            let mut want = start;
            for i in 0..m {
                for k in 0..kk {
                    if a[(i, k)] != 0.0 {
                        for c in 0..rg {
                            want[i * rg + c].add_scaled(a[(i, k)], zdd[(k0 + k) * rg + c]);
                        }
                    }
                }
            }
            for (e, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g.hi.to_bits() == w.hi.to_bits() && g.lo.to_bits() == w.lo.to_bits(),
                    "{m}×{kk}·rg {rg}, element {e}: {g:?} against {w:?}"
                );
            }
        }
    }

    fn close(a: &[f64], b: &[f64]) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-12 * (1.0 + y.abs()), "{x} vs {y}");
        }
    }

    /// The K-split products (used for short, wide bands on many cores) equal one plain product.
    #[test]
    fn ksplit_products_match_one_product() {
        let (m, kk, w, g, k0) = (20, 3000, 12, 5, 7);
        let a = data(m * kk, 1);
        let z = data((kk + k0) * w, 2);
        let zs = data((kk + k0) * g, 3);
        let za = data((kk + k0) * g, 4);
        let lhs = MatRef::from_row_major_slice(&a, m, kk);
        let rhs = MatRef::from_row_major_slice(&z, kk + k0, w).subrows(k0, kk);
        let mut want = vec![1.0; m * w];
        let out = MatMut::from_row_major_slice_mut(&mut want, m, w);
        matmul(out, Accum::Add, lhs, rhs, 1.0, Par::Seq);
        let mut got = vec![1.0; m * w];
        gemm_ksplit(&mut got, lhs, rhs, 8);
        close(&got, &want);

        let rhs_t = Rhs {
            rg: w,
            g,
            signed: Vec::new(),
            dd_hi: Vec::new(),
            dd_lo: Vec::new(),
            sq: &zs,
            abs: &za,
        };
        let lay = Layout {
            rows: m,
            cols: kk,
            trans: false,
        };
        let (mut sq, mut abs) = (vec![0.5; m * g], vec![0.25; m * g]);
        tolerance_ksplit(&a, lay, &rhs_t, k0, &mut sq, &mut abs, 8);
        let (mut sq2, mut abs2) = (vec![0.5; m * g], vec![0.25; m * g]);
        let mut a2 = a.clone();
        a2.iter_mut().for_each(|v| *v = v.abs());
        fn zr(v: &[f64], rows: usize, g: usize, k0: usize) -> MatRef<'_, f64> {
            MatRef::from_row_major_slice(v, rows, g).subrows(k0, rows - k0)
        }
        let lhs2 = MatRef::from_row_major_slice(&a2, m, kk);
        let out = MatMut::from_row_major_slice_mut(&mut abs2, m, g);
        matmul(
            out,
            Accum::Add,
            lhs2,
            zr(&za, kk + k0, g, k0),
            1.0,
            Par::Seq,
        );
        a2.iter_mut().for_each(|v| *v *= *v);
        let lhs2 = MatRef::from_row_major_slice(&a2, m, kk);
        let out = MatMut::from_row_major_slice_mut(&mut sq2, m, g);
        matmul(
            out,
            Accum::Add,
            lhs2,
            zr(&zs, kk + k0, g, k0),
            1.0,
            Par::Seq,
        );
        close(&abs, &abs2);
        close(&sq, &sq2);
    }

    /// A source that hides its map (`mapped_block` is `None`), so the scatter copies bands.
    struct NoMap<'a>(&'a dyn MatrixSource);
    impl MatrixSource for NoMap<'_> {
        fn path(&self) -> &std::path::Path {
            self.0.path()
        }
        fn shape(&self) -> (u64, u64) {
            self.0.shape()
        }
        fn dtype(&self) -> DType {
            self.0.dtype()
        }
        fn read_block(&self, b: &Block, host: DType, dst: &mut [u8]) -> Result<()> {
            self.0.read_block(b, host, dst)
        }
        fn will_need(&self, b: &Block) -> u64 {
            self.0.will_need(b)
        }
        fn verify_block(&self, b: &Block) -> Result<()> {
            self.0.verify_block(b)
        }
        fn read_staged(&self, b: &Block, h: DType, d: &mut [u8], v: bool) -> Result<u64> {
            self.0.read_staged(b, h, d, v)
        }
        fn identity(&self) -> String {
            self.0.identity()
        }
        fn checksum_tile(&self) -> Option<(u64, u64)> {
            self.0.checksum_tile()
        }
    }

    /// Values whose sums are exact in f64 in any order (so mapped and copied must agree bit
    /// for bit), with NaN/Inf sprinkled in, as bytes of `dt`.
    fn values(rows: usize, cols: usize, dt: DType) -> Vec<u8> {
        let v = |i: usize| -> f64 {
            match i % 97 {
                13 => f64::NAN,
                41 if i.is_multiple_of(2) => f64::INFINITY,
                _ => (i % 61) as f64 * 0.25 - 7.0,
            }
        };
        (0..rows * cols)
            .flat_map(|i| match dt {
                DType::F64 => v(i).to_le_bytes().to_vec(),
                _ => (v(i) as f32).to_le_bytes().to_vec(),
            })
            .collect()
    }

    fn scatter_sums(f: &dyn MatrixSource, trans: bool, check: bool) -> Sums {
        try_scatter(f, trans, check).unwrap()
    }

    fn try_scatter(f: &dyn MatrixSource, trans: bool, check: bool) -> Result<Sums> {
        let op = Op {
            file: f,
            trans,
            round: None,
            check,
            times: false,
        };
        let (_, s) = op.shape();
        // Groups of 7 (not the storage tile's 16 or 8): they straddle tile edges.
        let groups = Groups::new(s, 7, 64);
        let mut g = crate::store::gen::Rng::new(5, 0);
        let mut x: Vec<Vec<f64>> = (0..3)
            .map(|_| {
                (0..s)
                    .map(|_| if g.next_u64() >> 63 == 0 { 1.0 } else { -1.0 })
                    .collect()
            })
            .collect();
        for xr in &mut x {
            xr[3] = 0.0; // an excluded column
        }
        scatter(&op, &groups, &x, f.dtype() == DType::F64)
    }

    fn same(a: &Sums, b: &Sums, what: &str) {
        let sig = |s: &Sums| {
            s.signed
                .iter()
                .map(|d| d.value().to_bits())
                .collect::<Vec<_>>()
        };
        let bits = |v: &[f64]| v.iter().map(|d| d.to_bits()).collect::<Vec<_>>();
        assert_eq!(sig(a), sig(b), "{what}: signed");
        assert_eq!(bits(&a.sq), bits(&b.sq), "{what}: sq");
        assert_eq!(bits(&a.abs), bits(&b.abs), "{what}: abs");
        assert_eq!(a.nonfinite, b.nonfinite, "{what}: nonfinite");
        assert_eq!(a.bad_row, b.bad_row, "{what}: bad_row");
        assert_eq!(a.bad_col, b.bad_col, "{what}: bad_col");
    }

    /// The scatter read in place from the map gives the sums of the copied bands: `.mgt` with
    /// partial edge tiles (one and several tile columns), a row-major file at an aligned and an
    /// unaligned offset, f32 and f64, as stored and transposed, with NaN/Inf, checks on and off.
    /// The CPU's sample of a band ([`Sample`]) is what its full fold gives on the sampled op
    /// rows — spread over the rows the band adds to, first and last among them — and its
    /// NaN/Inf marks are the fold's on every op row, for op(A) = A and Aᵀ, on a band wider and
    /// taller than the sample.
    #[test]
    fn a_sample_of_a_band_is_the_cpus_fold_on_its_rows() {
        use crate::store::rowmajor::{RowMajorFile, RowMajorSpec};
        let dir = tempfile::tempdir().unwrap();
        let (rows, cols) = (40usize, 300usize);
        let p = dir.path().join("a.raw");
        std::fs::write(&p, values(rows, cols, DType::F32)).unwrap();
        let spec = RowMajorSpec {
            rows: rows as u64,
            cols: cols as u64,
            dtype: DType::F32,
            data_offset: 0,
            transposed: false,
            kind: "raw".into(),
            region: false,
        };
        let f = RowMajorFile::open(&p, spec, None).unwrap();
        let band: Vec<f32> = std::fs::read(&p)
            .unwrap()
            .chunks(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        for trans in [false, true] {
            let op = Op {
                file: &f,
                trans,
                round: None,
                check: false,
                times: false,
            };
            let (m, k) = op.shape();
            let (rounds, groups) = (2, 3);
            let mut z = Sums::new(k, 1, rounds, groups);
            for (i, v) in z.signed.iter_mut().enumerate() {
                v.hi = ((i * 37) % 19) as f64 - 9.0;
            }
            for (i, v) in z.abs.iter_mut().enumerate() {
                *v = ((i * 11) % 7) as f64 + 1.0;
            }
            for (i, v) in z.sq.iter_mut().enumerate() {
                *v = ((i * 5) % 13) as f64 + 0.5;
            }
            let rhs = Rhs::new::<f64>(&z);
            // Stored rows 8..32: a band in the middle of the file.
            let (r0, h) = (8, 24);
            let m_band = &band[r0 * cols..(r0 + h) * cols];
            let smp = Sample::of(&op, &rhs, r0, h, m_band);
            let mut out = Sums::new(m, k, rounds, groups);
            let mut signed = vec![0f64; m * rhs.rg];
            fold_band::<f32, f64>(
                &op,
                &rhs,
                r0,
                h,
                m_band,
                &mut Vec::new(),
                &mut out,
                &mut signed,
            );
            let span = if trans { 0..m } else { r0..r0 + h };
            assert_eq!(smp.rows.len(), SAMPLE_ROWS, "trans {trans}");
            assert_eq!(smp.rows.first(), Some(&span.start), "trans {trans}");
            assert_eq!(smp.rows.last(), Some(&(span.end - 1)), "trans {trans}");
            assert!(smp.rows.windows(2).all(|w| w[0] < w[1]), "trans {trans}");
            assert_eq!(smp.span, span, "trans {trans}");
            assert_eq!(smp.bad, out.bad_row, "trans {trans}: NaN/Inf marks");
            assert!(
                smp.bad.iter().any(|&b| b),
                "trans {trans}: the data holds NaN/Inf"
            );
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * (1.0 + b.abs());
            let (rg, g) = (rhs.rg, rhs.g);
            for (j, &i) in smp.rows.iter().enumerate() {
                for c in 0..rg {
                    assert!(
                        close(smp.signed[j * rg + c], signed[i * rg + c]),
                        "trans {trans} row {i}"
                    );
                }
                for c in 0..g {
                    assert!(
                        close(smp.abs[j * g + c], out.abs[i * g + c]),
                        "trans {trans} row {i}"
                    );
                    assert!(
                        close(smp.sq[j * g + c], out.sq[i * g + c]),
                        "trans {trans} row {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn scatter_in_place_gives_the_sums_of_copied_bands() {
        use crate::store::rowmajor::{RowMajorFile, RowMajorSpec};
        let dir = tempfile::tempdir().unwrap();
        let mut files: Vec<(String, Box<dyn MatrixSource>, bool)> = Vec::new();
        for dt in [DType::F32, DType::F64] {
            // Tall enough (4 KiB test bands) to be read in several bands.
            for (rows, cols, tr, tc) in [(301, 45, 8, 16), (517, 13, 8, 16), (97, 200, 16, 64)] {
                let p = dir.path().join(format!("m{rows}x{cols}{dt}.mgt"));
                write_mgt(&p, (rows, cols), (tr, tc), dt);
                files.push((
                    p.display().to_string(),
                    Box::new(crate::store::TiledFile::open(&p).unwrap()),
                    true,
                ));
            }
            for (rows, cols, off) in [(301u64, 45u64, 8u64), (211, 7, 128), (150, 33, 4)] {
                let p = dir.path().join(format!("r{rows}x{cols}@{off}{dt}.raw"));
                let mut bytes = vec![0u8; off as usize];
                bytes.extend(values(rows as usize, cols as usize, dt));
                std::fs::write(&p, &bytes).unwrap();
                let spec = RowMajorSpec {
                    rows,
                    cols,
                    dtype: dt,
                    data_offset: off,
                    transposed: false,
                    kind: "raw".into(),
                    region: false,
                };
                let f = RowMajorFile::open(&p, spec, None).unwrap();
                let aligned = off % dt.size() as u64 == 0;
                files.push((p.display().to_string(), Box::new(f), aligned));
            }
        }
        for (name, f, maps) in &files {
            let rows = f.shape().0 as usize;
            // In the page cache, as a file just written normally is: the view maps only pages
            // in memory, and a full test run's memory pressure once evicted these (a failure
            // of "read in place" unrelated to the view).
            std::fs::read(name).unwrap();
            let mapped = match f.dtype() {
                DType::F64 => BandView::<f64>::mapped(f.as_ref(), 0, rows).is_some(),
                _ => BandView::<f32>::mapped(f.as_ref(), 0, rows).is_some(),
            };
            assert_eq!(mapped, *maps, "{name}: read in place");
            for trans in [false, true] {
                for check in [false, true] {
                    let got = scatter_sums(f.as_ref(), trans, check);
                    let want = scatter_sums(&NoMap(f.as_ref()), trans, check);
                    same(&got, &want, &format!("{name} trans {trans} check {check}"));
                    assert!(got.bad_row.iter().any(|&b| b), "{name}: NaN/Inf seen");
                }
            }
        }
    }
    /// A `.mgt` of `values` at `p`: `shape`, storage tiles `tile`, with checksums.
    fn write_mgt(p: &std::path::Path, shape: (u64, u64), tile: (u64, u64), dt: DType) {
        use crate::store::tiled::TiledWriter;
        use crate::store::{Header, MatrixSink};
        let (rows, cols) = shape;
        let w = TiledWriter::create(p, Header::new(dt, rows, cols, tile.0, tile.1, true)).unwrap();
        let all = Block {
            r0: 0,
            c0: 0,
            rows,
            cols,
        };
        let sink: &dyn MatrixSink = &w;
        sink.write_block(&all, dt, &values(rows as usize, cols as usize, dt))
            .unwrap();
        w.finish(false).unwrap();
    }

    /// A storage tile damaged in place is named by a checked scatter pass (its tiles checked
    /// before each band is folded), along rows and along columns (op(M) = Mᵀ), read in place and
    /// copied; an unchecked pass folds it without a word.
    #[test]
    fn a_damaged_tile_fails_the_checked_scatter_pass_in_place_and_copied() {
        use crate::store::TiledFile;
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.mgt");
        write_mgt(&p, (301, 45), (8, 16), DType::F32);
        let at = TiledFile::open(&p).unwrap().hdr.tile_offset(13, 1) + 4 * 17;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        let mut x = [0u8; 1];
        f.read_exact_at(&mut x, at).unwrap();
        f.write_all_at(&[x[0] ^ 1], at).unwrap();
        for trans in [false, true] {
            let m = TiledFile::open(&p).unwrap();
            for e in [
                try_scatter(&m, trans, true).err(),
                try_scatter(&NoMap(&m), trans, true).err(),
            ] {
                assert!(
                    matches!(e, Some(crate::error::Error::Checksum { ti: 13, tj: 1, .. })),
                    "trans {trans}: {e:?}"
                );
            }
            assert!(try_scatter(&m, trans, false).is_ok(), "unchecked: no error");
        }
    }
}
