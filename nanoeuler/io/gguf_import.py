"""Import a GGUF file (llama.cpp's format): `nanoeuler import --gguf FILE --out F [--context N] [--quantize
int8|int4 [--group N] [--head-type int8|int4]] [--overwrite]`.

    nanoeuler import --gguf SmolLM2-135M-Instruct-Q8_0.gguf --out smol_q8.bin      # int8 blocks, copied
    nanoeuler import --gguf Llama-3.2-1B-Instruct-Q4_K_M.gguf --out llama_int4.bin --quantize int4
    nanoeuler chat --ckpt smol_q8.bin

The file is read through the `gguf` package (the llama.cpp project's reader, the `gguf` extra), which maps it
into memory: each tensor is converted on its own (a quantized one a block of rows at a time), so the import
never holds the model in float32 whole. The architectures are llama.cpp's `llama` (Llama 2 and 3, Mistral,
TinyLlama, SmolLM2) and `qwen2` (q/k/v biases); the inverse of `export --gguf` (nanoeuler/io/gguf.py), whose
names, keys and Q/K row order it reads back: the `llama` architecture's Q and K rows are put back from
llama.cpp's adjacent RoPE pairs into our rotate-half order (rope_pairs_split), qwen2's are as they are. A file
without `output.weight` is tied (head 0 is the embedding); a `rope_freqs.weight` (Llama 3.1+) is read back
as the llama3 RoPE scaling whose factors it holds, found among the published settings, else refused.

Tensor types (docs/import.md has the table with the errors measured). The embedding and norms become float32
(the embedding dequantized exactly, whatever its type). The matrices:
- F32, F16, BF16: float32, exact; with --quantize, quantized as `import --hf --quantize` does.
- Q8_0: our int8 in groups of 32, the same bits (d, then the 32 q), nothing dequantized.
- Q4_0: int4 in groups of 32, exact: d * (q - 8) is d * q + m with m = -8 d (exact in float16).
- Q4_1: int4 in groups of 32, the same bits (export --gguf writes int4 so).
- Q4_K: int4 in groups of 32: a sub-block of 32 is d * sc * q - dmin * m with 6-bit sc and m; its scale
  d * sc and minimum -dmin * m are float32 numbers of up to 17 significant bits, which our float16 scale and
  minimum round (11 bits): the q are kept, each scale and minimum moves by at most half a float16 step (a
  relative 2^-11, or the float16 subnormal step below 6.1e-5).
- Q5_0, Q5_1, Q5_K, Q6_K: dequantized exactly (llama.cpp's float32 values) and quantized again to int8 in
  groups of 32, as `quantize --type int8` would: no format of ours holds their 5- and 6-bit q and 16-element
  (Q6_K) or minimum-carrying scales.
A checkpoint has one quantized type for the layers and one for the output head (config.quant_format): a file
whose layer matrices all map to int8 (int4) becomes an int8 (int4) checkpoint, its head of the type the output's
maps to (a Q4_1 file with a Q8_0 output, as `export --gguf` writes an int4 checkpoint, comes back int4 with an
int8 head, every block copied); a mixed file (Q4_K_M: Q4_K with Q6_K for the output and some attn_v and
ffn_down) becomes int8 in groups of 32 (each type within a small fraction of its own quantization step;
`--quantize int4` keeps Q4_K's q and takes the Q6_K layer tensors down to int4 and the head to int8 instead);
float matrices in a quantized file are quantized to its type (a float output as `quantize` would: int8). Any
other type (Q2_K, Q3_K, the IQ types, ...) is refused in one line.

Tokenizer from the metadata: tokenizer.ggml.model `gpt2` (the byte-level tokens, merges and token types; the
pre-tokenizer by tokenizer.ggml.pre: gpt-2 (or none), smollm, llama-bpe, qwen2) or `llama` (SentencePiece's
pieces, scores and byte tokens <0xNN>; the merges every split of each token in order of its score, as
transformers' converter derives a tokenizer.json from a SentencePiece model), control tokens special and
user-defined ones not, the BOS when add_bos_token says so, the end of text, the unknown token; all of it goes
through the reader of tokenizer.json (nanoeuler/tokenizer/hf.py), which picks our class, so the ids are the
tokenizer.json's of the same model. tokenizer.chat_template is the chat template; the end ids the eos and eot
ids. Trailing tokens of type `unused` ([PAD{i}], Qwen2's padding rows) are the rows past the tokenizer.
"""
import dataclasses
import sys

