"""`nanoeuler eval --task mc` against lm-evaluation-harness on the same items: the same pick for every item,
the same acc and acc_norm, and the two speeds side by side.

    .venv/bin/nanoeuler train small --steps 200 --out /tmp/evalsmall.bin
    .venv/bin/python benchmarks/eval_agreement.py --ckpt /tmp/evalsmall.bin

Two item sets: benchmarks/lm_eval/nanoeuler_mc.jsonl (our items) and tests/data/hellaswag_fixture.jsonl
(HellaSwag-shaped rows, made into mc items by nanoeuler's HellaSwag reader; the script first checks that
lm-eval's own hellaswag preprocessing, lm_eval/tasks/hellaswag/utils.py, gives the same contexts and
choices). The checkpoint is exported with `nanoeuler export --hf`, and lm-eval's `hf` model scores it through
the local task benchmarks/lm_eval/nanoeuler_mc.yaml in float32 on the same device. A pick that differs, or
a log-likelihood more than --tolerance apart, fails the script (exit status 1).
Needs the bench extra (lm-eval, accelerate, torch, transformers).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TASK_DIR = REPO / "benchmarks" / "lm_eval"
ITEM_SETS = {"nanoeuler_mc": TASK_DIR / "nanoeuler_mc.jsonl",
             "hellaswag_fixture": REPO / "tests" / "data" / "hellaswag_fixture.jsonl"}


def mc_file(name, path, folder):
    """The item set as an mc JSONL that lm-eval's task reads (HellaSwag rows converted, checked against lm-eval's
    own preprocessing)."""
    if name != "hellaswag_fixture":
        return path
    import datasets
    from lm_eval.tasks.hellaswag.utils import process_docs
    from nanoeuler.data.hellaswag import read_hellaswag
    ours = read_hellaswag(path)
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    theirs = process_docs(datasets.Dataset.from_list(rows))
    for item, doc in zip(ours, theirs):
        assert (item["context"], item["choices"], item["label"]) == (doc["query"], doc["choices"], doc["gold"]), \
            f"HellaSwag preprocessing differs from lm-eval's at {item['where']}"
    out = Path(folder) / "hellaswag_fixture_mc.jsonl"
    out.write_text("".join(json.dumps({k: item[k] for k in ("context", "choices", "label")}) + "\n" for item in ours))
    return out


def ours(ckpt, path, batch_size):
    from nanoeuler.data.mc_items import read_mc
    from nanoeuler.eval.tasks import score_choices
    from nanoeuler.io.checkpoint import load_model
    eng, tok, _ = load_model(ckpt, "cpu")
    items = read_mc(path)
    score_choices(eng, tok, items[:2], batch_size, progress=False)  # numba compiles outside the timing
    t0 = time.perf_counter()
    result = score_choices(eng, tok, items, batch_size, progress=False)
    return items, result, time.perf_counter() - t0


def lm_eval_hf(hf_dir, path, batch_size):
    """lm-eval's hf model on the exported folder, float32 on the CPU: lm_eval_scores (loaded before the clock)."""
    from lm_eval.models.huggingface import HFLM
    return lm_eval_scores(HFLM(pretrained=str(hf_dir), dtype="float32", batch_size=batch_size, device="cpu"), path)


def lm_eval_scores(model, path):
    """lm-eval's per-choice log-likelihoods, acc, acc_norm and seconds: the nanoeuler_mc task over the items in
    path, scored by the lm-eval model `model`."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    tasks = TaskManager(include_path=str(TASK_DIR), metadata={"data_file": str(path)})
    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, tasks=["nanoeuler_mc"], task_manager=tasks, log_samples=True,
                                  bootstrap_iters=0)
    seconds = time.perf_counter() - t0
    samples = sorted(out["samples"]["nanoeuler_mc"], key=lambda s: s["doc_id"])
    lls = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
    metrics = out["results"]["nanoeuler_mc"]
    return lls, metrics["acc,none"], metrics["acc_norm,none"], seconds


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default="/tmp/evalsmall.bin")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--tolerance", type=float, default=1e-3, help="largest |log-likelihood difference| allowed")
    args = p.parse_args()
    torch_threads = os.cpu_count()
    ok = True
    with tempfile.TemporaryDirectory() as folder:
        hf_dir = Path(folder) / "hf"
        subprocess.run([sys.executable, "-m", "nanoeuler", "export", "--hf", str(hf_dir), "--ckpt", args.ckpt],
                       check=True, stdout=subprocess.DEVNULL)
        rows = []
        for name, path in ITEM_SETS.items():
            path = mc_file(name, path, folder)
            items, result, t_ours = ours(args.ckpt, path, args.batch_size)
            lls, acc, acc_norm, t_lm = lm_eval_hf(hf_dir, path, args.batch_size)
            preds = [(p["pred"], p["pred_norm"]) for p in result["predictions"]]
            theirs = []
            for choice_lls, item in zip(lls, items):  # lm-eval's picks, as its process_results makes them
                lengths = np.array([float(len(c)) for c in item["choices"]])
                theirs.append((int(np.argmax(choice_lls)), int(np.argmax(np.array(choice_lls) / lengths))))
            same = sum(a == b for a, b in zip(preds, theirs))
            gap = max(abs(a - b) for p_, l_ in zip(result["predictions"], lls) for a, b in zip(p_["logprobs"], l_))
            n = result["n"]
            agree = same == n and result["acc"] == acc and result["acc_norm"] == acc_norm and gap <= args.tolerance
            ok &= agree
            rows.append((name, n, same, result["acc"], acc, result["acc_norm"], acc_norm, gap, n / t_ours, n / t_lm,
                         "yes" if agree else "NO"))
    print(f"checkpoint {args.ckpt}; CPU, {torch_threads} cores; lm-eval's hf model in float32, batch {args.batch_size} "
          "(both timed without loading the model)")
    print("| items | n | same picks (acc, acc_norm) | acc ours / lm-eval | acc_norm ours / lm-eval | max |Δ log-lik| "
          "| items/s ours | items/s lm-eval | agree |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, n, same, a, a2, an, an2, gap, s1, s2, agree in rows:
        print(f"| {name} | {n} | {same}/{n} | {a:.4f} / {a2:.4f} | {an:.4f} / {an2:.4f} | {gap:.2e} | {s1:.1f} | "
              f"{s2:.1f} | {agree} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
