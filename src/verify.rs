//! `verify`: Freivalds' check of a finished product, streaming, O(n²) instead of O(n³).
//!
//! For random vectors X (n × r) it compares `Y = C·X` with `W = α·op(A)·(op(B)·X) + β·C0·X`,
//! reading every file once in row bands, in f64. The tolerance per row i is
//!
//! ```text
//!   tol_i = T · (K + 2) · u · s_i,   s_i ≈ ‖(|α|·|op(A)|·|op(B)| + |β|·|C0|)_i,·‖₂
//! ```
//!
//! where u = 2·u_in + u_acc is the precision's unit roundoff (inputs as the GEMM sees them, plus
//! accumulation), (K + 2)·u·(|A||B|)_ij bounds each element's rounding error, and s_i — the norm
//! of row i of |A||B| — is estimated with Gaussian probes G through the same streaming passes
//! (E[(|A||B|g)_i²] = s_i²). Each (C·x)_i has a rounding error with standard deviation at most
//! (K + 2)·u·s_i, so T = 6 makes a false alarm vanishingly rare while a single corrupted element
//! of C shifts (C·x)_i by δ·x_j and is found once |δ·x_j| exceeds tol_i.

use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::plan::{Operand, Precision, Step};
use crate::store::gen::Rng;
use crate::store::{Block, TiledFile};

const T: f64 = 6.0;
const PROBES: usize = 8;
const BAND_BYTES: u64 = 32 << 20;

#[derive(Clone, Debug, Serialize)]
pub struct VerifyReport {
    pub step: usize,
    pub output: String,
    pub rounds: usize,
    pub pass: bool,
    /// Largest |residual| / tolerance over all rows and rounds.
    pub max_ratio: f64,
    pub worst_row: u64,
    pub residual: f64,
    pub allowed: f64,
    pub failing_rows: Vec<u64>,
    pub seconds: f64,
}

/// `out (op_rows × w) += f(op(M)) · x (op_cols × w)`, streaming M by row bands; `f` is the
/// identity or `abs` per column group: columns `0..split` use M, `split..w` use |M|.
fn op_mul(
    f: &TiledFile,
    trans: bool,
    x: &[f64],
    w: usize,
    split: usize,
    scale: (f64, f64),
) -> Result<Vec<f64>> {
    let (rows, cols) = (f.rows(), f.cols());
    let op_rows = if trans { cols } else { rows } as usize;
    let mut out = vec![0f64; op_rows * w];
    let band = (BAND_BYTES / (cols * 8)).clamp(1, rows);
    let mut buf = Vec::new();
    let mut r0 = 0;
    while r0 < rows {
        let h = band.min(rows - r0);
        buf.resize((h * cols) as usize * 8, 0u8);
        f.read_block(
            &Block {
                r0,
                c0: 0,
                rows: h,
                cols,
            },
            DType::F64,
            &mut buf,
        )?;
        let m: Vec<f64> = buf
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let cols = cols as usize;
        let apply = |o: &mut [f64], v: f64, xr: &[f64]| {
            for c in 0..w {
                let (mv, s) = if c < split {
                    (v, scale.0)
                } else {
                    (v.abs(), scale.1)
                };
                o[c] += s * mv * xr[c];
            }
        };
        if !trans {
            // out[i] += Σ_j m[i][j] · x[j]
            out[(r0 as usize) * w..(r0 + h) as usize * w]
                .par_chunks_mut(w)
                .enumerate()
                .for_each(|(i, o)| {
                    for j in 0..cols {
                        apply(o, m[i * cols + j], &x[j * w..j * w + w]);
                    }
                });
        } else {
            // out[j] += Σ_i m[i][j] · x[r0 + i]   (op(M) = Mᵀ)
            out.par_chunks_mut(w).enumerate().for_each(|(j, o)| {
                for i in 0..h as usize {
                    let xi = (r0 as usize + i) * w;
                    apply(o, m[i * cols + j], &x[xi..xi + w]);
                }
            });
        }
        r0 += h;
    }
    Ok(out)
}

