"""PyTorch FSDP2 (`fully_shard`, ZeRO-3's sharding) + torch.compile on N GPUs: the peer of
`bench_multi_gpu.py --zero 2 3`, for the same model at the same per-rank batch.

The model of docs/design.md (benchmarks/reference.py's math) written as one module a layer, as FSDP2 shards
it: each layer, and the rest (embedding, final norm, heads), a `fully_shard` unit whose weights are gathered
for its forward and again for its backward, and the gradients reduce-scattered; float32 weights with bf16
compute (MixedPrecisionPolicy: bf16 parameters in the products, float32 gradient reduction), each layer
compiled (torch.compile), AdamW (weight decay on the matrices), gradient clipping to 1.0, as torchtitan
trains. Random weights (normal 0.02), made on the meta device and sharded before any memory is taken, so
the shape of an 8B model starts on GPUs that could not hold it whole. Each rank runs the per-rank batch of
random tokens; a step ends with the loss on the host. Prints, for each number of GPUs, the median ms a
step, tokens/s in all and a GPU, MFU a GPU (where the GPU's peak is known) and the peak memory a GPU.

    PYTHONPATH=. python3 benchmarks/bench_torch_fsdp.py --preset large --batch-size 32 --gpus 1 2
    PYTHONPATH=. python3 benchmarks/bench_torch_fsdp.py --shape llama3-8b --context 2048 --batch-size 2 --gpus 8

Run without torchrun: it launches `torchrun --nproc-per-node G` itself for each G of --gpus. Without a GPU
(`--device cpu`, gloo, `--no-compile`) it runs the same code on CPU processes: a check of the script, not a
measurement.
"""
import argparse
import contextlib
import json
import math
import os
import sys
import time

import numpy as np

from shapes import SHAPES  # benchmarks/shapes.py: published models' shapes (llama3-8b: 8.03B parameters)


def config(args):
    import dataclasses
    from nanoeuler.model.config import PRESETS
    cfg = SHAPES[args.shape] if args.shape else PRESETS[args.preset]
    if cfg.tied or cfg.qkv_bias:
        sys.exit(f"{args.shape}: this peer's model has untied heads and no q/k/v biases (llama3-8b has neither)")
    return dataclasses.replace(cfg, context=args.context) if args.context else cfg


