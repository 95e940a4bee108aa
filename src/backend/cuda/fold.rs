//! `verify`'s dense pass on a GPU ([`crate::backend::fold`] says what and why): two streams
//! (the bands' copies, the compute), one cuBLAS handle, kernels/verify.cu.
//!
//! Per band: the f32 band is copied up on a stream of its own (from the host buffer the pass
//! read it into, page-locked by [`FoldDevice::pin`] where the driver allows, so the copy is DMA
//! at PCIe speed; 7–8 GB/s from pageable memory on the H200 host) into one of two device band
//! buffers; then, on the compute stream, once that copy is done, `vf_widen` writes it as f64
//! with NaN/Inf as 0 and marks their op rows, one DGEMM adds it times the signed sums, and
//! `vf_abs` and `vf_square` turn it into |a| and a·a in place for the two tolerance DGEMMs.
//! `fold` returns once the copy is done (the host may then reuse the band's buffer); the rest
//! runs while the host reads the next band. With one stream for both, a band's copy was queued
//! behind the previous band's widening and DGEMMs, and the host waited for those too; now the
//! next copy waits only for the widening of the band two before it (which read its buffer).
//!
//! Written in a session without a GPU (2026-12-05, the twenty-first): `verify` checks this
//! device's sums of the first and the last band against the CPU's before trusting them, and
//! falls back to the CPU on any difference, error or panic (src/verify/pass.rs); the DGEMMs'
//! layouts are checked on the host against cuBLAS's column-major definition (tests below). Its
//! twin tests (`verify::cuda::`, tools/checks/cuda_tests.sh) first ran, and passed, on one H100
//! the same day (docs/decisions/0018-verify-products-on-the-gpu.md).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    LaunchConfig, PushKernelArg,
};

use super::kernels::{compiled_once, gemm_ex};
use crate::backend::fold::{FoldDevice, FoldSpec, FoldSums};
use crate::backend::GemmDesc;
use crate::error::{Error, Result};
use crate::seam::Precision;

const SRC: &str = include_str!("../../../kernels/verify.cu");

/// kernels/verify.cu compiled once per process.
fn ptx() -> std::result::Result<cudarc::nvrtc::Ptx, cudarc::nvrtc::CompileError> {
    static PTX: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    compiled_once(&PTX, SRC)
}

/// The dense pass on GPU `ordinal` (as CUDA_VISIBLE_DEVICES numbers them).
pub(crate) fn open_fold(ordinal: usize) -> Result<Box<dyn FoldDevice>> {
    let devices = super::probe()?;
    let d = devices
        .iter()
        .find(|d| d.ordinal == ordinal)
        .ok_or_else(|| {
            Error::backend(
                "cuda",
                format!(
                    "GPU {ordinal} (engine.devices) is not among the {} visible",
                    devices.len()
                ),
            )
        })?;
    Ok(Box::new(CudaFold::new(d.ordinal, &d.name, &d.ctx)?))
}

/// The kernels of kernels/verify.cu.
struct Kernels {
    widen: CudaFunction,
    abs: CudaFunction,
    square: CudaFunction,
}

/// Device buffers of one pass, (re)allocated by `begin` when a pass needs more.
#[derive(Default)]
struct Bufs {
    z: Option<CudaSlice<f64>>,
    zabs: Option<CudaSlice<f64>>,
    zsq: Option<CudaSlice<f64>>,
    out: Option<CudaSlice<f64>>,
    oabs: Option<CudaSlice<f64>>,
    osq: Option<CudaSlice<f64>>,
    bad: Option<CudaSlice<u8>>,
    /// Two, copied into in turn (the copy of one band while the other is widened).
    band: [Option<CudaSlice<f32>>; 2],
    wide: Option<CudaSlice<f64>>,
}

