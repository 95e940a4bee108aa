//! Products checked against an independent f64 reference, on every backend: seeded random
//! shapes, storage tiles and compute tiles (non-multiples everywhere), all four transpose
//! combinations, alpha/beta with an accumulated C0, f32 and f64, and the reduced precisions.
//!
//! Error bound (stated once, used everywhere): for each element,
//!   |c − r| ≤ (2·u_in + (K + 2)·u_acc) · (|α|·Σ_p |a_ip·b_pj| + |β·c0_ij|)
//! where u_in is the unit roundoff of the inputs as the GEMM sees them (2^-24 fp32, 2^-11 tf32
//! and fp16, 2^-8 bf16, 2^-53 fp64) and u_acc that of the accumulation (fp32 or fp64). This is
//! the classical worst-case bound for a K-term dot product plus input rounding and the final
//! scaling and rounding of the output.

use crate::common::*;

use mgmm_stream::dtype::DType;
use mgmm_stream::plan::Precision;
use mgmm_stream::store::gen::{Dist, Rng};

struct Case {
    m: u64,
    n: u64,
    k: u64,
    at: bool,
    bt: bool,
    a_tile: (u64, u64),
    b_tile: (u64, u64),
    tile: [u64; 3],
    alpha: f64,
    c0: Option<(f64, (u64, u64))>,
    dtype: DType,
    precision: Precision,
}

fn check(backend: &str, c: &Case, seed: u64) {
    let d = tmp();
    let dir = d.path();
    let (ar, ac) = if c.at { (c.k, c.m) } else { (c.m, c.k) };
    let (br, bc) = if c.bt { (c.n, c.k) } else { (c.k, c.n) };
    gen(
        &dir.join("A.mgt"),
        ar,
        ac,
        c.dtype,
        c.a_tile,
        Dist::Normal,
        seed,
    );
    gen(
        &dir.join("B.mgt"),
        br,
        bc,
        c.dtype,
        c.b_tile,
        Dist::Normal,
        seed + 1,
    );
    let mut text = "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n".to_string();
    if let Some((_, t)) = c.c0 {
        gen(
            &dir.join("C0.mgt"),
            c.m,
            c.n,
            c.dtype,
            t,
            Dist::Uniform,
            seed + 2,
        );
        text += "[matrices.C0]\npath = \"C0.mgt\"\n";
    }
    let expr = format!(
        "A{} @ B{}",
        if c.at { ".T" } else { "" },
        if c.bt { ".T" } else { "" }
    );
    text += &format!(
        "[[step]]\noutput = \"C.mgt\"\nexpr = \"{expr}\"\nalpha = {:?}\n",
        c.alpha
    );
    if let Some((beta, _)) = c.c0 {
        text += &format!("accumulate = \"C0\"\nbeta = {beta:?}\n");
    }
    // Every way input blocks reach the lanes, by turns: from the files' pages where in memory
    // (the default), always copied, always from the pages (docs/PLAN.md, staging).
    let staging = ["auto", "copy", "direct"][(seed % 3) as usize];
    text += &format!(
        "[engine]\nbackend = \"{backend}\"\nprecision = \"{}\"\nhost_memory = \"64MiB\"\ntile = [{}, {}, {}]\nstaging = \"{staging}\"\n",
        c.precision.name(),
        c.tile[0],
        c.tile[1],
        c.tile[2]
    );
    run_text(dir, &text).unwrap_or_else(|e| panic!("run failed: {e}\nplan:\n{text}"));
    let a = Mat::load(&dir.join("A.mgt"));
    let b = Mat::load(&dir.join("B.mgt"));
    let c0 = c.c0.map(|_| Mat::load(&dir.join("C0.mgt")));
    let (r, mag) = reference(
        &a,
        c.at,
        &b,
        c.bt,
        c0.as_ref(),
        c.alpha,
        c.c0.map_or(0.0, |x| x.0),
        c.m as usize,
        c.n as usize,
        c.k as usize,
    );
    let out = Mat::load(&dir.join("C.mgt"));
    assert_eq!((out.rows, out.cols), (c.m as usize, c.n as usize));
    let factor = 2.0 * c.precision.input_eps() + (c.k as f64 + 2.0) * c.precision.acc_eps();
    let mut worst = 0.0f64;
    for i in 0..r.len() {
        let err = (out.v[i] - r[i]).abs();
        let allowed = factor * mag[i] + 1e-300;
        worst = worst.max(err / allowed);
        assert!(
            err <= allowed,
            "element ({}, {}): got {}, reference {}, error {err:e} > allowed {allowed:e}\nplan:\n{text}",
            i / c.n as usize,
            i % c.n as usize,
            out.v[i],
            r[i]
        );
    }
    assert!(worst.is_finite());
}

