// The elementwise parts of Llama-style blocks: SwiGLU between the gate/up product and the down
// projection, and rotary position embedding applied in place of the q/k columns of the q/k/v
// product. Grid-stride launches of 256 threads (`cuda::elementwise_config`), f32 arithmetic.
//
//   swiglu:      out[r, j] = dropout(silu(g + bg) · (u + bu)),  [g | u] = h[r, 0..2f]
//   swiglu_bwd:  dh[r, j]     = dropout(dout) · (u + bu) · silu'(g + bg)
//                dh[r, f + j] = dropout(dout) · silu(g + bg)
//   rotary:      for each q and k head, pairs (i, i + hd/2) rotated by ±pos·inv_freq[i],
//                pos = r % seq, or the row's position id in its example for packed sequences
//                (the sign is −1 for the backward pass: the rotation's transpose)
//
// Dropout uses the element index of `out` and the SplitMix64 hash of every other site.
#include "common.cuh"

__device__ __forceinline__ float sigmoid(float z) { return 1.f / (1.f + expf(-z)); }

template <typename T>
__device__ __forceinline__ float swiglu_one(float g, float u, const float *bias, int j, int f,
                                           int has_bias) {
    if (has_bias) {
        g += bias[j];
        u += bias[f + j];
    }
    return g * sigmoid(g) * u;
}

// `vec`: eight outputs per step (f a multiple of 8, every pointer 16-byte aligned).
template <typename T>
__device__ void swiglu_fwd(const T *h, const float *bias, T *out, size_t n, int f, int has_bias,
                           uint32_t threshold, float scale, uint64_t key, int vec) {
    const size_t start = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    if (vec) {
        const int f8 = f / 8;
        const Pack8<T> *h8 = reinterpret_cast<const Pack8<T> *>(h);
        Pack8<T> *o8 = reinterpret_cast<Pack8<T> *>(out);
        for (size_t q = start; q < n / 8; q += step) {
            const size_t r = q / f8;
            const int j0 = (int)(q % f8) * 8;
            const Pack8<T> gv = h8[r * 2 * f8 + j0 / 8], uv = h8[r * 2 * f8 + f8 + j0 / 8];
            Pack8<T> ov;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                float v = swiglu_one<T>(to_f32(gv.v[k]), to_f32(uv.v[k]), bias, j0 + k, f,
                                        has_bias);
                if (threshold) v = dropout_keep(key, q * 8 + k, threshold) ? v * scale : 0.f;
                ov.v[k] = from_f32<T>(v);
            }
            o8[q] = ov;
        }
        return;
    }
    for (size_t i = start; i < n; i += step) {
        const size_t r = i / f;
        const int j = (int)(i % f);
        float v = swiglu_one<T>(to_f32(h[r * 2 * f + j]), to_f32(h[r * 2 * f + f + j]), bias, j,
                                f, has_bias);
        if (threshold) v = dropout_keep(key, i, threshold) ? v * scale : 0.f;
        out[i] = from_f32<T>(v);
    }
}

// The gate's and up's gradients of one output element with gradient d (after dropout).
__device__ __forceinline__ void swiglu_grad_one(float d, float g, float u, const float *bias,
                                                int j, int f, int has_bias, float &dg,
                                                float &du) {
    if (has_bias) {
        g += bias[j];
        u += bias[f + j];
    }
    const float s = sigmoid(g);
    dg = d * u * s * (1.f + g * (1.f - s));
    du = d * g * s;
}

