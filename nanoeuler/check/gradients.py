"""`nanoeuler check`: every hand-written backward pass against finite differences, tensor by tensor.

Four models of the small preset's shape (4 layers, 4 query heads sharing 2 kv heads, RoPE) at reduced width
(dim 32, hidden 96, vocab 64): one with K = 1 prediction head, as the shipped `small`, one with K = 2
(multi-token heads), one with K = 1 whose head is its embedding (tied, as imported SmolLM or Llama 3.2: one
tensor whose gradient is the sum of the head's and the embedding's), and that one with biases on q, k and v
(as imported Qwen2: added before the rotary embedding). The CPU engine runs each
in float64 on a batch of two 24-token sequences (long enough for the causal mask to matter) with some
targets set to -1 (problems.random_problem). For 8 random entries of every parameter tensor (`--samples`),
the analytic gradient of the training loss is compared with a fourth-order central difference

    g ~ (8 (L(p+h) - L(p-h)) - (L(p+2h) - L(p-2h))) / (12 h),   h = 1e-3,

whose truncation error (O(h^4)) and rounding error (~1e-16 |L| / h) both sit near 1e-12, far below the
1e-6 threshold, so any error the check reports is the backward pass's. The error of an entry is
|fd - analytic| / max(|fd|, |analytic|) (0 when both are 0): relative, so a tensor with small gradients is
held to the same standard as one with large ones. Parameters are drawn at a larger scale than the
training init (std 0.15, norm gains 1 +- 0.2) so every layer has gradients well above rounding noise and
softmax and SiLU leave their linear regimes. The check fails (exit status 1) if any entry's error is
1e-6 or more.

LoRA (model/lora.py): the same loss's finite differences in every adapter tensor (A and B of q, k, v, o, gate, up
and down in every layer; rank 4, scale 2, entries normal(0, 0.1)) of a frozen base, with dropout off and at 0.25
(a fixed key, so the loss is a deterministic function of the adapters), on the first and last models.

    nanoeuler check            # CPU engine vs finite differences: the tensors of 4 models, DPO and LoRA
    nanoeuler check --gpu      # GPU kernels and gradients vs the CPU engine (nanoeuler/check/gpu.py)
"""
import math
import time

import numpy as np

from nanoeuler.model.config import Config, param_layout
from nanoeuler.check.problems import quantized_problem, random_problem, relative_error
from nanoeuler.model.losses import cross_entropy, cross_entropy_backward, sequence_logprobs
from nanoeuler.train.objectives import chosen_tokens, dpo_backward, dpo_loss, dpo_margins

THRESHOLD = 1e-6
# The small preset's structure at reduced width; head_dim 8. K = 1 is the shipped `small`, K = 2 checks the
# multi-token heads (their fused matmul, the mean over heads, a target -1 in one head only), tied checks an
# imported model's one embedding-and-head tensor.
_SHAPE = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, hidden=96, vocab_size=64, context=24)
CHECK_CONFIGS = (Config(**_SHAPE, mtp_heads=1), Config(**_SHAPE, mtp_heads=2), Config(**_SHAPE, mtp_heads=1, tied=True),
                 Config(**_SHAPE, mtp_heads=1, tied=True, qkv_bias=True))
# LoRA (model/lora.py) is checked on the first and last models, with dropout off and on
LORA_RANK, LORA_DROPOUT = 4, 0.25
LORA_CONFIGS = (CHECK_CONFIGS[0], CHECK_CONFIGS[-1])
# QLoRA: the adapters on the first model with its matrices quantized (model/quantize.py), dropout on
QLORA_TYPES = ("int8", "int4")
# The preference objective is checked as shipped: DPO plus RPO's chosen-reply NLL (dpo.DEFAULT_RPO_ALPHA).
DPO_ALPHA = 1.0


def gradient_check(cfg, samples=8, seed=0, h=1e-3, report=print):
    """Finite differences of one model (float64, CPU engine) against its backward pass.
    Returns {tensor name: max relative error over its sampled entries}."""
    from nanoeuler.model.engine import make_engine

    rng = np.random.default_rng(seed)
    eng = make_engine(cfg, device="cpu", dtype=np.float64)
    flat, inputs, targets = random_problem(cfg, rng)
    eng.load_params(flat)
    cross_entropy_backward(eng, inputs, targets)
    analytic = eng.grads.copy()

    def loss_at(index, delta):
        eng.params[index] = flat[index] + delta
        loss = cross_entropy(eng, inputs, targets)[0]
        eng.params[index] = flat[index]
        return loss

    return _compare(cfg, eng, flat, analytic, loss_at, inputs, samples, rng, h, report)


