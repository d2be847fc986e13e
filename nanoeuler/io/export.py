"""Export to Hugging Face: `nanoeuler export --hf DIR [--ckpt F]` (`--gguf FILE`: nanoeuler/io/gguf.py).

    nanoeuler export --hf hf_model --ckpt nanoeuler.bin
    # then, with transformers installed:
    #   LlamaForCausalLM.from_pretrained("hf_model"); PreTrainedTokenizerFast(tokenizer_file="hf_model/tokenizer.json")

The model is a Llama as far as `transformers` is concerned: the same RMSNorm (eps 1e-5), the same
rotate-half RoPE (so q/k rows need no permutation, unlike exports of Meta's interleaved checkpoints),
grouped-query attention, SwiGLU and no biases. An import is written as the architecture it came from
(config.architecture): a Qwen2ForCausalLM with its q/k/v biases (`*_proj.bias`), a MistralForCausalLM with
its sliding window. Head 0 (next-token prediction) becomes `lm_head`; the other
multi-token-prediction heads are training aids and are left out. A tied model (an import of one, config.tied)
is written tied: `tie_word_embeddings: true` and no `lm_head.weight`, so transformers reads the embedding as
the head, as it does for the model that was imported; an untied one says `tie_word_embeddings: false`.
Files: config.json, generation_config.json (all of an import's end ids), model.safetensors, tokenizer.json,
tokenizer_config.json (an import's named special tokens; with a chat checkpoint's `chat_template`: the
model's own, else data/template.py's, so `tokenizer.apply_chat_template` renders the template it was
fine-tuned on), special_tokens_map.json, and README.md, the model card (the run report, io/report.py, with
loading instructions and the loss curve); each is written atomically.

An adapter checkpoint (`sft|dpo --lora R`: io/checkpoint.py) is exported merged: its base with W + (alpha / r) B A
in every adapted product (`--merge` says so and is implied), here and with `--gguf`. `--peft DIR` writes its
adapters alone, as PEFT's files (io/peft.py), for the base this command writes of the checkpoint it names.
Adapters over a quantized base (QLoRA) are merged in float into its exact dequantized weights here; `--gguf`
writes the merge quantized again in the base's format (io/checkpoint.py's load_merged).
"""
import json
import os

import numpy as np
from safetensors.numpy import save as serialize

from nanoeuler.data.template import CHAT_TEMPLATE
from nanoeuler.io import checkpoint
from nanoeuler.io.report import model_card
from nanoeuler.model.config import views
from nanoeuler.errors import UserError
from nanoeuler.files import atomic_write, output_folder

LAYER_NAMES = {  # ours -> Hugging Face Llama, within layer i
    "attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj",
}
BIAS_NAMES = {"bq": "self_attn.q_proj", "bk": "self_attn.k_proj", "bv": "self_attn.v_proj"}  # their `.bias`
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


def hf_tensors(cfg, params):
    """Our flat parameter buffer -> {Hugging Face name: array}."""
    v = views(params, cfg)
    out = {"model.embed_tokens.weight": v["tok_emb"], "model.norm.weight": v["final_norm"]}
    if not cfg.tied:  # a tied head 0 is the embedding: transformers ties lm_head to it
        out["lm_head.weight"] = v["heads.0"]
    for i in range(cfg.n_layers):
        for ours, theirs in LAYER_NAMES.items():
            out[f"model.layers.{i}.{theirs}.weight"] = v[f"layers.{i}.{ours}"]
        if cfg.qkv_bias:
            for ours, theirs in BIAS_NAMES.items():
                out[f"model.layers.{i}.{theirs}.bias"] = v[f"layers.{i}.{ours}"]
    return {name: np.ascontiguousarray(a, dtype=np.float32) for name, a in out.items()}


