"""The first training steps of a preset on the CPU engine and on the GPU engine, from the same initial
weights, on the same batches, with the same AdamW steps: the two loss columns agree to TF32 tolerance (the
GPU engine trains here with TF32 matmuls and attention, `--precision tf32`; the CPU engine in float32).

Batches are random windows of a text file's bytes used directly as token ids (every preset's vocabulary
has the 256 byte tokens first), so no tokenizer is needed.

    PYTHONPATH=. python3 benchmarks/gpu_cpu_losses.py                       # big, 5 steps, batch 8
    PYTHONPATH=. python3 benchmarks/gpu_cpu_losses.py --steps 300 --gpu-only --every 25   # loss falls
"""
import argparse
import time

import numpy as np

from nanoeuler.model.config import PRESETS
from nanoeuler.model.engine import make_engine
from nanoeuler.model.optimizer import AdamW
from nanoeuler.model.losses import cross_entropy_backward
from reference import batches


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="big", choices=sorted(PRESETS))
    ap.add_argument("--data", default="shakespeare.txt")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--every", type=int, default=1, help="print every N steps")
    ap.add_argument("--gpu-only", action="store_true", help="skip the CPU engine (long runs)")
    ap.add_argument("--precision", default="tf32", choices=("bf16", "tf32", "fp32"),
                    help="the GPU engine's (default tf32; the CPU engine computes in float32)")
    args = ap.parse_args()
    cfg = PRESETS[args.preset]
    engines = {"gpu": make_engine(cfg, device="gpu", seed=0, precision=args.precision)}
    if not args.gpu_only:
        engines["cpu"] = make_engine(cfg, device="cpu", seed=0)
    optimizers = {name: AdamW(eng) for name, eng in engines.items()}
    print(f"{args.preset}: batch {args.batch_size} x {cfg.context} of {args.data} bytes, GPU {args.precision}, "
          f"lr {args.lr}, AdamW, clip 1.0; head-0 loss (nats/token)")
    print(f"{'step':>5} {'gpu loss':>10}" + ("" if args.gpu_only else f" {'cpu loss':>10} {'rel diff':>9}"))
    t0, worst = time.time(), 0.0
    data = np.fromfile(args.data, dtype=np.uint8)
    for step, (inputs, targets) in enumerate(batches(cfg, args.batch_size, seed=0, steps=args.steps, tokens=data), 1):
        losses = {}
        for name, eng in engines.items():
            losses[name] = cross_entropy_backward(eng, inputs, targets)[1]
            optimizers[name].step(eng, lr=args.lr, weight_decay=0.1, grad_clip=1.0)
        if step % args.every == 0 or step == 1:
            line = f"{step:5d} {losses['gpu']:10.5f}"
            if "cpu" in losses:
                diff = abs(losses["gpu"] - losses["cpu"]) / losses["cpu"]
                worst = max(worst, diff)
                line += f" {losses['cpu']:10.5f} {diff:9.1e}"
            print(line, flush=True)
    print(f"{args.steps} steps in {time.time() - t0:.0f} s" + ("" if args.gpu_only else f"; max rel diff {worst:.1e}"))


if __name__ == "__main__":
    main()
