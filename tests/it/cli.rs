//! Black-box tests of every command on real files in temp dirs, including bad input: each bad
//! case exits non-zero with one message naming the problem, never panics, and leaves its inputs
//! byte-identical.

use crate::common::*;

use std::path::Path;
use std::process::{Command, Output};

use mgmm_stream::dtype::DType;
use mgmm_stream::store::gen::Dist;
use mgmm_stream::store::npy;

fn mg(dir: &Path, args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .current_dir(dir)
        .output()
        .expect("spawn mgmm-stream")
}

fn ok(o: &Output) -> String {
    let s = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "command failed:\n{s}");
    s
}

/// Assert failure with a clean one-line message containing every `needles`.
fn fails(o: &Output, needles: &[&str]) -> String {
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!o.status.success(), "expected failure, got success:\n{err}");
    assert!(
        !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
        "panic:\n{err}"
    );
    assert!(
        err.starts_with("error: "),
        "message should start with 'error: ':\n{err}"
    );
    for n in needles {
        assert!(err.contains(n), "message should mention {n:?}:\n{err}");
    }
    err
}

fn write_npy(p: &Path, rows: u64, cols: u64, vals: &[f64], dt: DType, version: u8) {
    let mut h = npy::header_bytes(dt, rows, cols).unwrap();
    if version == 2 {
        // Rewrite as a v2 header (u32 length), padded to 64 bytes.
        let dict_start = 10;
        let dict = String::from_utf8(h[dict_start..].to_vec()).unwrap();
        let dict = dict.trim_end().to_string();
        let total = (12 + dict.len() + 1).div_ceil(64) * 64;
        let mut v = b"\x93NUMPY\x02\x00".to_vec();
        v.extend_from_slice(&((total - 12) as u32).to_le_bytes());
        v.extend_from_slice(dict.as_bytes());
        v.resize(total - 1, b' ');
        v.push(b'\n');
        h = v;
    }
    for x in vals {
        match dt {
            DType::F32 => h.extend_from_slice(&(*x as f32).to_le_bytes()),
            _ => h.extend_from_slice(&x.to_le_bytes()),
        }
    }
    std::fs::write(p, h).unwrap();
}

fn read_npy(p: &Path) -> (DType, u64, u64, Vec<f64>) {
    let bytes = std::fs::read(p).unwrap();
    let mut r = &bytes[..];
    let h = npy::read_header(p, &mut r).unwrap();
    let data = &bytes[h.data_offset as usize..];
    let v = data
        .chunks(h.dtype.size())
        .map(|c| mgmm_stream::dtype::get(h.dtype, c))
        .collect();
    (h.dtype, h.rows, h.cols, v)
}

#[test]
fn every_command_has_help_with_an_example() {
    let d = tmp();
    for c in ["gen", "info", "import", "export", "plan", "run"] {
        let s = ok(&mg(d.path(), &[c, "--help"]));
        assert!(s.contains("Example"), "{c} --help lacks an example:\n{s}");
    }
}

#[test]
fn gen_info_check_and_refuse_overwrite() {
    let d = tmp();
    let s = ok(&mg(
        d.path(),
        &[
            "gen", "A.mgt", "--rows", "100", "--cols", "37", "--tile", "32", "--seed", "3",
        ],
    ));
    assert!(s.contains("wrote A.mgt"), "{s}");
    let s = ok(&mg(d.path(), &["info", "A.mgt", "--check"]));
    assert!(
        s.contains("100 × 37")
            && s.contains("grid 4 × 2 = 8 tiles")
            && s.contains("all 8 tiles OK"),
        "{s}"
    );
    // The data line gives the values' bytes (100·37·4), the padded tiles' only beside them
    // (8 tiles of 32·32·4 = 4096 bytes: a page each).
    assert!(
        s.contains("data:        offset 4096, 14.45 KiB (14800 bytes) of values\n")
            && s.contains("32.00 KiB with the tiles' padding"),
        "{s}"
    );
    let before = digest(&d.path().join("A.mgt"));
    fails(
        &mg(d.path(), &["gen", "A.mgt", "--rows", "5", "--cols", "5"]),
        &["A.mgt", "already exists", "--force"],
    );
    assert_eq!(before, digest(&d.path().join("A.mgt")));
    // Same seed, different thread count and tile: same values.
    ok(&mg(
        d.path(),
        &[
            "gen",
            "A2.mgt",
            "--rows",
            "100",
            "--cols",
            "37",
            "--tile",
            "7",
            "--seed",
            "3",
            "--threads",
            "1",
        ],
    ));
    assert_eq!(
        Mat::load(&d.path().join("A.mgt")).v,
        Mat::load(&d.path().join("A2.mgt")).v
    );
}

#[test]
fn info_check_finds_a_corrupt_tile() {
    let d = tmp();
    ok(&mg(
        d.path(),
        &[
            "gen", "A.mgt", "--rows", "64", "--cols", "64", "--tile", "16",
        ],
    ));
    let p = d.path().join("A.mgt");
    let f = mgmm_stream::store::TiledFile::open(&p).unwrap();
    let off = f.hdr.tile_offset(1, 2) as usize + 8;
    drop(f);
    let mut b = std::fs::read(&p).unwrap();
    b[off] ^= 1;
    std::fs::write(&p, &b).unwrap();
    fails(
        &mg(d.path(), &["info", "A.mgt", "--check"]),
        &["A.mgt", "tile (1, 2)", "checksum"],
    );
}

#[test]
fn import_export_round_trip_v1_v2_f32_f64() {
    let d = tmp();
    let (r, c) = (23u64, 41u64);
    let vals: Vec<f64> = (0..r * c).map(|i| (i as f64) * 0.25 - 7.0).collect();
    for (dt, ver) in [
        (DType::F32, 1u8),
        (DType::F64, 1),
        (DType::F32, 2),
        (DType::F64, 2),
    ] {
        let src = d.path().join(format!("in_{dt}_{ver}.npy"));
        write_npy(&src, r, c, &vals, dt, ver);
        let mgt = format!("x_{dt}_{ver}.mgt");
        let out = format!("out_{dt}_{ver}.npy");
        ok(&mg(
            d.path(),
            &["import", src.to_str().unwrap(), &mgt, "--tile", "8"],
        ));
        ok(&mg(d.path(), &["export", &mgt, &out]));
        let (odt, orows, ocols, ov) = read_npy(&d.path().join(&out));
        assert_eq!((odt, orows, ocols), (dt, r, c));
        assert_eq!(ov, vals);
    }
    // 23×41 in 32² tiles (23×32 at this height): two tiles of a page each for 23·41 values;
    // said, with what helps.
    let src = d.path().join("in_f32_1.npy");
    let said = ok(&mg(
        d.path(),
        &["import", src.to_str().unwrap(), "big.mgt", "--tile", "32"],
    ));
    let said = said.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        said.contains("note: 3.68 KiB of big.mgt's 12.01 KiB hold its values: edge tiles are stored whole (23×32); a --tile that divides the shape, or one larger than it, pads less"),
        "{said}"
    );
    let said = ok(&mg(
        d.path(),
        &["import", src.to_str().unwrap(), "fit.mgt", "--tile", "64"],
    ));
    assert!(
        !said.contains("note:"),
        "one tile of 64² holds 23×41 without much padding: {said}"
    );
}

