"""The training loop every stage shares: `fit()`, with its schedule, metrics log, loss curve and Ctrl-C.

    status = fit(Job(hyper, tokenizer, source, Validation(quick, full), objective, out, log_path, ...), trainable)

A step: a batch from the job's `source` (any object with next/state/load_state: data/corpus.py's
RandomWindows, data/instructions.py's ExampleBatches, data/preferences.py's PairBatches), the objective's
gradients of it (train/objectives.py), then the trainable's step (train/trainable.py: the ranks' sum, the
clip, the AdamW step), queued on the device and read once the next step is queued (StepPipeline: the GPU
never waits for the host), then one JSON line in the metrics log (flushed: `tail -f` it). Every `eval_every`
steps the objective evaluates the held-out batches and the loss curve (a PNG beside the log) is redrawn;
every `sample_every` steps a sample is printed; every `ckpt_every` steps and at the end an atomic checkpoint
is written with what --resume needs to continue exactly (the trainable's state, the batch source's state,
the hyperparameters). The first Ctrl-C finishes the step under way (on several ranks also the one queued
after it: they agree through the steps' sums), saves and returns 130; a second aborts.

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
from nanoeuler.files import atomic_write
from nanoeuler.io.report import read_log, write_report
from nanoeuler.model.config import flops_per_token
from nanoeuler.parallel.comm import heartbeat
from nanoeuler.parallel.world import printer


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


@dataclasses.dataclass(frozen=True)
class Validation:
    """The held-out batches an objective evaluates: `quick` every eval_every steps, `full` at the end."""
    quick: list
    full: list


@dataclasses.dataclass
class Job:
    """What fit() trains on and writes, besides the weights (train/trainable.py): the hyperparameters, the
    tokenizer (saved with every checkpoint, and the samples'), the batch `source` (any object with
    next/state/load_state), the held-out batches, the objective (objectives.py), the checkpoint `out` and
    the metrics log, the step to start from (a resumed run's), the training state the checkpoints carry for
    --resume beside the loop's own, whether the result is a chat model, the prompt of the samples, the curve's
    title, fields for the first metrics record this run writes, and an eval task (eval/tasks.py's
    TrainingEval) scored every eval_task.every steps and at the end."""
    hyper: Hyperparameters
    tokenizer: object
    source: object
    validation: Validation
    objective: object
    out: str
    log_path: str
    start_step: int = 0
    train_state: dict = dataclasses.field(default_factory=dict)
    chat: bool = False
    sample_prompt: str = "\n"
    title: str = "nanoeuler"
    log_first: dict = None
    eval_task: object = None


class Progress:
    """Rank 0's account of the steps as they are read: the metrics record of each (losses at full precision,
    so that a resumed run compares bit for bit; rates rounded), the tokens and time that go on from a resumed
    run's last record, and the progress bar with the smoothed rate and MFU."""

    def __init__(self, job, trainable, log):
        self.job, self.trainable, self.eng = job, trainable, trainable.engine
        # a resumed run's wall time and tokens go on from its last record
        previous = log.records[-1] if log is not None and log.records else {}
        self.time0, self.tokens_seen = previous.get("time_s", 0.0), previous.get("tokens_seen", 0)
        self.t_run = time.perf_counter()
        self.peak = _peak_flops(self.eng)  # MFU is reported on the GPU, whose peak we know
        self.gpus = trainable.comm.world_size if self.peak else 1  # tokens/s and MFU per GPU beside the total
        self.tps_avg, self.log_first = None, job.log_first
        self.bar = tqdm(total=job.hyper.steps, initial=job.start_step, unit="step", dynamic_ncols=True,
                        smoothing=0.1, disable=log is None)

    def record(self, step, lr, losses, grad_norm, tokens, seconds, now):
        """The metrics record of a step that took `seconds` for `tokens`; the bar advanced."""
        eng, peak, gpus = self.eng, self.peak, self.gpus
        tps = tokens / seconds  # SFT batches may be shorter than the context
        self.tps_avg = tps if self.tps_avg is None else 0.9 * self.tps_avg + 0.1 * tps
        self.tokens_seen += int(tokens)
        record = dict(step=step, **losses, lr=float(f"{lr:.6g}"), grad_norm=round(grad_norm, 6),
                      tokens_per_s=round(tps, 1), tokens_seen=self.tokens_seen,
                      time_s=round(self.time0 + now - self.t_run, 2))
        if gpus > 1:
            record.update(tokens_per_s_per_gpu=round(tps / gpus, 1))
        if peak:  # of all the GPUs' peak: the mean utilisation of one
            record.update(mfu=round(tps * flops_per_token(eng.cfg) / (peak * gpus), 4))
        if eng.device_memory() is not None:  # the engine's pool and the copy engines' allocation
            memory = eng.device_memory() + self.trainable.device_memory()
            record.update(gpu_mem_gib=round(memory / 2 ** 30, 3))
        if self.log_first:
            record.update(self.log_first)
            self.log_first = None
        mfu = f", MFU {self.tps_avg * flops_per_token(eng.cfg) / (peak * gpus):.1%}" if peak else ""
        rate = (f"{self.tps_avg:,.0f} tok/s" if gpus == 1 else
                f"{self.tps_avg:,.0f} tok/s in total, {self.tps_avg / gpus:,.0f} a GPU")
        self.bar.set_postfix_str(f"loss {record['loss']:.3f}, {rate}{mfu}", refresh=False)
        self.bar.update(1)
        return record


