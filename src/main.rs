//! The `mgmm-stream` binary: parse the command line, run it, print errors as one clear message.

use clap::Parser;

fn main() {
    let cli = mgmm_stream::cli::Cli::parse();
    if let Err(e) = mgmm_stream::cli::execute(cli) {
        let mut msg = format!("error: {e}");
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            let t = s.to_string();
            if !msg.contains(&t) {
                msg += &format!(": {t}");
            }
            src = s.source();
        }
        eprintln!("{msg}");
        std::process::exit(1);
    }
}
