// kernels/ozaki.cu run on the CPU, each CUDA thread a std::thread and __syncthreads a barrier,
// driven as src/backend/cuda/emulate.rs drives them (info, coarse, an int8 GEMM in the TN
// layout, select, split into one residue plane per modulus, per modulus GEMM + reduce,
// rebuild; one case with emulate.rs's own launch shapes), and every element
// checked against a double-double reference and native DGEMM's bound (K+2)·u·(|α||A||B| +
// |β||C0|). What it checks is the kernels' arithmetic and indexing — strides of transposed
// operands, the TN layout, padding, Garner, the 128-bit rounding — without a GPU; cuBLAS and
// the launches' sizes are the GPU machine's to check (tools/checks/cuda_tests.sh).
//
//   tools/checks/ozaki_kernels_on_host.sh      (compiles this with g++ and runs it)

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

// ---- the CUDA names kernels/ozaki.cu uses, on the host ------------------------------------
#define __global__
#define __device__
#define __forceinline__ inline
#define __constant__ static const
#define __restrict__
#define __shared__ static thread_local_shared
struct dim3 { unsigned x = 1, y = 1, z = 1; };
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
static std::barrier<>* g_bar = nullptr;
static inline void __syncthreads() { g_bar->arrive_and_wait(); }
// `__shared__ T x;` becomes a static shared by the block's threads (blocks run one at a time).
#define thread_local_shared
static inline double __longlong_as_double(long long v) { double d; std::memcpy(&d, &v, 8); return d; }
static inline long long __double_as_longlong(double d) { long long v; std::memcpy(&v, &d, 8); return v; }
static inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
static inline double __ull2double_rn(unsigned long long x) { return (double)x; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline int atomicOr(int* p, int v) { return std::atomic_ref<int>(*p).fetch_or(v); }
static inline unsigned atomicOr(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_or(v); }
static inline unsigned atomicMax(unsigned* p, unsigned v) {
    std::atomic_ref<unsigned> a(*p);
    unsigned old = a.load();
    while (old < v && !a.compare_exchange_weak(old, v)) {}
    return old;
}
using std::max;
using std::isfinite;

#include "ozaki_host_src.inc"  // kernels/ozaki.cu with OZ_T_TABLE filled (the .sh makes it)

// Run `body` as a grid of blocks, each block's threads as std::threads.
static void launch(dim3 grid, dim3 block, const std::function<void()>& body) {
    gridDim = grid;
    blockDim = block;
    unsigned n = block.x * block.y;
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                std::barrier<> bar(n);
                g_bar = &bar;
                std::vector<std::thread> ts;
                for (unsigned ty = 0; ty < block.y; ty++)
                    for (unsigned tx = 0; tx < block.x; tx++)
                        ts.emplace_back([&, tx, ty, bx, by] {
                            threadIdx = {tx, ty, 0};
                            blockIdx = {bx, by, 0};
                            body();
                        });
                for (auto& t : ts) t.join();
            }
}

static const unsigned MODULI[16] = {256, 255, 253, 251, 247, 241, 239, 233,
                                    229, 227, 223, 217, 211, 199, 197, 193};

// c (row-major m×n, int32) = a8 (m×kp) · b8ᵀ (n×kp): what the int8 GEMM computes.
static void int_gemm(const signed char* a8, const signed char* b8, std::vector<int>& c, int m,
                     int n, int kp) {
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            long long s = 0;
            for (int p = 0; p < kp; p++) s += (long long)a8[(size_t)i * kp + p] * b8[(size_t)j * kp + p];
            c[(size_t)i * n + j] = (int)s;
        }
}

static unsigned __int128 modulus_product(int nm) {
    unsigned __int128 p = 1;
    for (int l = 0; l < nm; l++) p *= MODULI[l];
    return p;
}

struct Result { int moduli; bool fallback; };

// Launch the element-wise kernels with emulate.rs's own shapes (256-thread blocks, its grids)
// instead of the small ones that keep the other cases quick.
static bool g_gpu_shapes = false;

