// Rotary position embedding (rotate-half pairing, element i with i + D/2), in place on the first n_rot heads
// (the q and k heads) of the fused activation qkv (B, T, NH, D). The backward pass is the inverse rotation,
// the same kernel with the sine negated (sign = -1).
#include "common.cuh"

extern "C" __global__ void rope_rotate(act_t* __restrict__ qkv, const float* __restrict__ cos_t,
                                       const float* __restrict__ sin_t, int B, int T, int NH, int n_rot,
                                       int D, int pos0, float sign) {
    const int half = D >> 1;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)B * T * n_rot * half) return;
    const int j = (int)(i % half);
    const long long rest = i / half;
    const int h = (int)(rest % n_rot);
    const long long bt = rest / n_rot;
    const int p = pos0 + (int)(bt % T);
    const float c = cos_t[(long long)p * half + j], s = sign * sin_t[(long long)p * half + j];
    act_t* row = qkv + (bt * NH + h) * D;
    const float x1 = to_float(row[j]), x2 = to_float(row[j + half]);
    row[j] = from_float<act_t>(x1 * c - x2 * s);
    row[j + half] = from_float<act_t>(x2 * c + x1 * s);
}
