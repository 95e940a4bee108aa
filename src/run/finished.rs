//! What is already done, and what must not be lost: the checks a plan's run makes across its
//! steps before any of them runs (a foreign journal refused up front, a chain whose final
//! product is complete skipped, a finished output's inputs checked before `--restart`
//! overwrites it), and the removal of a chain's intermediates once the chain is complete.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::fingerprint::{fingerprint, fingerprint_with, input_ids};
use super::RunOptions;
use crate::durable::journal::{self, Fingerprint};
use crate::error::{Error, Result};
use crate::plan::layout::Layout;
use crate::plan::{Plan, Step};
use crate::progress::Progress;
use crate::store::MatrixSource;
use crate::units::fmt_bytes;

/// Whether step `i` is an intermediate of a chain whose final product is already complete for
/// the same inputs (then it is not recomputed: its file was removed when the chain completed).
pub(crate) fn chain_done(
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
pub(crate) fn refuse_foreign_journals(plan: &Plan, layouts: &[Layout], kind: &str) -> Result<()> {
    for (step, layout) in plan.steps.iter().zip(layouts) {
        // A journal whose output is gone has nothing to resume: the step starts afresh.
        if step.output_in_memory() || !step.output.exists() {
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
            if let Some((_, e)) = damaged_input(step, &j.fingerprint) {
                return Err(e);
            }
            let path = journal::journal_path(&step.output);
            return Err(journal::foreign(&path, &j.fingerprint, &fp));
        }
    }
    Ok(())
}

/// Whether step `j`'s journal says it is complete for the same plan and inputs (never with
/// `--restart`).
pub(crate) fn step_complete(
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
    Ok(journal::peek(&step.output)?
        .map(|p| (p.complete, journal::same_fingerprint(&p.fingerprint, fp))))
}

/// `run --restart` over a step its journal calls complete would throw a good output away first
/// and only then, reading the inputs, find one of them unreadable or corrupt (its data changed
/// in place, which the journal's identity of an input does not read; or its checksum table or
/// header damaged, which makes the identity differ as if the input had been replaced). So, for
/// such steps — whatever inputs the journal recorded — every input is opened and every input
/// tile's stored checksum is checked before anything is overwritten: one read of those inputs,
/// which the step's own reads then find in the page cache when they fit, and only when a
/// finished output is at stake. Inputs that a step of this plan writes, or that it generates and
/// are missing, are recomputed anyway and are not checked. Also used by `prepare --restart`.
pub(crate) fn check_before_restart(plan: &Plan, progress: &Progress) -> Result<()> {
    let mut outputs: HashSet<&Path> = plan.steps.iter().map(|s| s.output.as_path()).collect();
    // Inputs the plan generates and that are not there yet (`prepare` generates them after this
    // check): nothing to read; the step's output is recomputed from them.
    outputs.extend(
        (plan.matrices.iter())
            .filter(|d| d.generate.is_some() && !d.path.exists())
            .map(|d| d.path.as_path()),
    );
    let mut checked = HashSet::new();
    for step in &plan.steps {
        let operands = [Some(&step.a), Some(&step.b), step.c0.as_ref()];
        let sources = || {
            let mut v = Vec::new();
            for op in operands.into_iter().flatten() {
                if op.temp || outputs.contains(op.path.as_path()) || !checked.insert(&op.path) {
                    continue;
                }
                v.push(op.open()?);
            }
            Ok(v)
        };
        guard_finished(step, sources, plan.engine.verify_inputs, progress)?;
    }
    Ok(())
}

/// Before a restart overwrites `step`'s output: when its journal says the output is finished
/// (for whatever inputs), open the inputs `sources` opens and, with `verify` (`verify_inputs`),
/// check every stored checksum of theirs. An input that cannot be opened or does not match is
/// [`Error::KeptOutput`], and the output is kept. `run --restart` (for each step, through
/// [`check_before_restart`]) and a library call with `restart` both ask here.
pub(crate) fn guard_finished(
    step: &Step,
    sources: impl FnOnce() -> Result<Vec<Arc<dyn MatrixSource>>>,
    verify: bool,
    progress: &Progress,
) -> Result<()> {
    if !finished(step) {
        return Ok(());
    }
    let kept = |e: Error| Error::KeptOutput {
        source: Box::new(e),
        kept: step.output.clone(),
    };
    let sources = sources().map_err(kept)?;
    if !verify {
        return Ok(());
    }
    inputs_intact(sources.iter().map(|s| s.as_ref()), &step.output, progress).map_err(|e| match e {
        e @ Error::Checksum { .. } => kept(e),
        e => e,
    })
}

/// Whether `step`'s output exists and its journal says it is complete (for whatever plan and
/// inputs). A journal that cannot be read promises no finished output.
fn finished(step: &Step) -> bool {
    step.output.exists() && matches!(journal::peek(&step.output), Ok(Some(p)) if p.complete)
}

/// Check every stored checksum of `sources` before the finished output `kept` is overwritten,
/// saying so (it reads each input whole); the first mismatch is the error.
fn inputs_intact<'a>(
    sources: impl IntoIterator<Item = &'a dyn MatrixSource>,
    kept: &Path,
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
        check_whole(src)?;
    }
    Ok(())
}

