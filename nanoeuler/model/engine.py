"""The model, composed once for both engines.

`Engine` runs the forward pass and the hand-written backward pass by calling its *layers*, `eng.layers`: a
`Layers` of `nanoeuler.model.cpu.layers` (numba) or of `nanoeuler.model.gpu.layers` (CUDA kernels + cuBLAS),
whose methods are the same functions with the same signatures, over arrays of that module's array library
(NumPy or CuPy). The engine's precision and batch invariance are set in its Layers when they are made
(make_engine), and every layer call, inside the engine or outside it (decoding, the optimizer, the checks),
goes through that object: there is no mode to enter, and engines of different settings live side by side.
So the CPU and GPU engines differ only in their layers, and everything above them (objectives, the
optimizer, decoding, training, checkpoints) is written once against this class.

    from nanoeuler.model.engine import make_engine
    eng = make_engine(cfg, device="cpu")          # float32; dtype=np.float64 for the gradient check
    losses = eng.forward_backward(inputs, targets, weights)   # (K, N) per position; gradients in eng.grads

The engine knows no objective: it computes each head's cross-entropy at every position, and its backward
pass takes a gradient weight per (head, position), d objective / d loss[k, n]. The mean cross-entropy of
pretraining and SFT and the DPO loss are such weights (train/objectives.py). Decoding with a KV cache is
`decoding.decoder_of(eng)` (decoding.py); the AdamW step is optimizer.py.

The logits of a large vocabulary are the largest activation (Llama 3's 128,256 a position: 1 GB in bf16 for 4,096
positions), so they are never held whole beyond LOGITS_BYTES (512 MiB): the heads' product, the cross-entropy and the
gradient's way back through the heads go a piece of rows at a time (_head), one piece's logits held.

Parameters and gradients are each one flat buffer (layout: config.param_layout). Because wq|wk|wv,
w_gate|w_up and heads.0..K-1 sit next to each other in that buffer, each group is one fused matrix here: one
matmul instead of three, two or K; a model's q/k/v biases (bq|bk|bv, right after them) are likewise one
`bqkv`, added to the product before the rotary embedding, whose gradient is the column sums of d(qkv) after
the attention's backward pass has undone the rotation. A tied model's head 0 (`heads`, `heads.0`) is a view of `tok_emb`, in the
weights and in the gradients: the head's product reads the embedding, and its gradient is added to the
embedding's (every parameter gradient accumulates), so the tensor trains as the sum of both uses.

A quantized model (cfg.quant: model/quantize.py) decodes and scores only: its flat buffer holds the float
tensors alone (norms, embedding, biases, a tied head), and load_params puts its quantized matrices, fused as
above (rows stacked: exact), into `p` as the layers' quantized matrices (`Layers.quantized_matrix`), which
their products read packed.

Mixed precision (the GPU's "bf16"): the flat buffers above stay float32 (the master weights, what
checkpoints hold), and the layers read `weights`, a bf16 copy that AdamW rewrites in its pass; activations
are bf16, parameter gradients float32. Elsewhere `weights` is `params` itself.

Sharded weights and gradients (ZeRO-2/3, train/sharded.py): the passes go through the model a *unit* at a
time (`units()`: the embedding, each layer, the head: the final norm and the output heads) and tell
`sharding`, where it is set, before and after each: `gather(unit)` before a unit's weights are read (in the
forward pass and again in the backward pass, `backward=True`, the recomputed forward included) and
`release(unit)` after; `open_grads(unit)` before a unit's backward and `reduce(unit, accumulate)` once its
gradients are final.
The sharding object puts the unit's views into `p` and `g` (unit_views) and takes them out again, so the
layers read the same names whether the engine holds every weight or one unit's. An engine made for it
(zero 2 or 3) never holds the whole buffers that it keeps in shards: no whole gradients or master weights,
and in ZeRO-3 no whole weights (release_whole). Without it (the default) the engine holds all of them and
nothing is called.
"""
import math

import numpy as np

from nanoeuler.errors import UserError
from nanoeuler.model import memory
from nanoeuler.model.config import init_params, param_layout, quant_format, quantized_names, rope_tables
from nanoeuler.model.device import DEFAULT_PRECISION, precision as device_precision
from nanoeuler.model.quantize import concat_rows, stored_arrays


