//! The compute seam: one [`Lane`] per device, and the host memory the pipeline stages into.
//!
//! Pipeline code sees only this module's types: host buffers, slot and accumulator indices,
//! and tickets that say when asynchronous work is finished. It never sees streams, contexts or
//! device pointers. The CPU backend ([`cpu`]) is synchronous (every ticket is done at once); the
//! CUDA backend ([`cuda`]) queues copies and GEMMs on streams and completes tickets with events.
//!
//! Contract for every lane:
//! - Slots (input tiles) and accumulators (output tiles) are allocated once, at construction,
//!   from the [`Layout`](crate::plan::layout::Layout); a lane never allocates on the hot path.
//! - `upload` and `download` return a [`Ticket`]; the host buffer passed in must not be touched
//!   or dropped until `done`/`wait` says the ticket has completed. The device lane stage keeps
//!   the buffer's lease alive exactly that long.
//! - Work on one lane executes in the order it was issued as far as results are concerned: a
//!   GEMM sees every upload issued before it, a download sees every GEMM before it, an upload
//!   into a slot waits for GEMMs issued earlier that read the slot.

pub(crate) mod check;
pub(crate) mod cpu;
pub(crate) mod cuda;
/// Arrays already in GPU memory (for the Python package): which GPU, the caller's stream, copies.
pub use cuda::devmem;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub(crate) mod fold;
pub mod kept;
pub(crate) mod ozaki;
pub(crate) mod rates;
#[cfg(feature = "fault-injection")]
pub mod sim;

use std::ptr::NonNull;

use crate::error::Result;
use crate::plan::layout::Layout;
pub(crate) use crate::seam::MemorySpace;
pub use crate::seam::{Caps, DeviceStats, MAX_THREADS};
use crate::seam::{DeviceCheckSpec, OutRect, Precision};
pub(crate) use cuda::EarlySpec;

/// Host memory owned by a backend (plain on the CPU, page-locked on a GPU), 4096-byte aligned.
pub struct HostBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// Keeps the allocation alive; dropped (freed) with the buffer.
    _owner: Box<dyn Send + Sync>,
}

// SAFETY: a HostBuf is the unique handle to its allocation (no aliasing handles exist), and the
// owner it carries is Send + Sync, so moving or sharing it between threads is sound.
unsafe impl Send for HostBuf {}
unsafe impl Sync for HostBuf {}

impl HostBuf {
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes for as long as `owner` lives, and
    /// nothing else may access that memory while this HostBuf exists (other than DMA that the
    /// lane contract orders).
    pub(crate) unsafe fn from_raw(
        ptr: NonNull<u8>,
        len: usize,
        owner: Box<dyn Send + Sync>,
    ) -> HostBuf {
        HostBuf {
            ptr,
            len,
            _owner: owner,
        }
    }

    /// Ordinary heap memory, 4096-aligned (backed by a Vec of pages). Refused memory (a
    /// process limit such as `ulimit -v`, a machine short of memory) is an error saying what
    /// to lower, not the allocator's abort.
    pub(crate) fn heap(len: usize) -> Result<HostBuf> {
        #[repr(C, align(4096))]
        struct Page([u8; 4096]);
        let pages = len.div_ceil(4096).max(1);
        let mut v: Vec<Page> = Vec::new();
        v.try_reserve_exact(pages).map_err(|_| {
            crate::error::Error::backend(
                "host memory",
                format!(
                    "cannot allocate a {} buffer for the pipeline (refused by the system: a process memory limit such as `ulimit -v`, or the machine is short of memory); lower engine.host_memory (`plan` shows what a step allocates) or raise the limit",
                    crate::units::fmt_bytes(len as u64)
                ),
            )
        })?;
        // SAFETY: Page is plain bytes; zero-initialise every page before use.
        unsafe {
            std::ptr::write_bytes(v.as_mut_ptr(), 0, pages);
            v.set_len(pages);
        }
        let ptr = NonNull::new(v.as_mut_ptr() as *mut u8).expect("Vec pointer is non-null");
        // SAFETY: the Vec's heap block does not move when the Vec is moved into the Box, lives as
        // long as the owner, and is `pages*4096 >= len` bytes.
        Ok(unsafe { HostBuf::from_raw(ptr, len, Box::new(v)) })
    }

