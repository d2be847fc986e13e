"""Generation: the KV cache against the full forward pass, the samplers, long prompts, streaming, `infer`."""
import io
import os

import numpy as np
import pytest

from conftest import run_cli, sharp_params, tiny_config
from nanoeuler.model.decoding import decoder_of
from nanoeuler.model.engine import make_engine
from nanoeuler.infer.generate import TextStream, generate
from nanoeuler.infer.sampling import distribution, pick
from nanoeuler.model.losses import cross_entropy, cross_entropy_backward


@pytest.fixture(scope="module")
def eng():
    """A tiny model with weights large enough that logits differ clearly from position to position."""
    cfg = tiny_config(300)
    engine = make_engine(cfg)
    engine.load_params(sharp_params(cfg, seed=1, scale=0.3))
    return engine


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(0, 300, n).astype(np.int32)


def _rel(got, want):
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def test_kv_cache_decode_matches_full_forward(eng):
    T = eng.cfg.context
    ids = _ids(T)
    full = eng.logits(ids[None])[0]  # (T, V)
    cache = decoder_of(eng).new_cache(1)
    got = [decoder_of(eng).logits(cache, ids[None, :5])[0]]  # a prefill of 5, then one token at a time
    for t in range(5, T):
        got.append(decoder_of(eng).logits(cache, ids[None, t:t + 1])[0])
    assert cache.pos == T
    for t, logits in zip(range(4, T), got):
        assert _rel(logits, full[t]) < 1e-5, t
    assert np.abs(full[4] - full[20]).max() > 0.1  # the comparison is not trivially between equal rows


def test_kv_cache_holds_keys_and_values_only_and_rolls_back(eng):
    """The cache keeps the G k heads and G v heads of each position (no queries); setting pos back and
    decoding again overwrites what was past it, and a released cache comes back empty."""
    cfg = eng.cfg
    cache = decoder_of(eng).new_cache(1)
    assert cache.kv.shape == (cfg.n_layers, 1, cfg.context, 2 * cfg.n_kv_heads, cfg.head_dim)
    ids = _ids(12, seed=5)
    decoder_of(eng).logits(cache, ids[None, :8])
    cache.rewind(5)  # roll back 3 positions
    again = decoder_of(eng).logits(cache, ids[None, 5:12])
    assert cache.pos == 12 and int(cache.position[0]) == 12
    assert _rel(again, eng.logits(ids[None])[0, -1]) < 1e-5
    decoder_of(eng).release(cache)
    reused = decoder_of(eng).new_cache(1)
    assert reused is cache and reused.pos == 0 and int(reused.position[0]) == 0


def test_argmax_decode_is_the_logits_argmax(eng):
    ids = _ids(10, seed=6)
    logits = decoder_of(eng).logits(decoder_of(eng).new_cache(1), ids[None])
    assert decoder_of(eng).greedy(decoder_of(eng).new_cache(1), ids[None]).tolist() == [int(logits[0].argmax())]
    cache = decoder_of(eng).new_cache(1)
    decoder_of(eng).logits(cache, ids[None, :6])
    every = decoder_of(eng).logits(cache, ids[None, 6:], all_heads=True)
    cache.rewind(6)
    assert np.array_equal(decoder_of(eng).greedy(cache, ids[None, 6:], all_heads=True), every.argmax(axis=-1))


def test_repeated_greedy_steps_are_single_steps_in_a_row(eng):
    """decoder.greedy(..., steps=R) runs R greedy steps fed back on the device and reads their ids once: the same
    ids, for each of two sequences, as R single steps; steps > 1 need one-token steps."""
    prompt = np.stack([_ids(6, seed=7), _ids(6, seed=8)])
    cache = decoder_of(eng).new_cache(2)
    first = decoder_of(eng).greedy(cache, prompt)
    many = decoder_of(eng).greedy(cache, first[:, None], steps=5)
    assert many.shape == (2, 5) and cache.pos == 11
    cache = decoder_of(eng).new_cache(2)
    one = decoder_of(eng).greedy(cache, prompt)
    singles = []
    for _ in range(5):
        one = decoder_of(eng).greedy(cache, one[:, None])
        singles.append(one)
    assert np.array_equal(many, np.stack(singles, axis=1))
    with pytest.raises(ValueError, match="greedy steps > 1 take one token a sequence"):
        decoder_of(eng).greedy(cache, prompt[:, :2], steps=2)


def test_kv_cache_batches_and_chunks(eng):
    ids = np.stack([_ids(20, 1), _ids(20, 2)])
    full = eng.logits(ids)
    cache = decoder_of(eng).new_cache(2)
    decoder_of(eng).logits(cache, ids[:, :7])
    out = decoder_of(eng).logits(cache, ids[:, 7:20])  # a chunk of 13 after a prefill of 7
    assert _rel(out, full[:, 19]) < 1e-5


