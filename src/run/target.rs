//! Where a step's tiles go, and how the finished ones are remembered: the output [`Target`].
//!
//! A [`StepRun`](super::step::StepRun) drives one step's whole life; what differs between a
//! plan's output file, a chain's intermediate held in memory, a Python result array and one
//! shard of a split step is only *where* the tiles land and *what remembers* them. That is this
//! trait, with one implementation per kind:
//!
//! | target | writes | remembers finished tiles in | checkpoints | where |
//! |---|---|---|---|---|
//! | [`FileTarget`] | a `.mgt` / `.npy` file ([`OutputFile`]) | the step's journal (`OUTPUT.journal`) | yes | here |
//! | [`MemoryTarget`] | a sink in memory (chain intermediate, result array) | a set in memory | no | here |
//! | `ShardTarget` | the prepared output, its shard's tiles | the shard's journal | yes | `cluster/` |
//!
//! [`Target::open`] is called once per attempt (a device failover makes another): it answers
//! with nothing left ([`Resume::Complete`]) or the work left and the [`Record`] that the
//! pipeline's writeback reports each durable tile to.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::durable::checkpoint::Checkpoints;
use crate::durable::journal::{Fingerprint, Journal, State};
use crate::durable::sink::TileSink;
use crate::error::{Error, Result};
use crate::pipeline::{output_header, Work};
use crate::plan::layout::Layout;
use crate::plan::schedule::{OutTile, Schedule};
use crate::plan::{Engine, Step};
use crate::store::{
    create_output, fsutil, open_as_written, reopen_output, Header, MatrixSink, MatrixSource,
    WriteMode,
};

/// What remembers the finished tiles of one attempt: the pipeline's writeback reports each
/// tile once it is written (and flushed, when durable); [`Record::complete`] marks the whole
/// output done.
pub(crate) trait Record: TileSink + Send {
    /// Every tile is written: say so durably (a journal's completion record).
    fn complete(&self) -> Result<()>;
}

/// A journal as a [`Record`]: a step's or a shard's.
pub(crate) struct JournalRecord(pub(crate) Journal);

impl TileSink for JournalRecord {
    fn tile_written(&self, tile: &OutTile, crc: u32) -> Result<()> {
        self.0.record(tile.seq, crc)
    }
}

impl Record for JournalRecord {
    fn complete(&self) -> Result<()> {
        self.0.complete()
    }
}

/// The tiles of an output in memory written so far (there is no journal), so that a device
/// failover redoes only the rest.
#[derive(Clone, Default)]
struct Written(Arc<Mutex<BTreeSet<u32>>>);

impl TileSink for Written {
    fn tile_written(&self, tile: &OutTile, _crc: u32) -> Result<()> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(tile.seq);
        Ok(())
    }
}

impl Record for Written {
    fn complete(&self) -> Result<()> {
        Ok(())
    }
}

/// One attempt's work: the writer and the tiles left, and what records the tiles done.
pub(crate) struct Opened {
    /// The writer and the tiles left.
    pub(crate) work: Work,
    /// Output tiles in the step.
    pub(crate) total: u64,
    /// Recorded tiles whose bytes no longer match their CRC (redone).
    pub(crate) bad: u64,
    /// Why checkpoints or journal records found on disk were not used.
    pub(crate) notes: Vec<String>,
    /// Where finished tiles are reported.
    pub(crate) record: Box<dyn Record>,
}

/// A target's state at the start of an attempt.
pub(crate) enum Resume {
    /// Nothing to do: the journal says the output is complete.
    Complete,
    /// Work to do.
    Work(Opened),
}

/// Where a step's tiles go and how finished ones are remembered (see the module docs).
pub(crate) trait Target {
    /// Open for one attempt: the work left, or [`Resume::Complete`].
    fn open(&mut self) -> Result<Resume>;
    /// The checkpoints of long tiles, for a target that keeps them.
    fn checkpoints(&self) -> Option<&Checkpoints> {
        None
    }
    /// The tiles this target covers (a shard's); `None`: the whole step.
    fn scope(&self) -> Option<std::ops::Range<u32>> {
        None
    }
    /// The name a split run's shard goes by in messages ("shard 1/4"); `None` otherwise.
    fn shard_label(&self) -> Option<&str> {
        None
    }
    /// Whether finished tiles outlive the process (a journal records them): the sink-side
    /// faults of the tests apply to such targets only.
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    fn journaled(&self) -> bool;
    /// Every tile is recorded: clean up what the target kept for a resume (checkpoints).
    fn finished(&mut self) -> Result<()> {
        Ok(())
    }
}

