//! The CUDA backend: one lane per GPU, each with its own context, three streams (H2D, GEMM,
//! D2H), one cuBLAS handle, and every device buffer allocated once at start.
//!
//! This is the only module that touches cudarc. The pipeline sees slots, accumulators and
//! tickets; here they are `CudaSlice<u8>` buffers and events:
//! - uploads run on the H2D stream from pinned host buffers (the pool allocates pinned memory
//!   through [`CudaAlloc`]), so they are true asynchronous DMA;
//! - GEMMs run on the compute stream through `cublasGemmEx` (SGEMM, TF32, bf16/fp16 inputs with
//!   fp32 accumulate, DGEMM);
//! - downloads run on the D2H stream into pinned output buffers.
//!
//! Cross-stream ordering of device buffers (upload → GEMM → reuse of the slot; GEMM → download →
//! next use of the accumulator) is enforced by cudarc's per-buffer event tracking, which is on
//! because every context here has several streams. Host buffers are untracked by cudarc: each
//! upload and download records an event, returned as the ticket, and the pipeline keeps the host
//! buffer's lease alive until that event completes.
//!
//! cudarc panics when a CUDA library is missing, so [`probe`] checks that the driver, cuBLAS and
//! NVRTC can be loaded before anything else touches them, and turns absence into an error.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    LaunchConfig, PushKernelArg,
};

use super::{Backend, Dst, GemmDesc, HostAlloc, HostBuf, HostRun, Lane, Ticket};
use crate::dtype::DType;
use crate::error::{DeviceError, Error, Result};
use crate::plan::layout::Layout;
use crate::plan::{Devices, Engine};
use crate::seam::{Caps, DeviceCheckSpec, DeviceStats, MemorySpace, Precision};
use crate::units::fmt_bytes;

const CONVERT_SRC: &str = include_str!("../../kernels/convert.cu");
const CHECK_SRC: &str = include_str!("../../kernels/check.cu");

/// kernels/check.cu compiled once per process (see [`convert_ptx`]).
fn check_ptx() -> std::result::Result<cudarc::nvrtc::Ptx, cudarc::nvrtc::CompileError> {
    static PTX: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    compiled_once(&PTX, CHECK_SRC)
}

/// kernels/convert.cu compiled once per process (NVRTC takes tens of milliseconds; every lane of
/// every bf16/fp16 step loads the same PTX).
fn convert_ptx() -> std::result::Result<cudarc::nvrtc::Ptx, cudarc::nvrtc::CompileError> {
    static PTX: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    compiled_once(&PTX, CONVERT_SRC)
}

/// `src` compiled by NVRTC the first time, its PTX kept in `cell` for every later call.
fn compiled_once(
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
    warming: Option<Arc<Warming>>,
}

/// One GPU's early warm-up GEMM ([`warm_up_early`]), which loads cuBLAS's kernel (0.15–0.2 s on
/// an H200). With tf32/bf16/fp16 it runs beside the start of the run: the backend is ready once
/// its contexts are, a lane waits for it only before its first GEMM, and the step's staging —
/// the limit at those precisions — page-locks and uploads the first blocks meanwhile (32768² on
/// one H200, five runs each interleaved: process wall 1.22–1.33 s against 1.34–1.40 with tf32,
/// 1.11–1.20 against 1.16–1.32 with bf16; BENCHMARKS §24). With fp32/fp64 the GEMMs are the
/// limit from the first one on, so a wait inside the step lands on the critical path (step
/// 1.62 s against 1.43, the process no shorter): there the warm-up finishes before the backend
/// is handed over, as before.
pub(crate) struct Warming {
    spec: WarmSpec,
    thread: std::sync::Mutex<Option<std::thread::JoinHandle<bool>>>,
    ok: std::sync::OnceLock<bool>,
}

impl std::fmt::Debug for Warming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Warming({:?}, done: {:?})", self.spec, self.ok.get())
    }
}

impl Drop for Warming {
    /// A backend let go of before any GEMM (every step already complete, an error) still waits
    /// for its warm-up: the process must not tear the driver down under a thread inside cuBLAS.
    fn drop(&mut self) {
        let h = self
            .thread
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(h) = h {
            let _ = h.join();
        }
    }
}

impl Warming {
    /// Start `w`'s warm-up GEMM on GPU `ordinal`: on a thread of its own for the tensor-core
    /// precisions, inline for fp32/fp64 (or when no thread can be had).
    fn start(ctx: &Arc<CudaContext>, ordinal: usize, w: WarmSpec) -> Arc<Warming> {
        let me = Arc::new(Warming {
            spec: w,
            thread: std::sync::Mutex::new(None),
            ok: std::sync::OnceLock::new(),
        });
        let run = {
            let ctx = ctx.clone();
            move || ctx.bind_to_thread().is_ok() && warm_up_early(&ctx, ordinal, &w).is_ok()
        };
        if matches!(w.precision, Precision::Fp32 | Precision::Fp64) {
            let _ = me.ok.set(run());
            return me;
        }
        let spawned = std::thread::Builder::new()
            .name(format!("mgmm-cuda{ordinal}-warm"))
            .spawn(run.clone());
        match spawned {
            Ok(h) => *me.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(h),
            Err(_) => {
                let _ = me.ok.set(run());
            }
        }
        me
    }

    /// Wait for the warm-up; whether it loaded the kernel.
    fn wait(&self) -> bool {
        let mut g = self.thread.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = g.take() {
            let _ = self.ok.set(h.join().unwrap_or(false));
        }
        self.ok.get().copied().unwrap_or(false)
    }
}

fn derr(what: &str, e: impl std::fmt::Display) -> Error {
    Error::backend("cuda", format!("{what}: {e}"))
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
fn probe_with(early: Option<&EarlyStart>) -> Result<Vec<DeviceInfo>> {
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
    // wait on each other (tools/gpu/startup_probe.py), so N GPUs cost one context, not N.
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
    })
}

/// One GEMM of `w`'s shape on scratch memory of GPU `ordinal`, waited for and freed: cuBLAS
/// loads the kernel it picks on its first call (0.13–0.15 s for 8192³ fp32 on an H200,
/// 2026-12-02 call 1), so done here, beside the rest of the start, the lanes need not. The
/// operands are uninitialised (A and B share one buffer: both are only read) — only the kernel
/// matters. Any failure (memory short, say) just leaves the warm-up to the lanes.
fn warm_up_early(
    ctx: &Arc<CudaContext>,
    ordinal: usize,
    w: &WarmSpec,
) -> std::result::Result<(), String> {
    let t = std::time::Instant::now();
    let track = format!("cuda:{ordinal} lane");
    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
    let blas = CudaBlas::new(stream.clone()).map_err(|e| e.to_string())?;
    crate::trace::span(&track, "early: handle", t, std::time::Instant::now());
    let (in_size, out_size) = gemm_sizes(w.precision);
    let run = || -> std::result::Result<(), String> {
        let t = std::time::Instant::now();
        // SAFETY: scratch memory, read (a) and written (c) only by the GEMM below, which fits
        // in it: A is m·k and B k·n elements, both within `a`; C m·n within `c`.
        let a = unsafe { stream.alloc::<u8>((w.m * w.k).max(w.k * w.n) * in_size) }
            .map_err(|e| e.to_string())?;
        let mut c =
            unsafe { stream.alloc::<u8>(w.m * w.n * out_size) }.map_err(|e| e.to_string())?;
        stream.synchronize().map_err(|e| e.to_string())?;
        crate::trace::span(&track, "early: scratch", t, std::time::Instant::now());
        let t = std::time::Instant::now();
        let g = GemmDesc {
            m: w.m,
            n: w.n,
            k: w.k,
            a_trans: false,
            b_trans: false,
            alpha: 1.0,
            beta: 0.0,
        };
        {
            let (pa, _ga) = a.device_ptr(&stream);
            let (pc, _gc) = c.device_ptr_mut(&stream);
            // SAFETY: the handle's stream is `stream`, where the guards record the accesses;
            // the buffers are large enough (above).
            unsafe { gemm_ex(*blas.handle(), w.precision, &g, pa, pa, pc) }
                .map_err(|e| e.to_string())?;
        }
        crate::trace::span(&track, "early: issue", t, std::time::Instant::now());
        stream.synchronize().map_err(|e| e.to_string())
    };
    let t0 = t;
    let r = run();
    let_go_of_blas(ctx, blas);
    crate::trace::span(&track, "early warm-up GEMM", t0, std::time::Instant::now());
    r
}

/// Pinned (page-locked, cached) host memory from the first selected GPU's context, with a cache
/// of freed buffers.
///
/// Pinning is slow on the H200 host: `cuMemHostAlloc` runs at about 2.2–2.6 GiB/s however many
/// threads allocate, and freeing 4.5 GiB takes 0.6 s (tools/gpu/startup_probe.py). Mapping the
/// memory ourselves in transparent huge pages, populating it, and then registering it with
/// `cuMemHostRegister` runs at 4.4–5.2 GiB/s and frees in a fifth of the time (same probe,
/// docs/measurements/2026-12-01-*.log), so that is how buffers are made ([`Registered`]);
/// `cuMemHostAlloc` remains the fallback when registering fails.
///
/// A plan of several steps or a split run of several shards would pay the pinning again for
/// every pipeline. So a buffer that is dropped goes back to the cache, and the next pipeline of
/// this backend takes buffers of the same size from there (the Python API makes a backend per
/// call, so it does not benefit). Asking for another size first frees what the cache holds, so
/// the pinned memory held never exceeds what one pipeline asked for.
pub(crate) struct CudaAlloc {
    ctx: Arc<CudaContext>,
    cache: Arc<PinnedCache>,
    /// The [`Prefill`]'s buffers until the pools of the step it was made for are made
    /// ([`HostAlloc::pools_made`] frees those no pool took).
    prefill: std::sync::Mutex<Option<Prefill>>,
    /// Allocate with `cuMemHostAlloc` rather than registering mapped memory
    /// (`MGMM_PINNED_ALLOC`, read at the edge: [`super::BackendOptions`]).
    pinned_alloc: bool,
}

