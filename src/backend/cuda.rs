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

use super::{
    Backend, Caps, DeviceStats, Dst, GemmDesc, HostAlloc, HostBuf, Lane, MemorySpace, Ticket,
};
use crate::dtype::DType;
use crate::error::{DeviceError, Error, Result};
use crate::plan::layout::Layout;
use crate::plan::size::fmt_bytes;
use crate::plan::{Devices, Engine, Precision};

const CONVERT_SRC: &str = include_str!("../../kernels/convert.cu");

/// kernels/convert.cu compiled once per process (NVRTC takes tens of milliseconds; every lane of
/// every bf16/fp16 step loads the same PTX).
fn convert_ptx() -> std::result::Result<cudarc::nvrtc::Ptx, cudarc::nvrtc::CompileError> {
    static PTX: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    if let Some(src) = PTX.get() {
        return Ok(cudarc::nvrtc::Ptx::from_src(src.clone()));
    }
    let ptx = cudarc::nvrtc::compile_ptx(CONVERT_SRC)?;
    let _ = PTX.set(ptx.to_src());
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
}

fn derr(what: &str, e: impl std::fmt::Display) -> Error {
    Error::backend("cuda", format!("{what}: {e}"))
}

/// Check that the CUDA libraries load and list the devices, each with its primary context
/// open. Never panics.
///
/// Start-up is on the critical path of every run (issue 10: process wall − step wall), so the
/// independent parts overlap: cuBLAS and NVRTC (hundreds of MB of libraries) are loaded on one
/// thread while the driver initialises (`cuInit`, about 0.19 s on an H200 host) and every GPU's
/// primary context is created on threads of their own.
pub(crate) fn probe() -> Result<Vec<DeviceInfo>> {
    // SAFETY: these only attempt to dlopen the libraries and report success; no CUDA call is
    // made through a missing library.
    let libs = std::thread::spawn(|| unsafe {
        let blas = cudarc::cublas::sys::is_culib_present();
        let rtc = cudarc::nvrtc::sys::is_culib_present();
        // `is_culib_present` closes what it opened; load for good the ones that are there,
        // so that the work is not done again on the first cuBLAS or NVRTC call.
        if blas {
            cudarc::cublas::sys::culib();
        }
        if rtc {
            cudarc::nvrtc::sys::culib();
        }
        (blas, rtc)
    });
    let devices = probe_devices();
    let (blas, rtc) = libs.join().map_err(|_| {
        Error::backend(
            "cuda",
            "loading cuBLAS and NVRTC panicked (this is a bug; please report it)",
        )
    })?;
    let devices = devices?;
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
fn probe_devices() -> Result<Vec<DeviceInfo>> {
    // SAFETY: only attempts to dlopen the driver library and reports success.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(Error::backend("cuda", "the CUDA driver library (libcuda.so.1) was not found: no NVIDIA driver on this machine"));
    }
    let n = match std::panic::catch_unwind(CudaContext::device_count) {
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
    // One thread per GPU: creating a primary context takes ~0.24 s on an H200 and they do not
    // wait on each other (tools/gpu/startup_probe.py), so N GPUs cost one context, not N.
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n as usize)
            .map(|i| s.spawn(move || device_info(i)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::backend("cuda", "device probe panicked")))
            })
            .collect()
    })
}

