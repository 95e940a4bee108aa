//! Element types of matrix files and of computation.
//!
//! Files may hold f32, f64, f16 or bf16 (the header's dtype code). Computation on the host side
//! happens in f32 or f64 ("compute type"); 16-bit files are widened while staging. This module
//! is the one place that knows element sizes and the conversions between them.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
/// Element type of a stored matrix.
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary64.
    F64,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    BF16,
}

impl DType {
    pub(crate) fn code(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F64 => 1,
            DType::F16 => 2,
            DType::BF16 => 3,
        }
    }
    pub(crate) fn from_code(code: u32) -> Option<Self> {
        Some(match code {
            0 => DType::F32,
            1 => DType::F64,
            2 => DType::F16,
            3 => DType::BF16,
            _ => return None,
        })
    }
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
            DType::F16 | DType::BF16 => 2,
        }
    }
    /// The name plans and the command line use (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }
    /// Parse a name as [`DType::name`] writes it; `None` when unknown.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "f32" | "float32" => DType::F32,
            "f64" | "float64" => DType::F64,
            "f16" | "float16" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            _ => return None,
        })
    }
    /// The host compute type used for files of this dtype.
    pub fn compute(self) -> DType {
        match self {
            DType::F64 => DType::F64,
            _ => DType::F32,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Convert `src` (elements of `from`, raw little-endian bytes) into `dst` (elements of `to`).
/// Supported: identity for every dtype, and f16/bf16/f32 → f32, f32 → f64... only the pairs the
/// engine needs: same type, or 16-bit → f32. Returns false for an unsupported pair.
pub fn convert(from: DType, src: &[u8], to: DType, dst: &mut [u8]) -> bool {
    debug_assert_eq!(src.len() / from.size(), dst.len() / to.size());
    if from == to {
        dst.copy_from_slice(src);
        return true;
    }
    match (from, to) {
        (DType::F16, DType::F32) => {
            widen::<f16>(src, dst);
            true
        }
        (DType::BF16, DType::F32) => {
            widen::<bf16>(src, dst);
            true
        }
        (DType::F32, DType::F64) => {
            for (s, d) in src.chunks_exact(4).zip(dst.chunks_exact_mut(8)) {
                let v = f32::from_le_bytes([s[0], s[1], s[2], s[3]]) as f64;
                d.copy_from_slice(&v.to_le_bytes());
            }
            true
        }
        (DType::F64, DType::F32) => {
            for (s, d) in src.chunks_exact(8).zip(dst.chunks_exact_mut(4)) {
                let v = f64::from_le_bytes(s.try_into().unwrap()) as f32;
                d.copy_from_slice(&v.to_le_bytes());
            }
            true
        }
        (DType::F32, DType::F16) => {
            narrow::<f16>(src, dst);
            true
        }
        (DType::F32, DType::BF16) => {
            narrow::<bf16>(src, dst);
            true
        }
        _ => false,
    }
}

/// A 16-bit float type with `half`'s slice conversions (F16C instructions for f16 where the
/// CPU has them).
trait Half16: Copy + zerocopy::FromBytes + zerocopy::IntoBytes + zerocopy::Immutable {
    fn from_le(b: [u8; 2]) -> Self;
    fn to_le(self) -> [u8; 2];
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    fn widen_slice(src: &[Self], dst: &mut [f32]);
    fn narrow_slice(src: &[f32], dst: &mut [Self]);
}

macro_rules! half16 {
    ($t:ty) => {
        impl Half16 for $t {
            fn from_le(b: [u8; 2]) -> Self {
                <$t>::from_le_bytes(b)
            }
            fn to_le(self) -> [u8; 2] {
                self.to_le_bytes()
            }
            fn to_f32(self) -> f32 {
                <$t>::to_f32(self)
            }
            fn from_f32(v: f32) -> Self {
                <$t>::from_f32(v)
            }
            fn widen_slice(src: &[Self], dst: &mut [f32]) {
                src.convert_to_f32_slice(dst)
            }
            fn narrow_slice(src: &[f32], dst: &mut [Self]) {
                dst.convert_from_f32_slice(src)
            }
        }
    };
}
half16!(f16);
half16!(bf16);

/// 16-bit → f32: one slice conversion when both buffers are aligned for their element types
/// (pool buffers and vectors of the engine are), element by element otherwise.
fn widen<H: Half16>(src: &[u8], dst: &mut [u8]) {
    use zerocopy::FromBytes;
    if let (Ok(s), Ok(d)) = (<[H]>::ref_from_bytes(src), <[f32]>::mut_from_bytes(dst)) {
        return H::widen_slice(s, d);
    }
    for (s, d) in src.chunks_exact(2).zip(dst.chunks_exact_mut(4)) {
        d.copy_from_slice(&H::from_le([s[0], s[1]]).to_f32().to_le_bytes());
    }
}

/// f32 → 16-bit (round to nearest even), as [`widen`].
fn narrow<H: Half16>(src: &[u8], dst: &mut [u8]) {
    use zerocopy::FromBytes;
    if let (Ok(s), Ok(d)) = (<[f32]>::ref_from_bytes(src), <[H]>::mut_from_bytes(dst)) {
        return H::narrow_slice(s, d);
    }
    for (s, d) in src.chunks_exact(4).zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&H::from_f32(f32::from_le_bytes([s[0], s[1], s[2], s[3]])).to_le());
    }
}

