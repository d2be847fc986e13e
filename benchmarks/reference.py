"""What the benchmarks share: nanoeuler's model in PyTorch (the peer every speed figure is measured against)
and the training batches both sides run on.

`Reference(cfg, flat)` is the model of docs/design.md, with its weights from our flat parameter buffer
(`config.param_layout`; `Reference.from_tensors` takes the named tensors of a checkpoint instead):
Llama-style, no biases; RMSNorm (`F.rms_norm`, eps `cfg.norm_eps`); rotary position embeddings in the
rotate-half convention (theta `cfg.rope_theta`, 10000), as Hugging Face's `LlamaForCausalLM`;
grouped-query causal attention through `F.scaled_dot_product_attention` with scale 1/sqrt(head_dim);
SwiGLU; a final RMSNorm and K prediction heads, head k predicting the token 1+k positions ahead. The loss
is the mean over the heads of their cross-entropies, a target of -1 counting for nothing. As in our
engines, wq|wk|wv, w_gate|w_up and heads.0..K-1 are each one parameter, a fused matrix (a tied model's
`heads` is the `tok_emb` parameter itself), and weight decay goes to the matrices only (`param_groups`, as
`config.is_matrix`). By default each fused matrix is one
matmul whose output is split (the faster form on a GPU); `split_matmuls=True` runs a matmul per part on
slices of it instead, as separate `Linear` layers would (the faster form on a CPU at `small`'s size, where
the backward pass of the split outputs, a concatenation of large activation gradients, costs more than
the fused matmul saves).

Any floating dtype works: `Reference(..., dtype=torch.bfloat16)` or `.to(dtype)`, or float32 weights
under `torch.autocast(device_type, dtype=torch.bfloat16)`. The rotary tables follow the activations' dtype,
the residual stream keeps the weights' dtype (under autocast the matmuls run in bf16 and their outputs are
added to the float32 stream), and the cross-entropy is computed in float32 at least.

Grouped-query attention: `gqa="native"` passes k/v to SDPA with `enable_gqa=True`; `gqa="repeat"` repeats
them over each query group first, as Hugging Face's Llama does.

    from reference import Reference, batches
    model = Reference(cfg, init_params(cfg, seed=0), device="cuda")
    for inputs, targets in batches(cfg, batch_size=16, steps=10):   # the arrays our engines take
        loss, loss0 = model(torch.from_numpy(inputs).long().cuda(), torch.from_numpy(targets).long().cuda())
"""
import itertools
import json
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F

from nanoeuler.model.config import is_matrix, param_layout, views


def batches(cfg, batch_size, seed=0, steps=None, tokens=None):
    """`steps` training batches (without end if None) as both engines take them: inputs (B, T) and targets
    (K, B, T), int32, T = cfg.context, targets[k] the sequence shifted by 1 + k. Windows of random token
    ids, or, given a 1-D array `tokens` (a text's bytes, say), windows of it at random offsets."""
    rng = np.random.default_rng(seed)
    T, K = cfg.context, cfg.mtp_heads
    for _ in itertools.count() if steps is None else range(steps):
        if tokens is None:
            win = rng.integers(0, cfg.vocab_size, (batch_size, T + K))
        else:
            starts = rng.integers(0, len(tokens) - T - K, batch_size)
            win = np.stack([tokens[s:s + T + K] for s in starts])
        win = win.astype(np.int32)
        yield np.ascontiguousarray(win[:, :T]), np.stack([win[:, 1 + k:1 + k + T] for k in range(K)])


def _fused_names(cfg):
    """{fused name: [our tensor names, in buffer order]}: the matrices that one matmul reads together."""
    fused = {"tok_emb": ["tok_emb"]}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        fused[p + "attn_norm"] = [p + "attn_norm"]
        fused[p + "wqkv"] = [p + "wq", p + "wk", p + "wv"]
        if cfg.qkv_bias:
            fused[p + "bqkv"] = [p + "bq", p + "bk", p + "bv"]
        fused[p + "wo"] = [p + "wo"]
        fused[p + "ffn_norm"] = [p + "ffn_norm"]
        fused[p + "w_gate_up"] = [p + "w_gate", p + "w_up"]
        fused[p + "w_down"] = [p + "w_down"]
    fused["final_norm"] = ["final_norm"]
    if not cfg.tied:  # a tied head is tok_emb (Reference.w)
        fused["heads"] = [f"heads.{k}" for k in range(cfg.mtp_heads)]
    return fused


