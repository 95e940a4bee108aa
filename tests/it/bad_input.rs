//! The catalogue of bad input. Every case: non-zero exit, exactly one line of message that names
//! the file, key, step or tile and what to do, no panic or backtrace, and every input file
//! byte-identical afterwards.

use crate::common::*;

use std::path::Path;
use std::process::Command;

use mgmm_stream::dtype::DType;
use mgmm_stream::store::gen::Dist;

const GOOD: &str = "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n[matrices.D]\npath = \"D.mgt\"\n";

fn setup(dir: &Path) {
    small_inputs(dir);
    gen(
        &dir.join("D.mgt"),
        30,
        10,
        DType::F64,
        (8, 8),
        Dist::Normal,
        3,
    );
}

/// Rewrite a copy of A.mgt with `f` applied to its bytes, as `name`.
fn mutated(dir: &Path, name: &str, f: impl Fn(&mut Vec<u8>)) {
    let mut b = std::fs::read(dir.join("A.mgt")).unwrap();
    f(&mut b);
    std::fs::write(dir.join(name), b).unwrap();
}

fn plan_with(dir: &Path, text: &str) {
    std::fs::write(dir.join("p.toml"), text).unwrap();
}

fn step(expr: &str) -> String {
    format!("{GOOD}[[step]]\noutput = \"C.mgt\"\nexpr = \"{expr}\"\n")
}

fn uses(file: &str) -> String {
    format!("[matrices.X]\npath = \"{file}\"\n[[step]]\noutput = \"C.mgt\"\nexpr = \"X.T @ X\"\n")
}

struct Case {
    name: &'static str,
    prep: Box<dyn Fn(&Path)>,
    args: Vec<&'static str>,
    needles: Vec<&'static str>,
}