/// Write `v` as an element of `dt` into `dst` (exactly `dt.size()` bytes).
pub fn put(dt: DType, v: f64, dst: &mut [u8]) {
    match dt {
        DType::F32 => dst.copy_from_slice(&(v as f32).to_le_bytes()),
        DType::F64 => dst.copy_from_slice(&v.to_le_bytes()),
        DType::F16 => dst.copy_from_slice(&f16::from_f64(v).to_le_bytes()),
        DType::BF16 => dst.copy_from_slice(&bf16::from_f64(v).to_le_bytes()),
    }
}

/// Read an element of `dt` from `src` as f64.
pub fn get(dt: DType, src: &[u8]) -> f64 {
    match dt {
        DType::F32 => f32::from_le_bytes(src[..4].try_into().unwrap()) as f64,
        DType::F64 => f64::from_le_bytes(src[..8].try_into().unwrap()),
        DType::F16 => f16::from_le_bytes([src[0], src[1]]).to_f64(),
        DType::BF16 => bf16::from_le_bytes([src[0], src[1]]).to_f64(),
    }
}

#[cfg(not(target_endian = "little"))]
compile_error!("mgmm-stream reads tile payloads as native little-endian floats");

/// The number of NaN and Inf elements in `bytes` (little-endian `dt` elements); 0 for the
/// 16-bit types, which the engine only ever produces by conversion from f32.
pub fn count_nonfinite(dt: DType, bytes: &[u8]) -> u64 {
    count_nonfinite_as(dt, dt, bytes)
}

/// The number of elements of `bytes` (little-endian `from` elements) that are NaN or Inf once
/// converted to `to` as [`convert`] does (rounding to nearest, ties to even): those already
/// non-finite, and those beyond `to`'s range (an f32 of 65520 or more is Inf as f16). What the
/// writeback counts of an output tile on its way into the output file. 0 where `from` is a
/// 16-bit type (the engine computes in f32 or f64).
pub fn count_nonfinite_as(from: DType, to: DType, bytes: &[u8]) -> u64 {
    match from {
        DType::F32 => {
            // The smallest magnitude (as bits, sign cleared) that is not finite in `to`.
            let at: u32 = match to {
                // 65504 is f16's largest; 65520, half-way to 65536, rounds to the even Inf.
                DType::F16 => 0x477f_f000,
                // Half-way from bf16's largest (0x7f7f) to Inf (0x7f80), which is even.
                DType::BF16 => 0x7f7f_8000,
                DType::F32 | DType::F64 => 0x7f80_0000,
            };
            count_at_least(bytes, |x: [u8; 4]| {
                u32::from_le_bytes(x) & 0x7fff_ffff >= at
            })
        }
        DType::F64 => {
            let at: u64 = match to {
                // Half-way from f32's largest to 2^128, which rounds to the even Inf.
                DType::F32 | DType::F16 | DType::BF16 => {
                    (f32::MAX as f64 + 2f64.powi(103)).to_bits()
                }
                DType::F64 => 0x7ff0_0000_0000_0000,
            };
            count_at_least(bytes, |x: [u8; 8]| {
                u64::from_le_bytes(x) & 0x7fff_ffff_ffff_ffff >= at
            })
        }
        DType::F16 | DType::BF16 => 0,
    }
}

/// How many `N`-byte elements of `bytes` satisfy `hit`: summed per block of elements in a
/// `u32`, which the compiler turns into vector compares (an f32 tile counts at memory speed).
fn count_at_least<const N: usize>(bytes: &[u8], hit: impl Fn([u8; N]) -> bool) -> u64 {
    bytes
        .chunks(N << 12)
        .map(|block| {
            block
                .chunks_exact(N)
                .map(|x| hit(x.try_into().expect("chunks_exact")) as u32)
                .sum::<u32>() as u64
        })
        .sum()
}