#[test]
fn import_refuses_unsupported_npy() {
    let d = tmp();
    let dir = d.path();
    let mk = |name: &str, dict: &str| {
        let mut h = b"\x93NUMPY\x01\x00".to_vec();
        let total = (10 + dict.len() + 1).div_ceil(64) * 64;
        h.extend_from_slice(&((total - 10) as u16).to_le_bytes());
        h.extend_from_slice(dict.as_bytes());
        h.resize(total - 1, b' ');
        h.push(b'\n');
        h.extend_from_slice(&[0u8; 64]);
        std::fs::write(dir.join(name), h).unwrap();
    };
    mk(
        "big.npy",
        "{'descr': '>f4', 'fortran_order': False, 'shape': (4, 4), }",
    );
    mk(
        "int.npy",
        "{'descr': '<i4', 'fortran_order': False, 'shape': (4, 4), }",
    );
    mk(
        "obj.npy",
        "{'descr': '|O', 'fortran_order': False, 'shape': (4, 4), }",
    );
    mk(
        "rank1.npy",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (16,), }",
    );
    mk(
        "short.npy",
        "{'descr': '<f8', 'fortran_order': False, 'shape': (100, 100), }",
    );
    fails(
        &mg(dir, &["import", "big.npy", "a.mgt"]),
        &["big.npy", "big-endian"],
    );
    fails(
        &mg(dir, &["import", "int.npy", "b.mgt"]),
        &["int.npy", "'<i4'", "float32"],
    );
    fails(
        &mg(dir, &["import", "obj.npy", "c.mgt"]),
        &["obj.npy", "'|O'"],
    );
    fails(
        &mg(dir, &["import", "rank1.npy", "d.mgt"]),
        &["rank1.npy", "2-D"],
    );
    fails(
        &mg(dir, &["import", "short.npy", "e.mgt"]),
        &["short.npy", "truncated"],
    );
    for f in ["a.mgt", "b.mgt", "c.mgt", "d.mgt"] {
        assert!(
            !dir.join(f).exists(),
            "{f} must not be created for a refused import"
        );
    }
}

const PLAN: &str = r#"
[matrices.A]
path = "A.mgt"
generate = { rows = 70, cols = 45, dist = "uniform", seed = 1, tile = 16 }
[matrices.B]
path = "B.mgt"
generate = { rows = 45, cols = 33, dist = "uniform", seed = 2, tile = 16 }

[[step]]
output = "C.mgt"
expr = "A @ B"

[engine]
backend = "cpu"
tile = 32
host_memory = "8MiB"
"#;

#[test]
fn plan_then_run_then_export() {
    let d = tmp();
    let dir = d.path();
    std::fs::write(dir.join("plan.toml"), PLAN).unwrap();
    let s = ok(&mg(dir, &["plan", "plan.toml"]));
    for want in [
        "70×45",
        "45×33",
        "will be generated",
        "compute tile 32×32×32",
        "output tiles",
        "host ceiling",
        "lower bound",
        "traffic",
        "output written with mmap (write = auto: a ",
        "straight from the files' pages where",
        "the staging buffers are made only for blocks staged by copy",
        "(staging = auto)",
        // No device tile cache on the CPU: its lanes walk row bands.
        "order: each lane in serpentine row bands",
    ] {
        assert!(s.contains(want), "plan output lacks {want:?}:\n{s}");
    }
    assert!(!s.contains("status:"), "nothing on disk yet:\n{s}");
    let c = ok(&mg(
        dir,
        &["plan", "plan.toml", "--set", "engine.staging=copy"],
    ));
    assert!(
        c.contains("inputs copied into the staging buffers (staging = copy)"),
        "{c}"
    );
    // An added matrix is always staged by copy, and then so are the staging buffers made.
    let with_c0 = PLAN
        .replace(
            "[[step]]",
            "[matrices.C0]\npath = \"C0.mgt\"\ngenerate = { rows = 70, cols = 33 }\n[[step]]",
        )
        .replace("A @ B", "A @ B + C0");
    std::fs::write(dir.join("plan_c0.toml"), with_c0).unwrap();
    let c = ok(&mg(dir, &["plan", "plan_c0.toml"])).replace("\n      ", " ");
    assert!(
        c.contains("C0 (the added matrix, always) staged by copy")
            && !c.contains("made only for blocks"),
        "{c}"
    );
    assert!(
        !dir.join("A.mgt").exists(),
        "plan must not generate anything"
    );
    let s = ok(&mg(dir, &["run", "plan.toml", "--report", "r.json"]));
    for want in ["generated", "GFLOP/s", "busy:", "bottleneck:", "done in"] {
        assert!(s.contains(want), "run output lacks {want:?}:\n{s}");
    }
    let rep: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("r.json")).unwrap()).unwrap();
    assert_eq!(rep["steps"][0]["m"], 70);
    assert_eq!(rep["steps"][0]["write_mode"], "mmap", "as plan said");
    assert!(rep["steps"][0]["bottleneck"].is_string());
    ok(&mg(dir, &["export", "C.mgt", "C.npy"]));
    let (_, r, c, v) = read_npy(&dir.join("C.npy"));
    assert_eq!((r, c), (70, 33));
    let a = Mat::load(&dir.join("A.mgt"));
    let b = Mat::load(&dir.join("B.mgt"));
    let (refv, mag) = reference(&a, false, &b, false, None, 1.0, 0.0, 70, 33, 45);
    for i in 0..v.len() {
        assert!(
            (v[i] - refv[i]).abs() <= 47.0 * f32::EPSILON as f64 * mag[i],
            "element {i}"
        );
    }
    // A second run of the same plan does not regenerate and succeeds.
    let s = ok(&mg(dir, &["run", "plan.toml", "--quiet"]));
    assert!(s.is_empty(), "--quiet prints nothing: {s}");
    // `plan` says what `run` would do with what is on disk: skip, resume, refuse.
    let plan = |dir| ok(&mg(dir, &["plan", "plan.toml"]));
    assert!(plan(dir).contains("status: complete: `run` skips this step"));
    let j = dir.join("C.mgt.journal");
    let len = std::fs::metadata(&j).unwrap().len();
    set_len(&j, len - 32); // the completion mark and the last tile's record
    let s = plan(dir);
    assert!(
        s.contains("status: 5 of 6 output tiles done: `run` resumes"),
        "{s}"
    );
    // A tile recorded twice (redone after a failed check) counts once.
    let mut bytes = std::fs::read(&j).unwrap();
    let last = bytes[bytes.len() - 16..].to_vec();
    bytes.extend_from_slice(&last);
    std::fs::write(&j, &bytes).unwrap();
    let s = plan(dir);
    assert!(s.contains("status: 5 of 6 output tiles done"), "{s}");
    // A record damaged in place (not torn at the end) loses its tile only, and plan says so.
    let n = bytes.len();
    bytes[n - 48 + 5] ^= 1;
    std::fs::write(&j, &bytes).unwrap();
    let s = one_line(&plan(dir));
    assert!(
        s.contains("status: 4 of 6 output tiles done")
            && s.contains(
                "1 record in the journal damaged and skipped: its tile is computed again"
            ),
        "{s}"
    );
    let o = mg(dir, &["run", "plan.toml"]);
    let r = ok(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        r.contains("4 of 6 output tiles already done")
            || err.contains("4 of 6 output tiles already done"),
        "as plan said:\n{r}{err}"
    );
    assert!(
        err.contains("1 record in the journal damaged and skipped"),
        "run says so too:\n{err}"
    );
    assert!(plan(dir).contains("status: complete"));
    let complete = std::fs::read(&j).unwrap();
    // Another plan for the same output: run refuses the journal, and plan says why first.
    let other = PLAN.replace("tile = 32", "tile = 16");
    std::fs::write(dir.join("other.toml"), other).unwrap();
    let s = ok(&mg(dir, &["plan", "other.toml"]));
    assert!(
        s.contains("is from a different plan") && s.contains("compute tile: was 32×32×32"),
        "{s}"
    );
    fails(&mg(dir, &["run", "other.toml"]), &["different plan"]);
    let bytes = std::fs::read(&j).unwrap();
    std::fs::write(&j, b"not a journal\n").unwrap();
    let s = plan(dir);
    assert!(
        s.contains("status: ./C.mgt.journal: not a journal this version understands"),
        "{s}"
    );
    std::fs::write(&j, bytes).unwrap();
    std::fs::rename(dir.join("C.mgt"), dir.join("C.keep")).unwrap();
    assert!(
        plan(dir).contains("the journal is there but ./C.mgt is not: `run` starts the step afresh")
    );
    std::fs::rename(dir.join("C.keep"), dir.join("C.mgt")).unwrap();
    let header = std::fs::read(&j).unwrap();
    let nl = header.iter().position(|&b| b == b'\n').unwrap();
    std::fs::write(&j, &header[..=nl]).unwrap();
    assert!(
        plan(dir).contains("started, no output tile recorded yet: `run` starts the step afresh")
    );
    std::fs::remove_file(&j).unwrap();
    assert!(plan(dir).contains("exists but no journal says this plan wrote it"));
    fails(&mg(dir, &["run", "plan.toml"]), &["no journal"]);
    std::fs::create_dir(dir.join("C.mgt.shards")).unwrap();
    std::fs::write(dir.join("C.mgt.shards/manifest.json"), "{}").unwrap();
    assert!(plan(dir).contains("a split run is writing ./C.mgt"));
    // Once finalized, the step's own journal is there and speaks for it.
    std::fs::write(&j, &complete).unwrap();
    assert!(plan(dir).contains("status: complete"));
    // A partial journal with a truncated output: run refuses it, and plan says so first.
    std::fs::write(&j, &complete[..complete.len() - 32]).unwrap();
    set_len(&dir.join("C.mgt"), 100);
    let s = plan(dir);
    assert!(
        s.contains("shorter than the") && s.contains("`run` refuses it"),
        "{s}"
    );
    fails(&mg(dir, &["run", "plan.toml"]), &["truncated"]);
}

