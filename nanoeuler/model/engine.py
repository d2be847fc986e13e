"""The model, composed once for both engines.

`Engine` runs the forward pass, the hand-written backward pass, the AdamW step and KV-cache decoding by
calling a *layer module* (`nanoeuler.model.cpu.layers`, numba; or `nanoeuler.model.gpu.layers`, CUDA kernels + cuBLAS)
that has the same functions with the same signatures, over arrays of that module's array library
(NumPy or CuPy). So the CPU and GPU engines differ only in their layers, and everything above them
(training, sampling, checkpoints) is written once against this class.

    from nanoeuler.model.engine import make_engine
    eng = make_engine(cfg, device="cpu")          # float32; dtype=np.float64 for the gradient check
    loss, loss0 = eng.forward_backward(inputs, targets)
    eng.step(lr=1e-3, weight_decay=0.1, grad_clip=1.0)

Parameters, gradients and the two AdamW moments are each one flat buffer (layout: config.param_layout).
Because wq|wk|wv, w_gate|w_up and heads.0..K-1 sit next to each other in that buffer, each group is
one fused matrix here: one matmul instead of three, two or K.

Mixed precision (the GPU's "bf16"): the flat buffers above stay float32 (the master weights, what
checkpoints hold), and the layers read `weights`, a bf16 copy that AdamW rewrites in its pass; activations
are bf16, parameter gradients float32. Elsewhere `weights` is `params` itself.
"""
import math

import numpy as np

from nanoeuler.model.config import init_params, is_matrix, param_layout, rope_tables, views
from nanoeuler.errors import UserError


