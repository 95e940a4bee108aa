//! `mgmm_stream._native`: the compiled half of the Python package. The Python half
//! (`pysrc/mgmm_stream/__init__.py`) turns arrays, memmaps, tensors and paths into plain
//! descriptors (address or file, offset, shape, row stride, dtype); this half opens them as the
//! engine's sources and sinks ([`sources`]), builds the step, and runs it through
//! [`mgmm_stream::api`] with the GIL released ([`drive`]). Errors become the package's
//! exception classes ([`errors`]).

mod drive;
mod errors;
mod sources;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use mgmm_stream::api::{self, FileOutput, Output, StepJob, StepSources};
use mgmm_stream::cluster::{self, prepare::Prepared, ShardOptions};
use mgmm_stream::dtype::DType;
use mgmm_stream::plan::schedule::traffic;
use mgmm_stream::plan::{Engine, MatrixDecl, Operand, Plan, Precision, Step};
use mgmm_stream::run::{self, RunOptions};
use mgmm_stream::store::{self, MatrixSource, TiledFile};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use drive::{Queue, Watch};
use errors::{bad_input, to_py};
use sources::{
    BufferSink, BufferSource, DeviceMatrix, DeviceSink, DeviceSource, RawFileSource, RawMatrix,
};

const ORIGIN: &str = "matmul()";
/// The name a plan given as a dict goes by (relative paths in it are the current directory's).
pub(crate) const DICT: &str = "<plan dict>";
/// How `plan` and the summary name the array `matmul` allocates for its result (`out=None`).
const NEW_RESULT: &str = "result (new array)";

/// JSON text to Python objects (dicts, lists, numbers, strings).
pub(crate) fn json_to_py<'py>(py: Python<'py>, json: &str) -> PyResult<Bound<'py, PyAny>> {
    py.import("json")?.call_method1("loads", (json,))
}

fn to_py_value<'py>(py: Python<'py>, v: &impl serde::Serialize) -> PyResult<Bound<'py, PyAny>> {
    json_to_py(py, &serde_json::to_string(v).expect("reports serialize"))
}

fn get<'py, T: FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<T> {
    match d.get_item(key)? {
        Some(v) => v.extract::<T>().map_err(Into::into),
        None => Err(bad_input(d.py(), format!("descriptor lacks `{key}`"))),
    }
}

fn parse_dtype(py: Python<'_>, s: &str) -> PyResult<DType> {
    DType::parse(s).ok_or_else(|| {
        bad_input(
            py,
            format!("dtype {s} is not supported; use float32, float64 or float16"),
        )
    })
}

/// A matrix in memory described by the Python layer.
fn raw_matrix(d: &Bound<'_, PyDict>) -> PyResult<RawMatrix> {
    Ok(RawMatrix {
        addr: get(d, "addr")?,
        rows: get(d, "rows")?,
        cols: get(d, "cols")?,
        ld: get(d, "ld")?,
        dtype: parse_dtype(d.py(), &get::<String>(d, "dtype")?)?,
    })
}

/// An array in GPU memory described by the Python layer (a `buffer` descriptor and `device`).
fn device_matrix(d: &Bound<'_, PyDict>) -> PyResult<DeviceMatrix> {
    Ok(DeviceMatrix {
        m: raw_matrix(d)?,
        device: get(d, "device")?,
    })
}

/// Open an operand descriptor: `path` (.mgt, .npy, or whatever the engine opens), `raw` (a file
/// region: an np.memmap), `buffer` (an array in memory) or `device` (an array in GPU memory). Also whether the operand's
/// transpose flag must flip: a path to a Fortran-order `.npy` holds its matrix's transpose
/// (the Python layer already flipped the flag of Fortran-order arrays and memmaps).
fn open_operand(d: &Bound<'_, PyDict>, label: &str) -> PyResult<(Arc<dyn MatrixSource>, bool)> {
    let py = d.py();
    let kind: String = get(d, "kind")?;
    match kind.as_str() {
        "path" => {
            let p = PathBuf::from(get::<String>(d, "path")?);
            let s = open_path(&p).map_err(|e| to_py(py, e))?;
            let flip = s.transposed();
            Ok((s, flip))
        }
        "raw" => {
            let p = PathBuf::from(get::<String>(d, "path")?);
            let shape = (get(d, "rows")?, get(d, "cols")?, get(d, "ld")?);
            let dt = parse_dtype(py, &get::<String>(d, "dtype")?)?;
            let s = open_region(&p, get(d, "offset")?, shape, dt).map_err(|e| to_py(py, e))?;
            Ok((s, false))
        }
        "buffer" => Ok((
            Arc::new(BufferSource {
                label: PathBuf::from(label),
                m: raw_matrix(d)?,
            }),
            false,
        )),
        "device" => Ok((
            Arc::new(DeviceSource {
                label: PathBuf::from(format!("{label} (GPU array)")),
                d: device_matrix(d)?,
            }),
            false,
        )),
        k => Err(bad_input(py, format!("unknown operand kind {k}"))),
    }
}

