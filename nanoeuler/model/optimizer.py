"""AdamW over a model's one flat parameter buffer, on either engine.

    opt = AdamW(eng)                                   # moments, decay mask and step count, on eng's device
    grad_norm = opt.step(eng, lr, weight_decay=0.1, grad_clip=1.0)

The moments m and v are flat buffers laid out like the parameters (config.param_layout); weight decay applies
to the matrices only (the decay mask, a byte an element). `update` is one AdamW step of any matching slices of
parameters and gradients, and `update_pieces` of several, which is how ZeRO-1 (train/distributed.py) updates
its shard: `shard` gives the optimizer of one rank's pieces of the buffers. The arithmetic is the layers'
`adamw_update` kernel.
"""
import math

import numpy as np

from nanoeuler.model.config import is_matrix, param_layout
from nanoeuler.model.engine import to_numpy
from nanoeuler.model.limits import clip_scale


def decay_mask(cfg):
    """uint8 (params,): 1 where AdamW decays the weight (matrices), 0 on the norm gains and biases."""
    mask = DecayMask(cfg)
    return mask.read(0, mask.size)


class DecayMask:
    """decay_mask(cfg)'s elements [start, end) made on their own (read(start, end)): a ZeRO-2/3 rank's shard
    of the mask without the whole (train/sharded.py)."""
    dtype = np.dtype(np.uint8)

    def __init__(self, cfg):
        self.layout, self.size = param_layout(cfg)

    def read(self, start, end):
        out = np.zeros(end - start, dtype=self.dtype)
        for name, (off, shape) in self.layout.items():
            lo, hi = max(start, off), min(end, off + math.prod(shape))
            if lo < hi and is_matrix(name):
                out[lo - start:hi - start] = 1
        return out


class AdamW:
    def __init__(self, eng, beta1=0.9, beta2=0.95, eps=1e-8, mask=None):
        """Zero moments for eng's parameters (or for the elements of `mask`, a decay mask of a shard)."""
        self.layers, self.xp, self.dtype = eng.layers, eng.xp, eng.dtype
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        mask = decay_mask(eng.cfg) if mask is None else mask
        self.decay_mask = self.xp.asarray(mask)
        self.m = self.xp.zeros(mask.size, dtype=self.dtype)
        self.v = self.xp.zeros(mask.size, dtype=self.dtype)
        self.steps = 0  # updates taken: the bias correction's exponent, saved in checkpoints for resume

    def squared_norm(self, grads, on_device=False):
        """sum(grads^2), accumulated in float64: a float, or with on_device a scalar the host need not wait for."""
        return self.layers.sum_squares(grads, on_device)

    def update(self, params, grads, lr, weight_decay, grad_scale, compute_copy=None, squares=None, grad_clip=0.0):
        """One AdamW step of params from grads * grad_scale; compute_copy (the bf16 weights the layers read),
        where given, is rewritten from the new params in the same pass. With squares (the global gradient's sum
        of squares, a scalar on the engine's device), the scale is clip_scale(sqrt(squares), grad_clip) instead,
        computed where the update runs: the host need not wait for the norm."""
        self.steps += 1
        self.layers.adamw_update(params, grads, self.m, self.v, self.decay_mask, lr, self.beta1, self.beta2,
                                 self.eps, weight_decay, grad_scale, self.steps, compute_copy=compute_copy,
                                 squares=squares, grad_clip=grad_clip)

    def step(self, eng, lr, weight_decay, grad_clip):
        """Clip eng's gradients to the global norm grad_clip (0: no clipping), update its weights; returns the
        norm before clipping."""
        norm = math.sqrt(self.squared_norm(eng.grads))
        copy = None if eng.weights is eng.params else eng.weights
        self.update(eng.params, eng.grads, lr, weight_decay, clip_scale(norm, grad_clip), copy)
        return norm

    def update_pieces(self, params, grads, pieces, lr, weight_decay, grad_scale, compute_copy=None, count=True,
                      squares=None, grad_clip=0.0):
        """One AdamW step of pieces of the parameters: pieces [(start, end, at)] update params[start:end] (and
        compute_copy's, cut at its end: the parameters may be padded) from grads[start:end], with the moments and
        decay mask [at:at + end - start] (ZeRO-1's shard, or all of them); count=False for more pieces of the
        same step; squares and grad_clip as update's."""
        self.steps += count
        limit = compute_copy.size if compute_copy is not None else params.size
        for start, end, at in pieces:
            end = min(end, limit)
            if end <= start:
                continue
            shard = slice(at, at + end - start)
            self.layers.adamw_update(params[start:end], grads[start:end], self.m[shard], self.v[shard],
                                     self.decay_mask[shard], lr, self.beta1, self.beta2, self.eps, weight_decay,
                                     grad_scale, self.steps,
                                     compute_copy=None if compute_copy is None else compute_copy[start:end],
                                     squares=squares, grad_clip=grad_clip)

    def shard(self, eng, ranges):
        """The optimizer of one rank's shard, the buffers' elements [start, end) of each range, one after another
        (zero-padded past the parameters), its moments and step count copied from this one (ZeRO-1)."""
        def pieces(a):
            full = to_numpy(a)
            padding = max(end for _, end in ranges) - full.size
            full = np.concatenate([full, np.zeros(max(0, padding), dtype=full.dtype)])
            return np.concatenate([full[start:end] for start, end in ranges])
        sharded = AdamW(eng, self.beta1, self.beta2, self.eps, mask=pieces(self.decay_mask))
        sharded.m[...] = self.xp.asarray(pieces(self.m))
        sharded.v[...] = self.xp.asarray(pieces(self.v))
        sharded.steps = self.steps
        return sharded

    def state(self):
        """(m, v) as float32 host arrays."""
        return to_numpy(self.m).astype(np.float32), to_numpy(self.v).astype(np.float32)

    def load_state(self, m, v, steps):
        self.m[...] = self.xp.asarray(np.asarray(m, dtype=self.dtype))
        self.v[...] = self.xp.asarray(np.asarray(v, dtype=self.dtype))
        self.steps = steps
