// Products of a few rows for decoding: out (N, O) = x (N, I) @ w (O, I)^T, N <= FEW_ROWS, on the tensor cores
// (x's rows are the A operand's 16 rows, in tiles of 16, 8 rows of w the B operand). Every output element is its
// own dot product, summed in an order that depends on I alone, whatever N is and wherever the row sits: a
// batch's sequences and a speculative step's rows get the bits of a step of their own (batch invariance).
// out is act_t or float32 (the logits); with accumulate the product is added to it. Folded in: RMSNorm with a
// gain g, as rstd * (x @ act_t(w * g)^T) (bf16: x's sums of squares on the tensor cores too); and with half > 0,
// w's rows paired (i, i + half) for SwiGLU (glu_out) or the rotary embedding (rope), with a bias (O,) added to
// the product before the rotation where given (Qwen2's q|k|v biases). 9 to 64 rows of a large product take
// matmul_rows_t*, which stages x's rows in shared memory for many tiles of w, with the same sums and epilogue
// (finish_item); 9 to 64 rows of a product with too few tiles of w to fill the GPU take matmul_split_t*, the same
// blocks over groups of a row's virtual warps, whose sums matmul_split_finish adds in their order.
// docs/gpu-engine.md and docs/decoding.md have the design and its measurements.
#include "common.cuh"

#if !defined(FEW_ROWS) || !defined(MATMUL_SMALL_WARPS) || !defined(MATMUL_SMALL_LOADS) || !defined(MATMUL_PAIR) || \
    !defined(MATMUL_PAIR_WARPS) || !defined(MATMUL_ROWS_WARPS) || !defined(MATMUL_ROWS_NT) ||                   \
    !defined(MATMUL_ROWS_STAGES) || !defined(MATMUL_ROWS_XSPLIT) || !defined(MATMUL_SPLIT_BLOCKS) ||             \
    !defined(MATMUL_SPLIT_WARPS) || !defined(MATMUL_SPLIT_NT) || !defined(MATMUL_FINISH_THREADS)
#error "FEW_ROWS, MATMUL_SMALL_*, MATMUL_PAIR*, MATMUL_ROWS_*, MATMUL_SPLIT_*, MATMUL_FINISH_* come from constants.py"
#endif
static_assert(FEW_ROWS <= 64, "x's rows are at most 4 tiles of the mma fragments' 16 rows");

__device__ __forceinline__ float load_out(const void* out, long long at, int out_f32) {
    return out_f32 ? static_cast<const float*>(out)[at] : to_float(static_cast<const act_t*>(out)[at]);
}

__device__ __forceinline__ void store_out(void* out, long long at, float v, int out_f32) {
    if (out_f32) static_cast<float*>(out)[at] = v;
    else static_cast<act_t*>(out)[at] = from_float<act_t>(v);
}

// acc (x's rows g, g + 8 of a tile x w's rows 2t, 2t + 1) += the products of a thread's 16 bytes of x's rows
// g (a) and g + 8 (a8) and of w's row g (b): two k-steps, the first two 32-bit words in the first.
__device__ __forceinline__ void mma_chunk(float (&acc)[4], uint4 a, uint4 a8, uint4 b) {
    const unsigned av[4] = {a.x, a.y, a.z, a.w}, av8[4] = {a8.x, a8.y, a8.z, a8.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int s = 0; s < 4; s += 2) {
        const unsigned as[4] = {av[s], av8[s], av[s + 1], av8[s + 1]}, bs[2] = {bv[s], bv[s + 1]};
#if ACT_BF16
        mma_bf16(acc, as, bs);
#else
        // the k-step's sum added in float32: the tensor cores' own additions truncate
        float step[4] = {0.f, 0.f, 0.f, 0.f};
        mma_3xtf32(step, as, bs);
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[j] += step[j];
#endif
    }
}

#if ACT_BF16
// Two bf16 products in one instruction: the exact product rounded to nearest even, the bits of pack16 of the
// float product (exact for bf16 factors); the addend -0 keeps a product's sign
__device__ __forceinline__ unsigned mul_bf16x2(unsigned a, unsigned b) {
    unsigned r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
    return r;
}
#endif

// 16 bytes of w times the gain's, rounded to act_t (the norm's gain folded into w)
__device__ __forceinline__ uint4 gained(uint4 w, uint4 gain) {
#if ACT_BF16
    return make_uint4(mul_bf16x2(w.x, gain.x), mul_bf16x2(w.y, gain.y), mul_bf16x2(w.z, gain.z),
                      mul_bf16x2(w.w, gain.w));
#else
    float wv[PACK], gv[PACK];
    unpack16(wv, w);
    unpack16(gv, gain);
#pragma unroll
    for (int e = 0; e < PACK; ++e) wv[e] *= gv[e];
    return pack16(wv);
#endif
}

// A round's squares of x's rows g (ss[0]) and g + 8 (ss[1], where UPPER) added to ss, from the thread's chunks
// chunk(p, a, a8) (p < MATMUL_SMALL_LOADS, in order): bf16 on the tensor cores (bf16 squares are exact in
// float32), x's rows times themselves, the round's sums on the diagonal, which thread t = g / 2 holds (the
// other threads' are not used); float32 a thread's own elements, summed over a row's 4 threads later.
template <bool UPPER, class Chunk>
__device__ __forceinline__ void add_squares(float (&ss)[2], int g, const Chunk& chunk) {
#if ACT_BF16
    float lo[4] = {0.f, 0.f, 0.f, 0.f}, hi[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int p = 0; p < MATMUL_SMALL_LOADS; ++p) {
        uint4 a, a8;
        chunk(p, a, a8);
        mma_chunk(lo, a, a8, a);
        if (UPPER) mma_chunk(hi, a, a8, a8);
    }
    ss[0] += g & 1 ? lo[1] : lo[0];
    ss[1] += g & 1 ? hi[3] : hi[2];
#else
#pragma unroll
    for (int p = 0; p < MATMUL_SMALL_LOADS; ++p) {
        uint4 a, a8;
        chunk(p, a, a8);
        float xv[PACK], xv8[PACK];
        unpack16(xv, a);
        unpack16(xv8, a8);
#pragma unroll
        for (int e = 0; e < PACK; ++e) ss[0] += xv[e] * xv[e], ss[1] += xv8[e] * xv8[e];
    }
#endif
}

