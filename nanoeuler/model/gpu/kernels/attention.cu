// FlashAttention, forward and backward: causal, grouped-query, head_dim 32, 64 or 128, any sequence length.
//
// Tiled with online softmax; the only thing stored besides the output is the per-row logsumexp, never a
// T x T matrix. The matrix products run on the tensor cores through mma.sync with float32 accumulators; the
// softmax statistics (max, sum, lse, delta) are float32 in every build. The module is built once per define
// set (layers.py), and the kernel names are the same in all of them:
//   default           float activations, TF32 m16n8k8, one TF32 product per tile (training: the precision of
//                     the cuBLAS TF32 matmuls beside it);
//   -DATT_PRECISE=1   the "3xTF32" split (each operand = TF32 high part + TF32 residual, three products), which
//                     gives float32 accuracy: the checks (with float or bf16 activations);
//   -DACT_BF16=1      bf16 activations and bf16 m16n8k16 products: q, k, v, dout are bf16 already, P and dS
//                     are rounded to bf16 as operands (FlashAttention-2's mixed precision).
// Activations (qkv, out, dout, dqkv) are act_t (common.cuh): float, or bf16 with -DACT_BF16=1; lse and delta
// are float always. Layout: the fused activation qkv (B, T, H + 2G, D) with q heads, then k heads, then
// v heads; query head h reads kv head h / (H / G).
//
// A training block is ATT_THREADS threads: each warp owns 16 rows of an ATT_TILE-row tile and loops over tiles
// of the other side (the bf16 forward: half the warps, of 32 rows, AttForwardRows). ATT_TILE, ATT_THREADS and
// ATT_WARPS come from layers.py (nanoeuler/model/gpu/constants.py), which reads back the launch shapes derived
// here (attention_launch_d<D>). Head size 128 keeps the 64-row tiles and doubles each row's registers and
// shared memory: its forward gives a warp 16 query rows in every build and takes its tiles in dynamic shared
// memory, its backward runs 2 blocks an SM (registers), and its decoding blocks have at most ATT_WARPS_D128
// warps (a lane's key row and value slices take twice the registers).
// The kernels are written once over an "mma policy" (AttTf32, AttBf16 below) that holds the mma primitive and
// the fragment loaders; g = lane / 4, t = lane % 4.
//   m16n8k8 TF32 (one value a register): A rows g, g+8 x cols t, t+4; B rows (k) t, t+4 x col (n) g;
//     C rows g, g+8 x cols 2t, 2t+1. A product P @ V whose P comes out of an accumulator (cols 2t, 2t+1)
//     feeds it straight back as an A operand by numbering the k index so that k = t is column 2t and
//     k = t + 4 is column 2t + 1, and reading V's rows 2t, 2t+1 to match.
//   m16n8k16 bf16 (two values a register, the lower column in the low half): A rows g, g+8 x cols (2t, 2t+1),
//     (2t+8, 2t+9); B rows (k) (2t, 2t+1), (2t+8, 2t+9) x col g; C as above. Two neighbouring accumulator
//     tiles (cols 0..7, 8..15) are exactly one A operand once packed in pairs, in the natural k order; V's
//     rows come transposed out of shared memory through ldmatrix.trans.
// Either way P and dS go from accumulators to operands without shuffles or a trip through memory.
#include "common.cuh"

#if !defined(ATT_TILE) || !defined(ATT_THREADS) || !defined(ATT_WARPS) || !defined(ATT_CACHED_GROUP) ||         \
    !defined(ATT_CACHED_WARPS_MANY) || !defined(ATT_WARPS_D128)
#error "ATT_TILE, ATT_THREADS, ATT_WARPS, ATT_WARPS_D128 and ATT_CACHED_* come from nanoeuler/model/gpu/constants.py"
#endif
static_assert(ATT_THREADS == 32 * ATT_TILE / 16, "a warp owns 16 rows of a tile");
// Blocks an SM keeps of each backward kernel: the most whose registers fit without spills (docs/gpu-engine.md);
// head size 128 holds twice the accumulators a thread (dK and dV: 128 floats)
#define ATT_BACKWARD_BLOCKS(D) ((D) > 64 ? 2 : 3)
// -DATT_PRECISE=1 for the 3xTF32 kernels of the checks.
#ifndef ATT_PRECISE
#define ATT_PRECISE 0
#endif

// Two consecutive output elements (cols 2t, 2t+1 of an accumulator), converted to act_t.
__device__ __forceinline__ void att_store2(float* p, float a, float b) {
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
__device__ __forceinline__ void att_store2(bf16* p, float a, float b) {
    *reinterpret_cast<unsigned*>(p) = pack_bf16x2(a, b);
}

// A row of a head from its accumulators c[D/8][4] (columns dn * 8 + 2t, +1; e0 = 0 for row g, 2 for row
// g + 8) times scale, into dst (the row's head, plus 2t): the forward's output, or a gradient in dqkv. With a
// rotary table (cos_t: training's positions 0.., (T, D/2)) the rotary embedding's backward comes with a q or k
// gradient: the gradient of the unrotated q or k, the inverse rotation (d1, d2) -> (d1 cos + d2 sin, d2 cos -
// d1 sin) of each pair (c, c + D/2), which sits in this thread's accumulators dn and dn + D/16. It saves a
// pass over dqkv (rope_backward) a layer.
template <int D>
__device__ __forceinline__ void att_store_row(act_t* dst, const float (&c)[D / 8][4], int e0, float scale,
                                              const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                              int pos) {
    float v[D / 8][2];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) v[dn][0] = c[dn][e0] * scale, v[dn][1] = c[dn][e0 + 1] * scale;
    if (cos_t) {
        const int t = threadIdx.x & 3;
#pragma unroll
        for (int dn = 0; dn < D / 16; ++dn) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const long long at = (long long)pos * (D / 2) + dn * 8 + 2 * t + e;
                rotate_pair(v[dn][e], v[dn + D / 16][e], cos_t[at], -sin_t[at], v[dn][e], v[dn + D / 16][e]);
            }
        }
    }
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) att_store2(dst + dn * 8, v[dn][0], v[dn][1]);
}

// ------------------------------------------------------------------------------------------ mma policies
// What a kernel asks of its policy M (all fragments are 32-bit registers: one TF32 value or two bf16):
//   M::KS                 k extent of one mma: 8 (TF32) or 16 (bf16); a D- or 64-long product takes n / KS
//   M::elem_t             element of the shared-memory tiles: float (TF32) or bf16 (a raw copy of qkv/dout)
//   M::operand(x)         a float value as the kernel keeps it for an operand (P, dS, tile elements)
//   M::a_rows(a, X, ld)   A (16 x KS) = rows 0..15, cols 0..KS-1 of a row-major shared tile at X
//   M::a_global(a, r0, r1, ok0, ok1)   the same from global act_t rows r0 (row g), r1 (g + 8); 0 where !ok
//   M::a_acc(a, c, j)     A (16 x KS) = k-slice j of 16 x 64 accumulators c[8][4] (P, dS), k numbered as
//                         b_rows reads it
//   M::b_cols(b, X, ld)   B (KS x 8) with B[k][n] = X[n][k]: a tile whose rows are the n index (K in Q K^T)
//   M::b_rows(b, X, ld)   B (KS x 8) with B[k][n] = X[k][n]: a tile whose rows are the k index (V in P V)
//   M::mma(c, a, b)       c (16 x 8) += a b
// Shared tiles are (64, D) with rows padded by 16 bytes (LDS = D + 4 floats, or D + 8 bf16): the row stride
// is then 4 (mod 32) banks (D + 4 floats, D + 8 = 72 bf16) or 20 (D + 8 = 40 bf16), so the eight rows g of
// a fragment read land in distinct bank quads and every fragment read below is conflict-free; 16-byte rows
// also keep ldmatrix's row addresses aligned.
template <int D, class M>
struct AttTile {
    static constexpr int LDS = D + 16 / (int)sizeof(typename M::elem_t);  // row stride, elements
};

