//! Arrays that already live in GPU memory — a CUDA torch tensor, a CuPy array — handed to the
//! engine by the Python package: what it needs of the driver beside the lanes. Which GPU holds
//! a pointer, waiting for the caller's stream before reading, how much memory a GPU has free
//! (where a result may stay), and synchronous 2-D copies between GPU and host memory for the
//! paths that go through the host (a CPU lane reading a GPU array, a result written into one).
//! The fast path does not come here: a GPU lane copies a GPU array's blocks device to device
//! in [`super::lane`] (`HostRun::device`).
//!
//! Every function works on the GPU's primary context, the one torch, CuPy and the lanes use,
//! so the caller's pointers are valid in it, held open for the life of the process; the
//! caller's current context is current again when a function returns. None panics when the
//! driver is missing.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUmemorytype, CUDA_MEMCPY2D};
use cudarc::driver::CudaContext;

use super::derr;
use crate::error::{Error, Result};

/// The primary contexts opened here, one per GPU, held for the life of the process (retaining
/// and releasing one per copy would cost a driver round trip each, and releasing the last
/// reference destroys the context).
static CONTEXTS: std::sync::OnceLock<std::sync::Mutex<HashMap<usize, Arc<CudaContext>>>> =
    std::sync::OnceLock::new();

/// The driver, loaded and initialised; an error (never a panic) where there is none.
fn driver() -> Result<()> {
    // SAFETY: only attempts to dlopen the driver library and reports success.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::backend(
            "cuda",
            "the CUDA driver library (libcuda.so.1) was not found",
        ));
    }
    match std::panic::catch_unwind(CudaContext::device_count) {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(derr("cuInit failed", e)),
        Err(_) => Err(Error::backend(
            "cuda",
            "the CUDA driver could not be initialised",
        )),
    }
}

/// While it lives, GPU `device`'s primary context is current on this thread; dropping it makes
/// the caller's context current again (torch and CuPy keep their current device in it).
struct OnGpu {
    ctx: Arc<CudaContext>,
    before: sys::CUcontext,
}

impl Drop for OnGpu {
    fn drop(&mut self) {
        // SAFETY: restores the context that was current (possibly none) when this was made.
        unsafe { sys::cuCtxSetCurrent(self.before) };
    }
}

fn on_gpu(device: usize) -> Result<OnGpu> {
    driver()?;
    let ctx = {
        let mut m = CONTEXTS
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match m.get(&device) {
            Some(c) => c.clone(),
            None => {
                let c = std::panic::catch_unwind(|| CudaContext::new(device))
                    .map_err(|_| {
                        Error::backend("cuda", "the CUDA driver could not be initialised")
                    })?
                    .map_err(|e| derr(&format!("cannot open GPU {device}"), e))?;
                m.insert(device, c.clone());
                c
            }
        }
    };
    let mut before: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes the current context handle (possibly null) into `before`.
    unsafe { sys::cuCtxGetCurrent(&mut before) }
        .result()
        .map_err(|e| derr("cuCtxGetCurrent", e))?;
    let guard = OnGpu { ctx, before };
    guard
        .ctx
        .bind_to_thread()
        .map_err(|e| derr(&format!("cannot use GPU {device}"), e))?;
    Ok(guard)
}

/// The ordinal of the GPU whose memory holds `addr` (a unified address); an error for host
/// memory or an address the driver does not know.
pub fn device_of(addr: u64) -> Result<usize> {
    // With unified addressing the attributes of a pointer need no current context.
    driver()?;
    let mut kind: u32 = 0;
    // SAFETY: the attribute is written into a u32 (CUmemorytype), as the driver documents.
    unsafe {
        sys::cuPointerGetAttribute(
            &mut kind as *mut u32 as *mut c_void,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            addr,
        )
    }
    .result()
    .map_err(|e| {
        derr(
            &format!("address {addr:#x} is not GPU memory the driver knows"),
            e,
        )
    })?;
    if kind != CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return Err(Error::backend(
            "cuda",
            format!("address {addr:#x} is not in GPU memory (memory type {kind})"),
        ));
    }
    let mut ordinal: i32 = -1;
    // SAFETY: as above; the ordinal is an int.
    unsafe {
        sys::cuPointerGetAttribute(
            &mut ordinal as *mut i32 as *mut c_void,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            addr,
        )
    }
    .result()
    .map_err(|e| derr("cuPointerGetAttribute(DEVICE_ORDINAL)", e))?;
    usize::try_from(ordinal)
        .map_err(|_| Error::backend("cuda", "the driver gave no device ordinal"))
}

