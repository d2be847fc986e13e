// Token embedding: a gather forward; a deterministic scatter-add backward. A batch repeats tokens, so the
// backward sums, for each token id, the gradient rows of every position holding it; walking the positions
// sorted by token (layers.py sorts them on the device) gives every row's sum one fixed order, with no atomics,
// so two runs give the same bits. A frequent token's run of sorted positions is cut at every multiple of
// EMB_SEGMENT (a define from constants.py): each piece summed by a block of its own, in order, and the pieces'
// sums then added in order, so no block walks more than EMB_SEGMENT rows plus one sum a piece.
#include "common.cuh"

// out (N, C) = emb (V, C)[tokens (N,)]; one thread per output element. A decoding step's first kernel: it lets
// the next one (the first qkv product) start at once, to load its weights while the rows are gathered.
extern "C" __global__ void embedding_forward(act_t* __restrict__ out, const int* __restrict__ tokens,
                                             const act_t* __restrict__ emb, int N, int C) {
    let_next_launch();
    wait_for_inputs();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)N * C) return;
    const long long n = i / C, c = i % C;
    out[i] = emb[(long long)tokens[n] * C + c];
}

// partial (ceil(N / EMB_SEGMENT), C) row b = the sum of the rows of the sorted slots from j = b * EMB_SEGMENT to
// the end of their token's run or of the segment, in order, where j continues a run (its token is slot j - 1's);
// order (N,): positions sorted by token; sorted (N,): their tokens. One block per segment.
extern "C" __global__ void embedding_backward_segments(float* __restrict__ partial, const act_t* __restrict__ dout,
                                                       const int* __restrict__ order,
                                                       const int* __restrict__ sorted, int N, int C) {
    const int j = blockIdx.x * EMB_SEGMENT, token = sorted[j];
    if (j == 0 || sorted[j - 1] != token) return;
    const int end = min(N, j + EMB_SEGMENT);
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float acc = 0.f;
        for (int k = j; k < end && sorted[k] == token; ++k) acc += to_float(dout[(long long)order[k] * C + c]);
        partial[(long long)blockIdx.x * C + c] = acc;
    }
}

// demb (V, C) += dout (N, C) scattered by token. One block per sorted slot; the block at the first slot i of a
// token sums that token's rows up to the next multiple of EMB_SEGMENT, then adds the partials of the segments
// its run goes on into, in order; the other blocks have nothing to do.
extern "C" __global__ void embedding_backward(float* __restrict__ demb, const act_t* __restrict__ dout,
                                              const int* __restrict__ order, const int* __restrict__ sorted,
                                              const float* __restrict__ partial, int N, int C) {
    const int i = blockIdx.x, token = sorted[i];
    if (i > 0 && sorted[i - 1] == token) return;
    const int first_end = min(N, (i / EMB_SEGMENT + 1) * EMB_SEGMENT);
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float acc = 0.f;
        int j = i;
        for (; j < first_end && sorted[j] == token; ++j) acc += to_float(dout[(long long)order[j] * C + c]);
        for (; j < N && sorted[j] == token; j += EMB_SEGMENT) acc += partial[(long long)(j / EMB_SEGMENT) * C + c];
        demb[(long long)token * C + c] += acc;
    }
}
