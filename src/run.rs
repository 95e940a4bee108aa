//! `run` and `plan`: from a resolved plan to finished output files and a report.
//!
//! This is the only place that chooses a backend, generates missing inputs, sizes each step
//! (layout), and hands the step to the pipeline. It also renders the `plan` description and
//! the end-of-run summary from the same figures the JSON report carries.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Serialize;

use std::collections::BTreeMap;
use std::path::Path;

use crate::backend::{self, Selected};
use crate::error::{Error, Result};
use crate::pipeline::journal::{Fingerprint, Journal, State};
use crate::pipeline::stages::TileSink;
use crate::pipeline::{self, StepEnv, StepReport};
use crate::plan::layout::Layout;
use crate::plan::schedule::OutTile;
use crate::plan::schedule::{traffic, Schedule};
use crate::plan::size::fmt_bytes;
use crate::plan::Step;
use crate::plan::{Plan, Precision};
use crate::progress::Progress;
use crate::store::gen;
use crate::store::{TiledFile, TiledWriter};

#[derive(Default)]
pub struct RunOptions {
    pub report: Option<PathBuf>,
    /// Discard journals and recompute every step from scratch.
    pub restart: bool,
}

/// Ignore SIGXFSZ so that exceeding the file-size limit is an EFBIG error we can report,
/// not a silent kill.
pub fn ignore_sigxfsz() {
    // SAFETY: setting a signal's disposition to SIG_IGN installs no handler code.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
}

/// Free bytes for unprivileged writers on the filesystem holding `dir`.
fn free_bytes(dir: &Path) -> Option<u64> {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statvfs is a plain C struct of integers, for which all-zero bytes are valid.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: statvfs writes into the struct we own; the path is a valid C string.
    let r = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    (r == 0).then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

fn read_only(dir: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statvfs is a plain C struct of integers, for which all-zero bytes are valid.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as in free_bytes.
    let r = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    r == 0 && st.f_flag & libc::ST_RDONLY != 0
}

fn existing_dir(p: &Path) -> PathBuf {
    let mut d = p
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    if d.as_os_str().is_empty() {
        d = PathBuf::from(".");
    }
    while !d.exists() {
        match d.parent() {
            Some(p) if !p.as_os_str().is_empty() => d = p.to_path_buf(),
            _ => return PathBuf::from("."),
        }
    }
    d
}

/// Refuse to start when the files this plan will create do not fit on their filesystems.
fn check_space(plan: &Plan, layouts: &[Layout]) -> Result<()> {
    let mut need: BTreeMap<PathBuf, (u64, Vec<String>)> = BTreeMap::new();
    for d in &plan.matrices {
        if let (Some(g), false) = (&d.generate, d.path.exists()) {
            let h = crate::store::Header::new(g.dtype, g.rows, g.cols, g.tile.0, g.tile.1, true);
            let e = need.entry(existing_dir(&d.path)).or_default();
            e.0 += h.file_len();
            e.1.push(d.path.display().to_string());
        }
    }
    for (s, l) in plan.steps.iter().zip(layouts) {
        if !s.output.exists() {
            let h = pipeline::output_header(s, l);
            let e = need.entry(existing_dir(&s.output)).or_default();
            e.0 += h.file_len();
            e.1.push(s.output.display().to_string());
        }
    }
    for (dir, (bytes, files)) in need {
        if read_only(&dir) {
            return Err(Error::Usage(format!(
                "{} is on a read-only filesystem; cannot create {}",
                dir.display(),
                files.join(", ")
            )));
        }
        if let Some(free) = free_bytes(&dir) {
            if free < bytes {
                return Err(Error::Usage(format!(
                    "not enough disk space in {}: this plan needs {} more ({}) but {} is free; free some space or move the outputs elsewhere",
                    dir.display(),
                    fmt_bytes(bytes),
                    files.join(", "),
                    fmt_bytes(free)
                )));
            }
        }
    }
    Ok(())
}

/// Everything that determines a step's output bytes, for the journal.
fn fingerprint(step: &Step, layout: &Layout, sel: &Selected, p: Precision) -> Result<Fingerprint> {
    let mut fp = Fingerprint::new();
    let h = pipeline::output_header(step, layout);
    fp.insert(
        "output".into(),
        format!(
            "{}×{} {} in {}×{} tiles",
            h.rows, h.cols, h.dtype, h.tile_rows, h.tile_cols
        ),
    );
    fp.insert("expr".into(), step.expr.clone());
    fp.insert("alpha".into(), format!("{:?}", step.alpha));
    fp.insert("beta".into(), format!("{:?}", step.beta));
    fp.insert("precision".into(), p.name().into());
    fp.insert(
        "backend".into(),
        if sel.is_cuda() {
            "cuda".into()
        } else {
            "cpu".into()
        },
    );
    fp.insert(
        "compute tile".into(),
        format!("{}×{}×{}", layout.tm, layout.tn, layout.tk),
    );
    let ops = [Some(&step.a), Some(&step.b), step.c0.as_ref()];
    for op in ops.into_iter().flatten() {
        fp.insert(format!("input {}", op.name), input_identity(op)?);
    }
    Ok(fp)
}

/// An input's identity as the journal records it: path, size, header and checksum table
/// (`verify` compares it to find inputs changed since the output was computed).
pub fn input_identity(op: &crate::plan::Operand) -> Result<String> {
    let f = crate::store::TiledFile::open(&op.path)?;
    let len = f.hdr.file_len();
    let head = crc32c::crc32c(&f.hdr.to_block());
    let table = f
        .checksum_table()
        .map(|t| {
            format!(
                "{:08x}",
                crc32c::crc32c(&t.iter().flat_map(|c| c.to_le_bytes()).collect::<Vec<u8>>())
            )
        })
        .unwrap_or_else(|| "none".into());
    Ok(format!(
        "{} ({len} bytes, header {head:08x}, tile checksums {table})",
        op.path.display()
    ))
}

struct JournalSink<'a>(&'a Journal);
impl TileSink for JournalSink<'_> {
    fn tile_written(&self, tile: &OutTile, crc: u32) -> Result<()> {
        self.0.record(tile.seq, crc)
    }
}

