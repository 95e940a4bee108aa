//! The fixed 4 KiB header of a `.mgt` tiled matrix file (format v1, docs/FORMAT.md).
//!
//! The on-disk struct is a zerocopy type of little-endian fields, so it is read straight out of
//! a memory map and written without hand-rolled byte shuffling. [`Header`] is the validated,
//! native view: nothing reaches the rest of the engine until every field has been checked
//! against the file's real length, with checked arithmetic, so a lying header can neither
//! overflow an offset nor trigger a huge allocation.

use std::path::Path;

use zerocopy::byteorder::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use super::runs::Geometry;
use crate::dtype::DType;
use crate::error::{Error, Result};

pub(crate) const MAGIC: [u8; 8] = *b"MGMTILE1";
pub(crate) const VERSION: u32 = 1;
/// Data and tile strides are aligned to this many bytes.
pub(crate) const ALIGN: u64 = 4096;
/// Flag bit 0: a CRC-32C per storage tile is stored at `checksum_table_offset`.
pub(crate) const FLAG_CHECKSUMS: u64 = 1;
const KNOWN_FLAGS: u64 = FLAG_CHECKSUMS;
/// Upper bound on tile edge: a storage tile must stay far below any sane buffer size.
pub(crate) const MAX_TILE_EDGE: u64 = 1 << 16;

/// Byte-exact on-disk header: 72 bytes, every field alignment 1, no padding.
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug)]
#[repr(C)]
pub(crate) struct RawHeader {
    pub(crate) magic: [u8; 8],
    pub(crate) version: U32,
    pub(crate) dtype: U32,
    pub(crate) rows: U64,
    pub(crate) cols: U64,
    pub(crate) tile_rows: U32,
    pub(crate) tile_cols: U32,
    pub(crate) data_offset: U64,
    pub(crate) tile_stride: U64,
    pub(crate) flags: U64,
    pub(crate) checksum_table_offset: U64,
}
const _: () = assert!(std::mem::size_of::<RawHeader>() == 72);
/// Bytes of the header's fields; its CRC-32C follows them (bytes 72–75).
const RAW_LEN: usize = 72;

/// A validated header in native types.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Element type.
    pub dtype: DType,
    /// Rows.
    pub rows: u64,
    /// Columns.
    pub cols: u64,
    /// Rows of one storage tile.
    pub tile_rows: u64,
    /// Columns of one storage tile.
    pub tile_cols: u64,
    /// Byte offset of the first tile.
    pub data_offset: u64,
    /// Bytes from one tile to the next.
    pub tile_stride: u64,
    /// Flag bits ([`FLAG_CHECKSUMS`]).
    pub flags: u64,
    /// Byte offset of the CRC table (with [`FLAG_CHECKSUMS`]).
    pub checksum_table_offset: u64,
}

pub(crate) fn round_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// Why a `.mgt` of some layout is much larger than its values ([`Header::padding_cost`]); each holds
/// the sentence that says so, the callers add what to set (a `--tile`, a step's `tile`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Padding {
    /// Each storage tile at least four times its values' bytes (every tile starts on a 4 KiB
    /// page) and the file over 1 MiB: a larger tile helps.
    Pages(String),
    /// The tiles more than 1.5× the values because edge tiles are stored whole: a tile that
    /// divides the shape, or one larger than it, helps.
    Edges(String),
}

impl Header {
    /// Where a file of this layout is much larger than its values, why, as `plan`, `run`,
    /// `gen` and `import` say it (`tile = 7` made a 117 KiB output a 7.23 MiB file, and a
    /// 1500×1200 f32 array in 1024² tiles took 16.00 MiB for 6.87 MiB: new users' trials).
    pub(crate) fn padding_cost(&self, name: &str) -> Option<Padding> {
        let size = self.dtype.size() as u64;
        let values = self.rows * self.cols * size;
        let tile = self.tile_rows * self.tile_cols * size;
        let (len, stored) = (self.file_len(), self.data_end() - self.data_offset);
        let b = crate::units::fmt_bytes;
        if self.tile_stride >= 4 * tile && len > 1 << 20 {
            return Some(Padding::Pages(format!(
                "each {}×{} storage tile of {name} takes {} on disk for {} of values, so the file takes {} ({}× its values)",
                self.tile_rows,
                self.tile_cols,
                b(self.tile_stride),
                b(tile),
                b(len),
                (len as f64 / values.max(1) as f64).round()
            )));
        }
        // The tiles' bytes, not the file's: a small file is mostly its 4 KiB header.
        (stored > values + values / 2).then(|| {
            Padding::Edges(format!(
                "{} of {name}'s {} hold its values: edge tiles are stored whole ({}×{})",
                b(values),
                b(len),
                self.tile_rows,
                self.tile_cols
            ))
        })
    }

