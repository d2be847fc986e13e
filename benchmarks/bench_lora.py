"""LoRA fine-tuning steps on the GPU engine next to PEFT + transformers training the same adapters, in one run.

Shapes of published models (benchmarks/shapes.py) on random weights: Llama-3.2-1B with LoRA r 16 on all seven
projections at 4 x 2048, and Llama-3-8B's shape at 2 x 2048 (its QLoRA peer needs bitsandbytes, which the GPU
machine may lack: then both sides run LoRA on a bf16 base). Ours: the base frozen in bf16 (an engine without
master weights or gradients), the adapters' float32 master weights, gradients and AdamW moments, bf16
activations; with --recompute's modes (mlp: the attention's results kept, the norms and gate|up with SwiGLU
recomputed; products: the attention's output kept, the norms and the products around it recomputed; layer: the
whole layer recomputed) and without; beside it our full SFT step of the same model and
batch; with --quant, QLoRA rows: the same adapters on the base's matrices quantized (random int8/int4 blocks made
on the device, as bench_quantized.py makes them), with --recompute. PEFT's:
LlamaForCausalLM in bf16 with SDPA attention, `get_peft_model` with the same rank, alpha and targets, gradient
checkpointing (non-reentrant), fused AdamW over the adapters; eager, then torch.compile where it compiles in
time. A step is forward, backward, gradient clipping and AdamW, ending with the loss on the host. Printed: ms/step,
tokens/s and the peak GPU memory (ours: CuPy's pool, which only grows, after the steps; torch: its peak
allocation; and CUDA's used memory seen at the end of each row, cudaMemGetInfo). Our pool's blocks are handed
back to CUDA once the engine is made: making random weights on the device leaves gigabytes of freed temporaries
in the pool, which loading a checkpoint does not (a 64 MiB piece at most).

    PYTHONPATH=. python3 benchmarks/bench_lora.py                       # 1B and 8B, every row
    PYTHONPATH=. python3 benchmarks/bench_lora.py --shapes llama3.2-1b --compile
    PYTHONPATH=. python3 benchmarks/bench_lora.py --shapes llama3-8b --quant int4 --compile  # QLoRA on the 8B
    PYTHONPATH=. python3 benchmarks/bench_lora.py --shapes llama3-8b --quant int4 --quant-only  # that row alone
    PYTHONPATH=. python3 benchmarks/bench_lora.py --shapes llama3.2-1b --compile --no-full --no-peft  # ours only
"""
import argparse
import dataclasses
import gc
import math
import time

import numpy as np

from bench_gpu_train import time_steps
from reference import batches
from shapes import SHAPES

BATCH = {"llama3.2-1b": 4, "llama3-8b": 2}


def cuda_used():
    import cupy
    free, total = cupy.cuda.runtime.memGetInfo()
    return total - free


def random_weights(eng, seed=0):
    """Fill a GPU engine's weights with N(0, 0.02) and its norm gains with ones, on the device (no host copy
    of a large model)."""
    import cupy
    rng = cupy.random.default_rng(seed)
    target = eng.params if eng.params is not None else eng.weights
    for name, (off, shape) in eng.layout.items():
        n = math.prod(shape)
        piece = (cupy.ones(n, dtype=cupy.float32) if name.endswith("norm")
                 else rng.standard_normal(n, dtype=cupy.float32) * 0.02)
        if target.dtype == cupy.float32:
            target[off:off + n] = piece
        else:
            eng.layers.cast_params(target[off:off + n], piece)
        del piece
    eng.sync_weights()


def free_memory():
    """What a failed row left in CuPy's pool and torch's caching allocator, handed back."""
    import cupy
    import torch
    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()


def bench_ours(cfg, inputs, targets, args, mode, recompute=False):
    """mode: 'lora', 'qlora' (the base's matrices args.quant) or 'full'; recompute: the engine's (False, 'mlp',
    'products', 'layer')."""
    import cupy
    from nanoeuler.model import lora
    from nanoeuler.model.engine import make_engine
    from nanoeuler.model.losses import cross_entropy_backward
    from nanoeuler.model.optimizer import AdamW

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    full = mode == "full"
    if mode.startswith("qlora"):
        from bench_quantized import engine as quantized_engine, parse_type
        kind, group, head = parse_type(args.quant)
        eng = quantized_engine(cfg, kind, group, head=head)
    else:
        eng = make_engine(cfg, device="gpu", precision="bf16", training=full)
        random_weights(eng)
    pool.free_all_blocks()  # the random weights' temporaries
    if full:
        trained, opt = eng, AdamW(eng)
    else:
        trained = lora.attach(eng, lora.make_spec(cfg, args.rank, 2.0 * args.rank))
        opt = AdamW(eng, mask=lora.decay_mask(trained))
        eng.recompute = recompute

    def step():
        loss = cross_entropy_backward(eng, inputs, targets)[0]
        opt.step(trained, lr=1e-4, weight_decay=0.0, grad_clip=1.0)
        return loss

    med, _, loss = time_steps(step, cupy.cuda.Device().synchronize, args.warmup, args.steps)
    mem, used = pool.total_bytes(), cuda_used()
    del eng, trained, opt
    gc.collect()
    pool.free_all_blocks()
    return med, loss, mem, used