    /// Length in bytes (the simulated lane's raw copies need it).
    #[cfg(feature = "fault-injection")]
    pub(crate) fn len(&self) -> usize {
        self.len
    }
    /// Start of the buffer (the simulated lane copies on a helper thread through it).
    #[cfg(feature = "fault-injection")]
    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: valid for len bytes while self lives (from_raw contract).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusive access from Rust code.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// Allocates the pipeline's host buffers: pinned memory on a GPU, heap memory on the CPU.
pub trait HostAlloc: Send + Sync {
    /// Allocate a host buffer of `bytes` bytes for the pipeline's pools.
    fn alloc_host(&self, bytes: usize) -> Result<HostBuf>;
    /// The pools of a pipeline of the plan step at `step` ([`Step::order`]; `(0, 0)` for a
    /// lone product) are all allocated: memory prepared ahead for this step or an earlier one
    /// that no pool took can go (the CUDA backend's prefill, made for the step with the
    /// largest pools).
    ///
    /// [`Step::order`]: crate::plan::Step::order
    fn pools_made(&self, _step: (usize, usize)) {}
    /// An allocator of the same buffers that the pipeline can keep (a lazy pool's, which
    /// allocates while the stages run: [`crate::pipeline::pool::Pool::lazy`]); `None` where
    /// there is none, and pools are then allocated up front.
    fn shared(&self) -> Option<std::sync::Arc<dyn HostAlloc>> {
        None
    }
    /// What page-locks parts of the input files' maps so that the devices copy from them
    /// directly (`engine.staging`, [`crate::pipeline::direct`]); `None` where the backend's
    /// devices cannot (the CPU, a GPU without read-only registration).
    fn input_pinner(&self) -> Option<std::sync::Arc<dyn InputPinner>> {
        None
    }
}

/// Ordinary heap memory for the pools of backends that need nothing else (the CPU's).
pub(crate) struct HeapAlloc;

impl HostAlloc for HeapAlloc {
    fn alloc_host(&self, bytes: usize) -> Result<HostBuf> {
        HostBuf::heap(bytes)
    }
}

/// Page-locks (and releases) ranges of read-only file maps for the devices' copy engines.
pub trait InputPinner: Send + Sync {
    /// Page-lock `len` bytes at `ptr` (page-aligned, inside a live read-only map) for every
    /// device of the backend. Faults in pages not in memory.
    fn register(&self, ptr: *const u8, len: usize) -> std::result::Result<(), String>;
    /// Release a range [`Self::register`] locked; no copy may use it afterwards.
    fn unregister(&self, ptr: *const u8);
    /// Whether registering locks memory (false for the CPU's lanes, which read the map as it
    /// is): then nothing is counted against the budget or reported as page-locked.
    fn locks(&self) -> bool {
        true
    }
    /// The most that may be registered at once and the size of one registration, where the
    /// backend fixes them (the simulated devices' tests: small); `None`: half the memory the
    /// host can spare, and 32 MiB ([`crate::pipeline::direct`]).
    fn limits(&self) -> Option<(u64, u64)> {
        None
    }
}

/// One rectangle of an upload straight from a page-locked file map
/// ([`Lane::upload_runs`]): `rows` rows of `row_len` bytes, `host_pitch` bytes apart at `host`,
/// land `dst_pitch` bytes apart from byte `dst_off` of the destination. With `device`, `host`
/// is an address in GPU memory instead (an array already on a GPU), which only a lane on that
/// GPU gets ([`Lane::gpu`]): a device-to-device copy.
#[derive(Clone, Copy, Debug)]
pub struct HostRun {
    pub(crate) host: *const u8,
    pub(crate) device: bool,
    pub(crate) host_pitch: usize,
    pub(crate) dst_off: usize,
    pub(crate) dst_pitch: usize,
    pub(crate) row_len: usize,
    pub(crate) rows: usize,
}

// SAFETY: a HostRun only points into a map that the upload holding it keeps alive and
// page-locked (`pipeline::direct::DirectUpload`); it is read by the device (or, on the CPU and
// the simulated devices, copied by the lane while the upload holding it is alive).
unsafe impl Send for HostRun {}
unsafe impl Sync for HostRun {}

/// Identifies asynchronous work issued on a lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket(pub(crate) u64);

/// Where an upload lands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dst {
    /// An input-tile slot (converted to the device input type if that differs).
    Slot(usize),
    /// An accumulator (C0 tiles; host compute type).
    Acc(usize),
}

/// One GEMM on a lane: `acc = alpha·op(A)·op(B) + beta·acc`, row-major.
///
/// The slot for A holds the stored block densely: `m×k` (lda = k) or, if `a_trans`, `k×m`
/// (lda = m). Likewise B: `k×n` or, if `b_trans`, `n×k`. The accumulator is `m×n` dense.
#[derive(Clone, Copy, Debug)]
pub struct GemmDesc {
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) a_trans: bool,
    pub(crate) b_trans: bool,
    pub(crate) alpha: f64,
    /// 0 replaces the accumulator, 1 accumulates, anything else scales C0.
    pub(crate) beta: f64,
}

