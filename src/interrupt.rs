//! Ctrl-C (SIGINT), SIGTERM and SIGHUP as a request to stop cleanly, not a kill.
//!
//! [`install`] replaces the default action (terminate at once, leaving the progress bar drawn
//! over, the in-flight tiles lost and temporaries behind) with a handler that only sets a flag
//! and remembers the signal. SLURM sends SIGTERM at a job's time limit (SIGKILL follows
//! `KillWait` seconds later, 30 by default), `kill` and container runtimes send it by default,
//! and a closed terminal sends SIGHUP: all three stop a job the same way. Long jobs poll
//! [`flag`]: the pipeline stops its lanes, writes the tiles already computed, saves the
//! accumulators of the tiles in flight as checkpoints and keeps the journal
//! ([`crate::pipeline`]'s stop); `gen` and `export` stop and remove their temporary file; and
//! the binary's last line says how to resume. The process then exits with status 128 + the
//! signal's number (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP), as a shell reports a
//! process killed by it, rather than re-raising the signal: the work was stopped, not lost, and
//! the status still names the signal.
//!
//! A signal the process was started with ignored (`nohup` ignores SIGHUP) stays ignored.
//!
//! A second Ctrl-C while the first stop is being honoured exits at once (status 130), unless it
//! comes within 100 ms of the first: GNU `timeout -s INT` sends its signal to the process and
//! then to its process group, so the process gets it twice within microseconds, and that is
//! one request (it made `timeout -s INT` an immediate exit with nothing saved). A repeated
//! SIGTERM or SIGHUP never exits at once: SLURM may deliver SIGTERM twice (to the step's tasks
//! and through `srun`), and the stop it asked for is already under way.
//!
//! SIGBUS is no request but a fault: the kernel sends it when the engine touches a page of a
//! file it maps that no longer exists — an input truncated (or rewritten shorter) while a run
//! reads it through its map, or a mapped output whose blocks the disk could not provide.
//! [`explain_bus_errors`] makes the command line say that, and how to go on, instead of dying
//! with a bare "Bus error"; the exit status stays 135 (128 + SIGBUS). What was finished is in
//! the journal, as after a kill.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);
/// The first signal received (0: none).
static SIGNAL: AtomicI32 = AtomicI32::new(0);

/// The signals that stop a job cleanly.
const SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// When the first signal came (`CLOCK_MONOTONIC`, ns; 0: none yet).
static FIRST_NS: AtomicI64 = AtomicI64::new(0);

/// A second SIGINT sooner than this after the first is the same request delivered twice.
const SAME_REQUEST_NS: i64 = 100_000_000;

/// `CLOCK_MONOTONIC` in ns (`clock_gettime` is async-signal-safe).
fn monotonic_ns() -> i64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `clock_gettime` writes one `timespec` through a valid pointer to a local; it is
    // async-signal-safe (POSIX).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec * 1_000_000_000 + t.tv_nsec
}

extern "C" fn on_signal(sig: libc::c_int) {
    // Only async-signal-safe work here: atomics, `clock_gettime` and `_exit`.
    let now = monotonic_ns();
    let _ = FIRST_NS.compare_exchange(0, now, Ordering::SeqCst, Ordering::SeqCst);
    let _ = SIGNAL.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
    if REQUESTED.swap(true, Ordering::SeqCst)
        && sig == libc::SIGINT
        && now - FIRST_NS.load(Ordering::SeqCst) > SAME_REQUEST_NS
    {
        // SAFETY: `_exit` is async-signal-safe and never returns.
        unsafe { libc::_exit(128 + libc::SIGINT) };
    }
}

/// Install the handler for SIGINT, SIGTERM and SIGHUP (idempotent). A signal the process was
/// started with ignored stays ignored: `nohup mgmm-stream run …` (SIGHUP) and a job started in
/// the background by a shell without job control (SIGINT) asked not to be stopped by it.
pub fn install() {
    for sig in SIGNALS {
        // SAFETY: `sigaction` with a null new action only reads the current one into `old`, a
        // zeroed `sigaction` it may write; `on_signal` is an `extern "C"` function that only
        // touches atomics and calls `_exit`, all async-signal-safe, and `signal` with a valid
        // handler has no other precondition.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, std::ptr::null(), &mut old) == 0
                && old.sa_sigaction == libc::SIG_IGN
            {
                continue;
            }
            libc::signal(
                sig,
                on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            );
        }
    }
}

/// The flag the handler sets; jobs poll it and stop when it is true.
pub fn flag() -> &'static AtomicBool {
    &REQUESTED
}

/// Whether a stop was asked for (Ctrl-C, SIGTERM or SIGHUP).
pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
}

/// The signal that asked for the stop, by name (`SIGTERM`); `None` before one came.
pub fn signal_name() -> Option<&'static str> {
    match SIGNAL.load(Ordering::SeqCst) {
        libc::SIGINT => Some("SIGINT"),
        libc::SIGTERM => Some("SIGTERM"),
        libc::SIGHUP => Some("SIGHUP"),
        _ => None,
    }
}

/// How the last line of a stopped job starts: `interrupted` (Ctrl-C), `interrupted by SIGTERM`.
pub fn interrupted() -> String {
    match signal_name() {
        Some(n) if n != "SIGINT" => format!("interrupted by {n}"),
        _ => "interrupted".into(),
    }
}

/// The exit status of a job a signal stopped: 128 + its number (130 when none is known).
pub fn exit_status() -> i32 {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => 128 + libc::SIGINT,
        s => 128 + s,
    }
}

/// The line the command line prints on SIGBUS ([`explain_bus_errors`]).
const BUS_MESSAGE: &[u8] = b"\nerror: a file this run maps changed under it (SIGBUS): an input was truncated or rewritten while it was being read, or the disk could not provide the blocks of a mapped output (full?). Inputs must not change during a run: restore the file (or free space) and run the same command again; the journal keeps the tiles already finished (exit status 135)\n";

extern "C" fn on_bus_error(_sig: libc::c_int) {
    // SAFETY: `write` and `_exit` are async-signal-safe; the message is a static byte string.
    unsafe {
        libc::write(2, BUS_MESSAGE.as_ptr().cast(), BUS_MESSAGE.len());
        libc::_exit(128 + libc::SIGBUS);
    }
}

/// Make a SIGBUS (a mapped file shrank under the run) end the command with a message that says
/// what happened and what to do (see the module's doc). The command line only: a library
/// leaves the host program's own handling (Python's `faulthandler`) alone.
pub fn explain_bus_errors() {
    // SAFETY: installs an `extern "C"` handler that only calls async-signal-safe functions.
    unsafe {
        libc::signal(
            libc::SIGBUS,
            on_bus_error as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
}
