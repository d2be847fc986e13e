"""`import --hf` then `export --gguf` of models of SmolLM2-135M's, Llama-3.2-1B's, Qwen2.5-0.5B's (as llama.cpp's
`qwen2`: q/k/v biases, no Q/K permutation, padding rows), TinyLlama-1.1B's (a SentencePiece-style tokenizer, as
llama.cpp's `llama` tokenizer model with scores) and Mistral-7B-v0.1's structure (head 128, untied, the context
clamped to its sliding window): the GGUF carries their tokenizers
as llama.cpp's converter would (pre-tokenizer `smollm` / `llama-bpe`, the BOS Llama 3 adds, control and
user-defined tokens, the chat template, `rope_freqs` for llama3 RoPE scaling), and, where llama-cpp-python is
installed (mark llamacpp: an allowed skip without it, tests/conftest.py), llama.cpp gives our token ids on a
fuzzed corpus and our greedy continuations (`nanoeuler infer --temperature 0`); and a quantized checkpoint's
export (its Q8_0 / Q4_1 blocks) gives in llama.cpp our quantized engine's logits.

The models are random, narrower and shallower than the published ones (2 layers; heads of 64 as theirs), with
their config's other values (theta, epsilon, tied embeddings, Llama 3.2's rope_scaling) and their tokenizers'
exact structures, built as tests/test_tokenizer_families.py builds them: SmolLM2's Sequence[Digits, ByteLevel]
with 21 byte tokens missing (1,181 tokens with <|im_start|>, <|im_end|>; SmolLM2-Instruct's chat template);
Llama 3's Split regex + ByteLevel with ignore_merges, merges that use later tokens, a BOS post-processor, special
and non-special added tokens, 67,998 tokens (Llama 3's 128,256 reduced; above 65,536 all the same). Weights are
N(0, 0.5) so that greedy choices are decisive: a continuation may part from ours only where our top two logits
are within MARGIN (none did). llama.cpp runs the f32 export with an f32 KV cache.

    NANOEULER_LLAMA_CPP_SITE=/tmp/llamacpp-venv/lib/python3.11/site-packages .venv/bin/python -m pytest \\
        tests/test_gguf_llamacpp.py -s        # docs/gguf.md: installing llama-cpp-python
"""
import json
import os
import sys
import unicodedata

import gguf
import numpy as np
import pytest

from conftest import run_cli
from nanoeuler.infer.generate import generate
from nanoeuler.io import checkpoint
from nanoeuler.io.checkpoint import load_model
from test_tokenizer_families import MISSING, SHAKESPEARE, fuzz_texts, llama3_json, qwen2_json, smollm_json
from test_tokenizer_sentencepiece import EDGES, llama2_layout, trained

SMOL_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                 "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                 "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
# config.json of each, as published, but for the widths and depth (hidden 1/3 and 1/8 of theirs, 2 layers)
SMOLLM2 = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=2, num_attention_heads=3,
               num_key_value_heads=1, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True)
LLAMA32 = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=1, head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=True,
               rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"})
# Qwen2.5-0.5B's, narrowed (hidden 1/7 of its 896, 2 heads of 64 sharing one kv head as its 14 share 2), its
# embedding padded past the tokenizer as Qwen2.5's is (151,936 rows for 151,665 tokens)
QWEN25 = dict(hidden_size=128, intermediate_size=704, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
              tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768, max_window_layers=24,
              vocab_size=151_936)
# TinyLlama-1.1B's (untied, theta 10000, 32 heads of 64 sharing 4 kv heads), narrowed: 8 heads sharing 1
TINYLLAMA = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=1, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False)
# Mistral-7B-v0.1's (head 128, untied, sliding window 4096 under a context of 32768, which the import clamps
# to the window), narrowed: 2 heads of 128 sharing 1
MISTRAL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=32768, sliding_window=4096, rope_theta=10000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=False, architecture="mistral")
PROMPTS = ["ROMEO: But soft, what light", "def f(x):\n\treturn x ** 2", "In 2024, 1234567 people",
           "日本語のテキスト", "it's THEY'RE we'd", "\n"]
NEW_TOKENS, MARGIN = 24, 1e-3
QUANT_TOLERANCE = 0.15  # llama.cpp rounds the activations to 8 bits in its quantized products: 0.07 measured
GGML_TYPE_F32 = 0
NAMES = ["smollm2", "llama3.2", "qwen2.5", "tinyllama", "mistral"]
LLAMA_CPP_FIM = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")


