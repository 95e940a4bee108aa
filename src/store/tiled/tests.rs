//! Round trips of the `.mgt` format: files written by [`TiledWriter`] and read back by
//! [`TiledFile`], in every write mode, with damage, releases and resumes.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::Ordering;

use rayon::prelude::*;

use super::{TiledFile, TiledWriter};
use crate::dtype::{self, DType};
use crate::error::{Error, Result};
use crate::store::block::Block;
use crate::store::header::Header;
use crate::store::seam::{MatrixSink, MatrixSource, WriteMode};

/// A `.mgt` file opened as the pipeline sees it (what `open_source` gives for one).
fn open_mgt(p: &Path) -> Result<Box<dyn MatrixSource>> {
    Ok(Box::new(TiledFile::open(p)?))
}

const ROWS: u64 = 50;
const COLS: u64 = 37;

/// Element (r, c) of the test matrix.
fn val(r: u64, c: u64) -> f64 {
    (r * COLS + c) as f64 * 0.5 - 100.0
}

/// Block `b` of the test matrix as dense bytes of `dt`.
fn dense(b: &Block, dt: DType) -> Vec<u8> {
    let mut out = vec![0u8; b.elems() * dt.size()];
    for (i, d) in out.chunks_exact_mut(dt.size()).enumerate() {
        let (r, c) = (i as u64 / b.cols, i as u64 % b.cols);
        dtype::put(dt, val(b.r0 + r, b.c0 + c), d);
    }
    out
}

/// Write the whole test matrix in 13×11 blocks (straddling the 16×8 storage tiles).
fn write_matrix(path: &Path, mode: WriteMode, host: DType) {
    let hdr = Header::new(DType::F32, ROWS, COLS, 16, 8, true);
    let w = TiledWriter::create_with(path, hdr, mode).unwrap();
    for r0 in (0..ROWS).step_by(13) {
        for c0 in (0..COLS).step_by(11) {
            let b = Block {
                r0,
                c0,
                rows: 13.min(ROWS - r0),
                cols: 11.min(COLS - c0),
            };
            let sink: &dyn MatrixSink = &w;
            sink.prefault(&b);
            let crc = sink.write_block(&b, host, &dense(&b, host)).unwrap();
            assert_eq!(crc, crc32c::crc32c(&dense(&b, DType::F32)), "{b:?}");
            sink.flush_block(&b).unwrap();
        }
    }
    w.finish(false).unwrap();
}

/// The resident size (kB) of the mapping starting at `addr`, from /proc/self/smaps.
fn mapped_rss_kb(addr: usize) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let head = format!("{addr:x}-");
    let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&head));
    assert!(lines.next().is_some(), "no mapping at {head}");
    let rss = lines.find(|l| l.starts_with("Rss:")).unwrap();
    rss.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// A `rows × cols` matrix in 96×112 blocks, which straddle 128×128 storage tiles.
fn blocks_96x112(rows: u64, cols: u64) -> Vec<Block> {
    (0..rows)
        .step_by(96)
        .flat_map(|r0| {
            (0..cols).step_by(112).map(move |c0| Block {
                r0,
                c0,
                rows: 96.min(rows - r0),
                cols: 112.min(cols - c0),
            })
        })
        .collect()
}

/// An output larger than its budget drops each storage tile from the map once all of it is
/// written, by blocks that do not line up with the storage tiles, written on several
/// threads: nothing stays resident, and the file is byte for byte what `pwrite` writes.
#[test]
fn released_tiles_leave_the_map_and_keep_their_bytes() {
    let d = tempfile::tempdir().unwrap();
    let (rows, cols) = (1000u64, 900u64);
    let write = |path: &Path, mode: WriteMode| {
        let hdr = Header::new(DType::F32, rows, cols, 128, 128, true);
        let w = TiledWriter::create_with(path, hdr, mode).unwrap();
        w.release_written(true);
        let blocks = blocks_96x112(rows, cols);
        blocks.par_iter().for_each(|b| {
            let sink: &dyn MatrixSink = &w;
            sink.prefault(b);
            sink.write_block(b, DType::F32, &dense(b, DType::F32))
                .unwrap();
            sink.release(b);
        });
        // A late prefault of a finished block does not map it back.
        w.prefault(&blocks[0]);
        let rss = if mode == WriteMode::Mmap {
            mapped_rss_kb(w.map.as_ptr() as usize)
        } else {
            0
        };
        w.finish(false).unwrap();
        rss
    };
    let (pm, pp) = (d.path().join("m.mgt"), d.path().join("p.mgt"));
    let rss = write(&pm, WriteMode::Mmap);
    write(&pp, WriteMode::Pwrite);
    // The header page and the checksum table are not tiles; every tile's pages are gone.
    assert!(
        rss <= 8,
        "{rss} kB of a {} kB output still mapped",
        std::fs::metadata(&pm).unwrap().len() >> 10
    );
    assert_eq!(std::fs::read(&pm).unwrap(), std::fs::read(&pp).unwrap());
    open_mgt(&pm)
        .unwrap()
        .verify_block(&Block {
            r0: 0,
            c0: 0,
            rows,
            cols,
        })
        .unwrap();
}

