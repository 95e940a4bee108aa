//! A step split across processes (src/cluster, docs/CLUSTER.md): N processes, by `--shard` or
//! by each launcher's variables, give the bytes of one process; SIGKILLs then a rerun with
//! another process count give the same bytes; one shard is never written by two processes;
//! finalize names what is missing.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::{bin, tmp, two_step_plan};

const LAUNCHER_VARS: &[&str] = &[
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_ARRAY_TASK_COUNT",
    "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "JOB_COMPLETION_INDEX",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
];

/// A plan whose inputs are generated (deterministically) on first run: C = A·B with
/// `m×k·k×n` and compute tiles of `t`.
fn plan(dir: &Path, (m, k, n): (u64, u64, u64), t: u64) {
    std::fs::write(
        dir.join("plan.toml"),
        format!(
            "[matrices.A]\npath = \"A.mgt\"\ngenerate = {{ rows = {m}, cols = {k}, dist = \"normal\", seed = 1 }}\n\
             [matrices.B]\npath = \"B.mgt\"\ngenerate = {{ rows = {k}, cols = {n}, dist = \"normal\", seed = 2 }}\n\
             [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n\
             [engine]\nbackend = \"cpu\"\nthreads = 1\ntile = {t}\nhost_memory = \"64MiB\"\n"
        ),
    )
    .unwrap();
}