// TF32: an operand is rounded to TF32 once, where it is stored (shared-memory tiles, the query fragments,
// P and dS), not at each of its uses; the PRECISE kernels keep full float32 operands and split them in mma.
template <bool PRECISE>
struct AttTf32 {
    static constexpr int KS = 8;
    typedef float elem_t;
    static __device__ __forceinline__ float operand(float x) { return PRECISE ? x : __uint_as_float(to_tf32(x)); }
    static __device__ __forceinline__ void a_rows(unsigned (&a)[4], const float* X, int ld) {
        const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
        a[0] = __float_as_uint(X[g * ld + t]);
        a[1] = __float_as_uint(X[(g + 8) * ld + t]);
        a[2] = __float_as_uint(X[g * ld + t + 4]);
        a[3] = __float_as_uint(X[(g + 8) * ld + t + 4]);
    }
    static __device__ __forceinline__ void a_global(unsigned (&a)[4], const act_t* r0, const act_t* r1, bool ok0,
                                                    bool ok1) {
        const int t = threadIdx.x & 3;
        a[0] = __float_as_uint(ok0 ? operand(to_float(r0[t])) : 0.f);
        a[1] = __float_as_uint(ok1 ? operand(to_float(r1[t])) : 0.f);
        a[2] = __float_as_uint(ok0 ? operand(to_float(r0[t + 4])) : 0.f);
        a[3] = __float_as_uint(ok1 ? operand(to_float(r1[t + 4])) : 0.f);
    }
    // k = t <-> column 2t, k = t + 4 <-> column 2t + 1 (c[j][1] is row g, column 2t + 1)
    static __device__ __forceinline__ void a_acc(unsigned (&a)[4], const float (&c)[ATT_TILE / 8][4], int j) {
        a[0] = __float_as_uint(c[j][0]);
        a[1] = __float_as_uint(c[j][2]);
        a[2] = __float_as_uint(c[j][1]);
        a[3] = __float_as_uint(c[j][3]);
    }
    static __device__ __forceinline__ void b_cols(unsigned (&b)[2], const float* X, int ld) {
        const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
        b[0] = __float_as_uint(X[g * ld + t]);
        b[1] = __float_as_uint(X[g * ld + t + 4]);
    }
    static __device__ __forceinline__ void b_rows(unsigned (&b)[2], const float* X, int ld) {  // rows 2t, 2t+1
        const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
        b[0] = __float_as_uint(X[2 * t * ld + g]);
        b[1] = __float_as_uint(X[(2 * t + 1) * ld + g]);
    }
    static __device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
        if (PRECISE) mma_3xtf32(c, a, b);
        else mma_tf32(c, a[0], a[1], a[2], a[3], b[0], b[1]);
    }
};

// bf16: tiles and query fragments are the bf16 bits of qkv / dout as they are (bf16 is its own operand
// format); P and dS stay float until a_acc packs them, rounding to nearest even.
struct AttBf16 {
    static constexpr int KS = 16;
    typedef bf16 elem_t;
    static __device__ __forceinline__ float operand(float x) { return x; }
    static __device__ __forceinline__ unsigned ld2(const bf16* p) { return *reinterpret_cast<const unsigned*>(p); }
    static __device__ __forceinline__ void a_rows(unsigned (&a)[4], const bf16* X, int ld) {
        const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
        a[0] = ld2(X + g * ld + 2 * t);
        a[1] = ld2(X + (g + 8) * ld + 2 * t);
        a[2] = ld2(X + g * ld + 2 * t + 8);
        a[3] = ld2(X + (g + 8) * ld + 2 * t + 8);
    }
    static __device__ __forceinline__ void a_global(unsigned (&a)[4], const bf16* r0, const bf16* r1, bool ok0,
                                                    bool ok1) {
        const int t = threadIdx.x & 3;
        a[0] = ok0 ? ld2(r0 + 2 * t) : 0u;
        a[1] = ok1 ? ld2(r1 + 2 * t) : 0u;
        a[2] = ok0 ? ld2(r0 + 2 * t + 8) : 0u;
        a[3] = ok1 ? ld2(r1 + 2 * t + 8) : 0u;
    }
    // accumulator tiles 2j (k 0..7) and 2j + 1 (k 8..15), natural order
    static __device__ __forceinline__ void a_acc(unsigned (&a)[4], const float (&c)[ATT_TILE / 8][4], int j) {
        a[0] = pack_bf16x2(c[2 * j][0], c[2 * j][1]);
        a[1] = pack_bf16x2(c[2 * j][2], c[2 * j][3]);
        a[2] = pack_bf16x2(c[2 * j + 1][0], c[2 * j + 1][1]);
        a[3] = pack_bf16x2(c[2 * j + 1][2], c[2 * j + 1][3]);
    }
    static __device__ __forceinline__ void b_cols(unsigned (&b)[2], const bf16* X, int ld) {
        const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
        b[0] = ld2(X + g * ld + 2 * t);
        b[1] = ld2(X + g * ld + 2 * t + 8);
    }
    // Two 8 x 8 matrices (k rows 0..7 and 8..15, cols 0..7), transposed on the way: lane l < 16 gives the
    // address of row l, and each thread receives rows 2t, 2t+1 of column g. volatile: the tile is rewritten
    // between barriers, so the load must not move or merge across them.
    static __device__ __forceinline__ void b_rows(unsigned (&b)[2], const bf16* X, int ld) {
        const bf16* row = X + (threadIdx.x & 15) * ld;
        unsigned addr;
        asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(row));
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                     : "=r"(b[0]), "=r"(b[1])
                     : "r"(addr));
    }
    static __device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
        mma_bf16(c, a, b);
    }
};

#if ACT_BF16 && !ATT_PRECISE
typedef AttBf16 AttMma;
#else
typedef AttTf32<ATT_PRECISE> AttMma;
#endif

// Load rows [row0, row0 + 64) of one head of a (rows, NH, D) act_t array into a (64, LDS) shared tile, zeros
// past `rows`, as mma operands: converted to float (and rounded to TF32 in the fast build), or bf16 copied as
// is, 16 bytes at a time. bf16: a thread's loads all go out before its first store, so the tile costs one
// trip to memory, not one a load.
template <int D, class M, int THREADS = ATT_THREADS>
__device__ __forceinline__ void load_tile(typename M::elem_t* __restrict__ dst, const act_t* __restrict__ src,
                                          int row0, int rows, long long row_stride) {
    constexpr int LDS = AttTile<D, M>::LDS;
    if constexpr (sizeof(typename M::elem_t) == 2) {
        static_assert(sizeof(act_t) == sizeof(typename M::elem_t), "bf16 tiles need bf16 activations");
        constexpr int PER = ATT_TILE * D / 8 / THREADS;
        uint4 v[PER];
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = threadIdx.x + j * THREADS, r = i / (D / 8), c = (i % (D / 8)) * 8;
            v[j] = row0 + r < rows ? *reinterpret_cast<const uint4*>(src + (row0 + r) * row_stride + c)
                                   : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = threadIdx.x + j * THREADS, r = i / (D / 8), c = (i % (D / 8)) * 8;
            *reinterpret_cast<uint4*>(dst + r * LDS + c) = v[j];
        }
    } else {
        for (int i = threadIdx.x; i < ATT_TILE * D / 4; i += THREADS) {  // one at a time: more spill
            const int r = i / (D / 4), c = (i % (D / 4)) * 4;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (row0 + r < rows) v = load4(src + (row0 + r) * row_stride + c);
            *reinterpret_cast<float4*>(dst + r * LDS + c) =
                make_float4(M::operand(v.x), M::operand(v.y), M::operand(v.z), M::operand(v.w));
        }
    }
}

