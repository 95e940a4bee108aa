//! A long output tile survives a kill: its partial accumulator is checkpointed (here after every
//! k-chunk, `checkpoint_every = "0s"`), a run killed mid-tile (a device fault after N GEMMs)
//! resumes each unfinished tile at its saved k-chunk, computes only the GEMMs left, and writes
//! the bytes of an uninterrupted run. A corrupt checkpoint or one from other inputs is ignored
//! with a note, `--restart` discards them, and a completed step leaves none behind.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use mgmm_stream::backend::fault::FaultConfig;
use mgmm_stream::dtype::DType;
use mgmm_stream::plan::Plan;
use mgmm_stream::progress::Progress;
use mgmm_stream::run::{run_plan, RunOptions, RunReport};
use mgmm_stream::store::gen::Dist;

/// k-chunks per output tile in [`setup`] (K = 2000 in chunks of 100).
const GK: u64 = 20;

/// C = A·B (+ 0.5·C0 when `c0`), `m×2000` times `2000×n`, in tiles of 80×70 and k-chunks of
/// 100, on `backend` with one lane (so that a device fault stops the run). plan.toml writes
/// C.mgt with a checkpoint after every k-chunk; ref.toml writes C_ref.mgt without any.
fn setup(dir: &Path, backend: &str, m: u64, n: u64, c0: bool) {
    gen(
        &dir.join("A.mgt"),
        m,
        2000,
        DType::F32,
        (64, 64),
        Dist::Normal,
        1,
    );
    gen(
        &dir.join("B.mgt"),
        2000,
        n,
        DType::F32,
        (64, 64),
        Dist::Normal,
        2,
    );
    if c0 {
        gen(
            &dir.join("C0.mgt"),
            m,
            n,
            DType::F32,
            (64, 64),
            Dist::Normal,
            3,
        );
    }
    let (decl, expr) = if c0 {
        ("[matrices.C0]\npath = \"C0.mgt\"\n", "A @ B + 0.5 * C0")
    } else {
        ("", "A @ B")
    };
    for (name, out, every) in [
        ("plan.toml", "C.mgt", "0s"),
        ("ref.toml", "C_ref.mgt", "off"),
    ] {
        std::fs::write(
            dir.join(name),
            format!(
                "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n{decl}\
                 [[step]]\noutput = \"{out}\"\nexpr = \"{expr}\"\n\
                 [engine]\nbackend = \"{backend}\"\ndevices = [0]\nthreads = 1\n\
                 tile = [80, 70, 100]\nhost_memory = \"32MiB\"\ndurable = false\n\
                 checkpoint_every = \"{every}\"\n"
            ),
        )
        .unwrap();
    }
    run_file(dir, "ref.toml", None, false).0.unwrap();
}

/// Run `file` in `dir` with GEMM faults after `fail_after` GEMMs; the notes it printed and
/// its result.
fn run_file(
    dir: &Path,
    file: &str,
    fail_after: Option<u64>,
    restart: bool,
) -> (mgmm_stream::Result<RunReport>, Vec<String>) {
    let plan = Plan::load(&dir.join(file)).unwrap();
    let opts = RunOptions {
        restart,
        faults: fail_after.map(|n| FaultConfig {
            gemm_after: Some(n),
            ..Default::default()
        }),
        ..Default::default()
    };
    let lines = Arc::new(Mutex::new(Vec::new()));
    let progress = Progress::log_into(Duration::from_secs(3600), lines.clone());
    let r = run_plan(&plan, &opts, &progress);
    // Notes wrap at 80 columns: compare their words, not their line breaks. The step's
    // summary is left out (its `checkpoints:` line speaks of the run's own saves; the report
    // has them).
    let lines = (lines.lock().unwrap().iter())
        .filter(|l| !l.contains("bottleneck:"))
        .map(|l| one_line(l))
        .collect();
    (r, lines)
}

fn gemms(r: &RunReport) -> u64 {
    r.steps[0].lanes.iter().map(|l| l.stats.gemms).sum()
}

fn partial_dir(dir: &Path) -> PathBuf {
    dir.join("C.mgt.partial")
}

