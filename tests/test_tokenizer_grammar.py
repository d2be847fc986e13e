"""Any BPE tokenizer.json, read part by part (nanoeuler/tokenizer/grammar.py), against the `tokenizers` library:
property tests over generated files (normalizers, pre-tokenizers, BPE options, added-token flags,
post-processors and decoders combined at random, small vocabularies trained by `tokenizers`) and random text,
and the published structures that were once refused (GPT-2's file without a model type, Phi-3's added token
with rstrip, DeepSeek-LLM's Sequence of Splits, Digits and ByteLevel), built with `tokenizers`."""
import json
import os
import subprocess
import sys

import pytest

tokenizers = pytest.importorskip("tokenizers")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from nanoeuler.errors import UserError  # noqa: E402
from nanoeuler.tokenizer.bpe import LLAMA3_REGEX, QWEN2_REGEX, Tokenizer  # noqa: E402
from nanoeuler.tokenizer.grammar import GPT2_REGEX, GrammarBPE, onig_to_re  # noqa: E402
from nanoeuler.tokenizer.hf import from_hf  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPACE = "\u2581"
# Split regexes of published tokenizer.json files (GPT-2, Llama 3, Qwen2, DeepSeek-LLM's five in a simpler
# alphabet, GPT-4o's o200k, a few of BLOOM's and Falcon's) and simple ones
REGEXES = [
    GPT2_REGEX, LLAMA3_REGEX, QWEN2_REGEX,
    r"[\r\n]", "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u0370-\u03ff\u0400-\u04ff]+",
    r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r" ?[^(\s|[.,!?…。，、।۔،])]+", r"\p{N}", r"\s+", r"[\p{P}\p{S}]", r"\w+|[^\w\s]+", "a", " ",
]
CORPUS = ["Hello world! The quick brown fox jumps over the lazy dog 12345 times.",
          "Ünïcödé café naïve résumé — “quotes” and ‘apostrophes’ don't won't I'm we'll",
          "日本語のテキスト 中文文本 한국어 텍스트 Ελληνικά русский текст עברית العربية हिन्दी",
          "emoji 🎉🎉 🙂👍🏽 👨‍👩‍👧 x² ½ Ⅻ ٣ \t tabs\t\tand\n\nnewlines\r\n  spaces   ",
          "def f(x):\n    return x**2 + 3.14159  # code 0xFF <tag attr=\"v\">&amp;</tag>"]
SPECIALS = ["</s>", "<s>", "<|end|>", "<unk>"]
ADDED = ["<|user|>", "hello", " wor", "[MASK]", "ab", "\u00e9t\u00e9"]


def normalizers_():
    simple = st.sampled_from([
        None, {"type": "NFC"}, {"type": "NFD"}, {"type": "NFKC"}, {"type": "NFKD"}, {"type": "Lowercase"},
        {"type": "Strip", "strip_left": True, "strip_right": True},
        {"type": "Strip", "strip_left": False, "strip_right": True},
        {"type": "StripAccents"}, {"type": "Nmt"},
        {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
        {"type": "Replace", "pattern": {"Regex": r"\s+"}, "content": " "},
        {"type": "Prepend", "prepend": SPACE},
        {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True, "strip_accents": None,
         "lowercase": True},
        {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE},
                                             {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}]},
    ])
    return st.one_of(simple, st.lists(simple.filter(lambda n: n is not None), min_size=1, max_size=3).map(
        lambda ns: {"type": "Sequence", "normalizers": ns}))


BEHAVIORS = ["Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"]