fn cmd(dir: &Path, args: &[&str], env: &[(&str, String)]) -> Command {
    let mut c = Command::new(bin());
    c.args(args).current_dir(dir);
    for v in LAUNCHER_VARS {
        c.env_remove(v);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

fn spawn(dir: &Path, args: &[&str], env: &[(&str, String)]) -> Child {
    cmd(dir, args, env)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Run `plan.toml`'s shards 0/s … s-1/s one after another, each succeeding.
fn run_shards(dir: &Path, s: u32) {
    for k in 0..s {
        let shard = format!("{k}/{s}");
        ok(
            cmd(dir, &["run", "plan.toml", "-q", "--shard", &shard], &[])
                .output()
                .unwrap(),
        );
    }
}

fn ok(o: Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "failed: {err}");
    err + &String::from_utf8_lossy(&o.stdout)
}

/// The bytes of C from one process.
fn single(size: (u64, u64, u64), t: u64) -> Vec<u8> {
    let d = tmp();
    plan(d.path(), size, t);
    ok(cmd(d.path(), &["run", "plan.toml", "-q"], &[])
        .output()
        .unwrap());
    std::fs::read(d.path().join("C.mgt")).unwrap()
}

const SMALL: (u64, u64, u64) = (300, 200, 260);

#[test]
fn n_processes_by_shard_flag_and_by_each_launcher_match_one_process() {
    let reference = single(SMALL, 64);
    type Env = Vec<(&'static str, String)>;
    type Procs = Vec<(Vec<String>, Env)>;
    let cases: Vec<(&str, Procs)> = vec![
        (
            "--shard K/3",
            (0..3)
                .map(|k| (vec!["--shard".into(), format!("{k}/3")], vec![]))
                .collect(),
        ),
        (
            "SLURM_PROCID",
            (0..4)
                .map(|r| {
                    (
                        vec![],
                        vec![
                            ("SLURM_PROCID", r.to_string()),
                            ("SLURM_NTASKS", "4".into()),
                        ],
                    )
                })
                .collect(),
        ),
        (
            "SLURM array",
            (0..3)
                .map(|r| {
                    (
                        vec![],
                        vec![
                            ("SLURM_ARRAY_TASK_ID", r.to_string()),
                            ("SLURM_ARRAY_TASK_COUNT", "3".into()),
                        ],
                    )
                })
                .collect(),
        ),
        (
            "JOB_COMPLETION_INDEX",
            (0..3)
                .map(|r| {
                    (
                        vec!["--shards".into(), "3".into()],
                        vec![("JOB_COMPLETION_INDEX", r.to_string())],
                    )
                })
                .collect(),
        ),
        (
            "OMPI",
            (0..2)
                .map(|r| {
                    (
                        vec![],
                        vec![
                            ("OMPI_COMM_WORLD_RANK", r.to_string()),
                            ("OMPI_COMM_WORLD_SIZE", "2".into()),
                        ],
                    )
                })
                .collect(),
        ),
        (
            "PMI",
            (0..3)
                .map(|r| {
                    (
                        vec!["--shards".into(), "7".into()],
                        vec![("PMI_RANK", r.to_string()), ("PMI_SIZE", "3".into())],
                    )
                })
                .collect(),
        ),
    ];
    for (name, procs) in cases {
        let d = tmp();
        plan(d.path(), SMALL, 64);
        let children: Vec<Child> = procs
            .iter()
            .map(|(args, env)| {
                let mut a = vec!["run", "plan.toml"];
                a.extend(args.iter().map(String::as_str));
                spawn(d.path(), &a, env)
            })
            .collect();
        for c in children {
            ok(c.wait_with_output().unwrap());
        }
        let out = std::fs::read(d.path().join("C.mgt")).unwrap();
        assert!(out == reference, "{name}: output differs from one process");
        ok(cmd(d.path(), &["info", "C.mgt", "--check"], &[])
            .output()
            .unwrap());
        // The merged journal marks the step complete: a plain run skips it.
        let e = ok(cmd(d.path(), &["run", "plan.toml"], &[]).output().unwrap());
        assert!(e.contains("already complete"), "{name}: {e}");
    }
}

/// A whole-expression chain split between processes: its second part waits for its first to
/// be finalized (it started at once, read the first part's unwritten file and, with the inputs'
/// checks off, finished a wrong output silently), and two processes give one process's bytes.
#[test]
fn a_split_chains_second_part_waits_for_its_first() {
    let text = "[matrices.A]\npath = \"A.mgt\"\ngenerate = { rows = 200, cols = 150, seed = 1 }\n\
                [matrices.B]\npath = \"B.mgt\"\ngenerate = { rows = 150, cols = 160, seed = 2 }\n\
                [matrices.C]\npath = \"C.mgt\"\ngenerate = { rows = 160, cols = 10, seed = 3 }\n\
                [[step]]\noutput = \"W.mgt\"\nexpr = \"A @ B @ C\"\n\
                [engine]\nbackend = \"cpu\"\nthreads = 1\ntile = 32\nverify_inputs = false\n";
    let one = tmp();
    std::fs::write(one.path().join("plan.toml"), text).unwrap();
    ok(cmd(one.path(), &["run", "plan.toml", "-q"], &[])
        .output()
        .unwrap());
    let reference = std::fs::read(one.path().join("W.mgt")).unwrap();
    let d = tmp();
    let dir = d.path();
    std::fs::write(dir.join("plan.toml"), text).unwrap();
    // Alone, shard 1 of 2 cannot finish the first part, so the second must not start.
    let o = cmd(
        dir,
        &["run", "plan.toml", "--shard", "1/2", "--wait-timeout", "2"],
        &[],
    )
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("part1"), "{err}");
    assert!(
        !err.contains("checksum mismatch") && !dir.join("W.mgt").exists(),
        "{err}"
    );
    let said = ok(cmd(dir, &["run", "plan.toml", "--shard", "0/2"], &[])
        .output()
        .unwrap());
    // The shards write the intermediate's file, and say so (they said "held in memory").
    assert!(
        said.contains("W.mgt.part1.mgt") && !said.contains("held in memory"),
        "{said}"
    );
    ok(cmd(dir, &["run", "plan.toml", "--shard", "1/2"], &[])
        .output()
        .unwrap());
    assert!(std::fs::read(dir.join("W.mgt")).unwrap() == reference);
    // The split run keeps the intermediate for its processes; a plain run of the plan finds the
    // chain complete and removes it with its shards' folder (the folder stayed: `status`
    // called the intermediate "not yet finalized" and `finalize` failed on its removed file).
    let e = ok(cmd(dir, &["run", "plan.toml"], &[]).output().unwrap());
    assert!(e.contains("already complete"), "{e}");
    let left: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("part1"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    let st = ok(cmd(dir, &["status", "plan.toml"], &[]).output().unwrap());
    assert!(
        st.contains("an intermediate of the chain written to ./W.mgt")
            && !st.contains("not yet finalized"),
        "{st}"
    );
    let f = ok(cmd(dir, &["finalize", "plan.toml"], &[]).output().unwrap());
    assert!(
        f.contains(
            "an intermediate of the chain written to ./W.mgt, removed once the chain completed"
        ) && f.contains("./W.mgt is already finalized"),
        "{f}"
    );
    assert!(std::fs::read(dir.join("W.mgt")).unwrap() == reference);
}

#[test]
fn finalize_refuses_and_names_missing_shards_then_status_and_rerun_complete() {
    let reference = single(SMALL, 64);
    let d = tmp();
    let dir = d.path();
    plan(dir, SMALL, 64);
    for k in [0, 2] {
        let s = format!("{k}/3");
        ok(cmd(dir, &["run", "plan.toml", "--shard", &s], &[])
            .output()
            .unwrap());
    }
    let o = cmd(dir, &["finalize", "plan.toml"], &[]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "finalize must refuse: {err}");
    assert!(err.contains("shard 1/3"), "{err}");
    assert!(
        !err.contains("shard 0/3") && !err.contains("shard 2/3"),
        "{err}"
    );
    let st = ok(cmd(dir, &["status", "plan.toml"], &[]).output().unwrap());
    assert!(st.contains("shard   1/3") && st.contains("waiting"), "{st}");
    assert!(st.contains("shard   0/3") && st.contains("done"), "{st}");
    // Meanwhile the output is unfinished, not corrupt, to `verify`, `export` and `info --check`.
    let o = cmd(dir, &["verify", "plan.toml"], &[]).output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(!o.status.success() && out.contains("split run"), "{out}");
    for args in [
        &["export", "C.mgt", "C.npy"][..],
        &["info", "C.mgt", "--check"],
    ] {
        let o = cmd(dir, args, &[]).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains("split run"), "{err}");
        assert!(!err.contains("checksum mismatch"), "{err}");
    }
    let last = ok(cmd(dir, &["run", "plan.toml", "--shard", "1/3"], &[])
        .output()
        .unwrap());
    // Progress counts within the shard: the other shards' tiles are not "resumed" work.
    assert!(last.contains("step 1/1: ./C.mgt"), "{last}");
    assert!(
        !last.contains("resuming"),
        "a fresh shard starts at 0 %: {last}"
    );
    assert!(std::fs::read(dir.join("C.mgt")).unwrap() == reference);
    let st = ok(cmd(dir, &["status", "plan.toml"], &[]).output().unwrap());
    assert!(st.contains("FINALIZED"), "{st}");
    let f = ok(cmd(dir, &["finalize", "plan.toml", "--verify"], &[])
        .output()
        .unwrap());
    assert!(f.contains("already finalized") && f.contains("PASS"), "{f}");
}

#[test]
fn a_refused_prepare_leaves_no_claim_behind() {
    let d = tmp();
    let dir = d.path();
    plan(dir, SMALL, 64);
    // An output that a split run did not prepare: refused, and it stays as it was.
    std::fs::write(dir.join("C.mgt"), b"someone else's file").unwrap();
    let o = cmd(dir, &["run", "plan.toml", "--shard", "0/2"], &[])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "must refuse: {err}");
    assert!(err.contains("not prepared for a split run"), "{err}");
    assert_eq!(
        std::fs::read(dir.join("C.mgt")).unwrap(),
        b"someone else's file"
    );
    assert!(
        !dir.join("C.mgt.shards/prepare.claim").exists(),
        "the refusal left its claim: the other processes would wait for it to go stale"
    );
}

/// `prepare --restart` makes `run`'s up-front checks before it throws any output away: a step's
/// checkpoint folder that is a link is refused with the finished output left as it was (it
/// reset the output first and never looked at the folder).
#[test]
fn prepare_restart_refuses_before_it_resets_a_finished_output() {
    let d = tmp();
    let dir = d.path();
    plan(dir, SMALL, 64);
    run_shards(dir, 2);
    let done = std::fs::read(dir.join("C.mgt")).unwrap();
    std::fs::create_dir(dir.join("elsewhere")).unwrap();
    std::os::unix::fs::symlink(dir.join("elsewhere"), dir.join("C.mgt.partial")).unwrap();
    let o = cmd(dir, &["prepare", "plan.toml", "--restart"], &[])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "must refuse: {err}");
    assert!(err.contains("C.mgt.partial"), "{err}");
    assert!(
        std::fs::read(dir.join("C.mgt")).unwrap() == done,
        "the finished output was reset before the refusal"
    );
    let st = ok(cmd(dir, &["status", "plan.toml"], &[]).output().unwrap());
    assert!(st.contains("FINALIZED"), "{st}");
}

