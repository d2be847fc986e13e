"""LoRA in the engine (model/lora.py): adapter gradients against finite differences with dropout off and on,
a frozen base, the untrained adapter as the identity, merging, decoding with adapters, and --recompute's
gradients equal to the stored path's bit for bit."""
import numpy as np
import pytest

from nanoeuler.check.gradients import CHECK_CONFIGS, LORA_CONFIGS, lora_gradient_check, lora_problem
from nanoeuler.check.problems import random_problem
from nanoeuler.errors import UserError
from nanoeuler.model import lora
from nanoeuler.model.cpu.layers import Layers
from nanoeuler.model.engine import make_engine
from nanoeuler.model.losses import cross_entropy, cross_entropy_backward


@pytest.mark.parametrize("cfg", LORA_CONFIGS, ids=["K1", "tied-bias"])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_adapter_gradients_match_finite_differences(cfg, dropout):
    errors = lora_gradient_check(cfg, samples=2, seed=3, dropout=dropout, report=lambda line: None)
    assert len(errors) == 2 * 7 * cfg.n_layers
    assert max(errors.values()) < 1e-6, max(errors.items(), key=lambda kv: kv[1])


def test_each_backward_pass_draws_new_masks():
    cfg = CHECK_CONFIGS[0]
    eng, ad, _, inputs, targets = lora_problem(cfg, np.random.default_rng(0), 0.25)
    cross_entropy_backward(eng, inputs, targets)
    assert ad.dropout_key == 8
    first = ad.grads.copy()
    cross_entropy_backward(eng, inputs, targets)
    assert not np.array_equal(ad.grads, first)


def test_dropout_changes_the_loss_and_its_mask_follows_the_key():
    cfg = CHECK_CONFIGS[0]
    eng, ad, _, inputs, targets = lora_problem(cfg, np.random.default_rng(0), 0.25)
    with_key = lambda key: (setattr(ad, "dropout_key", key), cross_entropy(eng, inputs, targets)[0])[1]
    assert with_key(7) == with_key(7) != with_key(8)
    ad.dropout_on = False  # evaluation: no dropout, whatever the key
    assert with_key(7) == with_key(8)


def test_dropout_mask_rate_and_scale():
    layers = Layers("fp32", True)
    x = np.ones((64, 1000), dtype=np.float32)
    out = np.empty_like(x)
    layers.dropout_forward(out, x, 0.3, 12345, False)
    kept = out != 0
    assert abs(kept.mean() - 0.7) < 0.01
    assert np.all(out[kept] == np.float32(1 / 0.7))
    again = np.full_like(x, 2.0)
    layers.dropout_forward(again, x, 0.3, 12345, True)  # the same mask, added
    assert np.array_equal(again, out + 2.0)


def test_frozen_base_and_adapter_identity():
    """Fresh adapters (B = 0) leave the logits as they are; the base engine has no gradient buffer, and the
    gradient of a fresh A is exactly zero (it is multiplied by B) while B's is not."""
    cfg = CHECK_CONFIGS[3]
    rng = np.random.default_rng(1)
    eng = make_engine(cfg, "cpu", dtype=np.float64, training=False)
    flat, inputs, targets = random_problem(cfg, rng)
    eng.load_params(flat)
    before = eng.logits(inputs)
    ad = lora.attach(eng, lora.make_spec(cfg, 2))
    assert np.array_equal(eng.logits(inputs), before)
    cross_entropy_backward(eng, inputs, targets)
    assert eng.grads is None
    v = ad._views(ad.grads)
    assert all(not v[n].any() for n in v if n.endswith("lora_a"))
    assert all(v[n].any() for n in v if n.endswith("lora_b"))
    ad.enabled = False
    with pytest.raises(ValueError):
        cross_entropy_backward(eng, inputs, targets)  # nothing to train


