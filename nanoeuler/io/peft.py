"""PEFT's LoRA files, out and in: `nanoeuler export --peft DIR --ckpt F` and `--adapter DIR`.

A PEFT adapter folder holds `adapter_config.json` (peft_type LORA, r, lora_alpha, lora_dropout, target_modules,
...) and `adapter_model.safetensors`, whose tensors are named after the module they adapt in the Hugging Face
model, without PEFT's adapter name:

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight    (r, in)     our layers.0.q.lora_a
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight    (out, r)    our layers.0.q.lora_b

for the base that `export --hf` writes (model/lora.py's A and B are PEFT's, the same scaling alpha / r), so
`PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(hf_dir), peft_dir)` runs the model this adapter
made. Reading takes what PEFT writes for the Llama-class architectures nanoeuler imports: any subset of the
seven projections (the targets found in the file; a layer without a target's tensors gets a zero update there,
as `layers_to_transform` leaves it), float32, float16 or bfloat16 tensors, rsLoRA's scaling alpha / sqrt(r)
(read as the equivalent alpha). What nanoeuler's adapters cannot express (DoRA, per-module ranks or alphas,
biases, modules_to_save, other modules than the seven) is a one-line error, as is an adapter whose shapes or
layer count are not the base's.
"""
import json
import math
import os
import re

import numpy as np

from nanoeuler.errors import UserError
from nanoeuler.files import atomic_write, output_folder
from nanoeuler.io.safetensors_header import safetensors_header
from nanoeuler.model import lora

MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
TARGET_OF = {module.split(".")[1]: t for t, module in MODULES.items()}  # q_proj -> q
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_NAME = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight")


def peft_name(i, t, matrix):
    """PEFT's tensor name of our layers.{i}.{t}.lora_a / lora_b."""
    return f"base_model.model.model.layers.{i}.{MODULES[t]}.lora_{'A' if matrix == 'lora_a' else 'B'}.weight"


def adapter_config(spec, base=None):
    """adapter_config.json of spec, as PEFT's LoraConfig writes it."""
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": spec.rank,
            "lora_alpha": alpha, "lora_dropout": spec.dropout,
            "target_modules": [MODULES[t].split(".")[1] for t in spec.targets], "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
            "use_rslora": False, "use_dora": False, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {}, "alpha_pattern": {}, "revision": None}


def write(folder, cfg, spec, values, base=None):
    """Write PEFT's two files for the adapters `values` (flat, model/lora.py's layout) of spec into folder."""
    output_folder(folder, "--peft", CONFIG)
    from safetensors.numpy import save as serialize
    views = lora.adapter_views(np.asarray(values, dtype=np.float32), cfg, spec)
    tensors = {}
    for name, view in views.items():
        _, i, t, matrix = name.split(".")
        tensors[peft_name(int(i), t, matrix)] = np.ascontiguousarray(view)
    data = serialize(tensors, metadata={"format": "pt"})
    atomic_write(os.path.join(folder, WEIGHTS), lambda f: f.write(data))
    atomic_write(os.path.join(folder, CONFIG), lambda f: json.dump(adapter_config(spec, base), f, indent=2), mode="w")
    return tensors