/// A step that reads no earlier step's output does not wait for those steps: with a plan of two
/// independent steps, `--shard 0/2` alone works its half of both and exits (it waited for the
/// first step's other half to be finalized: a new user's trial); `--shard 1/2` then finishes
/// and finalizes both, to one process's bytes.
#[test]
fn an_independent_step_does_not_wait_for_the_steps_before_it() {
    let one = tmp();
    two_step_plan(one.path(), "plan.toml", 128, 64);
    ok(cmd(one.path(), &["run", "plan.toml", "-q"], &[])
        .output()
        .unwrap());
    let d = tmp();
    let dir = d.path();
    two_step_plan(dir, "plan.toml", 128, 64);
    let o = cmd(
        dir,
        &["run", "plan.toml", "--shard", "0/2", "--wait-timeout", "2"],
        &[],
    )
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains("waiting for step 1"), "{err}");
    let st = ok(cmd(dir, &["status", "plan.toml"], &[]).output().unwrap());
    assert!(!st.contains("FINALIZED"), "{st}");
    ok(cmd(dir, &["run", "plan.toml", "--shard", "1/2"], &[])
        .output()
        .unwrap());
    let st = ok(cmd(dir, &["status", "plan.toml"], &[]).output().unwrap());
    assert_eq!(st.matches("FINALIZED").count(), 2, "{st}");
    assert_same(dir, one.path(), &["C.mgt", "D.mgt"]);
}

/// One process's run of plan `text`, in a folder of its own (kept alive by the result).
fn one_process(text: &str) -> tempfile::TempDir {
    let one = tmp();
    std::fs::write(one.path().join("plan.toml"), text).unwrap();
    ok(cmd(one.path(), &["run", "plan.toml", "-q"], &[])
        .output()
        .unwrap());
    one
}

/// `--shard 0/2` and `--shard 1/2` of `dir`'s plan at once, both succeeding; then each of
/// `files` must hold the bytes one process wrote in `one`.
fn two_shards_at_once_match(dir: &Path, one: &Path, files: &[&str]) {
    let args = |s| {
        [
            "run",
            "plan.toml",
            "-q",
            "--shard",
            s,
            "--wait-timeout",
            "30",
        ]
    };
    let shards: Vec<Child> = ["0/2", "1/2"]
        .iter()
        .map(|s| spawn(dir, &args(s), &[]))
        .collect();
    for c in shards {
        ok(c.wait_with_output().unwrap());
    }
    assert_same(dir, one, files);
}

/// Each of `files` in `dir` holds the bytes of the same file in `one`.
fn assert_same(dir: &Path, one: &Path, files: &[&str]) {
    for f in files {
        assert!(
            std::fs::read(dir.join(f)).unwrap() == std::fs::read(one.join(f)).unwrap(),
            "{f} differs from one process's"
        );
    }
}

/// `prepare` of a plan whose later step reads an earlier step's `.npy` output: that step waits
/// (the earlier output exists, prepared but unfinished, and an unfinished `.npy` cannot be
/// opened: `prepare` stopped there with an error, a new user's trial); the shards then prepare
/// and compute it, to one process's bytes.
#[test]
fn prepare_leaves_a_step_reading_an_unfinished_npy_for_the_shards() {
    let text = "[matrices.A]\npath = \"A.mgt\"\ngenerate = { rows = 128, cols = 128, seed = 1 }\n\
                [matrices.B]\npath = \"B.mgt\"\ngenerate = { rows = 128, cols = 128, seed = 2 }\n\
                [[step]]\nname = \"X\"\noutput = \"X.npy\"\nexpr = \"A @ B\"\n\
                [[step]]\noutput = \"D.mgt\"\nexpr = \"B.T @ A.T\"\n\
                [[step]]\noutput = \"E.npy\"\nexpr = \"X.T @ A\"\n\
                [engine]\nbackend = \"cpu\"\ntile = 64\nhost_memory = \"64MiB\"\n";
    // Two processes at once: step 3 waits for step 1's other half.
    let said = prepared_shards_match_one_process(text, &["X.npy", "D.mgt", "E.npy"]);
    assert!(
        said.contains("step 3: prepared when its input ./X.npy is finalized"),
        "{said}"
    );
}

