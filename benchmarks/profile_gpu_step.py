"""Where a GPU training step's time goes: CUDA events around every layer call of the engine.

Each layer function of the engine's layers (a nanoeuler.model.gpu.layers.Layers) is wrapped with a pair of CUDA
events (on the current stream, so the timing adds no synchronisation inside the step); after the timed steps
the per-function totals are printed, sorted, as ms per step and share of the step. The events themselves cost
a few microseconds per call, so the sum is a little above the plain step time that bench_gpu_train.py reports.

    PYTHONPATH=. python3 benchmarks/profile_gpu_step.py                            # base, 16 x 512, bf16
    PYTHONPATH=. python3 benchmarks/profile_gpu_step.py --precision tf32 --batch-size 32
"""
import argparse
import collections
import functools
import time


from nanoeuler.model.config import PRESETS
from nanoeuler.model.optimizer import AdamW
from nanoeuler.model.losses import cross_entropy_backward
from reference import batches

LAYER_FUNCTIONS = ("matmul_forward", "matmul_backward", "embedding_forward", "embedding_backward",
                   "rmsnorm_forward", "rmsnorm_backward", "rope_forward", "rope_backward", "attention_forward",
                   "attention_backward", "swiglu_forward", "swiglu_backward", "crossentropy_forward",
                   "crossentropy_forward_backward", "adamw_update", "sum_squares", "cast_params")


def instrument(layers, events):
    """Replace each layer function of `layers` (an engine's; its other callers, the fused products, see the
    replacement too) by one that records (name, start, end) events around the call."""
    import cupy

    def wrap(name, fn):
        @functools.wraps(fn)
        def timed(*args, **kw):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            out = fn(*args, **kw)
            end.record()
            events.append((name, start, end))
            return out
        return timed
    for name in LAYER_FUNCTIONS:
        setattr(layers, name, wrap(name, getattr(layers, name)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="base", choices=sorted(PRESETS))
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--precision", default="bf16", choices=("bf16", "tf32", "fp32"))
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()

    import cupy
    from nanoeuler.model.engine import make_engine

    cfg = PRESETS[args.preset]
    eng = make_engine(cfg, device="gpu", precision=args.precision)
    opt = AdamW(eng)
    inputs, targets = next(batches(cfg, args.batch_size, seed=0))

    def step():
        cross_entropy_backward(eng, inputs, targets)
        opt.step(eng, lr=1e-4, weight_decay=0.1, grad_clip=1.0)
    for _ in range(3):
        step()
    cupy.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    cupy.cuda.Device().synchronize()
    plain = 1e3 * (time.perf_counter() - t) / args.steps

    events = []
    instrument(eng.layers, events)
    for _ in range(args.steps):
        step()
    cupy.cuda.Device().synchronize()
    total, calls = collections.Counter(), collections.Counter()
    for name, start, end in events:
        total[name] += cupy.cuda.get_elapsed_time(start, end) / args.steps
        calls[name] += 1
    timed = sum(total.values())
    peak = cupy.get_default_memory_pool().total_bytes() / 2 ** 30
    print(f"{args.preset}, {args.batch_size} x {cfg.context}, {args.precision}: step {plain:.2f} ms, "
          f"{args.batch_size * cfg.context / plain * 1e3:,.0f} tokens/s, {peak:.2f} GiB in CuPy's pool "
          f"(layer calls {timed:.2f} ms, the rest is host work and gaps)")
    print(f"{'layer function':<32} {'ms/step':>8} {'share':>6} {'calls':>6}")
    for name, ms in total.most_common():
        print(f"{name:<32} {ms:8.2f} {100 * ms / plain:5.1f}% {calls[name] // args.steps:6d}")


if __name__ == "__main__":
    main()
