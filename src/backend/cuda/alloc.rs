//! The pools' allocator ([`CudaAlloc`]): a buffer of the [`Prefill`] made for the step, else
//! one freed by an earlier pipeline of the backend, else fresh page-locked memory
//! ([`super::pinned`]).

use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::early::Prefill;
use super::pinned::{pinned_len, Pinned, PinnedCache, PinnedMem, Registered};
use super::{derr, lock};
use crate::backend::{HostAlloc, HostBuf};
use crate::error::{Error, Result};
use crate::units::fmt_bytes;

/// Pinned (page-locked, cached) host memory from the first selected GPU's context, with a cache
/// of freed buffers.
///
/// Pinning is slow on the H200 host: `cuMemHostAlloc` runs at about 2.2–2.6 GiB/s however many
/// threads allocate, and freeing 4.5 GiB takes 0.6 s (tools/probes/cuda_startup_costs.py). Mapping the
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

    /// Let go of the prefill if no pipeline took it (its threads joined, its buffers freed): a
    /// backend kept idle must have no thread of its own left running.
    pub(super) fn drop_prefill(&self) {
        let p = lock(&self.prefill).take();
        drop(p);
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