def hf_config(cfg, tok):
    """config.json: the architecture the model was imported as (Llama for our own); Qwen2's q/k/v biases are
    its architecture's, Mistral's sliding window its config's."""
    window = {}
    if cfg.architecture == "MistralForCausalLM":
        window = {"sliding_window": cfg.sliding_window}
    elif cfg.architecture == "Qwen2ForCausalLM":
        window = {"use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window,
                  "max_window_layers": 0 if cfg.sliding_window is not None else cfg.n_layers}
    return {
        "architectures": [cfg.architecture], "model_type": MODEL_TYPES[cfg.architecture], **window,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.hidden,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.context, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": cfg.tied,
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": "float32",
        "bos_token_id": None, "eos_token_id": tok.eos_id, "pad_token_id": None,
        **({} if cfg.rope_scaling is None else {"rope_scaling": dict(cfg.rope_scaling)}),
    }


def export_peft(args):
    """`export --peft DIR --ckpt F`: an adapter checkpoint's adapters as PEFT's files (io/peft.py)."""
    from nanoeuler.io import peft
    meta = checkpoint.read_metadata(args.ckpt)
    if not checkpoint.is_adapter(meta):
        raise UserError(f"--peft: {args.ckpt} is a model checkpoint, not adapters (sft/dpo --lora R writes those)")
    ack = checkpoint.load_adapters(args.ckpt)
    tensors = peft.write(args.peft, ack.cfg, ack.spec, ack.params, base=ack.base)
    print(f"exported the adapters of {args.ckpt} (step {ack.step}; rank {ack.spec.rank}, alpha {ack.spec.alpha:g}, "
          f"{','.join(ack.spec.targets)}) to {args.peft}/: {len(tensors)} tensors, "
          f"{sum(a.size for a in tensors.values()) / 1e6:.2f}M parameters, for the base {ack.base} exported with "
          "--hf")
    return 0


def main(args):
    if getattr(args, "peft", None):
        return export_peft(args)
    if args.gguf:
        from nanoeuler.io import gguf
        return gguf.main(args)
    ck = checkpoint.load_float_merged(args.ckpt)  # QLoRA's adapters merged into the dequantized base, in float
    tok = ck.tokenizer()
    out = args.hf
    output_folder(out, "--hf", "config.json")

    def write_json(name, obj):
        atomic_write(os.path.join(out, name), lambda f: json.dump(obj, f, indent=2), mode="w")

    cfg, params = ck.cfg, ck.params
    if cfg.quant is not None:  # Hugging Face's Llama has no such weights: the dequantized (exact) floats
        from nanoeuler.model.config import float_params
        cfg, params = float_params(cfg, params, ck.quantized)
    tensors = hf_tensors(cfg, params)
    data = serialize(tensors, metadata={"format": "pt"})
    atomic_write(os.path.join(out, "model.safetensors"), lambda f: f.write(data))
    write_json("config.json", hf_config(ck.cfg, tok))
    ends = list(tok.end_ids) if len(tok.end_ids) > 1 else tok.eos_id  # an import's several end ids, all kept
    write_json("generation_config.json", {"eos_token_id": ends, "max_length": ck.cfg.context})
    tok.save_hf(os.path.join(out, "tokenizer.json"))
    eos = next(name for name, i in tok.special_tokens.items() if i == tok.eos_id)
    write_json("tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": ck.cfg.context,
        **tok.named_tokens, "eos_token": eos, "clean_up_tokenization_spaces": False, "add_bos_token": False,
        "add_eos_token": False, **({"chat_template": tok.chat_template or CHAT_TEMPLATE} if ck.chat else {})})
    write_json("special_tokens_map.json", {"eos_token": eos})
    card = model_card(args.ckpt, out, ck.chat)
    atomic_write(os.path.join(out, "README.md"), lambda f: f.write(card), mode="w")
    print(f"exported {args.ckpt} (step {ck.step}) to {out}/: {ck.cfg.architecture}, "
          f"{sum(a.size for a in tensors.values()) / 1e6:.2f}M parameters "
          f"({'lm_head tied to the embedding' if ck.cfg.tied else 'head 0 as lm_head'}), tokenizer.json with "
          f"{tok.vocab_size} tokens")
    return 0
