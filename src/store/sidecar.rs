//! The per-tile CRC sidecar that `.npy` outputs carry, `ARRAY.npy.crc32c` (docs/FORMAT.md): it
//! holds what a `.mgt` file keeps in its checksum table, one CRC-32C per storage tile
//! ([`TileCrcs`]).
//!
//! Its own file because both sides of a `.npy` use it: the writer makes it
//! ([`super::npy_sink`]), the in-place reader checks blocks against it ([`super::rowmajor`],
//! opened by [`super::npy_source`], which trusts it only when it describes exactly the array
//! read).

use std::path::{Path, PathBuf};

use super::block::Block;
use super::runs::Geometry;
use crate::dtype::DType;

/// Per-tile CRCs kept beside the data (the `.npy` sidecar): tile shape and one CRC-32C per tile
/// of the tile's elements taken row by row (edge tiles clipped), grid row-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TileCrcs {
    pub(crate) tile: (u64, u64),
    pub(crate) crcs: Vec<u32>,
}

/// Checksum tile (ti, tj) of a `tile`-sized grid over `g`, clipped to the matrix.
pub(crate) fn clip_tile(g: &Geometry, tile: (u64, u64), ti: u64, tj: u64) -> Block {
    let (r0, c0) = (ti * tile.0, tj * tile.1);
    Block {
        r0,
        c0,
        rows: tile.0.min(g.rows - r0),
        cols: tile.1.min(g.cols - c0),
    }
}

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
