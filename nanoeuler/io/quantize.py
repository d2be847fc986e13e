"""`nanoeuler quantize --ckpt IN --out OUT --type int8|int4 [--group N] [--head-type int8|int4]`: a checkpoint's
matrices quantized (model/quantize.py, docs/quantization.md), written as a quantized checkpoint that infer, chat,
serve, eval and export take.

The untied prediction heads take --head-type (default: int8 for both types; model/quantize.py's DEFAULT_HEAD):
an int4 model keeps its heads int8 in groups of 32 (GGUF's Q8_0), as llama.cpp's Q4_K_M keeps its output in Q6_K,
since the head carries most of int4's loss; a head of the layers' type takes --group as they do, one of another
type groups of 32. A tied head is the embedding and stays float.

Tensor by tensor: each matrix is read from the input in float32, quantized and dropped, so the peak memory is
the quantized model plus its float tensors (embedding, norms) plus one matrix in float32, never the whole
float32 model; `import --hf DIR --quantize int8|int4` goes the same way from a Hugging Face folder
(io/hf_import.py). The optimizer state and the training state stay behind: a quantized model decodes and scores,
it does not train.
"""
import dataclasses
import os
import sys

import numpy as np
from safetensors import safe_open

from nanoeuler.errors import UserError
from nanoeuler.files import check_writable
from nanoeuler.io import checkpoint
from nanoeuler.model.config import param_layout, param_shapes, quant_format, quantized_names, views
from nanoeuler.model.quantize import DEFAULT_GROUP, DEFAULT_HEAD, group_of, quantize


def quantized_config(cfg, kind, group=None, head=None):
    """cfg with quant = kind, quant_group = group (default 32) and the heads' type `head` (default DEFAULT_HEAD's:
    int8 in groups of 32 for an int4 model; the layers' group where it is their type), recorded as quant_head and
    quant_head_group only where it differs from the layers' (and the model has untied heads); a one-line UserError
    for an unknown type, a group that is no format of ours, one that does not divide a matrix's rows, or a model
    quantized already."""
    if cfg.quant is not None:
        raise UserError(f"the model is quantized already ({cfg.quant}); quantize its float checkpoint")
    group = DEFAULT_GROUP if group is None else group
    head = DEFAULT_HEAD.get(kind, kind) if head is None else head
    head_group = group if head == kind else DEFAULT_GROUP
    own = not cfg.tied and (head, head_group) != (kind, group)
    try:
        qcfg = dataclasses.replace(cfg, quant=kind, quant_group=group, quant_head=head if own else None,
                                   quant_head_group=head_group if own else None)
        layout = param_layout(qcfg)[0]
        for name in quantized_names(qcfg):
            group_of(*quant_format(qcfg, name), layout[name][1][1])
    except ValueError as e:
        raise UserError(f"{kind} in groups of {group}{f', heads {head}' if own else ''}: {e}") from None
    return qcfg


def describe(qcfg):
    """What a quantized config holds, for the commands' last line: "int4 in groups of 32, the heads int8 in
    groups of 32"."""
    text = f"{qcfg.quant} in groups of {qcfg.quant_group or 'a row'}"
    if qcfg.quant_head is not None:
        text += f", the heads {qcfg.quant_head} in groups of {qcfg.quant_head_group or 'a row'}"
    return text


def quantize_model(qcfg, read, progress=True):
    """(flat float32 of the float tensors, {name: QuantizedTensor}) of a model whose tensors read(name, out)
    writes into the float32 array out (of the tensor's shape): the float tensors straight into their views, each
    quantized one through a scratch matrix, quantized and dropped."""
    from nanoeuler.tokenizer.base import progress_bar
    flat = np.empty(param_layout(qcfg, floats_only=True)[1], np.float32)
    for name, view in views(flat, qcfg, floats_only=True).items():
        read(name, view)
    quantized, shapes = {}, dict(param_shapes(qcfg))
    with progress_bar(progress and sys.stderr.isatty(), total=len(quantized_names(qcfg)), unit="matrix",
                      desc=f"quantizing ({qcfg.quant})") as bar:
        for name in quantized_names(qcfg):
            scratch = np.empty(shapes[name], np.float32)
            read(name, scratch)
            if not np.isfinite(scratch).all():
                raise UserError(f"tensor {name} holds non-finite values")
            quantized[name] = quantize(scratch, *quant_format(qcfg, name))
            bar.update(1)
    return flat, quantized


def main(args):
    if os.path.abspath(args.out) == os.path.abspath(args.ckpt):
        raise UserError("--out is --ckpt: write the quantized checkpoint beside the float one")
    if os.path.isfile(args.out) and not args.overwrite:
        raise UserError(f"{args.out} exists: --overwrite replaces it, --out FILE writes elsewhere")
    meta = checkpoint.read_metadata(args.ckpt)
    cfg = checkpoint.read_config(args.ckpt)
    qcfg = quantized_config(cfg, args.type, args.group, args.head_type)
    check_writable(args.out)

    def read(name, out):
        value = f.get_tensor(name)
        if value.shape != out.shape:
            raise UserError(f"checkpoint {args.ckpt}: tensor {name} has shape {value.shape}, its config says "
                            f"{out.shape}")
        out[...] = value

    try:
        with safe_open(args.ckpt, framework="numpy") as f:
            flat, quantized = quantize_model(qcfg, read)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"checkpoint {args.ckpt} is corrupt ({type(e).__name__}: {e})") from None
    if not np.isfinite(flat).all():
        raise UserError(f"checkpoint {args.ckpt} holds non-finite weights")
    checkpoint.save(args.out, qcfg, flat, meta["tokenizer"], int(meta["step"]), chat=meta.get("chat") == "1",
                    quantized=quantized)
    before, after = os.path.getsize(args.ckpt), os.path.getsize(args.out)
    print(f"quantized {args.ckpt} to {args.out}: {describe(qcfg)}, "
          f"{len(quantized)} matrices ({before / 1e6:.1f} MB -> {after / 1e6:.1f} MB; the embedding, norms"
          f"{', biases' if cfg.qkv_bias else ''}{' and the tied head' if cfg.tied else ''} stay float)")
    return 0
