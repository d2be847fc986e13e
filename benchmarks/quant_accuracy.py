"""Quantization's accuracy on real text: a model trained on shakespeare.txt, its last tenth held out (as `train`
holds it out), scored on that held-out text as float, int8 and int4 checkpoints: bits per byte (`eval --task
bpb`) and the picks of `eval --task mc` on HellaSwag-shaped items cut from the text (a context, its true
continuation and three from elsewhere: nanoeuler/data/text_tasks.py), the quantized picks compared with the
float model's item by item.

    python benchmarks/quant_accuracy.py                          # small to its plateau (the preset's 2,900 steps)
    python benchmarks/quant_accuracy.py --quick                  # 150 steps, 200 items: the whole path, quickly
    python benchmarks/quant_accuracy.py --size base --steps 1500 --device gpu
    python benchmarks/quant_accuracy.py --ckpt trained.bin       # a model trained already

Checkpoints and scores go under --work (a finished training run there is reused, an unfinished one resumed; the
quantized checkpoints and the scores are kept per float checkpoint and step, and per item set).
The quantized checkpoints are `nanoeuler quantize`'s, scored by the engines' quantized products; int4 both with
its heads int8 in groups of 32 (`--head-type int8`, the default) and int4 (`--head-type int4`). Two more rows
measure the other choices of which tensors stay float, by arithmetic equal to quantizing them: a float
checkpoint holding the exact dequantized values (model/quantize.dequantize) of the layers' matrices with the
output heads kept float, and one with the embedding quantized too. A third such checkpoint, every quantized
tensor dequantized as `quantize` stores it, checks that this stand-in scores as the quantized checkpoint does.
The table printed last says whether the aims are met: int8 within +0.3% of float's bits per byte, int4 within
+3%; int8's picks the same as float's on >= 97% of the items, int4's on >= 93%.
"""
import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nanoeuler.data.text_tasks import mc_items_from_text  # noqa: E402
from nanoeuler.model.config import param_shapes  # noqa: E402
from nanoeuler.train.pretrain import PRESET_HYPER  # noqa: E402
from repo_env import log, nanoeuler, repo_env  # noqa: E402

AIMS = {"int8": (0.3, 97.0), "int4": (3.0, 93.0)}  # bits per byte: at most +% over float; picks: agreement %
QUANTIZED = [  # (name, type, group, the heads' type: `quantize --head-type`; int8 is the default)
    ("int8 /32 (Q8_0)", "int8", 32, "int8"),
    ("int8, a scale a row", "int8", 0, "int8"),
    ("int4 /32 (Q4_1), head int8 (Q8_0)", "int4", 32, "int8"),
    ("int4 /32 (Q4_1), head int4", "int4", 32, "int4"),
    ("int4 /64, head int8", "int4", 64, "int8"),
    ("int4 /64, head int4", "int4", 64, "int4"),
]
INT4_HEAD = "int4 /32 (Q4_1), head int4"  # the quantized checkpoint the dequantized stand-in is checked against


def held_out_text(corpus):
    """The corpus's last tenth from the first line that starts in it: inside the validation split `train`
    holds out (which starts at a token boundary at or before nine tenths of the bytes)."""
    data = Path(corpus).read_bytes()
    start = data.index(b"\n", int(0.9 * len(data))) + 1
    return data[start:].decode("utf-8")


def train(opts, env):
    """The trained float checkpoint: --ckpt, or the run at WORK/float.bin (trained, resumed or reused)."""
    if opts.ckpt:
        return opts.ckpt
    from nanoeuler.io import checkpoint
    out = opts.work / "float.bin"
    steps = opts.steps or PRESET_HYPER[opts.size].steps
    args = ["train", opts.size, "--data", opts.data, "--out", str(out), "--device", opts.device, "--steps",
            str(steps)]
    if out.exists():
        if int(checkpoint.read_metadata(out)["step"]) >= steps:
            log(f"{out}: trained already ({steps} steps)")
            return str(out)
        args.append("--resume")
    nanoeuler(args, env)
    return str(out)


