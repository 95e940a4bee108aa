//! One step split across processes and nodes, coordinated only through files on a shared
//! filesystem — for SLURM, Kubernetes Indexed Jobs, `mpirun` or any launcher, with no network
//! protocol and no scheduler of its own (docs/CLUSTER.md).
//!
//! A step's output tiles, in schedule order, are cut into S shards ([`shard_range`]: whole
//! rows of output tiles when there are at least S of them, so a shard covers a contiguous,
//! stripe-friendly band of the file). Beside the output `C.mgt` lives `C.mgt.shards/`:
//!
//! | file | written by | meaning |
//! |---|---|---|
//! | `manifest.json` | the preparer, once | the output exists; fingerprint and tile grid |
//! | `shard-K-of-S.claim` | `O_EXCL` create, heartbeat mtime | a process is working shard K |
//! | `shard-K-of-S.done` | the claim, renamed | shard K finished |
//! | `shard-K-of-S.journal` | the claim holder | tiles finished (same records as the step journal) |
//! | `finalize.claim` | `O_EXCL` create | one process is finalizing |
//!
//! A process works shard after shard ([`run_step_shards`]): its own first, then any unclaimed
//! one, so a fast node takes more. The output is created once (temporary name + `link`, see
//! [`prepare`]) and written through a shared map on a local disk (the node's processes share its
//! page cache) and with `pwrite` elsewhere (a mapping is not coherent across NFS clients;
//! [`writer`]). The process that sees every tile done finalizes ([`finalize`]): it checks
//! every journal record against the bytes (one read; on a local disk not its own records of
//! this run, [`finalize::Own`]), writes the checksum table and the step's
//! merged journal. Journals record tiles, not shard ids, so a rerun with another S or process
//! count resumes from whatever is done.

pub(crate) mod claim;
pub mod finalize;
pub(crate) mod identity;
pub(crate) mod model;
pub mod prepare;
pub(crate) mod status;
pub(crate) mod target;
pub(crate) mod writer;

pub(crate) use crate::durable::split::split_state;
pub use crate::durable::split::state_dir;

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::backend::Backend;
use crate::durable::journal;
use crate::error::{Error, Result};
use crate::plan::layout::Layout;
use crate::plan::{Plan, Step};
use crate::progress::Progress;
use crate::report::StepReport;
use crate::run::{PlanStep, RunOptions, Split};
use target::ShardTarget;

/// This process's part in a split run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ShardSpec {
    /// `--shard K/S`: shard K of S and nothing else.
    One { k: u32, s: u32 },
    /// Rank `rank` of `size` processes over `shards` shards (`None`: chosen per step, see
    /// [`ShardSpec::shards`]): its own shards (rank, rank+size, …) first, then any unclaimed one.
    Rank {
        rank: u32,
        size: u32,
        shards: Option<u32>,
        source: &'static str,
    },
}

impl ShardSpec {
    /// How many shards a step is cut into: as asked, or by default `size` times the shards per
    /// process that the step's preparer recorded (see [`per_process`]).
    pub(crate) fn shards(&self, per_process: u32) -> u32 {
        match *self {
            ShardSpec::One { s, .. } => s,
            ShardSpec::Rank {
                shards: Some(s), ..
            } => s,
            ShardSpec::Rank {
                size, shards: None, ..
            } => size.saturating_mul(per_process.max(1)),
        }
    }

    /// The shards of `shards` this process tries, in order.
    pub(crate) fn order(&self, shards: u32) -> Vec<u32> {
        match *self {
            ShardSpec::One { k, .. } => vec![k],
            ShardSpec::Rank { rank, size, .. } => {
                let own = (rank..shards).step_by(size.max(1) as usize);
                let start = (rank as u64 * shards as u64 / size.max(1) as u64) as u32;
                let rest = (0..shards)
                    .map(|i| (i + start) % shards)
                    .filter(|k| k % size.max(1) != rank % size.max(1));
                own.chain(rest).collect()
            }
        }
    }
}

