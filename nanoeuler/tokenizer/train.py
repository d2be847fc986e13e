"""Training of the byte-level BPE (bpe.Tokenizer.train): the pretokens of a text file counted (all of it, or
1 MiB windows spread evenly over a file above the sample size), then merges learned by the compiled
train_merges of kernels.py in a thread while a progress bar follows it. The special tokens written in the text
(`</s>` closing a corpus's documents) are split out before it is pretokenized and are not counted, as encoding
splits them out (and `tokenizers` its added tokens when it encodes): the counts are of the pieces the encoder
meets, and no merge is learned across or inside one."""
import os
import sys
import threading
import time

import numpy as np

from nanoeuler.errors import UserError
from nanoeuler.tokenizer.pieces import _LOOKAHEAD, _alternation, _PieceTable, _kernels, _split
from nanoeuler.tokenizer.token_file import CHUNK, MAX_IDS, open_input, progress_bar

WINDOW = 1 << 20  # bytes of each window of a sampled file


def train(cls, path, vocab_size, progress=True, special_tokens=("</s>",), max_bytes=128 << 20):
    """A tokenizer of class cls (bpe.Tokenizer) with merges learned on the text file at path until the
    vocabulary (bytes + merges + special tokens) has vocab_size tokens. A file larger than max_bytes is sampled:
    1 MiB windows spread evenly."""
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
        words, lengths, counts, n_bytes = _count_pieces(f, size, max_bytes, progress, special_tokens)
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


def _count_pieces(f, size, max_bytes, progress, special_tokens=()):
    """Count the pretokens of the open file f (all of it, or 1 MiB windows spread evenly over it if it is
    larger than max_bytes), the text between the special tokens' occurrences only. Returns (bytes of the
    distinct pieces back to back, their lengths, their counts, bytes read)."""
    table = _PieceTable()
    counts = np.zeros(0, np.int64)
    pattern, longest = _alternation(special_tokens)
    margin = _LOOKAHEAD + longest  # unless final, text a special token may yet follow waits (bpe's encoding too)

    def count(data, final):
        """Count the pieces of data; unless final, only as far as the rest of the text cannot change them.
        Returns the bytes used."""
        nonlocal counts
        spans, start = [], 0  # (start, end, final) of the text between special tokens
        for m in pattern.finditer(data) if pattern is not None else ():
            if not final and m.start() > len(data) - longest:
                break  # its longest form is not in view yet
            spans.append((start, m.start(), True))
            start = m.end()
        spans.append((start, len(data), final))
        ids, used = [], 0
        for lo, hi, whole in spans:
            arr, ends, n_pieces = _split(memoryview(data)[lo:hi])
            if not whole:
                n_pieces = int(np.searchsorted(ends[:n_pieces], len(arr) - margin, side="right"))
            ids.append(table.intern(arr, ends, n_pieces))
            used = lo + (int(ends[n_pieces - 1]) if n_pieces else 0)
        ids = np.concatenate(ids)  # one count per call, however many documents the data holds
        counts = np.concatenate((counts, np.zeros(len(table) - len(counts), np.int64)))
        counts += np.bincount(ids, minlength=len(table))
        return used

    window = WINDOW
    n_windows = max(1, max_bytes // window)
    n_read = 0
    with progress_bar(progress, total=size if size <= max_bytes else n_windows * window, unit="B",
                       unit_scale=True, desc="count words") as bar:
        if size > max_bytes:
            for k in range(n_windows):
                f.seek(k * size // n_windows)
                block = f.read(window)
                # from a line start, not mid-word; the last few bytes, which may cut a word or a `</s>`, left out
                count(block[block.find(b"\n") + 1:] if k else block, False)
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