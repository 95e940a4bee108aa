//! The componentwise check of `fp64_emulated` outputs: sampled elements of C compared, each on
//! its own, with native DGEMM's bound `|c − α·op(A)·op(B) − β·C0| ≤ (K+2)·u·(|α|·|op(A)|·|op(B)|
//! + |β|·|C0|)` (u = 2⁻⁵³), against a double-double reference.
//!
//! Freivalds' test (the rest of this module) sums residuals over groups of columns, so its
//! threshold is a group's: a few elements of an emulated product that miss their own bound —
//! the known failure of Ozaki schemes, a row of A or a column of B whose exponents span more
//! than the moduli cover — can hide inside it. This check looks at elements one by one. It
//! reads the sampled rows of op(A) and columns of op(B) (a stored row is one read; a stored
//! column needs a pass over the file's rows), so it costs one more pass over op(B) stored
//! row-major; the sample is spread over every storage tile row and column band of the output,
//! and a small output is compared whole.

use std::collections::BTreeSet;

use rayon::prelude::*;
use serde::Serialize;
use zerocopy::IntoBytes;

use super::kernel::Dd;
use crate::dtype::DType;
use crate::error::Result;
use crate::plan::Step;
use crate::store::gen::Rng;
use crate::store::{Block, MatrixSource};

/// Multiply-adds of the reference (|sampled elements|·K) at most: about a second on two cores.
const WORK: u64 = 1 << 28;
/// Sampled elements at most.
const ELEMENTS: u64 = 1 << 20;
/// Stored bytes per band when a pass over a file's rows gathers columns.
const BAND_BYTES: u64 = 32 << 20;

/// What the componentwise check found (`verify`'s report, key `componentwise`).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Componentwise {
    /// Elements compared with their bound.
    pub elements: u64,
    /// Whether every element of the output was compared (a small output), not a sample.
    pub all: bool,
    /// Sampled elements left out: a NaN/Inf in their row of op(A) or column of op(B) (or in
    /// C0), or a reference beyond f64's range — IEEE rules decide those, as for DGEMM.
    pub skipped: u64,
    /// Elements whose error exceeds the bound.
    pub failing: u64,
    /// Largest error / bound among the elements compared.
    pub worst_ratio: f64,
    /// The element of that ratio (row, column).
    pub worst: (u64, u64),
    /// Output storage tiles (tile row, tile column) holding a failing element.
    pub failing_tiles: Vec<(u64, u64)>,
    /// The forced `engine.emulation_moduli`, when one was (failures are then expected where
    /// the run counted `bound_unmet`, not a bug).
    pub forced_moduli: Option<u32>,
}

/// Indices in `0..len`: every one when `want >= len`, else `want` strata of equal width with one
/// random index each, so each band of `band` indices holds some when `want >= 2·len/band`.
fn spread(len: u64, want: u64, rng: &mut Rng) -> Vec<usize> {
    if want >= len {
        return (0..len as usize).collect();
    }
    (0..want)
        .map(|s| {
            let (lo, hi) = (
                s * len / want,
                ((s + 1) * len / want).max(s * len / want + 1),
            );
            (lo + rng.next_u64() % (hi - lo)) as usize
        })
        .collect()
}

/// Elements of op(A) rows (and of op(B) columns) held at once: 128 MiB of f64 each.
const LINES: u64 = 1 << 24;

/// The sampled rows and columns of an m×n output with storage tiles `tile`, for depth `k`:
/// every one of a small output, else two per tile band on both sides where the budget has
/// room for that (growing both sides alike beyond it), else as many as it has, shared
/// between the sides in proportion to their bands. At most [`LINES`]/k of each side, so the
/// gathered rows and columns stay within memory.
fn sample(m: u64, n: u64, k: u64, tile: (u64, u64), seed: u64) -> (Vec<usize>, Vec<usize>) {
    let mut rng = Rng::new(seed, 0xC0_4D_0E_1E);
    let budget = (WORK / k.max(1)).clamp(1, ELEMENTS);
    let cap = (LINES / k.max(1)).max(1);
    if m.saturating_mul(n) <= budget && m <= cap && n <= cap {
        return ((0..m as usize).collect(), (0..n as usize).collect());
    }
    let bands = (
        (m.div_ceil(tile.0.max(1)) * 2).min(m),
        (n.div_ceil(tile.1.max(1)) * 2).min(n),
    );
    let (r, c) = if bands.0.saturating_mul(bands.1) <= budget {
        let grow = (budget as f64 / (bands.0 * bands.1) as f64).sqrt();
        let r = ((bands.0 as f64 * grow) as u64).clamp(bands.0, m);
        (r, (budget / r).clamp(bands.1.min(n), n))
    } else {
        let r = ((budget as f64 * bands.0 as f64 / bands.1 as f64).sqrt() as u64).clamp(1, bands.0);
        (r, (budget / r).clamp(1, bands.1))
    };
    (
        spread(m, r.min(cap), &mut rng),
        spread(n, c.min(cap), &mut rng),
    )
}