/// Page-locked host memory, either kind.
enum PinnedMem {
    Registered(Registered),
    Alloc(cudarc::driver::PinnedHostSlice<u8>),
}

impl PinnedMem {
    fn len(&self) -> usize {
        match self {
            PinnedMem::Registered(r) => r.map.len(),
            PinnedMem::Alloc(p) => p.len(),
        }
    }
    fn ptr(&mut self) -> Result<*mut u8> {
        match self {
            PinnedMem::Registered(r) => Ok(r.map.as_mut_ptr()),
            PinnedMem::Alloc(p) => p.as_mut_ptr().map_err(|e| derr("pinned pointer", e)),
        }
    }
}

/// An anonymous map of our own, in transparent huge pages where the kernel gives them,
/// populated, then page-locked and made visible to every context with
/// `cuMemHostRegister(PORTABLE)`; unregistered before it is unmapped.
struct Registered {
    map: memmap2::MmapMut,
    ctx: Arc<CudaContext>,
}

/// Bytes populated per `madvise` call in [`populated_map`].
const POPULATE_PIECE: usize = 4 << 20;

/// An anonymous map of `len` bytes, in transparent huge pages where the kernel gives them
/// (without, registering is slower, not wrong).
fn huge_map(len: usize) -> std::result::Result<memmap2::MmapMut, String> {
    let map = memmap2::MmapOptions::new()
        .len(len)
        .map_anon()
        .map_err(|e| format!("anonymous map: {e}"))?;
    let _ = map.advise(memmap2::Advice::HugePage);
    Ok(map)
}

/// [`huge_map`], every page populated (`MADV_POPULATE_WRITE`), so that a lack of memory the
/// kernel reports (ENOMEM) becomes an error naming `host_memory`; without
/// `MADV_POPULATE_WRITE` (EINVAL: Linux < 5.14) the pages are touched one by one instead.
///
/// In pieces of [`POPULATE_PIECE`]: populating holds the process's memory-map lock, and the
/// driver's own `mmap` calls (stream creation, say) wait for it; one call per 256 MiB buffer
/// made the backend's start beside it take 0.92 s in one traced run (2026-12-01c call 2),
/// against 0.44–0.51 s in pieces (call 3).
fn populated_map(len: usize) -> std::result::Result<memmap2::MmapMut, String> {
    let t = std::time::Instant::now();
    let mut map = huge_map(len)?;
    let mut off = 0;
    while off < len {
        let n = POPULATE_PIECE.min(len - off);
        if let Err(e) = map.advise_range(memmap2::Advice::PopulateWrite, off, n) {
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(format!("populating the pages: {e}"));
            }
            for page in map[off..].chunks_mut(4096) {
                page[0] = 0;
            }
            break;
        }
        off += n;
    }
    crate::trace::span("pinned memory", "populate", t, std::time::Instant::now());
    Ok(map)
}

/// [`huge_map`] for a [`Prefill`], every page touched; gives up when `stop` is set between
/// pieces of [`POPULATE_PIECE`].
///
/// Touched, not populated with `MADV_POPULATE_WRITE`: a page fault takes only the lock of its
/// own mapping (Linux ≥ 6.4), while `MADV_POPULATE_WRITE` takes the process's memory-map lock,
/// which every `mmap` of `cuInit` and of the context's creation waits for. Beside the prefill,
/// 32768² fp32 on one H200 (2026-12-02 calls 2–4, docs/measurements/2026-12-02-h200-*.log):
/// populating 2.25 GiB took 0.22–0.32 s advised and 0.06–0.08 s touched; the context 0.26–0.30
/// s and 0.11–0.14 s. A fault cannot fail softly where memory runs out (nor can populating
/// reliably: the OOM killer may act first), so [`Prefill::new`] prefills only what fits in
/// half of what the process can take.
fn touched_map(len: usize, stop: &AtomicBool) -> std::result::Result<memmap2::MmapMut, String> {
    let t = std::time::Instant::now();
    let mut map = huge_map(len)?;
    for piece in map.chunks_mut(POPULATE_PIECE) {
        if stop.load(Ordering::Relaxed) {
            return Err("the prefill was called off".into());
        }
        for page in piece.chunks_mut(4096) {
            // SAFETY: a byte of our own live mapping; volatile, so that the write that makes
            // the kernel allocate the page is not optimised away.
            unsafe { std::ptr::write_volatile(page.as_mut_ptr(), 0) };
        }
    }
    crate::trace::span("pinned memory", "populate", t, std::time::Instant::now());
    Ok(map)
}

impl Registered {
    fn new(ctx: &Arc<CudaContext>, len: usize) -> std::result::Result<Registered, String> {
        Registered::register(ctx, populated_map(len)?)
    }

    /// Page-lock `map` for every context of the process.
    fn register(
        ctx: &Arc<CudaContext>,
        mut map: memmap2::MmapMut,
    ) -> std::result::Result<Registered, String> {
        let t = std::time::Instant::now();
        let len = map.len();
        ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: the range is our own live mapping of `len` bytes, registered once; it is
        // unregistered in Drop before the map is unmapped, and nothing is copied to or from it
        // after that (the pipeline waits for every copy before it drops a buffer).
        unsafe {
            cudarc::driver::sys::cuMemHostRegister_v2(
                map.as_mut_ptr() as *mut c_void,
                len,
                cudarc::driver::sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        }
        .result()
        .map_err(|e| format!("cuMemHostRegister: {e}"))?;
        crate::trace::span("pinned memory", "register", t, std::time::Instant::now());
        Ok(Registered {
            map,
            ctx: ctx.clone(),
        })
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: registered in `register`; no copy uses the range any more (see there).
        let _ = unsafe {
            cudarc::driver::sys::cuMemHostUnregister(self.map.as_mut_ptr() as *mut c_void)
        };
    }
}

/// Freed pinned allocations, by length.
#[derive(Default)]
struct PinnedCache(std::sync::Mutex<Vec<PinnedMem>>);

/// Owns a pinned allocation while a [`HostBuf`] uses it; gives it back to the cache on drop.
struct Pinned {
    mem: Option<PinnedMem>,
    cache: Arc<PinnedCache>,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if let Some(p) = self.mem.take() {
            self.cache
                .0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(p);
        }
    }
}

impl CudaAlloc {
    /// A cached buffer of exactly `len` bytes; when there is none, the cache is emptied (freed)
    /// so that the fresh allocation that follows replaces, not adds to, what is held.
    fn cached(&self, len: usize) -> Option<PinnedMem> {
        let mut c = self.cache.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = c.iter().position(|p| p.len() == len) {
            return Some(c.swap_remove(i));
        }
        let stale = std::mem::take(&mut *c);
        drop(c);
        drop(stale);
        None
    }

    /// Fresh page-locked memory: registered, or from `cuMemHostAlloc` if registering fails.
    fn fresh(&self, len: usize) -> Result<PinnedMem> {
        let mut why = String::new();
        if !self.pinned_alloc {
            match Registered::new(&self.ctx, len) {
                Ok(r) => return Ok(PinnedMem::Registered(r)),
                Err(e) => why = format!(" (registering mapped memory failed first: {e})"),
            }
        }
        // SAFETY: the memory is uninitialised bytes; every reader of a staging or output
        // buffer reads only what a fill or a download wrote first. Flags 0 = cached (not
        // write-combined: output buffers are read by the CPU) with PORTABLE so every GPU's
        // context may use it.
        unsafe {
            self.ctx
                .alloc_pinned_with_flags::<u8>(len, cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE)
        }
        .map(PinnedMem::Alloc)
        .map_err(|e| {
            derr(
                &format!(
                    "cannot allocate {} of pinned host memory (engine.host_memory){why}",
                    fmt_bytes(len as u64)
                ),
                e,
            )
        })
    }
}

/// The length of the pinned allocation that holds `bytes`: whole pages, at least one. The
/// prefill's guess must round as the allocator does, or no pool would find its buffers.
pub(crate) fn pinned_len(bytes: usize) -> usize {
    bytes.div_ceil(4096).max(1) * 4096
}

/// What a run can start before its CUDA backend is ready, as `run` guessed it from the plan
/// ([`EarlySpec`]): populating the pinned pools' memory, and each GPU's first GEMM of the
/// plan's tile shape, which loads cuBLAS's kernel.
pub(crate) struct EarlyStart {
    prefill: Option<Prefill>,
    warm: Option<WarmSpec>,
    /// The GPUs the plan lists (`None`: all), the only ones warmed up.
    devices: Option<Vec<usize>>,
}

