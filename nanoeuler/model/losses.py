"""The model's losses, written over the engine's per-position losses and per-position gradient weights: the
cross-entropy, bits per byte and sequence log-probabilities that training's objectives (nanoeuler/train/
objectives.py, where DPO's formulas are too), nanoeuler/check and nanoeuler/eval use.

The engine computes every head's cross-entropy at every position (losses (K, N)) and back-propagates any
weighting of them (Engine.backward(weights)). An objective is a choice of weights: the cross-entropy of
pretraining and SFT is the mean over the K heads of each head's mean over its supervised targets, so
weights[k, n] = 1 / (K * count_k) (count_k: head k's targets that are not -1, over the whole optimizer batch,
every micro-batch and rank).
"""
import math

import numpy as np

from nanoeuler.model.engine import to_numpy


# --------------------------------------------------------------------------------------- cross-entropy
def log_softmax(logits):
    """log-probabilities of logits (..., V) along the last axis, in float64 on the host (a copy: the logits are
    left as they are); the one log-softmax that decoding's log-probs, the server's and eval's scores read."""
    z = to_numpy(logits).astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def supervised_counts(targets):
    """(K,) float64: each head's targets that are not -1."""
    targets = np.asarray(targets)
    return (targets >= 0).reshape(targets.shape[0], -1).sum(axis=1).astype(np.float64)


def _per_head(losses, counts, xp=None):
    """(mean over heads, head 0's) of each head's summed losses (K, N) divided by counts[k] (a host array, or
    one of the engine's library: then divided there, and read once): floats, or with xp (the engine's library)
    float64 scalars of it that the host has not waited for."""
    if xp is not None:
        per_head = losses.sum(axis=1).astype(np.float64) / xp.asarray(counts).clip(1, None)
        return per_head.mean(), per_head[0]
    if isinstance(counts, np.ndarray):
        per_head = to_numpy(losses.sum(axis=1)).astype(np.float64) / np.maximum(counts, 1)
    else:
        per_head = to_numpy(losses.sum(axis=1).astype(np.float64) / counts.clip(1, None))
    return float(per_head.mean()), float(per_head[0])


def cross_entropy(eng, inputs, targets):
    """(loss, loss0) without gradients: loss is the mean over the K heads, loss0 head 0's."""
    return _per_head(eng.forward(inputs, targets), supervised_counts(targets))


def cross_entropy_backward(eng, inputs, targets, counts=None, accumulate=False, final=True, on_device=False):
    """The cross-entropy's gradients into eng.grads (added to them with accumulate); (loss, loss0), floats, or
    with on_device scalars on the engine's device (the host does not wait for the pass). counts (K,): the
    supervised targets per head of the whole optimizer batch when this is a part of it (gradient accumulation,
    data parallelism): the parts' losses and gradients then add up to the batch's; on the GPU they may be a
    device array (the ranks' sum, which the host has not waited for). final: passed on to
    Engine.forward_backward, False on a step's passes before its last."""
    if counts is None or not hasattr(counts, "clip"):  # a list, or none: this batch's own on the host
        counts = supervised_counts(targets) if counts is None else np.asarray(counts, dtype=np.float64)
    # counts on the device (all-reduced there): the weights are made there, so the host need not wait
    weights = (1.0 / (len(counts) * counts.clip(1, None)))[:, None]
    return _per_head(eng.forward_backward(inputs, targets, weights, accumulate, final=final), counts,
                     eng.xp if on_device else None)


def sequence_logprobs(eng, inputs, targets):
    """(B,) float64: each row's sum of head-0 log-probabilities of its supervised targets (for a chat pair, the
    response tokens and </s>). No gradients."""
    B, T = np.shape(inputs)
    return -to_numpy(eng.forward(inputs, targets)[0]).astype(np.float64).reshape(B, T).sum(axis=1)


def bits_per_byte(eng, batches, comm=None):
    """(mean head-0 loss in nats per token, bits per byte) over eval batches (inputs, targets, n_bytes). With comm
    (N ranks), rank r scores every N-th batch and the ranks' sum of the per-batch losses (zeros elsewhere) gives
    every rank the numbers of one process, added up in the same order."""
    rank, ranks = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    parts = np.zeros(len(batches))
    for i in range(rank, len(batches), ranks):
        inputs, targets, _ = batches[i]
        parts[i] = cross_entropy(eng, inputs, targets)[1] * int((targets[0] >= 0).sum())
    if ranks > 1:
        parts = comm.all_reduce_sum(parts)
    total, count, n_bytes = 0.0, 0, 0
    for part, (_, targets, b) in zip(parts, batches):
        total += part
        count += int((targets[0] >= 0).sum())
        n_bytes += b
    return total / count, total / math.log(2) / n_bytes
