"""Batched decoding on the CPU engine (infer/batch.py): a sequence's tokens, greedy or sampled with a seed, are
those it gets alone, whatever else is in the batch, wherever its row, through joins, leaves and reused rows;
the sampler's cuts; cancel; logprobs; `infer --num-samples`."""
import numpy as np
import pytest

from conftest import run_cli, sharp_params, tiny_config
from nanoeuler.infer.batch import BatchGenerator, Request, log_probabilities
from nanoeuler.infer.generate import generate
from nanoeuler.model.engine import make_engine


@pytest.fixture(scope="module")
def eng():
    cfg = tiny_config(300)  # context 32
    engine = make_engine(cfg)
    engine.load_params(sharp_params(cfg, seed=3, scale=0.3))
    return engine


def _prompt(n, seed):
    return tuple(int(i) for i in np.random.default_rng(seed).integers(0, 300, n))


def _requests():
    """Prompts of 1 to 30 tokens (the prefill of the longest in chunks), greedy and sampled, one stopping."""
    out = []
    for i, (n, new) in enumerate([(1, 9), (7, 3), (30, 5), (12, 20), (3, 1), (20, 11), (5, 31), (9, 6)]):
        sampled = i % 2 == 1
        out.append(Request(_prompt(n, i), new, temperature=0.9 if sampled else 0.0, top_k=40 if i == 3 else 0,
                           top_p=0.8 if i == 5 else 1.0, seed=100 + i if sampled else None))
    return out


def _run(gen, requests, order=None):
    """Add the requests (in `order`) to gen, one more each step while rows are busy; the ids of each."""
    seqs = {}
    pending = list(order if order is not None else range(len(requests)))
    while pending or gen.busy():
        if pending:
            i = pending.pop(0)
            seqs[i] = gen.add(requests[i])
        for t in gen.step():
            assert t.sequence.finish_reason == t.finish_reason or t.finish_reason is None
    return {i: (s.ids, s.finish_reason) for i, s in seqs.items()}


def test_batched_tokens_are_each_sequence_alone(eng):
    requests = _requests()
    alone = {}
    for i, r in enumerate(requests):
        gen = BatchGenerator(eng, rows=1)
        alone.update({i: v for v in _run(gen, [r]).values()})
        gen.close()
    # 3 rows for 8 requests: rows leave and are reused, sequences join while others decode, in two orders
    for order, rows, chunk in (([0, 1, 2, 3, 4, 5, 6, 7], 3, 64), ([7, 5, 3, 1, 6, 4, 2, 0], 5, 64)):
        gen = BatchGenerator(eng, rows=rows, prefill_chunk=chunk)
        assert _run(gen, requests, order) == alone
        assert not gen.busy() and sorted(gen.free) == list(range(rows))
    assert alone[6][1] == "length" and len(alone[6][0]) == 32 - 5 + 1  # the context's end
    assert alone[3][1] == "length" and len(alone[3][0]) == 20
    assert len({tuple(ids) for ids, _ in alone.values()}) == len(alone)


def test_generate_over_a_list_is_generate_of_each(eng):
    # prompts of one length are prefilled together (admit), others one by one
    prompts = [list(_prompt(n, 10 + i)) for i, n in enumerate((3, 17, 8, 8, 8, 25, 3))]
    rng = np.random.default_rng(5)
    together = generate(eng, prompts, 40, 0.8, 0, 0.95, rng)  # 40 > context: the window slides
    rng = np.random.default_rng(5)
    assert together == [list(generate(eng, p, 40, 0.8, 0, 0.95, rng)) for p in prompts]
    assert all(len(out) == 40 for out in together)
    greedy = generate(eng, prompts, 12, temperature=0)
    assert greedy == [list(generate(eng, p, 12, temperature=0)) for p in prompts]


def test_a_seed_repeats_a_sample_and_another_seed_differs(eng):
    r = Request(_prompt(6, 1), 25, temperature=1.0, seed=11)
    runs = []
    for seed in (11, 11, 12):
        gen = BatchGenerator(eng, rows=2)
        runs.append(_run(gen, [Request(r.prompt_ids, 25, temperature=1.0, seed=seed)])[0][0])
    assert runs[0] == runs[1] != runs[2]


