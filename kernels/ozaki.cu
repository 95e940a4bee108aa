// fp64 GEMM emulated with exact int8 GEMMs (Ozaki scheme II): the elementwise steps of
// src/backend/ozaki.rs on the device, for one block C = alpha·op(A)·op(B) + beta·C of a CUDA
// lane (src/backend/cuda/emulate.rs runs them around cuBLAS's int8 GEMMs). The numerics — the
// per-vector scaling, the accuracy contract, Garner's reconstruction, the one rounding — are
// the CPU's, step for step; src/backend/ozaki.rs's module documentation derives them.
// Compiled at run time by NVRTC (no headers). Vectors: the rows of op(A) and the columns of
// op(B), element p of vector v at X[v·rs + p·ks].

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned __int128 u128;

// The moduli and Garner's inverses (inv[l] = (m_0···m_{l−1})⁻¹ mod m_l) as literals: every loop
// over the moduli is unrolled, so each `x % oz_m(l)` is a division by a constant, which the
// compiler turns into a multiply and shifts (a division by a value read from memory is a
// subroutine of ~20 instructions, and the reconstruction does O(N²) of them per element). Must
// equal ozaki::MODULI and ozaki::garner_inverses (a unit test in src/backend/cuda/emulate.rs
// reads these switches).
#define OZ_MAX 16
__device__ __forceinline__ u32 oz_m(int l) {
    switch (l) {
    case 0: return 256; case 1: return 255; case 2: return 253; case 3: return 251;
    case 4: return 247; case 5: return 241; case 6: return 239; case 7: return 233;
    case 8: return 229; case 9: return 227; case 10: return 223; case 11: return 217;
    case 12: return 211; case 13: return 199; case 14: return 197; default: return 193;
    }
}
__device__ __forceinline__ u32 oz_inv(int l) {
    switch (l) {
    case 0: return 1; case 1: return 1; case 2: return 211; case 3: return 182;
    case 4: return 246; case 5: return 184; case 6: return 41; case 7: return 115;
    case 8: return 161; case 9: return 54; case 10: return 163; case 11: return 149;
    case 12: return 46; case 13: return 142; case 14: return 91; default: return 116;
    }
}
__constant__ int OZ_T[OZ_MAX + 1] = {OZ_T_TABLE};
#define OZ_NONE (-2147483647 - 1)

// 2^e for e in [-1022, 1023].
__device__ __forceinline__ double oz_p2(int e) {
    return __longlong_as_double((i64)(0x3ff + e) << 52);
}

// x·2^n exactly where representable, else rounded once (musl's scalbn, as ozaki::scalbn).
__device__ double oz_scalbn(double x, int n) {
    double y = x;
    if (n > 1023) {
        y *= oz_p2(1023);
        n -= 1023;
        if (n > 1023) {
            y *= oz_p2(1023);
            n -= 1023;
            if (n > 1023) n = 1023;
        }
    } else if (n < -1022) {
        y *= oz_p2(-1022) * oz_p2(53);
        n += 1022 - 53;
        if (n < -1022) {
            y *= oz_p2(-1022) * oz_p2(53);
            n += 1022 - 53;
            if (n < -1022) n = -1022;
        }
    }
    return y * oz_p2(n);
}

// floor(log2 |x|) of a finite non-zero x, subnormals included (as ozaki::ilogb).
__device__ int oz_ilogb(double x) {
    u64 bits = (u64)__double_as_longlong(fabs(x));
    int e = (int)(bits >> 52);
    if (e == 0) {
        u64 frac = bits & ((1ull << 52) - 1);
        return -1023 - (__clzll((i64)frac) - 12);
    }
    return e - 1023;
}

