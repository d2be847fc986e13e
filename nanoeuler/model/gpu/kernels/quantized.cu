// Products with quantized weights (model/quantize.py, docs/quantization.md): out (N, O) = x (N, I) @ W^T where W
// (O, I) is int4 (w = d q + m) or int8 (w = d q) in groups of 32 * 2^k elements along a row (or one group a row),
// read packed from memory and dequantized in registers: never a float copy of the matrix.
//
// The weights' GPU layout (model/gpu/quantized.py writes it once, at load): a row is cut into chunks of 32
// elements and the chunks into records of 64 bytes (int4: 4 chunks, int8: 2), of which a warp's lane t = 0..3
// of a row reads 16 bytes: elements 8t .. 8t + 7 of each of the record's chunks. int4: a 32-bit word a chunk,
// its nibble i element 2i and nibble 4 + i element 2i + 1 (so that one mask of the word shifted by 4i gives
// the pair (2i, 2i + 1) as two 16-bit lanes); int8: 8 bytes a chunk, q + 128 as unsigned bytes in the
// order of elements 0, 2, 1, 3, 4, 6, 5, 7 (so that bytes 0 and 2 of a word are a pair). The rows lie in tiles
// of 8: record r of a tile's 8 rows next to each other (512 bytes), after their record r - 1, so that a warp
// reads a tile as one contiguous run (DRAM streams it; rows apart, 64 bytes at a time, it would not). A row's
// float16 scales (int4: (d, m) pairs, d in the low half; in group order) are cut into pieces of the bytes a
// lane loads for a record (int4: 16, 8 or 4, the groups of the record's chunks; int8: 4, two groups' d), the
// pieces tiled as the records: piece p of a tile's 8 rows next to each other, after their piece p - 1.
//
// quant_matmul_*: tensor cores (mma m16n8k16, bf16, float32 accumulators) with W as the A operand: a warp takes
// 16 rows of W (lane (g, t) loads rows g and g + 8: its own rows' weights and scales) and x's rows as the B
// operand, 8 a tile (NT tiles: up to 8, 16 or 32 rows a block, by N; more rows in more blocks, next to each
// other so that they read the weights from L2; a block's tiles share each record's dequantized A fragments, so
// many rows take 4 tiles: 64 rows dequantize the weights twice, not four times as in blocks of 16). The mma's
// k order is permuted within a chunk alike for W and x: lane t's k = 2t, 2t+1, 2t+8, 2t+9 of the chunk's first
// k-step are its elements 0..3, of the second 4..7, so x comes as one 16-byte load a chunk. The A operand is
// exact bf16 integers: int8's q (three instructions a pair), int4's 128 + q (one lop3 a pair: the nibble masked
// into the bf16 128's mantissa); per chunk, with the chunk's scale, acc = fma(d, sum q x, acc), and for int4
// acc = fma(d, sum (128 + q) x, acc) then acc = fma(m - 128 d, sum x, acc), the minimum's term taking back the
// 128 (sum x an mma with a matrix of ones). A row's records are split among the block's warps, contiguous runs
// set by the row length and the matrix's rows alone (QUANT_SPLIT at most), and the warps' sums added in warp
// order: every output is summed in an order that does not depend on N (nor on the tiles a block: batch
// invariance, as the bf16 products of matmul.cu). Each warp keeps QUANT_LOADS_<type> records in flight, copied
// (cp.async) into its stages in shared memory (QUANT_STAGE_RECORDS_T<tiles> records a stage, a wait and a
// __syncwarp each), the next stage issued as each is used: many bytes in flight without the registers to hold
// them, and a stage's records' chains interleaved (every sum still in record order: the bits do not depend on
// the records a stage).
// Folded in as in matmul.cu: RMSNorm with a gain (x times the gain, rounded to bf16, is the B operand; the
// squares of x on the tensor cores, the product scaled by rstd at the end), and with half > 0 W's rows taken in
// pairs (i, i + half), rows g and g + 8 of a warp's 16, for SwiGLU (glu_out) or the rotary embedding, after a
// bias where given.
//
// quant_dequantize: rows of W as act_t, d q + m in float32 (exact: d q is exact, one rounding of the sum), then
// rounded to act_t: the products of many rows (cuBLAS on the dequantized matrix), the float32 engine's and the
// checks. Bound by its writes (2 or 4 bytes a weight against 0.5 or 1 read): 16-byte loads and stores.
#include "common.cuh"

