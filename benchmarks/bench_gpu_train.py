"""One training step of a preset on the GPU engine next to a PyTorch implementation of the same model.

Both run in this process on the same GPU, the same batch and the same initial weights, in the same
precision: float32 storage with TF32 tensor-core matmuls. PyTorch runs eagerly with its fused AdamW and
scaled_dot_product_attention (causal; k/v repeated over the query group as Hugging Face's Llama does); our
engine is CUDA kernels + cuBLAS (nanoeuler/gpu). A step is forward, backward, gradient clipping and AdamW,
ending with the loss on the host, as in training. Prints ms/step, tokens/s, MFU (model FLOPs: 6 per
parameter per token for the matmuls, plus causal attention, 6 * layers * dim * T; over the card's dense
TF32 peak) and peak GPU memory (our CuPy memory pool's size, which only grows; torch's peak allocation).

    PYTHONPATH=. python3 benchmarks/bench_gpu_train.py                  # base, T = 512, batch 16
    PYTHONPATH=. python3 benchmarks/bench_gpu_train.py --preset big --batch-size 32
"""
import argparse
import math
import time

import numpy as np

from nanoeuler.config import PRESETS, flops_per_token, init_params, param_count, views


def batch(cfg, B, seed):
    rng = np.random.default_rng(seed)
    T, K = cfg.context, cfg.mtp_heads
    win = rng.integers(0, cfg.vocab_size, (B, T + K)).astype(np.int32)
    return win[:, :T], np.stack([win[:, 1 + k:1 + k + T] for k in range(K)])


def time_steps(step, sync, warmup, steps):
    """Median, min ms of `steps` timed steps after `warmup`, and the first step's loss."""
    first = step()
    for _ in range(warmup - 1):
        step()
    sync()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        sync()
        times.append(1e3 * (time.perf_counter() - t))
    return float(np.median(times)), float(np.min(times)), first


def bench_ours(cfg, inputs, targets, args):
    import cupy
    from nanoeuler.model import make_engine

    pool = cupy.get_default_memory_pool()
    eng = make_engine(cfg, device="gpu", seed=0)

    def step():
        loss = eng.forward_backward(inputs, targets)[0]
        eng.step(lr=1e-4, weight_decay=0.1, grad_clip=1.0)
        return loss

    med, best, loss = time_steps(step, cupy.cuda.Device().synchronize, args.warmup, args.steps)
    return med, best, loss, pool.total_bytes()


