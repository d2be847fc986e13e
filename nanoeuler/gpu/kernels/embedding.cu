// Token embedding: a gather forward, a scatter-add backward (atomics, since a batch repeats tokens).
#include "common.cuh"

// out (N, C) = emb (V, C)[tokens (N,)]; one thread per output element.
extern "C" __global__ void embedding_forward(float* __restrict__ out, const int* __restrict__ tokens,
                                             const float* __restrict__ emb, int N, int C) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)N * C) return;
    const long long n = i / C, c = i % C;
    out[i] = emb[(long long)tokens[n] * C + c];
}

// demb (V, C) += dout (N, C) scattered by token.
extern "C" __global__ void embedding_backward(float* __restrict__ demb, const float* __restrict__ dout,
                                              const int* __restrict__ tokens, int N, int C) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)N * C) return;
    const long long n = i / C, c = i % C;
    atomicAdd(&demb[(long long)tokens[n] * C + c], dout[i]);
}