struct CudaFold {
    name: String,
    ctx: Arc<CudaContext>,
    /// The widening, the DGEMMs and the sums.
    stream: Arc<CudaStream>,
    /// The bands' copies up.
    copy: Arc<CudaStream>,
    /// Per band buffer, the event after the widening that last read it (the next copy into it
    /// waits for that), and which buffer the next band goes to.
    widened: [Option<CudaEvent>; 2],
    next: usize,
    blas: Option<CudaBlas>,
    k: Kernels,
    b: Bufs,
    /// The pass's shape: (m, k, rg, g, trans).
    shape: (usize, usize, usize, usize, bool),
    /// Host ranges page-locked by `pin`.
    pinned: Vec<usize>,
}

// SAFETY: the raw handles inside (cuBLAS handle, functions) belong to `ctx`, which every call
// binds to its thread first; calls come one at a time (`&mut self`).
unsafe impl Send for CudaFold {}

fn err(name: &str, what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    let (name, what) = (name.to_string(), what.to_string());
    move |e| Error::device(0, name.clone(), what.clone(), e)
}

impl CudaFold {
    fn new(ordinal: usize, model: &str, ctx: &Arc<CudaContext>) -> Result<CudaFold> {
        let name = format!("cuda:{ordinal} {model}");
        let e = |what: &str| err(&name, what);
        ctx.bind_to_thread().map_err(e("cannot use context"))?;
        let stream = ctx.new_stream().map_err(e("cannot create stream"))?;
        let copy = ctx.new_stream().map_err(e("cannot create stream"))?;
        let ptx = ptx()
            .map_err(|x| Error::device(0, name.clone(), "NVRTC failed on kernels/verify.cu", x))?;
        let module = ctx
            .load_module(ptx)
            .map_err(e("cannot load kernels/verify.cu"))?;
        let f = |n: &str| {
            module
                .load_function(n)
                .map_err(e("cannot find a kernel of kernels/verify.cu"))
        };
        let k = Kernels {
            widen: f("vf_widen")?,
            abs: f("vf_abs")?,
            square: f("vf_square")?,
        };
        let blas = CudaBlas::new(stream.clone())
            .map_err(|x| Error::device(0, name.clone(), "cuBLAS handle", x))?;
        Ok(CudaFold {
            name,
            ctx: ctx.clone(),
            stream,
            copy,
            widened: [None, None],
            next: 0,
            blas: Some(blas),
            k,
            b: Bufs::default(),
            shape: (0, 0, 0, 0, false),
            pinned: Vec::new(),
        })
    }

    fn e(&self, what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error {
        err(&self.name, what)
    }

    /// `slot` holding at least `len` elements (allocated anew when smaller), zeroed if `zero`.
    fn ensure<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        stream: &Arc<CudaStream>,
        slot: &mut Option<CudaSlice<T>>,
        len: usize,
        zero: bool,
    ) -> std::result::Result<(), cudarc::driver::DriverError> {
        if slot.as_ref().is_none_or(|s| s.len() < len.max(1)) {
            // The smaller one is freed before the larger one is allocated.
            *slot = None;
            // SAFETY: written (zeroed below, or copied into) before it is read.
            *slot = Some(unsafe { stream.alloc::<T>(len.max(1)) }?);
        }
        if zero {
            stream.memset_zeros(slot.as_mut().expect("allocated above"))?;
        }
        Ok(())
    }
}

/// A DGEMM `c[c_off..] += op(a) · b[b_off..]` as `g` describes it (row-major), on `stream`.
fn dgemm(
    blas: &CudaBlas,
    stream: &Arc<CudaStream>,
    (g, b_off, c_off): (GemmDesc, usize, usize),
    a: &CudaSlice<f64>,
    b: &CudaSlice<f64>,
    c: &mut CudaSlice<f64>,
) -> std::result::Result<(), cudarc::cublas::result::CublasError> {
    let (pa, _ga) = a.device_ptr(stream);
    let (pb, _gb) = b.device_ptr(stream);
    let (pc, _gc) = c.device_ptr_mut(stream);
    // SAFETY: `a` holds g.m·g.k elements (the widened band), `b` from b_off g.k·g.n (the
    // right-hand side's rows of this band), `c` from c_off g.m·g.n (the sums' rows): `fold`
    // checked the band against the pass's shape and `begin` sized the buffers for it; all on
    // `stream`, whose handle `blas` is, with the context bound by the caller.
    unsafe {
        gemm_ex(
            *blas.handle(),
            Precision::Fp64,
            &g,
            pa,
            pb + (b_off * 8) as u64,
            pc + (c_off * 8) as u64,
        )
    }
}