def test_greedy_and_filters():
    rng = np.random.default_rng(0)
    logits = np.array([0.0, 3.0, 1.0, 2.9, -5.0], dtype=np.float32)
    assert pick(logits, 0, 0, 1.0, rng) == 1
    assert pick(logits, 1.0, 1, 1.0, rng) == 1        # top-1 is greedy
    assert pick(logits, 1.0, 0, 1e-6, rng) == 1       # the smallest nucleus is the top token
    draws = {pick(logits, 1.0, 2, 1.0, rng) for _ in range(200)}
    assert draws == {1, 3}                             # top-k keeps exactly k tokens
    # p = (.024, .479, .065, .433, .0002): tokens 1 and 3 hold .911, token 2 brings it to .976
    assert {pick(logits, 1.0, 0, 0.9, rng) for _ in range(400)} == {1, 3}
    assert {pick(logits, 1.0, 0, 0.95, rng) for _ in range(400)} == {1, 2, 3}
    # a high temperature flattens the distribution, a low one sharpens it
    cold = [pick(logits, 0.01, 0, 1.0, rng) for _ in range(200)]  # e^-10 odds for token 3
    hot = [pick(logits, 100.0, 0, 1.0, rng) for _ in range(2000)]
    assert cold.count(1) == 200 and 0.1 < hot.count(4) / 2000 < 0.3


def test_nucleus_keeps_the_likeliest_tokens_lowest_ids_first_on_ties():
    """top-p keeps the fewest likeliest tokens whose mass reaches top_p; among equal probabilities at the cut,
    the lowest ids (the order a stable sort of the ids by probability gives; distribution keeps it without
    sorting the ids)."""
    p = distribution(np.array([1.0, 2.0, 2.0, 2.0, 0.0], dtype=np.float32), 1.0, 0, 0.5)
    assert np.count_nonzero(p) == 2 and p[1] == p[2] == 0.5  # ids 1, 2 of the three tied ones
    rng = np.random.default_rng(0)
    for trial in range(300):
        logits = np.round(rng.standard_normal(int(rng.integers(1, 60))) * 2).astype(np.float32)  # ties
        temperature, top_p = float(rng.uniform(0.3, 2)), float(rng.choice([0.1, 0.5, 0.9, 0.999999]))
        z = np.exp(logits.astype(np.float64) / temperature - logits.max() / temperature)
        z /= z.sum()
        order = np.argsort(-z, kind="stable")
        keep = int(np.searchsorted(np.cumsum(z[order]), top_p)) + 1
        want = np.zeros_like(z)
        want[order[:keep]] = z[order[:keep]]
        np.testing.assert_allclose(distribution(logits, temperature, 0, top_p), want / want.sum(), rtol=1e-12)


def test_seed_reproduces_samples(eng):
    seed7 = list(generate(eng, _ids(5), 30, 1.0, 0, 0.9, np.random.default_rng(7)))
    seed7_again = list(generate(eng, _ids(5), 30, 1.0, 0, 0.9, np.random.default_rng(7)))
    seed8 = list(generate(eng, _ids(5), 30, 1.0, 0, 0.9, np.random.default_rng(8)))
    assert seed7 == seed7_again and seed7 != seed8 and len(seed7) == 30


def test_prompt_longer_than_context_keeps_its_last_tokens(eng):
    T = eng.cfg.context
    long = _ids(3 * T + 5)
    from_long = list(generate(eng, long, 10, temperature=0))
    from_tail = list(generate(eng, long[-T:], 10, temperature=0))
    assert from_long == from_tail


def test_generation_slides_past_the_context(eng):
    T = eng.cfg.context
    out = list(generate(eng, _ids(T - 2), 3 * T, temperature=0))
    assert len(out) == 3 * T
    # up to the first slide, the cached path is exactly the greedy continuation of a full forward pass
    seq = list(_ids(T - 2))
    for expected in out[:2]:
        assert int(np.argmax(eng.logits(np.array([seq]))[0, -1])) == expected
        seq.append(expected)


def test_stop_token_ends_generation(eng):
    first = next(generate(eng, _ids(4), 5, temperature=0))
    assert list(generate(eng, _ids(4), 50, temperature=0, stop_ids=(first,))) == [first]


def test_stream_prints_characters_split_across_tokens(tokenizer):
    out = io.StringIO()
    stream = TextStream(tokenizer, out)
    text = "café ☃ 😀 done"
    for i in tokenizer.encode(text):
        stream.write([i])
    stream.close()
    assert out.getvalue() == text
    out = io.StringIO()
    stream = TextStream(tokenizer, out)
    stream.write(tokenizer.encode(b"a\xffb"))
    stream.close()
    assert out.getvalue() == "a\ufffdb"