/// A device's worth of compute: slots, accumulators, and ordered asynchronous work.
pub trait Lane: Send {
    /// Human name ("cpu", "cuda:0 NVIDIA H200").
    fn name(&self) -> String;
    /// Called once on the thread that will drive the lane, before any other call.
    fn bind_thread(&mut self) -> Result<()> {
        Ok(())
    }
    /// Copy the first `elems` host-compute-type elements of `src` into `dst`.
    fn upload(&mut self, src: &HostBuf, elems: usize, dst: Dst) -> Result<Ticket>;
    /// Whether [`Lane::upload_runs`] works on this lane (its device copies from page-locked
    /// file maps that [`HostAlloc::input_pinner`] registered).
    fn uploads_runs(&self) -> bool {
        false
    }
    /// Copy a block of `elems` host-compute-type elements, given as rectangles of page-locked
    /// host memory, into input slot `slot` (densely, as [`Lane::upload`] would).
    fn upload_runs(&mut self, _runs: &[HostRun], _elems: usize, _slot: usize) -> Result<Ticket> {
        Err(crate::error::Error::Usage(
            "this lane cannot upload from file maps (a bug: staging asked it to)".into(),
        ))
    }
    /// The GPU this lane runs on: its [`Self::upload_runs`] takes runs in that GPU's memory
    /// ([`HostRun::device`]) and copies them device to device. `None`: not a GPU's lane.
    fn gpu(&self) -> Option<usize> {
        None
    }
    /// Whether [`Self::check_upload`] can check blocks on the device ([`check`]).
    fn checks_uploads(&self) -> bool {
        false
    }
    /// Check the block the last [`Self::upload_runs`] copied, on the device, as `spec` says:
    /// queued after that copy; `None` when this lane cannot (the host then checks the block).
    fn check_upload(&mut self, _spec: &DeviceCheckSpec) -> Option<Box<dyn check::DeviceCheck>> {
        None
    }
    /// A tile starts on accumulator `acc`: its GEMMs follow (a lane with several GEMM streams
    /// puts each tile on one of them).
    fn begin_tile(&mut self, _acc: usize) {}
    /// Accumulate `op(A slot) · op(B slot)` into accumulator `acc` as `g` describes.
    fn gemm(&mut self, g: &GemmDesc, a_slot: usize, b_slot: usize, acc: usize) -> Result<()>;
    /// Copy the first `elems` elements of accumulator `acc` into `dst`.
    fn download(&mut self, acc: usize, elems: usize, dst: &mut HostBuf) -> Result<Ticket>;
    /// Copy accumulator `acc`'s block (`r.rows` rows of `r.row_len` bytes, dense) straight into
    /// the output's memory at `r`, which [`Caps::writes_directly`] said this lane writes, instead
    /// of into an output buffer ([`Self::download`]). The memory must stay alive and untouched
    /// until the ticket is done.
    fn download_into(&mut self, _acc: usize, _r: &OutRect) -> Result<Ticket> {
        Err(crate::error::Error::Usage(
            "this lane cannot write into the output in place (a bug: the pipeline asked it to)"
                .into(),
        ))
    }
    /// Whether the transfer `t` has finished (never blocks).
    fn done(&mut self, t: Ticket) -> Result<bool>;
    /// Block until the transfer `t` has finished.
    fn wait(&mut self, t: Ticket) -> Result<()>;
    /// Final device statistics (may wait for queued work).
    fn stats(&mut self) -> DeviceStats;
    /// Statistics of the work known to be finished so far, without waiting (for progress).
    fn live_stats(&mut self) -> DeviceStats {
        self.stats()
    }
    /// The lane's work is over (all its downloads waited for): wait for anything still queued,
    /// keep the statistics, and free the device buffers and handles now, while the last tiles
    /// are still being written, rather than when the pipeline ends. Nothing is uploaded,
    /// computed or downloaded afterwards; `stats` still answers.
    fn release(&mut self) {}
    /// Work queued on the device and not yet known to be finished (GEMMs; a simulated device
    /// counts every op), so that the pipeline can keep a lane from running too far ahead of
    /// its device. 0 where the work is done when called (the CPU), and once the device has
    /// failed (the next op reports it).
    fn in_flight(&mut self) -> usize {
        0
    }
    /// Block until fewer than `n` of [`Lane::in_flight`] remain.
    fn wait_in_flight_below(&mut self, _n: usize) -> Result<()> {
        Ok(())
    }
}

