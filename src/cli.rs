//! The command line: clap definitions and one function per command. `main.rs` only parses,
//! calls [`execute`] and turns an error into a message and an exit code.
//!
//! Results a script reads (the run summary, plan text, `info`, verify's PASS/FAIL lines,
//! `devices`, what `gen`/`import`/`export` wrote) go to stdout; diagnostics (progress, notes,
//! errors) to stderr. Both through [`crate::out`], so a closed pipe never kills a finished job.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};

use crate::dtype::DType;
use crate::durable::journal;
use crate::error::{Error, Result};
use crate::plan::Plan;
use crate::progress::{fmt_duration, Progress};
use crate::run::{self, RunOptions};
use crate::store::gen::{self, Dist, GenSpec};
use crate::store::{npy, Header, TiledFile};
use crate::units::fmt_bytes;
use crate::{diagln, interrupt, out, outln};

/// The parsed command line of the `mgmm-stream` binary (see [`execute`]).
#[derive(Parser, Debug)]
#[command(
    name = "mgmm-stream",
    version,
    about = "Multiply matrices too big for GPU memory or host RAM, streaming tiles from disk"
)]
pub struct Cli {
    #[command(subcommand)]
    pub(crate) cmd: Command,
}

#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// Generate a matrix file with deterministic synthetic data.
    #[command(
        after_help = "Example:\n  mgmm-stream gen data/A.mgt --rows 4096 --cols 3000 --dist normal --seed 1"
    )]
    Gen {
        /// Output .mgt file (must not exist unless --force).
        out: PathBuf,
        #[arg(long)]
        rows: u64,
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
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Worker threads (0 = all cores).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// Replace OUT if it exists.
        #[arg(long)]
        force: bool,
    },
    /// Print a matrix file's header, shape, tile grid and size; --check verifies every tile.
    /// FILE is a .mgt, a .npy, or a raw descriptor raw:rows=R,cols=C,dtype=D[,order=F][,offset=N]:PATH.
    #[command(
        after_help = "Example:\n  mgmm-stream info data/C.mgt --check\n  mgmm-stream info raw:rows=4096,cols=3000,dtype=f32:x.bin"
    )]
    Info {
        file: PathBuf,
        /// Verify every storage tile against the stored CRC-32C table.
        #[arg(long)]
        check: bool,
    },
    /// Convert a .npy array (C or Fortran order, f16/f32/f64) or a raw descriptor
    /// (raw:rows=R,cols=C,dtype=D[,order=F][,offset=N]:PATH) into a tiled file (streaming).
    #[command(after_help = "Example:\n  mgmm-stream import A.npy data/A.mgt --tile 1024")]
    Import {
        input: PathBuf,
        output: PathBuf,
        #[arg(long, default_value_t = 1024)]
        tile: u64,
        #[arg(long)]
        force: bool,
    },
    /// Convert a tiled file, .npy or raw descriptor into a .npy array (streaming; 16-bit data
    /// becomes f32; a column-major input gives a Fortran-order array).
    #[command(
        after_help = "Example:\n  mgmm-stream export data/C.mgt C.npy\n  python3 -c 'import numpy as np; print(np.load(\"C.npy\", mmap_mode=\"r\")[:2, :4])'"
    )]
    Export {
        input: PathBuf,
        output: PathBuf,
        #[arg(long)]
        force: bool,
        /// Export an output that `run` has not finished (unfinished tiles read as zeros).
        #[arg(long)]
        allow_partial: bool,
    },
    /// Resolve a plan and print what `run` would do: shapes, tiles, memory budgets, bytes moved,
    /// and the lower bound on time.
    #[command(after_help = "Example:\n  mgmm-stream plan examples/quickstart.toml")]
    Plan {
        plan: PathBuf,
        /// Override an [engine] key of the plan (repeatable), e.g. --set engine.host_memory=8GiB.
        #[arg(long = "set", value_name = "engine.KEY=VALUE")]
        set: Vec<String>,
        #[command(flatten)]
        cluster: crate::cluster::cmd::ModelArgs,
    },
    /// List the CUDA GPUs this build can use (or say why there are none).
    #[command(after_help = "Example:\n  mgmm-stream devices")]
    Devices,
    /// Run a plan: generate missing inputs, stream every step, write the outputs.
    #[command(
        after_help = "Example:\n  mgmm-stream run examples/quickstart.toml --report run.json"
    )]
    Run {
        plan: PathBuf,
        /// Override an [engine] key of the plan (repeatable), e.g. --set engine.host_memory=8GiB.
        #[arg(long = "set", value_name = "engine.KEY=VALUE")]
        set: Vec<String>,
        /// Print nothing but errors.
        #[arg(long, short)]
        quiet: bool,
        /// Write the summary figures as JSON to this file.
        #[arg(long)]
        report: Option<PathBuf>,
        /// Seconds between log lines when stderr is not a terminal.
        #[arg(long, default_value_t = 5.0)]
        log_every: f64,
        /// Ignore journals from earlier runs and recompute every step (outputs are overwritten).
        #[arg(long)]
        restart: bool,
        /// After the run, check every product with Freivalds' test (see `verify`).
        #[arg(long)]
        verify: bool,
        #[command(flatten)]
        split: crate::cluster::cmd::ShardArgs,
    },
    /// Create a split step's output once before a cluster job starts (docs/CLUSTER.md).
    #[command(
        after_help = "Example:\n  mgmm-stream prepare plan.toml && sbatch examples/cluster/sbatch.sh"
    )]
    Prepare {
        plan: PathBuf,
        #[arg(long = "set", value_name = "engine.KEY=VALUE")]
        set: Vec<String>,
        /// Throw away the outputs, journals and shard state of every step and start over.
        #[arg(long)]
        restart: bool,
    },
    /// Finish split steps: check every tile against its shard journal, write the checksum
    /// table, merge the journals; refuses while shards are missing and names them.
    #[command(after_help = "Example:\n  mgmm-stream finalize plan.toml --verify")]
    Finalize {
        plan: PathBuf,
        #[arg(long = "set", value_name = "engine.KEY=VALUE")]
        set: Vec<String>,
        /// Run Freivalds' test on each output after (see `verify`).
        #[arg(long)]
        verify: bool,
    },
    /// Show a split job's progress: done/left/rate/ETA per step and per shard, and who holds
    /// each shard.
    #[command(after_help = "Example:\n  watch -n 10 mgmm-stream status plan.toml")]
    Status {
        plan: PathBuf,
        #[arg(long = "set", value_name = "engine.KEY=VALUE")]
        set: Vec<String>,
        /// Heartbeat age (seconds) after which a claim is shown as stale.
        #[arg(long, default_value_t = 120.0)]
        claim_timeout: f64,
    },
    /// Check the outputs of a plan that has run: the journal's record of the inputs, then
    /// Freivalds' test, streaming, O(n²): C·x against α·op(A)·(op(B)·x) (+ β·C0·x) for random
    /// ±1 vectors x, in higher precision than the product, against the rounding a correct
    /// product would have. Prints PASS/FAIL per step on stdout, exits non-zero and names the
    /// failing output tiles.
    #[command(after_help = "Example:\n  mgmm-stream verify examples/quickstart.toml --rounds 3")]
    Verify {
        plan: PathBuf,
        /// Override an [engine] key of the plan (repeatable), e.g. --set engine.host_memory=8GiB.
        #[arg(long = "set", value_name = "engine.KEY=VALUE")]
        set: Vec<String>,
        /// Random vectors to test with.
        #[arg(long, default_value_t = 2)]
        rounds: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Recompute the failing output tiles (through the journal) and verify again.
        #[arg(long)]
        repair: bool,
    },
}

