"""Speed of `nanoeuler eval`'s multiple-choice scoring against lm-evaluation-harness's `hf` model on the same
items in the same run, and a checkpoint's scores on the HellaSwag-shaped fixture and our mc items.

    python benchmarks/bench_eval.py --ckpt base.bin --device gpu --items 10042 --json out.json

The items: --data (mc JSON lines; HellaSwag's validation file when there is one: --hellaswag), else
`synthetic_items`: 10,042 items of HellaSwag's shape (a context of 20 to 90 words, 4 endings of 8 to 35
words, words drawn from shakespeare.txt), seeded. Ours: eval.tasks.score_choices, end to end (tokenizing,
batching, forwards, picks), after a warm-up on 64 items that compiles the kernels. lm-eval: the checkpoint
exported with `nanoeuler export --hf`, its `hf` model (loaded before the clock starts) over the local task
benchmarks/lm_eval/nanoeuler_mc.yaml reading the same items, end to end (simple_evaluate). Where lm-eval
cannot be imported, a plain transformers loop (the same requests, batched, one forward per batch) stands in
and the output says so. The two pick the same choice where their log-likelihoods agree; the share that does
is printed (bf16 on the GPU rounds both).
"""
import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TASK_DIR = REPO / "benchmarks" / "lm_eval"


def synthetic_items(n, seed=0):
    """n mc items of HellaSwag's shape from Shakespeare's words."""
    words = re.findall(r"[A-Za-z']+", (REPO / "shakespeare.txt").read_text(encoding="utf-8")[:2_000_000])
    rng = random.Random(seed)

    def text(lo, hi):
        return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi))).capitalize() + "."

    return [{"context": rng.choice(words).capitalize() + ": " + text(20, 90), "label": rng.randrange(4),
             "choices": [text(8, 35) for _ in range(4)]} for _ in range(n)]


def ours(ckpt, items, device, batch_size, precision):
    from nanoeuler.eval.tasks import score_choices
    from nanoeuler.io.checkpoint import load
    from nanoeuler.model.engine import make_engine
    ck = load(ckpt)
    eng = make_engine(ck.cfg, device=device, precision=precision)
    eng.load_params(ck.params)
    tok = ck.tokenizer()
    score_choices(eng, tok, items[:64], batch_size, progress=False)  # compiles the kernels
    if device == "gpu":
        import cupy
        cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    result = score_choices(eng, tok, items, batch_size, progress=False)
    return result, time.perf_counter() - t0, eng, tok


def lm_eval_hf(hf_dir, data_file, device, batch_size, dtype):
    """lm-eval's hf model on the exported folder: per-choice log-likelihoods and seconds."""
    from lm_eval.models.huggingface import HFLM
    from eval_agreement import lm_eval_scores
    lls, _, _, seconds = lm_eval_scores(HFLM(pretrained=str(hf_dir), dtype=dtype, batch_size=batch_size,
                                              device=device), data_file)
    return lls, seconds


