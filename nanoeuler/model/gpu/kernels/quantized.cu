// Products with quantized weights (model/quantize.py, docs/quantization.md): out (N, O) = x (N, I) @ W^T where W
// (O, I) is int4 (w = d q + m) or int8 (w = d q) in groups of 32 * 2^k elements along a row (or one group a row),
// read packed from memory
// and dequantized in registers: never a float copy of the matrix.
//
// The weights' GPU layout (model/gpu/quantized.py writes it once, at load): a row is cut into chunks of 32
// elements and the chunks into records of 64 bytes that a warp's 4 lanes t = 0..3 of one row read as one 16-byte
// load each. int4: a record is 4 chunks; lane t's word c holds bytes 4t..4t+3 of chunk c, whose byte j is element
// j (low nibble) and j + 16 (high nibble). int8: a record is 2 chunks; lane t's word 2c + s holds elements
// 16s + 4t .. 16s + 4t + 3 of chunk c. The float16 scales (and int4's minimums, interleaved: (d, m) pairs) are
// group-major, (I / group, O): the 8 rows of a tile read one contiguous run of them.
//
// quant_matmul_*: tensor cores (mma m16n8k16, bf16 x, float32 accumulators). A warp owns 8 rows of W (the mma's
// n) and 1 to 4 tiles of 16 rows of x (the mma's m); the block's warps split a row's records among them, always
// alike (warp w takes records w, w + WARPS, ...), and add their sums in warp order: every output is summed in
// an order set by I alone, whatever N is (batch invariance, as the bf16 products of matmul.cu). The mma's k
// order is permuted within a chunk alike for x and W (lane t's k = 2t, 2t+1 are elements 4t, 4t+1 and
// k = 2t+8, 2t+9 are 4t+2, 4t+3), so that a lane's weights are 4 adjacent bytes. The integers q are exact in
// bf16, and the scale is applied per group (or per record, where a group spans records): sum_k (d q_k + m) x_k
// = d (sum_k q_k x_k) + m (sum_k x_k), the second sum an mma of x with ones. N over 64 (prefill): blocks of 64 rows (grid y), the weights read again
// for each.
//
// quant_dequantize: rows of W as act_t, d q + m in float32 (exact: d q is exact, one rounding of the sum), then
// rounded to act_t: the float32 engine's products (cuBLAS on the dequantized matrix) and the checks.
#include "common.cuh"

#if !defined(QUANT_WARPS) || !defined(QUANT_LOADS)
#error "QUANT_WARPS and QUANT_LOADS come from nanoeuler/model/gpu/constants.py"
#endif

__device__ __forceinline__ float half_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// The 4 int4 of bytes 0, 1 (kstep's low / high nibbles) of a lane's word as bf16x2 pairs of exact integers.
// (0x4300 | q) is the bf16 128 + q; subtracting 128 leaves q.
__device__ __forceinline__ unsigned bf16x2_minus_128(unsigned v) {
    unsigned r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x3F803F80u), "r"(0xC300C300u));
    return r;
}

// int4 word -> B fragments of the chunk's two k-steps: b[s][0] = elements (4t, 4t+1) + 16 s, b[s][1] = (4t+2, 4t+3)
__device__ __forceinline__ void int4_fragments(unsigned w, unsigned (&b)[2][2]) {
    const unsigned p01 = __byte_perm(w, 0u, 0x4140), p23 = __byte_perm(w, 0u, 0x4342);  // bytes in 16-bit lanes
    b[0][0] = bf16x2_minus_128((p01 & 0x000F000Fu) | 0x43004300u);
    b[0][1] = bf16x2_minus_128((p23 & 0x000F000Fu) | 0x43004300u);
    b[1][0] = bf16x2_minus_128(((p01 >> 4) & 0x000F000Fu) | 0x43004300u);
    b[1][1] = bf16x2_minus_128(((p23 >> 4) & 0x000F000Fu) | 0x43004300u);
}

// Signed byte i of w as an exact float: 0x4B0000uu is 2^23 + uu, uu the byte with its sign bit flipped.
__device__ __forceinline__ float int8_at(unsigned flipped, int i) {
    return __uint_as_float(__byte_perm(flipped, 0x4Bu, 0x4550 | i)) - 8388736.0f;  // 2^23 + 128
}

// int8 word (4 elements) -> one k-step's B fragment: (e0, e1), (e2, e3)
__device__ __forceinline__ void int8_fragment(unsigned w, unsigned (&b)[2]) {
    const unsigned f = w ^ 0x80808080u;
    b[0] = pack_bf16x2(int8_at(f, 0), int8_at(f, 1));
    b[1] = pack_bf16x2(int8_at(f, 2), int8_at(f, 3));
}

