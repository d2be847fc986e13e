"""Decoding with quantized weights on the GPU: the device's time of one decoding step (graph replays, CUDA events)
of bf16, int8 and int4 weights of a published model's shape, at 1, 16 and 64 rows, in one run; and the peak GPU
memory of a quantized model decoding with an 8,192-token KV cache. A type is bf16 or a quantized type with its
group after a colon (0: one group a row, int8 only) and the heads' own type after a plus (groups of 32): int4
(the head int4 too), int4+int8 (the head int8: what `quantize --type int4` writes), int4:64+int8, int8:0.

Random weights made on the device (no host copy of an 8B model): bf16 matrices normal(0, 0.02); quantized ones
random bytes with scales that give the same spread (docs/quantization.md has the formats); the embedding and
norms as bf16 in every run. ms/token at batch 1 is one step of one row; tokens/s at N rows is N over a step.
A short greedy decode checks that the quantized model's tokens are a pure function of its own row (a row of a
batch of 16 decoded alone gives the same tokens).

Memory: a fresh engine of the model quantized, one sequence with an 8,192-token KV cache decoding 32 tokens
after a 512-token prompt; the peak of (total - free) from CUDA's memory info, sampled after each phase, and
CuPy's pool's high-water mark.

    PYTHONPATH=. python3 benchmarks/bench_quantized.py --shape llama3-8b llama3.2-1b
    PYTHONPATH=. python3 benchmarks/bench_quantized.py --shape llama3-8b --memory-only
    PYTHONPATH=. python3 benchmarks/bench_quantized.py --shape llama3-8b --products   # each product alone
    PYTHONPATH=. python3 benchmarks/bench_quantized.py --shape llama3-8b --types bf16 int4 int4+int8
    PYTHONPATH=. python3 benchmarks/bench_quantized.py --types bf16 int4+int8 int8 --no-memory --steps-only

--products: each of a layer's products (and the head) alone, int8 / int4 / int4:64 and bf16 (matmul_forward on
random weights), at each --rows, as CUDA graphs of 20 calls: microseconds and the bytes of weights read a
second; with --x-tiles 2 or 4 the quantized kernels' blocks of x's rows set for every matrix (of more than 16 rows).

    PYTHONPATH=. python3 benchmarks/bench_quantized.py --products --shape llama3-8b --rows 32 64 --x-tiles 2
"""
import argparse
import dataclasses
import time

import numpy as np

from shapes import SHAPES
from nanoeuler.model.decoding import decoder_of
from nanoeuler.model.engine import make_engine
from nanoeuler.infer.generate import generate

PIECE = 1 << 26  # values a piece of the random float weights


def fill_floats(eng, seed):
    """The engine's bf16 weights (its flat buffer: all of them, or a quantized model's float tensors): norms 1,
    the rest normal(0, 0.02), made on the device a piece at a time."""
    import cupy
    rng = cupy.random.default_rng(seed)
    for name, (offset, shape) in eng.layout.items():
        size = int(np.prod(shape))
        for start in range(0, size, PIECE):
            n = min(PIECE, size - start)
            values = cupy.ones(n, np.float32) if name.endswith("norm") else rng.standard_normal(n, np.float32) * 0.02
            eng.layers.cast_params(eng.weights[offset + start:offset + start + n], values)


def random_quantized(kind, group, O, I, rng):
    """A QuantizedMatrix of random bytes on the device whose values spread about as normal(0, 0.02); group 0:
    one group a row."""
    import cupy
    from nanoeuler.model.gpu.quantized import QuantizedMatrix, layout
    group = group or I
    w_shape, scale_shape, _ = layout(kind, group, O, I)
    w = (rng.random(w_shape, dtype=np.float32) * 256).astype(np.uint8)
    d = cupy.full(scale_shape, 0.02 / (4 if kind == "int4" else 64), np.float16)
    if kind == "int4":  # every (d, m) pair alike, wherever the layout puts a row's
        d[:, 1::2] = -7.5 * d[:, 1::2]
    return QuantizedMatrix(kind, group, (O, I), w, d.view(np.uint16))


def parse_type(spec):
    """(type or None for bf16, group, the heads' type or None) of a --types entry: int4:64+int8 is int4 in
    groups of 64 with the heads int8 (in groups of 32)."""
    spec, _, head = spec.partition("+")
    kind, _, group = spec.partition(":")
    return (None if kind == "bf16" else kind), int(group or 32), head or None


