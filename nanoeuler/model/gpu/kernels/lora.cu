// LoRA's dropout (layers.py: dropout_forward): an element is kept when the top 24 bits of a hash of (key, its
// flat index) are at least `threshold` (p of 2^24), so a mask is a pure function of the key, drawn again in the
// backward pass and the same as the CPU engine's (cpu/layers.py: _dropout, the same splitmix64 finaliser).
#include "common.cuh"

__device__ __forceinline__ unsigned long long dropout_mix64(unsigned long long x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// out (n,) = x * keep * inv (+= out with accumulate); a grid-stride loop
extern "C" __global__ void dropout_forward(act_t* __restrict__ out, const act_t* __restrict__ x, long long n,
                                           unsigned long long key, unsigned threshold, float inv, int accumulate) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        const unsigned long long h = dropout_mix64(key ^ ((unsigned long long)e * 0x9E3779B97F4A7C15ull));
        float v = (unsigned)(h >> 40) >= threshold ? to_float(x[e]) * inv : 0.0f;
        if (accumulate) v += to_float(out[e]);
        out[e] = from_float<act_t>(v);
    }
}
