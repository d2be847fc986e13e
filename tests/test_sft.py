"""Supervised fine-tuning: the Alpaca templates and the loss mask, truncation, the gradient of masked
positions, exact resume, bad data, `sft --show`, and the CPU pipeline pretrain -> sft -> chat."""
import io
import json
import os
import re
import sys

import numpy as np
import pytest

from conftest import ROOT, run_cli
from nanoeuler.io import checkpoint
from nanoeuler import cli
from nanoeuler.train import loop, sft, pretrain as train
from nanoeuler.model.losses import cross_entropy_backward
from nanoeuler.data import instructions
from nanoeuler.data.template import render_prompt
from nanoeuler.check.gradients import random_problem
from nanoeuler.model.config import PRESETS, Config
from nanoeuler.model.engine import make_engine
from nanoeuler.infer.generate import generate
from test_train import _interrupt_at

GREETINGS = os.path.join(ROOT, "tests", "data", "sft_greetings.json")
WITH_INPUT = {"instruction": "Translate to French.", "input": "the cat", "output": "le chat"}
NO_INPUT = {"instruction": "Name a colour.", "input": "", "output": "Blue, like the sea."}


def _expected_mask(ids, n_prompt, K, T):
    """targets[k][t] by the definition: the token at t+1+k if it is a response token or </s>, else -1."""
    return np.array([[ids[t + 1 + k] if n_prompt <= t + 1 + k < len(ids) else -1 for t in range(T)]
                     for k in range(K)])


def test_templates_are_the_standard_alpaca_ones():
    assert sft.render_prompt("Name a colour.") == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\nName a colour.\n\n### Response:\n")
    assert sft.render_prompt("Translate to French.", "the {cat}") == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n### Instruction:\nTranslate to "
        "French.\n\n### Input:\nthe {cat}\n\n### Response:\n")


