//! `precision = "fp64_emulated"` on a CUDA lane: each GEMM block computed with exact int8
//! tensor-core GEMMs (Ozaki scheme II, src/backend/ozaki.rs holds the numerics and their
//! derivation) instead of DGEMM, or with DGEMM where the accuracy contract cannot be met.
//!
//! Per block, on the lane's compute stream: kernels/ozaki.cu's `oz_info` measures each row of
//! op(A) and column of op(B) (its 2-norm's power of two, Σ|v|, its largest exponent, NaN/Inf);
//! `oz_coarse` writes coarse non-negative int8 copies in the TN layout and one int8 GEMM
//! (`cublasGemmEx`, int32 accumulation, op(A)ᵀ·op(B) with both k-contiguous: the layout that
//! ran at 1,284 TOP/s on an H200 against 130 in NN) bounds |A||B| from below; `oz_select` finds
//! the fewest moduli that keep every element within the contract, which the host reads (the
//! one synchronisation of a block). NaN/Inf, or no count up to 16 that meets the bound under
//! `auto`, leave the block to DGEMM. Otherwise `oz_split` scales each element once and writes
//! its int8 residues for every modulus used (TN, one plane per modulus; the integers never
//! reach memory), and per modulus one int8 GEMM multiplies the planes and `oz_reduce` keeps the
//! product mod the modulus as one byte per element; `oz_rebuild` recovers each element exactly
//! (Garner, 128-bit), rounds it once and applies alpha and beta with the native path's
//! roundings. The moduli are literals in the kernels (a division by a constant is a multiply).
//! The first H200 run (2026-12-05) spent 2.6 s of a 3.8 s GEMM stage in the element-wise kernels
//! of the first version (a 64-bit division per element for its flat indices, per-modulus
//! passes over int64 copies of the operands, runtime moduli in Garner's O(N²) loop). The depth
//! is padded with zeros to a multiple of 16.
//!
//! The scratch this needs is in the layout's device budget
//! ([`crate::plan::layout::emulation_scratch`]).
//! Written in a session without a GPU and switched on once its CUDA twins (the emulation's
//! accuracy tests, `tools/checks/cuda_tests.sh`) passed on an H200 on 2026-12-05 (docs/GPU.md).

use std::sync::Arc;

use cudarc::cublas::{result as blas_result, sys as blas_sys};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut,
    LaunchConfig, PushKernelArg,
};

use crate::backend::ozaki::{self, Done, Fallback, MAX_MODULI};
use crate::backend::GemmDesc;
use crate::plan::layout::{emulation_depth, Layout};
use crate::seam::EmulationModuli;

const SRC: &str = include_str!("../../../kernels/ozaki.cu");

/// kernels/ozaki.cu with its table of `t` filled from [`ozaki::t_of`], compiled once per
/// process (`--device-int128`: the reconstruction is exact in 128-bit integers;
/// `tools/checks/kernels_compile.py` compiles it with the same options).
fn ptx() -> Result<cudarc::nvrtc::Ptx, cudarc::nvrtc::CompileError> {
    static PTX: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    if let Some(p) = PTX.get() {
        return Ok(cudarc::nvrtc::Ptx::from_src(p.clone()));
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec!["--device-int128".into()],
        // No contraction into fused multiply-adds: the sums of oz_info as the CPU's.
        fmad: Some(false),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source(), opts)?;
    let _ = PTX.set(ptx.to_src());
    Ok(ptx)
}

/// The kernel source as compiled: `OZ_T_TABLE` replaced by `t_of(0..=16)`.
fn source() -> String {
    let t: Vec<String> = (0..=MAX_MODULI)
        .map(|n| ozaki::t_of(n.max(1)).to_string())
        .collect();
    SRC.replace("OZ_T_TABLE", &t.join(", "))
}

/// The kernels of kernels/ozaki.cu, loaded in one context.
struct Kernels {
    info: CudaFunction,
    coarse: CudaFunction,
    split: CudaFunction,
    select: CudaFunction,
    reduce: CudaFunction,
    rebuild: CudaFunction,
}

/// One lane's emulation: its kernels and scratch, sized for the layout's compute tile.
pub(super) struct Emulator {
    moduli: EmulationModuli,
    k: Kernels,
    /// Per vector of op(A) (rows) and op(B) (columns): q, s, x.
    qa: CudaSlice<i32>,
    sa: CudaSlice<f64>,
    xa: CudaSlice<i32>,
    qb: CudaSlice<i32>,
    sb: CudaSlice<f64>,
    xb: CudaSlice<i32>,
    /// `[NaN/Inf seen, need, least]`.
    flags: CudaSlice<u32>,
    /// The int8 operands in the TN layout, one plane per modulus (plane 0 also holds the
    /// coarse copies): `a_plane` and `b_plane` elements apart.
    a8: CudaSlice<u8>,
    b8: CudaSlice<u8>,
    a_plane: usize,
    b_plane: usize,
    c32: CudaSlice<i32>,
    planes: CudaSlice<u8>,
}

