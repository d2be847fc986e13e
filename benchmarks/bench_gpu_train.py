"""One training step of a preset on the GPU engine next to PyTorch training the same model, in one run.

Both run in this process on the same GPU, the same batch and the same initial weights. In bf16 (the default)
ours keeps float32 master weights, gradients and moments and computes on bf16 weights and activations; PyTorch
runs as nanoGPT does: float32 weights under `torch.autocast(dtype=torch.bfloat16)`, eagerly and with
torch.compile. In tf32 both keep float32 everything with TF32 tensor-core matmuls. The PyTorch model is the
one of docs/design.md in benchmarks/reference.py, with scaled_dot_product_attention (causal; k/v repeated over
the query group as Hugging Face's Llama does) and fused AdamW (weight decay on the matrices, as ours). A step
is forward, backward, gradient clipping and AdamW, ending with the loss on the host, as in training. Prints
ms/step, tokens/s, MFU (model FLOPs: 6 per parameter per token for the matmuls, plus causal attention,
6 * layers * dim * T; over the card's dense bf16 or TF32 peak) and peak GPU memory (our CuPy memory pool's
size, which only grows; torch's peak allocation), for each batch size.

    PYTHONPATH=. python3 benchmarks/bench_gpu_train.py                        # base, T = 512, batch 16 and 32
    PYTHONPATH=. python3 benchmarks/bench_gpu_train.py --precision tf32 --pytorch eager
    PYTHONPATH=. python3 benchmarks/bench_gpu_train.py --preset big --batch-sizes 32
    PYTHONPATH=. python3 benchmarks/bench_gpu_train.py --shape llama3.2-1b --context 1024 --batch-sizes 8 16

--shape NAME: a published model's shape (benchmarks/shapes.py) instead of a preset, at --context T (default
1024); the PyTorch model is the same Reference (tied head, Qwen's biases; its RoPE unscaled, which costs the
same).
"""
import argparse
import dataclasses
import math
import time

import numpy as np

from nanoeuler.model.config import PRESETS, flops_per_token, init_params, param_count
from nanoeuler.model.optimizer import AdamW
from nanoeuler.model.losses import cross_entropy_backward
from reference import Reference, batches, training_step
from shapes import SHAPES


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
    from nanoeuler.model.engine import make_engine

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    eng = make_engine(cfg, device="gpu", seed=0, precision=args.precision)
    opt = AdamW(eng)

    def step():
        loss = cross_entropy_backward(eng, inputs, targets)[0]
        opt.step(eng, lr=1e-4, weight_decay=0.1, grad_clip=1.0)
        return loss

    med, best, loss = time_steps(step, cupy.cuda.Device().synchronize, args.warmup, args.steps)
    mem = pool.total_bytes()
    del eng
    pool.free_all_blocks()  # hand our engine's memory back before torch runs
    return med, best, loss, mem


def bench_torch(cfg, inputs, targets, args, compiled=False):
    import contextlib
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.cuda.empty_cache()  # what an earlier PyTorch run left in the caching allocator
    model = Reference(cfg, init_params(cfg, 0), device="cuda", gqa="repeat")
    loss_fn = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    x = torch.tensor(inputs, device="cuda", dtype=torch.long)
    y = torch.tensor(targets, device="cuda", dtype=torch.long)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if args.precision == "bf16"
                else contextlib.nullcontext())
    torch.cuda.reset_peak_memory_stats()

    step = training_step(loss_fn, model, opt, x, y, autocast)
    med, best, loss = time_steps(step, torch.cuda.synchronize, args.warmup, args.steps)
    mem = torch.cuda.max_memory_allocated()
    del model, loss_fn, opt
    torch.cuda.empty_cache()
    return med, best, loss, mem


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="base", choices=sorted(PRESETS))
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a published model's shape instead of a preset")
    ap.add_argument("--context", type=int, help="sequence length T (default: the preset's; 1024 with --shape)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--precision", choices=["bf16", "tf32"], default="bf16")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed steps before the timed ones (torch.compile compiles in the first)")
    ap.add_argument("--pytorch", choices=["eager", "compiled", "both"], default="both",
                    help="the PyTorch side: eager, torch.compile, or one row of each (default both)")
    args = ap.parse_args()
    from nanoeuler.model.gpu import device_name, peak_flops

    cfg = SHAPES[args.shape] if args.shape else PRESETS[args.preset]
    cfg = dataclasses.replace(cfg, context=args.context or (1024 if args.shape else cfg.context))
    args.preset = args.shape or args.preset
    T = cfg.context
    peak = peak_flops(args.precision)
    what = "bf16 (ours: float32 master weights; PyTorch: autocast)" if args.precision == "bf16" else "FP32 + TF32 matmuls"
    print(f"{device_name()}: {args.preset} ({param_count(cfg) / 1e6:.1f}M params), T {T}, {what}; {args.warmup} "
          f"warm-up steps, median of {args.steps}; {flops_per_token(cfg) / 1e6:.0f} MFLOP/token, "
          f"{args.precision} dense peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s")
    print(f"{'engine':<30} {'batch':>5} {'ms/step':>8} {'best':>7} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} "
          f"{'step-1 loss':>12} {'ours/this':>9}")
    for B in args.batch_sizes:
        inputs, targets = next(batches(cfg, B, seed=1))
        rows = [("nanoeuler (CuPy + CUDA)", *bench_ours(cfg, inputs, targets, args))]
        if args.pytorch in ("eager", "both"):
            rows.append(("PyTorch eager + SDPA", *bench_torch(cfg, inputs, targets, args)))
        if args.pytorch in ("compiled", "both"):
            rows.append(("PyTorch torch.compile + SDPA", *bench_torch(cfg, inputs, targets, args, compiled=True)))
        for name, med, best, loss, mem in rows:
            tps = B * T / (med / 1e3)
            mfu = f"{100 * tps * flops_per_token(cfg) / peak:5.1f}%" if peak else "   n/a"
            print(f"{name:<30} {B:5d} {med:8.1f} {best:7.1f} {tps:10.0f} {mfu:>6} {mem / 2**30:9.2f} {loss:12.6f} "
                  f"{med / rows[0][1]:8.2f}x", flush=True)
        assert math.isfinite(rows[0][3])


if __name__ == "__main__":
    main()