@pytest.mark.parametrize("targets", [lora.TARGETS, ("q", "v"), ("down",)])
def test_merged_weights_give_the_adapted_logits(targets):
    cfg = CHECK_CONFIGS[3]
    eng, ad, values, inputs, _ = lora_problem(cfg, np.random.default_rng(2), 0.0)
    if targets != lora.TARGETS:
        base = eng.params.copy()
        ad = lora.attach(eng, lora.make_spec(cfg, 4, 8.0, 0.0, targets))
        values = np.random.default_rng(3).normal(0, 0.1, ad.size)
        ad.load(values)
    else:
        base = eng.params.copy()
    adapted = eng.logits(inputs)
    ad.enabled = False
    assert not np.allclose(eng.logits(inputs), adapted)  # the adapters change the model
    merged = make_engine(cfg, "cpu", dtype=np.float64, training=False)
    merged.load_params(lora.merge(cfg, base, ad.spec, values))
    assert np.allclose(merged.logits(inputs), adapted, rtol=0, atol=1e-5)  # merge rounds to float32


def test_decoding_reads_the_adapters():
    """Greedy generation with live adapters (the KV-cache path) picks what the merged model picks."""
    from nanoeuler.infer.generate import generate
    cfg = CHECK_CONFIGS[0]
    rng = np.random.default_rng(4)
    flat, inputs, _ = random_problem(cfg, rng)
    eng = make_engine(cfg, "cpu", training=False)
    eng.load_params(flat)
    spec = lora.make_spec(cfg, 4, 8.0, 0.25)
    values = rng.normal(0, 0.3, lora.adapter_layout(cfg, spec)[1])
    lora.attach(eng, spec, values)
    merged = make_engine(cfg, "cpu", training=False)
    merged.load_params(lora.merge(cfg, flat, spec, values))
    prompt = list(inputs[0, :5])
    live = list(generate(eng, prompt, 12, temperature=0))
    assert live == list(generate(merged, prompt, 12, temperature=0))
    eng.adapters.enabled = False
    assert live != list(generate(eng, prompt, 12, temperature=0))


def logits_in_pieces(eng, rows=5):
    """eng's logits computed a piece of at most `rows` rows at a time (Engine._logit_rows)."""
    eng.logits_bytes = rows * eng.cfg.mtp_heads * eng.cfg.vocab_size * eng.act.itemsize


def assert_recomputed(eng, mode):
    """eng's activations as mode keeps them: the recomputed kinds one buffer for every layer, the rest a layer each."""
    acts, n = eng._acts, eng.cfg.n_layers
    assert acts["recompute"] == mode
    for name in ("resid_mid", "xn1", "xn2", "rstd1", "rstd2", "qkv", "att", "lse", "gate_up", "sw"):
        kept = {"layer": (), "products": ("att", "lse"), "mlp": ("resid_mid", "qkv", "att", "lse")}[mode]
        shared = name not in kept
        assert (all(a is acts[name][0] for a in acts[name]) if shared else acts[name].shape[0] == n), name
        assert len(acts[name]) == n


@pytest.mark.parametrize("pieces", [False, True], ids=["whole-logits", "logits-in-pieces"])
@pytest.mark.parametrize("with_adapters", [False, True])
@pytest.mark.parametrize("mode", ["layer", "products", "mlp"])
def test_recompute_gradients_are_bit_identical(with_adapters, pieces, mode):
    """Every recompute mode (the layer but its down product; the same but the attention, its output kept; the
    norms and gate|up with SwiGLU alone, the attention's results kept), a full model or adapters with dropout,
    the logits whole or in pieces: the stored path's bits."""
    cfg = CHECK_CONFIGS[1] if not with_adapters else CHECK_CONFIGS[3]
    rng = np.random.default_rng(5)
    flat, inputs, targets = random_problem(cfg, rng)
    eng = make_engine(cfg, "cpu", training=not with_adapters)
    eng.load_params(flat)
    if pieces:
        logits_in_pieces(eng)
    if with_adapters:
        ad = lora.attach(eng, lora.make_spec(cfg, 4, 8.0, 0.25))
        ad.load(rng.normal(0, 0.1, ad.size))
    grads = lambda: (eng.adapters.grads if with_adapters else eng.grads).copy()
    losses = cross_entropy_backward(eng, inputs, targets)
    stored = grads()
    eng.recompute = mode
    if with_adapters:
        eng.adapters.dropout_key -= 1  # each backward pass moves the key on: the same masks again
    assert cross_entropy_backward(eng, inputs, targets) == losses
    assert np.array_equal(grads(), stored)
    assert_recomputed(eng, mode)