def pre_tokenizers_():
    leaf = st.one_of(
        st.builds(lambda r, b, i: {"type": "Split", "pattern": {"Regex": r}, "behavior": b, "invert": i},
                  st.sampled_from(REGEXES), st.sampled_from(BEHAVIORS), st.booleans()),
        st.builds(lambda s, b: {"type": "Split", "pattern": {"String": s}, "behavior": b, "invert": False},
                  st.sampled_from([" ", "\n", "a", "é"]), st.sampled_from(BEHAVIORS)),
        st.builds(lambda d: {"type": "Digits", "individual_digits": d}, st.booleans()),
        st.builds(lambda s, sp: {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": s, "split": sp},
                  st.sampled_from(["always", "first", "never"]), st.booleans()),
        st.sampled_from([{"type": "Whitespace"}, {"type": "WhitespaceSplit"}, {"type": "BertPreTokenizer"},
                         {"type": "CharDelimiterSplit", "delimiter": " "}]),
        st.builds(lambda b: {"type": "Punctuation", "behavior": b}, st.sampled_from(BEHAVIORS)),
    )
    tree = st.recursive(leaf, lambda inner: st.lists(inner, min_size=1, max_size=3).map(
        lambda ps: {"type": "Sequence", "pretokenizers": ps}), max_leaves=4)
    return tree


def byte_level_(regex, prefix):
    return {"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": True, "use_regex": regex}


@st.composite
def tokenizer_jsons(draw):
    """(tokenizer.json text, what its decoder is) of a random structure with a trained vocabulary."""
    byte_level = draw(st.booleans())
    norm = draw(normalizers_())
    pre = draw(st.one_of(st.none(), pre_tokenizers_()))
    if byte_level:  # the byte-level families: ByteLevel last, its decoder
        last = byte_level_(draw(st.booleans()), draw(st.booleans()))
        pre = last if pre is None else {"type": "Sequence", "pretokenizers": [pre, last]}
        dec = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    else:
        dec = draw(st.sampled_from([
            None,
            {"type": "Metaspace", "replacement": SPACE,
             "prepend_scheme": draw(st.sampled_from(["always", "first", "never"])), "split": True},
            {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
                                              {"type": "ByteFallback"}, {"type": "Fuse"},
                                              {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},  # (Strip's stop panics
            # in `tokenizers` on an empty token)
            {"type": "Fuse"},
        ]))
    prefix = draw(st.sampled_from([None, None, "##"]))
    suffix = draw(st.sampled_from([None, None, "</w>"]))
    if suffix and dec is None:
        dec = {"type": "BPEDecoder", "suffix": suffix}
    options = {k: v for k, v in (("continuing_subword_prefix", prefix), ("end_of_word_suffix", suffix)) if v}
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(**options))
    d = json.loads(hf.to_str())
    d.update(normalizer=norm, pre_tokenizer=pre, decoder=dec)
    hf = tokenizers.Tokenizer.from_str(json.dumps(d))
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=draw(st.integers(120, 500)), special_tokens=SPECIALS, initial_alphabet=alphabet,
        show_progress=False, **options, **({"limit_alphabet": 40} if draw(st.booleans()) else {}))
    hf.train_from_iterator(CORPUS * 3, trainer)
    d = json.loads(hf.to_str())
    model = d["model"]
    vocab = model["vocab"]
    if not byte_level and draw(st.booleans()):
        model["byte_fallback"] = True
        for b in range(256):
            vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    if draw(st.booleans()):
        model["unk_token"], model["fuse_unk"] = "<unk>", draw(st.booleans())
    model["ignore_merges"] = draw(st.booleans())
    if draw(st.booleans()):  # the "left right" strings of older files
        model["merges"] = [" ".join(m) for m in model["merges"] if " " not in "".join(m)] if all(
            " " not in "".join(m) for m in model["merges"]) else model["merges"]
    for t in d["added_tokens"]:
        t.update(lstrip=draw(st.booleans()), rstrip=draw(st.booleans()), single_word=draw(st.booleans()),
                 normalized=draw(st.booleans()))
    for content in draw(st.lists(st.sampled_from(ADDED), unique=True, max_size=3)):
        d["added_tokens"].append({"id": len(vocab) + len(d["added_tokens"]), "content": content,
                                  "single_word": draw(st.booleans()), "lstrip": draw(st.booleans()),
                                  "rstrip": draw(st.booleans()), "normalized": draw(st.booleans()),
                                  "special": draw(st.booleans())})
    ids = {t["content"]: t["id"] for t in d["added_tokens"]}
    template = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                           {"SpecialToken": {"id": "</s>", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [ids["<s>"]], "tokens": ["<s>"]},
                                   "</s>": {"id": "</s>", "ids": [ids["</s>"]], "tokens": ["</s>"]}}}
    d["post_processor"] = draw(st.sampled_from([
        None, template, {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {"type": "RobertaProcessing", "sep": ["</s>", ids["</s>"]], "cls": ["<s>", ids["<s>"]], "trim_offsets": True,
         "add_prefix_space": False},
        {"type": "BertProcessing", "sep": ["</s>", ids["</s>"]], "cls": ["<s>", ids["<s>"]]},
        {"type": "Sequence", "processors": [{"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                                             "use_regex": True}, template]},
    ]))
    if draw(st.booleans()):
        del model["type"]
    return json.dumps(d, ensure_ascii=False)


FRAGMENTS = st.one_of(
    st.text(st.characters(categories=["Lu", "Ll", "Lo", "Mn", "Nd", "No", "Po", "Ps", "Sm", "So", "Zs", "Cc"]),
            max_size=6),
    st.sampled_from(["🎉", "👍🏽", "👨‍👩‍👧", "e\u0301", "\u0301", "  ", "\t\t", "\n\n", "\r\n", " \n ", "123", "4567",
                     "x²", "Ⅻ", "日本", "ﬁ", "İ", "Σ", "ß", *SPECIALS, *ADDED, "<|", "|>", "’s", "'ll", "A"]),
    st.sampled_from(CORPUS),
)
TEXTS = st.lists(FRAGMENTS, max_size=8).map("".join)
GRAMMAR = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                   suppress_health_check=list(HealthCheck))


def assert_agrees(hf_json, texts):
    """The grammar's ids and decoded text are those of `tokenizers` on every text, with special tokens and
    without, and so are those of the class the factory picks for the file (a fast path where one fits)."""
    hf = tokenizers.Tokenizer.from_str(hf_json)
    ours = GrammarBPE.from_hf(json.loads(hf_json), "tokenizer.json")
    picked = from_hf(json.loads(hf_json), "tokenizer.json", byte_level=Tokenizer)
    assert GrammarBPE.from_json(ours.to_json()).to_json() == ours.to_json()
    for text in texts:
        for special in (False, True):
            hf.encode_special_tokens = not special
            want = hf.encode(text, add_special_tokens=special).ids
            for tok in (ours, picked):
                assert tok.encode(text, allow_special=special, add_bos=special) == want, (type(tok), text, special)
            assert ours.decode(want, text_start=True).decode("utf-8", "replace") == hf.decode(
                want, skip_special_tokens=False), (text, want)
    return ours


@GRAMMAR
@given(tokenizer_jsons(), st.lists(TEXTS, min_size=1, max_size=6))
def test_every_generated_tokenizer_json_encodes_and_decodes_as_tokenizers_does(hf_json, texts):
    assert_agrees(hf_json, texts)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.sampled_from(REGEXES), TEXTS)
def test_split_regexes_cut_as_oniguruma_does(regex, text):
    pre = tokenizers.pre_tokenizers.Split(tokenizers.Regex(regex), "isolated")
    want = [piece for piece, _ in pre.pre_tokenize_str(text)]
    from nanoeuler.tokenizer.grammar import pre_tokenizer

    got = [piece for piece, _ in pre_tokenizer({"type": "Split", "pattern": {"Regex": regex},
                                                "behavior": "Isolated", "invert": False})([(text, True)])]
    assert got == want


def _trained(pre, decoder, normalizer=None, byte_level=True, specials=("</s>", "<s>"), vocab_size=400):
    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    hf.normalizer, hf.pre_tokenizer, hf.decoder = normalizer, pre, decoder
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    hf.train_from_iterator(CORPUS * 3, tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(specials), initial_alphabet=alphabet, show_progress=False))
    return hf


PUBLISHED_TEXTS = CORPUS + ["</s>hello</s>  world<|end|>\n<|end|>x", "  a  b\n\n\nc 1234567 ½"]


def test_gpt2_file_without_a_model_type(tmp_path):
    """GPT-2's own tokenizer.json (an older `tokenizers`' file): its model has no "type"; it loads as the
    byte-level Tokenizer (the fast path) and gives the ids `tokenizers` gives."""
    hf = _trained(tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False), tokenizers.decoders.ByteLevel(),
                  specials=["<|endoftext|>"])
    d = json.loads(hf.to_str())
    del d["model"]["type"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(d))
    ours = Tokenizer.load(tmp_path / "tokenizer.json")
    assert type(ours) is Tokenizer and ours.eos == "<|endoftext|>"
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in PUBLISHED_TEXTS:
        assert ours.encode(text, allow_special=True) == hf.encode(text).ids
        assert ours.decode(hf.encode(text).ids).decode() == hf.decode(hf.encode(text).ids)


