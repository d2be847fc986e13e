"""The command skeleton that `train`, `sft` and `dpo` share; a stage is its hooks.

    return run_stage(Pretrain(), args)       # pretrain.py; sft.py and dpo.py likewise

run_stage does, in order: the world of ranks; --resume's checkpoint (written by the same stage, with its
optimizer state); the stage's `begin` (which model and data this run is about); the hyperparameters (a
resumed run's own, else the stage's defaults, with the flags on top); the device (refused early, as are
unwritable outputs); the communicator; the stage's `load` (tokenizer, data, batch source, held-out batches);
the engine with the weights (the stage's starting ones, or the resumed ones with their AdamW moments and
batch order); the stage's `ready` (work that needs the engine, e.g. DPO's reference log-probabilities); the
banners; train.loop.fit with the stage's objective; the closing line.

A stage sets, on the Run: in `begin`, `cfg` (for the device rule) and `hyper` (its defaults); in `load`,
`cfg`, `tok`, `source`, `val_quick`, `val_full`; and it answers `origin` (where the weights come from),
`plan` (what the run does and what a batch holds, for the banner), `objective`, `train_state` and
`fit_options` (sample prompt, title, chat flag, first log record).
"""
import dataclasses
import os
import sys
import time

from nanoeuler.errors import UserError
from nanoeuler.io import checkpoint
from nanoeuler.files import check_writable, remove_stale_temporaries
from nanoeuler.io.report import machine
from nanoeuler.model.config import param_count
from nanoeuler.model.device import resolve, wants_gpu
from nanoeuler.model.engine import make_engine
from nanoeuler.model.optimizer import AdamW
from nanoeuler.parallel.comm import World, make_communicator
from nanoeuler.train.distributed import DataParallel
from nanoeuler.train.loop import Hyperparameters, fit, schedule_text


class Stage:
    """The hooks of one training command (see the module docstring); `kind` is what its checkpoints' training
    state says, `command` how the user runs it."""
    kind = command = None

    def begin(self, run):
        """Which model and data: set run.cfg (for the device rule), run.hyper, and run.params (new runs)."""
        raise NotImplementedError

    def load(self, run):
        """Set run.cfg, run.tok, and (unless ready does) run.source, run.val_quick, run.val_full."""
        raise NotImplementedError

    def ready(self, run):
        """Work that needs run.eng, before training starts."""

    def origin(self, run):
        """Where the weights come from, for the model banner."""
        raise NotImplementedError

    def plan(self, run):
        """(what the run does, what a batch holds), for the schedule banner."""
        raise NotImplementedError

    def objective(self, run):
        raise NotImplementedError

    def train_state(self, run):
        """What --resume needs beyond the loop's own state."""
        return {}

    def fit_options(self, run):
        return {}

    def done(self, run):
        return f"saved {run.out}"


class Run:
    """What one training command has decided so far: args, world, outputs, the resumed checkpoint, and what
    the stage's hooks fill in."""

    def __init__(self, args):
        self.args = args
        self.world = run_world(args)
        self.say = print if self.world.is_main else (lambda *a, **k: None)
        self.out = args.out
        self.log_path = args.log or os.path.splitext(args.out)[0] + ".jsonl"
        self.ck = self.params = None
        self.source = None

    @property
    def start_step(self):
        return self.ck.step if self.ck is not None else 0

    def eval_limits(self):
        """(final, periodic) evaluation batches. Rank 0 evaluates alone, in batches of the per-rank size: N
        times as many of them cover the windows one process at the global batch would score, so the validation
        numbers do not depend on the world size."""
        n, hp = self.world.world_size, self.hp
        return None if hp.final_eval_batches is None else hp.final_eval_batches * n, hp.eval_batches * n

    def batch_text(self):
        """The batch of a step in words: B, (N passes of B), and the ranks that each take one."""
        hp, n = self.hp, self.world.world_size
        text = f"{hp.batch_size}" if hp.grad_accum == 1 else f"({hp.grad_accum} passes of {hp.batch_size})"
        return text if n == 1 else f"{n} ranks x {text}"

    def schedule(self):
        hp = self.hp
        return f"peak lr {hp.lr:g}, warmup {hp.warmup}, {schedule_text(hp)}; log {self.log_path}" + (
            f"; resuming {self.out}" if self.ck is not None else "")


