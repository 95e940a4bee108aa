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
    let dt = if p.is_f64() { DType::F64 } else { DType::F32 };
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

/// Ogita–Rump–Oishi Dot2 (TwoSum, TwoProduct by FMA): the dot product as if computed in twice
/// the working precision, then rounded: a reference more accurate than any f64 GEMM.
fn dot2(x: impl Iterator<Item = (f64, f64)>) -> f64 {
    let (mut s, mut c) = (0f64, 0f64);
    for (a, b) in x {
        let p = a * b;
        let pe = a.mul_add(b, -p);
        let t = s + p;
        let z = t - s;
        c += pe + ((s - (t - z)) + (p - z));
        s = t;
    }
    s + c
}

/// `alpha·A·B + beta·C0` from `.npy` files, through the engine with `engine` lines added to
/// `[engine]`; the output and the run's report.
#[allow(clippy::too_many_arguments)]
fn run_f64(
    backend: &str,
    engine: &str,
    (m, n, k): (usize, usize, usize),
    a: &[f64],
    b: &[f64],
    c0: &[f64],
    alpha: f64,
    beta: f64,
) -> mgmm_stream::Result<(Vec<f64>, mgmm_stream::run::RunReport)> {
    let d = tmp();
    let dir = d.path();
    write_npy(&dir.join("A.npy"), m, k, a, DType::F64);
    write_npy(&dir.join("B.npy"), k, n, b, DType::F64);
    write_npy(&dir.join("C0.npy"), m, n, c0, DType::F64);
    let text = format!(
        "[matrices.A]\npath = \"A.npy\"\n[matrices.B]\npath = \"B.npy\"\n\
         [matrices.C0]\npath = \"C0.npy\"\n\
         [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\nalpha = {alpha:?}\n\
         accumulate = \"C0\"\nbeta = {beta:?}\n\
         [engine]\nbackend = \"{backend}\"\nhost_memory = \"64MiB\"\ntile = [16, 16, 16]\n{engine}\n"
    );
    let rep = run_text(dir, &text)?;
    Ok((Mat::load(&dir.join("C.mgt")).v, rep))
}