// PACK elements of a row from element i on, as the 16 bytes one load brings: packed, one load (or zeros past
// the row's end, whole chunks only); else an element at a time, zero past n.
template <bool PACKED>
__device__ __forceinline__ uint4 load_chunk(const act_t* row, int i, int n) {
    if constexpr (PACKED) return i < n ? *reinterpret_cast<const uint4*>(row + i) : make_uint4(0u, 0u, 0u, 0u);
    float v[PACK];
#pragma unroll
    for (int e = 0; e < PACK; ++e) v[e] = i + e < n ? to_float(row[i + e]) : 0.f;
    return pack16(v);
}

// The rotary embedding of the pair product (rope: cos_t, sin_t (S, half), row r's position pos[r / T * stride] +
// r % T: stride 0 when the sequences share one position, 1 when each has its own; rotated rows below rot).
struct Rope {
    const float* cos_t;
    const float* sin_t;
    const int* pos;
    int T, stride, rot;
};

// The rotation (cs, sn) of the pair item (row, pair fcol).
__device__ __forceinline__ void rope_angle(const Rope& rope, int half, int row, int fcol, float& cs, float& sn) {
    const long long at = (long long)(rope.pos[row / rope.T * rope.stride] + row % rope.T) * half + fcol % half;
    cs = rope.cos_t[at], sn = rope.sin_t[at];
}

// What a product's epilogue needs besides the sums: out (N, O), the row length I, and what is folded in.
struct Finish {
    void* out;
    int O, I, out_f32, accumulate, half;
    const act_t* gain;  // where given: the norm folded in (its rstd (N,) stored too)
    float* rstd;
    float eps;
    act_t* glu_out;
    const act_t* bias;
    Rope rope;
};

// The end of one (row, column pair) item, from v, its two sums over the virtual warps (in their order), and s,
// the row's sum of squares: scaled by rstd where the norm is folded in (stored where stores_rstd), the bias
// added, added to out (prior: out's values, where `primed` loaded them early), then SwiGLU or the rotation
// (cs, sn where primed), stored. W: 1 (columns fcol, fcol + 1) or 2 (the pair fcol). Every product of few rows
// ends here, so a row's bits do not depend on the kernel that took it.
template <int W>
__device__ __forceinline__ void finish_item(const Finish& f, float (&v)[2], float s, int row, int fcol,
                                            bool stores_rstd, bool primed, const float (&prior)[2], float cs,
                                            float sn) {
    const int cols = f.O / W, half = f.half, fstep = W == 1 ? 1 : half;  // the second column's distance
    const int frow = W == 1 ? fcol : fcol / half * 2 * half + fcol % half;  // out's first column written
    const bool second = W == 2 || fcol + 1 < cols;
    if (f.gain) {
        const float rs = 1.f / sqrtf(s / f.I + f.eps);
        v[0] = __fmul_rn(v[0], rs), v[1] = __fmul_rn(v[1], rs);  // not contracted with what is added next
        if (stores_rstd) f.rstd[row] = rs;
    }
    if (f.bias) {
        v[0] += to_float(f.bias[frow]);
        if (second) v[1] += to_float(f.bias[frow + fstep]);
    }
    if (f.accumulate) {
        if (primed) v[0] += prior[0], v[1] += prior[1];
        else {
            v[0] += load_out(f.out, (long long)row * f.O + frow, f.out_f32);
            if (second) v[1] += load_out(f.out, (long long)row * f.O + frow + fstep, f.out_f32);
        }
    }
    if constexpr (W == 2) {
        const bool rotates = f.rope.cos_t && frow < f.rope.rot;
        if (f.glu_out || rotates) {  // from the values as stored
            v[0] = f.out_f32 ? v[0] : to_float(from_float<act_t>(v[0]));
            v[1] = f.out_f32 ? v[1] : to_float(from_float<act_t>(v[1]));
        }
        if (f.glu_out)
            f.glu_out[(long long)row * cols + fcol] = from_float<act_t>(v[0] / (1.f + expf(-v[0])) * v[1]);
        if (rotates) {
            if (!primed) rope_angle(f.rope, half, row, fcol, cs, sn);
            rotate_pair(v[0], v[1], cs, sn, v[0], v[1]);
        }
    }
    store_out(f.out, (long long)row * f.O + frow, v[0], f.out_f32);
    if (second) store_out(f.out, (long long)row * f.O + frow + fstep, v[1], f.out_f32);
}

// Rows of x a kernel takes: TILES tiles of 16, or with TILES 0 one tile's first 8 (rows g + 8 are zeros that
// need no registers: the path of single-sequence decoding, whose latency counts most).
template <int TILES>
struct RowTiles {
    static constexpr int tiles = TILES == 0 ? 1 : TILES, rows = TILES == 0 ? 8 : 16 * TILES;
    static constexpr bool upper = TILES != 0;
};

