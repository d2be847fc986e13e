"""Preference tuning with DPO: `nanoeuler dpo`, a chat checkpoint + preference pairs -> a chat checkpoint.

    nanoeuler dpo                              # data/preferences.jsonl + nanoeuler_chat.bin -> nanoeuler_dpo.bin
    nanoeuler dpo --beta 0.1 --steps 500 --lr 2e-5 --device gpu
    nanoeuler dpo --rpo-alpha 0                # plain DPO, without the chosen replies' NLL
    nanoeuler dpo --resume                     # continue nanoeuler_dpo.bin exactly where it stopped

Each line of the data is one pair {"prompt", "chosen", "rejected"}: the prompt an instruction alone, the two
responses bare text. Both responses are rendered with the chat template the SFT model was trained on
(nanoeuler/data/template.py): prompt tokens, response tokens, `</s>`. A sequence's log-probability is the sum of
head 0's log-softmax at the response tokens and `</s>` (the prompt masked with -1, as SFT masks it). The
reference model is the starting checkpoint: its log-probabilities of every pair are computed once, before
the first step, and kept in the checkpoint's training state, so --resume does not recompute them. The loss
is Rafailov et al.'s DPO plus RPO's NLL of the chosen replies (Pang et al. 2024, TRL's rpo_alpha):

    loss = mean over pairs of -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))
           + alpha * (the chosen replies' summed -log-probability) / (their tokens)

written once in train/objectives.py: the engine's backward pass with a weight per sequence on its rows'
cross-entropy gradients, on either engine. Plain DPO (--rpo-alpha 0) wins its margin by pushing the rejected
reply's first tokens down onto junk; the NLL term makes the chosen reply's tokens take that mass
(docs/dpo.md: the comparison with plain DPO and DPOP). The defaults (lr, steps) are per preset, the one
nearest to the checkpoint's size. The reward of a response is beta * (pi - ref); the metrics log's
evaluation lines carry val_loss, val_reward_accuracy (held-out pairs whose chosen reward beats the rejected
one; a tie counts a half, so the starting model scores exactly 50%), val_reward_margin (the mean of chosen
minus rejected reward) and val_chosen_logp_delta / val_rejected_logp_delta (the mean log-probability of the
chosen / rejected replies under the model minus under the reference). At the end the greedy replies to up to
64 held-out prompts are compared with the starting model's (computed before the first step and kept for
--resume): the share that changed and a few examples are printed and written as the log's last record. A
pair of which either sequence is longer than the context + 1 tokens is skipped (cutting a response would
change what is compared) and counted.

The stage's functions on the shared skeleton (run.py), so the same progress bar, metrics log, PNG, atomic
checkpoints, samples, Ctrl-C and exact --resume as `train` and `sft`; the data is data/preferences.py.
"""
import dataclasses
import json
import math
import os
import time
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from nanoeuler.data.corpus import provenance
from nanoeuler.data.instructions import split
from nanoeuler.data.preferences import DEFAULT_DATA, PairBatches, pair_batch, pair_eval_batches, prepare, read_pairs
from nanoeuler.data.template import sample_prompt
from nanoeuler.errors import UserError
from nanoeuler.infer.generate import generate
from nanoeuler.io import checkpoint
from nanoeuler.model.config import PRESETS, param_count
from nanoeuler.model.losses import sequence_logprobs
from nanoeuler.train import resume
from nanoeuler.train.loop import Hyperparameters, Validation
from nanoeuler.train.objectives import DPO
from nanoeuler.train.options import DpoOptions
from nanoeuler.train.run import Data, Model, Stage, run

# Per preset (the checkpoint's size picks the nearest, as pretraining's PRESET_HYPER). small and base: what
# took docs/dpo.md's trait at the first token with fluent replies (measured); big and large: by size, between.
DPO_HYPER = {
    "small": Hyperparameters(steps=200, batch_size=16, lr=1e-4, warmup=20, eval_every=25, sample_every=100,
                             ckpt_every=100, eval_batches=4),
    "big": Hyperparameters(steps=500, batch_size=16, lr=5e-5, warmup=50, eval_every=50, sample_every=250,
                           ckpt_every=250, eval_batches=8),
    "base": Hyperparameters(steps=500, batch_size=16, lr=2e-5, warmup=50, eval_every=50, sample_every=250,
                            ckpt_every=250, eval_batches=8),
    "large": Hyperparameters(steps=500, batch_size=16, lr=1e-5, warmup=50, eval_every=50, sample_every=250,
                             ckpt_every=250, eval_batches=8),
}
DEFAULT_BETA = 0.1
DEFAULT_RPO_ALPHA = 1.0
# The end-of-run comparison: greedy replies to this many held-out prompts, this long at most.
GREEDY_PROMPTS, GREEDY_TOKENS = 64, 48