/// [`count_nonfinite`] on the rayon pool, for whole blocks.
pub fn count_nonfinite_par(dt: DType, bytes: &[u8]) -> u64 {
    use rayon::prelude::*;
    let chunk = (1 << 20) / dt.size() * dt.size();
    bytes
        .par_chunks(chunk)
        .map(|c| count_nonfinite(dt, c))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What [`count_nonfinite_as`] counts is exactly what [`convert`] turns into NaN or Inf,
    /// at the edges of each narrower type's range.
    #[test]
    fn nonfinite_counts_match_the_conversion() {
        let near = |v: f32| {
            [
                v,
                f32::from_bits(v.to_bits() - 1),
                f32::from_bits(v.to_bits() + 1),
            ]
        };
        let mut vals: Vec<f32> = [65504.0, 65520.0, 65536.0, 3.389_531_4e38, 3.396_177_6e38]
            .into_iter()
            .flat_map(near)
            .chain([1.0, f32::MAX, f32::INFINITY, f32::NAN, 0.0, 1e-40])
            .collect();
        vals.extend(vals.clone().iter().map(|v| -v));
        let src: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        for to in [DType::F32, DType::F16, DType::BF16, DType::F64] {
            let mut dst = vec![0u8; vals.len() * to.size()];
            assert!(convert(DType::F32, &src, to, &mut dst));
            let want = (0..vals.len())
                .filter(|&i| !get(to, &dst[i * to.size()..]).is_finite())
                .count() as u64;
            assert_eq!(count_nonfinite_as(DType::F32, to, &src), want, "f32 → {to}");
        }
        let m = f32::MAX as f64;
        let wide: Vec<f64> = [
            m,
            m + 2f64.powi(103),
            m + 2f64.powi(103) - 2f64.powi(60),
            1e300,
        ]
        .into_iter()
        .chain([f64::NAN, f64::INFINITY, 1.0])
        .flat_map(|v| [v, -v])
        .collect();
        let src: Vec<u8> = wide.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut dst = vec![0u8; wide.len() * 4];
        assert!(convert(DType::F64, &src, DType::F32, &mut dst));
        let want = (0..wide.len())
            .filter(|&i| !get(DType::F32, &dst[i * 4..]).is_finite())
            .count();
        assert_eq!(
            count_nonfinite_as(DType::F64, DType::F32, &src),
            want as u64
        );
        assert_eq!(count_nonfinite_as(DType::F64, DType::F64, &src), 4);
    }

    /// Slice conversions (aligned buffers) and the element loop (misaligned) agree, both ways.
    #[test]
    fn half_conversions_match_elementwise() {
        let vals: Vec<f32> = (0..1000)
            .map(|i| (i as f32 - 500.0) * 0.37)
            .chain([f32::INFINITY, 1e-8, 65504.0, 70000.0])
            .collect();
        for dt in [DType::F16, DType::BF16] {
            let src: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
            let want: Vec<u8> = vals
                .iter()
                .flat_map(|&v| {
                    let mut b = [0u8; 2];
                    put(dt, v as f64, &mut b); // f32 → f64 is exact, so this rounds once
                    b
                })
                .collect();
            let mut aligned = vec![0u16; vals.len()];
            let narrow_dst = zerocopy::IntoBytes::as_mut_bytes(&mut aligned[..]);
            assert!(convert(DType::F32, &src, dt, narrow_dst));
            assert_eq!(narrow_dst, &want[..], "{dt} narrow, aligned");
            let mut odd = vec![0u8; want.len() + 1];
            assert!(convert(DType::F32, &src, dt, &mut odd[1..]));
            assert_eq!(&odd[1..], &want[..], "{dt} narrow, misaligned");
            let mut wide = vec![0f32; vals.len()];
            assert!(convert(
                dt,
                &want,
                DType::F32,
                zerocopy::IntoBytes::as_mut_bytes(&mut wide[..])
            ));
            let mut odd = vec![0u8; 4 * vals.len() + 1];
            let mut shifted = vec![0u8; want.len() + 1];
            shifted[1..].copy_from_slice(&want);
            assert!(convert(dt, &shifted[1..], DType::F32, &mut odd[1..]));
            for (i, w) in wide.iter().enumerate() {
                let e = get(dt, &want[2 * i..]) as f32;
                assert_eq!(w.to_bits(), e.to_bits(), "{dt} widen, aligned, {i}");
                let m = f32::from_le_bytes(odd[1 + 4 * i..5 + 4 * i].try_into().unwrap());
                assert_eq!(m.to_bits(), e.to_bits(), "{dt} widen, misaligned, {i}");
            }
        }
    }
}
