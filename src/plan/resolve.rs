//! Resolution: the parsed plan mirror plus the inputs' headers become [`Matrix`](super::MatrixDecl)
//! declarations and [`Step`]s, then the checks that need the whole plan.
//!
//! The only place that looks at input files is the `header_of` function passed in (a
//! [`HeaderOf`]), so tests resolve plans without any file. Every error names the plan file, the
//! key or step, and its line; expression errors also name the column.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use toml::Spanned;

use super::chain;
use super::expr::{self, Factor, ProductForm};
use super::raw::{line_of, RawGenerate, RawMatrix, RawStep};
use super::{same_file, Engine, MatrixDecl, Operand, Precision, Step};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::store::gen::{Dist, GenSpec};
use crate::store::open_source;
use crate::store::raw::{Order as RawOrder, RawSpec};

/// What resolution needs to know about an input file: its stored shape and element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatrixInfo {
    /// The declared (logical) shape.
    pub rows: u64,
    /// Stored columns.
    pub cols: u64,
    /// Element type.
    pub dtype: DType,
    /// The file stores the transpose row-major (a Fortran-order `.npy`).
    pub transposed: bool,
}

/// Reads an input's header: `Ok(None)` when the file does not exist.
pub type HeaderOf<'a> = &'a dyn Fn(&Path) -> Result<Option<MatrixInfo>>;

/// [`HeaderOf`] for real files: opens the `.mgt` or `.npy` file and reads its header.
pub fn header_from_disk(path: &Path) -> Result<Option<MatrixInfo>> {
    if !path.exists() {
        return Ok(None);
    }
    let f = open_source(path)?;
    let (r, c) = f.shape();
    let t = f.transposed();
    Ok(Some(MatrixInfo {
        rows: if t { c } else { r },
        cols: if t { r } else { c },
        dtype: f.dtype(),
        transposed: t,
    }))
}

/// A `format = "raw"` declaration checked against its keys and the file's size.
fn raw_decl(cx: &Ctx, name: &str, key: &str, m: &RawMatrix, path: &Path) -> Result<MatrixDecl> {
    let fmt = m
        .format
        .as_ref()
        .expect("raw_decl is called for format = ...");
    if fmt.get_ref() != "raw" {
        return Err(cx.err(format!(
            "{key}: format = \"{}\" is unknown; use \"raw\" for a headerless binary file (.mgt and .npy are recognised by their header)",
            fmt.get_ref()
        )));
    }
    if m.generate.is_some() {
        return Err(cx.err(format!(
            "{key}: a raw file cannot be generated; drop `generate` or `format`"
        )));
    }
    let missing = |k: &str| {
        cx.err(format!(
            "{key}: format = \"raw\" needs `{k}` (raw files have no header): e.g. rows = 1000, cols = 500, dtype = \"f32\""
        ))
    };
    let dtype = match &m.dtype {
        None => return Err(missing("dtype")),
        Some(d) => DType::parse(d).ok_or_else(|| {
            cx.err(format!(
                "{key}: dtype = \"{d}\" is unknown; use f32, f64, f16 or bf16"
            ))
        })?,
    };
    let order = match m.order.as_deref() {
        None => RawOrder::C,
        Some(o) => RawOrder::parse(o).ok_or_else(|| {
            cx.err(format!(
                "{key}: order = \"{o}\": use \"C\" (row-major) or \"F\" (column-major)"
            ))
        })?,
    };
    let spec = RawSpec {
        path: path.to_path_buf(),
        rows: m.rows.ok_or_else(|| missing("rows"))?,
        cols: m.cols.ok_or_else(|| missing("cols"))?,
        dtype,
        order,
        offset: m.offset.unwrap_or(0),
    };
    spec.check().map_err(|e| cx.err(format!("{key}: {e}")))?;
    Ok(MatrixDecl {
        name: name.to_string(),
        path: path.to_path_buf(),
        rows: spec.rows,
        cols: spec.cols,
        dtype,
        generate: None,
        transposed: order == RawOrder::F,
        raw: Some(spec),
    })
}

/// The plan being resolved: its file, its text (for lines) and the directory paths are
/// relative to.
pub(crate) struct Ctx<'a> {
    pub(crate) path: &'a Path,
    pub(crate) src: &'a str,
    pub(crate) base: PathBuf,
}

impl Ctx<'_> {
    pub(crate) fn err(&self, msg: String) -> Error {
        Error::plan(self.path, msg)
    }
    pub(crate) fn line<T>(&self, v: &Spanned<T>) -> usize {
        line_of(self.src, v.span().start)
    }
    /// A path the plan gives, relative to the plan's folder: `./A.mgt` for a plan in the
    /// current folder, but `../../x.npy`, not `./../../x.npy`, for one that climbs out of it.
    pub(crate) fn path(&self, p: impl AsRef<Path>) -> PathBuf {
        let p = p.as_ref();
        if self.base == Path::new(".") && p.starts_with("..") {
            return p.to_path_buf();
        }
        // `./x` under `.` is `./x`, not `././x` (new-user trial).
        let p = match p.strip_prefix(".") {
            Ok(rest) if !rest.as_os_str().is_empty() => rest,
            _ => p,
        };
        self.base.join(p)
    }
}

