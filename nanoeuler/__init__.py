"""nanoeuler: a GPT-2-class language model written from scratch (see README.md)."""
import os


def _configure_cpu_runtime():
    """Settings that numba and OpenBLAS read once, when they load: so they are made here, before nanoeuler
    imports either (an explicit setting by the user wins).

    - The CPU engine runs its own loops on numba's thread pool and its large matmuls on OpenBLAS's, on the
      same cores, one after the other: each pool must get out of the other's way when its work is done.
      numba's default (OpenMP) workers and OpenBLAS's (for up to 2^28 cycles, by default) spin-wait after
      their work, which slowed a training step of `small` on 2 cores by 1.4x to 2x. numba's workqueue layer
      and a short OpenBLAS timeout make idle threads sleep.
    - On CPUs with AVX-512, LLVM still vectorises with 256-bit registers unless told otherwise (a tuning
      for older chips that slowed down in 512-bit code). The CPU engine's loops are arithmetic-bound
      (exp, softmax, attention's products); 512-bit ones made a training step of `small` 1.3x faster.
    """
    os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    if "NUMBA_CPU_FEATURES" not in os.environ:
        import llvmlite.binding as llvm
        llvm.initialize_native_target()
        features = llvm.get_host_cpu_features().flatten()
        if "+avx512f" in features.split(","):
            os.environ["NUMBA_CPU_FEATURES"] = features + ",-prefer-256-bit"


_configure_cpu_runtime()

__version__ = "0.1.0"
