//! A library entry point for callers that hold their operands themselves: the Python package
//! multiplies numpy arrays in memory, `np.memmap`s and files without writing a plan.
//!
//! [`run_step`] runs one resolved [`Step`] like `run` does — same layout, pipeline, journal,
//! resume and device failover — but reads the operands from [`MatrixSource`]s the caller opened
//! ([`StepSources`]) and writes to an [`Output`] the caller chose: a file with a journal beside
//! it (resumable: the `.mgt` writer is [`TiledOutput`]; other formats implement
//! [`OutputFile`]), or a sink in memory without one. Cancellation and progress as data come
//! through the [`Progress`] passed in ([`Progress::with_cancel`], [`Progress::with_listener`]).
//! [`engine_with`] resolves `[engine]` settings given as key/value pairs, with the plan's checks.

use std::path::Path;

use crate::backend;
use crate::error::Result;
pub use crate::pipeline::StepSources;
use crate::plan::{Engine, Step};
use crate::progress::Progress;
use crate::report::{self, StepReport};
use crate::run::step::{StepRun, Voice};
pub use crate::run::target::{FileOutput, FileOutput as TiledOutput, OutputFile};
use crate::run::target::{FileTarget, MemoryTarget, Target};
use crate::store::MatrixSink;

/// Resolve `[engine]` settings given as `(key, value)` pairs (value as it would follow
/// `--set engine.KEY=`), with the same checks and messages as a plan's `[engine]` table;
/// unset keys keep their defaults. `origin` names the caller in messages.
pub fn engine_with(origin: &Path, settings: &[(&str, &str)]) -> Result<Engine> {
    crate::plan::engine::with_settings(origin, settings)
}

/// Where a step's result goes.
pub enum Output {
    /// A sink without a journal (an array in memory). The function makes the sink; it is
    /// called again after a device failover, and the tiles already written are not redone.
    Memory(Box<dyn Fn() -> Result<Box<dyn MatrixSink>> + Send + Sync>),
    /// A file with a journal beside it (`OUTPUT.journal`): an interrupted run resumes there.
    File(Box<dyn OutputFile>),
}

/// One step to run with caller-opened operands.
pub struct StepJob<'a> {
    /// Names the caller in messages (e.g. `matmul()`); stands where a plan file would.
    pub origin: &'a Path,
    /// The `[engine]` settings the step runs with.
    pub engine: &'a Engine,
    /// The step; `step.output` is the file of an [`Output::File`] and only a label otherwise.
    pub step: &'a Step,
    /// The operands, opened by the caller.
    pub sources: StepSources,
    /// Where the product goes.
    pub output: Output,
    /// Discard the journal and recompute every tile.
    pub restart: bool,
    /// Take the backend an earlier call of this process kept when its settings are the same,
    /// and keep this call's for the next ([`crate::backend::kept`]; the report's
    /// `backend_reused`). The Python package does; [`crate::backend::kept::release`] lets it go.
    pub keep_backend: bool,
    /// Progress display, cancellation and listener.
    pub progress: &'a Progress,
}

/// Run `job` to completion: `Ok(None)` when its journal says the output is already complete.
/// A device failure on a backend that can go on without the device redoes the device's
/// unfinished tiles on the rest, as `run` does: the same [`StepRun`], with a target in memory
/// or a journaled file.
pub fn run_step(job: StepJob<'_>) -> Result<Option<StepReport>> {
    let e = job.engine;
    crate::run::init_threads(e.threads);
    crate::run::ignore_sigxfsz();
    // As `run` starts a plan's backend: the pinned pools and cuBLAS's first kernel prepared
    // while the driver comes up — no output buffers for an array the lanes will write in place
    // (decision 0021), which the sink's maker (a struct, no I/O) says.
    let out = match &job.output {
        Output::Memory(make) => {
            (make().ok()).and_then(|w| crate::pipeline::first_rect(&*w, e.precision.host_dtype()))
        }
        Output::File(_) => None,
    };
    let opts = crate::run::prefill::backend_options_for_step(
        job.origin,
        e,
        job.step,
        [&*job.sources.a, &*job.sources.b],
        out,
    );
    let t = std::time::Instant::now();
    let (mut backend, lease) = backend::kept::obtain(e, opts, job.keep_backend)?;
    let backend_s = t.elapsed().as_secs_f64();
    let reused = lease.reused;
    if let Some(n) = backend.note() {
        job.progress.note(&n);
    }
    let progress = job.progress;
    let rep = run_on(job, &mut backend);
    lease.finish(backend, rep.as_ref().err());
    let mut rep = rep?;
    if let Some(r) = &mut rep {
        r.setup_s.insert(0, ("backend".into(), backend_s));
        r.backend_reused = reused;
        progress.note(&report::format_summary(r));
    }
    Ok(rep)
}

/// [`run_step`] on `backend`: the step's layout, its target and its [`StepRun`].
fn run_on(job: StepJob<'_>, backend: &mut Box<dyn backend::Backend>) -> Result<Option<StepReport>> {
    let e = job.engine;
    let layout = crate::run::layout_for(job.origin, job.step, e, backend.caps(), job.restart)?;
    let target: Box<dyn Target> = match job.output {
        Output::Memory(make) => Box::new(MemoryTarget::new(job.step, &layout, make)),
        Output::File(file) => {
            let ids = crate::run::source_ids(job.step, &job.sources);
            let kind = backend.caps().kind;
            let fp = crate::run::fingerprint_with(job.step, &layout, kind, e.precision, &ids);
            if job.restart {
                guard_finished(job.step, e, &job.sources, job.progress)?;
            }
            Box::new(FileTarget::new(job.step, &layout, e, fp, file, job.restart))
        }
    };
    let sources = || Ok(job.sources.clone());
    let run = StepRun {
        step: job.step,
        layout: &layout,
        engine: e,
        sources: &sources,
        target,
        order: (0, 0),
        cancel: None,
        voice: Voice::Library,
        #[cfg(feature = "fault-injection")]
        faults: None,
    };
    run.run(backend, job.progress)
}

/// As `run --restart`: a finished output is not thrown away for inputs found corrupt only
/// afterwards ([`crate::run::check_before_restart`]).
fn guard_finished(step: &Step, e: &Engine, s: &StepSources, progress: &Progress) -> Result<()> {
    let srcs = || {
        Ok([Some(&s.a), Some(&s.b), s.c0.as_ref()]
            .into_iter()
            .flatten()
            .cloned()
            .collect())
    };
    crate::run::guard_finished(step, srcs, e.verify_inputs, progress)
}
