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
// few microseconds where one block took tens. advance > 0 (one row only: no other row's block then reads the
// position): *pos += advance after the log, advance_position's work without a kernel of its own.
extern "C" __global__ void argmax_rows(int* __restrict__ ids, const float* __restrict__ logits, int V,
                                       int* __restrict__ log, int* __restrict__ pos,
                                       float* __restrict__ part_v, int* __restrict__ part_i,
                                       unsigned* __restrict__ done, int advance) {
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
        if (advance) *pos += advance;
        done[r] = 0u;
    }
}

// Sampling a row (nanoeuler/model/cpu/layers.py's sample_rows has the definition; these kernels compute the
// same float32 weights and noise with the same rounded operations, __f*_rn so that nothing is fused, and the
// same integer masses, so the draws are equal). After argmax_rows (ids: each row's first largest logit m), a
// sampled row takes four kernels of blocks (nb, R), block b reading the row's b-th slice of SAMPLE_THREADS x
// SAMPLE_LOADS logits, the row's last block to finish (state.done) taking the row's next decision:
//   sample_histogram: the live tokens' counts (top-k) and masses (top-p) by bucket of t = (z - m) log2(e) / T,
//     SAMPLE_BUCKETS buckets over t in [-SAMPLE_WEIGHT_BITS, 0] from the top; a bucket holds a range of logits,
//     above every later bucket's. The last block finds the bucket where the count from the top reaches k (or,
//     without top-k, the mass reaches top_p of the total): the cut is a key of that bucket's tokens.
//   sample_refine (round 1: top-k, round 2: top-p): the blocks gather that bucket's tokens (key and weight) in a
//     list, the last block finds the cut among them by a radix search of their keys (a byte a level, from the
//     highest bit in which they differ): the largest key whose tokens at or above it, with those of the buckets
//     before, hold k tokens or the top-p target. Round 1's last block then finds top-p's bucket with that cut.
//   sample_draw: the smallest E / w over the kept tokens (packed (E / w, id) in a 64-bit atomicMin).
// Counts and masses are integers and the draw a minimum, so the order the blocks add or meet them in changes
// nothing: a row's draw is a function of its own logits and settings. A greedy row (temperature <= 0) or one
// of top_p <= 0 keeps the argmax; each kernel's blocks of such rows return at once. The scratch (histograms,
// list, RowState) is left as it was found for the next step: zeros, key_lo ~0, best ~0.
// What a kernel's last block wrote (RowState, ids) the next kernel reads through L2 (__ldcg): under programmatic
// dependent launch a block may otherwise meet its SM's L1 copy of the line from before the write, and a row in a
// recorded batch draw other tokens than alone (eager launches, which start with L1 clean, do not show it).
#if !defined(SAMPLE_BUCKETS) || !defined(SAMPLE_LOADS) || !defined(SAMPLE_LIST) || !defined(SAMPLE_WEIGHT_BITS)
#error "SAMPLE_* come from nanoeuler/model/gpu/constants.py"
#endif
#if !defined(SAMPLE_EXP2_6) || !defined(SAMPLE_LN_8)
#error "SAMPLE_EXP2 and SAMPLE_LN come from nanoeuler/model/limits.py through constants.py"
#endif
constexpr float BUCKET_SCALE = (float)SAMPLE_BUCKETS / (float)SAMPLE_WEIGHT_BITS;
constexpr float SAMPLE_LOG2E = 0x1.715476p+0f, SAMPLE_LN2 = 0x1.62e43p-1f, SAMPLE_SQRT_HALF = 0x1.6a09e6p-1f;
constexpr int DIGIT_BITS = 8;  // a radix level's bits (its histogram: 2^8 entries)
constexpr int DIGITS = 1 << DIGIT_BITS;

// A row's sampling state between the kernels of a step (64 bytes; layers._sample_scratch lays it out).
struct RowState {
    unsigned mode;    // the refine round pending (1: top-k, 2: top-p), 0: none
    unsigned bucket;  // ... its bucket
    unsigned need;    // top-k: the tokens still needed from the bucket
    unsigned lower;   // top-p: the top-k cut, where it lies in the same bucket (else 0)
    unsigned cut;     // the tokens kept: live ones whose key is at least this
    unsigned n;       // the refine round's list length (counted past SAMPLE_LIST where it overflows)
    unsigned key_lo, key_hi;  // ... and its smallest and largest key
    unsigned done;    // the row's blocks finished (the last one resets it)
    unsigned pad;
    unsigned long long base;  // top-p: the mass of the buckets before the bucket
    unsigned long long best;  // sample_draw: the packed (E / w, id) minimum so far
    double target;            // top-p: the mass to reach, top_p x the kept mass
};

