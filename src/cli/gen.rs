//! `gen`: write a matrix file of deterministic synthetic data (the inputs of tests, benchmarks
//! and the examples), streaming, with a progress line.

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use clap::Args;

use super::{check_tile, interrupted, padding_note, refuse_existing};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::progress::Progress;
use crate::run;
use crate::store::gen::{self, Dist, GenSpec};
use crate::store::Header;
use crate::units::fmt_bytes;
use crate::{interrupt, outln};

/// Generate a matrix file with deterministic synthetic data.
#[derive(Args, Debug)]
#[command(
    after_help = "Example:\n  mgmm-stream gen data/A.mgt --rows 4096 --cols 3000 --dist normal --seed 1"
)]
pub(crate) struct GenArgs {
    /// The file to write: a .mgt, or a .npy array when the name ends in .npy (must not exist unless --force).
    out: PathBuf,
    /// Rows of the matrix.
    #[arg(long)]
    rows: u64,
    /// Columns of the matrix.
    #[arg(long)]
    cols: u64,
    /// Element type: f32, f64, f16, bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Storage tile edge (square tiles).
    #[arg(long, default_value_t = 1024)]
    tile: u64,
    /// normal, uniform (in [-1, 1)), identity, arange (value = row·cols + col).
    #[arg(long, default_value = "normal")]
    dist: String,
    /// Seed of the random values (the same seed, the same matrix).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Worker threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Replace OUT if it exists.
    #[arg(long)]
    force: bool,
}

impl GenArgs {
    pub(super) fn execute(self) -> Result<()> {
        let out = self.out.as_path();
        refuse_existing(out, self.force)?;
        let dtype = DType::parse(&self.dtype).ok_or_else(|| {
            Error::Usage(format!("--dtype {}: use f32, f64, f16 or bf16", self.dtype))
        })?;
        let dist = Dist::parse(&self.dist).ok_or_else(|| {
            Error::Usage(format!("--dist {}: use one of {}", self.dist, Dist::NAMES))
        })?;
        check_tile(self.tile)?;
        if self.threads > crate::backend::MAX_THREADS {
            return Err(Error::Usage(format!(
                "--threads {}: at most {}; leave it out (or 0) to use every core",
                self.threads,
                crate::backend::MAX_THREADS
            )));
        }
        let (rows, cols) = (self.rows, self.cols);
        if rows == 0 || cols == 0 {
            return Err(Error::Usage(format!(
                "{}: --rows and --cols must be at least 1",
                out.display()
            )));
        }
        if gen::absurdly_large(rows, cols) {
            return Err(Error::Usage(format!(
                "{}: --rows {rows} --cols {cols} is absurdly large (past 1 PiB as f64); check the shape",
                out.display()
            )));
        }
        run::init_threads(self.threads);
        interrupt::install();
        let t = Instant::now();
        let spec = GenSpec {
            rows,
            cols,
            dtype,
            tile: (self.tile.min(rows), self.tile.min(cols)),
            dist,
            seed: self.seed,
        };
        let h = Header::new(dtype, rows, cols, spec.tile.0, spec.tile.1, true);
        let done = AtomicU64::new(0);
        let progress = Progress::new(false, run::default_log_every());
        let label = format!("generating {}", out.display());
        let bytes = progress
            .job(&label, h.data_end() - h.data_offset, &done, || {
                gen::generate_counted(out, &spec, &done, Some(interrupt::flag()))
            })
            .map_err(|e| interrupted(e, &format!("{} was not written", out.display())))?;
        let s = t.elapsed().as_secs_f64();
        outln!(
            "wrote {} ({rows}×{cols} {dtype}): {} in {s:.2} s ({:.0} MB/s)",
            out.display(),
            fmt_bytes(bytes),
            bytes as f64 / s / 1e6
        );
        let mgt = out.extension().is_none_or(|e| e != "npy");
        if let Some(n) = padding_note(&h, out).filter(|_| mgt) {
            progress.note(&format!("note: {n}"));
        }
        Ok(())
    }
}
