"""llama.cpp's own Q8_0, Q4_K_M and Q4_1 beside our int8 and int4, on a model trained on shakespeare.txt: bits per
byte on the held-out last tenth, every model scored on the same token windows (those of `eval --task bpb`), ours
by the CPU engine, llama.cpp's from llama-cpp-python's logits; and our quantized checkpoints exported by `export
--gguf` (their Q8_0 / Q4_1 blocks copied), scored by llama.cpp and decoded greedily beside `nanoeuler infer
--temperature 0`. Our int4 both ways: its head int8 (Q8_0, `quantize --type int4`'s default) and int4.

    # llama.cpp: llama-quantize and the shared libraries, and llama-cpp-python's Python package beside them (its
    # source distribution vendors the llama.cpp that it binds; about 10 minutes on 2 cores)
    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.16 && tar xzf llama_cpp_python-0.3.16.tar.gz
    cmake -S llama_cpp_python-0.3.16/vendor/llama.cpp -B /tmp/llamacpp/build -G Ninja -DCMAKE_BUILD_TYPE=Release \\
        -DBUILD_SHARED_LIBS=ON -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
    ninja -C /tmp/llamacpp/build -j2 llama-quantize llama-perplexity llama-simple
    mkdir -p /tmp/llamacpp/site && cp -r llama_cpp_python-0.3.16/llama_cpp /tmp/llamacpp/site/ && \\
        mkdir -p /tmp/llamacpp/site/llama_cpp/lib && cp /tmp/llamacpp/build/bin/*.so /tmp/llamacpp/site/llama_cpp/lib/
    pip install --no-deps --target /tmp/llamacpp/site diskcache
    # a model whose rows Q4_K takes (a multiple of 256 elements): dim 256, 2 layers, small's hyperparameters and
    # tokenizer, 1,000 steps
    python benchmarks/quant_llamacpp.py --dim 256 --layers 2 --hidden 512
    python benchmarks/quant_llamacpp.py --ckpt /tmp/quant_accuracy_small/float.bin    # small (dim 128)

--llama-cpp-bin (llama-quantize) and --llama-cpp-site (llama_cpp, appended to sys.path so that nanoeuler's NumPy
stays the one imported) default to the folders above. llama.cpp's KV cache is float32, so the weights are the only
difference. Files and scores go under --work. llama.cpp's K-quants need rows of a multiple of 256 elements:
llama-quantize writes a narrower matrix in another type (Q4_K -> Q5_0, Q6_K -> Q8_0), so the table lists each
file's tensor types. llama.cpp's Q4_1 is our int4 /32 bit for bit in the layers, with its head in Q6_K and its
embedding in Q4_1: the row that tells the head's share.
"""
import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from quant_accuracy import held_out_text, log, nanoeuler  # noqa: E402 (puts the checkout on sys.path)
from gguf_llamacpp import llama_greedy  # noqa: E402
from nanoeuler.data.corpus import eval_batches, open_corpus  # noqa: E402
from nanoeuler.infer.generate import generate  # noqa: E402
from nanoeuler.io import checkpoint  # noqa: E402
from nanoeuler.model.losses import bits_per_byte  # noqa: E402
from repo_env import repo_env  # noqa: E402

PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo", "First Citizen:\nBefore we proceed"]
GGML_TYPE_F32 = 0
# `nanoeuler quantize --type T --group 32 --head-type H` (Q8_0 / Q4_1 blocks; the head's own): (label, T, H, file)
OURS = [("int8 /32", "int8", "int8", "int8_g32"), ("int4 /32, int8 head", "int4", "int8", "int4_g32_h8"),
        ("int4 /32, int4 head", "int4", "int4", "int4_g32")]
THEIRS = ["Q8_0", "Q4_K_M", "Q4_1"]  # llama-quantize of our f32 export (its Q4_1: our int4 /32, the head Q6_K)


