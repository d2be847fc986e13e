"""Quantized weights: int8 and int4 matrices, their exact dequantization, and the packing both engines read.

A matrix w (O, I) (PyTorch's Linear layout: a row an output) is cut along its input into groups of `group`
elements (group 0: one group a row, int8's per-channel scale). Each group keeps float16 parameters and small
integers q (docs/quantization.md):

- int8: q int8 in -127..127 and a scale d:   w = d * q
  d = max|x| / 127, q = roundf(x / d) (half away from zero), as llama.cpp quantizes: groups of 32 are GGUF's
  Q8_0 block for block, bit for bit (d, then the 32 q).
- int4: q in 0..15 and a scale d and a minimum m:   w = d * q + m
  d = (max - min) / 15, m = min, q = trunc((x - min) / d + 0.5) clipped to 0..15, as llama.cpp quantizes
  Q4_1: groups of 32 are GGUF's Q4_1 block for block, bit for bit (d, m, then the 16 bytes of q).
  Two q a byte, in GGUF's order within a group: byte j holds element j (low nibble) and j + group/2 (high).

Dequantization is exact and the same everywhere: float32(d) * q is exact in float32 (11 by 8 significant
bits), and d * q + m is one float32 rounding of that sum (an fma gives the same, d * q being exact): the CPU's
numba product, the GPU's kernels (which dequantize in registers) and `dequantize` below give the same float32
weights bit for bit, so a quantized model's only approximation is the quantization itself.

Which tensors are quantized (config.quantized_names): every layer's matrices (wq, wk, wv, wo, w_gate, w_up, w_down)
and the prediction heads; the embedding stays float (a lookup reads a row a token: nothing to gain at batch
1), and so does a tied head (it is the embedding), the norm gains and the q/k/v biases. The heads may have a
type of their own (config.quant_head, quant_format): `quantize --type int4` keeps them int8 in groups of 32
(Q8_0), since they carry most of int4's loss (docs/quantization.md).

    from nanoeuler.model.quantize import quantize, dequantize
    qt = quantize(w, "int4", 32)          # a QuantizedTensor: q (O, I // 2) uint8, scales and mins (O, I // 32)
    w32 = dequantize(qt)                  # float32 (O, I): the values every engine computes with

The GPU engine's copy of a QuantizedTensor holds the same arrays as CuPy arrays (model/gpu/quantized.py).
"""
import dataclasses

import numpy as np

TYPES = ("int8", "int4")
DEFAULT_GROUP = 32  # GGUF's Q8_0 and Q4_1 blocks
DEFAULT_HEAD = {"int8": "int8", "int4": "int8"}  # the heads' type by the layers' (quantize --head-type)



@dataclasses.dataclass
class QuantizedTensor:
    """A quantized matrix of logical shape (O, I): q (O, I) int8 (int8) or (O, I // 2) uint8 (int4, packed),
    scales (O, I // group) float16, mins (O, I // group) float16 (int4) or None; group I where it was 0."""
    kind: str
    group: int
    q: object
    scales: object
    mins: object = None

    @property
    def shape(self):
        O, cols = self.q.shape
        return (O, cols * (2 if self.kind == "int4" else 1))

    @property
    def nbytes(self):
        return sum(a.nbytes for a in (self.q, self.scales, self.mins) if a is not None)

    def rows(self, start, stop):
        """Rows start..stop-1 as a QuantizedTensor of views (no copy): groups never cross rows."""
        return QuantizedTensor(self.kind, self.group, self.q[start:stop], self.scales[start:stop],
                               None if self.mins is None else self.mins[start:stop])

    def arrays(self):
        """{suffix: array} as a checkpoint stores them (`<name>.q`, `<name>.scales`, `<name>.mins`)."""
        out = {"q": self.q, "scales": self.scales}
        if self.mins is not None:
            out["mins"] = self.mins
        return out


def check_type(kind, group):
    """ValueError (a one-line message) unless (kind, group) is a format we have."""
    if kind not in TYPES:
        raise ValueError(f"unknown quantization type {kind!r} (int8 or int4)")
    if group < 0 or (group and group % 32) or (kind == "int4" and group == 0):
        raise ValueError(f"{kind} groups of {group}: the group is a multiple of 32"
                         + (" (or 0, a scale per output channel)" if kind == "int8" else ""))


