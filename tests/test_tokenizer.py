"""The byte-level BPE tokenizer: exact round trips, merges worked out by hand and against a naive
recount-per-merge trainer, GPT-2 pretokenization and ids identical to the `tokenizers` library loading our
tokenizer.json, streaming encoding, special tokens, the CLI and its errors."""
import collections
import json
import os
import re
import tempfile
import unicodedata

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoeuler.cli import main as cli_main
from nanoeuler.errors import UserError
from nanoeuler.tokenizer.bpe import UNICODE_VERSION, Tokenizer, _split, bytes_to_unicode, class_table, read_token_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HYP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SAMPLES = [
    "",
    "Hello world! I'm sure they'll say it's fine, won't they? We've done what we'd planned.",
    "IT'S LOUD, DON'T SHOUT: 'tis the 'S' and 'LL' case, ''s and 's'",
    "def f(x):\n    return x**2  # square\n\tif a != b: print(\"hi\")\n\n\n",
    "日本語のテキストと中文字符，한국어 문장도 섞어서。",
    "👩‍💻 😀😃 👍🏽 🇫🇷 emoji!!",
    "a  b   c\n\n\n  d \t\t e\r\n\r\nend   " + " " * 300 + "x" + "\n" * 40 + "\t \t",
    "12345 3.14159 1,000,000 ٣٤٥ ⅫⅢ ½ x²",
    "e\u0301 cafe\u0301 ñ n\u0303 ก\u0e31\u0e49 \u0301\u0301 alone",
    "a\u00a0b\u3000c\u2009d\u200be\x1c\x1d\x1e\x1f\x85f\u2028g\u2029",
    "nul\x00byte and \x7f del, Ġ ĉ (byte-level lookalikes)",
    "hello</s>world </s> x</s></s> <s> </ s>",
]


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


@pytest.fixture(scope="module")
def varied_corpus(tmp_path_factory):
    with open(os.path.join(ROOT, "shakespeare.txt"), "rb") as f:
        english = f.read(200_000)
    extra = "\n".join(SAMPLES).encode() * 20 + bytes(range(256)) * 4
    return write(tmp_path_factory.mktemp("corpus"), "varied.txt", english + extra)


@pytest.fixture(scope="module")
def tok(varied_corpus):
    return Tokenizer.train(varied_corpus, 1000, progress=False)


@pytest.fixture(scope="module")
def tokenizers():
    """The `tokenizers` library (in the test extra): only the parity tests need it, so only they skip without."""
    return pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def hf(tok, tokenizers, tmp_path_factory):
    """Ours, loaded by `tokenizers`, and the same with special tokens read as plain text."""
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save_hf(path)
    plain = tokenizers.Tokenizer.from_file(str(path))
    plain.encode_special_tokens = True
    return tokenizers.Tokenizer.from_file(str(path)), plain


# --------------------------------------------------------------------------------------- round trips


@HYP
@given(st.binary(max_size=400))
def test_round_trip_arbitrary_bytes(tok, data):
    ids = tok.encode(data)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == data
    assert tok.decode(tok.encode(data, allow_special=True)) == data


@HYP
@given(st.text(max_size=200))
def test_round_trip_text(tok, text):
    assert tok.decode(tok.encode(text)) == text.encode()


def test_round_trip_unusual_input(tok):
    for data in [b"\xff\xfe\x00\x80 \xc3(\xe2\x82 \xf0\x9f\x98", b"\xed\xa0\x80", b" " * 100_000, b"\x00" * 1000]:
        assert tok.decode(tok.encode(data)) == data
    assert tok.decode(tok.encode("a\ud800b")) == "a\ud800b".encode("utf-8", "surrogatepass")  # lone surrogate
    assert tok.encode(b"caf\xc3\xa9") == tok.encode("café")


# ---------------------------------------------------------------------------------------- training