/// The inputs of the emulation's accuracy tests, by name: A (m×k), B (k×n).
fn emulation_inputs(
    kind: &str,
    (m, n, k): (usize, usize, usize),
    seed: u64,
) -> (Vec<f64>, Vec<f64>) {
    let mut g = Rng::new(seed, 9);
    let mut unit = || (g.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    let mut normal = || {
        let (u, v) = (unit().max(1e-300), unit());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    };
    let mut a: Vec<f64> = (0..m * k).map(|_| normal()).collect();
    let mut b: Vec<f64> = (0..k * n).map(|_| normal()).collect();
    match kind {
        "normal" => {}
        "uniform" => {
            a.iter_mut().for_each(|x| *x = x.abs().fract());
            b.iter_mut().for_each(|x| *x = x.abs().fract());
        }
        // Rows of A and columns of B scaled over 1e-8 … 1e8.
        "scaled rows" => {
            for i in 0..m {
                let s = 10f64.powf(-8.0 + 16.0 * i as f64 / (m - 1) as f64);
                a[i * k..(i + 1) * k].iter_mut().for_each(|x| *x *= s);
            }
            for j in 0..n {
                let s = 10f64.powf(8.0 - 16.0 * j as f64 / (n - 1) as f64);
                (0..k).for_each(|p| b[p * n + j] *= s);
            }
        }
        // A column of B all zero, and a row of A.
        "zero column" => {
            (0..k).for_each(|p| b[p * n + 3] = 0.0);
            a[2 * k..3 * k].fill(0.0);
        }
        // Subnormal rows of A and a subnormal column of B, beside normal ones.
        "subnormals" => {
            a[..2 * k].iter_mut().for_each(|x| *x *= 1e-310);
            (0..k).for_each(|p| b[p * n + 1] *= 2e-309);
        }
        // Rows of A spanning 1e±150 whose large elements meet zeros of B: no count of
        // moduli meets the bound there, the blocks fall back to native fp64.
        "wide rows" => {
            for i in 0..m {
                a[i * k] = 1e150;
                (1..k).for_each(|p| a[i * k + p] *= 1e-150);
            }
            b[..n].fill(0.0);
        }
        "nonfinite" => {
            a[5] = f64::NAN;
            a[3 * k + 20] = f64::INFINITY;
            b[7 * n + 11] = f64::NEG_INFINITY;
        }
        other => panic!("{other}"),
    }
    (a, b)
}

/// `precision = "fp64_emulated"` against Dot2 element by element — every element within
/// `(K+2)·u·(|α||A||B| + |β·C0|)` (plus K+2 units of underflow, 2^-1074, where the products
/// are subnormal) — and its median relative error at most twice the engine's native fp64 on
/// the same files; NaN/Inf exactly where native fp64 puts them; the blocks left to native
/// fp64 counted in the report. Shapes straddle every tile edge (tile 16, m, n, k not
/// multiples of it).
fn fp64_emulated_accuracy(backend: &str) {
    let (m, n, k) = (37, 29, 45);
    let emulated = "precision = \"fp64_emulated\"";
    let u = 2f64.powi(-53);
    for (t, kind) in [
        "normal",
        "uniform",
        "scaled rows",
        "zero column",
        "subnormals",
        "wide rows",
        "nonfinite",
    ]
    .into_iter()
    .enumerate()
    {
        let (a, b) = emulation_inputs(kind, (m, n, k), 10 + t as u64);
        let c0: Vec<f64> = emulation_inputs("normal", (m, 1, n), 50 + t as u64).0;
        let (alpha, beta) = [(1.0, 0.0), (-0.75, 1.0), (2.0, -0.5)][t % 3];
        let (c, rep) = run_f64(backend, emulated, (m, n, k), &a, &b, &c0, alpha, beta)
            .unwrap_or_else(|e| panic!("{kind}: {e}"));
        let (native, _) = run_f64(
            backend,
            "precision = \"fp64\"",
            (m, n, k),
            &a,
            &b,
            &c0,
            alpha,
            beta,
        )
        .unwrap();
        let em = rep.steps[0]
            .emulation
            .as_ref()
            .expect("an emulation report");
        let (mut rel, mut rel_native) = (Vec::new(), Vec::new());
        for i in 0..m {
            for j in 0..n {
                let e = i * n + j;
                let pairs = (0..k).map(|p| (a[i * k + p], b[p * n + j]));
                let s = dot2(pairs.clone());
                let g: f64 = pairs.map(|(x, y)| (x * y).abs()).sum();
                let want = alpha * s + beta * c0[e];
                if !want.is_finite() || !native[e].is_finite() {
                    assert!(
                        c[e].to_bits() == native[e].to_bits()
                            || (c[e].is_nan() && native[e].is_nan()),
                        "{kind} ({i}, {j}): {} where native fp64 gives {}",
                        c[e],
                        native[e]
                    );
                    continue;
                }
                let mag = alpha.abs() * g + (beta * c0[e]).abs();
                let bound = (k as f64 + 2.0) * (u * mag + f64::from_bits(1));
                let err = (c[e] - want).abs();
                assert!(
                    err <= bound,
                    "{kind} ({i}, {j}): {} against {want}, error {err:e} > {bound:e}",
                    c[e]
                );
                if want != 0.0 {
                    rel.push(err / want.abs());
                    rel_native.push((native[e] - want).abs() / want.abs());
                }
            }
        }
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied().unwrap_or(0.0)
        };
        let (med, med_native) = (median(rel), median(rel_native));
        assert!(
            med <= 2.0 * med_native,
            "{kind}: median relative error {med:e}, native fp64 {med_native:e}"
        );
        let st = &em.stats;
        match kind {
            "nonfinite" => assert!(st.fallback_nonfinite > 0, "{kind}: {st:?}"),
            "wide rows" => assert!(st.fallback_bound > 0, "{kind}: {st:?}"),
            _ => assert!(
                st.fallback_tiles == 0 && st.blocks > 0 && st.moduli_max <= 16,
                "{kind}: {st:?}"
            ),
        }
        assert_eq!(
            st.fallback_tiles,
            st.fallback_nonfinite + st.fallback_bound + st.fallback_short
        );
    }
}

