//! Opening an input matrix: the [`MatrixSource`] for a path, chosen by the file's first bytes
//! ([`open_source`]: `.mgt` or `.npy`), for a declared raw file ([`SourceSpec`]) or a region of
//! a file ([`open_region`]); and what `info` says about a file that is not a `.mgt`
//! ([`inspect`], [`bad_tiles`]).
//!
//! The input side of the dispatch at the top of `store` (the output side is [`super::output`]):
//! it imports the formats (the `.mgt` reader [`TiledFile`], the row-major reader behind `.npy`
//! and raw files), and none of them imports it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::block::Block;
use super::raw::RawSpec;
use super::rowmajor::{RowMajorFile, RowMajorSpec};
use super::seam::MatrixSource;
use super::tiled::TiledFile;
use crate::error::{Error, Result};

/// Open a matrix file for reading, choosing the implementation by its first bytes: `.mgt`
/// (`MGMTILE1`) or `.npy` (`\x93NUMPY`). A raw binary file has no header and must be described
/// ([`SourceSpec::Raw`]).
pub fn open_source(path: &Path) -> Result<Arc<dyn MatrixSource>> {
    open_file(path, false)
}

/// [`open_source`] for an output the engine writes, read as it is — unfinished too (a `.npy`
/// whose header still says so): to resume, finalize, describe or export it as it is.
pub(crate) fn open_as_written(path: &Path) -> Result<Arc<dyn MatrixSource>> {
    open_file(path, true)
}

fn open_file(path: &Path, unfinished_ok: bool) -> Result<Arc<dyn MatrixSource>> {
    let meta =
        std::fs::metadata(path).map_err(|e| Error::io(path, "cannot open matrix file", e))?;
    if !meta.is_file() {
        return Err(Error::format(path, "is not a regular file"));
    }
    let mut magic = [0u8; 8];
    let n = std::fs::File::open(path)
        .and_then(|f| {
            use std::os::unix::fs::FileExt;
            f.read_at(&mut magic, 0)
        })
        .map_err(|e| Error::io(path, "cannot open matrix file", e))?;
    if n >= 6 && &magic[..6] == b"\x93NUMPY" {
        return Ok(Arc::new(super::npy_source::open(path, unfinished_ok)?));
    }
    if n == 8 && &magic == b"MGMTILE1" {
        return Ok(Arc::new(TiledFile::open(path)?));
    }
    Err(Error::format(
        path,
        "wrong magic: neither a .mgt file (MGMTILE1) nor a .npy array (\\x93NUMPY); a raw binary matrix must be declared with format = \"raw\", rows, cols and dtype (in a plan), or as raw:rows=R,cols=C,dtype=f32:PATH (on the command line)",
    ))
}

/// A dense C-order `rows × cols` matrix of `dtype` stored at byte `offset` of `path`, the rest
/// of the file being anything (an `np.memmap`'s region, handed in by the Python package): read
/// in place as a row-major source, so its blocks take the same paths as a `.npy` file's (band
/// reads from disk, uploads straight from the page cache).
pub fn open_region(
    path: &Path,
    (rows, cols): (u64, u64),
    dtype: crate::dtype::DType,
    offset: u64,
) -> Result<Arc<dyn MatrixSource>> {
    if rows == 0 || cols == 0 {
        return Err(Error::format(
            path,
            format!("the matrix at offset {offset} is empty ({rows}×{cols})"),
        ));
    }
    let spec = RowMajorSpec {
        rows,
        cols,
        dtype,
        data_offset: offset,
        transposed: false,
        kind: "file region".into(),
        region: true,
    };
    Ok(Arc::new(RowMajorFile::open(path, spec, None)?))
}

/// What `info --check` found in a `.npy` or raw file ([`inspect`]).
pub(crate) enum Checked {
    /// Every tile matches: the `check:` line.
    Ok(String),
    /// Nothing to check against (no checksums, or a sidecar that does not fit): why.
    NotPossible(Error),
    /// The storage tiles that do not match their checksums, in tile order.
    Corrupt(Vec<Error>),
}

