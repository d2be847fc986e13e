"""One training step of a preset on the GPU engine next to a PyTorch implementation of the same model.

Both run in this process on the same GPU, the same batch and the same initial weights, in the same
precision: float32 storage with TF32 tensor-core matmuls. The PyTorch model is the one of docs/design.md in
benchmarks/reference.py, with scaled_dot_product_attention (causal; k/v repeated over the query group as
Hugging Face's Llama does) and fused AdamW (weight decay on the matrices, as ours), run eagerly, compiled
with torch.compile, or both (`--pytorch`); our engine is CUDA kernels + cuBLAS (nanoeuler/gpu). A step is
forward, backward, gradient clipping and AdamW, ending with the loss on the host, as in training. Prints
ms/step, tokens/s, MFU (model FLOPs: 6 per parameter per token for the matmuls, plus causal attention,
6 * layers * dim * T; over the card's dense TF32 peak) and peak GPU memory (our CuPy memory pool's size,
which only grows; torch's peak allocation).

    PYTHONPATH=. python3 benchmarks/bench_gpu_train.py                  # base, T = 512, batch 16
    PYTHONPATH=. python3 benchmarks/bench_gpu_train.py --preset big --batch-size 32
    PYTHONPATH=. python3 benchmarks/bench_gpu_train.py --pytorch both    # PyTorch eager and torch.compile
"""
import argparse
import math
import time

import numpy as np

from nanoeuler.config import PRESETS, flops_per_token, init_params, param_count
from reference import Reference, batches


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


def bench_torch(cfg, inputs, targets, args, compiled=False):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.cuda.empty_cache()  # what an earlier PyTorch run left in the caching allocator
    model = Reference(cfg, init_params(cfg, 0), device="cuda", gqa="repeat")
    loss_fn = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    x = torch.tensor(inputs, device="cuda", dtype=torch.long)
    y = torch.tensor(targets, device="cuda", dtype=torch.long)
    torch.cuda.reset_peak_memory_stats()

    def step():
        loss = loss_fn(x, y)[0]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
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
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed steps before the timed ones (torch.compile compiles in the first)")
    ap.add_argument("--pytorch", choices=["eager", "compiled", "both"], default="eager",
                    help="the PyTorch side: eager, torch.compile, or one row of each (default eager)")
    args = ap.parse_args()
    from nanoeuler.gpu import device_name, peak_tf32_flops
    from nanoeuler.train import PRESET_HYPER

    cfg = PRESETS[args.preset]
    B = args.batch_size or PRESET_HYPER[args.preset].batch_size
    T = cfg.context
    inputs, targets = next(batches(cfg, B, seed=1))
    peak = peak_tf32_flops()
    print(f"{device_name()}: {args.preset} ({param_count(cfg) / 1e6:.1f}M params), batch {B} x T {T}, FP32 + TF32 "
          f"matmuls; {args.warmup} warm-up steps, median of {args.steps}; {flops_per_token(cfg) / 1e6:.0f} "
          f"MFLOP/token, TF32 peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s")
    import cupy
    rows = [("nanoeuler (CuPy + CUDA)", *bench_ours(cfg, inputs, targets, args))]
    cupy.get_default_memory_pool().free_all_blocks()  # hand our engine's memory back before torch runs
    if args.pytorch in ("eager", "both"):
        rows.append(("PyTorch eager + SDPA", *bench_torch(cfg, inputs, targets, args)))
    if args.pytorch in ("compiled", "both"):
        rows.append(("PyTorch compiled + SDPA", *bench_torch(cfg, inputs, targets, args, compiled=True)))
    print(f"{'engine':<26} {'ms/step':>8} {'best':>7} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'step-1 loss':>12}")
    for name, med, best, loss, mem in rows:
        tps = B * T / (med / 1e3)
        mfu = f"{100 * tps * flops_per_token(cfg) / peak:5.1f}%" if peak else "   n/a"
        print(f"{name:<26} {med:8.1f} {best:7.1f} {tps:10.0f} {mfu:>6} {mem / 2**30:9.2f} {loss:12.6f}")
    for name, med, _, loss, _ in rows[1:]:
        label = "PyTorch" if len(rows) == 2 else name.split(" + ")[0]
        print(f"throughput ours / {label}: {med / rows[0][1]:.2f}x; first-step losses differ by "
              f"{abs(rows[0][3] - loss):.1e} (same weights and batch)")
    assert math.isfinite(rows[0][3])


if __name__ == "__main__":
    main()
