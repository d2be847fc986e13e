"""The GPU engine's quantized matrices (model/quantize.py): their device layout and the launchers of
kernels/quantized.cu.

`QuantizedMatrix.of(qt)` repacks a host QuantizedTensor once, at load, into the layout the kernels read (that
file's header: 64-byte records a row, four lanes' 16-byte loads; the scales group-major): still 4 or 8 bits a
weight plus its group's float16 scale (and minimum), never a float copy. `matmul` is the product the GPU Layers
take for such a w:

- bf16 activations: quant_matmul_* on the tensor cores for any number of rows (1..64 rows a block: decoding's
  few-row products, batch-invariant; more rows in blocks of 64, the weights read again for each);
- float32 activations (fp32, tf32): the matrix dequantized into a float32 scratch of its size (exact), then
  cuBLAS, as for float weights.

`dequantize(w)` gives the dequantized matrix as a CuPy array (float32 by default: model/quantize.py's values
bit for bit): the float32 path's first step, the checks', and a frozen base's backward product (QLoRA: dx =
dout W through a dequantized copy of one matrix at a time in `backward_scratch`, then cuBLAS).
"""
import dataclasses

import cupy
import numpy as np

from nanoeuler.model.gpu import runtime
from nanoeuler.model.gpu.constants import QUANT_WARPS
from nanoeuler.model.gpu.runtime import BF16, F32, kernel, launch
from nanoeuler.model.quantize import integers

CHUNK = 32  # elements a chunk: the scales' unit and the kernels' (a group is a whole number of chunks)


