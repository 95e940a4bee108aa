//! `info`: what a matrix file is (header, shape, tile grid, size) and, with `--check`, whether
//! every tile still matches its stored checksum — telling an output `run` has not finished
//! apart from a corrupt one. Also the wording, shared with `export`, of a checksum mismatch in
//! an output of `run` and of an unfinished output.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;

use crate::durable::journal;
use crate::error::{Error, Result};
use crate::store::TiledFile;
use crate::units::{count, fmt_bytes, fmt_bytes_exact};
use crate::{out, outln};

/// Print a matrix file's header, shape, tile grid and size; --check verifies every tile.
/// FILE is a .mgt, a .npy, or a raw descriptor raw:rows=R,cols=C,dtype=D[,order=F][,offset=N]:PATH.
#[derive(Args, Debug)]
#[command(
    after_help = "Example:\n  mgmm-stream info data/C.mgt --check\n  mgmm-stream info raw:rows=4096,cols=3000,dtype=f32:x.bin"
)]
pub(crate) struct InfoArgs {
    /// A .mgt file, a .npy array, or a raw file as `raw:rows=R,cols=C,dtype=D[,order=F][,offset=N]:PATH`.
    file: PathBuf,
    /// Verify every storage tile against the stored CRC-32C table (a .npy: its sidecar).
    /// Exit status: 0 every tile matches, 1 a tile does not (or another error), 3 nothing to
    /// check (no checksums).
    #[arg(long)]
    check: bool,
}

impl InfoArgs {
    pub(super) fn execute(self) -> Result<()> {
        info(&self.file, self.check)
    }
}

fn info(file: &Path, check: bool) -> Result<()> {
    use crate::store::source::Checked;
    // An output `run` has not finished is told apart from a corrupt one, in every format, and
    // named as such with or without `--check` (a damaged journal only matters to the check).
    let open = if check {
        unfinished(file)?
    } else {
        unfinished(file).ok().flatten()
    };
    // .npy and raw inputs describe themselves.
    if let Some((text, checked)) = crate::store::source::inspect(file, check && open.is_none())? {
        out!("{text}");
        if let Some(u) = &open {
            say_unfinished(u);
        }
        if let Some(u) = open.filter(|_| check) {
            outln!("check:       unfinished, resumable ({})", u.progress);
            return Err(unfinished_error(file, &u));
        }
        return match checked {
            None => Ok(()),
            Some(Checked::Ok(line)) => {
                out!("{line}");
                Ok(())
            }
            Some(Checked::NotPossible(e)) => {
                outln!("check:       not possible");
                Err(nothing_to_check(e))
            }
            Some(Checked::Corrupt(bad)) => Err(corrupt(file, bad)),
        };
    }
    let f = TiledFile::open(file)?;
    let h = f.hdr;
    outln!("file:        {}", file.display());
    outln!("format:      MGMTILE1 v1, dtype {}", h.dtype);
    outln!("shape:       {} × {}", h.rows, h.cols);
    outln!(
        "tiles:       {} × {} elements, grid {} × {} = {}, stride {} bytes",
        h.tile_rows,
        h.tile_cols,
        h.grid_rows(),
        h.grid_cols(),
        count(h.tiles(), "tile", "tiles"),
        h.tile_stride
    );
    // The values, as a .npy's data line gives them; the tiles' padding (edge tiles' unused
    // rows and columns, each tile rounded up to whole 4 KiB pages) only on the side: a new
    // user read the padded figure as the matrix's size.
    let values = h.rows * h.cols * h.dtype.size() as u64;
    let stored = h.data_end() - h.data_offset;
    outln!(
        "data:        offset {}, {} of values{}",
        h.data_offset,
        fmt_bytes_exact(values),
        match stored > values {
            true => format!(
                "\n             {} with the tiles' padding",
                fmt_bytes(stored)
            ),
            false => String::new(),
        }
    );
    outln!(
        "checksums:   {}",
        if h.has_checksums() {
            format!("CRC-32C per tile at offset {}", h.checksum_table_offset)
        } else {
            "none".into()
        }
    );
    outln!("size:        {}", fmt_bytes_exact(h.file_len()));
    if let Some(u) = &open {
        say_unfinished(u);
    }
    if !check {
        return Ok(());
    }
    if let Some(u) = open {
        outln!("check:       unfinished, resumable ({})", u.progress);
        return Err(unfinished_error(file, &u));
    }
    if !h.has_checksums() {
        outln!("check:       not possible");
        return Err(nothing_to_check(Error::format(
            file,
            format!(
                "has no checksum table (a file written without one); nothing to check. To add one, rewrite it: mgmm-stream export {f} tmp.npy && mgmm-stream import tmp.npy {f} --tile {t} --force",
                f = file.display(),
                t = h.tile_rows.max(h.tile_cols)
            ),
        )));
    }
    let t = Instant::now();
    use rayon::prelude::*;
    let gc = h.grid_cols();
    let bad: Vec<Error> = (0..h.tiles())
        .into_par_iter()
        .filter_map(|i| f.verify_tile(i / gc, i % gc).err())
        .collect();
    if !bad.is_empty() {
        return Err(corrupt(file, bad));
    }
    out!(
        "{}",
        crate::store::source::check_ok_line(h.tiles(), t.elapsed())
    );
    Ok(())
}