/// Whether the `len` bytes of host memory at `addr` are page-locked for the CUDA driver
/// (allocated by it — a pinned torch tensor, `cupyx.empty_pinned` — or registered with it), so
/// that a GPU's copy engine writes them directly ([`crate::seam::OutRect`]). Both ends are
/// asked (one array's buffer is one allocation). False without a driver, for pageable memory,
/// and for GPU memory.
pub fn page_locked(addr: u64, len: usize) -> bool {
    if len == 0 || driver().is_err() {
        return false;
    }
    let host = |a: u64| {
        let mut kind: u32 = 0;
        // SAFETY: the attribute is written into a u32 (CUmemorytype), as the driver documents;
        // with unified addressing a pointer's attributes need no current context.
        let r = unsafe {
            sys::cuPointerGetAttribute(
                &mut kind as *mut u32 as *mut c_void,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                a,
            )
        };
        r.result().is_ok() && kind == CUmemorytype::CU_MEMORYTYPE_HOST as u32
    };
    host(addr) && host(addr + len as u64 - 1)
}

/// Wait until the work queued so far on `stream` (a `CUstream` handle of the caller's: torch's
/// or CuPy's current stream; 0 the legacy default stream) on GPU `device` is done, so that the
/// arrays it produces are complete before a lane reads them. With `stream = None`, the whole
/// GPU (its primary context) is waited for.
pub fn wait_for_stream(device: usize, stream: Option<usize>) -> Result<()> {
    let g = on_gpu(device)?;
    match stream {
        // SAFETY: the handle is one the caller's framework created in this process (or 0, 1,
        // 2: the default streams); synchronizing it only waits.
        Some(s) => unsafe { sys::cuStreamSynchronize(s as sys::CUstream) }
            .result()
            .map_err(|e| {
                derr(
                    &format!("waiting for the caller's stream on GPU {device}"),
                    e,
                )
            }),
        None => g
            .ctx
            .synchronize()
            .map_err(|e| derr(&format!("waiting for GPU {device}"), e)),
    }
}

/// Wait until every copy [`copy_2d`] issued to GPU `device` has landed (a copy from pageable
/// host memory returns once its data is staged, before it reaches the GPU).
pub fn finish(device: usize) -> Result<()> {
    let g = on_gpu(device)?;
    g.ctx
        .synchronize()
        .map_err(|e| derr(&format!("waiting for the copies to GPU {device}"), e))
}

/// (free, total) bytes of GPU `device`'s memory now.
pub fn memory(device: usize) -> Result<(u64, u64)> {
    let g = on_gpu(device)?;
    let (free, total) = g.ctx.mem_get_info().map_err(|e| derr("cuMemGetInfo", e))?;
    Ok((free as u64, total as u64))
}

/// One side of a [`copy_2d`]: `pitch` bytes between rows from `addr`, in GPU memory (a unified
/// address) or in host memory.
#[derive(Clone, Copy, Debug)]
pub struct Side {
    /// The first row's first byte.
    pub addr: u64,
    /// Bytes from one row to the next.
    pub pitch: usize,
    /// `addr` is GPU memory (else host memory).
    pub on_gpu: bool,
}

/// Copy `rows` rows of `row_len` bytes from `src` to `dst` (either side on a GPU or on the
/// host), on GPU `device`'s context. A copy from pageable host memory to the GPU may return
/// before the data has landed ([`finish`] waits for it); every other copy is done on return.
///
/// # Safety
/// Both rectangles must be valid for the copy: `rows` rows of `row_len` bytes, `pitch` apart,
/// readable at `src` and writable at `dst`, not written by anyone else meanwhile.
pub unsafe fn copy_2d(
    device: usize,
    src: Side,
    dst: Side,
    row_len: usize,
    rows: usize,
) -> Result<()> {
    let _on = on_gpu(device)?;
    let side = |s: Side| match s.on_gpu {
        true => (
            CUmemorytype::CU_MEMORYTYPE_UNIFIED,
            std::ptr::null_mut::<c_void>(),
            s.addr,
        ),
        false => (CUmemorytype::CU_MEMORYTYPE_HOST, s.addr as *mut c_void, 0),
    };
    let (st, sh, sd) = side(src);
    let (dt, dh, dd) = side(dst);
    let copy = CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: st,
        srcHost: sh,
        srcDevice: sd,
        srcArray: std::ptr::null_mut(),
        srcPitch: src.pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: dt,
        dstHost: dh,
        dstDevice: dd,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst.pitch,
        WidthInBytes: row_len,
        Height: rows,
    };
    // SAFETY: the caller vouches for both rectangles; the copy is synchronous.
    unsafe { sys::cuMemcpy2D_v2(&copy) }
        .result()
        .map_err(|e| derr(&format!("copy on GPU {device}"), e))
}
