//! Durability: what survives a crash and how a step finds its way back.
//!
//! The [`journal`] records each output tile once its bytes are written (and flushed, with
//! `durable = true`), keyed by the step's fingerprint; the [`checkpoint`]s hold the accumulators
//! of long tiles part-way through K. Both are files beside the output. This layer sits above
//! `plan/` and `store/` and below the pipeline (which saves checkpoints as tiles progress) and
//! `run/` (whose `StepRun` opens the journal and decides what a resume redoes).

pub(crate) mod checkpoint;
pub mod journal;
pub(crate) mod sink;
pub(crate) mod split;