/// Resolve `[matrices]`: existing files by their header, missing ones by `generate`.
/// `steps` are only for the error of a missing file that one of them writes.
pub(crate) fn matrices(
    cx: &Ctx,
    raw: &BTreeMap<String, RawMatrix>,
    steps: &[RawStep],
    header_of: HeaderOf,
) -> Result<BTreeMap<String, MatrixDecl>> {
    let mut mats = BTreeMap::new();
    for (name, m) in raw {
        let key = format!("matrices.{name} (line {})", cx.line(&m.path));
        if !is_identifier(name) {
            return Err(cx.err(format!(
                "[matrices.{name:?}] (line {}): a matrix name is what `expr` refers to; use letters, digits and _, not starting with a digit",
                cx.line(&m.path)
            )));
        }
        if m.path.get_ref().trim().is_empty() {
            return Err(cx.err(format!("{key}: path is empty; give the matrix's file")));
        }
        let path = cx.path(m.path.get_ref());
        let decl = if m.format.is_some() {
            raw_decl(cx, name, &key, m, &path)
        } else {
            file_decl(cx, name, &key, m, path.clone(), header_of)
        };
        let decl = decl.map_err(|e| {
            match steps.iter().position(|s| same_file(&cx.path(s.output.get_ref()), &path)) {
                Some(i) if !path.exists() && m.generate.is_none() => {
                    let named = (steps[i].name.as_ref()).is_some_and(|n| n.get_ref() == name);
                    let fix = match named {
                        true => format!("step {} already names it {name}: drop [matrices.{name}]", i + 1),
                        false => format!("add name = \"{name}\" to step {} and drop [matrices.{name}]", i + 1),
                    };
                    cx.err(format!(
                        "{key}: file {} does not exist yet: step {} (line {}) writes it. A later step reads a step's output by its name: {fix} ([matrices] are files that exist before the run)",
                        path.display(),
                        i + 1,
                        cx.line(&steps[i].output),
                    ))
                }
                _ => e,
            }
        })?;
        // Two names for one file must agree on what it holds (a `generate` of another shape
        // would otherwise be found only when `run` reads past the matrix; a raw file read as
        // another shape is a reshape, not a view). A raw file declared once in each order is
        // one matrix and its transpose: the same bytes, so that is allowed.
        let stored = |d: &MatrixDecl| {
            let (r, c) = if d.transposed {
                (d.cols, d.rows)
            } else {
                (d.rows, d.cols)
            };
            (r, c, d.dtype, d.raw.as_ref().map(|x| x.offset))
        };
        if let Some(o) = mats.values().find(|o: &&MatrixDecl| {
            crate::plan::same_file(&o.path, &decl.path) && stored(o) != stored(&decl)
        }) {
            // A raw file read again with rows and cols swapped is most likely meant as the
            // transpose: say how to declare that.
            let transpose = if decl.raw.is_some()
                && o.raw.is_some()
                && (decl.rows, decl.cols) == (o.cols, o.rows)
            {
                let order = if o.transposed { "C" } else { "F" };
                format!(" (for its transpose write {}.T in expr, or declare it with order = \"{order}\")", o.name)
            } else {
                String::new()
            };
            return Err(cx.err(format!(
                "{key}: {} is also matrices.{}, declared {}×{} {} there but {}×{} {} here; one file holds one matrix: give one of them another path{transpose}",
                decl.path.display(), o.name, o.rows, o.cols, o.dtype, decl.rows, decl.cols, decl.dtype
            )));
        }
        mats.insert(name.clone(), decl);
    }
    Ok(mats)
}

/// The declaration of a `.mgt` or `.npy` matrix: the file's header when it exists, else its
/// `generate`.
fn file_decl(
    cx: &Ctx,
    name: &str,
    key: &str,
    m: &RawMatrix,
    path: PathBuf,
    header_of: HeaderOf,
) -> Result<MatrixDecl> {
    if m.rows.is_some()
        || m.cols.is_some()
        || m.dtype.is_some()
        || m.order.is_some()
        || m.offset.is_some()
    {
        return Err(cx.err(format!(
            "{key}: rows, cols, dtype, order and offset describe a raw binary file; add format = \"raw\", or drop them (.mgt and .npy files carry their shape)"
        )));
    }
    let spec = match &m.generate {
        Some(g) => Some(gen_spec(cx, name, g)?),
        None => None,
    };
    let info = header_of(&path).map_err(|e| cx.err(format!("{key}: {e}")))?;
    Ok(match (info, spec) {
        (Some(f), spec) => {
            if let Some(s) = spec {
                if (s.rows, s.cols, s.dtype) != (f.rows, f.cols, f.dtype) {
                    return Err(cx.err(format!(
                        "{key}: {} exists and is {}×{} {}, but `generate` asks for {}×{} {}; delete the file to regenerate it, or fix the plan",
                        path.display(), f.rows, f.cols, f.dtype, s.rows, s.cols, s.dtype
                    )));
                }
            }
            MatrixDecl {
                name: name.to_string(),
                path,
                rows: f.rows,
                cols: f.cols,
                dtype: f.dtype,
                generate: None,
                transposed: f.transposed,
                raw: None,
            }
        }
        (None, Some(s)) => MatrixDecl {
            name: name.to_string(),
            path,
            rows: s.rows,
            cols: s.cols,
            dtype: s.dtype,
            generate: Some(s),
            transposed: false,
            raw: None,
        },
        (None, None) => {
            return Err(cx.err(format!(
                "{key}: file {} does not exist; create it with `mgmm-stream gen` or `import`, or add `generate = {{ rows = …, cols = … }}`",
                path.display()
            )))
        }
    })
}

/// A name `expr` can refer to: letters, digits and `_`, not starting with a digit.
fn is_identifier(name: &str) -> bool {
    let mut c = name.chars();
    c.next()
        .is_some_and(|f| f.is_ascii_alphabetic() || f == '_')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_')
}