// A token's weight 2^t, t = (z - m) * scale, and t: cpu/layers.py's _sample_weight, the same roundings.
__device__ __forceinline__ float sample_weight(float z, float m, float scale, float& t) {
    constexpr float c[] = {SAMPLE_EXP2_0, SAMPLE_EXP2_1, SAMPLE_EXP2_2, SAMPLE_EXP2_3,
                          SAMPLE_EXP2_4, SAMPLE_EXP2_5, SAMPLE_EXP2_6};
    constexpr int n = sizeof(c) / sizeof(c[0]);
    t = __fmul_rn(__fsub_rn(z, m), scale);
    if (!(t >= -(float)SAMPLE_WEIGHT_BITS)) return 0.f;
    const float e = floorf(t);
    const float f = __fsub_rn(t, e);
    float p = c[n - 1];
#pragma unroll
    for (int j = n - 2; j >= 0; --j) p = __fadd_rn(__fmul_rn(p, f), c[j]);
    return __fmul_rn(p, __int_as_float((127 + (int)e) << 23));
}

// A live token's bucket: 0 for the largest t, never increasing as t rises (so as the logit does).
__device__ __forceinline__ int sample_bucket(float t) {
    return min(SAMPLE_BUCKETS - 1, (int)__fmul_rn(-t, BUCKET_SCALE));
}

__device__ __forceinline__ unsigned long long sample_mass(float w) {
    return __float2ull_rz(__fmul_rn(w, (float)(1ull << SAMPLE_WEIGHT_BITS)));
}

// -ln(u) for token v: cpu/layers.py's _sample_noise, the same roundings.
__device__ __forceinline__ float sample_noise(unsigned long long seed, unsigned long long counter, int v) {
    constexpr float c[] = {SAMPLE_LN_0, SAMPLE_LN_1, SAMPLE_LN_2, SAMPLE_LN_3, SAMPLE_LN_4,
                          SAMPLE_LN_5, SAMPLE_LN_6, SAMPLE_LN_7, SAMPLE_LN_8};
    constexpr int n = sizeof(c) / sizeof(c[0]);
    const unsigned long long h = mix64(seed ^ (mix64(counter | (unsigned)v) + 0x9E3779B97F4A7C15ull));
    int e;
    float y = frexpf((float)(2ull * (h >> 41) + 1ull), &e);  // exact: below 2^24
    if (y < SAMPLE_SQRT_HALF) y = __fmul_rn(y, 2.f), --e;
    const float s = __fsub_rn(y, 1.f);
    float q = c[n - 1];
#pragma unroll
    for (int j = n - 2; j >= 0; --j) q = __fadd_rn(__fmul_rn(q, s), c[j]);
    return -__fadd_rn(__fmul_rn((float)(e - 24), SAMPLE_LN2), __fmul_rn(s, q));
}

// What every sampling kernel's block knows of its row.
struct SampleRow {
    bool sampled, cuts, top_k_on, top_p_on;
    int k;
    float p, m, scale;
};

__device__ __forceinline__ SampleRow sample_row(int r, const int* ids, const float* z, int V, const int* top_k,
                                                const float* temperature, const float* top_p) {
    SampleRow s;
    const float T = temperature[r];
    s.p = top_p[r];
    s.k = top_k[r];
    s.m = z[__ldcg(ids + r)];  // argmax_rows's, written by another SM
    s.sampled = T > 0.f && s.p > 0.f && fabsf(s.m) < pos_inf();  // a largest logit of inf or NaN: the argmax
    s.top_k_on = 0 < s.k && s.k < V;
    s.top_p_on = s.p < 1.f;
    s.cuts = s.top_k_on || s.top_p_on;
    s.scale = __fdiv_rn(SAMPLE_LOG2E, T);
    return s;
}

