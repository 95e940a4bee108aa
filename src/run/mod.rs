//! `run`: from a resolved plan to finished output files and a report.
//!
//! This is the control path. [`run_plan`] chooses the backend once, sizes every step before any
//! work (a plan that cannot fit fails here, untouched), checks disk space, generates missing
//! inputs, and then runs the steps in order. Each step's whole life — journal, resume,
//! checkpoints, pipeline, device failover, report — is one [`StepRun`](step::StepRun) writing
//! to a [`Target`](target::Target): the step's file, or for the small intermediates of a
//! whole-expression chain, memory ([`intermediates`]). A split run (`--shard`) is the same
//! loop with a [`Split`] (implemented by the cluster module) running this process's share of
//! each step. The library entry point ([`crate::api`]) builds the same `StepRun`s.

pub(crate) mod describe;
mod fingerprint;
mod finished;
mod inputs;
mod intermediates;
pub(crate) mod prefill;
pub mod space;
pub(crate) mod step;
pub(crate) mod target;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::backend::{self, kept, Backend};
use crate::error::{Error, Result};
use crate::pipeline::StepSources;
use crate::plan::layout::Layout;
use crate::plan::{Plan, Step};
use crate::progress::Progress;
use crate::report;
pub use crate::report::{RunReport, StepReport};
pub use describe::describe;
pub(crate) use fingerprint::{fingerprint, fingerprint_with, source_ids};
pub use fingerprint::{input_identity, input_ids};
pub(crate) use finished::{check_before_restart, damaged_input, guard_finished, journal_state};
pub use inputs::generate_missing;
pub(crate) use inputs::to_generate;
use intermediates::Held;
use step::{StepRun, Voice};
pub(crate) use target::resolve_write;
use target::{FileOutput, FileTarget};

/// How to run a plan, beyond what the plan says.
#[derive(Default)]
pub struct RunOptions {
    /// Write the run report as JSON to this file after the run.
    pub report: Option<PathBuf>,
    /// Discard journals and recompute every step from scratch.
    pub restart: bool,
    /// A flag that cancels the run when set (the binary's Ctrl-C handler); finished tiles stay
    /// in the journal, so the same command resumes.
    pub cancel: Option<&'static std::sync::atomic::AtomicBool>,
    /// Take the backend kept by an earlier run of this process when its settings are the same,
    /// and keep this run's for the next one ([`crate::backend::kept`]): the library's callers
    /// (Python, Dask tasks) that run plan after plan. The command line keeps none.
    pub keep_backend: bool,
    /// Faults to inject (tests and the GPU resilience scripts only).
    #[cfg(feature = "fault-injection")]
    pub faults: Option<crate::backend::fault::FaultConfig>,
}

/// A split run's share of each step (`run PLAN --shard`, implemented by the cluster module):
/// [`run_plan_split`] drives the plan as [`run_plan`] does and hands each step to this.
pub(crate) trait Split {
    /// Generate the plan's missing inputs once among all processes.
    fn generate(&self, plan: &Plan, progress: &Progress) -> Result<Vec<String>>;
    /// Run this process's share of `step` (each shard one [`StepRun`]); one report per shard
    /// computed.
    fn run_step(
        &self,
        cx: &PlanStep<'_>,
        backend: &mut Box<dyn Backend>,
    ) -> Result<Vec<StepReport>>;
}

/// A step of a plan being run, with what its [`StepRun`] needs from the run.
pub(crate) struct PlanStep<'a> {
    pub(crate) plan: &'a Plan,
    pub(crate) step: &'a Step,
    pub(crate) layout: &'a Layout,
    pub(crate) opts: &'a RunOptions,
    pub(crate) progress: &'a Progress,
}

