"""Preference tuning with DPO: `nanoeuler dpo`, a chat checkpoint + preference pairs -> a chat checkpoint.

    nanoeuler dpo                              # data/preferences.jsonl + nanoeuler_chat.bin -> nanoeuler_dpo.bin
    nanoeuler dpo --beta 0.1 --steps 500 --lr 5e-6 --device gpu
    nanoeuler dpo --resume                     # continue nanoeuler_dpo.bin exactly where it stopped

Each line of the data is one pair {"prompt", "chosen", "rejected"}: the prompt an instruction alone, the two
responses bare text. Both responses are rendered with the chat template the SFT model was trained on
(nanoeuler/data/template.py): prompt tokens, response tokens, `</s>`. A sequence's log-probability is the sum of
head 0's log-softmax at the response tokens and `</s>` (the prompt masked with -1, as SFT masks it). The
reference model is the starting checkpoint: its log-probabilities of every pair are computed once, before
the first step, and kept in the checkpoint's training state, so --resume does not recompute them. The loss
is Rafailov et al.'s

    loss = mean over pairs of -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))

written once in train/objectives.py: the engine's backward pass with a weight per sequence on its rows'
cross-entropy gradients, on either engine. The reward of a response is beta * (pi - ref); the
metrics log's evaluation lines carry val_loss, val_reward_accuracy (held-out pairs whose chosen reward beats
the rejected one; a tie counts a half, so the starting model scores exactly 50%) and val_reward_margin (the
mean of chosen minus rejected reward). A pair of which either sequence is longer than the context + 1
tokens is skipped (cutting a response would change what is compared) and counted.

The stage's hooks on the shared skeleton (run.py), so the same progress bar, metrics log, PNG, atomic
checkpoints, samples, Ctrl-C and exact --resume as `train` and `sft`; the data is data/preferences.py.
"""
import os
import time

import numpy as np
from tqdm import tqdm

from nanoeuler.data.instructions import split
from nanoeuler.data.preferences import DEFAULT_DATA, PairBatches, pair_batch, pair_eval_batches, prepare, read_pairs
from nanoeuler.data.template import render_prompt
from nanoeuler.errors import UserError
from nanoeuler.io import checkpoint
from nanoeuler.train.loop import Hyperparameters
from nanoeuler.train.objectives import DPO, sequence_logprobs
from nanoeuler.train.run import Stage, run_stage

# For a chat model of base's size on one GPU: small steps from the SFT model, as in the DPO paper.
DPO_HYPER = Hyperparameters(steps=1000, batch_size=16, lr=5e-6, warmup=50, eval_every=100, sample_every=500,
                            ckpt_every=250, eval_batches=8)
DEFAULT_BETA = 0.1


def reference_logps(eng, pairs, batch, progress=True):
    """(n, 2) float64: the model's log-probabilities of every pair's chosen and rejected response."""
    ref = np.empty((len(pairs), 2))
    K, context = eng.cfg.mtp_heads, eng.cfg.context
    with tqdm(total=len(pairs), desc="reference log-probs", unit="pair", disable=not progress,
              leave=False) as bar:
        for i in range(0, len(pairs), batch):
            group = pairs[i:i + batch]
            inputs, targets = pair_batch(group, context, K)
            logps = sequence_logprobs(eng, inputs, targets)
            ref[i:i + len(group), 0], ref[i:i + len(group), 1] = logps[:len(group)], logps[len(group):]
            bar.update(len(group))
    return ref


class PreferenceTune(Stage):
    kind, command = "dpo", "nanoeuler dpo"
    parallel = False

    def begin(self, run):
        args, ck = run.args, run.ck
        if ck is not None:
            state = ck.train_state
            if args.beta is not None and args.beta != state["beta"]:
                raise UserError(f"--resume: {run.out} was trained with --beta {state['beta']}; it cannot change "
                                "mid-run")
            self.data, self.beta, self.n_val, self.base = (args.data or state["data"], state["beta"],
                                                           state["val_pairs"], state["base"])
            self.start = ck
        else:
            self.start = checkpoint.load(args.ckpt)
            self.data, self.beta, self.n_val, self.base = (args.data or DEFAULT_DATA, args.beta or DEFAULT_BETA,
                                                           args.val_pairs, args.ckpt)
            run.params = self.start.params
        run.cfg, run.tok, run.hyper = self.start.cfg, self.start.tokenizer(), DPO_HYPER

    def load(self, run):
        data = read_pairs(self.data)
        if len(data) < 2:
            raise UserError(f"{self.data} holds {len(data)} pair; DPO needs at least 2 (1 held out)")
        train_idx, val_idx = split(len(data), self.n_val)
        self.n_val = len(val_idx)
        self.first = data[val_idx[0]]
        self.train, self.val, self.counts = prepare(data, train_idx, val_idx, run.tok, run.cfg.context)
        counts = self.counts
        print(f"data: {self.data}: {len(data):,} pairs: {counts['train']:,} for training, {counts['val']:,} held "
              f"out; {counts['skipped']:,} skipped (a response does not fit the context of {run.cfg.context} tokens)")
        if not self.start.chat:
            print(f"note: {self.base if run.ck is None else run.out} is not a chat model (no `nanoeuler sft`): the "
                  "pairs are still rendered in the chat template")

    def ready(self, run):
        """The reference log-probs of the starting model: computed when the run began, kept in its state."""
        hp, cfg, ck = run.hp, run.cfg, run.ck
        if ck is not None:
            self.ref = np.array(ck.train_state["ref"], dtype=np.float64)
            if self.ref.shape != (self.counts["train"] + self.counts["val"], 2):
                raise UserError(f"--resume: {self.data} no longer gives the pairs {run.out} was trained on")
        else:
            t0 = time.perf_counter()
            self.ref = reference_logps(run.eng, self.train + self.val, hp.batch_size)
            print(f"reference: log-probabilities of {len(self.ref):,} pairs under {self.base} in "
                  f"{time.perf_counter() - t0:.1f} s (kept in the checkpoint)")
        ref_train, ref_val = self.ref[:len(self.train)], self.ref[len(self.train):]
        run.source = PairBatches(self.train, ref_train, hp.batch_size * hp.grad_accum, cfg.context,
                                 cfg.mtp_heads, hp.seed)
        run.val_full, run.val_quick = (pair_eval_batches(self.val, ref_val, hp.batch_size, cfg.context,
                                                         cfg.mtp_heads, limit=limit)
                                       for limit in (hp.final_eval_batches, hp.eval_batches))

    def origin(self, run):
        if run.ck is not None:
            return f"{run.out} (step {run.ck.step}, tuned from {self.base})"
        return f"{self.base} (step {self.start.step})"

    def plan(self, run):
        return "dpo", f" pairs, beta {self.beta:g}"

    def objective(self, run):
        return DPO(self.beta)

    def train_state(self, run):
        return dict(data=os.path.abspath(self.data), base=os.path.abspath(self.base), beta=self.beta,
                    val_pairs=self.n_val, pairs=self.counts, ref=self.ref.tolist())

    def fit_options(self, run):
        return dict(chat=True, sample_prompt=render_prompt(self.first["prompt"]), title="nanoeuler dpo",
                    log_first=dict(pairs_skipped=self.counts["skipped"]))

    def done(self, run):
        return f"saved {run.out} (a chat model: `nanoeuler chat --ckpt {run.out}`), log {run.log_path}"


def main(args):
    return run_stage(PreferenceTune(), args)
