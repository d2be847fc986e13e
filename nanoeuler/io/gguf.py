"""Export to GGUF for llama.cpp: `nanoeuler export --gguf FILE [--ckpt F] [--type f32|f16|bf16|q8_0]`.

    nanoeuler export --gguf small.gguf --ckpt nanoeuler.bin --type f16
    llama-cli -m small.gguf -p "ROMEO:" -n 40 --temp 0        # or Ollama: FROM ./small.gguf in a Modelfile

Written through the `gguf` package (the llama.cpp project's own writer; pip install -e '.[gguf]'). Our model
is llama.cpp's `llama` architecture: the file carries every hyperparameter llama.cpp reads for it (context,
widths, layer and head counts, RoPE dimensions and base, the RMSNorm epsilon, vocabulary size, file type),
head 0 as `output.weight` (the other prediction heads are training aids and stay behind) and the embedding
as `token_embd.weight`; a tied model (config.tied) has no `output.weight`, and llama.cpp then takes
`token_embd.weight` as the output, as it does for the tied Llamas its converter writes. Matrices are stored
as --type (q8_0 blocks of 32: a matrix whose rows are not a multiple of 32 falls back to f16), the norm
gains as f32, as llama.cpp's own converter does. An imported
model with llama3 RoPE scaling also gets the f32 `rope_freqs.weight` that converter writes for it (the factor
each RoPE frequency is divided by).

Q/K rows: our RoPE rotates element i of a head with element i + D/2 (rotate-half, Hugging Face's pairing);
llama.cpp's rope for `llama` rotates element 2i with 2i + 1. So row i of each head goes to row 2i and row
i + D/2 to row 2i + 1: the permutation convert_hf_to_gguf.py (LlamaModel.permute) applies to Hugging Face
checkpoints, which pair as we do. q and k of a head are permuted alike, so their dot products, and hence the
attention, are unchanged; V and the output projection are untouched.

A quantized checkpoint (model/quantize.py) writes its matrices as GGUF's own blocks wherever the format is
one: int8 in groups of 32 as Q8_0, int4 in groups of 32 as Q4_1, their bytes copied (d, then the int8 q; d, m,
then the 16 bytes of packed q, which are already GGUF's nibble order), never dequantized; the other groups are
dequantized (exactly) and written as --type. Its embedding and norms are float, written as --type and f32. A
head of its own type (an int4 model's int8 head, the default) is written in its own blocks (Q8_0) beside the
layers' Q4_1: llama.cpp reads each tensor's type, and the file type names the layers' (MOSTLY_Q4_1, as
llama-quantize names its Q4_1 file whose output is Q6_K).

A model with q/k/v biases (a Qwen2 import) is llama.cpp's `qwen2` architecture instead (gguf_arch): the same
keys under `qwen2.`, the biases as f32 `blk.{i}.attn_q|attn_k|attn_v.bias`, and no Q/K permutation, since
llama.cpp runs qwen2 with NeoX RoPE, which pairs i with i + D/2 as we do (convert_hf_to_gguf.py's Qwen2Model
writes Qwen2's rows as they are). Its embedding rows past the tokenizer are written as they are, named
[PAD{i}] and unused, as that converter names them.

A SentencePiece-style tokenizer (Llama 2, TinyLlama, Mistral imports) is written as llama.cpp's SentencePiece
model (tokenizer.ggml.model "llama", as its converter writes those checkpoints): the pieces as the vocabulary
spells them (`▁` for a space), a score each from the merges (SentencePieceBPE.gguf_vocab: llama.cpp joins the
adjacent pair that makes the token of the highest score), byte tokens as llama.cpp's byte type, `<unk>` as
unknown, add_space_prefix where the tokenizer puts a `▁` in front of a text.

Otherwise the tokenizer is a GPT-2-style BPE (tokenizer.ggml.model "gpt2"): the tokens in their byte-level spelling,
the merges, token types (special tokens are control tokens, an import's non-special added tokens user-defined),
the pre-tokenizer llama.cpp names the tokenizer's rule by (GGUF_PRE: "gpt-2", llama.cpp's hand-written
splitter of GPT-2's regex, for ours; "smollm" and "llama-bpe" for SmolLM's and Llama 3's), the BOS an imported
tokenizer adds (none for ours), the end-of-text token (ours: `</s>`) as EOS and, for chat checkpoints, the
chat template (an imported model's own, else nanoeuler/data/template.py's CHAT_TEMPLATE).
"""
import os

