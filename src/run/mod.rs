//! `run`: from a resolved plan to finished output files and a report.
//!
//! This is the control path. [`run_plan`] chooses the backend once, sizes every step before any
//! work (a plan that cannot fit fails here, untouched), checks disk space, generates missing
//! inputs, and then runs the steps in order. Each step is a short loop: load its
//! [`ResumeState`], build a [`Pipeline`] for the work left, run it; when a device fails and the
//! backend can go on without it ([`Backend::without`]), the loop goes round again — an ordinary
//! resume with one device fewer, computing the same bytes. The small intermediates of a
//! whole-expression chain are held in memory instead ([`intermediates`]).

mod describe;
mod intermediates;
mod prefill;
mod resume;
pub(crate) use resume::resolve_write;
mod space;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::backend::{self, Backend};
use crate::durable::checkpoint::Checkpoints;
use crate::durable::journal::{Fingerprint, Journal};
use crate::durable::sink::TileSink;
use crate::error::{Error, Result};
use crate::pipeline::{self, Engines, Pipeline, RunConfig};
use crate::plan::layout::Layout;
use crate::plan::schedule::OutTile;
use crate::plan::{Plan, Precision, Step};
use crate::progress::Progress;
use crate::report::{self, StepContext};
pub use crate::report::{RunReport, StepReport};
use crate::store::gen;
use crate::units::fmt_bytes;
pub use describe::describe;
pub use resume::ResumeState;

/// How to run a plan, beyond what the plan says.
#[derive(Default)]
pub struct RunOptions {
    /// Write the run report as JSON to this file after the run.
    pub report: Option<PathBuf>,
    /// Discard journals and recompute every step from scratch.
    pub restart: bool,
    /// This process's part of a step split across processes (`None`: the whole plan).
    pub shard: Option<crate::cluster::ShardOptions>,
    /// A flag that cancels the run when set (the binary's Ctrl-C handler); finished tiles stay
    /// in the journal, so the same command resumes.
    pub cancel: Option<&'static std::sync::atomic::AtomicBool>,
    /// Faults to inject (tests and the GPU resilience scripts only).
    #[cfg(feature = "fault-injection")]
    pub faults: Option<crate::backend::fault::FaultConfig>,
}

/// Ignore SIGXFSZ so that exceeding the file-size limit is an EFBIG error we can report,
/// not a silent kill.
pub fn ignore_sigxfsz() {
    // SAFETY: setting a signal's disposition to SIG_IGN installs no handler code.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
}

/// Everything that determines a step's output bytes, for the journal.
pub(crate) fn fingerprint(
    step: &Step,
    layout: &Layout,
    kind: &str,
    p: Precision,
) -> Result<Fingerprint> {
    Ok(fingerprint_with(step, layout, kind, p, &input_ids(step)?))
}

/// [`fingerprint`] with the inputs' entries given as (key, identity) pairs, for callers that
/// opened the inputs themselves ([`crate::api`]).
pub(crate) fn fingerprint_with(
    step: &Step,
    layout: &Layout,
    kind: &str,
    p: Precision,
    ids: &[(String, String)],
) -> Fingerprint {
    let mut fp = Fingerprint::new();
    let h = pipeline::output_header(step, layout);
    fp.insert(
        "output".into(),
        format!(
            "{}×{} {} in {}×{} tiles",
            h.rows, h.cols, h.dtype, h.tile_rows, h.tile_cols
        ),
    );
    fp.insert("expr".into(), step.expr.clone());
    fp.insert("alpha".into(), format!("{:?}", step.alpha));
    fp.insert("beta".into(), format!("{:?}", step.beta));
    fp.insert("precision".into(), p.name().into());
    fp.insert("backend".into(), kind.into());
    fp.insert(
        "compute tile".into(),
        format!("{}×{}×{}", layout.tm, layout.tn, layout.tk),
    );
    for (key, id) in ids {
        fp.insert(key.clone(), id.clone());
    }
    fp
}

/// The journal fingerprint's entries for a step's inputs: each input's identity, an
/// intermediate of a chain by its path (it is determined by the chain's inputs, listed too, and
/// is gone once the chain completes).
pub fn input_ids(step: &Step) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    let ops = [Some(&step.a), Some(&step.b), step.c0.as_ref()];
    for op in ops.into_iter().flatten() {
        let id = if op.temp {
            format!(
                "intermediate {}",
                crate::store::fsutil::identity_path(&op.path).display()
            )
        } else {
            input_identity(op)?
        };
        out.push((format!("input {}", op.name), id));
    }
    if let Some(c) = &step.chain {
        for op in &c.leaves {
            out.push((format!("chain input {}", op.name), input_identity(op)?));
        }
    }
    Ok(out)
}