fn case(
    name: &'static str,
    prep: impl Fn(&Path) + 'static,
    args: &[&'static str],
    needles: &[&'static str],
) -> Case {
    Case {
        name,
        prep: Box::new(prep),
        args: args.to_vec(),
        needles: needles.to_vec(),
    }
}

fn plan_case(name: &'static str, text: String, needles: &[&'static str]) -> Case {
    case(
        name,
        move |d| plan_with(d, &text),
        &["run", "p.toml"],
        needles,
    )
}

fn header_case(
    name: &'static str,
    file: &'static str,
    f: fn(&mut Vec<u8>),
    needles: &[&'static str],
) -> Case {
    case(
        name,
        move |d| {
            mutated(d, file, f);
            plan_with(d, &uses(file));
        },
        &["run", "p.toml"],
        needles,
    )
}

#[test]
fn catalogue_of_bad_input() {
    let cases = vec![
        plan_case("malformed TOML", "[matrices.A\npath = 1".into(), &["p.toml", "invalid plan"]),
        plan_case("unknown top-level key", format!("{GOOD}colour = \"blue\"\n"), &["p.toml", "colour"]),
        plan_case("unknown engine key", format!("{}[engine]\nthreds = 2\n", step("A @ B")), &["p.toml", "threds"]),
        plan_case("unknown step key", format!("{GOOD}[[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\nalpah = 2.0\n"), &["p.toml", "alpah"]),
        plan_case("wrong type: threads", format!("{}[engine]\nthreads = \"many\"\n", step("A @ B")), &["p.toml", "threads"]),
        plan_case("wrong type: alpha", format!("{GOOD}[[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\nalpha = \"one\"\n"), &["p.toml", "alpha"]),
        plan_case("unknown matrix", step("A @ Z"), &["p.toml", "step 1", "unknown matrix `Z`"]),
        plan_case("bad expression", step("A * B"), &["p.toml", "step 1", "X @ Y"]),
        plan_case("shape mismatch", step("A @ A"), &["p.toml", "step 1", "20×30", "inner dimensions"]),
        // Named as written, not as the transposed product is computed (B.T @ A @ A.T).
        plan_case("shape mismatch in a transposed product", step("(A @ A.T @ B).T"), &["p.toml", "A.T is 30×20 but B is 30×10 (inner dimensions 20 ≠ 30)"]),
        plan_case("dtype mismatch", step("A @ D"), &["p.toml", "`D` is f64", "same dtype"]),
        plan_case("accumulate shape", format!("{GOOD}[[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\naccumulate = \"A\"\n"), &["p.toml", "accumulate", "20×10"]),
        plan_case("beta without accumulate", format!("{GOOD}[[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\nbeta = 2.0\n"), &["p.toml", "beta", "accumulate"]),
        plan_case("output is an input", format!("{GOOD}[[step]]\noutput = \"B.mgt\"\nexpr = \"A @ B\"\n"), &["p.toml", "B.mgt", "new file"]),
        plan_case("unknown backend", format!("{}[engine]\nbackend = \"tpu\"\n", step("A @ B")), &["p.toml", "engine.backend", "tpu"]),
        plan_case("unknown precision", format!("{}[engine]\nprecision = \"fp8\"\n", step("A @ B")), &["p.toml", "engine.precision", "fp8"]),
        plan_case("fp64 on f32 inputs", format!("{}[engine]\nprecision = \"fp64\"\n", step("A @ B")), &["p.toml", "fp64", "f32"]),
        plan_case("bad size", format!("{}[engine]\nhost_memory = \"lots\"\n", step("A @ B")), &["p.toml", "engine.host_memory", "lots"]),
        plan_case("empty device list", format!("{}[engine]\ndevices = []\n", step("A @ B")), &["p.toml", "engine.devices"]),
        plan_case("budget too small", "[matrices.G]\npath = \"G.mgt\"\ngenerate = { rows = 3000, cols = 3000 }\n[[step]]\noutput = \"C.mgt\"\nexpr = \"G @ G\"\n[engine]\nbackend = \"cpu\"\nhost_memory = \"1MiB\"\ntile = 2048\n".to_string(), &["p.toml", "does not fit", "host_memory"]),
        plan_case("zero-sized generate", "[matrices.G]\npath = \"G.mgt\"\ngenerate = { rows = 0, cols = 5 }\n[[step]]\noutput = \"C.mgt\"\nexpr = \"G @ G\"\n".into(), &["p.toml", "matrices.G.generate", "at least 1"]),
        plan_case("absurd generate size", "[matrices.G]\npath = \"G.mgt\"\ngenerate = { rows = 100000000000, cols = 100000000000 }\n[[step]]\noutput = \"C.mgt\"\nexpr = \"G @ G\"\n".into(), &["p.toml", "matrices.G.generate", "absurdly large"]),
        plan_case("no steps", GOOD.into(), &["p.toml", "[[step]]"]),
        plan_case("missing input file", uses("nope.mgt"), &["p.toml", "matrices.X", "nope.mgt", "does not exist"]),
        case("directory as input", |d| { std::fs::create_dir(d.join("dir.mgt")).unwrap(); plan_with(d, &uses("dir.mgt")); }, &["run", "p.toml"], &["dir.mgt", "not a regular file"]),
        header_case("truncated file", "trunc.mgt", |b| b.truncate(b.len() / 2), &["trunc.mgt", "truncated"]),
        header_case("shorter than a header", "tiny.mgt", |b| b.truncate(10), &["tiny.mgt", "too short"]),
        header_case("wrong magic", "magic.mgt", |b| b[0] = b'X', &["magic.mgt", "wrong magic"]),
        header_case("wrong version", "version.mgt", |b| b[8] = 9, &["version.mgt", "version"]),
        header_case("unknown dtype", "dtype.mgt", |b| b[12] = 7, &["dtype.mgt", "dtype"]),
        header_case("sizes overflow", "huge.mgt", |b| b[16..24].copy_from_slice(&u64::MAX.to_le_bytes()), &["huge.mgt", "overflow"]),
        header_case("zero columns", "zero.mgt", |b| b[24..32].copy_from_slice(&0u64.to_le_bytes()), &["zero.mgt", "`cols` is 0"]),
        header_case("lying tile stride", "stride.mgt", |b| b[48..56].copy_from_slice(&0u64.to_le_bytes()), &["stride.mgt", "tile_stride"]),
        header_case("unaligned data offset", "offset.mgt", |b| b[40..48].copy_from_slice(&100u64.to_le_bytes()), &["offset.mgt", "data_offset"]),
        header_case("points past the end", "past.mgt", |b| b[40..48].copy_from_slice(&(1u64 << 40).to_le_bytes()), &["past.mgt", "checksum_table_offset"]),
        header_case("unknown flags", "flags.mgt", |b| b[56] = 0x80, &["flags.mgt", "flags"]),
        header_case("rows changed", "rows.mgt", |b| b[16..24].copy_from_slice(&19u64.to_le_bytes()), &["rows.mgt", "header checksum mismatch"]),
        // A field out of range in a header whose checksum no longer matches is damage: said
        // so, not blamed on the field where it showed (a flipped high bit of `rows` made the
        // checksum table's offset look wrong).
        header_case("a bit of rows flipped", "flipped.mgt", |b| b[20] ^= 1, &["flipped.mgt", "header checksum mismatch", "the file is corrupt"]),
        header_case("dtype changed", "retyped.mgt", |b| b[12] = 2, &["retyped.mgt", "header checksum mismatch"]),
        header_case("checksum flag cleared", "noflag.mgt", |b| b[56] = 0, &["noflag.mgt", "header checksum mismatch"]),
        case("output in a read-only place", |d| plan_with(d, &format!("{GOOD}[[step]]\noutput = \"/proc/mgmm-out.mgt\"\nexpr = \"A @ B\"\n")), &["run", "p.toml"], &["/proc"]),
        case("output is a directory", |d| { std::fs::create_dir(d.join("C.mgt")).unwrap(); plan_with(d, &step("A @ B")); }, &["run", "p.toml"], &["C.mgt", "is a directory"]),
        case("gen: zero rows", |_| {}, &["gen", "Z.mgt", "--rows", "0", "--cols", "4"], &["Z.mgt", "at least 1"]),
        case("gen: unknown dist", |_| {}, &["gen", "Z.mgt", "--rows", "4", "--cols", "4", "--dist", "cauchy"], &["--dist cauchy"]),
        case("gen: a shape whose size overflows", |_| {}, &["gen", "Z.mgt", "--rows", "3000000000", "--cols", "3000000000"], &["Z.mgt", "absurdly large"]),
        case("gen: u64::MAX rows", |_| {}, &["gen", "Z.mgt", "--rows", "18446744073709551615", "--cols", "1"], &["Z.mgt", "absurdly large"]),
        case("gen over an input", |_| {}, &["gen", "A.mgt", "--rows", "4", "--cols", "4"], &["A.mgt", "already exists"]),
        case("export over an existing file", |_| {}, &["export", "A.mgt", "B.mgt"], &["B.mgt", "already exists"]),
        case("export to a name that is no .npy", |_| {}, &["export", "A.mgt", "E.mgt"], &["E.mgt", "export writes a .npy array", "import"]),
        case("import of a file that is no matrix", |d| std::fs::write(d.join("junk.bin"), b"hello world").unwrap(), &["import", "junk.bin", "Z.mgt"], &["junk.bin", "wrong magic", "format = \"raw\""]),
        case("info of a missing file", |_| {}, &["info", "missing.mgt"], &["missing.mgt", "cannot open"]),
        case("verify before run", |d| plan_with(d, &step("A @ B")), &["verify", "p.toml"], &["C.mgt", "step 1's output does not exist yet", "`run` the plan first"]),
        plan_case("alpha not finite", format!("{GOOD}[[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\nalpha = nan\n"), &["p.toml", "step 1", "alpha = NaN", "finite"]),
        plan_case("coefficient overflows", step("1e300 * A @ B * 1e300"), &["p.toml", "step 1", "alpha = inf", "finite"]),
        plan_case("f32 and f64 steps in one plan", format!("{GOOD}[[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n[[step]]\noutput = \"E.mgt\"\nexpr = \"D.T @ D\"\n"), &["p.toml", "step 2", "`D` is f64", "precision is one for the whole plan", "step 1 computes from f32 inputs", "plan of their own"]),
        plan_case("alpha overflows f32", format!("{GOOD}[[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\nalpha = 1e39\n"), &["p.toml", "step 1", "alpha = 1e39", "f32's normal range", "fp64"]),
        plan_case("alpha below f32's range", step("1e-50 * A @ B"), &["p.toml", "step 1", "alpha = 1e-50", "f32's normal range"]),
        plan_case("runaway expression", step(&format!("{}A @ B{}", "(".repeat(5000), ")".repeat(5000))), &["p.toml", "step 1", "longer than 400 symbols"]),
        plan_case("negative tile", format!("{}[engine]\ntile = -4\n", step("A @ B")), &["p.toml", "`tile = -4`", "tile takes \"auto\""]),
        plan_case("two-edge tile", format!("{}[engine]\ntile = [1, 2]\n", step("A @ B")), &["p.toml", "tile takes \"auto\""]),
        plan_case("negative device", format!("{}[engine]\ndevices = [-1]\n", step("A @ B")), &["p.toml", "devices takes \"all\""]),
        plan_case("size as a number", format!("{}[engine]\nhost_memory = 67108864\n", step("A @ B")), &["p.toml", "host_memory", "\"64GiB\""]),
        plan_case("matrix name not an identifier", "[matrices.\"A B\"]\npath = \"A.mgt\"\n[[step]]\noutput = \"C.mgt\"\nexpr = \"A @ A.T\"\n".into(), &["p.toml", "\"A B\"", "letters, digits and _"]),
        plan_case("step name not an identifier", format!("{GOOD}[[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\nname = \"1x y\"\n"), &["p.toml", "step 1", "\"1x y\"", "letters, digits and _"]),
        plan_case("one file, two shapes", "[matrices.G]\npath = \"G.mgt\"\ngenerate = { rows = 30, cols = 30 }\n[matrices.H]\npath = \"G.mgt\"\ngenerate = { rows = 30, cols = 20 }\n[[step]]\noutput = \"C.mgt\"\nexpr = \"G @ H\"\n".into(), &["p.toml", "matrices.H", "also matrices.G", "one file holds one matrix"]),
        plan_case("absurd thread count", format!("{}[engine]\nthreads = 100000\n", step("A @ B")), &["p.toml", "engine.threads", "1024"]),
        case("gen: absurd thread count", |_| {}, &["gen", "Z.mgt", "--rows", "4", "--cols", "4", "--threads", "100000"], &["--threads 100000", "1024"]),
        case("gen into a missing folder", |_| {}, &["gen", "nodir/Z.mgt", "--rows", "4", "--cols", "4"], &["nodir/Z.mgt", "its directory nodir does not exist"]),
        case("export into a missing folder", |_| {}, &["export", "A.mgt", "nodir/Z.npy"], &["nodir/Z.npy", "its directory nodir does not exist"]),
        case("report where none can be written", |d| plan_with(d, &step("A @ B")), &["run", "p.toml", "--report", "/proc/mgmm-report.json"], &["/proc/mgmm-report.json", "--report"]),
        case("verify with no rounds", |d| plan_with(d, &step("A @ B")), &["verify", "p.toml", "--rounds", "0"], &["--rounds 0", "at least 1"]),
        case("time model with no GPU speed", |d| plan_with(d, &step("A @ B")), &["plan", "p.toml", "--nodes", "2", "--gpu-tflops", "0"], &["--gpu-tflops 0", "positive"]),
        case("export onto a device node", |_| {}, &["export", "A.mgt", "/dev/null", "--force"], &["/dev/null", "not a regular file"]),
        case("info of a FIFO", |d| assert!(Command::new("mkfifo").arg(d.join("fifo.npy")).status().unwrap().success()), &["info", "fifo.npy", "--check"], &["fifo.npy", "not a regular file"]),
    ];
    assert!(cases.len() >= 25);
    for c in cases {
        let d = tmp();
        let dir = d.path();
        setup(dir);
        (c.prep)(dir);
        let inputs: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "mgt" || e == "toml"))
            .map(|p| (p.clone(), std::fs::read(&p).unwrap()))
            .collect();
        let o = Command::new(bin())
            .args(&c.args)
            .current_dir(dir)
            .output()
            .unwrap();
        // The one-line note of `backend = "auto"` falling back to the CPU is information, not
        // part of the error.
        let err: String = String::from_utf8_lossy(&o.stderr)
            .lines()
            .filter(|l| !l.starts_with("backend auto: using the CPU"))
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(
            !o.status.success(),
            "{}: expected failure, got success:\n{err}",
            c.name
        );
        assert!(
            !err.contains("panicked") && !err.contains("backtrace"),
            "{}: panic:\n{err}",
            c.name
        );
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{}: expected one line of message:\n{err}",
            c.name
        );
        assert!(err.starts_with("error: "), "{}:\n{err}", c.name);
        for n in &c.needles {
            assert!(
                err.contains(n),
                "{}: message should mention {n:?}:\n{err}",
                c.name
            );
        }
        for (p, bytes) in inputs {
            assert!(
                std::fs::read(&p).unwrap() == bytes,
                "{}: {} changed",
                c.name,
                p.display()
            );
        }
        assert!(
            !dir.join("C.mgt").is_file() || c.name == "output is a directory",
            "{}: no output may be left",
            c.name
        );
    }
}

