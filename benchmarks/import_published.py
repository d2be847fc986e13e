"""`nanoeuler import` at a published model's shape: a random model against transformers, and fine-tuning it.

    .venv/bin/python benchmarks/import_published.py --workdir /tmp/smollm --device cpu --json smollm_cpu.json
    PYTHONPATH=. python3 benchmarks/import_published.py --workdir /tmp/smollm --device gpu    # on a GPU machine
    PYTHONPATH=. python3 benchmarks/import_published.py --shape llama3.2-1b --device gpu --workdir /tmp/llama

The model (by default): SmolLM-135M's config (dim 576, 30 layers, 9/3 heads, SwiGLU 1536, vocabulary 49,152,
tied embeddings, RoPE theta 10000, RMSNorm epsilon 1e-5, context 2048) with transformers' own random
initialisation, saved by save_pretrained, and a byte-level BPE of 49,152 tokens trained by `tokenizers` on
shakespeare.txt (its 3 special tokens first, so its ids are not in nanoeuler's order). The script then
1. imports it (`nanoeuler import --hf`),
2. compares head-0 logits on 128 tokens of Shakespeare against transformers in float64 (its RMSNorm and RoPE
   made float64 too, tests/test_import.py's all_in_float64): on the CPU the float64 and float32 engines, on
   the GPU the fp32 and bf16 precisions; and the float32 engine against transformers in float32,
3. the token ids of both tokenizers on 1 MB of shakespeare.txt taken from 8 places,
4. greedy continuations (24 tokens, 4 prompts) against transformers' generate (float32 both),
5. `nanoeuler export --hf` of the imported checkpoint against the original tensors,
6. `nanoeuler sft` for --sft-steps steps on a synthetic instruction set, the loss of each step.
--shape NAME takes a shape of benchmarks/shapes.py instead (SmolLM2-135M / 1.7B, Llama-3.2-1B with Llama 3's
RoPE scaling, Llama-3-8B, Qwen2.5-0.5B as a Qwen2ForCausalLM with its q/k/v biases), full size, its context cut
to 2048; the tokenizer is still trained on shakespeare.txt, which stops short of the larger vocabularies (the
ids past it are padding: logits are compared over the tokenizer's ids). The import's peak resident memory is
printed beside the model's float32 size. --no-float64 leaves out the float64 comparisons (a full-size model's
float64 copies need 16 bytes a parameter) and --sft-steps 0 the fine-tuning. Results: docs/import.md.
"""
import argparse
import json
import pathlib
import resource
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from nanoeuler.infer.generate import generate  # noqa: E402
from nanoeuler.io import checkpoint  # noqa: E402
from nanoeuler.io.hf_import import read_tensors  # noqa: E402
from nanoeuler.model.config import rope_inv_freq  # noqa: E402
from nanoeuler.model.engine import make_engine  # noqa: E402
from test_import import SPECIALS, all_in_float64, hf_tokenizer, save_llama  # noqa: E402
from shapes import SHAPES  # noqa: E402

SMOLLM = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
              intermediate_size=1536, vocab_size=49152, max_position_embeddings=2048, rope_theta=10000.0,
              rms_norm_eps=1e-5, tie_word_embeddings=True)
PROMPTS = ["ROMEO:", "To be, or not to be", "First Citizen:\nBefore we proceed", "The quality of mercy"]


def cli(*args):
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "nanoeuler", *map(str, args)], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"nanoeuler {' '.join(map(str, args))} failed:\n{r.stderr}")
    return r.stdout + r.stderr, time.time() - t0


def relative_error(ours, theirs, n_ids=None):
    """|ours - theirs| / |theirs| over the first n_ids logits of each row (past them: padding ids, -inf in ours)."""
    ours, theirs = ours[..., :n_ids], theirs[..., :n_ids]
    return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))


def synthetic_instructions(path, n=256, seed=0):
    """Instructions a model can learn in a few steps: repeat a word so many times, name a word's first letter."""
    rng = np.random.default_rng(seed)
    words = ["apple", "river", "stone", "cloud", "ember", "maple", "tiger", "lemon", "ocean", "violet"]
    examples = []
    for _ in range(n):
        w, k = words[rng.integers(len(words))], int(rng.integers(2, 5))
        if rng.random() < 0.5:
            examples.append({"instruction": f"Repeat the word {w} {k} times.", "input": "",
                             "output": " ".join([w] * k)})
        else:
            examples.append({"instruction": "Name the first letter of the word.", "input": w, "output": w[0].upper()})
    path.write_text(json.dumps(examples))


