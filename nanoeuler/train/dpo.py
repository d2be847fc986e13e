"""Preference tuning with DPO: `nanoeuler dpo`, a chat checkpoint + preference pairs -> a chat checkpoint.

    nanoeuler dpo                              # data/preferences.jsonl + nanoeuler_chat.bin -> nanoeuler_dpo.bin
    nanoeuler dpo --beta 0.1 --steps 500 --lr 5e-6 --device gpu
    nanoeuler dpo --resume                     # continue nanoeuler_dpo.bin exactly where it stopped

Each line of the data is one pair {"prompt", "chosen", "rejected"}: the prompt an instruction alone, the two
responses bare text. Both responses are rendered with the chat template the SFT model was trained on
(nanoeuler/template.py): prompt tokens, response tokens, `</s>`. A sequence's log-probability is the sum of
head 0's log-softmax at the response tokens and `</s>` (the prompt masked with -1, as SFT masks it). The
reference model is the starting checkpoint: its log-probabilities of every pair are computed once, before
the first step, and kept in the checkpoint's training state, so --resume does not recompute them. The loss
is Rafailov et al.'s

    loss = mean over pairs of -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))

with its hand-written backward in the engine (Engine.dpo_forward_backward: a weight per sequence on its
rows' cross-entropy gradients), on either engine. The reward of a response is beta * (pi - ref); the
metrics log's evaluation lines carry val_loss, val_reward_accuracy (held-out pairs whose chosen reward beats
the rejected one; a tie counts a half, so the starting model scores exactly 50%) and val_reward_margin (the
mean of chosen minus rejected reward). A pair of which either sequence is longer than the context + 1
tokens is skipped (cutting a response would change what is compared) and counted.

Training is train.fit() with the DPO objective below: the same progress bar, metrics log, PNG, atomic
checkpoints, samples, Ctrl-C and exact --resume as `train` and `sft`.
"""
import json
import os
import sys
import time

import numpy as np
from tqdm import tqdm

from nanoeuler.io import checkpoint
from nanoeuler.data import template
from nanoeuler.model.config import param_count
from nanoeuler.errors import UserError
from nanoeuler.train.sft import ExampleBatches, make_batch, split
from nanoeuler.train.pretrain import (Hyper, batch_text, fit, output_paths, replace_note,
                             resume_checkpoint, run_device, run_engine, run_hyper, schedule_text)

DEFAULT_DATA = "data/preferences.jsonl"
# For a chat model of base's size on one GPU: small steps from the SFT model, as in the DPO paper.
DPO_HYPER = Hyper(steps=1000, batch_size=16, lr=5e-6, warmup=50, eval_every=100, sample_every=500,
                  ckpt_every=250, eval_batches=8)
DEFAULT_BETA = 0.1
FIELDS = ("prompt", "chosen", "rejected")


# ------------------------------------------------------------------------------------------------ data
def read_pairs(path):
    """[{prompt, chosen, rejected}] from a JSONL file; every way it can be wrong is a one-line UserError that
    names the line."""
    if not os.path.exists(path):
        hint = " (fetch one with `sh data/get_preferences.sh`)" if path == DEFAULT_DATA else ""
        raise UserError(f"preference data {path} not found{hint}")
    if not os.path.isfile(path):
        raise UserError(f"preference data {path} is not a file")
    pairs = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except ValueError as e:
                    raise UserError(f"{path}:{n}: not JSON ({e})") from None
                if not isinstance(item, dict):
                    raise UserError(f"{path}:{n}: expected an object with {', '.join(FIELDS)}")
                for key in FIELDS:
                    if not isinstance(item.get(key), str):
                        raise UserError(f"{path}:{n}: no string {key!r}")
                for key in ("chosen", "rejected"):
                    if not item[key].strip():
                        raise UserError(f"{path}:{n}: the {key} response is empty")
                pairs.append({key: item[key] for key in FIELDS} | {"line": n})
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    if not pairs:
        raise UserError(f"{path} holds no preference pairs")
    return pairs


def encode_pair(tok, pair):
    """((chosen ids, n_prompt), (rejected ids, n_prompt)) in the chat template."""
    return (template.encode(tok, pair["prompt"], pair["chosen"]),
            template.encode(tok, pair["prompt"], pair["rejected"]))


def fits(encoded, context):
    """A pair fits when both sequences' head-0 targets (every token after the first) fit the context."""
    return all(len(ids) <= context + 1 for ids, _ in encoded)


