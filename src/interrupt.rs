//! Ctrl-C (SIGINT) as a request to stop cleanly, not a kill.
//!
//! [`install`] replaces the default action (terminate at once, leaving the progress bar drawn
//! over and no word on what to do next) with a handler that only sets a flag. Long jobs poll
//! [`flag`]: the pipeline cancels its stages (every finished tile is already in the journal),
//! `gen` and `export` stop and remove their temporary file, and the binary's last line says how
//! to resume. A second Ctrl-C while the first is being honoured exits at once (status 130).

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    // Only async-signal-safe work here: an atomic swap and `_exit`.
    if REQUESTED.swap(true, Ordering::SeqCst) {
        // SAFETY: `_exit` is async-signal-safe and never returns.
        unsafe { libc::_exit(130) };
    }
}

/// Install the SIGINT handler (idempotent).
pub fn install() {
    // SAFETY: `on_sigint` is an `extern "C"` function that only touches an atomic and calls
    // `_exit`, both async-signal-safe; `signal` with a valid handler has no other precondition.
    unsafe {
        libc::signal(
            libc::SIGINT,
            on_sigint as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
}

/// The flag the handler sets; jobs poll it and stop when it is true.
pub fn flag() -> &'static AtomicBool {
    &REQUESTED
}

/// Whether Ctrl-C was pressed.
pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
}
