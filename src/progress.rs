//! What a person watching a long job sees.
//!
//! Work is counted in GEMM units: the FLOPs of every k-step GEMM the device lanes have issued
//! (on the CPU a GEMM is done when issued; a GPU lane runs at most a few GEMMs behind), so one
//! huge output tile or a large K moves the display from the first seconds, not only when a tile
//! is written. Rate and ETA count only this run's work (a resume does not inflate them) and come
//! from an exponentially weighted recent rate ([`Rate`]) that adapts when throughput changes;
//! until there is a rate the ETA reads `--`, never NaN. With several steps a plan-level line says
//! `step i/N: output` and the whole plan's ETA (later steps counted in full at today's rate); a
//! whole-expression step's products are `step i/N, part p/P`, and the plan ETA counts the parts
//! still to come.
//!
//! On a terminal: indicatif bars on stderr, every line at most 80 columns. When stderr is not a
//! terminal (batch jobs, CI): a timestamped log line every `--log-every` seconds with human
//! durations ("1h02m"). `--quiet`: nothing but errors. Results a script reads (the run summary)
//! go to stdout through [`Progress::result`]; everything here goes to stderr. The stage names
//! shown (`read`, `device`, `write`, …) are explained in README.md ("Reading the progress
//! display"). Everything here only reads the pipeline's counters.
//!
//! Library callers (the Python package) can instead receive each update as data through a
//! [`ProgressListener`], and can attach a cancel flag ([`Progress::with_cancel`]): a running
//! pipeline watches it and stops as if a stage had failed, leaving its journal resumable.

use std::fmt::Write as _;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::metrics::{StageKind, StageMetrics};
use crate::{diagln, outln};

/// Widest line the display draws.
pub const WIDTH: usize = 80;
/// How often the display samples the counters.
const TICK: Duration = Duration::from_millis(200);
/// Time constant of the recent-rate average, seconds.
const RATE_TAU_S: f64 = 30.0;

/// Counters the display reads, for one step.
pub(crate) struct Live<'a> {
    /// When the step's stages started (rates and busy shares are measured from here).
    pub(crate) started: Instant,
    /// The step's index in the plan (0-based).
    pub(crate) step: usize,
    /// For one product of a whole-expression chain: its part number (1-based) and the count.
    pub(crate) part: Option<(usize, usize)>,
    /// The step's output, as the plan names it.
    pub(crate) output: String,
    /// Output tiles of the whole step (of a split run's shard: the shard's).
    pub(crate) tiles_total: u64,
    /// FLOPs of the whole step (of a split run's shard: the shard's).
    pub(crate) flops_total: u64,
    /// FLOPs of the tiles finished before this run (a resume).
    pub(crate) flops_before: u64,
    /// Output tiles written so far (including those finished before this run; of a shard,
    /// the shard's).
    pub(crate) tiles_done: &'a AtomicU64,
    /// FLOPs of the tiles written so far (including `flops_before`).
    pub(crate) flops_done: &'a AtomicU64,
    /// FLOPs of the GEMMs the lanes have issued in this run (the progress unit).
    pub(crate) flops_issued: &'a AtomicU64,
    /// Set when the run is being cancelled from outside (Ctrl-C).
    pub(crate) cancel: Option<&'static AtomicBool>,
    /// Whether the lanes are devices with their own engines worth showing (not the CPU).
    pub(crate) show_devices: bool,
    /// Each lane's name and its device statistics so far.
    pub(crate) lanes: Vec<(String, &'a Mutex<crate::seam::DeviceStats>)>,
}

/// A recent-rate estimate: the plain average over the first [`RATE_TAU_S`] seconds, then an
/// exponentially weighted average of the rate between samples with that time constant.
#[derive(Clone, Debug, Default)]
pub struct Rate {
    last: Option<(f64, f64)>,
    avg: f64,
}

impl Rate {
    /// Record that `work` units were done by `t` seconds after this run started.
    pub fn sample(&mut self, t: f64, work: f64) {
        if let Some((t0, w0)) = self.last {
            let dt = t - t0;
            if dt <= 0.0 {
                return;
            }
            if t < RATE_TAU_S {
                self.avg = work / t;
            } else {
                let inst = (work - w0) / dt;
                self.avg += (1.0 - (-dt / RATE_TAU_S).exp()) * (inst - self.avg);
            }
        } else if t > 0.0 {
            self.avg = work / t;
        }
        self.last = Some((t, work));
    }