/// An input's identity as the journal records it (the source's own fingerprint: for .mgt the
/// path, size, header and checksum table); `verify` compares it to find inputs changed since
/// the output was computed.
pub fn input_identity(op: &crate::plan::Operand) -> Result<String> {
    Ok(op.open()?.identity())
}

/// Whether step `i` is an intermediate of a chain whose final product is already complete for
/// the same inputs (then it is not recomputed: its file was removed when the chain completed).
fn chain_done(
    plan: &Plan,
    layouts: &[Layout],
    i: usize,
    kind: &str,
    opts: &RunOptions,
) -> Result<bool> {
    let step = &plan.steps[i];
    let Some(c) = step.chain.as_ref().filter(|c| c.part < c.parts) else {
        return Ok(false);
    };
    step_complete(plan, layouts, i + c.parts - c.part, kind, opts)
}

/// Refuse, before anything is computed, a step whose journal is from another plan, other
/// inputs or another backend: the step itself refuses it when its turn comes
/// (`Journal::open`), but only after the steps before it have run — a chain's whole first part,
/// say. A step whose inputs are not there yet (an earlier step makes them) is left to that
/// check.
fn refuse_foreign_journals(plan: &Plan, layouts: &[Layout], kind: &str) -> Result<()> {
    use crate::durable::journal;
    for (step, layout) in plan.steps.iter().zip(layouts) {
        if step.output_in_memory() {
            continue;
        }
        let Some(j) = journal::peek(&step.output)? else {
            continue;
        };
        let Ok(ids) = input_ids(step) else {
            continue;
        };
        let fp = fingerprint_with(step, layout, kind, plan.engine.precision, &ids);
        if !journal::same_fingerprint(&j.fingerprint, &fp) {
            let path = journal::journal_path(&step.output);
            return Err(journal::foreign(&path, &j.fingerprint, &fp));
        }
    }
    Ok(())
}

/// Whether step `j`'s journal says it is complete for the same plan and inputs (never with
/// `--restart`).
fn step_complete(
    plan: &Plan,
    layouts: &[Layout],
    j: usize,
    kind: &str,
    opts: &RunOptions,
) -> Result<bool> {
    if opts.restart {
        return Ok(false);
    }
    let fp = fingerprint(&plan.steps[j], &layouts[j], kind, plan.engine.precision)?;
    Ok(journal_state(&plan.steps[j], &fp)? == Some((true, true)))
}

/// What `step`'s journal says against the fingerprint `fp` of the plan and inputs now:
/// `None` without a journal, else (complete, same fingerprint).
pub(crate) fn journal_state(step: &Step, fp: &Fingerprint) -> Result<Option<(bool, bool)>> {
    Ok(crate::durable::journal::peek(&step.output)?.map(|p| {
        (
            p.complete,
            crate::durable::journal::same_fingerprint(&p.fingerprint, fp),
        )
    }))
}

/// `run --restart` over a step its journal calls complete for these very inputs would throw a
/// good output away first and only then, reading the inputs, find one of them corrupt (its data
/// changed in place: the journal's identity of an input does not read the data). So, for such
/// steps, every input tile's stored checksum is checked before anything is overwritten — one
/// read of those inputs, which the step's own reads then find in the page cache when they fit,
/// and only when a finished output is at stake. Inputs that a step of this plan writes are
/// recomputed anyway and are not checked. Also used by `prepare --restart`.
pub(crate) fn check_before_restart(
    plan: &Plan,
    layouts: &[Layout],
    kind: &str,
    progress: &Progress,
) -> Result<()> {
    if !plan.engine.verify_inputs {
        return Ok(());
    }
    let outputs: std::collections::HashSet<&std::path::Path> =
        plan.steps.iter().map(|s| s.output.as_path()).collect();
    let mut checked = std::collections::HashSet::new();
    for (step, layout) in plan.steps.iter().zip(layouts) {
        // Inputs that cannot be identified promise no finished output.
        let Ok(fp) = fingerprint(step, layout, kind, plan.engine.precision) else {
            continue;
        };
        if !finished_for(step, &fp) {
            continue;
        }
        let operands = [Some(&step.a), Some(&step.b), step.c0.as_ref()];
        for op in operands.into_iter().flatten() {
            if op.temp || outputs.contains(op.path.as_path()) || !checked.insert(&op.path) {
                continue;
            }
            inputs_intact([op.open()?.as_ref()], &step.output, progress)?;
        }
    }
    Ok(())
}

