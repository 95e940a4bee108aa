//! Whole-expression chains whose intermediates stay in host memory (src/store/memory.rs,
//! src/run/intermediates.rs): no temporary file at all, the same bytes as a file intermediate
//! and as the two-step plan, an f64 reference check, resume after a failure in the last part
//! (the intermediate is computed again), device failover inside the in-memory part, and split
//! runs that keep file intermediates. Values are uniform in [-1, 1) with full f32 mantissas, so
//! any change in the order of operations would show in the bits.

use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use mgmm_stream::backend::fault::FaultConfig;
use mgmm_stream::dtype::DType;
use mgmm_stream::plan::Plan;
use mgmm_stream::progress::Progress;
use mgmm_stream::run::{run_plan, RunOptions, RunReport};
use mgmm_stream::store::gen::Dist;

/// A 370×370, B 370×370, C 370×380: (A·B)·C is the cheaper order, through a 370×370 f32
/// intermediate of 547 600 bytes (B·C would be bigger), just over half the smallest
/// `host_memory` a plan accepts (1 MiB).
fn inputs(dir: &Path) -> (Mat, Mat, Mat) {
    for (name, r, c, seed) in [("A", 370, 370, 1), ("B", 370, 370, 2), ("C", 370, 380, 3)] {
        let p = dir.join(format!("{name}.mgt"));
        gen(&p, r, c, DType::F32, (16, 16), Dist::Uniform, seed);
    }
    let l = |n: &str| Mat::load(&dir.join(format!("{n}.mgt")));
    (l("A"), l("B"), l("C"))
}

const MATS: &str = "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n[matrices.C]\npath = \"C.mgt\"\n";

/// An `[engine]` table: `host_memory` 32 MiB keeps the intermediate in memory (half of it is
/// the chain's budget); 1 MiB (a 512 KiB budget) sends it to a temporary file.
fn engine(backend: &str, host_memory: &str) -> String {
    format!(
        "[engine]\nbackend = \"{backend}\"\ntile = [32, 48, 16]\nhost_memory = \"{host_memory}\"\ndurable = false\n"
    )
}

/// Write plan `name` with one chain step `expr` into `out`.
fn chain_plan(dir: &Path, name: &str, out: &str, expr: &str, engine: &str) {
    std::fs::write(
        dir.join(name),
        format!("{MATS}[[step]]\noutput = \"{out}\"\nexpr = \"{expr}\"\n{engine}"),
    )
    .unwrap();
}

/// Run plan `name` in `dir` with `faults`; its result and the notes it printed (words joined
/// by single spaces, since notes wrap at 80 columns).
fn run_file(
    dir: &Path,
    name: &str,
    faults: Option<FaultConfig>,
) -> (mgmm_stream::Result<RunReport>, String) {
    let plan = Plan::load(&dir.join(name)).unwrap();
    let opts = RunOptions {
        faults,
        ..Default::default()
    };
    let lines = Arc::new(Mutex::new(Vec::new()));
    let progress = Progress::log_into(Duration::from_secs(3600), lines.clone());
    let r = run_plan(&plan, &opts, &progress);
    let text = lines.lock().unwrap().join("\n");
    (r, one_line(&text))
}

/// Files in `dir` whose name holds `.partN` (a chain's temporary files and their journals;
/// not a `.partial` checkpoint folder).
fn part_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| {
            n.split(".part")
                .skip(1)
                .any(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        })
        .collect()
}

fn bytes(dir: &Path, f: &str) -> Vec<u8> {
    std::fs::read(dir.join(f)).unwrap()
}

/// `D` against (A·B)·C in f64: within the f32 rounding of both products.
fn check_reference(d: &Mat, a: &Mat, b: &Mat, c: &Mat) {
    let (ab, ab_mag) = reference(a, false, b, false, None, 1.0, 0.0, 370, 370, 370);
    let ab = Mat {
        rows: 370,
        cols: 370,
        v: ab,
    };
    let abs = Mat {
        rows: 370,
        cols: 370,
        v: ab_mag,
    };
    let (want, _) = reference(&ab, false, c, false, None, 1.0, 0.0, 370, 380, 370);
    let cabs = Mat {
        rows: 370,
        cols: 380,
        v: c.v.iter().map(|x| x.abs()).collect(),
    };
    let (mag, _) = reference(&abs, false, &cabs, false, None, 1.0, 0.0, 370, 380, 370);
    // Each f32 product of depth k is within about k·u·Σ|a||b| of the exact one.
    let u = f32::EPSILON as f64;
    for i in 0..want.len() {
        let tol = (2.0 * 370.0 + 4.0) * u * mag[i];
        assert!(
            (d.v[i] - want[i]).abs() <= tol,
            "element {i}: {} against {} (tolerance {tol})",
            d.v[i],
            want[i]
        );
    }
}