def settings_of(shape):
    """transformers' config settings of a shape of benchmarks/shapes.py, and its architecture's class name."""
    cfg = SHAPES[shape]
    settings = dict(hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                    num_key_value_heads=cfg.n_kv_heads, intermediate_size=cfg.hidden, vocab_size=cfg.vocab_size,
                    max_position_embeddings=2048, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps,
                    tie_word_embeddings=cfg.tied, head_dim=cfg.dim // cfg.n_heads)
    if cfg.rope_scaling:
        settings["rope_scaling"] = dict(cfg.rope_scaling)
    return settings, cfg.architecture


def save_model(folder, torch, transformers, tokenizer, architecture, **settings):
    """A random model of the architecture with transformers' own initialisation, saved with its tokenizer."""
    if architecture == "LlamaForCausalLM":
        return save_llama(folder, torch, transformers, tokenizer, far_from_init=False, **settings)
    torch.manual_seed(0)
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    model = getattr(transformers, architecture)(config_class(**settings)).eval()
    model.save_pretrained(folder)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=SPECIALS[0]).save_pretrained(folder)
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/smollm")
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a published shape instead of SmolLM-135M's")
    ap.add_argument("--sft-steps", type=int, default=6,
                    help="0: no fine-tuning (a CPU without room for AdamW's state)")
    ap.add_argument("--no-float64", action="store_true",
                    help="compare with transformers in float32 only (a full-size model's float64 copies need "
                         "16 bytes a parameter)")
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch
    import transformers

    work = pathlib.Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    hf_dir, ckpt = work / "hf", work / "imported.bin"
    results = {"device": args.device, "date": time.strftime("%Y-%m-%d"), "transformers": transformers.__version__,
               "shape": args.shape or "smollm-135m"}
    settings, architecture = settings_of(args.shape) if args.shape else (SMOLLM, "LlamaForCausalLM")
    torch.manual_seed(0)
    t0 = time.time()
    hf_tok = hf_tokenizer(ROOT / "shakespeare.txt", min(settings["vocab_size"], 65536))
    model = save_model(hf_dir, torch, transformers, hf_tok, architecture, **settings, eos_token_id=0, bos_token_id=0)
    results["make_model_s"] = round(time.time() - t0, 1)
    out, results["import_s"] = cli("import", "--hf", hf_dir, "--out", ckpt, "--overwrite")
    print(out.strip())
    results["import_peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2 ** 20, 2)
    results["fp32_model_gib"] = round(4 * sum(p.numel() for p in model.parameters()) / 2 ** 30, 2)
    print(f"import: peak RSS {results['import_peak_rss_gib']} GiB, the model in float32 "
          f"{results['fp32_model_gib']} GiB", flush=True)
    ck = checkpoint.load(ckpt)
    tok = ck.tokenizer()
    results["tokenizer_vocab"] = n_ids = tok.vocab_size

    text = (ROOT / "shakespeare.txt").read_text()
    ids = np.array([tok.encode(text[100_000:102_000])[:128]], np.int32)
    torch_ids = torch.from_numpy(ids).long()
    with torch.no_grad():
        theirs32 = model.float().eval()(torch_ids).logits.numpy()
    errors = {}
    if not args.no_float64:
        model64 = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float64).eval()
        inv_freq = rope_inv_freq(ck.cfg.head_dim, ck.cfg.rope_theta, ck.cfg.rope_scaling)
        all_in_float64(torch, model64, torch.from_numpy(inv_freq))
        with torch.no_grad():
            reference = model64(torch_ids).logits.numpy()
        del model64
        engines = {"float64": dict(dtype=np.float64), "float32": {}} if args.device == "cpu" else \
            {"fp32": dict(precision="fp32"), "bf16": dict(precision="bf16")}
        for name, kw in engines.items():
            eng = make_engine(ck.cfg, device=args.device, **kw)
            eng.load_params(ck.params)
            errors[name] = relative_error(eng.logits(ids), reference, n_ids)
            del eng
    eng = make_engine(ck.cfg, device=args.device, **({} if args.device == "cpu" else dict(precision="fp32")))
    eng.load_params(ck.params)
    errors["float32 engine vs transformers float32"] = relative_error(eng.logits(ids), theirs32, n_ids)
    if not args.no_float64:
        errors["transformers float32 vs its float64"] = relative_error(theirs32, reference, n_ids)
    results["logit_relative_errors"] = errors
    print("logits:", errors, flush=True)

    size, same, n_tokens = len(text), 0, 0
    for k in range(8):
        piece = text[k * size // 8:k * size // 8 + (1 << 20) // 8]
        ours = tok.encode(piece)
        same += ours == hf_tok.encode(piece).ids
        n_tokens += len(ours)
    results["tokenizer"] = dict(samples=8, identical=same, tokens=n_tokens)
    print("tokenizer:", results["tokenizer"], flush=True)

    greedy, padding = [], list(range(n_ids, ck.cfg.vocab_size))  # ours never generates the padding ids
    for prompt in PROMPTS:
        p = tok.encode(prompt)
        with torch.no_grad():
            hf = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                pad_token_id=0, suppress_tokens=padding or None)[0, len(p):].tolist()
        greedy.append(hf == list(generate(eng, p, 24, temperature=0)))
    results["greedy_identical"] = f"{sum(greedy)}/{len(greedy)}"
    print("greedy identical:", results["greedy_identical"], flush=True)
    del model, eng, ck  # the subprocesses below (export, sft) get this process's memory back

    cli("export", "--hf", work / "back", "--ckpt", ckpt)
    original, back = read_tensors(hf_dir), read_tensors(work / "back")
    # tied embeddings stay tied: one tensor, no lm_head.weight, as save_pretrained writes them
    results["export_back_identical"] = (set(back) == set(original)
                                        and all(np.array_equal(back[k], v) for k, v in original.items()))
    print("export --hf gives back the same tensors:", results["export_back_identical"], flush=True)
    del original, back

    if not args.sft_steps:
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
        return
    data = work / "instructions.json"
    synthetic_instructions(data)
    log = work / f"sft_{args.device}.jsonl"
    t0 = time.time()
    cli("sft", "--ckpt", ckpt, "--data", data, "--out", work / f"sft_{args.device}.bin", "--overwrite",
        "--steps", args.sft_steps, "--batch-size", 8, "--lr", 3e-4, "--device", args.device,
        "--eval-every", args.sft_steps, "--sample-every", 10 ** 6, "--val-examples", 16, "--log", log)
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    results["sft"] = dict(seconds=round(time.time() - t0, 1),
                          losses=[round(s["loss"], 4) for s in steps if "loss" in s],
                          val_loss=[s["val_loss"] for s in steps if "val_loss" in s])
    print("sft:", results["sft"], flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
