"""Model configuration: the presets, the parameter layout and the initialisation.

Everything that has to agree between the engines, the checkpoint and the exporters lives here: the
tensor names and shapes of docs/design.md, in the order they sit in the one flat parameter buffer.
A tied model (`tied`: an imported model whose output head is its embedding) has no `heads.0` in that
buffer: head 0 is `tok_emb`, one tensor (the engines read and train it as both). A model with `qkv_bias`
(Qwen2) has `layers.{i}.bq|bk|bv` right after `wv`, so the engines add them as one (q|k|v) bias.
"""
import dataclasses
import json
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Config:
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden: int = 384
    vocab_size: int = 512
    context: int = 128
    mtp_heads: int = 2          # K: head k predicts the token 1+k positions ahead
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # Hugging Face's rope_scaling dict of an imported model (rope_type "llama3"); None (and absent from the
    # checkpoint's JSON) for unscaled RoPE. Not hashed: a dict.
    rope_scaling: dict = dataclasses.field(default=None, hash=False)
    # Head 0 is tok_emb, one tensor (Hugging Face's tie_word_embeddings); False (and absent from the
    # checkpoint's JSON) for our own models. Only with one prediction head: heads.1.. could not sit beside it.
    tied: bool = False
    # q, k and v biases (Qwen2): layers.{i}.bq|bk|bv, added before the rotary embedding; False (and absent from
    # the checkpoint's JSON) for models without them
    qkv_bias: bool = False
    # Hugging Face's sliding_window of an imported model (Mistral), kept for export: `context` is never larger,
    # so no attention spans more than it; None (and absent) where there is none
    sliding_window: int = None
    # the tokenizer's vocabulary where it is smaller than vocab_size (Qwen2: 151,665 tokens, 151,936 rows): the
    # ids from it on are padding rows, never generated; None (and absent) where the two agree
    tokenizer_vocab: int = None
    # the Hugging Face architecture an import came from, which export --hf writes back (absent: Llama)
    architecture: str = "LlamaForCausalLM"
    # quantized weights (model/quantize.py, docs/quantization.md): "int8" or "int4" and the group length along
    # a row (0: one group a row); None (and absent from the checkpoint's JSON) for float weights
    quant: str = None
    quant_group: int = None
    # the untied prediction heads' own type and group where they differ from the layers' (an int4 model's heads
    # int8 in groups of 32, as llama.cpp's Q4_K_M keeps its output in Q6_K); None (and absent): as the layers
    quant_head: str = None
    quant_head_group: int = None

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden", "vocab_size", "context", "mtp_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.tied and self.mtp_heads != 1:
            raise ValueError(f"tied embeddings take one prediction head (head 0 is the embedding), "
                             f"not {self.mtp_heads}")
        if self.sliding_window is not None and self.context > self.sliding_window:
            raise ValueError(f"context {self.context} is larger than the sliding window {self.sliding_window}")
        if self.tokenizer_vocab is not None and not 1 <= self.tokenizer_vocab <= self.vocab_size:
            raise ValueError(f"tokenizer_vocab {self.tokenizer_vocab} is not within vocab_size {self.vocab_size}")
        if self.quant is not None:
            from nanoeuler.model.quantize import check_type
            check_type(self.quant, self.quant_group)
        if self.quant_head is not None:
            if self.quant is None or self.tied:
                raise ValueError("a head type of its own (quant_head) takes a quantized model with untied heads")
            from nanoeuler.model.quantize import check_type
            check_type(self.quant_head, self.quant_head_group)
        if self.rope_scaling is not None:
            rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)  # raises on what we do not compute

    @property
    def head_dim(self):
        return self.dim // self.n_heads

    def to_json(self):
        # optional keys are left out when unset: our own models' JSON is unchanged
        unset = {"rope_scaling": None, "tied": False, "qkv_bias": False, "sliding_window": None,
                 "tokenizer_vocab": None, "architecture": "LlamaForCausalLM",
                 "quant": None, "quant_group": None, "quant_head": None, "quant_head_group": None}
        return json.dumps({k: v for k, v in dataclasses.asdict(self).items() if k not in unset or v != unset[k]},
                          sort_keys=True)

    @classmethod
    def from_json(cls, text):
        fields = {f.name for f in dataclasses.fields(cls)}
        d = json.loads(text)
        return cls(**{k: v for k, v in d.items() if k in fields})


def _hidden(dim):
    # Llama's SwiGLU width: 8/3 of dim (same parameter count as a 4x GELU MLP), rounded up to 64.
    return 64 * math.ceil(8 * dim / 3 / 64)