#[derive(Debug, Serialize)]
pub struct RunReport {
    pub plan: String,
    pub backend: String,
    pub generated: Vec<String>,
    pub steps: Vec<StepReport>,
    pub wall_s: f64,
}

/// Build the global rayon pool once (later calls keep the first pool).
pub fn init_threads(threads: usize) -> usize {
    let n = backend::resolve_threads(threads);
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global();
    n
}

/// Generate every declared input that is missing and has a `generate` spec.
pub fn generate_missing(plan: &Plan, progress: &Progress) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for d in &plan.matrices {
        if let Some(spec) = &d.generate {
            if !d.path.exists() {
                if let Some(dir) = d.path.parent() {
                    if !dir.as_os_str().is_empty() {
                        std::fs::create_dir_all(dir)
                            .map_err(|e| Error::io(dir, "cannot create directory", e))?;
                    }
                }
                let t = Instant::now();
                let bytes = gen::generate(&d.path, spec)?;
                progress.note(&format!(
                    "generated {} ({}×{} {}, {:?}, seed {}): {} in {:.2} s",
                    d.path.display(),
                    spec.rows,
                    spec.cols,
                    spec.dtype,
                    spec.dist,
                    spec.seed,
                    fmt_bytes(bytes),
                    t.elapsed().as_secs_f64()
                ));
                out.push(d.path.display().to_string());
            }
        }
    }
    Ok(out)
}