def test_sampled_ids_stay_inside_the_top_k_and_top_p_cuts(eng):
    """sample_rows keeps the values at or above the k-th largest, then those at or above the largest value
    whose tokens hold top_p of the kept mass (ties kept): every draw lands there, and all of it gets drawn."""
    layers = eng.layers
    rng = np.random.default_rng(0)
    V, rows = 40, 6
    logits = np.round(rng.standard_normal((rows, V)) * 3, 1).astype(np.float32)  # rounded: ties
    top_k = np.array([0, 1, 5, 0, 7, 40], np.int32)
    top_p = np.array([0.5, 1.0, 1.0, 0.9, 0.6, 0.0], np.float32)
    temperature = np.array([1.0, 1.0, 0.7, 2.0, 1.0, 1.0], np.float32)
    kept = []
    for r in range(rows):
        z = logits[r].astype(np.float64)
        keep = np.ones(V, bool) if top_k[r] == 0 else z >= np.sort(z)[::-1][top_k[r] - 1]
        p = np.where(keep, np.exp((z - z.max()) / temperature[r]), 0)
        mass = np.array([p[z >= v].sum() for v in z])
        edge = z[mass >= top_p[r] * p.sum() * (1 - 1e-6)].max()
        kept.append(set(np.flatnonzero(keep & (z >= edge)).tolist()))
    drawn = [set() for _ in range(rows)]
    ids = np.empty(rows, np.int32)
    for i in range(400):
        layers.sample_rows(ids, logits, top_k, temperature, top_p, np.full(rows, 9, np.uint32),
                           np.zeros(rows, np.uint32), np.full(rows, i, np.int32))
        for r in range(rows):
            drawn[r].add(int(ids[r]))
    assert drawn == kept
    assert kept[1] == {int(logits[1].argmax())} and kept[5] == {int(logits[5].argmax())}  # top-1, top-p 0
    assert len(kept[2]) >= 5 and len(kept[0]) > 1
    layers.sample_rows(ids, logits, top_k, np.zeros(rows, np.float32), top_p, np.zeros(rows, np.uint32),
                       np.zeros(rows, np.uint32), np.zeros(rows, np.int32))
    assert ids.tolist() == logits.argmax(axis=1).tolist()  # temperature 0: the argmax


def test_sampled_ids_follow_the_softmax_of_the_kept_tokens(eng):
    """sample_rows over 20,000 seeds of one row (temperature 0.8, top-p 0.9): each kept token is drawn at its
    share of the kept tokens' softmax, within 4 standard errors, and nothing else is drawn."""
    rng = np.random.default_rng(3)
    V, n = 24, 20000
    z = rng.standard_normal(V).astype(np.float32) * np.float32(0.5)
    ids = np.empty(n, np.int32)
    eng.layers.sample_rows(ids, np.repeat(z[None], n, axis=0), np.zeros(n, np.int32), np.full(n, 0.8, np.float32),
                           np.full(n, 0.9, np.float32), np.arange(n, dtype=np.uint32), np.zeros(n, np.uint32),
                           np.full(n, 5, np.int32))
    p = np.exp((z.astype(np.float64) - z.max()) / 0.8)
    order = np.argsort(-p)
    kept = order[:int(np.searchsorted(np.cumsum(p[order]), 0.9 * p.sum())) + 1]
    share = p[kept] / p[kept].sum()
    counts = np.bincount(ids, minlength=V)
    assert set(np.flatnonzero(counts).tolist()) == set(kept.tolist()) and len(kept) > 3
    assert np.all(np.abs(counts[kept] / n - share) <= 4 * np.sqrt(share * (1 - share) / n))