#if !defined(QUANT_SPLIT) || !defined(QUANT_LOADS_INT4) || !defined(QUANT_LOADS_INT8) || !defined(QUANT_BLOCKS) || \
    !defined(QUANT_STAGE_RECORDS_T0) || !defined(QUANT_STAGE_RECORDS_T1) || !defined(QUANT_STAGE_RECORDS_T2) || \
    !defined(QUANT_STAGE_RECORDS_T4)
#error "QUANT_SPLIT, QUANT_LOADS_INT4/8, QUANT_STAGE_RECORDS_T0/1/2/4, QUANT_BLOCKS come from model/gpu/constants.py"
#endif

__device__ __forceinline__ float half_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Row r's first unit (a record, 64 bytes, or a piece of scales) in tiles of 8 rows of tile_bytes each
__device__ __forceinline__ const unsigned char* tiled_row(const void* base, long long tile_bytes, int unit, int r) {
    return static_cast<const unsigned char*>(base) + (long long)(r >> 3) * tile_bytes + (r & 7) * unit;
}

// The bytes of a piece of a row's scales (model/gpu/quantized.py's scale_piece)
__device__ __forceinline__ int piece_bytes(bool int4, int group_shift) {
    return int4 ? (group_shift == 0 ? 16 : group_shift == 1 ? 8 : 4) : 4;
}

