//! Finding the GPUs: loading the CUDA libraries without letting cudarc panic, initialising the
//! driver, opening every GPU's primary context (each on a thread of its own, beside the
//! libraries' loading and the early start's work: [`super::early`]), and holding each GPU's
//! stream-ordered memory pool while a backend uses it.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::early::{EarlyStart, WarmSpec, Warming};
use super::kernels::{check_ptx, convert_ptx};
use super::{derr, lock};
use crate::error::{Error, Result};
use crate::seam::Precision;

/// Memory left free per GPU when `device_memory = "auto"`: cuBLAS workspaces, the CUDA context,
/// and other processes.
pub(crate) fn auto_margin(free: u64) -> u64 {
    (free / 20).max(2 << 30)
}

#[derive(Clone, Debug)]
pub(crate) struct DeviceInfo {
    pub(crate) ordinal: usize,
    pub(crate) name: String,
    pub(crate) free: u64,
    pub(crate) total: u64,
    pub(crate) cc: (i32, i32),
    /// The GPU's primary context, held open: a primary context is destroyed when its last
    /// holder lets go, and creating it again costs 0.12–0.24 s, so the probe's context is the
    /// one the backend and its lanes use.
    pub(crate) ctx: Arc<CudaContext>,
    /// The GPU's memory pool, held while a backend uses the GPU (`None` in a probe).
    pub(crate) held: Option<Arc<HeldPool>>,
    /// The GEMM whose kernel the probe is loading on this GPU ([`EarlyStart`]), on a thread of
    /// its own.
    pub(super) warming: Option<Arc<Warming>>,
    /// The GEMM shapes lanes of this backend already warmed up on this GPU: cuBLAS keeps a
    /// kernel loaded in the context, so a later run's lane of the same shape (a backend kept
    /// between library calls, `backend::kept`; a plan's next step) skips its warm-up GEMM
    /// (22 ms for 8192³ fp32 on an H100, every call of a Python loop).
    pub(super) warmed: Arc<std::sync::Mutex<Vec<WarmSpec>>>,
}

/// Check that the CUDA libraries load and list the devices, each with its primary context
/// open. Never panics.
pub(crate) fn probe() -> Result<Vec<DeviceInfo>> {
    probe_with(None)
}

/// Load the CUDA library `name` as cudarc looks for it and keep it (`load`: cudarc's loader,
/// called once the library is known to be there, so that it never panics); false if it is
/// not there. cudarc's own check (`is_culib_present`) closes what it opened, which unloaded
/// cuBLAS and cuBLASLt (hundreds of MB) only for its loader to load them again.
///
/// # Safety
/// Loads a shared library (its initialisers run), as cudarc's loaders do.
unsafe fn load_for_good(name: &str, load: impl FnOnce()) -> bool {
    for choice in cudarc::get_lib_name_candidates(name) {
        let Ok(c) = std::ffi::CString::new(choice) else {
            continue;
        };
        // SAFETY: dlopen of a NUL-terminated name with the flags libloading uses; the handle
        // is closed below, after cudarc's loader has opened the same library (found under the
        // same first name), so it stays loaded.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
        if !h.is_null() {
            load();
            unsafe { libc::dlclose(h) };
            return true;
        }
    }
    false
}

/// Whether cuBLAS and NVRTC loaded (`Err`: loading them panicked), once the thread loading
/// them is done.
#[derive(Default)]
struct LibsLoaded(
    std::sync::Mutex<Option<std::result::Result<(bool, bool), ()>>>,
    std::sync::Condvar,
);