def preset_hyper(cfg):
    """DPO_HYPER of the preset nearest to cfg in parameter count."""
    size = lambda c: math.log(param_count(c))
    nearest = min(DPO_HYPER, key=lambda name: abs(size(PRESETS[name]) - size(cfg)))
    return nearest, DPO_HYPER[nearest]


def greedy_replies(eng, tok, prompts, max_new_tokens=GREEDY_TOKENS):
    """The greedy reply (text, </s> dropped) to each prompt (token ids of a rendered chat prompt), decoded
    together in one batch."""
    outs = generate(eng, [list(ids) for ids in prompts], max_new_tokens, temperature=0, stop_ids=tok.end_ids)
    return [tok.decode(out[:-1] if out and out[-1] in tok.end_ids else out).decode("utf-8", errors="replace")
            for out in outs]


def changed_replies(before, after, prompts, tok, show=3):
    """(the share of prompts whose reply changed, up to `show` changed ones as {prompt, before, after})."""
    changed = [i for i, (b, a) in enumerate(zip(before, after)) if b != a]
    instruction = lambda ids: tok.decode(list(ids)).decode("utf-8", errors="replace").rsplit(
        "### Instruction:\n", 1)[-1].split("\n\n### ")[0]  # the instruction alone, out of the chat template
    examples = [dict(prompt=instruction(prompts[i]), before=before[i], after=after[i]) for i in changed[:show]]
    return len(changed) / max(1, len(before)), examples


def reference_logps(eng, pairs, batch, progress=True, comm=None):
    """(n, 2) float64: the model's log-probabilities of every pair's chosen and rejected response. With comm
    (N ranks), rank r computes every N-th batch (the batches of one process) and the ranks' sum gives all."""
    rank, ranks = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    ref = np.zeros((len(pairs), 2))
    K, context = eng.cfg.mtp_heads, eng.cfg.context
    with tqdm(total=len(pairs), desc="reference log-probs", unit="pair", disable=not progress or rank > 0,
              leave=False) as bar:
        for i in range(rank * batch, len(pairs), batch * ranks):
            group = pairs[i:i + batch]
            inputs, targets = pair_batch(group, context, K)
            logps = sequence_logprobs(eng, inputs, targets)
            ref[i:i + len(group), 0], ref[i:i + len(group), 1] = logps[:len(group)], logps[len(group):]
            bar.update(len(group) * ranks)
    return comm.all_reduce_sum(ref) if ranks > 1 else ref


class Preference(NamedTuple):
    """The DPO run's own settings: the pairs, the held-out pairs asked for, the checkpoint it was tuned from (a
    path), beta, RPO's alpha, the preset whose defaults it takes, and the checkpoint its weights start from."""
    data: str
    n_val: int
    base: str
    beta: float
    alpha: float
    preset: str
    start: object


def plan(options, resumed, stored=False):
    """The chat checkpoint's model (--ckpt, also the reference; stored: its weights left in the file, read a
    shard at a time), or the resumed run's, whose beta and alpha cannot change."""
    if resumed is not None:
        state = resumed.train_state
        resume.refuse_changed(options, resumed, ("beta", "rpo_alpha"), "it cannot change mid-run")
        preset, hyper = preset_hyper(resumed.cfg)
        settings = Preference(options.data or state["data"], state["val_pairs"], state["base"], state["beta"],
                              state["rpo_alpha"], preset, resumed)
        return Model(resumed.cfg, hyper, f"{options.out} (step {resumed.step}, tuned from {settings.base})",
                     settings=settings)
    start = checkpoint.load(options.ckpt, stored_params=stored)
    preset, hyper = preset_hyper(start.cfg)
    settings = Preference(options.data or DEFAULT_DATA, options.val_pairs, options.ckpt,
                          DEFAULT_BETA if options.beta is None else options.beta,
                          DEFAULT_RPO_ALPHA if options.rpo_alpha is None else options.rpo_alpha, preset, start)
    return Model(start.cfg, hyper, f"{options.ckpt} (step {start.step})", start.params, settings,
                 start.quantized)


@dataclasses.dataclass(frozen=True)
class Pairs:
    """The pairs as load() prepares them (Data.pairs), which ready() turns into batches once it has their
    reference log-probabilities, and whose held-out prompts finish() asks again: training and held-out pairs,
    the counts."""
    train: list
    val: list
    counts: dict