const DIMS: &[u64] = &[1, 2, 3, 7, 13, 31, 32, 33, 64, 65, 97, 128, 129];
const STORE: &[u64] = &[5, 16, 31, 32, 64, 100];
const COMPUTE: &[u64] = &[4, 7, 16, 32, 33, 64];

fn pick(g: &mut Rng, xs: &[u64]) -> u64 {
    xs[(g.next_u64() % xs.len() as u64) as usize]
}

fn random_case(g: &mut Rng, dtype: DType, precision: Precision) -> Case {
    let c0 = g.next_u64().is_multiple_of(3).then(|| {
        let beta = [1.0, 0.5, -2.0][(g.next_u64() % 3) as usize];
        (beta, (pick(g, STORE), pick(g, STORE)))
    });
    Case {
        m: pick(g, DIMS),
        n: pick(g, DIMS),
        k: pick(g, DIMS),
        at: g.next_u64().is_multiple_of(2),
        bt: g.next_u64().is_multiple_of(2),
        a_tile: (pick(g, STORE), pick(g, STORE)),
        b_tile: (pick(g, STORE), pick(g, STORE)),
        tile: [pick(g, COMPUTE), pick(g, COMPUTE), pick(g, COMPUTE)],
        alpha: [1.0, -0.5, 2.0][(g.next_u64() % 3) as usize],
        c0,
        dtype,
        precision,
    }
}

fn sweep_f32(backend: &str) {
    let mut g = Rng::new(2024, 1);
    for i in 0..24 {
        let c = random_case(&mut g, DType::F32, Precision::Fp32);
        check(backend, &c, 100 + i);
    }
}

fn sweep_f64(backend: &str) {
    let mut g = Rng::new(2024, 2);
    for i in 0..12 {
        let c = random_case(&mut g, DType::F64, Precision::Fp64);
        check(backend, &c, 200 + i);
    }
}

fn reduced_precisions(backend: &str) {
    let mut g = Rng::new(2024, 3);
    for (i, p) in [Precision::Tf32, Precision::Bf16, Precision::Fp16]
        .into_iter()
        .enumerate()
    {
        for j in 0..4 {
            let c = random_case(&mut g, DType::F32, p);
            check(backend, &c, 300 + 10 * i as u64 + j);
        }
    }
}

fn transposes_and_edges(backend: &str) {
    // Every transpose combination on shapes that straddle every edge, plus degenerate shapes.
    let shapes = [
        (1, 37, 29),
        (37, 1, 29),
        (29, 37, 1),
        (1, 1, 1),
        (5, 3, 4),
        (67, 61, 71),
    ];
    let mut seed = 400;
    for &(m, n, k) in &shapes {
        for (at, bt) in [(false, false), (true, false), (false, true), (true, true)] {
            let c = Case {
                m,
                n,
                k,
                at,
                bt,
                a_tile: (16, 16),
                b_tile: (17, 15),
                tile: [32, 33, 31],
                alpha: 1.0,
                c0: None,
                dtype: DType::F32,
                precision: Precision::Fp32,
            };
            check(backend, &c, seed);
            seed += 1;
        }
    }
}

fn small_matrix_big_tiles(backend: &str) {
    // A matrix smaller than one storage tile and one compute tile.
    let c = Case {
        m: 3,
        n: 2,
        k: 5,
        at: false,
        bt: false,
        a_tile: (1024, 1024),
        b_tile: (1024, 1024),
        tile: [512, 512, 512],
        alpha: 1.0,
        c0: Some((1.0, (1024, 1024))),
        dtype: DType::F32,
        precision: Precision::Fp32,
    };
    check(backend, &c, 500);
}

