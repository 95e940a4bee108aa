//! What a person watching a long job sees.
//!
//! On a terminal: indicatif bars — output tiles with ETA, GFLOP/s, read and write MB/s — and a
//! line with each stage's busy share. When stderr is not a terminal (batch jobs, CI), indicatif
//! hides itself, so a plain log line is printed every few seconds instead. `--quiet` prints
//! nothing but errors. Everything here only reads the pipeline's counters.
//!
//! Library callers (the Python package) can instead receive each update as data through a
//! [`ProgressListener`], and can attach a cancel flag ([`Progress::with_cancel`]): a running
//! pipeline watches it and stops as if a stage had failed, leaving its journal resumable.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::pipeline::metrics::{StageKind, StageMetrics};

/// Counters the display reads.
pub struct Live<'a> {
    /// When the step's stages started (rates and busy shares are measured from here).
    pub started: std::time::Instant,
    pub tiles_total: u64,
    pub flops_total: u64,
    pub tiles_done: &'a AtomicU64,
    pub flops_done: &'a AtomicU64,
    /// Whether the lanes are devices with their own engines worth showing (not the CPU).
    pub show_devices: bool,
    /// Each lane's name and its device statistics so far.
    pub lanes: Vec<(String, &'a std::sync::Mutex<crate::backend::DeviceStats>)>,
}

enum Mode {
    Bars(MultiProgress),
    Log {
        every: Duration,
    },
    Quiet,
    Listener {
        every: Duration,
        to: Arc<dyn ProgressListener>,
    },
}

/// One progress update as data (what the bar shows), for a [`ProgressListener`].
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Update {
    /// "step 1", …
    pub label: String,
    pub tiles_done: u64,
    pub tiles_total: u64,
    pub flops_done: u64,
    pub flops_total: u64,
    /// Seconds since the step's stages started.
    pub elapsed_s: f64,
    pub gflops_per_s: f64,
    /// Bytes read from the inputs and written to the output so far.
    pub read_bytes: u64,
    pub write_bytes: u64,
    /// Estimated seconds left (NaN before the first tile).
    pub eta_s: f64,
    /// True for the last update of a step.
    pub finished: bool,
}

/// Receives progress as data instead of a display. Called from the pipeline's reporter
/// thread: implementations must be quick and must not block on the caller's thread.
pub trait ProgressListener: Send + Sync {
    /// A line the display would print (resuming, generated inputs, the summary).
    fn note(&self, msg: &str);
    /// The state of the running step, every `every` and once at its end.
    fn update(&self, u: &Update);
}

pub struct Progress {
    mode: Mode,
    cancel: Option<Arc<AtomicBool>>,
}

impl Progress {
    /// `quiet`: nothing. Otherwise bars on a terminal, log lines every `log_every` elsewhere.
    pub fn new(quiet: bool, log_every: Duration) -> Progress {
        let mode = if quiet {
            Mode::Quiet
        } else {
            let mp = MultiProgress::with_draw_target(ProgressDrawTarget::stderr());
            if mp.is_hidden() || !std::io::stderr().is_terminal() {
                Mode::Log { every: log_every }
            } else {
                Mode::Bars(mp)
            }
        };
        Progress { mode, cancel: None }
    }

    pub fn quiet() -> Progress {
        Progress {
            mode: Mode::Quiet,
            cancel: None,
        }
    }

    /// Progress delivered as data to `to`, every `every` while a step runs.
    pub fn with_listener(to: Arc<dyn ProgressListener>, every: Duration) -> Progress {
        Progress {
            mode: Mode::Listener { every, to },
            cancel: None,
        }
    }

    /// Attach a cancel flag: once it is set, a running pipeline stops (as if a stage had
    /// failed, with [`crate::Error::Cancelled`]); tiles already journaled stay done.
    pub fn with_cancel(mut self, flag: Arc<AtomicBool>) -> Progress {
        self.cancel = Some(flag);
        self
    }

    /// The cancel flag, if one is attached.
    pub fn cancel_flag(&self) -> Option<&Arc<AtomicBool>> {
        self.cancel.as_ref()
    }

    /// Print a line (above the bars when they are shown).
    pub fn note(&self, msg: &str) {
        match &self.mode {
            Mode::Quiet => {}
            Mode::Bars(mp) => mp.suspend(|| eprintln!("{msg}")),
            Mode::Log { .. } => {
                let _ = writeln!(std::io::stderr(), "{msg}");
            }
            Mode::Listener { to, .. } => to.note(msg),
        }
    }

    pub fn is_quiet(&self) -> bool {
        matches!(self.mode, Mode::Quiet)
    }

