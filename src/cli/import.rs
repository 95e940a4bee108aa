//! `import`: convert a .npy array or a raw descriptor into a tiled file, streaming; the file
//! appears whole or not at all, as `gen`'s and `export`'s do (`store::atomic`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;

use super::{check_tile, interrupted, padding_note, refuse_existing, refuse_same};
use crate::error::Result;
use crate::store::npy;
use crate::units::fmt_bytes;
use crate::{interrupt, outln};

/// Convert a .npy array (C or Fortran order, f16/f32/f64) or a raw descriptor
/// (raw:rows=R,cols=C,dtype=D[,order=F][,offset=N]:PATH) into a tiled file (streaming).
#[derive(Args, Debug)]
#[command(after_help = "Example:\n  mgmm-stream import A.npy data/A.mgt --tile 1024")]
pub(crate) struct ImportArgs {
    /// The matrix to convert: a .npy array, or `raw:rows=R,cols=C,dtype=D[,order=F][,offset=N]:PATH` for a raw file (docs/FORMAT.md).
    input: PathBuf,
    /// The .mgt file to write (must not exist unless --force).
    output: PathBuf,
    /// Edge of the .mgt's square storage tiles, in elements.
    #[arg(long, default_value_t = 1024)]
    tile: u64,
    #[arg(long)]
    /// Replace OUTPUT if it exists.
    force: bool,
}

impl ImportArgs {
    pub(super) fn execute(self) -> Result<()> {
        import(&self.input, &self.output, self.tile, self.force)
    }
}

fn import(input: &Path, output: &Path, tile: u64, force: bool) -> Result<()> {
    refuse_same(input, output)?;
    refuse_existing(output, force)?;
    check_tile(tile)?;
    interrupt::install();
    let t = Instant::now();
    let h = npy::import(input, output, (tile, tile))
        .map_err(|e| interrupted(e, &format!("{} was not written", output.display())))?;
    let said = format!(
        "imported {} → {} ({}×{} {}, {}) in {:.2} s{}",
        input.display(),
        output.display(),
        h.rows,
        h.cols,
        h.dtype,
        fmt_bytes(h.file_len()),
        t.elapsed().as_secs_f64(),
        padding_note(&h, output)
            .map(|n| format!("\n  note: {n}"))
            .unwrap_or_default()
    );
    outln!("{}", crate::progress::wrap(&said));
    Ok(())
}
