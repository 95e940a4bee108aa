//! Jobs survive: SIGKILL at random moments and resume to a bitwise-identical result, a write
//! failure mid-run stops cleanly and resumes, journals from other plans or inputs are refused,
//! a second writer fails at once, and the file-size limit is a clear error.

use crate::common::*;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use mgmm_stream::dtype::DType;
use mgmm_stream::store::gen::{Dist, Rng};

fn setup(dir: &Path, durable: bool) {
    setup_tiles(dir, durable, "[96, 112, 128]");
}

fn setup_tiles(dir: &Path, durable: bool, tile: &str) {
    gen(
        &dir.join("A.mgt"),
        1100,
        1300,
        DType::F32,
        (100, 100),
        Dist::Normal,
        1,
    );
    gen(
        &dir.join("B.mgt"),
        1300,
        1200,
        DType::F32,
        (100, 100),
        Dist::Normal,
        2,
    );
    for (name, out) in [("plan.toml", "C.mgt"), ("ref.toml", "C_ref.mgt")] {
        std::fs::write(
            dir.join(name),
            format!(
                "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n\
                 [[step]]\noutput = \"{out}\"\nexpr = \"A @ B\"\n\
                 [engine]\nbackend = \"cpu\"\ntile = {tile}\nhost_memory = \"32MiB\"\ndurable = {durable}\n"
            ),
        )
        .unwrap();
    }
}

/// `run plan.toml` with one test-only fault hook set in its environment.
fn run_with(dir: &Path, env: (&str, &str)) -> std::process::Output {
    Command::new(bin())
        .args(["run", "plan.toml"])
        .env(env.0, env.1)
        .current_dir(dir)
        .output()
        .unwrap()
}

