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
