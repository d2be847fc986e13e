"""The model, composed once for both engines.

`Engine` runs the forward pass and the hand-written backward pass by calling a *layer module*
(`nanoeuler.model.cpu.layers`, numba; or `nanoeuler.model.gpu.layers`, CUDA kernels + cuBLAS) that has the
same functions with the same signatures, over arrays of that module's array library (NumPy or CuPy). So the
CPU and GPU engines differ only in their layers, and everything above them (objectives, the optimizer,
decoding, training, checkpoints) is written once against this class.

    from nanoeuler.model.engine import make_engine
    eng = make_engine(cfg, device="cpu")          # float32; dtype=np.float64 for the gradient check
    losses = eng.forward_backward(inputs, targets, weights)   # (K, N) per position; gradients in eng.grads

The engine knows no objective: it computes each head's cross-entropy at every position, and its backward
pass takes a gradient weight per (head, position), d objective / d loss[k, n]. The mean cross-entropy of
pretraining and SFT and the DPO loss are such weights (train/objectives.py). Decoding with a KV cache is
`decoding.decoder_of(eng)` (decoding.py); the AdamW step is optimizer.py.

Parameters and gradients are each one flat buffer (layout: config.param_layout). Because wq|wk|wv,
w_gate|w_up and heads.0..K-1 sit next to each other in that buffer, each group is one fused matrix here: one
matmul instead of three, two or K.

Mixed precision (the GPU's "bf16"): the flat buffers above stay float32 (the master weights, what
checkpoints hold), and the layers read `weights`, a bf16 copy that AdamW rewrites in its pass; activations
are bf16, parameter gradients float32. Elsewhere `weights` is `params` itself.
"""
import contextlib
import math

import numpy as np

from nanoeuler.errors import UserError
from nanoeuler.model.config import init_params, param_layout, rope_tables, views


