"""The command skeleton that `train`, `sft` and `dpo` share; a stage is a few functions that return values.

    return run(STAGE, PretrainOptions.from_args(args))     # pretrain.py; sft.py and dpo.py likewise

run() does, in order: the world of ranks; --resume's checkpoint (written by the same stage, with its
optimizer state: train/resume.py); the stage's `plan(options, resumed, stored) -> Model` (the model, its starting
weights, the stage's default hyperparameters; stored: ZeRO-2/3 on several ranks, whose checkpoint weights stay
in the file, each rank reading its shard); the hyperparameters (a resumed run's own, else the stage's, with
the flags on top); the device and precision (refused early, as are unwritable outputs); the communicator; the
stage's `load(options, model, context) -> Data` (tokenizer, batch source, held-out batches, objective, the
training state --resume needs); the engine with the weights (ZeRO-2/3: the engine never whole, each rank's
shard of the weights in its Trainable); what trains (train/trainable.py's Trainable: the weights, their
optimizer, the ranks' reduction, sharded by --zero's stage; with --lora R or --adapter DIR its LoraTrainable:
adapters on frozen weights, the engine made without gradients, after ready()); the stage's `ready(...) -> Data`
where it has work that needs the engine (DPO's reference log-probabilities, on ZeRO-3's weights gathered whole);
the banners; train.loop.fit(Job, Trainable); the closing line (the stage's `finish`, where it has one).
"""
import dataclasses
import os
import sys
import time

from nanoeuler.errors import UserError
from nanoeuler.files import check_writable, remove_stale_temporaries
from nanoeuler.io.report import machine
from nanoeuler.model.config import InitialWeights, param_count
from nanoeuler.model.device import precision as device_precision, resolve, wants_gpu
from nanoeuler.model.engine import make_engine
from nanoeuler.model.gpu import require_libraries
from nanoeuler.parallel.comm import make_communicator
from nanoeuler.parallel.world import printer, world_of
from nanoeuler.train import resume
from nanoeuler.train.loop import Job, fit, schedule_text
from nanoeuler.train.trainable import LORA_LR_FACTOR, LoraTrainable, Trainable, is_sharded, lora_plan


@dataclasses.dataclass(frozen=True)
class Model:
    """What a stage's plan() decides before any work: the model's config (final, or close enough for the device
    rule: pretraining's vocabulary is its tokenizer's, which load() learns), the stage's default
    hyperparameters, where the weights come from in words (the banner), the weights to start from (None: a
    fresh initialisation, or the resumed checkpoint's; a quantized base's matrices in `quantized`), and the
    stage's own settings (its data, preset, ...)."""
    cfg: object
    hyper: object
    origin: str
    params: object = None
    settings: object = None
    quantized: object = None    # a quantized base's {name: QuantizedTensor} (QLoRA: params its float tensors)


@dataclasses.dataclass(frozen=True)
class Data:
    """What a stage's load() (and ready()) return: the model's final config, the tokenizer, the batch source,
    the held-out batches (loop.Validation), the objective (objectives.py), the training state the
    checkpoints carry for --resume, the banner's description of a step (`doing`, e.g. "training", and `unit`,
    what a batch holds), and what fit() shows and writes beside the numbers: whether the result is a chat
    model, the samples' prompt, the curve's title, the first metrics record's extra fields, the closing line;
    and `pairs`, what a stage keeps for its ready() and finish() (DPO's pairs, before their batches exist)."""
    cfg: object
    tokenizer: object
    source: object
    validation: object
    objective: object
    state: dict
    doing: str
    unit: str
    chat: bool = False
    sample_prompt: str = "\n"
    title: str = "nanoeuler"
    log_first: dict = None
    done: str = ""
    pairs: object = None


@dataclasses.dataclass(frozen=True)
class Context:
    """What the skeleton has settled that a stage's load() and ready() read: the options, the resumed
    checkpoint (or None), the world of ranks and its communicator, the hyperparameters, the device, the
    metrics log's path, and rank 0's printer."""
    options: object
    resumed: object
    world: object
    comm: object
    hyper: object
    device: str
    log_path: str
    say: object

    def eval_limits(self):
        """The batches of the (full, quick) evaluations (loop.Validation's), None: all of them. Rank 0 evaluates alone, in batches of the per-rank size: N
        times as many of them cover the windows one process at the global batch would score, so the validation
        numbers do not depend on the world size."""
        n, hp = self.world.world_size, self.hyper
        return None if hp.final_eval_batches is None else hp.final_eval_batches * n, hp.eval_batches * n