#[test]
fn nan_and_inf_are_computed_faithfully_and_counted() {
    let d = tmp();
    let dir = d.path();
    gen(
        &dir.join("A.mgt"),
        4,
        3,
        DType::F32,
        (4, 4),
        Dist::Arange,
        0,
    );
    gen(
        &dir.join("B.mgt"),
        3,
        2,
        DType::F32,
        (4, 4),
        Dist::Identity,
        0,
    );
    // A[1][2] = NaN, A[3][0] = +Inf.
    let f = mgmm_stream::store::TiledFile::open(&dir.join("A.mgt")).unwrap();
    let h = f.hdr;
    drop(f);
    let mut b = std::fs::read(dir.join("A.mgt")).unwrap();
    let at = |r: u64, c: u64| (h.data_offset + (r * h.tile_cols + c) * 4) as usize;
    b[at(1, 2)..at(1, 2) + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    b[at(3, 0)..at(3, 0) + 4].copy_from_slice(&f32::INFINITY.to_le_bytes());
    std::fs::write(dir.join("A.mgt"), b).unwrap();
    let text = "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n[[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n[engine]\nbackend = \"cpu\"\nverify_inputs = false\n";
    let rep = run_text(dir, text).unwrap();
    assert_eq!(rep.steps[0].nonfinite_inputs, 2);
    let c = Mat::load(&dir.join("C.mgt"));
    // C = A·[I; 0] keeps A's first two columns: row 1 has no NaN there (NaN·0 = NaN though).
    assert!(
        c.v[2].is_nan() && c.v[3].is_nan(),
        "NaN·0 is NaN: row 1 is all NaN, {:?}",
        &c.v[2..4]
    );
    assert!(
        c.v[6].is_infinite() && c.v[7].is_nan(),
        "Inf·1 = Inf, Inf·0 = NaN: {:?}",
        &c.v[6..8]
    );
    assert_eq!((c.v[0], c.v[1]), (0.0, 1.0));
}

fn mg(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(bin())
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

/// Files in `dir` whose name ends in `.partial` (junk a failed write would leave).
fn partials(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.contains(".partial"))
        .collect()
}

/// `mgmm-stream ARGS` in `dir` whose output writes fail after `tiles` tiles (the test-only
/// fault hook): a run stopped part-way with an unfinished output.
fn run_failing_after(dir: &Path, tiles: u32, args: &[&str]) -> std::process::Output {
    Command::new(bin())
        .args(args)
        .env("MGMM_FAULT_WRITE_AFTER", tiles.to_string())
        .current_dir(dir)
        .output()
        .unwrap()
}

/// The plan of `step("A @ B")` on the CPU with 8×8 compute tiles (6 output tiles).
fn small_cpu_plan(dir: &Path) {
    cpu_plan(dir, "C.mgt", "tile = 8\n");
}

/// p.toml computing `output` = A·B on the CPU, with `engine` lines added under [engine].
fn cpu_plan(dir: &Path, output: &str, engine: &str) {
    plan_with(
        dir,
        &format!("{GOOD}[[step]]\noutput = \"{output}\"\nexpr = \"A @ B\"\n[engine]\nbackend = \"cpu\"\n{engine}"),
    );
}

fn failed_with(o: &std::process::Output, needles: &[&str]) -> String {
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!o.status.success(), "expected failure:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "message should mention {n:?}:\n{err}");
    }
    err
}

