//! The device-lane stage: [`LaneOp`] → [`Done`] (to the writeback thread of the tile, through
//! [`ToWriteback`]): uploads, GEMMs and downloads issued on the backend's [`Lane`] (on CUDA
//! three streams and events), checkpoints of accumulators taken and resumed. One thread per
//! lane, bound to its device. It blocks on its input channel (polling for finished copies
//! meanwhile), on the device when it is [`MAX_AHEAD`] GEMMs ahead, on its output channels, and
//! for room to download (an output lease, fewer than `max_downs` downloads in flight) only
//! before it reuses the accumulator of a tile still waiting for that room: ended tiles queue
//! meanwhile ([`DeviceLane::issue_ends`], docs/decisions/0022-ended-tiles-wait-without-holding-up-the-lane.md).
//! A finished tile goes into an output buffer, or straight into the output's memory where the
//! output offers it ([`DeviceLane::direct_out`]).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Receiver, TryRecvError};

use super::messages::{Done, LaneOp, Staged, ToWriteback};
use crate::backend::{Dst, GemmDesc, Lane, Ticket};
use crate::dtype::DType;
use crate::durable::checkpoint::Checkpoints;
use crate::error::Result;
use crate::metrics::StageMetrics;
use crate::pipeline::control::Control;
use crate::pipeline::direct::CheckProgress;
use crate::pipeline::pool::{Lease, Pool};
use crate::plan::schedule::OutTile;
use crate::store::MatrixSink;

pub(crate) struct DeviceLane<'a> {
    pub(crate) lane: &'a mut dyn Lane,
    pub(crate) out_pool: Pool,
    /// Downloads this lane may have in flight (its share of the output pool).
    pub(crate) max_downs: usize,
    pub(crate) host_dt: DType,
    pub(crate) rx: Receiver<LaneOp>,
    pub(crate) out: ToWriteback,
    pub(crate) m: Arc<StageMetrics>,
    pub(crate) flops_issued: &'a AtomicU64,
    /// The stages' start and the time of the first GEMM after it (ns), shared by all lanes.
    pub(crate) first_gemm: (Instant, &'a AtomicU64),
    /// The lane's device statistics, refreshed now and then for the progress display.
    pub(crate) live: &'a std::sync::Mutex<crate::backend::DeviceStats>,
    /// Where partial accumulators are saved and resumed from (`None`: never).
    pub(crate) ckpt: Option<&'a Checkpoints>,
    /// The checks of every directly uploaded block so far, which results wait for.
    pub(crate) checks: Option<(Arc<CheckProgress>, u64)>,
    /// The output, when this lane downloads finished tiles straight into its memory
    /// ([`MatrixSink::direct_rect`], [`crate::seam::Caps::writes_directly`]), with the kind of
    /// rectangle approved for it ([`crate::pipeline::writes_in_place`]); `None`: through
    /// output buffers.
    pub(crate) direct_out: Option<(&'a dyn MatrixSink, crate::seam::OutRect)>,
}

/// GEMMs a lane may have queued on its device ([`DeviceLane::hold_back`]).
const MAX_AHEAD: usize = 8;

/// How often a device lane waiting for its next op checks for finished copies.
const LANE_POLL: std::time::Duration = std::time::Duration::from_micros(500);

struct Pending {
    ups: Vec<(Ticket, Staged)>,
    downs: Vec<(Ticket, Done)>,
    /// Tiles whose last GEMM is issued and whose download waits for room (an output lease,
    /// fewer than `max_downs` in flight), with their accumulators and the input checks they
    /// wait for (those issued when they ended), oldest first ([`DeviceLane::issue_ends`]).
    ends: std::collections::VecDeque<(OutTile, usize, Checks)>,
}

/// The checks of directly uploaded inputs a result waits for ([`Done::checks`]).
type Checks = Option<(Arc<CheckProgress>, u64)>;

/// How long [`DeviceLane::issue_ends`] may block for room.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Until {
    /// Not at all: issue what there is room for now.
    Room,
    /// Until the tile on this accumulator is issued (the accumulator is about to be reused).
    Acc(usize),
    /// Until every ended tile is issued.
    All,
}