def bench_peft(cfg, inputs, targets, args, compiled=False):
    import torch
    import transformers
    import peft

    torch.cuda.empty_cache()
    hf = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.hidden,
                                  num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                                  num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                                  max_position_embeddings=cfg.context, rms_norm_eps=cfg.norm_eps,
                                  rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tied,
                                  attn_implementation="sdpa", torch_dtype=torch.bfloat16)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(hf)
    torch.set_default_dtype(torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    conf = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, task_type="CAUSAL_LM",
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"])
    model = peft.get_peft_model(model, conf)
    for p in model.parameters():  # the adapters' master weights in float32, as ours (and PEFT's Trainer)
        if p.requires_grad:
            p.data = p.data.float()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    forward = torch.compile(model) if compiled else model
    x = torch.tensor(inputs, device="cuda", dtype=torch.long)
    y = torch.tensor(targets[0], device="cuda", dtype=torch.long)
    torch.cuda.reset_peak_memory_stats()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = forward(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    med, _, loss = time_steps(step, torch.cuda.synchronize, args.warmup, args.steps)
    mem, used = torch.cuda.max_memory_allocated(), cuda_used()
    del model, forward, opt, params
    gc.collect()
    torch.cuda.empty_cache()
    return med, loss, mem, used


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["llama3.2-1b", "llama3-8b"], choices=sorted(BATCH))
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile", nargs="*", default=["llama3.2-1b"], choices=sorted(BATCH), metavar="SHAPE",
                    help="the shapes that also get a torch.compile row (default llama3.2-1b; none: no such rows)")
    ap.add_argument("--no-full", action="store_true", help="leave out our full-SFT rows")
    ap.add_argument("--quant", metavar="TYPE", help="also QLoRA rows on the base quantized to TYPE: int8 or int4, "
                    "a group after a colon (default 32), the heads' type after a + (default the layers'), e.g. "
                    "int4:64 or int4+int8 (quantize's default)")
    ap.add_argument("--quant-only", action="store_true", help="the QLoRA rows of --quant alone")
    ap.add_argument("--recompute", nargs="+", default=["mlp", "layer"],
                    choices=("mlp", "products", "layer", "none"),
                    help="our --recompute rows' modes (default mlp and layer; none: without recomputation)")
    ap.add_argument("--no-peft", action="store_true", help="leave out PEFT's rows (ours alone)")
    args = ap.parse_args()
    if args.quant_only and not args.quant:
        ap.error("--quant-only needs --quant")
    from nanoeuler.model.gpu import device_name

    print(f"{device_name()}: LoRA r {args.rank} (alpha {2 * args.rank}) on q,k,v,o,gate,up,down, bf16 base, T "
          f"{args.context}; {args.warmup} warm-up steps, median of {args.steps}", flush=True)
    print(f"{'shape':<12} {'engine':<40} {'batch':>5} {'ms/step':>8} {'tokens/s':>9} {'peak GiB':>9} "
          f"{'CUDA used':>9} {'loss':>8} {'ours/this':>9}", flush=True)
    # in order of what matters most, so that a run cut short has measured it: ours with --recompute (each mode)
    # and PEFT's eager step of every shape, then ours without --recompute and full SFT, then the torch.compile rows
    tiers, first = ([], [], []), {}
    for name in args.shapes:
        cfg = dataclasses.replace(SHAPES[name], context=args.context)
        B = BATCH[name]
        inputs, targets = next(batches(cfg, B, seed=1))
        run = lambda mode, recompute=False, cfg=cfg, inputs=inputs, targets=targets: bench_ours(
            cfg, inputs, targets, args, mode, recompute)
        peer = lambda compile, cfg=cfg, inputs=inputs, targets=targets: bench_peft(cfg, inputs, targets, args, compile)
        if args.quant:  # first: what --quant asks for
            tiers[0].extend((name, B, f"ours QLoRA {args.quant} --recompute {mode}",
                             lambda run=run, mode=mode: run("qlora", False if mode == "none" else mode))
                            for mode in args.recompute)
            if args.quant_only:
                continue
        tiers[0].extend((name, B, f"ours LoRA --recompute {mode}",
                         lambda run=run, mode=mode: run("lora", False if mode == "none" else mode))
                        for mode in args.recompute if mode != "none")
        if not args.no_peft:
            tiers[0].append((name, B, "PEFT + transformers eager, SDPA, ckpt", lambda peer=peer: peer(False)))
        tiers[1].append((name, B, "ours LoRA", lambda run=run: run("lora")))
        if not args.no_full and name == "llama3.2-1b":
            tiers[1].append((name, B, "ours full SFT", lambda run=run: run("full")))
        if name in args.compile and not args.no_peft:
            tiers[2].append((name, B, "PEFT + transformers compiled, SDPA, ckpt", lambda peer=peer: peer(True)))
    for name, B, label, bench in tiers[0] + tiers[1] + tiers[2]:
        try:
            med, loss, mem, used = bench()
        except Exception as e:  # an out-of-memory row, or a compile that fails: said, and the others go on
            print(f"{name:<12} {label:<40} {B:5d} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
            free_memory()
            continue
        first.setdefault(name, med)
        tps = B * args.context / (med / 1e3)
        print(f"{name:<12} {label:<40} {B:5d} {med:8.1f} {tps:9.0f} {mem / 2**30:9.2f} {used / 2**30:9.2f} "
              f"{loss:8.4f} {med / first[name]:8.2f}x", flush=True)  # first: ours with the first --recompute mode

if __name__ == "__main__":
    main()
