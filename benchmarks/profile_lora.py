"""Where a LoRA / QLoRA training step's GPU time goes: CUDA events around each of its parts, summed over layers.

The step is bench_lora.py's (the same engine, adapters, batch and AdamW). Every call of the engine's layers
(model/gpu/layers.py), every cuBLAS product (runtime.gemm) and every dequantized copy (quantized.dequantize) is
bracketed by two CUDA events; a call's own time is its interval less its children's, so a product inside
`rmsnorm_matmul_forward` counts as a product and the norm around it as a norm. The phase a call runs in (the
forward pass, the backward pass's recomputation, the backward pass, the head with its cross-entropy, AdamW) names
its row where it matters: the base's cuBLAS products forward / recomputed / backward, the adapters' thin products
(x A^T and h B^T, their gradients) the same. Attention and the products get their rate (TFLOP/s, the attention's
FLOPs counted causal: 4 B H T^2 D / 2 forward, 2.5 times that backward). The events cost a little host time a
call; the step is timed without them too, and what the events do not cover (launch gaps) is the last row. The
events' host time can starve the device where it runs many small calls: the interval that then waits for the
host (one row, a different one from run to run) grows by about the difference between the step's time with the
events and without; the other rows are the device's. Last, the host's time issuing each phase without events
(a phase whose host time nears its device time is launch-bound; a host that runs ahead waits once CUDA's launch
queue is full, and that wait counts as host time).

    PYTHONPATH=. python3 benchmarks/profile_lora.py --shape llama3-8b --quant int4+int8 --recompute products
    PYTHONPATH=. python3 benchmarks/profile_lora.py --shape llama3.2-1b --recompute mlp     # LoRA, bf16 base
"""
import argparse
import collections
import dataclasses
import functools
import math
import time

from bench_lora import BATCH
from reference import batches
from shapes import SHAPES

# the engine layers' calls timed, each its own row (where a phase matters, one row a phase)
NORMS = ("rmsnorm_forward", "rmsnorm_backward", "rmsnorm_matmul_forward", "rmsnorm_matmul_rope_forward",
         "rmsnorm_matmul_swiglu_forward")
ELEMENTWISE = ("rope_forward", "rope_backward", "swiglu_forward", "swiglu_backward", "bias_add", "dropout_forward",
               "embedding_forward", "embedding_backward", "cast_params", "sum_squares", "add_sum_squares")
TIMED = NORMS + ELEMENTWISE + ("matmul_forward", "matmul_backward", "lora_forward", "lora_backward",
                               "lora_forward_group", "lora_backward_group", "attention_forward",
                               "attention_backward", "crossentropy_forward", "crossentropy_forward_backward",
                               "adamw_update")


