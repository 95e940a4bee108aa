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

// Must equal ozaki::MODULI and t_of (a unit test in src/backend/cuda/emulate.rs compares).
#define OZ_MAX 16
__constant__ u32 OZ_MODULI[OZ_MAX] = {256, 255, 253, 251, 247, 241, 239, 233,
                                      229, 227, 223, 217, 211, 199, 197, 193};
// The same moduli as literals, X(l, m_l) for each: a `%` by a literal compiles to a multiply
// and shifts, by a value read from OZ_MODULI to a division routine (tens of instructions) —
// which made the residues, the reductions and Garner's reconstruction, not the int8 GEMMs, most
// of an emulated block's time on an H200 (docs/measurements/2026-12-05b-h200-2-npy-cut-fp64e-locked.log).
#define OZ_EACH_MODULUS(X) \
    X(0, 256) X(1, 255) X(2, 253) X(3, 251) X(4, 247) X(5, 241) X(6, 239) X(7, 233) \
    X(8, 229) X(9, 227) X(10, 223) X(11, 217) X(12, 211) X(13, 199) X(14, 197) X(15, 193)
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

// A grid-stride walk over the elements e of an m×n row-major matrix with its row i and column j
// kept by additions: a 64-bit division per element (e / n, e % n) cost more than the work on
// the element in oz_reduce. Two divisions per thread instead.
struct OzWalk {
    u64 e, step;
    u64 i, j, si, sj, n;
    __device__ explicit OzWalk(u64 cols) {
        n = cols ? cols : 1;  // an empty matrix: no element, and no division by zero
        e = (u64)blockIdx.x * blockDim.x + threadIdx.x;
        step = (u64)gridDim.x * blockDim.x;
        i = e / n;
        j = e % n;
        si = step / n;
        sj = step % n;
    }
    __device__ void next() {
        e += step;
        i += si;
        j += sj;
        if (j >= n) {
            j -= n;
            i++;
        }
    }
};

// m_l as a compile-time constant: OzM<l>::v.
template <int L> struct OzM;
#define OZ_M_TYPE(l, m) \
    template <> struct OzM<l> { static constexpr u32 v = m; };
OZ_EACH_MODULUS(OZ_M_TYPE)
#undef OZ_M_TYPE

