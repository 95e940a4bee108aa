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
}
