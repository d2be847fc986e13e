"""What a training step trains and in which state: the one thing train.loop.fit() asks about the weights.

    trainable = Trainable(engine, hyper, comm, zero=1, resumed=ck)   # zero: the ZeRO stage, 0..3
    ...the objective's forward and backward passes on trainable.engine, into its gradients...
    numbers = trainable.step(lr, hyper, values)   # the ranks' sum, the clip, the AdamW step: queued
    params, (m, v), opt_step = trainable.state()  # what a checkpoint holds (a collective with ZeRO)

Today that is every weight of the engine: one flat float32 buffer of parameters (engine.params; in bf16 a
compute copy, engine.weights), one of gradients (engine.grads, which the objectives' backward passes fill),
AdamW's moments over all of them (model/optimizer.py) and, over N ranks, DataParallel's reduction and with
ZeRO-1 the moments' shards (train/distributed.py), or with ZeRO-2/3 the gradients' and weights' shards too
(train/sharded.py: Sharded, behind the same interface). What trains in another way plugs in here, behind the same
members (engine, step, state, save, evaluating, device_memory): `LoraTrainable` trains LoRA's adapters
(model/lora.py) beside the frozen weights of an engine that has no gradients, with their own flat parameters,
gradients and moments, and saves those alone as an adapter checkpoint (io/checkpoint.py). The loop, the objectives' shares and the checkpoints' format of the
training state stay as they are.
"""
import contextlib
import dataclasses

from nanoeuler.errors import UserError
from nanoeuler.io import checkpoint
from nanoeuler.model import lora
from nanoeuler.model.optimizer import AdamW
from nanoeuler.train.distributed import DataParallel
from nanoeuler.train.sharded import Sharded


def is_sharded(zero, world_size):
    """Whether a run of ZeRO stage `zero` on world_size ranks shards its weights and gradients (train/sharded.py):
    its engine is then made without its whole buffers (make_engine's zero) and takes no whole weights."""
    return zero >= 2 and world_size > 1


class Trainable:
    """Every weight of `engine`, trained by AdamW (hyper's betas) over the ranks of `comm` (zero: the ZeRO stage,
    0 to 3; a world of one is plain). resumed (a checkpoint read with its optimizer state): its moments and step
    count are taken. The engine already holds the weights to start from (Engine.load_params), or, sharded
    (is_sharded), `weights` are the weights to start from, of which each rank takes its shard (Sharded's)."""

    def __init__(self, engine, hyper, comm, zero=0, resumed=None, weights=None):
        self.engine = engine
        if is_sharded(zero, comm.world_size):  # the shard's moments made straight from the resumed whole ones
            moments = (*resumed.opt, resumed.train_state["opt_step"]) if resumed is not None else None
            self.parallel = Sharded(engine, comm, zero, hyper.beta1, hyper.beta2, moments, weights=weights)
            if engine.device_memory() is not None:
                engine.xp.get_default_memory_pool().free_all_blocks()  # the engine's whole buffers handed back
            return
        optimizer = AdamW(engine, hyper.beta1, hyper.beta2)
        if resumed is not None:
            optimizer.load_state(*resumed.opt, resumed.train_state["opt_step"])
        self.parallel = DataParallel(engine, optimizer, comm, zero=zero == 1)
        del optimizer  # with ZeRO-1 the full moments it holds are dropped: that is the memory saved
        if self.parallel.zero and engine.device_memory() is not None:
            engine.xp.get_default_memory_pool().free_all_blocks()  # so that CuPy's pool hands them back

    @property
    def comm(self):
        return self.parallel.comm

    def step(self, lr, hyper, values):
        """The ranks' gradients summed, clipped to hyper.grad_clip by their global norm, one AdamW step (lr,
        hyper.weight_decay), all queued on the device; `values` (the step's losses, tokens, Ctrl-C flags) ride
        on the norm's collective. Returns a function that waits for that step alone: (the norm, the values
        summed over the ranks)."""
        return self.parallel.start_step(lr, hyper.weight_decay, hyper.grad_clip, values)

    def state(self):
        """(the weights, the optimizer's moments (m, v), its step count) as host arrays and an int, what a
        checkpoint holds for --resume; every rank must call it (with ZeRO-1 the pieces are gathered; ZeRO-2/3's
        are streamed buffers, read while save() writes)."""
        if isinstance(self.parallel, Sharded):
            params, moments = self.parallel.streamed()
        else:
            params, moments = self.parallel.params_numpy(), self.parallel.opt_state_numpy()
        return params, moments, self.parallel.optimizer.steps

    def save(self, path, params, moments, tokenizer_json, step, train_state, chat):
        """A checkpoint of the weights and moments that state() returned: every rank calls it, rank 0 writes
        (with ZeRO-2/3 the others send their shards a unit at a time meanwhile; train_state is rank 0's)."""
        if self.comm.rank == 0:
            checkpoint.save(path, self.engine.cfg, params, tokenizer_json, step, opt=moments, train_state=train_state,
                            chat=chat)
        elif isinstance(self.parallel, Sharded):
            checkpoint.read_along(self.engine.cfg, params, moments)

    def evaluating(self):
        """A context for the evaluations, samples and closing work between and after the steps (every rank
        enters it; rank 0 works inside): ZeRO-3 gathers the whole weights for it; else nothing changes."""
        if isinstance(self.parallel, Sharded):
            return self.parallel.evaluating()
        return contextlib.nullcontext()

    def device_memory(self):
        """Bytes on the GPU beside the engine's pool (the copy engines' buffers of the reduction)."""
        return self.parallel.device_memory()