PRESETS = {
    # small: one prediction head and a 4 * dim SwiGLU, both chosen by experiment (docs/training-small.md)
    "small": Config(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, hidden=4 * 128,
                    vocab_size=512, context=128, mtp_heads=1),
    "big": Config(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, hidden=_hidden(384),
                  vocab_size=4096, context=256, mtp_heads=2),
    "base": Config(dim=768, n_layers=16, n_heads=12, n_kv_heads=4, hidden=_hidden(768),
                   vocab_size=4096, context=512, mtp_heads=4),
    # 264.7M: base widened to 1024 (head size 64 as base) and deepened to 22 layers; made for a 12 GB card
    # in bf16 with gradient accumulation (fp32 master weights, gradients and moments: 4.2 GB of the 12).
    "large": Config(dim=1024, n_layers=22, n_heads=16, n_kv_heads=4, hidden=_hidden(1024),
                    vocab_size=4096, context=512, mtp_heads=4),
}


def param_shapes(cfg, floats_only=False):
    """(name, shape) for every tensor, in flat-buffer order; floats_only leaves out a quantized model's
    quantized tensors (model/quantize.py: the flat buffer of such a model holds the others alone)."""
    hd = cfg.head_dim
    shapes = [("tok_emb", (cfg.vocab_size, cfg.dim))]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        shapes += [
            (p + "attn_norm", (cfg.dim,)),
            (p + "wq", (cfg.n_heads * hd, cfg.dim)),
            (p + "wk", (cfg.n_kv_heads * hd, cfg.dim)),
            (p + "wv", (cfg.n_kv_heads * hd, cfg.dim)),
        ]
        if cfg.qkv_bias:
            shapes += [(p + "bq", (cfg.n_heads * hd,)), (p + "bk", (cfg.n_kv_heads * hd,)),
                       (p + "bv", (cfg.n_kv_heads * hd,))]
        shapes += [
            (p + "wo", (cfg.dim, cfg.n_heads * hd)),
            (p + "ffn_norm", (cfg.dim,)),
            (p + "w_gate", (cfg.hidden, cfg.dim)),
            (p + "w_up", (cfg.hidden, cfg.dim)),
            (p + "w_down", (cfg.dim, cfg.hidden)),
        ]
    shapes.append(("final_norm", (cfg.dim,)))
    first_head = 1 if cfg.tied else 0  # a tied head 0 is tok_emb
    shapes += [(f"heads.{k}", (cfg.vocab_size, cfg.dim)) for k in range(first_head, cfg.mtp_heads)]
    if floats_only and cfg.quant is not None:
        quantized = set(quantized_names(cfg))
        shapes = [(name, shape) for name, shape in shapes if name not in quantized]
    return shapes


QUANTIZED_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # a layer's


def quantized_names(cfg):
    """The tensors a quantized model of cfg holds quantized, in parameter order (nothing where cfg.quant is
    unset): every layer matrix and the untied prediction heads."""
    if cfg.quant is None:
        return ()
    names = [f"layers.{i}.{m}" for i in range(cfg.n_layers) for m in QUANTIZED_MATRICES]
    return tuple(names + [f"heads.{k}" for k in range(1 if cfg.tied else 0, cfg.mtp_heads)])


def quant_format(cfg, name):
    """(type, group) of the quantized tensor `name` of cfg (group as the config holds it: 0 is a row): the
    heads' own (quant_head, quant_head_group) where the config sets them, else the layers' (quant,
    quant_group)."""
    if cfg.quant_head is not None and name.startswith("heads."):
        return cfg.quant_head, cfg.quant_head_group
    return cfg.quant, cfg.quant_group


def param_layout(cfg, floats_only=False):
    """{name: (offset, shape)} into the flat buffer, and the total element count (floats_only: param_shapes')."""
    layout, offset = {}, 0
    for name, shape in param_shapes(cfg, floats_only):
        layout[name] = (offset, shape)
        offset += math.prod(shape)
    return layout, offset


def param_count(cfg):
    return param_layout(cfg)[1]


def flops_per_token(cfg):
    """Training FLOPs per token (forward + backward): 6 per parameter a product reads (every one but the
    embedding's lookup; a tied embedding is head 0's product) plus causal attention's 6 * layers * dim *
    context (PaLM's accounting); the numerator of MFU."""
    lookup_only = 0 if cfg.tied else cfg.vocab_size * cfg.dim
    return 6 * (param_count(cfg) - lookup_only) + 6 * cfg.n_layers * cfg.dim * cfg.context


def views(flat, cfg, floats_only=False):
    """Named views (no copies) into a flat buffer laid out by param_layout; works for numpy and cupy."""
    layout, total = param_layout(cfg, floats_only)
    assert flat.size == total, (flat.size, total)
    return {name: flat[off:off + math.prod(shape)].reshape(shape) for name, (off, shape) in layout.items()}


def is_bias(name):
    """A q, k or v bias (or the engines' fused bqkv of them)."""
    return name.rsplit(".", 1)[-1] in ("bq", "bk", "bv", "bqkv")


def is_matrix(name):
    """Weight decay applies to matrices only, never to the norm gains or the biases."""
    return not name.endswith("norm") and not is_bias(name)