def prepare(data, train_idx, val_idx, tok, context, progress=True):
    """Tokenize the pairs: (train pairs, held-out pairs, counts); a pair is ((c_ids, n), (r_ids, n))."""
    parts, skipped = [], 0
    bar = tqdm(total=len(data), desc="tokenizing", unit="pair", disable=not progress, leave=False)
    for indices in (train_idx, val_idx):
        kept = []
        for i in indices:
            encoded = encode_pair(tok, data[i])
            if fits(encoded, context):
                kept.append(encoded)
            else:
                skipped += 1
            bar.update(1)
        parts.append(kept)
    bar.close()
    train, val = parts
    if not train or not val:
        first = data[(train_idx if not train else val_idx)[0]]
        need = max(len(ids) for ids, _ in encode_pair(tok, first)) - 1
        raise UserError(f"no {'training' if not train else 'held-out'} pair fits the model's context of {context} "
                        f"tokens (line {first['line']} needs {need}); use shorter pairs")
    return train, val, {"train": len(train), "val": len(val), "skipped": skipped}


def pair_batch(pairs, context, K):
    """Pairs -> inputs (2P, T), targets (K, 2P, T): the P chosen sequences, then the P rejected ones."""
    return make_batch([c for c, _ in pairs] + [r for _, r in pairs], context, K)


class PairBatches(ExampleBatches):
    """DPO batches for train.fit(): `batch` pairs at a time, each epoch a fresh permutation (ExampleBatches'
    resumable order) of the training pairs, with their reference log-probabilities."""

    def __init__(self, pairs, ref, batch, context, K, seed):
        super().__init__(list(range(len(pairs))), batch, context, K, seed)
        self.pairs, self.ref = pairs, ref  # ref (n, 2): chosen, rejected

    def next(self):
        picks = self.picks()
        inputs, targets = pair_batch([self.pairs[i] for i in picks], self.context, self.K)
        return inputs, targets, np.concatenate([self.ref[picks, 0], self.ref[picks, 1]])


def pair_eval_batches(pairs, ref, batch, context, K, limit=None):
    """(inputs, targets, ref) batches over the held-out pairs, in order; with `limit`, that many spread evenly."""
    groups = [list(range(i, min(i + batch, len(pairs)))) for i in range(0, len(pairs), batch)]
    if limit is not None and limit < len(groups):
        groups = [groups[i] for i in np.linspace(0, len(groups) - 1, limit).round().astype(int)]
    out = []
    for g in groups:
        inputs, targets = pair_batch([pairs[i] for i in g], context, K)
        out.append((inputs, targets, np.concatenate([ref[g, 0], ref[g, 1]])))
    return out


def reference_logps(eng, pairs, batch, progress=True):
    """(n, 2) float64: the model's log-probabilities of every pair's chosen and rejected response."""
    ref = np.empty((len(pairs), 2))
    K, context = eng.cfg.mtp_heads, eng.cfg.context
    with tqdm(total=len(pairs), desc="reference log-probs", unit="pair", disable=not progress,
              leave=False) as bar:
        for i in range(0, len(pairs), batch):
            group = pairs[i:i + batch]
            inputs, targets = pair_batch(group, context, K)
            logps = eng.sequence_logprobs(inputs, targets)
            ref[i:i + len(group), 0], ref[i:i + len(group), 1] = logps[:len(group)], logps[len(group):]
            bar.update(len(group))
    return ref


# ------------------------------------------------------------------------------------------- objective
def tie_accuracy(z):
    """The share of pairs whose chosen reward beats the rejected one (z > 0), a tie counting a half."""
    z = np.asarray(z)
    return float(((z > 0).sum() + 0.5 * (z == 0).sum()) / max(1, z.size))


class DPO:
    """The DPO objective for train.fit() (the counterpart of train.CrossEntropy): a batch is (inputs,
    targets, reference log-probs) of P pairs; gradient accumulation splits the pairs into hp.grad_accum
    groups, each normalised by all P, so the passes add up to the batch's loss and gradient."""
    ylabel = "DPO loss (nats/pair)"

    def __init__(self, beta):
        self.beta = beta

    def train_step(self, eng, batch, hp):
        inputs, targets, ref = batch
        P = len(inputs) // 2
        loss, zs = 0.0, []
        for i, rows in enumerate(np.array_split(np.arange(P), min(hp.grad_accum, P))):
            both = np.concatenate([rows, rows + P])
            part, stats = eng.dpo_forward_backward(inputs[both], targets[:, both], ref[both], self.beta,
                                                   pairs=P, accumulate=i > 0)
            loss += part
            zs.append(stats["z"])
        z = np.concatenate(zs)
        return dict(loss=loss, reward_accuracy=tie_accuracy(z), reward_margin=float(z.mean())), inputs.size

    def evaluate(self, eng, batches):
        zs = []
        for inputs, targets, ref in batches:
            pi = eng.sequence_logprobs(inputs, targets)
            P = len(pi) // 2
            zs.append(self.beta * ((pi[:P] - ref[:P]) - (pi[P:] - ref[P:])))
        z = np.concatenate(zs)
        return dict(val_loss=float(np.logaddexp(0.0, -z).mean()), val_reward_accuracy=tie_accuracy(z),
                    val_reward_margin=float(z.mean()))

    def eval_text(self, record):
        return (f"train loss {record['loss']:.4f}, val loss {record['val_loss']:.4f}, reward accuracy "
                f"{record['val_reward_accuracy']:.1%}, margin {record['val_reward_margin']:.3f}")

    def plot_title(self, record):
        return f"val reward accuracy {record['val_reward_accuracy']:.1%}"