// (a & b) | c in one instruction (lop3; the compiler splits the two constants' mask and or in two otherwise)
__device__ __forceinline__ unsigned and_or(unsigned a, unsigned b, unsigned c) {
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// (a & b) ^ c in one instruction
__device__ __forceinline__ unsigned and_xor(unsigned a, unsigned b, unsigned c) {
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// An int4 chunk word (nibble i element 2i, nibble 4 + i element 2i + 1) -> pairs (2i, 2i + 1) as the exact
// bf16x2 128 + q ((0x4300 | q) is the bf16 128 + q): one instruction a pair; the product takes the 128 back
// with the minimum's term (quant_matmul: (m - 128 d) sum x)
__device__ __forceinline__ void int4_pairs(unsigned w, unsigned (&a)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = and_or(w >> (4 * i), 0x000F000Fu, 0x43004300u);
}

// An int8 chunk's two words (bytes: elements 0, 2, 1, 3 and 4, 6, 5, 7, each stored as u = q + 128) -> pairs
// (2i, 2i + 1) as exact bf16x2: with u = 128 b + v (v < 128), (0x4300 | v) is 128 + v, and q = v - 128 (1 - b)
// is that minus 128 (b = 1: 0x4300) or 256 (b = 0: 0x4380), exact, bytes 0 and 2 of a word at once
__device__ __forceinline__ unsigned int8_pair(unsigned w) {
    unsigned r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;"
        : "=r"(r)
        : "r"(and_xor(w, 0x00800080u, 0x43804380u)), "r"(0xBF80BF80u), "r"(and_or(w, 0x007F007Fu, 0x43004300u)));
    return r;
}
__device__ __forceinline__ void int8_pairs(unsigned w0, unsigned w1, unsigned (&a)[4]) {
    a[0] = int8_pair(w0), a[1] = int8_pair(w0 >> 8), a[2] = int8_pair(w1), a[3] = int8_pair(w1 >> 8);
}

__device__ __forceinline__ float load_out(const void* out, long long at, int out_f32) {
    return out_f32 ? static_cast<const float*>(out)[at] : to_float(static_cast<const act_t*>(out)[at]);
}

__device__ __forceinline__ void store_out(void* out, long long at, float v, int out_f32) {
    if (out_f32) static_cast<float*>(out)[at] = v;
    else static_cast<act_t*>(out)[at] = from_float<act_t>(v);
}

#if ACT_BF16
// Two bf16 products in one instruction, rounded to nearest even (matmul.cu's mul_bf16x2)
__device__ __forceinline__ unsigned mul_bf16x2(unsigned a, unsigned b) {
    unsigned r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
    return r;
}

// The rotary embedding of paired rows (matmul.cu's Rope): cos_t, sin_t (S, half), row r's position
// pos[r / T * stride] + r % T; output columns below rot are rotated.
struct QuantRope {
    const float* cos_t;
    const float* sin_t;
    const int* pos;
    int T, stride, rot;
};

// cp.async of 16 or 4 bytes to a shared-memory address (16: past L1; 4 through it)
__device__ __forceinline__ void copy_async(unsigned dst, const void* src, int bytes) {
    if (bytes == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
    else asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory"); }

// A warp's stage holds RECS records (QUANT_STAGE_RECORDS_T<tiles>: several records a wait and a __syncwarp,
// whose chains the warp interleaves, where the registers allow), 80 RECS uint4: record j's weights at 64 j
// (rows g and g + 8 of the warp's 16: 2 x 32 slots of 16 bytes, a lane's own), then its rows' scales at
// 64 RECS + 16 j (8 slots a row of the two, each row's piece of scales holding the record's chunks': int4 pieces
// of 16 or 8 bytes a record (groups of 32, 64) or of 4 bytes a group; int8 4 bytes, groups 2p, 2p + 1), 4 bytes
// a lane: the four lanes of a row share its slot, so the scales take a quarter of the bytes they would copied
// whole by each lane

// Records rec0 .. rec0 + RECS - 1 (those below end) of a lane's rows into the stage at shared address `stage`:
// the 16 bytes of each row (wrow: its record 0) and its 4 bytes of each row's piece of scales (srow: its piece 0)
template <bool INT4, int RECS>
__device__ __forceinline__ void copy_stage(unsigned stage, const uint4* const (&wrow)[2],
                                           const unsigned char* const (&srow)[2], int rec0, int end,
                                           int group_shift) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int bytes = piece_bytes(INT4, group_shift);
#pragma unroll
    for (int j = 0; j < RECS; ++j) {
        const int rec = rec0 + j;
        if (j && rec >= end) break;  // the warp alike
        const int piece = INT4 ? (4 * rec) >> max(group_shift, 2) : ((2 * rec) >> group_shift) >> 1;
        const int at = 8 * bytes * piece + 4 * t;  // a tile's 8 rows' pieces
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            // a tile's record: 8 rows x 4 lanes x 16 bytes
            copy_async(stage + 16 * (64 * j + 32 * h + lane), wrow[h] + 32 * rec, 16);
            if (4 * t < bytes) copy_async(stage + 16 * (64 * RECS + 16 * j + 8 * h + g) + 4 * t, srow[h] + at, 4);
        }
    }
}

// The scales of a record's chunks, as copy_stage left them: (d | m << 16) or d in the low 16 bits
template <bool INT4>
__device__ __forceinline__ void record_scales(uint4 v, int rec, int group_shift, unsigned (&s)[INT4 ? 4 : 2]) {
    if constexpr (INT4) {
        if (group_shift == 0) s[0] = v.x, s[1] = v.y, s[2] = v.z, s[3] = v.w;
        else if (group_shift == 1) s[0] = s[1] = v.x, s[2] = s[3] = v.y;
        else s[0] = s[1] = s[2] = s[3] = v.x;
    } else if (group_shift == 0) {
        s[0] = v.x & 0xffffu, s[1] = v.x >> 16;
    } else {  // the record's one group, the low or high half of its piece
        s[0] = s[1] = (((2 * rec) >> group_shift) & 1) ? v.x >> 16 : v.x & 0xffffu;
    }
}

// out (N, O) (+)= [rmsnorm] x (N, I) @ W^T; TILES tiles of 8 rows of x a block (0: one row). scales: rows of `groups` groups.
template <int TILES, bool INT4, bool GAIN>
__device__ __forceinline__ void quant_matmul(void* __restrict__ out, const bf16* __restrict__ x,
                                             const unsigned char* __restrict__ w,
                                             const unsigned short* __restrict__ scales, int N, int O, int I,
                                             int pieces, int group_shift, int row_phase, int out_f32, int accumulate,
                                             const bf16* __restrict__ gain, float* __restrict__ rstd, float eps,
                                             int half, bf16* __restrict__ glu_out, const bf16* __restrict__ bias,
                                             QuantRope rope, int row_blocks) {
    constexpr int CHUNKS = INT4 ? 4 : 2;
    constexpr int LOADS = INT4 ? QUANT_LOADS_INT4 : QUANT_LOADS_INT8;  // records in flight a warp
    constexpr int RECS = TILES == 0   ? QUANT_STAGE_RECORDS_T0
                         : TILES == 1 ? QUANT_STAGE_RECORDS_T1
                         : TILES == 2 ? QUANT_STAGE_RECORDS_T2
                                      : QUANT_STAGE_RECORDS_T4;  // records a stage
    constexpr int STAGE = 80 * RECS;  // uint4 a stage (copy_stage)
    // TILES 0: one row of x (N = 1), whose sums are the C fragment's even columns alone: the odd ones are not
    // accumulated (the even ones' instructions are those of any N: the same bits)
    constexpr int NT = TILES ? TILES : 1;
    constexpr bool ONE = TILES == 0;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, split = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x / row_blocks, row0 = (blockIdx.x % row_blocks) * 8 * NT;
    // this lane's rows of W (A's rows g, g + 8): 16 in a row, or 8 pairs (i, i + half); past the end, the last
    const uint4* wrow[2];
    const unsigned char* srow[2];
    {
        int r[2];
        if (half) {
            const int pair = min(tile * 8 + g, O / 2 - 1);
            r[0] = pair / half * 2 * half + pair % half, r[1] = r[0] + half;
        } else {
            r[0] = min(tile * 16 + g, O - 1), r[1] = min(tile * 16 + g + 8, O - 1);
        }
        const long long row_bytes = INT4 ? I / 2 : I;
        const int piece = piece_bytes(INT4, group_shift);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            wrow[h] = reinterpret_cast<const uint4*>(tiled_row(w, 8 * row_bytes, 64, r[h] + row_phase)) + t;
            srow[h] = tiled_row(scales, 8LL * pieces * piece, piece, r[h] + row_phase);
        }
    }
    const int records = I / (32 * CHUNKS);
    const int first = warp * records / split, end = (warp + 1) * records / split;  // this warp's records
    // LOADS / RECS stages a warp of STAGE uint4 each (copy_stage)
    // (dynamic shared memory: split x (LOADS x 1,280 + 576) bytes; then the warps' sums, [W's row][x's
    // row], the squares of x's row n at [n][8])
    constexpr int STAGES = LOADS / RECS;
    static_assert(STAGES * RECS == LOADS && STAGES >= 2, "whole stages, one in use while the next land");
    extern __shared__ uint4 ring[];
    uint4* const mine = ring + warp * STAGES * STAGE;
    const unsigned shared_mine = (unsigned)__cvta_generic_to_shared(mine);
    float(*partial)[16][9] = reinterpret_cast<float(*)[16][9]>(ring + split * STAGES * STAGE);
    const int stages = (end - first + RECS - 1) / RECS;  // this warp's
#pragma unroll
    for (int u = 0; u < STAGES - 1; ++u) {  // before the wait: the weights are no kernel's output
        if (u < stages)
            copy_stage<INT4, RECS>(shared_mine + 16 * u * STAGE, wrow, srow, first + RECS * u, end, group_shift);
        commit_copies();
    }
    let_next_launch();
    wait_for_inputs();
    // x's row of this lane in each tile (past N: the last row; an mma's columns are independent, and those
    // columns' sums are never stored), as 32-bit offsets from x (N <= 64: no overflow), half a pointer's registers
    int xrow[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) xrow[nt] = min(row0 + 8 * nt + g, N - 1) * I + 8 * t;
    const unsigned ones[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};
    float acc[NT][4], squares[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[nt][j] = squares[nt][j] = 0.f;
    // record `rec`, j-th of the stage at st: every product and sum in record order, chunk by chunk, whatever RECS
    auto record = [&](const uint4* st, int j, int rec) {
        const uint4 q[2] = {st[64 * j + lane], st[64 * j + 32 + lane]};
        unsigned sc[2][CHUNKS];
        record_scales<INT4>(st[64 * RECS + 16 * j + g], rec, group_shift, sc[0]);
        record_scales<INT4>(st[64 * RECS + 16 * j + 8 + g], rec, group_shift, sc[1]);
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int at = 32 * (rec * CHUNKS + c);  // the chunk's first element
            unsigned a[2][4];  // rows g, g + 8: pairs of elements (0, 1), (2, 3), (4, 5), (6, 7)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned words[4] = {q[h].x, q[h].y, q[h].z, q[h].w};
                if constexpr (INT4) int4_pairs(words[c], a[h]);
                else int8_pairs(words[2 * c], words[2 * c + 1], a[h]);
            }
            const uint4 gv = GAIN ? *reinterpret_cast<const uint4*>(gain + at + 8 * t) : make_uint4(0u, 0u, 0u, 0u);
            const float d0 = half_to_float(sc[0][c] & 0xffffu), d1 = half_to_float(sc[1][c] & 0xffffu);
            // int4's A is 128 + q: d sum (128 + q) x + (m - 128 d) sum x = d sum q x + m sum x
            const float m0 = INT4 ? __fmaf_rn(-128.f, d0, half_to_float(sc[0][c] >> 16)) : 0.f;
            const float m1 = INT4 ? __fmaf_rn(-128.f, d1, half_to_float(sc[1][c] >> 16)) : 0.f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const uint4 xv = *reinterpret_cast<const uint4*>(x + xrow[nt] + at);
                const uint4 bv = GAIN ? make_uint4(mul_bf16x2(xv.x, gv.x), mul_bf16x2(xv.y, gv.y),
                                                   mul_bf16x2(xv.z, gv.z), mul_bf16x2(xv.w, gv.w))
                                      : xv;
                const unsigned b[2][2] = {{bv.x, bv.y}, {bv.z, bv.w}};
                float qx[4] = {0.f, 0.f, 0.f, 0.f}, sx[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int s = 0; s < 2; ++s) {
                    const unsigned as[4] = {a[0][2 * s], a[1][2 * s], a[0][2 * s + 1], a[1][2 * s + 1]};
                    mma_bf16(qx, as, b[s]);
                    if constexpr (INT4) mma_bf16(sx, ones, b[s]);
                }
                if constexpr (GAIN) {  // x's rows times themselves: the squares' sums on the diagonal
                    const unsigned x0[4] = {xv.x, 0u, xv.y, 0u}, x1[4] = {xv.z, 0u, xv.w, 0u};
                    const unsigned b0[2] = {xv.x, xv.y}, b1[2] = {xv.z, xv.w};
                    mma_bf16(squares[nt], x0, b0);
                    mma_bf16(squares[nt], x1, b1);
                }
                // rounded as written, whatever the template (no contraction that could differ with NT)
                acc[nt][0] = __fmaf_rn(d0, qx[0], acc[nt][0]);
                if (!ONE) acc[nt][1] = __fmaf_rn(d0, qx[1], acc[nt][1]);
                acc[nt][2] = __fmaf_rn(d1, qx[2], acc[nt][2]);
                if (!ONE) acc[nt][3] = __fmaf_rn(d1, qx[3], acc[nt][3]);
                if constexpr (INT4) {
                    acc[nt][0] = __fmaf_rn(m0, sx[0], acc[nt][0]);
                    if (!ONE) acc[nt][1] = __fmaf_rn(m0, sx[1], acc[nt][1]);
                    acc[nt][2] = __fmaf_rn(m1, sx[2], acc[nt][2]);
                    if (!ONE) acc[nt][3] = __fmaf_rn(m1, sx[3], acc[nt][3]);
                }
            }
        }
    };
    for (int s = 0, stage = 0; s < stages; ++s, stage = stage == STAGES - 1 ? 0 : stage + 1) {
        // the stage STAGES - 1 ahead into the one the last stage left (its reads are done: used)
        const int ahead = stage == 0 ? STAGES - 1 : stage - 1;
        __syncwarp();  // the warp's reads of that stage's scales are done before any lane copies into it
        if (s + STAGES - 1 < stages)
            copy_stage<INT4, RECS>(shared_mine + 16 * ahead * STAGE, wrow, srow, first + RECS * (s + STAGES - 1), end,
                             group_shift);
        commit_copies();
        wait_copies<STAGES - 1>();  // this stage's copies are done, each lane's,
        __syncwarp();               // and every lane's: a row's scales come from its four lanes
        const uint4* st = mine + stage * STAGE;
        const int rec0 = first + RECS * s;
        if (rec0 + RECS <= end) {  // a whole stage: its records' chains interleaved
#pragma unroll
            for (int j = 0; j < RECS; ++j) record(st, j, rec0 + j);
        } else {  // the warp's last stage, part full
#pragma unroll
            for (int j = 0; j < RECS; ++j)
                if (rec0 + j < end) record(st, j, rec0 + j);
        }
    }
    wait_copies<0>();
    // the warps' sums added in warp order, a tile of x's rows at a time; then the epilogue (matmul.cu's)
    const int pairs = O / 2, rows_a_tile = half ? 8 : 16, items = rows_a_tile * 8;
    const int fstep = half ? half : 1;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        if (row0 + 8 * nt >= N) break;  // the whole block alike
        if (nt) __syncthreads();  // the last tile's sums are read
        partial[warp][g][2 * t] = acc[nt][0];
        partial[warp][g][2 * t + 1] = acc[nt][1];
        partial[warp][g + 8][2 * t] = acc[nt][2];
        partial[warp][g + 8][2 * t + 1] = acc[nt][3];
        if (GAIN && t == g >> 1) partial[warp][g][8] = squares[nt][g & 1];  // x's row g: C[g][g]
        __syncthreads();
        for (int item = threadIdx.x; item < items; item += blockDim.x) {
            const int m = item % rows_a_tile, n = item / rows_a_tile, row = row0 + 8 * nt + n;
            if (row >= N) continue;
            int frow;
            if (half) {
                const int pair = tile * 8 + m;
                if (pair >= pairs) continue;
                frow = pair / half * 2 * half + pair % half;
            } else {
                frow = tile * 16 + m;
                if (frow >= O) continue;
            }
            float v[2] = {partial[0][m][n], half ? partial[0][m + 8][n] : 0.f};
            float s = partial[0][n][8];
            for (int k = 1; k < split; ++k) {
                v[0] = __fadd_rn(v[0], partial[k][m][n]);
                if (half) v[1] = __fadd_rn(v[1], partial[k][m + 8][n]);
                s = __fadd_rn(s, partial[k][n][8]);
            }
            if constexpr (GAIN) {
                const float rs = 1.f / sqrtf(s / I + eps);
                v[0] = __fmul_rn(v[0], rs), v[1] = __fmul_rn(v[1], rs);
                if (tile == 0 && m == 0) rstd[row] = rs;
            }
            if (bias) {
                v[0] = __fadd_rn(v[0], to_float(bias[frow]));
                if (half) v[1] = __fadd_rn(v[1], to_float(bias[frow + fstep]));
            }
            const long long at = (long long)row * O + frow;
            if (accumulate) {
                v[0] = __fadd_rn(v[0], load_out(out, at, out_f32));
                if (half) v[1] = __fadd_rn(v[1], load_out(out, at + fstep, out_f32));
            }
            if (half) {
                const bool rotates = rope.cos_t && frow < rope.rot;
                if (glu_out || rotates) {  // from the values as stored
                    v[0] = out_f32 ? v[0] : to_float(from_float<act_t>(v[0]));
                    v[1] = out_f32 ? v[1] : to_float(from_float<act_t>(v[1]));
                }
                const int pair = tile * 8 + m;
                if (glu_out) glu_out[(long long)row * pairs + pair] = from_float<act_t>(v[0] / (1.f + expf(-v[0])) * v[1]);
                if (rotates) {
                    const long long p = (long long)(rope.pos[row / rope.T * rope.stride] + row % rope.T) * half + pair % half;
                    rotate_pair(v[0], v[1], rope.cos_t[p], rope.sin_t[p], v[0], v[1]);
                }
                store_out(out, at + fstep, v[1], out_f32);
            }
            store_out(out, at, v[0], out_f32);
        }
    }
}