/// The DGEMM of a band against a right-hand side of `w` columns: rows r0..r0 + h of the sums
/// against all of it (op(A) = A), or every op row against its rows r0..r0 + h (op(A) = Aᵀ:
/// the band, h × cols row-major, is then op(A)'s columns r0.. stored transposed).
fn band_gemm(trans: bool, r0: usize, h: usize, cols: usize, w: usize) -> (GemmDesc, usize, usize) {
    let (m, k, b_off, c_off) = match trans {
        false => (h, cols, 0, r0 * w),
        true => (cols, h, r0 * w, 0),
    };
    let g = GemmDesc {
        m,
        n: w,
        k,
        a_trans: trans,
        b_trans: false,
        alpha: 1.0,
        beta: 1.0,
    };
    (g, b_off, c_off)
}

/// The launch of `f` over `n` elements (grid-stride), its arguments still to push.
fn launch<'a>(
    stream: &'a Arc<CudaStream>,
    f: &'a CudaFunction,
    n: usize,
) -> (cudarc::driver::LaunchArgs<'a>, LaunchConfig) {
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 65535 * 8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    (stream.launch_builder(f), cfg)
}

impl FoldDevice for CudaFold {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn prepare(&mut self, spec: &FoldSpec, h: usize, cols: usize) -> Result<()> {
        self.begin(spec, h * cols)?;
        let (m, k, rg, g, trans) = self.shape;
        let (s, name) = (&self.stream, &self.name);
        let e = |what: &str| err(name, what);
        let be = |what: &'static str| move |x| Error::device(0, name.clone(), what, x);
        let blas = self.blas.as_ref().expect("held until drop");
        let b = &mut self.b;
        // One band of zeros through the widening and the DGEMMs of its two shapes (the
        // tolerance sums' two share one), against zeroed sums; `begin` zeroes the results again.
        for z in [&mut b.z, &mut b.zabs] {
            s.memset_zeros(z.as_mut().expect("allocated by begin"))
                .map_err(e("zeroing the sums"))?;
        }
        let zero = b.band[0].as_mut().expect("allocated by begin");
        s.memset_zeros(zero).map_err(e("zeroing a band"))?;
        let (stored, rows_ok) = match trans {
            false => (h.min(m), cols == k),
            true => (h.min(k), cols == m),
        };
        if stored > 0 && rows_ok {
            let n = (stored * cols) as u64;
            let wide = b.wide.as_mut().expect("allocated by begin");
            let bad = b.bad.as_mut().expect("allocated by begin");
            let (cols64, row0, tr) = (cols as u64, 0u64, trans as u32);
            // SAFETY: as in `fold`: the band buffers hold h·cols ≥ n elements, `bad` m.
            unsafe {
                let (mut l, cfg) = launch(s, &self.k.widen, n as usize);
                l.arg(&*zero)
                    .arg(&mut *wide)
                    .arg(&n)
                    .arg(&cols64)
                    .arg(&mut *bad)
                    .arg(&tr)
                    .arg(&row0);
                l.launch(cfg).map_err(e("vf_widen launch"))?;
                for f in [&self.k.abs, &self.k.square] {
                    let (mut l, cfg) = launch(s, f, n as usize);
                    l.arg(&mut *wide).arg(&n);
                    l.launch(cfg).map_err(e("vf_abs/vf_square launch"))?;
                }
            }
            let z = b.z.as_ref().expect("begin");
            let out = b.out.as_mut().expect("begin");
            dgemm(blas, s, band_gemm(trans, 0, stored, cols, rg), wide, z, out)
                .map_err(be("DGEMM"))?;
            let (za, oa) = (
                b.zabs.as_ref().expect("begin"),
                b.oabs.as_mut().expect("begin"),
            );
            dgemm(blas, s, band_gemm(trans, 0, stored, cols, g), wide, za, oa)
                .map_err(be("DGEMM"))?;
        }
        // The copy stream's first copy, too.
        let one = [0f32];
        let c = &self.copy;
        c.memcpy_htod(&one[..], b.band[1].as_mut().expect("allocated by begin"))
            .map_err(e("copy of a band"))?;
        c.synchronize().map_err(e("waiting for the warm-up"))?;
        s.synchronize().map_err(e("waiting for the warm-up"))
    }