def slug(name):
    """A file name for a row's name."""
    return "".join(c for c in name.replace(" ", "_").replace("/", "g") if c.isalnum() or c in "_-")


def dequantized_variant(ckpt, out, kind, group, names):
    """A float checkpoint of ckpt with the tensors `names` replaced by their exact quantize-dequantize values."""
    from nanoeuler.io import checkpoint
    from nanoeuler.model.config import views
    from nanoeuler.model.quantize import dequantize, quantize
    ck = checkpoint.load(ckpt)
    params = ck.params.copy()
    tensors = views(params, ck.cfg)
    for name in names:
        tensors[name][...] = dequantize(quantize(np.ascontiguousarray(tensors[name]), kind, group))
    checkpoint.save(out, ck.cfg, params, ck.tokenizer_json, ck.step)


def score(ckpt, name, opts, env, heldout, items, derived):
    """{bpb, acc, acc_norm, pred (N,), pred_norm (N,)} of a checkpoint (cached beside the quantized ones)."""
    folder = derived / f"scores_{opts.key}"  # scores of these very items and this held-out text
    folder.mkdir(exist_ok=True)
    stem = folder / slug(name)
    if not (stem.with_suffix(".bpb.json")).exists():
        nanoeuler(["eval", "--task", "bpb", "--data", str(heldout), "--ckpt", ckpt, "--device", opts.device,
                   "--json", str(stem.with_suffix(".bpb.json"))], env)
    if not (stem.with_suffix(".preds.jsonl")).exists():
        nanoeuler(["eval", "--task", "mc", "--data", str(items), "--ckpt", ckpt, "--device", opts.device,
                   "--json", str(stem.with_suffix(".mc.json")), "--predictions",
                   str(stem.with_suffix(".preds.jsonl"))], env)
    bpb = json.loads(stem.with_suffix(".bpb.json").read_text())
    mc = json.loads(stem.with_suffix(".mc.json").read_text())
    preds = [json.loads(line) for line in stem.with_suffix(".preds.jsonl").read_text().splitlines()]
    return {"bpb": bpb["bpb"], "acc": mc["acc"], "acc_norm": mc["acc_norm"],
            "pred": np.array([p["pred"] for p in preds]), "pred_norm": np.array([p["pred_norm"] for p in preds])}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=sorted(PRESET_HYPER), help="model preset (default small)")
    ap.add_argument("--steps", type=int, help="training steps (default the preset's; --quick 150)")
    ap.add_argument("--ckpt", help="a trained float checkpoint: skip training")
    ap.add_argument("--data", default="shakespeare.txt", help="the corpus (default shakespeare.txt)")
    ap.add_argument("--items", type=int, help="multiple-choice items (default 1000; --quick 200)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--threads", type=int, default=2, help="threads of the commands (numba and BLAS; default 2)")
    ap.add_argument("--work", type=Path, help="folder for checkpoints and scores (default /tmp/quant_accuracy_SIZE)")
    ap.add_argument("--quick", action="store_true", help="150 training steps and 200 items")
    opts = ap.parse_args()
    opts.steps = opts.steps or (150 if opts.quick else None)
    n_items = opts.items or (200 if opts.quick else 1000)
    opts.work = opts.work or Path(f"/tmp/quant_accuracy_{opts.size}{'_quick' if opts.quick else ''}")
    opts.work.mkdir(parents=True, exist_ok=True)
    opts.data = str(Path(opts.data).resolve())
    # BLAS's own threads too: numpy's products (the LoRA adapters, the quantized products of many rows) with
    # OpenBLAS's default threads on a loaded machine run several times slower
    threads = {name: str(opts.threads) for name in ("NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    env = repo_env(**threads, PYTHONUNBUFFERED="1")

    ckpt = train(opts, env)
    from nanoeuler.io import checkpoint
    cfg = checkpoint.read_config(ckpt)
    step = int(checkpoint.read_metadata(ckpt)["step"])
    text = held_out_text(opts.data)
    heldout = opts.work / "heldout.txt"
    heldout.write_text(text, encoding="utf-8")
    items = opts.work / f"items{n_items}.jsonl"
    made = mc_items_from_text(text, n_items, seed=0)
    items.write_text("".join(json.dumps(item) + "\n" for item in made), encoding="utf-8")
    opts.key = hashlib.sha256(heldout.read_bytes() + items.read_bytes()).hexdigest()[:12]
    derived = opts.work / f"from_{Path(ckpt).stem}_step{step}"  # a retrained float model gets its own
    derived.mkdir(exist_ok=True)
    log(f"held-out text: {len(text.encode()):,} bytes of {opts.data}; {n_items} four-way items -> {items}")

    checkpoints = {"float": ckpt}
    for name, kind, group, head in QUANTIZED:
        out = derived / f"{kind}_g{group}{'_h8' if head != kind else ''}.bin"
        if not out.exists():
            nanoeuler(["quantize", "--ckpt", ckpt, "--out", str(out), "--type", kind, "--group", str(group),
                       "--head-type", head], env)
        checkpoints[name] = str(out)
    layers = [f"layers.{i}.{m}" for i in range(cfg.n_layers)
              for m in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")]
    heads = [f"heads.{k}" for k in range(1 if cfg.tied else 0, cfg.mtp_heads)]
    stand_ins = {"int4 /32, heads float": layers, "int4 /32, embedding int4 too": layers + heads + ["tok_emb"],
                 "int4 /32 dequantized (check)": layers + heads}
    if not heads:  # a tied model's head is its embedding: no separate head to keep float
        del stand_ins["int4 /32, heads float"]
    for name, names in stand_ins.items():
        out = derived / (slug(name) + ".bin")
        if not out.exists():
            log(f"writing {out} ({len(names)} tensors quantized and dequantized)")
            dequantized_variant(ckpt, str(out), "int4", 32, names)
        checkpoints[name] = str(out)

    scores = {name: score(path, name, opts, env, heldout, items, derived) for name, path in checkpoints.items()}
    base = scores["float"]
    check = scores.get("int4 /32 dequantized (check)")
    params = sum(int(np.prod(shape)) for _, shape in param_shapes(cfg))
    print(f"\nmodel: {opts.size if not opts.ckpt else ckpt}, {params / 1e6:.2f}M parameters, {step} training steps; "
          f"held-out {len(text.encode()):,} bytes; {n_items} items; device {opts.device}")
    if check is not None:
        print(f"stand-in check: int4 /32 dequantized into a float checkpoint vs the int4 checkpoint: bits per byte "
              f"{check['bpb']:.5f} vs {scores[INT4_HEAD]['bpb']:.5f}, picks the same on "
              f"{100 * np.mean(check['pred'] == scores[INT4_HEAD]['pred']):.1f}% of the items")
    rows = [("weights", "bits/byte", "vs float", "acc", "acc_norm", "picks = float's", "norm picks = float's",
             "aim")]
    for name, s in scores.items():
        if name == "int4 /32 dequantized (check)":
            continue
        delta = 100 * (s["bpb"] / base["bpb"] - 1)
        agree = 100 * np.mean(s["pred"] == base["pred"])
        agree_norm = 100 * np.mean(s["pred_norm"] == base["pred_norm"])
        aim = ""
        if name in [q[0] for q in QUANTIZED]:
            bound, need = AIMS[name[:4]]
            aim = ("met" if delta <= bound and agree >= need else "NOT met") + f" (+{bound}%, {need:.0f}%)"
        rows.append((name, f"{s['bpb']:.4f}", "" if name == "float" else f"{delta:+.2f}%", f"{s['acc']:.3f}",
                     f"{s['acc_norm']:.3f}", "" if name == "float" else f"{agree:.1f}%",
                     "" if name == "float" else f"{agree_norm:.1f}%", aim))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    summary = {name: {k: v for k, v in s.items() if not isinstance(v, np.ndarray)} for name, s in scores.items()}
    (opts.work / "summary.json").write_text(json.dumps({"size": opts.size, "steps": step, "params": params,
                                                         "items": n_items, "device": opts.device,
                                                         "scores": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
