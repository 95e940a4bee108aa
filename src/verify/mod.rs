//! `verify`: is a finished output the product its plan describes? Streaming, O(n²) instead of
//! O(n³), more precise than the product, and calibrated to the rounding a correct product of
//! this precision has — so it catches small corruptions without crying wolf.
//!
//! Order of checks: the journal first (an input or the plan changed since the output was
//! computed, or the step never finished: a clear failure naming what, no residual needed);
//! then Freivalds' test with row residuals `C·x − α·op(A)·(op(B)·x) − β·C0·x` per output row
//! and column group (x = random ±1, [`pass`]), each compared with the tolerance of
//! [`model`]. NaN/Inf follow the product's IEEE rules: a row of op(A) or a column of op(B)
//! holding NaN/Inf, and a cell whose C0 holds one (β ≠ 0), may legitimately be NaN/Inf and are
//! left out, never multiplied; `β = 0` never reads C0 and `α = 0` never reads A or B. On a
//! failure the column residuals `yᵀ·C − (yᵀ·op(A))·op(B) − β·yᵀ·C0` (the same test on Cᵀ) name
//! the columns, and the failing storage tiles of the output are listed; `repair` recomputes
//! just those through the journal.

pub mod componentwise;
mod device;
mod kernel;
pub(crate) mod model;
pub(crate) mod pass;
mod view;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;

use crate::dtype::DType;
use crate::durable::journal;
use crate::error::{Error, Result};
use crate::plan::{Operand, Plan, Precision, Step};
use crate::store::gen::Rng;
use crate::store::{open_source, MatrixSource};
pub(crate) use device::Device;
use model::{Cell, Model};
use pass::{Dd, Groups, Op, Sums};

/// Residual groups wanted per output row (and per column for the column test).
const GROUPS: usize = 32;
/// Cells named in the report at most.
const NAMED: usize = 64;
/// Rows or columns set aside that the report names at most.
pub const NAMED_LINES: usize = 8;

#[derive(Clone, Debug, Serialize)]
/// The verdict of `verify` on one step, with the numbers behind it.
pub struct VerifyReport {
    /// Step number (1-based).
    pub step: usize,
    /// Output file.
    pub output: String,
    /// Rounds of the randomized test.
    pub rounds: usize,
    /// Whether the output passed.
    pub pass: bool,
    /// Why it failed before any residual was computed (journal: changed input, unfinished).
    pub reason: Option<String>,
    /// Largest |residual| / threshold (≤ 1 passes); 0 when every residual is exactly 0 (then
    /// `worst_row`, `residual` and `allowed` name none: `format` says so instead of a 0/0).
    pub max_ratio: f64,
    /// Largest |residual| / σ of the statistical model.
    pub max_sigmas: f64,
    /// Row of the largest residual ratio.
    pub worst_row: u64,
    /// That row's residual.
    pub residual: f64,
    /// That row's allowed residual.
    pub allowed: f64,
    /// Some residual exceeds the rigorous worst-case bound: certainly not a correct product.
    pub certainly_wrong: bool,
    /// (row, column group) cells of the row test that fail.
    pub failing_cells: usize,
    /// Output storage tiles (tile row, tile column) that fail.
    pub failing_tiles: Vec<(u64, u64)>,
    /// Output storage tiles whose data no longer matches the checksums `run` stored (they are
    /// the failing tiles then; the residual test is not run).
    pub corrupt_tiles: usize,
    /// An input (or added matrix `C0`) whose data does not match its stored checksums: it
    /// changed after they were written, so the output is not checked against it (`reason` says
    /// which tile).
    pub corrupt_input: Option<String>,
    /// Inputs with stored checksums that were not checked: a storage tile row of theirs is
    /// larger than a quarter of the memory available, so checking it ahead of the band reads
    /// would read it from disk twice.
    pub inputs_unchecked: Vec<String>,
    /// Inputs with no stored checksums (a `.npy` that `run` did not write, a raw file): the
    /// journal knows them by size, mtime and a sample CRC only, so a failure may be a change to
    /// them that kept those (`format` says so on a FAIL).
    pub inputs_without_checksums: Vec<String>,
    /// The output's own header or stored checksums (a `.npy`'s sidecar) are damaged or
    /// missing though its journal says the step is complete (`reason` says which): `--repair`
    /// mends them through `run`, which recomputes only tiles that no longer match the journal.
    pub damaged_output: Option<String>,
    /// Storage tile shape used to name failing tiles.
    pub tile_shape: (u64, u64),
    /// NaN/Inf in the output where the inputs give no IEEE reason for one.
    pub unexpected_nonfinite: u64,
    /// Cells (row, group) not checked because NaN/Inf or overflow may legitimately be there.
    pub skipped_cells: u64,
    /// Why they were set aside: which rows and columns, which cells (`format` names them).
    pub set_aside: SetAside,
    /// Cells (row, group) of the row test in all.
    pub cells: u64,
    /// Under `precision = "fp64_emulated"`: sampled elements compared one by one with native
    /// DGEMM's bound `(K+2)·u·|A||B|` ([`componentwise`]); `None` for other precisions.
    pub componentwise: Option<componentwise::Componentwise>,
    /// What computed the dense pass (op(A) times the sums of op(B)): "cpu", or the GPU
    /// ("cuda:0 NVIDIA H200") where `engine.backend` allows one and the data is not f64.
    pub device: String,
    /// Why a GPU that was asked for did not compute it (none, or it failed and the CPU did).
    pub device_note: Option<String>,
    /// Seconds the check took.
    pub seconds: f64,
    /// With `alpha = 0`, what the output was checked against instead of the product, which
    /// BLAS's rule leaves unused (its factors are not read): `"beta·C0"`, or `"zeros"` for a step
    /// that adds no C0. `None` for any other alpha.
    pub product_unused: Option<String>,
}

/// The parts of an output `verify` leaves to IEEE rules, by cause: output rows whose row of
/// op(A) holds NaN/Inf, output columns whose column of op(B) does, and (row, column group) cells
/// where C0 holds NaN/Inf or the product could overflow the output's type.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SetAside {
    /// Output rows set aside because their row of op(A) holds NaN/Inf.
    pub rows: u64,
    /// The first [`NAMED_LINES`] of them.
    pub first_rows: Vec<u64>,
    /// The file of op(A), whose same rows hold the NaN/Inf …
    pub rows_in: String,
    /// … or its same columns, when the step reads it transposed.
    pub rows_transposed: bool,
    /// Output columns set aside (x_j = 0) because their column of op(B) holds NaN/Inf.
    pub columns: u64,
    /// The first [`NAMED_LINES`] of them.
    pub first_columns: Vec<u64>,
    /// The file of op(B), whose same columns hold the NaN/Inf …
    pub columns_in: String,
    /// … or its same rows, when the step reads it transposed.
    pub columns_transposed: bool,
    /// Cells of the other rows whose C0 holds NaN/Inf (β ≠ 0).
    pub c0_cells: u64,
    /// Cells of the other rows where |α||A||B| + |β||C0| could overflow the output's type.
    pub overflow_cells: u64,
    /// The output's rows and columns, for the share the test saw.
    pub of: (u64, u64),
    /// The operands are rounded to fp16 first: a finite value beyond its range is an Inf too.
    pub rounded_to_fp16: bool,
}

