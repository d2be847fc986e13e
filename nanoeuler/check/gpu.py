"""`nanoeuler check --gpu`: every GPU kernel against the CPU layer it replaces, then the whole model, in each
precision the GPU engine runs.

Kernels: each GPU layer runs on fresh random inputs, at sizes that are not multiples of the kernels' tiles
or warps, with its outputs poisoned with NaN beforehand (an element the kernel fails to write shows up as
NaN); the reference is the CPU layer in float64 on exactly the GPU's inputs (rounded to the precision's
element type first). Error = ||gpu - cpu|| / ||cpu||. Bounds:
- fp32 (FP32 cuBLAS, 3xTF32 attention): 1e-5, float32's rounding with room for long sums;
- tf32 (the matmul and attention products on TF32 tensor cores, 10 mantissa bits): 5e-3;
- bf16 (bf16 inputs and outputs, float32 accumulation): every output is rounded to bf16 once, a relative
  error of at most u = 2^-9 per element (about u / sqrt(3) = 1.1e-3 by norm); attention also rounds its
  probabilities P and dS to bf16 operands, a few more roundings of the same size. The bound, 8u = 2^-6 =
  1.6e-2, leaves room for those and still catches any real fault (a wrong index or a missed term is an O(1)
  error).

Model (K = 2 heads, K = 1 tied to the embedding, and that with q/k/v biases and padding ids past its
tokenizer's vocabulary, as an imported Qwen2): the GPU engine's gradients for every parameter tensor
against the CPU engine's (float64) on the same float32-representable parameters and batch (some targets -1),
plus the loss and the KV-cache decode logits, in fp32 (bound 1e-5), tf32 and bf16 (each gradient passes
through some 50 bf16 roundings on its way back through the two layers; as a random walk that is
sqrt(50) u = 1.4e-2, and the bound is 2^-4 = 6.3e-2). And
the backward pass must be deterministic: two runs give bit-identical gradients in every precision.

Quantized weights (model/quantize.py): the products on int8 and int4 matrices (gpu/quantized.py) against the
CPU layers on the same packed matrices, from 1 to 100 rows (over 64: the matrix dequantized, in bf16 rounded
to bf16, then cuBLAS); the GPU's dequantization bit for bit the host's; in bf16 each row of a 64-row product
bit for bit that row's product alone (batch invariance). Then a quantized
model of each type: its full-forward and KV-cache decode logits against the CPU engine's on the same
quantized checkpoint (float64), bounds as for float weights.
LoRA: its layers (the update into a column slice of a wider product, its backward pass, dropout's mask), then a
frozen base with adapters on all seven targets, dropout off and on (the same key: the same mask on both
engines), the adapters' gradients against the CPU engine's in fp32 and bf16, and --recompute's gradients (mlp,
products and layer) equal to the stored path's bit for bit.

    nanoeuler check --gpu
"""
import dataclasses
import math
import time

import numpy as np

from nanoeuler.train.objectives import cross_entropy_backward
from nanoeuler.model.config import Config, param_layout, rope_tables
from nanoeuler.model.decoding import decoder_of
from nanoeuler.model.gpu.constants import MATMUL_SPLIT_MIN_WEIGHTS, NORM_APART_WEIGHTS
from nanoeuler.model.limits import FEW_ROWS

FP32_TOL = 1e-5   # float32 kernels against the float64 reference
TF32_TOL = 5e-3   # TF32 tensor-core mode (10-bit mantissa inputs)
BF16_TOL = 2.0 ** -6   # 8 bf16 unit roundoffs (see the docstring)
BF16_MODEL_TOL = 2.0 ** -4
TOLERANCE = {"fp32": FP32_TOL, "tf32": TF32_TOL, "bf16": BF16_TOL}
# head_dim 32, GQA 4/2, T = 100 (two attention tiles, the second partial), K = 2 heads
MODEL_CONFIG = Config(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden=352, vocab_size=300, context=100,
                      mtp_heads=2)
# the same with one head that is the embedding (an imported tied model): one tensor, two products' gradients
TIED_CONFIG = dataclasses.replace(MODEL_CONFIG, mtp_heads=1, tied=True)
# and with biases on q, k and v and ids past the tokenizer's vocabulary (an imported Qwen2)
BIAS_CONFIG = dataclasses.replace(TIED_CONFIG, qkv_bias=True, tokenizer_vocab=280)


def rel_err(gpu, ref):
    gpu = np.asarray(gpu, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if not np.all(np.isfinite(gpu)):
        return math.inf  # NaN poison left behind, or an overflow
    return float(np.linalg.norm(gpu - ref) / max(np.linalg.norm(ref), 1e-300))


def logits_err(gpu, ref, cfg):
    """rel_err over the tokenizer's ids; the ids past them (a padded vocabulary) must be -inf in both."""
    live = cfg.tokenizer_vocab or np.shape(gpu)[-1]
    padding = np.asarray(gpu)[..., live:], np.asarray(ref)[..., live:]
    if not all(np.all(np.isneginf(p)) for p in padding):
        return math.inf
    return rel_err(np.asarray(gpu)[..., :live], np.asarray(ref)[..., :live])


def bf16_bits(a):
    """float32 values rounded to the nearest bfloat16 (ties to even), as the uint16 storage bits."""
    b = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF).astype(np.uint16)


def bf16_value(bits):
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


class _Case:
    """Random float64 host inputs for one precision: `act` rounds them to its element type (what the GPU will
    see, so the CPU reference sees it too), `dev` makes device copies of activations, `dev32` of float32-only
    arrays (statistics, gradients, tables), `poisoned`/`poisoned32` NaN-filled outputs, `get` reads back."""

    def __init__(self, rng, precision):
        import cupy
        self.cp, self.rng, self.precision = cupy, rng, precision
        self.bf16 = precision == "bf16"
        self.tol, self.tag = TOLERANCE[precision], f" ({precision})" if precision != "fp32" else ""

    def normal(self, *shape, scale=1.0):
        return self.rng.normal(0.0, scale, shape)

    def act(self, a):
        a = np.asarray(a, dtype=np.float32)
        return (bf16_value(bf16_bits(a)) if self.bf16 else a).astype(np.float64)

    def dev(self, a):
        a = np.asarray(a, dtype=np.float32)
        return self.cp.asarray(bf16_bits(a) if self.bf16 else a)

    def dev32(self, a):
        return self.cp.asarray(np.asarray(a, dtype=np.float32))

    def poisoned(self, *shape):
        if self.bf16:
            return self.cp.full(shape, 0x7FC0, dtype=np.uint16)
        return self.poisoned32(*shape)

    def poisoned32(self, *shape):
        return self.cp.full(shape, np.nan, dtype=np.float32)

    def get(self, g):
        g = g.get()
        return bf16_value(g) if g.dtype == np.uint16 else g


def _f32(a):
    """float64 copy of a's float32 rounding: the CPU reference sees exactly the GPU's inputs."""
    return np.asarray(a, dtype=np.float32).astype(np.float64)


# Each check(case, gpu_layers, cpu_layers) returns [(label, error, tolerance)]: the GPU's and the CPU's Layers (the
# CPU's batch-invariant, as the GPU's) run on the inputs of `case`, a _Case of one precision.
def _precisions(*names):
    def mark(check):
        check.precisions = names
        return check
    return mark


def _matmul_forward_lines(case, gpu_layers, cpu_layers, N, I, O, what):
    """matmul_forward accumulating into act_t, and into float32 from bf16 operands (the decode logits)."""
    x, w, base = case.act(case.normal(N, I)), case.act(case.normal(O, I)), case.act(case.normal(N, O))
    ref = base.copy()
    cpu_layers.matmul_forward(ref, x, w, accumulate=True)
    g = case.dev(base)
    gpu_layers.matmul_forward(g, case.dev(x), case.dev(w), accumulate=True)
    ref32 = np.empty((N, O))
    cpu_layers.matmul_forward(ref32, x, w)
    g32 = case.poisoned32(N, O)
    gpu_layers.matmul_forward(g32, case.dev(x), case.dev(w))
    return x, w, [(f"matmul_forward{case.tag} {what}, +=", rel_err(case.get(g), ref), case.tol),
                  (f"matmul_forward{case.tag} {what}, float32 out", rel_err(case.get(g32), ref32), case.tol)]