/// Lines of `f` as f64: stored rows `lines` when `rows`, else stored columns `lines` (one pass
/// over the stored rows). Returns `lines.len()` vectors of the other dimension, back to back.
fn gather(f: &dyn MatrixSource, lines: &[usize], rows: bool) -> Result<Vec<f64>> {
    let (sr, sc) = f.shape();
    if rows {
        let mut out = vec![0f64; lines.len() * sc as usize];
        out.par_chunks_mut(sc as usize)
            .zip(lines)
            .try_for_each(|(dst, &r)| {
                let b = Block {
                    r0: r as u64,
                    c0: 0,
                    rows: 1,
                    cols: sc,
                };
                f.read_block(&b, DType::F64, dst.as_mut_bytes())
            })?;
        return Ok(out);
    }
    let len = sr as usize;
    let mut out = vec![0f64; lines.len() * len];
    let h = (BAND_BYTES / (sc * 8).max(1)).clamp(1, sr);
    let mut band = Vec::new();
    let mut r0 = 0;
    while r0 < sr {
        let rows = h.min(sr - r0);
        band.resize((rows * sc) as usize, 0f64);
        let sub = rows
            .div_ceil(rayon::current_num_threads() as u64 * 2)
            .max(1);
        band.par_chunks_mut((sub * sc) as usize)
            .enumerate()
            .try_for_each(|(i, part)| {
                let b = Block {
                    r0: r0 + i as u64 * sub,
                    c0: 0,
                    rows: part.len() as u64 / sc,
                    cols: sc,
                };
                f.read_block(&b, DType::F64, part.as_mut_bytes())
            })?;
        for (l, &c) in lines.iter().enumerate() {
            let dst = &mut out[l * len..(l + 1) * len];
            for s in 0..rows as usize {
                dst[r0 as usize + s] = band[s * sc as usize + c];
            }
        }
        r0 += rows;
    }
    Ok(out)
}

/// Rows `rows` of op(M) (M stored transposed when `trans`): `rows.len()` vectors of its columns.
fn op_rows(f: &dyn MatrixSource, trans: bool, rows: &[usize]) -> Result<Vec<f64>> {
    gather(f, rows, !trans)
}

