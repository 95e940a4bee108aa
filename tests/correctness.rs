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

mod common;
use common::*;

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
    text += &format!(
        "[engine]\nbackend = \"{backend}\"\nprecision = \"{}\"\nhost_memory = \"64MiB\"\ntile = [{}, {}, {}]\n",
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

per_backend! {
    sweep_f32_random_shapes_tiles_transposes => super::sweep_f32;
    sweep_f64_random_shapes => super::sweep_f64;
    reduced_precision_modes => super::reduced_precisions;
    transposes_on_edge_shapes => super::transposes_and_edges;
    matrix_smaller_than_a_tile => super::small_matrix_big_tiles;
    sixteen_bit_files_widen_to_f32 => super::f16_and_bf16_files;
}
