"""`sft|dpo --lora R` end to end on the CPU: the adapters learn, their checkpoint is small and names its base,
every command reads it merged, exact resume and Ctrl-C with dropout and --recompute, PEFT's folder in and
out of the commands, DPO's adapters over SFT's, and bad input as one line, exit 2 and nothing written."""
import dataclasses
import json
import os

import numpy as np
import pytest

from conftest import run_cli
from nanoeuler.data import instructions
from nanoeuler.io import checkpoint, peft as peft_io
from nanoeuler.model import lora
from nanoeuler.model.config import Config, float_params, views
from nanoeuler.model.quantize import dequantize
from nanoeuler.model.engine import make_engine
from nanoeuler.train import sft, dpo
from test_sft import GREETINGS, SFT_FLAGS, _cli, _main, pipeline  # noqa: F401 (the fixture)
from test_train import _interrupt_at

LORA = ["--steps", 40, "--batch-size", 8, "--lr", 1e-2, "--eval-every", 20, "--sample-every", 40, "--ckpt-every", 40]
PAIRS = [{"prompt": f"Greet {name}.", "chosen": f"Hello, {name}!", "rejected": "Go away."}
         for name in ("Romeo", "Kate", "Bob", "Ann", "Tom", "Sue")]


@pytest.fixture(scope="module")
def lora_chat(pipeline):  # noqa: F811
    """The pipeline's pretrained model fine-tuned with --lora 8 on the greetings (the adapters alone saved)."""
    out = pipeline["dir"] / "lora_chat.bin"
    assert _main(sft, "sft", "--ckpt", pipeline["base"], "--out", out, "--lora", 8, *LORA, *SFT_FLAGS) == 0
    return out


def test_lora_sft_learns_and_saves_the_adapters_alone(pipeline, lora_chat):  # noqa: F811
    ack = checkpoint.load_adapters(lora_chat, with_opt=True)
    base = checkpoint.load(pipeline["base"])
    assert ack.spec == lora.LoraSpec(8, 16.0, 0.0, lora.TARGETS) and ack.step == 40 and ack.chat
    assert ack.base == os.path.abspath(pipeline["base"]) and ack.fingerprint == checkpoint.adapter_fingerprint(base.params)
    assert os.path.getsize(lora_chat) < 0.3 * os.path.getsize(pipeline["base"])
    log = [json.loads(line) for line in open(pipeline["dir"] / "lora_chat.jsonl")]
    # on this barely pretrained 0.1M model the frozen features carry little: the adapters learn, slower than
    # full fine-tuning
    assert log[-1]["loss"] < 0.95 * log[0]["loss"] and log[-1]["val_loss"] < log[19]["val_loss"]
    # read anywhere else as the base with the adapters merged: what the live adapters compute
    merged = checkpoint.load(lora_chat)
    assert merged.chat and merged.step == 40 and not np.array_equal(merged.params, base.params)
    live = make_engine(base.cfg, training=False)
    live.load_params(base.params)
    lora.attach(live, ack.spec, ack.params)
    eng = make_engine(base.cfg, training=False)
    eng.load_params(merged.params)
    ids = np.array([merged.tokenizer().encode("Greet Romeo. Hello, Romeo!")], dtype=np.int32)
    assert np.allclose(eng.logits(ids), live.logits(ids), atol=1e-4)


def test_adapters_through_peft_folders_and_the_inference_commands(pipeline, lora_chat, tmp_path):  # noqa: F811
    r = run_cli("export", "--peft", tmp_path / "peft", "--ckpt", lora_chat)
    assert r.returncode == 0 and "adapters" in r.stdout, r.stderr
    seeded = ["--device", "cpu", "--temperature", 1, "--top-p", 1, "--seed", 3, "--max-new-tokens", 24]
    merged = run_cli("infer", "Greet Romeo.", "--ckpt", lora_chat, *seeded)
    through = run_cli("infer", "Greet Romeo.", "--ckpt", pipeline["base"], "--adapter", tmp_path / "peft", *seeded)
    plain = run_cli("infer", "Greet Romeo.", "--ckpt", pipeline["base"], *seeded)
    assert merged.returncode == through.returncode == 0, merged.stderr + through.stderr
    assert merged.stdout == through.stdout != plain.stdout
    # export of the adapter checkpoint: the merged model (--merge accepted, and implied)
    r = run_cli("export", "--hf", tmp_path / "hf", "--ckpt", lora_chat, "--merge")
    assert r.returncode == 0, r.stderr
    # sft --adapter DIR goes on from the PEFT folder
    out = tmp_path / "more.bin"
    assert _main(sft, "sft", "--ckpt", pipeline["base"], "--adapter", tmp_path / "peft", "--out", out, "--steps", 2,
                 "--batch-size", 4, "--eval-every", 2, "--sample-every", 2, *SFT_FLAGS) == 0
    assert checkpoint.load_adapters(out).spec.rank == 8


