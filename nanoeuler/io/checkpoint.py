"""Checkpoints: one safetensors file holding the weights, the config, the tokenizer and the resume state.

Layout (docs/design.md, "Checkpoint format"): the tensors under their model names (`tok_emb`, `layers.0.wq`,
...), optionally the AdamW moments under `opt.m.<name>` / `opt.v.<name>`, and string metadata: `format` =
"nanoeuler", `config` (JSON), `tokenizer` (JSON; an imported model's also holds its chat template and end
ids), `step`, `chat` ("0"/"1"; a model whose tokenizer has a chat template is a chat model either way), and
`train` (JSON: whatever the training loop needs to continue exactly: hyperparameters, data position, RNG
state).
`safetensors.numpy.load_file` opens it, and so does any other safetensors reader.

A quantized model (config `quant` "int8" or "int4" and `quant_group`: model/quantize.py, docs/quantization.md)
holds each of its quantized tensors as `<name>.q` (int8, or uint8 two int4 a byte), `<name>.scales` and, for
int4, `<name>.mins` (float16); the other tensors stay float32 under their names. Its params are then those
float tensors alone (config.param_layout(cfg, floats_only=True)) and `quantized` maps each quantized name to
its QuantizedTensor. The heads may have a type of their own (config `quant_head` and `quant_head_group`, e.g. an
int4 model's heads in int8: config.quant_format); without them the heads are of the layers' type, as every
quantized checkpoint written before. A checkpoint without `quant` in its config reads as it always has.

Writes are atomic (nanoeuler/files.py): a crash or Ctrl-C at any moment leaves either the old checkpoint
or the new one, never a mixture. Reads go through safetensors' own reader (safe_open), which validates the
file's layout; this module checks the rest (format, config, tensor names, shapes and dtypes) and turns every
way a file can be bad (missing, truncated, corrupt, disagreeing with its config) into a one-line UserError.
"""
import dataclasses
import json
import os

import numpy as np
from safetensors import safe_open

from nanoeuler.model import lora
from nanoeuler.model.config import (Config, float_params, param_layout, param_shapes, quant_format, quantized_names,
                                    views)
from nanoeuler.model.quantize import QuantizedTensor, stored_arrays
from nanoeuler.errors import UserError
from nanoeuler.files import atomic_write
from nanoeuler.tokenizer.bpe import Tokenizer

FORMAT = "nanoeuler"


@dataclasses.dataclass
class Checkpoint:
    cfg: Config
    params: np.ndarray            # flat float32, config.param_layout order (load's stored_params: a StoredFlat)
    tokenizer_json: str
    step: int
    chat: bool = False
    opt: tuple = None             # (m, v) flat float32, or None when the file has no optimizer state
    train_state: dict = None      # the training loop's resume state, or None
    quantized: dict = None        # a quantized model's {name: QuantizedTensor} (params: its float tensors alone)
    adapters: object = None       # --resume of a LoRA run: its AdapterCheckpoint (below; params are the base's)

    def tokenizer(self):
        return _tokenizer(self.tokenizer_json, self.cfg)


def _tokenizer(tokenizer_json, cfg, path=None):
    """The Tokenizer of a checkpoint's metadata, checked to fit its model; a one-line UserError if not."""
    where = f"checkpoint {path}" if path else "checkpoint"
    try:
        tok = Tokenizer.from_json(tokenizer_json)
    except Exception as e:
        raise UserError(f"{where} has a corrupt tokenizer ({type(e).__name__}: {e})") from None
    if tok.vocab_size > cfg.vocab_size:
        raise UserError(f"the tokenizer of {where} has {tok.vocab_size} tokens but its model only "
                        f"{cfg.vocab_size}")
    return tok


