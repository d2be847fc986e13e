"""The byte-level BPE tokenizer, written here: no tokenizer library at run time.

    tok = Tokenizer.train("shakespeare.txt", 4096)   # learn merges (on a sample if the file is huge)
    ids = tok.encode("Hello world")                  # list of ints; tok.decode(ids) gives the exact bytes
    tok.encode_file("corpus.txt", "corpus.tok")      # streaming, a token file, any size of corpus
    tokens = read_token_file("corpus.tok")           # its uint16 (or uint32) tokens, memory-mapped
    tok.save_hf("tokenizer.json")                    # the `tokenizers` library loads it and gives our ids

Ids: 0..255 are the bytes, then one id per new token made by the merges, in merge order, then the special
tokens (`</s>` first). Text is cut into GPT-2 pretokens (letter runs, digit runs, punctuation runs, each
taking a single leading space; whitespace runs; the contractions 's 't 're 've 'm 'll 'd) and merges
never cross a pretoken boundary. Any byte sequence round-trips: bytes that are not valid UTF-8 are
punctuation-class characters of their own. The compiled parts live in nanoeuler/tokenizer/kernels.py.

Token files (`.tok`, the one format: what encode_file writes and what training reads, as its cached
`<corpus>.tok`): a 128-byte header (magic "NEUTOKS\0", format version, token count, the size and mtime of
the text file they were made from, the tokenizer's sha256), then the tokens as little-endian uint16
(format version 1), or uint32 (version 2) for a vocabulary above 65,536.
read_token_file checks the header, and with `source`/`tok` that the file still matches that text and
tokenizer. The command line, `nanoeuler tokenizer train|encode|decode`, is in nanoeuler/cli.py.
"""
import functools
import io
import json
import os
import re
import sys
import threading
import time
import unicodedata
from importlib import resources

import numpy as np

from nanoeuler.errors import UserError
from nanoeuler.files import atomic_write
from nanoeuler.tokenizer.base import (CHUNK, MAX_IDS, MAX_VOCAB, TOKENS_HEADER, TOKENS_HEADER_BYTES, TOKENS_MAGIC,
                                      TOKENS_VERSION, TokenizerBase, checked_ids, open_input, post_bos,
                                      progress_bar)

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


def _as_bytes(text):
    if isinstance(text, str):
        # lone surrogates cannot be UTF-8; 'surrogatepass' keeps them as (invalid) bytes that round-trip
        return text.encode("utf-8", "surrogatepass")
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    raise TypeError(f"expected str or bytes, got {type(text).__name__}")