/// Whether `step`'s journal says its output is complete for the fingerprint `fp` (the plan and
/// the inputs as they are now). A journal that cannot be read promises no finished output.
pub(crate) fn finished_for(step: &Step, fp: &Fingerprint) -> bool {
    matches!(journal_state(step, fp), Ok(Some((true, true))))
}

/// Check every stored checksum of `sources` before the finished output `kept` is overwritten;
/// a mismatch is [`Error::KeptOutput`].
pub(crate) fn inputs_intact<'a>(
    sources: impl IntoIterator<Item = &'a dyn crate::store::MatrixSource>,
    kept: &std::path::Path,
    progress: &Progress,
) -> Result<()> {
    for src in sources.into_iter().filter(|s| s.checksum_tile().is_some()) {
        // A read of the whole input (from disk when it is not cached): say why it happens.
        progress.note(&format!(
            "restart: checking {} ({}) against its stored checksums before {}, which is complete, is overwritten",
            src.path().display(),
            fmt_bytes(src.shape().0 * src.shape().1 * src.dtype().size() as u64),
            kept.display()
        ));
        let (rows, cols) = src.shape();
        let all = crate::store::Block {
            r0: 0,
            c0: 0,
            rows,
            cols,
        };
        match src.verify_block(&all) {
            Err(e @ Error::Checksum { .. }) => {
                return Err(Error::KeptOutput {
                    source: Box::new(e),
                    kept: kept.to_path_buf(),
                })
            }
            r => r?,
        }
    }
    Ok(())
}

/// After the last product of a chain: remove its intermediates and their journals.
fn remove_chain_temps(step: &Step) -> Result<()> {
    let Some(c) = step.chain.as_ref().filter(|c| c.part == c.parts) else {
        return Ok(());
    };
    for t in &c.temps {
        for p in [t.clone(), crate::durable::journal::journal_path(t)] {
            match std::fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(&p, "cannot remove the chain's intermediate", e)),
            }
        }
    }
    Ok(())
}

struct JournalSink<'a>(&'a Journal);
impl TileSink for JournalSink<'_> {
    fn tile_written(&self, tile: &OutTile, crc: u32) -> Result<()> {
        self.0.record(tile.seq, crc)
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

/// The declared inputs that are missing and have a `generate` spec, with their folders created.
pub(crate) fn to_generate(
    plan: &Plan,
) -> Result<Vec<(&crate::plan::MatrixDecl, &crate::store::gen::GenSpec)>> {
    let mut out = Vec::new();
    for d in &plan.matrices {
        let Some(spec) = &d.generate else { continue };
        if d.path.exists() {
            continue;
        }
        if let Some(dir) = d.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| Error::io(dir, "cannot create directory", e))?;
        }
        out.push((d, spec));
    }
    Ok(out)
}

/// Generate every declared input that is missing and has a `generate` spec.
pub fn generate_missing(
    plan: &Plan,
    progress: &Progress,
    cancel: Option<&std::sync::atomic::AtomicBool>,
) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for (d, spec) in to_generate(plan)? {
        let t = Instant::now();
        let h = crate::store::Header::new(
            spec.dtype,
            spec.rows,
            spec.cols,
            spec.tile.0,
            spec.tile.1,
            true,
        );
        let done = std::sync::atomic::AtomicU64::new(0);
        let label = format!("generating {}", d.path.display());
        let bytes = progress.job(&label, h.data_end() - h.data_offset, &done, || {
            gen::generate_counted(&d.path, spec, &done, cancel)
        })?;
        progress.note(&format!(
            "generated {} ({}×{} {}, {:?}, seed {}): {} in {:.2} s",
            d.path.display(),
            spec.rows,
            spec.cols,
            spec.dtype,
            spec.dist,
            spec.seed,
            fmt_bytes(bytes),
            t.elapsed().as_secs_f64()
        ));
        out.push(d.path.display().to_string());
    }
    Ok(out)
}