def save(path, cfg, params, tokenizer_json, step, opt=None, train_state=None, chat=False, quantized=None):
    """Atomically write a checkpoint. params (and opt's m, v) are flat float32 host arrays, or buffers streamed
    a tensor at a time (read(start, end), a collective: the other ranks call read_along meanwhile); a quantized
    model's (cfg.quant) params are its float tensors alone and quantized its {name: QuantizedTensor}."""
    if cfg.quant is not None:
        assert opt is None and set(quantized) == set(quantized_names(cfg)), "a quantized model's tensors"
        tensors = dict(views(np.ascontiguousarray(params, dtype=np.float32), cfg, floats_only=True))
        for name, qt in quantized.items():
            for suffix, array in qt.arrays().items():
                tensors[f"{name}.{suffix}"] = array
        metadata = {"format": FORMAT, "config": cfg.to_json(), "tokenizer": tokenizer_json,
                    "step": str(int(step)), "chat": "1" if chat else "0"}
        atomic_write(path, lambda f: write_safetensors(f, tensors, metadata))
        return
    tensors = _tensors(cfg, params, opt)
    metadata = {"format": FORMAT, "config": cfg.to_json(), "tokenizer": tokenizer_json,
                "step": str(int(step)), "chat": "1" if chat else "0"}
    if train_state is not None:
        metadata["train"] = json.dumps(train_state, sort_keys=True)
    atomic_write(path, lambda f: write_safetensors(f, tensors, metadata))


def _tensors(cfg, params, opt=None):
    """{tensor name: array} of the weights (and the moments under opt.m., opt.v.); a streamed buffer's (one
    with read(start, end) and no array: ZeRO-2/3's shards, train/sharded.py) are read a tensor at a time as
    the writer reaches them."""
    def named(flat):
        if hasattr(flat, "read"):
            return {name: _Streamed(flat, off, shape) for name, (off, shape) in param_layout(cfg)[0].items()}
        return views(np.ascontiguousarray(flat, dtype=np.float32), cfg)
    tensors = dict(named(params))
    if opt is not None:
        for prefix, flat in zip(("opt.m.", "opt.v."), opt):
            for name, view in named(flat).items():
                tensors[prefix + name] = view
    return tensors


class _Streamed:
    """One tensor of a streamed flat buffer: its elements are read when the writer asks for its bytes."""
    dtype = np.dtype(np.float32)

    def __init__(self, flat, offset, shape):
        self.flat, self.offset, self.shape = flat, offset, tuple(shape)
        self.nbytes = 4 * int(np.prod(shape))

    def __array__(self, dtype=None, copy=None):
        values = self.flat.read(self.offset, self.offset + self.nbytes // 4).reshape(self.shape)
        return np.asarray(values, dtype=dtype or np.float32)


def read_along(cfg, params, opt=None):
    """The other ranks' part of save() of streamed buffers: the same reads in the order rank 0's writer makes
    them (the tensors' sorted names, safetensors' order), so that the collectives behind them meet."""
    tensors = _tensors(cfg, params, opt)
    for name in sorted(tensors):
        np.asarray(tensors[name])


SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int8): "I8",
                      np.dtype(np.uint8): "U8"}
DTYPE_NAMES = {"F32": "float32", "F16": "float16", "I8": "int8", "U8": "uint8"}