// Grid: (ceil(N / (8 NT)) blocks of x's rows) x (tiles: ceil(O / 16), or ceil(O / 2 / 8) pairs), the row
// blocks of a tile next to each other; blocks of 32 x split warps (split <= QUANT_SPLIT: a row's k-split).
#define QUANT_PARAMS                                                                                              \
    void *out, const bf16 *x, const unsigned char *w, const unsigned short *scales, int N, int O, int I,          \
        int pieces, int group_shift, int row_phase, int out_f32, int accumulate, const bf16 *gain, float *rstd,  \
        float eps, int half, bf16 *glu_out, const bf16 *bias, const float *cos_t, const float *sin_t,            \
        const int *pos, int T, int pos_stride, int rot, int row_blocks
#define QUANT_MATMUL(NT, NAME, INT4, GAIN)                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * QUANT_SPLIT, QUANT_BLOCKS) NAME##_t##NT(QUANT_PARAMS) {      \
        quant_matmul<NT, INT4, GAIN>(out, x, w, scales, N, O, I, pieces, group_shift, row_phase, out_f32,        \
                                     accumulate, gain, rstd, eps, half, glu_out, bias,                            \
                                     QuantRope{cos_t, sin_t, pos, T, pos_stride, rot}, row_blocks);               \
    }