impl LibsLoaded {
    fn set(&self, v: std::result::Result<(bool, bool), ()>) {
        *lock(&self.0) = Some(v);
        self.1.notify_all();
    }
    fn wait(&self) -> std::result::Result<(bool, bool), ()> {
        let mut g = lock(&self.0);
        loop {
            if let Some(v) = *g {
                return v;
            }
            g = self.1.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// [`probe`], starting `early`'s work as soon as the driver allows it.
///
/// Start-up is on the critical path of every run (issue 10: process wall − step wall), so the
/// independent parts overlap: cuBLAS and NVRTC (hundreds of MB of libraries) are loaded on one
/// thread while the driver initialises (`cuInit`, 0.11 s alone on an H200 host), every GPU's
/// primary context is created on a thread of its own, the prefill populates once `cuInit` is
/// done and registers from the first context on, and each GPU runs its warm-up GEMM as soon as
/// its context and cuBLAS are there.
pub(super) fn probe_with(early: Option<&EarlyStart>) -> Result<Vec<DeviceInfo>> {
    let loaded = Arc::new(LibsLoaded::default());
    let precision = early.and_then(|e| e.warm).map(|w| w.precision);
    let load = {
        let loaded = loaded.clone();
        move || {
            // Sets the latch however this ends (a panic included): the GPUs' threads wait on it.
            struct Latch(
                Arc<LibsLoaded>,
                Option<std::result::Result<(bool, bool), ()>>,
            );
            impl Drop for Latch {
                fn drop(&mut self) {
                    self.0.set(self.1.take().unwrap_or(Err(())));
                }
            }
            let mut latch = Latch(loaded, None);
            let t = std::time::Instant::now();
            // SAFETY: these only load the libraries (their initialisers run, as on any
            // dlopen) and report whether they are there; no CUDA call is made through a
            // missing library.
            let r = std::panic::catch_unwind(|| unsafe {
                (
                    load_for_good("cublas", || {
                        cudarc::cublas::sys::culib();
                    }),
                    load_for_good("nvrtc", || {
                        cudarc::nvrtc::sys::culib();
                    }),
                )
            });
            crate::trace::span(
                "start-up",
                "load cuBLAS, NVRTC",
                t,
                std::time::Instant::now(),
            );
            let rtc = matches!(r, Ok((_, true)));
            latch.1 = Some(r.map_err(|_| ()));
            drop(latch);
            // A bf16/fp16 plan's lanes load kernels/convert.cu: compiled here, beside `cuInit`
            // (17 ms of a bf16 lane's creation before, 2026-12-02 call 5); an error surfaces
            // there, when the lane compiles it again.
            if rtc && matches!(precision, Some(Precision::Bf16 | Precision::Fp16)) {
                let _ = std::panic::catch_unwind(convert_ptx);
            }
            // A tf32/bf16/fp16 lane checks the blocks it copies straight from the files'
            // pages with kernels/check.cu (crate::backend::check).
            if rtc
                && matches!(
                    precision,
                    Some(Precision::Tf32 | Precision::Bf16 | Precision::Fp16)
                )
            {
                let _ = std::panic::catch_unwind(check_ptx);
            }
        }
    };
    // Without a thread to be had, the libraries load first, then the driver starts.
    let libs = (std::thread::Builder::new().name("mgmm-cuda-libs".into()))
        .spawn(load.clone())
        .ok();
    if libs.is_none() {
        load();
    }
    let devices = probe_devices(early, &loaded);
    if let Some(h) = libs {
        let _ = h.join(); // a panic there left the latch at Err (below)
    }
    let devices = devices?;
    let Ok((blas, rtc)) = loaded.wait() else {
        return Err(Error::backend(
            "cuda",
            "loading cuBLAS and NVRTC panicked (this is a bug; please report it)",
        ));
    };
    if !blas {
        return Err(Error::backend(
            "cuda",
            "cuBLAS (libcublas.so.13) was not found; install the CUDA 13 runtime libraries",
        ));
    }
    if !rtc {
        return Err(Error::backend(
            "cuda",
            "NVRTC (libnvrtc.so.13) was not found; install the CUDA 13 runtime libraries",
        ));
    }
    Ok(devices)
}

/// The driver's devices, each with its primary context open.
fn probe_devices(early: Option<&EarlyStart>, loaded: &LibsLoaded) -> Result<Vec<DeviceInfo>> {
    // SAFETY: only attempts to dlopen the driver library and reports success.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(Error::backend("cuda", "the CUDA driver library (libcuda.so.1) was not found: no NVIDIA driver on this machine"));
    }
    let t = std::time::Instant::now();
    let n = std::panic::catch_unwind(CudaContext::device_count);
    crate::trace::span("start-up", "cuInit", t, std::time::Instant::now());
    let n = match n {
        Ok(Ok(n)) => n,
        Ok(Err(e)) => return Err(derr("cuInit/cuDeviceGetCount failed", e)),
        Err(_) => {
            return Err(Error::backend(
                "cuda",
                "the CUDA driver could not be initialised",
            ))
        }
    };
    if n <= 0 {
        return Err(Error::backend(
            "cuda",
            "the driver loaded but reports no CUDA devices",
        ));
    }
    if let Some(p) = early.and_then(|e| e.prefill.as_ref()) {
        p.start();
    }
    // One thread per GPU: creating a primary context takes ~0.14 s on an H200 and they do not
    // wait on each other (tools/probes/cuda_startup_costs.py), so N GPUs cost one context, not N.
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n as usize)
            .map(|i| {
                std::thread::Builder::new()
                    .spawn_scoped(s, move || device_info(i, early, loaded))
                    .map_err(|e| derr("cannot start a thread to open a GPU", e))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h?.join()
                    .unwrap_or_else(|_| Err(Error::backend("cuda", "device probe panicked")))
            })
            .collect()
    })
}

