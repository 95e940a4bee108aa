//! Plans: `plan.toml` parsed (see `raw`), then resolved once into a [`Plan`] that every later
//! stage trusts without re-validating.
//!
//! Resolution reads every input's header, checks names, expressions, dtypes and shapes, decides
//! which inputs must be generated, and records where each step's output goes. Errors name the
//! plan file, the key or step, the line, and both shapes. Tile sizes and memory budgets depend on
//! the backend and are derived afterwards by [`layout`].

pub mod layout;
pub mod raw;
pub mod schedule;
pub mod size;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::store::gen::{Dist, GenSpec};
use crate::store::TiledFile;
use raw::{RawDevices, RawPlan, RawTile};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Auto,
    Cpu,
    Cuda,
    /// Simulated devices for tests (only in builds with the `fault-injection` feature).
    Sim,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    Fp32,
    Tf32,
    Bf16,
    Fp16,
    Fp64,
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
            Precision::Fp64 => "fp64",
        }
    }
    /// Host compute/output element type.
    pub fn host_dtype(self) -> DType {
        if self == Precision::Fp64 {
            DType::F64
        } else {
            DType::F32
        }
    }
    /// Relative unit roundoff of the inputs as the GEMM sees them (for error bounds).
    pub fn input_eps(self) -> f64 {
        match self {
            Precision::Fp64 => f64::EPSILON / 2.0,
            Precision::Fp32 => f32::EPSILON as f64 / 2.0,
            Precision::Tf32 => 2f64.powi(-11),
            Precision::Fp16 => 2f64.powi(-11),
            Precision::Bf16 => 2f64.powi(-8),
        }
    }
    /// Unit roundoff of the accumulation.
    pub fn acc_eps(self) -> f64 {
        if self == Precision::Fp64 {
            f64::EPSILON / 2.0
        } else {
            f32::EPSILON as f64 / 2.0
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileSpec {
    Auto,
    Fixed { m: u64, n: u64, k: u64 },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Devices {
    All,
    List(Vec<u32>),
}

#[derive(Clone, Debug)]
pub struct Engine {
    pub backend: BackendKind,
    pub precision: Precision,
    pub threads: usize,
    pub host_memory: u64,
    /// Per-GPU device memory budget; `None` = auto (free memory less a margin).
    pub device_memory: Option<u64>,
    pub tile: TileSpec,
    pub devices: Devices,
    pub durable: bool,
    pub verify_inputs: bool,
    /// How output blocks reach the file (`engine.write`).
    pub write: crate::store::WriteMode,
}

/// One operand of a step as it is stored on disk.
#[derive(Clone, Debug)]
pub struct Operand {
    pub name: String,
    pub path: PathBuf,
    /// Stored shape (before `.T`).
    pub rows: u64,
    pub cols: u64,
    pub dtype: DType,
    pub trans: bool,
}

impl Operand {
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
pub struct Step {
    pub index: usize,
    pub line: usize,
    pub expr: String,
    pub a: Operand,
    pub b: Operand,
    pub c0: Option<Operand>,
    pub alpha: f64,
    pub beta: f64,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub output: PathBuf,
    pub out_dtype: DType,
    pub out_tile: Option<u64>,
}

impl Step {
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
}

/// A matrix declared in `[matrices]`.
#[derive(Clone, Debug)]
pub struct MatrixDecl {
    pub name: String,
    pub path: PathBuf,
    pub rows: u64,
    pub cols: u64,
    pub dtype: DType,
    /// Set when the file is missing and must be generated before running.
    pub generate: Option<GenSpec>,
}

#[derive(Clone, Debug)]
pub struct Plan {
    pub path: PathBuf,
    pub matrices: Vec<MatrixDecl>,
    pub steps: Vec<Step>,
    pub engine: Engine,
}

fn line_of(src: &str, byte: usize) -> usize {
    src[..byte.min(src.len())].matches('\n').count() + 1
}

/// Parse an expression like `A.T @ B` into ((name, trans), (name, trans)).
pub fn parse_expr(expr: &str) -> Option<((String, bool), (String, bool))> {
    let parts: Vec<&str> = expr.split('@').map(str::trim).collect();
    if parts.len() != 2 {
        return None;
    }
    let one = |s: &str| -> Option<(String, bool)> {
        let (name, t) = match s.strip_suffix(".T") {
            Some(n) => (n.trim(), true),
            None => (s, false),
        };
        let ok = !name.is_empty()
            && name
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        ok.then(|| (name.to_string(), t))
    };
    Some((one(parts[0])?, one(parts[1])?))
}

impl Plan {
    /// Read, parse and resolve a plan file.
    pub fn load(path: &Path) -> Result<Plan> {
        let src =
            std::fs::read_to_string(path).map_err(|e| Error::io(path, "cannot read plan", e))?;
        Plan::from_str(path, &src)
    }

    /// Resolve plan text `src` as if read from `path` (paths are relative to its directory).
    pub fn from_str(path: &Path, src: &str) -> Result<Plan> {
        let perr = |m: String| Error::plan(path, m);
        let raw: RawPlan = toml::from_str(src).map_err(|e| {
            let at = e
                .span()
                .map(|sp| {
                    let line = line_of(src, sp.start);
                    let col = sp.start
                        - src[..sp.start.min(src.len())]
                            .rfind('\n')
                            .map_or(0, |i| i + 1)
                        + 1;
                    let text = src.lines().nth(line - 1).unwrap_or("").trim();
                    format!(" at line {line}, column {col} (`{text}`)")
                })
                .unwrap_or_default();
            perr(format!("invalid plan{at}: {}", e.message().trim()))
        })?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let base = if base.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            base
        };
        let mut engine = resolve_engine(path, &raw.engine)?;
        let precision_explicit = raw.engine.precision.is_some();

        // Matrices.
        let mut mats: BTreeMap<String, MatrixDecl> = BTreeMap::new();
        for (name, m) in &raw.matrices {
            let key = format!("matrices.{name}");
            let mpath = base.join(&m.path);
            let decl = if mpath.exists() {
                let f = TiledFile::open(&mpath).map_err(|e| perr(format!("{key}: {e}")))?;
                if let Some(g) = &m.generate {
                    let spec = gen_spec(path, &key, g)?;
                    if (spec.rows, spec.cols, spec.dtype) != (f.rows(), f.cols(), f.dtype()) {
                        return Err(perr(format!(
                            "{key}: {} exists and is {}×{} {}, but `generate` asks for {}×{} {}; delete the file to regenerate it, or fix the plan",
                            mpath.display(), f.rows(), f.cols(), f.dtype(), spec.rows, spec.cols, spec.dtype
                        )));
                    }
                }
                MatrixDecl {
                    name: name.clone(),
                    path: mpath,
                    rows: f.rows(),
                    cols: f.cols(),
                    dtype: f.dtype(),
                    generate: None,
                }
            } else if let Some(g) = &m.generate {
                let spec = gen_spec(path, &key, g)?;
                MatrixDecl {
                    name: name.clone(),
                    path: mpath,
                    rows: spec.rows,
                    cols: spec.cols,
                    dtype: spec.dtype,
                    generate: Some(spec),
                }
            } else {
                return Err(perr(format!(
                    "{key}: file {} does not exist; create it with `mgmm-stream gen` or `import`, or add `generate = {{ rows = …, cols = … }}`",
                    mpath.display()
                )));
            };
            mats.insert(name.clone(), decl);
        }

        if raw.step.is_empty() {
            return Err(perr(
                "the plan has no [[step]]; add one with `output` and `expr = \"A @ B\"`".into(),
            ));
        }
        let mut steps = Vec::new();
        let mut avail: BTreeMap<String, (PathBuf, u64, u64, DType)> = mats
            .values()
            .map(|d| (d.name.clone(), (d.path.clone(), d.rows, d.cols, d.dtype)))
            .collect();
        let mut outputs: Vec<PathBuf> = Vec::new();
        for (i, s) in raw.step.iter().enumerate() {
            let line = line_of(src, s.expr.span().start);
            let at = format!("step {} (line {line})", i + 1);
            let expr = s.expr.get_ref().clone();
            let ((an, at_), (bn, bt)) = parse_expr(&expr).ok_or_else(|| {
                perr(format!("{at}: expr = \"{expr}\" is not of the form \"X @ Y\" (each side a matrix name, optionally with .T)"))
            })?;
            let operand = |name: &str, trans: bool| -> Result<Operand> {
                let (p, r, c, dt) = avail.get(name).cloned().ok_or_else(|| {
                    perr(format!(
                        "{at}: unknown matrix `{name}` in expr \"{expr}\"; known: {}",
                        avail.keys().cloned().collect::<Vec<_>>().join(", ")
                    ))
                })?;
                Ok(Operand {
                    name: name.to_string(),
                    path: p,
                    rows: r,
                    cols: c,
                    dtype: dt,
                    trans,
                })
            };
            let a = operand(&an, at_)?;
            let b = operand(&bn, bt)?;
            let (m, k) = a.op_shape();
            let (k2, n) = b.op_shape();
            if k != k2 {
                return Err(perr(format!(
                    "{at}: shape mismatch in \"{expr}\": {}{} is {m}×{k} but {}{} is {k2}×{n} (inner dimensions {k} ≠ {k2})",
                    a.name, if a.trans { ".T" } else { "" }, b.name, if b.trans { ".T" } else { "" }
                )));
            }
            if a.dtype != b.dtype {
                return Err(perr(format!(
                    "{at}: `{}` is {} but `{}` is {}; operands must have the same dtype",
                    a.name, a.dtype, b.name, b.dtype
                )));
            }
            let c0 = match &s.accumulate {
                None => {
                    if s.beta.is_some() {
                        return Err(perr(format!("{at}: `beta` is set but `accumulate` is not; name the matrix to add (accumulate = \"C0\")")));
                    }
                    None
                }
                Some(cn) => {
                    let c = operand(cn, false)?;
                    if (c.rows, c.cols) != (m, n) {
                        return Err(perr(format!(
                            "{at}: accumulate = \"{cn}\" is {}×{} but the product is {m}×{n}",
                            c.rows, c.cols
                        )));
                    }
                    if c.dtype != a.dtype {
                        return Err(perr(format!(
                            "{at}: accumulate matrix `{cn}` is {} but the operands are {}",
                            c.dtype, a.dtype
                        )));
                    }
                    Some(c)
                }
            };
            if !precision_explicit && i == 0 && a.dtype == DType::F64 {
                // f64 inputs and no precision given: compute in f64.
                engine.precision = Precision::Fp64;
            }
            match (engine.precision, a.dtype) {
                (Precision::Fp64, DType::F64) => {}
                (Precision::Fp64, dt) => {
                    return Err(perr(format!(
                        "{at}: engine.precision = \"fp64\" needs f64 inputs, but `{}` is {dt}",
                        a.name
                    )))
                }
                (p, DType::F64) => {
                    return Err(perr(format!(
                        "{at}: `{}` is f64 but engine.precision = \"{}\"; set precision = \"fp64\"",
                        a.name,
                        p.name()
                    )))
                }
                _ => {}
            }
            let output = base.join(&s.output);
            if output.is_dir() {
                return Err(perr(format!(
                    "{at}: output {} is a directory; give a file path",
                    output.display()
                )));
            }
            let out_dtype = engine.precision.host_dtype();
            let inputs = [Some(&a), Some(&b), c0.as_ref()];
            for op in inputs.into_iter().flatten() {
                if same_file(&op.path, &output) {
                    return Err(perr(format!(
                        "{at}: output {} is also the input `{}`; write the result to a new file",
                        output.display(),
                        op.name
                    )));
                }
            }
            if outputs.iter().any(|o| same_file(o, &output)) {
                return Err(perr(format!(
                    "{at}: output {} is written by an earlier step too",
                    output.display()
                )));
            }
            for d in mats.values() {
                if same_file(&d.path, &output) {
                    return Err(perr(format!(
                        "{at}: output {} is the file of matrix `{}`; inputs are never overwritten — choose another output path",
                        output.display(),
                        d.name
                    )));
                }
            }
            if let Some(t) = s.tile {
                if t == 0 || t > crate::store::header::MAX_TILE_EDGE {
                    return Err(perr(format!(
                        "{at}: tile = {t} must be between 1 and 65536"
                    )));
                }
            }
            outputs.push(output.clone());
            if let Some(name) = &s.name {
                if avail.contains_key(name) {
                    return Err(perr(format!(
                        "{at}: name = \"{name}\" is already used by another matrix"
                    )));
                }
                avail.insert(name.clone(), (output.clone(), m, n, out_dtype));
            }
            steps.push(Step {
                index: i,
                line,
                expr,
                a,
                b,
                c0,
                alpha: s.alpha.unwrap_or(1.0),
                beta: s
                    .beta
                    .unwrap_or(if s.accumulate.is_some() { 1.0 } else { 0.0 }),
                m,
                n,
                k,
                output,
                out_dtype,
                out_tile: s.tile,
            });
        }
        Ok(Plan {
            path: path.to_path_buf(),
            matrices: mats.into_values().collect(),
            steps,
            engine,
        })
    }
}

/// True if `a` and `b` name the same file (after resolving what can be resolved).
pub fn same_file(a: &Path, b: &Path) -> bool {
    let canon = |p: &Path| -> PathBuf {
        if let Ok(c) = p.canonicalize() {
            return c;
        }
        match (p.parent(), p.file_name()) {
            (Some(d), Some(f)) => {
                let d = if d.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    d
                };
                d.canonicalize()
                    .map(|d| d.join(f))
                    .unwrap_or_else(|_| p.to_path_buf())
            }
            _ => p.to_path_buf(),
        }
    };
    canon(a) == canon(b)
}

fn gen_spec(plan: &Path, key: &str, g: &raw::RawGenerate) -> Result<GenSpec> {
    let perr = |m: String| Error::plan(plan, m);
    if g.rows == 0 || g.cols == 0 {
        return Err(perr(format!(
            "{key}.generate: rows and cols must be at least 1 (got {}×{})",
            g.rows, g.cols
        )));
    }
    if g.rows
        .checked_mul(g.cols)
        .and_then(|n| n.checked_mul(8))
        .is_none_or(|b| b > 1 << 50)
    {
        return Err(perr(format!(
            "{key}.generate: {}×{} is absurdly large",
            g.rows, g.cols
        )));
    }
    let dist = match &g.dist {
        None => Dist::Normal,
        Some(d) => Dist::parse(d).ok_or_else(|| {
            perr(format!(
                "{key}.generate.dist = \"{d}\" is unknown; use one of {}",
                Dist::NAMES
            ))
        })?,
    };
    let dtype = match &g.dtype {
        None => DType::F32,
        Some(d) => DType::parse(d).ok_or_else(|| {
            perr(format!(
                "{key}.generate.dtype = \"{d}\" is unknown; use f32, f64, f16 or bf16"
            ))
        })?,
    };
    let tile = g.tile.unwrap_or(1024);
    if tile == 0 || tile > crate::store::header::MAX_TILE_EDGE {
        return Err(perr(format!(
            "{key}.generate.tile = {tile} must be between 1 and 65536"
        )));
    }
    Ok(GenSpec {
        rows: g.rows,
        cols: g.cols,
        dtype,
        tile: (tile.min(g.rows), tile.min(g.cols)),
        dist,
        seed: g.seed.unwrap_or(0),
    })
}

fn resolve_engine(path: &Path, e: &raw::RawEngine) -> Result<Engine> {
    let perr = |m: String| Error::plan(path, m);
    let backend = match e.backend.as_deref() {
        None | Some("auto") => BackendKind::Auto,
        Some("cpu") => BackendKind::Cpu,
        Some("cuda") => BackendKind::Cuda,
        Some("sim") => BackendKind::Sim,
        Some(o) => {
            return Err(perr(format!(
                "engine.backend = \"{o}\" is unknown; use \"auto\", \"cpu\" or \"cuda\""
            )))
        }
    };
    let precision = match e.precision.as_deref() {
        None | Some("fp32") => Precision::Fp32,
        Some("tf32") => Precision::Tf32,
        Some("bf16") => Precision::Bf16,
        Some("fp16") => Precision::Fp16,
        Some("fp64") => Precision::Fp64,
        Some(o) => {
            return Err(perr(format!(
                "engine.precision = \"{o}\" is unknown; use fp32, tf32, bf16, fp16 or fp64"
            )))
        }
    };
    let host_memory = match e.host_memory.as_deref() {
        None => 2 << 30,
        Some(s) => size::parse_size(s).ok_or_else(|| {
            perr(format!(
                "engine.host_memory = \"{s}\" is not a size; write e.g. \"2GiB\" or \"512MiB\""
            ))
        })?,
    };
    if host_memory < 1 << 20 {
        return Err(perr(format!(
            "engine.host_memory = {host_memory} bytes is too small; give at least 1MiB"
        )));
    }
    let device_memory = match e.device_memory.as_deref() {
        None | Some("auto") => None,
        Some(s) => Some(size::parse_size(s).ok_or_else(|| {
            perr(format!(
                "engine.device_memory = \"{s}\" is not a size; write \"auto\" or e.g. \"40GiB\""
            ))
        })?),
    };
    let tile = match &e.tile {
        None => TileSpec::Auto,
        Some(RawTile::Word(w)) if w == "auto" => TileSpec::Auto,
        Some(RawTile::Word(w)) => {
            return Err(perr(format!(
                "engine.tile = \"{w}\"; use \"auto\", a number, or [m, n, k]"
            )))
        }
        Some(RawTile::Square(t)) => TileSpec::Fixed {
            m: *t,
            n: *t,
            k: *t,
        },
        Some(RawTile::Three([m, n, k])) => TileSpec::Fixed {
            m: *m,
            n: *n,
            k: *k,
        },
    };
    if let TileSpec::Fixed { m, n, k } = tile {
        if [m, n, k].iter().any(|&t| t == 0 || t > 1 << 16) {
            return Err(perr(format!(
                "engine.tile = [{m}, {n}, {k}]: each must be between 1 and 65536"
            )));
        }
    }
    let devices = match &e.devices {
        None => Devices::All,
        Some(RawDevices::Word(w)) if w == "all" => Devices::All,
        Some(RawDevices::Word(w)) => {
            return Err(perr(format!(
                "engine.devices = \"{w}\"; use \"all\" or a list like [0, 1]"
            )))
        }
        Some(RawDevices::List(l)) if l.is_empty() => {
            return Err(perr(
                "engine.devices = []: list at least one GPU, or use \"all\"".into(),
            ))
        }
        Some(RawDevices::List(l)) => Devices::List(l.clone()),
    };
    let write = match e.write.as_deref() {
        None => crate::store::WriteMode::default(),
        Some(w) => crate::store::WriteMode::parse(w).ok_or_else(|| {
            perr(format!(
                "engine.write = \"{w}\" is unknown; use \"mmap\" (the default) or \"pwrite\""
            ))
        })?,
    };
    Ok(Engine {
        backend,
        precision,
        threads: e.threads.unwrap_or(0),
        host_memory,
        device_memory,
        tile,
        devices,
        durable: e.durable.unwrap_or(true),
        verify_inputs: e.verify_inputs.unwrap_or(true),
        write,
    })
}