/// What a run's first CUDA pipelines will allocate and compute, worked out from the plan before
/// the driver is up (by `run`, which has the plan and opens its inputs): the backend gets
/// these numbers, never the plan, and prepares them early ([`EarlyStart`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct EarlySpec {
    /// The byte lengths of the pinned buffers the pools will ask for, rounded as the
    /// allocator rounds them ([`pinned_len`]).
    pub(crate) pool_lens: Vec<usize>,
    /// The plan step ([`Step::order`](crate::plan::Step::order)) whose pools those are:
    /// pipelines of earlier steps leave the buffers for it ([`HostAlloc::pools_made`]).
    pub(crate) step: (usize, usize),
    /// Threads that may populate the buffers.
    pub(crate) threads: usize,
    /// That step's GEMM tile (m, n, k) and precision: each GPU's warm-up GEMM.
    pub(crate) tile: (usize, usize, usize),
    pub(crate) precision: Precision,
    /// The GPUs the plan lists (`None`: all), the only ones warmed up.
    pub(crate) devices: Option<Vec<usize>>,
}

/// A GEMM shape and precision whose cuBLAS kernel a GPU has loaded (a lane of that tile shape
/// skips its own warm-up GEMM).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WarmSpec {
    m: usize,
    n: usize,
    k: usize,
    precision: Precision,
}

impl EarlyStart {
    /// The start that `spec` describes (worked out from the plan by `run`, before the driver
    /// is up); `pinned_alloc`: no prefill, the pools' buffers come from `cuMemHostAlloc`.
    pub(crate) fn new(spec: EarlySpec, pinned_alloc: bool) -> EarlyStart {
        let (m, n, k) = spec.tile;
        EarlyStart {
            prefill: Prefill::new(spec.pool_lens, spec.threads, spec.step, pinned_alloc),
            warm: Some(WarmSpec {
                m,
                n,
                k,
                precision: spec.precision,
            }),
            devices: spec.devices,
        }
    }
}

/// Host memory populated for a run's pinned pools while the driver starts, then registered
/// with it ([`EarlyStart`]). The pools take the buffers by size; those no pool took are freed
/// once the first pipeline's pools are made. Dropped before that (`auto` fell back to the
/// CPU), it calls the populating off at its next 4 MiB piece and frees what it made.
///
/// Populating starts once `cuInit` is done ([`Prefill::start`]): `cuInit` — many `mmap`s —
/// took 0.45–0.63 s with the populating (then `MADV_POPULATE_WRITE`, which holds the process's
/// memory-map lock) and the libraries' loading beside it, against 0.11 s alone (32768² fp32 on
/// one H200, 2026-12-02 call 1). Since the pages are touched instead ([`touched_map`]), starting
/// before `cuInit` measured the same (call 4); after it stays, for kernels older than 6.4, where
/// a fault takes that lock too. Registering starts with the first context of a GPU the plan
/// uses ([`Prefill::register_with`]), a buffer as soon as it is populated.
pub(crate) struct Prefill {
    lens: Vec<usize>,
    /// The plan step whose pools were guessed: pipelines of earlier steps leave the buffers
    /// for it ([`HostAlloc::pools_made`]).
    step: (usize, usize),
    threads: usize,
    stop: Arc<AtomicBool>,
    workers: std::sync::Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// Populated maps, from the workers to the registering thread.
    tx: std::sync::Mutex<Option<crossbeam_channel::Sender<memmap2::MmapMut>>>,
    rx: std::sync::Mutex<Option<crossbeam_channel::Receiver<memmap2::MmapMut>>>,
    registered: Arc<PinnedCache>,
    registering: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Prefill {
    /// Buffers of `lens` bytes, to be populated on at most `threads` threads once started.
    /// `None`: nothing to do, more than half of the memory the process can take (the host's
    /// `MemAvailable`, or its memory cgroup's headroom: a guess must not run the process out
    /// of memory — [`touched_map`]), or `pinned_alloc` (`MGMM_PINNED_ALLOC=1`).
    pub(crate) fn new(
        lens: Vec<usize>,
        threads: usize,
        step: (usize, usize),
        pinned_alloc: bool,
    ) -> Option<Prefill> {
        let total: usize = lens.iter().sum();
        let fits = crate::store::fsutil::memory_headroom().is_some_and(|m| total as u64 <= m / 2);
        if lens.is_empty() || !fits || pinned_alloc {
            return None;
        }
        let (tx, rx) = crossbeam_channel::unbounded();
        Some(Prefill {
            lens,
            step,
            threads: threads.max(1),
            stop: Arc::default(),
            workers: Default::default(),
            tx: std::sync::Mutex::new(Some(tx)),
            rx: std::sync::Mutex::new(Some(rx)),
            registered: Arc::default(),
            registering: Default::default(),
        })
    }

    /// Start populating (once), on threads of their own, not the rayon pool: the pools'
    /// allocation runs on rayon workers and waits for this work ([`Prefill::await_registered`]),
    /// so jobs of it queued on those workers could never run (with `threads = 1`, they never
    /// did: the first version hung so).
    fn start(&self) {
        let Some(tx) = lock(&self.tx).take() else {
            return;
        };
        let per = self.lens.len().div_ceil(self.threads);
        let mut workers = lock(&self.workers);
        for c in self.lens.chunks(per) {
            let (c, stop, tx) = (c.to_vec(), self.stop.clone(), tx.clone());
            let job = move || {
                for &len in &c {
                    let Ok(m) = touched_map(len, &stop) else {
                        return;
                    };
                    if tx.send(m).is_err() {
                        return;
                    }
                }
            };
            // Fewer threads, fewer buffers: the pools make the rest.
            match std::thread::Builder::new()
                .name("mgmm-prefill".into())
                .spawn(job)
            {
                Ok(h) => workers.push(h),
                Err(_) => break,
            }
        }
    }

    /// Register the populated buffers with `ctx` (once) on a thread of its own, each as soon
    /// as it is ready; registered memory is portable, so any GPU's context will do.
    fn register_with(&self, ctx: &Arc<CudaContext>) {
        let Some(rx) = lock(&self.rx).take() else {
            return;
        };
        let (ctx, into) = (ctx.clone(), self.registered.clone());
        let job = move || {
            for map in rx {
                if let Ok(r) = Registered::register(&ctx, map) {
                    lock(&into.0).push(PinnedMem::Registered(r));
                }
            }
        };
        if let Ok(h) = std::thread::Builder::new()
            .name("mgmm-register".into())
            .spawn(job)
        {
            *lock(&self.registering) = Some(h);
        }
    }

    /// Wait until every buffer is populated and registered (if registering started).
    fn await_registered(&self) {
        if let Some(h) = lock(&self.registering).take() {
            let _ = h.join();
        }
    }

    /// A registered buffer of exactly `len` bytes.
    fn take(&self, len: usize) -> Option<PinnedMem> {
        let mut c = lock(&self.registered.0);
        let i = c.iter().position(|p| p.len() == len)?;
        Some(c.swap_remove(i))
    }
}

impl Drop for Prefill {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        drop(lock(&self.tx).take());
        // Without a registering thread the maps are dropped as they are sent, or the send
        // fails: either way the workers end.
        drop(lock(&self.rx).take());
        for h in lock(&self.workers).drain(..) {
            let _ = h.join();
        }
        self.await_registered();
    }
}

impl CudaAlloc {
    fn new(ctx: Arc<CudaContext>, prefill: Option<Prefill>, pinned_alloc: bool) -> CudaAlloc {
        CudaAlloc {
            ctx,
            cache: Arc::default(),
            prefill: std::sync::Mutex::new(prefill),
            pinned_alloc,
        }
    }

    /// A prefilled buffer of exactly `len` bytes, once the prefill's buffers are registered.
    fn prefilled(&self, len: usize) -> Option<PinnedMem> {
        let p = lock(&self.prefill);
        let p = p.as_ref()?;
        p.await_registered();
        p.take(len)
    }
}

impl Drop for CudaAlloc {
    fn drop(&mut self) {
        // The registering thread uses the context: it ends before the backend lets go of it.
        drop(lock(&self.prefill).take());
    }
}

impl HostAlloc for CudaAlloc {
    fn alloc_host(&self, bytes: usize) -> Result<HostBuf> {
        let len = pinned_len(bytes);
        let mut p = match self.prefilled(len).or_else(|| self.cached(len)) {
            Some(p) => p,
            None => self.fresh(len)?,
        };
        let ptr = p.ptr()?;
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::backend("cuda", "null pinned pointer"))?;
        let owner = Pinned {
            mem: Some(p),
            cache: self.cache.clone(),
        };
        // SAFETY: the pinned allocation lives as long as the owner box, which the HostBuf keeps
        // (dropping the owner returns it to the cache, where nobody uses it until it is handed
        // out again); it is `len >= bytes` long.
        Ok(unsafe { HostBuf::from_raw(ptr, bytes, Box::new(owner)) })
    }
    /// The same context and cache of released buffers, without the prefill (whose buffers
    /// the pools made up front take).
    fn shared(&self) -> Option<Arc<dyn HostAlloc>> {
        Some(Arc::new(CudaAlloc {
            ctx: self.ctx.clone(),
            cache: self.cache.clone(),
            prefill: std::sync::Mutex::new(None),
            pinned_alloc: self.pinned_alloc,
        }))
    }
    fn pools_made(&self, step: (usize, usize)) {
        let mut p = lock(&self.prefill);
        // A chain's first part has tiny pools; the prefill was made for a later step's.
        if p.as_ref().is_some_and(|p| step >= p.step) {
            drop(p.take());
        }
    }
}

// SAFETY: PinnedHostSlice is Send + Sync in cudarc, and so are MmapMut and Arc<CudaContext>
// (a registered map); `Pinned` never hands out a slice of either (the HostBuf holds the raw
// pointer, and the pipeline gives each buffer to one stage at a time); the wrapper and the
// cache add only a Mutex.
unsafe impl Send for Pinned {}
unsafe impl Sync for Pinned {}
unsafe impl Send for PinnedCache {}
unsafe impl Sync for PinnedCache {}

