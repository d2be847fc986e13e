"""The GPU engine. The CUDA sources must compile with nvcc (runs wherever the CUDA toolkit is, GPU or not,
as in CI); everything else needs a CUDA GPU and is skipped without one: each kernel against its CPU layer,
the whole model's gradients against the CPU engine's, and a few training steps on both engines."""
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

import nanoeuler.gpu
from nanoeuler.gpu.check import FP32_TOL, KERNEL_CHECKS, TF32_TOL, _Case, model_check, tf32_model_error

KERNELS = pathlib.Path(nanoeuler.gpu.__file__).parent / "kernels"
needs_gpu = pytest.mark.skipif(not nanoeuler.gpu.available(),
                               reason="needs a CUDA GPU (compute capability 8.0+) and cupy")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (the CUDA toolkit) is not installed")
def test_cuda_sources_compile(tmp_path):
    """Every kernel file, in each variant layers.py builds, compiles to PTX for sm_80 (the oldest GPU the
    attention kernels' TF32 mma instructions run on)."""
    jobs = []
    for src in sorted(KERNELS.glob("*.cu")):
        for i, defines in enumerate([[]] + ([["-DATT_PRECISE=1"]] if src.stem == "attention" else [])):
            cmd = ["nvcc", "-arch=compute_80", "--ptx", "--std=c++17", f"-I{KERNELS}", *defines,
                   "-o", str(tmp_path / f"{src.stem}{i}.ptx"), str(src)]
            jobs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    for cmd, proc in jobs:
        output = proc.communicate()[0]
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{output}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("check", KERNEL_CHECKS, ids=lambda f: f.__name__[len("check_"):])
def test_kernel_matches_cpu_layer(check):
    from nanoeuler.cpu import layers as R
    from nanoeuler.gpu import layers as L

    for label, err, tol in check(_Case(np.random.default_rng(11)), L, R):
        assert err < tol, f"{label}: {err:.2e} >= {tol:.0e}"


@pytest.mark.gpu
@needs_gpu
def test_model_gradients_match_cpu_engine():
    errors = model_check(seed=5, report=lambda line: None)
    worst = max(errors, key=errors.get)
    assert errors[worst] < FP32_TOL, (worst, errors[worst])


@pytest.mark.gpu
@needs_gpu
def test_tf32_training_mode_gradients_close():
    assert tf32_model_error(seed=6) < TF32_TOL


@pytest.mark.gpu
@needs_gpu
def test_training_steps_agree_across_engines():
    """Same init, same batches, same AdamW steps: the losses track each other at TF32 precision."""
    from nanoeuler.check import random_problem
    from nanoeuler.gpu.check import MODEL_CONFIG
    from nanoeuler.model import make_engine

    rng = np.random.default_rng(8)
    cpu, gpu = make_engine(MODEL_CONFIG, device="cpu"), make_engine(MODEL_CONFIG, device="gpu")
    for step in range(4):
        _, inputs, targets = random_problem(MODEL_CONFIG, rng, batch=4)
        losses = []
        for eng in (cpu, gpu):
            losses.append(eng.forward_backward(inputs, targets)[0])
            eng.step(lr=3e-3, weight_decay=0.1, grad_clip=1.0)
        assert abs(losses[1] - losses[0]) < 2e-3 * losses[0], (step, losses)
