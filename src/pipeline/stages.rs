//! The stages of a run, one struct each, each with a `run` that owns its channel ends.
//!
//! ```text
//!  shared tile queue
//!        │ (each lane's planner pulls the next output tile)
//!   Planner ──PlanOp──▶ Prefetch ──PlanOp──▶ Staging ──LaneOp──▶ DeviceLane ──Done──▶ Writeback
//!   (cache model,        (madvise            (lease buffer,       (upload, GEMM,       (write tile
//!    slot choice)         WILLNEED)           pread, CRC, NaNs;    download)            into output
//!                                             or page-lock the                          once its
//!                                             file's pages)──CheckJob──▶ Checker ───────▶ checks pass)
//!                                                                (CRC, NaNs)
//! ```
//! A stage loops over its receiver, stops when upstream disconnects, leaves when downstream
//! does, and reports its first error through [`Control`], which cancels the others.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender, TryRecvError};

use super::control::Control;
use super::direct::{CheckProgress, DirectReads, DirectUpload};
use super::metrics::StageMetrics;
use super::pool::{Lease, Pool};
use super::shared::{Got, SharedReads};
use crate::backend::{Dst, GemmDesc, Lane, Ticket};
use crate::dtype::DType;
use crate::durable::checkpoint::Checkpoints;
use crate::durable::sink::TileSink;
use crate::error::{Error, Result};
use crate::plan::schedule::{OutTile, Schedule, Src, TileCache};
use crate::store::{Block, MatrixSink, MatrixSource};

/// Planner → prefetch → staging.
#[derive(Debug)]
pub(crate) enum PlanOp {
    Load {
        slot: usize,
        src: Src,
        block: Block,
    },
    Begin {
        acc: usize,
        c0: Option<Block>,
        /// Start from this tile's checkpoint (then `c0` is `None`: it is in the checkpoint).
        resume: Option<OutTile>,
    },
    Gemm {
        desc: GemmDesc,
        a_slot: usize,
        b_slot: usize,
        acc: usize,
        /// The output tile and the k-chunk this GEMM computes (for checkpoints).
        tile: OutTile,
        kk: u64,
    },
    End {
        tile: OutTile,
        acc: usize,
    },
}

/// An input block ready for its lane: in a filled host buffer, or as rectangles of a file's
/// page-locked map ([`super::direct`]). Held until the lane's copy of it is done.
pub(crate) enum Staged {
    Buf(Arc<Lease>),
    Direct(Arc<DirectUpload>),
}

/// Staging → device lane: loads now carry filled host buffers.
pub(crate) enum LaneOp {
    Upload {
        slot: usize,
        buf: Staged,
        elems: usize,
    },
    Begin {
        acc: usize,
        c0: Option<(Arc<Lease>, usize)>,
        resume: Option<OutTile>,
    },
    Gemm {
        desc: GemmDesc,
        a_slot: usize,
        b_slot: usize,
        acc: usize,
        tile: OutTile,
        kk: u64,
    },
    End {
        tile: OutTile,
        acc: usize,
    },
}

/// Device lane → writeback: a finished output tile in a host buffer, or with `partial`, the
/// accumulator of a tile after that many k-chunks (a checkpoint).
pub(crate) struct Done {
    pub(crate) tile: OutTile,
    pub(crate) buf: Lease,
    pub(crate) partial: Option<u32>,
    /// The checks of directly uploaded inputs that must pass before it is written: those of
    /// every block the lane uploaded so far.
    pub(crate) checks: Option<(Arc<CheckProgress>, u64)>,
}

/// Device lanes → the writeback threads, one channel each. A tile's results always go to the
/// same thread (chosen by its sequence number), so its checkpoints and its final block are
/// written in the order the lane sent them: a late checkpoint can never land after the tile
/// was recorded and its checkpoints deleted.
#[derive(Clone)]
pub(crate) struct ToWriteback(pub(crate) Vec<Sender<Done>>);

impl ToWriteback {
    /// The channel of the thread that writes tile `seq`.
    pub(crate) fn to(&self, seq: u32) -> &Sender<Done> {
        &self.0[seq as usize % self.0.len()]
    }
}

/// Staging → check: a block uploaded straight from its file's pages, to check (CRC, NaN/Inf)
/// as copying it would have; `seq` is its place in the lane's order of checks.
pub(crate) struct CheckJob {
    pub(crate) seq: u64,
    pub(crate) src: Src,
    pub(crate) block: Block,
    /// The block's check on the device that copied it, when that lane can check
    /// ([`crate::backend::check`]).
    pub(crate) device:
        Option<crossbeam_channel::Receiver<Box<dyn crate::backend::check::DeviceCheck>>>,
    /// The block's registered ranges, held until it is checked: released and evicted
    /// meanwhile, its pages would be read back from disk.
    pub(crate) _pins: Vec<super::direct::Pin>,
}

/// Checks the blocks a lane uploads straight from the files' pages ([`super::direct`]): the
/// checksums of storage tiles not verified yet and the NaN/Inf count, reading the pages while
/// the device copies them, in the order staging issued them; each one passed is published in
/// `progress`, which writeback waits on. A corrupt tile fails the run here.
pub(crate) struct Checker<'a> {
    pub(crate) inputs: &'a Inputs,
    pub(crate) host_dt: DType,
    pub(crate) rx: Receiver<CheckJob>,
    pub(crate) progress: Arc<CheckProgress>,
    pub(crate) m: Arc<StageMetrics>,
}