/// A journal from another plan is refused before anything is computed: a chain's first part
/// (held in memory) used to run in full before its second part's journal was refused.
#[test]
fn a_foreign_journal_is_refused_before_any_part_runs() {
    let d = tmp();
    let dir = d.path();
    let plan = "[matrices.X]\npath = \"X.mgt\"\ngenerate = { rows = 90, cols = 90, seed = 3 }\n\
                [[step]]\noutput = \"D.mgt\"\nexpr = \"X @ X @ X\"\n\
                [engine]\nbackend = \"cpu\"\ntile = 32\n";
    std::fs::write(dir.join("c.toml"), plan).unwrap();
    ok(&mg(dir, &["run", "c.toml"]));
    std::fs::write(dir.join("c.toml"), plan.replace("tile = 32", "tile = 64")).unwrap();
    let err = fails(
        &mg(dir, &["run", "c.toml"]),
        &["different plan", "compute tile"],
    );
    assert!(
        !err.contains("part 1/2"),
        "no part ran before the refusal:\n{err}"
    );
    ok(&mg(dir, &["run", "c.toml", "--restart", "--quiet"]));
}

#[test]
fn bad_plans_and_files() {
    let d = tmp();
    let dir = d.path();
    ok(&mg(
        dir,
        &[
            "gen", "A.mgt", "--rows", "20", "--cols", "30", "--tile", "8",
        ],
    ));
    ok(&mg(
        dir,
        &[
            "gen", "B.mgt", "--rows", "31", "--cols", "10", "--tile", "8",
        ],
    ));
    ok(&mg(
        dir,
        &[
            "gen", "D.mgt", "--rows", "30", "--cols", "10", "--tile", "8", "--dtype", "f64",
        ],
    ));
    let inputs = ["A.mgt", "B.mgt", "D.mgt"];
    let digests: Vec<u32> = inputs.iter().map(|f| digest(&dir.join(f))).collect();
    let base = "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n[matrices.D]\npath = \"D.mgt\"\n";
    let cases: Vec<(&str, String, Vec<&str>)> = vec![
        ("shape mismatch", format!("{base}[[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n"), vec!["step 1", "line 9", "20×30", "31×10"]),
        ("unknown key", format!("{base}[[step]]\noutput = \"C.mgt\"\nexpr = \"A @ D\"\nalpha = 1.0\nbogus = 3\n"), vec!["bogus", "line"]),
        ("unknown matrix", format!("{base}[[step]]\noutput = \"C.mgt\"\nexpr = \"A @ Z\"\n"), vec!["unknown matrix `Z`"]),
        ("missing file", "[matrices.A]\npath = \"nope.mgt\"\n[[step]]\noutput = \"C.mgt\"\nexpr = \"A @ A\"\n".to_string(), vec!["matrices.A", "nope.mgt", "does not exist"]),
        ("bad expr", format!("{base}[[step]]\noutput = \"C.mgt\"\nexpr = \"A * D\"\n"), vec!["X @ Y"]),
        ("dtype mismatch", format!("{base}[[step]]\noutput = \"C.mgt\"\nexpr = \"A @ D\"\n"), vec!["f64", "f32", "same dtype"]),
        ("output is input", format!("{base}[[step]]\noutput = \"B.mgt\"\nexpr = \"A.T @ A\"\n"), vec!["B.mgt", "inputs are never overwritten"]),
        ("wrong type", format!("{base}[[step]]\noutput = \"C.mgt\"\nexpr = \"A.T @ A\"\n[engine]\nthreads = \"many\"\n"), vec!["threads"]),
        ("bad size", format!("{base}[[step]]\noutput = \"C.mgt\"\nexpr = \"A.T @ A\"\n[engine]\nhost_memory = \"lots\"\n"), vec!["engine.host_memory", "lots"]),
        ("malformed toml", "[matrices.A\npath = 1".to_string(), vec!["invalid plan"]),
        ("budget too small", format!("{base}[matrices.G]\npath = \"G.mgt\"\ngenerate = {{ rows = 2000, cols = 2000 }}\n[[step]]\noutput = \"C.mgt\"\nexpr = \"G @ G\"\n[engine]\nhost_memory = \"1MiB\"\ntile = 2048\nbackend = \"cpu\"\n"), vec!["does not fit", "host_memory"]),
    ];
    for (what, text, needles) in cases {
        std::fs::write(dir.join("p.toml"), &text).unwrap();
        for cmd in ["plan", "run"] {
            let o = mg(dir, &[cmd, "p.toml"]);
            let mut n = needles.clone();
            n.push("p.toml");
            let e = fails(&o, &n);
            assert!(
                !dir.join("C.mgt").exists(),
                "{what}: no output may be created:\n{e}"
            );
            assert!(
                !dir.join("G.mgt").exists(),
                "{what}: nothing may be generated before the plan is valid"
            );
        }
    }
    for (f, dg) in inputs.iter().zip(digests) {
        assert_eq!(digest(&dir.join(f)), dg, "{f} changed");
    }
}