fn f16_and_bf16_files(backend: &str) {
    for (i, dt) in [DType::F16, DType::BF16].into_iter().enumerate() {
        let c = Case {
            m: 45,
            n: 39,
            k: 50,
            at: false,
            bt: true,
            a_tile: (16, 16),
            b_tile: (32, 8),
            tile: [16, 32, 24],
            alpha: 1.0,
            c0: None,
            dtype: dt,
            precision: Precision::Fp32,
        };
        check(backend, &c, 600 + i as u64);
    }
}

/// A row-major f32 or f64 `.npy` file holding exactly `v` (an input whose every value the test
/// chooses).
fn write_npy(path: &std::path::Path, rows: usize, cols: usize, v: &[f64], dt: DType) {
    let descr = if dt == DType::F64 { "<f8" } else { "<f4" };
    let dict =
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    let total = (10 + dict.len() + 1).div_ceil(64) * 64;
    let mut h = vec![0x93, b'N', b'U', b'M', b'P', b'Y', 1, 0];
    h.extend_from_slice(&((total - 10) as u16).to_le_bytes());
    h.extend_from_slice(dict.as_bytes());
    h.resize(total - 1, b' ');
    h.push(b'\n');
    for &x in v {
        if dt == DType::F64 {
            h.extend_from_slice(&x.to_le_bytes());
        } else {
            h.extend_from_slice(&(x as f32).to_le_bytes());
        }
    }
    std::fs::write(path, h).unwrap();
}

/// C = alpha·A·B + beta·C0 on inputs whose values the test chooses; returns C.
#[allow(clippy::too_many_arguments)]
fn run_exact(
    backend: &str,
    p: Precision,
    (m, n, k): (usize, usize, usize),
    a: &[f64],
    b: &[f64],
    c0: &[f64],
    alpha: f64,
    beta: f64,
) -> Vec<f64> {
    let d = tmp();
    let dir = d.path();
    let dt = if p == Precision::Fp64 {
        DType::F64
    } else {
        DType::F32
    };
    write_npy(&dir.join("A.npy"), m, k, a, dt);
    write_npy(&dir.join("B.npy"), k, n, b, dt);
    write_npy(&dir.join("C0.npy"), m, n, c0, dt);
    let text = format!(
        "[matrices.A]\npath = \"A.npy\"\n[matrices.B]\npath = \"B.npy\"\n\
         [matrices.C0]\npath = \"C0.npy\"\n\
         [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\nalpha = {alpha:?}\n\
         accumulate = \"C0\"\nbeta = {beta:?}\n\
         [engine]\nbackend = \"{backend}\"\nprecision = \"{}\"\nhost_memory = \"64MiB\"\n\
         tile = [16, 16, 16]\n",
        p.name()
    );
    run_text(dir, &text).unwrap_or_else(|e| panic!("run failed: {e}\nplan:\n{text}"));
    Mat::load(&dir.join("C.mgt")).v
}