# ------------------------------------------------------------------------------------------ the command
def main(args):
    from nanoeuler.model.device import wants_gpu
    from nanoeuler.train.distributed import World

    if World.from_env().world_size > 1:
        raise UserError("nanoeuler dpo runs in one process; data parallelism (--gpus) is for train and sft")
    out, log_path = output_paths(args)
    ck = resume_checkpoint(args, "dpo", "nanoeuler dpo")
    if ck is not None:
        state = ck.train_state
        if args.beta is not None and args.beta != state["beta"]:
            raise UserError(f"--resume: {out} was trained with --beta {state['beta']}; it cannot change mid-run")
        data_path, beta, n_val, base, start = args.data or state["data"], state["beta"], state["val_pairs"], \
            state["base"], ck
    else:
        start = checkpoint.load(args.ckpt)
        data_path, beta, n_val, base = args.data or DEFAULT_DATA, args.beta or DEFAULT_BETA, args.val_pairs, \
            args.ckpt
    hp = run_hyper(args, ck, DPO_HYPER)
    cfg, tok = start.cfg, start.tokenizer()
    device = run_device(args, cfg, out, log_path)

    data = read_pairs(data_path)
    if len(data) < 2:
        raise UserError(f"{data_path} holds {len(data)} pair; DPO needs at least 2 (1 held out)")
    train_idx, val_idx = split(len(data), n_val)
    n_val = len(val_idx)
    train, val, counts = prepare(data, train_idx, val_idx, tok, cfg.context)
    print(f"data: {data_path}: {len(data):,} pairs: {counts['train']:,} for training, {counts['val']:,} held out; "
          f"{counts['skipped']:,} skipped (a response does not fit the context of {cfg.context} tokens)")
    if not start.chat:
        print(f"note: {base if ck is None else out} is not a chat model (no `nanoeuler sft`): the pairs are "
              f"still rendered in the chat template")

    source_args = (hp.batch_size * hp.grad_accum, cfg.context, cfg.mtp_heads, hp.seed)
    eng = run_engine(cfg, device, args, hp, ck, None, params=start.params)
    if ck is not None:  # the reference log-probs of the starting model, computed when the run began
        ref = np.array(state["ref"], dtype=np.float64)
        if ref.shape != (counts["train"] + counts["val"], 2):
            raise UserError(f"--resume: {data_path} no longer gives the pairs {out} was trained on")
    else:
        t0 = time.perf_counter()
        ref = reference_logps(eng, train + val, hp.batch_size)
        print(f"reference: log-probabilities of {len(ref):,} pairs under {base} in {time.perf_counter() - t0:.1f} s "
              f"(kept in the checkpoint)")
    ref_train, ref_val = ref[:len(train)], ref[len(train):]
    source = PairBatches(train, ref_train, *source_args)
    if ck is not None:
        source.load_state(ck.train_state["source"])
    val_full = pair_eval_batches(val, ref_val, hp.batch_size, cfg.context, cfg.mtp_heads,
                                 limit=hp.final_eval_batches)
    val_quick = pair_eval_batches(val, ref_val, hp.batch_size, cfg.context, cfg.mtp_heads,
                                  limit=hp.eval_batches)

    slow = device == "cpu" and wants_gpu(cfg)
    origin = f"{out} (step {ck.step}, tuned from {base})" if ck is not None else f"{base} (step {start.step})"
    print(f"model: {origin}, {param_count(cfg) / 1e6:.2f}M parameters, context {cfg.context}, "
          f"{device.upper()} engine in {eng.precision}" + (" (no GPU: this will be slow)" if slow else ""))
    first_step = ck.step if ck is not None else 0
    print(f"dpo: steps {first_step + 1}..{hp.steps} of {batch_text(hp)} pairs, beta {beta:g}, peak lr {hp.lr:g}, "
          f"warmup {hp.warmup}, {schedule_text(hp)}; log {log_path}" + (f"; resuming {out}" if ck else ""))
    replace_note(out, ck)
    sys.stdout.flush()
    first = data[val_idx[0]]
    t0 = time.perf_counter()
    status = fit(eng, tok, source, val_quick, val_full, hp, out, log_path, start_step=first_step,
                 train_state=dict(kind="dpo", data=os.path.abspath(data_path), base=os.path.abspath(base),
                                  precision=eng.precision, beta=beta, val_pairs=n_val, pairs=counts,
                                  ref=ref.tolist()),
                 chat=True, sample_prompt=template.render_prompt(first["prompt"]), title="nanoeuler dpo",
                 log_first=dict(pairs_skipped=counts["skipped"]), objective=DPO(beta))
    if status == 0:
        print(f"done in {time.perf_counter() - t0:.0f} s: saved {out} (a chat model: `nanoeuler chat --ckpt "
              f"{out}`), log {log_path}")
    return status
