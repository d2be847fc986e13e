// Products of a few rows for decoding: out (N, O) = x (N, I) @ w (O, I)^T, N <= FEW_ROWS, on the tensor cores
// (x's rows are the A operand's rows g, 8 rows of w the B operand). Every output element is its own dot
// product, summed in an order that depends on I alone, so a speculative step's rows get plain decoding's bits.
// out is act_t or float32 (the logits); with accumulate the product is added to it. Folded in: RMSNorm with a
// gain g, as rstd * (x @ act_t(w * g)^T); and with half > 0, w's rows paired (i, i + half) for SwiGLU
// (glu_out) or the rotary embedding (rope). docs/gpu-engine.md has the design and its measurements.
#include "common.cuh"

#if !defined(FEW_ROWS) || !defined(MATMUL_SMALL_WARPS) || !defined(MATMUL_SMALL_LOADS)
#error "FEW_ROWS, MATMUL_SMALL_WARPS and MATMUL_SMALL_LOADS come from nanoeuler/model/gpu/constants.py"
#endif
static_assert(FEW_ROWS <= 8, "x's rows are the 8 rows g of the mma fragments");

__device__ __forceinline__ float load_out(const void* out, long long at, int out_f32) {
    return out_f32 ? static_cast<const float*>(out)[at] : to_float(static_cast<const act_t*>(out)[at]);
}

__device__ __forceinline__ void store_out(void* out, long long at, float v, int out_f32) {
    if (out_f32) static_cast<float*>(out)[at] = v;
    else static_cast<act_t*>(out)[at] = from_float<act_t>(v);
}

// acc (x's rows g, g + 8 x w's rows 2t, 2t + 1) += the products of a thread's 16 bytes of x's row g (a) and
// of w's row g (b): two k-steps, the first two 32-bit words in the first.
__device__ __forceinline__ void mma_chunk(float (&acc)[4], uint4 a, uint4 b) {
    const unsigned av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int s = 0; s < 4; s += 2) {
        const unsigned as[4] = {av[s], 0u, av[s + 1], 0u}, bs[2] = {bv[s], bv[s + 1]};  // x's rows 8..15 zero
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

// The rotary embedding of the pair product (rope: cos_t, sin_t (S, half), the first row's position *pos, T rows
// a sequence, rotated rows below rot).
struct Rope {
    const float* cos_t;
    const float* sin_t;
    const int* pos;
    int T, rot;
};

// W: 1 (a block's 8 rows of w are 8 columns) or 2 (4 pairs). Grid: a block 8 rows, `warps` warps of 32 threads.
template <int W, bool PACKED>
__device__ __forceinline__ void matmul_small_tile(void* __restrict__ out, const act_t* __restrict__ x,
                                                  const act_t* __restrict__ w, int N, int O, int I, int out_f32,
                                                  int accumulate, const act_t* __restrict__ gain,
                                                  float* __restrict__ rstd, float eps, int half,
                                                  act_t* __restrict__ glu_out, Rope rope,
                                                  float (*partial)[8][9]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int cols = O / W;  // columns, or pairs
    // the row of w this thread loads: the block's column g
    const int lcol = W == 1 ? blockIdx.x * 8 + g : blockIdx.x * 4 + g / 2;
    const int lrow = W == 1 ? lcol : lcol / half * 2 * half + lcol % half + (g & 1) * half;
    const act_t* wrow = w + (long long)lrow * I;
    const bool loads_w = lcol < cols, loads_x = g < N;
    // what this thread finishes: x's row g, tile columns 2t and 2t + 1 (a column pair or a pair's two rows)
    const int fcol = W == 1 ? blockIdx.x * 8 + 2 * t : blockIdx.x * 4 + t;
    const int frow = W == 1 ? fcol : fcol / half * 2 * half + fcol % half;  // out's first column written
    const int fstep = W == 1 ? 1 : half;                                     // and the second's distance
    const bool finisher = warp == 0 && loads_x && fcol < cols;
    let_next_launch();
    // a round: MATMUL_SMALL_LOADS consecutive k-blocks a warp (4 threads x PACK elements each), warps side by side
    const int step = 4 * PACK, stride = warps * MATMUL_SMALL_LOADS * step;
    const int warp_own = warp * MATMUL_SMALL_LOADS * step, own = warp_own + t * PACK;
    uint4 wr[MATMUL_SMALL_LOADS];
    const auto load_weights = [&](int r0) {  // with the gain: w * g, rounded to act_t
#pragma unroll
        for (int p = 0; p < MATMUL_SMALL_LOADS; ++p)
            wr[p] = loads_w ? load_chunk<PACKED>(wrow, r0 + own + p * step, I) : make_uint4(0u, 0u, 0u, 0u);
        if (gain && loads_w) {
#pragma unroll
            for (int p = 0; p < MATMUL_SMALL_LOADS; ++p) {
                float wv[PACK], gv[PACK];
                unpack16(wv, wr[p]);
                unpack16(gv, load_chunk<PACKED>(gain, r0 + own + p * step, I));
#pragma unroll
                for (int e = 0; e < PACK; ++e) wv[e] *= gv[e];
                wr[p] = pack16(wv);
            }
        }
    };
    load_weights(0);  // before the wait: w and the gain are no kernel's output
    float cs = 1.f, sn = 0.f;  // the rotation
    const bool rotates = W == 2 && rope.cos_t && finisher && frow < rope.rot;
    if (rotates) {
        const long long at = (long long)(*rope.pos + g % rope.T) * half + fcol % half;
        cs = rope.cos_t[at], sn = rope.sin_t[at];
    }
    wait_for_inputs();
    float prior[2] = {0.f, 0.f};  // what is accumulated onto
    if (finisher && accumulate) {
        prior[0] = load_out(out, (long long)g * O + frow, out_f32);
        if (W == 2 || fcol + 1 < cols) prior[1] = load_out(out, (long long)g * O + frow + fstep, out_f32);
    }
    const act_t* xrow = x + (long long)g * I;
    float acc[4] = {0.f, 0.f, 0.f, 0.f}, ss = 0.f;
    for (int r0 = 0; r0 < I; r0 += stride) {
        if (r0) load_weights(r0);
        uint4 xr[MATMUL_SMALL_LOADS];
#pragma unroll
        for (int p = 0; p < MATMUL_SMALL_LOADS; ++p)
            xr[p] = loads_x ? load_chunk<PACKED>(xrow, r0 + own + p * step, I) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int p = 0; p < MATMUL_SMALL_LOADS; ++p)
            if (r0 + warp_own + p * step < I) mma_chunk(acc, xr[p], wr[p]);  // the warp's block holds some of I
        if (gain && loads_x) {  // the squares of x, off the products' path
#pragma unroll
            for (int p = 0; p < MATMUL_SMALL_LOADS; ++p) {
                float xv[PACK];
                unpack16(xv, xr[p]);
#pragma unroll
                for (int e = 0; e < PACK; ++e) ss += xv[e] * xv[e];
            }
        }
    }
    ss += __shfl_xor_sync(FULL_MASK, ss, 1);
    ss += __shfl_xor_sync(FULL_MASK, ss, 2);
    partial[warp][g][2 * t] = acc[0];
    partial[warp][g][2 * t + 1] = acc[1];
    if (t == 0) partial[warp][g][8] = ss;
    __syncthreads();
    if (!finisher) return;
    float v[2] = {0.f, 0.f}, s = 0.f;
    for (int j = 0; j < warps; ++j) {
        v[0] += partial[j][g][2 * t];
        v[1] += partial[j][g][2 * t + 1];
        s += partial[j][g][8];
    }
    if (gain) {
        const float rs = 1.f / sqrtf(s / I + eps);
        v[0] *= rs, v[1] *= rs;
        if (blockIdx.x == 0 && t == 0) rstd[g] = rs;
    }
    v[0] += prior[0], v[1] += prior[1];
    if constexpr (W == 2) {
        if (glu_out || rotates) {  // from the values as stored
            v[0] = out_f32 ? v[0] : to_float(from_float<act_t>(v[0]));
            v[1] = out_f32 ? v[1] : to_float(from_float<act_t>(v[1]));
        }
        if (glu_out) glu_out[(long long)g * cols + fcol] = from_float<act_t>(v[0] / (1.f + expf(-v[0])) * v[1]);
        if (rotates) rotate_pair(v[0], v[1], cs, sn, v[0], v[1]);
    }
    store_out(out, (long long)g * O + frow, v[0], out_f32);
    if (W == 2 || fcol + 1 < cols) store_out(out, (long long)g * O + frow + fstep, v[1], out_f32);
}