// Per vector: q (2^q above its 2-norm; OZ_NONE for a zero vector), s = Σ|v|·2^-q, x = the
// exponent of its largest magnitude; flags[0] set when any element is NaN or Inf, and bit `side`
// of flags[3] when a vector is not all zero. One block of 256 threads per vector.
extern "C" __global__ void oz_info(const double* __restrict__ X, int count, int k, i64 rs, i64 ks,
                                   int* q, double* s, int* xo, u32* flags, u32 side) {
    __shared__ double red[256];
    __shared__ double red2[256];
    __shared__ int bad;
    int v = blockIdx.x;
    if (v >= count) return;
    const double* base = X + (i64)v * rs;
    int t = threadIdx.x;
    if (t == 0) bad = 0;
    __syncthreads();
    double amax = 0.0;
    int mybad = 0;
    for (int p = t; p < k; p += blockDim.x) {
        double e = base[(i64)p * ks];
        if (!isfinite(e)) mybad = 1;
        else amax = fmax(amax, fabs(e));
    }
    if (mybad) atomicOr(&bad, 1);
    red[t] = amax;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if (t < w) red[t] = fmax(red[t], red[t + w]);
        __syncthreads();
    }
    amax = red[0];
    __syncthreads();
    if (bad) {
        if (t == 0) {
            atomicOr(&flags[0], 1u);
            q[v] = OZ_NONE;
            s[v] = 0.0;
            xo[v] = 0;
        }
        return;
    }
    if (amax == 0.0) {
        if (t == 0) {
            q[v] = OZ_NONE;
            s[v] = 0.0;
            xo[v] = 0;
        }
        return;
    }
    int x = oz_ilogb(amax);
    double s2 = 0.0, s1 = 0.0;
    for (int p = t; p < k; p += blockDim.x) {
        double y = oz_scalbn(fabs(base[(i64)p * ks]), -x);
        s2 += y * y;
        s1 += y;
    }
    red[t] = s2;
    red2[t] = s1;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if (t < w) {
            red[t] += red[t + w];
            red2[t] += red2[t + w];
        }
        __syncthreads();
    }
    if (t == 0) {
        atomicOr(&flags[3], side);  // a non-zero vector on this side
        // A margin of 2^-30 for the rounding of the sum of squares (relative error below
        // (k+2)·u in any summation order).
        int qq = x + oz_ilogb(sqrt(red[0]) * (1.0 + oz_p2(-30))) + 1;
        q[v] = qq;
        s[v] = oz_scalbn(red2[0], x - qq);
        xo[v] = x;
    }
}

// The vectors in the TN layout the int8 GEMMs read: element p of vector v at v·kp + p, zero
// for p ≥ k and for zero vectors. Tiles of 32 vectors × 32 elements through shared memory, so
// that reads follow the stored order (along p when ks = 1, along v when rs = 1) and writes run
// along p. Vectors on grid x (up to 2^31 − 1 blocks), elements on grid y (kp/32 ≤ 2048).
// MODE 0: coarse |v|·2^(6−x_v) truncated (largest in [64, 127]) for the lower bound of |A||B|;
// MODE 1: trunc(v·2^(t−q_v)) (below 2^t in magnitude). `put(offset, value)` writes it.
template <typename T, int MODE, typename Put>
__device__ void oz_tn(const double* __restrict__ X, int count, int k, int kp, i64 rs, i64 ks,
                      const int* __restrict__ q, const int* __restrict__ xo, int t, Put put) {
    __shared__ T tile[32][33];
    int v0 = blockIdx.x * 32, p0 = blockIdx.y * 32;
    bool along_p = ks == 1;
    for (int r = threadIdx.y; r < 32; r += blockDim.y) {
        int v = v0 + (along_p ? r : threadIdx.x);
        int p = p0 + (along_p ? threadIdx.x : r);
        T val = 0;
        if (v < count && p < k && q[v] != OZ_NONE) {
            double e = X[(i64)v * rs + (i64)p * ks];
            if (MODE == 0) val = (T)trunc(oz_scalbn(fabs(e), 6 - xo[v]));
            else val = (T)trunc(oz_scalbn(e, t - q[v]));
        }
        if (along_p) tile[r][threadIdx.x] = val;
        else tile[threadIdx.x][r] = val;
    }
    __syncthreads();
    for (int r = threadIdx.y; r < 32; r += blockDim.y) {
        int v = v0 + r, p = p0 + threadIdx.x;
        if (v < count && p < kp) put((i64)v * kp + p, tile[r][threadIdx.x]);
    }
}

extern "C" __global__ void oz_coarse(const double* X, int count, int k, int kp, i64 rs, i64 ks,
                                     const int* q, const int* xo, signed char* out) {
    oz_tn<signed char, 0>(X, count, k, kp, rs, ks, q, xo, 0,
                          [&](i64 o, signed char x) { out[o] = x; });
}

// a mod m_l for |a| < 2^63, symmetric in [−m/2, m/2) as int8: in two 32-bit halves
// (a 64-bit division is a long subroutine on the GPU; by a constant 32-bit one is a multiply).
__device__ __forceinline__ signed char oz_sym(i64 a, int l) {
    const u32 m = oz_m(l);
    u64 ua = a < 0 ? (u64)(-a) : (u64)a;
    u32 hi = (u32)(ua >> 32), lo = (u32)ua;
    const u32 r32 = (u32)(((u64)1 << 32) % m);
    u32 r = ((hi % m) * r32 + lo % m) % m;  // below 2^16 before the last reduction
    int sr = a < 0 ? (r == 0 ? 0 : (int)(m - r)) : (int)r;
    if (2 * sr >= (int)m) sr -= (int)m;
    return (signed char)sr;
}