    fn begin(&mut self, spec: &FoldSpec, band_elems: usize) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(self.e("cannot use context"))?;
        let (m, k, rg, g) = (spec.m, spec.k, spec.rg, spec.g);
        let s = self.stream.clone();
        let fail = |what: &'static str| {
            let name = self.name.clone();
            move |x| {
                Error::device(
                    0,
                    name.clone(),
                    format!("cannot allocate {what} for verify's dense pass"),
                    x,
                )
            }
        };
        let b = &mut self.b;
        Self::ensure(&s, &mut b.z, k * rg, false).map_err(fail("the signed sums"))?;
        Self::ensure(&s, &mut b.zabs, k * g, false).map_err(fail("the tolerance sums"))?;
        Self::ensure(&s, &mut b.zsq, k * g, false).map_err(fail("the tolerance sums"))?;
        Self::ensure(&s, &mut b.out, m * rg, true).map_err(fail("the results"))?;
        Self::ensure(&s, &mut b.oabs, m * g, true).map_err(fail("the results"))?;
        Self::ensure(&s, &mut b.osq, m * g, true).map_err(fail("the results"))?;
        Self::ensure(&s, &mut b.bad, m, true).map_err(fail("the row flags"))?;
        for band in &mut b.band {
            Self::ensure(&s, band, band_elems, false).map_err(fail("a band"))?;
        }
        Self::ensure(&s, &mut b.wide, band_elems, false).map_err(fail("a band"))?;
        let up = |src: &[f64], dst: &mut Option<CudaSlice<f64>>| {
            s.memcpy_htod(src, dst.as_mut().expect("allocated above"))
        };
        let name = &self.name;
        // (`prepare` has no sums yet: empty slices.)
        if !spec.signed.is_empty() {
            up(spec.signed, &mut b.z).map_err(err(name, "copy of the signed sums"))?;
            up(spec.abs, &mut b.zabs).map_err(err(name, "copy of the tolerance sums"))?;
            up(spec.sq, &mut b.zsq).map_err(err(name, "copy of the tolerance sums"))?;
        }
        self.shape = (m, k, rg, g, spec.trans);
        // The copy stream's first copies may not start before the buffers exist.
        let ready = s
            .record_event(None)
            .map_err(err(name, "event after allocation"))?;
        self.copy.wait(&ready).map_err(err(name, "copy stream"))?;
        self.widened = [None, None];
        Ok(())
    }

    fn pin(&mut self, bufs: &[&[f32]]) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        for b in bufs {
            let (p, len) = (b.as_ptr() as usize, std::mem::size_of_val(*b));
            // SAFETY: registers the caller's live buffer, which it keeps alive and in place
            // until `unpin` (the pass's contract); a refusal only leaves it pageable.
            let r = unsafe {
                cudarc::driver::sys::cuMemHostRegister_v2(
                    p as *mut c_void,
                    len,
                    cudarc::driver::sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            };
            if r == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                self.pinned.push(p);
            }
        }
    }

    fn unpin(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // A `fold` that failed may have left its copy from a buffer running.
        let _ = self.copy.synchronize();
        let _ = self.stream.synchronize();
        for p in self.pinned.drain(..) {
            // SAFETY: a range this fold registered and has not unregistered.
            unsafe { cudarc::driver::sys::cuMemHostUnregister(p as *mut c_void) };
        }
    }

    fn fold(&mut self, r0: usize, h: usize, band: &[f32]) -> Result<()> {
        let (m, k, rg, g, trans) = self.shape;
        let n = band.len();
        let cols = n / h.max(1);
        let fits = h > 0
            && n == h * cols
            && n <= self.b.band[0].as_ref().map_or(0, |b| b.len())
            && match trans {
                false => r0 + h <= m && cols == k,
                true => r0 + h <= k && cols == m,
            };
        if !fits {
            return Err(Error::backend(
                "cuda",
                format!("verify's dense pass: a band of {h}×{cols} at row {r0} does not fit a pass of {m}×{k}{}", if trans { " (transposed)" } else { "" }),
            ));
        }
        self.ctx
            .bind_to_thread()
            .map_err(self.e("cannot use context"))?;
        let (s, c, name) = (&self.stream, &self.copy, &self.name);
        let blas = self.blas.as_ref().expect("held until drop");
        let e = |what: &str| err(name, what);
        let be = |what: &'static str| move |x| Error::device(0, name.clone(), what, x);
        let b = &mut self.b;
        let slot = self.next % 2;
        self.next += 1;
        let dband = b.band[slot].as_mut().expect("allocated by begin");
        // The buffer was last read by the widening of the band two before this one.
        if let Some(w) = &self.widened[slot] {
            c.wait(w).map_err(e("copy stream waiting for a widening"))?;
        }
        c.memcpy_htod(band, dband).map_err(e("copy of a band"))?;
        let copied = c
            .record_event(None)
            .map_err(e("event after a band's copy"))?;
        s.wait(&copied)
            .map_err(e("compute stream waiting for a band's copy"))?;
        let wide = b.wide.as_mut().expect("allocated by begin");
        let bad = b.bad.as_mut().expect("allocated by begin");
        let (n64, cols64, row0, tr) = (n as u64, cols as u64, r0 as u64, trans as u32);
        // SAFETY (the three launches): the kernels of kernels/verify.cu touch the first n
        // elements of the band buffers (`begin` sized them for the largest band; `fits`
        // above) and, for `vf_widen`, entries of `bad` below m (op rows: row0 + i / cols < m,
        // or i % cols < m, by the shape check above); all on this fold's stream.
        unsafe {
            let (mut l, cfg) = launch(s, &self.k.widen, n);
            l.arg(&*dband)
                .arg(&mut *wide)
                .arg(&n64)
                .arg(&cols64)
                .arg(&mut *bad)
                .arg(&tr)
                .arg(&row0);
            l.launch(cfg).map_err(e("vf_widen launch"))?;
        }
        self.widened[slot] = Some(
            s.record_event(None)
                .map_err(e("event after a band's widening"))?,
        );
        let (z, out) = (b.z.as_ref().expect("begin"), b.out.as_mut().expect("begin"));
        dgemm(blas, s, band_gemm(trans, r0, h, cols, rg), wide, z, out).map_err(be("DGEMM"))?;
        unsafe {
            let (mut l, cfg) = launch(s, &self.k.abs, n);
            l.arg(&mut *wide).arg(&n64);
            l.launch(cfg).map_err(e("vf_abs launch"))?;
        }
        let (za, oa) = (
            b.zabs.as_ref().expect("begin"),
            b.oabs.as_mut().expect("begin"),
        );
        dgemm(blas, s, band_gemm(trans, r0, h, cols, g), wide, za, oa).map_err(be("DGEMM"))?;
        unsafe {
            let (mut l, cfg) = launch(s, &self.k.square, n);
            l.arg(&mut *wide).arg(&n64);
            l.launch(cfg).map_err(e("vf_square launch"))?;
        }
        let (zq, oq) = (
            b.zsq.as_ref().expect("begin"),
            b.osq.as_mut().expect("begin"),
        );
        dgemm(blas, s, band_gemm(trans, r0, h, cols, g), wide, zq, oq).map_err(be("DGEMM"))?;
        // The host may reuse `band` once its copy is done; the kernels and DGEMMs run on.
        copied.synchronize().map_err(e("waiting for a band's copy"))
    }

    fn sums(&mut self) -> Result<FoldSums> {
        let (m, _, rg, g, _) = self.shape;
        self.ctx
            .bind_to_thread()
            .map_err(self.e("cannot use context"))?;
        let s = &self.stream;
        let e = |what: &str| err(&self.name, what);
        let b = &self.b;
        let take = |v: &Option<CudaSlice<f64>>, len: usize| {
            s.clone_dtoh(&v.as_ref().expect("begin").slice(0..len))
        };
        let signed = take(&b.out, m * rg).map_err(e("copy of the sums"))?;
        let abs = take(&b.oabs, m * g).map_err(e("copy of the sums"))?;
        let sq = take(&b.osq, m * g).map_err(e("copy of the sums"))?;
        let bad = s
            .clone_dtoh(&b.bad.as_ref().expect("begin").slice(0..m))
            .map_err(e("copy of the row flags"))?;
        s.synchronize().map_err(e("waiting for the sums"))?;
        Ok(FoldSums {
            signed,
            abs,
            sq,
            bad: bad.into_iter().map(|v| v != 0).collect(),
        })
    }
}

