"""Which engine to run on: `--device auto|cpu|gpu` resolved against the model and what this machine has.

The one rule for `auto`, used by `train` and `sft` alike: a model of at most CPU_MAX_PARAMS parameters runs
on the CPU engine (the `small` preset: its batches are too small to keep a GPU busy, and the CPU engine is
the reference), a larger one on the GPU when there is one (`big`, `base`), else on the CPU, slowly.
Inference (`infer`, `chat`) takes the GPU whenever there is one. The precision rule is here too: what each
engine computes in (`precision`), checked before any work starts and again where an engine is made.

The probe is nanoeuler.model.gpu.available(), which imports cupy only inside a try, so the CPU path works (and
never loads cupy) on a machine without CUDA.
"""
from nanoeuler.model.config import param_count
from nanoeuler.errors import UserError, require
from nanoeuler.model.gpu import available as gpu_available

# small has 1.1M parameters (2.0M with a 4096-token vocabulary), big 14.2M: the line falls between them.
CPU_MAX_PARAMS = 4_000_000
# what each engine computes in when --precision is not given; the CPU engine has fp32 only
DEFAULT_PRECISION = {"cpu": "fp32", "gpu": "bf16"}
PRECISIONS = {"cpu": ("fp32",), "gpu": ("bf16", "tf32", "fp32")}


def wants_gpu(cfg):
    """True when --device auto should take the GPU for training this model (when there is one), and the
    CPU engine is the slow choice for it."""
    return param_count(cfg) > CPU_MAX_PARAMS


def resolve(device, cfg=None):
    """'cpu' or 'gpu' for a --device value. auto: the GPU when there is one, unless cfg (the model to
    train) is small enough for the CPU (wants_gpu)."""
    if device == "cpu":
        return "cpu"
    if device == "gpu":
        try:
            require("cupy", what="the GPU engine")
        except UserError as e:
            raise UserError(f"--device gpu: no CUDA GPU found ({e}); use --device cpu") from None
        if not gpu_available():
            raise UserError("--device gpu: no CUDA GPU found (needs an NVIDIA GPU of compute capability 8.0+ "
                            "and `pip install -e '.[gpu]'`); use --device cpu")
        return "gpu"
    return "gpu" if (cfg is None or wants_gpu(cfg)) and gpu_available() else "cpu"


def precision(device, requested=None):
    """The precision an engine on `device` computes in: `requested` (--precision), else the device's default;
    one the device lacks is refused in one line."""
    chosen = requested or DEFAULT_PRECISION[device]
    if chosen not in PRECISIONS[device]:
        raise UserError(f"--precision {chosen}: the CPU engine computes in fp32 only" if device == "cpu" else
                        f"--precision {chosen}: the GPU engine computes in {', '.join(PRECISIONS[device])}")
    return chosen
