"""`nanoeuler check --gpu`: every GPU kernel against the CPU layer it replaces, then the whole model.

Kernels: each GPU layer runs on fresh random inputs, at sizes that are not multiples of the kernels' tiles
or warps, with its outputs poisoned with NaN beforehand (an element the kernel fails to write shows up as
NaN); the reference is the CPU layer in float64. Error = ||gpu - cpu|| / ||cpu||. The GPU runs in float32
accuracy (FP32 cuBLAS, 3xTF32 attention); the TF32 training mode of the matmul and attention is reported
too, against its own, looser bound.

Model: the GPU engine's gradients for every parameter tensor against the CPU engine's (float64) on the same
float32-representable parameters and batch (some targets -1), plus the loss and the KV-cache decode logits.

    nanoeuler check --gpu
"""
import math
import time

import numpy as np

from nanoeuler.config import Config, param_layout

FP32_TOL = 1e-5   # float32 kernels against the float64 reference
TF32_TOL = 5e-3   # TF32 tensor-core mode (10-bit mantissa inputs)
# head_dim 32, GQA 4/2, T = 100 (two attention tiles, the second partial), K = 2 heads
MODEL_CONFIG = Config(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden=352, vocab_size=300, context=100,
                      mtp_heads=2)


def rel_err(gpu, ref):
    gpu = np.asarray(gpu, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if not np.all(np.isfinite(gpu)):
        return math.inf  # NaN poison left behind, or an overflow
    return float(np.linalg.norm(gpu - ref) / max(np.linalg.norm(ref), 1e-300))


class _Case:
    """Random float64 host inputs; `dev` gives float32 device copies, `poisoned` NaN-filled outputs."""

    def __init__(self, rng):
        import cupy
        self.cp, self.rng = cupy, rng

    def normal(self, *shape, scale=1.0):
        return self.rng.normal(0.0, scale, shape)

    def dev(self, a):
        return self.cp.asarray(np.asarray(a, dtype=np.float32))

    def poisoned(self, *shape):
        return self.cp.full(shape, np.nan, dtype=np.float32)


def _f32(a):
    """float64 copy of a's float32 rounding: the CPU reference sees exactly the GPU's inputs."""
    return np.asarray(a, dtype=np.float32).astype(np.float64)


# Each check returns [(label, error, tolerance)]; L = GPU layers, R = CPU layers.
def _both_precisions(case):
    """Run case(tag, tol) at float32 accuracy and in the TF32 training mode."""
    def check(c, L, R):
        out = []
        for enabled, tag, tol in ((False, "", FP32_TOL), (True, " (tf32)", TF32_TOL)):
            with L.tf32(enabled):
                out += case(c, L, R, tag, tol)
        return out
    check.__name__ = case.__name__
    return check


@_both_precisions
def check_matmul(c, L, R, tag, tol):
    N, I, O = 77, 45, 51
    x, w, dout = _f32(c.normal(N, I)), _f32(c.normal(O, I)), _f32(c.normal(N, O))
    base_out, base_dw = _f32(c.normal(N, O)), _f32(c.normal(O, I))
    ref = base_out.copy()
    R.matmul_forward(ref, x, w, accumulate=True)
    g = c.dev(base_out)
    L.matmul_forward(g, c.dev(x), c.dev(w), accumulate=True)
    rdx, rdw = np.empty((N, I)), base_dw.copy()
    R.matmul_backward(rdx, rdw, dout, x, w)
    gdx, gdw = c.poisoned(N, I), c.dev(base_dw)
    L.matmul_backward(gdx, gdw, c.dev(dout), c.dev(x), c.dev(w))
    return [(f"matmul_forward{tag} {N}x{I} @ {O}x{I}.T, +=", rel_err(g.get(), ref), tol),
            (f"matmul_backward{tag} dx", rel_err(gdx.get(), rdx), tol),
            (f"matmul_backward{tag} dw (+=)", rel_err(gdw.get(), rdw), tol)]


def check_embedding(c, L, R):
    V, C, N = 53, 37, 129
    emb, dout = _f32(c.normal(V, C)), _f32(c.normal(N, C))
    tokens = c.rng.integers(0, V, N).astype(np.int32)
    tokens[:9] = 7  # repeated tokens: the backward scatter-add must not lose updates
    ref = np.empty((N, C))
    R.embedding_forward(ref, tokens, emb)
    g = c.poisoned(N, C)
    L.embedding_forward(g, c.cp.asarray(tokens), c.dev(emb))
    base = _f32(c.normal(V, C))
    rdemb = base.copy()
    R.embedding_backward(rdemb, dout, tokens)
    gdemb = c.dev(base)
    L.embedding_backward(gdemb, c.dev(dout), c.cp.asarray(tokens))
    return [(f"embedding_forward V={V} C={C} N={N}", rel_err(g.get(), ref), FP32_TOL),
            ("embedding_backward (+=, repeated tokens)", rel_err(gdemb.get(), rdemb), FP32_TOL)]


def check_rmsnorm(c, L, R):
    N, C = 67, 203
    x, w, dout = _f32(c.normal(N, C, scale=2.0)), _f32(1 + c.normal(C, scale=0.3)), _f32(c.normal(N, C))
    ref, rrstd = np.empty((N, C)), np.empty(N)
    R.rmsnorm_forward(ref, rrstd, x, w, 1e-5)
    g, grstd = c.poisoned(N, C), c.poisoned(N)
    L.rmsnorm_forward(g, grstd, c.dev(x), c.dev(w), 1e-5)
    base_dx, base_dw = _f32(c.normal(N, C)), _f32(c.normal(C))
    rdx, rdw = base_dx.copy(), base_dw.copy()
    R.rmsnorm_backward(rdx, rdw, dout, x, w, rrstd)
    gdx, gdw = c.dev(base_dx), c.dev(base_dw)
    L.rmsnorm_backward(gdx, gdw, c.dev(dout), c.dev(x), c.dev(w), c.dev(rrstd))
    return [(f"rmsnorm_forward N={N} C={C}", rel_err(g.get(), ref), FP32_TOL),
            ("rmsnorm_forward rstd", rel_err(grstd.get(), rrstd), FP32_TOL),
            ("rmsnorm_backward dx (+=)", rel_err(gdx.get(), rdx), FP32_TOL),
            ("rmsnorm_backward dw (+=)", rel_err(gdw.get(), rdw), FP32_TOL)]


def check_rope(c, L, R):
    B, T, H, G, D, pos0 = 3, 37, 6, 2, 64, 5
    cos, sin = R.rope_tables(D, 64, 10000.0, np.float64)
    cos, sin = _f32(cos), _f32(sin)
    out = []
    for name, rfn, gfn in (("rope_forward", R.rope_forward, L.rope_forward),
                           ("rope_backward", R.rope_backward, L.rope_backward)):
        qkv = _f32(c.normal(B, T, H + 2 * G, D))
        ref = qkv.copy()
        rfn(ref, cos, sin, H + G, pos0)
        g = c.dev(qkv)
        gfn(g, c.dev(cos), c.dev(sin), H + G, pos0)
        out.append((f"{name} B={B} T={T} heads {H}+{G}(+{G} v untouched) D={D} pos0={pos0}",
                    rel_err(g.get(), ref), FP32_TOL))
    return out


def _attention_cases():
    # (B, T, H, G, D): T past a tile boundary, GQA group 3, MHA, head_dim 64 and 32, one short of a tile
    return [(2, 77, 6, 2, 64), (1, 130, 4, 4, 32), (2, 63, 4, 2, 32)]


@_both_precisions
def check_attention(c, L, R, tag, tol):
    out = []
    for B, T, H, G, D in _attention_cases():
        NH = H + 2 * G
        qkv = _f32(c.normal(B, T, NH, D))
        ref_o, ref_lse = np.empty((B, T, H, D)), np.empty((B, H, T))
        R.attention_forward(ref_o, ref_lse, qkv, H, G, 0)
        go, glse = c.poisoned(B, T, H, D), c.poisoned(B, H, T)
        gqkv = c.dev(qkv)
        L.attention_forward(go, glse, gqkv, H, G, 0)
        out.append((f"attention_forward{tag} B={B} T={T} H={H} G={G} D={D}", rel_err(go.get(), ref_o), tol))
        out.append((f"attention_forward{tag} lse", rel_err(glse.get(), ref_lse), tol))
        # the backward pass reads the forward's output and lse: give both engines the GPU's
        dout, o32, lse32 = _f32(c.normal(B, T, H, D)), _f32(go.get()), _f32(glse.get())
        ref_d = np.empty_like(qkv)
        R.attention_backward(ref_d, dout, o32, lse32, qkv, H, G)
        gd = c.poisoned(B, T, NH, D)
        L.attention_backward(gd, c.dev(dout), c.dev(o32), c.dev(lse32), gqkv, H, G)
        gd = gd.get()
        for part, sl in (("dq", slice(0, H)), ("dk", slice(H, H + G)), ("dv", slice(H + G, NH))):
            out.append((f"attention_backward{tag} {part}", rel_err(gd[:, :, sl], ref_d[:, :, sl]), tol))
    # decoding: a few new queries at the end of a KV-cache view whose batches sit `ctx` rows apart
    B, ctx, Tk, H, G, D, q_start = 2, 100, 90, 6, 2, 64, 83
    cache = _f32(c.normal(B, ctx, H + 2 * G, D))
    ref_o, ref_lse = np.empty((B, Tk - q_start, H, D)), np.empty((B, H, Tk - q_start))
    R.attention_forward(ref_o, ref_lse, np.ascontiguousarray(cache[:, :Tk]), H, G, q_start)
    go, glse = c.poisoned(B, Tk - q_start, H, D), c.poisoned(B, H, Tk - q_start)
    L.attention_forward(go, glse, c.dev(cache)[:, :Tk], H, G, q_start)
    out.append((f"attention_forward{tag} KV-cache view q_start={q_start} Tk={Tk}", rel_err(go.get(), ref_o), tol))
    return out


def check_swiglu(c, L, R):
    N, F = 71, 93
    gu, dout = _f32(c.normal(N, 2 * F, scale=2.0)), _f32(c.normal(N, F))
    ref = np.empty((N, F))
    R.swiglu_forward(ref, gu)
    g = c.poisoned(N, F)
    L.swiglu_forward(g, c.dev(gu))
    rd = np.empty((N, 2 * F))
    R.swiglu_backward(rd, dout, gu)
    gd = c.poisoned(N, 2 * F)
    L.swiglu_backward(gd, c.dev(dout), c.dev(gu))
    return [(f"swiglu_forward N={N} F={F}", rel_err(g.get(), ref), FP32_TOL),
            ("swiglu_backward", rel_err(gd.get(), rd), FP32_TOL)]


def check_crossentropy(c, L, R):
    N, K, V = 97, 3, 1031
    logits = _f32(c.normal(N, K * V, scale=3.0))
    targets = c.rng.integers(0, V, (K, N)).astype(np.int32)
    targets[:, 5] = -1
    targets[2, 40:50] = -1
    dscale = _f32(c.rng.uniform(0.1, 1.0, K))
    ref_l = np.empty((K, N))
    R.crossentropy_forward(ref_l, logits, targets)
    gl = c.poisoned(K, N)
    L.crossentropy_forward(gl, c.dev(logits), c.cp.asarray(targets))
    ref_l2, ref_d = np.empty((K, N)), logits.copy()
    R.crossentropy_forward_backward(ref_l2, ref_d, targets, dscale)
    gl2, gd = c.poisoned(K, N), c.dev(logits)
    L.crossentropy_forward_backward(gl2, gd, c.cp.asarray(targets), c.dev(dscale))
    return [(f"crossentropy_forward N={N} K={K} V={V}, -1 targets", rel_err(gl.get(), ref_l), FP32_TOL),
            ("crossentropy_forward_backward losses", rel_err(gl2.get(), ref_l2), FP32_TOL),
            ("crossentropy_forward_backward dlogits (in place)", rel_err(gd.get(), ref_d), FP32_TOL)]


def check_adamw(c, L, R):
    # Reference: the CPU layer on float32 buffers, as the CPU engine trains (both do the arithmetic in
    # float64 and round the stored p, m, v to float32); a float64 reference would keep digits that float32
    # parameters cannot hold, next to a step a thousand times smaller than the parameters.
    n = 100_003
    f32 = lambda a: np.asarray(a, dtype=np.float32)
    p, gr = f32(c.normal(n)), f32(c.normal(n))
    m, v = f32(c.normal(n, scale=0.1)), f32(np.abs(c.normal(n, scale=0.1)))
    mask = f32(c.rng.random(n) < 0.9)
    args = (3e-3, 0.9, 0.95, 1e-8, 0.1, 0.7, 5)
    rp, rm, rv = p.copy(), m.copy(), v.copy()
    R.adamw_update(rp, gr, rm, rv, mask, *args)
    gp, gm, gv = c.dev(p), c.dev(m), c.dev(v)
    L.adamw_update(gp, c.dev(gr), gm, gv, c.dev(mask), *args)
    step = lambda new: new.astype(np.float64) - p  # compare the step itself, not the parameters
    gr64 = gr.astype(np.float64)
    return [(f"adamw_update n={n} (parameter step)", rel_err(step(gp.get()), step(rp)), FP32_TOL),
            ("adamw_update moments m, v", max(rel_err(gm.get(), rm), rel_err(gv.get(), rv)), FP32_TOL),
            ("sum_squares", abs(L.sum_squares(c.dev(gr)) - R.sum_squares(gr64)) / R.sum_squares(gr64), FP32_TOL)]


KERNEL_CHECKS = [check_matmul, check_embedding, check_rmsnorm, check_rope, check_attention, check_swiglu,
                 check_crossentropy, check_adamw]


def _engines(seed, cfg):
    """A CPU engine (float64) and a GPU engine on the same float32-representable random parameters, and a
    batch with some -1 targets."""
    from nanoeuler.check import random_problem
    from nanoeuler.model import make_engine

    flat, inputs, targets = random_problem(cfg, np.random.default_rng(seed), batch=3, scale=0.05)
    cpu, gpu = make_engine(cfg, device="cpu", dtype=np.float64), make_engine(cfg, device="gpu")
    cpu.load_params(_f32(flat))
    gpu.load_params(_f32(flat))
    return cpu, gpu, inputs, targets


def _grad_errors(cpu, gpu, cfg):
    got = gpu.grads.get()
    layout, _ = param_layout(cfg)
    return {name: rel_err(got[off:off + math.prod(shape)], cpu.grads[off:off + math.prod(shape)])
            for name, (off, shape) in layout.items()}


def model_check(seed, report=print, cfg=MODEL_CONFIG):
    """GPU engine (float32 accuracy) vs CPU engine (float64): {tensor: error}, plus the loss and the KV-cache
    decode logits."""
    from nanoeuler.gpu import layers as L

    cpu, gpu, inputs, targets = _engines(seed, cfg)
    cpu_loss = cpu.forward_backward(inputs, targets)[0]
    logits = []
    with L.tf32(False):
        gpu_loss = gpu.forward_backward(inputs, targets)[0]
        for eng in (cpu, gpu):  # a prompt, then single tokens
            cache = eng.new_cache(batch=2)
            steps = [eng.decode(cache, inputs[:2, :37])]
            steps += [eng.decode(cache, inputs[:2, 37 + i:38 + i]) for i in range(3)]
            logits.append(np.stack(steps))
    errors = {"loss": abs(gpu_loss - cpu_loss) / abs(cpu_loss)}
    report(f"{'loss':<24} : rel err {errors['loss']:.2e}  (cpu {cpu_loss:.8f}, gpu {gpu_loss:.8f})")
    for name, err in _grad_errors(cpu, gpu, cfg).items():
        errors[name] = err
        report(f"{name:<24} : rel err {err:.2e}")
    errors["decode logits"] = rel_err(logits[1], logits[0])
    report(f"{'decode logits (KV cache)':<24} : rel err {errors['decode logits']:.2e}")
    return errors


def tf32_model_error(seed, cfg=MODEL_CONFIG):
    """Largest per-tensor gradient error of the GPU engine in its TF32 training mode (vs float64 CPU)."""
    from nanoeuler.gpu import layers as L

    cpu, gpu, inputs, targets = _engines(seed, cfg)
    cpu.forward_backward(inputs, targets)
    with L.tf32(True):
        gpu.forward_backward(inputs, targets)
    return max(_grad_errors(cpu, gpu, cfg).values())


def run_gpu_check(seed=0):
    from nanoeuler.cpu import layers as R
    from nanoeuler.gpu import device_name, layers as L

    start = time.time()
    print(f"GPU check on {device_name()}: kernels vs the CPU layers (float64), outputs poisoned with NaN, "
          f"error = ||gpu - cpu|| / ||cpu||")
    rng = np.random.default_rng(seed)
    c = _Case(rng)
    worst_fp32, worst_tf32, ok = 0.0, 0.0, True
    for check in KERNEL_CHECKS:
        for label, err, tol in check(c, L, R):
            print(f"{label:<60} : rel err {err:.2e}")
            ok &= err < tol
            if tol == FP32_TOL:
                worst_fp32 = max(worst_fp32, err)
            else:
                worst_tf32 = max(worst_tf32, err)
    cfg = MODEL_CONFIG
    print(f"model: GPU engine (FP32 cuBLAS, 3xTF32 attention) vs CPU engine (float64): dim {cfg.dim}, "
          f"{cfg.n_layers} layers, {cfg.n_heads}/{cfg.n_kv_heads} q/kv heads (head_dim {cfg.head_dim}), "
          f"K = {cfg.mtp_heads}, B = 3, T = {cfg.context}, some targets -1")
    errors = model_check(seed)
    worst_model = max(errors.values())
    tf32_model = tf32_model_error(seed)
    print(f"{'gradients in TF32 training mode':<24} : max rel err {tf32_model:.2e} (bound {TF32_TOL:.0e})")
    worst = max(worst_fp32, worst_model)
    print(f"max relative error: {worst:.2e}")
    ok &= worst_model < FP32_TOL and tf32_model < TF32_TOL
    print(f"{'PASS' if ok else 'FAIL'} (float32 bound {FP32_TOL:.0e}, TF32 bound {TF32_TOL:.0e}; worst TF32 kernel "
          f"{worst_tf32:.2e}; {time.time() - start:.1f} s)")
    return 0 if ok else 1
