//! The CPU backend: the same lane contract, computed synchronously with faer on the rayon pool.
//!
//! Slots and accumulators are ordinary host buffers allocated once from the host budget (the
//! plan's layout counts them there). `upload` is a copy, `gemm` is faer's matmul over row-major
//! views (transposes are free views, never copies), and every ticket is complete on return.
//! faer splits work over the output only, never over k, so results do not depend on timing.

use std::time::Instant;

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use zerocopy::FromBytes;

use super::ozaki;
use super::{Backend, Dst, GemmDesc, HostAlloc, HostBuf, InputPinner, Lane, Ticket};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::plan::layout::Layout;
use crate::seam::{Caps, DeviceStats, EmulationModuli, MemorySpace, OutRect, Precision};

/// The CPU backend: one lane computing on `threads` rayon workers; slots and accumulators
/// live in host memory and count against `engine.host_memory`.
pub(crate) struct CpuBackend {
    threads: usize,
    note: Option<String>,
    caps: Caps,
}

const CPU_TILES: &[u64] = &[
    1024, 768, 512, 384, 256, 192, 128, 96, 64, 48, 32, 16, 8, 4, 2, 1,
];

/// faer measured 235-243 GFLOP/s per core (f32) on the development machine (Zen 5, AVX-512),
/// BENCHMARKS.md; f64 is half. A core without AVX-512 has half the vector width (AVX2 and
/// FMA: half the rate), one without those a quarter of that: the lower bound `plan` prints must
/// not assume a machine faster than this one.
fn cpu_peak(p: Precision, threads: usize, depth: u64) -> f64 {
    let f32_per_core = simd_f32_per_core();
    let per_core = match p {
        Precision::Fp64 => f32_per_core / 2.0,
        // N + 1 f64 GEMMs per block, N as `auto` picks it for normal data `depth` deep.
        Precision::Fp64Emulated(m) => {
            f32_per_core / 2.0 / (ozaki::expected_moduli(m, depth) + 1) as f64
        }
        _ => f32_per_core,
    };
    // Threads beyond the cores only wait for them (a trial saw 64 threads on 2 cores bound
    // the step at 32 cores' rate).
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    per_core * threads.min(cores) as f64
}

/// Where [`cpu_peak`]'s rate for `p` comes from, as `plan`'s lower bound says it.
fn cpu_peak_source(p: Precision) -> &'static str {
    if p == Precision::Fp64 {
        "faer's f64 rate per core: half its f32 rate with AVX-512, a quarter without, BENCHMARKS.md, times the threads (at most the cores)"
    } else if p.is_f64() {
        "faer's f64 rate per core over the N + 1 f64 GEMMs an emulated block takes, N as auto picks it for normal data as deep as this step's blocks, times the threads (at most the cores)"
    } else {
        "faer's f32 rate per core with AVX-512, half without, BENCHMARKS.md, times the threads (at most the cores)"
    }
}

fn simd_f32_per_core() -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return 240e9;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return 120e9;
        }
        30e9
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        120e9
    }
}

impl CpuBackend {
    pub(crate) fn new(threads: usize, note: Option<String>) -> CpuBackend {
        let threads = super::resolve_threads(threads);
        CpuBackend {
            threads,
            note,
            caps: Caps {
                kind: "cpu",
                memory: MemorySpace::Host,
                tile_ladder: CPU_TILES,
                staging_depth: 4,
                extra_out_buf: false,
                auto_copies_from: usize::MAX,
                lanes: 1,
                device_memory: 0,
                narrow_slots: false,
                link_names: ("staged", "collected"),
                link_rate: None,
                peak_flops: cpu_peak,
                peak_source: cpu_peak_source,
            },
        }
    }
}

impl HostAlloc for CpuBackend {
    fn alloc_host(&self, bytes: usize) -> Result<HostBuf> {
        HostBuf::heap(bytes)
    }
    fn shared(&self) -> Option<std::sync::Arc<dyn HostAlloc>> {
        Some(std::sync::Arc::new(super::HeapAlloc))
    }
    /// The lanes copy input blocks from the files' maps into their slots themselves, which
    /// saves the staging copy (`pipeline::direct`); nothing needs registering.
    fn input_pinner(&self) -> Option<std::sync::Arc<dyn InputPinner>> {
        Some(std::sync::Arc::new(HostMemory))
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        format!(
            "cpu ({})",
            crate::units::count(self.threads as u64, "thread", "threads")
        )
    }
    fn caps(&self) -> &Caps {
        &self.caps
    }
    fn threads(&self) -> usize {
        self.threads
    }
    fn note(&self) -> Option<String> {
        self.note.clone()
    }
    fn lanes(&self, layout: &Layout, p: Precision) -> Result<Vec<Box<dyn Lane>>> {
        Ok(vec![Box::new(CpuLane::new(layout, p, self.threads)?)])
    }
    fn without(&self, _lane: usize) -> Option<Result<Box<dyn Backend>>> {
        None
    }
}

