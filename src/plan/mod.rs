//! Plans: `plan.toml` parsed (see `raw`), then resolved once into a [`Plan`] that every later
//! stage trusts without re-validating.
//!
//! Three phases: parse (TOML into the [`raw`] mirror: syntax, keys, types, with lines), resolve
//! (`--set` overrides and `[engine]` in [`engine`]; every input's header read through one
//! [`HeaderOf`] function; each `expr` parsed into an [`Expr`] and reduced to a product), then the
//! checks that need the whole plan (outputs never overwrite inputs). Errors name the plan file,
//! the key or step, the line, and both shapes. Tile sizes and memory budgets depend on the
//! backend and are derived afterwards by [`layout`].

pub(crate) mod chain;
pub(crate) mod engine;
pub(crate) mod expr;
pub mod layout;
pub(crate) mod raw;
pub(crate) mod resolve;
pub mod schedule;

use std::path::{Path, PathBuf};

use crate::dtype::DType;
use crate::error::{Error, Result};
pub use crate::seam::{EmulationModuli, Precision, StagingMode};
use crate::store::gen::GenSpec;
use engine::{EngineSet, EngineSource};
use resolve::Ctx;
pub use resolve::{header_from_disk, scalar_problem, HeaderOf, MatrixInfo};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// Which backend `[engine] backend` asks for.
pub enum BackendKind {
    /// CUDA when a GPU is there, else the CPU.
    Auto,
    /// The CPU.
    Cpu,
    /// CUDA GPUs.
    Cuda,
    /// Simulated devices for tests (only in builds with the `fault-injection` feature).
    Sim,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// The compute tile: chosen from the budgets, or fixed.
pub enum TileSpec {
    /// Chosen from the memory budgets.
    Auto,
    /// Fixed at `m`×`n`×`k`.
    Fixed {
        /// Output rows per tile.
        m: u64,
        /// Output columns per tile.
        n: u64,
        /// Inner dimension per tile.
        k: u64,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
/// Which devices a GPU run uses.
pub enum Devices {
    /// Every visible device.
    All,
    /// These device indices.
    List(Vec<u32>),
}

impl Engine {
    /// A warning for `threads` set far above the cores this machine has (more than four times):
    /// the extra threads only wait for cores and slow the copies and checks they share (a
    /// 2.9 s job on 2 cores showed an ETA of 1.5 h with `threads = 1024`: a new user's trial).
    /// `None` otherwise, and for 0 (all cores).
    pub fn threads_note(&self) -> Option<String> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (self.threads > 4 * cores).then(|| {
            format!(
                "engine.threads = {} is more than four times the {cores} cores this machine has: the threads beyond them only wait for cores, and the run is slower for it; leave engine.threads out (0: all cores)",
                self.threads
            )
        })
    }
}

#[derive(Clone, Debug)]
/// The resolved `[engine]` table.
pub struct Engine {
    /// Backend to run on.
    pub backend: BackendKind,
    /// GEMM precision.
    pub precision: Precision,
    /// Worker threads (0: all cores).
    pub threads: usize,
    /// Host memory budget in bytes.
    pub host_memory: u64,
    /// Per-GPU device memory budget; `None` = auto (free memory less a margin).
    pub device_memory: Option<u64>,
    /// Compute tile.
    pub tile: TileSpec,
    /// With `tile = "auto"` on several lanes, shrink the row tile to deal rows evenly
    /// (`layout::balanced_rows`). Not a plan key: off for split runs, whose `prepare` and
    /// shard processes see different numbers of GPUs but must agree on the tile.
    pub even_rows: bool,
    /// GPU devices to use.
    pub devices: Devices,
    /// Flush each tile to disk before recording it in the journal.
    pub durable: bool,
    /// Check every input tile's CRC when it is first read.
    pub verify_inputs: bool,
    /// How output blocks reach the file (`engine.write`).
    pub write: crate::store::WriteMode,
    /// How often an output tile still being computed saves its partial accumulator
    /// (`engine.checkpoint_every`); `None` = never.
    pub checkpoint_every: Option<std::time::Duration>,
    /// How input tiles reach a GPU (`engine.staging`).
    pub staging: StagingMode,
}

/// One operand of a step as it is stored on disk.
#[derive(Clone, Debug)]
pub struct Operand {
    /// Name in the plan.
    pub name: String,
    /// File path.
    pub path: PathBuf,
    /// Stored shape (before `.T`).
    pub rows: u64,
    /// Stored columns (before `.T`).
    pub cols: u64,
    /// Element type.
    pub dtype: DType,
    /// Read transposed from its file: used as `X.T`, or stored transposed (below) and used
    /// as `X`.
    pub trans: bool,
    /// The file stores the transpose of the declared matrix (a Fortran-order `.npy`, a raw file
    /// with `order = "F"`), which [`Self::trans`] already accounts for: only for naming the
    /// operand as the plan's text does.
    pub stored_t: bool,
    /// The declared layout of a raw binary file (`format = "raw"`); `None` for `.mgt`/`.npy`.
    pub raw: Option<crate::store::raw::RawSpec>,
    /// An intermediate of a whole-expression chain (a temporary file `run` removes).
    pub temp: bool,
}

impl Operand {
    /// The operand as the plan's text names it: `B`, or `B.T` when used transposed (a file
    /// that stores the transpose is read transposed for `B`).
    pub(crate) fn label(&self) -> String {
        let t = self.trans != self.stored_t;
        format!("{}{}", self.name, if t { ".T" } else { "" })
    }