fn refuse_existing(p: &Path, force: bool) -> Result<()> {
    // A device node, FIFO or directory is never replaced by a file, --force or not
    // (`export … /dev/null --force` would otherwise swap the device node for a regular file).
    if let Ok(m) = std::fs::metadata(p) {
        if !m.is_file() {
            return Err(Error::Usage(format!(
                "{} exists and is not a regular file (a directory, device or FIFO); write to a file path",
                p.display()
            )));
        }
    }
    if p.exists() && !force {
        return Err(Error::Usage(format!(
            "{} already exists; choose another path or pass --force to replace it",
            p.display()
        )));
    }
    Ok(())
}

/// Refuse when `output` is `input` under another name: a hard link (same device and inode),
/// a symlink, or a path through `..`. Checked before anything is opened for writing.
fn refuse_same(input: &Path, output: &Path) -> Result<()> {
    // A `raw:…:PATH` descriptor names its file last.
    let spec = crate::store::source::SourceSpec::parse_arg(&input.to_string_lossy())?;
    if crate::plan::same_file(spec.path(), output) {
        return Err(Error::Usage(format!(
            "{} is the same file as the input {} (a link or another path to it); write to a new file",
            output.display(),
            input.display()
        )));
    }
    Ok(())
}

fn check_tile(tile: u64) -> Result<()> {
    if tile == 0 || tile > crate::store::header::MAX_TILE_EDGE {
        return Err(Error::Usage(format!(
            "--tile {tile}: must be between 1 and 65536"
        )));
    }
    Ok(())
}