pub(crate) struct CpuLane {
    dt: DType,
    slots: Vec<HostBuf>,
    accs: Vec<HostBuf>,
    par: Par,
    stats: DeviceStats,
    /// Reduced precision to emulate by rounding input slots on upload (C0 is never rounded).
    round: Option<Precision>,
    /// `precision = "fp64_emulated"`: the moduli setting, and the buffers the emulation reuses.
    emulate: Option<Emulation>,
}

/// The CPU's fp64 emulation: [`ozaki`] with faer's f64 GEMM as the exact integer GEMM.
struct Emulation {
    moduli: EmulationModuli,
    ws: ozaki::Workspace,
    ints: FaerInts,
    /// The block's product before alpha, beta and the accumulator.
    prod: Vec<f64>,
}

/// Integer GEMMs on the CPU: the int8 operands as f64, faer's f64 GEMM, the sums back to
/// int32. Exact: every product and partial sum is an integer below `k·128² ≤ 2³⁰ < 2⁵³`.
struct FaerInts {
    par: Par,
    a: Vec<f64>,
    b: Vec<f64>,
    c: Vec<f64>,
}

impl ozaki::IntGemm for FaerInts {
    fn gemm_tn(&mut self, m: usize, n: usize, k: usize, a: &[i8], b: &[i8], c: &mut [i32]) {
        let widen = |v: &mut Vec<f64>, x: &[i8]| {
            v.clear();
            v.extend(x.iter().map(|&e| e as f64));
        };
        widen(&mut self.a, &a[..m * k]);
        widen(&mut self.b, &b[..n * k]);
        self.c.resize(m * n, 0.0);
        let lhs = MatRef::from_row_major_slice(&self.a, m, k);
        let rhs = MatRef::from_row_major_slice(&self.b, n, k).transpose();
        let dst = MatMut::from_row_major_slice_mut(&mut self.c, m, n);
        matmul(dst, Accum::Replace, lhs, rhs, 1.0, self.par);
        for (o, &x) in c[..m * n].iter_mut().zip(&self.c) {
            *o = x as i32;
        }
    }
}

impl CpuLane {
    pub(crate) fn new(layout: &Layout, precision: Precision, threads: usize) -> Result<CpuLane> {
        let slots = (0..layout.slots)
            .map(|_| HostBuf::heap(layout.slot_bytes as usize))
            .collect::<Result<_>>()?;
        let accs = (0..layout.accs)
            .map(|_| HostBuf::heap(layout.acc_bytes as usize))
            .collect::<Result<_>>()?;
        let par = if threads > 1 {
            Par::rayon(threads)
        } else {
            Par::Seq
        };
        let round = matches!(
            precision,
            Precision::Tf32 | Precision::Bf16 | Precision::Fp16
        )
        .then_some(precision);
        let emulate = match precision {
            Precision::Fp64Emulated(moduli) => Some(Emulation {
                moduli,
                ws: ozaki::Workspace::default(),
                ints: FaerInts {
                    par,
                    a: Vec::new(),
                    b: Vec::new(),
                    c: Vec::new(),
                },
                prod: Vec::new(),
            }),
            _ => None,
        };
        Ok(CpuLane {
            dt: layout.host_dt,
            slots,
            accs,
            par,
            stats: DeviceStats::default(),
            round,
            emulate,
        })
    }
}

