//! Resolution: the parsed plan mirror plus the inputs' headers become [`Matrix`](super::MatrixDecl)
//! declarations and [`Step`]s, then the checks that need the whole plan.
//!
//! The only place that looks at input files is the `header_of` function passed in (a
//! [`HeaderOf`]), so tests resolve plans without any file. Every error names the plan file, the
//! key or step, and its line; expression errors also name the column.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use toml::Spanned;

use super::expr::{self, Factor, ProductForm};
use super::raw::{line_of, RawGenerate, RawMatrix, RawStep};
use super::{same_file, Engine, MatrixDecl, Operand, Precision, Step};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::store::gen::{Dist, GenSpec};
use crate::store::TiledFile;

/// What resolution needs to know about an input file: its stored shape and element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatrixInfo {
    pub rows: u64,
    pub cols: u64,
    pub dtype: DType,
}

/// Reads an input's header: `Ok(None)` when the file does not exist.
pub type HeaderOf<'a> = &'a dyn Fn(&Path) -> Result<Option<MatrixInfo>>;

/// [`HeaderOf`] for real files: opens the `.mgt` and reads its header.
pub fn header_from_disk(path: &Path) -> Result<Option<MatrixInfo>> {
    if !path.exists() {
        return Ok(None);
    }
    let f = TiledFile::open(path)?;
    Ok(Some(MatrixInfo {
        rows: f.rows(),
        cols: f.cols(),
        dtype: f.dtype(),
    }))
}

/// The plan being resolved: its file, its text (for lines) and the directory paths are
/// relative to.
pub(crate) struct Ctx<'a> {
    pub path: &'a Path,
    pub src: &'a str,
    pub base: PathBuf,
}

impl Ctx<'_> {
    pub fn err(&self, msg: String) -> Error {
        Error::plan(self.path, msg)
    }
    pub fn line<T>(&self, v: &Spanned<T>) -> usize {
        line_of(self.src, v.span().start)
    }
}

/// Resolve `[matrices]`: existing files by their header, missing ones by `generate`.
pub(crate) fn matrices(
    cx: &Ctx,
    raw: &BTreeMap<String, RawMatrix>,
    header_of: HeaderOf,
) -> Result<BTreeMap<String, MatrixDecl>> {
    let mut mats = BTreeMap::new();
    for (name, m) in raw {
        let key = format!("matrices.{name} (line {})", cx.line(&m.path));
        let path = cx.base.join(m.path.get_ref());
        let spec = match &m.generate {
            Some(g) => Some(gen_spec(cx, name, g)?),
            None => None,
        };
        let info = header_of(&path).map_err(|e| cx.err(format!("{key}: {e}")))?;
        let decl = match (info, spec) {
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
                    name: name.clone(),
                    path,
                    rows: f.rows,
                    cols: f.cols,
                    dtype: f.dtype,
                    generate: None,
                }
            }
            (None, Some(s)) => MatrixDecl {
                name: name.clone(),
                path,
                rows: s.rows,
                cols: s.cols,
                dtype: s.dtype,
                generate: Some(s),
            },
            (None, None) => {
                return Err(cx.err(format!(
                    "{key}: file {} does not exist; create it with `mgmm-stream gen` or `import`, or add `generate = {{ rows = …, cols = … }}`",
                    path.display()
                )))
            }
        };
        mats.insert(name.clone(), decl);
    }
    Ok(mats)
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
    if g.rows
        .checked_mul(g.cols)
        .and_then(|n| n.checked_mul(8))
        .is_none_or(|b| b > 1 << 50)
    {
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

/// Matrices a step can read: the declared ones and earlier steps' named outputs.
type Avail = BTreeMap<String, (PathBuf, u64, u64, DType)>;

/// Resolve every `[[step]]` in order; a named output becomes available to later steps.
/// `precision_explicit` says whether the precision was given (else f64 inputs select fp64).
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
        .map(|d| (d.name.clone(), (d.path.clone(), d.rows, d.cols, d.dtype)))
        .collect();
    let mut steps: Vec<Step> = Vec::new();
    for (i, s) in raw.iter().enumerate() {
        let step = step(cx, i, s, &avail)?;
        if i == 0 && precision_at.is_none() && step.a.dtype == DType::F64 {
            // f64 inputs and no precision given: compute in f64.
            engine.precision = Precision::Fp64;
        }
        let mut step = step;
        step.out_dtype = engine.precision.host_dtype();
        check_precision(cx, &step, engine.precision, precision_at.as_deref())?;
        check_output(cx, &step, &steps, mats)?;
        if let Some(name) = &s.name {
            let n = name.get_ref();
            if avail.contains_key(n) {
                return Err(cx.err(format!(
                    "step {} (line {}): name = \"{n}\" is already used by another matrix",
                    i + 1,
                    cx.line(name)
                )));
            }
            avail.insert(
                n.clone(),
                (step.output.clone(), step.m, step.n, step.out_dtype),
            );
        }
        steps.push(step);
    }
    Ok(steps)
}