/// An output file format a journaled target can create, reopen and read back.
pub trait OutputFile: Send + Sync {
    /// Create the file afresh (replacing what is there) for `header`.
    fn create(&self, header: Header, write: WriteMode) -> Result<Box<dyn MatrixSink>>;
    /// Reopen a partially written file to write the tiles left.
    fn reopen(&self, header: Header, write: WriteMode) -> Result<Box<dyn MatrixSink>>;
    /// Open the file for reading back the tiles the journal records (their CRCs are checked).
    fn read_back(&self) -> Result<Arc<dyn MatrixSource>>;
    /// The file is complete by its journal: why it cannot be trusted as it lies (a damaged
    /// header, written again here from `header`; missing stored checksums), or `None`. The
    /// target then resumes it from the journal. Formats without such metadata: always `None`.
    fn mend_finished(&self, _header: Header) -> Result<Option<String>> {
        Ok(None)
    }
}

/// The output file at a path, in the format its name says (`.npy`, else `.mgt`): what a plan's
/// steps write.
pub struct FileOutput(pub PathBuf);

impl OutputFile for FileOutput {
    fn create(&self, header: Header, write: WriteMode) -> Result<Box<dyn MatrixSink>> {
        create_output(&self.0, header, write)
    }
    fn reopen(&self, header: Header, write: WriteMode) -> Result<Box<dyn MatrixSink>> {
        reopen_output(&self.0, header, write)
    }
    fn read_back(&self) -> Result<Arc<dyn MatrixSource>> {
        open_as_written(&self.0)
    }
    fn mend_finished(&self, header: Header) -> Result<Option<String>> {
        crate::store::mend_finished(&self.0, &header)
    }
}

/// How an output will be written: `write = "auto"` resolved, and what decided it.
pub(crate) struct WritePlan {
    pub(crate) mode: WriteMode,
    /// The output file's size on disk.
    pub(crate) file_len: u64,
    /// The kernel's dirty limit, where it applied (`None`: `durable`, tmpfs, no `/proc`).
    pub(crate) dirty_limit: Option<u64>,
    /// Each written tile leaves the map ([`crate::store::MatrixSink::release_written`]): a
    /// mapped `.mgt` output larger than `host_memory`. Only then, since dropping mappings costs
    /// TLB shootdowns on every core running the process's threads
    /// (docs/decisions/0004-drop-written-tiles-past-host-memory.md).
    pub(crate) drop_written: bool,
}

/// How the output at `output` (header `header`) will be written, `write = "auto"` resolved
/// ([`WriteMode::resolve`]) for the file's size on disk. `run`, `plan` and the Python package
/// ask the same question.
pub(crate) fn resolve_write(
    output: &Path,
    header: &Header,
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

/// A step's output file with its journal beside it: an interrupted run resumes where it
/// stopped, re-checking every recorded tile's CRC against the bytes in the file.
pub(crate) struct FileTarget<'a> {
    step: &'a Step,
    layout: &'a Layout,
    fp: Fingerprint,
    file: Box<dyn OutputFile + 'a>,
    /// Discard the journal and the checkpoints on the first attempt (`--restart`); a failover's
    /// next attempt resumes what this run wrote.
    restart: bool,
    durable: bool,
    write: WriteMode,
    host_memory: u64,
    ckpt: Checkpoints,
    /// The modification time of a finished output being mended (its header or checksums
    /// damaged), given back when it is done if no data tile had to be computed again.
    mended_mtime: Option<std::time::SystemTime>,
}

/// The modification time of `path`, if it has one to read.
fn modified(path: &Path) -> Option<std::time::SystemTime> {
    std::fs::symlink_metadata(path)
        .and_then(|m| m.modified())
        .ok()
}

