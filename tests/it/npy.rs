//! Data where users keep it: `.npy` and raw inputs read in place, `.npy` outputs, whole
//! expressions in one step.
//!
//! Inputs are written here by a tiny `.npy` writer (so CI needs no numpy): every supported kind
//! (f16/f32/f64, C and Fortran order, header versions 1–3, raw row- and column-major with an
//! offset) on shapes that straddle the compute tiles, multiplied and compared with an f64
//! reference. Values are small integers, exact in every dtype, so the products are exact and
//! compared bit for bit. Each refused kind has its message checked. One test round-trips through
//! numpy: it is `#[ignore]`d, since a plain `cargo test` must not need Python, and .ci/run runs
//! it with `--ignored` against the numpy of its virtual environment.

use crate::common::*;

use std::path::Path;
use std::process::Command;

use mgmm_stream::dtype::{self, DType};
use mgmm_stream::plan::Plan;
use mgmm_stream::store::{open_source, Block};

/// Element (i, j) of test matrix `seed`: a small integer, exact in f16.
fn val(seed: u64, i: usize, j: usize) -> f64 {
    ((i * 7 + j * 3 + seed as usize * 5) % 11) as f64 - 5.0
}

fn mat(seed: u64, rows: usize, cols: usize) -> Mat {
    let v = (0..rows * cols)
        .map(|x| val(seed, x / cols, x % cols))
        .collect();
    Mat { rows, cols, v }
}

fn descr(dt: DType) -> &'static str {
    match dt {
        DType::F16 => "<f2",
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::BF16 => "|V2",
    }
}

/// The bytes of `m` in `dt`, row-major or (`fortran`) column-major.
fn data(m: &Mat, dt: DType, fortran: bool) -> Vec<u8> {
    let mut out = vec![0u8; m.rows * m.cols * dt.size()];
    let es = dt.size();
    for i in 0..m.rows {
        for j in 0..m.cols {
            let at = if fortran {
                j * m.rows + i
            } else {
                i * m.cols + j
            };
            dtype::put(dt, m.v[i * m.cols + j], &mut out[at * es..at * es + es]);
        }
    }
    out
}

/// A `.npy` file as numpy writes it: header `dict`, format `version`, padded to 64 bytes.
fn npy_bytes(version: u8, dict: &str, body: &[u8]) -> Vec<u8> {
    let pre = if version == 1 { 10 } else { 12 };
    let total = (pre + dict.len() + 1).div_ceil(64) * 64;
    let mut h = vec![0x93, b'N', b'U', b'M', b'P', b'Y', version, 0];
    if version == 1 {
        h.extend_from_slice(&((total - pre) as u16).to_le_bytes());
    } else {
        h.extend_from_slice(&((total - pre) as u32).to_le_bytes());
    }
    h.extend_from_slice(dict.as_bytes());
    h.resize(total - 1, b' ');
    h.push(b'\n');
    h.extend_from_slice(body);
    h
}

fn write_npy(path: &Path, m: &Mat, dt: DType, fortran: bool, version: u8) {
    let dict = format!(
        "{{'descr': '{}', 'fortran_order': {}, 'shape': ({}, {}), }}",
        descr(dt),
        if fortran { "True" } else { "False" },
        m.rows,
        m.cols
    );
    std::fs::write(path, npy_bytes(version, &dict, &data(m, dt, fortran))).unwrap();
}

/// The whole matrix in `path` (any source) as f64, in its declared orientation.
fn read_all(path: &Path) -> Mat {
    let f = open_source(path).unwrap();
    let (r, c) = f.shape();
    let host = f.dtype().compute();
    let mut buf = vec![0u8; (r * c) as usize * host.size()];
    let b = Block {
        r0: 0,
        c0: 0,
        rows: r,
        cols: c,
    };
    f.read_block(&b, host, &mut buf).unwrap();
    let v: Vec<f64> = buf
        .chunks(host.size())
        .map(|x| dtype::get(host, x))
        .collect();
    let m = Mat {
        rows: r as usize,
        cols: c as usize,
        v,
    };
    if !f.transposed() {
        return m;
    }
    let v = (0..m.rows * m.cols)
        .map(|x| m.v[(x % m.rows) * m.cols + x / m.rows])
        .collect();
    Mat {
        rows: m.cols,
        cols: m.rows,
        v,
    }
}