def test_grouped_adapters_equal_one_target_at_a_time(monkeypatch):
    """Without dropout the targets sharing an input (q|k|v, gate|up) take one stacked x A^T and one dA and dx
    product (lora_forward_group, lora_backward_group): the gradients of one target at a time up to float64
    rounding, and every --recompute mode's bits equal the stored path's (products and mlp add the updates
    again from the x A^T kept a layer each: no x given)."""
    cfg = CHECK_CONFIGS[3]
    rng = np.random.default_rng(6)
    flat, inputs, targets = random_problem(cfg, rng)
    eng = make_engine(cfg, "cpu", dtype=np.float64, training=False)
    eng.load_params(flat)
    ad = lora.attach(eng, lora.make_spec(cfg, 4, 8.0))
    ad.load(rng.normal(0, 0.1, ad.size))
    calls = []
    for name in ("lora_forward_group", "lora_backward_group"):
        layer = getattr(eng.layers, name)
        monkeypatch.setattr(eng.layers, name, lambda *a, layer=layer, name=name: (
            calls.append(name if a[-4] is not None else name + " kept"), layer(*a)))
    losses = cross_entropy_backward(eng, inputs, targets)
    grouped = ad.grads.copy()
    # q|k|v and gate|up a layer, forward and backward
    assert calls.count("lora_forward_group") == calls.count("lora_backward_group") == 2 * cfg.n_layers
    for mode, kept in (("layer", 0), ("products", 2), ("mlp", 1)):  # groups a layer whose x A^T is kept
        eng.recompute = mode
        calls.clear()
        assert cross_entropy_backward(eng, inputs, targets) == losses
        assert np.array_equal(ad.grads, grouped), mode
        assert calls.count("lora_forward_group kept") == kept * cfg.n_layers, mode
    eng.recompute = False
    monkeypatch.setattr(ad, "_grouped", lambda ts, dropout: None)  # one target at a time
    assert np.allclose(cross_entropy_backward(eng, inputs, targets), losses, rtol=1e-12, atol=0)
    assert np.allclose(ad.grads, grouped, rtol=1e-9, atol=1e-12)


def test_bare_recompute_keeps_the_attention_where_it_fits(monkeypatch):
    """recompute True (the bare --recompute): "mlp" where all its activations fit the free memory with
    AUTO_RESERVE to spare, else "products" where its do, else "layer"; each gives the stored path's bits."""
    from nanoeuler.model import engine
    cfg = CHECK_CONFIGS[3]
    rng = np.random.default_rng(6)
    flat, inputs, targets = random_problem(cfg, rng)
    eng = make_engine(cfg, "cpu")
    eng.load_params(flat)
    cross_entropy_backward(eng, inputs, targets)
    stored = eng.grads.copy()
    B, T = inputs.shape
    need = {mode: engine.activation_bytes(cfg, B, T, mode, eng.act, eng.dtype, eng._logit_rows(B * T))
            for mode in ("layer", "products", "mlp", None)}
    assert need["layer"] < need["products"] < need["mlp"] < need[None]
    reserve = engine.AUTO_RESERVE
    for free, mode in ((need["mlp"] + reserve, "mlp"), (need["mlp"] + reserve - 1, "products"),
                       (need["products"] + reserve, "products"), (need["products"] + reserve - 1, "layer")):
        monkeypatch.setenv("NANOEULER_MEMORY_AVAILABLE", str(free))
        eng.recompute, eng._acts_shape = True, None
        cross_entropy_backward(eng, inputs, targets)
        assert np.array_equal(eng.grads, stored)
        assert_recomputed(eng, mode)