impl<'a> PlanStep<'a> {
    /// The [`StepRun`] of this step into `target`, reading its operands with `sources`.
    pub(crate) fn step_run(
        &self,
        target: Box<dyn target::Target + 'a>,
        sources: &'a dyn Fn() -> Result<StepSources>,
    ) -> StepRun<'a> {
        StepRun {
            step: self.step,
            layout: self.layout,
            engine: &self.plan.engine,
            sources,
            target,
            order: self.step.order(),
            cancel: self.opts.cancel,
            voice: Voice::Plan,
            #[cfg(feature = "fault-injection")]
            faults: self.opts.faults.as_ref(),
        }
    }
}

/// The operands of `step`, opened from their files.
pub(crate) fn open_sources(step: &Step) -> Result<StepSources> {
    Held::default().sources(step)
}

/// Ignore SIGXFSZ so that exceeding the file-size limit is an EFBIG error we can report,
/// not a silent kill.
pub fn ignore_sigxfsz() {
    // SAFETY: setting a signal's disposition to SIG_IGN installs no handler code.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
}

/// Build the global rayon pool once (later calls keep the first pool).
pub fn init_threads(threads: usize) -> usize {
    let n = backend::resolve_threads(threads);
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global();
    n
}

/// The backend a run uses: the plan's (kept from an earlier run with `keep_backend`), wrapped
/// with injected faults when asked (tests only; such a backend is never kept).
fn choose_backend(plan: &Plan, opts: &RunOptions) -> Result<(Box<dyn Backend>, kept::Lease)> {
    #[cfg(feature = "fault-injection")]
    if let Some(f) = &opts.faults {
        let (b, lease) = kept::obtain(&plan.engine, prefill::backend_options(plan), false)?;
        let b = crate::backend::fault::FaultyBackend::new(b, f.clone());
        return Ok((Box::new(b), lease));
    }
    kept::obtain(
        &plan.engine,
        prefill::backend_options(plan),
        opts.keep_backend,
    )
}

/// The layout of `step` for a run that may resume it: [`Layout::new`], except that with
/// `tile = "auto"` the compute tile recorded in the output's journal is kept when it still fits.
/// `auto` picks the tile from the budgets and the number of GPUs (the row tile is evened over
/// the GPUs), so a job resumed on fewer GPUs or with another `host_memory` would otherwise get
/// another tile, a journal that no longer matches, and only `--restart` — losing every finished
/// tile. The bytes do not depend on the tile's choice beyond what the journal records, so the
/// recorded tile is as good as a fresh choice. A finished step keeps its recorded tile even
/// where it no longer fits (with `auto`, or the same tile set): nothing computes with it
/// ([`Layout::over_budget`]). `fresh` (`--restart`), or an output that is gone: the budgets' own
/// choice.
pub fn layout_for(
    origin: &std::path::Path,
    step: &Step,
    engine: &crate::plan::Engine,
    caps: &crate::backend::Caps,
    fresh: bool,
) -> Result<Layout> {
    use crate::plan::TileSpec;
    // Without its output a journal has nothing to resume (the step starts afresh:
    // `journal::read_state`), so the budgets choose; `--restart` too.
    let recorded = (!fresh && step.output.exists())
        .then(|| recorded_tile(step, engine, caps))
        .flatten();
    let l = match Layout::new(origin, step, engine, caps) {
        Ok(l) => l,
        // A finished step is skipped, not computed: its tile need not fit the budgets of now
        // (a rerun with a smaller `host_memory` was refused with only `--restart` to offer,
        // with `tile = "auto"` and a set tile alike). One whose output must be mended refuses
        // to compute with it (`FileTarget::open`).
        Err(e) => {
            return match recorded {
                Some((true, t)) if tile_allows(&engine.tile, t) => {
                    Ok(Layout::recorded(step, &with_tile(engine, t), caps, t))
                }
                _ => Err(e),
            }
        }
    };
    let Some((complete, (m, n, k))) = recorded else {
        return Ok(l);
    };
    if !matches!(engine.tile, TileSpec::Auto) || (m, n, k) == (l.tm, l.tn, l.tk) {
        return Ok(l);
    }
    let kept = with_tile(engine, (m, n, k));
    match Layout::new(origin, step, &kept, caps) {
        Ok(kept) => Ok(kept),
        Err(_) if complete => Ok(Layout::recorded(step, &kept, caps, (m, n, k))),
        Err(_) => Ok(l),
    }
}

