// FlashAttention, forward and backward: causal, grouped-query, head_dim 32 or 64, any sequence length.
//
// Tiled with online softmax; the only thing stored besides the output is the per-row logsumexp, never a
// T x T matrix. The matrix products run on the tensor cores through mma.sync m16n8k8 in TF32. Training uses
// one TF32 product per tile (the precision of the cuBLAS TF32 matmuls beside it); the checks use the
// "3xTF32" split (each operand = TF32 high part + TF32 residual, three products), which gives float32
// accuracy. Layout: the fused activation qkv (B, T, H + 2G, D) with q heads, then k heads, then v heads;
// query head h reads kv head h / (H / G).
//
// A block is 4 warps; each warp owns 16 rows of a 64-row tile and loops over 64-wide tiles of the other side.
// Fragment layout of m16n8k8 (g = lane / 4, t = lane % 4): A rows g, g+8 x cols t, t+4; B rows (k) t, t+4 x
// col (n) g; C rows g, g+8 x cols 2t, 2t+1. A product P @ V whose P comes out of an accumulator (cols 2t,
// 2t+1) feeds it straight back as an A operand by numbering the k index so that k = t is column 2t and
// k = t + 4 is column 2t + 1, and reading V's rows 2t, 2t+1 to match: no shuffles, no trip through memory.
#include "common.cuh"

#define ATT_TILE 64
#define ATT_THREADS 128
// The module is built once per precision: -DATT_PRECISE=1 for the 3xTF32 kernels of the checks.
#ifndef ATT_PRECISE
#define ATT_PRECISE 0
#endif

__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// An operand as the fast kernels keep it: rounded to TF32 once, where it is stored (shared-memory tiles, the
// query fragments, P and dS), not at each of its uses. The precise kernels keep full float32 operands.
template <bool PRECISE>
__device__ __forceinline__ float operand(float x) {
    return PRECISE ? x : __uint_as_float(to_tf32(x));
}

// c (16x8) += a (16x8) @ b (8x8); operands as operand<PRECISE>() made them.
template <bool PRECISE>
__device__ __forceinline__ void mma(float (&c)[4], float a0, float a1, float a2, float a3, float b0, float b1) {
    if (PRECISE) {  // 3xTF32: small terms first, then the main product
        const unsigned A0 = to_tf32(a0), A1 = to_tf32(a1), A2 = to_tf32(a2), A3 = to_tf32(a3);
        const unsigned B0 = to_tf32(b0), B1 = to_tf32(b1);
        mma_tf32(c, to_tf32(a0 - __uint_as_float(A0)), to_tf32(a1 - __uint_as_float(A1)),
                 to_tf32(a2 - __uint_as_float(A2)), to_tf32(a3 - __uint_as_float(A3)), B0, B1);
        mma_tf32(c, A0, A1, A2, A3, to_tf32(b0 - __uint_as_float(B0)), to_tf32(b1 - __uint_as_float(B1)));
        mma_tf32(c, A0, A1, A2, A3, B0, B1);
    } else {
        mma_tf32(c, __float_as_uint(a0), __float_as_uint(a1), __float_as_uint(a2), __float_as_uint(a3),
                 __float_as_uint(b0), __float_as_uint(b1));
    }
}

// Load rows [row0, row0 + 64) of one head of a (rows, NH, D) array into a (64, D + 4) shared tile, zeros past
// `rows`, as mma operands. The padding of 4 floats makes every fragment read below conflict-free.
template <int D, bool PRECISE>
__device__ __forceinline__ void load_tile(float* __restrict__ dst, const float* __restrict__ src, int row0,
                                          int rows, long long row_stride) {
    constexpr int LDS = D + 4;
    for (int i = threadIdx.x; i < ATT_TILE * D / 4; i += ATT_THREADS) {
        const int r = i / (D / 4), c = (i % (D / 4)) * 4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (row0 + r < rows) v = *reinterpret_cast<const float4*>(src + (row0 + r) * row_stride + c);
        *reinterpret_cast<float4*>(dst + r * LDS + c) =
            make_float4(operand<PRECISE>(v.x), operand<PRECISE>(v.y), operand<PRECISE>(v.z), operand<PRECISE>(v.w));
    }
}