/// `info --check` on a file it cannot check (no checksums, a sidecar that does not fit): not a
/// failure of the file, not a pass either — exit status 3, as `verify`'s "nothing checked", so
/// that a script tells it from a corrupt file (1); it exited 1 for both (new-user trial).
fn nothing_to_check(e: Error) -> Error {
    Error::Unverified(e.to_string())
}

/// `info --check`'s verdict on a file with tiles that do not match their checksums: every such
/// tile on the `check:` line, and the first one's error — for a finished output of `run` (its
/// journal beside it) with the advice that fits one: `verify --repair`, not regenerating it.
fn corrupt(file: &Path, bad: Vec<Error>) -> Error {
    let tiles: Vec<String> = bad
        .iter()
        .filter_map(|e| match e {
            Error::Checksum { ti, tj, .. } => Some(format!("({ti}, {tj})")),
            _ => None,
        })
        .collect();
    outln!(
        "check:       corrupt: {} tile(s) do not match their checksums: {}",
        tiles.len(),
        tiles.join(" ")
    );
    let first = bad.into_iter().next().expect("at least one bad tile");
    let output = !file.to_string_lossy().starts_with("raw:")
        && journal::peek(file).is_ok_and(|j| j.is_some());
    if output {
        run_output_checksum(
            first,
            &format!(" (of {} bad)", tiles.len()),
            " — keep its checksums",
        )
    } else {
        first
    }
}

/// A checksum mismatch in an output that `run` wrote (its journal is beside it) is recomputed
/// by `verify --repair`, not regenerated: the error says so instead of the generic advice.
/// `of`: how many tiles are bad, if known; `then`: what to do afterwards.
pub(super) fn run_output_checksum(e: Error, of: &str, then: &str) -> Error {
    match e {
        Error::Checksum {
            path,
            ti,
            tj,
            stored,
            computed,
            ..
        } => Error::Usage(format!(
            "{}: checksum mismatch in tile ({ti}, {tj}){of}: stored {stored:#010x}, computed {computed:#010x}; it is an output of `run` (its journal is beside it): `mgmm-stream verify PLAN --repair` (the plan that writes it) recomputes the bad tiles{then}",
            path.display()
        )),
        e => e,
    }
}

/// The `state:` lines of an output a run has not finished: how far it is and what finishes it.
fn say_unfinished(u: &Unfinished) {
    outln!("state:       UNFINISHED ({})", u.progress);
    outln!("             finish it: {}", u.finish);
    outln!("             read it as it is: mgmm-stream export FILE OUT.npy --allow-partial");
}

fn unfinished_error(file: &Path, u: &Unfinished) -> Error {
    Error::Usage(format!(
        "{}: unfinished, resumable ({}), not corrupt: finish it with {}",
        file.display(),
        u.progress,
        u.finish
    ))
}

/// An output a run (or a split run's shards) has not finished.
pub(super) struct Unfinished {
    /// How far it is: "N of M tiles done, L left".
    pub(super) progress: String,
    /// The command that finishes it, as a user types it.
    pub(super) finish: &'static str,
}

/// What finishes an output a plain `run` writes.
const FINISH_RUN: &str = "`mgmm-stream run PLAN` (the plan that writes it)";
/// What finishes a split run's output: its shards, not a plain `run` (which refuses it).
const FINISH_SHARDS: &str = "`mgmm-stream run PLAN --shard K/S` for the shards left (`--shards S` runs them all here; `mgmm-stream status PLAN` names them)";

/// "N of M output tiles done" and what finishes it, when `file` is an output whose journal says
/// `run` has not finished it (or a split run's shards are writing it); `None` for a finished
/// output or a file no run is writing.
pub(super) fn unfinished(file: &Path) -> Result<Option<Unfinished>> {
    // A `raw:…` descriptor is never an output of `run`.
    if file.to_string_lossy().starts_with("raw:") {
        return Ok(None);
    }
    let Some(j) = journal::peek(file)? else {
        return Ok(crate::cluster::split_state(file).map(|state| Unfinished {
            progress: format!(
                "a split run's shards are writing it, state in {}",
                state.display()
            ),
            finish: FINISH_SHARDS,
        }));
    };
    if j.complete {
        return Ok(None);
    }
    // Any output format (.mgt, .npy): the shape is all that is needed.
    let (rows, cols) = crate::store::source::open_as_written(file)?.shape();
    let progress = j.progress(rows, cols);
    Ok(Some(Unfinished {
        progress,
        finish: FINISH_RUN,
    }))
}