/// A GPU's current stream-ordered memory pool (where cudarc's `cuMemAllocAsync` takes device
/// buffers from), told to keep the memory freed into it while the backend lives.
///
/// By default a pool returns freed memory to the driver at the next synchronisation, which
/// cost 18 ms for the 9 GiB of 32768² fp32's slots at the end of every step (`MGMM_TRACE`,
/// BENCHMARKS.md §14), on the step's critical path. Kept, a plan's later steps take their
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
    fn shared(ctx: &Arc<CudaContext>) -> Option<Arc<HeldPool>> {
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
    fn trim(&self) {
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

/// Every chosen GPU as one backend: a lane per GPU, pinned host memory from the first GPU's
/// context (portable, so every lane may DMA from it).
pub(crate) struct CudaBackend {
    engine: Engine,
    devices: Vec<DeviceInfo>,
    alloc: CudaAlloc,
    threads: usize,
    caps: Caps,
}

/// `staging = "auto"` copies inputs on this many GPUs or more ([`Caps::staging`] says why).
pub(crate) const AUTO_COPIES_FROM: usize = 2;

const GPU_TILES: &[u64] = &[
    8192, 6144, 4096, 3072, 2048, 1536, 1024, 768, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1,
];

/// H200 cuBLAS rates measured in docs/GPU.md, per GPU.
fn h200_peak(p: Precision, lanes: usize) -> f64 {
    let per = match p {
        Precision::Fp32 => 54e12,
        Precision::Tf32 => 350e12,
        Precision::Bf16 | Precision::Fp16 => 700e12,
        Precision::Fp64 => 60e12,
    };
    per * lanes as f64
}

/// What the CUDA backend offers with `lanes` GPUs of `device_memory` bytes each.
pub(crate) fn cuda_caps(lanes: usize, device_memory: u64) -> Caps {
    Caps {
        kind: "cuda",
        memory: MemorySpace::Device,
        tile_ladder: GPU_TILES,
        staging_depth: 6,
        extra_out_buf: true,
        auto_copies_from: AUTO_COPIES_FROM,
        lanes,
        device_memory,
        narrow_slots: true,
        link_names: ("H2D", "D2H"),
        link_rate: Some(55e9),
        peak_flops: h200_peak,
        peak_source: "H200 cuBLAS rates measured in docs/GPU.md",
    }
}

fn choose(engine: &Engine, devs: &[DeviceInfo]) -> Result<Vec<DeviceInfo>> {
    match &engine.devices {
        Devices::All => Ok(devs.to_vec()),
        Devices::List(l) => l
            .iter()
            .map(|&i| {
                devs.iter()
                    .find(|d| d.ordinal == i as usize)
                    .cloned()
                    .ok_or_else(|| {
                        Error::backend(
                            "cuda",
                            format!(
                                "engine.devices lists GPU {i}, but only {} GPU(s) exist (0..{})",
                                devs.len(),
                                devs.len()
                            ),
                        )
                    })
            })
            .collect(),
    }
}

impl CudaBackend {
    /// The backend over the GPUs `engine` asks for, with `early`'s work started as the
    /// driver comes up and its prefilled memory adopted (freed on error); `pinned_alloc`: see
    /// [`super::BackendOptions`].
    pub(crate) fn select(
        engine: &Engine,
        early: Option<EarlyStart>,
        pinned_alloc: bool,
    ) -> Result<CudaBackend> {
        let devs = probe_with(early.as_ref())?;
        let chosen = choose(engine, &devs)?;
        let prefill = early.and_then(|e| e.prefill);
        CudaBackend::from_devices(engine, chosen, None, prefill, pinned_alloc)
    }

    /// The backend over `chosen` (opened GPUs), their pools held. `device_memory`: the budget
    /// per GPU when it is already fixed (a failover: the steps' layouts were sized from it),
    /// else from `engine` and the GPUs' free memory.
    fn from_devices(
        engine: &Engine,
        mut chosen: Vec<DeviceInfo>,
        device_memory: Option<u64>,
        prefill: Option<Prefill>,
        pinned_alloc: bool,
    ) -> Result<CudaBackend> {
        for d in &mut chosen {
            if d.held.is_none() {
                d.held = HeldPool::shared(&d.ctx);
            }
        }
        // A GPU listed twice runs two lanes, each with `device_memory` of its own: the free
        // memory is shared between them.
        let share = (chosen.iter())
            .map(|d| chosen.iter().filter(|e| e.ordinal == d.ordinal).count() as u64)
            .max()
            .unwrap_or(1);
        let min_free = chosen.iter().map(|d| d.free).min().unwrap_or(0);
        let device_memory = match (device_memory, engine.device_memory) {
            (Some(fixed), _) => fixed,
            (None, Some(b)) => {
                if b.saturating_mul(share) > min_free {
                    let per = if share > 1 {
                        format!(" for each of the {share} lanes of a GPU listed {share} times")
                    } else {
                        String::new()
                    };
                    return Err(Error::backend(
                        "cuda",
                        format!("engine.device_memory = {}{per} but GPU(s) have only {} free; lower it or use \"auto\"", fmt_bytes(b), fmt_bytes(min_free)),
                    ));
                }
                b
            }
            (None, None) => min_free.saturating_sub(auto_margin(min_free)) / share,
        };
        let ctx0 = chosen[0].ctx.clone();
        let alloc = CudaAlloc::new(ctx0, prefill, pinned_alloc);
        Ok(CudaBackend {
            engine: engine.clone(),
            threads: super::resolve_threads(engine.threads),
            alloc,
            caps: cuda_caps(chosen.len(), device_memory),
            devices: chosen,
        })
    }
}

impl HostAlloc for CudaBackend {
    fn alloc_host(&self, bytes: usize) -> Result<HostBuf> {
        self.alloc.alloc_host(bytes)
    }
    fn pools_made(&self, step: (usize, usize)) {
        self.alloc.pools_made(step)
    }
    fn shared(&self) -> Option<Arc<dyn HostAlloc>> {
        self.alloc.shared()
    }
    /// Registration of read-only file maps, where every GPU of the backend supports it
    /// (`CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED`; the H200s here do).
    fn input_pinner(&self) -> Option<Arc<dyn super::InputPinner>> {
        use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED as RO;
        let all = self
            .devices
            .iter()
            .all(|d| d.ctx.attribute(RO).is_ok_and(|v| v != 0));
        all.then(|| {
            Arc::new(FilePinner {
                ctx: self.alloc.ctx.clone(),
            }) as Arc<dyn super::InputPinner>
        })
    }
}

/// Page-locks parts of read-only file maps for every context of the process
/// (`cuMemHostRegister` with `PORTABLE | READ_ONLY`), for [`crate::pipeline::direct`].
struct FilePinner {
    ctx: Arc<CudaContext>,
}

impl super::InputPinner for FilePinner {
    fn register(&self, ptr: *const u8, len: usize) -> std::result::Result<(), String> {
        use cudarc::driver::sys::{CU_MEMHOSTREGISTER_PORTABLE, CU_MEMHOSTREGISTER_READ_ONLY};
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: the caller passes a page-aligned range inside a live read-only map, which it
        // unregisters (below) before the map can be unmapped; devices only read from it.
        unsafe {
            cudarc::driver::sys::cuMemHostRegister_v2(
                ptr as *mut c_void,
                len,
                CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_READ_ONLY,
            )
        }
        .result()
        .map_err(|e| format!("cuMemHostRegister: {e}"))
    }
    fn unregister(&self, ptr: *const u8) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: registered by `register`; the caller guarantees no copy uses it any more.
        let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(ptr as *mut c_void) };
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        self.devices
            .iter()
            .map(|d| format!("cuda:{} {}", d.ordinal, d.name))
            .collect::<Vec<_>>()
            .join(" + ")
    }
    fn caps(&self) -> &Caps {
        &self.caps
    }
    fn threads(&self) -> usize {
        self.threads
    }
    fn lanes(&self, layout: &Layout, p: Precision) -> Result<Vec<Box<dyn Lane>>> {
        // One thread per GPU: streams, device buffers and the cuBLAS handle of one GPU do not
        // wait for another's.
        std::thread::scope(|s| {
            let handles: Vec<_> = (self.devices.iter().enumerate())
                .map(|(i, d)| s.spawn(move || CudaLane::new(i, d, layout, p)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    let lane = h.join().unwrap_or_else(|_| {
                        Err(Error::backend("cuda", "creating a GPU lane panicked"))
                    })?;
                    Ok(Box::new(lane) as Box<dyn Lane>)
                })
                .collect()
        })
    }
    fn without(&self, lane: usize) -> Option<Result<Box<dyn Backend>>> {
        if self.devices.len() <= 1 || lane >= self.devices.len() {
            return None;
        }
        // The GPUs left, with their open contexts and held pools; the failed one is not
        // touched again (after some errors its context is unusable, and a fresh probe of
        // every GPU would fail on it; a GPU listed twice keeps its other lane, whose context
        // is the same one, so that lane goes on only after a failure that spared it). Their
        // free memory is measured again, with what the pools kept given back first; the
        // device budget stays the one the steps' layouts were sized from (the contexts'
        // loaded libraries now take some of the free memory).
        let rest: Vec<DeviceInfo> = (self.devices.iter().enumerate())
            .filter(|&(i, _)| i != lane)
            .map(|(_, d)| {
                let mut d = d.clone();
                if let Some(h) = &d.held {
                    h.trim();
                }
                if let Ok((free, _)) = d.ctx.mem_get_info() {
                    d.free = free as u64;
                }
                d
            })
            .collect();
        let engine = Engine {
            devices: Devices::List(rest.iter().map(|d| d.ordinal as u32).collect()),
            ..self.engine.clone()
        };
        let fixed = Some(self.caps.device_memory);
        Some(
            CudaBackend::from_devices(&engine, rest, fixed, None, self.alloc.pinned_alloc)
                .map(|b| Box::new(b) as Box<dyn Backend>),
        )
    }
}

