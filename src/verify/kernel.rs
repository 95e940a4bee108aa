//! The element types of the verify passes ([`Elem`], the double-double accumulator [`Dd`]) and
//! their per-element loops, below the passes that use them ([`super::pass`]).
//!
//! The loops: `verify` must run at memory bandwidth, so the loops are written for the compiler
//! to vectorise (independent lanes, no branches) and are compiled twice: for the baseline
//! x86-64 target the crate is built for (SSE2, two f64 lanes) and, picked at run time, for
//! AVX2 + FMA (four lanes, twice the registers). Every loop only
//! adds and multiplies, so both builds give the same sums up to the order of additions, which
//! the error model already allows for.
//!
//! The sign vectors x hold ±1 (or 0 for an excluded column), so `v·x` is exact and every sum
//! of such products is an ordinary f64 sum (or a double-double one, [`Dd`], for f64 data).

use zerocopy::{FromBytes, Immutable, IntoBytes};

use crate::backend::round_inputs;
use crate::dtype::DType;
use crate::plan::Precision;

/// `n` default (zero) values, written in parallel before anything reads them. `vec![0.0; n]`
/// takes untouched zero pages from the kernel, and the first `+=` into such a page (a read, then
/// a write) maps the shared zero page and then copies it, flushing that address from every
/// core's TLB the process runs on: on one 2-core VM those shootdowns were 10 % of a `verify`
/// (`perf`: `do_wp_page` → `ptep_clear_flush` under the scatter's row sums and the dense pass's
/// GEMM epilogue), and each one waits for every other thread of the pool. Pages written first
/// are allocated at once, with nothing to flush.
pub(crate) fn zeros<T: Default + Send>(n: usize) -> Vec<T> {
    use rayon::prelude::*;
    (0..n)
        .into_par_iter()
        .with_min_len(1 << 16)
        .map(|_| T::default())
        .collect()
}

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
    /// Add another double-double.
    #[inline]
    pub(crate) fn add_dd(&mut self, d: Dd) {
        self.add(d.hi);
        self.lo += d.lo;
    }
    pub(crate) fn value(self) -> f64 {
        self.hi + self.lo
    }
}

/// The element type a pass reads a file as: f64 for f64 files, f32 for the others (the reader
/// widens f16 and bf16). Bands stay in this type; values are widened to f64 in registers.
pub(crate) trait Elem:
    Copy + Default + Send + Sync + IntoBytes + FromBytes + Immutable + 'static
{
    const DTYPE: DType;
    fn wide(self) -> f64;
    /// Round to the GEMM's input format as the CPU backend does (f64 data is left as is).
    fn round(p: Precision, v: &mut [Self]);
}

impl Elem for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn wide(self) -> f64 {
        self as f64
    }
    fn round(p: Precision, v: &mut [f32]) {
        round_inputs(p, v)
    }
}

impl Elem for f64 {
    const DTYPE: DType = DType::F64;
    #[inline(always)]
    fn wide(self) -> f64 {
        self
    }
    fn round(_: Precision, _: &mut [f64]) {}
}

/// Independent accumulators per sum: enough to fill two AVX2 registers.
const LANES: usize = 8;

/// Σ y, Σ y² and Σ |y| for y = v·x.
#[inline(always)]
fn first_impl<T: Elem>(v: &[T], x: &[f64]) -> (f64, f64, f64) {
    let n = v.len().min(x.len()) / LANES * LANES;
    let (mut s, mut q, mut a) = ([0f64; LANES], [0f64; LANES], [0f64; LANES]);
    for (vv, xx) in v[..n].chunks_exact(LANES).zip(x[..n].chunks_exact(LANES)) {
        for l in 0..LANES {
            let y = vv[l].wide() * xx[l];
            s[l] += y;
            q[l] += y * y;
            a[l] += y.abs();
        }
    }
    for (vv, xx) in v[n..].iter().zip(&x[n..]) {
        let y = vv.wide() * xx;
        s[0] += y;
        q[0] += y * y;
        a[0] += y.abs();
    }
    (s.iter().sum(), q.iter().sum(), a.iter().sum())
}

