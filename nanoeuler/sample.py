"""Text generation with the KV cache: `nanoeuler infer "PROMPT"`, and the samples printed during training.

    nanoeuler infer "To be, or not to be" --max-new-tokens 200 --temperature 0.8 --top-k 40 --seed 1

The prompt is run through the model once (prefill), then each new token is decoded against the cache, so a
token costs one position of compute, not the whole window. The context is a hard limit of the model (RoPE
positions it was trained on): a prompt longer than the context keeps its last tokens, and when generation
fills the cache the last three quarters of the text are re-run into a fresh cache and generation goes on.
Tokens are streamed as they come, through an incremental UTF-8 decoder so a character split across tokens
is printed whole.
"""
import codecs
import os
import sys

import numpy as np


def pick(logits, temperature, top_k, top_p, rng):
    """Choose the next token id from logits (V,): greedy at temperature 0, else sample from the softmax at
    that temperature restricted to the top_k most likely tokens (0: all) and to the smallest set whose
    probability reaches top_p (nucleus)."""
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    if 0 < top_k < z.size:
        z[z < np.partition(z, -top_k)[-top_k]] = -np.inf
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        keep = int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1
        p[order[keep:]] = 0
        p /= p.sum()
    return int(rng.choice(p.size, p=p))


def generate(eng, prompt_ids, max_new_tokens, temperature=0.8, top_k=0, top_p=1.0, rng=None, stop_ids=()):
    """Yield up to max_new_tokens new token ids continuing prompt_ids (non-empty); stops after a stop id."""
    ctx = eng.cfg.context
    keep = ctx - ctx // 4
    rng = rng if rng is not None else np.random.default_rng()
    history = list(prompt_ids)
    assert history, "generation needs at least one token to condition on"
    cache = eng.new_cache(1)
    logits = eng.decode(cache, np.array([history[-ctx:]], dtype=np.int32))[0]
    for i in range(max_new_tokens):
        token = pick(logits, temperature, top_k, top_p, rng)
        yield token
        if token in stop_ids or i == max_new_tokens - 1:
            return
        history.append(token)
        if cache.pos == ctx:  # the cache is full: slide the window
            cache = eng.new_cache(1)
            logits = eng.decode(cache, np.array([history[-keep:]], dtype=np.int32))[0]
        else:
            logits = eng.decode(cache, np.array([[token]], dtype=np.int32))[0]


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
    """The prompt and its continuation as one string (for the samples printed during training)."""
    ids = list(generate(eng, start_ids(tok, prompt), max_new_tokens, temperature, top_k, top_p,
                        np.random.default_rng(seed), stop_ids=(tok.eos_id,)))
    if ids and ids[-1] == tok.eos_id:
        ids.pop()
    return prompt + tok.decode(ids).decode("utf-8", errors="replace")


def load_model(ckpt, device):
    """Checkpoint path -> (engine, tokenizer, checkpoint), on the resolved device."""
    from nanoeuler import checkpoint
    from nanoeuler.device import resolve
    from nanoeuler.model import make_engine
    ck = checkpoint.load(ckpt)
    tok = ck.tokenizer()
    eng = make_engine(ck.cfg, device=resolve(device))
    eng.load_params(ck.params)
    return eng, tok, ck


def main(args):
    eng, tok, _ = load_model(args.ckpt, args.device)
    ids = start_ids(tok, os.fsencode(args.prompt))  # the bytes as typed, even ones that are not UTF-8
    if len(ids) > eng.cfg.context:
        print(f"note: the prompt is {len(ids)} tokens; the model sees its last {eng.cfg.context}",
              file=sys.stderr)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")  # a terminal that cannot show a character gets '?'
    stream = TextStream(tok)
    stream.out.write(args.prompt)
    rng = np.random.default_rng(args.seed)
    for token in generate(eng, ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p, rng,
                          stop_ids=(tok.eos_id,)):
        if token != tok.eos_id:
            stream.write([token])
    stream.close()
    stream.out.write("\n")
    return 0