def load(options, model, context):
    """The pairs in the chat template; their batches need the reference log-probabilities (ready)."""
    settings, cfg = model.settings, model.cfg
    tok = settings.start.tokenizer()
    data = read_pairs(settings.data)
    if len(data) < 2:
        raise UserError(f"{settings.data} holds {len(data)} pair; DPO needs at least 2 (1 held out)")
    train_idx, val_idx = split(len(data), settings.n_val)
    first = data[val_idx[0]]
    train, val, counts = prepare(data, train_idx, val_idx, tok, cfg.context)
    context.say(f"data: {settings.data}: {len(data):,} pairs: {counts['train']:,} for training, {counts['val']:,} "
                f"held out; {counts['skipped']:,} skipped (a response does not fit the context of {cfg.context} "
                "tokens)")
    if not settings.start.chat:
        context.say(f"note: {settings.base if context.resumed is None else options.out} is not a chat model (no "
                    "`nanoeuler sft`): the pairs are still rendered in the chat template")
    remedy = f"RPO alpha {settings.alpha:g}" if settings.alpha else "plain DPO"
    state = dict(data=os.path.abspath(settings.data), base=os.path.abspath(settings.base), beta=settings.beta,
                 rpo_alpha=settings.alpha, val_pairs=len(val_idx), pairs=counts)
    return Data(cfg, tok, None, None, DPO(settings.beta, settings.alpha,
                context.comm), state, "dpo", f" pairs, beta {settings.beta:g}, {remedy} (defaults of "
                f"{settings.preset})", chat=True, sample_prompt=sample_prompt(tok, first["prompt"]),
                title="nanoeuler dpo", log_first=dict(pairs_skipped=counts["skipped"],
                                                      data=provenance(settings.data)),
                pairs=Pairs(train, val, counts))


def ready(model, data, eng, context):
    """The reference log-probs of the starting model (computed when the run began, kept in its state) and its
    greedy replies to the held-out prompts (kept for --resume); the pairs' batches and held-out batches."""
    settings, pairs, hp, cfg, resumed = model.settings, data.pairs, context.hyper, data.cfg, context.resumed
    if resumed is not None:
        ref = np.array(resumed.train_state["ref"], dtype=np.float64)
        if ref.shape != (pairs.counts["train"] + pairs.counts["val"], 2):
            raise UserError(f"--resume: {settings.data} no longer gives the pairs {context.options.out} was trained "
                            "on")
    else:
        t0 = time.perf_counter()
        ref = reference_logps(eng, pairs.train + pairs.val, hp.batch_size, comm=context.comm)
        context.say(f"reference: log-probabilities of {len(ref):,} pairs under {settings.base} in "
                    f"{time.perf_counter() - t0:.1f} s (kept in the checkpoint)")
    prompts = held_out_prompts(pairs.val)
    main = context.world.is_main  # rank 0 alone compares greedy replies at the end
    before = (resumed.train_state["greedy_before"] if resumed is not None
              else greedy_replies(eng, data.tokenizer, prompts) if main else None)
    ref_train, ref_val = ref[:len(pairs.train)], ref[len(pairs.train):]
    source = PairBatches(pairs.train, ref_train, hp.batch_size * hp.grad_accum, cfg.context, cfg.mtp_heads,
                         hp.seed, context.world.rank, context.world.world_size)
    full, quick = (pair_eval_batches(pairs.val, ref_val, hp.batch_size, cfg.context, cfg.mtp_heads, limit=limit)
                   for limit in context.eval_limits())
    return dataclasses.replace(data, source=source, validation=Validation(quick, full),
                               state=dict(data.state, ref=ref.tolist(), greedy_before=before))


def held_out_prompts(val):
    """The distinct prompts of the held-out pairs (token ids), GREEDY_PROMPTS at most."""
    return list(dict.fromkeys(tuple(c[:n].tolist()) for (c, n), _ in val))[:GREEDY_PROMPTS]


def finish(model, data, eng, context):
    """The greedy replies to the held-out prompts after DPO against the starting model's: printed, and one
    closing record in the metrics log (no step: a later --resume drops it and writes its own)."""
    out, log_path, base, tok = context.options.out, context.log_path, model.settings.base, data.tokenizer
    before, prompts = data.state["greedy_before"], held_out_prompts(data.pairs.val)
    after = greedy_replies(eng, tok, prompts)
    share, examples = changed_replies(before, after, prompts, tok)
    print(f"greedy replies to {len(prompts)} held-out prompts: {share:.0%} changed from {base}'s")
    for e in examples:
        print(f"  {e['prompt']!r}\n    before: {e['before']!r}\n    after:  {e['after']!r}")
    with open(log_path, "a") as log:
        log.write(json.dumps(dict(greedy_changed=share, greedy_prompts=len(prompts), greedy_examples=examples))
                  + "\n")
    return f"saved {out} (a chat model: `nanoeuler chat --ckpt {out}`), log {log_path}"


STAGE = Stage("dpo", "nanoeuler dpo", plan, load, ready, finish)


def main(args):
    return run(STAGE, DpoOptions.from_args(args))