/// A device failure inside the emulation, with what failed.
pub(super) type EmuError = (String, Box<dyn std::error::Error + Send + Sync>);

fn fail<E: std::error::Error + Send + Sync + 'static>(what: &str) -> impl Fn(E) -> EmuError + '_ {
    move |e| (what.to_string(), Box::new(e))
}

impl Emulator {
    /// Load the kernels into `ctx` and allocate the scratch for `l`'s tile on `stream`.
    pub(super) fn new(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        l: &Layout,
        moduli: EmulationModuli,
    ) -> Result<Emulator, EmuError> {
        let module = ctx
            .load_module(ptx().map_err(fail("NVRTC failed on kernels/ozaki.cu"))?)
            .map_err(fail("cannot load kernels/ozaki.cu"))?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(fail("cannot find a kernel of kernels/ozaki.cu"))
        };
        let k = Kernels {
            info: f("oz_info")?,
            coarse: f("oz_coarse")?,
            split: f("oz_split")?,
            select: f("oz_select")?,
            reduce: f("oz_reduce")?,
            rebuild: f("oz_rebuild")?,
        };
        let (tm, tn, kp) = (l.tm as usize, l.tn as usize, emulation_depth(l.tk) as usize);
        let tnp = emulation_depth(l.tn) as usize;
        let e = "cannot allocate the fp64_emulated scratch (it is in the layout's device budget: lower engine.tile or engine.device_memory)";
        // SAFETY: scratch is written by the kernels before it is read (the flags are zeroed
        // before each block).
        unsafe {
            Ok(Emulator {
                moduli,
                k,
                qa: stream.alloc(tm).map_err(fail(e))?,
                sa: stream.alloc(tm).map_err(fail(e))?,
                xa: stream.alloc(tm).map_err(fail(e))?,
                qb: stream.alloc(tn).map_err(fail(e))?,
                sb: stream.alloc(tn).map_err(fail(e))?,
                xb: stream.alloc(tn).map_err(fail(e))?,
                flags: stream.alloc(4).map_err(fail(e))?,
                a8: stream.alloc(MAX_MODULI * tm * kp).map_err(fail(e))?,
                // Zeroed once: its padding rows (n..np of a plane) are never written, only
                // multiplied into c32 columns nothing reads.
                b8: stream.alloc_zeros(MAX_MODULI * tnp * kp).map_err(fail(e))?,
                a_plane: tm * kp,
                b_plane: tnp * kp,
                c32: stream.alloc(tm * tnp).map_err(fail(e))?,
                planes: stream.alloc(MAX_MODULI * tm * tn).map_err(fail(e))?,
            })
        }
    }

    /// `c = alpha·op(A)·op(B) + beta·c` for `g` emulated, or `Err(fallback)` with `c` untouched
    /// (the caller runs DGEMM). `a`, `b`, `c`: the lane's slot and accumulator pointers.
    ///
    /// # Safety
    /// As [`super::kernels::gemm_ex`]: device pointers of this lane's context holding the
    /// block's f64 operands and accumulator, nothing else writing them meanwhile; `handle`'s
    /// stream is `stream`.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn gemm(
        &mut self,
        stream: &Arc<CudaStream>,
        handle: blas_sys::cublasHandle_t,
        g: &GemmDesc,
        a: u64,
        b: u64,
        c: u64,
    ) -> Result<Result<Done, Fallback>, EmuError> {
        let (m, n, k) = (g.m, g.n, g.k);
        let short = !(2..=ozaki::MAX_K).contains(&k);
        let kp = emulation_depth(k as u64) as usize;
        // The int8 GEMM's m (our n) and ldc padded to 16, as cuBLAS's int8 tensor-core kernels
        // want (a shape they refuse is left to DGEMM below); the padding columns of c32 are
        // never read.
        let np = emulation_depth(n as u64) as usize;
        let (mi, ni, ki, kpi, npi) = (m as i32, n as i32, k as i32, kp as i32, np as i32);
        // Vectors: op(A) row i at a + (i·rs + p·ks)·8; A is m×k row-major, or k×m (a_trans).
        let (ars, aks): (i64, i64) = if g.a_trans {
            (1, m as i64)
        } else {
            (k as i64, 1)
        };
        // op(B) column j: B is k×n row-major, or n×k (b_trans).
        let (brs, bks): (i64, i64) = if g.b_trans {
            (k as i64, 1)
        } else {
            (1, n as i64)
        };
        stream
            .memset_zeros(&mut self.flags)
            .map_err(fail("memset"))?;
        // Vectors on grid x, elements on grid y (kernels/ozaki.cu's oz_tn).
        let tiles = |count: usize| ((count.div_ceil(32)) as u32, (kp.div_ceil(32)) as u32, 1);
        // Columns on grid x, rows on grid y (strided past `rows`): the element-wise kernels.
        let grid2 = |rows: usize, cols: usize, ymax: usize| {
            (cols.div_ceil(256) as u32, rows.clamp(1, ymax) as u32, 1)
        };
        // SAFETY (every launch below): the kernels read the block's operands within m·k and
        // k·n elements (the layout sizes the slots for the tile) and write only this
        // emulator's scratch (sized for the tile: m ≤ tm, n ≤ tn, kp ≤ the tile's padded depth)
        // and the accumulator's m·n elements; all on `stream`.
        unsafe {
            for (count, x, rs, ks, q, s, xo, side) in [
                (
                    mi,
                    a,
                    ars,
                    aks,
                    &mut self.qa,
                    &mut self.sa,
                    &mut self.xa,
                    1u32,
                ),
                (
                    ni,
                    b,
                    brs,
                    bks,
                    &mut self.qb,
                    &mut self.sb,
                    &mut self.xb,
                    2u32,
                ),
            ] {
                let (mut lb, cfg) = launch(stream, &self.k.info, (count as u32, 1, 1), (256, 1, 1));
                lb.arg(&x)
                    .arg(&count)
                    .arg(&ki)
                    .arg(&rs)
                    .arg(&ks)
                    .arg(q)
                    .arg(s)
                    .arg(xo)
                    .arg(&mut self.flags)
                    .arg(&side);
                lb.launch(cfg).map_err(fail("oz_info launch"))?;
            }
        }
        if short {
            // As the CPU: NaN/Inf first, then a depth with nothing to gain (k = 1) or past what
            // int32 holds exactly (k > 65536).
            let flags = stream
                .clone_dtoh(&self.flags)
                .map_err(fail("reading the block's flags"))?;
            stream.synchronize().map_err(fail("synchronize"))?;
            return Ok(Err(if flags[0] != 0 {
                Fallback::NonFinite
            } else {
                Fallback::ShortK
            }));
        }
        // SAFETY: as above.
        unsafe {
            for (count, x, rs, ks, q, xo, out) in [
                (mi, a, ars, aks, &self.qa, &self.xa, &mut self.a8),
                (ni, b, brs, bks, &self.qb, &self.xb, &mut self.b8),
            ] {
                let (mut lb, cfg) =
                    launch(stream, &self.k.coarse, tiles(count as usize), (32, 8, 1));
                lb.arg(&x)
                    .arg(&count)
                    .arg(&ki)
                    .arg(&kpi)
                    .arg(&rs)
                    .arg(&ks)
                    .arg(q)
                    .arg(xo)
                    .arg(out);
                lb.launch(cfg).map_err(fail("oz_coarse launch"))?;
            }
            if !self.product(stream, handle, 0, (m, np, kp))? {
                return Ok(Err(Fallback::Bound));
            }
            // At most 256 row blocks: one atomic per block.
            let (mut lb, cfg) = launch(stream, &self.k.select, grid2(m, n, 256), (256, 1, 1));
            let mut sel = self.flags.slice_mut(1..3);
            lb.arg(&self.c32)
                .arg(&mi)
                .arg(&ni)
                .arg(&npi)
                .arg(&ki)
                .arg(&self.qa)
                .arg(&self.sa)
                .arg(&self.xa)
                .arg(&self.qb)
                .arg(&self.sb)
                .arg(&self.xb)
                .arg(&mut sel);
            lb.launch(cfg).map_err(fail("oz_select launch"))?;
        }
        let flags = stream
            .clone_dtoh(&self.flags)
            .map_err(fail("reading the block's moduli"))?;
        stream.synchronize().map_err(fail("synchronize"))?;
        if flags[0] != 0 {
            return Ok(Err(Fallback::NonFinite));
        }
        if flags[3] != 3 {
            // Every row of op(A) or every column of op(B) is zero: the product is zero, C =
            // beta·C, no integer GEMM (as the CPU: 0 moduli).
            self.rebuild(stream, (m, n), 0, 0, g, c)?;
            return Ok(Ok(Done {
                moduli: 0,
                bound_met: true,
            }));
        }
        let (need, least) = (flags[1].max(1) as usize, flags[2].max(1) as usize);
        let (nm, bound_met) = match self.moduli {
            EmulationModuli::Fixed(f) => {
                let f = (f as usize).clamp(1, MAX_MODULI);
                (f, least <= f)
            }
            EmulationModuli::Auto => {
                if least > need {
                    return Ok(Err(Fallback::Bound));
                }
                (need.min(MAX_MODULI), true)
            }
        };
        let t = ozaki::t_of(nm);
        let mn = m * n;
        let (nmi, (ap, bp)) = (nm as i32, (self.a_plane as i64, self.b_plane as i64));
        // SAFETY: as above; plane l of a8/b8 starts l·a_plane/b_plane elements in, nm ≤ 16
        // planes allocated.
        unsafe {
            for (count, x, rs, ks, q, plane, out) in [
                (mi, a, ars, aks, &self.qa, ap, &mut self.a8),
                (ni, b, brs, bks, &self.qb, bp, &mut self.b8),
            ] {
                let (mut lb, cfg) =
                    launch(stream, &self.k.split, tiles(count as usize), (32, 8, 1));
                lb.arg(&x)
                    .arg(&count)
                    .arg(&ki)
                    .arg(&kpi)
                    .arg(&rs)
                    .arg(&ks)
                    .arg(q)
                    .arg(&t)
                    .arg(&nmi)
                    .arg(&plane)
                    .arg(out);
                lb.launch(cfg).map_err(fail("oz_split launch"))?;
            }
            for l in 0..nm {
                if !self.product(stream, handle, l, (m, np, kp))? {
                    return Ok(Err(Fallback::Bound));
                }
                let li = l as i32;
                let mut plane = self.planes.slice_mut(l * mn..(l + 1) * mn);
                let (mut lb, cfg) = launch(stream, &self.k.reduce, grid2(m, n, 65535), (256, 1, 1));
                lb.arg(&self.c32)
                    .arg(&mi)
                    .arg(&ni)
                    .arg(&npi)
                    .arg(&li)
                    .arg(&mut plane);
                lb.launch(cfg).map_err(fail("oz_reduce launch"))?;
            }
        }
        self.rebuild(stream, (m, n), nm, t, g, c)?;
        Ok(Ok(Done {
            moduli: nm as u32,
            bound_met,
        }))
    }

    /// The int8 GEMM of plane `l` of `a8` and of `b8` into `c32` ([`int_gemm`]); `false`:
    /// cuBLAS has no int8 kernel for this shape, and the block is left to DGEMM (`c` is
    /// untouched until the rebuild, so that is always safe).
    fn product(
        &mut self,
        stream: &Arc<CudaStream>,
        handle: blas_sys::cublasHandle_t,
        l: usize,
        (m, np, kp): (usize, usize, usize),
    ) -> Result<bool, EmuError> {
        let a8 = self.a8.slice(l * self.a_plane..l * self.a_plane + m * kp);
        let b8 = self.b8.slice(l * self.b_plane..l * self.b_plane + np * kp);
        int_gemm(stream, handle, (&a8, &b8, &mut self.c32), m, np, kp)
    }

    /// `c = alpha·P + beta·c` with P rebuilt from the first `nm` residue planes (`nm = 0`: P = 0).
    fn rebuild(
        &mut self,
        stream: &Arc<CudaStream>,
        (m, n): (usize, usize),
        nm: usize,
        t: i32,
        g: &GemmDesc,
        c: u64,
    ) -> Result<(), EmuError> {
        let mm = ozaki::modulus_product(nm.max(1));
        let (mod_lo, mod_hi) = (mm as u64, (mm >> 64) as u64);
        let (nmi, mi, ni) = (nm as i32, m as i32, n as i32);
        let (alpha, beta) = (g.alpha, g.beta);
        let grid = (n.div_ceil(256) as u32, m.clamp(1, 65535) as u32, 1);
        let (mut lb, cfg) = launch(stream, &self.k.rebuild, grid, (256, 1, 1));
        lb.arg(&self.planes)
            .arg(&nmi)
            .arg(&mi)
            .arg(&ni)
            .arg(&self.qa)
            .arg(&self.qb)
            .arg(&t)
            .arg(&mod_lo)
            .arg(&mod_hi)
            .arg(&alpha)
            .arg(&beta)
            .arg(&c);
        // SAFETY: the planes and per-vector figures are this emulator's, sized for the tile;
        // `c` is the block's accumulator of m·n f64 (the caller's contract, `gemm`).
        unsafe { lb.launch(cfg) }.map_err(fail("oz_rebuild launch"))?;
        Ok(())
    }
}

