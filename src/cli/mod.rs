//! The command line: the clap parser ([`Cli`]), one [`Command`] variant per subcommand whose
//! arguments are a clap struct in the subcommand's own file, and [`execute`], which reads the
//! environment's settings once and hands the command to its file. `main.rs` only parses, calls
//! [`execute`] and turns an error into a message and an exit code.
//!
//! Results a script reads (the run summary, plan text, `info`, verify's PASS/FAIL lines,
//! `devices`, what `gen`/`import`/`export` wrote) go to stdout; diagnostics (progress, notes,
//! errors) to stderr. Both through [`crate::out`], so a closed pipe never kills a finished job.
//!
//! One file per command: `gen.rs`, `info.rs`, `import.rs`, `export.rs`, `plan.rs` (with the
//! cluster time model's flags), `devices.rs`, `run.rs` (with the split-run flags),
//! `prepare.rs`, `finalize.rs`, `status.rs`, `verify.rs`. A command's help text (its doc
//! comment and example) sits on its arguments struct, beside its flags.

mod devices;
mod export;
mod finalize;
mod gen;
mod import;
mod info;
mod plan;
mod prepare;
mod run;
mod status;
mod verify;

use std::path::Path;

use clap::{Parser, Subcommand};

use crate::config::Settings;
use crate::error::{Error, Result};
use crate::interrupt;

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

/// The subcommands, in the order `--help` lists them; each one's help is on its struct.
#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    Gen(gen::GenArgs),
    Info(info::InfoArgs),
    Import(import::ImportArgs),
    Export(export::ExportArgs),
    Plan(plan::PlanArgs),
    Devices(devices::DevicesArgs),
    Run(run::RunArgs),
    Prepare(prepare::PrepareArgs),
    Finalize(finalize::FinalizeArgs),
    Status(status::StatusArgs),
    Verify(verify::VerifyArgs),
}

/// Run one command.
pub fn execute(cli: Cli) -> Result<()> {
    crate::report::mark_process_start();
    // Past a file-size limit (`ulimit -f`) a write fails with EFBIG, which every command
    // reports naming the file, instead of the process dying of SIGXFSZ without a word.
    crate::run::ignore_sigxfsz();
    // A mapped file that shrinks under a run (an input truncated meanwhile) faults with SIGBUS:
    // said in words, with the way on, not a bare "Bus error".
    crate::interrupt::explain_bus_errors();
    // The environment's settings, read here once and passed down as values.
    let settings = Settings::from_env();
    #[cfg(feature = "fault-injection")]
    if let Some(p) = crate::config::sync_log() {
        crate::store::fsutil::log_syncs_to(&p);
    }
    match cli.cmd {
        Command::Gen(a) => a.execute(),
        Command::Info(a) => a.execute(),
        Command::Import(a) => a.execute(),
        Command::Export(a) => a.execute(),
        Command::Plan(a) => a.execute(),
        Command::Devices(a) => a.execute(),
        Command::Run(a) => a.execute(&settings),
        Command::Prepare(a) => a.execute(),
        Command::Finalize(a) => a.execute(&settings),
        Command::Status(a) => a.execute(),
        Command::Verify(a) => a.execute(&settings),
    }
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

/// Refuse `path` (`what` the flag or variable that named it, e.g. "--report ") when it is one
/// of the job's own files ([`crate::run::space::plan_files`]).
fn refuse_job_files(p: &crate::plan::Plan, path: Option<&Path>, what: &str) -> Result<()> {
    match path {
        Some(path) => crate::run::space::refuse_over(&crate::run::space::plan_files(p), path, what),
        None => Ok(()),
    }
}

fn check_tile(tile: u64) -> Result<()> {
    if tile == 0 || tile > crate::store::header::MAX_TILE_EDGE {
        return Err(Error::Usage(format!(
            "--tile {tile}: must be between 1 and 65536"
        )));
    }
    Ok(())
}

/// What `gen` and `import` say of a `.mgt` they wrote as `h` when its tiles' padding makes it
/// much larger than its values ([`crate::store::header::Header::padding_cost`]), with the `--tile`
/// that helps.
fn padding_note(h: &crate::store::Header, name: &std::path::Path) -> Option<String> {
    use crate::store::header::Padding;
    Some(match h.padding_cost(&name.display().to_string())? {
        Padding::Pages(p) => format!("{p}; give --tile 64 or more (the default is 1024)"),
        Padding::Edges(p) => {
            format!("{p}; a --tile that divides the shape, or one larger than it, pads less")
        }
    })
}

/// The error for a job stopped by Ctrl-C, SIGTERM or SIGHUP, or `e` itself.
fn interrupted(e: Error, what: &str) -> Error {
    if interrupt::requested() && matches!(e, Error::Cancelled | Error::Usage(_)) {
        Error::Usage(format!("{}; {what}", interrupt::interrupted()))
    } else {
        e
    }
}
