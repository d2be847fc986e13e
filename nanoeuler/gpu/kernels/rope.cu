// Rotary position embedding (rotate-half pairing, element i with i + D/2), in place on the first n_rot heads
// (the q and k heads) of the fused activation qkv (B, T, NH, D), positions *pos + t: read from device memory,
// so that a decoding step recorded as a CUDA graph serves every position. The backward pass is the inverse
// rotation, the same kernel with the sine negated (sign = -1). A thread rotates V = 4 consecutive pairs (one
// vector access per half) when D/2 is a multiple of 4, one pair otherwise.
#include "common.cuh"

template <int V>
__device__ __forceinline__ void rope_pairs(act_t* __restrict__ qkv, const float* __restrict__ cos_t,
                                           const float* __restrict__ sin_t, long long i, int T, int NH,
                                           int n_rot, int D, int pos0, float sign) {
    const int half = D >> 1;
    const int j = (int)(i % half);
    const long long rest = i / half;
    const int h = (int)(rest % n_rot);
    const long long bt = rest / n_rot;
    const int p = pos0 + (int)(bt % T);
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
                                       int D, const int* __restrict__ pos, float sign) {
    const int V = (D >> 1) % 4 == 0 ? 4 : 1;
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (i >= (long long)B * T * n_rot * (D >> 1)) return;
    const int pos0 = *pos;
    if (V == 4) rope_pairs<4>(qkv, cos_t, sin_t, i, T, NH, n_rot, D, pos0, sign);
    else rope_pairs<1>(qkv, cos_t, sin_t, i, T, NH, n_rot, D, pos0, sign);
}