/// C0 values with a full mantissa over many magnitudes (rounding them to 16 or 19 bits changes
/// every one of them), led by values the issue measured: 0.3090552 and 100000 (beyond fp16).
fn c0_values(len: usize) -> Vec<f64> {
    let mut g = Rng::new(77, 5);
    let mut v: Vec<f64> = (0..len)
        .map(|i| {
            let u = (g.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            let x = 10f64.powf(-3.0 + 8.0 * u) * (1.0 + u * 0.618_033_988_7);
            if i % 2 == 0 {
                x
            } else {
                -x
            }
        })
        .collect();
    v[..4].copy_from_slice(&[0.309_055_2, 100_000.0, -100_000.0, 12_345.678]);
    v
}

/// Small integers: exact in every input precision, and their products sum exactly in fp32,
/// so the only rounding left in C is that of adding beta·C0.
fn small_ints(len: usize, seed: u64) -> Vec<f64> {
    let mut g = Rng::new(seed, 6);
    (0..len).map(|_| (g.next_u64() % 7) as f64 - 3.0).collect()
}

/// The reference xGEMM contract, for every precision: alpha = 0 gives exactly beta·C0 (C0 is
/// never rounded to the input precision and A, B are not read: NaN there and values beyond
/// fp16 do not matter); with alpha ≠ 0 beta·C0 is added in the accumulation type (a bound of a
/// few fp32 roundings, far below what rounding C0 to tf32/bf16/fp16 would cost); beta = 0
/// never reads C0 (NaN/Inf there do not reach C).
fn alpha_zero_and_c0_full_precision(backend: &str) {
    let (m, n, k) = (37, 29, 40);
    for p in [
        Precision::Fp32,
        Precision::Tf32,
        Precision::Bf16,
        Precision::Fp16,
        Precision::Fp64,
    ] {
        let f64_out = p == Precision::Fp64;
        let (a, b, c0) = (small_ints(m * k, 1), small_ints(k * n, 2), c0_values(m * n));
        // alpha = 0: exactly beta·C0, computed in the output type, whatever A and B hold.
        let (mut a_bad, mut b_bad) = (a.clone(), b.clone());
        a_bad[0] = f64::NAN;
        b_bad[n + 1] = 1e6;
        b_bad[2 * n + 3] = f64::INFINITY;
        for beta in [-0.7, 1.0] {
            let c = run_exact(backend, p, (m, n, k), &a_bad, &b_bad, &c0, 0.0, beta);
            for (i, (&got, &x)) in c.iter().zip(&c0).enumerate() {
                let want = if f64_out {
                    beta * x
                } else {
                    (beta as f32 * x as f32) as f64
                };
                assert!(
                    got.to_bits() == want.to_bits(),
                    "{} alpha = 0, beta = {beta}: element {i} is {got}, want beta·C0 = {want} (C0 = {x})",
                    p.name()
                );
            }
        }
        // alpha ≠ 0: C0 keeps its full precision.
        let (alpha, beta) = (1.5, 0.75);
        let c = run_exact(backend, p, (m, n, k), &a, &b, &c0, alpha, beta);
        let am = Mat {
            rows: m,
            cols: k,
            v: a.clone(),
        };
        let bm = Mat {
            rows: k,
            cols: n,
            v: b.clone(),
        };
        let c0s: Vec<f64> = if f64_out {
            c0.clone()
        } else {
            c0.iter().map(|&x| x as f32 as f64).collect()
        };
        let c0m = Mat {
            rows: m,
            cols: n,
            v: c0s,
        };
        let (r, mag) = reference(&am, false, &bm, false, Some(&c0m), alpha, beta, m, n, k);
        let u = if f64_out {
            f64::EPSILON
        } else {
            f32::EPSILON as f64
        };
        for i in 0..r.len() {
            // A few roundings of the running sum (one per k-step and the epilogue); rounding
            // C0 to tf32 would cost 2^-11·|beta·c0|, to bf16 2^-8 — hundreds of times more.
            let allowed = 8.0 * u * mag[i];
            assert!(
                (c[i] - r[i]).abs() <= allowed,
                "{} alpha = {alpha}, beta = {beta}: element {i} is {}, reference {} (C0 = {}), error {:e} > {allowed:e}: C0 was rounded?",
                p.name(),
                c[i],
                r[i],
                c0[i],
                (c[i] - r[i]).abs()
            );
        }
        // beta = 0: C0 is not read; C = alpha·A·B exactly (integer products).
        let mut c0_bad = c0.clone();
        c0_bad[0] = f64::NAN;
        c0_bad[5] = f64::INFINITY;
        c0_bad[m * n - 1] = f64::NEG_INFINITY;
        let c = run_exact(backend, p, (m, n, k), &a, &b, &c0_bad, alpha, 0.0);
        let (r, _) = reference(&am, false, &bm, false, None, alpha, 0.0, m, n, k);
        for (i, (&got, &want)) in c.iter().zip(&r).enumerate() {
            assert!(
                got.is_finite() && got == want,
                "{} beta = 0 with NaN/Inf in C0: element {i} is {got}, want alpha·A·B = {want}",
                p.name()
            );
        }
    }
}

per_backend! {
    sweep_f32_random_shapes_tiles_transposes => super::sweep_f32;
    sweep_f64_random_shapes => super::sweep_f64;
    reduced_precision_modes => super::reduced_precisions;
    transposes_on_edge_shapes => super::transposes_and_edges;
    matrix_smaller_than_a_tile => super::small_matrix_big_tiles;
    sixteen_bit_files_widen_to_f32 => super::f16_and_bf16_files;
    alpha_zero_beta_zero_and_c0_kept_in_full_precision => super::alpha_zero_and_c0_full_precision;
}
