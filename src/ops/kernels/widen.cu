// Gradients into f32: a half-precision gradient widened to f32 for its f32 master, and summed in
// place into an f32 accumulator (the vocabulary head's chunks, a tied table's two parts); and
// the other way, an f32 master narrowed to the half precision of its products. Eight
// elements per thread step with 16-byte loads and stores when `vec` (see Pack8); candle's own
// cast moves one element per thread and ran at a quarter of the memory bandwidth.
#include "common.cuh"

template <typename T>
__device__ void widen(const T *x, float *y, size_t n, int vec) {
    const size_t start = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    if (vec) {
        const Pack8<T> *x8 = reinterpret_cast<const Pack8<T> *>(x);
        Pack8<float> *y8 = reinterpret_cast<Pack8<float> *>(y);
        for (size_t q = start; q < n / 8; q += step) {
            const Pack8<T> xv = x8[q];
            Pack8<float> yv;
#pragma unroll
            for (int k = 0; k < 8; ++k) yv.v[k] = to_f32(xv.v[k]);
            y8[q] = yv;
        }
        return;
    }
    for (size_t i = start; i < n; i += step) y[i] = to_f32(x[i]);
}

template <typename T>
__device__ void accumulate(float *acc, const T *x, size_t n, int vec) {
    const size_t start = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    if (vec) {
        const Pack8<T> *x8 = reinterpret_cast<const Pack8<T> *>(x);
        Pack8<float> *a8 = reinterpret_cast<Pack8<float> *>(acc);
        for (size_t q = start; q < n / 8; q += step) {
            const Pack8<T> xv = x8[q];
            Pack8<float> av = a8[q];
#pragma unroll
            for (int k = 0; k < 8; ++k) av.v[k] += to_f32(xv.v[k]);
            a8[q] = av;
        }
        return;
    }
    for (size_t i = start; i < n; i += step) acc[i] += to_f32(x[i]);
}

// An f32 master cast to the half precision its products run in, rounded to nearest even as
// candle's cast and the host's `half` crate round.
template <typename T>
__device__ void narrow(const float *x, T *y, size_t n, int vec) {
    const size_t start = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    if (vec) {
        const Pack8<float> *x8 = reinterpret_cast<const Pack8<float> *>(x);
        Pack8<T> *y8 = reinterpret_cast<Pack8<T> *>(y);
        for (size_t q = start; q < n / 8; q += step) {
            const Pack8<float> xv = x8[q];
            Pack8<T> yv;
#pragma unroll
            for (int k = 0; k < 8; ++k) yv.v[k] = from_f32<T>(xv.v[k]);
            y8[q] = yv;
        }
        return;
    }
    for (size_t i = start; i < n; i += step) y[i] = from_f32<T>(x[i]);
}

#define WIDEN_KERNELS(T, NAME)                                                                 \
    extern "C" __global__ void widen_##NAME(const T *x, float *y, size_t n, int vec) {         \
        widen<T>(x, y, n, vec);                                                                \
    }                                                                                          \
    extern "C" __global__ void accumulate_##NAME(float *acc, const T *x, size_t n, int vec) {  \
        accumulate<T>(acc, x, n, vec);                                                         \
    }

#define NARROW_KERNEL(T, NAME)                                                                 \
    extern "C" __global__ void narrow_##NAME(const float *x, T *y, size_t n, int vec) {        \
        narrow<T>(x, y, n, vec);                                                               \
    }

WIDEN_KERNELS(float, f32)
WIDEN_KERNELS(__nv_bfloat16, bf16)
WIDEN_KERNELS(__half, f16)
NARROW_KERNEL(__nv_bfloat16, bf16)
NARROW_KERNEL(__half, f16)