impl<'a> FileTarget<'a> {
    /// The target writing `step`'s output through `file`, recorded under fingerprint `fp`.
    pub(crate) fn new(
        step: &'a Step,
        layout: &'a Layout,
        engine: &Engine,
        fp: Fingerprint,
        file: Box<dyn OutputFile + 'a>,
        restart: bool,
    ) -> FileTarget<'a> {
        let ckpt = Checkpoints::for_step(step, layout, engine, &fp);
        FileTarget {
            step,
            layout,
            fp,
            file,
            restart,
            durable: engine.durable,
            write: engine.write,
            host_memory: engine.host_memory,
            ckpt,
            mended_mtime: None,
        }
    }

    /// Reopen an output whose journal records `done`, keeping the tiles whose bytes still
    /// match: the work left, the records that did not match, and a note on `damaged` journal
    /// records (skipped).
    fn resume(
        &self,
        header: Header,
        mode: WriteMode,
        done: &[(u32, u32)],
        damaged: usize,
    ) -> Result<(Work, u64, Option<String>)> {
        let sched = Schedule::new(self.step, self.layout);
        let total = sched.tiles.len() as u64;
        // An output that no longer fits its journal (truncated, its header changed) is beyond
        // resuming: say how to start over.
        let writer = self.file.reopen(header, mode).map_err(|e| match e {
            Error::Format { path, msg } => Error::Format {
                path,
                msg: match msg.strip_suffix("; rerun with --restart") {
                    Some(m) => format!(
                        "{m}; it cannot be resumed — rerun with --restart to compute the step again"
                    ),
                    None => format!(
                        "{msg}; it cannot be resumed — rerun with --restart to compute the step again"
                    ),
                },
            },
            e => e,
        })?;
        let back = self.file.read_back()?;
        let (finished, bad) = check_recorded(self.step, &sched, back.as_ref(), done)?;
        writer.forget_checksums();
        let todo: Vec<u32> = (0..total as u32)
            .filter(|&i| !finished[i as usize])
            .collect();
        let done_before = total - todo.len() as u64;
        let note = (damaged > 0).then(|| {
            format!(
                "{} in the journal damaged and skipped: {} computed again",
                crate::progress::count(damaged as u64, "record", "records"),
                if damaged == 1 {
                    "its tile is"
                } else {
                    "their tiles are"
                }
            )
        });
        let work = Work {
            writer,
            todo: Some(todo),
            done_before,
        };
        Ok((work, bad, note))
    }
}

impl Target for FileTarget<'_> {
    fn open(&mut self) -> Result<Resume> {
        let restart = std::mem::take(&mut self.restart);
        // Links where the step writes in place, and a checkpoint folder it cannot use, are
        // refused before anything is touched — before the journal, which `restart` resets (the
        // journal refuses its own links; the writers open the output with O_NOFOLLOW as well).
        fsutil::refuse_link(&self.step.output)?;
        self.ckpt.refuse_unusable_dir()?;
        let (journal, state) = Journal::open(&self.step.output, &self.fp, restart, self.durable)?;
        let sched = Schedule::new(self.step, self.layout);
        let header = output_header(self.step, self.layout);
        let out = &self.step.output;
        let plan = resolve_write(out, &header, self.durable, self.write, self.host_memory);
        let total = sched.tiles.len() as u64;
        if restart {
            self.ckpt.discard_all()?;
        }
        // Taken before a mend can touch it (`mend_finished` rewrites a damaged header).
        self.mended_mtime = matches!(state, State::Complete)
            .then(|| modified(out))
            .flatten();
        let (work, bad, note) = match state {
            State::Complete => match self.file.mend_finished(header)? {
                None => {
                    self.mended_mtime = None;
                    self.ckpt.discard_all()?;
                    return Ok(Resume::Complete);
                }
                // Complete by its journal, but the file's own header or stored checksums are
                // damaged: resume from the journal — every recorded tile is checked against
                // its CRC (only a mismatch is computed again), and finishing writes the
                // checksum table or sidecar again.
                Some(why) => {
                    if self.layout.over_budget {
                        return Err(Error::Usage(format!(
                            "{} is complete by its journal, but {why}; mending it computes with the compute tile its journal records ({}×{}×{}), which needs {} of host memory{}: give the run the engine.host_memory (and devices) it had, or rerun with --restart to compute the step again with the budgets of now",
                            out.display(),
                            self.layout.tm,
                            self.layout.tn,
                            self.layout.tk,
                            crate::units::fmt_bytes(self.layout.host_bytes),
                            if self.layout.device_bytes > 0 {
                                format!(
                                    " and {} per GPU",
                                    crate::units::fmt_bytes(self.layout.device_bytes)
                                )
                            } else {
                                String::new()
                            }
                        )));
                    }
                    let done = crate::durable::journal::peek(out)?.map_or(Vec::new(), |p| p.done);
                    let (work, bad, _) = self.resume(header, plan.mode, &done, 0)?;
                    if work.todo.as_ref().is_none_or(|t| !t.is_empty()) {
                        // A data tile is computed again (its bytes no longer matched, or its
                        // record was damaged): steps that read the output may have read it
                        // before it was put right, so it takes the time of its new bytes.
                        self.mended_mtime = None;
                    }
                    let note = format!(
                        "{} is complete by its journal, but {why}: checking its {} recorded tiles against the journal and writing what is damaged again",
                        out.display(),
                        done.len()
                    );
                    (work, bad, Some(note))
                }
            },
            State::Partial(done, damaged) if !done.is_empty() => {
                self.resume(header, plan.mode, &done, damaged)?
            }
            // A journal with no finished tile says nothing about the output (a kill may have
            // landed while the output was being created): start the step afresh.
            State::Fresh | State::Partial(..) => {
                let writer = self.file.create(header, plan.mode)?;
                let work = Work {
                    writer,
                    todo: None,
                    done_before: 0,
                };
                (work, 0, None)
            }
        };
        let mut opened = Opened {
            work,
            total,
            bad,
            notes: note.into_iter().collect(),
            record: Box::new(JournalRecord(journal)),
        };
        let todo: BTreeSet<u32> = match &opened.work.todo {
            Some(t) => t.iter().copied().collect(),
            None => (0..total as u32).collect(),
        };
        let notes = self.ckpt.scan(&sched, &todo, 0..total as u32)?;
        opened.notes.extend(notes);
        let writer = &opened.work.writer;
        writer.release_written(plan.drop_written);
        if plan.drop_written {
            // Tiles an earlier run wrote count toward their storage tiles' completion: a
            // storage tile it wrote in part leaves the map once this run writes the rest,
            // instead of staying mapped until `finish`.
            for t in sched.tiles.iter().filter(|t| !todo.contains(&t.seq)) {
                writer.release(&t.block);
            }
        }
        Ok(Resume::Work(opened))
    }

    fn checkpoints(&self) -> Option<&Checkpoints> {
        Some(&self.ckpt)
    }

    fn journaled(&self) -> bool {
        true
    }

    fn finished(&mut self) -> Result<()> {
        // Every tile is recorded: no checkpoint of this step is needed.
        self.ckpt.discard_all()?;
        // A finished output whose header or checksums were mended, every data tile intact:
        // its bytes are those it had, so it keeps its time — steps that read it before name
        // it by size, time and sampled contents, and would refuse it as changed (a user's
        // trial: `run` wrote a missing sidecar, and the next step was refused).
        if let Some(t) = self.mended_mtime.take() {
            let out = &self.step.output;
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(out)
                .and_then(|f| f.set_modified(t))
                .map_err(|e| Error::io(out, "cannot give the mended output back its time", e))?;
        }
        Ok(())
    }
}

