"""Every bad input of docs/design.md ("Error handling") gets one line on stderr, a non-zero exit, no traceback
and no damage; and the command line's process setup (the CPU thread settings, made before NumPy loads)."""
import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from safetensors.numpy import load_file, save as serialize

from conftest import ROOT, run_cli
from nanoeuler.io import checkpoint
from nanoeuler.model.device import gpu_available


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


@pytest.mark.parametrize("args,missing", [
    (["train"], "corpus shakespeare.txt"), (["train", "base"], "corpus data/pretrain.txt"),
    (["sft", "--ckpt", "{ckpt}"], "instruction data data/alpaca.json"),
    (["dpo", "--ckpt", "{ckpt}"], "preference data data/preferences.jsonl"),
])
def test_default_data_missing_outside_the_clone_says_how_to_download_it(args, missing, tiny_ckpt, tmp_path):
    """Run where none of the default data files is (outside the clone), each training command names the
    fetcher command that writes that very file there, and --data; the fetcher has that command, writing there."""
    from nanoeuler.data.corpus import FETCH_COMMANDS
    from nanoeuler.data.fetch import build_parser

    args = [arg.format(ckpt=tiny_ckpt) for arg in args]
    r = run_cli(*args, "--out", tmp_path / "o.bin", "--device", "cpu", cwd=tmp_path)
    path = missing.split()[-1]
    _one_line_error(r, f"{missing} not found", f"download it with `{FETCH_COMMANDS[path]}`", "or pass --data FILE")
    assert os.listdir(tmp_path) == []
    fetch_args = build_parser().parse_args(FETCH_COMMANDS[path].split()[3:])
    assert fetch_args.out == path


def test_cpu_refuses_a_gpu_precision_before_any_work(corpus, tmp_path):
    r = run_cli("train", "--device", "cpu", "--precision", "bf16", "--data", corpus, "--out", tmp_path / "o.bin")
    _one_line_error(r, "--precision bf16", "fp32 only")
    assert os.listdir(tmp_path) == []


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


def test_a_rate_of_zero_is_refused_as_not_above_zero():
    _one_line_error(run_cli("train", "--lr", "-1"), "--lr", "must be a finite number > 0, got -1")


# ------------------------------------------------------------------------------------------ help


def _help(*args):
    from nanoeuler.cli import build_parser
    parser, sub = build_parser()
    return (sub.choices[args[0]] if args else parser).format_help()


def test_the_top_help_is_a_map_of_every_command():
    """`nanoeuler --help` lists every command (COMMANDS and OWN_COMMANDS) once, with its one-line help and what it
    reads and writes, in the pipeline's order."""
    from nanoeuler.cli import COMMANDS, OWN_COMMANDS, build_parser
    from nanoeuler.cli_help import FLOW

    r = run_cli("--help")
    assert r.returncode == 0
    _, sub = build_parser()
    assert set(sub.choices) == set(COMMANDS) | set(OWN_COMMANDS)
    listed = re.findall(r"(?m)^  ([a-z]+)  +\S", r.stdout)
    assert listed == [name for name in FLOW if name in sub.choices]
    for name, action in ((choice.dest, choice) for choice in sub._choices_actions):
        assert f"  {name}" in r.stdout and action.help in r.stdout and FLOW[name] in r.stdout
    assert "python -m nanoeuler.data.fetch" in r.stdout


def test_every_command_has_a_description_and_examples():
    from nanoeuler.cli import build_parser
    from nanoeuler.cli_help import GUIDE, actions

    _, sub = build_parser()
    for name in sub.choices:
        text = _help(name)
        description, examples = GUIDE[name]
        assert " ".join(description.split()) in " ".join(text.split()), name
        assert "examples:" in text and examples, name
        for line in examples:
            assert f"  {line}" in text and line.startswith(("nanoeuler ", "echo ")), line
        for summary, action in actions(sub.choices[name]):  # tokenizer train|encode|decode
            text = action.format_help()
            assert summary[1:] in text and f"examples:\n  {action.prog} " in text, action.prog


@pytest.mark.parametrize("command", ["train", "sft", "dpo"])
def test_training_help_shows_the_defaults_of_the_real_tables(command):
    """The table of `COMMAND -h` holds the values of the hyperparameter tables the runs use."""
    from nanoeuler.train.dpo import DPO_HYPER
    from nanoeuler.train.pretrain import DEFAULT_DATA, PRESET_HYPER
    from nanoeuler.train.sft import SFT_HYPER

    tables = {"train": PRESET_HYPER, "sft": {"sft": SFT_HYPER}, "dpo": DPO_HYPER}
    text = run_cli(command, "-h").stdout if command == "train" else _help(command)
    rows = {}
    lines = text[re.search(r"(?m)^defaults", text).start():].splitlines()
    header = lines[2].split()
    for line in lines[3:]:
        if not line.startswith("  ") or line.startswith("  ("):
            break
        label, *values = re.split(r"\s{2,}", line.strip())
        rows[label] = dict(zip(header, values))
    assert header == list(tables[command])
    for name, hp in tables[command].items():
        for label, field in (("--steps", "steps"), ("--batch-size", "batch_size"), ("--lr (peak)", "lr"),
                             ("warmup steps", "warmup"), ("--eval-every", "eval_every"),
                             ("--sample-every", "sample_every"), ("--ckpt-every", "ckpt_every"),
                             ("--grad-accum", "grad_accum")):
            assert float(rows[label][name]) == getattr(hp, field), (name, label)
        if command == "train":
            assert rows["--data"][name] == DEFAULT_DATA[name]