/// The error for a job stopped by Ctrl-C, or `e` itself.
fn interrupted(e: Error, what: &str) -> Error {
    if interrupt::requested() && matches!(e, Error::Cancelled | Error::Usage(_)) {
        Error::Usage(format!("interrupted; {what}"))
    } else {
        e
    }
}

/// The steps after `step` that read its output and whose journals no longer match it (a repair
/// rewrote tiles they were computed from): they must be computed again. A step whose journal
/// still matches (the repaired tiles came out as they were when it ran) is left alone.
fn stale_after_repair<'p>(
    p: &'p Plan,
    step: &crate::plan::Step,
) -> Result<Vec<&'p crate::plan::Step>> {
    let mut backend = None;
    let mut stale = Vec::new();
    for later in p.steps.iter().skip(step.index + 1) {
        let ops = [Some(&later.a), Some(&later.b), later.c0.as_ref()];
        if !ops.into_iter().flatten().any(|o| o.path == step.output)
            || crate::durable::journal::peek(&later.output)?.is_none()
        {
            continue;
        }
        // Made only when a later step reads the output (a GPU backend takes a while to start).
        if backend.is_none() {
            backend = Some(crate::backend::select(&p.engine)?);
        }
        let b = backend.as_deref().expect("made above");
        let layout = run::layout_for(&p.path, later, &p.engine, b.caps(), false)?;
        let fp = run::fingerprint(later, &layout, b.caps().kind, p.engine.precision)?;
        if run::journal_state(later, &fp)?.is_some_and(|(_, same)| !same) {
            stale.push(later);
        }
    }
    Ok(stale)
}

