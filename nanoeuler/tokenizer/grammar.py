"""Any BPE tokenizer.json, read as the grammar it is: each part (normalizer, pre-tokenizer, model, added tokens,
post-processor, decoder) becomes a small function here, composed in the order the `tokenizers` library runs
them. Written here, no tokenizer library at run time; the byte-level families that the compiled scanner of
bpe.py knows (GPT-2, SmolLM, Llama 3, Qwen2) and SentencePiece-style BPE (sentencepiece_bpe.py) keep their own
faster classes, and hf.py's factory picks this one for every other file.

    tok = GrammarBPE.from_hf(json.load(open("tokenizer.json")), "tokenizer.json")
    tok.encode("Hello", allow_special=True)   # the ids `tokenizers` gives (add_special_tokens: add_bos)
    tok.decode(ids, text_start=True)          # its decoded text, as UTF-8 bytes

Encoding, as `tokenizers` does it: added tokens with `normalized: false` are cut out of the raw text (leftmost,
longest; `single_word`, `lstrip` and `rstrip` as they say), the rest is normalized a piece at a time, tokens with
`normalized: true` are cut out of the normalized pieces, what is left is pre-tokenized into words, and each word is
merged by merge rank (lowest first, leftmost on ties); the post-processor's template puts its special tokens
around the whole. Decoding runs the decoder chain on the tokens' names. Split patterns are Oniguruma regexes;
onig_to_re rewrites one for Python's `re`, with `\\p{L}`, `\\p{N}` and `\\s` from unicode_classes.txt (the Unicode
version of `tokenizers`) and other categories from the running Python's unicodedata.
"""
import functools
import json
import re
import string
import unicodedata

import numpy as np

from nanoeuler.errors import UserError
from nanoeuler.files import atomic_write
from nanoeuler.tokenizer.base import MAX_IDS, MAX_VOCAB, TokenizerBase, checked_ids
from nanoeuler.tokenizer.pieces import as_text as _as_text, cached_tokens, merge_symbols
from nanoeuler.tokenizer.token_file import CHUNK

FORMAT = "nanoeuler-hf-grammar"
_CACHE_WORDS = 1 << 20  # the word cache starts afresh beyond this many words
# Rust's char::is_whitespace (the White_Space property): lstrip/rstrip, Strip, WhitespaceSplit
WHITE_SPACE = frozenset(map(chr, [*range(0x9, 0xE), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028,
                                  0x2029, 0x202F, 0x205F, 0x3000]))
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
SPACE = "\u2581"


class Unsupported(UserError):
    """A part of a tokenizer.json that nanoeuler does not read (the message names it)."""


# ------------------------------------------------------------------------------------------- regexes

@functools.cache
def _class_ranges(name):
    """The character-class body (for inside [...]) of a Unicode class: L, N or W (\\s) from
    unicode_classes.txt; a general category (Lu, P, ...) from unicodedata."""
    from nanoeuler.tokenizer.pieces import class_table

    if name in ("L", "N", "W"):
        table = class_table()
        member = table == {"L": 1, "N": 2, "W": 3}[name]
    else:
        member = np.zeros(0x110000, bool)
        for cp in range(0x110000):
            cat = unicodedata.category(chr(cp))
            member[cp] = cat == name or cat[0] == name
    edges = np.flatnonzero(np.diff(np.concatenate(([0], member.view(np.int8), [0]))))
    parts = []
    for lo, hi in zip(edges[::2], edges[1::2] - 1):
        parts.append(f"\\U{lo:08x}" if lo == hi else f"\\U{lo:08x}-\\U{hi:08x}")
    return "".join(parts)


_CATEGORY_NAMES = {"Letter": "L", "Number": "N", "Punctuation": "P", "Symbol": "S", "Mark": "M", "Separator": "Z",
                   "Other": "C", "Alpha": "L", "Digit": "Nd", "Space": "W", "White_Space": "W"}
_CATEGORIES = {"L", "Lu", "Ll", "Lt", "Lm", "Lo", "M", "Mn", "Mc", "Me", "N", "Nd", "Nl", "No", "P", "Pc", "Pd", "Ps",
               "Pe", "Pi", "Pf", "Po", "S", "Sm", "Sc", "Sk", "So", "Z", "Zs", "Zl", "Zp", "C", "Cc", "Cf", "Cs",
               "Co", "Cn", "W"}


def _category_body(name, where):
    name = _CATEGORY_NAMES.get(name, name)
    if name not in _CATEGORIES:
        raise Unsupported(f"{where}: the Unicode class {name!r} of its regex is not one nanoeuler reads")
    return _class_ranges(name)


@functools.cache
def _word_body(kind):
    """A class body of \\w. "class": Oniguruma's inside [...] and Unicode's word characters (alphabetic
    characters, marks, decimal digits, connector punctuation; _is_word); "bare": Oniguruma's outside a class,
    which adds Latin-1's superscript digits and fractions (as `tokenizers` matches them); "rust": Rust's regex
    crate (the Whitespace pre-tokenizer), which adds the joiners U+200C and U+200D."""
    body = ("".join(_class_ranges(c) for c in ("L", "M", "Nd", "Nl", "Pc"))
            + "\u24b6-\u24e9\U0001f130-\U0001f149\U0001f150-\U0001f169\U0001f170-\U0001f189")
    return body + {"class": "", "bare": "\u00b2\u00b3\u00b9\u00bc-\u00be", "rust": "\u200c\u200d"}[kind]


