// Flash attention: softmax(scale · q kᵀ) v per head, forward and backward, without ever
// writing the (seq × seq) score or probability matrices to memory.
//
// Layout: q, k and v are read straight from the q/k/v product, rows of `d + 2·kvd` values per
// token (`[q | k | v]`, d = heads·hd, kvd = kv_heads·hd; query head h in columns h·hd ..
// (h+1)·hd of q, key/value head g likewise in k and v), so no head split/merge copy runs; the
// output rows (width d) and the gradient rows of the q/k/v product are written in the same
// token-major layout. Grouped-query attention: query head h reads key/value head
// h / (heads / kv_heads), in place; the dk/dv kernel runs one block per key/value head and sums
// the gradients of its group's query heads in registers, so shared heads are never repeated in
// memory and their gradients need no atomics.
//
// Grids are (batch·heads, tiles of 64 rows): the long dimension in x, which has no 65535 limit.
// Forward (one block per 64 query rows of one (batch, head), four warps of 16 rows): stream
// 64-key tiles of k and v through double-buffered shared memory, keep the running row maximum
// and sum of the online softmax in registers, and save one log-sum-exp per row (f32) for the
// backward pass. Backward, as two kernels that never need atomics (so every gradient is
// deterministic):
//   dq:   one block per 64 query rows; also writes D = rowsum(dO ⊙ O) for the next kernel;
//   dkdv: one block per 64 keys, streaming tiles of q and dO (`Tiles::DKDV_STREAM` rows).
// Each recomputes the probabilities from q, k and the saved log-sum-exp. A tile whose scores
// are all visible (`whole_tile`: most of a long causal sequence) skips the per-element mask.
//
// Wide heads (80, 96 and 128; `Tiles` below). A 64-row tile of a 128-wide head is 17 KB, so
// double-buffered k and v tiles would take 70 KB: over the 48 KB of static shared memory, and
// as dynamic shared memory (which needs a per-kernel opt-in above 48 KB) enough to leave room
// for one block per SM on an RTX 4090 (100 KB per SM) where two fit now. So heads wider than 64
// stream tiles of 32 rows instead, still double-buffered (35 KB at 128, 27 KB at 96, 23 KB at
// 80, all static), and keep everything else: 64 rows and four warps per block, A fragments in
// registers, two blocks per SM on the RTX 4090 and the H200 alike (the registers, up to 255 per
// thread, allow no more there either). A tile narrower than a block's rows can be all masked
// for a warp (causal, the block's last key tile): its probabilities come out 0, and the online
// softmax keeps the finite maximum of the first tile, whose key 0 every row sees. At 128 the
// dk/dv kernel's k and v fragments and dk and dv accumulators take 32 + 32 + 64 + 64 registers
// before any score, so it streams 16-query tiles: their score tiles are small enough for one
// sweep that computes each probability once (two sweeps, dv then dk, each recomputing them,
// measured 1.8 % slower on gpt-1.3b). Registers and spills per kernel are listed in README.md
// next to this file.
//
// Matrix products use the warp-level `mma.sync.m16n8k16` (bf16 or f16 in, f32 accumulate),
// available from sm_80, so the compute_80 PTX runs on Ampere, Ada (RTX 4090) and Hopper. The
// accumulator fragment of one product is reused in registers as the A operand of the next
// (probabilities times v), as FlashAttention-2 does; shared-memory operands are loaded with
// `ldmatrix` (`.trans` where the product needs the tile transposed).
//
// Dropout on the probabilities uses the same (key, element index) hash as every other dropout
// site, with the element index of the (batch, heads, seq, seq) probability tensor the
// materialised path would have: masks agree with it exactly and are regenerated, not stored.
// The row sums of the softmax are taken before dropout.
//
// Key padding: with `lens` (one u32 per sequence), keys at positions lens[b] and beyond are
// masked for every query, as PyTorch's `key_padding_mask`; tiles past the last real key are
// skipped. Without it (a null pointer) every key is real.
//
// Packed sequences: with `pos` (one u32 per token: its position within its own example, 0 where
// an example begins), query i sees keys start(i) ..= i, start(i) = i − pos[i]; attention never
// crosses examples. Starts never decrease along a sequence, so a block of rows starts its key
// tiles at its first row's start, and the dk/dv kernel ends its query tiles at the last query
// whose example starts at or before the block's last key (a binary search). A row may then see
// no key of a block's first tiles: the online softmax keeps its maximum at -inf and its sums
// at 0 until a tile holds one of its keys, which the row's own key guarantees.
#include <stddef.h>

#include "common.cuh"

namespace flash {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int TILE = 64;  // rows per block (queries, or keys in dk/dv: 16 per warp); also the
                          // rows of a streamed tile up to head width 64 (see `Tiles`)
constexpr int PAD = 8;    // shared rows are padded by 16 bytes: ldmatrix reads no bank twice
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

template <typename T> struct Mma;

template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
            "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // Two values as one register: `lo` in the low half (the lower column index).
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
};