// ------------------------------------------------------------------------------------------------ forward
// out (B, Tq, H, D), lse (B, H, Tq) natural-log logsumexp of the scaled scores. qkv (B, Tk, NH, D), rows
// batch_stride floats apart between batches (a view into the KV cache); the queries are its rows
// q_start = Tk - Tq .. Tk - 1. Grid (H, B, query tiles), the tiles with the most keys first.
template <int D, bool PRECISE>
__device__ __forceinline__ void attention_forward_block(float* __restrict__ out, float* __restrict__ lse,
                                                        const float* __restrict__ qkv, int Tq, int Tk, int H,
                                                        int G, long long batch_stride, float scale) {
    constexpr int LDS = D + 4;
    __shared__ __align__(16) float Ks[ATT_TILE * LDS];
    __shared__ __align__(16) float Vs[ATT_TILE * LDS];
    const int NH = H + 2 * G, q_start = Tk - Tq;
    const int h = blockIdx.x, b = blockIdx.y, qt = gridDim.z - 1 - blockIdx.z, kvh = h / (H / G);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float* base = qkv + b * batch_stride;
    const long long rs = (long long)NH * D;  // row stride
    const int row0 = qt * ATT_TILE + warp * 16 + g, row1 = row0 + 8;  // this thread's query rows
    const int pos0 = q_start + row0, pos1 = q_start + row1;           // and their positions
    const float sl2 = scale * LOG2E;  // scores in log2 units, for exp2

    float qf[D / 8][4];  // the warp's 16 query rows as A fragments
    {
        const float* q0 = base + (q_start + row0) * rs + h * D;
        const float* q1 = q0 + 8 * rs;
#pragma unroll
        for (int kk = 0; kk < D / 8; ++kk) {
            qf[kk][0] = row0 < Tq ? operand<PRECISE>(q0[kk * 8 + t]) : 0.f;
            qf[kk][1] = row1 < Tq ? operand<PRECISE>(q1[kk * 8 + t]) : 0.f;
            qf[kk][2] = row0 < Tq ? operand<PRECISE>(q0[kk * 8 + t + 4]) : 0.f;
            qf[kk][3] = row1 < Tq ? operand<PRECISE>(q1[kk * 8 + t + 4]) : 0.f;
        }
    }
    float o[D / 8][4];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.f;
    float m0 = neg_inf(), m1 = neg_inf(), l0 = 0.f, l1 = 0.f;  // running max (log2 units) and sum per row

    const int first_pos = q_start + qt * ATT_TILE;
    const int last_pos = q_start + min(Tq, (qt + 1) * ATT_TILE) - 1;
    const int n_kt = last_pos / ATT_TILE + 1;
    for (int kt = 0; kt < n_kt; ++kt) {
        const int k0 = kt * ATT_TILE;
        __syncthreads();  // everyone is done with the previous tile
        load_tile<D, PRECISE>(Ks, base + (H + kvh) * D, k0, Tk, rs);
        load_tile<D, PRECISE>(Vs, base + (H + G + kvh) * D, k0, Tk, rs);
        __syncthreads();

        float s[ATT_TILE / 8][4];  // S = Q K^T for 16 rows x 64 keys
#pragma unroll
        for (int nt = 0; nt < ATT_TILE / 8; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
            const float* kr = Ks + (nt * 8 + g) * LDS;
#pragma unroll
            for (int kk = 0; kk < D / 8; ++kk)
                mma<PRECISE>(s[nt], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], kr[kk * 8 + t], kr[kk * 8 + t + 4]);
        }
        // causal mask and the end of the keys, only on tiles that reach them
        const bool edge = k0 + ATT_TILE - 1 > first_pos || k0 + ATT_TILE > Tk;
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int nt = 0; nt < ATT_TILE / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = s[nt][e] * sl2;
                if (edge) {
                    const int key = k0 + nt * 8 + 2 * t + (e & 1);
                    if (key > (e < 2 ? pos0 : pos1) || key >= Tk) v = neg_inf();
                }
                s[nt][e] = v;
                if (e < 2) mx0 = fmaxf(mx0, v);
                else mx1 = fmaxf(mx1, v);
            }
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 2));
        // a row with every key so far masked keeps max -inf; exponentiate against 0 then (all terms are 0)
        const float ref0 = mx0 == neg_inf() ? 0.f : mx0, ref1 = mx1 == neg_inf() ? 0.f : mx1;
        const float c0 = exp2f(m0 - ref0), c1 = exp2f(m1 - ref1);
        m0 = mx0;
        m1 = mx1;
        l0 *= c0;
        l1 *= c1;
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
            o[dn][0] *= c0;
            o[dn][1] *= c0;
            o[dn][2] *= c1;
            o[dn][3] *= c1;
        }
