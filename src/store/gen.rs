//! `gen`: deterministic synthetic matrices written straight into a new tiled file.
//!
//! Every row has its own random stream (xoshiro256++ seeded from the seed and the row index), so
//! the file's contents depend only on (seed, shape, dist, dtype) — not on the thread count or the
//! tile size. Bands of storage-tile rows are contiguous in the file, so threads fill disjoint
//! slices of the file with no locking. The file appears at its name only when complete
//! ([`super::atomic`]).

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use rayon::prelude::*;

use super::atomic::TempOutput;
use super::header::Header;
use super::tiled::TiledWriter;
use crate::dtype::{self, DType};
use crate::error::{Error, Result};

/// The distribution of a generated matrix's values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dist {
    /// Standard normal values.
    Normal,
    /// Uniform values in [-1, 1).
    Uniform,
    /// The identity: 1 on the diagonal, 0 elsewhere.
    Identity,
    /// value = row·cols + col.
    Arange,
}

impl Dist {
    pub(crate) fn parse(s: &str) -> Option<Dist> {
        Some(match s {
            "normal" => Dist::Normal,
            "uniform" => Dist::Uniform,
            "identity" => Dist::Identity,
            "arange" => Dist::Arange,
            _ => return None,
        })
    }
    pub(crate) const NAMES: &'static str = "normal, uniform, identity, arange";
}

/// splitmix64, used to derive well-mixed seeds.
pub fn splitmix64(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// xoshiro256++ (Blackman & Vigna), small and fast; good enough for test matrices.
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A generator for one `stream` (e.g. a row index) of `seed`.
    pub fn new(seed: u64, stream: u64) -> Rng {
        let mut x = seed ^ stream.wrapping_mul(0xD134_2543_DE82_EF95);
        let s = [
            splitmix64(&mut x),
            splitmix64(&mut x),
            splitmix64(&mut x),
            splitmix64(&mut x),
        ];
        Rng { s }
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = (s[0].wrapping_add(s[3])).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }
    /// Uniform in [0, 1) with 53 random bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    /// Fill `out` with standard normal values (Box–Muller, pairs).
    pub fn normals(&mut self, out: &mut [f64]) {
        let mut i = 0;
        while i < out.len() {
            let u1 = 1.0 - self.unit(); // (0, 1]
            let u2 = self.unit();
            let r = (-2.0 * u1.ln()).sqrt();
            let (s, c) = (2.0 * std::f64::consts::PI * u2).sin_cos();
            out[i] = r * c;
            if i + 1 < out.len() {
                out[i + 1] = r * s;
            }
            i += 2;
        }
    }
}

/// Values of row `r` (length `cols`) for `dist`.
pub fn row_values(dist: Dist, seed: u64, r: u64, cols: u64, out: &mut [f64]) {
    match dist {
        Dist::Normal => Rng::new(seed, r).normals(out),
        Dist::Uniform => {
            let mut g = Rng::new(seed, r);
            out.iter_mut().for_each(|v| *v = 2.0 * g.unit() - 1.0);
        }
        Dist::Identity => {
            out.iter_mut().for_each(|v| *v = 0.0);
            if r < cols {
                out[r as usize] = 1.0;
            }
        }
        Dist::Arange => out
            .iter_mut()
            .enumerate()
            .for_each(|(c, v)| *v = (r * cols + c as u64) as f64),
    }
}

/// Whether `rows`×`cols` is past what any machine this runs on could hold (1 PiB as f64): such
/// a shape is refused by its name before a header is sized (whose arithmetic it would overflow).
pub(crate) fn absurdly_large(rows: u64, cols: u64) -> bool {
    rows.checked_mul(cols)
        .and_then(|n| n.checked_mul(8))
        .is_none_or(|b| b > 1 << 50)
}

/// What to generate: shape, element type, storage tiles, distribution and seed.
#[derive(Clone, Debug)]
pub struct GenSpec {
    /// Number of rows.
    pub rows: u64,
    /// Number of columns.
    pub cols: u64,
    /// Element type stored in the file.
    pub dtype: DType,
    /// Storage tile shape (rows, columns).
    pub tile: (u64, u64),
    /// Distribution of the values.
    pub dist: Dist,
    /// Seed of the random streams (the same seed gives the same file).
    pub seed: u64,
}

impl GenSpec {
    /// The header of the `.mgt` file this spec generates (checksums on).
    pub(crate) fn header(&self) -> Header {
        Header::new(
            self.dtype,
            self.rows,
            self.cols,
            self.tile.0,
            self.tile.1,
            true,
        )
    }
}

/// Generate a matrix into a new file at `path`. Returns the bytes written.
pub fn generate(path: &Path, spec: &GenSpec) -> Result<u64> {
    generate_counted(path, spec, &AtomicU64::new(0), None)
}

