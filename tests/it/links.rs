//! Files written where they must not be: temporaries at predictable names, outputs, reports
//! and checkpoint folders that are links, `import` at its final name, and the file-size limit.
//! A link planted by someone else never has its target written or emptied, and what a command
//! leaves at a final name is a regular file of its own (docs/RESILIENCE.md, "Temporary files
//! and links").

use crate::common::*;

use std::os::unix::fs::MetadataExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Output};

const VICTIM: &[u8] = b"precious bytes that are not ours to write\n";

fn mg(dir: &Path, args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

/// `sh -c SCRIPT` in `dir`, where `$MG` is the binary; `exec $MG …` keeps the shell's pid, so
/// `$$` names the pid the command will have.
fn sh(dir: &Path, script: &str) -> Output {
    Command::new("sh")
        .arg("-c")
        .arg(script)
        .env("MG", bin())
        .current_dir(dir)
        .output()
        .unwrap()
}

fn ok(o: &Output) {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

fn failed_with(o: &Output, needles: &[&str]) -> String {
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!o.status.success(), "expected failure:\n{err}");
    assert!(
        o.status.signal().is_none(),
        "killed by signal {:?}, with no message:\n{err}",
        o.status.signal()
    );
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "message should mention {n:?}:\n{err}");
    }
    err
}

/// A file someone else owns, to point links at.
fn victim(dir: &Path) -> std::path::PathBuf {
    let v = dir.join("victim.txt");
    std::fs::write(&v, VICTIM).unwrap();
    v
}

fn untouched(v: &Path) {
    let now = std::fs::read(v).unwrap();
    assert!(
        now == VICTIM,
        "{} was written through a link (now {} bytes)",
        v.display(),
        now.len()
    );
}

/// `p` is a regular file (not a link) with one name.
fn own_file(p: &Path) {
    let m = std::fs::symlink_metadata(p).unwrap();
    assert!(
        m.file_type().is_file(),
        "{} is not a regular file",
        p.display()
    );
    assert_eq!(m.nlink(), 1, "{} has other names", p.display());
}

/// Temporaries left in `dir` (names with `.partial` or `.tmp`).
fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".partial") || n.contains(".tmp"))
        .collect()
}

fn inputs(dir: &Path) {
    small_inputs(dir);
}

fn plan(dir: &Path, output: &str) {
    std::fs::write(
        dir.join("p.toml"),
        format!(
            "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n\
             [[step]]\noutput = \"{output}\"\nexpr = \"A @ B\"\n\
             [engine]\nbackend = \"cpu\"\ntile = 8\n"
        ),
    )
    .unwrap();
}

/// A symlink planted at the name `gen`, `export` and a report's writer used for their temporary
/// file (`NAME.<pid>.partial`, the pid known in advance through `exec`), or at the fixed name of
/// a `.npy` output's sidecar temporary, is never followed: its target keeps its bytes, and the
/// final name is a regular file.
#[test]
fn a_link_at_a_temporary_name_is_never_followed() {
    let d = tmp();
    let dir = d.path();
    let v = victim(dir);
    ok(&sh(
        dir,
        "ln -s victim.txt G.mgt.$$.partial && exec \"$MG\" gen G.mgt --rows 40 --cols 30",
    ));
    untouched(&v);
    own_file(&dir.join("G.mgt"));
    ok(&sh(
        dir,
        "ln -s victim.txt G.npy.$$.partial && exec \"$MG\" export G.mgt G.npy",
    ));
    untouched(&v);
    own_file(&dir.join("G.npy"));
    ok(&sh(
        dir,
        "ln -s victim.txt I.mgt.$$.partial && exec \"$MG\" import G.npy I.mgt",
    ));
    untouched(&v);
    own_file(&dir.join("I.mgt"));

    inputs(dir);
    plan(dir, "C.mgt");
    ok(&sh(
        dir,
        "ln -s victim.txt r.json.$$.partial && exec \"$MG\" run p.toml -q --report r.json",
    ));
    untouched(&v);
    own_file(&dir.join("r.json"));

    plan(dir, "C.npy");
    std::os::unix::fs::symlink("victim.txt", dir.join("C.npy.crc32c.tmp")).unwrap();
    ok(&mg(dir, &["run", "p.toml", "-q"]));
    untouched(&v);
    own_file(&dir.join("C.npy"));
    own_file(&dir.join("C.npy.crc32c"));
    ok(&mg(dir, &["verify", "p.toml"]));
    // Only the links this test planted are left.
    for n in leftovers(dir) {
        let m = std::fs::symlink_metadata(dir.join(&n)).unwrap();
        assert!(m.file_type().is_symlink(), "left behind: {n}");
    }
}

