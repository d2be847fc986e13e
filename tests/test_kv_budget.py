"""serve's KV cache sized for the memory there is (infer/kv_budget.py): the choice with injected memory numbers,
a server on a model whose context does not fit its budget, and one-sequence generation's smaller caches."""
import dataclasses
import os

import numpy as np
import pytest

from nanoeuler.errors import UserError
from nanoeuler.infer import kv_budget
from nanoeuler.model import memory
from nanoeuler.infer.generate import generate
from nanoeuler.io import checkpoint
from nanoeuler.model.config import Config, init_params
from nanoeuler.model.decoding import cache_positions, decoder_of, kv_cache_bytes

from conftest import run_cli, tiny_config

GiB = 1 << 30
# Llama 3.2 1B's cache: 16 layers, 8 kv heads of 64, 131,072 positions
LLAMA = Config(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden=8192, vocab_size=128256, context=131072)


def test_cache_bytes_are_layers_kv_heads_positions_slots_and_element_size():
    assert kv_cache_bytes(LLAMA, 131072, 64, 2) == 256 * GiB  # the cache that cannot be allocated
    assert kv_cache_bytes(LLAMA, 1, 1, 2) == 16 * 2 * 8 * 64 * 2
    cfg = tiny_config(100)
    cache = decoder_of_engine_free_cache(cfg, rows=3, context=16)
    assert cache.kv.nbytes == kv_cache_bytes(cfg, 16, 3, 4) and cache.context == 16


def decoder_of_engine_free_cache(cfg, rows, context):
    from nanoeuler.model.decoding import KVCache
    return KVCache(np, cfg, rows, np.float32, context)


def test_the_model_context_when_it_fits():
    p = kv_budget.plan(LLAMA, 2, 300 * GiB)
    assert (p.slots, p.context, p.bytes, p.reason) == (64, 131072, kv_cache_bytes(LLAMA, 131072, 65, 2), "")
    small = dataclasses.replace(LLAMA, context=2048)
    assert kv_budget.plan(small, 2, 5 * GiB).context == 2048


def test_too_big_chooses_the_largest_power_of_two_context_for_the_default_slots():
    budget = 70 * GiB  # an H100's free memory after a 1B model's weights and the margin
    p = kv_budget.plan(LLAMA, 2, budget)
    assert (p.slots, p.context) == (64, 32768) and p.bytes <= budget < kv_cache_bytes(LLAMA, 65536, 65, 2)
    line = kv_budget.describe(p, "bf16", LLAMA.context)
    assert line == ("KV cache: 64 slots x 32,768 positions (bf16, 65.0 GiB; the model allows 131,072: "
                    "--context/--slots to change)")
    # --slots given: the context chosen for them
    assert kv_budget.plan(LLAMA, 2, budget, slots=8).context == 131072
    assert kv_budget.plan(LLAMA, 2, 20 * GiB, slots=16).context == 32768
    # --context given: as many slots as fit, at most 64
    p = kv_budget.plan(LLAMA, 2, budget, context=131072)
    assert p.slots == 16 and p.bytes <= budget < kv_cache_bytes(LLAMA, 131072, 18, 2) and "64 slots" in p.reason


def test_too_little_for_the_smallest_context_takes_fewer_slots():
    budget = kv_cache_bytes(LLAMA, 2048, 11, 2) + 1  # 10 slots and the scratch one
    p = kv_budget.plan(LLAMA, 2, budget)
    assert (p.slots, p.context) == (10, 2048) and "64 slots of 2,048 positions do not fit" in p.reason
    with pytest.raises(UserError, match=r"^a KV cache of 1 slot x 2,048 positions needs 134,217,728 bytes \(0.1 GiB\); 1,000 bytes"):
        kv_budget.plan(LLAMA, 2, 1000)


def test_explicit_sizes_that_cannot_fit_are_one_line_errors():
    with pytest.raises(UserError) as e:
        kv_budget.plan(LLAMA, 2, 10 * GiB, slots=64, context=131072)
    msg = str(e.value)
    assert "\n" not in msg and f"{kv_cache_bytes(LLAMA, 131072, 65, 2):,} bytes" in msg
    assert f"{10 * GiB:,} bytes" in msg and "lower --slots or --context" in msg
    with pytest.raises(UserError, match="slots x 2,048 positions"):
        kv_budget.plan(LLAMA, 2, GiB, slots=64)
    with pytest.raises(UserError, match="--context must be 2 to the model's context 131,072"):
        kv_budget.plan(LLAMA, 2, 300 * GiB, context=262144)
    p = kv_budget.plan(LLAMA, 2, 10 * GiB, slots=4, context=8192)
    assert (p.slots, p.context, p.reason) == (4, 8192, "")


def test_available_memory_is_the_free_memory_less_the_margin(monkeypatch):
    monkeypatch.setenv("NANOEULER_MEMORY_AVAILABLE", str(80 * GiB))
    assert kv_budget.available(LLAMA, gpu=True) == 80 * GiB - kv_budget.margin(LLAMA)
    monkeypatch.delenv("NANOEULER_MEMORY_AVAILABLE")
    assert 0 < memory.cpu_available() and kv_budget.available(LLAMA, gpu=False) >= 0