/// A memmap's region of `p`: the whole data of a `.npy` file is opened as that file (so the
/// resume journal knows it whether it came as a path or as `np.load(mmap_mode="r")`, and its
/// CRC sidecar is checked); another dense region through the engine's row-major reader; both
/// take the engine's fast paths (band reads from disk, uploads straight from the page cache).
/// A row-strided region is read with `pread`s.
fn open_region(
    p: &Path,
    offset: u64,
    (rows, cols, ld): (u64, u64, u64),
    dt: DType,
) -> mgmm_stream::Result<Arc<dyn MatrixSource>> {
    if ld != cols {
        return Ok(Arc::new(RawFileSource::open(
            p,
            offset,
            (rows, cols, ld),
            dt,
        )?));
    }
    let whole_npy = std::fs::File::open(p)
        .ok()
        .and_then(|mut f| store::npy::read_header(p, &mut f).ok())
        .is_some_and(|h| {
            let stored = if h.fortran {
                (h.cols, h.rows)
            } else {
                (h.rows, h.cols)
            };
            h.data_offset == offset && stored == (rows, cols) && h.dtype == dt
        });
    if whole_npy {
        return store::open_source(p);
    }
    store::open_region(p, (rows, cols), dt, offset)
}

/// A matrix file by its format, opened by the engine: `.npy` (C or Fortran order — a Fortran
/// one reports [`MatrixSource::transposed`] —, its CRC sidecar checked when present), `.mgt`.
fn open_path(p: &Path) -> mgmm_stream::Result<Arc<dyn MatrixSource>> {
    store::open_source(p)
}

/// A matrix product prepared by `matmul` before its output exists: the resolved step, the
/// engine settings and the opened operands.
#[pyclass(module = "mgmm_stream._native")]
struct Job {
    engine: Engine,
    step: Step,
    a: Arc<dyn MatrixSource>,
    b: Arc<dyn MatrixSource>,
}

/// The operand `name` reading `s` (its stored row-major shape), transposed when `trans`.
fn operand(name: &str, s: &Arc<dyn MatrixSource>, trans: bool) -> Operand {
    let (rows, cols) = s.shape();
    Operand {
        name: name.into(),
        path: s.path().to_path_buf(),
        rows,
        cols,
        dtype: s.dtype(),
        trans,
        stored_t: s.transposed(),
        raw: None,
        temp: false,
    }
}

fn check_shapes(py: Python<'_>, a: &Operand, b: &Operand) -> PyResult<()> {
    let ((m, k), (k2, n)) = (a.op_shape(), b.op_shape());
    let t = |o: &Operand| if o.trans { ".T" } else { "" };
    if k != k2 {
        return Err(bad_input(
            py,
            format!(
                "shape mismatch: a{} is {m}×{k} but b{} is {k2}×{n} (inner dimensions {k} ≠ {k2})",
                t(a),
                t(b)
            ),
        ));
    }
    if a.dtype != b.dtype {
        return Err(bad_input(
            py,
            format!(
            "a is {} but b is {}; operands must have the same dtype (convert one with .astype())",
            a.dtype, b.dtype
        ),
        ));
    }
    Ok(())
}

/// The precision named, or the default for the dtype: fp64 for f64 inputs, else fp32.
fn choose_precision(py: Python<'_>, p: Option<&str>, dt: DType) -> PyResult<Precision> {
    let p = match p {
        None if dt == DType::F64 => Precision::Fp64,
        None => Precision::Fp32,
        Some(s) => Precision::parse(s).ok_or_else(|| {
            bad_input(
                py,
                format!(
                "precision={s:?} is unknown; use \"fp32\", \"tf32\", \"bf16\", \"fp16\", \"fp64\" or \"fp64_emulated\""
            ),
            )
        })?,
    };
    match (p, dt) {
        (p, DType::F64) if p.is_f64() => Ok(p),
        (p, d) if p.is_f64() => Err(bad_input(py, format!(
            "precision={:?} needs float64 inputs, but the inputs are {d}",
            p.name()
        ))),
        (_, DType::F64) => Err(bad_input(py, format!(
            "the inputs are float64 but precision={:?}; use precision=\"fp64\" (the default for float64) or convert the inputs to float32",
            p.name()
        ))),
        _ => Ok(p),
    }
}

