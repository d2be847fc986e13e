// Rotary position embedding (rotate-half pairing, element i with i + D/2), in place on the first n_rot heads
// (the q and k heads) of the fused activation qkv (B, T, NH, D), positions pos[0] + t, or pos[b] + t where
// pos_stride is 1 (a position a sequence: a batched decoding step's rows): read from device memory, so that a
// decoding step recorded as a CUDA graph serves every position. The backward pass is the inverse
// rotation, the same kernel with the sine negated (sign = -1). rope_rotate_rows is the fast path (D/2 a
// multiple of 16 bytes of elements); rope_rotate serves any D: a thread rotates V = 4 consecutive pairs (one
// vector access per half) when D/2 is a multiple of 4, one pair otherwise.
#include "common.cuh"

#ifndef ROPE_HEADS  // the heads a thread of rope_rotate_rows rotates
#error "ROPE_HEADS comes from nanoeuler/model/gpu/constants.py"
#endif

// Block (J * HG, rows): threadIdx.y picks a (b, t) row, threadIdx.x = hg * J + j. J = D / 2 / PACK 16-byte
// chunks make half a head; the thread rotates chunk j of heads hg, hg + HG, ... (ROPE_HEADS of them, HG =
// ceil(n_rot / ROPE_HEADS)): the row's index math is a 32-bit remainder, cos and sin are read once for
// ROPE_HEADS heads, and every access is 16 bytes, the heads' loads all in flight at once. Consecutive threads
// cover a half-head's contiguous chunks.
extern "C" __global__ void rope_rotate_rows(act_t* __restrict__ qkv, const float* __restrict__ cos_t,
                                            const float* __restrict__ sin_t, int rows, int T, int NH, int n_rot,
                                            int D, const int* __restrict__ pos, int pos_stride, float sign) {
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= rows) return;
    const int half = D >> 1, J = half / PACK, HG = (n_rot + ROPE_HEADS - 1) / ROPE_HEADS;
    const int j = threadIdx.x % J, hg = threadIdx.x / J;
    act_t* base = qkv + (long long)row * NH * D + j * PACK;
    uint4 lo[ROPE_HEADS], hi[ROPE_HEADS];
#pragma unroll
    for (int g = 0; g < ROPE_HEADS; ++g) {
        const int h = hg + g * HG;
        if (h < n_rot) {
            lo[g] = *reinterpret_cast<const uint4*>(base + h * D);
            hi[g] = *reinterpret_cast<const uint4*>(base + h * D + half);
        }
    }
    const int p = pos[row / T * pos_stride] + row % T;
    const float* cp = cos_t + (long long)p * half + j * PACK;
    const float* sp = sin_t + (long long)p * half + j * PACK;
    float c[PACK], s[PACK];
#pragma unroll
    for (int q = 0; q < PACK; q += 4) {
        const float4 cf = *reinterpret_cast<const float4*>(cp + q), sf = *reinterpret_cast<const float4*>(sp + q);
        c[q] = cf.x, c[q + 1] = cf.y, c[q + 2] = cf.z, c[q + 3] = cf.w;
        s[q] = sign * sf.x, s[q + 1] = sign * sf.y, s[q + 2] = sign * sf.z, s[q + 3] = sign * sf.w;
    }
#pragma unroll
    for (int g = 0; g < ROPE_HEADS; ++g) {
        const int h = hg + g * HG;
        if (h >= n_rot) continue;
        float x1[PACK], x2[PACK], y1[PACK], y2[PACK];
        unpack16(x1, lo[g]);
        unpack16(x2, hi[g]);
#pragma unroll
        for (int k = 0; k < PACK; ++k) rotate_pair(x1[k], x2[k], c[k], s[k], y1[k], y2[k]);
        *reinterpret_cast<uint4*>(base + h * D) = pack16(y1);
        *reinterpret_cast<uint4*>(base + h * D + half) = pack16(y2);
    }
}

template <int V>
__device__ __forceinline__ void rope_pairs(act_t* __restrict__ qkv, const float* __restrict__ cos_t,
                                           const float* __restrict__ sin_t, long long i, int T, int NH,
                                           int n_rot, int D, const int* __restrict__ pos, int pos_stride,
                                           float sign) {
    const int half = D >> 1;
    const int j = (int)(i % half);
    const long long rest = i / half;
    const int h = (int)(rest % n_rot);
    const long long bt = rest / n_rot;
    const int p = pos[bt / T * pos_stride] + (int)(bt % T);
    act_t* row = qkv + (bt * NH + h) * D;
    float x1[V], x2[V], c[V], s[V];
    load_vec<V>(x1, row + j);
    load_vec<V>(x2, row + j + half);
    load_vec<V>(c, cos_t + (long long)p * half + j);
    load_vec<V>(s, sin_t + (long long)p * half + j);
    float y1[V], y2[V];
#pragma unroll
    for (int k = 0; k < V; ++k) rotate_pair(x1[k], x2[k], c[k], sign * s[k], y1[k], y2[k]);
    store_vec<V>(row + j, y1);
    store_vec<V>(row + j + half, y2);
}

extern "C" __global__ void rope_rotate(act_t* __restrict__ qkv, const float* __restrict__ cos_t,
                                       const float* __restrict__ sin_t, int B, int T, int NH, int n_rot,
                                       int D, const int* __restrict__ pos, int pos_stride, float sign) {
    const int V = (D >> 1) % 4 == 0 ? 4 : 1;
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (i >= (long long)B * T * n_rot * (D >> 1)) return;
    if (V == 4) rope_pairs<4>(qkv, cos_t, sin_t, i, T, NH, n_rot, D, pos, pos_stride, sign);
    else rope_pairs<1>(qkv, cos_t, sin_t, i, T, NH, n_rot, D, pos, pos_stride, sign);
}
