//! One GPU's lane ([`CudaLane`]): its context's streams (H2D, GEMM, D2H, and for fp32 a second
//! GEMM stream), its cuBLAS handles, every device buffer allocated once at start, and the
//! tickets (events) that tell the pipeline when an upload or download is done.
//!
//! Two GEMM streams (fp32): tiles take the two in turn, each tile's GEMMs in order on its own,
//! so that one tile's GEMM fills the SMs the last wave of the other's leaves idle. In core on
//! one H100 (`tools/probes/gemm_shape_rates.py --walk 32768 8192`), 32768² as 8192³ GEMMs ran
//! 1354–1364 ms on two streams against 1379–1393 ms on one (one 32768³ GEMM: 1345 ms); fp64 ran
//! slower on two (1423–1425 against 1364–1366 ms), so it keeps one.

mod start;

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{sys as blas_sys, CudaBlas};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    DriverError, LaunchConfig, PushKernelArg,
};

use super::early::Warming;
use super::kernels::{gemm_ex, let_go_of_blas, CheckBufs, CheckRing, CudaCheck, CHECK_RING};
use crate::backend::check::MAX_TILES as CHECK_MAX_TILES;
use crate::backend::{Dst, GemmDesc, HostBuf, HostRun, Lane, Ticket};
use crate::dtype::DType;
use crate::error::{DeviceError, Error, Result};
use crate::seam::{DeviceCheckSpec, DeviceStats, Precision};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    H2d,
    D2h,
}

pub(crate) struct CudaLane {
    ordinal: usize,
    name: String,
    ctx: Arc<CudaContext>,
    h2d: Arc<CudaStream>,
    comp: Arc<CudaStream>,
    d2h: Arc<CudaStream>,
    blas: Option<CudaBlas>,
    /// The second GEMM stream and its cuBLAS handle ([`gemm_streams`]), when the lane has one.
    second: Option<(Arc<CudaStream>, CudaBlas)>,
    /// Per accumulator, the GEMM stream (0: `comp`, 1: `second`) its tile runs on, set when
    /// the tile begins ([`Lane::begin_tile`]); the next tile takes `next_stream`.
    acc_stream: Vec<u8>,
    next_stream: u8,
    /// Per slot and GEMM stream, an event after the last GEMM on that stream that read the
    /// slot: an upload into the slot waits for both (cudarc's own tracking keeps one reader,
    /// the last, and a GEMM on the other stream may still be reading).
    slot_reads: Vec<[Option<Arc<CudaEvent>>; 2]>,
    /// With two GEMM streams: the first GEMM's start event, and every harvested GEMM's span
    /// (ms from it), so that the final GEMM time is the union of overlapping GEMMs, not their
    /// sum ([`Self::gemm_union_s`]); until then `stats.gemm_s` counts each GEMM's part after
    /// the latest end harvested before it (`gemm_last_end`: a live figure, low where a GEMM
    /// issued later ran earlier).
    gemm_base: Option<CudaEvent>,
    gemm_spans: Vec<(f64, f64)>,
    gemm_last_end: Option<CudaEvent>,
    /// The probe's warm-up GEMM of this lane's tile shape, waited for before the first GEMM.
    warming: Option<Arc<Warming>>,
    slots: Vec<CudaSlice<u8>>,
    accs: Vec<CudaSlice<u8>>,
    /// Per accumulator, an event after the last op on `comp` that wrote it: its download waits
    /// for that alone, not for every GEMM queued since ([`Self::after_acc`]).
    acc_done: Vec<Option<CudaEvent>>,
    landing: Vec<CudaSlice<u8>>,
    next_landing: usize,
    convert: Option<CudaFunction>,
    /// kernels/check.cu's `check_tiles`, when it compiled and loaded; without it the host
    /// checks directly uploaded blocks ([`crate::backend::check`]).
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
    /// `precision = "fp64_emulated"`: the int8 emulation's kernels and scratch.
    emulator: Option<super::emulate::Emulator>,
}

// SAFETY: the lane is moved to its own thread once and used only there; cudarc's handles are
// Send, and CudaBlas is Send + Sync.
unsafe impl Send for CudaLane {}

fn timing() -> Option<CUevent_flags> {
    Some(CUevent_flags::CU_EVENT_DEFAULT)
}

