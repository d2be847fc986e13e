"""PyTorch DistributedDataParallel on N GPUs against one GPU, for the same model: the peer of
`bench_multi_gpu.py`'s scaling without ZeRO (every rank holds every moment and takes the whole update).

The model is benchmarks/reference.py's (the model of docs/design.md), float32 weights under bf16 autocast,
torch.compile, fused AdamW (weight decay on the matrices), gradient clipping to 1.0, as nanoGPT trains; DDP
with its default 25 MiB buckets reduced beside the backward pass and `gradient_as_bucket_view`. Each rank
runs the per-rank batch (random token windows); a step ends with the loss on the host, as in training.
Prints, for 1 GPU and N GPUs, the median ms a step, the tokens/s of all ranks and the ratio.

    PYTHONPATH=. python3 benchmarks/bench_torch_ddp.py --preset base --batch-size 32 --gpus 2

Run without torchrun: it launches `torchrun --nproc-per-node G` itself for G = 1 and N.
"""
import argparse
import json
import os
import sys
import time

import numpy as np


def rank_main(args):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from nanoeuler.model.config import PRESETS, init_params
    from reference import Reference, batches, training_step

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = PRESETS[args.preset]
    model = Reference(cfg, init_params(cfg, 0), device="cuda", gqa="repeat")
    wrapped = DistributedDataParallel(model, device_ids=[local], gradient_as_bucket_view=True) if world > 1 else model
    loss_fn = torch.compile(wrapped)
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    inputs, targets = next(batches(cfg, args.batch_size, seed=1 + rank))
    x = torch.tensor(inputs, device="cuda", dtype=torch.long)
    y = torch.tensor(targets, device="cuda", dtype=torch.long)

    step = training_step(loss_fn, model, opt, x, y, torch.autocast("cuda", dtype=torch.bfloat16))
    for _ in range(args.warmup):  # torch.compile compiles in the first
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    ms = 1e3 * float(np.median(times))
    if rank == 0:
        tokens = world * args.batch_size * cfg.context
        print(json.dumps({"gpus": world, "ms": ms, "tokens_per_s": tokens / (ms / 1e3),
                          "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30}), flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="base")
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8)
    args = ap.parse_args()
    if "RANK" in os.environ:
        return rank_main(args)
    from reference import torchrun_rows
    rows = torchrun_rows(__file__, (1, args.gpus), sys.argv[1:])
    print(f"PyTorch DDP + torch.compile, {args.preset}, bf16 autocast, per-rank batch {args.batch_size}")
    print(f"{'GPUs':>4} {'ms/step':>8} {'tokens/s':>10} {'vs 1':>6} {'peak GiB':>9}")
    for row in rows:
        print(f"{row['gpus']:4d} {row['ms']:8.2f} {row['tokens_per_s']:10,.0f} "
              f"{row['tokens_per_s'] / rows[0]['tokens_per_s']:5.3f}x {row['peak_gib']:9.2f}")


if __name__ == "__main__":
    main()