def train_model(opts, env):
    """A model of the given width and depth trained with small's hyperparameters (`train small --ckpt`), from a
    fresh initialization and small's tokenizer (512 tokens learned on the corpus)."""
    import dataclasses
    from nanoeuler.model.config import PRESETS, init_params
    from nanoeuler.tokenizer.bpe import Tokenizer
    out = opts.work / "float.bin"
    if out.exists() and int(checkpoint.read_metadata(out)["step"]) >= opts.steps:
        return out
    init = opts.work / "init.bin"
    if not init.exists():
        cfg = dataclasses.replace(PRESETS["small"], dim=opts.dim, n_layers=opts.layers, hidden=opts.hidden,
                                  n_heads=opts.dim // 64, n_kv_heads=max(1, opts.dim // 128))
        tok = Tokenizer.train(opts.data, cfg.vocab_size)
        cfg = dataclasses.replace(cfg, vocab_size=tok.vocab_size)
        checkpoint.save(init, cfg, init_params(cfg, seed=0), tok.to_json(), 0)
    nanoeuler(["train", "small", "--ckpt", str(init), "--data", opts.data, "--out", str(out), "--device", "cpu",
               "--steps", str(opts.steps)], env)
    return out


def tensor_types(path):
    """({GGML type name: count} of the 2-D tensors, bits a weight of the layers' matrices and the head, the
    embedding's type)."""
    import gguf
    reader = gguf.GGUFReader(path)
    matrices = [t for t in reader.tensors if len(t.shape) == 2]
    layers = [t for t in matrices if t.name != "token_embd.weight"]
    bits = 8 * sum(int(t.n_bytes) for t in layers) / sum(int(t.n_elements) for t in layers)
    embedding = next(t.tensor_type.name for t in matrices if t.name == "token_embd.weight")
    return dict(Counter(t.tensor_type.name for t in matrices)), round(bits, 3), embedding


def llama_model(Llama, path, context):
    # one thread: the windows are small, and llama.cpp's barriers between operations stall on shared cores (its
    # logits do not depend on the count: a row's dot products are one thread's)
    return Llama(model_path=str(path), n_ctx=context, n_batch=context, logits_all=True, verbose=False,
                 n_threads=1, n_threads_batch=1, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)


def llama_bits_per_byte(llm, batches, vocab):
    """bits_per_byte of llama.cpp's logits on the same windows: each window evaluated from an empty cache up to its
    last target (the positions after it are padding, which causal attention keeps from the ones before)."""
    total, n_bytes = 0.0, 0
    for inputs, targets, b in batches:
        for row, target in zip(inputs, targets[0]):
            n = int((target >= 0).sum())  # the valid targets are a prefix of the window
            if n == 0:
                continue
            llm.reset()
            llm.eval(row[:n].tolist())
            logits = np.asarray(llm.scores[:n, :vocab], np.float64)
            top = logits.max(-1)
            lse = top + np.log(np.exp(logits - top[:, None]).sum(-1))
            total += float((lse - logits[np.arange(n), target[:n]]).sum())
        n_bytes += b
    return total / math.log(2) / n_bytes


def greedy_pair(llm, eng, tok, n_new):
    """[{prompt, ours, llama.cpp, the tokens before the first difference, and there our logit of our token
    minus that of llama.cpp's (a near tie or not)}] for PROMPTS."""
    rows = []
    for text in PROMPTS:
        prompt = tok.encode(text)
        theirs = llama_greedy(llm, prompt, n_new)
        ours = list(generate(eng, prompt, n_new, temperature=0))
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), n_new)
        gap = None
        if same < n_new:
            logits = eng.logits(np.array([prompt + ours[:same]], np.int32))[0, -1]
            gap = float(logits[ours[same]] - logits[theirs[same]])
        rows.append({"prompt": text, "ours": tok.decode(ours).decode("utf-8", "replace"),
                     "llama.cpp": llm.detokenize(theirs).decode("utf-8", "replace"), "same_tokens": same,
                     "our_logit_gap_there": gap})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", help="a trained float checkpoint (else one is trained: --dim, --layers, --hidden)")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--steps", type=int, default=1000, help="training steps (default 1,000)")
    ap.add_argument("--data", default="shakespeare.txt")
    ap.add_argument("--llama-cpp-bin", type=Path, default=Path("/tmp/llamacpp/build/bin"))
    ap.add_argument("--llama-cpp-site", default="/tmp/llamacpp/site")
    ap.add_argument("--new-tokens", type=int, default=48, help="greedy tokens a prompt (default 48)")
    ap.add_argument("--work", type=Path, help="folder for files and scores (default /tmp/quant_llamacpp_NAME)")
    ap.add_argument("--json")
    opts = ap.parse_args()
    opts.data = str(Path(opts.data).resolve())
    name = Path(opts.ckpt).parent.name if opts.ckpt else f"d{opts.dim}_l{opts.layers}_h{opts.hidden}"
    opts.work = (opts.work or Path(f"/tmp/quant_llamacpp_{name}")).resolve()  # the commands run in the checkout
    opts.work.mkdir(parents=True, exist_ok=True)
    env = repo_env(NUMBA_NUM_THREADS="2", OPENBLAS_NUM_THREADS="2", OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1")
    sys.path.append(opts.llama_cpp_site)
    from llama_cpp import Llama, __version__

    ckpt = str(Path(opts.ckpt).resolve()) if opts.ckpt else str(train_model(opts, env))
    ck = checkpoint.load(ckpt)
    cfg = ck.cfg
    ours = {"float": ckpt}
    gguf = {"float (f32)": opts.work / "float.f32.gguf"}
    if not gguf["float (f32)"].exists():
        nanoeuler(["export", "--gguf", str(gguf["float (f32)"]), "--ckpt", ckpt, "--type", "f32"], env)
    for label, kind, head, stem in OURS:
        ours[label] = str(opts.work / f"{stem}.bin")
        gguf[f"ours {label}"] = opts.work / f"{stem}.gguf"
        if not Path(ours[label]).exists():
            nanoeuler(["quantize", "--ckpt", ckpt, "--out", ours[label], "--type", kind, "--group", "32",
                       "--head-type", head], env)
        if not gguf[f"ours {label}"].exists():  # the rest of the model (embedding, norms) in f32
            nanoeuler(["export", "--gguf", str(gguf[f"ours {label}"]), "--ckpt", ours[label], "--type", "f32"], env)
    for qtype in THEIRS:
        gguf[f"llama.cpp {qtype}"] = opts.work / f"llamacpp.{qtype}.gguf"
        if not gguf[f"llama.cpp {qtype}"].exists():
            log(f"llama-quantize {qtype}")
            done = os.system(f"{opts.llama_cpp_bin / 'llama-quantize'} {gguf['float (f32)']} "
                             f"{gguf[f'llama.cpp {qtype}']} {qtype} 2 > {opts.work / f'quantize.{qtype}.log'} 2>&1")
            if done:
                sys.exit(f"llama-quantize {qtype} failed: {opts.work / f'quantize.{qtype}.log'}")

    heldout = opts.work / "heldout.txt"
    heldout.write_text(held_out_text(opts.data), encoding="utf-8")
    tok = ck.tokenizer()
    corpus = open_corpus(heldout, tok, progress=False)
    batches = eval_batches(corpus.tokens, corpus.byte_len, 8, cfg.context, cfg.mtp_heads)  # eval --task bpb's
    log(f"held-out: {heldout.stat().st_size:,} bytes, {len(corpus.tokens):,} tokens, "
        f"{sum(len(b[0]) for b in batches):,} windows of {cfg.context}")

    results = {"llama_cpp_python": __version__, "date": time.strftime("%Y-%m-%d"), "ckpt": ckpt,
               "step": ck.step, "config": json.loads(cfg.to_json()), "ours": {}, "llama.cpp": {}, "greedy": {}}
    engines = {}
    for label, path in ours.items():
        eng, _, _ = checkpoint.load_model(path, "cpu")
        engines[label] = eng
        results["ours"][label] = {"bpb": float(bits_per_byte(eng, batches)[1])}
        log(f"ours {label}: {results['ours'][label]}")
    for label, path in gguf.items():
        types, bits, embedding = tensor_types(path)
        llm = llama_model(Llama, path, cfg.context)
        results["llama.cpp"][label] = {"bpb": llama_bits_per_byte(llm, batches, cfg.vocab_size), "types": types,
                                       "bits_per_weight": bits, "embedding": embedding,
                                       "mb": round(path.stat().st_size / 1e6, 3)}
        log(f"llama.cpp runs {label}: {results['llama.cpp'][label]}")
        if label.startswith("ours "):  # our export in llama.cpp: greedy text beside ours on the checkpoint
            results["greedy"][label] = greedy_pair(llm, engines[label[5:]], tok, opts.new_tokens)
        llm.close()

    base_ours, base_theirs = results["ours"]["float"]["bpb"], results["llama.cpp"]["float (f32)"]["bpb"]
    print(f"\n{ckpt} (step {ck.step}; dim {cfg.dim}, {cfg.n_layers} layers, hidden {cfg.hidden}); llama-cpp-python "
          f"{__version__}; bits per byte on the held-out tenth, each against its own engine's float")
    rows = [("weights", "engine", "bits/weight", "embedding", "tensor types", "bits/byte", "vs float")]
    for label, s in results["ours"].items():
        rows.append((label, "nanoeuler (CPU)", "", "", "", f"{s['bpb']:.5f}",
                     f"{100 * (s['bpb'] / base_ours - 1):+.3f}%"))
    for label, s in results["llama.cpp"].items():
        rows.append((label, "llama.cpp", f"{s['bits_per_weight']:.2f}", s["embedding"],
                     " ".join(f"{k}:{v}" for k, v in s["types"].items()), f"{s['bpb']:.5f}",
                     f"{100 * (s['bpb'] / base_theirs - 1):+.3f}%"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    for label, pairs in results["greedy"].items():
        print(f"\ngreedy, {opts.new_tokens} new tokens: {label} in llama.cpp vs `nanoeuler infer --temperature 0` "
              f"on the checkpoint")
        for p in pairs:
            gap = "" if p["our_logit_gap_there"] is None else f" (then our logit gap {p['our_logit_gap_there']:.3f})"
            print(f"  {p['prompt']!r}: {p['same_tokens']}/{opts.new_tokens} tokens the same{gap}\n"
                  f"    ours:      {p['ours']!r}\n    llama.cpp: {p['llama.cpp']!r}")
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
