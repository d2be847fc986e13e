"""Decoding speed at batch 1: ours (plain, graph-captured, self-speculative) beside Hugging Face `transformers`
on the same weights, in one run, with the greedy tokens compared; with --batch N, N prompts decoded together
(generate() over a list: infer/batch.py) beside `transformers`' batched generate with a static cache.

Random weights from the preset's initialisation (scaled up, so the logits are not flat), a short random
prompt, greedy decoding of --tokens new tokens; ms/token is the whole call (prefill of the prompt
included) over the tokens. Hugging Face runs `LlamaForCausalLM` built from our exported tensors (head 0 as
lm_head, export.hf_tensors) with its KV cache: eagerly, and on the GPU also with a static cache and
torch.compile, in the precision ours runs in (bf16 or float32). On the GPU "plain" is ours with each step's
kernels launched one by one from Python, "graph" the same steps replayed as CUDA graphs (the default).
On the GPU the run ends with the greedy step of one row kernel by kernel (`step_table`: each kernel's time,
count a step and share of the copy's bandwidth, one layer's kernels in turn, and what the step spends between
its kernels). Speculative decoding on random weights accepts few drafts (the heads were never trained to
agree): it measures the machinery's overhead, not its gain; a trained checkpoint (--ckpt; --prompt to continue text of
its own rather than random tokens) shows the gain, and the acceptance rate of each head. --temperature T
times sampling (top-p 0.95, as `infer`) instead, ours only.

    PYTHONPATH=. python3 benchmarks/bench_decode.py --preset small --device cpu
    PYTHONPATH=. python3 benchmarks/bench_decode.py --preset base --device gpu
    PYTHONPATH=. python3 benchmarks/bench_decode.py --ckpt nanoeuler.bin --device cpu
    PYTHONPATH=. python3 benchmarks/bench_decode.py --ckpt base.bin --device gpu --prompt "ROMEO:" --no-hf
    PYTHONPATH=. python3 benchmarks/bench_decode.py --preset base --device gpu --batch 64 --tokens 128

--shape NAME instead of --preset: a published model's shape (benchmarks/shapes.py: SmolLM2-135M and 1.7B,
Llama-3.2-1B, Llama-3-8B, Qwen2.5-0.5B) with random weights; transformers runs the same architecture (Llama
or Qwen2, tied or not, Llama 3's RoPE scaling, Qwen's biases) on the same tensors.

    PYTHONPATH=. python3 benchmarks/bench_decode.py --shape llama3-8b --device gpu --batch 32 --tokens 128

--prefill N: the time to the first token of one random N-token prompt (the prompt's forward and the first
token's pick; median of 5 after a warm-up), ours beside `transformers`' forward of the same prompt in the same
precision (SDPA attention, no cache kept beyond the call) and its argmax.

    PYTHONPATH=. python3 benchmarks/bench_decode.py --shape llama3.2-1b --device gpu --prefill 2048

--batch N: N random 8-token prompts, --tokens new tokens each (no stop), prefill included; ours greedy and
sampled (temperature 0.8, top-p 0.95, a seed a prompt), greedy without batch invariance (an engine whose few
rows' products are BLAS's: what invariance costs), and the batch-invariance check that every row's greedy
tokens are its prompt's alone (a few rows decoded one at a time); `transformers` with a static cache and
torch.compile on the same (unpadded, equal-length) batch, greedy. Aggregate tokens/s.
"""
import argparse
import time

import numpy as np

from nanoeuler.model.config import PRESETS, init_params, views
from nanoeuler.io.export import hf_config, hf_tensors
from shapes import SHAPES
from nanoeuler.model.decoding import decoder_of
from nanoeuler.model.engine import make_engine
from nanoeuler.infer.generate import generate


def ours(eng, prompt, n, speculative, temperature=0.0):
    stats, t0 = {}, time.perf_counter()
    tokens = list(generate(eng, prompt, n, temperature=temperature, top_p=0.95, rng=np.random.default_rng(0),
                           speculative=speculative, stats=stats))
    return tokens, time.perf_counter() - t0, stats


