"""The training loop every stage shares: `fit()`, with its schedule, metrics log, loss curve and Ctrl-C.

    status = fit(eng, optimizer, tok, source, val_quick, val_full, hp, out, log_path, objective=..., ...)

A step: a batch from `source` (any object with next/state/load_state: data/corpus.py's RandomWindows,
data/instructions.py's ExampleBatches, data/preferences.py's PairBatches), the objective's gradients of it
(train/objectives.py), the ranks' sum and the AdamW step (train/distributed.py's DataParallel), queued on the
device and read once the next step is queued (so the GPU never waits for the host), then one JSON line in the
metrics log (flushed: `tail -f` it). Every `eval_every` steps the objective evaluates the
held-out batches and the loss curve (a PNG beside the log) is redrawn; every `sample_every` steps a sample is
printed; every `ckpt_every` steps and at the end an atomic checkpoint is written with what --resume needs to
continue exactly (the optimizer state, the batch source's state, the hyperparameters). The first Ctrl-C
finishes the step under way (on several ranks also the one queued after it: they agree through the steps'
sums), saves and returns 130; a second aborts.

The learning rate: linear warmup, the peak held until the last `decay_frac` of the steps, then a cosine decay
to lr * min_lr_ratio.
"""
import collections
import dataclasses
import json
import math
import os
import signal
import time

import numpy as np
from tqdm import tqdm

from nanoeuler.errors import UserError
from nanoeuler.infer.generate import sample_text
from nanoeuler.io import checkpoint
from nanoeuler.files import atomic_write
from nanoeuler.io.report import read_log, write_report
from nanoeuler.model.config import flops_per_token
from nanoeuler.parallel.comm import heartbeat


@dataclasses.dataclass
class Hyperparameters:
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


