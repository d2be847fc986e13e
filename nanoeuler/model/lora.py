"""LoRA: low-rank adapters on a frozen model's projections, written once for both engines.

A target t of layer i (q, k, v, o, gate, up, down: the products wq, wk, wv, wo, w_gate, w_up, w_down) gets two
matrices, A (r, in) and B (out, r), and its product becomes

    y = x W^T + (alpha / r) * dropout(x) A^T B^T          x (N, in), W (out, in)

as in Hu et al. (2021) and PEFT's LoRA, whose files io/peft.py reads and writes (same A and B, same scaling,
dropout on the adapter's input only). W stays frozen: the backward pass computes no gradient for it, only the
input gradient that flows through it, and the adapters' own. A starts uniform in +-1/sqrt(in) and B at zero
(PEFT's default), so an untrained adapter leaves the model as it is.

The engine (model/engine.py) asks its `adapters` (an `Adapters`, or None) at each target: `forward` adds the
update to the product's output (for q, k and v a column slice of the fused q|k|v product, before the rotary
embedding; for gate and up one of gate|up, before SwiGLU), `backward` adds the update's input gradient to the
product's and accumulates the gradients of A and B. The arithmetic is the layers' `lora_forward`,
`lora_backward` and `dropout_forward`, the same functions on both engines. The low-rank activation x A^T
(N, r) of every target is kept for the backward pass (r columns: small). Targets that share an input (q, k and
v; gate and up) take it together where no dropout is drawn (`forward_group`, `backward_group` on the layers'
`lora_forward_group` and `lora_backward_group`): their A matrices stacked, one product x A^T for all of them
and one each for dA and dx, so the input and its gradient are read once a group, not once a target. Dropout's
mask is not kept but drawn again from a counter-based hash of (key, layer, target, element), so the backward
pass sees the forward's mask and the CPU and GPU draw the same one. The key is set by the training loop each
micro-batch (`dropout_key`), so a resumed run draws what the uninterrupted one would have.

Adapters keep flat buffers as the engine does: `params` (float32 master weights), `weights` (the compute
copy, bf16 on the GPU's mixed precision, else params itself) and `grads`; AdamW (model/optimizer.py) steps
them as it steps an engine. Their layout is `adapter_layout`: `layers.{i}.{t}.lora_a` then `.lora_b`, layer by
layer, in TARGETS order.

    spec = LoraSpec(rank=16, alpha=32)
    ad = attach(eng, spec)                 # eng made with training=False: the base keeps no gradient
    eng.forward_backward(inputs, targets, weights)   # gradients in ad.grads only
"""
import dataclasses
import json
import math

import numpy as np