impl Drop for CudaFold {
    fn drop(&mut self) {
        self.unpin();
        // As `let_go_of_blas`, but waiting for this fold's stream only, not for the whole
        // context (which a Python caller's own work may share).
        if let Some(blas) = self.blas.take() {
            if self.stream.synchronize().is_ok() {
                drop(blas);
            } else {
                std::mem::forget(blas);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::kernels::ColMajor;
    use super::*;

    /// cuBLAS's GEMM by its definition, column-major: `C[i + j·ldc] += Σ_l op(X)(i, l)·op(Y)(l,
    /// j)` with X the first operand and Y the second, each at its leading dimension.
    fn cublas(cm: ColMajor, x: &[f64], y: &[f64], c: &mut [f64]) {
        let (m, n, k) = (cm.m as usize, cm.n as usize, cm.k as usize);
        let (lx, ly, lc) = (cm.ld_first as usize, cm.ld_second as usize, cm.ldc as usize);
        for j in 0..n {
            for i in 0..m {
                let mut s = 0.0;
                for l in 0..k {
                    let a = if cm.trans_first {
                        x[l + i * lx]
                    } else {
                        x[i + l * lx]
                    };
                    let b = if cm.trans_second {
                        y[j + l * ly]
                    } else {
                        y[l + j * ly]
                    };
                    s += a * b;
                }
                c[i + j * lc] += s;
            }
        }
    }

    /// The DGEMMs of a dense pass, band by band with their offsets into Z and the sums, as
    /// cuBLAS computes them, give op(A)·Z for op(A) = A and Aᵀ: what `band_gemm` and
    /// [`ColMajor`] (the arguments `gemm_ex` passes) say, checked without a GPU.
    #[test]
    fn the_band_gemms_add_up_to_op_a_times_z() {
        let (rows, cols, w, band) = (11usize, 7usize, 3usize, 4usize);
        let a: Vec<f64> = (0..rows * cols).map(|i| (i as f64 * 0.37).sin()).collect();
        for trans in [false, true] {
            // op(A): M × K.
            let (m, k) = if trans { (cols, rows) } else { (rows, cols) };
            let z: Vec<f64> = (0..k * w).map(|i| (i as f64 * 0.71).cos()).collect();
            let mut out = vec![0.0; m * w];
            for r0 in (0..rows).step_by(band) {
                let h = band.min(rows - r0);
                let wide = &a[r0 * cols..(r0 + h) * cols];
                let (g, b_off, c_off) = band_gemm(trans, r0, h, cols, w);
                // Row-major C = op(A)·op(B): B (Z from b_off) first, A (the band) second.
                cublas(ColMajor::of(&g), &z[b_off..], wide, &mut out[c_off..]);
            }
            for i in 0..m {
                for j in 0..w {
                    let want: f64 = (0..k)
                        .map(|l| {
                            let av = if trans {
                                a[l * cols + i]
                            } else {
                                a[i * cols + l]
                            };
                            av * z[l * w + j]
                        })
                        .sum();
                    let got = out[i * w + j];
                    assert!(
                        (got - want).abs() < 1e-12,
                        "trans {trans}: ({i}, {j}) {got} against {want}"
                    );
                }
            }
        }
    }
}