// |a| mod M of a = ±ua (ua < 2^63), symmetric in [−M/2, M/2), as int8. M a literal: the
// 64-bit remainder is a multiply-high and shifts.
template <u32 M>
__device__ __forceinline__ signed char oz_sym(u64 ua, bool neg) {
    int r = (int)(ua % M);
    int sr = neg ? (r == 0 ? 0 : (int)M - r) : r;
    if (2 * sr >= (int)M) sr -= (int)M;
    return (signed char)sr;
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

// Coarse copies of the vectors for the lower bound of |A||B|: |v|·2^(6−x_v) truncated (int8,
// largest in [64, 127]) in the TN layout the int8 GEMMs read, out[v·kp + p], zero for p ≥ k and
// for zero vectors. Tiles of 32 vectors × 32 elements through shared memory, so that reads
// follow the stored order (along p when ks = 1, along v when rs = 1) and writes run along p.
// Vectors on grid x (up to 2^31 − 1 blocks), elements on grid y (kp/32 ≤ 2048).
extern "C" __global__ void oz_coarse(const double* __restrict__ X, int count, int k, int kp,
                                     i64 rs, i64 ks, const int* __restrict__ q,
                                     const int* __restrict__ xo, signed char* __restrict__ out) {
    __shared__ signed char tile[32][33];
    int v0 = blockIdx.x * 32, p0 = blockIdx.y * 32;
    bool along_p = ks == 1;
    for (int r = threadIdx.y; r < 32; r += blockDim.y) {
        int v = v0 + (along_p ? r : threadIdx.x);
        int p = p0 + (along_p ? threadIdx.x : r);
        signed char val = 0;
        if (v < count && p < k && q[v] != OZ_NONE)
            val = (signed char)trunc(oz_scalbn(fabs(X[(i64)v * rs + (i64)p * ks]), 6 - xo[v]));
        if (along_p) tile[r][threadIdx.x] = val;
        else tile[threadIdx.x][r] = val;
    }
    __syncthreads();
    for (int r = threadIdx.y; r < 32; r += blockDim.y) {
        int v = v0 + r, p = p0 + threadIdx.x;
        if (v < count && p < kp) out[(i64)v * kp + p] = tile[r][threadIdx.x];
    }
}

// The scaled integers x = trunc(v·2^(t−q_v)) (below 2^t in magnitude) of every vector, never
// stored: their residues mod each of the first nm moduli, symmetric in [−m/2, m/2), as int8 in
// the TN layout, plane l at out[l·plane + v·kp + p] (zero for p ≥ k and for zero vectors). One
// pass over the operand for all moduli (it was a pass over an int64 copy per modulus), the
// transposing tile of oz_tn holding the integers.
extern "C" __global__ void oz_split(const double* __restrict__ X, int count, int k, int kp, i64 rs,
                                    i64 ks, const int* __restrict__ q, int t, int nm, u64 plane,
                                    signed char* __restrict__ out) {
    __shared__ i64 tile[32][33];
    int v0 = blockIdx.x * 32, p0 = blockIdx.y * 32;
    bool along_p = ks == 1;
    for (int r = threadIdx.y; r < 32; r += blockDim.y) {
        int v = v0 + (along_p ? r : threadIdx.x);
        int p = p0 + (along_p ? threadIdx.x : r);
        i64 val = 0;
        if (v < count && p < k && q[v] != OZ_NONE)
            val = (i64)trunc(oz_scalbn(X[(i64)v * rs + (i64)p * ks], t - q[v]));
        if (along_p) tile[r][threadIdx.x] = val;
        else tile[threadIdx.x][r] = val;
    }
    __syncthreads();
    for (int r = threadIdx.y; r < 32; r += blockDim.y) {
        int v = v0 + r, p = p0 + threadIdx.x;
        if (v >= count || p >= kp) continue;
        i64 a = tile[r][threadIdx.x];
        bool neg = a < 0;
        u64 ua = neg ? (u64)(-a) : (u64)a;
        u64 at = (u64)v * kp + p;
#define OZ_SPLIT_ONE(l, m) \
        if (l < nm) out[(u64)l * plane + at] = oz_sym<m>(ua, neg);
        OZ_EACH_MODULUS(OZ_SPLIT_ONE)
#undef OZ_SPLIT_ONE
    }
}

// The accuracy contract per element (i, j) from the coarse product g = (ÃB̃)_ij: the fewest
// moduli that meet auto's aim (out[0], at most OZ_MAX) and the fewest that meet the bound
// itself (out[1], OZ_MAX + 1 when none does), as maxima over the block. g is row-major m×n with
// rows ldc apart (n padded for cuBLAS). Reduced per block in shared memory first: one atomic
// per block, not per thread. Launched with 256 threads per block.
extern "C" __global__ void oz_select(const int* __restrict__ g, int m, int n, int ldc, int k,
                                     const int* __restrict__ qa, const double* __restrict__ sa,
                                     const int* __restrict__ xa, const int* __restrict__ qb,
                                     const double* __restrict__ sb, const int* __restrict__ xb,
                                     u32* out) {
    __shared__ u32 red_need[256];
    __shared__ u32 red_least[256];
    u64 total = (u64)m * n;
    double budget = (double)k / 4.0 * oz_p2(-53);
    double rk = sqrt((double)k);
    double margin = 1.0 + oz_p2(-20);
    u32 need_max = 1, least_max = 1;
    for (OzWalk w(n); w.e < total; w.next()) {
        int i = (int)w.i, j = (int)w.j;
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

// plane[i·n + j] = c[i·ldc + j] mod m_l in [0, m_l): the residue of modulus l's integer product
// (c's rows padded to ldc for cuBLAS, the plane dense).
template <u32 M>
__device__ void oz_reduce_by(const int* __restrict__ c, int m_rows, int n, int ldc,
                             unsigned char* __restrict__ plane) {
    u64 len = (u64)m_rows * n;
    for (OzWalk w(n); w.e < len; w.next()) {
        int x = c[w.i * ldc + w.j];
        u32 r = (u32)(x < 0 ? -(i64)x : (i64)x) % M;
        plane[w.e] = (unsigned char)(x < 0 && r != 0 ? M - r : r);
    }
}

extern "C" __global__ void oz_reduce(const int* __restrict__ c, int m_rows, int n, int ldc, int l,
                                     unsigned char* plane) {
    switch (l) {
#define OZ_REDUCE_ONE(L, m) \
    case L: oz_reduce_by<m>(c, m_rows, n, ldc, plane); break;
        OZ_EACH_MODULUS(OZ_REDUCE_ONE)
#undef OZ_REDUCE_ONE
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

// Garner's digit l's running sum: acc = (acc·m_J + d[J]) mod m_L for J = L−2 … 0, every
// modulus a literal.
template <int L, int J>
__device__ __forceinline__ u32 oz_garner_sum(const u32* d, u32 acc) {
    if constexpr (J < 0) {
        return acc;
    } else {
        constexpr u32 ml = OzM<L>::v;
        return oz_garner_sum<L, J - 1>(d, (acc * (OzM<J>::v % ml) + d[J]) % ml);
    }
}

// Garner's mixed-radix digits d[L..nm) of an element from its residues c_l (planes[l·total + e]),
// d[0..L) known: d_L = (c_L − Σ) · inv_L mod m_L, added into x = Σ d_l·w_l as they come (w the
// product of the moduli before L), so that every index is a constant and d stays in registers.
template <int L>
__device__ __forceinline__ void oz_digits(u32* d, int nm, const unsigned char* __restrict__ planes,
                                          u64 total, u64 e, u64 inv_lo, u64 inv_hi, u128& x,
                                          u128 w) {
    if constexpr (L < OZ_MAX) {
        if (L >= nm) return;
        constexpr u32 ml = OzM<L>::v;
        u32 acc = oz_garner_sum<L, L - 2>(d, d[L - 1]);
        u32 inv = (u32)(((L < 8 ? inv_lo : inv_hi) >> (8 * (L % 8))) & 0xff);
        u32 c = planes[(u64)L * total + e];
        d[L] = (c + 2 * ml - acc) % ml * inv % ml;
        x += (u128)d[L] * w;
        oz_digits<L + 1>(d, nm, planes, total, e, inv_lo, inv_hi, x, w * ml);
    }
}

// C = alpha·P + beta·C with P the exact product rebuilt from its nm residues (Garner's
// mixed-radix digits, Horner in 128 bits, the symmetric adjustment) and rounded once:
// planes[l·m·n + e] holds residue l of element e; C row-major m×n; nm = 0: the product is
// zero (a side all zero), C = beta·C. The roundings of the
// native path: beta·C, alpha·P, their sum (no fused multiply-add).
extern "C" __global__ void oz_rebuild(const unsigned char* __restrict__ planes, int nm, int m,
                                      int n, const int* __restrict__ qa,
                                      const int* __restrict__ qb, int t, u64 inv_lo, u64 inv_hi,
                                      u64 mod_lo, u64 mod_hi, double alpha, double beta,
                                      double* C) {
    // inv: Garner's inverses, 8 bits each packed into two u64 (moduli 1..15); mod: M.
    u64 total = (u64)m * n;
    u128 M = ((u128)mod_hi << 64) | mod_lo;
    for (OzWalk w(n); w.e < total; w.next()) {
        u64 e = w.e;
        int i = (int)w.i, j = (int)w.j;
        double p = 0.0;
        if (nm > 0 && qa[i] != OZ_NONE && qb[j] != OZ_NONE) {
            u32 d[OZ_MAX];
            d[0] = planes[e];
            u128 x = d[0];
            oz_digits<1>(d, nm, planes, total, e, inv_lo, inv_hi, x, (u128)OzM<0>::v);
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