macro_rules! gemm_typed {
    ($name:ident, $t:ty) => {
        fn $name(g: &GemmDesc, a: &[$t], b: &[$t], c: &mut [$t], par: Par) {
            let (alpha, beta) = (g.alpha as $t, g.beta as $t);
            let lhs = if g.a_trans {
                MatRef::from_row_major_slice(&a[..g.k * g.m], g.k, g.m).transpose()
            } else {
                MatRef::from_row_major_slice(&a[..g.m * g.k], g.m, g.k)
            };
            let rhs = if g.b_trans {
                MatRef::from_row_major_slice(&b[..g.n * g.k], g.n, g.k).transpose()
            } else {
                MatRef::from_row_major_slice(&b[..g.k * g.n], g.k, g.n)
            };
            let c = &mut c[..g.m * g.n];
            if alpha == 0.0 {
                // Reference xGEMM: with alpha = 0 the product is not computed (so NaN/Inf in
                // A or B do not reach C) and C = beta·C0 exactly.
                if beta == 0.0 {
                    c.fill(0.0);
                } else if beta != 1.0 {
                    c.iter_mut().for_each(|x| *x *= beta);
                }
                return;
            }
            let accum = if beta == 0.0 {
                Accum::Replace
            } else {
                if beta != 1.0 {
                    c.iter_mut().for_each(|x| *x *= beta);
                }
                Accum::Add
            };
            let dst = MatMut::from_row_major_slice_mut(c, g.m, g.n);
            matmul(dst, accum, lhs, rhs, alpha, par);
        }
    };
}
gemm_typed!(gemm_f32, f32);
gemm_typed!(gemm_f64, f64);

/// `c = alpha·op(A)·op(B) + beta·c` with the product emulated ([`ozaki::gemm`]), counted in
/// `stats`; false (c untouched) where the block must be computed natively.
fn emulated(
    g: &GemmDesc,
    a: &[f64],
    b: &[f64],
    c: &mut [f64],
    em: &mut Emulation,
    stats: &mut DeviceStats,
) -> bool {
    em.prod.resize(g.m * g.n, 0.0);
    let r = ozaki::gemm(
        (g.m, g.n, g.k),
        a,
        g.a_trans,
        b,
        g.b_trans,
        em.moduli,
        &mut em.ints,
        &mut em.ws,
        &mut em.prod,
    );
    ozaki::record(&mut stats.emulation, r);
    if r.is_err() {
        return false;
    }
    // The same roundings as the native path: beta·C0, alpha·product, their sum.
    let (alpha, beta) = (g.alpha, g.beta);
    for (x, &p) in c[..g.m * g.n].iter_mut().zip(&em.prod) {
        *x = if beta == 0.0 {
            alpha * p
        } else if beta == 1.0 {
            *x + alpha * p
        } else {
            *x * beta + alpha * p
        };
    }
    true
}

impl Lane for CpuLane {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn upload(&mut self, src: &HostBuf, elems: usize, dst: Dst) -> Result<Ticket> {
        let t0 = Instant::now();
        let n = elems * self.dt.size();
        let d = match dst {
            Dst::Slot(s) => &mut self.slots[s],
            Dst::Acc(a) => &mut self.accs[a],
        };
        let d = &mut d.bytes_mut()[..n];
        d.copy_from_slice(&src.bytes()[..n]);
        if let (Some(p), Dst::Slot(_)) = (self.round, dst) {
            // Emulate the reduced-precision GEMM input; accumulators (C0) keep full precision.
            if let Ok(xs) = <[f32]>::mut_from_bytes(d) {
                super::round_inputs(p, xs);
            }
        }
        self.stats.h2d_s += t0.elapsed().as_secs_f64();
        self.stats.h2d_bytes += n as u64;
        Ok(Ticket(0))
    }

    fn uploads_runs(&self) -> bool {
        true
    }

    fn upload_runs(
        &mut self,
        runs: &[super::HostRun],
        elems: usize,
        slot: usize,
    ) -> Result<Ticket> {
        let t0 = Instant::now();
        let n = elems * self.dt.size();
        let d = &mut self.slots[slot].bytes_mut()[..n];
        for r in runs {
            // Staging gives runs in GPU memory only to a GPU's lane (`Lane::gpu`).
            if r.device {
                return Err(crate::error::Error::Usage(
                    "a CPU lane was given a block in GPU memory (a bug)".into(),
                ));
            }
            for i in 0..r.rows {
                let at = r.dst_off + i * r.dst_pitch;
                // SAFETY: the rectangle lies inside a file map that the upload holding `runs`
                // keeps alive for this call (pipeline::direct::DirectUpload).
                let row =
                    unsafe { std::slice::from_raw_parts(r.host.add(i * r.host_pitch), r.row_len) };
                d[at..at + r.row_len].copy_from_slice(row);
            }
        }
        if let Some(p) = self.round {
            if let Ok(xs) = <[f32]>::mut_from_bytes(d) {
                super::round_inputs(p, xs);
            }
        }
        self.stats.h2d_s += t0.elapsed().as_secs_f64();
        self.stats.h2d_bytes += n as u64;
        Ok(Ticket(0))
    }

