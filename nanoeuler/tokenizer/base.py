"""What every tokenizer of nanoeuler shares (the byte-level BPE of bpe.py, the SentencePiece-style BPE of
sentencepiece_bpe.py): the chat settings a model brings, the token-file format and its writer, and reading a
tokenizer.json post-processor's BOS.

Token files (`.tok`): a 128-byte header (magic "NEUTOKS\0", format version, token count, the size and mtime of
the text file they were made from, the tokenizer's sha256), then the tokens as little-endian uint16 (format
version 1), or uint32 (version 2) for a vocabulary above 65,536; bpe.read_token_file reads them.
"""
import hashlib
import os
import struct

from nanoeuler.errors import UserError
from nanoeuler.files import atomic_write

MAX_VOCAB = 1 << 16  # token files hold uint16 tokens up to this vocabulary, uint32 above it
MAX_IDS = 1 << 31  # any tokenizer, trained or loaded: ids are int32
CHUNK = 8 << 20  # text is tokenized this many bytes at a time
TOKENS_MAGIC = b"NEUTOKS\x00"
TOKENS_VERSION = 1  # uint16 tokens; version 2: uint32 (a vocabulary above MAX_VOCAB)
# magic, version, token count, source file size, source mtime_ns, tokenizer sha256 (hex); padded to 128 bytes
TOKENS_HEADER = struct.Struct("<8sI4xQQq64s")
TOKENS_HEADER_BYTES = 128


def open_input(path):
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


def progress_bar(enabled, **kw):
    from tqdm import tqdm

    return tqdm(disable=not enabled, dynamic_ncols=True, **kw)


def tokens_header(n_tokens, source_stat, tok, dtype):
    return TOKENS_HEADER.pack(TOKENS_MAGIC, TOKENS_VERSION if dtype.itemsize == 2 else 2, n_tokens,
                              source_stat.st_size, source_stat.st_mtime_ns, tok.sha256().encode())


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

    def encode_file(self, in_path, out_path, progress=True, allow_special=False, chunk_bytes=CHUNK):
        """Tokenize the file in_path into the token file out_path (the module docstring's format, written
        atomically), reading chunk_bytes at a time (the text is never held in memory), with the same ids as
        encode() on the whole text. Returns the token count; read_token_file(out_path) reads the tokens."""
        open_input(in_path).close()  # a missing input is an error before anything is written

        def write(dst):
            dst.write(bytes(TOKENS_HEADER_BYTES))  # the header needs the token count: written once it is known
            n = 0
            with open_input(in_path) as f, progress_bar(progress, total=os.fstat(f.fileno()).st_size,
                                                          unit="B", unit_scale=True, desc="tokenize") as bar:
                source = os.fstat(f.fileno())  # as it was when reading began: a later change makes it stale
                for ids, n_read in self._encode_stream(f.read, allow_special, chunk_bytes):
                    dst.write(ids.astype(self.token_dtype).tobytes())
                    n += len(ids)
                    bar.update(n_read)
            dst.seek(0)
            dst.write(tokens_header(n, source, self, self.token_dtype))
            count.append(n)

        count = []
        atomic_write(out_path, write)
        return count[0]

    def sha256(self):
        return hashlib.sha256(self.to_json().encode()).hexdigest()

