//! One shard of a split step as a [`Target`]: the prepared output reopened for writing
//! ([`ShardWriter`]: as one process writes it on a local disk, with `pwrite` elsewhere), the
//! shard's own journal, and the checkpoints of its tiles. What is done is
//! what any shard journal (under any earlier split) records with a CRC that the output's bytes
//! still match, so a rerun with another shard count resumes from whatever is done.

use std::collections::BTreeSet;
use std::ops::Range;
use std::path::PathBuf;

use super::writer::ShardWriter;
use crate::durable::checkpoint::Checkpoints;
use crate::durable::journal::{Fingerprint, Journal};
use crate::durable::sink::TileSink;
use crate::error::Result;
use crate::pipeline::{output_header, Work};
use crate::plan::layout::Layout;
use crate::plan::schedule::OutTile;
use crate::plan::schedule::Schedule;
use crate::plan::{Engine, Step};
use crate::run::target::{
    check_recorded, resolve_write, JournalRecord, Opened, Record, Resume, Target,
};
use crate::store::{open_as_written, MatrixSink, WriteMode};

/// The tiles `tiles` of `step`, worked by this process under the shard's claim.
pub(crate) struct ShardTarget<'a> {
    pub(crate) step: &'a Step,
    pub(crate) layout: &'a Layout,
    pub(crate) fp: Fingerprint,
    /// The step's shard folder (`C.mgt.shards/`).
    pub(crate) dir: PathBuf,
    /// This shard's journal in it.
    pub(crate) journal: PathBuf,
    pub(crate) tiles: Range<u32>,
    /// "shard K/S", for messages.
    pub(crate) label: String,
    pub(crate) durable: bool,
    /// `engine.write` and `engine.host_memory`: how the output is written, resolved as one
    /// process resolves it ([`resolve_write`]).
    pub(crate) write: WriteMode,
    pub(crate) host_memory: u64,
    pub(crate) ckpt: Checkpoints,
    /// The tiles this process wrote and recorded in this run (seq → CRC), for `finalize`
    /// ([`super::finalize::Own`]), shared by the shards it works.
    pub(crate) own: super::finalize::Own,
}

/// A shard's journal as its [`Record`], noting each tile it records in [`ShardTarget::own`].
struct ShardRecord {
    journal: JournalRecord,
    own: super::finalize::Own,
}

impl TileSink for ShardRecord {
    fn tile_written(&self, tile: &OutTile, crc: u32) -> Result<()> {
        self.journal.tile_written(tile, crc)?;
        self.own.note(tile.seq, crc);
        Ok(())
    }
}

impl Record for ShardRecord {
    fn complete(&self) -> Result<()> {
        self.journal.complete()
    }
}

impl<'a> ShardTarget<'a> {
    /// The target of shard `label` (tiles `tiles`) of `step`, its journal at `journal` in `dir`;
    /// the tiles it records are noted in `own` for this process's `finalize`.
    pub(crate) fn new(
        step: &'a Step,
        layout: &'a Layout,
        engine: &Engine,
        fp: Fingerprint,
        (dir, journal): (PathBuf, PathBuf),
        (tiles, label): (Range<u32>, String),
        own: super::finalize::Own,
    ) -> ShardTarget<'a> {
        let ckpt = Checkpoints::for_step(step, layout, engine, &fp);
        ShardTarget {
            step,
            layout,
            fp,
            dir,
            journal,
            tiles,
            label,
            durable: engine.durable,
            write: engine.write,
            host_memory: engine.host_memory,
            ckpt,
            own,
        }
    }
}

impl Target for ShardTarget<'_> {
    /// Open the shard's journal and decide what is left of its tiles: those no shard journal
    /// records with a CRC that the output's bytes still match. The output must exist
    /// (prepared); it is written as one process writes it on a local disk, else with `pwrite`
    /// ([`ShardWriter`]), through a sink that leaves the checksum table to `finalize`.
    fn open(&mut self) -> Result<Resume> {
        let (step, layout) = (self.step, self.layout);
        let (journal, _) = Journal::open_shard(&self.journal, &self.fp, self.durable)?;
        let sched = Schedule::new(step, layout);
        let total = sched.tiles.len() as u64;
        let done: Vec<(u32, u32)> = super::recorded(&self.dir, &self.fp)?
            .into_iter()
            .filter(|(seq, _)| self.tiles.contains(seq))
            .flat_map(|(seq, crcs)| crcs.into_iter().map(move |c| (seq, c)))
            .collect();
        let out = open_as_written(&step.output)?;
        let (finished, _) = check_recorded(step, &sched, out.as_ref(), &done)?;
        let todo: Vec<u32> = (self.tiles.clone())
            .filter(|&i| !finished[i as usize])
            .collect();
        // Recorded tiles whose bytes match none of their records (counted once each).
        let recorded: BTreeSet<u32> = done.iter().map(|d| d.0).collect();
        let bad = recorded.iter().filter(|&&s| !finished[s as usize]).count() as u64;
        let todo_set: BTreeSet<u32> = todo.iter().copied().collect();
        let notes = self.ckpt.scan(&sched, &todo_set, self.tiles.clone())?;
        if todo.is_empty() {
            return Ok(Resume::Complete);
        }
        let header = output_header(step, layout);
        let plan = resolve_write(
            &step.output,
            &header,
            self.durable,
            self.write,
            self.host_memory,
        );
        let writer = ShardWriter::open(&step.output, header, plan.mode)?;
        writer.release_written(plan.drop_written);
        if plan.drop_written {
            // Tiles other shards (or an earlier run) write count toward their storage tiles'
            // completion, as in one process's resume: a storage tile this shard writes in part
            // leaves its map once its part is written. Dropping only this process's mappings,
            // so safe while another process writes the rest.
            for t in sched.tiles.iter().filter(|t| !todo_set.contains(&t.seq)) {
                writer.release(&t.block);
            }
        }
        let done_before = total - todo.len() as u64;
        Ok(Resume::Work(Opened {
            work: Work {
                writer: Box::new(writer),
                todo: Some(todo),
                done_before,
            },
            total,
            bad,
            notes,
            record: Box::new(ShardRecord {
                journal: JournalRecord(journal),
                own: self.own.clone(),
            }),
        }))
    }

    fn checkpoints(&self) -> Option<&Checkpoints> {
        Some(&self.ckpt)
    }

    fn scope(&self) -> Option<Range<u32>> {
        Some(self.tiles.clone())
    }

    fn shard_label(&self) -> Option<&str> {
        Some(&self.label)
    }

    fn journaled(&self) -> bool {
        true
    }

    fn finished(&mut self) -> Result<()> {
        // The other shards' checkpoints stay: only an empty folder goes.
        self.ckpt.remove_dir_if_empty();
        Ok(())
    }
}
