"""The training loop and its data: exact resume, Ctrl-C, the metrics log, the schedule, the token cache,
what each evaluation covers, the gradient norm, and the device rule."""
import dataclasses
import json
import math
import os
import signal
import time

import numpy as np
import pytest

from conftest import tiny_config
from nanoeuler.io import checkpoint
from nanoeuler.model import device
from nanoeuler.train import loop, pretrain as train
from nanoeuler.model.losses import bits_per_byte
from nanoeuler.cli import build_parser
from nanoeuler.model.config import PRESETS, param_count
from nanoeuler.data.corpus import RandomWindows, eval_batches, open_corpus
from nanoeuler.errors import UserError

HYPER = loop.Hyperparameters(steps=12, batch_size=4, lr=3e-3, warmup=3, eval_every=4, sample_every=6, ckpt_every=5,
                             eval_batches=2, sample_tokens=8)


@pytest.fixture
def tiny_preset(monkeypatch, tokenizer):
    monkeypatch.setitem(PRESETS, "small", tiny_config(tokenizer.vocab_size))
    monkeypatch.setitem(train.PRESET_HYPER, "small", HYPER)


def _train(*argv):
    parser, _ = build_parser()
    return train.main(parser.parse_args(["train", *map(str, argv)]))


def _log(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _interrupt_at(monkeypatch, step, source=RandomWindows):
    """Deliver a real SIGINT while the loop draws the batch of `step` (1-based) from a `source` (the batch
    class: pretraining's RandomWindows, SFT's ExampleBatches, DPO's PairBatches)."""
    calls = {"n": 0}
    real_next = source.next

    def next_then_interrupt(self):
        calls["n"] += 1
        if calls["n"] == step:
            os.kill(os.getpid(), signal.SIGINT)
        return real_next(self)
    monkeypatch.setattr(source, "next", next_then_interrupt)


def test_resume_after_interrupt_is_bit_identical(tiny_preset, corpus, tokenizer_file, tmp_path, monkeypatch):
    common = ["--data", corpus, "--tokenizer", tokenizer_file, "--device", "cpu"]
    assert _train(*common, "--out", tmp_path / "a.bin") == 0
    full = _log(tmp_path / "a.jsonl")
    assert [r["step"] for r in full] == list(range(1, 13))

    # Ctrl-C during step 7 (after the checkpoint of step 5): the loop finishes step 7, saves and stops
    with monkeypatch.context() as m:
        _interrupt_at(m, 7)
        assert _train(*common, "--out", tmp_path / "b.bin") == 130
    assert checkpoint.load(tmp_path / "b.bin").step == 7
    assert _train("--resume", "--out", tmp_path / "b.bin", "--device", "cpu") == 0
    resumed = _log(tmp_path / "b.jsonl")

    assert [r["step"] for r in resumed] == list(range(1, 13))
    for record, record_resumed in zip(full, resumed):  # exactly equal floats, not approximately
        for key in ("loss", "loss_all_heads", "lr", "grad_norm", "val_loss", "val_bpb"):
            assert record.get(key) == record_resumed.get(key), (record["step"], key)
    ckpt_full, ckpt_resumed = (checkpoint.load(tmp_path / f"{n}.bin", with_opt=True) for n in "ab")
    np.testing.assert_array_equal(ckpt_full.params, ckpt_resumed.params)
    np.testing.assert_array_equal(ckpt_full.opt[0], ckpt_resumed.opt[0])
    np.testing.assert_array_equal(ckpt_full.opt[1], ckpt_resumed.opt[1])
    assert ckpt_full.train_state == ckpt_resumed.train_state


def test_resume_rewinds_the_log_to_the_checkpoint(tiny_preset, corpus, tokenizer_file, tmp_path):
    """A crash after the checkpoint of step 10 leaves log lines for steps 11.. that are run again."""
    common = ["--data", corpus, "--tokenizer", tokenizer_file, "--device", "cpu", "--out", tmp_path / "a.bin"]
    assert _train(*common, "--steps", 10) == 0
    with open(tmp_path / "a.jsonl", "a") as f:
        f.write(json.dumps({"step": 11, "loss": 1.0}) + "\n" + '{"step": 12, "lo')  # cut mid-line
    assert _train("--resume", "--out", tmp_path / "a.bin", "--steps", 12, "--device", "cpu") == 0
    log = _log(tmp_path / "a.jsonl")
    assert [r["step"] for r in log] == list(range(1, 13))
    assert log[10]["loss"] != 1.0
    with pytest.raises(UserError, match="is at step 12, --steps 8 is no further; pass --steps N above 12"):
        _train("--resume", "--out", tmp_path / "a.bin", "--steps", 8, "--device", "cpu")
    assert _train(*common, "--steps", 4, "--overwrite") == 0  # afresh over the finished run
    assert [r["step"] for r in _log(tmp_path / "a.jsonl")] == [1, 2, 3, 4]


def test_metrics_log_and_loss_curve(tiny_preset, corpus, tokenizer, tokenizer_file, tmp_path, capsys):
    assert _train("--data", corpus, "--tokenizer", tokenizer_file, "--device", "cpu", "--out",
                  tmp_path / "m.bin", "--log", tmp_path / "logs.jsonl") == 0
    log = _log(tmp_path / "logs.jsonl")
    for r in log:
        assert {"step", "loss", "lr", "tokens_per_s"} <= set(r)
        assert ("val_loss" in r) == (r["step"] % HYPER.eval_every == 0 or r["step"] == HYPER.steps)
    # the final evaluation covers the whole validation split: bpb = loss / ln 2 * tokens / bytes
    val = open_corpus(corpus, tokenizer, progress=False).val
    ratio = (len(val) - 1) / len(tokenizer.decode(val[1:]))
    assert log[-1]["val_bpb"] == pytest.approx(log[-1]["val_loss"] / math.log(2) * ratio, rel=1e-9)
    assert (tmp_path / "logs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "sample at step 6" in out and "val loss" in out


def test_each_record_times_its_own_step_on_the_cpu(tiny_preset, corpus, tokenizer_file, tmp_path, monkeypatch):
    """The CPU engine has finished a step when it is queued, so a step's time is its own, not the next one's."""
    real_next = RandomWindows.next
    calls = {"n": 0}

    def next_slow_at_step_3(self):
        calls["n"] += 1
        if calls["n"] == 3:
            time.sleep(0.4)
        return real_next(self)
    monkeypatch.setattr(RandomWindows, "next", next_slow_at_step_3)
    assert _train("--data", corpus, "--tokenizer", tokenizer_file, "--device", "cpu", "--out", tmp_path / "t.bin",
                  "--steps", 3) == 0
    seconds = np.diff([r["time_s"] for r in _log(tmp_path / "t.jsonl")])
    assert seconds[1] >= 0.39 and seconds[0] < 0.3, seconds  # time_s is rounded to 0.01 s


def test_bits_per_byte_covers_the_validation_split_once(corpus, tokenizer):
    data = open_corpus(corpus, tokenizer, progress=False)
    batches = eval_batches(data.val, data.byte_len, 4, 32, 2)
    head0 = np.concatenate([t[0][t[0] >= 0] for _, t, _ in batches])
    np.testing.assert_array_equal(head0, data.val[1:])  # every token but the first, once, in order
    assert sum(b for *_, b in batches) == data.byte_len[data.val[1:]].sum()
    assert all(i.shape == (4, 32) and t.shape == (2, 4, 32) for i, t, _ in batches)
    # the periodic estimate: `limit` batches of single windows spread from the first to the last
    quick = eval_batches(data.val, data.byte_len, 4, 32, 2, limit=3)
    firsts = np.concatenate([i[:, 0] for i, _, _ in quick])
    assert len(quick) == 3 and firsts[0] == data.val[0] and len(set(firsts.tolist())) > 8
    assert firsts[-1] == data.val[(len(data.val) - 2) // 32 * 32]
    # the split is the last tenth of the file's bytes, and train + val decode to the file exactly
    raw = corpus.read_bytes()
    val_bytes = tokenizer.decode(data.val)
    assert tokenizer.decode(data.train) + val_bytes == raw
    assert 0.1 <= len(val_bytes) / len(raw) < 0.1 + 64 / len(raw)


def test_final_evaluation_of_each_preset():
    """README and docs/training.md: at the end, small and big score the whole validation split; base at most
    256 batches: 4,096 windows of 512 spread evenly when the split is longer (at batch 16), else all of it."""
    assert train.PRESET_HYPER["small"].final_eval_batches is None
    assert train.PRESET_HYPER["big"].final_eval_batches is None
    hp = train.PRESET_HYPER["base"]
    assert (hp.final_eval_batches, hp.batch_size, PRESETS["base"].context) == (256, 16, 512)
    long = np.arange(5000 * 512 + 7)  # token i is i, so a window's first input is where it starts
    byte_len = np.ones(len(long), np.int64)
    batches = eval_batches(long, byte_len, hp.batch_size, 512, 4, limit=hp.final_eval_batches)
    starts = np.concatenate([i[:, 0] for i, _, _ in batches])
    gaps = np.diff(starts) // 512
    assert len(batches) == 256 and len(starts) == 4096 and set(gaps.tolist()) == {1, 2}  # 5,001 windows
    assert starts[0] == 0 and starts[-1] == 5000 * 512 and sum(b for *_, b in batches) == 4095 * 512 + 6
    short = long[:300 * 512]  # 300 windows: scored whole, every token but the first once
    batches = eval_batches(short, byte_len, hp.batch_size, 512, 4, limit=hp.final_eval_batches)
    head0 = np.concatenate([t[0][t[0] >= 0] for _, t, _ in batches])
    assert len(batches) == 19 and head0.tolist() == short[1:].tolist()
    # periodic estimates: 4 x 32 = 128 windows (small), 8 x 32 = 256 (big), 16 x 16 = 256 (base)
    assert [train.PRESET_HYPER[p].eval_batches * train.PRESET_HYPER[p].batch_size
            for p in ("small", "big", "base")] == [128, 256, 256]


def test_evaluate_weights_batches_by_their_targets():
    class Stub:  # each position's loss is its target itself (0 where masked): loss0 = the mean of the valid ones
        def forward(self, inputs, targets):
            return np.where(targets >= 0, targets, 0).reshape(len(targets), -1).astype(np.float64)
    t1 = np.array([[[1, 1, -1]]]), np.array([[[4, -1, -1]]])
    batches = [(None, t1[0], 2), (None, t1[1], 6)]
    loss, bpb = bits_per_byte(Stub(), batches)
    assert loss == pytest.approx((1 + 1 + 4) / 3)
    assert bpb == pytest.approx((1 + 1 + 4) / math.log(2) / 8)


def test_token_cache_is_rebuilt_when_stale(corpus, tokenizer, tmp_path):
    from nanoeuler.tokenizer.bpe import Tokenizer
    path = tmp_path / "c.txt"
    path.write_bytes(corpus.read_bytes()[:20000])
    first = np.array(open_corpus(path, tokenizer, progress=False).tokens)
    cache = str(path) + ".tok"
    assert open(cache, "rb").read(8) == b"NEUTOKS\x00"
    other = Tokenizer.train(path, 280, progress=False)
    np.testing.assert_array_equal(open_corpus(path, other, progress=False).tokens, other.encode(path.read_bytes()))
    np.testing.assert_array_equal(open_corpus(path, tokenizer, progress=False).tokens, first)
    time.sleep(0.01)
    path.write_bytes(b"changed " + path.read_bytes())  # same tokenizer, new text
    np.testing.assert_array_equal(open_corpus(path, tokenizer, progress=False).tokens,
                                  tokenizer.encode(path.read_bytes()))


def test_corpus_reads_the_end_token(tokenizer, tmp_path):
    """`</s>` written in a corpus is the end-of-text token (documents closed by it), not its four characters."""
    path = tmp_path / "docs.txt"
    path.write_text("First document.</s>\n\nSecond one.</s>\n")
    tokens = np.array(open_corpus(path, tokenizer, progress=False).tokens)
    np.testing.assert_array_equal(tokens, tokenizer.encode(path.read_text(), allow_special=True))
    assert (tokens == tokenizer.eos_id).sum() == 2
    assert not np.array_equal(tokens, tokenizer.encode(path.read_text()))


def test_a_cache_that_read_the_end_token_as_text_is_rebuilt(tokenizer, tmp_path):
    """A cache written before `</s>` in a corpus was the end token (the header of those days: 4 zero bytes
    where the flags are now, its `</s>` tokenized as text) matches the corpus and the tokenizer, and is still
    not reused: the corpus is tokenized again, and the new cache is reused."""
    import os
    import struct

    from nanoeuler.tokenizer.token_file import TOKENS_HEADER, read_token_file
    path = tmp_path / "docs.txt"
    path.write_text("First document.</s>\n\nSecond one.</s>\n" * 50)
    as_text = tokenizer.encode(path.read_bytes())
    st = os.stat(path)
    old_header = struct.Struct("<8sI4xQQq64s").pack(b"NEUTOKS\x00", 1, len(as_text), st.st_size, st.st_mtime_ns,
                                                     tokenizer.sha256().encode())
    cache = tmp_path / "docs.txt.tok"
    cache.write_bytes(old_header.ljust(128, b"\x00") + np.array(as_text, "<u2").tobytes())
    assert read_token_file(cache, source=path, tok=tokenizer).tolist() == as_text  # the old file still reads
    tokens = open_corpus(path, tokenizer, progress=False).tokens
    assert tokens.tolist() == tokenizer.encode(path.read_bytes(), allow_special=True)
    assert (tokens == tokenizer.eos_id).sum() == 100
    assert TOKENS_HEADER.unpack(cache.read_bytes()[:TOKENS_HEADER.size])[2] == 1  # the flag: </s> read as the token
    mtime = os.stat(cache).st_mtime_ns
    assert open_corpus(path, tokenizer, progress=False).tokens.tolist() == tokens.tolist()
    assert os.stat(cache).st_mtime_ns == mtime  # reused


DOCS = "First document.</s>\n\nSecond one, <|im_end|> kept.</s>\n\nA third.</s>\n"


def end_of_text_tokenizer(tmp_path, pre="byte-level"):
    """A Hugging Face tokenizer.json whose end of text is `<|endoftext|>`, with no `</s>` (as Llama 3's,
    Qwen2's and SmolLM2's have none), learned on a little text, loaded as an imported model's is."""
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, trainers

    from nanoeuler.tokenizer.bpe import Tokenizer
    hf = HF(models.BPE())
    hf.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if pre == "byte-level" else
                        pre_tokenizers.Sequence([pre_tokenizers.Punctuation(),  # read by grammar.py's class
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)]))
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator([DOCS.replace("</s>", "") * 20, "Some other text to learn from, said the doc."], trainer)
    hf.save(str(tmp_path / f"{pre}.json"))
    tok = Tokenizer.load(tmp_path / f"{pre}.json", eos="<|endoftext|>")
    assert "</s>" not in tok.special_tokens and tok.eos == "<|endoftext|>"
    return tok


@pytest.mark.parametrize("pre", ["byte-level", "grammar"])
def test_a_tokenizer_without_the_terminator_reads_it_as_its_end_of_text(tmp_path, pre):
    """A corpus's `</s>` read by a tokenizer that has no such token is its end-of-text token, one id where
    each document ends (no `<`, `/`, `s`, `>` there), read in pieces of any size as in one; its other special
    tokens written in the text are still those tokens; a string in memory is read the same way."""
    from nanoeuler.data.corpus import encode_text
    tok = end_of_text_tokenizer(tmp_path, pre)
    assert type(tok).__name__ == ("Tokenizer" if pre == "byte-level" else "GrammarBPE")
    path = tmp_path / "docs.txt"
    path.write_text(DOCS)
    tokens = open_corpus(path, tok, progress=False).tokens.tolist()
    expected = tok.encode(DOCS.replace("</s>", "<|endoftext|>"), allow_special=True)
    assert tokens == expected == encode_text(tok, DOCS)
    assert tokens.count(tok.eos_id) == 3 and tokens.count(tok.special_tokens["<|im_end|>"]) == 1
    assert tok.decode(tokens) == DOCS.replace("</s>", "<|endoftext|>").encode()  # nothing of `</s>` left
    ends = [i for i, t in enumerate(tokens) if t == tok.eos_id]
    assert [tok.decode(tokens[i - 1:i]).decode()[-1] for i in ends] == [".", ".", "."]  # right after the text
    as_text = tok.encode(DOCS, allow_special=True)
    assert tok.eos_id not in as_text and b"</s>" in tok.decode(as_text)  # what the corpus taught before
    for chunk in (1, 2, 3, 5, 17):  # `</s>` cut by the reads anywhere
        tok.encode_file(path, tmp_path / "c.tok", progress=False, allow_special=True, chunk_bytes=chunk,
                        document_ends=True)
        assert np.fromfile(tmp_path / "c.tok", "<u2", offset=128).tolist() == expected, chunk


def test_the_terminator_is_replaced_wherever_the_reads_cut_it():
    """The file reader that puts the end token's text in place of `</s>`: the text it gives, read in pieces of
    any size, is the whole text so replaced, and no piece but the last is empty."""
    import io

    from nanoeuler.tokenizer.token_file import Replacing
    rng = np.random.default_rng(0)
    for _ in range(300):
        text = bytes(rng.choice(list(b"</s>a"), size=int(rng.integers(0, 40))))
        reader = Replacing(io.BytesIO(text).read, b"</s>", b"<|endoftext|>")
        size, pieces = int(rng.integers(1, 9)), []
        while piece := reader.read(size):
            pieces.append(piece)
        assert b"".join(pieces) == text.replace(b"</s>", b"<|endoftext|>") and reader.consumed == len(text)


def test_the_cache_records_how_the_terminator_was_read(tmp_path):
    """A cache whose `</s>` was read as text by a tokenizer without it (same corpus, same tokenizer, special
    tokens read: only the reading of the terminator differs) is rebuilt, the new one reused, and a reading
    that does not map the terminator refuses the new one."""
    from nanoeuler.tokenizer.token_file import DOCUMENT_ENDS, SPECIAL_TOKENS, TOKENS_HEADER, read_token_file
    tok = end_of_text_tokenizer(tmp_path)
    path, cache = tmp_path / "docs.txt", tmp_path / "docs.txt.tok"
    path.write_text(DOCS * 30)
    tok.encode_file(path, cache, progress=False, allow_special=True)  # `</s>` as four characters
    assert TOKENS_HEADER.unpack(cache.read_bytes()[:TOKENS_HEADER.size])[2] == SPECIAL_TOKENS
    assert read_token_file(cache, source=path, tok=tok, allow_special=True).tolist() == \
        tok.encode(DOCS * 30, allow_special=True)
    tokens = open_corpus(path, tok, progress=False).tokens
    assert tokens.tolist().count(tok.eos_id) == 90
    assert TOKENS_HEADER.unpack(cache.read_bytes()[:TOKENS_HEADER.size])[2] == SPECIAL_TOKENS | DOCUMENT_ENDS
    mtime = os.stat(cache).st_mtime_ns
    assert open_corpus(path, tok, progress=False).tokens.tolist() == tokens.tolist()
    assert os.stat(cache).st_mtime_ns == mtime  # reused
    with pytest.raises(UserError, match=r"document terminators \(</s>\) read as the end-of-text token"):
        read_token_file(cache, source=path, tok=tok, allow_special=True, document_ends=False)


def test_a_tokenizer_with_the_terminator_reads_the_corpus_as_before(tokenizer, tmp_path):
    """Ours (`</s>` is its end-of-text token): the cache is the very file that reading the special tokens
    alone writes, byte for byte, and either reading reuses the other's."""
    path = tmp_path / "docs.txt"
    path.write_text(DOCS * 30)
    assert tokenizer.document_end() == "</s>" and tokenizer.with_document_ends(DOCS) is DOCS
    open_corpus(path, tokenizer, progress=False)
    tokenizer.encode_file(path, tmp_path / "plain.tok", progress=False, allow_special=True)
    assert (tmp_path / "docs.txt.tok").read_bytes() == (tmp_path / "plain.tok").read_bytes()
    tokens = open_corpus(path, tokenizer, progress=False).tokens.tolist()
    assert tokens == tokenizer.encode(DOCS * 30, allow_special=True) and tokens.count(tokenizer.eos_id) == 90


def test_training_counts_the_documents_by_the_end_token_they_became(monkeypatch, tmp_path, capsys):
    """`train` with an imported tokenizer without `</s>` counts the documents closed by its end-of-text token."""
    tok = end_of_text_tokenizer(tmp_path)
    monkeypatch.setitem(PRESETS, "small", tiny_config(tok.vocab_size))
    monkeypatch.setitem(train.PRESET_HYPER, "small", dataclasses.replace(HYPER, steps=1, eval_every=1,
                                                                           sample_every=1, ckpt_every=1))
    path = tmp_path / "docs.txt"
    path.write_text(DOCS * 40)
    assert _train("--data", path, "--tokenizer", tmp_path / "byte-level.json", "--device", "cpu",
                  "--out", tmp_path / "m.bin") == 0
    printed = capsys.readouterr()
    assert "; 120 documents closed by <|endoftext|>" in printed.out + printed.err


def test_random_windows_resume_from_state(tokenizer, corpus):
    tokens = np.arange(1000) % 300
    original = RandomWindows(tokens, 3, 8, 2, seed=5)
    for _ in range(4):
        original.next()
    restored = RandomWindows(tokens, 3, 8, 2, seed=99)
    restored.load_state(json.loads(json.dumps(original.state())))
    for _ in range(3):
        inputs, targets = original.next()
        inputs_restored, targets_restored = restored.next()
        np.testing.assert_array_equal(inputs, inputs_restored)
        np.testing.assert_array_equal(targets, targets_restored)
    np.testing.assert_array_equal(targets[1][:, :-1], targets[0][:, 1:])  # head k's target is 1+k ahead
    np.testing.assert_array_equal(inputs[:, 1:], targets[0][:, :-1])


def test_learning_rate_schedule():
    hp = loop.Hyperparameters(steps=100, batch_size=1, lr=1.0, warmup=10, eval_every=1, sample_every=1, ckpt_every=1)
    lrs = [loop.lr_at(hp, s) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(x >= y for x, y in zip(lrs[9:], lrs[10:]))
    assert loop.lr_at(hp, 100) == pytest.approx(hp.min_lr_ratio)
    assert lrs[55] == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-2)


def test_learning_rate_holds_its_peak_before_a_late_decay():
    hp = loop.Hyperparameters(steps=100, batch_size=1, lr=1.0, warmup=10, eval_every=1, sample_every=1, ckpt_every=1,
                              min_lr_ratio=0.0, decay_frac=0.4)
    lrs = [loop.lr_at(hp, s) for s in range(101)]
    assert lrs[9:61] == [1.0] * 52                      # the peak until the last 40% of the steps
    assert lrs[80] == pytest.approx(0.5)                # halfway down the cosine
    assert all(x > y for x, y in zip(lrs[60:], lrs[61:])) and lrs[100] == 0.0


def test_ctrl_c_from_the_terminal_saves_and_exits_cleanly(corpus, tmp_path):
    """A real `nanoeuler train` process gets SIGINT mid-run: it saves a loadable checkpoint, exits 130,
    and prints no traceback."""
    import subprocess
    import sys
    from conftest import ROOT
    proc = subprocess.Popen([sys.executable, "-m", "nanoeuler", "train", "small", "--data", str(corpus),
                             "--batch-size", "2", "--steps", "100000", "--device", "cpu", "--out",
                             str(tmp_path / "s.bin")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    log = tmp_path / "s.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 3):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    step = checkpoint.load(tmp_path / "s.bin", with_opt=True).step
    assert step >= 3 and "continue with --resume" in out


def test_fit_asks_only_the_trainable_about_the_weights(corpus, tokenizer, tmp_path):
    """What trains is one seam: fit() reads the engine, the communicator, a step, the state for a checkpoint and
    the memory beside the engine from the Trainable, and nothing else of it (adapters, sharded weights plug in
    there: docs/training.md)."""
    from nanoeuler.model.engine import make_engine
    from nanoeuler.parallel.comm import SingleProcess
    from nanoeuler.train.objectives import CrossEntropy
    from nanoeuler.train.trainable import Trainable

    class Only:
        """The members fit() may use, delegated to a real Trainable; any other is an AttributeError."""
        __slots__ = ("engine", "comm", "calls", "real")

        def __init__(self, real):
            self.engine, self.comm, self.calls, self.real = real.engine, real.comm, [], real

        def step(self, lr, hyper, values):
            self.calls.append("step")
            return self.real.step(lr, hyper, values)

        def state(self):
            self.calls.append("state")
            return self.real.state()

        def save(self, *args):
            self.calls.append("save")
            return self.real.save(*args)

        def evaluating(self):
            return self.real.evaluating()

        def device_memory(self):
            return self.real.device_memory()

    cfg = tiny_config(tokenizer.vocab_size)
    data = open_corpus(corpus, tokenizer, progress=False)
    hp = dataclasses.replace(HYPER, steps=6, ckpt_every=5)
    trainable = Only(Trainable(make_engine(cfg, device="cpu", seed=0), hp, SingleProcess()))
    source = RandomWindows(data.train, hp.batch_size, cfg.context, cfg.mtp_heads, seed=0)
    validation = loop.Validation(*(eval_batches(data.val, data.byte_len, hp.batch_size, cfg.context, cfg.mtp_heads,
                                                limit=2) for _ in range(2)))
    job = loop.Job(hp, tokenizer, source, validation, CrossEntropy(), str(tmp_path / "t.bin"),
                   str(tmp_path / "t.jsonl"))
    assert loop.fit(job, trainable) == 0
    assert trainable.calls == ["step"] * 5 + ["state", "save", "step", "state", "save"]  # checkpoints at steps 5, 6
    assert checkpoint.load(tmp_path / "t.bin", with_opt=True).train_state["opt_step"] == 6


def test_gradient_norm_accumulates_in_float64():
    from nanoeuler.model.cpu import layers as cpu_layers
    x = np.random.default_rng(0).standard_normal(3_000_001).astype(np.float32)  # not a multiple of a chunk
    exact = math.fsum((x.astype(np.float64) ** 2).tolist())  # float32 squares are exact in float64
    assert cpu_layers.sum_squares(x) == pytest.approx(exact, rel=1e-12)
    assert cpu_layers.sum_squares(x.astype(np.float64)) == pytest.approx(exact, rel=1e-12)
    assert cpu_layers.sum_squares(x[:0]) == 0.0 and cpu_layers.sum_squares(np.float32([3, 4])) == 25.0
    # the ranks' sum and its squares in one call (in place), as the copy engines' reduction takes them
    a, b = x.copy(), x[::-1].copy()
    squares = cpu_layers.add_sum_squares(a, a, b)
    np.testing.assert_array_equal(a, x + x[::-1])
    assert squares == cpu_layers.sum_squares(x + x[::-1])


def test_device_rule(monkeypatch):
    """--device auto: the CPU for models of at most device.CPU_MAX_PARAMS parameters, else the GPU when
    there is one; the same rule for train and sft."""
    small_4096 = dataclasses.replace(PRESETS["small"], vocab_size=4096)
    assert param_count(small_4096) <= device.CPU_MAX_PARAMS < param_count(PRESETS["big"])
    monkeypatch.setattr(device, "gpu_available", lambda: True)
    assert [device.resolve("auto", PRESETS[p]) for p in ("small", "big", "base")] == ["cpu", "gpu", "gpu"]
    assert device.resolve("auto", small_4096) == "cpu" and device.resolve("auto") == "gpu"  # inference
    assert device.resolve("cpu", PRESETS["base"]) == "cpu"
    monkeypatch.setattr(device, "gpu_available", lambda: False)
    assert device.resolve("auto", PRESETS["base"]) == "cpu"
    with pytest.raises(UserError, match="no CUDA GPU"):
        device.resolve("gpu", PRESETS["small"])


def test_train_and_sft_resolve_the_device_by_the_model(monkeypatch, corpus, tiny_ckpt, tmp_path):
    from nanoeuler.train import run, sft
    seen = []

    def spy(dev, cfg=None):
        seen.append((dev, cfg))
        raise UserError("stop here")
    monkeypatch.setattr(run, "resolve", spy)  # the one call, in the shared skeleton (train/run.py)
    for module, args in ((train, ["train", "big", "--data", corpus]), (sft, ["sft", "--ckpt", tiny_ckpt])):
        with pytest.raises(UserError, match="stop here"):
            module.main(build_parser()[0].parse_args([*map(str, args), "--out", str(tmp_path / "o.bin")]))
    assert seen == [("auto", PRESETS["big"]), ("auto", checkpoint.load(tiny_ckpt).cfg)]
