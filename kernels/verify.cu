// `verify`'s dense pass on the GPU (src/backend/cuda/fold.rs): a band of stored rows of A,
// uploaded as f32, widened to f64 for DGEMMs against the scatter pass's sums, then made |a|
// and a·a in place for the tolerance DGEMMs. Compiled at run time by NVRTC (no headers: bit
// tests instead of isfinite/fabs). One thread per element in a grid-stride loop; memory-bound.

// dst = src widened, NaN/Inf as 0 (never multiplied, as on the CPU); the op row of each
// non-finite element is marked in `bad`: the stored row (row0 + i / cols) when op(A) = A, the
// stored column (i % cols) when op(A) = Aᵀ.
extern "C" __global__ void vf_widen(const float* __restrict__ src,
                                    double* __restrict__ dst,
                                    unsigned long long n,
                                    unsigned long long cols,
                                    unsigned char* __restrict__ bad,
                                    unsigned int trans,
                                    unsigned long long row0) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v = src[i];
        if ((__float_as_uint(v) & 0x7f800000u) == 0x7f800000u) {
            dst[i] = 0.0;
            bad[trans ? (i % cols) : (row0 + i / cols)] = 1;
        } else {
            dst[i] = (double)v;
        }
    }
}

// v = |v|
extern "C" __global__ void vf_abs(double* __restrict__ v, unsigned long long n) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        v[i] = __longlong_as_double(__double_as_longlong(v[i]) & 0x7fffffffffffffffLL);
    }
}

// v = v·v
extern "C" __global__ void vf_square(double* __restrict__ v, unsigned long long n) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        double x = v[i];
        v[i] = x * x;
    }
}
