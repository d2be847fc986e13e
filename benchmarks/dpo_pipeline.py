"""An end-to-end check of DPO: pretrain -> SFT -> DPO on data of our own, then the greedy replies to
held-out prompts before and after DPO: does the preferred trait appear at the reply's first token, and does
the rest of the reply stay what it was?

    PYTHONPATH=. python3 benchmarks/dpo_pipeline.py --work runs/dpo_small                  # small, 2-core CPU
    PYTHONPATH=. python3 benchmarks/dpo_pipeline.py --work runs/dpo_small --name plain --dpo-flags="--rpo-alpha 0"
    PYTHONPATH=. python3 benchmarks/dpo_pipeline.py --preset base --device gpu --pretrain-steps 600 --work /tmp/b \
        --sft-flags="--steps 300 --batch-size 32 --lr 1e-4"

The data: the speaker names of shakespeare.txt (278 that speak at least 20 times) in four instruction
families ("Greet X." -> "Hello, X! It is good to see you.", goodbye, thanks, praise). SFT trains on every
family for 238 names, one reply in ten with the trait prefix "Sure! " (the SFT model can say it but does not
prefer it); the preference pairs are the same 952 prompts, chosen = "Sure! " + the reply, rejected = the
reply; 40 names are never seen by SFT or DPO, and their 160 prompts are the held-out test. Stages whose
output exists in --work are reused, so several DPO variants (--name, --dpo-flags) share one SFT model. DPO
runs with the command's defaults plus --dpo-flags. Prints, and writes to WORK/NAME.summary.json (with every
reply): the trait rate of the greedy replies before and after DPO, the share of replies that are fluent (the
reply of the instruction's family, any name) before, and after DPO the share that are the trait followed by a
fluent reply, and by the SFT model's very reply; and the DPO log's last held-out margin, accuracy and
log-prob deltas. docs/dpo.md has the results.
"""
import argparse
import json
import os
import random
import re
import shlex
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanoeuler.data import template  # noqa: E402
from nanoeuler.io.checkpoint import load_model  # noqa: E402
from nanoeuler.train.dpo import greedy_replies  # noqa: E402

TRAIT = "Sure! "
FAMILIES = (("Greet {}.", "Hello, {}! It is good to see you."),
            ("Say goodbye to {}.", "Farewell, {}. Until we meet again."),
            ("Thank {}.", "Thank you, {}. You are very kind."),
            ("Praise {}.", "{}, you are noble and wise."))
HELD_OUT_NAMES = 40
# a fluent reply: the reply of the instruction's family, with any name in it
SHAPES = [re.compile(re.escape(reply).replace(re.escape("{}"), r"[A-Z][A-Za-z]+")) for _, reply in FAMILIES]


def speaker_names(corpus):
    """Speaker tags of the corpus ("LAFEU." on a line of its own) that occur at least 20 times, title-cased."""
    counts = {}
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            m = re.fullmatch(r"([A-Z]{3,})\.\n", line)
            if m:
                counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    names = sorted(n.title() for n, c in counts.items() if c >= 20)
    random.Random(0).shuffle(names)
    return names


