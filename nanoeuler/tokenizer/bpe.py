"""The byte-level BPE tokenizer, written here: no tokenizer library at run time.

    tok = Tokenizer.train("shakespeare.txt", 4096)   # learn merges (on a sample if the file is huge)
    ids = tok.encode("Hello world")                  # list of ints; tok.decode(ids) gives the exact bytes
    tok.encode_file("corpus.txt", "corpus.tok")      # streaming, a token file, any size of corpus
    tokens = read_token_file("corpus.tok")           # its uint16 tokens, memory-mapped
    tok.save_hf("tokenizer.json")                    # the `tokenizers` library loads it and gives our ids

Ids: 0..255 are the bytes, then one id per new token made by the merges, in merge order, then the special
tokens (`</s>` first). Text is cut into GPT-2 pretokens (letter runs, digit runs, punctuation runs, each
taking a single leading space; whitespace runs; the contractions 's 't 're 've 'm 'll 'd) and merges
never cross a pretoken boundary. Any byte sequence round-trips: bytes that are not valid UTF-8 are
punctuation-class characters of their own. The compiled parts live in nanoeuler/tokenizer/kernels.py.

Token files (`.tok`, the one format: what encode_file writes and what training reads, as its cached
`<corpus>.tok`): a 128-byte header (magic "NEUTOKS\0", format version, token count, the size and mtime of
the text file they were made from, the tokenizer's sha256), then the tokens as little-endian uint16.
read_token_file checks the header, and with `source`/`tok` that the file still matches that text and
tokenizer. The command line, `nanoeuler tokenizer train|encode|decode`, is in nanoeuler/cli.py.
"""
import functools
import hashlib
import io
import json
import os
import re
import struct
import sys
import threading
import time
from importlib import resources

import numpy as np

from nanoeuler.errors import UserError
from nanoeuler.files import atomic_write

UNICODE_VERSION = "16.0.0"  # of unicode_classes.txt, and of the `tokenizers` library's regex engine
MAX_VOCAB = 1 << 16  # token files are uint16
# The scanner looks at most 7 bytes past a pretoken's end (a 3-byte space, then a 4-byte character) to
# decide where it ends, so a pretoken that ends 8 bytes before the end of a chunk is final.
_LOOKAHEAD = 8
_CLASSES = {"L": 1, "N": 2, "W": 3}  # bpe_kernels.LETTER, NUMBER, SPACE; the rest is OTHER (0)
_CHUNK = 8 << 20  # text is tokenized this many bytes at a time
_CACHE_PIECES, _CACHE_BYTES = 1 << 20, 64 << 20  # bound of the encoder's piece cache
TOKENS_MAGIC = b"NEUTOKS\x00"
TOKENS_VERSION = 1
# magic, version, token count, source file size, source mtime_ns, tokenizer sha256 (hex); padded to 128 bytes
TOKENS_HEADER = struct.Struct("<8sI4xQQq64s")
TOKENS_HEADER_BYTES = 128


@functools.cache
def _kernels():
    """The numba kernels, imported on first use (numba's import and compilation are not free)."""
    from nanoeuler.tokenizer import kernels as bpe_kernels

    return bpe_kernels


@functools.cache
def class_table():
    """uint8 class of every code point (unicode_classes.txt, Unicode 16): GPT-2's \\p{L}, \\p{N}, \\s."""
    table = np.zeros(0x110000, np.uint8)
    text = resources.files("nanoeuler.tokenizer").joinpath("unicode_classes.txt").read_text("ascii")
    for line in text.splitlines():
        if line and not line.startswith("#"):
            span, cls = line.split(";")
            lo, _, hi = span.strip().partition("..")
            table[int(lo, 16):int(hi or lo, 16) + 1] = _CLASSES[cls.strip()]
    return table