    /// Units per second, once some work was done over at least half a second.
    pub fn per_s(&self) -> Option<f64> {
        let (t, w) = self.last?;
        (t >= 0.5 && w > 0.0 && self.avg.is_finite() && self.avg > 0.0).then_some(self.avg)
    }

    /// Seconds to do `remaining` units at the current rate.
    pub fn eta(&self, remaining: f64) -> Option<f64> {
        let s = remaining.max(0.0) / self.per_s()?;
        s.is_finite().then_some(s)
    }
}

/// `n` and the noun that goes with it ([`crate::units`], where every layer can reach it).
pub use crate::units::count;

/// A duration for people: "0.4s", "9.8s", "42s", "3m05s", "1h02m", "2d03h"; `--` for none.
pub fn fmt_duration(s: Option<f64>) -> String {
    let Some(s) = s.filter(|s| s.is_finite() && *s >= 0.0) else {
        return "--".into();
    };
    // Short runs to a tenth ("done in 0s" said nothing of a 0.14 s run).
    if s < 9.95 {
        return format!("{s:.1}s");
    }
    let s = s.round() as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        3600..=86_399 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        86_400..=8_553_599 => format!("{}d{:02}h", s / 86_400, s % 86_400 / 3600),
        _ => ">99d".into(),
    }
}

/// A FLOP rate with a unit that keeps it short ("812 GFLOP/s", "12.3 TFLOP/s").
pub fn fmt_flops(per_s: Option<f64>) -> String {
    let Some(r) = per_s else {
        return "-- FLOP/s".into();
    };
    let (v, u) = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")]
        .into_iter()
        .find(|(s, _)| r >= *s)
        .map_or((r, ""), |(s, u)| (r / s, u));
    if v < 100.0 {
        format!("{v:.1} {u}FLOP/s")
    } else {
        format!("{v:.0} {u}FLOP/s")
    }
}

/// Local wall-clock time as "YYYY-MM-DD HH:MM:SS", for log lines.
pub fn timestamp() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as libc::time_t;
    // SAFETY: `localtime_r` writes only into the `tm` we own and reads `now`; a zeroed `tm` is
    // a valid value of that plain C struct. On failure it returns null and we fall back.
    let tm = unsafe {
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&now, &mut tm).is_null() {
            return format!("@{now}");
        }
        tm
    };
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    )
}

/// `s` cut to [`WIDTH`] columns (characters), with "…" where it was cut.
pub fn fit(s: &str) -> String {
    if s.chars().count() <= WIDTH {
        return s.to_string();
    }
    let mut t: String = s.chars().take(WIDTH - 1).collect();
    t.push('…');
    t
}

/// Every line of `s` broken into lines of at most [`WIDTH`] columns (characters), for the
/// text a command prints when it is done (summaries, `plan`, verify's results). A long line
/// breaks after ", " or "; ", before " => ", " | " or " — ", or at a run of spaces; failing
/// those at a space that is not between a number and its unit ("16.00 KiB" stays whole).
/// Continuation lines are indented four columns past the line's own indent. A word longer
/// than a line (a long path) is left whole.
pub fn wrap(s: &str) -> String {
    wrap_to(s, WIDTH)
}

/// [`wrap`] to `max` columns.
fn wrap_to(s: &str, max: usize) -> String {
    let mut out = String::new();
    for (n, line) in s.split('\n').enumerate() {
        if n > 0 {
            out.push('\n');
        }
        let lead = line.chars().take_while(|&c| c == ' ').count();
        let cont = " ".repeat(lead + 4);
        let mut rest: Vec<char> = line.chars().collect();
        let mut first = true;
        loop {
            let width = if first { 0 } else { cont.len() };
            if width + rest.len() <= max {
                if !first {
                    out += &cont;
                }
                out.extend(&rest);
                break;
            }
            let room = max.saturating_sub(width).max(1);
            let Some((cut, skip)) = break_at(&rest, room, lead + 1) else {
                if !first {
                    out += &cont;
                }
                out.extend(&rest);
                break;
            };
            if !first {
                out += &cont;
            }
            let end = (1..=cut).rev().find(|&e| rest[e - 1] != ' ').unwrap_or(cut);
            out.extend(&rest[..end]);
            out.push('\n');
            rest.drain(..skip);
            first = false;
        }
    }
    out
}

