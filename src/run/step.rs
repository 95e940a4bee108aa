//! One step, one lifecycle: [`StepRun`].
//!
//! Every way of computing a step — a plan's output file, a chain's intermediate held in
//! memory, a Python call's result array or file, one shard of a split step — goes through
//! [`StepRun::run`]. It owns the whole life of the step: open the [`Target`] (journal, resume,
//! checkpoints), say what is left, open the operands, build the [`Pipeline`], run it, and on a
//! device failure go round again on the devices left ([`Backend::without`]) — an ordinary resume
//! with one device fewer, computing the same bytes. What differs between the callers is only
//! the target ([`super::target`]) and how messages name the step ([`Voice`]).

use std::time::Instant;

use super::target::{Opened, Resume, Target};
use crate::backend::Backend;
use crate::durable::sink::TileSink;
use crate::error::{Error, Result};
use crate::pipeline::{Engines, Pipeline, RunConfig, StepSources};
use crate::plan::layout::Layout;
use crate::plan::{Engine, Step};
use crate::progress::Progress;
use crate::report::{self, StepContext, StepReport};

/// How messages speak of a step: as a plan's step (`step 2: …`, `--restart`), or as a library
/// call's product (no step number, the `restart` argument).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Voice {
    /// A step of a plan run by the binary.
    Plan,
    /// One product computed through the library ([`crate::api`], the Python package).
    Library,
}

/// One step to run to completion: what to compute, from which operands, into which target.
pub(crate) struct StepRun<'a> {
    /// The step.
    pub(crate) step: &'a Step,
    /// Its layout (tile sizes, pools).
    pub(crate) layout: &'a Layout,
    /// The `[engine]` settings it runs with.
    pub(crate) engine: &'a Engine,
    /// Opens the operands, once per attempt and only when there is work to do.
    pub(crate) sources: &'a dyn Fn() -> Result<StepSources>,
    /// Where the tiles go and what remembers them.
    pub(crate) target: Box<dyn Target + 'a>,
    /// The step's place in its plan (index, chain part), for the backend's early start.
    pub(crate) order: (usize, usize),
    /// A flag that cancels the run when set (finished tiles stay recorded).
    pub(crate) cancel: Option<&'static std::sync::atomic::AtomicBool>,
    /// How messages name the step.
    pub(crate) voice: Voice,
    /// Faults to inject on the sink side (tests only).
    #[cfg(feature = "fault-injection")]
    pub(crate) faults: Option<&'a crate::backend::fault::FaultConfig>,
}

