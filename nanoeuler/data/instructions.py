"""Instruction data for supervised fine-tuning (`nanoeuler sft`): Alpaca examples as training sequences.

Each example ({instruction, input, output}) is rendered with the chat template (template.py): the prompt's
tokens, the response's tokens and `</s>`, tokenized separately as chat tokenizes a prompt and then
generates; with a model's own template (an imported chat model), the user message and the assistant reply
in it, the reply's tokens through its end token. The loss is masked to the response: the target of every
head k at position t is the token at t+1+k if that token belongs to the response or ends it, else -1
(prompt, padding).

An example longer than the model's window (context + K tokens) is truncated to the window, which keeps the
prompt and the start of the response and drops the rest and `</s>` (so it never teaches a premature stop);
one whose prompt alone fills the context is skipped, as is every long example with `--long skip`. A fixed
held-out set (`split`, drawn the same way whatever the seed) gives the validation loss.
"""
import json
import os

import numpy as np
from tqdm import tqdm

from nanoeuler.data import template
from nanoeuler.data.corpus import fetch_hint, windows_to_batch
from nanoeuler.errors import UserError

DEFAULT_DATA = "data/alpaca.json"
MAX_VAL = 500      # held-out examples by default: a twentieth of the data, at most this many
SPLIT_SEED = 1234  # the held-out set does not move with --seed, so validation losses stay comparable
PAD_MULTIPLE = 64  # a batch is padded to its longest example rounded up to this (few distinct shapes)


def encode_example(tok, example):
    """(ids, n_prompt): the prompt's tokens, then the response's and </s>; ids[n_prompt:] are supervised."""
    return template.encode(tok, example["instruction"], example["output"], example["input"])


def fit_example(ids, n_prompt, context, K, long="truncate"):
    """(ids, status) with status "ok", "truncated" (ids cut to the window of context + K tokens) or
    "skipped" (ids None): skipped when the prompt alone fills the context, or with long="skip"."""
    if len(ids) <= context + K:
        return ids, "ok"
    if long == "skip" or n_prompt >= context:
        return None, "skipped"
    return ids[:context + K], "truncated"


def make_batch(examples, context, K):
    """Examples (ids, n_prompt) -> inputs (B, T) int32 and targets (K, B, T) int32, one example per row from
    position 0. targets[k, b, t] = ids[t+1+k] where that is a response token or </s>, else -1. T is the
    longest input rounded up to PAD_MULTIPLE (at most the context): a batch of short examples is cheap."""
    need = max(len(ids) - 1 for ids, _ in examples)
    T = min(context, -(-need // PAD_MULTIPLE) * PAD_MULTIPLE)
    win = np.full((len(examples), T + K), -1, dtype=np.int64)       # (B, T + K) tokens, -1 after the end
    supervised = np.zeros(win.shape, dtype=bool)
    for row, (ids, n_prompt) in enumerate(examples):
        win[row, :len(ids)] = ids
        supervised[row, n_prompt:len(ids)] = True
    inputs = windows_to_batch(np.maximum(win, 0), T, K)[0]  # padding inputs: any id, nothing reads them
    targets = windows_to_batch(np.where(supervised, win, -1), T, K)[1]
    return inputs, targets


class ExampleBatches:
    """SFT batches for train.fit(): `batch` examples at a time, in a shuffled order that is drawn afresh for
    each epoch from (seed, epoch), so the state is two integers and resumes exactly. With N ranks, each step
    takes the next N x batch examples of that order and rank r keeps the r-th `batch` of them (as
    data.RandomWindows does), so the state is the same on every rank and resumes on any number of ranks."""

    def __init__(self, examples, batch, context, K, seed, rank=0, world_size=1):
        self.examples, self.batch, self.context, self.K = examples, batch, context, K
        self.rank, self.world_size = rank, world_size
        self.load_state({"seed": seed, "epoch": 0, "pos": 0})

    def load_state(self, state):
        self.seed, self.epoch, self.pos = state["seed"], state["epoch"], state["pos"]
        self.order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.examples))

    def state(self):
        return {"seed": self.seed, "epoch": self.epoch, "pos": self.pos}

    def picks(self):
        """This rank's indices into the examples for the next batch."""
        picks = []
        while len(picks) < self.batch * self.world_size:
            if self.pos == len(self.order):
                self.load_state({"seed": self.seed, "epoch": self.epoch + 1, "pos": 0})
            picks.append(self.order[self.pos])
            self.pos += 1
        return picks[self.rank * self.batch:(self.rank + 1) * self.batch]

    def next(self):
        return make_batch([self.examples[i] for i in self.picks()], self.context, self.K)


