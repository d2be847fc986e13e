"""Token files (`.tok`, the one format: what encode_file writes and what training reads, as its cached
`<corpus>.tok`): a 128-byte header (magic "NEUTOKS\0", format version, flags, token count, the size and mtime of
the text file they were made from, the tokenizer's sha256), then the tokens as little-endian uint16 (format
version 1), or uint32 (version 2) for a vocabulary above 65,536. Flag SPECIAL_TOKENS says that the special
tokens written in the text (`</s>`) were read as those tokens (allow_special); a file written before the flag
has 0 there, as a file of text read as text does. Flag DOCUMENT_ENDS says that each document terminator `</s>`
was read as the tokenizer's end-of-text token, which a tokenizer without `</s>` among its added tokens reads as
text otherwise (document_ends; TokenizerBase.document_end); it is set only where that changed the tokens, so a
tokenizer whose `</s>` is a token writes the same file either way. write_token_file writes one
(TokenizerBase.encode_file), read_token_file reads one and checks its header, and with
`source`/`tok`/`allow_special`/`document_ends` that it still matches that text, that tokenizer and that reading
of the special tokens and document terminators.
"""
import os
import struct

import numpy as np

from nanoeuler.errors import UserError
from nanoeuler.files import atomic_write

MAX_VOCAB = 1 << 16  # token files hold uint16 tokens up to this vocabulary, uint32 above it
MAX_IDS = 1 << 31  # any tokenizer, trained or loaded: ids are int32
CHUNK = 8 << 20  # text is tokenized this many bytes at a time


def open_input(path):
    """path opened for reading bytes; a missing or unreadable file, or a folder, is one line."""
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


TOKENS_MAGIC = b"NEUTOKS\x00"
TOKENS_VERSION = 1  # uint16 tokens; version 2: uint32 (a vocabulary above MAX_VOCAB)
# magic, version, flags, token count, source file size, source mtime_ns, tokenizer sha256 (hex); padded to 128
# bytes. The flags are where the first headers had 4 zero bytes of padding: those read as no flag set.
TOKENS_HEADER = struct.Struct("<8sIIQQq64s")
SPECIAL_TOKENS = 1  # flag: the special tokens written in the text were read as those tokens
DOCUMENT_ENDS = 2  # flag: each `</s>` was read as the end-of-text token of a tokenizer that has no `</s>`
DOCUMENT_END = "</s>"  # what closes each document of a corpus (data/fetch.py writes it)
TOKENS_HEADER_BYTES = 128


def tokens_header(n_tokens, source_stat, tok, dtype, allow_special=False, document_ends=False):
    return TOKENS_HEADER.pack(TOKENS_MAGIC, TOKENS_VERSION if dtype.itemsize == 2 else 2,
                              (SPECIAL_TOKENS if allow_special else 0) | (DOCUMENT_ENDS if document_ends else 0),
                              n_tokens, source_stat.st_size, source_stat.st_mtime_ns, tok.sha256().encode())


def mapped_document_end(tok, allow_special, document_ends):
    """The text that replaces each `</s>` of the text read this way, or None where `</s>` stays as it is (no
    document_ends; without allow_special every token's text is text; a tokenizer whose `</s>` is a token)."""
    if not (document_ends and allow_special):
        return None
    end = tok.document_end()
    return None if end == DOCUMENT_END else end


class Replacing:
    """read(k) of a binary file with every `old` replaced by `new` (a non-empty block until the end, as
    _encode_stream expects): the tail of a block that may begin an `old` cut by the read is held back for the
    next one. `consumed` counts the file's bytes read, for the progress bar."""

    def __init__(self, read, old, new):
        self.raw, self.old, self.new, self.held, self.consumed = read, old, new, b"", 0

    def read(self, k):
        while True:
            block = self.raw(k)
            self.consumed += len(block)
            data, self.held = self.held + block, b""
            if not block:  # the end: what was held cannot be an `old`
                return data
            keep = next((j for j in range(len(self.old) - 1, 0, -1) if data.endswith(self.old[:j])), 0)
            data, self.held = data[:len(data) - keep], data[len(data) - keep:]
            if data:
                return data.replace(self.old, self.new)


def write_token_file(tok, in_path, out_path, progress=True, allow_special=False, chunk_bytes=None,
                     document_ends=False):
    """Tokenize the file in_path with tok into the token file out_path (written atomically), reading
    chunk_bytes at a time (the text is never held in memory), with the same ids as tok.encode() on the whole
    text; with document_ends (and allow_special), on tok.with_document_ends(text). Returns the token count."""
    chunk_bytes = chunk_bytes or CHUNK
    open_input(in_path).close()  # a missing input is an error before anything is written
    end = mapped_document_end(tok, allow_special, document_ends)

    def write(dst):
        dst.write(bytes(TOKENS_HEADER_BYTES))  # the header needs the token count: written once it is known
        n = 0
        with open_input(in_path) as f, progress_bar(progress, total=os.fstat(f.fileno()).st_size,
                                                      unit="B", unit_scale=True, desc="tokenize") as bar:
            source = os.fstat(f.fileno())  # as it was when reading began: a later change makes it stale
            reader = Replacing(f.read, DOCUMENT_END.encode(), end.encode()) if end else None
            done = 0  # bytes of the file read so far
            for ids, n_read in tok._encode_stream(reader.read if reader else f.read, allow_special, chunk_bytes):
                dst.write(ids.astype(tok.token_dtype).tobytes())
                n += len(ids)
                bar.update(reader.consumed - done if reader else n_read)
                done = reader.consumed if reader else done
        dst.seek(0)
        dst.write(tokens_header(n, source, tok, tok.token_dtype, allow_special, end is not None))
        count.append(n)

    count = []
    atomic_write(out_path, write)
    return count[0]


def read_token_file(path, source=None, tok=None, allow_special=None, document_ends=None):
    """The tokens of a token file (Tokenizer.encode_file) as a read-only uint16 (uint32, for a vocabulary above
    65,536) memmap (a corpus of many GB
    costs no RAM). With `source` (a path) or `tok`, the file must have been made from that file as it is now
    (same size and mtime) and with that tokenizer; with `allow_special` (True or False), with the special tokens
    written in the text read that way; with `document_ends` (True or False; needs `tok` and `allow_special`),
    with each `</s>` read that way (write_token_file). Every way it can fail is a one-line UserError."""
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
    _, version, flags, n_tokens, src_size, src_mtime, sha = TOKENS_HEADER.unpack(head)
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
    if allow_special is not None and bool(flags & SPECIAL_TOKENS) != bool(allow_special):
        read = "as text" if allow_special else "as special tokens"
        raise UserError(f"token file {path} was made with the special tokens in the text (</s>) read {read}")
    if document_ends is not None and bool(flags & DOCUMENT_ENDS) != bool(
            mapped_document_end(tok, allow_special, document_ends)):
        read = "as text" if flags & DOCUMENT_ENDS == 0 else "as the end-of-text token"
        raise UserError(f"token file {path} was made with its document terminators ({DOCUMENT_END}) read {read}")
    if n_tokens == 0:  # np.memmap cannot map zero bytes
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=TOKENS_HEADER_BYTES, shape=(n_tokens,))