/// The backend a run uses: the plan's, wrapped with injected faults when asked (tests only).
fn choose_backend(plan: &Plan, _opts: &RunOptions) -> Result<Box<dyn Backend>> {
    let b = backend::select_with(&plan.engine, prefill::backend_options(plan))?;
    #[cfg(feature = "fault-injection")]
    if let Some(f) = &_opts.faults {
        return Ok(Box::new(crate::backend::fault::FaultyBackend::new(
            b,
            f.clone(),
        )));
    }
    Ok(b)
}

/// The layout of `step` for a run that may resume it: [`Layout::new`], except that with
/// `tile = "auto"` the compute tile recorded in the output's journal is kept when it still fits.
/// `auto` picks the tile from the budgets and the number of GPUs (the row tile is evened over
/// the GPUs), so a job resumed on fewer GPUs or with another `host_memory` would otherwise get
/// another tile, a journal that no longer matches, and only `--restart` — losing every finished
/// tile. The bytes do not depend on the tile's choice beyond what the journal records, so the
/// recorded tile is as good as a fresh choice. `fresh` (`--restart`): the budgets' own choice.
pub fn layout_for(
    origin: &std::path::Path,
    step: &Step,
    engine: &crate::plan::Engine,
    caps: &crate::backend::Caps,
    fresh: bool,
) -> Result<Layout> {
    let l = Layout::new(origin, step, engine, caps)?;
    if fresh || !matches!(engine.tile, crate::plan::TileSpec::Auto) {
        return Ok(l);
    }
    let Ok(Some(j)) = crate::durable::journal::peek(&step.output) else {
        return Ok(l);
    };
    // Only a journal of this step (the inputs are compared by the run itself): another
    // expression, precision or backend on the same output path is refused anyway, and its tile
    // should not show in `plan`.
    let same = |key: &str, now: &str| j.fingerprint.get(key).is_some_and(|v| v == now);
    if !(same("expr", &step.expr)
        && same("precision", engine.precision.name())
        && same("backend", caps.kind))
    {
        return Ok(l);
    }
    let recorded: Option<Vec<u64>> = (j.fingerprint.get("compute tile"))
        .and_then(|t| t.split('×').map(|x| x.parse().ok()).collect());
    let Some(&[m, n, k]) = recorded.as_deref() else {
        return Ok(l);
    };
    if (m, n, k) == (l.tm, l.tn, l.tk) {
        return Ok(l);
    }
    let kept = crate::plan::Engine {
        tile: crate::plan::TileSpec::Fixed { m, n, k },
        ..engine.clone()
    };
    Ok(Layout::new(origin, step, &kept, caps).unwrap_or(l))
}

/// A temporary file beside report `path`: `NAME.<pid>.<what>`.
pub(crate) fn report_temp(path: &std::path::Path, what: &str) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{}.{what}", std::process::id()));
    path.with_file_name(name)
}

/// Run every step of `plan` on the backend the plan selects.
pub fn run_plan(plan: &Plan, opts: &RunOptions, progress: &Progress) -> Result<RunReport> {
    init_threads(plan.engine.threads);
    let t = Instant::now();
    let backend = choose_backend(plan, opts)?;
    crate::trace::span("start-up", "backend", t, Instant::now());
    let backend_s = t.elapsed().as_secs_f64();
    run_plan_timed(plan, backend, opts, progress, backend_s)
}

/// Run every step of `plan` on `backend` (tests pass simulated or faulty backends here).
pub fn run_plan_on(
    plan: &Plan,
    backend: Box<dyn Backend>,
    opts: &RunOptions,
    progress: &Progress,
) -> Result<RunReport> {
    run_plan_timed(plan, backend, opts, progress, 0.0)
}