@functools.cache
def bytes_to_unicode():
    """GPT-2's (and `tokenizers` ByteLevel's) map from each byte to a printable character."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    for b in range(256):
        if b not in bs:  # the other 68 bytes go to the code points from 256 on, in byte order
            cs.append(256 + len(bs) - 188)
            bs.append(b)
    return {b: chr(c) for b, c in zip(bs, cs)}


def _as_bytes(text):
    if isinstance(text, str):
        # lone surrogates cannot be UTF-8; 'surrogatepass' keeps them as (invalid) bytes that round-trip
        return text.encode("utf-8", "surrogatepass")
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    raise TypeError(f"expected str or bytes, got {type(text).__name__}")


def _open_input(path):
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if not os.path.isfile(path):
        f.close()
        raise UserError(f"{path} is not a regular file")
    return f


def _progress_bar(enabled, **kw):
    from tqdm import tqdm

    return tqdm(disable=not enabled, dynamic_ncols=True, **kw)


class Tokenizer:
    """Byte-level BPE: merges learned by train(), applied by encode(); see the module docstring."""

    def __init__(self, merges, special_tokens=("</s>",), ids=None, eos="</s>", decode_only=None):
        """merges: (left, right) pairs of internal token numbers in order (the bytes are 0..255, then each
        merge's new token in merge order); each makes the token of the two tokens' bytes joined (a new token,
        or the existing one of the same bytes). Use train/load/from_json to make one.

        Ids are those internal numbers, special tokens after them, unless `ids` gives each of those tokens
        (bytes, new tokens, specials) the id it has elsewhere (a Hugging Face vocabulary orders its tokens
        its own way); `decode_only` ({id: bytes}) adds vocabulary entries that no merge makes, which encode
        never yields but decode reads. `eos` names the special token that ends a text."""
        merges = np.asarray(merges, dtype=np.int64).reshape(-1, 2)
        token_bytes, results = _merged_tokens(merges)
        specials = list(special_tokens)
        if eos not in specials or len(set(specials)) != len(specials):
            raise UserError(f"special tokens must be distinct and include the end-of-text token {eos!r}")
        index = {t: i for i, t in enumerate(token_bytes)}
        for s in specials:
            data = _as_bytes(s) if isinstance(s, str) and s else None
            if data is None or _split(data)[2] == 1:
                raise UserError(f"special token {s!r} must be a string that ordinary text never yields as a "
                                "single word (mix letters and punctuation, like </s>)")
            if data in index:
                raise UserError(f"special token {s!r} equals an ordinary token")
        self.merges = merges.astype(np.int32)
        self._results = results
        self.n_ordinary = len(token_bytes)
        n_tokens = self.n_ordinary + len(specials)
        ids = np.arange(n_tokens) if ids is None else np.asarray(ids, dtype=np.int64)
        decode_only = {int(i): bytes(b) for i, b in (decode_only or {}).items()}
        if ids.shape != (n_tokens,):
            raise UserError(f"corrupt tokenizer: {len(ids)} ids for {n_tokens} tokens")
        own_ids = not decode_only and (ids == np.arange(n_tokens)).all()
        every_id = np.concatenate([ids, np.fromiter(decode_only, np.int64, len(decode_only))])
        vocab_size = int(every_id.max()) + 1
        if every_id.min() < 0 or len(np.unique(every_id)) != len(every_id) or vocab_size != len(every_id):
            raise UserError("corrupt tokenizer: its ids repeat or leave gaps")
        if vocab_size > MAX_VOCAB:
            raise UserError(f"vocabulary of {vocab_size} tokens is more than uint16 ids allow ({MAX_VOCAB})")
        self.vocab_size = vocab_size
        self._ids = None if own_ids else ids.astype(np.int32)  # internal token -> id, when not the identity
        self._decode_only = decode_only
        self.special_tokens = {s: int(ids[self.n_ordinary + i]) for i, s in enumerate(specials)}
        self.eos = eos
        self.eos_id = self.special_tokens[eos]
        self._token_bytes = [b""] * vocab_size  # by id: what decode reads
        for i, t in enumerate(token_bytes + [s.encode() for s in specials]):
            self._token_bytes[ids[i]] = t
        for i, t in decode_only.items():
            self._token_bytes[i] = t
        by_length = sorted((s.encode() for s in specials), key=len, reverse=True)
        self._special_re = re.compile(b"|".join(map(re.escape, by_length)))
        self._special_ids = {s.encode(): i for s, i in self.special_tokens.items()}
        self._max_special = len(by_length[0])
        self._cache = None  # _PieceCache, made on first encode

    # -------------------------------------------------------------------------------------------- training

    @classmethod
    def train(cls, path, vocab_size, progress=True, special_tokens=("</s>",), max_bytes=128 << 20):
        """Learn merges on the text file at path until the vocabulary (bytes + merges + special tokens)
        has vocab_size tokens. A file larger than max_bytes is sampled: 1 MiB windows spread evenly."""
        n_special = len(special_tokens)
        if not 256 + n_special <= vocab_size <= MAX_VOCAB:
            raise UserError(f"vocab size must be between {256 + n_special} (256 bytes + {n_special} special "
                            f"token{'s' * (n_special != 1)}) and {MAX_VOCAB}, got {vocab_size}")
        kern = _kernels()
        t0 = time.time()
        with _open_input(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise UserError(f"{path} is empty")
            words, lengths, counts, n_bytes = _count_pieces(f, size, max_bytes, progress)
        sym = words.astype(np.int32)
        starts = np.zeros(len(counts) + 1, np.int64)
        starts[1:] = np.cumsum(lengths)
        target = vocab_size - n_special
        done = np.zeros(1, np.int64)
        left, right, _ = _run_with_progress(kern.train_merges, (sym, starts, counts, target, done), done,
                                            target - 256, progress, "merges", start=256)
        merges = np.stack([left, right], axis=1)
        tok = cls(merges, special_tokens)
        if progress:
            print(f"tokenizer: {tok.vocab_size} tokens ({len(merges)} merges) from {n_bytes / 1e6:.1f} MB of "
                  f"{path} ({len(counts)} distinct words) in {time.time() - t0:.1f}s", file=sys.stderr)
        if tok.vocab_size < vocab_size:
            print(f"tokenizer: note: {path} supports only {tok.vocab_size} of the {vocab_size} tokens asked for",
                  file=sys.stderr)
        return tok

    # -------------------------------------------------------------------------------------------- encoding

    def encode(self, text, allow_special=False):
        """Token ids of text (str, or bytes in any encoding). Special tokens written in the text (like
        "</s>") become their ids only with allow_special=True; otherwise they are ordinary text."""
        data = _as_bytes(text)
        if len(data) <= _CHUNK:
            return self._encode_buffer(data, True, allow_special)[0].tolist()
        parts = [ids for ids, _ in self._encode_stream(io.BytesIO(data).read, allow_special)]
        return np.concatenate(parts).tolist()

    def decode(self, ids):
        """The exact bytes that the token ids stand for."""
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise UserError(f"token id {bad} is out of range for a vocabulary of {self.vocab_size}")
        return b"".join(map(self._token_bytes.__getitem__, ids))

    def encode_file(self, in_path, out_path, progress=True, allow_special=False, chunk_bytes=_CHUNK):
        """Tokenize the file in_path into the token file out_path (the module docstring's format, written
        atomically), reading chunk_bytes at a time (the text is never held in memory), with the same ids as
        encode() on the whole text. Returns the token count; read_token_file(out_path) reads the tokens."""
        _open_input(in_path).close()  # a missing input is an error before anything is written

        def write(dst):
            dst.write(bytes(TOKENS_HEADER_BYTES))  # the header needs the token count: written once it is known
            n = 0
            with _open_input(in_path) as f, _progress_bar(progress, total=os.fstat(f.fileno()).st_size,
                                                          unit="B", unit_scale=True, desc="tokenize") as bar:
                source = os.fstat(f.fileno())  # as it was when reading began: a later change makes it stale
                for ids, n_read in self._encode_stream(f.read, allow_special, chunk_bytes):
                    dst.write(ids.astype("<u2").tobytes())
                    n += len(ids)
                    bar.update(n_read)
            dst.seek(0)
            dst.write(_tokens_header(n, source, self))
            count.append(n)

        count = []
        atomic_write(out_path, write)
        return count[0]

    def _encode_stream(self, read, allow_special, chunk_bytes=_CHUNK):
        """Yield (int32 ids, bytes read) chunk by chunk, read(k) giving the next k bytes of the text; the
        unfinished tail of each chunk is carried over, so the ids are those of the whole text."""
        buf = b""
        while True:
            block = read(chunk_bytes)
            buf = buf + block if buf else block
            ids, used = self._encode_buffer(buf, not block, allow_special)
            yield ids, len(block)
            if not block:
                return
            buf = buf[used:]

    def _encode_buffer(self, data, final, allow_special):
        """(int32 ids, bytes used) of data; unless final, only as far as the rest of the text cannot change."""
        parts = []
        start = 0
        margin = _LOOKAHEAD
        if allow_special:
            # A special token found with its longest possible form in view is final; ordinary text
            # before a later one must also stay a lookahead away from where that one may start.
            margin += self._max_special
            for m in self._special_re.finditer(data):
                if not final and m.start() > len(data) - self._max_special:
                    break
                parts.append(self._encode_plain(data, start, m.start(), True, margin)[0])
                parts.append(np.array([self._special_ids[m.group()]], np.int32))
                start = m.end()
        ids, used = self._encode_plain(data, start, len(data), final, margin)
        parts.append(ids)
        return (np.concatenate(parts) if len(parts) > 1 else ids), start + used

    def _encode_plain(self, data, start, end, final, margin):
        arr, ends, n_pieces = _split(memoryview(data)[start:end])
        if not final:
            n_pieces = int(np.searchsorted(ends[:n_pieces], len(arr) - margin, side="right"))
        if self._cache is None:
            self._cache = _PieceCache(self.merges, self._results)
        ids = self._cache.encode(arr, ends, n_pieces)
        return (ids if self._ids is None else self._ids[ids]), int(ends[n_pieces - 1]) if n_pieces else 0

    # ------------------------------------------------------------------------------------ serialization

    def to_json(self):
        """Compact JSON (merges + special tokens): what checkpoints store under __metadata__["tokenizer"].
        Version 2 adds the ids, the end-of-text token and the decode-only entries of a tokenizer whose ids
        are not our own order (an imported one); ours stay version 1, readable by every nanoeuler."""
        d = {"format": "nanoeuler-bpe", "version": 1, "pretokenizer": "gpt2", "unicode": UNICODE_VERSION,
             "merges": self.merges.tolist(), "special_tokens": list(self.special_tokens)}
        if self._ids is not None or self.eos != "</s>":
            ids = self._ids.tolist() if self._ids is not None else list(range(self.vocab_size))
            d.update(version=2, ids=ids, eos=self.eos,
                     decode_only={str(i): t.hex() for i, t in self._decode_only.items()})
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text):
        try:
            d = json.loads(text)
            ok = (d["format"] == "nanoeuler-bpe" and d["version"] in (1, 2) and d["pretokenizer"] == "gpt2"
                  and isinstance(d["merges"], list) and isinstance(d["special_tokens"], list) and "unicode" in d
                  and (d["version"] == 1 or {"ids", "eos", "decode_only"} <= set(d)))
        except (ValueError, TypeError, KeyError):
            ok = False
        if not ok:
            raise UserError("not a nanoeuler tokenizer (corrupt or unknown JSON)")
        if d["unicode"] != UNICODE_VERSION:
            raise UserError(f"tokenizer made with Unicode {d['unicode']} classes; this version has {UNICODE_VERSION}")
        try:
            merges = np.array(d["merges"], dtype=np.int64).reshape(-1, 2)
            extra = {} if d["version"] == 1 else dict(
                ids=d["ids"], eos=d["eos"], decode_only={int(i): bytes.fromhex(t) for i, t in d["decode_only"].items()})
        except (ValueError, TypeError, AttributeError):
            raise UserError("corrupt tokenizer: merges must be pairs of ids") from None
        return cls(merges, d["special_tokens"], **extra)

    def sha256(self):
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def save_hf(self, path):
        """Write a Hugging Face tokenizer.json (byte-level BPE) that gives exactly our ids."""
        atomic_write(path, lambda f: f.write(json.dumps(self._hf_dict(), ensure_ascii=False).encode()))

    def byte_level_names(self):
        """(every token's name by id, the merges as "left right" names): GPT-2's byte-level spelling, which
        tokenizer.json and GGUF store; a special token's name is its text."""
        b2u = bytes_to_unicode()
        names = ["".join(b2u[b] for b in t) for t in self._token_bytes]
        for s, i in self.special_tokens.items():
            names[i] = s
        internal = self._ids if self._ids is not None else np.arange(self.n_ordinary)
        return names, [f"{names[internal[a]]} {names[internal[b]]}" for a, b in self.merges.tolist()]

    def _hf_dict(self):
        names, merges = self.byte_level_names()
        specials = set(self.special_tokens.values())
        vocab = {name: i for i, name in enumerate(names) if i not in specials}
        for s, i in self.special_tokens.items():
            if s in vocab:
                raise UserError(f"special token {s!r} has the same name as ordinary token {vocab[s]} in tokenizer.json")
            vocab[s] = i
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
        return {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for s, i in self.special_tokens.items()],
            "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": vocab,
                      "merges": merges},  # "left right" strings: the form every `tokenizers` version reads
        }

    @classmethod
    def load(cls, path, eos=None):
        """A tokenizer from a file: a Hugging Face byte-level BPE tokenizer.json (ours, from save_hf, or any
        other: its ids kept) or our compact JSON (to_json). eos names the end-of-text token of a
        tokenizer.json (default: </s> if it has one, else its first added token)."""
        with _open_input(path) as f:
            text = f.read()
        try:
            d = json.loads(text)
        except ValueError:
            raise UserError(f"{path} is not JSON") from None
        if isinstance(d, dict) and "model" in d:
            return cls._from_hf(d, path, eos)
        return cls.from_json(text)

    @classmethod
    def _from_hf(cls, d, path, eos=None):
        """Our tokenizer from a tokenizer.json's dict: any byte-level BPE with GPT-2's pretokenization, its
        ids kept; a one-line UserError naming what else it holds that we do not do."""
        u2b = {u: b for b, u in bytes_to_unicode().items()}
        try:
            model, pre, added = d["model"], d.get("pre_tokenizer"), d.get("added_tokens") or []
            vocab = model["vocab"]
            merges = [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]
        except (KeyError, TypeError, AttributeError):
            raise UserError(f"{path} is not a BPE tokenizer.json") from None
        refusal = _hf_refusal(d, model, pre)
        if refusal:
            raise UserError(f"{path}: {refusal}; nanoeuler takes a byte-level BPE with GPT-2's pretokenization")
        specials = sorted((t["id"], t["content"]) for t in added)
        special_ids = {i for i, _ in specials}

        def token_bytes(name):
            try:
                return bytes(u2b[c] for c in name)
            except KeyError:
                raise UserError(f"{path}: vocabulary entry {name!r} is not byte-level") from None

        byte_ids = [vocab.get(chr_) for chr_ in (bytes_to_unicode()[b] for b in range(256))]
        if None in byte_ids:
            raise UserError(f"{path}: the vocabulary lacks byte {byte_ids.index(None)} (a byte-level BPE has all 256)")
        internal = {bytes([b]): b for b in range(256)}  # token bytes -> internal number
        pairs = []
        ids = list(byte_ids)
        for r, pair in enumerate(merges):
            if len(pair) != 2 or any(name not in vocab for name in pair) or "".join(pair) not in vocab:
                raise UserError(f"{path}: merge {r} {pair!r} names tokens outside its vocabulary")
            left, right = (internal.get(token_bytes(name)) for name in pair)
            if left is None or right is None:
                raise UserError(f"{path}: merge {r} {pair!r} uses a token that no earlier merge makes")
            pairs.append((left, right))
            made = token_bytes(pair[0]) + token_bytes(pair[1])
            if made not in internal:
                internal[made] = len(ids)
                ids.append(vocab["".join(pair)])
        made_ids = set(ids)
        decode_only = {i: token_bytes(name) for name, i in vocab.items()
                       if i not in made_ids and i not in special_ids}
        names = [s for _, s in specials]
        if eos is None:
            eos = "</s>" if "</s>" in names else (names[0] if names else None)
        if eos is None:
            raise UserError(f"{path} has no special token to end a text with")
        return cls(pairs, names, ids=ids + [i for i, _ in specials], eos=eos, decode_only=decode_only)


