"""The CUDA runtime under the GPU layers: compiling the kernels, launching them, cuBLAS, and CUDA graphs.

layers.py says *what* runs (which kernel, on which arrays, in which shape); this module is *how*, and holds
no layer of its own:
- `module` / `kernel`: kernels/<name>.cu compiled by NVRTC through CuPy (cached by CuPy on disk), with the
  numbers it shares with Python as -D defines (constants.module_defines), one build per define set;
- `launch`: a kernel on the current stream, where it is being recorded into a CUDA graph with programmatic
  dependent launch (sm_90+: the driver's cuLaunchKernelEx through cuda-python, which CuPy's launches cannot
  ask for);
- `gemm`: a cuBLAS GemmEx on a handle of our own through NVIDIA's nvmath-python bindings, so that the
  products too can be recorded into a CUDA graph;
- `graph`: a decoding step recorded once as a CUDA graph and replayed.

It keeps no mode: what it is asked to do comes in the arguments (tf32, dependent), and whether a launch is
being recorded is the stream's own state (Stream.is_capturing). Its caches (compiled modules, the cuBLAS
handle of each device, the graphs' stream) hold only what does not change once made.
"""
import functools

import cupy
import numpy as np

from nanoeuler.errors import require
from nanoeuler.model.gpu.constants import KERNELS, module_defines

BF16 = np.dtype(np.uint16)  # storage type of bfloat16 activations (CuPy has no bfloat16 dtype)
F32 = np.dtype(np.float32)


def host_address(a):
    """The address of a NumPy array's data (its array interface), for the C APIs that take host pointers."""
    return a.__array_interface__["data"][0]


@functools.lru_cache(maxsize=None)
def sm_count():
    return cupy.cuda.Device().attributes["MultiProcessorCount"]


# ------------------------------------------------------------------------------------------- compiling
@functools.lru_cache(maxsize=None)
def module(name, defines=()):
    """Compile kernels/<name>.cu in the variant `defines` (ACT_BF16=1, ATT_PRECISE=1), with the numbers it shares
    with Python (constants.module_defines); its #include of common.cuh inlined, so CuPy's cache, which hashes
    the source text, sees header edits too."""
    common = (KERNELS / "common.cuh").read_text().replace("#pragma once\n", "")
    src = (KERNELS / f"{name}.cu").read_text().replace('#include "common.cuh"', common)
    return cupy.RawModule(code=src, options=("--std=c++17",) + tuple(f"-D{d}" for d in module_defines(name, defines)))


@functools.lru_cache(maxsize=None)
def _compiled(module_name, name, defines=()):
    return module(module_name, defines).get_function(name)


_opted_in = {}  # kernel -> the dynamic shared memory it may launch with, where above the default 48 KB


def kernel(module_name, name, defines=(), dynamic_smem=0):
    """The kernel `name` of kernels/<module_name>.cu, allowed to launch with dynamic_smem bytes of dynamic
    shared memory: above 48 KB a kernel has to opt in, and the limit only ever rises (it belongs to the
    kernel, not to one launch)."""
    k = _compiled(module_name, name, defines)
    if dynamic_smem > max(48 * 1024, _opted_in.get(k, 0)):
        k.max_dynamic_shared_size_bytes = dynamic_smem
        _opted_in[k] = dynamic_smem
    return k


# ------------------------------------------------------------------------- programmatic dependent launch
# Decoding's kernels (the matrix-vector products, the cached attention, argmax, the position's advance) are
# recorded into CUDA graphs with programmatic dependent launch on sm_90+: each may start while the one before
# it finishes, loading its weights, and waits (common.cuh: wait_for_inputs) only for its inputs. CuPy's
# launches cannot ask for it, so those go through the driver's cuLaunchKernelEx (cuda-python).
@functools.lru_cache(maxsize=None)
def _driver():
    """cuda.bindings.driver, or None where programmatic dependent launch is not to be had (before sm_90)."""
    if int(cupy.cuda.Device().compute_capability) < 90:
        return None
    driver, = require("cuda.bindings.driver", what="the GPU engine's CUDA graphs")
    return driver


def launch(kernel, grid, block, args, shared_mem=0, dependent=True):
    """kernel(grid, block, args) on the current stream; while that stream is being recorded into a CUDA graph
    (`graph`) and where dependent, with programmatic dependent launch (the kernel must wait_for_inputs before
    touching its inputs). Outside a recording a plain launch: the driver's path costs more host time, and a
    graph is what makes the overlap pay."""
    driver = _driver() if dependent else None
    stream = cupy.cuda.get_current_stream()
    if driver is None or not stream.is_capturing():
        kernel(grid, block, args, shared_mem=shared_mem)
        return
    assert all(isinstance(a, (cupy.ndarray, np.generic)) for a in args), [type(a) for a in args]
    # kernelParams in cuda-python's NumPy form: an array of the addresses of the arguments' values
    values = [np.array([a.data.ptr], np.uint64) if isinstance(a, cupy.ndarray) else np.array([a]) for a in args]
    params = np.array([host_address(v) for v in values], np.uint64)
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = tuple(grid) + (1,) * (3 - len(grid))
    config.blockDimX, config.blockDimY, config.blockDimZ = tuple(block) + (1,) * (3 - len(block))
    config.sharedMemBytes = shared_mem
    config.hStream = driver.CUstream(stream.ptr)
    config.attrs, config.numAttrs = [attr], 1
    # CuPy documents no handle of a RawKernel's CUfunction; .kernel.ptr is that of the Function it loaded
    function = driver.CUfunction(kernel.kernel.ptr)
    status, = driver.cuLaunchKernelEx(config, function, params, 0)
    if status != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernelEx failed: {status.name}")