/// Where to break `c` so that its first part has at most `max` characters: (end of the first
/// part, start of the rest). Never before `min` (the line's indent).
fn break_at(c: &[char], max: usize, min: usize) -> Option<(usize, usize)> {
    let at = |i: usize, p: &str| p.chars().enumerate().all(|(j, x)| c.get(i + j) == Some(&x));
    let hi = max.min(c.len());
    // Preferred: after ", " / "; " (cut after the mark), before " => " / " | " / " — ", or a
    // run of two or more spaces; when the best such point leaves the line less than half
    // full, a plain space further right is better.
    let mut pref = None;
    let mut plain = None;
    for i in min..hi + 1 {
        if i >= c.len() || c[i] != ' ' {
            continue;
        }
        let clause = i > 0 && (c[i - 1] == ',' || c[i - 1] == ';');
        if clause || at(i, " => ") || at(i, " | ") || at(i, " — ") {
            pref = Some((i, i + 1));
        } else if at(i, "  ") {
            let end = (i..c.len()).find(|&j| c[j] != ' ').unwrap_or(c.len());
            pref = Some((i, end));
        } else if !(i > 0
            && c[i - 1].is_ascii_digit()
            && c.get(i + 1).is_some_and(|x| x.is_alphabetic() || *x == '%'))
        {
            plain = Some((i, i + 1));
        }
    }
    match (pref, plain) {
        (Some(p), Some(q)) if 2 * p.0 < max && q.0 > p.0 => Some(q),
        (Some(p), _) => Some(p),
        (None, q) => q,
    }
}

/// A path shortened from the left to at most `n` characters ("…/out/C.mgt").
fn short_path(p: &str, n: usize) -> String {
    let c = p.chars().count();
    if c <= n {
        return p.to_string();
    }
    let tail: String = p.chars().skip(c - (n - 1)).collect();
    format!("…{tail}")
}

/// The display label of a stage kind (self-explanatory; the README has the legend).
fn stage_label(k: StageKind) -> &'static str {
    match k {
        StageKind::Planner => "plan",
        StageKind::Prefetch => "prefetch",
        StageKind::Staging => "read",
        StageKind::Check => "check",
        StageKind::Lane => "device",
        StageKind::OutPrep => "page-in",
        StageKind::Writeback => "write",
        StageKind::Sync => "sync",
    }
}

/// One sample of a step's counters, everything the lines show.
struct View {
    step: usize,
    steps: usize,
    part: Option<(usize, usize)>,
    output: String,
    elapsed: f64,
    frac: f64,
    rate: Option<f64>,
    eta: Option<f64>,
    plan_eta: Option<f64>,
    read_mb_s: f64,
    write_mb_s: f64,
    busy: String,
    devices: Option<String>,
}

impl View {
    /// "step 2/3", or "step 1/1, part 2/2" for a product of a chain.
    fn label(&self) -> String {
        let mut l = format!("step {}/{}", self.step + 1, self.steps);
        if let Some((p, n)) = self.part {
            let _ = write!(l, ", part {p}/{n}");
        }
        l
    }
    fn head(&self) -> String {
        let label = self.label();
        // 44 columns of name beside "step 12/12"; a part label takes them from the name.
        let name = short_path(&self.output, 54usize.saturating_sub(label.len()).max(20));
        fit(&format!(
            "{label}: {name}, elapsed {}",
            fmt_duration(Some(self.elapsed))
        ))
    }
    fn numbers(&self) -> String {
        let mut s = format!(
            "{:5.1}%  {}  ETA {}",
            100.0 * self.frac,
            fmt_flops(self.rate),
            fmt_duration(self.eta)
        );
        if self.steps > 1 || self.part.is_some_and(|(p, n)| p < n) {
            let _ = write!(s, "  plan ETA {}", fmt_duration(self.plan_eta));
        }
        s
    }
    fn io(&self) -> String {
        fit(&format!(
            "read {:.0} MB/s, write {:.0} MB/s; busy: {}",
            self.read_mb_s, self.write_mb_s, self.busy
        ))
    }
    /// The lines a log (non-terminal) shows for this sample.
    fn log_lines(&self) -> Vec<String> {
        let ts = timestamp();
        let mut v = vec![
            fit(&format!("{ts} {} {}", self.label(), self.numbers())),
            fit(&format!("{ts}   {}", self.io())),
        ];
        if let Some(d) = &self.devices {
            v.push(fit(&format!("{ts}   {d}")));
        }
        v
    }
}