// The row's slice of this block: its SAMPLE_LOADS logits a thread (-inf past the row's end), loaded at once.
__device__ __forceinline__ int load_slice(float (&zs)[SAMPLE_LOADS], const float* z, int V) {
    const int lo = blockIdx.x * SAMPLE_LOADS * blockDim.x;
#pragma unroll
    for (int i = 0; i < SAMPLE_LOADS; ++i) {
        const int v = lo + i * blockDim.x + threadIdx.x;
        zs[i] = v < V ? z[v] : neg_inf();
    }
    return lo;
}

// Whether this block is the row's last to finish (after its writes are visible to the others); the last
// resets the count for the next step.
__device__ __forceinline__ bool last_block(unsigned* done) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(done, 1u) == gridDim.x - 1u;
        if (last) *done = 0u;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// The first i of n (a multiple of blockDim.x) values val(i) whose sum from val(0) to val(i), plus start,
// passes ok (monotone: once true, true for larger sums), n where none does; *before: start plus the values
// before it. Every thread takes a run of n / blockDim.x values, a block scan gives each its start.
template <typename Val, typename Ok>
__device__ int block_first(int n, Val val, Ok ok, unsigned long long start, unsigned long long* before) {
    __shared__ unsigned long long warp_total[32], found_before;
    __shared__ int found;
    const int per = n / blockDim.x, i0 = threadIdx.x * per, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned long long own = 0;
    for (int j = 0; j < per; ++j) own += val(i0 + j);
    unsigned long long scan = own;  // inclusive over the warp
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long x = __shfl_up_sync(FULL_MASK, scan, o);
        if (lane >= o) scan += x;
    }
    if (threadIdx.x == 0) found = n;
    if (lane == 31) warp_total[warp] = scan;
    __syncthreads();
    unsigned long long run = start + scan - own;
    for (int w = 0; w < warp; ++w) run += warp_total[w];
    int mine = n;
    for (int j = 0; j < per; ++j) {
        const unsigned long long x = val(i0 + j);
        if (ok(run + x)) {
            mine = i0 + j;
            break;
        }
        run += x;
    }
    if (mine < n) atomicMin(&found, mine);
    __syncthreads();
    if (mine < n && mine == found) found_before = run;
    __syncthreads();
    const int i = found;
    *before = i < n ? found_before : 0ull;
    __syncthreads();  // found and found_before are read before a next call writes them
    return i;
}

// The plan of top-p once the top-k cut is known (kbucket: its bucket, SAMPLE_BUCKETS: no top-k cut, then
// kmass the mass of that bucket's tokens at or above it): the total kept mass, the target, top-p's bucket.
__device__ void plan_top_p(RowState* st, const unsigned long long* mass, float p, int kbucket,
                           unsigned long long kmass, unsigned kcut) {
    auto kept = [&](int b) -> unsigned long long {
        return b < kbucket ? __ldcg(mass + b) : b == kbucket ? kmass : 0ull;
    };
    __shared__ unsigned long long scratch[32];
    unsigned long long own = 0;
    for (int b = threadIdx.x; b < SAMPLE_BUCKETS; b += blockDim.x) own += kept(b);
    const unsigned long long total = block_sum(own, scratch);
    const double target = __dmul_rn((double)p, __ull2double_rn(total));
    unsigned long long base;
    const int b = block_first(SAMPLE_BUCKETS, kept, [&](unsigned long long x) { return __ull2double_rn(x) >= target; },
                              0ull, &base);
    if (threadIdx.x == 0) {  // b exists: the whole kept mass reaches the target
        st->mode = 2u, st->bucket = (unsigned)b, st->lower = b == kbucket ? kcut : 0u;
        st->base = base, st->target = target;
    }
}

