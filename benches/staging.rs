//! Staging's read of one input block, as the pipeline does it, in one run: the three passes
//! one after another (checksums of the storage tiles, the copy, the NaN/Inf count over the
//! copy) against `MatrixSource::read_staged`, which the `.mgt` reader does in one pass.
//!
//!     cargo bench --bench staging [-- N BLOCK]      (defaults 8192 and 4096)
//!
//! An N×N f32 `.mgt` (1024² storage tiles, with checksums) is generated into a temporary
//! folder and read once to put it in the page cache; then every BLOCK×BLOCK block is read
//! into one buffer, by a fresh handle each round (a handle verifies each storage tile once),
//! alternating the two ways, 5 rounds each. It prints the median GB/s of each and their
//! ratio. The copy target is ordinary memory here; on the GPU host it is pinned memory, and
//! the end-to-end effect is in BENCHMARKS.md.

use std::time::Instant;

use mgmm_stream::dtype::{count_nonfinite_par, DType};
use mgmm_stream::store::gen::{generate, Dist, GenSpec};
use mgmm_stream::store::{open_source, Block, MatrixSource};

const ROUNDS: usize = 5;

fn blocks(n: u64, t: u64) -> Vec<Block> {
    let mut v = Vec::new();
    for r0 in (0..n).step_by(t as usize) {
        for c0 in (0..n).step_by(t as usize) {
            v.push(Block {
                r0,
                c0,
                rows: t.min(n - r0),
                cols: t.min(n - c0),
            });
        }
    }
    v
}

fn separate(f: &dyn MatrixSource, b: &Block, buf: &mut [u8]) -> u64 {
    f.verify_block(b).expect("verify");
    f.read_block(b, DType::F32, buf).expect("read");
    count_nonfinite_par(DType::F32, buf)
}

fn fused(f: &dyn MatrixSource, b: &Block, buf: &mut [u8]) -> u64 {
    f.read_staged(b, DType::F32, buf, true)
        .expect("read_staged")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let n = args.first().copied().unwrap_or(8192);
    let t = args.get(1).copied().unwrap_or(4096).min(n);
    let dir = tempfile::tempdir().expect("a temporary folder");
    let path = dir.path().join("A.mgt");
    let spec = GenSpec {
        rows: n,
        cols: n,
        dtype: DType::F32,
        tile: (1024, 1024),
        dist: Dist::Normal,
        seed: 1,
    };
    generate(&path, &spec).expect("generate the input");
    let bs = blocks(n, t);
    let mut buf = vec![0u8; (t * t * 4) as usize];
    let bytes = (n * n * 4) as f64;
    let warm = open_source(&path).expect("open");
    for b in &bs {
        warm.read_block(b, DType::F32, &mut buf[..b.elems() * 4])
            .expect("warm-up read");
    }
    type Way = fn(&dyn MatrixSource, &Block, &mut [u8]) -> u64;
    let ways: [(&str, Way); 2] = [("separate passes", separate), ("read_staged", fused)];
    let mut rates = [Vec::new(), Vec::new()];
    for _ in 0..ROUNDS {
        for (i, (_, way)) in ways.iter().enumerate() {
            let f = open_source(&path).expect("open");
            let t0 = Instant::now();
            let mut nonfinite = 0;
            for b in &bs {
                nonfinite += way(&*f, b, &mut buf[..b.elems() * 4]);
            }
            assert_eq!(nonfinite, 0, "generated data is finite");
            rates[i].push(bytes / t0.elapsed().as_secs_f64() / 1e9);
        }
    }
    let threads = rayon::current_num_threads();
    println!("staging read of {n}² f32 in {t}² blocks, {threads} threads, median of {ROUNDS}:");
    let med: Vec<f64> = rates.into_iter().map(median).collect();
    for (i, (name, _)) in ways.iter().enumerate() {
        println!("  {name:<16} {:6.2} GB/s", med[i]);
    }
    println!("  read_staged / separate: {:.2}×", med[1] / med[0]);
}