__device__ __forceinline__ float load_out(const void* out, long long at, int out_f32) {
    return out_f32 ? static_cast<const float*>(out)[at] : to_float(static_cast<const act_t*>(out)[at]);
}

__device__ __forceinline__ void store_out(void* out, long long at, float v, int out_f32) {
    if (out_f32) static_cast<float*>(out)[at] = v;
    else static_cast<act_t*>(out)[at] = from_float<act_t>(v);
}

#if ACT_BF16
// out (N, O) (+)= x (N, I) @ W^T; scales: int4 (d, m) float16 pairs, int8 d, at [group * scale_stride + row]
// (scale_stride: the rows of the whole matrix, of which W may be a slice starting at row 0 of `scales`).
template <int MT, bool INT4>
__device__ __forceinline__ void quant_matmul(void* __restrict__ out, const bf16* __restrict__ x,
                                             const uint4* __restrict__ w, const unsigned short* __restrict__ scales,
                                             int N, int O, int I, int group_shift, int scale_stride, int out_f32,
                                             int accumulate) {
    constexpr int CHUNKS = INT4 ? 4 : 2;  // chunks of 32 elements a 64-byte record
    __shared__ float partial[QUANT_WARPS][MT * 4][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int o0 = blockIdx.x * 8, row0 = blockIdx.y * 64;
    const int records = I / (32 * CHUNKS);
    const uint4* wrow = w + (long long)min(o0 + g, O - 1) * records * 4 + t;  // B's column g: row o0 + g of W
    const int oa = min(o0 + 2 * t, O - 1), ob = min(o0 + 2 * t + 1, O - 1);  // the accumulators' columns
    const bf16* xr[MT][2];  // x's rows g and g + 8 of each tile, or null past N
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row0 + 16 * mt + 8 * h + g;
            xr[mt][h] = r < N ? x + (long long)r * I + 4 * t : nullptr;
        }
    const unsigned ones[2] = {0x3F803F80u, 0x3F803F80u};
    float acc[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;

    wait_for_inputs();
    for (int first = warp; first < records; first += QUANT_WARPS * QUANT_LOADS) {
        // several records in flight before any is used, with their chunks' scales (columns oa, ob): a scale
        // loaded when its group ends would put a memory latency on every group's path
        uint4 loaded[QUANT_LOADS];
        unsigned sa[QUANT_LOADS][CHUNKS], sb[QUANT_LOADS][CHUNKS];
#pragma unroll
        for (int u = 0; u < QUANT_LOADS; ++u) {
            const int rec = min(first + u * QUANT_WARPS, records - 1);  // past the end: a record never used
            loaded[u] = __ldg(wrow + (long long)rec * 4);
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                const long long at = (long long)((rec * CHUNKS + c) >> group_shift) * scale_stride;
                if constexpr (INT4) {
                    const unsigned* dm = reinterpret_cast<const unsigned*>(scales) + at;
                    sa[u][c] = __ldg(dm + oa), sb[u][c] = __ldg(dm + ob);
                } else {
                    sa[u][c] = __ldg(scales + at + oa), sb[u][c] = __ldg(scales + at + ob);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < QUANT_LOADS; ++u) {
            const int rec = first + u * QUANT_WARPS;
            if (rec >= records) break;
            const unsigned words[4] = {loaded[u].x, loaded[u].y, loaded[u].z, loaded[u].w};
            // a group's sums: sum q x and sum x over its chunks in this record, scaled once the group ends
            float qx[MT][4], sx[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < 4; ++j) qx[mt][j] = sx[mt][j] = 0.f;
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                const int chunk = rec * CHUNKS + c, group = chunk >> group_shift;
                unsigned b[2][2];
                if constexpr (INT4) {
                    int4_fragments(words[c], b);
                } else {
                    int8_fragment(words[2 * c], b[0]);
                    int8_fragment(words[2 * c + 1], b[1]);
                }
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int s = 0; s < 2; ++s) {
                        const int at = 32 * chunk + 16 * s;
                        const uint2 lo = xr[mt][0] ? *reinterpret_cast<const uint2*>(xr[mt][0] + at) : make_uint2(0u, 0u);
                        const uint2 hi = xr[mt][1] ? *reinterpret_cast<const uint2*>(xr[mt][1] + at) : make_uint2(0u, 0u);
                        const unsigned a[4] = {lo.x, hi.x, lo.y, hi.y};
                        mma_bf16(qx[mt], a, b[s]);
                        if constexpr (INT4) mma_bf16(sx[mt], a, ones);
                    }
                if (c != CHUNKS - 1 && ((chunk + 1) >> group_shift) == group) continue;  // the group goes on
                const float da = half_to_float(sa[u][c] & 0xffff), db = half_to_float(sb[u][c] & 0xffff);
                const float ma = INT4 ? half_to_float(sa[u][c] >> 16) : 0.f, mb = INT4 ? half_to_float(sb[u][c] >> 16) : 0.f;
                // rounded as written, whatever the template (no contraction that could differ with MT)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const float d = (j & 1) ? db : da, m = (j & 1) ? mb : ma;
                        const float part = INT4 ? __fmaf_rn(d, qx[mt][j], __fmul_rn(m, sx[mt][j])) : __fmul_rn(d, qx[mt][j]);
                        acc[mt][j] = __fadd_rn(acc[mt][j], part);
                        qx[mt][j] = sx[mt][j] = 0.f;
                    }
            }
        }
    }
    // the warps' sums added in warp order
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < 4; ++j) partial[warp][4 * mt + j][lane] = acc[mt][j];
    __syncthreads();
    let_next_launch();
    if (warp != 0) return;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float v = partial[0][4 * mt + j][lane];
