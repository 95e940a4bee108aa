//! `verify`: check a plan's outputs (the journal's record of the inputs, then Freivalds' test),
//! print PASS/FAIL per step, and with `--repair` recompute the failing tiles through the
//! journal — and the later steps computed from them — before checking again. `run --verify`
//! uses the same [`verify_plan`].

use std::path::PathBuf;

use clap::Args;

use crate::config::Settings;
use crate::error::{Error, Result};
use crate::plan::Plan;
use crate::progress::Progress;
use crate::run::{self, RunOptions};
use crate::{diagln, outln};

/// Check the outputs of a plan that has run: the journal's record of the inputs, then
/// Freivalds' test, streaming, O(n²): C·x against α·op(A)·(op(B)·x) (+ β·C0·x) for random
/// ±1 vectors x, in higher precision than the product, against the rounding a correct
/// product would have. Prints PASS/FAIL per step on stdout, exits non-zero and names the
/// failing output tiles. Exit status: 0 every step passed, 1 a step failed (or another error),
/// 3 nothing failed but nothing of an output could be checked, 75 an output is being written by
/// a run right now (try again once it has ended).
#[derive(Args, Debug)]
#[command(
    after_help = "Exit status: 0 every output passed; 1 an output failed (or an error); 3 nothing failed, but the check could judge nothing of an output (NOT CHECKED: NaN/Inf or a possible overflow everywhere, as from an output that overflowed its precision); 75 an output is being written by a run right now (try again once it has ended).\n\nExample:\n  mgmm-stream verify examples/quickstart.toml --rounds 3"
)]
pub(crate) struct VerifyArgs {
    /// The plan whose outputs to check (as `run` computed them).
    plan: PathBuf,
    /// Override an [engine] key of the plan (repeatable), e.g. --set engine.host_memory=8GiB.
    #[arg(long = "set", value_name = "engine.KEY=VALUE")]
    set: Vec<String>,
    /// Random vectors to test with.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Seed of the random vectors (another seed, another test of the same output).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Recompute the failing output tiles (through the journal) and verify again.
    #[arg(long)]
    repair: bool,
}

impl VerifyArgs {
    pub(super) fn execute(self, settings: &Settings) -> Result<()> {
        if self.rounds == 0 {
            return Err(Error::Usage(
                "--rounds 0: give at least 1 (each round is one random vector)".into(),
            ));
        }
        let p = Plan::load_with(&self.plan, &self.set)?;
        run::init_threads(p.engine.threads);
        let (rounds, seed, repair) = (self.rounds, self.seed, self.repair);
        super::refuse_job_files(&p, settings.trace.as_deref(), "MGMM_TRACE=")?;
        crate::trace::init(settings.trace.as_deref())?;
        let r = verify_plan(&p, rounds, seed, false, repair, settings.verify_times);
        crate::trace::write_at_end();
        r
    }
}

/// The steps after the one at `pos` in the plan's list that read its output and whose journals no longer match it (a repair
/// rewrote tiles they were computed from): they must be computed again. A step whose journal
/// still matches (the repaired tiles came out as they were when it ran) is left alone.
fn stale_after_repair(p: &Plan, pos: usize) -> Result<Vec<&crate::plan::Step>> {
    let step = &p.steps[pos];
    let mut backend = None;
    let mut stale = Vec::new();
    for later in p.steps.iter().skip(pos + 1) {
        // Its operands, and a chain's inputs (its last part's journal records every one, also
        // those an intermediate part read).
        let ops = [Some(&later.a), Some(&later.b), later.c0.as_ref()];
        let leaves = later.chain.iter().flat_map(|c| c.leaves.iter());
        if !ops
            .into_iter()
            .flatten()
            .chain(leaves)
            .any(|o| o.path == step.output)
            || crate::durable::journal::peek(&later.output)?.is_none()
        {
            continue;
        }
        // Made only when a later step reads the output (a GPU backend takes a while to start).
        if backend.is_none() {
            backend = Some(crate::backend::select(&p.engine)?);
        }
        let b = backend.as_deref().expect("made above");
        let layout = run::layout_for(&p.path, later, &p.engine, b.caps(), false)?;
        let fp = run::fingerprint(later, &layout, b.caps().kind, p.engine.precision)?;
        if run::journal_state(later, &fp)?.is_some_and(|(_, same)| !same) {
            stale.push(later);
        }
    }
    Ok(stale)
}

