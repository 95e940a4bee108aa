// Rounding of fp32 input tiles to 16-bit GEMM inputs, on the device.
// Compiled at run time by NVRTC (no headers needed: bit manipulation and a PTX cvt).
// One thread per element in a grid-stride loop; memory-bound.

extern "C" __global__ void f32_to_bf16(const float* __restrict__ src,
                                       unsigned short* __restrict__ dst,
                                       unsigned long long n) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        unsigned int b = __float_as_uint(src[i]);
        if ((b & 0x7fffffffu) > 0x7f800000u) {
            dst[i] = (unsigned short)((b >> 16) | 0x40u);  // NaN stays a (quiet) NaN
        } else {
            dst[i] = (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);  // round to nearest even
        }
    }
}

extern "C" __global__ void f32_to_f16(const float* __restrict__ src,
                                      unsigned short* __restrict__ dst,
                                      unsigned long long n) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(src[i]));
        dst[i] = h;
    }
}