impl Checker<'_> {
    pub(crate) fn run(self, ctl: &Control) -> Result<()> {
        // However the stage ends (done, an error, a panic), writeback must not wait forever
        // for checks that will never pass.
        struct Close<'p>(&'p CheckProgress);
        impl Drop for Close<'_> {
            fn drop(&mut self) {
                self.0.close();
            }
        }
        let _close = Close(&self.progress);
        // An error is reported before the progress closes, so that writeback, woken by the
        // close, finds the run cancelled with this error rather than a stopped stage.
        if let Err(e) = self.check_all(ctl) {
            ctl.fail(e);
        }
        Ok(())
    }

    fn check_all(&self, ctl: &Control) -> Result<()> {
        while let Some(job) = ctl.recv_timed(&self.rx, &self.m) {
            let f = self.inputs.file(job.src);
            let device = match &job.device {
                Some(rx) => self.device_results(ctl, rx)?,
                None => None,
            };
            let t = Instant::now();
            let nonfinite = match device {
                Some(r) => {
                    let n =
                        f.settle_device_check(&job.block, self.host_dt, self.inputs.verify, &r)?;
                    let bytes = (job.block.elems() * f.dtype().size()) as u64;
                    self.inputs
                        .device_checked
                        .fetch_add(bytes, Ordering::Relaxed);
                    n
                }
                None => f.scan_mapped(&job.block, self.host_dt, self.inputs.verify)?,
            };
            if nonfinite > 0 {
                self.inputs
                    .nonfinite
                    .fetch_add(nonfinite, Ordering::Relaxed);
            }
            self.progress.set(job.seq + 1);
            self.m.add_busy(t.elapsed());
            self.m
                .add_item((job.block.elems() * f.dtype().size()) as u64);
        }
        Ok(())
    }
}

impl Checker<'_> {
    /// The device's results for a block, waited for (as time waiting for input); `None`
    /// when the device could not check it (the lane dropped the sender: no kernel, a failed
    /// launch, the lane gone), so that the host checks it.
    fn device_results(
        &self,
        ctl: &Control,
        rx: &crossbeam_channel::Receiver<Box<dyn crate::backend::check::DeviceCheck>>,
    ) -> Result<Option<Vec<[u32; 2]>>> {
        let t = Instant::now();
        let got = loop {
            match rx.recv_timeout(std::time::Duration::from_millis(20)) {
                Ok(c) => break Some(c),
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break None,
                Err(crossbeam_channel::RecvTimeoutError::Timeout) if ctl.is_cancelled() => {
                    return Err(crate::error::Error::Cancelled)
                }
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            }
        };
        let r = got.and_then(|c| c.wait().ok());
        self.m.add_wait_in(t.elapsed());
        Ok(r)
    }
}

/// Output tiles still to compute, dealt so that lanes run *in phase*.
///
/// Lane `l` gets the output rows `ti ≡ l (mod lanes)`, walked band by band (band `b` = rows
/// `b·lanes .. b·lanes + lanes`) in serpentine column order, the direction alternating by band.
/// So at any moment every lane works in the same tile column and needs the same B tiles at the
/// same time: the shared reader ([`SharedReads`]) reads each of them from the file once for all
/// lanes. Within a lane, consecutive tiles share their A row (kept in the device tile cache) and
/// the serpentine turn reuses the B tiles used last. With one lane this is the schedule's own
/// serpentine order. A lane whose run is empty steals from the back of the longest other run, so
/// a slower or busier device simply ends up with fewer tiles.
///
/// When a lane's device tile cache holds every input tile the lane needs
/// ([`crate::plan::layout::Layout::squares_fit`]) and every lane has as many bands to do (more
/// than one), each lane walks its bands (ranked from 0 among those it has to do) and columns in
/// growing squares instead: (0,0); (0,1), (1,0), (1,1); (0,2), (1,2), (2,0), (2,1), (2,2); … —
/// a new B column or A row every few tiles rather than a new B column for every tile of the
/// first row. Each input tile is still loaded once, but the loads spread over the step instead
/// of crowding its first row, where they outran the page-locking of the inputs (45000² fp64 on
/// one H200: the GPU idle 0.5 s in the step's first 1.2 s; 0.27 s and the step 2–4 % shorter in
/// squares, BENCHMARKS.md §20). With as many bands each, the lanes walk the same sequence of
/// ranked (band, column) cells and stay in phase. Stealing takes the back of a run, which in
/// squares is a column of tiles in different A rows (each costing the thief `gk` A loads; in
/// serpentine order they share one); neither order's stealing is in the traffic model.
pub(crate) struct TileQueue {
    order: Vec<u32>,
    grow: bool,
    runs: std::sync::Mutex<Vec<std::collections::VecDeque<u32>>>,
}

impl TileQueue {
    /// `todo`: schedule sequence numbers still to compute; `may_grow`: the lanes' tile caches
    /// hold all they need ([`crate::plan::layout::Layout::squares_fit`]), so growing squares
    /// (see above) are used when the lanes also have as many bands to do, more than one.
    pub(crate) fn new(sched: &Schedule, todo: Vec<u32>, lanes: usize, may_grow: bool) -> TileQueue {
        let lanes = lanes.max(1);
        // Each lane's bands among the tiles to do, ranked from 0.
        let mut bands = vec![std::collections::BTreeMap::<u64, u64>::new(); lanes];
        for &seq in &todo {
            let t = &sched.tiles[seq as usize];
            bands[(t.ti % lanes as u64) as usize].insert(t.ti / lanes as u64, 0);
        }
        for b in &mut bands {
            for (rank, v) in b.values_mut().enumerate() {
                *v = rank as u64;
            }
        }
        let grow = may_grow
            && sched.gn > 1
            && bands[0].len() > 1
            && bands.iter().all(|b| b.len() == bands[0].len());
        let mut keyed: Vec<(usize, u64, u64, u32)> = todo
            .iter()
            .map(|&seq| {
                let t = &sched.tiles[seq as usize];
                let lane = (t.ti % lanes as u64) as usize;
                let band = t.ti / lanes as u64;
                if grow {
                    // Square `s` = max(rank, column): its column part top-down, then its row
                    // part left to right.
                    let r = bands[lane][&band];
                    let s = r.max(t.tj);
                    let pos = if t.tj == s && r < s { r } else { s + t.tj };
                    return (lane, s, pos, seq);
                }
                let col = if band.is_multiple_of(2) {
                    t.tj
                } else {
                    sched.gn - 1 - t.tj
                };
                (lane, band, col, seq)
            })
            .collect();
        keyed.sort_unstable();
        let mut runs: Vec<std::collections::VecDeque<u32>> = vec![Default::default(); lanes];
        for &(lane, _, _, seq) in &keyed {
            runs[lane].push_back(seq);
        }
        TileQueue {
            order: todo,
            grow,
            runs: std::sync::Mutex::new(runs),
        }
    }
    pub(crate) fn pop(&self, lane: usize) -> Option<u32> {
        let mut runs = self.runs.lock().unwrap();
        if let Some(t) = runs[lane].pop_front() {
            return Some(t);
        }
        let victim = (0..runs.len()).max_by_key(|&i| runs[i].len())?;
        runs[victim].pop_back()
    }
    /// The lane's next tile if `pred` accepts it (never stolen from another lane).
    pub(crate) fn pop_if(&self, lane: usize, pred: impl Fn(u32) -> bool) -> Option<u32> {
        let mut runs = self.runs.lock().unwrap();
        let next = *runs[lane].front()?;
        pred(next).then(|| runs[lane].pop_front()).flatten()
    }
    /// Lane `lane`'s run as dealt (before any tile was taken or stolen).
    #[cfg(test)]
    pub(crate) fn run(&self, lane: usize) -> Vec<u32> {
        self.runs.lock().unwrap()[lane].iter().copied().collect()
    }
    /// Whether lanes walk their tiles in growing squares.
    pub(crate) fn grows(&self) -> bool {
        self.grow
    }
    /// The tiles to compute, in schedule order.
    pub(crate) fn order(&self) -> &[u32] {
        &self.order
    }
    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }
}