class TorchModel:
    """The model of DESIGN.md in PyTorch (eager), weights from our flat buffer."""

    def __init__(self, cfg, flat, torch):
        self.cfg, self.torch = cfg, torch
        v = {k: torch.tensor(np.asarray(a), device="cuda") for k, a in views(flat, cfg).items()}
        cat = lambda *names: torch.cat([v[n] for n in names]).requires_grad_()
        self.params = {"tok_emb": v["tok_emb"].requires_grad_(), "final_norm": v["final_norm"].requires_grad_(),
                       "heads": cat(*[f"heads.{k}" for k in range(cfg.mtp_heads)])}
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            self.params[p + "wqkv"] = cat(p + "wq", p + "wk", p + "wv")
            self.params[p + "w_gate_up"] = cat(p + "w_gate", p + "w_up")
            for n in ("attn_norm", "wo", "ffn_norm", "w_down"):
                self.params[p + n] = v[p + n].requires_grad_()
        inv = cfg.rope_theta ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
        ang = torch.arange(cfg.context, dtype=torch.float64)[:, None] * inv[None, :]
        self.cos = torch.cos(ang).float().cuda()[:, None, :]  # (T, 1, D/2)
        self.sin = torch.sin(ang).float().cuda()[:, None, :]

    def rmsnorm(self, x, w):
        return x * self.torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps) * w

    def rope(self, x):  # x (B, T, h, D), rotate-half
        T, half = x.shape[1], x.shape[-1] // 2
        c, s = self.cos[:T], self.sin[:T]
        x1, x2 = x[..., :half], x[..., half:]
        return self.torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    def loss(self, inputs, targets):
        torch, F, cfg, P = self.torch, self.torch.nn.functional, self.cfg, self.params
        B, T = inputs.shape
        H, G, D, K, V = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mtp_heads, cfg.vocab_size
        x = F.embedding(inputs, P["tok_emb"])
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            qkv = F.linear(self.rmsnorm(x, P[p + "attn_norm"]), P[p + "wqkv"]).view(B, T, H + 2 * G, D)
            q, k, v = qkv.split([H, G, G], dim=2)
            q, k = self.rope(q).transpose(1, 2), self.rope(k).transpose(1, 2)
            k = k.repeat_interleave(H // G, dim=1)
            v = v.transpose(1, 2).repeat_interleave(H // G, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + F.linear(y.transpose(1, 2).reshape(B, T, H * D), P[p + "wo"])
            gate, up = F.linear(self.rmsnorm(x, P[p + "ffn_norm"]), P[p + "w_gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, P[p + "w_down"])
        logits = F.linear(self.rmsnorm(x, P["final_norm"]), P["heads"]).view(B * T, K, V)
        losses = [F.cross_entropy(logits[:, k], targets[k].reshape(-1), ignore_index=-1) for k in range(K)]
        return torch.stack(losses).mean()


def bench_torch(cfg, inputs, targets, args):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    model = TorchModel(cfg, init_params(cfg, 0), torch)
    opt = torch.optim.AdamW(list(model.params.values()), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, fused=True)
    x = torch.tensor(inputs, device="cuda", dtype=torch.long)
    y = torch.tensor(targets, device="cuda", dtype=torch.long)
    torch.cuda.reset_peak_memory_stats()

    def step():
        loss = model.loss(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.params.values()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    med, best, loss = time_steps(step, torch.cuda.synchronize, args.warmup, args.steps)
    return med, best, loss, torch.cuda.max_memory_allocated()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="base", choices=sorted(PRESETS))
    ap.add_argument("--batch-size", type=int, help="default: the preset's training batch")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    from nanoeuler.gpu import device_name, peak_tf32_flops
    from nanoeuler.train import PRESET_HYPER

    cfg = PRESETS[args.preset]
    B = args.batch_size or PRESET_HYPER[args.preset].batch_size
    T = cfg.context
    inputs, targets = batch(cfg, B, seed=1)
    peak = peak_tf32_flops()
    print(f"{device_name()}: {args.preset} ({param_count(cfg) / 1e6:.1f}M params), batch {B} x T {T}, FP32 + TF32 "
          f"matmuls; {args.warmup} warm-up steps, median of {args.steps}; {flops_per_token(cfg) / 1e6:.0f} "
          f"MFLOP/token, TF32 peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s")
    import cupy
    rows = [("nanoeuler (CuPy + CUDA)", *bench_ours(cfg, inputs, targets, args))]
    cupy.get_default_memory_pool().free_all_blocks()  # hand our engine's memory back before torch runs
    rows.append(("PyTorch eager + SDPA", *bench_torch(cfg, inputs, targets, args)))
    print(f"{'engine':<26} {'ms/step':>8} {'best':>7} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'step-1 loss':>12}")
    for name, med, best, loss, mem in rows:
        tps = B * T / (med / 1e3)
        mfu = f"{100 * tps * flops_per_token(cfg) / peak:5.1f}%" if peak else "   n/a"
        print(f"{name:<26} {med:8.1f} {best:7.1f} {tps:10.0f} {mfu:>6} {mem / 2**30:9.2f} {loss:12.6f}")
    ratio = rows[1][1] / rows[0][1]
    print(f"throughput ours / PyTorch: {ratio:.2f}x; first-step losses differ by "
          f"{abs(rows[0][3] - rows[1][3]):.1e} (same weights and batch)")
    assert math.isfinite(rows[0][3])


if __name__ == "__main__":
    main()
