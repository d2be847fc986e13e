// SwiGLU on the fused gate|up activation (N, 2F): gate is columns [0, F), up is [F, 2F). A thread takes 4
// consecutive columns (one vector access each) when F is a multiple of 4, one otherwise.
#include "common.cuh"

template <int V>
__device__ __forceinline__ void swiglu_forward_vec(act_t* __restrict__ out, const act_t* __restrict__ gate_up,
                                                   long long i, int F) {
    const long long n = i / F, f = i % F;
    float g[V], u[V], o[V];
    load_vec<V>(g, gate_up + n * 2 * F + f);
    load_vec<V>(u, gate_up + n * 2 * F + F + f);
#pragma unroll
    for (int k = 0; k < V; ++k) o[k] = g[k] / (1.f + expf(-g[k])) * u[k];
    store_vec<V>(out + i, o);
}

// out (N, F) = silu(gate) * up
extern "C" __global__ void swiglu_forward(act_t* __restrict__ out, const act_t* __restrict__ gate_up,
                                          int N, int F) {
    const int V = F % 4 == 0 ? 4 : 1;
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (i >= (long long)N * F) return;
    if (V == 4) swiglu_forward_vec<4>(out, gate_up, i, F);
    else swiglu_forward_vec<1>(out, gate_up, i, F);
}

template <int V>
__device__ __forceinline__ void swiglu_backward_vec(act_t* __restrict__ dgate_up, const act_t* __restrict__ dout,
                                                    const act_t* __restrict__ gate_up, long long i, int F) {
    const long long n = i / F, f = i % F;
    float g[V], u[V], d[V], dg[V], du[V];
    load_vec<V>(g, gate_up + n * 2 * F + f);
    load_vec<V>(u, gate_up + n * 2 * F + F + f);
    load_vec<V>(d, dout + i);
#pragma unroll
    for (int k = 0; k < V; ++k) {
        const float sig = 1.f / (1.f + expf(-g[k]));
        dg[k] = d[k] * u[k] * sig * (1.f + g[k] * (1.f - sig));
        du[k] = d[k] * g[k] * sig;
    }
    store_vec<V>(dgate_up + n * 2 * F + f, dg);
    store_vec<V>(dgate_up + n * 2 * F + F + f, du);
}

// dgate_up (N, 2F) overwritten: d gate = dout * up * silu'(gate), d up = dout * silu(gate).
extern "C" __global__ void swiglu_backward(act_t* __restrict__ dgate_up, const act_t* __restrict__ dout,
                                           const act_t* __restrict__ gate_up, int N, int F) {
    const int V = F % 4 == 0 ? 4 : 1;
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (i >= (long long)N * F) return;
    if (V == 4) swiglu_backward_vec<4>(dgate_up, dout, gate_up, i, F);
    else swiglu_backward_vec<1>(dgate_up, dout, gate_up, i, F);
}
