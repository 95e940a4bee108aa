//! `verify`'s dense pass on a device: the one part of the check that is a matrix product.
//!
//! `verify` (src/verify/pass.rs) reads every matrix once. Its scatter passes (op(B) and the
//! output against random ±1 vectors) are memory-bound folds; its dense pass multiplies op(A)
//! (M × K) by the K × (rounds·groups) sums of the pass over op(B), plus |op(A)| and op(A)∘op(A)
//! by two K × groups tolerance sums: 2·M·K·(rounds + 2)·groups flops, 275 GFLOP at 32768² — on
//! the CPU of the one-H200 host 1.15–1.35 s of a 1.6–2.0 s check (2026-11-30 log), on the GPU a
//! few milliseconds of DGEMM. A [`FoldDevice`] does that product for f32 data (f32 products are
//! exact in f64; f64 data needs the CPU's double-double sums): the bands of op(A) the host
//! reads are handed over one by one, widened and multiplied on the device, and the sums come
//! back at the end. The f64 sums of a device differ from the CPU's only in their order of
//! addition, which the check's model already allows for (it bounds the f64 sums' own error
//! whatever the order).
//!
//! [`open`] finds the device the plan's `engine.backend` names: the first GPU for `auto` and
//! `cuda`, a simulated device for `sim` (tests: the same contract computed on the host, so the
//! verify code that drives a device is tested where there is none), none for `cpu`.

use crate::error::Result;
use crate::plan::{BackendKind, Devices, Engine};

/// The right-hand sides of one dense pass, row-major f64: `signed` K × rg, `abs` and `sq`
/// K × g.
pub(crate) struct FoldSpec<'a> {
    /// Rows of op(A) (M).
    pub(crate) m: usize,
    /// Depth (K): rows of the right-hand sides.
    pub(crate) k: usize,
    /// Columns of `signed` (rounds · groups).
    pub(crate) rg: usize,
    /// Columns of `abs` and `sq` (groups).
    pub(crate) g: usize,
    /// op(A) = Aᵀ: a band of stored rows is a range of K for every op row.
    pub(crate) trans: bool,
    pub(crate) signed: &'a [f64],
    pub(crate) abs: &'a [f64],
    pub(crate) sq: &'a [f64],
}

/// The sums of a dense pass, row-major: `signed` M × rg, `abs` and `sq` M × g, and which op
/// rows of A held NaN/Inf (their values counted as 0).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct FoldSums {
    pub(crate) signed: Vec<f64>,
    pub(crate) abs: Vec<f64>,
    pub(crate) sq: Vec<f64>,
    pub(crate) bad: Vec<bool>,
}

/// A device that computes dense passes. Calls come from whichever thread reads the bands.
pub(crate) trait FoldDevice: Send {
    /// Human name ("cuda:0 NVIDIA H200").
    fn name(&self) -> String;
    /// Get ready for a pass of `spec`'s shape (its sums are not read) with bands of `h` rows of
    /// `cols` columns, before the sums it needs exist: allocate, and run each kernel once so
    /// that the driver has loaded them (the first band's fold took 61 ms more than the others
    /// on one H100, docs/measurements/2026-12-06f-h100-1-head-verify-trace.log). `verify` calls
    /// it while the pass over op(B) runs; a device may do nothing.
    fn prepare(&mut self, _spec: &FoldSpec, _h: usize, _cols: usize) -> Result<()> {
        Ok(())
    }
    /// Hold `spec`'s right-hand sides and zeroed sums for a new pass; a band holds at most
    /// `band_elems` elements.
    fn begin(&mut self, spec: &FoldSpec, band_elems: usize) -> Result<()>;
    /// Page-lock the host buffers the bands will be read into (faster copies), until
    /// [`FoldDevice::unpin`]; a device may ignore it.
    fn pin(&mut self, _bufs: &[&[f32]]) {}
    /// Let go of what [`FoldDevice::pin`] locked; called before those buffers are freed.
    fn unpin(&mut self) {}
    /// Fold stored rows `r0..r0 + h` of A (`band`, row-major h × cols, NaN/Inf allowed). The
    /// band's memory may be reused as soon as this returns.
    fn fold(&mut self, r0: usize, h: usize, band: &[f32]) -> Result<()>;
    /// The sums so far (waits for the device).
    fn sums(&mut self) -> Result<FoldSums>;
}

/// The device `engine.backend` names for `verify`'s dense pass: none for `cpu`, and for `auto`
/// where no GPU can be used (`Ok(None)`); the first GPU of `engine.devices` for `auto` and
/// `cuda` (`Err` for `cuda` without one: the caller says so and checks on the CPU).
pub(crate) fn open(engine: &Engine) -> Result<Option<Box<dyn FoldDevice>>> {
    let first = match &engine.devices {
        Devices::All => 0,
        Devices::List(l) => l.first().copied().unwrap_or(0) as usize,
    };
    match engine.backend {
        BackendKind::Cpu => Ok(None),
        BackendKind::Auto => Ok(super::cuda::open_fold(first).ok()),
        BackendKind::Cuda => Ok(Some(super::cuda::open_fold(first)?)),
        #[cfg(feature = "fault-injection")]
        BackendKind::Sim => Ok(Some(Box::new(HostFold::new(Fault::None)))),
        #[cfg(not(feature = "fault-injection"))]
        BackendKind::Sim => Err(crate::error::Error::Usage(
            "engine.backend = \"sim\" (simulated devices) exists only in test builds".into(),
        )),
    }
}

