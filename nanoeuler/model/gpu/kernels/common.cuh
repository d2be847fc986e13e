// Helpers shared by the nanoeuler kernels. The .cu files are compiled at run time by NVRTC through CuPy
// (nanoeuler/model/gpu/runtime.py inlines this header) and by nvcc in CI (tests/test_gpu.py), so they use no
// standard headers: only CUDA built-ins. The numbers a kernel shares with Python come as -D defines
// (nanoeuler/model/gpu/constants.py), never with a value of the kernel's own.
#pragma once

#define FULL_MASK 0xffffffffu
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32), returned to every thread. scratch: 32 values in shared
// memory; the leading barrier lets a caller reuse it for consecutive reductions.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? scratch[lane] : (T)0;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? scratch[lane] : neg_inf();
    return warp_max(v);
}

// ------------------------------------------------------------------------------------- element types
// Activations (and the compute copy of the weights) are `act_t`: float, or bf16 when the module is compiled
// with -DACT_BF16=1 (layers.py builds each kernel file once per element type). Math is always float: load
// with to_float, store with from_float. Parameter gradients, norm statistics and losses stay float.
struct __align__(2) bf16 {
    unsigned short bits;
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return __uint_as_float((unsigned)x.bits << 16); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float x) {  // round to nearest even, as cuBLAS does
    bf16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}

// Four consecutive elements (16-byte aligned for float, 8-byte for bf16) as a float4, and back.
__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load4(const bf16* p) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                       __uint_as_float(u.y & 0xffff0000u));
}
__device__ __forceinline__ void store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {  // lo at the lower address
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ void store4(bf16* p, float4 v) {
    *reinterpret_cast<uint2*>(p) = make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
}

#ifndef ACT_BF16
#define ACT_BF16 0
#endif
#if ACT_BF16
typedef bf16 act_t;
#else
typedef float act_t;
#endif

// V consecutive elements to and from float registers: V = 4 takes one vector access (the element count of
// the row a multiple of 4, so every row starts aligned), V = 1 the scalar fallback for odd sizes.
template <int V, typename T>
__device__ __forceinline__ void load_vec(float (&r)[V], const T* p) {
    if constexpr (V == 4) {
        const float4 f = load4(p);
        r[0] = f.x, r[1] = f.y, r[2] = f.z, r[3] = f.w;
    } else {
#pragma unroll
        for (int i = 0; i < V; ++i) r[i] = to_float(p[i]);
    }
}
template <int V, typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&r)[V]) {
    if constexpr (V == 4) {
        store4(p, make_float4(r[0], r[1], r[2], r[3]));
    } else {
#pragma unroll
        for (int i = 0; i < V; ++i) p[i] = from_float<T>(r[i]);
    }
}

// The act_t elements of 16 bytes (8 bf16 or 4 float, as one uint4 load brought them) as floats.
constexpr int PACK = 16 / sizeof(act_t);
__device__ __forceinline__ void unpack16(float (&r)[PACK], uint4 u) {
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if constexpr (PACK == 8) r[2 * i] = __uint_as_float(w[i] << 16), r[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        else r[i] = __uint_as_float(w[i]);
    }
}

// PACK floats as the 16 bytes of act_t that unpack16 reads back (bf16 rounded to nearest even, as from_float).
__device__ __forceinline__ uint4 pack16(const float (&r)[PACK]) {
    if constexpr (PACK == 8)
        return make_uint4(pack_bf16x2(r[0], r[1]), pack_bf16x2(r[2], r[3]), pack_bf16x2(r[4], r[5]),
                          pack_bf16x2(r[6], r[7]));
    else
        return make_uint4(__float_as_uint(r[0]), __float_as_uint(r[1]), __float_as_uint(r[2]), __float_as_uint(r[3]));
}

// The rotary embedding's rotation of a (x1, x2) pair, rounded without FMA contraction (the same bits however
// the compiler schedules the caller).
__device__ __forceinline__ void rotate_pair(float x1, float x2, float c, float s, float& y1, float& y2) {
    y1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
    y2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

// Tensor-core products (mma.sync, float32 accumulators): the attention kernels and decoding's matrix-vector
// products. Fragment layouts: attention.cu's header.
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

// c += a b to float32 accuracy on the TF32 tensor cores ("3xTF32"): each operand (float32 bits) split into a
// TF32 high part and a TF32 residual, three products, the residuals' first.
__device__ __forceinline__ void mma_3xtf32(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    unsigned hi[4], lo[4], bhi[2], blo[2];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        hi[i] = to_tf32(__uint_as_float(a[i]));
        lo[i] = to_tf32(__uint_as_float(a[i]) - __uint_as_float(hi[i]));
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        bhi[i] = to_tf32(__uint_as_float(b[i]));
        blo[i] = to_tf32(__uint_as_float(b[i]) - __uint_as_float(bhi[i]));
    }
    mma_tf32(c, lo[0], lo[1], lo[2], lo[3], bhi[0], bhi[1]);
    mma_tf32(c, hi[0], hi[1], hi[2], hi[3], blo[0], blo[1]);
    mma_tf32(c, hi[0], hi[1], hi[2], hi[3], bhi[0], bhi[1]);
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Programmatic dependent launch (sm_90+; runtime.py launches decoding's kernels so inside CUDA graphs): a
// kernel may start while the one before it is still running. Everything it reads that the kernels before
// it write, and everything it writes, comes after wait_for_inputs() (which returns once they have finished
// and their writes are visible); before it, only what no kernel of the step writes (the weights, the
// position, the cache's older rows). let_next_launch() lets the next kernel start. Elsewhere both do nothing.
__device__ __forceinline__ void wait_for_inputs() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void let_next_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}
