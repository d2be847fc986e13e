// Decoding's bookkeeping on the device: the greedy argmax of the logits, batched decoding's per-row sampling
// and the feeding back of its ids, the KV cache position's advance, and the acceptance of a speculative step's
// drafts. runtime.py records them into decoding's CUDA graphs with
// programmatic dependent launch, so each waits for its inputs first (common.cuh: wait_for_inputs).
#include "common.cuh"

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

// ------------------------------------------------------------------------------------------ batched sampling
// splitmix64's finaliser: a bijection of 64-bit words whose every output bit depends on every input bit.
__device__ __forceinline__ unsigned long long mix64(unsigned long long x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// x's bits as an unsigned that orders as the floats do.
__device__ __forceinline__ unsigned order_key(float x) {
    const unsigned bits = __float_as_uint(x);
    return bits < 0x80000000u ? bits ^ 0x80000000u : ~bits;
}

// The block's (value, id) with the largest value, the lowest id of equal ones (scratch: 32 of each).
__device__ __forceinline__ void block_argmax(float& v, int& i, float* sv, int* si) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, v, o);
        const int oi = __shfl_xor_sync(FULL_MASK, i, o);
        if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sv[warp] = v, si[warp] = i;
    __syncthreads();
    v = neg_inf(), i = 0x7fffffff;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w)
        if (sv[w] > v || (sv[w] == v && si[w] < i)) v = sv[w], i = si[w];
}

// ids[r] = the index of the largest of logits (R, V)'s row r (the first of equal ones): greedy decoding on
// the device, so a token costs the host one int, not V floats. With a log (S, R), also log[*pos, r]: the ids
// of consecutive decoding steps, which the host reads back together. Blocks (nb, R): block b of row r takes
// the row's b-th slice of ceil(V / nb) ids and writes its (value, id) to part_v / part_i[r * nb + b]; the
// row's last block to finish (done[r] counts them, and is set back to 0 for the next step) takes the nb
// results. The largest value and the lowest id among equal ones do not depend on the order they are met in,
// so the result is the one-block scan's, whichever block finishes last; a row spread over many SMs takes a
// few microseconds where one block took tens.
extern "C" __global__ void argmax_rows(int* __restrict__ ids, const float* __restrict__ logits, int V,
                                       int* __restrict__ log, const int* __restrict__ pos,
                                       float* __restrict__ part_v, int* __restrict__ part_i,
                                       unsigned* __restrict__ done) {
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ bool last;
    let_next_launch();
    wait_for_inputs();
    const int r = blockIdx.y, nb = gridDim.x, slice = (V + nb - 1) / nb;
    const int lo = blockIdx.x * slice, hi = min(V, lo + slice);
    const float* row = logits + (long long)r * V;
    float bv = neg_inf();
    int bi = 0x7fffffff;
    for (int v = lo + threadIdx.x; v < hi; v += blockDim.x) {
        const float x = row[v];
        if (x > bv) bv = x, bi = v;  // ascending v: the first of equal ones stays
    }
    block_argmax(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        part_v[r * nb + blockIdx.x] = bv, part_i[r * nb + blockIdx.x] = bi;
        __threadfence();  // the result is seen before the count that announces it
        last = atomicAdd(done + r, 1u) == (unsigned)nb - 1u;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    bv = neg_inf(), bi = 0x7fffffff;
    for (int b = threadIdx.x; b < nb; b += blockDim.x) {
        const float v = __ldcg(part_v + r * nb + b);  // from L2: other SMs wrote them
        const int i = __ldcg(part_i + r * nb + b);
        if (v > bv || (v == bv && i < bi)) bv = v, bi = i;
    }
    block_argmax(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        bi = bi == 0x7fffffff ? 0 : bi;  // a row of NaNs: 0
        ids[r] = bi;
        if (log) log[(long long)*pos * gridDim.y + r] = bi;
        done[r] = 0u;
    }
}

// The cuts' searches decide SAMPLE_BITS bits of the 32-bit key a pass: the counts (top-k) or masses (top-p) at
// every one of the next bits' CANDIDATES cuts at once, each summed as a pass for that cut alone would sum it
// (thread-strided ids, the zeros it would add skipped, then block_sum's tree): the same function of the cut.
// Both fall as the cut rises, so the largest cut that holds enough is bisection's, in 32 / SAMPLE_BITS passes.
#if !defined(SAMPLE_BITS)
#error "SAMPLE_BITS comes from nanoeuler/model/gpu/constants.py"
#endif
static_assert(32 % SAMPLE_BITS == 0, "the passes split the key's 32 bits evenly");
constexpr int CANDIDATES = (1 << SAMPLE_BITS) - 1;

// How many of the candidate cuts cut | j << shift (j = 1..CANDIDATES; cut's bits below shift + SAMPLE_BITS are
// 0) are at or below key.
__device__ __forceinline__ int cuts_below(unsigned key, unsigned cut, int shift) {
    const int high = shift + SAMPLE_BITS;  // 32 on the first pass: 64-bit shifts keep it defined
    const unsigned long long kp = (unsigned long long)key >> high, cp = (unsigned long long)cut >> high;
    return kp > cp ? CANDIDATES : kp < cp ? 0 : (int)((key >> shift) & CANDIDATES);
}

// block_sum of each of v's values: the same tree, the barriers shared (scratch: CANDIDATES x 32 values).
template <typename T>
__device__ __forceinline__ void block_sums(T (&v)[CANDIDATES], T (*scratch)[32]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int j = 0; j < CANDIDATES; ++j) v[j] = warp_sum(v[j]);
    __syncthreads();
    if (lane == 0)
#pragma unroll
        for (int j = 0; j < CANDIDATES; ++j) scratch[j][warp] = v[j];
    __syncthreads();
#pragma unroll
    for (int j = 0; j < CANDIDATES; ++j) v[j] = warp_sum(lane < (int)(blockDim.x >> 5) ? scratch[j][lane] : (T)0);
}