class StopOnInterrupt:
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
            self.records = read_log(path, resume_step)
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
        scored = [r for r in self.records if "eval_acc" in r]
        if scored:  # the eval task's scores (--eval-task) under the loss
            fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 7), dpi=100, sharex=True, height_ratios=(3, 2))
            at = [r["step"] for r in scored]
            ax2.plot(at, [r["eval_acc"] for r in scored], "o-", label="acc")
            ax2.plot(at, [r["eval_acc_norm"] for r in scored], "s-", label="acc_norm")
            ax2.axhline(scored[-1]["eval_chance"], color="gray", ls="--", lw=1, label="chance")
            ax2.set_ylabel(f"{scored[-1]['eval_task']} ({scored[-1]['eval_n']} items)")
            ax2.set_xlabel("step")
            ax2.grid(alpha=0.3)
            ax2.legend()
        else:
            fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
        ax.plot(steps, loss, color="tab:blue", alpha=0.25, lw=0.8)
        if len(loss) >= 20:  # a moving average shows the trend through the batch-to-batch noise
            w = max(10, len(loss) // 50)
            ax.plot(steps[w - 1:], np.convolve(loss, np.ones(w) / w, mode="valid"), color="tab:blue",
                    label=f"train (mean of {w} steps)")
        if val:
            ax.plot(*zip(*val), "o-", color="tab:orange", label="validation")
        if not scored:
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


def fit(eng, tok, source, val_quick, val_full, hp, out, log_path, objective, parallel, start_step=0,
        train_state=None, chat=False, sample_prompt="\n", title="nanoeuler", log_first=None, eval_task=None):
    """Train eng from start_step to hp.steps on batches from `source` with `objective` (objectives.py), the
    ranks' gradients summed and the AdamW step taken by `parallel` (distributed.DataParallel; a world of one
    is one rank), evaluating on val_quick periodically and val_full at the end. Checkpoints go to `out` with
    `train_state` (plus the source's state, the optimizer step and the hyperparameters) for --resume.
    log_first (a dict) is added to the first metrics record this run writes. Rank 0 alone evaluates,
    samples, prints and writes the log and the checkpoints; every rank stops at the same step on Ctrl-C.
    eval_task (eval/tasks.py's TrainingEval) scores multiple-choice items every eval_task.every steps and at the
    end, into the log and the curve's second panel. Each checkpoint gets its run report beside it (io/report.py).
    Returns 0 when done, 130 when stopped by Ctrl-C (after saving)."""
    main = parallel.comm.rank == 0
    log = MetricsLog(log_path, resume_step=start_step if start_step else None) if main else None
    say = tqdm.write if main else (lambda text: None)
    # a resumed run's wall time and tokens go on from its last record
    previous = log.records[-1] if main and log.records else {}
    time0, tokens_seen, t_run = previous.get("time_s", 0.0), previous.get("tokens_seen", 0), time.perf_counter()
    sample = {}  # the last sample printed and its step, kept in the checkpoint for the report

    def save(step):
        # every rank: with ZeRO the moments (and in bf16 the master weights) are gathered from all
        params, (m, v) = parallel.params_numpy(), parallel.opt_state_numpy()
        if main:
            state = dict(train_state or {}, hyper=dataclasses.asdict(hp), source=source.state(),
                         opt_step=parallel.optimizer.steps, world_size=parallel.comm.world_size, **sample)
            if os.path.abspath(log_path) != os.path.abspath(os.path.splitext(out)[0] + ".jsonl"):
                state.update(log=os.path.abspath(log_path))  # the report finds a log elsewhere than beside `out`
            checkpoint.save(out, eng.cfg, params, tok.to_json(), step, opt=(m, v),
                            train_state=state, chat=chat)
            write_report(out)

    peak = _peak_flops(eng)  # MFU is reported on the GPU, whose peak we know
    gpus = parallel.comm.world_size if peak else 1  # tokens/s and MFU per GPU beside the total
    bar = tqdm(total=hp.steps, initial=start_step, unit="step", dynamic_ncols=True, smoothing=0.1,
               disable=not main)
    tps_avg, status, stop = None, 0, False
    t_mark = time.perf_counter()  # where the time of the next step read starts

    def finish(step, lr, names, numbers):
        """Read a queued step's numbers (waiting for that step alone) and check them; (its metrics record on
        rank 0, else None; whether a rank was asked to stop: Ctrl-C)."""
        nonlocal tps_avg, tokens_seen, log_first, t_mark
        grad_norm, (*totals, tokens, stops) = numbers()
        now = time.perf_counter()
        heartbeat()
        losses = dict(zip(names, totals))
        if not all(math.isfinite(v) for v in losses.values()):
            raise UserError(f"training diverged at step {step} (loss {losses['loss']}); the last checkpoint in "
                            f"{out} is kept; try a lower --lr")
        if main:
            tps = tokens / (now - t_mark)  # SFT batches may be shorter than the context
            tps_avg = tps if tps_avg is None else 0.9 * tps_avg + 0.1 * tps
            # losses at full precision (a resumed run can be compared bit for bit), the rest rounded
            tokens_seen += int(tokens)
            record = dict(step=step, **losses, lr=float(f"{lr:.6g}"), grad_norm=round(grad_norm, 6),
                          tokens_per_s=round(tps, 1), tokens_seen=tokens_seen,
                          time_s=round(time0 + now - t_run, 2))
            if gpus > 1:
                record.update(tokens_per_s_per_gpu=round(tps / gpus, 1))
            if peak:  # of all the GPUs' peak: the mean utilisation of one
                record.update(mfu=round(tps * flops_per_token(eng.cfg) / (peak * gpus), 4))
            if eng.device_memory() is not None:  # the engine's pool and the copy engines' allocation
                memory = eng.device_memory() + parallel.device_memory()
                record.update(gpu_mem_gib=round(memory / 2 ** 30, 3))
            if log_first:
                record.update(log_first)
                log_first = None
            mfu = f", MFU {tps_avg * flops_per_token(eng.cfg) / (peak * gpus):.1%}" if peak else ""
            rate = (f"{tps_avg:,.0f} tok/s" if gpus == 1 else
                    f"{tps_avg:,.0f} tok/s in total, {tps_avg / gpus:,.0f} a GPU")
            bar.set_postfix_str(f"loss {record['loss']:.3f}, {rate}{mfu}", refresh=False)
            bar.update(1)
        t_mark = now
        return record if main else None, stops > 0

    def at_boundary(step):
        """Whether step ends with work that reads the weights or the log (evaluation, a sample, a checkpoint)."""
        every = [hp.eval_every, hp.sample_every, hp.ckpt_every] + ([eval_task.every] if eval_task else [])
        return step == hp.steps or any(step % n == 0 for n in every)

    step, queued = start_step, collections.deque()  # queued: steps on the device whose numbers are not read yet
    # the CPU engine has finished a step when it is queued: reading it a step later would time the next one
    read_behind = 0 if eng.xp is np else 1

    def read_queued(keep, hold=None):
        """Read the queued steps until `keep` are left (all of them once a rank asked to stop), writing their
        records but step `hold`'s, which is returned (rank 0) for its evaluation."""
        nonlocal stop
        held = None
        while len(queued) > (0 if stop else keep):
            done = queued[0][0]
            record, asked = finish(*queued.popleft())
            stop |= asked  # every rank reads the same sum at the same step: all stop after the same one
            if main and done == hold:
                held = record
            elif main:
                log.write(record)
        return held

    try:
        with StopOnInterrupt(say) as interrupt:
            while step < hp.steps and not stop:
                if interrupt.requested and parallel.comm.world_size == 1:
                    stop = True  # one process stops after the step under way; ranks agree on the step's sum
                    read_queued(0)
                    break
                lr = lr_at(hp, step)
                shares, tokens = objective.train_step(eng, source.next(), hp)
                # the ranks' losses, tokens and Ctrl-C flags summed in the collective of the gradient norm,
                # on the device: the step is read once the next one is queued, so the GPU never waits
                numbers = parallel.start_step(lr, hp.weight_decay, hp.grad_clip,
                                              [*shares.values(), tokens, float(interrupt.requested)])
                step += 1
                queued.append((step, lr, list(shares), numbers))
                boundary = at_boundary(step)
                record = read_queued(0 if boundary else read_behind, hold=step if boundary else None)
                if not boundary:
                    continue
                last = step == hp.steps
                if main:
                    if last or step % hp.eval_every == 0:
                        record.update(objective.evaluate(eng, val_full if last else val_quick))
                        say(f"step {step}: {objective.eval_text(record)}"
                            + (" (final, held-out split)" if last else ""))
                    if eval_task is not None and (last or step % eval_task.every == 0):
                        record.update(eval_task.evaluate(eng, tok))
                        say(f"step {step}: {eval_task.text(record)}")
                    if step % hp.sample_every == 0 or last:
                        text = sample_text(eng, tok, sample_prompt, hp.sample_tokens, seed=hp.seed + step)
                        sample.update(sample=text, sample_step=step)
                        say(f"--- sample at step {step} ---\n{text}\n---")
                    log.write(record)
                if last or step % hp.ckpt_every == 0:
                    save(step)
                if main and "val_loss" in record:
                    log.plot(f"{title}: step {step}, {objective.plot_title(record)}", objective.ylabel)
                t_mark = time.perf_counter()  # the next step's time starts after the evaluation and the save
            if stop and step < hp.steps:
                save(step)
                say(f"stopped at step {step}: saved {out}; continue with --resume")
                status = 130
    finally:
        bar.close()
        if log is not None:
            log.close()
    return status


