"""Pretraining: `nanoeuler train [small|big|base|large]`, one loop for the CPU and the GPU engine.

    nanoeuler train small --data shakespeare.txt          # `make train`: 1.1M params, CPU, minutes
    nanoeuler train big                                   # 14.2M params, the GPU if there is one
    nanoeuler train small --resume                        # continue nanoeuler.bin exactly where it stopped
    nanoeuler train --ckpt smollm.bin --data my.txt --out more.bin --lr 1e-4   # continued pretraining of an import

The stage's functions on the shared skeleton (run.py): `plan`, a preset (or the resumed checkpoint's model, or
--ckpt's); `load`, a tokenizer (the checkpoint's, --tokenizer, or one learned on the corpus by rank 0), the
corpus as random windows for training and its held-out last tenth for the validation loss and bits per byte;
the objective is the cross-entropy of the K heads (objectives.py).
"""
import dataclasses
import os
from typing import NamedTuple

from nanoeuler.data.corpus import (RandomWindows, check_corpus, count_token, eval_batches, open_corpus, provenance,
                                   unclosed_fetch)
from nanoeuler.errors import UserError
from nanoeuler.io import checkpoint
from nanoeuler.model.config import PRESETS
from nanoeuler.tokenizer.bpe import Tokenizer
from nanoeuler.parallel.comm import broadcast_text
from nanoeuler.train.loop import Hyperparameters, Validation
from nanoeuler.train.objectives import CrossEntropy
from nanoeuler.train.options import PretrainOptions
from nanoeuler.train.run import Data, Model, Stage, run

# small: `make train` on 2 CPU cores, its schedule chosen by the sweeps of docs/training-small.md; big and
# base: one GPU; large: base's tokens per step in 4 passes, for a 12 GB card.
PRESET_HYPER = {
    "small": Hyperparameters(steps=2900, batch_size=32, lr=4e-3, warmup=100, eval_every=125, sample_every=500,
                             ckpt_every=250, eval_batches=4, min_lr_ratio=0.0, decay_frac=0.4),
    "big": Hyperparameters(steps=5000, batch_size=32, lr=1e-3, warmup=200, eval_every=250, sample_every=1000,
                           ckpt_every=500),
    "base": Hyperparameters(steps=20000, batch_size=16, lr=6e-4, warmup=1000, eval_every=500,
                            sample_every=2000, ckpt_every=1000, eval_batches=16, final_eval_batches=256),
    "large": Hyperparameters(steps=20000, batch_size=4, grad_accum=4, lr=4e-4, warmup=1000, eval_every=500,
                             sample_every=2000, ckpt_every=1000, eval_batches=64, final_eval_batches=1024),
}
DEFAULT_DATA = {"small": "shakespeare.txt", "big": "shakespeare.txt", "base": "data/pretrain.txt",
                "large": "data/pretrain.txt"}


class Pretraining(NamedTuple):
    """The pretraining run's own settings: the preset (its hyperparameters), the corpus, and the checkpoint that
    --ckpt continues (None: a fresh model, or the resumed run's)."""
    preset: str
    data: str
    start: object = None


def plan(options, resumed, stored=False):
    """The model: the resumed run's, --ckpt's (its weights and tokenizer; a fresh optimizer; stored: its weights
    left in the file, read a shard at a time), or the preset's."""
    if resumed is not None:
        preset = resumed.train_state["preset"]
        if options.preset not in (None, preset):
            raise UserError(f"--resume: {options.out} is a {preset} model, not {options.preset}")
        settings = Pretraining(preset, options.data or resumed.train_state["data"])
        return Model(resumed.cfg, PRESET_HYPER[preset], preset, settings=settings)
    if options.ckpt:  # continued pretraining: the checkpoint's model, weights and tokenizer, a fresh optimizer
        if options.tokenizer:
            raise UserError("--ckpt brings its own tokenizer; leave out --tokenizer")
        start = checkpoint.load(options.ckpt, stored_params=stored)
        preset = options.preset or "base"
        return Model(start.cfg, PRESET_HYPER[preset],
                     f"{options.ckpt} (step {start.step}), {preset}'s hyperparameters", start.params,
                     Pretraining(preset, options.data or DEFAULT_DATA[preset], start))
    preset = options.preset or "small"
    # its vocabulary is close enough to the final one for the device rule
    return Model(PRESETS[preset], PRESET_HYPER[preset], preset,
                 settings=Pretraining(preset, options.data or DEFAULT_DATA[preset]))


def load(options, model, context):
    """The tokenizer, the corpus's windows and held-out batches, and the objective."""
    settings, resumed, world, comm, hp = model.settings, context.resumed, context.world, context.comm, context.hyper
    data = settings.data
    check_corpus(data)  # a missing default corpus: the one-line error says how to download it
    cfg = model.cfg
    if resumed is not None or settings.start is not None:
        tok = (resumed or settings.start).tokenizer()
    else:
        if options.tokenizer:
            tok = Tokenizer.load(options.tokenizer)
        else:  # learned by rank 0 alone, then sent to the others
            tok = Tokenizer.train(data, PRESETS[settings.preset].vocab_size, progress=True) if world.is_main else None
            tok = Tokenizer.from_json(broadcast_text(comm, tok.to_json() if tok else None))
        cfg = dataclasses.replace(cfg, vocab_size=tok.vocab_size)
    if not world.is_main:
        comm.barrier()  # rank 0 writes the token cache, the others then read it
    corpus = open_corpus(data, tok, progress=world.is_main)
    if world.is_main:
        comm.barrier()
    size = os.path.getsize(data)
    record = provenance(data) if world.is_main else None
    end = tok.document_end()  # the token each `</s>` of the corpus became
    ends = count_token(corpus.tokens, tok.special_tokens[end]) if world.is_main else 0
    context.say(f"data: {data}: {size:,} bytes, {len(corpus.tokens):,} tokens ({size / len(corpus.tokens):.2f} "
                f"bytes/token); train {len(corpus.train):,}, validation {len(corpus.val):,} (the last tenth)"
                + (f"; {ends:,} documents closed by {end}" if ends else ""))
    fetch = unclosed_fetch(record, ends)
    if fetch:
        context.say(f"note: {data} was fetched before the fetcher closed each document with </s>: a model trained "
                    f"on it does not learn where a text ends; `{fetch}` rebuilds it from its download cache")
    # one optimizer batch per draw, split into grad_accum passes: B x N draws the windows of B * N x 1
    source = RandomWindows(corpus.train, hp.batch_size * hp.grad_accum, cfg.context, cfg.mtp_heads, hp.seed,
                           world.rank, world.world_size)
    full, quick = (eval_batches(corpus.val, corpus.byte_len, hp.batch_size, cfg.context, cfg.mtp_heads, limit=limit)
                   for limit in context.eval_limits())
    png = os.path.splitext(context.log_path)[0] + ".png"
    return Data(cfg, tok, source, Validation(quick, full),
                CrossEntropy(comm, every_target=True),  # random windows: every position has its target
                dict(preset=settings.preset, data=os.path.abspath(data)), "training", f"x{cfg.context} tokens",
                title=f"nanoeuler {settings.preset}",
                # the first log record says what the run trained on: the corpus's sha256 and its fetched sources
                log_first=dict(data=record) if world.is_main else None,
                done=f"saved {options.out}, log {context.log_path}, loss curve {png}")


STAGE = Stage("pretrain", "nanoeuler train", plan, load)


def main(args):
    return run(STAGE, PretrainOptions.from_args(args))
