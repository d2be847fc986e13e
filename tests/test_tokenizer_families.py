"""The tokenizer.json structures of published model families load into our tokenizer and give the ids of the
`tokenizers` library (used here only, never at run time), on a fuzzed corpus and on shakespeare.txt:

- GPT-2's ByteLevel (ours);
- SmolLM/SmolLM2's Sequence[Digits(individual_digits), ByteLevel], with 21 of the 256 byte tokens missing;
- Llama 3's Sequence[Split(its regex), ByteLevel(use_regex=false)] with ignore_merges, merges that use
  tokens made by later merges, more than 65,536 tokens, a BOS from a TemplateProcessing post-processor,
  special and non-special added tokens;
- Qwen2.5's NFC normalizer and Sequence[Split(its regex: digits one by one), ByteLevel(use_regex=false)],
  its 151,643 ordinary tokens and 22 added ones (special and not), no BOS.

Each tokenizer is trained with `tokenizers`' BpeTrainer in that structure, then edited into its exact form.
"""
import json
import os
import random

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from nanoeuler.tokenizer.bpe import LLAMA3_REGEX, QWEN2_REGEX, Tokenizer, read_token_file  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAKESPEARE = os.path.join(ROOT, "shakespeare.txt")
# bytes SmolLM2's vocabulary lacks are the never-valid UTF-8 ones; here also some that text does contain
# (DEL, VT, FF, ESC, the continuation bytes 0x80 and 0xA0, the latter in NBSP), so that their neighbours merge
MISSING = [0xC0, 0xC1, *range(0xF5, 0x100), 0x7F, 0x0B, 0x0C, 0x1B, 0x80, 0xA0, 0x01, 0x02]
assert len(MISSING) == 21


def fuzz_texts(n=120, seed=0):
    """Texts mixing code, digits, CJK, emoji, CRLF, tabs, NBSP, contractions in any case, it'ſ, long numbers,
    lone control characters and random bytes decoded as UTF-8 with replacement."""
    rng = random.Random(seed)
    parts = ["def f(x):\n\treturn x ** 2  # square\r\n", "for (int i = 0; i < 10; ++i) { a[i] = i; }\n",
             "12345678901234567890", " 3.14159", "2024-01-02T03:04:05Z", "日本語のテキスト、中文字符。", "한국어 ",
             "😀👍🏽 🇫🇷", "\r\n\r\n", "\t\t", "\u00a0non-breaking\u00a0space", "it'ſ", "IT'S", "We'RE", "they'Ll",
             "you'VE", "I'm", "he'd", "don't", " '", "''", "Ünïcödé wörds", "  multiple   spaces  ", "\n\n\n",
             "x\u2028y\u2029z", "\u000b\u000c\u001b\u007f", " 1 22 333 4444", "a1b2c3", "Hello, World!", "?!...",
             " \n \n", "\u3000全角", "Ελληνικά", "русский текст", "مرحبا", "\u0300\u0301 combining", "<|tag|>",
             "e\u0301", "$100.00", "100,000", "٣٤٥", "Ⅻ", "½", "\x85next line"]
    texts = []
    for _ in range(n):
        k = rng.randint(1, 8)
        chunk = [rng.choice(parts) for _ in range(k)]
        if rng.random() < 0.3:
            chunk.append(bytes(rng.randrange(256) for _ in range(rng.randint(1, 24))).decode("utf-8", "replace"))
        if rng.random() < 0.2:
            chunk.append(str(rng.randrange(10 ** 30)))
        texts.append("".join(chunk))
    return texts


@pytest.fixture(scope="module")
def corpus():
    with open(SHAKESPEARE, encoding="utf-8") as f:
        text = f.read(200_000)
    lines = text.splitlines(keepends=True)
    slices = ["".join(lines[i:i + 40]) for i in range(0, 4000, 40)]
    return fuzz_texts(), slices, text


def train(pre, corpus, vocab_size=1200, normalizer=None):
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, trainers
    fuzz, _, text = corpus
    hf = HF(models.BPE())
    hf.pre_tokenizer = pre
    hf.normalizer = normalizer
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator([text] + fuzz * 3, trainer)
    return json.loads(hf.to_str())


