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
    match dt {
        DType::F32 => bytes
            .chunks_exact(4)
            .filter(|x| {
                let bits = u32::from_le_bytes([x[0], x[1], x[2], x[3]]);
                bits & 0x7f80_0000 == 0x7f80_0000
            })
            .count() as u64,
        DType::F64 => bytes
            .chunks_exact(8)
            .filter(|x| {
                let bits = u64::from_le_bytes((*x).try_into().unwrap());
                bits & 0x7ff0_0000_0000_0000 == 0x7ff0_0000_0000_0000
            })
            .count() as u64,
        _ => 0,
    }
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