/// Whether a step set to `tile` may keep the recorded compute tile `t`: any under `auto`, the
/// same one when set.
fn tile_allows(tile: &crate::plan::TileSpec, t: (u64, u64, u64)) -> bool {
    match *tile {
        crate::plan::TileSpec::Auto => true,
        crate::plan::TileSpec::Fixed { m, n, k } => (m, n, k) == t,
    }
}

/// `engine` with its compute tile set to `(m, n, k)`.
fn with_tile(engine: &crate::plan::Engine, (m, n, k): (u64, u64, u64)) -> crate::plan::Engine {
    crate::plan::Engine {
        tile: crate::plan::TileSpec::Fixed { m, n, k },
        ..engine.clone()
    }
}

/// The compute tile the journal of `step`'s output records, and whether it says the step is
/// complete — only a journal of this step (the inputs are compared by the run itself): another
/// expression, precision or backend on the same output path is refused anyway, and its tile
/// should not show in `plan`.
fn recorded_tile(
    step: &Step,
    engine: &crate::plan::Engine,
    caps: &crate::backend::Caps,
) -> Option<(bool, (u64, u64, u64))> {
    let j = crate::durable::journal::peek(&step.output).ok()??;
    let same = |key: &str, now: &str| j.fingerprint.get(key).is_some_and(|v| v == now);
    let same_expr = (j.fingerprint.get("expr"))
        .is_some_and(|v| crate::durable::journal::same_expr(v, &step.expr));
    if !(same_expr && same("precision", engine.precision.name()) && same("backend", caps.kind)) {
        return None;
    }
    Some((j.complete, j.compute_tile()?))
}

/// Run every step of `plan` on the backend the plan selects.
pub fn run_plan(plan: &Plan, opts: &RunOptions, progress: &Progress) -> Result<RunReport> {
    run_plan_split(plan, opts, progress, None)
}

/// [`run_plan`], or with `split` this process's share of a split run.
pub(crate) fn run_plan_split(
    plan: &Plan,
    opts: &RunOptions,
    progress: &Progress,
    split: Option<&dyn Split>,
) -> Result<RunReport> {
    init_threads(plan.engine.threads);
    let t = Instant::now();
    let (backend, lease) = choose_backend(plan, opts)?;
    crate::trace::span("start-up", "backend", t, Instant::now());
    let backend_s = t.elapsed().as_secs_f64();
    run_plan_timed(plan, backend, Some(lease), opts, progress, backend_s, split)
}

/// Run every step of `plan` on `backend` (tests pass simulated or faulty backends here).
pub fn run_plan_on(
    plan: &Plan,
    backend: Box<dyn Backend>,
    opts: &RunOptions,
    progress: &Progress,
) -> Result<RunReport> {
    run_plan_timed(plan, backend, None, opts, progress, 0.0, None)
}

/// [`run_plan_on`], with the seconds it took to start `backend` for the report; `lease` (how
/// `backend` was obtained) keeps it for the next run when it asked to and the run did not fail
/// on a device.
fn run_plan_timed(
    plan: &Plan,
    mut backend: Box<dyn Backend>,
    lease: Option<kept::Lease>,
    opts: &RunOptions,
    progress: &Progress,
    backend_s: f64,
    split: Option<&dyn Split>,
) -> Result<RunReport> {
    let reused = lease.as_ref().is_some_and(|l| l.reused);
    let out = run_plan_with(plan, &mut backend, reused, opts, progress, backend_s, split);
    // Freeing the backend here or leaving it to the process exit measured the same
    // (32768² on one H200: process − step 1.34 s against 1.36 s, docs/decisions/0015-what-a-step-leaves-behind.md).
    let t = Instant::now();
    match lease {
        Some(l) => l.finish(backend, out.as_ref().err()),
        None => drop(backend),
    }
    crate::trace::span("start-up", "backend teardown", t, Instant::now());
    out
}