def test_cancel_frees_the_row_and_stop_ends_without_the_stop_id(eng):
    gen = BatchGenerator(eng, rows=2)
    cancelled = gen.add(Request(_prompt(4, 1), 30))
    running = gen.add(Request(_prompt(5, 2), 30))
    waiting = gen.add(Request(_prompt(6, 3), 3))
    for _ in range(4):
        gen.step()
    assert cancelled.slot is not None and running.slot is not None and waiting.slot is None  # waits for a row
    slot = cancelled.slot
    gen.cancel(cancelled)
    assert cancelled.finish_reason == "cancelled" and slot in gen.free
    gen.step()
    assert waiting.slot == slot
    while gen.busy():
        gen.step()
    assert waiting.finish_reason == "length" and len(waiting.ids) == 3
    # stop: the same greedy prompt, stopped at its third token
    first = list(generate(eng, list(_prompt(5, 2)), 3, temperature=0))
    gen = BatchGenerator(eng, rows=1)
    s = gen.add(Request(_prompt(5, 2), 30, stop_ids=(first[2],)))
    tokens = []
    while gen.busy():
        tokens += gen.step()
    assert s.finish_reason == "stop" and s.ids == first[:2] and tokens[-1].id is None and s.stop_id == first[2]
    # with logprobs, the stop id's log-probability comes with the token that ends the sequence
    gen = BatchGenerator(eng, rows=1)
    s = gen.add(Request(_prompt(5, 2), 30, stop_ids=(first[2],), logprobs=2))
    tokens = []
    while gen.busy():
        tokens += gen.step()
    last = eng.logits(np.array([list(_prompt(5, 2)) + first[:2]]))[0, -1]
    want, top = log_probabilities(last, first[2], 2)
    assert tokens[-1].id is None and abs(tokens[-1].logprob - want) < 1e-4 and tokens[-1].top_logprobs[0][0] == top[0][0]
    with pytest.raises(ValueError, match="fit the context"):
        gen.add(Request(_prompt(32, 0), 1))


def test_logprobs_are_the_full_forward_log_softmax(eng):
    prompt = _prompt(7, 4)
    gen = BatchGenerator(eng, rows=2)
    gen.add(Request(_prompt(3, 9), 6))  # a neighbour
    seq = gen.add(Request(prompt, 4, temperature=1.0, seed=3, logprobs=3))
    tokens = []
    while gen.busy():
        tokens += [t for t in gen.step() if t.sequence is seq]
    full = eng.logits(np.array([list(prompt) + seq.ids[:-1]]))[0, len(prompt) - 1:]
    for t, z in zip(tokens, full):
        want, top = log_probabilities(z, t.id, 3)
        assert abs(t.logprob - want) < 1e-4 and [i for i, _ in t.top_logprobs] == [i for i, _ in top]
    assert len(tokens) == 4 and tokens[0].top_logprobs[0][1] >= tokens[0].top_logprobs[2][1]


def test_infer_num_samples_prints_each_sample_the_first_plain_infer(tiny_ckpt):
    """Sample i of --num-samples is plain infer's with --seed + i - 1; --no-batch-invariance runs too."""
    flags = ["--ckpt", tiny_ckpt, "--max-new-tokens", "8", "--seed", "4", "--device", "cpu"]
    plain = run_cli("infer", "ROMEO:", *flags)
    many = run_cli("infer", "ROMEO:", *flags, "--num-samples", "3")
    assert many.returncode == 0, many.stderr
    parts = many.stdout.split("--- sample ")
    assert len(parts) == 4 and parts[1].startswith("1 of 3 ---\n")
    assert parts[1].split("---\n", 1)[1].rstrip("\n") == plain.stdout.rstrip("\n")
    second = run_cli("infer", "ROMEO:", *flags[:-4], "--seed", "5", "--device", "cpu")  # sample i: --seed + i - 1
    assert parts[2].split("---\n", 1)[1].rstrip("\n") == second.stdout.rstrip("\n")
    loose = run_cli("infer", "ROMEO:", *flags, "--num-samples", "3", "--no-batch-invariance")
    assert loose.returncode == 0 and loose.stdout.count("--- sample ") == 3, loose.stderr


