//! An optional timeline of a run, for finding where a device waits.
//!
//! The report gives each stage's busy and waiting *totals*; they say which stage is the
//! bottleneck but not *when* a GPU sat idle (at the start, between tiles, at the end) or what
//! it waited for at that moment. With `MGMM_TRACE=PATH` set (read once by the command line
//! into [`crate::config::Settings`], which starts the timeline with [`init`] before a run),
//! every stage's busy and waiting intervals (recorded where [`StageMetrics`] counts them), each
//! GPU's GEMMs and copies as the device timed them (CUDA events, placed on the host clock), and
//! the phases of start-up and tear-down are kept in memory and written at the end as Chrome
//! trace-event JSON: open it in `chrome://tracing` or <https://ui.perfetto.dev>, or read it with
//! `tools/trace_gaps.py`, which prints the GPU idle gaps and what the stages did meanwhile.
//!
//! Off (the default) it costs one relaxed load per recorded interval. On, it keeps at most
//! [`MAX_EVENTS`] events (a few per tile and k-step), so even long runs stay bounded.
//!
//! [`StageMetrics`]: crate::metrics::StageMetrics

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// Events kept at most; later ones are counted and dropped.
pub(crate) const MAX_EVENTS: usize = 1 << 20;

struct Event {
    track: u32,
    name: String,
    start_us: f64,
    dur_us: f64,
}

#[derive(Default)]
struct Trace {
    tracks: HashMap<String, u32>,
    events: Vec<Event>,
    dropped: u64,
}

struct Global {
    /// Where [`write`] puts the timeline.
    path: PathBuf,
    origin: Instant,
    trace: Mutex<Trace>,
}

/// Set once by [`init`]; unset, nothing is recorded.
static GLOBAL: OnceLock<Global> = OnceLock::new();

fn global() -> Option<&'static Global> {
    GLOBAL.get()
}

/// Whether a timeline is being recorded.
pub(crate) fn enabled() -> bool {
    global().is_some()
}

/// Record that `track` (a stage, a GPU's engine, "start-up") was in state `name` from `start`
/// to `end`.
pub(crate) fn span(track: &str, name: &str, start: Instant, end: Instant) {
    let Some(g) = global() else { return };
    let us = |t: Instant| {
        if t >= g.origin {
            (t - g.origin).as_secs_f64() * 1e6
        } else {
            -((g.origin - t).as_secs_f64() * 1e6)
        }
    };
    let (s, e) = (us(start), us(end));
    let mut t = g.trace.lock().unwrap_or_else(|e| e.into_inner());
    if t.events.len() >= MAX_EVENTS {
        t.dropped += 1;
        return;
    }
    let n = t.tracks.len() as u32;
    let track = *t.tracks.entry(track.to_string()).or_insert(n);
    t.events.push(Event {
        track,
        name: name.to_string(),
        start_us: s,
        dur_us: (e - s).max(0.0),
    });
}

/// Record `name` on `track` for the `d` that ended just now (how the stages count time).
pub(crate) fn ended_now(track: &str, name: &str, d: std::time::Duration) {
    if !enabled() || d.is_zero() {
        return;
    }
    let now = Instant::now();
    span(track, name, now.checked_sub(d).unwrap_or(now), now);
}

/// Start recording a timeline to be written to `path` (`MGMM_TRACE`) at the end; `None`:
/// record nothing. Called by the command line before a run, once. Checks first that the path
/// can be written (its folder exists), so that a long run does not find out at its end that
/// its timeline is lost.
pub(crate) fn init(path: Option<&Path>) -> crate::error::Result<()> {
    let Some(path) = path else {
        return Ok(());
    };
    crate::store::fsutil::refuse_replacing(path, "MGMM_TRACE=")?;
    let dir = crate::store::fsutil::parent_dir(path);
    if !dir.is_dir() {
        return Err(crate::error::Error::Usage(format!(
            "MGMM_TRACE={}: the folder {} does not exist; create it or point MGMM_TRACE elsewhere",
            path.display(),
            dir.display()
        )));
    }
    let _ = GLOBAL.set(Global {
        path: path.to_path_buf(),
        origin: process_start().unwrap_or_else(Instant::now),
        trace: Mutex::default(),
    });
    Ok(())
}

