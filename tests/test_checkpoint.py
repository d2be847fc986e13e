"""Checkpoints: the safetensors layout of docs/design.md, validation of bad files, and atomic writes (of
nanoeuler/files.py, which every file nanoeuler writes goes through)."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from safetensors.numpy import load_file, save as serialize

from nanoeuler import files
from nanoeuler.io import checkpoint
from nanoeuler.model.config import Config, init_params, param_count, param_shapes
from nanoeuler.errors import UserError

CFG = Config(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden=64, vocab_size=300, context=16, mtp_heads=2)
TOK = json.dumps({"stand-in": "the checkpoint stores the tokenizer JSON as an opaque string"})


def _save(path, seed=0, **kw):
    params = init_params(CFG, seed)
    checkpoint.save(path, CFG, params, TOK, step=7, **kw)
    return params


def test_round_trip_with_optimizer_state(tmp_path):
    path = tmp_path / "a.bin"
    rng = np.random.default_rng(1)
    m, v = rng.normal(size=(2, param_count(CFG))).astype(np.float32)
    state = {"kind": "pretrain", "source": {"rng": np.random.default_rng(3).bit_generator.state}}
    params = _save(path, opt=(m, v), train_state=state, chat=True)
    ck = checkpoint.load(path, with_opt=True)
    assert ck.cfg == CFG and ck.step == 7 and ck.chat and ck.tokenizer_json == TOK
    assert ck.train_state == state  # the PCG64 state's 128-bit integers survive JSON exactly
    np.testing.assert_array_equal(ck.params, params)
    np.testing.assert_array_equal(ck.opt[0], m)
    np.testing.assert_array_equal(ck.opt[1], v)


def test_plain_safetensors_readers_see_the_design_layout(tmp_path):
    path = tmp_path / "a.bin"
    params = _save(path)
    tensors = load_file(path)
    assert set(tensors) == {name for name, _ in param_shapes(CFG)}
    assert tensors["layers.1.wk"].shape == (CFG.n_kv_heads * CFG.head_dim, CFG.dim)
    np.testing.assert_array_equal(tensors["tok_emb"].ravel(), params[:CFG.vocab_size * CFG.dim])
    meta = checkpoint.read_metadata(path)
    assert meta["format"] == "nanoeuler" and meta["step"] == "7" and meta["chat"] == "0"
    assert Config.from_json(meta["config"]) == CFG
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden", "vocab_size", "context", "mtp_heads"):
        assert key in json.loads(meta["config"])


def test_missing_checkpoint(tmp_path):
    with pytest.raises(UserError, match="not found"):
        checkpoint.load(tmp_path / "nope.bin")


@pytest.mark.parametrize("keep", [0, 5, 8, 40, -100, -1])
def test_truncated_checkpoint(tmp_path, keep):
    path = tmp_path / "a.bin"
    _save(path)
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:len(data) + keep])
    with pytest.raises(UserError, match="truncated|not a checkpoint|corrupt"):
        checkpoint.load(path)


def test_garbage_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(UserError, match="corrupt|truncated"):
        checkpoint.load(path)


def test_unreadable_header(tmp_path):
    path = tmp_path / "a.bin"
    header = b"{not json" + b" " * 7
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(UserError, match="unreadable header"):
        checkpoint.load(path)


def test_foreign_safetensors_file(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(serialize({"w": np.zeros(3, np.float32)}))
    with pytest.raises(UserError, match="not a nanoeuler checkpoint"):
        checkpoint.load(path)


def _rewrite(path, tensors, **meta_changes):
    meta = checkpoint.read_metadata(path)
    meta.update(meta_changes)
    path.write_bytes(serialize(tensors, metadata=meta))


@pytest.mark.parametrize("name,change,message", [
    ("layers.0.w_up", lambda t: np.zeros((CFG.hidden + 1, CFG.dim), np.float32), "layers.0.w_up has shape"),
    ("layers.1.wq", lambda t: t.astype(np.float16), "corrupt .tensor layers.1.wq is F16, not float32")])
def test_tensor_that_disagrees_with_the_config(tmp_path, name, change, message):
    """A tensor of another shape than the config's, or of another dtype than float32."""
    path = tmp_path / "a.bin"
    _save(path)
    tensors = load_file(path)
    tensors[name] = change(tensors[name])
    _rewrite(path, tensors)
    with pytest.raises(UserError, match=message):
        checkpoint.load(path)


def test_config_claims_more_layers_than_the_file_has(tmp_path):
    path = tmp_path / "a.bin"
    _save(path)
    bigger = Config(**{**json.loads(CFG.to_json()), "n_layers": 3})
    _rewrite(path, load_file(path), config=bigger.to_json())
    with pytest.raises(UserError, match="no tensor layers.2"):
        checkpoint.load(path)


