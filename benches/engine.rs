//! The whole engine on the CPU, end to end, beside the bare GEMM it is built on, in one run.
//!
//!     cargo bench --bench engine
//!
//! `cargo bench --bench cpu_gemm` measures only the GEMM crates; this measures what a user gets:
//! a plan read by the library, inputs generated into `.mgt` files, and each product streamed
//! through the pipeline (planner, prefetch, staging with CRC checks, CPU lane, writeback) by
//! `run::run_plan`, the entry point `mgmm-stream run` uses. For each case it prints the step's
//! wall time and GFLOP/s (median of 3 timed runs after one warm-up run that also generates the
//! inputs, so they are in the page cache), the largest busy shares and the bottleneck from that
//! run's report, and faer's GEMM on n×n f32 operands already in memory (median of 3 after a
//! warm-up, interleaved with the engine's runs), with the ratio engine/bare of their GFLOP/s.
//! The load average is printed before and after: on a shared machine it says how much the
//! figures can be trusted. One case is out of core:
//! `host_memory` is smaller than its inputs, so B's tiles are re-read every panel of rows.
//! Output goes to a temporary folder with `durable = false`, as in BENCHMARKS.md.

use std::path::Path;
use std::time::Instant;

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use mgmm_stream::plan::Plan;
use mgmm_stream::progress::Progress;
use mgmm_stream::run::{run_plan, RunOptions};

/// One measured configuration: n×n · n×n, f32, under a host memory budget.
struct Case {
    n: usize,
    host_memory: &'static str,
    label: &'static str,
}

const CASES: [Case; 4] = [
    Case {
        n: 1024,
        host_memory: "2GiB",
        label: "in memory",
    },
    Case {
        n: 2048,
        host_memory: "2GiB",
        label: "in memory",
    },
    Case {
        n: 4096,
        host_memory: "2GiB",
        label: "in memory",
    },
    Case {
        n: 4096,
        host_memory: "32MiB",
        label: "out of core: inputs 128 MiB",
    },
];

const TIMED_RUNS: usize = 3;

/// What the benchmark prints from one step's run report (copied out so that only the report's
/// field names, not its type's module path, tie this file to the library).
struct Measured {
    wall_s: f64,
    gflops_per_s: f64,
    tile: [u64; 3],
    read_bytes: u64,
    bottleneck: String,
    busy_shares: Vec<(String, f64)>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The plan a user would write: two generated inputs, one product, the CPU backend.
fn plan_text(n: usize, host_memory: &str) -> String {
    format!(
        r#"[matrices.A]
path = "A.mgt"
generate = {{ rows = {n}, cols = {n}, dist = "uniform", seed = 1 }}
[matrices.B]
path = "B.mgt"
generate = {{ rows = {n}, cols = {n}, dist = "uniform", seed = 2 }}
[[step]]
output = "C.mgt"
expr = "A @ B"
[engine]
backend = "cpu"
host_memory = "{host_memory}"
durable = false
"#
    )
}

/// faer's f32 GEMM on n×n operands already in memory, on every core: the engine's CPU lane
/// without the engine around it.
struct Bare {
    n: usize,
    threads: usize,
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
}

impl Bare {
    fn new(n: usize, threads: usize) -> Bare {
        Bare {
            n,
            threads,
            a: fill(n * n, 1),
            b: fill(n * n, 2),
            c: vec![0f32; n * n],
        }
    }

