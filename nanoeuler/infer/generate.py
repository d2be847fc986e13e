"""Text generation with the KV cache: what `nanoeuler infer "PROMPT"` (infer/main.py), `chat` and the samples
printed during training decode with.

    ids = list(generate(eng, prompt_ids, 200, temperature=0.8, top_k=40, rng=np.random.default_rng(1)))

The prompt is run through the model once (prefill), then each new token is decoded against the cache, so a
token costs one position of compute, not the whole window. The context is a hard limit of the model (RoPE
positions it was trained on): a prompt longer than the context keeps its last tokens, and when generation
fills the cache the last three quarters of the text are re-run into a fresh cache and generation goes on.
Tokens are streamed as they come, through an incremental UTF-8 decoder so a character split across tokens
is printed whole.
"""
import codecs
import contextlib
import secrets
import sys

import numpy as np

from nanoeuler.infer.batch import BatchGenerator, Request, decode_buckets
from nanoeuler.infer.sampling import distribution, pick, residual_draw
from nanoeuler.model.decoding import cache_positions, decoder_of
from nanoeuler.model.limits import DECODE_ROWS, FEW_ROWS

# Greedy generation decodes up to this many tokens before reading their ids back: the device never waits for
# the host between them. A stop id among them wastes at most LOOKAHEAD - 1 steps.
LOOKAHEAD = 8


def generate(eng, prompt_ids, max_new_tokens, temperature=0.8, top_k=0, top_p=1.0, rng=None, stop_ids=(),
             speculative=False, stats=None, seed=None):
    """One prompt (token ids, non-empty): an iterator of up to max_new_tokens new ids, as they come; it stops
    after a stop id. A list of prompts: a list of their continuations, decoded together in one batch
    (infer/batch.py), each the tokens the prompt would get alone. The seed of a prompt's draws: `seed` (one for
    every prompt, or a list with one a prompt), else one drawn from rng (a prompt after another from the same
    rng), else a fresh one. A prompt longer than the
    context keeps its last context - 1 tokens; when a sequence reaches the context's end, its last three
    quarters are prefilled again and generation goes on. speculative (one prompt): draft with the K prediction
    heads and verify (see `speculate`); stats (a dict) receives its counts."""
    batch = len(prompt_ids) > 0 and isinstance(prompt_ids[0], (list, tuple, np.ndarray))
    prompts = [list(p) for p in prompt_ids] if batch else [list(prompt_ids)]
    assert all(prompts), "generation needs at least one token to condition on"
    if speculative:
        if batch:
            raise ValueError("speculative decoding takes one prompt")
        return speculate(eng, prompts[0], max_new_tokens, temperature, top_k, top_p, rng, stop_ids, stats)
    if seed is not None:
        seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(prompts)
    else:
        seeds = [int(rng.integers(1 << 63)) if rng is not None else secrets.randbits(64) for _ in prompts]
    settings = dict(temperature=temperature, top_k=top_k, top_p=top_p, stop_ids=tuple(stop_ids))
    tokens = _decode(eng, prompts, max_new_tokens, settings, seeds) if max_new_tokens > 0 else iter(())
    if not batch:
        return (token for _, token in tokens)
    out = [[] for _ in prompts]
    for i, token in tokens:
        out[i].append(token)
    return out


def _decode(eng, prompts, max_new_tokens, settings, seeds):
    """(prompt number, new id) pairs as a BatchGenerator decodes the prompts (a stop id the last of a
    prompt's), LOOKAHEAD steps a read where it can; a sequence that fills the context goes on from the last
    three quarters of its text (its draws continue from the next token index)."""
    ctx, keep = eng.cfg.context, _kept(eng.cfg.context)
    # rows a power of two: the decoder keeps a cache (and its graphs) a size, so few sizes
    rows = next(b for b in decode_buckets(DECODE_ROWS) if b >= min(len(prompts), DECODE_ROWS))
    # slots of the positions the longest prompt and its new tokens take (the model's context where they need it
    # all): no sequence reaches a smaller cache's end, so the tokens are the full cache's
    need = max(min(len(p), ctx - 1) for p in prompts) + max_new_tokens
    gen = BatchGenerator(eng, rows=rows, context=cache_positions(need, ctx))
    history = [list(p) for p in prompts]
    emitted = [0] * len(prompts)
    owner = {}

    def add(i, prompt):
        owner[gen.add(Request(tuple(prompt), max_new_tokens - emitted[i], seed=seeds[i], first_index=emitted[i],
                              **settings))] = i

    try:
        for i, p in enumerate(prompts):
            add(i, p[-(ctx - 1):])
        while gen.busy():
            for t in gen.admit() if gen.can_admit() else gen.step(LOOKAHEAD):  # every prompt in, then decode
                i = owner[t.sequence]
                token = t.sequence.stop_id if t.id is None else t.id  # generate() yields the stop id too
                emitted[i] += 1
                history[i].append(token)
                yield i, token
                if t.finish_reason == "length" and emitted[i] < max_new_tokens:  # the context is full: slide
                    add(i, history[i][-keep:])
    finally:
        gen.close()


