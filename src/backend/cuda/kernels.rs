//! The GPU code the lanes run besides copies: kernels/convert.cu and kernels/check.cu compiled
//! by NVRTC once per process (kernels/verify.cu, `verify`'s, with [`compiled_once`] too), the GEMM through `cublasGemmEx` for every precision, and the
//! page-locked ring where the device checks of directly uploaded blocks
//! ([`crate::backend::check`]) leave their results.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{result as blas_result, sys as blas_sys};
use cudarc::driver::{CudaEvent, CudaSlice};

use crate::backend::check::MAX_TILES as CHECK_MAX_TILES;
use crate::backend::GemmDesc;
use crate::seam::Precision;

const CONVERT_SRC: &str = include_str!("../../../kernels/convert.cu");
const CHECK_SRC: &str = include_str!("../../../kernels/check.cu");

/// kernels/check.cu compiled once per process (see [`convert_ptx`]).
pub(super) fn check_ptx() -> std::result::Result<cudarc::nvrtc::Ptx, cudarc::nvrtc::CompileError> {
    static PTX: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    compiled_once(&PTX, CHECK_SRC)
}

/// kernels/convert.cu compiled once per process (NVRTC takes tens of milliseconds; every lane of
/// every bf16/fp16 step loads the same PTX).
pub(super) fn convert_ptx() -> std::result::Result<cudarc::nvrtc::Ptx, cudarc::nvrtc::CompileError>
{
    static PTX: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    compiled_once(&PTX, CONVERT_SRC)
}

/// `src` compiled by NVRTC the first time, its PTX kept in `cell` for every later call.
pub(super) fn compiled_once(
    cell: &std::sync::OnceLock<String>,
    src: &str,
) -> std::result::Result<cudarc::nvrtc::Ptx, cudarc::nvrtc::CompileError> {
    if let Some(ptx) = cell.get() {
        return Ok(cudarc::nvrtc::Ptx::from_src(ptx.clone()));
    }
    let ptx = cudarc::nvrtc::compile_ptx(src)?;
    let _ = cell.set(ptx.to_src());
    Ok(ptx)
}

/// Bytes per element of a GEMM's inputs and of its output in precision `p`.
pub(super) fn gemm_sizes(p: Precision) -> (usize, usize) {
    match p {
        Precision::Fp32 | Precision::Tf32 => (4, 4),
        Precision::Bf16 | Precision::Fp16 => (2, 4),
        // fp64_emulated: f64 tiles in and out (its int8 work is in `emulate`'s scratch).
        Precision::Fp64 | Precision::Fp64Emulated(_) => (8, 8),
    }
}

/// The column-major GEMM cuBLAS is asked for to compute row-major `C = op(A)·op(B)` of `g`:
/// row-major C is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ, so B is passed first. Kept apart from
/// [`gemm_ex`] so that the tests can check it against cuBLAS's definition on the host.
#[derive(Clone, Copy, Debug)]
pub(super) struct ColMajor {
    /// cuBLAS's m, n, k (the rows and columns of column-major Cᵀ, the depth).
    pub(super) m: i32,
    pub(super) n: i32,
    pub(super) k: i32,
    /// The first operand (B) and the second (A): transposed, and their leading dimensions.
    pub(super) trans_first: bool,
    pub(super) ld_first: i32,
    pub(super) trans_second: bool,
    pub(super) ld_second: i32,
    /// C's leading dimension.
    pub(super) ldc: i32,
}

impl ColMajor {
    pub(super) fn of(g: &GemmDesc) -> ColMajor {
        let (m, n, k) = (g.m as i32, g.n as i32, g.k as i32);
        ColMajor {
            m: n,
            n: m,
            k,
            trans_first: g.b_trans,
            ld_first: if g.b_trans { k } else { n },
            trans_second: g.a_trans,
            ld_second: if g.a_trans { m } else { k },
            ldc: n,
        }
    }
}