def read(folder, cfg):
    """(LoraSpec, flat float32 adapter values) of a PEFT LoRA folder for the base of config cfg; one-line
    UserErrors for what does not fit (module docstring)."""
    where = f"--adapter {folder}"
    config_path, weights_path = os.path.join(folder, CONFIG), os.path.join(folder, WEIGHTS)
    if not os.path.isdir(folder):
        raise UserError(f"{where}: no such folder")
    for path in (config_path, weights_path):
        if not os.path.exists(path):
            raise UserError(f"{where}: no {os.path.basename(path)} (a PEFT LoRA adapter saved with "
                            "safe_serialization is that file and adapter_config.json)")
    try:
        with open(config_path) as f:
            conf = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{where}: cannot read {CONFIG}: {e}") from None
    if conf.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{where}: a {conf.get('peft_type')} adapter; nanoeuler reads LoRA adapters only")
    for key, what in (("use_dora", "DoRA"), ("rank_pattern", "per-module ranks"),
                      ("alpha_pattern", "per-module alphas"), ("modules_to_save", "modules_to_save"),
                      ("fan_in_fan_out", "fan_in_fan_out (GPT-2's Conv1D)")):
        if conf.get(key):
            raise UserError(f"{where}: uses {what}, which nanoeuler's adapters do not express")
    if conf.get("bias", "none") != "none":
        raise UserError(f"{where}: trains biases (bias {conf['bias']!r}); nanoeuler's adapters have none")
    try:
        rank, alpha = int(conf["r"]), float(conf["lora_alpha"])
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{where}: {CONFIG} has no valid r and lora_alpha") from None
    if conf.get("use_rslora"):  # rsLoRA scales by alpha / sqrt(r): the same as our alpha / r with alpha * sqrt(r)
        alpha *= math.sqrt(rank)
    tensors = _Tensors(weights_path)
    found = {}
    for name in tensors:
        m = _NAME.fullmatch(name)
        if not m or m.group(2) not in TARGET_OF:
            raise UserError(f"{where}: tensor {name} adapts a module nanoeuler's adapters do not cover "
                            f"(only {', '.join(sorted(TARGET_OF))} of each layer)")
        i, t = int(m.group(1)), TARGET_OF[m.group(2)]
        if i >= cfg.n_layers:
            raise UserError(f"{where}: an adapter for layer {i}, but the base has {cfg.n_layers} layers: an adapter "
                            "for another base")
        found[(i, t, "lora_" + m.group(3).lower())] = name
    if not found:
        raise UserError(f"{where}: {WEIGHTS} holds no LoRA tensors")
    targets = tuple(t for t in lora.TARGETS if any(key[1] == t for key in found))
    if rank < 1 or rank > min(min(lora.target_shape(cfg, t)) for t in targets):
        raise UserError(f"{where}: rank {rank} does not fit the base's products: an adapter for another base")
    spec = lora.LoraSpec(rank, alpha, float(conf.get("lora_dropout", 0.0) or 0.0), targets)
    layout, total = lora.adapter_layout(cfg, spec)
    flat = np.zeros(total, dtype=np.float32)
    for (i, t, matrix), name in found.items():
        off, shape = layout[f"layers.{i}.{t}.{matrix}"]
        if tensors.shape(name) != shape:
            raise UserError(f"{where}: {name} has shape {list(tensors.shape(name))} but the base needs "
                            f"{list(shape)}: an adapter for another base")
        tensors.read_into(name, flat[off:off + math.prod(shape)].reshape(shape))
        if (i, t, "lora_b" if matrix == "lora_a" else "lora_a") not in found:
            raise UserError(f"{where}: {name} has no {'lora_B' if matrix == 'lora_a' else 'lora_A'} beside it")
    if not np.isfinite(flat).all():
        raise UserError(f"{where}: non-finite adapter weights")
    return spec, flat


_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BF16": "<u2"}


class _Tensors:
    """A safetensors file's tensors by name, read by hand as float32 (NumPy has no bfloat16: a bf16 is the top
    half of a float32, exact)."""

    def __init__(self, path):
        self.path, self.entries = path, {}
        header, start = safetensors_header(path)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if entry.get("dtype") not in _DTYPES:
                raise UserError(f"{path}: tensor {name} is {entry.get('dtype')}; adapters are float tensors")
            lo, hi = entry["data_offsets"]
            self.entries[name] = (entry["dtype"], tuple(entry["shape"]), start + lo, hi - lo)

    def __iter__(self):
        return iter(self.entries)

    def shape(self, name):
        return self.entries[name][1]

    def read_into(self, name, out):
        dtype, shape, start, size = self.entries[name]
        source = np.dtype(_DTYPES[dtype])
        if size != math.prod(shape) * source.itemsize:
            raise UserError(f"{self.path}: tensor {name} has {size} bytes, its shape {list(shape)} needs "
                            f"{math.prod(shape) * source.itemsize}")
        try:
            with open(self.path, "rb") as f:
                f.seek(start)
                raw = np.frombuffer(f.read(size), dtype=source)
        except OSError as e:
            raise UserError(f"cannot read {self.path}: {e}") from None
        if raw.size != math.prod(shape):
            raise UserError(f"{self.path} ends inside tensor {name}")
        values = (raw.astype(np.uint32) << 16).view(np.float32) if dtype == "BF16" else raw.astype(np.float32)
        out[...] = values.reshape(shape)


def apply(ck, folder):
    """The checkpoint ck with the PEFT adapter of folder merged into its weights (what inference with
    `--adapter DIR` runs): W + (alpha / r) B A for each adapted product."""
    spec, values = read(folder, ck.cfg)
    if ck.cfg.quant is not None:  # a quantized checkpoint: merged, then quantized again in its format
        ck.quantized = lora.merge_quantized(ck.cfg, ck.quantized, spec, values)
    else:
        ck.params = lora.merge(ck.cfg, ck.params, spec, values)
    return ck