def test_no_optimizer_state_to_resume(tmp_path):
    path = tmp_path / "a.bin"
    _save(path)
    checkpoint.load(path)
    with pytest.raises(UserError, match="no optimizer state"):
        checkpoint.load(path, with_opt=True)


def test_non_finite_weights(tmp_path):
    path = tmp_path / "a.bin"
    params = init_params(CFG)
    params[5] = np.nan
    checkpoint.save(path, CFG, params, TOK, step=1)
    with pytest.raises(UserError, match="non-finite"):
        checkpoint.load(path)


def test_save_interrupted_mid_write_leaves_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "a.bin"
    old = _save(path, seed=0)

    def write_half_then_interrupt(path, write, mode="wb"):
        real_atomic_write(path, lambda f: (f.write(b"\0" * 1000), f.flush(), _raise()), mode)

    def _raise():
        raise KeyboardInterrupt

    real_atomic_write = checkpoint.atomic_write
    monkeypatch.setattr(checkpoint, "atomic_write", write_half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        _save(path, seed=1)
    np.testing.assert_array_equal(checkpoint.load(path).params, old)
    assert os.listdir(tmp_path) == ["a.bin"]  # the temporary file was cleaned up


def test_process_killed_during_save_leaves_old_checkpoint(tmp_path):
    """A real crash: the saving process is SIGKILLed after writing all the new bytes, before the rename."""
    path = tmp_path / "a.bin"
    old = _save(path, seed=0)
    script = textwrap.dedent(f"""
        import os, signal
        from nanoeuler.io import checkpoint
        from nanoeuler.model.config import init_params
        from tests.test_checkpoint import CFG, TOK
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
        checkpoint.save({str(path)!r}, CFG, init_params(CFG, 1), TOK, step=8)
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()
    leftovers = [p for p in os.listdir(tmp_path) if p != "a.bin"]
    assert leftovers and all(".tmp" in p for p in leftovers)  # the new bytes never took the real name
    ck = checkpoint.load(path)
    assert ck.step == 7
    np.testing.assert_array_equal(ck.params, old)


def test_unwritable_destination(tmp_path):
    with pytest.raises(UserError, match="cannot write"):
        _save(tmp_path / "no" / "such" / "dir.bin")
    with pytest.raises(UserError, match="cannot write"):
        files.check_writable(tmp_path / "missing_dir" / "x.bin")
    with pytest.raises(UserError, match="directory"):
        files.check_writable(tmp_path)
    files.check_writable(tmp_path / "fine.bin")
    assert os.listdir(tmp_path) == []  # the probe leaves nothing behind


def test_atomic_output_keeps_the_extension_and_replaces_only_on_success(tmp_path):
    path = tmp_path / "web.txt"
    path.write_bytes(b"old")
    with files.atomic_output(path) as f:
        f.write(b"new")
        temp = os.path.basename(f.name)
        assert path.read_bytes() == b"old"  # not yet: the block is still writing its temporary
    assert temp == f"web.tmp{os.getpid()}.txt"  # *.txt ignore rules cover it too
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["web.txt"]
    # an exception in the block propagates as it is (an OSError stays an OSError), and nothing changes
    for error in (OSError(28, "No space left on device"), KeyboardInterrupt()):
        with pytest.raises(type(error)):
            with files.atomic_output(path, "w") as f:
                f.write("half")
                raise error
        assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["web.txt"]


def test_atomic_write_turns_os_errors_into_one_line(tmp_path):
    def fail(f):
        f.write(b"part")
        raise OSError(28, "No space left on device")
    with pytest.raises(UserError, match=r"cannot write .*x\.json: No space left on device"):
        files.atomic_write(tmp_path / "x.json", fail)
    with pytest.raises(UserError, match="cannot write"):
        files.atomic_write(tmp_path / "no" / "x.json", lambda f: f.write(b"{}"))
    assert os.listdir(tmp_path) == []
    files.atomic_write(tmp_path / "x.json", lambda f: f.write("{}"), mode="w")
    assert (tmp_path / "x.json").read_text() == "{}"


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path):
    """A run killed between writing and renaming leaves `<name>.tmp<pid>.bin`: the next start removes those of
    processes that no longer exist, and leaves a live process's and every other file alone."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    names = [f"nanoeuler.tmp{dead}.bin", f"nanoeuler.tmp{os.getpid()}.bin", "nanoeuler.bin", "other.tmp1.bin",
             "nanoeuler.tmpx.bin"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert files.remove_stale_temporaries(tmp_path / "nanoeuler.bin") == [f"nanoeuler.tmp{dead}.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])