impl StepRun<'_> {
    /// Run the step to completion on `backend`, failing over to the devices left when one
    /// fails. `None` when the target was already complete.
    pub(crate) fn run(
        mut self,
        backend: &mut Box<dyn Backend>,
        progress: &Progress,
    ) -> Result<Option<StepReport>> {
        loop {
            let tr = Instant::now();
            let opened = match self.target.open()? {
                Resume::Complete => {
                    progress.note(&self.complete_note());
                    return Ok(None);
                }
                Resume::Work(o) => o,
            };
            self.note_work(progress, &opened);
            self.note_partial(progress, &opened.notes);
            let tl = Instant::now();
            let n = self.step.index + 1;
            crate::trace::span("start-up", &format!("step {n}: resume"), tr, tl);
            let resume_s = (tl - tr).as_secs_f64();
            // Only a device that fails while the pipeline runs is failed over; an error while
            // the attempt is set up (the operands, the lanes, the pools) stops the step.
            match self.attempt(backend.as_ref(), opened, progress, resume_s)? {
                Err(err @ Error::Device { .. }) => {
                    *backend = fail_over(backend.as_ref(), err, &self, progress)?;
                }
                done => return done.map(Some),
            }
        }
    }

    /// One attempt: the pipeline over the work `opened` leaves, on `backend`. The outer error is
    /// one of setting the attempt up; the inner result is the pipeline's run and what follows.
    fn attempt(
        &mut self,
        backend: &dyn Backend,
        opened: Opened,
        progress: &Progress,
        resume_s: f64,
    ) -> Result<Result<StepReport>> {
        let (step, layout, e) = (self.step, self.layout, self.engine);
        let sources = (self.sources)()?;
        let writer = &*opened.work.writer;
        let engines = Engines::make(backend, layout, e, step, self.order, &sources, writer)?;
        let engine_times = engines.times;
        let record = opened.record;
        let sink: &dyn TileSink = record.as_ref();
        #[cfg(feature = "fault-injection")]
        let faulty = self.faulty_sink(sink);
        #[cfg(feature = "fault-injection")]
        let sink: &dyn TileSink = match &faulty {
            Some(f) => f,
            None => sink,
        };
        let cfg = RunConfig {
            cancel: self.cancel,
            ..RunConfig::from_engine(e)
        };
        // This attempt's checkpoints, not an earlier one's (a failover keeps the same store).
        let saved_before = self.target.checkpoints().map(|c| c.saved());
        let tb = Instant::now();
        let pipe = Pipeline::build_with(
            step,
            layout,
            backend,
            engines,
            opened.work,
            cfg,
            sink,
            progress,
            sources,
        )?;
        let pipe = match self.target.checkpoints() {
            Some(c) => pipe.with_checkpoints(c),
            None => pipe,
        };
        let pipe = match self.target.scope() {
            Some(tiles) => pipe.with_scope(tiles),
            None => pipe,
        };
        let build_s = tb.elapsed().as_secs_f64();
        let trun = Instant::now();
        let result = pipe.run();
        let n = step.index + 1;
        crate::trace::span("start-up", &format!("step {n}"), trun, Instant::now());
        if let Some(why) = self.target.checkpoints().and_then(|c| c.take_failure()) {
            progress.note(&format!(
                "{}checkpoints of long tiles were turned off for the rest of this run: {why}; free space there, or set engine.checkpoint_every = \"off\"",
                self.prefix()
            ));
        }
        let stats = match result {
            Ok(stats) => stats,
            Err(e) => return Ok(Err(e)),
        };
        let drop_s = (trun.elapsed().as_secs_f64() - stats.wall_s).max(0.0);
        let tf = Instant::now();
        record.complete()?;
        self.target.finished()?;
        crate::trace::span("start-up", &format!("step {n}: finish"), tf, Instant::now());
        let cx = StepContext::of(step, layout, backend, e);
        let mut rep = report::step_report(&cx, stats);
        if let (Some(c), Some(before)) = (self.target.checkpoints(), saved_before) {
            let resumed = c.resumed().len();
            rep.with_checkpoints(c.saved().since(before), e.checkpoint_every, resumed);
        }
        rep.setup_s = std::iter::once(("resume".into(), resume_s))
            .chain(engine_times.iter().map(|&(k, v)| (k.into(), v)))
            .chain([("build".into(), build_s), ("drop".into(), drop_s)])
            .collect();
        Ok(Ok(rep))
    }

    /// `step N: ` for a plan's step, nothing for a library call.
    fn prefix(&self) -> String {
        match self.voice {
            Voice::Plan => format!("step {}: ", self.step.index + 1),
            Voice::Library => String::new(),
        }
    }

    /// What to say when the target is already complete.
    fn complete_note(&self) -> String {
        let p = self.prefix();
        let out = self.step.output.display();
        match (self.target.shard_label(), self.voice) {
            (Some(label), _) => format!("{p}{label} is already done"),
            (None, Voice::Plan) => format!(
                "{p}{out} is already complete (its journal says so); skipping. Use --restart to recompute it."
            ),
            (None, Voice::Library) => format!(
                "{p}{out} is already complete (its journal says so); nothing to do. Pass restart=True to recompute it."
            ),
        }
    }

    /// Say what the step (or shard) has left to do, when that is news.
    fn note_work(&self, progress: &Progress, o: &Opened) {
        let p = self.prefix();
        let out = self.step.output.display();
        let redone = if o.bad > 0 {
            format!(
                " ({} did not match {} checksum and {} redone)",
                crate::progress::count(o.bad, "recorded tile", "recorded tiles"),
                if o.bad == 1 { "its" } else { "their" },
                if o.bad == 1 { "is" } else { "are" }
            )
        } else {
            String::new()
        };
        let done = o.work.done_before;
        if let Some(label) = self.target.shard_label() {
            let left = crate::progress::count(o.total - done, "tile", "tiles");
            progress.note(&format!("{p}{label} of {out}: {left} to compute{redone}"));
        } else if (done > 0 || o.bad > 0)
            && (self.target.journaled() || self.voice == Voice::Library)
        {
            // (A plan's intermediate in memory redoes a failed device's tiles without a word:
            // nothing of it is resumed from disk.)
            progress.note(&format!(
                "{p}resuming {out}: {done} of {} output tiles already done{redone}",
                o.total
            ));
        }
    }

    /// Say which checkpoints were ignored and why (`notes`), how many unfinished tiles resume
    /// from checkpoints, and how much of their K they hold.
    fn note_partial(&self, progress: &Progress, notes: &[String]) {
        let p = self.prefix();
        for note in notes {
            progress.note(&format!("{p}{note}"));
        }
        let Some(ckpt) = self.target.checkpoints() else {
            return;
        };
        let resumed = ckpt.resumed();
        if resumed.is_empty() {
            return;
        }
        let done: u64 = resumed.keys().map(|&s| ckpt.k_before(s)).sum();
        let of = resumed.len() as u64 * self.step.k.max(1);
        let (tiles, their) = match resumed.len() {
            1 => ("tile", "its"),
            _ => ("tiles", "their"),
        };
        progress.note(&format!(
            "{p}resuming {} partial {tiles} from checkpoints ({:.0} % of {their} K done)",
            resumed.len(),
            100.0 * done as f64 / of as f64
        ));
    }

    /// The record wrapped with the sink-side faults asked for (tests only), on journaled
    /// targets.
    #[cfg(feature = "fault-injection")]
    fn faulty_sink<'s>(
        &self,
        inner: &'s dyn TileSink,
    ) -> Option<crate::backend::fault::FaultySink<'s>> {
        self.faults
            .filter(|f| {
                self.target.journaled() && (f.write_after.is_some() || f.write_delay_ms > 0)
            })
            .map(|f| crate::backend::fault::FaultySink {
                inner,
                write_after: f.write_after.unwrap_or(u64::MAX),
                write_delay_ms: f.write_delay_ms,
                path: std::sync::Arc::new(self.step.output.clone()),
                written: Default::default(),
            })
    }
}