enum Mode {
    Bars(MultiProgress),
    Log {
        every: Duration,
        /// Where log lines go: stderr, or a buffer (tests).
        to: Option<Arc<Mutex<Vec<String>>>>,
    },
    Quiet,
    Listener {
        every: Duration,
        to: Arc<dyn ProgressListener>,
    },
}

/// One progress update as data (what the display shows), for a [`ProgressListener`].
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Update {
    /// "step 1/2", or "step 2/2, part 1/2" for a product of a whole-expression step.
    pub label: String,
    /// Output tiles written so far.
    pub tiles_done: u64,
    /// Output tiles of the whole step (of a split run's shard: the shard's).
    pub tiles_total: u64,
    /// FLOPs done (GEMMs issued in this run plus the tiles finished before it).
    pub flops_done: u64,
    /// FLOPs of the whole step.
    pub flops_total: u64,
    /// Seconds since the step's stages started.
    pub elapsed_s: f64,
    /// Recent rate in GFLOP/s (0 until there is a rate).
    pub gflops_per_s: f64,
    /// Bytes read from the inputs so far.
    pub read_bytes: u64,
    /// Bytes written to the output so far.
    pub write_bytes: u64,
    /// Estimated seconds left (NaN until there is a rate).
    pub eta_s: f64,
    /// True for the last update of a step whose every output tile is done; the last update of
    /// a step that stopped short (a cancel, an error) says false (it said true after a cancel).
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

/// The display for one invocation of the engine.
pub struct Progress {
    mode: Mode,
    /// Each step's output name, FLOPs and index in the plan, for the plan-level line.
    plan: Mutex<Vec<(String, u64, usize)>>,
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
                Mode::Log {
                    every: log_every,
                    to: None,
                }
            } else {
                Mode::Bars(mp)
            }
        };
        Progress {
            mode,
            plan: Mutex::new(Vec::new()),
            cancel: None,
        }
    }

    /// A progress that shows nothing and reports to no one.
    pub fn quiet() -> Progress {
        Progress {
            mode: Mode::Quiet,
            plan: Mutex::new(Vec::new()),
            cancel: None,
        }
    }

    /// Progress delivered as data to `to`, every `every` while a step runs.
    pub fn with_listener(to: Arc<dyn ProgressListener>, every: Duration) -> Progress {
        Progress {
            mode: Mode::Listener { every, to },
            plan: Mutex::new(Vec::new()),
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

    /// Log lines every `every` into `lines` instead of stderr (tests read them).
    pub fn log_into(every: Duration, lines: Arc<Mutex<Vec<String>>>) -> Progress {
        Progress {
            mode: Mode::Log {
                every,
                to: Some(lines),
            },
            plan: Mutex::new(Vec::new()),
            cancel: None,
        }
    }

    /// Tell the display the plan's steps as run (output name, FLOPs, the step's index in the
    /// plan: a chain's products share their step's index), for `step i/N` and the plan ETA.
    pub fn begin_plan(&self, steps: Vec<(String, u64, usize)>) {
        *self.plan.lock().unwrap() = steps;
    }

    fn emit(&self, line: &str) {
        match &self.mode {
            Mode::Quiet => {}
            Mode::Bars(mp) => mp.suspend(|| diagln!("{line}")),
            Mode::Log { to: Some(v), .. } => v.lock().unwrap().push(line.to_string()),
            Mode::Log { to: None, .. } => diagln!("{line}"),
            Mode::Listener { to, .. } => to.note(line),
        }
    }

    /// Print a diagnostic line on stderr (above the bars when they are shown; with a
    /// timestamp in a log).
    ///
    /// Wrapped to 80 columns for people (bars, log lines: a log line's continuation is
    /// indented under it); a listener (the Python package's `logging`) gets the message as it
    /// is, one record per note.
    pub fn note(&self, msg: &str) {
        match &self.mode {
            Mode::Log { .. } => {
                let ts = timestamp();
                for l in msg.lines() {
                    self.emit(&wrap(&format!("{ts} {l}")));
                }
            }
            Mode::Listener { .. } => self.emit(msg),
            _ => self.emit(&wrap(msg)),
        }
    }

    /// Print a result (the run summary) on stdout, unless quiet.
    pub fn result(&self, msg: &str) {
        match &self.mode {
            Mode::Quiet => {}
            Mode::Bars(mp) => mp.suspend(|| outln!("{msg}")),
            Mode::Log { to: Some(v), .. } => v.lock().unwrap().push(msg.to_string()),
            Mode::Log { to: None, .. } => outln!("{msg}"),
            Mode::Listener { to, .. } => to.note(msg),
        }
    }

    pub(crate) fn is_quiet(&self) -> bool {
        matches!(self.mode, Mode::Quiet)
    }

    /// The plan's step count and the FLOPs of what runs after the step writing `output`
    /// (step index `step`), from [`Progress::begin_plan`].
    fn plan_context(&self, step: usize, output: &str) -> (usize, f64) {
        let p = self.plan.lock().unwrap();
        let steps = p.iter().map(|e| e.2 + 1).max().unwrap_or(0).max(step + 1);
        let pos = p
            .iter()
            .position(|e| e.0 == output)
            .or_else(|| p.iter().rposition(|e| e.2 == step));
        let later = pos.map_or(0.0, |i| p.iter().skip(i + 1).map(|e| e.1 as f64).sum());
        (steps, later)
    }

    /// Show progress of one step until `stop` disconnects.
    pub(crate) fn watch(&self, live: &Live<'_>, stages: &[Arc<StageMetrics>], stop: &Receiver<()>) {
        if let Mode::Quiet = self.mode {
            let _ = stop.recv();
            return;
        }
        let (steps, later) = self.plan_context(live.step, &live.output);
        let mut rate = Rate::default();
        let mut sample = || -> View {
            let el = live.started.elapsed().as_secs_f64();
            let issued = live.flops_issued.load(Ordering::Relaxed) as f64;
            rate.sample(el, issued);
            let total = live.flops_total.max(1) as f64;
            let done = (live.flops_before as f64 + issued)
                .max(live.flops_done.load(Ordering::Relaxed) as f64)
                .min(total);
            let per_s = rate.per_s();
            let eta = rate.eta(total - done);
            View {
                step: live.step,
                steps,
                part: live.part,
                output: live.output.clone(),
                elapsed: el,
                frac: done / total,
                rate: per_s,
                eta,
                plan_eta: eta.and_then(|e| rate.eta(later).map(|l| e + l)),
                read_mb_s: kind_bytes(stages, StageKind::Staging) as f64 / el.max(1e-9) / 1e6,
                write_mb_s: kind_bytes(stages, StageKind::Writeback) as f64 / el.max(1e-9) / 1e6,
                busy: busy_shares(stages, el),
                devices: device_line(live, el),
            }
        };
        let first = sample();
        self.note(&format!(
            "{}: {}{}",
            first.label(),
            live.output,
            if live.flops_before > 0 {
                format!(" (resuming at {:.1}%)", 100.0 * first.frac)
            } else {
                String::new()
            }
        ));
        match &self.mode {
            Mode::Quiet => unreachable!("handled above"),
            Mode::Bars(mp) => Self::bars(mp, &mut sample, stop),
            Mode::Listener { every, to } => {
                // The last update: finished only when every tile is done — the pipeline's own
                // test of a complete run (a cancelled one whose last tiles landed meanwhile is).
                let update = |v: &View, last: bool| Update {
                    label: v.label(),
                    tiles_done: live.tiles_done.load(Ordering::Relaxed),
                    tiles_total: live.tiles_total,
                    flops_done: (v.frac * live.flops_total as f64) as u64,
                    flops_total: live.flops_total,
                    elapsed_s: v.elapsed,
                    // The last update of a call too short for the windowed rate: the
                    // step's average (a 26 ms call reported 0.0 GFLOP/s).
                    gflops_per_s: v
                        .rate
                        .filter(|r| *r > 0.0)
                        .or_else(|| {
                            let done = v.frac * live.flops_total as f64 - live.flops_before as f64;
                            (last && v.elapsed > 0.0).then(|| done.max(0.0) / v.elapsed)
                        })
                        .unwrap_or(0.0)
                        / 1e9,
                    read_bytes: kind_bytes(stages, StageKind::Staging),
                    write_bytes: kind_bytes(stages, StageKind::Writeback),
                    eta_s: v.eta.unwrap_or(f64::NAN),
                    finished: last && live.tiles_done.load(Ordering::Relaxed) >= live.tiles_total,
                };
                to.update(&update(&first, false));
                while let Err(RecvTimeoutError::Timeout) = stop.recv_timeout(*every) {
                    to.update(&update(&sample(), false));
                }
                to.update(&update(&sample(), true));
            }
            Mode::Log { every, .. } => {
                let mut next = Instant::now() + *every;
                while let Err(RecvTimeoutError::Timeout) = stop.recv_timeout(TICK.min(*every)) {
                    let v = sample();
                    if Instant::now() >= next {
                        next += *every;
                        v.log_lines().iter().for_each(|l| self.emit(l));
                    }
                }
            }
        }
        if live.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            let v = sample();
            self.note(&format!(
                "{}: stopped at {:.1}% (interrupted)",
                v.label(),
                100.0 * v.frac
            ));
        }
    }

    /// Draw bars until `stop` disconnects, then clear them.
    fn bars(mp: &MultiProgress, sample: &mut dyn FnMut() -> View, stop: &Receiver<()>) {
        let line = |tpl: &str| {
            let b = mp.add(ProgressBar::new(1000));
            b.set_style(ProgressStyle::with_template(tpl).expect("valid template"));
            b
        };
        let head = line("{msg}");
        let bar = line("{bar:24} {msg}");
        let io = line("{msg}");
        let dev = line("{msg}");
        loop {
            let v = sample();
            head.set_message(v.head());
            bar.set_position((1000.0 * v.frac) as u64);
            bar.set_message(v.numbers());
            io.set_message(v.io());
            dev.set_message(v.devices.clone().unwrap_or_default());
            if crate::out::stderr_closed() {
                mp.set_draw_target(ProgressDrawTarget::hidden());
            }
            match stop.recv_timeout(TICK) {
                Err(RecvTimeoutError::Timeout) => continue,
                _ => break,
            }
        }
        for b in [head, bar, io, dev] {
            b.finish_and_clear();
            mp.remove(&b);
        }
    }

    /// Run `work` (which adds to `done`, out of `total` bytes) while showing its progress
    /// under `label` (`gen`, inputs generated by `run`).
    pub fn job<R>(&self, label: &str, total: u64, done: &AtomicU64, work: impl FnOnce() -> R) -> R {
        if self.is_quiet() {
            return work();
        }
        let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
        std::thread::scope(|s| {
            s.spawn(|| self.watch_job(label, total, done, &stop_rx));
            let r = work();
            drop(stop_tx);
            r
        })
    }

    fn watch_job(&self, label: &str, total: u64, done: &AtomicU64, stop: &Receiver<()>) {
        let t0 = Instant::now();
        let mut rate = Rate::default();
        let mut line = || {
            let el = t0.elapsed().as_secs_f64();
            let d = done.load(Ordering::Relaxed) as f64;
            rate.sample(el, d);
            let frac = d / total.max(1) as f64;
            let mb = rate
                .per_s()
                .map_or("--".into(), |r| format!("{:.0}", r / 1e6));
            let name = short_path(label, 36);
            (
                frac,
                format!(
                    "{name}: {:5.1}%  {mb} MB/s  ETA {}",
                    100.0 * frac,
                    fmt_duration(rate.eta(total as f64 - d))
                ),
            )
        };
        match &self.mode {
            Mode::Quiet | Mode::Listener { .. } => {
                let _ = stop.recv();
            }
            Mode::Bars(mp) => {
                let bar = mp.add(ProgressBar::new(1000));
                bar.set_style(ProgressStyle::with_template("{bar:20} {msg}").expect("valid"));
                loop {
                    let (f, m) = line();
                    bar.set_position((1000.0 * f) as u64);
                    bar.set_message(m);
                    if !matches!(stop.recv_timeout(TICK), Err(RecvTimeoutError::Timeout)) {
                        break;
                    }
                }
                bar.finish_and_clear();
                mp.remove(&bar);
            }
            Mode::Log { every, .. } => {
                while let Err(RecvTimeoutError::Timeout) = stop.recv_timeout(*every) {
                    let (_, m) = line();
                    self.emit(&fit(&format!("{} {m}", timestamp())));
                }
            }
        }
    }
}

