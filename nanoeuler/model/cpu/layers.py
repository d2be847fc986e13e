"""The CPU engine's layers: numba forward/backward pairs, the reference every GPU kernel is checked against.

One source serves float32 (training) and float64 (the gradient check): numba compiles each function once per
dtype it is called with, and every temporary takes the dtype of its inputs. Row-wise work runs in parallel
with `prange`; the large matrix products go to NumPy's BLAS.

Conventions (as in llm.c): activation gradients overwrite, parameter gradients accumulate, except where a
docstring says an input gradient accumulates (the residual stream's). Shapes in comments: B batch, T time,
N = B*T rows, C model dim, H query heads, G kv heads, D head dim, F ffn hidden width, K heads, V vocab.
The attention and rope layers work on the fused QKV activation `(B, T, H + 2G, D)`: q heads, then k heads,
then v heads, which is what one matmul against the adjacent wq|wk|wv rows of the flat buffer produces.

An engine calls them through `Layers(precision, batch_invariant)` (Engine.layers, at the end): the layer
functions as one object's methods, in this module's order, with the engine's settings fixed when it is made
(no module-wide mode: two engines of different settings in one process do not interfere). The GPU's Layers
has the same methods in the same order (tests/test_gpu.py reads both classes to check it).
"""
import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from nanoeuler.model.limits import FEW_ROWS, SAMPLE_EXP2, SAMPLE_LN, SAMPLE_WEIGHT_BITS, clip_scale
from nanoeuler.model.quantize import QuantizedTensor

# Reassociation lets LLVM vectorise the sums; no flag that assumes away infinities or NaNs.
FAST = {"reassoc", "contract", "arcp", "nsz"}
jit = dict(cache=True, nogil=True, fastmath=FAST, error_model="numpy")
pjit = dict(cache=True, nogil=True, parallel=True, fastmath=FAST, error_model="numpy")
ONE = np.float32(1.0)  # exact in both dtypes; a float64 1.0 would promote float32 arithmetic to float64
ZERO = np.float32(0.0)  # an accumulator that starts as float32 stays float32 (a 0.0 would make it float64)
ROWS = 64  # rows per chunk of a parallel sum over rows (fixed: results must not depend on the thread count)


# ------------------------------------------------------------------------------------------------- exp
def exp(x):
    """math.exp, except in float32, where it is Cephes' expf written out so that LLVM can vectorise the
    loops that call it (libm's expf is an opaque call, one element at a time): about 3x faster, within
    1e-7 relative. Arguments below -87.3 give 1.2e-38 instead of underflowing to 0. float64 (the
    gradient check) keeps math.exp."""
    return math.exp(x)