#[pymethods]
impl Job {
    /// (rows, cols) of the result.
    #[getter]
    fn shape(&self) -> (u64, u64) {
        (self.step.m, self.step.n)
    }
    /// numpy name of the result's dtype.
    #[getter]
    fn dtype(&self) -> &'static str {
        match self.step.out_dtype {
            DType::F64 => "float64",
            _ => "float32",
        }
    }

    /// What `plan` prints for this product, as data; `out`: the output file `matmul(out=…)`
    /// would write, or `None` for an array.
    #[pyo3(signature = (out=None))]
    fn describe<'py>(&self, py: Python<'py>, out: Option<String>) -> PyResult<Bound<'py, PyAny>> {
        let mut step = self.step.clone();
        if let Some(p) = out {
            step.held.retain(|h| h != &step.output);
            step.output = PathBuf::from(p);
        }
        let decl = |o: &Operand| MatrixDecl {
            name: o.name.clone(),
            path: o.path.clone(),
            rows: o.rows,
            cols: o.cols,
            dtype: o.dtype,
            generate: None,
            transposed: false,
            raw: None,
        };
        let plan = Plan {
            path: PathBuf::from(ORIGIN),
            matrices: vec![decl(&step.a), decl(&step.b)],
            steps: vec![step],
            engine: self.engine.clone(),
        };
        describe_data(py, &plan)
    }

    /// Run the product into `out` (a descriptor: `buffer` in memory, or `path` .mgt/.npy).
    /// Returns the step report as a dict, or None when a journaled output was already complete.
    #[pyo3(signature = (out, restart, on_event, cancel_event, every))]
    fn run<'py>(
        &self,
        py: Python<'py>,
        out: &Bound<'py, PyDict>,
        restart: bool,
        on_event: Option<Bound<'py, PyAny>>,
        cancel_event: Option<Bound<'py, PyAny>>,
        every: f64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let mut step = self.step.clone();
        let kind: String = get(out, "kind")?;
        // A result the call allocated (`out=None`) is named as such in the summary.
        let new = match out.get_item("new")? {
            Some(v) => v.extract::<bool>()?,
            None => false,
        };
        let label = |what: &str| match new {
            true => PathBuf::from(format!("result (new {what})")),
            false => PathBuf::from(format!("out ({what})")),
        };
        let output = match kind.as_str() {
            "buffer" => {
                let m = raw_matrix(out)?;
                if (m.rows, m.cols) != (step.m, step.n) || m.dtype != step.out_dtype {
                    return Err(bad_input(
                        py,
                        format!(
                            "out is {}×{} {} but the result is {}×{} {}",
                            m.rows, m.cols, m.dtype, step.m, step.n, step.out_dtype
                        ),
                    ));
                }
                step.output = label("array");
                let label = step.output.clone();
                // Asked of the driver only where a GPU may run the step (the CPU's lanes write
                // any memory, and asking would start the driver for nothing), and inside the
                // sink's maker, which runs without the GIL (the driver's start can take
                // seconds).
                let gpu_may_run = self.engine.backend != mgmm_stream::plan::BackendKind::Cpu;
                Output::Memory(Box::new(move || {
                    let page_locked = gpu_may_run
                        && mgmm_stream::backend::devmem::page_locked(m.addr as u64, m.byte_len());
                    Ok(Box::new(BufferSink {
                        label: label.clone(),
                        m,
                        checksums: false,
                        page_locked,
                    }) as Box<dyn store::MatrixSink>)
                }))
            }
            "device" => {
                let d = device_matrix(out)?;
                if (d.m.rows, d.m.cols) != (step.m, step.n) || d.m.dtype != step.out_dtype {
                    return Err(bad_input(
                        py,
                        format!(
                            "out is {}×{} {} but the result is {}×{} {}",
                            d.m.rows, d.m.cols, d.m.dtype, step.m, step.n, step.out_dtype
                        ),
                    ));
                }
                step.output = label("GPU array");
                let label = step.output.clone();
                Output::Memory(Box::new(move || {
                    Ok(Box::new(DeviceSink {
                        label: label.clone(),
                        d,
                    }) as Box<dyn store::MatrixSink>)
                }))
            }
            "path" => {
                let p = PathBuf::from(get::<String>(out, "path")?);
                for op in [&step.a, &step.b] {
                    if mgmm_stream::plan::same_file(&op.path, &p) {
                        return Err(bad_input(
                            py,
                            format!(
                                "out={} is also the input `{}`; write the result to a new file",
                                p.display(),
                                op.name
                            ),
                        ));
                    }
                }
                step.output = p.clone();
                match p.extension().and_then(|e| e.to_str()) {
                    // The engine's output file, by the name's extension: as `run` writes it.
                    Some("mgt" | "npy") => Output::File(Box::new(FileOutput(p))),
                    _ => {
                        return Err(bad_input(
                            py,
                            format!(
                                "out={}: name a .mgt or .npy file, or pass an array",
                                p.display()
                            ),
                        ))
                    }
                }
            }
            k => return Err(bad_input(py, format!("unknown output kind {k}"))),
        };
        let watch = Watch {
            on_event,
            cancel_event,
            every,
        };
        let queue = Arc::new(Queue::default());
        let flag = Arc::new(AtomicBool::new(false));
        let progress = watch.progress(&queue, &flag);
        let job = StepJob {
            origin: Path::new(ORIGIN),
            engine: &self.engine,
            step: &step,
            sources: StepSources {
                a: self.a.clone(),
                b: self.b.clone(),
                c0: None,
            },
            output,
            restart,
            keep_backend: true,
            progress: &progress,
        };
        // `MGMM_TRACE` never names the call's own files (the timeline would replace them).
        let mats: Vec<(String, PathBuf)> = [("a", &step.a.path), ("b", &step.b.path)]
            .into_iter()
            .filter(|(_, p)| !step.held.contains(p))
            .map(|(n, p)| (n.to_string(), p.clone()))
            .collect();
        mgmm_stream::run::space::refuse_trace_over(&mgmm_stream::run::space::job_files(
            None,
            &mats,
            std::slice::from_ref(&step),
        ))
        .map_err(|e| to_py(py, e))?;
        let rep = watch.run(py, &queue, &flag, move || api::run_step(job))?;
        match rep.map_err(|e| to_py(py, e))? {
            Some(r) => to_py_value(py, &r),
            None => Ok(py.None().into_bound(py)),
        }
    }
}