// Tiles of the loop over the other side, double-buffered where the elements are bf16: the next tile's copy
// (cp.async, straight into shared memory) runs while the current one is used. Float tiles are converted on
// the way, so they load synchronously into one buffer (two would not fit the forward's static 48 KB).
template <class M>
struct AttStages {
    static constexpr int N = sizeof(typename M::elem_t) == 2 ? 2 : 1;
};

// The bf16 tile copy of load_tile, issued and not waited for (cp.async.cg, 16 bytes, zeros past `rows`); the
// caller commits the group and waits for it (att_copies_wait) before a barrier.
template <int D, class M, int THREADS = ATT_THREADS>
__device__ __forceinline__ void load_tile_async(typename M::elem_t* __restrict__ dst, const act_t* __restrict__ src,
                                                int row0, int rows, long long row_stride) {
    if constexpr (AttStages<M>::N == 1) {
        load_tile<D, M, THREADS>(dst, src, row0, rows, row_stride);
    } else {
        constexpr int LDS = AttTile<D, M>::LDS, PER = ATT_TILE * D / 8 / THREADS;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = threadIdx.x + j * THREADS, r = i / (D / 8), c = (i % (D / 8)) * 8;
            const bool ok = row0 + r < rows;
            const unsigned to = (unsigned)__cvta_generic_to_shared(dst + r * LDS + c);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to),
                         "l"(src + (ok ? row0 + r : 0) * row_stride + c), "r"(ok ? 16 : 0));
        }
    }
}

__device__ __forceinline__ void att_copies_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait for every committed copy but the newest `pending` groups (0 or 1).
__device__ __forceinline__ void att_copies_wait(int pending) {
    if (pending) asm volatile("cp.async.wait_group 1;\n" ::: "memory");
    else asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

// ------------------------------------------------------------------------------------------------ forward
// Query rows a warp of the forward owns, in m-tiles of 16: 2 in the bf16 build, so that each K and V fragment
// it reads from shared memory serves 32 rows; the float builds keep 1 (their fragments take twice the
// registers), and so does head size 128 (its output accumulators alone are 64 floats an m-tile).
template <int D, class M>
struct AttForwardRows {
    static constexpr int MT = sizeof(typename M::elem_t) == 2 && D <= 64 ? 2 : 1;
};

extern __shared__ __align__(16) unsigned char att_smem[];  // the dynamic shared memory of the kernels that take it

// The forward's K and V tiles, STAGES of each: static shared memory up to the 48 KB a block has without opting
// in, dynamic past it (head size 128), BYTES of it (0 where static).
template <int D, class M>
struct AttForwardSmem {
    static constexpr int TILES = 2 * AttStages<M>::N * ATT_TILE * AttTile<D, M>::LDS * (int)sizeof(typename M::elem_t);
    static constexpr bool DYNAMIC = TILES > 48 * 1024;
    static constexpr int BYTES = DYNAMIC ? TILES : 0;
};

// out (B, T, H, D), lse (B, H, T) natural-log logsumexp of the scaled scores, from qkv (B, T, NH, D) (training
// and a full forward; decoding over the KV cache is attention_cached below). Grid (H, B, query tiles), the
// tiles with the most keys first; ATT_THREADS / MT threads a block.
template <int D, class M>
__device__ __forceinline__ void attention_forward_block(act_t* __restrict__ out, float* __restrict__ lse,
                                                        const act_t* __restrict__ qkv, int T, int H, int G,
                                                        float scale) {
    typedef typename M::elem_t elem_t;
    constexpr int LDS = AttTile<D, M>::LDS, KS = M::KS;
    constexpr int STAGES = AttStages<M>::N, MT = AttForwardRows<D, M>::MT, THREADS = ATT_THREADS / MT;
    typedef elem_t Tile[ATT_TILE * LDS];
    Tile *Kstages, *Vstages;
    if constexpr (AttForwardSmem<D, M>::DYNAMIC) {
        Kstages = reinterpret_cast<Tile*>(att_smem);
        Vstages = Kstages + STAGES;
    } else {
        __shared__ __align__(16) Tile Kbuf[STAGES], Vbuf[STAGES];
        Kstages = Kbuf;
        Vstages = Vbuf;
    }
    const int NH = H + 2 * G;
    const int h = blockIdx.x, b = blockIdx.y, qt = gridDim.z - 1 - blockIdx.z, kvh = h / (H / G);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const long long rs = (long long)NH * D;  // row stride
    const act_t* base = qkv + b * T * rs;
    int row0[MT], row1[MT];  // this thread's query rows: g and g + 8 of each m-tile
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) row0[mt] = qt * ATT_TILE + (warp * MT + mt) * 16 + g, row1[mt] = row0[mt] + 8;
    const float sl2 = scale * LOG2E;  // scores in log2 units, for exp2

    unsigned qf[MT][D / KS][4];  // the warp's query rows as A fragments
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const act_t* q0 = base + row0[mt] * rs + h * D;
        const act_t* q1 = q0 + 8 * rs;
#pragma unroll
        for (int kk = 0; kk < D / KS; ++kk)
            M::a_global(qf[mt][kk], q0 + kk * KS, q1 + kk * KS, row0[mt] < T, row1[mt] < T);
    }
    float o[MT][D / 8][4];
    float m0[MT], m1[MT], l0[MT], l1[MT];  // running max (log2 units) and sum per row
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) o[mt][dn][0] = o[mt][dn][1] = o[mt][dn][2] = o[mt][dn][3] = 0.f;
        m0[mt] = m1[mt] = neg_inf();
        l0[mt] = l1[mt] = 0.f;
    }

    const int first_pos = qt * ATT_TILE;
    const int last_pos = min(T, (qt + 1) * ATT_TILE) - 1;
    const int n_kt = last_pos / ATT_TILE + 1;
    const auto issue = [&](int kt) {
        load_tile_async<D, M, THREADS>(Kstages[kt % STAGES], base + (H + kvh) * D, kt * ATT_TILE, T, rs);
        load_tile_async<D, M, THREADS>(Vstages[kt % STAGES], base + (H + G + kvh) * D, kt * ATT_TILE, T, rs);
        att_copies_commit();
    };
    if (STAGES == 2) issue(0);
    for (int kt = 0; kt < n_kt; ++kt) {
        const int k0 = kt * ATT_TILE;
        const elem_t* Ks = Kstages[kt % STAGES];
        const elem_t* Vs = Vstages[kt % STAGES];
        __syncthreads();  // everyone is done with the tile the next copy overwrites
        if (STAGES == 1) issue(kt);
        else if (kt + 1 < n_kt) issue(kt + 1);
        att_copies_wait(STAGES == 2 && kt + 1 < n_kt);
        __syncthreads();

        float s[MT][ATT_TILE / 8][4];  // S = Q K^T for 16 rows x 64 keys, each m-tile
        unsigned pa[MT][ATT_TILE / KS][4];  // P as the A operands of P V
#pragma unroll
        for (int nt = 0; nt < ATT_TILE / 8; ++nt) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / KS; ++kk) {
                unsigned bk[2];
                M::b_cols(bk, Ks + nt * 8 * LDS + kk * KS, LDS);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) M::mma(s[mt][nt], qf[mt][kk], bk);
            }
        }
        // causal mask and the end of the keys, only on tiles that reach them
        const bool edge = k0 + ATT_TILE - 1 > first_pos || k0 + ATT_TILE > T;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float mx0 = m0[mt], mx1 = m1[mt];
