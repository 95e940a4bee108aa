//! Finishing a split step: every tile accounted for, every journal record checked against the
//! bytes, the checksum table written, the shard journals merged into the step's journal.
//!
//! A `.npy` output gets its checksum sidecar and, last, the real header that makes it an array
//! numpy loads (until then its header is one numpy refuses).
//!
//! `finalize` runs once per step — explicitly (`mgmm-stream finalize PLAN`) or by the process
//! that finds every tile done after its last shard (claimed through `finalize.claim`, so two
//! such processes do not both do it). It refuses while tiles are missing and names the shards;
//! a tile whose bytes do not match any record (a node died before its writes reached the
//! filesystem) is named too, and its shard's `.done` marker removed so that a rerun redoes it.
//! It reads the output once, whatever the shards' page caches held: each tile is checked against
//! its journal records, and the checksum table is made of the CRCs so checked — except the
//! tiles the finalizing process itself wrote and recorded in this run, on a local disk
//! ([`Own`]): their bytes are in the page cache every reader of the node sees.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use rayon::prelude::*;

use super::prepare::{is_finalized, read_manifest, wait_for, Manifest};
use super::{claim, recorded, shard_files, shard_range, state_dir, ShardOptions};
use crate::dtype::DType;
use crate::durable::journal;
use crate::error::{Error, Result};
use crate::plan::{Plan, Step};
use crate::progress::Progress;
use crate::store::{
    block_crc, open_as_written, reopen_output, Header, OutputFormat, TiledFile, WriteMode,
};

/// What finalize found and did.
pub(crate) struct Finalized {
    pub(crate) tiles: u32,
    /// Of `tiles`, those read back to be checked (the rest this process wrote, [`Own`]).
    pub(crate) read: u32,
    pub(crate) secs: f64,
}

/// The tiles of a step this process wrote and recorded in this run (seq → CRC): `finalize`
/// need not read them back when the output is on a local disk and no other record of the tile
/// disagrees. Their bytes went into the page cache, which is the file for every reader of the
/// node, before their records — unlike a record found in a journal, which may have outlived its
/// tile's bytes (a machine that went down with `durable = false`) or come from another node
/// (NFS: a write that never reached the server). What this trusts: data written before its
/// record, and no other writer of the tile since. What it no longer catches for these tiles
/// (as for the checksum table of an unsplit run): a stray write of this process elsewhere in
/// the file, memory corrupted after the copy, a writeback error the kernel never reported.
/// One per [`super::run_step_shards`] call: a Dask shard task's own tiles only.
#[derive(Clone, Default)]
pub(crate) struct Own(std::sync::Arc<std::sync::Mutex<BTreeMap<u32, u32>>>);

impl Own {
    pub(crate) fn note(&self, seq: u32, crc: u32) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(seq, crc);
    }
    fn get(&self) -> BTreeMap<u32, u32> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Finalize `step` now if every tile is recorded and nobody else is at it; otherwise nothing,
