// The checks of an input block the GPU copied straight from a file's pages (engine.staging):
// for each storage tile the block touches, the CRC-32C of the tile's part of the block, in the
// file's byte order, and the number of NaN/Inf elements in it. The host compares the CRCs with
// the file's checksum table (src/store/tiled.rs, check_tile), as it would have after reading
// the same bytes itself; here they are the bytes the GEMMs will read.
//
// Compiled at run time by NVRTC (no headers). src/backend/check.rs mirrors this kernel in Rust
// step by step; its tests hold the mirror to the crc32c crate on blocks that straddle tiles.
//
// One thread block per storage tile (gridDim.x = tiles), 256 threads. The block is dense
// row-major in device memory: `brows` x `bcols` elements of `elem` (4 or 8) bytes, its element
// (0, 0) being the matrix's (br0, bc0). Storage tile (ti, tj) spans matrix rows
// [ti*tile_rows, (ti+1)*tile_rows) and columns [tj*tile_cols, (tj+1)*tile_cols); the tiles are
// ti0.., tj0.. in row-major order, ntj per row. Thread t takes a contiguous share of the tile
// part's rows and runs CRC-32C over them (slicing by 4); the threads' CRCs are then joined in a
// tree, zlib's crc32_combine: crc(A B) = x^(8|B|) * crc(A) + crc(B) mod P.
// out[2*tile] = CRC-32C, out[2*tile + 1] = NaN/Inf count.

#define POLY 0x82f63b78u
#define THREADS 256

// a * b modulo P, reflected (bit 31 is x^0): zlib's multmodp.
__device__ unsigned int multmodp(unsigned int a, unsigned int b) {
    unsigned int m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

// x^(n * 2^k) modulo P, x2n[j] = x^(2^j): zlib's x2nmodp, but with a table of 64 powers where
// zlib has 32 and wraps (x^(2^32) = x holds for zlib's CRC-32 polynomial, not for CRC-32C's,
// where it is x^2): n is a byte count below 2^61 and k = 3, so k + bits(n) stays below 64.
__device__ unsigned int x2nmodp(unsigned long long n, unsigned int k, const unsigned int* x2n) {
    unsigned int p = 1u << 31;
    while (n) {
        if (n & 1) p = multmodp(x2n[k], p);
        n >>= 1;
        k++;
    }
    return p;
}

extern "C" __global__ void check_tiles(const unsigned char* __restrict__ data,
                                       unsigned long long brows, unsigned long long bcols,
                                       unsigned long long br0, unsigned long long bc0,
                                       unsigned long long tile_rows, unsigned long long tile_cols,
                                       unsigned long long ti0, unsigned long long tj0,
                                       unsigned long long ntj, unsigned int elem,
                                       unsigned int* __restrict__ out) {
    __shared__ unsigned int tab[4][256];
    __shared__ unsigned int x2n[64];
    __shared__ unsigned int crcs[THREADS];
    __shared__ unsigned long long lens[THREADS];
    __shared__ unsigned int counts[THREADS];
    const unsigned int t = threadIdx.x;

    // Slicing-by-4 tables: tab[0] the byte table, tab[k][n] = tab[k-1][n] >> 8 ^ tab[0][low byte].
    unsigned int c = t;
    for (int i = 0; i < 8; i++) c = (c & 1) ? (c >> 1) ^ POLY : c >> 1;
    tab[0][t] = c;
    __syncthreads();
    for (int k = 1; k < 4; k++) {
        tab[k][t] = (tab[k - 1][t] >> 8) ^ tab[0][tab[k - 1][t] & 0xff];
        __syncthreads();
    }
    if (t == 0) {
        unsigned int p = 1u << 30;  // x^1
        x2n[0] = p;
        for (int n = 1; n < 64; n++) x2n[n] = p = multmodp(p, p);
    }

    // This thread block's storage tile and its part of the block.
    const unsigned long long ti = ti0 + blockIdx.x / ntj, tj = tj0 + blockIdx.x % ntj;
    const unsigned long long ra = max(br0, ti * tile_rows), rb = min(br0 + brows, (ti + 1) * tile_rows);
    const unsigned long long ca = max(bc0, tj * tile_cols), cb = min(bc0 + bcols, (tj + 1) * tile_cols);
    const unsigned long long rows = rb - ra, words = (cb - ca) * elem / 4;
    const unsigned long long q = (rows + THREADS - 1) / THREADS;
    const unsigned long long r0 = min(rows, t * q), r1 = min(rows, (t + 1) * q);

    unsigned int crc = 0xffffffffu, bad = 0;
    for (unsigned long long r = r0; r < r1; r++) {
        const unsigned int* w = (const unsigned int*)(data + ((ra - br0 + r) * bcols + (ca - bc0)) * elem);
        for (unsigned long long i = 0; i < words; i++) {
            const unsigned int x = w[i];
            if (elem == 4) {
                bad += (x & 0x7f800000u) == 0x7f800000u;
            } else if (i & 1) {
                bad += (x & 0x7ff00000u) == 0x7ff00000u;  // the high half of an f64
            }
            crc ^= x;
            crc = tab[3][crc & 0xff] ^ tab[2][(crc >> 8) & 0xff] ^ tab[1][(crc >> 16) & 0xff] ^ tab[0][crc >> 24];
        }
    }
    crcs[t] = ~crc;  // 0 for no bytes: the CRC of nothing
    lens[t] = (r1 - r0) * words * 4;
    counts[t] = bad;
    __syncthreads();

    // Join neighbours, then pairs of pairs, ...: crcs[t] ends as the CRC of threads t..t+2s-1.
    for (unsigned int s = 1; s < THREADS; s <<= 1) {
        if (t % (2 * s) == 0) {
            const unsigned long long lb = lens[t + s];
            if (lb) crcs[t] = multmodp(x2nmodp(lb, 3, x2n), crcs[t]) ^ crcs[t + s];
            lens[t] += lb;
            counts[t] += counts[t + s];
        }
        __syncthreads();
    }
    if (t == 0) {
        out[2 * blockIdx.x] = crcs[0];
        out[2 * blockIdx.x + 1] = counts[0];
    }
}