/// Verify every step; results go to stdout (one PASS/FAIL line per step), the error that
/// makes the exit status non-zero to stderr. With `repair`, failing tiles are recomputed
/// through the journal and the step is verified again. `times`: report each pass's time on
/// stderr (`MGMM_VERIFY_TIMES`).
pub(super) fn verify_plan(
    p: &Plan,
    rounds: usize,
    seed: u64,
    quiet: bool,
    repair: bool,
    times: bool,
) -> Result<()> {
    let mut failed = Vec::new();
    let mut causes: Vec<String> = Vec::new();
    let mut unchecked = Vec::new();
    let v = crate::verify::Verifier::with_times(&p.engine, rounds, seed, times);
    // A chain's intermediates are checked with its last part, under the user's step. `pos`:
    // the step's place in the plan's list, where a chain's parts are steps of their own (they
    // share their user step's `index`).
    let steps = p.steps.iter().enumerate();
    for (pos, step) in steps.filter(|(_, s)| !crate::verify::is_intermediate(s)) {
        let mut rep = v.step(step)?;
        if !quiet || !rep.pass || rep.nothing_checked() {
            outln!("{}", crate::verify::format(&rep));
        }
        let mend = rep.damaged_output.is_some();
        if repair && !rep.pass && (!rep.failing_tiles.is_empty() || mend) {
            if mend {
                diagln!(
                    "repair: mending {} through `run` (its recorded tiles are checked against the journal)",
                    step.output.display()
                );
            } else {
                // Verify judges storage tiles, `run` recomputes compute tiles: say both, so
                // "1 failing, recomputing 2" reads as what it is.
                let (n, (tm, tn)) = crate::verify::forget_failing(p, step, &rep)?;
                let (sr, sc) = rep.tile_shape;
                diagln!(
                    "repair: recomputing {n} compute tile(s) (of up to {tm}×{tn}) of {} through `run`, which hold the {} failing storage tile(s) (of up to {sr}×{sc})",
                    step.output.display(),
                    rep.failing_tiles.len()
                );
            }
            let progress = Progress::new(true, run::default_log_every());
            // This step and those before it first: a later step that reads this output was
            // computed from the tiles now redone, and is computed again below if their bytes
            // changed what its journal recorded of them.
            let mut upto = p.clone();
            upto.steps.truncate(pos + 1);
            run::run_plan(&upto, &RunOptions::default(), &progress)?;
            for later in stale_after_repair(p, pos)? {
                diagln!(
                    "repair: step {} ({}) reads {}, which the repair rewrote, and its journal no longer matches it (a .npy's modification time, or a changed tile's checksum): computing it again",
                    later.index + 1,
                    later.output.display(),
                    step.output.display()
                );
                crate::cluster::prepare::reset(&later.output)?;
            }
            if pos + 1 < p.steps.len() {
                run::run_plan(p, &RunOptions::default(), &progress)?;
            }
            rep = v.step(step)?;
            outln!("after repair:\n{}", crate::verify::format(&rep));
        }
        if !rep.pass {
            // 0: an input does not match its checksums; 1: the journal, an unfinished step;
            // 4: the journal, other inputs or plan (no tiles for either); 2: tiles (an earlier
            // step's output that does not match its checksums is repaired there).
            let of_plan = |i: &String| p.steps.iter().any(|s| s.output.display().to_string() == *i);
            let kind = match (&rep.corrupt_input, &rep.reason) {
                _ if rep.damaged_output.is_some() => 2,
                (Some(i), _) if of_plan(i) => 2,
                (Some(_), _) => 0,
                (None, Some(r)) if r.starts_with("the step is unfinished") => 1,
                (None, Some(_)) => 4,
                (None, None) => 2,
            };
            // Tiles to redo, but no journal to redo single tiles through.
            let kind = match (kind, crate::durable::journal::peek(&step.output)) {
                (2, Ok(None)) => 3,
                (k, _) => k,
            };
            // What is wrong with the output, for the last line (tiles to redo: kinds 2 and 3).
            let what = if rep.damaged_output.is_some() {
                "its header or stored checksums are damaged".to_string()
            } else if rep.corrupt_tiles > 0 {
                match rep.corrupt_tiles {
                    1 => "one of its tiles no longer matches its stored checksum".to_string(),
                    n => format!("{n} of its tiles no longer match their stored checksums"),
                }
            } else if let Some(i) = &rep.corrupt_input {
                // An input damaged in place (an earlier step's output is repaired at its step):
                // not the residuals, which were never judged (a new user's trial read "its
                // residuals are larger …" here for a chain's damaged intermediate).
                format!("its input {i} does not match the checksums stored in it")
            } else {
                "its residuals are larger than a correct product's rounding allows".to_string()
            };
            failed.push((format!("step {} ({})", rep.step, rep.output), kind));
            causes.push(what);
        } else if rep.nothing_checked() {
            unchecked.push(format!("step {} ({})", rep.step, rep.output));
        }
    }
    if failed.is_empty() {
        if unchecked.is_empty() {
            return Ok(());
        }
        // Not a pass: a script that reads only the exit status must not take it for one.
        return Err(Error::Unverified(format!(
            "nothing checked for {}: the output is NaN/Inf, or could overflow, everywhere the test looks (see NOT CHECKED above), so it is not known to be right; exit status 3",
            unchecked.join(", ")
        )));
    }
    let names: Vec<&str> = failed.iter().map(|(n, _)| n.as_str()).collect();
    // A failure found in the journal (other inputs or plan, unfinished) names no tiles: only
    // rerunning the step (or resuming it) helps; residuals that fail name tiles to repair; an
    // input that no longer matches its checksums must be restored first.
    let advice = if failed.iter().any(|(_, kind)| *kind == 0) {
        "an input does not match its stored checksums (see above): restore it, then verify again"
    } else if failed.iter().all(|(_, kind)| *kind == 1) {
        "the step is unfinished (see above): `run` resumes it (a split one: `run PLAN --shard K/S` for the shards left, as the reason says)"
    } else if failed.iter().all(|(_, kind)| *kind == 4) {
        "see the reason above: `run --restart` computes the step again from the inputs and plan as they are now"
    } else if failed.iter().all(|(_, kind)| *kind == 1 || *kind == 4) {
        "see the reasons above: `run` resumes an unfinished step (a split one: `run PLAN --shard K/S` for the shards left); `run --restart` recomputes one whose plan or inputs changed"
    } else if failed.iter().all(|(_, kind)| *kind == 3) {
        "no journal is beside it, so single tiles cannot be redone: `run --restart` recomputes the whole step"
    } else {
        "`verify --repair` recomputes the failing tiles (or mends the header or checksums), `run --restart` the whole step"
    };
    // Tiles to redo: say first what is wrong with the output (one cause, or each step's).
    let advice = match (failed.iter().all(|(_, k)| *k == 2 || *k == 3), causes.len()) {
        (true, 1) => format!("{}; {advice}", causes[0]),
        (true, _) => format!(
            "{}; {advice}",
            (failed.iter().zip(&causes))
                .map(|((n, _), c)| format!("{n}: {c}"))
                .collect::<Vec<_>>()
                .join("; ")
        ),
        _ => advice.to_string(),
    };
    Err(Error::Usage(format!(
        "verification failed for {}: {advice}",
        names.join(", ")
    )))
}
