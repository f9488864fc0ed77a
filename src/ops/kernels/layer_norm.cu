// Layer norm over the last dimension with f32 gamma/beta; T is the activation dtype, statistics
// and arithmetic in f32. Row kernels run one block per row; the parameter-gradient reduction
// runs over column tiles (see ln_params_partial).
//
// `rms` (the same for every thread of a launch) turns each kernel into RMS norm's: the mean is
// taken as 0, beta is not read, and its gradient (still written by the reduction) is unused.
#include "common.cuh"

// Mean and 1/sqrt(var + eps) of one row, two-pass (mean first, then squared deviations) so a
// large mean does not cancel the variance.
template <typename T>
__device__ void row_stats(const T *x, int cols, float eps, int rms, float &mean, float &rstd) {
    mean = 0.f;
    if (!rms) {
        float s = 0.f;
        for (int j = threadIdx.x; j < cols; j += blockDim.x) s += to_f32(x[j]);
        mean = block_sum(s) / (float)cols;
    }
    float v = 0.f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        const float d = to_f32(x[j]) - mean;
        v += d * d;
    }
    const float var = block_sum(v) / (float)cols;
    rstd = 1.f / sqrtf(var + eps);
}

template <typename T>
__device__ void ln_fwd(const T *xs, const float *gamma, const float *beta, T *ys, int cols,
                       float eps, int rms) {
    const size_t row = blockIdx.x;
    const T *x = xs + row * cols;
    T *y = ys + row * cols;
    float mean, rstd;
    row_stats(x, cols, eps, rms, mean, rstd);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        const float shift = rms ? 0.f : beta[j];
        y[j] = from_f32<T>((to_f32(x[j]) - mean) * rstd * gamma[j] + shift);
    }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma (RMS norm: without the
// mean(g) term, as its output does not subtract the mean), plus the matching row of `pluses`
// where it is not null (a residual stream's gradient, added before the one rounding).
// Statistics are recomputed from x (the row is read from L1/L2 again) instead of being saved
// by the forward pass.
template <typename T>
__device__ void ln_bwd_input(const T *xs, const T *dys, const float *gamma, const T *pluses,
                             T *dxs, int cols, float eps, int rms) {
    const size_t row = blockIdx.x;
    const T *x = xs + row * cols;
    const T *dy = dys + row * cols;
    const T *plus = pluses ? pluses + row * cols : nullptr;
    T *dx = dxs + row * cols;
    float mean, rstd;
    row_stats(x, cols, eps, rms, mean, rstd);
    float sum_g = 0.f, sum_gx = 0.f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        const float g = to_f32(dy[j]) * gamma[j];
        sum_g += g;
        sum_gx += g * (to_f32(x[j]) - mean) * rstd;
    }
    block_sum2(sum_g, sum_gx);
    const float mean_g = rms ? 0.f : sum_g / (float)cols;
    const float mean_gx = sum_gx / (float)cols;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        const float g = to_f32(dy[j]) * gamma[j];
        const float xhat = (to_f32(x[j]) - mean) * rstd;
        const float added = plus ? to_f32(plus[j]) : 0.f;
        dx[j] = from_f32<T>(rstd * (g - mean_g - xhat * mean_gx) + added);
    }
}

// stats[2 * row] = mean, stats[2 * row + 1] = rstd.
template <typename T>
__device__ void ln_stats(const T *xs, float *stats, int cols, float eps, int rms) {
    const size_t row = blockIdx.x;
    float mean, rstd;
    row_stats(xs + row * cols, cols, eps, rms, mean, rstd);
    if (threadIdx.x == 0) {
        stats[2 * row] = mean;
        stats[2 * row + 1] = rstd;
    }
}

// The same three kernels with one warp per row (`warp`): eight rows a block of 256 threads,
// each lane moving eight values a step, and the sums over the row by shuffles within the warp,
// without the block's barriers. Taken where every row has a multiple of 8 values and every
// buffer starts on a 16-byte boundary; faster for the rows of up to a few thousand values that
// transformers have, where the block version spends its time at barriers. Loads and stores
// go through `load8` and `store8` (common.cuh).
// This warp's row, or -1 past the last.
__device__ __forceinline__ long long warp_row(int rows) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    return row < rows ? row : -1;
}

