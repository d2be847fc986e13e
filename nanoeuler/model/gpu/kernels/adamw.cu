// The optimizer over the flat parameter buffer: AdamW in one launch, and the sum of squares behind the
// global gradient-norm clip (in double). AdamW's arithmetic is float32 (in double the pass is bound by the
// GPU's double-precision units), so the step differs from the CPU engine's by float32 rounding (about 1e-7
// relative).
#include "common.cuh"

// g = grads * grad_scale (the clip factor); m, v moments; bias corrections bc1 = 1 - beta1^t, bc2 likewise;
// decoupled weight decay where decay_mask (a byte a parameter, the least traffic) is 1. squares (nullable):
// the global gradient's sum of squares, from which the clip factor is computed here in double, as the host's
// clip_scale computes it (nanoeuler/model/limits.py), in place of grad_scale: the host need not wait for the
// norm. compute_copy (nullable): the weights the layers read, when they are not the master weights themselves
// (bf16 training), rewritten in the same pass.
extern "C" __global__ void adamw_update(float* __restrict__ params, const float* __restrict__ grads,
                                        float* __restrict__ m, float* __restrict__ v,
                                        const unsigned char* __restrict__ decay_mask, long long n, double lr,
                                        double beta1, double beta2, double eps, double weight_decay,
                                        double grad_scale, const double* __restrict__ squares, double grad_clip,
                                        double clip_eps, double bc1, double bc2,
                                        act_t* __restrict__ compute_copy) {
    if (squares) grad_scale = grad_clip > 0 ? fmin(1.0, grad_clip / (sqrt(*squares) + clip_eps)) : 1.0;
    const float b1 = (float)beta1, b2 = (float)beta2, gs = (float)grad_scale, rate = (float)lr;
    const float rbc1 = (float)(1.0 / bc1), rbc2 = (float)(1.0 / bc2), e = (float)eps, wd = (float)weight_decay;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float g = grads[i] * gs;
        const float mi = b1 * m[i] + (1.f - b1) * g;
        const float vi = b2 * v[i] + (1.f - b2) * g * g;
        m[i] = mi;
        v[i] = vi;
        const float update = mi * rbc1 / (sqrtf(vi * rbc2) + e);
        const float p = params[i];
        const float updated = p - rate * (update + (decay_mask[i] ? wd * p : 0.f));
        params[i] = updated;
        if (compute_copy) compute_copy[i] = from_float<act_t>(updated);
    }
}

// partial[block] = sum of x^2 over a grid-stride share of x; the caller adds the partials.
extern "C" __global__ void sum_squares(double* __restrict__ partial, const float* __restrict__ x, long long n) {
    __shared__ double scratch[32];
    double acc = 0.0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const double xi = x[i];
        acc += xi * xi;
    }
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// out = a + b (out may be a), and partial[block] = the sum of out^2 over the same grid-stride share as
// sum_squares's (so the same partials): the ranks' gradients summed and the norm's squares taken in one pass.
extern "C" __global__ void add_sum_squares(float* out, const float* a, const float* __restrict__ b,
                                           double* __restrict__ partial, long long n) {
    __shared__ double scratch[32];
    double acc = 0.0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float sum = a[i] + b[i];
        out[i] = sum;
        const double si = sum;
        acc += si * si;
    }
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// dst (n,) = src (n,) in the element type of the module: the master weights' compute copy after a load.
extern "C" __global__ void cast_params(act_t* __restrict__ dst, const float* __restrict__ src, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dst[i] = from_float<act_t>(src[i]);
}