/// [`run_plan_on`], with the seconds it took to start `backend` for the report.
fn run_plan_timed(
    plan: &Plan,
    mut backend: Box<dyn Backend>,
    opts: &RunOptions,
    progress: &Progress,
    backend_s: f64,
) -> Result<RunReport> {
    let t0 = Instant::now();
    ignore_sigxfsz();
    init_threads(plan.engine.threads);
    let layouts: Vec<Layout> = plan
        .steps
        .iter()
        .map(|s| layout_for(&plan.path, s, &plan.engine, backend.caps(), opts.restart))
        .collect::<Result<_>>()?;
    space::check_space(plan, &layouts, opts.shard.is_none())?;
    if let Some(n) = backend.note() {
        progress.note(&n);
    }
    let backend_name = backend.name();
    if opts.shard.is_some() && opts.restart {
        return Err(Error::Usage(
            "--restart cannot be combined with a split run (it would race the other processes); run `mgmm-stream prepare PLAN --restart` once before the job".into(),
        ));
    }
    progress.begin_plan(
        plan.steps
            .iter()
            .map(|s| {
                let flops = 2u64.saturating_mul(s.m).saturating_mul(s.n);
                (
                    s.output.display().to_string(),
                    flops.saturating_mul(s.k),
                    s.index,
                )
            })
            .collect(),
    );
    let prepare_s = t0.elapsed().as_secs_f64();
    let tg = Instant::now();
    let generated = match &opts.shard {
        Some(sh) => crate::cluster::generate_shared(plan, sh, progress)?,
        None => generate_missing(plan, progress, opts.cancel)?,
    };
    crate::trace::span("start-up", "generate", tg, Instant::now());
    let startup_s = vec![
        ("backend".to_string(), backend_s),
        ("prepare".to_string(), prepare_s),
        ("generate".to_string(), tg.elapsed().as_secs_f64()),
    ];
    if opts.shard.is_none() && !opts.restart {
        refuse_foreign_journals(plan, &layouts, backend.caps().kind)?;
    }
    if opts.shard.is_none() && opts.restart {
        // Against the tile the journals record (the fresh layouts may differ: `tile = "auto"`
        // depends on the GPU count), so a finished output is still recognised as finished.
        let recorded: Vec<Layout> = (plan.steps.iter())
            .map(|s| layout_for(&plan.path, s, &plan.engine, backend.caps(), false))
            .collect::<Result<_>>()?;
        check_before_restart(plan, &recorded, backend.caps().kind, progress)?;
    }
    let mut steps = Vec::new();
    // The chain intermediates held in memory; dropped as soon as the step reading each is done.
    let mut held = intermediates::Held::default();
    for (i, (step, layout)) in plan.steps.iter().zip(&layouts).enumerate() {
        let kind = backend.caps().kind;
        if chain_done(plan, &layouts, i, kind, opts)? {
            continue;
        }
        let reps = match &opts.shard {
            Some(sh) => crate::cluster::run_step_shards(
                plan,
                step,
                layout,
                &mut backend,
                opts,
                sh,
                progress,
            )?,
            None if intermediates::Held::in_memory(step, opts) => {
                let complete = |j| step_complete(plan, &layouts, j, kind, opts);
                if !intermediates::Held::needed(plan, opts, i, &complete)? {
                    continue;
                }
                vec![held.compute(plan, step, layout, &mut backend, opts, progress)?]
            }
            None => run_step_with(
                plan,
                step,
                layout,
                &mut backend,
                opts,
                progress,
                None,
                &held,
            )?
            .into_iter()
            .collect(),
        };
        held.release(step);
        for rep in reps {
            progress.result(&report::format_summary(&rep));
            steps.push(rep);
        }
        // Split runs keep a chain's intermediates: other processes may still read them
        // (they stay next to the output until an unsplit run of the plan, or by hand).
        if opts.shard.is_none() {
            remove_chain_temps(step)?;
        }
    }
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
        let s = serde_json::to_string_pretty(&report).expect("report serializes");
        if p.exists() {
            // An existing report (or a link to one) is written through, as the check before
            // the run tried: its folder need not be writable.
            std::fs::write(p, s).map_err(|e| Error::io(p, "cannot write report", e))?;
        } else {
            // A new one appears whole or not at all: a temporary file renamed onto it.
            let tmp = report_temp(p, "partial");
            std::fs::write(&tmp, s)
                .and_then(|_| std::fs::rename(&tmp, p))
                .map_err(|e| {
                    let _ = std::fs::remove_file(&tmp);
                    Error::io(p, "cannot write report", e)
                })?;
        }
    }
    // Freeing the backend here or leaving it to the process exit measured the same
    // (32768² on one H200: process − step 1.34 s against 1.36 s, BENCHMARKS §14).
    let t = Instant::now();
    drop(backend);
    crate::trace::span("start-up", "backend teardown", t, Instant::now());
    Ok(report)
}