/// The chain with its intermediate in memory, with it in a temporary file, and as two named
/// steps: the same bits, no `.part` file left by the memory run, and the f64 reference.
fn memory_file_and_two_steps_agree(backend: &str) {
    let d = tmp();
    let dir = d.path();
    let (a, b, c) = inputs(dir);
    chain_plan(
        dir,
        "mem.toml",
        "D_mem.mgt",
        "A @ B @ C",
        &engine(backend, "32MiB"),
    );
    chain_plan(
        dir,
        "file.toml",
        "D_file.mgt",
        "A @ B @ C",
        &engine(backend, "1MiB"),
    );
    std::fs::write(
        dir.join("two.toml"),
        format!(
            "{MATS}[[step]]\noutput = \"X.mgt\"\nexpr = \"A @ B\"\nname = \"X\"\n[[step]]\noutput = \"D_two.mgt\"\nexpr = \"X @ C\"\n{}",
            engine(backend, "32MiB")
        ),
    )
    .unwrap();
    let chain = |name: &str| {
        let p = Plan::load(&dir.join(name)).unwrap();
        p.steps[1].chain.clone().unwrap()
    };
    let (mem, file) = (chain("mem.toml"), chain("file.toml"));
    assert_eq!(mem.order, "((A @ B) @ C)");
    assert_eq!(file.order, mem.order);
    assert_eq!((mem.memory.len(), mem.temps.len()), (1, 1));
    assert!(file.memory.is_empty() && file.temps.len() == 1);

    let (r, notes) = run_file(dir, "mem.toml", None);
    let r = r.unwrap();
    assert!(
        notes.contains("T1 = A @ B (534.77 KiB) stays in host memory"),
        "{notes}"
    );
    // The part reading T1 reads it from memory (at least once whole), the one making it none.
    let (first, last) = (&r.steps[0], &r.steps[1]);
    assert_eq!(first.memory_read_bytes, 0);
    assert!(
        last.memory_read_bytes >= 370 * 370 * 4,
        "{}",
        last.memory_read_bytes
    );
    assert!(last.memory_read_bytes < last.read_bytes);
    assert_eq!(
        part_files(dir),
        Vec::<String>::new(),
        "a memory chain made files"
    );
    let (r, notes) = run_file(dir, "file.toml", None);
    assert!(r.unwrap().steps.iter().all(|s| s.memory_read_bytes == 0));
    assert!(!notes.contains("stays in host memory"), "{notes}");
    assert_eq!(
        part_files(dir),
        Vec::<String>::new(),
        "temporary file not removed"
    );
    run_file(dir, "two.toml", None).0.unwrap();

    let got = bytes(dir, "D_mem.mgt");
    assert!(
        got == bytes(dir, "D_file.mgt"),
        "memory and file intermediates differ"
    );
    assert!(
        got == bytes(dir, "D_two.mgt"),
        "one step and two steps differ"
    );
    check_reference(&Mat::load(&dir.join("D_mem.mgt")), &a, &b, &c);
}