/// Which precision the lane computes in, and the host dtype it exchanges.
pub(crate) fn describe_precision(p: Precision) -> &'static str {
    match p {
        Precision::Fp32 => "fp32 (SGEMM)",
        Precision::Tf32 => "tf32 inputs, fp32 accumulate",
        Precision::Bf16 => "bf16 inputs, fp32 accumulate and output",
        Precision::Fp16 => "fp16 inputs, fp32 accumulate and output",
        Precision::Fp64 => "fp64 (DGEMM)",
        Precision::Fp64Emulated(_) => "fp64 emulated with exact integer GEMMs (Ozaki scheme II)",
    }
}

/// Round f32 values in place to what a reduced-precision GEMM input would see (TF32: 10-bit
/// mantissa, round to nearest even; bf16; fp16). Used by the CPU backend to emulate those modes
/// and by tests as the reference rounding.
pub(crate) fn round_inputs(p: Precision, xs: &mut [f32]) {
    match p {
        Precision::Tf32 => xs.iter_mut().for_each(|x| {
            if x.is_finite() {
                let b = x.to_bits();
                let r = b.wrapping_add(0xFFF + ((b >> 13) & 1)) & !0x1FFF;
                *x = f32::from_bits(r);
            }
        }),
        Precision::Bf16 => xs
            .iter_mut()
            .for_each(|x| *x = half::bf16::from_f32(*x).to_f32()),
        Precision::Fp16 => xs
            .iter_mut()
            .for_each(|x| *x = half::f16::from_f32(*x).to_f32()),
        Precision::Fp32 | Precision::Fp64 | Precision::Fp64Emulated(_) => {}
    }
}

/// A compute backend: its capabilities, its host allocator, and the lanes it makes for a
/// layout. The run loop, the planner and the pipeline see only this trait and [`Lane`].
pub trait Backend: HostAlloc {
    /// Human name ("cpu (2 threads)", "cuda:0 NVIDIA H200 + cuda:1 NVIDIA H200").
    fn name(&self) -> String;
    /// What the backend can do: memory space, tile ladder, staging depth, rounding, peak rates.
    fn caps(&self) -> &Caps;
    /// Worker threads for host-side work.
    fn threads(&self) -> usize;
    /// A one-line note for the user (e.g. why `auto` fell back to the CPU).
    fn note(&self) -> Option<String> {
        None
    }
    /// One lane per device, allocated for `layout`.
    fn lanes(&self, layout: &Layout, p: Precision) -> Result<Vec<Box<dyn Lane>>>;
    /// The same backend without lane `lane` (index into [`Backend::lanes`]' result), for
    /// failover; `None` when nothing would be left.
    fn without(&self, lane: usize) -> Option<Result<Box<dyn Backend>>>;
    /// Before a run of a backend kept since an earlier call ([`kept`]): measure again what may
    /// have changed meanwhile (the GPUs' free memory, which the `auto` device budget in
    /// [`Backend::caps`] comes from) and take back what [`Backend::idle`] gave up. An error
    /// means it cannot run again; it is dropped and a new one made.
    fn refresh(&mut self) -> Result<()> {
        Ok(())
    }
    /// After a run, before the backend waits for another call ([`kept`]): give back what only
    /// a running step needs (the GPUs' memory pools, trimmed, their release threshold restored).
    fn idle(&mut self) {}
}

/// Number of worker threads `threads = 0` means.
pub(crate) fn resolve_threads(threads: usize) -> usize {
    if threads > 0 {
        threads
    } else {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    }
}

/// How to build a backend beyond the plan's `[engine]`: the settings read at the edge of the
/// process ([`crate::config`]), and what `run` worked out ahead for a CUDA backend.
#[derive(Debug, Default)]
pub(crate) struct BackendOptions {
    /// Pin the CUDA backend's host buffers with `cuMemHostAlloc` rather than registering
    /// memory it mapped (`MGMM_PINNED_ALLOC`, [`crate::config::pinned_alloc`]).
    pub(crate) pinned_alloc: bool,
    /// What the first CUDA pipeline will allocate, to prepare while the driver starts.
    pub(crate) early: Option<EarlySpec>,
}

/// Choose the backend for `engine`: `cpu`, `cuda` (an error if no GPU is usable), or `auto`
/// (every visible GPU if the driver loads and one exists, else the CPU with a note).
pub fn select(engine: &crate::plan::Engine) -> Result<Box<dyn Backend>> {
    let opts = BackendOptions {
        pinned_alloc: crate::config::pinned_alloc(),
        early: None,
    };
    select_with(engine, opts)
}