def to_float32(a):
    """a as float32 (bf16 activations are uint16: the top half of a float32's bits)."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


class KVCache:
    """Per-layer keys and values kv (L, B, context, 2G, D) of positions 0..pos-1: the G k heads (rotated), then
    the G v heads. The queries are not kept: nothing reads them again.

    The position lives twice: `pos` on the host, `position` (one int32) where the kernels read it, so that a
    decoding step recorded once as a CUDA graph serves every position. Setting pos (back) rolls the cache
    back: later positions are overwritten. `steps` keeps the buffers (and graphs) of the small decoding steps
    run on this cache, by shape."""

    def __init__(self, xp, cfg, batch, dtype):
        self.kv = xp.empty((cfg.n_layers, batch, cfg.context, 2 * cfg.n_kv_heads, cfg.head_dim), dtype=dtype)
        self.position = xp.zeros(1, dtype=np.int32)
        self._pos = 0
        self.steps = {}

    @property
    def pos(self):
        return self._pos

    @pos.setter
    def pos(self, value):
        self._pos = int(value)
        self.position[...] = self._pos


class Engine:
    def __init__(self, cfg, layers, xp, dtype=np.float32, seed=0, precision="fp32"):
        self.cfg, self.L, self.xp, self.dtype = cfg, layers, xp, np.dtype(dtype)
        self.precision = precision
        self.act = np.dtype(layers.activation_dtype(precision, self.dtype))  # activations' element type
        layout, total = param_layout(cfg)
        self.params = xp.asarray(init_params(cfg, seed, self.dtype))
        self.weights = self.params if self.act == self.dtype else xp.empty(total, dtype=self.act)
        self.grads = xp.zeros(total, dtype=self.dtype)
        self.opt_m = xp.zeros(total, dtype=self.dtype)
        self.opt_v = xp.zeros(total, dtype=self.dtype)
        self.opt_step = 0  # AdamW steps taken (bias correction); saved in checkpoints for resume
        # 1 where AdamW decays the weight (matrices), a byte each: every step reads it, and as float32 it was
        # an eighth of the GPU AdamW pass's memory traffic
        mask = np.zeros(total, dtype=np.uint8)
        for name, (off, shape) in layout.items():
            if is_matrix(name):
                mask[off:off + math.prod(shape)] = 1
        self.decay_mask = xp.asarray(mask)
        self.p, self.g = self._fused_views(self.weights), self._fused_views(self.grads)
        self.sync_weights()
        cos, sin = rope_tables(cfg.head_dim, cfg.context, cfg.rope_theta, self.dtype)
        self.cos, self.sin = xp.asarray(cos), xp.asarray(sin)
        self.zero_position = xp.zeros(1, dtype=np.int32)  # where training and full forwards start
        self._acts, self._acts_shape = None, None
        self._spare_caches = []  # released KV caches, kept with their recorded decoding steps
        self.graphs = True  # replay small decoding steps as CUDA graphs (GPU); off to measure the difference

    def sync_weights(self):
        """Rewrite the compute copy of the weights (bf16) from the master weights after they changed outside
        the AdamW step (a load, a broadcast, ZeRO's all-gather); nothing to do where the two are one buffer."""
        if self.weights is not self.params:
            self.L.cast_params(self.weights, self.params)

    def pad_buffers(self, multiple):
        """Move params and grads into buffers padded with zeros to a multiple of `multiple` elements
        (`params_padded`, `grads_padded`): ZeRO's reduce-scatter and all-gather split a buffer into equal shards
        (distributed.DataParallel). params and grads stay the exact-size views that everything else reads."""
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

    def _mode(self):
        """The layer module's precision for the block (the GPU's tf32 / fp32 switch); nothing on the CPU."""
        return self.L.precision(self.precision)

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

    # -------------------------------------------------------------------------------- state in and out
    def load_params(self, flat):
        self.params[...] = self.xp.asarray(np.asarray(flat, dtype=self.dtype))
        self.sync_weights()

    def params_numpy(self):
        return self._to_numpy(self.params).astype(np.float32)

    def opt_state_numpy(self):
        return self._to_numpy(self.opt_m).astype(np.float32), self._to_numpy(self.opt_v).astype(np.float32)

    def load_opt_state(self, m, v):
        self.opt_m[...] = self.xp.asarray(np.asarray(m, dtype=self.dtype))
        self.opt_v[...] = self.xp.asarray(np.asarray(v, dtype=self.dtype))

    def device_memory(self):
        """Bytes the GPU engine holds in CuPy's memory pool (its high-water mark: the pool only grows); None on
        the CPU."""
        return None if self.xp is np else self.xp.get_default_memory_pool().total_bytes()

    def _to_numpy(self, a):
        return a.get() if hasattr(a, "get") else np.array(a)

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
        # Kept per layer though cheap to recompute: the SwiGLU output (recomputing it cost 3% of a `base` step on
        # the H100, 0.6 ms of 19.4, for 0.5 GiB at batch 16 x 512) and the normed inputs of the two sublayers
        # (2% at batch 32, 0.76 ms of 33.55, for 0.36 GiB at 16 x 512 and 0.72 at 32).
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
    def _forward(self, tokens, a, B, T, cache=None):
        """tokens (B, T) -> a['hf'] (N, C), the final-normed hidden state; fills every activation. With a KV
        cache (decoding), the tokens sit at positions cache.pos.. and attend to the cache too; decoding's
        activations (`_decode_step`) are one buffer per kind shared by all layers, the residual stream
        updated in place."""
        cfg, L, p = self.cfg, self.L, self.p
        H, G = cfg.n_heads, cfg.n_kv_heads
        N = B * T
        L.embedding_forward(a["resid"][0], tokens.reshape(N), p["tok_emb"])
        for i in range(cfg.n_layers):
            w = f"layers.{i}."
            resid, resid_mid = a["resid"][i], a["resid_mid"][i]
            qkv, att = a["qkv"][i], a["att"][i]
            # attention block: (N, C) -> qkv (B, T, H+2G, D) -> att (B, T, H, D) -> (N, C)
            # the skip connections: the norm copies its input into the stream's next buffer (training keeps
            # one a sublayer; decoding updates one in place), and the sublayer's matmul adds its output there
            skip = resid_mid if resid_mid is not resid else None
            resid_next = a["resid"][i + 1]
            position = self.zero_position if cache is None else cache.position
            L.rmsnorm_matmul_rope_forward(qkv, a["rstd1"][i], resid, p[w + "attn_norm"], p[w + "wqkv"], cfg.norm_eps,
                                          a["xn1"][i], self.cos, self.sin, H + G, position, skip)
            if cache is None:
                L.attention_forward(att, a["lse"][i], qkv, H, G)
            else:  # k and v into the cache, attention over it
                L.attention_cached(att, a["lse"][i], qkv, cache.kv[i], H, G, cache.position)
            L.matmul_forward(resid_mid, att.reshape(N, -1), p[w + "wo"], accumulate=True)
            # feed-forward block: (N, C) -> gate|up (N, 2F) -> (N, F) -> (N, C)
            L.rmsnorm_matmul_swiglu_forward(a["sw"][i], a["gate_up"][i], a["rstd2"][i], resid_mid, p[w + "ffn_norm"],
                                            p[w + "w_gate_up"], cfg.norm_eps, a["xn2"][i],
                                            resid_next if resid_next is not resid_mid else None)
            L.matmul_forward(resid_next, a["sw"][i], p[w + "w_down"], accumulate=True)
        L.rmsnorm_forward(a["hf"], a["rstdf"], a["resid"][cfg.n_layers], p["final_norm"], cfg.norm_eps)

    def _losses(self, a, targets, backward, counts):
        """All K heads' logits (N, K*V) in one matmul, then the fused softmax cross-entropy. Returns a function
        that reads back (loss, loss0) (the caller queues the backward pass first, so the device does not wait
        for the host in between): each head's loss is its sum over supervised targets divided by counts[k]
        (this batch's, or a larger batch's)."""
        cfg, xp = self.cfg, self.xp
        K = cfg.mtp_heads
        targets = targets.reshape(K, -1)
        self.L.matmul_forward(a["logits"], a["hf"], self.p["heads"])
        counts = np.asarray(counts, dtype=np.float64)
        if backward:
            # the cross-entropy layer scales each (head, row) on its own; here every row of head k alike
            scale = 1.0 / (K * np.maximum(counts, 1))
            dscale = np.repeat(scale[:, None], targets.shape[1], axis=1)
            self.L.crossentropy_forward_backward(a["losses"], a["logits"], targets,
                                                 xp.asarray(dscale.astype(self.dtype)))
        else:
            self.L.crossentropy_forward(a["losses"], a["logits"], targets)
        sums = a["losses"].sum(axis=1)

        def read():
            per_head = self._to_numpy(sums).astype(np.float64) / np.maximum(counts, 1)
            return float(per_head.mean()), float(per_head[0])
        return read

    def _tokens(self, inputs):
        """inputs as a (B, T) int32 array of the engine's library; refuses what does not fit the context (the
        RoPE tables and the kernels stop there)."""
        inputs = np.asarray(inputs)
        if inputs.ndim != 2 or not 1 <= inputs.shape[1] <= self.cfg.context:
            raise ValueError(f"inputs of shape {inputs.shape} do not fit the model: (batch, 1..{self.cfg.context})")
        return self.xp.asarray(inputs.astype(np.int32, copy=False))

    def _prepare(self, inputs, targets):
        """Device copies of inputs and targets, and the supervised targets per head (counted on the host,
        so the step does not wait for the device)."""
        inputs = self._tokens(inputs)
        targets = np.asarray(targets, dtype=np.int32)
        B, T = inputs.shape
        if targets.shape != (self.cfg.mtp_heads, B, T):
            raise ValueError(f"targets {targets.shape} do not match inputs {inputs.shape} and K heads")
        counts = (targets >= 0).reshape(self.cfg.mtp_heads, -1).sum(axis=1)
        return inputs, self.xp.asarray(targets), counts, B, T

    def forward_loss(self, inputs, targets):
        """(loss, loss0) without gradients: loss is the mean over the K heads, loss0 head 0's."""
        inputs, targets, counts, B, T = self._prepare(inputs, targets)
        a = self._activations(B, T)
        with self._mode():
            self._forward(inputs, a, B, T)
            return self._losses(a, targets, backward=False, counts=counts)()

    def sequence_logprobs(self, inputs, targets):
        """(B,) float64: each row's sum of head-0 log-probabilities of its supervised targets (targets[0] >= 0;
        for a chat pair, the response tokens and </s>). No gradients: DPO's reference model."""
        inputs, targets, _, B, T = self._prepare(inputs, targets)
        a = self._activations(B, T)
        with self._mode():
            self._forward(inputs, a, B, T)
            self.L.matmul_forward(a["logits"], a["hf"], self.p["heads"])
            self.L.crossentropy_forward(a["losses"], a["logits"], targets.reshape(self.cfg.mtp_heads, -1))
        return -self._to_numpy(a["losses"][0]).astype(np.float64).reshape(B, T).sum(axis=1)

    def logits(self, inputs):
        """Head-0 logits (B, T, V) of a full forward pass, as float32 NumPy."""
        inputs = self._tokens(inputs)
        B, T = inputs.shape
        a = self._activations(B, T)
        with self._mode():
            self._forward(inputs, a, B, T)
            self.L.matmul_forward(a["logits"], a["hf"], self.p["heads"])
        V = self.cfg.vocab_size
        return self._to_numpy(to_float32(a["logits"][:, :V])).reshape(B, T, V)

    # --------------------------------------------------------------------------------------- backward
    def forward_backward(self, inputs, targets, accumulate=False, counts=None):
        """Loss and gradients for one batch; returns (loss, loss0). The gradients overwrite self.grads, or add
        to them with accumulate (gradient accumulation over micro-batches: pass counts, the supervised targets
        per head over all of them, and the returned losses add up to the large batch's)."""
        with self._mode():
            return self._forward_backward(inputs, targets, accumulate, counts)

    def _forward_backward(self, inputs, targets, accumulate, counts):
        inputs, targets, batch_counts, B, T = self._prepare(inputs, targets)
        a = self._activations(B, T)
        self._forward(inputs, a, B, T)
        counts = batch_counts if counts is None else counts
        loss = self._losses(a, targets, backward=True, counts=counts)  # a['logits'] now holds d loss / d logits
        self._backward(inputs, a, B, T, accumulate)
        return loss()

    def _backward(self, inputs, a, B, T, accumulate):
        """From d loss / d logits in a['logits'] to every parameter's gradient (into self.grads, or added)."""
        cfg, L, p, g = self.cfg, self.L, self.p, self.g
        N, H, G = B * T, cfg.n_heads, cfg.n_kv_heads
        if not accumulate:
            self.grads.fill(0)
        dresid, dxn = a["dresid"], a["dxn"]
        # heads and final norm: dhf = dlogits @ heads, dheads += dlogits.T @ hf
        L.matmul_backward(a["dhf"], g["heads"], a["logits"], a["hf"], p["heads"])
        dresid.fill(0)
        L.rmsnorm_backward(dresid, g["final_norm"], a["dhf"], a["resid"][cfg.n_layers], p["final_norm"],
                           a["rstdf"])
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
        L.embedding_backward(g["tok_emb"], dresid, inputs.reshape(N))

    # ------------------------------------------------------------------------------------------- DPO
    def dpo_forward_backward(self, inputs, targets, ref_logps, beta, pairs=None, accumulate=False):
        """DPO (Rafailov et al. 2023) on a batch of P preference pairs: rows 0..P-1 of inputs (2P, T) are the
        chosen sequences, rows P..2P-1 the rejected ones, pair i = rows (i, P+i); targets (K, 2P, T) mask
        everything but each response and its </s> with -1 (as SFT does); ref_logps (2P,) are the reference
        model's sequence log-probabilities of the same rows (sequence_logprobs of the starting model).

            pi_s = sum over the row's supervised head-0 targets of log softmax(logits)[target]
            z_i  = beta * ((pi_c - ref_c) - (pi_r - ref_r))
            loss = (1 / pairs) * sum_i -log sigmoid(z_i)

        pairs is the number of pairs the loss is averaged over (this batch's P, or a larger batch's with
        accumulate, for gradient accumulation: the micro-batches' losses and gradients then add up).
        The backward is the cross-entropy layer's own with a weight per row: d pi_s / d logits of a row is
        -(softmax - onehot), and d loss / d pi_c = -beta * sigmoid(-z) / pairs (+ for pi_r), so d loss /
        d logits of a chosen row = +beta * sigmoid(-z) / pairs * (softmax - onehot), of a rejected row the
        negative of that. Heads 1..K-1 get no gradient (their scale is 0). Returns (loss, stats) with stats
        the per-pair arrays pi (2P,), z (P,), and the rewards beta * (pi - ref) (2P,)."""
        with self._mode():
            return self._dpo_forward_backward(inputs, targets, ref_logps, beta, pairs, accumulate)

    def dpo_weights(self, z, beta, pairs):
        """(chosen, rejected) weights of each pair's rows' cross-entropy gradients: d loss / d CE_s."""
        w = beta * (1.0 / (1.0 + np.exp(z))) / pairs  # beta * sigmoid(-z) / pairs
        return w, -w

    def _dpo_forward_backward(self, inputs, targets, ref_logps, beta, pairs, accumulate):
        cfg, xp, K = self.cfg, self.xp, self.cfg.mtp_heads
        inputs_d, targets_d, _, B, T = self._prepare(inputs, targets)
        if B % 2:
            raise ValueError(f"DPO needs chosen and rejected rows in pairs, got {B} rows")
        P = B // 2
        pairs = P if pairs is None else pairs
        a = self._activations(B, T)
        self._forward(inputs_d, a, B, T)
        flat_targets = targets_d.reshape(K, -1)
        self.L.matmul_forward(a["logits"], a["hf"], self.p["heads"])
        # the forward alone first: the weights need every sequence's log-probability
        self.L.crossentropy_forward(a["losses"], a["logits"], flat_targets)
        pi = -self._to_numpy(a["losses"][0]).astype(np.float64).reshape(B, T).sum(axis=1)
        ref = np.asarray(ref_logps, dtype=np.float64)
        z = beta * ((pi[:P] - ref[:P]) - (pi[P:] - ref[P:]))
        loss = float(np.logaddexp(0.0, -z).sum() / pairs)  # -log sigmoid(z), stable for any z
        w_chosen, w_rejected = self.dpo_weights(z, beta, pairs)
        dscale = np.zeros((K, B, T))
        dscale[0] = np.concatenate([w_chosen, w_rejected])[:, None]
        self.L.crossentropy_forward_backward(a["losses"], a["logits"], flat_targets,
                                             xp.asarray(dscale.reshape(K, -1).astype(self.dtype)))
        self._backward(inputs_d, a, B, T, accumulate)
        return loss, dict(pi=pi, z=z, rewards=beta * (pi - ref))

    def dpo_loss(self, inputs, targets, ref_logps, beta, pairs=None):
        """The DPO loss of dpo_forward_backward without gradients (the finite-difference check)."""
        pi = self.sequence_logprobs(inputs, targets)
        ref = np.asarray(ref_logps, dtype=np.float64)
        P = len(pi) // 2
        z = beta * ((pi[:P] - ref[:P]) - (pi[P:] - ref[P:]))
        return float(np.logaddexp(0.0, -z).sum() / (P if pairs is None else pairs))

    # ------------------------------------------------------------------------------------------ AdamW
    def step(self, lr, weight_decay, grad_clip, beta1=0.9, beta2=0.95, eps=1e-8):
        """Clip the global gradient norm to grad_clip (0: no clipping), then one AdamW step.
        Returns the norm before clipping."""
        norm = math.sqrt(self.L.sum_squares(self.grads))
        scale = clip_scale(norm, grad_clip)
        self.opt_step += 1
        copy = None if self.weights is self.params else self.weights
        self.L.adamw_update(self.params, self.grads, self.opt_m, self.opt_v, self.decay_mask, lr, beta1,
                            beta2, eps, weight_decay, scale, self.opt_step, compute_copy=copy)
        return norm

    # ------------------------------------------------------------------------------------- generation
    def new_cache(self, batch=1):
        """An empty KV cache for `batch` sequences: a released one of that size when there is one (its
        decoding steps are recorded already), else a new one."""
        for i, cache in enumerate(self._spare_caches):
            if cache.kv.shape[1] == batch:
                cache = self._spare_caches.pop(i)
                cache.pos = 0
                return cache
        return KVCache(self.xp, self.cfg, batch, self.act)

    def release_cache(self, cache):
        """Hand back a cache no longer used, for new_cache to reuse (a generation's, when it ends)."""
        if all(c is not cache for c in self._spare_caches):
            self._spare_caches.append(cache)

    def decode(self, cache, tokens, every_head=False, argmax=False, repeat=1):
        """Append tokens (B, n) at cache.pos and run them through the model, attending to the cache. Returns
        head-0 logits (B, V) of the last new position, or with every_head the logits of all K heads at every
        new position, (B, n, K, V) (what speculative decoding verifies and drafts with): float32 NumPy. With
        argmax, the index of the largest logit instead, (B,) or (B, n, K) int32, found on the device (greedy
        decoding then reads back one number a token, not V). With argmax and one token a sequence, repeat > 1
        runs that many steps, each fed the ids of the step before, and returns the (B, repeat) ids: greedy
        decoding then waits for the device once every `repeat` tokens.

        Steps of at most STEP_ROWS = B * n rows keep their buffers in the cache, and on the GPU run as a CUDA
        graph, recorded by their first call and replayed after: one launch a token instead of hundreds."""
        tokens = np.asarray(tokens, dtype=np.int32)
        if tokens.ndim != 2 or tokens.shape[1] < 1:
            raise ValueError(f"tokens of shape {tokens.shape}: (batch, n) expected")
        B, n = tokens.shape
        if repeat > 1 and (n != 1 or every_head or not argmax):
            raise ValueError("repeat > 1 takes greedy steps of one token a sequence (argmax, n = 1)")
        if cache.pos + n * repeat > self.cfg.context:
            raise ValueError(f"the KV cache holds {self.cfg.context} positions; {cache.pos} + {n * repeat} do not fit")
        with self._mode():
            out = self._step(cache, B, n, every_head, argmax)(tokens, repeat)
        cache._pos += n * repeat  # the steps advanced cache.position on the device
        return out

    def verify_drafts(self, cache, tokens, repeat=1):
        """Greedy self-speculative decoding's steps, chained on the device, for one sequence: tokens (1, K) are
        the next token and K - 1 drafts after it. A step runs them through the model over the cache, keeps the
        drafts that head 0's argmax agrees with and moves the cache past them and the first token; head 0's
        next id and heads 1..K-1's drafts at the last kept row are the next step's tokens (the layer
        accept_drafts). After `repeat` steps returns (the kept ids, the accepted drafts of each step, the next
        step's tokens (K,)): one read back for them all."""
        K = self.cfg.mtp_heads
        tokens = np.asarray(tokens, dtype=np.int32).reshape(1, K)
        if cache.pos + K * repeat > self.cfg.context:
            raise ValueError(f"the KV cache holds {self.cfg.context} positions; {cache.pos} + {K} x {repeat} "
                             "may not fit")
        with self._mode():
            kept, accepted, following = self._step(cache, 1, K, True, True, verify=True)(tokens, repeat)
        cache._pos += len(kept)  # accept_drafts moved cache.position on the device
        return kept, accepted, following

    def _step(self, cache, B, n, every_head, argmax, verify=False):
        """The cache's step function of this shape, made by _decode_step the first time."""
        key = (B, n, every_head, argmax, verify, self.graphs)
        step = cache.steps.get(key)
        if step is None:
            step = self._decode_step(cache, B, n, every_head, argmax, verify)
            if B * n <= STEP_ROWS:
                cache.steps[key] = step
        return step

    def _decode_step(self, cache, B, n, every_head, argmax, verify=False):
        """A function tokens (B, n) -> decode's result (verify_drafts' with verify), over buffers of its own."""
        cfg, L, p, xp = self.cfg, self.L, self.p, self.xp
        N, C, H, G, D, F, V = B * n, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden, cfg.vocab_size
        heads = cfg.mtp_heads if every_head else 1
        rows = N if every_head else B  # the rows that get logits: every position's, or each sequence's last
        e = lambda *shape: xp.empty(shape, dtype=self.act)
        f = lambda *shape: xp.empty(shape, dtype=self.dtype)
        x, rstd, qkv, att, lse = e(N, C), f(N), e(B, n, H + 2 * G, D), e(B, n, H, D), f(B, H, n)
        layers = cfg.n_layers
        xn = e(N, C)
        a = dict(resid=[x] * (layers + 1), resid_mid=[x] * layers, xn1=[xn] * layers, xn2=[xn] * layers,
                 rstd1=[rstd] * layers, rstd2=[rstd] * layers, qkv=[qkv] * layers, att=[att] * layers,
                 lse=[lse] * layers, gate_up=[e(N, 2 * F)] * layers, sw=[e(N, F)] * layers, hf=e(N, C), rstdf=f(N),
                 last=e(B, C), logits=f(rows, heads * V), tokens=xp.empty((B, n), dtype=np.int32))
        # Greedy single steps write the chosen ids over their own input: when the next call feeds them back,
        # as generation does, they are on the device already and nothing is copied there. They also log
        # them by position, so that `repeat` steps in a row are read back at once.
        feeds_back = argmax and not every_head and n == 1
        a["ids"] = a["tokens"].reshape(B) if feeds_back else xp.empty(rows * heads, dtype=np.int32)
        log = xp.empty((cfg.context, B), dtype=np.int32) if feeds_back else None
        if verify:  # (kept id, accepted drafts of the step starting there) by position, and the next tokens
            log = xp.zeros((cfg.context + n, 2), dtype=np.int32)
        held = {}  # the host copy of what a["tokens"] holds

        def run():
            self._forward(a["tokens"], a, B, n, cache)
            h = a["hf"]
            if rows != N:
                a["last"][...] = h.reshape(B, n, C)[:, -1]
                h = a["last"]
            L.matmul_forward(a["logits"], h, p["heads"] if every_head else p["heads.0"])
            if verify:
                L.argmax(a["ids"], a["logits"].reshape(rows * heads, V))
                L.accept_drafts(a["tokens"].reshape(n), a["ids"], log, cache.position)
                return
            if argmax:
                L.argmax(a["ids"], a["logits"].reshape(rows * heads, V), log, cache.position)
            L.advance_position(cache.position, n)

        run = L.graph(run) if self.graphs and N <= STEP_ROWS else run
        shape = (B, n, cfg.mtp_heads) if every_head else (B,)

        def step(tokens, repeat):
            if not np.array_equal(held.get("tokens"), tokens):
                if xp is np:
                    a["tokens"][...] = tokens
                else:
                    a["tokens"].set(tokens)  # one copy to the device, no temporary
            start = cache.pos
            for _ in range(repeat):
                run()
            if verify:  # the steps kept 1 to n ids each: walk their accepted counts from the start
                span = self._to_numpy(log[start:start + n * repeat + n])
                end, accepted = 0, []
                for _ in range(repeat):
                    accepted.append(int(span[end, 1]))
                    end += accepted[-1] + 1
                following = span[end:end + n, 0].copy()
                held["tokens"] = following[None]
                return span[:end, 0].tolist(), accepted, following
            if not argmax:
                held["tokens"] = tokens.copy()
                return self._to_numpy(a["logits"]).astype(np.float32).reshape(shape + (V,))
            if not feeds_back:
                held["tokens"] = tokens.copy()
                return self._to_numpy(a["ids"]).reshape(shape)
            ids = self._to_numpy(log[start:start + repeat]).T  # (B, repeat)
            held["tokens"] = ids[:, -1:].copy()
            return ids if repeat > 1 else ids[:, 0]

        return step


def clip_scale(norm, grad_clip):
    """The factor that scales gradients of global norm `norm` down to grad_clip (0: no clipping)."""
    return min(1.0, grad_clip / (norm + 1e-6)) if grad_clip > 0 else 1.0


# Decoding steps of at most this many rows (batch x new tokens) keep their buffers and run as CUDA graphs; the
# GPU's matmuls of that few rows take its matrix-vector kernel (cuBLAS, through CuPy, cannot be recorded).
STEP_ROWS = 8
DEFAULT_PRECISION = {"cpu": "fp32", "gpu": "bf16"}


def make_engine(cfg, device="cpu", dtype=np.float32, seed=0, precision=None):
    """An Engine on the CPU (numba) or the GPU (CUDA kernels; needs CUDA and cupy). precision: "fp32" (the
    CPU's only one), "tf32" or "bf16" (the GPU's default); None takes the device's default."""
    precision = precision or DEFAULT_PRECISION[device]
    if device == "cpu":
        if precision != "fp32":
            raise UserError(f"--precision {precision}: the CPU engine computes in fp32 only")
        from nanoeuler.model.cpu import layers
        return Engine(cfg, layers, np, dtype, seed, precision)
    if device == "gpu":
        from nanoeuler.model.gpu import check_config
        try:
            check_config(cfg)
        except ValueError as e:
            raise UserError(str(e)) from None
        import cupy
        from nanoeuler.model.gpu import layers
        return Engine(cfg, layers, cupy, dtype, seed, precision)
    raise ValueError(f"unknown device {device!r}")