// W: 1 (a tile's 8 rows of w are 8 columns) or 2 (4 pairs); a warp takes NT tiles of 8 rows of w at once (each
// fragment of x loaded once for NT products: x's loads bound many rows), a block `groups` of such in turn, and
// x's rows from row_base on (RowTiles). I is split over `vwarps` virtual warps (set by I alone), which meet in
// shared memory (partial), where the block's threads finish (row, column pair) items, each summing the virtual
// warps' parts in their order. A block's physical warps (blockDim.x / 32, dividing vwarps; all of them when NT >
// 1) take the virtual warps warp, warp + physical, ... in turn (up to 8 rows; the tiles' kernels have as many
// physical warps as virtual ones), so the physical count may follow the row count
// (few rows: small blocks, many resident an SM) while a row's sums stay those of vwarps: a tile's products and
// sums are the same whatever NT and the physical warps are.
template <int W, bool PACKED, int TILES, int NT>
__device__ __forceinline__ void matmul_small_tile(void* __restrict__ out, const act_t* __restrict__ x,
                                                  const act_t* __restrict__ w, int N, int O, int I, int out_f32,
                                                  int accumulate, const act_t* __restrict__ gain,
                                                  float* __restrict__ rstd, float eps, int half,
                                                  act_t* __restrict__ glu_out, const act_t* __restrict__ bias,
                                                  Rope rope, int vwarps,
                                                  float (*partial)[RowTiles<TILES>::rows][9], int tile0, int row_base) {
    using RT = RowTiles<TILES>;
    const int lane = threadIdx.x & 31, warps = vwarps, pwarps = blockDim.x >> 5;
    int warp = threadIdx.x >> 5;  // the virtual warp this warp runs now: threadIdx.x / 32, + pwarps, ...
    const int g = lane >> 2, t = lane & 3;
    const int cols = O / W;  // columns, or pairs
    if (tile0 * 8 / W >= cols) return;  // a block's last tiles past the end (the whole block alike)
    const act_t* wrow[NT];
    bool loads_w[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) {  // the row of w this thread loads: the tile's column g
        const int lcol = W == 1 ? (tile0 + n) * 8 + g : (tile0 + n) * 4 + g / 2;
        const int lrow = W == 1 ? lcol : lcol / half * 2 * half + lcol % half + (g & 1) * half;
        wrow[n] = w + (long long)lrow * I;
        loads_w[n] = lcol < cols;
    }
    const Finish fin{out, O, I, out_f32, accumulate, half, gain, rstd, eps, glu_out, bias, rope};
    let_next_launch();
    // a round: MATMUL_SMALL_LOADS consecutive k-blocks a warp (4 threads x PACK elements each), warps side by side
    const int step = 4 * PACK, stride = warps * MATMUL_SMALL_LOADS * step;
    int warp_own = warp * MATMUL_SMALL_LOADS * step, own = warp_own + t * PACK;
    uint4 wr[NT][MATMUL_SMALL_LOADS];
    const auto load_raw = [&](int r0) {
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int p = 0; p < MATMUL_SMALL_LOADS; ++p)
                wr[n][p] = loads_w[n] ? load_chunk<PACKED>(wrow[n], r0 + own + p * step, I)
                                      : make_uint4(0u, 0u, 0u, 0u);
    };
    const auto apply_gain = [&](int r0) {  // w * g, rounded to act_t
        if (gain) {
#pragma unroll
            for (int p = 0; p < MATMUL_SMALL_LOADS; ++p) {
                const uint4 gr = load_chunk<PACKED>(gain, r0 + own + p * step, I);
#pragma unroll
                for (int n = 0; n < NT; ++n) wr[n][p] = gained(wr[n][p], gr);
            }
        }
    };
    const auto load_weights = [&](int r0) { load_raw(r0), apply_gain(r0); };
    load_weights(0);  // before the wait: w and the gain are no kernel's output
    // the (row, column pair) item this thread finishes first: its rotation and what it adds to, early
    const int items = min(N - row_base, RT::rows) * 4;
    const auto item_at = [&](int tile, int item, int& row, int& fcol, int& frow) {
        row = row_base + (item >> 2);
        const int tt = item & 3;
        fcol = W == 1 ? tile * 8 + 2 * tt : tile * 4 + tt;
        frow = W == 1 ? fcol : fcol / half * 2 * half + fcol % half;  // out's first column written
    };
    int row0, fcol0, frow0;
    item_at(tile0, threadIdx.x, row0, fcol0, frow0);
    const bool first_live = (int)threadIdx.x < items && fcol0 < cols;
    float cs0 = 1.f, sn0 = 0.f;
    if (W == 2 && rope.cos_t && first_live && frow0 < rope.rot) rope_angle(rope, half, row0, fcol0, cs0, sn0);
    const int fstep = W == 1 ? 1 : half;  // the second column's distance from the first
    wait_for_inputs();
    float prior0[2] = {0.f, 0.f};  // what the first item is accumulated onto
    if (first_live && accumulate) {
        prior0[0] = load_out(out, (long long)row0 * O + frow0, out_f32);
        if (W == 2 || fcol0 + 1 < cols) prior0[1] = load_out(out, (long long)row0 * O + frow0 + fstep, out_f32);
    }
    float acc[NT][RT::tiles][4], ss[RT::tiles][2];
#if ACT_BF16
    const int ss_lane = g >> 1;  // the diagonal's
#else
    const int ss_lane = 0;  // after the sum over a row's 4 threads
#endif
    for (;;) {  // this warp's virtual warps in turn
#pragma unroll
    for (int j = 0; j < RT::tiles; ++j) {
        ss[j][0] = ss[j][1] = 0.f;
#pragma unroll
        for (int n = 0; n < NT; ++n) acc[n][j][0] = acc[n][j][1] = acc[n][j][2] = acc[n][j][3] = 0.f;
    }
    for (int r0 = 0; r0 < I; r0 += stride) {
        // w's loads (the first virtual warp's first came before the wait); up to 8 rows the gain waits for x's
        // loads to be issued, so that its multiply, which waits for w, does not hold them back
        const bool later = r0 || warp != (int)(threadIdx.x >> 5);
        if (later) {
            if (TILES == 0) load_raw(r0);
            else load_weights(r0);
        }
#pragma unroll
        for (int j = 0; j < RT::tiles; ++j) {
            const int ra = row_base + 16 * j + g, rb = ra + 8;
            if (row_base + 16 * j >= N) break;  // the same for the whole block
            const act_t* xa = x + (long long)ra * I;
            const act_t* xb = x + (long long)rb * I;
            uint4 xr[MATMUL_SMALL_LOADS], xr8[MATMUL_SMALL_LOADS];
#pragma unroll
            for (int p = 0; p < MATMUL_SMALL_LOADS; ++p) {
                xr[p] = ra < N ? load_chunk<PACKED>(xa, r0 + own + p * step, I) : make_uint4(0u, 0u, 0u, 0u);
                xr8[p] = RT::upper && rb < N ? load_chunk<PACKED>(xb, r0 + own + p * step, I)
                                             : make_uint4(0u, 0u, 0u, 0u);
            }
            if (TILES == 0 && later && j == 0) apply_gain(r0);
#pragma unroll
            for (int p = 0; p < MATMUL_SMALL_LOADS; ++p)
                if (r0 + warp_own + p * step < I)  // the warp holds some of I
#pragma unroll
                    for (int n = 0; n < NT; ++n) mma_chunk(acc[n][j], xr[p], xr8[p], wr[n][p]);
            if (gain)  // the squares of x, off the products' path
                add_squares<RT::upper>(ss[j], g, [&](int p, uint4& a, uint4& a8) { a = xr[p], a8 = xr8[p]; });
        }
    }
#if !ACT_BF16
#pragma unroll
    for (int j = 0; j < RT::tiles; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            ss[j][h] += __shfl_xor_sync(FULL_MASK, ss[j][h], 1);
            ss[j][h] += __shfl_xor_sync(FULL_MASK, ss[j][h], 2);
        }
#endif
    if (TILES != 0 || warp + pwarps >= warps) break;  // the last virtual warp's sums are stored below
    // one tile of w (NT 1): this virtual warp's sums into its own slot, then the next virtual warp's loads
#pragma unroll
    for (int j = 0; j < RT::tiles; ++j) {
        const int ra = 16 * j + g;
        partial[warp][ra][2 * t] = acc[0][j][0];
        partial[warp][ra][2 * t + 1] = acc[0][j][1];
        if (t == ss_lane) partial[warp][ra][8] = ss[j][0];
        if (RT::upper) {
            partial[warp][ra + 8][2 * t] = acc[0][j][2];
            partial[warp][ra + 8][2 * t + 1] = acc[0][j][3];
            if (t == ss_lane) partial[warp][ra + 8][8] = ss[j][1];
        }
    }
    warp += pwarps;
    warp_own = warp * MATMUL_SMALL_LOADS * step, own = warp_own + t * PACK;
    }
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const int tile = tile0 + n;
        if (tile * 8 / W >= cols) break;  // the whole block alike
        if (n) __syncthreads();  // the last tile's partial sums are read