def test_merges_worked_by_hand(tmp_path):
    # "aaabdaaabac", one word. Pairs (overlaps counted): aa 4, ab 2, bd da ba ac 1: merge a+a -> 256;
    # leftmost first that makes Z a b d Z a b a c. Now Za = ab = 2, a tie that the smaller left id wins:
    # a+b -> 257. Then Z Y d Z Y a c: Z+Y (2) -> 258. Then X d X a c, all pairs 1: a+c (smallest) -> 259.
    tok = Tokenizer.train(write(tmp_path, "a.txt", "aaabdaaabac"), 256 + 4 + 1, progress=False)
    assert tok.merges.tolist() == [[97, 97], [97, 98], [256, 257], [97, 99]]
    assert tok.encode("aaabdaaabac") == [258, 100, 258, 259]
    assert (tok.vocab_size, tok.eos_id, tok.special_tokens) == (261, 260, {"</s>": 260})

    # "hug hug hug pug" -> words "hug" x1, " hug" x2, " pug" x1, pairs weighted by word count:
    # ug 4 (3 + 1) -> 256; h+ug 3 -> 257; " "+hug 2 -> 258; then " "+p and p+ug tie at 1: " p" -> 259;
    # " p"+ug -> 260.
    tok = Tokenizer.train(write(tmp_path, "h.txt", "hug hug hug pug"), 262, progress=False)
    assert tok.merges.tolist() == [[117, 103], [104, 256], [32, 257], [32, 112], [259, 256]]
    assert tok.encode("hug pug hugs") == [257, 260, 258, 115]


def naive_train(words, n_tokens):
    """Recount every pair before each merge: the definition that the incremental trainer must match."""
    words = {tuple(word): count for word, count in words.items()}
    token_bytes = [bytes([byte]) for byte in range(256)]
    merges = []
    while len(token_bytes) < n_tokens:
        counts = collections.Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                counts[pair] += count
        if not counts:
            break
        left, right = max(counts, key=lambda pair: (counts[pair], -pair[0], -pair[1]))
        joined = token_bytes[left] + token_bytes[right]
        if joined not in token_bytes:
            token_bytes.append(joined)
        new = token_bytes.index(joined)
        merges.append([left, right])
        merged = {}
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == (left, right):
                    out.append(new)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + count
        words = merged
    return merges


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text("aab \n'1", min_size=1, max_size=12), min_size=1, max_size=12), st.integers(257, 300))
def test_incremental_trainer_equals_naive(lines, n_tokens):
    data = "\n".join(lines).encode()
    _, ends, n = _split(data)
    words = collections.Counter(data[s:e] for s, e in zip([0, *ends[:n - 1]], ends[:n]))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "c.txt")
        with open(path, "wb") as f:
            f.write(data)
        tok = Tokenizer.train(path, n_tokens + 1, progress=False)
    assert tok.merges.tolist() == naive_train(words, n_tokens)


def test_training_samples_a_large_file():
    path = os.path.join(ROOT, "shakespeare.txt")
    tok = Tokenizer.train(path, 400, progress=False, max_bytes=2 << 20)  # 2 windows of the 5 MB file
    assert tok.vocab_size == 400
    text = "To be, or not to be, that is the question."
    assert tok.decode(tok.encode(text)) == text.encode()
    assert len(tok.encode(text)) < len(text) / 2


@pytest.fixture(scope="module")
def closed_documents(tmp_path_factory):
    """The start of shakespeare.txt (no `<`, `>` or `/` in it) as documents, its paragraphs, each closed by
    `</s>` as the fetched corpora close theirs: 2,761 of them."""
    with open(os.path.join(ROOT, "shakespeare.txt"), encoding="utf-8") as f:
        text = f.read(300_000)
    assert not set("<>/") & set(text)
    docs = re.sub(r"(\S)\n\n", lambda m: m.group(1) + "</s>\n\n", text)
    return write(tmp_path_factory.mktemp("docs"), "docs.txt", docs)


def test_training_learns_no_merge_across_or_inside_the_end_token(closed_documents, monkeypatch):
    """`</s>` written in the text is split out before the text is pretokenized and counted (as encoding splits
    it out): no learned token holds a piece of it (`</`, `.</`, `s>` ...), and encoding with allow_special
    gives the end token at every document's end; the same merges whatever the chunk boundaries."""
    from nanoeuler.tokenizer import train as training
    tok = Tokenizer.train(closed_documents, 600, progress=False)
    assert tok.vocab_size == 600
    pieces = [tok.decode([i]) for i in range(tok.vocab_size) if i != tok.eos_id]
    assert [p for p in pieces if len(p) > 1 and set(p) & set(b"</>")] == []
    text = closed_documents.read_bytes()
    ids = tok.encode(text, allow_special=True)
    assert ids.count(tok.eos_id) == text.count(b"</s>") == 2761 and tok.decode(ids) == text
    assert tok.encode("Exeunt.</s>", allow_special=True)[-2:] == [tok.encode("Exeunt.")[-1], tok.eos_id]
    monkeypatch.setattr(training, "CHUNK", 1001)  # chunk ends all over the text, inside `</s>` too
    assert Tokenizer.train(closed_documents, 600, progress=False).merges.tolist() == tok.merges.tolist()


