"""Import a Hugging Face Llama, Mistral or Qwen2: `nanoeuler import --hf DIR|HUB_ID --out F [--context N]
[--overwrite]`.

    nanoeuler import --hf SmolLM-135M --out smollm.bin
    nanoeuler import --hf HuggingFaceTB/SmolLM2-135M-Instruct --out smol_chat.bin   # from the Hub (or its cache)
    nanoeuler infer "Once upon a time" --ckpt smollm.bin --temperature 0
    nanoeuler sft --ckpt smollm.bin --out smollm_chat.bin

DIR is a `LlamaForCausalLM`, `MistralForCausalLM` or `Qwen2ForCausalLM` folder as `save_pretrained` writes
it: config.json, the weights as safetensors (one file or shards with their index; float32, float16 or
bfloat16, streamed a tensor at a time into float32) and a tokenizer.json (any BPE that the `tokenizers`
library reads: nanoeuler/tokenizer/hf.py picks the class that reads it). A string that is not a directory but
reads `owner/name` (or `owner/name@revision`) is a Hugging Face Hub id: `huggingface_hub.snapshot_download` (the `hub` extra) fetches
the files this import reads into the user's cache (HF_HOME, HF_HUB_CACHE), or finds them there
(HF_HUB_OFFLINE=1: the cache only). It becomes one nanoeuler checkpoint (nanoeuler/io/checkpoint.py) with K = 1
prediction heads:
`lm_head` becomes head 0, the tokenizer becomes ours with its ids kept (nanoeuler/tokenizer/), and RoPE
theta, its "llama3" scaling (Llama 3.1+: only the tables change) and the RMSNorm epsilon go into the config.
The Q/K rows need no permutation: our RoPE pairs dimensions as Hugging Face's does (rotate-half). This is the
inverse of `nanoeuler export --hf` (nanoeuler/io/export.py), whose tensor names it reads back.

Tied embeddings (SmolLM, Llama 3.2 1B/3B, Qwen2.5 0.5B) stay tied: the config says `tied` and head 0 is
`tok_emb`, one tensor, stored and trained once. Whether a model is tied is decided as transformers loads it:
- config.json's `tie_word_embeddings`; absent, the architecture's default in transformers' configuration
  class (TIE_DEFAULTS: False for LlamaConfig, unlike PretrainedConfig's True in transformers 4);
- tied, with an `lm_head.weight` equal to the embedding: tied (the copy is dropped); with one that differs:
  untied, lm_head as head 0, with a note (transformers then unties the two rather than lose either);
- untied, with no `lm_head.weight`: transformers would give lm_head random values, which is no one's model,
  so the embedding is taken as the head instead: tied, with a note.

An -Instruct model's chat template (chat_template.jinja, else tokenizer_config.json's `chat_template`) and
its end ids (generation_config.json's and config.json's `eos_token_id`s and the tokenizer's end of text) go
into the tokenizer (`chat_settings`, Tokenizer.set_chat): a model with a template is a chat model, which
chat, serve, sft and dpo address in that template (nanoeuler/data/jinja_template.py), and generation stops at
any of its end ids.

Qwen2's q/k/v biases become `layers.{i}.bq|bk|bv` (config `qkv_bias`); an embedding with more rows than the
tokenizer has tokens (Qwen2.5's) keeps the tokenizer's count in the config (`tokenizer_vocab`: decoding never
produces the ids past it). A sliding window (Mistral's, or Qwen2's where turned on) is honoured by a context no
larger than it: clamped with a note, a larger --context refused. The architecture goes into the config, for
export --hf to write back.

What our engines do not compute is refused in one line: other biases, rope scaling other than llama3, partial
rotary embeddings, an activation other than SiLU, a head size other than dim / heads, a tokenizer whose model
is not BPE (WordPiece, Unigram) or that has a part nanoeuler does not read (docs/tokenizer.md lists the
grammar it reads). A head size the GPU attention
kernels do not take is imported with a note (the CPU engine runs it).
"""
import dataclasses
import json
import os
import re
import sys

import numpy as np

from nanoeuler.errors import UserError, require
from nanoeuler.files import check_writable
from nanoeuler.io import checkpoint
from nanoeuler.io.safetensors_header import safetensors_header
from nanoeuler.io.export import BIAS_NAMES, LAYER_NAMES
from nanoeuler.io.quantize import describe
from nanoeuler.model.config import ROPE_TYPES, Config, param_count, views
from nanoeuler.tokenizer.bpe import Tokenizer

