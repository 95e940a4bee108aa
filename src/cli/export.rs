//! `export`: convert a tiled file, .npy or raw descriptor into a .npy array, streaming; an
//! output `run` has not finished is refused unless `--allow-partial`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;

use super::info::{run_output_checksum, unfinished};
use super::{interrupted, refuse_existing, refuse_same};
use crate::durable::journal;
use crate::error::{Error, Result};
use crate::store::npy;
use crate::{interrupt, outln};

/// Convert a tiled file, .npy or raw descriptor into a .npy array (streaming; 16-bit data
/// becomes f32; a column-major input gives a Fortran-order array).
#[derive(Args, Debug)]
#[command(
    after_help = "Example:\n  mgmm-stream export data/C.mgt C.npy\n  python3 -c 'import numpy as np; print(np.load(\"C.npy\", mmap_mode=\"r\")[:2, :4])'"
)]
pub(crate) struct ExportArgs {
    /// The matrix to convert: a .mgt (an unfinished one with --allow-partial), or any input `import` takes.
    input: PathBuf,
    /// The .npy file to write (must not exist unless --force).
    output: PathBuf,
    #[arg(long)]
    /// Replace OUTPUT if it exists.
    force: bool,
    /// Export an output that `run` has not finished (unfinished tiles read as zeros).
    #[arg(long)]
    allow_partial: bool,
}

impl ExportArgs {
    pub(super) fn execute(self) -> Result<()> {
        export(&self.input, &self.output, self.force, self.allow_partial)
    }
}

fn export(input: &Path, output: &Path, force: bool, allow_partial: bool) -> Result<()> {
    refuse_same(input, output)?;
    refuse_existing(output, force)?;
    // It writes a .npy array whatever the name: `export C.npy C.mgt` wrote a .npy called
    // C.mgt, which `info` then read as a .npy (new-user trial).
    if output
        .extension()
        .is_none_or(|e| !e.eq_ignore_ascii_case("npy"))
    {
        return Err(crate::error::Error::Usage(format!(
            "{}: export writes a .npy array; name the output *.npy (`mgmm-stream import IN OUT.mgt` writes a tiled file)",
            output.display()
        )));
    }
    // An output `run` is still writing (.mgt or .npy) has a journal, or a split run's state,
    // beside it; a raw descriptor is read as it is.
    // With --allow-partial a journal that cannot be read only loses the note.
    let open = match allow_partial {
        true => unfinished(input).ok().flatten(),
        false => unfinished(input)?,
    };
    if let (false, Some(u)) = (allow_partial, &open) {
        return Err(Error::Usage(format!(
            "{} is unfinished ({}): finish it with {}, or pass --allow-partial to export it as it is",
            input.display(),
            u.progress,
            u.finish
        )));
    }
    interrupt::install();
    let t = Instant::now();
    npy::export(input, output, !allow_partial).map_err(|e| match e {
        e @ Error::Checksum { .. } if journal::peek(input).is_ok_and(|j| j.is_some()) => {
            run_output_checksum(e, "", ", then export again")
        }
        e => interrupted(e, &format!("{} was not written", output.display())),
    })?;
    // What --allow-partial exported: it said nothing of the tiles that read as zeros (a new
    // user's trial).
    let partial = match &open {
        Some(u) => format!(
            "\n  note: {} is unfinished ({}): the tiles not done are zeros in {}",
            input.display(),
            u.progress,
            output.display()
        ),
        None => String::new(),
    };
    let said = format!(
        "exported {} → {} in {:.2} s{partial}",
        input.display(),
        output.display(),
        t.elapsed().as_secs_f64()
    );
    outln!("{}", crate::progress::wrap(&said));
    Ok(())
}