@dataclasses.dataclass(frozen=True)
class Stage:
    """One training command as functions (module docstring): `kind` is what its checkpoints' training state
    says, `command` how the user runs it."""
    kind: str
    command: str
    plan: object                # (options, resumed, stored) -> Model
    load: object                # (options, model, context) -> Data
    ready: object = None        # (model, data, engine, context) -> Data: work that needs the engine
    finish: object = None       # (model, data, engine, context) -> the closing line, after training


def run(stage, options):
    """Run a training command: the skeleton above with `stage`'s functions. Returns its exit status."""
    world = world_of(options.gpus, options.nnodes)
    say = printer(world.rank)
    # ZeRO-2/3 on N ranks: the checkpoint's weights stay in the file, each rank reads its shard of them
    stored = is_sharded(options.zero or 0, world.world_size)
    resumed = resume.load(options, stage.kind, stage.command, stored=stored)
    if os.path.abspath(options.out) == os.path.abspath(options.ckpt or ""):
        raise UserError(f"--out {options.out} is the checkpoint this run starts from (--ckpt); name another file")
    model = stage.plan(options, resumed, stored)
    adapters = (lora_plan(options, resumed, model.cfg, options.ckpt, model.params, model.quantized)
                if hasattr(options, "lora") else None)
    if model.cfg.quant is not None and adapters is None:  # QLoRA trains adapters on it; nothing else trains it
        raise UserError(f"{options.ckpt or options.out} is quantized ({model.cfg.quant}): full training needs float "
                        "weights (train the float checkpoint, or adapters on this one with --lora R)")
    if adapters is not None and options.zero:
        raise UserError("--zero shards full training's optimizer state; LoRA's adapters keep theirs whole (it is small)")
    zero = zero_stage(options, adapters is not None)
    fresh = model.hyper if adapters is None else dataclasses.replace(model.hyper, lr=model.hyper.lr * LORA_LR_FACTOR)
    hp = resume.hyperparameters(options, resumed, fresh, world.world_size)
    eval_task = training_eval(options, hp)  # its items read now: a bad file stops the run before any work
    log_path = options.log or os.path.splitext(options.out)[0] + ".jsonl"
    device = run_device(options, model.cfg, log_path, world.world_size)
    context = Context(options, resumed, world, make_communicator(world, device), hp, device, log_path, say)
    data = stage.load(options, model, context)

    # LoRA: the base frozen, without gradients or (in bf16) float32 master weights; the adapters train.
    # ZeRO-2/3: the engine without its whole buffers; each rank takes its shard of the weights (Trainable)
    sharded = adapters is None and is_sharded(zero, world.world_size)
    eng = make_engine(data.cfg, device=device, seed=hp.seed, precision=resume.precision(options, device, resumed),
                      training=adapters is None, zero=zero if sharded else 0, ranks=world.world_size)
    eng.recompute = options.recompute
    start = resumed if resumed is not None else model
    weights = None
    if sharded:  # a fresh model's initial weights drawn a tensor at a time, each rank keeping its shard
        weights = start.params if start.params is not None else InitialWeights(data.cfg, hp.seed)
    elif start.params is not None:
        eng.load_params(start.params, start.quantized)
    if adapters is None:
        trainable = Trainable(eng, hp, context.comm, zero=zero, resumed=resumed, weights=weights)
        if stage.ready is not None:
            with trainable.evaluating():  # every rank: ZeRO-3's weights whole for DPO's reference and replies
                data = stage.ready(model, data, eng, context)
    else:  # after ready(): DPO's reference is the base without the adapters
        if stage.ready is not None:
            data = stage.ready(model, data, eng, context)
        trainable = LoraTrainable(eng, adapters, hp, context.comm, resumed=resumed, seed=hp.seed)
    if resumed is not None:
        data.source.load_state(resumed.train_state["source"])

    start_step = resumed.step if resumed is not None else 0
    slow = " (no GPU: this will be slow)" if device == "cpu" and wants_gpu(data.cfg) else ""
    cfg = data.cfg
    say(f"model: {model.origin}, {param_count(cfg) / 1e6:.2f}M parameters (dim {cfg.dim}, {cfg.n_layers} "
        f"layers, {cfg.n_heads}/{cfg.n_kv_heads} heads, context {cfg.context}, vocab {cfg.vocab_size}, "
        f"{cfg.mtp_heads} prediction head{'s' * (cfg.mtp_heads != 1)}{', tied to the embedding' * cfg.tied}), "
        f"{device.upper()} engine in {eng.precision}{slow}")
    if adapters is not None:
        spec, n = adapters.spec, trainable.adapters.size
        say(f"LoRA: rank {spec.rank}, alpha {spec.alpha:g} (scale {spec.scale:g}), dropout {spec.dropout:g}, on "
            f"{','.join(spec.targets)}: {n / 1e6:.2f}M trained parameters ({100 * n / param_count(cfg):.2f}% of the "
            f"model), from {adapters.origin}; the base frozen; checkpoints hold the adapters alone")
    if world.world_size > 1 and adapters is None:
        say(f"ZeRO stage {zero}: {ZERO_STAGES[zero]}")
    say(f"{data.doing}: steps {start_step + 1}..{hp.steps} of {batch_text(hp, world.world_size)}{data.unit}, "
        f"peak lr {hp.lr:g}, warmup {hp.warmup}, {schedule_text(hp)}; log {log_path}"
        + (f"; resuming {options.out}" if resumed is not None else ""))
    sys.stdout.flush()
    t0 = time.perf_counter()
    train_state = dict(kind=stage.kind, precision=eng.precision, device=device, machine=machine(device),
                       argv=sys.argv[1:], **data.state)
    job = Job(hp, data.tokenizer, data.source, data.validation, data.objective, options.out, log_path,
              start_step=start_step, train_state=train_state, chat=data.chat, sample_prompt=data.sample_prompt,
              title=data.title, log_first=data.log_first, eval_task=eval_task)
    status = fit(job, trainable)
    if status == 0 and stage.finish is not None:
        with trainable.evaluating():  # every rank: ZeRO-3's weights whole for rank 0's closing work
            done = stage.finish(model, data, eng, context) if world.is_main else None
    else:
        done = data.done
    if status == 0:
        say(f"done in {time.perf_counter() - t0:.0f} s: {done}")
    return status