/// Open GPU `i`'s primary context and read what the backend needs to know about it.
fn device_info(i: usize) -> Result<DeviceInfo> {
    let ctx = CudaContext::new(i).map_err(|e| derr(&format!("cannot open GPU {i}"), e))?;
    let (free, total) = ctx.mem_get_info().map_err(|e| derr("cuMemGetInfo", e))?;
    Ok(DeviceInfo {
        ordinal: i,
        name: ctx.name().unwrap_or_else(|_| "?".into()),
        free: free as u64,
        total: total as u64,
        cc: ctx.compute_capability().unwrap_or((0, 0)),
        ctx,
        held: None,
    })
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
    /// A [`prefill`]'s buffers, registered, until the first pipeline's pools are made
    /// ([`HostAlloc::pools_made`] frees those no pool took).
    prefilled: Arc<PinnedCache>,
    /// Registering the prefill's maps into `prefilled`; joined by the first allocation, by
    /// `pools_made` and on drop.
    adopting: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
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

/// An anonymous map of `len` bytes in transparent huge pages where the kernel gives them,
/// every page populated (`MADV_POPULATE_WRITE`). For a [`prefill`] (`stop` given) it gives up
/// when `stop` is set between pieces, and where the kernel lacks `MADV_POPULATE_WRITE`: the
/// page-by-page fallback cannot report a lack of memory, which a guess should not risk.
fn populated_map(
    len: usize,
    stop: Option<&AtomicBool>,
) -> std::result::Result<memmap2::MmapMut, String> {
    let t = std::time::Instant::now();
    let mut map = memmap2::MmapOptions::new()
        .len(len)
        .map_anon()
        .map_err(|e| format!("anonymous map: {e}"))?;
    // Without huge pages registration is slower, not wrong. Without MADV_POPULATE_WRITE
    // (EINVAL: Linux < 5.14) the pages are touched one by one instead; any other failure
    // (ENOMEM above all) is reported, so that memory short does not become an OOM kill.
    //
    // In pieces of [`POPULATE_PIECE`]: populating holds the process's memory-map lock, and the
    // driver's own `mmap` calls (`cuInit`, stream creation) wait for it; one 256 MiB call made
    // the backend's start (`cuInit`, contexts, libraries) beside it take 0.92 s in one traced
    // run (2026-12-01c call 2), against 0.44–0.51 s in pieces (call 3).
    let _ = map.advise(memmap2::Advice::HugePage);
    let mut off = 0;
    while off < len {
        if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
            return Err("the prefill was called off".into());
        }
        let n = POPULATE_PIECE.min(len - off);
        if let Err(e) = map.advise_range(memmap2::Advice::PopulateWrite, off, n) {
            if e.raw_os_error() != Some(libc::EINVAL) || stop.is_some() {
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

impl Registered {
    fn new(ctx: &Arc<CudaContext>, len: usize) -> std::result::Result<Registered, String> {
        Registered::register(ctx, populated_map(len, None)?)
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
        if !crate::config::pinned_alloc() {
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
fn pinned_len(bytes: usize) -> usize {
    bytes.div_ceil(4096).max(1) * 4096
}

/// Host memory being populated for a run's pinned pools before its backend exists
/// ([`prefill`]), until [`CudaBackend::select`] adopts it. Dropped unadopted (`auto` fell back
/// to the CPU), it calls the populating off at its next 4 MiB piece and frees what it made.
pub(crate) struct Prefill {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Vec<memmap2::MmapMut>>>,
}

impl Drop for Prefill {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.thread.take() {
            drop(h.join());
        }
    }
}

/// Start populating the host memory of pinned buffers of `lens` bytes on at most `threads`
/// threads of their own, before the CUDA backend exists: `cuInit` and the contexts take 0.3 s,
/// and populating 2.25 GiB of pools took 0.42–0.69 s on one H200's host (BENCHMARKS.md §14), so
/// much of it is done before the backend needs it. [`CudaBackend::select`] registers the maps
/// with the driver beside the lanes' creation, the pools take them by size, and those no pool
/// took are freed once the first pipeline's pools are made. `lens` comes from the plan
/// ([`guess_pool_lens`]). `None`: nothing to do, `MGMM_PINNED_ALLOC=1`, or no thread to be had.
///
/// Measured on one H200, 32768² fp32, interleaved with the build before it (BENCHMARKS.md
/// §15): process − step 1.30–1.50 → 1.06–1.19 s; in one traced run each, the backend 0.44 →
/// 0.51 s (the populating slows the driver's start a little, even in 4 MiB pieces), lanes and
/// pools together 0.52 → 0.21 s.
pub(crate) fn prefill(lens: Vec<usize>, threads: usize) -> Option<Prefill> {
    if lens.is_empty() || crate::config::pinned_alloc() {
        return None;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    // Threads of its own, not the rayon pool: the pools' allocation runs on rayon workers and
    // waits for this work (`CudaAlloc::await_prefill`), so jobs of it queued on those workers
    // could never run (with `threads = 1`, they never did: the first version hung so).
    let thread = std::thread::Builder::new()
        .name("mgmm-prefill".into())
        .spawn(move || {
            let per = lens.len().div_ceil(threads.max(1)).max(1);
            std::thread::scope(|s| {
                let mut maps = Vec::new();
                let mut hs = Vec::new();
                for c in lens.chunks(per) {
                    let flag = &flag;
                    let job = move || {
                        (c.iter())
                            .map_while(|&len| populated_map(len, Some(flag)).ok())
                            .collect::<Vec<_>>()
                    };
                    match std::thread::Builder::new().spawn_scoped(s, job) {
                        Ok(h) => hs.push(h),
                        Err(_) => break, // fewer threads, fewer buffers: the pools make the rest
                    }
                }
                for h in hs {
                    maps.extend(h.join().unwrap_or_default());
                }
                maps
            })
        })
        .ok()?;
    Some(Prefill {
        stop,
        thread: Some(thread),
    })
}

/// How many GPUs `CUDA_VISIBLE_DEVICES` lets CUDA see, read as CUDA reads it: indices or
/// `GPU-`/`MIG-` UUIDs up to the first entry that is neither (`"0,1,-1,2"`: two; `"-1"`,
/// `""`: none).
fn visible_count(v: &str) -> usize {
    v.split(',')
        .map(str::trim)
        .take_while(|x| x.parse::<u32>().is_ok() || x.starts_with("GPU-") || x.starts_with("MIG-"))
        .count()
}

/// The GPUs a run of `engine` would use, guessed without starting the driver: the listed
/// ones, or those `CUDA_VISIBLE_DEVICES` lets through, at most as many as the driver lists
/// under `/proc/driver/nvidia/gpus`. 0 when there is no sign of a GPU.
fn guess_gpu_count(engine: &Engine) -> usize {
    let present = std::fs::read_dir("/proc/driver/nvidia/gpus").map_or(0, |d| d.count());
    let n = match (&engine.devices, std::env::var("CUDA_VISIBLE_DEVICES")) {
        (Devices::List(l), _) => l.len(),
        (_, Ok(v)) => visible_count(&v),
        _ => present,
    };
    n.min(present)
}

/// The byte lengths of the pinned buffers of `plan`'s step with the largest pools on this
/// machine's GPUs, as [`CudaAlloc`] rounds them (the largest: a chain's first part is often
/// tiny, and the pools of one step are reused by the next when the sizes match). Empty when no
/// GPU is in sight or no layout can be made. Device memory is taken as 64 GiB (or
/// `engine.device_memory`): it changes the pools only through the tile size, which on GPUs
/// with less memory may come out smaller — then the guess is not used, and freed once the
/// first pools are made.
pub(crate) fn guess_pool_lens(plan: &crate::plan::Plan) -> Vec<usize> {
    pool_lens_on(plan, guess_gpu_count(&plan.engine))
}

/// [`guess_pool_lens`] for `lanes` GPUs.
fn pool_lens_on(plan: &crate::plan::Plan, lanes: usize) -> Vec<usize> {
    let e = &plan.engine;
    if lanes == 0 {
        return Vec::new();
    }
    let caps = cuda_caps(lanes, e.device_memory.unwrap_or(64 << 30));
    let lens_of = |l: &Layout| {
        let mut lens = vec![pinned_len(l.staging_buf_bytes as usize); l.staging_bufs * lanes];
        lens.extend(std::iter::repeat_n(
            pinned_len(l.out_buf_bytes as usize),
            l.out_bufs * lanes,
        ));
        lens
    };
    (plan.steps.iter())
        .filter_map(|step| Layout::new(&plan.path, step, e, &caps).ok())
        .map(|l| lens_of(&l))
        .max_by_key(|lens| lens.iter().sum::<usize>())
        .unwrap_or_default()
}

impl CudaAlloc {
    fn new(ctx: Arc<CudaContext>) -> CudaAlloc {
        CudaAlloc {
            ctx,
            cache: Arc::default(),
            prefilled: Arc::default(),
            adopting: Default::default(),
        }
    }

    /// Register what `p` populated, on a thread of its own, into `prefilled`; the first
    /// allocation waits for that thread. Without a thread, `p` is dropped (freed).
    fn adopt_prefill(&self, mut p: Prefill) {
        let Some(h) = p.thread.take() else {
            return;
        };
        let (ctx, into) = (self.ctx.clone(), self.prefilled.clone());
        let adopt = std::thread::Builder::new()
            .name("mgmm-register".into())
            .spawn(move || {
                for map in h.join().unwrap_or_default() {
                    if let Ok(r) = Registered::register(&ctx, map) {
                        (into.0.lock().unwrap_or_else(|e| e.into_inner()))
                            .push(PinnedMem::Registered(r));
                    }
                }
            });
        if let Ok(adopt) = adopt {
            *self.adopting.lock().unwrap_or_else(|e| e.into_inner()) = Some(adopt);
        }
    }

    /// Wait until the prefilled buffers are registered (if any are coming).
    fn await_prefill(&self) {
        let mut a = self.adopting.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = a.take() {
            let _ = h.join();
        }
    }

    /// A prefilled buffer of exactly `len` bytes.
    fn prefilled(&self, len: usize) -> Option<PinnedMem> {
        let mut c = self.prefilled.0.lock().unwrap_or_else(|e| e.into_inner());
        let i = c.iter().position(|p| p.len() == len)?;
        Some(c.swap_remove(i))
    }
}

impl Drop for CudaAlloc {
    fn drop(&mut self) {
        // The registering thread uses the context: it ends before the backend lets go of it.
        self.await_prefill();
    }
}

impl HostAlloc for CudaAlloc {
    fn alloc_host(&self, bytes: usize) -> Result<HostBuf> {
        self.await_prefill();
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
    fn pools_made(&self) {
        self.await_prefill();
        let rest = std::mem::take(&mut *self.prefilled.0.lock().unwrap_or_else(|e| e.into_inner()));
        drop(rest);
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
fn cuda_caps(lanes: usize, device_memory: u64) -> Caps {
    Caps {
        kind: "cuda",
        memory: MemorySpace::Device,
        tile_ladder: GPU_TILES,
        staging_depth: 6,
        extra_out_buf: true,
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
    /// The backend over the GPUs `engine` asks for, adopting `prefill`'s memory (freed on
    /// error).
    pub(crate) fn select(engine: &Engine, prefill: Option<Prefill>) -> Result<CudaBackend> {
        let devs = probe()?;
        let chosen = choose(engine, &devs)?;
        let b = CudaBackend::from_devices(engine, chosen, None)?;
        if let Some(p) = prefill {
            b.alloc.adopt_prefill(p);
        }
        Ok(b)
    }

    /// The backend over `chosen` (opened GPUs), their pools held. `device_memory`: the budget
    /// per GPU when it is already fixed (a failover: the steps' layouts were sized from it),
    /// else from `engine` and the GPUs' free memory.
    fn from_devices(
        engine: &Engine,
        mut chosen: Vec<DeviceInfo>,
        device_memory: Option<u64>,
    ) -> Result<CudaBackend> {
        for d in &mut chosen {
            if d.held.is_none() {
                d.held = HeldPool::shared(&d.ctx);
            }
        }
        let min_free = chosen.iter().map(|d| d.free).min().unwrap_or(0);
        let device_memory = match (device_memory, engine.device_memory) {
            (Some(fixed), _) => fixed,
            (None, Some(b)) => {
                if b > min_free {
                    return Err(Error::backend(
                        "cuda",
                        format!("engine.device_memory = {} but GPU(s) have only {} free; lower it or use \"auto\"", fmt_bytes(b), fmt_bytes(min_free)),
                    ));
                }
                b
            }
            (None, None) => min_free.saturating_sub(auto_margin(min_free)),
        };
        let ctx0 = chosen[0].ctx.clone();
        let alloc = CudaAlloc::new(ctx0);
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
    fn pools_made(&self) {
        self.alloc.pools_made()
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
                .map(|(i, d)| s.spawn(move || CudaLane::new(i, d.ordinal, layout, p)))
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
        // every GPU would fail on it). Their free memory is measured again, with what the
        // pools kept given back first; the device budget stays the one the steps' layouts
        // were sized from (the contexts' loaded libraries now take some of the free memory).
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
            CudaBackend::from_devices(&engine, rest, fixed)
                .map(|b| Box::new(b) as Box<dyn Backend>),
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
    slots: Vec<CudaSlice<u8>>,
    accs: Vec<CudaSlice<u8>>,
    landing: Vec<CudaSlice<u8>>,
    next_landing: usize,
    convert: Option<CudaFunction>,
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

fn timing() -> Option<CUevent_flags> {
    Some(CUevent_flags::CU_EVENT_DEFAULT)
}

impl CudaLane {
    pub(crate) fn new(
        lane: usize,
        ordinal: usize,
        l: &Layout,
        precision: Precision,
    ) -> Result<CudaLane> {
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
        let libs = || -> Result<(CudaBlas, Option<CudaFunction>)> {
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
            crate::trace::span(&track, "kernels", t, std::time::Instant::now());
            match convert {
                Ok(c) => Ok((blas, c)),
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
        let ((slots, accs, landing), (blas, convert)) = match (bufs, libs) {
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
            slots,
            accs,
            landing,
            next_landing: 0,
            convert,
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
        let t = std::time::Instant::now();
        lane.warm_up(l)?;
        crate::trace::span(&track, "warm-up GEMM", t, std::time::Instant::now());
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
    /// still load a kernel on first use.
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
        self.gemm(&desc, 0, b_slot, 0)?;
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
            }
        }
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

    fn gemm(&mut self, g: &GemmDesc, a_slot: usize, b_slot: usize, acc: usize) -> Result<()> {
        use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        if g.alpha == 0.0 {
            // Reference xGEMM: with alpha = 0, A and B are not read (NaN/Inf there, or values
            // that overflow fp16, never reach C) and C = beta·C exactly.
            return self.scale_acc(acc, g.m * g.n, g.beta);
        }
        use blas_sys::cudaDataType::*;
        let (m, n, k) = (g.m as i32, g.n as i32, g.k as i32);
        // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: pass B first.
        let transa = if g.b_trans { CUBLAS_OP_T } else { CUBLAS_OP_N };
        let lda = if g.b_trans { k } else { n };
        let transb = if g.a_trans { CUBLAS_OP_T } else { CUBLAS_OP_N };
        let ldb = if g.a_trans { m } else { k };
        let (in_t, out_t, compute) = match self.precision {
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
        let (pa, pb): (*const c_void, *const c_void) = if self.precision == Precision::Fp64 {
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
            // accumulators for tm·tn); alpha/beta point to live locals of the right type; the
            // handle's stream is `comp`, on which the guards above record the accesses.
            unsafe {
                blas_result::gemm_ex(
                    *blas.handle(),
                    transa,
                    transb,
                    n,
                    m,
                    k,
                    pa,
                    ptr_b as *const c_void,
                    in_t,
                    lda,
                    ptr_a as *const c_void,
                    in_t,
                    ldb,
                    pb,
                    ptr_c as *mut c_void,
                    out_t,
                    n,
                    compute,
                    blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
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

impl Drop for CudaLane {
    fn drop(&mut self) {
        // Finish queued work before buffers are freed; the cuBLAS handle first (see
        // `let_go_of_blas`).
        let t = std::time::Instant::now();
        let _ = self.ctx.bind_to_thread();
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

    /// The prefill's guess is the pools' own sizes: for 32768² fp32 on one GPU, six staging
    /// buffers and three output buffers of one 8192² f32 tile each, twice as many on two; the
    /// largest step of a chain, not its tiny first part; nothing without a GPU.
    #[test]
    fn prefill_guesses_the_pools_of_the_largest_step() {
        let dir = tempfile::tempdir().unwrap();
        let text = "[matrices.A]\npath = \"A.mgt\"\ngenerate = { rows = 32768, cols = 32768 }\n\
                    [matrices.B]\npath = \"B.mgt\"\ngenerate = { rows = 32768, cols = 32768 }\n\
                    [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n\
                    [engine]\nbackend = \"cuda\"\ndevices = [0]\nhost_memory = \"16GiB\"\n";
        let path = dir.path().join("p.toml");
        std::fs::write(&path, text).unwrap();
        let plan = crate::plan::Plan::load(&path).unwrap();
        let tile = 8192 * 8192 * 4;
        assert_eq!(pool_lens_on(&plan, 1), vec![tile; 9]);
        assert_eq!(pool_lens_on(&plan, 2), vec![tile; 18]);
        assert!(pool_lens_on(&plan, 0).is_empty());
        let caps = cuda_caps(1, 64 << 30);
        let l = Layout::new(&plan.path, &plan.steps[0], &plan.engine, &caps).unwrap();
        assert_eq!((l.staging_bufs, l.out_bufs), (6, 3));
        // The 43 GB chain: two parts, the first 3000×100·100×100; the guess is the second's.
        let text = "[matrices.A]\npath = \"A.mgt\"\ngenerate = { rows = 3000, cols = 100 }\n\
                    [matrices.B]\npath = \"B.mgt\"\ngenerate = { rows = 100, cols = 100 }\n\
                    [matrices.C]\npath = \"C.mgt\"\ngenerate = { rows = 100, cols = 3600000 }\n\
                    [[step]]\noutput = \"D.mgt\"\nexpr = \"(A @ B @ C).T\"\n\
                    [engine]\nbackend = \"cuda\"\nhost_memory = \"16GiB\"\n";
        std::fs::write(&path, text).unwrap();
        let chain = crate::plan::Plan::load(&path).unwrap();
        assert_eq!(chain.steps.len(), 2);
        let big = Layout::new(&chain.path, &chain.steps[1], &chain.engine, &caps).unwrap();
        let lens = pool_lens_on(&chain, 1);
        assert!(lens.contains(&pinned_len(big.out_buf_bytes as usize)));
        assert!(lens.iter().sum::<usize>() > 100 << 20, "{lens:?}");
    }

    /// `CUDA_VISIBLE_DEVICES` as CUDA reads it: up to the first entry that is not a GPU.
    #[test]
    fn visible_devices_stop_at_the_first_invalid_entry() {
        assert_eq!(visible_count("0,1"), 2);
        assert_eq!(visible_count("0,1,-1,2"), 2);
        assert_eq!(visible_count("-1"), 0);
        assert_eq!(visible_count(""), 0);
        assert_eq!(visible_count("GPU-8f2c,MIG-1a2b/1/0"), 2);
    }

    /// A prefill populates buffers of the asked sizes on its own threads; called off (`stop`),
    /// populating gives up; dropped, it frees what it made.
    #[test]
    fn a_prefill_populates_and_can_be_called_off() {
        let mut p = prefill(vec![1 << 20, 3 << 20, 1 << 20], 2).expect("threads");
        let maps = p.thread.take().unwrap().join().unwrap();
        let mut lens: Vec<usize> = maps.iter().map(|m| m.len()).collect();
        lens.sort();
        assert_eq!(lens, vec![1 << 20, 1 << 20, 3 << 20]);
        assert!(maps.iter().all(|m| m.iter().all(|&b| b == 0)));
        let stop = AtomicBool::new(true);
        assert!(populated_map(8 << 20, Some(&stop)).is_err());
        assert!(populated_map(8 << 20, None).is_ok());
        drop(prefill(vec![64 << 20; 4], 2)); // returns once its threads have stopped
        assert!(prefill(Vec::new(), 2).is_none());
    }
}
