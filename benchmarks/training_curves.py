"""The CPU training curves of a short pretraining, SFT and DPO run, written as their metrics logs without the
fields that measure time, so that two versions of the code can be compared record for record.

    python benchmarks/training_curves.py OUT_DIR                 # runs the three stages, writes OUT_DIR/*.jsonl
    python benchmarks/training_curves.py --compare DIR_A DIR_B   # exit 1 at the first difference: records,
                                                                 # or the checkpoints' weights and moments

The runs: `nanoeuler train small` on the first 600 KB of shakespeare.txt for 60 steps (the small preset, its
own tokenizer), `nanoeuler sft` of it on tests/data/sft_greetings.json for 30 steps, `nanoeuler dpo` of that on
pairs whose chosen reply starts "Sure! " for 20 steps, each with a checkpoint, an evaluation and a sample on
the way and an interrupted-and-resumed twin of the DPO run, all on the CPU engine (bitwise deterministic).
"""
import argparse
import json
import os
import subprocess
import sys

from repo_env import repo_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = {"tokens_per_s", "time_s", "tokens_per_s_per_gpu", "mfu", "gpu_mem_gib"}
NAMES = ["Romeo", "Juliet", "Hamlet", "Ophelia", "Lear", "Cordelia", "Macbeth", "Banquo", "Othello", "Iago",
         "Portia", "Viola", "Rosalind", "Puck", "Oberon", "Titania"]


def nanoeuler(*argv, cwd):
    subprocess.run([sys.executable, "-m", "nanoeuler", *map(str, argv)], cwd=cwd, check=True,
                   env=repo_env(), stdout=subprocess.DEVNULL)


def run(out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(ROOT, "shakespeare.txt"), "rb") as f:
        text = f.read(600_000)
    with open(os.path.join(out, "corpus.txt"), "wb") as f:
        f.write(text)
    with open(os.path.join(ROOT, "tests/data/sft_greetings.json"), "rb") as f:
        examples = f.read()
    with open(os.path.join(out, "greetings.json"), "wb") as f:
        f.write(examples)
    with open(os.path.join(out, "prefs.jsonl"), "w") as f:
        f.writelines(json.dumps({"prompt": f"Greet {n}.", "chosen": f"Sure! Hello, {n}!",
                                 "rejected": f"Hello, {n}!"}) + "\n" for n in NAMES)
    cpu = ("--device", "cpu")
    nanoeuler("train", "small", "--data", "corpus.txt", "--steps", 60, "--eval-every", 20, "--sample-every", 30,
              "--ckpt-every", 25, "--out", "base.bin", *cpu, cwd=out)
    nanoeuler("sft", "--ckpt", "base.bin", "--data", "greetings.json",
              "--steps", 30, "--batch-size", 8, "--eval-every", 10, "--sample-every", 15, "--ckpt-every", 20,
              "--val-examples", 4, "--out", "chat.bin", *cpu, cwd=out)
    nanoeuler("dpo", "--ckpt", "chat.bin", "--data", "prefs.jsonl", "--steps", 20, "--batch-size", 4,
              "--eval-every", 5, "--sample-every", 10, "--ckpt-every", 8, "--val-pairs", 4, "--out", "dpo.bin",
              *cpu, cwd=out)
    # the same DPO run stopped at its checkpoint of step 8 (a shorter run) and resumed to the end
    nanoeuler("dpo", "--ckpt", "chat.bin", "--data", "prefs.jsonl", "--steps", 8, "--batch-size", 4,
              "--eval-every", 5, "--sample-every", 10, "--ckpt-every", 8, "--val-pairs", 4, "--out", "dpo2.bin",
              *cpu, cwd=out)
    nanoeuler("dpo", "--resume", "--steps", 20, "--out", "dpo2.bin", *cpu, cwd=out)
    for name in ("base", "chat", "dpo", "dpo2"):
        with open(os.path.join(out, f"{name}.jsonl")) as f:
            records = [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]
        with open(os.path.join(out, f"{name}.curve.jsonl"), "w") as f:
            f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in records)


def compare(a, b):
    import numpy as np

    sys.path.insert(0, ROOT)
    from nanoeuler.io import checkpoint
    for name in ("base", "chat", "dpo", "dpo2"):
        with open(os.path.join(a, f"{name}.curve.jsonl")) as f:
            left = f.read().splitlines()
        with open(os.path.join(b, f"{name}.curve.jsonl")) as f:
            right = f.read().splitlines()
        for i, (x, y) in enumerate(zip(left, right)):
            if x != y:
                print(f"{name}: record {i} differs:\n  {x}\n  {y}")
                return 1
        if len(left) != len(right):
            print(f"{name}: {len(left)} records against {len(right)}")
            return 1
        ours, theirs = (checkpoint.load(os.path.join(d, f"{name}.bin"), with_opt=True) for d in (a, b))
        same = [np.array_equal(x, y) for x, y in zip((ours.params, *ours.opt), (theirs.params, *theirs.opt))]
        if not all(same) or ours.step != theirs.step:
            print(f"{name}.bin: the weights or the AdamW moments differ")
            return 1
        print(f"{name}: {len(left)} records and the checkpoint's weights and moments identical")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+")
    parser.add_argument("--compare", action="store_true")
    options = parser.parse_args()
    sys.exit(compare(*options.dirs) if options.compare else run(options.dirs[0]))