impl VerifyReport {
    /// Nothing failed, but every cell of the test was set aside (NaN/Inf or a possible
    /// overflow everywhere: an output that overflowed its precision): nothing was checked, which
    /// is not a pass (`verify` exits 3, [`crate::error::Error::Unverified`]).
    pub fn nothing_checked(&self) -> bool {
        self.pass && self.cells > 0 && self.skipped_cells == self.cells
    }
}

/// One direction of Freivalds' test: the row residuals of `c = α·a·b + β·c0`.
struct Side<'a> {
    a: Op<'a>,
    b: Op<'a>,
    c: Op<'a>,
    c0: Option<Op<'a>>,
    alpha: f64,
    beta: f64,
    model: Model,
    exact: bool,
    dev: &'a Device,
}

#[derive(Default)]
struct Outcome {
    /// Failing (row, group) cells.
    fails: Vec<(usize, usize)>,
    max_ratio: f64,
    max_sigmas: f64,
    worst: (usize, f64, f64),
    certainly_wrong: bool,
    nonfinite: u64,
    skipped: u64,
    /// Rows of op(A) holding NaN/Inf (their output rows are set aside), in order.
    bad_rows: Vec<usize>,
    /// Columns of op(B) holding NaN/Inf (x_j = 0 there), in order.
    bad_cols: Vec<usize>,
    /// Cells set aside because C0 holds NaN/Inf there, and because the product could overflow.
    c0_cells: u64,
    overflow_cells: u64,
}

fn signs(n: usize, rounds: usize, seed: u64, stream: u64) -> Vec<Vec<f64>> {
    let mut g = Rng::new(seed, stream);
    (0..rounds)
        .map(|_| {
            (0..n)
                .map(|_| if g.next_u64() >> 63 == 0 { 1.0 } else { -1.0 })
                .collect()
        })
        .collect()
}

impl Side<'_> {
    /// The sums of op(B)·X, or `None` for α = 0 (A and B are not read); columns of op(B)
    /// holding NaN/Inf are dropped from `x` (set to 0).
    fn scatter_b(&self, groups: &Groups, x: &mut [Vec<f64>]) -> Result<Option<Sums>> {
        if self.alpha == 0.0 {
            return Ok(None);
        }
        let mut z = pass::scatter(&self.b, groups, x, self.exact)?;
        let bad_col = z.bad_col.clone();
        if bad_col.iter().any(|&b| b) {
            // Columns of op(B) holding NaN/Inf make their output columns NaN/Inf by IEEE rules:
            // drop them from the test (x_j = 0) and fold op(B) again without them.
            for xr in x.iter_mut() {
                xr.iter_mut().zip(&bad_col).for_each(|(v, &b)| {
                    if b {
                        *v = 0.0
                    }
                });
            }
            z = pass::scatter(&self.b, groups, x, self.exact)?;
        }
        Ok(Some(z))
    }

    fn run(&self, groups: &Groups, rounds: usize, seed: u64, stream: u64) -> Result<Outcome> {
        let (m, n) = self.c.shape();
        let mut x = signs(n, rounds, seed, stream);
        // A device for the dense pass gets ready meanwhile (its buffers, its kernels loaded).
        let (zb, ()) = rayon::join(
            || self.scatter_b(groups, &mut x),
            || {
                if self.alpha != 0.0 {
                    pass::prepare(&self.a, rounds, groups.count(), self.exact, self.dev)
                }
            },
        );
        let zb = zb?;
        let x = &x;
        let dense = || match &zb {
            Some(z) => pass::dense(&self.a, z, self.exact, self.dev).map(Some),
            None => Ok(None),
        };
        let scatters = || {
            let cs = pass::scatter(&self.c, groups, x, self.exact);
            let c0s = match (&self.c0, self.beta != 0.0) {
                (Some(op), true) => pass::scatter(op, groups, x, self.exact).map(Some),
                _ => Ok(None),
            };
            (cs, c0s)
        };
        // With the products on a device, the host folds the output (and C0) against the same
        // X meanwhile (the passes are independent once X is fixed); on the CPU alone, one
        // after the other (at once they only compete for the same cores: 8 % slower on two).
        let on_device =
            zb.is_some() && !self.exact && self.a.file.dtype() != DType::F64 && self.dev.present();
        let (ab, (cs, c0s)) = match on_device {
            true => rayon::join(dense, scatters),
            false => (dense(), scatters()),
        };
        let (ab, cs, c0s) = (ab?, cs?, c0s?);
        let g = groups.count();
        let bad_cols: Vec<usize> = match &zb {
            Some(z) => (z.bad_col.iter().enumerate())
                .filter_map(|(j, &b)| b.then_some(j))
                .collect(),
            None => Vec::new(),
        };
        // A group whose columns all hold NaN/Inf in op(B) has x = 0 throughout: its cells
        // test nothing (0 = 0) and are set aside, not counted as checked — with every column
        // so, nothing was checked (exit 3), not a pass.
        let empty: Vec<bool> = match &zb {
            Some(z) => (0..g)
                .map(|gr| groups.range(gr).all(|j| z.bad_col[j]))
                .collect(),
            None => vec![false; g],
        };
        let out_max = if self.c.file.dtype() == DType::F64 {
            f64::MAX
        } else {
            f32::MAX as f64
        };
        let rows: Vec<Outcome> = (0..m)
            .into_par_iter()
            .map(|i| self.row(i, &empty, n, out_max, ab.as_ref(), &cs, c0s.as_ref()))
            .collect();
        let mut o = Outcome {
            bad_cols,
            ..Outcome::default()
        };
        for r in rows {
            o.fails.extend(r.fails);
            if r.max_ratio > o.max_ratio || r.max_ratio.is_nan() {
                o.max_ratio = r.max_ratio;
                o.worst = r.worst;
            }
            o.max_sigmas = o.max_sigmas.max(r.max_sigmas);
            o.certainly_wrong |= r.certainly_wrong;
            o.nonfinite += r.nonfinite;
            o.skipped += r.skipped;
            o.bad_rows.extend(r.bad_rows);
            o.c0_cells += r.c0_cells;
            o.overflow_cells += r.overflow_cells;
        }
        Ok(o)
    }

    #[allow(clippy::too_many_arguments)]
    fn row(
        &self,
        i: usize,
        empty: &[bool],
        n: usize,
        out_max: f64,
        ab: Option<&Sums>,
        cs: &Sums,
        c0s: Option<&Sums>,
    ) -> Outcome {
        let mut o = Outcome::default();
        let g = empty.len();
        if ab.is_some_and(|p| p.bad_row[i]) {
            o.skipped += g as u64;
            o.bad_rows.push(i);
            return o;
        }
        let (al, be) = (self.alpha, self.beta);
        let rg = cs.rounds * g;
        for (gr, &empty) in empty.iter().enumerate() {
            if empty {
                o.skipped += 1; // every column of the group is set aside: x = 0 there
                continue;
            }
            let at = i * g + gr;
            let mut cell = Cell {
                c2: cs.sq[at],
                cabs: cs.abs[at],
                ..Cell::default()
            };
            if let Some(p) = ab {
                cell.p = al * al * p.sq[at];
                cell.ab = al.abs() * p.abs[at];
            }
            if let Some(c0) = c0s {
                if c0.nonfinite[at] > 0 {
                    o.skipped += 1;
                    o.c0_cells += 1;
                    continue;
                }
                cell.c0sq = be * be * c0.sq[at];
                cell.c0abs = be.abs() * c0.abs[at];
            }
            if cell.ab + cell.c0abs > out_max / 4.0 {
                o.skipped += 1; // the product may overflow to ±Inf here
                o.overflow_cells += 1;
                continue;
            }
            let (thr, sigma) = self.model.threshold(&cell, n);
            let bound = self.model.bound(&cell) + self.model.own(&cell, n);
            let mut bad = cs.nonfinite[at] > 0;
            o.nonfinite += cs.nonfinite[at] as u64;
            for rho in 0..cs.rounds {
                let s = i * rg + rho * g + gr;
                let mut r = cs.signed[s];
                if let Some(p) = ab {
                    r.add_scaled(-al, p.signed[s]);
                }
                if let Some(c0) = c0s {
                    r.add_scaled(-be, c0.signed[s]);
                }
                let res = Dd::value(r).abs();
                let ratio = if res.is_nan() {
                    f64::INFINITY
                } else {
                    res / thr
                };
                if ratio > o.max_ratio {
                    o.max_ratio = ratio;
                    o.worst = (i, res, thr);
                }
                o.max_sigmas = o.max_sigmas.max(res / sigma);
                bad |= ratio > 1.0;
                o.certainly_wrong |= res.is_nan() || res > bound;
            }
            if bad {
                o.fails.push((i, gr));
            }
        }
        o
    }
}