/// Prepare `alpha · op(a) · op(b)`: open both operands, check shapes and dtypes, resolve the
/// engine settings (`settings`: `[engine]` key/value pairs).
#[pyfunction]
#[pyo3(signature = (a, b, alpha, trans_a, trans_b, precision, settings))]
#[allow(clippy::too_many_arguments)]
fn prepare(
    py: Python<'_>,
    a: &Bound<'_, PyDict>,
    b: &Bound<'_, PyDict>,
    alpha: f64,
    trans_a: bool,
    trans_b: bool,
    precision: Option<String>,
    settings: Vec<(String, String)>,
) -> PyResult<Job> {
    let (sa, flip_a) = open_operand(a, "a (array)")?;
    let (sb, flip_b) = open_operand(b, "b (array)")?;
    let oa = operand("a", &sa, trans_a ^ flip_a);
    let ob = operand("b", &sb, trans_b ^ flip_b);
    check_shapes(py, &oa, &ob)?;
    mgmm_stream::plan::scalar_problem("alpha", "", alpha, oa.dtype)
        .map_err(|e| bad_input(py, e))?;
    let p = choose_precision(py, precision.as_deref(), oa.dtype)?;
    let mut kv: Vec<(&str, &str)> = settings
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    kv.push(("precision", p.name()));
    let engine = api::engine_with(Path::new(ORIGIN), &kv)
        .map_err(|e| bad_input(py, errors::python_words(&e.to_string())))?;
    let ((m, k), (_, n)) = (oa.op_shape(), ob.op_shape());
    // The expression as a plan would write it for the same files: a Fortran-order `.npy` — as a
    // path, or as a memmap of the whole file, which is opened as that file — is read as its
    // stored transpose (`MatrixSource::transposed`), as the CLI's plan reads it, and — as there
    // — that is no `.T` of the expression (its header, in the input's identity, says so). With
    // the flip written in, `2 * a @ b.T` against a plan's `A @ BF`, each side refused the
    // other's finished output and `verify` with a plan failed (a new user's trial). `o.trans`
    // less the source's own flip is what the caller asked of the matrix it passed: taken from
    // `trans_a` alone, a Fortran memmap passed with `trans_a=True` read as the path without it
    // and was handed that product's output (cold review).
    let t = |o: &Operand, s: &Arc<dyn MatrixSource>| {
        if o.trans ^ s.transposed() {
            ".T"
        } else {
            ""
        }
    };
    let expr = format!("{alpha} * a{} @ b{}", t(&oa, &sa), t(&ob, &sb));
    // Arrays are no files: `plan` says so (the output an array until `describe` is given a
    // path; `run` names its output itself).
    let held = [(&sa, &oa.path), (&sb, &ob.path)]
        .into_iter()
        .filter(|(s, _)| !s.is_file())
        .map(|(_, p)| p.clone())
        .chain([PathBuf::from(NEW_RESULT)])
        .collect();
    let step = Step {
        index: 0,
        line: 0,
        expr,
        a: oa,
        b: ob,
        c0: None,
        alpha,
        beta: 0.0,
        m,
        n,
        k,
        output: PathBuf::from(NEW_RESULT),
        out_dtype: p.host_dtype(),
        out_tile: None,
        chain: None,
        held,
    };
    Ok(Job {
        engine,
        step,
        a: sa,
        b: sb,
    })
}