def onig_to_re(pattern, where="its regex", rust=False):
    """A compiled Python `re` pattern that matches as the Oniguruma pattern does in `tokenizers`: \\p{..}
    and \\P{..} become explicit classes, \\s and \\w Oniguruma's Unicode ones, \\z and \\Z their `re` forms,
    a class inside a class its members, ^ and $ line anchors (Ruby syntax, Oniguruma's default)."""
    out, i, n, in_class, depth = [], 0, len(pattern), False, 0
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            e = pattern[i + 1]
            if e in "pP":
                if pattern.startswith("{", i + 2):
                    end = pattern.index("}", i + 2)
                    name, i = pattern[i + 3:end], end + 1
                else:
                    name, i = pattern[i + 2], i + 3
                negate = (e == "P") != name.startswith("^")
                body = _category_body(name.lstrip("^"), where)
                if in_class and negate:
                    raise Unsupported(f"{where}: a negated Unicode class inside [...] is not one nanoeuler reads")
                out.append(body if in_class else f"[{'^' if negate else ''}{body}]")
                continue
            if e in "sSwW" and True:
                body = _class_ranges("W") if e in "sS" else _word_body(
                    "rust" if rust else "class" if in_class else "bare")
                negate = e in "SW"
                if in_class and negate:
                    raise Unsupported(f"{where}: \\{e} inside [...] is not one nanoeuler reads")
                out.append(body if in_class else f"[{'^' if negate else ''}{body}]")
                i += 2
                continue
            if e == "z" and not in_class:
                out.append(r"\Z")
            elif e == "Z" and not in_class:
                out.append(r"(?=\n?\Z)")
            elif e == "h" and not in_class:
                out.append(r"[0-9a-fA-F]")
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            if c == "[":  # a class inside a class (Oniguruma's union): its members join the outer class
                if pattern.startswith("[^", i) or pattern.startswith("[:", i):
                    raise Unsupported(f"{where}: {pattern[i:i + 2]!r} inside a class is not one nanoeuler reads")
                depth += 1
                i += 1
                continue
            if c == "&" and pattern.startswith("&&", i):
                raise Unsupported(f"{where}: a class intersection (&&) is not one nanoeuler reads")
            if c == "]" and depth:
                depth -= 1
                i += 1
                continue
            if c == "]" and not (out and out[-1] in ("[", "[^")):
                in_class = False
            out.append(c)
        elif c == "[":
            in_class = True
            if pattern.startswith("[^", i):
                out.append("[^")
                i += 2
                if i < n and pattern[i] == "]":
                    out.append("\\]")
                    i += 1
                continue
            out.append("[")
            if i + 1 < n and pattern[i + 1] == "]":
                out.append("\\]")
                i += 1
        else:
            out.append(c)
        i += 1
    try:
        return re.compile("".join(out), re.MULTILINE)  # Oniguruma's ^ and $ match at every line
    except re.error as e:
        raise Unsupported(f"{where}: regex {pattern!r} is not one nanoeuler reads ({e})") from None


def _pattern(spec, where):
    """A compiled pattern of a {"String": s} or {"Regex": r} in a tokenizer.json."""
    if not isinstance(spec, dict) or len(spec) != 1:
        raise UserError(f"{where}: its pattern {spec!r} is neither a String nor a Regex")
    (kind, value), = spec.items()
    if kind == "String" and isinstance(value, str):
        return re.compile(re.escape(value))
    if kind == "Regex" and isinstance(value, str):
        return onig_to_re(value, where)
    raise UserError(f"{where}: its pattern {spec!r} is neither a String nor a Regex")


def find_matches(regex, text):
    """(start, end, is_match) spans covering text, as `tokenizers` cuts it on a regex (an empty match right
    after a match is skipped, as Oniguruma's iterator does)."""
    if not text:
        return [(0, 0, False)]
    spans, prev = [], 0
    for m in regex.finditer(text):
        s, e = m.span()
        if s == e and s == prev and spans and spans[-1][2]:
            continue
        if prev != s:
            spans.append((prev, s, False))
        spans.append((s, e, True))
        prev = e
    if prev != len(text):
        spans.append((prev, len(text), False))
    return spans


@functools.cache
def char_class(name):
    """A regex of one character of a class (find_matches with it cuts as `tokenizers` cuts on a character
    predicate: each such character a match of its own): numbers (Rust's char::is_numeric), White_Space, or
    punctuation (Unicode's, or ASCII's); any other name is that character."""
    if name == "numeric":
        return re.compile(f"[{_class_ranges('N')}]")
    if name == "whitespace":
        return re.compile(f"[{''.join(map(re.escape, sorted(WHITE_SPACE)))}]")
    if name == "punctuation":
        return re.compile(f"[{_class_ranges('P')}{re.escape(string.punctuation)}]")
    return re.compile(re.escape(name))