/// A resumed run: blocks an earlier run wrote (here: the first half, by a writer that
/// never finished) are counted as written when the output is reopened, as the resume does
/// (`run::resume`), so storage tiles that both runs wrote part of leave the map once this
/// run writes the rest, not only when `finish` reads them.
#[test]
fn a_reopened_output_drops_tiles_an_earlier_run_wrote_part_of() {
    let d = tempfile::tempdir().unwrap();
    let (rows, cols) = (1000u64, 900u64);
    let hdr = Header::new(DType::F32, rows, cols, 128, 128, true);
    let blocks = blocks_96x112(rows, cols);
    let (before, after) = blocks.split_at(blocks.len() / 2);
    let path = d.path().join("r.mgt");
    {
        let w = TiledWriter::create_with(&path, hdr, WriteMode::Pwrite).unwrap();
        for b in before {
            w.write_block(b, DType::F32, &dense(b, DType::F32)).unwrap();
        }
        // Killed here: no finish.
    }
    let run = |count_earlier: bool| {
        let w = TiledWriter::reopen_with(&path, hdr, WriteMode::Mmap).unwrap();
        let sink: &dyn MatrixSink = &w;
        sink.forget_checksums();
        sink.release_written(true);
        if count_earlier {
            before.iter().for_each(|b| {
                sink.release(b);
            });
        }
        after.par_iter().for_each(|b| {
            let sink: &dyn MatrixSink = &w;
            sink.prefault(b);
            sink.write_block(b, DType::F32, &dense(b, DType::F32))
                .unwrap();
            sink.release(b);
        });
        let rss = mapped_rss_kb(w.map.as_ptr() as usize);
        w.finish(false).unwrap();
        rss
    };
    // Without counting the earlier blocks, the straddled storage tiles stay mapped.
    let stuck = run(false);
    assert!(
        stuck > 64,
        "only {stuck} kB mapped: the test no longer straddles tiles"
    );
    let rss = run(true);
    assert!(rss <= 8, "{rss} kB still mapped after a resumed run");
    let full = d.path().join("p.mgt");
    let w = TiledWriter::create_with(&full, hdr, WriteMode::Pwrite).unwrap();
    for b in &blocks {
        w.write_block(b, DType::F32, &dense(b, DType::F32)).unwrap();
    }
    w.finish(false).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), std::fs::read(&full).unwrap());
}

#[test]
fn write_modes_give_identical_files_that_read_back() {
    let d = tempfile::tempdir().unwrap();
    let (pm, pp) = (d.path().join("m.mgt"), d.path().join("p.mgt"));
    write_matrix(&pm, WriteMode::Mmap, DType::F32);
    write_matrix(&pp, WriteMode::Pwrite, DType::F64);
    assert_eq!(std::fs::read(&pm).unwrap(), std::fs::read(&pp).unwrap());
    let f = open_mgt(&pm).unwrap();
    assert_eq!((f.shape(), f.dtype()), ((ROWS, COLS), DType::F32));
    let all = Block {
        r0: 0,
        c0: 0,
        rows: ROWS,
        cols: COLS,
    };
    f.verify_block(&all).unwrap();
    for b in [
        all,
        Block {
            r0: 5,
            c0: 3,
            rows: 20,
            cols: 30,
        },
        Block {
            r0: 49,
            c0: 0,
            rows: 1,
            cols: 37,
        },
        Block {
            r0: 0,
            c0: 36,
            rows: 50,
            cols: 1,
        },
    ] {
        for host in [DType::F32, DType::F64] {
            let mut got = vec![0u8; b.elems() * host.size()];
            f.read_block(&b, host, &mut got).unwrap();
            assert_eq!(got, dense(&b, host), "{b:?} as {host}");
        }
    }
    let mut buf = vec![0u8; 4 * 4];
    let outside = Block {
        r0: 48,
        c0: 0,
        rows: 4,
        cols: 1,
    };
    let e = f.read_block(&outside, DType::F32, &mut buf).unwrap_err();
    assert!(e.to_string().contains("outside"), "{e}");
}