/// Verify every step; results go to stdout (one PASS/FAIL line per step), the error that
/// makes the exit status non-zero to stderr. With `repair`, failing tiles are recomputed
/// through the journal and the step is verified again.
fn verify_plan(p: &Plan, rounds: usize, seed: u64, quiet: bool, repair: bool) -> Result<()> {
    let mut failed = Vec::new();
    for step in &p.steps {
        let mut rep = crate::verify::verify_step(step, p.engine.precision, rounds, seed)?;
        if !quiet || !rep.pass {
            outln!("{}", crate::verify::format(&rep));
        }
        if repair && !rep.pass && !rep.failing_tiles.is_empty() {
            let n = crate::verify::forget_failing(p, step, &rep)?;
            diagln!(
                "repair: recomputing {n} tile(s) of {} through `run`",
                step.output.display()
            );
            let progress = Progress::new(true, run::default_log_every());
            // This step and those before it first: a later step that reads this output was
            // computed from the tiles now redone, and is computed again below if their bytes
            // changed what its journal recorded of them.
            let mut upto = p.clone();
            upto.steps.truncate(step.index + 1);
            run::run_plan(&upto, &RunOptions::default(), &progress)?;
            for later in stale_after_repair(p, step)? {
                diagln!(
                    "repair: step {} ({}) reads {}, which the repair rewrote, and its journal no longer matches it (a .npy's modification time, or a changed tile's checksum): computing it again",
                    later.index + 1,
                    later.output.display(),
                    step.output.display()
                );
                crate::cluster::prepare::reset(&later.output)?;
            }
            if step.index + 1 < p.steps.len() {
                run::run_plan(p, &RunOptions::default(), &progress)?;
            }
            rep = crate::verify::verify_step(step, p.engine.precision, rounds, seed)?;
            outln!("after repair:\n{}", crate::verify::format(&rep));
        }
        if !rep.pass {
            // 0: an input does not match its checksums; 1: the journal (no tiles); 2: tiles
            // (an earlier step's output that does not match its checksums is repaired there).
            let of_plan = |i: &String| p.steps.iter().any(|s| s.output.display().to_string() == *i);
            let kind = match (&rep.corrupt_input, &rep.reason) {
                (Some(i), _) if of_plan(i) => 2,
                (Some(_), _) => 0,
                (None, Some(_)) => 1,
                (None, None) => 2,
            };
            failed.push((format!("step {} ({})", rep.step, rep.output), kind));
        }
    }
    if failed.is_empty() {
        return Ok(());
    }
    let names: Vec<&str> = failed.iter().map(|(n, _)| n.as_str()).collect();
    // A failure found in the journal (other inputs or plan, unfinished) names no tiles: only
    // rerunning the step (or resuming it) helps; residuals that fail name tiles to repair; an
    // input that no longer matches its checksums must be restored first.
    let advice = if failed.iter().any(|(_, kind)| *kind == 0) {
        "an input does not match its stored checksums (see above): restore it, then verify again"
    } else if failed.iter().all(|(_, kind)| *kind == 1) {
        "see the reason above: `run` resumes an unfinished step; `run --restart` recomputes one whose plan or inputs changed"
    } else {
        "the output does not match the inputs or its stored checksums; `verify --repair` recomputes the failing tiles, `run --restart` the whole step"
    };
    Err(Error::Usage(format!(
        "verification failed for {}: {advice}",
        names.join(", ")
    )))
}

/// Run one command.
pub fn execute(cli: Cli) -> Result<()> {
    crate::report::mark_process_start();
    match cli.cmd {
        Command::Gen {
            out,
            rows,
            cols,
            dtype,
            tile,
            dist,
            seed,
            threads,
            force,
        } => gen_cmd(
            &out,
            GenArgs {
                rows,
                cols,
                dtype,
                tile,
                dist,
                seed,
                threads,
                force,
            },
        ),
        Command::Info { file, check } => info_cmd(&file, check),
        Command::Import {
            input,
            output,
            tile,
            force,
        } => import_cmd(&input, &output, tile, force),
        Command::Export {
            input,
            output,
            force,
            allow_partial,
        } => export_cmd(&input, &output, force, allow_partial),
        Command::Devices => devices_cmd(),
        Command::Plan { plan, set, cluster } => {
            crate::cluster::cmd::plan_cmd(&plan, &set, &cluster)
        }
        Command::Prepare { plan, set, restart } => {
            crate::cluster::cmd::prepare_cmd(&plan, &set, restart)
        }
        Command::Finalize { plan, set, verify } => {
            crate::cluster::cmd::finalize_cmd(&plan, &set, verify)
        }
        Command::Status {
            plan,
            set,
            claim_timeout,
        } => crate::cluster::cmd::status_cmd(&plan, &set, claim_timeout),
        Command::Run {
            plan,
            quiet,
            report,
            log_every,
            restart,
            verify,
            set,
            split,
        } => run_cmd(
            &plan,
            &set,
            RunFlags {
                quiet,
                report,
                log_every,
                restart,
                verify,
            },
            &split,
        ),
        Command::Verify {
            plan,
            set,
            rounds,
            seed,
            repair,
        } => {
            if rounds == 0 {
                return Err(Error::Usage(
                    "--rounds 0: give at least 1 (each round is one random vector)".into(),
                ));
            }
            let p = Plan::load_with(&plan, &set)?;
            run::init_threads(p.engine.threads);
            verify_plan(&p, rounds, seed, false, repair)
        }
    }
}

