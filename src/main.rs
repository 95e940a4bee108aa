//! The `mgmm-stream` binary: parse the command line, run it, print errors as one clear message.
//!
//! Exit status: 0 on success, 1 on an error (one line on stderr, `error: …`), 3 when `verify`
//! could check nothing of an output, 75 when the output is being written by another process
//! (`verify` during a run: try again later; [`mgmm_stream::error::Error::exit_status`]), 128 +
//! the signal's number when Ctrl-C (130), SIGTERM (143) or SIGHUP (129) stopped a job (the
//! last line says how to resume; `mgmm_stream::interrupt`). Output goes through `mgmm_stream::out`,
//! so a closed stdout or stderr pipe never turns a finished job into a panic.

use clap::Parser;
use mgmm_stream::diagln;

fn main() {
    let cli = mgmm_stream::cli::Cli::parse();
    if let Err(e) = mgmm_stream::cli::execute(cli) {
        let mut msg = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            let t = s.to_string();
            if !msg.contains(&t) {
                msg += &format!(": {t}");
            }
            src = s.source();
        }
        let interrupted = mgmm_stream::interrupt::requested();
        if interrupted && msg.starts_with("interrupted") {
            diagln!("{msg}");
            std::process::exit(mgmm_stream::interrupt::exit_status());
        }
        diagln!("error: {msg}");
        std::process::exit(if interrupted {
            mgmm_stream::interrupt::exit_status()
        } else {
            e.exit_status()
        });
    }
}
