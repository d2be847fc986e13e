"""The GPU engine's layers: the functions of nanoeuler.cpu.layers, same names and signatures, over CuPy arrays.

Each is a thin launcher: the work happens in a raw CUDA kernel from kernels/*.cu (compiled on first use by
NVRTC through CuPy and cached by CuPy on disk) or, for every matrix product, in cuBLAS. Shapes and the
activation layout are those of the CPU layers (see that module's docstring); arrays are float32 and
C-contiguous except the KV-cache view that attention_forward reads.

Precision: training runs the matmuls on the TF32 tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32) and attention
with one TF32 product per tile; inside `with tf32(False):` both run at float32 accuracy (plain FP32 cuBLAS and
3xTF32 attention), which is what `nanoeuler check --gpu` compares against the
CPU engine.
"""
import contextlib
import functools
import math
import pathlib

import cupy
import numpy as np
from cupy.cuda import cublas

from nanoeuler.cpu.layers import rope_tables  # noqa: F401  (host-side tables, the same for both engines)

KERNELS = pathlib.Path(__file__).parent / "kernels"

# cuBLAS enum values (cublas_api.h, library_types.h)
_OP_N, _OP_T = 0, 1
_R_32F = 0
_COMPUTE_32F, _COMPUTE_32F_FAST_TF32 = 68, 77
_GEMM_DEFAULT = -1
_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)  # host scalars for alpha / beta

_precision = {"tf32": True}


@contextlib.contextmanager
def tf32(enabled):
    """Within the block: TF32 tensor cores for matmuls and attention (enabled, the training default) or
    float32 accuracy (not enabled, the checks)."""
    before, _precision["tf32"] = _precision["tf32"], bool(enabled)
    try:
        yield
    finally:
        _precision["tf32"] = before


@functools.lru_cache(maxsize=None)
def _module(name, defines=()):
    """Compile kernels/<name>.cu (its #include of common.cuh inlined, so CuPy's cache, which hashes the source
    text, sees header edits too)."""
    common = (KERNELS / "common.cuh").read_text().replace("#pragma once\n", "")
    src = (KERNELS / f"{name}.cu").read_text().replace('#include "common.cuh"', common)
    return cupy.RawModule(code=src, options=("--std=c++17",) + tuple(f"-D{d}" for d in defines))


@functools.lru_cache(maxsize=None)
def _kernel(module, name, defines=(), dynamic_smem=0):
    k = _module(module, defines).get_function(name)
    if dynamic_smem > 48 * 1024:  # above the default limit a kernel has to opt in
        k.max_dynamic_shared_size_bytes = dynamic_smem
    return k


@functools.lru_cache(maxsize=None)
def _sm_count():
    return cupy.cuda.Device().attributes["MultiProcessorCount"]


def _i32(x):
    return np.int32(x)


def _f32(x):
    return np.float32(x)


def _blocks(n, threads):
    return (int(n) + threads - 1) // threads


def _check(*arrays):
    for a in arrays:
        assert a.dtype == np.float32 and a.flags.c_contiguous, (a.dtype, a.shape, a.strides)


# ---------------------------------------------------------------------------------------------- matmul
def _gemm(transa, transb, m, n, k, A, lda, B, ldb, C, ldc, accumulate):
    """Column-major C (m, n) = op(A) op(B) (+ C), on cuBLAS on the current stream."""
    handle = cupy.cuda.device.get_cublas_handle()
    compute = _COMPUTE_32F_FAST_TF32 if _precision["tf32"] else _COMPUTE_32F
    beta = _ONE if accumulate else _ZERO
    cublas.gemmEx(handle, transa, transb, m, n, k, _ONE.ctypes.data, A.data.ptr, _R_32F, lda, B.data.ptr, _R_32F,
                  ldb, beta.ctypes.data, C.data.ptr, _R_32F, ldc, compute, _GEMM_DEFAULT)


def matmul_forward(out, x, w, accumulate=False):
    """out (N, O) = x (N, I) @ w (O, I).T, += when accumulate. Row-major out is column-major out.T, so
    cuBLAS computes out.T (O, N) = w (O, I) @ x.T (I, N)."""
    _check(out, x, w)
    (N, I), O = x.shape, w.shape[0]
    _gemm(_OP_T, _OP_N, O, N, I, w, I, x, I, out, O, accumulate)