def held_out_groups(n, batch, limit=None):
    """Indices 0..n-1 in consecutive groups of `batch` (the last may be short); with `limit`, that many of the
    groups, spread evenly: the held-out batches of SFT and DPO, all of them or a cheaper sample."""
    groups = [np.arange(i, min(i + batch, n)) for i in range(0, n, batch)]
    if limit is not None and limit < len(groups):
        groups = [groups[i] for i in np.linspace(0, len(groups) - 1, limit).round().astype(int)]
    return groups


def eval_batches(examples, byte_len, batch, context, K, limit=None):
    """(inputs, targets, n_bytes) batches over the held-out examples, in order; n_bytes counts the bytes of
    the supervised head-0 targets (for bits per byte). With `limit`, that many batches spread evenly."""
    out = []
    for group in held_out_groups(len(examples), batch, limit):
        inputs, targets = make_batch([examples[i] for i in group], context, K)
        valid = targets[0][targets[0] >= 0]
        out.append((inputs, targets, int(byte_len[valid].sum())))
    return out


def read_alpaca(path):
    """The examples of an Alpaca file, checked to be a non-empty JSON list of {instruction, input, output}
    strings; the downloader (fetch.py) checks what it fetched with it too."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"not JSON ({e})") from None
    if not isinstance(data, list) or not data:
        raise UserError("expected a non-empty JSON list of examples")
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise UserError(f"example {i} is not an object")
        for key in ("instruction", "input", "output"):
            if not isinstance(item.get(key), str):
                raise UserError(f"example {i} has no string {key!r}")
    return data


def read_data(path):
    """The examples of an Alpaca JSON file; every way it can be wrong is a one-line UserError."""
    if not os.path.exists(path):
        raise UserError(f"instruction data {path} not found{fetch_hint(path)}")
    if not os.path.isfile(path):
        raise UserError(f"instruction data {path} is not a file")
    try:
        return read_alpaca(path)
    except UserError as e:
        raise UserError(f"{path} is not Alpaca instruction data: {e}") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None


def split(n, n_val):
    """(train indices, held-out indices): n_val examples drawn with a fixed seed, both in file order."""
    if n_val is None:
        n_val = min(MAX_VAL, max(1, n // 20))
    if not 1 <= n_val < n:
        raise UserError(f"--val-examples {n_val}: needs at least 1 held-out and 1 training example of {n}")
    held = np.zeros(n, dtype=bool)
    held[np.random.default_rng(SPLIT_SEED).permutation(n)[:n_val]] = True
    return np.flatnonzero(~held), np.flatnonzero(held)


def prepare(data, train_idx, val_idx, tok, context, K, long, progress=True):
    """Tokenize and fit the examples: (train examples, held-out examples, counts)."""
    counts = {"ok": 0, "truncated": 0, "skipped": 0}
    parts = []
    bar = tqdm(total=len(data), desc="tokenizing", unit="ex", disable=not progress, leave=False)
    for indices in (train_idx, val_idx):
        kept = []
        for i in indices:
            ids, n_prompt = encode_example(tok, data[i])
            ids, status = fit_example(ids, n_prompt, context, K, long)
            counts[status] += 1
            if ids is not None:
                kept.append((ids, n_prompt))
            bar.update(1)
        parts.append(kept)
    bar.close()
    train, val = parts
    if not train or not val:
        raise UserError(f"every {'training' if not train else 'held-out'} example is longer than the model's "
                        f"context of {context} tokens; use shorter examples")
    return train, val, {"train": len(train), "val": len(val), "truncated": counts["truncated"],
                        "skipped": counts["skipped"]}


def response_byte_len(tok):
    """Bytes per token id for bits per byte; an end token (</s>, an imported model's end ids) counts as one
    byte (the end of the text) rather than the bytes of its name, and keeps bits per byte finite for an
    empty response."""
    byte_len = np.array([len(tok.decode([i])) for i in range(tok.vocab_size)], dtype=np.int64)
    byte_len[list(tok.end_ids)] = 1
    return byte_len