/// Open GPU `i`'s primary context and read what the backend needs to know about it; then
/// start registering `early`'s prefill and run its warm-up GEMM.
fn device_info(i: usize, early: Option<&EarlyStart>, loaded: &LibsLoaded) -> Result<DeviceInfo> {
    let t = std::time::Instant::now();
    let ctx = CudaContext::new(i).map_err(|e| derr(&format!("cannot open GPU {i}"), e))?;
    crate::trace::span(
        &format!("cuda:{i} lane"),
        "context",
        t,
        std::time::Instant::now(),
    );
    // Only GPUs the plan uses: a registered buffer holds its context open for the whole run.
    let early = early.filter(|e| e.devices.as_ref().is_none_or(|l| l.contains(&i)));
    if let Some(p) = early.and_then(|e| e.prefill.as_ref()) {
        p.register_with(&ctx);
    }
    let (free, total) = ctx.mem_get_info().map_err(|e| derr("cuMemGetInfo", e))?;
    let warming = (early.and_then(|e| e.warm))
        .filter(|_| loaded.wait().is_ok_and(|(blas, _)| blas))
        .map(|w| Warming::start(&ctx, i, w));
    Ok(DeviceInfo {
        ordinal: i,
        name: ctx.name().unwrap_or_else(|_| "?".into()),
        free: free as u64,
        total: total as u64,
        cc: ctx.compute_capability().unwrap_or((0, 0)),
        ctx,
        held: None,
        warming,
        warmed: Arc::default(),
    })
}

/// A GPU's current stream-ordered memory pool (where cudarc's `cuMemAllocAsync` takes device
/// buffers from), told to keep the memory freed into it while the backend lives.
///
/// By default a pool returns freed memory to the driver at the next synchronisation, which
/// cost 18 ms for the 9 GiB of 32768² fp32's slots at the end of every step (`MGMM_TRACE`,
/// docs/decisions/0011-polling-lane-and-start-group.md), on the step's critical path. Kept, a plan's later steps take their
/// buffers from the pool. Dropped (with the last backend holding it: a backend that replaces
/// one after a GPU failed shares its survivors'), the pool is trimmed and its previous release
/// threshold restored, so that a process that goes on (Python, with torch or CuPy in it) gets
/// the pool back as it was. Failing only costs time, so errors are ignored.
#[derive(Debug)]
pub(crate) struct HeldPool {
    ctx: Arc<CudaContext>,
    pool: cudarc::driver::sys::CUmemoryPool,
    old_threshold: u64,
}

// SAFETY: a memory pool handle is a driver object that may be used from any thread; every use
// here binds the pool's context first.
unsafe impl Send for HeldPool {}
unsafe impl Sync for HeldPool {}

const RELEASE_THRESHOLD: cudarc::driver::sys::CUmemPool_attribute =
    cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;

/// The pools held now, by GPU, so that backends alive at the same time (Python calls on
/// threads of their own, a failover's backend) share one [`HeldPool`]: each saving and
/// restoring the threshold on its own would restore the other's `u64::MAX` for good.
static HELD: std::sync::Mutex<Vec<(usize, std::sync::Weak<HeldPool>)>> =
    std::sync::Mutex::new(Vec::new());

impl HeldPool {
    /// The pool of `ctx`'s GPU, held: the one already held, or held now.
    pub(super) fn shared(ctx: &Arc<CudaContext>) -> Option<Arc<HeldPool>> {
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        held.retain(|(_, w)| w.strong_count() > 0);
        let ordinal = ctx.ordinal();
        if let Some(p) = held
            .iter()
            .find(|(o, _)| *o == ordinal)
            .and_then(|(_, w)| w.upgrade())
        {
            return Some(p);
        }
        let p = Arc::new(HeldPool::hold(ctx)?);
        held.push((ordinal, Arc::downgrade(&p)));
        Some(p)
    }

    fn hold(ctx: &Arc<CudaContext>) -> Option<HeldPool> {
        use cudarc::driver::result::{device, mem_pool};
        // No context is made current: the pool calls need none (a Python caller's current
        // context stays as it was).
        // SAFETY: the device comes from a live context and its current pool is valid while the
        // context is (we hold the context); the threshold attribute is a u64, by pointer.
        unsafe {
            let pool = device::get_mem_pool(ctx.cu_device()).ok()?;
            let mut old = 0u64;
            mem_pool::get_attribute(pool, RELEASE_THRESHOLD, &mut old as *mut u64 as *mut c_void)
                .ok()?;
            let mut max = u64::MAX;
            mem_pool::set_attribute(pool, RELEASE_THRESHOLD, &mut max as *mut u64 as *mut c_void)
                .ok()?;
            Some(HeldPool {
                ctx: ctx.clone(),
                pool,
                old_threshold: old,
            })
        }
    }

    /// Give the memory freed into the pool back to the driver (so that it counts as free).
    pub(super) fn trim(&self) {
        let _ = self.ctx.synchronize();
        // SAFETY: the pool is valid while `ctx` lives (see `hold`).
        let _ = unsafe { cudarc::driver::result::mem_pool::trim_to(self.pool, 0) };
    }
}

impl Drop for HeldPool {
    fn drop(&mut self) {
        self.trim();
        let mut old = self.old_threshold;
        // SAFETY: as in `hold`.
        let _ = unsafe {
            cudarc::driver::result::mem_pool::set_attribute(
                self.pool,
                RELEASE_THRESHOLD,
                &mut old as *mut u64 as *mut c_void,
            )
        };
    }
}
