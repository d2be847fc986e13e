"""nanoeuler: a GPT-2-class language model written from scratch (see README.md)."""
import os
import sys


def configure_cpu_runtime():
    """Settings that OpenBLAS and numba read from the environment when they load (an explicit setting by the
    user wins). The command line calls this first thing in cli.main(), before any of its modules imports
    NumPy or numba; it is idempotent.

    - The CPU engine runs its own loops on numba's thread pool and its large matmuls on OpenBLAS's, on the
      same cores, one after the other: each pool must get out of the other's way when its work is done, and
      a loop must start at once after the last (a decoding step runs some 150 of them). numba's OpenMP
      workers spin 1,000 rounds after a loop, then sleep (GNU OpenMP's default, 300,000, takes the cores
      from OpenBLAS's next product); OpenBLAS's spin up to 2^28 cycles by default, a short timeout makes
      them sleep. numba's workqueue layer, whose workers sleep at once, costs about 0.5 ms a loop to wake
      them: the CPU engine decoded 4-5x slower on it (docs/experiments.md).
    - NUMBA_NUM_THREADS, where the user sets it (the CPU engine's threads), caps OpenBLAS's threads too
      (OPENBLAS_NUM_THREADS, unless set): numpy's products otherwise take every core, and on a loaded machine
      each one waits for its threads to be scheduled (LoRA's thin products: docs/lora.md's Measurements).
    - On CPUs with AVX-512, LLVM still vectorises with 256-bit registers unless told otherwise (a tuning
      for older chips that slowed down in 512-bit code); the CPU engine's loops are arithmetic-bound (exp,
      softmax, attention's products), so they get 512-bit registers. docs/benchmarks.md has what each gave.

    When it takes effect: OPENBLAS_THREAD_TIMEOUT and OPENBLAS_NUM_THREADS are read once, when NumPy loads
    OpenBLAS, so they only count if NumPy was not imported yet; nothing can change them later. GOMP_SPINCOUNT
    likewise, when GNU OpenMP loads: with numba's thread pool, unless another library (PyTorch) loaded it
    first. numba's settings count as long as numba has neither started its thread pool nor compiled or loaded
    a kernel: if numba is already imported, its configuration is reloaded here from the environment. All are
    speed settings, and but for OpenBLAS's thread count results do not depend on them (the CPU engine's
    parallel loops fix their chunks, not the threads); OpenBLAS splits the sums of a product of few outputs
    and many terms (a weight's gradient over a batch) among its threads, so those round differently on
    another count, as on a machine of another number of cores by default.
    """
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    if os.environ.get("NUMBA_NUM_THREADS", "").strip():
        os.environ.setdefault("OPENBLAS_NUM_THREADS", os.environ["NUMBA_NUM_THREADS"].strip())
    if "NUMBA_CPU_FEATURES" not in os.environ:
        import llvmlite.binding as llvm
        llvm.initialize_native_target()
        features = llvm.get_host_cpu_features().flatten()
        if "+avx512f" in features.split(","):
            os.environ["NUMBA_CPU_FEATURES"] = features + ",-prefer-256-bit"
    if "numba" in sys.modules:  # numba read its environment when it loaded: have it read it again
        from numba.core import config
        config.reload_config()


# Also on import, for Python code that uses nanoeuler as a library (the benchmarks, the tests): it takes
# effect in full only where `import nanoeuler` comes before NumPy (benchmarks/bench_cpu_train.py imports it
# first for this reason), and it keeps numba's compiled-kernel cache to one variant (the CPU features are
# part of its key) between the command line and library use. The command line does not rely on this call.
configure_cpu_runtime()

__version__ = "0.1.0"
