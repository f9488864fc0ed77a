// Adam / AdamW over compact optimizer state (see src/ops/compact_adam.rs): f32, bf16 or 8-bit
// block-wise moments; f32 masters, or bf16 masters with Kahan compensation or stochastic
// rounding. One block of 256 threads per 2048 elements, eight per thread, strided so that a
// warp's loads are contiguous. The arithmetic is src/ops/compact_adam/cpu.rs's, element by
// element, in the same order and rounding, so CPU and GPU agree bit for bit.
#include "common.cuh"

struct AdamK {
    float b1, c1, b2, c2, inv_sqrt_bias2, eps, step_size, decay, l2;
};
static_assert(sizeof(AdamK) == 36, "AdamK must match AdamArgs in src/ops/adam/gpu.rs");

#define CA_BLOCK 2048
#define CA_THREADS 256
#define CA_PER_THREAD (CA_BLOCK / CA_THREADS)

enum { MOM_F32 = 0, MOM_BF16 = 1, MOM_INT8 = 2 };
enum { MASTER_F32 = 0, MASTER_KAHAN = 1, MASTER_SR = 2 };

// SplitMix64's finaliser: the random bits of element `i` under `seed` (twin of random_bits in
// src/ops/compact_adam.rs).
__device__ __forceinline__ uint32_t ca_random_bits(unsigned long long seed, unsigned long long i) {
    unsigned long long z = seed + (i + 1ull) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (uint32_t)z;
}

// Rounds x to bf16 up or down with probability proportional to the distance (twin of
// round_stochastic in src/ops/compact_adam.rs).
__device__ __forceinline__ float ca_round_stochastic(float x, uint32_t r) {
    uint32_t bits = __float_as_uint(x);
    if ((bits & 0x7f800000u) == 0x7f800000u) return __bfloat162float(__float2bfloat16_rn(x));
    bits += r & 0xffffu;
    bits &= 0xffff0000u;
    return __uint_as_float(bits);
}

__device__ __forceinline__ unsigned char ca_quantize(const float *map, float x) {
    int lo = 0, hi = 255;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (map[mid] <= x) lo = mid; else hi = mid - 1;
    }
    if (lo < 255 && fabsf(__fsub_rn(map[lo + 1], x)) < fabsf(__fsub_rn(x, map[lo]))) lo += 1;
    return (unsigned char)lo;
}

__device__ __forceinline__ float ca_block_max(float v, float *scratch) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = scratch[0];
    for (int i = 1; i < CA_THREADS / 32; ++i) r = fmaxf(r, scratch[i]);
    return r;
}