def to_float32(a):
    """a as float32 (bf16 activations are uint16: the top half of a float32's bits)."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


def to_numpy(a):
    """A NumPy copy of a NumPy or CuPy array."""
    return a.get() if hasattr(a, "get") else np.array(a)


LOAD_PIECE = 1 << 24  # float32 values a piece of a load into an engine without master weights (64 MiB)
# the most bytes of logits held at once: more rows' logits are computed, scored and sent back through the heads a
# piece of rows at a time (Engine._head), so a large vocabulary's (N, K*V) logits never exist whole; the presets'
# training (base: 32 x 512 positions of 4 x 4,096 logits in bf16) stays one piece
LOGITS_BYTES = 512 << 20

# The activations the backward pass reads of a layer: qkv (after the rotary embedding), att and lse (attention's
# output and log-sum-exp), resid_mid (the stream between the sublayers), the normed inputs xn1, xn2 with rstd1,
# rstd2, gate_up and sw (SwiGLU's input and output). Recomputation (Engine.recompute) keeps some of them a layer
# each and computes the others again in the backward pass, into one buffer that every layer shares; the down
# product is never run again (its output is the stream, kept), only its adapter's low-rank product where that
# is not kept:
# - "layer": none kept; the layer's forward again from its input (the residual stream, always kept);
# - "products": the attention's output and log-sum-exp kept (att, lse: the attention itself is not run again);
#   the norms, the q|k|v product with the rotary embedding, the o product (resid_mid) and gate|up with SwiGLU
#   (and their adapters) computed again;
# - "mlp": the attention's results kept (qkv, att, lse, resid_mid: its products, the attention itself and its
#   adapters are the costly part); the two norms and the gate|up product with SwiGLU (and the gate and up
#   adapters) computed again;
# - "auto" (True, the bare --recompute): the first of "mlp", "products" where all the step's activations in that
#   mode fit the device's free memory less AUTO_RESERVE (what the step allocates beyond them: scratch,
#   transients), else "layer".
RECOMPUTE_MODES = ("layer", "products", "mlp")
RECOMPUTED = {"layer": ("resid_mid", "xn1", "xn2", "rstd1", "rstd2", "qkv", "att", "lse", "gate_up", "sw"),
              "products": ("resid_mid", "xn1", "xn2", "rstd1", "rstd2", "qkv", "gate_up", "sw"),
              "mlp": ("xn1", "xn2", "rstd1", "rstd2", "gate_up", "sw"), None: ()}
AUTO_RESERVE = 1 << 30


def activation_shapes(cfg, B, T, mode, act, stat, rows):
    """{name: (per_layer, shape, dtype)} of the activation buffers of a (B, T) step (Engine._activations):
    per_layer "kept" (one (shape) a layer), "recomputed" (one for every layer: mode's RECOMPUTED) or None (one
    buffer); act the activations' type, stat the statistics' (float32, never bf16); rows the logits' piece."""
    N, C, D = B * T, cfg.dim, cfg.head_dim
    H, G, F = cfg.n_heads, cfg.n_kv_heads, cfg.hidden
    per_layer = dict(resid_mid=((N, C), act), xn1=((N, C), act), xn2=((N, C), act), rstd1=((N,), stat),
                     rstd2=((N,), stat), qkv=((B, T, H + 2 * G, D), act), att=((B, T, H, D), act),
                     lse=((B, H, T), stat), gate_up=((N, 2 * F), act), sw=((N, F), act))
    shapes = {name: ("recomputed" if name in RECOMPUTED[mode] else "kept", shape, dtype)
              for name, (shape, dtype) in per_layer.items()}
    shapes["resid"] = (None, (cfg.n_layers + 1, N, C), act)  # the stream before each layer: always kept
    # the final norm, one piece of rows' logits of all K heads (scored before the next is computed), the losses
    shapes.update(hf=(None, (N, C), act), rstdf=(None, (N,), stat),
                  logits=(None, (rows, cfg.mtp_heads * cfg.vocab_size), act), losses=(None, (cfg.mtp_heads, N), stat))
    # the backward pass's scratch
    shapes.update({name: (None, shape, act) for name, shape in (
        ("dresid", (N, C)), ("dxn", (N, C)), ("dqkv", (B, T, H + 2 * G, D)), ("datt", (B, T, H, D)),
        ("dgate_up", (N, 2 * F)), ("dsw", (N, F)), ("dhf", (N, C)))})
    return shapes


def activation_bytes(cfg, B, T, mode, act, stat, rows):
    """The bytes of activation_shapes' buffers: what a (B, T) step holds besides weights, gradients and
    optimizer state (less a few transients); mode None or one of RECOMPUTE_MODES."""
    total = 0
    for per_layer, shape, dtype in activation_shapes(cfg, B, T, mode, act, stat, rows).values():
        total += math.prod(shape) * np.dtype(dtype).itemsize * (cfg.n_layers if per_layer == "kept" else 1)
    return total