// The int8 residues of the scaled integers trunc(v·2^(t−q_v)) for the first nm moduli, in one
// pass: each element is read and scaled once and its nm residues written, residue l to plane
// l (out + l·plane, the TN layout of oz_tn). The integers never reach memory.
extern "C" __global__ void oz_split(const double* X, int count, int k, int kp, i64 rs, i64 ks,
                                    const int* q, int t, int nm, i64 plane, signed char* out) {
    oz_tn<i64, 1>(X, count, k, kp, rs, ks, q, q, t, [&](i64 o, i64 x) {
#pragma unroll
        for (int l = 0; l < OZ_MAX; l++)
            if (l < nm) out[l * plane + o] = oz_sym(x, l);
    });
}

// The accuracy contract per element (i, j) from the coarse product g = (ÃB̃)_ij: the fewest
// moduli that meet auto's aim (out[0], at most OZ_MAX) and the fewest that meet the bound
// itself (out[1], OZ_MAX + 1 when none does), as maxima over the block. g is row-major m×n with
// rows ldc apart (n padded for cuBLAS). Columns on grid x (256 threads per block), rows on grid
// y, strided. Reduced per block in shared memory first: one atomic per block, not per thread.
extern "C" __global__ void oz_select(const int* __restrict__ g, int m, int n, int ldc, int k,
                                     const int* __restrict__ qa, const double* __restrict__ sa,
                                     const int* __restrict__ xa, const int* __restrict__ qb,
                                     const double* __restrict__ sb, const int* __restrict__ xb,
                                     u32* out) {
    __shared__ u32 red_need[256];
    __shared__ u32 red_least[256];
    double budget = (double)k / 4.0 * oz_p2(-53);
    double rk = sqrt((double)k);
    double margin = 1.0 + oz_p2(-20);
    u32 need_max = 1, least_max = 1;
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    for (int i = blockIdx.y; j < n && i < m; i += gridDim.y) {
        int qi = qa[i], rj = qb[j];
        if (qi == OZ_NONE || rj == OZ_NONE) continue;
        double gp = oz_scalbn((double)g[(u64)i * ldc + j], xa[i] - 6 - qi + xb[j] - 6 - rj);
        double sp = sa[i] + sb[j];
        u32 need = 1;
        while (need < OZ_MAX && !(oz_p2(-OZ_T[need]) * sp * rk * margin <= budget * gp)) need++;
        u32 least = 1;
        while (least <= OZ_MAX && !(oz_p2(-OZ_T[least]) * sp * margin <= budget * gp)) least++;
        need_max = max(need_max, need);
        least_max = max(least_max, least);
    }
    int t = threadIdx.x;
    red_need[t] = need_max;
    red_least[t] = least_max;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if (t < w) {
            red_need[t] = max(red_need[t], red_need[t + w]);
            red_least[t] = max(red_least[t], red_least[t + w]);
        }
        __syncthreads();
    }
    if (t == 0) {
        atomicMax(&out[0], red_need[0]);
        atomicMax(&out[1], red_least[0]);
    }
}

// plane[i·n + j] = c[i·ldc + j] mod m_L in [0, m_L): the residue of one modulus's integer
// product (c's rows padded to ldc for cuBLAS, the plane dense). Columns on grid x, rows on grid
// y, strided (no division of a flat index).
template <int L>
__device__ void oz_reduce_by(const int* __restrict__ c, int m_rows, int n, int ldc,
                             unsigned char* __restrict__ plane) {
    const int m = (int)oz_m(L);
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    for (int i = blockIdx.y; i < m_rows; i += gridDim.y) {
        int r = c[(i64)i * ldc + j] % m;
        plane[(i64)i * n + j] = (unsigned char)(r < 0 ? r + m : r);
    }
}

extern "C" __global__ void oz_reduce(const int* __restrict__ c, int m_rows, int n, int ldc, int l,
                                     unsigned char* plane) {
    switch (l) {
#define OZ_R(L) case L: oz_reduce_by<L>(c, m_rows, n, ldc, plane); break;
    OZ_R(0) OZ_R(1) OZ_R(2) OZ_R(3) OZ_R(4) OZ_R(5) OZ_R(6) OZ_R(7)
    OZ_R(8) OZ_R(9) OZ_R(10) OZ_R(11) OZ_R(12) OZ_R(13) OZ_R(14) OZ_R(15)
#undef OZ_R
    }
}