/// The body of [`run_plan_timed`]: every step of `plan` on `backend` (`reused`: kept from an
/// earlier run, for the steps' reports), the report written.
fn run_plan_with(
    plan: &Plan,
    backend: &mut Box<dyn Backend>,
    reused: bool,
    opts: &RunOptions,
    progress: &Progress,
    backend_s: f64,
    split: Option<&dyn Split>,
) -> Result<RunReport> {
    let t0 = Instant::now();
    ignore_sigxfsz();
    init_threads(plan.engine.threads);
    if split.is_some() && opts.restart {
        return Err(Error::Usage(
            "--restart cannot be combined with a split run (it would race the other processes); run `mgmm-stream prepare PLAN --restart` once before the job".into(),
        ));
    }
    let layouts = prepare(plan, backend.as_ref(), opts, progress, split.is_some())?;
    let backend_name = backend.name();
    let prepare_s = t0.elapsed().as_secs_f64();
    let tg = Instant::now();
    let generated = match split {
        Some(sp) => sp.generate(plan, progress)?,
        None => generate_missing(plan, progress, opts.cancel)?,
    };
    crate::trace::span("start-up", "generate", tg, Instant::now());
    let startup_s = vec![
        ("backend".to_string(), backend_s),
        ("prepare".to_string(), prepare_s),
        ("generate".to_string(), tg.elapsed().as_secs_f64()),
    ];
    if split.is_none() {
        guard_outputs(plan, &layouts, backend.caps(), opts, progress)?;
    }
    let steps = run_steps(plan, &layouts, backend, reused, opts, progress, split)?;
    let report = RunReport {
        plan: plan.path.display().to_string(),
        backend: backend_name,
        generated,
        steps,
        wall_s: t0.elapsed().as_secs_f64(),
        process_wall_s: report::process_age_s(),
        startup_s,
    };
    if let Some(p) = &opts.report {
        write_report(p, &report)?;
    }
    Ok(report)
}

/// Lay out every step (a plan that cannot fit fails here, untouched), check the disk space,
/// and announce the plan to the progress display.
fn prepare(
    plan: &Plan,
    backend: &dyn Backend,
    opts: &RunOptions,
    progress: &Progress,
    split: bool,
) -> Result<Vec<Layout>> {
    let layouts: Vec<Layout> = plan
        .steps
        .iter()
        .map(|s| layout_for(&plan.path, s, &plan.engine, backend.caps(), opts.restart))
        .collect::<Result<_>>()?;
    space::check_space(plan, &layouts, !split)?;
    if let Some(n) = backend.note() {
        progress.note(&n);
    }
    // Warnings about how a step computes, for the steps this run may compute: a run that
    // only finds every step complete computes nothing to warn about (a trial saw the
    // `threads` warning on such a run).
    let kind = backend.caps().kind;
    let done = |i| -> Result<bool> {
        Ok(finished::step_complete(plan, &layouts, i, kind, opts)?
            || finished::chain_done(plan, &layouts, i, kind, opts)?)
    };
    let pending: Vec<bool> = (0..plan.steps.len())
        .map(|i| !done(i).unwrap_or(false))
        .collect();
    if let Some(w) = (plan.engine.threads_note()).filter(|_| pending.contains(&true)) {
        progress.note(&format!("warning: {w}"));
    }
    for ((s, l), _) in (plan.steps.iter().zip(&layouts))
        .zip(&pending)
        .filter(|x| *x.1)
    {
        if let Some(w) = l.small_tile_note(s, &plan.engine) {
            progress.note(&format!("warning: {w}"));
        }
    }
    progress.begin_plan(
        plan.steps
            .iter()
            .map(|s| {
                let flops = 2u64.saturating_mul(s.m).saturating_mul(s.n);
                (s.output_label(), flops.saturating_mul(s.k), s.index)
            })
            .collect(),
    );
    Ok(layouts)
}