    /// A fresh header with the canonical layout: data at 4096, stride = tile bytes rounded up
    /// to 4096. Checksum table (if any) directly after the data.
    pub(crate) fn new(
        dtype: DType,
        rows: u64,
        cols: u64,
        tile_rows: u64,
        tile_cols: u64,
        checksums: bool,
    ) -> Header {
        let tile_stride = round_up(tile_rows * tile_cols * dtype.size() as u64, ALIGN);
        let mut h = Header {
            dtype,
            rows,
            cols,
            tile_rows,
            tile_cols,
            data_offset: ALIGN,
            tile_stride,
            flags: 0,
            checksum_table_offset: 0,
        };
        if checksums {
            h.flags |= FLAG_CHECKSUMS;
            h.checksum_table_offset = round_up(h.data_end(), ALIGN);
        }
        h
    }

    /// Rows of tiles.
    pub fn grid_rows(&self) -> u64 {
        self.rows.div_ceil(self.tile_rows)
    }
    /// Columns of tiles.
    pub fn grid_cols(&self) -> u64 {
        self.cols.div_ceil(self.tile_cols)
    }
    /// Tiles in all.
    pub fn tiles(&self) -> u64 {
        self.grid_rows() * self.grid_cols()
    }
    /// Bytes per element.
    pub fn elem(&self) -> usize {
        self.dtype.size()
    }
    /// The tile-grid layout of the data, for block I/O ([`super::runs`]).
    pub(crate) fn geometry(&self) -> Geometry {
        Geometry {
            rows: self.rows,
            cols: self.cols,
            tile_rows: self.tile_rows,
            tile_cols: self.tile_cols,
            elem: self.elem() as u64,
            data_offset: self.data_offset,
            tile_stride: self.tile_stride,
        }
    }
    /// Byte offset of tile (`ti`, `tj`).
    pub fn tile_offset(&self, ti: u64, tj: u64) -> u64 {
        self.data_offset + (ti * self.grid_cols() + tj) * self.tile_stride
    }
    pub(crate) fn data_end(&self) -> u64 {
        self.data_offset + self.tiles() * self.tile_stride
    }
    /// The file ranges of storage tile (`ti`, `tj`) that hold no element of the matrix — the
    /// columns and rows of an edge tile outside it, and the bytes from the tile's elements to
    /// its stride — which are zero in every file written (docs/FORMAT.md).
    pub(crate) fn padding(&self, ti: u64, tj: u64) -> Vec<std::ops::Range<u64>> {
        let off = self.tile_offset(ti, tj);
        let e = self.elem() as u64;
        let row = self.tile_cols * e;
        let vr = self.tile_rows.min(self.rows - ti * self.tile_rows);
        let vc = self.tile_cols.min(self.cols - tj * self.tile_cols);
        let mut out = Vec::new();
        if vc < self.tile_cols {
            out.extend((0..vr).map(|r| off + r * row + vc * e..off + (r + 1) * row));
        }
        out.push(off + vr * row..off + self.tile_stride);
        out.retain(|r| r.start < r.end);
        out
    }
    /// Whether the file has a CRC per tile.
    pub fn has_checksums(&self) -> bool {
        self.flags & FLAG_CHECKSUMS != 0
    }
    /// Total file length this header implies.
    pub fn file_len(&self) -> u64 {
        if self.has_checksums() {
            self.checksum_table_offset + self.tiles() * 4
        } else {
            self.data_end()
        }
    }

    pub(crate) fn to_raw(self) -> RawHeader {
        RawHeader {
            magic: MAGIC,
            version: U32::new(VERSION),
            dtype: U32::new(self.dtype.code()),
            rows: U64::new(self.rows),
            cols: U64::new(self.cols),
            tile_rows: U32::new(self.tile_rows as u32),
            tile_cols: U32::new(self.tile_cols as u32),
            data_offset: U64::new(self.data_offset),
            tile_stride: U64::new(self.tile_stride),
            flags: U64::new(self.flags),
            checksum_table_offset: U64::new(self.checksum_table_offset),
        }
    }