// quant_matmul_<type>[_norm]_t<tiles of x>: with and without RMSNorm folded in; t0: one row, t1, t2, t4: up to 8,
// 16, 32 rows a block (every output's sums the same instructions in the same order whatever the tiles)
QUANT_MATMUL(0, quant_matmul_int4, true, false)
QUANT_MATMUL(0, quant_matmul_int8, false, false)
QUANT_MATMUL(0, quant_matmul_int4_norm, true, true)
QUANT_MATMUL(0, quant_matmul_int8_norm, false, true)
QUANT_MATMUL(1, quant_matmul_int4, true, false)
QUANT_MATMUL(2, quant_matmul_int4, true, false)
QUANT_MATMUL(1, quant_matmul_int8, false, false)
QUANT_MATMUL(2, quant_matmul_int8, false, false)
QUANT_MATMUL(1, quant_matmul_int4_norm, true, true)
QUANT_MATMUL(2, quant_matmul_int4_norm, true, true)
QUANT_MATMUL(1, quant_matmul_int8_norm, false, true)
QUANT_MATMUL(2, quant_matmul_int8_norm, false, true)
QUANT_MATMUL(4, quant_matmul_int4, true, false)
QUANT_MATMUL(4, quant_matmul_int8, false, false)
QUANT_MATMUL(4, quant_matmul_int4_norm, true, true)
QUANT_MATMUL(4, quant_matmul_int8_norm, false, true)
#endif

