//! Matrix storage: everything that touches matrix bytes on disk.
//!
//! The pipeline sees storage only through [`MatrixSource`] and [`MatrixSink`] ([`seam`]); the
//! `.mgt` tiled file ([`header`], [`tiled`]) implements them, with block I/O cut into contiguous
//! file runs by one iterator ([`runs`]). Around that: synthetic data generation ([`gen`]),
//! `.npy` import and export ([`npy`]), filesystem checks and reservations ([`fsutil`]), and files
//! that appear whole or not at all ([`atomic`]). Data where users keep it: `.npy` arrays
//! ([`npy_source`]) and raw binary files ([`raw`]) are read in place as row-major sources
//! ([`rowmajor`]), and `.npy` outputs are written directly with a per-tile CRC sidecar
//! ([`npy_sink`], [`sidecar`]).
//!
//! The files stand in layers, each importing only those below it:
//! - bottom: a [`Block`] ([`block`]), the runs and tile geometry of a file ([`runs`]), the
//!   `.mgt` header ([`header`]), the traits of the [`seam`], filesystem questions ([`fsutil`],
//!   then [`atomic`]);
//! - shared by the formats: run I/O, conversion and CRCs ([`blockio`]), the `.npy` header
//!   ([`npy_header`]) and checksum sidecar ([`sidecar`]);
//! - the formats: `.mgt` ([`tiled`]), row-major files ([`rowmajor`], opened as [`npy_source`]
//!   or [`raw`]), `.npy` outputs ([`npy_sink`]), matrices in memory ([`memory`]);
//! - top: opening an input by its path or declaration ([`source`]), creating or reopening an
//!   output ([`output`]), and the commands that move whole files (`gen`, `import`, `export`:
//!   [`gen`], [`npy`]).

pub(crate) mod atomic;
pub(crate) mod block;
pub(crate) mod blockio;
pub(crate) mod fsutil;
pub mod gen;
pub(crate) mod header;
pub(crate) mod memory;
pub mod npy;
pub(crate) mod npy_header;
pub(crate) mod npy_sink;
pub(crate) mod npy_source;
pub(crate) mod output;
pub(crate) mod raw;
pub(crate) mod rowmajor;
pub(crate) mod runs;
pub(crate) mod seam;
pub(crate) mod sidecar;
pub(crate) mod source;
pub(crate) mod tiled;

pub use crate::seam::OutRect;
pub use block::Block;
pub use blockio::par_crc32c;
pub use header::Header;
pub(crate) use output::{
    create_output, create_output_in, mend_finished, output_file_len, output_main_len,
    reopen_output, OutputFormat,
};
pub(crate) use seam::block_crc;
pub use seam::{DeviceBlock, MappedBlock, MatrixSink, MatrixSource, WriteMode};
pub(crate) use source::open_as_written;
pub use source::{open_region, open_source};
pub use tiled::TiledFile;