#pragma unroll
        for (int j = 0; j < RT::tiles; ++j) {
            const int ra = 16 * j + g;  // x's row row_base + ra
            partial[warp][ra][2 * t] = acc[n][j][0];
            partial[warp][ra][2 * t + 1] = acc[n][j][1];
            if (t == ss_lane) partial[warp][ra][8] = ss[j][0];
            if (RT::upper) {
                partial[warp][ra + 8][2 * t] = acc[n][j][2];
                partial[warp][ra + 8][2 * t + 1] = acc[n][j][3];
                if (t == ss_lane) partial[warp][ra + 8][8] = ss[j][1];
            }
        }
        __syncthreads();
        for (int item = threadIdx.x; item < items; item += blockDim.x) {
            int row, fcol, frow;
            item_at(tile, item, row, fcol, frow);
            if (fcol >= cols) continue;
            const int c2 = 2 * (item & 3), local = row - row_base;
            float v[2] = {0.f, 0.f}, s = 0.f;
            for (int j = 0; j < warps; ++j) {
                v[0] += partial[j][local][c2];
                v[1] += partial[j][local][c2 + 1];
                s += partial[j][local][8];
            }
            finish_item<W>(fin, v, s, row, fcol, tile == 0 && (item & 3) == 0, n == 0 && item == (int)threadIdx.x,
                           prior0, cs0, sn0);
        }
    }
}

// Products of 9 to 64 rows with many tiles of w (matmul_rows_t<XT>): a row's bits are matmul_small's. A block
// takes all of x's rows (XT tiles of 16) and warps x NT tiles of 8 rows of w, and walks the row's virtual warps
// in order, each one's rounds in order: a stage is one round of one virtual warp, the same k-range and the same
// chunks a thread of that virtual warp loads in matmul_small (thread (g, t): 16 bytes of x's rows g and g + 8
// and of w's row g at element r0 + own + p * step). A stage's x, w and gain chunks are copied into shared
// memory in the fragments' order (cp.async, MATMUL_ROWS_STAGES stages in flight), so x's rows come from L2 once
// a block, not once a tile of w. A warp takes a group of x's tiles (RowsSplit: at 4 tiles, MATMUL_ROWS_XSPLIT
// groups of 4 / that many, the block's warps in that many groups) and the block's tiles of w a group's share (NT
// x the groups: x's A operands and w's B operands read from shared memory once for that many products). Each
// warp sums a virtual warp's products from 0 in registers through the same mma_chunk calls, then adds them to
// its running total (from 0.f, as matmul_small's `v += partial[j]`); the squares of x's row halves (tile c / 2,
// rows g or g + 8: chain c) are summed the same way by warp c % warps. No reduction across warps: each thread
// finishes its own (row, column pair) items (finish_item).
template <int XT>
struct RowsSplit {
    static constexpr int groups = XT == 4 ? MATMUL_ROWS_XSPLIT : 1, tiles = XT / groups;
};
static_assert(MATMUL_ROWS_XSPLIT == 1 || MATMUL_ROWS_XSPLIT == 2 || MATMUL_ROWS_XSPLIT == 4,
              "x's 4 tiles in groups of whole tiles");

// Copy 16 bytes at element i of a row into shared memory: packed, one cp.async (zeros past n or where not live);
// else an element at a time (load_chunk), stored.
template <bool PACKED>
__device__ __forceinline__ void stage_chunk(uint4* to, const act_t* row, int i, int n, bool live) {
    if constexpr (PACKED) {  // a whole chunk or none (zeros)
        const bool in = live && i < n;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"((unsigned)__cvta_generic_to_shared(to)),
                     "l"(in ? row + i : row), "r"(in ? 16 : 0)
                     : "memory");
    } else {
        *to = live ? load_chunk<false>(row, i, n) : make_uint4(0u, 0u, 0u, 0u);
    }
}