#[test]
fn gen_and_export_onto_a_disk_too_small_leave_nothing() {
    let d = tmp();
    let dir = d.path();
    // 10⁷ × 10⁷ f32 is 400 TB: refused before anything is created.
    let o = mg(
        dir,
        &["gen", "Z.mgt", "--rows", "10000000", "--cols", "10000000"],
    );
    failed_with(&o, &["not enough disk space", "Z.mgt"]);
    assert!(!dir.join("Z.mgt").exists() && partials(dir).is_empty());
    // A write that fails part-way (the file-size limit stands in for a full disk): the partial
    // file is removed, nothing at the final name, and the next `gen` is not told "exists".
    let limited = |cmd: &str| {
        Command::new("sh")
            .arg("-c")
            .arg(format!("ulimit -f 256; exec \"{}\" {cmd}", bin().display()))
            .current_dir(dir)
            .output()
            .unwrap()
    };
    let o = limited("gen G.mgt --rows 1024 --cols 1024");
    failed_with(&o, &["G.mgt"]);
    assert!(!dir.join("G.mgt").exists(), "no file that looks valid");
    assert!(partials(dir).is_empty(), "{:?}", partials(dir));
    let o = mg(dir, &["gen", "G.mgt", "--rows", "1024", "--cols", "1024"]);
    assert!(o.status.success(), "{o:?}");
    let o = limited("export G.mgt G.npy");
    failed_with(&o, &["G.npy"]);
    assert!(!dir.join("G.npy").exists() && partials(dir).is_empty());
    // gen --force onto a failing disk keeps the old file whole.
    let before = std::fs::read(dir.join("G.mgt")).unwrap();
    let o = limited("gen G.mgt --rows 1024 --cols 1024 --seed 9 --force");
    failed_with(&o, &["G.mgt"]);
    assert!(std::fs::read(dir.join("G.mgt")).unwrap() == before);
    assert!(partials(dir).is_empty());
}

#[test]
fn outputs_that_are_inputs_under_another_name_are_refused() {
    let d = tmp();
    let dir = d.path();
    setup(dir);
    std::fs::create_dir(dir.join("sub")).unwrap();
    let a = std::fs::read(dir.join("A.mgt")).unwrap();
    let b = std::fs::read(dir.join("B.mgt")).unwrap();
    std::fs::hard_link(dir.join("B.mgt"), dir.join("hard.mgt")).unwrap();
    std::os::unix::fs::symlink(dir.join("B.mgt"), dir.join("soft.mgt")).unwrap();
    for out in ["hard.mgt", "soft.mgt", "sub/../B.mgt", "new/../B.mgt"] {
        plan_with(
            dir,
            &format!("{GOOD}[[step]]\noutput = \"{out}\"\nexpr = \"A @ B\"\n"),
        );
        for args in [&["run", "p.toml"][..], &["run", "p.toml", "--restart"]] {
            let o = mg(dir, args);
            failed_with(&o, &[out, "new file"]);
        }
        let o = mg(dir, &["export", "B.mgt", out, "--force"]);
        failed_with(&o, &["same file"]);
        let o = mg(dir, &["import", out, "B.mgt", "--force"]);
        failed_with(&o, &["same file"]);
    }
    // A raw descriptor names its file last; that file is the one compared.
    let raw = "raw:rows=1,cols=8,dtype=f32:B.mgt";
    let o = mg(dir, &["import", raw, "B.mgt", "--force"]);
    failed_with(&o, &["same file"]);
    let o = mg(dir, &["export", raw, "soft.mgt", "--force"]);
    failed_with(&o, &["same file"]);
    assert!(
        !dir.join("new").exists(),
        "nothing created for a refused path"
    );
    // `gen --force` over a hard link replaces the directory entry, never the linked data.
    let o = mg(
        dir,
        &["gen", "hard.mgt", "--rows", "4", "--cols", "4", "--force"],
    );
    assert!(o.status.success(), "{o:?}");
    assert!(std::fs::read(dir.join("A.mgt")).unwrap() == a);
    assert!(
        std::fs::read(dir.join("B.mgt")).unwrap() == b,
        "B.mgt changed"
    );
}

