//! The staging stage: [`PlanOp`] → [`LaneOp`], loads becoming [`Staged`] blocks: a buffer leased
//! from the lane's pool and filled by a read (or another lane's read of the same block, through
//! [`SharedReads`]), the tile CRCs and NaN/Inf count checked on the way; or, for direct uploads,
//! rectangles of the file's page-locked map, whose checks go to the check stage as
//! [`CheckJob`]s. One thread per lane. It blocks on a free buffer in its pool (the lane's
//! uploads hold them), on another lane's read of a shared block, on the read itself, and on its
//! output channel to the device lane.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

use super::inputs::Inputs;
use super::messages::{CheckJob, LaneOp, PlanOp, Staged};
use crate::dtype::DType;
use crate::error::Result;
use crate::metrics::StageMetrics;
use crate::pipeline::control::Control;
use crate::pipeline::direct::{CheckProgress, DirectReads};
use crate::pipeline::pool::{Lease, Pool};
use crate::pipeline::shared::{Got, SharedReads};
use crate::plan::schedule::Src;
use crate::store::Block;

pub(crate) struct Staging<'a> {
    /// This lane's index (owner of `pool` in the shared reader).
    pub(crate) lane: usize,
    pub(crate) inputs: &'a Inputs,
    pub(crate) shared: &'a SharedReads,
    /// Uploads straight from the files' pages, when this lane's device can do them, and where
    /// their checks go ([`Checker`](super::check::Checker)).
    pub(crate) direct: Option<(&'a DirectReads, Sender<CheckJob>, Arc<CheckProgress>)>,
    /// Checks issued so far.
    pub(crate) checks_issued: std::cell::Cell<u64>,
    /// The lane checks directly uploaded blocks on its device ([`crate::backend::check`]).
    pub(crate) device_checks: bool,
    /// The GPU of this lane, which copies blocks of arrays in its memory device to device
    /// ([`crate::backend::Lane::gpu`]).
    pub(crate) gpu: Option<usize>,
    pub(crate) pool: Pool,
    pub(crate) host_dt: DType,
    pub(crate) rx: Receiver<PlanOp>,
    pub(crate) out: Sender<LaneOp>,
    pub(crate) m: Arc<StageMetrics>,
}

