"""--resume's rules in one place: which checkpoint a run continues, which flags must keep the values it was
trained with, the hyperparameters it goes on with, and the precision it computes in.
"""
import dataclasses
import os

from nanoeuler.errors import UserError
from nanoeuler.io import checkpoint
from nanoeuler.train.loop import Hyperparameters


def load(options, kind, command, stored=False):
    """The checkpoint that options.resume continues (options.out, with its optimizer state), which `command`
    (of training `kind`) must have written; None for a new run, whose outputs must then be free. One-line
    errors otherwise. Its moments are read as the run needs them, and with stored its weights too (ZeRO-2/3's
    ranks read their shards: checkpoint.StoredFlat). An adapter checkpoint (a LoRA run) is read as its base's
    weights with the adapters' state: step, moments, training state, and the adapters themselves in
    `adapters`."""
    out = options.out
    if not options.resume:
        if os.path.isfile(out) and not options.overwrite:
            raise UserError(f"{out} exists: --resume continues it, --overwrite starts afresh and replaces it, "
                            "--out FILE writes elsewhere")
        return None
    if not os.path.exists(out):
        raise UserError(f"--resume: nothing to resume, {out} not found (--out names the checkpoint)")
    if checkpoint.is_adapter(checkpoint.read_metadata(out)):  # a LoRA run: its base's weights, its adapters' state
        ack = checkpoint.load_adapters(out, with_opt=True)
        base = checkpoint.load_adapter_base(ack, out)
        ck = dataclasses.replace(base, step=ack.step, chat=ack.chat, opt=ack.opt, train_state=ack.train_state,
                                 adapters=ack)
    else:
        ck = checkpoint.load(out, with_opt=True, stored_opt=True, stored_params=stored)
    if not ck.train_state or ck.train_state.get("kind") != kind:
        raise UserError(f"--resume: {out} was not written by `{command}`; nothing to resume")
    return ck


def refuse_changed(options, resumed, flags, why):
    """A flag given again must keep the value the resumed run was trained with (why: what a change would
    break)."""
    state = resumed.train_state
    for flag in flags:
        given = getattr(options, flag)
        if given is not None and given != state[flag]:
            raise UserError(f"--resume: {options.out} was trained with --{flag.replace('_', '-')} {state[flag]}; "
                            f"{why}")


def hyperparameters(options, resumed, fresh, world_size=1):
    """The run's hyperparameters: a resumed run's own, else `fresh` (the stage's), with the flags given on top
    (a warmup at least as long as the run shortened to a tenth); a finished run needs a larger --steps. A run
    resumed on another number of ranks keeps its global batch (batch_size is per rank), so it continues on the
    very batches it would have drawn (data.RandomWindows)."""
    base = fresh
    if resumed is not None:
        base = Hyperparameters(**resumed.train_state["hyper"])
        total = base.batch_size * resumed.train_state.get("world_size", 1)
        if options.batch_size is None and total != base.batch_size * world_size:
            if total % world_size:
                raise UserError(f"--resume: {options.out} was trained on global batches of {total}, which "
                                f"{world_size} ranks cannot share evenly; pass --batch-size (per rank)")
            base = dataclasses.replace(base, batch_size=total // world_size)
    hp = dataclasses.replace(base, **options.hyper_flags())
    if hp.warmup >= hp.steps:
        hp = dataclasses.replace(hp, warmup=max(1, hp.steps // 10))
    if resumed is not None and resumed.step >= hp.steps:
        raise UserError(f"--resume: {options.out} is at step {resumed.step}, --steps {hp.steps} is no further; pass "
                        f"--steps N above {resumed.step} to train longer")
    return hp


def precision(options, device, resumed):
    """--precision, else on --resume the precision the run trained in (where this device has it), else None
    (the device's default: model/device.py)."""
    if options.precision:
        return options.precision
    previous = (resumed.train_state or {}).get("precision") if resumed is not None else None
    return previous if previous and (device == "gpu" or previous == "fp32") else None