# ------------------------------------------------------------------------------------------ the pieces
ZERO_STAGES = {0: "every rank holds the weights, gradients and AdamW moments (replicated update)",
               1: "the AdamW moments sharded over the ranks",
               2: "the gradients and the AdamW moments sharded over the ranks",
               3: "the weights, gradients and AdamW moments sharded over the ranks, a layer gathered at a time"}


def zero_stage(options, lora):
    """The ZeRO stage of the run: --zero, else 1 for full training (on one rank every stage is the plain
    update) and 0 for LoRA's adapters, which keep their small state whole."""
    if options.zero is not None:
        return options.zero
    return 0 if lora else 1


def batch_text(hp, world_size):
    """The batch of a step in words: B, (N passes of B), and the ranks that each take one."""
    text = f"{hp.batch_size}" if hp.grad_accum == 1 else f"({hp.grad_accum} passes of {hp.batch_size})"
    return text if world_size == 1 else f"{world_size} ranks x {text}"


def training_eval(options, hp):
    """--eval-task hellaswag|mc:FILE as eval.tasks.TrainingEval, every --eval-task-every steps (default: the
    evaluation's); None without the flag."""
    if not options.eval_task:
        if options.eval_task_every:
            raise UserError("--eval-task-every needs --eval-task hellaswag|mc:FILE")
        return None
    from nanoeuler.eval.tasks import TrainingEval, parse_eval_task
    name, items = parse_eval_task(options.eval_task)
    return TrainingEval(name, items, options.eval_task_every or hp.eval_every, hp.batch_size)


def run_device(options, cfg, log_path, world_size=1):
    """The run's device for a model like cfg (several ranks: the GPU whenever there is one, as --gpus says); a
    precision the device lacks and outputs that cannot be written are refused here, before any work
    (tokenizer training, data loading) starts."""
    device = resolve(options.device, cfg if world_size == 1 else None)
    device_precision(device, options.precision)
    if device == "gpu":
        require_libraries()  # training's products are cuBLAS's: without its bindings, one line now
    for path in (options.out, log_path, os.path.splitext(log_path)[0] + ".png"):
        check_writable(path)
        remove_stale_temporaries(path)  # a run killed mid-write leaves its temporary behind
    return device