def test_sampled_windows_count_no_piece_of_the_end_token(closed_documents, monkeypatch):
    """A window of a sampled file that ends inside a `</s>` leaves the cut token out, as it does a cut word."""
    from nanoeuler.tokenizer import train as training
    monkeypatch.setattr(training, "WINDOW", 997)  # 200 windows, ends landing everywhere
    with open(closed_documents, "rb") as f:
        words, lengths, counts, _ = training._count_pieces(f, os.path.getsize(closed_documents), 997 * 200, False,
                                                           ("</s>",))
    words = words.tobytes()
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    pieces = [words[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    assert len(pieces) > 1000 and [p for p in pieces if set(p) & set(b"</>")] == []


def test_training_beyond_65536_tokens(tmp_path):
    """Merges past id 65,535 (pair keys and heap entries hold 31-bit ids): the first merges are those of a
    smaller vocabulary, the text comes back, and its token file is uint32."""
    # 150,000 distinct random words (shakespeare.txt runs out of pairs at 47,854 tokens)
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
    words = {bytes(rng.choice(letters, rng.integers(3, 9))) for _ in range(150_000)}
    text = b" ".join(sorted(words)) + b"\n"
    path = write(tmp_path, "words.txt", text)
    big = Tokenizer.train(path, 66_000, progress=False)
    assert big.vocab_size == 66_000
    small = Tokenizer.train(path, 2_000, progress=False)
    assert big.merges[:len(small.merges)].tolist() == small.merges.tolist()
    text = text[:300_000]
    ids = big.encode(text)
    assert max(ids) >= 65_536 and big.decode(ids) == text
    out = write(tmp_path, "t.txt", text)
    big.encode_file(out, tmp_path / "t.tok", progress=False)
    tokens = read_token_file(tmp_path / "t.tok")
    assert tokens.dtype == np.dtype("<u4") and tokens.tolist() == ids


def test_small_corpus_gives_what_it_can(tmp_path, capsys):
    tok = Tokenizer.train(write(tmp_path, "s.txt", "ab ab"), 4096, progress=False)
    assert tok.vocab_size < 4096 and tok.decode(tok.encode("ab ab")) == b"ab ab"
    assert "supports only" in capsys.readouterr().err


# --------------------------------------------------------------------------------- HF parity


def hf_pieces(tokenizers, text):
    """Byte offsets of the ends of the pretokens that `tokenizers` ByteLevel makes of text."""
    pre = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return np.cumsum([len(piece) for piece, _ in pre.pre_tokenize_str(text)]).tolist()  # one char a byte


@HYP
@given(st.binary(max_size=200))
def test_pretokenization_matches_tokenizers_on_any_bytes(tokenizers, data):
    # bytes that are not UTF-8 are single "other" characters: like "#", which is also one byte
    text = "".join("#" if "\udc80" <= ch <= "\udcff" else ch for ch in data.decode("utf-8", "surrogateescape"))
    _, ends, n = _split(data)
    assert ends[:n].tolist() == hf_pieces(tokenizers, text)


@HYP
@given(st.text(max_size=200))
def test_same_ids_as_tokenizers_on_any_text(tok, hf, text):
    with_special, plain = hf
    assert tok.encode(text) == plain.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, allow_special=True) == with_special.encode(text, add_special_tokens=False).ids


def test_same_ids_as_tokenizers_on_varied_text(tok, hf):
    with_special, plain = hf
    with open(os.path.join(ROOT, "shakespeare.txt"), encoding="utf-8") as f:
        english = f.read(300_000)
    for text in SAMPLES + [english, "".join(SAMPLES) * 3, " " * 50_000 + "x"]:
        assert tok.encode(text) == plain.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, allow_special=True) == with_special.encode(text, add_special_tokens=False).ids
    assert with_special.decode(tok.encode(SAMPLES[1]), skip_special_tokens=False) == SAMPLES[1]