def dpo_problem(cfg, rng, pairs=2, beta=0.5):
    """(flat params, inputs (2P, T), targets (K, 2P, T), beta) for the DPO check: P pairs of random sequences
    (chosen rows first, then rejected), each with a random prompt length masked with -1 in every head as SFT
    does, and padding after a random end."""
    flat, _, _ = random_problem(cfg, rng)
    T, K, B = cfg.context, cfg.mtp_heads, 2 * pairs
    seq = rng.integers(0, cfg.vocab_size, (B, T + K))
    targets = np.full((K, B, T), -1, dtype=np.int32)
    for b in range(B):
        n_prompt, end = int(rng.integers(2, T // 2)), int(rng.integers(T // 2 + 2, T + K + 1))
        for k in range(K):
            for t in range(T):
                if n_prompt <= t + 1 + k < end:
                    targets[k, b, t] = seq[b, t + 1 + k]
    return flat, seq[:, :T].astype(np.int32), targets, beta


def dpo_gradient_check(cfg, samples=8, seed=0, h=1e-3, report=print, beta=0.5, alpha=DPO_ALPHA):
    """Finite differences of the preference objective (train/objectives.dpo_backward: DPO plus RPO's chosen-reply
    NLL per token weighted by alpha) against its analytic gradient, float64 CPU engine, as gradient_check
    does for the training loss."""
    from nanoeuler.model.engine import make_engine

    rng = np.random.default_rng(seed + 1)
    eng = make_engine(cfg, device="cpu", dtype=np.float64)
    flat, inputs, targets, beta = dpo_problem(cfg, rng, beta=beta)
    eng.load_params(flat)
    pi = sequence_logprobs(eng, inputs, targets)
    ref = pi + rng.normal(0.0, 2.0, pi.shape)  # a reference model a little away from the policy
    dpo_backward(eng, inputs, targets, ref, beta, alpha=alpha)
    analytic = eng.grads.copy()
    tokens = chosen_tokens(targets)

    def loss_at(index, delta):
        eng.params[index] = flat[index] + delta
        pi = sequence_logprobs(eng, inputs, targets)
        z = dpo_margins(pi, ref, beta)
        loss = dpo_loss(z, len(z), pi, alpha, tokens)
        eng.params[index] = flat[index]
        return loss

    return _compare(cfg, eng, flat, analytic, loss_at, inputs, samples, rng, h, report,
                    skip=[f"heads.{k}" for k in range(1, cfg.mtp_heads)])


def lora_problem(cfg, rng, dropout, quant=None, dtype=np.float64):
    """(frozen base engine in float64, adapters, their flat values, inputs, targets) for the LoRA check: the
    random problem's base frozen, adapters of rank 4 (alpha 8: a scale of 2) on all seven targets with entries
    normal(0, 0.1) (B too, so both factors have gradients), dropout p on the adapters' inputs (a fixed key).
    quant "int8" / "int4": the base's matrices quantized in groups of 32, its heads int8 (QLoRA on what `quantize`
    writes: the differences are those of the same quantized model); dtype: the engine's (float64 for the check)."""
    from nanoeuler.model import lora
    from nanoeuler.model.engine import make_engine

    flat, inputs, targets = random_problem(cfg, rng)
    quantized = None
    if quant is not None:
        cfg, flat, quantized = quantized_problem(cfg, flat, quant, 32, head="int8")
    eng = make_engine(cfg, device="cpu", dtype=dtype, training=False)
    eng.load_params(flat, quantized)
    ad = lora.attach(eng, lora.make_spec(cfg, LORA_RANK, 2.0 * LORA_RANK, dropout))
    values = rng.normal(0.0, 0.1, ad.size)
    ad.load(values)
    ad.dropout_key = 7
    return eng, ad, values, inputs, targets


def lora_gradient_check(cfg, samples=8, seed=0, h=1e-3, report=print, dropout=0.0, quant=None):
    """Finite differences of the training loss in the adapter tensors (the base frozen: it has no gradient
    buffer at all) against the backward pass's adapter gradients, float64 CPU engine, dropout p (seeded); quant:
    a quantized base (QLoRA, lora_problem)."""
    rng = np.random.default_rng(seed + 2)
    eng, ad, values, inputs, targets = lora_problem(cfg, rng, dropout, quant)
    cross_entropy_backward(eng, inputs, targets)
    analytic = ad.grads.copy()
    ad.dropout_key -= 1  # the backward pass moved the key on: the differences draw the masks it drew

    def loss_at(index, delta):
        ad.params[index] = values[index] + delta
        loss = cross_entropy(eng, inputs, targets)[0]
        ad.params[index] = values[index]
        return loss

    return _compare(cfg, eng, values, analytic, loss_at, inputs, samples, rng, h, report, layout=ad.layout)


def _compare(cfg, eng, flat, analytic, loss_at, inputs, samples, rng, h, report, skip=(), layout=None):
    layout = param_layout(cfg)[0] if layout is None else layout
    used_rows = np.unique(inputs)
    errors = {}
    for name, (off, shape) in layout.items():
        size = math.prod(shape)
        picks = rng.choice(size, min(samples, size), replace=False)
        if name == "tok_emb":  # half the sample from rows the batch uses, which have non-zero gradients
            rows = rng.choice(used_rows, (samples + 1) // 2)
            picks[:len(rows)] = rows * shape[1] + rng.integers(0, shape[1], len(rows))
        if name in skip:  # DPO reads head 0 only: the other heads' gradient must be exactly 0
            errors[name] = float(np.abs(analytic[off:off + size]).max())
            report(f"  {name:<20} : max |grad| {errors[name]:.2e} (not in the objective: must be 0)")
            continue
        fd = np.empty(len(picks))
        for j, i in enumerate(off + picks):
            near = loss_at(i, h) - loss_at(i, -h)
            far = loss_at(i, 2 * h) - loss_at(i, -2 * h)
            fd[j] = (8 * near - far) / (12 * h)
        errors[name] = float(relative_error(fd, analytic[off + picks]).max())
        report(f"  {name:<20} : max rel err {errors[name]:.2e}")
    return errors


def label(cfg):
    """A check model's name in the report: its K, whether it is tied, whether it has q/k/v biases."""
    return f"K = {cfg.mtp_heads}" + (", tied" if cfg.tied else "") + (", q/k/v biases" if cfg.qkv_bias else "")


def describe(cfg):
    if cfg.qkv_bias:
        return "biases on q, k and v before the rotary embedding, as imported Qwen2"
    if cfg.tied:
        return "the head is the embedding, as imported tied models"
    return "the shipped `small`" if cfg.mtp_heads == 1 else "multi-token heads"


def main(args):
    if args.gpu:
        from nanoeuler.errors import UserError
        from nanoeuler.model.gpu import available
        if not available():
            raise UserError("--gpu: no CUDA GPU is available (cupy could not find a device)")
        from nanoeuler.check.gpu import run_gpu_check
        return run_gpu_check(args.seed)
    c = CHECK_CONFIGS[0]
    print(f"gradient check: CPU engine in float64 vs 4th-order central differences (h = 1e-3), "
          f"{args.samples} entries per tensor")
    print(f"models: {c.n_layers} layers, {c.n_heads}/{c.n_kv_heads} q/kv heads, RoPE, dim {c.dim}, hidden "
          f"{c.hidden}, vocab {c.vocab_size}; {'; '.join(label(m) for m in CHECK_CONFIGS)}; "
          f"batch 2 x T = {c.context}, some targets -1")
    start = time.time()
    errors = {}
    for cfg in CHECK_CONFIGS:
        print(f"{label(cfg)} ({describe(cfg)}):")
        for name, err in gradient_check(cfg, samples=args.samples, seed=args.seed).items():
            errors[f"{label(cfg)}, {name}"] = err
    for cfg in CHECK_CONFIGS:
        print(f"DPO objective, {label(cfg)}: 2 pairs, beta 0.5, RPO alpha {DPO_ALPHA:g}, prompts and "
              "padding masked:")
        for name, err in dpo_gradient_check(cfg, samples=args.samples, seed=args.seed).items():
            errors[f"DPO {label(cfg)}, {name}"] = err
    for cfg in LORA_CONFIGS:
        for p in (0.0, LORA_DROPOUT):
            print(f"LoRA adapters, {label(cfg)}: rank {LORA_RANK} on q,k,v,o,gate,up,down, base frozen, dropout "
                  f"{p:g}{' (seeded)' if p else ''}:")
            for name, err in lora_gradient_check(cfg, samples=args.samples, seed=args.seed, dropout=p).items():
                errors[f"LoRA {label(cfg)}, dropout {p:g}, {name}"] = err
    for quant in QLORA_TYPES:
        cfg = LORA_CONFIGS[0]
        print(f"QLoRA adapters, {label(cfg)}: the base's matrices {quant} in groups of 32 (heads int8), rank "
              f"{LORA_RANK} on q,k,v,o,gate,up,down, dropout {LORA_DROPOUT:g} (seeded):")
        for name, err in lora_gradient_check(cfg, samples=args.samples, seed=args.seed, dropout=LORA_DROPOUT,
                                             quant=quant).items():
            errors[f"QLoRA {quant} {label(cfg)}, {name}"] = err
    worst = max(errors, key=lambda n: math.inf if math.isnan(errors[n]) else errors[n])  # NaN is worst
    print(f"max relative error: {errors[worst]:.2e} ({worst})")
    ok = all(err < THRESHOLD for err in errors.values())
    print(f"{'PASS' if ok else 'FAIL'} (threshold {THRESHOLD:.0e}, {len(errors)} tensors in "
          f"{len(CHECK_CONFIGS)} models, training loss, DPO, LoRA and QLoRA, {time.time() - start:.1f} s)")
    return 0 if ok else 1