    fn gemm(&mut self, g: &GemmDesc, a_slot: usize, b_slot: usize, acc: usize) -> Result<()> {
        let t0 = Instant::now();
        let bad = |_| Error::backend("cpu", "misaligned buffer");
        let (a, b) = (self.slots[a_slot].bytes(), self.slots[b_slot].bytes());
        let c = self.accs[acc].bytes_mut();
        // SAFETY-free casts: zerocopy checks size and alignment (buffers are 4096-aligned).
        match self.dt {
            DType::F32 => {
                let a = <[f32]>::ref_from_bytes(a).map_err(|e| bad(e.to_string()))?;
                let b = <[f32]>::ref_from_bytes(b).map_err(|e| bad(e.to_string()))?;
                let c = <[f32]>::mut_from_bytes(c).map_err(|e| bad(e.to_string()))?;
                gemm_f32(g, a, b, c, self.par);
            }
            DType::F64 => {
                let a = <[f64]>::ref_from_bytes(a).map_err(|e| bad(e.to_string()))?;
                let b = <[f64]>::ref_from_bytes(b).map_err(|e| bad(e.to_string()))?;
                let c = <[f64]>::mut_from_bytes(c).map_err(|e| bad(e.to_string()))?;
                match &mut self.emulate {
                    // alpha = 0 computes no product (gemm_f64 says why): nothing to emulate.
                    Some(em) if g.alpha != 0.0 => {
                        if !emulated(g, a, b, c, em, &mut self.stats) {
                            gemm_f64(g, a, b, c, self.par);
                        }
                    }
                    _ => gemm_f64(g, a, b, c, self.par),
                }
            }
            other => return Err(Error::backend("cpu", format!("no {other} GEMM on the CPU"))),
        }
        self.stats.gemm_s += t0.elapsed().as_secs_f64();
        self.stats.gemms += 1;
        Ok(())
    }

    fn download(&mut self, acc: usize, elems: usize, dst: &mut HostBuf) -> Result<Ticket> {
        let t0 = Instant::now();
        let n = elems * self.dt.size();
        dst.bytes_mut()[..n].copy_from_slice(&self.accs[acc].bytes()[..n]);
        self.stats.d2h_s += t0.elapsed().as_secs_f64();
        self.stats.d2h_bytes += n as u64;
        Ok(Ticket(0))
    }

    fn download_into(&mut self, acc: usize, r: &OutRect) -> Result<Ticket> {
        use rayon::prelude::*;
        if r.gpu.is_some() || r.pitch < r.row_len {
            return Err(crate::error::Error::Usage(format!(
                "the CPU cannot write {r:?} in place (a bug: the pipeline asked it to)"
            )));
        }
        let t0 = Instant::now();
        let n = r.rows * r.row_len;
        let (addr, pitch) = (r.addr as usize, r.pitch);
        self.accs[acc].bytes()[..n]
            .par_chunks(r.row_len.max(1))
            .enumerate()
            .for_each(|(i, row)| {
                // SAFETY: row `i` of the rectangle lies in the output's memory, alive and
                // written by this call alone (the sink that gave `r` and the pipeline, which
                // hands each block to one lane, guarantee both); `row` is `row_len` bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        row.as_ptr(),
                        (addr + i * pitch) as *mut u8,
                        row.len(),
                    )
                };
            });
        self.stats.d2h_s += t0.elapsed().as_secs_f64();
        self.stats.d2h_bytes += n as u64;
        Ok(Ticket(0))
    }

    fn done(&mut self, _t: Ticket) -> Result<bool> {
        Ok(true)
    }
    fn wait(&mut self, _t: Ticket) -> Result<()> {
        Ok(())
    }
    fn stats(&mut self) -> DeviceStats {
        self.stats.clone()
    }
}

/// The CPU's "registration": nothing, its lanes read host memory anyway.
pub(crate) struct HostMemory;

impl InputPinner for HostMemory {
    fn register(&self, _ptr: *const u8, _len: usize) -> std::result::Result<(), String> {
        Ok(())
    }
    fn unregister(&self, _ptr: *const u8) {}
    fn locks(&self) -> bool {
        false
    }
}