def test_infer_cli(tiny_ckpt):
    greedy = ["--ckpt", tiny_ckpt, "--temperature", "0", "--max-new-tokens", "12", "--device", "cpu"]
    first = run_cli("infer", "ROMEO:", *greedy)
    second = run_cli("infer", "ROMEO:", *greedy)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout and first.stdout.startswith("ROMEO:")
    # argv cannot hold NUL; \udcff is how Python passes the lone (non-UTF-8) byte 0xff through argv
    for prompt in ["", "\x07 odd \u00e9\u2603\U0001f600 \udcff bytes", "word " * 200]:
        r = run_cli("infer", prompt, "--ckpt", tiny_ckpt, "--max-new-tokens", "5", "--seed", "1", "--top-k", "5")
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "the model sees its last 31" in r.stderr  # one position left for the first new token


def test_chat_repl(tiny_ckpt, tmp_path):
    env = dict(os.environ, HOME=str(tmp_path))  # the history file goes to this HOME
    r = run_cli("chat", "--ckpt", tiny_ckpt, "--max-new-tokens", "6", "--seed", "0", "--device", "cpu",
                input="ROMEO:\n/reset\n/nope\nmore\n", env=env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "(cleared)" in r.stdout and "unknown command /nope" in r.stdout  # Ctrl-D (end of input) quits
    r = run_cli("chat", "--ckpt", tiny_ckpt, input="/quit\nnever read\n", env=env)
    assert r.returncode == 0 and r.stdout.rstrip().endswith(">")


def test_every_entry_refuses_sequences_longer_than_the_context(eng):
    """The RoPE tables and the kernels stop at the context: logits, losses and the KV cache refuse more."""
    T = eng.cfg.context + 1
    ids = np.zeros((1, T), dtype=np.int32)
    targets = np.zeros((eng.cfg.mtp_heads, 1, T), dtype=np.int32)
    with pytest.raises(ValueError, match="do not fit"):
        eng.logits(ids)
    with pytest.raises(ValueError, match="do not fit"):
        cross_entropy(eng, ids, targets)
    with pytest.raises(ValueError, match="do not fit"):
        cross_entropy_backward(eng, ids, targets)
    with pytest.raises(ValueError, match="KV cache"):
        decoder_of(eng).logits(decoder_of(eng).new_cache(), ids)
    assert eng.logits(ids[:, :-1]).shape == (1, T - 1, eng.cfg.vocab_size)  # the context itself fits


def test_gpu_refuses_a_head_size_its_kernels_lack_in_one_line():
    from nanoeuler.model.config import Config
    from nanoeuler.errors import UserError
    from nanoeuler.model.engine import make_engine

    cfg = Config(dim=48, n_layers=1, n_heads=3, n_kv_heads=1, hidden=64, vocab_size=50, context=16)  # head_dim 16
    with pytest.raises(UserError, match="head_dim 32, 64 or 128, not 16"):
        make_engine(cfg, device="gpu")


# ------------------------------------------------------------------------------- speculative decoding
def _spec_engine(vocab, K, context, seed, same_heads=False):
    from nanoeuler.model.config import Config
    cfg = Config(dim=32, n_layers=2, n_heads=1, n_kv_heads=1, hidden=64, vocab_size=vocab, context=context,
                 mtp_heads=K)
    engine = make_engine(cfg)
    engine.load_params(sharp_params(cfg, seed=seed, scale=0.5, same_heads=same_heads))
    return engine


def test_every_head_decode_matches_the_full_forward(eng):
    ids = _ids(20, seed=3)
    cache = decoder_of(eng).new_cache(1)
    decoder_of(eng).logits(cache, ids[None, :12])
    heads = decoder_of(eng).logits(cache, ids[None, 12:], all_heads=True)[0]  # (8, K, V)
    full = eng.logits(ids[None])[0]
    assert heads.shape == (8, eng.cfg.mtp_heads, eng.cfg.vocab_size)
    assert _rel(heads[:, 0], full[12:]) < 1e-5


def test_a_verifying_step_gives_single_steps_bits():
    """A position decoded in a step of K rows gets the logits of a step of its own to the bit (the CPU's
    matrix products of a few rows are row by row): what makes speculative greedy decoding plain greedy."""
    engine = _spec_engine(vocab=50, K=3, context=40, seed=2)
    ids = _ids(12, seed=4) % 50
    one, three = decoder_of(engine).new_cache(1), decoder_of(engine).new_cache(1)
    for cache in (one, three):
        decoder_of(engine).logits(cache, ids[None, :9])
    singles = np.stack([decoder_of(engine).logits(one, ids[None, t:t + 1], all_heads=True)[0, 0] for t in range(9, 12)])
    assert np.array_equal(singles, decoder_of(engine).logits(three, ids[None, 9:12], all_heads=True)[0])


def test_speculative_greedy_is_plain_greedy_through_window_slides():
    """K = 3 heads drafting; 120 tokens from a 40-token context slide the window three times."""
    for same_heads in (False, True):
        engine = _spec_engine(vocab=50, K=3, context=40, seed=1, same_heads=same_heads)
        prompt = [1, 2, 3, 4, 5]
        stats = {}
        plain = list(generate(engine, prompt, 120, temperature=0))
        spec = list(generate(engine, prompt, 120, temperature=0, speculative=True, stats=stats))
        assert spec == plain
        assert stats["tokens"] == 120 and stats["drafted"] == 2 * stats["steps"]
        assert (stats["accepted"] > 20) == same_heads, stats


def test_verify_drafts_chains_the_steps_a_host_would_take():
    """decoder.verify's steps chained on the device keep what a host checking every head's argmax keeps, move
    the cache to the same place, and hand on the same next tokens; some drafts accepted, some not."""
    engine = _spec_engine(vocab=50, K=3, context=40, seed=1, same_heads=True)
    chained, host = decoder_of(engine).new_cache(1), decoder_of(engine).new_cache(1)
    for cache in (chained, host):
        decoder_of(engine).greedy(cache, np.array([[1, 2, 3]], dtype=np.int32))
        tokens = decoder_of(engine).greedy(cache, np.array([[4]], dtype=np.int32), all_heads=True)[0, -1].tolist()
    kept, accepted, following = decoder_of(engine).verify(chained, [tokens], steps=6)
    expect, counts = [], []
    for _ in range(6):
        out = decoder_of(engine).greedy(host, np.array([tokens], dtype=np.int32), all_heads=True)[0]  # (K, K)
        n = 0
        while n < 2 and out[n, 0] == tokens[n + 1]:
            n += 1
        expect += tokens[:n + 1]
        counts.append(n)
        host.rewind(host.pos - (2 - n))
        tokens = [int(t) for t in out[n]]
    assert kept == expect and accepted == counts and following.tolist() == tokens
    assert chained.pos == host.pos == 4 + len(kept) and 0 < sum(counts) < 12
    assert int(chained.position[0]) == chained.pos


def test_speculative_sampling_follows_the_model_distribution():
    """Two tokens after a fixed prompt, 3000 times, at temperature 1 with K = 2: the joint distribution of
    (t1, t2) from speculative sampling matches the model's exact one (chi-square), while the head-1 drafts'
    own distribution is far from it (so accepting drafts blindly would fail)."""
    V, n = 6, 3000
    engine = _spec_engine(vocab=V, K=2, context=16, seed=7)
    prompt = [1, 2, 3]
    cache = decoder_of(engine).new_cache(1)
    first = decoder_of(engine).logits(cache, np.array([prompt]), all_heads=True)[0, -1]  # (K, V)
    softmax = lambda z: np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    p1, q2 = softmax(first[0].astype(np.float64)), softmax(first[1].astype(np.float64))
    exact = np.zeros((V, V))
    for t1 in range(V):
        after_t1 = decoder_of(engine).new_cache(1)
        decoder_of(engine).logits(after_t1, np.array([prompt]))
        exact[t1] = p1[t1] * softmax(decoder_of(engine).logits(after_t1, np.array([[t1]]))[0].astype(np.float64))
    rng = np.random.default_rng(0)
    counts = np.zeros((V, V))
    for _ in range(n):
        t1, t2 = generate(engine, prompt, 2, temperature=1.0, top_p=1.0, rng=rng, speculative=True)
        counts[t1, t2] += 1
    chi2 = lambda expected: float((((counts - n * expected) ** 2) / (n * expected)).sum())
    assert chi2(exact) < 80  # 35 degrees of freedom: mean 35, p < 1e-4 above 80
    assert chi2(p1[:, None] * q2[None, :]) > 300


def test_speculative_needs_draft_heads():
    from nanoeuler.errors import UserError
    engine = _spec_engine(vocab=20, K=1, context=16, seed=1)
    with pytest.raises(UserError, match="K >= 2"):
        list(generate(engine, [1], 5, temperature=0, speculative=True))


def test_infer_speculative_cli_prints_the_greedy_text_and_stats(tiny_ckpt):
    greedy = ["--ckpt", tiny_ckpt, "--temperature", "0", "--max-new-tokens", "20", "--device", "cpu"]
    plain = run_cli("infer", "ROMEO:", *greedy)
    spec = run_cli("infer", "ROMEO:", *greedy, "--speculative", "--stats")
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    assert "accepted" in spec.stderr and "tokens/s" in spec.stderr