// A chain of the squares of x (matmul_rows): a round's squares of x's rows g (UPPER false) or g + 8 added to ss,
// from chunk(p, a, a8) (p < MATMUL_SMALL_LOADS, in order): add_squares' arithmetic for one of its two sums (the
// same mma_chunk calls, or a thread's own elements in float32), so that two warps can take a tile's two halves.
template <class Chunk>
__device__ __forceinline__ void add_square_chain(float& ss, bool upper, int g, const Chunk& chunk) {
#if ACT_BF16
    float sq[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int p = 0; p < MATMUL_SMALL_LOADS; ++p) {
        uint4 a, a8;
        chunk(p, a, a8);
        mma_chunk(sq, a, a8, upper ? a8 : a);
    }
    ss += upper ? (g & 1 ? sq[3] : sq[2]) : (g & 1 ? sq[1] : sq[0]);
#else
#pragma unroll
    for (int p = 0; p < MATMUL_SMALL_LOADS; ++p) {
        uint4 a, a8;
        chunk(p, a, a8);
        float xv[PACK];
        unpack16(xv, upper ? a8 : a);
#pragma unroll
        for (int e = 0; e < PACK; ++e) ss += xv[e] * xv[e];
    }
#endif
}

// The split's scratch (matmul_split_t*): a virtual warp's sums of row r, column c (the mma's: a tile's 8, pairs
// as 2 adjacent) at parts[(vw * N + r) * width + c], width 8 x the tiles of w; then the rows' squares at
// parts[vwarps * N * width + vw * N + r].
__device__ __forceinline__ int split_width(int O, int half) {
    return half ? (O / 2 + 3) / 4 * 8 : (O + 7) / 8 * 8;  // layers._matmul_small's 8 x tiles_of_w
}

// A block's stages in order (matmul_rows): round r of virtual warp v at k = r * stride + v * LOADS * step, kept
// as counters (no division a stage).
struct StageWalk {
    int round, k, first;  // the stage's round, its k, its virtual warp's k
    __device__ __forceinline__ bool next(int rounds, int stride, int vstep) {  // true where a virtual warp ends
        if (++round < rounds) {
            k += stride;
            return false;
        }
        round = 0, first += vstep, k = first;
        return true;
    }
};

// SPLIT (matmul_split_t<XT>): block (x, y) runs virtual warps y * group .. + group - 1 only, storing each one's
// sums (and block x 0 the squares) in the scratch `parts` instead of adding them up; matmul_split_finish adds
// them in virtual-warp order and finishes the items.
template <int W, bool PACKED, int XT, int NT, bool SPLIT>
__device__ __forceinline__ void matmul_rows(const Finish& f, const act_t* __restrict__ x, const act_t* __restrict__ w,
                                            int N, int vwarps, uint4* __restrict__ stages,
                                            float* __restrict__ squares, float* __restrict__ parts, int group) {
    constexpr int LOADS = MATMUL_SMALL_LOADS, STAGES = MATMUL_ROWS_STAGES, step = 4 * PACK;
    constexpr int XG = RowsSplit<XT>::groups, XW = RowsSplit<XT>::tiles, NW = NT * XG;  // x's tiles, w's a warp
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5, I = f.I, half = f.half, cols = f.O / W;
    const int xtile0 = warp % XG * XW, wslot0 = warp / XG * NW;  // this warp's first tile of x, of w (in the block)
    // the block's groups of tiles of w (warps x NT tiles each): blockIdx.x, + gridDim.x, ... (a split block: one)
    const int tiles = warps * NT, groups_all = ((W == 1 ? (cols + 7) / 8 : (cols + 3) / 4) + tiles - 1) / tiles;
    const int group_step = SPLIT ? groups_all : gridDim.x;
    const int groups = (int)blockIdx.x < groups_all ? (groups_all - 1 - blockIdx.x) / group_step + 1 : 0;
    // a stage in uint4: x (XT tiles x LOADS x 2 halves x 32 lanes), the gain (LOADS x 4), w (tiles x LOADS x 32)
    const int x_size = XT * LOADS * 64, gain_at = x_size, w_at = x_size + LOADS * 4;
    const int stage_size = w_at + tiles * LOADS * 32;
    const int stride = vwarps * LOADS * step, rounds = (I + stride - 1) / stride, vstep = LOADS * step;
    const int v0 = SPLIT ? blockIdx.y * group : 0, S = ((SPLIT ? min(vwarps, v0 + group) : vwarps) - v0) * rounds;
    const int width = split_width(f.O, half);
    float* const split_squares = parts + (long long)vwarps * N * width;
    // the rows of w this thread copies for the group of tiles from tile0: column g of the block's tiles warp,
    // warp + warps, ... (NT of them), into those tiles' slots of a stage (which the warps that use them read
    // after the stage's barrier)
    const act_t* w_row[NT];
    bool w_live[NT];
    const auto rows_of_w = [&](int tile0) {
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            const int tile = tile0 + warp + i * warps;
            const int lcol = W == 1 ? tile * 8 + g : tile * 4 + g / 2;
            const int lrow = W == 1 ? lcol : lcol / half * 2 * half + lcol % half + (g & 1) * half;
            w_live[i] = lcol < cols;
            w_row[i] = w_live[i] ? w + (long long)lrow * I : w;
        }
    };
    const int kt = t * PACK;  // a thread's element in a k-block of 4 x PACK
    const auto copy_w = [&](int s, int k0) {  // and the gain's
        uint4* st = stages + s % STAGES * stage_size + w_at + warp * LOADS * 32 + lane;
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
            for (int p = 0; p < LOADS; ++p)
                stage_chunk<PACKED>(st + (i * warps * LOADS + p) * 32, w_row[i], k0 + p * step + kt, I, w_live[i]);
        if (f.gain && (int)threadIdx.x < LOADS * 4)
            stage_chunk<PACKED>(stages + s % STAGES * stage_size + gain_at + threadIdx.x, f.gain,
                                k0 + (threadIdx.x >> 2) * step + (threadIdx.x & 3) * PACK, I, true);
    };
    const auto copy_x = [&](int s, int k0) {
        uint4* st = stages + s % STAGES * stage_size;
        for (int c = threadIdx.x; c < x_size; c += blockDim.x) {
            const int l = c & 31, jp = c >> 6, row = 16 * (jp / LOADS) + 8 * ((c >> 5) & 1) + (l >> 2);
            stage_chunk<PACKED>(st + c, x + (long long)(row < N ? row : 0) * I, k0 + jp % LOADS * step + (l & 3) * PACK,
                                I, row < N);
        }
    };
    const auto commit = [] { asm volatile("cp.async.commit_group;\n" ::: "memory"); };
    // the stages' walk over the block's groups (S stages each), the copies' STAGES - 1 ahead of the products'
    const StageWalk start{0, v0 * vstep, v0 * vstep};
    StageWalk copying = start, summing = start;
    int copy_stage = 0, copy_tile0 = blockIdx.x * tiles;  // the copies' stage in its group, and its group
    const auto copied = [&] {  // the copies' walk one stage on
        copying.next(rounds, stride, vstep);
        if (++copy_stage == S) copy_stage = 0, copying = start, copy_tile0 += group_step * tiles, rows_of_w(copy_tile0);
    };
    const int all = groups * S;  // the block's stages
    int first_k[STAGES - 1];
    rows_of_w(copy_tile0);
    let_next_launch();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {  // before the wait: w and the gain are no one's output
        first_k[s] = copying.k;
        if (s < all) copy_w(s, copying.k), copied();
    }
    wait_for_inputs();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < all) copy_x(s, first_k[s]);
        commit();
    }