fn round_of(p: Precision) -> Option<Precision> {
    matches!(p, Precision::Tf32 | Precision::Bf16 | Precision::Fp16).then_some(p)
}

/// Compare the journal's record of the plan and inputs with now; `Some(reason)` on a mismatch
/// or an unfinished step. An input whose identity changed because it is damaged (its checksum
/// table or data no longer agree) is named as such, in `rep.corrupt_input` too.
fn journal_check(
    step: &Step,
    precision: Precision,
    rep: &mut VerifyReport,
) -> Result<Option<String>> {
    let Some(j) = journal::peek(&step.output)? else {
        if journal::torn(&step.output) {
            return Ok(Some(format!(
                "the step is unfinished: its journal {}'s first line was torn while it was first written (a crash), so it records no tile; `run` writes it again and computes the step",
                journal::journal_path(&step.output).display()
            )));
        }
        return Ok(crate::durable::split::split_state(&step.output).map(|state| {
            format!(
                "the step is unfinished: a split run's shards are writing it (state in {}); `run PLAN --shard K/S` runs the shards left (`status PLAN` names them), and the last to finish finalizes it",
                state.display()
            )
        }));
    };
    let mut now = vec![
        ("expr".to_string(), step.expr.clone()),
        ("alpha".into(), format!("{:?}", step.alpha)),
        ("beta".into(), format!("{:?}", step.beta)),
        ("precision".into(), precision.name().to_string()),
    ];
    now.extend(crate::run::input_ids(step)?);
    // The keys verify can know (the journal's fingerprint has more: the layout, the backend),
    // compared and worded as `run` does ([`journal::fingerprint_changes`]).
    let now: journal::Fingerprint = now.into_iter().collect();
    // Under the plan's names for the journal's matrices (`a`, `b` of a Python `matmul`).
    let was: journal::Fingerprint = (journal::renamed(&j.fingerprint, &now).iter())
        .filter(|(k, _)| now.contains_key(*k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let changes = journal::fingerprint_changes(&was, &now);
    let jp = journal::journal_path(&step.output);
    if !changes.is_empty() {
        if let Some((path, e)) = crate::run::damaged_input(step, &j.fingerprint) {
            rep.corrupt_input = Some(path.display().to_string());
            return Ok(Some(e.to_string()));
        }
        return Ok(Some(format!(
            "the output was computed from other inputs or another plan than now (journal {}): {}; rerun this step with `run --restart`",
            jp.display(),
            changes
        )));
    }
    if !j.complete {
        return Ok(Some(format!(
            "the step is unfinished: its journal {} records {} finished tiles and no completion; resume it with `run`",
            jp.display(),
            j.done.len()
        )));
    }
    Ok(None)
}

/// Checks the steps of one plan: the check's settings, and the device its dense passes run on
/// ([`crate::backend::fold`]: a GPU where `engine.backend` allows one), opened once, in the
/// background, when the verifier is made.
pub struct Verifier {
    precision: Precision,
    rounds: usize,
    seed: u64,
    times: bool,
    dev: Device,
}

impl Verifier {
    /// A verifier for the steps of a plan with `engine` (its precision; its backend and
    /// devices for where the dense passes run), `rounds` rounds of the randomized test from
    /// `seed`. `MGMM_VERIFY_TIMES` (set) reports each pass's time on stderr.
    pub fn new(engine: &crate::plan::Engine, rounds: usize, seed: u64) -> Verifier {
        let times = crate::config::Settings::from_env().verify_times;
        Verifier::with_times(engine, rounds, seed, times)
    }

    /// [`Verifier::new`] with `times` given (read once where the command started).
    pub(crate) fn with_times(
        engine: &crate::plan::Engine,
        rounds: usize,
        seed: u64,
        times: bool,
    ) -> Verifier {
        Verifier {
            precision: engine.precision,
            rounds,
            seed,
            times,
            dev: Device::open(engine),
        }
    }

    /// A verifier whose dense passes run on `dev` (tests).
    #[cfg(test)]
    pub(crate) fn on(precision: Precision, rounds: usize, seed: u64, dev: Device) -> Verifier {
        Verifier {
            precision,
            rounds,
            seed,
            times: false,
            dev,
        }
    }

    /// Check `step`'s output.
    pub fn step(&self, step: &Step) -> Result<VerifyReport> {
        self.dev.new_step();
        let mut rep = self.step_inner(step)?;
        (rep.device, rep.device_note) = self.dev.used();
        Ok(rep)
    }

    fn step_inner(&self, step: &Step) -> Result<VerifyReport> {
        let (precision, rounds, seed, times) = (self.precision, self.rounds, self.seed, self.times);
        let t0 = Instant::now();
        let r = rounds.max(1);
        // An intermediate of a chain has no file once the chain completed (none at all when it
        // was held in memory): the chain is checked at its last part.
        if let Some(why) = intermediate_part(step) {
            let mut rep = blank_report(step, r, (step.m, step.n));
            rep.reason = Some(why);
            rep.seconds = t0.elapsed().as_secs_f64();
            return Ok(rep);
        }
        // A run writing the output holds its journal: the file is then neither finished nor
        // wrong. Held (shared) while the output is read, so no run starts writing it meanwhile.
        let _reading = journal::read_lock(&step.output)?;
        let (m, n) = (step.m as usize, step.n as usize);
        if !step.output.exists() {
            return Err(Error::format(
                &step.output,
                format!(
                    "step {}'s output does not exist yet: `run` the plan first, then verify",
                    step.index + 1
                ),
            ));
        }
        let complete = journal::peek(&step.output)
            .ok()
            .flatten()
            .is_some_and(|j| j.complete);
        let out = match open_source(&step.output) {
            Ok(out) => out,
            Err(e @ Error::Format { .. }) if complete => {
                let why = format!("its header is damaged ({e})");
                return Ok(damaged_output(step, r, why, t0));
            }
            // An unfinished `.npy` cannot be opened as a matrix (its header says UNFINISHED):
            // the journal, or a split run's state, says why and what finishes it, on the
            // step's FAIL line as for a `.mgt` (it was an error with no `verify step` line,
            // and no word of the shards: a new user's trial).
            Err(e @ Error::Format { .. }) if unfinished_npy(&step.output) => {
                let mut rep = blank_report(step, r, (step.m, step.n));
                let Some(why) = journal_check(step, precision, &mut rep)? else {
                    return Err(e);
                };
                rep.pass = false;
                rep.reason = Some(why);
                rep.seconds = t0.elapsed().as_secs_f64();
                return Ok(rep);
            }
            Err(e) => return Err(e),
        };
        let npy = crate::store::OutputFormat::of(&step.output) == crate::store::OutputFormat::Npy;
        let rewritten = npy
            .then(|| {
                crate::store::npy_sink::not_as_written_at(
                    &step.output,
                    (step.out_dtype, step.m, step.n),
                )
            })
            .flatten();
        if let (true, Some(why)) = (complete, rewritten) {
            // Not what `run` wrote, so neither `run` nor `--repair` can mend it in place.
            let mut rep = blank_report(step, r, (step.m, step.n));
            rep.pass = false;
            rep.reason = Some(format!(
                "{why}, though its journal says the step is complete: `run` cannot resume or mend such a file; `run --restart` computes the step again"
            ));
            rep.seconds = t0.elapsed().as_secs_f64();
            return Ok(rep);
        }
        if complete && npy && out.checksum_tile().is_none() {
            let why = match out.checksum_note() {
                Some(note) => format!("its checksum {note}"),
                None => format!(
                    "its checksum sidecar {} is missing",
                    crate::store::sidecar::sidecar_path(&step.output).display()
                ),
            };
            return Ok(damaged_output(step, r, why, t0));
        }
        if out.shape() != (step.m, step.n) || out.transposed() {
            return Err(Error::format(
                &step.output,
                format!(
                    "is {}×{} but step {} produces {m}×{n}",
                    out.shape().0,
                    out.shape().1,
                    step.index + 1
                ),
            ));
        }
        let tile = out.checksum_tile().unwrap_or((step.m, step.n));
        let mut rep = blank_report(step, r, tile);
        match no_residuals(step, precision, &mut rep)? {
            Some((false, why)) => {
                rep.pass = false;
                rep.reason = Some(why);
            }
            other => {
                // The checksums `run` stored first (cheap, exact): a flipped low bit can hide in
                // the rounding the residual test must allow, never in a CRC.
                let bad = corrupt_tiles(out.as_ref())?;
                if !bad.is_empty() {
                    rep.pass = false;
                    rep.corrupt_tiles = bad.len();
                    rep.failing_tiles = bad;
                } else if let Some((pass, why)) = other {
                    rep.pass = pass;
                    rep.reason = Some(why);
                } else {
                    residuals(
                        step,
                        precision,
                        out.as_ref(),
                        seed,
                        times,
                        &self.dev,
                        &mut rep,
                    )?;
                }
            }
        }
        rep.seconds = t0.elapsed().as_secs_f64();
        Ok(rep)
    }
}

/// The failing report of `step` whose output, complete by its journal, has a damaged header or
/// lost its stored checksums (`why`): nothing else is checked; `--repair` mends it.
fn damaged_output(step: &Step, rounds: usize, why: String, t0: Instant) -> VerifyReport {
    let mut rep = blank_report(step, rounds, (step.m, step.n));
    rep.pass = false;
    rep.reason = Some(format!(
        "{why}, though its journal says the step is complete: `verify --repair` (or `run`) checks every tile against the journal's record and writes the header or checksums again, recomputing only tiles that no longer match"
    ));
    rep.damaged_output = Some(why);
    rep.seconds = t0.elapsed().as_secs_f64();
    rep
}

/// The storage tiles of `out` whose data no longer matches the checksum stored with it (none
/// for a file without checksums), in (tile row, tile column) order.
fn corrupt_tiles(out: &dyn MatrixSource) -> Result<Vec<(u64, u64)>> {
    Ok(crate::store::source::bad_tiles(out)?
        .into_iter()
        .filter_map(|e| match e {
            Error::Checksum { ti, tj, .. } => Some((ti, tj)),
            _ => None,
        })
        .collect())
}

/// Whether `f`'s stored checksums are checked as the passes read it: a storage tile row is
/// checked whole ahead of the first band that touches it, so it must stay in the page cache
/// until the bands have read it — at most a quarter of the memory available (4 GiB when that
/// is unknown). Files without checksums have nothing to check.
fn checkable(f: &dyn MatrixSource) -> bool {
    let Some((tr, _)) = f.checksum_tile() else {
        return false;
    };
    let row = tr
        .saturating_mul(f.shape().1)
        .saturating_mul(f.dtype().size() as u64);
    row <= crate::store::fsutil::mem_available().unwrap_or(16 << 30) / 4
}

/// A passing report of `step` with nothing measured yet.
fn blank_report(step: &Step, rounds: usize, tile: (u64, u64)) -> VerifyReport {
    VerifyReport {
        step: step.index + 1,
        output: step.output.display().to_string(),
        rounds,
        pass: true,
        reason: None,
        max_ratio: 0.0,
        max_sigmas: 0.0,
        worst_row: 0,
        residual: 0.0,
        allowed: 0.0,
        certainly_wrong: false,
        failing_cells: 0,
        failing_tiles: Vec::new(),
        corrupt_tiles: 0,
        corrupt_input: None,
        inputs_unchecked: Vec::new(),
        inputs_without_checksums: Vec::new(),
        damaged_output: None,
        tile_shape: tile,
        unexpected_nonfinite: 0,
        skipped_cells: 0,
        set_aside: SetAside::default(),
        cells: 0,
        componentwise: None,
        device: "cpu".into(),
        device_note: None,
        seconds: 0.0,
        product_unused: (step.alpha == 0.0).then(|| match step.c0.is_some() && step.beta != 0.0 {
            true => "beta·C0".into(),
            false => "zeros".into(),
        }),
    }
}

/// Whether `step` is an intermediate part of a whole-expression chain: it has no output of its
/// own to check (the chain is checked at its last part), so `verify` shows no line for it.
pub fn is_intermediate(step: &Step) -> bool {
    intermediate_part(step).is_some()
}

/// Why an intermediate part of a whole-expression chain is not checked on its own; `None` for
/// any other step.
fn intermediate_part(step: &Step) -> Option<String> {
    let c = step.chain.as_ref().filter(|c| c.part < c.parts)?;
    let kept = if c.memory.contains(&step.output) {
        "held in host memory while the chain runs (a split run writes it to a temporary file)"
    } else {
        "a temporary file removed when the chain completes"
    };
    Some(format!(
        "an intermediate of a whole-expression chain, {kept}; the chain is checked at its last part"
    ))
}

/// Why the residual test is not run on the last part of a chain or an ordinary `step`, with
/// the verdict that stands instead: a chain without its intermediates passes on the journal
/// alone; a journal that disagrees with the plan and inputs fails.
fn no_residuals(
    step: &Step,
    precision: Precision,
    rep: &mut VerifyReport,
) -> Result<Option<(bool, String)>> {
    if let Some(why) = journal_check(step, precision, rep)? {
        return Ok(Some((false, why)));
    }
    Ok(chain_gap(step).map(|why| (true, why)))
}

/// Freivalds' test of `out` against the step's operands, row residuals first and, when some
/// fail, column residuals to name the failing storage tiles; fills `rep` (its `rounds` and
/// `tile_shape` are set). `times`: report each pass's time on stderr.
fn residuals(
    step: &Step,
    precision: Precision,
    out: &dyn MatrixSource,
    seed: u64,
    times: bool,
    dev: &Device,
    rep: &mut VerifyReport,
) -> Result<()> {
    let (m, n, k) = (step.m as usize, step.n as usize, step.k);
    let (r, tile) = (rep.rounds, rep.tile_shape);
    let fa = step.a.open()?;
    // One handle for a file that is both operands (X.T @ X): its tiles are checked once.
    let fb = match step.b.path == step.a.path && step.b.raw == step.a.raw {
        true => None,
        false => Some(step.b.open()?),
    };
    let fb: &dyn MatrixSource = fb.as_deref().unwrap_or(fa.as_ref());
    let fc0 = match &step.c0 {
        Some(c) if step.beta != 0.0 => Some(c.open()?),
        _ => None,
    };
    let mut check = |f: &dyn MatrixSource| {
        let ok = checkable(f);
        let p = f.path().display().to_string();
        let list = match f.checksum_tile() {
            Some(_) if !ok => &mut rep.inputs_unchecked,
            None if f.is_file() => &mut rep.inputs_without_checksums,
            _ => return ok,
        };
        if !list.contains(&p) {
            list.push(p);
        }
        ok
    };
    let (ca, cb) = (check(fa.as_ref()), check(fb));
    let cc0 = fc0.as_deref().is_some_and(&mut check);
    let exact = step.a.dtype == DType::F64;
    let model = Model::new(precision, step.a.dtype, out.dtype(), k, exact);
    let rd = round_of(precision);
    let op = |f, trans, round, check| Op {
        file: f,
        trans,
        round,
        check,
        times,
    };
    let rows = Side {
        a: op(fa.as_ref(), step.a.trans, rd, ca),
        b: op(fb, step.b.trans, rd, cb),
        c: op(out, false, None, false),
        c0: fc0.as_ref().map(|f| op(f.as_ref(), false, None, cc0)),
        alpha: step.alpha,
        beta: step.beta,
        model,
        exact,
        dev,
    };
    let cg = Groups::new(n, tile.1 as usize, groups_for(m.max(n), r));
    let o = match rows.run(&cg, r, seed, 0x5EED) {
        Err(Error::Checksum {
            path,
            ti,
            tj,
            stored,
            computed,
            sidecar,
        }) if path != step.output => {
            // The passes check the operands' stored checksums as they read them
            // (pass::read_band); the output's were checked before.
            input_changed(rep, &path, (ti, tj), (stored, computed), sidecar.as_deref());
            return Ok(());
        }
        o => o?,
    };
    rep.max_ratio = o.max_ratio;
    rep.max_sigmas = o.max_sigmas;
    (rep.worst_row, rep.residual, rep.allowed) = (o.worst.0 as u64, o.worst.1, o.worst.2);
    rep.certainly_wrong = o.certainly_wrong;
    rep.failing_cells = o.fails.len();
    rep.unexpected_nonfinite = o.nonfinite;
    rep.skipped_cells = o.skipped;
    rep.set_aside = SetAside {
        rows: o.bad_rows.len() as u64,
        first_rows: o
            .bad_rows
            .iter()
            .take(NAMED_LINES)
            .map(|&i| i as u64)
            .collect(),
        rows_in: step.a.path.display().to_string(),
        // As the plan's text reads it: a Fortran-order file's rows are numpy's rows, though
        // the step reads its stored transpose.
        rows_transposed: step.a.trans ^ fa.transposed(),
        columns: o.bad_cols.len() as u64,
        first_columns: o
            .bad_cols
            .iter()
            .take(NAMED_LINES)
            .map(|&j| j as u64)
            .collect(),
        columns_in: step.b.path.display().to_string(),
        columns_transposed: step.b.trans ^ fb.transposed(),
        c0_cells: o.c0_cells,
        overflow_cells: o.overflow_cells,
        of: (m as u64, n as u64),
        rounded_to_fp16: precision == Precision::Fp16,
    };
    rep.cells = m as u64 * cg.count() as u64;
    if let Precision::Fp64Emulated(_) = precision {
        let ops = (fa.as_ref(), fb, fc0.as_deref());
        let mut cw = componentwise::check(step, ops, out, tile, seed)?;
        if let Precision::Fp64Emulated(crate::plan::EmulationModuli::Fixed(nm)) = precision {
            cw.forced_moduli = Some(nm as u32);
        }
        if cw.failing > 0 {
            // Named in `format`'s lines, with the failing tiles (repairable), not as a
            // `reason` (which means a failure found before any tile was looked at).
            rep.pass = false;
        }
        rep.componentwise = Some(cw);
    }
    if !o.fails.is_empty() {
        rep.pass = false;
        // The same test on Cᵀ = α·op(B)ᵀ·op(A)ᵀ + β·C0ᵀ names the failing columns.
        let cols = Side {
            a: op(fb, !step.b.trans, rd, cb),
            b: op(fa.as_ref(), !step.a.trans, rd, ca),
            c: op(out, true, None, false),
            c0: fc0.as_ref().map(|f| op(f.as_ref(), true, None, cc0)),
            ..rows
        };
        let rgp = Groups::new(m, tile.0 as usize, groups_for(m.max(n), r));
        let oc = cols.run(&rgp, r, seed, 0xC015)?;
        rep.failing_tiles = tiles(&o.fails, &cg, &oc.fails, &rgp, tile);
    }
    if let Some(cw) = &rep.componentwise {
        let mut all: BTreeSet<(u64, u64)> = rep.failing_tiles.iter().copied().collect();
        all.extend(cw.failing_tiles.iter().copied());
        rep.failing_tiles = all.into_iter().collect();
    }
    Ok(())
}

/// Fill `rep` for an input `path` whose tile `(ti, tj)` no longer matches its stored checksum
/// (in `sidecar`, or in the file): the output cannot be checked against it.
fn input_changed(
    rep: &mut VerifyReport,
    path: &Path,
    (ti, tj): (u64, u64),
    (stored, computed): (u32, u32),
    sidecar: Option<&Path>,
) {
    rep.pass = false;
    rep.corrupt_input = Some(path.display().to_string());
    let p = path.display();
    let (table, meant) = match sidecar {
        Some(s) => (
            format!("the checksums in {}", s.display()),
            format!(
                "; if it was changed on purpose, delete {} and `run --restart` to recompute the step from it",
                s.display()
            ),
        ),
        None => ("the checksums stored in it".into(), String::new()),
    };
    // Neutral about when it changed: with `verify_inputs = false` the run itself may
    // have read it so.
    rep.reason = Some(format!(
        "the input {p} does not match {table} (tile ({ti}, {tj}): stored {stored:#010x}, computed {computed:#010x}): its data changed after they were written, so the output cannot be checked against it — restore the input (regenerate or re-import it; an output of an earlier step is checked at that step, where `verify --repair` recomputes its bad tiles) and verify again; `info {p} --check` lists every bad tile{meant}"
    ));
}

/// Why the residual test cannot run on a part of a whole-expression chain: its intermediates
/// are removed when the chain completes, or were only ever held in memory. The journal check
/// above still ran (inputs unchanged, the chain complete). `None` for an ordinary step, or
/// while the intermediates still exist (a split run keeps them).
fn chain_gap(step: &Step) -> Option<String> {
    let c = step.chain.as_ref()?;
    let gone: Vec<&Operand> = [&step.a, &step.b]
        .into_iter()
        .filter(|o| o.temp && !o.path.exists())
        .collect();
    if gone.is_empty() {
        return None;
    }
    let where_ = if gone.iter().all(|o| c.memory.contains(&o.path)) {
        "which were held in host memory while the chain ran (or, after a split run, kept in files until a plain `run` removed them) and are not kept"
    } else {
        "which `run` removed"
    };
    Some(format!(
        "journal only (the chain {} is complete and its inputs are unchanged); residuals not computed: Freivalds' check of a chain needs its intermediates, {where_} — to check the product by residuals, run the chain as separate named steps",
        c.order
    ))
}

/// Groups per side: [`GROUPS`], fewer when the per-row sums would pass ~512 MiB.
fn groups_for(len: usize, rounds: usize) -> usize {
    let per_group = len * (rounds * 16 + 24) * 3;
    (((512usize << 20) / per_group.max(1)).clamp(1, GROUPS)).max(1)
}

/// Storage tiles named by both tests (or by the row test alone when the column test, less
/// sensitive for some errors, finds nothing).
fn tiles(
    rf: &[(usize, usize)],
    cg: &Groups,
    cf: &[(usize, usize)],
    rgp: &Groups,
    tile: (u64, u64),
) -> Vec<(u64, u64)> {
    let (tr, tc) = (tile.0 as usize, tile.1 as usize);
    let span = |g: &Groups, grp: usize, t: usize| {
        let rg = g.range(grp);
        (rg.start / t..=(rg.end - 1) / t).map(|x| x as u64)
    };
    let by_rows: BTreeSet<(u64, u64)> = rf
        .iter()
        .flat_map(|&(i, grp)| span(cg, grp, tc).map(move |tj| ((i / tr) as u64, tj)))
        .collect();
    let by_cols: BTreeSet<(u64, u64)> = cf
        .iter()
        .flat_map(|&(j, grp)| span(rgp, grp, tr).map(move |ti| (ti, (j / tc) as u64)))
        .collect();
    let both: Vec<(u64, u64)> = by_rows.intersection(&by_cols).copied().collect();
    if both.is_empty() {
        by_rows.into_iter().collect()
    } else {
        both
    }
}

/// The result for scripts (stdout): a first line `verify step N (OUTPUT): PASS` (or `FAIL`)
/// with the rounds and time, then indented details, every line within 80 columns.
pub fn format(rep: &VerifyReport) -> String {
    let verdict = if rep.pass { "PASS" } else { "FAIL" };
    if let Some(why) = &rep.reason {
        return crate::progress::wrap(&format!(
            "verify step {} ({}): {verdict} — {why}",
            rep.step, rep.output
        ));
    }
    if rep.corrupt_tiles > 0 {
        let s = format!(
            "verify step {} ({}): {verdict} — {} tile(s) no longer match the checksums `run` stored with them: the file changed after it was written\n{}",
            rep.step,
            rep.output,
            rep.corrupt_tiles,
            failing_tiles_lines(rep)
        );
        return crate::progress::wrap(&s);
    }
    if rep.nothing_checked() {
        // Nothing failed, but nothing was tested either: not a pass (`verify` exits 3), said
        // on the line scripts read.
        // The advice follows the cause: NaN/Inf in the inputs (rows or columns set aside), or
        // an output that could overflow its precision.
        let sa = &rep.set_aside;
        let why = match sa.rows > 0 || sa.columns > 0 {
            true => "is set aside: the inputs hold NaN/Inf there (named below), which make the output NaN/Inf by IEEE rules, so nothing says this output is right. Mend or drop those values in the inputs",
            false => "holds NaN/Inf or could overflow the output's precision (|alpha|·|A|·|B| near its largest value): IEEE results the test cannot judge, so nothing says this output is right. If `run` noted NaN/Inf in the output from finite inputs, the product overflowed: scale alpha or the inputs down, or store the inputs as f64 and compute in fp64",
        };
        let mut s = format!(
            "verify step {} ({}): NOT CHECKED — every part the test looks at ({} cells: each row's run of columns) {why}, then `run --restart` and verify again",
            rep.step, rep.output, rep.cells
        );
        if let Some(line) = set_aside_line(rep) {
            s += &format!("\n  {line}");
        }
        if !rep.inputs_unchecked.is_empty() {
            s += &format!(
                "\n  stored checksums not checked: {}",
                rep.inputs_unchecked.join(", ")
            );
        }
        return crate::progress::wrap(&s);
    }
    let on = match rep.device.as_str() {
        "cpu" => String::new(),
        d => format!(" (products on {d})"),
    };
    let mut s = format!(
        "verify step {} ({}): {verdict} — {} round(s) in {:.2} s{on}\n",
        rep.step, rep.output, rep.rounds, rep.seconds
    );
    s += &format!("  {}", residual_line(rep));
    if let Some(line) = set_aside_line(rep) {
        s += &format!("\n  {line}");
    }
    if let Some(cw) = &rep.componentwise {
        let forced = cw.forced_moduli;
        s += &format!(
            "\n  componentwise (fp64_emulated): {} {}element(s) against (K+2)·u·|A||B|, worst {:.3e} × the bound at ({}, {}){}{}",
            cw.elements,
            if cw.all { "" } else { "sampled " },
            cw.worst_ratio,
            cw.worst.0,
            cw.worst.1,
            match cw.skipped {
                0 => String::new(),
                k => format!("; {k} left out (NaN/Inf or overflow: IEEE rules)"),
            },
            match (cw.failing, forced) {
                (0, _) => String::new(),
                (f, Some(nm)) => format!("; {f} exceed it: the forced emulation_moduli = {nm} is too few for this data (the run counted those blocks as bound_unmet); use \"auto\", which falls back to native fp64 where no count meets the bound, and `run --restart`"),
                (f, None) => format!("; {f} exceed it: the emulation missed its accuracy contract there (a bug to report, with the inputs if you can; `verify --repair` recomputes those tiles)"),
            }
        );
    }
    if let Some(note) = &rep.device_note {
        s += &format!("\n  note: {note}");
    }
    if !rep.inputs_unchecked.is_empty() {
        s += &format!(
            "\n  stored checksums not checked: {} (a storage tile row larger than a quarter of the memory available would be read twice; `info --check` checks them)",
            rep.inputs_unchecked.join(", ")
        );
    }
    if !rep.pass {
        if rep.unexpected_nonfinite > 0 {
            s += &format!(
                "\n  {} unexpected NaN/Inf in the output",
                rep.unexpected_nonfinite
            );
        }
        if rep.certainly_wrong {
            s += "\n  above the rigorous rounding bound: certainly wrong";
        }
        if !rep.inputs_without_checksums.is_empty() {
            // The journal knows such an input by its size, mtime and a sample CRC: a change
            // that kept those reads as a wrong output (docs/RESILIENCE.md).
            let (has, them, their) = match rep.inputs_without_checksums.len() {
                1 => ("has", "it", "its"),
                _ => ("have", "them", "their"),
            };
            s += &format!(
                "\n  note: {} {has} no stored checksums: a change to {them} since the run that kept {their} size and modification time would fail this test the same way; if one may have changed, `run --restart` recomputes the output from the inputs as they are now",
                rep.inputs_without_checksums.join(", "),
            );
        }
        s += &format!("\n{}", failing_tiles_lines(rep));
    }
    crate::progress::wrap(&s)
}

/// The line under the verdict: the largest residual against what a correct product's rounding
/// allows — or, when every residual is exactly 0, that (no row's ratio then means anything: an
/// output of zeros is allowed no residual at all, a 0/0); with `alpha = 0` it first says that
/// the product was not used and what the output was checked against.
fn residual_line(rep: &VerifyReport) -> String {
    let ratio = match rep.max_ratio == 0.0 {
        true => "every residual is exactly 0".to_string(),
        false => format!(
            "max residual/allowed = {:.3e} at row {} (residual {:.3e}, allowed {:.3e}; {:.1} σ of a correct product's rounding)",
            rep.max_ratio, rep.worst_row, rep.residual, rep.allowed, rep.max_sigmas
        ),
    };
    match &rep.product_unused {
        None => ratio,
        Some(what) => format!(
            "alpha = 0: as in BLAS, the product is not used (its factors were not read); the output was checked against {what}: {ratio}"
        ),
    }
}

/// What the test left to IEEE rules, by cause, naming the rows and columns and the file whose
/// NaN/Inf put them there (a bare "33 row groups not checked" named no row, and an Inf in B set
/// a column aside without a word: new-user trial). `None` when nothing was set aside.
fn set_aside_line(rep: &VerifyReport) -> Option<String> {
    let sa = &rep.set_aside;
    if rep.skipped_cells == 0 && sa.columns == 0 {
        return None;
    }
    // "row 123" / "rows 5, 9, 123 and 4 more".
    let lines = |what: &str, n: u64, first: &[u64]| {
        let mut t = format!(
            "{what}{} {}",
            if n == 1 { "" } else { "s" },
            first
                .iter()
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
        if n > first.len() as u64 {
            t += &format!(" and {} more", n - first.len() as u64);
        }
        t
    };
    // Where op(X)'s line lies in the file: the same rows or columns, swapped when transposed.
    // Under fp16 the operands are rounded first: a finite value past 65504 is an Inf then.
    let what = match sa.rounded_to_fp16 {
        true => "NaN/Inf or values beyond fp16's range",
        false => "NaN/Inf",
    };
    let where_in = |file: &str, own: &str, other: &str, n: u64, transposed: bool| {
        let plural = if n == 1 { "" } else { "s" };
        match transposed {
            false => format!("{file} holds {what} in the same {own}{plural}"),
            true => format!(
                "{file} holds {what} in the same {other}{plural}: the step reads it transposed"
            ),
        }
    };
    let mut parts = Vec::new();
    if sa.rows > 0 {
        parts.push(format!(
            "output {} ({})",
            lines("row", sa.rows, &sa.first_rows),
            where_in(&sa.rows_in, "row", "column", sa.rows, sa.rows_transposed)
        ));
    }
    if sa.columns > 0 {
        parts.push(format!(
            "output {} ({})",
            lines("column", sa.columns, &sa.first_columns),
            where_in(
                &sa.columns_in,
                "column",
                "row",
                sa.columns,
                sa.columns_transposed
            )
        ));
    }
    if sa.c0_cells > 0 {
        parts.push(format!(
            "{} row group(s) of other rows where C0 holds NaN/Inf",
            sa.c0_cells
        ));
    }
    if sa.overflow_cells > 0 {
        parts.push(format!(
            "{} row group(s) where |alpha|·|A|·|B| could overflow the output's type",
            sa.overflow_cells
        ));
    }
    if parts.is_empty() {
        parts.push(format!("{} row group(s)", rep.skipped_cells));
    }
    // How much the PASS covers: NaN in 599 of 600 columns of B passed on one column, and only
    // the list's "and 591 more" said so (new-user trial).
    let (m, n) = sa.of;
    let share = match (m, n) {
        (0, _) | (_, 0) => String::new(),
        _ => format!(
            "; the test saw {} of {m} rows and {} of {n} columns",
            m.saturating_sub(sa.rows),
            n.saturating_sub(sa.columns)
        ),
    };
    Some(format!(
        "not checked (IEEE rules decide them): {}{share}",
        parts.join("; ")
    ))
}

/// "  failing tiles of R×C (tile row, tile col): (a, b) …", packed by hand so that no
/// (row, col) pair is split across lines.
fn failing_tiles_lines(rep: &VerifyReport) -> String {
    let mut shown: Vec<String> = rep
        .failing_tiles
        .iter()
        .take(NAMED)
        .map(|(a, b)| format!("({a}, {b})"))
        .collect();
    if rep.failing_tiles.len() > NAMED {
        shown.push(format!("… ({} in all)", rep.failing_tiles.len()));
    }
    let mut s = String::new();
    let mut line = format!(
        "  failing tiles of {}×{} (tile row, tile col):",
        rep.tile_shape.0, rep.tile_shape.1
    );
    for t in shown {
        if line.chars().count() + 1 + t.chars().count() > crate::progress::WIDTH {
            s += &format!("{line}\n");
            line = "     ".into();
        }
        line += &format!(" {t}");
    }
    s + &line
}

/// Whether `path` is a `.npy` output whose header says the engine has not finished it (and
/// nothing else is wrong with the header): only then is an error opening it "unfinished", not a
/// damaged file (cold review).
fn unfinished_npy(path: &Path) -> bool {
    std::fs::File::open(path)
        .ok()
        .and_then(|mut f| crate::store::npy::read_header(path, &mut f).ok())
        .is_some_and(|h| h.unfinished)
}

/// `verify --repair`: make the next `run` recompute the failing storage tiles of `rep` (the
/// compute tiles that overlap them lose their journal records). Returns how many were dropped,
/// and the compute tile's rows and columns.
pub(crate) fn forget_failing(
    plan: &Plan,
    step: &Step,
    rep: &VerifyReport,
) -> Result<(usize, (u64, u64))> {
    if journal::peek(&step.output)?.is_none() {
        return Err(Error::Usage(format!(
            "{}: no journal beside the output, so single tiles cannot be redone; rerun the step with `run --restart`",
            step.output.display()
        )));
    }
    let sel = crate::backend::select(&plan.engine)?;
    let layout = crate::run::layout_for(&plan.path, step, &plan.engine, sel.caps(), false)?;
    let sched = crate::plan::schedule::Schedule::new(step, &layout);
    let (tr, tc) = rep.tile_shape;
    let seqs: BTreeSet<u32> = sched
        .tiles
        .iter()
        .filter(|t| {
            let b = &t.block;
            rep.failing_tiles.iter().any(|&(ti, tj)| {
                let (r0, c0) = (ti * tr, tj * tc);
                b.r0 < r0 + tr && r0 < b.r0 + b.rows && b.c0 < c0 + tc && c0 < b.c0 + b.cols
            })
        })
        .map(|t| t.seq)
        .collect();
    Ok((
        journal::forget(&step.output, &seqs)?,
        (layout.tm, layout.tn),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::fold::{Fault, HostFold};

    /// `expr` of a generated A (70×90, or 90×70 for `A.T`) and B (90×50), run on the CPU in
    /// tiles of 32.
    fn product(dir: &Path, expr: &str) -> Plan {
        let (ar, ac) = if expr.contains("A.T") {
            (90, 70)
        } else {
            (70, 90)
        };
        let text = format!(
            "[matrices.A]\npath = \"A.mgt\"\ngenerate = {{ rows = {ar}, cols = {ac}, dist = \"normal\", seed = 1 }}\n\
             [matrices.B]\npath = \"B.mgt\"\ngenerate = {{ rows = 90, cols = 50, dist = \"normal\", seed = 2 }}\n\
             [[step]]\noutput = \"C.mgt\"\nexpr = \"{expr}\"\n\
             [engine]\nbackend = \"cpu\"\ntile = 32\ndurable = false\n"
        );
        std::fs::write(dir.join("plan.toml"), text).unwrap();
        let plan = Plan::load(&dir.join("plan.toml")).unwrap();
        crate::run::run_plan(
            &plan,
            &Default::default(),
            &crate::progress::Progress::quiet(),
        )
        .unwrap();
        plan
    }

    fn check(plan: &Plan, dev: Device) -> VerifyReport {
        Verifier::on(plan.engine.precision, 2, 3, dev)
            .step(&plan.steps[0])
            .unwrap()
    }

    /// The dense pass on a device (the host's stand-in for a GPU, band by band: A is read in
    /// 7 bands here) gives the CPU's verdict and residuals up to f64 rounding, for op(A) = A
    /// and Aᵀ.
    #[test]
    fn the_dense_pass_on_a_device_gives_the_cpus_verdict() {
        for expr in ["A @ B", "A.T @ B"] {
            let d = tempfile::tempdir().unwrap();
            let plan = product(d.path(), expr);
            let cpu = check(&plan, Device::cpu());
            let dev = check(&plan, Device::with(Box::new(HostFold::new(Fault::None))));
            assert!(
                cpu.pass && dev.pass,
                "{expr}: {}\n{}",
                format(&cpu),
                format(&dev)
            );
            assert_eq!(
                (cpu.device.as_str(), dev.device.as_str()),
                ("cpu", "sim:0 (host fold)")
            );
            assert!(dev.device_note.is_none(), "{:?}", dev.device_note);
            let rel = (dev.max_ratio - cpu.max_ratio).abs() / cpu.max_ratio;
            assert!(
                rel < 1e-9 && dev.cells == cpu.cells,
                "{expr}: {} against {}",
                dev.max_ratio,
                cpu.max_ratio
            );
            assert!(
                format(&dev).contains("(products on sim:0 (host fold))"),
                "{}",
                format(&dev)
            );
        }
    }

    /// A tile of A damaged after the run is named as such when the dense pass runs on a
    /// device, whose bands are copied from the file's map with each tile's checksum checked
    /// first: the check fails on A's tile, not on the output's residuals.
    #[test]
    fn a_damaged_input_tile_is_named_with_the_dense_pass_on_a_device() {
        for expr in ["A @ B", "A.T @ B"] {
            let d = tempfile::tempdir().unwrap();
            let plan = product(d.path(), expr);
            let a = d.path().join("A.mgt");
            let mut bytes = std::fs::read(&a).unwrap();
            let h = crate::store::Header::parse(&a, &bytes, bytes.len() as u64).unwrap();
            // A byte in the middle of the first tile's data.
            bytes[h.data_offset as usize + 100] ^= 0x40;
            std::fs::write(&a, &bytes).unwrap();
            let r = Verifier::on(
                plan.engine.precision,
                2,
                3,
                Device::with(Box::new(HostFold::new(Fault::None))),
            )
            .step(&plan.steps[0]);
            let e = match r {
                Err(e) => e.to_string(),
                Ok(rep) => format(&rep),
            };
            assert!(e.contains("A.mgt") && e.contains("checksum"), "{expr}: {e}");
        }
    }

    /// A device whose sums of the first band are not the CPU's, one that places later bands
    /// wrongly (caught at the last band), or one that fails or panics in the first or a later
    /// band, is let go: the CPU computes the pass again, the verdict and residuals are the
    /// CPU's to the bit, and the report says why the device was not used.
    #[test]
    fn a_device_that_errs_is_let_go_and_the_cpu_checks() {
        for expr in ["A @ B", "A.T @ B"] {
            let d = tempfile::tempdir().unwrap();
            let plan = product(d.path(), expr);
            let_go(&plan);
        }
    }

    fn let_go(plan: &Plan) {
        let plan = plan.clone();
        let cpu = check(&plan, Device::cpu());
        let t = plan.steps[0].a.trans;
        for (fault, says) in [
            // (A's stored rows, in bands of its width: A.T @ B reads a wider A.)
            (
                Fault::WrongSums,
                if t {
                    "sums of rows 0..14 of"
                } else {
                    "sums of rows 0..11 of"
                },
            ),
            (
                Fault::LaterRowsWrong,
                if t {
                    "differ from the CPU's: row"
                } else {
                    "sums of rows 66..70 of"
                },
            ),
            (Fault::FailAt(1), "injected failure"),
            (Fault::FailAt(4), "injected failure"),
            (
                if t {
                    Fault::FailAt(2)
                } else {
                    Fault::RowPastBand
                },
                if t {
                    "injected failure"
                } else {
                    "row 11, outside the band, changed"
                },
            ),
            (Fault::PanicAt(3), "it panicked"),
        ] {
            let rep = check(&plan, Device::with(Box::new(HostFold::new(fault))));
            let note = rep.device_note.clone().unwrap_or_default();
            assert!(
                rep.pass
                    && rep.device == "cpu"
                    && note.contains(says)
                    && note.contains("the check ran on the CPU"),
                "{fault:?}: {}",
                format(&rep)
            );
            assert_eq!(
                rep.max_ratio.to_bits(),
                cpu.max_ratio.to_bits(),
                "{fault:?}"
            );
            assert!(
                format(&rep).contains("note: sim:0 (host fold) was not used"),
                "{}",
                format(&rep)
            );
        }
    }
}
