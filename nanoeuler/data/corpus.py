"""Training data: a text corpus tokenized once into a cached token file, split, and cut into batches.

    corpus = open_corpus("shakespeare.txt", tok)     # builds or reuses shakespeare.txt.tok
    source = RandomWindows(corpus.train, batch=16, context=128, K=2, seed=0)
    inputs, targets = source.next()                  # int32 (B, T) and (K, B, T)

The cache is a token file, the one format of nanoeuler/tokenizer/bpe.py (written by Tokenizer.encode_file, read
by read_token_file): a 128-byte header (magic, version, flags, token count, the corpus file's size and mtime, the
tokenizer's sha256) followed by the tokens as little-endian uint16 (uint32 for a vocabulary above 65,536).
Any mismatch with the corpus, the tokenizer or the reading of special tokens and document terminators (flags:
a cache whose `</s>` was read as text is not this one) rebuilds it, so a stale cache is never used. It is
memory-mapped, so a corpus of many GB costs no RAM. The tokenizer's special tokens written in the text
(`</s>`) are those tokens, so a corpus can close its documents with the end-of-text token, as pretraining
corpora do (GPT-2's `<|endoftext|>`): a model then learns where a text ends before fine-tuning asks it to
end its replies. A tokenizer without `</s>` (an imported Llama 3's, Qwen2's) reads each `</s>` as its own
end-of-text token (TokenizerBase.document_end, the one rule; encode_text for a corpus's text in memory).
The validation split is the last tenth of the corpus by bytes (cut at the first token boundary that
covers it), so bits per byte are measured on text the model never trained on.

A batch source is any object with `next() -> (inputs, targets)`, `state()` and `load_state(state)`; the
training loop saves `state()` in every checkpoint and restores it on --resume, which is what makes a resumed
run draw exactly the batches the uninterrupted run would have drawn.

Provenance: a fetched data file has a sidecar, `<file>.source.json` (written by data/fetch.py), that names its
sources (URL, pinned revision, sha256); provenance(path) is what a run records of its data in the first
record of its metrics log: the file's size and sha256, and the sidecar's sources when it describes this very
file. fetch_hint(path) says how to get a missing default data file.
"""
import hashlib
import json
import os
import re
import tempfile

import numpy as np
from tqdm import tqdm

from nanoeuler.errors import UserError
from nanoeuler.tokenizer.bpe import read_token_file

VAL_FRACTION = 0.1


def cache_path(corpus_path):
    """`<corpus>.tok` next to the corpus, or in the temp dir when the corpus's directory is read-only."""
    corpus_path = os.path.abspath(corpus_path)
    if os.access(os.path.dirname(corpus_path), os.W_OK):
        return corpus_path + ".tok"
    digest = hashlib.sha256(corpus_path.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"nanoeuler-{os.path.basename(corpus_path)}-{digest}.tok")


ALLOW_SPECIAL = True  # the special tokens written in a corpus (`</s>`) are those tokens
DOCUMENT_ENDS = True  # each `</s>` closing a document is the tokenizer's end-of-text token (document_end)


def encode_text(tok, text):
    """The token ids of a corpus's text (str or bytes) as training reads the corpus's file (open_corpus: no BOS)."""
    return tok.encode(tok.with_document_ends(text) if DOCUMENT_ENDS else text, allow_special=ALLOW_SPECIAL,
                      add_bos=False)


def cached_tokens(corpus_path, tok):
    """The corpus's cached tokens as a read-only memmap, or None if its cache is missing, damaged or stale."""
    try:
        return read_token_file(cache_path(corpus_path), source=corpus_path, tok=tok, allow_special=ALLOW_SPECIAL,
                               document_ends=DOCUMENT_ENDS)
    except UserError:
        return None