@_precisions("fp32", "tf32", "bf16")
def check_matmul(case, gpu_layers, cpu_layers):
    N, I, O = 77, 45, 51
    x, w, out = _matmul_forward_lines(case, gpu_layers, cpu_layers, N, I, O, f"{N}x{I} @ {O}x{I}.T")
    dout, base_dw = case.act(case.normal(N, O)), _f32(case.normal(O, I))
    rdx, rdw = np.empty((N, I)), base_dw.copy()
    cpu_layers.matmul_backward(rdx, rdw, dout, x, w)
    gdx, gdw = case.poisoned(N, I), case.dev32(base_dw)
    gpu_layers.matmul_backward(gdx, gdw, case.dev(dout), case.dev(x), case.dev(w))
    out += [(f"matmul_backward{case.tag} dx", rel_err(case.get(gdx), rdx), case.tol),
            (f"matmul_backward{case.tag} dw (float32, +=)", rel_err(case.get(gdw), rdw), case.tol)]
    base_db = _f32(case.normal(O))
    rdb, gdb = base_db.copy(), case.dev32(base_db)
    cpu_layers.matmul_backward(rdx, rdw, dout, x, w, rdb)
    gpu_layers.matmul_backward(gdx, gdw, case.dev(dout), case.dev(x), case.dev(w), gdb)
    out.append((f"matmul_backward{case.tag} dbias (float32, +=)", rel_err(case.get(gdb), rdb), case.tol))
    # decoding's few rows (the matrix-vector kernel, up to FEW_ROWS): 16-byte loads, and an odd row length
    # without them, rows split over 1 to 16 warps, in 1 to 4 rounds; the same kernel with RMSNorm (C = I)
    # folded in front, and with SwiGLU after
    # (and 1 to 4 tiles of 16 rows: batched decoding's steps)
    # (and rows of 2, 3 and 16 of a warp's k-slices of 128, many rows)
    # (and a gate|up product of NORM_APART_WEIGHTS, whose norm is a kernel of its own: the last case)
    for N, I, O in ((1, 64, 77), (FEW_ROWS, 136, 33), (3, 45, 51), (2, 1000, 40), (1, 2048, 24), (1, 8192, 16),
                    (3, 4100, 9), (13, 45, 51), (37, 1000, 40), (50, 136, 33), (FEW_ROWS, 256, 72), (37, 384, 24),
                    (50, 2048, 20), (3, 2048, NORM_APART_WEIGHTS // 2 // 2048)):
        x, w, lines = _matmul_forward_lines(case, gpu_layers, cpu_layers, N, I, O,
                                            f"{N} rows (matrix-vector) I={I} O={O}")
        gain = case.act(1 + case.normal(I, scale=0.3))
        ref, rstd, xn = np.empty((N, O)), np.empty(N), np.empty((N, I))
        cpu_layers.rmsnorm_matmul_forward(ref, rstd, x, gain, w, 1e-5, xn)
        g, grstd = case.poisoned(N, O), case.poisoned32(N)
        # no xn: the fused kernel
        gpu_layers.rmsnorm_matmul_forward(g, grstd, case.dev(x), case.dev(gain), case.dev(w), 1e-5, None)
        out += lines + [(f"rmsnorm_matmul_forward{case.tag} {N} rows", rel_err(case.get(g), ref), case.tol),
                        (f"rmsnorm_matmul_forward{case.tag} {N} rows rstd", rel_err(case.get(grstd), rstd), case.tol)]
        w2 = case.act(case.normal(2 * O, I))
        ref_gu, ref_sw = np.empty((N, 2 * O)), np.empty((N, O))
        cpu_layers.rmsnorm_matmul_swiglu_forward(ref_sw, ref_gu, rstd, x, gain, w2, 1e-5, xn)
        gsw, ggu, grstd = case.poisoned(N, O), case.poisoned(N, 2 * O), case.poisoned32(N)
        gpu_layers.rmsnorm_matmul_swiglu_forward(gsw, ggu, grstd, case.dev(x), case.dev(gain), case.dev(w2), 1e-5, None)
        out += [(f"rmsnorm_matmul_swiglu_forward{case.tag} {N} rows gate|up", rel_err(case.get(ggu), ref_gu), case.tol),
                (f"rmsnorm_matmul_swiglu_forward{case.tag} {N} rows out", rel_err(case.get(gsw), ref_sw), case.tol),
                (f"rmsnorm_matmul_swiglu_forward{case.tag} {N} rows rstd", rel_err(case.get(grstd), rstd), case.tol)]
    # the qkv product with the rotary embedding of its first 3 of 5 heads, 2 sequences of 3 rows at position 5
    (B, T, NH, D), I = (2, 3, 5, 8), 136
    x, w = case.act(case.normal(B * T, I)), case.act(case.normal(NH * D, I))
    gain = case.act(1 + case.normal(I, scale=0.3))
    cos, sin = (_f32(t) for t in rope_tables(D, 16, 10000.0, np.float64))
    pos = np.full(1, 5, np.int32)
    ref, rstd, xn = np.empty((B, T, NH, D)), np.empty(B * T), np.empty((B * T, I))
    cpu_layers.rmsnorm_matmul_rope_forward(ref, rstd, x, gain, w, 1e-5, xn, cos, sin, 3, pos)
    g = case.poisoned(B, T, NH, D)
    gpu_layers.rmsnorm_matmul_rope_forward(g, case.poisoned32(B * T), case.dev(x), case.dev(gain), case.dev(w), 1e-5,
                                           None, case.dev32(cos), case.dev32(sin), 3, case.cp.asarray(pos))
    out.append((f"rmsnorm_matmul_rope_forward{case.tag} {B}x{T} rows, 3 of 5 heads rotated", rel_err(case.get(g), ref),
                case.tol))
    # with a bias added before the rotation (Qwen2's q|k|v): the fused kernel of a few rows, and many rows
    # (cuBLAS, bias_add, rope)
    bias = case.act(case.normal(NH * D))
    cos, sin = (_f32(t) for t in rope_tables(D, 64, 10000.0, np.float64))
    for B, T in ((2, 3), (3, 40)):
        x = case.act(case.normal(B * T, I))
        ref, xn = np.empty((B, T, NH, D)), np.empty((B * T, I))
        cpu_layers.rmsnorm_matmul_rope_forward(ref, np.empty(B * T), x, gain, w, 1e-5, xn, cos, sin, 3, pos,
                                               bias=bias)
        g = case.poisoned(B, T, NH, D)
        gpu_layers.rmsnorm_matmul_rope_forward(g, case.poisoned32(B * T), case.dev(x), case.dev(gain), case.dev(w),
                                               1e-5, None, case.dev32(cos), case.dev32(sin), 3, case.cp.asarray(pos),
                                               bias=case.dev(bias))
        out.append((f"rmsnorm_matmul_rope_forward{case.tag} {B}x{T} rows, with a bias", rel_err(case.get(g), ref),
                    case.tol))
    # batched decoding: 19 sequences of one row, each at its own position
    B, pos = 19, case.rng.integers(0, 16, 19).astype(np.int32)
    x = case.act(case.normal(B, I))
    ref = np.empty((B, 1, NH, D))
    cpu_layers.rmsnorm_matmul_rope_forward(ref, np.empty(B), x, gain, w, 1e-5, np.empty((B, I)), cos, sin, 3, pos)
    g = case.poisoned(B, 1, NH, D)
    gpu_layers.rmsnorm_matmul_rope_forward(g, case.poisoned32(B), case.dev(x), case.dev(gain), case.dev(w), 1e-5, None,
                                           case.dev32(cos), case.dev32(sin), 3, case.cp.asarray(pos))
    out.append((f"rmsnorm_matmul_rope_forward{case.tag} {B} sequences at their own positions",
                rel_err(case.get(g), ref), case.tol))
    # batch invariance: a row's bits are the same in a product of 1, 5, 20 or 64 rows, wherever it sits (64 rows
    # of a product this narrow are split over blocks of 16), plain, accumulating, with RMSNorm folded in (its rstd
    # too), with SwiGLU and with the rotary embedding (a sequence a row, each at its own position); rows of 1000
    # (a warp's k-slice of 128 partly past the end) and of 256 (whole slices); and a product of 4,200 x 1,000,
    # whose 20 and 64 rows split their virtual warps over blocks (matmul_split_t*)
    D = 8
    cos, sin = (case.dev32(_f32(t)) for t in rope_tables(D, 16, 10000.0, np.float64))
    pos = case.rng.integers(0, 16, FEW_ROWS).astype(np.int32)
    for I, big, split in ((1000, False, False), (256, False, False), (256, True, False), (1000, False, True)):
        # big: a gate|up or head product whose norm is apart
        O = NORM_APART_WEIGHTS // I if big else D * -(-MATMUL_SPLIT_MIN_WEIGHTS // (I * D)) if split else 6 * D
        NH = O // D
        x, w = case.act(case.normal(FEW_ROWS, I)), case.act(case.normal(O, I))
        gain = case.act(1 + case.normal(I, scale=0.3))
        base = case.act(case.normal(FEW_ROWS, O))
        dx, dw, dgain = case.dev(x), case.dev(w), case.dev(gain)

        def plain(rows):
            g = case.poisoned(len(rows), O)
            gpu_layers.matmul_forward(g, dx[case.cp.asarray(rows)], dw)
            return g,

        def accumulating(rows):
            g = case.dev(base[rows])
            gpu_layers.matmul_forward(g, dx[case.cp.asarray(rows)], dw, accumulate=True)
            return g,

        def normed(rows):
            g, grstd = case.poisoned(len(rows), O), case.poisoned32(len(rows))
            gpu_layers.rmsnorm_matmul_forward(g, grstd, dx[case.cp.asarray(rows)], dgain, dw, 1e-5, None)
            return g, grstd

        def swiglu(rows):
            gsw, ggu, grstd = case.poisoned(len(rows), O // 2), case.poisoned(len(rows), O), case.poisoned32(len(rows))
            gpu_layers.rmsnorm_matmul_swiglu_forward(gsw, ggu, grstd, dx[case.cp.asarray(rows)], dgain, dw, 1e-5, None)
            return gsw, ggu, grstd

        def rotated(rows):
            g, grstd = case.poisoned(len(rows), 1, NH, D), case.poisoned32(len(rows))
            gpu_layers.rmsnorm_matmul_rope_forward(g, grstd, dx[case.cp.asarray(rows)], dgain, dw, 1e-5, None, cos,
                                                   sin, 4, case.cp.asarray(pos[rows]))
            return g, grstd

        def logits(rows):  # the head's product: float32 out
            g, grstd = case.poisoned32(len(rows), O), case.poisoned32(len(rows))
            gpu_layers.rmsnorm_matmul_forward(g, grstd, dx[case.cp.asarray(rows)], dgain, dw, 1e-5, None)
            return g, grstd

        if big:  # the norm apart against the CPU engine's values, then the bits below
            ref, rows = np.empty((3, O)), np.arange(3)
            cpu_layers.rmsnorm_matmul_forward(ref, np.empty(3), x[rows], gain, w, 1e-5, None)
            out.append((f"rmsnorm_matmul_forward{case.tag} its norm apart, float32 out, 3x{O}x{I}",
                        rel_err(case.get(logits(rows)[0]), ref), case.tol))
        products = ((("rmsnorm_matmul_swiglu_forward, its norm apart", swiglu),
                     ("rmsnorm_matmul_forward, its norm apart", normed),
                     ("rmsnorm_matmul_forward, its norm apart, float32 out", logits)) if big else (
            ("matmul_forward", plain), ("matmul_forward +=", accumulating), ("rmsnorm_matmul_forward", normed),
            ("rmsnorm_matmul_swiglu_forward", swiglu), ("rmsnorm_matmul_rope_forward", rotated)))
        for name, product in products:
            bits = lambda rows: [case.get(a) for a in product(np.asarray(rows))]
            alone = [bits([r]) for r in range(FEW_ROWS)]
            same = True
            for N in (5, 20, FEW_ROWS):
                rows = case.rng.permutation(FEW_ROWS)[:N]
                among = bits(rows)
                same &= all(np.array_equal(a, np.stack([alone[r][i][0] for r in rows])) for i, a in enumerate(among))
            out.append((f"{name}{case.tag} {O}x{I}: a row's bits alone and among 5, 20, {FEW_ROWS} rows",
                        0.0 if same else math.inf, case.tol))
    return out


@_precisions("fp32", "bf16")
def check_embedding(case, gpu_layers, cpu_layers):
    V, C, N = 53, 37, 229
    emb, dout = case.act(case.normal(V, C)), case.act(case.normal(N, C))
    tokens = case.rng.integers(0, V, N).astype(np.int32)
    # repeated tokens: the backward scatter-add must not lose updates; runs longer than EMB_SEGMENT, cut in pieces
    tokens[:9] = 7
    tokens[case.rng.permutation(N)[:100]] = 11
    ref = np.empty((N, C))
    cpu_layers.embedding_forward(ref, tokens, emb)
    g = case.poisoned(N, C)
    gpu_layers.embedding_forward(g, case.cp.asarray(tokens), case.dev(emb))
    base = _f32(case.normal(V, C))
    rdemb = base.copy()
    cpu_layers.embedding_backward(rdemb, dout, tokens)
    gdemb = case.dev32(base)
    gpu_layers.embedding_backward(gdemb, case.dev(dout), case.cp.asarray(tokens))
    return [(f"embedding_forward{case.tag} V={V} C={C} N={N}", rel_err(case.get(g), ref), case.tol),
            (f"embedding_backward{case.tag} (+=, repeated tokens)", rel_err(case.get(gdemb), rdemb), case.tol)]


@_precisions("fp32", "bf16")
def check_rmsnorm(case, gpu_layers, cpu_layers):
    # the norm and the residual stream's copy of x, which no layer does alone
    from nanoeuler.model.gpu.layers import _rmsnorm_forward as _gpu_rmsnorm_forward

    out = []
    # a row length off the 4-wide vector path, one on it, one of whole 16-byte chunks (rows in registers)
    for N, C in ((67, 203), (45, 196), (37, 256)):
        x, w = case.act(case.normal(N, C, scale=2.0)), case.act(1 + case.normal(C, scale=0.3))
        dout = case.act(case.normal(N, C))
        ref, rrstd = np.empty((N, C)), np.empty(N)
        cpu_layers.rmsnorm_forward(ref, rrstd, x, w, 1e-5)
        g, grstd, gskip = case.poisoned(N, C), case.poisoned32(N), case.poisoned(N, C)
        _gpu_rmsnorm_forward(g, grstd, case.dev(x), case.dev(w), 1e-5, gskip)  # and the residual stream's copy of x
        base_dx, base_dw = case.act(case.normal(N, C)), _f32(case.normal(C))
        rdx, rdw = base_dx.copy(), base_dw.copy()
        rrstd = _f32(rrstd)
        cpu_layers.rmsnorm_backward(rdx, rdw, dout, x, w, rrstd)
        gdx, gdw = case.dev(base_dx), case.dev32(base_dw)
        gpu_layers.rmsnorm_backward(gdx, gdw, case.dev(dout), case.dev(x), case.dev(w), case.dev32(rrstd))
        out += [(f"rmsnorm_forward{case.tag} N={N} C={C}", rel_err(case.get(g), ref), case.tol),
                (f"rmsnorm_forward{case.tag} rstd", rel_err(case.get(grstd), rrstd), case.tol),
                (f"rmsnorm_forward{case.tag} skip (a copy of x: exact)", rel_err(case.get(gskip), x), 0.0),
                (f"rmsnorm_backward{case.tag} dx (+=)", rel_err(case.get(gdx), rdx), case.tol),
                (f"rmsnorm_backward{case.tag} dw (float32, +=)", rel_err(case.get(gdw), rdw), case.tol)]
    return out


@_precisions("fp32", "bf16")
def check_rope(case, gpu_layers, cpu_layers):
    out = []
    # the 16-byte kernel, then the general one (D/2 odd last); one position for all, then one a sequence
    for B, T, H, G, D, pos0 in ((3, 37, 6, 2, 64, 5), (2, 11, 3, 1, 36, 40), (3, 5, 3, 1, 6, 9)):
        cos, sin = rope_tables(D, 64, 10000.0, np.float64)
        cos, sin = _f32(cos), _f32(sin)
        for pos in (np.array([pos0], dtype=np.int32), case.rng.integers(0, 64 - T, B).astype(np.int32)):
            where = f"pos0={pos0}" if pos.size == 1 else f"positions {pos.tolist()}"
            for name, rfn, gfn in (("rope_forward", cpu_layers.rope_forward, gpu_layers.rope_forward),
                                   ("rope_backward", cpu_layers.rope_backward, gpu_layers.rope_backward)):
                qkv = case.act(case.normal(B, T, H + 2 * G, D))
                ref = qkv.copy()
                rfn(ref, cos, sin, H + G, pos)
                g = case.dev(qkv)
                gfn(g, case.dev32(cos), case.dev32(sin), H + G, case.cp.asarray(pos))
                out.append((f"{name}{case.tag} B={B} T={T} heads {H}+{G}(+{G} v untouched) D={D} {where}",
                            rel_err(case.get(g), ref), case.tol))
    return out


def _attention_cases():
    # (B, T, H, G, D): T past a tile boundary, GQA group 3, MHA, head_dim 64 and 32, one short of a tile; head_dim
    # 128 past two tiles, GQA group 2
    return [(2, 77, 6, 2, 64), (1, 130, 4, 4, 32), (2, 63, 4, 2, 32), (2, 150, 4, 2, 128)]


@_precisions("fp32", "tf32", "bf16")
def check_attention(case, gpu_layers, cpu_layers):
    out = []
    for B, T, H, G, D in _attention_cases():
        NH = H + 2 * G
        qkv = case.act(case.normal(B, T, NH, D))
        ref_o, ref_lse = np.empty((B, T, H, D)), np.empty((B, H, T))
        cpu_layers.attention_forward(ref_o, ref_lse, qkv, H, G)
        go, glse = case.poisoned(B, T, H, D), case.poisoned32(B, H, T)
        gqkv = case.dev(qkv)
        gpu_layers.attention_forward(go, glse, gqkv, H, G)
        out.append((f"attention_forward{case.tag} B={B} T={T} H={H} G={G} D={D}", rel_err(case.get(go), ref_o),
                    case.tol))
        out.append((f"attention_forward{case.tag} lse", rel_err(case.get(glse), ref_lse), case.tol))
        # the backward pass reads the forward's output and lse: give both engines the GPU's
        dout = case.act(case.normal(B, T, H, D))
        o, lse32 = case.get(go).astype(np.float64), case.get(glse).astype(np.float64)
        # plain, and through the rotary embedding (rope_backward folded into the stores of dq and dk)
        cos, sin = rope_tables(D, T, 10000.0, np.float64)
        for rope, tables in (("", ()), (" +rope", (cos, sin))):
            ref_d = np.empty_like(qkv)
            cpu_layers.attention_backward(ref_d, dout, o, lse32, qkv, H, G, *tables)
            gd = case.poisoned(B, T, NH, D)
            gpu_layers.attention_backward(gd, case.dev(dout), go, glse, gqkv, H, G, *(case.dev32(t) for t in tables))
            gd = case.get(gd)
            for part, sl in (("dq", slice(0, H)), ("dk", slice(H, H + G)), ("dv", slice(H + G, NH))):
                out.append((f"attention_backward{case.tag}{rope} {part}", rel_err(gd[:, :, sl], ref_d[:, :, sl]),
                            case.tol))
    # decoding: a prompt of 90, then 11 (across a 32-key chunk's end) and 1 new rows, appended to a KV cache
    # of 109 positions and attending to it (the cache's untouched tail stays poisoned on both sides)
    B, S, H, G = 2, 109, 6, 2
    for D in (64, 32, 128):
        ref_cache, g_cache = np.full((B, S, 2 * G, D), np.nan), case.poisoned(B, S, 2 * G, D)
        ref_pos, g_pos = np.zeros(1, np.int32), case.cp.zeros(1, np.int32)
        for n in (90, 11, 1):
            qkv = case.act(case.normal(B, n, H + 2 * G, D))
            ref_o, ref_lse = np.empty((B, n, H, D)), np.empty((B, H, n))
            cpu_layers.attention_cached(ref_o, ref_lse, qkv, ref_cache, H, G, ref_pos)
            go, glse = case.poisoned(B, n, H, D), case.poisoned32(B, H, n)
            gpu_layers.attention_cached(go, glse, case.dev(qkv), g_cache, H, G, g_pos)
            label = f"attention_cached{case.tag} D={D} pos={ref_pos[0]} n={n}"
            out += [(label, rel_err(case.get(go), ref_o), case.tol),
                    (f"{label} lse", rel_err(case.get(glse), ref_lse), case.tol)]
            cpu_layers.advance_position(ref_pos, n)
            gpu_layers.advance_position(g_pos, n)
        stored = int(g_pos.get()[0])
        out.append((f"attention_cached{case.tag} D={D} the cache (k, v heads of {stored} positions), position",
                    rel_err(case.get(g_cache)[:, :stored], ref_cache[:, :stored])
                    + (0.0 if stored == ref_pos[0] == 102 else math.inf), case.tol))
        # batched decoding: sequences in slots 3, 0, 4 of a cache of 5 rows, each at its own position (a chunk
        # of 5 new rows, then one row each), the slots' keys and values written before by the same kernel
        rows_of, context = np.array([3, 0, 4], np.int32), 40
        ref_slots = case.act(case.normal(5, context, 2 * G, D))
        g_slots = case.dev(ref_slots)
        ref_slots = ref_slots.astype(np.float64)
        for n, pos in ((5, np.array([7, 0, 33], np.int32)), (1, np.array([12, 5, 38], np.int32))):
            qkv = case.act(case.normal(3, n, H + 2 * G, D))
            ref_o, ref_lse = np.empty((3, n, H, D)), np.empty((3, H, n))
            cpu_layers.attention_cached(ref_o, ref_lse, qkv, ref_slots, H, G, pos, rows_of)
            go, glse = case.poisoned(3, n, H, D), case.poisoned32(3, H, n)
            gpu_layers.attention_cached(go, glse, case.dev(qkv), g_slots, H, G, case.cp.asarray(pos),
                                        case.cp.asarray(rows_of))
            label = f"attention_cached{case.tag} D={D} slots {rows_of.tolist()} at {pos.tolist()} n={n}"
            out += [(label, rel_err(case.get(go), ref_o), case.tol),
                    (f"{label} lse", rel_err(case.get(glse), ref_lse), case.tol)]
        out.append((f"attention_cached{case.tag} D={D} slots: the cache", rel_err(case.get(g_slots), ref_slots),
                    case.tol))
    # batch invariance: a row's bits are the same decoded alone (a block a query head) and among 12 rows (a
    # block a kv head's query heads), for kv groups of 2 and 4 query heads and of 5 (more than a block takes);
    # head_dim 128: a block a query head either way, of 8 warps alone and 4 among 12
    rows, context = 12, 70
    for H, G, D in ((4, 2, 64), (8, 2, 64), (10, 2, 64), (8, 2, 128)):
        cache, qkv = case.act(case.normal(rows, context, 2 * G, D)), case.act(case.normal(rows, 1, H + 2 * G, D))
        pos = case.rng.integers(0, context - 1, rows).astype(np.int32)
        go, glse = case.poisoned(rows, 1, H, D), case.poisoned32(rows, H, 1)
        gpu_layers.attention_cached(go, glse, case.dev(qkv), case.dev(cache), H, G, case.cp.asarray(pos),
                                    case.cp.arange(rows, dtype=np.int32))
        together, together_lse, same = case.get(go), case.get(glse), True
        for r in range(rows):
            go, glse = case.poisoned(1, 1, H, D), case.poisoned32(1, H, 1)
            gpu_layers.attention_cached(go, glse, case.dev(qkv[r:r + 1]), case.dev(cache), H, G,
                                        case.cp.asarray(pos[r:r + 1]), case.cp.full(1, r, dtype=np.int32))
            same &= bool(np.array_equal(case.get(go)[0], together[r])
                         and np.array_equal(case.get(glse)[0], together_lse[r]))
        out.append((f"attention_cached{case.tag} H={H} G={G} D={D}: a row's bits alone and among {rows} rows",
                    0.0 if same else math.inf, case.tol))
    return out


@_precisions("fp32")
def check_sample_rows(case, gpu_layers, cpu_layers):
    """sample_rows: the CPU layer's draws, every one (the two engines compute the same weights, integer masses,
    cuts and noise): 300 token indices of small rows with ties at the cuts, and rows of Llama 3's vocabulary
    and of an odd one: top-p, top-k, both, top-k past the live tokens, a flat row, a nearly flat one (its cut's
    bucket more than the list holds), -inf padding, a greedy row among them; each row alone draws what it draws
    in the batch; at temperature 0 the argmax; then feed_back's inputs, positions, indices and log."""
    Rn, V = 6, 37
    logits = np.round(case.normal(Rn, V, scale=3.0), 1).astype(np.float32)  # rounded: ties at the cuts
    logits[5, [3, 30]] = logits[5].max() + 1  # a tie at the top: the first id greedy
    top_k = np.array([0, 1, 5, 0, 7, 0], np.int32)
    top_p = np.array([0.5, 1.0, 1.0, 1.0, 0.6, 0.0], np.float32)
    temp = np.array([1.0, 1.0, 0.7, 2.0, 1.0, 1.0], np.float32)
    seeds = case.rng.integers(0, 1 << 32, (2, Rn)).astype(np.uint32)
    ref, got = np.empty(Rn, np.int32), case.cp.full(Rn, -1, np.int32)
    drawn, differ = [set() for _ in range(Rn)], 0
    dev = [case.cp.asarray(a) for a in (logits, top_k, temp, top_p, seeds[0], seeds[1])]
    for i in range(300):
        index = np.full(Rn, i, np.int32)
        cpu_layers.sample_rows(ref, logits, top_k, temp, top_p, seeds[0], seeds[1], index)
        gpu_layers.sample_rows(got, dev[0], dev[1], dev[2], dev[3], dev[4], dev[5], case.cp.asarray(index))
        differ += int((got.get() != ref).sum())
        for r in range(Rn):
            drawn[r].add(int(ref[r]))
    spread = len(drawn[3]) > 5 and len(drawn[1]) == 1 and len(drawn[5]) == 1  # top-1 and top-p 0: one id
    gpu_layers.sample_rows(got, dev[0], dev[1], case.cp.zeros(Rn, np.float32), dev[3], dev[4], dev[5],
                           case.cp.zeros(Rn, np.int32))
    greedy = np.array_equal(got.get(), logits.argmax(axis=1))
    out = [(f"sample_rows rows={Rn} V={V}: the CPU's draws ({differ} of {300 * Rn} differ)",
            0.0 if differ == 0 and spread else math.inf, case.tol),
           ("sample_rows temperature 0: the argmax (the first of a tie)", 0.0 if greedy else math.inf, case.tol)]
    for Vl, draws in ((128256, 6), (50021, 3)):
        big = case.normal(8, Vl, scale=2.0).astype(np.float32)
        big[4] = 0.0  # flat: every token tied
        big[5] = np.float32(3.0) + case.normal(Vl, scale=1e-3).astype(np.float32)  # nearly flat
        big[6, Vl - 1000:] = -np.inf  # padding past a vocabulary
        big[7] = np.round(big[7], 1)  # ties at the cuts
        settings = [np.array(a, dtype) for a, dtype in (
            ([0, 40, 0, 300, 0, 50, 0, Vl - 1], np.int32), ([1.0, 0.8, 1.3, 1.0, 0.8, 0.7, 0.0, 0.9], np.float32),
            ([0.9, 0.95, 0.5, 1.0, 0.95, 0.9, 0.9, 0.99], np.float32))]
        big_seeds = case.rng.integers(0, 1 << 32, (2, 8)).astype(np.uint32)
        big_dev = [case.cp.asarray(a) for a in (big, *settings, *big_seeds)]
        ref_big, got_big, differ, alone_differ = np.empty(8, np.int32), case.cp.full(8, -1, np.int32), 0, 0
        for i in range(draws):
            index = np.full(8, 3 * i + 1, np.int32)
            cpu_layers.sample_rows(ref_big, big, *settings, *big_seeds, index)
            gpu_layers.sample_rows(got_big, *big_dev, case.cp.asarray(index))
            together = got_big.get()
            differ += int((together != ref_big).sum())
            for r in range(8):  # the row alone, in a batch of one
                one = case.cp.full(1, -1, np.int32)
                gpu_layers.sample_rows(one, *[a[r:r + 1] for a in big_dev], case.cp.asarray(index[r:r + 1]))
                alone_differ += int(one.get()[0] != together[r])
        out.append((f"sample_rows rows=8 V={Vl}: the CPU's draws ({differ} of {8 * draws} differ), each row alone "
                    f"its batch's ({alone_differ} differ)", 0.0 if differ == alone_differ == 0 else math.inf,
                    case.tol))
    tokens, pos, index = case.cp.zeros((Rn, 1), np.int32), case.cp.asarray(np.array([0, 5, 9, 9, 2, 1], np.int32)), \
        case.cp.arange(Rn, dtype=np.int32)
    log, counter = case.cp.full((4, Rn), -1, np.int32), case.cp.full(1, 2, np.int32)
    gpu_layers.feed_back(tokens, got, pos, index, log, counter, 10)
    fed = (np.array_equal(tokens.get()[:, 0], got.get()) and pos.get().tolist() == [1, 6, 9, 9, 3, 2]
           and np.array_equal(index.get(), np.arange(1, Rn + 1)) and np.array_equal(log.get()[2], got.get())
           and int(counter.get()[0]) == 3)
    return out + [("feed_back: inputs, positions (capped), indices, log, counter", 0.0 if fed else math.inf,
                   case.tol)]


@_precisions("fp32")
def check_argmax(case, gpu_layers, cpu_layers):
    logits = _f32(case.normal(7, 1031, scale=3.0))
    logits[3, [10, 500]] = logits[3].max() + 1  # a tie: the first index wins, as NumPy's
    ref = np.empty(7, np.int32)
    cpu_layers.argmax(ref, logits)
    got, log = case.cp.full(7, -1, np.int32), case.cp.full((5, 7), -1, np.int32)
    gpu_layers.argmax(got, case.dev32(logits), log, case.cp.full(1, 3, np.int32))  # and into row 3 of a log
    logged = log.get()
    right = np.array_equal(got.get(), ref) and np.array_equal(logged[3], ref) and (np.delete(logged, 3, 0) == -1).all()
    out = [("argmax rows=7 V=1031 (a tie), logged at position 3", 0.0 if right else math.inf, case.tol)]
    # a long row: many blocks a row, their results met in any order; ties across blocks, one row of -inf
    logits = _f32(case.normal(3, 50021, scale=3.0))
    logits[0, [40000, 7, 25000]] = logits[0].max() + 1
    logits[1, [50020, 30001]] = logits[1].max() + 1
    logits[2] = -np.inf
    ref = np.empty(3, np.int32)
    cpu_layers.argmax(ref, logits)
    for _ in range(2):  # twice: the blocks' count is back at 0 after a launch
        got = case.cp.full(3, -1, np.int32)
        gpu_layers.argmax(got, case.dev32(logits))
        right = np.array_equal(got.get(), ref)
        out.append(("argmax rows=3 V=50021 (ties across blocks, a row of -inf)", 0.0 if right else math.inf,
                    case.tol))
    # a greedy step's end: logged at the position, which then moves on (one row: in the argmax's kernel; more:
    # advance_position after it), twice
    for R in (1, 3):
        ref, ref_log, ref_pos = np.empty(R, np.int32), np.full((9, R), -1, np.int32), np.full(1, 2, np.int32)
        got, log, pos = case.cp.full(R, -1, np.int32), case.cp.full((9, R), -1, np.int32), case.cp.full(1, 2, np.int32)
        for _ in range(2):
            cpu_layers.argmax(ref, logits[:R], ref_log, ref_pos, 3)
            gpu_layers.argmax(got, case.dev32(logits[:R]), log, pos, 3)
        right = (np.array_equal(got.get(), ref) and np.array_equal(log.get(), ref_log)
                 and int(pos.get()[0]) == int(ref_pos[0]) == 8)
        out.append((f"argmax rows={R} V=50021 logged at positions 2 and 5, the position advanced by 3 each",
                    0.0 if right else math.inf, case.tol))
    return out


@_precisions("fp32", "bf16")
def check_swiglu(case, gpu_layers, cpu_layers):
    out = []
    for N, F in ((71, 93), (37, 92)):  # off and on the 4-wide vector path
        gu, dout = case.act(case.normal(N, 2 * F, scale=2.0)), case.act(case.normal(N, F))
        ref = np.empty((N, F))
        cpu_layers.swiglu_forward(ref, gu)
        g = case.poisoned(N, F)
        gpu_layers.swiglu_forward(g, case.dev(gu))
        rd = np.empty((N, 2 * F))
        cpu_layers.swiglu_backward(rd, dout, gu)
        gd = case.poisoned(N, 2 * F)
        gpu_layers.swiglu_backward(gd, case.dev(dout), case.dev(gu))
        out += [(f"swiglu_forward{case.tag} N={N} F={F}", rel_err(case.get(g), ref), case.tol),
                (f"swiglu_backward{case.tag}", rel_err(case.get(gd), rd), case.tol)]
    return out


@_precisions("fp32", "bf16")
def check_crossentropy(case, gpu_layers, cpu_layers):
    # V = 1031 streams a row; 2048 and 4096 (base's) hold it in registers, 1, 2 or 4 pieces a thread
    results = []
    for N, K, V in ((97, 3, 1031), (21, 2, 2048), (13, 4, 4096)):
        logits = case.act(case.normal(N, K * V, scale=3.0))
        targets = case.rng.integers(0, V, (K, N)).astype(np.int32)
        targets[:, 5] = -1
        targets[K - 1, 7:10] = -1
        dscale = _f32(case.rng.uniform(-1.0, 1.0, (K, N)))  # a scale per head and row, signed as DPO's
        ref_l = np.empty((K, N))
        cpu_layers.crossentropy_forward(ref_l, logits, targets)
        gl = case.poisoned32(K, N)
        gpu_layers.crossentropy_forward(gl, case.dev(logits), case.cp.asarray(targets))
        ref_l2, ref_d = np.empty((K, N)), logits.copy()
        cpu_layers.crossentropy_forward_backward(ref_l2, ref_d, targets, dscale)
        gl2, gd = case.poisoned32(K, N), case.dev(logits)
        gpu_layers.crossentropy_forward_backward(gl2, gd, case.cp.asarray(targets), case.dev32(dscale))
        results += [(f"crossentropy_forward{case.tag} N={N} K={K} V={V}, -1 targets", rel_err(case.get(gl), ref_l),
                     case.tol),
                    (f"crossentropy_forward_backward{case.tag} losses", rel_err(case.get(gl2), ref_l2), case.tol),
                    (f"crossentropy_forward_backward{case.tag} dlogits (in place)", rel_err(case.get(gd), ref_d),
                     case.tol)]
    return results


@_precisions("fp32", "bf16")
def check_adamw(case, gpu_layers, cpu_layers):
    # Reference: the CPU layer on float32 buffers, as the CPU engine trains (both do the arithmetic in
    # float64 and round the stored p, m, v to float32); a float64 reference would keep digits that float32
    # parameters cannot hold, next to a step a thousand times smaller than the parameters. The master
    # weights are float32 in every precision; bf16 adds the compute copy written in the same pass.
    n = 100_003
    f32 = lambda a: np.asarray(a, dtype=np.float32)
    p, gr = f32(case.normal(n)), f32(case.normal(n))
    m, v = f32(case.normal(n, scale=0.1)), f32(np.abs(case.normal(n, scale=0.1)))
    mask = (case.rng.random(n) < 0.9).astype(np.uint8)
    args = (3e-3, 0.9, 0.95, 1e-8, 0.1, 0.7, 5)
    rp, rm, rv = p.copy(), m.copy(), v.copy()
    cpu_layers.adamw_update(rp, gr, rm, rv, mask, *args)
    gp, gm, gv = case.dev32(p), case.dev32(m), case.dev32(v)
    copy = case.poisoned(n) if case.bf16 else None
    gpu_layers.adamw_update(gp, case.dev32(gr), gm, gv, case.cp.asarray(mask), *args, compute_copy=copy)
    step = lambda new: new.astype(np.float64) - p  # compare the step itself, not the parameters
    gr64 = gr.astype(np.float64)
    if case.bf16:  # the copy must be the updated master weights rounded to nearest: exactly, so error 0
        return [(f"adamw_update{case.tag} compute copy = bf16(master)",
                 rel_err(case.get(copy), case.act(gp.get())), case.tol)]
    exact = cpu_layers.sum_squares(gr64)
    # the clip factor computed in the kernel from the squared norm on the device (the training step's path):
    # 2.25 clips a norm of 3 to 1.5 (factor 1/2)
    clipped, cm, cv = p.copy(), m.copy(), v.copy()
    cpu_layers.adamw_update(clipped, gr, cm, cv, mask, *args, squares=np.float64(9.0), grad_clip=1.5)
    gp2, gm2, gv2 = case.dev32(p), case.dev32(m), case.dev32(v)
    gpu_layers.adamw_update(gp2, case.dev32(gr), gm2, gv2, case.cp.asarray(mask), *args,
                            squares=case.cp.asarray(np.float64(9.0)), grad_clip=1.5)
    # the ranks' gradients summed with the norm's squares in one pass (in place: out is a), the squares the
    # bits of sum_squares over the sum
    ga, gb = case.dev32(gr), case.dev32(m)
    squares = float(gpu_layers.add_sum_squares(ga, ga, gb))
    ref_sum = gr64 + m.astype(np.float64)
    added = [("add_sum_squares sum", rel_err(ga.get(), ref_sum), case.tol),
             ("add_sum_squares squares = sum_squares(sum)",
              0.0 if squares == gpu_layers.sum_squares(ga) else math.inf, 0.0),
             ("add_sum_squares squares", abs(squares - cpu_layers.sum_squares(ref_sum)) / squares, case.tol)]
    return added + [(f"adamw_update n={n} (parameter step)", rel_err(step(gp.get()), step(rp)), case.tol),
            ("adamw_update moments m, v", max(rel_err(gm.get(), rm), rel_err(gv.get(), rv)), case.tol),
            ("adamw_update, clip factor from the squared norm on the device",
             max(rel_err(step(gp2.get()), step(clipped)), rel_err(gm2.get(), cm), rel_err(gv2.get(), cv)), case.tol),
            ("sum_squares", abs(gpu_layers.sum_squares(case.dev32(gr)) - exact) / exact, case.tol)]


QUANT_FORMATS = (("int8", 32), ("int8", 0), ("int4", 32), ("int4", 64))


@_precisions("fp32", "bf16")
def check_quantized_matmul(case, gpu_layers, cpu_layers):
    from nanoeuler.model.gpu.quantized import QuantizedMatrix, dequantize as gpu_dequantize
    from nanoeuler.model.quantize import dequantize, quantize
    I, O = 384, 77  # O not a multiple of the kernels' 8 rows
    out = []
    # int4/32 in rows of 1,024 too: QUANT_SPLIT warps split its rows, so more than 16 rows take 4 tiles of x a
    # block (gpu.quantized.x_tiles; int8 takes them at any split)
    for kind, group, cols in (*((k, g, I) for k, g in QUANT_FORMATS), ("int4", 32, 1024)):
        qt = quantize(case.normal(O, cols).astype(np.float32), kind, group)
        w = QuantizedMatrix.of(qt)
        what = f"{kind}/{group or 'row'}" + (f" in rows of {cols}" if cols != I else "")
        if case.precision == "fp32":
            exact = np.array_equal(gpu_dequantize(w).get(), dequantize(qt))
            out.append((f"quantized dequantize {what} (bit for bit)", 0.0 if exact else math.inf, 0.0))
        w64 = dequantize(qt).astype(np.float64)
        for N in (1, 5, 16, 37, 64, 100):
            x, base = case.act(case.normal(N, cols)), case.act(case.normal(N, O))
            ref = base.copy()
            cpu_layers.matmul_forward(ref, x, w64, accumulate=True)
            g = case.dev(base)
            gpu_layers.matmul_forward(g, case.dev(x), w, accumulate=True)
            ref32 = np.empty((N, O))
            cpu_layers.matmul_forward(ref32, x, w64)
            g32 = case.poisoned32(N, O)
            gpu_layers.matmul_forward(g32, case.dev(x), w)
            out.append((f"quantized matmul{case.tag} {what} {N} rows, +=", rel_err(case.get(g), ref), case.tol))
            out.append((f"quantized matmul{case.tag} {what} {N} rows, float32 out", rel_err(case.get(g32), ref32),
                        case.tol))
            if case.precision == "bf16" and N in (37, 64):  # each row's bits those of its product alone
                rows = g32.get()
                alone = case.poisoned32(1, O)
                same = True
                for r in (0, 17, 33, N - 1):
                    gpu_layers.matmul_forward(alone, case.dev(x[r:r + 1]), w)
                    same &= np.array_equal(alone.get()[0], rows[r])
                out.append((f"quantized matmul{case.tag} {what}: a row of {N} = the row alone",
                            0.0 if same else math.inf, 0.0))
    # a row slice (an engine's heads.0 of its heads) reads its own rows' scales
    qt = quantize(case.normal(2 * O, I).astype(np.float32), "int4", 32)
    x = case.act(case.normal(3, I))
    ref = np.empty((3, O))
    cpu_layers.matmul_forward(ref, x, dequantize(qt)[O:].astype(np.float64))
    g = case.poisoned32(3, O)
    gpu_layers.matmul_forward(g, case.dev(x), QuantizedMatrix.of(qt).rows(O, 2 * O))
    out.append((f"quantized matmul{case.tag} int4/32 of a row slice", rel_err(case.get(g), ref), case.tol))
    if case.precision == "bf16":
        out += _quantized_folded(case, gpu_layers, cpu_layers)
    return out


def _quantized_folded(case, gpu_layers, cpu_layers):
    """bf16 quantized products with RMSNorm folded in (decoding's and any unnormed-input forward's): plain, with
    SwiGLU, with a bias and the rotary embedding of 3 of 5 heads (a row at its own position), at 1, 13 and 64
    rows against the CPU layers on the dequantized matrix, and at 100 (dequantized into bf16, then the separate
    kernels); and a row's bits in 37 and 64 rows those of the row alone."""
    from nanoeuler.model.gpu.quantized import QuantizedMatrix
    from nanoeuler.model.quantize import dequantize, quantize
    I, NH, D = 1024, 5, 16  # rows of 8 records or more: QUANT_SPLIT warps split them, more than 16 rows 4 tiles
    O = NH * D  # not a multiple of the kernels' 16 rows (8 pairs)
    gain, bias = case.act(1 + case.normal(I, scale=0.3)), case.act(case.normal(O))
    cos, sin = (_f32(t) for t in rope_tables(D, 64, 10000.0, np.float64))
    dgain, dbias, dcos, dsin = case.dev(gain), case.dev(bias), case.dev32(cos), case.dev32(sin)
    out = []
    for kind, group in (("int4", 32), ("int8", 64)):
        qt = quantize(case.normal(O, I).astype(np.float32), kind, group)
        w, w64, what = QuantizedMatrix.of(qt), dequantize(qt).astype(np.float64), f"{kind}/{group}"

        def normed(x, pos):
            g, grstd = case.poisoned(len(x), O), case.poisoned32(len(x))
            gpu_layers.rmsnorm_matmul_forward(g, grstd, case.dev(x), dgain, w, 1e-5, None)
            return g, grstd

        def swiglu(x, pos):
            gsw, ggu = case.poisoned(len(x), O // 2), case.poisoned(len(x), O)
            gpu_layers.rmsnorm_matmul_swiglu_forward(gsw, ggu, case.poisoned32(len(x)), case.dev(x), dgain, w, 1e-5,
                                                     None)
            return gsw, ggu

        def rotated(x, pos):
            g = case.poisoned(len(x), 1, NH, D)
            gpu_layers.rmsnorm_matmul_rope_forward(g, case.poisoned32(len(x)), case.dev(x), dgain, w, 1e-5, None, dcos,
                                                   dsin, 3, case.cp.asarray(pos), bias=dbias)
            return g,

        for N in (1, 13, 64, 100):
            x, pos = case.act(case.normal(N, I)), case.rng.integers(0, 64, N).astype(np.int32)
            ref, rstd, sw, xn = np.empty((N, O)), np.empty(N), np.empty((N, O // 2)), np.empty((N, I))
            cpu_layers.rmsnorm_matmul_forward(ref, rstd, x, gain, w64, 1e-5, xn)
            g, grstd = normed(x, pos)
            out += [(f"quantized rmsnorm_matmul_forward{case.tag} {what} {N} rows", rel_err(case.get(g), ref), case.tol),
                    (f"quantized rmsnorm_matmul_forward{case.tag} {what} {N} rows rstd", rel_err(case.get(grstd), rstd),
                     case.tol)]
            cpu_layers.rmsnorm_matmul_swiglu_forward(sw, ref, rstd, x, gain, w64, 1e-5, xn)
            gsw, ggu = swiglu(x, pos)
            out += [(f"quantized rmsnorm_matmul_swiglu_forward{case.tag} {what} {N} rows gate|up",
                     rel_err(case.get(ggu), ref), case.tol),
                    (f"quantized rmsnorm_matmul_swiglu_forward{case.tag} {what} {N} rows out", rel_err(case.get(gsw), sw),
                     case.tol)]
            ref = np.empty((N, 1, NH, D))
            cpu_layers.rmsnorm_matmul_rope_forward(ref, rstd, x, gain, w64, 1e-5, xn, cos, sin, 3, pos, bias=bias)
            out.append((f"quantized rmsnorm_matmul_rope_forward{case.tag} {what} {N} rows, a bias, 3 of 5 heads",
                        rel_err(case.get(rotated(x, pos)[0]), ref), case.tol))
        same = True
        for n in (37, 64):  # the few-row products: 37 rows end in a part-full block of x's rows
            for product in (normed, swiglu, rotated):
                together = [a.get() for a in product(x[:n], pos[:n])]
                for r in (0, 17, 33, n - 1):
                    alone = [a.get() for a in product(x[r:r + 1], pos[r:r + 1])]
                    same &= all(np.array_equal(a[0], b[r]) for a, b in zip(alone, together))
        out.append((f"quantized folded products{case.tag} {what}: a row of 37 or 64 = the row alone (norm, SwiGLU, "
                    "rotary)", 0.0 if same else math.inf, 0.0))
    return out


@_precisions("fp32", "tf32", "bf16")
def check_lora(case, gpu_layers, cpu_layers):
    """LoRA's layers: the update into a column slice of a wider output, its backward pass from a column slice of
    that output's gradient (rank 5, sizes off the tiles), and dropout (p 0.3: a wrong mask is an O(1) error)."""
    N, I, O, r, wide, at = 71, 93, 37, 5, 100, 21
    scale = 1.75
    x, a, b = case.act(case.normal(N, I)), case.act(case.normal(r, I, scale=0.3)), case.act(case.normal(O, r, scale=0.3))
    base, dout = case.act(case.normal(N, wide)), case.act(case.normal(N, wide))
    ref_out, ref_h = base.copy(), np.empty((N, r))
    cpu_layers.lora_forward(ref_out[:, at:at + O], ref_h, x, a, b, scale)
    g_out, g_h = case.dev(base), case.poisoned(N, r)
    gpu_layers.lora_forward(g_out[:, at:at + O], g_h, case.dev(x), case.dev(a), case.dev(b), scale)
    h = case.act(ref_h)  # the backward pass reads the kept product as the GPU rounded it
    dx0 = case.act(case.normal(N, I))
    rdx, rda, rdb, rdh = dx0.copy(), np.zeros((r, I)), np.zeros((O, r)), np.empty((N, r))
    cpu_layers.lora_backward(rdx, rda, rdb, rdh, dout[:, at:at + O], x, h, a, b, scale, True)
    gdx, gda, gdb, gdh = case.dev(dx0), case.dev32(np.zeros((r, I))), case.dev32(np.zeros((O, r))), case.poisoned(N, r)
    gpu_layers.lora_backward(gdx, gda, gdb, gdh, case.dev(dout)[:, at:at + O], case.dev(x), case.dev(h), case.dev(a),
                             case.dev(b), scale, True)
    rd, gd = np.empty((N, I)), case.poisoned(N, I)
    cpu_layers.dropout_forward(rd, x, 0.3, 987654321, False)
    gpu_layers.dropout_forward(gd, case.dev(x), 0.3, 987654321, False)
    return [(f"lora_forward{case.tag} into columns {at}..{at + O} of {wide}", rel_err(case.get(g_out), ref_out), case.tol),
            (f"lora_forward{case.tag}: kept x A^T", rel_err(case.get(g_h), ref_h), case.tol),
            (f"lora_backward{case.tag}: dx (added)", rel_err(case.get(gdx), rdx), case.tol),
            (f"lora_backward{case.tag}: dA, dB", max(rel_err(gda.get(), rda), rel_err(gdb.get(), rdb)), case.tol),
            (f"dropout_forward{case.tag} p 0.3", rel_err(case.get(gd), rd), case.tol)]


@_precisions("fp32", "tf32", "bf16")
def check_lora_group(case, gpu_layers, cpu_layers):
    """LoRA's grouped layers (the targets that share an input, q|k|v): three updates into column slices of a
    wider output from one stacked A, x A^T into a column slice of a wider kept buffer, and their backward pass."""
    N, I, r, wide, scale = 71, 93, 5, 100, 1.75
    outs = ((3, 37), (40, 11), (51, 11))  # (first column, width) of each target in the wide output
    x, a = case.act(case.normal(N, I)), case.act(case.normal(3 * r, I, scale=0.3))
    b = [case.act(case.normal(O, r, scale=0.3)) for _, O in outs]
    base, dout = case.act(case.normal(N, wide)), case.act(case.normal(N, wide))
    cols = [slice(at, at + O) for at, O in outs]
    ref_out, ref_h = base.copy(), np.empty((N, 5 * r))
    cpu_layers.lora_forward_group([ref_out[:, c] for c in cols], ref_h[:, r:4 * r], x, a, b, scale)
    g_out, g_h = case.dev(base), case.poisoned(N, 5 * r)
    gpu_layers.lora_forward_group([g_out[:, c] for c in cols], g_h[:, r:4 * r], case.dev(x), case.dev(a),
                                  [case.dev(m) for m in b], scale)
    h = case.act(ref_h[:, r:4 * r])  # the backward pass reads the kept product as the GPU rounded it
    dx0 = case.act(case.normal(N, I))
    rdx, rda, rdh = dx0.copy(), np.zeros((3 * r, I)), np.empty((N, 3 * r))
    rdb = [np.zeros((O, r)) for _, O in outs]
    cpu_layers.lora_backward_group(rdx, rda, rdb, rdh, [dout[:, c] for c in cols], x, h, a, b, scale)
    g_hbuf = case.dev(np.concatenate([np.zeros((N, r)), h, np.zeros((N, r))], axis=1))
    gdx, gda, gdh = case.dev(dx0), case.dev32(np.zeros((3 * r, I))), case.poisoned(N, 3 * r)
    gdb = [case.dev32(np.zeros((O, r))) for _, O in outs]
    g_dout = case.dev(dout)
    gpu_layers.lora_backward_group(gdx, gda, gdb, gdh, [g_dout[:, c] for c in cols], case.dev(x), g_hbuf[:, r:4 * r],
                                   case.dev(a), [case.dev(m) for m in b], scale)
    return [(f"lora_forward_group{case.tag} into 3 column slices", rel_err(case.get(g_out), ref_out), case.tol),
            (f"lora_forward_group{case.tag}: kept x A^T (a column slice)",
             rel_err(case.get(g_h)[:, r:4 * r], ref_h[:, r:4 * r]), case.tol),
            (f"lora_backward_group{case.tag}: dx (added)", rel_err(case.get(gdx), rdx), case.tol),
            (f"lora_backward_group{case.tag}: dA, dB", max([rel_err(gda.get(), rda)]
                                                            + [rel_err(g.get(), r_) for g, r_ in zip(gdb, rdb)]),
             case.tol)]


KERNEL_CHECKS = [check_matmul, check_embedding, check_rmsnorm, check_rope, check_attention, check_swiglu,
                 check_crossentropy, check_adamw, check_argmax, check_sample_rows, check_quantized_matmul,
                 check_lora, check_lora_group]

# a quantized model: every row length a multiple of the int4 kernels' 128
QUANT_CONFIG = dataclasses.replace(MODEL_CONFIG, hidden=384)


def quantized_model_check(seed, kind, group, precision, report=print, head=None):
    """A quantized model on the GPU in `precision` vs the CPU engine (float64) on the same quantized weights:
    full-forward logits and KV-cache decode logits (a prompt, then single tokens: a CUDA graph); head: the heads'
    own type (groups of 32: an int4 model's int8 head), else the layers'."""
    from nanoeuler.check.problems import quantized_problem, random_problem
    from nanoeuler.model.engine import make_engine
    cfg = QUANT_CONFIG
    flat, inputs, _ = random_problem(cfg, np.random.default_rng(seed), batch=3, scale=0.05)
    qcfg, floats, quantized = quantized_problem(cfg, flat, kind, group, head)
    cpu = make_engine(qcfg, device="cpu", dtype=np.float64, training=False)
    gpu = make_engine(qcfg, device="gpu", precision=precision, training=False)
    cpu.load_params(_f32(floats), quantized)
    gpu.load_params(floats, quantized)
    errors = {"logits": logits_err(gpu.logits(inputs), cpu.logits(inputs), cfg)}
    logits = []
    for eng in (cpu, gpu):
        dec = decoder_of(eng)
        cache = dec.new_cache(2)
        steps = [dec.logits(cache, inputs[:2, :37])]
        steps += [dec.logits(cache, inputs[:2, 37 + i:38 + i]) for i in range(3)]
        logits.append(np.stack(steps))
    errors["decode logits"] = logits_err(logits[1], logits[0], cfg)
    what = f"{kind}/{group}" + (f", head {qcfg.quant_head}" if qcfg.quant_head else "")
    for name, err in errors.items():
        report(f"{name + ' (' + what + ')':<24} : rel err {err:.2e}")
    return errors


def _engines(seed, cfg, precision):
    """A CPU engine (float64) and a GPU engine in `precision` on the same float32-representable random
    parameters, and a batch with some -1 targets."""
    from nanoeuler.model.engine import make_engine
    from nanoeuler.check.problems import random_problem

    flat, inputs, targets = random_problem(cfg, np.random.default_rng(seed), batch=3, scale=0.05)
    cpu = make_engine(cfg, device="cpu", dtype=np.float64)
    gpu = make_engine(cfg, device="gpu", precision=precision)
    cpu.load_params(_f32(flat))
    gpu.load_params(_f32(flat))
    return cpu, gpu, inputs, targets


def _grad_errors(cpu, gpu, cfg):
    got = gpu.grads.get()
    layout, _ = param_layout(cfg)
    return {name: rel_err(got[off:off + math.prod(shape)], cpu.grads[off:off + math.prod(shape)])
            for name, (off, shape) in layout.items()}


def model_check(seed, precision="fp32", report=print, cfg=MODEL_CONFIG):
    """GPU engine in `precision` vs CPU engine (float64): {tensor: error}, plus the loss, the KV-cache decode
    logits and whether a second backward pass gives bit-identical gradients (error 0 or inf)."""
    cpu, gpu, inputs, targets = _engines(seed, cfg, precision)
    cpu_loss = cross_entropy_backward(cpu, inputs, targets)[0]
    gpu_loss = cross_entropy_backward(gpu, inputs, targets)[0]
    first = gpu.grads.copy()
    logits, heads = [], []
    for eng in (cpu, gpu):  # a prompt, then single tokens (on the GPU: a CUDA graph, recorded then replayed)
        dec = decoder_of(eng)
        cache = dec.new_cache(2)
        steps = [dec.logits(cache, inputs[:2, :37])]
        steps += [dec.logits(cache, inputs[:2, 37 + i:38 + i]) for i in range(3)]
        logits.append(np.stack(steps))
        if cfg.mtp_heads > 1:
            heads.append(dec.logits(cache, inputs[:2, 40:43], all_heads=True))  # 3 positions x K heads
    greedy = decoder_of(gpu).greedy(decoder_of(gpu).new_cache(2), inputs[:2, :37])
    errors = {"loss": abs(gpu_loss - cpu_loss) / abs(cpu_loss)}
    report(f"{'loss':<24} : rel err {errors['loss']:.2e}  (cpu {cpu_loss:.8f}, gpu {gpu_loss:.8f})")
    for name, err in _grad_errors(cpu, gpu, cfg).items():
        errors[name] = err
        report(f"{name:<24} : rel err {err:.2e}")
    errors["decode logits"] = logits_err(logits[1], logits[0], cfg)
    report(f"{'decode logits (KV cache)':<24} : rel err {errors['decode logits']:.2e}")
    if heads:
        errors["decode every head"] = logits_err(heads[1], heads[0], cfg)
        report(f"{'decode, every head':<24} : rel err {errors['decode every head']:.2e}")
    errors["decode argmax"] = 0.0 if np.array_equal(greedy, logits[1][0].argmax(axis=-1)) else math.inf
    report(f"{'decode argmax':<24} : {'the logits argmax' if errors['decode argmax'] == 0 else 'WRONG'}")
    cross_entropy_backward(gpu, inputs, targets)
    same = bool((gpu.grads == first).all())
    errors["determinism"] = 0.0 if same else math.inf
    report(f"{'second backward pass':<24} : {'bit-identical gradients' if same else 'DIFFERENT gradients'}")
    return errors


def lora_model_check(seed, precision="fp32", report=print, cfg=BIAS_CONFIG, dropout=0.0, quant=None):
    """LoRA on a frozen base (model/lora.py), GPU engine in `precision` vs CPU engine (float64), the same base,
    adapters (rank 8 on all seven targets, alpha 16) and dropout key: {adapter tensor: error}, plus the loss,
    and whether the GPU's gradients with --recompute (mlp, products and layer) equal its stored path's bit for bit (error 0
    or inf).
    quant "int8" / "int4": QLoRA, the base's matrices quantized in groups of 32 on both engines, its heads int8
    (`quantize`'s default; the input gradient through them: the CPU's exact dequantization, the GPU's dequantized
    scratch and cuBLAS)."""
    from nanoeuler.check.problems import quantized_problem, random_problem
    from nanoeuler.model import lora
    from nanoeuler.model.engine import make_engine

    rng = np.random.default_rng(seed + 11)
    flat, inputs, targets = random_problem(cfg, rng, batch=3, scale=0.05)
    spec = lora.make_spec(cfg, 8, 16.0, dropout)
    values = _f32(rng.normal(0.0, 0.05, lora.adapter_layout(cfg, spec)[1]))
    quantized = None
    if quant is not None:
        cfg, flat, quantized = quantized_problem(cfg, flat, quant, 32, head="int8")
    engines = []
    for device, dtype in (("cpu", np.float64), ("gpu", np.float32)):
        eng = make_engine(cfg, device=device, dtype=dtype, precision=None if device == "cpu" else precision,
                          training=False)
        eng.load_params(_f32(flat), quantized)
        lora.attach(eng, spec, values).dropout_key = 3
        engines.append(eng)
    cpu, gpu = engines
    losses = [cross_entropy_backward(eng, inputs, targets)[0] for eng in engines]
    errors = {"loss": abs(losses[1] - losses[0]) / abs(losses[0])}
    report(f"{'loss':<24} : rel err {errors['loss']:.2e}  (cpu {losses[0]:.8f}, gpu {losses[1]:.8f})")
    got, ref = gpu.adapters.grads.get(), cpu.adapters.grads
    for name, (off, shape) in cpu.adapters.layout.items():
        size = math.prod(shape)
        errors[name] = rel_err(got[off:off + size], ref[off:off + size])
        report(f"{name:<24} : rel err {errors[name]:.2e}")
    errors["recompute"] = 0.0
    for mode in ("mlp", "products", "layer"):
        gpu.recompute = mode
        gpu.adapters.dropout_key -= 1  # the same masks again
        cross_entropy_backward(gpu, inputs, targets)
        same = bool((gpu.adapters.grads.get() == got).all())
        errors["recompute"] = max(errors["recompute"], 0.0 if same else math.inf)
        report(f"{'--recompute ' + mode:<24} : {'bit-identical gradients' if same else 'DIFFERENT gradients'}")
    return errors


def run_gpu_check(seed=0):
    from nanoeuler.model.cpu.layers import Layers as CPULayers
    from nanoeuler.model.gpu import device_name
    from nanoeuler.model.gpu.layers import Layers as GPULayers

    start = time.time()
    print(f"GPU check on {device_name()}: kernels vs the CPU layers (float64), outputs poisoned with NaN, "
          f"error = ||gpu - cpu|| / ||cpu||")
    rng = np.random.default_rng(seed)
    worst, ok = {}, True
    for precision in ("fp32", "tf32", "bf16"):
        case = _Case(rng, precision)
        gpu_layers, cpu_layers = GPULayers(precision, batch_invariant=True), CPULayers("fp32", batch_invariant=True)
        for check in KERNEL_CHECKS:
            if precision not in check.precisions:
                continue
            for label, err, tol in check(case, gpu_layers, cpu_layers):
                print(f"{label:<64} : rel err {err:.2e}")
                ok &= err <= tol
                worst[precision] = max(worst.get(precision, 0.0), err)
    bounds = {"fp32": FP32_TOL, "tf32": TF32_TOL, "bf16": BF16_MODEL_TOL}
    model_worst = {}
    for precision, what in (("fp32", "FP32 cuBLAS, 3xTF32 attention"), ("tf32", "TF32 tensor cores"),
                            ("bf16", "bf16 activations and weights, float32 master weights and gradients")):
        for cfg in (MODEL_CONFIG, TIED_CONFIG, BIAS_CONFIG):
            heads = (f"K = {cfg.mtp_heads}" + (" tied to the embedding" if cfg.tied else "")
                     + (", q/k/v biases, ids from 280 padding" if cfg.qkv_bias else ""))
            print(f"model in {precision} ({what}) vs CPU engine (float64): dim {cfg.dim}, {cfg.n_layers} layers, "
                  f"{cfg.n_heads}/{cfg.n_kv_heads} q/kv heads (head_dim {cfg.head_dim}), {heads}, B = 3, "
                  f"T = {cfg.context}, some targets -1")
            report = print if precision != "tf32" else (lambda line: None)
            errors = model_check(seed, precision, report=report, cfg=cfg)
            worst_here = max(errors.values())
            model_worst[precision] = max(model_worst.get(precision, 0.0), worst_here)
            if precision == "tf32":
                print(f"{'all tensors':<24} : max rel err {worst_here:.2e}")
            ok &= worst_here < bounds[precision]
        for kind, group, head in (("int8", 32, None), ("int4", 32, None), ("int4", 64, None), ("int4", 32, "int8")):
            print(f"quantized model ({kind}, groups of {group}{f', heads {head} in groups of 32' if head else ''}) in "
                  f"{precision} vs CPU engine (float64) on the same quantized weights")
            worst_here = max(quantized_model_check(seed, kind, group, precision, head=head).values())
            model_worst[precision] = max(model_worst.get(precision, 0.0), worst_here)
            ok &= worst_here < bounds[precision]
    for precision in ("fp32", "bf16"):
        for p in (0.0, 0.25):
            print(f"LoRA in {precision} vs CPU engine (float64): base frozen, rank 8 on q,k,v,o,gate,up,down, "
                  f"dropout {p:g}{' (seeded)' if p else ''}, on the q/k/v-bias model")
            errors = lora_model_check(seed, precision, report=print, dropout=p)
            worst_here = max(errors.values())
            model_worst[precision] = max(model_worst.get(precision, 0.0), worst_here)
            ok &= worst_here < bounds[precision]
        for kind in ("int8", "int4"):
            print(f"QLoRA in {precision} vs CPU engine (float64): the base's matrices {kind} in groups of 32, "
                  f"frozen, rank 8 on q,k,v,o,gate,up,down, dropout 0.25 (seeded)")
            errors = lora_model_check(seed, precision, report=print, cfg=QUANT_CONFIG, dropout=0.25, quant=kind)
            worst_here = max(errors.values())
            model_worst[precision] = max(model_worst.get(precision, 0.0), worst_here)
            ok &= worst_here < bounds[precision]
    print("worst: " + ", ".join(f"{p} kernels {worst[p]:.2e} (bound {TOLERANCE[p]:.1e}), model {model_worst[p]:.2e} "
                                f"(bound {bounds[p]:.1e})" for p in ("fp32", "tf32", "bf16")))
    print(f"{'PASS' if ok else 'FAIL'} ({time.time() - start:.1f} s)")
    return 0 if ok else 1
