"""Does LoRA learn what full fine-tuning learns? A pretrained checkpoint fine-tuned three ways at the same steps
and batch on the same instruction data: `sft` (every weight), `sft --lora R` (adapters on all seven products,
the command's defaults) and QLoRA (`sft --lora R` on the checkpoint quantized to int4). Their validation loss
curves (read from the runs' metrics logs) in one plot, the final validation losses and their ratios, the held-out
replies' loss split into the end token `</s>` and the other tokens (a base pretrained on plain text has never
seen the end token: full SFT retrains its head row, the adapters cannot touch it), and the greedy `chat`
answers of the three to the same prompts side by side.

    python benchmarks/lora_learns.py --base trained.bin          # e.g. quant_accuracy.py's float.bin
    python benchmarks/lora_learns.py                             # trains `small` on shakespeare.txt first
    python benchmarks/lora_learns.py --plain-base                # ... without the end token in its text
    python benchmarks/lora_learns.py --base float.bin --end-token-steps 250   # float.bin learns the end token first
    python benchmarks/lora_learns.py --size base --base-steps 1000 --device gpu --steps 300 --batch-size 32
    python benchmarks/lora_learns.py --quick                     # 40 steps a run: the whole path, quickly
    python benchmarks/lora_learns.py --base base.bin --device gpu --steps 600 --batch-size 32

The base it trains (without --base) learns shakespeare.txt with the end token `</s>` closing each paragraph, as
a published base learns its end token from documents that close with it; on the plain text (--plain-base) the
base never sees the end token that fine-tuning asks for after every reply, and the adapters, which leave the
head frozen, lag full SFT on that token alone.

The instruction data (written to WORK/instructions.json): --data, an Alpaca JSON file, when given (the
pipeline's data/alpaca.json); otherwise examples cut from the first nine tenths of shakespeare.txt (the text a
`train` run on it learned from; nanoeuler/data/text_tasks.py: continue a speaker's line, answer a line as a
speaker, name a line's speaker, each answered by the text) with the 40 greetings of
tests/data/sft_greetings.json, whose prompts the pipeline's example asks (docs/pipeline.md). The prompts
answered side by side: the pipeline's three and one of each kind cut from the held-out last tenth.
Each run's learning rate is its command's default (full: 1e-4, LoRA: 10x) unless --lr-full / --lr-lora. A
run finished already in --work is reused (the plot and the answers made again); other settings want another
--work. A run that fails is left out of the plot and the tables, and the script then exits with status 1.
"""
import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nanoeuler.data.text_tasks import play_instructions  # noqa: E402
from repo_env import log, nanoeuler, repo_env  # noqa: E402

PIPELINE_PROMPTS = ["Greet Juliet.", "Greet the king.", "Write a poem."]  # docs/pipeline.md's chat
RUNS = ["full", "lora", "qlora"]
LABELS = {"full": "full SFT", "lora": "LoRA r {r}", "qlora": "QLoRA r {r} (int4 base)",
          "lora_lr": "LoRA r {r}, lr {lr:g}"}


def nine_tenths(path):
    """(the first nine tenths of a text, cut at a line; the rest)."""
    text = Path(path).read_text(encoding="utf-8")
    cut = text.index("\n", int(0.9 * len(text))) + 1
    return text[:cut], text[cut:]


def instruction_data(opts):
    """(the examples' file, the side-by-side prompts with the text's answers where there is one)."""
    out = opts.work / "instructions.json"
    prompts = [(p, "") for p in PIPELINE_PROMPTS]
    if opts.data:
        examples = json.loads(Path(opts.data).read_text(encoding="utf-8"))
    else:
        seen, held = nine_tenths(REPO / "shakespeare.txt")
        examples = play_instructions(seen, seed=0)[:opts.examples]
        greetings = json.loads((REPO / "tests" / "data" / "sft_greetings.json").read_text(encoding="utf-8"))
        examples = examples + greetings
        kinds = {}
        for example in play_instructions(held, seed=1):
            kinds.setdefault(example["instruction"].split()[0], example)
        prompts += [(e["instruction"], e["output"]) for _, e in sorted(kinds.items())]
    out.write_text(json.dumps(examples, indent=1) + "\n", encoding="utf-8")
    log(f"instruction data: {len(examples):,} examples -> {out}")
    return out, prompts


def with_end_tokens(text, end="</s>"):
    """The text with the end-of-text token closing each paragraph (a block of lines before a blank line: a
    speech with its speaker, a stage direction, a title), as a pretraining corpus closes each document."""
    return re.sub(r"(\S)\n\n", lambda m: m.group(1) + end + "\n\n", text)