@dataclasses.dataclass
class QuantizedMatrix:
    """A quantized (O, I) matrix on the GPU: w (O, I / 2 or I) uint8 in the kernels' layout, scales float16 bits
    (uint16), group-major: int4 (I / group, 2 stride) (d, m) pairs, int8 (I / group, stride); `stride` the rows
    of the matrix a row slice (rows) was taken from."""
    kind: str
    group: int
    shape: tuple
    w: object
    scales: object
    stride: int

    @classmethod
    def of(cls, qt):
        O, I = qt.shape
        record = 128 if qt.kind == "int4" else 64
        if I % record:
            raise ValueError(f"the GPU's {qt.kind} products take rows of a multiple of {record} elements, not {I}")
        chunks = qt.group // CHUNK
        if qt.group != I and chunks & (chunks - 1):
            raise ValueError(f"the GPU's products take groups of 32, 64, 128, ... elements or a whole row, not {qt.group}")
        q = integers(qt)
        if qt.kind == "int4":  # chunk bytes j = element j | element j + 16 << 4; record [lane t][chunk c][4 bytes]
            chunks = q.reshape(O, I // CHUNK, 2, 16)
            packed = (chunks[:, :, 0] | (chunks[:, :, 1] << np.uint8(4))).astype(np.uint8)
            packed = packed.reshape(O, I // 128, 4, 4, 4).transpose(0, 1, 3, 2, 4)
            scales = np.stack([qt.scales.astype(np.float16), qt.mins.astype(np.float16)], axis=-1)  # (O, G, 2)
            scales = np.ascontiguousarray(scales.transpose(1, 0, 2))
        else:  # record [lane t][chunk c][k-step s][4 bytes]
            packed = q.view(np.uint8).reshape(O, I // 64, 2, 2, 4, 4).transpose(0, 1, 4, 2, 3, 5)
            scales = np.ascontiguousarray(qt.scales.astype(np.float16).T)
        return cls(qt.kind, qt.group, (O, I), cupy.asarray(np.ascontiguousarray(packed).reshape(O, -1)),
                   cupy.asarray(scales.view(np.uint16).reshape(scales.shape[0], -1)), O)

    @property
    def nbytes(self):
        return self.w.nbytes + self.scales.nbytes

    def rows(self, start, stop):
        """Rows start..stop-1 (no copy): the scales keep the whole matrix's stride, from row `start` on."""
        assert 0 <= start <= stop <= self.shape[0]
        scales = self.scales[:, start * (2 if self.kind == "int4" else 1):]
        return QuantizedMatrix(self.kind, self.group, (stop - start, self.shape[1]), self.w[start:stop],
                               scales, self.stride)

    def _args(self):
        """(w, scales, the shift from a chunk's index to its group's, the scales' stride): a row's groups of
        2^k chunks, or one group (shift 31: every chunk's index shifts to 0)."""
        shift = 31 if self.group == self.shape[1] else (self.group // CHUNK).bit_length() - 1
        return self.w, self.scales, np.int32(shift), np.int32(self.stride)


def _check_input(x, w):
    assert x.flags.c_contiguous and x.shape[1] == w.shape[1] and x.data.ptr % 8 == 0, (x.shape, w.shape)


_scratch = {}


def scratch(shape, dtype):
    """A buffer kept for every later call of the same shape and type (a temporary inside a recorded CUDA graph
    would be handed to other arrays while replays still write it): decoding's normed rows, the float32 path's
    dequantized matrix."""
    key = (tuple(shape), np.dtype(dtype).str, cupy.cuda.Device().id)
    if key not in _scratch:
        _scratch[key] = cupy.empty(shape, dtype)
    return _scratch[key]


_backward = {}


def backward_scratch(shape, dtype):
    """An (O, I) buffer for a frozen matrix's dequantized copy in the backward pass (QLoRA: dx = dout W): one
    buffer per type and device, grown to the largest matrix asked and shared by all (a transient copy of one
    matrix at a time; the backward pass runs outside CUDA graphs)."""
    key = (np.dtype(dtype).str, cupy.cuda.Device().id)
    size = shape[0] * shape[1]
    if key not in _backward or _backward[key].size < size:
        _backward.pop(key, None)  # the smaller one freed before the larger is made
        _backward[key] = cupy.empty(size, dtype)
    return _backward[key][:size].reshape(shape)


def dequantize(w, dtype=F32, out=None):
    """The matrix (O, I) as `dtype` (float32: exact; BF16 rounded to nearest even), into out where given."""
    O, I = w.shape
    out = cupy.empty((O, I), dtype) if out is None else out
    assert out.shape == (O, I) and out.dtype == dtype and out.flags.c_contiguous
    defines = ("ACT_BF16=1",) if dtype == BF16 else ()
    threads = O * (I // (128 if w.kind == "int4" else 64)) * 4
    q, scales, group_shift, stride = w._args()
    kernel("quantized", "quant_dequantize", defines)((-(-threads // 256),), (256,),
                                                      (out, q, scales, np.int32(O), np.int32(0), np.int32(I),
                                                       group_shift, stride, np.int32(w.kind == "int4")))
    return out


def matmul(out, x, w, accumulate, tf32):
    """out (N, O) (+)= x (N, I) @ W.T for a QuantizedMatrix W; out float32 or x's type."""
    _check_input(x, w)
    assert out.flags.c_contiguous and out.dtype in (F32, x.dtype)
    (N, I), O = x.shape, w.shape[0]
    if x.dtype != BF16:  # float32 activations: the exact float32 matrix, then cuBLAS
        deq = dequantize(w, F32, scratch((O, I), F32))
        runtime.gemm(True, False, O, N, I, deq, I, x, I, out, O, accumulate, tf32)
        return
    tiles = min(4, -(-N // 16))
    q, scales, group_shift, stride = w._args()
    launch(kernel("quantized", f"quant_matmul_{w.kind}_t{tiles}", ("ACT_BF16=1",)),
           (-(-O // 8), -(-N // 64)), (32 * QUANT_WARPS,),
           (out, x, q, scales, np.int32(N), np.int32(O), np.int32(I), group_shift, stride,
            np.int32(out.dtype == F32), np.int32(accumulate)))