def to_float32(a):
    """a as float32 (bf16 activations are uint16: the top half of a float32's bits)."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


def to_numpy(a):
    """A NumPy copy of a NumPy or CuPy array."""
    return a.get() if hasattr(a, "get") else np.array(a)


class Engine:
    def __init__(self, cfg, layers, xp, dtype=np.float32, seed=0, precision="fp32", batch_invariant=True):
        self.cfg, self.layers, self.xp, self.dtype = cfg, layers, xp, np.dtype(dtype)
        self.precision = precision
        # decoding's products of a few rows: the row-invariant kernels, or BLAS's (faster, by the row count)
        self.batch_invariant = batch_invariant
        self.act = np.dtype(layers.activation_dtype(precision, self.dtype))  # activations' element type
        self.layout, total = param_layout(cfg)
        self.params = xp.asarray(init_params(cfg, seed, self.dtype))
        self.weights = self.params if self.act == self.dtype else xp.empty(total, dtype=self.act)
        self.grads = xp.zeros(total, dtype=self.dtype)
        self.p, self.g = self._fused_views(self.weights), self._fused_views(self.grads)
        self.sync_weights()
        cos, sin = rope_tables(cfg.head_dim, cfg.context, cfg.rope_theta, self.dtype)
        self.cos, self.sin = xp.asarray(cos), xp.asarray(sin)
        self.zero_position = xp.zeros(1, dtype=np.int32)  # where training and full forwards start
        self._acts, self._acts_shape = None, None
        self._last = None  # the last forward's (tokens, targets, B, T), for backward()
        self._decoder = None  # KV-cache decoding over this engine: decoding.decoder_of(eng) makes and keeps it
        # called during a step's final backward pass with the flat offset from which every gradient is final
        # (layers are done last to first): data parallelism reduces those while the pass goes on
        self.gradients_ready = None

    def sync_weights(self):
        """Rewrite the compute copy of the weights (bf16) from the master weights after they changed outside
        the AdamW step (a load, a broadcast, ZeRO's all-gather); nothing to do where the two are one buffer."""
        if self.weights is not self.params:
            self.layers.cast_params(self.weights, self.params)

    def pad_buffers(self, multiple):
        """Move params and grads into buffers padded with zeros to a multiple of `multiple` elements
        (`params_padded`, `grads_padded`): ZeRO's reduce-scatter and all-gather split a buffer into equal shards
        (train/distributed.py). params and grads stay the exact-size views that everything else reads."""
        total = self.params.size
        size = -(-total // multiple) * multiple
        same = self.weights is self.params
        for name in ("params", "grads"):
            padded = self.xp.zeros(size, dtype=self.dtype)
            padded[:total] = getattr(self, name)
            setattr(self, name + "_padded", padded)
            setattr(self, name, padded[:total])
        if same:
            self.weights = self.params
        self.p, self.g = self._fused_views(self.weights), self._fused_views(self.grads)

    @contextlib.contextmanager
    def mode(self):
        """The layer module's precision (the GPU's tf32 / fp32 switch; nothing on the CPU) and its products of a
        few rows (batch-invariant or BLAS's) for the block."""
        with self.layers.precision(self.precision), self.layers.batch_invariant(self.batch_invariant):
            yield

    def _fused_views(self, flat):
        """Named views plus the fused groups: layers.{i}.wqkv, layers.{i}.w_gate_up and heads."""
        cfg, v = self.cfg, views(flat, self.cfg)
        layout, _ = param_layout(cfg)

        def span(first, last, rows):
            start = layout[first][0]
            end = layout[last][0] + math.prod(layout[last][1])
            return flat[start:end].reshape(rows, cfg.dim)

        hd = cfg.head_dim
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            v[p + "wqkv"] = span(p + "wq", p + "wv", (cfg.n_heads + 2 * cfg.n_kv_heads) * hd)
            v[p + "w_gate_up"] = span(p + "w_gate", p + "w_up", 2 * cfg.hidden)
        v["heads"] = span("heads.0", f"heads.{cfg.mtp_heads - 1}", cfg.mtp_heads * cfg.vocab_size)
        return v

    def gradient_offsets(self):
        """The offsets that gradients_ready is called with in a backward pass, in order: from each of them to
        the end of the flat buffer every gradient is final (the heads and final norm first, then each layer
        from the last, then the embedding)."""
        layers = [self.layout[f"layers.{i}.attn_norm"][0] for i in reversed(range(self.cfg.n_layers))]
        return [self.layout["final_norm"][0], *layers, 0]

    # -------------------------------------------------------------------------------- state in and out
    def load_params(self, flat):
        self.params[...] = self.xp.asarray(np.asarray(flat, dtype=self.dtype))
        self.sync_weights()

    def params_numpy(self):
        return to_numpy(self.params).astype(np.float32)

    def device_memory(self):
        """Bytes the GPU engine holds in CuPy's memory pool (its high-water mark: the pool only grows); None on
        the CPU."""
        return None if self.xp is np else self.xp.get_default_memory_pool().total_bytes()

    # ------------------------------------------------------------------------------------ activations
    def _activations(self, B, T):
        """Buffers for everything the backward pass reads, allocated once per (B, T)."""
        if self._acts_shape == (B, T):
            return self._acts
        cfg, xp = self.cfg, self.xp
        N, C, L, D = B * T, cfg.dim, cfg.n_layers, cfg.head_dim
        H, G, F, KV = cfg.n_heads, cfg.n_kv_heads, cfg.hidden, cfg.mtp_heads * cfg.vocab_size
        e = lambda *shape: xp.empty(shape, dtype=self.act)      # activations
        f = lambda *shape: xp.empty(shape, dtype=self.dtype)    # statistics and losses, never bf16
        # the SwiGLU output and the sublayers' normed inputs are kept, not recomputed (docs/gpu-engine.md)
        a = dict(
            resid=e(L + 1, N, C), resid_mid=e(L, N, C),          # residual stream before each sublayer
            xn1=e(L, N, C), xn2=e(L, N, C), rstd1=f(L, N), rstd2=f(L, N),
            qkv=e(L, B, T, H + 2 * G, D), att=e(L, B, T, H, D), lse=f(L, B, H, T),
            gate_up=e(L, N, 2 * F), sw=e(L, N, F),
            hf=e(N, C), rstdf=f(N), logits=e(N, KV), losses=f(cfg.mtp_heads, N),
            # backward scratch
            dresid=e(N, C), dxn=e(N, C), dqkv=e(B, T, H + 2 * G, D), datt=e(B, T, H, D),
            dgate_up=e(N, 2 * F), dsw=e(N, F), dhf=e(N, C),
        )
        self._acts, self._acts_shape = a, (B, T)
        return a

    # ---------------------------------------------------------------------------------------- forward
    def forward_layers(self, tokens, a, B, T, cache=None):
        """tokens (B, T) -> a['hf'] (N, C), the final-normed hidden state; fills every activation. With a KV
        cache (decoding), the tokens sit at the cache's position and attend to the cache too.

        The residual stream: training keeps one buffer per sublayer (the backward pass reads them all), so
        each norm copies its input into the next buffer (`skip`) and the sublayer's matmul adds its output
        there. Decoding's activations (a['in_place']: decoding.py) are one buffer per kind for all layers, and
        the stream is updated in place: no copy; decoding stops before the final norm (a['resid'][-1] is the
        stream), which its head's product folds in."""
        cfg, L, p = self.cfg, self.layers, self.p
        H, G = cfg.n_heads, cfg.n_kv_heads
        N = B * T
        in_place = a.get("in_place", False)
        L.embedding_forward(a["resid"][0], tokens.reshape(N), p["tok_emb"])
        for i in range(cfg.n_layers):
            w = f"layers.{i}."
            resid, resid_mid = a["resid"][i], a["resid_mid"][i]
            qkv, att = a["qkv"][i], a["att"][i]
            # attention block: (N, C) -> qkv (B, T, H+2G, D) -> att (B, T, H, D) -> (N, C)
            skip = None if in_place else resid_mid
            resid_next = a["resid"][i + 1]
            position = self.zero_position if cache is None else cache.position
            L.rmsnorm_matmul_rope_forward(qkv, a["rstd1"][i], resid, p[w + "attn_norm"], p[w + "wqkv"], cfg.norm_eps,
                                          a["xn1"][i], self.cos, self.sin, H + G, position, skip)
            if cache is None:
                L.attention_forward(att, a["lse"][i], qkv, H, G)
            else:  # k and v into the cache, attention over it
                L.attention_cached(att, a["lse"][i], qkv, cache.kv[i], H, G, cache.position, cache.slots)
            L.matmul_forward(resid_mid, att.reshape(N, -1), p[w + "wo"], accumulate=True)
            # feed-forward block: (N, C) -> gate|up (N, 2F) -> (N, F) -> (N, C)
            L.rmsnorm_matmul_swiglu_forward(a["sw"][i], a["gate_up"][i], a["rstd2"][i], resid_mid, p[w + "ffn_norm"],
                                            p[w + "w_gate_up"], cfg.norm_eps, a["xn2"][i],
                                            None if in_place else resid_next)
            L.matmul_forward(resid_next, a["sw"][i], p[w + "w_down"], accumulate=True)
        if not in_place:  # decoding's head product folds the final norm in (decoding.py)
            L.rmsnorm_forward(a["hf"], a["rstdf"], a["resid"][cfg.n_layers], p["final_norm"], cfg.norm_eps)

    def _tokens(self, inputs):
        """inputs as a (B, T) int32 array of the engine's library; refuses what does not fit the context (the
        RoPE tables and the kernels stop there)."""
        inputs = np.asarray(inputs)
        if inputs.ndim != 2 or not 1 <= inputs.shape[1] <= self.cfg.context:
            raise ValueError(f"inputs of shape {inputs.shape} do not fit the model: (batch, 1..{self.cfg.context})")
        return self.xp.asarray(inputs.astype(np.int32, copy=False))

    def _run_to_logits(self, inputs, targets):
        """The forward pass of inputs (B, T) up to all K heads' logits (N, K*V), one matmul; targets (K, B, T)
        are kept on the device for the cross-entropy. Returns the activations."""
        inputs = self._tokens(inputs)
        B, T = inputs.shape
        targets = np.asarray(targets, dtype=np.int32)
        if targets.shape != (self.cfg.mtp_heads, B, T):
            raise ValueError(f"targets {targets.shape} do not match inputs {inputs.shape} and K heads")
        a = self._activations(B, T)
        self.forward_layers(inputs, a, B, T)
        self.layers.matmul_forward(a["logits"], a["hf"], self.p["heads"])
        self._last = (inputs, self.xp.asarray(targets).reshape(self.cfg.mtp_heads, -1), B, T)
        return a

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
        with self.mode():
            a = self._run_to_logits(inputs, targets)
            self.layers.crossentropy_forward(a["losses"], a["logits"], self._last[1])
        return a["losses"]

    def backward(self, weights, accumulate=False, final=True):
        """After forward(): the gradient of sum over (k, n) of weights[k, n] * loss[k, n] into self.grads (or
        added to them with accumulate). final: the last pass of the optimizer step (gradients_ready is called)."""
        inputs, targets, B, T = self._last
        a = self._acts
        with self.mode():
            self.layers.crossentropy_forward_backward(a["losses"], a["logits"], targets, self._weights(weights))
            self._backward(inputs, a, B, T, accumulate, final)

    def forward_backward(self, inputs, targets, weights, accumulate=False, final=True):
        """forward() and backward(weights) in one: the cross-entropy's forward and gradient are one pass.
        Returns the losses (K, B*T) on the device; read them after the call, so the device runs the backward
        pass before the host waits for them."""
        with self.mode():
            a = self._run_to_logits(inputs, targets)
            inputs, targets, B, T = self._last
            self.layers.crossentropy_forward_backward(a["losses"], a["logits"], targets, self._weights(weights))
            self._backward(inputs, a, B, T, accumulate, final)
        return a["losses"]

    def logits(self, inputs):
        """Head-0 logits (B, T, V) of a full forward pass, as float32 NumPy."""
        inputs = self._tokens(inputs)
        B, T = inputs.shape
        a = self._activations(B, T)
        with self.mode():
            self.forward_layers(inputs, a, B, T)
            self.layers.matmul_forward(a["logits"], a["hf"], self.p["heads"])
        V = self.cfg.vocab_size
        return to_numpy(to_float32(a["logits"][:, :V])).reshape(B, T, V)

    # --------------------------------------------------------------------------------------- backward
    def _backward(self, inputs, a, B, T, accumulate, final=True):
        """From d loss / d logits in a['logits'] to every parameter's gradient (into self.grads, or added)."""
        cfg, L, p, g = self.cfg, self.layers, self.p, self.g
        layout = self.layout
        ready = self.gradients_ready if final else None
        N, H, G = B * T, cfg.n_heads, cfg.n_kv_heads
        if not accumulate:
            self.grads.fill(0)
        dresid, dxn = a["dresid"], a["dxn"]
        # heads and final norm: dhf = dlogits @ heads, dheads += dlogits.T @ hf
        L.matmul_backward(a["dhf"], g["heads"], a["logits"], a["hf"], p["heads"])
        dresid.fill(0)
        L.rmsnorm_backward(dresid, g["final_norm"], a["dhf"], a["resid"][cfg.n_layers], p["final_norm"],
                           a["rstdf"])
        if ready:
            ready(layout["final_norm"][0])
        for i in reversed(range(cfg.n_layers)):
            w = f"layers.{i}."
            # feed-forward block; dresid is d(resid[i+1]) and, through the skip, d(resid_mid)
            L.matmul_backward(a["dsw"], g[w + "w_down"], dresid, a["sw"][i], p[w + "w_down"])
            L.swiglu_backward(a["dgate_up"], a["dsw"], a["gate_up"][i])
            L.matmul_backward(dxn, g[w + "w_gate_up"], a["dgate_up"], a["xn2"][i], p[w + "w_gate_up"])
            L.rmsnorm_backward(dresid, g[w + "ffn_norm"], dxn, a["resid_mid"][i], p[w + "ffn_norm"],
                               a["rstd2"][i])
            # attention block; dresid is now d(resid_mid) and, through the skip, d(resid[i])
            L.matmul_backward(a["datt"].reshape(N, -1), g[w + "wo"], dresid, a["att"][i].reshape(N, -1),
                              p[w + "wo"])
            L.attention_backward(a["dqkv"], a["datt"], a["att"][i], a["lse"][i], a["qkv"][i], H, G, self.cos,
                                 self.sin)  # through the rotary embedding too
            L.matmul_backward(dxn, g[w + "wqkv"], a["dqkv"].reshape(N, -1), a["xn1"][i], p[w + "wqkv"])
            L.rmsnorm_backward(dresid, g[w + "attn_norm"], dxn, a["resid"][i], p[w + "attn_norm"],
                               a["rstd1"][i])
            if ready:
                ready(layout[w + "attn_norm"][0])
        L.embedding_backward(g["tok_emb"], dresid, inputs.reshape(N))
        if ready:
            ready(0)


DEFAULT_PRECISION = {"cpu": "fp32", "gpu": "bf16"}


def make_engine(cfg, device="cpu", dtype=np.float32, seed=0, precision=None, batch_invariant=True):
    """An Engine on the CPU (numba) or the GPU (CUDA kernels; needs CUDA and cupy). precision: "fp32" (the
    CPU's only one), "tf32" or "bf16" (the GPU's default); None takes the device's default. batch_invariant
    False: decoding's products of a few rows take BLAS / cuBLAS, so a sequence's tokens may change with what
    else is in its batch (the GPU's batched decoding is faster so: docs/decoding.md)."""
    precision = precision or DEFAULT_PRECISION[device]
    if device == "cpu":
        if precision != "fp32":
            raise UserError(f"--precision {precision}: the CPU engine computes in fp32 only")
        from nanoeuler.model.cpu import layers
        return Engine(cfg, layers, np, dtype, seed, precision, batch_invariant)
    if device == "gpu":
        from nanoeuler.model.gpu import check_config
        try:
            check_config(cfg)
        except ValueError as e:
            raise UserError(str(e)) from None
        import cupy
        from nanoeuler.model.gpu import layers
        return Engine(cfg, layers, cupy, dtype, seed, precision, batch_invariant)
    raise ValueError(f"unknown device {device!r}")