class StepPipeline:
    """The steps queued on the device whose numbers the host has not read yet. A step is read once the next
    one is queued (on the GPU; the CPU engine has finished a step when it is queued: reading it a step later
    would time the next one), and every step up to one that ends in work reading the weights or the log.
    Reading a step checks its losses, makes its record (rank 0) and learns whether a rank asked to stop
    (Ctrl-C): every rank reads the same sums at the same step, so all stop after the same one."""

    def __init__(self, job, progress, log, eng):
        self.job, self.progress, self.log = job, progress, log
        self.queued = collections.deque()  # (step, lr, loss names, the function that reads its numbers)
        self.read_behind = 0 if eng.xp is np else 1
        self.stop = False
        self.t_mark = time.perf_counter()  # where the time of the next step read starts

    def push(self, step, lr, names, numbers):
        self.queued.append((step, lr, names, numbers))

    def restart_clock(self):
        """The next step's time starts now (after an evaluation, a sample, a checkpoint)."""
        self.t_mark = time.perf_counter()

    def _finish(self, step, lr, names, numbers):
        """Read a queued step's numbers (waiting for that step alone) and check them; (its metrics record on
        rank 0, else None; whether a rank was asked to stop)."""
        grad_norm, (*totals, tokens, stops) = numbers()
        now = time.perf_counter()
        heartbeat()
        losses = dict(zip(names, totals))
        if not all(math.isfinite(v) for v in losses.values()):
            raise UserError(f"training diverged at step {step} (loss {losses['loss']}); the last checkpoint in "
                            f"{self.job.out} is kept; try a lower --lr")
        record = None
        if self.log is not None:
            record = self.progress.record(step, lr, losses, grad_norm, tokens, now - self.t_mark, now)
        self.t_mark = now
        return record, stops > 0

    def read(self, boundary=None):
        """Read the queued steps until read_behind are left (none at a boundary, or once a rank asked to stop),
        writing their records to the log but the boundary step's, which is returned (rank 0) for its
        evaluation."""
        keep = 0 if boundary is not None else self.read_behind
        held = None
        while len(self.queued) > (0 if self.stop else keep):
            done = self.queued[0][0]
            record, asked = self._finish(*self.queued.popleft())
            self.stop |= asked
            if self.log is not None and done == boundary:
                held = record
            elif self.log is not None:
                self.log.write(record)
        return held