/// Every storage tile of `src` against its stored checksum (nothing for a file without any).
fn check_whole(src: &dyn MatrixSource) -> Result<()> {
    let (rows, cols) = src.shape();
    src.verify_block(&crate::store::Block {
        r0: 0,
        c0: 0,
        rows,
        cols,
    })
}

/// A journal written under `old` no longer matches `step`'s inputs: is one of the inputs whose
/// identity changed *damaged* rather than replaced? An input's identity includes its header and
/// its checksum table, so one flipped bit there reads like another input; but a replaced input
/// (regenerated, re-imported) still matches its own checksums, and a damaged one does not. So
/// each input whose identity changed is opened and checked whole (a read of that input, only on
/// this error path), and the first that fails is named as damaged, with what to do — instead of
/// "different inputs, rerun with --restart", which would throw the finished output away and then
/// stop on the same damage. The input's path and that error; `None`: every changed input is
/// intact (really changed).
pub(crate) fn damaged_input(step: &Step, old: &Fingerprint) -> Option<(PathBuf, Error)> {
    let ops = [Some(&step.a), Some(&step.b), step.c0.as_ref()];
    let leaves = step.chain.iter().flat_map(|c| c.leaves.iter());
    for op in ops.into_iter().flatten().chain(leaves) {
        if op.temp {
            continue;
        }
        let Ok(src) = op.open() else {
            // Unreadable: the step's own open names it.
            continue;
        };
        let was = old
            .values()
            .any(|v| journal::same_value(v, &src.identity()));
        if was {
            continue;
        }
        if let Err(e @ Error::Checksum { .. }) = check_whole(src.as_ref()) {
            let p = op.path.display();
            // A run's output (its journal beside it): the plan that computed it — an earlier
            // step of this one, or another plan — can mend it, `verify --repair` just the
            // damaged tiles.
            if matches!(journal::peek(&op.path), Ok(Some(_))) {
                let e = Error::Usage(format!(
                    "input {} is damaged, not changed: {e}. It is a run's output (its journal {} is beside it), and its stored checksums no longer match its own data, which is why the journal {} no longer recognises it. `mgmm-stream verify PLAN --repair` with the plan that computed it (this one, when an earlier step of it writes the file) recomputes just its damaged tiles, and then this step if it must; that plan's `run --restart` recomputes it whole",
                    op.name,
                    journal::journal_path(&op.path).display(),
                    journal::journal_path(&step.output).display()
                ));
                return Some((op.path.clone(), e));
            }
            let e = Error::Usage(format!(
                "input {} is damaged, not changed: {e}. Its stored checksums no longer match its own data, which is why the journal {} no longer recognises it (`info {p} --check` lists every bad tile). The finished output {} is kept: restore {p} (copy it back, regenerate or re-import it) and run again; --restart would stop on the same damage",
                op.name,
                journal::journal_path(&step.output).display(),
                step.output.display()
            ));
            return Some((op.path.clone(), e));
        }
    }
    None
}

/// After the last product of a chain: remove its intermediates, their journals, and what a
/// split run of the chain kept of them (their shards' folders: left behind, `status` called
/// such an intermediate "not yet finalized" and `finalize` failed on its removed file).
pub(crate) fn remove_chain_temps(step: &Step) -> Result<()> {
    let Some(c) = step.chain.as_ref().filter(|c| c.part == c.parts) else {
        return Ok(());
    };
    for t in &c.temps {
        for p in [t.clone(), journal::journal_path(t)] {
            match std::fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(&p, "cannot remove the chain's intermediate", e)),
            }
        }
        // A link in its place is removed, not followed.
        let dir = crate::durable::split::state_dir(t);
        crate::store::fsutil::remove_any(&dir).map_err(|e| {
            Error::io(
                &dir,
                "cannot remove the split run's state of the chain's intermediate",
                e,
            )
        })?;
    }
    Ok(())
}
