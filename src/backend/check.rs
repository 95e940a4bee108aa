//! Checking directly uploaded input blocks on the device that received them.
//!
//! With `engine.staging` direct, the GPU copies input blocks straight out of the files' pages;
//! the host used to read those pages a second time for the checks (each storage tile's CRC-32C
//! against the file's checksum table, the NaN/Inf count). For tf32/bf16 that read was the
//! busiest host stage: skipping it shortened a 32768² step on one H200 from 0.53–0.57 s to
//! 0.46–0.48 s (docs/decisions/0008-input-checks-on-the-gpu.md). So a lane that can ([`super::Lane::check_upload`]) runs
//! kernels/check.cu over the block it just received — the bytes the GPU got (for bf16/fp16 the
//! f32 block before its conversion), which is a stronger check than the host's — and hands back, per storage tile, the CRC and the count;
//! the host compares them with the table ([`crate::store::MatrixSource::settle_device_check`]).
//! A GPU's lanes do for tf32/bf16/fp16, where the GEMMs leave the GPU idle most of a step; with
//! fp32/fp64 they are GEMM-bound, the checks queued between copies cost 4.6 %, and the host has
//! time to spare, so it checks (§23). A check the device cannot give (no kernel, too many
//! tiles, a failed launch) is done by the host as before.
//!
//! [`mirror`] is the kernel in Rust, step for step (thread shares, slicing-by-4, the tree of
//! combines), so that its arithmetic is tested here, where there is no GPU.

#[cfg(any(test, feature = "fault-injection"))]
use crate::seam::DeviceCheckSpec;

/// A device check on its way: [`DeviceCheck::wait`] blocks until the device has done it and
/// returns `[crc, nonfinite]` per storage tile (in [`DeviceCheckSpec`](crate::seam::DeviceCheckSpec)'s order), or why it
/// could not (the host then checks the block itself).
pub trait DeviceCheck: Send {
    fn wait(self: Box<Self>) -> std::result::Result<Vec<[u32; 2]>, String>;
}

/// The most storage tiles one device check covers; staging leaves a block in more to the host.
pub(crate) const MAX_TILES: usize = 4096;

/// Threads per thread block in kernels/check.cu (`THREADS`).
pub(crate) const THREADS: u64 = 256;

#[cfg(any(test, feature = "fault-injection"))]
const POLY: u32 = 0x82f6_3b78;

#[cfg(any(test, feature = "fault-injection"))]
/// kernels/check.cu's `multmodp`: `a · b` modulo the CRC-32C polynomial, reflected.
fn multmodp(a: u32, mut b: u32) -> u32 {
    let mut m = 1u32 << 31;
    let mut p = 0;
    loop {
        if a & m != 0 {
            p ^= b;
            if a & (m - 1) == 0 {
                break;
            }
        }
        m >>= 1;
        if m == 0 {
            break; // a = 0, which never comes (x^n mod P is never 0); the kernel would spin
        }
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
    }
    p
}

#[cfg(any(test, feature = "fault-injection"))]
fn x2n_table() -> [u32; 64] {
    let mut t = [0u32; 64];
    let mut p = 1u32 << 30;
    t[0] = p;
    for e in t.iter_mut().skip(1) {
        p = multmodp(p, p);
        *e = p;
    }
    t
}

#[cfg(any(test, feature = "fault-injection"))]
fn x2nmodp(mut n: u64, mut k: u32, x2n: &[u32; 64]) -> u32 {
    let mut p = 1u32 << 31;
    while n != 0 {
        if n & 1 != 0 {
            p = multmodp(x2n[k as usize], p);
        }
        n >>= 1;
        k += 1;
    }
    p
}

#[cfg(any(test, feature = "fault-injection"))]
fn tables() -> [[u32; 256]; 4] {
    let mut tab = [[0u32; 256]; 4];
    for (n, e) in tab[0].iter_mut().enumerate() {
        let mut c = n as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
        }
        *e = c;
    }
    for k in 1..4 {
        for n in 0..256 {
            tab[k][n] = (tab[k - 1][n] >> 8) ^ tab[0][(tab[k - 1][n] & 0xff) as usize];
        }
    }
    tab
}

