//! mgmm-stream: multiply matrices too big for GPU memory or host RAM.
//!
//! Matrices live on disk as `.mgt` tiled files ([`store`]). A `plan.toml` names the inputs and
//! the products to compute ([`plan`]); each product streams through a pipeline of stage threads
//! ([`pipeline`]) onto one lane per device ([`backend`]):
//!
//! ```text
//!             shared queue of output tiles (each lane owns a run, steals when idle)
//!                 │            │
//!   per lane:  planner ──▶ prefetch ──▶ staging ──▶ device lane ──┐
//!   per lane:  planner ──▶ prefetch ──▶ staging ──▶ device lane ──┼──▶ writeback ──▶ output.mgt
//!                 └──────────── output blocks ──▶ outprep ────────┘        │
//!                                                                     journal record
//! ```
//!
//! | stage | input → output | thread | notes |
//! |---|---|---|---|
//! | planner | tile queue → `PlanOp` | one per lane | runs the lane's tile-cache model; decides loads and slots |
//! | prefetch | `PlanOp` → `PlanOp` | one per lane | `madvise(WILLNEED)` on the blocks about to be staged |
//! | staging | `PlanOp` → `LaneOp` | one per lane (+ rayon for reads) | leases a buffer from the pool, `pread`s the block, verifies tile CRCs once |
//! | device lane | `LaneOp` → `Done` | one per lane | upload, GEMM, download; on CUDA three streams and events |
//! | outprep | output blocks → (pages) | a quarter of `threads`, 2 to 8 (at least one per lane, up to 8) | populates the output file's pages ahead of writeback |
//! | writeback | `Done` → file | `threads / 8`, 1 to 4 (a tile's messages on one) | writes the tile, returns the buffer, hands it to sync |
//!
//! Backpressure comes from bounded channels and fixed buffer pools sized by the plan's memory
//! budget ([`plan::layout`]); the first error cancels every stage ([`pipeline::control`]).

//!
//! The public surface is small: [`run`] (run a plan), [`api`] (run one step on operands the
//! caller opened, for the Python package), [`plan`] (load and inspect a plan), [`store`] (read
//! and write matrix files), [`verify`], [`dtype`], [`progress`], [`backend`] (choose one; the
//! simulated and fault-injecting backends of the tests), [`cli`] (the binary) and [`Error`].
//! The tests also reach into [`journal`] and [`cluster`] to check resume state. Everything else
//! is `pub(crate)`.

#![warn(missing_docs, unreachable_pub)]

pub mod api;
pub mod backend;
pub mod cli;
pub mod cluster;
pub(crate) mod config;
pub mod dtype;
pub(crate) mod durable;
pub mod error;
pub mod interrupt;
pub(crate) mod metrics;
pub mod out;
pub(crate) mod pipeline;
pub mod plan;
pub mod progress;
pub(crate) mod report;
pub mod run;
pub(crate) mod seam;
pub mod store;
pub mod trace;
pub mod units;
pub mod verify;

pub use durable::journal;
pub use error::{Error, Result};
