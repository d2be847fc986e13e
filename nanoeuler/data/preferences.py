"""Preference data for DPO (`nanoeuler dpo`): pairs of responses to one prompt, rendered as training rows.

Each line of the data is one pair {"prompt", "chosen", "rejected"}: the prompt an instruction alone, the two
responses bare text. Both responses are rendered with the chat template (template.py): prompt tokens,
response tokens, `</s>`, the prompt masked with -1 as SFT masks it. A pair of which either sequence is longer
than the context + 1 tokens is skipped (cutting a response would change what is compared) and counted. A
batch of P pairs is 2P rows: the P chosen sequences, then the P rejected ones.
"""
import json
import os

import numpy as np
from tqdm import tqdm

from nanoeuler.data import template
from nanoeuler.data.corpus import fetch_hint
from nanoeuler.data.instructions import ExampleBatches, held_out_groups, make_batch
from nanoeuler.errors import UserError

DEFAULT_DATA = "data/preferences.jsonl"
FIELDS = ("prompt", "chosen", "rejected")


def read_pairs(path):
    """[{prompt, chosen, rejected}] from a JSONL file; every way it can be wrong is a one-line UserError that
    names the line."""
    if not os.path.exists(path):
        raise UserError(f"preference data {path} not found{fetch_hint(path)}")
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
    resumable order) of the training pairs, with their reference log-probabilities; with N ranks, rank r
    takes the r-th `batch` of every N x batch pairs."""

    def __init__(self, pairs, ref, batch, context, K, seed, rank=0, world_size=1):
        super().__init__(list(range(len(pairs))), batch, context, K, seed, rank, world_size)
        self.pairs, self.ref = pairs, ref  # ref (n, 2): chosen, rejected

    def next(self):
        picks = self.picks()
        inputs, targets = pair_batch([self.pairs[i] for i in picks], self.context, self.K)
        return inputs, targets, np.concatenate([self.ref[picks, 0], self.ref[picks, 1]])


def pair_eval_batches(pairs, ref, batch, context, K, limit=None):
    """(inputs, targets, ref) batches over the held-out pairs, in order; with `limit`, that many spread evenly."""
    out = []
    for group in held_out_groups(len(pairs), batch, limit):
        inputs, targets = pair_batch([pairs[i] for i in group], context, K)
        out.append((inputs, targets, np.concatenate([ref[group, 0], ref[group, 1]])))
    return out