#pragma unroll
            for (int nt = 0; nt < ATT_TILE / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float v = s[mt][nt][e] * sl2;
                    if (edge) {
                        const int key = k0 + nt * 8 + 2 * t + (e & 1);
                        if (key > (e < 2 ? row0[mt] : row1[mt]) || key >= T) v = neg_inf();
                    }
                    s[mt][nt][e] = v;
                    if (e < 2) mx0 = fmaxf(mx0, v);
                    else mx1 = fmaxf(mx1, v);
                }
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 2));
            // a row with every key so far masked keeps max -inf; exponentiate against 0 then (all terms are 0)
            const float ref0 = mx0 == neg_inf() ? 0.f : mx0, ref1 = mx1 == neg_inf() ? 0.f : mx1;
            const float c0 = exp2f(m0[mt] - ref0), c1 = exp2f(m1[mt] - ref1);
            m0[mt] = mx0;
            m1[mt] = mx1;
            l0[mt] *= c0;
            l1[mt] *= c1;
#pragma unroll
            for (int dn = 0; dn < D / 8; ++dn) {
                o[mt][dn][0] *= c0;
                o[mt][dn][1] *= c0;
                o[mt][dn][2] *= c1;
                o[mt][dn][3] *= c1;
            }
#pragma unroll
            for (int nt = 0; nt < ATT_TILE / 8; ++nt) {
                s[mt][nt][0] = exp2f(s[mt][nt][0] - ref0);
                s[mt][nt][1] = exp2f(s[mt][nt][1] - ref0);
                s[mt][nt][2] = exp2f(s[mt][nt][2] - ref1);
                s[mt][nt][3] = exp2f(s[mt][nt][3] - ref1);
                l0[mt] += s[mt][nt][0] + s[mt][nt][1];  // the sum of the unrounded P; P V uses its operand rounding
                l1[mt] += s[mt][nt][2] + s[mt][nt][3];
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][nt][e] = M::operand(s[mt][nt][e]);
            }
#pragma unroll
            for (int ks = 0; ks < ATT_TILE / KS; ++ks) M::a_acc(pa[mt][ks], s[mt], ks);  // bf16: half the registers
        }
        // O += P V: P's accumulator fragments are the A operand
#pragma unroll
        for (int ks = 0; ks < ATT_TILE / KS; ++ks) {
#pragma unroll
            for (int dn = 0; dn < D / 8; ++dn) {
                unsigned bv[2];
                M::b_rows(bv, Vs + ks * KS * LDS + dn * 8, LDS);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) M::mma(o[mt][dn], pa[mt][ks], bv);
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int e0 = 0; e0 < 4; e0 += 2) {  // row g (accumulator elements 0, 1), then g + 8 (2, 3)
            const int row = e0 ? row1[mt] : row0[mt];
            float l = e0 ? l1[mt] : l0[mt];
            l += __shfl_xor_sync(FULL_MASK, l, 1);
            l += __shfl_xor_sync(FULL_MASK, l, 2);
            if (row >= T) continue;
            att_store_row<D>(out + (((long long)b * T + row) * H + h) * D + 2 * t, o[mt], e0, 1.f / l, nullptr,
                             nullptr, 0);
            if (t == 0) lse[((long long)b * H + h) * T + row] = ((e0 ? m1[mt] : m0[mt]) + log2f(l)) * LN2;
        }
    }
}

#define ATTENTION_FORWARD(D)                                                                                 \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                               \
        attention_forward_d##D(act_t* out, float* lse, const act_t* qkv, int T, int H, int G, float scale) { \
        attention_forward_block<D, AttMma>(out, lse, qkv, T, H, G, scale);                                  \
    }
ATTENTION_FORWARD(128)
ATTENTION_FORWARD(64)
ATTENTION_FORWARD(32)

// ----------------------------------------------------------------------------------------------- backward
// Deterministic: no atomics. The FlashAttention-2 recurrence, p_ij = exp(s_ij - lse_i), dp_ij = dout_i . v_j,
// ds_ij = p_ij (dp_ij - delta_i), is evaluated twice, once by blocks that own keys (dK, dV) and once by blocks
// that own queries (dQ), so that each gradient row is summed in one thread's registers in a fixed order and
// written once: results are bitwise identical from run to run. The price is two more products per tile (S
// and dP are computed by both kernels, 7 products per tile pair instead of 5); dqkv needs no zeroing. Launch
// order: delta, then the other two in any order (they write disjoint heads of dqkv, every element once).

// delta (B, H, T) = rowsum(dout * out), one warp per (b, t, h) row; the FlashAttention-2 preprocessing step.
extern "C" __global__ void attention_backward_delta(float* __restrict__ delta, const act_t* __restrict__ dout,
                                                    const act_t* __restrict__ out, int B, int T, int H, int D) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= (long long)B * T * H) return;
    float s = 0.f;
    for (int d = lane; d < D; d += 32) s += to_float(dout[row * D + d]) * to_float(out[row * D + d]);
    s = warp_sum(s);
    const int h = (int)(row % H);
    const long long bt = row / H;
    if (lane == 0) delta[(bt / T * H + h) * T + bt % T] = s;
}

// The backward's streamed tiles: double-buffered where bf16 (AttStages), except head size 128 on the GPUs whose
// blocks take less than 163 KB of shared memory (sm_86, sm_89, sm_120: 99 KB), where 2 stages (103 KB) don't fit.
template <int D, class M>
struct AttBackwardStages {
#if __CUDA_ARCH__ == 800 || __CUDA_ARCH__ == 870 || (__CUDA_ARCH__ >= 900 && __CUDA_ARCH__ < 1200)
    static constexpr int N = AttStages<M>::N;
#else
    static constexpr int N = D > 64 ? 1 : AttStages<M>::N;
#endif
};

// The backward kernels' dynamic shared memory, bytes: 2 tiles resident and 2 streamed STAGES deep, (ATT_TILE,
// LDS) elements each, and for dK/dV the streamed query tiles' lse and delta.
template <int D, class M>
struct AttBackwardSmem {
    static constexpr int STAGES = AttBackwardStages<D, M>::N;
    static constexpr int TILES = (2 + 2 * STAGES) * ATT_TILE * AttTile<D, M>::LDS * (int)sizeof(typename M::elem_t);
    static constexpr int DKDV = TILES + STAGES * 2 * ATT_TILE * (int)sizeof(float);
    static constexpr int DQ = TILES;
};

// The two backward kernels rebuild P and dS the same way, over a warp's 16 rows x 64 columns of a tile pair
// (dK/dV's: keys x queries, S^T and dP^T; dQ's: queries x keys, S and dP). att_scores: s = A_s B_s^T and
// ds = A_d B_d^T, the warp's rows of A_s, A_d the A operands, read once per k step for all eight column tiles.
template <int D, class M>
__device__ __forceinline__ void att_scores(float (&s)[ATT_TILE / 8][4], float (&ds)[ATT_TILE / 8][4],
                                           const typename M::elem_t* As, const typename M::elem_t* Ad,
                                           const typename M::elem_t* Bs, const typename M::elem_t* Bd, int warp) {
    constexpr int LDS = AttTile<D, M>::LDS, KS = M::KS;
#pragma unroll
    for (int nt = 0; nt < ATT_TILE / 8; ++nt)
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = ds[nt][0] = ds[nt][1] = ds[nt][2] = ds[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / KS; ++kk) {
        unsigned as[4], ad[4];
        M::a_rows(as, As + warp * 16 * LDS + kk * KS, LDS);
        M::a_rows(ad, Ad + warp * 16 * LDS + kk * KS, LDS);
#pragma unroll
        for (int nt = 0; nt < ATT_TILE / 8; ++nt) {
            unsigned bs[2], bd[2];
            M::b_cols(bs, Bs + nt * 8 * LDS + kk * KS, LDS);
            M::b_cols(bd, Bd + nt * 8 * LDS + kk * KS, LDS);
            M::mma(s[nt], as, bs);
            M::mma(ds[nt], ad, bd);
        }
    }
}