/// The backend without the device that `err` (an [`Error::Device`]) names, when it can go on
/// without it; else `err` itself. `run` says so as its voice speaks.
fn fail_over(
    backend: &dyn Backend,
    err: Error,
    run: &StepRun<'_>,
    progress: &Progress,
) -> Result<Box<dyn Backend>> {
    let Error::Device {
        lane, ref device, ..
    } = err
    else {
        return Err(err);
    };
    let Some(rest) = backend.without(lane) else {
        return Err(err);
    };
    let rest = rest?;
    // A plan's step: `step N: DEVICE failed (ERROR); …`; a library call: `ERROR; …`.
    let failed = match run.voice {
        Voice::Plan => format!("{}{device} failed ({err})", run.prefix()),
        Voice::Library => err.to_string(),
    };
    progress.note(&format!(
        "{failed}; redoing its unfinished tiles on {}",
        rest.name()
    ));
    Ok(rest)
}

#[cfg(all(test, feature = "fault-injection"))]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::*;
    use crate::backend::fault::{FaultConfig, FaultyBackend};
    use crate::backend::sim::SimBackend;
    use crate::run::target::MemoryTarget;
    use crate::store::memory::{MemoryMatrix, MemoryWriter};
    use crate::store::MatrixSink;

    /// A library call's failover note is the one `api::run_step` has always given: the
    /// device's error, then what goes on — no step number and no "DEVICE failed (…)", which
    /// are a plan's (`step 1: sim:1 failed (…); redoing …`).
    #[test]
    fn a_library_calls_failover_note_is_the_devices_error() {
        let dir = tempfile::tempdir().unwrap();
        for (name, rows, cols, seed) in [("A.mgt", 96, 80, 1), ("B.mgt", 80, 96, 2)] {
            let spec = crate::store::gen::GenSpec {
                rows,
                cols,
                dtype: crate::dtype::DType::F32,
                tile: (16, 16),
                dist: crate::store::gen::Dist::Normal,
                seed,
            };
            crate::store::gen::generate(&dir.path().join(name), &spec).unwrap();
        }
        let path = dir.path().join("p.toml");
        std::fs::write(
            &path,
            "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n\
             [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n\
             [engine]\nbackend = \"sim\"\ntile = 16\n",
        )
        .unwrap();
        let plan = crate::plan::Plan::load(&path).unwrap();
        let step = &plan.steps[0];
        let lane_dies = FaultConfig {
            lane: Some(1),
            gemm_after: Some(2),
            ..Default::default()
        };
        let sim = Box::new(SimBackend::with_delays(vec![0; 2], 1 << 30));
        let mut backend: Box<dyn Backend> = Box::new(FaultyBackend::new(sim, lane_dies));
        let layout = Layout::new(&plan.path, step, &plan.engine, backend.caps()).unwrap();
        let out = Arc::new(
            MemoryMatrix::new(
                &step.output,
                (step.m, step.n),
                step.out_dtype,
                layout.out_tile,
            )
            .unwrap(),
        );
        let make = || Ok(Box::new(MemoryWriter(out.clone())) as Box<dyn MatrixSink>);
        let sources = || crate::run::open_sources(step);
        let run = StepRun {
            step,
            layout: &layout,
            engine: &plan.engine,
            sources: &sources,
            target: Box::new(MemoryTarget::new(step, &layout, Box::new(make))),
            order: (0, 0),
            cancel: None,
            voice: Voice::Library,
            faults: None,
        };
        let lines = Arc::new(Mutex::new(Vec::new()));
        let progress = Progress::log_into(Duration::from_secs(3600), lines.clone());
        run.run(&mut backend, &progress).unwrap().expect("computed");
        let notes = lines.lock().unwrap().join(" ");
        let notes = notes.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            notes.contains(
                "sim:1: GEMM: injected fault (MGMM_FAULT_GEMM_AFTER); redoing its unfinished tiles on"
            ),
            "{notes}"
        );
        assert!(!notes.contains("failed ("), "{notes}");
    }
}