/// The last part fails (a full disk) after some tiles; the rerun computes the in-memory
/// intermediate again and resumes the last part from its journal, to the same bytes as an
/// uninterrupted run. A complete chain is skipped without computing its intermediate. On the
/// simulated lanes, a device failing inside the in-memory part fails over to the others.
fn resume_recomputes_the_memory_intermediate(backend: &str) {
    let d = tmp();
    let dir = d.path();
    inputs(dir);
    let eng = engine(backend, "32MiB");
    chain_plan(dir, "mem.toml", "D.mgt", "A @ B @ C", &eng);
    chain_plan(dir, "ref.toml", "D_ref.mgt", "A @ B @ C", &eng);
    run_file(dir, "ref.toml", None).0.unwrap();

    let disk_full = FaultConfig {
        write_after: Some(20),
        ..Default::default()
    };
    let (r, notes) = run_file(dir, "mem.toml", Some(disk_full));
    let err = r.unwrap_err().to_string();
    assert!(
        err.contains("D.mgt"),
        "the failure is in the last part: {err}"
    );
    assert!(notes.contains("stays in host memory"), "{notes}");
    assert!(dir.join("D.mgt.journal").exists());
    assert_eq!(part_files(dir), Vec::<String>::new());

    let (r, notes) = run_file(dir, "mem.toml", None);
    r.unwrap();
    assert!(
        notes.contains("stays in host memory"),
        "not recomputed: {notes}"
    );
    assert!(
        notes.contains("resuming"),
        "the last part started over: {notes}"
    );
    assert!(
        bytes(dir, "D.mgt") == bytes(dir, "D_ref.mgt"),
        "resumed chain differs"
    );
    assert_eq!(part_files(dir), Vec::<String>::new());

    let (r, notes) = run_file(dir, "mem.toml", None);
    r.unwrap();
    assert!(notes.contains("already complete"), "{notes}");
    assert!(
        !notes.contains("stays in host memory"),
        "recomputed needlessly: {notes}"
    );

    if backend == "sim" {
        chain_plan(dir, "fail.toml", "D_fail.mgt", "A @ B @ C", &eng);
        let lane_dies = FaultConfig {
            lane: Some(1),
            gemm_after: Some(3),
            ..Default::default()
        };
        let (r, notes) = run_file(dir, "fail.toml", Some(lane_dies));
        r.unwrap();
        assert!(
            notes.contains("failed") && notes.contains("redoing"),
            "{notes}"
        );
        assert!(
            bytes(dir, "D_fail.mgt") == bytes(dir, "D_ref.mgt"),
            "failover differs"
        );
    }
}

per_backend! {
    memory_file_and_two_steps => super::memory_file_and_two_steps_agree;
    resume_in_memory => super::resume_recomputes_the_memory_intermediate;
}

fn cli(dir: &Path, args: &[&str]) -> (bool, String, String) {
    let o = Command::new(bin())
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout)
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" "),
        String::from_utf8_lossy(&o.stderr)
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" "),
    )
}