def merge_names(d):
    return [m.split(" ") if isinstance(m, str) else m for m in d["model"]["merges"]]


def renumber(d, order):
    """Give the vocabulary names in `order` the ids 0.. (added tokens keep their place by name)."""
    vocab = {name: i for i, name in enumerate(order)}
    d["model"]["vocab"] = vocab
    for t in d["added_tokens"]:
        t["id"] = vocab[t["content"]]
    return d


def smollm_json(corpus):
    from tokenizers import pre_tokenizers
    pre = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    d = train(pre, corpus)
    from nanoeuler.tokenizer.bpe import bytes_to_unicode
    b2u = bytes_to_unicode()
    gone = {b2u[b] for b in MISSING}
    merges = [m for m in merge_names(d) if m[0] not in gone and m[1] not in gone]
    d["model"]["merges"] = merges
    order = [name for name, _ in sorted(d["model"]["vocab"].items(), key=lambda kv: kv[1]) if name not in gone]
    return renumber(d, order)


def llama3_json(corpus):
    from tokenizers import Regex, pre_tokenizers
    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    d = train(pre, corpus, vocab_size=1500)
    merges = merge_names(d)
    # move merges that use a token to before the merge that makes it (Llama 3's merge 1 is "Ġ ĠĠĠ")
    maker = {a + b: r for r, (a, b) in enumerate(merges)}
    moved = [r for r, (a, b) in enumerate(merges) if maker.get(b, -1) > 50 and r > maker[b]][:40]
    merges = [merges[r] for r in moved] + [m for r, m in enumerate(merges) if r not in set(moved)]
    assert any(maker.get(b, -1) > 0 for a, b in merges[:len(moved)])
    d["model"]["merges"] = merges
    d["model"]["ignore_merges"] = True
    vocab = d["model"]["vocab"]
    order = [name for name, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    # whole words that the merges split: with ignore_merges each is one token
    from nanoeuler.tokenizer.bpe import bytes_to_unicode
    b2u = bytes_to_unicode()
    rng = random.Random(1)
    words = sorted({w for w in corpus[2].split() if len(w) > 6 and w.isalpha()})
    whole = ["".join(b2u[b] for b in (" " + w).encode()) for w in words[:300]]
    pad = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(9)) for _ in range(66_000)]
    order += [w for w in dict.fromkeys(pad + whole) if w not in vocab]
    added = [("<|begin_of_text|>", True), ("<|end_of_text|>", True), ("<|eot_id|>", True), ("<tool>", False)]
    added += [(f"<|reserved_special_token_{k}|>", True) for k in range(200)]
    d["added_tokens"] = [{"id": 0, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": not special, "special": special} for c, special in added]
    order = [name for name in order if name != "<|endoftext|>"] + [c for c, _ in added]
    d = renumber(d, order)
    for c, _ in added:  # as in Llama 3's file: added tokens are not in the model's vocabulary
        del d["model"]["vocab"][c]
    bos = d["model"]["vocab"].get("<|begin_of_text|>") or next(t["id"] for t in d["added_tokens"]
                                                               if t["content"] == "<|begin_of_text|>")
    d["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [bos],
                                                  "tokens": ["<|begin_of_text|>"]}}}]}
    return d, words[:300]


