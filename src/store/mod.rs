//! Matrix storage: everything that touches matrix bytes on disk.
//!
//! The pipeline sees storage only through [`MatrixSource`] and [`MatrixSink`] ([`source`]); the
//! `.mgt` tiled file ([`header`], [`tiled`]) implements them, with block I/O cut into contiguous
//! file runs by one iterator ([`runs`]). Around that: synthetic data generation ([`gen`]),
//! `.npy` import and export ([`npy`]), filesystem checks and reservations ([`fsutil`]), and files that appear whole or not at
//! all ([`atomic`]).

pub mod atomic;
pub mod fsutil;
pub mod gen;
pub mod header;
pub mod npy;
pub(crate) mod runs;
pub mod source;
pub mod tiled;

pub use header::Header;
pub use source::{open_source, Block, MatrixSink, MatrixSource, WriteMode};
pub use tiled::{TiledFile, TiledWriter};