def batched(eng, prompts, n, temperature):
    """generate() over the prompts: (their tokens, seconds)."""
    if eng.xp is not np:
        eng.xp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    out = generate(eng, prompts, n, temperature=temperature, top_p=0.95, rng=np.random.default_rng(0))
    return out, time.perf_counter() - t0


def hf_model(cfg, params, device, bf16):
    """transformers' model of cfg's architecture (export --hf's config.json: Llama, Qwen2, tied or not, RoPE
    scaling) built on the device in the precision, holding our tensors, in eval mode."""
    import types
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = hf_config(cfg, types.SimpleNamespace(eos_id=0))
    hf_cfg = AutoConfig.for_model(settings.pop("model_type"), **settings)
    dtype = torch.bfloat16 if bf16 else torch.float32
    with torch.device("cuda" if device == "gpu" else "cpu"):  # made where it runs, in its precision
        try:
            model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
        except TypeError:  # transformers before 4.56 names it torch_dtype
            model = AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=dtype)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in hf_tensors(cfg, params).items()},
                                                strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if cfg.tied else set()), (missing, unexpected)
    if cfg.tied:
        model.tie_weights()
    return model.eval()


def hugging_face(cfg, params, prompt, n, device, compiled, bf16):
    """hf_model's greedy decoding of the prompt(s): (its tokens, seconds)."""
    import torch

    model = hf_model(cfg, params, device, bf16)
    dev = "cuda" if device == "gpu" else "cpu"
    x = torch.tensor(prompt if isinstance(prompt[0], list) else [prompt], device=dev)
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    if compiled:
        # Hugging Face's recipe: a static cache, whose decoding steps generate() compiles itself (transformers
        # 4.47+, compile_config; a model.forward compiled by hand as well would be compiled inside its compiled
        # call); before that, model.forward compiled by hand. mode "reduce-overhead" (CUDA graphs) falls back
        # to "default" where it fails.
        kw["cache_implementation"] = "static"
        try:
            from transformers import CompileConfig
            kw["compile_config"] = CompileConfig(fullgraph=True, mode=compiled)
        except ImportError:
            model.forward = torch.compile(model.forward, mode=compiled, fullgraph=True)
    with torch.no_grad():
        model.generate(x, **kw)  # warm-up (and compilation)
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(x, **kw)
        if dev == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    return out[:, x.shape[1]:].tolist() if isinstance(prompt[0], list) else out[0, len(prompt):].tolist(), seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a published model's shape instead of a preset")
    ap.add_argument("--ckpt", help="a trained checkpoint instead of random weights")
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--precision", choices=("bf16", "tf32", "fp32"), help="the GPU's (default bf16)")
    ap.add_argument("--no-hf", action="store_true", help="skip Hugging Face")
    ap.add_argument("--no-eager", action="store_true",
                    help="Hugging Face compiled only (a large model's eager run is slow)")
    ap.add_argument("--prompt", help="with --ckpt: text to continue (default: 8 random tokens)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature (top-p 0.95, as infer) instead of greedy; no peers")
    ap.add_argument("--batch", type=int, help="decode this many prompts together (see above) instead")
    ap.add_argument("--prefill", type=int, metavar="N", help="time to the first token of an N-token prompt instead")
    args = ap.parse_args()
    if args.prompt is not None and not args.ckpt:
        ap.error("--prompt needs --ckpt (random weights have no tokenizer)")

    if args.ckpt:
        from nanoeuler.io import checkpoint
        ck = checkpoint.load(args.ckpt)
        cfg, params, what = ck.cfg, ck.params, args.ckpt
    else:
        cfg = SHAPES[args.shape] if args.shape else PRESETS[args.preset]
        params = init_params(cfg, seed=0)
        for name, view in views(params, cfg).items():
            if not name.endswith("norm"):
                view *= 3.0  # random weights with logits that are not flat
        if cfg.tokenizer_vocab is not None:  # padding rows (Qwen's) zero, as untrained: transformers does not mask them
            views(params, cfg)["tok_emb"][cfg.tokenizer_vocab:] = 0
        what = f"{args.shape or args.preset}, random weights"
        args.preset = args.shape or args.preset
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, 8).tolist()
    if args.prompt is not None:
        prompt = ck.tokenizer().encode(args.prompt)[: cfg.context // 2] or prompt
    n = min(args.tokens, cfg.context - len(prompt))
    precision = "fp32" if args.device == "cpu" else args.precision or "bf16"
    eng = make_engine(cfg, device=args.device, precision=precision, training=False)
    eng.load_params(params)
    if eng.device_memory() is not None:
        print(f"nanoeuler's engine: {eng.device_memory() / 2 ** 30:.2f} GiB on the GPU ({cfg.n_layers} layers, "
              f"{params.size / 1e9:.2f}B parameters, its weights in {precision} alone)", flush=True)
    T = args.temperature
    if args.batch:
        return batch_rows(args, cfg, params, eng, n, precision)
    if args.prefill:
        return prefill_rows(args, cfg, params, eng, precision)
    # warm-up (numba compilation, kernel compilation; on the GPU the recording of the steps' graphs, which a
    # generation of this length's cache size then replays)
    ours(eng, prompt, n, False, T)
    if cfg.mtp_heads > 1:
        ours(eng, prompt, n, True, T)
    rows = []
    if args.device == "gpu":
        decoder_of(eng).graphs = False
        tokens, seconds, _ = ours(eng, prompt, n, False, T)
        rows.append(("nanoeuler plain (kernel by kernel)", seconds, tokens, ""))
        decoder_of(eng).graphs = True
    plain, seconds, _ = ours(eng, prompt, n, False, T)
    rows.append(("nanoeuler graph" if args.device == "gpu" else "nanoeuler plain", seconds, plain, ""))
    if cfg.mtp_heads > 1:
        spec, seconds, stats = ours(eng, prompt, n, True, T)
        per_head = ", ".join(f"head {k + 1} {a / max(v, 1):.0%}" for k, (v, a) in enumerate(stats["per_head"]))
        rows.append(("nanoeuler --speculative", seconds, spec,
                     f"accepted {stats['accepted']}/{stats['drafted']} drafts in {stats['steps']} forwards "
                     f"({per_head})"))
    if args.device == "gpu":  # the fraction of the memory bandwidth a token's step reaches
        ceiling = copy_bandwidth(eng.xp)
        position = len(prompt) + n // 2  # the KV cache's average length over the run
        name, seconds, tokens, note = rows[1]
        rows[1] = (name, seconds, tokens, bandwidth_note(eng, seconds / n, position, ceiling))
        device = greedy_step_time(eng, prompt, n)
        print(f"device-to-device copy: {ceiling / 1e12:.2f} TB/s (read + written); the device's greedy step "
              f"alone (graph replays, no host): {1e3 * device:.3f} ms, "
              f"{bandwidth_note(eng, device, position, ceiling)}", flush=True)
    how = f"temperature {T}, top-p 0.95 (sampled: the tokens differ)" if T > 0 else "greedy"
    print(f"{what}: batch 1, {how}, {n} new tokens after a {len(prompt)}-token prompt, {args.device} ({precision})")
    print(f"{'decoder':<38} {'ms/token':>9} {'vs first row':>13} {'tokens = first row':>19}  notes")
    for row in rows:
        report(row, rows[0], n)
    if cfg.mtp_heads > 1:
        print(f"--speculative: {rows[-2][1] / rows[-1][1]:.2f}x the tokens/s of {rows[-2][0]}", flush=True)
    if args.device == "gpu":
        step_table(eng, position, device, ceiling)
    if not args.no_hf and T == 0:
        bf16 = precision == "bf16"
        if not args.no_eager:
            hf, seconds = hugging_face(cfg, params, prompt, n, args.device, None, bf16)
            report(("transformers eager", seconds, hf, ""), rows[0], n)
        if args.device == "gpu":
            for mode in ("reduce-overhead", "default"):
                try:
                    hfc, seconds = hugging_face(cfg, params, prompt, n, args.device, mode, bf16)
                except Exception as e:  # noqa: BLE001 - a failing peer is reported, the benchmark goes on
                    print(f"transformers static cache + compile ({mode}): failed, {type(e).__name__}")
                    continue
                report((f"transformers static cache + compile ({mode})", seconds, hfc, ""), rows[0], n)
                break


def prefill_rows(args, cfg, params, eng, precision, repeats=5):
    """--prefill: ours and transformers' time to the first token of one random prompt of args.prefill tokens."""
    N = min(args.prefill, cfg.context - 1)
    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, N).tolist()
    sync = eng.xp.cuda.Device().synchronize if eng.xp is not np else (lambda: None)

    def first_token():
        sync()
        t0 = time.perf_counter()
        token = list(generate(eng, prompt, 1, temperature=0.0))
        sync()
        return time.perf_counter() - t0, token

    first_token()  # warm-up: kernels compiled, the prompt's shapes planned
    ours_s, token = sorted(first_token() for _ in range(repeats))[repeats // 2]
    print(f"{args.preset}: time to the first token of a {N}-token prompt, batch 1, {args.device} ({precision}), "
          f"median of {repeats}")
    print(f"{'nanoeuler generate(), 1 token':<44} {1e3 * ours_s:9.2f} ms  {N / ours_s:>10,.0f} prompt tokens/s")
    if args.no_hf:
        return
    import torch

    model = hf_model(cfg, params, args.device, precision == "bf16")  # SDPA: transformers' default attention
    dev = "cuda" if args.device == "gpu" else "cpu"
    x = torch.tensor([prompt], device=dev)

    def hf_first_token():
        with torch.no_grad():
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            token = int(model(input_ids=x, logits_to_keep=1).logits[0, -1].argmax())
            if dev == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t0, [token]

    hf_first_token()
    hf_s, hf_token = sorted(hf_first_token() for _ in range(repeats))[repeats // 2]
    print(f"{'transformers forward (SDPA) + argmax':<44} {1e3 * hf_s:9.2f} ms  {N / hf_s:>10,.0f} prompt tokens/s  "
          f"(ours: {hf_s / ours_s:.2f}x; first token equal: {hf_token == token})")


def batch_rows(args, cfg, params, eng, n, precision):
    """--batch: ours greedy and sampled, the invariance check, `transformers` static cache + compile."""
    N = args.batch
    prompts = np.random.default_rng(1).integers(0, cfg.vocab_size, (N, 8)).tolist()
    batched(eng, prompts, n, 0.0)  # warm-up: compiles the kernels and records the steps' graphs (this cache size's)
    batched(eng, prompts, n, 0.8)
    print(f"{args.preset}, random weights: batch {N}, {n} new tokens after 8-token prompts, {args.device} "
          f"({precision}); tokens/s over all rows, prefill included")
    greedy, seconds = batched(eng, prompts, n, 0.0)
    first = N * n / seconds
    print(f"{'nanoeuler generate() greedy':<44} {N * n / seconds:>10,.0f} tokens/s  {1e3 * seconds / n:7.3f} ms a step")
    sampled, seconds = batched(eng, prompts, n, 0.8)
    print(f"{'nanoeuler generate() top-p 0.95, T 0.8':<44} {N * n / seconds:>10,.0f} tokens/s  "
          f"{1e3 * seconds / n:7.3f} ms a step")
    loose = make_engine(cfg, device=args.device, precision=precision, batch_invariant=False, training=False)
    loose.load_params(params)
    batched(loose, prompts, n, 0.0)  # warm-up
    fast, seconds = batched(loose, prompts, n, 0.0)
    agree = sum(a == b for x, y in zip(fast, greedy) for a, b in zip(x, y))
    print(f"{'nanoeuler generate() greedy, not invariant':<44} {N * n / seconds:>10,.0f} tokens/s  "
          f"{1e3 * seconds / n:7.3f} ms a step  (--no-batch-invariance: BLAS's products; invariance costs "
          f"{1 - first / (N * n / seconds):.0%} of these tokens/s; tokens equal to the invariant run's: "
          f"{agree}/{N * n})")
    if loose.xp is not np:
        print(f"the device's time of one decoding step of {N} rows, not invariant: {step_time(loose, N):.3f} ms")
    del loose
    if eng.xp is not np:
        for rows in sorted({1, N}):
            print(f"the device's time of one decoding step of {rows} rows (graph replays, no host): "
                  f"{step_time(eng, rows):.3f} ms")
        times = {rows: kernel_times(eng, rows, 130, 400) for rows in sorted({1, N})}
        print("a layer's kernels one by one (us, launch included): "
              + "; ".join(f"{k} " + " / ".join(f"{times[r][k]:.1f}" for r in times) for k in times[1]))
    alone = [r for r in range(0, N, max(1, N // 4))]
    same = all(list(generate(eng, prompts[r], n, temperature=0)) == greedy[r] for r in alone)
    print(f"batch invariance: rows {alone} decoded alone give the batch's tokens: {same}")
    if args.no_hf:
        return
    try:
        hf, seconds = hugging_face(cfg, params, prompts, n, args.device, "default" if args.device == "gpu" else None,
                                   precision == "bf16")
    except Exception as e:  # noqa: BLE001 - a failing peer is reported, the benchmark goes on
        print(f"transformers static cache + compile: failed, {type(e).__name__}: {e}")
        return
    agree = sum(a == b for x, y in zip(hf, greedy) for a, b in zip(x, y))
    print(f"{'transformers static cache + compile, greedy':<44} {N * n / seconds:>10,.0f} tokens/s  "
          f"{1e3 * seconds / n:7.3f} ms a step  (ours: {first / (N * n / seconds):.1f}x; tokens equal to ours: "
          f"{agree}/{N * n})", flush=True)


def greedy_step_time(eng, prompt, repeats=200):
    """Seconds of one greedy decoding step of one sequence after the prompt as the device runs it: the recorded
    step (argmax on the device, its id fed to the next) replayed `repeats` times back to back (the positions
    len(prompt) + 2 on), timed by CUDA events."""
    cp = eng.xp
    decoder = decoder_of(eng)
    cache = decoder.new_cache(1, min(eng.cfg.context, 1 << (len(prompt) + repeats + 8).bit_length()))
    decoder.greedy(cache, np.array([prompt], np.int32))  # the prompt's prefill
    decoder.greedy(cache, np.zeros((1, 1), np.int32), steps=2)  # the one-token step, recorded
    step = next(s for key, s in cache.steps.items() if key[:3] == ("greedy", 1, 1))
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(repeats):
        step.run()  # each moves the device's position on by one
    end.record()
    end.synchronize()
    cache.rewind(0)
    decoder.release(cache)
    return cp.cuda.get_elapsed_time(start, end) / 1e3 / repeats


def step_time(eng, rows, repeats=200):
    """ms of one decoding step of `rows` sequences as the device runs it: replays of the recorded step, timed
    by CUDA events (the state left by the last run: positions stay inside the context)."""
    cp = eng.xp
    decoder = decoder_of(eng)
    cache = decoder.new_cache(rows + 1)  # as BatchGenerator's: a slot a row and a scratch one
    step = decoder.batch_step(cache, rows, 1)
    counter = step.fields["counter"]
    counter[...] = 0
    step.run()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for i in range(repeats):
        if i % 16 == 0:
            counter[...] = 0  # the log holds CHAINED steps
        step.run()
    end.record()
    end.synchronize()
    decoder.release(cache)
    return cp.cuda.get_elapsed_time(start, end) / repeats


def kernel_times(eng, rows, position, repeats=100):
    """{kernel: us} of a decoding step's kernels at `rows` sequences of one token at `position` (one layer's):
    each recorded 20 times over as a CUDA graph, the replays timed by CUDA events."""
    cp, layers, cfg, p = eng.xp, eng.layers, eng.cfg, eng.p
    H, G, D, C, F, V = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim, cfg.hidden, cfg.vocab_size
    e = lambda *shape: cp.zeros(shape, dtype=eng.act)
    x, qkv, att, gate_up, sw = e(rows, C), e(rows, 1, H + 2 * G, D), e(rows, 1, H, D), e(rows, 2 * F), e(rows, F)
    rstd, lse, logits = cp.zeros(rows, np.float32), cp.zeros((rows, H, 1), np.float32), cp.zeros((rows, V), np.float32)
    kv = e(rows, cfg.context, 2 * G, D)
    pos, slots = cp.full(rows, position, np.int32), cp.arange(rows, dtype=np.int32)
    settings = [cp.full(rows, v, dtype) for v, dtype in ((0, np.int32), (0.8, np.float32), (0.95, np.float32),
                                                          (1, np.uint32), (0, np.uint32), (3, np.int32))]
    ids = cp.zeros(rows, np.int32)
    # the argmax and the sampler read a model's kind of row (the head's output here is zeros, a flat row)
    z = cp.asarray(np.random.default_rng(0).normal(0.0, 2.0, (rows, V)).astype(np.float32))
    w = "layers.0."
    calls = {
        "qkv + norm + rope": lambda: layers.rmsnorm_matmul_rope_forward(
            qkv, rstd, x, p[w + "attn_norm"], p[w + "wqkv"], cfg.norm_eps, None, eng.cos, eng.sin, H + G, pos),
        f"attention at {position}": lambda: layers.attention_cached(att, lse, qkv, kv, H, G, pos, slots),
        "wo, +=": lambda: layers.matmul_forward(x, att.reshape(rows, -1), p[w + "wo"], accumulate=True),
        "gate|up + norm + swiglu": lambda: layers.rmsnorm_matmul_swiglu_forward(
            sw, gate_up, rstd, x, p[w + "ffn_norm"], p[w + "w_gate_up"], cfg.norm_eps, None),
        "down, +=": lambda: layers.matmul_forward(x, sw, p[w + "w_down"], accumulate=True),
        "head 0, float32": lambda: layers.matmul_forward(logits, x, p["heads.0"]),
        "argmax": lambda: layers.argmax(ids, z),
        "sample, greedy": lambda: layers.sample_rows(ids, z, settings[0], cp.zeros(rows, np.float32), *settings[2:]),
        "sample, top-p 0.95": lambda: layers.sample_rows(ids, z, *settings),
        "sample, top-k 50 + top-p 0.95": lambda: layers.sample_rows(ids, z, cp.full(rows, 50, np.int32),
                                                                    *settings[1:]),
        "sample, top-p 0.95, a flat row": lambda: layers.sample_rows(ids, logits, *settings),
    }
    return timed(eng, calls, repeats)


def timed(eng, calls, repeats):
    """{name: us} of each call of calls {name: call}: recorded 20 times over as a CUDA graph, the replays timed
    by CUDA events (launch included)."""
    cp, out = eng.xp, {}
    for name, call in calls.items():
        replay = eng.layers.graph(lambda: [call() for _ in range(20)])
        replay()  # records
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(repeats // 20):
            replay()
        end.record()
        end.synchronize()
        out[name] = 1e3 * cp.cuda.get_elapsed_time(start, end) / (repeats // 20 * 20)
    return out


def step_table(eng, position, device, ceiling, repeats=200):
    """The greedy step of one row kernel by kernel, printed: each kernel of the step (one layer's, at `position`)
    timed as kernel_times does, its count a step and its bytes' share of the copy's rate; one layer's kernels
    recorded in turn (as the step runs them: each waits for the one before), and the sum of the step's kernels
    against the device's step: what is left is the time between the kernels that neither shows."""
    from nanoeuler.model.gpu import layers as gpu_layers  # the gate|up product's norm apart: its two kernels

    cp, layers, cfg, p = eng.xp, eng.layers, eng.cfg, eng.p
    H, G, D, C, F, V = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim, cfg.hidden, cfg.vocab_size
    e = lambda *shape: cp.zeros(shape, dtype=eng.act)
    x, qkv, att, gate_up, sw = e(1, C), e(1, 1, H + 2 * G, D), e(1, 1, H, D), e(1, 2 * F), e(1, F)
    rstd, lse, logits = cp.zeros(1, np.float32), cp.zeros((1, H, 1), np.float32), cp.zeros((1, V), np.float32)
    kv, pos = e(1, cfg.context, 2 * G, D), cp.full(1, position, np.int32)
    tokens, ids, moving = cp.zeros(1, np.int32), cp.zeros(1, np.int32), cp.zeros(1, np.int32)
    log = cp.zeros((1024, 1), np.int32)  # the argmax's ids logged at the position it moves on (120 replays)
    w, eps = "layers.0.", cfg.norm_eps
    apart = gpu_layers._norm_apart(p[w + "w_gate_up"], x, None)
    itemsize = np.dtype(eng.act).itemsize
    kv_bytes = 2 * G * D * (position + 1) * itemsize
    nbytes = lambda *names: sum(p[k].nbytes for k in names)
    kernels = {  # name: (call, kernels of it a step, bytes it must read)
        "embedding": (lambda: layers.embedding_forward(x, tokens, p["tok_emb"]), 1, C * itemsize),
        "qkv + norm + rope": (lambda: layers.rmsnorm_matmul_rope_forward(
            qkv, rstd, x, p[w + "attn_norm"], p[w + "wqkv"], eps, None, eng.cos, eng.sin, H + G, pos),
            cfg.n_layers, nbytes(w + "wqkv")),
        f"attention at {position}": (lambda: layers.attention_cached(att, lse, qkv, kv, H, G, pos), cfg.n_layers,
                                     kv_bytes),
        "wo, +=": (lambda: layers.matmul_forward(x, att.reshape(1, -1), p[w + "wo"], accumulate=True),
                   cfg.n_layers, nbytes(w + "wo")),
    }
    if apart:  # the step's two kernels: rmsnorm_rows into its kept scratch, then the product
        norm = lambda: gpu_layers._normed_rows(rstd, x, p[w + "ffn_norm"], eps, None)
        normed = norm()
        kernels["gate|up's norm (rmsnorm_rows)"] = (norm, cfg.n_layers, 0)
        kernels["gate|up + swiglu"] = (lambda: gpu_layers._matmul_small(
            gate_up, normed, p[w + "w_gate_up"], False, glu_out=sw), cfg.n_layers, nbytes(w + "w_gate_up"))
    else:
        kernels["gate|up + norm + swiglu"] = (lambda: layers.rmsnorm_matmul_swiglu_forward(
            sw, gate_up, rstd, x, p[w + "ffn_norm"], p[w + "w_gate_up"], eps, None), cfg.n_layers,
            nbytes(w + "w_gate_up"))
    kernels["down, +="] = (lambda: layers.matmul_forward(x, sw, p[w + "w_down"], accumulate=True), cfg.n_layers,
                           nbytes(w + "w_down"))
    kernels["head 0 + final norm, float32"] = (lambda: layers.rmsnorm_matmul_forward(
        logits, rstd, x, p["final_norm"], p["heads.0"], eps, None), 1, nbytes("heads.0") + 4 * V)
    kernels["argmax + the position's advance"] = (lambda: layers.argmax(ids, logits, log, moving, 1), 1, 4 * V)
    layer = [name for name, (_, count, _) in kernels.items() if count == cfg.n_layers]
    times = timed(eng, {name: call for name, (call, _, _) in kernels.items()}, repeats)
    chain = timed(eng, {"layer": lambda: [kernels[name][0]() for name in layer]}, repeats)["layer"]
    moving[...] = 0
    print(f"the greedy step of one row, kernel by kernel (each recorded 20 times over in a graph and replayed, "
          f"CUDA events, launch included; % of the copy's {ceiling / 1e12:.2f} TB/s):")
    print(f"{'kernel':<34} {'us':>7} {'a step':>7} {'us a step':>10} {'bytes':>10} {'% of copy':>9}")
    total = 0.0
    for name, (_, count, read) in kernels.items():
        total += times[name] * count
        share = f"{read / (times[name] * 1e-6) / ceiling:.0%}" if read else ""
        print(f"{name:<34} {times[name]:7.1f} {count:7d} {times[name] * count:10.1f} {read / 1e6:9.2f}M {share:>9}")
    print(f"{'the sum':<34} {'':7} {sum(c for _, c, _ in kernels.values()):7d} {total:10.1f}")
    print(f"{'a layer its kernels in turn':<34} {chain:7.1f} {cfg.n_layers:7d} {chain * cfg.n_layers:10.1f}  "
          f"(the kernels alone: {sum(times[k] for k in layer):.1f} us a layer)")
    print(f"{'the device step':<34} {'':7} {'':7} {1e6 * device:10.1f}  between the kernels: "
          f"{1e6 * device - total:.1f} us ({(1e6 * device - total) / sum(c for _, c, _ in kernels.values()):.2f} "
          f"a kernel)", flush=True)


def step_bytes(eng, position):
    """The bytes a one-row decoding step must read at `position`: every layer's weights, the final norm and head
    0 once, the KV cache's rows before it, the float32 logits written and read back (the token's embedding row
    is noise)."""
    cfg, p = eng.cfg, eng.p
    fused = ("wqkv", "bqkv", "w_gate_up")  # views of the same memory as wq..wv, w_gate and w_up
    weights = sum(v.nbytes for k, v in p.items() if k.startswith("layers.") and k.rsplit(".", 1)[-1] not in fused)
    weights += p["final_norm"].nbytes + p["heads.0"].nbytes
    kv = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * position * np.dtype(eng.act).itemsize
    return weights + kv + 2 * 4 * cfg.vocab_size


def copy_bandwidth(cp, nbytes=2 << 30, repeats=10):
    """Bytes a second of a device-to-device copy of nbytes, counting bytes read plus bytes written (the ceiling
    the bandwidth fractions are against), measured in the same run: the median of `repeats` copies."""
    src, dst = cp.ones(nbytes // 4, np.float32), cp.empty(nbytes // 4, np.float32)
    times = []
    for _ in range(repeats + 2):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        cp.copyto(dst, src)
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    del src, dst
    return 2 * nbytes / float(np.median(times[2:]))


def bandwidth_note(eng, seconds_a_token, position, ceiling):
    """"X GB at Y TB/s, Z of the copy's" for a step of seconds_a_token at `position`."""
    nbytes = step_bytes(eng, position)
    rate = nbytes / seconds_a_token
    return f"{nbytes / 1e9:.3f} GB a token at {rate / 1e12:.2f} TB/s: {rate / ceiling:.0%} of the copy's"


def report(row, first, n):
    name, seconds, tokens, note = row
    same = sum(a == b for a, b in zip(tokens, first[2]))
    print(f"{name:<38} {1e3 * seconds / n:9.3f} {seconds / first[1]:12.2f}x {same:>12}/{n}  {note}", flush=True)


if __name__ == "__main__":
    main()
