// fp8 conversion on the GPU: the largest magnitude of a tensor, the scale that fits it into an
// fp8 format, and the conversion itself (optionally transposed, for the operand layout an fp8
// matrix product takes). The encoding mirrors `Fp8Format::encode` in src/ops/fp8.rs bit for
// bit: round to nearest even, saturate to the largest finite value, NaN stays NaN. It is written
// out in integer and power-of-two arithmetic rather than with `cvt.rn.satfinite.e4m3x2.f32`,
// which needs sm_89 PTX, where these kernels are compute_80 PTX that loads on every GPU.
#include "common.cuh"

// format: 0 = E4M3 (3 mantissa bits, bias 7, largest code 0x7e), 1 = E5M2 (2, 15, 0x7b).
__device__ __forceinline__ unsigned char fp8_encode(float x, int format) {
    const int mantissa = format == 0 ? 3 : 2;
    const int bias = format == 0 ? 7 : 15;
    const float max_code = format == 0 ? 126.f : 123.f;
    const unsigned int bits = __float_as_uint(x);
    const unsigned char sign = (bits >> 31) ? 0x80 : 0;
    if (isnan(x)) return sign | 0x7f;
    const float magnitude = fabsf(x);
    if (magnitude == 0.f) return sign;
    // The f32's binade, no lower than the format's smallest normal one (whose spacing the
    // subnormals share); an infinity's is 128, which saturates below.
    const int binade = max((int)((bits >> 23) & 0xff) - 127, 1 - bias);
    // Exact: a scaling by a power of two into [0, 2^(mantissa+1)). The power, 2^-125 to 2^16,
    // is a normal f32 built from its exponent bits: ldexpf's range checks cost more than the
    // rest of the conversion, and without fast math the product is as exact as ldexpf.
    const float power = __uint_as_float((unsigned int)(mantissa - binade + 127) << 23);
    const float steps = rintf(magnitude * power);
    const float field = (float)((binade + bias - 1) << mantissa) + steps;
    return sign | (unsigned char)fminf(field, max_code);
}

// Four codes packed into a word, the first at the lowest address.
__device__ __forceinline__ unsigned int fp8_encode4(float a, float b, float c, float d,
                                                    int format) {
    return (unsigned int)fp8_encode(a, format) | ((unsigned int)fp8_encode(b, format) << 8) |
           ((unsigned int)fp8_encode(c, format) << 16) |
           ((unsigned int)fp8_encode(d, format) << 24);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    return v;
}

// The largest of the block's threads' `m` (NaNs ignored, as fmaxf does), valid in its first
// thread; blocks of whole warps, in one or two dimensions. Every thread of the block must call it.
__device__ float block_max(float m) {
    __shared__ float partial[32];
    m = warp_max(m);
    const int thread = threadIdx.y * blockDim.x + threadIdx.x;
    const int lane = thread & 31;
    const int warp = thread >> 5;
    if (lane == 0) partial[warp] = m;
    __syncthreads();
    float t = 0.f;
    if (warp == 0) {
        t = lane < (int)((blockDim.x * blockDim.y) >> 5) ? partial[lane] : 0.f;
        t = warp_max(t);
    }
    return t;  // valid in thread 0
}

// Folds the block's largest magnitude `m` into `*amax` (nothing where `amax` is null): a
// conversion records the largest magnitude it read, which delayed scaling turns into the next
// conversion's scale, without a pass of its own. Magnitudes are not negative, so their bits
// order as the floats do and an integer maximum is the float one; it does not depend on the
// blocks' order. `*amax` starts at zero.
__device__ void record_amax(float m, float *amax) {
    if (amax == nullptr) return;
    m = block_max(m);
    if (threadIdx.x == 0 && threadIdx.y == 0) {
        atomicMax(reinterpret_cast<unsigned int *>(amax), __float_as_uint(m));
    }
}

// The largest magnitude of each block's share of x (NaNs ignored, as fmaxf does) into
// partials[blockIdx.x]; fp8_scale reduces the partials. Two launches and no atomics: nothing
// needs zeroing first, and the result does not depend on the blocks' order.
template <typename T>
__device__ void amax(const T *x, size_t n, int vec, float *partials) {
    const size_t start = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    float m = 0.f;
    if (vec) {
        const Pack8<T> *x8 = reinterpret_cast<const Pack8<T> *>(x);
        for (size_t q = start; q < n / 8; q += step) {
            const Pack8<T> v = x8[q];
#pragma unroll
            for (int k = 0; k < 8; ++k) m = fmaxf(m, fabsf(to_f32(v.v[k])));
        }
    } else {
        for (size_t i = start; i < n; i += step) m = fmaxf(m, fabsf(to_f32(x[i])));
    }
    m = block_max(m);
    if (threadIdx.x == 0) partials[blockIdx.x] = m;
}