/// Before an unsplit run computes anything: refuse journals of other plans or inputs (naming an
/// input that is damaged rather than changed), and with `--restart` check the inputs of every
/// finished output before it is overwritten.
fn guard_outputs(
    plan: &Plan,
    layouts: &[Layout],
    caps: &crate::backend::Caps,
    opts: &RunOptions,
    progress: &Progress,
) -> Result<()> {
    if !opts.restart {
        return finished::refuse_foreign_journals(plan, layouts, caps.kind);
    }
    check_before_restart(plan, progress)
}

/// Run the steps in order: each one's [`StepRun`] (or, split, this process's shards of it).
fn run_steps(
    plan: &Plan,
    layouts: &[Layout],
    backend: &mut Box<dyn Backend>,
    reused: bool,
    opts: &RunOptions,
    progress: &Progress,
    split: Option<&dyn Split>,
) -> Result<Vec<StepReport>> {
    let mut steps = Vec::new();
    // The chain intermediates held in memory; dropped as soon as the step reading each is done.
    let mut held = Held::default();
    for (i, (step, layout)) in plan.steps.iter().zip(layouts).enumerate() {
        let kind = backend.caps().kind;
        if finished::chain_done(plan, layouts, i, kind, opts)? {
            continue;
        }
        let cx = PlanStep {
            plan,
            step,
            layout,
            opts,
            progress,
        };
        let reps = match split {
            Some(sp) => sp.run_step(&cx, backend)?,
            None if step.output_in_memory() => {
                let complete = |j| finished::step_complete(plan, layouts, j, kind, opts);
                if !Held::needed(plan, i, &complete)? {
                    continue;
                }
                vec![held.compute(&cx, backend)?]
            }
            None => {
                let fp = fingerprint(step, layout, kind, plan.engine.precision)?;
                let file = Box::new(FileOutput(step.output.clone()));
                let target = FileTarget::new(step, layout, &plan.engine, fp, file, opts.restart);
                create_output_dir(step)?;
                let sources = || held.sources(step);
                cx.step_run(Box::new(target), &sources)
                    .run(backend, progress)?
                    .into_iter()
                    .collect()
            }
        };
        held.release(step);
        for mut rep in reps {
            rep.backend_reused = reused;
            progress.result(&report::format_summary(&rep));
            steps.push(rep);
        }
        // Split runs keep a chain's intermediates: other processes may still read them
        // (they stay next to the output, with their shards' folders, until an unsplit run of
        // the plan removes them, or by hand).
        if split.is_none() {
            finished::remove_chain_temps(step)?;
        }
    }
    Ok(steps)
}

/// Create the folder `step`'s output goes in.
fn create_output_dir(step: &Step) -> Result<()> {
    if let Some(dir) = step.output.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|err| Error::io(dir, "cannot create output directory", err))?;
    }
    Ok(())
}

/// Write the run report as JSON to `p`: whole or not at all, through a temporary file renamed
/// onto it. An existing report — a link, or a file with other hard links — has its directory
/// entry replaced; what it pointed at, or its other names, keep their bytes.
fn write_report(p: &std::path::Path, report: &RunReport) -> Result<()> {
    let s = serde_json::to_string_pretty(report).expect("report serializes");
    let tmp = crate::store::atomic::TempOutput::new(p, s.len() as u64)?;
    let mut f = tmp.file();
    std::io::Write::write_all(&mut f, s.as_bytes())
        .map_err(|e| Error::io(p, "cannot write report", e))?;
    tmp.commit()
}

pub(crate) fn default_log_every() -> Duration {
    Duration::from_secs(5)
}