template <typename T>
__device__ void swiglu_bwd(const T *dout, const T *h, const float *bias, T *dh, size_t n, int f,
                           int has_bias, uint32_t threshold, float scale, uint64_t key,
                           int vec) {
    const size_t start = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    if (vec) {
        const int f8 = f / 8;
        const Pack8<T> *d8 = reinterpret_cast<const Pack8<T> *>(dout);
        const Pack8<T> *h8 = reinterpret_cast<const Pack8<T> *>(h);
        Pack8<T> *o8 = reinterpret_cast<Pack8<T> *>(dh);
        for (size_t q = start; q < n / 8; q += step) {
            const size_t r = q / f8;
            const int j0 = (int)(q % f8) * 8;
            const size_t gi = r * 2 * f8 + j0 / 8, ui = gi + f8;
            const Pack8<T> dv = d8[q], gv = h8[gi], uv = h8[ui];
            Pack8<T> dg8, du8;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                float d = to_f32(dv.v[k]);
                if (threshold) d = dropout_keep(key, q * 8 + k, threshold) ? d * scale : 0.f;
                float dg, du;
                swiglu_grad_one(d, to_f32(gv.v[k]), to_f32(uv.v[k]), bias, j0 + k, f, has_bias,
                                dg, du);
                dg8.v[k] = from_f32<T>(dg);
                du8.v[k] = from_f32<T>(du);
            }
            o8[gi] = dg8;
            o8[ui] = du8;
        }
        return;
    }
    for (size_t i = start; i < n; i += step) {
        const size_t r = i / f;
        const int j = (int)(i % f);
        float d = to_f32(dout[i]);
        if (threshold) d = dropout_keep(key, i, threshold) ? d * scale : 0.f;
        float dg, du;
        swiglu_grad_one(d, to_f32(h[r * 2 * f + j]), to_f32(h[r * 2 * f + f + j]), bias, j, f,
                        has_bias, dg, du);
        dh[r * 2 * f + j] = from_f32<T>(dg);
        dh[r * 2 * f + f + j] = from_f32<T>(du);
    }
}

// One thread per (row, rotated head, pair): `heads` query and key heads from column 0 of each
// row of `width` columns (the values after them are not touched). In place.
template <typename T>
__device__ void rotary(T *x, const float *inv_freq, const uint32_t *pos, size_t rows, int width,
                       int heads, int hd, int seq, float sign) {
    const int half = hd / 2;
    const size_t n = rows * (size_t)heads * half;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += step) {
        const int p = (int)(i % half);
        const size_t rh = i / half;
        const int head = (int)(rh % heads);
        const size_t r = rh / heads;
        // A row's position: its index in its sequence, or its position id in its example.
        const float angle = (float)(pos ? pos[r] : r % seq) * inv_freq[p];
        float sn, cs;
        sincosf(angle, &sn, &cs);
        sn *= sign;
        T *row = x + r * width + head * hd;
        const float a = to_f32(row[p]), b = to_f32(row[p + half]);
        row[p] = from_f32<T>(a * cs - b * sn);
        row[p + half] = from_f32<T>(b * cs + a * sn);
    }
}

#define LLAMA_KERNELS(T, NAME)                                                                 \
    extern "C" __global__ void swiglu_fwd_##NAME(const T *h, const float *bias, T *out,        \
                                                 size_t n, int f, int has_bias,                \
                                                 uint32_t threshold, float scale,              \
                                                 uint64_t key, int vec) {                      \
        swiglu_fwd<T>(h, bias, out, n, f, has_bias, threshold, scale, key, vec);               \
    }                                                                                          \
    extern "C" __global__ void swiglu_bwd_##NAME(const T *dout, const T *h, const float *bias, \
                                                 T *dh, size_t n, int f, int has_bias,         \
                                                 uint32_t threshold, float scale,              \
                                                 uint64_t key, int vec) {                      \
        swiglu_bwd<T>(dout, h, bias, dh, n, f, has_bias, threshold, scale, key, vec);          \
    }                                                                                          \
    extern "C" __global__ void rotary_##NAME(T *x, const float *inv_freq, const uint32_t *pos, \
                                             size_t rows, int width, int heads, int hd,        \
                                             int seq, float sign) {                            \
        rotary<T>(x, inv_freq, pos, rows, width, heads, hd, seq, sign);                        \
    }

LLAMA_KERNELS(float, f32)
LLAMA_KERNELS(__nv_bfloat16, bf16)
LLAMA_KERNELS(__half, f16)
