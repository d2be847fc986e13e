"""What the tokenizer's readers share: the Unicode classes of GPT-2's pretokenizer (unicode_classes.txt), GPT-2's
byte-to-character map, the pretokenization rules that the compiled scanner of kernels.py knows, the tables that
intern pieces and cache their tokens (bpe.py drives them, train.py counts pieces with them), and merge_symbols,
the merging of one word by rank (sentencepiece_bpe.py, grammar.py)."""
import functools
import heapq
import re
from importlib import resources

import numpy as np

UNICODE_VERSION = "16.0.0"  # of unicode_classes.txt, and of the `tokenizers` library's regex engine
# Pretokenization rules, by the name the JSON forms store: GPT-2's regex; GPT-2's after Digits(individual_digits)
# (SmolLM, SmolLM2); Llama 3's Split regex (digits three at a time); Qwen2's (the same, digits one at a time).
RULES = ("gpt2", "gpt2_digits", "llama3", "qwen2")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
# The scanner looks at most 7 bytes past a pretoken's end (a 3-byte space, then a 4-byte character) to
# decide where it ends, so a pretoken that ends 8 bytes before the end of a chunk is final.
_LOOKAHEAD = 8
_CLASSES = {"L": 1, "N": 2, "W": 3}  # bpe_kernels.LETTER, NUMBER, SPACE; the rest is OTHER (0)
_CACHE_PIECES, _CACHE_BYTES = 1 << 20, 64 << 20  # bound of the encoder's piece cache


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


@functools.cache
def _byte_level_decoding():
    """str.translate's table from a byte-level name's characters to the bytes they stand for (as latin-1
    characters); any other character below 256 becomes a lone surrogate, which latin-1 cannot encode."""
    table = {c: "\ud800" for c in range(256)}
    table.update({ord(c): chr(b) for b, c in bytes_to_unicode().items()})
    return table


def _split(data, rule="gpt2"):
    """Pretokenization of the bytes data by a rule of RULES (GPT-2's by default): (data as a uint8 array,
    piece end offsets, piece count). The array is a writable copy: the kernels are compiled for one array
    type, the one they make inside."""
    arr = np.frombuffer(bytearray(data), np.uint8)
    ends = np.empty(len(arr), np.int32)
    kern = _kernels()
    if rule == "gpt2":
        return arr, ends, kern.split_pieces(arr, len(arr), class_table(), ends)
    if rule == "gpt2_digits":
        return arr, ends, kern.split_pieces_digits(arr, len(arr), class_table(), ends)
    return arr, ends, kern.split_pieces_llama3(arr, len(arr), class_table(), ends, 3 if rule == "llama3" else 1)


def _alternation(strings):
    """(compiled regex of the strings as bytes, longest first, and the longest one's length), or (None, 0): how
    added tokens are found in a text, leftmost, then longest (as `tokenizers` finds them)."""
    if not strings:
        return None, 0
    by_length = sorted((s.encode() for s in strings), key=len, reverse=True)
    return re.compile(b"|".join(map(re.escape, by_length))), len(by_length[0])


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

    def __init__(self, merges, results, byte_tok, whole_tokens=None):
        """whole_tokens: the bytes of every token by internal number, when a piece that is a token is that
        token (ignore_merges)."""
        self.pair_key, self.pair_rank = _kernels().merge_table(merges)
        self.results = results
        self.byte_tok = byte_tok
        self.whole = whole_tokens is not None
        vocab = _PieceTable()
        if self.whole:
            data = np.frombuffer(b"".join(whole_tokens), np.uint8).copy()
            ends = np.cumsum([len(t) for t in whole_tokens]).astype(np.int32)
            vocab.intern(data, ends, len(whole_tokens))
        slot_hash, slot_entry, _, key_off, key_len, key_buf = vocab.arrays
        self.vocab = (slot_hash, slot_entry, key_off, key_len, key_buf)
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
                key_buf, key_off, key_len, first, len(self.table), self.byte_tok, self.pair_key, self.pair_rank,
                self.results, self.whole, *self.vocab, self.tok_off, self.tok_len, self.tok_buf, self.tok_used)
        return _kernels().gather(ids, self.tok_off, self.tok_len, self.tok_buf)


def merge_symbols(syms, merges):
    """The tokens of a word's first symbols (a list, changed in place) merged by rank, lowest first, leftmost on
    ties, as `tokenizers`' BPE does: merges maps (left, right) to (rank, merged); a heap of candidate pairs,
    stale entries skipped when their pair no longer makes the same token."""
    n = len(syms)
    heap = [(m[0], p, m[1]) for p in range(n - 1) if (m := merges.get((syms[p], syms[p + 1])))]
    if not heap:
        return syms
    heapq.heapify(heap)
    nxt, prv, alive = list(range(1, n + 1)), list(range(-1, n - 1)), [True] * n
    while heap:
        _, p, made = heapq.heappop(heap)
        q = nxt[p]
        if not alive[p] or q >= n:
            continue
        m = merges.get((syms[p], syms[q]))
        if m is None or m[1] != made:
            continue
        syms[p], alive[q] = made, False
        nxt[p] = nxt[q]
        if nxt[q] < n:
            prv[nxt[q]] = p
        if prv[p] >= 0 and (m := merges.get((syms[prv[p]], made))):
            heapq.heappush(heap, (m[0], prv[p], m[1]))
        if nxt[p] < n and (m := merges.get((made, syms[nxt[p]]))):
            heapq.heappush(heap, (m[0], p, m[1]))
    return [s for s, a in zip(syms, alive) if a]


def cached_tokens(words, cache, merge_word, bound=1 << 20):
    """The ids of words, each merged once (merge_word) and kept in the dict cache, which starts afresh beyond
    bound words (memory stays bounded on any corpus)."""
    if len(cache) > bound:
        cache.clear()
    ids = []
    for w in words:
        got = cache.get(w)
        if got is None:
            got = cache[w] = merge_word(w)
        ids += got
    return ids


def as_text(text):
    """text (str, or bytes: UTF-8, a byte that is not as a surrogate escape) as str."""
    if isinstance(text, str):
        return text
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text).decode("utf-8", "surrogateescape")
    raise TypeError(f"expected str or bytes, got {type(text).__name__}")