import numpy as np

from nanoeuler.errors import UserError, require
from nanoeuler.files import atomic_output, check_writable
from nanoeuler.io import checkpoint
from nanoeuler.model.config import rope_inv_freq, views
from nanoeuler.model.quantize import QuantizedTensor, dequantize
from nanoeuler.tokenizer.sentencepiece_bpe import SentencePieceBPE

GGUF_LAYER_NAMES = {  # ours -> llama.cpp's, within block i
    "attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
    "ffn_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down",
}
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5  # llama.cpp's (gguf.TokenType)
SPM_TOKEN_TYPES = {"normal": TOKEN_NORMAL, "unknown": 2, "control": TOKEN_CONTROL, "user": TOKEN_USER_DEFINED,
                   "byte": 6}  # SentencePieceBPE.gguf_vocab's kinds
# tokenizer.ggml.pre by pretokenization rule: the names llama.cpp (src/llama-vocab.cpp) gives these splits, and
# that its convert_hf_to_gguf.py writes for GPT-2, SmolLM/SmolLM2, Llama 3 and Qwen2 (llama-bpe: ignore_merges
# and a BOS by default)
GGUF_PRE = {"gpt2": "gpt-2", "gpt2_digits": "smollm", "llama3": "llama-bpe", "qwen2": "qwen2"}


def rope_pairs_adjacent(w, n_heads):
    """Rows of each head's (D, in) block from rotate-half order (i with i + D/2) to llama.cpp's adjacent
    pairs (2i with 2i + 1): convert_hf_to_gguf.py's LlamaModel.permute."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_pairs_split(w, n_heads):
    """The inverse of rope_pairs_adjacent: llama.cpp's row order back to ours."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_arch(cfg):
    """llama.cpp's architecture for the model: `qwen2` for one with q/k/v biases (Qwen2: the biases as
    blk.{i}.attn_q|attn_k|attn_v.bias, NeoX RoPE), else `llama`."""
    return "qwen2" if cfg.qkv_bias else "llama"


GGUF_BIAS_NAMES = {"bq": "attn_q", "bk": "attn_k", "bv": "attn_v"}  # ours -> llama.cpp's (qwen2), within block i


def gguf_names(cfg):
    """{llama.cpp tensor name: our tensor name}, in file order; heads 1..K-1 have none, nor has a tied head 0
    (it is token_embd). A model with q/k/v biases (qwen2) also has blk.{i}.attn_q|attn_k|attn_v.bias."""
    names = {"token_embd.weight": "tok_emb"}
    for i in range(cfg.n_layers):
        names.update({f"blk.{i}.{theirs}.weight": f"layers.{i}.{ours}" for ours, theirs in GGUF_LAYER_NAMES.items()})
        if cfg.qkv_bias:
            names.update({f"blk.{i}.{theirs}.bias": f"layers.{i}.{ours}" for ours, theirs in GGUF_BIAS_NAMES.items()})
    names["output_norm.weight"] = "final_norm"
    if not cfg.tied:
        names["output.weight"] = "heads.0"
    return names


def rope_heads(cfg, name):
    """The heads whose rows rope_pairs_adjacent permutes in our tensor `name`, or None: wq's and wk's for the
    `llama` architecture; none for `qwen2`, whose NeoX RoPE pairs element i with i + D/2 as ours does."""
    if gguf_arch(cfg) != "llama":
        return None
    return {"wq": cfg.n_heads, "wk": cfg.n_kv_heads}.get(name.rsplit(".", 1)[-1])


