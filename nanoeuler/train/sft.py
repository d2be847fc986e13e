"""Supervised fine-tuning on instruction data: `nanoeuler sft` (the chat template is nanoeuler/template.py).

    nanoeuler sft                                   # data/alpaca.json + nanoeuler.bin -> nanoeuler_chat.bin
    nanoeuler sft --steps 500 --lr 5e-5 --device gpu
    nanoeuler sft --resume                          # continue nanoeuler_chat.bin exactly where it stopped
    nanoeuler sft --show 3                          # print 3 examples as trained, supervised tokens marked

Each Alpaca example ({instruction, input, output}) is rendered with the standard Alpaca prompt template (the
variant with the input field when `input` is not empty, else the one without), and the training sequence is
the prompt's tokens, the response's tokens and `</s>`. The prompt and the response are tokenized separately,
exactly as chat tokenizes a prompt and then generates, so the model is trained on the token boundary it
will see. The loss is masked to the response: the target of every head k at position t is the token at
t+1+k if that token belongs to the response or is `</s>`, else -1 (prompt, padding), so the model learns to
answer, and to stop, not to write prompts.

An example longer than the model's window (context + K tokens) is truncated to the window, which keeps the
prompt and the start of the response and drops the rest and `</s>` (so it never teaches a premature stop);
one whose prompt alone fills the context is skipped, as is every long example with `--long skip`. Both are
counted and printed. A fixed held-out set of examples (`--val-examples`, drawn the same way whatever the
seed) gives the validation loss and bits per byte of the response tokens.

Training is train.fit(), the same loop as pretraining (schedule, clipping, evaluation, samples, atomic
checkpoints, Ctrl-C, JSONL log and PNG curve, exact --resume) with ExampleBatches as its batch source; the
weights come from the pretrained checkpoint (`--ckpt`), the optimizer starts fresh, and the result is saved
with `chat` = 1 in its metadata, which tells `nanoeuler chat` to wrap each line in the template.
"""
import os
import sys
import time

import numpy as np
from tqdm import tqdm

from nanoeuler.io import checkpoint
from nanoeuler.data import template
from nanoeuler.model.config import param_count
from nanoeuler.data.corpus import windows_to_batch
from nanoeuler.errors import UserError
from nanoeuler.data.template import PROMPT_NO_INPUT, PROMPT_WITH_INPUT, render_prompt  # noqa: F401 (sft.render_prompt)
from nanoeuler.train.pretrain import (batch_text, eval_limits, fit, output_paths, replace_note, resume_checkpoint,
                             run_device, run_engine, run_hyper, run_world, schedule_text,
                             Hyper)  # noqa: F401 (Hyper: sft.Hyper)

DEFAULT_DATA = "data/alpaca.json"
# For the base model on one GPU: about one epoch of Alpaca (52K examples, 500 held out) at 32 per batch.
SFT_HYPER = Hyper(steps=1500, batch_size=32, lr=1e-4, warmup=50, eval_every=100, sample_every=500,
                  ckpt_every=500)
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


def eval_batches(examples, byte_len, batch, context, K, limit=None):
    """(inputs, targets, n_bytes) batches over the held-out examples, in order; n_bytes counts the bytes of
    the supervised head-0 targets (for bits per byte). With `limit`, that many batches spread evenly."""
    groups = [examples[i:i + batch] for i in range(0, len(examples), batch)]
    if limit is not None and limit < len(groups):
        groups = [groups[i] for i in np.linspace(0, len(groups) - 1, limit).round().astype(int)]
    out = []
    for group in groups:
        inputs, targets = make_batch(group, context, K)
        valid = targets[0][targets[0] >= 0]
        out.append((inputs, targets, int(byte_len[valid].sum())))
    return out


def read_data(path):
    """The examples of an Alpaca JSON file; every way it can be wrong is a one-line UserError."""
    from nanoeuler.data.fetch import read_alpaca
    if not os.path.exists(path):
        hint = " (fetch Alpaca with `sh data/get_alpaca.sh`)" if path == DEFAULT_DATA else ""
        raise UserError(f"instruction data {path} not found{hint}")
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
    """Bytes per token id for bits per byte; </s> counts as one byte (the end of the text) rather than
    the four of its name, and keeps bits per byte finite for an empty response."""
    byte_len = np.array([len(tok.decode([i])) for i in range(tok.vocab_size)], dtype=np.int64)
    byte_len[tok.eos_id] = 1
    return byte_len


# ------------------------------------------------------------------------------------------ --show
GREEN, RESET = "\x1b[1;32m", "\x1b[0m"


def marked(tok, ids, n_prompt, color):
    """The example's text with its supervised tokens (ids[n_prompt:]) in bold green, or in [[ ]]."""
    prompt = tok.decode(ids[:n_prompt]).decode("utf-8", errors="replace")
    response = tok.decode(ids[n_prompt:]).decode("utf-8", errors="replace")
    return prompt + (GREEN + response + RESET if color else "[[" + response + "]]")


