// Softmax cross-entropy over the K prediction heads' fused logits (N, K*V), one block per (row n, head k).
// The backward variant overwrites the logits with d loss / d logits in the same launch, so the
// probabilities are computed once and never stored next to the logits. Logits may be bf16; the math is float.
#include "common.cuh"

template <bool BACKWARD>
__device__ __forceinline__ void crossentropy_row(float* __restrict__ losses, act_t* __restrict__ logits,
                                                 const int* __restrict__ targets,
                                                 const float* __restrict__ dscale, int N, int K, int V) {
    __shared__ float scratch[32];
    const int n = blockIdx.x, k = blockIdx.y;
    act_t* row = logits + ((long long)n * K + k) * V;
    const int t = targets[(long long)k * N + n];
    if (t < 0) {  // ignored position: no loss and, for every head, no gradient
        if (BACKWARD)
            for (int v = threadIdx.x; v < V; v += blockDim.x) row[v] = from_float<act_t>(0.f);
        if (threadIdx.x == 0) losses[(long long)k * N + n] = 0.f;
        return;
    }
    const float target_logit = to_float(row[t]);  // read before any thread overwrites the row
    float m = neg_inf(), s = 0.f;       // this thread's running max and sum of exp(x - m)
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        const float x = to_float(row[v]);
        if (x > m) {
            s = s * expf(m - x) + 1.f;
            m = x;
        } else {
            s += expf(x - m);
        }
    }
    const float mx = block_max(m, scratch);
    const float total = block_sum(s * expf(m - mx), scratch);
    const float lse = mx + logf(total);
    if (threadIdx.x == 0) losses[(long long)k * N + n] = lse - target_logit;
    if (BACKWARD) {
        const float sc = dscale[(long long)k * N + n];
        for (int v = threadIdx.x; v < V; v += blockDim.x)
            row[v] = from_float<act_t>(expf(to_float(row[v]) - lse) * sc - (v == t ? sc : 0.f));
    }
}

// losses (K, N); targets (K, N), -1 = ignored.
extern "C" __global__ void crossentropy_forward(float* losses, act_t* logits, const int* targets, int N, int K,
                                                int V) {
    crossentropy_row<false>(losses, logits, targets, nullptr, N, K, V);
}

// as crossentropy_forward, then logits := (softmax - onehot) * dscale[k, n]; dscale (K, N) float32: a scale
// per head and row (DPO weights each sequence's rows on their own).
extern "C" __global__ void crossentropy_forward_backward(float* losses, act_t* logits, const int* targets,
                                                         const float* dscale, int N, int K, int V) {
    crossentropy_row<true>(losses, logits, targets, dscale, N, K, V);
}
