"""How multiple-choice items are scored: the user's JSON lines (data/mc_items.py) and HellaSwag
(data/hellaswag.py), both read into mc items `{"context", "choices", "label", "where"}`.

    result = score_choices(eng, tok, items, batch_size=64)   # acc, acc_norm, predictions

Each choice follows the context after one space, as lm-evaluation-harness's default target_delimiter puts it
(benchmarks/lm_eval/nanoeuler_mc.yaml is the same task for lm-eval).

acc: the choice with the highest summed log-probability; acc_norm: the highest log-probability divided by
the choice's length in characters (Python's len of the choice without the delimiter: Unicode code points, not
bytes), lm-eval's acc_norm. Ties go to the first choice (numpy's argmax, as in lm-eval).
"""
import math
import os

import numpy as np

from nanoeuler.data.corpus import fetch_hint
from nanoeuler.data.template import prompt_ids
from nanoeuler.errors import UserError
from nanoeuler.eval.scoring import check_requests, choice_requests, loglikelihoods

HELLASWAG_DEFAULT = "data/hellaswag_val.jsonl"


def read_task_items(task, data=None):
    """The items of `hellaswag` (data or the default file) or `mc` (data, required)."""
    from nanoeuler.data.hellaswag import read_hellaswag
    from nanoeuler.data.mc_items import read_mc
    if task == "hellaswag":
        path = data or HELLASWAG_DEFAULT
        if not os.path.exists(path):
            raise UserError(f"{path} not found{fetch_hint(path) if data is None else ''}")
        return read_hellaswag(path)
    if data is None:
        raise UserError("--task mc needs --data FILE (JSON lines {\"context\", \"choices\", \"label\"})")
    return read_mc(data)


def parse_eval_task(spec):
    """`hellaswag` or `mc:FILE` (training's --eval-task) -> (task name, items), read now so that a bad file
    stops the run before it starts."""
    if spec == "hellaswag":
        return "hellaswag", read_task_items("hellaswag")
    if spec.startswith("mc:") and len(spec) > 3:
        return "mc", read_task_items("mc", spec[3:])
    raise UserError(f"--eval-task {spec!r}: expected hellaswag or mc:FILE")


def interval95(hits):
    """Half the width of the 95% interval of a mean of 0/1 outcomes: 1.96 x the standard error that lm-eval
    reports (sample standard deviation / sqrt(n))."""
    n = len(hits)
    return 1.96 * float(np.std(hits, ddof=1)) / math.sqrt(n) if n > 1 else float("nan")


def chat_requests(tok, items):
    """As scoring.choice_requests, through the chat template (the model's own, or ours: data/template.py): the
    context is the instruction, each choice the response, tokenized apart as chat and SFT do."""
    requests, first = [], []
    for item in items:
        first.append(len(requests))
        prompt = prompt_ids(tok, item["context"])
        requests.extend((prompt, tok.encode(choice, add_bos=False)) for choice in item["choices"])
    return requests, first


def score_choices(eng, tok, items, batch_size, chat=False, progress=True, comm=None):
    """Score the items: {"n", "acc", "acc_norm", "acc_interval", "acc_norm_interval", "truncated",
    "predictions"}, where predictions holds {"index", "pred", "pred_norm", "logprobs"} per item and truncated
    counts the sequences longer than the model's context (their contexts keep their last tokens). comm: the ranks
    of `eval --gpus N`, which share the batches (scoring.loglikelihoods)."""
    requests, first = (chat_requests if chat else choice_requests)(tok, items)
    check_requests(items, requests, first, eng.cfg.context)
    truncated = sum(len(c) + len(x) - 1 > eng.cfg.context for c, x in requests)
    logprobs = loglikelihoods(eng, requests, batch_size, progress=progress, comm=comm)
    predictions, hits, hits_norm = [], [], []
    for i, item in enumerate(items):
        lls = logprobs[first[i]:first[i] + len(item["choices"])]
        lengths = np.array([float(len(choice)) for choice in item["choices"]])
        pred, pred_norm = int(np.argmax(lls)), int(np.argmax(lls / lengths))
        predictions.append({"index": i, "pred": pred, "pred_norm": pred_norm, "logprobs": lls.tolist()})
        hits.append(pred == item["label"])
        hits_norm.append(pred_norm == item["label"])
    return {"n": len(items), "acc": float(np.mean(hits)), "acc_norm": float(np.mean(hits_norm)),
            "acc_interval": interval95(hits), "acc_norm_interval": interval95(hits_norm), "truncated": truncated,
            "predictions": predictions}


class TrainingEval:
    """Multiple-choice scores during training (--eval-task): fit() calls evaluate(eng, tok) every `every` steps and
    at the end, and adds its fields to the metrics record."""

    def __init__(self, name, items, every, batch_size):
        self.name, self.items, self.every, self.batch_size = name, items, every, batch_size
        self.chance = float(np.mean([1 / len(item["choices"]) for item in items]))

    def evaluate(self, eng, tok):
        result = score_choices(eng, tok, self.items, self.batch_size, progress=False)
        return dict(eval_task=self.name, eval_n=result["n"], eval_acc=result["acc"], eval_acc_norm=result["acc_norm"],
                    eval_chance=round(self.chance, 4))

    def text(self, record):
        return (f"{record['eval_task']} acc {record['eval_acc']:.4f}, acc_norm {record['eval_acc_norm']:.4f} "
                f"(chance {record['eval_chance']:.4f})")
