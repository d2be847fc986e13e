"""A published model's shape (Llama-3-8B's by default) fully fine-tuned across GPUs with ZeRO, through the
command line a user runs, beside PyTorch FSDP2 + torch.compile on the same shape and per-rank batch, in one run.

A checkpoint of random weights of the shape (shape_checkpoint.py) is trained by `nanoeuler train --ckpt` with
`--recompute layer` (the whole layer recomputed, as FSDP2's activation checkpointing does) on each number of GPUs and ZeRO stage asked, for --steps steps of --batch-size sequences a rank;
its metrics log gives the median tokens/s and MFU of the steps after --warmup and CuPy's pool on rank 0, and
nvidia-smi's memory in use, sampled every second, each GPU's peak (what a card must hold, the CUDA context
included). A run is stopped (its launcher and ranks killed) once its last measured step is logged: its closing
evaluation and final checkpoint (96 GB for an 8B model with its moments) are not what is measured. Then
bench_torch_fsdp.py on the same shape, context, per-rank batch and numbers of GPUs prints its own table.

    PYTHONPATH=. python3 benchmarks/bench_zero_shape.py --tokenizer tok.json --gpus 2 4 --zero 2 3
    PYTHONPATH=. python3 benchmarks/bench_zero_shape.py --tokenizer tok.json --shape smollm2-135m --context 128 \
        --gpus 2 --device cpu --steps 3 --warmup 1 --no-peer        # the script checked on CPU ranks

The checkpoint (4 bytes a parameter: 32 GB for Llama-3-8B) goes to --work (default a temporary folder), with
room for it; each rank reads its shard of it alone (ZeRO-2/3).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from repo_env import ROOT, log, repo_env
from shape_checkpoint import save_shape_checkpoint

from nanoeuler.tokenizer.bpe import Tokenizer


class GpuMemory:
    """Each GPU's peak memory in use (MiB, nvidia-smi) while it runs, sampled every second; nothing where not
    `sampled` (CPU ranks)."""

    def __init__(self, sampled=True):
        self.peak, self._stop = {}, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True) if sampled else None

    def __enter__(self):
        if self._thread:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join()

    def _sample(self):
        while not self._stop.is_set():
            done = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True)
            for line in done.stdout.strip().splitlines():
                gpu, mib = (int(v) for v in line.split(","))
                self.peak[gpu] = max(self.peak.get(gpu, 0), mib)
            self._stop.wait(1.0)


def records(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train(args, ckpt, gpus, zero, work):
    """One `nanoeuler train --ckpt` run, stopped once step --steps - 1 is logged; (its step records, peaks)."""
    out = os.path.join(work, f"run_{gpus}_{zero}.bin")  # unique: what the run's processes are found by
    metrics = out[:-4] + ".jsonl"
    command = [sys.executable, "-m", "nanoeuler", "train", "--ckpt", ckpt, "--data", args.data, "--out", out,
               "--overwrite", "--device", args.device, "--precision", args.precision, "--batch-size",
               str(args.batch_size), "--grad-accum", "1", "--recompute", "layer", "--steps", str(args.steps),
               "--eval-every", "1000000", "--sample-every", "1000000", "--ckpt-every", "1000000"]
    if gpus > 1:
        command += ["--gpus", str(gpus), "--zero", str(zero)]
    log(" ".join(command[2:]))
    last = args.steps - 1  # the last step's record comes after the closing evaluation: not waited for
    deadline = time.time() + args.timeout
    with open(out[:-4] + ".err", "w") as err, GpuMemory(args.device == "gpu") as memory:
        proc = subprocess.Popen(command, cwd=ROOT, env=repo_env(), stdout=subprocess.DEVNULL, stderr=err)
        while proc.poll() is None and time.time() < deadline:
            stepped = [r for r in records(metrics) if "tokens_per_s" in r]
            if stepped and stepped[-1]["step"] >= last:
                break
            time.sleep(1.0)
        # the ranks run in sessions of their own: each process of this run is found by its --out
        subprocess.run(["pkill", "-9", "-f", out])
        proc.wait()
    stepped = [r for r in records(metrics) if "tokens_per_s" in r]
    if not stepped:
        with open(out[:-4] + ".err") as f:
            log(f"no step logged; the run's stderr ends:\n{f.read()[-2000:]}")
    return stepped, memory.peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--tokenizer", required=True, help="a tokenizer.json (`nanoeuler tokenizer train` writes one)")
    ap.add_argument("--data", default="shakespeare.txt")
    ap.add_argument("--gpus", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--zero", type=int, nargs="+", choices=(1, 2, 3), default=[3])
    ap.add_argument("--batch-size", type=int, default=2, help="sequences a rank (default 2)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4, help="steps left out of the median")
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--precision", help="default bf16 on the GPU, fp32 on the CPU")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a run may take (default 600)")
    ap.add_argument("--work", help="where the checkpoint and the runs' logs go (default a temporary folder)")
    ap.add_argument("--no-peer", action="store_true", help="skip PyTorch FSDP2")
    args = ap.parse_args()
    args.precision = args.precision or ("bf16" if args.device == "gpu" else "fp32")
    if args.steps <= args.warmup + 1:
        sys.exit("--steps must exceed --warmup + 1 (the last step is not waited for)")
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        ckpt = os.path.join(work, f"{args.shape}.bin")
        t0 = time.time()
        cfg = save_shape_checkpoint(ckpt, args.shape, Tokenizer.load(args.tokenizer).to_json(), args.context)
        log(f"{ckpt}: {args.shape}, context {cfg.context}, random weights, in {time.time() - t0:.0f} s")
        rows = []
        for gpus in args.gpus:
            for zero in args.zero:
                stepped, peak = train(args, ckpt, gpus, zero, work)
                body = stepped[args.warmup:] or stepped
                if not body:
                    continue
                tps = statistics.median(r["tokens_per_s"] for r in body)
                mfu = statistics.median(r.get("mfu", 0) for r in body)
                pool = max(r.get("gpu_mem_gib", 0) for r in stepped)
                used = max(peak.values()) / 1024 if peak else None
                rows.append((gpus, zero, tps, mfu, pool, used, len(stepped), stepped[0]["loss"], stepped[-1]["loss"]))
                log(f"{gpus} GPUs ZeRO-{zero}: {tps:,.0f} tokens/s, MFU {mfu:.1%}, rank 0's pool {pool:.2f} GiB"
                    + ("" if used is None else f", the most in use on a GPU {used:.2f} GiB"))
    print(f"\nnanoeuler train --ckpt ({args.shape}, random weights), {args.precision}, --recompute layer, "
          f"{args.batch_size} x {args.context} a rank; medians of steps {args.warmup + 1}-{args.steps - 1}")
    print("| GPUs | ZeRO | tokens/s (all) | a GPU | MFU a GPU | rank 0's pool (GiB) | peak in use a GPU (GiB) "
          "| steps | loss first / last |")
    print("|---|---|---|---|---|---|---|---|---|")
    for gpus, zero, tps, mfu, pool, used, steps, first, last in rows:
        print(f"| {gpus} | {zero} | {tps:,.0f} | {tps / gpus:,.0f} | {mfu:.1%} | {pool:.2f} | "
              f"{'-' if used is None else f'{used:.2f}'} | {steps} | {first:.3f} / {last:.3f} |")
    if not args.no_peer:
        peer = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_torch_fsdp.py"), "--shape", args.shape,
                "--context", str(args.context), "--batch-size", str(args.batch_size), "--recompute",
                "--steps", str(args.steps), "--warmup", str(args.warmup), "--gpus", *map(str, args.gpus)]
        if args.device == "cpu":
            peer += ["--device", "cpu", "--no-compile"]
        print(flush=True)
        subprocess.run(peer, cwd=ROOT, env=repo_env())
    if len(rows) < len(args.gpus) * len(args.zero):
        sys.exit("a run logged no step (above)")


if __name__ == "__main__":
    main()
