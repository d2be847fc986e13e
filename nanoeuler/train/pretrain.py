"""Pretraining: `nanoeuler train [small|big|base]`, one loop for the CPU and the GPU engine.

    nanoeuler train small --data shakespeare.txt          # `make train`: 1.1M params, CPU, minutes
    nanoeuler train big                                   # 14.2M params, the GPU if there is one
    nanoeuler train small --resume                        # continue nanoeuler.bin exactly where it stopped

The loop: AdamW (the engine's; decoupled weight decay on matrices only), linear warmup then cosine decay
(for small, after a stretch at the peak), global gradient-norm clipping, a validation loss and bits per
byte on the held-out last tenth of the corpus every `eval_every` steps, a sample every `sample_every` steps,
an atomic checkpoint every `ckpt_every` steps and at the end. Ctrl-C finishes the current step, saves and exits;
`--resume` restores the weights, the AdamW moments and step count, the schedule and the data sampler's RNG,
so the resumed run computes bit for bit the losses the uninterrupted run would have.

Every step appends one JSON line to the metrics log (flushed: `tail -f` it), and every evaluation redraws
the loss curve, a PNG next to the log. `fit()` is the loop itself, independent of where batches come from
(any object with next/state/load_state, see data.py), so fine-tuning reuses it with its own batch source.
"""
import dataclasses
import json
import math
import os
import signal
import sys
import time

import numpy as np
from tqdm import tqdm

from nanoeuler.io import checkpoint
from nanoeuler.model.config import PRESETS, flops_per_token, param_count
from nanoeuler.train.distributed import DataParallel, SingleProcess, heartbeat
from nanoeuler.errors import UserError
from nanoeuler.io.files import atomic_write, check_writable
from nanoeuler.infer.generate import sample_text


@dataclasses.dataclass
class Hyper:
    steps: int
    batch_size: int
    lr: float
    warmup: int
    eval_every: int
    sample_every: int
    ckpt_every: int
    eval_batches: int = 8         # batches per periodic evaluation, spread over the validation split
    final_eval_batches: int = None  # the final evaluation: the whole split (None) or this many batches
    min_lr_ratio: float = 0.1     # cosine decay ends at lr * min_lr_ratio
    decay_frac: float = 1.0       # the decay spans this last fraction of the steps; the lr holds its peak before
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.95
    sample_tokens: int = 120
    seed: int = 0
    grad_accum: int = 1           # forward/backward passes of batch_size per optimizer step


# small is sized for `make train` on 2 CPU cores: about 13 minutes with setup and compilation. Sweeps (README)
# found loss per token flat across batch 8-32 and lr 4e-3..6e-3, flat in beta1, beta2, weight decay, warmup and
# initialisation; what moved it was holding the peak lr and decaying to 0 over the last 40% of the steps
# (-0.02 bits/byte against cosine to a tenth from the start). Past ~2,700 steps (5 epochs of Shakespeare)
# more steps no longer lower the held-out loss; a wider SwiGLU (config.py) still does. big and base: one GPU.
PRESET_HYPER = {
    "small": Hyper(steps=2900, batch_size=32, lr=4e-3, warmup=100, eval_every=125, sample_every=500,
                   ckpt_every=250, eval_batches=4, min_lr_ratio=0.0, decay_frac=0.4),
    "big": Hyper(steps=5000, batch_size=32, lr=1e-3, warmup=200, eval_every=250, sample_every=1000,
                 ckpt_every=500),
    "base": Hyper(steps=20000, batch_size=16, lr=6e-4, warmup=1000, eval_every=500, sample_every=2000,
                  ckpt_every=1000, eval_batches=16, final_eval_batches=256),
    # large: base's 16 x 512 tokens per step as 4 passes of 4, which fits a 12 GB card in bf16
    "large": Hyper(steps=20000, batch_size=4, grad_accum=4, lr=4e-4, warmup=1000, eval_every=500,
                   sample_every=2000, ckpt_every=1000, eval_batches=64, final_eval_batches=1024),
}
DEFAULT_DATA = {"small": "shakespeare.txt", "big": "shakespeare.txt", "base": "data/pretrain.txt",
                "large": "data/pretrain.txt"}