pub fn run_plan(plan: &Plan, opts: &RunOptions, progress: &Progress) -> Result<RunReport> {
    let t0 = Instant::now();
    ignore_sigxfsz();
    init_threads(plan.engine.threads);
    let sel = backend::select(&plan.engine)?;
    // Size every step before doing any work: a plan that cannot fit fails here, untouched.
    let layouts: Vec<Layout> = plan
        .steps
        .iter()
        .map(|s| Layout::new(&plan.path, s, &plan.engine, &sel.target))
        .collect::<Result<_>>()?;
    check_space(plan, &layouts)?;
    if let Some(n) = &sel.note {
        progress.note(n);
    }
    let generated = generate_missing(plan, progress)?;
    let mut steps = Vec::new();
    'step: for (step, layout) in plan.steps.iter().zip(layouts) {
        if let Some(dir) = step.output.parent() {
            if !dir.as_os_str().is_empty() && !dir.exists() {
                std::fs::create_dir_all(dir)
                    .map_err(|e| Error::io(dir, "cannot create output directory", e))?;
            }
        }
        let fp = fingerprint(step, &layout, &sel, plan.engine.precision)?;
        let mut reselected: Option<Selected> = None;
        let rep = loop {
            let sel_now: &Selected = reselected.as_ref().unwrap_or(&sel);
            let (journal, state) =
                Journal::open(&step.output, &fp, opts.restart, plan.engine.durable)?;
            let sched = Schedule::new(step, &layout);
            let header = pipeline::output_header(step, &layout);
            // A journal with no finished tile says nothing about the output (a kill may have landed
            // while the output was being created): start the step afresh.
            let state = match state {
                State::Partial(done) if done.is_empty() => State::Fresh,
                s => s,
            };
            let (writer, todo, done_before) = match state {
                State::Complete => {
                    progress.note(&format!(
                    "step {}: {} is already complete (its journal says so); skipping. Use --restart to recompute it.",
                    step.index + 1,
                    step.output.display()
                ));
                    continue 'step;
                }
                State::Fresh => (TiledWriter::create(&step.output, header)?, None, 0),
                State::Partial(done) => {
                    let writer = TiledWriter::reopen(&step.output, header)?;
                    let out = TiledFile::open(&step.output)?;
                    let mut finished = vec![false; sched.tiles.len()];
                    let mut bad = 0;
                    for (seq, crc) in done {
                        let Some(t) = sched.tiles.get(seq as usize) else {
                            continue;
                        };
                        let mut buf = vec![0u8; t.block.elems() * step.out_dtype.size()];
                        out.read_block(&t.block, step.out_dtype, &mut buf)?;
                        if crate::store::tiled::par_crc32c(&buf) == crc {
                            finished[seq as usize] = true;
                        } else {
                            bad += 1;
                        }
                    }
                    writer.forget_checksums();
                    let todo: Vec<u32> = (0..sched.tiles.len() as u32)
                        .filter(|&i| !finished[i as usize])
                        .collect();
                    let n_done = (sched.tiles.len() - todo.len()) as u64;
                    progress.note(&format!(
                        "step {}: resuming {}: {n_done} of {} output tiles already done{}",
                        step.index + 1,
                        step.output.display(),
                        sched.tiles.len(),
                        if bad > 0 {
                            format!(
                            " ({bad} recorded tiles did not match their checksum and are redone)"
                        )
                        } else {
                            String::new()
                        }
                    ));
                    (writer, Some(todo), n_done)
                }
            };
            let lanes = sel_now.lanes(&layout, plan.engine.precision)?;
            let sink = JournalSink(&journal);
            let env = StepEnv {
                layout: &layout,
                alloc: sel_now.alloc.as_ref(),
                lanes,
                backend_name: sel_now.name.clone(),
                precision: plan.engine.precision,
                host_rounding: !sel_now.is_cuda(),
                verify_inputs: plan.engine.verify_inputs,
                durable: plan.engine.durable,
                host_budget: plan.engine.host_memory,
                progress,
                todo,
                sink: &sink,
                writer: Some(writer),
                done_before,
            };
            match pipeline::run_step(step, env) {
                Ok(rep) => {
                    journal.complete()?;
                    break rep;
                }
                // A GPU failed while others remain: its unfinished tiles are redone on the rest.
                // The journal holds every tile written so far, so this is an ordinary resume with
                // one device fewer; tiles are computed the same way on any GPU of the run.
                Err(Error::Backend { backend, msg })
                    if sel_now.is_cuda() && sel_now.ordinals.len() > 1 =>
                {
                    let failed: Option<usize> =
                        backend.strip_prefix("cuda:").and_then(|o| o.parse().ok());
                    let Some(failed) = failed.filter(|f| sel_now.ordinals.contains(f)) else {
                        return Err(Error::Backend { backend, msg });
                    };
                    let rest: Vec<u32> = sel_now
                        .ordinals
                        .iter()
                        .filter(|&&o| o != failed)
                        .map(|&o| o as u32)
                        .collect();
                    progress.note(&format!(
                    "step {}: GPU {failed} failed ({msg}); redoing its unfinished tiles on GPU(s) {rest:?}",
                    step.index + 1
                ));
                    drop(journal);
                    let engine = crate::plan::Engine {
                        devices: crate::plan::Devices::List(rest),
                        ..plan.engine.clone()
                    };
                    reselected = Some(backend::cuda::select(&engine)?);
                }
                Err(e) => return Err(e),
            }
        };
        progress.note(&format_summary(&rep));
        steps.push(rep);
    }
    let report = RunReport {
        plan: plan.path.display().to_string(),
        backend: sel.name.clone(),
        generated,
        steps,
        wall_s: t0.elapsed().as_secs_f64(),
    };
    if let Some(p) = &opts.report {
        let s = serde_json::to_string_pretty(&report).expect("report serializes");
        std::fs::write(p, s).map_err(|e| Error::io(p, "cannot write report", e))?;
    }
    Ok(report)
}

