"""SentencePiece-style BPE tokenizer.json files (Llama 2, TinyLlama, Mistral) load into our SentencePieceBPE and
give the ids of the `tokenizers` library (used here only, never at run time), on the fuzzed corpus of
tests/test_tokenizer_families.py and the first 100 KB of shakespeare.txt, with decode round trips:

- Llama 2's layout: normalizer Sequence[Prepend("▁"), Replace(" ", "▁")], no pre-tokenizer, byte fallback,
  fuse_unk, the decoder Sequence[Replace, ByteFallback, Fuse, Strip], `<s>` from the post-processor;
- a Metaspace pre-tokenizer (prepend_scheme first and always, split or not), with byte tokens missing so
  that unknown characters become (fused) `<unk>`s;
- a vocabulary with a token that has `▁` after another character (no word-by-word merging).

Each vocabulary is trained by `tokenizers`' BpeTrainer (byte fallback, the 256 byte tokens, a small alphabet so
that many characters fall back to bytes), then put in the published JSON layout.
"""
import json

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from nanoeuler.tokenizer.bpe import Tokenizer, read_token_file  # noqa: E402
from nanoeuler.tokenizer.sentencepiece_bpe import SentencePieceBPE  # noqa: E402
from test_tokenizer_families import SHAKESPEARE, fuzz_texts  # noqa: E402

SPACE = "\u2581"
BYTES = [f"<0x{b:02X}>" for b in range(256)]
EDGES = ["", " ", "  ", " leading", "trailing ", "  two  spaces  ", "\t tab", "\r\n", "a\r\nb", "\u00a0", "x\u00a0 y",
         SPACE, f"{SPACE}word", f"a{SPACE}{SPACE}b", "<s>", "</s>x", "a<s>b", "<s> a", "a </s> b", "<unk>",
         "日本語", "😀", "\U0010fffd", "e\u0301", "1234567890", "def f(x):\n    return x  # 2\n"]


@pytest.fixture(scope="module")
def corpus():
    with open(SHAKESPEARE, encoding="utf-8") as f:
        text = f.read(100_000)
    return fuzz_texts() + EDGES, text


def trained(corpus, vocab_size=1000):
    """A SentencePiece-style BPE vocabulary as tokenizers trains it: <unk> <s> </s>, the byte tokens, merges."""
    from tokenizers import Tokenizer as HF, models, pre_tokenizers, trainers
    texts, text = corpus
    hf = HF(models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"] + BYTES,
                                  limit_alphabet=70, show_progress=False)
    hf.train_from_iterator([text] + texts * 2, trainer)
    d = json.loads(hf.to_str())
    d["added_tokens"] = [t for t in d["added_tokens"] if t["content"] not in BYTES]  # as published: vocab only
    for t in d["added_tokens"]:
        t["normalized"] = False
    return d