def test_phi3_added_token_with_rstrip(tmp_path):
    """Phi-3's layout: a SentencePiece-style BPE (Llama 2's normalizer, byte fallback) whose added tokens have
    rstrip true (`</s>`, `<|end|>`): the spaces after one belong to it."""
    norm = tokenizers.normalizers.Sequence([tokenizers.normalizers.Prepend(SPACE),
                                            tokenizers.normalizers.Replace(" ", SPACE)])
    dec = tokenizers.decoders.Sequence([tokenizers.decoders.Replace(SPACE, " "), tokenizers.decoders.ByteFallback(),
                                        tokenizers.decoders.Fuse(), tokenizers.decoders.Strip(" ", 1, 0)])
    # a vocabulary trained in words (SentencePiece's: `▁` only begins a token), then Phi-3's layout: no pre-tokenizer
    hf = _trained(tokenizers.pre_tokenizers.Metaspace(), dec, norm, byte_level=False, specials=["<unk>", "<s>", "</s>"])
    d = json.loads(hf.to_str())
    d["pre_tokenizer"] = None
    d["model"].update(byte_fallback=True, fuse_unk=True, unk_token="<unk>")
    for b in range(256):
        d["model"]["vocab"].setdefault(f"<0x{b:02X}>", len(d["model"]["vocab"]))
    for t in d["added_tokens"]:
        t.update(rstrip=t["content"] == "</s>", normalized=False)
    d["added_tokens"].append({"id": len(d["model"]["vocab"]), "content": "<|end|>", "single_word": False,
                              "lstrip": False, "rstrip": True, "normalized": False, "special": True})
    d["post_processor"] = {"type": "TemplateProcessing", "single": [
        {"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}], "pair": [],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [d["added_tokens"][1]["id"]], "tokens": ["<s>"]}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(d))
    ours = Tokenizer.load(tmp_path / "tokenizer.json")
    assert ours.bos == "<s>" and ours.eos == "</s>" and ours._sub_words is not None  # merged word by word
    assert_agrees(json.dumps(d), PUBLISHED_TEXTS + ["<|end|>   \n x", "a</s>  b", "  x  ▁▁y ▁"])


def test_deepseek_sequence_of_splits_digits_and_byte_level(tmp_path):
    """DeepSeek-LLM's pre-tokenizer: a Sequence of five Splits, Digits one by one and ByteLevel without its
    regex (a LlamaForCausalLM whose file no compiled rule matches)."""
    t = tokenizers.pre_tokenizers
    pre = t.Sequence([t.Split(tokenizers.Regex(r), "isolated") for r in REGEXES[3:8]]
                     + [t.Digits(individual_digits=True), t.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf = _trained(pre, tokenizers.decoders.ByteLevel(), specials=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"])
    hf.post_processor = tokenizers.processors.TemplateProcessing(
        single="<｜begin▁of▁sentence｜> $A", special_tokens=[("<｜begin▁of▁sentence｜>", 0)])
    hf.save(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer.load(tmp_path / "tokenizer.json", eos="<｜end▁of▁sentence｜>")
    assert type(ours) is GrammarBPE and ours.bos_id == 0 and ours.eos_id == 1
    assert_agrees(hf.to_str(), PUBLISHED_TEXTS)


def test_what_is_not_bpe_is_one_line(tmp_path):
    hf = tokenizers.Tokenizer(tokenizers.models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    (tmp_path / "wp.json").write_text(hf.to_str())
    with pytest.raises(UserError, match="its model is WordPiece; nanoeuler reads BPE models only"):
        Tokenizer.load(tmp_path / "wp.json")
    unigram = tokenizers.Tokenizer(tokenizers.models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0, False))
    (tmp_path / "ug.json").write_text(unigram.to_str())
    r = subprocess.run([sys.executable, "-m", "nanoeuler", "tokenizer", "encode", "--tokenizer", tmp_path / "ug.json",
                        "a"], capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "its model is Unigram" in r.stderr, r.stderr


def test_a_regex_nanoeuler_cannot_read_is_one_line():
    with pytest.raises(UserError, match="Unicode class 'Han'"):
        onig_to_re(r"\p{Han}+")


def test_streaming_and_the_compact_json_keep_the_ids(tmp_path):
    """encode_file (chunks cut between lines) gives encode's ids; the checkpoint's JSON gives the same tokenizer."""
    t = tokenizers.pre_tokenizers
    pre = t.Sequence([t.Split(tokenizers.Regex(REGEXES[8]), "isolated"), t.ByteLevel(add_prefix_space=False,
                                                                                     use_regex=False)])
    hf = _trained(pre, tokenizers.decoders.ByteLevel())
    ours = GrammarBPE.from_hf(json.loads(hf.to_str()), "tokenizer.json")
    text = "".join(CORPUS * 40) + "\n</s>x"
    (tmp_path / "c.txt").write_text(text)
    n = ours.encode_file(tmp_path / "c.txt", tmp_path / "c.tok", progress=False, chunk_bytes=1000)
    from nanoeuler.tokenizer.token_file import read_token_file

    assert read_token_file(tmp_path / "c.tok").tolist() == ours.encode(text) and n == len(ours.encode(text))
    again = Tokenizer.from_json(ours.to_json())
    assert type(again) is GrammarBPE and again.encode(text) == ours.encode(text)
    ours.save_hf(tmp_path / "saved.json")
    assert tokenizers.Tokenizer.from_file(str(tmp_path / "saved.json")).encode(text).ids == ours.encode(
        text, allow_special=True)
    ids = ours.encode("héllo wörld 🎉 and more")
    assert b"".join([ours.decode(ids[:3], text_start=True), ours.decode(ids[3:])]) == ours.decode(ids, text_start=True)


def _llama2_style():
    """Llama 2's layout (the SentencePiece-style class): Prepend and Replace of ▁, byte fallback, a BOS."""
    norm = tokenizers.normalizers.Sequence([tokenizers.normalizers.Prepend(SPACE),
                                            tokenizers.normalizers.Replace(" ", SPACE)])
    dec = tokenizers.decoders.Sequence([tokenizers.decoders.Replace(SPACE, " "), tokenizers.decoders.ByteFallback(),
                                        tokenizers.decoders.Fuse(), tokenizers.decoders.Strip(" ", 1, 0)])
    hf = _trained(None, dec, norm, byte_level=False, specials=["<unk>", "<s>", "</s>"])
    d = json.loads(hf.to_str())
    d["model"].update(byte_fallback=True, fuse_unk=True, unk_token="<unk>")
    for b in range(256):
        d["model"]["vocab"].setdefault(f"<0x{b:02X}>", len(d["model"]["vocab"]))
    d["post_processor"] = {"type": "TemplateProcessing", "single": [
        {"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}], "pair": [],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    return json.dumps(d)


def _deepseek_style():
    t = tokenizers.pre_tokenizers
    pre = t.Sequence([t.Split(tokenizers.Regex(r), "isolated") for r in REGEXES[3:8]]
                     + [t.Digits(individual_digits=True), t.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf = _trained(pre, tokenizers.decoders.ByteLevel(), specials=["</s>", "<s>", "<|user|>", "<|assistant|>"])
    hf.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return hf.to_str()


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


@pytest.mark.parametrize("family", ["llama2", "deepseek"])
def test_cli_serve_and_chat_agree_with_tokenizers(tmp_path, family):
    """`tokenizer encode/decode`, serve's /tokenize and /detokenize and a chat template's ids are those of
    `tokenizers` (and transformers) on the same file; /detokenize drops the space Llama 2's encoder put first."""
    import dataclasses
    import http.client
    import re
    import time

    from conftest import run_cli, sharp_params, tiny_config
    from nanoeuler.data import jinja_template
    from nanoeuler.io import checkpoint

    path = tmp_path / "tokenizer.json"
    path.write_text(_llama2_style() if family == "llama2" else _deepseek_style())
    hf = tokenizers.Tokenizer.from_file(str(path))
    tok = Tokenizer.load(path)
    assert type(tok).__name__ == ("SentencePieceBPE" if family == "llama2" else "GrammarBPE")
    text = "Hello world! 12345 don't  stop </s> café 日本語"
    hf.encode_special_tokens = True
    r = run_cli("tokenizer", "encode", "--tokenizer", path, text)
    assert r.returncode == 0 and list(map(int, r.stdout.split())) == hf.encode(text).ids, r.stderr
    hf.encode_special_tokens = False
    ids = hf.encode(text).ids
    r = run_cli("tokenizer", "decode", "--tokenizer", path, *ids[1:])
    assert r.returncode == 0 and r.stdout == hf.decode(ids[1:], skip_special_tokens=False), r.stderr

    transformers = pytest.importorskip("transformers")
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token="<s>", eos_token="</s>",
                                                  chat_template=CHAT_TEMPLATE)
    tok.set_chat(CHAT_TEMPLATE, named_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    messages = [{"role": "user", "content": "Hi there, 123!"}, {"role": "assistant", "content": "Hello </s> you."},
                {"role": "user", "content": " two  spaces"}]
    ours = jinja_template.encode_rendered(tok, jinja_template.render(tok, messages, True))
    assert ours == theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              sanitize_control_tokens=True)["input_ids"]  # "</s>" written: text

    cfg = dataclasses.replace(tiny_config(tok.vocab_size), context=64)
    checkpoint.save(tmp_path / "m.bin", cfg, sharp_params(cfg, seed=1, scale=0.3), tok.to_json(), step=0, chat=True)
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "nanoeuler", "serve", "--ckpt", str(tmp_path / "m.bin"), "--device",
                             "cpu", "--port", "0"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (m := re.search(r"on http://127\.0\.0\.1:(\d+)/ ", (tmp_path / "serve.log").read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.05)

        def post(route, body):
            conn = http.client.HTTPConnection("127.0.0.1", int(m.group(1)), timeout=60)
            conn.request("POST", route, json.dumps(body), {"Content-Type": "application/json"})
            answer = json.loads(conn.getresponse().read())
            conn.close()
            return answer
        assert post("/tokenize", {"prompt": text})["tokens"] == hf.encode(text).ids
        for part in (ids, ids[1:], ids[3:]):
            assert post("/detokenize", {"tokens": part})["prompt"] == hf.decode(part, skip_special_tokens=False)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_character_classes_match_as_in_tokenizers():
    """Each class of a Split regex holds the characters it holds in `tokenizers` (Oniguruma): every assigned
    code point below U+0800 and every 37th above it."""
    import unicodedata

    from nanoeuler.tokenizer.grammar import pre_tokenizer

    points = [*range(0x800), *range(0x800, 0x110000, 37)]
    chars = "".join(chr(c) for c in points if unicodedata.category(chr(c)) not in ("Cn", "Cs"))
    for regex in [r"\w", r"[\w]", r"[^\w\s]", r"\W", r"\s", r"\S", r"\d", r"\p{L}", r"\p{N}", r"\p{P}", r"\p{Lu}",
                  r"[^\s\p{L}\p{N}]", r"\p{M}"]:
        spec = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Removed", "invert": True}
        want = "".join(p for p, _ in tokenizers.pre_tokenizers.Split(tokenizers.Regex(regex), "removed", invert=True)
                       .pre_tokenize_str(chars))
        got = "".join(p for p, _ in pre_tokenizer(spec)([(chars, 0)]))
        assert got == want, (regex, sorted(set(got) ^ set(want))[:10])
