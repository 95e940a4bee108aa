//! Element types of matrix files and of computation.
//!
//! Files may hold f32, f64, f16 or bf16 (the header's dtype code). Computation on the host side
//! happens in f32 or f64 ("compute type"); 16-bit files are widened while staging. This module
//! is the one place that knows element sizes and the conversions between them.

use half::{bf16, f16};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
}

impl DType {
    pub fn code(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F64 => 1,
            DType::F16 => 2,
            DType::BF16 => 3,
        }
    }
    pub fn from_code(code: u32) -> Option<Self> {
        Some(match code {
            0 => DType::F32,
            1 => DType::F64,
            2 => DType::F16,
            3 => DType::BF16,
            _ => return None,
        })
    }
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
            DType::F16 | DType::BF16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }
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
            for (s, d) in src.chunks_exact(2).zip(dst.chunks_exact_mut(4)) {
                let v = f16::from_le_bytes([s[0], s[1]]).to_f32();
                d.copy_from_slice(&v.to_le_bytes());
            }
            true
        }
        (DType::BF16, DType::F32) => {
            for (s, d) in src.chunks_exact(2).zip(dst.chunks_exact_mut(4)) {
                let v = bf16::from_le_bytes([s[0], s[1]]).to_f32();
                d.copy_from_slice(&v.to_le_bytes());
            }
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
            for (s, d) in src.chunks_exact(4).zip(dst.chunks_exact_mut(2)) {
                let v = f16::from_f32(f32::from_le_bytes([s[0], s[1], s[2], s[3]]));
                d.copy_from_slice(&v.to_le_bytes());
            }
            true
        }
        (DType::F32, DType::BF16) => {
            for (s, d) in src.chunks_exact(4).zip(dst.chunks_exact_mut(2)) {
                let v = bf16::from_f32(f32::from_le_bytes([s[0], s[1], s[2], s[3]]));
                d.copy_from_slice(&v.to_le_bytes());
            }
            true
        }
        _ => false,
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