// kernel 1 of a sampled row: the histograms, and the plan of the first refine round.
extern "C" __global__ void sample_histogram(const int* __restrict__ ids, const float* __restrict__ logits, int V,
                                            const int* __restrict__ top_k, const float* __restrict__ temperature,
                                            const float* __restrict__ top_p, RowState* __restrict__ state,
                                            unsigned* __restrict__ counts, unsigned long long* __restrict__ masses) {
    __shared__ unsigned s_count[SAMPLE_BUCKETS];
    __shared__ unsigned long long s_mass[SAMPLE_BUCKETS];
    let_next_launch();
    wait_for_inputs();
    const int r = blockIdx.y;
    const float* z = logits + (long long)r * V;
    const SampleRow row = sample_row(r, ids, z, V, top_k, temperature, top_p);
    if (!row.sampled || !row.cuts) return;
    unsigned* count = counts + (long long)r * SAMPLE_BUCKETS;
    unsigned long long* mass = masses + (long long)r * SAMPLE_BUCKETS;
    for (int b = threadIdx.x; b < SAMPLE_BUCKETS; b += blockDim.x) s_count[b] = 0u, s_mass[b] = 0ull;
    float zs[SAMPLE_LOADS];
    load_slice(zs, z, V);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < SAMPLE_LOADS; ++i) {
        float t;
        const float w = sample_weight(zs[i], row.m, row.scale, t);
        const int b = w > 0.f ? sample_bucket(t) : -1;
        const unsigned long long x = row.top_p_on && w > 0.f ? sample_mass(w) : 0ull;
        const int b0 = __shfl_sync(FULL_MASK, b, 0);
        if (__all_sync(FULL_MASK, b == b0)) {  // the warp's tokens in one bucket (a flat row): one add
            const unsigned long long sum = warp_sum(x);
            if (b0 >= 0 && (threadIdx.x & 31) == 0) {
                if (row.top_k_on) atomicAdd(s_count + b0, 32u);
                if (row.top_p_on) atomicAdd(s_mass + b0, sum);
            }
        } else if (b >= 0) {
            if (row.top_k_on) atomicAdd(s_count + b, 1u);
            if (row.top_p_on) atomicAdd(s_mass + b, x);
        }
    }
    __syncthreads();
    for (int b = threadIdx.x; b < SAMPLE_BUCKETS; b += blockDim.x) {
        if (s_count[b]) atomicAdd(count + b, s_count[b]);
        if (s_mass[b]) atomicAdd(mass + b, s_mass[b]);
    }
    RowState* st = state + r;
    if (!last_block(&st->done)) return;
    if (row.top_k_on) {  // the bucket where the live tokens from the top reach k
        unsigned long long before;
        const int b = block_first(SAMPLE_BUCKETS, [&](int i) { return (unsigned long long)__ldcg(count + i); },
                                  [&](unsigned long long x) { return x >= (unsigned long long)row.k; }, 0ull, &before);
        if (b < SAMPLE_BUCKETS) {
            if (threadIdx.x == 0) st->mode = 1u, st->bucket = (unsigned)b, st->need = row.k - (unsigned)before,
                                  st->lower = 0u;
            return;
        }
    }
    if (row.top_p_on) {
        plan_top_p(st, mass, row.p, SAMPLE_BUCKETS, 0ull, 0u);
    } else if (threadIdx.x == 0) {  // at most k live tokens: all kept
        st->mode = 0u, st->cut = 0u;
    }
}