// Then P = exp(S - lse) and dS = P (dP - delta) in place of s and ds (P as an operand, kept in s where
// KEEP_P). Accumulator element e of column tile nt is column c = 8 nt + 2 t + (e & 1) of the thread's row
// (g, or g + 8 where e >= 2): lse(c, e), masked(c, e) and delta(c, e) give its lse in log2 units, whether the
// causal mask zeroes it, and its delta.
template <class M, bool KEEP_P, class Lse, class Masked, class Delta>
__device__ __forceinline__ void att_p_ds(float (&s)[ATT_TILE / 8][4], float (&ds)[ATT_TILE / 8][4], float sl2,
                                         int t, Lse lse, Masked masked, Delta delta) {
#pragma unroll
    for (int nt = 0; nt < ATT_TILE / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int c = nt * 8 + 2 * t + (e & 1);
            float pv = exp2f(s[nt][e] * sl2 - lse(c, e));
            if (masked(c, e)) pv = 0.f;
            ds[nt][e] = M::operand(pv * (ds[nt][e] - delta(c, e)));
            if (KEEP_P) s[nt][e] = M::operand(pv);
        }
    }
}

// The parameters both backward kernels' blocks take (the kernels below pass theirs on).
#define ATT_BACKWARD_PARAMS                                                                                     \
    act_t *__restrict__ dqkv, const act_t *__restrict__ dout, const float *__restrict__ lse,                   \
        const float *__restrict__ delta, const act_t *__restrict__ qkv, int T, int H, int G, float scale,      \
        const float *__restrict__ cos_t, const float *__restrict__ sin_t

// dK, dV. One block per (kv head, batch, 64-key tile): grid (G, B, key tiles), 128 threads. Key tile 0 has
// the most query tiles after it, so blockIdx.z is the key tile as it is (the first blocks scheduled are the
// longest). The block keeps its keys' dK and dV in registers while it walks the group's H / G query heads
// and, for each, the query tiles at and after the diagonal; warp w owns keys 16w .. 16w + 15, so S and dP
// come out transposed (keys x queries) and P^T, dS^T are the A operands of dV += P^T dO, dK += dS^T Q.
// Writes the k and v heads of dqkv (B, T, NH, D), each row once (dK through att_store_row: with cos_t, of the
// unrotated k). lse natural-log, delta from the kernel above.
template <int D, class M>
__device__ __forceinline__ void attention_backward_dkdv_block(ATT_BACKWARD_PARAMS) {
    // dynamic shared memory: AttBackwardSmem<D, M>::DKDV bytes
    typedef typename M::elem_t elem_t;
    constexpr int LDS = AttTile<D, M>::LDS, KS = M::KS, STAGES = AttBackwardStages<D, M>::N;
    elem_t* Ks = reinterpret_cast<elem_t*>(att_smem);  // (64 keys, D)
    elem_t* Vs = Ks + ATT_TILE * LDS;                  // (64 keys, D)
    elem_t* Qbuf = Vs + ATT_TILE * LDS;                // STAGES x (64 queries, D)
    elem_t* dObuf = Qbuf + STAGES * ATT_TILE * LDS;    // STAGES x (64 queries, D)
    // STAGES x (64,) each: lse and delta as stored, 0 past T (there q and dO are 0 too, so P^T dO and dS^T Q
    // get exact zeros from those queries)
    float* lse_buf = reinterpret_cast<float*>(dObuf + STAGES * ATT_TILE * LDS);
    float* delta_buf = lse_buf + STAGES * ATT_TILE;

    const int NH = H + 2 * G, group = H / G;
    const int kvh = blockIdx.x, b = blockIdx.y, kt = blockIdx.z, k0 = kt * ATT_TILE;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const long long rs = (long long)NH * D;
    const act_t* base = qkv + (long long)b * T * rs;
    const float sl2 = scale * LOG2E;

    load_tile<D, M>(Ks, base + (H + kvh) * D, k0, T, rs);
    load_tile<D, M>(Vs, base + (H + G + kvh) * D, k0, T, rs);
    const int key0 = k0 + warp * 16 + g, key1 = key0 + 8;  // this thread's keys
    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
        dk[dn][0] = dk[dn][1] = dk[dn][2] = dk[dn][3] = 0.f;
        dv[dn][0] = dv[dn][1] = dv[dn][2] = dv[dn][3] = 0.f;
    }

    // one flat loop over the (query head, query tile) pairs: with nested loops more state stays live across
    // iterations, and ptxas spilled at D = 32 (sm_90)
    const int n_q = (T + ATT_TILE - 1) / ATT_TILE - kt;  // query tiles kt .. last
    const auto issue = [&](int it) {
        const int h = kvh * group + it / n_q, q0 = (kt + it % n_q) * ATT_TILE, stage = it % STAGES;
        const long long bh = (long long)b * H + h;
        load_tile_async<D, M>(Qbuf + stage * ATT_TILE * LDS, base + h * D, q0, T, rs);
        load_tile_async<D, M>(dObuf + stage * ATT_TILE * LDS, dout + ((long long)b * T * H + h) * D, q0, T,
                              (long long)H * D);
        for (int i = threadIdx.x; i < ATT_TILE; i += ATT_THREADS) {
            const bool ok = q0 + i < T;
            float* l = lse_buf + stage * ATT_TILE + i;
            float* d = delta_buf + stage * ATT_TILE + i;
            if (STAGES == 2) {
                const long long at = ok ? bh * T + q0 + i : 0;
                asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                                 (unsigned)__cvta_generic_to_shared(l)), "l"(lse + at), "r"(ok ? 4 : 0));
                asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                                 (unsigned)__cvta_generic_to_shared(d)), "l"(delta + at), "r"(ok ? 4 : 0));
            } else {
                *l = ok ? lse[bh * T + q0 + i] : 0.f;
                *d = ok ? delta[bh * T + q0 + i] : 0.f;
            }
        }
        att_copies_commit();
    };
    const int n_it = group * n_q;
    if (STAGES == 2) issue(0);
    for (int it = 0; it < n_it; ++it) {
        const int qt = kt + it % n_q, q0 = qt * ATT_TILE, stage = it % STAGES;
        const elem_t* Qs = Qbuf + stage * ATT_TILE * LDS;
        const elem_t* dOs = dObuf + stage * ATT_TILE * LDS;
        const float* lse_s = lse_buf + stage * ATT_TILE;
        const float* delta_s = delta_buf + stage * ATT_TILE;
        __syncthreads();  // everyone is done with the buffers the next copy overwrites (first: Ks, Vs in place)
        if (STAGES == 1) issue(it);
        else if (it + 1 < n_it) issue(it + 1);
        att_copies_wait(STAGES == 2 && it + 1 < n_it);
        __syncthreads();

        // S^T = K Q^T and dP^T = V dO^T, 16 keys x 64 queries per warp
        float p[ATT_TILE / 8][4], ds[ATT_TILE / 8][4];
        att_scores<D, M>(p, ds, Ks, Vs, Qs, dOs, warp);
        // P^T = exp(S^T - lse), causal mask on the diagonal tile; dS^T = P^T (dP^T - delta)
        const bool diag = qt == kt;
        att_p_ds<M, true>(
            p, ds, sl2, t, [&](int q, int) { return __fmul_rn(lse_s[q], LOG2E); },
            [&](int q, int e) { return diag && (e < 2 ? key0 : key1) > q0 + q; },
            [&](int q, int) { return delta_s[q]; });
        // dV += P^T dO and dK += dS^T Q: the query index is the k index
#pragma unroll
        for (int ks = 0; ks < ATT_TILE / KS; ++ks) {
            unsigned pa[4], sa[4];
            M::a_acc(pa, p, ks);
            M::a_acc(sa, ds, ks);
#pragma unroll
            for (int dn = 0; dn < D / 8; ++dn) {
                unsigned bd[2], bq[2];
                M::b_rows(bd, dOs + ks * KS * LDS + dn * 8, LDS);
                M::b_rows(bq, Qs + ks * KS * LDS + dn * 8, LDS);
                M::mma(dv[dn], pa, bd);
                M::mma(dk[dn], sa, bq);
            }
        }
    }
    act_t* dbase = dqkv + (long long)b * T * rs;
    if (key0 < T) {
        att_store_row<D>(dbase + key0 * rs + (H + kvh) * D + 2 * t, dk, 0, scale, cos_t, sin_t, key0);
        att_store_row<D>(dbase + key0 * rs + (H + G + kvh) * D + 2 * t, dv, 0, 1.f, nullptr, nullptr, 0);
    }
    if (key1 < T) {
        att_store_row<D>(dbase + key1 * rs + (H + kvh) * D + 2 * t, dk, 2, scale, cos_t, sin_t, key1);
        att_store_row<D>(dbase + key1 * rs + (H + G + kvh) * D + 2 * t, dv, 2, 1.f, nullptr, nullptr, 0);
    }
}

