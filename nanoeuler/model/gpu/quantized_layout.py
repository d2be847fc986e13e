"""The layout of a quantized matrix on the GPU (kernels/quantized.cu's header): the host side of its packing,
apart from CuPy so that it is checked without a GPU.

A row is cut into chunks of 32 elements and the chunks into records of 64 bytes (int4: 4 chunks, int8: 2), of
which lane t = 0..3 of a warp reads 16 bytes; W's rows lie in tiles of 8, a tile's 8 rows' record r next to
each other after their record r - 1, so that a warp reads a tile as one contiguous run. A row's float16 scales
(int4: (d, m) pairs) are cut into the pieces a lane loads for a record (`scale_piece`) and tiled alike.
"""
import numpy as np

from nanoeuler.model.quantize import integers

CHUNK = 32  # elements a chunk: the scales' unit and the kernels' (a group is a whole number of chunks)
TILE = 8  # rows of W a tile: a warp reads a tile's records (and their scales) as one contiguous run


def group_shift(group, I):
    """The shift from a chunk's index to its group's: a row's groups of 2^k chunks, or one group (31: every
    chunk's index shifts to 0)."""
    return 31 if group == I else (group // CHUNK).bit_length() - 1


def scale_piece(kind, shift):
    """The bytes of a row's scales a lane loads for a record (a piece): int4 the (d, m) pairs of the record's
    four chunks (16 bytes: groups of 32), of its two groups (8: groups of 64) or its one group (4); int8 4 bytes,
    the d of two groups."""
    return {0: 16, 1: 8}.get(shift, 4) if kind == "int4" else 4


def layout(kind, group, O, I):
    """(w's shape, scales' shape, the pieces of a row's scales) of an (O, I) matrix in the kernels' layout:
    tiles of 8 rows, uint8 (tiles, 8 x I / 2 or 8 x I) and uint16 (tiles, 8 x pieces x piece / 2)."""
    tiles, row_bytes = -(-O // TILE), I // 2 if kind == "int4" else I
    scale_bytes = (I // group) * (4 if kind == "int4" else 2)
    piece = scale_piece(kind, group_shift(group, I))
    pieces = -(-scale_bytes // piece)
    return (tiles, TILE * row_bytes), (tiles, TILE * pieces * piece // 2), pieces


def pack(qt):
    """The integers of a host QuantizedTensor in the kernels' layout (kernels/quantized.cu's header), uint8
    (tiles, 8 x I / 2) (int4) or (tiles, 8 x I) (int8): a row's records of 64 bytes, lane t's 16 bytes the
    elements 8t .. 8t + 7 of each of the record's chunks (an int4 chunk's 32-bit word holds element 2i in nibble
    i, 2i + 1 in nibble 4 + i; an int8 chunk's two words q + 128 of elements 0, 2, 1, 3 and 4, 6, 5, 7); record r
    of a tile's 8 rows next to each other, after their record r - 1."""
    O, I = qt.shape
    q = integers(qt)
    if qt.kind == "int4":
        e = q.reshape(O, I // CHUNK, 4, 8)  # (row, chunk, lane, element)
        words = (e[..., [0, 4, 1, 5]] | (e[..., [2, 6, 3, 7]] << np.uint8(4))).astype(np.uint8)  # bytes of a word
        packed = words.reshape(O, I // 128, 4, 4, 4).transpose(0, 1, 3, 2, 4)  # (row, record, lane, chunk, byte)
    else:  # q + 128 as bytes, a word's bytes elements 0, 2, 1, 3
        u = (q.view(np.uint8) ^ np.uint8(0x80)).reshape(O, I // CHUNK, 4, 8)[..., [0, 2, 1, 3, 4, 6, 5, 7]]
        packed = u.reshape(O, I // 64, 2, 4, 8).transpose(0, 1, 3, 2, 4)
    return _tiles(np.ascontiguousarray(packed).reshape(O, -1, 64))


def packed_scales(qt):
    """A QuantizedTensor's float16 parameters as the kernels read them, uint16 bits: a row's (int4: (d, m)
    pairs; int8: d) cut into pieces (`scale_piece`, the last padded with zeros), tiled as the weights: piece p
    of a tile's 8 rows next to each other."""
    O, I = qt.shape
    if qt.kind == "int4":
        scales = np.stack([qt.scales.astype(np.float16), qt.mins.astype(np.float16)], axis=-1)  # (O, G, 2)
    else:
        scales = qt.scales.astype(np.float16)
    row = np.ascontiguousarray(scales).view(np.uint8).reshape(O, -1)
    piece, pieces = scale_piece(qt.kind, group_shift(qt.group, I)), layout(qt.kind, qt.group, O, I)[2]
    padded = np.zeros((O, pieces * piece), np.uint8)
    padded[:, :row.shape[1]] = row
    return _tiles(padded.reshape(O, pieces, piece)).view(np.uint16)


def _tiles(units):
    """(O, U, B) -> (tiles, 8 x U x B): rows padded with zeros to whole tiles of 8, unit u of a tile's 8 rows
    next to each other, after their unit u - 1."""
    O, U, B = units.shape
    tiles = -(-O // TILE)
    padded = np.zeros((tiles * TILE, U, B), units.dtype)
    padded[:O] = units
    return np.ascontiguousarray(padded.reshape(tiles, TILE, U, B).transpose(0, 2, 1, 3)).reshape(tiles, -1)