    /// The operand as the file is read: `B.T` whenever it is read transposed, also for a file
    /// that stores the transpose. A chain's sub-products are journaled in these words (part of
    /// each part's `expr`): jobs journaled before [`Self::label`] named operands as written
    /// must keep resuming, so the journaled text keeps them.
    pub(crate) fn read_label(&self) -> String {
        format!("{}{}", self.name, if self.trans { ".T" } else { "" })
    }

    /// Open the operand's file for reading.
    pub(crate) fn open(&self) -> Result<std::sync::Arc<dyn crate::store::MatrixSource>> {
        match &self.raw {
            Some(r) => Ok(std::sync::Arc::new(r.open()?)),
            None => crate::store::open_source(&self.path),
        }
    }

    /// Shape of op(X).
    pub fn op_shape(&self) -> (u64, u64) {
        if self.trans {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        }
    }
}

#[derive(Clone, Debug)]
/// One product of a plan: `output = alpha · op(a) · op(b) + beta · c0`.
pub struct Step {
    /// Position in the plan (0-based).
    pub index: usize,
    /// Line of the step in the plan file; 0 for a step that no plan file's line holds (the
    /// Python package's `matmul`, a plan given as a dict): [`Step::at`] then names no line.
    pub line: usize,
    /// The expression as written.
    pub expr: String,
    /// Left operand.
    pub a: Operand,
    /// Right operand.
    pub b: Operand,
    /// Operand added with `beta`, if any.
    pub c0: Option<Operand>,
    /// Scale of the product.
    pub alpha: f64,
    /// Scale of `c0`.
    pub beta: f64,
    /// Output rows.
    pub m: u64,
    /// Output columns.
    pub n: u64,
    /// Inner dimension.
    pub k: u64,
    /// Output file.
    pub output: PathBuf,
    /// Output element type.
    pub out_dtype: DType,
    /// Output storage tile edge, if the plan sets one.
    pub out_tile: Option<u64>,
    /// Set when this step is one product of a whole-expression chain (`expr = "A @ B @ C"`).
    pub chain: Option<chain::ChainPart>,
    /// Operands and output the caller holds in memory, not files (the Python package's arrays,
    /// by their labels): `plan` describes them so — no file read, written or made room for. A
    /// chain's intermediates held in memory are its `chain.memory`; [`Step::in_memory`] asks both.
    pub held: Vec<PathBuf>,
}

/// An expression as people read it: the Python package writes its products as `alpha * a @ b`
/// (the text its journal's resume checks against, so kept), and a factor of 1 is left out where
/// `plan` and the summary show it; a chain's part (`A @ B @ C [part 1/2: T1 = B @ C]`, the
/// text its journal keeps) reads as its own product, `B @ C (part 1/2 of A @ B @ C)` — the
/// summary headed the intermediate with the whole expression (new-user trial).
pub(crate) fn readable_expr(expr: &str) -> String {
    let expr = expr.strip_prefix("1 * ").unwrap_or(expr);
    let part = (expr.strip_suffix(']'))
        .and_then(|e| e.rsplit_once(" [part "))
        .and_then(|(whole, p)| {
            let (of, text) = p.split_once(": ")?;
            let (_, sub) = text.split_once(" = ")?;
            Some(format!("{sub} (part {of} of {whole})"))
        });
    part.unwrap_or_else(|| expr.to_string())
}

impl Step {
    /// Floating-point operations of the product (2·m·n·k).
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }

    /// Where this step runs among the plan's: its index, then its part of a chain (0 for a step
    /// that is not one: a chain's parts share their step's index).
    pub(crate) fn order(&self) -> (usize, usize) {
        (self.index, self.chain.as_ref().map_or(0, |c| c.part))
    }

    /// How messages and `plan` name the step: `step 2 (line 14)`, or `step 1` alone when no
    /// plan file's line holds it (`line` 0: `plan` of a Python `matmul` said `line 0`).
    pub(crate) fn at(&self) -> String {
        match self.line {
            0 => format!("step {}", self.index + 1),
            l => format!("step {} (line {l})", self.index + 1),
        }
    }

    /// Whether this step writes a chain intermediate that an unsplit run holds in host memory
    /// instead of a file (a split run writes every intermediate to its file).
    pub(crate) fn output_in_memory(&self) -> bool {
        self.held.contains(&self.output)
            || (self.chain.as_ref())
                .is_some_and(|c| c.part < c.parts && c.memory.contains(&self.output))
    }

    /// Whether the matrix at `path` (an operand's or the output's) lives in memory rather than
    /// in a file: a chain's intermediate held in memory, or an array the caller handed in.
    pub(crate) fn in_memory(&self, path: &Path) -> bool {
        self.held.iter().any(|p| p == path)
            || (self.chain.as_ref()).is_some_and(|c| c.memory.iter().any(|p| p == path))
    }

    /// Where the step's inputs are read from, as `plan` says it: "files", "memory" (arrays, or
    /// intermediates held in memory) or "files and memory".
    pub(crate) fn inputs_from(&self) -> &'static str {
        let ops = [Some(&self.a), Some(&self.b), self.c0.as_ref()];
        let held = ops
            .iter()
            .flatten()
            .filter(|o| self.in_memory(&o.path))
            .count();
        match held {
            0 => "files",
            n if n == ops.iter().flatten().count() => "memory",
            _ => "files and memory",
        }
    }

    /// How `plan`, the progress lines and the summary name this step's output: its file, or for
    /// a chain's intermediate that an unsplit run holds in memory, its name in the chain and
    /// `(held in memory)` — not the file a split run would write (`D.npy.part1.mgt`), which
    /// never exists then.
    pub(crate) fn output_label(&self) -> String {
        match &self.chain {
            Some(c) if self.output_in_memory() => format!("{} (held in memory)", c.result_name()),
            _ => self.output.display().to_string(),
        }
    }
}

/// A matrix declared in `[matrices]`.
#[derive(Clone, Debug)]
pub struct MatrixDecl {
    /// Name in the plan.
    pub name: String,
    /// File path.
    pub path: PathBuf,
    /// Logical rows.
    pub rows: u64,
    /// Logical columns.
    pub cols: u64,
    /// Element type.
    pub dtype: DType,
    /// Set when the file is missing and must be generated before running.
    pub generate: Option<GenSpec>,
    /// The file stores the transpose row-major (Fortran order); `rows`/`cols` are the declared
    /// (logical) shape.
    pub transposed: bool,
    /// The declared layout of a raw binary file.
    pub raw: Option<crate::store::raw::RawSpec>,
}

#[derive(Clone, Debug)]
/// A resolved plan: matrices, steps and engine settings, validated once.
pub struct Plan {
    /// The plan file.
    pub path: PathBuf,
    /// Declared matrices.
    pub matrices: Vec<MatrixDecl>,
    /// Products to compute, in order.
    pub steps: Vec<Step>,
    /// Engine settings.
    pub engine: Engine,
}

impl Plan {
    /// Read, parse and resolve a plan file.
    pub fn load(path: &Path) -> Result<Plan> {
        Plan::load_with(path, &[])
    }