// An integer 0 <= u < 2^23 as the exact float u - bias: 2^23 + u from its bits, less 2^23 + bias (an or and an
// add; no int-to-float conversion, which issues at a fraction of the float rate)
__device__ __forceinline__ float exact_float(unsigned u, float bias) {
    return __uint_as_float(0x4B000000u | u) - (8388608.0f + bias);
}

// 16 bytes at p (16-byte aligned) in one store: written out, as the compiler splits a uint4 store of this kernel
// into four 4-byte ones (it cannot show the alignment)
__device__ __forceinline__ void store16(void* p, unsigned a, unsigned b, unsigned c, unsigned d) {
    asm volatile("st.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// 8 consecutive dequantized elements as act_t: one 16-byte store (bf16) or two (float)
__device__ __forceinline__ void store8(act_t* p, const float (&v)[8]) {
#if ACT_BF16
    store16(p, pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]), pack_bf16x2(v[6], v[7]));
#else
#pragma unroll
    for (int h = 0; h < 2; ++h)
        store16(p + 4 * h, __float_as_uint(v[4 * h]), __float_as_uint(v[4 * h + 1]), __float_as_uint(v[4 * h + 2]),
                __float_as_uint(v[4 * h + 3]));
#endif
}

// out (R, I) act_t = rows 0 .. R - 1 of W (row 0 at row_phase of its tile), dequantized. A block of 256 threads
// takes 8 records of one tile of 8 rows (grid (tiles, records / 8)): a warp a record, so that it reads the tile's
// contiguous 512 bytes, lane 4p + t row p's 16 bytes of lane t; the lane writes the 8 elements of each chunk of
// those (32 chunk + 8t ..) as one 16-byte store (bf16; two for float): 64 bytes of a row per four lanes.
extern "C" __global__ void __launch_bounds__(256) quant_dequantize(
    act_t* __restrict__ out, const unsigned char* __restrict__ w, const unsigned short* __restrict__ scales, int R,
    int row_phase, int I, int pieces, int group_shift, int int4) {
    const int chunks = int4 ? 4 : 2, records = I / (32 * chunks);
    const int rec = blockIdx.y * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31, p = lane >> 2, t = lane & 3;
    const int tile_row = blockIdx.x * 8 + p, r = tile_row - row_phase;
    if (rec >= records || r < 0 || r >= R) return;
    const long long row_bytes = int4 ? I / 2 : I;
    const uint4 v = reinterpret_cast<const uint4*>(w + blockIdx.x * 8 * row_bytes)[32 * rec + lane];
    const int piece = piece_bytes(int4, group_shift);
    const unsigned char* srow = tiled_row(scales, 8LL * pieces * piece, piece, tile_row);
    const unsigned words[4] = {v.x, v.y, v.z, v.w};
    act_t* row = out + (long long)r * I;
    float e[8];
    if (int4) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            // the group's (d, m): byte b of the row's scales, in piece b / piece (a power of two: no division)
            const int chunk = rec * 4 + c, b = 4 * (chunk >> group_shift);
            const unsigned dm = *reinterpret_cast<const unsigned*>(srow + (long long)(b & -piece) * 8 + (b & (piece - 1)));
            const float d = half_to_float(dm & 0xffff), m = half_to_float(dm >> 16);
#pragma unroll
            for (int i = 0; i < 4; ++i) {  // nibble i element 2i, nibble 4 + i element 2i + 1
                e[2 * i] = fmaf(d, exact_float((words[c] >> (4 * i)) & 15u, 0.0f), m);
                e[2 * i + 1] = fmaf(d, exact_float((words[c] >> (4 * i + 16)) & 15u, 0.0f), m);
            }
            store8(row + 32 * chunk + 8 * t, e);
        }
    } else {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int chunk = rec * 2 + c, b = 2 * (chunk >> group_shift);
            const float d = half_to_float(*reinterpret_cast<const unsigned short*>(srow + (b & -4) * 8 + (b & 3)));
#pragma unroll
            for (int k = 0; k < 2; ++k)  // a word's bytes: elements 0, 2, 1, 3 (+ 4k), each q + 128
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    e[4 * k + (j & 1) * 2 + (j >> 1)] = d * exact_float((words[2 * c + k] >> (8 * j)) & 0xffu, 128.0f);
            store8(row + 32 * chunk + 8 * t, e);
        }
    }
}