/// An f32 .mgt of `rows × cols` (element (r, c) = `r·cols + c`) in `tr × tc` storage tiles.
fn write_grid(path: &Path, rows: u64, cols: u64, tr: u64, tc: u64) -> Header {
    let hdr = Header::new(DType::F32, rows, cols, tr, tc, true);
    let w = TiledWriter::create(path, hdr).unwrap();
    let all = Block {
        r0: 0,
        c0: 0,
        rows,
        cols,
    };
    let data: Vec<u8> = (0..rows * cols)
        .flat_map(|i| (i as f32).to_le_bytes())
        .collect();
    let sink: &dyn MatrixSink = &w;
    sink.write_block(&all, DType::F32, &data).unwrap();
    w.finish(false).unwrap();
    hdr
}

/// A block as (r0, c0, rows, cols).
type Tile4 = (u64, u64, u64, u64);

/// Read each `(r0, c0, rows, cols)` block of the f32 file `p` with `read_staged` (checking
/// checksums) by a fresh handle: no NaN, the bytes of `read_block`, and every tile the block
/// touches marked as checked.
fn staged_matches_read_block(p: &Path, blocks: &[Tile4]) {
    for &(r0, c0, rows, cols) in blocks {
        let b = Block { r0, c0, rows, cols };
        let f = TiledFile::open(p).unwrap();
        let mut want = vec![0u8; b.elems() * 4];
        f.read_block(&b, DType::F32, &mut want).unwrap();
        let mut got = vec![0u8; b.elems() * 4];
        assert_eq!(f.read_staged(&b, DType::F32, &mut got, true).unwrap(), 0);
        assert_eq!(got, want, "{b:?}");
        for (ti, tj) in f.geo.tiles_iter(&b) {
            assert!(f.marks()[f.geo.tile_index(ti, tj)].load(Ordering::Relaxed));
        }
    }
}

/// Storage tiles of 4.3 MiB, more than a run's `IO_SPAN`: one tile's CRC is combined from
/// several runs' pieces (and from `pread`s of what the block leaves out).
#[test]
fn read_staged_combines_several_runs_of_a_tile() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("big.mgt");
    let (rows, cols) = (2100u64, 1200u64);
    write_grid(&p, rows, cols, 1024, 1100);
    staged_matches_read_block(
        &p,
        &[
            (0, 0, 1024, 1200),
            (3, 0, 1500, 1100),
            (0, 0, rows, cols),
            (1000, 0, 1100, 1100),
        ],
    );
    // A damaged byte in the second run of tile (0, 0) is found through the combined CRC.
    let hdr = TiledFile::open(&p).unwrap().hdr;
    let off = hdr.tile_offset(0, 0) + 1000 * 1100 * 4;
    let e = staged_error_after_damage(&p, off, (0, 0, 1024, 1100));
    assert!(matches!(e, Error::Checksum { ti: 0, tj: 0, .. }), "{e}");
}

/// Write four bytes of damage at `off` of `p`, then read block `(r0, c0, rows, cols)`
/// staged, with checks, through a fresh handle: the error it must give.
fn staged_error_after_damage(p: &Path, off: u64, (r0, c0, rows, cols): Tile4) -> Error {
    OpenOptions::new()
        .write(true)
        .open(p)
        .unwrap()
        .write_all_at(&[0x7f; 4], off)
        .unwrap();
    let b = Block { r0, c0, rows, cols };
    let mut buf = vec![0u8; b.elems() * 4];
    TiledFile::open(p)
        .unwrap()
        .read_staged(&b, DType::F32, &mut buf, true)
        .unwrap_err()
}

