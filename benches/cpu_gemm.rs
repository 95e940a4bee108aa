//! CPU GEMM throughput of the candidate crates, f32, on all cores, side by side in one run.
//!
//!     cargo bench --bench cpu_gemm            # n = 1024, 2048, 4096
//!
//! Prints GFLOP/s (median of 5 timed products after one warm-up) for faer (the engine's CPU
//! backend) and matrixmultiply, and FLOP per core-cycle at the base clock /proc/cpuinfo reports
//! (turbo makes it exceed the hardware's per-cycle peak; docs/decisions/0001-cpu-gemm-faer.md discusses the peak).
//! With MGMM_PEAK_GFLOPS set, also the share of that peak. numpy's figure comes from
//! tools/peers/numpy_gemm.py, run in the same session.

use std::time::Instant;

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn fill(n: usize, seed: u64) -> Vec<f32> {
    let mut g = mgmm_stream::store::gen::Rng::new(seed, 0);
    (0..n).map(|_| (g.unit() * 2.0 - 1.0) as f32).collect()
}

fn time<F: FnMut()>(mut f: F) -> f64 {
    f();
    let mut v = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        f();
        v.push(t.elapsed().as_secs_f64());
    }
    median(v)
}

fn main() {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global();
    let peak: Option<f64> = std::env::var("MGMM_PEAK_GFLOPS")
        .ok()
        .and_then(|v| v.parse().ok());
    let mhz: f64 = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("cpu MHz"))
                .and_then(|l| l.split(':').nth(1)?.trim().parse().ok())
        })
        .unwrap_or(0.0);
    println!("threads {threads}, base clock {mhz:.0} MHz (from /proc/cpuinfo)");
    println!(
        "{:>6} {:>14} {:>22} {:>26}",
        "n", "faer GFLOP/s", "matrixmultiply GFLOP/s", "faer FLOP/core/base-cycle"
    );
    for n in [1024usize, 2048, 4096] {
        let a = fill(n * n, 1);
        let b = fill(n * n, 2);
        let mut c = vec![0f32; n * n];
        let flops = 2.0 * (n as f64).powi(3);
        let tf = time(|| {
            let dst = MatMut::from_row_major_slice_mut(&mut c, n, n);
            matmul(
                dst,
                Accum::Replace,
                MatRef::from_row_major_slice(&a, n, n),
                MatRef::from_row_major_slice(&b, n, n),
                1.0f32,
                Par::rayon(threads),
            );
        });
        let tm = time(|| unsafe {
            // SAFETY: all three buffers are n×n row-major, as the strides say.
            matrixmultiply::sgemm(
                n,
                n,
                n,
                1.0,
                a.as_ptr(),
                n as isize,
                1,
                b.as_ptr(),
                n as isize,
                1,
                0.0,
                c.as_mut_ptr(),
                n as isize,
                1,
            );
        });
        let (gf, gm) = (flops / tf / 1e9, flops / tm / 1e9);
        let per_cycle = if mhz > 0.0 {
            gf / (threads as f64 * mhz / 1e3)
        } else {
            f64::NAN
        };
        let share = |g: f64| {
            peak.map(|p| format!(" ({:.0}% of peak)", 100.0 * g / p))
                .unwrap_or_default()
        };
        println!(
            "{n:>6} {gf:>14.1}{} {gm:>22.1}{} {per_cycle:>26.1}",
            share(gf),
            share(gm)
        );
    }
}