template <typename W, typename G, int MOM, int MASTER>
__device__ void compact_adam(W *w, const G *g, void *m_, void *v_, float *m_scale, float *v_scale,
                             __nv_bfloat16 *comp, const float *map1, const float *map2, AdamK k,
                             long long n, unsigned long long seed) {
    __shared__ float q1[256], q2[256], scratch[CA_THREADS / 32];
    if (MOM == MOM_INT8) {
        q1[threadIdx.x] = map1[threadIdx.x];
        q2[threadIdx.x] = map2[threadIdx.x];
        __syncthreads();
    }
    const long long b = blockIdx.x;
    const long long start = b * CA_BLOCK;
    float mn[CA_PER_THREAD], vn[CA_PER_THREAD];
    float am = 0.f, av = 0.f;
#pragma unroll
    for (int j = 0; j < CA_PER_THREAD; ++j) {
        const long long i = start + threadIdx.x + j * CA_THREADS;
        mn[j] = 0.f;
        vn[j] = 0.f;
        if (i >= n) continue;
        float m0, v0;
        if (MOM == MOM_F32) {
            m0 = ((float *)m_)[i];
            v0 = ((float *)v_)[i];
        } else if (MOM == MOM_BF16) {
            m0 = __bfloat162float(((__nv_bfloat16 *)m_)[i]);
            v0 = __bfloat162float(((__nv_bfloat16 *)v_)[i]);
        } else {
            m0 = __fmul_rn(q1[((unsigned char *)m_)[i]], m_scale[b]);
            v0 = __fmul_rn(q2[((unsigned char *)v_)[i]], v_scale[b]);
        }
        const float theta = to_f32(w[i]);
        float gi = to_f32(g[i]);
        if (k.l2 != 0.f) gi = __fadd_rn(gi, __fmul_rn(theta, k.l2));
        const float m1 = __fadd_rn(__fmul_rn(m0, k.b1), __fmul_rn(gi, k.c1));
        const float v1 = __fadd_rn(__fmul_rn(v0, k.b2), __fmul_rn(__fmul_rn(gi, gi), k.c2));
        const float denom = __fadd_rn(__fmul_rn(sqrtf(v1), k.inv_sqrt_bias2), k.eps);
        const float update = __fmul_rn(__fdiv_rn(m1, denom), k.step_size);
        const float next = __fsub_rn(__fmul_rn(theta, k.decay), update);
        if (MASTER == MASTER_F32) {
            w[i] = from_f32<W>(next);
        } else if (MASTER == MASTER_SR) {
            w[i] = from_f32<W>(ca_round_stochastic(next, ca_random_bits(seed, (unsigned long long)i)));
        } else {
            const float step = __fadd_rn(__fsub_rn(next, theta), __bfloat162float(comp[i]));
            const float stored = __bfloat162float(__float2bfloat16_rn(__fadd_rn(theta, step)));
            comp[i] = __float2bfloat16_rn(__fsub_rn(step, __fsub_rn(stored, theta)));
            w[i] = from_f32<W>(stored);
        }
        mn[j] = m1;
        vn[j] = v1;
        am = fmaxf(am, fabsf(m1));
        av = fmaxf(av, fabsf(v1));
    }
    if (MOM == MOM_INT8) {
        const float sm = ca_block_max(am, scratch);
        const float sv = ca_block_max(av, scratch);
        if (threadIdx.x == 0) {
            m_scale[b] = sm;
            v_scale[b] = sv;
        }
#pragma unroll
        for (int j = 0; j < CA_PER_THREAD; ++j) {
            const long long i = start + threadIdx.x + j * CA_THREADS;
            if (i >= n) continue;
            ((unsigned char *)m_)[i] = ca_quantize(q1, sm > 0.f ? __fdiv_rn(mn[j], sm) : 0.f);
            ((unsigned char *)v_)[i] = ca_quantize(q2, sv > 0.f ? __fdiv_rn(vn[j], sv) : 0.f);
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < CA_PER_THREAD; ++j) {
        const long long i = start + threadIdx.x + j * CA_THREADS;
        if (i >= n) continue;
        if (MOM == MOM_F32) {
            ((float *)m_)[i] = mn[j];
            ((float *)v_)[i] = vn[j];
        } else {
            ((__nv_bfloat16 *)m_)[i] = __float2bfloat16_rn(mn[j]);
            ((__nv_bfloat16 *)v_)[i] = __float2bfloat16_rn(vn[j]);
        }
    }
}

#define COMPACT_ADAM(W, G, WN, MOM, MN, MASTER, SN)                                              \
    extern "C" __global__ void compact_adam_##WN##_##MN##_##SN(                                 \
        W *w, const G *g, void *m, void *v, float *m_scale, float *v_scale,                     \
        __nv_bfloat16 *comp, const float *map1, const float *map2, AdamK k, long long n,        \
        unsigned long long seed) {                                                              \
        compact_adam<W, G, MOM, MASTER>(w, g, m, v, m_scale, v_scale, comp, map1, map2, k, n,   \
                                        seed);                                                  \
    }

// f32 masters take f32 gradients; bf16 masters take bf16 gradients, or f32 ones (a sum kept
// in f32, such as the vocabulary head's over its chunks) without a rounded copy.
COMPACT_ADAM(float, float, f32, MOM_F32, mf32, MASTER_F32, f32)
COMPACT_ADAM(float, float, f32, MOM_BF16, mbf16, MASTER_F32, f32)
COMPACT_ADAM(float, float, f32, MOM_INT8, mi8, MASTER_F32, f32)
#define COMPACT_ADAM_BF16(G, GN)                                                                \
    COMPACT_ADAM(__nv_bfloat16, G, bf16##GN, MOM_F32, mf32, MASTER_KAHAN, kahan)               \
    COMPACT_ADAM(__nv_bfloat16, G, bf16##GN, MOM_BF16, mbf16, MASTER_KAHAN, kahan)             \
    COMPACT_ADAM(__nv_bfloat16, G, bf16##GN, MOM_INT8, mi8, MASTER_KAHAN, kahan)               \
    COMPACT_ADAM(__nv_bfloat16, G, bf16##GN, MOM_F32, mf32, MASTER_SR, sr)                     \
    COMPACT_ADAM(__nv_bfloat16, G, bf16##GN, MOM_BF16, mbf16, MASTER_SR, sr)                   \
    COMPACT_ADAM(__nv_bfloat16, G, bf16##GN, MOM_INT8, mi8, MASTER_SR, sr)
COMPACT_ADAM_BF16(__nv_bfloat16, )
COMPACT_ADAM_BF16(float, _g32)
