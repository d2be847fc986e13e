"""Random test problems shared by the gradient checks (`nanoeuler check`, `nanoeuler check --gpu`) and the
tests: well-conditioned parameters, a batch with masked targets, and the error metric.

A module of its own, below both checks, so that neither check imports the other.
"""
import dataclasses
import math

import numpy as np

from nanoeuler.model.config import param_layout, quant_format, quantized_names, views
from nanoeuler.model.quantize import quantize


def random_problem(cfg, rng, batch=2, scale=0.15):
    """(flat float64 parameters, inputs (batch, T) int32, targets (K, batch, T) int32), T = cfg.context.

    Parameters are normal(0, scale), norm gains 1 + normal(0, 0.2): larger than the training init, so every
    layer has gradients well above rounding noise and softmax and SiLU leave their linear regimes. The
    targets are the sequence shifted by 1 + k for head k, with some set to -1: one position of the first
    sequence in every head, and a run of 4 positions of the last sequence in the last head."""
    layout, total = param_layout(cfg)
    flat = rng.normal(0.0, scale, total)
    for name, (off, shape) in layout.items():
        if name.endswith("norm"):
            flat[off:off + math.prod(shape)] = 1.0 + rng.normal(0.0, 0.2, math.prod(shape))
    T, K = cfg.context, cfg.mtp_heads
    seq = rng.integers(0, cfg.vocab_size, (batch, T + K))
    inputs = seq[:, :T].astype(np.int32)
    targets = np.stack([seq[:, 1 + k:1 + k + T] for k in range(K)]).astype(np.int32)
    targets[:, 0, T // 3] = -1                  # a masked position in every head
    targets[K - 1, batch - 1, T // 2:T // 2 + 4] = -1  # and a masked run in the last head
    return flat, inputs, targets


def quantized_problem(cfg, flat, kind, group, head=None):
    """The problem's model with its matrices quantized (`kind` int8/int4 in groups of `group`; the untied heads
    `head` in groups of 32 where given and not the layers' format: the mixed checkpoint `quantize --type int4`
    writes): (its config, its float tensors flat, {name: QuantizedTensor}), what Engine.load_params takes."""
    full = views(flat, cfg)
    own = head is not None and not cfg.tied and (head, 32) != (kind, group)
    qcfg = dataclasses.replace(cfg, quant=kind, quant_group=group, quant_head=head if own else None,
                               quant_head_group=32 if own else None)
    quantized = {name: quantize(full[name], *quant_format(qcfg, name)) for name in quantized_names(qcfg)}
    floats = np.concatenate([full[name].reshape(-1) for name in param_layout(qcfg, floats_only=True)[0]])
    return qcfg, floats, quantized


def relative_error(a, b):
    """Entrywise |a - b| / max(|a|, |b|), defined as 0 where both are 0."""
    denom = np.maximum(np.abs(a), np.abs(b))
    return np.where(denom > 0, np.abs(a - b) / np.where(denom > 0, denom, 1.0), 0.0)
