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

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::backend;
use crate::durable::journal::{Journal, State};
use crate::durable::sink::TileSink;
use crate::error::{Error, Result};
pub use crate::pipeline::StepSources;
use crate::pipeline::{output_header, Engines, Pipeline, RunConfig, Work};
use crate::plan::engine::{EngineSet, EngineSource};
use crate::plan::layout::Layout;
use crate::plan::raw::RawEngine;
use crate::plan::schedule::{OutTile, Schedule};
use crate::plan::{Engine, Step};
use crate::progress::Progress;
use crate::report::{self, StepContext, StepReport};
use crate::store::{Header, MatrixSink, MatrixSource, TiledFile, TiledWriter, WriteMode};

/// Resolve `[engine]` settings given as `(key, value)` pairs (value as it would follow
/// `--set engine.KEY=`), with the same checks and messages as a plan's `[engine]` table;
/// unset keys keep their defaults. `origin` names the caller in messages.
pub fn engine_with(origin: &Path, settings: &[(&str, &str)]) -> Result<Engine> {
    let sets = settings
        .iter()
        .map(|(k, v)| EngineSet::parse(&format!("engine.{k}={v}")))
        .collect::<Result<Vec<_>>>()?;
    let mut raw = RawEngine::default();
    let from = EngineSource::apply(origin, "", &mut raw, sets);
    crate::plan::engine::resolve_engine(&raw, &from)
}

/// Where a step's result goes.
pub enum Output {
    /// A sink without a journal (an array in memory). The function makes the sink; it is
    /// called again after a device failover, and the tiles already written are not redone.
    Memory(Box<dyn Fn() -> Result<Box<dyn MatrixSink>> + Send + Sync>),
    /// A file with a journal beside it (`OUTPUT.journal`): an interrupted run resumes there.
    File(Box<dyn OutputFile>),
}

/// An output file format the journaled path can create, reopen and read back.
pub trait OutputFile: Send + Sync {
    /// Create the file afresh (replacing what is there) for `header`.
    fn create(&self, header: Header, write: WriteMode) -> Result<Box<dyn MatrixSink>>;
    /// Reopen a partially written file to write the tiles left.
    fn reopen(&self, header: Header, write: WriteMode) -> Result<Box<dyn MatrixSink>>;
    /// Open the file for reading back the tiles the journal records (their CRCs are checked).
    fn read_back(&self) -> Result<Arc<dyn MatrixSource>>;
}

/// The `.mgt` tiled file at the step's output path.
pub struct TiledOutput(pub PathBuf);

impl OutputFile for TiledOutput {
    fn create(&self, header: Header, write: WriteMode) -> Result<Box<dyn MatrixSink>> {
        Ok(Box::new(TiledWriter::create_with(&self.0, header, write)?))
    }
    fn reopen(&self, header: Header, write: WriteMode) -> Result<Box<dyn MatrixSink>> {
        Ok(Box::new(TiledWriter::reopen_with(&self.0, header, write)?))
    }
    fn read_back(&self) -> Result<Arc<dyn MatrixSource>> {
        Ok(Arc::new(TiledFile::open(&self.0)?))
    }
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
    /// Progress display, cancellation and listener.
    pub progress: &'a Progress,
}

/// Tiles finished so far, recorded in a journal or (for memory outputs) in memory.
enum Record<'a> {
    Journal(&'a Journal),
    Memory(&'a Mutex<Vec<u32>>),
}

impl TileSink for Record<'_> {
    fn tile_written(&self, tile: &OutTile, crc: u32) -> Result<()> {
        match self {
            Record::Journal(j) => j.record(tile.seq, crc),
            Record::Memory(m) => {
                m.lock().unwrap().push(tile.seq);
                Ok(())
            }
        }
    }
}

/// Run `job` to completion: `Ok(None)` when its journal says the output is already complete.
/// A device failure on a backend that can go on without the device redoes the device's
/// unfinished tiles on the rest, as `run` does.
pub fn run_step(job: StepJob<'_>) -> Result<Option<StepReport>> {
    let e = job.engine;
    crate::run::init_threads(e.threads);
    crate::run::ignore_sigxfsz();
    let mut backend = backend::select(e)?;
    if let Some(n) = backend.note() {
        job.progress.note(&n);
    }
    let layout = crate::run::layout_for(job.origin, job.step, e, backend.caps(), job.restart)?;
    let written = Mutex::new(Vec::new());
    loop {
        let Some((work, journal)) = step_work(&job, backend.as_ref(), &layout, &written)? else {
            return Ok(None);
        };
        let record = match &journal {
            Some(j) => Record::Journal(j),
            None => Record::Memory(&written),
        };
        let sources = StepSources {
            a: job.sources.a.clone(),
            b: job.sources.b.clone(),
            c0: job.sources.c0.clone(),
        };
        let engines = Engines::make(backend.as_ref(), &layout, e, (0, 0), &sources)?;
        let cfg = RunConfig::from_engine(e);
        let pipe = Pipeline::build_with(
            job.step,
            &layout,
            backend.as_ref(),
            engines,
            work,
            cfg,
            &record,
            job.progress,
            sources,
        )?;
        match pipe.run() {
            Ok(stats) => {
                if let Some(j) = &journal {
                    j.complete()?;
                }
                let cx = StepContext::of(job.step, &layout, backend.as_ref(), e);
                let rep = report::step_report(&cx, stats);
                job.progress.note(&report::format_summary(&rep));
                return Ok(Some(rep));
            }
            Err(err @ Error::Device { .. }) => {
                let Error::Device { lane, .. } = err else {
                    unreachable!()
                };
                let Some(rest) = backend.without(lane) else {
                    return Err(err);
                };
                let rest = rest?;
                job.progress.note(&format!(
                    "{err}; redoing its unfinished tiles on {}",
                    rest.name()
                ));
                drop(journal);
                backend = rest;
            }
            Err(err) => return Err(err),
        }
    }
}

