"""Pretraining: `nanoeuler train [small|big|base|large]`, one loop for the CPU and the GPU engine.

    nanoeuler train small --data shakespeare.txt          # `make train`: 1.1M params, CPU, minutes
    nanoeuler train big                                   # 14.2M params, the GPU if there is one
    nanoeuler train small --resume                        # continue nanoeuler.bin exactly where it stopped
    nanoeuler train --ckpt smollm.bin --data my.txt --out more.bin --lr 1e-4   # continued pretraining of an import

The stage's hooks on the shared skeleton (run.py): a preset (or the resumed checkpoint's model), a tokenizer
(the checkpoint's, --tokenizer, or one learned on the corpus by rank 0), the corpus as random windows for
training and its held-out last tenth for the validation loss and bits per byte; the objective is the
cross-entropy of the K heads (objectives.py).
"""
import dataclasses
import os

from nanoeuler.data.corpus import RandomWindows, check_corpus, eval_batches, open_corpus, provenance
from nanoeuler.errors import UserError
from nanoeuler.io import checkpoint
from nanoeuler.model.config import PRESETS
from nanoeuler.tokenizer.bpe import Tokenizer
from nanoeuler.parallel.comm import broadcast_text
from nanoeuler.train.loop import Hyperparameters
from nanoeuler.train.objectives import CrossEntropy
from nanoeuler.train.run import Stage, run_stage

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


class Pretrain(Stage):
    kind, command = "pretrain", "nanoeuler train"
    start = None  # the checkpoint that --ckpt continues

    def begin(self, run):
        args, ck = run.args, run.ck
        if ck is not None:
            self.preset = ck.train_state["preset"]
            if args.preset not in (None, self.preset):
                raise UserError(f"--resume: {run.out} is a {self.preset} model, not {args.preset}")
            self.data = args.data or ck.train_state["data"]
            run.cfg = ck.cfg
        elif args.ckpt:  # continued pretraining: the checkpoint's model, weights and tokenizer, a fresh optimizer
            if args.tokenizer:
                raise UserError("--ckpt brings its own tokenizer; leave out --tokenizer")
            self.start = checkpoint.load(args.ckpt)
            self.preset = args.preset or "base"
            self.data = args.data or DEFAULT_DATA[self.preset]
            run.cfg, run.params = self.start.cfg, self.start.params
        else:
            self.preset = args.preset or "small"
            self.data = args.data or DEFAULT_DATA[self.preset]
            run.cfg = PRESETS[self.preset]  # its vocabulary is close enough to the final one for the device rule
        run.hyper = PRESET_HYPER[self.preset]

    def load(self, run):
        args, ck, world, comm, hp = run.args, run.ck, run.world, run.comm, run.hp
        check_corpus(self.data)  # a missing default corpus: the one-line error says how to download it
        if ck is not None or self.start is not None:
            run.tok = (ck or self.start).tokenizer()
        elif args.tokenizer:
            run.tok = Tokenizer.load(args.tokenizer)
        else:  # learned by rank 0 alone, then sent to the others
            tok = Tokenizer.train(self.data, PRESETS[self.preset].vocab_size, progress=True) if world.is_main else None
            run.tok = Tokenizer.from_json(broadcast_text(comm, tok.to_json() if tok else None))
        if ck is None and self.start is None:
            run.cfg = dataclasses.replace(run.cfg, vocab_size=run.tok.vocab_size)
        cfg = run.cfg
        if not world.is_main:
            comm.barrier()  # rank 0 writes the token cache, the others then read it
        corpus = open_corpus(self.data, run.tok, progress=world.is_main)
        if world.is_main:
            comm.barrier()
        size = os.path.getsize(self.data)
        run.say(f"data: {self.data}: {size:,} bytes, {len(corpus.tokens):,} tokens ({size / len(corpus.tokens):.2f} "
                f"bytes/token); train {len(corpus.train):,}, validation {len(corpus.val):,} (the last tenth)")
        # one optimizer batch per draw, split into grad_accum passes: B x N draws the windows of B * N x 1
        run.source = RandomWindows(corpus.train, hp.batch_size * hp.grad_accum, cfg.context, cfg.mtp_heads,
                                   hp.seed, world.rank, world.world_size)
        final, periodic = run.eval_limits()
        run.val_full, run.val_quick = (eval_batches(corpus.val, corpus.byte_len, hp.batch_size, cfg.context,
                                                    cfg.mtp_heads, limit=limit) for limit in (final, periodic))

    def origin(self, run):
        return f"{run.args.ckpt} (step {self.start.step}), {self.preset}'s hyperparameters" if self.start else self.preset

    def plan(self, run):
        return "training", f"x{run.cfg.context} tokens"

    def objective(self, run):
        return CrossEntropy(run.comm, every_target=True)  # random windows: every position has its target

    def train_state(self, run):
        return dict(preset=self.preset, data=os.path.abspath(self.data))

    def fit_options(self, run):
        # the first log record says what the run trained on: the corpus's sha256 and its fetched sources
        return dict(title=f"nanoeuler {self.preset}", log_first=dict(data=provenance(self.data)) if run.world.is_main
                    else None)

    def done(self, run):
        return f"saved {run.out}, log {run.log_path}, loss curve {os.path.splitext(run.log_path)[0]}.png"


def main(args):
    return run_stage(Pretrain(), args)