def transformers_loop(hf_dir, items, device, batch_size, dtype, tok):
    """Summed log-probabilities of each choice with transformers' LlamaForCausalLM: the same requests (our
    token split), sorted by length, right-padded, one forward per batch."""
    import torch
    from transformers import LlamaForCausalLM
    from nanoeuler.eval.scoring import choice_requests, scoring_row
    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).to(device).eval()
    t0 = time.perf_counter()
    requests, first = choice_requests(tok, items)
    C = model.config.max_position_embeddings
    rows = [scoring_row(c, x, C) for c, x in requests]
    order = sorted(range(len(rows)), key=lambda r: -len(rows[r][0]))
    scores = np.empty(len(rows))
    with torch.inference_mode():
        for s in range(0, len(order), batch_size):
            batch = order[s:s + batch_size]
            T = len(rows[batch[0]][0]) - 1
            inputs = torch.zeros((len(batch), T), dtype=torch.long)
            for b, r in enumerate(batch):
                inputs[b, :len(rows[r][0]) - 1] = torch.tensor(rows[r][0][:-1])
            logp = torch.log_softmax(model(inputs.to(device)).logits.float(), dim=-1)
            for b, r in enumerate(batch):
                window, scored = rows[r]
                n = len(window) - 1
                targets = torch.tensor(window[n - scored + 1:], device=device)
                scores[r] = logp[b, n - scored:n].gather(1, targets[:, None]).sum().item()
    seconds = time.perf_counter() - t0
    return [scores[f:f + len(item["choices"])].tolist() for f, item in zip(first, items)], seconds


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--device", default="gpu", choices=("cpu", "gpu"))
    p.add_argument("--items", type=int, default=10042)
    p.add_argument("--data", help="mc JSON lines to time instead of synthetic items")
    p.add_argument("--batch-size", type=int, default=128, help="ours (rows per forward)")
    p.add_argument("--peer-batch-size", type=int, default=64, help="lm-eval's / the transformers loop's")
    p.add_argument("--precision", default=None, help="ours (default: the device's, bf16 on the GPU)")
    p.add_argument("--peer-dtype", default=None, help="lm-eval's (default bfloat16 on the GPU, float32 on the CPU)")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()
    from nanoeuler.data.hellaswag import read_hellaswag
    from nanoeuler.data.mc_items import read_mc
    from nanoeuler.eval.tasks import score_choices
    dtype = args.peer_dtype or ("bfloat16" if args.device == "gpu" else "float32")
    torch_device = "cuda" if args.device == "gpu" else "cpu"
    items = read_mc(args.data) if args.data else synthetic_items(args.items)
    out = {"items": len(items), "source": args.data or "synthetic HellaSwag-shaped", "device": args.device}
    with tempfile.TemporaryDirectory() as folder:
        data_file = Path(folder) / "items.jsonl"
        data_file.write_text("".join(json.dumps({k: it[k] for k in ("context", "choices", "label")}) + "\n"
                                     for it in items))
        result, t_ours, eng, tok = ours(args.ckpt, items, args.device, args.batch_size, args.precision)
        out.update(ours_seconds=round(t_ours, 3), ours_items_per_s=round(len(items) / t_ours, 1),
                   ours_precision=eng.precision, ours_batch=args.batch_size)
        print(f"nanoeuler: {len(items)} items in {t_ours:.2f} s ({len(items) / t_ours:,.0f} items/s), "
              f"{eng.precision}, batch {args.batch_size}", flush=True)
        for name, path, reader in (("hellaswag_fixture", REPO / "tests/data/hellaswag_fixture.jsonl", read_hellaswag),
                                   ("nanoeuler_mc", TASK_DIR / "nanoeuler_mc.jsonl", read_mc)):
            scored = score_choices(eng, tok, reader(path), args.batch_size, progress=False)
            out[name] = {k: scored[k] for k in ("n", "acc", "acc_norm", "acc_interval", "acc_norm_interval")}
            print(f"{name}: n {scored['n']}, acc {scored['acc']:.4f} ± {scored['acc_interval']:.4f}, acc_norm "
                  f"{scored['acc_norm']:.4f} ± {scored['acc_norm_interval']:.4f}", flush=True)
        hf_dir = Path(folder) / "hf"
        subprocess.run([sys.executable, "-m", "nanoeuler", "export", "--hf", str(hf_dir), "--ckpt", args.ckpt],
                       check=True, stdout=subprocess.DEVNULL)
        try:
            import lm_eval  # noqa: F401
            peer = f"lm-evaluation-harness {lm_eval.__version__} hf model"
            lls, t_peer = lm_eval_hf(hf_dir, data_file, torch_device, args.peer_batch_size, dtype)
        except ImportError as e:
            peer = f"transformers loop (lm-eval not importable: {e})"
            lls, t_peer = transformers_loop(hf_dir, items, torch_device, args.peer_batch_size, dtype, tok)
    same = sum(int(np.argmax(l)) == p["pred"] for l, p in zip(lls, result["predictions"]))
    out.update(peer=peer, peer_dtype=dtype, peer_batch=args.peer_batch_size, peer_seconds=round(t_peer, 3),
               peer_items_per_s=round(len(items) / t_peer, 1), speedup=round(t_peer / t_ours, 2), same_picks=same)
    print(f"{peer}: {len(items)} items in {t_peer:.2f} s ({len(items) / t_peer:,.0f} items/s), {dtype}, batch "
          f"{args.peer_batch_size}; nanoeuler is {t_peer / t_ours:.1f}x faster; same pick (acc) on {same} of "
          f"{len(items)} items")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
