// Elementwise epilogues of a matrix product, forward and backward, and the embedding lookup.
//
//   forward:  out = residual + dropout(act(y + bias))      (each part optional)
//   backward: dy  = dropout(dout) * act'(y + bias)
//   embed:    out = dropout(table[ids[r]] + positions[r % seq])
//   embed_grad: dtable[ids[r] - first] += d[r]  (float atomics: summation order is not fixed;
//               ids outside the table's rows from `first` on are skipped)
//
// An id at or past the table's `vocab` rows is never read or written through: the lookup
// gives NaN (a kernel cannot return an error, and NaN makes the bad batch visible in the
// loss, as the cross-entropy kernel does for an out-of-range target) and its gradient is
// dropped, where an unchecked index would read or atomically add out of bounds.
//
// Dropout masks are a pure function of (key, element index): a SplitMix64 hash, the same one
// the CPU implementation uses, so the backward pass (and a recomputed forward) regenerate the
// forward's mask instead of storing it, and CPU and GPU draw identical masks.
#include "common.cuh"

#define ACT_NONE 0
#define ACT_RELU 1
#define ACT_GELU 2

// GELU, tanh approximation (GPT-2's), and its derivative.
__device__ __forceinline__ float gelu(float z) {
    const float u = 0.7978845608028654f * (z + 0.044715f * z * z * z);
    return 0.5f * z * (1.f + tanhf(u));
}
__device__ __forceinline__ float gelu_grad(float z) {
    const float u = 0.7978845608028654f * (z + 0.044715f * z * z * z);
    const float t = tanhf(u);
    return 0.5f * (1.f + t) +
           0.5f * z * (1.f - t * t) * 0.7978845608028654f * (1.f + 3.f * 0.044715f * z * z);
}

__device__ __forceinline__ float activate(float z, int act) {
    if (act == ACT_RELU) return z > 0.f ? z : 0.f;
    if (act == ACT_GELU) return gelu(z);
    return z;
}
__device__ __forceinline__ float activate_grad(float z, int act) {
    if (act == ACT_RELU) return z > 0.f ? 1.f : 0.f;
    if (act == ACT_GELU) return gelu_grad(z);
    return 1.f;
}

// Eight elements per step (`Pack8`, common.cuh) when `vec` is set (n and cols multiples of 8,
// every pointer 16-byte aligned), else one element at a time.

template <typename T>
__device__ __forceinline__ float epilogue_one(float v, const float *bias, size_t i, int c,
                                              int has_bias, int act, uint32_t threshold,
                                              float scale, uint64_t key) {
    if (has_bias) v += bias[c];
    v = activate(v, act);
    if (threshold) v = dropout_keep(key, i, threshold) ? v * scale : 0.f;
    return v;
}

template <typename T>
__device__ void epilogue_fwd(const T *y, const float *bias, const T *residual, T *out, size_t n,
                             int cols, int has_bias, int has_residual, int act,
                             uint32_t threshold, float scale, uint64_t key, int vec) {
    const size_t start = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    if (vec) {
        const Pack8<T> *y8 = reinterpret_cast<const Pack8<T> *>(y);
        const Pack8<T> *r8 = reinterpret_cast<const Pack8<T> *>(residual);
        Pack8<T> *o8 = reinterpret_cast<Pack8<T> *>(out);
        for (size_t q = start; q < n / 8; q += step) {
            const Pack8<T> yv = y8[q];
            Pack8<T> rv;
            if (has_residual) rv = r8[q];
            const int c0 = (int)((q * 8) % (size_t)cols);
            Pack8<T> ov;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                float v = epilogue_one<T>(to_f32(yv.v[k]), bias, q * 8 + k, c0 + k, has_bias,
                                          act, threshold, scale, key);
                if (has_residual) v += to_f32(rv.v[k]);
                ov.v[k] = from_f32<T>(v);
            }
            o8[q] = ov;
        }
        return;
    }
    for (size_t i = start; i < n; i += step) {
        float v = epilogue_one<T>(to_f32(y[i]), bias, i, (int)(i % cols), has_bias, act,
                                  threshold, scale, key);
        if (has_residual) v += to_f32(residual[i]);
        out[i] = from_f32<T>(v);
    }
}

template <typename T>
__device__ __forceinline__ float epilogue_grad_one(float g, float z, const float *bias,
                                                   size_t i, int c, int has_bias, int act,
                                                   uint32_t threshold, float scale,
                                                   uint64_t key) {
    if (threshold) g = dropout_keep(key, i, threshold) ? g * scale : 0.f;
    if (act != ACT_NONE) {
        if (has_bias) z += bias[c];
        g *= activate_grad(z, act);
    }
    return g;
}