def split_spans(text, spans, behavior):
    """The pieces of text that `tokenizers`' NormalizedString.split keeps for a SplitDelimiterBehavior, as
    (where it starts, its text)."""
    if behavior == "Removed":
        keep = [(s, e) for s, e, m in spans if not m]
    elif behavior == "Isolated":
        keep = [(s, e) for s, e, _ in spans]
    elif behavior in ("Contiguous", "MergedWithPrevious"):
        keep, previous = [], False
        for s, e, m in spans:
            joins = m == previous if behavior == "Contiguous" else m and not previous
            if joins and keep:
                keep[-1] = (keep[-1][0], e)
            else:
                keep.append((s, e))
            previous = m
    elif behavior == "MergedWithNext":
        keep, previous = [], False
        for s, e, m in reversed(spans):
            if m and not previous and keep:
                keep[-1] = (s, keep[-1][1])
            else:
                keep.append((s, e))
            previous = m
        keep.reverse()
    else:
        raise UserError(f"split behavior {behavior!r} is not one of tokenizers'")
    return [(s, text[s:e]) for s, e in keep]


# ----------------------------------------------------------------------------------------- normalizers

@functools.cache
def bytes_to_unicode():
    from nanoeuler.tokenizer.pieces import bytes_to_unicode as table

    return table()


@functools.cache
def _byte_level_table():
    return {b: c for b, c in bytes_to_unicode().items()}


def _byte_level_chars(text):
    """text as ByteLevel writes it: each UTF-8 byte as its character (bytes_to_unicode)."""
    return text.encode("utf-8", "surrogateescape").decode("latin-1").translate(_byte_level_table())


def _lowercase(text):
    return "".join(c.lower() for c in text)  # per character, as Rust's char::to_lowercase (no final sigma)


_NMT_DROP = frozenset(map(chr, [*range(0x1, 0x9), 0xB, *range(0xE, 0x20), 0x7F, 0x8F, 0x9F]))
_NMT_SPACE = frozenset(map(chr, [0x9, 0xA, 0xC, 0xD, 0x1680, *range(0x200B, 0x2010), 0x2028, 0x2029, 0x2581,
                                 0xFEFF, 0xFFFD]))


def _is_chinese(c):
    cp = ord(c)
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF or 0x2A700 <= cp <= 0x2B73F
            or 0x2B740 <= cp <= 0x2B81F or 0x2B920 <= cp <= 0x2CEAF or 0xF900 <= cp <= 0xFAFF
            or 0x2F800 <= cp <= 0x2FA1F)


def _strip_accents(text):
    return "".join(c for c in text if unicodedata.category(c)[0] != "M")  # every combining mark


def _bert_normalizer(d):
    clean, chinese = d.get("clean_text", True), d.get("handle_chinese_chars", True)
    lower = d.get("lowercase", True)
    accents = d.get("strip_accents")
    accents = lower if accents is None else accents

    def run(text):
        if clean:
            text = "".join(" " if c in "\t\n\r" or c in WHITE_SPACE else c for c in text if not (
                c == "\0" or c == "\ufffd" or (c not in "\t\n\r" and unicodedata.category(c)[0] == "C")))
        if chinese:
            text = "".join(f" {c} " if _is_chinese(c) else c for c in text)
        if accents:  # only the nonspacing marks here (StripAccents drops every mark)
            text = "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn")
        if lower:
            text = _lowercase(text)
        return text
    return run


def _chain(steps):
    """A Sequence: each step (None: none) applied to what the one before it gave."""
    steps = [f for f in steps if f is not None]

    def run(value):
        for f in steps:
            value = f(value)
        return value
    return run


def normalizer(d, where="its normalizer"):
    """A str -> str function for a tokenizer.json normalizer (None: the identity)."""
    if d is None:
        return None
    kind = d.get("type") if isinstance(d, dict) else None
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return functools.partial(unicodedata.normalize, kind)
    if kind == "Lowercase":
        return _lowercase
    if kind == "Strip":
        left, right = d.get("strip_left", True), d.get("strip_right", True)
        ws = "".join(WHITE_SPACE)
        return lambda t: (t.lstrip(ws) if left else t).rstrip(ws) if right else (t.lstrip(ws) if left else t)
    if kind == "StripAccents":
        return _strip_accents
    if kind == "Replace":
        regex, content = _pattern(d.get("pattern"), "its Replace normalizer"), d.get("content", "")
        return lambda t: regex.sub(lambda m: content, t)
    if kind == "Prepend":
        prefix = d.get("prepend", "")
        return lambda t: prefix + t if t else t
    if kind == "Append":
        suffix = d.get("append", "")
        return lambda t: t + suffix if t else t
    if kind == "ByteLevel":
        return _byte_level_chars
    if kind == "Nmt":
        return lambda t: "".join(" " if c in _NMT_SPACE else c for c in t if c not in _NMT_DROP)
    if kind == "BertNormalizer":
        return _bert_normalizer(d)
    if kind == "Precompiled" and not d.get("precompiled_charsmap"):
        return None
    if kind == "Sequence":
        return _chain([normalizer(s, where) for s in d.get("normalizers") or []])
    raise Unsupported(f"{where}: {kind} is not one nanoeuler reads")


# ------------------------------------------------------------------------------------- pre-tokenizers
# A pre-tokenizer maps a list of (text, origin) words to a new list; origin: how many of the word's first
# characters stand for the text's first character (Metaspace's prepend_scheme "first" reads whether any do)
_CACHE_CUTS = 1 << 18  # each step's cache of the cuts of the words it has seen starts afresh beyond this


def _splitting(cut):
    """A pre-tokenizer from cut(text) -> (start, piece) pairs; words repeat, so each one's cut is kept."""
    cache = {}

    def run(words):
        out = []
        if len(cache) > _CACHE_CUTS:
            cache.clear()
        for text, origin in words:
            pieces = cache.get(text)
            if pieces is None:
                pieces = cache[text] = [(start, piece) for start, piece in cut(text) if piece]
            if origin:
                out += [(piece, max(0, origin - start)) for start, piece in pieces]
            else:
                out += [(piece, 0) for _, piece in pieces]
        return out
    return run