fn product(a: &Mat, b: &Mat, alpha: f64) -> Vec<f64> {
    reference(a, false, b, false, None, alpha, 0.0, a.rows, b.cols, a.cols).0
}

const ENGINE: &str = "[engine]\nbackend = \"cpu\"\ntile = [16, 24, 8]\nhost_memory = \"32MiB\"\n";

#[test]
fn every_npy_kind_in_place_matches_the_reference() {
    let (m, k, n) = (37, 29, 41);
    let mut case = 0;
    for dt in [DType::F16, DType::F32, DType::F64] {
        for (fa, fb) in [(false, false), (true, false), (false, true), (true, true)] {
            case += 1;
            let d = tmp();
            let (a, b) = (mat(1, m, k), mat(2, k, n));
            write_npy(&d.path().join("A.npy"), &a, dt, fa, 1 + case % 3);
            write_npy(&d.path().join("B.npy"), &b, dt, fb, 1 + (case + 1) % 3);
            let prec = if dt == DType::F64 { "fp64" } else { "fp32" };
            let out = if case % 2 == 0 { "C.npy" } else { "C.mgt" };
            // Every way inputs reach the lanes, by turns (docs/PLAN.md, staging): arrays of the
            // compute dtype go straight from the files' pages unless copying is asked for.
            let staging = ["auto", "copy", "direct"][(case % 3) as usize];
            let rep = run_text(
                d.path(),
                &format!(
                    "[matrices.A]\npath = \"A.npy\"\n[matrices.B]\npath = \"B.npy\"\n\
                     [[step]]\noutput = \"{out}\"\nexpr = \"A @ B\"\n{ENGINE}precision = \"{prec}\"\n\
                     staging = \"{staging}\"\n"
                ),
            )
            .unwrap_or_else(|e| panic!("{dt} F-order {fa}/{fb}: {e}"));
            let direct = rep.steps[0].direct_bytes;
            if staging == "copy" || dt == DType::F16 {
                assert_eq!(direct, 0, "{dt} {staging}");
            } else {
                assert_eq!(direct, rep.steps[0].read_bytes, "{dt} {staging}");
            }
            let c = read_all(&d.path().join(out));
            assert_eq!((c.rows, c.cols), (m, n));
            assert_eq!(c.v, product(&a, &b, 1.0), "{dt} fortran {fa}/{fb} → {out}");
        }
    }
}

#[test]
fn transposed_operands_of_fortran_files_read_without_a_copy() {
    // A.T @ B.T with A stored in Fortran order: A.T is then a plain row-major read.
    let d = tmp();
    let (at, bt) = (mat(3, 29, 37), mat(4, 41, 29));
    write_npy(&d.path().join("A.npy"), &at, DType::F32, true, 2);
    write_npy(&d.path().join("B.npy"), &bt, DType::F32, false, 3);
    run_text(
        d.path(),
        &format!(
            "[matrices.A]\npath = \"A.npy\"\n[matrices.B]\npath = \"B.npy\"\n\
             [[step]]\noutput = \"C.npy\"\nexpr = \"0.5 * A.T @ B.T\"\n{ENGINE}"
        ),
    )
    .unwrap();
    let want = reference(&at, true, &bt, true, None, 0.5, 0.0, 37, 41, 29).0;
    assert_eq!(read_all(&d.path().join("C.npy")).v, want);
}

