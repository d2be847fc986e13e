"""Which engine to run on: `--device auto|cpu|gpu` resolved against what this machine has.

The probe is nanoeuler.gpu.available(), which imports cupy only inside a try, so the CPU path works (and
never loads cupy) on a machine without CUDA.
"""
from nanoeuler.errors import UserError
from nanoeuler.gpu import available as gpu_available


def resolve(device, prefer_gpu=True):
    """'cpu' or 'gpu' for a --device value; auto takes the GPU when there is one and prefer_gpu is set."""
    if device == "cpu":
        return "cpu"
    if device == "gpu":
        if not gpu_available():
            raise UserError("--device gpu: no CUDA GPU found (needs an NVIDIA GPU of compute capability 8.0+ "
                            "and `pip install nanoeuler[gpu]`); use --device cpu")
        return "gpu"
    return "gpu" if prefer_gpu and gpu_available() else "cpu"