/// What a [`HostFold`] gets wrong on purpose (tests of the cross-check and the fallback).
#[cfg(any(test, feature = "fault-injection"))]
#[cfg_attr(not(test), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Fault {
    None,
    /// Every signed sum of the first band off by one part in 10⁶.
    WrongSums,
    /// The bands after the first marked on the wrong rows (as a wrong offset would): the
    /// first band is right.
    LaterRowsWrong,
    /// Each band also adds its first row into the op row just past it (op(A) = A), as a DGEMM
    /// of one row too many would.
    RowPastBand,
    /// The n-th call to `fold` fails.
    FailAt(usize),
    /// The n-th call to `fold` panics.
    PanicAt(usize),
}

/// The device contract computed on the host, element by element in f64 and in band order
/// (`backend = "sim"`, and the tests): what a GPU does, without one.
#[cfg(any(test, feature = "fault-injection"))]
pub(crate) struct HostFold {
    fault: Fault,
    folds: usize,
    m: usize,
    k: usize,
    rg: usize,
    g: usize,
    trans: bool,
    z: Vec<f64>,
    zabs: Vec<f64>,
    zsq: Vec<f64>,
    out: FoldSums,
}

#[cfg(any(test, feature = "fault-injection"))]
impl HostFold {
    pub(crate) fn new(fault: Fault) -> HostFold {
        HostFold {
            fault,
            folds: 0,
            m: 0,
            k: 0,
            rg: 0,
            g: 0,
            trans: false,
            z: Vec::new(),
            zabs: Vec::new(),
            zsq: Vec::new(),
            out: FoldSums::default(),
        }
    }
}

#[cfg(any(test, feature = "fault-injection"))]
impl FoldDevice for HostFold {
    fn name(&self) -> String {
        "sim:0 (host fold)".into()
    }
    fn begin(&mut self, spec: &FoldSpec, _band_elems: usize) -> Result<()> {
        (self.m, self.k, self.rg, self.g, self.trans) =
            (spec.m, spec.k, spec.rg, spec.g, spec.trans);
        (self.z, self.zabs, self.zsq) = (spec.signed.into(), spec.abs.into(), spec.sq.into());
        self.out = FoldSums {
            signed: vec![0.0; spec.m * spec.rg],
            abs: vec![0.0; spec.m * spec.g],
            sq: vec![0.0; spec.m * spec.g],
            bad: vec![false; spec.m],
        };
        Ok(())
    }
    fn fold(&mut self, r0: usize, h: usize, band: &[f32]) -> Result<()> {
        self.folds += 1;
        if self.fault == Fault::PanicAt(self.folds) {
            panic!("injected panic of the dense pass");
        }
        if self.fault == Fault::FailAt(self.folds) {
            return Err(crate::error::Error::backend(
                "sim",
                "injected failure of the dense pass",
            ));
        }
        let cols = band.len() / h.max(1);
        let (rg, g) = (self.rg, self.g);
        let skew = match (self.fault, self.folds) {
            (Fault::WrongSums, 1) => 1.0 + 1e-6,
            _ => 1.0,
        };
        for l in 0..h {
            for c in 0..cols {
                let v = band[l * cols + c] as f64;
                // op row i, depth kk of this element.
                let (mut i, kk) = match self.trans {
                    false => (r0 + l, c),
                    true => (c, r0 + l),
                };
                if self.fault == Fault::LaterRowsWrong && self.folds > 1 {
                    i = (i + 1) % self.m;
                }
                debug_assert!(i < self.m && kk < self.k);
                if !v.is_finite() {
                    self.out.bad[i] = true;
                    continue;
                }
                for j in 0..rg {
                    self.out.signed[i * rg + j] += v * self.z[kk * rg + j] * skew;
                }
                if self.fault == Fault::RowPastBand && !self.trans && l == 0 && r0 + h < self.m {
                    let p = r0 + h;
                    for j in 0..rg {
                        self.out.signed[p * rg + j] += v * self.z[kk * rg + j];
                    }
                }
                for j in 0..g {
                    self.out.abs[i * g + j] += v.abs() * self.zabs[kk * g + j];
                    self.out.sq[i * g + j] += v * v * self.zsq[kk * g + j];
                }
            }
        }
        Ok(())
    }
    fn sums(&mut self) -> Result<FoldSums> {
        Ok(self.out.clone())
    }
}
