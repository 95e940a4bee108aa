//! The streaming passes of `verify`: every matrix is read once in bands of stored rows, widened
//! to f64, and folded into small per-row accumulators, so memory stays O(n·groups) however big
//! the files are.
//!
//! Two kinds of pass exist. A *scatter* pass folds op(M) against random ±1 vectors that are cut
//! into column groups ([`Groups`]): for each op row t and group g it sums M·x, M² and |M| over the
//! group's columns (what the residual, the statistical tolerance and the rigorous bound need).
//! A *dense* pass multiplies op(A) by the K-row results of a scatter pass over op(B). Signed sums
//! are kept in double-double ([`Dd`]) so that the check is more precise than the product even
//! for f64 data; the tolerance sums need no such care. NaN/Inf elements are never multiplied:
//! they are recorded (rows, columns, cells) and left out of every sum.

use std::sync::Mutex;

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use rayon::prelude::*;

use crate::backend::round_inputs;
use crate::dtype::DType;
use crate::error::Result;
use crate::plan::Precision;
use crate::store::{Block, MatrixSource};

const BAND_BYTES: u64 = 32 << 20;

/// A double-double accumulator: `hi + lo` carries about 106 significant bits.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Dd {
    pub(crate) hi: f64,
    pub(crate) lo: f64,
}

impl Dd {
    /// Add `v` exactly (Knuth's TwoSum; the rounding error goes to `lo`).
    #[inline]
    pub(crate) fn add(&mut self, v: f64) {
        let s = self.hi + v;
        let bb = s - self.hi;
        let err = (self.hi - (s - bb)) + (v - bb);
        self.hi = s;
        self.lo += err;
    }
    /// Add the product `a·b` (TwoProd by fused multiply-add, then TwoSum).
    #[inline]
    pub(crate) fn add_prod(&mut self, a: f64, b: f64) {
        let p = a * b;
        let e = a.mul_add(b, -p);
        self.add(p);
        self.lo += e;
    }
    /// Add `s · d` for another double-double `d`.
    #[inline]
    pub(crate) fn add_scaled(&mut self, s: f64, d: Dd) {
        self.add_prod(s, d.hi);
        self.lo += s * d.lo;
    }
    pub(crate) fn value(self) -> f64 {
        self.hi + self.lo
    }
}

/// One operand as a pass sees it: op(M) of a stored file, optionally rounded to the GEMM's
/// input precision exactly as the CPU backend rounds it (so a value beyond fp16's range is
/// infinite here too).
#[derive(Clone, Copy)]
pub(crate) struct Op<'a> {
    pub(crate) file: &'a dyn MatrixSource,
    pub(crate) trans: bool,
    pub(crate) round: Option<Precision>,
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

impl Sums {
    fn new(rows: usize, cols: usize, rounds: usize, groups: usize) -> Sums {
        Sums {
            rounds,
            groups,
            signed: vec![Dd::default(); rows * rounds * groups],
            sq: vec![0.0; rows * groups],
            abs: vec![0.0; rows * groups],
            nonfinite: vec![0; rows * groups],
            bad_row: vec![false; rows],
            bad_col: vec![false; cols],
        }
    }
}

/// Stored rows `r0..r0 + h` of `f`, all columns, as f64 (rounded to `round`'s input format).
fn read_band(f: &dyn MatrixSource, r0: u64, h: u64, round: Option<Precision>) -> Result<Vec<f64>> {
    let b = Block {
        r0,
        c0: 0,
        rows: h,
        cols: f.shape().1,
    };
    if f.dtype() == DType::F64 {
        let mut buf = vec![0f64; b.elems()];
        f.read_block(&b, DType::F64, bytemuck_f64(&mut buf))?;
        return Ok(buf);
    }
    let mut buf = vec![0f32; b.elems()];
    f.read_block(&b, DType::F32, bytemuck_f32(&mut buf))?;
    if let Some(p) = round {
        round_inputs(p, &mut buf);
    }
    Ok(buf.par_iter().map(|&v| v as f64).collect())
}

fn bytemuck_f64(v: &mut [f64]) -> &mut [u8] {
    zerocopy::IntoBytes::as_mut_bytes(v)
}
fn bytemuck_f32(v: &mut [f32]) -> &mut [u8] {
    zerocopy::IntoBytes::as_mut_bytes(v)
}

