// Adam / AdamW in place over f32 tensors, in three passes (first moment, second moment,
// weight), each one kernel per parameter tensor instead of a dozen tensor ops.
//
// k = [b1, c1, b2, c2, inv_sqrt_bias2, eps, step_size, decay, l2]; decay is 1 and l2 is 0 when
// unused. The arithmetic mirrors the host optimizer's (`AdamConsts` in host_math.rs).
#include "common.cuh"

struct AdamK {
    float b1, c1, b2, c2, inv_sqrt_bias2, eps, step_size, decay, l2;
};

__device__ __forceinline__ float decayed_grad(const AdamK &k, float theta, float g) {
    return k.l2 != 0.f ? g + __fmul_rn(theta, k.l2) : g;
}

extern "C" __global__ void adam_first(float *m, const float *g, const float *theta, AdamK k,
                                      size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float gi = decayed_grad(k, theta[i], g[i]);
        m[i] = __fadd_rn(__fmul_rn(m[i], k.b1), __fmul_rn(gi, k.c1));
    }
}

extern "C" __global__ void adam_second(float *v, const float *g, const float *theta, AdamK k,
                                       size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float gi = decayed_grad(k, theta[i], g[i]);
        v[i] = __fadd_rn(__fmul_rn(v[i], k.b2), __fmul_rn(__fmul_rn(gi, gi), k.c2));
    }
}

extern "C" __global__ void adam_apply(float *theta, const float *m, const float *v, AdamK k,
                                      size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float denom = __fadd_rn(__fmul_rn(sqrtf(v[i]), k.inv_sqrt_bias2), k.eps);
        const float update = __fmul_rn(__fdiv_rn(m[i], denom), k.step_size);
        theta[i] = __fsub_rn(__fmul_rn(theta[i], k.decay), update);
    }
}