def test_bad_specs_are_one_line_errors():
    cfg = CHECK_CONFIGS[0]
    with pytest.raises(UserError, match="at least 1"):
        lora.make_spec(cfg, 0)
    with pytest.raises(UserError, match="unknown"):
        lora.parse_targets("q,x_proj")
    with pytest.raises(UserError, match="rank at most"):
        lora.make_spec(cfg, 64)
    with pytest.raises(UserError, match="dropout"):
        lora.make_spec(cfg, 4, dropout=1.0)
    assert lora.parse_targets("v, q") == ("q", "v")
    assert lora.make_spec(cfg, 4).alpha == 8.0


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_qlora_adapter_gradients_match_finite_differences(quant):
    """QLoRA: the base's matrices quantized (the engine holds them packed), the adapters' gradients against the
    finite differences of the same quantized model, dropout on."""
    errors = lora_gradient_check(LORA_CONFIGS[0], samples=2, seed=3, dropout=0.25, quant=quant,
                                 report=lambda line: None)
    assert len(errors) == 2 * 7 * LORA_CONFIGS[0].n_layers
    assert max(errors.values()) < 1e-6, max(errors.items(), key=lambda kv: kv[1])


def test_qlora_adapter_gradients_with_logits_in_pieces(monkeypatch):
    """The QLoRA gradient check (int4, dropout on) with the logits a piece of 5 rows at a time."""
    from nanoeuler.model import engine
    cfg = LORA_CONFIGS[0]
    monkeypatch.setattr(engine, "LOGITS_BYTES", 5 * cfg.mtp_heads * cfg.vocab_size * 8)  # float64
    errors = lora_gradient_check(cfg, samples=2, seed=3, dropout=0.25, quant="int4", report=lambda line: None)
    assert max(errors.values()) < 1e-6, max(errors.items(), key=lambda kv: kv[1])


def test_input_gradient_through_a_quantized_matrix_is_the_dequantized_product(monkeypatch):
    from nanoeuler.model.cpu import layers as cpu_layers
    from nanoeuler.model.quantize import dequantize, quantize
    monkeypatch.setattr(cpu_layers, "QUANT_ROWS", 64)  # several blocks of rows
    rng = np.random.default_rng(0)
    for kind in ("int8", "int4"):
        qt = Layers.quantized_matrix(quantize(rng.normal(size=(200, 96)).astype(np.float32), kind, 32))
        dout, dx = rng.normal(size=(5, 200)), np.empty((5, 96))
        Layers.matmul_backward(dx, None, dout, None, qt)
        np.testing.assert_allclose(dx, dout @ dequantize(qt).astype(np.float64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pieces", [False, True], ids=["whole-logits", "logits-in-pieces"])
@pytest.mark.parametrize("mode", ["layer", "products", "mlp"])
def test_qlora_recompute_gradients_are_bit_identical(pieces, mode):
    """--recompute (every mode) on a quantized base: the same bits as the stored path (float32 CPU engine), the
    logits whole or a piece of rows at a time."""
    eng, ad, _, inputs, targets = lora_problem(CHECK_CONFIGS[0], np.random.default_rng(5), 0.25, "int4", np.float32)
    if pieces:
        logits_in_pieces(eng)
    losses = cross_entropy_backward(eng, inputs, targets)
    stored = ad.grads.copy()
    eng.recompute = mode
    ad.dropout_key -= 1  # the same masks again
    assert cross_entropy_backward(eng, inputs, targets) == losses
    assert np.array_equal(ad.grads, stored) and np.abs(stored).max() > 0