class Corpus:
    """A tokenized corpus: `tokens` (memmap uint16, uint32 for a vocabulary above 65,536), its `train` and
    `val` splits (views), and `byte_len`, the number of bytes each token id decodes to (for bits per byte)."""

    def __init__(self, tokens, byte_len, n_bytes):
        self.tokens, self.byte_len = tokens, byte_len
        # walk back from the end until a tenth of the corpus's bytes is covered; reads only the val split
        want, got, split, chunk = VAL_FRACTION * n_bytes, 0, len(tokens), 1 << 20
        while split > 0 and got < want:
            lo = max(0, split - chunk)
            lens = byte_len[tokens[lo:split]]
            rev = np.cumsum(lens[::-1])
            if got + rev[-1] < want:
                got, split = got + int(rev[-1]), lo
            else:
                split -= int(np.searchsorted(rev, want - got)) + 1
                break
        self.train, self.val = tokens[:split], tokens[split:]


SOURCE_SUFFIX = ".source.json"
# How to make each default data file of the training commands where they look for it (the working directory):
# the fetcher is in the package, so this works outside the clone too.
FETCH_COMMANDS = {"shakespeare.txt": "python -m nanoeuler.data.fetch shakespeare",
                  "data/pretrain.txt": "python -m nanoeuler.data.fetch pretrain",
                  "data/alpaca.json": "python -m nanoeuler.data.fetch alpaca",
                  "data/preferences.jsonl": "python -m nanoeuler.data.fetch preferences",
                  "data/hellaswag_val.jsonl": "python -m nanoeuler.data.hellaswag"}


def fetch_hint(path):
    """' (download it with `COMMAND`, or pass --data FILE)' for a default data file, else ' (pass --data FILE)'."""
    command = FETCH_COMMANDS.get(os.path.normpath(os.fspath(path)).replace(os.sep, "/"))
    return f" (download it with `{command}`, or pass --data FILE)" if command else " (pass --data FILE)"


def sidecar_path(path):
    return os.fspath(path) + SOURCE_SUFFIX


def file_sha256(path, progress=False):
    """The sha256 of a file, read in 1 MiB blocks (a progress bar for the long ones)."""
    digest = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=f"sha256 {os.path.basename(path)}",
                                     disable=not progress or size < 1 << 28, dynamic_ncols=True) as bar:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def provenance(path):
    """What a run records of its data file: {path, bytes, sha256}, plus the sidecar's `sources` (and how the
    file was built) when the sidecar's sha256 is this file's; `sidecar` says which case it is."""
    path = os.fspath(path)
    record = dict(path=os.path.abspath(path), bytes=os.path.getsize(path), sha256=file_sha256(path, progress=True))
    try:
        with open(sidecar_path(path), encoding="utf-8") as f:
            side = json.load(f)
    except FileNotFoundError:
        return dict(record, sidecar="none")
    except (OSError, ValueError):
        return dict(record, sidecar="unreadable")
    if not isinstance(side, dict) or side.get("sha256") != record["sha256"]:
        return dict(record, sidecar="describes another file")
    return dict(record, sidecar="matches", built_by=side.get("built_by"), sources=side.get("sources"))


def count_token(tokens, token_id, block=1 << 24):
    """How many times token_id occurs in tokens (a memmap of any size, read a block at a time)."""
    return sum(int(np.count_nonzero(tokens[i:i + block] == token_id)) for i in range(0, len(tokens), block))


# the fetches whose corpora close their documents with `</s>` (data/fetch.py), as their sidecars name them
DOCUMENT_FETCHES = re.compile(r"nanoeuler\.data\.fetch (gutenberg|web|pretrain)\b")


def unclosed_fetch(record, n_ends):
    """The command that fetched a corpus of documents, from its provenance() record, when the corpus holds
    no document end (n_ends 0: no tok.document_end() token): a fetch made before the fetcher closed documents
    with `</s>`, which the same command rebuilds from its download cache. None otherwise."""
    if n_ends or not record or record.get("sidecar") != "matches":
        return None
    command = record.get("built_by") or ""
    return command if DOCUMENT_FETCHES.search(command) else None


def check_corpus(path):
    if not os.path.exists(path):
        raise UserError(f"corpus {path} not found{fetch_hint(path)}")
    if not os.path.isfile(path):
        raise UserError(f"corpus {path} is not a file")
    if os.path.getsize(path) == 0:
        raise UserError(f"corpus {path} is empty")