/// An output in memory: a chain's intermediate, or a caller's result array. No journal and no
/// checkpoint: nothing of it outlives the process, and a failover redoes the tiles not yet
/// written.
pub(crate) struct MemoryTarget<'a> {
    make: Box<dyn Fn() -> Result<Box<dyn MatrixSink>> + 'a>,
    total: u32,
    written: Written,
}

impl<'a> MemoryTarget<'a> {
    /// The target writing `step`'s tiles into the sink that `make` makes (called once per
    /// attempt).
    pub(crate) fn new(
        step: &Step,
        layout: &Layout,
        make: Box<dyn Fn() -> Result<Box<dyn MatrixSink>> + 'a>,
    ) -> MemoryTarget<'a> {
        MemoryTarget {
            make,
            total: Schedule::new(step, layout).tiles.len() as u32,
            written: Written::default(),
        }
    }
}

impl Target for MemoryTarget<'_> {
    fn open(&mut self) -> Result<Resume> {
        let done = self
            .written
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let todo: Vec<u32> = (0..self.total).filter(|s| !done.contains(s)).collect();
        Ok(Resume::Work(Opened {
            work: Work {
                writer: (self.make)()?,
                done_before: (self.total as usize - todo.len()) as u64,
                todo: Some(todo),
            },
            total: self.total as u64,
            bad: 0,
            notes: Vec::new(),
            record: Box::new(self.written.clone()),
        }))
    }

    fn journaled(&self) -> bool {
        false
    }
}

/// Which recorded tiles (`done`: seq, CRC) still hold the bytes their CRC says, read back from
/// `out`; and how many records did not match.
pub(crate) fn check_recorded(
    step: &Step,
    sched: &Schedule,
    out: &dyn MatrixSource,
    done: &[(u32, u32)],
) -> Result<(Vec<bool>, u64)> {
    let mut finished = vec![false; sched.tiles.len()];
    let mut bad = 0;
    for &(seq, crc) in done {
        let Some(t) = sched.tiles.get(seq as usize) else {
            continue;
        };
        if crate::store::block_crc(out, &t.block, step.out_dtype)? == crc {
            finished[seq as usize] = true;
        } else {
            bad += 1;
        }
    }
    Ok((finished, bad))
}