_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}  # BF16: the top half of a float32
# tie_word_embeddings when config.json leaves it out: the default of transformers' configuration class of each
# model_type (LlamaConfig's, MistralConfig's, Qwen2Config's and Qwen3Config's are all False)
TIE_DEFAULTS = {"llama": False, "mistral": False, "qwen2": False, "qwen3": False}


# what the import reads of a Hub repository (snapshot_download's allow_patterns)
HUB_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "chat_template.jinja", "*.safetensors", "model.safetensors.index.json"]
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*(@[^@\s]+)?")


def hub_folder(source):
    """The local folder of --hf SOURCE: SOURCE itself when it is a directory; for a Hub id `owner/name[@rev]`,
    its snapshot in the Hugging Face cache, downloaded (only HUB_FILES) unless HF_HUB_OFFLINE=1 keeps to the
    cache; anything else, and each way the Hub can fail, a one-line UserError."""
    source = os.fspath(source)
    if os.path.isdir(source):
        return source
    if not HUB_ID.fullmatch(source):
        raise UserError(f"--hf {source} is not a directory")
    repo, _, revision = source.partition("@")
    huggingface_hub, errors = require("huggingface_hub", "huggingface_hub.errors",
                                      what=f"--hf {source} is not a directory, and a Hugging Face Hub id")
    at = f" at revision {revision}" if revision else ""
    try:
        return huggingface_hub.snapshot_download(repo, revision=revision or None, allow_patterns=HUB_FILES)
    except errors.GatedRepoError:
        raise UserError(f"{repo} is a gated model: accept its terms on https://huggingface.co/{repo} and log in "
                        "(`hf auth login` or HF_TOKEN)") from None
    except errors.RepositoryNotFoundError:
        raise UserError(f"--hf {source}: no such local folder, and no model {repo} on the Hugging Face Hub (or a "
                        "private one: log in with `hf auth login` or HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise UserError(f"the Hugging Face model {repo} has no revision {revision!r}") from None
    except errors.LocalEntryNotFoundError:
        what = (" and HF_HUB_OFFLINE=1 keeps to it: download it once online" if huggingface_hub.constants.HF_HUB_OFFLINE
                else " and the Hub cannot be reached: connect, or point HF_HUB_CACHE at a cache that has it")
        raise UserError(f"{repo}{at} is not in the Hugging Face cache ({huggingface_hub.constants.HF_HUB_CACHE})"
                        f"{what}") from None
    except (errors.HfHubHTTPError, OSError, ValueError) as e:
        raise UserError(f"cannot download {repo}{at} from the Hugging Face Hub: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path} not found (a Hugging Face model folder has config.json and tokenizer.json)") from None
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path}: {e}") from None


def _safetensors_files(folder):
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        return sorted({os.path.join(folder, f) for f in _read_json(index)["weight_map"].values()})
    files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise UserError(f"{folder} has no .safetensors weights (save the model with safe_serialization=True)")
    return files


CHUNK = 1 << 22  # values read, converted and checked at a time