/// Bytes per element of a GEMM's inputs and of its output in precision `p`.
fn gemm_sizes(p: Precision) -> (usize, usize) {
    match p {
        Precision::Fp32 | Precision::Tf32 => (4, 4),
        Precision::Bf16 | Precision::Fp16 => (2, 4),
        Precision::Fp64 => (8, 8),
    }
}

/// Row-major `C = alpha·op(A)·op(B) + beta·C` for `g` in precision `p`, through
/// `cublasGemmEx` (SGEMM, TF32, bf16/fp16 inputs with fp32 accumulate, DGEMM).
///
/// # Safety
/// `a`, `b` and `c` must be device pointers of `handle`'s context holding at least `g.m·g.k`,
/// `g.k·g.n` and `g.m·g.n` elements of [`gemm_sizes`]`(p)`, with nothing else writing them
/// before the GEMM on `handle`'s stream is done.
unsafe fn gemm_ex(
    handle: blas_sys::cublasHandle_t,
    p: Precision,
    g: &GemmDesc,
    a: cudarc::driver::sys::CUdeviceptr,
    b: cudarc::driver::sys::CUdeviceptr,
    c: cudarc::driver::sys::CUdeviceptr,
) -> std::result::Result<(), blas_result::CublasError> {
    use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
    use blas_sys::cudaDataType::*;
    let (m, n, k) = (g.m as i32, g.n as i32, g.k as i32);
    // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: pass B first.
    let transa = if g.b_trans { CUBLAS_OP_T } else { CUBLAS_OP_N };
    let lda = if g.b_trans { k } else { n };
    let transb = if g.a_trans { CUBLAS_OP_T } else { CUBLAS_OP_N };
    let ldb = if g.a_trans { m } else { k };
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
        Precision::Fp64 => (
            CUDA_R_64F,
            CUDA_R_64F,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_64F,
        ),
    };
    let (a32, b32) = (g.alpha as f32, g.beta as f32);
    let (a64, b64) = (g.alpha, g.beta);
    let (pa, pb): (*const c_void, *const c_void) = if p == Precision::Fp64 {
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
            n,
            m,
            k,
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
            n,
            compute,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    H2d,
    D2h,
}

/// Let go of a cuBLAS handle without letting a broken context turn into a panic: cudarc's
/// `CudaBlas` unwraps `cublasDestroy` in its Drop, which fails on a context that took an error
/// (an illegal address, an ECC error). There the handle is leaked (with the stream and the
/// context retain it holds: the GPU is unusable anyway); on a healthy context it is dropped.
fn let_go_of_blas(ctx: &CudaContext, blas: CudaBlas) {
    if ctx.synchronize().is_ok() {
        drop(blas);
    } else {
        std::mem::forget(blas);
    }
}

pub(crate) struct CudaLane {
    ordinal: usize,
    name: String,
    ctx: Arc<CudaContext>,
    h2d: Arc<CudaStream>,
    comp: Arc<CudaStream>,
    d2h: Arc<CudaStream>,
    blas: Option<CudaBlas>,
    /// The probe's warm-up GEMM of this lane's tile shape, waited for before the first GEMM.
    warming: Option<Arc<Warming>>,
    slots: Vec<CudaSlice<u8>>,
    accs: Vec<CudaSlice<u8>>,
    landing: Vec<CudaSlice<u8>>,
    next_landing: usize,
    convert: Option<CudaFunction>,
    /// kernels/check.cu's `check_tiles`, when it compiled and loaded; without it the host
    /// checks directly uploaded blocks ([`super::check`]).
    check: Option<CudaFunction>,
    /// What the last `upload_runs` wrote, for its check: the landing buffer it went through
    /// (bf16/fp16) or else the slot, and its bytes.
    last_upload: Option<(Option<usize>, usize, usize)>,
    /// Where checks put their results, made at the first check.
    check_bufs: Option<CheckBufs>,
    precision: Precision,
    host_dt: DType,
    dev_dt: DType,
    tickets: HashMap<u64, (CudaEvent, CudaEvent, Kind, u64)>,
    next_ticket: u64,
    gemm_events: VecDeque<(CudaEvent, CudaEvent)>,
    stats: DeviceStats,
    /// With a timeline being recorded ([`crate::trace`]): an event that completed at a known
    /// host instant, so that device-timed GEMMs and copies can be placed on the host clock.
    clock: Option<(CudaEvent, std::time::Instant)>,
    /// Index of this lane in the backend's lane list (for [`Error::Device`]).
    lane: usize,
}

// SAFETY: the lane is moved to its own thread once and used only there; cudarc's handles are
// Send, and CudaBlas is Send + Sync.
unsafe impl Send for CudaLane {}

/// Checks a lane may have in flight at once (staging's check queue holds 64, plus the blocks
/// being copied); a check beyond them is left to the host.
const CHECK_RING: usize = 128;
use super::check::MAX_TILES as CHECK_MAX_TILES;

/// Where a lane's checks ([`super::check`]) put their results: `[crc, count]` per storage
/// tile, written by the kernel into `dev`, copied into the page-locked `ring._host`, one region
/// of `CHECK_MAX_TILES` pairs per check in flight.
struct CheckBufs {
    dev: CudaSlice<u32>,
    ring: Arc<CheckRing>,
}

/// The page-locked half of [`CheckBufs`] and which of its regions are free; shared with the
/// checks in flight, which give their region back when dropped.
struct CheckRing {
    _host: cudarc::driver::PinnedHostSlice<u32>,
    /// `host`'s address, taken once when nothing was using it.
    ptr: usize,
    free: std::sync::Mutex<Vec<usize>>,
}

/// A check queued on a lane's H2D stream: its region of the ring and the event after the copy
/// of its results into it.
struct CudaCheck {
    ring: Arc<CheckRing>,
    region: usize,
    tiles: usize,
    /// Recorded once the check and its copy are queued (`None` until then).
    done: Option<CudaEvent>,
}