def fit(job, trainable):
    """Train trainable (train/trainable.py: the engine, the weights that train and their optimizer over the
    ranks; a world of one is one rank) from job.start_step to job.hyper.steps on job's batches and objective,
    evaluating on the quick held-out batches periodically and the full ones at the end. Checkpoints go to
    job.out with job.train_state (plus the source's state, the optimizer step, the hyperparameters and the
    last sample) for --resume, each with its run report beside it (io/report.py). Rank 0 alone evaluates,
    samples, prints and writes the log and the checkpoints; every rank stops at the same step on Ctrl-C.
    Returns 0 when done, 130 when stopped by Ctrl-C (after saving)."""
    hp, eng, comm = job.hyper, trainable.engine, trainable.comm
    main = comm.rank == 0
    log = MetricsLog(job.log_path, resume_step=job.start_step if job.start_step else None) if main else None
    say = printer(comm.rank)
    sample = {}  # the last sample printed and its step, kept in the checkpoint for the report
    every = [hp.eval_every, hp.sample_every, hp.ckpt_every] + ([job.eval_task.every] if job.eval_task else [])

    def save(step):
        params, (m, v), opt_step = trainable.state()  # every rank: with ZeRO the pieces come from all
        state = None
        if main:
            state = dict(job.train_state, hyper=dataclasses.asdict(hp), source=job.source.state(),
                         opt_step=opt_step, world_size=comm.world_size, **sample)
            if os.path.abspath(job.log_path) != os.path.abspath(os.path.splitext(job.out)[0] + ".jsonl"):
                state.update(log=os.path.abspath(job.log_path))  # the report finds a log elsewhere than beside out
        # every rank: rank 0 writes, with ZeRO-2/3 the others send their shards as it goes
        trainable.save(job.out, params, (m, v), job.tokenizer.to_json() if main else None, step, state, job.chat)
        if main:
            write_report(job.out)

    progress = Progress(job, trainable, log)
    pipeline = StepPipeline(job, progress, log, eng)
    step, status = job.start_step, 0
    try:
        with StopOnInterrupt(say) as interrupt:
            while step < hp.steps and not pipeline.stop:
                if interrupt.requested and comm.world_size == 1:
                    pipeline.stop = True  # one process stops after the step under way; ranks agree on the sum
                    pipeline.read()
                    break
                lr = lr_at(hp, step)
                shares, tokens = job.objective.train_step(eng, job.source.next(), hp)
                # the ranks' losses, tokens and Ctrl-C flags summed in the collective of the gradient norm,
                # on the device: the step is read once the next one is queued, so the GPU never waits
                numbers = trainable.step(lr, hp, [*shares.values(), tokens, float(interrupt.requested)])
                step += 1
                pipeline.push(step, lr, list(shares), numbers)
                # whether the step ends with work that reads the weights or the log
                boundary = step == hp.steps or any(step % n == 0 for n in every)
                record = pipeline.read(step if boundary else None)
                if not boundary:
                    continue
                last = step == hp.steps
                with trainable.evaluating():  # every rank: LoRA's dropout off, ZeRO-3's weights gathered whole
                    if main:
                        _evaluate(job, eng, step, last, record, sample, say)
                if main:
                    log.write(record)
                if last or step % hp.ckpt_every == 0:
                    save(step)
                if main and "val_loss" in record:
                    log.plot(f"{job.title}: step {step}, {job.objective.plot_title(record)}", job.objective.ylabel)
                pipeline.restart_clock()  # the next step's time starts after the evaluation and the save
            if pipeline.stop and step < hp.steps:
                save(step)
                say(f"stopped at step {step}: saved {job.out}; continue with --resume")
                status = 130
    finally:
        progress.bar.close()
        if log is not None:
            log.close()
    return status


def _evaluate(job, eng, step, last, record, sample, say):
    """Rank 0's work at a boundary step: the held-out evaluation, the eval task and the sample where they are
    due, into `record` (and the sample into `sample`, for the checkpoint)."""
    hp, objective = job.hyper, job.objective
    if last or step % hp.eval_every == 0:
        record.update(objective.evaluate(eng, job.validation.full if last else job.validation.quick))
        say(f"step {step}: {objective.eval_text(record)}" + (" (final, held-out split)" if last else ""))
    if job.eval_task is not None and (last or step % job.eval_task.every == 0):
        record.update(job.eval_task.evaluate(eng, job.tokenizer))
        say(f"step {step}: {job.eval_task.text(record)}")
    if step % hp.sample_every == 0 or last:
        text = sample_text(eng, job.tokenizer, job.sample_prompt, hp.sample_tokens, seed=hp.seed + step)
        sample.update(sample=text, sample_step=step)
        say(f"--- sample at step {step} ---\n{text}\n---")