/// `c32` (row-major m×n, n a multiple of 16) = a8 (m×kp) · b8ᵀ (b8: n×kp), both k-contiguous,
/// exactly in int32: the column-major Cᵀ = b8·a8ᵀ, cuBLAS's TN. `Ok(false)`: cuBLAS has no
/// kernel for the shape (CUBLAS_STATUS_NOT_SUPPORTED).
fn int_gemm(
    stream: &Arc<CudaStream>,
    handle: blas_sys::cublasHandle_t,
    (a8, b8, c32): (&CudaView<u8>, &CudaView<u8>, &mut CudaSlice<i32>),
    m: usize,
    n: usize,
    kp: usize,
) -> Result<bool, EmuError> {
    use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
    use blas_sys::cudaDataType::{CUDA_R_32I, CUDA_R_8I};
    let (one, zero) = (1i32, 0i32);
    let (pa, _ga) = a8.device_ptr(stream);
    let (pb, _gb) = b8.device_ptr(stream);
    let (pc, _gc) = c32.device_ptr_mut(stream);
    // SAFETY: a8/b8/c32 are this emulator's buffers of at least m·kp, n·kp and m·n
    // elements on `stream`, the handle's stream; alpha/beta point to live i32 locals, the
    // type CUBLAS_COMPUTE_32I reads.
    let r = unsafe {
        blas_result::gemm_ex(
            handle,
            CUBLAS_OP_T,
            CUBLAS_OP_N,
            n as i32,
            m as i32,
            kp as i32,
            &one as *const i32 as *const std::ffi::c_void,
            pb as *const std::ffi::c_void,
            CUDA_R_8I,
            kp as i32,
            pa as *const std::ffi::c_void,
            CUDA_R_8I,
            kp as i32,
            &zero as *const i32 as *const std::ffi::c_void,
            pc as *mut std::ffi::c_void,
            CUDA_R_32I,
            n as i32,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32I,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    };
    match r {
        Ok(()) => Ok(true),
        Err(blas_result::CublasError(blas_sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => {
            Ok(false)
        }
        Err(e) => Err(fail("cublasGemmEx (int8)")(e)),
    }
}

/// A launch of `f` on `stream` (arguments to push) and its grid.
fn launch<'a>(
    stream: &'a Arc<CudaStream>,
    f: &'a CudaFunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
) -> (cudarc::driver::LaunchArgs<'a>, LaunchConfig) {
    let cfg = LaunchConfig {
        grid_dim: grid,
        block_dim: block,
        shared_mem_bytes: 0,
    };
    (stream.launch_builder(f), cfg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ozaki::MODULI;

    /// The literal `case l: return x;` list of the kernel function `name` (kernels/ozaki.cu's
    /// switches), in order; `default:` is the last one.
    fn switch_of(src: &str, name: &str) -> Vec<u32> {
        let body = &src[src.find(&format!("u32 {name}(int l)")).expect(name)..];
        let body = &body[..body.find("\n}").expect("end of function")];
        body.split("return ")
            .skip(1)
            .map(|r| r[..r.find(';').unwrap()].trim().parse().unwrap())
            .collect()
    }

    /// The kernels' literal moduli and Garner inverses are the CPU's, and their table of t is
    /// filled from its `t_of`.
    #[test]
    fn the_kernels_use_the_cpus_moduli_inverses_and_t() {
        let src = source();
        assert_eq!(
            switch_of(&src, "oz_m"),
            MODULI.to_vec(),
            "oz_m differs from ozaki::MODULI"
        );
        assert_eq!(
            switch_of(&src, "oz_inv"),
            ozaki::garner_inverses(MAX_MODULI).to_vec(),
            "oz_inv differs from ozaki::garner_inverses"
        );
        // Every launch's case list reaches every modulus.
        for l in 0..MAX_MODULI {
            assert!(
                src.contains(&format!("OZ_R({l})")),
                "oz_reduce lacks modulus {l}"
            );
        }
        let t: Vec<String> = (0..=MAX_MODULI)
            .map(|n| ozaki::t_of(n.max(1)).to_string())
            .collect();
        assert!(src.contains(&format!("{{{}}}", t.join(", "))));
        assert!(!src.contains("OZ_T_TABLE"));
    }
}