#[test]
fn bad_matrix_files() {
    let d = tmp();
    let dir = d.path();
    ok(&mg(
        dir,
        &[
            "gen", "A.mgt", "--rows", "20", "--cols", "30", "--tile", "8",
        ],
    ));
    let good = std::fs::read(dir.join("A.mgt")).unwrap();
    std::fs::write(dir.join("trunc.mgt"), &good[..good.len() / 2]).unwrap();
    std::fs::write(dir.join("tiny.mgt"), &good[..10]).unwrap();
    let mut magic = good.clone();
    magic[0] = b'X';
    std::fs::write(dir.join("magic.mgt"), &magic).unwrap();
    let mut ver = good.clone();
    ver[8] = 9;
    std::fs::write(dir.join("version.mgt"), &ver).unwrap();
    let mut huge = good.clone();
    huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(dir.join("huge.mgt"), &huge).unwrap();
    let mut zero = good.clone();
    zero[24..32].copy_from_slice(&0u64.to_le_bytes());
    std::fs::write(dir.join("zero.mgt"), &zero).unwrap();
    std::fs::create_dir(dir.join("dir.mgt")).unwrap();
    let cases = [
        ("trunc.mgt", vec!["truncated"]),
        ("tiny.mgt", vec!["too short"]),
        ("magic.mgt", vec!["wrong magic"]),
        ("version.mgt", vec!["version"]),
        ("huge.mgt", vec!["overflow"]),
        ("zero.mgt", vec!["cols", "0"]),
        ("dir.mgt", vec!["not a regular file"]),
        ("missing.mgt", vec![]),
    ];
    for (f, needles) in cases {
        let before = std::fs::metadata(dir.join(f))
            .ok()
            .map(|_| std::fs::read(dir.join(f)).ok());
        let mut n = needles.clone();
        n.push(f);
        fails(&mg(dir, &["info", f]), &n);
        fails(&mg(dir, &["export", f, "x.npy"]), &n);
        let plan = format!(
            "[matrices.A]\npath = \"{f}\"\n[[step]]\noutput = \"C.mgt\"\nexpr = \"A.T @ A\"\n"
        );
        std::fs::write(dir.join("p.toml"), plan).unwrap();
        fails(&mg(dir, &["run", "p.toml"]), &n);
        let after = std::fs::metadata(dir.join(f))
            .ok()
            .map(|_| std::fs::read(dir.join(f)).ok());
        assert_eq!(before, after, "{f} changed");
        assert!(!dir.join("x.npy").exists());
    }
}

#[test]
fn plan_of_a_million_squared_answers_in_under_a_second() {
    let d = tmp();
    let dir = d.path();
    let text = "[matrices.A]\npath = \"A.mgt\"\ngenerate = { rows = 1000000, cols = 1000000 }\n\
                [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ A.T\"\n[engine]\nbackend = \"cpu\"\n";
    std::fs::write(dir.join("p.toml"), text).unwrap();
    // Default tile and a small one (2.4e8 output tiles): the traffic model is closed-form.
    for set in ["engine.tile=auto", "engine.tile=64"] {
        let t = std::time::Instant::now();
        let s = ok(&mg(dir, &["plan", "p.toml", "--set", set]));
        let took = t.elapsed().as_secs_f64();
        assert!(took < 1.0, "{set}: plan took {took:.2} s:\n{s}");
        assert!(
            s.contains("1000000×1000000") && s.contains("lower bound"),
            "{s}"
        );
        // What `run` would refuse before any work (disk space for the 4 TB input it would
        // generate), said by `plan`, which writes nothing; sizes as sizes.
        let flat = one_line(&s);
        assert!(
            flat.contains("warning: `run` will refuse to start: not enough disk space")
                && flat.contains("elements) per lane")
                && !flat.contains(" words per lane"),
            "{s}"
        );
        let left: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, ["p.toml"], "plan wrote nothing");
    }
}

#[test]
fn set_overrides_engine_keys_on_plan_run_and_verify() {
    let d = tmp();
    let dir = d.path();
    let text = "[matrices.A]\npath = \"A.mgt\"\ngenerate = { rows = 40, cols = 30, seed = 1 }\n\
                [[step]]\noutput = \"C.mgt\"\nexpr = \"0.5 * A @ A.T\"\n\
                [engine]\nbackend = \"cpu\"\nhost_memory = \"lots\"\n";
    std::fs::write(dir.join("p.toml"), text).unwrap();
    // The file's bad value names its line; --set replaces it before validation.
    fails(
        &mg(dir, &["plan", "p.toml"]),
        &["p.toml", "engine.host_memory (line 9)", "lots"],
    );
    let s = ok(&mg(
        dir,
        &[
            "plan",
            "p.toml",
            "--set",
            "engine.host_memory=16MiB",
            "--set",
            "engine.tile=16",
        ],
    ));
    assert!(
        s.contains("compute tile 16×16×16") && s.contains("16.00 MiB"),
        "{s}"
    );
    // Same validation and messages as the file, naming the argument.
    let e = fails(
        &mg(dir, &["plan", "p.toml", "--set", "engine.host_memory=abc"]),
        &["--set engine.host_memory=abc", "not a size"],
    );
    assert!(!e.contains("lots"), "{e}");
    fails(
        &mg(dir, &["run", "p.toml", "--set", "engine.warp=9"]),
        &["--set engine.warp=9", "warp"],
    );
    fails(
        &mg(dir, &["verify", "p.toml", "--set", "matrices.A.path=B.mgt"]),
        &["only [engine] keys"],
    );
    ok(&mg(
        dir,
        &["run", "p.toml", "--set", "engine.host_memory=16MiB", "-q"],
    ));
    ok(&mg(
        dir,
        &["verify", "p.toml", "--set", "engine.host_memory=16MiB"],
    ));
}

/// Every line of `o`'s stdout and stderr, with the command, for the 80-column check.
fn lines_of(what: &str, o: &Output) -> Vec<(String, String)> {
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    (out.lines().chain(err.lines()))
        .map(|l| (what.to_string(), l.to_string()))
        .collect()
}

