// RMSNorm with a gain: one warp per row of C values (any C), so the row's sum of squares is a warp reduction.
// The gain's gradient is reduced without atomics (per-block partial sums, then one pass over the blocks in a
// fixed order), so the backward gives the same bits on every run.
#include "common.cuh"

// out (N, C) = x * rstd * w, rstd (N,) = 1 / sqrt(mean(x^2) + eps).
extern "C" __global__ void rmsnorm_forward(act_t* __restrict__ out, float* __restrict__ rstd,
                                           const act_t* __restrict__ x, const act_t* __restrict__ w,
                                           int N, int C, float eps) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return;
    const act_t* xr = x + (long long)row * C;
    float ss = 0.f;
    for (int c = lane; c < C; c += 32) {
        const float v = to_float(xr[c]);
        ss += v * v;
    }
    ss = warp_sum(ss);
    const float r = 1.f / sqrtf(ss / C + eps);
    if (lane == 0) rstd[row] = r;
    act_t* orow = out + (long long)row * C;
    for (int c = lane; c < C; c += 32) orow[c] = from_float<act_t>(to_float(xr[c]) * r * to_float(w[c]));
}

// dx (N, C) += r * (g - xhat * mean(g * xhat)) with g = dout * w, xhat = x * r (the residual gradient
// accumulates); dw_partial (gridDim.x, C) = this block's sum over its rows of dout * xhat. Lane l of a warp
// owns columns l, l + 32, ..., so each warp keeps its partial in its own shared row (dynamic, warps * C
// floats) without atomics; the warps' rows are added in order at the end.
extern "C" __global__ void rmsnorm_backward(act_t* __restrict__ dx, float* __restrict__ dw_partial,
                                            const act_t* __restrict__ dout, const act_t* __restrict__ x,
                                            const act_t* __restrict__ w, const float* __restrict__ rstd,
                                            int N, int C) {
    extern __shared__ float dw_part[];
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float* mine = dw_part + warp * C;
    for (int c = lane; c < C; c += 32) mine[c] = 0.f;
    for (int row = blockIdx.x * warps + warp; row < N; row += gridDim.x * warps) {
        const act_t* xr = x + (long long)row * C;
        const act_t* dr = dout + (long long)row * C;
        const float r = rstd[row];
        float dot = 0.f;
        for (int c = lane; c < C; c += 32) dot += to_float(dr[c]) * to_float(w[c]) * (to_float(xr[c]) * r);
        dot = warp_sum(dot) / C;
        act_t* dxr = dx + (long long)row * C;
        for (int c = lane; c < C; c += 32) {
            const float xhat = to_float(xr[c]) * r, d = to_float(dr[c]);
            dxr[c] = from_float<act_t>(to_float(dxr[c]) + r * (d * to_float(w[c]) - xhat * dot));
            mine[c] += d * xhat;
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float s = 0.f;
        for (int k = 0; k < warps; ++k) s += dw_part[k * C + c];
        dw_partial[(long long)blockIdx.x * C + c] = s;
    }
}

// dw (C,) += sum over the blocks of dw_partial (blocks, C), in block order.
extern "C" __global__ void rmsnorm_dw_reduce(float* __restrict__ dw, const float* __restrict__ dw_partial,
                                             int blocks, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float s = 0.f;
    for (int k = 0; k < blocks; ++k) s += dw_partial[(long long)k * C + c];
    dw[c] += s;
}