/// Shards per process when none are asked for. Shards are bands of output tile rows, and each
/// band reads all of op(B). When op(B)'s tiles and one row panel of op(A) fit in a lane's tile
/// cache, one process's tiles share one read of op(B), and every extra shard reads it again:
/// two processes with one GPU each took 1.13× one process with two GPUs at 4 shards per
/// process, and 0.91× at one (n = 32768, docs/measurements/2026-11-30-cluster-two-procs-4.log).
/// So: 1. Otherwise every band of tiles reads op(B) again anyway, so smaller shards cost
/// nothing extra and 4 per process let a fast node take more. The preparer decides it once and
/// records it in the manifest, so every process of the step cuts it the same way.
pub(crate) fn per_process(step: &Step, layout: &Layout) -> u32 {
    let (_, gn, gk) = layout.grid(step);
    if layout.slots as u64 >= gk.saturating_mul(gn).saturating_add(gk) {
        1
    } else {
        4
    }
}

/// How a split run behaves, beyond which shards it takes.
#[derive(Clone, Debug)]
pub struct ShardOptions {
    pub(crate) spec: ShardSpec,
    /// A claim whose heartbeat is older than this is presumed dead and taken over.
    pub(crate) claim_timeout: Duration,
    /// How long to wait for the output to be created or the previous step finalized.
    pub(crate) wait: Duration,
    /// With one shard (`ShardSpec::One`) whose claim another process holds: wait until that
    /// shard is done (nothing is left to do) or its claim goes stale (take it over), instead of
    /// refusing. A task scheduler's retry of a shard whose worker died needs this
    /// (`mgmm_stream.dask`); `run --shard` refuses, so two array tasks never share a shard.
    pub(crate) wait_for_held: bool,
}

impl ShardOptions {
    pub(crate) fn new(spec: ShardSpec) -> ShardOptions {
        ShardOptions {
            spec,
            claim_timeout: Duration::from_secs(120),
            wait: Duration::from_secs(3600),
            wait_for_held: false,
        }
    }

    /// Shard `k` of `s` and nothing else (`run --shard K/S`), with the claim and wait
    /// timeouts; `wait_for_held` as [`ShardOptions::wait_for_held`].
    pub fn one_shard(
        k: u32,
        s: u32,
        claim_timeout: Duration,
        wait: Duration,
        wait_for_held: bool,
    ) -> Result<ShardOptions> {
        if s == 0 || k >= s {
            return Err(Error::Usage(format!(
                "shard {k} of {s} does not exist: shards are numbered 0 to S-1, S at least 1"
            )));
        }
        Ok(ShardOptions {
            spec: ShardSpec::One { k, s },
            claim_timeout: claim_timeout.max(Duration::from_millis(500)),
            wait,
            wait_for_held,
        })
    }
}

/// Lay `plan` out for a split run: a tile that does not depend on the GPUs of the process
/// that lays it out, since the preparer and the shard processes may see different counts
/// (`Engine::even_rows`), and every chain intermediate in its file. `prepare`, `run --shard`
/// and the Python shards all call this.
pub fn for_split(plan: &mut Plan) {
    plan.engine.even_rows = false;
    // A split run writes every intermediate of a chain to its file, for the other processes:
    // none is held in memory, and messages name the file (they said "T1 (held in memory)"
    // while the shards wrote `D.npy.part1.mgt`: a new user's trial).
    for step in &mut plan.steps {
        if let Some(c) = step.chain.as_mut() {
            c.memory.clear();
        }
    }
}

