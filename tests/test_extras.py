"""Every optional dependency that is missing is named in one line, with the extra that brings it, and the
command exits with status 2, never with a traceback: each one is made unimportable here (None in sys.modules,
as Python's import system reads it) in a `nanoeuler` process on the CPU."""
import os
import subprocess
import sys
import types

import pytest

from conftest import ROOT
from nanoeuler.errors import UserError


def blocked(modules, *argv, cwd=None, gpu=False):
    """Run `nanoeuler ARGV` in a subprocess where `modules` do not import; gpu: as on a machine with a GPU and
    the [gpu] extra's libraries (stand-ins, and the probe says yes) but those in `modules`."""
    setup = "import sys, types\n"
    if gpu:
        setup += "".join(f"sys.modules[{m!r}] = types.ModuleType({m!r})\n" for m in ("cupy", "cuda", "cuda.bindings",
                                                                                      "nvmath"))
        setup += "import nanoeuler.model.device as device\ndevice.gpu_available = lambda: True\n"
    setup += "".join(f"sys.modules[{m!r}] = None\n" for m in modules)
    code = setup + f"from nanoeuler.cli import main\nmain({[str(a) for a in argv]!r})\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                          env=dict(os.environ, PYTHONPATH=ROOT))


def one_line(r, message):
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr == f"nanoeuler: error: {message}\n", r.stderr


def test_no_cupy_with_device_gpu(tmp_path):
    one_line(blocked(["cupy"], "train", "--device", "gpu", "--out", tmp_path / "a.bin"),
             "--device gpu: no CUDA GPU found (the GPU engine needs CuPy: pip install -e '.[gpu]'); use --device cpu")


@pytest.mark.parametrize("module, package", [("cuda.bindings", "cuda-bindings"), ("nvmath", "nvmath-python")])
def test_no_gpu_bindings_when_training_on_the_gpu(module, package, tmp_path):
    """`nanoeuler train big` on a GPU machine without NVIDIA's bindings: one line before any work."""
    one_line(blocked([module], "train", "big", "--out", tmp_path / "a.bin", gpu=True),
             f"the GPU engine needs {package}: pip install -e '.[gpu]'")


def test_where_the_gpu_engine_imports_the_bindings_it_says_so_in_one_line(monkeypatch):
    """runtime.py imports cuda.bindings and nvmath where it first uses them: the same line there."""
    from nanoeuler.errors import require
    monkeypatch.setitem(sys.modules, "nvmath", None)
    with pytest.raises(UserError, match=r"^the GPU engine's cuBLAS products needs nvmath-python: pip install -e "
                                        r"'\.\[gpu\]'$"):
        require("nvmath.bindings.cublas", what="the GPU engine's cuBLAS products")
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))  # a namespace package of another library
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(UserError, match=r"needs cuda-bindings: pip install -e '\.\[gpu\]'$"):
        require("cuda.bindings.driver", what="the GPU engine's CUDA graphs")


def test_no_starlette_for_serve(tiny_ckpt):
    one_line(blocked(["starlette"], "serve", "--ckpt", tiny_ckpt), "nanoeuler serve needs Starlette: pip install -e "
             "'.[serve]'")


def test_no_gguf_for_export(tiny_ckpt, tmp_path):
    one_line(blocked(["gguf"], "export", "--gguf", tmp_path / "m.gguf", "--ckpt", tiny_ckpt),
             "export --gguf needs gguf: pip install -e '.[gguf]'")


def test_no_huggingface_hub_for_a_hub_id(tmp_path):
    one_line(blocked(["huggingface_hub"], "import", "--hf", "TestOwner/Tiny-Llama", "--out", tmp_path / "x.bin",
                     cwd=tmp_path),
             "--hf TestOwner/Tiny-Llama is not a directory, and a Hugging Face Hub id needs huggingface_hub: pip "
             "install -e '.[hub]'")