    /// [`Plan::load`] with `--set engine.KEY=VALUE` overrides (each `sets` item is the
    /// `engine.KEY=VALUE` text), applied over the file's `[engine]` before validation.
    pub fn load_with(path: &Path, sets: &[String]) -> Result<Plan> {
        let src =
            std::fs::read_to_string(path).map_err(|e| Error::io(path, "cannot read plan", e))?;
        Plan::resolve(path, &src, sets, &header_from_disk)
    }

    /// Resolve plan text: parse (syntax, keys, types), apply `sets`, resolve `[engine]`, read
    /// each input's header through `header_of` (the only file access besides the output
    /// checks), resolve the steps and check them.
    pub fn resolve(path: &Path, src: &str, sets: &[String], header_of: HeaderOf) -> Result<Plan> {
        let sets = sets
            .iter()
            .map(|s| EngineSet::parse(s))
            .collect::<Result<Vec<_>>>()?;
        let mut raw = raw::parse(src).map_err(|m| Error::plan(path, m))?;
        let from = EngineSource::apply(path, src, &mut raw.engine, sets);
        let mut engine = engine::resolve_engine(&raw.engine, &from)?;
        let precision_at = raw
            .engine
            .precision
            .as_ref()
            .map(|v| from.at("precision", v));
        let base = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let cx = Ctx { path, src, base };
        let mats = resolve::matrices(&cx, &raw.matrices, &raw.step, header_of)?;
        let steps = resolve::steps(&cx, &raw.step, &mats, &mut engine, precision_at)?;
        Ok(Plan {
            path: path.to_path_buf(),
            matrices: mats.into_values().collect(),
            steps,
            engine,
        })
    }
}

/// What the engine keeps beside a file it writes or reads, by suffix: a step's journal
/// (`durable::journal::journal_path`), a `.npy`'s checksum sidecar (`store::sidecar::sidecar_path`),
/// the checkpoints' folder (`durable::checkpoint::partial_dir`) and a split run's folder
/// (`durable::split::state_dir`). The durable module's tests hold this list to those functions.
pub(crate) const COMPANION_SUFFIXES: [&str; 4] = [".journal", ".crc32c", ".partial", ".shards"];

/// The companion of `owner` that `p` names (`.journal`, …: [`COMPANION_SUFFIXES`]), if any.
pub(crate) fn companion_of(p: &Path, owner: &Path) -> Option<&'static str> {
    COMPANION_SUFFIXES.into_iter().find(|s| {
        let mut c = owner.as_os_str().to_owned();
        c.push(s);
        same_file(p, Path::new(&c))
    })
}

/// True if `a` and `b` name the same file: the same device and inode when both exist (hard
/// links included), else the same path after resolving symlinks and `..` as far as the path
/// exists and `..`/`.` lexically beyond that.
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
        if x.dev() == y.dev() && x.ino() == y.ino() {
            return true;
        }
    }
    resolved(a) == resolved(b)
}

/// `p` with its longest existing prefix canonicalized (symlinks, `..`) and the rest of its
/// components applied lexically, so `new/../A.mgt` and `A.mgt` resolve alike.
fn resolved(p: &Path) -> PathBuf {
    use std::path::Component;
    let comps: Vec<Component> = p.components().collect();
    for i in (0..=comps.len()).rev() {
        let prefix: PathBuf = comps[..i].iter().collect();
        let prefix = if prefix.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            prefix
        };
        let Ok(mut canon) = prefix.canonicalize() else {
            continue;
        };
        for c in &comps[i..] {
            match c {
                Component::ParentDir => {
                    canon.pop();
                }
                Component::CurDir => {}
                other => canon.push(other.as_os_str()),
            }
        }
        return canon;
    }
    p.to_path_buf()
}

#[cfg(test)]
mod tests {
    /// A factor of 1 is left out; a chain's part reads as its own product, of the whole.
    #[test]
    fn expressions_read_as_people_write_them() {
        use super::readable_expr;
        assert_eq!(readable_expr("1 * a @ b.T"), "a @ b.T");
        assert_eq!(readable_expr("2 * a @ b"), "2 * a @ b");
        assert_eq!(
            readable_expr("A @ B @ C [part 1/2: T1 = B @ C.T]"),
            "B @ C.T (part 1/2 of A @ B @ C)"
        );
        assert_eq!(readable_expr("A @ B [x]"), "A @ B [x]");
    }
}
