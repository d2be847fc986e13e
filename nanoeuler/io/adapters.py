"""Adapter checkpoints: what `sft|dpo --lora R --out F` writes, the adapters alone (megabytes, not the base's
gigabytes) and the checkpoint of the base they belong to, by path.

The file is a nanoeuler checkpoint (io/checkpoint.py: safetensors, format "nanoeuler", the base's `config` and
`tokenizer`, `step`, `chat`, `train`) whose tensors are the adapters (model/lora.py's names: `layers.0.q.lora_a`,
...; with the AdamW moments under `opt.m.` / `opt.v.`), plus three metadata keys: `adapters` (the LoraSpec as
JSON), `base` (the base checkpoint's absolute path) and `base_fingerprint` (its parameter count and a sum over a
sample of its weights, so an adapter is not silently merged into another model of the same shape).

Everywhere a model is read (`checkpoint.load`: infer, chat, serve, eval, export --hf / --gguf) an adapter
checkpoint is the base with the adapters merged in; training reads the adapters themselves (`load`) to resume.
"""
import dataclasses
import json
import os

import numpy as np
from safetensors import safe_open

from nanoeuler.errors import UserError
from nanoeuler.files import atomic_write
from nanoeuler.io import checkpoint
from nanoeuler.model import lora

FINGERPRINT_STRIDE = 1009  # every 1009th weight summed: cheap for a large model, changed by any retraining


@dataclasses.dataclass
class AdapterCheckpoint:
    cfg: object           # the base's Config
    spec: lora.LoraSpec
    params: np.ndarray    # flat float32 adapters, model/lora.py's layout
    base: str             # the base checkpoint's path
    fingerprint: str
    tokenizer_json: str
    step: int
    chat: bool = False
    opt: tuple = None
    train_state: dict = None


def fingerprint(params):
    """A short string that tells a base's weights apart: their count and a float64 sum of a strided sample."""
    params = np.asarray(params)
    return f"{params.size}:{float(np.sum(params[::FINGERPRINT_STRIDE], dtype=np.float64)):.17g}"


def is_adapter(meta):
    """Whether a checkpoint's metadata is an adapter checkpoint's."""
    return "adapters" in meta


def save(path, cfg, spec, values, base, base_fingerprint, tokenizer_json, step, opt=None, train_state=None,
         chat=False):
    """Atomically write an adapter checkpoint: values (and opt's m, v) flat float32 host arrays of spec's layout."""
    tensors = dict(lora.adapter_views(np.ascontiguousarray(values, dtype=np.float32), cfg, spec))
    if opt is not None:
        for prefix, flat in zip(("opt.m.", "opt.v."), opt):
            for name, view in lora.adapter_views(np.ascontiguousarray(flat, dtype=np.float32), cfg, spec).items():
                tensors[prefix + name] = view
    metadata = {"format": checkpoint.FORMAT, "config": cfg.to_json(), "tokenizer": tokenizer_json,
                "step": str(int(step)), "chat": "1" if chat else "0", "adapters": spec.to_json(),
                "base": os.path.abspath(base), "base_fingerprint": base_fingerprint}
    if train_state is not None:
        metadata["train"] = json.dumps(train_state, sort_keys=True)
    atomic_write(path, lambda f: checkpoint.write_safetensors(f, tensors, metadata))


def load(path, with_opt=False):
    """Read and validate an adapter checkpoint (one-line UserErrors as checkpoint.load's)."""
    path = os.fspath(path)
    meta = checkpoint.read_metadata(path)
    if not is_adapter(meta):
        raise UserError(f"{path} is a model checkpoint, not an adapter checkpoint (sft/dpo --lora writes those)")
    cfg = checkpoint.read_config(path)
    try:
        spec = lora.LoraSpec.from_json(meta["adapters"])
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"checkpoint {path} is corrupt (bad adapters metadata: {e})") from None
    layout, total = lora.adapter_layout(cfg, spec)
    prefixes = [""] + (["opt.m.", "opt.v."] if with_opt else [])
    flats = {prefix: np.empty(total, dtype=np.float32) for prefix in prefixes}
    try:
        with safe_open(path, framework="numpy") as f:
            names = set(f.keys())
            if with_opt and "opt.m." + next(iter(layout)) not in names:
                raise UserError(f"checkpoint {path} has no optimizer state to resume from")
            for prefix, flat in flats.items():
                for name, view in lora.adapter_views(flat, cfg, spec).items():
                    if prefix + name not in names:
                        raise UserError(f"checkpoint {path} has no tensor {prefix + name}, which its adapters require")
                    view[...] = f.get_tensor(prefix + name)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"checkpoint {path} is corrupt ({type(e).__name__}: {e})") from None
    if not np.isfinite(flats[""]).all():
        raise UserError(f"checkpoint {path} holds non-finite adapter weights")
    try:
        train_state = json.loads(meta["train"]) if "train" in meta else None
    except ValueError:
        raise UserError(f"checkpoint {path} is corrupt (unreadable training state)") from None
    return AdapterCheckpoint(cfg=cfg, spec=spec, params=flats[""], base=meta.get("base", ""),
                             fingerprint=meta.get("base_fingerprint", ""), tokenizer_json=meta["tokenizer"],
                             step=int(meta["step"]), chat=meta.get("chat") == "1",
                             opt=(flats["opt.m."], flats["opt.v."]) if with_opt else None, train_state=train_state)


def base_path(ack, path):
    """Where the adapter checkpoint's base is: its recorded path, else a file of that name beside the adapter
    checkpoint (the two moved together); a one-line UserError if neither exists."""
    beside = os.path.join(os.path.dirname(os.path.abspath(path)), os.path.basename(ack.base))
    for candidate in (ack.base, beside):
        if candidate and os.path.isfile(candidate):
            return candidate
    raise UserError(f"adapter checkpoint {path}: its base {ack.base} is not found (nor beside it)")


def load_base(ack, path):
    """The base checkpoint of the adapter checkpoint at path, checked to be the one the adapters were trained on."""
    where = base_path(ack, path)
    if os.path.abspath(where) == os.path.abspath(path):
        raise UserError(f"adapter checkpoint {path} names itself as its base")
    base = checkpoint.load(where)  # an adapter checkpoint too (DPO's adapters over SFT's): merged, as trained on
    if base.cfg != ack.cfg or (ack.fingerprint and fingerprint(base.params) != ack.fingerprint):
        raise UserError(f"adapter checkpoint {path}: {where} is not the base it was trained on (its weights differ)")
    return base


def merged(path):
    """checkpoint.load of an adapter checkpoint: its base with the adapters merged in, at the adapters' step."""
    ack = load(path)
    base = load_base(ack, path)
    base.params = lora.merge(base.cfg, base.params, ack.spec, ack.params)
    base.step, base.chat = ack.step, ack.chat or base.chat
    base.train_state = ack.train_state
    return base
