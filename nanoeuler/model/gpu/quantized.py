"""The GPU engine's quantized matrices (model/quantize.py): their device layout and the launchers of
kernels/quantized.cu.

`QuantizedMatrix.of(qt)` repacks a host QuantizedTensor once, at load, into the layout the kernels read (that
file's header: 64-byte records a row, four lanes' 16-byte loads; tiles of 8 rows, the scales too): still 4 or 8
bits a weight plus its group's float16 scale (and minimum), never a kept float copy. `matmul` is the product the
GPU Layers take for such a w in products of at most FEW_ROWS rows (decoding, prefill's chunks):

- bf16 activations: quant_matmul_* on the tensor cores (8, 16 or 32 rows a block, `x_tiles`; more in more
  blocks, which read the weights from L2), batch-invariant, with RMSNorm, SwiGLU, the rotary embedding and a
  bias folded in where asked (as the bf16 few-row products);
- float32 activations (fp32, tf32): the matrix dequantized into a float32 scratch of its size (exact), then
  cuBLAS, as for float weights.

`dequantize(w)` gives the dequantized matrix as a CuPy array (float32 by default: model/quantize.py's values
bit for bit): the float32 path's first step, the checks', and, into `dequantized_scratch` (one matrix at a time),
every product of more rows (layers._dequantized: training's forward, a full forward) and a frozen base's
backward product (QLoRA: dx = dout W), both then cuBLAS's. A matrix of more than SLICE_ELEMENTS weights (an
untied head: Llama 3's is 128,256 x 4,096, 1 GB in bf16) goes through those a slice of rows at a time
(`row_slices`), so the scratch holds at most that many.
"""
import dataclasses
import functools

import cupy
import numpy as np

from nanoeuler.model.gpu import runtime
from nanoeuler.model.gpu.constants import QUANT_LOADS, QUANT_SPLIT, QUANT_T4_INT4_SPLIT, QUANT_WAVE_WARPS
from nanoeuler.model.gpu.quantized_layout import CHUNK, TILE, group_shift, layout, pack, packed_scales
from nanoeuler.model.gpu.runtime import BF16, F32, kernel, launch

# the most weights of one matrix dequantized at once for a product of many rows (256 MiB in bf16: every matrix of
# a Llama-3-8B layer fits): a larger one is dequantized and multiplied a slice of its rows at a time
SLICE_ELEMENTS = 1 << 27
_largest = {}  # device -> the most weights of a quantized matrix made on it, which sizes the scratch once


@dataclasses.dataclass
class QuantizedMatrix:
    """A quantized (O, I) matrix on the GPU in the kernels' layout (kernels/quantized.cu's header, `layout`):
    w uint8 and scales float16 bits (uint16, int4's (d, m) pairs) in tiles of 8 rows; this matrix is their rows
    row0 .. row0 + O - 1 (a slice of rows shares its matrix's arrays)."""
    kind: str
    group: int
    shape: tuple
    w: object
    scales: object
    row0: int = 0

    def __post_init__(self):
        device = self.w.device.id
        _largest[device] = max(_largest.get(device, 0), self.shape[0] * self.shape[1])

    @classmethod
    def of(cls, qt):
        O, I = qt.shape
        record = 128 if qt.kind == "int4" else 64
        if I % record:
            raise ValueError(f"the GPU's {qt.kind} products take rows of a multiple of {record} elements, not {I}")
        chunks = qt.group // CHUNK
        if qt.group != I and chunks & (chunks - 1):
            raise ValueError(f"the GPU's products take groups of 32, 64, 128, ... elements or a whole row, not {qt.group}")
        return cls(qt.kind, qt.group, (O, I), cupy.asarray(pack(qt)), cupy.asarray(packed_scales(qt)))

    @property
    def nbytes(self):
        """The bytes of its rows' weights and scales."""
        (_, w_cols), (_, s_cols), _ = layout(self.kind, self.group, *self.shape)
        return self.shape[0] * (w_cols + 2 * s_cols) // TILE

    def rows(self, start, stop):
        """Rows start..stop-1 (no copy)."""
        assert 0 <= start <= stop <= self.shape[0]
        return QuantizedMatrix(self.kind, self.group, (stop - start, self.shape[1]), self.w, self.scales,
                               self.row0 + start)

    def _args(self):
        """(w and scales from row0's tile on, the pieces of a row's scales, the group shift, row0's place in its
        tile)."""
        tile = self.row0 // TILE
        shift = group_shift(self.group, self.shape[1])
        pieces = layout(self.kind, self.group, *self.shape)[2]
        return self.w[tile:], self.scales[tile:], np.int32(pieces), np.int32(shift), np.int32(self.row0 % TILE)