def write_safetensors(f, tensors, metadata):
    """Write float32 arrays (and a quantized model's float16, int8 and uint8 ones) as a safetensors file, as
    safetensors' own writer lays it out (the tensors sorted by name, the JSON header padded with spaces to 8
    bytes), one tensor at a time: no copy of the whole file in memory."""
    names = sorted(tensors)
    header, offset = {"__metadata__": metadata}, 0
    for name in names:
        header[name] = {"dtype": SAFETENSORS_DTYPES[np.dtype(tensors[name].dtype)],
                        "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + tensors[name].nbytes]}
        offset += tensors[name].nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    f.write(len(blob).to_bytes(8, "little") + blob)
    for name in names:
        a = tensors[name]
        f.write(memoryview(np.ascontiguousarray(a, dtype=np.dtype(a.dtype).newbyteorder("<"))).cast("B"))


def _header(path):
    """The metadata and {tensor name: (dtype, shape)} of a checkpoint (dtype as safetensors names it), validated,
    without reading any tensor data."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise UserError(f"checkpoint {path} not found")
    if os.path.isdir(path):
        raise UserError(f"checkpoint {path} is a directory, not a file")
    try:
        with safe_open(path, framework="numpy") as f:
            meta = f.metadata() or {}
            entries = {name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape()))
                       for name in f.keys()}
    except OSError as e:
        raise UserError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    except Exception as e:  # safetensors' SafetensorError: a damaged file
        raise UserError(_damage(path, e)) from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{path} is not a nanoeuler checkpoint (no format=nanoeuler in its metadata)")
    return meta, entries


def _damage(path, e):
    """The one-line error for a file that safetensors cannot open: its header's JSON, or lengths that do not
    fit the file."""
    size = os.path.getsize(path)
    if size < 8:  # not even the header's length
        return f"checkpoint {path} is truncated or not a checkpoint ({size} bytes)"
    detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    detail = detail.split("deserializing header: ", 1)[-1]
    # newer safetensors say "invalid JSON in header", older ones "InvalidHeaderDeserialization"
    if "json" in detail.lower() or "deserialization" in detail.lower():
        return f"checkpoint {path} is corrupt (unreadable header)"
    return f"checkpoint {path} is truncated or corrupt ({detail}; a {size}-byte file)"


def read_metadata(path):
    """The checkpoint's `__metadata__` (string values), validated as a nanoeuler checkpoint; reads only the
    header, so it is cheap even for a large model."""
    return _header(path)[0]


def read_config(path):
    """The checkpoint's Config, from its header alone (cheap even for a large model)."""
    path = os.fspath(path)
    return _config(path, read_metadata(path))[0]


def read_tokenizer(path):
    """The checkpoint's tokenizer, from its header alone (cheap even for a large model)."""
    path = os.fspath(path)
    meta = read_metadata(path)
    cfg, _ = _config(path, meta)
    return _tokenizer(meta["tokenizer"], cfg, path)


def _config(path, meta):
    for key in ("config", "tokenizer", "step"):
        if key not in meta:
            raise UserError(f"checkpoint {path} is corrupt (no {key!r} in its metadata)")
    try:
        cfg = Config.from_json(meta["config"])
        step = int(meta["step"])
    except (ValueError, TypeError) as e:
        raise UserError(f"checkpoint {path} is corrupt (bad config or step: {e})") from None
    return cfg, step


def _has_chat_template(tokenizer_json):
    """Whether the tokenizer brings its own chat template: a model that has one is a chat model, whatever
    trained it last (continued pretraining of an imported -Instruct model writes chat = 0)."""
    try:
        return json.loads(tokenizer_json).get("chat_template") is not None
    except (ValueError, AttributeError):
        return False  # a corrupt tokenizer is reported where it is read


def load(path, with_opt=False, stored_opt=False, stored_params=False):
    """Read and validate a checkpoint. with_opt also returns the optimizer state (an error if absent); with
    stored_opt as StoredFlat buffers, read from the file when asked (whole, or a rank's shard of them); with
    stored_params the weights too (a float model's: ZeRO-2/3's ranks read their shards alone), checked finite
    as they are read."""
    path = os.fspath(path)
    meta, header = _header(path)
    if is_adapter(meta):  # an adapter checkpoint is read as its base with the adapters merged
        if with_opt:
            raise UserError(f"{path} is an adapter checkpoint: resume it with --lora")
        return load_merged(path)
    cfg, step = _config(path, meta)
    quant = cfg.quant is not None
    if with_opt and quant:
        raise UserError(f"checkpoint {path} is quantized ({cfg.quant}): full training needs float weights")
    checked = [""] + (["opt.m.", "opt.v."] if with_opt else [])
    stored_params = stored_params and not quant
    prefixes = [prefix for prefix in checked if not (stored_params if prefix == "" else stored_opt)]
    expected = {prefix + name: ("F32", tuple(shape)) for prefix in checked
                for name, shape in param_shapes(cfg, floats_only=True)}
    layout = param_layout(cfg)[0]
    for name in quantized_names(cfg):
        for suffix, (dtype, shape) in stored_arrays(layout[name][1], *quant_format(cfg, name)).items():
            expected[f"{name}.{suffix}"] = (SAFETENSORS_DTYPES[dtype], tuple(shape))
    for name, (dtype, shape) in expected.items():
        if name not in header:
            if name.startswith("opt."):
                raise UserError(f"checkpoint {path} has no optimizer state to resume from")
            raise UserError(f"checkpoint {path} has no tensor {name}, which its config requires")
        if header[name][0] != dtype:
            raise UserError(f"checkpoint {path} is corrupt (tensor {name} is {header[name][0]}, not {DTYPE_NAMES[dtype]})")
        if header[name][1] != shape:
            raise UserError(f"checkpoint {path}: tensor {name} has shape {header[name][1]} "
                            f"but its config says {shape}")
    known = set(expected) | {prefix + name for prefix in ("opt.m.", "opt.v.") for name, _ in param_shapes(cfg)}
    for name, (dtype, _) in header.items():
        if name not in known and dtype != "F32":
            raise UserError(f"checkpoint {path} is corrupt (tensor {name} is {dtype}, not float32)")
    extra = sorted(set(header) - known)
    if extra:
        raise UserError(f"checkpoint {path}: tensor {extra[0]} does not belong to its config")

    total = param_layout(cfg, floats_only=True)[1]
    flats = {prefix: np.empty(total, dtype=np.float32) for prefix in prefixes}
    quantized = {} if quant else None
    try:
        with safe_open(path, framework="numpy") as f:
            for prefix, flat in flats.items():
                for name, view in views(flat, cfg, floats_only=True).items():
                    view[...] = f.get_tensor(prefix + name)
            for name in quantized_names(cfg):
                parts = {s: f.get_tensor(f"{name}.{s}") for s in ("q", "scales", "mins") if f"{name}.{s}" in header}
                kind, group = quant_format(cfg, name)
                quantized[name] = QuantizedTensor(kind, group or layout[name][1][1], parts["q"], parts["scales"],
                                                  parts.get("mins"))
    except Exception as e:  # the header was fine, so this is damage inside the file
        raise UserError(f"checkpoint {path} is corrupt ({type(e).__name__}: {e})") from None
    if (not stored_params and not np.isfinite(flats[""]).all()) or (quant and not all(
            np.isfinite(qt.scales).all() and (qt.mins is None or np.isfinite(qt.mins).all())
            for qt in quantized.values())):
        raise UserError(f"checkpoint {path} holds non-finite weights")
    try:
        train_state = json.loads(meta["train"]) if "train" in meta else None
    except ValueError:
        raise UserError(f"checkpoint {path} is corrupt (unreadable training state)") from None
    opt = None
    if with_opt:
        opt = tuple(StoredFlat(path, cfg, prefix) if stored_opt else flats[prefix] for prefix in ("opt.m.", "opt.v."))
    params = StoredFlat(path, cfg, "", finite=True) if stored_params else flats[""]
    return Checkpoint(cfg=cfg, params=params, tokenizer_json=meta["tokenizer"], step=step,
                      chat=meta.get("chat") == "1" or _has_chat_template(meta["tokenizer"]),
                      opt=opt,
                      train_state=train_state, quantized=quantized)


class StoredFlat:
    """A flat float32 buffer of a checkpoint's tensors under `prefix` ("": the weights; "opt.m.": a moment),
    read from the file when asked: whole (np.asarray) or elements [start, end) (read), so that a ZeRO-2/3
    rank reads its shard alone (the tensors' names and shapes were checked by load), a tensor's rows at a
    time. finite: a non-finite value read is a one-line error (the weights'). bytes_read counts the bytes
    read from the file so far."""
    dtype = np.dtype(np.float32)

    def __init__(self, path, cfg, prefix, finite=False):
        self.path, self.prefix, self.finite = path, prefix, finite
        self.layout, self.size = param_layout(cfg)
        self.bytes_read = 0

    def read(self, start, end):
        out = np.empty(end - start, dtype=np.float32)
        try:
            with safe_open(self.path, framework="numpy") as f:
                for name, (off, shape) in self.layout.items():
                    lo, hi = max(start, off), min(end, off + int(np.prod(shape)))
                    if lo >= hi:
                        continue
                    row = int(np.prod(shape[1:]))  # elements a row: the rows holding [lo, hi) are read
                    first, last = (lo - off) // row, -(-(hi - off) // row)
                    rows = np.asarray(f.get_slice(self.prefix + name)[first:last], dtype=np.float32).reshape(-1)
                    self.bytes_read += rows.nbytes
                    out[lo - start:hi - start] = rows[lo - off - first * row:hi - off - first * row]
        except Exception as e:
            raise UserError(f"checkpoint {self.path} is corrupt or gone ({type(e).__name__}: {e})") from None
        if self.finite and not np.isfinite(out).all():
            raise UserError(f"checkpoint {self.path} holds non-finite weights")
        return out

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.read(0, self.size), dtype=dtype or np.float32)


