//! Helpers shared by the integration tests (the modules of tests/it, and tests/budget.rs by
//! `#[path]`): temp dirs, generated inputs, an independent f64 reference product, and running a
//! plan through the library.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use mgmm_stream::dtype::DType;
use mgmm_stream::plan::Plan;
use mgmm_stream::progress::Progress;
use mgmm_stream::run::{run_plan, RunOptions, RunReport};
use mgmm_stream::store::gen::{generate, Dist, GenSpec};
use mgmm_stream::store::{Block, TiledFile};

pub fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("temp dir")
}

pub fn gen(
    path: &Path,
    rows: u64,
    cols: u64,
    dtype: DType,
    tile: (u64, u64),
    dist: Dist,
    seed: u64,
) {
    let spec = GenSpec {
        rows,
        cols,
        dtype,
        tile: (tile.0.min(rows), tile.1.min(cols)),
        dist,
        seed,
    };
    generate(path, &spec).expect("generate");
}

/// The small pair most edge tests multiply: `A.mgt` (20×30) and `B.mgt` (30×10), f32 in 8×8
/// storage tiles, normal, seeds 1 and 2.
pub fn small_inputs(dir: &Path) {
    gen(
        &dir.join("A.mgt"),
        20,
        30,
        DType::F32,
        (8, 8),
        Dist::Normal,
        1,
    );
    gen(
        &dir.join("B.mgt"),
        30,
        10,
        DType::F32,
        (8, 8),
        Dist::Normal,
        2,
    );
}

/// Whole matrix as f64, row-major.
pub fn load(path: &Path) -> (usize, usize, Vec<f64>) {
    let f = TiledFile::open(path).expect("open");
    let (r, c) = (f.rows(), f.cols());
    let mut bytes = vec![0u8; (r * c) as usize * 8];
    let dt = f.dtype();
    let mut tmp = vec![0u8; (r * c) as usize * dt.size()];
    f.read_block(
        &Block {
            r0: 0,
            c0: 0,
            rows: r,
            cols: c,
        },
        dt,
        &mut tmp,
    )
    .expect("read");
    for (i, ch) in tmp.chunks(dt.size()).enumerate() {
        let v = mgmm_stream::dtype::get(dt, ch);
        bytes[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    let v = bytes
        .chunks(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (r as usize, c as usize, v)
}

pub struct Mat {
    pub rows: usize,
    pub cols: usize,
    pub v: Vec<f64>,
}

impl Mat {
    pub fn load(p: &Path) -> Mat {
        let (rows, cols, v) = load(p);
        Mat { rows, cols, v }
    }
    /// op(X)[i][j]
    pub fn at(&self, i: usize, j: usize, trans: bool) -> f64 {
        if trans {
            self.v[j * self.cols + i]
        } else {
            self.v[i * self.cols + j]
        }
    }
    pub fn round(mut self, f: impl Fn(f32) -> f32) -> Mat {
        self.v.iter_mut().for_each(|x| *x = f(*x as f32) as f64);
        self
    }
}

/// Independent f64 reference: returns (value, |alpha|·Σ|a||b| + |beta||c0|) for every element.
#[allow(clippy::too_many_arguments)]
pub fn reference(
    a: &Mat,
    at: bool,
    b: &Mat,
    bt: bool,
    c0: Option<&Mat>,
    alpha: f64,
    beta: f64,
    m: usize,
    n: usize,
    k: usize,
) -> (Vec<f64>, Vec<f64>) {
    let mut val = vec![0.0; m * n];
    let mut mag = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut sa) = (0.0, 0.0);
            for p in 0..k {
                let x = a.at(i, p, at) * b.at(p, j, bt);
                s += x;
                sa += x.abs();
            }
            let (mut v, mut g) = (alpha * s, alpha.abs() * sa);
            if let Some(c) = c0 {
                v += beta * c.v[i * n + j];
                g += (beta * c.v[i * n + j]).abs();
            }
            val[i * n + j] = v;
            mag[i * n + j] = g;
        }
    }
    (val, mag)
}

/// Write `text` as plan.toml in `dir` and run it quietly.
pub fn run_text(dir: &Path, text: &str) -> mgmm_stream::Result<RunReport> {
    let p = dir.join("plan.toml");
    std::fs::write(&p, text).unwrap();
    let plan = Plan::load(&p)?;
    run_plan(&plan, &RunOptions::default(), &Progress::quiet())
}

/// The command-line binary: the one cargo built beside this test binary, or `MGMM_TEST_BIN`
/// where the test binary runs away from its build tree (the GPU machine's CUDA twins,
/// tools/checks/cuda_tests.sh, which carries both in `.dev/bin`).
pub fn bin() -> PathBuf {
    std::env::var_os("MGMM_TEST_BIN")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_mgmm-stream")))
}