template <> struct Mma<__half> {
    static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
            "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
};

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// B operands of two n-tiles from a shared tile X (rows × pitch) where B(k, n) = X[n][k]:
// n = row0 .. row0+16, k = col0 .. col0+16. b[0], b[1] serve n-tile row0, b[2], b[3] row0+8.
template <typename T>
__device__ __forceinline__ void frag_b_rows(uint32_t (&b)[4], const T *x, int pitch, int row0,
                                            int col0) {
    const int lane = threadIdx.x & 31;
    const int m = lane >> 3, r = lane & 7;
    const T *p = x + (row0 + (m >> 1) * 8 + r) * pitch + col0 + (m & 1) * 8;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                 : "r"(smem_addr(p)));
}

// B operands of two n-tiles where B(k, n) = X[k][n]: k = k0 .. k0+16 (rows of X),
// n = n0 .. n0+16 (columns). b[0], b[1] serve n-tile n0, b[2], b[3] n0+8.
template <typename T>
__device__ __forceinline__ void frag_b_cols(uint32_t (&b)[4], const T *x, int pitch, int k0,
                                            int n0) {
    const int lane = threadIdx.x & 31;
    const int m = lane >> 3, r = lane & 7;
    const T *p = x + (k0 + (m & 1) * 8 + r) * pitch + n0 + (m >> 1) * 8;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                 : "r"(smem_addr(p)));
}

// The A operand (16 rows × 16 columns from col0) of rows row0.. of a row-major global matrix;
// rows at or past `rows` read as zero.
template <typename T>
__device__ __forceinline__ void frag_a_global(uint32_t (&a)[4], const T *x, long long stride,
                                              int row0, int col0, int rows) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int r0 = row0 + g, r1 = row0 + g + 8, c = col0 + 2 * t;
    auto at = [&](int r, int col) -> uint32_t {
        return r < rows ? *reinterpret_cast<const uint32_t *>(x + r * stride + col) : 0u;
    };
    a[0] = at(r0, c);
    a[1] = at(r1, c);
    a[2] = at(r0, c + 8);
    a[3] = at(r1, c + 8);
}

// Copies `N` rows of width HD (rows row0.. of a global matrix) into shared memory as
// asynchronous 16-byte copies (sm_80 `cp.async`), so the next tile streams in while the current
// one is computed on; complete it with `cp_async_wait` and a barrier. Rows at or past `rows`
// are zero-filled: zero v rows keep masked-out keys from feeding NaN garbage into 0 · v.
template <typename T, int HD, int N>
__device__ __forceinline__ void load_tile_async(T *dst, const T *src, long long stride, int row0,
                                                int rows) {
    constexpr int VEC = 8;
    constexpr int PER_ROW = HD / VEC;
    for (int i = threadIdx.x; i < N * PER_ROW; i += THREADS) {
        const int r = i / PER_ROW, c = (i % PER_ROW) * VEC;
        const bool valid = row0 + r < rows;
        const T *from = valid ? src + (row0 + r) * stride + c : src;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                         smem_addr(dst + r * (HD + PAD) + c)),
                     "l"(from), "r"(valid ? 16 : 0));
    }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Issues tile `next` (if any, tiles of N rows) into the other buffer and waits for the current