def speculate(eng, prompt_ids, max_new_tokens, temperature=0.8, top_k=0, top_p=1.0, rng=None, stop_ids=(),
              stats=None):
    """Self-speculative decoding with the K multi-token heads: at the last position, head 0 gives the next
    token and heads 1..K-1 propose the K-1 after it; one forward over those K tokens verifies the proposals
    against head 0 at each position. The longest agreeing prefix is kept, then the model's own token where
    the first proposal failed, and the cache rolls back past the rejected positions.

    Greedy (temperature 0): a proposal is kept when it is head 0's argmax, so the output is plain greedy
    decoding's; the rounds run on the device, LOOKAHEAD of them chained between reads (Decoder.verify).
    Sampling: a proposal d drawn from head k's distribution q is kept with probability min(1, p(d) / q(d)), p
    head 0's distribution at that position; otherwise the token is drawn from max(0, p - q) normalised: the
    exact speculative-sampling rule, so the output follows p, as plain sampling does. stats (a dict): `steps`
    (verifying forwards), `drafted`, `accepted`, `tokens`, and `per_head`: for heads 1..K-1, [proposals
    verified, proposals accepted] (a head's proposal is verified when the ones before it were accepted)."""
    check_speculative(eng)
    K, ctx, keep = eng.cfg.mtp_heads, eng.cfg.context, _kept(eng.cfg.context)
    rng = rng if rng is not None else np.random.default_rng()
    greedy = temperature == 0
    dist = lambda logits: distribution(logits, temperature, top_k, top_p)
    choose = lambda out: int(out) if greedy else pick(out, temperature, top_k, top_p, rng)
    stats = stats if stats is not None else {}
    for key in ("steps", "drafted", "accepted", "tokens"):
        stats.setdefault(key, 0)
    stats.setdefault("per_head", [[0, 0] for _ in range(K - 1)])
    # room for the prompt, its new tokens and the last chained rounds' drafts: no round finds the cache full
    # before max_new_tokens where the model's context would not
    need = min(len(prompt_ids), ctx - 1) + max_new_tokens + K * (LOOKAHEAD + 1)
    with _generation(eng, prompt_ids, cache_positions(need, ctx)) as (decoder, cache, history):
        heads = _prefill(decoder, cache, history[-(ctx - 1):], True, greedy)  # (K,) ids or (K, V) logits
        first = None  # the next token when already decided (a replacement for a rejected proposal)
        emitted = 0
        while True:
            if first is None:
                first = choose(heads[0])
            if cache.free < K:
                # No room to verify K tokens: one plain step, sliding the window exactly when plain decoding
                # does (when the cache is full), so greedy output stays plain greedy's.
                kept, replacement = [first], None
                if cache.free == 0:
                    cache.rewind(0)
                    heads = _prefill(decoder, cache, (history + kept)[-keep:], True, greedy)
                else:
                    step = decoder.greedy if greedy else decoder.logits
                    heads = step(cache, np.array([kept], dtype=np.int32), all_heads=True)[0, -1]
            elif greedy:
                # steps verified and chained on the device, LOOKAHEAD of them (each keeps at least one id)
                # between reads, so the host never stands between a step and the next
                steps = min(LOOKAHEAD, cache.free // K, max_new_tokens - emitted)
                kept, accepted, heads = decoder.verify(cache, [[first] + [int(d) for d in heads[1:]]], steps)
                for n in accepted:
                    for j in range(min(n + 1, K - 1)):
                        stats["per_head"][j][0] += 1
                        stats["per_head"][j][1] += j < n
                stats["steps"] += steps
                stats["drafted"] += steps * (K - 1)
                stats["accepted"] += sum(accepted)
                replacement = None  # the next token is heads[0]
            else:
                # the K-1 proposals after `first`, each from its head at the last cached position
                q = [dist(heads[k]) for k in range(1, K)]
                drafts = [int(rng.choice(q[k - 1].size, p=q[k - 1])) for k in range(1, K)]
                pos = cache.pos
                out = decoder.logits(cache, np.array([[first] + drafts], dtype=np.int32), all_heads=True)[0]  # K, K, V
                kept, replacement = [first], None
                for j, d in enumerate(drafts):  # d proposes the token after kept[-1], at position pos + j + 1
                    stats["per_head"][j][0] += 1
                    p = dist(out[j, 0])
                    if rng.random() * q[j][d] >= p[d]:
                        replacement = residual_draw(p, q[j], rng)
                        break
                    stats["per_head"][j][1] += 1
                    kept.append(d)
                stats["steps"] += 1
                stats["drafted"] += len(drafts)
                stats["accepted"] += len(kept) - 1
                if len(kept) < K:  # roll back past the rejected proposals (a device write: only when needed)
                    cache.rewind(pos + len(kept))
                heads = out[len(kept) - 1]
            for token in kept:
                yield token
                emitted += 1
                stats["tokens"] += 1
                if token in stop_ids or emitted == max_new_tokens:
                    return
                history.append(token)
            first = replacement


@contextlib.contextmanager
def _generation(eng, prompt_ids, context=None):
    """(decoder, a KV cache for one sequence of `context` positions (default the model's), the token history)
    of one generation; the cache is handed back at its end."""
    history = list(prompt_ids)
    assert history, "generation needs at least one token to condition on"
    decoder = decoder_of(eng)
    cache = decoder.new_cache(1, context)
    try:
        yield decoder, cache, history
    finally:
        decoder.release(cache)


def _kept(context):
    """The tokens a full cache keeps when generation slides its window: the last three quarters."""
    return context - context // 4


def _prefill(decoder, cache, ids, all_heads, greedy):
    """Run ids into the empty cache; decode's result (head 0, or every head) at the last of them. In chunks of
    FEW_ROWS from position 0, as BatchGenerator prefills (the last one's output read): every position is
    then computed by the same kernels in plain and speculative decoding, so their greedy outputs agree to the
    bit."""
    for start in range(0, len(ids) - FEW_ROWS, FEW_ROWS):
        decoder.greedy(cache, np.array([ids[start:start + FEW_ROWS]], dtype=np.int32))
    last = ids[(len(ids) - 1) // FEW_ROWS * FEW_ROWS:]
    step = decoder.greedy if greedy else decoder.logits
    out = step(cache, np.array([last], dtype=np.int32), all_heads=all_heads)[0]
    return out[-1] if all_heads else out


def check_speculative(eng):
    """Speculative decoding drafts with heads 1..K-1: a K = 1 model has none (one-line error)."""
    if eng.cfg.mtp_heads < 2:
        from nanoeuler.errors import UserError
        raise UserError("--speculative needs a checkpoint with K >= 2 prediction heads to draft with; this one "
                        "has 1")


def start_ids(tok, prompt):
    """The prompt's ids; an empty prompt starts from a newline, the start of a line of text."""
    return tok.encode(prompt) or tok.encode("\n")


class TextStream:
    """Writes token ids to a text stream as they come; bytes of a character split across tokens wait for
    the rest, and invalid UTF-8 becomes U+FFFD."""

    def __init__(self, tok, out=None):
        self.tok, self.out = tok, out or sys.stdout
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(self, ids):
        self.out.write(self.decoder.decode(self.tok.decode(ids)))
        self.out.flush()

    def close(self):
        self.out.write(self.decoder.decode(b"", final=True))
        self.out.flush()


def sample_text(eng, tok, prompt, max_new_tokens, temperature=0.8, top_k=0, top_p=1.0, seed=0):
    """The prompt (a string, or token ids: a chat prompt with its template's special tokens) and its
    continuation as one string (for the samples printed during training)."""
    if isinstance(prompt, (list, tuple)):
        prompt_ids, prompt = list(prompt), tok.decode(prompt).decode("utf-8", errors="replace")
    else:
        prompt_ids = start_ids(tok, prompt)
    ids = list(generate(eng, prompt_ids, max_new_tokens, temperature, top_k, top_p,
                        np.random.default_rng(seed), stop_ids=tok.end_ids))
    if ids and ids[-1] in tok.end_ids:
        ids.pop()
    return prompt + tok.decode(ids).decode("utf-8", errors="replace")


def stats_line(tokens, seconds, stats):
    """`--stats`: speed, and for speculative decoding how many drafts the verifying forwards accepted."""
    line = f"{tokens} tokens in {seconds:.2f} s ({tokens / max(seconds, 1e-9):,.1f} tokens/s, prefill included)"
    if stats.get("steps"):
        line += (f"; speculative: {stats['steps']} verifying forwards, accepted {stats['accepted']} of "
                 f"{stats['drafted']} drafts ({stats['accepted'] / stats['steps']:.2f} a step; per head "
                 + ", ".join(f"{k + 1}: {a / max(v, 1):.0%} of {v}" for k, (v, a) in enumerate(stats["per_head"]))
                 + ")")
    return line