/// `run --restart` over an output that is a symlink is refused (naming it, saying what to do)
/// and the link's target keeps its bytes; over an output with another hard link it writes a new
/// file, and the other name keeps its bytes. A report that is a link is replaced, not written
/// through.
#[test]
fn restart_and_report_never_write_through_links() {
    let d = tmp();
    let dir = d.path();
    let v = victim(dir);
    inputs(dir);
    plan(dir, "C.mgt");
    std::os::unix::fs::symlink("victim.txt", dir.join("C.mgt")).unwrap();
    for args in [&["run", "p.toml", "--restart"][..], &["run", "p.toml"]] {
        let o = mg(dir, args);
        failed_with(&o, &["C.mgt", "symbolic link"]);
        untouched(&v);
    }
    // `plan` says so (its status said `run --restart` would overwrite it), and so it does for
    // a link to nothing (it said nothing).
    for target in ["victim.txt", "nothing.here"] {
        std::fs::remove_file(dir.join("C.mgt")).unwrap();
        std::os::unix::fs::symlink(target, dir.join("C.mgt")).unwrap();
        let o = mg(dir, &["plan", "p.toml"]);
        let text = String::from_utf8_lossy(&o.stdout)
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        for needle in [
            "is a symbolic link: `run` refuses it, with or without `--restart`",
            "warning: `run` will refuse to start",
            "(to ",
            target,
        ] {
            assert!(text.contains(needle), "{needle:?} not in:\n{text}");
        }
        failed_with(&mg(dir, &["run", "p.toml"]), &["C.mgt", "symbolic link"]);
    }
    untouched(&v);
    std::fs::remove_file(dir.join("C.mgt")).unwrap();

    // A hard link (a `cp -al` backup, or any other name of the same inode).
    let other = dir.join("other.bin");
    std::fs::write(&other, VICTIM).unwrap();
    std::fs::hard_link(&other, dir.join("C.mgt")).unwrap();
    ok(&mg(dir, &["run", "p.toml", "--restart", "-q"]));
    untouched(&other);
    own_file(&dir.join("C.mgt"));
    ok(&mg(dir, &["verify", "p.toml"]));

    // A report that is a link to someone else's file, or has another hard link.
    std::os::unix::fs::symlink("victim.txt", dir.join("r.json")).unwrap();
    ok(&mg(
        dir,
        &["run", "p.toml", "-q", "--restart", "--report", "r.json"],
    ));
    untouched(&v);
    own_file(&dir.join("r.json"));
    assert!(std::fs::read_to_string(dir.join("r.json"))
        .unwrap()
        .contains("\"steps\""));
    std::fs::remove_file(dir.join("r.json")).unwrap();
    // A hard link to a file that is no JSON document is refused (a report replaces only
    // reports); to an earlier report, the name is replaced and the other link keeps its bytes.
    std::fs::hard_link(&other, dir.join("r.json")).unwrap();
    let o = mg(dir, &["run", "p.toml", "-q", "--report", "r.json"]);
    failed_with(&o, &["r.json", "not a report or timeline"]);
    untouched(&other);
    std::fs::remove_file(dir.join("r.json")).unwrap();
    let old = dir.join("old.json");
    std::fs::write(&old, "{\"plan\": \"an earlier report\"}\n").unwrap();
    std::fs::hard_link(&old, dir.join("r.json")).unwrap();
    ok(&mg(dir, &["run", "p.toml", "-q", "--report", "r.json"]));
    assert_eq!(
        std::fs::read_to_string(&old).unwrap(),
        "{\"plan\": \"an earlier report\"}\n"
    );
    own_file(&dir.join("r.json"));
}

