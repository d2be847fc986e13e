"""How much memory a device has free, and how much an engine's parameter buffers take: what lets a model that
cannot fit be refused in one line before anything is allocated (make_engine), and serve size its KV cache
(nanoeuler/infer/kv_budget.py).

- GPU: cudaMemGetInfo's free bytes plus the blocks CuPy's pool holds unused;
- CPU: the machine's available memory (/proc/meminfo MemAvailable, else sysconf's available pages).
NANOEULER_MEMORY_AVAILABLE (bytes) replaces the measured free memory on either.
"""
import os

GiB = 1 << 30


def cpu_available():
    """The machine's available memory in bytes (MemAvailable), else sysconf's available pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gpu_available():
    """The device's free memory in bytes: cudaMemGetInfo's free plus the blocks CuPy's pool holds unused."""
    import cupy
    free, _ = cupy.cuda.runtime.memGetInfo()
    return free + cupy.get_default_memory_pool().free_bytes()


def gpu_in_use():
    """Bytes of the device's memory in use (cudaMemGetInfo's total - free, less the blocks CuPy's pool holds
    unused): this process's CUDA context and arrays, and anything else on the card."""
    import cupy
    free, total = cupy.cuda.runtime.memGetInfo()
    return total - free - cupy.get_default_memory_pool().free_bytes()


def parse_size(text):
    """'12GiB', '12G', '1.5 GB', '800MiB', '4096' (bytes) -> bytes; ValueError otherwise. G, GiB: 2^30; GB: 10^9."""
    units = {"": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10 ** 3, "m": 1 << 20, "mib": 1 << 20, "mb": 10 ** 6,
             "g": GiB, "gib": GiB, "gb": 10 ** 9, "t": 1 << 40, "tib": 1 << 40, "tb": 10 ** 12}
    t = text.strip().lower().replace(" ", "")
    number = t.rstrip("kmgtib")
    unit = t[len(number):]
    if unit not in units or not number:
        raise ValueError(f"{text!r} is not a size (e.g. 12GiB, 800MiB)")
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise ValueError(f"{text!r} is not a size (e.g. 12GiB, 800MiB)") from None
    if value <= 0:
        raise ValueError(f"{text!r} is not a positive size")
    return int(value)


def free_bytes(gpu):
    """The free memory of the GPU or the CPU in bytes, or NANOEULER_MEMORY_AVAILABLE where it is set."""
    override = os.environ.get("NANOEULER_MEMORY_AVAILABLE")
    return int(override) if override else gpu_available() if gpu else cpu_available()


def size_text(n):
    """Bytes as GiB, or MiB below a tenth of one."""
    return f"{n / GiB:,.1f} GiB" if n >= GiB / 10 else f"{n / (1 << 20):,.1f} MiB"


def parameter_bytes(n_params, itemsize, compute_itemsize, training):
    """The bytes of an engine's parameter buffers: in training the master weights and the gradients (itemsize
    each) and the compute copy where the activations' type differs (bf16); for decoding the weights it
    computes on alone (model/engine.py)."""
    if not training:
        return n_params * compute_itemsize
    return n_params * (2 * itemsize + (compute_itemsize if compute_itemsize != itemsize else 0))


def sharded_bytes(n_params, ranks, stage, itemsize, compute_itemsize):
    """A ZeRO-2/3 rank's bytes of parameter state (train/sharded.py): its shard of the master weights,
    gradients and two AdamW moments (itemsize each), of the decay mask (a byte) and of the compute copy where
    it differs (bf16); in stage 2 the whole compute weights too. The shard: n_params / ranks, rounded up."""
    copy = compute_itemsize if compute_itemsize != itemsize else 0
    shard = -(-n_params // ranks) * (4 * itemsize + 1 + copy)
    return shard + (n_params * compute_itemsize if stage == 2 else 0)