class Reference(torch.nn.Module):
    """nanoeuler's model in PyTorch; forward(inputs (B, T), targets (K, B, T)) -> (loss, head-0 loss)."""

    def __init__(self, cfg, flat, device="cpu", dtype=torch.float32, gqa="native", split_matmuls=False):
        super().__init__()
        assert gqa in ("native", "repeat"), gqa
        self.cfg, self.gqa, self.split_matmuls = cfg, gqa, split_matmuls
        named = views(np.asarray(flat), cfg)
        self.fused = _fused_names(cfg)
        self.p = torch.nn.ParameterDict({
            self._key(name): torch.nn.Parameter(torch.cat([torch.tensor(np.array(named[n])) for n in parts])
                                                .to(device=device, dtype=dtype))
            for name, parts in self.fused.items()})
        # rotate-half tables over the whole head: angle(pos, i) = pos * theta^(-2 (i mod D/2) / D)
        D = cfg.head_dim
        inv = cfg.rope_theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        ang = torch.arange(cfg.context, dtype=torch.float64)[:, None] * inv[None, :]
        ang = torch.cat([ang, ang], dim=-1)[:, None, :]  # (context, 1, D): broadcast over heads
        self.register_buffer("cos", ang.cos().to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", ang.sin().to(device=device, dtype=dtype), persistent=False)

    @classmethod
    def from_tensors(cls, cfg, tensors, **kw):
        """From named tensors ({name: array}, as a checkpoint holds them) instead of the flat buffer."""
        layout, total = param_layout(cfg)
        flat = np.empty(total, dtype=np.float32)
        for name, view in views(flat, cfg).items():
            view[...] = np.asarray(tensors[name], dtype=np.float32).reshape(layout[name][1])
        return cls(cfg, flat, **kw)

    @staticmethod
    def _key(name):  # ParameterDict keys cannot hold dots
        return name.replace(".", "_")

    def w(self, name):
        """A parameter by its fused name (`layers.0.wqkv`, `heads`, ...)."""
        if name == "heads" and self.cfg.tied:
            name = "tok_emb"
        return self.p[self._key(name)]

    def param_groups(self, weight_decay):
        """AdamW groups as our engines decay: the matrices, and the norm gains and biases without weight decay."""
        return [{"params": [self.w(n) for n in self.fused if is_matrix(n)], "weight_decay": weight_decay},
                {"params": [self.w(n) for n in self.fused if not is_matrix(n)], "weight_decay": 0.0}]

    def named_tensors(self, grad=False):
        """{our tensor name: NumPy array}: the weights, or with grad=True their gradients (float64 for a
        float64 model, else float32)."""
        out = {}
        layout, _ = param_layout(self.cfg)
        for name, parts in self.fused.items():
            t = self.w(name).grad if grad else self.w(name)
            rows = [layout[n][1][0] for n in parts]  # the pieces are stacked along the first axis
            t = t.detach().cpu()
            t = t if t.dtype == torch.float64 else t.float()
            for n, piece in zip(parts, t.split(rows)):
                out[n] = piece.numpy().reshape(layout[n][1])
        return out

    def project(self, x, name, sizes, bias=None):
        """x @ w.T (+ the fused bias `bias`) for the fused matrix `name`, as one output per part (their sizes
        along the last axis)."""
        w, b = self.w(name), None if bias is None else self.w(bias)
        if self.split_matmuls:
            return [F.linear(x, part, None if b is None else b_part)
                    for part, b_part in zip(w.split(sizes), [None] * len(sizes) if b is None else b.split(sizes))]
        return F.linear(x, w, b).split(sizes, dim=-1)

    def rope(self, x):
        """x (B, T, heads, D), positions 0..T-1, rotate-half."""
        T, half = x.shape[1], x.shape[-1] // 2
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def hidden(self, inputs):
        """The final-normed hidden state (B, T, dim) of token ids (B, T)."""
        cfg = self.cfg
        B, T = inputs.shape
        H, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        norm = lambda x, name: F.rms_norm(x, (cfg.dim,), self.w(name), cfg.norm_eps)
        x = F.embedding(inputs, self.w("tok_emb"))
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            q, k, v = self.project(norm(x, p + "attn_norm"), p + "wqkv", (H * D, G * D, G * D),
                                   p + "bqkv" if cfg.qkv_bias else None)
            q, k, v = self.rope(q.view(B, T, H, D)), self.rope(k.view(B, T, G, D)), v.view(B, T, G, D)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)
            if self.gqa == "repeat":
                k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa == "native")
            x = x + F.linear(att.transpose(1, 2).reshape(B, T, H * D), self.w(p + "wo"))
            gate, up = self.project(norm(x, p + "ffn_norm"), p + "w_gate_up", (cfg.hidden, cfg.hidden))
            x = x + F.linear(F.silu(gate) * up, self.w(p + "w_down"))
        return norm(x, "final_norm")

    def logits(self, inputs):
        """Head-0 logits (B, T, vocab): what generation uses."""
        return F.linear(self.hidden(inputs), self.w("heads")[:self.cfg.vocab_size])

    def forward(self, inputs, targets):
        """(mean over the K heads of their cross-entropies, head 0's): the training loss and the reported."""
        V, K = self.cfg.vocab_size, self.cfg.mtp_heads
        logits = self.project(self.hidden(inputs), "heads", (V,) * K)  # K times (B, T, V)
        dtype = torch.promote_types(logits[0].dtype, torch.float32)  # bf16 -> float32; else as is
        losses = [F.cross_entropy(z.to(dtype).reshape(-1, V), targets[k].reshape(-1), ignore_index=-1)
                  for k, z in enumerate(logits)]
        return torch.stack(losses).mean(), losses[0]


def training_step(loss_fn, model, opt, x, y, autocast):
    """A step as nanoGPT trains, for the benchmarks: loss_fn(x, y) (the model, compiled or wrapped) under
    `autocast`, backward, clipping to 1.0, the optimizer's step; returns the loss on the host, as training
    reads it."""
    def step():
        with autocast:
            loss = loss_fn(x, y)[0]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def torchrun_rows(script, rank_counts, argv):
    """Run `script argv` under torchrun once for each count of ranks (one machine); each run's last JSON line
    from rank 0, in order. A failed run ends the benchmark with its stderr's tail."""
    rows = []
    for ranks in rank_counts:
        done = subprocess.run(["torchrun", "--standalone", f"--nproc-per-node={ranks}", script, *argv],
                              capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            sys.exit(f"torchrun with {ranks} ranks failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(lines[-1]))
    return rows