/// Row-major `C = alpha·op(A)·op(B) + beta·C` for `g` in precision `p`, through
/// `cublasGemmEx` (SGEMM, TF32, bf16/fp16 inputs with fp32 accumulate, DGEMM).
///
/// # Safety
/// `a`, `b` and `c` must be device pointers of `handle`'s context holding at least `g.m·g.k`,
/// `g.k·g.n` and `g.m·g.n` elements of [`gemm_sizes`]`(p)`, with nothing else writing them
/// before the GEMM on `handle`'s stream is done.
pub(super) unsafe fn gemm_ex(
    handle: blas_sys::cublasHandle_t,
    p: Precision,
    g: &GemmDesc,
    a: cudarc::driver::sys::CUdeviceptr,
    b: cudarc::driver::sys::CUdeviceptr,
    c: cudarc::driver::sys::CUdeviceptr,
) -> std::result::Result<(), blas_result::CublasError> {
    use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
    use blas_sys::cudaDataType::*;
    let cm = ColMajor::of(g);
    let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
    let (transa, transb, lda, ldb) = (
        op(cm.trans_first),
        op(cm.trans_second),
        cm.ld_first,
        cm.ld_second,
    );
    let (in_t, out_t, compute) = match p {
        Precision::Fp32 => (
            CUDA_R_32F,
            CUDA_R_32F,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        Precision::Tf32 => (
            CUDA_R_32F,
            CUDA_R_32F,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        ),
        Precision::Bf16 => (
            CUDA_R_16BF,
            CUDA_R_32F,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        Precision::Fp16 => (
            CUDA_R_16F,
            CUDA_R_32F,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        Precision::Fp64 | Precision::Fp64Emulated(_) => (
            CUDA_R_64F,
            CUDA_R_64F,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_64F,
        ),
    };
    let (a32, b32) = (g.alpha as f32, g.beta as f32);
    let (a64, b64) = (g.alpha, g.beta);
    let (pa, pb): (*const c_void, *const c_void) = if p.is_f64() {
        (
            &a64 as *const f64 as *const c_void,
            &b64 as *const f64 as *const c_void,
        )
    } else {
        (
            &a32 as *const f32 as *const c_void,
            &b32 as *const f32 as *const c_void,
        )
    };
    // SAFETY: the caller's buffers (above); alpha/beta point to live locals of the type that
    // `compute` reads.
    unsafe {
        blas_result::gemm_ex(
            handle,
            transa,
            transb,
            cm.m,
            cm.n,
            cm.k,
            pa,
            b as *const c_void,
            in_t,
            lda,
            a as *const c_void,
            in_t,
            ldb,
            pb,
            c as *mut c_void,
            out_t,
            cm.ldc,
            compute,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
}

/// Let go of a cuBLAS handle without letting a broken context turn into a panic: cudarc's
/// `CudaBlas` unwraps `cublasDestroy` in its Drop, which fails on a context that took an error
/// (an illegal address, an ECC error). There the handle is leaked (with the stream and the
/// context retain it holds: the GPU is unusable anyway); on a healthy context it is dropped.
pub(super) fn let_go_of_blas(ctx: &cudarc::driver::CudaContext, blas: cudarc::cublas::CudaBlas) {
    if ctx.synchronize().is_ok() {
        drop(blas);
    } else {
        std::mem::forget(blas);
    }
}

/// Checks a lane may have in flight at once (staging's check queue holds 64, plus the blocks
/// being copied); a check beyond them is left to the host.
pub(super) const CHECK_RING: usize = 128;

/// Where a lane's checks ([`crate::backend::check`]) put their results: `[crc, count]` per storage
/// tile, written by the kernel into `dev`, copied into the page-locked `ring._host`, one region
/// of `CHECK_MAX_TILES` pairs per check in flight.
pub(super) struct CheckBufs {
    pub(super) dev: CudaSlice<u32>,
    pub(super) ring: Arc<CheckRing>,
}

/// The page-locked half of [`CheckBufs`] and which of its regions are free; shared with the
/// checks in flight, which give their region back when dropped.
pub(super) struct CheckRing {
    pub(super) _host: cudarc::driver::PinnedHostSlice<u32>,
    /// `host`'s address, taken once when nothing was using it.
    pub(super) ptr: usize,
    pub(super) free: std::sync::Mutex<Vec<usize>>,
}

/// A check queued on a lane's H2D stream: its region of the ring and the event after the copy
/// of its results into it.
pub(super) struct CudaCheck {
    pub(super) ring: Arc<CheckRing>,
    pub(super) region: usize,
    pub(super) tiles: usize,
    /// Recorded once the check and its copy are queued (`None` until then).
    pub(super) done: Option<CudaEvent>,
}

impl crate::backend::check::DeviceCheck for CudaCheck {
    fn wait(self: Box<Self>) -> std::result::Result<Vec<[u32; 2]>, String> {
        let done = (self.done.as_ref()).ok_or("the check was never queued")?;
        done.synchronize().map_err(|e| e.to_string())?;
        let at = self.ring.ptr as *const u32;
        // SAFETY: the region lies inside `ring.host` (alive: `self.ring`), its results were
        // copied there before `done` (synchronized above), and no other check writes it
        // until this one gives it back (Drop).
        let r = unsafe {
            std::slice::from_raw_parts(at.add(self.region * CHECK_MAX_TILES * 2), self.tiles * 2)
        };
        Ok(r.chunks_exact(2).map(|p| [p[0], p[1]]).collect())
    }
}

impl Drop for CudaCheck {
    fn drop(&mut self) {
        (self.ring.free.lock().unwrap_or_else(|e| e.into_inner())).push(self.region);
    }
}