# how to make a default corpus that is not in the repository (the scripts are in data/, docs/data.md)
DATA_HINT = {"data/pretrain.txt": "build it with `sh data/get_gutenberg.sh && sh data/get_web.sh`, then "
                                  "`cat data/gutenberg.txt data/web.txt > data/pretrain.txt`; or pass --data FILE"}


def lr_at(hp, step):
    """Learning rate for 0-based step: linear warmup over hp.warmup steps, the peak held until the last
    decay_frac of the steps, then a cosine decay to lr * min_lr_ratio (decay_frac 1: right after the warmup)."""
    if step < hp.warmup:
        return hp.lr * (step + 1) / hp.warmup
    decay_start = max(hp.warmup, round(hp.steps * (1 - hp.decay_frac)))
    progress = min(1.0, max(0, step - decay_start) / max(1, hp.steps - decay_start))
    return hp.lr * (hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def schedule_text(hp):
    decay = f" over the last {hp.decay_frac:.0%} of the steps" if hp.decay_frac < 1 else ""
    return f"cosine to {hp.lr * hp.min_lr_ratio:g}{decay}"


def evaluate(eng, batches):
    """(mean head-0 loss in nats per token, bits per byte) over eval batches (inputs, targets, n_bytes)."""
    total, count, n_bytes = 0.0, 0, 0
    for inputs, targets, b in batches:
        n = int((targets[0] >= 0).sum())
        total += eng.forward_loss(inputs, targets)[1] * n
        count += n
        n_bytes += b
    return total / count, total / math.log(2) / n_bytes


class _StopOnInterrupt:
    """Turns the first Ctrl-C into a flag the loop checks between steps (so a step is never cut in half and
    the checkpoint is consistent); a second Ctrl-C aborts at once. `say` prints (rank 0's tqdm.write)."""

    def __init__(self, say):
        self.say = say

    def __enter__(self):
        self.requested = False
        self.previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.say("Ctrl-C: finishing this step and saving a checkpoint (Ctrl-C again to abort)")

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)