#[test]
fn unfinished_outputs_are_told_apart_from_corrupt_ones() {
    let d = tmp();
    let dir = d.path();
    setup(dir);
    small_cpu_plan(dir);
    // The output's writes fail after 2 tiles: the run stops with an unfinished output.
    let o = run_failing_after(dir, 2, &["run", "p.toml"]);
    assert!(!o.status.success());
    let o = mg(dir, &["export", "C.mgt", "C.npy"]);
    failed_with(
        &o,
        &[
            "C.mgt",
            "unfinished",
            "finish it with `mgmm-stream run PLAN`",
        ],
    );
    assert!(!dir.join("C.npy").exists());
    let o = mg(dir, &["info", "C.mgt", "--check"]);
    let err = failed_with(
        &o,
        &["unfinished, resumable", "of 6 tiles done", "not corrupt"],
    );
    assert!(!err.contains("checksum mismatch"), "{err}");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("check:       unfinished, resumable"), "{out}");
    let o = mg(dir, &["export", "C.mgt", "C.npy", "--allow-partial"]);
    assert!(o.status.success(), "{o:?}");
    // It says what it exported: the tiles not done are zeros.
    let said = String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(
        said.contains("note: C.mgt is unfinished (") && said.contains("of 6 tiles done"),
        "{said}"
    );
    assert!(
        said.contains("the tiles not done are zeros in C.npy"),
        "{said}"
    );
    // Finished, then corrupted: "corrupt", not "unfinished".
    let o = mg(dir, &["run", "p.toml"]);
    assert!(o.status.success(), "{o:?}");
    let f = mgmm_stream::store::TiledFile::open(&dir.join("C.mgt")).unwrap();
    let (off, off2) = (
        f.hdr.tile_offset(0, 0) as usize,
        f.hdr.tile_offset(f.hdr.grid_rows() - 1, 0) as usize,
    );
    let last = f.hdr.grid_rows() - 1;
    drop(f);
    let mut bytes = std::fs::read(dir.join("C.mgt")).unwrap();
    bytes[off] ^= 1;
    bytes[off2] ^= 1;
    std::fs::write(dir.join("C.mgt"), bytes).unwrap();
    // Every bad tile listed; a finished output's advice is `verify --repair`, not regenerating.
    let o = mg(dir, &["info", "C.mgt", "--check"]);
    failed_with(
        &o,
        &[
            "C.mgt: checksum mismatch in tile (0, 0) (of 2 bad)",
            "verify PLAN --repair",
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains(&format!(
            "check:       corrupt: 2 tile(s) do not match their checksums: (0, 0) ({last}, 0)"
        )),
        "{out}"
    );
    // `export` checks the tiles it copies; `verify` checks the stored checksums before its
    // residual test (a one-bit flip may hide in the rounding it allows) and names the tile;
    // `verify --repair` recomputes it.
    let o = mg(dir, &["export", "C.mgt", "C2.npy"]);
    // Either bad tile may be the one found first (tiles are checked in parallel: under load CI
    // once named the last one).
    let err = failed_with(&o, &["C.mgt", "checksum mismatch", "verify PLAN --repair"]);
    assert!(
        err.contains("tile (0, 0)") || err.contains(&format!("tile ({last}, 0)")),
        "{err}"
    );
    // One remedy, the one that applies: an output is recomputed, not regenerated.
    assert!(!err.contains("regenerate"), "{err}");
    assert!(!dir.join("C2.npy").exists() && partials(dir).is_empty());
    let o = mg(dir, &["verify", "p.toml"]);
    failed_with(&o, &["verification failed", "--repair"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("FAIL — 2 tile(s) no longer match the checksums") && out.contains("(0, 0)"),
        "{out}"
    );
    let o = mg(dir, &["verify", "p.toml", "--repair"]);
    assert!(o.status.success(), "{o:?}");
    let o = mg(dir, &["info", "C.mgt", "--check"]);
    assert!(o.status.success(), "{o:?}");
}

#[test]
fn an_unfinished_npy_output_is_not_exported_or_called_corrupt() {
    let d = tmp();
    let dir = d.path();
    setup(dir);
    cpu_plan(dir, "C.npy", "tile = 8\n");
    let o = run_failing_after(dir, 2, &["run", "p.toml"]);
    assert!(!o.status.success());
    let o = mg(dir, &["export", "C.npy", "X.npy"]);
    failed_with(&o, &["C.npy", "unfinished", "--allow-partial"]);
    assert!(!dir.join("X.npy").exists());
    let o = mg(dir, &["info", "C.npy", "--check"]);
    failed_with(
        &o,
        &["unfinished, resumable", "of 6 tiles done", "not corrupt"],
    );
    let o = mg(dir, &["run", "p.toml"]);
    assert!(o.status.success(), "{o:?}");
    let o = mg(dir, &["info", "C.npy", "--check"]);
    assert!(o.status.success(), "{o:?}");
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(out.matches("file:").count(), 1, "{out}");
    assert!(out.contains("check:       all 6 tiles OK"), "{out}");
    // A damaged sidecar: `info --check` says it was ignored and why, not "no checksums".
    let side = dir.join("C.npy.crc32c");
    let mut b = std::fs::read(&side).unwrap();
    let n = b.len();
    b[n - 3] ^= 1;
    std::fs::write(&side, b).unwrap();
    let o = mg(dir, &["info", "C.npy", "--check"]);
    failed_with(
        &o,
        &[
            "C.npy.crc32c ignored",
            "does not match",
            "delete the sidecar",
        ],
    );
    // The description comes first, as for a `.mgt`: what the file is, then why no check.
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("shape:") && out.contains("check:       not possible"),
        "{out}"
    );
    // A raw file (no checksums at all) likewise.
    std::fs::write(dir.join("x.bin"), [0u8; 24]).unwrap();
    let o = mg(
        dir,
        &["info", "raw:rows=2,cols=3,dtype=f32:x.bin", "--check"],
    );
    failed_with(&o, &["has no checksums", "nothing to check"]);
    assert_eq!(
        o.status.code(),
        Some(3),
        "nothing to check is exit 3, not 1"
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("format:      raw") && out.contains("check:       not possible"),
        "{out}"
    );
}

#[test]
fn a_journal_that_is_a_link_is_never_written_through() {
    let d = tmp();
    let dir = d.path();
    setup(dir);
    plan_with(
        dir,
        &format!("{}[engine]\nbackend = \"cpu\"\n", step("A @ B")),
    );
    let a = std::fs::read(dir.join("A.mgt")).unwrap();
    let j = dir.join("C.mgt.journal");
    std::os::unix::fs::symlink(dir.join("A.mgt"), &j).unwrap();
    let o = mg(dir, &["run", "p.toml"]);
    failed_with(&o, &["C.mgt.journal"]);
    let o = mg(dir, &["run", "p.toml", "--restart"]);
    failed_with(
        &o,
        &[
            "C.mgt.journal",
            "symbolic link",
            "copy of what it points at",
        ],
    );
    assert!(
        std::fs::read(dir.join("A.mgt")).unwrap() == a,
        "A.mgt changed"
    );
    // A hard link (here to an input; in life a `cp -al` backup) is broken, not written through.
    std::fs::remove_file(&j).unwrap();
    std::fs::hard_link(dir.join("A.mgt"), &j).unwrap();
    let o = mg(dir, &["run", "p.toml", "--restart"]);
    assert!(o.status.success(), "{o:?}");
    assert!(
        std::fs::read(dir.join("A.mgt")).unwrap() == a,
        "A.mgt changed"
    );
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(dir.join("A.mgt")).unwrap().nlink(), 1);
    // A finished step's journal hard-linked into a backup: the step stays complete, the backup
    // keeps its bytes.
    let backup = dir.join("backup.journal");
    std::fs::hard_link(&j, &backup).unwrap();
    let kept = std::fs::read(&backup).unwrap();
    let o = mg(dir, &["run", "p.toml"]);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("already complete"),
        "{o:?}"
    );
    assert!(mg(dir, &["verify", "p.toml"]).status.success());
    assert!(std::fs::read(&backup).unwrap() == kept);
}

