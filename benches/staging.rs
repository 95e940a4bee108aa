//! Staging's read of one input block, as the pipeline does it, in one run: the three passes
//! one after another (checksums of the storage tiles, the copy, the NaN/Inf count over the
//! copy) against `MatrixSource::read_staged`, which the `.mgt` reader does in one pass.
//!
//!     cargo bench --bench staging [-- N BLOCK]      (defaults 8192 and 4096)
//!     cargo bench --bench staging -- npy [N BLOCK]  (defaults 8192 and 2048)
//!
//! An N×N f32 `.mgt` (1024² storage tiles, with checksums) is generated into a temporary
//! folder and read once to put it in the page cache; then every BLOCK×BLOCK block is read
//! into one buffer, by a fresh handle each round (a handle verifies each storage tile once),
//! alternating the two ways, 5 rounds each. It prints the median GB/s of each and their
//! ratio. The copy target is ordinary memory here; on the GPU host it is pinned memory, and
//! the end-to-end effect is in BENCHMARKS.md.
//!
//! With `npy`, an N×N f64 `.npy` is written and its BLOCK×BLOCK blocks (narrow: a row of a block
//! is BLOCK·8 bytes of an N·8-byte file row, as staging copies them on a GPU) are read with
//! `read_staged`, the way the readers do it now (runs whose pages are cached copied out of the
//! file's map) against `MGMM_READ_PREAD=1` (a `pread` per row): each way in a process of its
//! own (the setting is read once per process), alternating, 5 rounds each.

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

/// One round of the `npy` comparison in this process: read every block of `path` (an N×N f64
/// `.npy`) once, print the rate in GB/s on stdout.
fn npy_child(path: &str, n: u64, t: u64) {
    let f = open_source(std::path::Path::new(path)).expect("open");
    let bs = blocks(n, t);
    let mut buf = vec![0u8; (t * t * 8) as usize];
    let t0 = Instant::now();
    for b in &bs {
        let nonfinite = f
            .read_staged(b, DType::F64, &mut buf[..b.elems() * 8], true)
            .expect("read_staged");
        assert_eq!(nonfinite, 0, "written data is finite");
    }
    println!("{}", (n * n * 8) as f64 / t0.elapsed().as_secs_f64() / 1e9);
}

fn npy(n: u64, t: u64) {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let path = dir.path().join("A.npy");
    let dict = format!("{{'descr': '<f8', 'fortran_order': False, 'shape': ({n}, {n}), }}");
    let mut head = dict.into_bytes();
    while (10 + head.len() + 1) % 64 != 0 {
        head.push(b' ');
    }
    head.push(b'\n');
    let mut data = b"\x93NUMPY\x01\x00".to_vec();
    data.extend_from_slice(&(head.len() as u16).to_le_bytes());
    data.extend_from_slice(&head);
    data.extend((0..n * n).flat_map(|i| ((i % 1000) as f64 * 0.5).to_le_bytes()));
    std::fs::write(&path, &data).expect("write the .npy");
    drop(data);
    let me = std::env::current_exe().expect("this bench's path");
    let way = |pread: bool| -> f64 {
        let mut c = std::process::Command::new(&me);
        c.args([
            "npy-child",
            path.to_str().unwrap(),
            &n.to_string(),
            &t.to_string(),
        ]);
        if pread {
            c.env("MGMM_READ_PREAD", "1");
        } else {
            c.env_remove("MGMM_READ_PREAD");
        }
        let o = c.output().expect("run a round");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout)
            .trim()
            .parse()
            .expect("a rate")
    };
    way(false); // the file into the page cache
    let (mut map, mut pread) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        map.push(way(false));
        pread.push(way(true));
    }
    let threads = rayon::current_num_threads();
    println!("read_staged of {n}² f64 .npy in {t}² blocks, {threads} threads, median of {ROUNDS}:");
    let (m, p) = (median(map), median(pread));
    println!("  copied out of the map {m:6.2} GB/s");
    println!("  pread per row         {p:6.2} GB/s");
    println!("  map / pread: {:.2}×", m / p);
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("npy-child") {
        let num = |i: usize| argv[i].parse::<u64>().expect("a number");
        return npy_child(&argv[2], num(3), num(4));
    }
    if argv.iter().any(|a| a == "npy") {
        let nums: Vec<u64> = argv.iter().skip(1).filter_map(|a| a.parse().ok()).collect();
        let n = nums.first().copied().unwrap_or(8192);
        return npy(n, nums.get(1).copied().unwrap_or(2048).min(n));
    }
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