@pytest.fixture(scope="module")
def family_corpus():
    """(fuzzed texts, Shakespeare slices, Shakespeare): what test_tokenizer_families trains and compares on."""
    with open(SHAKESPEARE, encoding="utf-8") as f:
        text = f.read(200_000)
    lines = text.splitlines(keepends=True)
    return fuzz_texts(), ["".join(lines[i:i + 40]) for i in range(0, 4000, 40)], text


def smollm2_tokenizer(family_corpus):
    d = smollm_json(family_corpus)
    n = max(d["model"]["vocab"].values()) + 1
    for k, content in enumerate(["<|im_start|>", "<|im_end|>"]):  # SmolLM2's chat tokens, special
        d["model"]["vocab"][content] = n + k
        d["added_tokens"].append({"id": n + k, "content": content, "single_word": False, "lstrip": False,
                                  "rstrip": False, "normalized": False, "special": True})
    return d


def tinyllama_tokenizer(family_corpus):
    """Llama 2's SentencePiece-style layout (test_tokenizer_sentencepiece's), its merges every split of every
    token in the order of the token made, as the tokenizer.json of a SentencePiece model lists them (the
    `tokenizers` converter's): what llama.cpp's score-ordered joining reproduces."""
    fuzz, _, text = family_corpus
    d = llama2_layout(trained((fuzz + EDGES, text[:100_000])))
    vocab = d["model"]["vocab"]
    added = {t["content"] for t in d["added_tokens"]}
    merges = []
    for name, i in sorted(vocab.items(), key=lambda kv: kv[1]):
        if name in added or name.startswith("<0x"):
            continue
        splits = [(name[:k], name[k:]) for k in range(1, len(name)) if name[:k] in vocab and name[k:] in vocab]
        merges += sorted(splits, key=lambda ab: (vocab[ab[0]], vocab[ab[1]]))
    d["model"]["merges"] = [list(m) for m in merges]
    return d


def save_hf(folder, torch, transformers, tokenizer, config, tokenizer_config):
    """A random LlamaForCausalLM of `config` (weights N(0, 0.5), norm gains N(1, 0.5)) saved with the
    tokenizer.json dict and tokenizer_config.json given; a Qwen2ForCausalLM (q/k/v biases N(0, 0.5)) where the
    config has a vocab_size, its rows past the tokenizer zero (never chosen: they stand for Qwen's untrained
    padding, which llama.cpp, unlike our decoding, does not mask); a MistralForCausalLM where it says so."""
    folder.mkdir()
    n_tokens = max(max(tokenizer["model"]["vocab"].values()), max(t["id"] for t in tokenizer["added_tokens"])) + 1
    torch.manual_seed(0)
    config = dict(config)
    if config.pop("architecture", None) == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(vocab_size=n_tokens, **config)).eval()
    elif "vocab_size" in config:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config)).eval()
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=n_tokens, **config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape) * 0.5 + (1.0 if name.endswith("norm.weight") else 0.0))
        model.get_input_embeddings().weight[n_tokens:] = 0
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")


