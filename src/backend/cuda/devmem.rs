//! Arrays that already live in GPU memory — a CUDA torch tensor, a CuPy array — handed to the
//! engine by the Python package: what it needs of the driver beside the lanes. Which GPU holds
//! a pointer, waiting for the caller's stream before reading, how much memory a GPU has free
//! (where a result may stay), and synchronous 2-D copies between GPU and host memory for the
//! paths that go through the host (a CPU lane reading a GPU array, a result written into one).
//! The fast path does not come here: a GPU lane copies a GPU array's blocks device to device
//! in [`super::lane`] (`HostRun::device`).
//!
//! Every function works on the GPU's primary context, the one torch, CuPy and the lanes use,
//! so the caller's pointers are valid in it. None panics when the driver is missing.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUmemorytype, CUDA_MEMCPY2D};
use cudarc::driver::CudaContext;

use super::derr;
use crate::error::{Error, Result};

/// GPU `device`'s primary context, current on this thread; an error (never a panic) where
/// there is no driver or no such GPU.
fn context(device: usize) -> Result<Arc<CudaContext>> {
    // SAFETY: only attempts to dlopen the driver library and reports success.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::backend(
            "cuda",
            "an array in GPU memory was given, but the CUDA driver library (libcuda.so.1) was not found",
        ));
    }
    let ctx = std::panic::catch_unwind(|| CudaContext::new(device))
        .map_err(|_| Error::backend("cuda", "the CUDA driver could not be initialised"))?
        .map_err(|e| derr(&format!("cannot open GPU {device}"), e))?;
    ctx.bind_to_thread()
        .map_err(|e| derr(&format!("cannot use GPU {device}"), e))?;
    Ok(ctx)
}

/// The ordinal of the GPU whose memory holds `addr` (a unified address); an error for host
/// memory or an address the driver does not know.
pub fn device_of(addr: u64) -> Result<usize> {
    context(0)?;
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

/// Wait until the work queued so far on `stream` (a `CUstream` handle of the caller's: torch's
/// or CuPy's current stream; 0 the legacy default stream) on GPU `device` is done, so that the
/// arrays it produces are complete before a lane reads them. With `stream = None`, the whole
/// GPU (its primary context) is waited for.
pub fn wait_for_stream(device: usize, stream: Option<usize>) -> Result<()> {
    let ctx = context(device)?;
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
        None => ctx
            .synchronize()
            .map_err(|e| derr(&format!("waiting for GPU {device}"), e)),
    }
}

/// (free, total) bytes of GPU `device`'s memory now.
pub fn memory(device: usize) -> Result<(u64, u64)> {
    let ctx = context(device)?;
    let (free, total) = ctx.mem_get_info().map_err(|e| derr("cuMemGetInfo", e))?;
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
/// host), on GPU `device`'s context, and wait for it.
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
    context(device)?;
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
