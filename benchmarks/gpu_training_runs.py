"""The GPU training runs behind the bf16 engine's claims, through the real `nanoeuler train` command:

1. quality: `big` for 1,000 steps on shakespeare.txt from one seed in bf16 and in fp32; the final held-out
   bits/byte of each and one PNG with both validation curves;
2. determinism: two bf16 runs of 100 steps from one seed, and one stopped by Ctrl-C (SIGINT) at step ~50 and
   resumed: the losses of all three compared bit for bit;
3. gradient accumulation: `large` for 20 steps as 4 passes of 4 and as one pass of 16 from one seed: the
   largest loss difference, tokens/s and peak GPU memory of each.

    PYTHONPATH=. python3 benchmarks/gpu_training_runs.py --out runs/     # writes logs, PNG, a summary
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time


def train(out_dir, name, *args, interrupt_at=None):
    """Run `nanoeuler train ARGS --out out_dir/name.bin`; returns the metrics log's records. With interrupt_at,
    send SIGINT once the log reaches that step, then continue with --resume."""
    ckpt = os.path.join(out_dir, f"{name}.bin")
    cmd = [sys.executable, "-m", "nanoeuler", "train", *map(str, args), "--out", ckpt, "--device", "gpu"]
    log_path = os.path.join(out_dir, f"{name}.jsonl")
    with open(os.path.join(out_dir, f"{name}.out"), "w") as console:
        proc = subprocess.Popen(cmd, stdout=console, stderr=subprocess.STDOUT)
        while interrupt_at and proc.poll() is None:
            if os.path.exists(log_path) and len(open(log_path).readlines()) >= interrupt_at:
                proc.send_signal(signal.SIGINT)
                break
            time.sleep(0.05)
        proc.wait()
        if interrupt_at:
            assert proc.returncode == 130, f"{name}: exit {proc.returncode} after SIGINT"
            proc = subprocess.run([sys.executable, "-m", "nanoeuler", "train", "--resume", "--out", ckpt,
                                   "--device", "gpu"], stdout=console, stderr=subprocess.STDOUT)
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}, see {name}.out"
    with open(log_path) as f:
        return [json.loads(line) for line in f]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs")
    ap.add_argument("--only", choices=("quality", "determinism", "accumulation"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    summary = {}

    if args.only in (None, "quality"):
        curves = {}
        for precision in ("bf16", "fp32"):
            log = train(args.out, f"big_{precision}", "big", "--steps", 1000, "--eval-every", 100,
                        "--sample-every", 1000, "--ckpt-every", 1000, "--seed", 1, "--precision", precision)
            curves[precision] = [(r["step"], r["val_bpb"]) for r in log if "val_bpb" in r]
            summary[f"big {precision} final val bits/byte"] = curves[precision][-1][1]
            summary[f"big {precision} tokens/s (median)"] = sorted(r["tokens_per_s"] for r in log)[len(log) // 2]
        summary["big |bf16 - fp32| final val bits/byte"] = abs(curves["bf16"][-1][1] - curves["fp32"][-1][1])
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for precision, curve in curves.items():
            ax.plot(*zip(*curve), marker="o", ms=3, label=f"{precision}: final {curve[-1][1]:.4f}")
        ax.set(xlabel="step", ylabel="validation bits/byte", title="big on shakespeare.txt, seed 1: bf16 vs fp32")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "bf16_vs_fp32.png"), dpi=120)

    if args.only in (None, "determinism"):
        common = ("big", "--steps", 100, "--eval-every", 50, "--sample-every", 100, "--ckpt-every", 20, "--seed", 2)
        runs = [train(args.out, "det_a", *common), train(args.out, "det_b", *common),
                train(args.out, "det_c", *common, interrupt_at=50)]
        losses = [[r["loss_all_heads"] for r in run] for run in runs]
        summary["bf16 runs a, b identical losses"] = losses[0] == losses[1]
        summary["bf16 run c (Ctrl-C, --resume) identical to a"] = losses[0] == losses[2]
        summary["determinism steps"] = [len(x) for x in losses]

    if args.only in (None, "accumulation"):
        common = ("large", "--data", "shakespeare.txt", "--steps", 20, "--eval-every", 20, "--sample-every", 20,
                  "--ckpt-every", 20, "--seed", 3, "--precision", "bf16")
        logs = {n: train(args.out, f"large_{n}", *common, *flags)
                for n, flags in (("4x4", ("--batch-size", 4, "--grad-accum", 4)),
                                 ("16x1", ("--batch-size", 16, "--grad-accum", 1)))}
        a, b = ([r["loss_all_heads"] for r in logs[n]] for n in ("4x4", "16x1"))
        summary["large 4x4 vs 16x1 max |loss diff|"] = max(abs(x - y) for x, y in zip(a, b))
        summary["large losses 4x4 (first, last)"] = (a[0], a[-1])
        summary["large losses 16x1 (first, last)"] = (b[0], b[-1])
        for n, log in logs.items():
            summary[f"large {n} tokens/s (median of steps 5+)"] = sorted(r["tokens_per_s"] for r in log[4:])[
                len(log[4:]) // 2]
            summary[f"large {n} peak GPU memory GiB"] = max(r.get("gpu_mem_gib", 0) for r in log)

    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for k, v in summary.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
