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
//!
//! By concern: [`driver`] finds the GPUs and loads the libraries, [`early`] starts what a run
//! can prepare before the driver is up, [`pinned`] makes page-locked host memory (and registers
//! input files' maps) and [`alloc`] hands it to the pools, [`lane`] is one GPU's lane,
//! [`kernels`] the GPU code it runs, [`fold`] `verify`'s dense pass, [`devmem`] what the Python package needs of the driver for
//! arrays already on a GPU; this file is the backend over them.

mod alloc;
pub mod devmem;
mod driver;
mod early;
mod emulate;
mod fold;
mod kernels;
mod lane;
mod pinned;

use std::sync::Arc;

use crate::backend::{Backend, HostAlloc, HostBuf, Lane};
use crate::error::{Error, Result};
use crate::plan::layout::Layout;
use crate::plan::{Devices, Engine};
use crate::seam::{Caps, MemorySpace, Precision};
use crate::units::fmt_bytes;
use alloc::CudaAlloc;
pub(crate) use driver::probe;
use driver::{auto_margin, probe_with, DeviceInfo, HeldPool};
pub(crate) use early::EarlySpec;
pub(crate) use early::EarlyStart;
use early::Prefill;
pub(crate) use fold::open_fold;
use lane::CudaLane;
pub(crate) use pinned::pinned_len;
use pinned::FilePinner;

fn derr(what: &str, e: impl std::fmt::Display) -> Error {
    Error::backend("cuda", format!("{what}: {e}"))
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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
fn h200_peak(p: Precision, lanes: usize, _depth: u64) -> f64 {
    let per = match p {
        Precision::Fp32 => 54e12,
        Precision::Tf32 => 350e12,
        Precision::Bf16 | Precision::Fp16 => 700e12,
        Precision::Fp64 => 60e12,
        // 32768² from `.npy` on one H200, 8192-deep blocks: 16.6 TFLOP/s
        // (docs/measurements/2026-12-05b-h200-2-npy-cut-fp64e-locked.log).
        Precision::Fp64Emulated(_) => 16.6e12,
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
        peak_source: |p| match p {
            Precision::Fp64Emulated(_) => {
                "fp64_emulated measured on one H200 at 32768², BENCHMARKS.md"
            }
            _ => "H200 cuBLAS rates measured in docs/GPU.md",
        },
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
    /// [`crate::backend::BackendOptions`].
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
        let device_memory = device_budget(engine, &chosen, device_memory)?;
        let ctx0 = chosen[0].ctx.clone();
        let alloc = CudaAlloc::new(ctx0, prefill, pinned_alloc);
        Ok(CudaBackend {
            engine: engine.clone(),
            threads: crate::backend::resolve_threads(engine.threads),
            alloc,
            caps: cuda_caps(chosen.len(), device_memory),
            devices: chosen,
        })
    }
}

/// The device budget per lane over `chosen`: `fixed` when the steps' layouts were already sized
/// from it (a failover), else `engine.device_memory` (an error when a GPU has less free), else
/// the least free memory less a margin (`auto`).
fn device_budget(engine: &Engine, chosen: &[DeviceInfo], fixed: Option<u64>) -> Result<u64> {
    // A GPU listed twice runs two lanes, each with `device_memory` of its own: the free
    // memory is shared between them.
    let share = (chosen.iter())
        .map(|d| chosen.iter().filter(|e| e.ordinal == d.ordinal).count() as u64)
        .max()
        .unwrap_or(1);
    let min_free = chosen.iter().map(|d| d.free).min().unwrap_or(0);
    Ok(match (fixed, engine.device_memory) {
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
    })
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
    fn input_pinner(&self) -> Option<Arc<dyn crate::backend::InputPinner>> {
        use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED as RO;
        let all = self
            .devices
            .iter()
            .all(|d| d.ctx.attribute(RO).is_ok_and(|v| v != 0));
        all.then(|| {
            Arc::new(FilePinner {
                ctx: self.alloc.ctx.clone(),
            }) as Arc<dyn crate::backend::InputPinner>
        })
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
    /// The GPUs' free memory measured again (with what the held pools kept given back first)
    /// and the device budget worked out from it as [`CudaBackend::select`] does; the pools
    /// held again.
    fn refresh(&mut self) -> Result<()> {
        for d in &mut self.devices {
            if let Some(h) = &d.held {
                h.trim();
            }
            let (free, _) = d.ctx.mem_get_info().map_err(|e| derr("free memory", e))?;
            d.free = free as u64;
        }
        let budget = device_budget(&self.engine, &self.devices, None)?;
        for d in &mut self.devices {
            if d.held.is_none() {
                d.held = HeldPool::shared(&d.ctx);
            }
        }
        self.caps = cuda_caps(self.devices.len(), budget);
        Ok(())
    }
    /// The held pools let go (trimmed, their thresholds restored once no other backend holds
    /// them: [`HeldPool`]); contexts and the page-locked cache stay. A backend that ran no
    /// pipeline (every step already complete) still has its early start going: the prefill is
    /// let go and the warm-ups waited for, so that no thread of its own is inside the driver
    /// while it waits (the process may end meanwhile, and a kept backend is never dropped).
    fn idle(&mut self) {
        self.alloc.drop_prefill();
        for d in &mut self.devices {
            if let Some(w) = &d.warming {
                w.wait();
            }
            d.held = None;
        }
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