def base_checkpoint(opts, env):
    """--base, or `train SIZE` on shakespeare.txt: on its paragraphs closed by the end token (the tokenizer
    learned on the plain text first, so the marks take no merges), or with --plain-base on the text as it is,
    where the base never sees the end token that fine-tuning then asks it to write after every reply."""
    from nanoeuler.io import checkpoint
    if opts.base and opts.end_token_steps:  # continued pretraining: the base learns the end token
        out = opts.work / "base_ends.bin"
        if not finished(out, opts.end_token_steps):
            data = opts.work / "shakespeare_ends.txt"
            data.write_text(with_end_tokens((REPO / "shakespeare.txt").read_text(encoding="utf-8")), encoding="utf-8")
            # small's schedule (100 steps of warmup, the decay over the last 40%) for any model: a short run
            nanoeuler(["train", "small", "--ckpt", opts.base, "--data", str(data), "--out", str(out), "--device", opts.device,
                       "--steps", str(opts.end_token_steps), "--batch-size", "16", "--lr", "1e-3", "--overwrite"],
                      env)
        return str(out)
    if opts.base:
        return opts.base
    from nanoeuler.model.config import PRESETS
    from nanoeuler.train.pretrain import PRESET_HYPER
    out = opts.work / ("base_plain.bin" if opts.plain_base else "base.bin")
    steps = opts.base_steps or (150 if opts.quick else PRESET_HYPER[opts.size].steps)
    if out.exists() and int(checkpoint.read_metadata(out)["step"]) >= steps:
        return str(out)
    data, tokenizer = "shakespeare.txt", []
    if not opts.plain_base:
        data, tokenizer = opts.work / "shakespeare_ends.txt", opts.work / "tokenizer.json"
        data.write_text(with_end_tokens((REPO / "shakespeare.txt").read_text(encoding="utf-8")), encoding="utf-8")
        if not tokenizer.exists():
            nanoeuler(["tokenizer", "train", "shakespeare.txt", "--vocab-size", str(PRESETS[opts.size].vocab_size),
                       "--out", str(tokenizer)], env)
        tokenizer = [] if out.exists() else ["--tokenizer", str(tokenizer)]  # a resumed run has its own
    nanoeuler(["train", opts.size, "--data", str(data), "--out", str(out), "--device", opts.device,
               "--steps", str(steps)] + tokenizer + (["--resume"] if out.exists() else []), env)
    return str(out)


def finished(ckpt, steps):
    """Whether ckpt is a run finished at `steps`, its metrics log beside it."""
    from nanoeuler.io import checkpoint
    return (ckpt.exists() and ckpt.with_suffix(".jsonl").exists()
            and int(checkpoint.read_metadata(ckpt)["step"]) == steps)


def chat_answers(ckpt, prompts, opts, env):
    """Greedy answers of a chat checkpoint, each prompt alone (/reset between them)."""
    stdin = "".join(f"{p}\n/reset\n" for p, _ in prompts)
    out = nanoeuler(["chat", "--ckpt", ckpt, "--device", opts.device, "--temperature", "0", "--max-new-tokens",
                     str(opts.max_new_tokens)], env, stdin=stdin)
    replies = [part.strip() for part in out.split("> ")[1:] if part.strip() not in ("(cleared)", "")]
    return replies[:len(prompts)]


def end_token_losses(ckpt, data, device):
    """The held-out replies' loss of a chat checkpoint split by token: (mean on the end token, mean on the
    others, the end token's share of the sum). A base pretrained without the end token (a text corpus has
    none) starts it far above the other tokens, and only a run that moves the head can bring it down fast."""
    from nanoeuler.data.instructions import prepare, read_data, split
    from nanoeuler.io.checkpoint import load_model
    eng, tok, ck = load_model(ckpt, device)
    examples = read_data(data)
    train_idx, val_idx = split(len(examples), None)  # sft's held-out split (its default --val-examples)
    _, val, _ = prepare(examples, train_idx[:1], val_idx, tok, ck.cfg.context, ck.cfg.mtp_heads, "truncate",
                        progress=False)
    end, other = [], []
    for first in range(0, len(val), 16):  # 16 examples a forward pass, padded at the end (causal: unread)
        chunk = val[first:first + 16]
        T = min(ck.cfg.context, max(len(ids) - 1 for ids, _ in chunk))
        inputs = np.zeros((len(chunk), T), dtype=np.int32)
        for b, (ids, _) in enumerate(chunk):
            n = min(T, len(ids) - 1)
            inputs[b, :n] = ids[:n]
        logits = eng.logits(inputs)  # (B, T, V)
        for b, (ids, n_prompt) in enumerate(chunk):
            n = min(T, len(ids) - 1)  # positions scored: the targets ids[1:n + 1]
            lg = logits[b, :n].astype(np.float64)
            lg -= lg.max(axis=1, keepdims=True)
            nll = np.log(np.exp(lg).sum(axis=1)) - lg[np.arange(n), ids[1:n + 1]]
            for token, loss in zip(ids[n_prompt:n + 1], nll[n_prompt - 1:]):  # the reply's tokens
                (end if token == tok.eos_id else other).append(loss)
    total = sum(end) + sum(other)
    return float(np.mean(end)) if end else float("nan"), float(np.mean(other)), float(sum(end) / total)