// One block: the largest magnitude of `count` values (partial maxima, or a few f32 given
// directly), then the scale that puts it at the format's largest finite value less `margin`
// binades, in the same f32 operations as `TensorScaler::scale_for`; 1 where there is no finite,
// nonzero magnitude. Writes `out` = [1/scale (what the product multiplies by), scale, 0]: the
// last is where a recording conversion at this scale folds its input's largest magnitude.
extern "C" __global__ void fp8_scale(const float *partials, int count, int format, int margin,
                                     float *out) {
    if (blockIdx.x != 0) return;
    float m = 0.f;
    for (int i = threadIdx.x; i < count; i += blockDim.x) m = fmaxf(m, fabsf(partials[i]));
    const float reference = block_max(m);
    if (threadIdx.x != 0) return;
    const float max_finite = format == 0 ? 448.f : 57344.f;
    float s = 1.f;
    if (isfinite(reference) && reference > 0.f) {
        s = max_finite / reference / ldexpf(1.f, margin);
        if (!isfinite(s)) s = 3.402823466e38f;
    }
    out[0] = 1.f / s;
    out[1] = s;
    out[2] = 0.f;
}

// Eight values' codes at scale `s`, as two words (the first value in the lowest byte), folding
// their largest magnitude into `m`: the eight-wide step both the rows and the wide transposed
// conversion take.
template <typename T>
__device__ __forceinline__ uint2 encode8(const Pack8<T> &v, float s, int format, float &m) {
    float f[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float value = to_f32(v.v[k]);
        m = fmaxf(m, fabsf(value));
        f[k] = value * s;
    }
    return make_uint2(fp8_encode4(f[0], f[1], f[2], f[3], format),
                      fp8_encode4(f[4], f[5], f[6], f[7], format));
}

template <typename T>
__device__ void quantize(const T *x, size_t n, const float *scale, int format, int vec,
                         unsigned char *codes, float *amax) {
    const float s = *scale;
    const size_t start = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    float m = 0.f;
    if (vec) {
        // Eight values in one 16-byte (bf16/f16) or two (f32) loads, their codes in one
        // 8-byte store.
        const Pack8<T> *x8 = reinterpret_cast<const Pack8<T> *>(x);
        uint2 *codes8 = reinterpret_cast<uint2 *>(codes);
        for (size_t q = start; q < n / 8; q += step) codes8[q] = encode8(x8[q], s, format, m);
    } else {
        for (size_t i = start; i < n; i += step) {
            const float value = to_f32(x[i]);
            m = fmaxf(m, fabsf(value));
            codes[i] = fp8_encode(value * s, format);
        }
    }
    record_amax(m, amax);
}

// x (rows × cols, row-major) converted and written transposed (cols × rows), through a 32 × 32
// tile in shared memory so that reads and writes are both along rows; with `codes` not null,
// also as it is (rows × cols), from the same read. Blocks of 32 × 8 threads: each reads four
// rows of the tile, then writes one 4-byte word of a transposed row (bytes where `rows` is not
// a multiple of 4 or the tile ends inside the word). With `amax` not null, records the largest
// magnitude it read there (record_amax).
template <typename T>
__device__ void quantize_transposed(const T *x, int rows, int cols, const float *scale,
                                    int format, unsigned char *codes,
                                    unsigned char *codes_t, float *amax) {
    __shared__ unsigned char tile[32][33];
    const float s = *scale;
    const int col0 = blockIdx.x * 32, row0 = blockIdx.y * 32;
    float m = 0.f;
    for (int k = threadIdx.y; k < 32; k += 8) {
        const int r = row0 + k, c = col0 + threadIdx.x;
        if (r < rows && c < cols) {
            const size_t at = (size_t)r * cols + c;
            const float value = to_f32(x[at]);
            m = fmaxf(m, fabsf(value));
            const unsigned char code = fp8_encode(value * s, format);
            tile[k][threadIdx.x] = code;
            if (codes != nullptr) codes[at] = code;
        }
    }
    // Its barrier also orders the tile's writes before the reads below.
    __syncthreads();
    record_amax(m, amax);
    const int t = threadIdx.y * 32 + threadIdx.x;
    const int c = col0 + t / 8, r = row0 + 4 * (t % 8);
    if (c >= cols || r >= rows) return;
    const unsigned char *column = &tile[0][0] + (t / 8);
    unsigned char *out = codes_t + (size_t)c * rows + r;
    const int lt = r - row0;
    if ((rows & 3) == 0 && r + 4 <= rows) {
        *reinterpret_cast<unsigned int *>(out) =
            (unsigned int)column[lt * 33] | ((unsigned int)column[(lt + 1) * 33] << 8) |
            ((unsigned int)column[(lt + 2) * 33] << 16) |
            ((unsigned int)column[(lt + 3) * 33] << 24);
        return;
    }
    for (int j = 0; j < 4 && r + j < rows; ++j) out[j] = column[(lt + j) * 33];
}

