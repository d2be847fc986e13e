// RMSNorm with a gain: one warp per row of C values, so the row's sum of squares is a warp reduction. The
// gain's gradient is reduced without atomics (per-block partial sums, then one pass over the blocks in a
// fixed order), so the backward gives the same bits on every run. Two builds of each pass: rows held in
// registers (the *_k<K> kernels: C a multiple of 16 bytes of elements, up to 32 elements a lane), and the
// generic kernels for any other C (rows of a multiple of 4 read and write 4 values a lane at once).
#include "common.cuh"

#ifndef RMSNORM_ROWS_CHUNKS
#error "RMSNORM_ROWS_CHUNKS comes from nanoeuler/model/gpu/constants.py"
#endif

// The two reductions both builds share. A row's rstd = 1 / sqrt(mean(x^2) + eps) from each lane's share ss of
// its sum of squares (the warp's lanes added); lane 0 writes it to rstd[row].
__device__ __forceinline__ float row_rstd(float ss, float* __restrict__ rstd, int row, int C, float eps, int lane) {
    ss = warp_sum(ss);
    const float r = 1.f / sqrtf(ss / C + eps);
    if (lane == 0) rstd[row] = r;
    return r;
}

// A thread's share of a row's sum of squares: its K chunks of PACK elements, in order.
template <int K>
__device__ __forceinline__ float chunk_squares(const uint4 (&xu)[K]) {
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        float v[PACK];
        unpack16(v, xu[k]);
#pragma unroll
        for (int i = 0; i < PACK; ++i) ss += v[i] * v[i];
    }
    return ss;
}

// 16 bytes of a row normed: x * rstd * the gain's (g), rounded to act_t.
__device__ __forceinline__ uint4 normed_chunk(uint4 x, uint4 g, float r) {
    float v[PACK], gv[PACK];
    unpack16(v, x);
    unpack16(gv, g);
#pragma unroll
    for (int i = 0; i < PACK; ++i) v[i] *= r * gv[i];
    return pack16(v);
}

// dw_partial's row blockIdx.x (C,) = the sum of the block's warps' gain partials, dw_part (warps * C floats,
// each warp's row written by it), added in order of warp once every warp is done.
__device__ __forceinline__ void sum_warp_rows(float* __restrict__ dw_partial, const float* dw_part, int C) {
    const int warps = blockDim.x >> 5;
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float s = 0.f;
        for (int k = 0; k < warps; ++k) s += dw_part[k * C + c];
        dw_partial[(long long)blockIdx.x * C + c] = s;
    }
}

// The parameters of both builds' backward (dw_part: the block's dynamic shared memory).
#define RMSNORM_BACKWARD_PARAMS                                                                                 \
    act_t *__restrict__ dx, float *__restrict__ dw_partial, const act_t *__restrict__ dout,                    \
        const act_t *__restrict__ x, const act_t *__restrict__ w, const float *__restrict__ rstd, int N, int C, \
        float *dw_part

// ------------------------------------------------------------------------ rows held in registers
// Lane l of a warp owns the 16-byte chunks l, l + 32, ..., l + 32 (K - 1) of every row (chunks past C masked
// off): it issues the K loads of its share of a row at once, keeps the row (bf16 still packed) from the sum to
// the update instead of reading it again, and owns the same gain columns in every row, so the backward keeps
// its share of the gain's gradient in registers across its rows.
template <int K>
__device__ __forceinline__ void load_chunks(uint4 (&u)[K], const act_t* __restrict__ row, int C, int lane) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int c = (k * 32 + lane) * PACK;
        u[k] = c < C ? *reinterpret_cast<const uint4*>(row + c) : make_uint4(0u, 0u, 0u, 0u);  // 0 is 0.0f
    }
}

// out (N, C) = x * rstd * w, rstd (N,) = 1 / sqrt(mean(x^2) + eps); the generic kernel's arithmetic. skip
// (null or (N, C)) receives a copy of x: the residual stream's next buffer (layers.py: rmsnorm_matmul_forward).
template <int K>
__device__ __forceinline__ void rmsnorm_forward_regs(act_t* __restrict__ out, float* __restrict__ rstd,
                                                     const act_t* __restrict__ x, const act_t* __restrict__ w,
                                                     int N, int C, float eps, act_t* __restrict__ skip) {
    const int lane = threadIdx.x & 31, row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    uint4 xu[K], wu[K];
    load_chunks<K>(xu, x + (long long)row * C, C, lane);
    load_chunks<K>(wu, w, C, lane);
    const float r = row_rstd(chunk_squares<K>(xu), rstd, row, C, eps, lane);
    act_t* orow = out + (long long)row * C;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int c = (k * 32 + lane) * PACK;
        if (c >= C) continue;
        *reinterpret_cast<uint4*>(orow + c) = normed_chunk(xu[k], wu[k], r);
        if (skip) *reinterpret_cast<uint4*>(skip + (long long)row * C + c) = xu[k];
    }
}