QWEN_ADDED = [(c, True) for c in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                                   "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                                   "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                                   "<|image_pad|>", "<|video_pad|>")]
QWEN_ADDED += [(c, False) for c in ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
                                    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")]


def qwen2_json(corpus):
    """Qwen2.5's tokenizer.json structure, its vocabulary padded to Qwen's 151,643 ordinary tokens."""
    from tokenizers import Regex, normalizers, pre_tokenizers
    from nanoeuler.tokenizer.bpe import bytes_to_unicode
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
                                   byte_level])
    d = train(pre, corpus, vocab_size=1500, normalizer=normalizers.NFC())
    vocab = d["model"]["vocab"]
    order = [name for name, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if name != "<|endoftext|>"]
    b2u = bytes_to_unicode()
    order += ["".join(b2u[b] for b in f"\x01{k}".encode()) for k in range(151_643 - len(order))]  # never in text
    assert len(order) == 151_643
    d["model"]["vocab"] = {name: i for i, name in enumerate(order)}
    d["model"].update(continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    d["added_tokens"] = [{"id": 151_643 + k, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": special} for k, (c, special) in enumerate(QWEN_ADDED)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    d["normalizer"] = {"type": "NFC"}
    d["post_processor"] = byte_level
    d["decoder"] = byte_level
    return d


def gpt2_json(corpus):
    from tokenizers import pre_tokenizers
    return train(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), corpus)


def compare(d, tmp_path, texts, name, eos=None):
    """(texts, texts with equal ids, ours, hf, our ids)."""
    from tokenizers import Tokenizer as HF
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(d, ensure_ascii=False), encoding="utf-8")
    hf = HF.from_file(str(path))
    ours = Tokenizer.load(path, eos=eos)
    equal = 0
    all_ids = []
    for t in texts:
        ids = ours.encode(t, allow_special=True)
        all_ids.append(ids)
        equal += ids == hf.encode(t).ids
    print(f"{name}: {equal} of {len(texts)} texts give the ids of `tokenizers`")
    return len(texts), equal, ours, hf, all_ids


def test_gpt2_rule(corpus, tmp_path):
    fuzz, slices, _ = corpus
    d = gpt2_json(corpus)
    n, equal, ours, _, all_ids = compare(d, tmp_path, fuzz + slices, "gpt2", eos="<|endoftext|>")
    assert equal == n and ours.rule == "gpt2"
    assert '"version":3' not in ours.to_json()  # a GPT-2 file loads as the merges-only form, as before
    for t, ids in zip(fuzz + slices, all_ids):
        assert ours.decode(ids) == t.encode()


def test_smollm_digits_and_missing_bytes(corpus, tmp_path):
    fuzz, slices, _ = corpus
    d = smollm_json(corpus)
    texts = fuzz + slices + ["Nbsp\u00a0here", "a\x7fb \x0bx\x0cy", "x\u00a0\u00a0y 12\u00a0345"]
    n, equal, ours, hf, all_ids = compare(d, tmp_path, texts, "smollm", eos="<|endoftext|>")
    assert equal == n and ours.rule == "gpt2_digits"
    assert ours.encode(" 2024") == hf.encode(" 2024").ids and len(ours.encode("2024")) == 4
    missing = set(MISSING)
    for t, ids in zip(texts, all_ids):  # a byte without a token is dropped; the rest round-trips
        assert ours.decode(ids) == bytes(b for b in t.encode() if b not in missing)
    check_saved(ours, hf, texts, tmp_path, "smollm")


def test_llama3_rule_ignore_merges_forward_merges_bos_big_vocab(corpus, tmp_path):
    fuzz, slices, _ = corpus
    d, words = llama3_json(corpus)
    specials = "<|eot_id|>hi<tool> x <|reserved_special_token_7|>\n<|end_of_text|>"
    texts = fuzz + slices + [" ".join(words[::7]), specials, "it'ſ IT'S it'Ll x'RE 'VE 'd 'M 'T"]
    n, equal, ours, hf, all_ids = compare(d, tmp_path, texts, "llama3", eos="<|end_of_text|>")
    assert equal == n and ours.rule == "llama3" and ours.ignore_merges
    assert ours.vocab_size > 65_536 and max(max(ids) for ids in all_ids) > 65_536
    bos = ours.special_tokens["<|begin_of_text|>"]
    assert ours.bos_id == bos and all(ids[0] == bos for ids in all_ids)
    assert ours.encode("hi", add_bos=False) == hf.encode("hi", add_special_tokens=False).ids
    assert ours.encode("<tool>")[1:] == [ours.special_tokens["<tool>"]]  # non-special: found in any text
    assert ours.encode("<|eot_id|>")[1:] != [ours.special_tokens["<|eot_id|>"]]  # special: only when allowed
    for t, ids in zip(texts, all_ids):
        assert ours.decode(ids[1:]) == t.encode()
    check_saved(ours, hf, texts, tmp_path, "llama3")
    # a token file of this vocabulary holds uint32 tokens
    src = tmp_path / "text.txt"
    src.write_text("".join(texts), encoding="utf-8")
    count = ours.encode_file(src, tmp_path / "text.tok", progress=False, chunk_bytes=1000)
    tokens = read_token_file(tmp_path / "text.tok", source=src, tok=ours)
    assert tokens.dtype == np.dtype("<u4") and count == len(tokens)
    assert tokens.tolist() == ours.encode("".join(texts), add_bos=False)


def check_saved(ours, hf, texts, tmp_path, name):
    """Our JSON keeps the rule; our tokenizer.json export loads in `tokenizers` with the same ids."""
    from tokenizers import Tokenizer as HF
    again = Tokenizer.from_json(ours.to_json())
    assert again.to_json() == ours.to_json() and again.rule == ours.rule
    ours.save_hf(tmp_path / f"{name}.export.json")
    exported = HF.from_file(str(tmp_path / f"{name}.export.json"))
    reloaded = Tokenizer.load(tmp_path / f"{name}.export.json", eos=ours.eos)
    assert reloaded.to_json() == ours.to_json()
    for t in texts:
        ids = again.encode(t, allow_special=True)
        assert ids == exported.encode(t).ids == hf.encode(t).ids


def test_qwen2_nfc_nonspecial_added_big_vocab(corpus, tmp_path):
    fuzz, slices, _ = corpus
    d = qwen2_json(corpus)
    extra = ["e\u0301t\u00e9 caf\u0065\u0301 A\u030a \u1100\u1161\u11a8 \u2126", "<|im_start|>user\nhi<|im_end|>\n",
             "<tool_call>{\"a\": 1}</tool_call><|fim_prefix|>x<|endoftext|>", "<|im_end|>\u0338 >\u0338 12345"]
    texts = fuzz + slices[:30] + extra
    n, equal, ours, hf, all_ids = compare(d, tmp_path, texts, "qwen2", eos="<|endoftext|>")
    assert equal == n and ours.rule == "qwen2" and ours.normalizer == "nfc" and ours.bos_id is None
    assert ours.vocab_size == 151_665 and ours.token_dtype == np.dtype("<u4")
    assert len(ours.encode("2024")) == 4 and ours.encode("e\u0301") == ours.encode("\u00e9")
    assert ours.encode("<tool_call>") == [ours.special_tokens["<tool_call>"]]  # non-special: in any text
    assert ours.encode("<|im_end|>") != [ours.special_tokens["<|im_end|>"]]  # special: only when allowed
    import unicodedata
    for t, ids in zip(texts, all_ids):  # the text between added tokens comes back in NFC
        assert ours.decode(ids) == unicodedata.normalize("NFC", t).encode() or "\u0338" in t
    # kept in our JSON and exported (the lighter form of check_saved, for the size of the vocabulary)
    from tokenizers import Tokenizer as HF
    again = Tokenizer.from_json(ours.to_json())
    assert again.normalizer == "nfc" and again.rule == "qwen2"
    ours.save_hf(tmp_path / "qwen2.export.json")
    exported = HF.from_file(str(tmp_path / "qwen2.export.json"))
    for t, ids in zip(texts, all_ids):
        assert again.encode(t, allow_special=True) == exported.encode(t).ids == ids
    # a token file: uint32 tokens; streamed in chunks (NFC at the chunk edges) it gives encode's ids
    src = tmp_path / "text.txt"
    whole = "".join(texts)
    src.write_text(whole, encoding="utf-8")
    count = ours.encode_file(src, tmp_path / "text.tok", progress=False, chunk_bytes=1000)
    tokens = read_token_file(tmp_path / "text.tok", source=src, tok=ours)
    assert tokens.dtype == np.dtype("<u4") and count == len(tokens)
    assert tokens.tolist() == ours.encode(whole) and max(tokens) > 65_536
