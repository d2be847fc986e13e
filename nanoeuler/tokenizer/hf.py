"""Hugging Face tokenizer.json, read and written: `load` picks the class a file needs, and the byte-level
Tokenizer's reader and writer live here.

    tok = load("tokenizer.json")    # any BPE tokenizer.json `tokenizers` reads, or our compact JSON

Which class reads a tokenizer.json: a byte-level BPE whose pretokenization is one that the compiled scanner of
kernels.py knows (GPT-2's, SmolLM's digits one by one, Llama 3's, Qwen2's; NFC or no normalizer; at most a BOS
added) is a bpe.Tokenizer; a SentencePiece-style BPE of the common layouts (Llama 2's normalizer, or Metaspace) a
sentencepiece_bpe.SentencePieceBPE; every other BPE file a grammar.GrammarBPE, which interprets each of its parts.
The first two are the fast paths; all three give the ids `tokenizers` gives. A model that is not BPE (WordPiece,
Unigram, WordLevel) or a part nanoeuler does not read is one line naming it.
"""
import json

from nanoeuler.errors import UserError
from nanoeuler.files import atomic_write
from nanoeuler.tokenizer.base import post_bos
from nanoeuler.tokenizer.pieces import LLAMA3_REGEX, QWEN2_REGEX, _byte_level_decoding, bytes_to_unicode
from nanoeuler.tokenizer.token_file import open_input


def load(path, eos=None, bos=None, byte_level=None):
    """A tokenizer from a file: a Hugging Face tokenizer.json (its ids kept) or our compact JSON (to_json). eos
    names the end-of-text token of a tokenizer.json (default: </s> if it has one, else its first added token);
    bos a token to put first when its post-processor does not (tokenizer_config.json's add_bos_token).
    byte_level: the byte-level class (bpe.Tokenizer, which calls this as Tokenizer.load)."""
    with open_input(path) as f:
        text = f.read()
    try:
        d = json.loads(text)
    except ValueError:
        raise UserError(f"{path} is not JSON") from None
    if isinstance(d, dict) and "model" in d:
        return from_hf(d, path, eos, bos, byte_level)
    return byte_level.from_json(text)


def from_hf(d, path, eos=None, bos=None, byte_level=None):
    """The tokenizer of a tokenizer.json dict: the fastest class that reads it exactly (module docstring)."""
    from nanoeuler.tokenizer import grammar, sentencepiece_bpe

    model = d.get("model")
    kind = grammar.model_type(model)
    if kind != "BPE":
        raise UserError(f"{path}: its model is {kind}; nanoeuler reads BPE models only")
    if "type" not in model:  # an older `tokenizers`' file (GPT-2's): the same model
        d = {**d, "model": {"type": "BPE", **model}}
    try:
        if sentencepiece_bpe.is_sentencepiece_style(d):
            return sentencepiece_bpe.SentencePieceBPE.from_hf(d, path, eos, bos)
        return byte_level_from_hf(byte_level, d, path, eos, bos)
    except grammar.Unsupported:
        raise
    except UserError:  # a structure the fast classes do not hold: the grammar reads every part
        return grammar.GrammarBPE.from_hf(d, path, eos, bos)


def save_byte_level(tok, path):
    """Write a byte-level Tokenizer's tokenizer.json, which gives exactly its ids."""
    atomic_write(path, lambda f: f.write(json.dumps(byte_level_dict(tok), ensure_ascii=False).encode()))


def byte_level_dict(tok):
    """The tokenizer.json dict of a byte-level Tokenizer, which gives exactly its ids."""
    names, merges = tok.byte_level_names()
    specials = set(tok.special_tokens.values())
    vocab = {name: i for i, name in enumerate(names) if i not in specials}
    for s, i in tok.special_tokens.items():
        if s in vocab:
            raise UserError(f"special token {s!r} has the same name as ordinary token {vocab[s]} in tokenizer.json")
        vocab[s] = i
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    pre = byte_level
    if tok.rule == "gpt2_digits":
        pre = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}
    elif tok.rule in ("llama3", "qwen2"):
        split = {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX if tok.rule == "llama3" else QWEN2_REGEX},
                 "behavior": "Isolated", "invert": False}
        pre = {"type": "Sequence", "pretokenizers": [split, {**byte_level, "use_regex": False}]}
    post = None
    if tok.bos is not None:
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": tok.bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": tok.bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": tok.bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {tok.bos: {"id": tok.bos, "ids": [tok.bos_id], "tokens": [tok.bos]}}}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": s in tok.nonspecial, "special": s not in tok.nonspecial}
                         for s, i in tok.special_tokens.items()],
        "normalizer": {"type": "NFC"} if tok.normalizer == "nfc" else None, "pre_tokenizer": pre,
        "post_processor": post, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": tok.ignore_merges, "vocab": vocab,
                  "merges": merges},  # "left right" strings: the form every `tokenizers` version reads
    }


def byte_level_from_hf(cls, d, path, eos=None, bos=None):
    """A bpe.Tokenizer (cls) from a tokenizer.json's dict: a byte-level BPE with one of the pretokenizations of
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
