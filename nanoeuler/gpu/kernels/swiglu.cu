// SwiGLU on the fused gate|up activation (N, 2F): gate is columns [0, F), up is [F, 2F).
#include "common.cuh"

// out (N, F) = silu(gate) * up
extern "C" __global__ void swiglu_forward(act_t* __restrict__ out, const act_t* __restrict__ gate_up,
                                          int N, int F) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)N * F) return;
    const long long n = i / F, f = i % F;
    const float g = to_float(gate_up[n * 2 * F + f]), u = to_float(gate_up[n * 2 * F + F + f]);
    out[i] = from_float<act_t>(g / (1.f + expf(-g)) * u);
}

// dgate_up (N, 2F) overwritten: d gate = dout * up * silu'(gate), d up = dout * silu(gate).
extern "C" __global__ void swiglu_backward(act_t* __restrict__ dgate_up, const act_t* __restrict__ dout,
                                           const act_t* __restrict__ gate_up, int N, int F) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)N * F) return;
    const long long n = i / F, f = i % F;
    const float g = to_float(gate_up[n * 2 * F + f]), u = to_float(gate_up[n * 2 * F + F + f]);
    const float sig = 1.f / (1.f + expf(-g));
    const float d = to_float(dout[i]);
    dgate_up[n * 2 * F + f] = from_float<act_t>(d * u * sig * (1.f + g * (1.f - sig)));
    dgate_up[n * 2 * F + F + f] = from_float<act_t>(d * g * sig);
}