/// The tiles (schedule sequence numbers) of shard `k` of `s`, for a step of `total` tiles in
/// rows of `gn`: whole rows when there are at least `s` rows, else an even cut of the order.
pub(crate) fn shard_range(total: u32, gn: u32, s: u32, k: u32) -> Range<u32> {
    let (total, gn, s, k) = (total as u64, gn.max(1) as u64, s as u64, k as u64);
    let gm = total / gn;
    let r = if gm >= s {
        (k * gm / s * gn)..((k + 1) * gm / s * gn)
    } else {
        (k * total / s)..((k + 1) * total / s)
    };
    r.start as u32..r.end as u32
}

/// A shard file's path: `shard-K-of-S.EXT`.
pub(crate) fn shard_file(dir: &Path, k: u32, s: u32, ext: &str) -> PathBuf {
    dir.join(format!("shard-{k}-of-{s}.{ext}"))
}

/// Parse `shard-K-of-S.EXT` back into (K, S, EXT).
pub(crate) fn parse_shard_file(name: &str) -> Option<(u32, u32, &str)> {
    let rest = name.strip_prefix("shard-")?;
    let (k, rest) = rest.split_once("-of-")?;
    let (s, ext) = rest.split_once('.')?;
    Some((k.parse().ok()?, s.parse().ok()?, ext))
}

/// Every finished tile any shard journal in `dir` records under fingerprint `fp`, with every
/// CRC recorded for it (a tile redone after a takeover may appear twice).
pub fn recorded(dir: &Path, fp: &journal::Fingerprint) -> Result<BTreeMap<u32, Vec<u32>>> {
    let mut out: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for (path, _, _) in shard_files(dir, "journal")? {
        let Some(peek) = journal::peek_file(&path)? else {
            continue;
        };
        if !journal::same_fingerprint(&peek.fingerprint, fp) {
            continue;
        }
        for (seq, crc) in peek.done {
            let v = out.entry(seq).or_default();
            if !v.contains(&crc) {
                v.push(crc);
            }
        }
    }
    Ok(out)
}

/// The files `shard-K-of-S.EXT` in `dir`, as (path, K, S).
pub(crate) fn shard_files(dir: &Path, ext: &str) -> Result<Vec<(PathBuf, u32, u32)>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(dir, "cannot list shard directory", e)),
    };
    let mut v = Vec::new();
    for ent in rd {
        let ent = ent.map_err(|e| Error::io(dir, "cannot list shard directory", e))?;
        let name = ent.file_name().to_string_lossy().to_string();
        if let Some((k, s, x)) = parse_shard_file(&name) {
            if x == ext {
                v.push((ent.path(), k, s));
            }
        }
    }
    v.sort_by_key(|(_, k, s)| (*s, *k));
    Ok(v)
}

/// Generate the plan's missing inputs once among all processes: the first to claim
/// `X.generating` writes `X` under a temporary name and renames it; the others wait for it.
pub(crate) fn generate_shared(
    plan: &Plan,
    sh: &ShardOptions,
    progress: &Progress,
) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for (d, spec) in crate::run::to_generate(plan)? {
        let claim_path = d.path.with_extension("mgt.generating");
        match claim::try_claim(&claim_path, sh.claim_timeout)? {
            claim::Try::Got(c) => {
                if !d.path.exists() {
                    // Appears whole or not at all (`store::atomic`).
                    crate::store::gen::generate(&d.path, spec)?;
                    progress.note(&format!("generated {}", d.path.display()));
                    out.push(d.path.display().to_string());
                }
                c.release();
            }
            claim::Try::Held(h) => {
                let what = format!("{} to be generated by {}", d.path.display(), h.describe());
                prepare::wait_for(&what, sh.wait, progress, || Ok(d.path.exists()))?;
            }
        }
    }
    Ok(out)
}

/// Run `plan` as this process's part of a split run (`run PLAN --shard`, or a launcher's
/// rank): the plan's run, each step worked shard by shard ([`run_step_shards`]).
pub fn run_plan(
    plan: &Plan,
    opts: &RunOptions,
    sh: &ShardOptions,
    progress: &Progress,
) -> Result<crate::run::RunReport> {
    crate::run::run_plan_split(plan, opts, progress, Some(sh))
}