/// Σ v·x.
#[inline(always)]
fn dot_impl<T: Elem>(v: &[T], x: &[f64]) -> f64 {
    let n = v.len().min(x.len()) / LANES * LANES;
    let mut s = [0f64; LANES];
    for (vv, xx) in v[..n].chunks_exact(LANES).zip(x[..n].chunks_exact(LANES)) {
        for l in 0..LANES {
            s[l] += vv[l].wide() * xx[l];
        }
    }
    for (vv, xx) in v[n..].iter().zip(&x[n..]) {
        s[0] += vv.wide() * xx;
    }
    s.iter().sum()
}

/// s += v·x, q += (v·x)², a += |v·x| elementwise (x one scalar).
#[inline(always)]
fn axpy_first_impl<T: Elem>(v: &[T], x: f64, s: &mut [f64], q: &mut [f64], a: &mut [f64]) {
    for (((vv, s), q), a) in v.iter().zip(s).zip(q).zip(a) {
        let y = vv.wide() * x;
        *s += y;
        *q += y * y;
        *a += y.abs();
    }
}

/// s += v·x elementwise.
#[inline(always)]
fn axpy_impl<T: Elem>(v: &[T], x: f64, s: &mut [f64]) {
    for (vv, s) in v.iter().zip(s) {
        *s += vv.wide() * x;
    }
}

/// Widen `v` into `dst`; true when every value is finite (NaN·0 and ±Inf·0 are NaN).
#[inline(always)]
fn widen_impl<T: Elem>(v: &[T], dst: &mut [f64]) -> bool {
    let mut z = [0f64; LANES];
    let n = v.len().min(dst.len()) / LANES * LANES;
    for (vv, dd) in v[..n]
        .chunks_exact(LANES)
        .zip(dst[..n].chunks_exact_mut(LANES))
    {
        for l in 0..LANES {
            dd[l] = vv[l].wide();
            z[l] += dd[l] * 0.0;
        }
    }
    for (vv, dd) in v[n..].iter().zip(&mut dst[n..]) {
        *dd = vv.wide();
        z[0] += *dd * 0.0;
    }
    z.iter().sum::<f64>() == 0.0
}

/// Run-time dispatch between the AVX2 + FMA build of a kernel and the baseline one.
macro_rules! dispatch {
    ($(#[$doc:meta])* $name:ident, $avx:ident, $imp:ident, ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        fn $avx<T: Elem>($($arg: $ty),*) -> $ret {
            $imp($($arg),*)
        }
        $(#[$doc])*
        #[inline]
        pub(crate) fn $name<T: Elem>($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                // SAFETY: the CPU was just checked to support AVX2 and FMA, the only target
                // features the function is compiled with; it is otherwise ordinary safe code.
                return unsafe { $avx($($arg),*) };
            }
            $imp($($arg),*)
        }
    };
}

dispatch!(
    /// Σ v·x, Σ (v·x)², Σ |v·x| over a row segment.
    first, first_avx2, first_impl, (v: &[T], x: &[f64]) -> (f64, f64, f64)
);
dispatch!(
    /// Σ v·x over a row segment.
    dot, dot_avx2, dot_impl, (v: &[T], x: &[f64]) -> f64
);
dispatch!(
    /// Fold one stored row, times the scalar sign x, into per-column sums (first round).
    axpy_first, axpy_first_avx2, axpy_first_impl,
    (v: &[T], x: f64, s: &mut [f64], q: &mut [f64], a: &mut [f64]) -> ()
);
dispatch!(
    /// Fold one stored row, times the scalar sign x, into per-column signed sums.
    axpy, axpy_avx2, axpy_impl, (v: &[T], x: f64, s: &mut [f64]) -> ()
);
dispatch!(
    /// Widen to f64; true when all values are finite.
    widen, widen_avx2, widen_impl, (v: &[T], dst: &mut [f64]) -> bool
);