def test_merge_that_remakes_an_existing_token(tokenizers, tmp_path):
    # "abc" made twice: a+b, ab+c, then b+c and a+bc, whose bytes are those of ab+c: the same id,
    # as `tokenizers` does it
    tok = Tokenizer([(97, 98), (256, 99), (98, 99), (97, 258)])
    assert tok.vocab_size == 256 + 3 + 1 and tok._results.tolist() == [256, 257, 258, 257]
    assert tok.encode("abc xbc") == [257, 32, 120, 258]
    tok.save_hf(tmp_path / "t.json")
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "t.json"))
    for text in ["abc xbc abcbc", "aabbcc abcabc"]:
        assert tok.encode(text) == hf.encode(text).ids


# -------------------------------------------------------------------------------- special tokens


def test_special_tokens_only_where_asked(tok):
    eos = tok.eos_id
    assert tok.special_tokens == {"</s>": eos} and eos == tok.vocab_size - 1
    assert eos not in tok.encode("a</s>b")
    assert tok.encode("a</s>b", allow_special=True) == tok.encode("a") + [eos] + tok.encode("b")
    assert tok.decode([eos]) == b"</s>"
    assert tok.decode(tok.encode("x </s>\n</s>", allow_special=True)) == b"x </s>\n</s>"


def test_custom_special_tokens(tmp_path, varied_corpus):
    tok = Tokenizer.train(varied_corpus, 300, progress=False, special_tokens=["</s>", "<|pad|>", "<s>"])
    assert tok.special_tokens == {"</s>": 297, "<|pad|>": 298, "<s>": 299} and tok.eos_id == 297
    assert tok.encode("<s>hi<|pad|>", allow_special=True) == [299, *tok.encode("hi"), 298]
    assert Tokenizer.from_json(tok.to_json()).special_tokens == tok.special_tokens
    for bad in (["<s>"], ["</s>", "</s>"], ["</s>", "hello"], ["</s>", " "], ["</s>", ""], ["</s>", 5]):
        with pytest.raises(UserError):
            Tokenizer([], bad)


# ------------------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("allow_special", [False, True])
def test_encode_file_equals_encode(tok, tmp_path, allow_special):
    data = ("\n".join(SAMPLES) * 2).encode() + b"\xff\xe2\x82 tail's</s"
    src = write(tmp_path, "in.txt", data)
    expected = tok.encode(data, allow_special=allow_special)
    for chunk in (1, 3, 7, 64, 1000, 1 << 20):
        out = tmp_path / f"out{chunk}.tok"
        n = tok.encode_file(src, out, progress=False, allow_special=allow_special, chunk_bytes=chunk)
        assert n == len(expected)
        assert read_token_file(out, source=src, tok=tok).tolist() == expected


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300) | st.text("ab' \n\u3000\u00e9</s>1", max_size=300).map(str.encode),
       st.integers(1, 40), st.booleans())
def test_streaming_never_changes_ids(tok, data, chunk, allow_special):
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "in"), os.path.join(d, "out")
        with open(src, "wb") as f:
            f.write(data)
        tok.encode_file(src, dst, progress=False, allow_special=allow_special, chunk_bytes=chunk)
        assert read_token_file(dst).tolist() == tok.encode(data, allow_special=allow_special)


def test_a_token_file_is_the_training_cache_format(tok, tmp_path, monkeypatch):
    """One `.tok` format: a file written by encode_file with the special tokens read as tokens (as training
    reads a corpus) is what the training data loader reads (here it takes it as its cache of the corpus: no
    re-encoding) and round-trips to the text; one that read them as text is not its cache."""
    from nanoeuler.data import corpus as data
    text = ("\n".join(SAMPLES) * 3).encode()
    src = write(tmp_path, "corpus.txt", text)
    n = tok.encode_file(src, data.cache_path(src), progress=False)
    assert read_token_file(data.cache_path(src), source=src, tok=tok).tolist() == tok.encode(text)
    assert data.cached_tokens(src, tok) is None  # SAMPLES write </s>: read as text here, not as training does
    n = tok.encode_file(src, data.cache_path(src), progress=False, allow_special=True)
    raw = open(data.cache_path(src), "rb").read()
    assert raw[:8] == b"NEUTOKS\x00" and len(raw) == 128 + 2 * n
    with monkeypatch.context() as m:
        m.setattr(Tokenizer, "encode_file", lambda *a, **k: pytest.fail("the loader re-encoded the corpus"))
        corpus = data.open_corpus(src, tok, progress=False)
    assert corpus.tokens.tolist() == tok.encode(text, allow_special=True) and tok.decode(corpus.tokens) == text
    with pytest.raises(UserError, match=r"special tokens in the text \(</s>\) read as special tokens"):
        read_token_file(data.cache_path(src), allow_special=False)
    # and a cache that the loader writes reads back through the same reader
    other = write(tmp_path, "other.txt", SAMPLES[1])
    data.open_corpus(other, tok, progress=False)
    assert read_token_file(data.cache_path(other), source=other, tok=tok).tolist() == tok.encode(SAMPLES[1])