#[test]
fn a_journal_header_torn_before_its_newline_is_written_again() {
    let d = tmp();
    let dir = d.path();
    setup(dir);
    plan_with(
        dir,
        &format!("{}[engine]\nbackend = \"cpu\"\n", step("A @ B")),
    );
    assert!(mg(dir, &["run", "p.toml"]).status.success());
    let j = dir.join("C.mgt.journal");
    let bytes = std::fs::read(&j).unwrap();
    let nl = bytes.iter().position(|&b| b == b'\n').unwrap();
    std::fs::write(&j, &bytes[..nl]).unwrap();
    let o = mg(dir, &["run", "p.toml"]);
    assert!(o.status.success(), "{o:?}");
    let o = mg(dir, &["verify", "p.toml"]);
    assert!(o.status.success(), "{o:?}");
    assert!(mg(dir, &["info", "C.mgt", "--check"]).status.success());
}

#[test]
fn an_output_beyond_resuming_says_to_restart() {
    let d = tmp();
    let dir = d.path();
    setup(dir);
    small_cpu_plan(dir);
    let o = run_failing_after(dir, 2, &["run", "p.toml"]);
    assert!(!o.status.success());
    let len = std::fs::metadata(dir.join("C.mgt")).unwrap().len();
    set_len(&dir.join("C.mgt"), len / 2);
    let o = mg(dir, &["run", "p.toml"]);
    failed_with(&o, &["C.mgt", "truncated", "rerun with --restart"]);
    // Something else where the checkpoints go: named, with what to do.
    std::fs::write(dir.join("C.mgt.partial"), b"x").unwrap();
    let o = mg(dir, &["run", "p.toml", "--restart"]);
    failed_with(&o, &["C.mgt.partial", "not a folder", "move or delete it"]);
    std::fs::remove_file(dir.join("C.mgt.partial")).unwrap();
    let o = mg(dir, &["run", "p.toml", "--restart"]);
    assert!(o.status.success(), "{o:?}");
}

/// `--report` and `MGMM_TRACE` never replace the job's own files nor a file that is not a
/// JSON document (a tab-completion slip, `--report A.mgt`, replaced the input with a report,
/// exit 0); an earlier report is replaced as before.
#[test]
fn a_report_or_timeline_never_replaces_the_jobs_files() {
    let d = tmp();
    let dir = d.path();
    setup(dir);
    cpu_plan(dir, "C.mgt", "");
    std::fs::write(dir.join("notes.txt"), "my notes\n").unwrap();
    let before = |f: &str| std::fs::read(dir.join(f)).unwrap();
    let (a, p, notes) = (before("A.mgt"), before("p.toml"), before("notes.txt"));
    for (path, needles) in [
        ("A.mgt", vec!["--report A.mgt", "the matrix `A`"]),
        ("p.toml", vec!["the plan file"]),
        ("C.mgt", vec!["the output of step 1"]),
        (
            "notes.txt",
            vec!["notes.txt", "not a report or timeline", "run.json"],
        ),
    ] {
        let o = mg(dir, &["run", "p.toml", "--report", path]);
        failed_with(&o, &needles);
    }
    let o = Command::new(bin())
        .args(["verify", "p.toml"])
        .env("MGMM_TRACE", "A.mgt")
        .current_dir(dir)
        .output()
        .unwrap();
    failed_with(&o, &["MGMM_TRACE=A.mgt", "the matrix `A`", "trace.json"]);
    assert_eq!(before("A.mgt"), a, "A.mgt was changed");
    assert_eq!(before("p.toml"), p, "the plan was changed");
    assert_eq!(before("notes.txt"), notes, "notes.txt was changed");
    assert!(
        !dir.join("C.mgt").exists(),
        "a refused run computed nothing"
    );
    // A report of an earlier run is replaced.
    for _ in 0..2 {
        let o = mg(dir, &["run", "p.toml", "--restart", "--report", "r.json"]);
        assert!(o.status.success(), "{o:?}");
    }
    // The journal: JSON too, refused as the job's own.
    let o = mg(dir, &["run", "p.toml", "--report", "C.mgt.journal"]);
    failed_with(&o, &["the journal of step 1"]);
    // Inside the checkpoint folder, which the step removes (the report was made, then lost).
    let o = mg(
        dir,
        &[
            "run",
            "p.toml",
            "--restart",
            "--report",
            "C.mgt.partial/r.json",
        ],
    );
    failed_with(
        &o,
        &["inside the checkpoint folder of step 1", "would be lost"],
    );
    // A JSON file of the user's own (not a report), a pipe (as `MGMM_TRACE=/dev/null` replaced
    // the device node by a regular file, as root), and one path for both.
    std::fs::write(dir.join("settings.json"), "{\"lr\": 0.1}\n").unwrap();
    let o = mg(
        dir,
        &["run", "p.toml", "--restart", "--report", "settings.json"],
    );
    failed_with(
        &o,
        &["settings.json", "not a report or timeline of mgmm-stream"],
    );
    assert_eq!(before("settings.json"), b"{\"lr\": 0.1}\n");
    assert!(Command::new("mkfifo")
        .arg(dir.join("pipe"))
        .status()
        .unwrap()
        .success());
    let with_trace = |trace: &str, args: &[&str]| {
        Command::new(bin())
            .args(args)
            .env("MGMM_TRACE", trace)
            .current_dir(dir)
            .output()
            .unwrap()
    };
    let o = with_trace("pipe", &["verify", "p.toml"]);
    failed_with(&o, &["MGMM_TRACE=pipe", "not a regular file"]);
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::symlink_metadata(dir.join("pipe"))
        .unwrap()
        .file_type()
        .is_fifo());
    let o = with_trace(
        "same.json",
        &["run", "p.toml", "--restart", "--report", "same.json"],
    );
    failed_with(&o, &["name the same file"]);
    // A timeline of an earlier run is replaced.
    for _ in 0..2 {
        let o = with_trace("t.json", &["run", "p.toml", "--restart", "-q"]);
        assert!(o.status.success(), "{o:?}");
    }
}

