"""Supervised fine-tuning on instruction data: `nanoeuler sft`.

    nanoeuler sft                                   # data/alpaca.json + nanoeuler.bin -> nanoeuler_chat.bin
    nanoeuler sft --steps 500 --lr 5e-5 --device gpu
    nanoeuler sft --resume                          # continue nanoeuler_chat.bin exactly where it stopped
    nanoeuler sft --show 3                          # print 3 examples as trained, supervised tokens marked

The stage's hooks on the shared skeleton (run.py): the weights of a pretrained checkpoint (`--ckpt`; the
optimizer starts fresh), Alpaca examples in the chat template with the loss masked to the responses
(data/instructions.py), the cross-entropy objective. The result is saved with `chat` = 1 in its metadata,
which tells `nanoeuler chat` to wrap each line in the template.
"""
import os
import sys

import numpy as np

from nanoeuler.data.instructions import (DEFAULT_DATA, ExampleBatches, encode_example, eval_batches, fit_example,
                                         prepare, read_data, response_byte_len, split)
from nanoeuler.data.corpus import provenance
from nanoeuler.data.template import render_prompt, sample_prompt  # noqa: F401 (the prompt sft trains on)
from nanoeuler.io import checkpoint
from nanoeuler.train.loop import Hyperparameters
from nanoeuler.train.objectives import CrossEntropy
from nanoeuler.train.run import Stage, refuse_changed_flags, run_stage

# For the base model on one GPU: about one epoch of Alpaca (52K examples, 500 held out) at 32 per batch.
SFT_HYPER = Hyperparameters(steps=1500, batch_size=32, lr=1e-4, warmup=50, eval_every=100, sample_every=500,
                            ckpt_every=500)


class FineTune(Stage):
    kind, command = "sft", "nanoeuler sft"

    def begin(self, run):
        args, ck = run.args, run.ck
        if ck is not None:
            state = ck.train_state
            refuse_changed_flags(run, ("long", "val_examples"), "the held-out split and the examples cannot change "
                                 "mid-run")
            self.data, self.long, self.n_val, self.base = (args.data or state["data"], state["long"],
                                                           state["val_examples"], state["base"])
            self.start = ck
        else:
            self.start = checkpoint.load(args.ckpt)
            self.data, self.long, self.n_val, self.base = (args.data or DEFAULT_DATA, args.long or "truncate",
                                                           args.val_examples, args.ckpt)
            run.params = self.start.params
        run.cfg, run.tok, run.hyper = self.start.cfg, self.start.tokenizer(), SFT_HYPER

    def load(self, run):
        cfg, hp, world = run.cfg, run.hp, run.world
        data = read_data(self.data)
        train_idx, val_idx = split(len(data), self.n_val)
        self.n_val = len(val_idx)
        self.first = data[val_idx[0]]  # the samples during training answer a held-out instruction
        train, val, self.counts = prepare(data, train_idx, val_idx, run.tok, cfg.context, cfg.mtp_heads, self.long,
                                          progress=world.is_main)
        lengths = np.array([len(ids) for ids, _ in train])
        counts = self.counts
        run.say(f"data: {self.data}: {len(data):,} examples: {counts['train']:,} for training, {counts['val']:,} "
                f"held out; {counts['truncated']:,} truncated and {counts['skipped']:,} skipped (longer than "
                f"{cfg.context} + {cfg.mtp_heads} tokens, --long {self.long}); {int(np.median(lengths))} tokens per "
                f"training example (median), {int(lengths.max())} at most")
        run.source = ExampleBatches(train, hp.batch_size * hp.grad_accum, cfg.context, cfg.mtp_heads, hp.seed,
                                    world.rank, world.world_size)
        byte_len = response_byte_len(run.tok)
        final, periodic = run.eval_limits()
        run.val_full, run.val_quick = (eval_batches(val, byte_len, hp.batch_size, cfg.context, cfg.mtp_heads,
                                                    limit=limit) for limit in (final, periodic))

    def origin(self, run):
        if run.ck is not None:
            return f"{run.out} (step {run.ck.step}, fine-tuned from {self.base})"
        return f"{self.base} (step {self.start.step}{', already a chat model' if self.start.chat else ''})"

    def plan(self, run):
        return "fine-tuning", " examples, loss on the responses only"

    def objective(self, run):
        return CrossEntropy(run.comm)

    def train_state(self, run):
        return dict(data=os.path.abspath(self.data), base=os.path.abspath(self.base), long=self.long,
                    val_examples=self.n_val, examples=self.counts)

    def fit_options(self, run):
        return dict(chat=True, sample_prompt=sample_prompt(run.tok, self.first["instruction"], self.first["input"]),
                    title="nanoeuler sft", log_first=dict(examples_truncated=self.counts["truncated"],
                                                          examples_skipped=self.counts["skipped"],
                                                          data=provenance(self.data) if run.world.is_main else None))

    def done(self, run):
        return f"saved {run.out} (a chat model: `nanoeuler chat --ckpt {run.out}`), log {run.log_path}"


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


def main(args):
    if args.show is not None:
        return show(args)
    return run_stage(FineTune(), args)
