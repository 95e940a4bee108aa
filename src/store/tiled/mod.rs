//! Reading and writing `.mgt` tiled matrix files: the first [`MatrixSource`] and [`MatrixSink`].
//!
//! [`TiledFile`] reads arbitrary row/column blocks of an input with parallel `pread`s of the
//! block's contiguous runs ([`super::runs`]), checking storage-tile checksums on the pieces it
//! reads ([`TiledFile::read_staged`]) or with `pread`s of their own; it keeps a read-only map
//! for readahead advice and the checksum table. [`TiledWriter`] creates an output at its full
//! length and writes blocks either by copying into a writable map whose pages a prefault stage
//! populated, or by `pwrite` ([`WriteMode`]); `finish` fills in the checksum table and makes
//! the data durable.
//!
//! Measured choices (docs/GPU.md): input blocks are read with `pread` (21.5 GB/s into pinned
//! memory on the H200 host, against 19.4 for registering the map with CUDA, and 2.12 s against
//! 2.85 s end to end for copying through the map); output blocks go through the prefaulted map by
//! default (1.92 s against 2.31 s for `pwrite`).
//!
//! Memory-map safety: a map of a file that another process truncates raises SIGBUS, and one that
//! another process writes is undefined behaviour. The engine never writes its inputs (outputs
//! are always different files, which `plan` checks) and the docs tell users not to modify input
//! files while a job runs; that is the guarantee every `unsafe` map below relies on.
//!
//! The format is read by [`TiledFile`] ([`reader`]) and written by [`TiledWriter`] ([`writer`]);
//! the run I/O both share with the other formats is in [`super::blockio`]. Their round trips
//! are tested together (`tests.rs`).
//!
//! [`MatrixSource`]: super::MatrixSource
//! [`MatrixSink`]: super::MatrixSink
//! [`WriteMode`]: super::WriteMode

mod reader;
#[cfg(test)]
mod tests;
mod writer;

/// Where callers have long found it; it lives with the run I/O ([`super::blockio`]).
pub(crate) use super::blockio::par_crc32c;
pub use reader::TiledFile;
pub(crate) use writer::TiledWriter;
