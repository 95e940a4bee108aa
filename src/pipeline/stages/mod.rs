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
//!
//! One file per stage, named as reports and the progress display name it
//! ([`StageKind`](crate::metrics::StageKind)): [`planner`], [`prefetch`], [`staging`],
//! [`check`], [`lane`], [`outprep`], [`writeback`], [`sync`]. Each opens with what it takes and
//! gives, on which thread, and what blocks it. What they share: the [`messages`] between them,
//! the step's [`inputs`], the [`nonfinite`] tallies, and the [`queue`] of output tiles the planners take from.
//!
//! [`Control`]: crate::pipeline::control::Control

mod check;
mod inputs;
mod lane;
mod messages;
mod nonfinite;
mod outprep;
mod planner;
mod prefetch;
mod queue;
mod staging;
mod sync;
mod writeback;

pub(crate) use check::Checker;
pub(crate) use inputs::{Inputs, NonfiniteSeen};
pub(crate) use lane::DeviceLane;
pub(crate) use messages::{Done, LaneOp, PlanOp, ToWriteback};
pub(crate) use nonfinite::Nonfinite;
pub(crate) use outprep::OutPrep;
pub(crate) use planner::Planner;
pub(crate) use prefetch::Prefetch;
pub(crate) use queue::TileQueue;
pub(crate) use staging::Staging;
pub(crate) use sync::Durable;
pub(crate) use writeback::Writeback;