import numpy as np

from nanoeuler.errors import UserError, require
from nanoeuler.io.gguf import ROPE_FREQS, gguf_names, rope_freq_factors, rope_heads, rope_pairs_split
from nanoeuler.model.config import Config, param_layout, param_shapes, quant_format, quantized_names, views
from nanoeuler.model.quantize import DEFAULT_GROUP, QuantizedTensor, concat_rows, pack_int4, quantize

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}  # llama.cpp's -> transformers'
FLOAT_TYPES = ("F32", "F16", "BF16")
# GGUF type -> (our quantized type, whether the blocks map onto it exactly)
QUANT_TYPES = {"Q8_0": ("int8", True), "Q4_0": ("int4", True), "Q4_1": ("int4", True), "Q4_K": ("int4", False),
               "Q5_0": ("int8", False), "Q5_1": ("int8", False), "Q5_K": ("int8", False), "Q6_K": ("int8", False)}
# tokenizer.ggml.pre -> our pretokenization rule (nanoeuler/io/gguf.py's GGUF_PRE, read back)
PRE_RULES = {None: "gpt2", "gpt-2": "gpt2", "gpt2": "gpt2", "default": "gpt2", "smollm": "gpt2_digits",
             "llama-bpe": "llama3", "llama3": "llama3", "qwen2": "qwen2"}
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"
ROWS = 4096  # rows of a quantized tensor dequantized at a time
# llama3 RoPE scalings published (Llama 3.1, 3.2, 3.3): tried against a file's rope_freqs
LLAMA3_SCALINGS = [dict(factor=f, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
                   for f in (8.0, 32.0, 16.0, 4.0, 2.0)]


class GGUFFile:
    """A GGUF file's metadata fields and tensor entries (name, type, shape, place), parsed by gguf.GGUFReader;
    the tensors' bytes are read when asked for (rows). Every way the file can be unreadable is a one-line
    UserError."""

    def __init__(self, path):
        self.path = str(path)
        self.gguf, = require("gguf", what="import --gguf")
        try:
            reader = self.gguf.GGUFReader(self.path)
        except FileNotFoundError:
            raise UserError(f"{self.path} not found") from None
        except OSError as e:
            raise UserError(f"cannot read {self.path}: {e.strerror or e}") from None
        except Exception as e:  # the reader's own checks, or a reshape of data past the end of the file
            raise UserError(f"{self.path} is not a readable GGUF file (truncated or corrupt: {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None
        self.fields = reader.fields
        self.tensors = {t.name: t for t in reader.tensors}

    def get(self, key, default=None):
        field = self.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception:
            raise UserError(f"{self.path}: metadata {key} is unreadable") from None

    def rows(self, name, lo=0, hi=None):
        """Rows lo..hi-1 of a tensor as the file stores them ((rows, values) float32 / float16 for F32 / F16, else
        (rows, bytes) uint8), read from the file rather than through the reader's map, so that the pages of
        tensors already converted do not stay in this process's memory."""
        t = self.tensors[name]
        O = self.shape(name)[0] if len(t.shape) > 1 else 1
        hi = O if hi is None else min(hi, O)
        row_bytes = int(t.n_bytes) // O
        buffer = np.empty((hi - lo) * row_bytes, np.uint8)
        try:
            with open(self.path, "rb") as fh:
                fh.seek(int(t.data_offset) + lo * row_bytes)
                if fh.readinto(memoryview(buffer)) != buffer.size:
                    raise UserError(f"{self.path} ends inside tensor {name} (a truncated download?)")
        except OSError as e:
            raise UserError(f"cannot read {self.path}: {e.strerror or e}") from None
        dtype = {"F32": np.float32, "F16": np.float16}.get(t.tensor_type.name, np.uint8)
        return buffer.view(dtype).reshape(hi - lo, -1)

    def type_name(self, name):
        return self.tensors[name].tensor_type.name

    def shape(self, name):
        """Our shape of a tensor: (rows, columns), GGUF's ne reversed."""
        return tuple(int(n) for n in reversed(self.tensors[name].shape))


def config_of(f, context=None):
    """Our Config of a GGUF file's metadata (architecture llama or qwen2), or a one-line UserError."""
    arch = f.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(f"{f.path}: architecture {arch!r}; nanoeuler imports llama.cpp's llama (Llama 2 and 3, "
                        "Mistral, TinyLlama, SmolLM2) and qwen2")

    def key(name, default=KeyError):
        value = f.get(f"{arch}.{name}", None)
        if value is None:
            if default is KeyError:
                raise UserError(f"{f.path} has no {arch}.{name}")
            return default
        return value

    if key("expert_count", 0):
        raise UserError(f"{f.path}: a mixture of experts ({key('expert_count')} experts); nanoeuler's model has one "
                        "feed-forward a layer")
    dim, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    if dim % n_heads:
        raise UserError(f"{f.path}: embedding length {dim} is not a whole number of {n_heads} heads")
    head_dim = dim // n_heads
    for name in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        if int(key(name, head_dim)) != head_dim:
            raise UserError(f"{f.path}: {arch}.{name} is {key(name)}, not the head size {head_dim} (embedding / "
                            "heads), the only one nanoeuler's model has")
    scaling = key("rope.scaling.type", "none")
    if scaling not in ("none", "linear") or (scaling == "linear" and float(key("rope.scaling.factor", 1.0)) != 1.0):
        raise UserError(f"{f.path}: rope scaling {scaling!r} (nanoeuler computes llama3 scaling, which llama.cpp "
                        "writes as rope_freqs.weight)")
    n_kv = key("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        raise UserError(f"{f.path}: a kv head count per layer; nanoeuler's layers all have the same")
    vocab = key("vocab_size", None)
    if vocab is None:
        vocab = len(f.get("tokenizer.ggml.tokens") or [])
    positions = int(key("context_length"))
    try:
        return Config(dim=dim, n_layers=int(key("block_count")), n_heads=n_heads, n_kv_heads=int(n_kv),
                      hidden=int(key("feed_forward_length")), vocab_size=int(vocab), context=context or positions,
                      mtp_heads=1, rope_theta=float(key("rope.freq_base", 10000.0)),
                      norm_eps=_decimal(key("attention.layer_norm_rms_epsilon", 1e-5)), qkv_bias=arch == "qwen2",
                      tied="output.weight" not in f.tensors, architecture=ARCHITECTURES[arch])
    except (ValueError, TypeError) as e:
        raise UserError(f"{f.path}: {e}") from None


def _decimal(x):
    """A float32 metadata value as the shortest decimal that reads back as it (1e-05, not 9.9999997e-06)."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-")) if isinstance(x, float) else float(x)


def rope_scaling_of(f, cfg):
    """cfg with the llama3 RoPE scaling whose factors the file's rope_freqs.weight holds (None: none)."""
    if ROPE_FREQS not in f.tensors:
        return cfg
    factors = np.empty(int(f.tensors[ROPE_FREQS].n_elements), np.float32)
    dequantized(f, ROPE_FREQS, factors)
    if factors.shape != (cfg.head_dim // 2,):
        raise UserError(f"{f.path}: {ROPE_FREQS} has {factors.size} values, not {cfg.head_dim // 2}")
    if np.all(factors == 1):
        return cfg
    arch = "qwen2" if cfg.qkv_bias else "llama"
    old = f.get(f"{arch}.rope.scaling.original_context_length")
    for scaling in LLAMA3_SCALINGS:
        if old is not None:
            scaling = dict(scaling, original_max_position_embeddings=old)
        scaling = dict(scaling, rope_type="llama3")
        candidate = dataclasses.replace(cfg, rope_scaling=scaling)
        if np.allclose(rope_freq_factors(candidate), factors, rtol=1e-6, atol=0):
            return candidate
    raise UserError(f"{f.path}: {ROPE_FREQS} holds RoPE factors (max {factors.max():g}) that are no llama3 scaling "
                    "nanoeuler knows")


def target_type(f, cfg, quant=None, group=None, head=None):
    """(quant, group, the heads' type or None for quantized_config's default) of the checkpoint: --quantize's
    (and --head-type's), else the one type the file's layer matrices map to (int8 for a mixed file) with the
    output's own (Q8_0's and Q6_K's int8, Q4_*'s int4), None (float) for a file of float matrices; and what the
    import says about it or None."""
    matrices = set(quantized_names(dataclasses.replace(cfg, quant="int8", quant_group=0)))  # the ones we quantize
    ours_of = {n: ours for n, ours in gguf_names(cfg).items() if ours in matrices and n in f.tensors}
    types = {f.type_name(n) for n in ours_of}
    refused = sorted(t for t in {f.type_name(n) for n in f.tensors} if t not in FLOAT_TYPES and t not in QUANT_TYPES)
    if refused:
        raise UserError(f"{f.path}: tensor type {refused[0]}; nanoeuler imports F32, F16, BF16, "
                        f"{', '.join(QUANT_TYPES)}")
    for flag, value in (("--group", group), ("--head-type", head)):
        if value is not None and quant is None:
            raise UserError(f"{flag} goes with --quantize int8|int4")
    if quant is not None:
        return quant, DEFAULT_GROUP if group is None else group, head, None
    kinds, head_kinds = set(), set()  # the layers' and the output's
    for n, ours in ours_of.items():
        if f.type_name(n) in QUANT_TYPES:
            (head_kinds if ours.startswith("heads.") else kinds).add(QUANT_TYPES[f.type_name(n)][0])
    head = head_kinds.pop() if head_kinds else None  # a float output in a quantized file: quantize's default
    if not kinds:
        return (None, None, None, None) if head is None else (head, DEFAULT_GROUP, head, None)
    if len(kinds) == 1:
        return kinds.pop(), DEFAULT_GROUP, head, None
    return "int8", DEFAULT_GROUP, head, (f"the matrices mix {', '.join(sorted(types))}: imported as int8 in groups "
                                         "of 32 (--quantize int4 keeps Q4_K's q and quantizes the others to int4, "
                                         "the head to int8)")


def dequantized(f, name, out, lo=0, hi=None):
    """Fill the float32 array out with rows lo..hi-1 of the tensor (all of it by default; out of their shape),
    ROWS rows at a time: llama.cpp's float32 values of a quantized type (gguf.quants.dequantize, numpy)."""
    t = f.tensors[name]
    rows = out.reshape(-1, out.shape[-1]) if out.ndim > 1 else out.reshape(1, -1)
    for start in range(0, rows.shape[0], ROWS):
        part = rows[start:start + ROWS]
        raw = f.rows(name, lo + start, lo + start + part.shape[0])
        part[...] = f.gguf.quants.dequantize(raw, t.tensor_type).reshape(part.shape)


def _blocks(raw, size):
    """Raw rows (rows, bytes) as (rows, blocks a row, block size) uint8."""
    return raw.view(np.uint8).reshape(raw.shape[0], -1, size)


def _f16(a):
    return np.ascontiguousarray(a).view(np.float16)[..., 0]


def q8_0(raw, stats):
    """Q8_0 blocks (d, 32 int8 q) as our int8 in groups of 32: the same bits."""
    b = _blocks(raw, 34)
    O = b.shape[0]
    return QuantizedTensor("int8", 32, np.ascontiguousarray(b[:, :, 2:]).view(np.int8).reshape(O, -1),
                           _f16(b[:, :, :2]))


def q4_0(raw, stats):
    """Q4_0 blocks (d, 16 bytes of q: byte j = element j | element j + 16 << 4, our order) as int4: m = -8 d."""
    b = _blocks(raw, 18)
    d = _f16(b[:, :, :2])
    return QuantizedTensor("int4", 32, np.ascontiguousarray(b[:, :, 2:]).reshape(b.shape[0], -1), d,
                           (d * np.float16(-8)).astype(np.float16))


def q4_1(raw, stats):
    """Q4_1 blocks (d, m, 16 bytes of q) as int4: the same bits."""
    b = _blocks(raw, 20)
    return QuantizedTensor("int4", 32, np.ascontiguousarray(b[:, :, 4:]).reshape(b.shape[0], -1),
                           _f16(b[:, :, :2]), _f16(b[:, :, 2:4]))


def q4_k_parts(b):
    """(q (O, n * 256) uint8 0..15, scales (O, n * 8) float32, minimums (O, n * 8) float32) of Q4_K blocks b
    (O, n, 144): each sub-block of 32 is scale * q + minimum, its scale d * sc and minimum -dmin * m exact in
    float32 (llama.cpp's values)."""
    import gguf
    O, n = b.shape[:2]
    d = _f16(b[:, :, 0:2]).astype(np.float32)
    dmin = _f16(b[:, :, 2:4]).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[:, :, 4:16]).reshape(O * n, 12))
    scales = (d[..., None] * sc.reshape(O, n, 8).astype(np.float32)).reshape(O, n * 8)
    mins = -(dmin[..., None] * m.reshape(O, n, 8).astype(np.float32)).reshape(O, n * 8)
    qs = b[:, :, 16:].reshape(O, n, 4, 1, 32)  # 4 chunks of 32 bytes: sub-block 2j low nibbles, 2j + 1 high
    q = (qs >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & np.uint8(15)
    return q.reshape(O, n * 256), scales, mins


def q4_k(raw, stats):
    """Q4_K blocks as int4 in groups of 32: the q kept, each sub-block's scale and minimum rounded to float16
    (stats counts those that were not exact and the largest change of a weight, in units of its scale)."""
    q, scales, mins = q4_k_parts(_blocks(raw, 144))
    s16, m16 = scales.astype(np.float16), mins.astype(np.float16)
    inexact = (s16.astype(np.float32) != scales) | (m16.astype(np.float32) != mins)
    stats["groups"] += scales.size
    stats["inexact"] += int(inexact.sum())
    with np.errstate(divide="ignore", invalid="ignore"):
        moved = (15 * np.abs(s16.astype(np.float32) - scales) + np.abs(m16.astype(np.float32) - mins)) / scales
    stats["worst"] = max(stats["worst"], float(np.nanmax(np.where(scales > 0, moved, 0), initial=0)))
    return QuantizedTensor("int4", 32, pack_int4(q, 32), s16, m16)


CONVERT = {"Q8_0": q8_0, "Q4_0": q4_0, "Q4_1": q4_1, "Q4_K": q4_k}  # blocks -> our blocks, without floats


def _rows_ours(cfg, ours, a):
    """A tensor's rows (array or QuantizedTensor) from llama.cpp's order into ours (Q/K of `llama`)."""
    heads = rope_heads(cfg, ours)
    if heads is None:
        return a
    order = lambda x: np.ascontiguousarray(rope_pairs_split(x, heads))
    if isinstance(a, QuantizedTensor):
        return QuantizedTensor(a.kind, a.group, order(a.q), order(a.scales), None if a.mins is None else order(a.mins))
    return order(a)


def read_params(f, cfg, progress=True):
    """Our parameters of the file's tensors: flat float32 (a float cfg), or (flat float32 of the float tensors,
    {name: QuantizedTensor}) for a quantized cfg (module docstring: which type becomes what). Returns them and
    the Q4_K statistics."""
    from nanoeuler.tokenizer.token_file import progress_bar

    names = gguf_names(cfg)  # theirs -> ours
    allowed = set(names) | {ROPE_FREQS}
    unknown = sorted(set(f.tensors) - allowed)
    if unknown:
        raise UserError(f"{f.path}: tensor {unknown[0]} has no place in nanoeuler's model")
    theirs_of = {ours: theirs for theirs, ours in names.items()}
    missing = [t for t in names if t not in f.tensors]
    if missing:
        raise UserError(f"{f.path} has no tensor {missing[0]}")
    shapes = dict(param_shapes(cfg))
    for theirs, ours in names.items():
        if f.shape(theirs) != tuple(shapes[ours]):
            raise UserError(f"{f.path}: tensor {theirs} has shape {list(f.shape(theirs))}, the metadata says "
                            f"{list(shapes[ours])}")

    def read_float(ours, out):
        theirs = theirs_of[ours]
        dequantized(f, theirs, out)
        heads = rope_heads(cfg, ours)
        if heads is not None:
            out[...] = rope_pairs_split(out.copy(), heads)
        for lo in range(0, out.size, 1 << 22):
            if not np.isfinite(out.reshape(-1)[lo:lo + (1 << 22)]).all():
                raise UserError(f"{f.path}: tensor {theirs} holds non-finite values")

    stats = {"groups": 0, "inexact": 0, "worst": 0.0}
    quantized = {}
    flat = np.empty(param_layout(cfg, floats_only=True)[1], np.float32)
    to_quantize = quantized_names(cfg)
    with progress_bar(progress and sys.stderr.isatty(), total=len(names), unit="tensor", desc="importing") as bar:
        for ours, view in views(flat, cfg, floats_only=True).items():
            read_float(ours, view)
            bar.update(1)
        for ours in to_quantize:
            theirs = theirs_of[ours]
            kind, (O, I) = f.type_name(theirs), shapes[ours]
            ours_kind, ours_group = quant_format(cfg, ours)
            direct = kind in CONVERT and QUANT_TYPES[kind][0] == ours_kind and ours_group == 32
            parts = []
            for lo in range(0, O, ROWS):  # a block of rows at a time: groups never cross rows
                if direct:
                    part = CONVERT[kind](f.rows(theirs, lo, lo + ROWS), stats)
                else:  # float or another type: its exact float32 values quantized to the checkpoint's type
                    values = np.empty((min(ROWS, O - lo), I), np.float32)
                    dequantized(f, theirs, values, lo, lo + ROWS)
                    if not np.isfinite(values).all():
                        raise UserError(f"{f.path}: tensor {theirs} holds non-finite values")
                    part = quantize(values, ours_kind, ours_group)
                if not (np.isfinite(part.scales).all() and (part.mins is None or np.isfinite(part.mins).all())):
                    raise UserError(f"{f.path}: tensor {theirs} holds non-finite scales")
                parts.append(part)
            quantized[ours] = _rows_ours(cfg, ours, concat_rows(parts))
            bar.update(1)
    return (flat if cfg.quant is None else (flat, quantized)), stats


# ------------------------------------------------------------------------------------------------ tokenizer
def _token_list(f):
    tokens = f.get("tokenizer.ggml.tokens")
    if not tokens:
        raise UserError(f"{f.path} has no tokenizer (tokenizer.ggml.tokens)")
    types = f.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise UserError(f"{f.path}: {len(types)} token types for {len(tokens)} tokens")
    n = len(tokens)  # trailing unused tokens ([PAD{i}]): rows past the tokenizer
    while n and types[n - 1] == TOKEN_UNUSED:
        n -= 1
    return list(tokens[:n]), list(types[:n])


def _token_id(f, key, n):
    i = f.get(f"tokenizer.ggml.{key}_token_id")
    return i if isinstance(i, int) and 0 <= i < n else None


def tokenizer_dict(f):
    """(tokenizer.json dict, eos content, bos content or None) of the file's tokenizer metadata."""
    model = f.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise UserError(f"{f.path}: tokenizer model {model!r}; nanoeuler reads gpt2 (byte-level BPE) and llama "
                        "(SentencePiece BPE)")
    tokens, types = _token_list(f)
    n = len(tokens)
    eos_id, bos_id, unk_id = (_token_id(f, k, n) for k in ("eos", "bos", "unknown"))
    if eos_id is None:
        raise UserError(f"{f.path} has no end-of-text token (tokenizer.ggml.eos_token_id)")
    add_bos = f.get("tokenizer.ggml.add_bos_token")
    pre = f.get("tokenizer.ggml.pre")
    if add_bos is None:  # llama.cpp's defaults: SentencePiece and Llama 3's add one
        add_bos = model == "llama" or pre == "llama-bpe"
    special = {i for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_UNUSED)}
    special |= {i for i in (eos_id, bos_id if add_bos else None) if i is not None}
    user = {i for i, t in enumerate(types) if t == TOKEN_USER_DEFINED} - special
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": i in special} for i in sorted(special | user)]
    bos = tokens[bos_id] if add_bos and bos_id is not None else None
    if model == "gpt2":
        if pre not in PRE_RULES:
            raise UserError(f"{f.path}: pre-tokenizer {pre!r}; nanoeuler reads "
                            f"{', '.join(sorted(p for p in PRE_RULES if p))}")
        rule = PRE_RULES[pre]
        if pre in (None, "default"):
            print(f"note: {f.path}: {'no' if pre is None else 'the default'} pre-tokenizer named: read as GPT-2's "
                  "(llama.cpp's 'default' splits numbers differently)", file=sys.stderr)
        from nanoeuler.tokenizer.pieces import LLAMA3_REGEX, QWEN2_REGEX
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
        pre_tokenizer = byte_level
        if rule == "gpt2_digits":
            pre_tokenizer = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                                   byte_level]}
        elif rule in ("llama3", "qwen2"):
            split = {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX if rule == "llama3" else QWEN2_REGEX},
                     "behavior": "Isolated", "invert": False}
            pre_tokenizer = {"type": "Sequence", "pretokenizers": [split, {**byte_level, "use_regex": False}]}
        merges = f.get("tokenizer.ggml.merges") or []
        vocab = {t: i for i, t in enumerate(tokens) if i not in special and i not in user}
        d = {"version": "1.0", "added_tokens": added, "normalizer": {"type": "NFC"} if rule == "qwen2" else None,
             "pre_tokenizer": pre_tokenizer, "post_processor": None, "decoder": {"type": "ByteLevel"},
             "model": {"type": "BPE", "vocab": vocab, "merges": list(merges), "ignore_merges": rule == "llama3"}}
    else:
        scores = f.get("tokenizer.ggml.scores") or [0.0] * n
        vocab = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        d = {"version": "1.0", "added_tokens": added, "post_processor": None,
             "model": {"type": "BPE", "vocab": vocab,
                       "merges": sentencepiece_merges(tokens, types, scores, special | user),
                       "unk_token": None if unk_id is None else tokens[unk_id], "fuse_unk": True,
                       "byte_fallback": True}}
        if f.get("tokenizer.ggml.add_space_prefix", True):
            d["normalizer"] = {"type": "Sequence", "normalizers": [  # Llama 2's
                {"type": "Prepend", "prepend": SPACE},
                {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}]}
            d["pre_tokenizer"] = None
        else:
            d["normalizer"] = None
            d["pre_tokenizer"] = {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "never", "split": False}
    return d, tokens[eos_id], bos