fn open(op: &Operand) -> Result<TiledFile> {
    TiledFile::open(&op.path)
}

pub fn verify_step(
    step: &Step,
    precision: Precision,
    rounds: usize,
    seed: u64,
) -> Result<VerifyReport> {
    let t0 = Instant::now();
    let (m, n, k) = (step.m as usize, step.n as usize, step.k as usize);
    let out = TiledFile::open(&step.output)?;
    if (out.rows(), out.cols()) != (step.m, step.n) {
        return Err(Error::format(
            &step.output,
            format!(
                "is {}×{} but step {} produces {}×{}",
                out.rows(),
                out.cols(),
                step.index + 1,
                m,
                n
            ),
        ));
    }
    let r = rounds.max(1);
    let w = r + PROBES;
    // Columns 0..r: random test vectors x; r..w: Gaussian probes g for the scale estimate.
    let mut x = vec![0f64; n * w];
    let mut g = Rng::new(seed, 0x5EED);
    g.normals(&mut x);
    // Y = C·X (signed columns only matter; probes ride along unused).
    let y = op_mul(&out, false, &x, w, w, (1.0, 1.0))?;
    // Z = op(B)·X, Zg = |op(B)|·G.
    let z = op_mul(&open(&step.b)?, step.b.trans, &x, w, r, (1.0, 1.0))?;
    // W = α·op(A)·Z, Wg = |α|·|op(A)|·Zg.
    let mut wv = op_mul(
        &open(&step.a)?,
        step.a.trans,
        &z,
        w,
        r,
        (step.alpha, step.alpha.abs()),
    )?;
    if let Some(c0) = &step.c0 {
        let c = op_mul(&open(c0)?, false, &x, w, r, (step.beta, step.beta.abs()))?;
        wv.iter_mut().zip(&c).for_each(|(a, b)| *a += b);
    }
    let u = 2.0 * precision.input_eps() + precision.acc_eps();
    let factor = T * (k as f64 + 2.0) * u;
    let mut rep = VerifyReport {
        step: step.index + 1,
        output: step.output.display().to_string(),
        rounds: r,
        pass: true,
        max_ratio: 0.0,
        worst_row: 0,
        residual: 0.0,
        allowed: 0.0,
        failing_rows: Vec::new(),
        seconds: 0.0,
    };
    for i in 0..m {
        let row = &wv[i * w..i * w + w];
        let s = (row[r..].iter().map(|v| v * v).sum::<f64>() / PROBES as f64).sqrt();
        let tol = factor * s + f64::MIN_POSITIVE;
        let mut bad = false;
        for c in 0..r {
            let res = (y[i * w + c] - row[c]).abs();
            let ratio = if res.is_nan() {
                f64::INFINITY
            } else {
                res / tol
            };
            if ratio > rep.max_ratio {
                rep.max_ratio = ratio;
                rep.worst_row = i as u64;
                rep.residual = res;
                rep.allowed = tol;
            }
            bad |= ratio.is_nan() || ratio > 1.0;
        }
        if bad {
            rep.pass = false;
            if rep.failing_rows.len() < 16 {
                rep.failing_rows.push(i as u64);
            }
        }
    }
    rep.seconds = t0.elapsed().as_secs_f64();
    Ok(rep)
}

pub fn format(rep: &VerifyReport) -> String {
    format!(
        "verify step {} ({}): {} — {} round(s): max residual/allowed = {:.3e} at row {} (residual {:.3e}, allowed {:.3e}){}; {:.2} s",
        rep.step,
        rep.output,
        if rep.pass { "PASS" } else { "FAIL" },
        rep.rounds,
        rep.max_ratio,
        rep.worst_row,
        rep.residual,
        rep.allowed,
        if rep.pass { String::new() } else { format!("; rows failing: {:?}", rep.failing_rows) },
        rep.seconds
    )
}