// Grid: ceil(columns / 8) blocks (ceil(pairs / 4) when paired) of 32 x warps threads, warps <=
// MATMUL_SMALL_WARPS; half 0 (plain) or the pairing distance, with glu_out (SwiGLU's output) or cos_t (the
// rotary embedding). Registers held to 80 so that the largest product of `base` runs in one wave (CUDA 12.4+;
// older compilers bound the block size only).
#if defined(__CUDACC_VER_MAJOR__) && __CUDACC_VER_MAJOR__ * 100 + __CUDACC_VER_MINOR__ >= 1204
#define MATMUL_SMALL_BOUNDS __maxnreg__(80)
#else
#define MATMUL_SMALL_BOUNDS __launch_bounds__(32 * MATMUL_SMALL_WARPS, 1)
#endif
extern "C" __global__ void MATMUL_SMALL_BOUNDS
    matmul_small(void* __restrict__ out, const act_t* __restrict__ x, const act_t* __restrict__ w, int N, int O,
                 int I, int out_f32, int accumulate, int packed, const act_t* __restrict__ gain,
                 float* __restrict__ rstd, float eps, int half, act_t* __restrict__ glu_out,
                 const float* __restrict__ cos_t, const float* __restrict__ sin_t, const int* __restrict__ pos, int T,
                 int rot) {
    __shared__ float partial[MATMUL_SMALL_WARPS][8][9];  // a warp's 8 x 8 sums (rows g), and the squares
    const Rope rope{cos_t, sin_t, pos, T, rot};
#define MATMUL_SMALL_TILE(W, PACKED)                                                                               \
    matmul_small_tile<W, PACKED>(out, x, w, N, O, I, out_f32, accumulate, gain, rstd, eps, half, glu_out, rope,  \
                                 partial)
    if (half && packed) MATMUL_SMALL_TILE(2, true);
    else if (half) MATMUL_SMALL_TILE(2, false);
    else if (packed) MATMUL_SMALL_TILE(1, true);
    else MATMUL_SMALL_TILE(1, false);
}