def sentencepiece_merges(tokens, types, scores, added):
    """The merges of a SentencePiece vocabulary: every split of each token into two tokens, the tokens in order
    of score (highest first; ties by id), a token's splits by the ids of their halves: transformers'
    SentencePieceExtractor, which wrote the tokenizer.json of Llama 2 and its kin."""
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = []
    order = sorted((i for i, t in enumerate(tokens) if i not in added and types[i] != TOKEN_BYTE and len(t) > 1),
                   key=lambda i: (-scores[i], i))
    for i in order:
        t = tokens[i]
        splits = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab]
        merges += [list(s) for s in sorted(splits, key=lambda ab: (vocab[ab[0]], vocab[ab[1]]))]
    return merges


def tokenizer_of(f):
    """Our tokenizer (its class picked as for a tokenizer.json) with its chat template and end ids."""
    from nanoeuler.tokenizer import hf
    from nanoeuler.tokenizer.bpe import Tokenizer

    d, eos, bos = tokenizer_dict(f)
    tok = hf.from_hf(d, f.path, eos, bos, byte_level=Tokenizer)
    template = f.get("tokenizer.chat_template")
    if template is not None:
        from nanoeuler.data.jinja_template import compiled
        compiled(template)
    tokens, _ = _token_list(f)
    ends = [i for i in (_token_id(f, "eos", len(tokens)), _token_id(f, "eot", len(tokens))) if i is not None]
    named = {name: tokens[i] for name, i in (("bos_token", _token_id(f, "bos", len(tokens))),
                                             ("eos_token", _token_id(f, "eos", len(tokens))),
                                             ("unk_token", _token_id(f, "unknown", len(tokens))),
                                             ("pad_token", _token_id(f, "padding", len(tokens)))) if i is not None}
    return tok.set_chat(template, ends, named if template is not None else None)  # the names a template reads


