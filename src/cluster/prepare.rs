//! Creating a split step's output exactly once, and waiting for it.
//!
//! The first process to claim `C.mgt.shards/prepare.claim` writes the output under a temporary
//! name, in the format its name asks for (`.mgt`, or a `.npy` whose header numpy refuses until
//! `finalize` writes the real one), header, full length, reserved blocks where `fallocate`
//! works, synced, then `link`s it to its
//! final name — `link` fails rather than replace, and is atomic on NFS and Lustre — and then
//! writes `manifest.json` the same way. The manifest is the signal: every other process waits
//! for it (printing what it waits for) up to a timeout.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{claim, identity, state_dir, ShardOptions};
use crate::durable::journal::{self, Fingerprint};
use crate::error::{Error, Result};
use crate::pipeline::output_header;
use crate::plan::layout::Layout;
use crate::plan::Step;
use crate::progress::Progress;
use crate::store::atomic::TempOutput;
use crate::store::{create_output_in, Block, OutputFormat, WriteMode};

/// What every process of a split step agrees on, written once by the preparer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    /// The step's journal fingerprint (what the shards must agree on).
    pub fingerprint: Fingerprint,
    /// Output rows.
    pub m: u64,
    /// Output columns.
    pub n: u64,
    /// Output tile rows.
    pub tm: u64,
    /// Output tile columns.
    pub tn: u64,
    /// Output tiles per row of tiles.
    pub gn: u64,
    /// Output tiles in all.
    pub tiles: u32,
    /// Shards per process when the processes are not told (`--shards`): decided once here
    /// ([`super::per_process`]) so that every process cuts the step the same way.
    #[serde(default = "four")]
    pub per_process: u32,
    /// Who prepared the output (`host pid N`).
    pub prepared_by: String,
    /// The output's storage tile (rows, columns): the tiles of a `.npy` output's checksum
    /// sidecar, which `finalize` writes (a `.mgt` keeps it in its own header). Absent from
    /// manifests written before `.npy` outputs could be split.
    #[serde(default)]
    pub out_tile: Option<(u64, u64)>,
}

impl Manifest {
    /// The output tiles in schedule order (the serpentine of `plan::schedule::Schedule`).
    pub(crate) fn blocks(&self) -> Vec<Block> {
        let gm = self.m.div_ceil(self.tm);
        let mut v = Vec::with_capacity(self.tiles as usize);
        for ti in 0..gm {
            for j in 0..self.gn {
                let tj = if ti % 2 == 0 { j } else { self.gn - 1 - j };
                let (r0, c0) = (ti * self.tm, tj * self.tn);
                v.push(Block {
                    r0,
                    c0,
                    rows: self.tm.min(self.m - r0),
                    cols: self.tn.min(self.n - c0),
                });
            }
        }
        v
    }
}

pub(crate) use crate::durable::split::manifest_path;