/// Bytes moved so far by the stages of `kind`.
fn kind_bytes(stages: &[Arc<StageMetrics>], kind: StageKind) -> u64 {
    stages
        .iter()
        .filter(|m| m.kind == kind)
        .map(|m| m.bytes())
        .sum()
}

/// Busy share of each kind of stage (averaged over its threads), busiest first (a log line
/// cut at 80 columns keeps the bottleneck); the helper stages (plan, prefetch, page-in) only
/// when at least 10% busy.
fn busy_shares(stages: &[Arc<StageMetrics>], el: f64) -> String {
    let kinds = [
        StageKind::Staging,
        StageKind::Lane,
        StageKind::Writeback,
        StageKind::Planner,
        StageKind::Prefetch,
        StageKind::OutPrep,
    ];
    let mut parts = Vec::new();
    for k in kinds {
        let of: Vec<f64> = stages
            .iter()
            .filter(|m| m.kind == k)
            .map(|m| m.snapshot().busy_s)
            .collect();
        if !of.is_empty() {
            let share = 100.0 * of.iter().sum::<f64>() / (of.len() as f64 * el.max(1e-9));
            // The helper stages are shown only when they matter.
            let main = matches!(
                k,
                StageKind::Staging | StageKind::Lane | StageKind::Writeback
            );
            if main || share >= 10.0 {
                parts.push((share.min(100.0), stage_label(k)));
            }
        }
    }
    // Busiest first: a line cut at 80 columns keeps the bottleneck.
    parts.sort_by(|a, b| b.0.total_cmp(&a.0));
    (parts.iter())
        .map(|(share, label)| format!("{label} {share:.0}%"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Devices' GEMM share and link rates, averaged over the lanes (GPU backends only).
fn device_line(live: &Live<'_>, el: f64) -> Option<String> {
    if !live.show_devices || live.lanes.is_empty() {
        return None;
    }
    let st: Vec<_> = live
        .lanes
        .iter()
        .map(|(_, s)| s.lock().unwrap().clone())
        .collect();
    let n = st.len() as f64;
    let gemm = 100.0 * st.iter().map(|s| s.gemm_s).sum::<f64>() / (n * el.max(1e-9));
    let gbs = |b: u64, s: f64| b as f64 / s.max(1e-9) / 1e9;
    let h2d: f64 = st.iter().map(|s| gbs(s.h2d_bytes, s.h2d_s)).sum::<f64>() / n;
    let d2h: f64 = st.iter().map(|s| gbs(s.d2h_bytes, s.d2h_s)).sum::<f64>() / n;
    Some(format!(
        "{} device(s): GEMM busy {:.0}%, upload {h2d:.1} GB/s, download {d2h:.1} GB/s",
        st.len(),
        gemm.min(100.0)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrap_breaks_at_clauses_keeps_units_and_long_words() {
        let line = format!(
            "  host memory: staging 4×16.00 KiB (peak 4), output 2×16.00 KiB (peak 2); peak {} of 2.00 GiB",
            "704.00 KiB"
        );
        let w = wrap(&line);
        let lines: Vec<&str> = w.lines().collect();
        assert_eq!(lines.len(), 2, "{w}");
        assert!(lines.iter().all(|l| l.chars().count() <= WIDTH), "{w}");
        assert!(
            lines[0].ends_with(';'),
            "breaks after the last clause that fits: {w}"
        );
        assert!(
            lines[1].starts_with("      peak 704.00 KiB"),
            "indent + 4: {w}"
        );
        // Never between a number and its unit.
        let many = vec!["12.50 GiB"; 20].join(" ");
        for l in wrap(&many).lines() {
            assert!(l.trim_start().starts_with("12.50 GiB"), "{l}");
            assert!(l.chars().count() <= WIDTH, "{l}");
        }
        // A word longer than a line stays whole; short text is unchanged.
        let long = format!("output {}", "x".repeat(100));
        assert_eq!(wrap(&long).lines().count(), 2);
        assert!(wrap(&long).contains(&"x".repeat(100)));
        assert_eq!(wrap("a\n  b"), "a\n  b");
    }

    #[test]
    fn durations_read_like_people_write_them() {
        assert_eq!(fmt_duration(None), "--");
        assert_eq!(fmt_duration(Some(f64::NAN)), "--");
        assert_eq!(fmt_duration(Some(-1.0)), "--");
        assert_eq!(fmt_duration(Some(0.14)), "0.1s");
        assert_eq!(fmt_duration(Some(9.94)), "9.9s");
        assert_eq!(fmt_duration(Some(9.96)), "10s");
        assert_eq!(fmt_duration(Some(42.4)), "42s");
        assert_eq!(fmt_duration(Some(185.0)), "3m05s");
        assert_eq!(fmt_duration(Some(3720.0)), "1h02m");
        assert_eq!(fmt_duration(Some(2.0 * 86400.0 + 3.0 * 3600.0)), "2d03h");
        assert_eq!(fmt_duration(Some(1e12)), ">99d");
        assert_eq!(fmt_flops(Some(12.34e12)), "12.3 TFLOP/s");
        assert_eq!(fmt_flops(Some(812e9)), "812 GFLOP/s");
        assert_eq!(fmt_flops(None), "-- FLOP/s");
    }

    #[test]
    fn rate_has_no_eta_until_work_is_done_then_adapts() {
        let mut r = Rate::default();
        assert_eq!(r.eta(100.0), None);
        r.sample(0.2, 0.0);
        r.sample(1.0, 0.0);
        assert_eq!(r.eta(100.0), None, "no work yet: no ETA");
        // 10 units/s for 60 s.
        for i in 2..=60 {
            r.sample(i as f64, 10.0 * i as f64);
        }
        let e = r.eta(1000.0).unwrap();
        assert!((e - 100.0).abs() < 1.0, "{e}");
        // Throughput halves: within a few time constants the ETA follows.
        for i in 61..=200 {
            r.sample(i as f64, 600.0 + 5.0 * (i - 60) as f64);
        }
        let e = r.eta(1000.0).unwrap();
        assert!((e - 200.0).abs() < 10.0, "recent rate is 5/s: ETA {e}");
    }

    #[test]
    fn a_resume_counts_only_this_runs_work() {
        // The rate sees this run's work only; before-work never enters it.
        let mut r = Rate::default();
        for i in 1..=10 {
            r.sample(i as f64, 2.0 * i as f64);
        }
        assert!((r.per_s().unwrap() - 2.0).abs() < 1e-9);
    }

    #[test]
    fn counts_take_the_noun_they_need() {
        assert_eq!(count(1, "output tile", "output tiles"), "1 output tile");
        assert_eq!(count(0, "tile", "tiles"), "0 tiles");
        assert_eq!(count(16, "tile", "tiles"), "16 tiles");
    }

    #[test]
    fn lines_fit_80_columns() {
        let v = View {
            step: 11,
            steps: 12,
            part: Some((3, 4)),
            output: "/very/long/path/to/some/output/directory/with/a/matrix/C_final_result.mgt"
                .into(),
            elapsed: 3723.0,
            frac: 0.421,
            rate: Some(123.4e12),
            eta: Some(5400.0),
            plan_eta: Some(86400.0 * 3.0),
            read_mb_s: 12345.0,
            write_mb_s: 6789.0,
            busy: "read 100% device 100% write 100% plan 100% prefetch 100% page-in 100%".into(),
            devices: Some(
                "8 device(s): GEMM busy 100%, upload 55.5 GB/s, download 55.5 GB/s".into(),
            ),
        };
        let mut all = v.log_lines();
        all.push(v.head());
        all.push(format!("{} {}", "#".repeat(24), v.numbers()));
        all.push(v.io());
        for l in all {
            assert!(
                l.chars().count() <= WIDTH,
                "{} columns: {l}",
                l.chars().count()
            );
            assert!(!l.contains("NaN") && !l.contains("inf"), "{l}");
        }
        let head = v.head();
        assert!(
            head.contains("step 12/12, part 3/4: ") && head.contains("1h02m"),
            "{head}"
        );
        // A one-step chain: the plan ETA shows while a later part remains.
        let first = View {
            steps: 1,
            step: 0,
            part: Some((1, 2)),
            ..v
        };
        assert!(first.numbers().contains("plan ETA"), "{}", first.numbers());
        let last = View {
            part: Some((2, 2)),
            ..first
        };
        assert!(!last.numbers().contains("plan ETA"), "{}", last.numbers());
    }
}
