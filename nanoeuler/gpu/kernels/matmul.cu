// Matrix products of a few rows: out (N, O) = x (N, I) @ w (O, I)^T, N <= MATMUL_SMALL_ROWS, for decoding.
// cuBLAS does the training products; at batch 1 a product is a matrix-vector product, bound by reading w
// once, and cuBLAS through CuPy cannot be recorded into a CUDA graph. Here a warp owns output columns o (rows
// of w): it streams w's row with 16-byte loads (8 bf16 or 4 float) and dots it with every row of x (which
// stays in L1), accumulating in float32; a block is 8 warps. out is act_t or float32 (the logits), and the
// product is added to it with accumulate (the residual stream).
//
// With a gain g (norm != 0) the product is RMSNorm's folded in: out = (x * rstd * g) @ w^T, computed as
// rstd * ((x * g) @ w^T), each warp summing the rows' squares in the same pass over x (no extra pass and no
// barrier; warp 0 of block 0 stores rstd). It saves decoding a launch and a round trip per sublayer.
#include "common.cuh"

#define MATMUL_SMALL_ROWS 8

constexpr int PACK = 16 / sizeof(act_t);  // elements a 16-byte load brings

template <int P>
__device__ __forceinline__ void load_pack(float (&r)[P], const act_t* p) {
    if constexpr (P == 8) {
        const uint4 u = *reinterpret_cast<const uint4*>(p);
        const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) r[2 * i] = __uint_as_float(w[i] << 16), r[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
        load_vec<4>(r, p);
    }
}

// Elements i..i+V-1 of row r of x into v (V = PACK from one 16-byte load, or 1), and of the gain into g.
template <int V>
__device__ __forceinline__ void load_row(float (&v)[V], const act_t* p) {
    if constexpr (V == 1) v[0] = to_float(*p);
    else load_pack(v, p);
}

// packed: I is a multiple of PACK and x, w, gain start 16-byte aligned (else a load an element).
template <int V>
__device__ __forceinline__ void matmul_small_warp(void* __restrict__ out, const act_t* __restrict__ x,
                                                  const act_t* __restrict__ w, int N, int O, int I, int o,
                                                  int out_f32, int accumulate, const act_t* __restrict__ gain,
                                                  float* __restrict__ rstd, float eps) {
    const int lane = threadIdx.x & 31;
    const act_t* wo = w + (long long)o * I;
    float acc[MATMUL_SMALL_ROWS], ss[MATMUL_SMALL_ROWS];
#pragma unroll
    for (int r = 0; r < MATMUL_SMALL_ROWS; ++r) acc[r] = ss[r] = 0.f;
#pragma unroll 4
    for (int i = lane * V; i < I; i += 32 * V) {
        float wv[V], g[V];
        load_row(wv, wo + i);
        if (gain) {
            load_row(g, gain + i);
#pragma unroll
            for (int k = 0; k < V; ++k) wv[k] *= g[k];
        }
#pragma unroll
        for (int r = 0; r < MATMUL_SMALL_ROWS; ++r) {
            if (r < N) {
                float xv[V];
                load_row(xv, x + (long long)r * I + i);
#pragma unroll
                for (int k = 0; k < V; ++k) acc[r] += wv[k] * xv[k], ss[r] += xv[k] * xv[k];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MATMUL_SMALL_ROWS; ++r) {
        if (r < N) {
            float v = warp_sum(acc[r]);
            if (gain) {
                const float rs = 1.f / sqrtf(warp_sum(ss[r]) / I + eps);
                v *= rs;
                if (o == 0 && lane == 0) rstd[r] = rs;
            }
            if (lane == 0) {
                const long long at = (long long)r * O + o;
                if (out_f32) {
                    float* dst = static_cast<float*>(out) + at;
                    *dst = accumulate ? *dst + v : v;
                } else {
                    act_t* dst = static_cast<act_t*>(out) + at;
                    *dst = from_float<act_t>(accumulate ? to_float(*dst) + v : v);
                }
            }
        }
    }
}

extern "C" __global__ void matmul_small(void* __restrict__ out, const act_t* __restrict__ x,
                                        const act_t* __restrict__ w, int N, int O, int I, int out_f32,
                                        int accumulate, int packed, const act_t* __restrict__ gain,
                                        float* __restrict__ rstd, float eps) {
    const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= O) return;
    if (packed) matmul_small_warp<PACK>(out, x, w, N, O, I, o, out_f32, accumulate, gain, rstd, eps);
    else matmul_small_warp<1>(out, x, w, N, O, I, o, out_f32, accumulate, gain, rstd, eps);
}

// ids[r] = the index of the largest of logits (R, V)'s row r (the first of equal ones): greedy decoding on
// the device, so a token costs the host one int, not V floats. One block per row.
extern "C" __global__ void argmax_rows(int* __restrict__ ids, const float* __restrict__ logits, int V) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
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
        ids[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;  // a row of NaNs: 0
    }
}