/// The checkpoint files on disk: (path, k-chunks done), read from their headers.
fn checkpoints(dir: &Path) -> Vec<(PathBuf, u64)> {
    let Ok(entries) = std::fs::read_dir(partial_dir(dir)) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries {
        let p = e.unwrap().path();
        if !p.is_file() {
            continue;
        }
        let bytes = std::fs::read(&p).unwrap();
        let nl = bytes.iter().position(|&b| b == b'\n').unwrap();
        let line = std::str::from_utf8(&bytes[..nl]).unwrap();
        let json = line.splitn(3, ' ').nth(2).unwrap();
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        out.push((p, v["k_done"].as_u64().unwrap()));
    }
    out.sort();
    out
}

fn same_output(dir: &Path) -> bool {
    std::fs::read(dir.join("C.mgt")).unwrap() == std::fs::read(dir.join("C_ref.mgt")).unwrap()
}

/// Run plan.toml until the device fails after `n` GEMMs; the checkpoints it left.
fn kill_after(dir: &Path, n: u64) -> Vec<(PathBuf, u64)> {
    kill_after_restart(dir, n, false)
}

fn kill_after_restart(dir: &Path, n: u64, restart: bool) -> Vec<(PathBuf, u64)> {
    let (r, _) = run_file(dir, "plan.toml", Some(n), restart);
    let Err(err) = r.map(|_| ()) else {
        panic!("the injected fault did not stop the run");
    };
    let err = err.to_string();
    assert!(err.contains("injected fault"), "{err}");
    let c = checkpoints(dir);
    assert!(!c.is_empty(), "a run killed mid-tile left no checkpoint");
    c
}

/// Resume plan.toml to completion; the report and the notes. Completion leaves no checkpoint.
fn resume(dir: &Path) -> (RunReport, Vec<String>) {
    let (r, notes) = run_file(dir, "plan.toml", None, false);
    let r = r.unwrap();
    assert!(
        same_output(dir),
        "resumed output differs from an uninterrupted run"
    );
    assert!(
        !partial_dir(dir).exists(),
        "a completed step left checkpoints: {:?}",
        checkpoints(dir)
    );
    (r, notes)
}