def test_lora_resume_after_interrupt_is_bit_identical(pipeline, tmp_path, monkeypatch):  # noqa: F811
    common = ["--ckpt", pipeline["base"], "--steps", 10, "--batch-size", 4, "--lr", 3e-3, "--eval-every", 4,
              "--sample-every", 6, "--ckpt-every", 5, "--lora", 4, "--lora-dropout", 0.1, "--lora-targets", "q,v,down",
              "--recompute", *SFT_FLAGS]
    assert _main(sft, "sft", "--out", tmp_path / "a.bin", *common) == 0
    with monkeypatch.context() as m:
        _interrupt_at(m, 7, instructions.ExampleBatches)
        assert _main(sft, "sft", "--out", tmp_path / "b.bin", *common) == 130
    assert checkpoint.load_adapters(tmp_path / "b.bin").step == 7
    assert _main(sft, "sft", "--resume", "--out", tmp_path / "b.bin", "--device", "cpu", "--recompute") == 0
    full, resumed = ([json.loads(line) for line in open(tmp_path / f"{n}.jsonl")] for n in "ab")
    assert [r["step"] for r in resumed] == list(range(1, 11))
    for record, record_resumed in zip(full, resumed):
        for key in ("loss", "lr", "grad_norm", "val_loss"):
            assert record.get(key) == record_resumed.get(key), (record["step"], key)
    a, b = (checkpoint.load_adapters(tmp_path / f"{n}.bin", with_opt=True) for n in "ab")
    np.testing.assert_array_equal(a.params, b.params)
    np.testing.assert_array_equal(a.opt[1], b.opt[1])
    assert a.spec == b.spec == lora.LoraSpec(4, 8.0, 0.1, ("q", "v", "down"))


def test_dpo_lora_over_sft_lora(pipeline, lora_chat, tmp_path):  # noqa: F811
    """DPO's adapters over SFT's: the base is the SFT adapter checkpoint (read merged), the reference it
    without DPO's adapters; the result reads as both merged."""
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    out = tmp_path / "dpo.bin"
    assert _main(dpo, "dpo", "--ckpt", lora_chat, "--data", tmp_path / "pairs.jsonl", "--out", out, "--lora", 4,
                 "--steps", 4, "--batch-size", 2, "--lr", 1e-2, "--eval-every", 2, "--sample-every", 4, "--rpo-alpha", 0,
                 "--val-pairs", 2, "--device", "cpu") == 0
    ack = checkpoint.load_adapters(out)
    assert ack.base == os.path.abspath(lora_chat)
    sft_merged, dpo_merged = checkpoint.load(lora_chat), checkpoint.load(out)
    assert np.allclose(dpo_merged.params, lora.merge(ack.cfg, sft_merged.params, ack.spec, ack.params))
    log = [json.loads(line) for line in open(tmp_path / "dpo.jsonl")]
    assert log[0]["loss"] == pytest.approx(np.log(2), rel=1e-3)  # fresh adapters: the policy is the reference


@pytest.mark.parametrize("flags,needle", [
    (["--lora", 0], "at least 1"),
    (["--lora", 4, "--lora-targets", "q,w_q"], "unknown w_q"),
    (["--lora", 100], "rank at most"),
    (["--lora-dropout", 0.1], "needs --lora"),
    (["--lora", 4, "--zero", 1], "LoRA's adapters keep theirs whole"),
])
def test_bad_lora_flags_are_one_line(flags, needle, pipeline, tmp_path, capsys):  # noqa: F811
    status, _, err = _cli(capsys, "sft", "--ckpt", pipeline["base"], "--out", tmp_path / "x.bin", *flags, *SFT_FLAGS)
    assert status == 2 and needle in err and err.count("\n") == 1, err
    assert not os.listdir(tmp_path)


def test_an_adapter_for_another_base_is_refused(pipeline, tmp_path, capsys):  # noqa: F811
    cfg = checkpoint.load(pipeline["base"]).cfg
    other = Config(**{**cfg.__dict__, "hidden": cfg.hidden + 32})
    spec = lora.make_spec(other, 4)
    peft_io.write(tmp_path / "other", other, spec, lora.init_adapters(other, spec))
    for argv in (["sft", "--ckpt", pipeline["base"], "--out", tmp_path / "x.bin", "--adapter", tmp_path / "other",
                  *SFT_FLAGS],
                 ["infer", "hi", "--ckpt", pipeline["base"], "--adapter", tmp_path / "other", "--device", "cpu"]):
        status, _, err = _cli(capsys, *argv)
        assert status == 2 and "another base" in err and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == ["other"]


