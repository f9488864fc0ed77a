// Adam / AdamW in place over f32 tensors, in three passes (first moment, second moment,
// weight), each one kernel per parameter tensor instead of a dozen tensor ops.
//
// k = [b1, c1, b2, c2, inv_sqrt_bias2, eps, step_size, decay, l2]; decay is 1 and l2 is 0 when
// unused. The arithmetic mirrors the host optimizer's (`AdamConsts` in src/ops/host_optim.rs).
#include <stddef.h>

#include "common.cuh"

// Twin of `AdamArgs` in src/ops/adam/gpu.rs (a `[f32; 9]` filled by `AdamConsts::packed`): the
// static_asserts below and the Rust const asserts there check the same layout; change both
// together.
struct AdamK {
    float b1, c1, b2, c2, inv_sqrt_bias2, eps, step_size, decay, l2;
};

static_assert(sizeof(AdamK) == 36, "AdamK must match AdamArgs in src/ops/adam/gpu.rs");
static_assert(offsetof(AdamK, b1) == 0, "AdamK::b1 must be AdamArgs.0[0]");
static_assert(offsetof(AdamK, c1) == 4, "AdamK::c1 must be AdamArgs.0[1]");
static_assert(offsetof(AdamK, b2) == 8, "AdamK::b2 must be AdamArgs.0[2]");
static_assert(offsetof(AdamK, c2) == 12, "AdamK::c2 must be AdamArgs.0[3]");
static_assert(offsetof(AdamK, inv_sqrt_bias2) == 16, "AdamK::inv_sqrt_bias2 must be AdamArgs.0[4]");
static_assert(offsetof(AdamK, eps) == 20, "AdamK::eps must be AdamArgs.0[5]");
static_assert(offsetof(AdamK, step_size) == 24, "AdamK::step_size must be AdamArgs.0[6]");
static_assert(offsetof(AdamK, decay) == 28, "AdamK::decay must be AdamArgs.0[7]");
static_assert(offsetof(AdamK, l2) == 32, "AdamK::l2 must be AdamArgs.0[8]");

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

// All parameter tensors of a model in one launch, each element's three updates in one pass
// (the arithmetic of the three kernels above, in their order). Blocks cover `per_block`
// consecutive elements of one tensor; `first_block` numbers each tensor's first block, so a
// block finds its tensor by binary search over the (few hundred) segments.
//
// Twin of `Segment` in src/ops/adam/gpu.rs: the static_asserts below and the Rust const asserts
// there check the same layout; change both together.
struct AdamSegment {
    float *theta;
    float *m;
    float *v;
    const float *g;
    long long n;
    long long first_block;
};

static_assert(sizeof(AdamSegment) == 48, "AdamSegment must match Segment in src/ops/adam/gpu.rs");
static_assert(offsetof(AdamSegment, theta) == 0, "AdamSegment::theta must match Segment::theta");
static_assert(offsetof(AdamSegment, m) == 8, "AdamSegment::m must match Segment::m");
static_assert(offsetof(AdamSegment, v) == 16, "AdamSegment::v must match Segment::v");
static_assert(offsetof(AdamSegment, g) == 24, "AdamSegment::g must match Segment::g");
static_assert(offsetof(AdamSegment, n) == 32, "AdamSegment::n must match Segment::n");
static_assert(offsetof(AdamSegment, first_block) == 40,
              "AdamSegment::first_block must match Segment::first_block");

extern "C" __global__ void adam_multi(const AdamSegment *segs, int n_segs, AdamK k,
                                      long long per_block) {
    int lo = 0, hi = n_segs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (segs[mid].first_block <= (long long)blockIdx.x) lo = mid; else hi = mid - 1;
    }
    const AdamSegment s = segs[lo];
    const long long start = ((long long)blockIdx.x - s.first_block) * per_block;
    const long long end = min(start + per_block, s.n);
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        const float theta = s.theta[i];
        const float gi = decayed_grad(k, theta, s.g[i]);
        const float m = __fadd_rn(__fmul_rn(s.m[i], k.b1), __fmul_rn(gi, k.c1));
        const float v = __fadd_rn(__fmul_rn(s.v[i], k.b2), __fmul_rn(__fmul_rn(gi, gi), k.c2));
        const float denom = __fadd_rn(__fmul_rn(sqrtf(v), k.inv_sqrt_bias2), k.eps);
        const float update = __fmul_rn(__fdiv_rn(m, denom), k.step_size);
        s.m[i] = m;
        s.v[i] = v;
        s.theta[i] = __fsub_rn(__fmul_rn(theta, k.decay), update);
    }
}