/// Every storage tile of `s` checked against its stored checksum, in parallel: the mismatches,
/// in tile order (other errors, such as a failed read, are returned as such).
pub(crate) fn bad_tiles(s: &dyn MatrixSource) -> Result<Vec<Error>> {
    use rayon::prelude::*;
    let Some((tr, tc)) = s.checksum_tile() else {
        return Ok(Vec::new());
    };
    let (rows, cols) = s.shape();
    let gc = cols.div_ceil(tc);
    let found: Vec<Option<Error>> = (0..rows.div_ceil(tr) * gc)
        .into_par_iter()
        .map(|i| {
            let (ti, tj) = (i / gc, i % gc);
            let b = Block {
                r0: ti * tr,
                c0: tj * tc,
                rows: tr.min(rows - ti * tr),
                cols: tc.min(cols - tj * tc),
            };
            match s.verify_block(&b) {
                Ok(()) => Ok(None),
                Err(e @ Error::Checksum { .. }) => Ok(Some(e)),
                Err(e) => Err(e),
            }
        })
        .collect::<Result<_>>()?;
    Ok(found.into_iter().flatten().collect())
}

/// `info --check`'s line for a file whose every tile matches its checksum, in every format.
pub(crate) fn check_ok_line(tiles: u64, took: std::time::Duration) -> String {
    let all = match tiles {
        1 => "1 tile".to_string(),
        n => format!("all {n} tiles"),
    };
    format!("check:       {all} OK ({:.2} s)\n", took.as_secs_f64())
}

/// How many tiles of `s` carry a stored checksum (0 without any).
fn checksum_tiles(s: &dyn MatrixSource) -> u64 {
    let Some((tr, tc)) = s.checksum_tile() else {
        return 0;
    };
    let (rows, cols) = s.shape();
    rows.div_ceil(tr) * cols.div_ceil(tc)
}

/// `info` for anything that is not a `.mgt` file (`None` for a `.mgt`, which the caller prints
/// from its header): a `.npy` array or a `raw:…` descriptor, described, and with `check` every
/// sidecar tile's CRC verified. The description comes back whatever the check finds, so that it
/// is printed before the check's verdict (`None` without `check`).
pub(crate) fn inspect(arg: &Path, check: bool) -> Result<Option<(String, Option<Checked>)>> {
    let spec = SourceSpec::parse_arg(&arg.to_string_lossy())?;
    if let SourceSpec::File(p) = &spec {
        // Opening a FIFO for reading would wait for a writer forever.
        if std::fs::metadata(p).is_ok_and(|m| !m.is_file()) {
            return Err(Error::format(p, "is not a regular file"));
        }
        let mut magic = [0u8; 8];
        let is_mgt = std::fs::File::open(p)
            .and_then(|f| {
                use std::os::unix::fs::FileExt;
                f.read_at(&mut magic, 0)
            })
            .is_ok_and(|n| n == 8 && &magic == b"MGMTILE1");
        if is_mgt {
            return Ok(None);
        }
    }
    let s = spec.open(true)?;
    let out = s.describe();
    if !check {
        return Ok(Some((out, None)));
    }
    if s.checksum_tile().is_none() {
        // A sidecar that is there but does not fit says why it was ignored.
        let why = match (s.checksum_note(), &spec) {
            (Some(note), _) => format!(
                "its {note}; nothing to check (delete the sidecar if the array was changed on purpose)"
            ),
            (None, SourceSpec::Raw(_)) => "a raw file has no checksums; nothing to check".into(),
            (None, _) => "has no checksums (only .npy files written by `run` have a sidecar of tile CRCs); nothing to check".into(),
        };
        let e = Error::format(spec.path(), why);
        return Ok(Some((out, Some(Checked::NotPossible(e)))));
    }
    let t = std::time::Instant::now();
    let bad = bad_tiles(s.as_ref())?;
    let checked = match bad.is_empty() {
        true => Checked::Ok(check_ok_line(checksum_tiles(s.as_ref()), t.elapsed())),
        false => Checked::Corrupt(bad),
    };
    Ok(Some((out, Some(checked))))
}

