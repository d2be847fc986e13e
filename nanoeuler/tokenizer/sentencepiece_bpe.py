"""The SentencePiece-style BPE of Llama 2, TinyLlama and Mistral, written here: no tokenizer library at run time.

A Hugging Face tokenizer.json of this kind has a BPE model over characters (not bytes) with `byte_fallback`
(a character outside the vocabulary becomes the `<0xXX>` tokens of its UTF-8 bytes) and usually `fuse_unk`,
spaces spelled `▁`, and one of two ways of marking the start of a text:

- `prepend`: the normalizer Sequence[Prepend("▁"), Replace(" ", "▁")] and no pre-tokenizer (Llama 2,
  TinyLlama, Mistral v0.1): every piece of text between added tokens gets a `▁` in front;
- `metaspace`: the Metaspace pre-tokenizer (replacement `▁`, prepend_scheme `always`, `first` or `never`,
  split or not): a `▁` in front of a piece that does not start with one (`first`: only at the text's start).

Tokenizer.load (nanoeuler/tokenizer/hf.py) picks this class for such a file; it has the byte-level Tokenizer's
interface (encode, encode_ordinary, decode, encode_file, special tokens, BOS/EOS, set_chat, to_json/from_json,
save_hf; the shared part in nanoeuler/tokenizer/base.py). Encoding follows `tokenizers` step by step: added
tokens are split out first (those with `normalized: false` from the raw text, the others after normalization),
the rest is normalized and pre-tokenized, and each word is merged by merge rank (lowest first, leftmost on
ties) from its characters. A vocabulary in which `▁` only ever starts a token (every SentencePiece-trained one)
lets a long piece be merged word by word (cut before each `▁` that follows another character: no merge crosses
there), each distinct word once. decode() gives the bytes the ids stand for, `▁` as a space, byte tokens as
their byte, and is concatenable (decode(a + b) == decode(a) + decode(b)) so that streaming works token by
token; decode(ids, text_start=True) also drops the one leading space that encoding put in front, as the file's
decoder does (Strip or Metaspace) for ids that begin a text. Bytes that are not UTF-8 are encoded through their
byte tokens and decode back exactly.
"""
import codecs
import json
import re

import numpy as np

from nanoeuler.errors import UserError
from nanoeuler.files import atomic_write
from nanoeuler.tokenizer.base import CHUNK, MAX_IDS, MAX_VOCAB, TokenizerBase, checked_ids, post_bos
from nanoeuler.tokenizer.pieces import as_text as _as_text, cached_tokens, merge_symbols

FORMAT = "nanoeuler-sentencepiece-bpe"
SPACE = "\u2581"  # ▁, SentencePiece's spelling of a space
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_CACHE_WORDS = 1 << 20  # the word cache starts afresh beyond this many words


def is_sentencepiece_style(d):
    """Whether a tokenizer.json dict is a SentencePiece-style BPE (byte fallback, `▁` for spaces)."""
    model = d.get("model") or {}
    pre = d.get("pre_tokenizer") or {}
    return model.get("type") == "BPE" and bool(model.get("byte_fallback") or pre.get("type") == "Metaspace"
                                               or _prepend_normalizer(d.get("normalizer")))


def _prepend_normalizer(norm):
    """Whether a normalizer is Sequence[Prepend("▁"), Replace(" ", "▁")] (Llama 2's)."""
    steps = norm.get("normalizers") if isinstance(norm, dict) and norm.get("type") == "Sequence" else None
    return (isinstance(steps, list) and len(steps) == 2
            and steps[0] == {"type": "Prepend", "prepend": SPACE}
            and steps[1].get("type") == "Replace" and steps[1].get("pattern") == {"String": " "}
            and steps[1].get("content") == SPACE)


def _char_bytes(c):
    """The UTF-8 bytes of one character; a surrogate escape (a byte that was not UTF-8) is that byte."""
    if "\udc80" <= c <= "\udcff":
        return bytes([ord(c) - 0xDC00])
    return c.encode("utf-8", "surrogatepass")


def _alternation(strings):
    """(compiled regex of the strings, longest first, and the longest one's length), or (None, 0)."""
    if not strings:
        return None, 0
    by_length = sorted(strings, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, by_length))), len(by_length[0])


