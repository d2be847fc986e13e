"""Where a QLoRA step's time goes beyond LoRA's on a bf16 base: the dequantized copies its products of many rows
multiply by (gpu/quantized.py's `dequantize`, kernels/quantized.cu's quant_dequantize), timed on the GPU.

1. Each matrix of a Llama-3-8B layer (int4 in groups of 32: q|k|v, o, gate|up, down) and a slice of its int8 head
   (32,768 rows: the most one dequantization takes) dequantized to bf16: ms (CUDA events, median of 20), the
   bytes it reads and writes and their rate; beside it cuBLAS's product of that matrix with 4,096 rows (2 x 2048),
   the work the copy is made for.
2. A QLoRA step of the 8B shape (r 16 on all seven targets, int4 base + int8 head, 2 x 2048, bench_lora.py's), each
   dequantization inside it bracketed by CUDA events: the step's ms, the dequantizations' count and summed ms.

    PYTHONPATH=. python3 benchmarks/bench_dequantize.py                      # both, --recompute layer and mlp
    PYTHONPATH=. python3 benchmarks/bench_dequantize.py --no-step            # the kernel alone
"""
import argparse
import dataclasses

import numpy as np

from bench_gpu_train import time_steps
from bench_quantized import engine as quantized_engine, random_quantized
from reference import batches
from shapes import SHAPES


def event_ms(fn, repeats):
    """Median ms of fn() over repeats, each between two CUDA events."""
    import cupy
    times = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def bench_matrices(cfg, rows, repeats):
    import cupy
    from nanoeuler.model.gpu import quantized, runtime
    from nanoeuler.model.gpu.runtime import BF16
    C, F, D = cfg.dim, cfg.hidden, cfg.head_dim
    shapes = [("q|k|v", "int4", (cfg.n_heads + 2 * cfg.n_kv_heads) * D, C), ("o", "int4", C, cfg.n_heads * D),
              ("gate|up", "int4", 2 * F, C), ("down", "int4", C, F),
              ("head slice", "int8", quantized.SLICE_ELEMENTS // C, C)]
    rng = cupy.random.default_rng(0)
    print(f"{'matrix':<11} {'type':<5} {'shape':>13} {'dequantize ms':>13} {'GB moved':>8} {'GB/s':>6} "
          f"{'cuBLAS ms, ' + str(rows) + ' rows':>20}", flush=True)
    total = 0.0
    for name, kind, O, I in shapes:
        w = random_quantized(kind, 32, O, I, rng)
        out = cupy.empty((O, I), dtype=BF16)
        quantized.dequantize(w, BF16, out)  # compiled, warm
        ms = event_ms(lambda: quantized.dequantize(w, BF16, out), repeats)
        moved = w.nbytes + out.nbytes
        x = cupy.zeros((rows, I), dtype=BF16)
        y = cupy.empty((rows, O), dtype=BF16)
        product = lambda: runtime.gemm(True, False, O, rows, I, out, I, x, I, y, O, False, True)
        product()
        gemm_ms = event_ms(product, repeats)
        if name != "head slice":
            total += ms
        print(f"{name:<11} {kind:<5} {f'{O} x {I}':>13} {ms:13.3f} {moved / 1e9:8.3f} {moved / ms / 1e6:6.0f} "
              f"{gemm_ms:20.3f}", flush=True)
        del w, out, x, y
    print(f"a layer's four matrices: {total:.3f} ms, x {cfg.n_layers} layers = {total * cfg.n_layers:.1f} ms a pass",
          flush=True)


def bench_step(cfg, mode, args):
    """(step ms, dequantizations a step, their summed ms) of one QLoRA step with `mode` recompute."""
    import cupy
    from nanoeuler.model import lora
    from nanoeuler.model.gpu import quantized
    from nanoeuler.model.losses import cross_entropy_backward
    from nanoeuler.model.optimizer import AdamW
    inputs, targets = next(batches(cfg, 2, seed=1))
    eng = quantized_engine(cfg, "int4", 32, head="int8")
    cupy.get_default_memory_pool().free_all_blocks()
    trained = lora.attach(eng, lora.make_spec(cfg, 16, 32.0))
    opt = AdamW(eng, mask=lora.decay_mask(trained))
    eng.recompute = mode
    plain, events = quantized.dequantize, []

    def timed(w, dtype=np.float32, out=None):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        out = plain(w, dtype, out)
        stop.record()
        events.append((start, stop))
        return out

    def step():
        loss = cross_entropy_backward(eng, inputs, targets)[0]
        opt.step(trained, lr=1e-4, weight_decay=0.0, grad_clip=1.0)
        return loss

    med, _, _ = time_steps(step, cupy.cuda.Device().synchronize, 1, args.steps)  # plain: the step's own time
    quantized.dequantize = timed
    try:
        step()
        cupy.cuda.Device().synchronize()
    finally:
        quantized.dequantize = plain
    spent = sum(cupy.cuda.get_elapsed_time(a, b) for a, b in events)
    del eng, trained, opt
    cupy.get_default_memory_pool().free_all_blocks()
    return med, len(events), spent


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=4096, help="the rows of the products beside them (2 x 2048)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--recompute", nargs="+", default=["layer", "mlp"])
    ap.add_argument("--no-step", action="store_true", help="the kernel alone, no QLoRA step")
    args = ap.parse_args()
    from nanoeuler.model import engine
    from nanoeuler.model.gpu import device_name
    cfg = dataclasses.replace(SHAPES[args.shape], context=2048)
    print(f"{device_name()}: {args.shape}'s matrices dequantized to bf16", flush=True)
    bench_matrices(cfg, args.rows, args.repeats)
    if args.no_step:
        return
    print(f"QLoRA r 16 step, int4 base + int8 head, 2 x 2048: {'recompute':<9} {'ms/step':>8} {'dequantizations':>15} "
          f"{'their ms':>8} {'share':>6}", flush=True)
    for mode in args.recompute:
        if mode not in engine.RECOMPUTE_MODES:
            print(f"{'':<50} {mode:<9} (not a mode of this engine)", flush=True)
            continue
        med, count, spent = bench_step(cfg, mode, args)
        print(f"{'':<50} {mode:<9} {med:8.1f} {count:15d} {spent:8.1f} {spent / med:6.1%}", flush=True)


if __name__ == "__main__":
    main()
