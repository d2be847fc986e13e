// Matrix products of a few rows: out (N, O) = x (N, I) @ w (O, I)^T, N <= MATMUL_SMALL_ROWS, for decoding.
// cuBLAS does the training products; at batch 1 a product is a matrix-vector product, bound by reading w
// once, and cuBLAS through CuPy cannot be recorded into a CUDA graph. Here a warp owns output columns o (rows
// of w): it streams w's row with 16-byte loads (8 bf16 or 4 float) and dots it with every row of x (which
// stays in L1), accumulating in float32; a block is 8 warps. out is act_t or float32 (the logits), and the
// product is added to it with accumulate (the residual stream).
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

// packed: I is a multiple of PACK and x, w start 16-byte aligned (else a load an element).
extern "C" __global__ void matmul_small(void* __restrict__ out, const act_t* __restrict__ x,
                                        const act_t* __restrict__ w, int N, int O, int I, int out_f32,
                                        int accumulate, int packed) {
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= O) return;
    const act_t* wo = w + (long long)o * I;
    float acc[MATMUL_SMALL_ROWS];
#pragma unroll
    for (int r = 0; r < MATMUL_SMALL_ROWS; ++r) acc[r] = 0.f;
    if (packed) {
#pragma unroll 4
        for (int i = lane * PACK; i < I; i += 32 * PACK) {
            float wv[PACK];
            load_pack(wv, wo + i);
#pragma unroll
            for (int r = 0; r < MATMUL_SMALL_ROWS; ++r) {
                if (r < N) {
                    float xv[PACK];
                    load_pack(xv, x + (long long)r * I + i);
#pragma unroll
                    for (int k = 0; k < PACK; ++k) acc[r] += wv[k] * xv[k];
                }
            }
        }
    } else {
        for (int i = lane; i < I; i += 32) {
            const float wv = to_float(wo[i]);
#pragma unroll
            for (int r = 0; r < MATMUL_SMALL_ROWS; ++r)
                if (r < N) acc[r] += wv * to_float(x[(long long)r * I + i]);
        }
    }
#pragma unroll
    for (int r = 0; r < MATMUL_SMALL_ROWS; ++r) {
        if (r < N) {
            const float v = warp_sum(acc[r]);
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