class SentencePieceBPE(TokenizerBase):
    """SentencePiece-style BPE loaded from a tokenizer.json (see the module docstring)."""

    def __init__(self, vocab, merges, added, eos, bos=None, *, style="prepend", prepend_scheme="always",
                 split=False, unk=None, fuse_unk=False, byte_fallback=True, ignore_merges=False):
        """vocab: {name: id} of the BPE model; merges: (left name, right name) pairs in rank order; added:
        (id, content, special, normalized) of each added token; eos/bos: the contents of the end- and
        beginning-of-text tokens (bos: put first by encode, or None); style: `prepend` or `metaspace`;
        prepend_scheme and split: the Metaspace pre-tokenizer's; unk: the model's unk_token or None."""
        if style not in ("prepend", "metaspace") or prepend_scheme not in ("always", "first", "never"):
            raise UserError(f"corrupt tokenizer: unknown style {style!r} / prepend scheme {prepend_scheme!r}")
        self.style, self.prepend_scheme, self.split = style, prepend_scheme, bool(split)
        self.fuse_unk, self.byte_fallback, self.ignore_merges = bool(fuse_unk), bool(byte_fallback), bool(ignore_merges)
        self._vocab = {str(k): int(v) for k, v in vocab.items()}
        self._added = [(int(i), str(c), bool(s), bool(n)) for i, c, s, n in added]
        names = {i: name for name, i in self._vocab.items()}
        if len(names) != len(self._vocab):
            raise UserError("corrupt tokenizer: two vocabulary entries share an id")
        for i, content, _, _ in self._added:
            if not content:
                raise UserError("corrupt tokenizer: an added token is empty")
            if names.setdefault(i, content) != content and self._vocab.get(content) != i:
                raise UserError(f"corrupt tokenizer: added token {content!r} has the id of {names[i]!r}")
        vocab_size = max(names) + 1 if names else 0
        if min(names, default=0) < 0 or len(names) != vocab_size:
            raise UserError("corrupt tokenizer: its ids repeat or leave gaps")
        if vocab_size > MAX_IDS:
            raise UserError(f"vocabulary of {vocab_size} tokens is more than int32 ids allow")
        self.vocab_size = vocab_size
        self.token_dtype = np.dtype("<u2" if vocab_size <= MAX_VOCAB else "<u4")
        self._merge_names = [(str(a), str(b)) for a, b in merges]
        self._merges = {}  # (left id, right id) -> (rank, id of the merged token)
        for r, (a, b) in enumerate(self._merge_names):
            if a not in self._vocab or b not in self._vocab or a + b not in self._vocab:
                raise UserError(f"corrupt tokenizer: merge {r} {a!r} {b!r} names tokens outside its vocabulary")
            self._merges[self._vocab[a], self._vocab[b]] = (r, self._vocab[a + b])
        self._byte_ids = [self._vocab.get(f"<0x{b:02X}>") for b in range(256)]
        self.unk = unk
        if unk is not None and unk not in self._vocab:
            raise UserError(f"corrupt tokenizer: its unk_token {unk!r} is not in its vocabulary")
        self._unk_id = None if unk is None else self._vocab[unk]

        self.special_tokens = {c: i for i, c, _, _ in sorted(self._added)}
        self.nonspecial = [c for _, c, s, _ in sorted(self._added) if not s]
        if eos not in self.special_tokens:
            raise UserError(f"the end-of-text token {eos!r} is not an added token of the tokenizer")
        if bos is not None and bos not in self.special_tokens:
            raise UserError(f"the beginning-of-text token {bos!r} is not an added token of the tokenizer")
        self.eos, self.eos_id = eos, self.special_tokens[eos]
        self.bos, self.bos_id = bos, None if bos is None else self.special_tokens[bos]
        # added tokens found in text, by (allow_special, normalized): all with allow_special, else non-special
        self._added_re = {(allow, norm): _alternation([c for _, c, s, n in self._added
                                                       if n == norm and (allow or not s)])
                          for allow in (False, True) for norm in (False, True)}
        self._added_ids = {c: i for i, c, _, _ in self._added}

        self._token_bytes = [b""] * vocab_size  # by id: what decode reads
        for i, name in names.items():
            m = _BYTE_TOKEN.fullmatch(name)
            self._token_bytes[i] = bytes([int(m.group(1), 16)]) if m else name.replace(SPACE, " ").encode(
                "utf-8", "surrogatepass")
        for i, content, _, _ in self._added:  # an added token decodes as its text
            self._token_bytes[i] = content.encode("utf-8", "surrogatepass")
        # `▁` only at the start of tokens: a piece may be merged word by word (module docstring)
        lead = re.compile(f"{SPACE}*[^{SPACE}]*")
        self.word_by_word = all(lead.fullmatch(name) for name in self._vocab)
        if style == "metaspace" and self.split:
            self._words = re.compile(f"{SPACE}[^{SPACE}]*|[^{SPACE}]+")
        elif self.word_by_word:
            self._words = re.compile(f"{SPACE}+[^{SPACE}]*|[^{SPACE}]+")
        else:
            self._words = None
        self._cache = {}
        self.set_chat()

    # -------------------------------------------------------------------------------------------- encoding

    def encode(self, text, allow_special=False, add_bos=None):
        """Token ids of text (str, or UTF-8 bytes; bytes that are not UTF-8 become their byte tokens).
        Special tokens written in the text become their ids only with allow_special=True; non-special added
        tokens always do. add_bos: put the beginning-of-text token first (by default when the file adds it)."""
        ids = self._encode_text(_as_text(text), allow_special, False)
        if self.bos_id is not None and (add_bos is None or add_bos):
            ids.insert(0, self.bos_id)
        return ids

    def encode_ordinary(self, text):
        """Token ids of text with no added token recognised, special or not, and no BOS."""
        return self._encode_piece(_as_text(text), True, True, False)

    def decode(self, ids, text_start=False):
        """The bytes the token ids stand for (`▁` a space, byte tokens their byte); text_start: the ids begin
        a text, so the one space that encoding put in front is dropped (the file's decoder does)."""
        ids = checked_ids(ids, self.vocab_size)
        data = b"".join(map(self._token_bytes.__getitem__, ids))
        if text_start and data.startswith(b" ") and (self.style == "prepend" or self.prepend_scheme != "never"):
            data = data[1:]
        return data

    def _encode_text(self, text, allow_special, continuation):
        """Ids of text, added tokens split out first. continuation: the text goes on from a cut that
        _safe_cut chose, so its start is neither the start of the text nor of a piece."""
        pattern, _ = self._added_re[bool(allow_special), False]
        ids, start = [], 0
        for m in pattern.finditer(text) if pattern is not None else ():
            ids += self._encode_piece(text[start:m.start()], start > 0 or not continuation,
                                      start == 0 and not continuation, allow_special)
            ids.append(self._added_ids[m.group()])
            start = m.end()
        ids += self._encode_piece(text[start:], start > 0 or not continuation, start == 0 and not continuation,
                                  allow_special)
        return ids

    def _encode_piece(self, piece, begins, at_origin, allow_special):
        """Ids of text between added tokens: normalized, normalized added tokens split out, pre-tokenized,
        merged. begins: it starts a piece (the normalizer's `▁` goes in front); at_origin: it starts the text."""
        if not piece:
            return []
        if self.style == "prepend":
            piece = (SPACE if begins else "") + piece.replace(" ", SPACE)
        pattern, _ = self._added_re[bool(allow_special), True]
        ids, start = [], 0
        for m in pattern.finditer(piece) if pattern is not None else ():
            ids += self._encode_words(piece[start:m.start()], at_origin and start == 0)
            ids.append(self._added_ids[m.group()])
            start = m.end()
        ids += self._encode_words(piece[start:], at_origin and start == 0)
        return ids

    def _encode_words(self, text, at_origin):
        if not text:
            return []
        if self.style == "metaspace":
            text = text.replace(" ", SPACE)
            if not text.startswith(SPACE) and (self.prepend_scheme == "always"
                                               or self.prepend_scheme == "first" and at_origin):
                text = SPACE + text
        words = self._words.findall(text) if self._words is not None else [text]
        return cached_tokens(words, self._cache, self._merge_word, _CACHE_WORDS)

    def _symbols(self, word):
        """The word's first symbols: each character's token, else its byte tokens, else the unk token (a run
        of them one unk with fuse_unk). A pending unk waits for the next known character, as in `tokenizers`."""
        vocab, byte_ids, unk_id = self._vocab, self._byte_ids, self._unk_id
        out, unk_pending = [], False
        for c in word:
            i = vocab.get(c)
            if i is not None:
                if unk_pending:
                    out.append(unk_id)
                    unk_pending = False
                out.append(i)
                continue
            if self.byte_fallback:
                fallback = [byte_ids[b] for b in _char_bytes(c)]
                if None not in fallback:
                    out += fallback
                    continue
            if unk_id is not None:
                if unk_pending and not self.fuse_unk:
                    out.append(unk_id)
                unk_pending = True
        if unk_pending:
            out.append(unk_id)
        return out

    def _merge_word(self, word):
        """The word's tokens: its symbols merged by rank, lowest first, leftmost on ties (`tokenizers`' heap,
        stale entries skipped when their pair no longer makes the same token)."""
        if self.ignore_merges and word in self._vocab:
            return [self._vocab[word]]
        return merge_symbols(self._symbols(word), self._merges)

    def _encode_stream(self, read, allow_special, chunk_bytes=CHUNK):
        """Yield (int32 ids, bytes read) chunk by chunk (encode_file's loop), each chunk encoded up to the last
        cut where the rest of the text cannot change its tokens; the ids are those of the whole text."""
        decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
        buf, continuation = "", False
        while True:
            block = read(chunk_bytes)
            buf += decoder.decode(block, final=not block)
            cut = len(buf) if not block else self._safe_cut(buf)
            ids = self._encode_text(buf[:cut], allow_special, continuation) if cut else []
            yield np.asarray(ids, np.int32), len(block)
            if not block:
                return
            if cut:
                buf, continuation = buf[cut:], True

    def _safe_cut(self, text):
        """A position in text where it may be cut and the two sides encoded apart (0: none): before a space
        that follows another character (no merge crosses it), outside any added token in view."""
        if self._words is None:
            return 0
        longest = max(self._added_re[True, False][1], self._added_re[True, True][1])
        p = text.rfind(" ", 0, len(text) - longest)
        while p > 0 and text[p - 1] in (" ", SPACE):
            p = text.rfind(" ", 0, p)
        if p <= 0:
            return 0
        for pattern, _ in (self._added_re[True, False], self._added_re[True, True]):
            for m in pattern.finditer(text, 0, min(len(text), p + longest)) if pattern is not None else ():
                if m.start() < p < m.end():
                    p = m.start()
        return p

    # ------------------------------------------------------------------------------------ serialization

    def _fields(self):
        return {"vocab": self._vocab, "merges": self._merge_names,
                "added": [list(t) for t in self._added], "eos": self.eos, "bos": self.bos, "style": self.style,
                "prepend_scheme": self.prepend_scheme, "split": self.split, "unk": self.unk,
                "fuse_unk": self.fuse_unk, "byte_fallback": self.byte_fallback, "ignore_merges": self.ignore_merges}

    def to_json(self):
        """Compact JSON of the whole tokenizer (what checkpoints store under __metadata__["tokenizer"])."""
        d = {"format": FORMAT, "version": 1, **self._fields()}
        d.update(self._chat_json())
        return json.dumps(d, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, text):
        try:
            d = json.loads(text)
            ok = d["format"] == FORMAT and d["version"] == 1
            fields = {k: d[k] for k in ("vocab", "merges", "added", "eos", "bos", "style", "prepend_scheme", "split",
                                        "unk", "fuse_unk", "byte_fallback", "ignore_merges")}
            vocab, merges, added, eos, bos = (fields.pop(k) for k in ("vocab", "merges", "added", "eos", "bos"))
            tok = cls(vocab, merges, added, eos, bos, **fields) if ok else None
        except (ValueError, TypeError, KeyError, AttributeError):
            tok = None
        if tok is None:
            raise UserError("not a nanoeuler tokenizer (corrupt or unknown JSON)")
        return tok.set_chat(d.get("chat_template"), d.get("end_ids"), d.get("named_tokens"))

    @classmethod
    def from_hf(cls, d, path, eos=None, bos=None):
        """The tokenizer of a SentencePiece-style tokenizer.json dict; a one-line UserError naming what else
        it holds that nanoeuler does not do."""
        model, norm, pre = d["model"], d.get("normalizer"), d.get("pre_tokenizer")
        try:
            vocab = model["vocab"]
            merges = [m.split(" ") if isinstance(m, str) else m for m in model.get("merges") or []]
            added = [(int(t["id"]), t["content"], bool(t.get("special")), bool(t.get("normalized")), t)
                     for t in d.get("added_tokens") or []]
        except (KeyError, TypeError, AttributeError, ValueError):
            raise UserError(f"{path} is not a BPE tokenizer.json") from None
        if not isinstance(vocab, dict) or any(len(m) != 2 for m in merges):
            raise UserError(f"{path} is not a BPE tokenizer.json")
        for key in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
            if model.get(key):
                raise UserError(f"{path}: its BPE has {key} = {model[key]!r}, which nanoeuler does not do")
        for _, content, _, _, t in added:
            for key in ("lstrip", "rstrip", "single_word"):
                if t.get(key):
                    raise UserError(f"{path}: added token {content!r} has {key}, which nanoeuler does not do")
        style, scheme, split = "prepend", "always", False
        if _prepend_normalizer(norm) and pre is None:
            pass
        elif (norm is None and isinstance(pre, dict) and pre.get("type") == "Metaspace"
              and pre.get("replacement") == SPACE):
            style, split = "metaspace", bool(pre.get("split", True))
            scheme = pre.get("prepend_scheme") or ("always" if pre.get("add_prefix_space", True) else "never")
            if scheme not in ("always", "first", "never"):
                raise UserError(f"{path}: its Metaspace has prepend_scheme {scheme!r}, which nanoeuler does not do")
        else:
            kinds = f"normalizer {(norm or {}).get('type')}, pre-tokenizer {(pre or {}).get('type')}"
            raise UserError(f"{path}: a SentencePiece-style BPE with {kinds}; nanoeuler takes Llama 2's normalizer "
                            "(Prepend and Replace of ▁) or a Metaspace pre-tokenizer")
        names = {i: c for i, c, _, _, _ in added}
        post = d.get("post_processor")
        bos_found = None if post is None else post_bos(post, names)
        if bos_found is False:
            raise UserError(f"{path}: its post-processor ({post.get('type')}) adds tokens other than one at the start")
        bos = bos_found or bos
        if eos is None:
            contents = [c for _, c, _, _, _ in sorted(added, key=lambda t: t[0])]
            eos = "</s>" if "</s>" in contents else (contents[0] if contents else None)
        if eos is None:
            raise UserError(f"{path} has no special token to end a text with")
        return cls(vocab, merges, [t[:4] for t in added], eos, bos, style=style, prepend_scheme=scheme, split=split,
                   unk=model.get("unk_token"), fuse_unk=model.get("fuse_unk"), byte_fallback=model.get("byte_fallback"),
                   ignore_merges=model.get("ignore_merges"))

    def save_hf(self, path):
        """Write the Hugging Face tokenizer.json of the published layout, which gives exactly our ids."""
        atomic_write(path, lambda f: f.write(json.dumps(self._hf_dict(), ensure_ascii=False).encode()))

    def _hf_dict(self):
        replace_space = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
        if self.style == "prepend":
            norm = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE}, replace_space]}
            pre = None
        else:
            norm, pre = None, {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": self.prepend_scheme,
                               "split": self.split}
        decoder = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
        merges = [list(m) for m in self._merge_names]
        if not any(" " in a + b for a, b in merges):  # "left right" strings: the form every `tokenizers` reads
            merges = [f"{a} {b}" for a, b in merges]
        post = None
        if self.bos is not None:
            single = [{"SpecialToken": {"id": self.bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
            post = {"type": "TemplateProcessing", "single": single,
                    "pair": single + [{"SpecialToken": {"id": self.bos, "type_id": 1}},
                                      {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {self.bos: {"id": self.bos, "ids": [self.bos_id], "tokens": [self.bos]}}}
        return {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": n, "special": s} for i, c, s, n in self._added],
            "normalizer": norm, "pre_tokenizer": pre, "post_processor": post, "decoder": decoder,
            "model": {"type": "BPE", "dropout": None, "unk_token": self.unk, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": self.fuse_unk, "byte_fallback": self.byte_fallback,
                      "ignore_merges": self.ignore_merges, "vocab": self._vocab,
                      "merges": merges},
        }

    def gguf_vocab(self):
        """The vocabulary as llama.cpp's SentencePiece tokenizer (tokenizer.ggml.model `llama`) reads it: (the
        token texts by id, `▁` for spaces; a score each; a kind each: normal, byte, unknown, control or
        user-defined). llama.cpp merges the adjacent pair whose joined text is the token of the highest score,
        so a token that merge r makes scores -r (its lowest r), which gives our ids wherever every way of
        joining a token's text is a merge (as in the tokenizer.json of a SentencePiece model, whose merges list
        every split of every token); a longer token no merge makes scores below them all."""
        n = self.vocab_size
        names = [None] * n
        for name, i in self._vocab.items():
            names[i] = name
        first = {}  # joined text -> the lowest rank of a merge that makes it
        for r, (a, b) in enumerate(self._merge_names):
            first.setdefault(a + b, r)
        scores = [0.0] * n  # a single character never is a join of two symbols: its score is never read
        for name, i in self._vocab.items():
            if name in first:
                scores[i] = -float(first[name])
            elif len(name) > 1:
                scores[i] = -float(len(self._merge_names))
        kinds = ["normal"] * n
        for i, content, special, _ in self._added:
            names[i] = content
            kinds[i] = "control" if special else "user"
        for i in self._byte_ids:
            if i is not None:
                kinds[i] = "byte"
        if self._unk_id is not None:
            kinds[self._unk_id] = "unknown"
        return names, scores, kinds

    @property
    def adds_space_prefix(self):
        """Whether a text gets a `▁` in front (llama.cpp's tokenizer.ggml.add_space_prefix): Llama 2's
        normalizer, or a Metaspace that prepends."""
        return self.style == "prepend" or self.prepend_scheme != "never"
