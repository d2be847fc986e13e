"""`import --hf` streams: each tensor is read from its safetensors shard straight into its place in the flat
float32 parameters, so the import's peak memory is about the model's float32 size once (docs/import.md,
Measurements). A random bf16 Llama in two shards, written here by hand (no transformers: its shape, not its
values, is what matters), of 142 MB in float32: the import takes a few seconds."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from nanoeuler.io.export import LAYER_NAMES


def write_random_llama(folder, dim=960, n_layers=2, n_heads=15, n_kv_heads=5, hidden=2560, vocab=49152,
                       shards=2, tied=True, seed=0):
    """A LlamaForCausalLM folder of random bf16 weights in `shards` safetensors files with their index (the
    layout of a published model), and a byte-level BPE tokenizer of 256 byte tokens and 3 special ones.
    Returns the float32 size of its parameters in bytes."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    kv = dim // n_heads * n_kv_heads
    shapes = {"model.embed_tokens.weight": (vocab, dim), "model.norm.weight": (dim,)}
    sizes = {"attn_norm": (dim,), "wq": (dim, dim), "wk": (kv, dim), "wv": (kv, dim), "wo": (dim, dim),
             "ffn_norm": (dim,), "w_gate": (hidden, dim), "w_up": (hidden, dim), "w_down": (dim, hidden)}
    for i in range(n_layers):
        for ours, theirs in LAYER_NAMES.items():
            shapes[f"model.layers.{i}.{theirs}.weight"] = sizes[ours]
    if not tied:
        shapes["lm_head.weight"] = (vocab, dim)
    rng = np.random.default_rng(seed)
    names = list(shapes)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {}, 0
        for name in part:
            n = int(np.prod(shapes[name]))
            header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + 2 * n]}
            offset += 2 * n
            weight_map[name] = file
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        with open(os.path.join(folder, file), "wb") as f:
            f.write(len(blob).to_bytes(8, "little") + blob)
            for name in part:
                n = int(np.prod(shapes[name]))
                for lo in range(0, n, 1 << 22):  # 4M values at a time: the writer stays small too
                    values = rng.standard_normal(min(1 << 22, n - lo), dtype=np.float32) * 0.02
                    f.write((values.view(np.uint32) >> 16).astype("<u2").tobytes())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": dim,
              "num_hidden_layers": n_layers, "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads,
              "intermediate_size": hidden, "vocab_size": vocab, "max_position_embeddings": 2048,
              "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": tied, "eos_token_id": 0}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    from nanoeuler.tokenizer.bpe import bytes_to_unicode
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_tokens = list(bytes_to_unicode().values())
    vocab_json = {t: i for i, t in enumerate(specials + byte_tokens)}
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "normalizer": None,
                 "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                                   "normalized": False, "special": True} for i, t in enumerate(specials)],
                 "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                   "use_regex": True},
                 "post_processor": None, "decoder": {"type": "ByteLevel"},
                 "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                           "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                           "ignore_merges": False, "vocab": vocab_json, "merges": []}}
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f)
    return 4 * sum(int(np.prod(s)) for s in shapes.values())


# the import in a child process, its peak resident set (ru_maxrss: kB on Linux) printed last
PEAK = """import atexit, resource, sys
atexit.register(lambda: print("peak", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
from nanoeuler.cli import main
main(["import", "--hf", sys.argv[1], "--out", sys.argv[2], "--overwrite"])
"""


def import_peak(folder, out):
    """(peak RSS in bytes of `nanoeuler import --hf folder --out out` in a fresh process, its stdout)."""
    r = subprocess.run([sys.executable, "-c", PEAK, os.fspath(folder), os.fspath(out)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split()[-1]), r.stdout


def baseline_peak():
    """The peak RSS of a process that imports what the import does and nothing else."""
    code = ("import resource, numpy, numba, nanoeuler.io.hf_import, nanoeuler.io.checkpoint, nanoeuler.model.gpu\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in kB: Linux")
def test_the_import_peak_is_about_the_float32_model_once(tmp_path):
    """35M parameters (SmolLM2-360M's width, a vocabulary of 16,384, 2 layers), bf16 in two shards: the import's peak
    RSS above a bare process is below 1.6x the float32 size (reading everything first and copying it took ~3x)."""
    fp32 = write_random_llama(tmp_path / "hf", vocab=16384)
    peak, stdout = import_peak(tmp_path / "hf", tmp_path / "m.bin")
    assert "embedding tied" in stdout
    extra = peak - baseline_peak()
    assert extra < 1.6 * fp32, (extra / fp32, fp32)
    from nanoeuler.io import checkpoint
    from nanoeuler.io.hf_import import read_tensors
    ck = checkpoint.load(tmp_path / "m.bin")
    theirs = read_tensors(tmp_path / "hf")
    from nanoeuler.model.config import views
    v = views(ck.params, ck.cfg)
    assert np.array_equal(v["tok_emb"], theirs["model.embed_tokens.weight"])
    assert np.array_equal(v["layers.1.w_down"], theirs["model.layers.1.mlp.down_proj.weight"])