from nanoeuler.errors import UserError
from nanoeuler.model.config import quant_format, views

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
BASE_NAMES = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down"}
DEFAULT_ALPHA_PER_RANK = 2.0  # alpha = 2r (a scale of 2) unless given, as torchtune's and Unsloth's recipes
_MASK64 = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple = TARGETS

    @property
    def scale(self):
        """alpha / r: the factor of the low-rank update."""
        return self.alpha / self.rank

    def to_json(self):
        return json.dumps({"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                           "targets": list(self.targets)}, sort_keys=True)

    @classmethod
    def from_json(cls, text):
        d = json.loads(text)
        return cls(int(d["rank"]), float(d["alpha"]), float(d["dropout"]), tuple(d["targets"]))


def parse_targets(text):
    """'q,v' -> ('q', 'v') in TARGETS order; a one-line UserError for a name that is none of them."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise UserError(f"--lora-targets {text!r}: {'unknown ' + ', '.join(unknown) if unknown else 'empty'}; "
                        f"choose among {','.join(TARGETS)}")
    return tuple(t for t in TARGETS if t in names)


def make_spec(cfg, rank, alpha=None, dropout=0.0, targets=TARGETS):
    """A LoraSpec checked against the model: rank at least 1 and at most every target's smaller side, alpha
    positive, dropout in [0, 1); one-line UserErrors otherwise."""
    if rank is None or rank < 1:
        raise UserError(f"--lora {rank}: the rank must be at least 1")
    alpha = DEFAULT_ALPHA_PER_RANK * rank if alpha is None else float(alpha)
    if not alpha > 0:
        raise UserError(f"--lora-alpha {alpha:g}: must be positive")
    if not 0.0 <= dropout < 1.0:
        raise UserError(f"--lora-dropout {dropout:g}: must be in [0, 1)")
    for t in targets:
        if t not in TARGETS:
            raise UserError(f"--lora-targets: unknown target {t!r}; choose among {','.join(TARGETS)}")
        out, inp = target_shape(cfg, t)
        if rank > min(out, inp):
            raise UserError(f"--lora {rank}: larger than target {t}'s {out} x {inp} product allows "
                            f"(rank at most {min(out, inp)})")
    return LoraSpec(int(rank), alpha, float(dropout), tuple(t for t in TARGETS if t in targets))


def target_shape(cfg, t):
    """(out, in) of target t's product."""
    H, G, D, C, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim, cfg.hidden
    return {"q": (H * D, C), "k": (G * D, C), "v": (G * D, C), "o": (C, H * D), "gate": (F, C), "up": (F, C),
            "down": (C, F)}[t]


def adapter_layout(cfg, spec):
    """({name: (offset, shape)}, total): layers.{i}.{t}.lora_a (r, in) and .lora_b (out, r), layer by layer."""
    layout, off = {}, 0
    for i in range(cfg.n_layers):
        for t in spec.targets:
            out, inp = target_shape(cfg, t)
            for name, shape in (("lora_a", (spec.rank, inp)), ("lora_b", (out, spec.rank))):
                layout[f"layers.{i}.{t}.{name}"] = (off, shape)
                off += math.prod(shape)
    return layout, off


def adapter_views(flat, cfg, spec):
    layout, _ = adapter_layout(cfg, spec)
    return {name: flat[off:off + math.prod(shape)].reshape(shape) for name, (off, shape) in layout.items()}


def init_adapters(cfg, spec, seed=0, dtype=np.float32):
    """A flat buffer of fresh adapters: every A uniform in +-1/sqrt(in) (PEFT's kaiming_uniform with a = sqrt(5)),
    every B zero."""
    layout, total = adapter_layout(cfg, spec)
    rng = np.random.default_rng(seed)
    flat = np.zeros(total, dtype=np.float64)
    for name, (off, shape) in layout.items():
        if name.endswith("lora_a"):
            bound = 1.0 / math.sqrt(shape[1])
            flat[off:off + math.prod(shape)] = rng.uniform(-bound, bound, math.prod(shape))
    return flat.astype(dtype)


def merge(cfg, base, spec, adapters):
    """The flat float32 parameters of the base with each target's update folded in: W + (alpha / r) B A (what
    export --hf / --gguf and inference with --adapter run)."""
    merged = np.array(base, dtype=np.float32)
    w, ad = views(merged, cfg), adapter_views(np.asarray(adapters, dtype=np.float32), cfg, spec)
    for i in range(cfg.n_layers):
        for t in spec.targets:
            a, b = ad[f"layers.{i}.{t}.lora_a"].astype(np.float64), ad[f"layers.{i}.{t}.lora_b"].astype(np.float64)
            target = w[f"layers.{i}.{BASE_NAMES[t]}"]
            target[...] = (target.astype(np.float64) + spec.scale * (b @ a)).astype(np.float32)
    return merged


def merge_quantized(cfg, quantized, spec, adapters):
    """A quantized base's {name: QuantizedTensor} with each target's update folded in and quantized again in the
    base's format: quantize(dequantize(W) + (alpha / r) B A) (QLoRA's merge; the second quantization adds its
    error to the first's: docs/lora.md). Untargeted matrices are kept as they are."""
    from nanoeuler.model.quantize import dequantize, quantize
    merged = dict(quantized)
    ad = adapter_views(np.asarray(adapters, dtype=np.float32), cfg, spec)
    for i in range(cfg.n_layers):
        for t in spec.targets:
            a, b = ad[f"layers.{i}.{t}.lora_a"].astype(np.float64), ad[f"layers.{i}.{t}.lora_b"].astype(np.float64)
            name = f"layers.{i}.{BASE_NAMES[t]}"
            w = dequantize(quantized[name]).astype(np.float64) + spec.scale * (b @ a)
            merged[name] = quantize(w.astype(np.float32), *quant_format(cfg, name))
    return merged


def _mix64(x):
    """splitmix64's finaliser on Python ints (the dropout keys; the layers' hash is the same function)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class Adapters:
    """One engine's adapters (module docstring): their buffers on the engine's device, read by its forward and
    backward passes while `enabled` (off: the base model alone, DPO's reference), with dropout while
    `dropout_on` (training; off for evaluation and decoding)."""

    def __init__(self, eng, spec, flat=None, seed=0, training=True):
        self.eng, self.cfg, self.spec = eng, eng.cfg, spec
        self.layout, total = adapter_layout(eng.cfg, spec)
        xp, dtype, act = eng.xp, eng.dtype, eng.act
        if flat is None:
            flat = init_adapters(eng.cfg, spec, seed)
        flat = np.asarray(flat)
        if flat.shape != (total,):
            raise ValueError(f"adapters of {flat.size} values for a layout of {total}")
        self.xp, self.dtype, self.act = xp, dtype, act
        self.params = xp.asarray(flat.astype(dtype))
        self.weights = self.params if act == dtype else xp.zeros(total, dtype=act)
        self.grads = xp.zeros(total, dtype=dtype) if training else None
        self.p = self._views(self.weights)
        self.g = self._views(self.grads) if training else None
        self.sync_weights()
        self.layers = eng.layers
        # data parallelism (train/distributed.py) steps adapters as it steps an engine: it sets this, called
        # with offset 0 when the backward pass has made every adapter gradient final
        self.gradients_ready = None
        self.enabled = True
        self.dropout_on = spec.dropout > 0
        self.dropout_key = 0
        self.index = {t: k for k, t in enumerate(spec.targets)}
        self._low_rank = {}  # (slots, N) -> (slots, N, targets * r) kept x A^T
        self._scratch = {}

    def _views(self, flat):
        return {name: flat[off:off + math.prod(shape)].reshape(shape) for name, (off, shape) in self.layout.items()}

    @property
    def size(self):
        return self.params.size

    def sync_weights(self):
        if self.weights is not self.params:
            self.eng.layers.cast_params(self.weights, self.params)

    def load(self, flat):
        self.params[...] = self.xp.asarray(np.asarray(flat, dtype=self.dtype))
        self.sync_weights()

    def params_numpy(self):
        return np.asarray(self.params.get() if hasattr(self.params, "get") else self.params, dtype=np.float32)

    # ------------------------------------------------- what the optimizer and data parallelism ask of them
    def read_later(self, a):
        return self.eng.read_later(a)

    def device_memory(self):
        return self.eng.device_memory()

    def gradient_offsets(self):
        """The offsets gradients_ready is called with: the adapters' gradients are final together, at the end."""
        return [0]

    def pad_buffers(self, multiple, grads=None):
        """params and grads moved into buffers padded to a multiple of `multiple` (Engine.pad_buffers)."""
        total = self.params.size
        size = -(-total // multiple) * multiple
        same = self.weights is self.params
        for name in ("params", "grads"):
            padded = grads if name == "grads" and grads is not None else self.xp.zeros(size, dtype=self.dtype)
            padded[:total] = getattr(self, name)
            if name == "grads" and grads is not None:
                padded[total:] = 0
            setattr(self, name + "_padded", padded)
            setattr(self, name, padded[:total])
        if same:
            self.weights = self.params
        self.p, self.g = self._views(self.weights), self._views(self.grads)

    def targets(self, *names):
        """Whether the adapters are on and change any of the named targets."""
        return self.enabled and any(t in self.index for t in names)

    # ------------------------------------------------------------------------------------------ buffers
    def _buffer(self, key, shape, dtype):
        buf = self._scratch.get(key)
        if buf is None or buf.shape != shape:
            buf = self._scratch[key] = self.xp.empty(shape, dtype=dtype)
        return buf

    def low_rank(self, slots, N):
        """(slots, N, targets * r): the kept x A^T of each target (its r columns, in spec.targets' order: the
        targets that share an input side by side, as lora_forward_group writes them), a slot a layer (one where
        the layers are recomputed, or for decoding). Kept for every shape asked (a few: training's,
        evaluation's, decoding's steps, whose recorded graphs keep reading theirs)."""
        key = (slots, N)
        if key not in self._low_rank:
            self._low_rank[key] = self.xp.empty((slots, N, len(self.spec.targets) * self.spec.rank), dtype=self.act)
        return self._low_rank[key]

    def _columns(self, h, ts):
        """The columns of a slot h (N, targets * r) that targets ts (consecutive in spec.targets) keep."""
        r = self.spec.rank
        return h[:, self.index[ts[0]] * r:(self.index[ts[-1]] + 1) * r]

    def normed_input(self, N):
        """A buffer for a sublayer's normed input where the activations keep none (decoding): the update reads it."""
        return self._buffer(("xn", N), (N, self.cfg.dim), self.act)

    def _dropped(self, x, key, dropout):
        """dropout(x) with the mask of key, into a scratch buffer (x itself where dropout is off)."""
        p = self.spec.dropout
        if not (dropout and self.dropout_on and p > 0):
            return x
        out = self._buffer(("xd", x.shape), x.shape, self.act)
        self.eng.layers.dropout_forward(out, x, p, key, False)
        return out

    def _key(self, i, t):
        return _mix64((self.dropout_key << 16) + i * 8 + self.index[t] + 1)

    # --------------------------------------------------------------------------------- forward, backward
    def forward(self, i, t, h, out, x, dropout=True, kept=False):
        """out (N, out) += scale * dropout(x) (N, in) A^T B^T for target t of layer i (nothing where t has no
        adapter); h (N, targets * r), the layer's slot of low_rank, keeps x A^T (out None: that alone, for a
        recomputation whose out is kept). dropout False: none whatever dropout_on says (decoding). kept: h
        holds this pass's x A^T already (a recomputation where the slots are a layer's): the update alone."""
        if t not in self.index or (kept and out is None):
            return
        name = f"layers.{i}.{t}."
        xd = None if kept else self._dropped(x, self._key(i, t), dropout)
        self.eng.layers.lora_forward(out, self._columns(h, (t,)), xd, self.p[name + "lora_a"],
                                     self.p[name + "lora_b"], self.spec.scale)

    def backward(self, i, t, h, dx, dout, x):
        """dx (N, in) += the update's input gradient given dout (N, out); the gradients of A and B accumulate;
        h as forward's, x the same input (the mask is drawn again)."""
        if t not in self.index:
            return
        N = x.shape[0]
        name, key = f"layers.{i}.{t}.", self._key(i, t)
        xd = self._dropped(x, key, True)
        dh = self._buffer(("dh", N), (N, self.spec.rank), self.act)
        layers, a, b = self.eng.layers, self.p[name + "lora_a"], self.p[name + "lora_b"]
        da, db, h = self.g[name + "lora_a"], self.g[name + "lora_b"], self._columns(h, (t,))
        if xd is x:
            layers.lora_backward(dx, da, db, dh, dout, x, h, a, b, self.spec.scale, True)
        else:  # the input gradient through the same mask: into scratch, then masked and added
            dxd = self._buffer(("dxd", x.shape), x.shape, self.act)
            layers.lora_backward(dxd, da, db, dh, dout, xd, h, a, b, self.spec.scale, False)
            layers.dropout_forward(dx, dxd, self.spec.dropout, key, True)

    def _grouped(self, ts, dropout):
        """The targets of ts with adapters, where two or more of them share their input unchanged (no dropout
        drawn): lora_forward_group then reads it once for all; else None."""
        ts = tuple(t for t in ts if t in self.index)
        drops = dropout and self.dropout_on and self.spec.dropout > 0
        return ts if len(ts) > 1 and not drops else None

    def _stacked(self, i, ts, kind, views):
        """The matrices `kind` (lora_a) of layer i's targets ts stacked, (k r, in): one buffer a group, refilled
        at each use (the weights change at every optimizer step)."""
        parts = [views[f"layers.{i}.{t}.{kind}"] for t in ts]
        rows = parts[0].shape[0]
        out = self._buffer(("stack", ts, kind), (len(parts) * rows,) + parts[0].shape[1:], parts[0].dtype)
        for j, part in enumerate(parts):
            out[j * rows:(j + 1) * rows] = part
        return out

    def forward_group(self, i, ts, h, outs, x, dropout=True, kept=False):
        """forward(i, t, h, out, x, dropout, kept) for each target t of ts with its out of outs, all sharing the
        input x: where two or more have adapters and no dropout is drawn (or kept: h holds their x A^T already),
        x A^T of them all in one product (lora_forward_group: the A matrices stacked), else one target at a
        time."""
        group = self._grouped(ts, dropout and not kept)
        if group is None:
            for t, out in zip(ts, outs):
                self.forward(i, t, h, out, x, dropout, kept)
            return
        outs = [out for t, out in zip(ts, outs) if t in self.index]
        b = [self.p[f"layers.{i}.{t}.lora_b"] for t in group]
        a = None if kept else self._stacked(i, group, "lora_a", self.p)
        self.eng.layers.lora_forward_group(outs, self._columns(h, group), None if kept else x, a, b,
                                           self.spec.scale)

    def backward_group(self, i, ts, h, dx, douts, x):
        """backward(i, t, h, dx, dout, x) for each target t of ts with its dout of douts, all sharing x; grouped
        as forward_group groups them (one pass over x and one over dx for the group): dA of the stacked A
        matrices into a zeroed float32 scratch, then added to each target's."""
        group = self._grouped(ts, True)
        if group is None:
            for t, dout in zip(ts, douts):
                self.backward(i, t, h, dx, dout, x)
            return
        douts = [dout for t, dout in zip(ts, douts) if t in self.index]
        N, r = x.shape[0], self.spec.rank
        dh = self._buffer(("dh", N, len(group)), (N, len(group) * r), self.act)
        a = self._stacked(i, group, "lora_a", self.p)
        da = self._buffer(("da", a.shape), a.shape, self.dtype)
        da.fill(0)
        b = [self.p[f"layers.{i}.{t}.lora_b"] for t in group]
        db = [self.g[f"layers.{i}.{t}.lora_b"] for t in group]
        self.eng.layers.lora_backward_group(dx, da, db, dh, douts, x, self._columns(h, group), a, b, self.spec.scale)
        for j, t in enumerate(group):
            self.g[f"layers.{i}.{t}.lora_a"] += da[j * r:(j + 1) * r]


def attach(eng, spec, flat=None, seed=0, training=True):
    """Adapters of spec on eng (fresh ones, or flat's), read by its passes from now on; returns them."""
    eng.adapters = Adapters(eng, spec, flat, seed, training)
    return eng.adapters


def decay_mask(ad):
    """AdamW's decay mask of the adapters: all matrices."""
    return np.ones(ad.size, dtype=np.uint8)