def run_stage(stage, args):
    """Run a training command: the skeleton above with `stage`'s hooks. Returns its exit status."""
    run = Run(args)
    if args.resume:
        run.ck = load_for_resume(run.out, stage.kind, stage.command)
    elif os.path.isfile(run.out) and not args.overwrite:
        raise UserError(f"{run.out} exists: --resume continues it, --overwrite starts afresh and replaces it, "
                        "--out FILE writes elsewhere")
    if os.path.abspath(run.out) == os.path.abspath(getattr(args, "ckpt", None) or ""):
        raise UserError(f"--out {run.out} is the checkpoint this run starts from (--ckpt); name another file")
    stage.begin(run)
    if run.cfg.quant is not None:  # a quantized model decodes and scores only
        raise UserError(f"{getattr(args, 'ckpt', None) or run.out} is quantized ({run.cfg.quant}): full training needs float weights")
    run.hp = run_hyper(args, run.ck, run.hyper, run.world.world_size)
    eval_task = training_eval(args, run.hp)  # its items read now: a bad file stops the run before any work
    run.device = run_device(args, run.cfg, run.out, run.log_path, run.world.world_size)
    run.comm = make_communicator(run.world, run.device)
    stage.load(run)

    hp, ck = run.hp, run.ck
    eng = run.eng = make_engine(run.cfg, device=run.device, seed=hp.seed,
                                precision=engine_precision(args, run.device, ck))
    optimizer = AdamW(eng, hp.beta1, hp.beta2)
    if ck is not None:
        eng.load_params(ck.params)
        optimizer.load_state(*ck.opt, ck.train_state["opt_step"])
    elif run.params is not None:
        eng.load_params(run.params)
    stage.ready(run)
    if ck is not None:
        run.source.load_state(ck.train_state["source"])
    parallel = DataParallel(eng, optimizer, run.comm, zero=getattr(args, "zero", 0) == 1)
    del optimizer  # with ZeRO-1 the full moments it holds are dropped: that is the memory saved
    if parallel.zero and eng.device_memory() is not None:
        eng.xp.get_default_memory_pool().free_all_blocks()  # so that CuPy's pool hands them back

    slow = " (no GPU: this will be slow)" if run.device == "cpu" and wants_gpu(run.cfg) else ""
    cfg = run.cfg
    run.say(f"model: {stage.origin(run)}, {param_count(cfg) / 1e6:.2f}M parameters (dim {cfg.dim}, {cfg.n_layers} "
            f"layers, {cfg.n_heads}/{cfg.n_kv_heads} heads, context {cfg.context}, vocab {cfg.vocab_size}, "
            f"{cfg.mtp_heads} prediction head{'s' * (cfg.mtp_heads != 1)}{', tied to the embedding' * cfg.tied}), "
            f"{run.device.upper()} engine in "
            f"{eng.precision}{slow}")
    verb, unit = stage.plan(run)
    run.say(f"{verb}: steps {run.start_step + 1}..{hp.steps} of {run.batch_text()}{unit}, {run.schedule()}")
    sys.stdout.flush()
    t0 = time.perf_counter()
    status = fit(eng, run.tok, run.source, run.val_quick, run.val_full, hp, run.out, run.log_path,
                 stage.objective(run), parallel, start_step=run.start_step,
                 train_state=dict(kind=stage.kind, precision=eng.precision, device=run.device,
                                  machine=machine(run.device), argv=sys.argv[1:], **stage.train_state(run)),
                 eval_task=eval_task, **stage.fit_options(run))
    if status == 0 and run.world.is_main:
        run.say(f"done in {time.perf_counter() - t0:.0f} s: {stage.done(run)}")
    return status


# ------------------------------------------------------------------------------------------ the pieces
def refuse_changed_flags(run, flags, why):
    """--resume: a flag given again must keep the value the run's checkpoint was trained with (why: what a
    change would break)."""
    state = run.ck.train_state
    for flag in flags:
        given = getattr(run.args, flag)
        if given is not None and given != state[flag]:
            raise UserError(f"--resume: {run.out} was trained with --{flag.replace('_', '-')} {state[flag]}; {why}")