/// Load a plan from a file, or from TOML text (a dict converted by the Python layer) whose
/// relative paths are relative to the current directory.
fn load_plan(
    py: Python<'_>,
    path: Option<String>,
    toml_text: Option<String>,
    sets: &[String],
) -> PyResult<Plan> {
    let r = match (path, toml_text) {
        (Some(p), None) => Plan::load_with(Path::new(&p), sets),
        (None, Some(t)) => Plan::resolve(
            &std::env::current_dir().unwrap_or_default().join(DICT),
            &t,
            sets,
            &mgmm_stream::plan::header_from_disk,
        ),
        _ => return Err(bad_input(py, "give a plan path or a plan dict")),
    };
    let mut plan = r.map_err(|e| to_py(py, e))?;
    if plan.path.ends_with(DICT) {
        // The lines are those of the TOML the dict was written as, which the caller never saw.
        for s in &mut plan.steps {
            s.line = 0;
        }
    }
    Ok(plan)
}

/// A plan dict (as JSON text) to TOML text.
#[pyfunction]
fn json_to_toml(py: Python<'_>, json: &str) -> PyResult<String> {
    let v: toml::Value = serde_json::from_str(json)
        .map_err(|e| bad_input(py, format!("the plan dict cannot be written as TOML: {e}")))?;
    toml::to_string(&v)
        .map_err(|e| bad_input(py, format!("the plan dict cannot be written as TOML: {e}")))
}

/// Run every step of a plan; returns the run report as a dict.
/// With `shard = (K, S)`, only shard K of S of every step, as `run --shard K/S` (the last
/// shard to finish finalizes the step); `wait_for_held` waits for a shard another process
/// holds to finish or go stale instead of refusing (`mgmm_stream.dask`'s retries).
#[pyfunction]
#[pyo3(signature = (path, toml_text, sets, restart, on_event, cancel_event, every, shard=None, claim_timeout=120.0, wait_timeout=3600.0, wait_for_held=false))]
#[allow(clippy::too_many_arguments)]
fn run_plan<'py>(
    py: Python<'py>,
    path: Option<String>,
    toml_text: Option<String>,
    sets: Vec<String>,
    restart: bool,
    on_event: Option<Bound<'py, PyAny>>,
    cancel_event: Option<Bound<'py, PyAny>>,
    every: f64,
    shard: Option<(u32, u32)>,
    claim_timeout: f64,
    wait_timeout: f64,
    wait_for_held: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let mut plan = load_plan(py, path, toml_text, &sets)?;
    let split = match shard {
        None => None,
        Some((k, s)) => {
            cluster::for_split(&mut plan);
            let secs = |x: f64| Duration::from_secs_f64(x.clamp(0.0, 1e9));
            let sh = ShardOptions::one_shard(
                k,
                s,
                secs(claim_timeout),
                secs(wait_timeout),
                wait_for_held,
            )
            .map_err(|e| to_py(py, e))?;
            Some(sh)
        }
    };
    let watch = Watch {
        on_event,
        cancel_event,
        every,
    };
    let queue = Arc::new(Queue::default());
    let flag = Arc::new(AtomicBool::new(false));
    let progress = watch.progress(&queue, &flag);
    let opts = RunOptions {
        restart,
        keep_backend: true,
        ..Default::default()
    };
    mgmm_stream::run::space::refuse_trace_over(&mgmm_stream::run::space::plan_files(&plan))
        .map_err(|e| to_py(py, e))?;
    let (plan, progress, opts, split) = (&plan, &progress, &opts, &split);
    let rep = watch.run(py, &queue, &flag, move || match split {
        Some(sh) => cluster::run_plan(plan, opts, sh, progress),
        None => run::run_plan(plan, opts, progress),
    })?;
    let mut rep = rep.map_err(|e| to_py(py, e))?;
    rep.plan = plan_name(plan);
    to_py_value(py, &rep)
}

