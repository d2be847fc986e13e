"""Shared fixtures: a tiny corpus, tokenizer, config and checkpoint, so the training, sampling, export and
CLI tests run in seconds (dim 32, 2 layers, context 32)."""
import os
import subprocess
import sys

import pytest

from nanoeuler.io import checkpoint
from nanoeuler.model.config import Config, init_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --------------------------------------------------------------------------------- strict skips
# With NANOEULER_STRICT_SKIPS=1 (`make test`, hence CI, sets it) a skipped test fails the run unless it is
# marked gpu, or marked with an optional tool of OPTIONAL_TOOLS while its variable is unset: browser (no
# Chromium: installing it needs root, which a user's machine may not give; .ci/run sets
# NANOEULER_REQUIRE_BROWSER, so CI runs the browser test or fails), llamacpp (no llama-cpp-python: its build
# takes half an hour on 2 cores, docs/gguf.md). A missing library or tool must not pass for a green run. The
# skips are listed at the end, allowed ones too.
def _flag(name):
    return os.environ.get(name, "0") not in ("", "0")


STRICT_SKIPS = _flag("NANOEULER_STRICT_SKIPS")
OPTIONAL_TOOLS = {"browser": "NANOEULER_REQUIRE_BROWSER", "llamacpp": "NANOEULER_REQUIRE_LLAMACPP"}
ALLOWED_TOOLS = tuple(mark for mark, variable in OPTIONAL_TOOLS.items() if not _flag(variable))
ALLOWED_MARKS = ("gpu",) + ALLOWED_TOOLS
_bad_skips, _allowed_tool_skips = [], []


def _record_skip(report):
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    skip = (report.nodeid, reason.removeprefix("Skipped: "))
    keywords = getattr(report, "keywords", {})
    if any(mark in keywords for mark in ALLOWED_TOOLS):
        _allowed_tool_skips.append(skip)
    elif not any(mark in keywords for mark in ALLOWED_MARKS):
        _bad_skips.append(skip)


def pytest_runtest_logreport(report):
    _record_skip(report)


def pytest_collectreport(report):  # a module skipped whole, at import
    _record_skip(report)


def pytest_sessionfinish(session, exitstatus):
    if STRICT_SKIPS and _bad_skips and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _allowed_tool_skips:
        terminalreporter.section(f"{len(_allowed_tool_skips)} test(s) of an optional tool skipped, allowed ("
                                 + ", ".join(f"{v}=1" for m, v in OPTIONAL_TOOLS.items() if m in ALLOWED_TOOLS)
                                 + " makes such a skip a failure)", yellow=True)
        for nodeid, reason in _allowed_tool_skips:
            terminalreporter.line(f"{nodeid}: {reason}", yellow=True)
    if STRICT_SKIPS and _bad_skips:
        terminalreporter.section(f"{len(_bad_skips)} skipped, not marked {' or '.join(ALLOWED_MARKS)}: the run "
                                 "fails (NANOEULER_STRICT_SKIPS=1)", red=True)
        for nodeid, reason in _bad_skips:
            terminalreporter.line(f"{nodeid}: {reason}", red=True)


def tiny_config(vocab_size, gpu=False):
    """A model of a few thousand parameters; gpu: heads of 32, the narrowest the GPU attention kernels take."""
    heads = dict(dim=64, n_heads=2, n_kv_heads=1) if gpu else dict(dim=32, n_heads=4, n_kv_heads=2)
    return Config(**heads, n_layers=2, hidden=64, vocab_size=vocab_size, context=32, mtp_heads=2)


def sharp_params(cfg, seed, scale, same_heads=False):
    """Parameters whose matrices are drawn N(0, scale): logits far from flat, so positions differ clearly and
    greedy decoding has no near-ties. same_heads: heads 1..K-1 are copies of head 0, so their speculative
    drafts repeat head 0's next token and are accepted wherever the text repeats a token (random heads' drafts
    almost never are)."""
    import numpy as np
    from nanoeuler.model.config import views
    flat = init_params(cfg, seed=seed)
    rng = np.random.default_rng(seed + 1)
    for name, view in views(flat, cfg).items():
        if not name.endswith("norm"):
            view[...] = rng.normal(0, scale, view.shape)
        if same_heads and name.startswith("heads."):
            view[...] = views(flat, cfg)["heads.0"]
    return flat


def run_cli(*args, cwd=None, **kw):
    """Run `python -m nanoeuler ARGS` in a subprocess; returns the CompletedProcess (text)."""
    return subprocess.run([sys.executable, "-m", "nanoeuler", *map(str, args)], cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The first ~120 KB of shakespeare.txt, plus bytes that are not UTF-8."""
    with open(os.path.join(ROOT, "shakespeare.txt"), "rb") as f:
        text = f.read(120_000)
    path = tmp_path_factory.mktemp("corpus") / "tiny.txt"
    path.write_bytes(text + b"\n\xff\xfe odd bytes \x00 and caf\xc3\xa9\n")
    return path


@pytest.fixture(scope="session")
def tokenizer(corpus):
    from nanoeuler.tokenizer.bpe import Tokenizer
    return Tokenizer.train(corpus, 300, progress=False)


@pytest.fixture(scope="session")
def tokenizer_file(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save_hf(path)
    return path


@pytest.fixture(scope="session")
def tiny_ckpt(tokenizer, tmp_path_factory):
    """A checkpoint of an untrained tiny model (random weights: fine for plumbing and exactness tests)."""
    cfg = tiny_config(tokenizer.vocab_size)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.bin"
    checkpoint.save(path, cfg, init_params(cfg, seed=3), tokenizer.to_json(), step=0)
    return path


# PyTorch and transformers are in the test extra; only the tests that compare with them skip without them
@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")

