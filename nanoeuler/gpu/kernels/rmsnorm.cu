// RMSNorm with a gain: one warp per row of C values (any C; rows of a multiple of 4 read and write 4 values a
// lane at once), so the row's sum of squares is a warp reduction. The gain's gradient is reduced without
// atomics (per-block partial sums, then one pass over the blocks in a fixed order), so the backward gives
// the same bits on every run.
#include "common.cuh"

// out (N, C) = x * rstd * w, rstd (N,) = 1 / sqrt(mean(x^2) + eps).
template <int V>
__device__ __forceinline__ void rmsnorm_forward_row(act_t* __restrict__ out, float* __restrict__ rstd,
                                                    const act_t* __restrict__ x, const act_t* __restrict__ w,
                                                    int row, int C, float eps) {
    const int lane = threadIdx.x & 31;
    const act_t* xr = x + (long long)row * C;
    float ss = 0.f;
    for (int c = lane * V; c < C; c += 32 * V) {
        float v[V];
        load_vec<V>(v, xr + c);
#pragma unroll
        for (int i = 0; i < V; ++i) ss += v[i] * v[i];
    }
    ss = warp_sum(ss);
    const float r = 1.f / sqrtf(ss / C + eps);
    if (lane == 0) rstd[row] = r;
    act_t* orow = out + (long long)row * C;
    for (int c = lane * V; c < C; c += 32 * V) {
        float v[V], g[V];
        load_vec<V>(v, xr + c);
        load_vec<V>(g, w + c);
#pragma unroll
        for (int i = 0; i < V; ++i) v[i] *= r * g[i];
        store_vec<V>(orow + c, v);
    }
}

extern "C" __global__ void rmsnorm_forward(act_t* __restrict__ out, float* __restrict__ rstd,
                                           const act_t* __restrict__ x, const act_t* __restrict__ w,
                                           int N, int C, float eps) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    if (C % 4 == 0) rmsnorm_forward_row<4>(out, rstd, x, w, row, C, eps);
    else rmsnorm_forward_row<1>(out, rstd, x, w, row, C, eps);
}

// dx (N, C) += r * (g - xhat * mean(g * xhat)) with g = dout * w, xhat = x * r (the residual gradient
// accumulates); dw_partial (gridDim.x, C) = this block's sum over its rows of dout * xhat. Lane l of a warp
// owns its own columns, so each warp keeps its partial in its own shared row (dynamic, warps * C floats)
// without atomics; the warps' rows are added in order at the end.
template <int V>
__device__ __forceinline__ void rmsnorm_backward_rows(act_t* __restrict__ dx, float* __restrict__ dw_partial,
                                                      const act_t* __restrict__ dout, const act_t* __restrict__ x,
                                                      const act_t* __restrict__ w, const float* __restrict__ rstd,
                                                      int N, int C, float* dw_part) {
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float* mine = dw_part + warp * C;
    for (int c = lane; c < C; c += 32) mine[c] = 0.f;
    __syncwarp();
    for (int row = blockIdx.x * warps + warp; row < N; row += gridDim.x * warps) {
        const act_t* xr = x + (long long)row * C;
        const act_t* dr = dout + (long long)row * C;
        const float r = rstd[row];
        float dot = 0.f;
        for (int c = lane * V; c < C; c += 32 * V) {
            float xv[V], dv[V], wv[V];
            load_vec<V>(xv, xr + c);
            load_vec<V>(dv, dr + c);
            load_vec<V>(wv, w + c);
#pragma unroll
            for (int i = 0; i < V; ++i) dot += dv[i] * wv[i] * (xv[i] * r);
        }
        dot = warp_sum(dot) / C;
        act_t* dxr = dx + (long long)row * C;
        for (int c = lane * V; c < C; c += 32 * V) {
            float xv[V], dv[V], wv[V], acc[V];
            load_vec<V>(xv, xr + c);
            load_vec<V>(dv, dr + c);
            load_vec<V>(wv, w + c);
            load_vec<V>(acc, dxr + c);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const float xhat = xv[i] * r;
                acc[i] += r * (dv[i] * wv[i] - xhat * dot);
                mine[c + i] += dv[i] * xhat;
            }
            store_vec<V>(dxr + c, acc);
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float s = 0.f;
        for (int k = 0; k < warps; ++k) s += dw_part[k * C + c];
        dw_partial[(long long)blockIdx.x * C + c] = s;
    }
}

extern "C" __global__ void rmsnorm_backward(act_t* __restrict__ dx, float* __restrict__ dw_partial,
                                            const act_t* __restrict__ dout, const act_t* __restrict__ x,
                                            const act_t* __restrict__ w, const float* __restrict__ rstd,
                                            int N, int C) {
    extern __shared__ float dw_part[];
    if (C % 4 == 0) rmsnorm_backward_rows<4>(dx, dw_partial, dout, x, w, rstd, N, C, dw_part);
    else rmsnorm_backward_rows<1>(dx, dw_partial, dout, x, w, rstd, N, C, dw_part);
}

// dw (C,) += sum over the blocks of dw_partial (blocks, C), in a fixed order: block (32, 8) threads; column
// c = 32 * blockIdx.x + threadIdx.x, thread row y sums partial rows y, y + 8, ..., then the 8 sums are added
// in order of y.
extern "C" __global__ void rmsnorm_dw_reduce(float* __restrict__ dw, const float* __restrict__ dw_partial,
                                             int blocks, int C) {
    __shared__ float sums[8][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    float s = 0.f;
    if (c < C)
        for (int k = threadIdx.y; k < blocks; k += 8) s += dw_partial[(long long)k * C + c];
    sums[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float total = 0.f;
#pragma unroll
        for (int y = 0; y < 8; ++y) total += sums[y][threadIdx.x];
        dw[c] += total;
    }
}