def _check_input(x, w):
    assert x.flags.c_contiguous and x.shape[1] == w.shape[1] and x.data.ptr % 16 == 0, (x.shape, w.shape, x.data.ptr)


_scratch = {}


def scratch(shape, dtype):
    """A buffer kept for every later call of the same shape and type (a temporary inside a recorded CUDA graph
    would be handed to other arrays while replays still write it): decoding's normed rows, the float32 path's
    dequantized matrix."""
    key = (tuple(shape), np.dtype(dtype).str, cupy.cuda.Device().id)
    if key not in _scratch:
        _scratch[key] = cupy.empty(shape, dtype)
    return _scratch[key]


def row_slices(w):
    """[(start, stop)]: w's rows in slices of at most SLICE_ELEMENTS weights (whole tiles of 8 rows), the pieces
    a product of many rows dequantizes one at a time; one slice where w fits."""
    O, I = w.shape
    rows = max(TILE, SLICE_ELEMENTS // I // TILE * TILE)
    return [(start, min(O, start + rows)) for start in range(0, O, rows)]


_dequantized = {}


def dequantized_scratch(shape, dtype):
    """An (O, I) buffer for a matrix's dequantized copy, or a slice's (row_slices), in a product of many rows (the
    forward's, layers._dequantized, and the backward's dx = dout W of a frozen base): one buffer per type and
    device shared by all (a transient copy of one matrix at a time; such products run outside CUDA graphs), made
    once at the size of the largest quantized matrix on the device or SLICE_ELEMENTS, whichever is smaller: not
    grown matrix by matrix, which would leave each smaller buffer behind in CuPy's pool."""
    key = (np.dtype(dtype).str, cupy.cuda.Device().id)
    size = shape[0] * shape[1]
    if key not in _dequantized or _dequantized[key].size < size:
        _dequantized.pop(key, None)  # a smaller one freed before the larger is made
        _dequantized[key] = cupy.empty(max(size, min(SLICE_ELEMENTS, _largest.get(key[1], 0))), dtype)
    return _dequantized[key][:size].reshape(shape)


def dequantize(w, dtype=F32, out=None):
    """The matrix (O, I) as `dtype` (float32: exact; BF16 rounded to nearest even), into out where given."""
    O, I = w.shape
    out = cupy.empty((O, I), dtype) if out is None else out
    assert out.shape == (O, I) and out.dtype == dtype and out.flags.c_contiguous and out.data.ptr % 16 == 0
    defines = ("ACT_BF16=1",) if dtype == BF16 else ()
    records = I // (128 if w.kind == "int4" else 64)
    q, scales, pieces, shift, phase = w._args()
    # a block 8 records of a tile of 8 rows (a warp a record): the tiles of rows row0 .. row0 + O - 1
    kernel("quantized", "quant_dequantize", defines)((-(-(int(phase) + O) // TILE), -(-records // 8)), (256,),
                                                      (out, q, scales, np.int32(O), phase, np.int32(I),
                                                       pieces, shift, np.int32(w.kind == "int4")))
    return out


def warp_smem(kind):
    """A warp's shared memory in quant_matmul_<kind>: its stages of QUANT_LOADS[kind] records in all (1,280 bytes a
    record in kernels/quantized.cu's stages, whatever the records a stage) and its sums."""
    return QUANT_LOADS[kind] * 1280 + 16 * 9 * 4


@functools.lru_cache(maxsize=None)
def _most_warps(device, kind):
    """The warps a block's shared memory holds on this GPU (227 KB a block on an H100 / H200, 99 KB on an RTX
    40x0)."""
    return cupy.cuda.runtime.deviceGetAttribute(97, device) // warp_smem(kind)  # MaxSharedMemoryPerBlockOptin


def split(w):
    """The warps that split a row of w's records (a block's): from the matrix's shape (and the GPU's shared
    memory) alone, never the rows of x, so a row's sums run in the same order whatever N is. The most (a power
    of two, at most QUANT_SPLIT and the records a row) that keep the product's warps within QUANT_WAVE_WARPS:
    small products split their rows to fill the GPU, large ones give each warp whole rows, which keep its
    QUANT_LOADS[kind] records streaming."""
    (O, I), records = w.shape, w.shape[1] // (128 if w.kind == "int4" else 64)
    tiles = -(-O // 16)  # 16 rows of W (8 pairs) a warp
    most = min(QUANT_SPLIT, records, _most_warps(cupy.cuda.Device().id, w.kind))
    ways = 1
    while ways * 2 <= most and tiles * ways * 2 <= QUANT_WAVE_WARPS:
        ways *= 2
    return ways


def x_tiles(N, w):
    """The tiles of 8 rows of x a block of quant_matmul_* takes for a product of N rows by w (more rows: more
    blocks, which read the weights again from L2): a block's tiles share each record's dequantized weights, so
    more than 16 rows take 4 (32 rows a block), int4 only where QUANT_T4_INT4_SPLIT warps or more split a row
    (constants.py); the kernels' sums do not depend on it (batch invariance)."""
    if N <= 16:
        return 1 if N <= 8 else 2
    return 4 if w.kind == "int8" or split(w) >= QUANT_T4_INT4_SPLIT else 2


def matmul(out, x, w, accumulate, tf32, gain=None, rstd=None, eps=0.0, glu_out=None, rope=None, bias=None):
    """out (N, O) (+)= x (N, I) @ W.T for a QuantizedMatrix W; out float32 or x's type. bf16 x may take
    RMSNorm with the gain (N,) (rstd (N,) receives 1 / the rows' rms), then SwiGLU into glu_out (N, O / 2) or
    the rotary embedding (rope = (cos, sin, pos, T, rotated rows, D / 2), as layers._matmul_small), after a
    bias (O,) where given: one kernel."""
    _check_input(x, w)
    assert out.flags.c_contiguous and out.dtype in (F32, x.dtype)
    (N, I), O = x.shape, w.shape[0]
    if x.dtype != BF16:  # float32 activations: the exact float32 matrix, then cuBLAS
        assert gain is None and glu_out is None and rope is None and bias is None
        deq = dequantize(w, F32, scratch((O, I), F32))
        runtime.gemm(True, False, O, N, I, deq, I, x, I, out, O, accumulate, tf32)
        return
    if gain is not None and gain.data.ptr % 16:  # the kernel reads the gain 16 bytes at a time
        aligned = scratch(gain.shape, gain.dtype)
        aligned[...] = gain
        gain = aligned
    null = np.uint64(0)
    cos, sin, pos, T, rot, half = rope if rope is not None else (null, null, null, 1, 0, 0)
    pos_stride = int(rope is not None and pos.size > 1)  # a position a sequence, or one for all
    if glu_out is not None:
        half = O // 2
    tiles_x = x_tiles(N, w)
    row_blocks = -(-N // (8 * tiles_x))
    ways = split(w)
    tiles = -(-(O // 2) // 8) if half else -(-O // 16)
    q, scales, pieces, shift, phase = w._args()
    smem = ways * warp_smem(w.kind)
    name = f"quant_matmul_{w.kind}{'_norm' if gain is not None else ''}_t{0 if N == 1 else tiles_x}"  # t0: one row
    launch(kernel("quantized", name, ("ACT_BF16=1",), smem),
           (tiles * row_blocks,), (32 * ways,),
           (out, x, q, scales, np.int32(N), np.int32(O), np.int32(I), pieces, shift, phase,
            np.int32(out.dtype == F32), np.int32(accumulate), null if gain is None else gain,
            null if rstd is None else rstd, np.float32(eps), np.int32(half), null if glu_out is None else glu_out,
            null if bias is None else bias, cos, sin, pos, np.int32(T), np.int32(pos_stride), np.int32(rot),
            np.int32(row_blocks)), shared_mem=smem)