/// `gen`'s arguments besides the output path.
struct GenArgs {
    rows: u64,
    cols: u64,
    dtype: String,
    tile: u64,
    dist: String,
    seed: u64,
    threads: usize,
    force: bool,
}

fn gen_cmd(out: &Path, a: GenArgs) -> Result<()> {
    refuse_existing(out, a.force)?;
    let dtype = DType::parse(&a.dtype)
        .ok_or_else(|| Error::Usage(format!("--dtype {}: use f32, f64, f16 or bf16", a.dtype)))?;
    let dist = Dist::parse(&a.dist)
        .ok_or_else(|| Error::Usage(format!("--dist {}: use one of {}", a.dist, Dist::NAMES)))?;
    check_tile(a.tile)?;
    if a.threads > crate::backend::MAX_THREADS {
        return Err(Error::Usage(format!(
            "--threads {}: at most {}; leave it out (or 0) to use every core",
            a.threads,
            crate::backend::MAX_THREADS
        )));
    }
    let (rows, cols) = (a.rows, a.cols);
    if rows == 0 || cols == 0 {
        return Err(Error::Usage(format!(
            "{}: --rows and --cols must be at least 1",
            out.display()
        )));
    }
    run::init_threads(a.threads);
    run::ignore_sigxfsz();
    interrupt::install();
    let t = Instant::now();
    let spec = GenSpec {
        rows,
        cols,
        dtype,
        tile: (a.tile.min(rows), a.tile.min(cols)),
        dist,
        seed: a.seed,
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
    Ok(())
}

fn info_cmd(file: &Path, check: bool) -> Result<()> {
    use crate::store::source::Checked;
    // An output `run` has not finished is told apart from a corrupt one, in every format.
    let open = if check { unfinished(file)? } else { None };
    // .npy and raw inputs describe themselves.
    if let Some((text, checked)) = crate::store::source::inspect(file, check && open.is_none())? {
        out!("{text}");
        if let Some(progress) = open {
            outln!("check:       unfinished, resumable ({progress})");
            return Err(unfinished_error(file, &progress));
        }
        return match checked {
            None => Ok(()),
            Some(Checked::Ok(line)) => {
                out!("{line}");
                Ok(())
            }
            Some(Checked::NotPossible(e)) => {
                outln!("check:       not possible");
                Err(e)
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
        "tiles:       {} × {} elements, grid {} × {} = {} tiles, stride {} bytes",
        h.tile_rows,
        h.tile_cols,
        h.grid_rows(),
        h.grid_cols(),
        h.tiles(),
        h.tile_stride
    );
    outln!(
        "data:        offset {}, {}",
        h.data_offset,
        fmt_bytes(h.data_end() - h.data_offset)
    );
    outln!(
        "checksums:   {}",
        if h.has_checksums() {
            format!("CRC-32C per tile at offset {}", h.checksum_table_offset)
        } else {
            "none".into()
        }
    );
    outln!(
        "size:        {} ({} bytes)",
        fmt_bytes(h.file_len()),
        h.file_len()
    );
    if !check {
        return Ok(());
    }
    if let Some(progress) = open {
        outln!("check:       unfinished, resumable ({progress})");
        return Err(unfinished_error(file, &progress));
    }
    if !h.has_checksums() {
        outln!("check:       not possible");
        return Err(Error::format(
            file,
            format!(
                "has no checksum table (a file written without one); nothing to check. To add one, rewrite it: mgmm-stream export {f} tmp.npy && mgmm-stream import tmp.npy {f} --tile {t} --force",
                f = file.display(),
                t = h.tile_rows.max(h.tile_cols)
            ),
        ));
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
    outln!(
        "check:       all {} tiles OK ({:.2} s)",
        h.tiles(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
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
fn run_output_checksum(e: Error, of: &str, then: &str) -> Error {
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

fn unfinished_error(file: &Path, progress: &str) -> Error {
    Error::Usage(format!(
        "{}: unfinished, resumable ({progress}), not corrupt: resume with `mgmm-stream run PLAN` (the plan that writes it)",
        file.display()
    ))
}

/// "N of M output tiles done" when `file` is an output whose journal says `run` has not
/// finished it (or what a split run that is writing it has left to do); `None` for a
/// finished output or a file no run is writing.
fn unfinished(file: &Path) -> Result<Option<String>> {
    // A `raw:…` descriptor is never an output of `run`.
    if file.to_string_lossy().starts_with("raw:") {
        return Ok(None);
    }
    let Some(j) = journal::peek(file)? else {
        return Ok(crate::cluster::split_state(file).map(|state| {
            format!(
                "a split run's shards are writing it, state in {}; `mgmm-stream status PLAN` shows them, `finalize PLAN` completes it",
                state.display()
            )
        }));
    };
    if j.complete {
        return Ok(None);
    }
    // Any output format (.mgt, .npy): the shape is all that is needed.
    let (rows, cols) = crate::store::source::open_source(file)?.shape();
    let done: std::collections::BTreeSet<u32> = j.done.iter().map(|&(s, _)| s).collect();
    // The journal's fingerprint names the compute tile "tm×tn×tk": output tiles are tm × tn.
    let total = j.fingerprint.get("compute tile").and_then(|t| {
        let v: Vec<u64> = t.split('×').filter_map(|x| x.trim().parse().ok()).collect();
        (v.len() == 3 && v[0] > 0 && v[1] > 0).then(|| rows.div_ceil(v[0]) * cols.div_ceil(v[1]))
    });
    Ok(Some(match total {
        Some(m) => format!("{} of {m} tiles done", done.len()),
        None => format!("{} tiles done", done.len()),
    }))
}

fn import_cmd(input: &Path, output: &Path, tile: u64, force: bool) -> Result<()> {
    refuse_same(input, output)?;
    refuse_existing(output, force)?;
    check_tile(tile)?;
    let t = Instant::now();
    let h = npy::import(input, output, (tile, tile))?;
    outln!(
        "imported {} → {} ({}×{} {}) in {:.2} s",
        input.display(),
        output.display(),
        h.rows,
        h.cols,
        h.dtype,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

fn export_cmd(input: &Path, output: &Path, force: bool, allow_partial: bool) -> Result<()> {
    refuse_same(input, output)?;
    refuse_existing(output, force)?;
    // An output `run` is still writing (.mgt or .npy) has a journal, or a split run's state,
    // beside it; a raw descriptor is read as it is.
    if !allow_partial {
        if let Some(progress) = unfinished(input)? {
            return Err(Error::Usage(format!(
                "{} is unfinished ({progress}): resume with `mgmm-stream run PLAN` (the plan that writes it), or pass --allow-partial to export it as it is",
                input.display()
            )));
        }
    }
    run::ignore_sigxfsz();
    interrupt::install();
    let t = Instant::now();
    npy::export(input, output, !allow_partial).map_err(|e| match e {
        e @ Error::Checksum { .. } if journal::peek(input).is_ok_and(|j| j.is_some()) => {
            run_output_checksum(e, "", ", then export again")
        }
        e => interrupted(e, &format!("{} was not written", output.display())),
    })?;
    outln!(
        "exported {} → {} in {:.2} s",
        input.display(),
        output.display(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

fn devices_cmd() -> Result<()> {
    match crate::backend::cuda::probe() {
        Ok(devs) => {
            for d in devs {
                outln!(
                    "cuda:{}  {}  compute capability {}.{}  memory {} free of {}",
                    d.ordinal,
                    d.name,
                    d.cc.0,
                    d.cc.1,
                    fmt_bytes(d.free),
                    fmt_bytes(d.total)
                );
            }
        }
        Err(e) => outln!(
            "{}",
            crate::progress::wrap(&format!(
                "no usable GPU: {e}\nbackend = \"auto\" will use the CPU."
            ))
        ),
    }
    Ok(())
}

/// `run`'s flags besides the plan, `--set` and the split.
struct RunFlags {
    quiet: bool,
    report: Option<PathBuf>,
    log_every: f64,
    restart: bool,
    verify: bool,
}

/// Whether `--report PATH` can be written: an existing regular file opened for writing (left
/// as it is), or a new one that could be created in its folder (tried with a probe file removed
/// at once, so a run killed before its end leaves no empty report behind; the report itself is
/// written whole at the end, `run::run_plan_timed`).
fn report_writable(path: &Path) -> Result<()> {
    let err = |e| Error::io(path, "cannot write the report (--report)", e);
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => Err(Error::Usage(format!(
            "--report {}: not a regular file; give a file path",
            path.display()
        ))),
        Ok(_) => std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .map(|_| ())
            .map_err(err),
        Err(_) => {
            // Its folder is made as an output's is (`run` creates those too).
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent).map_err(err)?;
            }
            let probe = crate::run::report_temp(path, "probe");
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&probe)
                .map_err(err)?;
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
    }
}

fn run_cmd(
    plan: &Path,
    set: &[String],
    flags: RunFlags,
    split: &crate::cluster::cmd::ShardArgs,
) -> Result<()> {
    let RunFlags {
        quiet,
        report,
        log_every,
        restart,
        verify,
    } = flags;
    let mut p = Plan::load_with(plan, &split.with_local_gpu(set.to_vec()))?;
    if split.options()?.is_some() {
        // As `prepare` laid the step out: a tile that does not depend on this process's GPUs.
        p.engine.even_rows = false;
    }
    crate::trace::check_path()?;
    // A report path that cannot be written fails now, not after hours of work.
    if let Some(r) = &report {
        report_writable(r)?;
    }
    interrupt::install();
    let progress = Progress::new(quiet, Duration::from_secs_f64(log_every.max(0.1)));
    let opts = RunOptions {
        report: report.clone(),
        restart,
        cancel: Some(interrupt::flag()),
        #[cfg(feature = "fault-injection")]
        faults: crate::backend::fault::FaultConfig::from_env(),
    };
    let rep = match split.options()? {
        Some(sh) => crate::cluster::run_plan(&p, &opts, &sh, &progress),
        None => run::run_plan(&p, &opts, &progress),
    };
    match crate::trace::write() {
        Err(e) => crate::diagln!("warning: {e}"),
        Ok(0) => {}
        Ok(n) => crate::diagln!(
            "note: the timeline (MGMM_TRACE) kept its first {} events; {n} later ones were dropped",
            crate::trace::MAX_EVENTS
        ),
    }
    let rep = rep.map_err(|e| {
        interrupted(
            e,
            "run the same command again to resume (finished tiles are kept)",
        )
    })?;
    progress.result(&format!(
        "done in {} (process {})",
        fmt_duration(Some(rep.wall_s)),
        fmt_duration(rep.process_wall_s)
    ));
    if verify {
        verify_plan(&p, 2, 1, quiet, false)?;
    }
    Ok(())
}