/// Call `f(r0, h, band)` for consecutive bands of stored rows of `op`.
fn bands(op: &Op, mut f: impl FnMut(usize, usize, &[f64]) -> Result<()>) -> Result<()> {
    let (rows, cols) = op.file.shape();
    let band = (BAND_BYTES / (cols * 8)).clamp(1, rows);
    let mut r0 = 0;
    while r0 < rows {
        let h = band.min(rows - r0);
        let m = read_band(op.file, r0, h, op.round)?;
        f(r0 as usize, h as usize, &m)?;
        r0 += h;
    }
    Ok(())
}

/// The accumulators of one op row during a scatter pass.
struct RowSums<'a> {
    signed: &'a mut [Dd],
    sq: &'a mut [f64],
    abs: &'a mut [f64],
    nonfinite: &'a mut [u32],
    bad: bool,
}

impl RowSums<'_> {
    #[inline]
    fn visit(
        &mut self,
        s: usize,
        v: f64,
        x: &[Vec<f64>],
        groups: &Groups,
        bad_cols: &mut Vec<usize>,
    ) {
        let g = groups.of(s);
        let gs = self.sq.len();
        if !v.is_finite() {
            self.bad = true;
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
}

/// Fold op(M) (T × S) against the round vectors `x` (each of length S; 0 marks an excluded
/// column, whose NaN/Inf are expected and not counted) over column groups.
pub(crate) fn scatter(op: &Op, groups: &Groups, x: &[Vec<f64>]) -> Result<Sums> {
    timed("scatter", op, || scatter_inner(op, groups, x))
}

/// Run one pass, and with `MGMM_VERIFY_TIMES` set report its time and input rate on stderr.
fn timed<R>(what: &str, op: &Op, f: impl FnOnce() -> R) -> R {
    let t0 = std::time::Instant::now();
    let r = f();
    if std::env::var_os("MGMM_VERIFY_TIMES").is_some() {
        let (rows, cols) = op.file.shape();
        let bytes = (rows * cols) as f64 * op.file.dtype().size() as f64;
        let s = t0.elapsed().as_secs_f64();
        eprintln!(
            "verify: {what} {}{} {rows}×{cols} {}: {s:.3} s, {:.2} GB/s",
            op.file.path().display(),
            if op.trans { " (transposed)" } else { "" },
            op.file.dtype(),
            bytes / s / 1e9
        );
    }
    r
}

fn scatter_inner(op: &Op, groups: &Groups, x: &[Vec<f64>]) -> Result<Sums> {
    let (t_rows, s_cols) = op.shape();
    let (r, g) = (x.len(), groups.count());
    let mut out = Sums::new(t_rows, s_cols, r, g);
    let bad_cols = Mutex::new(Vec::new());
    let stored_cols = op.file.shape().1 as usize;
    bands(op, |r0, h, m| {
        // Op rows this band touches: all of them for op(M) = Mᵀ, the band's own otherwise.
        let (lo, hi) = if op.trans { (0, t_rows) } else { (r0, r0 + h) };
        let rows = out.signed[lo * r * g..hi * r * g]
            .par_chunks_mut(r * g)
            .zip(out.sq[lo * g..hi * g].par_chunks_mut(g))
            .zip(out.abs[lo * g..hi * g].par_chunks_mut(g))
            .zip(out.nonfinite[lo * g..hi * g].par_chunks_mut(g))
            .zip(out.bad_row[lo..hi].par_iter_mut())
            .enumerate();
        rows.for_each(|(tl, ((((signed, sq), abs), nonfinite), bad))| {
            let t = lo + tl;
            let mut acc = RowSums {
                signed,
                sq,
                abs,
                nonfinite,
                bad: *bad,
            };
            let mut bc = Vec::new();
            if op.trans {
                // op row t = stored column t; this band holds op columns r0..r0+h.
                for sl in 0..h {
                    acc.visit(r0 + sl, m[sl * stored_cols + t], x, groups, &mut bc);
                }
            } else {
                let row = &m[(t - r0) * stored_cols..(t - r0 + 1) * stored_cols];
                for (s, &v) in row.iter().enumerate() {
                    acc.visit(s, v, x, groups, &mut bc);
                }
            }
            *bad = acc.bad;
            if !bc.is_empty() {
                bad_cols.lock().unwrap().extend(bc);
            }
        });
        Ok(())
    })?;
    for s in bad_cols.into_inner().unwrap() {
        out.bad_col[s] = true;
    }
    Ok(out)
}

/// op(A)·Z for the sums `z` of a scatter pass over op(B) (K rows): signed sums in
/// double-double when `exact` (f64 data), in f64 through faer otherwise (f32 products are exact
/// in f64 and the f64 sums' own error is counted by the model); `sq` columns are multiplied by
/// op(A)∘op(A), `abs` by |op(A)|. Rows of op(A) holding NaN/Inf are marked in `bad_row`.
pub(crate) fn dense(op: &Op, z: &Sums, exact: bool) -> Result<Sums> {
    timed("dense", op, || dense_inner(op, z, exact))
}

fn dense_inner(op: &Op, z: &Sums, exact: bool) -> Result<Sums> {
    let (m_rows, k) = op.shape();
    let (r, g) = (z.rounds, z.groups);
    let rg = r * g;
    let mut out = Sums::new(m_rows, k, r, g);
    let zf: Vec<f64> = z.signed.iter().map(|d| d.value()).collect();
    let mut signed_f = if exact {
        Vec::new()
    } else {
        vec![0f64; m_rows * rg]
    };
    let stored_cols = op.file.shape().1 as usize;
    let par = Par::rayon(rayon::current_num_threads().max(1));
    bands(op, |r0, h, m| {
        let mut clean = m.to_vec();
        let mut bad_rows = Vec::new();
        for (e, v) in clean.iter_mut().enumerate() {
            if !v.is_finite() {
                *v = 0.0;
                let (sr, sc) = (e / stored_cols, e % stored_cols);
                bad_rows.push(if op.trans { sc } else { r0 + sr });
            }
        }
        for i in bad_rows {
            out.bad_row[i] = true;
        }
        let sq: Vec<f64> = clean.par_iter().map(|v| v * v).collect();
        let ab: Vec<f64> = clean.par_iter().map(|v| v.abs()).collect();
        fn zr(v: &[f64], k: usize, w: usize) -> MatRef<'_, f64> {
            MatRef::from_row_major_slice(v, k, w)
        }
        let mul = |lhs: &[f64], rhs: MatRef<f64>, dst: &mut [f64], w: usize| {
            let (dst, lhs, rhs) = if op.trans {
                (
                    MatMut::from_row_major_slice_mut(dst, m_rows, w),
                    MatRef::from_row_major_slice(lhs, h, m_rows).transpose(),
                    rhs.subrows(r0, h),
                )
            } else {
                (
                    MatMut::from_row_major_slice_mut(&mut dst[r0 * w..(r0 + h) * w], h, w),
                    MatRef::from_row_major_slice(lhs, h, k),
                    rhs,
                )
            };
            matmul(dst, Accum::Add, lhs, rhs, 1.0, par);
        };
        mul(&sq, zr(&z.sq, k, g), &mut out.sq, g);
        mul(&ab, zr(&z.abs, k, g), &mut out.abs, g);
        if exact {
            dense_dd(op, &clean, r0, h, &z.signed, rg, &mut out.signed);
        } else {
            mul(&clean, zr(&zf, k, rg), &mut signed_f, rg);
        }
        Ok(())
    })?;
    if !exact {
        out.signed = signed_f.into_iter().map(|hi| Dd { hi, lo: 0.0 }).collect();
    }
    Ok(out)
}

