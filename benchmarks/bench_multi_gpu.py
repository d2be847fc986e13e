"""Data-parallel training on N GPUs against one GPU, through the command line a user runs, in one run.

Each configuration is a real `nanoeuler train PRESET` (one GPU, or `--gpus N` with each `--zero` stage asked) of
a few hundred steps on the same corpus and tokenizer; its metrics log gives the median tokens/s over the
steps after the warm-up (all ranks together) and the GPU memory of rank 0 (CuPy's pool at its high-water mark,
plus the copy engines' allocation). Prints each configuration's tokens/s, its ratio to one GPU at the same per-rank
batch, that ratio over the number of GPUs (the scaling efficiency), and its memory; with --nccl, each multi-GPU
configuration also with NCCL's reduce-scatter in place of the copy engines'; --reductions copy nccl chooses
them one by one. --repeats R runs every configuration R times, round after round, and reports the medians and
the spread of the rounds' ratios.

    PYTHONPATH=. python3 benchmarks/bench_multi_gpu.py --data shakespeare.txt --tokenizer tok.json
    PYTHONPATH=. python3 benchmarks/bench_multi_gpu.py --presets base large --batch-sizes 16 32 --gpus 2 4 --nccl
    PYTHONPATH=. python3 benchmarks/bench_multi_gpu.py --presets large --batch-sizes 32 --zero 1 2 3
    PYTHONPATH=. python3 benchmarks/bench_multi_gpu.py --equivalence 100 --precision fp32   # losses, 2x16 vs 1x32

--equivalence STEPS instead trains one GPU at batch 2B, one GPU at batch B in 2 accumulation passes, and
N GPUs at batch B (once per --zero stage) from one seed, and prints the loss curves' largest relative
differences. ZeRO-2 and 3 reduce through NCCL whatever NANOEULER_REDUCE says.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def train(args, preset, batch, gpus, zero, steps, extra=(), out_dir=None, name="run", reduce="copy"):
    """One `nanoeuler train` run (NANOEULER_REDUCE=reduce); its metrics log's records."""
    out = os.path.join(out_dir, f"{name}.bin")
    command = [sys.executable, "-m", "nanoeuler", "train", preset, "--device", "gpu", "--data", args.data,
               "--steps", str(steps), "--batch-size", str(batch), "--grad-accum", "1", "--eval-every", "100000",
               "--sample-every", "100000", "--ckpt-every", "100000", "--out", out, "--overwrite",
               "--precision", args.precision, *extra]
    if args.tokenizer:
        command += ["--tokenizer", args.tokenizer]
    if gpus > 1:
        command += ["--gpus", str(gpus), "--zero", str(zero)]
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, NANOEULER_REDUCE=reduce))
    if done.returncode:  # said, and the other configurations still run
        print(f"FAILED: {' '.join(command)}:\n{done.stderr[-1500:]}", flush=True)
        return None
    with open(os.path.join(out_dir, f"{name}.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def speed(args, out_dir):
    rows = []
    reductions = list(dict.fromkeys(args.reductions + (["nccl"] if args.nccl else [])))
    for preset in args.presets:
        for batch in args.batch_sizes:
            runs = [(1, 0, "-")] + [(g, z, r) for g in args.gpus for z in args.zero for r in reductions]
            measured = {run: {} for run in runs}  # round -> (tokens/s, MFU, GiB)
            for repeat in range(args.repeats):  # round after round, so that drift touches every configuration
                for gpus, zero, reduce in runs:
                    log = train(args, preset, batch, gpus, zero, args.steps, out_dir=out_dir,
                                name=f"{preset}_{batch}_{gpus}_{int(zero)}_{reduce}", reduce=reduce)
                    if log is None:
                        continue
                    steps = [r for r in log if "tokens_per_s" in r][args.warmup:]
                    tps = statistics.median(r["tokens_per_s"] for r in steps)
                    mfu = statistics.median(r.get("mfu", 0) for r in steps)
                    mem = max(r.get("gpu_mem_gib", 0) for r in log)
                    measured[gpus, zero, reduce][repeat] = (tps, mfu, mem)
                    print(f"{preset} batch {batch} x {gpus} GPU {zero_name(zero)} {reduce} (round "
                          f"{repeat + 1}): {tps:,.0f} tokens/s, MFU {mfu:.1%} a GPU, {mem:.2f} GiB", flush=True)
            one = {repeat: tps for repeat, (tps, _, _) in measured[runs[0]].items()}
            for (gpus, zero, reduce), results in measured.items():
                if not results or not one:
                    continue
                tps = statistics.median(t for t, _, _ in results.values())
                ratio = tps / statistics.median(one.values())
                # each round's ratio to that round's one GPU: the spread a single run would show
                rounds = [t / one[repeat] for repeat, (t, _, _) in results.items() if repeat in one]
                rows.append((preset, batch, gpus, zero_name(zero), reduce, tps, ratio, ratio / gpus,
                             statistics.median(m for _, m, _ in results.values()),
                             max(g for _, _, g in results.values()),
                             f"{min(rounds):.3f}-{max(rounds):.3f}x" if len(rounds) > 1 else "-"))
    print(f"\n{args.repeats} round(s); tokens/s: the median of the rounds' medians; vs 1 GPU: that over one GPU's; "
          "each round's ratio to its own one-GPU run in the last column")
    print("| preset | per-rank batch | GPUs | ZeRO | reduction | tokens/s (all GPUs) | vs 1 GPU | scaling efficiency "
          "| MFU a GPU | GPU memory (GiB) | rounds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for preset, batch, gpus, zero, reduce, tps, ratio, efficiency, mfu, mem, spread in rows:
        print(f"| {preset} | {batch} | {gpus} | {zero} | {reduce} | {tps:,.0f} | {ratio:.3f}x | {efficiency:.1%} "
              f"| {mfu:.1%} | {mem:.2f} | {spread} |")


def zero_name(stage):
    return f"zero{stage}" if stage else "-"


def equivalence(args, out_dir):
    """Losses of N GPUs x B against one GPU x N*B and one GPU x (N passes of B) from one seed."""
    preset, batch, n, steps = args.presets[0], args.batch_sizes[0], args.gpus[0], args.equivalence
    extra = ["--eval-every", str(args.eval_every)] if args.eval_every else []
    runs = {
        f"1 GPU x {n * batch}": train(args, preset, n * batch, 1, 0, steps, extra, out_dir, "one"),
        f"1 GPU x ({n} passes of {batch})": train(args, preset, batch, 1, 0, steps,
                                                  extra + ["--grad-accum", str(n)], out_dir, "accum"),
    }
    for stage in args.zero:
        runs[f"{n} GPUs x {batch} {zero_name(stage)}"] = train(args, preset, batch, n, stage, steps, extra, out_dir,
                                                              f"ranks{stage}")
    curves = {name: [r["loss"] for r in log if "loss" in r and "step" in r] for name, log in runs.items()}
    vals = {name: [(r["step"], r["val_loss"]) for r in log if "val_loss" in r] for name, log in runs.items()}
    names = list(curves)
    ref = curves[names[0]]
    for name in names:
        curve = curves[name]
        rel = [abs(a - b) / abs(b) for a, b in zip(curve, ref)]
        first = next((i + 1 for i, r in enumerate(rel) if r > 1e-6), None)
        print(f"{name}: loss at step 1 {curve[0]:.6f}, step {len(curve)} {curve[-1]:.6f}; largest relative "
              f"difference to {names[0]} {max(rel):.2e}, first above 1e-6 at step {first}; val {vals[name][-1:]}")
    acc = curves[names[1]]
    for name in names[2:]:
        rel = max(abs(a - b) / abs(b) for a, b in zip(curves[name], acc))
        print(f"{name} against {names[1]}: largest relative difference {rel:.2e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="shakespeare.txt")
    parser.add_argument("--tokenizer", help="a tokenizer.json (default: each run learns one)")
    parser.add_argument("--presets", nargs="+", default=["base"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--gpus", type=int, nargs="+", default=[2], help="numbers of GPUs, each against one")
    parser.add_argument("--reductions", nargs="+", choices=["copy", "nccl"], default=["copy"],
                        help="NANOEULER_REDUCE of each multi-GPU run: the copy engines or NCCL's kernels "
                             "(default copy)")
    parser.add_argument("--nccl", action="store_true",
                        help="each multi-GPU run also with NCCL reduce-scatter (NANOEULER_REDUCE=nccl)")
    parser.add_argument("--zero", type=int, nargs="+", choices=(0, 1, 2, 3), default=[0, 1],
                        help="the ZeRO stages of the multi-GPU runs (default 0 1)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=30, help="steps left out of the median")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of every configuration, one after another (the ratios vary by about 1%% "
                             "from run to run)")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--equivalence", type=int, metavar="STEPS", help="compare loss curves instead of speed")
    parser.add_argument("--eval-every", type=int, help="with --equivalence: validation every N steps")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out_dir:
        (equivalence if args.equivalence else speed)(args, out_dir)


if __name__ == "__main__":
    main()
