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

pub(crate) mod atomic;
pub(crate) mod fsutil;
pub mod gen;
pub(crate) mod header;
pub(crate) mod memory;
pub mod npy;
pub(crate) mod npy_sink;
pub(crate) mod npy_source;
pub(crate) mod raw;
pub(crate) mod rowmajor;
pub(crate) mod runs;
pub(crate) mod source;
pub(crate) mod tiled;

pub use header::Header;
pub(crate) use source::{
    create_output, output_file_len, output_main_len, reopen_output, OutputFormat,
};
pub use source::{
    open_region, open_source, Block, MappedBlock, MatrixSink, MatrixSource, WriteMode,
};
pub(crate) use tiled::TiledWriter;
pub use tiled::{par_crc32c, TiledFile};