@pytest.fixture(scope="module")
def models(family_corpus, torch, transformers, tmp_path_factory):
    """{name: (checkpoint, f32 GGUF, texts to tokenize)} of the two imports."""
    d = tmp_path_factory.mktemp("gguf_llamacpp")
    llama3, words = llama3_json(family_corpus)
    fuzz, slices, _ = family_corpus
    specials = "<|eot_id|>hi<tool> x <|reserved_special_token_7|>\n<|end_of_text|>"
    sources = {
        "smollm2": (smollm2_tokenizer(family_corpus), SMOLLM2,
                    {"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "chat_template": SMOL_TEMPLATE},
                    fuzz + slices + ["Nbsp\u00a0here", "a\x7fb \x0bx\x0cy", "x\u00a0\u00a0y 12\u00a0345",
                                     "<|im_start|>user\nhi<|im_end|>"]),
        "llama3.2": (llama3, LLAMA32, {"eos_token": "<|end_of_text|>", "bos_token": "<|begin_of_text|>"},
                     fuzz + slices + [" ".join(words[::7]), specials, "it's IT'S it'Ll x'RE 'VE 'd 'M 'T"]),
        "qwen2.5": (qwen2_json(family_corpus), QWEN25, {"eos_token": "<|endoftext|>", "bos_token": None},
                    fuzz + slices + ["e\u0301t\u00e9 caf\u0065\u0301 A\u030a \u1100\u1161\u11a8 \u2126",
                                     "<|im_start|>user\nhi<|im_end|>\n", "In 2024, 1234567 people",
                                     "<tool_call>{\"a\": 1}</tool_call><|fim_prefix|>x<|endoftext|>"]),
        "tinyllama": (tinyllama_tokenizer(family_corpus), TINYLLAMA, {"eos_token": "</s>", "bos_token": "<s>"},
                      fuzz + slices + EDGES),
        "mistral": (tinyllama_tokenizer(family_corpus), MISTRAL, {"eos_token": "</s>", "bos_token": "<s>"},
                    fuzz[:40] + EDGES),
    }
    out = {}
    for name, (tokenizer, config, tokenizer_config, texts) in sources.items():
        save_hf(d / name, torch, transformers, tokenizer, config, tokenizer_config)
        r = run_cli("import", "--hf", d / name, "--out", d / f"{name}.bin")
        assert r.returncode == 0, r.stderr
        r = run_cli("export", "--gguf", d / f"{name}.gguf", "--ckpt", d / f"{name}.bin", "--type", "f32")
        assert r.returncode == 0, r.stderr
        out[name] = (d / f"{name}.bin", d / f"{name}.gguf", texts)
    return out


def fields_of(path):
    return {name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()}


@pytest.mark.parametrize("name", NAMES)
def test_gguf_keys_are_llama_cpps_for_the_family(models, name):
    """What convert_hf_to_gguf.py writes for these tokenizers, read back with the gguf package (no llama.cpp)."""
    ckpt, path, _ = models[name]
    ck = checkpoint.load(ckpt)
    tok, fields = ck.tokenizer(), fields_of(path)
    tensors = {t.name for t in gguf.GGUFReader(path).tensors}
    untied = name in ("tinyllama", "mistral")
    assert ck.cfg.tied == (not untied) and ("output.weight" in tensors) == untied
    types = fields["tokenizer.ggml.token_type"]
    assert fields["tokenizer.ggml.eos_token_id"] == tok.eos_id
    unk = tok.special_tokens.get("<unk>")
    assert all(types[i] == (4 if s in tok.nonspecial else 2 if i == unk else 3) for s, i in tok.special_tokens.items())
    assert fields["general.architecture"] == ("qwen2" if name == "qwen2.5" else "llama")
    if name == "mistral":  # head 128, the context clamped to the window, llama.cpp's `llama` architecture
        assert ck.cfg.head_dim == 128 and ck.cfg.context == ck.cfg.sliding_window == 4096
        assert fields["llama.context_length"] == 4096 and fields["llama.rope.dimension_count"] == 128
        assert fields["tokenizer.ggml.model"] == "llama"
    elif name == "tinyllama":  # llama.cpp's SentencePiece tokenizer, as its converter writes Llama 2's
        assert fields["tokenizer.ggml.model"] == "llama" and "tokenizer.ggml.merges" not in fields
        assert fields["tokenizer.ggml.add_bos_token"] is True and fields["tokenizer.ggml.bos_token_id"] == tok.bos_id
        assert fields["tokenizer.ggml.add_space_prefix"] is True and fields["tokenizer.ggml.unknown_token_id"] == unk
        tokens, scores = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.scores"]
        assert len(tokens) == len(scores) == tok.vocab_size and tokens[tok.bos_id] == "<s>"
        assert [types[tokens.index(f"<0x{b:02X}>")] for b in range(256)] == [6] * 256
        ranks = {a + b: r for r, (a, b) in reversed(list(enumerate(tok._merge_names)))}
        assert all(scores[tokens.index(t)] == -r for t, r in ranks.items())
    elif name == "qwen2.5":
        cfg = ck.cfg
        assert {k: fields[k] for k in fields if k.startswith("qwen2.")} == {
            "qwen2.context_length": cfg.context, "qwen2.embedding_length": 128, "qwen2.block_count": 2,
            "qwen2.feed_forward_length": 704, "qwen2.attention.head_count": 2, "qwen2.attention.head_count_kv": 1,
            "qwen2.rope.dimension_count": 64, "qwen2.rope.freq_base": 1000000.0,
            "qwen2.attention.layer_norm_rms_epsilon": pytest.approx(1e-6), "qwen2.vocab_size": 151_936}
        assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "qwen2"
        assert fields["tokenizer.ggml.add_bos_token"] is False and tok.bos_id is None
        tokens = fields["tokenizer.ggml.tokens"]
        assert len(tokens) == 151_936 and tok.vocab_size == cfg.tokenizer_vocab == 151_665
        assert tokens[151_665:] == [f"[PAD{i}]" for i in range(151_665, 151_936)] and set(types[151_665:]) == {5}
        assert types[tok.special_tokens["<tool_call>"]] == 4 and types[tok.special_tokens["<|im_end|>"]] == 3
        names = {t.name for t in gguf.GGUFReader(path).tensors}
        assert {f"blk.{i}.attn_{x}.bias" for i in (0, 1) for x in "qkv"} <= names
        # every tensor as the checkpoint has it: no Q/K row permutation for qwen2's NeoX RoPE
        from nanoeuler.io.gguf import read_params
        assert np.array_equal(read_params(path, cfg, ck.params), ck.params)
        from nanoeuler.model.config import views
        v = views(ck.params, cfg)
        wq = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
        assert np.array_equal(np.asarray(wq.data).reshape(v["layers.0.wq"].shape), v["layers.0.wq"])
    elif name == "smollm2":
        assert fields["tokenizer.ggml.pre"] == "smollm" and tok.rule == "gpt2_digits"
        assert fields["tokenizer.ggml.add_bos_token"] is False and tok.bos_id is None
        assert fields["tokenizer.chat_template"] == SMOL_TEMPLATE
        assert len(fields["tokenizer.ggml.tokens"]) == tok.vocab_size == 1181  # 1,200 less 21 bytes, 2 chat tokens
    else:
        assert fields["tokenizer.ggml.pre"] == "llama-bpe" and tok.rule == "llama3" and tok.ignore_merges
        assert fields["tokenizer.ggml.add_bos_token"] is True
        assert fields["tokenizer.ggml.bos_token_id"] == tok.bos_id == tok.special_tokens["<|begin_of_text|>"]
        assert types[tok.special_tokens["<tool>"]] == 4 and tok.vocab_size > 65_536
        assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(path).tensors}