    /// Show progress of one step until `stop` disconnects.
    pub fn watch(
        &self,
        label: &str,
        live: &Live<'_>,
        stages: &[Arc<StageMetrics>],
        stop: &Receiver<()>,
    ) {
        let t0 = live.started;
        let read_bytes = || -> u64 {
            stages
                .iter()
                .filter(|m| m.kind == StageKind::Staging)
                .map(|m| m.bytes())
                .sum()
        };
        let write_bytes = || -> u64 {
            stages
                .iter()
                .filter(|m| m.kind == StageKind::Writeback)
                .map(|m| m.bytes())
                .sum()
        };
        let rates = || {
            let el = t0.elapsed().as_secs_f64().max(1e-9);
            (
                live.flops_done.load(Ordering::Relaxed) as f64 / el / 1e9,
                read_bytes() as f64 / el / 1e6,
                write_bytes() as f64 / el / 1e6,
            )
        };
        let shares = || -> String {
            let el = t0.elapsed().as_secs_f64().max(1e-9);
            let mut parts: Vec<String> = stages
                .iter()
                .map(|m| format!("{} {:.0}%", m.name, 100.0 * m.snapshot().busy_s / el))
                .collect();
            for (name, st) in &live.lanes {
                let st = st.lock().unwrap().clone();
                if st.gemms > 0 && live.show_devices {
                    parts.push(format!(
                        "{name}: gemm {:.0}%, H2D {:.1} GB/s, D2H {:.1} GB/s",
                        100.0 * st.gemm_s / el,
                        st.h2d_bytes as f64 / st.h2d_s.max(1e-9) / 1e9,
                        st.d2h_bytes as f64 / st.d2h_s.max(1e-9) / 1e9
                    ));
                }
            }
            parts.join("  ")
        };
        match &self.mode {
            Mode::Quiet => {
                let _ = stop.recv();
            }
            Mode::Listener { every, to } => {
                let update = |finished: bool| {
                    let el = t0.elapsed().as_secs_f64();
                    let flops_done = live.flops_done.load(Ordering::Relaxed);
                    let frac = flops_done as f64 / live.flops_total.max(1) as f64;
                    Update {
                        label: label.to_string(),
                        tiles_done: live.tiles_done.load(Ordering::Relaxed),
                        tiles_total: live.tiles_total,
                        flops_done,
                        flops_total: live.flops_total,
                        elapsed_s: el,
                        gflops_per_s: rates().0,
                        read_bytes: read_bytes(),
                        write_bytes: write_bytes(),
                        eta_s: if frac > 0.0 { el / frac - el } else { f64::NAN },
                        finished,
                    }
                };
                to.update(&update(false));
                while let Err(RecvTimeoutError::Timeout) = stop.recv_timeout(*every) {
                    to.update(&update(false));
                }
                to.update(&update(true));
            }
            Mode::Bars(mp) => {
                let bar = mp.add(ProgressBar::new(live.tiles_total));
                bar.set_style(
                    ProgressStyle::with_template(
                        "{prefix:>8} [{elapsed_precise}] {wide_bar} {pos}/{len} tiles ETA {eta} {msg}",
                    )
                    .expect("valid template"),
                );
                bar.set_prefix(label.to_string());
                let stage_line = mp.add(ProgressBar::new(1));
                stage_line.set_style(
                    ProgressStyle::with_template("         {msg}").expect("valid template"),
                );
                loop {
                    let (g, r, w) = rates();
                    bar.set_position(live.tiles_done.load(Ordering::Relaxed));
                    bar.set_message(format!(
                        "{g:.1} GFLOP/s  read {r:.0} MB/s  write {w:.0} MB/s"
                    ));
                    stage_line.set_message(shares());
                    match stop.recv_timeout(Duration::from_millis(200)) {
                        Err(RecvTimeoutError::Timeout) => continue,
                        _ => break,
                    }
                }
                bar.finish_and_clear();
                stage_line.finish_and_clear();
                mp.remove(&bar);
                mp.remove(&stage_line);
            }
            Mode::Log { every } => {
                while let Err(RecvTimeoutError::Timeout) = stop.recv_timeout(*every) {
                    let done = live.tiles_done.load(Ordering::Relaxed);
                    let (g, r, w) = rates();
                    let el = t0.elapsed().as_secs_f64();
                    let frac = live.flops_done.load(Ordering::Relaxed) as f64
                        / live.flops_total.max(1) as f64;
                    let eta = if frac > 0.0 { el / frac - el } else { f64::NAN };
                    eprintln!(
                        "{label}: {done}/{} tiles ({:.1}%), {g:.1} GFLOP/s, read {r:.0} MB/s, write {w:.0} MB/s, elapsed {el:.0}s, ETA {eta:.0}s | {}",
                        live.tiles_total,
                        100.0 * frac,
                        shares()
                    );
                }
            }
        }
    }
}