def show(args):
    ck = checkpoint.load(args.ckpt)
    tok, cfg = ck.tokenizer(), ck.cfg
    data = read_data(args.data or DEFAULT_DATA)
    color = sys.stdout.isatty()
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    where = "in bold green" if color else "between [[ and ]]"
    print(f"{min(args.show, len(data))} of {len(data)} examples as `nanoeuler sft` trains them with "
          f"{args.ckpt}'s tokenizer and window ({cfg.context} + {cfg.mtp_heads} tokens); the supervised "
          f"tokens, the only ones in the loss, are {where}.")
    for i, example in enumerate(data[:args.show]):
        ids, n_prompt = encode_example(tok, example)
        fitted, status = fit_example(ids, n_prompt, cfg.context, cfg.mtp_heads, args.long or "truncate")
        window = cfg.context + cfg.mtp_heads
        why = "--long skip" if args.long == "skip" else "the prompt alone fills the context"
        note = {"ok": "", "skipped": f"; SKIPPED: longer than the window of {window} and {why}",
                "truncated": f"; TRUNCATED to {window} (the rest and </s> are not trained)"}[status]
        print(f"\n=== example {i} ({'with' if example['input'] else 'no'} input): {len(ids)} tokens, "
              f"{0 if fitted is None else len(fitted) - n_prompt} supervised{note}")
        if fitted is None:  # nothing of it is trained
            print(tok.decode(ids).decode("utf-8", errors="replace"))
        else:
            print(marked(tok, fitted, n_prompt, color))
    return 0


# ------------------------------------------------------------------------------------------ the command
def main(args):
    if args.show is not None:
        return show(args)
    from nanoeuler.model.device import wants_gpu
    from nanoeuler.train.distributed import DataParallel, make_communicator

    world = run_world(args)
    say = print if world.is_main else (lambda *a, **k: None)
    out, log_path = output_paths(args)
    ck = resume_checkpoint(args, "sft", "nanoeuler sft")
    if ck is not None:
        state = ck.train_state
        for flag, key in (("long", "long"), ("val_examples", "val_examples")):
            given = getattr(args, flag)
            if given is not None and given != state[key]:
                raise UserError(f"--resume: {out} was trained with --{flag.replace('_', '-')} {state[key]}; "
                                f"the held-out split and the examples cannot change mid-run")
        data_path, long, n_val, base = args.data or state["data"], state["long"], state["val_examples"], \
            state["base"]
        start = ck
    else:
        start = checkpoint.load(args.ckpt)
        data_path, long, n_val, base = args.data or DEFAULT_DATA, args.long or "truncate", args.val_examples, \
            args.ckpt
    hp = run_hyper(args, ck, SFT_HYPER, world.world_size)
    cfg, tok = start.cfg, start.tokenizer()
    device = run_device(args, cfg, out, log_path, world.world_size)
    comm = make_communicator(world, device)

    data = read_data(data_path)
    train_idx, val_idx = split(len(data), n_val)
    n_val = len(val_idx)
    train, val, counts = prepare(data, train_idx, val_idx, tok, cfg.context, cfg.mtp_heads, long,
                                 progress=world.is_main)
    lengths = np.array([len(ids) for ids, _ in train])
    say(f"data: {data_path}: {len(data):,} examples: {counts['train']:,} for training, {counts['val']:,} "
        f"held out; {counts['truncated']:,} truncated and {counts['skipped']:,} skipped (longer than "
        f"{cfg.context} + {cfg.mtp_heads} tokens, --long {long}); {int(np.median(lengths))} tokens per "
        f"training example (median), {int(lengths.max())} at most")
    source = ExampleBatches(train, hp.batch_size * hp.grad_accum, cfg.context, cfg.mtp_heads, hp.seed,
                            world.rank, world.world_size)
    byte_len = response_byte_len(tok)
    final, periodic = eval_limits(hp, world)
    val_full = eval_batches(val, byte_len, hp.batch_size, cfg.context, cfg.mtp_heads, limit=final)
    val_quick = eval_batches(val, byte_len, hp.batch_size, cfg.context, cfg.mtp_heads, limit=periodic)

    eng = run_engine(cfg, device, args, hp, ck, source, params=start.params)
    parallel = DataParallel(eng, comm, zero=args.zero == 1)
    slow = device == "cpu" and wants_gpu(cfg)
    if ck is not None:
        origin = f"{out} (step {ck.step}, fine-tuned from {base})"
    else:
        origin = f"{base} (step {start.step}{', already a chat model' if start.chat else ''})"
    say(f"model: {origin}, {param_count(cfg) / 1e6:.2f}M parameters, context {cfg.context}, "
        f"{device.upper()} engine in {eng.precision}"
        + (" (no GPU: this will be slow)" if slow else ""))
    first_step = ck.step if ck is not None else 0
    say(f"fine-tuning: steps {first_step + 1}..{hp.steps} of {batch_text(hp, world)} examples, loss on the "
        f"responses only, peak lr {hp.lr:g}, warmup {hp.warmup}, {schedule_text(hp)}; log {log_path}"
        + (f"; resuming {out}" if args.resume else ""))
    if world.is_main:
        replace_note(out, ck)
    sys.stdout.flush()
    first = data[val_idx[0]]  # the samples during training answer a held-out instruction
    t0 = time.perf_counter()
    status = fit(eng, tok, source, val_quick, val_full, hp, out, log_path, start_step=first_step,
                 train_state=dict(kind="sft", data=os.path.abspath(data_path), base=os.path.abspath(base),
                                  precision=eng.precision,
                                  long=long, val_examples=n_val, examples=counts),
                 chat=True, sample_prompt=render_prompt(first["instruction"], first["input"]),
                 title="nanoeuler sft",
                 log_first=dict(examples_truncated=counts["truncated"], examples_skipped=counts["skipped"]),
                 parallel=parallel)
    if status == 0:
        say(f"done in {time.perf_counter() - t0:.0f} s: saved {out} (a chat model: `nanoeuler chat --ckpt "
            f"{out}`), log {log_path}")
    return status