# ------------------------------------------------------------------------------------ llama.cpp itself
@pytest.fixture(scope="module")
def llama_cpp():
    """llama_cpp, from this Python or from the site-packages NANOEULER_LLAMA_CPP_SITE names (appended to
    sys.path, so that nanoeuler's NumPy stays the one imported)."""
    site = os.environ.get("NANOEULER_LLAMA_CPP_SITE")
    if site and site not in sys.path:
        sys.path.append(site)
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (docs/gguf.md: its own "
                               "virtualenv, then NANOEULER_LLAMA_CPP_SITE=its site-packages)")


def ids_both_ways(tok, llm, text):
    """(ours, llama.cpp's): with the BOS the tokenizer adds (llama.cpp's add_bos adds the one the file says to
    add) and without, plain text and with special tokens parsed."""
    data = text.encode()
    return ([tok.encode(text), tok.encode(text, add_bos=False), tok.encode(text, allow_special=True)],
            [llm.tokenize(data, add_bos=True, special=False), llm.tokenize(data, add_bos=False, special=False),
             llm.tokenize(data, add_bos=True, special=True)])


def without_known_difference(name, text):
    """The text less what llama.cpp's tokenizer does otherwise than `tokenizers`: SmolLM2's missing bytes (its
    BPE keeps a missing byte's symbol through the merges, dropping it after, so its neighbours do not merge;
    `tokenizers` drops it first); Qwen2.5's NFC normalizer, which llama.cpp does not apply (equal on the text in
    NFC), and its non-special FIM tokens, which llama.cpp makes control tokens whatever the file says. Llama 3's
    structure showed no difference."""
    if name == "smollm2":
        return "".join(c for c in text if not set(c.encode()) & set(MISSING))
    if name == "qwen2.5":  # llama.cpp does not apply the tokenizer's NFC normalizer, and makes Qwen's FIM tokens
        for t in LLAMA_CPP_FIM:  # control tokens (src/llama-vocab.cpp), found only with special tokens parsed
            text = text.replace(t, "")
        return unicodedata.normalize("NFC", text)
    return text