#[cfg(any(test, feature = "fault-injection"))]
/// kernels/check.cu's `check_tiles` on the host: `data` is the block as the device holds it.
pub(crate) fn mirror(data: &[u8], s: &DeviceCheckSpec) -> Vec<[u32; 2]> {
    let tab = tables();
    let x2n = x2n_table();
    let elem = s.elem as u64;
    (0..s.tiles() as u64)
        .map(|blk| {
            let (ti, tj) = (s.ti0 + blk / s.ntj, s.tj0 + blk % s.ntj);
            let ra = s.br0.max(ti * s.tile_rows);
            let rb = (s.br0 + s.brows).min((ti + 1) * s.tile_rows);
            let ca = s.bc0.max(tj * s.tile_cols);
            let cb = (s.bc0 + s.bcols).min((tj + 1) * s.tile_cols);
            let (rows, words) = (rb - ra, (cb - ca) * elem / 4);
            let q = rows.div_ceil(THREADS);
            let mut crcs = vec![0u32; THREADS as usize];
            let mut lens = vec![0u64; THREADS as usize];
            let mut counts = vec![0u32; THREADS as usize];
            for t in 0..THREADS {
                let (r0, r1) = ((t * q).min(rows), ((t + 1) * q).min(rows));
                let (mut crc, mut bad) = (0xffff_ffffu32, 0u32);
                for r in r0..r1 {
                    let at = (((ra - s.br0 + r) * s.bcols + (ca - s.bc0)) * elem) as usize;
                    for i in 0..words as usize {
                        let x = u32::from_le_bytes(
                            data[at + 4 * i..at + 4 * i + 4].try_into().unwrap(),
                        );
                        if elem == 4 {
                            bad += (x & 0x7f80_0000 == 0x7f80_0000) as u32;
                        } else if i & 1 == 1 {
                            bad += (x & 0x7ff0_0000 == 0x7ff0_0000) as u32;
                        }
                        crc ^= x;
                        crc = tab[3][(crc & 0xff) as usize]
                            ^ tab[2][((crc >> 8) & 0xff) as usize]
                            ^ tab[1][((crc >> 16) & 0xff) as usize]
                            ^ tab[0][(crc >> 24) as usize];
                    }
                }
                crcs[t as usize] = !crc;
                lens[t as usize] = (r1 - r0) * words * 4;
                counts[t as usize] = bad;
            }
            let mut step = 1;
            while step < THREADS as usize {
                for t in (0..THREADS as usize).step_by(2 * step) {
                    let lb = lens[t + step];
                    if lb != 0 {
                        crcs[t] = multmodp(x2nmodp(lb, 3, &x2n), crcs[t]) ^ crcs[t + step];
                    }
                    lens[t] += lb;
                    counts[t] += counts[t + step];
                }
                step *= 2;
            }
            [crcs[0], counts[0]]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CRC-32C and NaN/Inf count of each storage tile's part of the block, straight from
    /// the crc32c crate and a plain loop.
    fn expected(data: &[u8], s: &DeviceCheckSpec) -> Vec<[u32; 2]> {
        let elem = s.elem as u64;
        let mut out = Vec::new();
        for ti in s.ti0..s.ti0 + s.nti {
            for tj in s.tj0..s.tj0 + s.ntj {
                let ra = s.br0.max(ti * s.tile_rows);
                let rb = (s.br0 + s.brows).min((ti + 1) * s.tile_rows);
                let ca = s.bc0.max(tj * s.tile_cols);
                let cb = (s.bc0 + s.bcols).min((tj + 1) * s.tile_cols);
                let mut bytes = Vec::new();
                for r in ra..rb {
                    let at = (((r - s.br0) * s.bcols + (ca - s.bc0)) * elem) as usize;
                    bytes.extend_from_slice(&data[at..at + ((cb - ca) * elem) as usize]);
                }
                let dt = if elem == 4 {
                    crate::dtype::DType::F32
                } else {
                    crate::dtype::DType::F64
                };
                out.push([
                    crc32c::crc32c(&bytes),
                    crate::dtype::count_nonfinite(dt, &bytes) as u32,
                ]);
            }
        }
        out
    }

    /// A block of `rows × cols` at (r0, c0) of a matrix in `tr × tc` storage tiles.
    fn spec(
        r0: u64,
        c0: u64,
        rows: u64,
        cols: u64,
        tr: u64,
        tc: u64,
        elem: u32,
    ) -> DeviceCheckSpec {
        let (ti0, tj0) = (r0 / tr, c0 / tc);
        DeviceCheckSpec {
            brows: rows,
            bcols: cols,
            br0: r0,
            bc0: c0,
            tile_rows: tr,
            tile_cols: tc,
            ti0,
            tj0,
            nti: (r0 + rows).div_ceil(tr) - ti0,
            ntj: (c0 + cols).div_ceil(tc) - tj0,
            elem,
        }
    }

    #[test]
    fn the_kernels_arithmetic_matches_crc32c_on_blocks_that_straddle_tiles() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        // (r0, c0, rows, cols, tile rows, tile cols, elem): aligned, straddling, primes, one
        // row, one column, more rows than threads, fewer, tiles larger than the block.
        let cases = [
            (0, 0, 64, 64, 32, 32, 4),
            (5, 3, 37, 41, 16, 8, 4),
            (7, 0, 1, 29, 4, 8, 4),
            (0, 11, 23, 1, 8, 4, 8),
            (3, 2, 601, 9, 300, 4, 4),
            (0, 0, 520, 3, 1024, 1024, 8),
            (13, 17, 97, 31, 10, 7, 8),
        ];
        for (r0, c0, rows, cols, tr, tc, elem) in cases {
            let s = spec(r0, c0, rows, cols, tr, tc, elem);
            let mut data: Vec<u8> = (0..rows * cols * elem as u64)
                .map(|_| next() as u8)
                .collect();
            // Some NaN and Inf, as stored.
            let e = elem as usize;
            for k in [0usize, 5, 17] {
                let at = (k * e) % data.len();
                if elem == 4 {
                    data[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
                } else {
                    data[at..at + 8].copy_from_slice(&f64::INFINITY.to_le_bytes());
                }
            }
            assert_eq!(mirror(&data, &s), expected(&data, &s), "{s:?}");
        }
    }

    /// Lengths past 2^29 bytes reach x^(2^32) and beyond, where zlib's 32-entry table wraps
    /// (right for its polynomial, wrong for CRC-32C's): a 1 GiB tile part once came out wrong.
    #[test]
    fn combining_long_parts_matches_crc32c_combine() {
        let x2n = x2n_table();
        for len in [1u64 << 29, (1 << 30) + 12_345, 3 << 31, (1 << 40) + 7] {
            for (a, b) in [(0x1234_5678u32, 0x9abc_def0u32), (0xffff_ffff, 1)] {
                assert_eq!(
                    multmodp(x2nmodp(len, 3, &x2n), a) ^ b,
                    crc32c::crc32c_combine(a, b, len as usize),
                    "len {len}"
                );
            }
        }
    }

    #[test]
    fn combining_matches_crc32c_of_the_concatenation() {
        let x2n = x2n_table();
        let a: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        let b: Vec<u8> = (0..333u32).map(|i| (i * 13 + 1) as u8).collect();
        let whole: Vec<u8> = a.iter().chain(&b).copied().collect();
        let joined =
            multmodp(x2nmodp(b.len() as u64, 3, &x2n), crc32c::crc32c(&a)) ^ crc32c::crc32c(&b);
        assert_eq!(joined, crc32c::crc32c(&whole));
    }
}