#pragma unroll
        for (int nt = 0; nt < ATT_TILE / 8; ++nt) {
            s[nt][0] = exp2f(s[nt][0] - ref0);
            s[nt][1] = exp2f(s[nt][1] - ref0);
            s[nt][2] = exp2f(s[nt][2] - ref1);
            s[nt][3] = exp2f(s[nt][3] - ref1);
            l0 += s[nt][0] + s[nt][1];
            l1 += s[nt][2] + s[nt][3];
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] = operand<PRECISE>(s[nt][e]);
        }
        // O += P V: P's accumulator fragments are the A operand (k = t <-> key 2t, k = t + 4 <-> key 2t + 1)
#pragma unroll
        for (int ks = 0; ks < ATT_TILE / 8; ++ks) {
            const float* v0 = Vs + (ks * 8 + 2 * t) * LDS;
            const float* v1 = v0 + LDS;
#pragma unroll
            for (int dn = 0; dn < D / 8; ++dn)
                mma<PRECISE>(o[dn], s[ks][0], s[ks][2], s[ks][1], s[ks][3], v0[dn * 8 + g], v1[dn * 8 + g]);
        }
    }
    l0 += __shfl_xor_sync(FULL_MASK, l0, 1);
    l0 += __shfl_xor_sync(FULL_MASK, l0, 2);
    l1 += __shfl_xor_sync(FULL_MASK, l1, 1);
    l1 += __shfl_xor_sync(FULL_MASK, l1, 2);
    if (row0 < Tq) {
        const float inv = 1.f / l0;
        float* dst = out + (((long long)b * Tq + row0) * H + h) * D + 2 * t;
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn)
            *reinterpret_cast<float2*>(dst + dn * 8) = make_float2(o[dn][0] * inv, o[dn][1] * inv);
        if (t == 0) lse[((long long)b * H + h) * Tq + row0] = (m0 + log2f(l0)) * LN2;
    }
    if (row1 < Tq) {
        const float inv = 1.f / l1;
        float* dst = out + (((long long)b * Tq + row1) * H + h) * D + 2 * t;
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn)
            *reinterpret_cast<float2*>(dst + dn * 8) = make_float2(o[dn][2] * inv, o[dn][3] * inv);
        if (t == 0) lse[((long long)b * H + h) * Tq + row1] = (m1 + log2f(l1)) * LN2;
    }
}

#define ATTENTION_FORWARD(NAME, D, PRECISE)                                                                  \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                               \
        NAME(float* out, float* lse, const float* qkv, int Tq, int Tk, int H, int G, long long batch_stride, \
             float scale) {                                                                                 \
        attention_forward_block<D, PRECISE>(out, lse, qkv, Tq, Tk, H, G, batch_stride, scale);              \
    }
ATTENTION_FORWARD(attention_forward_d64, 64, ATT_PRECISE)
ATTENTION_FORWARD(attention_forward_d32, 32, ATT_PRECISE)

// ----------------------------------------------------------------------------------------------- backward
// delta (B, H, T) = rowsum(dout * out), one warp per (b, t, h) row; the FlashAttention-2 preprocessing step.
extern "C" __global__ void attention_backward_delta(float* __restrict__ delta, const float* __restrict__ dout,
                                                    const float* __restrict__ out, int B, int T, int H, int D) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= (long long)B * T * H) return;
    float s = 0.f;
    for (int d = lane; d < D; d += 32) s += dout[row * D + d] * out[row * D + d];
    s = warp_sum(s);
    const int h = (int)(row % H);
    const long long bt = row / H;
    if (lane == 0) delta[(bt / T * H + h) * T + bt % T] = s;
}