#[test]
fn a_report_into_a_new_folder_is_written_and_a_failed_run_leaves_none() {
    let d = tmp();
    let dir = d.path();
    setup(dir);
    cpu_plan(dir, "res/C.mgt", "");
    let o = mg(dir, &["run", "p.toml", "--report", "res/report.json"]);
    assert!(o.status.success(), "{o:?}");
    assert!(std::fs::read_to_string(dir.join("res/report.json"))
        .unwrap()
        .contains("\"steps\""));
    // A run that fails part-way leaves no empty report behind.
    let o = run_failing_after(
        dir,
        0,
        &["run", "p.toml", "--restart", "--report", "r2.json"],
    );
    assert!(!o.status.success(), "{o:?}");
    assert!(!dir.join("r2.json").exists());
    // Nor does a run killed outright (the report is written whole at the end), and the
    // writability probe left nothing either.
    gen(
        &dir.join("G.mgt"),
        600,
        600,
        DType::F32,
        (8, 8),
        Dist::Normal,
        4,
    );
    plan_with(
        dir,
        "[matrices.G]\npath = \"G.mgt\"\n[[step]]\noutput = \"K.mgt\"\nexpr = \"G @ G\"\n\
         [engine]\nbackend = \"cpu\"\ntile = 8\nthreads = 1\n",
    );
    let mut child = std::process::Command::new(bin())
        .args(["run", "p.toml", "-q", "--report", "r3.json"])
        .current_dir(dir)
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    while !dir.join("K.mgt.journal").exists() && t.elapsed().as_secs() < 30 {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    std::thread::sleep(std::time::Duration::from_millis(50));
    child.kill().unwrap();
    let st = child.wait().unwrap();
    assert!(
        !st.success(),
        "the run finished before the kill: make it longer"
    );
    let left: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("r3.json") || n.contains(".probe"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// `run --restart` over a finished step whose input was corrupted in place since (a byte of its
/// data flipped; the journal's identity of it unchanged) stops before the output is touched,
/// naming the input and its tile; once the input is put back, `run` has nothing to compute and
/// the output is the one computed before. A step that is not complete is restarted as before
/// (the run's own reads find the corruption then, with nothing finished to lose).
#[test]
fn restart_keeps_a_finished_output_when_an_input_is_now_corrupt() {
    use std::os::unix::fs::FileExt;
    let d = tmp();
    let dir = d.path();
    setup(dir);
    cpu_plan(dir, "C.mgt", "");
    assert!(mg(dir, &["run", "p.toml", "-q"]).status.success());
    let c = std::fs::read(dir.join("C.mgt")).unwrap();
    let j = std::fs::read(dir.join("C.mgt.journal")).unwrap();
    let f = mgmm_stream::store::TiledFile::open(&dir.join("B.mgt")).unwrap();
    let off = f.hdr.tile_offset(1, 0) + 4 * 9;
    drop(f);
    let flip = || {
        let w = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.join("B.mgt"))
            .unwrap();
        let mut x = [0u8; 1];
        w.read_exact_at(&mut x, off).unwrap();
        w.write_all_at(&[x[0] ^ 1], off).unwrap();
    };
    flip();
    // `run --restart`, and `prepare --restart` (a split run's set-up), alike.
    for args in [
        &["run", "p.toml", "--restart"][..],
        &["prepare", "p.toml", "--restart"],
    ] {
        let o = mg(dir, args);
        let err = failed_with(
            &o,
            &[
                "B.mgt",
                "checksum mismatch in tile (1, 0)",
                "the restart stopped before touching ./C.mgt",
            ],
        );
        // The error is one line, after notes saying what is being checked, and why.
        let line = err.lines().find(|l| l.starts_with("error:")).unwrap_or("");
        assert!(
            line.contains("tile (1, 0)") && line.contains("left it as it was"),
            "{err}"
        );
        assert!(err.contains("restart: checking ./B.mgt"), "{err}");
        assert!(
            std::fs::read(dir.join("C.mgt")).unwrap() == c,
            "C.mgt changed"
        );
        assert!(
            std::fs::read(dir.join("C.mgt.journal")).unwrap() == j,
            "the journal changed"
        );
    }
    flip();
    let o = mg(dir, &["run", "p.toml"]);
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stderr).contains("already complete"),
        "{o:?}"
    );
    assert!(std::fs::read(dir.join("C.mgt")).unwrap() == c);
    // Unfinished (no journal): restarted, and the run's own check names the tile.
    flip();
    std::fs::remove_file(dir.join("C.mgt.journal")).unwrap();
    let o = mg(dir, &["run", "p.toml", "--restart"]);
    let err = failed_with(&o, &["B.mgt", "checksum mismatch in tile (1, 0)"]);
    assert!(!err.contains("stopped before touching"), "{err}");
}