def load_model(ckpt, device, batch_invariant=True, adapter=None):
    """Checkpoint path -> (engine, tokenizer, checkpoint), on the resolved device (make_engine says what
    batch_invariant False trades); adapter: a PEFT LoRA folder merged into the weights (--adapter DIR)."""
    from nanoeuler.model.device import resolve
    from nanoeuler.model.engine import make_engine
    ck = load_with_adapter(ckpt, adapter)
    tok = ck.tokenizer()
    eng = make_engine(ck.cfg, device=resolve(device), batch_invariant=batch_invariant, training=False)
    eng.load_params(ck.params, ck.quantized)
    return eng, tok, ck


def load_with_adapter(ckpt, adapter=None):
    """load(ckpt), with the PEFT LoRA adapter of folder `adapter` (where given) merged into its weights."""
    ck = load(ckpt)
    if adapter:
        from nanoeuler.io import peft
        ck = peft.apply(ck, adapter)
    return ck


# ------------------------------------------------------------------------------------- adapter checkpoints
# What `sft|dpo --lora R --out F` writes: the adapters alone (megabytes, not the base's gigabytes) and the
# checkpoint of the base they belong to, by path. The file is a checkpoint as above (format "nanoeuler", the
# base's config and tokenizer, step, chat, train) whose tensors are the adapters (model/lora.py's names:
# `layers.0.q.lora_a`, ...; their AdamW moments under `opt.m.` / `opt.v.`), plus three metadata keys:
# `adapters` (the LoraSpec as JSON), `base` (the base checkpoint's absolute path) and `base_fingerprint` (its
# parameter count and a sum over a sample of its weights, so that adapters are not silently merged into another
# model of the same shape). load() reads one as its base with the adapters merged (infer, chat, serve, eval,
# export --hf / --gguf); training reads the adapters themselves (load_adapters) to resume.
@dataclasses.dataclass
class AdapterCheckpoint:
    cfg: Config           # the base's
    spec: lora.LoraSpec
    params: np.ndarray    # flat float32 adapters, model/lora.py's layout
    base: str             # the base checkpoint's path
    fingerprint: str
    tokenizer_json: str
    step: int
    chat: bool = False
    opt: tuple = None
    train_state: dict = None