def test_sft_dpo_chat_and_serve_prompt_alike(tokenizer, monkeypatch):
    """One template for every stage: an instruction becomes the same prompt tokens in what sft trains on, what
    dpo scores, what `nanoeuler chat` hands the model and what the server prompts with."""
    from types import SimpleNamespace
    from nanoeuler.data.preferences import encode_pair  # the pairs that dpo scores
    from nanoeuler.data.template import conversation_ids
    from nanoeuler.infer import chat, serve
    tok, odd = tokenizer, "Say {hi}\n\n### Response:\n and </s>"
    for instruction in (NO_INPUT["instruction"], odd):
        ids, n_prompt = sft.encode_example(tok, {"instruction": instruction, "input": "", "output": "Blue."})
        assert tok.decode(ids[:n_prompt]) == sft.render_prompt(instruction).encode()
        (chosen, n_chosen), (rejected, n_rejected) = encode_pair(
            tok, {"prompt": instruction, "chosen": "Blue.", "rejected": "No."})
        assert n_chosen == n_rejected == n_prompt and chosen.tolist() == ids.tolist()
        assert rejected[:n_prompt].tolist() == ids[:n_prompt].tolist()
        system, turns = serve.conversation([{"role": "user", "content": instruction}])
        assert conversation_ids(tok, turns, system) == ids[:n_prompt].tolist()
    # the REPL of a chat checkpoint: the ids it gives generate() for each line, the conversation so far
    given, lines = [], iter([NO_INPUT["instruction"], odd])

    def fake_generate(eng, ids, *args, **kwargs):
        given.append(list(ids))
        yield tok.eos_id

    def fake_input(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None
    eng = SimpleNamespace(cfg=SimpleNamespace(context=4096))
    monkeypatch.setattr(chat, "load_model", lambda ckpt, device, **_: (eng, tok, SimpleNamespace(chat=True, step=0)))
    monkeypatch.setattr(chat, "generate", fake_generate)
    monkeypatch.setattr("builtins.input", fake_input)
    args = SimpleNamespace(ckpt="c.bin", device="cpu", speculative=0, seed=0, max_new_tokens=4, temperature=0,
                           top_k=0, top_p=1.0, stats=False)
    assert chat.main(args) == 0
    first = sft.encode_example(tok, {"instruction": NO_INPUT["instruction"], "input": "", "output": ""})[0]
    assert given == [first[:-1].tolist(), first.tolist() + conversation_ids(tok, [(odd, None)])]


@pytest.mark.parametrize("example", [WITH_INPUT, NO_INPUT], ids=["with-input", "no-input"])
def test_mask_covers_exactly_the_response_and_eos(tokenizer, example):
    tok, K = tokenizer, 3
    ids, n_prompt = instructions.encode_example(tok, example)
    prompt = render_prompt(example["instruction"], example["input"])
    assert tok.decode(ids[:n_prompt]) == prompt.encode()
    assert tok.decode(ids[n_prompt:]) == (example["output"] + "</s>").encode() and ids[-1] == tok.eos_id
    # one row alone, and next to a longer example (so this row has padding after its end)
    other = instructions.encode_example(tok, {**example, "output": example["output"] * 4})
    for batch in ([(ids, n_prompt)], [(ids, n_prompt), other]):
        inputs, targets = instructions.make_batch(batch, context=256, K=K)
        T = inputs.shape[1]
        assert T % instructions.PAD_MULTIPLE == 0 and T >= len(batch[-1][0]) - 1
        assert targets.shape == (K, len(batch), T)
        np.testing.assert_array_equal(inputs[0, :len(ids)], ids[:T])
        np.testing.assert_array_equal(targets[:, 0], _expected_mask(ids, n_prompt, K, T))
        head0 = targets[0, 0][targets[0, 0] >= 0]
        assert tok.decode(head0) == (example["output"] + "</s>").encode()  # response + </s>, nothing else
        for k in range(K):  # head k sees the same tokens, k positions earlier
            assert (targets[k, 0] >= 0).sum() == len(ids) - n_prompt


def test_truncation_keeps_the_mask_aligned(tokenizer):
    tok, K = tokenizer, 2
    example = {**NO_INPUT, "output": "la di da " * 40}
    full, n_prompt = instructions.encode_example(tok, example)
    context = len(instructions.encode_example(tok, WITH_INPUT)[0]) + 4  # WITH_INPUT fits, `example` does not
    ids, status = instructions.fit_example(full, n_prompt, context, K)
    assert status == "truncated" and len(ids) == context + K
    np.testing.assert_array_equal(ids, full[:context + K])
    inputs, targets = instructions.make_batch([(ids, n_prompt)], context, K)
    assert inputs.shape == (1, context)
    np.testing.assert_array_equal(targets[:, 0], _expected_mask(full, n_prompt, K, context))
    assert tok.eos_id not in targets  # a cut response never teaches the model to stop there
    assert all((targets[k, 0] >= 0).sum() == context + k + 1 - n_prompt for k in range(K))
    # what cannot be truncated usefully is skipped
    assert instructions.fit_example(full, n_prompt, n_prompt, K) == (None, "skipped")  # the prompt fills it
    assert instructions.fit_example(full, n_prompt, context, K, long="skip") == (None, "skipped")
    assert instructions.fit_example(full, n_prompt, len(full) - K, K)[1] == "ok"  # exactly the window
    data = [example, NO_INPUT, {**WITH_INPUT, "instruction": "Say it. " * 40}, WITH_INPUT]
    train_idx, val_idx = instructions.split(len(data), 1)
    _, _, counts = instructions.prepare(data, train_idx, val_idx, tok, context, K, "truncate", progress=False)
    assert counts == {"train": 2, "val": 1, "truncated": 1, "skipped": 1}


def test_masked_positions_contribute_no_gradient():
    """The gradient of an SFT batch is exactly the sum of its supervised positions' own gradients (each
    computed with every other target masked), weighted as the loss weights them: prompt and padding
    positions add nothing. Float64 CPU engine."""
    cfg = Config(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, hidden=32, vocab_size=40, context=24, mtp_heads=2)
    rng = np.random.default_rng(0)
    eng = make_engine(cfg, dtype=np.float64)
    eng.load_params(random_problem(cfg, rng)[0])
    examples = [(rng.integers(0, 39, 22), 9), (rng.integers(0, 39, 12), 5)]  # row 1 is padded
    inputs, targets = instructions.make_batch(examples, cfg.context, cfg.mtp_heads)
    loss, loss0 = cross_entropy_backward(eng, inputs, targets)
    full = eng.grads.copy()
    # loss0 is head 0's mean cross-entropy over the supervised positions only
    logits = eng.logits(inputs).astype(np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    b, t = np.nonzero(targets[0] >= 0)
    assert loss0 == pytest.approx(-logp[b, t, targets[0, b, t]].mean(), rel=1e-6)  # logits() is float32

    total = np.zeros_like(full)
    for k in range(cfg.mtp_heads):
        valid = np.argwhere(targets[k] >= 0)
        for b, t in valid:
            one = np.full_like(targets, -1)
            one[k, b, t] = targets[k, b, t]
            cross_entropy_backward(eng, inputs, one)
            total += eng.grads / len(valid)
    assert np.linalg.norm(total - full) <= 1e-12 * np.linalg.norm(full)


def test_batches_cover_each_epoch_and_resume_exactly():
    examples = [(np.full(i + 2, i), 1) for i in range(7)]  # example i: tokens i, i, ...
    original = instructions.ExampleBatches(examples, 3, 16, 2, seed=4)
    drawn = [original.next()[0] for _ in range(2)]
    restored = instructions.ExampleBatches(examples, 3, 16, 2, seed=99)
    restored.load_state(json.loads(json.dumps(original.state())))
    for _ in range(5):  # across two epoch boundaries
        (inputs, targets), (inputs_restored, targets_restored) = original.next(), restored.next()
        np.testing.assert_array_equal(inputs, inputs_restored)
        np.testing.assert_array_equal(targets, targets_restored)
        drawn.append(inputs)
    order = [int(row[0]) for batch in drawn for row in batch]
    for epoch in range(3):  # each epoch is a permutation, a different one each time
        assert sorted(order[7 * epoch:7 * epoch + 7]) == list(range(7))
    assert order[:7] != order[7:14] and original.state() == {"seed": 4, "epoch": 2, "pos": 7}


def _cli(capsys, *argv):
    """Run the CLI in-process: (exit status, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.mark.parametrize("content,needle", [
    (None, "not found"), ("{not json", "not JSON"), ('{"instruction": "x"}', "non-empty JSON list"),
    ("[]", "non-empty JSON list"), ('[{"instruction": "x", "output": "y"}]', "example 0 has no string 'input'"),
    (b"\xff\xfe[]", "not JSON")])
def test_bad_instruction_data_is_one_line(content, needle, tiny_ckpt, tmp_path, capsys):
    data = tmp_path / "data.json"
    if content is not None:
        data.write_bytes(content if isinstance(content, bytes) else content.encode())
    status, out, err = _cli(capsys, "sft", "--data", data, "--ckpt", tiny_ckpt, "--out", tmp_path / "c.bin")
    assert status == 2 and err.count("\n") == 1 and needle in err and str(data) in err, err
    assert not (tmp_path / "c.bin").exists()


def test_resume_without_a_checkpoint(tmp_path, capsys):
    status, _, err = _cli(capsys, "sft", "--resume", "--out", tmp_path / "none.bin")
    assert status == 2 and "nothing to resume" in err and err.count("\n") == 1


def test_every_example_too_long(tiny_ckpt, tmp_path, capsys):
    """The tiny checkpoint's context (32) is shorter than any Alpaca prompt."""
    status, _, err = _cli(capsys, "sft", "--data", GREETINGS, "--ckpt", tiny_ckpt, "--out", tmp_path / "c.bin")
    assert status == 2 and "longer than the model's context of 32" in err


# ---------------------------------------------------------------------------------- the CPU pipeline
TINY = Config(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, hidden=96, vocab_size=512, context=160, mtp_heads=2)
PRETRAIN = loop.Hyperparameters(steps=60, batch_size=4, lr=3e-3, warmup=10, eval_every=60, sample_every=60,
                                ckpt_every=60, eval_batches=2, final_eval_batches=2, sample_tokens=16)
FINETUNE = loop.Hyperparameters(steps=100, batch_size=8, lr=1e-2, warmup=10, eval_every=50, sample_every=100,
                                ckpt_every=100, eval_batches=2, sample_tokens=8)
SFT_FLAGS = ["--data", GREETINGS, "--device", "cpu", "--val-examples", 4]
REPLY = r"Hello, [^\n]+!"  # the shape of every response in sft_greetings.json


def _main(module, *argv):
    return module.main(cli.build_parser()[0].parse_args([str(arg) for arg in argv]))


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """Pretrain the small preset's structure (4 layers, 4/2 heads, K = 2) at width 32 briefly on the start
    of shakespeare.txt, then fine-tune it on tests/data/sft_greetings.json ("Greet X." -> "Hello, X!"):
    about 30 s on 2 cores. (At this width it learns the shape of the answer and to stop, not yet to copy
    the name; width 64 does that too, at three times the cost.)"""
    d = tmp_path_factory.mktemp("pipeline")
    text = d / "shakespeare.txt"
    with open(os.path.join(ROOT, "shakespeare.txt"), "rb") as f:
        text.write_bytes(f.read(300_000))
    with pytest.MonkeyPatch.context() as m:
        m.setitem(PRESETS, "small", TINY)
        m.setitem(train.PRESET_HYPER, "small", PRETRAIN)
        m.setattr(sft, "SFT_HYPER", FINETUNE)
        assert _main(train, "train", "--data", text, "--device", "cpu", "--out", d / "base.bin") == 0
        assert _main(sft, "sft", "--ckpt", d / "base.bin", "--out", d / "chat.bin", *SFT_FLAGS) == 0
    return {"dir": d, "base": d / "base.bin", "chat": d / "chat.bin"}


def test_pipeline_chat_model_answers_in_the_template_and_stops(pipeline):
    base, chat = checkpoint.load(pipeline["base"]), checkpoint.load(pipeline["chat"], with_opt=True)
    assert not base.chat and chat.chat and chat.step == 100 and chat.cfg == base.cfg
    assert chat.train_state["examples"] == {"train": 36, "val": 4, "truncated": 0, "skipped": 0}
    log = [json.loads(line) for line in open(pipeline["dir"] / "chat.jsonl")]
    assert log[-1]["loss"] < 0.5 * log[0]["loss"] and "val_loss" in log[-1]
    assert log[0]["examples_truncated"] == 0 and log[0]["examples_skipped"] == 0  # counted in the log

    tok = chat.tokenizer()
    eng = make_engine(chat.cfg)
    eng.load_params(chat.params)
    # trained, held-out and new instructions, both templates: greedy replies have the trained shape and
    # end in </s>
    with open(GREETINGS) as f:
        data = json.load(f)
    held_out = [(data[i]["instruction"], data[i]["input"]) for i in instructions.split(len(data), 4)[1]]
    for instruction, input in [("Greet Romeo.", ""), ("Welcome Titania.", ""), ("Say hello to Bob.", ""),
                               ("Greet the person named below.", "Kate")] + held_out:
        ids = tok.encode(render_prompt(instruction, input))
        reply = list(generate(eng, ids, 30, temperature=0, stop_ids=(tok.eos_id,)))
        assert reply[-1] == tok.eos_id and len(reply) < 30, tok.decode(reply)
        assert re.fullmatch(REPLY, tok.decode(reply[:-1]).decode()), tok.decode(reply)

    # the REPL: a chat checkpoint wraps each line in the template and stops at </s>
    r = run_cli("chat", "--ckpt", pipeline["chat"], "--device", "cpu", "--temperature", 0,
                "--max-new-tokens", 30, input="Greet Romeo.\nGreet Hamlet.\n/quit\n")
    assert r.returncode == 0 and "a chat model" in r.stdout, r.stderr
    assert len(re.findall(f"> {REPLY}\n", r.stdout)) == 2, r.stdout
    # while the pretrained checkpoint still just continues the text
    r = run_cli("chat", "--ckpt", pipeline["base"], "--device", "cpu", "--max-new-tokens", 5, "--seed", 1,
                input="ROMEO:\n")
    assert r.returncode == 0 and "a base model" in r.stdout and "Hello," not in r.stdout, r.stderr


def test_sft_resume_after_interrupt_is_bit_identical(pipeline, tmp_path, monkeypatch):
    common = ["--ckpt", pipeline["base"], "--steps", 12, "--batch-size", 4, "--lr", 3e-3, "--eval-every", 4,
              "--sample-every", 6, "--ckpt-every", 5, *SFT_FLAGS]
    assert _main(sft, "sft", "--out", tmp_path / "a.bin", *common) == 0
    with monkeypatch.context() as m:
        _interrupt_at(m, 7, instructions.ExampleBatches)
        assert _main(sft, "sft", "--out", tmp_path / "b.bin", *common) == 130
    assert checkpoint.load(tmp_path / "b.bin").step == 7
    assert _main(sft, "sft", "--resume", "--out", tmp_path / "b.bin", "--device", "cpu") == 0
    full, resumed = ([json.loads(line) for line in open(tmp_path / f"{n}.jsonl")] for n in "ab")
    assert [r["step"] for r in resumed] == list(range(1, 13))
    for record, record_resumed in zip(full, resumed):
        for key in ("loss", "loss_all_heads", "lr", "grad_norm", "val_loss", "val_bpb"):
            assert record.get(key) == record_resumed.get(key), (record["step"], key)
    ckpt_full, ckpt_resumed = (checkpoint.load(tmp_path / f"{n}.bin", with_opt=True) for n in "ab")
    np.testing.assert_array_equal(ckpt_full.params, ckpt_resumed.params)
    assert ckpt_full.chat and ckpt_resumed.chat and ckpt_full.train_state == ckpt_resumed.train_state


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_show_marks_the_supervised_tokens(pipeline, tiny_ckpt, monkeypatch, capsys):
    status, out, _ = _cli(capsys, "sft", "--show", 4, "--data", GREETINGS, "--ckpt", pipeline["base"])
    assert status == 0
    with open(GREETINGS) as f:
        data = json.load(f)
    for ex in data[:4]:  # brackets when stdout is not a terminal
        assert render_prompt(ex["instruction"], ex["input"]) + f"[[{ex['output']}</s>]]" in out
    assert "=== example 3 (with input)" in out and "\x1b[" not in out
    term = _Terminal()
    monkeypatch.setattr(sys, "stdout", term)
    args = cli.build_parser()[0].parse_args(["sft", "--show", "1", "--data", GREETINGS, "--ckpt",
                                             str(pipeline["base"])])
    assert sft.main(args) == 0
    assert f"### Response:\n{sft.GREEN}Hello, Romeo!</s>{sft.RESET}" in term.getvalue()
    monkeypatch.undo()
    # with a context of 32 every prompt is too long: shown unmarked, and said so
    status, out, _ = _cli(capsys, "sft", "--show", 1, "--data", GREETINGS, "--ckpt", tiny_ckpt)
    assert status == 0 and "SKIPPED" in out and "</s>]]" not in out
