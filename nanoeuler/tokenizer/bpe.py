"""The byte-level BPE tokenizer, written here: no tokenizer library at run time.

    tok = Tokenizer.train("shakespeare.txt", 4096)   # learn merges (train.py; on a sample if the file is huge)
    ids = tok.encode("Hello world")                  # list of ints; tok.decode(ids) gives the exact bytes
    tok.encode_file("corpus.txt", "corpus.tok")      # streaming, a token file, any size of corpus
    tokens = read_token_file("corpus.tok")           # its uint16 (or uint32) tokens, memory-mapped (token_file.py)
    tok.save_hf("tokenizer.json")                    # the `tokenizers` library loads it and gives our ids (hf.py)
    tok = Tokenizer.load("tokenizer.json")           # any BPE tokenizer.json, as the class that reads it (hf.py)

Ids: 0..255 are the bytes, then one id per new token made by the merges, in merge order, then the special
tokens (`</s>` first). Text is cut into GPT-2 pretokens (letter runs, digit runs, punctuation runs, each
taking a single leading space; whitespace runs; the contractions 's 't 're 've 'm 'll 'd) and merges
never cross a pretoken boundary. Any byte sequence round-trips: bytes that are not valid UTF-8 are
punctuation-class characters of their own. The compiled parts live in nanoeuler/tokenizer/kernels.py.

The package by concern: this module is the BPE core (merges, encoding, decoding, the compact JSON that
checkpoints store); hf.py reads and writes Hugging Face tokenizer.json and picks the class a file needs (this
one, sentencepiece_bpe.py's or grammar.py's); token_file.py reads and writes token files; train.py learns
merges. The command line, `nanoeuler tokenizer train|encode|decode`, is in nanoeuler/cli.py.
"""
import functools
import io
import json
import unicodedata
from importlib import resources

import numpy as np

from nanoeuler.errors import UserError
from nanoeuler.tokenizer.base import CHUNK, MAX_IDS, MAX_VOCAB, TokenizerBase, checked_ids
from nanoeuler.tokenizer.pieces import (_LOOKAHEAD, LLAMA3_REGEX, QWEN2_REGEX, RULES, UNICODE_VERSION,  # noqa: F401
                                        _alternation, _byte_level_decoding, _kernels, _PieceCache, _split,
                                        bytes_to_unicode, class_table)
from nanoeuler.tokenizer.token_file import read_token_file  # noqa: F401 (read here by its older callers)


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

    # ------------------------------------------------------------------------------ training and files

    @classmethod
    def train(cls, path, vocab_size, progress=True, special_tokens=("</s>",), max_bytes=128 << 20):
        """Learn merges on the text file at path (nanoeuler/tokenizer/train.py)."""
        from nanoeuler.tokenizer.train import train

        return train(cls, path, vocab_size, progress, special_tokens, max_bytes)

    @classmethod
    def load(cls, path, eos=None, bos=None):
        """A tokenizer from a file, of the class it needs (nanoeuler/tokenizer/hf.py's load)."""
        from nanoeuler.tokenizer.hf import load

        return load(path, eos, bos, cls)

    def save_hf(self, path):
        """Write a Hugging Face tokenizer.json (byte-level BPE) that gives exactly our ids."""
        from nanoeuler.tokenizer.hf import save_byte_level

        save_byte_level(self, path)


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
            if isinstance(d, dict) and d.get("format") == "nanoeuler-hf-grammar":
                from nanoeuler.tokenizer.grammar import GrammarBPE

                return GrammarBPE.from_json(text)
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

    def byte_level_names(self):
        """(every token's name by id, the merges as "left right" names): GPT-2's byte-level spelling, which
        tokenizer.json and GGUF store; a special token's name is its text."""
        b2u = bytes_to_unicode()
        names = [t.decode("latin-1").translate(b2u) for t in self._token_bytes]  # b2u: str.translate's table
        for s, i in self.special_tokens.items():
            names[i] = s
        internal = self._ids if self._ids is not None else np.arange(self.n_ordinary)
        return names, [f"{names[internal[a]]} {names[internal[b]]}" for a, b in self.merges.tolist()]

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