/// saying how many tiles are done when `tell` (after this process's shards; not while it polls
/// an earlier step, [`wait_finalized`], which said it every 0.2 s). `own`: the tiles this
/// process wrote in this run ([`Own`]).
pub(crate) fn try_auto(
    plan: &Plan,
    step: &Step,
    sh: &ShardOptions,
    progress: &Progress,
    own: &Own,
    tell: bool,
) -> Result<()> {
    let Some(m) = read_manifest(&step.output)? else {
        return Ok(());
    };
    if is_finalized(&step.output, Some(&m.fingerprint))? {
        return Ok(());
    }
    let rec = recorded(&state_dir(&step.output), &m.fingerprint)?;
    if rec.len() < m.tiles as usize {
        if !tell {
            return Ok(());
        }
        // This process's shards are done, others are not: say so, or a finished shard's
        // "done" reads as the step's.
        progress.note(&format!(
            "step {}: {} of {} output tiles of {} are done; the step is not finished until the other shards run (`mgmm-stream status PLAN` names them), and the last of them finalizes it",
            step.index + 1,
            rec.len(),
            m.tiles,
            step.output.display()
        ));
        return Ok(());
    }
    let cp = state_dir(&step.output).join("finalize.claim");
    let t = std::time::Instant::now();
    let got = claim::try_claim(&cp, sh.claim_timeout)?;
    crate::trace::span("start-up", "finalize: claim", t, std::time::Instant::now());
    if let claim::Try::Got(c) = got {
        let r = if is_finalized(&step.output, Some(&m.fingerprint))? {
            Ok(())
        } else {
            finalize_step(step, &m, plan.engine.durable, &own.get()).map(|f| {
                progress.note(&format!(
                    "step {}: finalized {} ({} checked{}, checksum table written) in {:.2} s",
                    step.index + 1,
                    step.output.display(),
                    crate::progress::count(f.tiles as u64, "tile", "tiles"),
                    if f.read < f.tiles {
                        format!(", {} read back: the rest this process wrote", f.read)
                    } else {
                        String::new()
                    },
                    f.secs
                ))
            })
        };
        c.release();
        r?;
    }
    let _ = plan;
    Ok(())
}

/// Wait until `prev` (a step before the one about to run) is finalized, finalizing it
/// ourselves if every tile is done and its finalizer is gone.
pub(crate) fn wait_finalized(
    plan: &Plan,
    prev: &Step,
    sh: &ShardOptions,
    progress: &Progress,
) -> Result<()> {
    let what = format!(
        "step {} ({}) to be finalized by the processes working it",
        prev.index + 1,
        prev.output.display()
    );
    wait_for(&what, sh.wait, progress, || {
        if is_finalized(&prev.output, None)? {
            return Ok(true);
        }
        try_auto(plan, prev, sh, progress, &Own::default(), false)?;
        is_finalized(&prev.output, None)
    })
}

/// The shards (of the split most recently worked) that hold `tiles`, as text, and remove
/// their `.done` markers so a rerun works them again.
fn name_shards(output: &Path, m: &Manifest, tiles: &[u32]) -> Result<String> {
    let dir = state_dir(output);
    let mut newest: Option<(std::time::SystemTime, u32)> = None;
    for ext in ["claim", "done", "journal"] {
        for (p, _, s) in shard_files(&dir, ext)? {
            if let Ok(t) = std::fs::metadata(&p).and_then(|md| md.modified()) {
                if newest.is_none_or(|(n, _)| t > n) {
                    newest = Some((t, s));
                }
            }
        }
    }
    for (p, k, s) in shard_files(&dir, "done")? {
        let r = shard_range(m.tiles, m.gn as u32, s, k);
        if tiles.iter().any(|t| r.contains(t)) {
            let _ = std::fs::remove_file(p);
        }
    }
    let Some((_, s)) = newest else {
        return Ok(format!("tiles {}", list(tiles)));
    };
    let mut parts = Vec::new();
    for k in 0..s {
        let r = shard_range(m.tiles, m.gn as u32, s, k);
        let inside: Vec<u32> = tiles.iter().copied().filter(|t| r.contains(t)).collect();
        if !inside.is_empty() {
            parts.push(format!(
                "shard {k}/{s} ({} of its {} tiles: {})",
                inside.len(),
                r.len(),
                list(&inside)
            ));
        }
    }
    Ok(parts.join(", "))
}

fn list(t: &[u32]) -> String {
    let mut s: Vec<String> = t.iter().take(8).map(|x| x.to_string()).collect();
    if t.len() > 8 {
        s.push(format!("… {} more", t.len() - 8));
    }
    s.join(" ")
}