fn run(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(bin())
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

#[test]
fn sigkill_at_random_moments_then_resume_is_bitwise_identical() {
    let d = tmp();
    let dir = d.path();
    setup_tiles(dir, true, "[48, 64, 128]");
    let t = Instant::now();
    let o = run(dir, &["run", "ref.toml", "--quiet"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let full = t.elapsed();
    let reference = std::fs::read(dir.join("C_ref.mgt")).unwrap();
    let mut g = Rng::new(99, 0);
    let mut killed = 0;
    let journal = dir.join("C.mgt.journal");
    let jlen = || std::fs::metadata(&journal).map(|m| m.len()).unwrap_or(0);
    for i in 0..14 {
        let before = jlen();
        let mut child = Command::new(bin())
            .args(["run", "plan.toml", "--quiet"])
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        if i % 2 == 0 {
            // A purely random moment early in the run: startup, journal creation, first tiles.
            std::thread::sleep(full.mul_f64(0.1 * g.unit()));
        } else {
            // A random moment after this run has finished at least one more tile.
            let t = Instant::now();
            while jlen() <= before && t.elapsed() < 2 * full && child.try_wait().unwrap().is_none()
            {
                std::thread::sleep(Duration::from_micros(200));
            }
            std::thread::sleep(full.mul_f64(0.05 * g.unit()));
        }
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap(); // SIGKILL
            killed += 1;
        }
        let _ = child.wait();
    }
    eprintln!("killed {killed} runs mid-way; an uninterrupted run took {full:?}");
    assert!(
        killed >= 10,
        "only {killed} runs were still going when killed (full run took {full:?})"
    );
    let o = run(dir, &["run", "plan.toml"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let out = std::fs::read(dir.join("C.mgt")).unwrap();
    assert!(
        out == reference,
        "resumed output differs from an uninterrupted run"
    );
    let o = run(dir, &["info", "C.mgt", "--check"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn write_failure_stops_cleanly_and_resume_completes() {
    let d = tmp();
    let dir = d.path();
    setup(dir, false);
    assert!(run(dir, &["run", "ref.toml", "--quiet"]).status.success());
    let o = run_with(dir, ("MGMM_FAULT_WRITE_AFTER", "20"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("C.mgt") && err.contains("No space left"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let o = run(dir, &["run", "plan.toml"]);
    // Notes wrap at 80 columns: compare with line breaks as spaces.
    let err = String::from_utf8_lossy(&o.stderr)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("resuming") && err.contains("20 of 132 output tiles already done"),
        "{err}"
    );
    assert!(
        std::fs::read(dir.join("C.mgt")).unwrap() == std::fs::read(dir.join("C_ref.mgt")).unwrap()
    );
    // A completed step is not recomputed.
    let o = run(dir, &["run", "plan.toml"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("already complete"));
}

/// Copy every file of `from` into `to` (a job folder moved or copied whole, as `cp -r` does:
/// new inodes, new modification times).
fn copy_folder(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
        }
    }
}

#[test]
fn a_job_folder_copied_elsewhere_resumes_and_verifies_there() {
    let d = tmp();
    let dir = d.path().join("job");
    std::fs::create_dir(&dir).unwrap();
    setup(&dir, false);
    assert!(run(&dir, &["run", "ref.toml", "--quiet"]).status.success());
    let o = run_with(&dir, ("MGMM_FAULT_WRITE_AFTER", "20"));
    assert!(!o.status.success());
    // Half done, moved: the journal names the old paths, the inputs are the same content.
    let moved = d.path().join("moved");
    copy_folder(&dir, &moved);
    std::fs::remove_dir_all(&dir).unwrap();
    let o = run(&moved, &["run", "plan.toml"]);
    let err = String::from_utf8_lossy(&o.stderr)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(o.status.success(), "{err}");
    assert!(err.contains("20 of 132 output tiles already done"), "{err}");
    assert!(
        std::fs::read(moved.join("C.mgt")).unwrap()
            == std::fs::read(moved.join("C_ref.mgt")).unwrap()
    );
    // Finished, copied again: complete there, and `verify` passes on the journal's inputs.
    let again = d.path().join("again");
    copy_folder(&moved, &again);
    let o = run(&again, &["run", "plan.toml"]);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("already complete"),
        "{o:?}"
    );
    let o = run(&again, &["verify", "plan.toml"]);
    assert!(o.status.success(), "{o:?}");
    // Other content under the old name is still refused.
    std::fs::remove_file(again.join("B.mgt")).unwrap();
    gen(
        &again.join("B.mgt"),
        1300,
        1200,
        DType::F32,
        (100, 100),
        Dist::Normal,
        3,
    );
    let o = run(&again, &["verify", "plan.toml"]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("input B: was"),
        "{o:?}"
    );
}

#[test]
fn journal_from_different_inputs_is_refused_until_restart() {
    let d = tmp();
    let dir = d.path();
    setup(dir, false);
    let o = run_with(dir, ("MGMM_FAULT_WRITE_AFTER", "3"));
    assert!(!o.status.success());
    std::fs::remove_file(dir.join("B.mgt")).unwrap();
    gen(
        &dir.join("B.mgt"),
        1300,
        1200,
        DType::F32,
        (100, 100),
        Dist::Normal,
        3,
    );
    let before = digest(&dir.join("C.mgt"));
    let o = run(dir, &["run", "plan.toml"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("different plan or different inputs")
            && err.contains("input B")
            && err.contains("--restart"),
        "{err}"
    );
    assert_eq!(
        before,
        digest(&dir.join("C.mgt")),
        "a refused run must not touch the output"
    );
    let o = run(dir, &["run", "plan.toml", "--restart", "--quiet"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn existing_output_without_journal_is_not_overwritten() {
    let d = tmp();
    let dir = d.path();
    setup(dir, false);
    std::fs::write(dir.join("C.mgt"), b"precious").unwrap();
    let o = run(dir, &["run", "plan.toml"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && err.contains("not written by this plan")
            && err.contains("--restart"),
        "{err}"
    );
    assert_eq!(std::fs::read(dir.join("C.mgt")).unwrap(), b"precious");
    // The refused run leaves no journal behind.
    assert!(!dir.join("C.mgt.journal").exists());
}

#[test]
fn a_second_writer_fails_at_once() {
    use std::os::fd::AsRawFd;
    let d = tmp();
    let dir = d.path();
    setup(dir, false);
    // Another run holds the journal lock (the run waits up to a second for it, then says so).
    let j = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("C.mgt.journal"))
        .unwrap();
    assert_eq!(
        unsafe { libc::flock(j.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
        0
    );
    let t = Instant::now();
    let o = run(dir, &["run", "plan.toml"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("another mgmm-stream run"),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(10));
    assert!(!dir.join("C.mgt").exists());
}

#[test]
fn file_size_limit_is_a_clear_error() {
    let d = tmp();
    let dir = d.path();
    setup(dir, false);
    let o = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "ulimit -f 1000; exec {} run plan.toml",
            bin().display()
        ))
        .current_dir(dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("C.mgt") && err.contains("file-size limit"),
        "{err}"
    );
    assert!(!err.contains("panicked"));
}

/// A device failing mid-run (injected through the test-only hook MGMM_FAULT_GEMM_AFTER) stops
/// the run with a message naming the device — no hang, no wrong result — and the next run
/// resumes to the same bytes as an uninterrupted run. The CUDA twin runs on the GPU machine
/// (tools/checks/fault_resume.sh).
#[test]
fn device_failure_stops_cleanly_then_resume_is_identical() {
    let d = tmp();
    let dir = d.path();
    setup(dir, false);
    assert!(run(dir, &["run", "ref.toml", "--quiet"]).status.success());
    let t = Instant::now();
    let o = run_with(dir, ("MGMM_FAULT_GEMM_AFTER", "300"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("cpu: GEMM") && err.contains("injected fault"),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(60));
    let o = run(dir, &["run", "plan.toml"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("resuming"), "{err}");
    assert!(
        std::fs::read(dir.join("C.mgt")).unwrap() == std::fs::read(dir.join("C_ref.mgt")).unwrap()
    );
}

/// A kill while the output was being created (journal header written, output cut short) does
/// not wedge the step: with no finished tile recorded, the next run starts the step afresh.
#[test]
fn kill_during_output_creation_restarts_the_step() {
    let d = tmp();
    let dir = d.path();
    setup(dir, false);
    assert!(run(dir, &["run", "ref.toml", "--quiet"]).status.success());
    let o = run_with(dir, ("MGMM_FAULT_WRITE_AFTER", "0"));
    assert!(!o.status.success());
    // Simulate the kill landing inside output creation: only the header page survived.
    set_len(&dir.join("C.mgt"), 4096);
    let o = run(dir, &["run", "plan.toml"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        std::fs::read(dir.join("C.mgt")).unwrap() == std::fs::read(dir.join("C_ref.mgt")).unwrap()
    );
}

/// A library call's resume speaks as the library does, without a plan's step number: a
/// damaged journal record is noted as "1 record in the journal damaged and skipped…", not
/// "step 1: …" (`matmul()` has no step 1), and the product is completed.
#[test]
fn a_library_calls_resume_notes_name_no_step() {
    use mgmm_stream::api::{self, FileOutput, Output, StepJob, StepSources};
    use mgmm_stream::plan::Plan;
    use mgmm_stream::progress::Progress;
    use std::sync::{Arc, Mutex};

    let d = tmp();
    let dir = d.path();
    gen(
        &dir.join("A.mgt"),
        200,
        150,
        DType::F32,
        (50, 50),
        Dist::Normal,
        1,
    );
    gen(
        &dir.join("B.mgt"),
        150,
        180,
        DType::F32,
        (50, 50),
        Dist::Normal,
        2,
    );
    std::fs::write(
        dir.join("plan.toml"),
        "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n\
         [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n\
         [engine]\nbackend = \"cpu\"\ntile = 50\ndurable = false\n",
    )
    .unwrap();
    let plan = Plan::load(&dir.join("plan.toml")).unwrap();
    let step = &plan.steps[0];
    let call = |progress: &Progress| {
        let open = |p: &Path| mgmm_stream::store::open_source(p).unwrap();
        api::run_step(StepJob {
            origin: Path::new("matmul()"),
            engine: &plan.engine,
            step,
            sources: StepSources {
                a: open(&dir.join("A.mgt")),
                b: open(&dir.join("B.mgt")),
                c0: None,
            },
            output: Output::File(Box::new(FileOutput(step.output.clone()))),
            restart: false,
            progress,
        })
    };
    call(&Progress::quiet()).unwrap().expect("computed");
    let want = std::fs::read(&step.output).unwrap();
    // The journal without its completion record, its first tile record damaged in place.
    let jp = mgmm_stream::journal::journal_path(&step.output);
    let mut j = std::fs::read(&jp).unwrap();
    j.truncate(j.len() - 16);
    let first = j.iter().position(|&b| b == b'\n').unwrap() + 1;
    j[first + 8] ^= 0xff;
    std::fs::write(&jp, &j).unwrap();

    let lines = Arc::new(Mutex::new(Vec::new()));
    let rep = call(&Progress::log_into(
        Duration::from_secs(3600),
        lines.clone(),
    ))
    .unwrap();
    assert!(rep.is_some(), "the damaged record's tile is computed again");
    let lines = lines.lock().unwrap();
    let notes: Vec<String> = (lines.iter())
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    let damaged = notes.iter().find(|n| n.contains("damaged and skipped"));
    assert!(
        damaged.is_some_and(
            |n| n.contains("1 record in the journal damaged") && !n.contains("step 1:")
        ),
        "{notes:?}"
    );
    assert_eq!(std::fs::read(&step.output).unwrap(), want);
}