// tile's copies: the double-buffered pipeline every kernel's tile loop runs.
template <typename T, int HD, int N>
__device__ __forceinline__ void pipeline_step(T (*a)[N * (HD + PAD)], T (*b)[N * (HD + PAD)],
                                              const T *sa, long long stride_a, const T *sb,
                                              long long stride_b, int next, int tiles, int rows) {
    if (next < tiles) {
        load_tile_async<T, HD, N>(a[next & 1], sa, stride_a, next * N, rows);
        load_tile_async<T, HD, N>(b[next & 1], sb, stride_b, next * N, rows);
        cp_async_commit();
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
}

// The four accumulator elements of a thread in an m16n8 tile sit at rows (g, g, g+8, g+8)
// and columns (2t, 2t+1, 2t, 2t+1).
__device__ __forceinline__ int acc_row(int e) { return (threadIdx.x & 31) / 4 + (e >> 1) * 8; }
__device__ __forceinline__ int acc_col(int e) { return 2 * (threadIdx.x & 3) + (e & 1); }

// The two products every kernel runs, for one warp's 16 rows (A in registers, 16 columns from
// k0) against a shared tile X of N rows × HD:
//   c (16 × N)  += A · X[.., k0 .. k0+16]ᵀ     (scores: q·kᵀ, dO·vᵀ, k·qᵀ, v·dOᵀ)
//   c (16 × HD) += A · X[k0 .. k0+16, ..]       (outputs: P·v, dS·k, Pᵀ·dO, dSᵀ·q)
template <typename T, int HD, int N>
__device__ __forceinline__ void mma_by_rows_t(float (&c)[N / 8][4], const uint32_t (&a)[4],
                                              const T *x, int k0) {
#pragma unroll
    for (int nt = 0; nt < N / 8; nt += 2) {
        uint32_t bf[4];
        frag_b_rows(bf, x, HD + PAD, nt * 8, k0);
        Mma<T>::run(c[nt], a, bf[0], bf[1]);
        Mma<T>::run(c[nt + 1], a, bf[2], bf[3]);
    }
}

template <typename T, int HD>
__device__ __forceinline__ void mma_by_rows(float (&c)[HD / 8][4], const uint32_t (&a)[4],
                                            const T *x, int k0) {
#pragma unroll
    for (int dt = 0; dt < HD / 8; dt += 2) {
        uint32_t bf[4];
        frag_b_cols(bf, x, HD + PAD, k0, dt * 8);
        Mma<T>::run(c[dt], a, bf[0], bf[1]);
        Mma<T>::run(c[dt + 1], a, bf[2], bf[3]);
    }
}

// The A operand for columns kk·16 .. kk·16+16 of a 16 × N accumulator: the accumulator layout
// of two m16n8 tiles is the A layout of one m16k16 (FlashAttention-2's register reuse).
template <typename T, int N>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&c)[N / 8][4], int kk) {
    a[0] = Mma<T>::pack(c[2 * kk][0], c[2 * kk][1]);
    a[1] = Mma<T>::pack(c[2 * kk][2], c[2 * kk][3]);
    a[2] = Mma<T>::pack(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[3] = Mma<T>::pack(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// Twin of `Dims` in src/ops/attention/gpu.rs: the static_asserts below and the Rust const
// asserts there check the same layout; change both together.
struct Dims {
    int batch, heads, seq;
    float scale;         // 1/√hd
    int causal;          // query i sees keys 0..=i
    int kv_heads;        // key/value heads; divides heads
    uint64_t key;        // dropout mask key
    uint32_t threshold;  // 0: no dropout
    float keep_scale;    // 1/(1-p)
};

static_assert(sizeof(Dims) == 40, "Dims must match Dims in src/ops/attention/gpu.rs");
static_assert(offsetof(Dims, batch) == 0, "Dims::batch must match the Rust Dims::batch");
static_assert(offsetof(Dims, heads) == 4, "Dims::heads must match the Rust Dims::heads");
static_assert(offsetof(Dims, seq) == 8, "Dims::seq must match the Rust Dims::seq");
static_assert(offsetof(Dims, scale) == 12, "Dims::scale must match the Rust Dims::scale");
static_assert(offsetof(Dims, causal) == 16, "Dims::causal must match the Rust Dims::causal");
static_assert(offsetof(Dims, kv_heads) == 20,
              "Dims::kv_heads must match the Rust Dims::kv_heads");
static_assert(offsetof(Dims, key) == 24, "Dims::key must match the Rust Dims::key");
static_assert(offsetof(Dims, threshold) == 32,
              "Dims::threshold must match the Rust Dims::threshold");
static_assert(offsetof(Dims, keep_scale) == 36,
              "Dims::keep_scale must match the Rust Dims::keep_scale");

// Keys of sequence b that are not padding: lens[b] clamped into 1..S (a kernel cannot report a
// bad length), or all S without a key-padding mask (lens null).
__device__ __forceinline__ int key_count(const uint32_t *lens, int b, int S) {
    return lens ? (int)min(max(lens[b], 1u), (uint32_t)S) : S;
}

// The first key query `row` of sequence b sees: its example's first token, or key 0 without
// packed sequences (pos null) and for rows past the end. A position beyond the row's index is
// clamped (a kernel cannot report it).
__device__ __forceinline__ int example_start(const uint32_t *pos, int b, int row, int S) {
    if (!pos || row >= S) return 0;
    return row - (int)min(pos[(long long)b * S + row], (uint32_t)row);
}

// One past the last query of sequence b whose example starts at or before key `key`: the
// queries that may see keys up to `key` (all S without packed sequences). Starts never
// decrease along a sequence, so a binary search finds it.
__device__ __forceinline__ int queries_seeing(const uint32_t *pos, int b, int key, int S) {
    if (!pos) return S;
    int lo = min(key + 1, S), hi = S;  // query `key` sees key `key`; find the first that does not
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (example_start(pos, b, mid, S) <= key) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// Whether every score of a tile is visible: queries r0 ..= r1 against keys c0 ..= c1, all real
// rows and keys, none after its query (causal), none before its example (`last_start`, the
// start of the tile's last query: starts never decrease). Most tiles of a long sequence are
// whole; their scores skip the per-element mask, whose integer work is the bulk of the
// kernels' non-product instructions. Uniform across a block, so no warp diverges.
__device__ __forceinline__ bool whole_tile(const Dims &p, int r0, int r1, int c0, int c1, int keys,
                                           int last_start) {
    return r1 < p.seq && c1 < keys && !(p.causal && c1 > r0) && c0 >= last_start;
}

// A compile-time flag for the two versions of a tile's score loop (masked or whole).
template <bool B> struct Masked {
    static constexpr bool value = B;
};

__device__ __forceinline__ bool kept(const Dims &p, int bh, int i, int j) {
    const uint64_t idx = ((uint64_t)bh * p.seq + i) * p.seq + j;
    return dropout_keep(p.key, idx, p.threshold);
}

// Where one sequence's query head h and the key/value head it reads start in the q/k/v rows.
struct HeadCols {
    long long stride;  // width of a q/k/v row: d + 2·kvd
    int d, kvd;
    __device__ HeadCols(const Dims &p, int hd) : d(p.heads * hd), kvd(p.kv_heads * hd) {
        stride = (long long)d + 2LL * kvd;
    }
    __device__ int group(const Dims &p) const { return p.heads / p.kv_heads; }
    // Columns of k and v of key/value head g.
    __device__ int k_col(int g, int hd) const { return d + g * hd; }
    __device__ int v_col(int g, int hd) const { return d + kvd + g * hd; }
};

// How each head width tiles its work (see the header comment): `STREAM` rows per streamed tile
// (keys and values in the forward and dq kernels), `DKDV_STREAM` rows of queries and output
// gradients per tile in dk/dv.
template <int HD> struct Tiles {
    static_assert(HD % 16 == 0 && HD >= 16 && HD <= 128, "head widths are multiples of 16");
    static constexpr int STREAM = HD <= 64 ? TILE : 32;
    // The dk/dv kernel holds k, v, dk and dv beside its two score tiles: at 64 a 64-query tile
    // takes 255 registers and spills, a 32-query tile does not; at 128 a 16-query tile keeps
    // the score tiles small enough for one sweep (README.md next to this file lists the spills).
    static constexpr int DKDV_STREAM = HD <= 32 ? TILE : HD <= 96 ? 32 : 16;
    static_assert(TILE % STREAM == 0, "a block's rows span whole streamed tiles");
    // Static shared memory is capped at 48 KB per block: two double-buffered tiles.
    static_assert(2 * 2 * STREAM * (HD + PAD) * 2 + 2 * STREAM * 4 <= 48 * 1024,
                  "the streamed tiles fit static shared memory");
};

template <typename T, int HD>
__device__ void forward(const T *qkv, const uint32_t *lens, const uint32_t *pos, T *out,
                        float *lse, Dims p) {
    constexpr int PITCH = HD + PAD;
    constexpr int KT = Tiles<HD>::STREAM;
    __shared__ __align__(16) T kbuf[2][KT * PITCH];
    __shared__ __align__(16) T vbuf[2][KT * PITCH];
    const HeadCols cols(p, HD);
    const int d = cols.d, S = p.seq;
    const long long stride = cols.stride;
    const int bh = blockIdx.x, b = bh / p.heads, h = bh % p.heads, g = h / cols.group(p);
    const int warp = threadIdx.x >> 5;
    const T *base = qkv + (long long)b * S * stride;
    const T *q = base + h * HD;
    const T *k = base + cols.k_col(g, HD);
    const T *v = base + cols.v_col(g, HD);
    // Causal blocks of late rows do the most work: they go first, not into the last wave.
    const int tile = gridDim.y - 1 - blockIdx.y;
    const int row0 = tile * TILE + warp * 16;

    uint32_t qf[HD / 16][4];
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) frag_a_global(qf[kk], q, stride, row0, kk * 16, S);

    float acc[HD / 8][4] = {};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    const float sl2 = p.scale * LOG2E;
    const int keys = key_count(lens, b, S);
    int tiles = (keys + KT - 1) / KT;
    // The last key this block's last row sees is in key tile (tile + 1) · TILE / KT − 1.
    if (p.causal) tiles = min(tiles, (tile + 1) * (TILE / KT));
    // Packed: no row of the block sees a key before its first row's example.
    const int first = example_start(pos, b, tile * TILE, S) / KT;
    const int start[2] = {example_start(pos, b, row0 + acc_row(0), S),
                          example_start(pos, b, row0 + acc_row(2), S)};
    const int last_start = example_start(pos, b, tile * TILE + TILE - 1, S);

    load_tile_async<T, HD, KT>(kbuf[first & 1], k, stride, first * KT, S);
    load_tile_async<T, HD, KT>(vbuf[first & 1], v, stride, first * KT, S);
    cp_async_commit();
    for (int j = first; j < tiles; ++j) {
        pipeline_step<T, HD, KT>(kbuf, vbuf, k, stride, v, stride, j + 1, tiles, S);
        __syncthreads();  // tile j is in for every thread's copies
        const T *ks = kbuf[j & 1], *vs = vbuf[j & 1];

        float s[KT / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) mma_by_rows_t<T, HD, KT>(s, qf[kk], ks, kk * 16);
        // Scores in the log2 domain; masked keys at -inf. Then the new row maxima.
        float mnew[2] = {m[0], m[1]};
        const auto scale_and_mask = [&](auto masked) {
#pragma unroll
            for (int nt = 0; nt < KT / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = row0 + acc_row(e), col = j * KT + nt * 8 + acc_col(e);
                    float x = s[nt][e] * sl2;
                    if constexpr (decltype(masked)::value) {
                        if (col >= keys || (p.causal && col > row) || col < start[e >> 1])
                            x = -INFINITY;
                    }
                    s[nt][e] = x;
                    mnew[e >> 1] = fmaxf(mnew[e >> 1], x);
                }
            }
        };
        if (whole_tile(p, tile * TILE, tile * TILE + TILE - 1, j * KT, j * KT + KT - 1, keys,
                       last_start))
            scale_and_mask(Masked<false>{});
        else
            scale_and_mask(Masked<true>{});
        float base[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mnew[r] = fmaxf(mnew[r], __shfl_xor_sync(0xffffffffu, mnew[r], 1));
            mnew[r] = fmaxf(mnew[r], __shfl_xor_sync(0xffffffffu, mnew[r], 2));
            // A row that has seen no key yet (packed: its example starts in a later tile) keeps
            // mnew at -inf: base 0 makes alpha and its probabilities 0, its sums stay 0. (With
            // tiles narrower than a block, a row may see no key of a later tile: mnew keeps the
            // finite running maximum and its probabilities come out 0.)
            base[r] = mnew[r] == -INFINITY ? 0.f : mnew[r];
            const float alpha = exp2f(m[r] - base[r]);
            l[r] *= alpha;
#pragma unroll
            for (int dt = 0; dt < HD / 8; ++dt) {
                acc[dt][2 * r] *= alpha;
                acc[dt][2 * r + 1] *= alpha;
            }
            m[r] = mnew[r];
        }
        // Probabilities (unnormalised); the row sums see them before dropout.
#pragma unroll
        for (int nt = 0; nt < KT / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float pe = exp2f(s[nt][e] - base[e >> 1]);
                l[e >> 1] += pe;
                if (p.threshold) {
                    const int row = row0 + acc_row(e), col = j * KT + nt * 8 + acc_col(e);
                    if (row < S && col < S && !kept(p, bh, row, col)) pe = 0.f;
                }
                s[nt][e] = pe;
            }
        }
        // acc += P · V, the probabilities reused in registers as the A operand.
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) {
            uint32_t pa[4];
            acc_to_a<T, KT>(pa, s, kk);
            mma_by_rows<T, HD>(acc, pa, vs, kk * 16);
        }
        __syncthreads();  // everyone is done with tile j before its buffer is refilled
    }

    const int t = threadIdx.x & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float total = l[r];
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        const int row = row0 + acc_row(2 * r);
        if (row >= S) continue;
        const float inv = p.keep_scale / total;
        T *o = out + ((long long)b * S + row) * d + h * HD;
#pragma unroll
        for (int dt = 0; dt < HD / 8; ++dt) {
            *reinterpret_cast<uint32_t *>(o + dt * 8 + 2 * t) =
                Mma<T>::pack(acc[dt][2 * r] * inv, acc[dt][2 * r + 1] * inv);
        }
        if (t == 0) lse[(long long)bh * S + row] = (m[r] + log2f(total)) * LN2;
    }
}

