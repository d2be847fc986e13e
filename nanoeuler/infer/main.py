"""`nanoeuler infer "PROMPT"`: sample from a checkpoint, the text streamed as it comes (infer/generate.py
decodes).

    nanoeuler infer "To be, or not to be" --max-new-tokens 200 --temperature 0.8 --top-k 40 --seed 1
    nanoeuler infer "ROMEO:" --num-samples 4 --seed 7     # four samples, decoded as one batch
"""
import os
import sys
import time

import numpy as np

from nanoeuler.errors import UserError
from nanoeuler.infer.generate import TextStream, check_speculative, generate, start_ids, stats_line
from nanoeuler.io.checkpoint import load_model


def main(args):
    eng, tok, _ = load_model(args.ckpt, args.device, not args.no_batch_invariance,
                             adapter=getattr(args, "adapter", None))
    samples = getattr(args, "num_samples", 1)
    if args.speculative:
        check_speculative(eng)
        if samples > 1:
            raise UserError("--speculative decodes one sample; leave out --num-samples")
    ids = start_ids(tok, os.fsencode(args.prompt))  # the bytes as typed, even ones that are not UTF-8
    if len(ids) > eng.cfg.context - 1:
        print(f"note: the prompt is {len(ids)} tokens; the model sees its last {eng.cfg.context - 1}",
              file=sys.stderr)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")  # a terminal that cannot show a character gets '?'
    rng = np.random.default_rng(args.seed)  # speculative sampling's draws
    stats, t0 = {}, time.perf_counter()
    settings = (args.max_new_tokens, args.temperature, args.top_k, args.top_p, rng)
    # sample i draws with seed --seed + i, as choice i of a server request with that seed
    seeds = None if args.seed is None else [args.seed + i for i in range(samples)]
    if samples > 1:  # one batch
        outs = generate(eng, [ids] * samples, *settings, stop_ids=tok.end_ids, seed=seeds)
        n = sum(len(out) for out in outs)
        for i, out in enumerate(outs, 1):
            stream = TextStream(tok)
            stream.out.write(f"{'' if i == 1 else chr(10)}--- sample {i} of {samples} ---\n{args.prompt}")
            stream.write([t for t in out if t not in tok.end_ids])
            stream.close()
            stream.out.write("\n")
    else:
        stream = TextStream(tok)
        stream.out.write(args.prompt)
        n = 0
        for n, token in enumerate(generate(eng, ids, *settings, stop_ids=tok.end_ids, speculative=args.speculative,
                                           stats=stats, seed=seeds and seeds[0]), 1):
            if token not in tok.end_ids:
                stream.write([token])
        stream.close()
        stream.out.write("\n")
    if args.stats:
        print(stats_line(n, time.perf_counter() - t0, stats), file=sys.stderr)
    return 0