/// [`generate`], adding the data bytes written so far to `done` (for a progress display) and
/// stopping with an "interrupted" error when `cancel` becomes true. The file
/// appears at `path` only when it is complete: it is written under a temporary name beside it
/// after a free-space check and renamed at the end; on any error the partial file is removed
/// ([`TempOutput`]).
pub fn generate_counted(
    path: &Path,
    spec: &GenSpec,
    done: &AtomicU64,
    cancel: Option<&AtomicBool>,
) -> Result<u64> {
    if spec.rows == 0 || spec.cols == 0 {
        return Err(Error::Usage(format!(
            "{}: cannot generate a {}×{} matrix: both dimensions must be at least 1",
            path.display(),
            spec.rows,
            spec.cols
        )));
    }
    if super::OutputFormat::of(path) == super::OutputFormat::Npy {
        return generate_npy(path, spec, done, cancel);
    }
    let hdr = spec.header();
    let tmp = TempOutput::new(path, hdr.file_len())?;
    let w = TiledWriter::create_temp(&tmp, hdr, Default::default())?;
    // One band of storage-tile rows at a time per thread: generate whole rows (the random
    // stream is per row), lay them out as the band's tiles, write the band with one pwrite.
    (0..hdr.grid_rows()).into_par_iter().try_for_each(|ti| {
        if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Err(Error::Usage(format!(
                "interrupted; {} was not written (run the same command again)",
                path.display()
            )));
        }
        let band = band_bytes(spec, &hdr, ti);
        w.write_raw(hdr.tile_offset(ti, 0), &band)?;
        done.fetch_add(band.len() as u64, Ordering::Relaxed);
        Ok(())
    })?;
    w.finish(true)?;
    tmp.commit()?;
    Ok(hdr.file_len())
}

/// [`generate_counted`] for a name ending in `.npy`: a real `.npy`, written by the engine's own
/// `.npy` writer (`store::create_output_in`, as a step's output: data at byte 4096, the real
/// header and the checksum sidecar at the end), so that numpy loads what `gen` and a plan's
/// `generate` make under that name (it wrote the tiled format there before 2026-12-05, which
/// numpy refused as pickled data).
fn generate_npy(
    path: &Path,
    spec: &GenSpec,
    done: &AtomicU64,
    cancel: Option<&AtomicBool>,
) -> Result<u64> {
    let hdr = spec.header();
    let es = spec.dtype.size() as u64;
    let len = super::output_main_len(path, &hdr);
    let tmp = TempOutput::new(path, len)?;
    let w = super::create_output_in(super::OutputFormat::Npy, &tmp, hdr, Default::default())?;
    // Bands of whole rows of about 8 MiB, in parallel.
    let band = ((8u64 << 20) / (spec.cols * es).max(1)).clamp(1, spec.rows);
    (0..spec.rows.div_ceil(band))
        .into_par_iter()
        .try_for_each(|b| {
            if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                return Err(Error::Usage(format!(
                    "interrupted; {} was not written (run the same command again)",
                    path.display()
                )));
            }
            let (r0, r1) = (b * band, ((b + 1) * band).min(spec.rows));
            let mut bytes = vec![0u8; ((r1 - r0) * spec.cols * es) as usize];
            let mut vals = vec![0f64; spec.cols as usize];
            for (r, row) in (r0..r1).zip(bytes.chunks_exact_mut((spec.cols * es) as usize)) {
                row_values(spec.dist, spec.seed, r, spec.cols, &mut vals);
                for (v, out) in vals.iter().zip(row.chunks_exact_mut(es as usize)) {
                    dtype::put(spec.dtype, *v, out);
                }
            }
            let blk = super::Block {
                r0,
                c0: 0,
                rows: r1 - r0,
                cols: spec.cols,
            };
            w.write_block(&blk, spec.dtype, &bytes)?;
            done.fetch_add(bytes.len() as u64, Ordering::Relaxed);
            Ok(())
        })?;
    w.finish(true)?;
    tmp.commit()?;
    Ok(len)
}

/// The file bytes of storage-tile row `ti`: whole rows generated (the random stream is per
/// row) and laid out as the band's tiles.
fn band_bytes(spec: &GenSpec, hdr: &Header, ti: u64) -> Vec<u8> {
    let es = spec.dtype.size();
    let (dist, seed, cols, rows) = (spec.dist, spec.seed, spec.cols, spec.rows);
    let mut band = vec![0u8; (hdr.grid_cols() * hdr.tile_stride) as usize];
    let mut vals = vec![0f64; cols as usize];
    let r_start = ti * hdr.tile_rows;
    let r_end = (r_start + hdr.tile_rows).min(rows);
    for r in r_start..r_end {
        row_values(dist, seed, r, cols, &mut vals);
        let rr = r - r_start;
        // One storage tile's piece of the row at a time: no per-element index arithmetic.
        for (tj, seg) in vals.chunks(hdr.tile_cols as usize).enumerate() {
            let base = (tj as u64 * hdr.tile_stride + rr * hdr.tile_cols * es as u64) as usize;
            let dst = &mut band[base..base + seg.len() * es];
            match spec.dtype {
                DType::F32 => dst
                    .chunks_exact_mut(4)
                    .zip(seg)
                    .for_each(|(d, v)| d.copy_from_slice(&(*v as f32).to_le_bytes())),
                DType::F64 => dst
                    .chunks_exact_mut(8)
                    .zip(seg)
                    .for_each(|(d, v)| d.copy_from_slice(&v.to_le_bytes())),
                dt => dst
                    .chunks_exact_mut(es)
                    .zip(seg)
                    .for_each(|(d, v)| dtype::put(dt, *v, d)),
            }
        }
    }
    band
}