/// Run the binary with `args` in `dir`: whether it succeeded, and its stdout then stderr.
pub fn cli_in(dir: &Path, args: &[&str]) -> (bool, String) {
    let o = std::process::Command::new(bin())
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.success(), text)
}

/// Hash of a file's bytes (to prove inputs are unchanged).
pub fn digest(p: &Path) -> u32 {
    crc32c::crc32c(&std::fs::read(p).unwrap())
}

/// Stamp a test once per backend. CUDA copies are `#[ignore]`d: CI has no GPU, and lists them
/// as not run; on the GPU machine run them with `--ignored`.
#[macro_export]
macro_rules! per_backend {
    ($($name:ident => $f:path;)*) => {
        mod cpu {
            $( #[test] fn $name() { $f("cpu") } )*
        }
        /// Four simulated asynchronous lanes (tests/it/sim.rs): the multi-lane pipeline on CI.
        mod sim {
            $( #[test] fn $name() { $f("sim") } )*
        }
        mod cuda {
            $( #[test] #[ignore = "needs a GPU: run on the GPU machine with --ignored"] fn $name() { $f("cuda") } )*
        }
    };
}

/// Cut or extend the file at `p` to `len` bytes (a kill or a full disk, simulated).
#[allow(dead_code)]
pub fn set_len(p: &Path, len: u64) {
    let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
    f.set_len(len).unwrap();
}

/// A row-major f32 or f64 `.npy` file holding exactly `v` (rows×cols; an input whose every
/// value the test chooses).
pub fn write_npy(path: &std::path::Path, rows: usize, cols: usize, v: &[f64], dt: DType) {
    write_npy_order(path, rows, cols, v, dt, false)
}

/// [`write_npy`] in Fortran order when `fortran` (`v` is still given row-major; the file holds
/// its columns one after another, as numpy writes `np.asfortranarray`).
pub fn write_npy_order(
    path: &std::path::Path,
    rows: usize,
    cols: usize,
    v: &[f64],
    dt: DType,
    fortran: bool,
) {
    let descr = if dt == DType::F64 { "<f8" } else { "<f4" };
    let order = if fortran { "True" } else { "False" };
    let dict =
        format!("{{'descr': '{descr}', 'fortran_order': {order}, 'shape': ({rows}, {cols}), }}");
    let total = (10 + dict.len() + 1).div_ceil(64) * 64;
    let mut h = vec![0x93, b'N', b'U', b'M', b'P', b'Y', 1, 0];
    h.extend_from_slice(&((total - 10) as u16).to_le_bytes());
    h.extend_from_slice(dict.as_bytes());
    h.resize(total - 1, b' ');
    h.push(b'\n');
    let at = |i: usize| match fortran {
        true => v[(i % rows) * cols + i / rows],
        false => v[i],
    };
    for x in (0..rows * cols).map(at) {
        if dt == DType::F64 {
            h.extend_from_slice(&x.to_le_bytes());
        } else {
            h.extend_from_slice(&(x as f32).to_le_bytes());
        }
    }
    std::fs::write(path, h).unwrap();
}

/// `s` with every run of whitespace made one space: the CLI wraps its lines at 80 columns, so
/// tests compare what it says with the wrapping undone.
pub fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// XOR `bits` into the byte at `off` of `p` (damage a file in place, as a disk or a stray write
/// would).
pub fn flip(p: &Path, off: u64, bits: u8) {
    use std::os::unix::fs::FileExt;
    let w = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(p)
        .unwrap();
    let mut x = [0u8; 1];
    w.read_exact_at(&mut x, off).unwrap();
    w.write_all_at(&[x[0] ^ bits], off).unwrap();
}

/// Write `dir/file`: a two-step plan on the CPU, C = A·B then D = A·Bᵀ, of `n`×`n` generated
/// inputs in compute tiles of `tile` (the split-run tests' plan of more than one step).
pub fn two_step_plan(dir: &Path, file: &str, n: u64, tile: u64) {
    std::fs::write(
        dir.join(file),
        format!(
            "[matrices.A]\npath = \"A.mgt\"\ngenerate = {{ rows = {n}, cols = {n}, seed = 1 }}\n\
             [matrices.B]\npath = \"B.mgt\"\ngenerate = {{ rows = {n}, cols = {n}, seed = 2 }}\n\
             [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n\
             [[step]]\noutput = \"D.mgt\"\nexpr = \"A @ B.T\"\n\
             [engine]\nbackend = \"cpu\"\ntile = {tile}\nhost_memory = \"64MiB\"\n"
        ),
    )
    .unwrap();
}