impl CudaLane {
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
            let mut ms = s.elapsed_ms(e).map_err(|x| self.err("event timing", x))? as f64;
            self.trace("gemm", s, e);
            if self.second.is_some() {
                let at = match &self.gemm_base {
                    Some(b) => b.elapsed_ms(s).map_err(|x| self.err("event timing", x))? as f64,
                    None => 0.0,
                };
                self.gemm_spans.push((at, at + ms));
            }
            let later = match &self.gemm_last_end {
                // Two streams: the part of this GEMM before the latest end so far was counted.
                Some(last) => {
                    let overlap = s
                        .elapsed_ms(last)
                        .map_err(|x| self.err("event timing", x))?;
                    ms -= (overlap as f64).clamp(0.0, ms);
                    last.elapsed_ms(e)
                        .map_err(|x| self.err("event timing", x))?
                        >= 0.0
                }
                None => true,
            };
            self.stats.gemm_s += ms * 1e-3;
            let (s, e) = self
                .gemm_events
                .pop_front()
                .expect("the front was just read");
            if later {
                self.gemm_last_end = Some(e);
            }
            if self.second.is_some() && self.gemm_base.is_none() {
                self.gemm_base = Some(s);
            }
        }
        Ok(())
    }

    /// The union of the harvested GEMMs' spans, in seconds (two GEMM streams).
    fn gemm_union_s(&mut self) -> f64 {
        let spans = &mut self.gemm_spans;
        spans.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (mut total, mut end) = (0.0, f64::NEG_INFINITY);
        for &(a, b) in spans.iter() {
            if b > end {
                total += b - a.max(end);
                end = b;
            }
        }
        total * 1e-3
    }

    /// The GEMM stream of accumulator `acc`'s tile, and its cuBLAS handle.
    fn stream_of(&self, acc: usize) -> (&Arc<CudaStream>, &CudaBlas) {
        let blas =
            || (self.blas.as_ref()).expect("the handle lives until release (no GEMM after it)");
        match (&self.second, self.acc_stream.get(acc)) {
            (Some((s, b)), Some(1)) => (s, b),
            _ => (&self.comp, blas()),
        }
    }

    /// Make the H2D stream wait for every GEMM that read `slot` before it is written again.
    fn before_slot_write(&self, slot: usize) -> Result<()> {
        for e in self.slot_reads.get(slot).into_iter().flatten().flatten() {
            self.h2d.wait(e).map_err(|x| self.err("stream wait", x))?;
        }
        Ok(())
    }
}