/// What `run`, `plan`, `verify` and `info` print when they succeed fits an 80-column terminal
/// (characters, not bytes: × is one), on a plan with several steps, a chain, an added matrix
/// and generated inputs, on the CPU backend and on the simulated four-lane one (per-device
/// lines); verify's FAIL text too (a report with many failing tiles).
#[test]
fn end_of_command_text_fits_80_columns() {
    let plan = |backend: &str, chain: &str| {
        format!(
            "[matrices.A]\npath = \"A.mgt\"\ngenerate = {{ rows = 300, cols = 200 }}\n\
             [matrices.B]\npath = \"B.mgt\"\ngenerate = {{ rows = 200, cols = 250 }}\n\
             [matrices.E]\npath = \"E.mgt\"\ngenerate = {{ rows = 250, cols = 40 }}\n\
             [matrices.C0]\npath = \"C0.mgt\"\ngenerate = {{ rows = 250, cols = 200, dist = \"uniform\" }}\n\
             [[step]]\noutput = \"AB.mgt\"\nexpr = \"A @ B\"\nname = \"AB\"\n\
             [[step]]\noutput = \"D.mgt\"\nexpr = \"-1.5 * AB.T @ A + 0.5 * C0\"\n\
             {chain}[engine]\nbackend = \"{backend}\"\ntile = 64\nhost_memory = \"8MiB\"\n\
             durable = false\n"
        )
    };
    // A chain (its `plan` text has lines of its own); verify cannot check a chain's output
    // once its intermediate is gone, so that plan is planned and run, not verified.
    let chain = "[[step]]\noutput = \"F.mgt\"\nexpr = \"A @ B @ E\"\n";
    let mut lines = Vec::new();
    for backend in ["cpu", "sim"] {
        let d = tmp();
        let dir = d.path();
        std::fs::write(dir.join("p.toml"), plan(backend, "")).unwrap();
        std::fs::write(dir.join("q.toml"), plan(backend, chain)).unwrap();
        for args in [
            &["plan", "q.toml"][..],
            &["run", "q.toml"],
            &["plan", "p.toml"],
            &["run", "p.toml"],
            &["verify", "p.toml"],
            &["run", "p.toml", "--restart", "--verify"],
            &["info", "--check", "D.mgt"],
            &["info", "AB.mgt"],
        ] {
            let o = mg(dir, args);
            ok(&o);
            lines.extend(lines_of(&format!("{backend}: {}", args.join(" ")), &o));
        }
    }
    let fail = mgmm_stream::verify::VerifyReport {
        step: 12,
        output: "out/C.mgt".into(),
        rounds: 2,
        pass: false,
        reason: None,
        max_ratio: 1.234e5,
        max_sigmas: 9.9e5,
        worst_row: 123_456_789,
        residual: 1.5e3,
        allowed: 1.2e-2,
        certainly_wrong: true,
        failing_cells: 40,
        failing_tiles: (0..40).map(|i| (1000 + i, 2000 + 3 * i)).collect(),
        corrupt_tiles: 0,
        corrupt_input: None,
        inputs_unchecked: vec!["in/A.mgt".into()],
        inputs_without_checksums: vec!["in/B.npy".into()],
        damaged_output: None,
        tile_shape: (4096, 4096),
        unexpected_nonfinite: 7,
        skipped_cells: 3,
        set_aside: mgmm_stream::verify::SetAside {
            rows: 12,
            first_rows: vec![100_000_001, 100_000_002, 100_000_003, 100_000_004, 5, 6, 7, 8],
            rows_in: "some/rather/long/folder/name/for/the/inputs/of/this/job/A.mgt".into(),
            rows_transposed: true,
            columns: 1,
            first_columns: vec![123_456_789],
            columns_in: "in/B.npy".into(),
            columns_transposed: false,
            c0_cells: 2,
            overflow_cells: 1,
            of: (200_000_000, 300_000_000),
            rounded_to_fp16: false,
        },
        cells: 40,
        componentwise: None,
        device: "cuda:0 NVIDIA H200".into(),
        device_note: Some("cuda:1 NVIDIA H200 was not used after an error (verify: its sums of the first band of in/A.mgt differ from the CPU's: row 17, group 3, round 1: 1.5e3 against 1.2e3); the check ran on the CPU".into()),
        seconds: 12.5,
        product_unused: None,
    };
    let text = mgmm_stream::verify::format(&fail);
    assert!(
        text.starts_with("verify step 12 (out/C.mgt): FAIL") && text.contains("(1000, 2000)"),
        "{text}"
    );
    let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        flat.contains("output rows 100000001, 100000002, 100000003, 100000004, 5, 6, 7, 8 and 4 more (some/rather/long/folder/name/for/the/inputs/of/this/job/A.mgt holds NaN/Inf in the same columns: the step reads it transposed); output column 123456789 (in/B.npy holds NaN/Inf in the same column); 2 row group(s) of other rows where C0 holds NaN/Inf; 1 row group(s) where")
            && flat.contains("note: in/B.npy has no stored checksums: a change to it since the run that kept its size and modification time would fail this test the same way"),
        "{flat}"
    );
    lines.extend(
        text.lines()
            .map(|l| ("verify FAIL".to_string(), l.to_string())),
    );
    let corrupt = mgmm_stream::verify::VerifyReport {
        corrupt_tiles: 40,
        ..fail.clone()
    };
    let text = mgmm_stream::verify::format(&corrupt);
    assert!(
        text.contains("40 tile(s) no longer match") && text.contains("(1000, 2000)"),
        "{text}"
    );
    lines.extend(
        text.lines()
            .map(|l| ("verify corrupt".to_string(), l.to_string())),
    );
    let all: String = lines.iter().map(|(_, l)| format!("{l}\n")).collect();
    for want in [
        "busy:",
        "bottleneck:",
        "host ceiling",
        "PASS",
        "done in",
        "chain:",
    ] {
        assert!(all.contains(want), "no {want:?} in:\n{all}");
    }
    let long: Vec<String> = lines
        .iter()
        .filter(|(_, l)| l.chars().count() > 80)
        .map(|(w, l)| format!("{w}: {} chars: {l}", l.chars().count()))
        .collect();
    assert!(
        long.is_empty(),
        "lines wider than 80 columns:\n{}",
        long.join("\n")
    );
}

/// The journal names inputs by their canonical paths: the same plan reached from another
/// working directory, or by another spelling of its path, is the same job — a complete output
/// is recognised as complete, resumes would continue, and `verify` passes.
#[test]
fn journal_does_not_depend_on_the_working_directory() {
    let d = tmp();
    let dir = d.path();
    std::fs::create_dir_all(dir.join("job/data")).unwrap();
    gen(
        &dir.join("job/data/A.mgt"),
        67,
        45,
        DType::F32,
        (16, 16),
        Dist::Normal,
        1,
    );
    gen(
        &dir.join("job/data/B.mgt"),
        45,
        38,
        DType::F32,
        (16, 16),
        Dist::Normal,
        2,
    );
    std::fs::write(
        dir.join("job/plan.toml"),
        "[matrices.A]\npath = \"data/A.mgt\"\n[matrices.B]\npath = \"data/B.mgt\"\n\
         [[step]]\noutput = \"data/C.mgt\"\nexpr = \"A @ B\"\n[engine]\nbackend = \"cpu\"\n",
    )
    .unwrap();
    ok(&mg(dir, &["run", "job/plan.toml"]));
    let again = mg(&dir.join("job"), &["run", "plan.toml"]);
    let err = String::from_utf8_lossy(&again.stderr).to_string();
    assert!(again.status.success(), "{err}");
    assert!(err.contains("already complete"), "{err}");
    let abs = dir.join("job/../job/plan.toml");
    let v = mg(Path::new("/"), &["verify", abs.to_str().unwrap()]);
    assert!(ok(&v).contains("PASS"), "{}", ok(&v));
}