template <typename T>
__device__ void warp_row_stats(const T *x, int cols, float eps, int rms, float &mean,
                               float &rstd) {
    const int first = (threadIdx.x & 31) * 8;
    mean = 0.f;
    if (!rms) {
        float s = 0.f;
        for (int j = first; j < cols; j += 256) {
            float f[8];
            load8(x + j, f);
#pragma unroll
            for (int e = 0; e < 8; ++e) s += f[e];
        }
        mean = warp_sum(s) / (float)cols;
    }
    float v = 0.f;
    for (int j = first; j < cols; j += 256) {
        float f[8];
        load8(x + j, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float d = f[e] - mean;
            v += d * d;
        }
    }
    rstd = 1.f / sqrtf(warp_sum(v) / (float)cols + eps);
}

template <typename T>
__device__ void ln_fwd_warp(const T *xs, const float *gamma, const float *beta, T *ys, int rows,
                            int cols, float eps, int rms) {
    const long long row = warp_row(rows);
    if (row < 0) return;
    const T *x = xs + row * cols;
    T *y = ys + row * cols;
    float mean, rstd;
    warp_row_stats(x, cols, eps, rms, mean, rstd);
    for (int j = (threadIdx.x & 31) * 8; j < cols; j += 256) {
        float f[8], g[8], b[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        load8(x + j, f);
        load8(gamma + j, g);
        if (!rms) load8(beta + j, b);
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = (f[e] - mean) * rstd * g[e] + b[e];
        store8(y + j, f);
    }
}

template <typename T>
__device__ void ln_bwd_input_warp(const T *xs, const T *dys, const float *gamma,
                                  const T *pluses, T *dxs, int rows, int cols, float eps,
                                  int rms) {
    const long long row = warp_row(rows);
    if (row < 0) return;
    const T *x = xs + row * cols;
    const T *dy = dys + row * cols;
    const T *plus = pluses ? pluses + row * cols : nullptr;
    T *dx = dxs + row * cols;
    const int first = (threadIdx.x & 31) * 8;
    float mean, rstd;
    warp_row_stats(x, cols, eps, rms, mean, rstd);
    float sum_g = 0.f, sum_gx = 0.f;
    for (int j = first; j < cols; j += 256) {
        float f[8], d[8], g[8];
        load8(x + j, f);
        load8(dy + j, d);
        load8(gamma + j, g);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float gg = d[e] * g[e];
            sum_g += gg;
            sum_gx += gg * (f[e] - mean) * rstd;
        }
    }
    sum_g = warp_sum(sum_g);
    sum_gx = warp_sum(sum_gx);
    const float mean_g = rms ? 0.f : sum_g / (float)cols;
    const float mean_gx = sum_gx / (float)cols;
    for (int j = first; j < cols; j += 256) {
        float f[8], d[8], g[8], p[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        load8(x + j, f);
        load8(dy + j, d);
        load8(gamma + j, g);
        if (plus) load8(plus + j, p);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float xhat = (f[e] - mean) * rstd;
            f[e] = rstd * (d[e] * g[e] - mean_g - xhat * mean_gx) + p[e];
        }
        store8(dx + j, f);
    }
}

template <typename T>
__device__ void ln_stats_warp(const T *xs, float *stats, int rows, int cols, float eps, int rms) {
    const long long row = warp_row(rows);
    if (row < 0) return;
    float mean, rstd;
    warp_row_stats(xs + row * cols, cols, eps, rms, mean, rstd);
    if ((threadIdx.x & 31) == 0) {
        stats[2 * row] = mean;
        stats[2 * row + 1] = rstd;
    }
}

