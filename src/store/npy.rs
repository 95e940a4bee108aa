//! `.npy` import and export, streaming, so a 30 GB array never needs 30 GB of RAM.
//!
//! Supports C-order 2-D arrays of little-endian f32 (`<f4`) or f64 (`<f8`), format versions
//! 1.0, 2.0 and 3.0. Anything else — Fortran order, other dtypes, object arrays, other ranks — is
//! refused with a message that says what was found and what to do.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use super::header::Header;
use super::tiled::{Block, TiledFile, TiledWriter};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Rows moved per chunk are sized to about this many bytes.
const CHUNK_BYTES: usize = 64 << 20;

pub struct NpyHeader {
    pub dtype: DType,
    pub rows: u64,
    pub cols: u64,
    /// Byte offset of the first element.
    pub data_offset: u64,
}

fn dict_value<'a>(dict: &'a str, key: &str) -> Option<&'a str> {
    let k = format!("'{key}'");
    let i = dict.find(&k)? + k.len();
    let rest = dict[i..].trim_start().strip_prefix(':')?.trim_start();
    if rest.starts_with('(') {
        let end = rest.find(')')?;
        Some(&rest[..=end])
    } else if let Some(r) = rest.strip_prefix('\'') {
        let end = r.find('\'')?;
        Some(&r[..end])
    } else {
        let end = rest.find([',', '}']).unwrap_or(rest.len());
        Some(rest[..end].trim())
    }
}

pub fn read_header(path: &Path, r: &mut impl Read) -> Result<NpyHeader> {
    let bad = |m: String| Error::format(path, m);
    let mut pre = [0u8; 8];
    r.read_exact(&mut pre)
        .map_err(|_| bad("too short to be a .npy file".into()))?;
    if &pre[..6] != b"\x93NUMPY" {
        return Err(bad("not a .npy file (missing \\x93NUMPY magic)".into()));
    }
    let major = pre[6];
    let hlen = match major {
        1 => {
            let mut b = [0u8; 2];
            r.read_exact(&mut b)
                .map_err(|_| bad("truncated .npy header".into()))?;
            u16::from_le_bytes(b) as usize
        }
        2 | 3 => {
            let mut b = [0u8; 4];
            r.read_exact(&mut b)
                .map_err(|_| bad("truncated .npy header".into()))?;
            u32::from_le_bytes(b) as usize
        }
        v => {
            return Err(bad(format!(
                ".npy format version {v}.{} is not supported (1, 2, 3 are)",
                pre[7]
            )))
        }
    };
    if hlen > 1 << 20 {
        return Err(bad(format!(".npy header claims {hlen} bytes; refusing")));
    }
    let mut h = vec![0u8; hlen];
    r.read_exact(&mut h)
        .map_err(|_| bad("truncated .npy header".into()))?;
    let dict = String::from_utf8_lossy(&h).to_string();
    let descr = dict_value(&dict, "descr").ok_or_else(|| bad("header has no 'descr'".into()))?;
    let dtype = match descr {
        "<f4" => DType::F32,
        "<f8" => DType::F64,
        other => {
            return Err(bad(format!(
                "dtype '{other}' is not supported; convert to float32 or float64 first (arr.astype(np.float32))"
            )))
        }
    };
    if dict_value(&dict, "fortran_order") != Some("False") {
        return Err(bad(
            "array is in Fortran order; save it C-contiguous (np.ascontiguousarray) and try again"
                .into(),
        ));
    }
    let shape = dict_value(&dict, "shape").ok_or_else(|| bad("header has no 'shape'".into()))?;
    let dims: Vec<u64> = shape
        .trim_matches(|c| c == '(' || c == ')')
        .split(',')
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u64>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| bad(format!("cannot parse shape {shape}")))?;
    if dims.len() != 2 {
        return Err(bad(format!(
            "array has shape {shape}; only 2-D arrays are supported (reshape it first)"
        )));
    }
    if dims[0] == 0 || dims[1] == 0 {
        return Err(bad(format!(
            "array has shape {shape}; empty matrices are not supported"
        )));
    }
    let pre_len = if major == 1 { 10 } else { 12 };
    Ok(NpyHeader {
        dtype,
        rows: dims[0],
        cols: dims[1],
        data_offset: (pre_len + hlen) as u64,
    })
}