/// The input matrices of a step.
pub(crate) struct Inputs {
    pub(crate) a: Arc<dyn MatrixSource>,
    pub(crate) b: Arc<dyn MatrixSource>,
    pub(crate) c0: Option<Arc<dyn MatrixSource>>,
    pub(crate) verify: bool,
    pub(crate) nonfinite: AtomicU64,
    /// Bytes staged from sources held in memory (a chain's intermediate), not from files.
    pub(crate) memory_bytes: AtomicU64,
    /// Bytes of directly uploaded blocks checked on the device that copied them.
    pub(crate) device_checked: AtomicU64,
}

impl Inputs {
    pub(crate) fn new(
        a: Arc<dyn MatrixSource>,
        b: Arc<dyn MatrixSource>,
        c0: Option<Arc<dyn MatrixSource>>,
        verify: bool,
    ) -> Inputs {
        Inputs {
            a,
            b,
            c0,
            verify,
            nonfinite: AtomicU64::new(0),
            memory_bytes: AtomicU64::new(0),
            device_checked: AtomicU64::new(0),
        }
    }
    pub(crate) fn file(&self, s: Src) -> &dyn MatrixSource {
        match s {
            Src::A => &*self.a,
            Src::B => &*self.b,
            Src::C0 => &**self
                .c0
                .as_ref()
                .expect("C0 is only requested when the step has one"),
        }
    }
}

pub(crate) struct Planner<'a> {
    pub(crate) lane: usize,
    /// Output blocks about to be computed, for the output prefault stage (a hint: dropped
    /// rather than waited for when that stage is behind).
    pub(crate) outprep: Sender<Block>,
    pub(crate) sched: &'a Schedule,
    pub(crate) queue: &'a TileQueue,
    pub(crate) slots: usize,
    pub(crate) accs: usize,
    /// Output tiles the lane's first group computes k-chunk by k-chunk
    /// ([`crate::plan::layout::Layout::start_group`]; 1: none).
    pub(crate) start_group: usize,
    pub(crate) alpha: f64,
    pub(crate) beta: f64,
    pub(crate) has_c0: bool,
    /// Saved partial accumulators: tiles found there start at their next k-chunk.
    pub(crate) ckpt: Option<&'a Checkpoints>,
    pub(crate) out: Sender<PlanOp>,
    pub(crate) m: Arc<StageMetrics>,
}

