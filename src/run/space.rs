//! Disk-space and filesystem checks made before any work, so a plan that cannot finish on its
//! disks fails at start-up with the numbers, untouched, instead of hours later.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::durable::checkpoint;
use crate::error::{Error, Result};
use crate::pipeline;
use crate::plan::layout::Layout;
use crate::plan::Plan;
use crate::store::fsutil;
use crate::units::fmt_bytes;

fn existing_dir(p: &Path) -> PathBuf {
    let mut d = p
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    if d.as_os_str().is_empty() {
        d = PathBuf::from(".");
    }
    while !d.exists() {
        match d.parent() {
            Some(p) if !p.as_os_str().is_empty() => d = p.to_path_buf(),
            _ => return PathBuf::from("."),
        }
    }
    d
}

/// Refuse to start when the files this plan will create do not fit on their filesystems; with
/// `unsplit`, the chain intermediates held in memory create none.
pub(crate) fn check_space(plan: &Plan, layouts: &[Layout], unsplit: bool) -> Result<()> {
    let mut need: BTreeMap<PathBuf, (u64, Vec<String>)> = BTreeMap::new();
    for d in &plan.matrices {
        if let (Some(g), false) = (&d.generate, d.path.exists()) {
            let h = crate::store::Header::new(g.dtype, g.rows, g.cols, g.tile.0, g.tile.1, true);
            let e = need.entry(existing_dir(&d.path)).or_default();
            e.0 += h.file_len();
            e.1.push(d.path.display().to_string());
        }
    }
    for (s, l) in plan.steps.iter().zip(layouts) {
        let in_memory = unsplit && s.output_in_memory();
        // `run` writes no output or journal through a link (`fsutil::refuse_link`,
        // `journal::refuse_odd`), and keeps checkpoints only in a folder of their own: said
        // before any work — before `--restart` resets a step's journal — and by `plan`, rather
        // than when the step opens its output.
        if !in_memory {
            fsutil::refuse_link(&s.output)?;
            // A split run's shard folder too: its manifest, claims and tile records are written
            // and `prepare --restart` empties it (it used to replace a linked folder silently).
            if !unsplit {
                fsutil::refuse_link(&crate::durable::split::state_dir(&s.output))?;
            }
            checkpoint::refuse_unusable_dir(&checkpoint::partial_dir(&s.output))?;
            crate::durable::journal::refuse_odd(&s.output)?;
        }
        if !s.output.exists() && !in_memory {
            let h = pipeline::output_header(s, l);
            let e = need.entry(existing_dir(&s.output)).or_default();
            // Beside the output: its journal (a record per tile) and, for a `.npy`, the
            // checksum sidecar (4 bytes per storage tile): a generous 64 bytes per tile.
            let (gm, gn, _) = l.grid(s);
            let beside = 4096 + 64 * gm * gn + 64 * h.tiles();
            e.0 += crate::store::output_file_len(&s.output, &h) + beside;
            e.1.push(s.output.display().to_string());
        }
    }
    for (dir, (bytes, files)) in need {
        if fsutil::read_only(&dir) {
            return Err(Error::Usage(format!(
                "{} is on a read-only filesystem; cannot create {}",
                dir.display(),
                files.join(", ")
            )));
        }
        // A folder the user may not write to (permissions, not a read-only mount): said once,
        // naming the folder, instead of by the first file `run` fails to create in it.
        // A temporary file of its own, removed at once (`store::atomic`).
        match crate::store::atomic::TempOutput::new(&dir.join(".mgmm-stream-probe"), 0) {
            Ok(probe) => drop(probe),
            Err(Error::Io { source: e, .. })
                if e.kind() == std::io::ErrorKind::PermissionDenied =>
            {
                return Err(Error::Usage(format!(
                    "cannot create files in {} ({e}), where {} would be written; choose a folder you can write to, or change its permissions",
                    dir.display(),
                    files.join(", ")
                )));
            }
            Err(_) => {}
        }
        if let Some(free) = fsutil::free_bytes(&dir) {
            if free < bytes {
                // Exact bytes where rounding would show the two as equal.
                let (b, f) = match (fmt_bytes(bytes), fmt_bytes(free)) {
                    (b, f) if b == f => (format!("{bytes} bytes"), format!("{free} bytes")),
                    bf => bf,
                };
                return Err(Error::Usage(format!(
                    "not enough disk space in {}: this plan needs {b} more ({}, with their journals and checksums) but {f} is free; free some space or move the outputs elsewhere",
                    dir.display(),
                    files.join(", "),
                )));
            }
        }
    }
    Ok(())
}