// x·2^s rounded once to nearest even, also when subnormal, |x| < 2^127 (as ozaki::i128_ldexp).
__device__ double oz_i128_ldexp(u128 ux, bool neg, int s) {
    if (ux == 0) return 0.0;
    u64 hi = (u64)(ux >> 64), lo = (u64)ux;
    int bits = hi ? 128 - __clzll((i64)hi) : 64 - __clzll((i64)lo);
    double r;
    if (bits - 1 + s >= -1022) {
        // Normal: round the integer to 53 bits once (64 leading bits with a sticky bit give the
        // same rounding), then scale exactly.
        int sh = bits > 64 ? bits - 64 : 0;
        u64 top = (u64)(ux >> sh);
        if (sh > 0 && (ux & (((u128)1 << sh) - 1)) != 0) top |= 1;
        r = oz_scalbn(__ull2double_rn(top), s + sh);
    } else {
        int sh = -(s + 1074);
        u128 qv;
        if (sh <= 0) qv = ux << (-sh);
        else if (sh >= 127) qv = 0;
        else {
            qv = ux >> sh;
            u128 rem = ux & (((u128)1 << sh) - 1);
            u128 half = (u128)1 << (sh - 1);
            if (rem > half || (rem == half && (qv & 1))) qv += 1;
        }
        r = oz_scalbn(__ull2double_rn((u64)qv), -1074);
    }
    return neg ? -r : r;
}

// C = alpha·P + beta·C with P the exact product rebuilt from its nm residues (Garner's
// mixed-radix digits, the symmetric adjustment) and rounded once: planes[l·m·n + e] holds residue
// l of element e = i·n + j; C row-major m×n; nm = 0: the product is zero (a side all zero),
// C = beta·C. The roundings of the native path: beta·C, alpha·P, their sum (no fused
// multiply-add). Every loop over the moduli is unrolled (literal moduli and inverses); the
// digits' partial sums are reduced every third step (below 2^32 in between: each step is
// s·c + v with c, v < 256). The mixed-radix value is formed in two 64-bit halves (the first
// eight moduli's product is below 2^64, so is the last eight's) and one 64×64→128 product.
// Columns on grid x, rows on grid y, strided.
extern "C" __global__ void oz_rebuild(const unsigned char* __restrict__ planes, int nm, int m,
                                      int n, const int* __restrict__ qa,
                                      const int* __restrict__ qb, int t, u64 mod_lo, u64 mod_hi,
                                      double alpha, double beta, double* C) {
    u64 total = (u64)m * n;
    u128 M = ((u128)mod_hi << 64) | mod_lo;
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    for (int i = blockIdx.y; i < m; i += gridDim.y) {
        u64 e = (u64)i * n + j;
        double p = 0.0;
        if (nm > 0 && qa[i] != OZ_NONE && qb[j] != OZ_NONE) {
            u32 v[OZ_MAX];
            v[0] = planes[e];
#pragma unroll
            for (int l = 1; l < OZ_MAX; l++) {
                if (l < nm) {
                    const u32 ml = oz_m(l);
                    // s = (v_0 + m_0(v_1 + … m_{l−2}·v_{l−1})) mod m_l
                    u32 s = v[l - 1];
                    int since = 0;
#pragma unroll
                    for (int jj = l - 2; jj >= 0; jj--) {
                        s = s * (oz_m(jj) % ml) + v[jj];
                        if (++since == 3 || jj == 0) {
                            s %= ml;
                            since = 0;
                        }
                    }
                    if (l == 1) s %= ml;
                    u32 c = planes[(u64)l * total + e];
                    v[l] = (c + 2 * ml - s) * oz_inv(l) % ml;  // below 3·2^16 before it
                } else {
                    v[l] = 0;
                }
            }
            // x = lo + (m_0···m_7)·hi, lo and hi each Horner in 64 bits over eight digits.
            u64 lo = 0, hi = 0, p8 = 1;
#pragma unroll
            for (int jj = OZ_MAX - 1; jj >= 8; jj--) hi = hi * oz_m(jj) + v[jj];
#pragma unroll
            for (int jj = 7; jj >= 0; jj--) {
                lo = lo * oz_m(jj) + v[jj];
                p8 *= oz_m(jj);
            }
            u128 x = (u128)lo + (u128)p8 * hi;
            bool neg = 2 * x >= M;
            u128 ax = neg ? M - x : x;
            p = oz_i128_ldexp(ax, neg, qa[i] + qb[j] - 2 * t);
        }
        double ap = __dmul_rn(alpha, p);
        if (beta == 0.0) C[e] = ap;
        else if (beta == 1.0) C[e] = __dadd_rn(C[e], ap);
        else C[e] = __dadd_rn(__dmul_rn(C[e], beta), ap);
    }
}
