"""nanoeuler: a GPT-2-class language model written from scratch (see README.md)."""
import os

# The CPU engine runs its own loops on numba's thread pool and its large matmuls on OpenBLAS's, on the same
# cores, one after the other. Each pool must get out of the other's way as soon as its work is done:
# numba's default (OpenMP) workers and OpenBLAS's (for up to 2^28 cycles, by default) spin-wait after
# their work, which slowed a training step of `small` on 2 cores by 1.4x to 2x. numba's workqueue layer and
# a short OpenBLAS timeout make idle threads sleep. Both are read when the library loads, so they are set
# here, before nanoeuler imports numpy or numba (an explicit setting by the user wins).
os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

__version__ = "0.1.0"