// The block as emulate.rs computes it: C = alpha·op(A)·op(B) + beta·C (auto moduli, or fixed).
static Result emulated(const std::vector<double>& A, bool at, const std::vector<double>& B, bool bt,
                       int m, int n, int k, double alpha, double beta, std::vector<double>& C,
                       int fixed) {
    int kp = (k + 15) / 16 * 16;
    long long ars = at ? 1 : k, aks = at ? m : 1, brs = bt ? k : 1, bks = bt ? 1 : n;
    std::vector<int> qa(m), xa(m), qb(n), xb(n);
    std::vector<double> sa(m), sb(n);
    std::vector<unsigned> flags(4, 0);
    int np = (n + 15) / 16 * 16;  // the int8 GEMM's n and ldc, padded as emulate.rs pads them
    launch({(unsigned)m, 1, 1}, {256, 1, 1}, [&] { oz_info(A.data(), m, k, ars, aks, qa.data(), sa.data(), xa.data(), flags.data(), 1u); });
    launch({(unsigned)n, 1, 1}, {256, 1, 1}, [&] { oz_info(B.data(), n, k, brs, bks, qb.data(), sb.data(), xb.data(), flags.data(), 2u); });
    // One plane per modulus (the coarse copies in plane 0); padding rows of b8: garbage.
    size_t ap = (size_t)m * kp + 48, bp = (size_t)np * kp + 16;  // planes apart, as the tile's
    std::vector<signed char> a8(16 * ap), b8(16 * bp, 0x55);
    auto tiles = [&](int count) { return dim3{(unsigned)((count + 31) / 32), (unsigned)((kp + 31) / 32), 1}; };
    launch(tiles(m), {32, 8, 1}, [&] { oz_coarse(A.data(), m, k, kp, ars, aks, qa.data(), xa.data(), a8.data()); });
    launch(tiles(n), {32, 8, 1}, [&] { oz_coarse(B.data(), n, k, kp, brs, bks, qb.data(), xb.data(), b8.data()); });
    std::vector<int> c32((size_t)m * np);
    int_gemm(a8.data(), b8.data(), c32, m, np, kp);
    // Columns on grid x, rows on grid y strided (3 row blocks: the stride is exercised); with
    // g_gpu_shapes as emulate.rs launches them: grid2(m, n, 256) for select, grid2(m, n, 65535)
    // for reduce and rebuild, 256 threads.
    unsigned bx = g_gpu_shapes ? 256 : 64;
    dim3 g2{(unsigned)((n + bx - 1) / bx), g_gpu_shapes ? (unsigned)std::clamp(m, 1, 256) : 3, 1};
    dim3 g2r = g_gpu_shapes ? dim3{g2.x, (unsigned)std::clamp(m, 1, 65535), 1} : g2;
    dim3 blk{bx, 1, 1};
    launch(g2, blk, [&] { oz_select(c32.data(), m, n, np, k, qa.data(), sa.data(), xa.data(), qb.data(), sb.data(), xb.data(), flags.data() + 1); });
    if (flags[0]) return {0, true};
    size_t mn = (size_t)m * n;
    std::vector<unsigned char> planes(16 * mn);
    if (flags[3] != 3) {  // a side all zero: C = beta·C, 0 moduli
        launch(g2r, blk, [&] {
            oz_rebuild(planes.data(), 0, m, n, qa.data(), qb.data(), 0, 256, 0, alpha, beta, C.data());
        });
        return {0, false};
    }
    int need = std::max(1u, flags[1]), least = std::max(1u, flags[2]);
    int nm = fixed ? fixed : need;
    if (!fixed && least > need) return {0, true};
    int t = OZ_T[nm];
    launch(tiles(m), {32, 8, 1}, [&] { oz_split(A.data(), m, k, kp, ars, aks, qa.data(), t, nm, (long long)ap, a8.data()); });
    launch(tiles(n), {32, 8, 1}, [&] { oz_split(B.data(), n, k, kp, brs, bks, qb.data(), t, nm, (long long)bp, b8.data()); });
    for (int l = 0; l < nm; l++) {
        int_gemm(a8.data() + l * ap, b8.data() + l * bp, c32, m, np, kp);
        launch(g2r, blk, [&] { oz_reduce(c32.data(), m, n, np, l, planes.data() + l * mn); });
    }
    unsigned __int128 M = modulus_product(nm);
    launch(g2r, blk, [&] {
        oz_rebuild(planes.data(), nm, m, n, qa.data(), qb.data(), t,
                   (unsigned long long)M, (unsigned long long)(M >> 64), alpha, beta, C.data());
    });
    return {nm, false};
}