/// A journal that is a symlink is named as one by every command, before anything reads
/// through it (a plain `run` used to call it "not a journal this version understands" and send
/// the user to `--restart`, which then refused the link).
#[test]
fn a_linked_journal_is_named_as_a_link_first() {
    let d = tmp();
    let dir = d.path();
    let v = victim(dir);
    inputs(dir);
    plan(dir, "C.mgt");
    ok(&mg(dir, &["run", "p.toml", "-q"]));
    std::fs::remove_file(dir.join("C.mgt.journal")).unwrap();
    std::os::unix::fs::symlink("victim.txt", dir.join("C.mgt.journal")).unwrap();
    for args in [
        &["run", "p.toml"][..],
        &["run", "p.toml", "--restart"],
        &["verify", "p.toml"],
    ] {
        let o = mg(dir, args);
        let err = failed_with(&o, &["C.mgt.journal", "symbolic link"]);
        assert!(!err.contains("understands"), "{err}");
        untouched(&v);
    }
    // `plan` says so in the step's status and in its closing warning, as for a linked output
    // (its status gave the error alone, and no warning line closed the plan).
    let o = mg(dir, &["plan", "p.toml"]);
    let text = one_line(&String::from_utf8_lossy(&o.stdout));
    for needle in [
        "status: the journal ./C.mgt.journal is a symbolic link: `run` refuses it, with or without `--restart`",
        "warning: `run` will refuse to start: ./C.mgt.journal: is a symbolic link",
    ] {
        assert!(text.contains(needle), "{needle:?} not in:\n{text}");
    }
    // Refused before any step runs: an earlier step is not restarted first (its output was
    // written again, as a new file, before the linked journal of step 2 was found).
    std::fs::write(
        dir.join("p2.toml"),
        "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n\
         [[step]]\noutput = \"D.mgt\"\nexpr = \"A @ B\"\n\
         [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n\
         [engine]\nbackend = \"cpu\"\ntile = 8\n",
    )
    .unwrap();
    std::fs::remove_file(dir.join("C.mgt.journal")).unwrap();
    ok(&mg(dir, &["run", "p2.toml", "-q", "--restart"]));
    std::fs::remove_file(dir.join("C.mgt.journal")).unwrap();
    std::os::unix::fs::symlink("victim.txt", dir.join("C.mgt.journal")).unwrap();
    let ino = || std::fs::metadata(dir.join("D.mgt")).unwrap().ino();
    let before = (ino(), digest(&dir.join("D.mgt.journal")));
    let o = mg(dir, &["run", "p2.toml", "--restart"]);
    failed_with(&o, &["C.mgt.journal", "symbolic link"]);
    assert_eq!((ino(), digest(&dir.join("D.mgt.journal"))), before);
    untouched(&v);
}