def open_corpus(path, tok, progress=True):
    path = os.fspath(path)
    check_corpus(path)
    tokens = cached_tokens(path, tok)
    if tokens is None:
        cache = cache_path(path)
        tok.encode_file(path, cache, progress=progress, allow_special=ALLOW_SPECIAL, document_ends=DOCUMENT_ENDS)
        # an error here: the corpus changed meanwhile
        tokens = read_token_file(cache, source=path, tok=tok, allow_special=ALLOW_SPECIAL,
                                 document_ends=DOCUMENT_ENDS)
    byte_len = np.array([len(tok.decode([i])) for i in range(tok.vocab_size)], dtype=np.int64)
    return Corpus(tokens, byte_len, os.path.getsize(path))


def windows_to_batch(win, context, K):
    """Windows (B, context + K) -> inputs (B, T) and targets (K, B, T): targets[k] is 1+k tokens ahead."""
    inputs = np.ascontiguousarray(win[:, :context], dtype=np.int32)
    targets = np.stack([win[:, 1 + k:1 + k + context] for k in range(K)]).astype(np.int32)
    return inputs, targets


class RandomWindows:
    """Pretraining batches: `batch` windows of context + K tokens at uniformly random offsets.

    With N ranks (data parallel) every rank draws the same offsets for the global batch of N x batch windows
    from the same generator and keeps its own slice, rank r the rows r*batch..(r+1)*batch-1. So the ranks see
    different windows, and the global batch is a function of the seed and the step alone: N ranks at batch B
    train on exactly the windows one process draws at batch N x B, and a checkpoint (one state for all ranks)
    resumes on any number of ranks with the same data."""

    def __init__(self, tokens, batch, context, K, seed, rank=0, world_size=1):
        self.tokens, self.batch, self.context, self.K = tokens, batch, context, K
        self.rank, self.world_size = rank, world_size
        self.span = context + K
        if len(tokens) < self.span:
            raise UserError(f"the training split has {len(tokens)} tokens, fewer than one window of "
                            f"{self.span}; use a larger corpus")
        self.rng = np.random.default_rng(seed)

    def next(self):
        starts = self.rng.integers(0, len(self.tokens) - self.span + 1, size=self.batch * self.world_size)
        starts = starts[self.rank * self.batch:(self.rank + 1) * self.batch]
        win = self.tokens[starts[:, None] + np.arange(self.span)]
        return windows_to_batch(win, self.context, self.K)

    def state(self):
        return {"rng": self.rng.bit_generator.state}

    def load_state(self, state):
        self.rng.bit_generator.state = state["rng"]


def eval_batches(tokens, byte_len, batch, context, K, limit=None):
    """Validation batches covering `tokens` with consecutive windows (each token is a head-0 target once).

    Returns a list of (inputs, targets, n_bytes), where n_bytes counts the bytes of the valid head-0
    targets (for bits per byte). Targets past the end are -1, and the last batch is padded with rows of -1
    targets, so every batch has the same shape (the engine keeps its buffers). With `limit`, only that many
    batches, of windows spread evenly over the split (a cheaper estimate for the periodic evaluations)."""
    n = len(tokens)
    if n < 2:
        raise UserError(f"the validation split has {n} tokens; use a larger corpus")
    starts = np.arange(0, n - 1, context)
    if limit is not None and limit * batch < len(starts):
        # single windows spread evenly over the whole split: a far better sample than a few whole batches
        starts = starts[np.linspace(0, len(starts) - 1, limit * batch).round().astype(int)]
    out = []
    for b in range(0, len(starts), batch):
        win = np.full((batch, context + K), -1, dtype=np.int64)
        for row, start in enumerate(starts[b:b + batch]):
            piece = tokens[start:start + context + K]
            win[row, :len(piece)] = piece
        inputs, targets = windows_to_batch(win, context, K)
        inputs[inputs < 0] = 0  # padding positions past the end: their targets are -1 anyway
        valid = targets[0][targets[0] >= 0]
        out.append((inputs, targets, int(byte_len[valid].sum())))
    return out
