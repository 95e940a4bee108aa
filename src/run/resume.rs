//! What is done of a step, what is left, and whether the output on disk can be trusted.
//!
//! [`ResumeState::load`] opens (or creates) the step's journal against the step's fingerprint,
//! re-checks every recorded tile's CRC against the bytes in the output, and answers with the work
//! left: nothing (complete), everything (fresh output), or the tiles whose records are missing or
//! did not match. The run loop only acts on the answer.
//!
//! It also looks at the step's checkpoints ([`Checkpoints::scan`]): an unfinished tile with a
//! valid one is resumed from its saved accumulator at its next k-chunk; any other checkpoint is
//! deleted (with a note when it was invalid). `--restart` and a complete step delete them all.

use std::collections::BTreeSet;

use crate::durable::checkpoint::Checkpoints;
use crate::durable::journal::{Fingerprint, Journal, State};
use crate::error::{Error, Result};
use crate::pipeline::{output_header, Work};
use crate::plan::layout::Layout;
use crate::plan::schedule::Schedule;
use crate::plan::Step;
use crate::store::{create_output, fsutil, open_source, reopen_output, WriteMode};

/// How an output will be written: `write = "auto"` resolved, and what decided it.
pub(crate) struct WritePlan {
    pub(crate) mode: WriteMode,
    /// The output file's size on disk.
    pub(crate) file_len: u64,
    /// The kernel's dirty limit, where it applied (`None`: `durable`, tmpfs, no `/proc`).
    pub(crate) dirty_limit: Option<u64>,
    /// Each written tile leaves the map ([`crate::store::MatrixSink::release_written`]): a
    /// mapped `.mgt` output larger than `host_memory`. Only then, since dropping mappings costs
    /// TLB shootdowns on every core running the process's threads (docs/decisions/0004-drop-written-tiles-past-host-memory.md).
    pub(crate) drop_written: bool,
}

/// How the output at `output` (header `header`) will be written, `write = "auto"` resolved
/// ([`WriteMode::resolve`]) for the file's size on disk. `run`, `plan` and the Python package
/// ask the same question.
pub(crate) fn resolve_write(
    output: &std::path::Path,
    header: &crate::store::Header,
    durable: bool,
    write: WriteMode,
    host_memory: u64,
) -> WritePlan {
    let file_len = crate::store::output_file_len(output, header);
    let dirty_limit = (!durable && fsutil::dir_counts_dirty_pages(output))
        .then(fsutil::dirty_limits)
        .flatten()
        .map(|d| d.limit);
    // A `.mgt` writer drops each written tile from its map (`TiledWriter::release`).
    let mgt = crate::store::OutputFormat::of(output) == crate::store::OutputFormat::Mgt;
    let mode = write.resolve(file_len, host_memory, dirty_limit, mgt);
    WritePlan {
        mode,
        file_len,
        dirty_limit,
        drop_written: mgt && mode == WriteMode::Mmap && file_len > host_memory,
    }
}

/// A step's state on disk, as the journal and the output's bytes agree on it.
pub enum ResumeState {
    /// The journal says the step finished: nothing to do.
    Complete,
    /// Work to do on an output that is open for writing.
    Work {
        /// The writer and the tiles left.
        work: Work,
        /// Output tiles in the step.
        total: u64,
        /// Recorded tiles whose bytes no longer match their CRC (redone).
        bad: u64,
        /// Why checkpoints found on disk were not used (each one was deleted).
        notes: Vec<String>,
    },
}

impl ResumeState {
    /// The work, tile counts and checkpoint notes of [`ResumeState::Work`]; `None` when
    /// complete.
    pub(crate) fn into_work(self) -> Option<(Work, u64, u64, Vec<String>)> {
        match self {
            ResumeState::Complete => None,
            ResumeState::Work {
                work,
                total,
                bad,
                notes,
            } => Some((work, total, bad, notes)),
        }
    }

