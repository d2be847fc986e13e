"""Every bad input of DESIGN.md gets one line on stderr, a non-zero exit, no traceback and no damage."""
import hashlib

import numpy as np
import pytest
from safetensors.numpy import load_file, save as serialize

from conftest import run_cli
from nanoeuler import checkpoint
from nanoeuler.device import gpu_available


def _one_line_error(r, *needles):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.strip(), repr(r.stderr)
    for needle in needles:
        assert needle in r.stderr, r.stderr


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def bad_ckpts(tiny_ckpt, tmp_path):
    """name -> a damaged copy of the tiny checkpoint."""
    data = tiny_ckpt.read_bytes()
    files = {"corrupt": np.random.default_rng(0).bytes(len(data)), "truncated": data[:len(data) // 2],
             "header-only": data[:200]}
    tensors = load_file(tiny_ckpt)
    tensors["layers.1.wv"] = tensors["layers.1.wv"][:-1]  # one row short of what the config says
    files["disagrees"] = serialize(tensors, metadata=checkpoint.read_metadata(tiny_ckpt))
    paths = {}
    for name, content in files.items():
        paths[name] = tmp_path / f"{name}.bin"
        paths[name].write_bytes(content)
    return paths


@pytest.mark.parametrize("command", ["infer", "chat", "export", "train-resume"])
@pytest.mark.parametrize("damage,needle", [("corrupt", "corrupt"), ("truncated", "truncated"),
                                           ("header-only", "truncated"), ("disagrees", "layers.1.wv"),
                                           ("missing", "not found")])
def test_bad_checkpoint(command, damage, needle, bad_ckpts, tmp_path):
    path = bad_ckpts.get(damage, tmp_path / "missing.bin")
    before = _digest(path) if path.exists() else None
    args = {"infer": ["infer", "hi", "--ckpt", path], "chat": ["chat", "--ckpt", path],
            "export": ["export", "--hf", tmp_path / "hf", "--ckpt", path],
            "train-resume": ["train", "--resume", "--out", path]}[command]
    r = run_cli(*args, input="")
    _one_line_error(r, needle)
    assert (_digest(path) if path.exists() else None) == before
    assert not (tmp_path / "hf").exists()


def test_resume_a_checkpoint_without_training_state(tiny_ckpt, corpus, tmp_path):
    r = run_cli("train", "--resume", "--out", tiny_ckpt, "--data", corpus)
    _one_line_error(r, "no optimizer state")


def test_missing_corpus(tmp_path):
    _one_line_error(run_cli("train", "--data", tmp_path / "nope.txt", "--out", tmp_path / "o.bin"), "not found")
    assert not (tmp_path / "o.bin").exists()


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    _one_line_error(run_cli("train", "--data", tmp_path / "empty.txt", "--out", tmp_path / "o.bin"), "empty")


@pytest.mark.parametrize("out,log", [("nodir/o.bin", None), ("o.bin", "nodir/o.jsonl"), (".", None)])
def test_unwritable_output(out, log, corpus, tmp_path):
    args = ["train", "--data", corpus, "--out", tmp_path / out] + (["--log", tmp_path / log] if log else [])
    _one_line_error(run_cli(*args), "cannot write")


def test_export_to_unwritable_folder(tiny_ckpt, tmp_path):
    (tmp_path / "file").write_text("x")
    _one_line_error(run_cli("export", "--hf", tmp_path / "file" / "hf", "--ckpt", tiny_ckpt), "cannot create")


@pytest.mark.parametrize("args,needle", [
    (["train", "--steps", "0"], "--steps"), (["train", "--batch-size", "-3"], "--batch-size"),
    (["train", "--lr", "0"], "--lr"), (["train", "--lr", "nan"], "--lr"), (["train", "--seed", "x"], "--seed"),
    (["train", "huge"], "invalid choice"), (["train", "--device", "tpu"], "--device"),
    (["infer", "x", "--temperature", "-1"], "--temperature"), (["infer", "x", "--top-p", "0"], "--top-p"),
    (["infer", "x", "--top-p", "1.5"], "--top-p"), (["infer", "x", "--top-k", "-1"], "--top-k"),
    (["infer", "x", "--max-new-tokens", "-5"], "--max-new-tokens"), (["infer"], "prompt"),
    (["export"], "--hf"), (["chat", "--temperature", "inf"], "--temperature"),
])
def test_out_of_range_flags(args, needle):
    _one_line_error(run_cli(*args), needle)


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("command", ["train", "infer", "chat"])
def test_device_gpu_without_a_gpu(command, tiny_ckpt, corpus, tmp_path):
    args = {"train": ["train", "--data", corpus, "--out", tmp_path / "o.bin"],
            "infer": ["infer", "x", "--ckpt", tiny_ckpt], "chat": ["chat", "--ckpt", tiny_ckpt]}[command]
    _one_line_error(run_cli(*args, "--device", "gpu", input=""), "no CUDA GPU")
    assert not (tmp_path / "o.bin").exists()


def test_resume_with_nothing_to_resume(tmp_path):
    _one_line_error(run_cli("train", "--resume", "--out", tmp_path / "none.bin"), "nothing to resume")