def load_gguf(path, context=None, quant=None, group=None, head=None):
    """(Config, parameters, Tokenizer, note or None, the file's tensor types counted) of a GGUF file: the
    parameters flat float32 for a float checkpoint, else (flat float32 of the float tensors, {name:
    QuantizedTensor}); quant, group and head: --quantize's, --group's and --head-type's (None: the file's own,
    target_type)."""
    f = GGUFFile(path)
    cfg = rope_scaling_of(f, config_of(f, context))
    tok = tokenizer_of(f)
    if tok.vocab_size > cfg.vocab_size:
        raise UserError(f"{f.path}: the tokenizer has {tok.vocab_size} tokens but the model only {cfg.vocab_size}")
    if tok.vocab_size < cfg.vocab_size:
        cfg = dataclasses.replace(cfg, tokenizer_vocab=tok.vocab_size)
    quant, group, head, note = target_type(f, cfg, quant, group, head)
    if quant is not None:
        from nanoeuler.io.quantize import quantized_config
        cfg = quantized_config(cfg, quant, group, head)
    params, stats = read_params(f, cfg)
    if stats["groups"]:
        share = stats["inexact"] / stats["groups"]
        q4k = (f"Q4_K: {stats['inexact']} of {stats['groups']} sub-block scales/minimums ({100 * share:.1f}%) "
               f"rounded to float16 (a weight moved by at most {stats['worst']:.2g} of its scale)")
        note = q4k if note is None else f"{note}; {q4k}"
    types = {}
    for t in f.tensors.values():
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(types.items(), key=lambda kv: -kv[1]))
    return cfg, params, tok, note, kinds