impl super::check::DeviceCheck for CudaCheck {
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

fn timing() -> Option<CUevent_flags> {
    Some(CUevent_flags::CU_EVENT_DEFAULT)
}

impl CudaLane {
    fn new(lane: usize, d: &DeviceInfo, l: &Layout, precision: Precision) -> Result<CudaLane> {
        let ordinal = d.ordinal;
        let name = format!("cuda:{ordinal}");
        let e = |what: &str| {
            let name = name.clone();
            let what = what.to_string();
            move |err: cudarc::driver::DriverError| {
                Error::device(lane, name.clone(), what.clone(), err)
            }
        };
        let track = format!("cuda:{ordinal} lane");
        let t = std::time::Instant::now();
        // The backend holds the GPU's primary context open, so this only retains it; the lane
        // has a handle of its own so that errors cudarc records on one (in a Drop, say)
        // surface in this lane's calls, not in another lane's or step's.
        let ctx = CudaContext::new(ordinal).map_err(e("cannot open context"))?;
        ctx.bind_to_thread().map_err(e("cannot use context"))?;
        let h2d = ctx.new_stream().map_err(e("cannot create stream"))?;
        let comp = ctx.new_stream().map_err(e("cannot create stream"))?;
        let d2h = ctx.new_stream().map_err(e("cannot create stream"))?;
        let alloc = |n: usize, count: usize, what: &str| -> Result<Vec<CudaSlice<u8>>> {
            (0..count)
                .map(|i| {
                    // SAFETY: device memory is uninitialised; every slot/accumulator is written
                    // (upload or GEMM with beta = 0) before it is read.
                    unsafe { comp.alloc::<u8>(n.max(1)) }.map_err(|err| {
                        Error::device(
                            lane,
                            name.clone(),
                            format!(
                                "cannot allocate {what} {} of {count} ({} each, {} in all for this GPU; lower engine.device_memory or engine.tile)",
                                i + 1,
                                fmt_bytes(n as u64),
                                fmt_bytes(l.device_bytes)
                            ),
                            err,
                        )
                    })
                })
                .collect()
        };
        crate::trace::span(&track, "streams", t, std::time::Instant::now());
        // The device buffers, and on a thread of its own the cuBLAS handle and the conversion
        // kernel (library loads, 90–100 ms on an H200), which do not need the buffers.
        // The cuBLAS handle and the conversion and check kernels.
        type Libs = (CudaBlas, (Option<CudaFunction>, Option<CudaFunction>));
        let libs = || -> Result<Libs> {
            let t = std::time::Instant::now();
            ctx.bind_to_thread().map_err(e("cannot use context"))?;
            let blas = CudaBlas::new(comp.clone())
                .map_err(|err| Error::device(lane, name.clone(), "cuBLAS handle", err))?;
            crate::trace::span(&track, "cuBLAS handle", t, std::time::Instant::now());
            let t = std::time::Instant::now();
            let convert = || -> Result<Option<CudaFunction>> {
                Ok(match precision {
                    Precision::Bf16 | Precision::Fp16 => {
                        let ptx = convert_ptx().map_err(|err| {
                            Error::device(
                                lane,
                                name.clone(),
                                "NVRTC failed on kernels/convert.cu",
                                err,
                            )
                        })?;
                        let module = ctx
                            .load_module(ptx)
                            .map_err(e("cannot load kernels/convert.cu"))?;
                        let f = if precision == Precision::Bf16 {
                            "f32_to_bf16"
                        } else {
                            "f32_to_f16"
                        };
                        Some(
                            module
                                .load_function(f)
                                .map_err(e("cannot find conversion kernel"))?,
                        )
                    }
                    _ => None,
                })
            };
            let convert = convert();
            // The checks' kernel, for the tensor-core precisions only: there the GEMMs leave
            // the GPU idle most of a step while the host is the limit; with fp32/fp64 the
            // GEMMs are the limit, and checks queued between the copies delayed them (32768²
            // fp32: 1.492 s against 1.427 s), while the host has time to spare (§23). A lane
            // without it lets the host check (no error).
            let tensor = matches!(
                precision,
                Precision::Tf32 | Precision::Bf16 | Precision::Fp16
            );
            let check = match (&convert, l.host_dt) {
                (Ok(_), DType::F32) if tensor => check_ptx()
                    .ok()
                    .and_then(|ptx| ctx.load_module(ptx).ok())
                    .and_then(|m| m.load_function("check_tiles").ok()),
                _ => None,
            };
            crate::trace::span(&track, "kernels", t, std::time::Instant::now());
            match convert {
                Ok(c) => Ok((blas, (c, check))),
                Err(err) => {
                    let_go_of_blas(&ctx, blas);
                    Err(err)
                }
            }
        };
        let bufs = || -> Result<_> {
            let t = std::time::Instant::now();
            let slots = alloc(l.slot_bytes as usize, l.slots, "tile-cache slot")?;
            let accs = alloc(l.acc_bytes as usize, l.accs, "accumulator")?;
            let landing = alloc(l.landing_bytes as usize, l.landing, "landing buffer")?;
            ctx.synchronize()
                .map_err(e("synchronize after allocation"))?;
            crate::trace::span(&track, "device buffers", t, std::time::Instant::now());
            Ok((slots, accs, landing))
        };
        let (bufs, libs) = std::thread::scope(|s| {
            let libs = s.spawn(libs);
            let bufs = bufs();
            let libs = libs.join().unwrap_or_else(|_| {
                Err(Error::backend(
                    "cuda",
                    "loading cuBLAS for a GPU lane panicked",
                ))
            });
            (bufs, libs)
        });
        let ((slots, accs, landing), (blas, (convert, check))) = match (bufs, libs) {
            (Ok(b), Ok(l)) => (b, l),
            (Err(e), Ok((blas, _))) => {
                let_go_of_blas(&ctx, blas);
                return Err(e);
            }
            (Err(e), Err(_)) | (Ok(_), Err(e)) => return Err(e),
        };
        ctx.bind_to_thread().map_err(e("cannot use context"))?;
        let mut lane = CudaLane {
            ordinal,
            name: format!("cuda:{ordinal} {}", ctx.name().unwrap_or_default()),
            ctx,
            h2d,
            comp,
            d2h,
            blas: Some(blas),
            warming: None,
            slots,
            accs,
            landing,
            next_landing: 0,
            convert,
            check,
            last_upload: None,
            check_bufs: None,
            precision,
            host_dt: l.host_dt,
            dev_dt: l.dev_dt,
            tickets: HashMap::new(),
            next_ticket: 1,
            gemm_events: VecDeque::new(),
            stats: DeviceStats::default(),
            clock: None,
            lane,
        };
        let shape = WarmSpec {
            m: l.tm as usize,
            n: l.tn as usize,
            k: l.tk as usize,
            precision,
        };
        match &d.warming {
            // The probe is loading this shape's kernel: the first GEMM waits for it.
            Some(w) if w.spec == shape => lane.warming = Some(w.clone()),
            _ => {
                let t = std::time::Instant::now();
                lane.warm_up(l)?;
                crate::trace::span(&track, "warm-up GEMM", t, std::time::Instant::now());
            }
        }
        if crate::trace::enabled() {
            let ev = lane
                .comp
                .record_event(timing())
                .map_err(|e| lane.err("event", e))?;
            ev.synchronize().map_err(|e| lane.err("event wait", e))?;
            lane.clock = Some((ev, std::time::Instant::now()));
        }
        Ok(lane)
    }

    /// One full-tile GEMM on zeroed buffers, waited for, then forgotten. cuBLAS loads the
    /// kernels it picks lazily, on their first call; without this the pipeline's first GEMM
    /// waited for that load (the first GEMM of 32768² fp32 on one H200 was issued 0.25 s after
    /// the stages started, while its two tiles take about 0.05 s to read and upload), and the
    /// stages behind it stalled. Tiles of other shapes (edges) and transposed operands may
    /// still load a kernel on first use. Skipped when the probe already ran this tile shape
    /// ([`warm_up_early`]), which moves the load off the lanes' creation.
    fn warm_up(&mut self, l: &Layout) -> Result<()> {
        let (dev, host) = (self.dev_dt.size() as u64, self.host_dt.size() as u64);
        let fits = l.tm * l.tk * dev <= l.slot_bytes
            && l.tk * l.tn * dev <= l.slot_bytes
            && l.tm * l.tn * host <= l.acc_bytes;
        if !fits || self.slots.is_empty() || self.accs.is_empty() {
            return Ok(());
        }
        let b_slot = 1.min(self.slots.len() - 1);
        for i in [0, b_slot] {
            self.comp
                .memset_zeros(&mut self.slots[i])
                .map_err(|e| self.err("zero a slot", e))?;
        }
        let desc = GemmDesc {
            m: l.tm as usize,
            n: l.tn as usize,
            k: l.tk as usize,
            a_trans: false,
            b_trans: false,
            alpha: 1.0,
            beta: 0.0,
        };
        let t = std::time::Instant::now();
        self.gemm(&desc, 0, b_slot, 0)?;
        let track = format!("cuda:{} lane", self.ordinal);
        crate::trace::span(&track, "warm-up: issue", t, std::time::Instant::now());
        self.comp
            .synchronize()
            .map_err(|e| self.err("synchronize after warm-up GEMM", e))?;
        self.gemm_events.clear();
        self.stats = DeviceStats::default();
        Ok(())
    }

    fn err(&self, what: &str, e: impl Into<DeviceError>) -> Error {
        Error::device(self.lane, format!("cuda:{}", self.ordinal), what, e)
    }

    fn ticket(&mut self, start: CudaEvent, end: CudaEvent, kind: Kind, bytes: u64) -> Ticket {
        let t = self.next_ticket;
        self.next_ticket += 1;
        self.tickets.insert(t, (start, end, kind, bytes));
        Ticket(t)
    }

    /// Put the device-timed interval from `s` to `e` (both complete) on the timeline.
    fn trace(&self, what: &str, s: &CudaEvent, e: &CudaEvent) {
        let Some((base, at)) = &self.clock else {
            return;
        };
        let (Ok(a), Ok(b)) = (base.elapsed_ms(s), base.elapsed_ms(e)) else {
            return;
        };
        let t = |ms: f32| *at + std::time::Duration::from_secs_f64((ms as f64 * 1e-3).max(0.0));
        crate::trace::span(&format!("cuda:{} {what}", self.ordinal), what, t(a), t(b));
    }

    fn finish_ticket(&mut self, t: u64) -> Result<()> {
        if let Some((s, e, kind, bytes)) = self.tickets.remove(&t) {
            let ms = s.elapsed_ms(&e).map_err(|x| self.err("event timing", x))? as f64;
            self.trace(
                match kind {
                    Kind::H2d => "h2d",
                    Kind::D2h => "d2h",
                },
                &s,
                &e,
            );
            match kind {
                Kind::H2d => {
                    self.stats.h2d_s += ms * 1e-3;
                    self.stats.h2d_bytes += bytes;
                }
                Kind::D2h => {
                    self.stats.d2h_s += ms * 1e-3;
                    self.stats.d2h_bytes += bytes;
                }
            }
        }
        Ok(())
    }

    /// Account GEMM time for completed GEMMs (front of the queue).
    fn harvest_gemms(&mut self, all: bool) -> Result<()> {
        while let Some((s, e)) = self.gemm_events.front() {
            if !all
                && !e
                    .try_is_complete()
                    .map_err(|x| self.err("event query", x))?
            {
                break;
            }
            let ms = s.elapsed_ms(e).map_err(|x| self.err("event timing", x))? as f64;
            self.trace("gemm", s, e);
            self.stats.gemm_s += ms * 1e-3;
            self.gemm_events.pop_front();
        }
        Ok(())
    }
}

impl CudaLane {
    /// `acc[..elems] *= beta` on the compute stream, in the accumulator's type (f32, or f64
    /// for fp64): nothing for beta = 1, zeros for beta = 0 (C is not read), else cuBLAS scal.
    fn scale_acc(&mut self, acc: usize, elems: usize, beta: f64) -> Result<()> {
        if beta == 1.0 {
            return Ok(());
        }
        let ordinal = self.ordinal;
        let bytes = elems * self.host_dt.size();
        if beta == 0.0 {
            let mut view = self.accs[acc].slice_mut(..bytes);
            return self
                .comp
                .memset_zeros(&mut view)
                .map_err(|e| self.err("zero accumulator", e));
        }
        let (b32, b64) = (beta as f32, beta);
        let n = elems as i32;
        let blas = self
            .blas
            .as_ref()
            .expect("the handle lives until release (no GEMM after it)");
        let (ptr_c, _gc) = self.accs[acc].device_ptr_mut(&self.comp);
        // SAFETY: the accumulator belongs to this lane's context and holds at least `elems`
        // values of the host compute type (layout sizes it for tm·tn); beta points to a live
        // local of that type; the handle's stream is `comp`, on which the guard records the
        // access.
        let status = unsafe {
            if self.host_dt == DType::F64 {
                blas_sys::cublasDscal_v2(*blas.handle(), n, &b64, ptr_c as *mut f64, 1)
            } else {
                blas_sys::cublasSscal_v2(*blas.handle(), n, &b32, ptr_c as *mut f32, 1)
            }
        };
        // A device error (not a backend one), so that a failing GPU fails over like any other.
        let lane = self.lane;
        status
            .result()
            .map_err(|e| Error::device(lane, format!("cuda:{ordinal}"), "cublas scal", e))
    }
}

impl Lane for CudaLane {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn bind_thread(&mut self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.err("bind context", e))
    }