def test_one_sequence_caches_hold_the_prompt_and_its_new_tokens(tokenizer, tmp_path):
    assert cache_positions(100, 131072) == 128 and cache_positions(129, 131072) == 256
    assert cache_positions(5000, 4096) == 4096 and cache_positions(1, 32) == 2
    from nanoeuler.io.checkpoint import load_model
    cfg = dataclasses.replace(tiny_config(tokenizer.vocab_size), context=4096)
    checkpoint.save(tmp_path / "m.bin", cfg, init_params(cfg, seed=3), tokenizer.to_json(), step=0)
    eng = load_model(tmp_path / "m.bin", "cpu", True)[0]
    ids = list(range(1, 20))
    out = list(generate(eng, ids, 10, temperature=0.0))
    assert len(out) == 10
    assert {c.context for c in decoder_of(eng)._spare} == {32}  # not the model's 4096


@pytest.fixture(scope="module")
def long_ckpt(tokenizer, tmp_path_factory):
    """The tiny model with a context of 8192."""
    cfg = dataclasses.replace(tiny_config(tokenizer.vocab_size), context=8192)
    path = tmp_path_factory.mktemp("long") / "long.bin"
    checkpoint.save(path, cfg, init_params(cfg, seed=3), tokenizer.to_json(), step=0)
    return path, cfg


def test_serve_sizes_its_cache_for_the_budget_and_refuses_longer_prompts(long_ckpt, tmp_path, monkeypatch):
    pytest.importorskip("openai")
    from test_serve import Server
    path, cfg = long_ckpt
    # room for 64 slots of 2048 positions (float32 on the CPU), not of 4096
    budget = kv_budget.margin(cfg) + kv_cache_bytes(cfg, 2048, 65, 4) + 1000
    monkeypatch.setenv("NANOEULER_MEMORY_AVAILABLE", str(budget))
    server = Server(path, tmp_path / "serve.log")
    try:
        out = server.output()
        assert "KV cache: 64 slots x 2,048 positions (float32, " in out and "the model allows 8,192" in out
        status, card = server.request("GET", "/v1/models")
        assert card["data"][0]["max_model_len"] == 2048
        status, err = server.request("POST", "/v1/completions", {"model": "long", "prompt": [5] * 2048,
                                                                  "max_tokens": 1})
        assert status == 400 and err["error"]["code"] == "context_length_exceeded", err
        assert err["error"]["message"].startswith("this server's context is 2048 tokens; the prompt has 2048")
        # a prompt that fits, with more new tokens than the slot has room for: cut at the slot's end
        status, ok = server.request("POST", "/v1/completions", {"model": "long", "prompt": [5] * 2040,
                                                                 "max_tokens": 50, "temperature": 0})
        assert status == 200 and ok["choices"][0]["finish_reason"] == "length"
        assert ok["usage"]["completion_tokens"] < 50
    finally:
        server.stop()
    # explicit sizes that do not fit: one line, the bytes needed and available
    r = run_cli("serve", "--ckpt", path, "--device", "cpu", "--port", "0", "--context", "8192",
                "--slots", "64", env=dict(os.environ, NANOEULER_MEMORY_AVAILABLE=str(budget)))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert f"needs {kv_cache_bytes(cfg, 8192, 65, 4):,} bytes" in r.stderr
    assert f"{budget - kv_budget.margin(cfg):,} bytes" in r.stderr


def test_a_model_that_cannot_fit_is_refused_before_it_is_allocated(long_ckpt):
    """make_engine compares the parameter buffers with the free memory: infer's engine (no gradients) needs
    the float32 weights alone, training's the gradients too; what cannot fit is one line naming both."""
    from nanoeuler.io.checkpoint import load_model
    from nanoeuler.model.config import param_layout
    path, cfg = long_ckpt
    n = param_layout(cfg)[1]
    eng = load_model(path, "cpu")[0]
    assert eng.grads is None and eng.params.size == n
    with pytest.raises(ValueError, match="no gradients"):
        eng.forward_backward(np.zeros((1, 4), np.int32), -np.ones((cfg.mtp_heads, 1, 4), np.int32), 1.0)
    assert memory.parameter_bytes(n, 4, 4, training=False) == 4 * n
    assert memory.parameter_bytes(n, 4, 2, training=True) == 10 * n  # float32 weights, bf16 copy, gradients
    assert memory.parameter_bytes(n, 4, 2, training=False) == 2 * n  # the GPU decodes on the bf16 copy alone
    env = dict(os.environ, NANOEULER_MEMORY_AVAILABLE=str(4 * n - 1))
    r = run_cli("infer", "hi", "--ckpt", path, "--device", "cpu", env=env)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "needs" in r.stderr and "float32 weights on the CPU, which has" in r.stderr
    env = dict(os.environ, NANOEULER_MEMORY_AVAILABLE=str(4 * n + 1000))  # the weights fit, no gradients needed
    assert run_cli("infer", "hi", "--ckpt", path, "--device", "cpu", "--max-new-tokens", 2, env=env).returncode == 0