/// A checkpoint folder `OUTPUT.partial` that is a symlink to another folder: its `tile*.ckpt`
/// files are neither deleted nor written; the run is refused, naming the link.
#[test]
fn a_linked_checkpoint_folder_is_never_emptied() {
    let d = tmp();
    let dir = d.path();
    inputs(dir);
    plan(dir, "C.mgt");
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    for n in ["tile0.ckpt", "tile1.ckpt", "tile2.ckpt.tmp7"] {
        std::fs::write(elsewhere.join(n), VICTIM).unwrap();
    }
    std::os::unix::fs::symlink("elsewhere", dir.join("C.mgt.partial")).unwrap();
    for args in [&["run", "p.toml"][..], &["run", "p.toml", "--restart"]] {
        let o = mg(dir, args);
        failed_with(&o, &["C.mgt.partial", "symbolic link"]);
        for n in ["tile0.ckpt", "tile1.ckpt", "tile2.ckpt.tmp7"] {
            untouched(&elsewhere.join(n));
        }
    }
    std::fs::remove_file(dir.join("C.mgt.partial")).unwrap();
    ok(&mg(dir, &["run", "p.toml", "-q", "--restart"]));
    ok(&mg(dir, &["verify", "p.toml"]));
}

/// `run --restart` over complete outputs where a step's checkpoint folder cannot be used (a
/// file at its name, or a link) is refused before anything is modified: every step's output
/// and journal keep their bytes and stay complete (the step's journal was reset first, and the
/// folder refused only then: the output was left unfinished, 0 of its tiles done), and `plan`
/// says so in its status and its closing warning.
#[test]
fn an_unusable_checkpoint_folder_is_refused_before_restart_touches_anything() {
    let d = tmp();
    let dir = d.path();
    inputs(dir);
    std::fs::write(
        dir.join("p.toml"),
        "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n\
         [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n\
         [[step]]\noutput = \"D.mgt\"\nexpr = \"2 * A @ B\"\n\
         [engine]\nbackend = \"cpu\"\ntile = 8\n",
    )
    .unwrap();
    ok(&mg(dir, &["run", "p.toml", "-q"]));
    // Bytes and inode: a restart writes a new file, which may hold the same bytes.
    let files = ["C.mgt", "C.mgt.journal", "D.mgt", "D.mgt.journal"];
    let state = || -> Vec<(u32, u64)> {
        let at = |f: &&str| dir.join(f);
        let ino = |p: std::path::PathBuf| std::fs::metadata(p).unwrap().ino();
        files.iter().map(|f| (digest(&at(f)), ino(at(f)))).collect()
    };
    let before = state();
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    // The second step's folder too: the first step is not restarted before it is refused.
    for (name, what) in [
        ("C.mgt.partial", "is not a folder"),
        ("D.mgt.partial", "is not a folder"),
        ("D.mgt.partial", "is a symbolic link"),
    ] {
        let at = dir.join(name);
        match what {
            "is a symbolic link" => std::os::unix::fs::symlink("elsewhere", &at).unwrap(),
            _ => std::fs::write(&at, VICTIM).unwrap(),
        }
        let o = mg(dir, &["run", "p.toml", "--restart"]);
        failed_with(&o, &[name, what]);
        assert_eq!(
            state(),
            before,
            "{name} {what}: an output or journal changed"
        );
        let o = mg(dir, &["plan", "p.toml"]);
        let text = one_line(&String::from_utf8_lossy(&o.stdout));
        for needle in [
            format!("status: ./{name}, the step's checkpoint folder, is "),
            "`run` refuses the step, with or without `--restart`".into(),
            format!("warning: `run` will refuse to start: ./{name}: {what}"),
        ] {
            assert!(text.contains(&needle), "{needle:?} not in:\n{text}");
        }
        if what == "is not a folder" {
            untouched(&at);
        }
        std::fs::remove_file(&at).unwrap();
        let o = mg(dir, &["plan", "p.toml"]);
        let text = one_line(&String::from_utf8_lossy(&o.stdout));
        assert_eq!(
            text.matches("status: complete: `run` skips this step")
                .count(),
            2,
            "{text}"
        );
        assert!(!text.contains("warning"), "{text}");
    }
    assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
}