// dq = scale · Σ_j dS_ij k_j with dS = P ⊙ (dP − D), dP = dropout(dO · vᵀ); writes D first.
template <typename T, int HD>
__device__ void backward_dq(const T *qkv, const uint32_t *lens, const uint32_t *pos, const T *out,
                            const T *dout, const float *lse, float *dsum, T *dqkv, Dims p) {
    constexpr int PITCH = HD + PAD;
    constexpr int KT = Tiles<HD>::STREAM;
    __shared__ __align__(16) T kbuf[2][KT * PITCH];
    __shared__ __align__(16) T vbuf[2][KT * PITCH];
    const HeadCols cols(p, HD);
    const int d = cols.d, S = p.seq;
    const long long stride = cols.stride;
    const int bh = blockIdx.x, b = bh / p.heads, h = bh % p.heads, g = h / cols.group(p);
    const int warp = threadIdx.x >> 5, t = threadIdx.x & 3;
    const T *base = qkv + (long long)b * S * stride;
    const T *q = base + h * HD;
    const T *k = base + cols.k_col(g, HD);
    const T *v = base + cols.v_col(g, HD);
    const T *o = out + (long long)b * S * d + h * HD;
    const T *dog = dout + (long long)b * S * d + h * HD;
    // Causal blocks of late rows do the most work: they go first, not into the last wave.
    const int tile = gridDim.y - 1 - blockIdx.y;
    const int row0 = tile * TILE + warp * 16;

    uint32_t qf[HD / 16][4], df[HD / 16][4];
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        frag_a_global(qf[kk], q, stride, row0, kk * 16, S);
        frag_a_global(df[kk], dog, d, row0, kk * 16, S);
    }
    // D = rowsum(dO ⊙ O): each quad holds a whole row of dO between its four threads.
    float dr[2] = {0.f, 0.f}, l2[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + acc_row(2 * r);
        if (row < S) {
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int col = kk * 16 + 2 * t + half * 8;
                    const uint32_t packed = df[kk][r + 2 * half];
                    const T *dv = reinterpret_cast<const T *>(&packed);
                    const T *ov = o + (long long)row * d + col;
                    dr[r] += to_f32(dv[0]) * to_f32(ov[0]) + to_f32(dv[1]) * to_f32(ov[1]);
                }
            }
        }
        dr[r] += __shfl_xor_sync(0xffffffffu, dr[r], 1);
        dr[r] += __shfl_xor_sync(0xffffffffu, dr[r], 2);
        l2[r] = row < S ? lse[(long long)bh * S + row] * LOG2E : 0.f;
        if (row < S && t == 0) dsum[(long long)bh * S + row] = dr[r];
    }

    float acc[HD / 8][4] = {};
    const float sl2 = p.scale * LOG2E;
    const int keys = key_count(lens, b, S);
    int tiles = (keys + KT - 1) / KT;
    if (p.causal) tiles = min(tiles, (tile + 1) * (TILE / KT));
    const int first = example_start(pos, b, tile * TILE, S) / KT;
    const int start[2] = {example_start(pos, b, row0 + acc_row(0), S),
                          example_start(pos, b, row0 + acc_row(2), S)};
    const int last_start = example_start(pos, b, tile * TILE + TILE - 1, S);
    load_tile_async<T, HD, KT>(kbuf[first & 1], k, stride, first * KT, S);
    load_tile_async<T, HD, KT>(vbuf[first & 1], v, stride, first * KT, S);
    cp_async_commit();
    for (int j = first; j < tiles; ++j) {
        pipeline_step<T, HD, KT>(kbuf, vbuf, k, stride, v, stride, j + 1, tiles, S);
        __syncthreads();
        const T *ks = kbuf[j & 1], *vs = vbuf[j & 1];

        float s[KT / 8][4] = {}, dp[KT / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            mma_by_rows_t<T, HD, KT>(s, qf[kk], ks, kk * 16);
            mma_by_rows_t<T, HD, KT>(dp, df[kk], vs, kk * 16);
        }
        // dS = P ⊙ (dropout(dP) − D) in place of the scores.
        const auto score_gradients = [&](auto masked) {
#pragma unroll
            for (int nt = 0; nt < KT / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = row0 + acc_row(e), col = j * KT + nt * 8 + acc_col(e);
                    bool visible = true;
                    if constexpr (decltype(masked)::value)
                        visible = row < S && col < keys && !(p.causal && col > row) &&
                                  col >= start[e >> 1];
                    const float pe = visible ? exp2f(s[nt][e] * sl2 - l2[e >> 1]) : 0.f;
                    float z = 1.f;
                    if (p.threshold) z = visible && kept(p, bh, row, col) ? p.keep_scale : 0.f;
                    s[nt][e] = pe * (dp[nt][e] * z - dr[e >> 1]);
                }
            }
        };
        if (whole_tile(p, tile * TILE, tile * TILE + TILE - 1, j * KT, j * KT + KT - 1, keys,
                       last_start))
            score_gradients(Masked<false>{});
        else
            score_gradients(Masked<true>{});
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) {
            uint32_t sa[4];
            acc_to_a<T, KT>(sa, s, kk);
            mma_by_rows<T, HD>(acc, sa, ks, kk * 16);
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + acc_row(2 * r);
        if (row >= S) continue;
        T *dq = dqkv + ((long long)b * S + row) * stride + h * HD;
#pragma unroll
        for (int dt = 0; dt < HD / 8; ++dt) {
            *reinterpret_cast<uint32_t *>(dq + dt * 8 + 2 * t) =
                Mma<T>::pack(acc[dt][2 * r] * p.scale, acc[dt][2 * r + 1] * p.scale);
        }
    }
}