@pytest.mark.llamacpp
@pytest.mark.parametrize("name", NAMES)
def test_llama_cpp_gives_our_token_ids(llama_cpp, models, name):
    """llama.cpp's tokenize gives our ids on every text, or on a text llama.cpp tokenizes otherwise than
    `tokenizers` (without_known_difference), on it less that difference."""
    ckpt, path, texts = models[name]
    tok = checkpoint.load(ckpt).tokenizer()
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    same, apart = 0, 0
    for t in texts:
        ours, theirs = ids_both_ways(tok, llm, t)
        if ours == theirs:
            same += 1
            continue
        plain = without_known_difference(name, t)
        assert plain != t, (t, ours, theirs)
        ours, theirs = ids_both_ways(tok, llm, plain)
        assert ours == theirs, (plain, ours, theirs)
        apart += 1
    print(f"{name}: llama.cpp {llama_cpp.__version__} gives our ids on {same} of {len(texts)} texts, and on the "
          f"other {apart} less what it splits otherwise than `tokenizers`")
    llm.close()


def top2_margins(eng, ids):
    """Per position of ids, our head-0 logit gap between the best token and the next."""
    logits = eng.logits(np.array([ids], np.int32))[0]
    top = np.sort(logits, axis=-1)[:, -2:]
    return top[:, 1] - top[:, 0]


@pytest.mark.llamacpp
@pytest.mark.parametrize("name", NAMES)
def test_llama_cpp_greedy_text_is_ours(llama_cpp, models, name):
    """llama.cpp's greedy sampler (temperature 0, top_k 1, seed 0) on the f32 GGUF continues each prompt with
    the ids of `nanoeuler infer --temperature 0` (generate on the CPU engine), and its text is ours; the first
    prompt through the command itself."""
    ckpt, path, _ = models[name]
    eng, tok, _ = load_model(str(ckpt), "cpu")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, seed=0, verbose=False, n_threads=2,
                          type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
    equal, smallest = 0, np.inf
    for k, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt)
        assert ids == llm.tokenize(prompt.encode(), add_bos=True)
        ours = list(generate(eng, ids, NEW_TOKENS, temperature=0))
        theirs = []
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            theirs.append(token)
            if len(theirs) == NEW_TOKENS:
                break
        margins = top2_margins(eng, ids + ours)[len(ids) - 1:]
        smallest = min(smallest, float(margins.min()))
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        assert first is None or margins[first] < MARGIN, (prompt, first, ours, theirs)
        equal += first is None
        assert llm.detokenize(theirs, special=True) == tok.decode(theirs)
        if k == 0:  # the command: the prompt, then the text up to an end id
            r = run_cli("infer", prompt, "--ckpt", ckpt, "--temperature", 0, "--max-new-tokens", NEW_TOKENS,
                        "--device", "cpu")
            assert r.returncode == 0, r.stderr
            end = next((i for i, t in enumerate(theirs) if t in tok.end_ids), len(theirs))
            assert r.stdout == prompt + tok.decode(theirs[:end]).decode("utf-8", "replace") + "\n"
    print(f"{name}: llama.cpp's greedy continuation is ours on {equal} of {len(PROMPTS)} prompts "
          f"({NEW_TOKENS} tokens; smallest top-2 logit gap {smallest:.3g})")
    assert equal == len(PROMPTS)
    llm.close()