def gguf_tensors(cfg, params, quantized=None):
    """{llama.cpp name: float32 array in llama.cpp's row order} of our flat parameters, in file order; a
    quantized model's (params its float tensors, quantized its {name: QuantizedTensor}) quantized matrices as
    QuantizedTensors, their rows in that order too (a row's groups move with it)."""
    v = dict(views(params, cfg, floats_only=True), **(quantized or {}))
    out = {}
    for theirs, ours in gguf_names(cfg).items():
        heads = rope_heads(cfg, ours)
        order = (lambda a: a) if heads is None else (lambda a: np.ascontiguousarray(rope_pairs_adjacent(a, heads)))
        if isinstance(v[ours], QuantizedTensor):
            t = v[ours]
            out[theirs] = QuantizedTensor(t.kind, t.group, order(t.q), order(t.scales),
                                          None if t.mins is None else order(t.mins))
        else:
            out[theirs] = np.ascontiguousarray(order(v[ours]), dtype=np.float32)
    return out


def gguf_blocks(gguf, t):
    """(the bytes (O, blocks * block size) uint8, GGUF type) of a QuantizedTensor that is a GGUF type block for
    block (int8 / int4 in groups of 32: Q8_0 / Q4_1), or None."""
    if t.group != 32:
        return None
    O = t.q.shape[0]
    fields = [t.scales.astype(np.float16).view(np.uint8).reshape(O, -1, 2)]
    if t.kind == "int4":
        fields.append(t.mins.astype(np.float16).view(np.uint8).reshape(O, -1, 2))
    fields.append(np.ascontiguousarray(t.q).view(np.uint8).reshape(O, fields[0].shape[1], -1))
    qtype = gguf.GGMLQuantizationType.Q8_0 if t.kind == "int8" else gguf.GGMLQuantizationType.Q4_1
    return np.concatenate(fields, axis=-1).reshape(O, -1), qtype


ROPE_FREQS = "rope_freqs.weight"


def rope_freq_factors(cfg):
    """llama.cpp's rope_freqs tensor (as convert_hf_to_gguf.py writes it for llama3 scaling): per frequency,
    what the unscaled inverse frequency is divided by."""
    return (rope_inv_freq(cfg.head_dim, cfg.rope_theta) /
            rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)).astype(np.float32)


def read_params(path, cfg, params):
    """A copy of the flat parameters `params` with every tensor the GGUF file at `path` holds replaced by the
    file's values (dequantized, in our row order): the model llama.cpp runs, for our engines."""
    import gguf
    flat = np.array(params, dtype=np.float32)
    v = views(flat, cfg)
    names = gguf_names(cfg)
    for t in gguf.GGUFReader(path).tensors:
        if t.name == ROPE_FREQS:  # computed from the config
            continue
        ours = names[t.name]
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(v[ours].shape)
        heads = rope_heads(cfg, ours)
        v[ours][...] = data if heads is None else rope_pairs_split(data, heads)
    return flat


def _stored(gguf, array, kind):
    """(data, raw dtype or None) of one tensor as the file stores it for --type kind (a QuantizedTensor: its
    own GGUF blocks where it has them, else dequantized)."""
    if isinstance(array, QuantizedTensor):
        blocks = gguf_blocks(gguf, array)
        if blocks is not None:
            return blocks
        array = dequantize(array)
    if array.ndim == 1 or kind == "f32":
        return array, None
    if kind == "f16" or (kind == "q8_0" and array.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0]):
        return array.astype(np.float16), None
    qtype = gguf.GGMLQuantizationType.BF16 if kind == "bf16" else gguf.GGMLQuantizationType.Q8_0
    return gguf.quants.quantize(array, qtype), qtype