// The radix search of a refine round's last block over the bucket's gathered tokens: visit(f) calls f(key, w)
// for each. Returns the cut; *kept: the mass of the tokens at or above it.
template <typename Visit>
__device__ unsigned radix_cut(Visit visit, const RowState& st, int round, unsigned long long* kept) {
    __shared__ unsigned h_count[DIGITS];
    __shared__ unsigned long long h_mass[DIGITS], scratch[32];
    const unsigned lo = st.key_lo, hi = st.key_hi;
    int bits = lo == hi ? 0 : 32 - __clz(lo ^ hi);  // the low bits in which the keys differ
    unsigned prefix = bits == 32 ? 0u : lo & ~((1u << bits) - 1u);
    unsigned long long above_count = 0, above_mass = 0, at_mass = 0;
    do {
        const int width = min(DIGIT_BITS, bits), shift = bits - width;
        for (int i = threadIdx.x; i < DIGITS; i += blockDim.x) h_count[i] = 0u, h_mass[i] = 0ull;
        __syncthreads();
        visit([&](unsigned key, float w) {  // entry DIGITS - 1 - digit: the digits from the top
            if ((unsigned long long)key >> bits != (unsigned long long)prefix >> bits) return;
            const int slot = DIGITS - 1 - (int)((key >> shift) & ((1u << width) - 1u));
            atomicAdd(h_count + slot, 1u);
            atomicAdd(h_mass + slot, sample_mass(w));
        });
        __syncthreads();
        unsigned long long before;
        int i;
        if (round == 1) {
            i = block_first(DIGITS, [&](int j) { return (unsigned long long)h_count[j]; },
                            [&](unsigned long long x) { return x >= (unsigned long long)st.need; }, above_count, &before);
            above_count = before;
            unsigned long long own = 0;
            for (int j = threadIdx.x; j < i; j += blockDim.x) own += h_mass[j];
            above_mass += block_sum(own, scratch);
        } else {
            const unsigned long long base = st.base;
            const double target = st.target;
            i = block_first(DIGITS, [&](int j) { return h_mass[j]; },
                            [&](unsigned long long x) { return __ull2double_rn(base + x) >= target; }, above_mass,
                            &before);
            above_mass = before;
        }
        i = min(i, DIGITS - 1);  // found: the whole bucket passes
        at_mass = above_mass + h_mass[i];
        prefix |= (unsigned)(DIGITS - 1 - i) << shift;
        bits = shift;
        __syncthreads();  // the histograms are read before the next level clears them
    } while (bits > 0);
    *kept = at_mass;
    return prefix;
}

// kernels 2 and 3 of a sampled row (round 1: the top-k cut, 2: the top-p cut), where its state has that round
// pending: gather the bucket's tokens, and the last block finds the cut among them.
extern "C" __global__ void sample_refine(const int* __restrict__ ids, const float* __restrict__ logits, int V,
                                         const int* __restrict__ top_k, const float* __restrict__ temperature,
                                         const float* __restrict__ top_p, RowState* __restrict__ state,
                                         const unsigned long long* __restrict__ masses,
                                         unsigned* __restrict__ list_key, float* __restrict__ list_w, int round) {
    __shared__ unsigned s_lo[32], s_hi[32];
    let_next_launch();
    wait_for_inputs();
    const int r = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* z = logits + (long long)r * V;
    const SampleRow row = sample_row(r, ids, z, V, top_k, temperature, top_p);
    if (!row.sampled || !row.cuts) return;
    RowState* st = state + r;
    if (__ldcg(&st->mode) != (unsigned)round) return;
    const int bucket = (int)__ldcg(&st->bucket);
    const unsigned lower = __ldcg(&st->lower);
    unsigned* keys = list_key + (long long)r * SAMPLE_LIST;
    float* ws = list_w + (long long)r * SAMPLE_LIST;
    float zs[SAMPLE_LOADS];
    load_slice(zs, z, V);
    unsigned lo = 0xffffffffu, hi = 0u;
#pragma unroll
    for (int i = 0; i < SAMPLE_LOADS; ++i) {
        float t;
        const float w = sample_weight(zs[i], row.m, row.scale, t);
        const unsigned key = order_key(zs[i]);
        const bool in = w > 0.f && sample_bucket(t) == bucket && key >= lower;
        const unsigned ballot = __ballot_sync(FULL_MASK, in);
        if (!ballot) continue;
        unsigned at = 0;
        if (lane == 0) at = atomicAdd(&st->n, (unsigned)__popc(ballot));
        at = __shfl_sync(FULL_MASK, at, 0) + __popc(ballot & ((1u << lane) - 1u));
        if (in) {
            if (at < SAMPLE_LIST) keys[at] = key, ws[at] = w;
            lo = min(lo, key), hi = max(hi, key);
        }
    }
    lo = __reduce_min_sync(FULL_MASK, lo), hi = __reduce_max_sync(FULL_MASK, hi);
    if (lane == 0) s_lo[warp] = lo, s_hi[warp] = hi;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) lo = min(lo, s_lo[w]), hi = max(hi, s_hi[w]);
        if (lo <= hi) atomicMin(&st->key_lo, lo), atomicMax(&st->key_hi, hi);
    }
    if (!last_block(&st->done)) return;
    RowState s;
    s.key_lo = __ldcg(&st->key_lo), s.key_hi = __ldcg(&st->key_hi), s.n = __ldcg(&st->n);
    s.need = __ldcg(&st->need), s.base = __ldcg(&st->base), s.target = __ldcg(&st->target);
    unsigned long long kept = 0;
    unsigned cut;
    if (s.key_lo == s.key_hi) {  // one value (a flat row): the cut; the bucket's tokens are all at it
        cut = s.key_lo;
        kept = round == 1 ? __ldcg(masses + (long long)r * SAMPLE_BUCKETS + bucket) : 0ull;
    } else if (s.n <= SAMPLE_LIST) {
        cut = radix_cut([&](auto f) {
            for (int i = threadIdx.x; i < (int)s.n; i += blockDim.x) f(__ldcg(keys + i), __ldcg(ws + i));
        }, s, round, &kept);
    } else {  // more than the list holds (a nearly flat row): the search reads the row itself
        cut = radix_cut([&](auto f) {
            for (int v = threadIdx.x; v < V; v += blockDim.x) {
                float t;
                const float w = sample_weight(z[v], row.m, row.scale, t);
                const unsigned key = order_key(z[v]);
                if (w > 0.f && sample_bucket(t) == bucket && key >= lower) f(key, w);
            }
        }, s, round, &kept);
    }
    __syncthreads();
    if (threadIdx.x == 0) st->n = 0u, st->key_lo = 0xffffffffu, st->key_hi = 0u;
    if (round == 1 && row.top_p_on) {
        plan_top_p(st, masses + (long long)r * SAMPLE_BUCKETS, row.p, bucket, kept, cut);
    } else if (threadIdx.x == 0) {
        st->mode = 0u, st->cut = cut;
    }
}