impl DeviceLane<'_> {
    /// An output buffer: a free one, or (after letting go of everything finished) the next one
    /// writeback returns.
    fn lease_out(&mut self, p: &mut Pending, ctl: &Control) -> Result<Lease> {
        self.lease_as(p, ctl, false)
    }

    /// A lease of the output pool, waiting for one as [`Self::lease_out`] does; with `token`,
    /// one without a buffer first where the pool is lazy ([`Pool::lazy`]): for a download into
    /// the output itself.
    fn lease_as(&mut self, p: &mut Pending, ctl: &Control, token: bool) -> Result<Lease> {
        if let Some(b) = self.out_pool.try_lease_as(token) {
            return Ok(b);
        }
        self.settle(p, ctl, true)?;
        let t = Instant::now();
        let b = self.out_pool.lease_as(ctl, token)?;
        self.m.add_wait_out(t.elapsed());
        Ok(b)
    }

    /// Put `tile`'s saved accumulator into `acc`, so that the tile continues where its
    /// checkpoint left off. The file is read here, on the lane's thread, into an output buffer
    /// (the only host buffer sized for a whole tile); it happens once per resumed tile.
    fn resume(&mut self, tile: &OutTile, acc: usize, p: &mut Pending, ctl: &Control) -> Result<()> {
        let ckpt = self.ckpt.expect("resumed tiles come from checkpoints");
        let mut buf = self.lease_out(p, ctl)?;
        ckpt.read_into(tile, buf.materialize()?.bytes_mut())?;
        let tk = self
            .lane
            .upload(buf.buf(), tile.block.elems(), Dst::Acc(acc))?;
        p.ups.push((tk, Staged::Buf(Arc::new(buf))));
        Ok(())
    }

    /// Download `acc` (tile `tile` after `k_done` k-chunks) and send it to writeback to be
    /// saved. The download is waited for before anything else is issued, so that the next GEMM
    /// cannot change the accumulator under the copy on any backend; that costs one pipeline
    /// drain per checkpoint, minutes apart.
    fn checkpoint(
        &mut self,
        tile: &OutTile,
        acc: usize,
        k_done: u32,
        p: &mut Pending,
        ctl: &Control,
    ) -> Result<()> {
        let mut buf = self.lease_out(p, ctl)?;
        let tk = self
            .lane
            .download(acc, tile.block.elems(), buf.materialize()?)?;
        self.lane.wait(tk)?;
        let done = Done {
            tile: *tile,
            buf,
            into: None,
            partial: Some(k_done),
            checks: self.checks.clone(),
        };
        ctl.send_timed(self.out.to(done.tile.seq), done, &self.m)
    }

    /// Release finished uploads and forward finished downloads; with `all`, wait for everything.
    fn settle(&mut self, p: &mut Pending, ctl: &Control, all: bool) -> Result<()> {
        let mut i = 0;
        while i < p.ups.len() {
            if all {
                self.lane.wait(p.ups[i].0)?;
            }
            if all || self.lane.done(p.ups[i].0)? {
                p.ups.swap_remove(i);
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < p.downs.len() {
            let ready = if all {
                self.lane.wait(p.downs[i].0)?;
                true
            } else {
                self.lane.done(p.downs[i].0)?
            };
            if ready {
                let (_, d) = p.downs.remove(i);
                ctl.send_timed(self.out.to(d.tile.seq), d, &self.m)?;
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Wait for the next op. Meanwhile let go of whatever the device has finished, so that
    /// staging (waiting for the staging buffers our uploads hold) and writeback (for our
    /// downloads) go on, polling every [`LANE_POLL`]; block outright only when nothing is in
    /// flight. It never waits for the device itself: that used to be done here, and waiting
    /// for the last download waits for every GEMM queued before it, so the GPU ran dry and sat
    /// idle until the next upload arrived (about 10 ms at every output tile of 32768² fp32 on
    /// one H200, 76–101 ms in all, seen in `MGMM_TRACE` timelines). `None`: upstream is
    /// finished, the run is cancelled or a stop is asked.
    fn next_op(&mut self, p: &mut Pending, ctl: &Control) -> Result<Option<LaneOp>> {
        // Only the time spent in `recv` counts as waiting for input (handing on finished
        // downloads counts as waiting for room downstream, in `settle`).
        let mut waited = std::time::Duration::ZERO;
        let op = loop {
            self.settle(p, ctl, false)?;
            self.issue_ends(p, ctl, Until::Room)?;
            let t = Instant::now();
            // Nothing in flight or waiting: block until an op comes (or a stop is asked).
            let idle = p.ups.is_empty() && p.downs.is_empty() && p.ends.is_empty();
            let r = ctl.recv_lane(&self.rx, (!idle).then_some(LANE_POLL));
            waited += t.elapsed();
            match r {
                Ok(Some(op)) => break Some(op),
                Ok(None) => continue,
                Err(()) => break None,
            }
        };
        self.m.add_wait_in(waited);
        Ok(op)
    }

    /// Wait while the device has [`MAX_AHEAD`] GEMMs queued (until the oldest finishes).
    /// Since the lane no longer waits for its device when it has nothing to do
    /// ([`Self::next_op`]), a lane whose inputs are all cached could otherwise queue its whole
    /// share of work on a slow device and hold the buffers and reads other lanes wait for:
    /// with one simulated lane 20× slower than three others, a fast lane was left with a
    /// sixth of its share in 3–6 of 30 runs (`tests/it/sim.rs`), 1 in 30 with a bound of 32,
    /// none with 8. Eight 8192³ GEMMs are 0.17 s of fp32 and 16–22 ms of tf32 or bf16 on an
    /// H200, well ahead of the GPU.
    fn hold_back(&mut self, p: &mut Pending, ctl: &Control) -> Result<()> {
        if self.lane.in_flight() < MAX_AHEAD {
            return Ok(());
        }
        // Hand on what is finished first: the wait below is for the oldest GEMM only.
        self.settle(p, ctl, false)?;
        let t = Instant::now();
        if p.ends.is_empty() {
            self.lane.wait_in_flight_below(MAX_AHEAD)?;
        } else {
            // Tiles wait for room to download: poll, so that each goes as soon as writeback
            // hands a lease back rather than a GEMM (21 ms of 8192³ fp32) later; once none
            // waits, wait for the device as above.
            while self.lane.in_flight() >= MAX_AHEAD && !ctl.is_stopping() {
                if p.ends.is_empty() {
                    self.lane.wait_in_flight_below(MAX_AHEAD)?;
                    break;
                }
                std::thread::sleep(LANE_POLL);
                self.settle(p, ctl, false)?;
                self.issue_ends(p, ctl, Until::Room)?;
            }
        }
        self.m.add_wait_out(t.elapsed());
        Ok(())
    }

    pub(crate) fn run(mut self, ctl: &Control) -> Result<()> {
        self.lane.bind_thread()?;
        let mut p = Pending {
            ups: Vec::new(),
            downs: Vec::new(),
            ends: Default::default(),
        };
        let mut active = BTreeMap::new();
        let mut r = self.work(ctl, &mut p, &mut active);
        if r.is_ok() && ctl.is_stopping() && !ctl.is_cancelled() {
            r = self.stop(ctl, &mut p, &active);
        }
        // A lane that stops early (an error, a cancel) may leave copies in flight; those
        // reading the files' page-locked pages must end before the pages are released when
        // the stages are over (best effort: a failed device answers at once).
        for (tk, buf) in p.ups.drain(..) {
            if matches!(buf, Staged::Direct(_)) {
                let _ = self.lane.wait(tk);
            }
        }
        r
    }

    /// Run ops until upstream is finished, the run is cancelled or a stop is asked; `active`
    /// keeps, per accumulator in use, its tile and the k-chunks issued on it.
    fn work(
        &mut self,
        ctl: &Control,
        p: &mut Pending,
        active: &mut BTreeMap<usize, (OutTile, u32)>,
    ) -> Result<()> {
        let mut ops = 0u64;
        // When each accumulator's tile started, or was last saved (for checkpoints): per
        // accumulator, because a start group interleaves several tiles' k-chunks.
        let mut marks: Vec<Instant> = Vec::new();
        loop {
            if ctl.is_stopping() {
                return Ok(());
            }
            let op = match self.rx.try_recv() {
                Ok(op) => op,
                Err(TryRecvError::Disconnected) => break,
                Err(TryRecvError::Empty) => {
                    let Some(op) = self.next_op(p, ctl)? else {
                        break;
                    };
                    op
                }
            };
            let (t, waited) = (Instant::now(), self.m.waited_out());
            match op {
                LaneOp::Upload { slot, buf, elems } => {
                    let tk = self.upload(slot, &buf, elems)?;
                    p.ups.push((tk, buf));
                }
                LaneOp::Begin { acc, c0, resume } => {
                    self.issue_ends(p, ctl, Until::Acc(acc))?;
                    self.begin_tile(acc, c0, resume, &mut marks, p, ctl)?;
                }
                LaneOp::Gemm {
                    desc,
                    a_slot,
                    b_slot,
                    acc,
                    tile,
                    kk,
                } => {
                    self.issue_ends(p, ctl, Until::Acc(acc))?;
                    self.hold_back(p, ctl)?;
                    self.lane.gemm(&desc, a_slot, b_slot, acc)?;
                    active.insert(acc, (tile, kk as u32 + 1));
                    self.count_gemm(&desc, ops == 0);
                    self.checkpoint_if_due(&tile, acc, kk, &mut marks, p, ctl)?;
                }
                LaneOp::End { tile, acc } => {
                    active.remove(&acc);
                    self.end_tile(tile, acc, p, ctl)?
                }
            }
            self.m.add_busy_since(t, waited);
            self.settle(p, ctl, false)?;
            self.issue_ends(p, ctl, Until::Room)?;
            ops += 1;
            if ops.is_multiple_of(16) {
                *self.live.lock().unwrap() = self.lane.live_stats();
            }
        }
        if !ctl.is_cancelled() && !ctl.is_stopping() {
            self.issue_ends(p, ctl, Until::All)?;
            self.settle(p, ctl, true)?;
            *self.live.lock().unwrap() = self.lane.live_stats();
            self.lane.release();
        }
        Ok(())
    }

    /// A stop was asked: hand on the tiles finished (their downloads), send the accumulators of
    /// the tiles `active` is in the middle of to be saved as checkpoints (when the run takes
    /// them), let go of the channels to writeback — which ends once every lane has — and then
    /// only discard what upstream still sends until the run is cancelled, so that no stage
    /// fails on a closed channel before the output stages are done.
    fn stop(
        &mut self,
        ctl: &Control,
        p: &mut Pending,
        active: &BTreeMap<usize, (OutTile, u32)>,
    ) -> Result<()> {
        self.issue_ends(p, ctl, Until::All)?;
        self.settle(p, ctl, true)?;
        if let Some(c) = self.ckpt.filter(|c| c.saving()) {
            for (&acc, &(tile, k_done)) in active {
                if (k_done as u64) < c.k_chunks() {
                    self.checkpoint(&tile, acc, k_done, p, ctl)?;
                }
            }
        }
        drop(std::mem::replace(&mut self.out, ToWriteback(Vec::new())));
        while let Some(op) = ctl.recv(&self.rx) {
            drop(op);
        }
        Ok(())
    }

    /// Issue the upload of a staged input block into `slot`: from its host buffer, or straight
    /// from its file's pages (then the checks that results wait for grow by it, and its check
    /// on the device is queued where the lane can).
    fn upload(&mut self, slot: usize, buf: &Staged, elems: usize) -> Result<Ticket> {
        let tk = match buf {
            Staged::Buf(b) => self.lane.upload(b.buf(), elems, Dst::Slot(slot))?,
            Staged::Direct(d) => {
                if let Some((p, seq)) = &d.check {
                    self.checks = Some((p.clone(), seq + 1));
                }
                let tk = self.lane.upload_runs(&d.runs, elems, slot)?;
                // Its check on the device, queued after the copy; without one (the
                // sender dropped here) the check stage checks it on the host.
                let dc = d
                    .device_check
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take();
                if let Some((tx, spec)) = dc {
                    if let Some(c) = self.lane.check_upload(&spec) {
                        let _ = tx.send(c);
                    }
                }
                tk
            }
        };
        Ok(tk)
    }

    /// Start a tile on accumulator `acc` (noting when, in `marks`): upload its added matrix
    /// `c0`, or put back its checkpoint when it `resume`s from one.
    fn begin_tile(
        &mut self,
        acc: usize,
        c0: Option<(Arc<Lease>, usize)>,
        resume: Option<OutTile>,
        marks: &mut Vec<Instant>,
        p: &mut Pending,
        ctl: &Control,
    ) -> Result<()> {
        if marks.len() <= acc {
            marks.resize(acc + 1, Instant::now());
        }
        marks[acc] = Instant::now();
        self.lane.begin_tile(acc);
        if let Some((buf, elems)) = c0 {
            let tk = self.lane.upload(buf.buf(), elems, Dst::Acc(acc))?;
            p.ups.push((tk, Staged::Buf(buf)));
        }
        if let Some(tile) = resume {
            self.resume(&tile, acc, p, ctl)?;
        }
        Ok(())
    }

    /// Count a GEMM just issued: its FLOPs, and the time of the stages' first GEMM
    /// (`first_op`: it is this lane's first op).
    fn count_gemm(&self, desc: &GemmDesc, first_op: bool) {
        if first_op || self.first_gemm.1.load(Ordering::Relaxed) == u64::MAX {
            let ns = self.first_gemm.0.elapsed().as_nanos() as u64;
            self.first_gemm.1.fetch_min(ns, Ordering::Relaxed);
        }
        self.flops_issued
            .fetch_add(2 * (desc.m * desc.n * desc.k) as u64, Ordering::Relaxed);
    }

    /// After k-chunk `kk` of `tile` on `acc`: save the accumulator when the run takes
    /// checkpoints, the tile has k-chunks left and its interval since `marks[acc]` is up.
    fn checkpoint_if_due(
        &mut self,
        tile: &OutTile,
        acc: usize,
        kk: u64,
        marks: &mut [Instant],
        p: &mut Pending,
        ctl: &Control,
    ) -> Result<()> {
        if let Some(c) = self.ckpt {
            let mark = marks.get(acc).copied().unwrap_or_else(Instant::now);
            if kk + 1 < c.k_chunks() && c.due(mark) {
                self.checkpoint(tile, acc, kk as u32 + 1, p, ctl)?;
                if let Some(m) = marks.get_mut(acc) {
                    *m = Instant::now();
                }
            }
        }
        Ok(())
    }

    /// End `tile` on `acc`: its download, into an output buffer or the output itself, is
    /// issued as soon as there is room, to be handed to writeback once done
    /// ([`Self::settle`]); meanwhile the lane goes on issuing later ops ([`Self::issue_ends`]).
    fn end_tile(
        &mut self,
        tile: OutTile,
        acc: usize,
        p: &mut Pending,
        ctl: &Control,
    ) -> Result<()> {
        p.ends.push_back((tile, acc, self.checks.clone()));
        self.issue_ends(p, ctl, Until::Room)
    }

    /// Issue the downloads of ended tiles, oldest first, while there is room: a lease of the
    /// output pool and fewer than `max_downs` downloads in flight (a lane whose device is
    /// slower than its input — every input tile cached, or a slow GPU — would otherwise run
    /// ahead through its ops and hold every buffer of the shared output pool while its device
    /// catches up, starving the other lanes). Block for room only as `until` says. The lane
    /// used to block at every end without room: when a start group's tiles ended together
    /// (four 8192² tiles of one row, two output buffers), it waited for writeback to hand a
    /// buffer back while the device ran out of queued GEMMs — 27 ms of idle GPU in a 1.13 s
    /// step of two 30000² CUDA tensors on one H200 (`MGMM_TRACE`, trace_gaps.py:
    /// docs/measurements/2026-12-06c-h200-3-gpu-arrays-in-place.log).
    fn issue_ends(&mut self, p: &mut Pending, ctl: &Control, until: Until) -> Result<()> {
        while let Some((tile, acc)) = p.ends.front().map(|e| (e.0, e.1)) {
            let must = match until {
                Until::Room => false,
                Until::Acc(a) => p.ends.iter().any(|e| e.1 == a),
                Until::All => true,
            };
            let elems = tile.block.elems();
            // Straight into the output's memory where it takes it ([`Self::direct_out`]):
            // the lease is then a token that bounds the downloads in flight, without a
            // buffer.
            let host = self.host_dt;
            let into = (self.direct_out).and_then(|(w, kind)| {
                (w.direct_rect(&tile.block, host))
                    .filter(|r| crate::pipeline::same_kind(r, &kind, &tile.block, host))
            });
            let room = p.downs.len() < self.max_downs.max(1);
            let buf = match room.then(|| self.out_pool.try_lease_as(into.is_some())) {
                Some(Some(b)) => b,
                _ if !must => return Ok(()),
                _ => {
                    while p.downs.len() >= self.max_downs.max(1) {
                        let t = Instant::now();
                        self.lane.wait(p.downs[0].0)?;
                        self.m.add_wait_out(t.elapsed());
                        let (_, d) = p.downs.remove(0);
                        ctl.send_timed(self.out.to(d.tile.seq), d, &self.m)?;
                    }
                    self.lease_as(p, ctl, into.is_some())?
                }
            };
            let checks = p.ends.pop_front().and_then(|e| e.2);
            let mut buf = buf;
            let tk = match into {
                Some(r) => self.lane.download_into(acc, &r)?,
                None => self.lane.download(acc, elems, buf.materialize()?)?,
            };
            let partial = None;
            p.downs.push((
                tk,
                Done {
                    tile,
                    buf,
                    into,
                    partial,
                    checks,
                },
            ));
            self.m.add_item((elems * self.host_dt.size()) as u64);
        }
        Ok(())
    }
}