def test_recompute_trains_the_same_bits(pipeline, tmp_path):  # noqa: F811
    """--recompute on a full fine-tuning run, bare (auto: mlp, which fits) and `layer`: the same weights and log,
    bit for bit, as without it."""
    common = ["--ckpt", pipeline["base"], "--steps", 3, "--batch-size", 4, "--eval-every", 3, "--sample-every", 3,
              *SFT_FLAGS]
    assert _main(sft, "sft", "--out", tmp_path / "a.bin", *common) == 0
    assert _main(sft, "sft", "--out", tmp_path / "b.bin", "--recompute", *common) == 0
    assert _main(sft, "sft", "--out", tmp_path / "c.bin", "--recompute", "layer", *common) == 0
    a, b, c = (checkpoint.load(tmp_path / f"{n}.bin") for n in "abc")
    np.testing.assert_array_equal(a.params, b.params)
    np.testing.assert_array_equal(a.params, c.params)
    logs = [[json.loads(line)["loss"] for line in open(tmp_path / f"{n}.jsonl")] for n in "abc"]
    assert logs[0] == logs[1] == logs[2]


def test_recompute_flag_takes_a_mode_or_none():
    """--recompute alone is auto, with a mode that mode, absent False; an unknown mode is argparse's one line."""
    from nanoeuler import cli
    parse = cli.build_parser()[0].parse_args
    assert parse(["sft", "--recompute"]).recompute == "auto"
    assert parse(["train", "small", "--recompute"]).recompute == "auto"
    modes = ("mlp", "products", "layer")
    assert [parse(["dpo", "--recompute", m]).recompute for m in modes] == list(modes)
    assert parse(["sft"]).recompute is False
    with pytest.raises(SystemExit):
        parse(["sft", "--recompute", "attention"])
    # the flag alone before train's preset, as before it took a mode
    bare = parse(cli.bare_recompute(["train", "--recompute", "small"]))
    assert (bare.recompute, bare.preset) == ("auto", "small")
    assert cli.bare_recompute(["sft", "--recompute", "mlp"]) == ["sft", "--recompute", "mlp"]


def test_lora_on_two_ranks_is_one_rank_at_twice_the_batch(pipeline, tmp_path):  # noqa: F811
    """--gpus 2 (two CPU processes): the adapters' gradients summed over the ranks, the frozen base never; the
    losses of one rank at the global batch, to float32 rounding."""
    common = ["--ckpt", pipeline["base"], "--steps", 3, "--eval-every", 3, "--sample-every", 3, "--lora", 4,
              *map(str, SFT_FLAGS)]
    r = run_cli("sft", "--out", tmp_path / "two.bin", "--gpus", 2, "--batch-size", 4, *common)
    assert r.returncode == 0, r.stderr
    assert _main(sft, "sft", "--out", tmp_path / "one.bin", "--batch-size", 8, *common) == 0
    two, one = ([json.loads(line)["loss"] for line in open(tmp_path / f"{n}.jsonl")] for n in ("two", "one"))
    np.testing.assert_allclose(two, one, rtol=1e-5)
    np.testing.assert_allclose(checkpoint.load_adapters(tmp_path / "two.bin").params, checkpoint.load_adapters(tmp_path / "one.bin").params,
                               atol=1e-5)


@pytest.fixture(scope="module")
def int4_base(pipeline):  # noqa: F811
    """The pipeline's pretrained model quantized to int4 (groups of 32): QLoRA's base."""
    out = pipeline["dir"] / "base_int4.bin"
    r = run_cli("quantize", "--ckpt", pipeline["base"], "--out", out, "--type", "int4")
    assert r.returncode == 0, r.stderr
    return out


