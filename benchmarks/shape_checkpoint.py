"""A checkpoint of random weights in a published model's shape (benchmarks/shapes.py), for training runs at that
shape through the command line, e.g. Llama 3 8B's fully fine-tuned on 8 GPUs with ZeRO-3:

    PYTHONPATH=. python3 benchmarks/shape_checkpoint.py --shape llama3-8b --context 2048 --tokenizer tok4096.json \
        --out llama3_8b_random.bin
    nanoeuler train --ckpt llama3_8b_random.bin --data shakespeare.txt --out run.bin --gpus 8 --zero 3 \
        --batch-size 2 --recompute --steps 50 --eval-every 1000 --sample-every 1000 --ckpt-every 1000

The weights are drawn as config.init_params draws them (normal 0.02, the residual projections scaled down; norm
gains 1, biases 0), but in float32 and a tensor a thread (an 8B model's in seconds, not minutes), the tokenizer any of
the model's vocabulary or smaller (the rows past it are padding, never generated: config.tokenizer_vocab); the checkpoint is the format of
docs/design.md (float32: 4 bytes a parameter, 32 GB for llama3-8b), written without optimizer state, so
`train --ckpt` starts a fresh AdamW on it as on an imported model.
"""
import argparse
import dataclasses
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from shapes import SHAPES

from nanoeuler.io import checkpoint
from nanoeuler.model.config import init_rule, param_count, param_shapes, views
from nanoeuler.tokenizer.bpe import Tokenizer


def save_shape_checkpoint(path, shape, tokenizer_json, context=None, seed=0):
    """Write a checkpoint of random weights of `shape` (its context, or `context`) with the tokenizer; its cfg.
    The rows past the tokenizer's ids are padding, never generated (a run's samples, a server's replies)."""
    cfg = SHAPES[shape] if context is None else dataclasses.replace(SHAPES[shape], context=context)
    tokens = Tokenizer.from_json(tokenizer_json).vocab_size
    if tokens > cfg.vocab_size:
        sys.exit(f"the tokenizer has more tokens than {shape}'s {cfg.vocab_size}")
    cfg = dataclasses.replace(cfg, tokenizer_vocab=min(tokens, cfg.tokenizer_vocab or tokens))
    checkpoint.save(path, cfg, random_params(cfg, seed), tokenizer_json, 0)
    return cfg


def random_params(cfg, seed=0):
    """init_params' distribution (config.init_rule), each tensor drawn in float32 by its own generator on a
    thread of its own (numpy's generators release the GIL), so the draw does not depend on the thread count."""
    flat = np.empty(param_count(cfg), dtype=np.float32)
    tensors = views(flat, cfg)
    names = [name for name, _ in param_shapes(cfg)]

    def draw(job):
        name, seq = job
        kind, value = init_rule(cfg, name)
        if kind == "fill":
            tensors[name][...] = value
            return
        np.random.default_rng(seq).standard_normal(dtype=np.float32, out=tensors[name].reshape(-1))
        tensors[name] *= np.float32(value)

    with ThreadPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(draw, zip(names, np.random.SeedSequence(seed).spawn(len(names)))))
    return flat


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--context", type=int, default=2048, help="the model's context (default 2048)")
    ap.add_argument("--tokenizer", required=True, help="a tokenizer.json (e.g. one `nanoeuler train` learned)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tokenizer_json = Tokenizer.load(args.tokenizer).to_json()  # a tokenizer.json as `tokenizer train` writes it
    t0 = time.perf_counter()
    cfg = save_shape_checkpoint(args.out, args.shape, tokenizer_json, args.context, args.seed)
    print(f"{args.out}: {args.shape}, {param_count(cfg) / 1e9:.2f}B parameters, context {cfg.context}, random "
          f"weights (seed {args.seed}), in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
