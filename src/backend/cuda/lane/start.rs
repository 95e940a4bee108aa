//! Starting a lane ([`CudaLane::new`]): its context's streams, its device buffers allocated
//! once, its cuBLAS handle and kernels loaded on a thread of their own meanwhile, and the
//! warm-up GEMM that loads cuBLAS's kernel for the lane's tile shape.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream};

use super::{timing, CudaLane};
use crate::backend::cuda::driver::DeviceInfo;
use crate::backend::cuda::early::WarmSpec;
use crate::backend::cuda::kernels::{check_ptx, convert_ptx, let_go_of_blas};
use crate::backend::{GemmDesc, Lane};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::plan::layout::Layout;
use crate::seam::{DeviceStats, Precision};
use crate::units::fmt_bytes;

/// Whom a lane's start-up names: its index in the backend's lane list (for [`Error::Device`]),
/// `cuda:N`, and its track on the timeline.
struct Who {
    lane: usize,
    name: String,
    track: String,
}

impl Who {
    /// The error a failed driver call `what` of this lane becomes.
    fn err(&self, what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error {
        let name = self.name.clone();
        let what = what.to_string();
        let lane = self.lane;
        move |err: cudarc::driver::DriverError| Error::device(lane, name.clone(), what.clone(), err)
    }
}

/// The streams of a lane's context: H2D, compute, D2H.
type Streams = (
    Arc<CudaContext>,
    Arc<CudaStream>,
    Arc<CudaStream>,
    Arc<CudaStream>,
);

/// A lane's context and its three streams.
fn open_streams(ordinal: usize, who: &Who) -> Result<Streams> {
    let e = |what: &str| who.err(what);
    let t = std::time::Instant::now();
    // The backend holds the GPU's primary context open, so this only retains it; the lane
    // has a handle of its own so that errors cudarc records on one (in a Drop, say)
    // surface in this lane's calls, not in another lane's or step's.
    let ctx = CudaContext::new(ordinal).map_err(e("cannot open context"))?;
    ctx.bind_to_thread().map_err(e("cannot use context"))?;
    let h2d = ctx.new_stream().map_err(e("cannot create stream"))?;
    let comp = ctx.new_stream().map_err(e("cannot create stream"))?;
    let d2h = ctx.new_stream().map_err(e("cannot create stream"))?;
    crate::trace::span(&who.track, "streams", t, std::time::Instant::now());
    Ok((ctx, h2d, comp, d2h))
}

/// A lane's device buffers: tile-cache slots, accumulators, landing buffers.
type Buffers = (Vec<CudaSlice<u8>>, Vec<CudaSlice<u8>>, Vec<CudaSlice<u8>>);

/// A lane's device buffers, allocated once, as `l` lays them out.
fn device_buffers(
    who: &Who,
    ctx: &Arc<CudaContext>,
    comp: &Arc<CudaStream>,
    l: &Layout,
) -> Result<Buffers> {
    let (lane, name) = (who.lane, &who.name);
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
    let t = std::time::Instant::now();
    let slots = alloc(l.slot_bytes as usize, l.slots, "tile-cache slot")?;
    let accs = alloc(l.acc_bytes as usize, l.accs, "accumulator")?;
    let landing = alloc(l.landing_bytes as usize, l.landing, "landing buffer")?;
    ctx.synchronize()
        .map_err(who.err("synchronize after allocation"))?;
    crate::trace::span(&who.track, "device buffers", t, std::time::Instant::now());
    Ok((slots, accs, landing))
}

/// How many GEMM streams a lane computing in `precision` uses: two for fp32, whose 8192³
/// tile GEMMs leave SMs idle in their last wave (module doc of [`super`]), one otherwise —
/// fp64 measured slower on two, tf32/bf16/fp16 are bound by the host, and fp64_emulated's
/// scratch serves one GEMM at a time. `MGMM_GEMM_STREAMS` overrides it (not for
/// fp64_emulated).
pub(super) fn gemm_streams(precision: Precision) -> usize {
    match (crate::config::gemm_streams(), precision) {
        (_, Precision::Fp64Emulated(_)) => 1,
        (Some(n), _) => n.min(2),
        (None, Precision::Fp32) => 2,
        (None, _) => 1,
    }
}

/// A second GEMM stream and its cuBLAS handle (its kernels are the first handle's, loaded
/// once per context).
fn second_stream(who: &Who, ctx: &Arc<CudaContext>) -> Result<(Arc<CudaStream>, CudaBlas)> {
    let t = std::time::Instant::now();
    let s = ctx.new_stream().map_err(who.err("cannot create stream"))?;
    let blas = CudaBlas::new(s.clone())
        .map_err(|err| Error::device(who.lane, who.name.clone(), "cuBLAS handle", err))?;
    crate::trace::span(
        &who.track,
        "second GEMM stream",
        t,
        std::time::Instant::now(),
    );
    Ok((s, blas))
}

/// The cuBLAS handle and the conversion and check kernels.
type Libs = (CudaBlas, (Option<CudaFunction>, Option<CudaFunction>));

/// A lane's cuBLAS handle on `comp`, and its conversion ([`convert_kernel`]) and check
/// ([`check_kernel`]) kernels.
fn load_libraries(
    who: &Who,
    ctx: &Arc<CudaContext>,
    comp: &Arc<CudaStream>,
    l: &Layout,
    precision: Precision,
) -> Result<Libs> {
    let t = std::time::Instant::now();
    ctx.bind_to_thread()
        .map_err(who.err("cannot use context"))?;
    let blas = CudaBlas::new(comp.clone())
        .map_err(|err| Error::device(who.lane, who.name.clone(), "cuBLAS handle", err))?;
    crate::trace::span(&who.track, "cuBLAS handle", t, std::time::Instant::now());
    let t = std::time::Instant::now();
    let convert = convert_kernel(who, ctx, precision);
    let check = check_kernel(ctx, precision, &convert, l.host_dt);
    crate::trace::span(&who.track, "kernels", t, std::time::Instant::now());
    match convert {
        Ok(c) => Ok((blas, (c, check))),
        Err(err) => {
            let_go_of_blas(ctx, blas);
            Err(err)
        }
    }
}

/// kernels/convert.cu's f32 → bf16/fp16 kernel for `precision` (`None` where the inputs are
/// not narrowed on the device).
fn convert_kernel(
    who: &Who,
    ctx: &Arc<CudaContext>,
    precision: Precision,
) -> Result<Option<CudaFunction>> {
    let e = |what: &str| who.err(what);
    Ok(match precision {
        Precision::Bf16 | Precision::Fp16 => {
            let ptx = convert_ptx().map_err(|err| {
                Error::device(
                    who.lane,
                    who.name.clone(),
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
}

/// The checks' kernel, for the tensor-core precisions only: there the GEMMs leave the GPU idle
/// most of a step while the host is the limit; with fp32/fp64 the GEMMs are the limit, and
/// checks queued between the copies delayed them (32768² fp32: 1.492 s against 1.427 s), while
/// the host has time to spare (§23). A lane without it lets the host check (no error).
fn check_kernel(
    ctx: &Arc<CudaContext>,
    precision: Precision,
    convert: &Result<Option<CudaFunction>>,
    host_dt: DType,
) -> Option<CudaFunction> {
    let tensor = matches!(
        precision,
        Precision::Tf32 | Precision::Bf16 | Precision::Fp16
    );
    match (convert, host_dt) {
        (Ok(_), DType::F32) if tensor => check_ptx()
            .ok()
            .and_then(|ptx| ctx.load_module(ptx).ok())
            .and_then(|m| m.load_function("check_tiles").ok()),
        _ => None,
    }
}

impl CudaLane {
    pub(in crate::backend::cuda) fn new(
        lane: usize,
        d: &DeviceInfo,
        l: &Layout,
        precision: Precision,
    ) -> Result<CudaLane> {
        let ordinal = d.ordinal;
        let who = Who {
            lane,
            name: format!("cuda:{ordinal}"),
            track: format!("cuda:{ordinal} lane"),
        };
        let (ctx, h2d, comp, d2h) = open_streams(ordinal, &who)?;
        // The device buffers, and on a thread of its own the cuBLAS handle and the conversion
        // kernel (library loads, 90–100 ms on an H200), which do not need the buffers.
        let (bufs, libs) = std::thread::scope(|s| {
            let libs = s.spawn(|| load_libraries(&who, &ctx, &comp, l, precision));
            let bufs = device_buffers(&who, &ctx, &comp, l);
            let libs = libs.join().unwrap_or_else(|_| {
                Err(Error::backend(
                    "cuda",
                    "loading cuBLAS for a GPU lane panicked",
                ))
            });
            (bufs, libs)
        });
        let ((slots, accs, landing), (blas, (convert, check))) = match (bufs, libs) {
            (Ok(b), Ok(l)) => (b, l),
            (Err(e), Ok((blas, _))) => {
                let_go_of_blas(&ctx, blas);
                return Err(e);
            }
            (Err(e), Err(_)) | (Ok(_), Err(e)) => return Err(e),
        };
        ctx.bind_to_thread()
            .map_err(who.err("cannot use context"))?;
        let second = match gemm_streams(precision) {
            2 => match second_stream(&who, &ctx) {
                Ok(s) => Some(s),
                Err(e) => {
                    let_go_of_blas(&ctx, blas);
                    return Err(e);
                }
            },
            _ => None,
        };
        let mut lane = CudaLane {
            ordinal,
            name: format!("cuda:{ordinal} {}", ctx.name().unwrap_or_default()),
            ctx,
            h2d,
            comp,
            d2h,
            blas: Some(blas),
            second,
            acc_stream: Vec::new(),
            next_stream: 0,
            slot_reads: Vec::new(),
            gemm_base: None,
            gemm_spans: Vec::new(),
            gemm_last_end: None,
            warming: None,
            slots,
            accs,
            acc_done: Vec::new(),
            landing,
            next_landing: 0,
            convert,
            check,
            last_upload: None,
            check_bufs: None,
            precision,
            host_dt: l.host_dt,
            dev_dt: l.dev_dt,
            tickets: HashMap::new(),
            next_ticket: 1,
            gemm_events: VecDeque::new(),
            stats: DeviceStats::default(),
            clock: None,
            lane,
            emulator: None,
        };
        if let Precision::Fp64Emulated(moduli) = precision {
            let em = crate::backend::cuda::emulate::Emulator::new(&lane.ctx, &lane.comp, l, moduli)
                .map_err(|(what, e)| {
                    Error::device(lane.lane, who.name.clone(), what, e.to_string())
                })?;
            lane.emulator = Some(em);
        }
        lane.warm_and_clock(d, l, &who.track)?;
        Ok(lane)
    }

    /// The end of [`CudaLane::new`]: the lane's first GEMM of its tile shape waits for the
    /// probe's warm-up of that shape, or the lane warms up itself; with a timeline being
    /// recorded, the clock event that places device times on the host clock.
    fn warm_and_clock(&mut self, d: &DeviceInfo, l: &Layout, track: &str) -> Result<()> {
        let shape = WarmSpec {
            m: l.tm as usize,
            n: l.tn as usize,
            k: l.tk as usize,
            precision: self.precision,
        };
        let done_before = d
            .warmed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&shape);
        match &d.warming {
            // The probe is loading this shape's kernel: the first GEMM waits for it.
            Some(w) if w.spec == shape => self.warming = Some(w.clone()),
            // An earlier lane of this backend on this GPU loaded it.
            _ if done_before => {}
            _ => {
                let t = std::time::Instant::now();
                if self.warm_up(l)? {
                    d.warmed
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(shape);
                }
                crate::trace::span(track, "warm-up GEMM", t, std::time::Instant::now());
            }
        }
        if crate::trace::enabled() {
            let ev = self
                .comp
                .record_event(timing())
                .map_err(|e| self.err("event", e))?;
            ev.synchronize().map_err(|e| self.err("event wait", e))?;
            self.clock = Some((ev, std::time::Instant::now()));
        }
        Ok(())
    }

    /// One full-tile GEMM on zeroed buffers, waited for, then forgotten. cuBLAS loads the
    /// kernels it picks lazily, on their first call; without this the pipeline's first GEMM
    /// waited for that load (the first GEMM of 32768² fp32 on one H200 was issued 0.25 s after
    /// the stages started, while its two tiles take about 0.05 s to read and upload), and the
    /// stages behind it stalled. Tiles of other shapes (edges) and transposed operands may
    /// still load a kernel on first use. Skipped when the probe already ran this tile shape
    /// ([`warm_up_early`](super::super::early::warm_up_early)), which moves the load off the
    /// lanes' creation.
    /// `true` when it ran the GEMM (a layout whose tile does not fit its buffers runs none).
    fn warm_up(&mut self, l: &Layout) -> Result<bool> {
        let (dev, host) = (self.dev_dt.size() as u64, self.host_dt.size() as u64);
        let fits = l.tm * l.tk * dev <= l.slot_bytes
            && l.tk * l.tn * dev <= l.slot_bytes
            && l.tm * l.tn * host <= l.acc_bytes;
        if !fits || self.slots.is_empty() || self.accs.is_empty() {
            return Ok(false);
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
        let t = std::time::Instant::now();
        self.gemm(&desc, 0, b_slot, 0)?;
        let track = format!("cuda:{} lane", self.ordinal);
        crate::trace::span(&track, "warm-up: issue", t, std::time::Instant::now());
        self.comp
            .synchronize()
            .map_err(|e| self.err("synchronize after warm-up GEMM", e))?;
        self.gemm_events.clear();
        self.stats = DeviceStats::default();
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::gemm_streams;
    use crate::seam::Precision;

    #[test]
    fn fp32_takes_two_gemm_streams_and_the_others_one() {
        if std::env::var_os("MGMM_GEMM_STREAMS").is_some() {
            return; // the variable overrides the choice under test
        }
        assert_eq!(gemm_streams(Precision::Fp32), 2);
        let emulated = Precision::Fp64Emulated(crate::plan::EmulationModuli::Auto);
        for p in [
            Precision::Fp64,
            Precision::Tf32,
            Precision::Bf16,
            Precision::Fp16,
            emulated,
        ] {
            assert_eq!(gemm_streams(p), 1, "{p:?}");
        }
    }
}
