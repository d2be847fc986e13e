// A bias added to every row of a product: out (N, O) += bias (O,), the q|k|v biases of the attention's input
// (Qwen2) after a cuBLAS product (decoding's few rows add them inside matmul.cu's kernel). A thread takes 4
// consecutive columns (one vector access each) where vec says O and both pointers allow it, one otherwise.
#include "common.cuh"

template <int V>
__device__ __forceinline__ void bias_add_vec(act_t* __restrict__ out, const act_t* __restrict__ bias, long long i,
                                             int O) {
    float o[V], b[V];
    load_vec<V>(o, out + i);
    load_vec<V>(b, bias + i % O);
#pragma unroll
    for (int k = 0; k < V; ++k) o[k] += b[k];
    store_vec<V>(out + i, o);
}

// out (N, O) += bias (O,)
extern "C" __global__ void bias_add(act_t* __restrict__ out, const act_t* __restrict__ bias, int N, int O, int vec) {
    const int V = vec ? 4 : 1;
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (i >= (long long)N * O) return;
    if (V == 4) bias_add_vec<4>(out, bias, i, O);
    else bias_add_vec<1>(out, bias, i, O);
}