// One block per (query head, batch, 64-key tile); grid (H, B, key tiles), the tiles with the most queries
// first. The block keeps its keys' dK and dV in registers while it walks the query tiles at and after the
// diagonal (warp w owns keys 16w .. 16w + 15, so S and dP come out transposed, keys x queries); dQ goes
// straight to global memory with atomic adds, and so do dK, dV at the end, because the group's query heads
// run in other blocks. dqkv (B, T, NH, D) must be zero on entry; lse natural-log, delta from the kernel above.
template <int D, bool PRECISE>
__device__ __forceinline__ void attention_backward_block(float* __restrict__ dqkv, const float* __restrict__ dout,
                                                         const float* __restrict__ lse,
                                                         const float* __restrict__ delta,
                                                         const float* __restrict__ qkv, int T, int H, int G,
                                                         float scale) {
    constexpr int LDS = D + 4, LDP = ATT_TILE + 4;
    extern __shared__ __align__(16) float smem[];
    float* Ks = smem;                        // (64 keys, D)
    float* Vs = Ks + ATT_TILE * LDS;         // (64 keys, D)
    float* Qs = Vs + ATT_TILE * LDS;         // (64 queries, D)
    float* dOs = Qs + ATT_TILE * LDS;        // (64 queries, D)
    float* dSs = dOs + ATT_TILE * LDS;       // (64 queries, 64 keys)
    float* lse_s = dSs + ATT_TILE * LDP;     // (64,) in log2 units; +inf past T so p = 0 there
    float* delta_s = lse_s + ATT_TILE;       // (64,)

    const int NH = H + 2 * G;
    const int h = blockIdx.x, b = blockIdx.y, kt = blockIdx.z, kvh = h / (H / G), k0 = kt * ATT_TILE;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const long long rs = (long long)NH * D;
    const float* base = qkv + (long long)b * T * rs;
    float* dbase = dqkv + (long long)b * T * rs;
    const float* dobase = dout + ((long long)b * T * H + h) * D;
    const float sl2 = scale * LOG2E;

    load_tile<D, PRECISE>(Ks, base + (H + kvh) * D, k0, T, rs);
    load_tile<D, PRECISE>(Vs, base + (H + G + kvh) * D, k0, T, rs);
    const int kr0 = warp * 16 + g, kr1 = kr0 + 8;  // this thread's key rows in the tile
    const int key0 = k0 + kr0, key1 = k0 + kr1;
    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
        dk[dn][0] = dk[dn][1] = dk[dn][2] = dk[dn][3] = 0.f;
        dv[dn][0] = dv[dn][1] = dv[dn][2] = dv[dn][3] = 0.f;
    }

    const int n_qt = (T + ATT_TILE - 1) / ATT_TILE;
    for (int qt = kt; qt < n_qt; ++qt) {
        const int q0 = qt * ATT_TILE;
        __syncthreads();  // the previous iteration is done with Qs, dOs, dSs
        load_tile<D, PRECISE>(Qs, base + h * D, q0, T, rs);
        load_tile<D, PRECISE>(dOs, dobase, q0, T, (long long)H * D);
        for (int i = threadIdx.x; i < ATT_TILE; i += ATT_THREADS) {
            const bool ok = q0 + i < T;
            lse_s[i] = ok ? lse[((long long)b * H + h) * T + q0 + i] * LOG2E : pos_inf();
            delta_s[i] = ok ? delta[((long long)b * H + h) * T + q0 + i] : 0.f;
        }
        __syncthreads();

        // S^T = K Q^T and dP^T = V dO^T, 16 keys x 64 queries per warp
        float p[ATT_TILE / 8][4], ds[ATT_TILE / 8][4];
        const float* ka = Ks + kr0 * LDS;
        const float* kb = ka + 8 * LDS;
        const float* va = Vs + kr0 * LDS;
        const float* vb = va + 8 * LDS;
#pragma unroll
        for (int nt = 0; nt < ATT_TILE / 8; ++nt) {
            p[nt][0] = p[nt][1] = p[nt][2] = p[nt][3] = 0.f;
            ds[nt][0] = ds[nt][1] = ds[nt][2] = ds[nt][3] = 0.f;
            const float* qr = Qs + (nt * 8 + g) * LDS;
            const float* dr = dOs + (nt * 8 + g) * LDS;
#pragma unroll
            for (int kk = 0; kk < D / 8; ++kk) {
                const int c = kk * 8 + t;
                mma<PRECISE>(p[nt], ka[c], kb[c], ka[c + 4], kb[c + 4], qr[c], qr[c + 4]);
                mma<PRECISE>(ds[nt], va[c], vb[c], va[c + 4], vb[c + 4], dr[c], dr[c + 4]);
            }
        }
        // P^T = exp(S^T - lse), causal mask on the diagonal tile; dS^T = P^T (dP^T - delta)
        const bool diag = q0 < k0 + ATT_TILE - 1;
#pragma unroll
        for (int nt = 0; nt < ATT_TILE / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int q = nt * 8 + 2 * t + (e & 1);
                float pv = exp2f(p[nt][e] * sl2 - lse_s[q]);
                if (diag && (e < 2 ? key0 : key1) > q0 + q) pv = 0.f;
                ds[nt][e] = operand<PRECISE>(pv * (ds[nt][e] - delta_s[q]));
                p[nt][e] = operand<PRECISE>(pv);
            }
        }
        // dV += P^T dO and dK += dS^T Q (the query index is the k index: k = t <-> query 2t, t + 4 <-> 2t + 1)