// kernel 4 of a sampled row: the draw, the smallest (E / w, id) over the kept tokens; the last block writes it
// to ids and clears the histograms.
extern "C" __global__ void sample_draw(int* __restrict__ ids, const float* __restrict__ logits, int V,
                                       const int* __restrict__ top_k, const float* __restrict__ temperature,
                                       const float* __restrict__ top_p, const unsigned* __restrict__ seed_lo,
                                       const unsigned* __restrict__ seed_hi, const int* __restrict__ index,
                                       RowState* __restrict__ state, unsigned* __restrict__ counts,
                                       unsigned long long* __restrict__ masses) {
    __shared__ unsigned long long s_best[32];
    let_next_launch();
    wait_for_inputs();
    const int r = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* z = logits + (long long)r * V;
    const SampleRow row = sample_row(r, ids, z, V, top_k, temperature, top_p);
    if (!row.sampled) return;
    RowState* st = state + r;
    const unsigned cut = row.cuts ? __ldcg(&st->cut) : 0u;
    const unsigned long long seed = mix64(((unsigned long long)seed_hi[r] << 32) | seed_lo[r]);
    const unsigned long long counter = (unsigned long long)(unsigned)index[r] << 32;
    float zs[SAMPLE_LOADS];
    const int lo = load_slice(zs, z, V);
    unsigned long long best = ~0ull;
#pragma unroll
    for (int i = 0; i < SAMPLE_LOADS; ++i) {
        float t;
        const float w = sample_weight(zs[i], row.m, row.scale, t);
        if (w > 0.f && order_key(zs[i]) >= cut) {
            const int v = lo + i * blockDim.x + threadIdx.x;
            const float q = __fdiv_rn(sample_noise(seed, counter, v), w);  // positive: its bits order as it does
            best = min(best, ((unsigned long long)__float_as_uint(q) << 32) | (unsigned)v);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) best = min(best, __shfl_xor_sync(FULL_MASK, best, o));
    if (lane == 0) s_best[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) best = min(best, s_best[w]);
        if (best != ~0ull) atomicMin(&st->best, best);
    }
    if (!last_block(&st->done)) return;
    if (threadIdx.x == 0) {
        const unsigned long long drawn = __ldcg(&st->best);
        if (drawn != ~0ull) ids[r] = (int)(unsigned)drawn;  // always: the largest logit is kept
        st->best = ~0ull;
    }
    if (row.cuts)
        for (int b = threadIdx.x; b < SAMPLE_BUCKETS; b += blockDim.x)
            counts[(long long)r * SAMPLE_BUCKETS + b] = 0u, masses[(long long)r * SAMPLE_BUCKETS + b] = 0ull;
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