@pytest.mark.llamacpp
@pytest.mark.parametrize("kind, head", [("int8", "int8"), ("int4", "int8"), ("int4", "int4")])
def test_llama_cpp_runs_a_quantized_export(llama_cpp, tokenizer, tmp_path, kind, head):
    """`quantize --type int8|int4 --head-type int8|int4` then `export --gguf` (the Q8_0 / Q4_1 blocks copied,
    each tensor in its type: int4 layers with a Q8_0 output, the default, or a Q4_1 one): llama.cpp loads the
    file, and its logits at every position of a prompt and our greedy continuation of it are those of our CPU
    engine on the quantized checkpoint but for its rounding of the activations to 8 bits in its quantized dot
    products (median 0.03, largest 0.07 of the logits' norm on these random weights, the same argmax at 95% of
    the positions; a block misread would be off by the logits' own size): the f32 export of the same values,
    dequantized, gives our logits to float32 rounding. docs/quantization.md compares the bits per byte and the
    greedy text on a trained model, where that rounding moves the bits per byte by less than 0.01%."""
    from conftest import sharp_params
    from nanoeuler.model.config import Config, float_params
    cfg = Config(dim=64, n_heads=4, n_kv_heads=2, n_layers=2, hidden=96, context=64, mtp_heads=1,
                 vocab_size=tokenizer.vocab_size)
    ckpt, q, deq = tmp_path / "f.bin", tmp_path / "q.bin", tmp_path / "deq.bin"
    checkpoint.save(ckpt, cfg, sharp_params(cfg, 1, 0.2), tokenizer.to_json(), step=1)
    assert run_cli("quantize", "--ckpt", ckpt, "--out", q, "--type", kind, "--head-type", head).returncode == 0
    ck = checkpoint.load(q)
    checkpoint.save(deq, *float_params(ck.cfg, ck.params, ck.quantized), ck.tokenizer_json, step=1)
    for c in (q, deq):
        assert run_cli("export", "--gguf", c.with_suffix(".gguf"), "--ckpt", c, "--type", "f32").returncode == 0
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(q.with_suffix(".gguf")).tensors}
    gguf_type = {"int8": "Q8_0", "int4": "Q4_1"}
    assert types["blk.0.ffn_down.weight"] == gguf_type[kind] and types["output.weight"] == gguf_type[head]
    eng, tok, _ = load_model(str(q), "cpu")
    runs = {}
    for c in (q, deq):
        llm = llama_cpp.Llama(model_path=str(c.with_suffix(".gguf")), n_ctx=64, n_batch=64, logits_all=True,
                              verbose=False, n_threads=2, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
        errors, same = [], 0
        for prompt in PROMPTS[:4]:
            ids = tok.encode(prompt)
            ids += list(generate(eng, ids, NEW_TOKENS, temperature=0))
            llm.reset()
            llm.eval(ids)
            theirs = np.array(llm.scores[:len(ids), :cfg.vocab_size])
            ours = eng.logits(np.array([ids], np.int32))[0]
            errors += list(np.linalg.norm(theirs - ours, axis=-1) / np.linalg.norm(ours, axis=-1))
            same += int((theirs.argmax(-1) == ours.argmax(-1)).sum())
        llm.close()
        runs[c.stem] = float(max(errors)), float(np.median(errors)), same, len(errors)
    said = {k: "within {:.2g} (median {:.2g}), the same argmax at {}/{} positions".format(*v) for k, v in runs.items()}
    print(f"{kind}, head {head}: llama.cpp's logits against ours (relative, L2): the quantized file {said['q']}; the f32 file of "
          f"its dequantized values {said['deq']}")
    worst, _, same, n = runs["q"]
    assert worst < QUANT_TOLERANCE and same >= 0.9 * n
    assert runs["deq"][0] < 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_import_gguf_gives_back_the_import(models, name, tmp_path, transformers):
    """`import --gguf` of each family's GGUF: the imported checkpoint's tensors and config again (Mistral's
    sliding window aside: GGUF's `llama` has none, and llama.cpp attends to the whole context), its tokenizer
    rebuilt from the metadata giving the tokenizer.json's ids on every text (the SentencePiece merges derived
    from the scores), its BOS, end and chat template. transformers' own GGUF tokenizer gives them for Llama 3's;
    for the others its converter departs from the tokenizer.json (docs/import.md)."""
    ckpt, path, texts = models[name]
    out = tmp_path / "back.bin"
    r = run_cli("import", "--gguf", path, "--out", out)
    assert r.returncode == 0, r.stderr
    a, b = checkpoint.load(ckpt), checkpoint.load(out)
    assert np.array_equal(a.params, b.params)
    changed = {k for k in a.cfg.__dataclass_fields__ if getattr(a.cfg, k) != getattr(b.cfg, k)}
    assert changed == ({"sliding_window", "architecture"} if name == "mistral" else set()), changed
    ta, tb = a.tokenizer(), b.tokenizer()
    assert type(ta) is type(tb) and (ta.eos_id, ta.bos_id, ta.chat_template) == (tb.eos_id, tb.bos_id, tb.chat_template)
    for text in texts:
        for allow in (False, True):
            assert list(tb.encode(text, allow_special=allow)) == list(ta.encode(text, allow_special=allow)), text
    if name == "llama3.2":
        theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        for text in texts[:60]:
            assert theirs(text)["input_ids"] == list(tb.encode(text)), text