/// Four output tiles of 20 k-chunks, killed in the third tile: only the GEMMs not in the
/// journal or a checkpoint are computed again, and the bytes are those of a clean run.
fn kill_mid_tile_then_resume_from_checkpoint(backend: &str) {
    let d = tmp();
    let dir = d.path();
    setup(dir, backend, 150, 130, true);
    let saved = kill_after(dir, 2 * GK + 10);
    let k_saved: u64 = saved.iter().map(|c| c.1).sum();
    // `status` names the tiles whose partial sums wait in checkpoints.
    let st = std::process::Command::new(bin())
        .args(["status", "plan.toml"])
        .current_dir(dir)
        .output()
        .unwrap();
    let st = String::from_utf8_lossy(&st.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    let want = match saved.len() {
        1 => "1 unfinished tile checkpointed in ./C.mgt.partial".to_string(),
        n => format!("{n} unfinished tiles checkpointed in ./C.mgt.partial"),
    };
    assert!(st.contains("tiles done") && st.contains(&want), "{st}");
    let (r, notes) = resume(dir);
    let computed = r.steps[0].tiles_computed;
    assert_eq!(r.steps[0].checkpoint_resumed_tiles, saved.len() as u64);
    // Exactly the k-chunks neither recorded nor checkpointed, and fewer than without
    // checkpoints (every unrecorded tile from its start).
    assert_eq!(gemms(&r), computed * GK - k_saved, "{saved:?}");
    assert!(k_saved >= 1 && gemms(&r) < computed * GK, "{saved:?}");
    let want = format!("resuming {} partial tile", saved.len());
    assert!(
        notes
            .iter()
            .any(|n| n.contains(&want) && n.contains("% of") && n.contains("K done")),
        "{notes:?}"
    );
    // The report counts this run's work only.
    let flops = 2.0 * 80.0 * 70.0 * 100.0;
    assert!(
        r.steps[0].flops <= gemms(&r) as f64 * flops,
        "{}",
        r.steps[0].flops
    );
    // A step already complete leaves nothing to resume and nothing behind.
    let (r, _) = run_file(dir, "plan.toml", None, false);
    assert!(r.unwrap().steps.is_empty());
}

/// A 60×50 output of one tile of 20 k-chunks, its run stopped by a device fault after 13 GEMMs:
/// the folder and its one checkpoint.
fn one_long_tile_killed(backend: &str) -> (tempfile::TempDir, Vec<(PathBuf, u64)>) {
    let d = tmp();
    setup(d.path(), backend, 60, 50, false);
    let saved = kill_after(d.path(), 13);
    assert_eq!(saved.len(), 1);
    (d, saved)
}

/// One output tile of 20 k-chunks: the journal records nothing before the kill (the case the
/// checkpoints exist for), and the resumed run computes only the k-chunks after the saved one.
fn single_long_tile_resumes(backend: &str) {
    let (d, saved) = one_long_tile_killed(backend);
    let dir = d.path();
    // `plan` tells what `run` will do: resume the tile from its checkpoint, not start afresh.
    let plan = Plan::load(&dir.join("plan.toml")).unwrap();
    let said = mgmm_stream::run::describe(&plan).unwrap();
    let said = one_line(&said);
    assert!(
        said.contains("no output tile finished yet; 1 partial tile checkpointed (")
            && said.contains("`run` resumes it from its checkpoint"),
        "{said}"
    );
    let (r, notes) = resume(dir);
    assert_eq!(gemms(&r), GK - saved[0].1, "{saved:?}");
    assert!(gemms(&r) < GK);
    // The report's work is this run's k-chunks only (each 2·60·50·100 FLOPs).
    assert_eq!(r.steps[0].flops, (gemms(&r) * 2 * 60 * 50 * 100) as f64);
    // And what its own checkpoints cost: with "0s" one after each k-chunk but the last (the
    // tile is then written), each the 60×50 f32 accumulator and a header line.
    let s = &r.steps[0];
    assert_eq!(s.checkpoint_resumed_tiles, 1);
    assert_eq!(s.checkpoint_every_s, Some(0.0));
    assert_eq!(s.checkpoints_saved, gemms(&r) - 1, "{saved:?}");
    assert!(
        s.checkpoint_bytes > s.checkpoints_saved * 60 * 50 * 4 && s.checkpoint_s > 0.0,
        "{} bytes in {} s",
        s.checkpoint_bytes,
        s.checkpoint_s
    );
    assert!(
        notes
            .iter()
            .any(|n| n.contains("resuming 1 partial tile from checkpoints")),
        "{notes:?}"
    );
}

/// A checkpoint outlives its output: with the output deleted (the journal kept, then the
/// journal deleted too) `plan` says the step starts again and resumes the partial tile, and
/// `run` does so, to the bytes of a clean run.
fn checkpoint_without_its_output_is_resumed(backend: &str) {
    let (d, saved) = one_long_tile_killed(backend);
    let dir = d.path();
    let status = |set: &[&str]| {
        let o = std::process::Command::new(bin())
            .args(["status", "plan.toml"])
            .args(set)
            .current_dir(dir)
            .output()
            .unwrap();
        one_line(&String::from_utf8_lossy(&o.stdout))
    };
    // Another compute tile than the journal's: `run` refuses the journal, and `status` says so
    // (it said "resumes it").
    let st = status(&["--set", "engine.tile=[80, 70, 50]"]);
    assert!(
        st.contains("its journal is from the compute tile 60×50×100, the plan's is 60×50×50")
            && st.contains("refuses it"),
        "{st}"
    );
    std::fs::remove_file(dir.join("C.mgt")).unwrap();
    // `status` says the same.
    let st = status(&[]);
    assert!(
        st.contains("the output is gone")
            && st.contains("computes the step again, resuming the checkpointed tiles")
            && st.contains("1 unfinished tile checkpointed in ./C.mgt.partial ("),
        "{st}"
    );
    for (gone, want) in [
        (
            "the output",
            "C.mgt is not: `run` starts the step again; 1 partial tile checkpointed (",
        ),
        (
            "the journal",
            "no output or journal yet; 1 partial tile checkpointed (",
        ),
    ] {
        if gone == "the journal" {
            std::fs::remove_file(dir.join("C.mgt.journal")).unwrap();
        }
        let plan = Plan::load(&dir.join("plan.toml")).unwrap();
        let said = one_line(&mgmm_stream::run::describe(&plan).unwrap());
        assert!(
            said.contains(want) && said.contains("`run` resumes it from its checkpoint"),
            "{gone} deleted: {said}"
        );
    }
    let st = status(&[]);
    assert!(
        st.contains("no output or journal yet; 1 unfinished tile checkpointed in ./C.mgt.partial")
            && st.contains("resumes them where they match the step"),
        "{st}"
    );
    let (r, _) = resume(dir);
    assert_eq!(gemms(&r), GK - saved[0].1, "{saved:?}");
}

/// A checkpoint whose data or header no longer matches its CRC is never trusted: it is deleted
/// with a note and its tile computed from the start, to the same bytes.
fn corrupt_checkpoint_is_ignored(backend: &str) {
    let d = tmp();
    let dir = d.path();
    setup(dir, backend, 150, 130, true);
    // A flipped bit in the data; then a header saying one k-chunk more than was done (valid
    // JSON, so only the header's own CRC can tell).
    let data = |b: &mut Vec<u8>| {
        let last = b.len() - 5;
        b[last] ^= 0x40;
    };
    let header = |b: &mut Vec<u8>| {
        let text = String::from_utf8_lossy(&b[..200]).to_string();
        let at = text.find("\"k_done\":").unwrap() + 9;
        b[at] = if b[at] == b'9' { b'1' } else { b[at] + 1 };
    };
    for (i, corrupt) in [&data as &dyn Fn(&mut Vec<u8>), &header]
        .into_iter()
        .enumerate()
    {
        let saved = kill_after_restart(dir, 2 * GK + 10, i > 0);
        for (p, _) in &saved {
            let mut b = std::fs::read(p).unwrap();
            corrupt(&mut b);
            std::fs::write(p, b).unwrap();
        }
        let (r, notes) = resume(dir);
        assert_eq!(gemms(&r), r.steps[0].tiles_computed * GK);
        let ignored = notes
            .iter()
            .filter(|n| n.contains("ignoring the checkpoint") && n.contains("CRC"))
            .count();
        assert_eq!(ignored, saved.len(), "{notes:?}");
        assert!(
            !notes.iter().any(|n| n.contains("partial tile")),
            "{notes:?}"
        );
    }
}

/// Checkpoints of other inputs (the output and its journal deleted, A regenerated) are
/// ignored; `--restart` discards checkpoints without looking at them.
fn changed_input_or_restart_discards_checkpoints(backend: &str) {
    let d = tmp();
    let dir = d.path();
    setup(dir, backend, 150, 130, true);
    kill_after(dir, 2 * GK + 10);
    std::fs::remove_file(dir.join("C.mgt")).unwrap();
    std::fs::remove_file(dir.join("C.mgt.journal")).unwrap();
    std::fs::remove_file(dir.join("A.mgt")).unwrap();
    gen(
        &dir.join("A.mgt"),
        150,
        2000,
        DType::F32,
        (64, 64),
        Dist::Normal,
        7,
    );
    run_file(dir, "ref.toml", None, true).0.unwrap();
    let (r, notes) = resume(dir);
    assert_eq!(gemms(&r), 4 * GK);
    assert!(
        notes.iter().any(|n| n.contains("ignoring the checkpoint")
            && n.contains("different plan or different inputs")),
        "{notes:?}"
    );
    // --restart: the checkpoints of a killed run are discarded, every tile recomputed.
    kill_after_restart(dir, GK + 5, true);
    let (r, notes) = run_file(dir, "plan.toml", None, true);
    let r = r.unwrap();
    assert_eq!(gemms(&r), 4 * GK);
    assert!(!notes.iter().any(|n| n.contains("checkpoint")), "{notes:?}");
    assert!(same_output(dir) && !partial_dir(dir).exists());
}

/// A checkpoint that cannot be saved does not stop the run: here every checkpoint's name is
/// taken by a directory, so the rename of a saved one onto it fails (which defeats even root).
/// The product is finished and identical, a note says checkpoints were turned off and why, and
/// the directories stay.
fn unsaveable_checkpoint_is_a_note(backend: &str) {
    let d = tmp();
    let dir = d.path();
    setup(dir, backend, 150, 130, false);
    for seq in 0..4 {
        std::fs::create_dir_all(partial_dir(dir).join(format!("tile{seq}.ckpt"))).unwrap();
    }
    let (r, notes) = run_file(dir, "plan.toml", None, false);
    let r = r.unwrap();
    assert_eq!(r.steps[0].tiles_computed, 4);
    assert!(same_output(dir), "output differs from an uninterrupted run");
    assert!(
        notes
            .iter()
            .any(|n| n.contains("checkpoints of long tiles were turned off")
                && n.contains("checkpoint_every")),
        "{notes:?}"
    );
    assert!(checkpoints(dir).is_empty(), "{:?}", checkpoints(dir));
}

per_backend! {
    unsaveable_checkpoint => super::unsaveable_checkpoint_is_a_note;
    kill_mid_tile => super::kill_mid_tile_then_resume_from_checkpoint;
    single_long_tile => super::single_long_tile_resumes;
    checkpoint_without_output => super::checkpoint_without_its_output_is_resumed;
    corrupt_checkpoint => super::corrupt_checkpoint_is_ignored;
    changed_input_or_restart => super::changed_input_or_restart_discards_checkpoints;
}

/// Four simulated lanes, one failing mid-tile: failover resumes its tile from its checkpoint on
/// the other lanes, in the same run, to the CPU's bytes.
#[test]
fn failover_resumes_the_failed_lanes_tile() {
    use mgmm_stream::backend::fault::FaultyBackend;
    use mgmm_stream::backend::sim::SimBackend;
    let d = tmp();
    let dir = d.path();
    setup(dir, "cpu", 330, 290, false);
    let plan = Plan::load(&dir.join("plan.toml")).unwrap();
    let sim = Box::new(SimBackend::with_delays(vec![200; 4], 1 << 30));
    let cfg = FaultConfig {
        lane: Some(1),
        gemm_after: Some(GK + 7),
        ..Default::default()
    };
    let backend = Box::new(FaultyBackend::new(sim, cfg));
    let lines = Arc::new(Mutex::new(Vec::new()));
    let progress = Progress::log_into(Duration::from_secs(3600), lines.clone());
    let r = mgmm_stream::run::run_plan_on(&plan, backend, &RunOptions::default(), &progress);
    let notes = lines.lock().unwrap().clone();
    let r = r.unwrap();
    assert!(notes.iter().any(|n| n.contains("failed")), "{notes:?}");
    assert!(
        notes
            .iter()
            .any(|n| n.contains("partial tile") && n.contains("from checkpoint")),
        "{notes:?}"
    );
    // The report's checkpoints are the last attempt's, as its GEMMs are (the store outlives
    // the failover): at most one per GEMM of that attempt.
    let s = &r.steps[0];
    assert!(
        (1..gemms(&r)).contains(&s.checkpoints_saved),
        "{} checkpoints, {} GEMMs",
        s.checkpoints_saved,
        gemms(&r)
    );
    // The CPU reference of setup() computes each tile as every simulated lane does.
    assert!(same_output(dir));
    assert!(!partial_dir(dir).exists());
}

/// With 32 worker threads the output has four writeback threads: a tile's checkpoints and its
/// final block still go through one of them in order, so a run killed mid-tile resumes from its
/// checkpoints to the bytes of an uninterrupted single-threaded run, and none is left behind.
#[test]
fn four_writeback_threads_keep_each_tiles_checkpoints_in_order() {
    let d = tmp();
    let dir = d.path();
    setup(dir, "cpu", 150, 130, true);
    let p = dir.join("plan.toml");
    let text = std::fs::read_to_string(&p).unwrap();
    std::fs::write(&p, text.replace("threads = 1", "threads = 32")).unwrap();
    let saved = kill_after(dir, 2 * GK + 10);
    let k_saved: u64 = saved.iter().map(|c| c.1).sum();
    assert!(k_saved >= 1, "{saved:?}");
    let (r, _) = resume(dir);
    assert_eq!(
        gemms(&r),
        r.steps[0].tiles_computed * GK - k_saved,
        "{saved:?}"
    );
    let names: Vec<&str> = (r.steps[0].busy_shares.iter())
        .map(|s| s.0.as_str())
        .filter(|n| n.starts_with("writeback"))
        .collect();
    assert_eq!(names.len(), 4, "{names:?}");
    assert!(same_output(dir), "output differs from an uninterrupted run");
    assert!(checkpoints(dir).is_empty(), "{:?}", checkpoints(dir));
}