/// The manifest of `output`'s split step, if it was prepared.
pub fn read_manifest(output: &Path) -> Result<Option<Manifest>> {
    let p = manifest_path(output);
    match std::fs::read(&p) {
        Ok(b) => serde_json::from_slice(&b).map(Some).map_err(|e| {
            Error::Usage(format!(
                "{}: unreadable manifest ({e}); run `mgmm-stream prepare PLAN --restart` to start the step over",
                p.display()
            ))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(&p, "cannot read manifest", e)),
    }
}

/// Poll `ready` every 200 ms, saying once (and every 30 s) what is awaited, up to `timeout`; a
/// stop asked for meanwhile (Ctrl-C, SIGTERM, SIGHUP) ends the wait at once, as it ends a run
/// (a shard waiting for an earlier step ignored all three until SIGKILL: a new user's trial).
pub(crate) fn wait_for(
    what: &str,
    timeout: Duration,
    progress: &Progress,
    mut ready: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let t0 = Instant::now();
    let mut said = None::<Instant>;
    loop {
        if ready()? {
            return Ok(());
        }
        if crate::interrupt::requested() {
            return Err(Error::Cancelled);
        }
        if t0.elapsed() > timeout {
            return Err(Error::Usage(format!(
                "gave up after {:.0} s waiting for {what}; check that process (`mgmm-stream status PLAN`), or raise --wait-timeout",
                t0.elapsed().as_secs_f64()
            )));
        }
        if said.is_none_or(|s| s.elapsed() > Duration::from_secs(30)) {
            progress.note(&format!("waiting for {what}"));
            said = Some(Instant::now());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn check(m: &Manifest, fp: &Fingerprint, output: &Path) -> Result<()> {
    if crate::durable::journal::same_fingerprint(&m.fingerprint, fp) {
        return Ok(());
    }
    let changed: Vec<String> = m
        .fingerprint
        .iter()
        .filter(|(k, v)| fp.get(*k) != Some(*v))
        .map(|(k, v)| {
            format!(
                "{k}: prepared {v}, now {}",
                fp.get(k).map(String::as_str).unwrap_or("(none)")
            )
        })
        .collect();
    Err(Error::Usage(format!(
        "{}: this split step was prepared for a different plan, inputs or backend ({}); run `mgmm-stream prepare PLAN --restart` to start it over, or run with the same plan and backend",
        output.display(),
        changed.join("; ")
    )))
}

/// Make sure `step`'s output exists for a split run under fingerprint `fp`: prepare it, or
/// wait for the process that does.
pub(crate) fn ensure(
    step: &Step,
    layout: &Layout,
    fp: &Fingerprint,
    sh: &ShardOptions,
    progress: &Progress,
) -> Result<Manifest> {
    let out = &step.output;
    if let Some(m) = read_manifest(out)? {
        check(&m, fp, out)?;
        return Ok(m);
    }
    let dir = state_dir(out);
    if !dir.is_dir() {
        std::fs::create_dir_all(&dir)
            .map_err(|e| Error::io(&dir, "cannot create shard directory", e))?;
        crate::store::fsutil::sync_parent(&dir)?;
    }
    loop {
        match claim::try_claim(&dir.join("prepare.claim"), sh.claim_timeout)? {
            claim::Try::Got(c) => {
                let made = read_manifest(out).and_then(|m| match m {
                    Some(m) => Ok(m),
                    None => create(step, layout, fp, progress),
                });
                // Released either way: a refusal (the output exists, no space) is not a crash,
                // and the processes waiting for this claim then try at once and are told the
                // same, instead of waiting for it to go stale.
                c.release();
                let m = made?;
                check(&m, fp, out)?;
                return Ok(m);
            }
            claim::Try::Held(h) => {
                let what = format!("{} to be created by {}", out.display(), h.describe());
                let claim_path = dir.join("prepare.claim");
                wait_for(&what, sh.wait, progress, || {
                    Ok(manifest_path(out).exists() || !claim_path.exists())
                })?;
                if let Some(m) = read_manifest(out)? {
                    check(&m, fp, out)?;
                    return Ok(m);
                }
                // The preparer let go without a manifest (it failed): try ourselves.
            }
        }
    }
}

/// Create the output and its manifest (the caller holds the prepare claim).
fn create(step: &Step, layout: &Layout, fp: &Fingerprint, progress: &Progress) -> Result<Manifest> {
    let out = &step.output;
    if out.exists() {
        return Err(Error::Usage(format!(
            "{}: the output exists but was not prepared for a split run (no {}); run `mgmm-stream prepare PLAN --restart` to overwrite it, or choose another output path",
            out.display(),
            manifest_path(out).display()
        )));
    }
    let header = output_header(step, layout);
    // In the format the output's name asks for (a `.npy` with a header numpy refuses until
    // `finalize`), whole and synced under a temporary name, then moved to a name nothing has.
    let tmp = TempOutput::new(out, header.file_len())?;
    drop(create_output_in(
        OutputFormat::of(out),
        &tmp,
        header,
        WriteMode::Pwrite,
    )?);
    // A stale sidecar would describe another array; `finalize` writes this one's.
    let _ = std::fs::remove_file(crate::store::sidecar::sidecar_path(out));
    tmp.commit_new()?;
    let (gm, gn, _) = layout.grid(step);
    let m = Manifest {
        fingerprint: fp.clone(),
        m: step.m,
        n: step.n,
        tm: layout.tm,
        tn: layout.tn,
        gn,
        tiles: (gm * gn) as u32,
        per_process: super::per_process(step, layout),
        prepared_by: format!("{} pid {}", identity::host(), std::process::id()),
        out_tile: Some((header.tile_rows, header.tile_cols)),
    };
    let mp = manifest_path(out);
    let json = serde_json::to_vec_pretty(&m).expect("manifest serializes");
    let mtmp = TempOutput::new(&mp, json.len() as u64)?;
    (mtmp.file().write_all(&json)).map_err(|e| Error::io(&mp, "cannot write manifest", e))?;
    mtmp.commit()?;
    progress.note(&format!(
        "step {}: prepared {} ({}) for a split run",
        step.index + 1,
        out.display(),
        crate::progress::count(m.tiles as u64, "output tile", "output tiles")
    ));
    Ok(m)
}

/// Throw away a split step's state: output, its journal, its tiles' checkpoints and the shard
/// directory (`prepare --restart`).
pub(crate) fn reset(output: &Path) -> Result<()> {
    let partial = crate::durable::checkpoint::partial_dir(output);
    match std::fs::remove_dir_all(&partial) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(&partial, "cannot remove checkpoints", e)),
    }
    for p in [
        output.to_path_buf(),
        journal::journal_path(output),
        crate::store::sidecar::sidecar_path(output),
    ] {
        match std::fs::remove_file(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(&p, "cannot remove", e)),
        }
    }
    let dir = state_dir(output);
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(&dir, "cannot remove shard directory", e)),
    }
}