/// The componentwise check of `out` against `step`'s operands (`a`, `b`, and `c0` when β ≠ 0,
/// opened by the caller), with the output's storage tile `tile`.
pub(crate) fn check(
    step: &Step,
    (a, b, c0): (
        &dyn MatrixSource,
        &dyn MatrixSource,
        Option<&dyn MatrixSource>,
    ),
    out: &dyn MatrixSource,
    tile: (u64, u64),
    seed: u64,
) -> Result<Componentwise> {
    let (m, n, k) = (step.m, step.n, step.k as usize);
    let (rows, cols) = sample(m, n, k as u64, tile, seed);
    let all = rows.len() as u64 == m && cols.len() as u64 == n;
    let ar = op_rows(a, step.a.trans, &rows)?;
    // Columns of op(B) are rows of op(B)ᵀ.
    let bc = op_rows(b, !step.b.trans, &cols)?;
    // A row of C (and of C0) is read by the task that checks it: only one per thread is held.
    let c0 = c0.filter(|_| step.beta != 0.0);
    let row_of = |f: &dyn MatrixSource, r: usize| -> Result<Vec<f64>> {
        let mut v = vec![0f64; n as usize];
        let b = Block {
            r0: r as u64,
            c0: 0,
            rows: 1,
            cols: n,
        };
        f.read_block(&b, DType::F64, v.as_mut_bytes())?;
        Ok(v)
    };
    let finite = |v: &[f64]| v.iter().all(|x| x.is_finite());
    let bad_b: Vec<bool> = bc.chunks(k.max(1)).map(|v| !finite(v)).collect();
    let u = f64::EPSILON / 2.0;
    let eta = f64::from_bits(1); // the smallest subnormal: underflow's absolute part
    let grow = (k as f64 + 2.0) * u;
    let (alpha, beta) = (step.alpha, step.beta);
    struct Row {
        elements: u64,
        skipped: u64,
        failing: Vec<usize>,
        worst: (f64, usize),
    }
    let per_row: Vec<Row> = rows
        .par_iter()
        .enumerate()
        .map(|(ri, &r)| -> Result<Row> {
            let crow = row_of(out, r)?;
            let c0row = c0.map(|f| row_of(f, r)).transpose()?;
            let a = &ar[ri * k..(ri + 1) * k];
            let mut row = Row {
                elements: 0,
                skipped: 0,
                failing: Vec::new(),
                worst: (0.0, 0),
            };
            let bad_a = !finite(a);
            for (ci, &c) in cols.iter().enumerate() {
                let c0 = c0row.as_ref().map_or(0.0, |v| v[c]);
                if bad_a || bad_b[ci] || !c0.is_finite() {
                    row.skipped += 1;
                    continue;
                }
                let bcol = &bc[ci * k..(ci + 1) * k];
                let (d, abs) = super::kernel::dot_prod_dd(a, bcol);
                let mut r = Dd::default();
                r.add_scaled(alpha, d);
                if beta != 0.0 {
                    r.add_prod(beta, c0);
                }
                let want = r.value();
                if !want.is_finite() || !abs.is_finite() {
                    row.skipped += 1;
                    continue;
                }
                let got = crow[c];
                let bound =
                    grow * (alpha.abs() * abs + beta.abs() * c0.abs()) + (k as f64 + 2.0) * eta;
                let err = (got - want).abs();
                let ratio = if err.is_nan() {
                    f64::INFINITY
                } else {
                    err / bound
                };
                row.elements += 1;
                if ratio > 1.0 {
                    row.failing.push(ci);
                }
                if ratio > row.worst.0 {
                    row.worst = (ratio, ci);
                }
            }
            Ok(row)
        })
        .collect::<Result<_>>()?;
    let mut rep = Componentwise {
        elements: 0,
        all,
        skipped: 0,
        failing: 0,
        worst_ratio: 0.0,
        worst: (0, 0),
        failing_tiles: Vec::new(),
        forced_moduli: None,
    };
    let mut tiles = BTreeSet::new();
    for (ri, r) in per_row.iter().enumerate() {
        rep.elements += r.elements;
        rep.skipped += r.skipped;
        rep.failing += r.failing.len() as u64;
        if r.worst.0 > rep.worst_ratio {
            rep.worst_ratio = r.worst.0;
            rep.worst = (rows[ri] as u64, cols[r.worst.1] as u64);
        }
        for &ci in &r.failing {
            tiles.insert((
                rows[ri] as u64 / tile.0.max(1),
                cols[ci] as u64 / tile.1.max(1),
            ));
        }
    }
    rep.failing_tiles = tiles.into_iter().collect();
    Ok(rep)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_output_is_compared_whole_and_a_large_one_sampled_in_every_band() {
        let (r, c) = sample(300, 200, 100, (64, 64), 1);
        assert_eq!((r.len(), c.len()), (300, 200));
        let bands = |v: &[usize], t: u64, len: u64| {
            let hit: BTreeSet<u64> = v.iter().map(|&i| i as u64 / t).collect();
            hit.len() as u64 == len.div_ceil(t)
        };
        // Square, wide, tall and deep outputs: every tile row and column band is sampled
        // whenever two per band fit the budget, and the lines gathered stay bounded.
        for (m, n, k, t) in [
            (100_000u64, 80_000u64, 100_000u64, 4096u64),
            (131_072, 131_072, 131_072, 2048),
            (1 << 22, 1024, 1 << 14, 1024),
            (1 << 20, 1 << 20, 64, 4096),
        ] {
            let (r, c) = sample(m, n, k, (t, t), 7);
            let cap = LINES / k;
            let fits = 4 * m.div_ceil(t) * n.div_ceil(t) <= (WORK / k).min(ELEMENTS)
                && 2 * m.div_ceil(t).max(n.div_ceil(t)) <= cap;
            assert!((r.len() * c.len()) as u64 <= (WORK / k).min(ELEMENTS) + r.len() as u64);
            assert!(r.len() as u64 * k <= LINES.max(k) && c.len() as u64 * k <= LINES.max(k));
            if fits {
                assert!(bands(&r, t, m), "{m}×{n}: every tile row band sampled");
                assert!(bands(&c, t, n), "{m}×{n}: every tile column band sampled");
            }
            assert!(r.windows(2).all(|w| w[0] < w[1]) && c.windows(2).all(|w| w[0] < w[1]));
        }
    }
}
