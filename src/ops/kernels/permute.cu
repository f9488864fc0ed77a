// Contiguous copy of a permuted view whose innermost dimension stays innermost (attention's
// head split and merge). The output is walked in order; each element's source offset is
// Σ index_k · stride_k over up to four outer dimensions. Copies move whole 16-byte units when
// the innermost run, the strides and the pointers allow it, else single elements.
#include <stddef.h>
#include <stdint.h>

// Twin of `Dims4` in src/ops/permute/gpu.rs: the static_asserts below and the Rust const asserts
// there check the same layout; change both together.
struct Dims4 {
    long long n[4];       // output outer dims
    long long stride[4];  // source stride (in units) of each output outer dim
};

static_assert(sizeof(Dims4) == 64, "Dims4 must match Dims4 in src/ops/permute/gpu.rs");
static_assert(offsetof(Dims4, n) == 0, "Dims4::n must match the Rust Dims4::n");
static_assert(offsetof(Dims4, stride) == 32, "Dims4::stride must match the Rust Dims4::stride");

template <typename U>
__device__ void permute_copy(const U *src, U *dst, Dims4 d, long long inner, long long total) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long rest = i / inner;
        const long long e = i - rest * inner;
        long long offset = e;
#pragma unroll
        for (int k = 3; k >= 0; --k) {
            const long long idx = rest % d.n[k];
            rest /= d.n[k];
            offset += idx * d.stride[k];
        }
        dst[i] = src[offset];
    }
}

extern "C" __global__ void permute_b16(const uint4 *src, uint4 *dst, Dims4 d, long long inner,
                                       long long total) {
    permute_copy<uint4>(src, dst, d, inner, total);
}
extern "C" __global__ void permute_b4(const uint32_t *src, uint32_t *dst, Dims4 d,
                                      long long inner, long long total) {
    permute_copy<uint32_t>(src, dst, d, inner, total);
}
extern "C" __global__ void permute_b2(const uint16_t *src, uint16_t *dst, Dims4 d,
                                      long long inner, long long total) {
    permute_copy<uint16_t>(src, dst, d, inner, total);
}