/// An output that overflows its precision is not silent (issue 33, item 3): `alpha = 3e38` on
/// normal f32 data makes most of the output ±Inf from finite inputs. The run's summary and its
/// `--report` count the non-finite elements and name the likely cause; `verify`, which can
/// check none of it, exits 3 (not 0) and says why and what to do.
#[test]
fn an_overflowing_output_is_counted_and_verify_exits_3() {
    let d = tmp();
    let dir = d.path();
    let text = "[matrices.A]\npath = \"A.mgt\"\ngenerate = { rows = 100, cols = 50, dist = \"normal\", seed = 1 }\n\
                [matrices.B]\npath = \"B.mgt\"\ngenerate = { rows = 50, cols = 70, dist = \"normal\", seed = 2 }\n\
                [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\nalpha = 3e38\n\
                [engine]\nbackend = \"cpu\"\nprecision = \"fp32\"\n";
    std::fs::write(dir.join("p.toml"), text).unwrap();
    let s = ok(&mg(dir, &["run", "p.toml", "--report", "r.json"]));
    let (_, _, c) = load(&dir.join("C.mgt"));
    let inf = c.iter().filter(|v| !v.is_finite()).count() as u64;
    assert!(inf > 3000, "most of the 7000 elements overflow: {inf}");
    let flat = one_line(&s);
    assert!(
        flat.contains(&format!("{inf} of the 7000 output elements are NaN/Inf"))
            && flat.contains("the inputs are all finite")
            && flat.contains("overflow")
            && flat.contains("alpha")
            && flat.contains("fp64"),
        "{s}"
    );
    let rep: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("r.json")).unwrap()).unwrap();
    assert_eq!(rep["steps"][0]["nonfinite_outputs"], inf, "{rep}");
    assert_eq!(rep["steps"][0]["nonfinite_inputs"], 0);
    assert_eq!(
        rep["steps"][0]["first_nonfinite_tile"],
        serde_json::json!([0, 0])
    );

    let o = mg(dir, &["verify", "p.toml"]);
    let out = String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(3), "{out}\n{err}");
    assert!(
        out.contains("NOT CHECKED") && !out.contains("PASS") && out.contains("fp64"),
        "{out}"
    );
    assert!(
        err.starts_with("error: ") && err.contains("nothing") && err.contains("./C.mgt"),
        "{err}"
    );
    // A plan whose output is finite still verifies with 0.
    let fine = text.replace("alpha = 3e38\n", "");
    std::fs::write(dir.join("p.toml"), fine).unwrap();
    ok(&mg(dir, &["run", "p.toml", "--restart", "-q"]));
    ok(&mg(dir, &["verify", "p.toml"]));
}

/// `plan` names what it means (issue 33's small things): an fp64 rate is faer's f64 rate; a
/// chain's shapes use the plan's own operand names (`op(A)`, `op(B)`, `C` collided with a plan's
/// A, B and C); an intermediate held in memory is `T1 (held in memory)`, not a file that never
/// exists; a path that climbs out of the plan's folder prints as given, without `./`.
#[test]
fn plan_text_names_rates_operands_intermediates_and_paths_as_they_are() {
    let d = tmp();
    let dir = d.path();
    std::fs::create_dir_all(dir.join("sub/dir")).unwrap();
    let text = "[matrices.A]\npath = \"A.mgt\"\ngenerate = { rows = 300, cols = 10, seed = 1 }\n\
                [matrices.B]\npath = \"B.mgt\"\ngenerate = { rows = 10, cols = 10, seed = 2 }\n\
                [matrices.C]\npath = \"C.mgt\"\ngenerate = { rows = 10, cols = 200, seed = 3 }\n\
                [[step]]\noutput = \"D.mgt\"\nexpr = \"A @ B @ C\"\n\
                [engine]\nbackend = \"cpu\"\n";
    std::fs::write(dir.join("p.toml"), text).unwrap();
    let s = ok(&mg(dir, &["plan", "p.toml"]));
    let flat = one_line(&s);
    assert!(!flat.contains("op(A)") && !flat.contains("op(B)"), "{s}");
    assert!(
        flat.contains("shapes: B 10×10 @ C 10×200 → T1 10×200")
            && flat.contains("shapes: A 300×10 @ T1 10×200 → ./D.mgt 300×200"),
        "{s}"
    );
    assert!(
        flat.contains("step 1 (line 12), part 1/2 of A @ B @ C: T1 (held in memory) = B @ C")
            && !flat.contains("D.mgt.part1.mgt ="),
        "{s}"
    );
    let r = ok(&mg(dir, &["run", "p.toml"]));
    assert!(
        !r.contains("part1.mgt") && r.contains("T1 (held in memory)"),
        "{r}"
    );
    // f64 inputs: fp64, at faer's f64 rate.
    let f64_plan = text
        .replace("seed = 1 }", "seed = 1, dtype = \"f64\" }")
        .replace("seed = 2 }", "seed = 2, dtype = \"f64\" }")
        .replace("seed = 3 }", "seed = 3, dtype = \"f64\" }")
        .replace("A.mgt", "A64.mgt")
        .replace("B.mgt", "B64.mgt")
        .replace("C.mgt", "C64.mgt")
        .replace("D.mgt", "D64.mgt");
    std::fs::write(dir.join("p64.toml"), f64_plan).unwrap();
    let s = ok(&mg(dir, &["plan", "p64.toml"]));
    let flat = one_line(&s);
    assert!(
        flat.contains("fp64")
            && flat.contains("faer's f64 rate")
            && !flat.contains("faer's f32 rate"),
        "{s}"
    );
    // fp64_emulated on a small step: a rate in the unit that shows it (it printed "0.0
    // TFLOP/s"), from the moduli of this step's block depth (it assumed k = 1024).
    let emu = "[matrices.A]\npath = \"A64.mgt\"\n\
               generate = { rows = 300, cols = 10, dtype = \"f64\" }\n\
               [matrices.B]\npath = \"B64.mgt\"\n\
               generate = { rows = 10, cols = 10, dtype = \"f64\" }\n\
               [[step]]\noutput = \"E.mgt\"\nexpr = \"A @ B\"\n\
               [engine]\nbackend = \"cpu\"\nprecision = \"fp64_emulated\"\n";
    std::fs::write(dir.join("emu.toml"), emu).unwrap();
    let s = ok(&mg(dir, &["plan", "emu.toml"]));
    let flat = one_line(&s);
    assert!(
        !flat.contains(" 0.0 TFLOP/s")
            && flat.contains("GFLOP/s (faer's f64 rate")
            && flat.contains("as deep as this step's blocks")
            && !flat.contains("k = 1024"),
        "{s}"
    );
    // A plan in the current folder whose paths climb out of it.
    let up = "[matrices.A]\npath = \"../../A.mgt\"\n[[step]]\noutput = \"../../x.npy\"\n\
              expr = \"A @ A.T\"\n[engine]\nbackend = \"cpu\"\n";
    std::fs::write(dir.join("sub/dir/up.toml"), up).unwrap();
    let s = ok(&mg(&dir.join("sub/dir"), &["plan", "up.toml"]));
    assert!(
        s.contains("../../A.mgt") && s.contains("../../x.npy = A @ A.T") && !s.contains(" ./../"),
        "{s}"
    );
}