// Double-double Σ a·b (TwoProd by fma, TwoSum).
static double dot2(const double* a, long long as, const double* b, long long bs, int k, double* absum) {
    double hi = 0, lo = 0, s = 0;
    for (int p = 0; p < k; p++) {
        double x = a[p * as], y = b[p * bs];
        double pr = x * y, e = std::fma(x, y, -pr);
        double sum = hi + pr, bb = sum - hi, err = (hi - (sum - bb)) + (pr - bb);
        hi = sum;
        lo += err + e;
        s += std::fabs(pr);
    }
    *absum = s;
    return hi + lo;
}

// oz_rebuild's reconstruction alone, for every count of moduli 1..16: integers X drawn over
// [−M/2, M/2) (the ends and 0 included), their residues as oz_reduce leaves them, rebuilt with
// scale 2^0 (q_a + q_b = 2t) and alpha = 1, beta = 0; each must come back as X rounded once.
static int rebuild_every_count(std::mt19937_64& g) {
    int fails = 0;
    for (int nm = 1; nm <= 16; nm++) {
        unsigned __int128 M = modulus_product(nm);
        int m = 7, n = 9, t = OZ_T[nm];
        size_t mn = (size_t)m * n;
        std::vector<unsigned __int128> ax(mn);
        std::vector<bool> neg(mn);
        std::vector<unsigned char> planes(16 * mn);
        for (size_t e = 0; e < mn; e++) {
            unsigned __int128 r = ((unsigned __int128)g() << 64 | g()) % M;  // in [0, M)
            if (e == 0) r = 0;
            if (e == 1) r = M / 2 - 1;  // the largest positive
            if (e == 2) r = (M + 1) / 2;  // the most negative: M − r = M/2 rounded down
            if (e == 3) r = M - 1;        // −1
            for (int l = 0; l < nm; l++) planes[l * mn + e] = (unsigned char)(r % MODULI[l]);
            neg[e] = 2 * r >= M;
            ax[e] = neg[e] ? M - r : r;
        }
        std::vector<int> qa(m, t), qb(n, t);
        std::vector<double> C(mn, 0.0);
        launch({1, 2, 1}, {16, 1, 1}, [&] {
            oz_rebuild(planes.data(), nm, m, n, qa.data(), qb.data(), t, (unsigned long long)M,
                       (unsigned long long)(M >> 64), 1.0, 0.0, C.data());
        });
        int bad = 0;
        for (size_t e = 0; e < mn; e++)
            if (C[e] != oz_i128_ldexp(ax[e], neg[e], 0)) bad++;
        if (bad) { printf("FAIL rebuild with %d moduli: %d of %zu integers wrong\n", nm, bad, mn); fails++; }
    }
    if (!fails) printf("ok   rebuild      every count 1..16: integers over [-M/2, M/2) come back exactly\n");
    return fails ? 1 : 0;  // one case
}

