// Shared helpers for the fused-op kernels: dtype conversion and block-wide reductions.
//
// Every row kernel runs one block per row with a power-of-two block size between 32 and 1024
// threads, so the reductions below can assume whole warps. Reductions combine values in a fixed
// order (a fixed shuffle tree, then warp 0 over the per-warp results), which makes every kernel
// bitwise reproducible for a given shape and block size: there are no float atomics.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#define MAX_THREADS 1024

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
// Round to nearest even, as the host side's `half` crate does, so CPU and GPU outputs can
// agree bit for bit when their f32 values do.
template <> __device__ __forceinline__ __half from_f32<__half>(float x) {
    return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// Sum of `v` over the block, returned to every thread.
__device__ float block_sum(float v) {
    __shared__ float partial[33];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n_warps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < n_warps ? partial[lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) partial[32] = t;
    }
    __syncthreads();
    const float total = partial[32];
    // The next call reuses `partial`: nobody may write it before everyone has read the total.
    __syncthreads();
    return total;
}

// Two sums at once (one round of barriers instead of two).
__device__ void block_sum2(float &a, float &b) {
    __shared__ float pa[33];
    __shared__ float pb[33];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n_warps = blockDim.x >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    if (lane == 0) {
        pa[warp] = a;
        pb[warp] = b;
    }
    __syncthreads();
    if (warp == 0) {
        float ta = lane < n_warps ? pa[lane] : 0.f;
        float tb = lane < n_warps ? pb[lane] : 0.f;
        ta = warp_sum(ta);
        tb = warp_sum(tb);
        if (lane == 0) {
            pa[32] = ta;
            pb[32] = tb;
        }
    }
    __syncthreads();
    a = pa[32];
    b = pb[32];
    __syncthreads();
}

// Online log-sum-exp state: the running maximum `m` and the sum `s` of exp(x - m).
// Adding one value costs one exp, so a row is read once to get both max and normaliser.
__device__ __forceinline__ void lse_add(float &m, float &s, float x) {
    if (x > m) {
        s = s * expf(m - x) + 1.f;
        m = x;
    } else if (m != -INFINITY) {
        // m == -inf here means x == -inf too: exp(-inf - -inf) would be NaN, and adds nothing.
        s += expf(x - m);
    }
}

__device__ __forceinline__ void lse_merge(float &m, float &s, float m2, float s2) {
    const float hi = fmaxf(m, m2);
    if (hi == -INFINITY) return;  // both empty (all -inf so far)
    s = s * expf(m - hi) + s2 * expf(m2 - hi);
    m = hi;
}

__device__ __forceinline__ void warp_lse(float &m, float &s) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
        lse_merge(m, s, m2, s2);
    }
}

// Block-wide online log-sum-exp: every thread gets the row maximum `m` and sum of exp(x - m).
__device__ void block_lse(float &m, float &s) {
    __shared__ float pm[33];
    __shared__ float ps[33];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n_warps = blockDim.x >> 5;
    warp_lse(m, s);
    if (lane == 0) {
        pm[warp] = m;
        ps[warp] = s;
    }
    __syncthreads();
    if (warp == 0) {
        float tm = lane < n_warps ? pm[lane] : -INFINITY;
        float ts = lane < n_warps ? ps[lane] : 0.f;
        warp_lse(tm, ts);
        if (lane == 0) {
            pm[32] = tm;
            ps[32] = ts;
        }
    }
    __syncthreads();
    m = pm[32];
    s = ps[32];
    __syncthreads();
}

// Whether element `i` of a dropout site with mask key `key` survives: SplitMix64 of the key and
// the index, the function the CPU side uses (`crate::ops::DropoutMask::keeps`), so masks are
// regenerated rather than stored and CPU and GPU draw identical ones.
__device__ __forceinline__ bool dropout_keep(uint64_t key, uint64_t i, uint32_t threshold) {
    uint64_t z = key + (i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (uint32_t)(z >> 32) >= threshold;
}

// Eight elements moved as one 16-byte (bf16/f16) or two 16-byte (f32) accesses: the vectorised
// path of the elementwise kernels, taken when every pointer is 16-byte aligned and the element
// count (and a row width, where one matters) is a multiple of 8.
template <typename T> struct alignas(16) Pack8 {
    T v[8];
};

// Eight elements at `p` (16-byte aligned) as f32, and eight f32 stored there as `T`.
template <typename T> __device__ __forceinline__ void load8(const T *p, float (&f)[8]) {
    const Pack8<T> v = *reinterpret_cast<const Pack8<T> *>(p);
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = to_f32(v.v[e]);
}
template <typename T> __device__ __forceinline__ void store8(T *p, const float (&f)[8]) {
    Pack8<T> v;
#pragma unroll
    for (int e = 0; e < 8; ++e) v.v[e] = from_f32<T>(f[e]);
    *reinterpret_cast<Pack8<T> *>(p) = v;
}