def test_chained_pipelined_steps_with_a_cancel_in_flight(eng):
    """step(8): chains of 8 steps, each call returning the chain launched by the call before; a sequence
    cancelled while a chain over its row is in flight frees the row once that chain is read, and the others'
    tokens are still their own alone."""
    requests = [Request(_prompt(4 + i, 20 + i), 20, temperature=0.7, seed=i) for i in range(3)]
    alone = []
    for r in requests:
        gen = BatchGenerator(eng, rows=1)
        alone.append(_run(gen, [r])[0][0])
    gen = BatchGenerator(eng, rows=3)
    seqs = [gen.add(r) for r in requests]
    while gen.queue or gen.joining:
        gen.admit()
    assert gen.step(8) == [] and gen.inflight is not None  # launched, read by the next call
    gen.cancel(seqs[1])
    assert seqs[1].finish_reason == "cancelled" and gen.retiring and len(gen.free) == 0
    late = gen.add(Request(_prompt(5, 30), 6))
    while gen.busy():
        if gen.can_admit():
            gen.admit()
        else:
            gen.step(8)
    assert seqs[0].ids == alone[0] and seqs[2].ids == alone[2] and len(late.ids) == 6
    assert sorted(gen.free) == [0, 1, 2] and not gen.retiring


def test_chained_steps_end_sequences_as_single_steps_do(eng):
    """A chain's run of ids a row ends a sequence where single steps would: at a stop id (not emitted, the
    Token after the last kept one), at max_new_tokens, at the context's end; the Tokens of a sequence in order."""
    first = list(generate(eng, list(_prompt(6, 50)), 12, temperature=0))
    requests = [Request(_prompt(6, 50), 30, stop_ids=(first[4], 299)),  # stops at its 5th token
                Request(_prompt(5, 51), 11, temperature=0.8, seed=2),  # max_new_tokens inside a chain
                Request(_prompt(20, 52), 30, temperature=0.8, seed=3)]  # the context (32) ends inside a chain

    def tokens(steps):
        gen = BatchGenerator(eng, rows=3)
        seqs = [gen.add(r) for r in requests]
        while gen.queue or gen.joining:
            gen.admit()
        out = []
        while gen.busy():
            out += gen.step(steps)
        runs = [[(t.id, t.finish_reason) for t in out if t.sequence is s] for s in seqs]
        return runs, [(s.ids, s.finish_reason, s.stop_id) for s in seqs]

    single, chained = tokens(1), tokens(8)
    assert chained == single
    assert single[1][0] == (first[:4], "stop", first[4]) and single[0][0][-1] == (None, "stop")
    assert single[1][1][1] == "length" and len(single[1][1][0]) == 11
    assert single[1][2][1] == "length" and len(single[1][2][0]) == 32 - 20 + 1


def test_without_batch_invariance_products_are_blas_and_tokens_stay(eng):
    """make_engine(batch_invariant=False) (`--no-batch-invariance`): a few rows' products are BLAS's, bit for bit,
    where the invariant engine's are _matmul_rows's; the greedy tokens of a batch, whose logits then differ by
    rounding only, are the invariant engine's."""
    from nanoeuler.model.cpu.layers import Layers, _matmul_rows
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 48), np.float32), rng.standard_normal((37, 48), np.float32)
    outs = {}
    for on in (True, False):
        out = np.empty((5, 37), np.float32)
        Layers("fp32", batch_invariant=on).matmul_forward(out, x, w)
        outs[on] = out
    assert np.array_equal(outs[False], x @ w.T)
    reference = np.empty_like(outs[True])
    _matmul_rows(reference, x, w, False)
    assert np.array_equal(outs[True], reference) and not np.array_equal(outs[True], outs[False])
    loose = make_engine(eng.cfg, batch_invariant=False)
    loose.load_params(eng.params)
    prompts = [list(_prompt(n, 40 + n)) for n in (3, 9, 17)]
    assert generate(loose, prompts, 10, temperature=0) == generate(eng, prompts, 10, temperature=0)
