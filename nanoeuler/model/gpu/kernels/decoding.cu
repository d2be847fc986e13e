// Decoding's bookkeeping on the device: the greedy argmax of the logits, the KV cache position's advance, and
// the acceptance of a speculative step's drafts. layers.py records them into decoding's CUDA graphs with
// programmatic dependent launch, so each waits for its inputs first (common.cuh: wait_for_inputs).
#include "common.cuh"

// ids[r] = the index of the largest of logits (R, V)'s row r (the first of equal ones): greedy decoding on
// the device, so a token costs the host one int, not V floats. With a log (S, R), also log[*pos, r]: the ids
// of consecutive decoding steps, which the host reads back together. One block per row.
extern "C" __global__ void argmax_rows(int* __restrict__ ids, const float* __restrict__ logits, int V,
                                       int* __restrict__ log, const int* __restrict__ pos) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    let_next_launch();
    wait_for_inputs();
    const float* row = logits + (long long)blockIdx.x * V;
    float bv = neg_inf();
    int bi = 0x7fffffff;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        const float x = row[v];
        if (x > bv) bv = x, bi = v;  // ascending v: the first of equal ones stays
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
        const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) best_v[warp] = bv, best_i[warp] = bi;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
            if (best_v[w] > bv || (best_v[w] == bv && best_i[w] < bi)) bv = best_v[w], bi = best_i[w];
        bi = bi == 0x7fffffff ? 0 : bi;  // a row of NaNs: 0
        ids[blockIdx.x] = bi;
        if (log) log[(long long)*pos * gridDim.x + blockIdx.x] = bi;
    }
}

// *pos += n, the last node of a decoding step.
extern "C" __global__ void advance_position(int* pos, int n) {
    wait_for_inputs();  // every kernel of the step has read the position
    *pos += n;
}

// The last node of a greedy speculative step (one sequence): tokens (K,) went in, the next token and K-1
// drafts; ids (K, K) are every head's argmax at each of the K rows. Keep the drafts head 0 agrees with (n of
// them), log the n + 1 kept ids by position, log[p] = (id, n at the step's first position), put head 0's
// next id and heads 1..K-1's drafts of the last kept row into tokens and after the kept ids in the log (the
// host reads them when it takes over), and move the position past the kept ids: the rejected rows' keys and
// values are overwritten by the next step. So steps chain on the device with no host in between.
extern "C" __global__ void accept_drafts(int* __restrict__ tokens, const int* __restrict__ ids,
                                         int* __restrict__ log, int* __restrict__ pos, int K) {
    wait_for_inputs();
    const int p = *pos;
    int n = 0;
    while (n < K - 1 && ids[n * K] == tokens[n + 1]) ++n;
    for (int j = 0; j <= n; ++j) log[2 * (p + j)] = tokens[j];
    log[2 * p + 1] = n;
    for (int h = 0; h < K; ++h) {
        tokens[h] = ids[n * K + h];
        log[2 * (p + n + 1 + h)] = tokens[h];
    }
    *pos = p + n + 1;
}