FINGERPRINT_STRIDE = 1009  # every 1009th weight summed: cheap for a large model, changed by any retraining


def adapter_fingerprint(params, quantized=None):
    """A short string that tells a base's weights apart: their count and a float64 sum of a strided sample; a
    quantized base's (QLoRA) also sums a sample of its matrices' integers and scales, in name order."""
    params = np.asarray(params)
    text = f"{params.size}:{float(np.sum(params[::FINGERPRINT_STRIDE], dtype=np.float64)):.17g}"
    if quantized:
        total = sum(float(np.sum(a.reshape(-1)[::FINGERPRINT_STRIDE], dtype=np.float64))
                    for name in sorted(quantized) for a in quantized[name].arrays().values())
        text += f":q{total:.17g}"
    return text


def is_adapter(meta):
    """Whether a checkpoint's metadata is an adapter checkpoint's."""
    return "adapters" in meta


def save_adapters(path, cfg, spec, values, base, base_fingerprint, tokenizer_json, step, opt=None,
                  train_state=None, chat=False):
    """Atomically write an adapter checkpoint: values (and opt's m, v) flat float32 host arrays of spec's layout."""
    tensors = dict(lora.adapter_views(np.ascontiguousarray(values, dtype=np.float32), cfg, spec))
    if opt is not None:
        for prefix, flat in zip(("opt.m.", "opt.v."), opt):
            for name, view in lora.adapter_views(np.ascontiguousarray(flat, dtype=np.float32), cfg, spec).items():
                tensors[prefix + name] = view
    metadata = {"format": FORMAT, "config": cfg.to_json(), "tokenizer": tokenizer_json,
                "step": str(int(step)), "chat": "1" if chat else "0", "adapters": spec.to_json(),
                "base": os.path.abspath(base), "base_fingerprint": base_fingerprint}
    if train_state is not None:
        metadata["train"] = json.dumps(train_state, sort_keys=True)
    atomic_write(path, lambda f: write_safetensors(f, tensors, metadata))