/// A `--set` value of the wrong kind names the key, the value and what the key takes, in
/// words (it answered "invalid type: string \"-1\", expected usize"); so does the plan file.
#[test]
fn a_bad_engine_value_is_answered_in_words() {
    let d = tmp();
    let dir = d.path();
    let text = "[matrices.A]\npath = \"A.mgt\"\ngenerate = { rows = 40, cols = 30, seed = 1 }\n\
                [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ A.T\"\n[engine]\nbackend = \"cpu\"\n";
    std::fs::write(dir.join("p.toml"), text).unwrap();
    let e = fails(
        &mg(dir, &["plan", "p.toml", "--set", "engine.threads=-1"]),
        &[
            "--set engine.threads=-1",
            "engine.threads takes a whole number",
            "not -1",
        ],
    );
    assert!(!e.contains("usize") && !e.contains("invalid type"), "{e}");
    let e = fails(
        &mg(dir, &["plan", "p.toml", "--set", "engine.durable=maybe"]),
        &["engine.durable takes true or false", "not maybe"],
    );
    assert!(!e.contains("boolean"), "{e}");
    std::fs::write(dir.join("q.toml"), format!("{text}threads = -1\n")).unwrap();
    let e = fails(
        &mg(dir, &["plan", "q.toml"]),
        &["line 9", "threads = -1", "a whole number, 0 or more"],
    );
    assert!(!e.contains("usize"), "{e}");
    // A key that takes no 0 asks for 1 or more (`rows = -1` was answered "0 or more", and
    // `rows = 0` then refused: a trial), inline tables included; one that takes 0 says so.
    let bad = text.replace("rows = 40", "rows = -1");
    std::fs::write(dir.join("r.toml"), &bad).unwrap();
    let e = fails(
        &mg(dir, &["plan", "r.toml"]),
        &["line 3", "rows = -1", "a whole number, 1 or more"],
    );
    assert!(!e.contains("0 or more"), "{e}");
    std::fs::write(dir.join("s.toml"), text.replace("seed = 1", "seed = -1")).unwrap();
    fails(
        &mg(dir, &["plan", "s.toml"]),
        &["seed = -1", "a whole number, 0 or more"],
    );
}

/// A step that no plan file's line holds (the Python package's `plan(a, b)` of a `matmul`, a
/// plan given as a dict: line 0) is named without a line; `plan` said `line 0`.
#[test]
fn a_step_without_a_plan_line_is_named_without_one() {
    let d = tmp();
    let dir = d.path();
    let text = "[matrices.A]\npath = \"A.mgt\"\ngenerate = { rows = 40, cols = 30, seed = 1 }\n\
                [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ A.T\"\n[engine]\nbackend = \"cpu\"\n";
    std::fs::write(dir.join("p.toml"), text).unwrap();
    let mut p = mgmm_stream::plan::Plan::load(&dir.join("p.toml")).unwrap();
    assert!(mgmm_stream::run::describe(&p)
        .unwrap()
        .contains("step 1 (line 6): "));
    p.steps[0].line = 0;
    let s = mgmm_stream::run::describe(&p).unwrap();
    assert!(s.contains("step 1: ") && !s.contains("line 0"), "{s}");
}

/// `precision = "fp64_emulated"`: `plan` shows the moduli setting and the predicted cost (N + 1
/// integer GEMMs per block), the run's summary the moduli used and the fallback tiles, and a
/// forced count shows as such.
#[test]
fn fp64_emulated_in_plan_and_summary() {
    let d = tmp();
    let dir = d.path();
    let text = PLAN
        .replace(
            "seed = 1, tile = 16 }",
            "seed = 1, tile = 16, dtype = \"f64\" }",
        )
        .replace(
            "seed = 2, tile = 16 }",
            "seed = 2, tile = 16, dtype = \"f64\" }",
        )
        .replace(
            "backend = \"cpu\"",
            "backend = \"cpu\"\nprecision = \"fp64_emulated\"",
        );
    std::fs::write(dir.join("plan.toml"), text).unwrap();
    // The output wrapped at 80 columns, read as one line.
    let flat = |s: String| one_line(&s);
    let s = flat(ok(&mg(dir, &["plan", "plan.toml"])));
    for want in [
        "fp64 emulated with exact integer GEMMs",
        "emulation: moduli auto (the fewest within the accuracy bound",
        "integer GEMMs per block",
        "emulation.fallback_tiles",
    ] {
        assert!(s.contains(want), "plan output lacks {want:?}:\n{s}");
    }
    let s = flat(ok(&mg(
        dir,
        &["plan", "plan.toml", "--set", "engine.emulation_moduli=12"],
    )));
    assert!(
        s.contains("emulation: moduli 12 (forced); 13 integer GEMMs per block"),
        "{s}"
    );
    let s = flat(ok(&mg(dir, &["run", "plan.toml"])));
    assert!(
        s.contains("emulation (moduli auto): ") && s.contains("fallback_tiles 0 (native fp64)"),
        "{s}"
    );
}

/// `backend = "cuda"` where no GPU can be used: the error names the setting and the way out
/// (a new user's named neither). On a machine with a GPU the plan simply resolves.
#[test]
fn backend_cuda_without_a_gpu_names_the_setting_and_the_way_out() {
    let d = tmp();
    let dir = d.path();
    let text = "[matrices.A]\npath = \"A.mgt\"\ngenerate = { rows = 40, cols = 30 }\n\
                [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ A.T\"\n[engine]\nbackend = \"cuda\"\n";
    std::fs::write(dir.join("p.toml"), text).unwrap();
    let o = mg(dir, &["plan", "p.toml"]);
    if o.status.success() {
        return; // a GPU here
    }
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("engine.backend = \"cuda\"") && e.contains("backend = \"auto\""),
        "{e}"
    );
}

/// An `n`×`n` A.npy and p.toml computing C.npy = A @ A on the CPU in tiles of `tile`.
fn a_times_a(dir: &Path, n: u64, tile: u64) {
    ok(&mg(
        dir,
        &[
            "gen",
            "A.npy",
            "--rows",
            &n.to_string(),
            "--cols",
            &n.to_string(),
        ],
    ));
    std::fs::write(
        dir.join("p.toml"),
        format!(
            "[matrices.A]\npath = \"A.npy\"\n[[step]]\noutput = \"C.npy\"\nexpr = \"A @ A\"\n\
             [engine]\nbackend = \"cpu\"\ntile = {tile}\n"
        ),
    )
    .unwrap();
}