/// `text` prepared and then run as two shards at once, to one process's bytes for `outputs`;
/// what `prepare` printed.
fn prepared_shards_match_one_process(text: &str, outputs: &[&str]) -> String {
    let one = one_process(text);
    let d = tmp();
    let dir = d.path();
    std::fs::write(dir.join("plan.toml"), text).unwrap();
    let said = ok(cmd(dir, &["prepare", "plan.toml"], &[]).output().unwrap());
    two_shards_at_once_match(dir, one.path(), outputs);
    said
}

/// A chain part that multiplies none of an earlier step's output still waits for it when the
/// chain holds it: `C @ D @ E` is computed `C @ (D @ E)`, and its first part (`D @ E`) records
/// every leaf's identity, C's too — it fingerprinted C unfinished and every later process then
/// refused the step as "prepared for a different plan" (cold review).
#[test]
fn a_chain_part_waits_for_an_earlier_output_among_its_leaves() {
    let text = "[matrices.A]\npath = \"A.mgt\"\ngenerate = { rows = 128, cols = 128, seed = 1 }\n\
                [matrices.B]\npath = \"B.mgt\"\ngenerate = { rows = 128, cols = 128, seed = 2 }\n\
                [matrices.D]\npath = \"D.mgt\"\ngenerate = { rows = 128, cols = 128, seed = 3 }\n\
                [matrices.E]\npath = \"E.mgt\"\ngenerate = { rows = 128, cols = 4, seed = 4 }\n\
                [[step]]\nname = \"C\"\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n\
                [[step]]\noutput = \"W.mgt\"\nexpr = \"C @ D @ E\"\n\
                [engine]\nbackend = \"cpu\"\ntile = 64\nhost_memory = \"64MiB\"\n";
    let d = tmp();
    std::fs::write(d.path().join("plan.toml"), text).unwrap();
    let described = ok(cmd(d.path(), &["plan", "plan.toml"], &[]).output().unwrap());
    assert!(described.contains("C @ (D @ E)"), "{described}");
    prepared_shards_match_one_process(text, &["C.mgt", "W.mgt"]);
}

/// A split step's shard folder that is a link is refused by `prepare`, `prepare --restart` and
/// the shard processes alike, naming it, with the folder it points at untouched (`prepare
/// --restart` replaced the link with a folder of its own without a word: a new user's trial).
#[test]
fn a_linked_shard_folder_is_refused_and_left_alone() {
    let d = tmp();
    let dir = d.path();
    plan(dir, SMALL, 64);
    run_shards(dir, 2);
    let done = std::fs::read(dir.join("C.mgt")).unwrap();
    std::fs::rename(dir.join("C.mgt.shards"), dir.join("kept")).unwrap();
    std::os::unix::fs::symlink(dir.join("kept"), dir.join("C.mgt.shards")).unwrap();
    let listing = |p: &Path| {
        let mut v: Vec<_> = std::fs::read_dir(p)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        v.sort();
        v
    };
    let before = listing(&dir.join("kept"));
    for args in [
        &["prepare", "plan.toml", "--restart"][..],
        &["prepare", "plan.toml"][..],
        &["run", "plan.toml", "--shard", "0/2"][..],
    ] {
        let o = cmd(dir, args, &[]).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} must refuse: {err}");
        assert!(
            err.contains("C.mgt.shards") && err.contains("symbolic link"),
            "{args:?}: {err}"
        );
        assert!(
            std::fs::symlink_metadata(dir.join("C.mgt.shards"))
                .unwrap()
                .file_type()
                .is_symlink(),
            "{args:?} replaced the link"
        );
        assert_eq!(listing(&dir.join("kept")), before, "{args:?}");
        assert!(
            std::fs::read(dir.join("C.mgt")).unwrap() == done,
            "{args:?}"
        );
    }
}

/// Bigger, slower (one thread, small tiles): long enough to kill mid-run.
const SLOW: (u64, u64, u64) = (512, 1536, 512);

#[test]
fn two_processes_claiming_one_shard_never_both_write_it() {
    let d = tmp();
    let dir = d.path();
    plan(dir, SLOW, 32);
    ok(cmd(dir, &["prepare", "plan.toml"], &[]).output().unwrap());
    let first = spawn(dir, &["run", "plan.toml", "--shard", "0/1"], &[]);
    let claim = dir.join("C.mgt.shards/shard-0-of-1.claim");
    let t = Instant::now();
    while !claim.exists() && t.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(claim.exists(), "the first process never claimed the shard");
    // `prepare --restart` throws nothing away under a working shard (it deleted a running
    // job's output, which went on into the deleted file: a new user's trial).
    let o = cmd(dir, &["prepare", "plan.toml", "--restart"], &[])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && e.contains("shard 0/1 of a split run is at it")
            && e.contains("before `prepare --restart` throws the output away"),
        "{e}"
    );
    assert!(dir.join("C.mgt.shards/manifest.json").exists());
    let second = cmd(dir, &["run", "plan.toml", "--shard", "0/1"], &[])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&second.stderr);
    ok(first.wait_with_output().unwrap());
    assert!(!second.status.success(), "the second claimant ran: {err}");
    assert!(err.contains("being worked by"), "{err}");
    // Every tile was recorded exactly once: one writer.
    let j = mgmm_stream::journal::peek_file(&dir.join("C.mgt.shards/shard-0-of-1.journal"))
        .unwrap()
        .unwrap();
    let mut seqs: Vec<u32> = j.done.iter().map(|d| d.0).collect();
    let n = seqs.len();
    seqs.sort();
    seqs.dedup();
    assert_eq!(seqs.len(), n, "a tile was written twice");
    assert_eq!(n, 16 * 16);
}