// dQ. One block per (query head, batch, 64-query tile): grid (H, B, query tiles), 128 threads, the tiles
// with the most keys first, as in the forward. Warp w owns queries 16w .. 16w + 15, with their lse and delta
// in registers. The block's Q and dO tiles stay in shared memory for the whole loop (as fragments in
// registers they would cost 8 D / KS more registers a thread, and the 3xTF32 build would spill); for each
// key tile 0 .. diagonal: S = Q K^T, dP = dO V^T, P = exp(S - lse) (causal mask on the diagonal),
// dS = P (dP - delta), and dQ += dS K with dS straight from the accumulators. dQ * scale is written once into
// the q head of dqkv (att_store_row: with cos_t, the gradient of the unrotated q).
template <int D, class M>
__device__ __forceinline__ void attention_backward_dq_block(ATT_BACKWARD_PARAMS) {
    // dynamic shared memory: AttBackwardSmem<D, M>::DQ bytes
    typedef typename M::elem_t elem_t;
    constexpr int LDS = AttTile<D, M>::LDS, KS = M::KS;
    constexpr int STAGES = AttBackwardStages<D, M>::N;
    elem_t* Qs = reinterpret_cast<elem_t*>(att_smem);  // (64 queries, D)
    elem_t* dOs = Qs + ATT_TILE * LDS;                 // (64 queries, D)
    elem_t* Kbuf = dOs + ATT_TILE * LDS;               // STAGES x (64 keys, D)
    elem_t* Vbuf = Kbuf + STAGES * ATT_TILE * LDS;     // STAGES x (64 keys, D)

    const int NH = H + 2 * G;
    const int h = blockIdx.x, b = blockIdx.y, qt = gridDim.z - 1 - blockIdx.z, kvh = h / (H / G);
    const int q0 = qt * ATT_TILE;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const long long rs = (long long)NH * D;
    const act_t* base = qkv + (long long)b * T * rs;
    const float sl2 = scale * LOG2E;
    const int row0 = q0 + warp * 16 + g, row1 = row0 + 8;  // this thread's queries

    load_tile<D, M>(Qs, base + h * D, q0, T, rs);
    load_tile<D, M>(dOs, dout + ((long long)b * T * H + h) * D, q0, T, (long long)H * D);
    // lse in log2 units, +inf past T so p = 0 there
    const float* lse_h = lse + ((long long)b * H + h) * T;
    const float* delta_h = delta + ((long long)b * H + h) * T;
    const float lse0 = row0 < T ? lse_h[row0] * LOG2E : pos_inf(), lse1 = row1 < T ? lse_h[row1] * LOG2E : pos_inf();
    const float dl0 = row0 < T ? delta_h[row0] : 0.f, dl1 = row1 < T ? delta_h[row1] : 0.f;
    float dq[D / 8][4];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) dq[dn][0] = dq[dn][1] = dq[dn][2] = dq[dn][3] = 0.f;

    const auto issue = [&](int kt) {
        load_tile_async<D, M>(Kbuf + kt % STAGES * ATT_TILE * LDS, base + (H + kvh) * D, kt * ATT_TILE, T, rs);
        load_tile_async<D, M>(Vbuf + kt % STAGES * ATT_TILE * LDS, base + (H + G + kvh) * D, kt * ATT_TILE, T, rs);
        att_copies_commit();
    };
    if (STAGES == 2) issue(0);
    for (int kt = 0; kt <= qt; ++kt) {
        const int k0 = kt * ATT_TILE;
        const elem_t* Ks = Kbuf + kt % STAGES * ATT_TILE * LDS;
        const elem_t* Vs = Vbuf + kt % STAGES * ATT_TILE * LDS;
        __syncthreads();  // everyone is done with the tile the next copy overwrites (first: Qs, dOs in place)
        if (STAGES == 1) issue(kt);
        else if (kt + 1 <= qt) issue(kt + 1);
        att_copies_wait(STAGES == 2 && kt + 1 <= qt);
        __syncthreads();

        // S = Q K^T and dP = dO V^T, 16 queries x 64 keys per warp
        float s[ATT_TILE / 8][4], ds[ATT_TILE / 8][4];
        att_scores<D, M>(s, ds, Qs, dOs, Ks, Vs, warp);
        // P = exp(S - lse), causal mask on the diagonal tile (keys past T are past every query there);
        // dS = P (dP - delta)
        const bool diag = kt == qt;
        att_p_ds<M, false>(
            s, ds, sl2, t, [&](int, int e) { return e < 2 ? lse0 : lse1; },
            [&](int key, int e) { return diag && k0 + key > (e < 2 ? row0 : row1); },
            [&](int, int e) { return e < 2 ? dl0 : dl1; });
        // dQ += dS K: the key index is the k index, K's rows read as b_rows numbers them
#pragma unroll
        for (int ks = 0; ks < ATT_TILE / KS; ++ks) {
            unsigned sa[4];
            M::a_acc(sa, ds, ks);
#pragma unroll
            for (int dn = 0; dn < D / 8; ++dn) {
                unsigned bk[2];
                M::b_rows(bk, Ks + ks * KS * LDS + dn * 8, LDS);
                M::mma(dq[dn], sa, bk);
            }
        }
    }
    act_t* dbase = dqkv + (long long)b * T * rs;
    if (row0 < T) att_store_row<D>(dbase + row0 * rs + h * D + 2 * t, dq, 0, scale, cos_t, sin_t, row0);
    if (row1 < T) att_store_row<D>(dbase + row1 * rs + h * D + 2 * t, dq, 2, scale, cos_t, sin_t, row1);
}

