"""The GPU engine: CUDA kernels (kernels/*.cu, compiled at run time through CuPy/NVRTC) and cuBLAS, behind the
same layer functions as the CPU engine (layers.py; nanoeuler.model.engine.Engine drives either), over the CUDA
runtime of runtime.py (compiling, launching, cuBLAS through nvmath-python, CUDA graphs).

Nothing here imports cupy at import time, so the CPU path never loads it; `available()` probes inside a try.
The extra `[gpu]` brings the three libraries the engine needs (`require_libraries`): a machine without one of
them is told so in one line, never with a traceback.
"""
from nanoeuler.errors import installed, require

# Dense tensor-core peaks (FLOP/s) of the GPUs we know, for MFU, by substring of the device name (most specific
# first): TF32, and bf16 with float32 accumulation (what our matmuls use; GeForce cards run that at half
# their fp16-accumulate rate). fp32 is reported against the TF32 peak, as PyTorch users would.
_PEAK = {"H200": (494.7e12, 989.4e12), "H100 PCIe": (378e12, 756e12), "H100": (494.7e12, 989.4e12),
         "A100": (156e12, 312e12), "L40S": (183e12, 362e12), "RTX 4090": (82.6e12, 165.2e12),
         "RTX 4080": (48.7e12, 97.5e12), "RTX 4070": (29.1e12, 58.3e12), "RTX 3090": (35.6e12, 71e12)}


def available():
    """True when cupy imports and sees a CUDA GPU of compute capability 8.0 or newer (the attention kernels
    use the TF32 tensor-core instructions that Ampere introduced). Never raises."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return False
        return int(cupy.cuda.Device(0).compute_capability) >= 80
    except Exception:  # no cupy, no driver, no device: all mean "no GPU"
        return False


def require_libraries(what="the GPU engine"):
    """CuPy imported, and NVIDIA's CUDA Python (cuda-bindings) and nvmath-python bindings installed (imported
    where they are used, by runtime.py, after CuPy has loaded its CUDA libraries); a one-line UserError naming
    the first that is missing and `pip install -e '.[gpu]'` otherwise."""
    require("cupy", what=what)
    installed("cuda.bindings", "nvmath", what=what)


def device_name():
    import cupy
    return cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()


def peak_flops(precision="bf16"):
    """The current GPU's dense tensor-core peak in FLOP/s for `precision` (bf16, or TF32 for tf32 and fp32),
    or None when we do not know the card."""
    name = device_name()
    for key, (tf32, bf16) in _PEAK.items():
        if key in name:
            return bf16 if precision == "bf16" else tf32
    return None


HEAD_SIZES = (32, 64, 128)  # what the attention kernels are built for


def check_config(cfg):
    """Refuse, in one line (ValueError), a model the GPU kernels cannot run."""
    if cfg.head_dim not in HEAD_SIZES:
        sizes = ", ".join(map(str, HEAD_SIZES[:-1])) + f" or {HEAD_SIZES[-1]}"
        raise ValueError(f"the GPU attention kernels support head_dim {sizes}, not {cfg.head_dim} "
                         f"(dim {cfg.dim} / {cfg.n_heads} heads); use --device cpu")