#if ACT_BF16
    const int ss_lane = g >> 1;  // the diagonal's
#else
    const int ss_lane = 0;
#endif
    // acc: a virtual warp's sums (w's tile n, x's tile xtile0 + j); ss: its squares' chains (x's tile c / 2, the
    // rows g or g + 8 of c % 2), chain c by warp c % warps; total, ss_total: from 0.f, a virtual warp's added in turn
    float acc[NW][XW][4], total[NW][XW][4], ss[2 * XT], ss_total[2 * XT];
#pragma unroll
    for (int c = 0; c < 2 * XT; ++c) ss[c] = ss_total[c] = 0.f;
#pragma unroll
    for (int n = 0; n < NW; ++n)
#pragma unroll
        for (int j = 0; j < XW; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[n][j][i] = total[n][j][i] = 0.f;
    // the squares: in the block's first group only (x's rows are every group's); a split's by one block of each
    // virtual warp
    bool squares_here = f.gain && (!SPLIT || blockIdx.x == 0);
    int stage = 0, tile0 = blockIdx.x * tiles;  // the products' stage in its group, and its group
    for (int s = 0; s < all; ++s) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2) : "memory");  // stage s has landed
        __syncthreads();  // everyone's copies of it, and everyone is done with stage s - 1, whose buffer is next
        if (s + STAGES - 1 < all) copy_w(s + STAGES - 1, copying.k), copy_x(s + STAGES - 1, copying.k), copied();
        commit();
        const uint4* st = stages + s % STAGES * stage_size;
        const int k0 = summing.k;
        const auto x_at = [&](int j, int p, int h) { return st[((j * LOADS + p) * 2 + h) * 32 + lane]; };
#pragma unroll
        for (int p = 0; p < LOADS; ++p) {
            if (k0 + p * step >= I) break;  // the virtual warp holds no more of I
            uint4 wf[NW];
            const uint4 gr = f.gain ? st[gain_at + p * 4 + t] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
            for (int n = 0; n < NW; ++n) {
                wf[n] = st[w_at + ((wslot0 + n) * LOADS + p) * 32 + lane];
                if (f.gain) wf[n] = gained(wf[n], gr);
            }
#pragma unroll
            for (int j = 0; j < XW; ++j) {
                const uint4 a = x_at(xtile0 + j, p, 0), a8 = x_at(xtile0 + j, p, 1);
#pragma unroll
                for (int n = 0; n < NW; ++n) mma_chunk(acc[n][j], a, a8, wf[n]);
            }
        }
        if (squares_here)
#pragma unroll
            for (int c = 0; c < 2 * XT; ++c)
                if (c % warps == warp)
                    add_square_chain(ss[c], c & 1, g, [&](int p, uint4& a, uint4& a8) {
                        a = x_at(c >> 1, p, 0), a8 = x_at(c >> 1, p, 1);
                    });
        if (summing.next(rounds, stride, vstep)) {  // the virtual warp's last round: its sums onto the totals, in order
#if !ACT_BF16
#pragma unroll
            for (int c = 0; c < 2 * XT; ++c) {
                ss[c] += __shfl_xor_sync(FULL_MASK, ss[c], 1);
                ss[c] += __shfl_xor_sync(FULL_MASK, ss[c], 2);
            }
#endif
            if constexpr (SPLIT) {  // this virtual warp's sums into the scratch
                const int vw = v0 + stage / rounds;
                if (f.gain && blockIdx.x == 0 && t == ss_lane)
#pragma unroll
                    for (int c = 0; c < 2 * XT; ++c) {
                        const int row = 8 * c + g;  // x's tile c / 2, half c % 2
                        if (c % warps == warp && row < N) split_squares[vw * N + row] = ss[c];
                    }
#pragma unroll
                for (int n = 0; n < NW; ++n) {
                    const int tile = tile0 + wslot0 + n;
                    if (tile * 8 / W >= cols) break;  // past the end
#pragma unroll
                    for (int j = 0; j < XW; ++j)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const int row = 16 * (xtile0 + j) + 8 * h + g;
                            const long long at = ((long long)vw * N + row) * width + tile * 8 + 2 * t;
                            if (row < N)
                                *reinterpret_cast<float2*>(parts + at) =
                                    make_float2(acc[n][j][2 * h], acc[n][j][2 * h + 1]);
                        }
                }
            } else {
#pragma unroll
                for (int c = 0; c < 2 * XT; ++c) ss_total[c] += ss[c];
#pragma unroll
                for (int n = 0; n < NW; ++n)
#pragma unroll
                    for (int j = 0; j < XW; ++j)
#pragma unroll
                        for (int i = 0; i < 4; ++i) total[n][j][i] += acc[n][j][i];
            }
#pragma unroll
            for (int c = 0; c < 2 * XT; ++c) ss[c] = 0.f;
#pragma unroll
            for (int n = 0; n < NW; ++n)
