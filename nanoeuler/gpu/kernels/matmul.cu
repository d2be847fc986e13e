// Matrix products of a few rows: out (N, O) = x (N, I) @ w (O, I)^T, N <= MATMUL_SMALL_ROWS, for decoding.
// cuBLAS does the training products; at batch 1 a product is a matrix-vector product, bound by reading w
// once, and cuBLAS through CuPy cannot be recorded into a CUDA graph. A decoding step is a chain of such
// products, each too small to keep the memory busy for long, so what counts is the latency of one: every
// lane issues all its loads of w (up to LOADS 16-byte loads, 8 bf16 or 4 float) before it uses the first, and
// the whole matrix is in flight at once. x's rows (and the gain) are read by every warp of a block: the
// builds for more than one row copy them into shared memory once (dynamic: N x I elements, and I for the
// gain) rather than each lane holding its share of every row in registers beside w's loads (that cost the
// 4-row build of a speculative step 179 registers and a block an SM, and its products 1.4 to 1.9x the
// time of one row's); one row stays in registers, where the copy's barrier would cost a plain step 14%
// (H100, `base`). `split` consecutive warps of a block (8 warps) own an output column o
// (a row of w), each taking every split-th 32 * PACK-element stretch of the row; their float32 partial sums
// meet in shared memory in a fixed order. out is act_t or float32 (the logits); with accumulate the product
// is added to it (the residual stream), the old value read at the start.
//
// With a gain g (norm != 0) the product is RMSNorm's folded in: out = (x * rstd * g) @ w^T, computed as
// rstd * ((x * g) @ w^T), the rows' squares summed in the same pass over x (column 0 stores rstd).
//
// Paired rows (half > 0): column o takes w's rows i and i + half, i = (o / half) * 2 half + o % half, writing
// out's columns i and i + half, and then
// - glu (the feed-forward's gate|up product, w (2F, I), half = F): also SwiGLU's silu(gate) * up (from the
//   rounded values, as swiglu_forward computes it) to glu_out (N, F);
// - rope (the attention's qkv product, half = D/2): the pair is rotated by the rotary embedding (rounded
//   first, as rope_forward finds it in qkv) at position *pos + (row % T) when i < rot (the q and k heads).
// Each saves decoding a launch a layer.
//
// A lane's sums run in the same order for any number of rows (the split layers.py picks depends on I only),
// so a speculative step's rows get plain decoding's bits.
#include "common.cuh"

#define MATMUL_SMALL_ROWS 8
#define LOADS 4  // the 16-byte loads of w a lane has in flight; layers.py picks split for it

// The raw bits of V elements: one 16-byte load (V = PACK) or one element (V = 1, rows of odd length).
template <int V>
struct Raw {
    uint4 u;
};
template <>
struct Raw<1> {
    act_t e;
};

template <int V>
__device__ __forceinline__ Raw<V> load_raw(const act_t* p) {
    Raw<V> r;
    if constexpr (V == 1) r.e = *p;
    else r.u = *reinterpret_cast<const uint4*>(p);
    return r;
}

template <int V>
__device__ __forceinline__ void unpack(float (&r)[V], const Raw<V>& raw) {
    if constexpr (V == 1) r[0] = to_float(raw.e);
    else unpack16(r, raw.u);
}

__device__ __forceinline__ float load_out(const void* out, long long at, int out_f32) {
    return out_f32 ? static_cast<const float*>(out)[at] : to_float(static_cast<const act_t*>(out)[at]);
}

__device__ __forceinline__ void store_out(void* out, long long at, float v, int out_f32) {
    if (out_f32) static_cast<float*>(out)[at] = v;
    else static_cast<act_t*>(out)[at] = from_float<act_t>(v);
}

// n elements from src to dst in shared memory, by the whole block: 16 bytes a copy straight into shared memory
// when packed (cp.async: all of a thread's copies in flight at once), else one element a copy. The caller
// waits (staged_wait) and syncs the block.
__device__ __forceinline__ void stage(act_t* dst, const act_t* src, int n, int packed) {
    if (packed) {
        for (int j = threadIdx.x * PACK; j < n; j += blockDim.x * PACK) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
            const unsigned to = (unsigned)__cvta_generic_to_shared(dst + j);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to), "l"(src + j));
#else
            *reinterpret_cast<uint4*>(dst + j) = *reinterpret_cast<const uint4*>(src + j);
#endif
        }
    } else {
        for (int j = threadIdx.x; j < n; j += blockDim.x) dst[j] = src[j];
    }
}

__device__ __forceinline__ void staged_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// The rotary embedding of the pair product (rope: cos_t, sin_t (S, half), the first row's position *pos, T rows
// a sequence, rotated rows below rot).
struct Rope {
    const float* cos_t;
    const float* sin_t;
    const int* pos;
    int T, rot;
};