/// `prepare --restart` refuses an output a one-process run is writing (its journal locked, as
/// a run holds it for the whole step), and leaves it as it was.
#[test]
fn prepare_restart_refuses_an_output_a_run_is_writing() {
    let d = tmp();
    let dir = d.path();
    plan(dir, SMALL, 64);
    ok(cmd(dir, &["run", "plan.toml", "-q"], &[]).output().unwrap());
    let before = std::fs::read(dir.join("C.mgt")).unwrap();
    let held = std::fs::File::open(dir.join("C.mgt.journal")).unwrap();
    held.lock().unwrap();
    let o = cmd(dir, &["prepare", "plan.toml", "--restart"], &[])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    let want = format!(
        "a run (pid {}) is writing it; wait for it to finish",
        std::process::id()
    );
    assert!(!o.status.success() && e.contains(&want), "{e}");
    drop(held);
    assert!(std::fs::read(dir.join("C.mgt")).unwrap() == before);
    assert!(dir.join("C.mgt.journal").exists() && !dir.join("C.mgt.shards").exists());
}

/// Tiles the shard journals of `dir/C.mgt` record so far.
fn done_tiles(dir: &Path) -> usize {
    let out = dir.join("C.mgt");
    let Ok(Some(m)) = mgmm_stream::cluster::prepare::read_manifest(&out) else {
        return 0;
    };
    mgmm_stream::cluster::recorded(&mgmm_stream::cluster::state_dir(&out), &m.fingerprint)
        .map(|r| r.len())
        .unwrap_or(0)
}