/// One step: its expression reduced to `alpha·op(a)·op(b) + beta·c0`, operands looked up,
/// shapes and dtypes checked.
fn step(cx: &Ctx, i: usize, s: &RawStep, avail: &Avail) -> Result<Step> {
    let line = cx.line(&s.expr);
    let at = format!("step {} (line {line})", i + 1);
    let text = s.expr.get_ref();
    let form =
        expr::product_form(text).map_err(|e| cx.err(format!("{at}: expr = \"{text}\": {e}")))?;
    let operand = |f: &Factor| -> Result<Operand> {
        let (p, r, c, dt) = avail.get(&f.name).cloned().ok_or_else(|| {
            let place = if f.col == 0 {
                "in accumulate".to_string()
            } else {
                format!("(column {}) in expr \"{text}\"", f.col)
            };
            cx.err(format!(
                "{at}: unknown matrix `{}` {place}; known: {}",
                f.name,
                avail.keys().cloned().collect::<Vec<_>>().join(", ")
            ))
        })?;
        Ok(Operand {
            name: f.name.clone(),
            path: p,
            rows: r,
            cols: c,
            dtype: dt,
            trans: f.trans,
        })
    };
    let a = operand(&form.a)?;
    let b = operand(&form.b)?;
    let (m, k) = a.op_shape();
    let (k2, n) = b.op_shape();
    if k != k2 {
        return Err(cx.err(format!(
            "{at}: shape mismatch in \"{text}\": {}{} is {m}×{k} but {}{} is {k2}×{n} (inner dimensions {k} ≠ {k2})",
            a.name, if a.trans { ".T" } else { "" }, b.name, if b.trans { ".T" } else { "" }
        )));
    }
    if a.dtype != b.dtype {
        return Err(cx.err(format!(
            "{at}: `{}` is {} but `{}` is {}; operands must have the same dtype",
            a.name, a.dtype, b.name, b.dtype
        )));
    }
    let (c0, beta) = addend(cx, &at, s, &form, &operand, (m, n), a.dtype)?;
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
    Ok(Step {
        index: i,
        line,
        expr: text.clone(),
        a,
        b,
        c0,
        alpha: form.alpha * s.alpha.as_ref().map_or(1.0, |v| *v.get_ref()),
        beta,
        m,
        n,
        k,
        output: cx.base.join(s.output.get_ref()),
        out_dtype: DType::F32,
        out_tile: s.tile.as_ref().map(|t| *t.get_ref()),
    })
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

fn check_precision(cx: &Ctx, s: &Step, p: Precision, p_at: Option<&str>) -> Result<()> {
    let at = format!("step {} (line {})", s.index + 1, s.line);
    let key = p_at.map_or("engine.precision".to_string(), str::to_string);
    match (p, s.a.dtype) {
        (Precision::Fp64, DType::F64) => Ok(()),
        (Precision::Fp64, dt) => Err(cx.err(format!(
            "{at}: {key} = \"fp64\" needs f64 inputs, but `{}` is {dt}",
            s.a.name
        ))),
        (p, DType::F64) => Err(cx.err(format!(
            "{at}: `{}` is f64 but {key} = \"{}\"; set precision = \"fp64\"",
            s.a.name,
            p.name()
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
    let at = format!("step {} (line {})", s.index + 1, s.line);
    let out = &s.output;
    if out.is_dir() {
        return Err(cx.err(format!(
            "{at}: output {} is a directory; give a file path",
            out.display()
        )));
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
                "{at}: output {} is the file of matrix `{}`; inputs are never overwritten — choose another output path",
                out.display(),
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
        let info = |rows, cols, dtype| Some(MatrixInfo { rows, cols, dtype });
        Ok(match name {
            "A" => info(20, 30, DType::F32),
            "B" => info(30, 10, DType::F32),
            "C0" => info(20, 10, DType::F32),
            "D" => info(30, 10, DType::F64),
            _ => None,
        })
    }
    const MATS: &str = "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n[matrices.C0]\npath = \"C0.mgt\"\n[matrices.D]\npath = \"D.mgt\"\n";

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
            (format!("{MATS}[[step]]\noutput = \"X.mgt\"\nexpr = \"A @ @ B\"\n"), "step 1 (line 11): expr = \"A @ @ B\": column 5"),
            (format!("{MATS}[[step]]\noutput = \"X.mgt\"\nexpr = \"A @ Z\"\n"), "unknown matrix `Z` (column 5)"),
            (format!("{MATS}[matrices.G]\npath = \"G.mgt\"\n[[step]]\noutput = \"X.mgt\"\nexpr = \"A @ B\"\n"), "matrices.G (line 10)"),
            (format!("{MATS}[matrices.G]\npath = \"G.mgt\"\ngenerate = {{ rows = 2, cols = 2, dist = \"odd\" }}\n"), "matrices.G.generate (line 11): dist"),
            (format!("{MATS}[matrices.G]\npath = \"G.mgt\"\n\ngenerate = {{ rows = 0, cols = 2 }}\n"), "matrices.G.generate (line 12)"),
            (format!("{MATS}[[step]]\noutput = \"X.mgt\"\nexpr = \"A @ B + C0\"\naccumulate = \"C0\"\n"), "(line 12) adds another"),
            (format!("{MATS}[[step]]\noutput = \"X.mgt\"\nexpr = \"A @ B @ B\"\n"), "more than one product"),
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
                .contains("--set engine.precision=fp64 = \"fp64\" needs f64"),
            "{e}"
        );
    }
}