#[test]
fn read_staged_reads_checks_and_counts_in_one_pass() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("s.mgt");
    // 768 KiB storage tiles (pieces of 512 KiB split them), partial edge tiles, padding.
    let (rows, cols) = (701u64, 653u64);
    let hdr = write_grid(&p, rows, cols, 512, 384);
    let blocks = [
        (0, 0, rows, cols),
        (3, 5, 509, 389),
        (512, 384, 189, 269),
        (0, 0, 512, 384),
        (100, 0, 1, cols),
        (0, 652, rows, 1),
        (511, 383, 2, 2),
    ];
    staged_matches_read_block(&p, &blocks);
    // And read_block itself reads the test matrix (element (r, c) = r·cols + c).
    let f = TiledFile::open(&p).unwrap();
    for &(r0, c0, r, c) in &blocks {
        let b = Block {
            r0,
            c0,
            rows: r,
            cols: c,
        };
        let mut got = vec![0u8; b.elems() * 4];
        f.read_block(&b, DType::F32, &mut got).unwrap();
        let first = f32::from_le_bytes(got[..4].try_into().unwrap());
        assert_eq!(first, (r0 * cols + c0) as f32, "{b:?}");
    }
    // Damage in a tile's data, and in its padding, is found and names the tile; NaN and
    // Inf are counted.
    let poke = |off: u64, v: f32| {
        let f = OpenOptions::new().write(true).open(&p).unwrap();
        f.write_all_at(&v.to_le_bytes(), off).unwrap();
    };
    let b = Block {
        r0: 500,
        c0: 370,
        rows: 30,
        cols: 30,
    };
    let f = TiledFile::open(&p).unwrap();
    let mut buf = vec![0u8; b.elems() * 4];
    f.read_staged(&b, DType::F32, &mut buf, true).unwrap();
    // Element (510, 380) lies in tile (0, 0), row 510, column 380.
    poke(hdr.tile_offset(0, 0) + (510 * 384 + 380) * 4, f32::NAN);
    // Element (520, 390): tile (1, 1), row 8, column 6.
    poke(hdr.tile_offset(1, 1) + (8 * 384 + 6) * 4, f32::NEG_INFINITY);
    // Checked once per handle: this one verified both tiles before the damage.
    assert_eq!(f.read_staged(&b, DType::F32, &mut buf, true).unwrap(), 2);
    let e = TiledFile::open(&p)
        .unwrap()
        .read_staged(&b, DType::F32, &mut buf, true)
        .unwrap_err();
    assert!(matches!(e, Error::Checksum { .. }), "{e}");
    let no_check = TiledFile::open(&p).unwrap();
    assert_eq!(
        no_check
            .read_staged(&b, DType::F32, &mut buf, false)
            .unwrap(),
        2
    );
    // Padding after tile (1, 0)'s last valid row (row 701 - 512 = 189 of 512).
    write_grid(&p, rows, cols, 512, 384);
    let pad = hdr.tile_offset(1, 0) + 300 * 384 * 4;
    let e = staged_error_after_damage(&p, pad, (600, 0, 10, 10));
    assert!(
        matches!(e, Error::Checksum { ti: 1, tj: 0, .. }),
        "expected tile (1, 0): {e}"
    );
}

#[test]
fn verify_block_finds_a_corrupt_tile_and_checks_each_tile_once() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("v.mgt");
    write_matrix(&p, WriteMode::Mmap, DType::F32);
    let hdr = TiledFile::open(&p).unwrap().hdr;
    let corrupt = |ti, tj| {
        let f = OpenOptions::new().write(true).open(&p).unwrap();
        f.write_all_at(&[0xff; 4], hdr.tile_offset(ti, tj) + 8)
            .unwrap();
    };
    let first = Block {
        r0: 0,
        c0: 0,
        rows: 16,
        cols: 8,
    };
    let f = TiledFile::open(&p).unwrap();
    f.verify_block(&first).unwrap();
    // Tile (0, 0) was verified by this handle: later damage is not re-checked by it.
    corrupt(0, 0);
    f.verify_block(&first).unwrap();
    corrupt(1, 2);
    let clear = Block {
        r0: 0,
        c0: 8,
        rows: 16,
        cols: 29,
    };
    f.verify_block(&clear).unwrap();
    let e = f
        .verify_block(&Block {
            r0: 15,
            c0: 15,
            rows: 2,
            cols: 2,
        })
        .unwrap_err();
    assert!(
        matches!(e, Error::Checksum { ti: 1, tj: 2, .. }),
        "expected tile (1, 2): {e}"
    );
    // A fresh handle checks (0, 0) again.
    let e = TiledFile::open(&p)
        .unwrap()
        .verify_block(&first)
        .unwrap_err();
    assert!(matches!(e, Error::Checksum { ti: 0, tj: 0, .. }), "{e}");
}

#[test]
fn identity_is_the_journal_text() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("i.mgt");
    write_matrix(&p, WriteMode::Mmap, DType::F32);
    let f = TiledFile::open(&p).unwrap();
    let len = std::fs::metadata(&p).unwrap().len();
    let id = MatrixSource::identity(&f);
    let prefix = format!("{} ({len} bytes, header ", p.display());
    assert!(id.starts_with(&prefix), "{id}");
    let rest = &id[prefix.len()..];
    assert_eq!(&rest[8..25], ", tile checksums ", "{id}");
    assert!(rest[..8]
        .chars()
        .chain(rest[25..33].chars())
        .all(|c| c.is_ascii_hexdigit()));
    assert_eq!(&rest[33..], ")");
}