class Safetensors:
    """The tensors of a folder's safetensors files, by name, from their headers only; each tensor's bytes are
    read when asked for, `CHUNK` values at a time, straight into a float32 array the caller gives (BF16: the
    top half of a float32, exact), so that an import holds the float32 model once (plus one chunk). Read by hand
    (the header is JSON, the data raw little-endian) because NumPy has no bfloat16, the dtype most published
    checkpoints use."""

    def __init__(self, folder):
        self.entries = {}  # name -> (path, dtype, shape, start byte, end byte)
        for path in _safetensors_files(folder):
            header, start = safetensors_header(path)
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                if entry["dtype"] != "BF16" and entry["dtype"] not in _DTYPES:
                    raise UserError(f"{path}: tensor {name} is {entry['dtype']}; nanoeuler reads float weights only")
                lo, hi = entry["data_offsets"]
                self.entries[name] = (path, entry["dtype"], tuple(entry["shape"]), start + lo, start + hi)

    def __contains__(self, name):
        return name in self.entries

    def __iter__(self):
        return iter(self.entries)

    def shape(self, name):
        return self.entries[name][2]

    def chunks(self, name):
        """The tensor's values in order, as float32 arrays of at most CHUNK values."""
        path, dtype, shape, start, end = self.entries[name]
        source = np.dtype("<u2" if dtype == "BF16" else _DTYPES[dtype]).newbyteorder("<")
        count = int(np.prod(shape, dtype=np.int64))
        if end - start != count * source.itemsize:
            raise UserError(f"{path}: tensor {name} has {end - start} bytes, its shape {list(shape)} needs "
                            f"{count * source.itemsize}")
        buffer = np.empty(min(count, CHUNK), source)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                for lo in range(0, count, CHUNK):
                    part = buffer[:min(CHUNK, count - lo)]
                    if f.readinto(memoryview(part).cast("B")) != part.nbytes:
                        raise UserError(f"{path} ends inside tensor {name} (a truncated download?)")
                    yield (part.astype(np.uint32) << 16).view(np.float32) if dtype == "BF16" else part.astype(np.float32)
        except OSError as e:
            raise UserError(f"cannot read {path}: {e}") from None

    def read_into(self, name, out):
        """Fill the float32 array `out` (contiguous, of the tensor's shape) with the tensor's values."""
        flat, lo = out.reshape(-1), 0
        for part in self.chunks(name):
            flat[lo:lo + part.size] = part
            lo += part.size

    def array(self, name):
        out = np.empty(self.shape(name), np.float32)
        self.read_into(name, out)
        return out

    def equal(self, a, b):
        """Whether tensors a and b hold the same values, compared a chunk at a time."""
        return self.shape(a) == self.shape(b) and all(
            np.array_equal(x, y) for x, y in zip(self.chunks(a), self.chunks(b)))


def read_tensors(folder):
    """{name: float32 array} of every safetensors file of the folder (all of them in memory at once: for
    tests and comparisons; the import itself streams them through Safetensors)."""
    index = Safetensors(folder)
    return {name: index.array(name) for name in index}


# the architectures imported (Hugging Face's class names) by model_type; Qwen2's has biases on q, k and v
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def architecture_of(hf, where="config.json"):
    """The Hugging Face class name of a config (one of ARCHITECTURES), or a one-line UserError."""
    named = [a for a in hf.get("architectures") or [] if a in ARCHITECTURES.values()]
    if named:
        return named[0]
    if hf.get("model_type") in ARCHITECTURES and not hf.get("architectures"):
        return ARCHITECTURES[hf["model_type"]]
    raise UserError(f"{where}: {hf.get('architectures') or hf.get('model_type')} is not one of "
                    f"{', '.join(ARCHITECTURES.values())}")


def sliding_window_of(hf, architecture):
    """The attention window of a config, or None: Mistral's `sliding_window` (null: none); Qwen2's where it
    says use_sliding_window or any layer's type is sliding_attention."""
    window = hf.get("sliding_window")
    if architecture == "MistralForCausalLM":
        return window
    if architecture == "Qwen2ForCausalLM" and (hf.get("use_sliding_window") or
                                               "sliding_attention" in (hf.get("layer_types") or [])):
        return window
    return None


