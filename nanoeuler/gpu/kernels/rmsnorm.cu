// RMSNorm with a gain: one warp per row of C values (any C), so the row's sum of squares is a warp reduction.
#include "common.cuh"

// out (N, C) = x * rstd * w, rstd (N,) = 1 / sqrt(mean(x^2) + eps).
extern "C" __global__ void rmsnorm_forward(float* __restrict__ out, float* __restrict__ rstd,
                                           const float* __restrict__ x, const float* __restrict__ w,
                                           int N, int C, float eps) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return;
    const float* xr = x + (long long)row * C;
    float ss = 0.f;
    for (int c = lane; c < C; c += 32) ss += xr[c] * xr[c];
    ss = warp_sum(ss);
    const float r = 1.f / sqrtf(ss / C + eps);
    if (lane == 0) rstd[row] = r;
    float* orow = out + (long long)row * C;
    for (int c = lane; c < C; c += 32) orow[c] = xr[c] * r * w[c];
}

// dx (N, C) += r * (g - xhat * mean(g * xhat)) with g = dout * w, xhat = x * r (the residual gradient
// accumulates); dw (C,) += sum over rows of dout * xhat. Each block walks many rows, sums its share of dw
// in shared memory (dynamic, C floats) and adds that to dw once, so global atomics stay few.
extern "C" __global__ void rmsnorm_backward(float* __restrict__ dx, float* __restrict__ dw,
                                            const float* __restrict__ dout, const float* __restrict__ x,
                                            const float* __restrict__ w, const float* __restrict__ rstd,
                                            int N, int C) {
    extern __shared__ float dw_part[];
    for (int c = threadIdx.x; c < C; c += blockDim.x) dw_part[c] = 0.f;
    __syncthreads();
    const int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    for (int row = blockIdx.x * warps + (threadIdx.x >> 5); row < N; row += gridDim.x * warps) {
        const float* xr = x + (long long)row * C;
        const float* dr = dout + (long long)row * C;
        const float r = rstd[row];
        float dot = 0.f;
        for (int c = lane; c < C; c += 32) dot += dr[c] * w[c] * (xr[c] * r);
        dot = warp_sum(dot) / C;
        float* dxr = dx + (long long)row * C;
        for (int c = lane; c < C; c += 32) {
            const float xhat = xr[c] * r;
            dxr[c] += r * (dr[c] * w[c] - xhat * dot);
            atomicAdd(&dw_part[c], dr[c] * xhat);
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) atomicAdd(&dw[c], dw_part[c]);
}