/// `import` writes under a temporary name and renames: `--force` replaces a link or a hard
/// link's entry (the other name keeps its bytes), and under a file-size limit it fails with a
/// message naming the file — not SIGXFSZ — leaving nothing at the final name and no partial file.
/// `gen` and `export` do the same.
#[test]
fn import_is_atomic_and_never_writes_through_links() {
    let d = tmp();
    let dir = d.path();
    let v = victim(dir);
    ok(&mg(
        dir,
        &["gen", "G.mgt", "--rows", "1024", "--cols", "1024"],
    ));
    ok(&mg(dir, &["export", "G.mgt", "G.npy"]));
    std::os::unix::fs::symlink("victim.txt", dir.join("I.mgt")).unwrap();
    ok(&mg(dir, &["import", "G.npy", "I.mgt", "--force"]));
    untouched(&v);
    own_file(&dir.join("I.mgt"));
    std::fs::remove_file(dir.join("I.mgt")).unwrap();
    let other = dir.join("other.bin");
    std::fs::write(&other, VICTIM).unwrap();
    std::fs::hard_link(&other, dir.join("I.mgt")).unwrap();
    ok(&mg(dir, &["import", "G.npy", "I.mgt", "--force"]));
    untouched(&other);
    own_file(&dir.join("I.mgt"));
    assert_eq!(digest(&dir.join("I.mgt")), digest(&dir.join("G.mgt")));

    // The file-size limit (1 MiB, the arrays are 4 MiB) stands in for a full disk or a kill.
    std::fs::remove_file(dir.join("I.mgt")).unwrap();
    for (cmd, out) in [
        ("import G.npy I.mgt", "I.mgt"),
        ("gen H.mgt --rows 1024 --cols 1024", "H.mgt"),
        ("export G.mgt H.npy", "H.npy"),
    ] {
        let o = sh(dir, &format!("ulimit -f 1024; exec \"$MG\" {cmd}"));
        let err = failed_with(&o, &[out, "ulimit -f"]);
        // The file the user named, not the temporary one.
        assert!(!err.contains(".partial"), "{err}");
        assert!(!dir.join(out).exists(), "{out} left at its final name");
        assert!(
            leftovers(dir).is_empty(),
            "left behind: {:?}",
            leftovers(dir)
        );
    }
    // --force under the limit keeps the old file whole.
    ok(&mg(dir, &["import", "G.npy", "I.mgt"]));
    let before = std::fs::read(dir.join("I.mgt")).unwrap();
    let o = sh(
        dir,
        "ulimit -f 1024; exec \"$MG\" import G.npy I.mgt --tile 512 --force",
    );
    failed_with(&o, &["I.mgt"]);
    assert!(std::fs::read(dir.join("I.mgt")).unwrap() == before);
    assert!(
        leftovers(dir).is_empty(),
        "left behind: {:?}",
        leftovers(dir)
    );
}

/// `import` checks the free space first: an array larger than the disk is refused before
/// anything is created (a sparse raw file of 1.28 TB stands in for it).
#[test]
fn import_larger_than_the_disk_is_refused_up_front() {
    let d = tmp();
    let dir = d.path();
    let free = {
        let out = Command::new("df")
            .args(["-B1", "--output=avail", "."])
            .current_dir(dir)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .nth(1)
            .and_then(|l| l.trim().parse::<u64>().ok())
    };
    let n: u64 = 400_000;
    let len = n * n * 8;
    if free.is_none_or(|f| f >= len) {
        return; // a disk this large: nothing to show here
    }
    let raw = dir.join("big.raw");
    let f = std::fs::File::create(&raw).unwrap();
    if f.set_len(len).is_err() {
        return; // the filesystem cannot hold a file this large, even sparse
    }
    drop(f);
    let src = format!("raw:rows={n},cols={n},dtype=f64:big.raw");
    let o = mg(dir, &["import", &src, "I.mgt"]);
    failed_with(&o, &["not enough disk space", "I.mgt"]);
    assert!(!dir.join("I.mgt").exists());
    assert!(
        leftovers(dir).is_empty(),
        "left behind: {:?}",
        leftovers(dir)
    );
}