#pragma unroll
                for (int j = 0; j < XW; ++j)
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[n][j][i] = 0.f;
        }
        if (++stage < S || SPLIT) continue;
        // the group's last stage: its items finished (the next group's first stages are in flight meanwhile)
        if (squares_here) {  // the rows' squares, for this group and the later ones
            if (t == ss_lane)
#pragma unroll
                for (int c = 0; c < 2 * XT; ++c)
                    if (c % warps == warp) squares[8 * c + g] = ss_total[c];
            squares_here = false;
        }
        if (s < S) __syncthreads();  // the first group: every warp's squares stored
        const float none[2] = {0.f, 0.f};
#pragma unroll
        for (int n = 0; n < NW; ++n) {
            const int tile = tile0 + wslot0 + n, fcol = W == 1 ? tile * 8 + 2 * t : tile * 4 + t;
            if (fcol >= cols) break;
#pragma unroll
            for (int j = 0; j < XW; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = 16 * (xtile0 + j) + 8 * h + g;
                    if (row >= N) continue;
                    float v[2] = {total[n][j][2 * h], total[n][j][2 * h + 1]};
                    finish_item<W>(f, v, f.gain ? squares[row] : 0.f, row, fcol, tile == 0 && t == 0, false, none,
                                   1.f, 0.f);
                }
        }
#pragma unroll
        for (int n = 0; n < NW; ++n)
#pragma unroll
            for (int j = 0; j < XW; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) total[n][j][i] = 0.f;
        stage = 0, tile0 += group_step * tiles, summing = start;
    }
}

// Grid: (ceil(columns / 8) (ceil(pairs / 4) when paired) / (groups x NT), ceil(N / rows a block)) blocks of
// 32 x warps threads, warps <= MATMUL_SMALL_WARPS (MATMUL_PAIR_WARPS for NT > 1); half 0 (plain) or the pairing
// distance, with glu_out (SwiGLU's output) or cos_t (the rotary embedding). One kernel a row count class:
// matmul_small (rows up to 8, registers held to 80 so that the largest product of `base` runs in one wave;
// CUDA 12.4+, older compilers bound the block size only), and matmul_small_t{1..4}_n{1, MATMUL_PAIR} (1 to 4
// tiles of 16 rows a block, NT tiles of w a warp). They run one template: a row's arithmetic is the same in each.
// matmul_rows_t{1..4} (below) take the same arguments (groups unused), their grid at most ceil(tiles of w /
// (warps x MATMUL_ROWS_NT)) blocks (fewer: each walks several groups of tiles of w; layers._rows_blocks).
#if defined(__CUDACC_VER_MAJOR__) && __CUDACC_VER_MAJOR__ * 100 + __CUDACC_VER_MINOR__ >= 1204
#define MATMUL_SMALL_BOUNDS __maxnreg__(80)
#else
#define MATMUL_SMALL_BOUNDS __launch_bounds__(32 * MATMUL_SMALL_WARPS, 1)
#endif
#define MATMUL_SMALL_PARAMS                                                                                       \
    void *__restrict__ out, const act_t *__restrict__ x, const act_t *__restrict__ w, int N, int O, int I,       \
        int out_f32, int accumulate, int packed, const act_t *__restrict__ gain, float *__restrict__ rstd,       \
        float eps, int half, act_t *__restrict__ glu_out, const act_t *__restrict__ bias,                        \
        const float *__restrict__ cos_t,                                                                         \
        const float *__restrict__ sin_t, const int *__restrict__ pos, int T, int pos_stride, int rot, int groups, \
        int vwarps, float *__restrict__ parts
// groups > 1 (many rows): a block's tiles reread x from L1 rather than every block from L2; grid.y splits x's
// rows (row_base), a constant 0 for matmul_small, whose 80 registers spill with a row offset to carry
#define MATMUL_SMALL_BODY(TILES, NT)                                                                              \
    __shared__ float partial[MATMUL_SMALL_WARPS][RowTiles<TILES>::rows][9]; /* a warp's sums and squares */      \
    const Rope rope{cos_t, sin_t, pos, T, pos_stride, rot};                                                      \
    for (int tile = blockIdx.x * groups * NT; tile < (blockIdx.x + 1) * groups * NT; tile += NT) {               \
        if (tile > blockIdx.x * groups * NT) __syncthreads(); /* the last tile's partial sums are read */        \
        if (half && packed) MATMUL_SMALL_TILE(2, true, TILES, NT);                                               \
        else if (half) MATMUL_SMALL_TILE(2, false, TILES, NT);                                                   \
        else if (packed) MATMUL_SMALL_TILE(1, true, TILES, NT);                                                  \
        else MATMUL_SMALL_TILE(1, false, TILES, NT);                                                             \
    }
#define MATMUL_SMALL_TILE(W, PACKED, TILES, NT)                                                                   \
    matmul_small_tile<W, PACKED, TILES, NT>(out, x, w, N, O, I, out_f32, accumulate, gain, rstd, eps, half,      \
                                            glu_out, bias, rope, vwarps, partial, tile,                         \
                                            TILES ? blockIdx.y * RowTiles<TILES>::rows : 0)

extern "C" __global__ void MATMUL_SMALL_BOUNDS matmul_small(MATMUL_SMALL_PARAMS) { MATMUL_SMALL_BODY(0, 1) }
// matmul_small_t<tiles>_n<NT>: NT tiles of w a warp at once; NT = MATMUL_PAIR in blocks of at most
// MATMUL_PAIR_WARPS warps, two an SM, whose threads may take the registers that holding more tiles needs
#define MATMUL_SMALL_TILES(TILES, NT) MATMUL_SMALL_TILES_(TILES, NT)
#define MATMUL_SMALL_TILES_(TILES, NT)                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * (NT == 1 ? MATMUL_SMALL_WARPS : MATMUL_PAIR_WARPS),        \
                                                 NT == 1 ? 1 : 2)                                               \
        matmul_small_t##TILES##_n##NT(MATMUL_SMALL_PARAMS) { MATMUL_SMALL_BODY(TILES, NT) }