def test_imports_go_one_way_checkpoint_to_tokenizer():
    """io/checkpoint.py builds Tokenizers; the tokenizer package needs nothing of checkpoint.py (no import
    cycle, not even inside a function: the CLI glue that reads a checkpoint's tokenizer lives in cli.py)."""
    import ast
    import glob

    def imported(*paths):
        names = set()
        for path in paths:
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom):  # a relative one resolved from the file's package
                    package = os.path.relpath(os.path.dirname(path), ROOT).split(os.sep)
                    module = (".".join(package[:len(package) + 1 - node.level] + [node.module or ""]).strip(".")
                              if node.level else node.module)
                    names.add(module)
                    names.update(f"{module}.{a.name}" for a in node.names)
        return names
    tokenizer_files = glob.glob(os.path.join(ROOT, "nanoeuler", "tokenizer", "*.py"))
    assert len(tokenizer_files) >= 2
    assert "nanoeuler.tokenizer.bpe" in imported(os.path.join(ROOT, "nanoeuler", "io", "checkpoint.py"))
    assert not {n for n in imported(*tokenizer_files) if n.startswith("nanoeuler.io.checkpoint")}


def test_token_file_errors(tok, tmp_path):
    src = write(tmp_path, "in.txt", SAMPLES[1])
    out = tmp_path / "in.tok"
    tok.encode_file(src, out, progress=False)
    raw = out.read_bytes()
    with pytest.raises(UserError, match="not found"):
        read_token_file(tmp_path / "missing.tok")
    with pytest.raises(UserError, match="not a nanoeuler token file"):
        read_token_file(write(tmp_path, "bare.tok", np.arange(10, dtype="<u2").tobytes()))  # bare uint16
    with pytest.raises(UserError, match="truncated"):
        read_token_file(write(tmp_path, "cut.tok", raw[:-1]))
    with pytest.raises(UserError, match="different tokenizer"):
        read_token_file(out, tok=Tokenizer(tok.merges[:-1]))
    os.utime(src, ns=(0, 0))
    with pytest.raises(UserError, match="stale"):
        read_token_file(out, source=src)
    assert read_token_file(out).tolist() == tok.encode(SAMPLES[1])  # without a source to check against


# --------------------------------------------------------------------------------- serialization


def test_json_forms_round_trip(tok, tmp_path):
    text = "".join(SAMPLES)
    again = Tokenizer.from_json(tok.to_json())
    assert again.encode(text) == tok.encode(text) and again.sha256() == tok.sha256()
    tok.save_hf(tmp_path / "hf.json")
    (tmp_path / "ours.json").write_text(tok.to_json())
    for name in ("hf.json", "ours.json"):
        loaded = Tokenizer.load(tmp_path / name)
        assert loaded.to_json() == tok.to_json()
    other = Tokenizer(tok.merges[:-1])
    assert other.sha256() != tok.sha256()
    hf = json.loads((tmp_path / "hf.json").read_text())
    assert hf["model"]["vocab"][bytes_to_unicode()[32] + "t"] == tok.encode(" t")[0]


def test_unicode_table_agrees_with_unicodedata():
    with open(os.path.join(ROOT, "nanoeuler", "tokenizer", "unicode_classes.txt")) as f:
        assert f"Unicode {UNICODE_VERSION}" in f.read()
    table = class_table()
    for cp in range(0x110000):
        cat = unicodedata.category(chr(cp))
        if cat == "Cn":  # unassigned in this Python's Unicode: the table may know it from a later version
            continue
        want = 3 if cp in (9, 10, 11, 12, 13, 0x85) or cat in ("Zs", "Zl", "Zp") else {"L": 1, "N": 2}.get(cat[0], 0)
        assert table[cp] == want, hex(cp)