#define ATTENTION_BACKWARD(D)                                                                                \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, ATT_BACKWARD_BLOCKS(D))                           \
        attention_backward_dkdv_d##D(act_t* dqkv, const act_t* dout, const float* lse, const float* delta,  \
                                     const act_t* qkv, int T, int H, int G, float scale, const float* cos_t, \
                                     const float* sin_t) {                                                  \
        attention_backward_dkdv_block<D, AttMma>(dqkv, dout, lse, delta, qkv, T, H, G, scale, cos_t, sin_t); \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, ATT_BACKWARD_BLOCKS(D))                           \
        attention_backward_dq_d##D(act_t* dqkv, const act_t* dout, const float* lse, const float* delta,    \
                                   const act_t* qkv, int T, int H, int G, float scale, const float* cos_t,   \
                                   const float* sin_t) {                                                    \
        attention_backward_dq_block<D, AttMma>(dqkv, dout, lse, delta, qkv, T, H, G, scale, cos_t, sin_t);  \
    }
ATTENTION_BACKWARD(128)
ATTENTION_BACKWARD(64)
ATTENTION_BACKWARD(32)

// The launch shapes layers.py reads back rather than re-derive: the forward's threads a block, then the dK/dV
// and the dQ kernels' dynamic shared memory in bytes, then the forward's (0: static).
#define ATTENTION_LAUNCH(D)                                                                                \
    extern "C" {                                                                                           \
    __constant__ int attention_launch_d##D[4] = {ATT_THREADS / AttForwardRows<D, AttMma>::MT,              \
                                                 AttBackwardSmem<D, AttMma>::DKDV,                         \
                                                 AttBackwardSmem<D, AttMma>::DQ,                           \
                                                 AttForwardSmem<D, AttMma>::BYTES};                        \
    }
ATTENTION_LAUNCH(128)
ATTENTION_LAUNCH(64)
ATTENTION_LAUNCH(32)

// ----------------------------------------------------------------------------------------------- decoding
// The KV cache (rows, S, 2G, D) holds the rotated k heads, then the v heads, of every position decoded so far
// (S the context); sequence b's are row slots[b] (b where slots is null: a batched step's sequences sit in any
// rows). The position p of sequence b's first new row, pos[b] (pos_stride 1: each its own) or pos[0] (0: one
// for all), is read from device memory, never passed as an argument, so that a decoding step recorded once as
// a CUDA graph replays at every position.

// Attention of the n new query rows of qkv (B, n, H + 2G, D), q and k heads rotated already (the qkv product
// did it), at positions p + t, to positions 0..p + t: the cache's rows before p, and the new rows' keys and
// values, read from qkv (so no block waits for another to store them). out (B, n, H, D), lse (B, H, n).
//
// Bound by the latency of its loads (a few rows against a few hundred keys), not by arithmetic. Block
// (h, b * n + t) takes query row t of sequence b, head h (or, for many rows, block (kv head, b * n + t) takes
// the kv head's query heads, which then share each key's and value's load: a third of the bytes for `base`);
// its ATT_WARPS (virtual) warps split the keys in chunks of 32, chunk c to warp c % ATT_WARPS, a key a lane:
// the lane loads its key's row and the chunk's value rows of its
// dims (all at once, into registers), scores the query against its key, and the warp keeps running softmax
// statistics and output over its chunks (flash-decoding); the warps' results then meet in shared memory,
// merged in warp order. Every sum runs in an order fixed by the key positions alone, so a row gets the same
// bits decoded alone or with others (a block a row: docs/gpu-engine.md says why). The blocks of the first
// query head of each kv group (every block, for many rows) append their row's new k and v to the cache.
#define ATT_CHUNK 32
// A block's most threads: head size 128 holds fewer warps, each with up to 255 registers for its wider rows
#define ATT_CACHED_THREADS(D) (32 * ((D) > 64 ? ATT_WARPS_D128 : ATT_WARPS))

// DL consecutive elements of a value row (a lane's dims of the output), kept as loaded: two bf16 in one
// register, or floats.
template <int DL>
struct ValueSlice {
#if ACT_BF16
    unsigned bits;  // the element at the lower address in the low half
    __device__ __forceinline__ void load(const act_t* p) {
        bits = DL == 2 ? *reinterpret_cast<const unsigned*>(p) : (unsigned)p->bits;
    }
    __device__ __forceinline__ void zero() { bits = 0u; }
    __device__ __forceinline__ float get(int i) const { return __uint_as_float(i == 0 ? bits << 16 : bits & 0xffff0000u); }
#else
    float f[DL];
    __device__ __forceinline__ void load(const act_t* p) {
#pragma unroll
        for (int i = 0; i < DL; ++i) f[i] = p[i];
    }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < DL; ++i) f[i] = 0.f;
    }
    __device__ __forceinline__ float get(int i) const { return f[i]; }
#endif
};
#if ACT_BF16
// Head size 128: four bf16 in two registers, one 8-byte load.
template <>
struct ValueSlice<4> {
    unsigned bits[2];  // elements 0, 1 and 2, 3, the lower address in the low half
    __device__ __forceinline__ void load(const act_t* p) {
        const uint2 u = *reinterpret_cast<const uint2*>(p);
        bits[0] = u.x, bits[1] = u.y;
    }
    __device__ __forceinline__ void zero() { bits[0] = bits[1] = 0u; }
    __device__ __forceinline__ float get(int i) const {
        return __uint_as_float(i & 1 ? bits[i >> 1] & 0xffff0000u : bits[i >> 1] << 16);
    }
};
#endif

