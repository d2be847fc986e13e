"""Does a base pretrained on documents closed by `</s>` learn where a text ends? Two runs of `train` on the same
paragraphs, closed by the end-of-text token as the fetcher closes a document or a blank line apart without it (as
the fetched corpora were before), then the probability each model gives `</s>` where a held-out document ends.

    python benchmarks/end_token.py                           # small, 300 steps, on shakespeare.txt's paragraphs
    python benchmarks/end_token.py --size base --steps 1000 --device gpu
    python benchmarks/end_token.py --quick                   # 60 steps: the whole path, quickly

The documents are the paragraphs of --data (blocks of lines between blank lines: in shakespeare.txt a speech with
its speaker, a stage direction, a title), each written as nanoeuler/data/fetch.py's document() writes a book or a
web page: its text, `</s>` right after its last character, a blank line (WORK/docs.txt); WORK/plain.txt holds the
same paragraphs a blank line apart. `train SIZE` learns a tokenizer on each file and trains on it, as the
pipeline's `train base` does on data/pretrain.txt. Both models then read the documents that start in the last 9%
of docs.txt (held out of both runs, whose validation splits are their files' last tenths) with `</s>` read as
the end token: at each document's end, the probability of `</s>` (mean, median) and how often it is the most
likely token; at every other position, the same (how often a model would end a text too soon).
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nanoeuler.data.corpus import encode_text  # noqa: E402
from nanoeuler.data.fetch import document  # noqa: E402
from repo_env import log, nanoeuler, repo_env  # noqa: E402


def corpora(text, work):
    """WORK/docs.txt (the paragraphs as the fetcher closes documents) and WORK/plain.txt (a blank line apart)."""
    paragraphs = [p for p in text.split(b"\n\n") if p.strip()]
    docs, plain = work / "docs.txt", work / "plain.txt"
    docs.write_bytes(b"".join(document(p) for p in paragraphs))
    plain.write_bytes(b"\n\n".join(p.rstrip() for p in paragraphs) + b"\n\n")
    return docs, plain, len(paragraphs)


def held_out_documents(docs, fraction=0.91):
    """The documents of docs.txt that start after `fraction` of its bytes."""
    data = docs.read_bytes()
    cut = data.index(b"</s>\n\n", int(fraction * len(data))) + len(b"</s>\n\n")
    return data[cut:]


def end_token_probabilities(eng, tokens, eos_id, context, batch=64):
    """Head 0's probability of eos_id at every position of tokens read as consecutive windows of `context`:
    (at the positions whose next token is eos_id, at the others, whether it is the likeliest token at each
    end, and at each other position)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    n = (len(tokens) - 1) // context
    inputs = tokens[:n * context].reshape(n, context).astype(np.int32)
    ends = tokens[1:n * context + 1].reshape(n, context) == eos_id
    prob, top = [], []
    for start in range(0, n, batch):
        logits = eng.logits(inputs[start:start + batch]).astype(np.float64)  # (B, T, V)
        logits -= logits.max(-1, keepdims=True)
        p = np.exp(logits[..., eos_id]) / np.exp(logits).sum(-1)
        prob.append(p)
        top.append(logits.argmax(-1) == eos_id)
    prob, top = np.concatenate(prob), np.concatenate(top)
    return prob[ends], prob[~ends], top[ends], top[~ends]


def measure(ckpt, text):
    """The figures of one model on the held-out documents (text, bytes)."""
    from nanoeuler.io import checkpoint
    from nanoeuler.model.engine import make_engine
    from nanoeuler.tokenizer.bpe import Tokenizer
    ck = checkpoint.load(ckpt)
    tok = Tokenizer.from_json(ck.tokenizer_json)
    eng = make_engine(ck.cfg, device="cpu", precision="fp32", training=False)
    eng.load_params(ck.params)
    at_ends, elsewhere, top_ends, top_elsewhere = end_token_probabilities(
        eng, encode_text(tok, text), tok.special_tokens[tok.document_end()], ck.cfg.context)
    return dict(ends=int(len(at_ends)), mean=float(at_ends.mean()), median=float(np.median(at_ends)),
                top=float(top_ends.mean()), other_mean=float(elsewhere.mean()), other_top=float(top_elsewhere.mean()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(REPO / "shakespeare.txt"), help="the text whose paragraphs are the "
                        "documents (default shakespeare.txt)")
    parser.add_argument("--size", default="small", help="the preset trained (default small)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="60 steps")
    parser.add_argument("--work", type=Path, default=Path("/tmp/end_token"), help="folder for the corpora, "
                        "checkpoints and results (default /tmp/end_token)")
    opts = parser.parse_args()
    steps = 60 if opts.quick else opts.steps
    opts.work.mkdir(parents=True, exist_ok=True)
    env = repo_env()
    docs, plain, n_docs = corpora(Path(opts.data).read_bytes(), opts.work)
    log(f"{n_docs:,} documents: {docs} ({docs.stat().st_size:,} bytes), {plain} ({plain.stat().st_size:,} bytes)")
    held_out = held_out_documents(docs)
    results = {}
    for name, data in (("closed by </s>", docs), ("a blank line apart", plain)):
        out = opts.work / f"{data.stem}.bin"
        nanoeuler(["train", opts.size, "--data", str(data), "--out", str(out), "--device", opts.device, "--steps",
                   str(steps), "--overwrite"], env)
        results[name] = measure(out, held_out)
    (opts.work / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"\n{opts.size}, {steps} steps on {n_docs:,} paragraphs of {Path(opts.data).name} as documents; "
          f"held out: {len(held_out):,} bytes")
    print("| documents in training | ends | p(</s>) at an end: mean | median | </s> likeliest at an end | "
          "p(</s>) elsewhere: mean | </s> likeliest elsewhere |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['ends']:,} | {r['mean']:.3g} | {r['median']:.3g} | {r['top']:.1%} | "
              f"{r['other_mean']:.3g} | {r['other_top']:.2%} |")


if __name__ == "__main__":
    main()
