//! Where output tiles go: the output format an output path asks for ([`OutputFormat`]), its
//! size on disk, and the [`MatrixSink`] that creates or reopens it (`.mgt`: [`TiledWriter`],
//! `.npy`: [`NpyWriter`]).
//!
//! The output side of the dispatch at the top of `store` (the input side is [`super::source`]):
//! it imports the formats, and none of them imports it.

use std::path::Path;

use super::atomic::TempOutput;
use super::header::Header;
use super::npy_sink::{self, NpyWriter};
use super::seam::{MatrixSink, WriteMode};
use super::tiled::TiledWriter;
use crate::error::Result;

/// What an output file holds: chosen by the output path's extension (`.npy`, else `.mgt`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OutputFormat {
    Mgt,
    Npy,
}

impl OutputFormat {
    pub(crate) fn of(path: &Path) -> OutputFormat {
        match path.extension().and_then(|e| e.to_str()) {
            Some(e) if e.eq_ignore_ascii_case("npy") => OutputFormat::Npy,
            _ => OutputFormat::Mgt,
        }
    }
}

/// Bytes the output `path` with (`.mgt`-style) header `hdr` takes on disk, sidecar included.
pub(crate) fn output_file_len(path: &Path, hdr: &Header) -> u64 {
    match OutputFormat::of(path) {
        OutputFormat::Mgt => hdr.file_len(),
        OutputFormat::Npy => npy_sink::file_len(hdr),
    }
}

/// The length the output file `path` itself has once complete: [`output_file_len`] less a
/// `.npy`'s checksum sidecar, which is another file.
pub(crate) fn output_main_len(path: &Path, hdr: &Header) -> u64 {
    match OutputFormat::of(path) {
        OutputFormat::Mgt => hdr.file_len(),
        OutputFormat::Npy => npy_sink::npy_len(hdr),
    }
}

/// Create the output `path` for the matrix `hdr` describes (its shape, dtype and storage tile;
/// a `.npy` output keeps the tile for its checksum sidecar).
pub(crate) fn create_output(
    path: &Path,
    hdr: Header,
    mode: WriteMode,
) -> Result<Box<dyn MatrixSink>> {
    create_output_as(OutputFormat::of(path), path, hdr, mode)
}

/// [`create_output`] in the format `format` whatever `path` is called: a split step's output is
/// prepared under a temporary name, then linked to the name that says its format.
pub(crate) fn create_output_as(
    format: OutputFormat,
    path: &Path,
    hdr: Header,
    mode: WriteMode,
) -> Result<Box<dyn MatrixSink>> {
    Ok(match format {
        OutputFormat::Mgt => Box::new(TiledWriter::create_with(path, hdr, mode)?),
        OutputFormat::Npy => Box::new(NpyWriter::create(path, &hdr, mode)?),
    })
}

/// [`create_output_as`] in the temporary `tmp`, renamed into place by the caller once whole.
pub(crate) fn create_output_in(
    format: OutputFormat,
    tmp: &TempOutput,
    hdr: Header,
    mode: WriteMode,
) -> Result<Box<dyn MatrixSink>> {
    Ok(match format {
        OutputFormat::Mgt => Box::new(TiledWriter::create_temp(tmp, hdr, mode)?),
        OutputFormat::Npy => Box::new(NpyWriter::create_temp(tmp, &hdr, mode)?),
    })
}

/// Reopen the partly written output `path` to resume it; it must match `hdr`.
pub(crate) fn reopen_output(
    path: &Path,
    hdr: Header,
    mode: WriteMode,
) -> Result<Box<dyn MatrixSink>> {
    Ok(match OutputFormat::of(path) {
        OutputFormat::Mgt => Box::new(TiledWriter::reopen_with(path, hdr, mode)?),
        OutputFormat::Npy => Box::new(NpyWriter::reopen(path, &hdr, mode)?),
    })
}