class Engine:
    def __init__(self, cfg, layers, xp, dtype=np.float32, seed=0, training=True, zero=0):
        """layers: a Layers of cpu/layers.py or gpu/layers.py (with the engine's precision and batch invariance),
        over arrays of xp (NumPy or CuPy). training False: an engine for decoding and scoring only, which has no
        gradient buffer, no master weights where it computes on a copy (bf16: its weights are that copy alone,
        params None) and starts from zero weights (load_params gives it its own). zero 2 or 3: an engine for
        ZeRO-2/3's sharding (train/sharded.py), made without the whole buffers that the sharding keeps in
        shards (release_whole): it never holds them."""
        self.cfg, self.layers, self.xp, self.dtype = cfg, layers, xp, np.dtype(dtype)
        self.act = np.dtype(layers.activation_dtype(self.dtype))  # activations' element type
        if cfg.quant is not None and training:
            raise UserError(f"the model is quantized ({cfg.quant}): full training needs float weights")
        assert zero in (0, 2, 3) and (training or not zero)
        self.layout, total = param_layout(cfg, floats_only=True)
        self.zero = 0
        if zero:
            self.params = self.weights = self.grads = None
            self.release_whole(zero)
        else:
            if training:
                self.params = xp.asarray(init_params(cfg, seed, self.dtype))
            else:
                self.params = xp.zeros(total, self.dtype) if self.act == self.dtype else None
            self.weights = self.params if self.act == self.dtype else xp.zeros(total, dtype=self.act)
            self.grads = xp.zeros(total, dtype=self.dtype) if training else None
            self.p = self._fused_views(self.weights)
            self.g = self._fused_views(self.grads) if training else None
            self.sync_weights()
        cos, sin = rope_tables(cfg.head_dim, cfg.context, cfg.rope_theta, self.dtype, cfg.rope_scaling)
        self.cos, self.sin = xp.asarray(cos), xp.asarray(sin)
        self.zero_position = xp.zeros(1, dtype=np.int32)  # where training and full forwards start
        self._acts, self._acts_shape = None, None
        self.logits_bytes = LOGITS_BYTES  # the logits held at once (_logit_rows)
        # LoRA's adapters (model/lora.py: attach), read by the passes at their targets; None: none
        self.adapters = None
        # activations recomputed in the backward pass instead of kept (less memory; the same gradients bit for
        # bit): False (none), "layer", "mlp" or True / "auto" (RECOMPUTE_MODES: what each keeps)
        self.recompute = False
        self._gain_scratch = None  # a frozen norm gain's gradient lands here (the backward pass of a frozen base)
        self._last = None  # the last forward's (tokens, targets, B, T), for backward()
        self._decoder = None  # KV-cache decoding over this engine: decoding.decoder_of(eng) makes and keeps it
        # called during a step's final backward pass with the flat offset from which every gradient is final
        # (layers are done last to first): data parallelism reduces those while the pass goes on
        self.gradients_ready = None
        # ZeRO-2/3's sharding (the module's docstring): told of each unit before and after the passes use it
        self.sharding = None

    def release_whole(self, stage):
        """ZeRO-2/3 (train/sharded.py holds the shards): the whole gradients and master weights dropped, or never
        made; stage 2 keeps the whole compute weights (made, zeroed, where the engine has none: the sharding
        gathers them; in fp32 they are `params` too), stage 3 no whole weights at all (the sharding puts a
        unit's into `p` while the passes use it)."""
        total = param_layout(self.cfg, floats_only=True)[1]
        self.zero, self.grads, self.g = stage, None, {}
        if stage == 3:
            self.params = self.weights = None
            self.p = {}
            return
        if self.weights is None:
            self.weights = self.xp.zeros(total, dtype=self.act)
            self.p = self._fused_views(self.weights)
        self.params = self.weights if self.act == self.dtype else None

    def sync_weights(self):
        """Rewrite the compute copy of the weights (bf16) from the master weights after they changed outside
        the AdamW step (a load, a broadcast, ZeRO's all-gather); nothing to do where the two are one buffer."""
        if self.weights is not self.params and self.params is not None:
            self.layers.cast_params(self.weights, self.params)

    def pad_buffers(self, multiple, grads=None):
        """Move params and grads into buffers padded with zeros to a multiple of `multiple` elements
        (`params_padded`, `grads_padded`): ZeRO's reduce-scatter and all-gather split a buffer into equal shards
        (train/distributed.py). params and grads stay the exact-size views that everything else reads. grads,
        where given, is the padded gradient buffer to use (memory the other ranks can reach: the copy
        engines' reduction); else a new one."""
        total = self.params.size
        size = -(-total // multiple) * multiple
        same = self.weights is self.params
        for name in ("params", "grads"):
            if name == "grads" and grads is not None:
                padded = grads
                padded.fill(0)
            else:
                padded = self.xp.zeros(size, dtype=self.dtype)
            padded[:total] = getattr(self, name)
            setattr(self, name + "_padded", padded)
            setattr(self, name, padded[:total])
        if same:
            self.weights = self.params
        self.p, self.g = self._fused_views(self.weights), self._fused_views(self.grads)

    @property
    def precision(self):
        """"fp32", "tf32" or "bf16": the layers' (set when they were made)."""
        return self.layers.precision

    @property
    def batch_invariant(self):
        """Whether decoding's products of a few rows take the row-invariant kernels (else BLAS's: faster, but
        rounded by the row count); the layers' (set when they were made)."""
        return self.layers.batch_invariant

    def _fused_views(self, flat):
        """Named views plus the fused groups: layers.{i}.wqkv (and bqkv), layers.{i}.w_gate_up and heads."""
        return self.unit_views(flat, 0, param_layout(self.cfg, floats_only=True)[1])

    def units(self):
        """The units the passes go through one at a time, in the flat buffer's order: [(unit, start, end)],
        "embedding" (tok_emb), each layer i (an int), "head" (the final norm and the heads; a tied model's head
        0 is the embedding's tensor, which its head unit reads too)."""
        layout, total, n = self.layout, param_layout(self.cfg, floats_only=True)[1], self.cfg.n_layers
        starts = [0] + [layout[f"layers.{i}.attn_norm"][0] for i in range(n)] + [layout["final_norm"][0]]
        names = ["embedding", *range(n), "head"]
        return list(zip(names, starts, starts[1:] + [total]))

    def unit_views(self, flat, start, end):
        """Named views plus the fused groups (layers.{i}.wqkv and bqkv, layers.{i}.w_gate_up, heads) of the
        tensors that lie in [start, end) of the flat buffer, over `flat`, which holds those elements."""
        cfg, layout = self.cfg, self.layout
        inside = lambda name: name in layout and start <= layout[name][0] and \
            layout[name][0] + math.prod(layout[name][1]) <= end
        v = {name: flat[off - start:off - start + math.prod(shape)].reshape(shape)
             for name, (off, shape) in layout.items() if inside(name)}

        def span(first, last, rows=None):
            a = layout[first][0] - start
            b = layout[last][0] + math.prod(layout[last][1]) - start
            return flat[a:b] if rows is None else flat[a:b].reshape(rows, cfg.dim)

        hd = cfg.head_dim
        quantized = cfg.quant is not None  # the matrices come in load_params
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            if not inside(p + "attn_norm"):
                continue
            if not quantized:
                v[p + "wqkv"] = span(p + "wq", p + "wv", (cfg.n_heads + 2 * cfg.n_kv_heads) * hd)
            if cfg.qkv_bias:
                v[p + "bqkv"] = span(p + "bq", p + "bv")
            if not quantized:
                v[p + "w_gate_up"] = span(p + "w_gate", p + "w_up", 2 * cfg.hidden)
        if cfg.tied:  # head 0 is the embedding (and the only head): the same memory under the heads' names
            if "tok_emb" in v:
                v["heads.0"] = v["heads"] = v["tok_emb"]
        elif not quantized and inside("heads.0"):
            v["heads"] = span("heads.0", f"heads.{cfg.mtp_heads - 1}", cfg.mtp_heads * cfg.vocab_size)
        return v

    def gradient_offsets(self):
        """The offsets that gradients_ready is called with in a backward pass, in order: from each of them to
        the end of the flat buffer every gradient is final (the heads and final norm first, then each layer
        from the last, then the embedding; a tied head 0 is the embedding, final with it at 0)."""
        layers = [self.layout[f"layers.{i}.attn_norm"][0] for i in reversed(range(self.cfg.n_layers))]
        return [self.layout["final_norm"][0], *layers, 0]

    # -------------------------------------------------------------------------------- state in and out
    def load_params(self, flat, quantized=None):
        """The weights from a flat host array, copied straight into the engine's buffer (no second copy on the
        device); a quantized model's float tensors, and its {name: QuantizedTensor} in quantized."""
        if self.cfg.quant is not None:
            self._load_quantized(quantized)
        flat = np.ascontiguousarray(flat, dtype=self.dtype).reshape(-1)
        if self.params is None:  # the compute copy alone: converted a piece at a time, as sync_weights rounds
            for start in range(0, flat.size, LOAD_PIECE):
                piece = self.xp.asarray(flat[start:start + LOAD_PIECE])
                self.layers.cast_params(self.weights[start:start + piece.size], piece)
            return
        if self.xp is np:
            self.params[...] = flat
        else:
            self.params.set(flat)
        self.sync_weights()

    def _load_quantized(self, q):
        """The quantized matrices into `p`, fused as the float ones are (rows stacked), on the layers' device."""
        cfg, make = self.cfg, self.layers.quantized_matrix
        for i in range(cfg.n_layers):
            w = f"layers.{i}."
            self.p[w + "wqkv"] = make(concat_rows([q[w + "wq"], q[w + "wk"], q[w + "wv"]]))
            self.p[w + "w_gate_up"] = make(concat_rows([q[w + "w_gate"], q[w + "w_up"]]))
            self.p[w + "wo"], self.p[w + "w_down"] = make(q[w + "wo"]), make(q[w + "w_down"])
        if not cfg.tied:
            heads = make(concat_rows([q[f"heads.{k}"] for k in range(cfg.mtp_heads)]))
            self.p["heads"] = heads
            for k in range(cfg.mtp_heads):
                self.p[f"heads.{k}"] = heads.rows(k * cfg.vocab_size, (k + 1) * cfg.vocab_size)

    def params_numpy(self):
        if self.params is None:
            raise ValueError("an engine made with training=False keeps no float32 weights")
        return to_numpy(self.params).astype(np.float32)

    def device_memory(self):
        """Bytes the GPU engine holds in CuPy's memory pool (its high-water mark: the pool only grows); None on
        the CPU."""
        return None if self.xp is np else self.xp.get_default_memory_pool().total_bytes()

    def read_later(self, a):
        """A function that returns a's values as a NumPy array once the work queued so far has computed them,
        and does not make the host wait before it is called: on the GPU an asynchronous copy into pinned host
        memory after that work, waited for (its event alone) by the call; on the CPU a copy."""
        if self.xp is np:
            values = np.array(a)
            return lambda: values
        cupy = self.xp
        a = cupy.ascontiguousarray(a)
        host = np.frombuffer(cupy.cuda.alloc_pinned_memory(a.nbytes), a.dtype, a.size).reshape(a.shape)
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(host.ctypes.data, a.data.ptr, a.nbytes, cupy.cuda.runtime.memcpyDeviceToHost,
                                      stream.ptr)
        copied = cupy.cuda.Event(disable_timing=True)
        copied.record(stream)

        def read():
            copied.synchronize()
            return host.copy()
        return read

    # ------------------------------------------------------------------------------------ activations
    def _logit_rows(self, N):
        """The rows whose logits are computed at a time: all N where their logits (N, K*V) take at most
        logits_bytes, else N cut into equal pieces that do."""
        row = self.cfg.mtp_heads * self.cfg.vocab_size * self.act.itemsize
        return -(-N // max(1, -(-N * row // self.logits_bytes)))

    def _recompute_mode(self, B, T):
        """self.recompute as the mode the passes run: None or one of RECOMPUTE_MODES; "auto", True: "mlp", else
        "products", where its activations fit the device's free memory less AUTO_RESERVE, else "layer"."""
        mode = self.recompute
        if mode is True or mode == "auto":
            free = memory.free_bytes(self.xp is not np)
            for kept in ("mlp", "products"):
                need = activation_bytes(self.cfg, B, T, kept, self.act, self.dtype, self._logit_rows(B * T))
                if need + AUTO_RESERVE <= free:
                    return kept
            return "layer"
        if mode not in (False, None) + RECOMPUTE_MODES:
            raise ValueError(f"recompute {mode!r}: False, True, 'auto' or one of {RECOMPUTE_MODES}")
        return mode or None

    def _activations(self, B, T):
        """Buffers for everything the backward pass reads, allocated once per (B, T) and recompute setting. A
        kind recomputed in the backward pass is one buffer shared by every layer (a list of n_layers times the
        same array), so the passes index every kind by layer alike; acts['recompute'] is the mode they run."""
        N = B * T
        rows = self._logit_rows(N)
        if self._acts_shape == (B, T, self.recompute, rows):
            return self._acts
        self._acts = None  # the old buffers freed before the new ones are made
        mode = self._recompute_mode(B, T)
        xp, n_layers = self.xp, self.cfg.n_layers
        acts = {}
        for name, (per_layer, shape, dtype) in activation_shapes(self.cfg, B, T, mode, self.act, self.dtype,
                                                                 rows).items():
            if per_layer == "kept":
                acts[name] = xp.empty((n_layers,) + shape, dtype=dtype)
            elif per_layer == "recomputed":
                acts[name] = [xp.empty(shape, dtype=dtype)] * n_layers
            else:
                acts[name] = xp.empty(shape, dtype=dtype)
        acts["recompute"] = mode
        self._acts, self._acts_shape = acts, (B, T, self.recompute, rows)
        return acts

    # ---------------------------------------------------------------------------------------- forward
    def forward_layers(self, tokens, acts, B, T, cache=None):
        """tokens (B, T) -> acts['hf'] (N, C), the final-normed hidden state; fills every activation. With a KV
        cache (decoding), the tokens sit at the cache's position and attend to the cache too.

        The residual stream: training keeps one buffer per sublayer (the backward pass reads them all), so
        each norm copies its input into the next buffer (`skip`) and the sublayer's matmul adds its output
        there. Decoding's activations (acts['in_place']: decoding.py) are one buffer per kind for all layers,
        and the stream is updated in place: no copy; decoding stops before the final norm (acts['resid'][-1] is
        the stream), which its head's product folds in."""
        cfg, layers, p = self.cfg, self.layers, self.p
        N = B * T
        in_place = acts.get("in_place", False)
        self._gather("embedding")
        layers.embedding_forward(acts["resid"][0], tokens.reshape(N), p["tok_emb"])
        self._release("embedding")
        low_rank = self._low_rank(N, acts)
        for i in range(cfg.n_layers):
            slot = 0 if in_place else i  # decoding's buffers are one set for every layer
            self._gather(i)
            self._layer_forward(i, slot, acts, B, T, cache, None if low_rank is None else low_rank[slot])
            self._release(i)
        if not in_place:  # decoding's head product folds the final norm in (decoding.py)
            self._gather("head")  # released by the caller after the heads' product
            layers.rmsnorm_forward(acts["hf"], acts["rstdf"], acts["resid"][cfg.n_layers], p["final_norm"],
                                   cfg.norm_eps)

    def _gather(self, unit):
        if self.sharding is not None:
            self.sharding.gather(unit)

    def _release(self, unit):
        if self.sharding is not None:
            self.sharding.release(unit)

    def _low_rank(self, N, acts):
        """The adapters' kept low-rank products, (targets, N, r) a layer (one slot for every layer where the
        layers are recomputed whole, and for decoding; a slot a layer otherwise: the attention's adapters are not
        recomputed in "mlp" mode), or None without adapters."""
        ad = self.adapters
        if ad is None or not ad.enabled:
            return None
        if acts.get("in_place", False) or acts.get("recompute") == "layer":
            return [ad.low_rank(1, N)[0]] * self.cfg.n_layers
        return ad.low_rank(self.cfg.n_layers, N)

    def _layer_forward(self, i, j, acts, B, T, cache, low_rank, recompute=None):
        """Layer i from acts['resid'][i] to acts['resid'][i + 1], its activations into slot j of the per-layer
        buffers (i; 0 in decoding's single set; a recomputed kind's one buffer is every layer's slot); low_rank:
        the adapters' slot (targets, N, r), or None without adapters. Where an adapter changes a fused product
        (q|k|v, gate|up), the product is computed plain, the update added, then the bias, rotary embedding or
        SwiGLU that follows. recompute "layer" or "products": the backward pass's recomputation (_recompute_layer),
        which leaves resid[i + 1] as the forward pass made it (no down product: only its adapter's x A^T) and with
        "products" the attention's output and log-sum-exp too (no attention), and the adapters' x A^T, kept a
        layer each (_low_rank): their updates alone are added again."""
        cfg, layers, p = self.cfg, self.layers, self.p
        H, G, D, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden
        N = B * T
        in_place = acts.get("in_place", False)
        ad = self.adapters if low_rank is not None else None
        kept = recompute == "products"  # the adapters' x A^T kept a layer each (_low_rank): not computed again
        w = f"layers.{i}."
        resid, resid_mid = acts["resid"][i], acts["resid_mid"][j]
        qkv, att = acts["qkv"][j], acts["att"][j]
        # attention block: (N, C) -> qkv (B, T, H+2G, D) -> att (B, T, H, D) -> (N, C)
        skip = None if in_place else resid_mid
        resid_next = acts["resid"][i + 1]
        position = self.zero_position if cache is None else cache.position
        if ad is not None and ad.targets("q", "k", "v"):
            xn, rows = acts["xn1"][j], qkv.reshape(N, -1)
            xn = ad.normed_input(N) if xn is None else xn
            layers.rmsnorm_matmul_forward(rows, acts["rstd1"][j], resid, p[w + "attn_norm"], p[w + "wqkv"],
                                          cfg.norm_eps, xn, skip)
            cols = (slice(0, H * D), slice(H * D, (H + G) * D), slice((H + G) * D, (H + 2 * G) * D))
            ad.forward_group(i, ("q", "k", "v"), low_rank, [rows[:, c] for c in cols], xn, cache is None, kept)
            if cfg.qkv_bias:
                layers.bias_add(rows, p[w + "bqkv"])
            layers.rope_forward(qkv, self.cos, self.sin, H + G, position)
        else:
            layers.rmsnorm_matmul_rope_forward(qkv, acts["rstd1"][j], resid, p[w + "attn_norm"], p[w + "wqkv"],
                                               cfg.norm_eps, acts["xn1"][j], self.cos, self.sin, H + G, position,
                                               skip, p.get(w + "bqkv"))
        if cache is None:
            if recompute != "products":
                layers.attention_forward(att, acts["lse"][j], qkv, H, G)
        else:  # k and v into the cache, attention over it
            layers.attention_cached(att, acts["lse"][j], qkv, cache.kv[i], H, G, cache.position, cache.slots)
        layers.matmul_forward(resid_mid, att.reshape(N, -1), p[w + "wo"], accumulate=True)
        if ad is not None:
            ad.forward(i, "o", low_rank, resid_mid, att.reshape(N, -1), cache is None, kept)
        # feed-forward block: (N, C) -> gate|up (N, 2F) -> (N, F) -> (N, C)
        self._swiglu_forward(i, j, acts, N, None if in_place or recompute else resid_next, low_rank, cache is None,
                             kept)
        if not recompute:
            layers.matmul_forward(resid_next, acts["sw"][j], p[w + "w_down"], accumulate=True)
        if ad is not None:  # recomputing: its x A^T alone where low_rank's slot is every layer's, else nothing
            ad.forward(i, "down", low_rank, None if recompute else resid_next, acts["sw"][j], cache is None, kept)

    def _swiglu_forward(self, i, j, acts, N, skip, low_rank, dropout=True, kept=False):
        """Layer i's feed-forward block up to its SwiGLU output: rmsnorm(resid_mid) into xn2 and rstd2, the
        gate|up product (with the gate and up adapters' updates where low_rank is given) into gate_up, SwiGLU
        into sw, slot j; skip as rmsnorm_matmul_forward (None: the residual stream is not copied, as in
        the backward pass's recomputation); kept: low_rank holds the adapters' x A^T already (Adapters.forward)."""
        cfg, layers, p = self.cfg, self.layers, self.p
        w, F, resid_mid = f"layers.{i}.", cfg.hidden, acts["resid_mid"][j]
        ad = self.adapters if low_rank is not None else None
        if ad is not None and ad.targets("gate", "up"):
            xn, gate_up = acts["xn2"][j], acts["gate_up"][j]
            xn = ad.normed_input(N) if xn is None else xn
            layers.rmsnorm_matmul_forward(gate_up, acts["rstd2"][j], resid_mid, p[w + "ffn_norm"],
                                          p[w + "w_gate_up"], cfg.norm_eps, xn, skip)
            ad.forward_group(i, ("gate", "up"), low_rank, [gate_up[:, :F], gate_up[:, F:]], xn, dropout, kept)
            layers.swiglu_forward(acts["sw"][j], gate_up)
        else:
            layers.rmsnorm_matmul_swiglu_forward(acts["sw"][j], acts["gate_up"][j], acts["rstd2"][j], resid_mid,
                                                 p[w + "ffn_norm"], p[w + "w_gate_up"], cfg.norm_eps,
                                                 acts["xn2"][j], skip)

    def _recompute_layer(self, i, acts, B, T, low_rank):
        """Layer i's activations that acts['recompute'] left out, again from what the forward pass kept, into
        the shared buffers: "layer", the layer from its input resid[i] up to the down product (its output,
        resid[i + 1], is kept); "products", the same but the attention (its output and log-sum-exp kept a layer
        each); "mlp", the attention's normed input (xn1, rstd1) and the feed-forward block up to SwiGLU from
        resid_mid[i] (the attention's results, qkv after the rotary embedding, att, lse and resid_mid, kept a
        layer each). The same kernels on the same inputs and dropout masks: the same bits as the forward pass's."""
        if acts["recompute"] in ("layer", "products"):
            self._layer_forward(i, i, acts, B, T, None, low_rank, acts["recompute"])
        elif acts["recompute"] == "mlp":
            cfg = self.cfg
            self.layers.rmsnorm_forward(acts["xn1"][i], acts["rstd1"][i], acts["resid"][i],
                                        self.p[f"layers.{i}.attn_norm"], cfg.norm_eps)
            self._swiglu_forward(i, i, acts, B * T, None, low_rank, kept=True)  # x A^T kept a layer each

    def _tokens(self, inputs):
        """inputs as a (B, T) int32 array of the engine's library; refuses what does not fit the context (the
        RoPE tables and the kernels stop there)."""
        inputs = np.asarray(inputs)
        if inputs.ndim != 2 or not 1 <= inputs.shape[1] <= self.cfg.context:
            raise ValueError(f"inputs of shape {inputs.shape} do not fit the model: (batch, 1..{self.cfg.context})")
        return self.xp.asarray(inputs.astype(np.int32, copy=False))

    def _run_to_head(self, inputs, targets):
        """The forward pass of inputs (B, T) up to the final norm's output acts['hf'] (N, C), the head's unit
        still gathered (the caller releases it); targets (K, B, T) are kept on the device for the cross-entropy.
        Returns the activations."""
        inputs = self._tokens(inputs)
        B, T = inputs.shape
        targets = np.asarray(targets, dtype=np.int32)
        if targets.shape != (self.cfg.mtp_heads, B, T):
            raise ValueError(f"targets {targets.shape} do not match inputs {inputs.shape} and K heads")
        acts = self._activations(B, T)
        self.forward_layers(inputs, acts, B, T)
        self._last = (inputs, self.xp.asarray(targets).reshape(self.cfg.mtp_heads, -1), B, T)
        return acts

    def _head(self, acts, dscale=None, dheads=None, computed=False):
        """The heads on acts['hf'] (N, C) a piece of rows at a time (acts['logits'] holds a piece's: _logit_rows):
        the piece's logits (rows, K*V) in one matmul (computed: already there, forward()'s, where one piece is
        all N), their cross-entropy into acts['losses'] (K, N), and with dscale (K, N) d loss / d logits in their
        place and the heads' backward product: acts['dhf'] and the heads' gradient added to dheads (None: a
        frozen head). The pieces follow from the shapes alone, so every pass (--recompute's too) cuts them alike."""
        layers, xp, K = self.layers, self.xp, self.cfg.mtp_heads
        targets, N, rows = self._last[1], acts["hf"].shape[0], acts["logits"].shape[0]
        for start in range(0, N, rows):
            stop = min(N, start + rows)
            hf, logits = acts["hf"][start:stop], acts["logits"][:stop - start]
            if not computed:
                layers.matmul_forward(logits, hf, self.p["heads"])
            piece = lambda a: xp.ascontiguousarray(a[:, start:stop])  # (K, rows) of a (K, N)
            losses = acts["losses"] if rows == N else xp.empty((K, stop - start), dtype=self.dtype)
            if dscale is None:
                layers.crossentropy_forward(losses, logits, piece(targets))
            else:
                layers.crossentropy_forward_backward(losses, logits, piece(targets), piece(dscale))
                layers.matmul_backward(acts["dhf"][start:stop], dheads, logits, hf, self.p["heads"])
            if rows < N:
                acts["losses"][:, start:stop] = losses

    def _weights(self, weights):
        """A gradient weight per (head, position), (K, N) float32 on the device, from anything that broadcasts
        to that shape (e.g. (K, 1): one weight a head); a device array of the engine's library is broadcast
        there, so the host need not wait for it."""
        K, N = self.cfg.mtp_heads, self._last[1].shape[1]
        if isinstance(weights, self.xp.ndarray) and self.xp is not np:
            return self.xp.ascontiguousarray(self.xp.broadcast_to(weights.astype(self.dtype, copy=False), (K, N)))
        return self.xp.asarray(np.ascontiguousarray(np.broadcast_to(np.asarray(weights, dtype=self.dtype), (K, N))))

    def forward(self, inputs, targets):
        """Each head's cross-entropy at every position, losses (K, B*T) on the device (0 where the target is
        -1), without gradients; the activations stay for backward()."""
        acts = self._run_to_head(inputs, targets)
        self._head(acts)
        self._release("head")
        return acts["losses"]

    def backward(self, weights, accumulate=False, final=True):
        """After forward(): the gradient of sum over (k, n) of weights[k, n] * loss[k, n] into self.grads (or
        added to them with accumulate). final: the last pass of the optimizer step (gradients_ready is called).
        Where the logits came in pieces, the backward pass computes them again (one more product of the heads)."""
        inputs, targets, B, T = self._last
        acts = self._acts
        kept = acts["logits"].shape[0] == B * T  # forward()'s logits of every row, still there
        self._backward(inputs, acts, B, T, self._weights(weights), accumulate, final, kept)

    def forward_backward(self, inputs, targets, weights, accumulate=False, final=True):
        """forward() and backward(weights) in one: the cross-entropy's forward and gradient are one pass.
        Returns the losses (K, B*T) on the device; read them after the call, so the device runs the backward
        pass before the host waits for them. The logits are computed in the backward pass (_head), a piece at a
        time: each piece's gradient goes back through the heads before the next piece's logits are made."""
        acts = self._run_to_head(inputs, targets)
        self._release("head")  # gathered again by the backward pass, which computes the heads
        inputs, targets, B, T = self._last
        self._backward(inputs, acts, B, T, self._weights(weights), accumulate, final)
        return acts["losses"]

    def logits(self, inputs):
        """Head-0 logits (B, T, V) of a full forward pass, as float32 NumPy."""
        inputs = self._tokens(inputs)
        B, T = inputs.shape
        acts = self._activations(B, T)
        self.forward_layers(inputs, acts, B, T)
        N, V, rows = B * T, self.cfg.vocab_size, acts["logits"].shape[0]
        out = np.empty((N, V), dtype=np.float32)
        for start in range(0, N, rows):  # a piece of rows at a time (_logit_rows)
            stop = min(N, start + rows)
            logits = acts["logits"][:stop - start]
            self.layers.matmul_forward(logits, acts["hf"][start:stop], self.p["heads"])
            out[start:stop] = to_numpy(to_float32(logits[:, :V]))
        self._release("head")
        return out.reshape(B, T, V)

    # --------------------------------------------------------------------------------------- backward
    def _backward(self, inputs, acts, B, T, dscale, accumulate, final=True, computed=False):
        """From the gradient weights dscale (K, N) of the losses, through the heads (_head: their logits again,
        or computed: forward()'s, all N rows', still in acts['logits']), to every parameter's gradient (into
        self.grads, or added). An engine without gradients (training=False) with adapters on has a frozen base:
        only the adapters' gradients are computed (into adapters.grads), and of the base's products only the
        input gradients."""
        ad = self.adapters if self.adapters is not None and self.adapters.enabled else None
        sharded = self.sharding
        frozen = self.grads is None and sharded is None
        if frozen and ad is None:
            raise ValueError("an engine made with training=False has no gradients")
        cfg, layers, p = self.cfg, self.layers, self.p
        layout = self.layout
        if frozen:  # no weight gradients; a norm gain's is summed into a scratch vector and never read
            if self._gain_scratch is None:
                self._gain_scratch = self.xp.zeros(cfg.dim, dtype=self.dtype)
            gw = gb = lambda name: None
            gn = lambda name: self._gain_scratch
        else:
            gw = gn = self.g.__getitem__
            gb = self.g.get
        ready = self.gradients_ready if final and not frozen else None
        N, H, G, D, F = B * T, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden
        if not accumulate:
            if self.grads is not None:
                self.grads.fill(0)
            if ad is not None:
                ad.grads.fill(0)
        low_rank = self._low_rank(N, acts)
        dresid, dxn = acts["dresid"], acts["dxn"]
        # heads and final norm: dhf = dlogits @ heads, dheads += dlogits.T @ hf (tied: into tok_emb's gradient,
        # which the embedding's scatter-add below adds to)
        if sharded:
            sharded.gather("head", backward=True)
            sharded.open_grads("head")
        self._head(acts, dscale, gw("heads"), computed)
        dresid.fill(0)
        layers.rmsnorm_backward(dresid, gn("final_norm"), acts["dhf"], acts["resid"][cfg.n_layers],
                                p["final_norm"], acts["rstdf"])
        if sharded:
            sharded.release("head")
            sharded.reduce("head", accumulate)
        if ready:
            ready(layout["final_norm"][0])
        for i in reversed(range(cfg.n_layers)):
            w = f"layers.{i}."
            lr = None if low_rank is None else low_rank[i]  # one slot for every layer where they are recomputed whole (_low_rank)
            if sharded:
                sharded.gather(i, backward=True)
                sharded.open_grads(i)
            self._recompute_layer(i, acts, B, T, lr)  # what the forward pass did not keep (none without recompute)
            # feed-forward block; dresid is d(resid[i+1]) and, through the skip, d(resid_mid)
            layers.matmul_backward(acts["dsw"], gw(w + "w_down"), dresid, acts["sw"][i], p[w + "w_down"])
            if ad is not None:
                ad.backward(i, "down", lr, acts["dsw"], dresid, acts["sw"][i])
            layers.swiglu_backward(acts["dgate_up"], acts["dsw"], acts["gate_up"][i])
            layers.matmul_backward(dxn, gw(w + "w_gate_up"), acts["dgate_up"], acts["xn2"][i], p[w + "w_gate_up"])
            if ad is not None:
                ad.backward_group(i, ("gate", "up"), lr, dxn, [acts["dgate_up"][:, :F], acts["dgate_up"][:, F:]],
                                  acts["xn2"][i])
            layers.rmsnorm_backward(dresid, gn(w + "ffn_norm"), dxn, acts["resid_mid"][i], p[w + "ffn_norm"],
                                    acts["rstd2"][i])
            # attention block; dresid is now d(resid_mid) and, through the skip, d(resid[i])
            datt, att = acts["datt"].reshape(N, -1), acts["att"][i].reshape(N, -1)
            layers.matmul_backward(datt, gw(w + "wo"), dresid, att, p[w + "wo"])
            if ad is not None:
                ad.backward(i, "o", lr, datt, dresid, att)
            layers.attention_backward(acts["dqkv"], acts["datt"], acts["att"][i], acts["lse"][i], acts["qkv"][i],
                                      H, G, self.cos, self.sin)  # through the rotary embedding too
            dqkv = acts["dqkv"].reshape(N, -1)
            layers.matmul_backward(dxn, gw(w + "wqkv"), dqkv, acts["xn1"][i], p[w + "wqkv"], gb(w + "bqkv"))
            if ad is not None:
                cols = (slice(0, H * D), slice(H * D, (H + G) * D), slice((H + G) * D, (H + 2 * G) * D))
                ad.backward_group(i, ("q", "k", "v"), lr, dxn, [dqkv[:, c] for c in cols], acts["xn1"][i])
            if frozen and i == 0:
                break  # the frozen embedding wants no gradient: the stream's below the first layer is unused
            layers.rmsnorm_backward(dresid, gn(w + "attn_norm"), dxn, acts["resid"][i], p[w + "attn_norm"],
                                    acts["rstd1"][i])
            if sharded:
                sharded.release(i)
                sharded.reduce(i, accumulate)
            if ready:
                ready(layout[w + "attn_norm"][0])
        if ad is not None:
            ad.dropout_key += 1  # the next pass (a micro-batch) draws new masks; this one's forward and backward shared one
        if frozen:
            if final and ad.gradients_ready:
                ad.gradients_ready(0)
            return
        if sharded:
            sharded.open_grads("embedding")
        layers.embedding_backward(gw("tok_emb"), dresid, inputs.reshape(N))
        if sharded:
            sharded.reduce("embedding", accumulate)
        if ready:
            ready(0)


def make_engine(cfg, device="cpu", dtype=np.float32, seed=0, precision=None, batch_invariant=True, training=True,
                zero=0, ranks=1):
    """An Engine on the CPU (numba) or the GPU (CUDA kernels; needs CUDA and cupy). precision: "fp32" (the
    CPU's only one), "tf32" or "bf16" (the GPU's default); None takes the device's default. batch_invariant
    False: decoding's products of a few rows take BLAS / cuBLAS, so a sequence's tokens may change with what
    else is in its batch (the GPU's batched decoding is faster so: docs/decoding.md). training False: no
    gradient buffer (decoding, scoring). zero 2 or 3: an engine for ZeRO-2/3 over `ranks` ranks, without its
    whole buffers (Engine). A model whose buffers cannot fit the device's free memory is refused in one line
    that names both (model/memory.py); with zero, its share: a rank's shards, and in ZeRO-2 the whole compute
    weights."""
    if device not in DEFAULT_PRECISION:
        raise ValueError(f"unknown device {device!r}")
    precision = device_precision(device, precision)
    if device == "cpu":
        from nanoeuler.model.cpu.layers import Layers
        layers, xp = Layers(precision, batch_invariant), np
    elif device == "gpu":
        from nanoeuler.model.gpu import check_config
        try:
            check_config(cfg)
        except ValueError as e:
            raise UserError(str(e)) from None
        import cupy
        from nanoeuler.model.gpu.layers import Layers
        layers, xp = Layers(precision, batch_invariant), cupy
    else:
        raise ValueError(f"unknown device {device!r}")
    _check_fits(cfg, device, np.dtype(dtype), np.dtype(layers.activation_dtype(np.dtype(dtype))), training, zero,
                ranks)
    return Engine(cfg, layers, xp, dtype, seed, training, zero)


def _check_fits(cfg, device, dtype, act, training, zero=0, ranks=1):
    """UserError where the engine's parameter buffers alone (with zero: a rank's share of them) exceed the
    device's free memory."""
    n_params = param_layout(cfg)[1]
    floats = param_layout(cfg, floats_only=True)[1]
    if zero:
        need = memory.sharded_bytes(floats, ranks, zero, dtype.itemsize, act.itemsize)
    else:
        need = memory.parameter_bytes(floats, dtype.itemsize, act.itemsize, training)
    need += quantized_bytes(cfg)
    free = memory.free_bytes(device == "gpu")
    if need > free:
        compute = "bf16" if act == np.uint16 else act.name  # bf16 is stored as 16-bit words
        if zero:
            what = (f"ZeRO-{zero} share over {ranks} ranks (a shard of the weights, gradients and AdamW moments"
                    + (f", and the whole {compute} weights" if zero == 2 else "") + ")")
        elif act == dtype:
            what = f"{dtype.name} weights" + (" and gradients" if training else "")
        elif training:
            what = f"{dtype.name} weights, their {compute} copy and gradients"
        else:
            what = f"{compute} weights"
        raise UserError(f"the model ({n_params / 1e9:,.2f}B parameters) needs {memory.size_text(need)} for its {what} "
                        f"on the {device.upper()}, which has {memory.size_text(free)} free"
                        + ("; a smaller model, or the GPU" if device == "cpu" else "; a smaller model")
                        + (", or more ranks" if zero else ""))


def quantized_bytes(cfg):
    """The bytes of a quantized model's quantized tensors, each in its own type (an int4 model's int8 heads: 8.5
    bits a weight); 0 where cfg.quant is unset."""
    layout = param_layout(cfg)[0]
    return sum(int(np.prod(shape)) * dtype.itemsize
               for name in quantized_names(cfg)
               for dtype, shape in stored_arrays(layout[name][1], *quant_format(cfg, name)).values())
