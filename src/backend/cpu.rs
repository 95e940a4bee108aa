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

use super::{DeviceStats, Dst, GemmDesc, HostAlloc, HostBuf, Lane, Ticket};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::plan::layout::Layout;

pub struct CpuAlloc;

impl HostAlloc for CpuAlloc {
    fn alloc_host(&self, bytes: usize) -> Result<HostBuf> {
        Ok(HostBuf::heap(bytes))
    }
}

pub struct CpuLane {
    dt: DType,
    slots: Vec<HostBuf>,
    accs: Vec<HostBuf>,
    par: Par,
    stats: DeviceStats,
    /// Test-only fault injection, as on CUDA lanes: fail the GEMM after this many
    /// (MGMM_FAULT_GEMM_AFTER).
    fault_after: Option<u64>,
}

impl CpuLane {
    pub fn new(layout: &Layout, threads: usize) -> Result<CpuLane> {
        let slots = (0..layout.slots)
            .map(|_| HostBuf::heap(layout.slot_bytes as usize))
            .collect();
        let accs = (0..layout.accs)
            .map(|_| HostBuf::heap(layout.acc_bytes as usize))
            .collect();
        let par = if threads > 1 {
            Par::rayon(threads)
        } else {
            Par::Seq
        };
        let fault_after = std::env::var("MGMM_FAULT_GEMM_AFTER")
            .ok()
            .and_then(|v| v.parse().ok());
        Ok(CpuLane {
            dt: layout.host_dt,
            slots,
            accs,
            par,
            stats: DeviceStats::default(),
            fault_after,
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
        d.bytes_mut()[..n].copy_from_slice(&src.bytes()[..n]);
        self.stats.h2d_s += t0.elapsed().as_secs_f64();
        self.stats.h2d_bytes += n as u64;
        Ok(Ticket(0))
    }

    fn gemm(&mut self, g: &GemmDesc, a_slot: usize, b_slot: usize, acc: usize) -> Result<()> {
        if self.fault_after.is_some_and(|n| self.stats.gemms >= n) {
            return Err(Error::backend(
                "cpu",
                "GEMM: injected fault (MGMM_FAULT_GEMM_AFTER)",
            ));
        }
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
                gemm_f64(g, a, b, c, self.par);
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
