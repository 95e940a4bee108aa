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
    // `status` reads a single process's journal too (it said "not started as a split run").
    let st = run(dir, &["status", "plan.toml"]);
    let st = String::from_utf8_lossy(&st.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(
        st.contains("started in one process, not finished: 20 of 132 tiles done, 112 left; no process is running it: `mgmm-stream run plan.toml` resumes it; journal last written ")
            && st.contains("s ago"),
        "{st}"
    );
    // While a process holds the journal (as a run does for the whole step), it says so: the
    // line was the same for a running step and an abandoned one. std's `File::lock` is the
    // `flock` a run takes.
    let held = std::fs::File::open(dir.join("C.mgt.journal")).unwrap();
    held.lock().unwrap();
    let st = run(dir, &["status", "plan.toml"]);
    let st = String::from_utf8_lossy(&st.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    let me = format!(
        "20 of 132 tiles done, 112 left; a run (pid {}) is writing it",
        std::process::id()
    );
    assert!(st.contains(&me), "{st}");
    drop(held);
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
            keep_backend: false,
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
    let notes: Vec<String> = (lines.iter()).map(|l| one_line(l)).collect();
    let damaged = notes.iter().find(|n| n.contains("damaged and skipped"));
    assert!(
        damaged.is_some_and(
            |n| n.contains("1 record in the journal damaged") && !n.contains("step 1:")
        ),
        "{notes:?}"
    );
    assert_eq!(std::fs::read(&step.output).unwrap(), want);
}

/// `setup_tiles` with `.npy` outputs: `plan.toml` writes `C.npy`, `ref.toml` `C_ref.npy`.
fn setup_npy(dir: &Path, durable: bool) {
    setup_tiles(dir, durable, "[48, 64, 128]");
    for name in ["plan.toml", "ref.toml"] {
        let p = dir.join(name);
        let t = std::fs::read_to_string(&p).unwrap();
        std::fs::write(&p, t.replace(".mgt\"\nexpr", ".npy\"\nexpr")).unwrap();
    }
}

/// Whether numpy would load the `.npy` header `b` as an array: its magic, a version it
/// reads, and a header that is a dict (numpy's `_read_array_header` refuses anything else:
/// "Header is not a dictionary").
fn numpy_would_load(b: &[u8]) -> bool {
    let version_ok = matches!((b[6], b[7]), (1, 0) | (2, 0) | (3, 0));
    let text_at = if b[6] == 1 { 10 } else { 12 };
    &b[..6] == b"\x93NUMPY" && version_ok && b[text_at] == b'{'
}

/// `python3 -c CODE` in `dir` when python3 with numpy is there (`MGMM_PYTHON` names another
/// interpreter): `None` when it is not, else whether the code ran without error.
fn with_numpy(dir: &Path, code: &str) -> Option<bool> {
    let py = std::env::var("MGMM_PYTHON").unwrap_or_else(|_| "python3".into());
    let has = Command::new(&py)
        .args(["-c", "import numpy"])
        .output()
        .is_ok_and(|o| o.status.success());
    has.then(|| {
        Command::new(&py)
            .args(["-c", code])
            .current_dir(dir)
            .output()
            .unwrap()
            .status
            .success()
    })
}

/// A run killed mid-way leaves a `.npy` that numpy refuses to load (its header says it is
/// unfinished), which `info` names unfinished with the tiles done and left, `export
/// --allow-partial` reads, and the resumed run turns into the array an uninterrupted run
/// writes, byte for byte.
#[test]
fn a_killed_runs_npy_output_is_not_loadable_until_resumed() {
    let d = tmp();
    let dir = d.path();
    setup_npy(dir, true);
    let o = run(dir, &["run", "ref.toml", "--quiet"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let reference = std::fs::read(dir.join("C_ref.npy")).unwrap();
    assert!(numpy_would_load(&reference));
    // SIGKILL once the journal records a few tiles.
    let journal = dir.join("C.npy.journal");
    let records = || {
        let b = std::fs::read(&journal).unwrap_or_default();
        b.iter()
            .position(|&c| c == b'\n')
            .map_or(0, |h| (b.len() - h - 1) / 16)
    };
    let mut child = Command::new(bin())
        .args(["run", "plan.toml", "--quiet"])
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while records() < 3 && t.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_micros(200));
    }
    assert!(
        child.try_wait().unwrap().is_none(),
        "the run finished before it could be killed"
    );
    child.kill().unwrap(); // SIGKILL
    let _ = child.wait();
    let left = std::fs::read(dir.join("C.npy")).unwrap();
    assert_eq!(left.len(), reference.len());
    assert!(
        !numpy_would_load(&left),
        "a killed run's .npy has a header numpy loads: {:?}",
        String::from_utf8_lossy(&left[..120])
    );
    assert!(
        String::from_utf8_lossy(&left[10..60]).starts_with("'UNFINISHED mgmm-stream output"),
        "{:?}",
        String::from_utf8_lossy(&left[..120])
    );
    if let Some(loaded) = with_numpy(dir, "import numpy as np; np.load('C.npy')") {
        assert!(!loaded, "np.load read an unfinished output");
    }
    let unfinished_head = std::fs::read(dir.join("C.npy")).unwrap()[..4096].to_vec();
    let o = run(dir, &["info", "C.npy"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        out.contains("UNFINISHED")
            && out.contains("tiles done")
            && out.contains("left")
            && out.contains("mgmm-stream run PLAN"),
        "{out}"
    );
    let o = run(dir, &["export", "C.npy", "part.npy", "--allow-partial"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(numpy_would_load(
        &std::fs::read(dir.join("part.npy")).unwrap()
    ));
    // Nor does the engine read it as a matrix: as an input of another plan, or to import.
    std::fs::write(
        dir.join("uses.toml"),
        "[matrices.X]\npath = \"C.npy\"\n[[step]]\noutput = \"XX.mgt\"\nexpr = \"X @ X.T\"\n[engine]\nbackend = \"cpu\"\n",
    )
    .unwrap();
    for args in [&["run", "uses.toml"][..], &["import", "C.npy", "I.mgt"]] {
        let o = run(dir, args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success(),
            "{args:?} read an unfinished .npy: {err}"
        );
        assert!(err.contains("has not finished"), "{args:?}: {err}");
    }
    assert!(!dir.join("XX.mgt").exists() && !dir.join("I.mgt").exists());
    let o = run(dir, &["run", "plan.toml"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = std::fs::read(dir.join("C.npy")).unwrap();
    assert!(
        out == reference,
        "resumed .npy differs from an uninterrupted run"
    );
    assert_eq!(
        std::fs::read(dir.join("C.npy.crc32c")).unwrap(),
        std::fs::read(dir.join("C_ref.npy.crc32c")).unwrap()
    );
    if let Some(loaded) = with_numpy(dir, "import numpy as np; np.load('C.npy')") {
        assert!(loaded, "np.load refused the finished output");
    }
    let o = run(dir, &["info", "C.npy", "--check"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!String::from_utf8_lossy(&o.stdout).contains("UNFINISHED"));

    // The journal complete but the header still unfinished (`durable = false` and a crash
    // before the finished header reached the disk): `verify` does not pass it, and `run` writes
    // the finished header again instead of skipping the step.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("C.npy"))
            .unwrap();
        f.write_all_at(&unfinished_head, 0).unwrap();
    }
    let o = run(dir, &["verify", "plan.toml"]);
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "verify passed an unfinished header: {text}"
    );
    assert!(text.contains("not finished"), "{text}");
    let o = run(dir, &["run", "plan.toml"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("still marks it unfinished"), "{err}");
    assert!(std::fs::read(dir.join("C.npy")).unwrap() == reference);
}

/// With `durable = true` the output's header and size, the output's and the journal's names
/// in their folder are synced before the first tile is recorded (`MGMM_FAULT_SYNC_LOG`, the
/// test hook that logs every sync and journal record in order). What this shows is the order
/// of the `fsync` calls; that the disk keeps what was synced across a power cut is the
/// kernel's promise, which no test here can cut the power to check.
#[test]
fn the_header_and_directory_entries_are_synced_before_the_first_tile_is_recorded() {
    for out in ["C.mgt", "C.npy"] {
        let d = tmp();
        let dir = d.path();
        if out == "C.npy" {
            setup_npy(dir, true);
        } else {
            setup(dir, true);
        }
        let log = dir.join("syncs.log");
        let o = Command::new(bin())
            .args(["run", "plan.toml", "--quiet"])
            .env("MGMM_FAULT_SYNC_LOG", &log)
            .env("MGMM_FAULT_WRITE_AFTER", "4")
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(!o.status.success());
        let canon = std::fs::canonicalize(dir).unwrap();
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let at = |want: String| lines.iter().position(|l| *l == want);
        let first_record = at(format!(
            "record {}",
            canon.join(format!("{out}.journal")).display()
        ))
        .unwrap_or_else(|| panic!("{out}: no journal record logged:\n{text}"));
        let output_synced = at(format!("file {}", canon.join(out).display()));
        let dir_synced = at(format!("dir {}", canon.display()));
        let journal_synced = at(format!(
            "file {}",
            canon.join(format!("{out}.journal")).display()
        ));
        for (what, i) in [
            ("the output's header", output_synced),
            ("the folder's entries", dir_synced),
            ("the journal's header", journal_synced),
        ] {
            assert!(
                i.is_some_and(|i| i < first_record),
                "{out}: {what} not synced before the first tile was recorded:\n{text}"
            );
        }
        // The folder is synced after the output was created, not only before.
        let last_dir = lines
            .iter()
            .rposition(|l| *l == format!("dir {}", canon.display()));
        assert!(last_dir > output_synced, "{out}:\n{text}");
        // And the header read back through a fresh open is the output's (not zeros).
        let head = std::fs::read(dir.join(out)).unwrap();
        assert!(head.starts_with(b"MGMTILE1") || head.starts_with(b"\x93NUMPY"));
    }
}