/// `plan` says where each intermediate goes, with its size; a split run writes the in-memory
/// intermediate to its file (other processes read it) and `verify` then checks the product by
/// residuals; after an unsplit run it says why it checked the journal only.
#[test]
fn plan_split_runs_and_verify_name_where_intermediates_go() {
    let d = tmp();
    let dir = d.path();
    inputs(dir);
    chain_plan(
        dir,
        "mem.toml",
        "D.mgt",
        "A @ B @ C",
        &engine("cpu", "32MiB"),
    );
    chain_plan(
        dir,
        "file.toml",
        "E.mgt",
        "A @ B @ C",
        &engine("cpu", "1MiB"),
    );
    let (ok, out, err) = cli(dir, &["plan", "mem.toml"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("intermediate 534.77 KiB stays in host memory (within half of host_memory; a split run writes it to the temporary file ./D.mgt.part1.mgt)"),
        "{out}"
    );
    // Only the final part writes a file, so only it says how.
    assert_eq!(out.matches("output written with").count(), 1, "{out}");
    let (ok, out, err) = cli(dir, &["plan", "file.toml"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("in the temporary file ./E.mgt.part1.mgt, removed when the chain completes"),
        "{out}"
    );

    let (ok, _, err) = cli(dir, &["run", "mem.toml", "--shard", "0/1"]);
    assert!(ok, "{err}");
    assert!(
        dir.join("D.mgt.part1.mgt").exists(),
        "a split run must keep a file"
    );
    let (ok, out, err) = cli(dir, &["verify", "mem.toml"]);
    assert!(ok && !out.contains("journal only"), "{out}\n{err}");

    // The split run's file and journal go with the first unsplit run (its `.shards` folder
    // of claims stays, as for any split run).
    let (ok, _, err) = cli(dir, &["run", "mem.toml", "--restart"]);
    assert!(ok, "{err}");
    assert!(!dir.join("D.mgt.part1.mgt").exists() && !dir.join("D.mgt.part1.mgt.journal").exists());
    let (ok, out, err) = cli(dir, &["verify", "mem.toml"]);
    assert!(ok, "{out}\n{err}");
    // One line per step of the plan: none for the chain's internal intermediate, whose
    // temporary name the user never gave.
    assert!(
        !out.contains("D.mgt.part1") && out.matches("verify step 1").count() == 1,
        "{out}"
    );
    assert!(
        out.contains("journal only")
            && out.contains(
                "which were held in host memory while the chain ran (or, after a split run,"
            ),
        "{out}"
    );
}

/// ((A·B)·C)·D with T1 = A·B (352 KiB) in memory and T2 = T1·C (703 KiB, which does not fit
/// beside T1 in a 512 KiB budget) in a file. The last part fails after T2 completed: the rerun
/// resumes it from T2's file without computing T1 again, to the bytes of an uninterrupted run.
#[test]
fn a_memory_intermediate_whose_reader_is_complete_is_not_recomputed() {
    let d = tmp();
    let dir = d.path();
    let shapes = [
        ("A", 300, 300),
        ("B", 300, 300),
        ("C", 300, 600),
        ("D", 600, 900),
    ];
    let mut mats = String::new();
    for (i, (name, r, c)) in shapes.into_iter().enumerate() {
        let p = dir.join(format!("{name}.mgt"));
        gen(&p, r, c, DType::F32, (64, 64), Dist::Uniform, i as u64 + 1);
        mats += &format!("[matrices.{name}]\npath = \"{name}.mgt\"\n");
    }
    let eng = engine("cpu", "1MiB");
    for (name, out) in [("p.toml", "E.mgt"), ("ref.toml", "E_ref.mgt")] {
        std::fs::write(
            dir.join(name),
            format!("{mats}[[step]]\noutput = \"{out}\"\nexpr = \"A @ B @ C @ D\"\n{eng}"),
        )
        .unwrap();
    }
    let p = Plan::load(&dir.join("p.toml")).unwrap();
    let c = p.steps[2].chain.clone().unwrap();
    assert_eq!(c.order, "(((A @ B) @ C) @ D)");
    assert_eq!(c.memory, [dir.join("E.mgt.part1.mgt")]);
    assert_eq!(c.temps.len(), 2);
    run_file(dir, "ref.toml", None).0.unwrap();

    // T2 has 10×13 tiles of 32×48, the last part 10×19: it fails after 150 tiles.
    let disk_full = FaultConfig {
        write_after: Some(150),
        ..Default::default()
    };
    let (r, notes) = run_file(dir, "p.toml", Some(disk_full));
    let err = r.unwrap_err().to_string();
    assert!(!err.contains("part2"), "T2 should have completed: {err}");
    assert!(notes.contains("stays in host memory"), "{notes}");
    assert!(dir.join("E.mgt.part2.mgt").exists());
    let (r, notes) = run_file(dir, "p.toml", None);
    r.unwrap();
    assert!(
        !notes.contains("stays in host memory"),
        "T1 recomputed: {notes}"
    );
    assert!(
        notes.contains("already complete") && notes.contains("resuming"),
        "{notes}"
    );
    assert!(
        bytes(dir, "E.mgt") == bytes(dir, "E_ref.mgt"),
        "resumed chain differs"
    );
    assert_eq!(part_files(dir), Vec::<String>::new());
    // `status` names the removed intermediates for what they are (it said "not started").
    let (ok, out, err) = cli(dir, &["status", "p.toml"]);
    let flat = out.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(ok, "{err}");
    for part in [1, 2] {
        let want = format!("./E.mgt.part{part}.mgt: an intermediate of the chain written to ./E.mgt (part {part} of 3)");
        assert!(flat.contains(&want), "{out}");
    }
    assert!(
        flat.contains("./E.mgt: complete (run in one process)"),
        "{out}"
    );
}

/// A device that fails inside the in-memory part of a chain is failed over without a word of
/// "resuming": nothing of an intermediate in memory is resumed from disk (the steps with a
/// journal say "resuming", and tests and users grep for it).
#[test]
fn failover_inside_the_memory_part_says_nothing_of_resuming() {
    let d = tmp();
    let dir = d.path();
    inputs(dir);
    chain_plan(
        dir,
        "fail.toml",
        "D.mgt",
        "A @ B @ C",
        &engine("sim", "32MiB"),
    );
    // Late enough that tiles of the intermediate are written before (24 k-steps a tile).
    let lane_dies = FaultConfig {
        lane: Some(1),
        gemm_after: Some(200),
        ..Default::default()
    };
    let (r, notes) = run_file(dir, "fail.toml", Some(lane_dies));
    r.unwrap();
    assert!(notes.contains("stays in host memory"), "{notes}");
    assert!(notes.contains("step 1: sim:1 failed"), "{notes}");
    assert!(!notes.contains("step 1: resuming"), "{notes}");
}