/// How a report names the plan: its path, or for a plan given as a dict `<plan dict>` (its path
/// is the current directory's, for the relative paths in it; no such file exists).
fn plan_name(plan: &Plan) -> String {
    if plan.path.ends_with(DICT) {
        DICT.into()
    } else {
        plan.path.display().to_string()
    }
}

/// `mgmm-stream prepare`: generate missing inputs and create each split step's output once;
/// one dict per step (`ready`, `output`, `tiles`, `per_process`, or the input it waits for).
#[pyfunction]
#[pyo3(signature = (path, toml_text, sets, restart))]
fn prepare_plan<'py>(
    py: Python<'py>,
    path: Option<String>,
    toml_text: Option<String>,
    sets: Vec<String>,
    restart: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let mut plan = load_plan(py, path, toml_text, &sets)?;
    cluster::for_split(&mut plan);
    run::init_threads(plan.engine.threads);
    let plan = &plan;
    let done = py
        .detach(move || {
            cluster::prepare::prepare_plan(plan, restart, &mgmm_stream::progress::Progress::quiet())
        })
        .map_err(|e| to_py(py, e))?;
    let v: Vec<serde_json::Value> = done
        .iter()
        .map(|d| match d {
            Prepared::Ready {
                step,
                output,
                manifest: m,
            } => serde_json::json!({
                "step": step + 1, "ready": true, "output": output.display().to_string(),
                "tiles": m.tiles, "per_process": m.per_process, "tile": [m.tm, m.tn],
            }),
            Prepared::Waiting { step, input } => serde_json::json!({
                "step": step + 1, "ready": false, "waits_for": input.display().to_string(),
            }),
        })
        .collect();
    to_py_value(py, &v)
}

/// `mgmm-stream finalize`: finish every split step (idempotent); returns the lines the CLI
/// prints.
#[pyfunction]
#[pyo3(signature = (path, toml_text, sets))]
fn finalize_plan(
    py: Python<'_>,
    path: Option<String>,
    toml_text: Option<String>,
    sets: Vec<String>,
) -> PyResult<Vec<String>> {
    let mut plan = load_plan(py, path, toml_text, &sets)?;
    cluster::for_split(&mut plan);
    run::init_threads(plan.engine.threads);
    let plan = &plan;
    py.detach(move || {
        let mut lines = Vec::new();
        cluster::finalize::finalize_plan(plan, None, &mut |l| lines.push(l)).map(|()| lines)
    })
    .map_err(|e| to_py(py, e))
}