// W: weight rows a column takes (2 when paired); R: the rows of x the kernel is built for (N <= R). packed: I
// is a multiple of PACK and x, w, gain start 16-byte aligned (else V = 1, a load an element).
template <int V, int W, int R>
__device__ __forceinline__ void matmul_small_block(void* __restrict__ out, const act_t* __restrict__ x,
                                                   const act_t* __restrict__ w, int N, int O, int I, int split,
                                                   int out_f32, int accumulate, const act_t* __restrict__ gain,
                                                   float* __restrict__ rstd, float eps, int half,
                                                   act_t* __restrict__ glu_out, Rope rope) {
    constexpr int SLOTS = (W + 1) * R;  // per warp: W dot products and the squares, per row
    __shared__ float partial[8][SLOTS];
    extern __shared__ __align__(16) unsigned char matmul_staged[];
    act_t* xs = reinterpret_cast<act_t*>(matmul_staged);  // x (N, I), then the gain (I)
    act_t* gs = xs + N * I;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = warp % split;
    const int cols = O / W, o = blockIdx.x * (8 / split) + warp / split;
    const int row0 = W == 1 ? o : o / half * 2 * half + o % half;  // w's (and out's) first row of the column
    const bool finisher = sub == 0 && o < cols && lane < N;  // lane r of the column's first warp ends row r
    let_next_launch();
    const int stride = split * 32 * V;
    int base = (sub * 32 + lane) * V;
    Raw<V> wr[W][LOADS];  // the weights of a round of loads; the first round's go out before the wait
    const auto load_weights = [&]() {
#pragma unroll
        for (int p = 0; p < LOADS; ++p) {
            const int i = base + p * stride;
            if (o < cols && i < I) {
#pragma unroll
                for (int k = 0; k < W; ++k) wr[k][p] = load_raw<V>(w + (long long)(row0 + k * half) * I + i);
            }
        }
    };
    load_weights();
    float cs = 1.f, sn = 0.f;  // the rotation
    const bool rotates = W == 2 && rope.cos_t && finisher && row0 < rope.rot;
    if (rotates) {
        const long long at = (long long)(*rope.pos + lane % rope.T) * half + o % half;
        cs = rope.cos_t[at], sn = rope.sin_t[at];
    }
    wait_for_inputs();
    constexpr bool STAGED = R > 1;  // x's rows and the gain from shared memory, else from registers
    if constexpr (STAGED) {
        stage(xs, x, N * I, V > 1);
        if (gain) stage(gs, gain, I, V > 1);
    }
    float prior[W];  // what is accumulated onto
#pragma unroll
    for (int k = 0; k < W; ++k)
        prior[k] = finisher && accumulate ? load_out(out, (long long)lane * O + row0 + k * half, out_f32) : 0.f;
    float acc[W][R], ss[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        ss[r] = 0.f;
#pragma unroll
        for (int k = 0; k < W; ++k) acc[k][r] = 0.f;
    }
    if constexpr (STAGED) {
        staged_wait();
        __syncthreads();
    }
    if (o < cols) {
        for (bool first = true; base < I; base += LOADS * stride, first = false) {
            if (!first) load_weights();
            Raw<V> gr[LOADS], xr[R][LOADS];  // unstaged: a round's gain and x, loaded together
            if constexpr (!STAGED) {
#pragma unroll
                for (int p = 0; p < LOADS; ++p) {
                    const int i = base + p * stride;
                    if (i < I) {
                        if (gain) gr[p] = load_raw<V>(gain + i);
#pragma unroll
                        for (int r = 0; r < R; ++r)
                            if (r < N) xr[r][p] = load_raw<V>(x + (long long)r * I + i);
                    }
                }
            }
#pragma unroll
            for (int p = 0; p < LOADS; ++p) {
                const int i = base + p * stride;
                if (i < I) {
                    float wv[W][V];
#pragma unroll
                    for (int k = 0; k < W; ++k) unpack(wv[k], wr[k][p]);
                    if (gain) {
                        float g[V];
                        unpack(g, STAGED ? load_raw<V>(gs + i) : gr[p]);
#pragma unroll
                        for (int k = 0; k < W; ++k)
#pragma unroll
                            for (int e = 0; e < V; ++e) wv[k][e] *= g[e];
                    }
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        if (r < N) {
                            float xv[V];
                            unpack(xv, STAGED ? load_raw<V>(xs + r * I + i) : xr[r][p]);
#pragma unroll
                            for (int e = 0; e < V; ++e) {
                                ss[r] += xv[e] * xv[e];
#pragma unroll
                                for (int k = 0; k < W; ++k) acc[k][r] += wv[k][e] * xv[e];
                            }
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (r < N) {
#pragma unroll
            for (int k = 0; k < W; ++k) acc[k][r] = warp_sum(acc[k][r]);
            if (gain) ss[r] = warp_sum(ss[r]);
            if (lane == 0) {
#pragma unroll
                for (int k = 0; k < W; ++k) partial[warp][k * R + r] = acc[k][r];
                partial[warp][W * R + r] = ss[r];
            }
        }
    }
    __syncthreads();
    if (!finisher) return;
    const int r = lane;
    float v[W], s = 0.f;
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = 0.f;
    for (int j = 0; j < split; ++j) {
#pragma unroll
        for (int k = 0; k < W; ++k) v[k] += partial[warp + j][k * R + r];
        s += partial[warp + j][W * R + r];
    }
    if (gain) {
        const float rs = 1.f / sqrtf(s / I + eps);
#pragma unroll
        for (int k = 0; k < W; ++k) v[k] *= rs;
        if (o == 0) rstd[r] = rs;
    }
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] += prior[k];
    if constexpr (W == 2) {
        if (glu_out || rotates) {  // from the values as stored
            v[0] = out_f32 ? v[0] : to_float(from_float<act_t>(v[0]));
            v[1] = out_f32 ? v[1] : to_float(from_float<act_t>(v[1]));
        }
        if (glu_out) glu_out[(long long)r * cols + o] = from_float<act_t>(v[0] / (1.f + expf(-v[0])) * v[1]);
        if (rotates) rotate_pair(v[0], v[1], cs, sn, v[0], v[1]);
    }
#pragma unroll
    for (int k = 0; k < W; ++k) store_out(out, (long long)r * O + row0 + k * half, v[k], out_f32);
}

template <int W, int R>
__device__ __forceinline__ void matmul_small_rows(void* out, const act_t* x, const act_t* w, int N, int O, int I,
                                                  int split, int out_f32, int accumulate, int packed,
                                                  const act_t* gain, float* rstd, float eps, int half,
                                                  act_t* glu_out, Rope rope) {
    if (packed)
        matmul_small_block<PACK, W, R>(out, x, w, N, O, I, split, out_f32, accumulate, gain, rstd, eps, half, glu_out, rope);
    else
        matmul_small_block<1, W, R>(out, x, w, N, O, I, split, out_f32, accumulate, gain, rstd, eps, half, glu_out, rope);
}

// Grid: ceil(columns / (8 / split)) blocks of 256 threads, x's rows (and the gain) as dynamic shared memory
// where R > 1; split in {1, 2, 4, 8}; half 0 (plain) or the pairing distance, with glu_out (SwiGLU's output)
// or cos_t (the rotary embedding). matmul_small_rR takes up to R rows (its sums R a lane): r1 for batch-1 decoding, r4 for
// a speculative verification of 4 tokens, r8 for a prompt's chunks.
#define MATMUL_SMALL(NAME, R)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256)                                                            \
        NAME(void* __restrict__ out, const act_t* __restrict__ x, const act_t* __restrict__ w, int N, int O,     \
             int I, int split, int out_f32, int accumulate, int packed, const act_t* __restrict__ gain,          \
             float* __restrict__ rstd, float eps, int half, act_t* __restrict__ glu_out,                         \
             const float* __restrict__ cos_t, const float* __restrict__ sin_t, const int* __restrict__ pos,      \
             int T, int rot) {                                                                                   \
        const Rope rope{cos_t, sin_t, pos, T, rot};                                                              \
        if (half) matmul_small_rows<2, R>(out, x, w, N, O, I, split, out_f32, accumulate, packed, gain, rstd,   \
                                          eps, half, glu_out, rope);                                             \
        else matmul_small_rows<1, R>(out, x, w, N, O, I, split, out_f32, accumulate, packed, gain, rstd, eps,   \
                                     half, glu_out, rope);                                                       \
    }
MATMUL_SMALL(matmul_small_r1, 1)
MATMUL_SMALL(matmul_small_r2, 2)
MATMUL_SMALL(matmul_small_r4, 4)
MATMUL_SMALL(matmul_small_r8, MATMUL_SMALL_ROWS)

// ids[r] = the index of the largest of logits (R, V)'s row r (the first of equal ones): greedy decoding on
// the device, so a token costs the host one int, not V floats. With a log (S, R), also log[*pos, r]: the ids
// of consecutive decoding steps, which the host reads back together. One block per row.
extern "C" __global__ void argmax_rows(int* __restrict__ ids, const float* __restrict__ logits, int V,
                                       int* __restrict__ log, const int* __restrict__ pos) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    let_next_launch();
    wait_for_inputs();
    const float* row = logits + (long long)blockIdx.x * V;
    float bv = neg_inf();
    int bi = 0x7fffffff;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        const float x = row[v];
        if (x > bv) bv = x, bi = v;  // ascending v: the first of equal ones stays
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
        const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) best_v[warp] = bv, best_i[warp] = bi;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
            if (best_v[w] > bv || (best_v[w] == bv && best_i[w] < bi)) bv = best_v[w], bi = best_i[w];
        bi = bi == 0x7fffffff ? 0 : bi;  // a row of NaNs: 0
        ids[blockIdx.x] = bi;
        if (log) log[(long long)*pos * gridDim.x + blockIdx.x] = bi;
    }
}