def llama2_layout(d):
    bos = d["model"]["vocab"]["<s>"]
    d["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE},
                                                           {"type": "Replace", "pattern": {"String": " "},
                                                            "content": SPACE}]}
    d["pre_tokenizer"] = None
    d["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    single = [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
    d["post_processor"] = {"type": "TemplateProcessing", "single": single,
                           "pair": single + [{"SpecialToken": {"id": "<s>", "type_id": 1}},
                                             {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [bos], "tokens": ["<s>"]}}}
    return d


def metaspace_layout(d, scheme, split):
    d = llama2_layout(d)
    d["normalizer"] = None
    d["pre_tokenizer"] = {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": scheme, "split": split}
    d["decoder"] = {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": scheme, "split": split}
    return d


def without_bytes(d, missing):
    """The vocabulary without some byte tokens, renumbered: characters of those bytes become <unk>."""
    gone = {f"<0x{b:02X}>" for b in missing}
    order = [name for name, _ in sorted(d["model"]["vocab"].items(), key=lambda kv: kv[1]) if name not in gone]
    d["model"]["vocab"] = {name: i for i, name in enumerate(order)}
    for t in d["added_tokens"]:
        t["id"] = d["model"]["vocab"][t["content"]]
    d["post_processor"]["special_tokens"]["<s>"]["ids"] = [d["model"]["vocab"]["<s>"]]
    return d


def compare(d, tmp_path, texts, name, text_start_round_trip=True):
    """Ours against `tokenizers` on every text (ids with and without special tokens, decode); returns ours."""
    from tokenizers import Tokenizer as HF
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(d, ensure_ascii=False), encoding="utf-8")
    hf = HF.from_file(str(path))
    ours = Tokenizer.load(path)
    assert isinstance(ours, SentencePieceBPE) and ours.bos == "<s>" and ours.eos == "</s>"
    unk = ours.special_tokens["<unk>"]
    for t in texts:
        ids = ours.encode(t, allow_special=True)
        assert ids == hf.encode(t).ids, (name, t)
        plain = ours.encode(t, add_bos=False)
        assert ours.encode_ordinary(t) == plain
        if unk not in ids and not any(s in t for s in ours.special_tokens):
            assert plain == ids[1:]
            if text_start_round_trip:
                assert ours.decode(ids[1:], text_start=True).decode() == hf.decode(ids[1:], skip_special_tokens=False)
            # the bytes of the text, the `▁` put in front a space
            assert ours.decode(plain, text_start=True) == t.replace(SPACE, " ").encode() or ours.style == "metaspace"
    return ours, hf


def check_kept(ours, hf, texts, tmp_path, name):
    """Our compact JSON and our tokenizer.json export give the same tokenizer and ids."""
    from tokenizers import Tokenizer as HF
    again = Tokenizer.from_json(ours.to_json())
    assert isinstance(again, SentencePieceBPE) and again.to_json() == ours.to_json()
    ours.save_hf(tmp_path / f"{name}.export.json")
    exported = HF.from_file(str(tmp_path / f"{name}.export.json"))
    assert Tokenizer.load(tmp_path / f"{name}.export.json").to_json() == ours.to_json()
    for t in texts:
        assert again.encode(t, allow_special=True) == exported.encode(t).ids == hf.encode(t).ids


def test_llama2_layout(corpus, tmp_path):
    texts, text = corpus
    d = llama2_layout(trained(corpus))
    ours, hf = compare(d, tmp_path, texts + [text], "llama2")
    assert ours.style == "prepend" and ours.word_by_word
    byte_ids = {d["model"]["vocab"][b] for b in BYTES}
    assert byte_ids & set(ours.encode("日本語 😀 \U0010fffd"))  # characters outside the vocabulary: byte tokens
    assert ours.encode("<s>hi</s>", allow_special=True) == hf.encode("<s>hi</s>").ids
    assert ours.special_tokens["</s>"] not in ours.encode("</s>")  # special: ordinary text unless allowed
    check_kept(ours, hf, texts[:60], tmp_path, "llama2")


def test_metaspace_first_and_always_with_unk(corpus, tmp_path):
    texts, _ = corpus
    cjk = ["日本語のテキスト", "中文字符。x", "😀日", "a日b😀c", "日😀日 日"]
    for scheme in ("first", "always"):
        for split in (True, False):
            d = metaspace_layout(trained(corpus), scheme, split)
            d = without_bytes(d, range(0xE5, 0xEA))  # CJK lead bytes: those characters are <unk>, fused
            ours, hf = compare(d, tmp_path, texts + cjk, f"metaspace-{scheme}-{split}", text_start_round_trip=False)
            assert ours.style == "metaspace" and ours.prepend_scheme == scheme and ours.split == split
            unk = ours.special_tokens["<unk>"]
            assert ours.encode("日本語", add_bos=False).count(unk) == 1
            check_kept(ours, hf, texts[:30] + cjk, tmp_path, f"metaspace-{scheme}-{split}")


def test_space_inside_a_token(corpus, tmp_path):
    """A vocabulary where `▁` follows another character in a token: each piece is merged whole."""
    texts, text = corpus
    d = llama2_layout(trained(corpus, vocab_size=700))
    vocab = d["model"]["vocab"]
    for left, right in (("e", SPACE), ("s", SPACE), (f"e{SPACE}", "a")):
        vocab[left + right] = len(vocab)
        d["model"]["merges"].append([left, right])
    ours, _ = compare(d, tmp_path, texts + [text[:20_000]], "inner-space")
    assert not ours.word_by_word


def test_stream_and_token_file(corpus, tmp_path):
    """encode_file, in small chunks, gives encode's ids (no BOS); any bytes round-trip through byte tokens."""
    texts, text = corpus
    d = llama2_layout(trained(corpus))
    path = tmp_path / "sp.json"
    path.write_text(json.dumps(d, ensure_ascii=False), encoding="utf-8")
    ours = Tokenizer.load(path)
    whole = text[:30_000] + "".join(texts) + " tail"
    src = tmp_path / "text.txt"
    src.write_text(whole, encoding="utf-8")
    for chunk in (1000, 4093):
        count = ours.encode_file(src, tmp_path / "text.tok", progress=False, chunk_bytes=chunk)
        tokens = read_token_file(tmp_path / "text.tok", source=src, tok=ours)
        assert tokens.dtype == np.dtype("<u2") and count == len(tokens)
        assert tokens.tolist() == ours.encode(whole, add_bos=False)
    raw = bytes(range(256)) + b"\xff\xfe caf\xc3\xa9 \xe6\x97"
    assert ours.decode(ours.encode(raw, add_bos=False), text_start=True) == raw
    # token by token, the bytes join to the text (a streaming decoder's view)
    ids = ours.encode("héllo 日本 😀", add_bos=False)
    assert b"".join(ours.decode([i]) for i in ids) == " héllo 日本 😀".encode()


def test_a_corpus_terminator_without_the_token_is_the_end_of_text(corpus, tmp_path):
    """A SentencePiece vocabulary whose end of text is `<eos>` (no `</s>`, as Gemma's): a corpus's `</s>`, read
    in small chunks, becomes `<eos>`, with the ids `tokenizers` gives the text that has `<eos>` written there
    (the Metaspace `▁` only at the start of the text, none after an end token)."""
    from nanoeuler.data.corpus import encode_text
    from tokenizers import Tokenizer as HF
    d = metaspace_layout(trained(corpus), "first", True)
    d["model"]["vocab"]["<eos>"] = d["model"]["vocab"].pop("</s>")
    for t in d["added_tokens"]:
        t["content"] = "<eos>" if t["content"] == "</s>" else t["content"]
    path = tmp_path / "eos.json"
    path.write_text(json.dumps(d, ensure_ascii=False), encoding="utf-8")
    ours = Tokenizer.load(path, eos="<eos>")
    assert isinstance(ours, SentencePieceBPE) and "</s>" not in ours.special_tokens
    text = "One story ends here.</s>\n\nAnd another one there.</s>\n\n" * 40
    src = tmp_path / "docs.txt"
    src.write_text(text, encoding="utf-8")
    expected = HF.from_file(str(path)).encode(text.replace("</s>", "<eos>"), add_special_tokens=False).ids
    assert expected.count(ours.eos_id) == 80 and encode_text(ours, text) == expected
    for chunk in (7, 64):
        ours.encode_file(src, tmp_path / "docs.tok", progress=False, allow_special=True, chunk_bytes=chunk,
                         document_ends=True)
        assert read_token_file(tmp_path / "docs.tok", src, ours, True, True).tolist() == expected