def _mapping(f):
    return lambda words: [(f(t), o) for t, o in words]


def pre_tokenizer(d, where="its pre-tokenizer"):
    """A pre-tokenizer function (the comment above) for a tokenizer.json pre-tokenizer (None: identity)."""
    if d is None:
        return None
    kind = d.get("type") if isinstance(d, dict) else None
    if kind == "Sequence":
        return _chain([pre_tokenizer(s, where) for s in d.get("pretokenizers") or []])
    if kind == "Split":
        regex = _pattern(d.get("pattern"), f"{where} (Split)")
        behavior, invert = d.get("behavior", "Isolated"), bool(d.get("invert"))

        def cut(text):
            spans = find_matches(regex, text)
            if invert:
                spans = [(s, e, not m) for s, e, m in spans]
            return split_spans(text, spans, behavior)
        return _splitting(cut)
    if kind == "ByteLevel":
        regex = onig_to_re(GPT2_REGEX) if d.get("use_regex", True) else None
        prefix = bool(d.get("add_prefix_space", True))

        def run(words):
            out = []
            for text, origin in words:
                if prefix and not text.startswith(" "):
                    text, origin = " " + text, origin + 1 if origin else 0
                pieces = split_spans(text, find_matches(regex, text), "Isolated") if regex else [(0, text)]
                for start, p in pieces:
                    if p:  # each character becomes the characters of its UTF-8 bytes
                        k = max(0, origin - start)
                        out.append((_byte_level_chars(p), len(_byte_level_chars(p[:k]))))
            return out
        return run
    if kind == "Digits":
        behavior = "Isolated" if d.get("individual_digits") else "Contiguous"
        return _splitting(lambda t: split_spans(t, find_matches(char_class("numeric"), t), behavior))
    if kind == "Metaspace":
        replacement = d.get("replacement", SPACE)
        scheme = d.get("prepend_scheme") or ("always" if d.get("add_prefix_space", True) else "never")
        scheme = scheme.lower()
        if scheme not in ("always", "first", "never"):
            raise UserError(f"{where}: Metaspace prepend_scheme {scheme!r} is not one of tokenizers'")
        split = bool(d.get("split", True))

        def run(words):
            out = []
            for text, origin in words:
                text = text.replace(" ", replacement)
                if not text.startswith(replacement) and (scheme == "always" or scheme == "first" and origin):
                    text, origin = replacement + text, origin + 1 if origin else 0
                pieces = (split_spans(text, find_matches(char_class(replacement), text), "MergedWithNext")
                          if split else [(0, text)])
                out += [(p, max(0, origin - start)) for start, p in pieces if p]
            return out
        return run
    if kind == "Whitespace":
        regex = onig_to_re(r"\w+|[^\w\s]+", rust=True)  # Rust's regex crate here, not Oniguruma
        return _splitting(lambda t: split_spans(t, [(s, e, not m) for s, e, m in find_matches(regex, t)], "Removed"))
    if kind == "WhitespaceSplit":
        return _splitting(lambda t: split_spans(t, find_matches(char_class("whitespace"), t), "Removed"))
    if kind == "Punctuation":
        behavior = d.get("behavior", "Isolated")
        return _splitting(lambda t: split_spans(t, find_matches(char_class("punctuation"), t), behavior))
    if kind == "CharDelimiterSplit":
        delimiter = d.get("delimiter")
        return _splitting(lambda t: split_spans(t, find_matches(char_class(delimiter), t), "Removed"))
    if kind == "BertPreTokenizer":
        spaces = _splitting(lambda t: split_spans(t, find_matches(char_class("whitespace"), t), "Removed"))
        punct = _splitting(lambda t: split_spans(t, find_matches(char_class("punctuation"), t), "Isolated"))
        return lambda words: punct(spaces(words))
    if kind == "FixedLength":
        length = int(d.get("length", 5))
        return _splitting(lambda t: [(k, t[k:k + length]) for k in range(0, len(t), length)])
    raise Unsupported(f"{where}: {kind} is not one nanoeuler reads")


# ------------------------------------------------------------------------------------------- decoders
# A decoder maps (list of token strings, whether the first one starts the text) to a new list; the strings
# carry bytes that are not UTF-8 as surrogate escapes, so that decoding gives back the exact bytes.

class Joined(list):
    """A decoder's output that is the tokens joined into one: its start is not a token's start."""


def _wordpiece_cleanup(t):
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" do not", " don't"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        t = t.replace(a, b)
    return t


def _byte_fallback(tokens):
    out, pending = [], bytearray()
    for t in tokens:
        if len(t) == 6 and t.startswith("<0x") and t.endswith(">") and all(c in string.hexdigits for c in t[3:5]):
            pending.append(int(t[3:5], 16))
            continue
        if pending:
            out.append(pending.decode("utf-8", "surrogateescape"))
            pending.clear()
        out.append(t)
    if pending:
        out.append(pending.decode("utf-8", "surrogateescape"))
    return out