def load_adapters(path, with_opt=False):
    """Read and validate an adapter checkpoint (one-line UserErrors as checkpoint.load's)."""
    path = os.fspath(path)
    meta = read_metadata(path)
    if not is_adapter(meta):
        raise UserError(f"{path} is a model checkpoint, not an adapter checkpoint (sft/dpo --lora writes those)")
    cfg = read_config(path)
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


def adapter_base_path(ack, path):
    """Where the adapter checkpoint's base is: its recorded path, else a file of that name beside the adapter
    checkpoint (the two moved together); a one-line UserError if neither exists."""
    beside = os.path.join(os.path.dirname(os.path.abspath(path)), os.path.basename(ack.base))
    for candidate in (ack.base, beside):
        if candidate and os.path.isfile(candidate):
            return candidate
    raise UserError(f"adapter checkpoint {path}: its base {ack.base} is not found (nor beside it)")


def load_adapter_base(ack, path):
    """The base checkpoint of the adapter checkpoint at path, checked to be the one the adapters were trained on."""
    where = adapter_base_path(ack, path)
    if os.path.abspath(where) == os.path.abspath(path):
        raise UserError(f"adapter checkpoint {path} names itself as its base")
    base = load(where)  # an adapter checkpoint too (DPO's adapters over SFT's): merged, as trained on
    if base.cfg != ack.cfg or (ack.fingerprint
                               and adapter_fingerprint(base.params, base.quantized) != ack.fingerprint):
        raise UserError(f"adapter checkpoint {path}: {where} is not the base it was trained on (its weights differ)")
    return base


def load_float_merged(path):
    """checkpoint.load for export --hf: an adapter checkpoint over a quantized base (QLoRA) as the base's exact
    dequantized floats with the adapters merged in float (the model it trained as; no second quantization);
    any other checkpoint as load reads it."""
    if not is_adapter(read_metadata(path)):
        return load(path)
    ack = load_adapters(path)
    base = load_adapter_base(ack, path)
    if base.cfg.quant is None:
        return load_merged(path)
    cfg, params = float_params(base.cfg, base.params, base.quantized)
    base.cfg, base.params, base.quantized = cfg, lora.merge(cfg, params, ack.spec, ack.params), None
    base.step, base.chat = ack.step, ack.chat or base.chat
    base.train_state = ack.train_state
    return base


def load_merged(path):
    """checkpoint.load of an adapter checkpoint: its base with the adapters merged in, at the adapters' step (a
    quantized base's targets merged and quantized again: lora.merge_quantized)."""
    ack = load_adapters(path)
    base = load_adapter_base(ack, path)
    if base.cfg.quant is not None:  # QLoRA: merged, then quantized again in the base's format
        base.quantized = lora.merge_quantized(base.cfg, base.quantized, ack.spec, ack.params)
    else:
        base.params = lora.merge(base.cfg, base.params, ack.spec, ack.params)
    base.step, base.chat = ack.step, ack.chat or base.chat
    base.train_state = ack.train_state
    return base