def training_eval(args, hp):
    """--eval-task hellaswag|mc:FILE as eval.tasks.TrainingEval, every --eval-task-every steps (default: the
    evaluation's); None without the flag."""
    if not getattr(args, "eval_task", None):
        if getattr(args, "eval_task_every", None):
            raise UserError("--eval-task-every needs --eval-task hellaswag|mc:FILE")
        return None
    from nanoeuler.eval.main import parse_eval_task
    from nanoeuler.eval.tasks import TrainingEval
    name, items = parse_eval_task(args.eval_task)
    return TrainingEval(name, items, args.eval_task_every or hp.eval_every, hp.batch_size)


def run_world(args):
    """This process's World (parallel/world.py): from the variables that `--gpus N` (parallel/launch.py), torchrun, srun
    or mpirun set, else a world of one; --gpus (x --nnodes), when given, must agree with it."""
    world = World.from_env()
    gpus, nodes = getattr(args, "gpus", None), getattr(args, "nnodes", None) or 1
    if gpus is not None and gpus * nodes != world.world_size:
        hosts = f" x --nnodes {nodes}" if nodes > 1 else ""
        raise UserError(f"--gpus {gpus}{hosts} but WORLD_SIZE is {world.world_size}")
    return world


def load_for_resume(out, kind, command):
    """The checkpoint at `out` with its optimizer state, which `command` (of training `kind`) must have
    written; a one-line error otherwise."""
    if not os.path.exists(out):
        raise UserError(f"--resume: nothing to resume, {out} not found (--out names the checkpoint)")
    ck = checkpoint.load(out, with_opt=True)
    if not ck.train_state or ck.train_state.get("kind") != kind:
        raise UserError(f"--resume: {out} was not written by `{command}`; nothing to resume")
    return ck


def hyper_with_flags(base, args):
    """Preset (or resumed) hyperparameters with the flags the user gave on top."""
    overrides = {field: getattr(args, field) for field in ("steps", "batch_size", "lr", "seed", "eval_every",
                                                           "sample_every", "ckpt_every", "grad_accum")
                 if getattr(args, field, None) is not None}
    hp = dataclasses.replace(base, **overrides)
    if hp.warmup >= hp.steps:
        hp = dataclasses.replace(hp, warmup=max(1, hp.steps // 10))
    return hp


def run_hyper(args, ck, fresh, world_size=1):
    """The run's hyperparameters: a resumed run's own (ck), else `fresh`, with the flags given on top; a
    finished run needs a larger --steps. A run resumed on another number of ranks keeps its global batch
    (batch_size is per rank), so it continues on the very batches it would have drawn (data.RandomWindows)."""
    base = fresh
    if ck is not None:
        base = Hyperparameters(**ck.train_state["hyper"])
        total = base.batch_size * ck.train_state.get("world_size", 1)
        if getattr(args, "batch_size", None) is None and total != base.batch_size * world_size:
            if total % world_size:
                raise UserError(f"--resume: {args.out} was trained on global batches of {total}, which "
                                f"{world_size} ranks cannot share evenly; pass --batch-size (per rank)")
            base = dataclasses.replace(base, batch_size=total // world_size)
    hp = hyper_with_flags(base, args)
    if ck is not None and ck.step >= hp.steps:
        raise UserError(f"--resume: {args.out} is at step {ck.step}, --steps {hp.steps} is no further; pass --steps N "
                        f"above {ck.step} to train longer")
    return hp


def run_device(args, cfg, out, log_path, world_size=1):
    """The run's device for a model like cfg (several ranks: the GPU whenever there is one, as --gpus says); a
    precision the device lacks and outputs that cannot be written are refused here, before any work
    (tokenizer training, data loading) starts."""
    device = resolve(args.device, cfg if world_size == 1 else None)
    if device == "cpu" and args.precision not in (None, "fp32"):
        raise UserError(f"--precision {args.precision}: the CPU engine computes in fp32 only")
    for path in (out, log_path, os.path.splitext(log_path)[0] + ".png"):
        check_writable(path)
        remove_stale_temporaries(path)  # a run killed mid-write leaves its temporary behind
    return device


def engine_precision(args, device, ck):
    """--precision, else on --resume the precision the run trained in (where this device has it), else the
    device's default (None: bf16 on the GPU, fp32 on the CPU)."""
    if args.precision:
        return args.precision
    previous = (ck.train_state or {}).get("precision") if ck is not None else None
    return previous if previous and (device == "gpu" or previous == "fp32") else None