// What one dk/dv sweep over the query tiles reads: the block's place, its streamed tiles in
// shared memory, and the global rows they stream from.
template <typename T, int HD> struct DkdvSweep {
    static constexpr int QT = Tiles<HD>::DKDV_STREAM;
    T (*qbuf)[QT * (HD + PAD)];
    T (*dobuf)[QT * (HD + PAD)];
    float *l2s, *ds;
    int *starts;  // the streamed queries' example starts (0 without packed sequences)
    const uint32_t *pos;
    const T *q, *dog;
    const float *lse, *dsum;
    long long stride;
    float sl2;  // scale · log2(e)
    int d, S, b, bh, keys, key0, first, tiles;
    int key_first;  // the block's first key (key0 is the warp's)
};

// One sweep of the dk/dv kernel over the query tiles first .. tiles: dv += dropout(P)ᵀ · dO
// and dk += dSᵀ · q (the scales are applied by the caller). kf and vf are the block's k and v
// rows as A fragments.
template <typename T, int HD>
__device__ __forceinline__ void dkdv_sweep(float (&dk)[HD / 8][4], float (&dv)[HD / 8][4],
                                           const uint32_t (&kf)[HD / 16][4],
                                           const uint32_t (&vf)[HD / 16][4],
                                           const DkdvSweep<T, HD> &w, const Dims &p) {
    constexpr int QT = DkdvSweep<T, HD>::QT;
    if (w.first < w.tiles) {
        load_tile_async<T, HD, QT>(w.qbuf[w.first & 1], w.q, w.stride, w.first * QT, w.S);
        load_tile_async<T, HD, QT>(w.dobuf[w.first & 1], w.dog, w.d, w.first * QT, w.S);
        cp_async_commit();
    }
    for (int i = w.first; i < w.tiles; ++i) {
        pipeline_step<T, HD, QT>(w.qbuf, w.dobuf, w.q, w.stride, w.dog, w.d, i + 1, w.tiles,
                                 w.S);
        const T *qs = w.qbuf[i & 1], *dos = w.dobuf[i & 1];
        for (int r = threadIdx.x; r < QT; r += THREADS) {
            const int row = i * QT + r;
            w.l2s[r] = row < w.S ? w.lse[(long long)w.bh * w.S + row] * LOG2E : 0.f;
            w.ds[r] = row < w.S ? w.dsum[(long long)w.bh * w.S + row] : 0.f;
            w.starts[r] = example_start(w.pos, w.b, row, w.S);
        }
        __syncthreads();

        // Sᵀ = k · qᵀ, then Pᵀ; `kept_bits` remembers the dropout mask for dPᵀ.
        float s[QT / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) mma_by_rows_t<T, HD, QT>(s, kf[kk], qs, kk * 16);
        uint32_t kept_bits = 0xffffffffu;
        const auto probabilities = [&](auto masked) {
#pragma unroll
            for (int nt = 0; nt < QT / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = w.key0 + acc_row(e), lq = nt * 8 + acc_col(e);
                    const int row = i * QT + lq;
                    bool visible = true;
                    if constexpr (decltype(masked)::value)
                        visible = row < w.S && key < w.keys && !(p.causal && key > row) &&
                                  key >= w.starts[lq];
                    s[nt][e] = visible ? exp2f(s[nt][e] * w.sl2 - w.l2s[lq]) : 0.f;
                    if (p.threshold && !(visible && kept(p, w.bh, row, key)))
                        kept_bits &= ~(1u << (nt * 4 + e));
                }
            }
        };
        // The block's keys are key_first ..= key_first + TILE - 1.
        if (whole_tile(p, i * QT, i * QT + QT - 1, w.key_first, w.key_first + TILE - 1, w.keys,
                       w.starts[QT - 1]))
            probabilities(Masked<false>{});
        else
            probabilities(Masked<true>{});
        // dv += dropout(P)ᵀ · dO (the keep scale is applied once at the end).
#pragma unroll
        for (int kk = 0; kk < QT / 16; ++kk) {
            float z[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int nt = 2 * kk + (e >> 2), c = e & 3;
                z[e] = (kept_bits >> (nt * 4 + c)) & 1u ? s[nt][c] : 0.f;
            }
            const uint32_t pa[4] = {Mma<T>::pack(z[0], z[1]), Mma<T>::pack(z[2], z[3]),
                                    Mma<T>::pack(z[4], z[5]), Mma<T>::pack(z[6], z[7])};
            mma_by_rows<T, HD>(dv, pa, dos, kk * 16);
        }
        // dPᵀ = v · dOᵀ, then dSᵀ = Pᵀ ⊙ (dropout(dPᵀ) − D) in place of Pᵀ.
        float dp[QT / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) mma_by_rows_t<T, HD, QT>(dp, vf[kk], dos, kk * 16);
#pragma unroll
        for (int nt = 0; nt < QT / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int lq = nt * 8 + acc_col(e);
                float z = 1.f;
                if (p.threshold) z = (kept_bits >> (nt * 4 + e)) & 1u ? p.keep_scale : 0.f;
                s[nt][e] = s[nt][e] * (dp[nt][e] * z - w.ds[lq]);
            }
        }
        // dk += dSᵀ · q.