pub fn format_summary(r: &StepReport) -> String {
    let mut s = format!(
        "step {}: {} = {}  ({}×{}×{}, {}, {}, tile {}×{}×{})\n",
        r.step,
        r.output,
        r.expr,
        r.m,
        r.n,
        r.k,
        r.precision,
        r.backend,
        r.tile[0],
        r.tile[1],
        r.tile[2]
    );
    s += &format!(
        "  wall {:.3} s   {:.2} GFLOP/s   read {} ({:.0} MB/s)   written {}   flush {:.3} s\n",
        r.wall_s,
        r.gflops_per_s,
        fmt_bytes(r.read_bytes),
        r.read_bytes as f64 / r.wall_s / 1e6,
        fmt_bytes(r.write_bytes),
        r.flush_s
    );
    let pools: Vec<String> = r
        .pools
        .iter()
        .map(|p| {
            format!(
                "{} {}×{} (peak {})",
                p.name,
                p.buffers,
                fmt_bytes(p.buffer_bytes),
                p.high_water
            )
        })
        .collect();
    s += &format!(
        "  host memory: {}; peak {} of {} budget\n",
        pools.join(", "),
        fmt_bytes(r.host_peak_bytes),
        fmt_bytes(r.host_budget_bytes)
    );
    for l in &r.lanes {
        if l.name != "cpu" {
            s += &format!(
                "  {}: gemm {:.3} s ({} calls), H2D {} at {:.1} GB/s, D2H {} at {:.1} GB/s\n",
                l.name,
                l.stats.gemm_s,
                l.stats.gemms,
                fmt_bytes(l.stats.h2d_bytes),
                l.stats.h2d_bytes as f64 / l.stats.h2d_s.max(1e-9) / 1e9,
                fmt_bytes(l.stats.d2h_bytes),
                l.stats.d2h_bytes as f64 / l.stats.d2h_s.max(1e-9) / 1e9
            );
        }
    }
    let shares: Vec<String> = r
        .busy_shares
        .iter()
        .map(|(n, v)| format!("{n} {:.0}%", 100.0 * v))
        .collect();
    s += &format!("  busy: {}\n", shares.join(" | "));
    s += &format!("  bottleneck: {}", r.bottleneck);
    if r.nonfinite_inputs > 0 {
        s += &format!(
            "\n  note: {} NaN/Inf values seen while staging inputs (computed as IEEE arithmetic says; a tile staged twice counts twice)",
            r.nonfinite_inputs
        );
    }
    s
}

/// Peak rates assumed for the lower bound in `plan` (documented in docs/PLAN.md).
fn assumed_rate(sel: &Selected, p: Precision) -> (f64, &'static str) {
    if sel.is_cuda() {
        let per = match p {
            Precision::Fp32 => 54e12,
            Precision::Tf32 => 350e12,
            Precision::Bf16 | Precision::Fp16 => 700e12,
            Precision::Fp64 => 60e12,
        };
        (
            per * sel.target.lanes as f64,
            "H200 cuBLAS rates measured in docs/GPU.md",
        )
    } else {
        // faer measured 235-243 GFLOP/s per core (f32) on the development machine (Zen 5,
        // AVX-512); BENCHMARKS.md. f64 is half.
        let per_core = if p == Precision::Fp64 { 120e9 } else { 240e9 };
        (
            per_core * sel.threads as f64,
            "faer f32 rate measured per core, BENCHMARKS.md",
        )
    }
}

const DISK_READ: f64 = 1.6e9;
const PCIE: f64 = 55e9;

