"""The losses of training and evaluation, written over the engine's per-position losses and per-position
gradient weights: model math, used by nanoeuler/train's objectives, nanoeuler/check and nanoeuler/eval.

The engine computes every head's cross-entropy at every position (losses (K, N)) and back-propagates any
weighting of them (Engine.backward(weights)). An objective is a choice of weights:

- the cross-entropy of pretraining and SFT: the mean over the K heads of each head's mean over its
  supervised targets, so weights[k, n] = 1 / (K * count_k) (count_k: head k's targets that are not -1, over
  the whole optimizer batch, every micro-batch and rank);
- DPO (Rafailov et al. 2023): a sequence's log-probability is pi_s = -sum of head 0's losses over its
  supervised targets; with pairs (chosen c, rejected r) and the reference model's ref,

      z_i  = beta * ((pi_c - ref_c) - (pi_r - ref_r))
      loss = (1 / pairs) * sum_i -log sigmoid(z_i)  +  alpha * (sum_i -pi_c,i) / chosen_tokens

  the second term RPO's (Pang et al. 2024; TRL's `rpo_alpha`): the chosen replies' NLL per token, which
  keeps DPO from winning its margin by pushing the rejected reply down onto unrelated tokens (docs/dpo.md);
  alpha 0 is plain DPO. d loss / d loss_s[0, n] = -d loss / d pi_s = beta * sigmoid(-z) / pairs + alpha /
  chosen_tokens on a chosen row's positions, -beta * sigmoid(-z) / pairs on a rejected row's, 0 for heads
  1..K-1.
"""
import math

import numpy as np

from nanoeuler.model.engine import to_numpy


# --------------------------------------------------------------------------------------- cross-entropy
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


# ------------------------------------------------------------------------------------------------- DPO
def dpo_margins(pi, ref, beta):
    """z (P,) of rows (2P,) holding the P chosen sequences, then the P rejected ones."""
    P = len(pi) // 2
    return beta * ((pi[:P] - ref[:P]) - (pi[P:] - ref[P:]))


def chosen_tokens(targets):
    """(2P,) rows -> the number of head-0 targets of the P chosen rows (what RPO's NLL is averaged over)."""
    targets = np.asarray(targets)
    return int((targets[0, :targets.shape[1] // 2] >= 0).sum())


def dpo_loss(z, pairs, pi=None, alpha=0.0, tokens=1):
    """sum of -log sigmoid(z) (stable for any z) over the pairs, divided by `pairs`; alpha > 0 adds RPO's
    alpha * (the chosen rows' summed -log-probability, pi (2P,)'s first half) / tokens."""
    loss = np.logaddexp(0.0, -z).sum() / pairs
    return float(loss - alpha * pi[:len(pi) // 2].sum() / tokens if alpha else loss)


def dpo_row_weights(z, beta, pairs, alpha=0.0, tokens=1):
    """(2P,): d loss / d loss_s of each row's head-0 cross-entropy, chosen rows first: DPO's
    beta * sigmoid(-z) / pairs, and on the chosen rows RPO's alpha / tokens."""
    w = beta * (1.0 / (1.0 + np.exp(z))) / pairs  # beta * sigmoid(-z) / pairs
    return np.concatenate([w + alpha / tokens, -w])


def dpo_backward(eng, inputs, targets, ref, beta, pairs=None, accumulate=False, alpha=0.0, tokens=None,
                 final=True):
    """The preference objective's gradients of P pairs into eng.grads: rows 0..P-1 of inputs (2P, T) the chosen
    sequences, rows P..2P-1 the rejected ones, targets (K, 2P, T) masking all but each response and its </s>
    with -1, ref (2P,) the reference model's sequence log-probabilities. pairs and tokens: what the DPO term
    and the chosen NLL are averaged over (this batch's pairs and chosen tokens, or a larger batch's with
    accumulate). alpha: RPO's weight of the chosen replies' NLL (0: plain DPO). final: passed on to
    Engine.backward, False on a step's passes before its last. Returns (loss, z)."""
    B, T = np.shape(inputs)
    if B % 2:
        raise ValueError(f"DPO needs chosen and rejected rows in pairs, got {B} rows")
    pairs = B // 2 if pairs is None else pairs
    tokens = chosen_tokens(targets) if tokens is None else tokens
    # the forward first: the weights need every sequence's log-probability
    pi = -to_numpy(eng.forward(inputs, targets)[0]).astype(np.float64).reshape(B, T).sum(axis=1)
    ref = np.asarray(ref, dtype=np.float64)
    z = dpo_margins(pi, ref, beta)
    weights = np.zeros((eng.cfg.mtp_heads, B, T))
    weights[0] = dpo_row_weights(z, beta, pairs, alpha, tokens)[:, None]
    eng.backward(weights.reshape(eng.cfg.mtp_heads, -1), accumulate, final=final)
    return dpo_loss(z, pairs, pi, alpha, tokens), z


def tie_accuracy(z):
    """The share of pairs whose chosen reward beats the rejected one (z > 0), a tie counting a half."""
    z = np.asarray(z)
    return float(((z > 0).sum() + 0.5 * (z == 0).sum()) / max(1, z.size))