#pragma unroll
        for (int kk = 0; kk < QT / 16; ++kk) {
            uint32_t sa[4];
            acc_to_a<T, QT>(sa, s, kk);
            mma_by_rows<T, HD>(dk, sa, qs, kk * 16);
        }
        __syncthreads();  // everyone is done with tile i (and l2s, ds) before they are refilled
    }
}

// Rows key0 + (0, 8) of this thread's accumulator, times `scale`, into columns `col0` ..
// `col0 + HD` of the keys' gradient rows (the head's k or v columns).
template <typename T, int HD>
__device__ __forceinline__ void store_key_rows(T *dqkv, const float (&acc)[HD / 8][4],
                                               float scale, int b, int S, int key0, int col0,
                                               long long stride) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = key0 + acc_row(2 * r);
        if (key >= S) continue;
        T *dst = dqkv + ((long long)b * S + key) * stride + col0;
#pragma unroll
        for (int dt = 0; dt < HD / 8; ++dt) {
            *reinterpret_cast<uint32_t *>(dst + dt * 8 + 2 * t) =
                Mma<T>::pack(acc[dt][2 * r] * scale, acc[dt][2 * r + 1] * scale);
        }
    }
}

// dv = Σ_i dropout(P)_ij dO_i and dk = scale · Σ_i dS_ij q_i for this block's 64 keys of one
// key/value head, summed over the query heads of its group; the products run transposed (keys
// as rows), so P and dS come out as Pᵀ and dSᵀ fragments.
template <typename T, int HD>
__device__ void backward_dkdv(const T *qkv, const uint32_t *lens, const uint32_t *pos,
                              const T *dout, const float *lse, const float *dsum, T *dqkv,
                              Dims p) {
    constexpr int PITCH = HD + PAD;
    constexpr int QT = Tiles<HD>::DKDV_STREAM;
    __shared__ __align__(16) T qbuf[2][QT * PITCH];
    __shared__ __align__(16) T dobuf[2][QT * PITCH];
    __shared__ float l2s[QT];
    __shared__ float ds[QT];
    __shared__ int starts[QT];
    const HeadCols cols(p, HD);
    const int d = cols.d, S = p.seq;
    const long long stride = cols.stride;
    const int group = cols.group(p);
    const int bg = blockIdx.x, b = bg / p.kv_heads, g = bg % p.kv_heads;
    const int warp = threadIdx.x >> 5;
    const T *base = qkv + (long long)b * S * stride;
    const T *k = base + cols.k_col(g, HD);
    const T *v = base + cols.v_col(g, HD);
    const int key0 = blockIdx.y * TILE + warp * 16;
    // The sweep's arguments; `for_head` points them at one query head of the group.
    DkdvSweep<T, HD> w;
    w.sl2 = p.scale * LOG2E;
    w.keys = key_count(lens, b, S);
    // A block of padding keys only writes their zero gradients. Causal: queries before the
    // block's first key see none of its keys.
    w.tiles = blockIdx.y * TILE < w.keys ? (S + QT - 1) / QT : 0;
    w.first = p.causal ? (int)blockIdx.y * (TILE / QT) : 0;
    // Packed: queries past the example of the block's last key see none of its keys.
    const int last_key = min((int)blockIdx.y * TILE + TILE - 1, S - 1);
    w.tiles = min(w.tiles, (queries_seeing(pos, b, last_key, S) + QT - 1) / QT);
    w.starts = starts;
    w.pos = pos;
    w.b = b;
    w.qbuf = qbuf;
    w.dobuf = dobuf;
    w.l2s = l2s;
    w.ds = ds;
    w.lse = lse;
    w.dsum = dsum;
    w.stride = stride;
    w.d = d;
    w.S = S;
    w.key0 = key0;
    w.key_first = blockIdx.y * TILE;
    const auto for_head = [&](int h) {
        w.q = base + h * HD;
        w.dog = dout + (long long)b * S * d + h * HD;
        w.bh = b * p.heads + h;
    };
    const int h0 = g * group;

    uint32_t kf[HD / 16][4], vf[HD / 16][4];
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        frag_a_global(kf[kk], k, stride, key0, kk * 16, S);
        frag_a_global(vf[kk], v, stride, key0, kk * 16, S);
    }
    float dk[HD / 8][4] = {}, dv[HD / 8][4] = {};