/// A `.mgt` without a checksum table (written by a tool that left it out): `info --check` says
/// it cannot check and gives the commands that add one, and those commands work.
#[test]
fn info_check_without_a_checksum_table_says_how_to_add_one() {
    let d = tmp();
    let dir = d.path();
    setup(dir);
    let p = dir.join("A.mgt");
    let mut b = std::fs::read(&p).unwrap();
    // Flag bit 0 and the table's offset cleared, the header CRC (bytes 0–71) made valid again.
    b[56..72].fill(0);
    let crc = crc32c::crc32c(&b[..72]);
    b[72..76].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&p, b).unwrap();
    let o = mg(dir, &["info", "A.mgt", "--check"]);
    let err = failed_with(&o, &["no checksum table", "mgmm-stream export", "import"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("check:       not possible"), "{out}");
    // Run the advice as written, then check again.
    let advice = err.split("rewrite it: ").nth(1).unwrap().trim();
    let sh = Command::new("sh")
        .args(["-c", advice])
        .current_dir(dir)
        .env(
            "PATH",
            format!(
                "{}:{}",
                bin().parent().unwrap().display(),
                std::env::var("PATH").unwrap_or_default()
            ),
        )
        .output()
        .unwrap();
    assert!(
        sh.status.success(),
        "{advice}: {}",
        String::from_utf8_lossy(&sh.stderr)
    );
    let o = mg(dir, &["info", "A.mgt", "--check"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("tiles OK"));
}

/// An earlier step's `.npy` output damaged in place after the run: the step that reads it says
/// so and points to `verify --repair` (the plan computes that input; "restore it, --restart
/// would stop on the same damage" was wrong advice there), and `verify --repair` mends both
/// steps, after which `run` finds the plan complete.
#[test]
fn a_damaged_output_of_an_earlier_step_points_to_repair() {
    use std::os::unix::fs::FileExt;
    let d = tmp();
    let dir = d.path();
    std::fs::write(
        dir.join("p.toml"),
        "[matrices.A]\npath = \"A.mgt\"\ngenerate = { rows = 90, cols = 70, seed = 1 }\n\
         [matrices.B]\npath = \"B.mgt\"\ngenerate = { rows = 70, cols = 80, seed = 2 }\n\
         [[step]]\nname = \"X\"\noutput = \"X.npy\"\nexpr = \"A @ B\"\n\
         [[step]]\noutput = \"W.npy\"\nexpr = \"X @ X.T\"\n\
         [engine]\nbackend = \"cpu\"\ntile = 32\ndurable = false\n",
    )
    .unwrap();
    assert!(mg(dir, &["run", "p.toml", "-q"]).status.success());
    let (x, w) = (
        std::fs::read(dir.join("X.npy")).unwrap(),
        std::fs::read(dir.join("W.npy")).unwrap(),
    );
    std::thread::sleep(std::time::Duration::from_millis(20));
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("X.npy"))
        .unwrap();
    f.write_all_at(&7.5f32.to_le_bytes(), (x.len() - 40) as u64)
        .unwrap();
    drop(f);
    let o = mg(dir, &["run", "p.toml"]);
    let err = failed_with(
        &o,
        &[
            "X.npy",
            "damaged",
            "a run's output",
            "verify PLAN --repair` with the plan that computed it",
        ],
    );
    assert!(!err.contains("would stop on the same damage"), "{err}");
    let o = mg(dir, &["verify", "p.toml", "--repair"]);
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        std::fs::read(dir.join("X.npy")).unwrap() == x,
        "X.npy not restored"
    );
    assert!(
        std::fs::read(dir.join("W.npy")).unwrap() == w,
        "W.npy differs"
    );
    let o = mg(dir, &["run", "p.toml"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// One flipped bit in an input's checksum table after a finished run (issue 33, item 7): every
/// command names the input as damaged — its table no longer matches its own data — instead of
/// "different inputs, rerun with --restart"; and `run --restart` (and `prepare --restart`) stop
/// before touching the finished output, output and journal byte-identical. The same when the
/// input cannot even be opened (its header damaged). Once the input is restored, `run` finds
/// the step complete.
#[test]
fn a_damaged_checksum_table_is_named_and_restart_keeps_the_output() {
    use std::os::unix::fs::FileExt;
    let d = tmp();
    let dir = d.path();
    setup(dir);
    cpu_plan(dir, "C.mgt", "");
    assert!(mg(dir, &["run", "p.toml", "-q"]).status.success());
    let c = std::fs::read(dir.join("C.mgt")).unwrap();
    let j = std::fs::read(dir.join("C.mgt.journal")).unwrap();
    let f = mgmm_stream::store::TiledFile::open(&dir.join("B.mgt")).unwrap();
    // Tile 1 of B's checksum table: tile (0, 1) of its 4×2 grid.
    let table = f.hdr.checksum_table_offset + 4;
    drop(f);
    let flip = |off: u64, bit: u8| {
        let w = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.join("B.mgt"))
            .unwrap();
        let mut x = [0u8; 1];
        w.read_exact_at(&mut x, off).unwrap();
        w.write_all_at(&[x[0] ^ bit], off).unwrap();
    };
    let kept = || {
        assert!(
            std::fs::read(dir.join("C.mgt")).unwrap() == c,
            "C.mgt changed"
        );
        assert!(
            std::fs::read(dir.join("C.mgt.journal")).unwrap() == j,
            "the journal changed"
        );
    };
    flip(table, 0x10);
    let o = mg(dir, &["run", "p.toml"]);
    let err = failed_with(&o, &["B.mgt", "damaged", "tile (0, 1)", "restore"]);
    assert!(!err.contains("different plan or different inputs"), "{err}");
    kept();
    let o = mg(dir, &["verify", "p.toml"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(!o.status.success(), "{out}");
    assert!(out.contains("damaged") && out.contains("B.mgt"), "{out}");
    assert!(!out.contains("other inputs"), "{out}");
    for args in [
        &["run", "p.toml", "--restart"][..],
        &["prepare", "p.toml", "--restart"],
    ] {
        let o = mg(dir, args);
        failed_with(
            &o,
            &[
                "B.mgt",
                "checksum mismatch in tile (0, 1)",
                "the restart stopped before touching ./C.mgt",
            ],
        );
        kept();
    }
    flip(table, 0x10);
    // An input that cannot be opened at all (a header field flipped): refused as the plan
    // loads, the output kept all the same.
    flip(20, 0x01);
    let o = mg(dir, &["run", "p.toml", "--restart"]);
    failed_with(&o, &["B.mgt", "header"]);
    kept();
    flip(20, 0x01);
    let o = mg(dir, &["run", "p.toml"]);
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stderr).contains("already complete"),
        "{o:?}"
    );
    kept();
}

/// A damaged checksum sidecar beside an unchanged `.npy` input is not a changed input: the
/// finished step that read it is still complete (it was "from different inputs", and the
/// advised `--restart` recomputed it — from corrupt data, had the data changed too), and
/// `info` says why the sidecar is ignored (new-user trial).
#[test]
fn a_damaged_sidecar_does_not_make_its_input_a_different_one() {
    let d = tmp();
    let dir = d.path();
    gen(
        &dir.join("A.mgt"),
        60,
        40,
        DType::F32,
        (16, 16),
        Dist::Normal,
        1,
    );
    gen(
        &dir.join("B.mgt"),
        40,
        50,
        DType::F32,
        (16, 16),
        Dist::Normal,
        2,
    );
    let engine = "[engine]\nbackend = \"cpu\"\ntile = 16\n";
    let p1 = format!("[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n[[step]]\noutput = \"AB.npy\"\nexpr = \"A @ B\"\n{engine}");
    let p2 = format!("[matrices.X]\npath = \"AB.npy\"\n[[step]]\noutput = \"C.mgt\"\nexpr = \"X.T @ X\"\n{engine}");
    std::fs::write(dir.join("p1.toml"), p1).unwrap();
    std::fs::write(dir.join("p2.toml"), p2).unwrap();
    assert!(mg(dir, &["run", "p1.toml"]).status.success());
    assert!(mg(dir, &["run", "p2.toml"]).status.success());
    let before = std::fs::read(dir.join("C.mgt")).unwrap();
    let side = dir.join("AB.npy.crc32c");
    let mut b = std::fs::read(&side).unwrap();
    b[40] ^= 1;
    std::fs::write(&side, b).unwrap();
    let o = mg(dir, &["run", "p2.toml"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && err.contains("already complete"),
        "{o:?}"
    );
    assert_eq!(std::fs::read(dir.join("C.mgt")).unwrap(), before);
    let o = mg(dir, &["info", "AB.npy"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("checksums:   none: the sidecar") && out.contains("does not match"),
        "{out}"
    );
}