/// What `plan` prints, as data: the text and, per step, tiles, memory and traffic.
fn describe_data<'py>(py: Python<'py>, plan: &Plan) -> PyResult<Bound<'py, PyAny>> {
    // Said as the Python call would (a plan dict by its name; `restart=True` for the command
    // line's `--restart`).
    let text = errors::python_words(&run::describe(plan).map_err(|e| to_py(py, e))?);
    let backend = mgmm_stream::backend::select(&plan.engine).map_err(|e| to_py(py, e))?;
    let mut steps = Vec::new();
    for s in &plan.steps {
        // As `plan` and `run` lay it out (a journal's tile kept on resume).
        let l = run::layout_for(&plan.path, s, &plan.engine, backend.caps(), false)
            .map_err(|e| to_py(py, e))?;
        let t = traffic(s, &l);
        let (gm, gn, gk) = l.grid(s);
        steps.push(serde_json::json!({
            "step": s.index + 1, "output": s.output.display().to_string(), "expr": s.expr,
            "m": s.m, "n": s.n, "k": s.k, "flops": s.flops(),
            "tile": [l.tm, l.tn, l.tk], "grid": [gm, gn, gk], "output_tile": [l.out_tile.0, l.out_tile.1],
            "host_bytes": l.host_bytes, "device_bytes_per_lane": l.device_bytes, "lanes": l.lanes,
            "traffic": {
                "tile_loads": t.tile_loads, "read_bytes": t.read_bytes, "min_read_bytes": t.min_read_bytes,
                "h2d_bytes": t.h2d_bytes, "d2h_bytes": t.d2h_bytes, "write_bytes": t.write_bytes, "gemms": t.gemms,
            },
        }));
    }
    let v = serde_json::json!({
        "plan": plan_name(plan),
        "backend": backend.name(),
        "precision": plan.engine.precision.name(),
        "host_memory": plan.engine.host_memory,
        "steps": steps,
        "text": text,
    });
    to_py_value(py, &v)
}

/// What `mgmm-stream plan` prints for a plan, as data.
#[pyfunction]
#[pyo3(signature = (path, toml_text, sets))]
fn describe_plan<'py>(
    py: Python<'py>,
    path: Option<String>,
    toml_text: Option<String>,
    sets: Vec<String>,
) -> PyResult<Bound<'py, PyAny>> {
    let plan = load_plan(py, path, toml_text, &sets)?;
    describe_data(py, &plan)
}

/// Freivalds' check of every step of a plan that has run: one report dict per step.
#[pyfunction]
#[pyo3(signature = (path, toml_text, sets, rounds, seed))]
fn verify_plan<'py>(
    py: Python<'py>,
    path: Option<String>,
    toml_text: Option<String>,
    sets: Vec<String>,
    rounds: usize,
    seed: u64,
) -> PyResult<Bound<'py, PyAny>> {
    let plan = load_plan(py, path, toml_text, &sets)?;
    run::init_threads(plan.engine.threads);
    let plan = &plan;
    let reps = py.detach(move || {
        let v = mgmm_stream::verify::Verifier::new(&plan.engine, rounds, seed);
        plan.steps
            .iter()
            .filter(|s| !mgmm_stream::verify::is_intermediate(s))
            .map(|s| v.step(s))
            .collect::<mgmm_stream::Result<Vec<_>>>()
    });
    // An output nothing could be checked in (every row non-finite) is no pass: `pass` is
    // False, `checked` False, and `reason` says why (the CLI's exit status 3).
    let reps = reps.map_err(|e| to_py(py, e))?;
    let dicts: Vec<serde_json::Value> = reps
        .iter()
        .map(|r| {
            let mut v = serde_json::to_value(r).expect("a verify report serializes");
            v["checked"] = serde_json::Value::Bool(!r.nothing_checked());
            if r.nothing_checked() {
                v["pass"] = serde_json::Value::Bool(false);
                v["reason"] = serde_json::Value::String(format!(
                    "nothing checked: every row of {} holds NaN or Inf (an overflow of the output's precision, or non-finite inputs)",
                    r.output
                ));
            }
            if !r.pass && r.reason.is_none() && r.corrupt_tiles > 0 {
                v["reason"] = serde_json::Value::String(format!(
                    "{} output tile(s) no longer match the checksums `run` stored with them: the file changed after it was written; the command line's `verify --repair` redoes those tiles (`failing_tiles`), `restart=True` recomputes the step",
                    r.corrupt_tiles
                ));
            } else if !r.pass && r.reason.is_none() && !r.nothing_checked() {
                // A FAIL found in the output itself: said, not left `None` (new-user trial).
                v["reason"] = serde_json::Value::String(format!(
                    "the output fails the check (largest residual/allowed = {:.3e}; the failing output tiles are in `failing_tiles`): it does not hold this product; `restart=True` recomputes the step (the command line's `verify --repair` redoes only those tiles)",
                    r.max_ratio
                ));
            }
            errors::python_words_in(&mut v);
            v
        })
        .collect();
    to_py_value(py, &dicts)
}