/// Run one step — or with `shard`, one shard of it — to completion (`None` when it was
/// already complete), failing over to the remaining devices when one fails.
pub(crate) fn run_step(
    plan: &Plan,
    step: &Step,
    layout: &Layout,
    backend: &mut Box<dyn Backend>,
    opts: &RunOptions,
    progress: &Progress,
    shard: Option<&crate::cluster::ShardCtx>,
) -> Result<Option<StepReport>> {
    let none = intermediates::Held::default();
    run_step_with(plan, step, layout, backend, opts, progress, shard, &none)
}

/// [`run_step`] reading the chain intermediates in `held` from memory.
#[allow(clippy::too_many_arguments)]
fn run_step_with(
    plan: &Plan,
    step: &Step,
    layout: &Layout,
    backend: &mut Box<dyn Backend>,
    opts: &RunOptions,
    progress: &Progress,
    shard: Option<&crate::cluster::ShardCtx>,
    held: &intermediates::Held,
) -> Result<Option<StepReport>> {
    let e = &plan.engine;
    if let Some(dir) = step.output.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|err| Error::io(dir, "cannot create output directory", err))?;
    }
    let fp = fingerprint(step, layout, backend.caps().kind, e.precision)?;
    let n = step.index + 1;
    let mut ckpt = Checkpoints::new(&step.output, &fp, e.checkpoint_every, layout, step.k);
    loop {
        let tr = Instant::now();
        let (journal, state) = load_state(step, layout, &fp, opts, e, shard, &mut ckpt)?;
        let (work, total, bad, notes) = match (state, shard) {
            (ResumeState::Complete, Some(ctx)) => {
                progress.note(&format!("step {n}: {} is already done", ctx.label));
                return Ok(None);
            }
            (ResumeState::Complete, None) => {
                progress.note(&format!(
                    "step {n}: {} is already complete (its journal says so); skipping. Use --restart to recompute it.",
                    step.output.display()
                ));
                return Ok(None);
            }
            (st, _) => st.into_work().expect("not complete"),
        };
        note_work(progress, step, shard, &work, total, bad);
        note_partial(progress, step, &notes, &ckpt);
        let tl = Instant::now();
        crate::trace::span("start-up", &format!("step {n}: resume"), tr, tl);
        let resume_s = (tl - tr).as_secs_f64();
        let sources = held.sources(step)?;
        let engines = Engines::make(backend.as_ref(), layout, e, step.order(), &sources)?;
        let engine_times = engines.times;
        let journal_sink = JournalSink(&journal);
        #[cfg(feature = "fault-injection")]
        let faulty = faulty_sink(opts, step, &journal_sink);
        #[cfg(feature = "fault-injection")]
        let sink: &dyn TileSink = match &faulty {
            Some(f) => f,
            None => &journal_sink,
        };
        #[cfg(not(feature = "fault-injection"))]
        let sink: &dyn TileSink = &journal_sink;
        let cfg = RunConfig {
            cancel: opts.cancel,
            ..RunConfig::from_engine(e)
        };
        let tb = Instant::now();
        let pipe = Pipeline::build_with(
            step,
            layout,
            backend.as_ref(),
            engines,
            work,
            cfg,
            sink,
            progress,
            sources,
        )?
        .with_checkpoints(&ckpt);
        let pipe = match shard {
            Some(ctx) => pipe.with_scope(ctx.tiles.clone()),
            None => pipe,
        };
        let build_s = tb.elapsed().as_secs_f64();
        let trun = Instant::now();
        let result = pipe.run();
        crate::trace::span("start-up", &format!("step {n}"), trun, Instant::now());
        if let Some(why) = ckpt.take_failure() {
            progress.note(&format!(
                "step {n}: checkpoints of long tiles were turned off for the rest of this run: {why}; free space there, or set engine.checkpoint_every = \"off\""
            ));
        }
        match result {
            Ok(stats) => {
                let drop_s = (trun.elapsed().as_secs_f64() - stats.wall_s).max(0.0);
                journal.complete()?;
                // Every tile is recorded: no checkpoint of this step (or shard) is needed.
                match shard {
                    None => ckpt.discard_all()?,
                    Some(_) => ckpt.remove_dir_if_empty(),
                }
                let cx = StepContext::of(step, layout, backend.as_ref(), e);
                let mut rep = report::step_report(&cx, stats);
                rep.setup_s = std::iter::once(("resume".into(), resume_s))
                    .chain(engine_times.iter().map(|&(k, v)| (k.into(), v)))
                    .chain([("build".into(), build_s), ("drop".into(), drop_s)])
                    .collect();
                return Ok(Some(rep));
            }
            // A device failed: if the backend can go on without it, its unfinished tiles are
            // redone on the rest. The journal holds every tile written so far, so this is an
            // ordinary resume with one device fewer; tiles are computed the same way on any
            // device of the run.
            Err(err @ Error::Device { .. }) => {
                drop(journal);
                *backend = fail_over(backend.as_ref(), err, n, progress)?;
            }
            Err(err) => return Err(err),
        }
    }
}

