"""Run reports: what a training run writes beside its checkpoint (`<out>.md`), what `nanoeuler report` prints,
and the eval task's scores in the metrics log."""
import argparse
import json
import os

import pytest

from conftest import tiny_config
from nanoeuler import cli
from nanoeuler.cli import build_parser
from nanoeuler.io import report
from nanoeuler.model.config import PRESETS, param_count
from nanoeuler.train import loop, pretrain

HYPER = loop.Hyperparameters(steps=8, batch_size=4, lr=3e-3, warmup=2, eval_every=4, sample_every=8, ckpt_every=5,
                             eval_batches=2, sample_tokens=8)
ITEMS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "lm_eval",
                     "nanoeuler_mc.jsonl")


@pytest.fixture(scope="module")
def trained(tokenizer, tokenizer_file, corpus, tmp_path_factory):
    """One tiny training run for the module (the tests that change its files put them back)."""
    out = tmp_path_factory.mktemp("run") / "run.bin"
    argv = ["train", "--data", str(corpus), "--tokenizer", str(tokenizer_file), "--device", "cpu", "--out", str(out),
            "--eval-task", f"mc:{ITEMS}", "--eval-task-every", "4"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PRESETS, "small", tiny_config(tokenizer.vocab_size))
        mp.setitem(pretrain.PRESET_HYPER, "small", HYPER)
        mp.setattr("sys.argv", ["nanoeuler", *argv])
        parser, _ = build_parser()
        assert pretrain.main(parser.parse_args(argv)) == 0
    return out


def test_training_writes_the_report_and_the_eval_scores(trained, tokenizer, corpus):
    md = trained.with_suffix(".md").read_text()
    log = [json.loads(line) for line in open(trained.with_suffix(".jsonl"))]
    scored = [r for r in log if "eval_acc" in r]
    assert [r["step"] for r in scored] == [4, 8] and all(r["eval_n"] == 40 and r["eval_task"] == "mc" for r in scored)
    assert log[-1]["tokens_seen"] == 8 * 4 * 32 and log[-1]["time_s"] > 0
    final = log[-1]
    cfg = tiny_config(tokenizer.vocab_size)
    for text in (f"{param_count(cfg):,} parameters", f"`{corpus}` ({os.path.getsize(corpus):,} bytes)",
                 "8 of 8 steps, 4 sequences a step", f"{8 * 4 * 32:,} tokens", "wall time", "tokens/s",
                 "fp32 on ", f"validation loss {final['val_loss']:.4f} nats/token, {final['val_bpb']:.4f} bits/byte",
                 f"mc (40 items): acc {final['eval_acc']:.4f}, acc_norm {final['eval_acc_norm']:.4f}",
                 "![loss curve](run.png)", "## Sample", "At step 8:",
                 f"nanoeuler train --resume --out {trained} --steps 16", "epochs of the training split",
                 "command: `nanoeuler train --data"):
        assert text in md, text


def test_report_command_prints_it_and_rebuilds_it_the_same(trained, capsys):
    written = trained.with_suffix(".md").read_text()
    cli.report_command(argparse.Namespace(ckpt=str(trained)))
    assert capsys.readouterr().out == written + "\n"
    trained.with_suffix(".md").unlink()
    try:
        assert report.report_text(trained) == written  # from the checkpoint and its log alone
    finally:
        trained.with_suffix(".md").write_text(written)


def test_report_ignores_log_records_past_the_checkpoint(trained):
    log = trained.with_suffix(".jsonl")
    kept = log.read_text()
    log.write_text(kept + json.dumps({"step": 99, "loss": 1.0, "val_loss": 0.5, "val_bpb": 0.1}) + "\n")
    try:  # a later run went on without saving
        text = report.build_report(trained)
        assert "(step 99)" not in text and "(step 8)" in text
    finally:
        log.write_text(kept)


def test_report_of_a_checkpoint_without_training_state(tiny_ckpt):
    text = report.build_report(tiny_ckpt)
    assert text.startswith("# tiny.bin: nanoeuler model (no training state") and "## Resume" not in text