// The generic backward's arithmetic (below), the row's dx loaded with x and dout before the row's sum; the
// lane's gain partials stay in registers over the warp's rows, then go to the warp's shared row (warps * C
// floats) once, and the warps' rows are added in order.
template <int K>
__device__ __forceinline__ void rmsnorm_backward_regs(RMSNORM_BACKWARD_PARAMS) {
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    uint4 wu[K];
    load_chunks<K>(wu, w, C, lane);
    float dw[K][PACK];
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
        for (int i = 0; i < PACK; ++i) dw[k][i] = 0.f;
    for (int row = blockIdx.x * warps + warp; row < N; row += gridDim.x * warps) {
        const long long off = (long long)row * C;
        uint4 xu[K], du[K], au[K];
        load_chunks<K>(xu, x + off, C, lane);
        load_chunks<K>(du, dout + off, C, lane);
        load_chunks<K>(au, dx + off, C, lane);
        const float r = rstd[row];
        float dot = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            float xv[PACK], dv[PACK], wv[PACK];
            unpack16(xv, xu[k]);
            unpack16(dv, du[k]);
            unpack16(wv, wu[k]);
#pragma unroll
            for (int i = 0; i < PACK; ++i) dot += dv[i] * wv[i] * (xv[i] * r);
        }
        dot = warp_sum(dot) / C;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int c = (k * 32 + lane) * PACK;
            if (c >= C) continue;
            float xv[PACK], dv[PACK], wv[PACK], acc[PACK];
            unpack16(xv, xu[k]);
            unpack16(dv, du[k]);
            unpack16(wv, wu[k]);
            unpack16(acc, au[k]);
#pragma unroll
            for (int i = 0; i < PACK; ++i) {
                const float xhat = xv[i] * r;
                acc[i] += r * (dv[i] * wv[i] - xhat * dot);
                dw[k][i] += dv[i] * xhat;
            }
            *reinterpret_cast<uint4*>(dx + off + c) = pack16(acc);
        }
    }
    float* mine = dw_part + warp * C;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int c = (k * 32 + lane) * PACK;
        if (c >= C) continue;
#pragma unroll
        for (int i = 0; i < PACK; ++i) mine[c + i] = dw[k][i];
    }
    sum_warp_rows(dw_partial, dw_part, C);
}

// One kernel per K (layers.py picks the smallest K that holds a row), each with the registers of its own K.
// The backward's blocks an SM, RMSNORM_BACKWARD_BLOCKS_K<K>, come from layers.py, which sizes its grid by them
// (nanoeuler/model/gpu/constants.py: rmsnorm_backward_blocks); a K without one does not compile.
#define RMSNORM_REGS(K)                                                                                          \
    extern "C" __global__ void rmsnorm_forward_k##K(act_t* __restrict__ out, float* __restrict__ rstd,          \
                                                    const act_t* __restrict__ x, const act_t* __restrict__ w,   \
                                                    int N, int C, float eps, act_t* __restrict__ skip) {        \
        rmsnorm_forward_regs<K>(out, rstd, x, w, N, C, eps, skip);                                              \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(256, RMSNORM_BACKWARD_BLOCKS_K##K) rmsnorm_backward_k##K(       \
        act_t* __restrict__ dx, float* __restrict__ dw_partial, const act_t* __restrict__ dout,                 \
        const act_t* __restrict__ x, const act_t* __restrict__ w, const float* __restrict__ rstd, int N, int C) {\
        extern __shared__ float dw_part[];                                                                      \
        rmsnorm_backward_regs<K>(dx, dw_partial, dout, x, w, rstd, N, C, dw_part);                             \
    }
RMSNORM_REGS(1)
RMSNORM_REGS(2)
RMSNORM_REGS(3)
RMSNORM_REGS(4)
#if !ACT_BF16  // float: 4 elements a chunk, so up to 8 chunks for 32 elements a lane
RMSNORM_REGS(6)
RMSNORM_REGS(8)
#endif

// ------------------------------------------------------------------------------------- any C

// out (N, C) = x * rstd * w, rstd (N,) = 1 / sqrt(mean(x^2) + eps); skip as rmsnorm_forward_regs.
template <int V>
__device__ __forceinline__ void rmsnorm_forward_row(act_t* __restrict__ out, float* __restrict__ rstd,
                                                    const act_t* __restrict__ x, const act_t* __restrict__ w,
                                                    int row, int C, float eps, act_t* __restrict__ skip) {
    const int lane = threadIdx.x & 31;
    const act_t* xr = x + (long long)row * C;
    float ss = 0.f;
    for (int c = lane * V; c < C; c += 32 * V) {
        float v[V];
        load_vec<V>(v, xr + c);
#pragma unroll
        for (int i = 0; i < V; ++i) ss += v[i] * v[i];
    }
    const float r = row_rstd(ss, rstd, row, C, eps, lane);
    act_t* orow = out + (long long)row * C;
    for (int c = lane * V; c < C; c += 32 * V) {
        float v[V], g[V];
        load_vec<V>(v, xr + c);
        load_vec<V>(g, w + c);
        if (skip) store_vec<V>(skip + (long long)row * C + c, v);  // exact: the values as loaded
#pragma unroll
        for (int i = 0; i < V; ++i) v[i] *= r * g[i];
        store_vec<V>(orow + c, v);
    }
}

// Decoding's normed rows, a block a row (few rows: the latency of one row counts): out (N, C) = x * rstd * w,
// rstd (N,). A thread takes the 16-byte chunks t, t + blockDim.x, ... (at most RMSNORM_ROWS_CHUNKS), the row's
// sum of squares adds its chunks in order, then the block's warps in order: the bits of a row depend on C
// alone, whatever N is (batch invariance). Launched dependent: the gain is read before waiting for x.
extern "C" __global__ void rmsnorm_rows(act_t* __restrict__ out, float* __restrict__ rstd,
                                        const act_t* __restrict__ x, const act_t* __restrict__ w, int C, float eps) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    let_next_launch();
    uint4 xu[RMSNORM_ROWS_CHUNKS], wu[RMSNORM_ROWS_CHUNKS];
#pragma unroll
    for (int k = 0; k < RMSNORM_ROWS_CHUNKS; ++k) {
        const int c = (k * (int)blockDim.x + (int)threadIdx.x) * PACK;
        wu[k] = c < C ? *reinterpret_cast<const uint4*>(w + c) : make_uint4(0u, 0u, 0u, 0u);
    }
    wait_for_inputs();
#pragma unroll
    for (int k = 0; k < RMSNORM_ROWS_CHUNKS; ++k) {
        const int c = (k * (int)blockDim.x + (int)threadIdx.x) * PACK;
        xu[k] = c < C ? *reinterpret_cast<const uint4*>(x + row * C + c) : make_uint4(0u, 0u, 0u, 0u);
    }
    const float r = 1.f / sqrtf(block_sum(chunk_squares<RMSNORM_ROWS_CHUNKS>(xu), scratch) / C + eps);
    if (threadIdx.x == 0) rstd[row] = r;
#pragma unroll
    for (int k = 0; k < RMSNORM_ROWS_CHUNKS; ++k) {
        const int c = (k * (int)blockDim.x + (int)threadIdx.x) * PACK;
        if (c >= C) break;
        *reinterpret_cast<uint4*>(out + row * C + c) = normed_chunk(xu[k], wu[k], r);
    }
}