// QH query heads a block: 1 (block (h, row)), or the H / G heads of kv head blockIdx.x (at most QH), which
// then share each key and value load. A head's arithmetic is the same either way.
template <int D, int QH>
__device__ __forceinline__ void attention_cached_block(act_t* __restrict__ out, float* __restrict__ lse,
                                                       const act_t* __restrict__ qkv, act_t* __restrict__ cache,
                                                       const int* __restrict__ pos, int pos_stride,
                                                       const int* __restrict__ slots, int n, int S, int H, int G,
                                                       float scale) {
    constexpr int DL = D / 32, KP = D / PACK;  // output dims a lane, 16-byte loads a key
    __shared__ float q_s[QH][D];
    __shared__ float part_s[ATT_WARPS][QH][D + 2];  // each warp's (output, max, sum) of each head
    const int group = H / G, heads = QH == 1 ? 1 : group;  // this block's query heads: h0, h0 + 1, ...
    const int h0 = QH == 1 ? blockIdx.x : blockIdx.x * group, b = blockIdx.y / n, t = blockIdx.y % n;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long NHD = (long long)(H + 2 * G) * D;
    let_next_launch();
    // sequence b's position (its own, or the one of all) and cache row (its slot, or b): no kernel of the step
    // writes either
    const int p0 = pos[b * pos_stride], kvh = h0 / group, E = 2 * G * D, last_key = p0 + t;
    act_t* cbase = cache + (long long)(slots ? slots[b] : b) * S * E + kvh * D;
    const act_t* nbase = qkv + (long long)b * n * NHD + H * D + kvh * D;  // row 0 of the new k heads
    // A chunk's keys and values: the lane's key, and the chunk's values of the lane's dims (DL from lane * DL).
    // `cached`: the cache's rows, positions before p0 (no kernel of the step writes them, so the warp's first
    // chunk loads before the wait, its latency hidden behind the kernels before), zeros from p0 on; else the
    // step's new rows p0..last_key, read from qkv, over those zeros. Zeros past the row's keys (never
    // weighted, but 0 * garbage could be NaN).
    uint4 kr[KP];
    ValueSlice<DL> v[ATT_CHUNK];
    const auto load_chunk = [&](int j0, bool cached) {
        const int key = j0 + lane;
        if (cached ? key < p0 : key >= p0 && key <= last_key) {
            const uint4* krow = reinterpret_cast<const uint4*>(cached ? cbase + (long long)key * E
                                                                      : nbase + (key - p0) * NHD);
#pragma unroll
            for (int p = 0; p < KP; ++p) kr[p] = krow[p];
        } else if (cached) {
#pragma unroll
            for (int p = 0; p < KP; ++p) kr[p] = make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int j = 0; j < ATT_CHUNK; ++j) {
            const int kj = j0 + j;
            if (cached ? kj < p0 : kj >= p0 && kj <= last_key)
                v[j].load((cached ? cbase + (long long)kj * E : nbase + (kj - p0) * NHD) + G * D + lane * DL);
            else if (cached) v[j].zero();
        }
    };
    const int warps = blockDim.x >> 5, first_chunk = warp * ATT_CHUNK;  // the warp's first: its first virtual warp's
    if (first_chunk <= last_key) load_chunk(first_chunk, true);
    wait_for_inputs();
    if (first_chunk <= last_key) load_chunk(first_chunk, false);  // in flight with the query's loads
    if (warp == 0) {  // the query rows, scaled
        for (int i = 0; i < heads; ++i) {
            const act_t* qrow = qkv + ((long long)b * n + t) * NHD + (h0 + i) * D;
            for (int d = lane; d < D; d += 32) q_s[i][d] = to_float(qrow[d]) * scale;
        }
    }
    if (h0 % group == 0 && warp == 1) {  // the row's new k and v into the cache
        const uint4* src = reinterpret_cast<const uint4*>(nbase + t * NHD);
        uint4* dst = reinterpret_cast<uint4*>(cbase + (long long)(p0 + t) * E);
        if (lane < KP) dst[lane] = src[lane], dst[lane + G * KP] = src[lane + G * KP];  // k; v G heads on
    }
    __syncthreads();
    // A warp takes virtual warps warp, warp + warps, ...: chunk c is virtual warp c % ATT_WARPS's, each keeps its
    // own statistics, and they are merged in their order, so a row's bits are the same for any warps a block
    // (all ATT_WARPS for a few rows: the latency of one; fewer for many: more blocks resident; layers.py).
    // Virtual warps past the row's last key hold no chunk: neither run nor merged.
    const int holding = min(ATT_WARPS, last_key / ATT_CHUNK + 1);  // the virtual warps that hold keys
    for (int vw = warp; vw < holding; vw += warps) {
        float M[QH], L[QH], O[QH][DL];  // this virtual warp's running statistics and output, a head each
#pragma unroll
        for (int i = 0; i < QH; ++i) {
            M[i] = neg_inf(), L[i] = 0.f;
#pragma unroll
            for (int d = 0; d < DL; ++d) O[i][d] = 0.f;
        }
        for (int j0 = vw * ATT_CHUNK; j0 <= last_key; j0 += ATT_WARPS * ATT_CHUNK) {
            if (j0 != first_chunk) load_chunk(j0, true), load_chunk(j0, false);
            const bool seen = j0 + lane <= last_key;
#pragma unroll
            for (int i = 0; i < QH; ++i) {
                if (i >= heads) break;
                float s = 0.f;
#pragma unroll
                for (int p = 0; p < KP; ++p) {
                    float kf[PACK];
                    unpack16(kf, kr[p]);
#pragma unroll
                    for (int e = 0; e < PACK; ++e) s += q_s[i][p * PACK + e] * kf[e];
                }
                s = seen ? s : neg_inf();
                const float m = warp_max(s), pr = seen ? expf(s - m) : 0.f, l = warp_sum(pr);
                float o[DL];
#pragma unroll
                for (int d = 0; d < DL; ++d) o[d] = 0.f;
#pragma unroll
                for (int j = 0; j < ATT_CHUNK; ++j) {
                    const float pj = __shfl_sync(FULL_MASK, pr, j);
#pragma unroll
                    for (int d = 0; d < DL; ++d) o[d] += pj * v[j].get(d);
                }
                // into the running statistics (with one chunk a warp, as for contexts up to 512, exactly)
                const float Mn = fmaxf(M[i], m), a = expf(M[i] - Mn), c = expf(m - Mn);
                L[i] = L[i] * a + l * c;
#pragma unroll
                for (int d = 0; d < DL; ++d) O[i][d] = O[i][d] * a + o[d] * c;
                M[i] = Mn;
            }
        }
#pragma unroll
        for (int i = 0; i < QH; ++i) {
            if (i >= heads) break;
#pragma unroll
            for (int d = 0; d < DL; ++d) part_s[vw][i][lane * DL + d] = O[i][d];
            if (lane == 0) part_s[vw][i][D] = M[i], part_s[vw][i][D + 1] = L[i];
        }
    }
    __syncthreads();
    // each head's virtual warps' results merged in their order, a warp a head
    for (int i = warp; i < heads; i += warps) {
        const int h = h0 + i;
        float Mx = neg_inf();
        for (int w = 0; w < holding; ++w) Mx = fmaxf(Mx, part_s[w][i][D]);
        float Ls = 0.f, o[DL];
#pragma unroll
        for (int d = 0; d < DL; ++d) o[d] = 0.f;
        for (int w = 0; w < holding; ++w) {
            const float m = part_s[w][i][D];
            const float c = expf(m - Mx);
            Ls += part_s[w][i][D + 1] * c;
#pragma unroll
            for (int d = 0; d < DL; ++d) o[d] += part_s[w][i][lane * DL + d] * c;
        }
#pragma unroll
        for (int d = 0; d < DL; ++d)
            out[(((long long)b * n + t) * H + h) * D + lane * DL + d] = from_float<act_t>(o[d] / Ls);
        if (lane == 0) lse[((long long)b * H + h) * n + t] = Mx + logf(Ls);
    }
}

// Grid (H, B * n) (attention_cached_d<D>: a block a query head and row, at most ATT_WARPS warps, ATT_WARPS_D128
// at head size 128) or (G, B * n) (attention_cached_group_d<D>: a block a kv head's H / G <= ATT_CACHED_GROUP
// query heads and a row, of ATT_CACHED_WARPS_MANY warps; not at head size 128, where ptxas spills it).
#define ATTENTION_CACHED(D)                                                                                  \
    extern "C" __global__ void __launch_bounds__(ATT_CACHED_THREADS(D))                                       \
        attention_cached_d##D(act_t* out, float* lse, const act_t* qkv, act_t* cache, const int* pos,         \
                              int pos_stride, const int* slots, int n, int S, int H, int G, float scale) {    \
        attention_cached_block<D, 1>(out, lse, qkv, cache, pos, pos_stride, slots, n, S, H, G, scale);       \
    }
#define ATTENTION_CACHED_GROUP(D)                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * ATT_CACHED_WARPS_MANY)                                  \
        attention_cached_group_d##D(act_t* out, float* lse, const act_t* qkv, act_t* cache, const int* pos,   \
                                    int pos_stride, const int* slots, int n, int S, int H, int G, float scale) { \
        attention_cached_block<D, ATT_CACHED_GROUP>(out, lse, qkv, cache, pos, pos_stride, slots, n, S, H, G, \
                                                    scale);                                                  \
    }
ATTENTION_CACHED(128)
ATTENTION_CACHED(64)
ATTENTION_CACHED_GROUP(64)
ATTENTION_CACHED(32)
ATTENTION_CACHED_GROUP(32)