/// Where a matrix comes from: a self-describing file (`.mgt`, `.npy`), or a raw binary file
/// and its declared layout.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum SourceSpec {
    File(PathBuf),
    Raw(RawSpec),
}

impl SourceSpec {
    /// A command-line argument: `raw:rows=R,cols=C,dtype=D[,order=F][,offset=N]:PATH`, or a path.
    pub(crate) fn parse_arg(arg: &str) -> Result<SourceSpec> {
        match arg.strip_prefix("raw:") {
            Some(rest) => Ok(SourceSpec::Raw(RawSpec::parse_arg(rest)?)),
            None => Ok(SourceSpec::File(PathBuf::from(arg))),
        }
    }
    pub(crate) fn path(&self) -> &Path {
        match self {
            SourceSpec::File(p) => p,
            SourceSpec::Raw(r) => &r.path,
        }
    }
    /// Open it as a matrix to read (an unfinished output refused), or with `as_written` as the
    /// file it is ([`open_as_written`]).
    pub(crate) fn open(&self, as_written: bool) -> Result<Arc<dyn MatrixSource>> {
        match self {
            SourceSpec::File(p) => open_file(p, as_written),
            SourceSpec::Raw(r) => Ok(Arc::new(r.open()?)),
        }
    }
}

#[cfg(test)]
mod tests {

    /// A matrix in the middle of a file (an `np.memmap`'s region) reads in place, block by
    /// block, and has a map a device can copy from; a region past the file's end is refused
    /// with the file named, as is an empty one.
    #[test]
    fn a_file_region_reads_in_place() {
        use crate::dtype::DType;
        use crate::store::{open_region, Block};
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("region.bin");
        let (rows, cols, off) = (7u64, 5u64, 24u64);
        let vals: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.5 - 3.0).collect();
        let mut bytes = vec![0xabu8; off as usize];
        bytes.extend(vals.iter().flat_map(|v| v.to_le_bytes()));
        bytes.extend([0xcd; 9]);
        std::fs::write(&p, &bytes).unwrap();
        let s = open_region(&p, (rows, cols), DType::F32, off).unwrap();
        assert_eq!(
            (s.shape(), s.dtype(), s.transposed()),
            ((rows, cols), DType::F32, false)
        );
        let b = Block {
            r0: 2,
            c0: 1,
            rows: 4,
            cols: 3,
        };
        let mut dst = vec![0u8; 4 * 3 * 4];
        s.read_block(&b, DType::F32, &mut dst).unwrap();
        let got: Vec<f32> = dst
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let want: Vec<f32> = (2..6)
            .flat_map(|r| (1..4).map(move |c| (r * cols + c) as f32 * 0.5 - 3.0))
            .collect();
        assert_eq!(got, want);
        assert!(s.mapped_block(&b, DType::F32).is_some());
        // The journal identity reads the region, not the bytes before it (a region deep in a
        // large file would read them all): a changed prefix byte, same length and modification
        // time, leaves it; a changed byte of the region does not.
        let id = s.identity();
        let t = std::fs::metadata(&p).unwrap().modified().unwrap();
        let rewrite = |at: usize, v: u8| {
            let mut b = std::fs::read(&p).unwrap();
            b[at] = v;
            std::fs::write(&p, &b).unwrap();
            std::fs::File::options()
                .write(true)
                .open(&p)
                .unwrap()
                .set_modified(t)
                .unwrap();
            open_region(&p, (rows, cols), DType::F32, off)
                .unwrap()
                .identity()
        };
        assert_eq!(
            rewrite(3, 0x11),
            id,
            "the prefix is not part of the identity"
        );
        assert_ne!(
            rewrite(off as usize, 0x11),
            id,
            "the region's first bytes are"
        );
        let too_long = open_region(&p, (rows + 1, cols), DType::F32, off)
            .err()
            .unwrap();
        assert!(too_long.to_string().contains("region.bin"), "{too_long}");
        assert!(open_region(&p, (0, cols), DType::F32, off).is_err());
    }
}