template <typename T>
__device__ void epilogue_bwd(const T *dout, const T *y, const float *bias, T *dy, size_t n,
                             int cols, int has_bias, int act, uint32_t threshold, float scale,
                             uint64_t key, int vec) {
    const size_t start = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    if (vec) {
        const Pack8<T> *d8 = reinterpret_cast<const Pack8<T> *>(dout);
        const Pack8<T> *y8 = reinterpret_cast<const Pack8<T> *>(y);
        Pack8<T> *o8 = reinterpret_cast<Pack8<T> *>(dy);
        for (size_t q = start; q < n / 8; q += step) {
            const Pack8<T> dv = d8[q];
            Pack8<T> yv;
            if (act != ACT_NONE) yv = y8[q];
            const int c0 = (int)((q * 8) % (size_t)cols);
            Pack8<T> ov;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const float z = act != ACT_NONE ? to_f32(yv.v[k]) : 0.f;
                ov.v[k] = from_f32<T>(epilogue_grad_one<T>(to_f32(dv.v[k]), z, bias, q * 8 + k,
                                                           c0 + k, has_bias, act, threshold,
                                                           scale, key));
            }
            o8[q] = ov;
        }
        return;
    }
    for (size_t i = start; i < n; i += step) {
        const float z = act != ACT_NONE ? to_f32(y[i]) : 0.f;
        dy[i] = from_f32<T>(epilogue_grad_one<T>(to_f32(dout[i]), z, bias, i, (int)(i % cols),
                                                 has_bias, act, threshold, scale, key));
    }
}

template <typename T>
__device__ void embed_fwd(const uint32_t *ids, const T *table, const T *positions, T *out,
                          size_t n, int d, uint32_t vocab, int seq, int has_positions,
                          uint32_t threshold, float scale, uint64_t key) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / d, c = i % d;
        const uint32_t id = ids[r];
        float v = id < vocab ? to_f32(table[(size_t)id * d + c]) : NAN;
        if (has_positions) v += to_f32(positions[(r % seq) * d + c]);
        if (threshold) v = dropout_keep(key, i, threshold) ? v * scale : 0.f;
        out[i] = from_f32<T>(v);
    }
}

template <typename T>
__device__ void embed_grad(const uint32_t *ids, const T *d_out, float *d_table, size_t n, int d,
                           uint32_t vocab, uint32_t first) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / d, c = i % d;
        // Below `first` the difference wraps past `vocab`: skipped like an id past the rows.
        const uint32_t id = ids[r] - first;
        if (id < vocab) atomicAdd(d_table + (size_t)id * d + c, to_f32(d_out[i]));
    }
}

#define EPILOGUE_KERNELS(T, NAME)                                                              \
    extern "C" __global__ void epilogue_fwd_##NAME(                                            \
        const T *y, const float *bias, const T *residual, T *out, size_t n, int cols,          \
        int has_bias, int has_residual, int act, uint32_t threshold, float scale,              \
        uint64_t key, int vec) {                                                               \
        epilogue_fwd<T>(y, bias, residual, out, n, cols, has_bias, has_residual, act,          \
                        threshold, scale, key, vec);                                           \
    }                                                                                          \
    extern "C" __global__ void epilogue_bwd_##NAME(                                            \
        const T *dout, const T *y, const float *bias, T *dy, size_t n, int cols, int has_bias, \
        int act, uint32_t threshold, float scale, uint64_t key, int vec) {                     \
        epilogue_bwd<T>(dout, y, bias, dy, n, cols, has_bias, act, threshold, scale, key,      \
                        vec);                                                                  \
    }                                                                                          \
    extern "C" __global__ void embed_fwd_##NAME(                                               \
        const uint32_t *ids, const T *table, const T *positions, T *out, size_t n, int d,      \
        uint32_t vocab, int seq, int has_positions, uint32_t threshold, float scale,           \
        uint64_t key) {                                                                        \
        embed_fwd<T>(ids, table, positions, out, n, d, vocab, seq, has_positions, threshold,   \
                     scale, key);                                                              \
    }                                                                                          \
    extern "C" __global__ void embed_grad_##NAME(const uint32_t *ids, const T *d_out,          \
                                                 float *d_table, size_t n, int d,              \
                                                 uint32_t vocab, uint32_t first) {             \
        embed_grad<T>(ids, d_out, d_table, n, d, vocab, first);                                \
    }

EPILOGUE_KERNELS(float, f32)
EPILOGUE_KERNELS(__nv_bfloat16, bf16)
EPILOGUE_KERNELS(__half, f16)