# ------------------------------------------------------------------------------------------------ LoRA
# A LoRA run's default peak learning rate is the command's full-training default times this: the ratio of the
# usual recipes (Hugging Face's alignment handbook: SFT 2e-5 full, 2e-4 LoRA; DPO 5e-7 full, 5e-6 LoRA)
LORA_LR_FACTOR = 10
@dataclasses.dataclass(frozen=True)
class LoraPlan:
    """What a LoRA run trains: its spec, the adapters to start from (None: fresh), the base checkpoint's path
    and the fingerprint of its weights (io/checkpoint.py's adapter checkpoints), and where the start came from in words."""
    spec: lora.LoraSpec
    values: object
    base: str
    fingerprint: str
    origin: str


def lora_plan(options, resumed, cfg, base_path, base_params, base_quantized=None):
    """The run's LoRA (None for full training) from --lora R, --lora-alpha, --lora-dropout, --lora-targets and
    --adapter DIR (a PEFT folder to start from), or the resumed adapter checkpoint's; one-line errors for what
    cannot be (checked before any work)."""
    given = [flag for flag in ("lora_alpha", "lora_dropout", "lora_targets") if getattr(options, flag) is not None]
    adapter = getattr(options, "adapter", None)
    if resumed is not None and resumed.adapters is not None:
        ack = resumed.adapters
        for flag, value in (("lora", ack.spec.rank), ("lora_alpha", ack.spec.alpha),
                            ("lora_dropout", ack.spec.dropout),
                            ("lora_targets", ",".join(ack.spec.targets))):
            mine = getattr(options, flag)
            if flag == "lora_targets" and mine is not None:
                mine = ",".join(lora.parse_targets(mine))
            if mine is not None and mine != value:
                raise UserError(f"--resume: {options.out} trains adapters with --{flag.replace('_', '-')} {value}")
        if adapter:
            raise UserError(f"--resume: {options.out} goes on from its own adapters; leave out --adapter")
        return LoraPlan(ack.spec, ack.params, ack.base, ack.fingerprint, f"adapters of {options.out}")
    if resumed is not None:
        if options.lora is not None or adapter:
            raise UserError(f"--resume: {options.out} is full fine-tuning, not adapters; leave out --lora/--adapter")
        return None
    if options.lora is None and not adapter:
        if given:
            raise UserError(f"--{given[0].replace('_', '-')} needs --lora R (the adapters' rank)")
        return None
    if adapter:  # a PEFT adapter to go on training: its rank, alpha and targets
        from nanoeuler.io import peft
        spec, values = peft.read(adapter, cfg)
        if options.lora is not None and options.lora != spec.rank:
            raise UserError(f"--lora {options.lora}: the adapter {adapter} has rank {spec.rank}")
        if options.lora_targets is not None and lora.parse_targets(options.lora_targets) != spec.targets:
            raise UserError(f"--lora-targets: the adapter {adapter} adapts {','.join(spec.targets)}")
        alpha = spec.alpha if options.lora_alpha is None else options.lora_alpha
        spec = lora.make_spec(cfg, spec.rank, alpha, options.lora_dropout or 0.0, spec.targets)
        return LoraPlan(spec, values, base_path, checkpoint.adapter_fingerprint(base_params, base_quantized),
                        f"the PEFT adapter {adapter}")
    targets = lora.parse_targets(options.lora_targets) if options.lora_targets is not None else lora.TARGETS
    spec = lora.make_spec(cfg, options.lora, options.lora_alpha, options.lora_dropout or 0.0, targets)
    return LoraPlan(spec, None, base_path, checkpoint.adapter_fingerprint(base_params, base_quantized),
                    "fresh adapters")


class LoraTrainable(Trainable):
    """LoRA's adapters on `engine` (made without gradients: its weights are frozen), trained by AdamW over the
    ranks of `comm` as Trainable trains an engine's weights: the adapters stand where the engine's flat
    buffers do (model/lora.py: Adapters), so the reduction, the clip and the update are DataParallel's, over
    the adapters alone; no ZeRO (their moments are small). Their dropout's key follows the optimizer's step and
    each backward pass (so a resumed run draws the uninterrupted run's masks), and is off in evaluations."""

    def __init__(self, engine, plan, hyper, comm, resumed=None, seed=0):
        self.plan = plan
        self.adapters = lora.attach(engine, plan.spec, plan.values, seed=seed)
        optimizer = AdamW(engine, hyper.beta1, hyper.beta2, mask=lora.decay_mask(self.adapters))
        if resumed is not None:
            optimizer.load_state(*resumed.opt, resumed.train_state["opt_step"])
        self.engine = engine
        self.parallel = DataParallel(self.adapters, optimizer, comm)
        self._key()

    def _key(self):
        self.adapters.dropout_key = self.parallel.optimizer.steps << 16  # the backward passes count on from there

    def step(self, lr, hyper, values):
        numbers = super().step(lr, hyper, values)
        self._key()
        return numbers

    def save(self, path, params, moments, tokenizer_json, step, train_state, chat):
        if self.comm.rank != 0:
            return
        checkpoint.save_adapters(path, self.engine.cfg, self.plan.spec, params, self.plan.base, self.plan.fingerprint,
                      tokenizer_json, step, opt=moments, train_state=train_state, chat=chat)

    @contextlib.contextmanager
    def evaluating(self):
        was, self.adapters.dropout_on = self.adapters.dropout_on, False
        try:
            yield
        finally:
            self.adapters.dropout_on = was
