//! Raw binary matrices: a file of bare little-endian elements (`a.tofile()`, `np.memmap`, a
//! simulation's dump) whose layout the user declares, read in place as a [`RowMajorFile`].
//!
//! A raw file has no header, so the declaration is all there is to check it against: the file
//! must be exactly `offset + rows·cols·element size` bytes long, which catches most wrong shapes
//! and dtypes before any data is read. Column-major (`order = "F"`) files are the row-major
//! transpose and are read as such ([`super::rowmajor`]).

use std::path::PathBuf;

use super::rowmajor::{data_end, RowMajorFile, RowMajorSpec};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Element order of a raw file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// Row-major (C order).
    C,
    /// Column-major (Fortran order).
    F,
}

impl Order {
    pub(crate) fn parse(s: &str) -> Option<Order> {
        match s {
            "C" | "c" => Some(Order::C),
            "F" | "f" => Some(Order::F),
            _ => None,
        }
    }
}

/// A declared raw matrix: `rows × cols` elements of `dtype` in `order`, from byte `offset`.
#[derive(Clone, Debug, PartialEq)]
pub struct RawSpec {
    pub path: PathBuf,
    pub rows: u64,
    pub cols: u64,
    pub dtype: DType,
    pub order: Order,
    pub offset: u64,
}