    fn upload(&mut self, src: &HostBuf, elems: usize, dst: Dst) -> Result<Ticket> {
        let hbytes = elems * self.host_dt.size();
        let host = &src.bytes()[..hbytes];
        let start = self
            .h2d
            .record_event(timing())
            .map_err(|e| self.err("event", e))?;
        match dst {
            Dst::Acc(a) => {
                let mut view = self.accs[a].slice_mut(..hbytes);
                self.h2d
                    .memcpy_htod(host, &mut view)
                    .map_err(|e| self.err("H2D copy", e))?;
            }
            Dst::Slot(s) if self.dev_dt == self.host_dt => {
                let mut view = self.slots[s].slice_mut(..hbytes);
                self.h2d
                    .memcpy_htod(host, &mut view)
                    .map_err(|e| self.err("H2D copy", e))?;
            }
            Dst::Slot(s) => {
                // Upload fp32 into a landing buffer, then round to 16 bits into the slot.
                let li = self.next_landing;
                self.next_landing = (li + 1) % self.landing.len();
                {
                    let mut view = self.landing[li].slice_mut(..hbytes);
                    self.h2d
                        .memcpy_htod(host, &mut view)
                        .map_err(|e| self.err("H2D copy", e))?;
                }
                self.convert_landing(li, s, elems)?;
            }
        }
        self.uploaded(start, hbytes)
    }

    fn uploads_runs(&self) -> bool {
        true
    }

    fn checks_uploads(&self) -> bool {
        self.check.is_some()
    }

    /// kernels/check.cu over the block the last `upload_runs` wrote, queued on the H2D stream
    /// after it (a later copy into the same buffer queues behind the check), its results
    /// copied into a page-locked region and an event recorded after them.
    fn check_upload(
        &mut self,
        spec: &DeviceCheckSpec,
    ) -> Option<Box<dyn super::check::DeviceCheck>> {
        let f = self.check.clone()?;
        let (landing, slot, bytes) = self.last_upload.take()?;
        let tiles = spec.tiles();
        let want = spec.brows * spec.bcols * spec.elem as u64;
        if tiles == 0 || tiles > CHECK_MAX_TILES || want != bytes as u64 {
            return None;
        }
        if self.check_bufs.is_none() {
            let n = CHECK_RING * CHECK_MAX_TILES * 2;
            // SAFETY: written by the kernel before any copy out of it reads a region.
            let dev = unsafe { self.h2d.alloc::<u32>(n) }.ok()?;
            // SAFETY: page-locked, cached (flags 0: read by the host); written only by copies.
            let mut host = unsafe { self.ctx.alloc_pinned_with_flags::<u32>(n, 0) }.ok()?;
            let ptr = host.as_mut_ptr().ok()? as usize;
            let ring = Arc::new(CheckRing {
                _host: host,
                ptr,
                free: std::sync::Mutex::new((0..CHECK_RING).rev().collect()),
            });
            self.check_bufs = Some(CheckBufs { dev, ring });
        }
        let bufs = self.check_bufs.as_mut()?;
        let region = (bufs.ring.free.lock().unwrap_or_else(|e| e.into_inner())).pop()?;
        // Gives the region back if anything below fails (the host then checks the block).
        let mut check = CudaCheck {
            ring: bufs.ring.clone(),
            region,
            tiles,
            done: None,
        };
        let src = match landing {
            Some(li) => &self.landing[li],
            None => &self.slots[slot],
        };
        let data = src.slice(..bytes);
        let off = region * CHECK_MAX_TILES * 2;
        let mut out = bufs.dev.slice_mut(off..off + tiles * 2);
        let (dptr, g_in) = data.device_ptr(&self.h2d);
        let (optr, g_out) = out.device_ptr_mut(&self.h2d);
        let mut b = self.h2d.launch_builder(&f);
        b.arg(&dptr)
            .arg(&spec.brows)
            .arg(&spec.bcols)
            .arg(&spec.br0)
            .arg(&spec.bc0)
            .arg(&spec.tile_rows)
            .arg(&spec.tile_cols)
            .arg(&spec.ti0)
            .arg(&spec.tj0)
            .arg(&spec.ntj)
            .arg(&spec.elem)
            .arg(&optr);
        // SAFETY: the kernel reads `brows·bcols` elements of `elem` bytes from `data` (exactly
        // its length, checked above) and writes `2·tiles` u32 into `out`; both outlive the
        // launch in stream order (device buffers of this lane, freed after its streams).
        let launched = unsafe {
            b.launch(LaunchConfig {
                grid_dim: (tiles as u32, 1, 1),
                block_dim: (super::check::THREADS as u32, 1, 1),
                shared_mem_bytes: 0,
            })
        };
        drop((g_in, g_out));
        launched.ok()?;
        // SAFETY: the region lies inside the ring's page-locked allocation (2·tiles ≤
        // 2·CHECK_MAX_TILES u32 from its start), which lives while `check` holds the ring.
        unsafe {
            cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
                (check.ring.ptr as *mut u32).add(off) as *mut c_void,
                optr,
                tiles * 2 * 4,
                self.h2d.cu_stream(),
            )
        }
        .result()
        .ok()?;
        // Blocking sync: the check stage's thread sleeps while it waits instead of spinning a
        // core of a host that is the limit with these precisions.
        check.done = Some(
            (self.h2d)
                .record_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC))
                .ok()?,
        );
        Some(Box::new(check))
    }

    fn upload_runs(&mut self, runs: &[HostRun], elems: usize, slot: usize) -> Result<Ticket> {
        use cudarc::driver::sys::{cuMemcpy2DAsync_v2, CUmemorytype, CUDA_MEMCPY2D};
        let hbytes = elems * self.host_dt.size();
        let start = self
            .h2d
            .record_event(timing())
            .map_err(|e| self.err("event", e))?;
        // Into the slot, or (bf16/fp16) into a landing buffer and converted from there.
        let landing = (self.dev_dt != self.host_dt).then(|| {
            let li = self.next_landing;
            self.next_landing = (li + 1) % self.landing.len();
            li
        });
        let stream = self.h2d.cu_stream();
        let buf = match landing {
            Some(li) => &mut self.landing[li],
            None => &mut self.slots[slot],
        };
        let mut view = buf.slice_mut(..hbytes);
        let (dptr, guard) = view.device_ptr_mut(&self.h2d);
        let mut r = Ok(());
        for run in runs {
            debug_assert!(run.dst_off + (run.rows - 1) * run.dst_pitch + run.row_len <= hbytes);
            let copy = CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: CUmemorytype::CU_MEMORYTYPE_HOST,
                srcHost: run.host as *const c_void,
                srcDevice: 0,
                srcArray: std::ptr::null_mut(),
                srcPitch: run.host_pitch,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
                dstHost: std::ptr::null_mut(),
                dstDevice: dptr + run.dst_off as u64,
                dstArray: std::ptr::null_mut(),
                dstPitch: run.dst_pitch,
                WidthInBytes: run.row_len,
                Height: run.rows,
            };
            // SAFETY: the source rectangle lies in a page-locked file map that the upload
            // holding `runs` keeps registered until this copy is known to be done (the
            // pipeline waits for the ticket); the destination rectangle lies inside the view
            // (the runs tile the dense block of `elems` elements).
            r = unsafe { cuMemcpy2DAsync_v2(&copy, stream) }.result();
            if r.is_err() {
                break;
            }
        }
        drop(guard);
        let r = r
            .map_err(|e| self.err("H2D copy from a file map", e))
            .and_then(|()| match landing {
                Some(li) => self.convert_landing(li, slot, elems),
                None => Ok(()),
            })
            .and_then(|()| self.uploaded(start, hbytes));
        self.last_upload = r.is_ok().then_some((landing, slot, hbytes));
        if r.is_err() {
            // Copies already queued read pages that the caller releases once this returns
            // without a ticket: let them end first (best effort; a failed device answers at
            // once).
            let _ = self.h2d.synchronize();
        }
        r
    }

    fn gemm(&mut self, g: &GemmDesc, a_slot: usize, b_slot: usize, acc: usize) -> Result<()> {
        if let Some(w) = self.warming.take() {
            // Whether it loaded the kernel or failed, this GEMM may go now (after a failure it
            // loads the kernel itself, as any first call does).
            let t = std::time::Instant::now();
            w.wait();
            let track = format!("cuda:{} lane", self.ordinal);
            crate::trace::span(&track, "wait for the warm-up", t, std::time::Instant::now());
        }
        if g.alpha == 0.0 {
            // Reference xGEMM: with alpha = 0, A and B are not read (NaN/Inf there, or values
            // that overflow fp16, never reach C) and C = beta·C exactly.
            return self.scale_acc(acc, g.m * g.n, g.beta);
        }
        let (ordinal, lane) = (self.ordinal, self.lane);
        let start;
        {
            let (acc_buf, rest) = (&mut self.accs[acc], &self.slots);
            let (ptr_b, _gb) = rest[b_slot].device_ptr(&self.comp);
            let (ptr_a, _ga) = rest[a_slot].device_ptr(&self.comp);
            let (ptr_c, _gc) = acc_buf.device_ptr_mut(&self.comp);
            // After the pointers: taking them makes the stream wait for the buffers' last use
            // on the other streams, above all the accumulator's download of its previous tile
            // (the uploads were waited for in `upload`). That wait is not GEMM time; it was
            // counted as such before, which showed staging-bound tf32 runs' GEMMs at half
            // cuBLAS's rate.
            start = self
                .comp
                .record_event(timing())
                .map_err(|e| Error::device(lane, format!("cuda:{ordinal}"), "event", e))?;
            let blas = self
                .blas
                .as_ref()
                .expect("the handle lives until release (no GEMM after it)");
            // SAFETY: all three buffers belong to this lane's context and are at least as large
            // as the GEMM reads/writes (layout sizes slots for tm·tk and tk·tn elements and
            // accumulators for tm·tn); the handle's stream is `comp`, on which the guards above
            // record the accesses.
            unsafe { gemm_ex(*blas.handle(), self.precision, g, ptr_a, ptr_b, ptr_c) }
                .map_err(|e| Error::device(lane, format!("cuda:{ordinal}"), "cublasGemmEx", e))?;
        }
        let end = self
            .comp
            .record_event(timing())
            .map_err(|e| self.err("event", e))?;
        self.gemm_events.push_back((start, end));
        self.stats.gemms += 1;
        if self.gemm_events.len() > 64 {
            self.harvest_gemms(false)?;
        }
        Ok(())
    }

    fn download(&mut self, acc: usize, elems: usize, dst: &mut HostBuf) -> Result<Ticket> {
        let bytes = elems * self.host_dt.size();
        // The download needs every GEMM issued so far on this accumulator; wait before the
        // timing event so that D2H time is copy time only.
        self.d2h
            .join(&self.comp)
            .map_err(|e| self.err("stream wait", e))?;
        let start = self
            .d2h
            .record_event(timing())
            .map_err(|e| self.err("event", e))?;
        {
            let view = self.accs[acc].slice(..bytes);
            let host = &mut dst.bytes_mut()[..bytes];
            self.d2h
                .memcpy_dtoh(&view, host)
                .map_err(|e| self.err("D2H copy", e))?;
        }
        let end = self
            .d2h
            .record_event(timing())
            .map_err(|e| self.err("event", e))?;
        Ok(self.ticket(start, end, Kind::D2h, bytes as u64))
    }

    fn done(&mut self, t: Ticket) -> Result<bool> {
        let complete = match self.tickets.get(&t.0) {
            None => true,
            Some((_, e, _, _)) => e
                .try_is_complete()
                .map_err(|x| self.err("event query", x))?,
        };
        if complete {
            self.finish_ticket(t.0)?;
        }
        Ok(complete)
    }

    fn wait(&mut self, t: Ticket) -> Result<()> {
        if let Some((_, e, _, _)) = self.tickets.get(&t.0) {
            e.synchronize().map_err(|x| self.err("event wait", x))?;
        }
        self.finish_ticket(t.0)
    }

    fn live_stats(&mut self) -> DeviceStats {
        let _ = self.harvest_gemms(false);
        self.stats.clone()
    }

    fn in_flight(&mut self) -> usize {
        let _ = self.harvest_gemms(false);
        self.gemm_events.len()
    }

    fn wait_in_flight_below(&mut self, n: usize) -> Result<()> {
        while self.gemm_events.len() >= n.max(1) {
            let waited = match self.gemm_events.front() {
                Some((_, end)) => end.synchronize(),
                None => break,
            };
            waited.map_err(|x| self.err("event wait", x))?;
            self.harvest_gemms(false)?;
        }
        Ok(())
    }

    fn stats(&mut self) -> DeviceStats {
        let _ = self.ctx.bind_to_thread();
        let _ = self.comp.synchronize();
        let _ = self.harvest_gemms(true);
        self.stats.clone()
    }

    fn release(&mut self) {
        let t = std::time::Instant::now();
        self.stats();
        // The cuBLAS handle first, then every device buffer.
        if let Some(b) = self.blas.take() {
            let_go_of_blas(&self.ctx, b);
        }
        self.slots.clear();
        self.accs.clear();
        self.landing.clear();
        // The frees are stream-ordered and go to the pool the backend holds (`HeldPool`):
        // waiting for them is quick.
        let _ = self.ctx.synchronize();
        crate::trace::span(
            &format!("cuda:{} lane", self.ordinal),
            "release",
            t,
            std::time::Instant::now(),
        );
    }
}