/// [`select`] with `opts`: a CUDA backend starts what [`BackendOptions::early`] describes
/// as its driver comes up (freed, the populating called off, when the backend is not CUDA
/// after all).
pub(crate) fn select_with(
    engine: &crate::plan::Engine,
    opts: BackendOptions,
) -> Result<Box<dyn Backend>> {
    use crate::plan::BackendKind;
    let pinned = opts.pinned_alloc;
    let early = opts.early.map(|s| cuda::EarlyStart::new(s, pinned));
    match engine.backend {
        BackendKind::Cpu => Ok(Box::new(cpu::CpuBackend::new(engine.threads, None))),
        BackendKind::Cuda => match cuda::CudaBackend::select(engine, early, pinned) {
            Ok(b) => Ok(Box::new(b)),
            // Say which setting asked for it, and the way out (a new user's error named neither).
            Err(crate::error::Error::Backend { backend, msg }) => Err(crate::error::Error::Backend {
                backend,
                msg: format!(
                    "{msg}; engine.backend = \"cuda\" asks for the GPUs: set backend = \"auto\" (which computes on the CPU where no GPU can be used) or \"cpu\""
                ),
            }),
            Err(e) => Err(e),
        },
        #[cfg(feature = "fault-injection")]
        BackendKind::Sim => Ok(Box::new(sim::SimBackend::new(engine))),
        #[cfg(not(feature = "fault-injection"))]
        BackendKind::Sim => Err(crate::error::Error::Usage(
            "engine.backend = \"sim\" (simulated devices) exists only in test builds (cargo feature fault-injection); use \"auto\", \"cpu\" or \"cuda\"".into(),
        )),
        BackendKind::Auto => match cuda::CudaBackend::select(engine, early, pinned) {
            Ok(s) => Ok(Box::new(s)),
            Err(e) => {
                // GPUs named in the plan make the fallback worth more than a note: the Python
                // package raises a RuntimeWarning on this wording ("devices = [").
                let asked = match &engine.devices {
                    crate::plan::Devices::List(l) => format!(
                        "; engine.devices = {l:?} asked for GPUs: set backend = \"cuda\" to make this an error, or backend = \"cpu\""
                    ),
                    crate::plan::Devices::All => String::new(),
                };
                Ok(Box::new(cpu::CpuBackend::new(
                    engine.threads,
                    Some(format!("backend auto: using the CPU ({e}){asked}")),
                )))
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::HostBuf;

    /// Memory the system refuses is an error naming the buffer and what to lower, not the
    /// allocator's abort (a `ulimit -v` under a batch system; here, more than any machine has).
    #[test]
    fn refused_host_memory_is_an_error_saying_what_to_lower() {
        let e = HostBuf::heap(1 << 60)
            .err()
            .expect("2^60 bytes cannot be allocated");
        let m = e.to_string();
        assert!(
            m.contains("cannot allocate a 1048576.00 TiB buffer")
                && m.contains("lower engine.host_memory"),
            "{m}"
        );
        let b = HostBuf::heap(5000).unwrap();
        assert!(b.bytes().len() == 5000 && b.bytes().iter().all(|&x| x == 0));
    }

    /// Which outputs' memory each backend's lanes write themselves (decision 0021): the CPU any
    /// host memory, a GPU page-locked host memory and GPU memory, a simulated GPU page-locked
    /// host memory only (its lanes copy on the host).
    #[test]
    fn which_rectangles_each_backend_writes_in_place() {
        use super::{Backend, Caps, OutRect};
        // SAFETY: never written: only their kind is asked of.
        let rect = |page_locked, gpu| unsafe { OutRect::new(4096, 8, 8, 2, page_locked, gpu) };
        let (pageable, pinned, gpu) = (rect(false, None), rect(true, None), rect(false, Some(0)));
        let cpu = super::cpu::CpuBackend::new(1, None);
        let cuda = super::cuda::cuda_caps(1, 1 << 30);
        let engine =
            crate::plan::engine::with_settings(std::path::Path::new("t"), &[("backend", "sim")])
                .unwrap();
        let sim = super::sim::SimBackend::new(&engine);
        let said = |c: &Caps| [&pageable, &pinned, &gpu].map(|r| c.writes_directly(r));
        assert_eq!(said(cpu.caps()), [true, true, false], "cpu");
        assert_eq!(said(&cuda), [false, true, true], "cuda");
        assert_eq!(said(sim.caps()), [false, true, false], "sim");
    }
}