def _hf_refusal(d, model, pre):
    """What in a tokenizer.json nanoeuler's BPE does not do, in a few words, or None."""
    byte_level = lambda p: (isinstance(p, dict) and p.get("type") == "ByteLevel"  # noqa: E731
                            and not p.get("add_prefix_space") and p.get("use_regex", True))
    if model.get("type") != "BPE":
        return f"its model is {model.get('type')}, not BPE"
    if not byte_level(pre):
        kind = pre.get("type") if isinstance(pre, dict) else pre
        if kind == "Sequence":
            kind = "Sequence of " + ", ".join(p.get("type", "?") for p in pre.get("pretokenizers", []))
        return f"its pre-tokenizer is {kind}, not ByteLevel (GPT-2 regex, no prefix space)"
    if d.get("normalizer") is not None:
        return f"it has a normalizer ({d['normalizer'].get('type')})"
    post = d.get("post_processor")
    if post is not None and _adds_tokens(post):
        return f"its post-processor ({post.get('type')}) adds tokens to every text"
    for key in ("byte_fallback", "ignore_merges", "continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(key):
            return f"its BPE has {key} = {model[key]!r}"
    return None


def _adds_tokens(post):
    """Whether a tokenizer.json post-processor adds tokens to a single text (ByteLevel only fixes offsets; the
    TemplateProcessing transformers writes for a tokenizer without BOS is the text alone)."""
    kind = post.get("type")
    if kind == "Sequence":
        return any(_adds_tokens(p) for p in post.get("processors", []))
    if kind == "TemplateProcessing":
        return any("SpecialToken" in item for item in post.get("single", []))
    return kind != "ByteLevel"


def _merged_tokens(merges):
    """(bytes of every ordinary token in internal order: the 256 bytes, then each merge's new token; the
    internal number of each merge's result) for merges of internal numbers."""
    token_bytes = [bytes([b]) for b in range(256)]
    index = {t: i for i, t in enumerate(token_bytes)}
    results = np.empty(len(merges), np.int32)
    seen = set()
    for r, (a, b) in enumerate(merges.tolist()):
        if not (0 <= a < len(token_bytes) and 0 <= b < len(token_bytes)) or (a, b) in seen:
            raise UserError(f"corrupt tokenizer: merge {r} ({a}, {b}) is invalid or repeated")
        seen.add((a, b))
        t = token_bytes[a] + token_bytes[b]
        if t not in index:
            index[t] = len(token_bytes)
            token_bytes.append(t)
        results[r] = index[t]
    return token_bytes, results


def _tokens_header(n_tokens, source_stat, tok):
    return TOKENS_HEADER.pack(TOKENS_MAGIC, TOKENS_VERSION, n_tokens, source_stat.st_size,
                              source_stat.st_mtime_ns, tok.sha256().encode())


def read_token_file(path, source=None, tok=None):
    """The tokens of a token file (Tokenizer.encode_file) as a read-only uint16 memmap (a corpus of many GB
    costs no RAM). With `source` (a path) or `tok`, the file must have been made from that file as it is now
    (same size and mtime) and with that tokenizer. Every way it can fail is a one-line UserError."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            head = f.read(TOKENS_HEADER.size)
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise UserError(f"token file {path} not found") from None
    except OSError as e:
        raise UserError(f"cannot read token file {path}: {e.strerror or e}") from None
    if len(head) < TOKENS_HEADER.size or head[:8] != TOKENS_MAGIC:
        raise UserError(f"{path} is not a nanoeuler token file")
    _, version, n_tokens, src_size, src_mtime, sha = TOKENS_HEADER.unpack(head)
    if version != TOKENS_VERSION:
        raise UserError(f"token file {path} has format version {version}; this nanoeuler reads {TOKENS_VERSION}")
    if size != TOKENS_HEADER_BYTES + 2 * n_tokens:
        raise UserError(f"token file {path} is truncated or corrupt ({size} bytes for {n_tokens} tokens)")
    if source is not None:
        try:
            st = os.stat(source)
        except OSError as e:
            raise UserError(f"cannot read {source}: {e.strerror or e}") from None
        if (st.st_size, st.st_mtime_ns) != (src_size, src_mtime):
            raise UserError(f"token file {path} is stale: {source} changed since it was tokenized")
    if tok is not None and sha != tok.sha256().encode():
        raise UserError(f"token file {path} was made with a different tokenizer")
    if n_tokens == 0:  # np.memmap cannot map zero bytes
        return np.zeros(0, "<u2")
    return np.memmap(path, dtype="<u2", mode="r", offset=TOKENS_HEADER_BYTES, shape=(n_tokens,))


def _split(data):
    """GPT-2 pretokenization of the bytes data: (data as a uint8 array, piece end offsets, piece count).
    The array is a writable copy: the kernels are compiled for one array type, the one they make inside."""
    arr = np.frombuffer(bytearray(data), np.uint8)
    ends = np.empty(len(arr), np.int32)
    return arr, ends, _kernels().split_pieces(arr, len(arr), class_table(), ends)


class _PieceTable:
    """Distinct pieces, numbered in order of first appearance (bpe_kernels.intern_pieces)."""

    def __init__(self):
        self.state = np.zeros(2, np.int64)  # entries, key bytes used
        self.arrays = (np.empty(1 << 12, np.uint64), np.full(1 << 12, -1, np.int64), np.empty(1 << 11, np.uint64),
                       np.empty(1 << 11, np.int64), np.empty(1 << 11, np.int64), np.empty(1 << 16, np.uint8))

    def __len__(self):
        return int(self.state[0])

    def intern(self, arr, ends, n_pieces):
        """Ids of the first n_pieces pieces of arr (ends as from _split), adding new pieces."""
        ids, *arrays = _kernels().intern_pieces(arr, ends, n_pieces, self.state, *self.arrays)
        self.arrays = tuple(arrays)
        return ids

    def pieces(self):
        """(bytes of all pieces back to back, each one's offset, each one's length)."""
        n, used = len(self), int(self.state[1])
        _, _, _, key_off, key_len, key_buf = self.arrays
        return key_buf[:used], key_off[:n], key_len[:n]


class _PieceCache:
    """The tokens of every distinct piece met so far, so that each is merged once; it starts afresh when
    it holds more than _CACHE_PIECES pieces or _CACHE_BYTES of them (memory stays bounded on any corpus)."""

    def __init__(self, merges, results):
        self.pair_key, self.pair_rank = _kernels().merge_table(merges)
        self.results = results
        self.reset()

    def reset(self):
        self.table = _PieceTable()
        self.tok_off = np.empty(1 << 11, np.int64)
        self.tok_len = np.empty(1 << 11, np.int64)
        self.tok_buf = np.empty(1 << 14, np.int32)
        self.tok_used = 0

    def encode(self, arr, ends, n_pieces):
        if len(self.table) > _CACHE_PIECES or self.table.state[1] > _CACHE_BYTES:
            self.reset()
        first = len(self.table)
        ids = self.table.intern(arr, ends, n_pieces)
        if len(self.table) > first:
            key_buf, key_off, key_len = self.table.pieces()
            self.tok_off, self.tok_len, self.tok_buf, self.tok_used = _kernels().bpe_pieces(
                key_buf, key_off, key_len, first, len(self.table), self.pair_key, self.pair_rank, self.results,
                self.tok_off, self.tok_len, self.tok_buf, self.tok_used)
        return _kernels().gather(ids, self.tok_off, self.tok_len, self.tok_buf)


def _count_pieces(f, size, max_bytes, progress):
    """Count the pretokens of the open file f (all of it, or 1 MiB windows spread evenly over it if it is
    larger than max_bytes). Returns (bytes of the distinct pieces back to back, their lengths, their
    counts, bytes read)."""
    table = _PieceTable()
    counts = np.zeros(0, np.int64)

    def count(data, final):
        nonlocal counts
        arr, ends, n_pieces = _split(data)
        if not final:
            n_pieces = int(np.searchsorted(ends[:n_pieces], len(arr) - _LOOKAHEAD, side="right"))
        ids = table.intern(arr, ends, n_pieces)
        counts = np.concatenate((counts, np.zeros(len(table) - len(counts), np.int64)))
        counts += np.bincount(ids, minlength=len(table))
        return int(ends[n_pieces - 1]) if n_pieces else 0

    window = 1 << 20
    n_windows = max(1, max_bytes // window)
    n_read = 0
    with _progress_bar(progress, total=size if size <= max_bytes else n_windows * window, unit="B",
                       unit_scale=True, desc="count words") as bar:
        if size > max_bytes:
            for k in range(n_windows):
                f.seek(k * size // n_windows)
                block = f.read(window)
                count(block[block.find(b"\n") + 1:] if k else block, True)  # from a line start, not mid-word
                n_read += len(block)
                bar.update(len(block))
        else:
            buf = b""
            while True:
                block = f.read(_CHUNK)
                buf += block
                buf = buf[count(buf, not block):]
                n_read += len(block)
                bar.update(len(block))
                if not block:
                    break
    key_buf, _, key_len = table.pieces()
    if len(key_buf) >= 1 << 31:
        raise UserError("the training sample has too many distinct words; use a smaller sample size")
    return key_buf, key_len, counts, n_read


def _run_with_progress(fn, args, done, total, enabled, desc, start=0):
    """Run a nogil numba kernel in a thread while a progress bar follows done[0] (which it updates)."""
    if not enabled:
        return fn(*args)
    result = []
    errors = []

    def target():
        try:
            result.append(fn(*args))
        except BaseException as e:  # re-raised in the calling thread
            errors.append(e)

    worker = threading.Thread(target=target, daemon=True)
    with _progress_bar(True, total=total, desc=desc) as bar:
        worker.start()
        while worker.is_alive():
            worker.join(0.2)
            bar.n = max(int(done[0]) - start, 0)
            bar.refresh()
    if errors:
        raise errors[0]
    return result[0]