#pragma unroll
            for (int k = 1; k < QUANT_WARPS; ++k) v = __fadd_rn(v, partial[k][4 * mt + j][lane]);
            const int r = row0 + 16 * mt + g + 8 * (j >> 1), o = o0 + 2 * t + (j & 1);
            if (r >= N || o >= O) continue;
            const long long at = (long long)r * O + o;
            store_out(out, at, accumulate ? __fadd_rn(load_out(out, at, out_f32), v) : v, out_f32);
        }
}

#define QUANT_MATMUL(MT, NAME, INT4)                                                                               \
    extern "C" __global__ void __launch_bounds__(32 * QUANT_WARPS)                                                \
        NAME##_t##MT(void* out, const bf16* x, const uint4* w, const unsigned short* scales, int N, int O, int I, \
                     int group_shift, int scale_stride, int out_f32, int accumulate) {                            \
        quant_matmul<MT, INT4>(out, x, w, scales, N, O, I, group_shift, scale_stride, out_f32, accumulate);       \
    }
QUANT_MATMUL(1, quant_matmul_int4, true)
QUANT_MATMUL(2, quant_matmul_int4, true)
QUANT_MATMUL(3, quant_matmul_int4, true)
QUANT_MATMUL(4, quant_matmul_int4, true)
QUANT_MATMUL(1, quant_matmul_int8, false)
QUANT_MATMUL(2, quant_matmul_int8, false)
QUANT_MATMUL(3, quant_matmul_int8, false)
QUANT_MATMUL(4, quant_matmul_int8, false)
#endif

// out (R, I) act_t = rows first .. first + R - 1 of W, dequantized; a thread a 16-byte load of a record.
extern "C" __global__ void quant_dequantize(act_t* __restrict__ out, const uint4* __restrict__ w,
                                           const unsigned short* __restrict__ scales, int R, int first, int I,
                                           int group_shift, int scale_stride, int int4) {
    const int chunks = int4 ? 4 : 2, records = I / (32 * chunks);
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)R * records * 4) return;
    const int r = (int)(i / (records * 4)), rec = (int)(i / 4 % records), t = (int)(i % 4);
    const int o = first + r;
    const uint4 v = w[((long long)o * records + rec) * 4 + t];
    const unsigned words[4] = {v.x, v.y, v.z, v.w};
    act_t* row = out + (long long)r * I;
    for (int c = 0; c < chunks; ++c) {
        const int chunk = rec * chunks + c, group = chunk >> group_shift;
        if (int4) {
            const unsigned dm = reinterpret_cast<const unsigned*>(scales)[(long long)group * scale_stride + o];
            const float d = half_to_float(dm & 0xffff), m = half_to_float(dm >> 16);
            for (int j = 0; j < 4; ++j) {
                const unsigned byte = (words[c] >> (8 * j)) & 0xff;
                row[32 * chunk + 4 * t + j] = from_float<act_t>(fmaf(d, (float)(byte & 15), m));
                row[32 * chunk + 16 + 4 * t + j] = from_float<act_t>(fmaf(d, (float)(byte >> 4), m));
            }
        } else {
            const float d = half_to_float(scales[(long long)group * scale_stride + o]);
            for (int s = 0; s < 2; ++s)
                for (int j = 0; j < 4; ++j) {
                    const int q = (int)(signed char)((words[2 * c + s] >> (8 * j)) & 0xff);
                    row[32 * chunk + 16 * s + 4 * t + j] = from_float<act_t>(d * (float)q);
                }
        }
    }
}