class Tokenizer(TokenizerBase):
    """Byte-level BPE: merges learned by train(), applied by encode(); see the module docstring."""

    def __init__(self, merges, special_tokens=("</s>",), ids=None, eos="</s>", decode_only=None, *, tokens=None,
                 rule="gpt2", ignore_merges=False, bos=None, nonspecial=(), normalizer=None):
        """merges: (left, right) pairs of internal token numbers in order (the bytes are 0..255, then each
        merge's new token in merge order); each makes the token of the two tokens' bytes joined (a new token,
        or the existing one of the same bytes). Use train/load/from_json to make one.

        Ids are those internal numbers, special tokens after them, unless `ids` gives each of those tokens
        (bytes, new tokens, specials) the id it has elsewhere (a Hugging Face vocabulary orders its tokens
        its own way); `decode_only` ({id: bytes}) adds vocabulary entries that no merge makes, which encode
        never yields but decode reads. `eos` names the special token that ends a text.

        The form of a tokenizer loaded from a Hugging Face tokenizer.json that the form above cannot hold:
        `tokens`, the bytes of every ordinary token (internal numbers are their positions; a merge makes
        the token of its two tokens' bytes, which must be listed, so a merge may use a token that a later
        merge makes; a byte with no single-byte token is dropped from the text); `rule`, the pretokenization
        (RULES); `ignore_merges`, a pretoken that is a token is that token; `bos`, a special token that
        encode() puts first by default; `nonspecial`, the added tokens (of special_tokens) that every text
        is split on, as `tokenizers` does, not only with allow_special; `normalizer`, "nfc" to put the text
        between added tokens in Unicode NFC before it is split (Qwen2's), or None."""
        merges = np.asarray(merges, dtype=np.int64).reshape(-1, 2)
        if rule not in RULES:
            raise UserError(f"unknown pretokenization rule {rule!r} (nanoeuler has {', '.join(RULES)})")
        if normalizer not in (None, "nfc"):
            raise UserError(f"unknown normalizer {normalizer!r} (nanoeuler has nfc)")
        if tokens is None:
            token_bytes, results = _merged_tokens(merges)
            byte_tok = np.arange(256, dtype=np.int32)
        else:
            token_bytes, results, byte_tok = _listed_tokens(merges, tokens)
        explicit = (tokens is not None or rule != "gpt2" or ignore_merges or bos is not None or bool(nonspecial)
                    or normalizer is not None)
        specials = list(special_tokens)
        if eos not in specials or len(set(specials)) != len(specials):
            raise UserError(f"special tokens must be distinct and include the end-of-text token {eos!r}")
        if bos is not None and bos not in specials:
            raise UserError(f"the beginning-of-text token {bos!r} is not one of the special tokens")
        if not set(nonspecial) <= set(specials):
            raise UserError("corrupt tokenizer: a non-special added token is not among the added tokens")
        index = {t: i for i, t in enumerate(token_bytes)}
        for s in specials:
            data = _as_bytes(s) if isinstance(s, str) and s else None
            if data is None:
                raise UserError(f"special token {s!r} must be a non-empty string")
            if explicit:  # a loaded tokenizer's added tokens are whatever its file says (they win over text)
                continue
            if _split(data)[2] == 1:
                raise UserError(f"special token {s!r} must be a string that ordinary text never yields as a "
                                "single word (mix letters and punctuation, like </s>)")
            if data in index:
                raise UserError(f"special token {s!r} equals an ordinary token")
        self.merges = merges.astype(np.int32)
        self._results = results
        self._byte_tok = byte_tok
        self._explicit = explicit
        self.rule = rule
        self.normalizer = normalizer
        self.ignore_merges = bool(ignore_merges)
        self.n_ordinary = len(token_bytes)
        self._ordinary_bytes = token_bytes
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
        if vocab_size > MAX_IDS:
            raise UserError(f"vocabulary of {vocab_size} tokens is more than int32 ids allow")
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
        self.nonspecial = [s for s in specials if s in set(nonspecial)]
        self.bos = bos
        self.bos_id = None if bos is None else self.special_tokens[bos]
        # added tokens in text: leftmost, then longest (as `tokenizers` finds them); all of them with
        # allow_special, else the non-special ones
        self._added_re = {True: _alternation(specials), False: _alternation(self.nonspecial)}
        self._special_ids = {s.encode(): i for s, i in self.special_tokens.items()}
        self.token_dtype = np.dtype("<u2" if vocab_size <= MAX_VOCAB else "<u4")  # of token files
        self._cache = None  # _PieceCache, made on first encode
        self.set_chat()

    # -------------------------------------------------------------------------------------------- training

    @classmethod
    def train(cls, path, vocab_size, progress=True, special_tokens=("</s>",), max_bytes=128 << 20):
        """Learn merges on the text file at path until the vocabulary (bytes + merges + special tokens)
        has vocab_size tokens. A file larger than max_bytes is sampled: 1 MiB windows spread evenly."""
        n_special = len(special_tokens)
        if not 256 + n_special <= vocab_size <= MAX_IDS:
            raise UserError(f"vocab size must be between {256 + n_special} (256 bytes + {n_special} special "
                            f"token{'s' * (n_special != 1)}) and {MAX_IDS}, got {vocab_size}")
        kern = _kernels()
        t0 = time.time()
        with open_input(path) as f:
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

    def encode(self, text, allow_special=False, add_bos=None):
        """Token ids of text (str, or bytes in any encoding). Special tokens written in the text (like
        "</s>") become their ids only with allow_special=True; otherwise they are ordinary text (a loaded
        tokenizer's non-special added tokens are always found). add_bos: put the beginning-of-text token
        first; by default when the tokenizer has one (a loaded tokenizer whose file adds it; ours have none)."""
        data = _as_bytes(text)
        if len(data) <= CHUNK:
            ids = self._encode_buffer(data, True, allow_special)[0].tolist()
        else:
            parts = [ids for ids, _ in self._encode_stream(io.BytesIO(data).read, allow_special)]
            ids = np.concatenate(parts).tolist()
        if self.bos_id is not None and (add_bos is None or add_bos):
            ids.insert(0, self.bos_id)
        return ids

    def encode_ordinary(self, text):
        """Token ids of text with no added token recognised, special or not, and no BOS: how a chat template's
        renderer encodes what the user wrote (transformers' split_special_tokens)."""
        data = _as_bytes(text)
        return self._encode_plain(data, 0, len(data), True, 0)[0].tolist()

    def decode(self, ids, text_start=False):
        """The exact bytes that the token ids stand for (text_start: the ids begin a text, which changes nothing
        here; a SentencePiece-style tokenizer drops the space it put in front)."""
        ids = checked_ids(ids, self.vocab_size)
        return b"".join(map(self._token_bytes.__getitem__, ids))

    def _encode_stream(self, read, allow_special, chunk_bytes=CHUNK):
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
        pattern, longest = self._added_re[bool(allow_special)]
        if pattern is not None:
            # A special token found with its longest possible form in view is final; ordinary text
            # before a later one must also stay a lookahead away from where that one may start.
            margin += longest
            for m in pattern.finditer(data):
                if not final and m.start() > len(data) - longest:
                    break
                parts.append(self._encode_plain(data, start, m.start(), True, margin)[0])
                parts.append(np.array([self._special_ids[m.group()]], np.int32))
                start = m.end()
        ids, used = self._encode_plain(data, start, len(data), final, margin)
        parts.append(ids)
        return (np.concatenate(parts) if len(parts) > 1 else ids), start + used

    def _encode_plain(self, data, start, end, final, margin):
        if self.normalizer is not None:
            return self._encode_normalized(data, start, end, final, margin)
        arr, ends, n_pieces = _split(memoryview(data)[start:end], self.rule)
        if not final:
            n_pieces = int(np.searchsorted(ends[:n_pieces], len(arr) - margin, side="right"))
            if self.rule in ("llama3", "qwen2"):
                # \s*[\r\n]+ looks to the end of a whitespace run: pieces of a run the text may continue wait
                while n_pieces and arr[ends[n_pieces - 2] if n_pieces > 1 else 0:ends[n_pieces - 1]].tobytes().decode(
                        "utf-8", "replace").isspace():
                    n_pieces -= 1
        if self._cache is None:
            self._cache = _PieceCache(self.merges, self._results, self._byte_tok,
                                      self._ordinary_bytes if self.ignore_merges else None)
        ids = self._cache.encode(arr, ends, n_pieces)
        return (ids if self._ids is None else self._ids[ids]), int(ends[n_pieces - 1]) if n_pieces else 0

    def _encode_normalized(self, data, start, end, final, margin):
        """_encode_plain of the NFC form of data[start:end]; unless final, only up to the last newline that a
        printable ASCII character follows (NFC and every rule's split restart there)."""
        cut = end
        if not final:
            cut = data.rfind(b"\n", start, max(start, end - margin))
            while cut >= start and not 0x21 <= data[cut + 1] <= 0x7E:
                cut = data.rfind(b"\n", start, cut)
            cut = max(cut + 1, start)
        text = bytes(data[start:cut]).decode("utf-8", "surrogateescape")
        normal = unicodedata.normalize("NFC", text).encode("utf-8", "surrogateescape")
        arr, ends, n_pieces = _split(normal, self.rule)
        if self._cache is None:
            self._cache = _PieceCache(self.merges, self._results, self._byte_tok,
                                      self._ordinary_bytes if self.ignore_merges else None)
        ids = self._cache.encode(arr, ends, n_pieces)
        return (ids if self._ids is None else self._ids[ids]), cut - start

    # ------------------------------------------------------------------------------------ serialization

    def to_json(self):
        """Compact JSON (merges + special tokens): what checkpoints store under __metadata__["tokenizer"].
        Version 2 adds the ids, the end-of-text token and the decode-only entries of a tokenizer whose ids
        are not our own order (an imported one); ours stay version 1, readable by every nanoeuler. Any
        version may add what set_chat holds where it is not the default: `chat_template`, `end_ids` and
        `named_tokens`."""
        d = {"format": "nanoeuler-bpe", "version": 1, "pretokenizer": "gpt2", "unicode": UNICODE_VERSION,
             "merges": self.merges.tolist(), "special_tokens": list(self.special_tokens)}
        if self._explicit:  # version 3: the token list, the rule and the rest of a loaded tokenizer.json
            ids = self._ids.tolist() if self._ids is not None else list(range(self.vocab_size))
            d.update(version=3, pretokenizer=self.rule, ids=ids, eos=self.eos,
                     decode_only={str(i): t.hex() for i, t in self._decode_only.items()},
                     tokens=[t.hex() for t in self._ordinary_bytes], ignore_merges=self.ignore_merges,
                     bos=self.bos, nonspecial=self.nonspecial)
            if self.normalizer is not None:
                d["normalizer"] = self.normalizer
        elif self._ids is not None or self.eos != "</s>":
            ids = self._ids.tolist() if self._ids is not None else list(range(self.vocab_size))
            d.update(version=2, ids=ids, eos=self.eos,
                     decode_only={str(i): t.hex() for i, t in self._decode_only.items()})
        d.update(self._chat_json())
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text):
        """A tokenizer from its compact JSON (to_json's); a SentencePiece-style one's is that class's."""
        try:
            d = json.loads(text)
            if isinstance(d, dict) and d.get("format") == "nanoeuler-sentencepiece-bpe":
                from nanoeuler.tokenizer.sentencepiece_bpe import SentencePieceBPE

                return SentencePieceBPE.from_json(text)
            ok = (d["format"] == "nanoeuler-bpe" and d["version"] in (1, 2, 3)
                  and d["pretokenizer"] in (RULES if d["version"] == 3 else ("gpt2",))
                  and isinstance(d["merges"], list) and isinstance(d["special_tokens"], list) and "unicode" in d
                  and (d["version"] == 1 or {"ids", "eos", "decode_only"} <= set(d))
                  and (d["version"] < 3 or {"tokens", "ignore_merges", "bos", "nonspecial"} <= set(d)))
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
            if d["version"] == 3:
                extra.update(tokens=[bytes.fromhex(t) for t in d["tokens"]], rule=d["pretokenizer"],
                             ignore_merges=bool(d["ignore_merges"]), bos=d["bos"], nonspecial=d["nonspecial"],
                             normalizer=d.get("normalizer"))
        except (ValueError, TypeError, AttributeError):
            raise UserError("corrupt tokenizer: merges must be pairs of ids") from None
        return cls(merges, d["special_tokens"], **extra).set_chat(d.get("chat_template"), d.get("end_ids"),
                                                                  d.get("named_tokens"))

    def save_hf(self, path):
        """Write a Hugging Face tokenizer.json (byte-level BPE) that gives exactly our ids."""
        atomic_write(path, lambda f: f.write(json.dumps(self._hf_dict(), ensure_ascii=False).encode()))

    def byte_level_names(self):
        """(every token's name by id, the merges as "left right" names): GPT-2's byte-level spelling, which
        tokenizer.json and GGUF store; a special token's name is its text."""
        b2u = bytes_to_unicode()
        names = [t.decode("latin-1").translate(b2u) for t in self._token_bytes]  # b2u: str.translate's table
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
        pre = byte_level
        if self.rule == "gpt2_digits":
            pre = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}
        elif self.rule in ("llama3", "qwen2"):
            split = {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX if self.rule == "llama3" else QWEN2_REGEX},
                     "behavior": "Isolated", "invert": False}
            pre = {"type": "Sequence", "pretokenizers": [split, {**byte_level, "use_regex": False}]}
        post = None
        if self.bos is not None:
            post = {"type": "TemplateProcessing",
                    "single": [{"SpecialToken": {"id": self.bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                    "pair": [{"SpecialToken": {"id": self.bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                             {"SpecialToken": {"id": self.bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {self.bos: {"id": self.bos, "ids": [self.bos_id], "tokens": [self.bos]}}}
        return {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": s in self.nonspecial, "special": s not in self.nonspecial}
                             for s, i in self.special_tokens.items()],
            "normalizer": {"type": "NFC"} if self.normalizer == "nfc" else None, "pre_tokenizer": pre,
            "post_processor": post, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": self.ignore_merges, "vocab": vocab,
                      "merges": merges},  # "left right" strings: the form every `tokenizers` version reads
        }

    @classmethod
    def load(cls, path, eos=None, bos=None):
        """A tokenizer from a file: a Hugging Face byte-level BPE tokenizer.json (ours, from save_hf, or any
        other: its ids kept), a SentencePiece-style BPE tokenizer.json (Llama 2, Mistral: a SentencePieceBPE of
        nanoeuler/tokenizer/sentencepiece_bpe.py) or our compact JSON (to_json). eos names the end-of-text token of a
        tokenizer.json (default: </s> if it has one, else its first added token); bos a token to put first
        when its post-processor does not (tokenizer_config.json's add_bos_token)."""
        with open_input(path) as f:
            text = f.read()
        try:
            d = json.loads(text)
        except ValueError:
            raise UserError(f"{path} is not JSON") from None
        if isinstance(d, dict) and "model" in d:
            from nanoeuler.tokenizer import sentencepiece_bpe

            if isinstance(d["model"], dict) and sentencepiece_bpe.is_sentencepiece_style(d):
                return sentencepiece_bpe.SentencePieceBPE.from_hf(d, path, eos, bos)
            return cls._from_hf(d, path, eos, bos)
        return cls.from_json(text)

    @classmethod
    def _from_hf(cls, d, path, eos=None, bos=None):
        """Our tokenizer from a tokenizer.json's dict: a byte-level BPE with one of the pretokenizations of
        RULES, its ids kept; a one-line UserError naming what else it holds that we do not do. A file that the
        merges-only form holds (ours, GPT-2's) loads as that form; any other keeps its token list."""
        try:
            model, pre, added = d["model"], d.get("pre_tokenizer"), d.get("added_tokens") or []
            vocab = model["vocab"]
            merges = [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]
            added = [(int(t["id"]), t["content"], bool(t.get("special")), t) for t in added]
        except (KeyError, TypeError, AttributeError, ValueError):
            raise UserError(f"{path} is not a BPE tokenizer.json") from None
        rule, post_bos, refusal = _hf_structure(d, model, pre, {i: c for i, c, _, _ in added})
        if refusal:
            raise UserError(f"{path}: {refusal}; nanoeuler takes a byte-level BPE with GPT-2's, SmolLM's (digits "
                            "one by one), Llama 3's or Qwen2's pretokenization (and NFC), or a SentencePiece-style BPE")
        for _, content, _, t in added:
            for key in ("lstrip", "rstrip", "single_word"):
                if t.get(key):
                    raise UserError(f"{path}: added token {content!r} has {key}, which nanoeuler does not do")
        added.sort()
        specials = [c for _, c, _, _ in added]
        nonspecial = [c for _, c, special, _ in added if not special]
        special_ids = {i for i, _, _, _ in added}
        bos = post_bos or bos
        if bos is not None and bos not in specials:
            raise UserError(f"{path}: the beginning-of-text token {bos!r} is not an added token")
        names = specials
        if eos is None:
            eos = "</s>" if "</s>" in names else (names[0] if names else None)
        if eos is None:
            raise UserError(f"{path} has no special token to end a text with")

        def token_bytes(name):
            try:
                return name.translate(_byte_level_decoding()).encode("latin-1")
            except UnicodeEncodeError:
                raise UserError(f"{path}: vocabulary entry {name!r} is not byte-level") from None

        for r, pair in enumerate(merges):
            if len(pair) != 2 or any(name not in vocab for name in pair) or "".join(pair) not in vocab:
                raise UserError(f"{path}: merge {r} {pair!r} names tokens outside its vocabulary")
        normalizer = "nfc" if d.get("normalizer") == {"type": "NFC"} else None
        extra = dict(rule=rule, ignore_merges=bool(model.get("ignore_merges")), bos=bos, nonspecial=nonspecial,
                     normalizer=normalizer)
        merges_only = (rule == "gpt2" and not model.get("ignore_merges") and bos is None and not nonspecial
                       and normalizer is None)
        byte_ids = [vocab.get(chr_) for chr_ in (bytes_to_unicode()[b] for b in range(256))]
        if None in byte_ids and model.get("unk_token") is not None:
            raise UserError(f"{path}: the vocabulary lacks byte {byte_ids.index(None)} and its BPE has unk_token "
                            f"{model['unk_token']!r}, which nanoeuler does not do (only a vocabulary that drops them)")
        if merges_only and None not in byte_ids:
            internal = {bytes([b]): b for b in range(256)}  # token bytes -> internal number
            pairs = []
            ids = list(byte_ids)
            for pair in merges:
                left, right = (internal.get(token_bytes(name)) for name in pair)
                if left is None or right is None:  # a merge that uses a later merge's token: the listed form
                    break
                pairs.append((left, right))
                made = token_bytes(pair[0]) + token_bytes(pair[1])
                if made not in internal:
                    internal[made] = len(ids)
                    ids.append(vocab["".join(pair)])
            else:
                made_ids = set(ids)
                decode_only = {i: token_bytes(name) for name, i in vocab.items()
                               if i not in made_ids and i not in special_ids}
                return cls(pairs, names, ids=ids + [i for i, _, _, _ in added], eos=eos, decode_only=decode_only)
        # the listed form: every vocabulary entry (not an added token) by id, merges of their positions
        ordinary = sorted((i, name) for name, i in vocab.items() if i not in special_ids)
        position = {name: k for k, (_, name) in enumerate(ordinary)}
        pairs = []
        for r, pair in enumerate(merges):
            if pair[0] not in position or pair[1] not in position:
                raise UserError(f"{path}: merge {r} {pair!r} uses an added token")
            pairs.append((position[pair[0]], position[pair[1]]))
        return cls(pairs, names, ids=[i for i, _ in ordinary] + [i for i, _, _, _ in added], eos=eos,
                   tokens=[token_bytes(name) for _, name in ordinary], **extra)


def _hf_structure(d, model, pre, added_names):
    """(rule, the special token its post-processor puts first or None, what in a tokenizer.json nanoeuler's
    BPE does not do in a few words or None)."""
    def byte_level(p, regex=True):
        return (isinstance(p, dict) and p.get("type") == "ByteLevel" and not p.get("add_prefix_space")
                and bool(p.get("use_regex", True)) == regex)

    rule = None
    steps = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else None
    if byte_level(pre):
        rule = "gpt2"
    elif steps and len(steps) == 2:
        first, second = steps
        if first.get("type") == "Digits" and first.get("individual_digits") and byte_level(second):
            rule = "gpt2_digits"
        elif (first.get("type") == "Split" and first.get("behavior") == "Isolated" and not first.get("invert")
              and byte_level(second, regex=False)):
            rule = {LLAMA3_REGEX: "llama3", QWEN2_REGEX: "qwen2"}.get((first.get("pattern") or {}).get("Regex"))
    if model.get("type") != "BPE":
        return rule, None, f"its model is {model.get('type')}, not BPE"
    if rule is None:
        kind = pre.get("type") if isinstance(pre, dict) else pre
        if kind == "Sequence":
            kind = "Sequence of " + ", ".join(p.get("type", "?") for p in pre.get("pretokenizers", []))
        return rule, None, f"its pre-tokenizer is {kind}, not one nanoeuler has"
    if d.get("normalizer") not in (None, {"type": "NFC"}):
        return rule, None, f"it has a normalizer ({d['normalizer'].get('type')})"
    post = d.get("post_processor")
    bos = None
    if post is not None:
        bos = post_bos(post, added_names)
        if bos is False:
            return rule, None, f"its post-processor ({post.get('type')}) adds tokens other than one at the start"
    for key in ("byte_fallback", "continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(key):
            return rule, None, f"its BPE has {key} = {model[key]!r}"
    return rule, bos, None


def _alternation(strings):
    """(compiled regex of the strings as bytes, longest first, and the longest one's length), or (None, 0)."""
    if not strings:
        return None, 0
    by_length = sorted((s.encode() for s in strings), key=len, reverse=True)
    return re.compile(b"|".join(map(re.escape, by_length))), len(by_length[0])


def _listed_tokens(merges, tokens):
    """(token bytes, the internal number of each merge's result, each byte's token or -1) of an explicit
    token list: a merge makes the listed token of its two tokens' bytes."""
    token_bytes = [bytes(t) for t in tokens]
    index = {t: i for i, t in enumerate(token_bytes)}
    if len(index) != len(token_bytes) or b"" in index:
        raise UserError("corrupt tokenizer: its token list repeats a token or has an empty one")
    results = np.empty(len(merges), np.int32)
    seen = set()
    n = len(token_bytes)
    for r, (a, b) in enumerate(merges.tolist()):
        if not (0 <= a < n and 0 <= b < n) or (a, b) in seen:
            raise UserError(f"corrupt tokenizer: merge {r} ({a}, {b}) is invalid or repeated")
        seen.add((a, b))
        made = index.get(token_bytes[a] + token_bytes[b])
        if made is None:
            raise UserError(f"corrupt tokenizer: merge {r} makes a token that is not in its token list")
        results[r] = made
    byte_tok = np.array([index.get(bytes([b]), -1) for b in range(256)], np.int32)
    return token_bytes, results, byte_tok


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


def read_token_file(path, source=None, tok=None):
    """The tokens of a token file (Tokenizer.encode_file) as a read-only uint16 (uint32, for a vocabulary above
    65,536) memmap (a corpus of many GB
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
    if version not in (TOKENS_VERSION, 2):
        raise UserError(f"token file {path} has format version {version}; this nanoeuler reads {TOKENS_VERSION} and 2")
    dtype = np.dtype("<u2" if version == TOKENS_VERSION else "<u4")
    if size != TOKENS_HEADER_BYTES + dtype.itemsize * n_tokens:
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
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=TOKENS_HEADER_BYTES, shape=(n_tokens,))


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
    with progress_bar(progress, total=size if size <= max_bytes else n_windows * window, unit="B",
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
                block = f.read(CHUNK)
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
    with progress_bar(True, total=total, desc=desc) as bar:
        worker.start()
        while worker.is_alive():
            worker.join(0.2)
            bar.n = max(int(done[0]) - start, 0)
            bar.refresh()
    if errors:
        raise errors[0]
    return result[0]