impl CudaLane {
    /// Note the last op on `comp` that wrote accumulator `acc` (just queued).
    fn mark_acc(&mut self, acc: usize) -> Result<()> {
        let e = (self.stream_of(acc).0)
            .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| self.err("event", e))?;
        if self.acc_done.len() <= acc {
            self.acc_done.resize_with(acc + 1, || None);
        }
        self.acc_done[acc] = Some(e);
        Ok(())
    }

    /// Make the D2H stream wait for accumulator `acc`'s last write before a download — for
    /// that op only, where [`Self::mark_acc`] noted it, else for all of `comp` — and before the
    /// download's timing event, so that D2H time is copy time only. A download issued while
    /// later GEMMs are queued (a tile that waited for an output lease) then starts as soon as
    /// its own tile is done, not after them.
    fn after_acc(&self, acc: usize) -> Result<()> {
        match self.acc_done.get(acc).and_then(|e| e.as_ref()) {
            Some(e) => self.d2h.wait(e),
            None => (self.d2h.join(&self.comp)).and_then(|()| match &self.second {
                Some((s, _)) => self.d2h.join(s),
                None => Ok(()),
            }),
        }
        .map_err(|e| self.err("stream wait", e))
    }

    /// Queue `copy` of accumulator `acc` (`bytes` of it) on the D2H stream, after the
    /// accumulator's last write ([`Self::after_acc`]) and between timing events: the one shape
    /// of [`Lane::download`] and [`Lane::download_into`], which differ only in where the bytes
    /// go. `what` names the copy in its error.
    fn copy_out(
        &mut self,
        acc: usize,
        bytes: usize,
        what: &str,
        copy: impl FnOnce(&CudaSlice<u8>, &Arc<CudaStream>) -> std::result::Result<(), DriverError>,
    ) -> Result<Ticket> {
        self.after_acc(acc)?;
        let start = self
            .d2h
            .record_event(timing())
            .map_err(|e| self.err("event", e))?;
        copy(&self.accs[acc], &self.d2h).map_err(|e| self.err(what, e))?;
        let end = self
            .d2h
            .record_event(timing())
            .map_err(|e| self.err("event", e))?;
        Ok(self.ticket(start, end, Kind::D2h, bytes as u64))
    }

    /// `acc[..elems] *= beta` on the compute stream, in the accumulator's type (f32, or f64
    /// for fp64): nothing for beta = 1, zeros for beta = 0 (C is not read), else cuBLAS scal.
    fn scale_acc(&mut self, acc: usize, elems: usize, beta: f64) -> Result<()> {
        if beta == 1.0 {
            return Ok(());
        }
        let ordinal = self.ordinal;
        let bytes = elems * self.host_dt.size();
        let (stream, handle) = {
            let (s, b) = self.stream_of(acc);
            (s.clone(), *b.handle())
        };
        if beta == 0.0 {
            let mut view = self.accs[acc].slice_mut(..bytes);
            return stream
                .memset_zeros(&mut view)
                .map_err(|e| self.err("zero accumulator", e));
        }
        let (b32, b64) = (beta as f32, beta);
        let n = elems as i32;
        let (ptr_c, _gc) = self.accs[acc].device_ptr_mut(&stream);
        // SAFETY: the accumulator belongs to this lane's context and holds at least `elems`
        // values of the host compute type (layout sizes it for tm·tn); beta points to a live
        // local of that type; the handle's stream is the tile's GEMM stream, on which the guard
        // records the access.
        let status = unsafe {
            if self.host_dt == DType::F64 {
                blas_sys::cublasDscal_v2(handle, n, &b64, ptr_c as *mut f64, 1)
            } else {
                blas_sys::cublasSscal_v2(handle, n, &b32, ptr_c as *mut f32, 1)
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
        if let Dst::Slot(s) = dst {
            self.before_slot_write(s)?;
        }
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

    fn gpu(&self) -> Option<usize> {
        Some(self.ordinal)
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
    ) -> Option<Box<dyn crate::backend::check::DeviceCheck>> {
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
                block_dim: (crate::backend::check::THREADS as u32, 1, 1),
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
        self.before_slot_write(slot)?;
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
            // A run in GPU memory (an array already on this GPU) is given by its unified
            // address: a device-to-device copy.
            let (src_type, src_host, src_device) = match run.device {
                true => (
                    CUmemorytype::CU_MEMORYTYPE_UNIFIED,
                    std::ptr::null(),
                    run.host as u64,
                ),
                false => (
                    CUmemorytype::CU_MEMORYTYPE_HOST,
                    run.host as *const c_void,
                    0,
                ),
            };
            let copy = CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: src_type,
                srcHost: src_host,
                srcDevice: src_device,
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
            // pipeline waits for the ticket), or in a GPU array that the caller keeps alive
            // for the whole call (the Python package holds a reference to it); the destination
            // rectangle lies inside the view (the runs tile the dense block of `elems`
            // elements).
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

    fn begin_tile(&mut self, acc: usize) {
        if self.second.is_some() {
            if self.acc_stream.len() <= acc {
                self.acc_stream.resize(acc + 1, 0);
            }
            self.acc_stream[acc] = self.next_stream;
            self.next_stream ^= 1;
        }
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
            self.scale_acc(acc, g.m * g.n, g.beta)?;
            return self.mark_acc(acc);
        }
        let (ordinal, lane) = (self.ordinal, self.lane);
        let (stream, handle) = {
            let (s, b) = self.stream_of(acc);
            (s.clone(), *b.handle())
        };
        let start;
        {
            let (acc_buf, rest) = (&mut self.accs[acc], &self.slots);
            let (ptr_b, _gb) = rest[b_slot].device_ptr(&stream);
            let (ptr_a, _ga) = rest[a_slot].device_ptr(&stream);
            let (ptr_c, _gc) = acc_buf.device_ptr_mut(&stream);
            // After the pointers: taking them makes the stream wait for the buffers' last use
            // on the other streams, above all the accumulator's download of its previous tile
            // (the uploads were waited for in `upload`). That wait is not GEMM time; it was
            // counted as such before, which showed staging-bound tf32 runs' GEMMs at half
            // cuBLAS's rate.
            start = stream
                .record_event(timing())
                .map_err(|e| Error::device(lane, format!("cuda:{ordinal}"), "event", e))?;
            // fp64_emulated: int8 GEMMs where the accuracy contract holds, else (NaN/Inf, no
            // affordable count of moduli) the DGEMM below, counted either way.
            let native = match self.emulator.as_mut() {
                None => true,
                Some(em) => {
                    // SAFETY: as for the GEMM below (the same buffers and stream).
                    let r = unsafe { em.gemm(&stream, handle, g, ptr_a, ptr_b, ptr_c) }.map_err(
                        |(what, e)| {
                            Error::device(lane, format!("cuda:{ordinal}"), what, e.to_string())
                        },
                    )?;
                    crate::backend::ozaki::record(&mut self.stats.emulation, r);
                    r.is_err()
                }
            };
            // SAFETY: all three buffers belong to this lane's context and are at least as large
            // as the GEMM reads/writes (layout sizes slots for tm·tk and tk·tn elements and
            // accumulators for tm·tn); the handle's stream is `stream` (the tile's GEMM stream,
            // `stream_of`), on which the guards above record the accesses.
            if native {
                unsafe { gemm_ex(handle, self.precision, g, ptr_a, ptr_b, ptr_c) }.map_err(
                    |e| Error::device(lane, format!("cuda:{ordinal}"), "cublasGemmEx", e),
                )?;
            }
        }
        let end = stream
            .record_event(timing())
            .map_err(|e| self.err("event", e))?;
        if self.second.is_some() {
            // The slots' readers on this stream, for their next upload (`before_slot_write`).
            let read = Arc::new(
                stream
                    .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                    .map_err(|e| self.err("event", e))?,
            );
            let k = usize::from(self.acc_stream.get(acc) == Some(&1));
            for s in [a_slot, b_slot] {
                if self.slot_reads.len() <= s {
                    self.slot_reads.resize_with(s + 1, Default::default);
                }
                self.slot_reads[s][k] = Some(read.clone());
            }
        }
        self.gemm_events.push_back((start, end));
        self.mark_acc(acc)?;
        self.stats.gemms += 1;
        if self.gemm_events.len() > 64 {
            self.harvest_gemms(false)?;
        }
        Ok(())
    }

    fn download(&mut self, acc: usize, elems: usize, dst: &mut HostBuf) -> Result<Ticket> {
        let bytes = elems * self.host_dt.size();
        self.copy_out(acc, bytes, "D2H copy", |a, d2h| {
            d2h.memcpy_dtoh(&a.slice(..bytes), &mut dst.bytes_mut()[..bytes])
        })
    }

    fn download_into(&mut self, acc: usize, r: &crate::seam::OutRect) -> Result<Ticket> {
        use cudarc::driver::sys::{cuMemcpy2DAsync_v2, CUmemorytype, CUDA_MEMCPY2D};
        let r = *r;
        self.copy_out(
            acc,
            r.rows * r.row_len,
            "D2H copy into the output",
            |a, d2h| {
                let view = a.slice(..r.rows * r.row_len);
                let (sptr, guard) = view.device_ptr(d2h);
                // A GPU array (on this lane's GPU) by its unified address: device to device.
                let (dst_type, dst_host, dst_device) = match r.gpu {
                    Some(_) => (
                        CUmemorytype::CU_MEMORYTYPE_UNIFIED,
                        std::ptr::null_mut(),
                        r.addr,
                    ),
                    None => (CUmemorytype::CU_MEMORYTYPE_HOST, r.addr as *mut c_void, 0),
                };
                let copy = CUDA_MEMCPY2D {
                    srcXInBytes: 0,
                    srcY: 0,
                    srcMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
                    srcHost: std::ptr::null(),
                    srcDevice: sptr,
                    srcArray: std::ptr::null_mut(),
                    srcPitch: r.row_len,
                    dstXInBytes: 0,
                    dstY: 0,
                    dstMemoryType: dst_type,
                    dstHost: dst_host,
                    dstDevice: dst_device,
                    dstArray: std::ptr::null_mut(),
                    dstPitch: r.pitch,
                    WidthInBytes: r.row_len,
                    Height: r.rows,
                };
                // SAFETY: the source is the first `rows · row_len` bytes of this lane's accumulator
                // (dense rows of `row_len`); the destination rectangle lies in page-locked host
                // memory or GPU memory that the output's sink keeps alive and that no one else
                // writes until this copy's ticket is done (the pipeline hands each block to one
                // lane and waits for the ticket before writeback reads it).
                let done = unsafe { cuMemcpy2DAsync_v2(&copy, d2h.cu_stream()) }.result();
                drop(guard);
                done
            },
        )
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
        // A failed device: nothing to wait for (the next op reports the error).
        match self.harvest_gemms(false) {
            Ok(()) => self.gemm_events.len(),
            Err(_) => 0,
        }
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
        if let Some((s, _)) = &self.second {
            let _ = s.synchronize();
        }
        let _ = self.harvest_gemms(true);
        if !self.gemm_spans.is_empty() {
            self.stats.gemm_s = self.gemm_union_s();
        }
        self.stats.clone()
    }

    fn release(&mut self) {
        let t = std::time::Instant::now();
        self.stats();
        // The cuBLAS handles first, then every device buffer.
        if let Some(b) = self.blas.take() {
            let_go_of_blas(&self.ctx, b);
        }
        if let Some((_, b)) = self.second.take() {
            let_go_of_blas(&self.ctx, b);
        }
        self.slot_reads.clear();
        self.slots.clear();
        self.accs.clear();
        self.acc_done.clear();
        self.landing.clear();
        // fp64_emulated's scratch (3.25 GiB at 8192³ tiles) with the rest.
        self.emulator = None;
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
        if let Some((s, _)) = &self.second {
            s.wait(&end).map_err(|e| self.err("stream wait", e))?;
        }
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
        if let Some((_, b)) = self.second.take() {
            let_go_of_blas(&self.ctx, b);
        }
        self.slot_reads.clear();
        self.gemm_last_end = None;
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