impl RawSpec {
    /// Parse the command-line form `rows=R,cols=C,dtype=D[,order=C|F][,offset=N]:PATH` (what
    /// follows `raw:`).
    pub(crate) fn parse_arg(s: &str) -> Result<RawSpec> {
        let usage = |why: String| {
            Error::Usage(format!(
                "raw:{s}: {why}; write raw:rows=R,cols=C,dtype=f32[,order=F][,offset=N]:PATH"
            ))
        };
        let (keys, path) = s
            .split_once(':')
            .ok_or_else(|| usage("no `:` before the path".into()))?;
        let (mut rows, mut cols, mut dtype, mut order, mut offset) =
            (None, None, None, Order::C, 0);
        for kv in keys.split(',') {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| usage(format!("`{kv}` is not key=value")))?;
            let num = || {
                v.parse::<u64>()
                    .map_err(|_| usage(format!("{k} = {v} is not a whole number")))
            };
            match k {
                "rows" => rows = Some(num()?),
                "cols" => cols = Some(num()?),
                "offset" => offset = num()?,
                "dtype" => {
                    dtype = Some(DType::parse(v).ok_or_else(|| {
                        usage(format!("dtype = {v} is unknown (f32, f64, f16, bf16)"))
                    })?)
                }
                "order" => {
                    order =
                        Order::parse(v).ok_or_else(|| usage(format!("order = {v}: use C or F")))?
                }
                _ => return Err(usage(format!("unknown key `{k}`"))),
            }
        }
        let need = |v: Option<u64>, k: &str| v.ok_or_else(|| usage(format!("{k} is missing")));
        Ok(RawSpec {
            path: PathBuf::from(path),
            rows: need(rows, "rows")?,
            cols: need(cols, "cols")?,
            dtype: dtype.ok_or_else(|| usage("dtype is missing".into()))?,
            order,
            offset,
        })
    }

    /// The row-major layout this declaration gives the file.
    pub(crate) fn row_major(&self) -> RowMajorSpec {
        let t = self.order == Order::F;
        RowMajorSpec {
            rows: if t { self.cols } else { self.rows },
            cols: if t { self.rows } else { self.cols },
            dtype: self.dtype,
            data_offset: self.offset,
            transposed: t,
            kind: format!("raw {}", if t { "column-major" } else { "row-major" }),
            region: false,
        }
    }

    /// Check the declaration against the file: it exists and is exactly as long as declared.
    pub(crate) fn check(&self) -> Result<()> {
        let p = &self.path;
        if self.rows == 0 || self.cols == 0 {
            return Err(Error::format(
                p,
                format!("declared shape {}×{} is empty", self.rows, self.cols),
            ));
        }
        let need = data_end(&self.row_major())
            .ok_or_else(|| Error::format(p, "declared shape overflows"))?;
        let len = std::fs::metadata(p)
            .map_err(|e| Error::io(p, "cannot open raw matrix file", e))?
            .len();
        if len != need {
            return Err(Error::format(
                p,
                format!(
                    "raw file is {len} bytes but {}×{} {} from offset {} is {need} bytes; fix rows, cols, dtype or offset",
                    self.rows, self.cols, self.dtype, self.offset
                ),
            ));
        }
        Ok(())
    }

    /// Open the file for reading (after [`RawSpec::check`]).
    pub(crate) fn open(&self) -> Result<RowMajorFile> {
        self.check()?;
        RowMajorFile::open(&self.path, self.row_major(), None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_line_form() {
        let r =
            RawSpec::parse_arg("rows=3,cols=5,dtype=f64,order=F,offset=16:/tmp/a:b.bin").unwrap();
        assert_eq!(
            (r.rows, r.cols, r.dtype, r.order, r.offset),
            (3, 5, DType::F64, Order::F, 16)
        );
        assert_eq!(r.path, PathBuf::from("/tmp/a:b.bin"));
        let rm = r.row_major();
        assert_eq!((rm.rows, rm.cols, rm.transposed), (5, 3, true));
        for (bad, want) in [
            ("rows=3,cols=5:/x", "dtype is missing"),
            ("rows=3,cols=5,dtype=i4:/x", "dtype = i4"),
            ("rows=3,cols=x,dtype=f32:/x", "cols = x"),
            ("rows=3,cols=5,dtype=f32,order=Z:/x", "order = Z"),
            ("rows=3", "no `:`"),
        ] {
            let e = RawSpec::parse_arg(bad).unwrap_err().to_string();
            assert!(e.contains(want), "{bad}: {e}");
        }
    }

    #[test]
    fn read_staged_counts_nonfinite_and_matches_read_block() {
        use crate::store::{Block, MatrixSource};
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("m.bin");
        let (rows, cols) = (301u64, 203u64);
        let mut vals: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        for (i, v) in [
            (5, f32::NAN),
            (1000, f32::INFINITY),
            (60000, f32::NEG_INFINITY),
        ] {
            vals[i] = v;
        }
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(&path, bytes).unwrap();
        let spec = RawSpec {
            path,
            rows,
            cols,
            dtype: DType::F32,
            order: Order::C,
            offset: 0,
        };
        let f = spec.open().unwrap();
        let count = |b: &Block| {
            (b.r0..b.r0 + b.rows)
                .flat_map(|r| (b.c0..b.c0 + b.cols).map(move |c| (r * cols + c) as usize))
                .filter(|&i| !vals[i].is_finite())
                .count() as u64
        };
        for (r0, c0, r, c) in [
            (0, 0, rows, cols),
            (0, 0, 5, 7),
            (3, 2, 298, 200),
            (295, 0, 6, 1),
        ] {
            let b = Block {
                r0,
                c0,
                rows: r,
                cols: c,
            };
            let mut want = vec![0u8; b.elems() * 4];
            f.read_block(&b, DType::F32, &mut want).unwrap();
            let mut got = vec![0u8; b.elems() * 4];
            let n = f.read_staged(&b, DType::F32, &mut got, true).unwrap();
            assert_eq!(got, want, "{b:?}");
            assert_eq!(n, count(&b), "{b:?}");
            // Read as f64: converted, then counted.
            let mut wide = vec![0u8; b.elems() * 8];
            assert_eq!(
                f.read_staged(&b, DType::F64, &mut wide, true).unwrap(),
                count(&b)
            );
        }
    }

    /// Column panels of a file evicted from the page cache (where the filesystem allows it)
    /// go through the band reads; whatever path is taken, the bytes must be the file's.
    #[test]
    fn strided_blocks_of_a_cold_file_read_right() {
        use crate::store::{Block, MatrixSource};
        use std::os::fd::AsRawFd;
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("c.bin");
        let (rows, cols) = (257u64, 1031u64);
        let bytes: Vec<u8> = (0..rows * cols)
            .flat_map(|i| (i as f32).to_le_bytes())
            .collect();
        std::fs::write(&path, &bytes).unwrap();
        let spec = RawSpec {
            path: path.clone(),
            rows,
            cols,
            dtype: DType::F32,
            order: Order::C,
            offset: 0,
        };
        for (c0, c) in [(0, 64), (100, 150), (1000, 31)] {
            let f = std::fs::File::open(&path).unwrap();
            f.sync_all().unwrap();
            // SAFETY: plain advice on an open descriptor.
            unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            let src = spec.open().unwrap();
            let b = Block {
                r0: 3,
                c0,
                rows: rows - 3,
                cols: c,
            };
            let mut got = vec![0u8; b.elems() * 4];
            assert_eq!(src.read_staged(&b, DType::F32, &mut got, false).unwrap(), 0);
            for (i, v) in got.chunks_exact(4).enumerate() {
                let (r, cc) = (b.r0 + i as u64 / c, c0 + i as u64 % c);
                let want = (r * cols + cc) as f32;
                assert_eq!(
                    f32::from_le_bytes(v.try_into().unwrap()),
                    want,
                    "({r}, {cc})"
                );
            }
        }
    }
}