/// The text `mgmm-stream plan` prints.
pub fn describe(plan: &Plan) -> Result<String> {
    let sel = backend::select(&plan.engine)?;
    let e = &plan.engine;
    let mut s = format!("plan {}\n", plan.path.display());
    if let Some(n) = &sel.note {
        s += &format!("note: {n}\n");
    }
    s += &format!(
        "engine: backend {} | precision {} ({}) | threads {} | host_memory {}{}\n",
        sel.name,
        e.precision.name(),
        backend::describe_precision(e.precision),
        sel.threads,
        fmt_bytes(e.host_memory),
        if sel.is_cuda() {
            format!(
                " | device budget {} per GPU",
                fmt_bytes(sel.target.device_memory)
            )
        } else {
            String::new()
        }
    );
    s += "matrices:\n";
    for d in &plan.matrices {
        s += &format!(
            "  {:<6} {}×{} {}  {}{}\n",
            d.name,
            d.rows,
            d.cols,
            d.dtype,
            d.path.display(),
            if d.generate.is_some() {
                "  (missing: will be generated)"
            } else {
                ""
            }
        );
    }
    for step in &plan.steps {
        let l = Layout::new(&plan.path, step, e, &sel.target)?;
        let sched = Schedule::new(step, &l);
        let t = traffic(step, &l, &sched);
        let (gm, gn, gk) = l.grid(step);
        s += &format!(
            "step {} (line {}): {} = {}\n",
            step.index + 1,
            step.line,
            step.output.display(),
            step.expr
        );
        s += &format!(
            "  shapes: op(A) {}×{}, op(B) {}×{}, C {}×{}{}  alpha {} beta {}\n",
            step.m,
            step.k,
            step.k,
            step.n,
            step.m,
            step.n,
            step.c0
                .as_ref()
                .map(|c| format!(" + {}", c.name))
                .unwrap_or_default(),
            step.alpha,
            step.beta
        );
        s += &format!(
            "  compute tile {}×{}×{}: {} output tiles ({}×{}), {} k-steps each, {} GEMM calls; output storage tile {}×{}\n",
            l.tm, l.tn, l.tk, gm * gn, gm, gn, gk, t.gemms, l.out_tile.0, l.out_tile.1
        );
        s += &format!(
            "  host pools: staging {}×{} per lane, output {}×{} per lane{}  => host ceiling {} of {}\n",
            l.staging_bufs,
            fmt_bytes(l.staging_buf_bytes),
            l.out_bufs,
            fmt_bytes(l.out_buf_bytes),
            if sel.is_cuda() { String::new() } else {
                format!(", tile cache {}×{}, accumulators {}×{}", l.slots, fmt_bytes(l.slot_bytes), l.accs, fmt_bytes(l.acc_bytes))
            },
            fmt_bytes(l.host_bytes),
            fmt_bytes(e.host_memory)
        );
        if sel.is_cuda() {
            s += &format!(
                "  device per GPU: tile cache {}×{} ({}), accumulators {}×{}{} => {}\n",
                l.slots,
                fmt_bytes(l.slot_bytes),
                l.dev_dt,
                l.accs,
                fmt_bytes(l.acc_bytes),
                if l.landing > 0 {
                    format!(", landing {}×{}", l.landing, fmt_bytes(l.landing_bytes))
                } else {
                    String::new()
                },
                fmt_bytes(l.device_bytes)
            );
        }
        s += &format!(
            "  traffic: read {} from files (minimum {}; {} tile loads), {} {}, {} {}, write {}\n",
            fmt_bytes(t.read_bytes),
            fmt_bytes(t.min_read_bytes),
            t.tile_loads,
            if sel.is_cuda() { "H2D" } else { "staged" },
            fmt_bytes(t.h2d_bytes),
            if sel.is_cuda() { "D2H" } else { "collected" },
            fmt_bytes(t.d2h_bytes),
            fmt_bytes(t.write_bytes)
        );
        let (rate, why) = assumed_rate(&sel, e.precision);
        let tc = step.flops() / rate;
        let td = (t.min_read_bytes + t.write_bytes) as f64 / DISK_READ;
        let tp = if sel.is_cuda() {
            (t.h2d_bytes.max(t.d2h_bytes)) as f64 / PCIE / sel.target.lanes as f64
        } else {
            0.0
        };
        s += &format!(
            "  lower bound: {:.3e} FLOP at {:.1} TFLOP/s ({why}) = {:.3} s; cold disk at {:.1} GB/s = {:.3} s{} => at least {:.3} s\n",
            step.flops(),
            rate / 1e12,
            tc,
            DISK_READ / 1e9,
            td,
            if sel.is_cuda() { format!("; PCIe at {:.0} GB/s = {tp:.3} s", PCIE / 1e9) } else { String::new() },
            tc.max(tp)
        );
    }
    Ok(s)
}

pub fn default_log_every() -> Duration {
    Duration::from_secs(5)
}
