//! Page-locked host memory: the pools' pinned buffers (mapped, populated and registered with the
//! driver, or from `cuMemHostAlloc`; cached between pipelines by `super::alloc`), and the
//! registration of read-only file maps that lets the GPUs copy inputs straight from the files'
//! pages ([`FilePinner`], for `crate::pipeline::direct`).

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::derr;
use crate::error::Result;

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
    pub(super) fn ptr(&mut self) -> Result<*mut u8> {
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

/// [`huge_map`] for a [`Prefill`](super::early::Prefill), every page touched; gives up when `stop` is set between
/// pieces of [`POPULATE_PIECE`].
///
/// Touched, not populated with `MADV_POPULATE_WRITE`: a page fault takes only the lock of its
/// own mapping (Linux ≥ 6.4), while `MADV_POPULATE_WRITE` takes the process's memory-map lock,
/// which every `mmap` of `cuInit` and of the context's creation waits for. Beside the prefill,
/// 32768² fp32 on one H200 (2026-12-02 calls 2–4, docs/measurements/2026-12-02-h200-*.log):
/// populating 2.25 GiB took 0.22–0.32 s advised and 0.06–0.08 s touched; the context 0.26–0.30
/// s and 0.11–0.14 s. A fault cannot fail softly where memory runs out (nor can populating
/// reliably: the OOM killer may act first), so [`Prefill::new`](super::early::Prefill::new) prefills only what fits in
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
    pub(super) fn new(
        ctx: &Arc<CudaContext>,
        len: usize,
    ) -> std::result::Result<Registered, String> {
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

/// Owns a pinned allocation while a [`HostBuf`](crate::backend::HostBuf) uses it; gives it back to the cache on drop.
pub(super) struct Pinned {
    pub(super) mem: Option<PinnedMem>,
    pub(super) cache: Arc<PinnedCache>,
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

/// The length of the pinned allocation that holds `bytes`: whole pages, at least one. The
/// prefill's guess must round as the allocator does, or no pool would find its buffers.
pub(crate) fn pinned_len(bytes: usize) -> usize {
    bytes.div_ceil(4096).max(1) * 4096
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