/// [`reset`] for every output of a plan at once (`prepare --restart`), all or nothing: each
/// output's files and folders are first moved aside within their folder, and removed only once
/// every move succeeded; a move that fails puts back those made, so a refusal leaves every
/// output as it was (removing them one output after another, a folder that could not be removed
/// left the outputs before it gone: a new user's trial, with an immutable `D.npy.shards`).
fn reset_all(outputs: &[&Path]) -> Result<()> {
    let mut moved: Vec<(std::path::PathBuf, std::path::PathBuf)> = Vec::new();
    for out in outputs {
        let paths = [
            crate::durable::checkpoint::partial_dir(out),
            out.to_path_buf(),
            journal::journal_path(out),
            crate::store::sidecar::sidecar_path(out),
            state_dir(out),
        ];
        for p in paths {
            if std::fs::symlink_metadata(&p).is_err() || moved.iter().any(|(q, _)| *q == p) {
                continue;
            }
            let mut aside = p.clone().into_os_string();
            aside.push(format!(".restart-{}", std::process::id()));
            let aside = std::path::PathBuf::from(aside);
            if let Err(e) = std::fs::rename(&p, &aside) {
                for (from, to) in moved.iter().rev() {
                    let _ = std::fs::rename(to, from);
                }
                return Err(Error::io(
                    &p,
                    "cannot move it aside to start the plan over (every output was left as it was)",
                    e,
                ));
            }
            moved.push((p, aside));
        }
    }
    for (_, aside) in moved {
        crate::store::fsutil::remove_any(&aside)
            .map_err(|e| Error::io(&aside, "cannot remove what the restart moved aside", e))?;
    }
    Ok(())
}

/// Who is writing `output` now, as a phrase: a process holding its journal (one process's run,
/// or a `verify`), or a shard of a split run whose claim's heartbeat is fresher than
/// `claim_timeout`; `None` when nobody is.
pub(crate) fn busy(output: &Path, claim_timeout: std::time::Duration) -> Result<Option<String>> {
    if let Some(h) = journal::holder(output) {
        return Ok(Some(h));
    }
    for (p, k, s) in super::shard_files(&state_dir(output), "claim")? {
        if let Some(h) =
            super::claim::read(&p).filter(|h| !super::claim::is_stale(h, claim_timeout))
        {
            return Ok(Some(format!(
                "shard {k}/{s} of a split run is at it ({})",
                h.describe()
            )));
        }
    }
    Ok(None)
}

/// Manifests written before `per_process` existed used 4 shards per process.
fn four() -> u32 {
    4
}

/// What [`prepare_plan`] did for one step.
#[derive(Clone, Debug)]
pub enum Prepared {
    /// The output exists, laid out for a split run as its manifest says.
    Ready {
        /// The step's index in the plan (0-based).
        step: usize,
        /// The step's output file.
        output: std::path::PathBuf,
        /// What the shard processes agree on (tiles, grid, shards per process).
        manifest: Manifest,
    },
    /// Left for later: this input does not exist yet (a step before makes it).
    Waiting {
        /// The step's index in the plan (0-based).
        step: usize,
        /// The missing input.
        input: std::path::PathBuf,
    },
}