/// Import `src` (.npy) into a new tiled file `dst` with storage tiles `tile`.
pub fn import(src: &Path, dst: &Path, tile: (u64, u64)) -> Result<Header> {
    let f = File::open(src).map_err(|e| Error::io(src, "cannot open .npy file", e))?;
    let len = f
        .metadata()
        .map_err(|e| Error::io(src, "cannot stat", e))?
        .len();
    let mut r = BufReader::with_capacity(8 << 20, f);
    let nh = read_header(src, &mut r)?;
    let es = nh.dtype.size() as u64;
    let need = nh
        .rows
        .checked_mul(nh.cols)
        .and_then(|n| n.checked_mul(es))
        .and_then(|n| n.checked_add(nh.data_offset))
        .ok_or_else(|| Error::format(src, "shape overflows"))?;
    if len < need {
        return Err(Error::format(
            src,
            format!(
                "file is {len} bytes but its header ({}×{} {}) needs {need}: truncated",
                nh.rows, nh.cols, nh.dtype
            ),
        ));
    }
    let hdr = Header::new(
        nh.dtype,
        nh.rows,
        nh.cols,
        tile.0.min(nh.rows).max(1),
        tile.1.min(nh.cols).max(1),
        true,
    );
    let w = TiledWriter::create(dst, hdr)?;
    let row_bytes = (nh.cols * es) as usize;
    let chunk_rows = (CHUNK_BYTES / row_bytes).max(1) as u64;
    let mut buf = Vec::new();
    let mut r0 = 0;
    while r0 < nh.rows {
        let n = chunk_rows.min(nh.rows - r0);
        buf.resize(n as usize * row_bytes, 0);
        r.read_exact(&mut buf)
            .map_err(|e| Error::io(src, "cannot read array data", e))?;
        w.write_block(
            &Block {
                r0,
                c0: 0,
                rows: n,
                cols: nh.cols,
            },
            nh.dtype,
            &buf,
        )?;
        r0 += n;
    }
    w.finish(true)?;
    Ok(hdr)
}

/// The bytes of a .npy header for a C-order 2-D array.
pub fn header_bytes(dtype: DType, rows: u64, cols: u64) -> Result<Vec<u8>> {
    let descr = match dtype {
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        other => {
            return Err(Error::Usage(format!(
                "cannot export {other} data to .npy (f32 and f64 only)"
            )))
        }
    };
    let dict =
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    let mut v1 = true;
    let mut total = 10 + dict.len() + 1;
    if total.div_ceil(64) * 64 - 10 > u16::MAX as usize {
        v1 = false;
        total = 12 + dict.len() + 1;
    }
    let padded = total.div_ceil(64) * 64;
    let pre = if v1 { 10 } else { 12 };
    let hlen = padded - pre;
    let mut out = Vec::with_capacity(padded);
    out.extend_from_slice(b"\x93NUMPY");
    if v1 {
        out.extend_from_slice(&[1, 0]);
        out.extend_from_slice(&(hlen as u16).to_le_bytes());
    } else {
        out.extend_from_slice(&[2, 0]);
        out.extend_from_slice(&(hlen as u32).to_le_bytes());
    }
    out.extend_from_slice(dict.as_bytes());
    out.resize(padded - 1, b' ');
    out.push(b'\n');
    Ok(out)
}

/// Export tiled file `src` to `dst` (.npy). 16-bit files are widened to f32.
pub fn export(src: &Path, dst: &Path) -> Result<()> {
    let t = TiledFile::open(src)?;
    let out_dt = t.dtype().compute();
    let head = header_bytes(out_dt, t.rows(), t.cols())?;
    let f = File::create(dst).map_err(|e| Error::io(dst, "cannot create .npy file", e))?;
    let mut w = BufWriter::with_capacity(8 << 20, f);
    w.write_all(&head)
        .map_err(|e| Error::io(dst, "cannot write", e))?;
    let row_bytes = (t.cols() as usize) * out_dt.size();
    let chunk_rows = (CHUNK_BYTES / row_bytes).max(1) as u64;
    let mut buf = Vec::new();
    let mut r0 = 0;
    while r0 < t.rows() {
        let n = chunk_rows.min(t.rows() - r0);
        buf.resize(n as usize * row_bytes, 0);
        t.read_block(
            &Block {
                r0,
                c0: 0,
                rows: n,
                cols: t.cols(),
            },
            out_dt,
            &mut buf,
        )?;
        w.write_all(&buf)
            .map_err(|e| Error::io(dst, "cannot write", e))?;
        r0 += n;
    }
    let f = w
        .into_inner()
        .map_err(|e| Error::io(dst, "cannot write", e.into_error()))?;
    f.sync_all().map_err(|e| Error::io(dst, "cannot sync", e))?;
    Ok(())
}
