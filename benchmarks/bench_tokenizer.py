"""Tokenizer speed: nanoeuler's BPE against Hugging Face `tokenizers` on the same text and vocabulary size.

    python benchmarks/bench_tokenizer.py                     # shakespeare.txt twice (10.1 MB), vocab 4096
    python benchmarks/bench_tokenizer.py --file data/web.txt --repeat 1

Both sides learn a byte-level BPE of the same size (with `</s>`) on the same file, then encode the whole
text. `tokenizers` runs on every core (its default); nanoeuler's tokenizer is single-threaded. Ours is timed
after a warm-up, so numba's one-time compilation (cached on disk afterwards) is reported apart. Sides are
timed in alternating rounds, so a change in machine load hits both alike; the best round of each counts.
Also checks that `tokenizers`, loading our tokenizer.json, gives our ids on the first megabyte.
"""
import argparse
import os
import platform
import subprocess
import tempfile
import time

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from nanoeuler.tokenizer.bpe import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_name():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def hf_train(path, vocab_size):
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([path], trainer)
    return tok


def timed(fn, *args):
    t = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - t, result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", default=os.path.join(ROOT, "shakespeare.txt"))
    ap.add_argument("--repeat", type=int, default=2, help="use the file this many times over (default 2)")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    with open(args.file, "rb") as f:
        data = f.read() * args.repeat
    text = data.decode("utf-8", "replace")  # `tokenizers` takes str; ours gets the very same text
    data = text.encode()
    mb = len(data) / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "corpus.txt")
        with open(path, "wb") as f:
            f.write(data)
        small = os.path.join(tmp, "small.txt")
        with open(small, "wb") as f:
            f.write(data[:100_000])
        print(f"machine: {cpu_name()}, {os.cpu_count()} cores; tokenizers {tokenizers.__version__}")
        print(f"text: {os.path.basename(args.file)} x{args.repeat} = {mb:.1f} MB, vocab {args.vocab_size}")

        t = time.perf_counter()
        Tokenizer.train(small, 300, progress=False).encode(text[:100_000])
        print(f"nanoeuler warm-up (numba compilation or loading its cache): {time.perf_counter() - t:.1f}s")

        times = {k: [] for k in ("ours train", "hf train", "ours encode", "hf encode", "hf batch", "ours file")}
        lines = text.splitlines(keepends=True)
        for _ in range(args.rounds):
            t, ours = timed(Tokenizer.train, path, args.vocab_size, False)
            times["ours train"].append(t)
            t, hf = timed(hf_train, path, args.vocab_size)
            times["hf train"].append(t)
            t, ids = timed(ours.encode, data)
            times["ours encode"].append(t)
            t, hf_ids = timed(lambda tok: tok.encode(text).ids, hf)
            times["hf encode"].append(t)
            times["hf batch"].append(timed(hf.encode_batch, lines)[0])
            times["ours file"].append(timed(ours.encode_file, path, os.path.join(tmp, "c.tok"), False)[0])

        tok_json = os.path.join(tmp, "tokenizer.json")
        ours.save_hf(tok_json)
        head = text[:1_000_000]
        same = tokenizers.Tokenizer.from_file(tok_json).encode(head).ids == ours.encode(head)

    tr_o, tr_h, en_o, en_h, en_b, t_file = (min(times[k]) for k in times)
    w = 36
    print(f"{'':{w}s}{'nanoeuler':>11s}{'tokenizers':>11s}{'ours/theirs':>13s}")
    print(f"{'train time, s':{w}s}{tr_o:11.2f}{tr_h:11.2f}{tr_o / tr_h:12.2f}x  (target: at most 3x)")
    print(f"{'encode, MB/s (theirs: one call)':{w}s}{mb / en_o:11.2f}{mb / en_h:11.2f}{en_h / en_o:12.2f}x")
    print(f"{'encode, MB/s (theirs: batch of lines)':{w}s}{mb / en_o:11.2f}{mb / en_b:11.2f}{en_b / en_o:12.2f}x"
          "  (target: at least 0.5x)")
    print(f"{'encode_file to uint16 tokens, MB/s':{w}s}{mb / t_file:11.2f}")
    print(f"{'bytes per token':{w}s}{len(data) / len(ids):11.2f}{len(data) / len(hf_ids):11.2f}")
    print(f"tokenizers loading our tokenizer.json gives our ids on the first MB: {same}")


if __name__ == "__main__":
    main()
