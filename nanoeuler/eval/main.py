"""`nanoeuler eval`: a checkpoint's scores on HellaSwag, on the user's multiple-choice items, or its bits per
byte on a text file.

    nanoeuler eval --task hellaswag                       # data/hellaswag_val.jsonl (python -m nanoeuler.data.hellaswag)
    nanoeuler eval --task mc --data items.jsonl --json scores.json --predictions preds.jsonl
    nanoeuler eval --task bpb --data shakespeare.txt --ckpt big.bin

Multiple choice is scored completion-style, as llm.c and lm-evaluation-harness do (tasks.py, scoring.py): a
short table on stdout (acc and acc_norm with a 95% interval, time, items/s), --json for the numbers,
--predictions for one JSON line per item. bpb is training's final evaluation (consecutive windows, each
token after the first scored once: model/losses.bits_per_byte) over the whole file.
"""
import json
import os
import sys
import time

from nanoeuler.errors import UserError
from nanoeuler.files import atomic_write, check_writable
from nanoeuler.io import checkpoint
from nanoeuler.eval.tasks import HELLASWAG_DEFAULT, read_task_items
from nanoeuler.parallel.world import printer

BATCH_SIZE = {"cpu": 32, "gpu": 128}  # rows per forward when --batch-size is not given


def _load_engine(args, world):
    """(engine, tokenizer, checkpoint, device, communicator); the communicator first, which picks this rank's
    GPU."""
    from nanoeuler.model.device import resolve
    from nanoeuler.model.engine import make_engine
    from nanoeuler.parallel.comm import make_communicator
    ck = checkpoint.load_with_adapter(args.ckpt, getattr(args, "adapter", None))
    device = resolve(args.device, ck.cfg if world.world_size == 1 else None)
    comm = make_communicator(world, device)
    eng = make_engine(ck.cfg, device=device, precision=args.precision, training=False)
    eng.load_params(ck.params, ck.quantized)
    return eng, ck.tokenizer(), ck, device, comm


def _world(args):
    """This process's World (parallel/world.py); --gpus (x --nnodes), when given, must agree with it."""
    from nanoeuler.parallel.world import world_of
    return world_of(getattr(args, "gpus", None), getattr(args, "nnodes", None))


def _table(rows):
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _write_json(path, obj):
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=2) + "\n"), mode="w")


def run_choices(args, eng, tok, ck, device, comm):
    from nanoeuler.eval.tasks import score_choices
    items = read_task_items(args.task, args.data)
    if args.limit:
        items = items[:args.limit]
    if args.chat and not ck.chat:
        raise UserError(f"--chat: {args.ckpt} is not a chat checkpoint (nanoeuler sft writes one)")
    t0 = time.perf_counter()
    result = score_choices(eng, tok, items, args.batch_size or BATCH_SIZE[device], chat=args.chat, comm=comm,
                           progress=comm.rank == 0)
    seconds = time.perf_counter() - t0
    say = printer(comm.rank)
    if result["truncated"]:
        say(f"note: {result['truncated']} of {sum(len(i['choices']) for i in items)} context + choice sequences "
              f"are longer than the model's context of {eng.cfg.context} tokens; their contexts keep their last "
              "tokens", file=sys.stderr)
    n = result["n"]
    say(_table([("task", "items", "acc", "acc_norm", "time", "items/s"),
                  (args.task, f"{n}", f"{result['acc']:.4f} ± {result['acc_interval']:.4f}",
                   f"{result['acc_norm']:.4f} ± {result['acc_norm_interval']:.4f}", f"{seconds:.1f} s",
                   f"{n / seconds:,.1f}")]))
    summary = {"task": args.task, "n": n, "acc": result["acc"], "acc_norm": result["acc_norm"],
               "acc_interval95": result["acc_interval"], "acc_norm_interval95": result["acc_norm_interval"],
               "seconds": round(seconds, 3), "items_per_s": round(n / seconds, 2), "truncated": result["truncated"]}
    if args.predictions and comm.rank == 0:
        atomic_write(args.predictions, lambda f: f.writelines(json.dumps(p) + "\n" for p in result["predictions"]),
                     mode="w")
    return summary


def run_bpb(args, eng, tok, ck, device, comm):
    from nanoeuler.data.corpus import eval_batches, open_corpus
    from nanoeuler.model.losses import bits_per_byte
    if args.data is None:
        raise UserError("--task bpb needs --data FILE (any text file)")
    for rank in (0, 1):  # rank 0 writes the token cache, then the others read it
        if (comm.rank == 0) == (rank == 0):
            corpus = open_corpus(args.data, tok)
        if comm.world_size > 1 and rank == 0:
            comm.barrier()
    cfg = eng.cfg
    t0 = time.perf_counter()
    batches = eval_batches(corpus.tokens, corpus.byte_len, args.batch_size or BATCH_SIZE[device] // 4, cfg.context,
                           cfg.mtp_heads)
    if args.limit:
        batches = batches[:args.limit]
    loss, bpb = bits_per_byte(eng, batches, comm)
    seconds = time.perf_counter() - t0
    tokens = sum(int((targets[0] >= 0).sum()) for _, targets, _ in batches)
    if comm.rank == 0:
        print(_table([("task", "file", "tokens", "loss", "bits/byte", "time", "tokens/s"),
                      ("bpb", args.data, f"{tokens:,}", f"{loss:.4f}", f"{bpb:.4f}", f"{seconds:.1f} s",
                       f"{tokens / seconds:,.0f}")]))
    return {"task": "bpb", "n": tokens, "loss": loss, "bpb": bpb, "bytes": sum(b for _, _, b in batches),
            "seconds": round(seconds, 3)}


def main(args):
    for path in (args.json, args.predictions):
        if path:
            check_writable(path)
    if args.predictions and args.task == "bpb":
        raise UserError("--predictions is for the multiple-choice tasks (hellaswag, mc)")
    world = _world(args)
    eng, tok, ck, device, comm = _load_engine(args, world)
    summary = (run_bpb if args.task == "bpb" else run_choices)(args, eng, tok, ck, device, comm)
    if not world.is_main:  # the other ranks scored their share of the batches; rank 0 prints and writes
        return 0
    data = HELLASWAG_DEFAULT if args.task == "hellaswag" and args.data is None else args.data
    summary.update(ckpt=os.path.abspath(args.ckpt), step=ck.step, data=data, device=device, precision=eng.precision)
    if args.json:
        _write_json(args.json, summary)
    return 0