def build(cfg, device, recompute):
    """The model (one module a layer) on `device`'s meta twin: parameters without memory."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    H, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def norm(x, w):
        return F.rms_norm(x, (cfg.dim,), w, cfg.norm_eps)

    def rope(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm = nn.Parameter(torch.empty(cfg.dim))
            self.wqkv = nn.Parameter(torch.empty((H + 2 * G) * D, cfg.dim))
            self.wo = nn.Parameter(torch.empty(cfg.dim, H * D))
            self.ffn_norm = nn.Parameter(torch.empty(cfg.dim))
            self.w_gate_up = nn.Parameter(torch.empty(2 * cfg.hidden, cfg.dim))
            self.w_down = nn.Parameter(torch.empty(cfg.dim, cfg.hidden))

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            q, k, v = F.linear(norm(x, self.attn_norm), self.wqkv).split((H * D, G * D, G * D), dim=-1)
            q, k, v = rope(q.view(B, T, H, D), cos, sin), rope(k.view(B, T, G, D), cos, sin), v.view(B, T, G, D)
            att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=True)
            x = x + F.linear(att.transpose(1, 2).reshape(B, T, H * D), self.wo)
            gate, up = F.linear(norm(x, self.ffn_norm), self.w_gate_up).split((cfg.hidden, cfg.hidden), dim=-1)
            return x + F.linear(F.silu(gate) * up, self.w_down)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_emb = nn.Parameter(torch.empty(cfg.vocab_size, cfg.dim))
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.n_layers))
            self.final_norm = nn.Parameter(torch.empty(cfg.dim))
            self.heads = nn.Parameter(torch.empty(cfg.mtp_heads * cfg.vocab_size, cfg.dim))
            self.cos = self.sin = None  # the rotary tables, made on the device after the weights

        def forward(self, inputs, targets):
            T = inputs.shape[1]
            cos, sin = self.cos[:T].to(self.tok_emb.dtype), self.sin[:T].to(self.tok_emb.dtype)
            x = F.embedding(inputs, self.tok_emb)
            for block in self.blocks:
                if recompute:
                    from torch.utils.checkpoint import checkpoint
                    x = checkpoint(block, x, cos, sin, use_reentrant=False)
                else:
                    x = block(x, cos, sin)
            V = cfg.vocab_size
            logits = F.linear(norm(x, self.final_norm), self.heads).split((V,) * cfg.mtp_heads, dim=-1)
            losses = [F.cross_entropy(z.float().reshape(-1, V), targets[k].reshape(-1)) for k, z in enumerate(logits)]
            return torch.stack(losses).mean(), losses[0]

    with torch.device("meta"):
        return Model()


def rank_main(args):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from nanoeuler.model.config import flops_per_token, param_count
    from reference import training_step

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpu = args.device == "gpu"
    if gpu:
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    cfg = config(args)
    model = build(cfg, device, args.recompute)
    compute = torch.bfloat16 if gpu else torch.float32  # the CPU check computes in float32
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for block in model.blocks:
        if not args.no_compile:
            block.compile()
        fully_shard(block, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mp_policy=policy, reshard_after_forward=True)
    model.to_empty(device=device)
    torch.manual_seed(rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
        D = cfg.head_dim
        inv = cfg.rope_theta ** (-torch.arange(0, D, 2, dtype=torch.float64, device=device) / D)
        ang = torch.arange(cfg.context, dtype=torch.float64, device=device)[:, None] * inv[None, :]
        ang = torch.cat([ang, ang], dim=-1)[:, None, :]
        model.cos, model.sin = ang.cos().float(), ang.sin().float()
    decay = [p for n, p in model.named_parameters() if not n.endswith("norm")]
    plain = [p for n, p in model.named_parameters() if n.endswith("norm")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    generator = np.random.default_rng(1 + rank)
    x = torch.tensor(generator.integers(0, cfg.vocab_size, (args.batch_size, cfg.context)), device=device)
    y = torch.tensor(generator.integers(0, cfg.vocab_size, (cfg.mtp_heads, args.batch_size, cfg.context)),
                     device=device)

    step = training_step(model, model, opt, x, y, contextlib.nullcontext())  # FSDP's policy casts, no autocast
    losses = [step() for _ in range(args.warmup)]  # torch.compile compiles in the first
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - start)
    ms = 1e3 * float(np.median(times))
    if rank == 0:
        tokens = world * args.batch_size * cfg.context
        tps = tokens / (ms / 1e3)
        peak = None
        if gpu:
            try:
                from nanoeuler.model.gpu import peak_flops
                peak = peak_flops("bf16")
            except Exception:  # no cupy beside torch: MFU is left out
                peak = None
        print(json.dumps({"gpus": world, "ms": ms, "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / world,
                          "mfu": tps * flops_per_token(cfg) / (peak * world) if peak else None,
                          "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if gpu else None,
                          "params": param_count(cfg), "losses": [losses[0], losses[-1]]}), flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="base")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a published model's shape instead of a preset")
    ap.add_argument("--context", type=int, help="sequence length (default the model's)")
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--gpus", type=int, nargs="+", default=[2], help="numbers of GPUs (ranks), one run each")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--recompute", action="store_true", help="activation checkpointing of every layer")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help="cpu: gloo, to check the script")
    args = ap.parse_args()
    if "RANK" in os.environ:
        return rank_main(args)
    from reference import torchrun_rows
    rows = torchrun_rows(__file__, args.gpus, sys.argv[1:])
    cfg = config(args)
    print(f"PyTorch FSDP2{'' if args.no_compile else ' + torch.compile'}, {args.shape or args.preset} "
          f"({rows[0]['params'] / 1e6:,.1f}M parameters), {'bf16' if args.device == 'gpu' else 'fp32 on the CPU'}, "
          f"per-rank batch {args.batch_size} x {cfg.context}"
          f"{', recompute' * args.recompute}")
    print(f"{'GPUs':>4} {'ms/step':>9} {'tokens/s':>11} {'a GPU':>9} {'MFU':>6} {'peak GiB':>9} {'loss first/last':>16}")
    for row in rows:
        mfu = f"{row['mfu']:.1%}" if row["mfu"] else "-"
        peak = f"{row['peak_gib']:.2f}" if row["peak_gib"] is not None else "-"
        first, last = row["losses"]
        print(f"{row['gpus']:4d} {row['ms']:9.2f} {row['tokens_per_s']:11,.0f} {row['tokens_per_s_per_gpu']:9,.0f} "
              f"{mfu:>6} {peak:>9} {first:7.3f}/{last:.3f}")
    if not all(math.isfinite(v) for row in rows for v in row["losses"]):
        sys.exit("a loss is not finite")


if __name__ == "__main__":
    main()