def decoder(d, where="its decoder"):
    """A decoder function (the comment above) for a tokenizer.json decoder (None: tokens joined by spaces)."""
    kind = d.get("type") if isinstance(d, dict) else None
    if kind == "Sequence":
        steps = [decoder(s, where) for s in d.get("decoders") or []]

        def run(tokens, start):
            for f in steps:
                tokens = f(tokens, start)
            return tokens
        return run
    if kind == "ByteLevel":
        u2b = {c: b for b, c in bytes_to_unicode().items()}

        def run(tokens, start):
            data = bytearray()
            for t in tokens:
                raw = [u2b.get(c) for c in t]
                data += bytes(raw) if None not in raw else t.encode("utf-8", "surrogateescape")
            return Joined([data.decode("utf-8", "surrogateescape")])
        return run
    if kind == "Metaspace":
        replacement = d.get("replacement", SPACE)
        scheme = (d.get("prepend_scheme") or ("always" if d.get("add_prefix_space", True) else "never")).lower()
        return lambda tokens, start: [t.replace(replacement, "" if k == 0 and start and scheme != "never" else " ")
                                      for k, t in enumerate(tokens)]
    if kind == "ByteFallback":
        return lambda tokens, start: _byte_fallback(tokens)
    if kind == "Fuse":
        return lambda tokens, start: Joined(["".join(tokens)])
    if kind == "Strip":
        content, lead, trail = d.get("content", " "), int(d.get("start", 0)), int(d.get("stop", 0))

        def strip(t, first):
            a, b = 0, len(t)
            while first and a < min(lead, len(t)) and t[a] == content:
                a += 1
            k = 0
            while k < trail and b > a and t[b - 1] == content:
                b, k = b - 1, k + 1
            return t[a:b]
        # joined tokens that continue a text do not start with a token: no cut there
        return lambda tokens, start: [strip(t, start or k > 0 or not isinstance(tokens, Joined))
                                      for k, t in enumerate(tokens)]
    if kind == "Replace":
        regex, content = _pattern(d.get("pattern"), "its Replace decoder"), d.get("content", "")
        return lambda tokens, start: [regex.sub(lambda m: content, t) for t in tokens]
    if kind == "BPEDecoder":
        suffix = d.get("suffix", "</w>")
        return lambda tokens, start: [t.replace(suffix, "" if k == len(tokens) - 1 else " ")
                                      for k, t in enumerate(tokens)]
    if kind == "WordPiece":
        prefix, cleanup = d.get("prefix", "##"), d.get("cleanup", True)

        def run(tokens, start):
            out = []
            for k, t in enumerate(tokens):
                if k or not start:
                    t = t.replace(prefix, "", 1) if t.startswith(prefix) else " " + t
                out.append(_wordpiece_cleanup(t) if cleanup else t)
            return out
        return run
    if d is None:
        return lambda tokens, start: [" ".join(tokens) if start else "".join(" " + t for t in tokens)]
    raise Unsupported(f"{where}: {kind} is not one nanoeuler reads")


# ------------------------------------------------------------------------------------ post-processors

def post_template(d, added, where="its post-processor"):
    """The single-text template of a tokenizer.json post-processor: a list of "A" (the text's ids) and lists of
    ids (special tokens), or None for none."""
    if d is None:
        return None
    kind = d.get("type") if isinstance(d, dict) else None
    if kind == "ByteLevel":
        return None
    if kind in ("RobertaProcessing", "BertProcessing"):
        try:
            cls, sep = int(d["cls"][1]), int(d["sep"][1])
        except (KeyError, TypeError, ValueError, IndexError):
            raise UserError(f"{where}: {kind} lacks its cls or sep token") from None
        return [[cls], "A", [sep]]
    if kind == "TemplateProcessing":
        specials = d.get("special_tokens") or {}
        out = []
        for item in d.get("single") or []:
            (part, body), = item.items()
            if part == "Sequence":
                out.append("A")
            elif part == "SpecialToken":
                ids = (specials.get(body.get("id")) or {}).get("ids")
                if not isinstance(ids, list):
                    raise UserError(f"{where}: special token {body.get('id')!r} of its template has no ids")
                out.append([int(i) for i in ids])
            else:
                raise UserError(f"{where}: template piece {part!r} is not one of tokenizers'")
        return out
    if kind == "Sequence":
        template = ["A"]
        for p in d.get("processors") or []:
            inner = post_template(p, added, where)
            if inner is not None:  # each processor wraps what the ones before it made
                template = [x for piece in inner for x in (template if piece == "A" else [piece])]
        return template if template != ["A"] else None
    raise Unsupported(f"{where}: {kind} is not one nanoeuler reads")


# -------------------------------------------------------------------------------------------- the model

def model_type(model):
    """The model's type as `tokenizers` reads it: its "type", or without one, from its keys (a file of an
    older `tokenizers`, GPT-2's: a model with merges is a BPE)."""
    if not isinstance(model, dict):
        return None
    if "type" in model:
        return model["type"]
    if "merges" in model:
        return "BPE"
    if isinstance(model.get("vocab"), list):
        return "Unigram"
    if "max_input_chars_per_word" in model:
        return "WordPiece"
    return "WordLevel"