@intrinsic
def _bits_as_float32(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@overload(exp)
def _exp_impl(x):
    if x != types.float32:
        return lambda x: math.exp(x)

    def expf(x):
        f = np.float32
        x = min(max(x, f(-87.33654)), f(88.72283))
        n = math.floor(x * f(1.44269504) + f(0.5))           # x = n ln2 + r, |r| <= ln2 / 2
        r = x - n * f(0.693359375) + n * f(2.12194440e-4)  # ln2 in two parts keeps r exact
        p = f(1.9875691500e-4)
        p = p * r + f(1.3981999507e-3)
        p = p * r + f(8.3334519073e-3)
        p = p * r + f(4.1665795894e-2)
        p = p * r + f(1.6666665459e-1)
        p = p * r + f(5.0000001201e-1)
        p = p * r * r + r + f(1.0)
        return p * _bits_as_float32((np.int32(n) + np.int32(127)) << np.int32(23))  # * 2^n
    return expf


# ---------------------------------------------------------------------------------------------- matmul
# Products of up to FEW_ROWS rows (decoding) take _matmul_rows: each output element is one dot product
# whose order of sums is set by the row length alone, so a row's result is the same bits whatever the other
# rows (a batch's other sequences, a speculative step's drafts); BLAS's gemm of a few rows would round by the
# shape (docs/decoding.md has the measurements).
COLUMNS = 8  # output columns a task of _matmul_rows: their rows of w stay in L1 while every row of x passes


@njit(**jit)
def _dot(a, b):
    s = ZERO
    for i in range(a.shape[0]):
        s += a[i] * b[i]
    return s


@njit(**pjit)
def _matmul_rows(out, x, w, accumulate):
    N, O = out.shape
    for block in prange(-(-O // COLUMNS)):
        for n in range(N):
            for o in range(block * COLUMNS, min(O, (block + 1) * COLUMNS)):
                v = _dot(x[n], w[o])
                out[n, o] = out[n, o] + v if accumulate else v


# Quantized matrices (model/quantize.py): rows of w dequantized from their packed integers and float16 scales
# (and minimums) into float32, exactly as quantize.dequantize does, then the float products above on them: a
# few rows take _matmul_rows_quantized (each output's dot product that of _matmul_rows on the dequantized
# matrix, bit for bit), more rows BLAS on QUANT_ROWS rows of w dequantized at a time.
QUANT_ROWS = 1024


@njit(**jit)
def _dequantize_row(out, q, scales, mins, o, group, int4):
    """out (I,) float32 = row o of a quantized matrix: d * q, or d * q + m (int4: byte j of a group holds its
    elements j and j + group/2)."""
    I = out.shape[0]
    half = group // 2
    for gi in range(I // group):
        d = np.float32(scales[o, gi])
        if int4:
            m = np.float32(mins[o, gi])
            for j in range(half):
                byte = q[o, gi * half + j]
                out[gi * group + j] = d * np.float32(byte & 15) + m
                out[gi * group + half + j] = d * np.float32(byte >> 4) + m
        else:
            for j in range(group):
                out[gi * group + j] = d * np.float32(q[o, gi * group + j])


@njit(**pjit)
def _dequantize_rows(out, q, scales, mins, first, group, int4):
    """out (R, I) float32 = rows first..first+R-1 of a quantized matrix."""
    for r in prange(out.shape[0]):
        _dequantize_row(out[r], q, scales, mins, first + r, group, int4)


@njit(**pjit)
def _matmul_rows_quantized(out, x, q, scales, mins, group, int4, accumulate):
    N, O = out.shape
    for block in prange(-(-O // COLUMNS)):
        w = np.empty((COLUMNS, x.shape[1]), dtype=np.float32)
        for o in range(block * COLUMNS, min(O, (block + 1) * COLUMNS)):
            _dequantize_row(w[o - block * COLUMNS], q, scales, mins, o, group, int4)
        for n in range(N):
            for o in range(block * COLUMNS, min(O, (block + 1) * COLUMNS)):
                v = _dot(x[n], w[o - block * COLUMNS])
                out[n, o] = out[n, o] + v if accumulate else v


def _quantized_args(w):
    """The numba kernels' arguments of a QuantizedTensor (mins: a dummy for int8); float16 (which numba lacks)
    widened to float32, exactly (quantized_matrix does it once for an engine's matrices)."""
    scales = w.scales.astype(np.float32, copy=False)
    mins = scales if w.mins is None else w.mins.astype(np.float32, copy=False)
    return w.q, scales, mins, w.group, w.kind == "int4"


def dequantize_rows(w, first, last):
    """Rows first..last-1 of a QuantizedTensor as float32 (quantize.dequantize's values)."""
    out = np.empty((last - first, w.shape[1]), np.float32)
    _dequantize_rows(out, *_quantized_args(w)[:3], first, *_quantized_args(w)[3:])
    return out


def matmul_quantized(out, x, w, accumulate, few_rows):
    """out (N, O) (+)= x (N, I) @ dequantize(w).T for a QuantizedTensor w: few_rows the row-invariant kernel."""
    if few_rows:
        _matmul_rows_quantized(out, x, *_quantized_args(w), accumulate)
        return
    for first in range(0, w.shape[0], QUANT_ROWS):
        last = min(w.shape[0], first + QUANT_ROWS)
        product = x @ dequantize_rows(w, first, last).T
        if accumulate:
            out[:, first:last] += product
        else:
            out[:, first:last] = product


def matmul_backward_quantized(dx, dout, w):
    """dx (N, I) = dout (N, O) @ dequantize(w) for a QuantizedTensor w: the input gradient through a frozen
    quantized matrix, summed over blocks of QUANT_ROWS rows of w dequantized in turn (one block in float at a
    time)."""
    dx.fill(0)
    for first in range(0, w.shape[0], QUANT_ROWS):
        last = min(w.shape[0], first + QUANT_ROWS)
        dx += dout[:, first:last] @ dequantize_rows(w, first, last).astype(dx.dtype, copy=False)


# matmul_forward and the products that end in it (rmsnorm_matmul_*_forward) read the batch-invariance
# setting: they are methods of Layers, at the end.
def matmul_backward(dx, dw, dout, x, w, dbias=None):
    """dx (N, I) = dout @ w; dw (O, I) += dout.T @ x (dw None: not computed); where given, dbias (O,) += the column sums of dout (the
    gradient of a bias added to the product). A QuantizedTensor w (a frozen quantized base: QLoRA) gives dx
    through its exact dequantization, QUANT_ROWS rows at a time (never the whole matrix in float)."""
    if isinstance(w, QuantizedTensor):
        assert dw is None, "a quantized matrix is frozen"
        matmul_backward_quantized(dx, dout, w)
    else:
        np.matmul(dout, w, out=dx)
    if dw is not None:  # None: a frozen weight (LoRA's base), whose input gradient alone is wanted
        dw += dout.T @ x
    if dbias is not None:
        dbias += dout.sum(axis=0)


# ------------------------------------------------------------------------------------------------ LoRA
# A frozen product's low-rank update (model/lora.py): out += scale * (x A^T) B^T, x possibly after dropout.
def lora_forward(out, h, x, a, b, scale):
    """h (N, r) = x (N, I) @ a (r, I).T, then out (N, O) += scale * h @ b (O, r).T; out may be a column slice
    of a wider product (q of q|k|v), or None: h alone; x None: h as it is (kept from the forward pass)."""
    if x is not None:
        np.matmul(x, a.T, out=h)
    if out is not None:
        out += scale * (h @ b.T)


def lora_backward(dx, da, db, dh, dout, x, h, a, b, scale, accumulate):
    """Given dout (N, O) (a column slice where the forward's out was): db (O, r) += scale * dout.T @ h;
    dh (N, r) = scale * dout @ b; da (r, I) += dh.T @ x; dx (N, I) += dh @ a (= without accumulate)."""
    db += scale * (dout.T @ h)
    np.matmul(dout, b, out=dh)
    dh *= scale
    da += dh.T @ x
    if accumulate:
        dx += dh @ a
    else:
        np.matmul(dh, a, out=dx)


def lora_forward_group(outs, h, x, a, b, scale):
    """The updates of k targets sharing the input x (q, k, v; gate, up) with one pass over it: h (N, k r) =
    x (N, I) @ a (k r, I).T, a their A matrices stacked; then outs[j] (N, O_j) += scale * h_j @ b[j] (O_j, r).T,
    h_j h's columns j r..(j + 1) r (h may be a column slice of a wider buffer); x None: h as it is (kept from
    the forward pass), a unused."""
    if x is not None:
        np.matmul(x, a.T, out=h)
    r = b[0].shape[1]
    for j, (out, bj) in enumerate(zip(outs, b)):
        out += scale * (h[:, j * r:(j + 1) * r] @ bj.T)


def lora_backward_group(dx, da, db, dh, douts, x, h, a, b, scale):
    """lora_forward_group's backward pass, one pass over x and one over dx for the k targets: for each j, db[j]
    (O_j, r) += scale * douts[j].T @ h_j and dh_j = scale * douts[j] @ b[j] (dh (N, k r)); then da (k r, I) +=
    dh.T @ x and dx (N, I) += dh @ a."""
    r = b[0].shape[1]
    for j, (dout, bj, dbj) in enumerate(zip(douts, b, db)):
        dbj += scale * (dout.T @ h[:, j * r:(j + 1) * r])
        dhj = dh[:, j * r:(j + 1) * r]
        np.matmul(dout, bj, out=dhj)
        dhj *= scale
    da += dh.T @ x
    dx += dh @ a


def dropout_threshold(p):
    """Dropout keeps an element whose 24-bit hash is at least this (p of the 2^24 values fall below it)."""
    return np.uint32(min(1 << 24, round(p * (1 << 24))))


@njit(**pjit)
def _dropout(out, x, threshold, key, inv, accumulate):
    flat_out, flat_x = out.reshape(-1), x.reshape(-1)
    for e in prange(flat_x.size):
        h = _mix64(key ^ (np.uint64(e) * _GOLDEN))
        v = flat_x[e] * inv if np.uint32(h >> np.uint64(40)) >= threshold else inv * 0
        flat_out[e] = flat_out[e] + v if accumulate else v


def dropout_forward(out, x, p, key, accumulate):
    """out (N, I) = x * keep / (1 - p) (+= with accumulate), keep drawn per element from a hash of (key, its
    flat index): the same mask for the same key on every call and on the GPU (kernels/lora.cu)."""
    _dropout(out, x, dropout_threshold(p), np.uint64(key), x.dtype.type(1.0 / (1.0 - p)), bool(accumulate))


def bias_add(out, bias):
    """out (N, O) += bias (O,)"""
    out += bias


# ------------------------------------------------------------------------------------------- embedding
@njit(**pjit)
def embedding_forward(out, tokens, emb):
    """out (N, C) = emb (V, C)[tokens (N,)]"""
    for n in prange(tokens.shape[0]):
        out[n, :] = emb[tokens[n], :]


@njit(**jit)
def embedding_backward(demb, dout, tokens):
    """demb (V, C) += scatter of dout (N, C) by token; serial because tokens repeat."""
    for n in range(tokens.shape[0]):
        t = tokens[n]
        for c in range(dout.shape[1]):
            demb[t, c] += dout[n, c]


# --------------------------------------------------------------------------------------------- rmsnorm
@njit(**pjit)
def rmsnorm_forward(out, rstd, x, w, eps):
    """out (N, C) = x / sqrt(mean(x^2) + eps) * w;  rstd (N,) kept for the backward pass."""
    N, C = x.shape
    for n in prange(N):
        ss = ZERO
        for c in range(C):
            ss += x[n, c] * x[n, c]
        r = 1.0 / math.sqrt(ss / C + eps)
        rstd[n] = r
        for c in range(C):
            out[n, c] = x[n, c] * r * w[c]


@njit(**pjit)
def rmsnorm_backward(dx, dw, dout, x, w, rstd):
    """dx (N, C) += d/dx (accumulates into the residual gradient); dw (C,) += sum_n dout * x * rstd.

    With xhat = x * r:  dx = r * (g - xhat * mean(g * xhat)),  g = dout * w.
    dw is summed per chunk of ROWS rows in parallel, then over the chunks: a fixed order, so the result
    does not depend on the number of threads.
    """
    N, C = x.shape
    n_chunks = -(-N // ROWS)
    partial = np.zeros((n_chunks, C), dtype=dw.dtype)
    for chunk in prange(n_chunks):
        dw_chunk = partial[chunk]
        for n in range(chunk * ROWS, min(N, (chunk + 1) * ROWS)):
            r = rstd[n]
            dot = ZERO
            for c in range(C):
                dot += dout[n, c] * w[c] * x[n, c] * r
            dot /= C
            for c in range(C):
                xhat = x[n, c] * r
                dx[n, c] += r * (dout[n, c] * w[c] - xhat * dot)
                dw_chunk[c] += dout[n, c] * xhat
    for chunk in range(n_chunks):
        for c in range(C):
            dw[c] += partial[chunk, c]


# ------------------------------------------------------------------------------------------------ rope
def rope_forward(qkv, cos, sin, n_rot_heads, pos):
    """In place on the first n_rot_heads heads (q and k) of qkv (B, T, H+2G, D), positions pos[0] + t, or
    pos[b] + t where pos holds one position a sequence (a batch decoding step's rows). pos is an int32 array,
    not a number: the GPU kernel reads it from device memory, so that a decoding step recorded once as a CUDA
    graph serves every position.

    Element i pairs with i + D/2:  (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    """
    _rope(qkv, cos, sin, n_rot_heads, pos, False)


def rope_backward(dqkv, cos, sin, n_rot_heads, pos):
    """In place: the transpose of the rotation, (d1, d2) -> (d1 cos + d2 sin, d2 cos - d1 sin); pos as in
    rope_forward."""
    _rope(dqkv, cos, sin, n_rot_heads, pos, True)


@njit(**pjit)
def _rope(qkv, cos, sin, n_rot_heads, pos, inverse):
    """The rotation, or with inverse its transpose: the rotation of the swapped pair (d2, d1), its outputs
    written back swapped. Each output is then the direction's own formula, the same two products added in
    the same order (and fused alike under fastmath's contract): the same bits as a function a direction."""
    B, T, _, D = qkv.shape
    half = D // 2
    first, second = (half, 0) if inverse else (0, half)
    per_row = pos.shape[0] > 1
    for bt in prange(B * T):
        b, t = bt // T, bt % T
        p = pos[b if per_row else 0] + t
        for h in range(n_rot_heads):
            xs1, xs2 = qkv[b, t, h, first:first + half], qkv[b, t, h, second:second + half]
            for i in range(half):
                x1, x2 = xs1[i], xs2[i]
                xs1[i] = x1 * cos[p, i] - x2 * sin[p, i]
                xs2[i] = x2 * cos[p, i] + x1 * sin[p, i]


# ------------------------------------------------------------------------------------------- attention
# Attention runs per (batch, kv head) in a *key-major* layout: a score matrix s (Tk, M) has a row per key j
# and a column per query c of the group, c = t * group + r for query position t and query head r of the
# kv head's group. Column c sees keys j <= q_start + t, so row j is live from column (j - q_start) * group
# to the end: every inner loop runs over a contiguous stretch of columns, long enough to vectorise, and
# starting it at a multiple of ALIGN (with M padded to one) leaves no scalar tail. The few columns between
# the rounded-down start and the true one are masked: -inf before the softmax, 0 after it.
ALIGN = 16


@njit(**jit)
def _live_columns(j, q_start, group):
    """(first column that sees key j, the same rounded down to ALIGN)"""
    start = max(j - q_start, 0) * group
    return start, start - start % ALIGN


@njit(**jit)
def _gather_queries_t(dst, src, b, head0, group, scale):
    """dst (D, M) column t*group + r = src[b, t, head0 + r, :] * scale; zero in the padding."""
    D, M = dst.shape
    n = src.shape[1] * group
    for c in range(n):
        t, r = c // group, c % group
        for d in range(D):
            dst[d, c] = src[b, t, head0 + r, d] * scale
    for d in range(D):
        for c in range(n, M):
            dst[d, c] = 0


@njit(**jit)
def _gather_keys(dst, src, b, head):
    """dst (Tk, D) = src[b, :Tk, head, :], contiguous."""
    for t in range(dst.shape[0]):
        for d in range(dst.shape[1]):
            dst[t, d] = src[b, t, head, d]


@njit(inline="always", **jit)
def _axpy4(y, a0, x0, a1, x1, a2, x2, a3, x3):
    """y += a0 x0 + a1 x1 + a2 x2 + a3 x3: four products per load and store of y."""
    for c in range(y.shape[0]):
        y[c] += a0 * x0[c] + a1 * x1[c] + a2 * x2[c] + a3 * x3[c]


@njit(inline="always", **jit)
def _axpy(y, a, x):
    for c in range(y.shape[0]):
        y[c] += a * x[c]


@njit(**jit)
def _rows_times(s, a, bt, q_start, group):
    """s[j, c] = sum_d a[j, d] * bt[d, c] on row j's live columns: (Tk, D) @ (D, M) -> (Tk, M)."""
    Tk, D = a.shape
    for j in range(Tk):
        _, c0 = _live_columns(j, q_start, group)
        sj = s[j, c0:]  # 1-D views: indices that start at 0 let LLVM drop the negative-index fix-ups
        sj[:] = 0
        d = 0
        while d + 4 <= D:
            _axpy4(sj, a[j, d], bt[d, c0:], a[j, d + 1], bt[d + 1, c0:], a[j, d + 2], bt[d + 2, c0:],
                   a[j, d + 3], bt[d + 3, c0:])
            d += 4
        for d in range(d, D):
            _axpy(sj, a[j, d], bt[d, c0:])


@njit(**jit)
def _columns_times(outt, a, s, q_start, group):
    """outt[d, c] += sum_j a[j, d] * s[j, c]: (Tk, D).T @ (Tk, M) -> (D, M). s must be 0 wherever column c
    does not see key j, left of the live columns included: four keys share one pass from the first's start."""
    Tk, D = a.shape
    j = 0
    while j + 4 <= Tk:
        _, c0 = _live_columns(j, q_start, group)
        for d in range(D):
            _axpy4(outt[d, c0:], a[j, d], s[j, c0:], a[j + 1, d], s[j + 1, c0:], a[j + 2, d], s[j + 2, c0:],
                   a[j + 3, d], s[j + 3, c0:])
        j += 4
    for j in range(j, Tk):
        _, c0 = _live_columns(j, q_start, group)
        for d in range(D):
            _axpy(outt[d, c0:], a[j, d], s[j, c0:])


@njit(**jit)
def _rows_dot(out, s, bt, group):
    """out[j, d] = sum_c s[j, c] * bt[d, c]: (Tk, M) @ (D, M).T -> (Tk, D) (training layout, q_start 0).
    Four dot products per pass over s[j]."""
    Tk, D = out.shape
    for j in range(Tk):
        _, c0 = _live_columns(j, 0, group)
        sj = s[j, c0:]
        d = 0
        while d + 4 <= D:
            b0, b1, b2, b3 = bt[d, c0:], bt[d + 1, c0:], bt[d + 2, c0:], bt[d + 3, c0:]
            acc0 = acc1 = acc2 = acc3 = ZERO
            for c in range(sj.shape[0]):
                x = sj[c]
                acc0 += x * b0[c]
                acc1 += x * b1[c]
                acc2 += x * b2[c]
                acc3 += x * b3[c]
            out[j, d], out[j, d + 1], out[j, d + 2], out[j, d + 3] = acc0, acc1, acc2, acc3
            d += 4
        for d in range(d, D):
            bd = bt[d, c0:]
            acc = ZERO
            for c in range(sj.shape[0]):
                acc += sj[c] * bd[c]
            out[j, d] = acc


def attention_forward(out, lse, qkv, n_heads, n_kv_heads):
    """Causal grouped-query attention over qkv (B, T, H+2G, D), positions 0..T-1 (training, full forwards).
    out (B, T, H, D), lse (B, H, T) the per-row logsumexp of the scaled scores, the only thing the backward
    pass needs besides out. Query head h reads kv head h // (H/G)."""
    B = qkv.shape[0]
    rows = np.arange(B, dtype=np.int32)
    _attention(out, lse, qkv, qkv, rows, n_heads, n_heads, n_kv_heads, np.zeros(B, dtype=np.int32))


def attention_cached(out, lse, qkv, cache, n_heads, n_kv_heads, pos, slots=None):
    """Decoding: qkv (B, n, H+2G, D)'s k heads (rotated already) and v heads written to the KV cache
    (S, context, 2G, D) at positions p..p+n-1, then attention of its queries to the cache's positions
    0..p+n-1, causally, where p is pos[0] (every sequence) or pos[b] (one position a sequence), and sequence
    b's cache row is slots[b] (b where slots is None). out (B, n, H, D), lse (B, H, n). (The GPU does all
    of it in one kernel.)"""
    B, n = qkv.shape[:2]
    rows = np.arange(B, dtype=np.int32) if slots is None else slots
    starts = np.broadcast_to(pos, (B,)).astype(np.int32)
    for b in range(B):
        cache[rows[b], starts[b]:starts[b] + n] = qkv[b, :, n_heads:]
    _attention(out, lse, qkv, cache, rows, 0, n_heads, n_kv_heads, starts)


@njit(**pjit)
def _attention(out, lse, qkv, kv, kv_rows, k_head, n_heads, n_kv_heads, q_starts):
    """Causal grouped-query attention of the queries of qkv (B, Tq, ., D) of sequence b, positions
    q_starts[b]..q_starts[b]+Tq-1, to the keys and values of kv row kv_rows[b] (>= Tk, ., D), positions
    0..Tk-1 = q_starts[b]+Tq-1: kv head g's keys are head k_head + g of kv, its values head k_head + G + g."""
    B, Tq, _, D = qkv.shape
    group = n_heads // n_kv_heads
    M = -(-Tq * group // ALIGN) * ALIGN
    scale = ONE / math.sqrt(D)
    for bg in prange(B * n_kv_heads):
        b, g = bg // n_kv_heads, bg % n_kv_heads
        q_start = q_starts[b]
        Tk = q_start + Tq
        qt = np.empty((D, M), dtype=qkv.dtype)
        k = np.empty((Tk, D), dtype=qkv.dtype)
        v = np.empty((Tk, D), dtype=qkv.dtype)
        _gather_queries_t(qt, qkv, b, g * group, group, scale)
        _gather_keys(k, kv, kv_rows[b], k_head + g)
        _gather_keys(v, kv, kv_rows[b], k_head + n_kv_heads + g)
        s = np.zeros((Tk, M), dtype=qkv.dtype)  # _columns_times reads the zeros left of a row's start
        _rows_times(s, k, qt, q_start, group)
        m = np.full(M, -np.inf, dtype=qkv.dtype)  # column-wise softmax: max, then exp and sum
        for j in range(Tk):
            c1, c0 = _live_columns(j, q_start, group)
            sj, mj = s[j, c0:], m[c0:]
            for c in range(c1 - c0):
                sj[c] = -np.inf
            for c in range(M - c0):
                mj[c] = max(mj[c], sj[c])
        total = np.zeros(M, dtype=qkv.dtype)
        for j in range(Tk):
            c1, c0 = _live_columns(j, q_start, group)
            sj, mj, tj = s[j, c0:], m[c0:], total[c0:]
            for c in range(M - c0):
                sj[c] = exp(sj[c] - mj[c])
                tj[c] += sj[c]
            for c in range(c1 - c0):
                sj[c] = 0
        ot = np.zeros((D, M), dtype=qkv.dtype)
        _columns_times(ot, v, s, q_start, group)
        for c in range(Tq * group):
            t, h = c // group, g * group + c % group
            inv = ONE / total[c]
            for d in range(D):
                out[b, t, h, d] = ot[d, c] * inv
            lse[b, h, t] = m[c] + math.log(total[c])


def attention_backward(dqkv, dout, out, lse, qkv, n_heads, n_kv_heads, cos=None, sin=None):
    """dqkv (B, T, H+2G, D) overwritten with dq, dk, dv from dout (B, T, H, D); with the rotary tables cos,
    sin, dq and dk are the gradients of the unrotated q and k (rope_backward after it, positions 0..T-1; the
    GPU folds it into the kernels' stores)."""
    _attention_backward(dqkv, dout, out, lse, qkv, n_heads, n_kv_heads)
    if cos is not None:
        rope_backward(dqkv, cos, sin, n_heads + n_kv_heads, np.zeros(1, dtype=np.int32))


@njit(**pjit)
def _attention_backward(dqkv, dout, out, lse, qkv, n_heads, n_kv_heads):
    """dqkv (B, T, H+2G, D) overwritten with dq, dk, dv from dout (B, T, H, D).

    FlashAttention's recurrence: p_ij = exp(s_ij - lse_i), dp_ij = dout_i . v_j, delta_i = dout_i . out_i,
    ds_ij = p_ij (dp_ij - delta_i). Parallel over (batch, kv head), which owns its k, v and its group's q.
    """
    B, T, _, D = qkv.shape
    group = n_heads // n_kv_heads
    M = -(-T * group // ALIGN) * ALIGN
    scale = ONE / math.sqrt(D)
    for bg in prange(B * n_kv_heads):
        b, g = bg // n_kv_heads, bg % n_kv_heads
        kh, vh = n_heads + g, n_heads + n_kv_heads + g
        qt = np.empty((D, M), dtype=qkv.dtype)
        dot = np.empty((D, M), dtype=qkv.dtype)
        k = np.empty((T, D), dtype=qkv.dtype)
        v = np.empty((T, D), dtype=qkv.dtype)
        _gather_queries_t(qt, qkv, b, g * group, group, scale)
        _gather_queries_t(dot, dout, b, g * group, group, ONE)
        _gather_keys(k, qkv, b, kh)
        _gather_keys(v, qkv, b, vh)
        lse_c = np.zeros(M, dtype=qkv.dtype)
        delta = np.zeros(M, dtype=qkv.dtype)
        for c in range(T * group):
            t, h = c // group, g * group + c % group
            lse_c[c] = lse[b, h, t]
            acc = ZERO
            for d in range(D):
                acc += dout[b, t, h, d] * out[b, t, h, d]
            delta[c] = acc
        p = np.empty((T, M), dtype=qkv.dtype)
        ds = np.zeros((T, M), dtype=qkv.dtype)
        _rows_times(p, k, qt, 0, group)   # the scores again, then p
        _rows_times(ds, v, dot, 0, group)  # dp, then ds
        for j in range(T):
            c1, c0 = _live_columns(j, 0, group)
            pj, dsj, lj, dj = p[j, c0:], ds[j, c0:], lse_c[c0:], delta[c0:]
            for c in range(M - c0):
                pj[c] = exp(pj[c] - lj[c])
                dsj[c] = pj[c] * (dsj[c] - dj[c])
            for c in range(c1 - c0):
                pj[c] = 0
                dsj[c] = 0
        dk = np.empty((T, D), dtype=qkv.dtype)
        dv = np.empty((T, D), dtype=qkv.dtype)
        _rows_dot(dv, p, dot, group)
        _rows_dot(dk, ds, qt, group)  # q is pre-scaled, so this is scale * ds @ q
        dqt = np.zeros((D, M), dtype=qkv.dtype)
        _columns_times(dqt, k, ds, 0, group)
        for c in range(T * group):
            t, h = c // group, g * group + c % group
            for d in range(D):
                dqkv[b, t, h, d] = dqt[d, c] * scale
        for t in range(T):
            for d in range(D):
                dqkv[b, t, kh, d] = dk[t, d]
                dqkv[b, t, vh, d] = dv[t, d]


# ---------------------------------------------------------------------------------------------- swiglu
@njit(**pjit)
def swiglu_forward(out, gate_up):
    """out (N, F) = silu(gate) * up, gate = gate_up[:, :F], up = gate_up[:, F:] (adjacent w_gate|w_up)."""
    N, F = out.shape
    for n in prange(N):
        for f in range(F):
            g = gate_up[n, f]
            out[n, f] = g / (ONE + exp(-g)) * gate_up[n, F + f]


@njit(**pjit)
def swiglu_backward(dgate_up, dout, gate_up):
    """dgate_up (N, 2F) overwritten: d gate = dout * up * silu'(gate), d up = dout * silu(gate)."""
    N, F = dout.shape
    for n in prange(N):
        for f in range(F):
            g = gate_up[n, f]
            sig = ONE / (ONE + exp(-g))
            dgate_up[n, f] = dout[n, f] * gate_up[n, F + f] * sig * (ONE + g * (ONE - sig))
            dgate_up[n, F + f] = dout[n, f] * g * sig


# --------------------------------------------------------------------------------------- cross-entropy
@njit(inline="always", **jit)
def _max(x, lanes):
    """max of a 1-D array x, through an elementwise max into ALIGN lanes (scratch), then over the lanes:
    LLVM vectorises a max *reduction* only where it may assume that there are no NaNs."""
    lanes[:] = x[0]
    n = x.shape[0] - x.shape[0] % ALIGN
    for c0 in range(0, n, ALIGN):
        block = x[c0:c0 + ALIGN]
        for c in range(ALIGN):
            lanes[c] = max(lanes[c], block[c])
    m = lanes[0]
    for c in range(1, ALIGN):
        m = max(m, lanes[c])
    for c in range(n, x.shape[0]):
        m = max(m, x[c])
    return m


@njit(**pjit)
def crossentropy_forward(losses, logits, targets):
    """losses (K, N) = -log softmax(logits (N, K*V) head k's slice)[targets (K, N)]; 0 where target is -1."""
    K, N = targets.shape
    V = logits.shape[1] // K
    for n in prange(N):
        lanes = np.empty(ALIGN, dtype=logits.dtype)
        for k in range(K):
            t = targets[k, n]
            if t < 0:
                losses[k, n] = 0.0
                continue
            row = logits[n, k * V:(k + 1) * V]
            m = _max(row, lanes)
            total = ZERO
            for v in range(V):
                total += exp(row[v] - m)
            losses[k, n] = m + math.log(total) - row[t]


@njit(**pjit)
def crossentropy_forward_backward(losses, logits, targets, dscale):
    """As crossentropy_forward, then logits (N, K*V) is overwritten in place with d loss / d logits:
    (softmax - onehot) * dscale[k, n] (dscale (K, N): one scale per head and row, so a row's gradient can be
    weighted on its own, as DPO's per-sequence weights need), and 0 on rows whose target is -1. Fusing the two means the
    probabilities are computed once and never stored beside the logits."""
    K, N = targets.shape
    V = logits.shape[1] // K
    for n in prange(N):
        lanes = np.empty(ALIGN, dtype=logits.dtype)
        for k in range(K):
            t = targets[k, n]
            row = logits[n, k * V:(k + 1) * V]
            if t < 0:
                losses[k, n] = 0.0
                row[:] = 0.0
                continue
            m = _max(row, lanes)
            target_logit = row[t]
            total = ZERO
            for v in range(V):
                row[v] = exp(row[v] - m)
                total += row[v]
            losses[k, n] = m + math.log(total) - target_logit
            sc = dscale[k, n]
            s = sc / total
            for v in range(V):
                row[v] *= s
            row[t] -= sc


# ---------------------------------------------------------------------------------------------- adamw
@njit(**pjit)
def _adamw_update(params, grads, m, v, decay_mask, lr, beta1, beta2, eps, weight_decay, grad_scale, step):
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    for i in prange(params.shape[0]):
        g = grads[i] * grad_scale
        m[i] = beta1 * m[i] + (1.0 - beta1) * g
        v[i] = beta2 * v[i] + (1.0 - beta2) * g * g
        update = (m[i] / bc1) / (math.sqrt(v[i] / bc2) + eps)
        params[i] -= lr * (update + weight_decay * decay_mask[i] * params[i])


def adamw_update(params, grads, m, v, decay_mask, lr, beta1, beta2, eps, weight_decay, grad_scale, step,
                 compute_copy=None, squares=None, grad_clip=0.0):
    """One AdamW step over the flat buffers, gradients first multiplied by grad_scale (the clip factor; with
    squares, the global gradient's sum of squares, clip_scale(sqrt(squares), grad_clip) instead, as the GPU
    kernel computes it on the device). Decoupled weight decay, applied only where decay_mask is 1 (matrices,
    not norm gains; a byte each). compute_copy is the GPU's bf16 copy of the weights; the CPU engine computes
    on the master weights and has none."""
    assert compute_copy is None
    if squares is not None:
        grad_scale = clip_scale(math.sqrt(float(squares)), grad_clip)
    _adamw_update(params, grads, m, v, decay_mask, lr, beta1, beta2, eps, weight_decay, grad_scale, step)


SUM_CHUNK = 1 << 14  # elements per partial sum of sum_squares (fixed: the result must not depend on threads)


@njit(**jit)
def _sum_squares_f64(x):
    s = 0.0  # float64, whatever x's dtype
    for i in range(x.shape[0]):
        v = np.float64(x[i])
        s += v * v
    return s


@njit(**pjit)
def _sum_squares_partials(partial, x):
    """partial[c] = sum of x^2 over chunk c of SUM_CHUNK elements, in float64 (a loop over a slice: LLVM
    vectorises it, which a loop over a computed index range did not, 8x slower)."""
    for c in prange(partial.shape[0]):
        partial[c] = _sum_squares_f64(x[c * SUM_CHUNK:(c + 1) * SUM_CHUNK])


def sum_squares(x, on_device=False):
    """sum(x^2) of a flat buffer, accumulated in float64 whatever x's dtype (a float; with on_device a float64
    scalar, as the GPU engine's device scalar): the global gradient norm, which clipping divides by (the GPU
    engine's kernel sums in double too). A float32 dot product rounds its running sums to 24 bits (relative
    errors of order 1e-5 on big's 14.2M gradients). The partial sums over fixed chunks make the result
    independent of the thread count; the pass is memory-bound, as fast as the float32 dot on big's gradients,
    and a fraction of a millisecond on small's."""
    x = x.reshape(-1)
    partial = np.empty(-(-x.shape[0] // SUM_CHUNK), np.float64)
    _sum_squares_partials(partial, x)
    return partial.sum() if on_device else float(partial.sum())


def add_sum_squares(out, a, b):
    """out = a + b (out may be a) and sum(out^2) in float64: the ranks' gradients summed and the norm's squares
    (train/distributed.py; one pass on the GPU). Returns the squares as a float64 scalar."""
    np.add(a, b, out=out)
    return sum_squares(out, on_device=True)


# ------------------------------------------------------------------------------------------- decoding
def argmax(ids, logits, log=None, pos=None, advance=0):
    """ids (R,) int32 = the index of each row's largest logit (the first of equal ones); logits (R, V).
    With log (S, R) int32 and pos, also log[pos[0]] = ids: consecutive steps' ids, read back together; then
    pos[0] += advance (advance_position's work: a greedy step's end)."""
    ids[:] = np.argmax(logits, axis=1)
    if log is not None:
        log[pos[0]] = ids
    if advance:
        advance_position(pos, advance)


def advance_position(pos, n):
    """pos[0] += n: the KV cache's position after a decoding step of n tokens."""
    pos[0] += n


def accept_drafts(tokens, ids, log, pos):
    """The end of a greedy speculative step of one sequence: tokens (K,) were the input (the next token, then
    K - 1 drafts), ids (K * K,) each head's argmax at each of the K rows (row-major). The n leading drafts that
    head 0 agrees with are kept with the first token: log[p + j, 0] = the kept ids and log[p, 1] = n (p =
    pos[0]); tokens becomes the next step's input (head 0's id and heads 1..K-1's drafts at the last kept
    row), also written after the kept ids in log; pos[0] moves past the kept ids (the rejected rows' keys and
    values are overwritten by the next step). Steps then chain with nothing read back in between."""
    K, p = tokens.size, int(pos[0])
    rows = ids.reshape(K, K)
    n = 0
    while n < K - 1 and rows[n, 0] == tokens[n + 1]:
        n += 1
    log[p:p + n + 1, 0] = tokens[:n + 1]
    log[p, 1] = n
    tokens[:] = rows[n]
    log[p + n + 1:p + n + 1 + K, 0] = tokens
    pos[0] = p + n + 1


# Sampling a row: Gumbel-max over the kept tokens, with noise from a hash of (seed, token index, id) that is a
# pure function of them, so a row's draw depends on nothing else in the batch. Every quantity is an exact
# function of the row: float32 weights from a fixed sequence of rounded operations (nanoeuler.model.limits:
# SAMPLE_EXP2, SAMPLE_LN; compiled without fastmath, which would let LLVM fuse or reorder them), integer masses
# that add alike in any order, cuts found on the logits' order-preserving integer keys (no sort). The GPU's
# sample_* kernels (kernels/decoding.cu) compute the same weights, masses, cuts and noise, so its draws equal
# these (it finds the cuts by histograms of the masses instead of bisection: the same values).
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_EXP2 = np.array(SAMPLE_EXP2, np.float32)
_LN = np.array(SAMPLE_LN, np.float32)
_LOG2E, _LN2, _SQRT_HALF = (np.float32(float.fromhex(c)) for c in ("0x1.715476p+0", "0x1.62e43p-1", "0x1.6a09e6p-1"))
_UNIT = np.float32(2.0 ** SAMPLE_WEIGHT_BITS)  # a mass's unit is 2^-SAMPLE_WEIGHT_BITS of a weight
exact = dict(cache=True, nogil=True, error_model="numpy")  # no fastmath: every rounding as written


@njit(inline="always", **jit)
def _mix64(x):
    """splitmix64's finaliser: a bijection of uint64 whose every output bit depends on every input bit."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


@njit(inline="always", **jit)
def _order_key(x):
    """x's float32 bits as a uint32 that orders as the floats do."""
    bits = np.uint32(_float32_bits(x))
    return bits ^ np.uint32(0x80000000) if bits < np.uint32(0x80000000) else ~bits


@intrinsic
def _float32_bits(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


@njit(inline="always", **exact)
def _sample_weight(z, m, scale):
    """A token's weight 2^t, t = (z - m) * scale (float32; scale = log2(e) / temperature): 0 where t is below
    -SAMPLE_WEIGHT_BITS (or NaN), else in [2^-SAMPLE_WEIGHT_BITS, 1], 1 at the largest logit m."""
    t = (z - m) * scale
    if not t >= -SAMPLE_WEIGHT_BITS:
        return np.float32(0.0)
    n = math.floor(t)
    f = t - np.float32(n)  # exact, in [0, 1)
    p = _EXP2[_EXP2.size - 1]
    for j in range(_EXP2.size - 2, -1, -1):
        p = p * f + _EXP2[j]
    return p * np.float32(math.ldexp(1.0, n))


@njit(inline="always", **exact)
def _sample_noise(seed, counter, v):
    """-ln(u) (float32, in (0, 16.7)) for u = (2h + 1) 2^-24, h the top 23 bits of a hash of (seed, counter | v)."""
    h = _mix64(seed ^ (_mix64(counter | np.uint64(v)) + _GOLDEN))
    mantissa, e = math.frexp(np.float64(np.uint64(2) * (h >> np.uint64(41)) + np.uint64(1)))  # exact
    y = np.float32(mantissa)  # in [1/2, 1): u = y 2^(e - 24)
    if y < _SQRT_HALF:
        y, e = y * np.float32(2.0), e - 1
    s = y - np.float32(1.0)  # exact, in [sqrt(1/2) - 1, sqrt(2) - 1]
    q = _LN[_LN.size - 1]
    for j in range(_LN.size - 2, -1, -1):
        q = q * s + _LN[j]
    return -(np.float32(e - 24) * _LN2 + s * q)


@njit(inline="always", **exact)
def _sample_mass(w):
    """A weight's mass: floor(w 2^SAMPLE_WEIGHT_BITS), an integer (w times a power of two is exact)."""
    return np.uint64(w * _UNIT)


@njit(parallel=True, **exact)
def sample_rows(ids, logits, top_k, temperature, top_p, seed_lo, seed_hi, index):
    """ids (R,) int32: a token drawn from each row of logits (R, V) float32, row r with its own temperature,
    top_k (0: off), top_p (1: off), 64-bit seed (seed_hi << 32 | seed_lo, uint32 each) and token index.
    m = the row's largest logit (its first id: `best`); a token's weight w = 2^t, t = (z - m) * (log2(e) / T)
    in float32 (_sample_weight: 0 below t = -SAMPLE_WEIGHT_BITS, 1 at m) and its mass the integer
    floor(w 2^SAMPLE_WEIGHT_BITS); the tokens of nonzero weight are live. Top-k keeps the live tokens at or
    above the k-th largest live value; top-p then keeps those at or above the largest value c whose kept
    tokens at or above c hold mass M_c with float64(M_c) >= float64(top_p) * float64(total kept mass): ties
    at a cut kept, every sum an exact integer. The draw is the kept token of the smallest E / w (float32
    division; the lowest id of equal ones), E = -ln(u) (_sample_noise) from a hash of (seed, index, id):
    Gumbel-max, as -ln(E) + ln(w) is Gumbel noise plus the scaled logit. Temperature <= 0, top_p <= 0 or a
    row whose largest logit is not finite: `best`, the argmax (the first of equal ones)."""
    R, V = logits.shape
    for r in prange(R):
        z = logits[r]
        best = 0
        for v in range(V):
            if z[v] > z[best]:
                best = v
        T, p, m = temperature[r], top_p[r], z[best]
        if not (T > 0 and p > 0 and np.isfinite(m)):
            ids[r] = best
            continue
        scale = _LOG2E / T
        keys = np.empty(V, dtype=np.uint32)
        w = np.empty(V, dtype=np.float32)
        live = 0
        for v in range(V):
            keys[v] = _order_key(z[v])
            w[v] = _sample_weight(z[v], m, scale)
            live += w[v] > 0
        cut = np.uint32(0)
        if 0 < top_k[r] < live:  # the k-th largest live key: the largest c with at least k live keys >= c
            for bit in range(31, -1, -1):
                c = cut | np.uint32(1 << bit)
                count = 0
                for v in range(V):
                    count += w[v] > 0 and keys[v] >= c
                if count >= top_k[r]:
                    cut = c
        if p < 1:  # the largest c whose kept tokens at or above it hold top_p of the kept mass
            kcut, cut = cut, np.uint32(0)
            target = np.float64(p) * np.float64(_kept_mass(w, keys, kcut, kcut))
            for bit in range(31, -1, -1):
                c = cut | np.uint32(1 << bit)
                if np.float64(_kept_mass(w, keys, kcut, c)) >= target:
                    cut = c
        seed = _mix64((np.uint64(seed_hi[r]) << np.uint64(32)) | np.uint64(seed_lo[r]))
        counter = np.uint64(index[r]) << np.uint64(32)
        choice, score = best, np.float32(np.inf)
        for v in range(V):
            if w[v] > 0 and keys[v] >= cut:
                s = _sample_noise(seed, counter, v) / w[v]
                if s < score:
                    choice, score = v, s
        ids[r] = choice


@njit(**exact)
def _kept_mass(w, keys, kcut, c):
    """The integer mass of the tokens whose key is at least kcut and c."""
    s = np.uint64(0)
    for v in range(w.shape[0]):
        if keys[v] >= kcut and keys[v] >= c:
            s += _sample_mass(w[v])
    return s


def feed_back(tokens, ids, pos, index, log, counter, context):
    """After a batched step of one token a sequence: each row's drawn id becomes its next input, its
    position (at most context - 1: rows past their end are padding) and token index move on by one, and
    log[counter[0]] = ids, counter[0] += 1: steps chain with nothing read back in between."""
    tokens.reshape(-1)[:] = ids
    np.minimum(pos + 1, context - 1, out=pos)
    index += 1
    log[counter[0]] = ids
    counter[0] += 1


def graph(step):
    """The GPU records a decoding step as a CUDA graph and replays it; the CPU runs the step as it is."""
    return step


# -------------------------------------------------------------------------------------------------- layers
class Layers:
    """One engine's CPU layers (Engine.layers): the layer functions above, in their order, as the methods of
    one object, as the GPU's Layers are. Its setting, batch_invariant, is read by the products, which are
    therefore defined here: products of at most FEW_ROWS rows take _matmul_rows (on: a row's bits the same
    whatever the other rows) or BLAS, whose rounding depends on the row count (off). The other layers read no
    setting and are this module's functions as they are. precision: "fp32", the only one (model/device.py's
    rule); the arrays' dtype decides the arithmetic (float64 for the gradient check)."""

    def __init__(self, precision, batch_invariant):
        self.precision, self.batch_invariant = precision, bool(batch_invariant)

    def activation_dtype(self, dtype):
        """Activations are in the engine's dtype: float32 for training, float64 for the gradient check."""
        return np.dtype(dtype)

    # ------------------------------------------------------------------------------------------ matmul
    def matmul_forward(self, out, x, w, accumulate=False):
        """out (N, O) = x (N, I) @ w (O, I).T  -- PyTorch Linear layout; += when accumulate (residual adds). w may
        be a QuantizedTensor (quantized_matrix), read packed."""
        if isinstance(w, QuantizedTensor):
            matmul_quantized(out, x, w, accumulate, x.shape[0] <= FEW_ROWS and self.batch_invariant)
        elif x.shape[0] <= FEW_ROWS and self.batch_invariant:
            _matmul_rows(out, x, w, accumulate)
        elif accumulate:
            out += x @ w.T
        else:
            np.matmul(x, w.T, out=out)

    matmul_backward = staticmethod(matmul_backward)

    @staticmethod
    def quantized_matrix(qt):
        """A QuantizedTensor as this engine's products read it: the host arrays, the float16 scales and minimums
        widened to float32 (exact; numba has no float16)."""
        widen = lambda a: None if a is None else a.astype(np.float32)
        return QuantizedTensor(qt.kind, qt.group, qt.q, widen(qt.scales), widen(qt.mins))

    def rmsnorm_matmul_forward(self, out, rstd, x, norm_w, w, eps, xn, skip=None):
        """out (N, O) = rmsnorm(x (N, C)) * norm_w @ w (O, C).T, rstd (N,); xn (N, C) receives the normed input,
        or is None where nobody reads it (decoding: on the GPU a few rows are then normalised inside the product,
        one kernel). skip (N, C), where given, receives a copy of x: the residual stream's next buffer (the GPU
        copies it on the norm's read of x)."""
        if skip is not None:
            skip[...] = x
        if xn is None:
            xn = np.empty_like(x)
        rmsnorm_forward(xn, rstd, x, norm_w, eps)
        self.matmul_forward(out, xn, w)

    def rmsnorm_matmul_rope_forward(self, qkv, rstd, x, norm_w, w, eps, xn, cos, sin, n_rot_heads, pos, skip=None,
                                    bias=None):
        """The attention's input: qkv (B, T, H+2G, D) = rmsnorm(x (B*T, C)) * norm_w @ w.T (+ bias (H+2G)*D, where
        given: the q|k|v biases), then the rotary embedding of its first n_rot_heads heads (q and k) at positions
        pos[0] + t (one GPU kernel for decoding's few rows); xn, skip as rmsnorm_matmul_forward."""
        rows = qkv.reshape(x.shape[0], -1)
        self.rmsnorm_matmul_forward(rows, rstd, x, norm_w, w, eps, xn, skip)
        if bias is not None:
            rows += bias
        rope_forward(qkv, cos, sin, n_rot_heads, pos)

    def rmsnorm_matmul_swiglu_forward(self, out, gate_up, rstd, x, norm_w, w, eps, xn, skip=None):
        """The feed-forward's first half: gate_up (N, 2F) = rmsnorm(x) * norm_w @ w (2F, C).T, then out (N, F) =
        silu(gate) * up (one kernel on the GPU for decoding's few rows); xn, skip as rmsnorm_matmul_forward."""
        self.rmsnorm_matmul_forward(gate_up, rstd, x, norm_w, w, eps, xn, skip)
        swiglu_forward(out, gate_up)

    # ------------------------------------------------------------------------ the rest, as defined above
    embedding_forward = staticmethod(embedding_forward)
    embedding_backward = staticmethod(embedding_backward)
    rmsnorm_forward = staticmethod(rmsnorm_forward)
    rmsnorm_backward = staticmethod(rmsnorm_backward)
    rope_forward = staticmethod(rope_forward)
    rope_backward = staticmethod(rope_backward)
    attention_forward = staticmethod(attention_forward)
    attention_cached = staticmethod(attention_cached)
    attention_backward = staticmethod(attention_backward)
    swiglu_forward = staticmethod(swiglu_forward)
    swiglu_backward = staticmethod(swiglu_backward)
    lora_forward = staticmethod(lora_forward)
    lora_backward = staticmethod(lora_backward)
    lora_forward_group = staticmethod(lora_forward_group)
    lora_backward_group = staticmethod(lora_backward_group)
    dropout_forward = staticmethod(dropout_forward)
    bias_add = staticmethod(bias_add)
    crossentropy_forward = staticmethod(crossentropy_forward)
    crossentropy_forward_backward = staticmethod(crossentropy_forward_backward)
    adamw_update = staticmethod(adamw_update)
    sum_squares = staticmethod(sum_squares)
    add_sum_squares = staticmethod(add_sum_squares)
    argmax = staticmethod(argmax)
    advance_position = staticmethod(advance_position)
    accept_drafts = staticmethod(accept_drafts)
    sample_rows = staticmethod(sample_rows)
    feed_back = staticmethod(feed_back)
    graph = staticmethod(graph)