#[test]
fn raw_files_row_and_column_major_with_an_offset() {
    let d = tmp();
    let (a, b) = (mat(5, 33, 17), mat(6, 17, 26));
    let mut fa = vec![0xAB; 100];
    fa.extend(data(&a, DType::F32, false));
    std::fs::write(d.path().join("a.bin"), &fa).unwrap();
    let mut fb = vec![0xCD; 8];
    fb.extend(data(&b, DType::F32, true));
    std::fs::write(d.path().join("b.bin"), &fb).unwrap();
    let text = format!(
        "[matrices.A]\npath = \"a.bin\"\nformat = \"raw\"\nrows = 33\ncols = 17\ndtype = \"f32\"\noffset = 100\n\
         [matrices.B]\npath = \"b.bin\"\nformat = \"raw\"\nrows = 17\ncols = 26\ndtype = \"f32\"\norder = \"F\"\noffset = 8\n\
         [[step]]\noutput = \"C.npy\"\nexpr = \"A @ B\"\n{ENGINE}"
    );
    run_text(d.path(), &text).unwrap();
    assert_eq!(read_all(&d.path().join("C.npy")).v, product(&a, &b, 1.0));
    // A wrong declared shape is caught by the file size, naming the file.
    let e = run_text(d.path(), &text.replace("rows = 33", "rows = 34"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("a.bin") && e.contains("raw file is") && e.contains("fix rows"),
        "{e}"
    );
    let e = run_text(
        d.path(),
        &text.replace("dtype = \"f32\"\noffset = 100", "offset = 100"),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("needs `dtype`"), "{e}");
}

#[test]
fn one_raw_file_as_a_matrix_and_its_transpose_but_not_as_another_shape() {
    let d = tmp();
    let a = mat(7, 23, 19);
    std::fs::write(d.path().join("a.bin"), data(&a, DType::F32, false)).unwrap();
    // X is A (row-major), Y the same bytes read column-major: Aᵀ. X @ Y = A·Aᵀ.
    let text = format!(
        "[matrices.X]\npath = \"a.bin\"\nformat = \"raw\"\nrows = 23\ncols = 19\ndtype = \"f32\"\n\
         [matrices.Y]\npath = \"a.bin\"\nformat = \"raw\"\nrows = 19\ncols = 23\ndtype = \"f32\"\norder = \"F\"\n\
         [[step]]\noutput = \"C.npy\"\nexpr = \"X @ Y\"\n{ENGINE}"
    );
    run_text(d.path(), &text).unwrap();
    let want = reference(&a, false, &a, true, None, 1.0, 0.0, 23, 23, 19).0;
    assert_eq!(read_all(&d.path().join("C.npy")).v, want);
    // Read row-major as 19×23 it would be a reshape of A: refused, naming both declarations.
    std::fs::remove_file(d.path().join("C.npy")).unwrap();
    let e = run_text(d.path(), &text.replace("order = \"F\"\n", ""))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("matrices.Y")
            && e.contains("also matrices.X")
            && e.contains("one file holds one matrix")
            && e.contains("X.T in expr, or declare it with order = \"F\""),
        "{e}"
    );
}

