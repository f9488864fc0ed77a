// Softmax cross-entropy from logits. One block per row; T is the logits dtype, all arithmetic
// in f32. A row holds `cols` values of which the first `classes` are classes; the rest are
// padding (a vocabulary head padded to a multiple of 64 runs cuBLAS's aligned kernels) that
// takes no part in the loss and gets a zero gradient.
#include "common.cuh"

// loss[row] = logsumexp(logits[row]) - logits[row][target], computed as
// log(sum) - (logit[target] - max) so large logits do not cancel; NaN for an out-of-range
// target (a kernel cannot return an error, and NaN makes the bad batch visible in the loss).
template <typename T>
__device__ void ce_fwd(const T *logits, const uint32_t *targets, float *loss, int classes,
                       int cols, int vec) {
    const size_t row = blockIdx.x;
    const T *x = logits + row * cols;
    float m = -INFINITY, s = 0.f;
    int scalar_from = 0;
    if (vec) {
        // Eight classes a load (`vec`: rows of a multiple of 8 values on 16-byte boundaries):
        // one log-sum-exp per pack, merged into the thread's. The classes past the last whole
        // pack go one at a time below.
        const int packs = classes / 8;
        for (int p = threadIdx.x; p < packs; p += blockDim.x) {
            float f[8];
            load8(x + 8 * p, f);
            float hi = -INFINITY;
#pragma unroll
            for (int e = 0; e < 8; ++e) hi = fmaxf(hi, f[e]);
            float sum = 0.f;
            if (hi != -INFINITY) {
#pragma unroll
                for (int e = 0; e < 8; ++e) sum += expf(f[e] - hi);
            }
            lse_merge(m, s, hi, sum);
        }
        scalar_from = packs * 8;
    }
    for (int j = scalar_from + threadIdx.x; j < classes; j += blockDim.x)
        lse_add(m, s, to_f32(x[j]));
    block_lse(m, s);
    if (threadIdx.x == 0) {
        const uint32_t t = targets[row];
        loss[row] = t < (uint32_t)classes ? logf(s) - (to_f32(x[t]) - m) : NAN;
    }
}

// dlogits[row][j] = (softmax(logits[row])[first + j] - [first + j == target]) * grad[row] for
// the columns first..first + cols of each row (`logits` holds only those; first is 0 for whole
// rows), zero at or past `classes`. `loss_grad` holds a per-row value followed by the per-row
// upstream gradients (2 * rows floats): the row's log-sum-exp itself when `given_lse`, else its
// loss, from which whole rows rebuild it as lse = loss + logits[target].
template <typename T>
__device__ void ce_bwd(const T *logits, const uint32_t *targets, const float *loss_grad,
                       T *dlogits, int rows, int first, int classes, int cols, int given_lse,
                       int vec) {
    const size_t row = blockIdx.x;
    const T *x = logits + row * cols;
    T *dx = dlogits + row * cols;
    const uint32_t t = targets[row];
    const float g = loss_grad[rows + row];
    const float lse = given_lse ? loss_grad[row]
                      : t < (uint32_t)classes ? loss_grad[row] + to_f32(x[t])
                                              : NAN;
    if (vec) {
        // Eight columns a load and a store (`vec`: `cols` a multiple of 8, both buffers on
        // 16-byte boundaries).
        for (int p = threadIdx.x; p < cols / 8; p += blockDim.x) {
            float f[8];
            load8(x + 8 * p, f);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int col = first + p * 8 + e;
                const float prob = col < classes ? expf(f[e] - lse) : 0.f;
                f[e] = (prob - (col == (int)t ? 1.f : 0.f)) * g;
            }
            store8(dx + 8 * p, f);
        }
        return;
    }
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        const int col = first + j;
        const float p = col < classes ? expf(to_f32(x[j]) - lse) : 0.f;
        dx[j] = from_f32<T>((p - (col == (int)t ? 1.f : 0.f)) * g);
    }
}

#define CE_KERNELS(T, NAME)                                                                    \
    extern "C" __global__ void __launch_bounds__(MAX_THREADS)                                  \
        ce_fwd_##NAME(const T *logits, const uint32_t *targets, float *loss, int classes,      \
                      int cols, int vec) {                                                     \
        ce_fwd<T>(logits, targets, loss, classes, cols, vec);                                  \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(MAX_THREADS)                                  \
        ce_bwd_##NAME(const T *logits, const uint32_t *targets, const float *loss_grad,        \
                      T *dlogits, int rows, int first, int classes, int cols, int given_lse,   \
                      int vec) {                                                               \
        ce_bwd<T>(logits, targets, loss_grad, dlogits, rows, first, classes, cols, given_lse,  \
                  vec);                                                                        \
    }

CE_KERNELS(float, f32)
CE_KERNELS(__nv_bfloat16, bf16)
CE_KERNELS(__half, f16)