// ids[r] = a token drawn from row r of logits (R, V) with the row's settings: nanoeuler/model/cpu/layers.py's
// sample_rows, the same algorithm (its docstring has the definition), a block a row. Every sum runs over
// thread-strided ids and then a fixed tree, so a row's draw depends on its own inputs alone. ids holds each
// row's argmax on entry (argmax_rows, launched just before: many blocks a row find it faster than one), which
// is a greedy row's draw, and the largest logit, which the others' weights are relative to.
extern "C" __global__ void sample_rows(int* __restrict__ ids, const float* __restrict__ logits, int V,
                                       const int* __restrict__ top_k, const float* __restrict__ temperature,
                                       const float* __restrict__ top_p, const unsigned* __restrict__ seed_lo,
                                       const unsigned* __restrict__ seed_hi, const int* __restrict__ index) {
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ float sf[32];
    __shared__ float sfs[CANDIDATES][32];
    __shared__ int scs[CANDIDATES][32];
    let_next_launch();
    wait_for_inputs();
    const int r = blockIdx.x;
    const float T = temperature[r];
    if (T <= 0.f) return;  // greedy: the argmax is there already
    const float* z = logits + (long long)r * V;
    const int best = ids[r];
    const float m = z[best] > neg_inf() ? z[best] : neg_inf();  // a row of NaNs: -inf, as a scan would give
    __syncthreads();  // every thread has read ids[r] before thread 0 overwrites it
    unsigned cut = 0u;
    const int k = top_k[r];
    if (0 < k && k < V) {  // the k-th largest key: the largest c with at least k keys >= c
        for (int shift = 32 - SAMPLE_BITS; shift >= 0; shift -= SAMPLE_BITS) {
            int count[CANDIDATES];
#pragma unroll
            for (int j = 0; j < CANDIDATES; ++j) count[j] = 0;
            for (int v = threadIdx.x; v < V; v += blockDim.x) {
                const int below = cuts_below(order_key(z[v]), cut, shift);
#pragma unroll
                for (int j = 0; j < CANDIDATES; ++j) count[j] += j < below;
            }
            block_sums(count, scs);
            int taken = 0;
#pragma unroll
            for (int j = 0; j < CANDIDATES; ++j) taken = count[j] >= k ? j + 1 : taken;
            cut |= (unsigned)taken << shift;
        }
    }
    const float p = top_p[r];
    if (p < 1.f) {  // the largest c whose keys at or above it hold top_p of the mass above the top-k cut
        const unsigned kcut = cut;
        float total = 0.f;
        for (int v = threadIdx.x; v < V; v += blockDim.x)
            total += order_key(z[v]) >= kcut ? expf((z[v] - m) / T) : 0.f;
        const float target = p * block_sum(total, sf);
        cut = 0u;
        for (int shift = 32 - SAMPLE_BITS; shift >= 0; shift -= SAMPLE_BITS) {
            float mass[CANDIDATES];
#pragma unroll
            for (int j = 0; j < CANDIDATES; ++j) mass[j] = 0.f;
            for (int v = threadIdx.x; v < V; v += blockDim.x) {
                const unsigned key = order_key(z[v]);
                const int below = key >= kcut ? cuts_below(key, cut, shift) : 0;
                if (below == 0) continue;  // it adds 0 to every candidate's mass
                const float e = expf((z[v] - m) / T);
#pragma unroll
                for (int j = 0; j < CANDIDATES; ++j)
                    if (j < below) mass[j] += e;
            }
            block_sums(mass, sfs);
            int taken = 0;
#pragma unroll
            for (int j = 0; j < CANDIDATES; ++j) taken = mass[j] >= target ? j + 1 : taken;
            cut |= (unsigned)taken << shift;
        }
    }
    // Gumbel-max over the kept ids: noise -log(-log(u)), u from a hash of (seed, token index, id)
    const unsigned long long seed = mix64(((unsigned long long)seed_hi[r] << 32) | seed_lo[r]);
    const unsigned long long counter = (unsigned long long)(unsigned)index[r] << 32;
    float score = neg_inf();
    int choice = 0x7fffffff;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        if (order_key(z[v]) < cut) continue;
        const unsigned long long h = mix64(seed ^ (mix64(counter | (unsigned)v) + 0x9E3779B97F4A7C15ull));
        const float u = (float)(2ull * (h >> 41) + 1ull) * 5.9604644775390625e-8f;  // (2k + 1) 2^-24
        const float s = (z[v] - m) / T - logf(-logf(u));
        if (s > score) score = s, choice = v;
    }
    block_argmax(score, choice, sv, si);
    if (threadIdx.x == 0) ids[r] = choice == 0x7fffffff ? best : choice;  // nothing kept (top_p 0): the argmax
}

// After a batched step of one token a sequence (B threads): ids become the next inputs, positions (at most
// context - 1: padding rows stay inside their slot) and token indices move on, log[*counter] = ids, and
// *counter += 1: such steps chain on the device, read back once.
extern "C" __global__ void feed_back(int* __restrict__ tokens, const int* __restrict__ ids, int* __restrict__ pos,
                                     int* __restrict__ index, int* __restrict__ log, int* __restrict__ counter,
                                     int context) {
    wait_for_inputs();
    const int b = threadIdx.x, B = blockDim.x, step = *counter;
    tokens[b] = ids[b];
    pos[b] = min(pos[b] + 1, context - 1);
    index[b] += 1;
    log[(long long)step * B + b] = ids[b];
    __syncthreads();
    if (b == 0) *counter = step + 1;
}