class Profiler:
    """Intervals of CUDA events: (row of its own time, start, end, children's intervals, FLOPs)."""

    def __init__(self):
        import cupy
        self.cupy = cupy
        self.phase = "step"
        self.host = collections.defaultdict(float)  # phase -> host seconds issuing it (nested phases apart)
        self.stack = []
        self.done = []
        self.enabled = False

    def interval(self, kind, flops=0.0):
        prof = self

        class Interval:
            def __enter__(self):
                if not prof.enabled:
                    return self
                self.kind, self.flops, self.children, self.phase = kind, flops, [], prof.phase
                self.parent = prof.stack[-1] if prof.stack else None
                self.start = prof.cupy.cuda.Event()
                self.start.record()
                prof.stack.append(self)
                return self

            def __exit__(self, *exc):
                if not prof.enabled:
                    return False
                self.end = prof.cupy.cuda.Event()
                self.end.record()
                prof.stack.pop()
                if self.parent is not None:
                    self.parent.children.append(self)
                prof.done.append(self)
                return False
        return Interval()

    def wrap(self, fn, kind, flops=None):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.enabled:  # the steps timed without events: the call alone
                return fn(*args, **kwargs)
            with self.interval(kind, 0.0 if flops is None else flops(*args)):
                return fn(*args, **kwargs)
        return timed

    def set_phase(self, fn, phase):
        @functools.wraps(fn)
        def phased(*args, **kwargs):
            before, self.phase = self.phase, phase
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                self.host[phase] += spent
                self.host[before] -= spent  # the enclosing phase's own host time excludes this one
                self.phase = before
        return phased

    def row(self, iv):
        """The table's row of an interval's own time."""
        k, ph = iv.kind, iv.phase
        enclosing = iv.parent.kind if iv.parent is not None else None
        if k == "gemm":
            if ph == "head":
                return "head: products (logits, input gradient)"
            if ph == "adamw":
                return "AdamW"
            if enclosing is not None and enclosing.startswith("lora"):
                return f"adapters' thin products, {ph}"
            return f"base products (cuBLAS), {ph}"
        if k == "dequantize":
            return f"dequantize, {ph}"
        if ph == "head":
            return "head: cross-entropy and the rest"
        if ph == "adamw":
            return "AdamW"
        if k in NORMS:
            return "RMSNorm (own time), skip copies"
        if k.startswith("attention"):
            return f"{k.replace('_', ' ')}"
        if k.startswith("lora"):
            return f"adapters' thin products, {ph}"
        if k in ("matmul_forward", "matmul_backward"):
            return "products' own time (outside cuBLAS)"
        return k.replace("_forward", "").replace("_backward", "") + " (elementwise)"

    def table(self):
        """{row: [ms, FLOPs]} of the intervals recorded since the last call."""
        self.cupy.cuda.Device().synchronize()
        rows = collections.defaultdict(lambda: [0.0, 0.0])
        for iv in self.done:
            own = self.cupy.cuda.get_elapsed_time(iv.start, iv.end)
            own -= sum(self.cupy.cuda.get_elapsed_time(c.start, c.end) for c in iv.children)
            r = rows[self.row(iv)]
            r[0] += own
            r[1] += iv.flops
        self.done = []
        return rows


