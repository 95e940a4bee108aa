//! `.npy` arrays read in place, and the per-tile CRC sidecar that `.npy` outputs carry.
//!
//! [`open`] parses the header strictly ([`super::npy::read_header`]: versions 1.0–3.0,
//! little-endian f16/f32/f64, C or Fortran order, clear refusals for everything else) and hands
//! the data region to [`RowMajorFile`]. A Fortran-order array is the row-major transpose of its
//! shape, so it is opened as that and flagged [`MatrixSource::transposed`](super::MatrixSource).
//!
//! The sidecar `ARRAY.npy.crc32c` (docs/FORMAT.md) holds what a `.mgt` file keeps in its checksum
//! table: one CRC-32C per storage tile. It is only trusted when it describes exactly this array
//! (dtype, shape, data offset and file length); otherwise it is ignored and `info` says why.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use super::npy::read_header;
use super::rowmajor::{RowMajorFile, RowMajorSpec, TileCrcs};
use crate::dtype::DType;
use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"MGMNPYC1";
/// Fixed part of the sidecar before the CRC table.
const HEAD: usize = 56;

/// The sidecar beside a `.npy` file: `C.npy` → `C.npy.crc32c`.
pub(crate) fn sidecar_path(npy: &Path) -> PathBuf {
    let mut s = npy.as_os_str().to_owned();
    s.push(".crc32c");
    PathBuf::from(s)
}

/// The content of a sidecar.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Sidecar {
    pub(crate) dtype: DType,
    pub(crate) rows: u64,
    pub(crate) cols: u64,
    pub(crate) data_offset: u64,
    pub(crate) file_len: u64,
    pub(crate) crcs: TileCrcs,
}

impl Sidecar {
    /// Little-endian bytes: magic, u32 version 1, u32 dtype code, u64 rows, u64 cols, u32 tile
    /// rows, u32 tile cols, u64 data offset, u64 `.npy` file length, the CRC table (grid
    /// row-major), then a CRC-32C of everything before it.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(HEAD + 4 * self.crcs.crcs.len() + 4);
        v.extend_from_slice(MAGIC);
        v.extend_from_slice(&1u32.to_le_bytes());
        v.extend_from_slice(&self.dtype.code().to_le_bytes());
        v.extend_from_slice(&self.rows.to_le_bytes());
        v.extend_from_slice(&self.cols.to_le_bytes());
        v.extend_from_slice(&(self.crcs.tile.0 as u32).to_le_bytes());
        v.extend_from_slice(&(self.crcs.tile.1 as u32).to_le_bytes());
        v.extend_from_slice(&self.data_offset.to_le_bytes());
        v.extend_from_slice(&self.file_len.to_le_bytes());
        for c in &self.crcs.crcs {
            v.extend_from_slice(&c.to_le_bytes());
        }
        let c = crc32c::crc32c(&v);
        v.extend_from_slice(&c.to_le_bytes());
        v
    }

    /// Parse sidecar bytes; a message says what is wrong.
    pub(crate) fn decode(b: &[u8]) -> std::result::Result<Sidecar, String> {
        if b.len() < HEAD + 4 || &b[..8] != MAGIC {
            return Err("not a sidecar (bad magic or too short)".into());
        }
        let (body, tail) = b.split_at(b.len() - 4);
        if crc32c::crc32c(body) != u32::from_le_bytes(tail.try_into().unwrap()) {
            return Err("its own CRC does not match (torn or damaged)".into());
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        if u32_at(8) != 1 {
            return Err(format!("version {} is not supported", u32_at(8)));
        }
        let dtype = DType::from_code(u32_at(12)).ok_or("unknown dtype code")?;
        let (rows, cols) = (u64_at(16), u64_at(24));
        let tile = (u32_at(32) as u64, u32_at(36) as u64);
        if rows == 0 || cols == 0 || tile.0 == 0 || tile.1 == 0 {
            return Err("empty shape or tile".into());
        }
        let n = rows.div_ceil(tile.0).checked_mul(cols.div_ceil(tile.1));
        if n != Some(((body.len() - HEAD) / 4) as u64) || !(body.len() - HEAD).is_multiple_of(4) {
            return Err("its CRC table does not match its tile grid".into());
        }
        let crcs = body[HEAD..]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        Ok(Sidecar {
            dtype,
            rows,
            cols,
            data_offset: u64_at(40),
            file_len: u64_at(48),
            crcs: TileCrcs { tile, crcs },
        })
    }
}

/// The sidecar of `path` if it describes this array, or why it is ignored.
fn load_sidecar(path: &Path, spec: &RowMajorSpec, len: u64) -> (Option<TileCrcs>, Option<String>) {
    let sp = sidecar_path(path);
    let bytes = match std::fs::read(&sp) {
        Ok(b) => b,
        Err(_) => return (None, None),
    };
    // Not judged by modification times: a damaged copy or a crashed writer changes those too,
    // and a mismatch then says to delete the sidecar if the array was changed on purpose.
    let why = match Sidecar::decode(&bytes) {
        Err(m) => m,
        Ok(s) if spec.transposed => {
            let _ = s;
            "the array is in Fortran order, sidecars describe C-order arrays".into()
        }
        Ok(s)
            if (s.dtype, s.rows, s.cols, s.data_offset, s.file_len)
                == (spec.dtype, spec.rows, spec.cols, spec.data_offset, len) =>
        {
            return (Some(s.crcs), None)
        }
        Ok(_) => "it describes another array (shape, dtype or length differ)".into(),
    };
    (
        None,
        Some(format!("sidecar {} ignored: {why}", sp.display())),
    )
}

/// Open a `.npy` file for reading in place.
pub(crate) fn open(path: &Path) -> Result<RowMajorFile> {
    let f = File::open(path).map_err(|e| Error::io(path, "cannot open .npy file", e))?;
    let len = f
        .metadata()
        .map_err(|e| Error::io(path, "cannot stat .npy file", e))?
        .len();
    let mut r = BufReader::with_capacity(64 << 10, f);
    let h = read_header(path, &mut r)?;
    let version = {
        use std::os::unix::fs::FileExt;
        let mut v = [0u8; 8];
        let f = r.into_inner();
        f.read_exact_at(&mut v, 0)
            .map_err(|e| Error::io(path, "cannot read .npy header", e))?;
        v[6]
    };
    let mut spec = RowMajorSpec {
        rows: if h.fortran { h.cols } else { h.rows },
        cols: if h.fortran { h.rows } else { h.cols },
        dtype: h.dtype,
        data_offset: h.data_offset,
        transposed: h.fortran,
        kind: format!(".npy v{version}.0"),
        region: false,
    };
    let (crcs, note) = load_sidecar(path, &spec, len);
    if let Some(n) = &note {
        spec.kind = format!("{} ({n})", spec.kind);
    }
    Ok(RowMajorFile::open(path, spec, crcs)?.with_checksum_note(note))
}