#pragma unroll 1
    for (int h = h0; h < h0 + group; ++h) {
        for_head(h);
        dkdv_sweep<T, HD>(dk, dv, kf, vf, w, p);
    }
    store_key_rows<T, HD>(dqkv, dk, p.scale, b, S, key0, cols.k_col(g, HD), stride);
    store_key_rows<T, HD>(dqkv, dv, p.keep_scale, b, S, key0, cols.v_col(g, HD), stride);
}

}  // namespace flash

#define FLASH_KERNELS(T, NAME, HD)                                                             \
    extern "C" __global__ void __launch_bounds__(flash::THREADS)                               \
        flash_fwd_h##HD##_##NAME(const T *qkv, const uint32_t *lens, const uint32_t *pos,      \
                                 T *out, float *lse, flash::Dims p) {                          \
        flash::forward<T, HD>(qkv, lens, pos, out, lse, p);                                    \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(flash::THREADS)                               \
        flash_bwd_dq_h##HD##_##NAME(const T *qkv, const uint32_t *lens, const uint32_t *pos,   \
                                    const T *out, const T *dout, const float *lse,             \
                                    float *dsum, T *dqkv, flash::Dims p) {                     \
        flash::backward_dq<T, HD>(qkv, lens, pos, out, dout, lse, dsum, dqkv, p);              \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(flash::THREADS)                               \
        flash_bwd_dkdv_h##HD##_##NAME(const T *qkv, const uint32_t *lens, const uint32_t *pos, \
                                      const T *dout, const float *lse, const float *dsum,      \
                                      T *dqkv, flash::Dims p) {                                \
        flash::backward_dkdv<T, HD>(qkv, lens, pos, dout, lse, dsum, dqkv, p);                 \
    }

FLASH_KERNELS(__nv_bfloat16, bf16, 16)
FLASH_KERNELS(__nv_bfloat16, bf16, 32)
FLASH_KERNELS(__nv_bfloat16, bf16, 64)
FLASH_KERNELS(__nv_bfloat16, bf16, 80)
FLASH_KERNELS(__nv_bfloat16, bf16, 96)
FLASH_KERNELS(__nv_bfloat16, bf16, 128)
FLASH_KERNELS(__half, f16, 16)
FLASH_KERNELS(__half, f16, 32)
FLASH_KERNELS(__half, f16, 64)
FLASH_KERNELS(__half, f16, 80)
FLASH_KERNELS(__half, f16, 96)
FLASH_KERNELS(__half, f16, 128)