fn gen_spec(cx: &Ctx, name: &str, g: &Spanned<RawGenerate>) -> Result<GenSpec> {
    let key = format!("matrices.{name}.generate (line {})", cx.line(g));
    let g = g.get_ref();
    if g.rows == 0 || g.cols == 0 {
        return Err(cx.err(format!(
            "{key}: rows and cols must be at least 1 (got {}×{})",
            g.rows, g.cols
        )));
    }
    if crate::store::gen::absurdly_large(g.rows, g.cols) {
        return Err(cx.err(format!("{key}: {}×{} is absurdly large", g.rows, g.cols)));
    }
    let dist = match &g.dist {
        None => Dist::Normal,
        Some(d) => Dist::parse(d).ok_or_else(|| {
            cx.err(format!(
                "{key}: dist = \"{d}\" is unknown; use one of {}",
                Dist::NAMES
            ))
        })?,
    };
    let dtype = match &g.dtype {
        None => DType::F32,
        Some(d) => DType::parse(d).ok_or_else(|| {
            cx.err(format!(
                "{key}: dtype = \"{d}\" is unknown; use f32, f64, f16 or bf16"
            ))
        })?,
    };
    let tile = g.tile.unwrap_or(1024);
    if tile == 0 || tile > crate::store::header::MAX_TILE_EDGE {
        return Err(cx.err(format!("{key}: tile = {tile} must be between 1 and 65536")));
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

/// Matrices a step can read: the declared ones and earlier steps' named outputs, each as an
/// operand read without `.T` (`trans` set when the file stores the transpose).
type Avail = BTreeMap<String, Operand>;

fn decl_operand(d: &MatrixDecl) -> Operand {
    let (rows, cols) = if d.transposed {
        (d.cols, d.rows)
    } else {
        (d.rows, d.cols)
    };
    Operand {
        name: d.name.clone(),
        path: d.path.clone(),
        rows,
        cols,
        dtype: d.dtype,
        trans: d.transposed,
        stored_t: d.transposed,
        raw: d.raw.clone(),
        temp: false,
    }
}

/// Resolve every `[[step]]` in order; a named output becomes available to later steps. A
/// `[[step]]` whose expression is a chain becomes several steps (its sub-products).
/// `precision_at` says where the precision was given (else f64 inputs select fp64).
pub(crate) fn steps(
    cx: &Ctx,
    raw: &[RawStep],
    mats: &BTreeMap<String, MatrixDecl>,
    engine: &mut Engine,
    precision_at: Option<String>,
) -> Result<Vec<Step>> {
    if raw.is_empty() {
        return Err(
            cx.err("the plan has no [[step]]; add one with `output` and `expr = \"A @ B\"`".into())
        );
    }
    let mut avail: Avail = mats
        .values()
        .map(|d| (d.name.clone(), decl_operand(d)))
        .collect();
    // Which step names which output: a use before the step that makes it is then explained.
    let named: BTreeMap<String, usize> = raw
        .iter()
        .enumerate()
        .filter_map(|(j, s)| Some((s.name.as_ref()?.get_ref().clone(), j)))
        .collect();
    let mut steps: Vec<Step> = Vec::new();
    for (i, s) in raw.iter().enumerate() {
        let parts = step(cx, i, s, &avail, &named, engine.host_memory)?;
        if i == 0 && precision_at.is_none() && parts[0].a.dtype == DType::F64 {
            // f64 inputs and no precision given: compute in f64.
            engine.precision = Precision::Fp64;
        }
        for mut part in parts {
            part.out_dtype = engine.precision.host_dtype();
            check_precision(cx, &part, engine.precision, precision_at.as_deref(), &steps)?;
            check_output(cx, &part, &steps, mats)?;
            steps.push(part);
        }
        let last = steps.last().expect("a step has at least one part");
        if let Some(name) = &s.name {
            let n = name.get_ref();
            if !is_identifier(n) {
                return Err(cx.err(format!(
                    "step {} (line {}): name = {n:?}: a name is what `expr` refers to; use letters, digits and _, not starting with a digit",
                    i + 1,
                    cx.line(name)
                )));
            }
            if avail.contains_key(n) {
                return Err(cx.err(format!(
                    "step {} (line {}): name = \"{n}\" is already used by another matrix",
                    i + 1,
                    cx.line(name)
                )));
            }
            let op = Operand {
                name: n.clone(),
                path: last.output.clone(),
                rows: last.m,
                cols: last.n,
                dtype: last.out_dtype,
                trans: false,
                stored_t: false,
                raw: None,
                temp: false,
            };
            avail.insert(n.clone(), op);
        }
    }
    Ok(steps)
}

/// One `[[step]]`: its expression reduced to `alpha·op(F₁)·…·op(Fₙ) + beta·c0`, operands looked
/// up, shapes and dtypes checked; a chain (n > 2) ordered and cut into sub-product steps.
fn step(
    cx: &Ctx,
    i: usize,
    s: &RawStep,
    avail: &Avail,
    named: &BTreeMap<String, usize>,
    mem: u64,
) -> Result<Vec<Step>> {
    let line = cx.line(&s.expr);
    let at = format!("step {} (line {line})", i + 1);
    let text = s.expr.get_ref();
    let form =
        expr::product_form(text).map_err(|e| cx.err(format!("{at}: expr = \"{text}\": {e}")))?;
    let operand = |f: &Factor| factor_operand(cx, &at, text, f, i, avail, named);
    let leaves = form
        .factors
        .iter()
        .map(operand)
        .collect::<Result<Vec<_>>>()?;
    check_chain(cx, &at, text, &form.factors, &leaves)?;
    let m = leaves[0].op_shape().0;
    let n = leaves[leaves.len() - 1].op_shape().1;
    let (c0, beta) = addend(cx, &at, s, &form, &operand, (m, n), leaves[0].dtype)?;
    if let Some(t) = &s.tile {
        let v = *t.get_ref();
        if v == 0 || v > crate::store::header::MAX_TILE_EDGE {
            return Err(cx.err(format!(
                "step {} (line {}): tile = {v} must be between 1 and 65536",
                i + 1,
                cx.line(t)
            )));
        }
    }
    let output = cx.path(s.output.get_ref());
    let alpha = form.alpha * s.alpha.as_ref().map_or(1.0, |v| *v.get_ref());
    check_scalars(
        cx,
        &at,
        &[("alpha", alpha), ("beta", beta)],
        leaves[0].dtype,
    )?;
    let one = |a: Operand, b: Operand, output: PathBuf, last: bool| Step {
        index: i,
        line,
        expr: text.clone(),
        m: a.op_shape().0,
        n: b.op_shape().1,
        k: a.op_shape().1,
        a,
        b,
        c0: if last { c0.clone() } else { None },
        alpha: if last { alpha } else { 1.0 },
        beta: if last { beta } else { 0.0 },
        output,
        out_dtype: DType::F32,
        out_tile: if last {
            s.tile.as_ref().map(|t| *t.get_ref())
        } else {
            None
        },
        chain: None,
        held: Vec::new(),
    };
    if leaves.len() == 2 {
        let (a, b) = (leaves[0].clone(), leaves[1].clone());
        return Ok(vec![one(a, b, output, true)]);
    }
    let names: Vec<String> = form
        .factors
        .iter()
        .map(|f| format!("{}{}", f.name, if f.trans { ".T" } else { "" }))
        .collect();
    // A transposed product's factors come reversed (`(X @ Y).T` is `Y.T @ X.T`): its naive
    // order as written is then right to left here.
    let (first, last) = (&form.factors[0], &form.factors[form.factors.len() - 1]);
    let reversed = first.col > last.col && last.col > 0;
    Ok(chain_steps(
        &leaves, &names, reversed, &output, mem, text, one,
    ))
}

/// The operand a factor of step `i`'s expression names (transposed as the factor says), or the
/// error naming it: unknown, or the output of a step that has not run yet.
fn factor_operand(
    cx: &Ctx,
    at: &str,
    text: &str,
    f: &Factor,
    i: usize,
    avail: &Avail,
    named: &BTreeMap<String, usize>,
) -> Result<Operand> {
    let base = avail.get(&f.name).ok_or_else(|| {
        let place = if f.col == 0 {
            "in accumulate".to_string()
        } else {
            format!("(column {}) in expr \"{text}\"", f.col)
        };
        if let Some(&j) = named.get(&f.name).filter(|&&j| j >= i) {
            let fix = if j == i {
                "a step cannot use its own output".to_string()
            } else {
                format!("steps run in plan order: move step {} before this one", j + 1)
            };
            return cx.err(format!(
                "{at}: `{}` {place} is the output of step {} (name = \"{}\"), which has not run yet; {fix}",
                f.name,
                j + 1,
                f.name
            ));
        }
        cx.err(format!(
            "{at}: unknown matrix `{}` {place}; known: {}",
            f.name,
            avail.keys().cloned().collect::<Vec<_>>().join(", ")
        ))
    })?;
    Ok(Operand {
        trans: base.trans ^ f.trans,
        ..base.clone()
    })
}

/// Neighbouring factors of a product must agree in inner dimension and dtype. A mismatch is
/// named as the expression is written: a transposed product's factors come in reverse order
/// and transposed (`(X @ Y).T` is `Y.T @ X.T`), and are turned back for the message.
fn check_chain(
    cx: &Ctx,
    at: &str,
    text: &str,
    factors: &[Factor],
    leaves: &[Operand],
) -> Result<()> {
    for (i, w) in leaves.windows(2).enumerate() {
        let ((m, k), (k2, n)) = (w[0].op_shape(), w[1].op_shape());
        if k != k2 {
            let (f0, f1) = (&factors[i], &factors[i + 1]);
            let written = |f: &Factor, flip: bool| {
                format!("{}{}", f.name, if f.trans != flip { ".T" } else { "" })
            };
            let (x, (xr, xc), y, (yr, yc)) = match f0.col > f1.col && f1.col > 0 {
                false => (written(f0, false), (m, k), written(f1, false), (k2, n)),
                true => (written(f1, true), (n, k2), written(f0, true), (k, m)),
            };
            // One operand on both sides ("A @ A"): "A is … but A is …" read as nonsense to a
            // new user; say what does not meet, and what would.
            if x == y {
                return Err(cx.err(format!(
                    "{at}: shape mismatch in \"{text}\": {x} is {xr}×{xc} on both sides of @ (inner dimensions {xc} ≠ {yr}: its columns against its rows); {x}.T on one side would match"
                )));
            }
            return Err(cx.err(format!(
                "{at}: shape mismatch in \"{text}\": {x} is {xr}×{xc} but {y} is {yr}×{yc} (inner dimensions {xc} ≠ {yr})"
            )));
        }
        if w[0].dtype != w[1].dtype {
            return Err(cx.err(format!(
                "{at}: `{}` is {} but `{}` is {}; operands must have the same dtype",
                w[0].name, w[0].dtype, w[1].name, w[1].dtype
            )));
        }
    }
    Ok(())
}

/// `alpha` and `beta` must be finite, and within f32's normal range unless the inputs are f64.
fn check_scalars(cx: &Ctx, at: &str, scalars: &[(&str, f64)], dtype: DType) -> Result<()> {
    for &(what, v) in scalars {
        let note = format!(" (expr's coefficient times the `{what}` key)");
        scalar_problem(what, &note, v, dtype).map_err(|e| cx.err(format!("{at}: {e}")))?;
    }
    Ok(())
}

/// What is wrong with a step's coefficient `what` = `v` for inputs of `dtype` (`note` follows
/// its value in the message: where it came from), if anything: the one check of `alpha` and
/// `beta` for plans and for the Python package's `matmul(alpha=…)`.
pub fn scalar_problem(
    what: &str,
    note: &str,
    v: f64,
    dtype: DType,
) -> std::result::Result<(), String> {
    // inf or NaN would make every output element non-finite (and an overflowing product
    // of finite factors, too): refused here rather than found by `verify` afterwards.
    if !v.is_finite() {
        return Err(format!("{what} = {v}{note}; use a finite number"));
    }
    // Inputs other than f64 are computed with f32 scalars: a factor that overflows f32
    // makes every output element infinite, one below its normal range loses its digits
    // or flushes to zero — a wrong product, silently.
    let f32_range = f32::MIN_POSITIVE as f64..=f32::MAX as f64;
    if dtype != DType::F64 && v != 0.0 && !f32_range.contains(&v.abs()) {
        return Err(format!(
            "{what} = {v:e} is outside f32's normal range (about 1.2e-38 to 3.4e38), and with {dtype} inputs the product is computed with f32 factors; scale the inputs instead, or store them as f64 and set precision = \"fp64\""
        ));
    }
    Ok(())
}

/// The steps of a chain: the cheapest order, its sub-products as steps, each knowing the chain
/// and which intermediates stay in memory (within [`chain::memory_budget`] of `host_memory`).
#[allow(clippy::too_many_arguments)]
fn chain_steps(
    leaves: &[Operand],
    names: &[String],
    reversed: bool,
    output: &Path,
    host_memory: u64,
    text: &str,
    one: impl Fn(Operand, Operand, PathBuf, bool) -> Step,
) -> Vec<Step> {
    let mem = chain::memory_budget(host_memory);
    let mut dims: Vec<u64> = leaves.iter().map(|o| o.op_shape().0).collect();
    dims.push(leaves[leaves.len() - 1].op_shape().1);
    let elem = leaves[0].dtype.compute().size() as u64;
    let best = chain::best_order(&dims, mem, elem);
    // The naive order is left to right as the user wrote the expression: of the factors as
    // written (reversed and transposed back) when the product is a transposed one.
    let n = leaves.len();
    let (naive, naive_text) = match reversed {
        false => (chain::left_to_right(n), chain::left_to_right(n).show(names)),
        true => {
            let written: Vec<String> = (names.iter().rev())
                .map(|x| match x.strip_suffix(".T") {
                    Some(base) => base.to_string(),
                    None => format!("{x}.T"),
                })
                .collect();
            (
                chain::right_to_left(n),
                chain::left_to_right(n).show(&written),
            )
        }
    };
    let mut subs = chain::sub_products(&best, leaves, output, mem, elem);
    // Intermediates are stored as the steps' output dtype, f32 (`Step::out_dtype`).
    chain::place_in_memory(&mut subs, mem, DType::F32.size() as u64);
    let temps: Vec<PathBuf> = subs
        .iter()
        .filter(|p| p.temp)
        .map(|p| p.output.clone())
        .collect();
    let memory: Vec<PathBuf> = subs
        .iter()
        .filter(|p| p.memory)
        .map(|p| p.output.clone())
        .collect();
    let parts = subs.len();
    subs.into_iter()
        .enumerate()
        .map(|(j, p)| {
            let mut st = one(p.a, p.b, p.output, j + 1 == parts);
            st.expr = format!("{text} [part {}/{parts}: {}]", j + 1, p.text);
            st.chain = Some(chain::ChainPart {
                part: j + 1,
                parts,
                root_output: output.to_path_buf(),
                temps: temps.clone(),
                memory: memory.clone(),
                leaves: leaves.to_vec(),
                text: p.text,
                cost: p.cost,
                order: best.show(names),
                order_cost: chain::tree_cost(&best, &dims, mem, elem),
                naive: naive_text.clone(),
                naive_cost: chain::tree_cost(&naive, &dims, mem, elem),
            });
            st
        })
        .collect()
}

/// The matrix added to the product (from `+ β·C0` in `expr`, or the `accumulate`/`beta` keys)
/// and its coefficient.
fn addend(
    cx: &Ctx,
    at: &str,
    s: &RawStep,
    form: &ProductForm,
    operand: &dyn Fn(&Factor) -> Result<Operand>,
    (m, n): (u64, u64),
    dtype: DType,
) -> Result<(Option<Operand>, f64)> {
    let (factor, beta, what) = match (&form.c0, &s.accumulate, &s.beta) {
        (Some((f, _)), Some(acc), _) => {
            return Err(cx.err(format!(
                "{at}: expr adds `{}` and accumulate = \"{}\" (line {}) adds another; keep one",
                f.name,
                acc.get_ref(),
                cx.line(acc)
            )))
        }
        (Some(_), None, Some(b)) => {
            return Err(cx.err(format!(
                "{at}: beta (line {}) is set but expr already gives the added matrix its factor; write it in expr (… + {} * C0)",
                cx.line(b),
                b.get_ref()
            )))
        }
        (Some((f, beta)), None, None) => (
            f.clone(),
            *beta,
            format!("the added matrix `{}` (column {})", f.name, f.col),
        ),
        (None, None, Some(b)) => {
            return Err(cx.err(format!(
                "{at}: beta (line {}) is set but `accumulate` is not; name the matrix to add (accumulate = \"C0\")",
                cx.line(b)
            )))
        }
        (None, None, None) => return Ok((None, 0.0)),
        (None, Some(acc), b) => (
            Factor {
                name: acc.get_ref().clone(),
                trans: false,
                col: 0,
            },
            b.as_ref().map_or(1.0, |v| *v.get_ref()),
            format!(
                "accumulate = \"{}\" (line {})",
                acc.get_ref(),
                cx.line(acc)
            ),
        ),
    };
    let c = operand(&factor)?;
    if c.trans {
        return Err(cx.err(format!(
            "{at}: {what} is stored in Fortran (column-major) order; the added matrix must be stored row-major (C order): rewrite its data so, e.g. np.save(PATH, np.ascontiguousarray(c0)) (declaring a raw file order = \"C\" would only misread it)"
        )));
    }
    if (c.rows, c.cols) != (m, n) {
        return Err(cx.err(format!(
            "{at}: {what} is {}×{} but the product is {m}×{n}",
            c.rows, c.cols
        )));
    }
    if c.dtype != dtype {
        return Err(cx.err(format!(
            "{at}: {what} is {} but the operands are {dtype}",
            c.dtype
        )));
    }
    Ok((Some(c), beta))
}

fn check_precision(
    cx: &Ctx,
    s: &Step,
    p: Precision,
    p_at: Option<&str>,
    earlier: &[Step],
) -> Result<()> {
    let at = s.at();
    // Changing the precision would only move the error to an earlier step of the other kind.
    let mixed = (earlier.iter())
        .find(|e| (e.a.dtype == DType::F64) != (s.a.dtype == DType::F64))
        .map(|e| {
            format!(
                "; precision is one for the whole plan ([engine]) and step {} computes from {} inputs, so put the {} steps in a plan of their own",
                e.index + 1,
                e.a.dtype,
                if s.a.dtype == DType::F64 { "f64" } else { "f32" }
            )
        });
    let key = p_at.map_or("engine.precision".to_string(), str::to_string);
    // `--set engine.precision=fp64` already says its value.
    let said = |v: &str| {
        if key.starts_with("--set") {
            key.clone()
        } else {
            format!("{key} = \"{v}\"")
        }
    };
    match (p, s.a.dtype) {
        (Precision::Fp64 | Precision::Fp64Emulated(_), DType::F64) => Ok(()),
        (Precision::Fp64 | Precision::Fp64Emulated(_), dt) => Err(cx.err(format!(
            "{at}: {} needs f64 inputs, but `{}` is {dt}{}",
            said(p.name()),
            s.a.name,
            mixed.unwrap_or_default()
        ))),
        (p, DType::F64) => Err(cx.err(format!(
            "{at}: `{}` is f64 but {}{}",
            s.a.name,
            said(p.name()),
            mixed.unwrap_or_else(|| "; set precision = \"fp64\"".into())
        ))),
        _ => Ok(()),
    }
}

/// The output must be a new file: not a directory, not an input, not another step's output.
fn check_output(
    cx: &Ctx,
    s: &Step,
    earlier: &[Step],
    mats: &BTreeMap<String, MatrixDecl>,
) -> Result<()> {
    let at = s.at();
    let out = &s.output;
    if out.is_dir() {
        return Err(cx.err(format!(
            "{at}: output {} is a directory; give a file path",
            out.display()
        )));
    }
    if same_file(cx.path, out) {
        return Err(cx.err(format!(
            "{at}: output {} is this plan file; write the result to a new file",
            out.display()
        )));
    }
    // Nor what the engine keeps beside an input or an output (a journal, a `.npy`'s checksums,
    // checkpoints, a split run's folder): `run --restart` would replace it (new-user trial).
    // Also beside a file of another plan's: `X.npy.crc32c` where `X.npy` exists.
    let beside: Vec<PathBuf> = (super::COMPANION_SUFFIXES.iter())
        .filter_map(|suf| out.to_str()?.strip_suffix(suf).map(PathBuf::from))
        .filter(|owner| owner.is_file())
        .collect();
    let owners = (mats.values().map(|d| (&d.path, "matrix file")))
        .chain(earlier.iter().map(|e| (&e.output, "output")))
        .chain(beside.iter().map(|p| (p, "file")));
    for (owner, what) in owners {
        if let Some(suffix) = super::companion_of(out, owner) {
            return Err(cx.err(format!(
                "{at}: output {} is the {suffix} file the engine keeps beside the {what} {}; write the result to a new file",
                out.display(),
                owner.display()
            )));
        }
    }
    for e in earlier {
        if let Some(suffix) = super::companion_of(&e.output, out) {
            return Err(cx.err(format!(
                "{at}: step {}'s output {} is the {suffix} file the engine keeps beside this output {}; give one of them another path",
                e.index + 1,
                e.output.display(),
                out.display()
            )));
        }
    }
    for op in [Some(&s.a), Some(&s.b), s.c0.as_ref()]
        .into_iter()
        .flatten()
    {
        if same_file(&op.path, out) {
            return Err(cx.err(format!(
                "{at}: output {} is also the input `{}`; write the result to a new file",
                out.display(),
                op.name
            )));
        }
    }
    if earlier.iter().any(|e| same_file(&e.output, out)) {
        return Err(cx.err(format!(
            "{at}: output {} is written by an earlier step too",
            out.display()
        )));
    }
    for d in mats.values() {
        if same_file(&d.path, out) {
            return Err(cx.err(format!(
                "{at}: output {} is the file of matrix `{}`; inputs are never overwritten — choose another output path, or, for a later step to read this step's output, give this step name = \"{}\" and drop [matrices.{}]",
                out.display(),
                d.name,
                d.name,
                d.name
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Plan;

    /// Headers for A (20×30), B (30×10), C0 (20×10), D (30×10 f64); anything else is missing.
    fn headers(p: &Path) -> Result<Option<MatrixInfo>> {
        let name = p.file_stem().unwrap().to_str().unwrap();
        let info = |rows, cols, dtype| {
            Some(MatrixInfo {
                rows,
                cols,
                dtype,
                transposed: name == "F",
            })
        };
        Ok(match name {
            "A" => info(20, 30, DType::F32),
            "B" => info(30, 10, DType::F32),
            "C0" => info(20, 10, DType::F32),
            "D" => info(30, 10, DType::F64),
            // Fortran order: declared 10×20, stored as its 20×10 transpose.
            "F" => info(10, 20, DType::F32),
            _ => None,
        })
    }
    const MATS: &str = "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n[matrices.C0]\npath = \"C0.mgt\"\n[matrices.D]\npath = \"D.mgt\"\n";

    #[test]
    fn fortran_operands_flip_their_transpose_and_chains_cut_into_parts() {
        // F is declared 10×20 (A·B is 20×10, so A·B·F is 20×20); stored as its transpose.
        let p = plan(&format!(
            "{MATS}[matrices.F]\npath = \"F.npy\"\n[[step]]\noutput = \"X.npy\"\nexpr = \"2 * A @ B @ F\"\n"
        ))
        .unwrap();
        assert_eq!(p.steps.len(), 2);
        let (s1, s2) = (&p.steps[0], &p.steps[1]);
        // (A·B)·F: 2·20·30·10 + 2·20·10·20 against A·(B·F): 2·30·10·20 + 2·20·30·20.
        assert_eq!((s1.a.name.as_str(), s1.b.name.as_str()), ("A", "B"));
        assert_eq!((s1.alpha, s2.alpha), (1.0, 2.0));
        assert!(s1.output.to_str().unwrap().ends_with("X.npy.part1.mgt"));
        assert!(s2.a.temp && !s2.a.trans);
        assert_eq!(
            (s2.b.name.as_str(), s2.b.trans, s2.b.rows, s2.b.cols),
            ("F", true, 20, 10)
        );
        // Named as written: read transposed because the file stores the transpose, not `F.T`;
        // the journaled text keeps how it is read (older journals say so).
        assert_eq!(s2.b.label(), "F");
        assert!(s2.expr.ends_with("T1 @ F.T]"), "{}", s2.expr);
        assert_eq!((s2.m, s2.n, s2.k), (20, 20, 10));
        let c = s2.chain.as_ref().unwrap();
        assert_eq!((c.part, c.parts, c.temps.len()), (2, 2, 1));
        // The 20×10 intermediate (800 bytes) fits in half of the default host_memory.
        assert_eq!(c.memory, c.temps);
        assert!(c.naive_cost >= c.order_cost);
        // (A·B)ᵀ with both factors transposed: the intermediate is computed untransposed.
        let p = plan(&format!(
            "{MATS}[[step]]\noutput = \"Y.mgt\"\nexpr = \"(A @ B @ B.T).T\"\n"
        ))
        .unwrap();
        let first = &p.steps[0];
        assert!(!first.a.trans && !first.b.trans, "{:?}", first.expr);
        // Its naive order is left to right as written, ((A @ B) @ B.T): 2·20·30·10 +
        // 2·20·10·30, not the rewritten (B @ B.T) @ A.T's 2·30·10·30 + 2·30·30·20.
        let c = first.chain.as_ref().unwrap();
        assert_eq!(c.naive, "((A @ B) @ B.T)");
        assert_eq!(c.naive_cost, 24_000.0);
    }

    fn plan(text: &str) -> Result<Plan> {
        Plan::resolve(Path::new("/nonexistent/p.toml"), text, &[], &headers)
    }

    #[test]
    fn resolves_without_files() {
        let p = plan(&format!(
            "{MATS}[[step]]\noutput = \"X.mgt\"\nexpr = \"0.5 * (B.T @ A.T).T - 2 * C0\"\nalpha = 3\nname = \"X\"\n\
             [[step]]\noutput = \"Y.mgt\"\nexpr = \"X @ X.T\"\n[engine]\nbackend = \"cpu\"\n"
        ))
        .unwrap();
        let s = &p.steps[0];
        assert_eq!(
            (s.a.name.as_str(), s.a.trans, s.b.name.as_str(), s.b.trans),
            ("A", false, "B", false)
        );
        assert_eq!((s.m, s.n, s.k, s.alpha, s.beta), (20, 10, 30, 1.5, -2.0));
        assert_eq!(s.c0.as_ref().unwrap().name, "C0");
        assert_eq!((p.steps[1].m, p.steps[1].n, p.steps[1].k), (20, 20, 10));
        assert_eq!(p.steps[1].line, 16);
        // The accumulate/beta keys still work as before.
        let p = plan(&format!(
            "{MATS}[[step]]\noutput = \"X.mgt\"\nexpr = \"A @ B\"\naccumulate = \"C0\"\nbeta = 0.25\n"
        ))
        .unwrap();
        assert_eq!((p.steps[0].alpha, p.steps[0].beta), (1.0, 0.25));
    }

    /// An output named like what the engine keeps beside a file that exists (another plan's
    /// output, say) is refused: `run --restart` would replace that file's checksums or journal.
    #[test]
    fn an_output_beside_an_existing_file_as_its_companion_is_refused() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("Z.npy"), b"x").unwrap();
        let text = format!("{MATS}[[step]]\noutput = \"Z.npy.crc32c\"\nexpr = \"A @ B\"\n");
        let e = Plan::resolve(&d.path().join("p.toml"), &text, &[], &headers)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("is the .crc32c file the engine keeps beside the file"),
            "{e}"
        );
        let text = format!("{MATS}[[step]]\noutput = \"Q.npy.crc32c\"\nexpr = \"A @ B\"\n");
        assert!(Plan::resolve(&d.path().join("p.toml"), &text, &[], &headers).is_ok());
    }

    #[test]
    fn value_errors_name_their_line() {
        let step =
            |extra: &str| format!("{MATS}[[step]]\noutput = \"X.mgt\"\nexpr = \"A @ B\"\n{extra}");
        let cases: Vec<(String, &str)> = vec![
            (step("tile = 0\n"), "(line 12): tile = 0"),
            (step("beta = 2.0\n"), "beta (line 12)"),
            (step("accumulate = \"A\"\n"), "accumulate = \"A\" (line 12)"),
            (step("accumulate = \"Q\"\n"), "unknown matrix `Q` in accumulate"),
            (step("name = \"B\"\n"), "step 1 (line 12): name = \"B\""),
            (step("[engine]\nprecision = \"fp64\"\n"), "engine.precision (line 13) = \"fp64\""),
            (step("[engine]\ntile = 0\n"), "engine.tile (line 13): 0 is not a tile: each edge must be between 1 and 65536"),
            (step("[engine]\ntile = [8, 0, 8]\n"), "engine.tile (line 13): [8, 0, 8] is not a tile"),
            (format!("{MATS}[[step]]\noutput = \"X.mgt\"\nexpr = \"A @ @ B\"\n"), "step 1 (line 11): expr = \"A @ @ B\": column 5"),
            (format!("{MATS}[[step]]\noutput = \"X.mgt\"\nexpr = \"A @ Z\"\n"), "unknown matrix `Z` (column 5)"),
            (format!("{MATS}[[step]]\noutput = \"X.mgt\"\nexpr = \"A @ Y\"\n[[step]]\noutput = \"Y.mgt\"\nexpr = \"A @ B\"\nname = \"Y\"\n"), "is the output of step 2 (name = \"Y\"), which has not run yet; steps run in plan order: move step 2 before this one"),
            (format!("{MATS}[[step]]\noutput = \"X.mgt\"\nexpr = \"A @ X\"\nname = \"X\"\n"), "a step cannot use its own output"),
            (format!("{MATS}[matrices.G]\npath = \"G.mgt\"\n[[step]]\noutput = \"X.mgt\"\nexpr = \"A @ B\"\n"), "matrices.G (line 10)"),
            (format!("{MATS}[[step]]\noutput = \"p.toml\"\nexpr = \"A @ B\"\n"), "output /nonexistent/p.toml is this plan file"),
            (format!("{MATS}[[step]]\noutput = \"A.mgt.journal\"\nexpr = \"A @ B\"\n"), "output /nonexistent/A.mgt.journal is the .journal file the engine keeps beside the matrix file /nonexistent/A.mgt"),
            (format!("{MATS}[[step]]\noutput = \"X.npy\"\nexpr = \"A @ B\"\n[[step]]\noutput = \"./X.npy.crc32c\"\nexpr = \"A @ B\"\n"), "is the .crc32c file the engine keeps beside the output /nonexistent/X.npy"),
            (format!("{MATS}[[step]]\noutput = \"X.npy.shards\"\nexpr = \"A @ B\"\n[[step]]\noutput = \"X.npy\"\nexpr = \"A @ B\"\n"), "step 1's output /nonexistent/X.npy.shards is the .shards file the engine keeps beside this output /nonexistent/X.npy"),
            (format!("{MATS}[[step]]\noutput = \"C0.mgt\"\nexpr = \"A @ B\"\n"), "give this step name = \"C0\" and drop [matrices.C0]"),
            (format!("{MATS}[matrices.W]\npath = \"./W.mgt\"\n[[step]]\noutput = \"W.mgt\"\nexpr = \"A @ B\"\nname = \"W\"\n[[step]]\noutput = \"X.mgt\"\nexpr = \"W @ A\"\n"), "step 1 already names it W: drop [matrices.W]"),
            (format!("{MATS}[matrices.W]\npath = \"./W.mgt\"\n[[step]]\noutput = \"W.mgt\"\nexpr = \"A @ B\"\n[[step]]\noutput = \"X.mgt\"\nexpr = \"W @ A\"\n"), "file /nonexistent/W.mgt does not exist yet: step 1 (line 12) writes it. A later step reads a step's output by its name: add name = \"W\" to step 1"),
            (format!("{MATS}[matrices.G]\npath = \"G.mgt\"\ngenerate = {{ rows = 2, cols = 2, dist = \"odd\" }}\n"), "matrices.G.generate (line 11): dist"),
            (format!("{MATS}[matrices.G]\npath = \"G.mgt\"\n\ngenerate = {{ rows = 0, cols = 2 }}\n"), "matrices.G.generate (line 12)"),
            (format!("{MATS}[[step]]\noutput = \"X.mgt\"\nexpr = \"A @ B + C0\"\naccumulate = \"C0\"\n"), "(line 12) adds another"),
            (format!("{MATS}[[step]]\noutput = \"X.mgt\"\nexpr = \"A @ B @ B\"\n"), "B is 30×10 on both sides of @ (inner dimensions 10 ≠ 30"),
            (format!("{MATS}[[step]]\noutput = \"X.mgt\"\nexpr = \"A @ B + A @ B\"\n"), "sum of several products"),
        ];
        for (text, want) in cases {
            let e = plan(&text).unwrap_err().to_string();
            assert!(e.contains(want), "{want:?} not in: {e}");
            assert!(e.starts_with("/nonexistent/p.toml: "), "{e}");
        }
    }

    #[test]
    fn set_applies_before_validation() {
        let text = format!("{MATS}[[step]]\noutput = \"X.mgt\"\nexpr = \"A @ B\"\n[engine]\nhost_memory = \"lots\"\n");
        let path = Path::new("p.toml");
        let sets = ["engine.host_memory=64MiB".to_string()];
        let p = Plan::resolve(path, &text, &sets, &headers).unwrap();
        assert_eq!(p.engine.host_memory, 64 << 20);
        let sets = ["engine.precision=fp64".to_string()];
        let e = Plan::resolve(path, &text.replace("lots", "1GiB"), &sets, &headers).unwrap_err();
        assert!(
            e.to_string()
                .contains("--set engine.precision=fp64 needs f64"),
            "{e}"
        );
    }
}