def instrument(prof, eng, opt, cfg, B, T):
    """Wrap eng's layers, cuBLAS, the dequantized copies and the phases in prof's intervals."""
    from nanoeuler.model.gpu import quantized, runtime
    layers = eng.layers
    gemm_flops = lambda ta, tb, m, n, k, *rest: 2.0 * m * n * k
    runtime.gemm = prof.wrap(runtime.gemm, "gemm", gemm_flops)
    quantized.dequantize = prof.wrap(quantized.dequantize, "dequantize")
    H, D = cfg.n_heads, cfg.head_dim
    att_fwd = 4.0 * B * H * T * T * D / 2
    for name in TIMED:
        if hasattr(layers, name):
            flops = None
            if name == "attention_forward":
                flops = lambda *a: att_fwd
            elif name == "attention_backward":
                flops = lambda *a: 2.5 * att_fwd
            setattr(layers, name, prof.wrap(getattr(layers, name), name, flops))
    eng.forward_layers = prof.set_phase(eng.forward_layers, "forward")
    eng._backward = prof.set_phase(eng._backward, "backward")
    eng._recompute_layer = prof.set_phase(eng._recompute_layer, "recompute")
    eng._head = prof.set_phase(eng._head, "head")
    opt.step = prof.set_phase(opt.step, "adamw")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(BATCH))
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--quant", metavar="TYPE", help="QLoRA on the base quantized to TYPE (bench_lora.py's --quant); "
                    "default LoRA on the bf16 base")
    ap.add_argument("--recompute", default="products", choices=("none", "mlp", "products", "layer"))
    ap.add_argument("--steps", type=int, default=2, help="profiled steps (the table is their mean)")
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    import cupy
    from bench_lora import random_weights
    from nanoeuler.model import lora
    from nanoeuler.model.engine import make_engine
    from nanoeuler.model.gpu import device_name
    from nanoeuler.model.losses import cross_entropy_backward
    from nanoeuler.model.optimizer import AdamW

    cfg = dataclasses.replace(SHAPES[args.shape], context=args.context)
    B, T = BATCH[args.shape], args.context
    inputs, targets = next(batches(cfg, B, seed=1))
    if args.quant:
        from bench_quantized import engine as quantized_engine, parse_type
        kind, group, head = parse_type(args.quant)
        eng = quantized_engine(cfg, kind, group, head=head)
    else:
        eng = make_engine(cfg, device="gpu", precision="bf16", training=False)
        random_weights(eng)
    cupy.get_default_memory_pool().free_all_blocks()
    trained = lora.attach(eng, lora.make_spec(cfg, args.rank, 2.0 * args.rank))
    opt = AdamW(eng, mask=lora.decay_mask(trained))
    eng.recompute = False if args.recompute == "none" else args.recompute
    prof = Profiler()
    instrument(prof, eng, opt, cfg, B, T)
    sync = cupy.cuda.Device().synchronize

    def step():
        cross_entropy_backward(eng, inputs, targets)
        opt.step(trained, lr=1e-4, weight_decay=0.0, grad_clip=1.0)
        sync()

    for _ in range(args.warmup):
        step()
    plain = []
    prof.host.clear()
    for _ in range(args.steps):  # without events
        t = time.perf_counter()
        step()
        plain.append(1e3 * (time.perf_counter() - t))
    host = {p: 1e3 * t / args.steps for p, t in prof.host.items() if p != "step"}
    host["step"] = sum(plain) / len(plain) - sum(host.values())  # the rest of the step, its final wait included
    prof.enabled = True
    total = collections.defaultdict(lambda: [0.0, 0.0])
    walls = []
    for _ in range(args.steps):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        step()
        end.record()
        end.synchronize()
        walls.append(cupy.cuda.get_elapsed_time(start, end))
        for row, (ms, flops) in prof.table().items():
            total[row][0] += ms / args.steps
            total[row][1] += flops / args.steps
    wall = sum(walls) / len(walls)
    gpu_phase = collections.defaultdict(float)
    for row, (ms, _) in total.items():
        phase = next((p for p in ("forward", "recompute", "backward") if row.endswith(", " + p)), None)
        phase = phase or ("head" if row.startswith("head") else "adamw" if row == "AdamW" else None)
        if phase:
            gpu_phase[phase] += ms
    label = f"QLoRA {args.quant}" if args.quant else "LoRA, bf16 base"
    print(f"{device_name()}: {args.shape} {label}, r {args.rank} on all seven, {B} x {T}, --recompute "
          f"{args.recompute}: {sorted(plain)[len(plain) // 2]:.1f} ms/step without events, {wall:.1f} ms with them "
          f"(mean of {args.steps})")
    print(f"{'part':<52} {'ms':>8} {'%':>6} {'TFLOP/s':>8}")
    covered = 0.0
    for row, (ms, flops) in sorted(total.items(), key=lambda kv: -kv[1][0]):
        covered += ms
        rate = f"{flops / (ms * 1e9):8.0f}" if flops and ms > 0 else ""
        print(f"{row:<52} {ms:8.2f} {100 * ms / wall:6.1f} {rate:>8}")
    print(f"{'not covered by events (launch gaps, host waits)':<52} {wall - covered:8.2f} "
          f"{100 * (wall - covered) / wall:6.1f}")
    # where the host takes about as long to issue a phase as the device to run it, the phase is launch-bound
    print("host time issuing each phase (without the events), ms/step: " + ", ".join(
        f"{p} {host.get(p, 0.0):.1f}" for p in ("forward", "recompute", "backward", "head", "adamw"))
        + f"; the rest of the step, its final wait for the device included, {host['step']:.1f}")
    print("device time of the rows named by phase, ms/step: " + ", ".join(
        f"{p} {gpu_phase[p]:.1f}" for p in ("forward", "recompute", "backward", "head", "adamw")))


if __name__ == "__main__":
    main()
