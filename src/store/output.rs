//! Where output tiles go: the output format an output path asks for ([`OutputFormat`]), its
//! size on disk, and the [`MatrixSink`] that creates or reopens it (`.mgt`: [`TiledWriter`],
//! `.npy`: [`NpyWriter`]).
//!
//! The output side of the dispatch at the top of `store` (the input side is [`super::source`]):
//! it imports the formats, and none of them imports it.

use std::path::Path;

use super::atomic::TempOutput;
use super::fsutil;
use super::header::Header;
use super::npy_header;
use super::npy_sink::{self, NpyWriter};
use super::seam::{MatrixSink, WriteMode};
use super::tiled::TiledWriter;
use crate::error::{Error, Result};

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

/// Why the output `path` (the matrix `hdr` describes), which its journal calls complete, cannot
/// be trusted as it lies: its header block is not the one `run` writes (a field or a reserved
/// byte damaged, or a `.npy` header still marked unfinished after a crash), or a `.npy`'s
/// checksum sidecar is missing or damaged. A damaged header is written again from `hdr` — the
/// journal's fingerprint matched the plan, so `hdr` is the header that was written — provided
/// the file has the length that header needs (else reopening it says it is truncated). A header
/// that is whole but describes another matrix (the file replaced since) is an error: it is not
/// this run's to overwrite. `None`: nothing is wrong. The caller then resumes the step from the
/// journal: every recorded tile is checked against its CRC, and the checksum table or sidecar
/// is written again when it finishes. A read of one header block (and a sidecar), the file
/// opened read-only — a finished output the user made read-only is still skipped — and for
/// writing (through [`fsutil::open_in_place`]) only when there is something to mend.
pub(crate) fn mend_finished(path: &Path, hdr: &Header) -> Result<Option<String>> {
    use std::os::unix::fs::FileExt;
    let format = OutputFormat::of(path);
    let want = match format {
        OutputFormat::Mgt => hdr.to_block(),
        OutputFormat::Npy => npy_sink::header(hdr.dtype, hdr.rows, hdr.cols)?,
    };
    // A `.npy` saved again by another program (its data moved): not what `run` wrote, whatever
    // its length; said as such (`prepare` then computes it again, a resume refuses it).
    if format == OutputFormat::Npy {
        if let Some(why) = npy_sink::not_as_written_at(path, (hdr.dtype, hdr.rows, hdr.cols)) {
            return Ok(Some(why));
        }
    }
    let file = std::fs::File::open(path).map_err(|e| {
        Error::io(
            path,
            "cannot open the finished output to check its header",
            e,
        )
    })?;
    let mut have = vec![0u8; want.len()];
    let n = super::blockio::read_prefix(&file, &mut have)
        .map_err(|e| Error::io(path, "cannot read header", e))?;
    let mut why = Vec::new();
    if n < want.len() || have != want {
        let len = file.metadata().map_or(0, |m| m.len());
        let need = output_main_len(path, hdr);
        if len != need {
            return Ok(Some(format!(
                "it is {len} bytes, not the {need} its header needs"
            )));
        }
        why.push(match header_as_found(path, format, &have[..n], len, hdr)? {
            Found::Damaged(e) => format!("its header is damaged ({e})"),
            Found::Unfinished => "its header still marks it unfinished (a crash before the finished header reached the disk)".into(),
            Found::Reserved => {
                "its header block is not the one `run` writes (a reserved byte changed)".into()
            }
        });
        let file = fsutil::open_in_place(path, fsutil::InPlace::Existing)?;
        file.write_all_at(&want, 0)
            .and_then(|_| file.sync_data())
            .map_err(|e| Error::io(path, "cannot write the header again", e))?;
    }
    if format == OutputFormat::Npy {
        let src = super::source::open_as_written(path)?;
        if src.checksum_tile().is_none() {
            why.push(match src.checksum_note() {
                Some(note) => format!("its checksum {note}"),
                None => format!(
                    "its checksum sidecar {} is missing",
                    super::sidecar::sidecar_path(path).display()
                ),
            });
        }
    }
    Ok((!why.is_empty()).then(|| why.join("; ")))
}

/// What a finished output's header block, not the one `run` writes, holds.
enum Found {
    /// It does not parse (or its own checksum fails): the error says where.
    Damaged(Error),
    /// A `.npy` header of this matrix still marked unfinished.
    Unfinished,
    /// The fields of this matrix, with other bytes (a `.mgt`'s reserved bytes, a `.npy`'s
    /// padding) changed.
    Reserved,
}

/// Read `have` (the first block of `path`, `len` bytes long) as the header it is; a whole header
/// of another matrix than `hdr` is an error (the file was replaced, not damaged).
fn header_as_found(
    path: &Path,
    format: OutputFormat,
    have: &[u8],
    len: u64,
    hdr: &Header,
) -> Result<Found> {
    let other = |what: String| {
        replaced(
            path,
            format!("its header describes another matrix ({what}) than the plan writes"),
        )
    };
    Ok(match format {
        OutputFormat::Mgt => match Header::parse(path, have, len) {
            Err(e) => Found::Damaged(e),
            Ok(h)
                if (h.dtype, h.rows, h.cols, h.tile_rows, h.tile_cols)
                    != (hdr.dtype, hdr.rows, hdr.cols, hdr.tile_rows, hdr.tile_cols) =>
            {
                return Err(other(format!(
                    "{}×{} {} in {}×{} tiles",
                    h.rows, h.cols, h.dtype, h.tile_rows, h.tile_cols
                )))
            }
            Ok(_) => Found::Reserved,
        },
        OutputFormat::Npy => match npy_header::read_header(path, &mut &have[..]) {
            Err(e) => Found::Damaged(e),
            Ok(h) => match npy_sink::not_as_written(&h, (hdr.dtype, hdr.rows, hdr.cols)) {
                Some(why) => return Err(replaced(path, why)),
                None if h.unfinished => Found::Unfinished,
                None => Found::Reserved,
            },
        },
    })
}

/// The error for a finished output that is not the file `run` wrote (`why`): replaced, or
/// saved again by another program, since the run finished it.
fn replaced(path: &Path, why: String) -> Error {
    Error::Usage(format!(
        "{}: {why}, so the file was replaced or rewritten since the run finished it; restore it, or rerun with --restart to compute it again",
        path.display()
    ))
}