def write_gguf(path, cfg, params, tok, kind="f16", chat=False, name="nanoeuler", quantized=None):
    """Write the model (head 0) and its tokenizer as a llama.cpp GGUF file, atomically (a quantized model: its
    {name: QuantizedTensor} in quantized)."""
    gguf, = require("gguf", what="export --gguf")
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind]
    if cfg.quant is not None and cfg.quant_group == 32:  # the layers' own type (most of the weights; a head's differs)
        file_type = gguf.LlamaFileType.MOSTLY_Q8_0 if cfg.quant == "int8" else gguf.LlamaFileType.MOSTLY_Q4_1
    sentencepiece = isinstance(tok, SentencePieceBPE)
    if sentencepiece:
        names, scores, kinds = tok.gguf_vocab()
        types = [SPM_TOKEN_TYPES[k] for k in kinds]
    else:
        names, merges = tok.byte_level_names()
        types = [TOKEN_NORMAL] * tok.vocab_size
        for s, i in tok.special_tokens.items():  # a non-special added token is found in any text: user-defined
            types[i] = TOKEN_USER_DEFINED if s in tok.nonspecial else TOKEN_CONTROL
    # rows of the model past the tokenizer's vocabulary: named, never produced by the tokenizer
    names += [f"[PAD{i}]" for i in range(tok.vocab_size, cfg.vocab_size)]
    types += [TOKEN_UNUSED] * (cfg.vocab_size - tok.vocab_size)

    arch = gguf_arch(cfg)
    if arch != "llama" and cfg.rope_scaling is not None:
        raise UserError(f"export --gguf: RoPE scaling is written for the llama architecture only, not {arch}")
    w = gguf.GGUFWriter(None, arch)
    w.add_name(name)
    w.add_context_length(cfg.context)
    w.add_embedding_length(cfg.dim)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.hidden)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(file_type)
    if sentencepiece:  # llama.cpp's SentencePiece tokenizer: merges by the joined token's score
        w.add_tokenizer_model("llama")
        w.add_token_list(names)
        w.add_token_scores(scores + [0.0] * (cfg.vocab_size - tok.vocab_size))
        w.add_token_types(types)
        w.add_add_space_prefix(tok.adds_space_prefix)
        if tok.unk is not None:
            w.add_unk_token_id(names.index(tok.unk))
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(GGUF_PRE[tok.rule])
        w.add_token_list(names)
        w.add_token_types(types)
        w.add_token_merges(merges)
    w.add_eos_token_id(tok.eos_id)
    # the tokenizer's BOS (an import's, put first by encode) is added; ours have none: the BOS id is the token
    # a text follows in training, never added
    w.add_bos_token_id(tok.eos_id if tok.bos_id is None else tok.bos_id)
    w.add_add_bos_token(tok.bos_id is not None)
    w.add_add_eos_token(False)
    if chat:
        from nanoeuler.data.template import CHAT_TEMPLATE
        w.add_chat_template(tok.chat_template or CHAT_TEMPLATE)  # an import's own, else ours
    for tensor_name, array in gguf_tensors(cfg, params, quantized).items():
        data, raw_dtype = _stored(gguf, array, kind)
        w.add_tensor(tensor_name, data, raw_dtype=raw_dtype)
    if cfg.rope_scaling is not None:
        w.add_tensor(ROPE_FREQS, rope_freq_factors(cfg))
    try:
        with atomic_output(path) as f:
            # the writer opens files by name: it writes the temporary that atomic_output renames into place
            w.write_header_to_file(f.name)
            w.write_kv_data_to_file()
            w.write_tensors_to_file(progress=True)
            w.close()
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None


def main(args):
    ck = checkpoint.load(args.ckpt)
    tok = ck.tokenizer()
    check_writable(args.gguf)
    name = os.path.splitext(os.path.basename(args.ckpt))[0]
    write_gguf(args.gguf, ck.cfg, ck.params, tok, args.type, chat=ck.chat, name=name, quantized=ck.quantized)
    cfg = ck.cfg
    def written(kind, group, what):
        own = {"int8": "q8_0", "int4": "q4_1"}.get(kind) if group == 32 else None
        return f"{kind} {what} as {own} blocks (copied)" if own else f"{kind} {what} dequantized to {args.type}"
    matrices = f"{args.type} matrices" if cfg.quant is None else written(cfg.quant, cfg.quant_group, "matrices")
    if cfg.quant_head is not None:
        matrices += ", " + written(cfg.quant_head, cfg.quant_head_group, "head")
    print(f"exported {args.ckpt} (step {ck.step}) to {args.gguf}: llama.cpp GGUF, architecture "
          f"{gguf_arch(ck.cfg)}, "
          f"{matrices}, {'output tied to token_embd' if ck.cfg.tied else 'head 0 as output'}, "
          f"{tok.vocab_size} tokens"
          + (", chat template" if ck.chat else "") + f" ({os.path.getsize(args.gguf) / 1e6:.1f} MB)")
    return 0