    /// Seconds of one product.
    fn once(&mut self) -> f64 {
        let n = self.n;
        let t = Instant::now();
        matmul(
            MatMut::from_row_major_slice_mut(&mut self.c, n, n),
            Accum::Replace,
            MatRef::from_row_major_slice(&self.a, n, n),
            MatRef::from_row_major_slice(&self.b, n, n),
            1.0f32,
            Par::rayon(self.threads),
        );
        t.elapsed().as_secs_f64()
    }
}

/// Uniform values in [-1, 1) from a xorshift generator (the GEMM's speed does not depend on them).
fn fill(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Runs the plan once to generate the inputs and warm the page cache, and the bare GEMM once;
/// then `TIMED_RUNS` rounds of one engine run from scratch and one bare GEMM, interleaved so that
/// load from other processes on a shared machine hits both alike. Returns the report of the
/// engine run with the median step wall time and the bare GEMM's median seconds.
fn measure(dir: &Path, case: &Case, threads: usize) -> Result<(Measured, f64), String> {
    let path = dir.join("plan.toml");
    std::fs::write(&path, plan_text(case.n, case.host_memory))
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    let plan = Plan::load(&path).map_err(|e| e.to_string())?;
    let opts = RunOptions {
        restart: true,
        ..RunOptions::default()
    };
    let progress = Progress::quiet();
    run_plan(&plan, &opts, &progress).map_err(|e| e.to_string())?;
    let mut bare = Bare::new(case.n, threads);
    bare.once();
    let (mut runs, mut bare_s) = (Vec::new(), Vec::new());
    for _ in 0..TIMED_RUNS {
        let report = run_plan(&plan, &opts, &progress).map_err(|e| e.to_string())?;
        let r = report.steps.first().ok_or("the run report has no step")?;
        runs.push(Measured {
            wall_s: r.wall_s,
            gflops_per_s: r.gflops_per_s,
            tile: r.tile,
            read_bytes: r.read_bytes,
            bottleneck: r.bottleneck.clone(),
            busy_shares: r.busy_shares.clone(),
        });
        bare_s.push(bare.once());
    }
    runs.sort_by(|a, b| a.wall_s.total_cmp(&b.wall_s));
    Ok((runs.swap_remove(TIMED_RUNS / 2), median(bare_s)))
}

fn print_case(case: &Case, r: &Measured, bare_s: f64) {
    let bare_gflops = 2.0 * (case.n as f64).powi(3) / bare_s / 1e9;
    let shares: Vec<String> = r
        .busy_shares
        .iter()
        .take(4)
        .map(|(name, v)| format!("{name} {:.0}%", 100.0 * v))
        .collect();
    println!(
        "{:>5} {:>6} {:>8.3} {:>9.1} {:>8.3} {:>9.1} {:>10.2}  tile {:?}, read {:.0} MiB ({})",
        case.n,
        case.host_memory,
        r.wall_s,
        r.gflops_per_s,
        bare_s,
        bare_gflops,
        r.gflops_per_s / bare_gflops,
        r.tile,
        r.read_bytes as f64 / (1u64 << 20) as f64,
        case.label
    );
    println!(
        "{:>14} bottleneck {}; busy: {}",
        "",
        r.bottleneck,
        shares.join(", ")
    );
}

/// The 1-minute load average from /proc/loadavg, or "?" where there is none.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".to_string())
}

fn main() {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    println!(
        "engine (run_plan, CPU backend, f32, inputs in the page cache) vs bare faer GEMM in memory; \
         {threads} threads, median of {TIMED_RUNS}; load average {}",
        load_average()
    );
    println!(
        "{:>5} {:>6} {:>8} {:>9} {:>8} {:>9} {:>10}",
        "n", "host", "engine s", "GFLOP/s", "faer s", "GFLOP/s", "engine/bare"
    );
    for case in &CASES {
        let dir = match tempfile::tempdir() {
            Ok(d) => d,
            Err(e) => {
                eprintln!("cannot create a temporary folder for the benchmark: {e}");
                std::process::exit(1);
            }
        };
        match measure(dir.path(), case, threads) {
            Ok((engine, bare_s)) => print_case(case, &engine, bare_s),
            Err(e) => {
                eprintln!("n = {}, host_memory {}: {e}", case.n, case.host_memory);
                std::process::exit(1);
            }
        }
    }
    println!("load average at the end: {}", load_average());
}