def matmul_backward(dx, dw, dout, x, w, accumulate_dx=False):
    """dx (N, I) = dout (N, O) @ w (or +=); dw (O, I) += dout.T @ x."""
    _check(dx, dw, dout, x, w)
    (N, I), O = x.shape, w.shape[0]
    _gemm(_OP_N, _OP_N, I, N, O, w, I, dout, O, dx, I, accumulate_dx)
    _gemm(_OP_N, _OP_T, I, O, N, x, I, dout, O, dw, I, True)


# ------------------------------------------------------------------------------------------- embedding
def embedding_forward(out, tokens, emb):
    """out (N, C) = emb (V, C)[tokens (N,)]"""
    _check(out, emb)
    N, C = out.shape
    tokens = cupy.ascontiguousarray(tokens, dtype=np.int32)
    _kernel("embedding", "embedding_forward")((_blocks(N * C, 256),), (256,), (out, tokens, emb, _i32(N), _i32(C)))


def embedding_backward(demb, dout, tokens):
    """demb (V, C) += dout (N, C) scattered by token"""
    _check(demb, dout)
    N, C = dout.shape
    tokens = cupy.ascontiguousarray(tokens, dtype=np.int32)
    _kernel("embedding", "embedding_backward")((_blocks(N * C, 256),), (256,), (demb, dout, tokens, _i32(N), _i32(C)))


# --------------------------------------------------------------------------------------------- rmsnorm
def rmsnorm_forward(out, rstd, x, w, eps):
    """out (N, C) = x / sqrt(mean(x^2) + eps) * w; rstd (N,)"""
    _check(out, rstd, x, w)
    N, C = x.shape
    _kernel("rmsnorm", "rmsnorm_forward")((_blocks(N, 8),), (256,), (out, rstd, x, w, _i32(N), _i32(C), _f32(eps)))


def rmsnorm_backward(dx, dw, dout, x, w, rstd):
    """dx (N, C) += input gradient (the residual stream's); dw (C,) += weight gradient."""
    _check(dx, dw, dout, x, w, rstd)
    N, C = x.shape
    grid = min(_blocks(N, 8), 4 * _sm_count())
    _kernel("rmsnorm", "rmsnorm_backward")((grid,), (256,), (dx, dw, dout, x, w, rstd, _i32(N), _i32(C)),
                                           shared_mem=4 * C)