def group_of(kind, group, columns):
    """The group length a matrix of `columns` inputs is cut into; ValueError where it does not divide them."""
    check_type(kind, group)
    g = group or columns
    if columns % g:
        raise ValueError(f"a row of {columns} elements is not a whole number of {kind} groups of {g}")
    return g


def _roundf(x):
    """C's roundf (half away from zero), as llama.cpp rounds (gguf.quants.np_roundf)."""
    a = np.abs(x)
    floored = np.floor(a)
    return np.sign(x) * (floored + np.floor(2 * (a - floored)))


def quantize(w, kind, group=DEFAULT_GROUP):
    """A float matrix (O, I) as a QuantizedTensor of `kind` in groups of `group` (0: a row; int8 only)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    O, I = w.shape
    g = group_of(kind, group, I)
    blocks = w.reshape(O, I // g, g)
    with np.errstate(divide="ignore"):
        if kind == "int8":
            d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
            q = _roundf(blocks * inv).astype(np.int8).reshape(O, I)
            return QuantizedTensor(kind, g, q, d[..., 0].astype(np.float16))
        hi = blocks.max(axis=-1, keepdims=True)
        lo = blocks.min(axis=-1, keepdims=True)
        d = (hi - lo) / np.float32(15)
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    q = np.trunc((blocks - lo) * inv + np.float32(0.5)).astype(np.uint8).clip(0, 15)
    return QuantizedTensor(kind, g, pack_int4(q.reshape(O, I), g), d[..., 0].astype(np.float16),
                           lo[..., 0].astype(np.float16))


def pack_int4(q, group):
    """q (O, I) in 0..15 -> (O, I // 2) uint8: in each group, byte j = q[j] | q[j + group/2] << 4."""
    O, I = q.shape
    q = q.astype(np.uint8).reshape(O, I // group, 2, group // 2)
    return (q[:, :, 0] | (q[:, :, 1] << np.uint8(4))).reshape(O, I // 2)


def unpack_int4(packed, group):
    """The inverse of pack_int4: (O, I // 2) uint8 -> (O, I) uint8 in 0..15."""
    O, half = packed.shape
    p = packed.reshape(O, half // (group // 2), 1, group // 2)
    return ((p >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)).reshape(O, 2 * half)


def integers(qt):
    """The q of every element, (O, I): int8, or uint8 in 0..15 for int4."""
    return qt.q if qt.kind == "int8" else unpack_int4(qt.q, qt.group)


def dequantize(qt):
    """The float32 matrix (O, I) a QuantizedTensor stands for: d * q (+ m), exactly as the engines compute it."""
    O, I = qt.shape
    g = qt.group
    q = integers(qt).astype(np.float32).reshape(O, I // g, g)
    w = q * qt.scales.astype(np.float32)[..., None]
    if qt.mins is not None:
        w += qt.mins.astype(np.float32)[..., None]
    return w.reshape(O, I)


def concat_rows(parts):
    """QuantizedTensors of one kind, group and width stacked by rows (the engines' fused wq|wk|wv, w_gate|w_up
    and heads): exact, since groups never cross rows."""
    first = parts[0]
    assert all(p.kind == first.kind and p.group == first.group and p.shape[1] == first.shape[1] for p in parts)
    return QuantizedTensor(first.kind, first.group, np.concatenate([p.q for p in parts]),
                           np.concatenate([p.scales for p in parts]),
                           None if first.mins is None else np.concatenate([p.mins for p in parts]))


def stored_arrays(qt_or_shape, kind=None, group=None):
    """{suffix: (dtype, shape)} of a quantized tensor's stored arrays: from a QuantizedTensor, or from a
    logical shape (O, I) and a kind and group (what a checkpoint of a config must hold)."""
    if isinstance(qt_or_shape, QuantizedTensor):
        return {k: (a.dtype, a.shape) for k, a in qt_or_shape.arrays().items()}
    O, I = qt_or_shape
    g = group_of(kind, group, I)
    out = {"q": (np.dtype(np.int8), (O, I)) if kind == "int8" else (np.dtype(np.uint8), (O, I // 2)),
           "scales": (np.dtype(np.float16), (O, I // g))}
    if kind == "int4":
        out["mins"] = (np.dtype(np.float16), (O, I // g))
    return out
