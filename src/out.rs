//! Writing results to stdout and diagnostics to stderr without dying on a closed pipe.
//!
//! `println!` panics when its stream is gone (`mgmm-stream run plan.toml | head -1`), which
//! would turn a finished run into exit 101 with a half-written output. Everything the binary
//! prints goes through [`outln!`](crate::outln) (results a script reads: the run summary, plan
//! text, `info`, verify's PASS/FAIL) and [`diagln!`](crate::diagln) (diagnostics for a person:
//! notes, progress lines, errors) instead. A write that fails — EPIPE or any other error —
//! marks that stream closed and later writes to it are skipped; the work goes on and the exit
//! status is what the work says.

use std::fmt::Arguments;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);
static STDERR_CLOSED: AtomicBool = AtomicBool::new(false);

fn write_to(w: &mut dyn Write, closed: &AtomicBool, args: Arguments<'_>, newline: bool) {
    if closed.load(Ordering::Relaxed) {
        return;
    }
    let r = w
        .write_fmt(args)
        .and_then(|_| if newline { w.write_all(b"\n") } else { Ok(()) })
        .and_then(|_| w.flush());
    if r.is_err() {
        closed.store(true, Ordering::Relaxed);
    }
}

/// Write to stdout (results); silently stops once stdout is closed.
pub fn out(args: Arguments<'_>, newline: bool) {
    write_to(&mut std::io::stdout().lock(), &STDOUT_CLOSED, args, newline);
}

/// Write to stderr (diagnostics); silently stops once stderr is closed.
pub fn diag(args: Arguments<'_>, newline: bool) {
    write_to(&mut std::io::stderr().lock(), &STDERR_CLOSED, args, newline);
}

/// Whether a write to stderr has failed (the progress display stops drawing then).
pub fn stderr_closed() -> bool {
    STDERR_CLOSED.load(Ordering::Relaxed)
}

/// `println!` to stdout that never panics (see the module docs).
#[macro_export]
macro_rules! outln {
    ($($t:tt)*) => { $crate::out::out(format_args!($($t)*), true) };
}

/// `print!` to stdout that never panics (see the module docs).
#[macro_export]
macro_rules! out {
    ($($t:tt)*) => { $crate::out::out(format_args!($($t)*), false) };
}

/// `eprintln!` to stderr that never panics (see the module docs).
#[macro_export]
macro_rules! diagln {
    ($($t:tt)*) => { $crate::out::diag(format_args!($($t)*), true) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that fails like a closed pipe.
    struct Closed(usize);
    impl Write for Closed {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            self.0 += 1;
            Err(std::io::ErrorKind::BrokenPipe.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_closed_stream_is_marked_and_skipped() {
        let flag = AtomicBool::new(false);
        let mut w = Closed(0);
        write_to(&mut w, &flag, format_args!("x"), true);
        assert!(flag.load(Ordering::Relaxed));
        let tries = w.0;
        write_to(&mut w, &flag, format_args!("y"), true);
        assert_eq!(w.0, tries, "no further writes once closed");
        let ok = AtomicBool::new(false);
        let mut v = Vec::new();
        write_to(&mut v, &ok, format_args!("a{}", 1), true);
        assert_eq!(v, b"a1\n");
        assert!(!ok.load(Ordering::Relaxed));
    }
}