/// A `.mgt` file's header as a dict; `check` verifies every tile's CRC.
#[pyfunction]
#[pyo3(signature = (path, check))]
fn info<'py>(py: Python<'py>, path: String, check: bool) -> PyResult<Bound<'py, PyAny>> {
    let p = PathBuf::from(&path);
    // A .npy is not refused with "convert .npy files with mgmm-stream import" (matmul reads
    // them in place: new-user trial), but told where its description is.
    let mut magic = [0u8; 6];
    let is_npy = std::fs::File::open(&p)
        .and_then(|f| std::os::unix::fs::FileExt::read_exact_at(&f, &mut magic, 0))
        .is_ok_and(|()| &magic == b"\x93NUMPY");
    if is_npy {
        return Err(bad_input(
            py,
            format!("{path} is a .npy array: info() reads .mgt tiled files; np.load(path, mmap_mode='r') gives its shape and dtype, and `mgmm-stream info {path} --check` checks the tile checksums `run` writes beside it"),
        ));
    }
    let f = TiledFile::open(&p).map_err(|e| to_py(py, e))?;
    let h = f.hdr;
    if check {
        if !h.has_checksums() {
            return Err(to_py(py, mgmm_stream::Error::format(&p, "has no checksum table; nothing to check (re-import or regenerate it to add one)")));
        }
        let f = &f;
        py.detach(move || {
            use rayon::prelude::*;
            let gc = h.grid_cols();
            (0..h.tiles())
                .into_par_iter()
                .try_for_each(|i| f.verify_tile(i / gc, i % gc))
        })
        .map_err(|e| to_py(py, e))?;
    }
    let v = serde_json::json!({
        "path": path, "rows": h.rows, "cols": h.cols, "dtype": h.dtype.name(),
        "tile": [h.tile_rows, h.tile_cols], "grid": [h.grid_rows(), h.grid_cols()], "tiles": h.tiles(),
        "data_offset": h.data_offset, "checksums": h.has_checksums(), "file_bytes": h.file_len(),
        "checked": check,
    });
    to_py_value(py, &v)
}

/// The GPU whose memory holds `addr` (an array's data pointer).
#[pyfunction]
fn gpu_of(py: Python<'_>, addr: u64) -> PyResult<usize> {
    mgmm_stream::backend::devmem::device_of(addr).map_err(|e| to_py(py, e))
}

/// Wait for the work queued on the caller's `stream` (a CUstream handle; None: the whole GPU)
/// on GPU `device`, so that arrays it produces are complete before the engine reads them.
#[pyfunction]
#[pyo3(signature = (device, stream))]
fn gpu_wait(py: Python<'_>, device: usize, stream: Option<usize>) -> PyResult<()> {
    py.detach(|| mgmm_stream::backend::devmem::wait_for_stream(device, stream))
        .map_err(|e| to_py(py, e))
}

/// A size as plans write it ("8GiB", "512 MiB", 4096) in bytes; None where it is not one.
#[pyfunction]
fn parse_size(s: &str) -> Option<u64> {
    mgmm_stream::units::parse_size(s)
}

/// Drop the backend kept between calls (its GPUs' contexts and page-locked memory);
/// `True` if one was kept.
#[pyfunction]
fn release_backend(py: Python<'_>) -> bool {
    py.detach(mgmm_stream::backend::kept::release)
}

/// (free, total) bytes of GPU `device`'s memory.
#[pyfunction]
fn gpu_memory(py: Python<'_>, device: usize) -> PyResult<(u64, u64)> {
    mgmm_stream::backend::devmem::memory(device).map_err(|e| to_py(py, e))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<Job>()?;
    m.add_function(wrap_pyfunction!(prepare, m)?)?;
    m.add_function(wrap_pyfunction!(run_plan, m)?)?;
    m.add_function(wrap_pyfunction!(prepare_plan, m)?)?;
    m.add_function(wrap_pyfunction!(finalize_plan, m)?)?;
    m.add_function(wrap_pyfunction!(describe_plan, m)?)?;
    m.add_function(wrap_pyfunction!(verify_plan, m)?)?;
    m.add_function(wrap_pyfunction!(info, m)?)?;
    m.add_function(wrap_pyfunction!(json_to_toml, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_of, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_wait, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_memory, m)?)?;
    m.add_function(wrap_pyfunction!(parse_size, m)?)?;
    m.add_function(wrap_pyfunction!(release_backend, m)?)?;
    Ok(())
}
