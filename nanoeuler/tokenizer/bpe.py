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
punctuation-class characters of their own. The compiled parts live in nanoeuler/bpe_kernels.py.

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
from nanoeuler.io.files import atomic_write

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

    def __init__(self, merges, special_tokens=("</s>",)):
        """merges: (left id, right id) pairs in order; each makes the token of the two tokens' bytes
        joined (a new id, or the existing id of the same bytes). Use train/load/from_json to make one."""
        merges = np.asarray(merges, dtype=np.int64).reshape(-1, 2)
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
        specials = list(special_tokens)
        if "</s>" not in specials or len(set(specials)) != len(specials):
            raise UserError("special tokens must be distinct and include </s>")
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
        self.special_tokens = {s: self.n_ordinary + i for i, s in enumerate(specials)}
        self.vocab_size = self.n_ordinary + len(specials)
        if self.vocab_size > MAX_VOCAB:
            raise UserError(f"vocabulary of {self.vocab_size} tokens is more than uint16 ids allow ({MAX_VOCAB})")
        self.eos_id = self.special_tokens["</s>"]
        self._token_bytes = token_bytes + [s.encode() for s in specials]
        by_length = sorted(self._token_bytes[self.n_ordinary:], key=len, reverse=True)
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
        return self._cache.encode(arr, ends, n_pieces), int(ends[n_pieces - 1]) if n_pieces else 0

    # ------------------------------------------------------------------------------------ serialization

    def to_json(self):
        """Compact JSON (merges + special tokens): what checkpoints store under __metadata__["tokenizer"]."""
        return json.dumps({"format": "nanoeuler-bpe", "version": 1, "pretokenizer": "gpt2",
                           "unicode": UNICODE_VERSION, "merges": self.merges.tolist(),
                           "special_tokens": list(self.special_tokens)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text):
        try:
            d = json.loads(text)
            ok = (d["format"] == "nanoeuler-bpe" and d["version"] == 1 and d["pretokenizer"] == "gpt2"
                  and isinstance(d["merges"], list) and isinstance(d["special_tokens"], list) and "unicode" in d)
        except (ValueError, TypeError, KeyError):
            ok = False
        if not ok:
            raise UserError("not a nanoeuler tokenizer (corrupt or unknown JSON)")
        if d["unicode"] != UNICODE_VERSION:
            raise UserError(f"tokenizer made with Unicode {d['unicode']} classes; this version has {UNICODE_VERSION}")
        try:
            merges = np.array(d["merges"], dtype=np.int64).reshape(-1, 2)
        except (ValueError, TypeError):
            raise UserError("corrupt tokenizer: merges must be pairs of ids") from None
        return cls(merges, d["special_tokens"])

    def sha256(self):
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def save_hf(self, path):
        """Write a Hugging Face tokenizer.json (byte-level BPE) that gives exactly our ids."""
        atomic_write(path, lambda f: f.write(json.dumps(self._hf_dict(), ensure_ascii=False).encode()))

    def _hf_dict(self):
        b2u = bytes_to_unicode()
        names = ["".join(b2u[b] for b in t) for t in self._token_bytes[:self.n_ordinary]]
        vocab = {name: i for i, name in enumerate(names)}
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
                      # "left right" strings: the form every `tokenizers` version reads
                      "merges": [f"{names[a]} {names[b]}" for a, b in self.merges.tolist()]},
        }

    @classmethod
    def load(cls, path):
        """A tokenizer from a file: our tokenizer.json (save_hf) or our compact JSON (to_json)."""
        with _open_input(path) as f:
            text = f.read()
        try:
            d = json.loads(text)
        except ValueError:
            raise UserError(f"{path} is not JSON") from None
        if isinstance(d, dict) and "model" in d:
            return cls._from_hf(d, path)
        return cls.from_json(text)

    @classmethod
    def _from_hf(cls, d, path):
        b2u = bytes_to_unicode()
        try:
            model, pre = d["model"], d["pre_tokenizer"]
            vocab = model["vocab"]
            ok = (model["type"] == "BPE" and pre["type"] == "ByteLevel" and not pre["add_prefix_space"]
                  and pre.get("use_regex", True) and d.get("normalizer") is None
                  and all(vocab.get(b2u[b]) == b for b in range(256)))
            merges = [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]
            merges = [(vocab[a], vocab[b]) for a, b in merges]
            added = sorted((t["id"], t["content"]) for t in d["added_tokens"])
        except (KeyError, TypeError, ValueError, AttributeError):
            ok = False
        if not ok:
            raise UserError(f"{path} is not a byte-level BPE tokenizer.json of nanoeuler's layout")
        tok = cls(merges, [s for _, s in added])
        names = {"".join(b2u[b] for b in t): i for i, t in enumerate(tok._token_bytes[:tok.n_ordinary])}
        if (any(vocab.get(name) != i for name, i in names.items())
                or [i for i, _ in added] != list(tok.special_tokens.values())):
            raise UserError(f"{path}: vocabulary ids disagree with its merges (not nanoeuler's layout)")
        return tok


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