struct Lcg(u64);
impl Lcg {
    fn unit(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[test]
fn random_sigkills_then_a_different_process_count_give_identical_bytes() {
    let t = Instant::now();
    let reference = single(SLOW, 32);
    let full = t.elapsed();
    let d = tmp();
    let dir = d.path();
    plan(dir, SLOW, 32);
    ok(cmd(dir, &["prepare", "plan.toml"], &[]).output().unwrap());
    let mut g = Lcg(7);
    let mut killed_mid_run = 0;
    for round in 0..4u32 {
        // Round r: 2 + r processes over 3 + 2r shards, each killed at a random moment.
        let size = 2 + round;
        let shards = (3 + 2 * round).to_string();
        let mut kids: Vec<Child> = (0..size)
            .map(|r| {
                spawn(
                    dir,
                    &[
                        "run",
                        "plan.toml",
                        "--shards",
                        &shards,
                        "--claim-timeout",
                        "1",
                    ],
                    &[
                        ("SLURM_PROCID", r.to_string()),
                        ("SLURM_NTASKS", size.to_string()),
                    ],
                )
            })
            .collect();
        // Kill them all once the shard journals hold a random share of the tiles that grows
        // round by round (so every round is cut off mid-step), one after another at random
        // short intervals.
        let target = (256.0 * (0.15 * (round + 1) as f64 + 0.05 * g.unit())) as usize;
        let t = Instant::now();
        while done_tiles(dir) < target && t.elapsed() < 20 * full {
            std::thread::sleep(Duration::from_millis(1));
        }
        for c in kids.iter_mut() {
            std::thread::sleep(full.mul_f64(0.02 * g.unit()));
            if c.try_wait().unwrap().is_none() {
                c.kill().unwrap(); // SIGKILL
                killed_mid_run += 1;
            }
        }
        for mut c in kids {
            let _ = c.wait();
        }
    }
    let left = 256 - done_tiles(dir);
    assert!(
        killed_mid_run >= 8 && left > 0,
        "only {killed_mid_run} kills landed mid-run ({left} tiles left)"
    );
    // Finish with yet another process count and split.
    let kids: Vec<Child> = (0..3)
        .map(|r| {
            spawn(
                dir,
                &["run", "plan.toml", "--shards", "5", "--claim-timeout", "1"],
                &[("PMI_RANK", r.to_string()), ("PMI_SIZE", "3".into())],
            )
        })
        .collect();
    for c in kids {
        ok(c.wait_with_output().unwrap());
    }
    let out = std::fs::read(dir.join("C.mgt")).unwrap();
    assert!(
        out == reference,
        "output after kills and resharding differs from one process"
    );
    ok(cmd(dir, &["info", "C.mgt", "--check"], &[])
        .output()
        .unwrap());
}

#[test]
fn plan_nodes_prints_the_cluster_time_model() {
    let d = tmp();
    plan(d.path(), (400_000, 400_000, 400_000), 64);
    let o = ok(cmd(
        d.path(),
        &[
            "plan",
            "plan.toml",
            "--nodes",
            "16",
            "--gpus-per-node",
            "8",
            "--fs-bandwidth",
            "100",
        ],
        &[],
    )
    .output()
    .unwrap());
    for want in [
        "128 processes",
        "shared filesystem: read",
        "PCIe per GPU",
        "finalize",
        "2401 output tiles",
    ] {
        assert!(o.contains(want), "missing {want:?} in:\n{o}");
    }
}

/// `tile = "auto"` evens rows over a process's GPUs, but a split step's `prepare` and its shard
/// processes see different numbers (every GPU of the node against one each): split runs lay
/// the step out without it, so the shards agree with the manifest. Four simulated lanes at
/// `prepare`, one per shard process (SLURM_LOCALID, as under `srun --gpus-per-task=1`).
#[test]
fn prepare_on_all_lanes_and_shards_on_one_each_agree_on_the_auto_tile() {
    let d = tmp();
    let dir = d.path();
    std::fs::write(
        dir.join("plan.toml"),
        "[matrices.A]\npath = \"A.mgt\"\ngenerate = { rows = 1300, cols = 100, dist = \"normal\", seed = 1 }\n\
         [matrices.B]\npath = \"B.mgt\"\ngenerate = { rows = 100, cols = 200, dist = \"normal\", seed = 2 }\n\
         [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n\
         [engine]\nbackend = \"sim\"\nthreads = 1\n",
    )
    .unwrap();
    ok(cmd(dir, &["prepare", "plan.toml"], &[]).output().unwrap());
    for i in 0..2 {
        let env = [
            ("SLURM_PROCID", i.to_string()),
            ("SLURM_NTASKS", "2".to_string()),
            ("SLURM_NTASKS_PER_NODE", "2".to_string()),
            ("SLURM_LOCALID", i.to_string()),
        ];
        ok(cmd(dir, &["run", "plan.toml", "-q"], &env)
            .output()
            .unwrap());
    }
    ok(cmd(dir, &["finalize", "plan.toml"], &[]).output().unwrap());
    let v = ok(cmd(dir, &["verify", "plan.toml"], &[]).output().unwrap());
    assert!(v.contains("PASS"), "{v}");
}

/// A split step with a `.npy` output writes a real `.npy`: `prepare`, two shards and
/// `finalize` give the bytes one process gives (data at its 4096-byte offset, the real header),
/// and `finalize` writes the checksum sidecar; until then the header is one numpy refuses.
/// [`plan`] with a `.npy` output (SMALL, tile 64).
fn npy_plan(dir: &Path) {
    plan(dir, SMALL, 64);
    let p = dir.join("plan.toml");
    let text = std::fs::read_to_string(&p).unwrap();
    std::fs::write(&p, text.replace("output = \"C.mgt\"", "output = \"C.npy\"")).unwrap();
}

/// One process's `.npy` output of [`npy_plan`]: its folder and its bytes.
fn one_npy() -> (tempfile::TempDir, Vec<u8>) {
    let one = tmp();
    npy_plan(one.path());
    ok(cmd(one.path(), &["run", "plan.toml", "-q"], &[])
        .output()
        .unwrap());
    let reference = std::fs::read(one.path().join("C.npy")).unwrap();
    (one, reference)
}

#[test]
fn a_split_npy_output_is_the_npy_one_process_writes() {
    let (one, reference) = one_npy();
    assert_eq!(&reference[..6], b"\x93NUMPY");

    // A shard on a local disk writes as one process does (through the map: `write = "auto"`),
    // and with `pwrite` when told to (what it always does off a local disk): the same bytes.
    for (write, want) in [("auto", "mmap"), ("pwrite", "pwrite")] {
        let d = tmp();
        let dir = d.path();
        npy_plan(dir);
        let p = dir.join("plan.toml");
        let text = std::fs::read_to_string(&p).unwrap();
        std::fs::write(&p, format!("{text}write = \"{write}\"\n")).unwrap();
        split_npy_matches(dir, one.path(), &reference, want);
    }
}

fn split_npy_matches(dir: &Path, one: &Path, reference: &[u8], want_mode: &str) {
    ok(cmd(dir, &["prepare", "plan.toml"], &[]).output().unwrap());
    let head = std::fs::read(dir.join("C.npy")).unwrap();
    assert_eq!(
        &head[..6],
        b"\x93NUMPY",
        "prepare writes a .npy, not {:?}",
        String::from_utf8_lossy(&head[..8])
    );
    assert!(
        String::from_utf8_lossy(&head[10..200]).starts_with("'UNFINISHED"),
        "a prepared output's header is one numpy refuses"
    );
    for k in 0..2 {
        let rep = format!("r{k}.json");
        ok(cmd(
            dir,
            &[
                "run",
                "plan.toml",
                "-q",
                "--shard",
                &format!("{k}/2"),
                "--report",
                &rep,
            ],
            &[],
        )
        .output()
        .unwrap());
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(&rep)).unwrap()).unwrap();
        assert_eq!(r["steps"][0]["write_mode"], want_mode, "shard {k}/2");
    }
    // The last shard finalizes the step; an explicit finalize says so.
    ok(cmd(dir, &["finalize", "plan.toml"], &[]).output().unwrap());
    let split = std::fs::read(dir.join("C.npy")).unwrap();
    assert_eq!(&split[..8], b"\x93NUMPY\x01\x00");
    assert_eq!(split.len(), reference.len());
    assert!(
        split == reference,
        "the split .npy differs from one process's"
    );
    let side = std::fs::read(dir.join("C.npy.crc32c")).expect("finalize writes the sidecar");
    assert_eq!(
        side,
        std::fs::read(one.join("C.npy.crc32c")).unwrap(),
        "the same checksum sidecar as one process's"
    );
    let o = ok(cmd(dir, &["info", "C.npy", "--check"], &[])
        .output()
        .unwrap());
    assert!(o.contains("all 25 tiles OK"), "{o}");
}