#[test]
fn bad_npy_kinds_get_clear_errors_naming_the_file() {
    let d = tmp();
    let m = mat(1, 4, 4);
    let body = data(&m, DType::F32, false);
    let cases: &[(&str, &str, &[&str])] = &[
        ("'>f4'", "(4, 4)", &["big-endian", "astype('<f4')"]),
        ("'|O'", "(4, 4)", &["object array", "astype"]),
        ("'<i4'", "(4, 4)", &["integer", "astype('<f4')"]),
        ("'<u2'", "(4, 4)", &["integer"]),
        ("'<c8'", "(4, 4)", &["complex", "a.real"]),
        ("[('x', '<f4')]", "(4, 4)", &["structured"]),
        (
            "'|V2'",
            "(4, 4)",
            &["bfloat16", "ml_dtypes", "format = \"raw\""],
        ),
        ("'<f4'", "()", &["0-d"]),
        ("'<f4'", "(16,)", &["1-D", "reshape(1, -1)"]),
        ("'<f4'", "(2, 2, 4)", &["2-D", "reshape(-1, a.shape[-1])"]),
    ];
    for (descr, shape, wants) in cases {
        let dict = format!("{{'descr': {descr}, 'fortran_order': False, 'shape': {shape}, }}");
        std::fs::write(d.path().join("X.npy"), npy_bytes(1, &dict, &body)).unwrap();
        let text = format!(
            "[matrices.X]\npath = \"X.npy\"\n[[step]]\noutput = \"C.mgt\"\nexpr = \"X @ X\"\n{ENGINE}"
        );
        std::fs::write(d.path().join("plan.toml"), text).unwrap();
        let e = Plan::load(&d.path().join("plan.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("X.npy") && e.contains("matrices.X"),
            "{descr} {shape}: {e}"
        );
        for w in *wants {
            assert!(e.contains(w), "{descr} {shape}: {w:?} not in {e}");
        }
    }
    // Truncated data.
    let mut t = npy_bytes(
        1,
        "{'descr': '<f4', 'fortran_order': False, 'shape': (4, 4), }",
        &body,
    );
    t.truncate(t.len() - 4);
    std::fs::write(d.path().join("X.npy"), t).unwrap();
    let e = Plan::load(&d.path().join("plan.toml"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("truncated"), "{e}");
}

fn cli(args: &[&str]) -> (bool, String, String) {
    let o = Command::new(bin()).args(args).output().unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

/// `C.npy = A @ B` in `dir` from f32 `.npy` inputs A (matrix `a.0`, `a.1`×`a.2`) and B (matrix
/// `b.0`, `a.2`×`b.1`), run: the inputs and the plan's text.
fn npy_product(dir: &Path, a: (u64, usize, usize), b: (u64, usize)) -> (Mat, Mat, String) {
    let (a, b) = (mat(a.0, a.1, a.2), mat(b.0, a.2, b.1));
    write_npy(&dir.join("A.npy"), &a, DType::F32, false, 1);
    write_npy(&dir.join("B.npy"), &b, DType::F32, false, 1);
    let text = format!(
        "[matrices.A]\npath = \"A.npy\"\n[matrices.B]\npath = \"B.npy\"\n\
         [[step]]\noutput = \"C.npy\"\nexpr = \"A @ B\"\n{ENGINE}"
    );
    run_text(dir, &text).unwrap();
    (a, b, text)
}

#[test]
fn npy_output_has_aligned_data_a_sidecar_and_resumes() {
    let d = tmp();
    let (a, b, text) = npy_product(d.path(), (7, 50, 45), (8, 70));
    let c = d.path().join("C.npy");
    let bytes = std::fs::read(&c).unwrap();
    assert_eq!(bytes.len(), 4096 + 50 * 70 * 4);
    assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00");
    assert_eq!(u16::from_le_bytes([bytes[8], bytes[9]]), 4086);
    assert_eq!(bytes[4095], b'\n');
    assert_eq!(read_all(&c).v, product(&a, &b, 1.0));
    assert!(d.path().join("C.npy.crc32c").exists());
    // info --check verifies the sidecar's tile CRCs; verify checks the product.
    let cs = c.to_str().unwrap();
    let (ok, out, err) = cli(&["info", cs, "--check"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("16×24 tile") && out.contains("all 12 tiles OK"),
        "{out}"
    );
    let plan = d.path().join("plan.toml");
    let (ok, out, err) = cli(&["verify", plan.to_str().unwrap()]);
    assert!(ok && out.contains("PASS"), "{out}{err}");
    // plan's status compares the .npy's own length (not its sidecar's too) with its header.
    let (ok, out, err) = cli(&["plan", plan.to_str().unwrap()]);
    assert!(
        ok && out.contains("status: complete") && !out.contains("truncated"),
        "{out}{err}"
    );
    // Forget some tiles in the journal: the next run resumes into the .npy, same bytes.
    let forgotten: std::collections::BTreeSet<u32> = [0, 3, 5].into();
    mgmm_stream::journal::forget(&c, &forgotten).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&c).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[0xFF; 64], 4096).unwrap();
    drop(f);
    run_text(d.path(), &text).unwrap();
    assert_eq!(std::fs::read(&c).unwrap(), bytes);
    // Damage one element: info --check names the tile and the file.
    let f = std::fs::OpenOptions::new().write(true).open(&c).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[0x7F; 4], 4096 + (20 * 70 + 30) * 4).unwrap();
    let (ok, _, err) = cli(&["info", cs, "--check"]);
    assert!(
        !ok && err.contains("C.npy") && err.contains("tile (1, 1)"),
        "{err}"
    );
    // A finished output of `run`: the fix is `verify --repair`, not deleting its checksums
    // (which would make the damage invisible).
    assert!(
        err.contains("verify PLAN --repair") && !err.contains("delete the sidecar"),
        "{err}"
    );
    // Without a journal beside it, an array with a sidecar: what to do if it was changed on
    // purpose.
    std::fs::remove_file(mgmm_stream::journal::journal_path(&c)).unwrap();
    let (ok, _, err) = cli(&["info", cs, "--check"]);
    assert!(
        !ok && err.contains("C.npy.crc32c") && err.contains("delete the sidecar"),
        "{err}"
    );
}

/// A finished `.npy` output saved again by another program (numpy's `np.save` of it: the same
/// array, its data at byte 128, not 4096): `plan`, `verify` and `run` say the same — not what
/// `run` wrote, so it cannot be resumed or mended; `run --restart` computes it again — where
/// `verify` promised `--repair` would mend it, `run` gave its advice twice, and `plan` called
/// the file truncated.
#[test]
fn a_npy_output_saved_again_by_another_program_is_named_as_such() {
    let d = tmp();
    let (a, b, _) = npy_product(d.path(), (3, 40, 30), (4, 50));
    let c = d.path().join("C.npy");
    let want = product(&a, &b, 1.0);
    write_npy(
        &c,
        &Mat {
            rows: 40,
            cols: 50,
            v: want.clone(),
        },
        DType::F32,
        false,
        1,
    );
    let plan = d.path().join("plan.toml");
    let p = plan.to_str().unwrap();
    let says = "data start at byte 128, not at 4096 where `run` writes them";
    // Lines are wrapped at 80 columns: compare with the spaces evened out.
    let flat = one_line;
    let (ok, out, err) = cli(&["plan", p]);
    let out = flat(&out);
    assert!(
        ok && out.contains(says) && out.contains("`run --restart` computes it again"),
        "{out}{err}"
    );
    assert!(!out.contains("truncated"), "{out}");
    let (ok, out, err) = cli(&["verify", p, "--repair"]);
    let out = flat(&out);
    assert!(
        !ok && out.contains(says) && out.contains("`run --restart` computes the step again"),
        "{out}{err}"
    );
    assert!(
        !err.contains("repair:") && !out.contains("--repair` (or `run`)"),
        "{out}{err}"
    );
    let (ok, _, err) = cli(&["run", p]);
    let err = flat(&err);
    assert!(
        !ok && err.contains(says) && err.matches("--restart").count() == 1,
        "{err}"
    );
    // A split run's shard says the same (it said "N bytes, not the M its header needs").
    let (ok, _, err) = cli(&["run", p, "--shard", "0/1"]);
    let err = flat(&err);
    assert!(!ok && err.contains(says), "{err}");
    let (ok, _, err) = cli(&["run", p, "--restart"]);
    assert!(ok, "{err}");
    assert_eq!(read_all(&c).v, want);
}

#[test]
fn info_import_export_accept_npy_and_raw() {
    let d = tmp();
    let a = mat(9, 21, 13);
    let p = |n: &str| d.path().join(n).to_str().unwrap().to_string();
    write_npy(&d.path().join("A.npy"), &a, DType::F16, true, 3);
    let (ok, out, err) = cli(&["info", &p("A.npy")]);
    assert!(ok, "{err}");
    assert!(out.contains("21 × 13") && out.contains("Fortran"), "{out}");
    let (ok, _, err) = cli(&["import", &p("A.npy"), &p("A.mgt"), "--tile", "8"]);
    assert!(ok, "{err}");
    assert_eq!(Mat::load(&d.path().join("A.mgt")).v, a.v);
    std::fs::write(d.path().join("a.bin"), data(&a, DType::F64, false)).unwrap();
    let raw = format!("raw:rows=21,cols=13,dtype=f64:{}", p("a.bin"));
    let (ok, out, err) = cli(&["info", &raw]);
    assert!(ok && out.contains("raw row-major"), "{out}{err}");
    let (ok, _, err) = cli(&["export", &raw, &p("E.npy")]);
    assert!(ok, "{err}");
    assert_eq!(read_all(&d.path().join("E.npy")).v, a.v);
    let (ok, _, err) = cli(&["export", &p("A.npy"), &p("F.npy")]);
    assert!(ok, "{err}");
    assert_eq!(read_all(&d.path().join("F.npy")).v, a.v);
    let (ok, _, err) = cli(&["info", &p("a.bin")]);
    assert!(!ok && err.contains("format = \"raw\""), "{err}");
}

/// A 40×9, B 9×3, C 3×70: (A·B)·C is the cheaper order. `exact` gives small integers (exact
/// products); otherwise values with full f32 mantissas, so that any change in the order of
/// operations would show in the bits.
fn chain_inputs(dir: &Path, exact: bool) -> (Mat, Mat, Mat) {
    let m = |seed, r, c| {
        let mut x = mat(seed, r, c);
        if !exact {
            x.v.iter_mut().enumerate().for_each(|(i, v)| {
                *v = ((*v + (i as f64 * 0.618_034).fract()) / 3.0) as f32 as f64
            });
        }
        x
    };
    let (a, b, c) = (m(1, 40, 9), m(2, 9, 3), m(3, 3, 70));
    write_npy(&dir.join("A.npy"), &a, DType::F32, false, 1);
    write_npy(&dir.join("B.npy"), &b, DType::F32, false, 1);
    write_npy(&dir.join("C.npy"), &c, DType::F32, true, 2);
    (a, b, c)
}

const MATS: &str = "[matrices.A]\npath = \"A.npy\"\n[matrices.B]\npath = \"B.npy\"\n[matrices.C]\npath = \"C.npy\"\n";

#[test]
fn a_chain_in_one_step_is_bit_identical_to_two_steps() {
    let d = tmp();
    chain_inputs(d.path(), false);
    for (expr, two) in [
        // A·B (40×3) first: cheaper than B·C (9×70).
        ("2.5 * A @ B @ C", "expr = \"A @ B\"\nname = \"X\"\n[[step]]\noutput = \"two.npy\"\nexpr = \"2.5 * X @ C\""),
        ("(A @ B @ C).T", "expr = \"A @ B\"\nname = \"X\"\n[[step]]\noutput = \"two.npy\"\nexpr = \"(X @ C).T\""),
    ] {
        run_text(
            d.path(),
            &format!("{MATS}[[step]]\noutput = \"one.npy\"\nexpr = \"{expr}\"\n{ENGINE}"),
        )
        .unwrap();
        run_text(
            d.path(),
            &format!("{MATS}[[step]]\noutput = \"X.mgt\"\n{two}\n{ENGINE}"),
        )
        .unwrap();
        let one = std::fs::read(d.path().join("one.npy")).unwrap();
        assert_eq!(one, std::fs::read(d.path().join("two.npy")).unwrap(), "{expr}");
        assert!(!d.path().join("one.npy.part1.mgt").exists(), "intermediate not removed");
        assert!(!d.path().join("one.npy.part1.mgt.journal").exists());
        // A second run skips the whole chain (its intermediate is not recomputed).
        let plan = d.path().join("plan1.toml");
        std::fs::write(
            &plan,
            format!("{MATS}[[step]]\noutput = \"one.npy\"\nexpr = \"{expr}\"\n{ENGINE}"),
        )
        .unwrap();
        let (ok, _, err) = cli(&["run", plan.to_str().unwrap()]);
        assert!(ok && err.contains("already complete"), "{err}");
        assert!(!d.path().join("one.npy.part1.mgt").exists());
        let (ok, out, err) = cli(&["plan", plan.to_str().unwrap()]);
        assert!(ok, "{err}");
        assert!(out.contains("chain: 2 sub-products") && out.contains("naive left to right"), "{out}");
        for f in ["one.npy", "two.npy", "X.mgt"] {
            for ext in ["", ".journal", ".crc32c"] {
                let _ = std::fs::remove_file(d.path().join(format!("{f}{ext}")));
            }
        }
    }
}

#[test]
fn a_chain_matches_the_reference_and_orders_by_cost() {
    let d = tmp();
    let (a, b, c) = chain_inputs(d.path(), true);
    run_text(
        d.path(),
        &format!("{MATS}[[step]]\noutput = \"D.npy\"\nexpr = \"A.T.T @ (B @ C)\"\n{ENGINE}"),
    )
    .unwrap();
    let ab = Mat {
        rows: 40,
        cols: 3,
        v: product(&a, &b, 1.0),
    };
    assert_eq!(read_all(&d.path().join("D.npy")).v, product(&ab, &c, 1.0));
    let p = Plan::load(&d.path().join("plan.toml")).unwrap();
    let ch = p.steps[0].chain.as_ref().unwrap();
    assert_eq!(ch.order, "((A @ B) @ C)");
    assert!(ch.naive_cost <= ch.order_cost * 1.0001);
}

/// numpy reads our `.npy` output with mmap, and we read numpy's files of every kind. Needs a
/// python with numpy (`MGMM_PYTHON`, default `python3`) and fails saying so without one.
#[test]
#[ignore = "needs numpy (pip install numpy, or MGMM_PYTHON=a python that has it): run with --ignored; .ci/run does"]
fn numpy_round_trip() {
    let py = std::env::var("MGMM_PYTHON").unwrap_or_else(|_| "python3".into());
    let has = Command::new(&py)
        .args(["-c", "import numpy"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        has,
        "`{py} -c 'import numpy'` failed: install numpy, or set MGMM_PYTHON to a python that has it"
    );
    let d = tmp();
    let script = r#"
import numpy as np, sys
d = sys.argv[1]
a = (np.arange(37 * 29).reshape(37, 29) % 11 - 5)
b = (np.arange(29 * 41).reshape(29, 41) % 7 - 3)
np.save(d + '/A.npy', np.asfortranarray(a.astype('<f2')))
np.save(d + '/B.npy', b.astype('<f2'))
np.save(d + '/want.npy', (a.astype(np.float64) @ b).astype('<f4'))
"#;
    let o = Command::new(&py)
        .args(["-c", script, d.path().to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    run_text(
        d.path(),
        &format!(
            "[matrices.A]\npath = \"A.npy\"\n[matrices.B]\npath = \"B.npy\"\n\
             [[step]]\noutput = \"C.npy\"\nexpr = \"A @ B\"\n{ENGINE}"
        ),
    )
    .unwrap();
    let check = r#"
import numpy as np, sys
d = sys.argv[1]
c = np.load(d + '/C.npy', mmap_mode='r')
w = np.load(d + '/want.npy')
assert c.dtype == np.float32 and c.shape == w.shape, (c.dtype, c.shape)
assert (np.asarray(c) == w).all()
print('ok')
"#;
    let o = Command::new(&py)
        .args(["-c", check, d.path().to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("ok"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `gen X.npy` (and a plan's `generate` under a `.npy` name) writes a real `.npy` — numpy's
/// magic and header, the data at byte 4096 — holding exactly what `gen X.mgt` holds for the
/// same seed (it wrote the tiled format under the `.npy` name before, which numpy refused).
#[test]
fn gen_writes_a_real_npy_under_a_npy_name() {
    let d = tmp();
    let dir = d.path();
    for dt in [DType::F32, DType::F64] {
        let spec = |path: &Path| {
            let s = mgmm_stream::store::gen::GenSpec {
                rows: 70,
                cols: 45,
                dtype: dt,
                tile: (32, 32),
                dist: mgmm_stream::store::gen::Dist::Normal,
                seed: 9,
            };
            mgmm_stream::store::gen::generate(path, &s).unwrap();
        };
        let (npy, mgt) = (dir.join("G.npy"), dir.join("G.mgt"));
        spec(&npy);
        spec(&mgt);
        let bytes = std::fs::read(&npy).unwrap();
        assert_eq!(&bytes[..6], b"\x93NUMPY", "{dt:?}: not a .npy");
        assert_eq!(bytes.len(), 4096 + 70 * 45 * dt.size());
        assert_eq!(read_all(&npy).v, read_all(&mgt).v, "{dt:?}");
        for p in [&npy, &mgt] {
            std::fs::remove_file(p).unwrap();
        }
    }
}

/// A plan's `generate` writes a real `.npy` under a `.npy` name (docs/PLAN.md says so; it was
/// refused with "`generate` writes .mgt files" while `gen` wrote one), and the product read
/// from it is numpy's, element by element.
#[test]
fn a_plans_generate_writes_a_real_npy() {
    let d = tmp();
    let text = "[matrices.A]\npath = \"ta.npy\"\ngenerate = { rows = 37, cols = 21, dtype = \"f64\", seed = 3 }\n\
                [matrices.B]\npath = \"tb.npy\"\ngenerate = { rows = 21, cols = 13, dtype = \"f64\" }\n\
                [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n[engine]\nbackend = \"cpu\"\n";
    run_text(d.path(), text).unwrap();
    for (name, rows, cols) in [("ta.npy", 37, 21), ("tb.npy", 21, 13)] {
        let p = d.path().join(name);
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(&bytes[..6], b"\x93NUMPY", "{name}: not a .npy");
        assert_eq!(bytes.len(), 4096 + rows * cols * 8, "{name}");
    }
    let (a, b, c) = (
        read_all(&d.path().join("ta.npy")),
        read_all(&d.path().join("tb.npy")),
        read_all(&d.path().join("C.mgt")),
    );
    for i in 0..37 {
        for j in 0..13 {
            let want: f64 = (0..21).map(|p| a.v[i * 21 + p] * b.v[p * 13 + j]).sum();
            let scale: f64 = (0..21)
                .map(|p| (a.v[i * 21 + p] * b.v[p * 13 + j]).abs())
                .sum();
            let got = c.v[i * 13 + j];
            assert!(
                (got - want).abs() <= 24.0 * f64::EPSILON * scale,
                "({i}, {j}): {got} against {want}"
            );
        }
    }
}

/// An added matrix stored in Fortran order is refused with advice that works: rewrite it in C
/// order (the message advised declaring `order = "C"`, refused for a `.npy` and, for a raw
/// file, a silent misreading — new-user trial).
#[test]
fn a_fortran_order_added_matrix_is_refused_with_advice_that_works() {
    let d = tmp();
    write_npy(&d.path().join("A.npy"), &mat(1, 3, 4), DType::F32, false, 1);
    write_npy(&d.path().join("B.npy"), &mat(2, 4, 3), DType::F32, false, 1);
    write_npy(&d.path().join("C0.npy"), &mat(3, 3, 3), DType::F32, true, 1);
    let err = run_text(
        d.path(),
        "[matrices.A]\npath = \"A.npy\"\n[matrices.B]\npath = \"B.npy\"\n[matrices.C0]\npath = \"C0.npy\"\n\
         [[step]]\noutput = \"C.npy\"\nexpr = \"A @ B + C0\"\n[engine]\nbackend = \"cpu\"\n",
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("Fortran (column-major) order")
            && err.contains("np.ascontiguousarray(c0)")
            && err.contains("would only misread it"),
        "{err}"
    );
}
