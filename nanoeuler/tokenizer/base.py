"""What every tokenizer of nanoeuler shares (the byte-level BPE of bpe.py, the SentencePiece-style BPE of
sentencepiece_bpe.py, any other BPE tokenizer.json in grammar.py): the chat settings a model brings, writing a
token file (token_file.py has the format), reading a tokenizer.json post-processor's BOS, and what a corpus's
document terminator `</s>` is read as (document_end).
"""
import hashlib

from nanoeuler.errors import UserError
from nanoeuler.tokenizer.token_file import (CHUNK, DOCUMENT_END, MAX_IDS, MAX_VOCAB, open_input,  # noqa: F401
                                            progress_bar, write_token_file)


def checked_ids(ids, vocab_size):
    """ids (a sequence or an array) as a list of ints, each a token of a vocabulary of vocab_size; else one line."""
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(i for i in ids if not 0 <= i < vocab_size)
        raise UserError(f"token id {bad} is out of range for a vocabulary of {vocab_size}")
    return ids


def post_bos(post, added_names):
    """The token a tokenizer.json post-processor puts before a single text (None: none; False: it adds
    something else). ByteLevel only fixes offsets; TemplateProcessing may put one special token first."""
    kind = post.get("type")
    if kind == "Sequence":
        found = [post_bos(p, added_names) for p in post.get("processors", [])]
        if False in found or sum(f is not None for f in found) > 1:
            return False
        return next((f for f in found if f is not None), None)
    if kind == "ByteLevel":
        return None
    if kind != "TemplateProcessing":
        return False
    single = post.get("single", [])
    if [next(iter(item)) for item in single] == ["Sequence"]:
        return None
    if [next(iter(item)) for item in single] != ["SpecialToken", "Sequence"]:
        return False
    name = single[0]["SpecialToken"]["id"]
    ids = (post.get("special_tokens") or {}).get(name, {}).get("ids")
    if not ids or len(ids) != 1 or added_names.get(ids[0]) is None:
        return False
    return added_names[ids[0]]


class TokenizerBase:
    """The methods both tokenizers share; a subclass has vocab_size, eos/eos_id, bos/bos_id, special_tokens,
    token_dtype, to_json() and _encode_stream(read, allow_special, chunk_bytes)."""

    def set_chat(self, chat_template=None, end_ids=None, named_tokens=None):
        """What a model brings besides its tokens (an imported one; ours keep the defaults): `chat_template`,
        its Jinja chat template (data/jinja_template.py renders it), or None (ours: data/template.py's Alpaca);
        `end_ids`, every id that ends a reply (generation stops at any of them), the end-of-text id first;
        `named_tokens`, tokenizer_config.json's named special tokens ({"bos_token": ..., "eos_token": ...}),
        the variables of those names that a chat template reads. Returns the tokenizer."""
        if chat_template is not None and not isinstance(chat_template, str):
            raise UserError("corrupt tokenizer: its chat template is not a string")
        try:
            ends = list(dict.fromkeys([self.eos_id] + [int(i) for i in end_ids or ()]))
        except (TypeError, ValueError):
            raise UserError(f"corrupt tokenizer: end ids {end_ids!r} are not ids") from None
        if any(not 0 <= i < self.vocab_size for i in ends):
            raise UserError(f"corrupt tokenizer: end ids {ends} are not all ids of its {self.vocab_size} tokens")
        named = named_tokens if named_tokens is not None else self._default_named()
        if not isinstance(named, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in named.items()):
            raise UserError("corrupt tokenizer: its named tokens are not strings")
        self.chat_template, self.end_ids, self.named_tokens = chat_template, tuple(ends), dict(named)
        return self

    def _default_named(self):
        return {"eos_token": self.eos, **({"bos_token": self.bos} if self.bos is not None else {})}

    def _chat_json(self):
        """The fields of set_chat that differ from the defaults (to_json writes them; old readers skip them)."""
        d = {} if self.chat_template is None else {"chat_template": self.chat_template}
        if self.end_ids != (self.eos_id,):
            d["end_ids"] = list(self.end_ids)
        if self.named_tokens != self._default_named():
            d["named_tokens"] = self.named_tokens
        return d

    def document_end(self):
        """The token that a corpus's document terminator `</s>` (DOCUMENT_END, data/fetch.py writes it) is read
        as: `</s>` itself when it is one of this tokenizer's added tokens (ours; a SentencePiece Llama's or
        Mistral's eos), else the end-of-text token eos (an imported Llama 3's `<|end_of_text|>`, an instruct
        model's `<|eot_id|>`: the id its replies end with and generation stops at first), whose text then
        replaces it, so that each document ends with the model's own end token, not four characters."""
        if DOCUMENT_END in self.special_tokens:
            return DOCUMENT_END
        if self.encode(self.eos, allow_special=True, add_bos=False) != [self.eos_id]:
            raise UserError(f"the tokenizer does not read its end-of-text token {self.eos!r} as its id "
                            f"{self.eos_id}, so a corpus's {DOCUMENT_END} cannot become it")
        return self.eos

    def with_document_ends(self, text):
        """text (str or bytes) with each document terminator `</s>` replaced by document_end()'s text: what
        encode(..., allow_special=True) reads as a corpus is read (encode_file with document_ends)."""
        end = self.document_end()
        if end == DOCUMENT_END:
            return text
        return text.replace(DOCUMENT_END, end) if isinstance(text, str) else \
            bytes(text).replace(DOCUMENT_END.encode(), end.encode())

    def encode_file(self, in_path, out_path, progress=True, allow_special=False, chunk_bytes=CHUNK,
                    document_ends=False):
        """Tokenize the file in_path into the token file out_path (token_file.py's format, written atomically),
        reading chunk_bytes at a time, with the same ids as encode() on the whole text (with document_ends, on
        with_document_ends(text)). Returns the token count; read_token_file(out_path) reads the tokens."""
        return write_token_file(self, in_path, out_path, progress, allow_special, chunk_bytes, document_ends)

    def sha256(self):
        return hashlib.sha256(self.to_json().encode()).hexdigest()