class GrammarBPE(TokenizerBase):
    """A BPE tokenizer.json of any structure (the module docstring); to_json keeps the file itself."""

    def __init__(self, hf, eos=None, bos=None, where="tokenizer.json"):
        """hf: the tokenizer.json as a dict; eos names the end-of-text token (default </s> if it has one, else
        its first added token); bos names a token to put first where its post-processor adds none."""
        self.hf = hf
        model = hf.get("model")
        kind = model_type(model)
        if kind != "BPE":
            raise Unsupported(f"{where}: its model is {kind}; nanoeuler reads BPE models only")
        try:
            vocab = {str(k): int(v) for k, v in model["vocab"].items()}
            merges = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in model.get("merges") or []]
            added = _added_ids(vocab, [dict(t, content=str(t["content"])) for t in hf.get("added_tokens") or []])
        except (KeyError, TypeError, AttributeError, ValueError):
            raise UserError(f"{where} is not a BPE tokenizer.json") from None
        if model.get("dropout") not in (None, 0, 0.0):
            raise Unsupported(f"{where}: its BPE has dropout {model['dropout']!r} (random merges), which nanoeuler "
                              "does not do")
        self._vocab = vocab
        self._prefix = model.get("continuing_subword_prefix") or None
        self._suffix = model.get("end_of_word_suffix") or None
        self._byte_fallback, self._fuse_unk = bool(model.get("byte_fallback")), bool(model.get("fuse_unk"))
        self._ignore_merges = bool(model.get("ignore_merges"))
        unk = model.get("unk_token")
        self._unk_id = vocab.get(unk) if unk is not None else None
        plen = len(self._prefix.encode()) if self._prefix else 0
        self._merges = {}  # (left id, right id) -> (rank, merged id); a repeated pair keeps its last rank
        for r, pair in enumerate(merges):
            if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab:
                raise UserError(f"{where}: merge {r} {pair!r} names tokens outside its vocabulary")
            made = pair[0] + pair[1].encode()[plen:].decode("utf-8", "replace")
            if made not in vocab:
                raise UserError(f"{where}: merge {r} {pair!r} makes {made!r}, which is not in its vocabulary")
            self._merges[vocab[pair[0]], vocab[pair[1]]] = (r, vocab[made])

        self._normalize = normalizer(hf.get("normalizer"))
        self._reads_origin = '"first"' in json.dumps(hf.get("pre_tokenizer")).lower()
        self._pre = pre_tokenizer(hf.get("pre_tokenizer"))
        self._decode_chain = decoder(hf.get("decoder"))
        self._template = post_template(hf.get("post_processor"), added)

        names = {i: name for name, i in vocab.items()}
        self._added = sorted(added, key=lambda t: t["id"])
        for t in self._added:
            if not t["content"]:
                raise UserError(f"{where}: an added token is empty")
            # decoding reads a normalized token as the normalizer writes it
            normal = t.get("normalized", not t.get("special")) and self._normalize
            names[t["id"]] = self._normalize(t["content"]) if normal else t["content"]
        self.vocab_size = max(names) + 1 if names else 0
        if min(names, default=0) < 0 or self.vocab_size > MAX_IDS:
            raise UserError(f"{where}: its ids are not 0 to {MAX_IDS - 1}")
        self._names = [names.get(i) for i in range(self.vocab_size)]  # None: an id with no token (decodes to nothing)
        self.token_dtype = np.dtype("<u2" if self.vocab_size <= MAX_VOCAB else "<u4")
        self.special_tokens = {t["content"]: t["id"] for t in self._added}
        self.nonspecial = [t["content"] for t in self._added if not t.get("special")]
        self._special_set = {t["content"] for t in self._added if t.get("special")}
        # added tokens by where they are found: the raw text (normalized false), the normalized pieces (true,
        # their content normalized as the text will be)
        self._raw = self._matcher([t for t in self._added if not t.get("normalized", not t.get("special"))], False)
        self._normal = self._matcher([t for t in self._added if t.get("normalized", not t.get("special"))], True)

        contents = [t["content"] for t in self._added]
        if eos is None:
            eos = "</s>" if "</s>" in contents else (contents[0] if contents else None)
        if eos is None or eos not in self.special_tokens:
            raise UserError(f"{where} has no added token {eos!r} to end a text with" if eos else
                            f"{where} has no special token to end a text with")
        self.eos, self.eos_id = eos, self.special_tokens[eos]
        first = self._template[0] if self._template else None
        if isinstance(first, list) and len(first) == 1 and first[0] in names:
            self.bos, self.bos_id = names[first[0]], first[0]
        elif bos is not None and self._template is None:
            if bos not in self.special_tokens:
                raise UserError(f"{where}: the beginning-of-text token {bos!r} is not an added token")
            self.bos, self.bos_id = bos, self.special_tokens[bos]
            self._template = [[self.bos_id], "A"]
        else:
            self.bos = self.bos_id = None
        self._cache = {}
        # A vocabulary in which `▁` only begins tokens (every SentencePiece-trained one) has no merge across the
        # start of a `▁` run that follows another character: a long word (Llama 2's layout has no
        # pre-tokenizer: the whole text is one) is merged a piece at a time, each distinct piece once.
        lead = re.compile(f"{SPACE}*[^{SPACE}]*")
        self._sub_words = (re.compile(f"{SPACE}+[^{SPACE}]*|[^{SPACE}]+")
                           if SPACE in vocab and not (self._ignore_merges or self._prefix or self._suffix)
                           and all(lead.fullmatch(name) for name in vocab) else None)
        self.set_chat()

    def _matcher(self, tokens, normalized):
        """(regex of the tokens' texts, leftmost then longest, {text: token}) or (None, {})."""
        by_text = {}
        for t in tokens:
            text = self._normalize(t["content"]) if normalized and self._normalize else t["content"]
            by_text.setdefault(text, t)
        texts = sorted((t for t in by_text if t), key=len, reverse=True)
        return (re.compile("|".join(map(re.escape, texts))) if texts else None), by_text

    # -------------------------------------------------------------------------------------------- encoding

    def encode(self, text, allow_special=False, add_bos=None):
        """Token ids of text (str, or UTF-8 bytes), as `tokenizers` gives them: special tokens written in the text
        are found only with allow_special (else `encode_special_tokens`); non-special added tokens always are.
        add_bos: apply the post-processor's template (its special tokens around the text; by default)."""
        ids = self._encode_text(_as_text(text), allow_special, 1)
        if self._template is not None and (add_bos is None or add_bos):
            ids = [i for piece in self._template for i in (ids if piece == "A" else piece)]
        return ids

    def encode_ordinary(self, text):
        """Token ids of text with no added token recognised and no template."""
        text = _as_text(text)
        return self._words([(self._normal_text(text), len(self._normal_text(text[:1])))] if text else [])

    def _normal_text(self, text):
        return self._normalize(text) if self._normalize else text

    def _encode_text(self, text, allow_special, at_origin):
        """Ids of text, added tokens split out first; at_origin: it starts the text."""
        ids = []
        for piece, token, origin in self._extract(text, self._raw, allow_special, at_origin):
            if token is not None:
                ids.append(token["id"])
                continue
            origin = self._origin(piece) if origin and piece else 0
            piece = self._normal_text(piece)
            words = []
            for part, token2, origin2 in self._extract(piece, self._normal, allow_special, origin):
                if token2 is not None:
                    ids += self._words(words)
                    words = []
                    ids.append(token2["id"])
                elif part:
                    words.append((part, origin2))
            ids += self._words(words)
        return ids

    def _origin(self, piece):
        """How many characters of the normalized piece stand for its first character (it starts the text):
        what the normalizer writes for that character, or where it removes it, none. Only Metaspace's
        prepend_scheme "first" reads it."""
        if not self._normalize or not self._reads_origin:
            return 1
        head = piece[:64]  # normalizers act near each character: a window shows the first one's share
        alone = len(self._normalize(head[0]))
        return max(alone, len(self._normalize(head)) - len(self._normalize(head[1:]))) if alone or len(head) > 1 else 0

    def _extract(self, text, matcher, allow_special, at_origin):
        """(piece, added token or None, its origin) of text cut on the matcher's added tokens, as
        `tokenizers`' AddedVocabulary.find_matches (single_word, lstrip, rstrip)."""
        regex, by_text = matcher
        if regex is None or not text:
            return [(text, None, at_origin)]
        out, done = [], 0
        for m in regex.finditer(text):
            token = by_text[m.group()]
            if not allow_special and token["content"] in self._special_set:
                continue
            start, stop = m.span()
            if token.get("single_word"):
                before = start == 0 or not _is_word(text[start - 1])
                after = stop == len(text) or not _is_word(text[stop])
                if not (before and after):
                    continue
            if token.get("lstrip"):
                k = start
                while k > 0 and text[k - 1] in _RE_SPACE:
                    k -= 1
                start = max(k, done)
            if token.get("rstrip"):
                while stop < len(text) and text[stop] in _RE_SPACE:
                    stop += 1
            if done < start:
                out.append((text[done:start], None, max(0, at_origin - done)))
            out.append((text[start:stop], token, False))
            done = stop
        if done < len(text):
            out.append((text[done:], None, max(0, at_origin - done)))
        return out

    def _words(self, words):
        """Ids of normalized text pieces: pre-tokenized, then each word merged."""
        if self._pre is not None:
            words = self._pre(words)
        cut = self._sub_words
        pieces = [w for word, _ in words for w in cut.findall(word)] if cut is not None else [w for w, _ in words]
        return cached_tokens(pieces, self._cache, self._merge_word, _CACHE_WORDS)

    def _symbols(self, word):
        """The word's first symbols, as `tokenizers`' BPE::merge_word: each character (with the continuing
        prefix after the first, the end-of-word suffix on the last), else its <0xXX> byte tokens, else unk."""
        vocab, out, unk = self._vocab, [], None
        last = len(word) - 1
        for k, c in enumerate(word):
            s = (self._prefix + c if self._prefix and k else c) + (self._suffix if self._suffix and k == last else "")
            i = vocab.get(s)
            if i is not None:
                if unk is not None:
                    out.append(unk)
                    unk = None
                out.append(i)
                continue
            if self._byte_fallback:
                fallback = [vocab.get(f"<0x{b:02X}>") for b in s.encode("utf-8", "surrogateescape")]
                if None not in fallback:
                    out += fallback
                    continue
            if self._unk_id is not None:
                if unk is not None and not self._fuse_unk:
                    out.append(unk)
                unk = self._unk_id
        if unk is not None:
            out.append(unk)
        return out

    def _merge_word(self, word):
        if self._ignore_merges and word in self._vocab:
            return [self._vocab[word]]
        return merge_symbols(self._symbols(word), self._merges)

    def _encode_stream(self, read, allow_special, chunk_bytes=CHUNK):
        """Yield (int32 ids, bytes read) chunk by chunk: the text is cut after a line break that a printable
        ASCII character follows, outside any added token (every grammar restarts there)."""
        longest = max((len(t["content"].encode()) for t in self._added), default=0)
        buf, origin = b"", 1
        while True:
            block = read(chunk_bytes)
            buf = buf + block if buf else block
            cut = len(buf) if not block else self._safe_cut(buf, longest)
            text = buf[:cut].decode("utf-8", "surrogateescape")
            yield np.array(self._encode_text(text, allow_special, origin), np.int32), len(block)
            origin = 1 if origin and cut == 0 else 0
            if not block:
                return
            buf = buf[cut:]

    def _safe_cut(self, data, longest):
        cut = data.rfind(b"\n", 0, max(0, len(data) - longest - 8))
        while cut >= 0:
            if 0x21 <= data[cut + 1] <= 0x7E and not self._inside_added(data, cut + 1, longest):
                return cut + 1
            cut = data.rfind(b"\n", 0, cut)
        return 0

    def _inside_added(self, data, at, longest):
        window = data[max(0, at - longest):at + longest].decode("utf-8", "surrogateescape")
        left = len(data[max(0, at - longest):at].decode("utf-8", "surrogateescape"))
        for regex, _ in (self._raw, self._normal):
            if regex is not None and any(m.start() < left < m.end() for m in regex.finditer(window)):
                return True
        return False

    # -------------------------------------------------------------------------------------------- decoding

    def decode(self, ids, text_start=False):
        """The UTF-8 bytes of the text `tokenizers` decodes the ids to (special tokens kept); bytes that are
        not UTF-8 stay as they are. Without text_start the ids continue a text (decode(a + b) is
        decode(a, True) + decode(b)): a decoder's cut at the start of the text is not made."""
        ids = checked_ids(ids, self.vocab_size)
        tokens = [self._names[i] for i in ids if self._names[i] is not None]
        if not tokens:
            return b""
        return "".join(self._decode_chain(tokens, bool(text_start))).encode("utf-8", "surrogateescape")

    # ------------------------------------------------------------------------------------ serialization

    def to_json(self):
        """Compact JSON: the tokenizer.json itself, the end- and beginning-of-text tokens and the chat settings."""
        d = {"format": FORMAT, "version": 1, "hf": self.hf, "eos": self.eos, "bos": self._own_bos}
        d.update(self._chat_json())
        return json.dumps(d, separators=(",", ":"), ensure_ascii=False)

    @property
    def _own_bos(self):
        """The bos given to the constructor that the file's post-processor did not add."""
        return self.bos if post_template(self.hf.get("post_processor"), []) is None else None

    @classmethod
    def from_json(cls, text):
        try:
            d = json.loads(text)
            ok = d["format"] == FORMAT and d["version"] == 1 and isinstance(d["hf"], dict)
        except (ValueError, TypeError, KeyError):
            ok = False
        if not ok:
            raise UserError("not a nanoeuler tokenizer (corrupt or unknown JSON)")
        return cls(d["hf"], d.get("eos"), d.get("bos"), "the tokenizer").set_chat(
            d.get("chat_template"), d.get("end_ids"), d.get("named_tokens"))

    @classmethod
    def from_hf(cls, d, path, eos=None, bos=None):
        return cls(d, eos, bos, str(path))

    def byte_level_names(self):
        """No GGUF form (export --gguf reads this): llama.cpp's tokenizers take the two fast layouts only."""
        raise UserError("export --gguf: this tokenizer's structure (read part by part from its tokenizer.json) is "
                        "not one of llama.cpp's; it takes the byte-level and SentencePiece layouts")

    def save_hf(self, path):
        """Write the tokenizer.json it was read from (with a BOS it was given as its post-processor)."""
        hf = dict(self.hf)
        if self._own_bos is not None:
            single = [{"SpecialToken": {"id": self.bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
            hf["post_processor"] = {"type": "TemplateProcessing", "single": single, "pair": single + [
                {"Sequence": {"id": "B", "type_id": 1}}], "special_tokens": {
                self.bos: {"id": self.bos, "ids": [self.bos_id], "tokens": [self.bos]}}}
        atomic_write(path, lambda f: f.write(json.dumps(hf, ensure_ascii=False).encode()))


def _added_ids(vocab, added):
    """The added tokens with the ids `tokenizers` gives them as it loads a file: a token of the model's
    vocabulary keeps that id, another takes the next id after the vocabulary and the added tokens so far (the
    file's id is not read); a repeated text is one token."""
    out, seen = [], set()
    for t in added:
        if t["content"] in seen:
            continue
        seen.add(t["content"])
        i = vocab.get(t["content"])
        if i is None:
            top = max((u["id"] for u in out), default=None)
            i = len(vocab) if top is None or (top < len(vocab) and len(vocab)) else top + 1
        out.append(dict(t, id=i))
    return out


_RE_SPACE = frozenset(WHITE_SPACE)  # Rust regex's \s: White_Space


def _is_word(c):
    """Rust regex's \\w (added tokens' single_word): Alphabetic (letters, letter numbers, the circled and squared
    letters), a mark, a decimal digit, a connector punctuation or a join control."""
    cat, cp = unicodedata.category(c), ord(c)
    return (cat[0] in "LM" or cat in ("Nd", "Nl", "Pc") or c in "\u200c\u200d" or 0x24B6 <= cp <= 0x24E9
            or 0x1F130 <= cp <= 0x1F149 or 0x1F150 <= cp <= 0x1F169 or 0x1F170 <= cp <= 0x1F189)
