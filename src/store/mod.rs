//! Matrix storage: everything that touches matrix bytes on disk.
//!
//! The pipeline sees storage only through [`MatrixSource`] and [`MatrixSink`] ([`source`]); the
//! `.mgt` tiled file ([`header`], [`tiled`]) implements them, with block I/O cut into contiguous
//! file runs by one iterator ([`runs`]). Around that: synthetic data generation ([`gen`]),
//! `.npy` import and export ([`npy`]), filesystem checks and reservations ([`fsutil`]), and files
//! that appear whole or not at all ([`atomic`]). Data where users keep it: `.npy` arrays
//! ([`npy_source`]) and raw binary files ([`raw`]) are read in place as row-major sources
//! ([`rowmajor`]), and `.npy` outputs are written directly with a per-tile CRC sidecar
//! ([`npy_sink`]).

pub mod atomic;
pub mod fsutil;
pub mod gen;
pub mod header;
pub mod npy;
pub mod npy_sink;
pub mod npy_source;
pub mod raw;
pub mod rowmajor;
pub(crate) mod runs;
pub mod source;
pub mod tiled;

pub use header::Header;
pub use source::{
    create_output, open_source, open_spec, output_file_len, reopen_output, Block, MatrixSink,
    MatrixSource, OutputFormat, SourceSpec, WriteMode,
};
pub use tiled::{TiledFile, TiledWriter};