/// The work left for one attempt at `job` on `backend`, and the journal that records it (none
/// for a memory output, whose finished tiles are kept in `written`). `None` when the journal
/// says the output is already complete (after saying so through the progress).
fn step_work(
    job: &StepJob<'_>,
    backend: &dyn backend::Backend,
    layout: &Layout,
    written: &Mutex<Vec<u32>>,
) -> Result<Option<(Work, Option<Journal>)>> {
    let e = job.engine;
    let header = output_header(job.step, layout);
    let total = Schedule::new(job.step, layout).tiles.len() as u32;
    let mut journal = None;
    let work = match &job.output {
        Output::Memory(make) => {
            let done = written.lock().unwrap().clone();
            let todo: Vec<u32> = (0..total).filter(|s| !done.contains(s)).collect();
            Work {
                writer: make()?,
                done_before: (total as usize - todo.len()) as u64,
                todo: Some(todo),
            }
        }
        Output::File(f) => {
            let ids = identities(job.step, &job.sources);
            let fp = crate::run::fingerprint_with(
                job.step,
                layout,
                backend.caps().kind,
                e.precision,
                &ids,
            );
            let out = &job.step.output;
            // A restart's fresh layout may differ from the one the journal records (`tile =
            // "auto"` follows the GPU count): "finished" is judged against the recorded one.
            let recorded = || -> Result<bool> {
                let kept = crate::run::layout_for(job.origin, job.step, e, backend.caps(), false)?;
                let fp = crate::run::fingerprint_with(
                    job.step,
                    &kept,
                    backend.caps().kind,
                    e.precision,
                    &ids,
                );
                Ok(crate::run::finished_for(job.step, &fp))
            };
            if job.restart && e.verify_inputs && recorded()? {
                // As `run --restart`: a finished output is not thrown away for inputs found
                // corrupt only afterwards (crate::run::check_before_restart).
                let s = &job.sources;
                let srcs = [Some(&s.a), Some(&s.b), s.c0.as_ref()];
                let srcs = srcs.into_iter().flatten().map(|a| a.as_ref());
                crate::run::inputs_intact(srcs, out, job.progress)?;
            }
            let (j, state) = Journal::open(out, &fp, job.restart, e.durable)?;
            journal = Some(j);
            // `write = "auto"` decided as for a plan's run (the budget, the dirty limit).
            let plan = crate::run::resolve_write(out, &header, e.durable, e.write, e.host_memory);
            match resume_work(f.as_ref(), job.step, layout, header, plan.mode, state)? {
                Some(w) => {
                    w.writer.release_written(plan.drop_written);
                    w
                }
                None => {
                    job.progress.note(&format!(
                        "{} is already complete (its journal says so); nothing to do. Pass restart to recompute it.",
                        out.display()
                    ));
                    return Ok(None);
                }
            }
        }
    };
    if work.done_before > 0 {
        job.progress.note(&format!(
            "resuming {}: {} of {total} output tiles already done",
            job.step.output.display(),
            work.done_before
        ));
    }
    Ok(Some((work, journal)))
}

/// (operand name, source identity) of every operand, for the journal's fingerprint.
fn identities(step: &Step, s: &StepSources) -> Vec<(String, String)> {
    let mut ids = vec![
        (format!("input {}", step.a.name), s.a.identity()),
        (format!("input {}", step.b.name), s.b.identity()),
    ];
    if let (Some(op), Some(c0)) = (&step.c0, &s.c0) {
        ids.push((format!("input {}", op.name), c0.identity()));
    }
    ids
}

/// The work a journal state leaves on `f`: `None` when the step is complete. Recorded tiles
/// are read back and kept only if their bytes still match the recorded CRC.
fn resume_work(
    f: &dyn OutputFile,
    step: &Step,
    layout: &Layout,
    header: Header,
    write: WriteMode,
    state: State,
) -> Result<Option<Work>> {
    let done = match state {
        State::Complete => return Ok(None),
        State::Partial(done, _) if !done.is_empty() => done,
        // No finished tile: the output may be half created; start afresh.
        State::Fresh | State::Partial(..) => {
            return Ok(Some(Work {
                writer: f.create(header, write)?,
                todo: None,
                done_before: 0,
            }))
        }
    };
    let writer = f.reopen(header, write)?;
    let back = f.read_back()?;
    let sched = Schedule::new(step, layout);
    let mut finished = vec![false; sched.tiles.len()];
    let mut buf = Vec::new();
    for (seq, crc) in done {
        let Some(t) = sched.tiles.get(seq as usize) else {
            continue;
        };
        buf.resize(t.block.elems() * step.out_dtype.size(), 0u8);
        back.read_block(&t.block, step.out_dtype, &mut buf)?;
        finished[seq as usize] = crate::store::tiled::par_crc32c(&buf) == crc;
    }
    writer.forget_checksums();
    let todo: Vec<u32> = (0..finished.len() as u32)
        .filter(|&i| !finished[i as usize])
        .collect();
    Ok(Some(Work {
        writer,
        done_before: (finished.len() - todo.len()) as u64,
        todo: Some(todo),
    }))
}