// First pass of dgamma = sum_rows dy * xhat and dbeta = sum_rows dy. Block (32, 8): threadIdx.x
// picks a column (coalesced loads), threadIdx.y strides over the block's chunk of rows; the 8
// partial sums are added in a fixed order and written to partial[0|1][chunk][col]. The chunking
// depends only on the shape, so the result is reproducible run to run.
#define TILE_COLS 32
#define TILE_ROWS 8
template <typename T>
__device__ void ln_params_partial(const T *xs, const T *dys, const float *stats, float *partial,
                                  int rows, int cols, int rows_per_chunk) {
    __shared__ float sg[TILE_ROWS][TILE_COLS + 1];
    __shared__ float sb[TILE_ROWS][TILE_COLS + 1];
    const int col = blockIdx.x * TILE_COLS + threadIdx.x;
    const int chunk = blockIdx.y;
    const int chunks = gridDim.y;
    const int r0 = chunk * rows_per_chunk;
    const int r1 = min(rows, r0 + rows_per_chunk);
    float dg = 0.f, db = 0.f;
    if (col < cols) {
        for (int r = r0 + threadIdx.y; r < r1; r += TILE_ROWS) {
            const size_t i = (size_t)r * cols + col;
            const float d = to_f32(dys[i]);
            dg += d * (to_f32(xs[i]) - stats[2 * r]) * stats[2 * r + 1];
            db += d;
        }
    }
    sg[threadIdx.y][threadIdx.x] = dg;
    sb[threadIdx.y][threadIdx.x] = db;
    __syncthreads();
    if (threadIdx.y == 0 && col < cols) {
        float g = 0.f, b = 0.f;
#pragma unroll
        for (int k = 0; k < TILE_ROWS; ++k) {
            g += sg[k][threadIdx.x];
            b += sb[k][threadIdx.x];
        }
        partial[(size_t)chunk * cols + col] = g;
        partial[((size_t)chunks + chunk) * cols + col] = b;
    }
}

// Second pass: out[col] = dgamma, out[cols + col] = dbeta, summing the chunks in order.
extern "C" __global__ void ln_params_final(const float *partial, float *out, int chunks,
                                           int cols) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= cols) return;
    float g = 0.f, b = 0.f;
    for (int c = 0; c < chunks; ++c) {
        g += partial[(size_t)c * cols + col];
        b += partial[((size_t)chunks + c) * cols + col];
    }
    out[col] = g;
    out[cols + col] = b;
}

#define LN_KERNELS(T, NAME)                                                                    \
    extern "C" __global__ void __launch_bounds__(MAX_THREADS)                                  \
        ln_fwd_##NAME(const T *x, const float *gamma, const float *beta, T *y, int rows,       \
                      int cols, float eps, int rms, int warp) {                                \
        if (warp)                                                                              \
            ln_fwd_warp<T>(x, gamma, beta, y, rows, cols, eps, rms);                           \
        else                                                                                   \
            ln_fwd<T>(x, gamma, beta, y, cols, eps, rms);                                      \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(MAX_THREADS)                                  \
        ln_bwd_input_##NAME(const T *x, const T *dy, const float *gamma, const T *plus, T *dx, \
                            int rows, int cols, float eps, int rms, int warp) {                \
        if (warp)                                                                              \
            ln_bwd_input_warp<T>(x, dy, gamma, plus, dx, rows, cols, eps, rms);                \
        else                                                                                   \
            ln_bwd_input<T>(x, dy, gamma, plus, dx, cols, eps, rms);                           \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(MAX_THREADS)                                  \
        ln_stats_##NAME(const T *x, float *stats, int rows, int cols, float eps, int rms,      \
                        int warp) {                                                            \
        if (warp)                                                                              \
            ln_stats_warp<T>(x, stats, rows, cols, eps, rms);                                  \
        else                                                                                   \
            ln_stats<T>(x, stats, cols, eps, rms);                                             \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(TILE_COLS * TILE_ROWS)                        \
        ln_params_partial_##NAME(const T *x, const T *dy, const float *stats, float *partial,  \
                                 int rows, int cols, int rows_per_chunk) {                     \
        ln_params_partial<T>(x, dy, stats, partial, rows, cols, rows_per_chunk);               \
    }

LN_KERNELS(float, f32)
LN_KERNELS(__nv_bfloat16, bf16)
LN_KERNELS(__half, f16)