impl Planner<'_> {
    /// The k-chunk `seq` starts at: its checkpoint's next chunk when it resumes from one.
    fn k0(&self, seq: u32) -> u64 {
        self.ckpt
            .and_then(|c| c.resumed().get(&seq))
            .map_or(0, |&d| d as u64)
    }

    /// The loads and the GEMM of k-chunk `kk` of `tile` into `acc`.
    fn gemm_ops(
        &self,
        cache: &mut TileCache,
        tile: OutTile,
        kk: u64,
        acc: usize,
        ops: &mut Vec<PlanOp>,
    ) {
        let s = self.sched;
        let (a_slot, load_a) = cache.get((Src::A, tile.ti, kk));
        if load_a {
            ops.push(PlanOp::Load {
                slot: a_slot,
                src: Src::A,
                block: s.a_block(&tile, kk),
            });
        }
        let (b_slot, load_b) = cache.get((Src::B, kk, tile.tj));
        if load_b {
            ops.push(PlanOp::Load {
                slot: b_slot,
                src: Src::B,
                block: s.b_block(&tile, kk),
            });
        }
        let beta = if kk > 0 {
            1.0
        } else if self.has_c0 {
            self.beta
        } else {
            0.0
        };
        let desc = GemmDesc {
            m: tile.block.rows as usize,
            n: tile.block.cols as usize,
            k: s.kdepth(kk) as usize,
            a_trans: s.a_trans,
            b_trans: s.b_trans,
            alpha: self.alpha,
            beta,
        };
        ops.push(PlanOp::Gemm {
            desc,
            a_slot,
            b_slot,
            acc,
            tile,
            kk,
        });
    }

    /// The lane's first output tiles, up to [`Layout::start_group`] of them, that start from
    /// k-chunk 0: computed k-chunk by k-chunk across the group (see there). In serpentine order
    /// they are tiles of the lane's first row; in growing squares ([`TileQueue`]) the next
    /// tiles of its run, which on a fresh step with a group of four are its first square,
    /// (0,0), (0,1), (1,0), (1,1), whose k-chunk `kk` needs two A and two B tiles for four
    /// GEMMs.
    ///
    /// [`Layout::start_group`]: crate::plan::layout::Layout::start_group
    fn first_group(&self, seq: u32) -> Vec<u32> {
        let mut group = vec![seq];
        if self.start_group < 2 || self.k0(seq) > 0 {
            return group;
        }
        let ti = self.sched.tiles[seq as usize].ti;
        let grows = self.queue.grows();
        while group.len() < self.start_group {
            let next = self.queue.pop_if(self.lane, |q| {
                (grows || self.sched.tiles[q as usize].ti == ti) && self.k0(q) == 0
            });
            match next {
                Some(q) => group.push(q),
                None => break,
            }
        }
        group
    }

    pub(crate) fn run(self, ctl: &Control) -> Result<()> {
        let mut cache = TileCache::new(self.slots);
        let mut count = 0usize;
        let s = self.sched;
        while let Some(seq) = self.queue.pop(self.lane) {
            if ctl.is_cancelled() {
                return Err(Error::Cancelled);
            }
            let t0 = Instant::now();
            let group = if count == 0 {
                self.first_group(seq)
            } else {
                vec![seq]
            };
            let mut ops = Vec::new();
            let mut tiles = Vec::with_capacity(group.len());
            for &q in &group {
                let tile = s.tiles[q as usize];
                let _ = self.outprep.try_send(tile.block);
                let acc = count % self.accs;
                count += 1;
                // A tile resumed from its checkpoint continues at its next k-chunk; alpha,
                // beta and C0 entered in k-chunk 0 and are in the saved accumulator.
                let k0 = self.k0(q);
                ops.push(PlanOp::Begin {
                    acc,
                    c0: (self.has_c0 && k0 == 0).then_some(tile.block),
                    resume: (k0 > 0).then_some(tile),
                });
                tiles.push((tile, acc, k0));
            }
            // One tile: its k-chunks in order. A group: k-chunk by k-chunk across the tiles,
            // each tile's download as soon as its last GEMM is queued. Either way each tile
            // sums its k-chunks in the same order, so the bytes do not depend on grouping.
            let k_first = tiles.iter().map(|t| t.2).min().unwrap_or(0);
            let mut ended = vec![false; tiles.len()];
            for kk in k_first..s.gk {
                for (i, &(tile, acc, k0)) in tiles.iter().enumerate() {
                    if kk < k0 {
                        continue;
                    }
                    self.gemm_ops(&mut cache, tile, kk, acc, &mut ops);
                    if kk + 1 == s.gk {
                        ops.push(PlanOp::End { tile, acc });
                        ended[i] = true;
                    }
                }
            }
            for (i, &(tile, acc, _)) in tiles.iter().enumerate() {
                if !ended[i] {
                    ops.push(PlanOp::End { tile, acc });
                }
            }
            self.m.add_busy(t0.elapsed());
            for _ in &tiles {
                self.m.add_item(0);
            }
            for op in ops {
                ctl.send_timed(&self.out, op, &self.m)?;
            }
        }
        Ok(())
    }
}

pub(crate) struct Prefetch<'a> {
    pub(crate) inputs: &'a Inputs,
    pub(crate) rx: Receiver<PlanOp>,
    pub(crate) out: Sender<PlanOp>,
    pub(crate) m: Arc<StageMetrics>,
}

impl Prefetch<'_> {
    pub(crate) fn run(self, ctl: &Control) -> Result<()> {
        while let Some(op) = ctl.recv_timed(&self.rx, &self.m) {
            let t = Instant::now();
            match &op {
                PlanOp::Load { src, block, .. } => {
                    let n = self.inputs.file(*src).will_need(block);
                    self.m.add_item(n);
                }
                PlanOp::Begin {
                    c0: Some(block), ..
                } => {
                    let n = self.inputs.file(Src::C0).will_need(block);
                    self.m.add_item(n);
                }
                _ => {}
            }
            self.m.add_busy(t.elapsed());
            ctl.send_timed(&self.out, op, &self.m)?;
        }
        Ok(())
    }
}

