//! A finished output is not lost, and not misjudged, when what lies around it is damaged or
//! busy (issue 33, items 8 and 9): `verify` while a run writes the output; a damaged output
//! header, tile padding, `.npy` checksum sidecar; a zeroed header checksum; a torn journal
//! header. Item 7 (a damaged input) is in `bad_input.rs`.

use crate::common::*;

use std::path::Path;
use std::process::{Command, Output};

use mgmm_stream::dtype::DType;
use mgmm_stream::store::gen::Dist;

/// A.mgt (20×30), B.mgt (30×10) and p.toml computing `output` = A·B on the CPU with 8×8×8
/// compute tiles (6 output tiles); the run done.
fn finished(dir: &Path, output: &str) {
    small_inputs(dir);
    std::fs::write(
        dir.join("p.toml"),
        format!(
            "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n\
             [[step]]\noutput = \"{output}\"\nexpr = \"A @ B\"\n\
             [engine]\nbackend = \"cpu\"\ntile = 8\n"
        ),
    )
    .unwrap();
    let o = mg(dir, &["run", "p.toml", "-q"]);
    assert!(o.status.success(), "{o:?}");
}

fn mg(dir: &Path, args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Item 8: `verify` while a run holds the output's journal lock says the output is being
/// written and exits with status 75 (EX_TEMPFAIL: try again later), instead of judging the
/// half-written file; once the lock is gone it verifies as usual.
#[test]
fn verify_while_a_run_writes_the_output_says_so() {
    let d = tmp();
    let dir = d.path();
    finished(dir, "C.mgt");
    // Take the lock as `run` does (an exclusive `flock` on the journal).
    let j = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join("C.mgt.journal"))
        .unwrap();
    rustix::fs::flock(&j, rustix::fs::FlockOperation::NonBlockingLockExclusive).unwrap();
    let o = mg(dir, &["verify", "p.toml"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(75), "{t}");
    assert!(t.contains("being written") && t.contains("C.mgt"), "{t}");
    assert!(!t.contains("FAIL") && !t.contains("certainly wrong"), "{t}");
    drop(j);
    let o = mg(dir, &["verify", "p.toml"]);
    assert!(o.status.success(), "{}", text(&o));
}

/// Item 9a: a damaged output header is not skipped as "already complete": `verify` names it,
/// and `run` (or `verify --repair`) writes it again from the plan after checking every recorded
/// tile against the journal — the file byte-identical to the clean run, nothing recomputed.
#[test]
fn a_damaged_output_header_is_written_again_not_skipped() {
    let d = tmp();
    let dir = d.path();
    finished(dir, "C.mgt");
    let c = dir.join("C.mgt");
    let clean = std::fs::read(&c).unwrap();
    // Byte 20: the rows field; then byte 100, reserved (no field, outside the header's CRC).
    for off in [20, 100] {
        flip(&c, off, 0x01);
        let o = mg(dir, &["verify", "p.toml"]);
        let t = text(&o);
        assert!(!o.status.success(), "{t}");
        assert!(t.contains("header") && t.contains("verify --repair"), "{t}");
        let o = mg(dir, &["run", "p.toml"]);
        let t = text(&o);
        assert!(o.status.success(), "{t}");
        assert!(!t.contains("already complete"), "{t}");
        assert!(t.contains("header"), "{t}");
        assert!(
            std::fs::read(&c).unwrap() == clean,
            "offset {off}: not mended"
        );
        let o = mg(dir, &["run", "p.toml"]);
        assert!(text(&o).contains("already complete"), "{}", text(&o));
    }
    flip(&c, 20, 0x01);
    let o = mg(dir, &["verify", "p.toml", "--repair"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(std::fs::read(&c).unwrap() == clean, "verify --repair");
}

/// Item 9b: a flipped byte in a storage tile's padding (past its elements, inside its stride)
/// fails `verify` (the tile's CRC covers it), and `verify --repair` leaves the file
/// byte-identical to a clean run: padding is written again too.
#[test]
fn repair_rewrites_tile_padding() {
    let d = tmp();
    let dir = d.path();
    finished(dir, "C.mgt");
    let c = dir.join("C.mgt");
    let clean = std::fs::read(&c).unwrap();
    let h = mgmm_stream::store::TiledFile::open(&c).unwrap().hdr;
    let used = h.tile_rows * h.tile_cols * 4;
    assert!(used < h.tile_stride, "no padding to damage");
    flip(&c, h.tile_offset(0, 0) + used + 3, 0x40);
    let o = mg(dir, &["verify", "p.toml"]);
    assert!(!o.status.success(), "{}", text(&o));
    let o = mg(dir, &["verify", "p.toml", "--repair"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        std::fs::read(&c).unwrap() == clean,
        "the repaired file differs from the clean run"
    );
}

/// Item 9c: a damaged, then a deleted, `.npy` checksum sidecar: `verify` says so (it cannot
/// check the stored checksums), and `verify --repair` writes the sidecar again from the output
/// once every tile matches the journal — without recomputing a tile — byte-identical to the
/// one the run wrote.
#[test]
fn a_damaged_or_missing_npy_sidecar_is_named_and_written_again() {
    let d = tmp();
    let dir = d.path();
    finished(dir, "C.npy");
    let (c, s) = (dir.join("C.npy"), dir.join("C.npy.crc32c"));
    let (clean, side) = (std::fs::read(&c).unwrap(), std::fs::read(&s).unwrap());
    for damage in ["damaged", "missing"] {
        match damage {
            "damaged" => flip(&s, 60, 0x01),
            _ => std::fs::remove_file(&s).unwrap(),
        }
        let o = mg(dir, &["verify", "p.toml"]);
        let t = text(&o);
        assert!(!o.status.success(), "{damage}: {t}");
        assert!(
            t.contains("C.npy.crc32c") && t.contains(damage) && t.contains("verify --repair"),
            "{t}"
        );
        let o = mg(dir, &["verify", "p.toml", "--repair"]);
        let t = text(&o);
        assert!(o.status.success(), "{damage}: {t}");
        assert!(!t.contains("repair: recomputing"), "{damage}: {t}");
        assert!(std::fs::read(&s).unwrap() == side, "{damage}: sidecar");
        assert!(std::fs::read(&c).unwrap() == clean, "{damage}: array");
    }
}

/// `run` writes a finished `.npy` output's missing sidecar again without changing the array's
/// bytes, so the array keeps its modification time: the next step, which read it before and
/// names it by size, time and sampled contents, is still skipped (it was refused as changed,
/// while `plan` said it would be skipped: a new user's trial). A damaged data tile, computed
/// again, gives the file a new time.
#[test]
fn a_sidecar_written_again_by_run_keeps_the_next_step_complete() {
    let d = tmp();
    let dir = d.path();
    finished(dir, "C.npy");
    let one = std::fs::read_to_string(dir.join("p.toml")).unwrap();
    std::fs::write(dir.join("one.toml"), &one).unwrap();
    let plan = one.replace(
        "expr = \"A @ B\"\n",
        "expr = \"A @ B\"\nname = \"C\"\n[[step]]\noutput = \"D.npy\"\nexpr = \"C.T @ C\"\n",
    );
    std::fs::write(dir.join("p.toml"), plan).unwrap();
    let o = mg(dir, &["run", "p.toml", "-q"]);
    assert!(o.status.success(), "{}", text(&o));
    let (c, side) = (dir.join("C.npy"), dir.join("C.npy.crc32c"));
    let time = |p: &Path| std::fs::metadata(p).unwrap().modified().unwrap();
    let (before, d_before) = (time(&c), std::fs::read(dir.join("D.npy")).unwrap());
    std::fs::remove_file(&side).unwrap();
    // `status` says what `plan` says: complete, but to be mended (it said "complete").
    let st = text(&mg(dir, &["status", "p.toml"]));
    assert!(
        st.split_whitespace().collect::<Vec<_>>().join(" ").contains("complete by its journal, but its checksum sidecar is missing or damaged: `mgmm-stream run p.toml` mends it"),
        "{st}"
    );
    let o = mg(dir, &["run", "p.toml"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("complete by its journal") && t.contains("D.npy is already complete"),
        "{t}"
    );
    assert!(side.exists());
    assert_eq!(time(&c), before);
    assert_eq!(std::fs::read(dir.join("D.npy")).unwrap(), d_before);
    let o = mg(dir, &["verify", "p.toml"]);
    assert!(o.status.success(), "{}", text(&o));
    // A tile whose journal record is damaged is computed again (its bytes are not vouched
    // for) and gives C a new time, though no recorded CRC failed (the time was put back: a
    // cold review).
    std::fs::remove_file(&side).unwrap();
    let jp = dir.join("C.npy.journal");
    let head = std::fs::read(&jp)
        .unwrap()
        .iter()
        .position(|&b| b == b'\n')
        .unwrap() as u64
        + 1;
    flip(&jp, head + 12, 0x01);
    // `run one.toml` mends C, computing a tile again: C gets a new modification time.
    let recomputed = || {
        std::thread::sleep(std::time::Duration::from_millis(20));
        let o = mg(dir, &["run", "one.toml"]);
        let t = text(&o);
        assert!(
            o.status.success() && t.contains("complete by its journal"),
            "{t}"
        );
        assert!(time(&c) > before, "{t}");
    };
    let put_back = || {
        (std::fs::File::options().write(true).open(&c).unwrap())
            .set_modified(before)
            .unwrap()
    };
    recomputed();
    put_back();
    // A damaged element of C is no mend of bytes: its tile is computed again (by a plan of
    // step 1 alone: this plan's run refuses step 2's journal up front, naming C as changed),
    // and the file is newer.
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::remove_file(&side).unwrap();
    flip(&c, std::fs::metadata(&c).unwrap().len() - 4, 0x01);
    // Rot on disk, not a write: the time the array had.
    put_back();
    let o = mg(dir, &["run", "p.toml"]);
    let t = text(&o);
    assert!(
        !o.status.success() && t.contains("D.npy.journal") && t.contains("input C"),
        "{t}"
    );
    recomputed();
}

/// Item 9d: a header checksum set to 0 is refused (every file this format version writes has
/// one), naming the field; the file is not read as if its header were right.
#[test]
fn a_zeroed_header_checksum_is_refused() {
    let d = tmp();
    let dir = d.path();
    gen(
        &dir.join("A.mgt"),
        20,
        30,
        DType::F32,
        (8, 8),
        Dist::Normal,
        1,
    );
    let p = dir.join("A.mgt");
    let mut b = std::fs::read(&p).unwrap();
    b[72..76].fill(0);
    std::fs::write(&p, &b).unwrap();
    let o = mg(dir, &["info", "A.mgt"]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(
        t.contains("header checksum is 0") && t.contains("A.mgt"),
        "{t}"
    );
}

/// Item 9e: a journal whose first line was torn in the middle (a crash while it was first
/// written: no record can follow it) is written again whole, as docs/RESILIENCE.md says, and
/// the run computes the step.
#[test]
fn a_journal_header_torn_mid_line_is_written_again() {
    let d = tmp();
    let dir = d.path();
    finished(dir, "C.mgt");
    let c = std::fs::read(dir.join("C.mgt")).unwrap();
    let j = dir.join("C.mgt.journal");
    let bytes = std::fs::read(&j).unwrap();
    let nl = bytes.iter().position(|&b| b == b'\n').unwrap();
    std::fs::write(&j, &bytes[..nl / 2]).unwrap();
    let o = mg(dir, &["plan", "p.toml"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = mg(dir, &["run", "p.toml"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(std::fs::read(dir.join("C.mgt")).unwrap() == c);
    let o = mg(dir, &["verify", "p.toml"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(std::fs::read(&j).unwrap().starts_with(&bytes[..=nl]));
}