/// A forced count is used as given and reported: blocks it leaves outside the bound are
/// counted, not silently fallen back (the summary's wording: `report`'s unit tests).
fn fp64_emulated_forced_moduli(backend: &str) {
    let (m, n, k) = (20, 18, 32);
    let (a, b) = emulation_inputs("normal", (m, n, k), 3);
    let z = vec![0.0; m * n];
    let engine = "precision = \"fp64_emulated\"\nemulation_moduli = 6";
    let (_, rep) = run_f64(backend, engine, (m, n, k), &a, &b, &z, 1.0, 0.0).unwrap();
    let em = rep.steps[0].emulation.as_ref().unwrap();
    assert_eq!(em.setting, "6");
    assert_eq!((em.stats.moduli_min, em.stats.moduli_max), (6, 6));
    assert!(
        em.stats.bound_unmet > 0 && em.stats.fallback_tiles == 0,
        "{em:?}"
    );
}

/// `precision = "fp64_emulated"` through the engine's random shapes, tiles and transposes
/// (the sweep's f64 reference and bound).
fn sweep_f64_emulated(backend: &str) {
    let mut g = Rng::new(2024, 4);
    for i in 0..8 {
        let c = random_case(
            &mut g,
            DType::F64,
            Precision::Fp64Emulated(mgmm_stream::plan::EmulationModuli::Auto),
        );
        check(backend, &c, 700 + i);
    }
}

per_backend! {
    fp64_emulated_within_the_bound_and_twice_native => super::fp64_emulated_accuracy;
    fp64_emulated_forced_moduli_reported => super::fp64_emulated_forced_moduli;
    sweep_f64_emulated_random_shapes => super::sweep_f64_emulated;
    sweep_f32_random_shapes_tiles_transposes => super::sweep_f32;
    sweep_f64_random_shapes => super::sweep_f64;
    reduced_precision_modes => super::reduced_precisions;
    transposes_on_edge_shapes => super::transposes_and_edges;
    matrix_smaller_than_a_tile => super::small_matrix_big_tiles;
    sixteen_bit_files_widen_to_f32 => super::f16_and_bf16_files;
    alpha_zero_beta_zero_and_c0_kept_in_full_precision => super::alpha_zero_and_c0_full_precision;
}

/// The journal's fingerprint tells `fp64_emulated` from `fp64`, and a forced count of moduli
/// from another: an output computed one way is never resumed or taken as complete the other.
#[test]
fn fp64_emulated_and_its_moduli_are_in_the_fingerprint() {
    let d = tmp();
    let dir = d.path();
    let (m, n, k) = (9, 7, 20);
    let (a, b) = emulation_inputs("normal", (m, n, k), 5);
    write_npy(&dir.join("A.npy"), m, k, &a, DType::F64);
    write_npy(&dir.join("B.npy"), k, n, &b, DType::F64);
    let plan = |engine: &str| {
        format!(
            "[matrices.A]\npath = \"A.npy\"\n[matrices.B]\npath = \"B.npy\"\n\
             [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n\
             [engine]\nbackend = \"cpu\"\nhost_memory = \"64MiB\"\n{engine}\n"
        )
    };
    run_text(dir, &plan("precision = \"fp64\"")).unwrap();
    let e = run_text(dir, &plan("precision = \"fp64_emulated\""))
        .expect_err("an fp64 output is not the emulated one");
    let msg = e.to_string();
    assert!(
        msg.contains("precision") && msg.contains("fp64_emulated"),
        "{msg}"
    );
    std::fs::remove_file(dir.join("C.mgt")).unwrap();
    let _ = std::fs::remove_file(dir.join("C.mgt.journal"));
    run_text(
        dir,
        &plan("precision = \"fp64_emulated\"\nemulation_moduli = 12"),
    )
    .unwrap();
    let e = run_text(
        dir,
        &plan("precision = \"fp64_emulated\"\nemulation_moduli = 14"),
    )
    .expect_err("another forced count is another output");
    assert!(e.to_string().contains("emulation moduli"), "{e}");
}