pub(crate) struct Staging<'a> {
    /// This lane's index (owner of `pool` in the shared reader).
    pub(crate) lane: usize,
    pub(crate) inputs: &'a Inputs,
    pub(crate) shared: &'a SharedReads,
    /// Uploads straight from the files' pages, when this lane's device can do them, and where
    /// their checks go ([`Checker`]).
    pub(crate) direct: Option<(&'a DirectReads, Sender<CheckJob>, Arc<CheckProgress>)>,
    /// Checks issued so far.
    pub(crate) checks_issued: std::cell::Cell<u64>,
    /// The lane checks directly uploaded blocks on its device ([`crate::backend::check`]).
    pub(crate) device_checks: bool,
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
        if nonfinite > 0 {
            self.inputs
                .nonfinite
                .fetch_add(nonfinite, Ordering::Relaxed);
        }
        self.m.add_busy(t.elapsed());
        let read = (elems * f.dtype().size()) as u64;
        self.m.add_item(read);
        if f.in_memory() {
            self.inputs.memory_bytes.fetch_add(read, Ordering::Relaxed);
        }
        Ok(Arc::new(lease))
    }

    /// `block` of `src` as rectangles of its file's page-locked map, when direct uploads apply
    /// to it ([`DirectReads::prepare`]), its checks handed to the [`Checker`]; `None`: copy it.
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

    pub(crate) fn run(self, ctl: &Control) -> Result<()> {
        while let Some(op) = ctl.recv_timed(&self.rx, &self.m) {
            let out = match op {
                PlanOp::Load { slot, src, block } => {
                    let (buf, elems) = match self.fill_direct(ctl, src, &block)? {
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
}

/// GEMMs a lane may have queued on its device ([`DeviceLane::hold_back`]).
const MAX_AHEAD: usize = 8;

/// How often a device lane waiting for its next op checks for finished copies.
const LANE_POLL: std::time::Duration = std::time::Duration::from_micros(500);

struct Pending {
    ups: Vec<(Ticket, Staged)>,
    downs: Vec<(Ticket, Done)>,
}

impl DeviceLane<'_> {
    /// An output buffer: a free one, or (after letting go of everything finished) the next one
    /// writeback returns.
    fn lease_out(&mut self, p: &mut Pending, ctl: &Control) -> Result<Lease> {
        if let Some(b) = self.out_pool.try_lease() {
            return Ok(b);
        }
        self.settle(p, ctl, true)?;
        let t = Instant::now();
        let b = self.out_pool.lease(ctl)?;
        self.m.add_wait_out(t.elapsed());
        Ok(b)
    }

    /// Put `tile`'s saved accumulator into `acc`, so that the tile continues where its
    /// checkpoint left off. The file is read here, on the lane's thread, into an output buffer
    /// (the only host buffer sized for a whole tile); it happens once per resumed tile.
    fn resume(&mut self, tile: &OutTile, acc: usize, p: &mut Pending, ctl: &Control) -> Result<()> {
        let ckpt = self.ckpt.expect("resumed tiles come from checkpoints");
        let mut buf = self.lease_out(p, ctl)?;
        ckpt.read_into(tile, buf.buf_mut().bytes_mut())?;
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
        let tk = self.lane.download(acc, tile.block.elems(), buf.buf_mut())?;
        self.lane.wait(tk)?;
        let done = Done {
            tile: *tile,
            buf,
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
    /// finished or the run is cancelled.
    fn next_op(&mut self, p: &mut Pending, ctl: &Control) -> Result<Option<LaneOp>> {
        // Only the time spent in `recv` counts as waiting for input (handing on finished
        // downloads counts as waiting for room downstream, in `settle`).
        let mut waited = std::time::Duration::ZERO;
        let op = loop {
            self.settle(p, ctl, false)?;
            let t = Instant::now();
            if p.ups.is_empty() && p.downs.is_empty() {
                let op = ctl.recv(&self.rx);
                waited += t.elapsed();
                break op;
            }
            let r = ctl.recv_within(&self.rx, LANE_POLL);
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
    /// sixth of its share in 3–6 of 30 runs (`tests/sim.rs`), 1 in 30 with a bound of 32,
    /// none with 8. Eight 8192³ GEMMs are 0.17 s of fp32 and 16–22 ms of tf32 or bf16 on an
    /// H200, well ahead of the GPU.
    fn hold_back(&mut self, p: &mut Pending, ctl: &Control) -> Result<()> {
        if self.lane.in_flight() < MAX_AHEAD {
            return Ok(());
        }
        // Hand on what is finished first: the wait below is for the oldest GEMM only.
        self.settle(p, ctl, false)?;
        let t = Instant::now();
        self.lane.wait_in_flight_below(MAX_AHEAD)?;
        self.m.add_wait_out(t.elapsed());
        Ok(())
    }

    pub(crate) fn run(mut self, ctl: &Control) -> Result<()> {
        self.lane.bind_thread()?;
        let mut p = Pending {
            ups: Vec::new(),
            downs: Vec::new(),
        };
        let r = self.work(ctl, &mut p);
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

    fn work(&mut self, ctl: &Control, p: &mut Pending) -> Result<()> {
        let mut ops = 0u64;
        // When each accumulator's tile started, or was last saved (for checkpoints): per
        // accumulator, because a start group interleaves several tiles' k-chunks.
        let mut marks: Vec<Instant> = Vec::new();
        loop {
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
                    let tk = match &buf {
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
                    p.ups.push((tk, buf));
                }
                LaneOp::Begin { acc, c0, resume } => {
                    if marks.len() <= acc {
                        marks.resize(acc + 1, Instant::now());
                    }
                    marks[acc] = Instant::now();
                    if let Some((buf, elems)) = c0 {
                        let tk = self.lane.upload(buf.buf(), elems, Dst::Acc(acc))?;
                        p.ups.push((tk, Staged::Buf(buf)));
                    }
                    if let Some(tile) = resume {
                        self.resume(&tile, acc, p, ctl)?;
                    }
                }
                LaneOp::Gemm {
                    desc,
                    a_slot,
                    b_slot,
                    acc,
                    tile,
                    kk,
                } => {
                    self.hold_back(p, ctl)?;
                    self.lane.gemm(&desc, a_slot, b_slot, acc)?;
                    if ops == 0 || self.first_gemm.1.load(Ordering::Relaxed) == u64::MAX {
                        let ns = self.first_gemm.0.elapsed().as_nanos() as u64;
                        self.first_gemm.1.fetch_min(ns, Ordering::Relaxed);
                    }
                    self.flops_issued
                        .fetch_add(2 * (desc.m * desc.n * desc.k) as u64, Ordering::Relaxed);
                    if let Some(c) = self.ckpt {
                        let mark = marks.get(acc).copied().unwrap_or_else(Instant::now);
                        if kk + 1 < c.k_chunks() && c.due(mark) {
                            self.checkpoint(&tile, acc, kk as u32 + 1, p, ctl)?;
                            if let Some(m) = marks.get_mut(acc) {
                                *m = Instant::now();
                            }
                        }
                    }
                }
                LaneOp::End { tile, acc } => {
                    // At most `max_downs` downloads in flight: a lane whose device is slower
                    // than its input (every input tile cached, or a slow GPU) would otherwise
                    // run ahead through its ops and hold every buffer of the shared output pool
                    // while its device catches up, starving the other lanes.
                    while p.downs.len() >= self.max_downs.max(1) {
                        let t = Instant::now();
                        self.lane.wait(p.downs[0].0)?;
                        self.m.add_wait_out(t.elapsed());
                        let (_, d) = p.downs.remove(0);
                        ctl.send_timed(self.out.to(d.tile.seq), d, &self.m)?;
                    }
                    let mut buf = self.lease_out(p, ctl)?;
                    let elems = tile.block.elems();
                    let tk = self.lane.download(acc, elems, buf.buf_mut())?;
                    let (partial, checks) = (None, self.checks.clone());
                    p.downs.push((
                        tk,
                        Done {
                            tile,
                            buf,
                            partial,
                            checks,
                        },
                    ));
                    self.m.add_item((elems * self.host_dt.size()) as u64);
                }
            }
            self.m.add_busy_since(t, waited);
            self.settle(p, ctl, false)?;
            ops += 1;
            if ops.is_multiple_of(16) {
                *self.live.lock().unwrap() = self.lane.live_stats();
            }
        }
        if !ctl.is_cancelled() {
            self.settle(p, ctl, true)?;
            *self.live.lock().unwrap() = self.lane.live_stats();
            self.lane.release();
        }
        Ok(())
    }
}

/// Populates the output file's pages for tiles the planners just scheduled, so writeback copies
/// into memory that is already mapped instead of taking a page fault per 4 KiB.
pub(crate) struct OutPrep<'a> {
    pub(crate) writer: &'a dyn MatrixSink,
    pub(crate) rx: Receiver<Block>,
    pub(crate) m: Arc<StageMetrics>,
}

impl OutPrep<'_> {
    pub(crate) fn run(self, ctl: &Control) -> Result<()> {
        while let Some(b) = ctl.recv_timed(&self.rx, &self.m) {
            let t = Instant::now();
            let n = self.writer.prefault(&b);
            self.m.add_busy(t.elapsed());
            self.m.add_item(n);
        }
        Ok(())
    }
}

pub(crate) struct Writeback<'a> {
    pub(crate) writer: &'a dyn MatrixSink,
    /// Where checkpoints (partial accumulators) are saved.
    pub(crate) ckpt: Option<&'a Checkpoints>,
    pub(crate) host_dt: DType,
    pub(crate) rx: Receiver<Done>,
    /// Written tiles (with their CRC) on their way to being made durable and recorded.
    pub(crate) out: Sender<(OutTile, u32)>,
    pub(crate) m: Arc<StageMetrics>,
}

impl Writeback<'_> {
    pub(crate) fn run(self, ctl: &Control) -> Result<()> {
        while let Some(d) = ctl.recv_timed(&self.rx, &self.m) {
            if let Some((progress, n)) = &d.checks {
                // Nothing computed from an input block is written before its checks passed.
                let t = Instant::now();
                progress.wait_for(*n, ctl)?;
                self.m.add_wait_in(t.elapsed());
            }
            let t = Instant::now();
            let b = d.tile.block;
            let bytes = b.elems() * self.host_dt.size();
            let data = &d.buf.buf().bytes()[..bytes];
            if let Some(k_done) = d.partial {
                let c = self.ckpt.expect("only a run with checkpoints takes them");
                // A checkpoint that cannot be saved (disk full, read-only directory) only
                // means a kill would lose more: the run goes on without further checkpoints.
                if let Err(e) = c.save(&d.tile, k_done, data) {
                    c.give_up(&e);
                }
                drop(d.buf);
                self.m.add_busy(t.elapsed());
                continue;
            }
            // Populate the block's pages here too: when output is all the work (the 43 GB
            // chain) writeback overtakes outprep, and copying into unpopulated pages takes a
            // fault per 4 KiB while outprep populates the same tiles beside it. On two H200s
            // the chain took 3.55–3.69 s so against 6.87–7.24 s (BENCHMARKS.md §25); pages
            // outprep already made cost a walk of their page table.
            self.writer.prefault(&b);
            let crc = self.writer.write_block(&b, self.host_dt, data)?;
            drop(d.buf);
            // Out of this process's map now that it is written (still in the page cache):
            // resident memory holds the tiles in flight, not the output.
            self.writer.release(&b);
            self.m.add_busy(t.elapsed());
            self.m
                .add_item(b.elems() as u64 * self.writer.dtype().size() as u64);
            ctl.send_timed(&self.out, (d.tile, crc), &self.m)?;
        }
        Ok(())
    }
}

/// Makes written tiles durable (when asked) and records them in the journal, one after the
/// other, on its own thread: waiting for the disk to take tile `t` overlaps writeback writing
/// tile `t + 1` and the devices computing more, instead of stalling them.
pub(crate) struct Durable<'a> {
    pub(crate) writer: &'a dyn MatrixSink,
    pub(crate) rx: Receiver<(OutTile, u32)>,
    pub(crate) m: Arc<StageMetrics>,
    pub(crate) sink: &'a dyn TileSink,
    /// Checkpoints of tiles, removed once the tile is recorded.
    pub(crate) ckpt: Option<&'a Checkpoints>,
    pub(crate) tiles_done: &'a AtomicU64,
    pub(crate) flops_done: &'a AtomicU64,
    pub(crate) k: u64,
    /// Flush each tile's data before its journal record.
    pub(crate) durable: bool,
}

impl Durable<'_> {
    pub(crate) fn run(self, ctl: &Control) -> Result<()> {
        while let Some((tile, crc)) = ctl.recv_timed(&self.rx, &self.m) {
            let t = Instant::now();
            let b = tile.block;
            if self.durable {
                self.writer.flush_block(&b)?;
            }
            self.sink.tile_written(&tile, crc)?;
            // Work done before this run (a resumed checkpoint) was counted at the start.
            let mut k = self.k;
            if let Some(c) = self.ckpt {
                c.finished(tile.seq)?;
                k -= c.k_before(tile.seq);
            }
            self.m.add_busy(t.elapsed());
            self.m.add_item(0);
            self.tiles_done.fetch_add(1, Ordering::Relaxed);
            self.flops_done
                .fetch_add(2 * b.rows * b.cols * k, Ordering::Relaxed);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Caps, MemorySpace};
    use crate::pipeline::metrics::StageKind;
    use crate::plan::layout::Layout;

    /// A 300×190 · 190×520 step in 64² tiles (5 × 9 output tiles, 3 k-chunks) on a device
    /// with 1 GiB, and the planner's ops for it with the layout's start group or `group`, in
    /// serpentine order or (`grow`) growing squares.
    fn planner_ops(group: Option<usize>, grow: bool) -> (Schedule, Layout, Vec<PlanOp>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.toml");
        std::fs::write(
            &path,
            "[matrices.A]\npath = \"A.mgt\"\ngenerate = { rows = 300, cols = 190 }\n\
             [matrices.B]\npath = \"B.mgt\"\ngenerate = { rows = 190, cols = 520 }\n\
             [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n[engine]\ntile = 64\n",
        )
        .unwrap();
        let plan = crate::plan::Plan::load(&path).unwrap();
        let caps = Caps {
            kind: "test",
            memory: MemorySpace::Device,
            tile_ladder: &[64],
            staging_depth: 4,
            extra_out_buf: true,
            auto_copies_from: usize::MAX,
            lanes: 1,
            device_memory: 1 << 30,
            narrow_slots: false,
            link_names: ("H2D", "D2H"),
            link_rate: None,
            peak_flops: |_, _| 1e12,
            peak_source: "test",
        };
        let step = &plan.steps[0];
        let l = Layout::new(&plan.path, step, &plan.engine, &caps).unwrap();
        let sched = Schedule::new(step, &l);
        assert!(l.squares_fit(step, 1), "the fixture fits the device");
        let queue = TileQueue::new(&sched, (0..sched.tiles.len() as u32).collect(), 1, grow);
        let (tx, rx) = crossbeam_channel::unbounded();
        let (prep_tx, _prep_rx) = crossbeam_channel::unbounded();
        Planner {
            lane: 0,
            outprep: prep_tx,
            sched: &sched,
            queue: &queue,
            slots: l.slots,
            accs: l.accs,
            start_group: group.unwrap_or(l.start_group),
            alpha: 1.0,
            beta: 0.0,
            has_c0: false,
            ckpt: None,
            out: tx,
            m: StageMetrics::new(StageKind::Planner, 0, 1),
        }
        .run(&Control::new())
        .unwrap();
        let ops = rx.try_iter().collect();
        (sched, l, ops)
    }

    /// (tile seq, k-chunk) of every GEMM, in order.
    type Gemms = Vec<(u32, u64)>;

    /// Every GEMM's (tile seq, k-chunk), in order, and each End's position and tile.
    fn gemms_and_ends(ops: &[PlanOp]) -> (Gemms, Vec<(usize, u32)>) {
        let (mut g, mut e) = (Vec::new(), Vec::new());
        for (i, op) in ops.iter().enumerate() {
            match op {
                PlanOp::Gemm { tile, kk, .. } => g.push((tile.seq, *kk)),
                PlanOp::End { tile, .. } => e.push((i, tile.seq)),
                _ => {}
            }
        }
        (g, e)
    }

    /// The lane's first four tiles of row 0 go k-chunk by k-chunk (k-chunk 0 of all four, then
    /// 1, then 2), each tile's End right after its last GEMM, on four accumulators; every later
    /// tile runs its k-chunks in order on its own. Each tile's k-chunks are in order either way.
    #[test]
    fn a_start_group_runs_k_chunk_by_k_chunk() {
        let (sched, l, ops) = planner_ops(None, false);
        assert_eq!((l.start_group, l.accs), (4, 5), "{l:?}");
        let gk = sched.gk;
        assert_eq!(gk, 3);
        let begins: Vec<usize> = ops
            .iter()
            .take_while(|op| matches!(op, PlanOp::Begin { .. }))
            .map(|op| match op {
                PlanOp::Begin { acc, .. } => *acc,
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(begins, vec![0, 1, 2, 3]);
        let (g, ends) = gemms_and_ends(&ops);
        assert_eq!(g.len() as u64, sched.tiles.len() as u64 * gk);
        let group: Vec<u32> = g[..4].iter().map(|x| x.0).collect();
        // Four distinct tiles of one row.
        let ti = sched.tiles[group[0] as usize].ti;
        let mut tj: Vec<u64> = group.iter().map(|&q| sched.tiles[q as usize].tj).collect();
        tj.sort_unstable();
        tj.dedup();
        assert!(group.iter().all(|&q| sched.tiles[q as usize].ti == ti) && tj.len() == 4);
        for kk in 0..gk {
            let chunk: Vec<(u32, u64)> = group.iter().map(|&q| (q, kk)).collect();
            assert_eq!(&g[4 * kk as usize..4 * (kk as usize + 1)], &chunk[..]);
        }
        // The group's Ends come after each tile's last GEMM and before the next tile's Begin.
        let pos = |want: &dyn Fn(&PlanOp) -> bool| ops.iter().position(want).unwrap();
        for &q in &group {
            let last = pos(
                &|op| matches!(op, PlanOp::Gemm { tile, kk, .. } if tile.seq == q && *kk == gk - 1),
            );
            let end = ends.iter().find(|e| e.1 == q).unwrap().0;
            assert_eq!(end, last + 1, "tile {q}");
        }
        // After the group: one tile at a time, its k-chunks in order.
        for w in g[4 * gk as usize..].chunks(gk as usize) {
            assert!(w.iter().all(|x| x.0 == w[0].0), "{w:?}");
            assert_eq!(w.iter().map(|x| x.1).collect::<Vec<_>>(), vec![0, 1, 2]);
        }
        // With the group off, the same tiles in the same order, each on its own.
        let (_, _, plain) = planner_ops(Some(1), false);
        let (pg, _) = gemms_and_ends(&plain);
        for w in pg.chunks(gk as usize) {
            assert!(w.iter().all(|x| x.0 == w[0].0), "{w:?}");
        }
        let order = |g: &[(u32, u64)]| {
            let mut v: Vec<u32> = g.iter().map(|x| x.0).collect();
            v.dedup();
            v
        };
        assert_eq!(
            order(&pg),
            group
                .iter()
                .copied()
                .chain(order(&g[12..]))
                .collect::<Vec<_>>()
        );
    }

    /// (band, column) of a lane's run.
    fn cells(sched: &Schedule, run: &[u32], lanes: u64) -> Vec<(u64, u64)> {
        run.iter()
            .map(|&q| {
                let t = &sched.tiles[q as usize];
                (t.ti / lanes, t.tj)
            })
            .collect()
    }

    /// Growing squares over a grid of `rows` × `cols` cells, written out square by square: the
    /// column part top-down, then the row part left to right.
    fn squares(rows: u64, cols: u64) -> Vec<(u64, u64)> {
        let mut v = Vec::new();
        for s in 0..rows.max(cols) {
            v.extend((0..s).map(|b| (b, s)));
            v.extend((0..=s).map(|j| (s, j)));
        }
        v.retain(|&(b, j)| b < rows && j < cols);
        v
    }

    /// A schedule of `gm` × `gn` output tiles of 64² (the fixture's, with its tiles replaced).
    fn grid(sched: &Schedule, gm: u64, gn: u64) -> Schedule {
        let mut s = sched.clone();
        s.gn = gn;
        s.tiles = (0..gm)
            .flat_map(|ti| (0..gn).map(move |tj| (ti, tj)))
            .enumerate()
            .map(|(i, (ti, tj))| OutTile {
                seq: i as u32,
                ti,
                tj,
                block: crate::store::Block {
                    r0: ti * 64,
                    c0: tj * 64,
                    rows: 64,
                    cols: 64,
                },
            })
            .collect();
        s
    }

    /// In growing squares every tile comes once, in the order written out by [`squares`], and
    /// the loads are spread: with a cache that holds everything both orders load each input
    /// tile once, but the squares need fewer of them over the first row's worth of tiles.
    #[test]
    fn growing_squares_cover_every_tile_once_and_spread_the_loads() {
        let (sched, l, _) = planner_ops(None, false);
        let (gm, gn, gk) = (5u64, sched.gn, sched.gk);
        assert_eq!((gn, gk), (9, 3));
        let all: Vec<u32> = (0..sched.tiles.len() as u32).collect();
        let q = TileQueue::new(&sched, all.clone(), 1, true);
        assert!(q.grows());
        let sq = q.run(0);
        assert_eq!(cells(&sched, &sq, 1), squares(gm, gn));
        let loads = |run: &[u32], upto: usize| {
            let mut cache = TileCache::new(l.slots);
            let mut n = 0;
            for &q in &run[..upto] {
                let t = &sched.tiles[q as usize];
                for kk in 0..gk {
                    n += cache.get((Src::A, t.ti, kk)).1 as u64;
                    n += cache.get((Src::B, kk, t.tj)).1 as u64;
                }
            }
            n
        };
        let plain = TileQueue::new(&sched, all.clone(), 1, false);
        assert!(!plain.grows());
        let serp = plain.run(0);
        let n = all.len();
        assert_eq!(loads(&sq, n), gk * (gm + gn));
        assert_eq!(loads(&serp, n), gk * (gm + gn));
        // The first row's worth of tiles: the serpentine loads A's row and all of B, the
        // squares A's first three rows and B's first three columns.
        assert_eq!(loads(&serp, gn as usize), gk * (1 + gn));
        assert_eq!(loads(&sq, gn as usize), gk * (3 + 3));
        // One band, or one column: nothing to grow.
        let one_band: Vec<u32> = (0..gn as u32).collect();
        assert!(!TileQueue::new(&sched, one_band, 1, true).grows());
        let g1 = grid(&sched, 4, 1);
        assert!(!TileQueue::new(&g1, (0..4).collect(), 1, true).grows());
    }

    /// Lanes walk the same sequence of ranked (band, column) cells when they have as many bands
    /// to do — the whole grid, or a shard or resume that starts at any band — and keep the
    /// serpentine order when they have not.
    #[test]
    fn growing_squares_keep_lanes_in_phase_or_are_not_used() {
        let (sched, _, _) = planner_ops(None, false);
        let g = grid(&sched, 10, 7);
        let rows = |r: std::ops::Range<u64>| -> Vec<u32> {
            (r.start * 7..r.end * 7).map(|q| q as u32).collect()
        };
        // (tiles to do, lanes, squares expected, bands per lane)
        for (todo, lanes, grow, bands) in [
            (rows(0..10), 2, true, 5),
            (rows(2..10), 2, true, 4),
            (rows(3..7), 2, true, 2),
            (rows(0..5), 2, false, 0),
            (rows(0..9), 3, true, 3),
            (rows(1..10), 3, true, 3),
            (rows(0..10), 3, false, 0),
        ] {
            let n = todo.len();
            let q = TileQueue::new(&g, todo.clone(), lanes, true);
            assert_eq!(q.grows(), grow, "{todo:?} on {lanes} lanes");
            let runs: Vec<Vec<u32>> = (0..lanes).map(|l| q.run(l)).collect();
            assert_eq!(runs.iter().map(|r| r.len()).sum::<usize>(), n);
            let mut seen: Vec<u32> = runs.concat();
            seen.sort_unstable();
            assert_eq!(seen, todo);
            if grow {
                for (l, run) in runs.iter().enumerate() {
                    // Ranked bands: the lane's i-th band to do is rank i.
                    let ranked: Vec<(u64, u64)> = cells(&g, run, lanes as u64)
                        .into_iter()
                        .map(|(b, j)| {
                            let first = run.iter().map(|&q| g.tiles[q as usize].ti).min().unwrap();
                            (b - first / lanes as u64, j)
                        })
                        .collect();
                    assert_eq!(ranked, squares(bands, 7), "lane {l} of {lanes}");
                }
            }
        }
    }

    /// In growing squares the start group is the first square: k-chunk 0 of (0,0), (0,1),
    /// (1,0), (1,1), then k-chunk 1 of them, …; every tile's k-chunks in order, every tile once.
    #[test]
    fn the_start_group_of_growing_squares_is_the_first_square() {
        let (sched, l, ops) = planner_ops(None, true);
        assert_eq!(l.start_group, 4);
        let (g, _) = gemms_and_ends(&ops);
        assert_eq!(g.len(), sched.tiles.len() * sched.gk as usize);
        let cell = |q: u32| (sched.tiles[q as usize].ti, sched.tiles[q as usize].tj);
        for kk in 0..sched.gk as usize {
            let chunk: Vec<((u64, u64), u64)> = g[4 * kk..4 * kk + 4]
                .iter()
                .map(|x| (cell(x.0), x.1))
                .collect();
            assert_eq!(
                chunk,
                [(0, 0), (0, 1), (1, 0), (1, 1)].map(|c| (c, kk as u64)),
            );
        }
        for w in g[12..].chunks(sched.gk as usize) {
            assert!(w.iter().all(|x| x.0 == w[0].0), "{w:?}");
            assert_eq!(w.iter().map(|x| x.1).collect::<Vec<_>>(), vec![0, 1, 2]);
        }
        let loads = ops
            .iter()
            .filter(|op| matches!(op, PlanOp::Load { .. }))
            .count() as u64;
        assert_eq!(loads, sched.gk * (5 + sched.gn));
    }
}
