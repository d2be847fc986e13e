"""Supervised fine-tuning on instruction data: `nanoeuler sft`.

    nanoeuler sft                                   # data/alpaca.json + nanoeuler.bin -> nanoeuler_chat.bin
    nanoeuler sft --steps 500 --lr 5e-5 --device gpu
    nanoeuler sft --resume                          # continue nanoeuler_chat.bin exactly where it stopped
    nanoeuler sft --show 3                          # print 3 examples as trained, supervised tokens marked

The stage's functions on the shared skeleton (run.py): the weights of a pretrained checkpoint (`--ckpt`; the
optimizer starts fresh), Alpaca examples in the chat template with the loss masked to the responses
(data/instructions.py), the cross-entropy objective. The result is saved with `chat` = 1 in its metadata,
which tells `nanoeuler chat` to wrap each line in the template.
"""
import os
import sys
from typing import NamedTuple

import numpy as np

from nanoeuler.data.instructions import (DEFAULT_DATA, ExampleBatches, encode_example, eval_batches, fit_example,
                                         prepare, read_data, response_byte_len, split)
from nanoeuler.data.corpus import provenance
from nanoeuler.data.template import render_prompt, sample_prompt  # noqa: F401 (the prompt sft trains on)
from nanoeuler.io import checkpoint
from nanoeuler.train import resume
from nanoeuler.train.loop import Hyperparameters, Validation
from nanoeuler.train.objectives import CrossEntropy
from nanoeuler.train.options import SftOptions
from nanoeuler.train.run import Data, Model, Stage, run

# For the base model on one GPU: about one epoch of Alpaca (52K examples, 500 held out) at 32 per batch.
SFT_HYPER = Hyperparameters(steps=1500, batch_size=32, lr=1e-4, warmup=50, eval_every=100, sample_every=500,
                            ckpt_every=500)


class FineTuning(NamedTuple):
    """The SFT run's own settings: the examples, --long, the held-out examples asked for, the checkpoint it was
    fine-tuned from (a path), and the checkpoint its weights start from (the base, or the resumed run)."""
    data: str
    long: str
    n_val: int
    base: str
    start: object


def plan(options, resumed, stored=False):
    """The model of the pretrained checkpoint (--ckpt; stored: its weights left in the file, read a shard at a
    time), or of the resumed run, whose held-out split and examples cannot change."""
    if resumed is not None:
        state = resumed.train_state
        resume.refuse_changed(options, resumed, ("long", "val_examples"), "the held-out split and the examples "
                              "cannot change mid-run")
        settings = FineTuning(options.data or state["data"], state["long"], state["val_examples"], state["base"],
                              resumed)
        return Model(resumed.cfg, SFT_HYPER, f"{options.out} (step {resumed.step}, fine-tuned from "
                     f"{settings.base})", settings=settings)
    start = checkpoint.load(options.ckpt, stored_params=stored)
    settings = FineTuning(options.data or DEFAULT_DATA, options.long or "truncate", options.val_examples,
                          options.ckpt, start)
    return Model(start.cfg, SFT_HYPER, f"{options.ckpt} (step {start.step}"
                 f"{', already a chat model' if start.chat else ''})", start.params, settings,
                 start.quantized)


def load(options, model, context):
    """The examples in the chat template, their batches and held-out batches, and the objective."""
    settings, cfg, hp, world = model.settings, model.cfg, context.hyper, context.world
    tok = settings.start.tokenizer()
    data = read_data(settings.data)
    train_idx, val_idx = split(len(data), settings.n_val)
    first = data[val_idx[0]]  # the samples during training answer a held-out instruction
    train, val, counts = prepare(data, train_idx, val_idx, tok, cfg.context, cfg.mtp_heads, settings.long,
                                 progress=world.is_main)
    lengths = np.array([len(ids) for ids, _ in train])
    context.say(f"data: {settings.data}: {len(data):,} examples: {counts['train']:,} for training, {counts['val']:,} "
                f"held out; {counts['truncated']:,} truncated and {counts['skipped']:,} skipped (longer than "
                f"{cfg.context} + {cfg.mtp_heads} tokens, --long {settings.long}); {int(np.median(lengths))} tokens "
                f"per training example (median), {int(lengths.max())} at most")
    source = ExampleBatches(train, hp.batch_size * hp.grad_accum, cfg.context, cfg.mtp_heads, hp.seed,
                            world.rank, world.world_size)
    byte_len = response_byte_len(tok)
    full, quick = (eval_batches(val, byte_len, hp.batch_size, cfg.context, cfg.mtp_heads, limit=limit)
                   for limit in context.eval_limits())
    state = dict(data=os.path.abspath(settings.data), base=os.path.abspath(settings.base), long=settings.long,
                 val_examples=len(val_idx), examples=counts)
    return Data(cfg, tok, source, Validation(quick, full), CrossEntropy(context.comm), state, "fine-tuning",
                " examples, loss on the responses only", chat=True,
                sample_prompt=sample_prompt(tok, first["instruction"], first["input"]), title="nanoeuler sft",
                log_first=dict(examples_truncated=counts["truncated"], examples_skipped=counts["skipped"],
                               data=provenance(settings.data) if world.is_main else None),
                done=f"saved {options.out} (a chat model: `nanoeuler chat --ckpt {options.out}`), log "
                     f"{context.log_path}")


STAGE = Stage("sft", "nanoeuler sft", plan, load)


# ------------------------------------------------------------------------------------------ --show
GREEN, RESET = "\x1b[1;32m", "\x1b[0m"


def marked(tok, ids, n_prompt, color):
    """The example's text with its supervised tokens (ids[n_prompt:]) in bold green, or in [[ ]]."""
    prompt = tok.decode(ids[:n_prompt]).decode("utf-8", errors="replace")
    response = tok.decode(ids[n_prompt:]).decode("utf-8", errors="replace")
    return prompt + (GREEN + response + RESET if color else "[[" + response + "]]")


def show(options):
    """--show N: the first N examples as `nanoeuler sft` trains them, the supervised tokens marked."""
    ck = checkpoint.load(options.ckpt)
    tok, cfg = ck.tokenizer(), ck.cfg
    data = read_data(options.data or DEFAULT_DATA)
    color = sys.stdout.isatty()
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    where = "in bold green" if color else "between [[ and ]]"
    print(f"{min(options.show, len(data))} of {len(data)} examples as `nanoeuler sft` trains them with "
          f"{options.ckpt}'s tokenizer and window ({cfg.context} + {cfg.mtp_heads} tokens); the supervised "
          f"tokens, the only ones in the loss, are {where}.")
    for i, example in enumerate(data[:options.show]):
        ids, n_prompt = encode_example(tok, example)
        fitted, status = fit_example(ids, n_prompt, cfg.context, cfg.mtp_heads, options.long or "truncate")
        window = cfg.context + cfg.mtp_heads
        why = "--long skip" if options.long == "skip" else "the prompt alone fills the context"
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
    options = SftOptions.from_args(args)
    if options.show is not None:
        return show(options)
    return run(STAGE, options)