    /// The full 4096-byte header block (fields, then zeros up to data_offset's first page).
    pub(crate) fn to_block(self) -> Vec<u8> {
        let mut b = self.fields_block();
        let crc = crc32c::crc32c(&b[..RAW_LEN]);
        b[RAW_LEN..RAW_LEN + 4].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// [`Self::to_block`] without the header's own checksum (bytes 72–75 zero): what files
    /// written before that checksum hold, and what input identities are computed from, so
    /// that journals from either kind of file keep matching.
    pub(crate) fn fields_block(self) -> Vec<u8> {
        let mut b = vec![0u8; ALIGN as usize];
        self.to_raw()
            .write_to_prefix(&mut b)
            .expect("4096 bytes hold a 72-byte header");
        b
    }

    /// Parse and validate `bytes` (the start of the file) against the file length `file_len`.
    pub(crate) fn parse(path: &Path, bytes: &[u8], file_len: u64) -> Result<Header> {
        let bad = |msg: String| Error::format(path, msg);
        let (raw, _) = RawHeader::ref_from_prefix(bytes).map_err(|_| {
            bad(format!(
                "file is {file_len} bytes, too short for a .mgt header (72 bytes); it is truncated or not a tiled matrix file"
            ))
        })?;
        if raw.magic != MAGIC {
            return Err(bad(format!(
                "wrong magic {:?} (expected \"MGMTILE1\"): not an mgmm-stream tiled matrix file; convert .npy files with `mgmm-stream import`",
                String::from_utf8_lossy(&raw.magic)
            )));
        }
        let version = raw.version.get();
        if version != VERSION {
            return Err(bad(format!(
                "header field `version` is {version}; this build reads version {VERSION} only"
            )));
        }
        let dtype = DType::from_code(raw.dtype.get()).ok_or_else(|| {
            bad(format!(
                "header field `dtype` is {} (known: 0=f32, 1=f64, 2=f16, 3=bf16)",
                raw.dtype.get()
            ))
        })?;
        let h = Header {
            dtype,
            rows: raw.rows.get(),
            cols: raw.cols.get(),
            tile_rows: raw.tile_rows.get() as u64,
            tile_cols: raw.tile_cols.get() as u64,
            data_offset: raw.data_offset.get(),
            tile_stride: raw.tile_stride.get(),
            flags: raw.flags.get(),
            checksum_table_offset: raw.checksum_table_offset.get(),
        };
        // Fields that are each plausible but not the ones written (a tile edge or a dtype
        // changed) would read every tile wrongly: the header's own CRC-32C catches them. Every
        // file of this format version carries one, so 0 is refused too: accepting it as "no
        // checksum" would let a zeroed checksum vouch for any fields.
        let stored = bytes
            .get(RAW_LEN..RAW_LEN + 4)
            .map_or(0, |b| u32::from_le_bytes(b.try_into().unwrap()));
        let computed = crc32c::crc32c(&bytes[..RAW_LEN]);
        let fields = h.check_fields(path).and_then(|()| {
            let needed = h.needed_len(path)?;
            if file_len < needed {
                let (rows, cols, tile_rows, tile_cols) = (h.rows, h.cols, h.tile_rows, h.tile_cols);
                return Err(bad(format!(
                    "file is {file_len} bytes but its header ({rows}×{cols} {dtype}, {tile_rows}×{tile_cols} tiles) needs {needed}: the file is truncated"
                )));
            }
            Ok(())
        });
        if let Err(e) = fields {
            // A field out of range in a header whose checksum does not match is damage, and
            // the field named is only where it showed: a flipped bit in `rows` made the
            // checksum table's offset look wrong.
            if stored != computed && stored != 0 {
                let why = match &e {
                    Error::Format { msg, .. } => msg.clone(),
                    other => other.to_string(),
                };
                return Err(bad(format!(
                    "header checksum mismatch (stored {stored:#010x}, computed {computed:#010x}): its fields changed after the file was written ({why}); the file is corrupt — regenerate or re-import it"
                )));
            }
            return Err(e);
        }
        if stored == 0 && computed != 0 {
            return Err(bad(format!(
                "header checksum is 0 (bytes 72–75; computed {computed:#010x}): every .mgt file carries one, so its header cannot be trusted — the checksum was zeroed, or the file was written by a build from before header checksums (before 2026-12-04); regenerate or re-import it"
            )));
        }
        if stored != computed {
            return Err(bad(format!(
                "header checksum mismatch (stored {stored:#010x}, computed {computed:#010x}): its fields changed after the file was written; the file is corrupt — regenerate or re-import it"
            )));
        }
        // The rest of the first page is reserved and zero; the CRC does not cover it, so a
        // damaged byte there is found here (when the caller read that far).
        let reserved = bytes.get(RAW_LEN + 4..bytes.len().min(ALIGN as usize));
        if let Some(at) = reserved.and_then(|r| r.iter().position(|&b| b != 0)) {
            let at = at + RAW_LEN + 4;
            return Err(bad(format!(
                "header byte {at} is {:#04x}, but bytes 76–4095 are reserved and zero: the header is damaged",
                bytes[at]
            )));
        }
        Ok(h)
    }

    /// Check the shape, tile and layout fields of a header read from `path` on their own.
    fn check_fields(&self, path: &Path) -> Result<()> {
        let bad = |msg: String| Error::format(path, msg);
        for (name, v) in [("rows", self.rows), ("cols", self.cols)] {
            if v == 0 {
                return Err(bad(format!(
                    "header field `{name}` is 0: empty matrices are not supported"
                )));
            }
        }
        for (name, v) in [("tile_rows", self.tile_rows), ("tile_cols", self.tile_cols)] {
            if v == 0 || v > MAX_TILE_EDGE {
                return Err(bad(format!(
                    "header field `{name}` is {v}; it must be between 1 and {MAX_TILE_EDGE}"
                )));
            }
        }
        let data_offset = self.data_offset;
        if data_offset < ALIGN || !data_offset.is_multiple_of(ALIGN) {
            return Err(bad(format!(
                "header field `data_offset` is {data_offset}; it must be a non-zero multiple of {ALIGN}"
            )));
        }
        let tile_stride = self.tile_stride;
        let size = self.dtype.size();
        let tile_bytes = self.tile_rows * self.tile_cols * size as u64; // ≤ 2^32·8, no overflow
        if tile_stride < tile_bytes || !tile_stride.is_multiple_of(ALIGN) {
            return Err(bad(format!(
                "header field `tile_stride` is {tile_stride}; it must be a multiple of {ALIGN} and at least tile_rows·tile_cols·{size} = {tile_bytes}"
            )));
        }
        let flags = self.flags;
        if flags & !KNOWN_FLAGS != 0 {
            return Err(bad(format!(
                "header field `flags` is {flags:#x}: unknown bits set; the file was written by a newer version"
            )));
        }
        Ok(())
    }

    /// The file length a header read from `path` needs (data, then the checksum table if any),
    /// with checked arithmetic: a header whose sizes overflow is an error.
    fn needed_len(&self, path: &Path) -> Result<u64> {
        let bad = |msg: String| Error::format(path, msg);
        let (rows, cols, tile_rows, tile_cols) =
            (self.rows, self.cols, self.tile_rows, self.tile_cols);
        let tile_stride = self.tile_stride;
        let data_end = rows
            .div_ceil(tile_rows)
            .checked_mul(cols.div_ceil(tile_cols))
            .and_then(|t| t.checked_mul(tile_stride))
            .and_then(|b| b.checked_add(self.data_offset))
            .ok_or_else(|| {
                bad(format!(
                    "header sizes overflow: {rows}×{cols} in {tile_rows}×{tile_cols} tiles of {tile_stride} bytes cannot be addressed"
                ))
            })?;
        if !self.has_checksums() {
            return Ok(data_end);
        }
        let off = self.checksum_table_offset;
        if off < data_end || !off.is_multiple_of(ALIGN) {
            return Err(bad(format!(
                "header field `checksum_table_offset` is {off}; it must be a multiple of {ALIGN} at or after the end of the tile data ({data_end})"
            )));
        }
        off.checked_add(self.tiles() * 4)
            .ok_or_else(|| bad("header field `checksum_table_offset` overflows".into()))
    }
}