class MetricsLog:
    """The JSONL metrics log and the PNG loss curve beside it."""

    def __init__(self, path, resume_step=None):
        self.path = path
        self.png = os.path.splitext(path)[0] + ".png"
        self.records = []
        if resume_step is not None and os.path.exists(path):
            # keep what led up to the checkpoint; steps after it are about to be run again
            with open(path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue  # a line cut short by a crash
                    if rec.get("step", math.inf) <= resume_step:
                        self.records.append(rec)
            atomic_write(path, lambda f: f.writelines(json.dumps(r) + "\n" for r in self.records), mode="w")
            self.file = open(path, "a")
        else:
            self.file = open(path, "w")

    def write(self, record):
        self.records.append(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def plot(self, title, ylabel="loss (nats/token, head 0)"):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        steps = np.array([r["step"] for r in self.records])
        loss = np.array([r["loss"] for r in self.records])
        val = [(r["step"], r["val_loss"]) for r in self.records if "val_loss" in r]
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
        ax.plot(steps, loss, color="tab:blue", alpha=0.25, lw=0.8)
        if len(loss) >= 20:  # a moving average shows the trend through the batch-to-batch noise
            w = max(10, len(loss) // 50)
            ax.plot(steps[w - 1:], np.convolve(loss, np.ones(w) / w, mode="valid"), color="tab:blue",
                    label=f"train (mean of {w} steps)")
        if val:
            ax.plot(*zip(*val), "o-", color="tab:orange", label="validation")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        atomic_write(self.png, lambda f: fig.savefig(f, format="png"))
        plt.close(fig)

    def close(self):
        self.file.close()


def _peak_flops(eng):
    """The GPU's dense tensor-core peak in the engine's precision (FLOP/s), or None on the CPU or an unknown
    card."""
    if eng.xp is np:
        return None
    from nanoeuler.model.gpu import peak_flops
    return peak_flops(eng.precision)


def accumulate_gradients(eng, inputs, targets, micro_batches, comm=None):
    """Loss and gradients of one optimizer batch in `micro_batches` forward/backward passes over its rows.
    Every pass normalises by the whole step's supervised targets per head, counted over every rank (comm), so
    the passes add up, and the ranks' sums add up, to the loss and gradient of the global batch (to rounding),
    whatever the split. Returns this rank's share of (loss, loss0)."""
    K = targets.shape[0]
    counts = (np.asarray(targets) >= 0).reshape(K, -1).sum(axis=1).astype(np.float64)
    counts = (comm or SingleProcess()).all_reduce_sum(counts)
    loss = loss0 = 0.0
    for i, rows in enumerate(np.array_split(np.arange(len(inputs)), micro_batches)):
        part, part0 = eng.forward_backward(inputs[rows], targets[:, rows], accumulate=i > 0, counts=counts)
        loss, loss0 = loss + part, loss0 + part0
    return loss, loss0


class CrossEntropy:
    """The objective of pretraining and SFT for fit(): the mean over the K heads of their cross-entropies on
    the supervised targets of the global batch (every rank's, through comm). A batch is (inputs, targets);
    evaluation reports head 0's loss and bits per byte. dpo.py has the other objective, with the same four
    methods."""
    ylabel = "loss (nats/token, head 0)"

    def __init__(self, comm=None):
        self.comm = comm or SingleProcess()

    def train_step(self, eng, batch, hp):
        """Gradients of this rank's batch into eng.grads; (the record's loss fields, tokens processed by all
        ranks)."""
        inputs, targets = batch
        loss, loss0 = accumulate_gradients(eng, inputs, targets, hp.grad_accum, self.comm)
        loss, loss0, tokens = self.comm.all_reduce_sum(np.array([loss, loss0, inputs.size], dtype=np.float64))
        return dict(loss=float(loss0), loss_all_heads=float(loss)), int(tokens)

    def evaluate(self, eng, batches):
        val_loss, val_bpb = evaluate(eng, batches)
        return dict(val_loss=val_loss, val_bpb=val_bpb)

    def eval_text(self, record):
        return f"train loss {record['loss']:.4f}, val loss {record['val_loss']:.4f}, val {record['val_bpb']:.4f} bits/byte"

    def plot_title(self, record):
        return f"val {record['val_bpb']:.3f} bits/byte"


def fit(eng, tok, source, val_quick, val_full, hp, out, log_path, start_step=0, train_state=None,
        chat=False, sample_prompt="\n", title="nanoeuler", log_first=None, objective=None, parallel=None):
    """Train eng from start_step to hp.steps on batches from `source`, evaluating on the eval batches
    val_quick (periodically) and val_full (at the end). Checkpoints go to `out` with `train_state`
    (plus the source's state, the optimizer step and the hyperparameters) for --resume.
    log_first (a dict) is added to the first metrics record this run writes, e.g. SFT's example counts.
    objective: what is trained (CrossEntropy, the default, or dpo.DPO): it turns a batch into gradients and
    the loss fields of the log record, and evaluates.
    parallel: a distributed.DataParallel when this is one rank of several (its objective must sum over the
    ranks: CrossEntropy(parallel.comm)); rank 0 alone evaluates, samples, prints and writes the log and the
    checkpoints, and every rank stops at the same step on Ctrl-C.
    Returns 0 when done, 130 when stopped by Ctrl-C (after saving)."""
    parallel = parallel or DataParallel(eng)
    objective = objective or CrossEntropy(parallel.comm)
    main = parallel.comm.rank == 0
    log = MetricsLog(log_path, resume_step=start_step if start_step else None) if main else None
    say = tqdm.write if main else (lambda text: None)

    def save(step):
        m, v = parallel.opt_state_numpy()  # every rank: with ZeRO the moments are gathered from all
        if main:
            state = dict(train_state or {}, hyper=dataclasses.asdict(hp), source=source.state(),
                         opt_step=eng.opt_step, world_size=parallel.comm.world_size)
            checkpoint.save(out, eng.cfg, eng.params_numpy(), tok.to_json(), step, opt=(m, v),
                            train_state=state, chat=chat)

    peak = _peak_flops(eng)  # MFU is reported on the GPU, whose peak we know
    bar = tqdm(total=hp.steps, initial=start_step, unit="step", dynamic_ncols=True, smoothing=0.1,
               disable=not main)
    step, tps_avg, status, stop = start_step, None, 0, False
    try:
        with _StopOnInterrupt(say) as interrupt:
            while step < hp.steps and not stop:
                t0 = time.perf_counter()
                lr = lr_at(hp, step)
                losses, tokens = objective.train_step(eng, source.next(), hp)
                if not all(math.isfinite(v) for v in losses.values()):
                    raise UserError(f"training diverged at step {step + 1} (loss {losses['loss']}); the last "
                                    f"checkpoint in {out} is kept; try a lower --lr")
                grad_norm = parallel.step(lr, hp.weight_decay, hp.grad_clip, hp.beta1, hp.beta2)
                step += 1
                heartbeat()
                stop = parallel.any(interrupt.requested)
                last = step == hp.steps
                if main:
                    tps = tokens / (time.perf_counter() - t0)  # SFT batches may be shorter than the context
                    tps_avg = tps if tps_avg is None else 0.9 * tps_avg + 0.1 * tps
                    # losses at full precision (a resumed run can be compared bit for bit), the rest rounded
                    record = dict(step=step, **losses, lr=float(f"{lr:.6g}"), grad_norm=round(grad_norm, 6),
                                  tokens_per_s=round(tps, 1))
                    if peak:
                        record.update(mfu=round(tps * flops_per_token(eng.cfg) / peak, 4))
                    if eng.device_memory() is not None:
                        record.update(gpu_mem_gib=round(eng.device_memory() / 2 ** 30, 3))
                    if last or step % hp.eval_every == 0:
                        record.update(objective.evaluate(eng, val_full if last else val_quick))
                        say(f"step {step}: {objective.eval_text(record)}"
                            + (" (final, held-out split)" if last else ""))
                    if log_first:
                        record.update(log_first)
                        log_first = None
                    log.write(record)
                    mfu = f", MFU {tps_avg * flops_per_token(eng.cfg) / peak:.1%}" if peak else ""
                    bar.set_postfix_str(f"loss {record['loss']:.3f}, {tps_avg:,.0f} tok/s{mfu}", refresh=False)
                    bar.update(1)
                    if step % hp.sample_every == 0 or last:
                        text = sample_text(eng, tok, sample_prompt, hp.sample_tokens, seed=hp.seed + step)
                        say(f"--- sample at step {step} ---\n{text}\n---")
                if last or step % hp.ckpt_every == 0:
                    save(step)
                if main and "val_loss" in record:
                    log.plot(f"{title}: step {step}, {objective.plot_title(record)}", objective.ylabel)
            if stop and step < hp.steps:
                save(step)
                say(f"stopped at step {step}: saved {out}; continue with --resume")
                status = 130
    finally:
        bar.close()
        if log is not None:
            log.close()
    return status


# ------------------------------------------------------------------------------------------ the command
def hyper_with_flags(base, args):
    """Preset (or resumed) hyperparameters with the flags the user gave on top."""
    overrides = {field: getattr(args, field) for field in ("steps", "batch_size", "lr", "seed", "eval_every",
                                                           "sample_every", "ckpt_every", "grad_accum")
                 if getattr(args, field, None) is not None}
    hp = dataclasses.replace(base, **overrides)
    if hp.warmup >= hp.steps:
        hp = dataclasses.replace(hp, warmup=max(1, hp.steps // 10))
    return hp


def batch_text(hp, world=None):
    """The batch of a step in words: B, (N passes of B), and the ranks that each take one."""
    text = f"{hp.batch_size}" if hp.grad_accum == 1 else f"({hp.grad_accum} passes of {hp.batch_size})"
    n = world.world_size if world is not None else 1
    return text if n == 1 else f"{n} ranks x {text}"


def run_device(args, cfg, out, log_path, world_size=1):
    """The run's device for a model like cfg (several ranks: the GPU whenever there is one, as --gpus says); a
    precision the device lacks and outputs that cannot be written are refused here, before any work
    (tokenizer training, data loading) starts."""
    from nanoeuler.model.device import resolve
    device = resolve(args.device, cfg if world_size == 1 else None)
    if device == "cpu" and args.precision not in (None, "fp32"):
        raise UserError(f"--precision {args.precision}: the CPU engine computes in fp32 only")
    for path in (out, log_path, os.path.splitext(log_path)[0] + ".png"):
        check_writable(path)
    return device


def engine_precision(args, device, ck):
    """--precision, else on --resume the precision the run trained in (where this device has it), else the
    device's default (None: bf16 on the GPU, fp32 on the CPU)."""
    if args.precision:
        return args.precision
    previous = (ck.train_state or {}).get("precision") if ck is not None else None
    return previous if previous and (device == "gpu" or previous == "fp32") else None


def load_for_resume(out, kind, command):
    """The checkpoint at `out` with its optimizer state, which `command` (of training `kind`) must have
    written; a one-line error otherwise."""
    if not os.path.exists(out):
        raise UserError(f"--resume: nothing to resume, {out} not found (--out names the checkpoint)")
    ck = checkpoint.load(out, with_opt=True)
    if not ck.train_state or ck.train_state.get("kind") != kind:
        raise UserError(f"--resume: {out} was not written by `{command}`; nothing to resume")
    return ck


# The command skeleton that train, sft and dpo share: where the outputs go, what --resume continues and with
# which hyperparameters, the engine with the weights, optimizer and batch order restored.
def output_paths(args):
    """(out, metrics log): --out, and --log or --out with .jsonl."""
    return args.out, args.log or os.path.splitext(args.out)[0] + ".jsonl"


def resume_checkpoint(args, kind, command):
    """With --resume, the checkpoint at --out (written by `command`, with its optimizer state); else None."""
    return load_for_resume(args.out, kind, command) if args.resume else None


def run_hyper(args, ck, fresh, world_size=1):
    """The run's hyperparameters: a resumed run's own (ck), else `fresh`, with the flags given on top; a
    finished run needs a larger --steps. A run resumed on another number of ranks keeps its global batch
    (batch_size is per rank), so it continues on the very batches it would have drawn (data.RandomWindows)."""
    base = fresh
    if ck is not None:
        base = Hyper(**ck.train_state["hyper"])
        total = base.batch_size * ck.train_state.get("world_size", 1)
        if getattr(args, "batch_size", None) is None and total != base.batch_size * world_size:
            if total % world_size:
                raise UserError(f"--resume: {args.out} was trained on global batches of {total}, which "
                                f"{world_size} ranks cannot share evenly; pass --batch-size (per rank)")
            base = dataclasses.replace(base, batch_size=total // world_size)
    hp = hyper_with_flags(base, args)
    if ck is not None and ck.step >= hp.steps:
        raise UserError(f"--resume: {args.out} has finished its {hp.steps} steps; pass --steps N to train longer")
    return hp


def run_world(args):
    """This process's distributed.World: from the torchrun-style environment that `--gpus N` (launch.py) or
    another launcher sets, else a world of one; --gpus, when given, must agree with it."""
    from nanoeuler.train.distributed import World
    world = World.from_env()
    if args.gpus is not None and args.gpus != world.world_size:
        raise UserError(f"--gpus {args.gpus} but WORLD_SIZE is {world.world_size}")
    return world


def eval_limits(hp, world):
    """(final, periodic) evaluation batches. Rank 0 evaluates alone, in batches of the per-rank size: N times
    as many of them cover the windows one process at the global batch would score (eval_batches spreads
    them evenly), so the validation numbers do not depend on the world size."""
    n = world.world_size
    return None if hp.final_eval_batches is None else hp.final_eval_batches * n, hp.eval_batches * n


def run_engine(cfg, device, args, hp, ck, source, params=None):
    """The engine of a run: the weights of `params` (a new run that starts from a checkpoint) or of the
    resumed checkpoint ck, whose AdamW moments, step count and batch order are restored too."""
    from nanoeuler.model.engine import make_engine
    eng = make_engine(cfg, device=device, seed=hp.seed, precision=engine_precision(args, device, ck))
    if ck is not None:
        eng.load_params(ck.params)
        eng.load_opt_state(*ck.opt)
        eng.opt_step = ck.train_state["opt_step"]
        if source is not None:
            source.load_state(ck.train_state["source"])
    elif params is not None:
        eng.load_params(params)
    return eng


def replace_note(out, ck):
    if ck is None and os.path.exists(out):
        print(f"note: {out} exists and will be replaced at the first checkpoint (--resume continues it)")


def main(args):
    from nanoeuler.data.corpus import RandomWindows, check_corpus, eval_batches, open_corpus
    from nanoeuler.model.device import wants_gpu
    from nanoeuler.train.distributed import DataParallel, broadcast_text, make_communicator
    from nanoeuler.tokenizer.bpe import Tokenizer

    world = run_world(args)
    say = print if world.is_main else (lambda *a, **k: None)
    out, log_path = output_paths(args)
    ck = resume_checkpoint(args, "pretrain", "nanoeuler train")
    if ck is not None:
        preset = ck.train_state["preset"]
        if args.preset not in (None, preset):
            raise UserError(f"--resume: {out} is a {preset} model, not {args.preset}")
        data = args.data or ck.train_state["data"]
    else:
        preset = args.preset or "small"
        data = args.data or DEFAULT_DATA[preset]
    hp = run_hyper(args, ck, PRESET_HYPER[preset], world.world_size)
    # the preset's own vocabulary for a new run: close enough to the final one for the device rule
    device = run_device(args, ck.cfg if ck is not None else PRESETS[preset], out, log_path, world.world_size)
    comm = make_communicator(world, device)

    # the tokenizer: the checkpoint's, a given one, or a new one learned on the corpus
    if data in DATA_HINT and not os.path.exists(data):
        raise UserError(f"corpus {data} not found ({DATA_HINT[data]})")
    check_corpus(data)
    if ck is not None:
        tok = ck.tokenizer()
    elif args.tokenizer:
        tok = Tokenizer.load(args.tokenizer)
    else:  # learned by rank 0 alone, then sent to the others
        tok = Tokenizer.train(data, PRESETS[preset].vocab_size, progress=True) if world.is_main else None
        tok = Tokenizer.from_json(broadcast_text(comm, tok.to_json() if tok else None))
    cfg = ck.cfg if ck is not None else dataclasses.replace(PRESETS[preset], vocab_size=tok.vocab_size)

    if not world.is_main:
        comm.barrier()  # rank 0 writes the token cache, the others then read it
    corpus = open_corpus(data, tok, progress=world.is_main)
    if world.is_main:
        comm.barrier()
    size = os.path.getsize(data)
    say(f"data: {data}: {size:,} bytes, {len(corpus.tokens):,} tokens ({size / len(corpus.tokens):.2f} "
        f"bytes/token); train {len(corpus.train):,}, validation {len(corpus.val):,} (the last tenth)")
    # one optimizer batch per draw, split into grad_accum passes: B x N draws the windows of B * N x 1
    source = RandomWindows(corpus.train, hp.batch_size * hp.grad_accum, cfg.context, cfg.mtp_heads, hp.seed,
                           world.rank, world.world_size)
    final, periodic = eval_limits(hp, world)
    val_full = eval_batches(corpus.val, corpus.byte_len, hp.batch_size, cfg.context, cfg.mtp_heads, limit=final)
    val_quick = eval_batches(corpus.val, corpus.byte_len, hp.batch_size, cfg.context, cfg.mtp_heads,
                             limit=periodic)

    eng = run_engine(cfg, device, args, hp, ck, source)
    parallel = DataParallel(eng, comm, zero=args.zero == 1)
    note = " (no GPU: this will be slow)" if device == "cpu" and wants_gpu(cfg) else ""
    say(f"model: {preset}, {param_count(cfg) / 1e6:.2f}M parameters (dim {cfg.dim}, {cfg.n_layers} layers, "
        f"{cfg.n_heads}/{cfg.n_kv_heads} heads, context {cfg.context}, vocab {cfg.vocab_size}, "
        f"{cfg.mtp_heads} prediction head{'s' * (cfg.mtp_heads != 1)}), {device.upper()} engine in "
        f"{eng.precision}{note}")
    start = ck.step if ck is not None else 0
    say(f"training: steps {start + 1}..{hp.steps} of {batch_text(hp, world)}x{cfg.context} tokens, peak lr "
        f"{hp.lr:g}, warmup {hp.warmup}, {schedule_text(hp)}; log {log_path}"
        + (f"; resuming {out}" if ck is not None else ""))
    if world.is_main:
        replace_note(out, ck)
    sys.stdout.flush()
    t0 = time.perf_counter()
    status = fit(eng, tok, source, val_quick, val_full, hp, out, log_path, start_step=start,
                 train_state=dict(kind="pretrain", preset=preset, data=os.path.abspath(data),
                                  precision=eng.precision),
                 title=f"nanoeuler {preset}", parallel=parallel)
    if status == 0:
        say(f"done in {time.perf_counter() - t0:.0f} s: saved {out}, log {log_path}, loss curve "
            f"{os.path.splitext(log_path)[0]}.png")
    return status
