"""CPU training speed: nanoeuler's numba engine against PyTorch on the same model, batch and threads.

    pip install -e '.[bench]'              # PyTorch (CPU)
    python benchmarks/bench_cpu_train.py   # small preset, batch 16 x 128, all cores

Both sides run a full training step (forward, backward, gradient clipping, AdamW) of the `small` preset
from the same initial weights on the same batches; the first losses are printed side by side to show that
they compute the same model. PyTorch runs eagerly in float32 with scaled_dot_product_attention (the model
of docs/design.md, in benchmarks/reference.py). The two are timed in alternating rounds, so a change in
machine load hits both alike. Reported: the best round of each, and the median over rounds of the ratio
within a round (on a shared machine whose speed drifts, the steadier of the two).
Each timed round runs in a fresh process of its own (`--only`), as a user would run either one: in one
process, the thread pools of the other library (PyTorch's OpenMP, numba's workers) would stay around
and compete for the same cores.
"""
import nanoeuler  # first: it sets how numba's and OpenBLAS's thread pools behave before they load

import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import torch

from nanoeuler.model.config import PRESETS, init_params, param_count
from nanoeuler.model.engine import make_engine
from nanoeuler.model.optimizer import AdamW
from nanoeuler.model.losses import cross_entropy_backward
from reference import Reference, batches


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))  # cores we may run on
    ap.add_argument("--steps", type=int, default=10, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", choices=["nanoeuler", "pytorch"], help=argparse.SUPPRESS)  # one timed round
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    import numba
    numba.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    cfg, B = PRESETS[args.preset], args.batch_size
    flat = init_params(cfg, seed=0)
    lr, wd, clip = 1e-3, 0.1, 1.0

    eng = make_engine(cfg)
    optimizer = AdamW(eng)
    eng.load_params(flat)
    model = Reference(cfg, flat, split_matmuls=True)  # a matmul per weight, as separate Linear layers: faster here
    opt = torch.optim.AdamW(model.param_groups(wd), lr=lr, betas=(0.9, 0.95), eps=1e-8)

    def ours(inputs, targets):
        loss = cross_entropy_backward(eng, inputs, targets)[0]
        optimizer.step(eng, lr, wd, clip)
        return loss

    def theirs(inputs, targets):
        loss = model(torch.from_numpy(inputs).long(), torch.from_numpy(targets).long())[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        return loss.item()

    if args.only:
        fn = ours if args.only == "nanoeuler" else theirs
        fn(*next(batches(cfg, B, seed=1)))  # warm-up: compilation, thread pools, allocations
        data = list(batches(cfg, B, seed=100 + args.round, steps=args.steps))
        t = time.perf_counter()
        for inputs, targets in data:
            fn(inputs, targets)
        print(json.dumps(args.steps * B * cfg.context / (time.perf_counter() - t)))
        return
    print(f"{args.preset}: {param_count(cfg) / 1e6:.2f}M parameters, batch {B} x {cfg.context}, "
          f"{args.threads} threads, torch {torch.__version__}, numba {numba.__version__}")
    t0 = time.perf_counter()
    first = [(ours(*b), theirs(*b)) for b in batches(cfg, B, seed=1, steps=3)]
    print(f"warm-up (includes numba compilation unless cached): {time.perf_counter() - t0:.1f} s")
    for i, (a, b) in enumerate(first):
        print(f"  step {i + 1} loss: nanoeuler {a:.6f}  pytorch {b:.6f}")
    assert all(math.isclose(a, b, rel_tol=1e-3) for a, b in first), "the two models disagree"

    best = {"nanoeuler": 0.0, "pytorch": 0.0}
    ratios = []
    for r in range(args.rounds):
        tps_round = {}
        for name in best:
            cmd = [sys.executable, __file__, "--only", name, "--preset", args.preset, "--batch-size", str(B),
                   "--threads", str(args.threads), "--steps", str(args.steps), "--round", str(r)]
            tps = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            best[name] = max(best[name], tps)
            tps_round[name] = tps
            print(f"  round {r + 1} {name:9s}: {tps:9,.0f} tokens/s")
        ratios.append(tps_round["nanoeuler"] / tps_round["pytorch"])
    print(f"nanoeuler {best['nanoeuler']:,.0f} tokens/s, pytorch {best['pytorch']:,.0f} tokens/s (best rounds): "
          f"ratio {best['nanoeuler'] / best['pytorch']:.2f}x; median ratio within a round {np.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