extern "C" __global__ void rmsnorm_forward(act_t* __restrict__ out, float* __restrict__ rstd,
                                           const act_t* __restrict__ x, const act_t* __restrict__ w,
                                           int N, int C, float eps, act_t* __restrict__ skip) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    if (C % 4 == 0) rmsnorm_forward_row<4>(out, rstd, x, w, row, C, eps, skip);
    else rmsnorm_forward_row<1>(out, rstd, x, w, row, C, eps, skip);
}

// dx (N, C) += r * (g - xhat * mean(g * xhat)) with g = dout * w, xhat = x * r (the residual gradient
// accumulates); dw_partial (gridDim.x, C) = this block's sum over its rows of dout * xhat. Lane l of a warp
// owns its own columns, so each warp keeps its partial in its own shared row (dynamic, warps * C floats)
// without atomics; the warps' rows are added in order at the end.
template <int V>
__device__ __forceinline__ void rmsnorm_backward_rows(RMSNORM_BACKWARD_PARAMS) {
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
    sum_warp_rows(dw_partial, dw_part, C);
}

extern "C" __global__ void rmsnorm_backward(act_t* __restrict__ dx, float* __restrict__ dw_partial,
                                            const act_t* __restrict__ dout, const act_t* __restrict__ x,
                                            const act_t* __restrict__ w, const float* __restrict__ rstd,
                                            int N, int C) {
    extern __shared__ float dw_part[];
    if (C % 4 == 0) rmsnorm_backward_rows<4>(dx, dw_partial, dout, x, w, rstd, N, C, dw_part);
    else rmsnorm_backward_rows<1>(dx, dw_partial, dout, x, w, rstd, N, C, dw_part);
}

// dw (C,) += sum over the blocks of dw_partial (blocks, C), in a fixed order: block (32, Y) threads, Y <= 32;
// column c = 32 * blockIdx.x + threadIdx.x, thread row y sums partial rows y, y + Y, ..., then the Y sums are
// added in order of y (Y = 32 keeps 32 loads of a column in flight).
extern "C" __global__ void rmsnorm_dw_reduce(float* __restrict__ dw, const float* __restrict__ dw_partial,
                                             int blocks, int C) {
    __shared__ float sums[32][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    float s = 0.f;
    if (c < C)
#pragma unroll 4
        for (int k = threadIdx.y; k < blocks; k += blockDim.y) s += dw_partial[(long long)k * C + c];
    sums[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float total = 0.f;
        for (int y = 0; y < (int)blockDim.y; ++y) total += sums[y][threadIdx.x];
        dw[c] += total;
    }
}
