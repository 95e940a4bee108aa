//! The early start: what a run's CUDA backend prepares while the driver comes up, from the plain
//! description [`EarlySpec`] that `run` worked out from the plan (`run/prefill.rs`): the pinned
//! pools' memory populated and registered ([`Prefill`]), and each GPU's first GEMM of the
//! step's tile shape, which loads cuBLAS's kernel ([`Warming`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, DevicePtr, DevicePtrMut};

use super::kernels::{gemm_ex, gemm_sizes, let_go_of_blas};
use super::lock;
use super::pinned::{touched_map, PinnedCache, PinnedMem, Registered};
use crate::backend::GemmDesc;
use crate::seam::Precision;

/// One GPU's early warm-up GEMM ([`warm_up_early`]), which loads cuBLAS's kernel (0.15–0.2 s on
/// an H200). With tf32/bf16/fp16 it runs beside the start of the run: the backend is ready once
/// its contexts are, a lane waits for it only before its first GEMM, and the step's staging —
/// the limit at those precisions — page-locks and uploads the first blocks meanwhile (32768² on
/// one H200, five runs each interleaved: process wall 1.22–1.33 s against 1.34–1.40 with tf32,
/// 1.11–1.20 against 1.16–1.32 with bf16; docs/decisions/0009-early-start.md). With fp32/fp64 the GEMMs are the
/// limit from the first one on, so a wait inside the step lands on the critical path (step
/// 1.62 s against 1.43, the process no shorter): there the warm-up finishes before the backend
/// is handed over, as before.
pub(crate) struct Warming {
    pub(super) spec: WarmSpec,
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
    pub(super) fn start(ctx: &Arc<CudaContext>, ordinal: usize, w: WarmSpec) -> Arc<Warming> {
        let me = Arc::new(Warming {
            spec: w,
            thread: std::sync::Mutex::new(None),
            ok: std::sync::OnceLock::new(),
        });
        let run = {
            let ctx = ctx.clone();
            move || ctx.bind_to_thread().is_ok() && warm_up_early(&ctx, ordinal, &w).is_ok()
        };
        if matches!(w.precision, Precision::Fp32 | Precision::Fp64)
            || crate::config::warm_up_inline()
        {
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
    pub(super) fn wait(&self) -> bool {
        let mut g = self.thread.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = g.take() {
            let _ = self.ok.set(h.join().unwrap_or(false));
        }
        self.ok.get().copied().unwrap_or(false)
    }
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

/// What a run can start before its CUDA backend is ready, as `run` guessed it from the plan
/// ([`EarlySpec`]): populating the pinned pools' memory, and each GPU's first GEMM of the
/// plan's tile shape, which loads cuBLAS's kernel.
pub(crate) struct EarlyStart {
    pub(super) prefill: Option<Prefill>,
    pub(super) warm: Option<WarmSpec>,
    /// The GPUs the plan lists (`None`: all), the only ones warmed up.
    pub(super) devices: Option<Vec<usize>>,
}

/// What a run's first CUDA pipelines will allocate and compute, worked out from the plan before
/// the driver is up (by `run`, which has the plan and opens its inputs): the backend gets
/// these numbers, never the plan, and prepares them early ([`EarlyStart`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct EarlySpec {
    /// The byte lengths of the pinned buffers the pools will ask for, rounded as the
    /// allocator rounds them ([`pinned_len`](super::pinned_len)).
    pub(crate) pool_lens: Vec<usize>,
    /// The plan step ([`Step::order`](crate::plan::Step::order)) whose pools those are:
    /// pipelines of earlier steps leave the buffers for it
    /// ([`HostAlloc::pools_made`](crate::backend::HostAlloc::pools_made)).
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
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) precision: Precision,
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
    /// for it ([`HostAlloc::pools_made`](crate::backend::HostAlloc::pools_made)).
    pub(super) step: (usize, usize),
    threads: usize,
    stop: Arc<AtomicBool>,
    workers: std::sync::Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// Populated maps, from the workers to the registering thread.
    tx: std::sync::Mutex<Option<crossbeam_channel::Sender<memmap2::MmapMut>>>,
    rx: std::sync::Mutex<Option<crossbeam_channel::Receiver<memmap2::MmapMut>>>,
    registered: Arc<PinnedCache>,
    registering: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
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
    pub(super) fn start(&self) {
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
    pub(super) fn register_with(&self, ctx: &Arc<CudaContext>) {
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
    pub(super) fn await_registered(&self) {
        if let Some(h) = lock(&self.registering).take() {
            let _ = h.join();
        }
    }

    /// A registered buffer of exactly `len` bytes.
    pub(super) fn take(&self, len: usize) -> Option<PinnedMem> {
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

#[cfg(test)]
mod tests {
    use super::super::pinned::populated_map;
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
