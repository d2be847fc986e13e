"""Numbers the engines, the decoding steps and the CUDA kernels share (the kernels get them as defines)."""

# Products of at most this many rows take the few-row path on both engines (the GPU's tensor-core
# matrix-vector kernels, the CPU's _matmul_rows), whose sums for a row run in an order set by the row length
# alone, so a sequence's tokens do not depend on what else is in a batch (infer/batch.py); a decoding step of
# at most this many rows (sequences x new tokens) is recorded as a CUDA graph (gpu/runtime.py: its cuBLAS
# products too, on a handle of its own), and prefill goes in chunks of this many tokens.
FEW_ROWS = 64
# The most sequences of a batched decoding step (infer/batch.py): each a row of the step's products.
DECODE_ROWS = FEW_ROWS

# Gradient clipping multiplies the gradients by min(1, grad_clip / (norm + CLIP_EPS)): clip_scale below on the
# host, and the GPU's adamw_update on the device from the squared norm (so the host need not wait for it).
CLIP_EPS = 1e-6


def clip_scale(norm, grad_clip):
    """The factor that scales gradients of global norm `norm` down to grad_clip (0: no clipping)."""
    return min(1.0, grad_clip / (norm + CLIP_EPS)) if grad_clip > 0 else 1.0

# Sampling (both engines' sample_rows compute it with the same float32 operations, so their draws are equal):
# a token's weight is 2^t, t = (z - max z) * (log2(e) / temperature), as SAMPLE_EXP2's polynomial of t's
# fraction (coefficients from the constant up; 2^f on [0, 1) within 1e-7) times 2^floor(t), and 0 below
# t = -SAMPLE_WEIGHT_BITS; its mass is the integer floor(weight * 2^SAMPLE_WEIGHT_BITS), so masses add exactly
# in any order (a row's total is below 2^(SAMPLE_WEIGHT_BITS + 17)). A draw's noise -ln(u) takes ln(1 + s) =
# s * SAMPLE_LN's polynomial of s, s in [sqrt(1/2) - 1, sqrt(2) - 1] (within 2e-7).
SAMPLE_WEIGHT_BITS = 40
SAMPLE_EXP2 = tuple(float.fromhex(c) for c in (
    "0x1.0p+0", "0x1.62e42cp-1", "0x1.ebfd62p-3", "0x1.c68804p-5", "0x1.3d14dap-7", "0x1.4690f8p-10",
    "0x1.c5fa8ap-13"))
SAMPLE_LN = tuple(float.fromhex(c) for c in (
    "0x1.fffffep-1", "-0x1.ffffeep-2", "0x1.555788p-2", "-0x1.00085cp-2", "0x1.98c1dcp-3", "-0x1.52b72ep-3",
    "0x1.313c82p-3", "-0x1.2935b8p-3", "0x1.726b68p-4"))