/// For a library caller (the Python package's calls): start the timeline when `MGMM_TRACE`
/// is set — once per process; later calls add to the same timeline, whose clock starts at the
/// first call (a library caller's process start is not the job's: [`process_start`] is the
/// command line's). [`library_write`] after each call.
pub fn library_begin() -> crate::error::Result<()> {
    init(crate::config::Settings::from_env().trace.as_deref())
}

/// Write the timeline recorded so far (each call rewrites it whole); the number of events
/// dropped past [`MAX_EVENTS`]. Nothing when `MGMM_TRACE` is unset.
pub fn library_write() -> crate::error::Result<u64> {
    write()
}

/// Write what was recorded to the `MGMM_TRACE` path (Chrome trace-event JSON). Called when the
/// command ends; a later call writes everything recorded until then again.
/// Returns how many events were dropped (the buffer keeps the first [`MAX_EVENTS`]).
pub(crate) fn write() -> crate::error::Result<u64> {
    let Some(g) = global() else {
        return Ok(0);
    };
    let path = &g.path;
    let t = g.trace.lock().unwrap_or_else(|e| e.into_inner());
    let mut names: Vec<(&String, &u32)> = t.tracks.iter().collect();
    names.sort_by_key(|(_, &i)| i);
    let mut ev = Vec::with_capacity(t.events.len() + names.len());
    for (name, &id) in names {
        ev.push(
            serde_json::json!({"ph": "M", "name": "thread_name", "pid": 1, "tid": id,
            "args": {"name": name}}),
        );
        ev.push(
            serde_json::json!({"ph": "M", "name": "thread_sort_index", "pid": 1,
            "tid": id, "args": {"sort_index": id}}),
        );
    }
    for e in &t.events {
        ev.push(
            serde_json::json!({"ph": "X", "name": e.name, "pid": 1, "tid": e.track,
            "ts": e.start_us, "dur": e.dur_us}),
        );
    }
    let doc = serde_json::json!({
        "traceEvents": ev,
        "displayTimeUnit": "ms",
        "otherData": {"dropped_events": t.dropped, "origin": "process start"},
    });
    let s = serde_json::to_string(&doc).expect("trace serializes");
    // Whole or not at all, never through a link at `path` (`store::atomic`).
    let tmp = crate::store::atomic::TempOutput::new(path, s.len() as u64)?;
    std::io::Write::write_all(&mut tmp.file(), s.as_bytes())
        .map_err(|e| crate::error::Error::io(path, "cannot write the trace (MGMM_TRACE)", e))?;
    tmp.commit()?;
    Ok(t.dropped)
}

/// [`write`] where a command ends, a failure or dropped events said on stderr (the command's
/// own result stands either way).
pub(crate) fn write_at_end() {
    match write() {
        Err(e) => crate::diagln!("warning: {e}"),
        Ok(0) => {}
        Ok(n) => crate::diagln!(
            "note: the timeline (MGMM_TRACE) kept its first {MAX_EVENTS} events; {n} later ones were dropped"
        ),
    }
}

// The process clock: the origin of the timeline, and the process wall time of the run report
// (`crate::report`, which hands it on).

static PROCESS_START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

/// Mark the start of the process: the command line calls it first thing. (The kernel's
/// start time would do, but `cargo run` execs the binary inside cargo's process, so that clock
/// would include the build.)
pub(crate) fn mark_process_start() {
    let _ = PROCESS_START.set(std::time::Instant::now());
}

/// When [`mark_process_start`] was called; `None` when it was never called (a library caller,
/// such as the Python package, whose process is not the job's).
pub(crate) fn process_start() -> Option<std::time::Instant> {
    PROCESS_START.get().copied()
}

/// Seconds since [`mark_process_start`]; `None` when it was never called.
pub(crate) fn process_age_s() -> Option<f64> {
    PROCESS_START.get().map(|t| t.elapsed().as_secs_f64())
}