/// `prepare PLAN` (and `mgmm_stream.dask`'s first task): generate the plan's missing inputs
/// and create each split step's output once, before the shard processes start; `restart`
/// first throws away every step's output and state (after checking the inputs, as `run
/// --restart` does). `plan` must have been laid out with [`super::for_split`].
pub fn prepare_plan(
    plan: &crate::plan::Plan,
    restart: bool,
    progress: &Progress,
) -> Result<Vec<Prepared>> {
    let sh = ShardOptions::new(super::ShardSpec::One { k: 0, s: 1 });
    let backend = crate::backend::select(&plan.engine)?;
    // `run`'s up-front checks, before `restart` throws anything away: every step laid out (a
    // plan that cannot fit fails here, untouched), the disk space, and no output, journal or
    // checkpoint folder through a link (`prepare --restart` reset the outputs first, then
    // refused a later step).
    let layouts: Vec<Layout> = (plan.steps.iter())
        .map(|step| Layout::new(&plan.path, step, &plan.engine, backend.caps()))
        .collect::<Result<_>>()?;
    crate::run::space::check_space(plan, &layouts, false)?;
    if restart {
        // Nothing is thrown away under a process that is writing it: a run holding an output's
        // journal, or a shard whose claim is fresh (`prepare --restart` deleted a running job's
        // output, and the job went on into the deleted file and reported success: a new
        // user's trial).
        for step in &plan.steps {
            if let Some(who) = busy(&step.output, sh.claim_timeout)? {
                return Err(Error::Usage(format!(
                    "{}: {who}; wait for it to finish or stop it before `prepare --restart` throws the output away",
                    step.output.display()
                )));
            }
        }
        // Finished outputs are kept when an input is found corrupt (as `run --restart`).
        crate::run::check_before_restart(plan, progress)?;
        reset_all(
            &plan
                .steps
                .iter()
                .map(|s| s.output.as_path())
                .collect::<Vec<_>>(),
        )?;
    }
    super::generate_shared(plan, &sh, progress)?;
    let mut out = Vec::new();
    for (pos, (step, layout)) in plan.steps.iter().zip(&layouts).enumerate() {
        let ins = [Some(&step.a), Some(&step.b), step.c0.as_ref()];
        let missing = ins.into_iter().flatten().find(|op| !op.path.exists());
        // An earlier step's output that this step reads and that is not finalized yet is as
        // good as missing: prepared (an unfinished `.npy` cannot even be opened, so `prepare`
        // stopped there: a new user's trial) but not written. The shards prepare this step
        // once it is finalized (`ensure`).
        let unfinished = || -> Result<Option<std::path::PathBuf>> {
            for prev in &plan.steps[..pos] {
                if super::reads(step, prev) && !is_finalized(&prev.output, None)? {
                    return Ok(Some(prev.output.clone()));
                }
            }
            Ok(None)
        };
        let waiting = match missing {
            Some(op) => Some(op.path.clone()),
            None => unfinished()?,
        };
        if let Some(input) = waiting {
            out.push(Prepared::Waiting {
                step: step.index,
                input,
            });
            continue;
        }
        if let Some(dir) = step.output.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| Error::io(dir, "cannot create output directory", e))?;
        }
        let fp = crate::run::fingerprint(step, layout, backend.caps().kind, plan.engine.precision)?;
        if is_finalized(&step.output, Some(&fp))? {
            // Complete by its journal: the file itself must still be the one finalize left
            // (a `run` checks the same before it skips a step). Prepared alone, before the
            // shards start, so starting over cannot race them.
            if let Some(why) = finished_damage(step, layout)? {
                progress.note(&format!(
                    "step {}: {} is complete by its journal, but {why}: computing it again",
                    step.index + 1,
                    step.output.display()
                ));
                reset(&step.output)?;
            }
        }
        let manifest = ensure(step, layout, &fp, &sh, progress)?;
        out.push(Prepared::Ready {
            step: step.index,
            output: step.output.clone(),
            manifest,
        });
    }
    Ok(out)
}

/// Why a split step that its journal calls finalized cannot be skipped: its output is missing,
/// or its length, header or checksums are not what finalize left (`store::mend_finished`,
/// which writes a damaged header again); `None` when it is intact.
pub(crate) fn finished_damage(step: &Step, layout: &Layout) -> Result<Option<String>> {
    if !step.output.exists() {
        return Ok(Some("the file is missing".into()));
    }
    crate::store::mend_finished(&step.output, &output_header(step, layout))
}

/// Whether `output`'s journal marks the step complete (for fingerprint `fp`, when given). The
/// output itself may be gone: callers that report a finished file check that too (`status`,
/// `finalize`'s chain intermediates); a shard run names `prepare` for it.
pub(crate) fn is_finalized(output: &Path, fp: Option<&Fingerprint>) -> Result<bool> {
    Ok(journal::peek(output)?.is_some_and(|p| {
        p.complete && fp.is_none_or(|f| journal::same_fingerprint(&p.fingerprint, f))
    }))
}
