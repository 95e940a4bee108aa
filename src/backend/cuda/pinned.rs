//! Page-locked host memory: the pools' pinned buffers ([`CudaAlloc`]: mapped, populated and
//! registered with the driver, or from `cuMemHostAlloc`; cached between pipelines), and the
//! registration of read-only file maps that lets the GPUs copy inputs straight from the files'
//! pages ([`FilePinner`], for `crate::pipeline::direct`).

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::early::Prefill;
use super::{derr, lock};
use crate::backend::{HostAlloc, HostBuf};
use crate::error::{Error, Result};
use crate::units::fmt_bytes;

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
    pub(super) ctx: Arc<CudaContext>,
    cache: Arc<PinnedCache>,
    /// The [`Prefill`]'s buffers until the pools of the step it was made for are made
    /// ([`HostAlloc::pools_made`] frees those no pool took).
    prefill: std::sync::Mutex<Option<Prefill>>,
    /// Allocate with `cuMemHostAlloc` rather than registering mapped memory
    /// (`MGMM_PINNED_ALLOC`, read at the edge: [`crate::backend::BackendOptions`]).
    pub(super) pinned_alloc: bool,
}

/// Page-locked host memory, either kind.
pub(super) enum PinnedMem {
    Registered(Registered),
    Alloc(cudarc::driver::PinnedHostSlice<u8>),
}

impl PinnedMem {
    pub(super) fn len(&self) -> usize {
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
pub(super) struct Registered {
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
pub(super) fn populated_map(len: usize) -> std::result::Result<memmap2::MmapMut, String> {
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
pub(super) fn touched_map(
    len: usize,
    stop: &AtomicBool,
) -> std::result::Result<memmap2::MmapMut, String> {
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
    pub(super) fn register(
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
pub(super) struct PinnedCache(pub(super) std::sync::Mutex<Vec<PinnedMem>>);

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

impl CudaAlloc {
    pub(super) fn new(
        ctx: Arc<CudaContext>,
        prefill: Option<Prefill>,
        pinned_alloc: bool,
    ) -> CudaAlloc {
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

/// Page-locks parts of read-only file maps for every context of the process
/// (`cuMemHostRegister` with `PORTABLE | READ_ONLY`), for [`crate::pipeline::direct`].
pub(super) struct FilePinner {
    pub(super) ctx: Arc<CudaContext>,
}

impl crate::backend::InputPinner for FilePinner {
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
