"""nanoeuler: a GPT-2-class language model written from scratch (see README.md)."""
import os

# numba's default (OpenMP) threads spin-wait after every parallel region and take the cores from OpenBLAS's
# threads in the matmul that follows: a training step of `small` on 2 cores ran at 5,800 tokens/s that way
# and 11,700 with the workqueue layer, whose idle threads sleep. Set before numba is first imported.
os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")

__version__ = "0.1.0"