static_assert(MATMUL_PAIR > 1, "matmul_small_t<tiles>_n1 are the kernels of one tile a warp");
MATMUL_SMALL_TILES(1, 1)
MATMUL_SMALL_TILES(2, 1)
MATMUL_SMALL_TILES(3, 1)
MATMUL_SMALL_TILES(4, 1)
MATMUL_SMALL_TILES(1, MATMUL_PAIR)
MATMUL_SMALL_TILES(2, MATMUL_PAIR)
MATMUL_SMALL_TILES(3, MATMUL_PAIR)
MATMUL_SMALL_TILES(4, MATMUL_PAIR)
// matmul_rows_t<XT>: 9 to 64 rows (XT tiles of 16), MATMUL_ROWS_NT x RowsSplit<XT>::groups tiles of w a warp, 1
// to MATMUL_ROWS_WARPS warps a block (a multiple of those groups); dynamic shared memory: MATMUL_ROWS_STAGES
// stages (layers._matmul_small). matmul_split_t<XT>: the same code in blocks of MATMUL_SPLIT_WARPS warps of
// MATMUL_SPLIT_NT x RowsSplit<XT>::groups tiles of w each, grid.y groups of `groups` consecutive
// virtual warps each (its stages only: fewer than MATMUL_ROWS_STAGES need that many buffers only), their sums
// into the scratch parts, MATMUL_SPLIT_BLOCKS blocks an SM, rows of whole 16-byte chunks only (packed); then
// matmul_split_finish.
#define MATMUL_ROWS_CALL(W, PACKED, XT, NT, SPLIT) \
    matmul_rows<W, PACKED, XT, NT, SPLIT>(f, x, w, N, vwarps, stages, squares, parts, groups)
#define MATMUL_ROWS_KERNEL(NAME, XT, WARPS, NT, SPLIT, BLOCKS) MATMUL_ROWS_KERNEL_(NAME, XT, WARPS, NT, SPLIT, BLOCKS)
#define MATMUL_ROWS_KERNEL_(NAME, XT, WARPS, NT, SPLIT, BLOCKS)                                                      \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, BLOCKS) NAME##XT(MATMUL_SMALL_PARAMS) {                 \
        extern __shared__ uint4 stages[];                                                                           \
        __shared__ float squares[SPLIT ? 1 : 16 * XT]; /* the rows' sums of squares */                              \
        const Finish f{out, O, I, out_f32, accumulate, half, gain, rstd, eps, glu_out, bias,                        \
                       Rope{cos_t, sin_t, pos, T, pos_stride, rot}};                                                \
        if constexpr (SPLIT) { /* a split's rows are packed */                                                     \
            if (half) MATMUL_ROWS_CALL(2, true, XT, NT, true);                                                      \
            else MATMUL_ROWS_CALL(1, true, XT, NT, true);                                                           \
        } else if (half && packed) MATMUL_ROWS_CALL(2, true, XT, NT, false);                                        \
        else if (half) MATMUL_ROWS_CALL(2, false, XT, NT, false);                                                   \
        else if (packed) MATMUL_ROWS_CALL(1, true, XT, NT, false);                                                  \
        else MATMUL_ROWS_CALL(1, false, XT, NT, false);                                                             \
    }
MATMUL_ROWS_KERNEL(matmul_rows_t, 1, MATMUL_ROWS_WARPS, MATMUL_ROWS_NT, false, 1)
MATMUL_ROWS_KERNEL(matmul_rows_t, 2, MATMUL_ROWS_WARPS, MATMUL_ROWS_NT, false, 1)
MATMUL_ROWS_KERNEL(matmul_rows_t, 3, MATMUL_ROWS_WARPS, MATMUL_ROWS_NT, false, 1)
MATMUL_ROWS_KERNEL(matmul_rows_t, 4, MATMUL_ROWS_WARPS, MATMUL_ROWS_NT, false, 1)
MATMUL_ROWS_KERNEL(matmul_split_t, 1, MATMUL_SPLIT_WARPS, MATMUL_SPLIT_NT, true, MATMUL_SPLIT_BLOCKS)
MATMUL_ROWS_KERNEL(matmul_split_t, 2, MATMUL_SPLIT_WARPS, MATMUL_SPLIT_NT, true, MATMUL_SPLIT_BLOCKS)
MATMUL_ROWS_KERNEL(matmul_split_t, 3, MATMUL_SPLIT_WARPS, MATMUL_SPLIT_NT, true, MATMUL_SPLIT_BLOCKS)
MATMUL_ROWS_KERNEL(matmul_split_t, 4, MATMUL_SPLIT_WARPS, MATMUL_SPLIT_NT, true, MATMUL_SPLIT_BLOCKS)

// The end of a split product: a thread an item (row, two adjacent columns of the scratch: a tile's 2t, 2t + 1),
// its virtual warps' sums added in their order from 0.f and the row's squares likewise (matmul_rows' totals),
// then finish_item: the bits of matmul_rows and matmul_small. Grid: ceil(N x width / 2 / MATMUL_FINISH_THREADS).
extern "C" __global__ void __launch_bounds__(MATMUL_FINISH_THREADS) matmul_split_finish(MATMUL_SMALL_PARAMS) {
    const Finish f{out, O, I, out_f32, accumulate, half, gain, rstd, eps, glu_out, bias,
                   Rope{cos_t, sin_t, pos, T, pos_stride, rot}};
    const int width = split_width(O, half), items = width / 2, cols = half ? O / 2 : O;
    const float* squares = parts + (long long)vwarps * N * width;
    let_next_launch();
    const int item = blockIdx.x * blockDim.x + threadIdx.x, row = item / items, c2 = 2 * (item % items);
    const int fcol = half ? c2 / 2 : c2;  // matmul_rows': tile * 4 + t paired, tile * 8 + 2t plain
    wait_for_inputs();
    if (row >= N || fcol >= cols) return;
    float v[2] = {0.f, 0.f}, s = 0.f;
    for (int j = 0; j < vwarps; ++j) {  // through L2: other SMs wrote them (decoding.cu's sampler says why)
        const float2 p = __ldcg(reinterpret_cast<const float2*>(parts + ((long long)j * N + row) * width + c2));
        v[0] += p.x, v[1] += p.y;
        if (gain) s += __ldcg(squares + j * N + row);
    }
    const float none[2] = {0.f, 0.f};
    if (half) finish_item<2>(f, v, s, row, fcol, fcol == 0, false, none, 1.f, 0.f);
    else finish_item<1>(f, v, s, row, fcol, fcol == 0, false, none, 1.f, 0.f);
}