def plot(curves, labels, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run, curve in curves.items():
        ax.plot(*zip(*curve), "o-", markersize=3, label=labels[run])
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/token, the replies' tokens)")
    ax.set_title(textwrap.fill(title, 80), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="pretrained float checkpoint (default: train small on shakespeare.txt)")
    ap.add_argument("--size", default="small", choices=["small", "big", "base", "large"],
                    help="without --base: the preset trained on shakespeare.txt first (default small)")
    ap.add_argument("--base-steps", type=int, help="without --base: its training steps (default the preset's)")
    ap.add_argument("--end-token-steps", type=int, metavar="N",
                    help="with --base: first continue its pretraining N steps (16 windows, lr 1e-3) on shakespeare.txt "
                         "with the end token closing its paragraphs, for a base trained on the plain text")
    ap.add_argument("--plain-base", action="store_true",
                    help="without --base: train on shakespeare.txt as it is, no end token closing its paragraphs")
    ap.add_argument("--data", help="Alpaca JSON instead of the shakespeare-derived examples")
    ap.add_argument("--examples", type=int, default=6000, help="shakespeare-derived examples (default 6000)")
    ap.add_argument("--steps", type=int, help="steps of each run (default 400; --quick 40)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--eval-every", type=int, help="steps between validation losses (default steps / 10)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    ap.add_argument("--lr-full", type=float, help="full SFT's learning rate (default sft's)")
    ap.add_argument("--lr-lora", type=float, help="the adapters' learning rate (default sft --lora's)")
    ap.add_argument("--lr-lora-also", type=float, help="one more LoRA run at this learning rate")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--threads", type=int, default=2, help="threads of the commands (numba and BLAS; default 2)")
    ap.add_argument("--work", type=Path, help="folder for checkpoints and logs (default /tmp/lora_learns)")
    ap.add_argument("--plot", type=Path, default=REPO / "docs" / "lora_learns.png")
    ap.add_argument("--quick", action="store_true", help="40 steps a run, 400 examples, the plot in --work")
    ap.add_argument("--plot-from", type=Path, metavar="SUMMARY",
                    help="only draw --plot from a run's summary.json (a machine without matplotlib wrote it)")
    opts = ap.parse_args()
    if opts.plot_from:
        summary = json.loads(opts.plot_from.read_text())
        plot({run: [tuple(point) for point in curve] for run, curve in summary["curves"].items()},
             summary["labels"], opts.plot, summary["title"])
        log(f"plot -> {opts.plot}")
        return
    steps = opts.steps or (40 if opts.quick else 400)
    eval_every = opts.eval_every or max(1, steps // 10)
    if opts.quick:
        opts.examples = min(opts.examples, 400)
        opts.plot = opts.work / "lora_learns.png" if opts.work else Path("/tmp/lora_learns_quick/lora_learns.png")
    opts.work = opts.work or Path("/tmp/lora_learns" + ("_quick" if opts.quick else ""))
    opts.work.mkdir(parents=True, exist_ok=True)
    # BLAS's own threads too: numpy's products (the LoRA adapters, the quantized products of many rows) with
    # OpenBLAS's default threads on a loaded machine run several times slower
    threads = {name: str(opts.threads) for name in ("NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    env = repo_env(**threads, PYTHONUNBUFFERED="1")

    base = base_checkpoint(opts, env)
    data, prompts = instruction_data(opts)
    int4 = opts.work / "base_int4.bin"
    if not int4.exists():
        nanoeuler(["quantize", "--ckpt", base, "--out", str(int4), "--type", "int4"], env)
    common = ["--data", str(data), "--steps", str(steps), "--batch-size", str(opts.batch_size), "--eval-every",
              str(eval_every), "--sample-every", str(10 * steps), "--ckpt-every", str(steps), "--device",
              opts.device, "--overwrite"]
    runs = RUNS + (["lora_lr"] if opts.lr_lora_also else [])
    lora = ["--lora", str(opts.rank)]
    lora_lr = [] if opts.lr_lora is None else ["--lr", str(opts.lr_lora)]
    setups = {"full": (base, [] if opts.lr_full is None else ["--lr", str(opts.lr_full)]),
              "lora": (base, lora + lora_lr), "qlora": (str(int4), lora + lora_lr),
              "lora_lr": (base, lora + ["--lr", str(opts.lr_lora_also)])}
    curves, seconds, paths = {}, {}, {}
    for run in runs:  # a run that fails (e.g. a path not yet run on this device) is left out of the rest
        ckpt, extra = setups[run]
        out = opts.work / (f"lora_lr{opts.lr_lora_also:g}.bin" if run == "lora_lr" else f"{run}.bin")
        if finished(out, steps):  # a finished run of --work is reused (another setting: another --work)
            log(f"{out}: done already ({steps} steps)")
        elif nanoeuler(["sft", "--ckpt", ckpt, "--out", str(out), *common, *extra], env, check=False) is None:
            continue
        paths[run] = out
        records = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines() if line]
        seconds[run] = records[-1]["time_s"]
        curves[run] = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    done = list(curves)  # the runs that finished
    labels = {run: LABELS[run].format(r=opts.rank, lr=opts.lr_lora_also) for run in runs}
    from nanoeuler.io import checkpoint
    from nanoeuler.model.config import param_shapes
    params = sum(int(np.prod(shape)) for _, shape in param_shapes(checkpoint.read_config(base)))
    pretrained = (f"{checkpoint.read_metadata(opts.base)['step']} + {opts.end_token_steps} (the end token)"
                  if opts.base and opts.end_token_steps else checkpoint.read_metadata(base)["step"])
    cfg_line = (f"a {params / 1e6:.2f}M-parameter model pretrained {pretrained} steps, "
                f"{steps} steps of {opts.batch_size} examples ({opts.device})")
    try:
        import matplotlib  # noqa: F401
        opts.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(curves, labels, opts.plot, f"sft of {cfg_line}")
        log(f"plot -> {opts.plot}")
    except ImportError:
        log(f"no matplotlib: no plot (--plot-from {opts.work / 'summary.json'} draws it elsewhere)")

    split_losses = {run: end_token_losses(str(paths[run]), str(data), opts.device) for run in done}
    answers = {run: chat_answers(str(paths[run]), prompts, opts, env) for run in done}
    lines = ["| prompt | the text's answer | " + " | ".join(labels[r] for r in done) + " |",
             "|---|---|" + "---|" * len(done)]
    cell = lambda s: s.replace("|", "\\|").replace("\n", " / ")  # noqa: E731
    for i, (prompt, expected) in enumerate(prompts):
        lines.append(f"| {cell(prompt)} | {cell(expected)} | "
                     + " | ".join(cell(answers[r][i]) if i < len(answers[r]) else "" for r in done) + " |")
    table = "\n".join(lines)
    (opts.work / "answers.md").write_text(table + "\n")
    summary = {"base": base, "steps": steps, "batch_size": opts.batch_size, "data": str(data), "rank": opts.rank,
               "curves": curves, "seconds": seconds, "answers": answers, "prompts": prompts,
               "labels": {run: labels[run] for run in done}, "title": f"sft of {cfg_line}",
               "end_token": {run: dict(zip(("end", "other", "end_share"), v)) for run, v in split_losses.items()}}
    (opts.work / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    print("\nanswers (greedy chat, --max-new-tokens %d):\n%s\n" % (opts.max_new_tokens, table))
    print(f"sft of {cfg_line}")
    final = {run: curves[run][-1][1] for run in done}
    rows = [("run", "final val loss", "/ full SFT's", "best val loss", "end token", "other tokens", "end share",
             "time")]
    for run in done:
        end, other, share = split_losses[run]
        rows.append((labels[run], f"{final[run]:.4f}", f"{final[run] / final['full']:.3f}" if "full" in final else "",
                     f"{min(v for _, v in curves[run]):.4f}", f"{end:.3f}", f"{other:.4f}", f"{share:.3f}",
                     f"{seconds[run]:.0f} s"))  # time: the run's log's
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if "full" in final and "lora" in final:
        ratio = final["lora"] / final["full"]
        print(f"LoRA within 5% of full SFT's final validation loss: {'yes' if ratio <= 1.05 else 'no'} ({ratio:.3f})")
        other = split_losses["lora"][1] / split_losses["full"][1]
        print(f"on the replies' other tokens (all but the end token): {other:.3f}")
    missing = [run for run in runs if run not in done]
    if missing:
        sys.exit(f"failed: {', '.join(missing)}")

if __name__ == "__main__":
    main()