def config_from_hf(hf, context=None, where="config.json"):
    """Our Config of a Hugging Face LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM config, or a
    one-line UserError naming what we lack. A sliding window is honoured by a context no larger than it (so no
    attention spans more): the model's context is clamped to it with a note; a --context beyond it is refused."""
    architecture = architecture_of(hf, where)
    # transformers 5 writes RoPE as rope_parameters {rope_theta, rope_type}; 4.x as rope_theta and rope_scaling
    rope = hf.get("rope_parameters") or {}
    scaled = next((r for r in (rope, hf.get("rope_scaling") or {}) if r.get("rope_type", r.get("type")) not in
                   (None, "default")), None)
    scaling = scaled and {("rope_type" if k == "type" else k): v for k, v in scaled.items()
                          if k not in ("rope_theta", "partial_rotary_factor")}
    if not scaling:
        scaling = None
    elif scaling.get("rope_type") not in ROPE_TYPES:
        raise UserError(f"{where}: rope scaling type {scaling['rope_type']!r} (nanoeuler computes "
                        f"{' and '.join(map(repr, ROPE_TYPES))} RoPE only)")
    elif "original_max_position_embeddings" not in scaling and "max_position_embeddings" in hf:
        scaling["original_max_position_embeddings"] = hf["max_position_embeddings"]  # transformers' default
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0
    refusals = [
        (hf.get("hidden_act", "silu") != "silu", f"activation {hf.get('hidden_act')} (nanoeuler's SwiGLU uses SiLU)"),
        (hf.get("attention_bias") and architecture != "Qwen2ForCausalLM",
         "attention biases (nanoeuler's model has them on q, k and v only, as Qwen2)"),
        (hf.get("mlp_bias"), "feed-forward biases (nanoeuler's model has none)"),
        (partial != 1.0, f"partial_rotary_factor {partial} (nanoeuler rotates whole heads)"),
        (hf.get("pretraining_tp", 1) != 1, "pretraining_tp > 1"),
    ]
    for refused, what in refusals:
        if refused:
            raise UserError(f"{where}: {what}")
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, dim // n_heads) or dim % n_heads:
        raise UserError(f"{where}: head_dim {hf.get('head_dim')} is not hidden_size / num_attention_heads "
                        f"({dim} / {n_heads}), the only head size nanoeuler's model has")
    window = sliding_window_of(hf, architecture)
    if window is not None and not (isinstance(window, int) and window >= 1):
        raise UserError(f"{where}: sliding_window {window!r} is not a positive number of positions")
    if window is not None and context and context > window:
        raise UserError(f"--context {context} is larger than the model's sliding window ({window} positions): "
                        f"at most {window}")
    try:
        positions = context or hf["max_position_embeddings"]
        if window is not None and positions > window:
            print(f"note: {where}: context {positions} clamped to the sliding window, {window} positions (no "
                  "attention spans more)", file=sys.stderr)
            positions = window
        return Config(dim=dim, n_layers=hf["num_hidden_layers"], n_heads=n_heads,
                      n_kv_heads=hf.get("num_key_value_heads") or n_heads, hidden=hf["intermediate_size"],
                      vocab_size=hf["vocab_size"], context=positions, mtp_heads=1,
                      rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                      norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_scaling=scaling,
                      qkv_bias=architecture == "Qwen2ForCausalLM", sliding_window=window, architecture=architecture)
    except KeyError as e:
        raise UserError(f"{where} has no {e.args[0]}") from None
    except ValueError as e:
        raise UserError(f"{where}: {e}") from None


def _scaling_note(cfg):
    s = cfg.rope_scaling
    return "" if s is None else (f" ({s['rope_type']} scaling x{s['factor']:g} beyond "
                                 f"{s['original_max_position_embeddings']} positions)")


def tied_embeddings(hf, tensors):
    """(tied, note): whether head 0 is the embedding, decided as the module docstring says, and a note for
    stderr where the config and the weights disagree (else None)."""
    said = hf.get("tie_word_embeddings")
    tied = TIE_DEFAULTS.get(hf.get("model_type", "llama"), False) if said is None else bool(said)
    head, embedding = "lm_head.weight", "model.embed_tokens.weight"
    if tied and head in tensors and embedding in tensors and not (
            tensors.equal(head, embedding) if isinstance(tensors, Safetensors)
            else np.array_equal(tensors[head], tensors[embedding])):
        return False, ("config.json ties the embeddings but lm_head.weight differs from them: imported untied, "
                       "as transformers loads it")
    if not tied and head not in tensors:
        why = "says tie_word_embeddings false" if said is not None else "has no tie_word_embeddings (false by default)"
        return True, (f"config.json {why} but the weights have no lm_head.weight: imported tied, the embedding as "
                      "the output head (transformers would initialise lm_head at random)")
    return tied, None


def params_from_hf(cfg, tensors):
    """Our flat float32 parameters from Hugging Face's tensors (the names export.hf_tensors writes): a
    Safetensors index, whose tensors are read one at a time into their views of the flat buffer, or a dict of
    arrays. Head 0 is lm_head, or, in a tied model (cfg.tied), the embedding itself (an lm_head.weight beside it
    is its copy)."""
    ours = {"tok_emb": "model.embed_tokens.weight", "final_norm": "model.norm.weight"}
    if not cfg.tied:
        ours["heads.0"] = "lm_head.weight"
    for i in range(cfg.n_layers):
        for name, theirs in LAYER_NAMES.items():
            ours[f"layers.{i}.{name}"] = f"model.layers.{i}.{theirs}.weight"
        if cfg.qkv_bias:
            for name, theirs in BIAS_NAMES.items():
                ours[f"layers.{i}.{name}"] = f"model.layers.{i}.{theirs}.bias"
    unused = sorted(set(tensors) - set(ours.values()) - {"lm_head.weight"})
    unused = [n for n in unused if not n.endswith("rotary_emb.inv_freq")]  # recomputed from theta
    if unused:
        raise UserError(f"tensor {unused[0]} has no place in nanoeuler's model"
                        + (" (nanoeuler's model has biases on q, k and v only, as Qwen2)"
                           if unused[0].endswith("bias") else ""))
    def read(name, view):
        theirs = ours[name]
        if theirs not in tensors:
            raise UserError(f"the weights have no {theirs}")
        shape = tuple(tensors.shape(theirs) if isinstance(tensors, Safetensors) else tensors[theirs].shape)
        if shape != view.shape:
            raise UserError(f"{theirs} has shape {shape}, the config says {view.shape}")
        if isinstance(tensors, Safetensors):
            tensors.read_into(theirs, view)
        else:
            view[...] = tensors[theirs]
        for lo in range(0, view.size, CHUNK):  # a chunk at a time: no boolean copy of the model
            if not np.isfinite(view.reshape(-1)[lo:lo + CHUNK]).all():
                raise UserError("the weights hold non-finite values")

    if cfg.quant is not None:  # each matrix read, quantized and dropped (io/quantize.py)
        from nanoeuler.io.quantize import quantize_model
        return quantize_model(cfg, read)
    flat = np.empty(param_count(cfg), np.float32)
    for name, view in views(flat, cfg).items():
        read(name, view)
    return flat