/// A shard whose process died shows no ETA: its last rate is no forecast (issue 33: `status`
/// said "ETA 1 s" for a shard no process worked on), and the step's ETA says so too.
#[test]
fn status_shows_no_eta_for_a_shard_no_process_works_on() {
    let d = tmp();
    let dir = d.path();
    plan(dir, SLOW, 32);
    ok(cmd(dir, &["prepare", "plan.toml"], &[]).output().unwrap());
    let mut kid = spawn(dir, &["run", "plan.toml", "--shard", "0/2"], &[]);
    let t = Instant::now();
    while done_tiles(dir) < 8 && t.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(2));
    }
    kid.kill().unwrap(); // SIGKILL: the claim stays, its heartbeat stops
    let _ = kid.wait();
    let left = 256 - done_tiles(dir);
    assert!(
        left > 128,
        "the shard finished before the kill ({left} left)"
    );
    std::thread::sleep(Duration::from_millis(1500));
    let st = ok(
        cmd(dir, &["status", "plan.toml", "--claim-timeout", "1"], &[])
            .output()
            .unwrap(),
    );
    let flat = crate::common::one_line(&st);
    let shard0 = flat
        .split("shard 0/2:")
        .nth(1)
        .and_then(|s| s.split("shard 1/2:").next())
        .unwrap_or_else(|| panic!("no line for shard 0/2: {st}"));
    assert!(
        shard0.contains("STALE") && shard0.contains("ETA not running"),
        "{st}"
    );
    let shard1 = flat.split("shard 1/2:").nth(1).unwrap();
    assert!(
        shard1.contains("ETA not running") && shard1.contains("waiting"),
        "{st}"
    );
    let step = flat.split("shard 0/2:").next().unwrap();
    assert!(step.contains("ETA not running"), "{st}");
}

/// A split step with shards still to run: every command that names it says to run those
/// shards (a plain `run` used to refuse the output as "not written by this plan" and suggest
/// `--restart`), and a shard that finishes while others are left says the step is not done.
#[test]
fn an_unfinished_split_step_sends_the_user_to_its_shards() {
    let d = tmp();
    let dir = d.path();
    plan(dir, SMALL, 64);
    ok(cmd(dir, &["prepare", "plan.toml"], &[]).output().unwrap());
    let o = cmd(dir, &["run", "plan.toml", "--shard", "1/2"], &[])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("not finished until the other shards run"),
        "{err}"
    );
    let o = cmd(dir, &["run", "plan.toml"], &[]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!o.status.success());
    assert!(
        err.contains("a split run is writing this output") && err.contains("--shard K/S"),
        "{err}"
    );
    assert!(!err.contains("not written by this plan"), "{err}");
    let info = cmd(dir, &["info", "C.mgt"], &[]).output().unwrap();
    let text = String::from_utf8_lossy(&info.stdout).to_string();
    assert!(
        text.contains("UNFINISHED") && text.contains("--shard K/S"),
        "{text}"
    );
    // What the messages say works: the shard left, then the step is whole.
    ok(cmd(dir, &["run", "plan.toml", "--shard", "0/2"], &[])
        .output()
        .unwrap());
    ok(cmd(dir, &["verify", "plan.toml"], &[]).output().unwrap());
}

/// `verify` of a split `.npy` step with shards left says so on the step's FAIL line, as for a
/// `.mgt` (an unfinished `.npy` cannot be opened as a matrix: verify stopped with that error,
/// no `verify step` line and no word of the shards: a new user's trial); then it passes.
#[test]
fn verify_of_an_unfinished_split_npy_step_names_the_shards_left() {
    let d = tmp();
    let dir = d.path();
    npy_plan(dir);
    ok(cmd(dir, &["prepare", "plan.toml"], &[]).output().unwrap());
    ok(cmd(dir, &["run", "plan.toml", "--shard", "1/2"], &[])
        .output()
        .unwrap());
    let o = cmd(dir, &["verify", "plan.toml"], &[]).output().unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(!o.status.success(), "{out}{err}");
    assert!(
        out.contains("verify step 1 (./C.npy): FAIL")
            && out.contains("a split run's shards are")
            && err.contains("`run PLAN --shard K/S` for the shards left"),
        "{out}{err}"
    );
    ok(cmd(dir, &["run", "plan.toml", "--shard", "0/2"], &[])
        .output()
        .unwrap());
    let out = ok(cmd(dir, &["verify", "plan.toml"], &[]).output().unwrap());
    assert!(out.contains("PASS"), "{out}");
}

/// A split step its journal calls finished, whose output is gone: `run --shard` refuses (it
/// could race the job's other processes) and names `prepare`, which computes the step again
/// alone; the bytes are those of one process.
#[test]
fn a_finished_split_output_that_is_gone_is_prepared_again() {
    let d = tmp();
    let dir = d.path();
    plan(dir, SMALL, 64);
    run_shards(dir, 2);
    let clean = std::fs::read(dir.join("C.mgt")).unwrap();
    std::fs::remove_file(dir.join("C.mgt")).unwrap();
    let o = cmd(dir, &["run", "plan.toml", "-q", "--shard", "0/2"], &[])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "a shard run over a missing finished output"
    );
    assert!(
        err.contains("the file is missing") && err.contains("mgmm-stream prepare PLAN"),
        "{err}"
    );
    let said = ok(cmd(dir, &["prepare", "plan.toml"], &[]).output().unwrap());
    assert!(
        said.contains("computing it again") || said.contains("ready"),
        "{said}"
    );
    run_shards(dir, 2);
    assert!(std::fs::read(dir.join("C.mgt")).unwrap() == clean);
    assert!(std::fs::read(dir.join("C.mgt")).unwrap() == single(SMALL, 64));
}