impl Split for ShardOptions {
    fn generate(&self, plan: &Plan, progress: &Progress) -> Result<Vec<String>> {
        generate_shared(plan, self, progress)
    }

    fn run_step(
        &self,
        cx: &PlanStep<'_>,
        backend: &mut Box<dyn Backend>,
    ) -> Result<Vec<StepReport>> {
        run_step_shards(cx, backend, self)
    }
}

/// Whether `step` reads `prev`'s output — as A, B or the added C0, or, for a part of a
/// whole-expression chain, as any leaf of the chain (every part's fingerprint holds every leaf's
/// identity, so a part that multiplies none of an earlier output still opens it: `C @ (D @ E)`
/// after a step writing C) — by the files' identities: another spelling of the same path
/// (`./D.mgt`, a folder through a link) is the same file.
pub(super) fn reads(step: &Step, prev: &Step) -> bool {
    let out = crate::store::fsutil::identity_path(&prev.output);
    let leaves = step.chain.iter().flat_map(|c| c.leaves.iter());
    [Some(&step.a), Some(&step.b), step.c0.as_ref()]
        .into_iter()
        .flatten()
        .chain(leaves)
        .any(|op| op.path == prev.output || crate::store::fsutil::identity_path(&op.path) == out)
}

/// Run this process's share of a step: wait for the steps before it to be finalized, make
/// sure the output exists, work shards while there are unclaimed ones, and finalize the step
/// when every tile is done. Returns one report per shard this process computed.
fn run_step_shards(
    cx: &PlanStep<'_>,
    backend: &mut Box<dyn Backend>,
    sh: &ShardOptions,
) -> Result<Vec<StepReport>> {
    let (plan, step, layout, progress) = (cx.plan, cx.step, cx.layout, cx.progress);
    let n = step.index + 1;
    // The steps before this one in the plan's list whose outputs it reads: a whole-expression
    // chain's parts are steps of their own that share their user step's `index` (waiting on
    // `..index` let a chain's second part start before its first was finalized, and read it
    // unwritten). A step that reads none of them does not wait (it waited for every earlier
    // step, so shards run one after another waited for another process's share of an
    // independent step: a new user's trial). Those it reads waited for theirs in turn.
    for prev in plan.steps.iter().take_while(|s| s.output != step.output) {
        if reads(step, prev) {
            finalize::wait_finalized(plan, prev, sh, progress)?;
        } else {
            // Not waited for, still finalized here when every tile is done and its finalizer
            // is gone (a process that died after the last tile), as waiting did it.
            finalize::try_auto(plan, prev, sh, progress, &finalize::Own::default(), false)?;
        }
    }
    let fp = crate::run::fingerprint(step, layout, backend.caps().kind, plan.engine.precision)?;
    if prepare::is_finalized(&step.output, Some(&fp))? {
        if let Some(why) = prepare::finished_damage(step, layout)? {
            // Starting over here could race the other processes of the job, which may be
            // reading the finished output: `prepare` does it alone.
            return Err(Error::Usage(format!(
                "step {n}: {} is complete by its journal, but {why}; compute it again with `mgmm-stream prepare PLAN` (alone, before the job) or an unsplit `run` (from Python: call again; a Dask product prepares first)",
                step.output.display()
            )));
        }
        progress.note(&format!(
            "step {n}: {} is already complete and finalized; skipping",
            step.output.display()
        ));
        return Ok(Vec::new());
    }
    let manifest = prepare::ensure(step, layout, &fp, sh, progress)?;
    let dir = state_dir(&step.output);
    let s = sh.spec.shards(manifest.per_process);
    let mut reports = Vec::new();
    let mut busy = Vec::new();
    let sources = || crate::run::open_sources(step);
    let own = finalize::Own::default();
    for k in sh.spec.order(s) {
        if shard_file(&dir, k, s, "done").exists() {
            continue;
        }
        let c = match claim::try_claim(&shard_file(&dir, k, s, "claim"), sh.claim_timeout)? {
            claim::Try::Got(c) => c,
            claim::Try::Held(h) => {
                if let (ShardSpec::One { .. }, true) = (&sh.spec, sh.wait_for_held) {
                    let what = format!(
                        "shard {k}/{s} of {}, worked by {}, to finish or go stale",
                        step.output.display(),
                        h.describe()
                    );
                    match wait_for_held(&dir, k, s, sh, progress, &what)? {
                        Some(c) => c,
                        None => continue,
                    }
                } else if let ShardSpec::One { .. } = sh.spec {
                    return Err(Error::Usage(format!(
                        "step {n}: shard {k}/{s} of {} is being worked by {}; not starting a second writer (if that process is gone, its claim {} goes stale after {} s)",
                        step.output.display(),
                        h.describe(),
                        shard_file(&dir, k, s, "claim").display(),
                        sh.claim_timeout.as_secs()
                    )));
                } else {
                    busy.push(k);
                    continue;
                }
            }
        };
        let target = ShardTarget::new(
            step,
            layout,
            &plan.engine,
            fp.clone(),
            (dir.clone(), shard_file(&dir, k, s, "journal")),
            (
                shard_range(manifest.tiles, manifest.gn as u32, s, k),
                format!("shard {k}/{s}"),
            ),
            own.clone(),
        );
        let rep = match cx
            .step_run(Box::new(target), &sources)
            .run(backend, progress)
        {
            Ok(rep) => rep,
            // Asked to stop (Ctrl-C, SIGTERM at a job's time limit, SIGHUP): the shard's journal
            // and checkpoints are saved, so give the shard back at once; a resubmission on
            // another host need not wait for the claim to go stale.
            Err(e) if crate::interrupt::requested() => {
                c.release();
                return Err(e);
            }
            // A library caller (a Dask task) lives on after the error and may retry at once:
            // a claim left behind by a live process would hold the retry for the whole
            // claim timeout. The journal keeps what was done, as above.
            Err(e) if sh.wait_for_held => {
                c.release();
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        c.finish_as(&shard_file(&dir, k, s, "done"))?;
        reports.extend(rep);
    }
    if !busy.is_empty() {
        progress.note(&format!(
            "step {n}: {} shard(s) are being worked by other processes; the last to finish finalizes",
            busy.len()
        ));
    }
    let t = std::time::Instant::now();
    finalize::try_auto(plan, step, sh, progress, &own, true)?;
    crate::trace::span(
        "start-up",
        &format!("step {n}: finalize"),
        t,
        std::time::Instant::now(),
    );
    Ok(reports)
}

/// Wait (up to `sh.wait`) until shard `k` of `s` is done — `None`: nothing is left to do — or
/// its claim can be taken (its holder finished without finishing it, or went stale).
fn wait_for_held(
    dir: &Path,
    k: u32,
    s: u32,
    sh: &ShardOptions,
    progress: &Progress,
    what: &str,
) -> Result<Option<claim::Claim>> {
    let mut got = None;
    prepare::wait_for(what, sh.wait, progress, || {
        if shard_file(dir, k, s, "done").exists() {
            return Ok(true);
        }
        match claim::try_claim(&shard_file(dir, k, s, "claim"), sh.claim_timeout)? {
            claim::Try::Got(c) => {
                got = Some(c);
                Ok(true)
            }
            claim::Try::Held(_) => Ok(false),
        }
    })?;
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_every_tile_once() {
        for (total, gn) in [(12u32, 4u32), (7, 7), (100, 10), (3, 1), (5, 5)] {
            for s in 1..=13 {
                let mut next = 0;
                for k in 0..s {
                    let r = shard_range(total, gn, s, k);
                    assert_eq!(r.start, next, "{total} {gn} {s} {k}");
                    next = r.end;
                    if total / gn >= s {
                        assert_eq!(r.start % gn, 0, "whole rows");
                    }
                }
                assert_eq!(next, total);
            }
        }
    }

    /// One shard per process when op(B)'s tiles and a panel of op(A) fit in the tile cache
    /// (extra shards would each read op(B) again), four when they do not.
    #[test]
    fn shards_per_process_follow_the_tile_cache() {
        use crate::backend::{cpu::CpuBackend, Backend};
        use crate::plan::{MatrixInfo, Plan};
        let headers = |_: &std::path::Path| {
            Ok(Some(MatrixInfo {
                rows: 64,
                cols: 64,
                dtype: crate::dtype::DType::F32,
                transposed: false,
            }))
        };
        let text = "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n[[step]]\n\
                    output = \"C.mgt\"\nexpr = \"A @ B\"\n[engine]\nbackend = \"cpu\"\ntile = 8\n";
        let plan = Plan::resolve(std::path::Path::new("p.toml"), text, &[], &headers).unwrap();
        let step = &plan.steps[0];
        let caps = CpuBackend::new(1, None).caps().clone();
        let mut l = Layout::new(&plan.path, step, &plan.engine, &caps).unwrap();
        // 8×8 tiles of 64²: op(B) is 64 tiles, a panel of op(A) 8.
        l.slots = 72;
        assert_eq!(per_process(step, &l), 1);
        l.slots = 71;
        assert_eq!(per_process(step, &l), 4);
        let spec = ShardSpec::Rank {
            rank: 0,
            size: 3,
            shards: None,
            source: "test",
        };
        assert_eq!(spec.shards(1), 3);
        assert_eq!(spec.shards(4), 12);
    }

    #[test]
    fn own_shards_first_then_the_rest() {
        let spec = ShardSpec::Rank {
            rank: 1,
            size: 3,
            shards: Some(8),
            source: "test",
        };
        let o = spec.order(8);
        assert_eq!(&o[..3], &[1, 4, 7]);
        let mut all = o.clone();
        all.sort();
        assert_eq!(all, (0..8).collect::<Vec<_>>());
        assert_eq!(
            parse_shard_file("shard-3-of-16.claim"),
            Some((3, 16, "claim"))
        );
        assert_eq!(parse_shard_file("manifest.json"), None);
    }

    /// A shard another live process holds: `wait_for_held` waits, and returns `None` when the
    /// holder finishes it, or the claim when the holder gives it back unfinished.
    #[test]
    fn waiting_for_a_held_shard_ends_when_it_is_done_or_given_back() {
        let dir = std::env::temp_dir().join(format!("mgmm-held-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let sh =
            ShardOptions::one_shard(0, 2, Duration::from_secs(60), Duration::from_secs(20), true)
                .unwrap();
        let p = Progress::quiet();
        for finish in [true, false] {
            let claim_path = shard_file(&dir, 0, 2, "claim");
            let held = match claim::try_claim(&claim_path, sh.claim_timeout).unwrap() {
                claim::Try::Got(c) => c,
                claim::Try::Held(_) => panic!("the claim was free"),
            };
            let done = shard_file(&dir, 0, 2, "done");
            let _ = std::fs::remove_file(&done);
            let t = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(400));
                if finish {
                    held.finish_as(&done).unwrap();
                } else {
                    held.release();
                }
            });
            let t0 = std::time::Instant::now();
            let got = wait_for_held(&dir, 0, 2, &sh, &p, "the test's shard").unwrap();
            assert!(
                t0.elapsed() >= Duration::from_millis(350),
                "it did not wait"
            );
            t.join().unwrap();
            assert_eq!(got.is_none(), finish, "finish={finish}");
            if let Some(c) = got {
                assert!(claim_path.exists(), "the waiter holds the claim now");
                c.release();
            }
        }
        assert!(ShardOptions::one_shard(2, 2, Duration::ZERO, Duration::ZERO, true).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