impl Staging<'_> {
    /// The host buffer holding `block` of `src`: another lane's read of it when the shared
    /// reader has one, else a read of our own (published for the other lanes). The read is
    /// claimed only once a buffer is leased ([`SharedReads::get`]).
    fn fill(&self, ctl: &Control, src: Src, block: &Block) -> Result<(Arc<Lease>, usize)> {
        let elems = block.elems();
        if !self.shared.enabled() || src == Src::C0 {
            let lease = self.lease(ctl, false)?;
            return Ok((self.read_into(lease, src, block)?, elems));
        }
        // Take it if another lane read it (waiting while one reads it); else lease a buffer and
        // look again, claiming the read this time. At most two rounds: a claim never finds
        // the block absent.
        let mut lease = None;
        loop {
            let t = Instant::now();
            let got = self.shared.get(ctl, src, block, lease.is_some())?;
            self.m.add_wait_in(t.elapsed());
            match got {
                Got::Shared(buf) => {
                    let f = self.inputs.file(src);
                    self.shared.count_shared((elems * f.dtype().size()) as u64);
                    return Ok((buf, elems)); // a buffer leased meanwhile goes back to the pool
                }
                Got::Read => break,
                Got::Absent => lease = Some(self.lease(ctl, false)?),
            }
        }
        let lease = lease.expect("a read is claimed only with a buffer in hand");
        let r = self.read_into(lease, src, block);
        match &r {
            Ok(buf) => self.shared.publish(src, block, buf, self.lane),
            Err(_) => self.shared.abandon(src, block),
        }
        Ok((r?, elems))
    }

    /// Lease a buffer from this lane's pool (as a `token`: one whose memory is not needed),
    /// first handing back what the shared reader holds of it if the pool is empty.
    fn lease(&self, ctl: &Control, token: bool) -> Result<Lease> {
        let t = Instant::now();
        let lease = loop {
            if let Some(l) = self.pool.try_lease_as(token) {
                break l;
            }
            // Hand back what the shared reader keeps of our pool, oldest first, until a buffer
            // is free; with nothing left to hand back, wait for the lanes' uploads.
            if !self.shared.evict_one(self.lane) {
                break self.pool.lease_as(ctl, token)?;
            }
        };
        self.m.add_wait_out(t.elapsed());
        Ok(lease)
    }

    /// Read `block` of `src` into `lease`.
    fn read_into(&self, mut lease: Lease, src: Src, block: &Block) -> Result<Arc<Lease>> {
        let t = Instant::now();
        let elems = block.elems();
        let bytes = elems * self.host_dt.size();
        let f = self.inputs.file(src);
        let dst = &mut lease.materialize()?.bytes_mut()[..bytes];
        // Checksums, the copy and the NaN/Inf count in one pass where the format can.
        // NaN and Inf are computed as IEEE arithmetic says; they are counted for the summary.
        let nonfinite = f.read_staged(block, self.host_dt, dst, self.inputs.verify)?;
        self.inputs.nonfinite(src).add(block, nonfinite);
        self.m.add_busy(t.elapsed());
        let read = (elems * f.dtype().size()) as u64;
        self.m.add_item(read);
        if f.in_memory() {
            self.inputs.memory_bytes.fetch_add(read, Ordering::Relaxed);
        }
        Ok(Arc::new(lease))
    }

    /// `block` of `src` as rectangles of its file's page-locked map, when direct uploads apply
    /// to it ([`DirectReads::prepare`]), its checks handed to the
    /// [`Checker`](super::check::Checker); `None`: copy it.
    fn fill_direct(&self, ctl: &Control, src: Src, block: &Block) -> Result<Option<Staged>> {
        let Some((d, checks, progress)) = &self.direct else {
            return Ok(None);
        };
        let f = self.inputs.file(src);
        let t = Instant::now();
        let Some(e) = d.eligible(f, block, self.host_dt) else {
            self.m.add_busy(t.elapsed());
            return Ok(None);
        };
        // A buffer as a token: as many blocks in flight as with copies.
        let token = self.lease(ctl, true)?;
        let t = Instant::now();
        let Some(mut up) = d.take(f, e, token) else {
            self.m.add_busy(t.elapsed());
            return Ok(None);
        };
        let seq = self.checks_issued.get();
        self.checks_issued.set(seq + 1);
        up.check = Some((progress.clone(), seq));
        // Checked on the device that copies it, where the lane can and the format says where
        // the block's storage tiles lie.
        let device = match f.device_check_spec(block, self.host_dt) {
            Some(spec)
                if self.device_checks && spec.tiles() <= crate::backend::check::MAX_TILES =>
            {
                let (tx, rx) = crossbeam_channel::bounded(1);
                *up.device_check.get_mut().unwrap_or_else(|e| e.into_inner()) = Some((tx, spec));
                Some(rx)
            }
            _ => None,
        };
        self.m.add_busy(t.elapsed());
        self.m.add_item((block.elems() * f.dtype().size()) as u64);
        let job = CheckJob {
            seq,
            src,
            block: *block,
            device,
            _pins: up.pins(),
        };
        ctl.send_timed(checks, job, &self.m)?;
        Ok(Some(Staged::Direct(Arc::new(up))))
    }

    /// `block` of `src` as a rectangle of GPU memory, when the input is an array on this lane's
    /// GPU ([`MatrixSource::device_block`]): copied device to device; `None`: read it through
    /// the host (a CPU lane; an array on another GPU, whose memory may not be mapped for this
    /// one — torch's and CuPy's pools are not, unless the owner grants access). Nothing is
    /// checked or counted on the host (the data never is there).
    ///
    /// [`MatrixSource::device_block`]: crate::store::MatrixSource::device_block
    fn fill_device(&self, ctl: &Control, src: Src, block: &Block) -> Result<Option<Staged>> {
        let Some(gpu) = self.gpu else {
            return Ok(None);
        };
        let f = self.inputs.file(src);
        let Some(d) = f
            .device_block(block, self.host_dt)
            .filter(|d| d.device == gpu)
        else {
            return Ok(None);
        };
        // A buffer as a token: as many blocks in flight as with copies.
        let token = self.lease(ctl, true)?;
        self.m.add_item((block.elems() * f.dtype().size()) as u64);
        Ok(Some(Staged::Direct(Arc::new(
            crate::pipeline::direct::DirectUpload::from_device(&d, token),
        ))))
    }

    pub(crate) fn run(self, ctl: &Control) -> Result<()> {
        while let Some(op) = ctl.recv_timed(&self.rx, &self.m) {
            let out = match op {
                PlanOp::Load { slot, src, block } => {
                    if let Some((d, ..)) = &self.direct {
                        d.count_load();
                    }
                    let direct = match self.fill_device(ctl, src, &block)? {
                        Some(up) => Some(up),
                        None => self.fill_direct(ctl, src, &block)?,
                    };
                    let (buf, elems) = match direct {
                        Some(up) => (up, block.elems()),
                        None => {
                            let (buf, elems) = self.fill(ctl, src, &block)?;
                            (Staged::Buf(buf), elems)
                        }
                    };
                    LaneOp::Upload { slot, buf, elems }
                }
                PlanOp::Begin { acc, c0, resume } => {
                    let c0 = match c0 {
                        Some(b) => Some(self.fill(ctl, Src::C0, &b)?),
                        None => None,
                    };
                    LaneOp::Begin { acc, c0, resume }
                }
                PlanOp::Gemm {
                    desc,
                    a_slot,
                    b_slot,
                    acc,
                    tile,
                    kk,
                } => LaneOp::Gemm {
                    desc,
                    a_slot,
                    b_slot,
                    acc,
                    tile,
                    kk,
                },
                PlanOp::End { tile, acc } => LaneOp::End { tile, acc },
            };
            ctl.send_timed(&self.out, out, &self.m)?;
        }
        Ok(())
    }
}
