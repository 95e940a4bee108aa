//! The messages between the stages of one lane and on to the output side: planner → prefetch →
//! staging ([`PlanOp`]), staging → device lane ([`LaneOp`], carrying [`Staged`] blocks),
//! device lane → writeback ([`Done`], over [`ToWriteback`]) and staging → check ([`CheckJob`]).
//! Plain data: each is moved through a bounded channel and owned by one stage at a time.

use std::sync::Arc;

use crossbeam_channel::Sender;

use crate::backend::GemmDesc;
use crate::pipeline::direct::{CheckProgress, DirectUpload};
use crate::pipeline::pool::Lease;
use crate::plan::schedule::{OutTile, Src};
use crate::store::Block;

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
/// page-locked map ([`crate::pipeline::direct`]). Held until the lane's copy of it is done.
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
    /// The output buffer holding the tile, or (`into`) a lease without one.
    pub(crate) buf: Lease,
    /// Where the lane wrote the tile itself: the output's own memory
    /// ([`crate::store::MatrixSink::direct_rect`]); `None`: it is in `buf`.
    pub(crate) into: Option<crate::seam::OutRect>,
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
    pub(crate) _pins: Vec<crate::pipeline::direct::Pin>,
}