def test_version():
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip().startswith("nanoeuler ") and r.stdout.split()[1][0].isdigit()


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("command", ["train", "infer", "chat"])
def test_device_gpu_without_a_gpu(command, tiny_ckpt, corpus, tmp_path):
    args = {"train": ["train", "--data", corpus, "--out", tmp_path / "o.bin"],
            "infer": ["infer", "x", "--ckpt", tiny_ckpt], "chat": ["chat", "--ckpt", tiny_ckpt]}[command]
    _one_line_error(run_cli(*args, "--device", "gpu", input=""), "no CUDA GPU")
    assert not (tmp_path / "o.bin").exists()


def test_resume_with_nothing_to_resume(tmp_path):
    _one_line_error(run_cli("train", "--resume", "--out", tmp_path / "none.bin"), "nothing to resume")


@pytest.mark.parametrize("command", ["train", "sft", "dpo"])
def test_a_fresh_run_never_replaces_a_checkpoint_unasked(command, tiny_ckpt, corpus, tmp_path):
    """A fresh run whose --out holds a file refuses before any work; --out equal to --ckpt is refused even
    with --overwrite; the files stay as they were."""
    out = tmp_path / "kept.bin"
    out.write_bytes(b"a run's checkpoint")
    data = ["--data", corpus] if command == "train" else ["--ckpt", tiny_ckpt]
    _one_line_error(run_cli(command, *data, "--out", out, "--device", "cpu"), f"{out} exists", "--resume",
                    "--overwrite")
    assert out.read_bytes() == b"a run's checkpoint"
    if command != "train":
        before = _digest(tiny_ckpt)
        _one_line_error(run_cli(command, "--ckpt", tiny_ckpt, "--out", tiny_ckpt, "--overwrite", "--device", "cpu"),
                        "is the checkpoint this run starts from")
        assert _digest(tiny_ckpt) == before


# ------------------------------------------------------------------------------------------ process setup

SPY = textwrap.dedent("""
    import atexit, json, os, sys
    KEYS = ("OPENBLAS_THREAD_TIMEOUT", "GOMP_SPINCOUNT", "OPENBLAS_NUM_THREADS")
    seen = {}

    class Spy:  # notes the environment at the moment numpy and numba are first imported
        def find_spec(self, name, path=None, target=None):
            if name in ("numpy", "numba") and name not in seen:
                seen[name] = {k: os.environ.get(k) for k in KEYS}

    sys.meta_path.insert(0, Spy())

    report_path, sys.argv = sys.argv[1], ["nanoeuler"] + sys.argv[2:]

    def report():
        import numba
        with open(report_path, "w") as f:
            json.dump({"seen": seen, "layer": numba.threading_layer()}, f)

    atexit.register(report)
    from nanoeuler.cli import main  # what the `nanoeuler` script runs
    main()
""")


@pytest.mark.parametrize("user_timeout, threads", [(None, None), ("7", "1")])
def test_cli_sets_the_thread_settings_before_numpy_loads(tiny_ckpt, tmp_path, user_timeout, threads):
    """OpenBLAS reads OPENBLAS_THREAD_TIMEOUT only when NumPy loads it, and GNU OpenMP GOMP_SPINCOUNT when
    numba's pool starts: the command line sets both before either is imported (a user's own setting wins), and
    NUMBA_NUM_THREADS, where given, as OpenBLAS's threads; numba's pool is one whose loops start without waking
    sleeping threads (not workqueue)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_THREAD_TIMEOUT", "GOMP_SPINCOUNT", "NUMBA_THREADING_LAYER", "NUMBA_NUM_THREADS",
                        "OPENBLAS_NUM_THREADS")}
    if user_timeout:
        env["OPENBLAS_THREAD_TIMEOUT"] = user_timeout
    if threads:
        env["NUMBA_NUM_THREADS"] = threads
    report = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-c", SPY, str(report), "infer", "x", "--ckpt", str(tiny_ckpt),
                        "--device", "cpu", "--max-new-tokens", "2", "--seed", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(report.read_text())
    expected = {"OPENBLAS_THREAD_TIMEOUT": user_timeout or "4", "GOMP_SPINCOUNT": "1000",
                "OPENBLAS_NUM_THREADS": threads}
    assert got["seen"] == {"numpy": expected, "numba": expected}
    assert got["layer"] in ("omp", "tbb")  # the pool the CPU engine's kernels ran on
