// Token embedding: a gather forward; a deterministic scatter-add backward. A batch repeats tokens, so the
// backward sums, for each token id, the gradient rows of every position holding it; walking the positions
// sorted by token (layers.py sorts them on the device) gives every row's sum one fixed order, with no atomics,
// so two runs give the same bits.
#include "common.cuh"

// out (N, C) = emb (V, C)[tokens (N,)]; one thread per output element.
extern "C" __global__ void embedding_forward(act_t* __restrict__ out, const int* __restrict__ tokens,
                                             const act_t* __restrict__ emb, int N, int C) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)N * C) return;
    const long long n = i / C, c = i % C;
    out[i] = emb[(long long)tokens[n] * C + c];
}

// demb (V, C) += dout (N, C) scattered by token. order (N,): positions sorted by token; sorted (N,): their
// tokens. One block per sorted slot; the block at the first slot of a token sums that token's rows in order,
// the others have nothing to do.
extern "C" __global__ void embedding_backward(float* __restrict__ demb, const act_t* __restrict__ dout,
                                              const int* __restrict__ order, const int* __restrict__ sorted,
                                              int N, int C) {
    const int i = blockIdx.x, token = sorted[i];
    if (i > 0 && sorted[i - 1] == token) return;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float acc = 0.f;
        for (int j = i; j < N && sorted[j] == token; ++j) acc += to_float(dout[(long long)order[j] * C + c]);
        demb[(long long)token * C + c] += acc;
    }
}
