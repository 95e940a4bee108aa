//! Freivalds' verification: passes on correct products in every precision and transpose
//! combination (including all-positive data, where rounding errors do not cancel), and finds a
//! single corrupted element in a 10000×10000 output.

mod common;
use common::*;

use std::os::unix::fs::FileExt;
use std::process::Command;

use mgmm_stream::dtype::DType;
use mgmm_stream::plan::Plan;
use mgmm_stream::store::gen::Dist;
use mgmm_stream::store::TiledFile;
use mgmm_stream::verify::verify_step;

fn plan_text(expr: &str, precision: &str, extra: &str) -> String {
    format!(
        "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n[matrices.C0]\npath = \"C0.mgt\"\n\
         [[step]]\noutput = \"C.mgt\"\nexpr = \"{expr}\"\n{extra}\
         [engine]\nbackend = \"cpu\"\nprecision = \"{precision}\"\ntile = [64, 48, 80]\n"
    )
}

#[test]
fn passes_on_correct_products() {
    let cases = [
        ("A @ B", "fp32", "", Dist::Normal, DType::F32),
        (
            "A.T @ B",
            "fp32",
            "alpha = -2.0\naccumulate = \"C0\"\nbeta = 0.5\n",
            Dist::Normal,
            DType::F32,
        ),
        ("A @ B.T", "tf32", "", Dist::Normal, DType::F32),
        ("A.T @ B.T", "bf16", "", Dist::Uniform, DType::F32),
        ("A @ B", "fp16", "", Dist::Uniform, DType::F32),
        ("A @ B", "fp64", "", Dist::Normal, DType::F64),
        ("A @ B", "fp32", "", Dist::Arange, DType::F32),
    ];
    for (i, (expr, p, extra, dist, dt)) in cases.into_iter().enumerate() {
        let d = tmp();
        let dir = d.path();
        let (m, n, k) = (150u64, 130u64, 700u64);
        let (ar, ac) = if expr.starts_with("A.T") {
            (k, m)
        } else {
            (m, k)
        };
        let (br, bc) = if expr.ends_with("B.T") {
            (n, k)
        } else {
            (k, n)
        };
        gen(
            &dir.join("A.mgt"),
            ar,
            ac,
            dt,
            (64, 64),
            dist,
            10 + i as u64,
        );
        gen(
            &dir.join("B.mgt"),
            br,
            bc,
            dt,
            (64, 64),
            dist,
            20 + i as u64,
        );
        gen(
            &dir.join("C0.mgt"),
            m,
            n,
            dt,
            (64, 64),
            Dist::Normal,
            30 + i as u64,
        );
        run_text(dir, &plan_text(expr, p, extra)).unwrap();
        let plan = Plan::load(&dir.join("plan.toml")).unwrap();
        let rep = verify_step(&plan.steps[0], plan.engine.precision, 3, 7).unwrap();
        eprintln!("{expr} {p}: {}", mgmm_stream::verify::format(&rep));
        assert!(rep.pass, "case {i} ({expr}, {p}): {rep:?}");
        assert!(
            rep.max_ratio < 1.0 && rep.max_ratio > 0.0 || rep.residual == 0.0,
            "{rep:?}"
        );
    }
}

#[test]
fn finds_one_corrupted_element_in_a_10000_square_output() {
    let d = tmp();
    let dir = d.path();
    gen(
        &dir.join("A.mgt"),
        10000,
        64,
        DType::F32,
        (1024, 64),
        Dist::Normal,
        1,
    );
    gen(
        &dir.join("B.mgt"),
        64,
        10000,
        DType::F32,
        (64, 1024),
        Dist::Normal,
        2,
    );
    std::fs::write(
        dir.join("plan.toml"),
        "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n\
         [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n[engine]\nbackend = \"cpu\"\ndurable = false\n",
    )
    .unwrap();
    let o = Command::new(bin())
        .args(["run", "plan.toml", "--verify"])
        .current_dir(dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("PASS"), "{err}");
    // Corrupt C[1234, 5678] by +16 (a typical element is about ±8 here).
    let f = TiledFile::open(&dir.join("C.mgt")).unwrap();
    let h = f.hdr;
    let (i, j) = (1234u64, 5678u64);
    let off = h.tile_offset(i / h.tile_rows, j / h.tile_cols)
        + ((i % h.tile_rows) * h.tile_cols + j % h.tile_cols) * 4;
    let mut b = [0u8; 4];
    f.file().read_exact_at(&mut b, off).unwrap();
    drop(f);
    let v = f32::from_le_bytes(b) + 16.0;
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("C.mgt"))
        .unwrap()
        .write_all_at(&v.to_le_bytes(), off)
        .unwrap();
    let o = Command::new(bin())
        .args(["verify", "plan.toml"])
        .current_dir(dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("FAIL")
            && err.contains("rows failing: [1234]")
            && err.contains("verification failed for step 1"),
        "{err}"
    );
}
