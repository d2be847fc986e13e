"""The CPU engine against finite differences (float64): each layer on its own, then the whole model; and
against PyTorch autograd (benchmarks/reference.py), where PyTorch is installed."""
import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

from nanoeuler.check.gradients import CHECK_CONFIGS, gradient_check
from nanoeuler.model.config import PRESETS, Config, param_count, param_layout, rope_tables, views
from nanoeuler.model.cpu.layers import Layers
from nanoeuler.model.engine import make_engine, to_numpy
from nanoeuler.model.optimizer import AdamW
from nanoeuler.model.losses import cross_entropy_backward
from nanoeuler.check.problems import random_problem, relative_error

rng = np.random.default_rng(1234)
cpu_layers = Layers("fp32", batch_invariant=True)  # the CPU engine's layers, as make_engine makes them


def numeric_grad(loss, x, h=1e-4):
    """Central differences of the scalar loss() with respect to every entry of x (modified in place)."""
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + h
        up = loss()
        flat[i] = old - h
        down = loss()
        flat[i] = old
        gflat[i] = (up - down) / (2 * h)
    return g


def assert_close(analytic, numeric, tol=1e-7):
    err = np.linalg.norm(analytic - numeric) / max(np.linalg.norm(numeric), 1e-300)
    assert err < tol, err


def test_matmul_backward():
    x, w = rng.normal(size=(5, 7)), rng.normal(size=(3, 7))
    upstream = rng.normal(size=(5, 3))
    out = np.empty((5, 3))

    def loss():
        cpu_layers.matmul_forward(out, x, w)
        return float((out * upstream).sum())

    dx, dw = np.empty_like(x), np.full_like(w, 0.5)  # weight gradients accumulate onto what is there
    cpu_layers.matmul_backward(dx, dw, upstream, x, w)
    assert_close(dx, numeric_grad(loss, x))
    assert_close(dw - 0.5, numeric_grad(loss, w))


def test_embedding_backward():
    emb = rng.normal(size=(11, 6))
    tokens = np.array([3, 1, 3, 10, 0, 3], dtype=np.int32)
    upstream = rng.normal(size=(6, 6))
    out = np.empty((6, 6))

    def loss():
        cpu_layers.embedding_forward(out, tokens, emb)
        return float((out * upstream).sum())

    demb = np.zeros_like(emb)
    cpu_layers.embedding_backward(demb, upstream, tokens)
    assert_close(demb, numeric_grad(loss, emb))