int main() {
    std::mt19937_64 g(7);
    std::normal_distribution<double> N(0, 1);
    int fails = rebuild_every_count(g), cases = 1;
    struct Case { int m, n, k; bool at, bt; double alpha, beta; const char* kind; int fixed; };
    std::vector<Case> cs = {
        {37, 29, 45, false, false, 1.0, 0.0, "normal", 0},
        {37, 29, 45, true, false, -0.75, 1.0, "normal", 0},
        {33, 40, 70, false, true, 2.0, -0.5, "scaled rows", 0},
        {20, 35, 33, true, true, 1.0, 0.0, "subnormals", 0},
        {16, 16, 16, false, false, 1.0, 0.0, "uniform", 0},
        {40, 9, 130, false, false, 1.0, 0.0, "zero column", 0},
        {21, 22, 23, false, false, 1.0, 0.0, "normal", 4},
        {10, 10, 10, false, false, 1.0, 0.0, "nonfinite", 0},
        {12, 7, 20, false, false, 2.0, 0.5, "zero A", 0},
        {40, 300, 50, true, false, 1.5, -1.0, "GPU shapes", 0},  // normal data, n > 256
    };
    for (auto c : cs) {
        int m = c.m, n = c.n, k = c.k;
        std::vector<double> A((size_t)m * k), B((size_t)k * n), C((size_t)m * n), C0;
        for (auto& x : A) x = N(g);
        for (auto& x : B) x = N(g);
        std::string kind = c.kind;
        if (kind == "uniform") { for (auto& x : A) x = std::fabs(x); for (auto& x : B) x = std::fabs(x); }
        // Stored shapes: A is m×k or, transposed, k×m; element (i, p) of op(A) at:
        auto ai = [&](int i, int p) -> double& { return c.at ? A[(size_t)p * m + i] : A[(size_t)i * k + p]; };
        auto bj = [&](int p, int j) -> double& { return c.bt ? B[(size_t)j * k + p] : B[(size_t)p * n + j]; };
        if (kind == "scaled rows") for (int i = 0; i < m; i++) for (int p = 0; p < k; p++) ai(i, p) *= std::pow(10.0, (i % 17) - 8);
        if (kind == "subnormals") for (int i = 0; i < m; i++) for (int p = 0; p < k; p++) ai(i, p) *= 1e-310;
        if (kind == "zero column") for (int p = 0; p < k; p++) bj(p, 3) = 0;
        if (kind == "nonfinite") ai(2, 3) = NAN;
        if (kind == "zero A") for (auto& x : A) x = 0.0;
        for (auto& x : C) x = N(g);
        C0 = C;
        g_gpu_shapes = kind == "GPU shapes";
        Result r = emulated(A, c.at, B, c.bt, m, n, k, c.alpha, c.beta, C, c.fixed);
        cases++;
        if (kind == "nonfinite") {
            if (!r.fallback) { printf("FAIL %s: NaN not sent to native\n", c.kind); fails++; }
            else printf("ok   %-12s falls back to native (NaN/Inf)\n", c.kind);
            continue;
        }
        if (r.fallback) { printf("note %-12s fell back to native (bound not met)\n", c.kind); continue; }
        if (kind == "zero A" && r.moduli != 0) { printf("FAIL zero A: %d moduli, not 0\n", r.moduli); fails++; }
        double u = std::ldexp(1.0, -53), worst = 0;
        int bad = 0;
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j++) {
                double abs;
                double p = dot2(&ai(i, 0), c.at ? m : 1, &bj(0, j), c.bt ? 1 : n, k, &abs);
                double want = c.alpha * p + c.beta * C0[(size_t)i * n + j];
                double bound = (k + 2) * u * (std::fabs(c.alpha) * abs + std::fabs(c.beta * C0[(size_t)i * n + j]))
                               + (k + 2) * std::ldexp(1.0, -1074);
                double err = std::fabs(C[(size_t)i * n + j] - want);
                double ratio = bound > 0 ? err / bound : (err > 0 ? INFINITY : 0);
                worst = std::max(worst, ratio);
                if (!(ratio <= 1.0)) bad++;
            }
        bool ok = c.fixed ? true : bad == 0;
        printf("%s %-12s %dx%dx%d at=%d bt=%d: %d moduli, worst error/bound %.3g, %d over%s\n",
               ok ? "ok  " : "FAIL", c.kind, m, n, k, c.at, c.bt, r.moduli, worst, bad,
               c.fixed ? " (forced count: reported, not judged)" : "");
        if (!ok) fails++;
    }
    printf("%d of %d cases failed\n", fails, cases);
    return fails ? 1 : 0;
}