# ---------------------------------------------------------------------------------------------- cuBLAS
class _Cublas:
    """A cuBLAS handle of our own, called through nvmath-python's low-level bindings (nvmath.bindings.cublas),
    with its workspace set up front: CuPy's cuBLAS wrappers refuse to run during stream capture (cupy #6290),
    and cuBLAS may not allocate during one, so this is what lets a decoding step whose products are cuBLAS's
    be recorded as a CUDA graph. The math mode is cuBLAS's default and scalars are host pointers (both set
    explicitly: the compute type of each call alone picks TF32 or FP32)."""

    WORKSPACE = 32 << 20  # what cuBLAS asks for on Hopper

    def __init__(self):
        # CuPy's libraries first: nvmath finds a library already loaded before searching (cuda-pathfinder), so
        # its handle then runs in the cuBLAS CuPy was built against, and NVRTC stays the one CuPy compiles with
        cupy.cuda.device.get_cublas_handle()
        cupy.cuda.nvrtc.getVersion()
        cublas, = require("nvmath.bindings.cublas", what="the GPU engine's cuBLAS products")
        self.cublas = cublas
        self.handle = cublas.create()
        cublas.set_math_mode(self.handle, cublas.Math.DEFAULT_MATH)
        cublas.set_pointer_mode(self.handle, cublas.PointerMode.HOST)
        self.workspace = cupy.empty(self.WORKSPACE, np.uint8)
        cublas.set_workspace(self.handle, self.workspace.data.ptr, self.WORKSPACE)


@functools.lru_cache(maxsize=None)
def _cublas(device):
    """The current device's handle (a cuBLAS handle belongs to the device it was made on; `device` is the key)."""
    return _Cublas()


_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)  # host scalars for alpha / beta
_CUDA_TYPE = {F32: 0, BF16: 14}  # cudaDataType_t: CUDA_R_32F, CUDA_R_16BF


def gemm(trans_a, trans_b, m, n, k, A, lda, B, ldb, C, ldc, accumulate, tf32, alpha=1.0):
    """Column-major C (m, n) = alpha op(A) op(B) (+ C when accumulate), on cuBLAS on the current stream; op
    transposes where trans_a / trans_b. A and B share a dtype (float32 or bf16); C may be either, and the products
    accumulate in float32: on the TF32 tensor cores for float32 operands where tf32, else in full float32
    (bf16 operands: compute type 32F whatever tf32 says)."""
    handle = _cublas(cupy.cuda.Device().id)
    cublas = handle.cublas
    compute = cublas.ComputeType.COMPUTE_32F_FAST_TF32 if A.dtype == F32 and tf32 else cublas.ComputeType.COMPUTE_32F
    op = lambda transposed: cublas.Operation.T if transposed else cublas.Operation.N
    ab, c = _CUDA_TYPE[A.dtype], _CUDA_TYPE[C.dtype]
    beta = _ONE if accumulate else _ZERO
    cublas.set_stream(handle.handle, cupy.cuda.get_current_stream().ptr)
    scale = _ONE if alpha == 1.0 else np.array([alpha], np.float32)  # read by cuBLAS during the call
    cublas.gemm_ex(handle.handle, op(trans_a), op(trans_b), m, n, k, host_address(scale), A.data.ptr, ab, lda,
                   B.data.ptr, ab, ldb, host_address(beta), C.data.ptr, c, ldc, compute, cublas.GemmAlgo.DEFAULT)


# ---------------------------------------------------------------------------------------------- graphs
@functools.lru_cache(maxsize=None)
def _graph_stream():
    # A blocking stream: the legacy default stream, where everything else runs, waits for it and it for the
    # default stream, so replays need no explicit synchronisation with the work around them.
    return cupy.cuda.Stream(non_blocking=False)


def graph(step):
    """step (a decoding step: kernels only, over buffers that outlive it, with every changing value in device
    memory) as a function that replays it as one CUDA graph. The first call runs step and records it; later
    calls launch the recording, one launch for the whole step (cuBLAS's products too: _Cublas). A temporary
    would be handed to other arrays after the recording while its replays still write it, so every buffer a
    step writes must be given to it."""
    recorded = []

    def replay():
        stream = _graph_stream()
        if recorded:
            recorded[0].launch(stream)
            return
        step()  # the first run also compiles any kernel not compiled yet, which recording could not
        with stream:
            stream.begin_capture()
            try:
                step()
            finally:
                recording = stream.end_capture()
        recorded.append(recording)

    return replay