/// A compute tile far too small for the matrix is run, but `plan` and `run` say what it costs
/// and what to set (`tile = 7` was accepted without a word: a new user's trial); the small
/// tiles of small matrices, as the tests use, draw no warning.
#[test]
fn a_tiny_tile_is_warned_about() {
    let d = tmp();
    let dir = d.path();
    a_times_a(dir, 300, 7);
    let want = "engine.tile makes 79507 GEMM calls of 7×7×7";
    let words = |s: String| s.split_whitespace().collect::<Vec<_>>().join(" ");
    let plan = words(ok(&mg(dir, &["plan", "p.toml"])));
    assert!(
        plan.contains(&format!("warning: step 1 (line 5): {want}")),
        "{plan}"
    );
    let run = words(ok(&mg(dir, &["run", "p.toml"])));
    assert!(
        run.contains(want) && run.contains("leave engine.tile out"),
        "{run}"
    );
    let plan = ok(&mg(dir, &["plan", "p.toml", "--set", "engine.tile=64"]));
    assert!(!plan.contains("warning"), "{plan}");
    // Threads far above the cores draw a warning too (a new user's trial: 1024 on 2 cores).
    let cores = std::thread::available_parallelism().unwrap().get();
    let many = format!("engine.threads={}", 4 * cores + 1);
    let plan = words(ok(&mg(
        dir,
        &["plan", "p.toml", "--set", "engine.tile=64", "--set", &many],
    )));
    let want = format!(
        "warning: engine.threads = {} is more than four times the {cores} cores",
        4 * cores + 1
    );
    assert!(plan.contains(&want), "{plan}");
    let plan = ok(&mg(
        dir,
        &[
            "plan",
            "p.toml",
            "--set",
            "engine.tile=64",
            "--set",
            &format!("engine.threads={}", 4 * cores),
        ],
    ));
    assert!(!plan.contains("warning"), "{plan}");
    // A run that finds the step complete computes nothing, so it warns about neither (a
    // trial saw the threads warning on such a run).
    let again = words(ok(&mg(dir, &["run", "p.toml", "--set", &many])));
    assert!(
        !again.contains("warning") && !again.contains("GEMM calls of 7×7×7"),
        "{again}"
    );
    // Nor does a finished chain, whose intermediate step has no journal of its own.
    std::fs::write(
        dir.join("chain.toml"),
        "[matrices.A]\npath = \"A.npy\"\n[[step]]\noutput = \"D.npy\"\nexpr = \"A @ A @ A\"\n\
         [engine]\nbackend = \"cpu\"\ntile = 64\n",
    )
    .unwrap();
    let first = words(ok(&mg(dir, &["run", "chain.toml", "--set", &many])));
    assert!(first.contains("warning: engine.threads"), "{first}");
    let again = words(ok(&mg(dir, &["run", "chain.toml", "--set", &many])));
    assert!(!again.contains("warning"), "{again}");
    // A `.mgt` output whose storage tiles are mostly padding (each starts on a 4 KiB page) is
    // warned about with what the file will take (a new user's trial: `tile = 7` made a 117 KiB
    // output 2.5 MiB), after the calls' warning or alone where only the step's `tile` is small.
    let mgt = |tiles: &str| {
        let toml = format!(
            "[matrices.A]\npath = \"A.npy\"\n[[step]]\noutput = \"C.mgt\"\nexpr = \"A @ A\"\n{tiles}"
        );
        std::fs::write(dir.join("m.toml"), toml).unwrap();
        words(ok(&mg(dir, &["plan", "m.toml"])))
    };
    let both = mgt("[engine]\nbackend = \"cpu\"\ntile = 7\n");
    let pad = "each 7×7 storage tile of ./C.mgt takes 4.00 KiB on disk for 196 B of values, so the file takes 7.23 MiB (21× its values);";
    let set =
        "set the step's `tile` (the output's storage tile, e.g. 1024) or a larger engine.tile";
    let raise = "raise the step's `tile` (the output's storage tile, now 7), e.g. to 1024";
    assert!(
        both.contains("7×7×7, far below") && both.contains(&format!("; and {pad} {set}")),
        "{both}"
    );
    let alone = mgt("tile = 7\n[engine]\nbackend = \"cpu\"\ntile = 64\n");
    assert!(
        alone.contains(&format!("warning: step 1 (line 5): {pad} {raise}")),
        "{alone}"
    );
    assert!(!alone.contains("GEMM calls of"), "{alone}");
    let fine = mgt("tile = 64\n[engine]\nbackend = \"cpu\"\ntile = 64\n");
    assert!(!fine.contains("warning"), "{fine}");
    // Whole edge tiles: 300² in 256² tiles stores 512² (over 1 MiB for 352 KiB of values).
    let edges = mgt("tile = 256\n[engine]\nbackend = \"cpu\"\ntile = 64\n");
    assert!(edges.contains("warning: step 1 (line 5): 351.56 KiB of ./C.mgt's 1.00 MiB hold its values: edge tiles are stored whole (256×256); the step's `tile` (the output's storage tile) dividing the shape"), "{edges}");
    // Not for the compute tile's own edges (the layout's choice): engine.tile = 256 alone.
    let own = mgt("[engine]\nbackend = \"cpu\"\ntile = 256\n");
    assert!(!own.contains("edge tiles"), "{own}");
    // `gen` says so too, for the `.mgt` it writes (a trial: `gen --tile 7` was silent).
    let g = |tile: &str| {
        let o = mg(
            dir,
            &[
                "gen", "G.mgt", "--rows", "300", "--cols", "300", "--tile", tile, "--force",
            ],
        );
        words(String::from_utf8_lossy(&o.stderr).into_owned())
    };
    let g7 = g("7");
    assert!(g7.contains("note: each 7×7 storage tile of G.mgt takes 4.00 KiB on disk for 196 B of values, so the file takes 7.23 MiB (21× its values); give --tile 64 or more"), "{g7}");
    assert!(!g("64").contains("note"));
}

/// A finished step with a set tile is skipped under a budget that tile no longer fits (it was
/// refused with "the requested tile does not fit": a new user's trial); unfinished, it is
/// refused as before.
#[test]
fn a_finished_step_with_a_set_tile_is_skipped_under_a_smaller_budget() {
    let d = tmp();
    let dir = d.path();
    a_times_a(dir, 600, 256);
    ok(&mg(dir, &["run", "p.toml", "-q"]));
    let small = "engine.host_memory=\"1MiB\"";
    let run = ok(&mg(dir, &["run", "p.toml", "--set", small]));
    assert!(run.contains("already complete"), "{run}");
    std::fs::remove_file(dir.join("C.npy")).unwrap();
    fails(
        &mg(dir, &["run", "p.toml", "--set", small]),
        &["the requested tile (256×256×256) does not fit"],
    );
}