def test_rmsnorm_backward():
    N, C = 6, 13
    x, w = rng.normal(size=(N, C)), rng.normal(1, 0.3, size=C)
    upstream = rng.normal(size=(N, C))
    out, rstd = np.empty((N, C)), np.empty(N)

    def loss():
        cpu_layers.rmsnorm_forward(out, rstd, x, w, 1e-5)
        return float((out * upstream).sum())

    loss()
    ref = x / np.sqrt((x ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
    assert np.allclose(out, ref)
    dx, dw = np.ones((N, C)), np.zeros(C)  # the input gradient accumulates into the residual's
    cpu_layers.rmsnorm_backward(dx, dw, upstream, x, w, rstd)
    assert_close(dx - 1, numeric_grad(loss, x))
    assert_close(dw, numeric_grad(loss, w))


def test_rope_matches_rotate_half_and_backward():
    B, T, heads, D = 2, 5, 3, 8
    cos, sin = rope_tables(D, 16, 10000.0, np.float64)
    x = rng.normal(size=(B, T, heads, D))
    y = x.copy()
    at3 = np.array([3], dtype=np.int32)  # positions come as a one-element array (the GPU reads it on the device)
    cpu_layers.rope_forward(y, cos, sin, 2, at3)  # rotate the first 2 heads, positions 3..7
    # Hugging Face Llama: q * cos + rotate_half(q) * sin, with cos/sin repeated over both halves
    pos = np.arange(3, 3 + T)
    ang = pos[:, None] * 10000.0 ** (-np.arange(0, D, 2) / D)[None, :]
    cos_ref, sin_ref = np.cos(np.concatenate([ang, ang], 1)), np.sin(np.concatenate([ang, ang], 1))
    rot = np.concatenate([-x[..., D // 2:], x[..., :D // 2]], -1)
    ref = x * cos_ref[None, :, None, :] + rot * sin_ref[None, :, None, :]
    assert np.allclose(y[:, :, :2], ref[:, :, :2])
    assert np.array_equal(y[:, :, 2], x[:, :, 2])
    upstream = rng.normal(size=x.shape)

    def loss():
        z = x.copy()
        cpu_layers.rope_forward(z, cos, sin, 2, at3)
        return float((z * upstream).sum())

    d = upstream.copy()
    cpu_layers.rope_backward(d, cos, sin, 2, at3)
    assert_close(d, numeric_grad(loss, x))


def naive_attention(qkv, H, G, q_start=0):
    B, Tk, _, D = qkv.shape
    q, k, v = qkv[:, q_start:, :H], qkv[:, :, H:H + G], qkv[:, :, H + G:]
    k, v = np.repeat(k, H // G, axis=2), np.repeat(v, H // G, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(D)
    qi = np.arange(q_start, Tk)[:, None]
    s = np.where(np.arange(Tk)[None, :] <= qi, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhij,bjhd->bihd", p, v)


@pytest.mark.parametrize("H,G", [(4, 2), (4, 1), (4, 4)])
def test_attention_forward_backward(H, G):
    B, T, D = 2, 7, 6
    qkv = rng.normal(size=(B, T, H + 2 * G, D))
    out, lse = np.empty((B, T, H, D)), np.empty((B, H, T))
    cpu_layers.attention_forward(out, lse, qkv, H, G)
    assert np.allclose(out, naive_attention(qkv, H, G))
    upstream = rng.normal(size=out.shape)

    def loss():
        cpu_layers.attention_forward(out, lse, qkv, H, G)
        return float((out * upstream).sum())

    dqkv = np.full_like(qkv, np.nan)  # every entry must be written
    loss()
    cpu_layers.attention_backward(dqkv, upstream, out.copy(), lse.copy(), qkv, H, G)
    assert_close(dqkv, numeric_grad(loss, qkv))


@pytest.mark.parametrize("T,H,G,D", [(37, 6, 2, 32), (128, 4, 2, 32), (20, 3, 1, 10)])
def test_attention_float32_matches_float64(T, H, G, D):
    """The float32 path (vectorised loops, blocks of 4 keys/dims with tails) against the float64 one,
    which the finite-difference test above checks; outputs poisoned with NaN so every entry must be written."""
    B = 2
    qkv = rng.normal(size=(B, T, H + 2 * G, D))
    dout = rng.normal(size=(B, T, H, D))
    results = {}
    for dt in (np.float64, np.float32):
        out, lse = np.full((B, T, H, D), np.nan, dt), np.full((B, H, T), np.nan, dt)
        cpu_layers.attention_forward(out, lse, qkv.astype(dt), H, G)
        dqkv = np.full(qkv.shape, np.nan, dt)
        cpu_layers.attention_backward(dqkv, dout.astype(dt), out, lse, qkv.astype(dt), H, G)
        results[dt] = (out, lse, dqkv)
    assert np.allclose(results[np.float64][0], naive_attention(qkv, H, G))
    for ref, got in zip(results[np.float64], results[np.float32]):
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5


def test_attention_over_the_kv_cache_matches_full():
    """Decoding in chunks (6 rows, then 1, then 2) through the cache (k and v only) gives the full forward's
    rows (of qkv rotated by the product before it); the cache holds exactly the rotated k heads and the v
    heads, and nothing past the position is touched."""
    B, T, H, G, D, S = 2, 9, 4, 2, 8, 12
    cos, sin = rope_tables(D, S, 10000.0, np.float64)
    qkv = rng.normal(size=(B, T, H + 2 * G, D))
    rotated = qkv.copy()
    cpu_layers.rope_forward(rotated, cos, sin, H + G, np.zeros(1, dtype=np.int32))
    full, lse = np.empty((B, T, H, D)), np.empty((B, H, T))
    cpu_layers.attention_forward(full, lse, rotated, H, G)
    cache = np.full((B, S, 2 * G, D), np.nan)
    pos = np.zeros(1, dtype=np.int32)
    for lo, hi in ((0, 6), (6, 7), (7, 9)):
        out, lse_c = np.full((B, hi - lo, H, D), np.nan), np.full((B, H, hi - lo), np.nan)
        cpu_layers.attention_cached(out, lse_c, rotated[:, lo:hi].copy(), cache, H, G, pos)
        assert np.allclose(out, full[:, lo:hi]) and np.allclose(lse_c, lse[:, :, lo:hi])
        cpu_layers.advance_position(pos, hi - lo)
    assert pos[0] == T
    assert np.allclose(cache[:, :T], rotated[:, :, H:]) and np.isnan(cache[:, T:]).all()


def test_argmax_logs_at_the_position_and_moves_it_on():
    """A greedy step's end: argmax's ids (the first of equal ones) logged at the position, which then moves on by
    `advance` (advance_position's work; 0 leaves it)."""
    logits = rng.normal(size=(3, 11))
    logits[1, [2, 7]] = logits[1].max() + 1
    ids, log, pos = np.empty(3, np.int32), np.full((9, 3), -1, np.int32), np.full(1, 2, np.int32)
    for advance, at in ((3, 2), (0, 5), (2, 5)):
        cpu_layers.argmax(ids, logits, log, pos, advance)
        assert ids.tolist() == logits.argmax(axis=1).tolist() and ids[1] == 2 and log[at].tolist() == ids.tolist()
    assert pos[0] == 7 and (log[[0, 1, 3, 4, 6, 7, 8]] == -1).all()


def test_normed_product_is_the_layers_in_turn():
    """rmsnorm_matmul_forward (one GPU kernel for decoding's few rows) is RMSNorm, then the product."""
    N, C, O = 3, 10, 7
    x, g, w = rng.normal(size=(N, C)), rng.normal(size=C), rng.normal(size=(O, C))
    out, rstd, xn = np.empty((N, O)), np.empty(N), np.empty((N, C))
    cpu_layers.rmsnorm_matmul_forward(out, rstd, x, g, w, 1e-5, xn)
    ref_xn, ref_rstd = np.empty((N, C)), np.empty(N)
    cpu_layers.rmsnorm_forward(ref_xn, ref_rstd, x, g, 1e-5)
    assert np.allclose(out, ref_xn @ w.T) and np.allclose(rstd, ref_rstd) and np.allclose(xn, ref_xn)


def test_swiglu_backward():
    N, F = 5, 9
    gu = rng.normal(size=(N, 2 * F)) * 2
    upstream = rng.normal(size=(N, F))
    out = np.empty((N, F))

    def loss():
        cpu_layers.swiglu_forward(out, gu)
        return float((out * upstream).sum())

    loss()
    g, u = gu[:, :F], gu[:, F:]
    assert np.allclose(out, g / (1 + np.exp(-g)) * u)
    d = np.empty_like(gu)
    cpu_layers.swiglu_backward(d, upstream, gu)
    assert_close(d, numeric_grad(loss, gu))


def test_crossentropy_forward_backward():
    K, N, V = 3, 6, 10
    logits = rng.normal(size=(N, K * V)) * 3
    targets = rng.integers(0, V, (K, N)).astype(np.int32)
    targets[0, 2] = targets[2, 5] = -1
    dscale = rng.uniform(-2, 2, (K, N))  # one scale per head and row, of either sign (DPO's weights)
    losses = np.empty((K, N))

    def loss():
        cpu_layers.crossentropy_forward(losses, logits, targets)
        return float((losses * dscale).sum())

    loss()
    for k in range(K):
        z = logits[:, k * V:(k + 1) * V]
        ref = np.log(np.exp(z).sum(1)) - z[np.arange(N), np.maximum(targets[k], 0)]
        assert np.allclose(losses[k], np.where(targets[k] >= 0, ref, 0.0))
    d = logits.copy()
    cpu_layers.crossentropy_forward_backward(np.empty((K, N)), d, targets, dscale)
    assert_close(d, numeric_grad(loss, logits))
    assert not d[2, :V].any() and not d[5, 2 * V:].any()


# the models of `nanoeuler check`: K = 1 (the shipped `small`), K = 2 (multi-token heads), K = 1 tied (an import's)
by_heads = pytest.mark.parametrize("cfg", CHECK_CONFIGS, ids=lambda cfg: f"K{cfg.mtp_heads}" + "-tied" * cfg.tied)


@by_heads
def test_whole_model_gradient_check(cfg):
    errors = gradient_check(cfg, samples=3, seed=7, report=lambda line: None)
    assert len(errors) == len(param_layout(cfg)[0])
    assert max(errors.values()) < 1e-6, errors


@by_heads
@pytest.mark.parametrize("n_kv_heads", [1, 4])
def test_gqa_extremes_gradient_check(cfg, n_kv_heads):
    cfg = dataclasses.replace(cfg, n_layers=2, n_kv_heads=n_kv_heads)
    errors = gradient_check(cfg, samples=3, seed=3, report=lambda line: None)
    assert max(errors.values()) < 1e-6, errors


def test_gradient_check_detects_a_wrong_backward(monkeypatch):
    """The check must be able to fail: break SwiGLU's backward slightly and it has to notice."""
    broken = cpu_layers.swiglu_backward

    def wrong(dgate_up, dout, gate_up):
        broken(dgate_up, dout, gate_up)
        dgate_up *= 1.001

    monkeypatch.setattr(Layers, "swiglu_backward", staticmethod(wrong))  # in every engine's layers
    errors = gradient_check(CHECK_CONFIGS[1], samples=2, seed=5, report=lambda line: None)
    assert errors["layers.0.w_gate"] > 1e-4 and errors["final_norm"] < 1e-6


def engine_with_problem(cfg=CHECK_CONFIGS[1], dtype=np.float64, seed=11):
    eng = make_engine(cfg, dtype=dtype)
    flat, inputs, targets = random_problem(cfg, np.random.default_rng(seed))
    eng.load_params(flat)
    return eng, inputs, targets


@by_heads
def test_masked_position_changes_no_gradient(cfg):
    eng, inputs, targets = engine_with_problem(cfg)
    T = inputs.shape[1]
    targets[:, :, -1] = -1  # the last position is masked in every head
    cross_entropy_backward(eng, inputs, targets)
    base = eng.grads.copy()
    # ... so the token there, and the value of its logits, cannot matter
    changed = inputs.copy()
    changed[:, -1] = (changed[:, -1] + 1) % cfg.vocab_size
    cross_entropy_backward(eng, changed, targets)
    assert np.allclose(eng.grads, base, rtol=0, atol=1e-14)
    # and the causal model on the sequence without it gives the same loss and gradients
    loss = cross_entropy_backward(eng, inputs, targets)
    short = cross_entropy_backward(eng, inputs[:, :T - 1], targets[:, :, :T - 1])
    assert np.allclose(loss, short, rtol=1e-13)
    assert np.allclose(eng.grads, base, rtol=0, atol=1e-14)


@by_heads
def test_float32_matches_float64_loss(cfg):
    eng64, inputs, targets = engine_with_problem(cfg)
    eng32, _, _ = engine_with_problem(cfg, dtype=np.float32)
    loss64 = cross_entropy_backward(eng64, inputs, targets)
    loss32 = cross_entropy_backward(eng32, inputs, targets)
    assert np.allclose(loss32, loss64, rtol=1e-5)
    assert relative_error(eng32.grads.astype(np.float64), eng64.grads).mean() < 1e-3
    assert np.linalg.norm(eng32.grads - eng64.grads) / np.linalg.norm(eng64.grads) < 1e-4


def in_pieces(eng, rows=7):
    """Set eng to compute its logits a piece of at most `rows` rows at a time (a short last piece where the
    rows do not divide N)."""
    eng.logits_bytes = rows * eng.cfg.mtp_heads * eng.cfg.vocab_size * eng.act.itemsize
    return eng


@by_heads
def test_logits_in_pieces_give_the_whole_logits_losses_and_gradients(cfg):
    """The heads, the cross-entropy and the gradient through the heads a piece of rows at a time: the losses and
    logits of the one product, the gradients to rounding (the heads' gradient is a sum over the pieces); only a
    piece's logits are held; forward() then backward() (DPO's way: the logits made again) gives the same."""
    whole, inputs, targets = engine_with_problem(cfg)
    pieces = in_pieces(engine_with_problem(cfg)[0])
    losses = cross_entropy_backward(whole, inputs, targets)
    assert np.allclose(cross_entropy_backward(pieces, inputs, targets), losses, rtol=1e-13, atol=0)
    assert pieces._acts["logits"].shape[0] == 7 < inputs.size
    assert np.allclose(pieces.grads, whole.grads, rtol=1e-12, atol=1e-15)
    assert np.array_equal(pieces.logits(inputs), whole.logits(inputs))
    first = pieces.grads.copy()
    weights = np.random.default_rng(0).random((cfg.mtp_heads, inputs.size))
    got = to_numpy(pieces.forward(inputs, targets))
    pieces.backward(weights)
    assert np.array_equal(to_numpy(whole.forward(inputs, targets)), got)
    whole.backward(weights)
    assert np.allclose(pieces.grads, whole.grads, rtol=1e-12, atol=1e-15) and not np.allclose(pieces.grads, first)


@pytest.mark.parametrize("cfg", CHECK_CONFIGS[1:3], ids=["K2", "K1-tied"])
def test_gradient_check_with_logits_in_pieces(cfg, monkeypatch):
    from nanoeuler.model import engine
    monkeypatch.setattr(engine, "LOGITS_BYTES", 5 * cfg.mtp_heads * cfg.vocab_size * 8)  # float64: 5 rows a piece
    errors = gradient_check(cfg, samples=3, seed=7, report=lambda line: None)
    assert max(errors.values()) < 1e-6, errors


def test_adamw_step_matches_formula():
    cfg = CHECK_CONFIGS[1]
    eng, inputs, targets = engine_with_problem(cfg)
    cross_entropy_backward(eng, inputs, targets)
    p0, g = eng.params.copy(), eng.grads.copy()
    norm = AdamW(eng).step(eng, lr=1e-2, weight_decay=0.1, grad_clip=0.5)
    assert np.isclose(norm, np.linalg.norm(g))
    g = g * min(1.0, 0.5 / (norm + 1e-6))
    m, v = 0.1 * g, 0.05 * g * g
    update = (m / 0.1) / (np.sqrt(v / 0.05) + 1e-8)
    decay = np.array([0.0 if n.endswith("norm") else 1.0 for n, (o, s) in param_layout(cfg)[0].items()
                      for _ in range(int(np.prod(s)))])
    assert np.allclose(eng.params, p0 - 1e-2 * (update + 0.1 * decay * p0))


def test_presets_parameter_counts():
    assert param_count(PRESETS["small"]) == 1_115_264
    assert param_count(PRESETS["big"]) == 14_160_768
    assert param_count(PRESETS["base"]) == 116_417_280
    with pytest.raises(ValueError):
        Config(dim=30, n_heads=4)


@by_heads
def test_engine_matches_pytorch_reference(cfg):
    """The CPU engine (float64) against autograd: the PyTorch model that the benchmarks time ours against
    (benchmarks/reference.py) gives the same losses and gradients. PyTorch is in the test extra ('.[test]')."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from reference import Reference
    finally:
        sys.path.pop(0)
    eng, inputs, targets = engine_with_problem(cfg)
    loss, loss0 = cross_entropy_backward(eng, inputs, targets)
    for gqa, split in (("native", False), ("repeat", True)):
        model = Reference(cfg, eng.params, dtype=torch.float64, gqa=gqa, split_matmuls=split)
        ref, ref0 = model(torch.from_numpy(inputs).long(), torch.from_numpy(targets).long())
        ref.backward()
        assert np.isclose(ref.item(), loss, rtol=1e-12) and np.isclose(ref0.item(), loss0, rtol=1e-12)
        ours = views(eng.grads, cfg)
        for name, grad in model.named_tensors(grad=True).items():
            assert np.linalg.norm(grad - ours[name]) <= 1e-12 * np.linalg.norm(ours[name]), name
