"""The options of the training commands as typed objects: what `nanoeuler train|sft|dpo` were asked, made
once from the parsed command line (`from_args`, the one place below cli.py that reads it); everything under
the commands takes these. A flag left out is None where the command's own default (its table, the resumed
checkpoint's value) decides.
"""
import dataclasses


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """The flags train, sft and dpo share (cli.py's _run_flags, _training_flags, _parallel_flags)."""
    out: str = "nanoeuler.bin"
    resume: bool = False
    overwrite: bool = False
    log: str = None                 # the metrics log (default: out with .jsonl)
    device: str = "auto"
    precision: str = None
    ckpt: str = None                # the checkpoint the weights start from
    data: str = None
    # hyperparameters over the stage's table (or the resumed run's own)
    steps: int = None
    batch_size: int = None          # per rank
    lr: float = None
    seed: int = None
    eval_every: int = None
    sample_every: int = None
    ckpt_every: int = None
    grad_accum: int = None
    eval_task: str = None           # hellaswag | mc:FILE, scored during training
    eval_task_every: int = None
    # ranks
    gpus: int = None
    nnodes: int = None
    zero: int = None                # the ZeRO stage 0..3; None: 1 for full training, 0 (whole) for LoRA
    recompute: object = False       # False, or auto | mlp | products | layer: activations recomputed in the backward pass

    HYPER_FLAGS = ("steps", "batch_size", "lr", "seed", "eval_every", "sample_every", "ckpt_every", "grad_accum")

    @classmethod
    def from_args(cls, args):
        """The options from an argparse.Namespace (or any object with the flags as attributes); a flag it
        lacks takes the default above."""
        return cls(**{field.name: getattr(args, field.name) for field in dataclasses.fields(cls)
                      if hasattr(args, field.name)})

    def hyper_flags(self):
        """{hyperparameter: value} of the hyperparameter flags given."""
        return {name: getattr(self, name) for name in self.HYPER_FLAGS if getattr(self, name) is not None}


@dataclasses.dataclass(frozen=True)
class PretrainOptions(RunOptions):
    preset: str = None              # small | big | base | large; on --resume the checkpoint's
    tokenizer: str = None           # a tokenizer.json to use instead of learning one


@dataclasses.dataclass(frozen=True)
class FineTuneOptions(RunOptions):
    """The flags sft and dpo add: LoRA's (model/lora.py)."""
    lora: int = None                # the adapters' rank; None: full fine-tuning
    lora_alpha: float = None        # default 2 * rank
    lora_dropout: float = None      # default 0
    lora_targets: str = None        # q,k,v,o,gate,up,down (the default: all seven)
    adapter: str = None             # a PEFT LoRA folder to start the adapters from (sft)


@dataclasses.dataclass(frozen=True)
class SftOptions(FineTuneOptions):
    out: str = "nanoeuler_chat.bin"
    ckpt: str = "nanoeuler.bin"
    val_examples: int = None
    long: str = None                # truncate | skip
    show: int = None                # print N examples as trained and exit


@dataclasses.dataclass(frozen=True)
class DpoOptions(FineTuneOptions):
    out: str = "nanoeuler_dpo.bin"
    ckpt: str = "nanoeuler_chat.bin"
    beta: float = None
    rpo_alpha: float = None
    val_pairs: int = None
