// Softmax cross-entropy over the K prediction heads' fused logits (N, K*V), one block per (row n, head k).
// The backward variant overwrites the logits with d loss / d logits in the same launch, so the
// probabilities are computed once and never stored next to the logits. Logits may be bf16; the math is float.
// Where a row is `chunks` (1, 2 or 4) 16-byte pieces a thread (V = 4096 in bf16: 2 at 256 threads), the row
// is read once into registers, all its loads in flight together; otherwise a thread streams its elements.
#include "common.cuh"

// One row's loss into *loss, the row's target t (>= 0); BACKWARD: the row := (softmax - onehot) * sc. A thread
// streams its elements with a running max and sum of exp(x - max), and the backward reads the row again.
template <bool BACKWARD>
__device__ __forceinline__ void crossentropy_row(float* __restrict__ loss, act_t* __restrict__ row, int t, int V,
                                                 float sc) {
    __shared__ float scratch[32];
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
    if (threadIdx.x == 0) *loss = lse - target_logit;
    if (BACKWARD)
        for (int v = threadIdx.x; v < V; v += blockDim.x)
            row[v] = from_float<act_t>(expf(to_float(row[v]) - lse) * sc - (v == t ? sc : 0.f));
}

// The same with the row held in registers, CHUNKS 16-byte pieces a thread, read once.
template <bool BACKWARD, int CHUNKS>
__device__ __forceinline__ void crossentropy_row_held(float* __restrict__ loss, act_t* __restrict__ row, int t,
                                                      float sc) {
    __shared__ float scratch[32];
    float x[CHUNKS][PACK];
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
        unpack16(x[c], *reinterpret_cast<const uint4*>(row + (c * blockDim.x + threadIdx.x) * PACK));
    const float target_logit = to_float(row[t]);  // (the reductions' barriers: read by all before any write)
    float m = neg_inf();
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int e = 0; e < PACK; ++e) m = fmaxf(m, x[c][e]);
    const float mx = block_max(m, scratch);
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int e = 0; e < PACK; ++e) s += expf(x[c][e] - mx);
    const float lse = mx + logf(block_sum(s, scratch));
    if (threadIdx.x == 0) *loss = lse - target_logit;
    if (BACKWARD) {
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int v0 = (c * blockDim.x + threadIdx.x) * PACK;
#pragma unroll
            for (int e = 0; e < PACK; ++e) x[c][e] = expf(x[c][e] - lse) * sc - (v0 + e == t ? sc : 0.f);
            *reinterpret_cast<uint4*>(row + v0) = pack16(x[c]);
        }
    }
}

// Block (n, k): row n's logits of head k, its target and scale; an ignored position (-1) gets no loss and no
// gradient.
template <bool BACKWARD>
__device__ __forceinline__ void crossentropy_rows(float* losses, act_t* logits, const int* targets,
                                                  const float* dscale, int N, int K, int V, int chunks) {
    const int n = blockIdx.x, k = blockIdx.y;
    const long long at = (long long)k * N + n;
    act_t* row = logits + ((long long)n * K + k) * V;
    const int t = targets[at];
    if (t < 0) {
        if (BACKWARD)
            for (int v = threadIdx.x; v < V; v += blockDim.x) row[v] = from_float<act_t>(0.f);
        if (threadIdx.x == 0) losses[at] = 0.f;
        return;
    }
    const float sc = BACKWARD ? dscale[at] : 0.f;
    if (chunks == 1) crossentropy_row_held<BACKWARD, 1>(losses + at, row, t, sc);
    else if (chunks == 2) crossentropy_row_held<BACKWARD, 2>(losses + at, row, t, sc);
    else if (chunks == 4) crossentropy_row_held<BACKWARD, 4>(losses + at, row, t, sc);
    else crossentropy_row<BACKWARD>(losses + at, row, t, V, sc);
}

// losses (K, N); targets (K, N), -1 = ignored.
extern "C" __global__ void crossentropy_forward(float* losses, act_t* logits, const int* targets, int N, int K,
                                                int V, int chunks) {
    crossentropy_rows<false>(losses, logits, targets, nullptr, N, K, V, chunks);
}

// as crossentropy_forward, then logits := (softmax - onehot) * dscale[k, n]; dscale (K, N) float32: a scale
// per head and row (DPO weights each sequence's rows on their own).
extern "C" __global__ void crossentropy_forward_backward(float* losses, act_t* logits, const int* targets,
                                                         const float* dscale, int N, int K, int V,
                                                         int chunks) {
    crossentropy_rows<true>(losses, logits, targets, dscale, N, K, V, chunks);
}