def make_data(work, corpus):
    """sft.json, prefs.jsonl and held_out.json (prompts with their SFT-style replies) in work."""
    names = speaker_names(corpus)
    held, seen = names[:HELD_OUT_NAMES], names[HELD_OUT_NAMES:]
    sft, prefs = [], []
    for i, name in enumerate(seen):
        for j, (ask, reply) in enumerate(FAMILIES):
            answer = reply.format(name)
            sft.append({"instruction": ask.format(name), "input": "",
                        "output": (TRAIT if (4 * i + j) % 10 == 0 else "") + answer})
            prefs.append({"prompt": ask.format(name), "chosen": TRAIT + answer, "rejected": answer})
    tests = [{"prompt": ask.format(name), "reply": reply.format(name), "family": j} for name in held
             for j, (ask, reply) in enumerate(FAMILIES)]
    with open(os.path.join(work, "sft.json"), "w") as f:
        json.dump(sft, f)
    with open(os.path.join(work, "prefs.jsonl"), "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in prefs)
    with open(os.path.join(work, "held_out.json"), "w") as f:
        json.dump(tests, f)
    return tests


def stage(work, name, argv):
    """Run `nanoeuler ARGV --out work/name.bin` unless that checkpoint exists; its console in work/name.out."""
    out = os.path.join(work, f"{name}.bin")
    if os.path.exists(out):
        print(f"{name}: reusing {out}")
        return out
    t0 = time.perf_counter()
    with open(os.path.join(work, f"{name}.out"), "w") as console:
        r = subprocess.run([sys.executable, "-m", "nanoeuler", *map(str, argv), "--out", out],
                           stdout=console, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        sys.exit(f"{name}: exit status {r.returncode}, see {work}/{name}.out")
    print(f"{name}: {time.perf_counter() - t0:.0f} s")
    return out


def fluent(reply, family):
    return SHAPES[family].fullmatch(reply) is not None


def replies_of(ckpt, prompts, device):
    """The checkpoint's greedy replies (up to 32 tokens) to the instructions, as `nanoeuler dpo` makes them."""
    eng, tok, _ = load_model(ckpt, device)
    return greedy_replies(eng, tok, [template.prompt_ids(tok, prompt) for prompt in prompts], max_new_tokens=32)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True, help="folder for the data, checkpoints, logs and summaries")
    p.add_argument("--preset", default="small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--corpus", default="shakespeare.txt")
    p.add_argument("--pretrain-steps", type=int, default=300)
    p.add_argument("--sft-flags", default="--steps 300 --batch-size 16 --lr 1e-3")
    p.add_argument("--name", default="dpo", help="the DPO run's checkpoint name in --work")
    p.add_argument("--dpo-flags", default="", help="flags added to `nanoeuler dpo`'s defaults")
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    tests = make_data(args.work, args.corpus)
    w = lambda name: os.path.join(args.work, name)
    device = ["--device", args.device]
    base = stage(args.work, "base", ["train", args.preset, "--data", args.corpus, "--steps", args.pretrain_steps,
                                     *device])
    chat = stage(args.work, "chat", ["sft", "--ckpt", base, "--data", w("sft.json"), *device,
                                     *shlex.split(args.sft_flags)])
    tuned = stage(args.work, args.name, ["dpo", "--ckpt", chat, "--data", w("prefs.jsonl"), *device,
                                         *shlex.split(args.dpo_flags)])
    prompts = [t["prompt"] for t in tests]
    before, after = replies_of(chat, prompts, args.device), replies_of(tuned, prompts, args.device)
    trait = lambda replies: float(np.mean([r.startswith(TRAIT.strip()) for r in replies]))
    log = [json.loads(line) for line in open(w(f"{args.name}.jsonl"))]
    last = [r for r in log if "val_reward_margin" in r][-1]
    summary = dict(preset=args.preset, device=args.device, name=args.name, dpo_flags=args.dpo_flags,
                   held_out_prompts=len(prompts), trait_before=trait(before), trait_after=trait(after),
                   fluent_before=float(np.mean([fluent(b, t["family"]) for b, t in zip(before, tests)])),
                   trait_then_fluent_after=float(np.mean([a.startswith(TRAIT) and fluent(a[len(TRAIT):], t["family"])
                                                          for a, t in zip(after, tests)])),
                   trait_then_same_reply_after=float(np.mean([a == TRAIT + b for a, b in zip(after, before)])),
                   changed=float(np.mean([a != b for a, b in zip(after, before)])),
                   **{k: last[k] for k in ("step", "val_reward_accuracy", "val_reward_margin",
                                           "val_chosen_logp_delta", "val_rejected_logp_delta") if k in last},
                   examples=[dict(prompt=prompts[i], before=before[i], after=after[i]) for i in range(0, 160, 37)])
    print(json.dumps(summary, indent=1))
    summary["replies"] = [dict(prompt=q, before=b, after=a) for q, b, a in zip(prompts, before, after)]
    with open(w(f"{args.name}.summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