impl CudaLane {
    /// Round the `elems` fp32 values of landing buffer `li` to the device input type into
    /// slot `s`, on the copy stream.
    fn convert_landing(&mut self, li: usize, s: usize, elems: usize) -> Result<()> {
        let hbytes = elems * self.host_dt.size();
        let f = self
            .convert
            .as_ref()
            .expect("conversion kernel is loaded for bf16/fp16");
        let n = elems as u64;
        let src_view = self.landing[li].slice(..hbytes);
        let mut dst_view = self.slots[s].slice_mut(..elems * self.dev_dt.size());
        let blocks = (elems.div_ceil(256)).min(65535 * 4) as u32;
        let mut b = self.h2d.launch_builder(f);
        b.arg(&src_view).arg(&mut dst_view).arg(&n);
        // SAFETY: the kernel reads `n` f32 from the landing view and writes `n` u16 into
        // the slot view; both views are at least that long (sized from the layout).
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (blocks.max(1), 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(|e| self.err("conversion kernel launch", e))?;
        Ok(())
    }

    /// Close an upload that began with event `start`: its end event, which later GEMMs wait
    /// for, and its ticket.
    fn uploaded(&mut self, start: CudaEvent, hbytes: usize) -> Result<Ticket> {
        let end = self
            .h2d
            .record_event(timing())
            .map_err(|e| self.err("event", e))?;
        // GEMMs issued from now on wait for this upload. cudarc's per-buffer tracking would
        // insert the same wait inside the GEMM's timed region; doing it here keeps the GEMM
        // timing events measuring the GEMM alone.
        self.comp
            .wait(&end)
            .map_err(|e| self.err("stream wait", e))?;
        Ok(self.ticket(start, end, Kind::H2d, hbytes as u64))
    }
}

impl Drop for CudaLane {
    fn drop(&mut self) {
        // Finish queued work before buffers are freed; the cuBLAS handle first (see
        // `let_go_of_blas`).
        let t = std::time::Instant::now();
        let _ = self.ctx.bind_to_thread();
        // A check kernel may still read a slot or landing buffer on the H2D stream, which the
        // buffers' stream-ordered frees below (on other streams) do not wait for.
        let _ = self.h2d.synchronize();
        if let Some(b) = self.blas.take() {
            let_go_of_blas(&self.ctx, b);
        }
        self.slots.clear();
        self.accs.clear();
        self.landing.clear();
        self.tickets.clear();
        self.gemm_events.clear();
        self.clock = None;
        let _ = self.ctx.synchronize();
        let track = format!("cuda:{} lane", self.ordinal);
        crate::trace::span(&track, "drop: buffers", t, std::time::Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prefill populates buffers of the asked sizes on its own threads; called off (`stop`),
    /// populating gives up; dropped, it frees what it made.
    #[test]
    fn a_prefill_populates_and_can_be_called_off() {
        let p = Prefill::new(vec![1 << 20, 3 << 20, 1 << 20], 2, (0, 0), false).expect("buffers");
        assert!(lock(&p.workers).is_empty(), "nothing runs before start");
        p.start();
        p.start(); // once only
        let workers: Vec<_> = lock(&p.workers).drain(..).collect();
        assert_eq!(workers.len(), 2);
        workers.into_iter().for_each(|h| h.join().unwrap());
        let maps: Vec<_> = lock(&p.rx).as_ref().unwrap().try_iter().collect();
        let mut lens: Vec<usize> = maps.iter().map(|m| m.len()).collect();
        lens.sort();
        assert_eq!(lens, vec![1 << 20, 1 << 20, 3 << 20]);
        assert!(maps.iter().all(|m| m.iter().all(|&b| b == 0)));
        let stop = AtomicBool::new(true);
        assert!(touched_map(8 << 20, &stop).is_err());
        assert!(touched_map(8 << 20, &AtomicBool::new(false)).is_ok_and(|m| m.len() == 8 << 20));
        assert!(populated_map(8 << 20).is_ok_and(|m| m.iter().all(|&b| b == 0)));
        assert!(
            Prefill::new(vec![usize::MAX / 4; 2], 2, (0, 0), false).is_none(),
            "more than memory holds"
        );
        let p = Prefill::new(vec![8 << 20; 4], 2, (0, 0), false).unwrap();
        p.start();
        drop(p); // returns once its threads have stopped
        drop(Prefill::new(vec![8 << 20; 4], 2, (0, 0), false)); // never started
        assert!(Prefill::new(Vec::new(), 2, (0, 0), false).is_none());
    }
}
