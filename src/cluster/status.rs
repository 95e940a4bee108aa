//! `status PLAN`: one view of a split job from any machine that sees the filesystem — per step
//! and per shard, tiles done and left, the rate, the ETA, and who holds each shard.
//!
//! It only reads: the manifest, every shard journal (records and mtime), every claim (holder,
//! start time, heartbeat age). The rate of a shard is its recorded tiles over the time from its
//! claim to its journal's last write; the step's rate is all tiles recorded over the span from
//! the earliest claim to the latest write.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, SystemTime};

use super::prepare::{is_finalized, read_manifest, Manifest};
use super::{claim, recorded, shard_file, shard_files, shard_range, state_dir};
use crate::durable::journal;
use crate::error::Result;
use crate::plan::{Plan, Step, TileSpec};

fn unix(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The time left at `rate`; none while no process works on it (`running` false): a rate from
/// before a process died is not a forecast (`status` once said "ETA 1 s" for a shard whose
/// process was killed).
fn eta(left: u64, rate: f64, running: bool) -> String {
    if left == 0 {
        return "-".into();
    }
    if !running {
        return "not running".into();
    }
    if rate <= 0.0 {
        return "unknown".into();
    }
    crate::progress::fmt_duration(Some(left as f64 / rate))
}

/// The text `status PLAN` prints.
pub(crate) fn status_text(plan: &Plan, claim_timeout: Duration) -> Result<String> {
    let mut s = String::new();
    for step in &plan.steps {
        let n = step.index + 1;
        let out = &step.output;
        let Some(m) = read_manifest(out)? else {
            let intermediate = (step.chain.as_ref()).filter(|c| c.part < c.parts);
            // A complete journal whose output was deleted is no finished output.
            let state = if out.exists() && is_finalized(out, None)? {
                match crate::run::describe::damaged_output(out) {
                    Some(why) => format!(
                        "complete by its journal, but {why}: `mgmm-stream run {}` mends it",
                        plan.path.display()
                    ),
                    None => "complete (run in one process)".to_string(),
                }
            } else if let Some(c) = intermediate.filter(|_| !out.exists()) {
                format!(
                    "an intermediate of the chain written to {} (part {} of {}): kept in memory, or removed once the chain completed",
                    c.root_output.display(),
                    c.part,
                    c.parts
                )
            } else if let Ok(Some(j)) = crate::durable::journal::peek(out) {
                one_process(step, &plan.engine, &j, &plan.path)
            } else if out.exists() {
                // As `plan` says it (`run::describe`): it said "not started".
                "the file exists but no journal says this plan wrote it: `run` refuses it; `run --restart` overwrites it".to_string()
            } else {
                // Checkpoints outlive their output and journal (`run` resumes those that match).
                let partial = checkpointed(out, &Default::default());
                match partial.is_empty() {
                    true => "not started (no journal, no manifest yet)".to_string(),
                    false => format!(
                        "no output or journal yet{partial}: `mgmm-stream run {}` resumes them where they match the step",
                        plan.path.display()
                    ),
                }
            };
            s += &format!("step {n}: {}: {state}\n", out.display());
            continue;
        };
        let dir = state_dir(out);
        let rec = recorded(&dir, &m.fingerprint)?;
        let done = rec.len() as u64;
        let total = m.tiles as u64;
        let fin = is_finalized(out, Some(&m.fingerprint))?;
        let (lines, first, last, running) = shard_lines(&dir, &m, &rec, claim_timeout)?;
        let rate = if last > first {
            done as f64 / (last - first)
        } else {
            0.0
        };
        s += &format!(
            "step {n}: {}: {done}/{total} tiles done ({:.1} %), {} left, {}, ETA {}{}\n",
            out.display(),
            100.0 * done as f64 / total.max(1) as f64,
            total - done,
            if rate > 0.0 {
                format!("{rate:.2} tiles/s")
            } else {
                "rate unknown".into()
            },
            eta(total - done, rate, running),
            if fin {
                ", FINALIZED".to_string()
            } else if done == total {
                format!(
                    ", all tiles done: not yet finalized (`mgmm-stream finalize {}`)",
                    plan.path.display()
                )
            } else {
                String::new()
            }
        );
        for l in lines {
            s += &l;
        }
    }
    Ok(s)
}

/// The state of an output one process writes, from its journal `j`: how far it is, whether a
/// process is at it now (the journal's lock), how long since the journal was last written, and
/// the tiles whose partial sums are checkpointed. Said the same way whether it runs or not
/// (a user's `status` showed one line for both).
fn one_process(
    step: &Step,
    engine: &crate::plan::Engine,
    j: &crate::durable::journal::Peek,
    plan: &Path,
) -> String {
    let (out, plan) = (&step.output, plan.display());
    if !out.exists() {
        // Nothing recorded survives the output, but checkpoints do (`run` resumes them where
        // they match the step).
        let partial = checkpointed(out, &Default::default());
        return format!(
            "its journal records {}, but the output is gone: `mgmm-stream run {plan}` computes the step {}{partial}",
            crate::units::count(j.done.len() as u64, "tile", "tiles"),
            if partial.is_empty() { "afresh" } else { "again, resuming the checkpointed tiles that still match it" }
        );
    }
    let progress = j.progress(step.m, step.n);
    // `status` has no backend to lay the step out with (so no fingerprint to compare), but a
    // compute tile the plan sets is known: another one than the journal's is refused by `run`.
    if let (TileSpec::Fixed { m, n, k }, Some(was)) = (engine.tile, j.compute_tile()) {
        let now = (m.min(step.m), n.min(step.n), k.min(step.k));
        if now != was {
            return format!(
                "started in one process, not finished: {progress}; but its journal is from the compute tile {}×{}×{}, the plan's is {}×{}×{}: `mgmm-stream run {plan}` refuses it (`run --restart` starts the step over; the journal's tile resumes it)",
                was.0, was.1, was.2, now.0, now.1, now.2
            );
        }
    }
    let who = match crate::durable::journal::holder(out) {
        Some(h) => h,
        None => format!("no process is running it: `mgmm-stream run {plan}` resumes it"),
    };
    let jpath = crate::durable::journal::journal_path(out);
    let age = std::fs::metadata(&jpath)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| SystemTime::now().duration_since(t).ok())
        .map(|d| {
            format!(
                "; journal last written {} ago",
                crate::progress::fmt_duration(Some(d.as_secs_f64()))
            )
        })
        .unwrap_or_default();
    let partial = checkpointed(out, &j.tiles_done());
    format!("started in one process, not finished: {progress}; {who}{age}{partial}")
}