/// Open the journal of `step` (or of its shard) and decide what is left to do, and which
/// tiles resume from their checkpoints in `ckpt`.
fn load_state(
    step: &Step,
    layout: &Layout,
    fp: &Fingerprint,
    opts: &RunOptions,
    e: &crate::plan::Engine,
    shard: Option<&crate::cluster::ShardCtx>,
    ckpt: &mut Checkpoints,
) -> Result<(Journal, ResumeState)> {
    match shard {
        Some(ctx) => ResumeState::load_shard(step, layout, fp, e.durable, ctx, ckpt),
        None => ResumeState::load(
            step,
            layout,
            fp,
            opts.restart,
            e.durable,
            e.write,
            e.host_memory,
            ckpt,
        ),
    }
}

/// The backend without the device that `err` (an [`Error::Device`]) names, when it can go on
/// without it; else `err` itself.
fn fail_over(
    backend: &dyn Backend,
    err: Error,
    n: usize,
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
    progress.note(&format!(
        "step {n}: {device} failed ({err}); redoing its unfinished tiles on {}",
        rest.name()
    ));
    Ok(rest)
}

/// Say what a step (or shard) has left to do, when that is news.
fn note_work(
    progress: &Progress,
    step: &Step,
    shard: Option<&crate::cluster::ShardCtx>,
    work: &pipeline::Work,
    total: u64,
    bad: u64,
) {
    let n = step.index + 1;
    let redone = if bad > 0 {
        format!(
            " ({} did not match {} checksum and {} redone)",
            crate::progress::count(bad, "recorded tile", "recorded tiles"),
            if bad == 1 { "its" } else { "their" },
            if bad == 1 { "is" } else { "are" }
        )
    } else {
        String::new()
    };
    if let Some(ctx) = shard {
        progress.note(&format!(
            "step {n}: {} of {}: {} to compute{redone}",
            ctx.label,
            step.output.display(),
            crate::progress::count(total - work.done_before, "tile", "tiles"),
        ));
    } else if work.done_before > 0 || bad > 0 {
        progress.note(&format!(
            "step {n}: resuming {}: {} of {total} output tiles already done{redone}",
            step.output.display(),
            work.done_before,
        ));
    }
}

/// Say which checkpoints were ignored and why (`notes`), how many unfinished tiles resume from
/// checkpoints, and how much of their K they hold.
fn note_partial(progress: &Progress, step: &Step, notes: &[String], ckpt: &Checkpoints) {
    for note in notes {
        progress.note(&format!("step {}: {note}", step.index + 1));
    }
    let resumed = ckpt.resumed();
    if resumed.is_empty() {
        return;
    }
    let done: u64 = resumed.keys().map(|&s| ckpt.k_before(s)).sum();
    let of = resumed.len() as u64 * step.k.max(1);
    let tiles = if resumed.len() == 1 { "tile" } else { "tiles" };
    progress.note(&format!(
        "step {}: resuming {} partial {tiles} from checkpoints ({:.0} % of their K done)",
        step.index + 1,
        resumed.len(),
        100.0 * done as f64 / of as f64
    ));
}

/// The journal sink wrapped with the sink-side faults asked for (tests only).
#[cfg(feature = "fault-injection")]
fn faulty_sink<'a>(
    opts: &RunOptions,
    step: &Step,
    inner: &'a JournalSink<'a>,
) -> Option<crate::backend::fault::FaultySink<'a>> {
    opts.faults
        .as_ref()
        .filter(|f| f.write_after.is_some() || f.write_delay_ms > 0)
        .map(|f| crate::backend::fault::FaultySink {
            inner,
            write_after: f.write_after.unwrap_or(u64::MAX),
            write_delay_ms: f.write_delay_ms,
            path: std::sync::Arc::new(step.output.clone()),
            written: Default::default(),
        })
}

pub(crate) fn default_log_every() -> Duration {
    Duration::from_secs(5)
}