# ------------------------------------------------------------------------------------------------ rope
def _rope(qkv, cos, sin, n_rot_heads, pos0, sign):
    _check(qkv, cos, sin)
    B, T, NH, D = qkv.shape
    n = B * T * n_rot_heads * (D // 2)
    _kernel("rope", "rope_rotate")((_blocks(n, 256),), (256,), (qkv, cos, sin, _i32(B), _i32(T), _i32(NH),
                                                               _i32(n_rot_heads), _i32(D), _i32(pos0), _f32(sign)))


def rope_forward(qkv, cos, sin, n_rot_heads, pos0):
    """In place on the first n_rot_heads heads of qkv (B, T, H+2G, D), positions pos0 + t."""
    _rope(qkv, cos, sin, n_rot_heads, pos0, 1.0)


def rope_backward(dqkv, cos, sin, n_rot_heads, pos0):
    """In place: the inverse rotation."""
    _rope(dqkv, cos, sin, n_rot_heads, pos0, -1.0)


# ------------------------------------------------------------------------------------------- attention
_TILE = 64


def _attention_defines():
    return () if _precision["tf32"] else ("ATT_PRECISE=1",)


def attention_forward(out, lse, qkv, n_heads, n_kv_heads, q_start):
    """Causal GQA FlashAttention. qkv (B, Tk, H+2G, D) may be a view of the KV cache (rows contiguous, batches
    any distance apart); queries are its rows q_start..Tk-1. out (B, Tq, H, D), lse (B, H, Tq)."""
    _check(out, lse)
    B, Tk, NH, D = qkv.shape
    Tq = Tk - q_start
    assert out.shape == (B, Tq, n_heads, D) and lse.shape == (B, n_heads, Tq) and D in (32, 64), (out.shape, D)
    assert qkv.dtype == np.float32 and qkv.strides[1:] == (NH * D * 4, D * 4, 4), qkv.strides
    k = _kernel("attention", f"attention_forward_d{D}", _attention_defines())
    k((n_heads, B, _blocks(Tq, _TILE)), (128,),
      (out, lse, qkv, _i32(Tq), _i32(Tk), _i32(n_heads), _i32(n_kv_heads), np.int64(qkv.strides[0] // 4),
       _f32(1.0 / math.sqrt(D))))


def attention_backward(dqkv, dout, out, lse, qkv, n_heads, n_kv_heads):
    """dqkv (B, T, H+2G, D) overwritten with dq, dk, dv from dout (B, T, H, D); training layout (q_start 0)."""
    _check(dqkv, dout, out, lse, qkv)
    B, T, NH, D = qkv.shape
    assert D in (32, 64)
    delta = cupy.empty((B, n_heads, T), dtype=np.float32)
    _kernel("attention", "attention_backward_delta", _attention_defines())(
        (_blocks(B * T * n_heads, 8),), (256,), (delta, dout, out, _i32(B), _i32(T), _i32(n_heads), _i32(D)))
    dqkv.fill(0)  # every block adds its share
    smem = 4 * (4 * _TILE * (D + 4) + _TILE * (_TILE + 4) + 2 * _TILE)
    k = _kernel("attention", f"attention_backward_d{D}", _attention_defines(), smem)
    k((n_heads, B, _blocks(T, _TILE)), (128,),
      (dqkv, dout, lse, delta, qkv, _i32(T), _i32(n_heads), _i32(n_kv_heads), _f32(1.0 / math.sqrt(D))),
      shared_mem=smem)


# ---------------------------------------------------------------------------------------------- swiglu
def swiglu_forward(out, gate_up):
    """out (N, F) = silu(gate) * up from gate_up (N, 2F)"""
    _check(out, gate_up)
    N, F = out.shape
    _kernel("swiglu", "swiglu_forward")((_blocks(N * F, 256),), (256,), (out, gate_up, _i32(N), _i32(F)))


def swiglu_backward(dgate_up, dout, gate_up):
    """dgate_up (N, 2F) overwritten"""
    _check(dgate_up, dout, gate_up)
    N, F = dout.shape
    _kernel("swiglu", "swiglu_backward")((_blocks(N * F, 256),), (256,), (dgate_up, dout, gate_up, _i32(N), _i32(F)))


# --------------------------------------------------------------------------------------- cross-entropy
def _ce_threads(V):
    return min(256, 32 * _blocks(V, 32))


def crossentropy_forward(losses, logits, targets):
    """losses (K, N) from logits (N, K*V) and targets (K, N), -1 ignored."""
    _check(losses, logits)
    K, N = targets.shape
    V = logits.shape[1] // K
    targets = cupy.ascontiguousarray(targets, dtype=np.int32)
    _kernel("crossentropy", "crossentropy_forward")((N, K), (_ce_threads(V),),
                                                    (losses, logits, targets, _i32(N), _i32(K), _i32(V)))


def crossentropy_forward_backward(losses, logits, targets, dscale):
    """As crossentropy_forward, then logits := d loss / d logits = (softmax - onehot) * dscale[k]."""
    _check(losses, logits, dscale)
    K, N = targets.shape
    V = logits.shape[1] // K
    targets = cupy.ascontiguousarray(targets, dtype=np.int32)
    _kernel("crossentropy", "crossentropy_forward_backward")(
        (N, K), (_ce_threads(V),), (losses, logits, targets, dscale, _i32(N), _i32(K), _i32(V)))


# ---------------------------------------------------------------------------------------------- adamw
def adamw_update(params, grads, m, v, decay_mask, lr, beta1, beta2, eps, weight_decay, grad_scale, step):
    """One AdamW step over the flat buffers in one launch (see the CPU layer for the formula)."""
    _check(params, grads, m, v, decay_mask)
    n = params.size
    grid = min(_blocks(n, 256), 32 * _sm_count())
    _kernel("adamw", "adamw_update")(
        (grid,), (256,), (params, grads, m, v, decay_mask, np.int64(n), np.float64(lr), np.float64(beta1),
                          np.float64(beta2), np.float64(eps), np.float64(weight_decay), np.float64(grad_scale),
                          np.float64(1.0 - beta1 ** step), np.float64(1.0 - beta2 ** step)))


def sum_squares(x):
    """sum(x^2) of a flat buffer, accumulated in float64 (for the global gradient norm)."""
    _check(x)
    grid = max(1, min(_blocks(x.size, 256), 1024))
    partial = cupy.empty(grid, dtype=np.float64)
    _kernel("adamw", "sum_squares")((grid,), (256,), (partial, x, np.int64(x.size)))
    return float(partial.sum())