/// "; N unfinished tiles checkpointed in DIR (K of their KS k-chunks done)" ("1 unfinished
/// tile … of its …") for the
/// checkpoints of `out`'s tiles not in `done` (a kill may leave those of recorded tiles
/// behind); empty when there are none.
fn checkpointed(out: &Path, done: &std::collections::BTreeSet<u32>) -> String {
    let ckpts = crate::durable::checkpoint::peek(out, done);
    if ckpts.is_empty() {
        return String::new();
    }
    let (k, of) = ckpts
        .iter()
        .fold((0, 0), |(a, b), &(_, k, n)| (a + k, b + n));
    let n = ckpts.len() as u64;
    format!(
        "; {} checkpointed in {} ({k} of {} {of} k-chunks done)",
        crate::units::count(n, "unfinished tile", "unfinished tiles"),
        crate::durable::checkpoint::partial_dir(out).display(),
        if n == 1 { "its" } else { "their" }
    )
}

/// The split in use: the S of the newest shard file (journal, claim or done mark) in `dir`.
fn newest_split(dir: &Path) -> Result<Option<u32>> {
    let mut newest_s = None::<(f64, u32)>;
    for (p, _, sh) in shard_files(dir, "journal")?
        .into_iter()
        .chain(shard_files(dir, "claim")?)
        .chain(shard_files(dir, "done")?)
    {
        if let Ok(t) = std::fs::metadata(&p).and_then(|md| md.modified()) {
            if newest_s.is_none_or(|(x, _)| unix(t) > x) {
                newest_s = Some((unix(t), sh));
            }
        }
    }
    Ok(newest_s.map(|(_, s)| s))
}

/// One line per shard of the split in use (tiles done, rate, ETA, state), the span over
/// which the held shards recorded tiles: (earliest claim, latest journal write), `(f64::MAX,
/// 0.0)` when none did, and whether a process works on any shard now (a claim with a fresh
/// heartbeat).
fn shard_lines(
    dir: &Path,
    m: &Manifest,
    rec: &BTreeMap<u32, Vec<u32>>,
    claim_timeout: Duration,
) -> Result<(Vec<String>, f64, f64, bool)> {
    let mut first = f64::MAX;
    let mut last: f64 = 0.0;
    let mut lines = Vec::new();
    let mut any_running = false;
    let Some(ns) = newest_split(dir)? else {
        return Ok((lines, first, last, false));
    };
    for k in 0..ns {
        let r = shard_range(m.tiles, m.gn as u32, ns, k);
        let d = r.clone().filter(|t| rec.contains_key(t)).count() as u64;
        let jp = shard_file(dir, k, ns, "journal");
        let mine = journal::peek_file(&jp)?.map(|p| p.done.len()).unwrap_or(0) as f64;
        let jt = std::fs::metadata(&jp)
            .and_then(|md| md.modified())
            .ok()
            .map(unix);
        let holder = claim::read(&shard_file(dir, k, ns, "claim"))
            .or_else(|| claim::read(&shard_file(dir, k, ns, "done")));
        let done_mark = shard_file(dir, k, ns, "done").exists();
        let running = !done_mark
            && holder
                .as_ref()
                .is_some_and(|h| !claim::is_stale(h, claim_timeout));
        any_running |= running;
        let state = if done_mark {
            "done".to_string()
        } else if let Some(h) = &holder {
            if claim::is_stale(h, claim_timeout) {
                format!("STALE claim by {} (rerun to take it over)", h.describe())
            } else {
                format!("running on {}", h.describe())
            }
        } else if d as usize == r.len() {
            "done (by an earlier split)".into()
        } else {
            "waiting".into()
        };
        let mut rate = 0.0;
        if let (Some(h), Some(jt)) = (&holder, jt) {
            let span = jt - h.since as f64;
            first = first.min(h.since as f64);
            last = last.max(jt);
            if span > 0.0 {
                rate = mine / span;
            }
        }
        let left = r.len() as u64 - d;
        lines.push(format!(
            "  shard {k:>3}/{ns}: {d:>6}/{:<6} tiles  {:>8}  ETA {:<9} {state}\n",
            r.len(),
            if rate > 0.0 {
                format!("{rate:.2}/s")
            } else {
                "-".into()
            },
            eta(left, rate, running)
        ));
    }
    Ok((lines, first, last, any_running))
}