/// `finalize` takes the tiles its own process wrote in this run as they are (on a local disk
/// the page cache is the file) and reads back every other: a tile of another process whose
/// bytes no longer match its record is named, its shard's `.done` removed, and a rerun of that
/// shard ends in one process's bytes.
#[test]
fn finalize_reads_back_other_processes_tiles_and_names_one_that_changed() {
    let (_one, reference) = one_npy();

    // One process doing every shard reads nothing back.
    let d = tmp();
    npy_plan(d.path());
    let o = ok(cmd(d.path(), &["run", "plan.toml", "--shard", "0/1"], &[])
        .output()
        .unwrap());
    // On a local disk (a temporary folder on NFS or 9p reads everything back).
    if local_disk(d.path()) {
        // (the message may be wrapped to the terminal's width)
        let words = o.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(words.contains("tiles checked, 0 read back"), "{o}");
    }
    assert!(std::fs::read(d.path().join("C.npy")).unwrap() == reference);

    // Two processes: the second finalizes, reading the first one's tiles.
    let d = tmp();
    let dir = d.path();
    npy_plan(dir);
    ok(cmd(dir, &["prepare", "plan.toml"], &[]).output().unwrap());
    ok(cmd(dir, &["run", "plan.toml", "-q", "--shard", "0/2"], &[])
        .output()
        .unwrap());
    // Shard 0 holds the first rows of tiles: change one byte of the output's first row.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("C.npy"))
        .unwrap();
    use std::os::unix::fs::FileExt;
    let mut b = [0u8; 1];
    std::fs::File::open(dir.join("C.npy"))
        .unwrap()
        .read_exact_at(&mut b, 4096 + 8)
        .unwrap();
    f.write_all_at(&[b[0] ^ 0x40], 4096 + 8).unwrap();
    drop(f);
    let o = cmd(dir, &["run", "plan.toml", "--shard", "1/2"], &[])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "a changed tile must stop finalize: {err}"
    );
    assert!(
        err.contains("do not hold the bytes") && err.contains("shard 0/2"),
        "{err}"
    );
    // The rerun of shard 0 redoes its changed tile, and the last shard finalizes.
    let o = ok(cmd(dir, &["run", "plan.toml", "--shard", "0/2"], &[])
        .output()
        .unwrap());
    assert!(o.contains("finalized"), "{o}");
    assert!(
        std::fs::read(dir.join("C.npy")).unwrap() == reference,
        "after the rerun the split output is one process's"
    );
}

/// Whether `dir` is on a filesystem the engine counts as a local disk (as `fsutil::on_local_disk`:
/// ext4, XFS, btrfs, tmpfs and the like).
fn local_disk(dir: &Path) -> bool {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `st` is written by statfs, which reads the NUL-terminated path `c`.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return false;
    }
    // ext2/3/4, XFS, btrfs, tmpfs, overlayfs, ZFS, F2FS.
    [
        0xef53u32,
        0x5846_5342,
        0x9123_683e,
        0x0102_1994,
        0x794c_7630,
        0x2fc1_2fc1,
        0xf2f5_2010,
    ]
    .contains(&(st.f_type as u32))
}

/// `prepare --restart` throws every output away or none: with one step's shard folder that
/// cannot be moved (immutable), it refuses with every finished output, journal and folder left
/// as they were (it removed the first step's output, then failed on the second's folder: a new
/// user's trial). Skipped where `chattr` cannot mark a folder immutable.
#[test]
fn prepare_restart_resets_every_output_or_none() {
    let d = tmp();
    let dir = d.path();
    two_step_plan(dir, "plan.toml", 128, 64);
    run_shards(dir, 2);
    let c = std::fs::read(dir.join("C.mgt")).unwrap();
    let shards = dir.join("D.mgt.shards");
    let chattr = |flag: &str| {
        Command::new("chattr")
            .args([flag, shards.to_str().unwrap()])
            .status()
            .is_ok_and(|s| s.success())
    };
    if !chattr("+i") {
        eprintln!("skipped: chattr +i is not available here");
        return;
    }
    let o = cmd(dir, &["prepare", "plan.toml", "--restart"], &[])
        .output()
        .unwrap();
    assert!(chattr("-i"), "chattr -i");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "must refuse: {err}");
    assert!(
        err.contains("D.mgt.shards") && err.contains("every output was left as it was"),
        "{err}"
    );
    assert!(
        std::fs::read(dir.join("C.mgt")).unwrap() == c,
        "C.mgt changed"
    );
    for p in ["C.mgt.shards", "D.mgt", "D.mgt.shards"] {
        assert!(dir.join(p).exists(), "{p} was removed");
    }
    let st = ok(cmd(dir, &["status", "plan.toml"], &[]).output().unwrap());
    assert_eq!(st.matches("FINALIZED").count(), 2, "{st}");
    ok(cmd(dir, &["prepare", "plan.toml", "--restart"], &[])
        .output()
        .unwrap());
    let st = ok(cmd(dir, &["status", "plan.toml"], &[]).output().unwrap());
    assert!(!st.contains("FINALIZED"), "started over: {st}");
    assert_eq!(
        std::fs::read_dir(dir)
            .unwrap()
            .filter(|e| e
                .as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .contains(".restart-"))
            .count(),
        0,
        "nothing moved aside is left"
    );
}