# ------------------------------------------------------------------------------------------ errors


def test_errors_are_user_errors(tok, tmp_path):
    missing = tmp_path / "missing.txt"
    with pytest.raises(UserError, match="no such file"):
        Tokenizer.train(missing, 300)
    with pytest.raises(UserError, match="empty"):
        Tokenizer.train(write(tmp_path, "empty.txt", b""), 300)
    with pytest.raises(UserError, match="vocab size"):
        Tokenizer.train(write(tmp_path, "x.txt", b"abc"), 256)
    with pytest.raises(UserError, match="vocab size"):
        Tokenizer.train(write(tmp_path, "x.txt", b"abc"), 2 ** 31 + 1)
    with pytest.raises(UserError, match="no such file"):
        tok.encode_file(missing, tmp_path / "out.tok")
    assert not (tmp_path / "out.tok").exists()
    with pytest.raises(UserError, match="no such file"):
        Tokenizer.load(missing)
    with pytest.raises(UserError, match="not JSON"):
        Tokenizer.load(write(tmp_path, "bad.json", b"{nope"))
    with pytest.raises(UserError):
        Tokenizer.load(write(tmp_path, "other.json", b'{"model": {"type": "WordPiece"}}'))
    for bad in ('{"format": "x"}', "[]", tok.to_json().replace('"merges":[[', '"merges":[[9999,')):
        with pytest.raises(UserError):
            Tokenizer.from_json(bad)
    for ids in ([-1], [tok.vocab_size], [1, 2, 10**9]):
        with pytest.raises(UserError, match="out of range"):
            tok.decode(ids)


# --------------------------------------------------------------------------------------------- CLI


def run(capsysbinary, *args):
    with pytest.raises(SystemExit) as exit_info:
        cli_main([str(arg) for arg in args])
    out = capsysbinary.readouterr()
    return exit_info.value.code, out.out, out.err.decode()


def test_cli_train_encode_decode(tmp_path, capsysbinary, varied_corpus, tiny_ckpt, tokenizer):
    out = tmp_path / "tok.json"
    code, _, err = run(capsysbinary, "tokenizer", "train", varied_corpus, "--vocab-size", 400, "--out", out)
    assert code == 0 and "vocab 400" in err
    tok = Tokenizer.load(out)
    text = "Hello </s> wörld  \t\n"
    code, stdout, _ = run(capsysbinary, "tokenizer", "encode", "--tokenizer", out, text)
    ids = [int(i) for i in stdout.split()]
    assert code == 0 and ids == tok.encode(text)
    code, stdout, _ = run(capsysbinary, "tokenizer", "decode", "--tokenizer", out, *ids)
    assert code == 0 and stdout == text.encode()
    code, stdout, _ = run(capsysbinary, "tokenizer", "encode", "--tokenizer", out, "--allow-special", text)
    assert tok.eos_id in [int(i) for i in stdout.split()]
    src = write(tmp_path, "bytes.bin", b"\xff\x00 odd\xc3")
    code, stdout, _ = run(capsysbinary, "tokenizer", "encode", "--tokenizer", out, "--file", src)
    code, stdout, _ = run(capsysbinary, "tokenizer", "decode", "--tokenizer", out, stdout.decode())
    assert stdout == b"\xff\x00 odd\xc3"
    # the tokenizer inside a checkpoint
    code, stdout, _ = run(capsysbinary, "tokenizer", "encode", "--ckpt", tiny_ckpt, "to be")
    assert code == 0 and [int(i) for i in stdout.split()] == tokenizer.encode("to be")


def test_cli_errors(tmp_path, capsysbinary):
    for args in (["train", tmp_path / "missing.txt"],
                 ["train", write(tmp_path, "x.txt", "abc"), "--vocab-size", 100],
                 ["encode", "--ckpt", tmp_path / "missing.bin", "x"],
                 ["encode", "--tokenizer", write(tmp_path, "bad.json", "{"), "x"],
                 ["decode", "--tokenizer", tmp_path / "missing.json", "1"]):
        code, _, err = run(capsysbinary, "tokenizer", *args)
        assert code == 2 and err.startswith("nanoeuler: error: ") and err.count("\n") == 1, err
