//! What residual a *correct* product may have: the statistical tolerance `verify` flags
//! against, and the rigorous worst-case bound that alone may say "certainly wrong".
//!
//! `verify` tests `r = Σ_{j∈g} (C_ij − C*_ij)·x_j` for each output row i, column group g and
//! random sign vector x (x_j = ±1), where C* is the exact `α·op(A)·op(B) + β·C0`. Given the
//! product's rounding errors e_ij = C_ij − C*_ij, r is a Rademacher sum, so by Hoeffding
//! `P(|r| > T·σ) ≤ 2·exp(−T²/2)` whenever `σ² ≥ Σ_j e_ij²` — no assumption that errors of
//! different elements are independent. The model below supplies σ² per (row, group):
//!
//! * accumulation (unit roundoff u_a, K terms, recursive order, the worst usual order): the
//!   error of a dot product is Σ_t δ_t·s_t over its partial sums s_t with independent δ_t of
//!   variance u_a²/3. For products p_k with mean μ (K·μ ≈ C_ij) and spread, Σ_t s_t² ≈
//!   K·(C_ij²/3 + P_ij/2) with P_ij = Σ_k p_k² = α²·Σ_k a_ik²·b_kj², so
//!   `var ≈ (u_a²/3)·(K·(C_ij²/3 + P_ij/2) + P_ij)` (the last term: rounding each product);
//! * inputs rounded to the GEMM's format (u_i; tf32/bf16/fp16 from wider data, 0 otherwise):
//!   `(2/3)·u_i²·P_ij` for round-to-nearest, plus `4·u_i²·C_ij²` for a conversion that
//!   truncates (a bias of up to 2·u_i; TF32 on some GPUs);
//! * β·C0 added in the accumulator and C rounded to its file type: `(u_a²/3)·(β·C0_ij)²`,
//!   `(u_o²/3)·C_ij²`.
//!
//! Summed over the group's columns, every term is an O(n²) quantity: Σ_j C_ij² and Σ_j C0_ij²
//! from the output and C0, Σ_j P_ij = α²·Σ_k a_ik²·(Σ_{j∈g} b_kj²) by one product of op(A)∘op(A)
//! with op(B)'s squared group sums. A residual above `T·σ` (T = 8: 2·e⁻³² ≈ 3·10⁻¹⁴ per test)
//! fails. Because rounding may follow another order than recursive summation (blocked sums
//! are far more accurate), σ overestimates the real spread; measured ratios are in
//! docs/RESILIENCE.md.
//!
//! The rigorous bound: |e_ij| ≤ γ·|α|·(|A||B|)_ij + 2u_a·|β·C0_ij| + u_o·|C_ij| with
//! γ = (K+1)·u_a/(1−(K+1)·u_a) + 4·u_i, whatever the data and order, so a residual above its
//! group sum is certainly an error. The flag threshold is the smaller of the two (for tiny K the
//! bound is the tighter), plus the check's own rounding.

use crate::dtype::DType;
use crate::plan::Precision;

/// Standard deviations a residual may reach before it is flagged.
pub(crate) const SIGMAS: f64 = 8.0;

#[derive(Clone, Copy, Debug)]
pub(crate) struct Model {
    /// Accumulation unit roundoff.
    pub(crate) u_acc: f64,
    /// Input rounding unit roundoff (0 when the data are already in the GEMM's input format).
    pub(crate) u_in: f64,
    /// Output file type unit roundoff.
    pub(crate) u_out: f64,
    pub(crate) k: f64,
    /// Relative error of the check's own sums (f64, or double-double for f64 data).
    pub(crate) u_own: f64,
}

/// Terms of one (row, group) cell, each already summed over the group's columns.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Cell {
    /// α²·Σ_j Σ_k a_ik²·b_kj².
    pub(crate) p: f64,
    /// Σ_j C_ij² (of the output as stored).
    pub(crate) c2: f64,
    /// β²·Σ_j C0_ij².
    pub(crate) c0sq: f64,
    /// |α|·Σ_j (|A||B|)_ij.
    pub(crate) ab: f64,
    /// |β|·Σ_j |C0_ij|.
    pub(crate) c0abs: f64,
    /// Σ_j |C_ij|.
    pub(crate) cabs: f64,
}

impl Model {
    pub(crate) fn new(
        precision: Precision,
        data: DType,
        out: DType,
        k: u64,
        exact_check: bool,
    ) -> Model {
        let u_in = match (precision, data) {
            (Precision::Fp32 | Precision::Fp64 | Precision::Fp64Emulated(_), _) => 0.0,
            (Precision::Tf32, DType::F16 | DType::BF16) => 0.0,
            (Precision::Bf16, DType::BF16) | (Precision::Fp16, DType::F16) => 0.0,
            (p, _) => p.input_eps(),
        };
        let u_out = if out == DType::F64 {
            f64::EPSILON / 2.0
        } else {
            f32::EPSILON as f64 / 2.0
        };
        Model {
            u_acc: precision.acc_eps(),
            u_in,
            u_out,
            k: k as f64,
            u_own: if exact_check {
                2f64.powi(-100)
            } else {
                f64::EPSILON
            },
        }
    }

    /// Variance bound σ² of a correct product's residual for this cell (x_j = ±1).
    pub(crate) fn sigma2(&self, c: &Cell) -> f64 {
        let (ua, ui, uo) = (self.u_acc, self.u_in, self.u_out);
        ua * ua / 3.0 * (self.k * (c.c2 / 3.0 + c.p / 2.0) + c.p + c.c0sq)
            + ui * ui * (2.0 / 3.0 * c.p + 4.0 * c.c2)
            + uo * uo / 3.0 * c.c2
    }

    /// Rigorous bound on |residual| of a correct product (∞ when K·u ≥ 1/2: it says nothing).
    pub(crate) fn bound(&self, c: &Cell) -> f64 {
        let ku = (self.k + 1.0) * self.u_acc;
        if ku >= 0.5 {
            return f64::INFINITY;
        }
        let gamma = ku / (1.0 - ku) + 4.0 * self.u_in * (1.0 + self.u_in);
        gamma * c.ab + 2.0 * self.u_acc * c.c0abs + self.u_out * c.cabs
    }

    /// Worst-case error of the check's own sums (added to the threshold).
    pub(crate) fn own(&self, c: &Cell, n: usize) -> f64 {
        self.u_own * (self.k + n as f64 + 4.0) * (c.ab + c.c0abs + c.cabs)
    }

    /// The threshold a residual of this cell may not exceed, and σ.
    pub(crate) fn threshold(&self, c: &Cell, n: usize) -> (f64, f64) {
        let sigma = self.sigma2(c).sqrt();
        ((SIGMAS * sigma).min(self.bound(c)) + self.own(c, n), sigma)
    }
}