def _eos_name(folder, hf):
    """The name of the end-of-text token: tokenizer_config.json's eos_token, else config.json's eos_token_id
    looked up in tokenizer.json's added tokens."""
    tc_path = os.path.join(folder, "tokenizer_config.json")
    if os.path.exists(tc_path):
        eos = _read_json(tc_path).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if eos:
            return eos
    eos_id = hf.get("eos_token_id")
    eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
    added = _read_json(os.path.join(folder, "tokenizer.json")).get("added_tokens") or []
    return next((t["content"] for t in added if t["id"] == eos_id), None)


def _bos_name(folder):
    """tokenizer_config.json's bos_token when it says add_bos_token (the post-processor may say it instead)."""
    tc_path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.exists(tc_path):
        return None
    tc = _read_json(tc_path)
    bos = tc.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    return bos if tc.get("add_bos_token") and bos else None


# tokenizer_config.json's named special tokens, which transformers hands a chat template as variables
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _ids(value):
    """An eos_token_id field (an id, a list of them, or absent) as a list."""
    return [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)]


def chat_settings(folder, hf, tok):
    """(chat template or None, end ids, named tokens) of a model folder, for Tokenizer.set_chat: the template
    as transformers loads it (chat_template.jinja, else tokenizer_config.json's `chat_template`, a string or
    the one named "default" of a list), compiled here so that a broken one fails at import; the end ids: the
    union of generation_config.json's and config.json's eos_token_id(s) and the tokenizer's end of text;
    tokenizer_config.json's named special tokens."""
    tc_path, jinja_path = os.path.join(folder, "tokenizer_config.json"), os.path.join(folder, "chat_template.jinja")
    tc = _read_json(tc_path) if os.path.exists(tc_path) else {}
    template = tc.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
        if template is None:
            print(f"note: {tc_path} has chat templates {sorted(map(str, named))} but none named 'default': "
                  "imported without one", file=sys.stderr)
    if os.path.exists(jinja_path):
        try:
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read {jinja_path}: {e}") from None
    if template is not None and not isinstance(template, str):
        raise UserError(f"{tc_path}: chat_template is neither a string nor a list of named templates")
    if template is not None:
        from nanoeuler.data.jinja_template import compiled
        compiled(template)
    gc_path = os.path.join(folder, "generation_config.json")
    gc = _read_json(gc_path) if os.path.exists(gc_path) else {}
    ends = _ids(gc.get("eos_token_id")) + _ids(hf.get("eos_token_id"))
    if [i for i in ends if not 0 <= i < tok.vocab_size]:
        print(f"note: end ids {[i for i in ends if not 0 <= i < tok.vocab_size]} of generation_config.json or "
              f"config.json are not tokens of tokenizer.json ({tok.vocab_size}); left out", file=sys.stderr)
    named = {k: v.get("content") if isinstance(v, dict) else v for k, v in tc.items() if k in NAMED_TOKENS}
    named = {k: v for k, v in named.items() if isinstance(v, str)} if tc else None
    return template, [i for i in ends if 0 <= i < tok.vocab_size], named


