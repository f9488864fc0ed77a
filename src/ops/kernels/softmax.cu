// Softmax over the last dimension and its backward. One block per row; f32 arithmetic.
//
// Both take the attention variants' extras: the input is multiplied by `scale` first, and with
// `causal_seq > 0` row r sees only columns 0..=(r % causal_seq) (a causal mask without a mask
// tensor); masked columns get probability 0.
#include "common.cuh"

// y = exp(x - max) / sum(exp(x - max)); the row is read twice (online max/sum, then write).
template <typename T>
__device__ void softmax_fwd(const T *xs, T *ys, int cols, float scale, int causal_seq) {
    const size_t row = blockIdx.x;
    const T *x = xs + row * cols;
    T *y = ys + row * cols;
    const int seen = causal_seq > 0 ? (int)(row % causal_seq) + 1 : cols;
    float m = -INFINITY, s = 0.f;
    for (int j = threadIdx.x; j < seen; j += blockDim.x) lse_add(m, s, scale * to_f32(x[j]));
    block_lse(m, s);
    const float inv = 1.f / s;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        y[j] = from_f32<T>(j < seen ? expf(scale * to_f32(x[j]) - m) * inv : 0.f);
    }
}

// dx = y * (dy - sum(dy * y)): needs only the output y, not the input.
template <typename T>
__device__ void softmax_bwd(const T *ys, const T *dys, T *dxs, int cols, float scale) {
    const size_t row = blockIdx.x;
    const T *y = ys + row * cols;
    const T *dy = dys + row * cols;
    T *dx = dxs + row * cols;
    float dot = 0.f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) dot += to_f32(dy[j]) * to_f32(y[j]);
    dot = block_sum(dot);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        dx[j] = from_f32<T>(scale * to_f32(y[j]) * (to_f32(dy[j]) - dot));
    }
}

// Short rows (attention scores): one warp per row, eight rows per block, shuffles only.
template <typename T>
__device__ void softmax_fwd_warp(const T *xs, T *ys, int rows, int cols, float scale,
                                 int causal_seq) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const T *x = xs + (size_t)row * cols;
    T *y = ys + (size_t)row * cols;
    const int seen = causal_seq > 0 ? row % causal_seq + 1 : cols;
    float m = -INFINITY, s = 0.f;
    for (int j = lane; j < seen; j += 32) lse_add(m, s, scale * to_f32(x[j]));
    warp_lse(m, s);
    const float inv = 1.f / s;
    for (int j = lane; j < cols; j += 32) {
        y[j] = from_f32<T>(j < seen ? expf(scale * to_f32(x[j]) - m) * inv : 0.f);
    }
}

template <typename T>
__device__ void softmax_bwd_warp(const T *ys, const T *dys, T *dxs, int rows, int cols,
                                 float scale) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const T *y = ys + (size_t)row * cols;
    const T *dy = dys + (size_t)row * cols;
    T *dx = dxs + (size_t)row * cols;
    float dot = 0.f;
    for (int j = lane; j < cols; j += 32) dot += to_f32(dy[j]) * to_f32(y[j]);
    dot = warp_sum(dot);
    for (int j = lane; j < cols; j += 32) {
        dx[j] = from_f32<T>(scale * to_f32(y[j]) * (to_f32(dy[j]) - dot));
    }
}

#define SOFTMAX_KERNELS(T, NAME)                                                               \
    extern "C" __global__ void __launch_bounds__(MAX_THREADS)                                  \
        softmax_fwd_##NAME(const T *x, T *y, int cols, float scale, int causal_seq) {          \
        softmax_fwd<T>(x, y, cols, scale, causal_seq);                                         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(MAX_THREADS)                                  \
        softmax_bwd_##NAME(const T *y, const T *dy, T *dx, int cols, float scale) {            \
        softmax_bwd<T>(y, dy, dx, cols, scale);                                                \
    }                                                                                          \
    extern "C" __global__ void softmax_fwd_warp_##NAME(const T *x, T *y, int rows, int cols,   \
                                                       float scale, int causal_seq) {          \
        softmax_fwd_warp<T>(x, y, rows, cols, scale, causal_seq);                              \
    }                                                                                          \
    extern "C" __global__ void softmax_bwd_warp_##NAME(const T *y, const T *dy, T *dx,         \
                                                       int rows, int cols, float scale) {      \
        softmax_bwd_warp<T>(y, dy, dx, rows, cols, scale);                                     \
    }

SOFTMAX_KERNELS(float, f32)
SOFTMAX_KERNELS(__nv_bfloat16, bf16)
SOFTMAX_KERNELS(__half, f16)