def engine(cfg, kind, group, seed=0, head=None):
    """A decoding engine of cfg with random weights: bf16 (kind None) or its matrices quantized (the untied heads
    as `head` in groups of 32 where given)."""
    import cupy
    if kind is not None:
        own = head is not None and not cfg.tied
        cfg = dataclasses.replace(cfg, quant=kind, quant_group=group, quant_head=head if own else None,
                                  quant_head_group=32 if own else None)
    eng = make_engine(cfg, device="gpu", training=False)
    fill_floats(eng, seed)
    if kind is not None:
        rng = cupy.random.default_rng(seed + 1)
        C, F, HD = cfg.dim, cfg.hidden, cfg.head_dim
        for i in range(cfg.n_layers):
            w = f"layers.{i}."
            eng.p[w + "wqkv"] = random_quantized(kind, group, (cfg.n_heads + 2 * cfg.n_kv_heads) * HD, C, rng)
            eng.p[w + "wo"] = random_quantized(kind, group, C, cfg.n_heads * HD, rng)
            eng.p[w + "w_gate_up"] = random_quantized(kind, group, 2 * F, C, rng)
            eng.p[w + "w_down"] = random_quantized(kind, group, C, F, rng)
        if not cfg.tied:
            heads = random_quantized(cfg.quant_head or kind, cfg.quant_head_group or group,
                                     cfg.mtp_heads * cfg.vocab_size, C, rng)
            eng.p["heads"] = heads
            for k in range(cfg.mtp_heads):
                eng.p[f"heads.{k}"] = heads.rows(k * cfg.vocab_size, (k + 1) * cfg.vocab_size)
    cupy.cuda.Device().synchronize()
    return eng


def step_time(eng, rows, repeats=100):
    """ms of one decoding step of `rows` sequences as the device runs it (bench_decode.py's measure)."""
    from bench_decode import step_time as measure
    return measure(eng, rows, repeats)


def used():
    import cupy
    free, total = cupy.cuda.runtime.memGetInfo()
    return total - free


def memory_run(cfg, kind, group, prompt_tokens=512, new_tokens=32, head=None):
    """(peak total - free, CuPy pool's bytes, engine bytes) of a fresh engine decoding one sequence with a KV cache
    of cfg.context (8,192) positions. The random weights' temporaries (float32 draws 4 to 8 times the packed
    bytes) are handed back to CUDA before the count starts: a checkpoint's load makes none."""
    import cupy
    base = used()
    eng = engine(cfg, kind, group, head=head)
    cupy.get_default_memory_pool().free_all_blocks()
    peak = used()
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, prompt_tokens).tolist()
    tokens = []
    for t in generate(eng, prompt, new_tokens, temperature=0):
        tokens.append(t)
        peak = max(peak, used())
    cupy.cuda.Device().synchronize()
    peak = max(peak, used())
    return peak, base, eng.device_memory(), len(tokens)