    /// Open the journal for `step` and decide what is left, and which unfinished tiles resume
    /// from their checkpoints in `ckpt`. The journal is returned so the caller can record tiles
    /// into it and mark it complete.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn load(
        step: &Step,
        layout: &Layout,
        fp: &Fingerprint,
        restart: bool,
        durable: bool,
        write: WriteMode,
        host_memory: u64,
        ckpt: &mut Checkpoints,
    ) -> Result<(Journal, ResumeState)> {
        let (journal, state) = Journal::open(&step.output, fp, restart, durable)?;
        let sched = Schedule::new(step, layout);
        let header = output_header(step, layout);
        let plan = resolve_write(&step.output, &header, durable, write, host_memory);
        let write = plan.mode;
        let total = sched.tiles.len() as u64;
        if restart {
            ckpt.discard_all()?;
        }
        let st = match state {
            State::Complete => {
                ckpt.discard_all()?;
                ResumeState::Complete
            }
            // A journal with no finished tile says nothing about the output (a kill may have
            // landed while the output was being created): start the step afresh.
            State::Fresh => Self::fresh(step, header, total, write)?,
            State::Partial(done, _) if done.is_empty() => Self::fresh(step, header, total, write)?,
            State::Partial(done, damaged) => {
                // An output that no longer fits its journal (truncated, its header changed) is
                // beyond resuming: say how to start over.
                let writer = reopen_output(&step.output, header, write).map_err(|e| match e {
                    Error::Format { path, msg } => Error::Format {
                        path,
                        msg: format!(
                            "{msg}; it cannot be resumed — rerun with --restart to compute the step again"
                        ),
                    },
                    e => e,
                })?;
                let (finished, bad) = check_recorded(step, &sched, &done)?;
                writer.forget_checksums();
                let todo: Vec<u32> = (0..total as u32)
                    .filter(|&i| !finished[i as usize])
                    .collect();
                let done_before = total - todo.len() as u64;
                ResumeState::Work {
                    work: Work {
                        writer,
                        todo: Some(todo),
                        done_before,
                    },
                    total,
                    bad,
                    notes: (damaged > 0)
                        .then(|| {
                            format!(
                                "{} in the journal damaged and skipped: {} computed again",
                                crate::progress::count(damaged as u64, "record", "records"),
                                if damaged == 1 {
                                    "its tile is"
                                } else {
                                    "their tiles are"
                                }
                            )
                        })
                        .into_iter()
                        .collect(),
                }
            }
        };
        let st = match st {
            ResumeState::Work {
                work,
                total,
                bad,
                notes: mut first,
            } => {
                let todo: BTreeSet<u32> = match &work.todo {
                    Some(t) => t.iter().copied().collect(),
                    None => (0..total as u32).collect(),
                };
                first.extend(ckpt.scan(&sched, &todo, 0..total as u32)?);
                let notes = first;
                work.writer.release_written(plan.drop_written);
                if plan.drop_written {
                    // Tiles an earlier run wrote count toward their storage tiles' completion:
                    // a storage tile it wrote in part leaves the map once this run writes the
                    // rest, instead of staying mapped until `finish`.
                    for t in sched.tiles.iter().filter(|t| !todo.contains(&t.seq)) {
                        work.writer.release(&t.block);
                    }
                }
                ResumeState::Work {
                    work,
                    total,
                    bad,
                    notes,
                }
            }
            complete => complete,
        };
        Ok((journal, st))
    }

    /// Open the journal of one shard of a split step and decide what is left of the shard's
    /// tiles: those no shard journal records (under any earlier split) with a CRC that the
    /// output's bytes still match. The output must exist (prepared); it is written with
    /// `pwrite` through a sink that leaves the checksum table to `finalize`.
    pub(crate) fn load_shard(
        step: &Step,
        layout: &Layout,
        fp: &Fingerprint,
        durable: bool,
        ctx: &crate::cluster::ShardCtx,
        ckpt: &mut Checkpoints,
    ) -> Result<(Journal, ResumeState)> {
        let (journal, _) = Journal::open_shard(&ctx.journal, fp, durable)?;
        let sched = Schedule::new(step, layout);
        let total = sched.tiles.len() as u64;
        let done: Vec<(u32, u32)> = crate::cluster::recorded(&ctx.dir, fp)?
            .into_iter()
            .filter(|(seq, _)| ctx.tiles.contains(seq))
            .flat_map(|(seq, crcs)| crcs.into_iter().map(move |c| (seq, c)))
            .collect();
        let (finished, _) = check_recorded(step, &sched, &done)?;
        let todo: Vec<u32> = ctx
            .tiles
            .clone()
            .filter(|&i| !finished[i as usize])
            .collect();
        // Recorded tiles whose bytes match none of their records (counted once each).
        let recorded: std::collections::BTreeSet<u32> = done.iter().map(|d| d.0).collect();
        let bad = recorded.iter().filter(|&&s| !finished[s as usize]).count() as u64;
        let todo_set: BTreeSet<u32> = todo.iter().copied().collect();
        let notes = ckpt.scan(&sched, &todo_set, ctx.tiles.clone())?;
        if todo.is_empty() {
            return Ok((journal, ResumeState::Complete));
        }
        let writer =
            crate::cluster::writer::ShardWriter::open(&step.output, output_header(step, layout))?;
        let done_before = total - todo.len() as u64;
        let work = Work {
            writer: Box::new(writer),
            todo: Some(todo),
            done_before,
        };
        let st = ResumeState::Work {
            work,
            total,
            bad,
            notes,
        };
        Ok((journal, st))
    }

    fn fresh(
        step: &Step,
        header: crate::store::Header,
        total: u64,
        write: WriteMode,
    ) -> Result<ResumeState> {
        Ok(ResumeState::Work {
            work: Work {
                writer: create_output(&step.output, header, write)?,
                todo: None,
                done_before: 0,
            },
            total,
            bad: 0,
            notes: Vec::new(),
        })
    }
}

/// Which recorded tiles still hold the bytes their CRC says; and how many do not.
fn check_recorded(step: &Step, sched: &Schedule, done: &[(u32, u32)]) -> Result<(Vec<bool>, u64)> {
    let out = open_source(&step.output)?;
    let mut finished = vec![false; sched.tiles.len()];
    let mut bad = 0;
    let mut buf = Vec::new();
    for &(seq, crc) in done {
        let Some(t) = sched.tiles.get(seq as usize) else {
            continue;
        };
        buf.resize(t.block.elems() * step.out_dtype.size(), 0u8);
        out.read_block(&t.block, step.out_dtype, &mut buf)?;
        if crate::store::tiled::par_crc32c(&buf) == crc {
            finished[seq as usize] = true;
        } else {
            bad += 1;
        }
    }
    Ok((finished, bad))
}