/// `acc += a·z` over a row of double-doubles held as their high and low parts (`hi`/`lo` the
/// accumulators, `zhi`/`zlo` the row of z): [`Dd::add_scaled`] per column, the same operations
/// in the same order, so the same sums.
#[inline(always)]
fn dd_axpy_impl(a: f64, zhi: &[f64], zlo: &[f64], hi: &mut [f64], lo: &mut [f64]) {
    let n = hi.len().min(lo.len()).min(zhi.len()).min(zlo.len());
    let (zhi, zlo, hi, lo) = (&zhi[..n], &zlo[..n], &mut hi[..n], &mut lo[..n]);
    for c in 0..n {
        let (h, l, zh) = (hi[c], lo[c], zhi[c]);
        let p = a * zh;
        let e = a.mul_add(zh, -p);
        let s = h + p;
        let bb = s - h;
        let err = (h - (s - bb)) + (p - bb);
        hi[c] = s;
        lo[c] = ((l + err) + e) + a * zlo[c];
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dd_axpy_avx2(a: f64, zhi: &[f64], zlo: &[f64], hi: &mut [f64], lo: &mut [f64]) {
    dd_axpy_impl(a, zhi, zlo, hi, lo)
}

/// [`dd_axpy_impl`], built for AVX2 + FMA where the CPU has them: the baseline build's
/// `mul_add` is a call into libm's software fma (correctly rounded, so the same result), which
/// made `verify`'s dense pass over f64 data twice the product's time on two cores.
#[inline]
pub(crate) fn dd_axpy(a: f64, zhi: &[f64], zlo: &[f64], hi: &mut [f64], lo: &mut [f64]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU was just checked to support AVX2 and FMA, the only target features
        // the function is compiled with; it is otherwise ordinary safe code.
        return unsafe { dd_axpy_avx2(a, zhi, zlo, hi, lo) };
    }
    dd_axpy_impl(a, zhi, zlo, hi, lo)
}

/// (Σ a·b in double-double, Σ |a·b|): [`Dd::add_prod`] along the vectors, in order.
#[inline(always)]
fn dot_prod_dd_impl(a: &[f64], b: &[f64]) -> (Dd, f64) {
    let mut d = Dd::default();
    let mut abs = 0.0f64;
    for (x, y) in a.iter().zip(b) {
        d.add_prod(*x, *y);
        abs += (x * y).abs();
    }
    (d, abs)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dot_prod_dd_avx2(a: &[f64], b: &[f64]) -> (Dd, f64) {
    dot_prod_dd_impl(a, b)
}

/// [`dot_prod_dd_impl`] with a hardware fused multiply-add where the CPU has one (see
/// [`dd_axpy`]): the componentwise check's reference.
#[inline]
pub(crate) fn dot_prod_dd(a: &[f64], b: &[f64]) -> (Dd, f64) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU was just checked to support AVX2 and FMA, the only target features
        // the function is compiled with; it is otherwise ordinary safe code.
        return unsafe { dot_prod_dd_avx2(a, b) };
    }
    dot_prod_dd_impl(a, b)
}

/// Σ v·x in double-double (f64 data): x is ±1 or 0, so each product is exact.
pub(crate) fn dot_dd<T: Elem>(v: &[T], x: &[f64]) -> Dd {
    let mut d = Dd::default();
    for (vv, xx) in v.iter().zip(x) {
        d.add(vv.wide() * xx);
    }
    d
}

/// s += v·x elementwise in double-double.
pub(crate) fn axpy_dd<T: Elem>(v: &[T], x: f64, s: &mut [Dd]) {
    for (vv, s) in v.iter().zip(s) {
        s.add(vv.wide() * x);
    }
}