def products(cfg, types, rows_list):
    """{(name, type, rows): microseconds} of the layer's products alone, and prints them with their weight bytes a
    second."""
    import cupy
    from nanoeuler.model.gpu.layers import Layers
    layers = Layers("bf16", True)
    C, F, HD = cfg.dim, cfg.hidden, cfg.head_dim
    shapes = {"wqkv": ((cfg.n_heads + 2 * cfg.n_kv_heads) * HD, C), "wo": (C, cfg.n_heads * HD),
              "w_gate_up": (2 * F, C), "w_down": (C, F), "head": (cfg.vocab_size, C)}
    rng = cupy.random.default_rng(0)
    for kind in types:
        name_, group, head = parse_type(kind)
        for name, (O, I) in shapes.items():
            if name_ is None:
                w = (rng.standard_normal((O, I), dtype=np.float32) * 0.02).view(np.uint32) >> 16
                w = w.astype(np.uint16)
                nbytes = w.nbytes
            else:
                w = random_quantized(head, 32, O, I, rng) if head and name == "head" else \
                    random_quantized(name_, group, O, I, rng)
                nbytes = w.nbytes
            for rows in rows_list:
                x = (rng.standard_normal((rows, I), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
                out = cupy.zeros((rows, O), np.uint16)
                replay = layers.graph(lambda: [layers.matmul_forward(out, x, w) for _ in range(20)])
                replay()
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record()
                for _ in range(5):
                    replay()
                end.record()
                end.synchronize()
                us = 1e3 * cupy.cuda.get_elapsed_time(start, end) / 100
                print(f"{name:<10} {O:>6} x {I:<6} {kind:<7} {rows:>3} rows: {us:8.1f} us, "
                      f"{nbytes / us / 1e3:7.0f} GB/s of weights", flush=True)
            del w


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", nargs="+", default=["llama3-8b", "llama3.2-1b"], choices=sorted(SHAPES))
    ap.add_argument("--types", nargs="+", default=["bf16", "int8", "int4", "int4:64"],
                    help="bf16, or a quantized type with its group after a colon (default 32) and the heads' type "
                    "after a plus: int8, int4:64, int4+int8, ...")
    ap.add_argument("--group", type=int, default=32, help="the memory run's int4 group (default 32)")
    ap.add_argument("--head", default="int8", choices=("int8", "int4"),
                    help="the memory run's head type (default int8, as `quantize --type int4` writes)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=1024, help="the KV cache's positions in the speed runs")
    ap.add_argument("--memory-only", action="store_true")
    ap.add_argument("--no-memory", action="store_true", help="the speed runs alone")
    ap.add_argument("--steps-only", action="store_true",
                    help="the steps' times alone: no kernel times, no batch-invariance decode")
    ap.add_argument("--products", action="store_true", help="each product alone (see above)")
    ap.add_argument("--x-tiles", type=int, choices=(2, 4),
                    help="the quantized products of more than 16 rows in blocks of this many tiles of 8 rows of x "
                    "whatever the matrix (default: gpu.quantized.x_tiles' choice), to compare the kernels")
    args = ap.parse_args()
    import cupy
    if args.x_tiles:
        from nanoeuler.model.gpu import quantized
        choose = quantized.x_tiles
        quantized.x_tiles = lambda N, w: choose(N, w) if N <= 16 else args.x_tiles
    from nanoeuler.model.gpu import device_name
    print(f"{device_name()}: decoding steps as CUDA graphs, random weights", flush=True)
    table = []
    if args.products:
        for shape in args.shape:
            products(SHAPES[shape], args.types, args.rows)
        return
    if not args.memory_only:
        for shape in args.shape:
            cfg = dataclasses.replace(SHAPES[shape], context=args.context)
            base = {}
            for kind in args.types:
                t0 = time.time()
                name, group, head = parse_type(kind)
                eng = engine(cfg, name, group, head=head)
                ms = {}
                for rows in args.rows:
                    ms[rows] = step_time(eng, rows)
                    base.setdefault(rows, ms[rows]) if kind == "bf16" else None
                    print(f"{shape:<12} {kind:<7} {rows:>3} rows: {ms[rows]:8.3f} ms a step, "
                          f"{1e3 * rows / ms[rows]:>9,.0f} tokens/s"
                          + (f"  ({base[rows] / ms[rows]:.2f}x bf16)" if rows in base and kind != "bf16" else ""),
                          flush=True)
                from bench_decode import kernel_times
                times = {} if args.steps_only else kernel_times(eng, 1, 130, 100)
                if times:
                    print(f"{shape:<12} {kind:<7} a layer's kernels at 1 row (us): "
                          + "; ".join(f"{k} {v:.1f}" for k, v in times.items()), flush=True)
                if kind != "bf16" and 16 in args.rows and not args.steps_only:  # a row of 16 alone: its tokens
                    prompts = np.random.default_rng(3).integers(0, cfg.vocab_size, (16, 8)).tolist()
                    together = generate(eng, prompts, 12, temperature=0)
                    alone = [list(generate(eng, prompts[r], 12, temperature=0)) for r in (0, 9)]
                    print(f"{shape:<12} {kind:<7} batch invariance (rows 0, 9 of 16 alone): "
                          f"{alone == [together[0], together[9]]}", flush=True)
                table.append((shape, kind, ms, eng.device_memory()))
                print(f"{shape:<12} {kind:<7} engine {eng.device_memory() / 2**30:.2f} GiB in CuPy's pool; "
                      f"{time.time() - t0:.0f} s", flush=True)
                del eng
                cupy.get_default_memory_pool().free_all_blocks()
    if not args.no_memory:
        cfg = dataclasses.replace(SHAPES["llama3-8b"], context=8192)
        cupy.get_default_memory_pool().free_all_blocks()
        peak, base, pool, n = memory_run(cfg, "int4", args.group, head=args.head)
        print(f"memory: llama3-8b int4 (groups of {args.group}, the head {args.head}), one sequence, 8,192-token KV "
              f"cache, {n} tokens decoded: peak GPU memory in use {peak / 2**30:.2f} GiB (total - free; "
              f"{base / 2**30:.2f} GiB before the engine: the CUDA context), CuPy's pool {pool / 2**30:.2f} GiB",
              flush=True)
    print("\nshape        type   " + "  ".join(f"{r:>3} rows ms (tok/s)" for r in args.rows))
    for shape, kind, ms, _ in table:
        print(f"{shape:<12} {kind:<7}  " + "  ".join(f"{ms[r]:7.3f} ({1e3 * r / ms[r]:>8,.0f})" for r in args.rows))


if __name__ == "__main__":
    main()