#pragma unroll
        for (int ks = 0; ks < ATT_TILE / 8; ++ks) {
            const float* d0 = dOs + (ks * 8 + 2 * t) * LDS;
            const float* d1 = d0 + LDS;
            const float* qa = Qs + (ks * 8 + 2 * t) * LDS;
            const float* qb = qa + LDS;
#pragma unroll
            for (int dn = 0; dn < D / 8; ++dn) {
                mma<PRECISE>(dv[dn], p[ks][0], p[ks][2], p[ks][1], p[ks][3], d0[dn * 8 + g], d1[dn * 8 + g]);
                mma<PRECISE>(dk[dn], ds[ks][0], ds[ks][2], ds[ks][1], ds[ks][3], qa[dn * 8 + g], qb[dn * 8 + g]);
            }
        }
        // dS (queries x keys) through shared memory, then dQ = dS K for the warp's 16 queries
#pragma unroll
        for (int nt = 0; nt < ATT_TILE / 8; ++nt) {
            float* col = dSs + (nt * 8 + 2 * t) * LDP;
            col[kr0] = ds[nt][0];
            col[LDP + kr0] = ds[nt][1];
            col[kr1] = ds[nt][2];
            col[LDP + kr1] = ds[nt][3];
        }
        __syncthreads();
        float dq[D / 8][4];
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) dq[dn][0] = dq[dn][1] = dq[dn][2] = dq[dn][3] = 0.f;
        const float* sa = dSs + (warp * 16 + g) * LDP;
        const float* sb = sa + 8 * LDP;
#pragma unroll
        for (int ks = 0; ks < ATT_TILE / 8; ++ks) {
            const float* k0r = Ks + (ks * 8 + t) * LDS;
            const float* k1r = k0r + 4 * LDS;
            const int c = ks * 8 + t;
#pragma unroll
            for (int dn = 0; dn < D / 8; ++dn)
                mma<PRECISE>(dq[dn], sa[c], sb[c], sa[c + 4], sb[c + 4], k0r[dn * 8 + g], k1r[dn * 8 + g]);
        }
        const int qa = q0 + warp * 16 + g, qb = qa + 8;
        if (qa < T) {
            float* dst = dbase + qa * rs + h * D + 2 * t;
#pragma unroll
            for (int dn = 0; dn < D / 8; ++dn) {
                atomicAdd(dst + dn * 8, dq[dn][0] * scale);
                atomicAdd(dst + dn * 8 + 1, dq[dn][1] * scale);
            }
        }
        if (qb < T) {
            float* dst = dbase + qb * rs + h * D + 2 * t;
#pragma unroll
            for (int dn = 0; dn < D / 8; ++dn) {
                atomicAdd(dst + dn * 8, dq[dn][2] * scale);
                atomicAdd(dst + dn * 8 + 1, dq[dn][3] * scale);
            }
        }
    }
    if (key0 < T) {
        float* dkr = dbase + key0 * rs + (H + kvh) * D + 2 * t;
        float* dvr = dbase + key0 * rs + (H + G + kvh) * D + 2 * t;
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
            atomicAdd(dkr + dn * 8, dk[dn][0] * scale);
            atomicAdd(dkr + dn * 8 + 1, dk[dn][1] * scale);
            atomicAdd(dvr + dn * 8, dv[dn][0]);
            atomicAdd(dvr + dn * 8 + 1, dv[dn][1]);
        }
    }
    if (key1 < T) {
        float* dkr = dbase + key1 * rs + (H + kvh) * D + 2 * t;
        float* dvr = dbase + key1 * rs + (H + G + kvh) * D + 2 * t;
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
            atomicAdd(dkr + dn * 8, dk[dn][2] * scale);
            atomicAdd(dkr + dn * 8 + 1, dk[dn][3] * scale);
            atomicAdd(dvr + dn * 8, dv[dn][2]);
            atomicAdd(dvr + dn * 8 + 1, dv[dn][3]);
        }
    }
}

#define ATTENTION_BACKWARD(NAME, D, PRECISE)                                                                 \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                               \
        NAME(float* dqkv, const float* dout, const float* lse, const float* delta, const float* qkv, int T,  \
             int H, int G, float scale) {                                                                   \
        attention_backward_block<D, PRECISE>(dqkv, dout, lse, delta, qkv, T, H, G, scale);                  \
    }
ATTENTION_BACKWARD(attention_backward_d64, 64, ATT_PRECISE)
ATTENTION_BACKWARD(attention_backward_d32, 32, ATT_PRECISE)