def load_hf(folder, context=None, quant=None, group=None, head=None):
    """(Config, flat float32 parameters, Tokenizer) of a Hugging Face Llama, Mistral or Qwen2 folder or Hub id;
    quant "int8" or "int4": its matrices quantized in groups of `group` (the untied heads as `head`:
    io/quantize.py's quantized_config) as they are read (the parameters are then (flat float32 of the float
    tensors, {name: QuantizedTensor}): io/quantize.py)."""
    folder = hub_folder(folder)
    hf = _read_json(os.path.join(folder, "config.json"))
    cfg = config_from_hf(hf, context, os.path.join(folder, "config.json"))
    tok = Tokenizer.load(os.path.join(folder, "tokenizer.json"), eos=_eos_name(folder, hf), bos=_bos_name(folder))
    tok.set_chat(*chat_settings(folder, hf, tok))
    if tok.vocab_size > cfg.vocab_size:
        raise UserError(f"tokenizer.json has {tok.vocab_size} tokens but the model only {cfg.vocab_size}")
    tensors = Safetensors(folder)
    tied, note = tied_embeddings(hf, tensors)
    if note:
        print(f"note: {note}", file=sys.stderr)
    cfg = dataclasses.replace(cfg, tied=tied)
    if tok.vocab_size < cfg.vocab_size:  # the embedding's padding rows (Qwen2's): never generated
        cfg = dataclasses.replace(cfg, tokenizer_vocab=tok.vocab_size)
    if quant is not None:
        from nanoeuler.io.quantize import quantized_config
        cfg = quantized_config(cfg, quant, group, head)
    return cfg, params_from_hf(cfg, tensors), tok


def main(args):
    for flag in ("group", "head_type"):  # both sources
        if getattr(args, flag, None) is not None and getattr(args, "quantize", None) is None:
            raise UserError(f"--{flag.replace('_', '-')} goes with --quantize int8|int4")
    if os.path.isfile(args.out) and not args.overwrite:
        raise UserError(f"{args.out} exists: --overwrite replaces it, --out FILE writes elsewhere")
    check_writable(args.out)
    kinds = None
    if getattr(args, "gguf", None):  # a llama.cpp file (io/gguf_import.py)
        from nanoeuler.io.gguf_import import load_gguf
        cfg, params, tok, note, kinds = load_gguf(args.gguf, args.context, getattr(args, "quantize", None),
                                                  getattr(args, "group", None), getattr(args, "head_type", None))
        if note:
            print(f"note: {note}", file=sys.stderr)
    else:
        cfg, params, tok = load_hf(args.hf, args.context, getattr(args, "quantize", None), getattr(args, "group", None),
                                   getattr(args, "head_type", None))
    quantized = None
    if cfg.quant is not None:
        params, quantized = params
    checkpoint.save(args.out, cfg, params, tok.to_json(), step=0, chat=tok.chat_template is not None,
                    quantized=quantized)
    print(f"imported {getattr(args, 'gguf', None) or args.hf} into {args.out}: "
          f"{'' if kinds is None else f'GGUF tensors {kinds}; '}{cfg.architecture}, dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads}/"
          f"{cfg.n_kv_heads} heads, hidden {cfg.hidden}, context {cfg.context}, vocab {cfg.vocab_size}, "
          f"rope theta {cfg.rope_theta:g}{_scaling_note(cfg)}, norm eps {cfg.norm_eps:g}, "
          f"{param_count(cfg) / 1e6:.2f}M parameters{' (embedding tied to the output head)' if cfg.tied else ''}"
          f"{'' if cfg.quant is None else f', matrices quantized to {describe(cfg)}'}"
          f"{', q/k/v biases' if cfg.qkv_bias else ''}; tokenizer: {tok.vocab_size} tokens"
          f"{'' if cfg.tokenizer_vocab is None else f' (ids {tok.vocab_size}..{cfg.vocab_size - 1} are padding, never generated)'}"
          f", end of text {tok.eos!r} = {tok.eos_id}")
    ends = ", ".join(f"{tok.decode([i]).decode('utf-8', 'replace')!r} = {i}" for i in tok.end_ids)
    print(f"{'a chat model: its own chat template' if tok.chat_template else 'no chat template (a base model)'}; "
          f"generation stops at {ends}")
    from nanoeuler.model.gpu import HEAD_SIZES
    if cfg.head_dim not in HEAD_SIZES:
        print(f"note: head size {cfg.head_dim}: the GPU attention kernels take {', '.join(map(str, HEAD_SIZES))}, "
              "so this model runs on the CPU engine only", file=sys.stderr)
    return 0