def init_params(cfg, seed=0, dtype=np.float32):
    """Normal(0, 0.02) weights; the projections that write into the residual stream (wo, w_down) scaled by
    1/sqrt(2 * n_layers) so the residual variance does not grow with depth (GPT-2); norm gains at 1, biases at 0."""
    flat = np.empty(param_count(cfg), dtype=dtype)
    v = views(flat, cfg)
    for name, values in init_tensors(cfg, seed, dtype):
        v[name][...] = values
    return flat


def init_rule(cfg, name):
    """How init_params starts a tensor: ("fill", value) for the norm gains (1) and biases (0), else
    ("normal", std): 0.02, the residual projections' scaled by 1/sqrt(2 * n_layers)."""
    if name.endswith("norm") or is_bias(name):
        return "fill", 1.0 if name.endswith("norm") else 0.0
    return "normal", 0.02 * (1.0 / math.sqrt(2 * cfg.n_layers) if name.endswith(("wo", "w_down")) else 1.0)


def init_tensors(cfg, seed=0, dtype=np.float32):
    """init_params's tensors one at a time, (name, array) in the flat buffer's order: the random draws go in
    that order, so a tensor's values are those of the whole buffer's."""
    rng = np.random.default_rng(seed)
    for name, shape in param_shapes(cfg):
        kind, value = init_rule(cfg, name)
        if kind == "fill":
            yield name, np.full(shape, value, dtype=dtype)
        else:
            yield name, rng.normal(0.0, value, size=shape).astype(dtype)


class InitialWeights:
    """init_params(cfg, seed)'s flat float32 buffer read a range at a time, one tensor drawn and held at a time:
    read(start, end), with ranges in ascending order (the draws go in the buffer's order). What a ZeRO-2/3 rank
    of a fresh run takes its shard of the weights from (train/sharded.py), never holding them whole."""
    dtype = np.dtype(np.float32)

    def __init__(self, cfg, seed=0):
        self.layout, self.size = param_layout(cfg)
        self._tensors = init_tensors(cfg, seed, self.dtype)
        self._drawn = (0, 0, None)  # the tensor drawn last: (its offset, its end, its values flat)

    def read(self, start, end):
        out = np.empty(end - start, dtype=self.dtype)
        at = start
        while at < end:
            offset, stop, values = self._drawn
            if at < offset:
                raise ValueError(f"InitialWeights reads in ascending order: {at} is before {offset}")
            if values is None or at >= stop:
                name, tensor = next(self._tensors)
                offset = self.layout[name][0]
                self._drawn = (offset, offset + tensor.size, tensor.reshape(-1))
                continue
            n = min(end, stop) - at
            out[at - start:at - start + n] = values[at - offset:at - offset + n]
            at += n
        return out


ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_inv_freq(head_dim, theta, scaling=None):
    """The D/2 inverse frequencies theta^(-2i/D) in float64, scaled as Hugging Face's rope_scaling dict says:
    rope_type "default" (or no dict) leaves them; "llama3" is transformers' _compute_llama3_parameters (Llama 3.1+):
    wavelengths under original_max_position_embeddings / high_freq_factor kept, over
    original_max_position_embeddings / low_freq_factor divided by factor, those between interpolated.
    ValueError for any other rope_type or a llama3 dict that lacks a key."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind != "llama3":
        raise ValueError(f"rope scaling type {kind!r}: nanoeuler computes {' and '.join(map(repr, ROPE_TYPES))} only")
    missing = [k for k in LLAMA3_KEYS if not isinstance(scaling.get(k), (int, float))]
    if missing:
        raise ValueError(f"llama3 rope scaling without a number for {', '.join(missing)}")
    factor, low, high, old = (float(scaling[k]) for k in LLAMA3_KEYS)
    if not (factor > 0 and 0 < low < high and old > 0):
        raise ValueError(f"llama3 rope scaling needs factor > 0 and 0 < low_freq_factor < high_freq_factor: {scaling}")
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled)


def rope_tables(head_dim, max_pos, theta, dtype, scaling=None):
    """cos, sin (max_pos, D/2): angle = pos * inv_freq (rope_inv_freq: theta^(-2i/D), scaled as `scaling`
    says), the rotate-half (Hugging Face Llama) pairing. Host-side NumPy, the same tables for both engines."""
    angles = np.arange(max_pos, dtype=np.float64)[:, None] * rope_inv_freq(head_dim, theta, scaling)[None, :]
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def float_params(cfg, params, quantized):
    """(the float config, its flat float32 parameters) of a quantized model: params (its float tensors) and
    each quantized tensor dequantized in its place (export --hf writes these)."""
    from nanoeuler.model.quantize import dequantize
    fcfg = dataclasses.replace(cfg, quant=None, quant_group=None, quant_head=None, quant_head_group=None)
    flat = np.empty(param_count(fcfg), np.float32)
    floats = views(params, cfg, floats_only=True)
    for name, view in views(flat, fcfg).items():
        view[...] = floats[name] if name in floats else dequantize(quantized[name])
    return fcfg, flat