// quantize_transposed for a matrix whose rows are a multiple of 16 and columns a multiple of 8,
// x on a 16-byte boundary: 64 × 64 tiles, blocks of 256 threads. Each thread reads eight values
// at once (two 16-byte loads of a row's run) and writes sixteen transposed codes as one 16-byte
// word, where the general kernel moves a value and four codes at a time. The tile's rows are 68
// bytes, so that its 4-byte stores and the column reads land on few shared banks each.
template <typename T>
__device__ void quantize_transposed_wide(const T *x, int rows, int cols, const float *scale,
                                         int format, unsigned char *codes,
                                         unsigned char *codes_t, float *amax) {
    __shared__ unsigned int tile_words[64 * 17];
    unsigned char *tile = reinterpret_cast<unsigned char *>(tile_words);
    const float s = *scale;
    const int col0 = blockIdx.x * 64, row0 = blockIdx.y * 64;
    const int t = threadIdx.x;
    float m = 0.f;
    for (int p = t; p < 512; p += 256) {
        const int k = p >> 3, c8 = (p & 7) * 8;
        const int r = row0 + k, c = col0 + c8;
        // cols is a multiple of 8: a run of eight is wholly inside or wholly past the end.
        if (r < rows && c < cols) {
            const size_t at = (size_t)r * cols + c;
            const uint2 words =
                encode8(*reinterpret_cast<const Pack8<T> *>(x + at), s, format, m);
            tile_words[k * 17 + c8 / 4] = words.x;
            tile_words[k * 17 + c8 / 4 + 1] = words.y;
            if (codes != nullptr) *reinterpret_cast<uint2 *>(codes + at) = words;
        }
    }
    // Its barrier also orders the tile's writes before the reads below.
    __syncthreads();
    record_amax(m, amax);
    // Output row c (column c of x), the sixteen rows of x from r on.
    const int oc = t >> 2, r0 = 16 * (t & 3);
    const int c = col0 + oc, r = row0 + r0;
    // rows is a multiple of 16: a run of sixteen is wholly inside or wholly past the end.
    if (c >= cols || r >= rows) return;
    unsigned int w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const unsigned char *column = tile + (r0 + 4 * j) * 68 + oc;
        w[j] = (unsigned int)column[0] | ((unsigned int)column[68] << 8) |
               ((unsigned int)column[2 * 68] << 16) | ((unsigned int)column[3 * 68] << 24);
    }
    *reinterpret_cast<uint4 *>(codes_t + (size_t)c * rows + r) = make_uint4(w[0], w[1], w[2], w[3]);
}

#define FP8_KERNELS(T, NAME)                                                                   \
    extern "C" __global__ void fp8_amax_##NAME(const T *x, size_t n, int vec,                 \
                                               float *partials) {                             \
        amax<T>(x, n, vec, partials);                                                          \
    }                                                                                          \
    extern "C" __global__ void fp8_quantize_##NAME(const T *x, size_t n, const float *scale,   \
                                                   int format, int vec, unsigned char *codes,  \
                                                   float *amax) {                              \
        quantize<T>(x, n, scale, format, vec, codes, amax);                                    \
    }                                                                                          \
    extern "C" __global__ void fp8_quantize_transposed_##NAME(                                 \
        const T *x, int rows, int cols, const float *scale, int format, unsigned char *codes,  \
        unsigned char *codes_t, float *amax) {                                                 \
        quantize_transposed<T>(x, rows, cols, scale, format, codes, codes_t, amax);            \
    }                                                                                          \
    extern "C" __global__ void fp8_quantize_transposed_wide_##NAME(                            \
        const T *x, int rows, int cols, const float *scale, int format, unsigned char *codes,  \
        unsigned char *codes_t, float *amax) {                                                 \
        quantize_transposed_wide<T>(x, rows, cols, scale, format, codes, codes_t, amax);       \
    }

FP8_KERNELS(float, f32)
FP8_KERNELS(__nv_bfloat16, bf16)
FP8_KERNELS(__half, f16)

// history[slot] = the f32 at `from` (a conversion's recorded largest magnitude): one thread.
extern "C" __global__ void fp8_record_amax(const float *from, float *history, int slot) {
    if (blockIdx.x == 0 && threadIdx.x == 0) history[slot] = *from;
}
