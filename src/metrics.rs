//! Per-stage counters, updated where the work happens and read by the progress display and the
//! final report: items, bytes, busy time, and time blocked waiting for input or for room
//! downstream. The stage with the largest busy share is the bottleneck. The counters live where
//! the work happens (the pipeline's stages and channels update them); the type sits at the
//! bottom of the house, importing nothing of the crate, so the progress display, the timeline
//! and the report read it without importing the pipeline.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What a stage does; reports and the progress display select stages by kind, never by name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum StageKind {
    #[default]
    Planner,
    Prefetch,
    Staging,
    /// Checks blocks the lanes copy straight from the files' pages (`engine.staging`).
    Check,
    Lane,
    OutPrep,
    Writeback,
    /// Makes written tiles durable and records them in the journal.
    Sync,
}

impl StageKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            StageKind::Planner => "planner",
            StageKind::Prefetch => "prefetch",
            StageKind::Staging => "staging",
            StageKind::Check => "check",
            StageKind::Lane => "lane",
            StageKind::OutPrep => "outprep",
            StageKind::Writeback => "writeback",
            StageKind::Sync => "sync",
        }
    }
}

#[derive(Default)]
pub(crate) struct StageMetrics {
    pub(crate) kind: StageKind,
    /// Display name: the kind, with `[i]` for one of several instances.
    pub(crate) name: String,
    busy_ns: AtomicU64,
    wait_in_ns: AtomicU64,
    wait_out_ns: AtomicU64,
    items: AtomicU64,
    bytes: AtomicU64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct StageSnapshot {
    pub(crate) kind: StageKind,
    pub(crate) name: String,
    pub(crate) busy_s: f64,
    pub(crate) wait_in_s: f64,
    pub(crate) wait_out_s: f64,
    pub(crate) items: u64,
    pub(crate) bytes: u64,
}

fn ns(d: Duration) -> u64 {
    d.as_nanos() as u64
}

impl StageMetrics {
    /// Metrics for instance `index` of `of` stages of this kind (no suffix when it is alone).
    pub(crate) fn new(kind: StageKind, index: usize, of: usize) -> Arc<StageMetrics> {
        let name = if of > 1 {
            format!("{}[{index}]", kind.name())
        } else {
            kind.name().to_string()
        };
        Arc::new(StageMetrics {
            kind,
            name,
            ..Default::default()
        })
    }
    // Each interval ends when it is counted, so it is also where the timeline
    // ([`crate::trace`]) learns of it.
    pub(crate) fn add_busy(&self, d: Duration) {
        self.busy_ns.fetch_add(ns(d), Ordering::Relaxed);
        crate::trace::ended_now(&self.name, "busy", d);
    }
    /// Time waited for room downstream so far (for [`Self::add_busy_since`]).
    pub(crate) fn waited_out(&self) -> Duration {
        Duration::from_nanos(self.wait_out_ns.load(Ordering::Relaxed))
    }
    /// Count the time since `start` as busy, less the waits for room downstream counted since
    /// then (`waited_before`: [`Self::waited_out`] at `start`), so that a stage whose work
    /// includes such waits (the device lane leasing an output buffer or holding back) does not
    /// count them twice: busy, wait-in and wait-out add up to at most the wall time.
    pub(crate) fn add_busy_since(&self, start: std::time::Instant, waited_before: Duration) {
        let waited = self.waited_out().saturating_sub(waited_before);
        self.add_busy(start.elapsed().saturating_sub(waited));
    }
    pub(crate) fn add_wait_in(&self, d: Duration) {
        self.wait_in_ns.fetch_add(ns(d), Ordering::Relaxed);
        crate::trace::ended_now(&self.name, "wait in", d);
    }
    pub(crate) fn add_wait_out(&self, d: Duration) {
        self.wait_out_ns.fetch_add(ns(d), Ordering::Relaxed);
        crate::trace::ended_now(&self.name, "wait out", d);
    }
    pub(crate) fn add_item(&self, bytes: u64) {
        self.items.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
    pub(crate) fn snapshot(&self) -> StageSnapshot {
        let s = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 * 1e-9;
        StageSnapshot {
            kind: self.kind,
            name: self.name.clone(),
            busy_s: s(&self.busy_ns),
            wait_in_s: s(&self.wait_in_ns),
            wait_out_s: s(&self.wait_out_ns),
            items: self.items.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
        }
    }
}