def test_qlora_sft_learns_resumes_and_reads_merged(pipeline, int4_base, tmp_path, monkeypatch, capsys):  # noqa: F811
    """sft --lora on a quantized base: the base stays int4 (its products and the input gradients through it
    dequantized), the adapters learn, resume is exact; full training of it is refused in one line."""
    common = ["--ckpt", int4_base, "--steps", 10, "--batch-size", 4, "--lr", 1e-2, "--eval-every", 5,
              "--sample-every", 10, "--ckpt-every", 5, "--lora", 4, "--lora-dropout", 0.1, *SFT_FLAGS]
    assert _main(sft, "sft", "--out", tmp_path / "a.bin", *common) == 0
    with monkeypatch.context() as m:
        _interrupt_at(m, 7, instructions.ExampleBatches)
        assert _main(sft, "sft", "--out", tmp_path / "b.bin", *common) == 130
    assert _main(sft, "sft", "--resume", "--out", tmp_path / "b.bin", "--device", "cpu") == 0
    full, resumed = ([json.loads(line) for line in open(tmp_path / f"{n}.jsonl")] for n in "ab")
    assert full[-1]["loss"] < 0.98 * full[0]["loss"] and full[-1]["val_loss"] < full[4]["val_loss"]
    for record, record_resumed in zip(full, resumed):
        for key in ("loss", "grad_norm", "val_loss"):
            assert record.get(key) == record_resumed.get(key), (record["step"], key)
    a, b = (checkpoint.load_adapters(tmp_path / f"{n}.bin", with_opt=True) for n in "ab")
    np.testing.assert_array_equal(a.params, b.params)
    base = checkpoint.load(int4_base)
    assert a.cfg.quant == "int4" and a.fingerprint == checkpoint.adapter_fingerprint(base.params, base.quantized)
    # read elsewhere as the base with the adapters merged and quantized again (int4): each merged weight within
    # half a step of its group (and the float16 rounding of the step and the minimum) of the float merge
    # W + (alpha / r) B A
    merged = checkpoint.load(tmp_path / "a.bin")
    assert merged.cfg.quant == "int4" and np.array_equal(merged.params, base.params)
    fcfg, fparams = float_params(base.cfg, base.params, base.quantized)
    floats = views(lora.merge(fcfg, fparams, a.spec, a.params), fcfg)
    for name, qt in merged.quantized.items():
        if name.startswith("heads"):
            assert np.array_equal(qt.q, base.quantized[name].q)
            continue
        step = np.repeat(qt.scales.astype(np.float32), qt.group, axis=1)
        error = np.abs(dequantize(qt) - floats[name])
        assert (error <= 0.5 * step + 16 * 2.0 ** -11 * (step + np.abs(floats[name]).max())).all(), name
        assert not np.array_equal(qt.q, base.quantized[name].q), name
    r = run_cli("infer", "Greet Romeo.", "--ckpt", tmp_path / "a.bin", "--device", "cpu", "--max-new-tokens", 4)
    assert r.returncode == 0, r.stderr
    # full training of a quantized checkpoint: one line, nothing written
    capsys.readouterr()
    status, _, err = _cli(capsys, "sft", "--ckpt", int4_base, "--out", tmp_path / "x.bin", *SFT_FLAGS)
    assert status == 2 and "full training needs float weights" in err and err.count("\n") == 1, err
    assert not (tmp_path / "x.bin").exists()


def test_qlora_dpo_and_the_peft_export(pipeline, int4_base, tmp_path):  # noqa: F811
    """dpo --lora on a quantized base (the reference is the base without adapters: the first loss is log 2);
    export --peft writes the adapters for the base's export --hf (its dequantized floats)."""
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    out = tmp_path / "dpo.bin"
    assert _main(dpo, "dpo", "--ckpt", int4_base, "--data", tmp_path / "pairs.jsonl", "--out", out, "--lora", 4,
                 "--steps", 3, "--batch-size", 2, "--lr", 1e-2, "--eval-every", 3, "--sample-every", 3,
                 "--rpo-alpha", 0, "--val-pairs", 2, "--device", "cpu") == 0
    log = [json.loads(line) for line in open(tmp_path / "dpo.jsonl")]
    assert log[0]["loss"] == pytest.approx(np.log(2), rel=1e-3)
    ack = checkpoint.load_adapters(out)
    r = run_cli("export", "--peft", tmp_path / "peft", "--ckpt", out)
    assert r.returncode == 0, r.stderr
    spec, values = peft_io.read(tmp_path / "peft", ack.cfg)
    assert spec.rank == 4 and np.allclose(values, ack.params)
    # export --hf: the adapters merged in float into the base's dequantized weights (no second quantization)
    r = run_cli("export", "--hf", tmp_path / "hf", "--ckpt", out)
    assert r.returncode == 0, r.stderr
    from safetensors.numpy import load_file
    base = checkpoint.load(int4_base)
    cfg, floats = float_params(base.cfg, base.params, base.quantized)
    want = views(lora.merge(cfg, floats, ack.spec, ack.params), cfg)["layers.1.w_down"]
    got = load_file(tmp_path / "hf" / "model.safetensors")["model.layers.1.mlp.down_proj.weight"]
    assert not np.array_equal(want, views(floats, cfg)["layers.1.w_down"]) and np.array_equal(got, want)