/// The files a job owns, each with its role for messages: the plan file (when there is one), the
/// matrices it reads (and their checksum sidecars), and per step its output, the output's
/// journal, checksums and checkpoint folder. What `--report` and `MGMM_TRACE` must never name
/// ([`refuse_over`]).
pub fn job_files(
    plan_file: Option<&Path>,
    matrices: &[(String, PathBuf)],
    steps: &[crate::plan::Step],
) -> Vec<(String, PathBuf)> {
    use crate::store::sidecar::sidecar_path;
    let mut named: Vec<(String, PathBuf)> = plan_file
        .map(|p| ("the plan file".to_string(), p.to_path_buf()))
        .into_iter()
        .collect();
    for (name, path) in matrices {
        let what = format!("the matrix `{name}`");
        named.push((format!("the checksums of {what}"), sidecar_path(path)));
        named.push((what, path.clone()));
    }
    for s in steps.iter().filter(|s| !s.output_in_memory()) {
        let n = s.index + 1;
        let what = format!("the output of step {n}");
        let o = &s.output;
        named.push((
            format!("the journal of step {n}"),
            crate::durable::journal::journal_path(o),
        ));
        named.push((format!("the checksums of {what}"), sidecar_path(o)));
        named.push((
            format!("the checkpoint folder of step {n}"),
            checkpoint::partial_dir(o),
        ));
        named.push((what, o.clone()));
    }
    named
}

/// [`job_files`] of a plan.
pub fn plan_files(plan: &Plan) -> Vec<(String, PathBuf)> {
    let mats: Vec<(String, PathBuf)> = (plan.matrices.iter())
        .map(|m| (m.name.clone(), m.path.clone()))
        .collect();
    job_files(Some(&plan.path), &mats, &plan.steps)
}

/// Refuse `path` (`what`: the flag or variable that named it, `--report ` or `MGMM_TRACE=`)
/// when it is one of `named` (the job's own files, [`job_files`]): the report or timeline
/// written there at the end would replace it, whatever it holds (a journal is JSON too).
pub fn refuse_over(named: &[(String, PathBuf)], path: &Path, what: &str) -> Result<()> {
    let (doc, eg) = match what.starts_with("MGMM_TRACE") {
        true => ("timeline", "trace.json"),
        false => ("report", "run.json"),
    };
    // The file itself, or — for the checkpoint folder, which a step creates and removes — any
    // path inside it (a report there was lost when the step removed the folder).
    let inside = |which: &str, f: &Path| {
        which.starts_with("the checkpoint folder")
            && path
                .ancestors()
                .skip(1)
                .any(|a| crate::plan::same_file(f, a))
    };
    let hit = named.iter().find_map(|(which, f)| match crate::plan::same_file(f, path) {
        true => Some(format!(
            "that is {which}, which the {doc} written at the end would replace"
        )),
        false if inside(which, f) => Some(format!(
            "that is inside {which}, which the step removes: the {doc} written at the end would be lost"
        )),
        false => None,
    });
    match hit {
        Some(which) => Err(Error::Usage(format!(
            "{what}{}: {which}; give a new path, e.g. {eg}",
            path.display(),
        ))),
        None => Ok(()),
    }
}

/// [`refuse_over`] for the `MGMM_TRACE` path of the environment, if one is set (the Python
/// package's calls, which record a timeline per call).
pub fn refuse_trace_over(named: &[(String, PathBuf)]) -> Result<()> {
    match crate::config::Settings::from_env().trace {
        Some(t) => refuse_over(named, &t, "MGMM_TRACE="),
        None => Ok(()),
    }
}