/// Finalize a split step whose manifest is `m`. Needs no backend: the manifest holds the
/// fingerprint and tile grid. `own`: tiles this process wrote and recorded in this run, with
/// their CRCs ([`Own`]), taken as checked when the output is on a local disk.
pub(crate) fn finalize_step(
    step: &Step,
    m: &Manifest,
    durable: bool,
    own: &BTreeMap<u32, u32>,
) -> Result<Finalized> {
    let t0 = std::time::Instant::now();
    let out = &step.output;
    let rec: BTreeMap<u32, Vec<u32>> = recorded(&state_dir(out), &m.fingerprint)?;
    let missing: Vec<u32> = (0..m.tiles).filter(|t| !rec.contains_key(t)).collect();
    if !missing.is_empty() {
        return Err(Error::Usage(format!(
            "step {}: cannot finalize {}: {} of {} output tiles are not done — {}; run those shards (`mgmm-stream run PLAN --shard K/S`) or resubmit the job, then finalize again",
            step.index + 1,
            out.display(),
            missing.len(),
            m.tiles,
            name_shards(out, m, &missing)?
        )));
    }
    // Any output format: `.mgt`, or a `.npy` whose unfinished header the engine reads.
    let tc = std::time::Instant::now();
    let file = open_as_written(out)?;
    let local = crate::store::fsutil::path_on_local_disk(out);
    let empty = BTreeMap::new();
    let own = if local { own } else { &empty };
    let dt = file.dtype();
    let blocks = m.blocks();
    let checked: Vec<Result<(u32, Option<u32>, bool)>> = blocks
        .par_iter()
        .enumerate()
        .map(|(i, b)| {
            let recs = &rec[&(i as u32)];
            // Written and recorded by this process in this run, on a local disk: in the file —
            // unless another writer recorded other bytes for it (a shard taken over from a
            // stalled owner that went on writing): then the file decides.
            let agreed = |c: &&u32| recs.iter().all(|r| r == *c);
            if let Some(&crc) = own.get(&(i as u32)).filter(agreed) {
                return Ok((i as u32, Some(crc), false));
            }
            let crc = block_crc(&*file, b, dt)?;
            Ok((i as u32, recs.contains(&crc).then_some(crc), true))
        })
        .collect();
    let mut good = Vec::with_capacity(blocks.len());
    let mut bad = Vec::new();
    let mut read = 0;
    for r in checked {
        let (i, crc, was_read) = r?;
        read += u32::from(was_read);
        match crc {
            Some(c) => good.push((i, c)),
            None => bad.push(i),
        }
    }
    if !bad.is_empty() {
        return Err(Error::Usage(format!(
            "step {}: cannot finalize {}: {} output tile(s) do not hold the bytes their journals record (a node may have died before its writes reached the filesystem) — {}; rerun the job: those tiles are recomputed",
            step.index + 1,
            out.display(),
            bad.len(),
            name_shards(out, m, &bad)?
        )));
    }
    drop(file);
    crate::trace::span("start-up", "finalize: check", tc, std::time::Instant::now());
    let tt = std::time::Instant::now();
    // The checksums of every tile (a `.mgt`'s table; a `.npy`'s sidecar, then its real
    // header, last), synced with the data when `durable` (`engine.durable`) or the output is
    // not on a local disk (as the shards' writes, `ShardWriter::finish`).
    let sync = durable || !local;
    // The table is made of the CRCs just checked (a tile that is one storage tile is not read a
    // second time; on one H100 a Dask task's 4 GiB output was read twice here).
    let sink = reopen_output(out, output_header_of(out, m, dt)?, WriteMode::Pwrite)?;
    for &(i, crc) in &good {
        sink.know_checksum(&blocks[i as usize], crc);
    }
    sink.finish(sync)?;
    let tj = std::time::Instant::now();
    crate::trace::span("start-up", "finalize: table", tt, tj);
    journal::write_complete(out, &m.fingerprint, &good, sync)?;
    crate::trace::span(
        "start-up",
        "finalize: journal",
        tj,
        std::time::Instant::now(),
    );
    Ok(Finalized {
        tiles: m.tiles,
        read,
        secs: t0.elapsed().as_secs_f64(),
    })
}