/// The double-double part of [`dense`]: `out[i] += Σ_k op(A)[i][k] · z[k]` over this band.
fn dense_dd(op: &Op, band: &[f64], r0: usize, h: usize, z: &[Dd], rg: usize, out: &mut [Dd]) {
    let (_, k) = op.shape();
    let stored_cols = op.file.shape().1 as usize;
    if op.trans {
        // Band rows are k indices r0..r0+h; op rows i are stored columns.
        out.par_chunks_mut(rg).enumerate().for_each(|(i, o)| {
            for kl in 0..h {
                let a = band[kl * stored_cols + i];
                if a != 0.0 {
                    let zk = &z[(r0 + kl) * rg..(r0 + kl + 1) * rg];
                    o.iter_mut()
                        .zip(zk)
                        .for_each(|(o, &zv)| o.add_scaled(a, zv));
                }
            }
        });
    } else {
        out[r0 * rg..(r0 + h) * rg]
            .par_chunks_mut(rg)
            .enumerate()
            .for_each(|(il, o)| {
                for (kk, &a) in band[il * k..(il + 1) * k].iter().enumerate() {
                    if a != 0.0 {
                        let zk = &z[kk * rg..(kk + 1) * rg];
                        o.iter_mut()
                            .zip(zk)
                            .for_each(|(o, &zv)| o.add_scaled(a, zv));
                    }
                }
            });
    }
}