/// The header the prepared output `out` was created with: a `.mgt`'s own; for a `.npy`, its
/// shape and dtype with the storage tile the manifest records.
fn output_header_of(out: &Path, m: &Manifest, dt: DType) -> Result<Header> {
    match OutputFormat::of(out) {
        OutputFormat::Mgt => Ok(TiledFile::open(out)?.hdr),
        OutputFormat::Npy => {
            let (tr, tc) = m.out_tile.ok_or_else(|| {
                Error::Usage(format!(
                    "{}: its manifest does not record the output's storage tile (written by an older version); run `mgmm-stream prepare PLAN --restart` to start the step over",
                    out.display()
                ))
            })?;
            Ok(Header::new(dt, m.m, m.n, tr, tc, true))
        }
    }
}

/// `finalize PLAN`: finalize every split step that is not yet, in order; with `verify`, run
/// Freivalds' test on each after. Each line of what it did goes to `say` (the CLI prints them;
/// Python returns them).
pub fn finalize_plan(
    plan: &Plan,
    verify: Option<&crate::verify::Verifier>,
    say: &mut dyn FnMut(String),
) -> Result<()> {
    let mut any = false;
    for step in &plan.steps {
        let n = step.index + 1;
        let Some(m) = read_manifest(&step.output)? else {
            if is_finalized(&step.output, None)? {
                say(format!(
                    "step {n}: {} is complete (not split)",
                    step.output.display()
                ));
                continue;
            }
            // An intermediate of a chain whose product is complete: an unsplit run removed it
            // with its shards' folder (`run::finished::remove_chain_temps`), nothing to do.
            if let Some(c) = (step.chain.as_ref())
                .filter(|c| c.part < c.parts && !step.output.exists())
                .filter(|c| c.root_output.exists())
                .filter(|c| is_finalized(&c.root_output, None).unwrap_or(false))
            {
                say(format!(
                    "step {n}: {} is an intermediate of the chain written to {}, removed once the chain completed",
                    step.output.display(),
                    c.root_output.display()
                ));
                continue;
            }
            return Err(Error::Usage(format!(
                "step {n}: {} was never prepared for a split run (no {}); run the job first",
                step.output.display(),
                super::prepare::manifest_path(&step.output).display()
            )));
        };
        any = true;
        // One finalizer at a time, as the shards' own (`try_auto`): another process (a
        // shard that found every tile done, a second `finalize`) may be at it right now.
        let mut done = None;
        let cp = state_dir(&step.output).join("finalize.claim");
        while !is_finalized(&step.output, Some(&m.fingerprint))? {
            if let claim::Try::Got(c) = claim::try_claim(&cp, Duration::from_secs(120))? {
                let r = match is_finalized(&step.output, Some(&m.fingerprint))? {
                    true => Ok(None),
                    false => {
                        finalize_step(step, &m, plan.engine.durable, &BTreeMap::new()).map(Some)
                    }
                };
                c.release();
                done = r?;
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        if let Some(f) = done {
            say(format!("step {n}: finalized {}: {} checked against their journals, checksum table written ({:.2} s)",
                step.output.display(),
                crate::progress::count(f.tiles as u64, "tile", "tiles"),
                f.secs
            ));
        } else {
            say(format!(
                "step {n}: {} is already finalized",
                step.output.display()
            ));
        }
        // A chain's intermediate is checked with its last part, as `verify` does.
        if let Some(v) = verify.filter(|_| !crate::verify::is_intermediate(step)) {
            let rep = v.step(step)?;
            say(crate::verify::format(&rep));
            if !rep.pass {
                let next = match rep.failing_tiles.is_empty() {
                    false => "`mgmm-stream verify PLAN --repair` recomputes the failing tiles",
                    true => "see the reason above",
                };
                return Err(Error::Usage(format!(
                    "step {n}: verification failed for {}; {next}",
                    step.output.display()
                )));
            }
        }
    }
    if !any {
        say("nothing to finalize: no step of this plan was split".into());
    }
    Ok(())
}
