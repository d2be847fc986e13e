"""The GPU engine's layers: the launchers of nanoeuler.model.cpu.layers' layers, same names, signatures and
order, over CuPy arrays.

Each is a thin launcher: the work happens in a raw CUDA kernel from kernels/*.cu or, for every matrix product
of many rows, in cuBLAS; how kernels are compiled and launched, cuBLAS called and decoding steps recorded as
CUDA graphs is runtime.py's. Shapes and the activation layout are those of the CPU layers (see that module's
docstring); arrays are C-contiguous. The numbers these launchers share with the kernels live in
constants.py and reach the kernels as compile-time defines.

`Layers(precision, batch_invariant)` is one engine's layers (Engine.layers): its methods are the layer
functions, and its two settings, fixed when it is made, are read by the launchers that depend on them, so
there is no module-wide mode and two engines of different settings in one process do not interfere. The
helpers before it take what they need as arguments.

Decoding: products of at most FEW_ROWS rows (nanoeuler.model.limits) take a matrix-vector kernel of ours
(bound by reading the weights once, and batch-invariant: a row's bits do not depend on the other rows), or
cuBLAS where the Layers were made with batch_invariant False, and `graph` records a decoding step as a CUDA
graph. Positions (rope, the KV cache) are read from device memory, so one recording serves every position.

Precision:
- "fp32": float32 everywhere, plain FP32 cuBLAS and 3xTF32 attention: what `nanoeuler check --gpu` compares
  against the CPU engine;
- "tf32": float32 arrays, matmuls on the TF32 tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32), one TF32
  product per attention tile;
- "bf16": activations and the compute copy of the weights are bfloat16, stored as uint16 arrays (CuPy has
  no bfloat16 dtype; a bf16 is the top half of a float32). Matmuls take bf16 operands and accumulate in
  float32 (cuBLAS compute type 32F); parameter gradients, norm statistics, softmax statistics and losses
  stay float32 (float32 operands, where there are any, compute as in tf32). Each kernel file is compiled
  once per element type (-DACT_BF16=1), chosen by the dtype of the arrays it is given.
"""
import functools
import math

import cupy
import numpy as np

from nanoeuler.model.gpu import runtime
from nanoeuler.model.gpu.constants import (ATT_CACHED_FEW_ROWS, ATT_CACHED_GROUP, ATT_CACHED_WARPS_MANY,
                                           ATT_THREADS, ATT_TILE, ATT_WARPS, ATT_WARPS_D128, EMB_SEGMENT,
                                           MATMUL_FEW_WARPS, MATMUL_FINISH_THREADS, MATMUL_PAIR, MATMUL_PAIR_WARPS,
                                           MATMUL_ROWS_MIN_TILES, MATMUL_ROWS_NT, MATMUL_ROWS_STAGES,
                                           MATMUL_ROWS_WARPS, MATMUL_ROWS_XSPLIT, MATMUL_SMALL_LOADS,
                                           MATMUL_SMALL_WARPS,
                                           MATMUL_SPLIT_BLOCKS, MATMUL_SPLIT_BYTES, MATMUL_SPLIT_MIN_WEIGHTS,
                                           MATMUL_SPLIT_NT, MATMUL_SPLIT_WARPS,
                                           NORM_APART_WEIGHTS,
                                           RMSNORM_ROWS_CHUNKS, RMSNORM_ROWS_THREADS,
                                           ROPE_HEADS, SAMPLE_BUCKETS, SAMPLE_LIST, SAMPLE_LOADS,
                                           SAMPLE_THREADS, ARGMAX_THREADS, ARGMAX_LOADS,
                                           rmsnorm_backward_blocks, rmsnorm_chunks)
from nanoeuler.model.gpu.runtime import BF16, F32, kernel, launch, sm_count
from nanoeuler.model.limits import CLIP_EPS, FEW_ROWS

from nanoeuler.errors import UserError
from nanoeuler.model.gpu import quantized  # products with quantized weights

PRECISIONS = ("bf16", "tf32", "fp32")


# ------------------------------------------------------------------------------------------- arguments
def _act_defines(a):
    """The compile-time defines for kernels whose activations have a's dtype."""
    return ("ACT_BF16=1",) if a.dtype == BF16 else ()


def _i32(x):
    return np.int32(x)


def _f32(x):
    return np.float32(x)


def _vec(n):
    """Elements per thread of the kernels that take 4 at once when the row length allows (common.cuh)."""
    return 4 if n % 4 == 0 else 1


def _blocks(n, threads):
    return (int(n) + threads - 1) // threads


def _check(*arrays, act=None):
    """Contiguous arrays of one activation dtype (act's), or float32 where act is None."""
    dtype = F32 if act is None else act.dtype
    for a in arrays:
        assert a.dtype == dtype and a.flags.c_contiguous, (a.dtype, dtype, a.shape, a.strides)


def _position(pos):
    assert pos.dtype == np.int32 and pos.ndim == 1 and pos.flags.c_contiguous, (pos.dtype, pos.shape)
    return pos


def _row_stride(a, dtype):
    """The row stride, in elements, of a 2-D array of dtype whose rows are contiguous (a column slice of a
    wider one allowed): cuBLAS's leading dimension."""
    assert a.dtype == dtype and a.ndim == 2 and a.strides[1] == a.itemsize, (a.dtype, dtype, a.shape, a.strides)
    return a.strides[0] // a.itemsize


# ---------------------------------------------------------------------------------------------- matmul
def _matmul_small(out, x, w, accumulate, gain=None, rstd=None, eps=0.0, glu_out=None, rope=None, skip=None,
                  bias=None):
    """The matrix-vector kernels on N <= FEW_ROWS rows of x (tensor-core products, kernels/matmul.cu), a row's
    arithmetic the same in each: up to 8 rows matmul_small (a block a tile of 8 rows of w); 9 to 64 rows of a
    product of at least MATMUL_ROWS_MIN_TILES tiles matmul_rows_t<tiles of 16> (x's rows in shared memory, shared
    by a block's many tiles of w), of a smaller one of at least MATMUL_SPLIT_MIN_WEIGHTS weights matmul_split_t<tiles
    of 16> (matmul_rows' blocks, a row's virtual warps split over grid.y, each one's sums into a scratch, then
    matmul_split_finish adds them in order and finishes the items; _split_group), of a smaller one still
    matmul_small_t<tiles of 16>_n<tiles of w a warp> (x's rows from L2 for each warp: more blocks and warps for a
    few tiles; _product_split).
    RMSNorm folded in when given its gain; SwiGLU of the gate|up product into glu_out, or the rotary embedding
    (rope = (cos, sin, pos, T, rotated rows, D/2); pos one position, or one a sequence of T rows) of the qkv
    product, when given, after adding bias (O,) where given. A row's k-split is that of its virtual warps (from
    the row length I alone, so a row's sums run in the same order whatever N is, and a speculative step's rows
    get plain decoding's bits): as many as give each thread MATMUL_SMALL_LOADS 16-byte loads of w, at most
    MATMUL_SMALL_WARPS. skip: where given, receives a copy of x first (rmsnorm_matmul_forward's residual copy,
    for a full forward of a few rows; decoding updates its stream in place)."""
    if skip is not None:
        skip[...] = x
    N, O, I = out.shape[0], w.shape[0], w.shape[1]
    assert N <= FEW_ROWS
    tiles = 0 if N <= 8 else -(-N // 16)  # x's tiles of 16 rows (0: up to 8 rows, matmul_small)
    aligned = [a.data.ptr % 16 == 0 for a in (x, w) + ((gain,) if gain is not None else ())]
    pack = 16 // x.itemsize
    packed = I % pack == 0 and all(aligned)
    k_blocks = -(-I // (4 * pack))  # a warp's 4 threads x 16 bytes at a time
    warps = min(MATMUL_SMALL_WARPS, -(-k_blocks // MATMUL_SMALL_LOADS))  # virtual: a row's k-split
    null = np.uint64(0)
    cos, sin, pos, T, rot, half = rope if rope is not None else (null, null, null, 1, 0, 0)
    pos_stride = int(rope is not None and pos.size > 1)  # a position a sequence, or one for all
    if glu_out is not None:
        half = O // 2
    tiles_of_w = _blocks(O // 2, 4) if half else _blocks(O, 8)  # 8 rows of w a tile: the mma's n
    smem, groups, parts = 0, 1, null
    split = _split_group(tiles, tiles_of_w, O, I, warps, pack, N) if packed else 0  # its kernels load whole chunks
    physical = _rows_warps(tiles_of_w, tiles) if tiles and tiles_of_w >= MATMUL_ROWS_MIN_TILES and not split else 0
    if physical:  # a whole number of x's groups (matmul_rows' RowsSplit)
        physical = max(physical, _rows_x_groups(tiles))
    if split:
        # a row's virtual warps in groups of `split` over grid.y, each one's sums into the scratch
        physical, groups, width = MATMUL_SPLIT_WARPS, split, 8 * tiles_of_w
        rounds = -(-I // (warps * MATMUL_SMALL_LOADS * 4 * pack))
        smem = _rows_smem(tiles, physical, min(MATMUL_ROWS_STAGES, split * rounds), MATMUL_SPLIT_NT)
        kern = kernel("matmul", f"matmul_split_t{tiles}", _act_defines(x), dynamic_smem=smem)
        grid = (_blocks(tiles_of_w, physical * MATMUL_SPLIT_NT), _blocks(warps, split))
        parts = quantized.scratch((warps * N * (width + 1),), F32)
    elif physical:
        smem = _rows_smem(tiles, physical)
        kern = kernel("matmul", f"matmul_rows_t{tiles}", _act_defines(x), dynamic_smem=smem)
        grid = (_rows_blocks(_blocks(tiles_of_w, physical * MATMUL_ROWS_NT), kern, physical, smem + 64 * tiles),)
    else:
        kernel_of = lambda row_tiles, per_warp: kernel(
            "matmul", f"matmul_small_t{row_tiles}_n{per_warp}" if row_tiles else "matmul_small", _act_defines(x))
        physical = _physical_warps(warps, tiles_of_w, kernel_of(0, 1)) if tiles == 0 else warps
        row_tiles, groups, per_warp = _product_split(tiles, tiles_of_w, physical, kernel_of)
        kern = kernel_of(row_tiles, per_warp)
        grid = (_blocks(tiles_of_w, groups * per_warp), _blocks(N, 16 * row_tiles if row_tiles else 8))
    args = (out, x, w, _i32(N), _i32(O), _i32(I), _i32(out.dtype == F32 and x.dtype != F32), _i32(accumulate),
            _i32(packed), null if gain is None else gain, null if rstd is None else rstd, _f32(eps), _i32(half),
            null if glu_out is None else glu_out, null if bias is None else bias, cos, sin, pos, _i32(T),
            _i32(pos_stride), _i32(rot), _i32(groups), _i32(warps), parts)
    launch(kern, grid, (32 * physical,), args, shared_mem=smem)
    if split:  # the sums in virtual-warp order, then the epilogue: an item a thread
        launch(kernel("matmul", "matmul_split_finish", _act_defines(x)),
               (_blocks(N * width // 2, MATMUL_FINISH_THREADS),), (MATMUL_FINISH_THREADS,), args)


def _folds_quantized(w, x, xn):
    """Whether a quantized product folds its input's RMSNorm (and SwiGLU or the rotary embedding) in: bf16
    activations (quantized.matmul's tensor-core kernel) on at most FEW_ROWS rows where nobody reads the normed
    input."""
    return isinstance(w, quantized.QuantizedMatrix) and x.dtype == BF16 and xn is None and x.shape[0] <= FEW_ROWS


def _dequantized(w, x):
    """w as the products of x's rows take it: a QuantizedMatrix in a product of more than FEW_ROWS rows (training,
    a full forward) dequantized into quantized.dequantized_scratch, in x's type (bf16 rounds each weight once;
    float32 is exact), so the product is cuBLAS's, as for a float w of those values: the quantized kernels
    read the packed weights again from L2 for every 16 rows, far slower than cuBLAS at thousands of rows.
    The scratch holds one matrix at a time, shared with the backward pass, and is made on first use: never
    inside a CUDA graph, which records only steps of at most FEW_ROWS rows (decoding, prefill's chunks),
    whose products keep the quantized kernels (batch-invariant; nothing dequantized). w itself otherwise, and where w is larger than
    one slice of quantized.row_slices (matmul_forward then takes it a slice at a time: _sliced_forward)."""
    if not isinstance(w, quantized.QuantizedMatrix) or x.shape[0] <= FEW_ROWS or len(quantized.row_slices(w)) > 1:
        return w
    assert not cupy.cuda.get_current_stream().is_capturing(), "a scratch made inside a CUDA graph"
    return quantized.dequantize(w, x.dtype, quantized.dequantized_scratch(w.shape, x.dtype))


def _sliced_forward(out, x, w, accumulate, tf32):
    """out (N, O) (+)= x (N, I) @ W.T for a QuantizedMatrix W of several row slices (quantized.row_slices): each
    slice dequantized into the scratch in turn, its product written into out's matching columns (cuBLAS's ldc is
    out's row stride)."""
    _check(x, act=x)
    assert out.flags.c_contiguous and out.dtype in (F32, x.dtype)
    (N, I), O = x.shape, w.shape[0]
    for start, stop in quantized.row_slices(w):
        part = _dequantized(w.rows(start, stop), x)
        runtime.gemm(True, False, stop - start, N, I, part, I, x, I, out[:, start:], O, accumulate, tf32)


def _sliced_backward(dx, dout, w, tf32, cast):
    """dx (N, I) = dout (N, O) @ W for a QuantizedMatrix W of several row slices: each slice dequantized into the
    scratch in turn and multiplied by dout's matching columns, the products summed in float32 (in dx, or for bf16
    in a float32 buffer rounded into dx once by cast: no rounding to bf16 between slices)."""
    _check(dx, dout, act=dout)
    (N, I), O = dx.shape, w.shape[0]
    total = dx if dx.dtype == F32 else cupy.empty((N, I), dtype=F32)
    for k, (start, stop) in enumerate(quantized.row_slices(w)):
        part = quantized.dequantize(w.rows(start, stop), dout.dtype,
                                    quantized.dequantized_scratch((stop - start, I), dout.dtype))
        runtime.gemm(False, False, I, N, stop - start, part, I, dout[:, start:], O, total, I, k > 0, tf32)
    if total is not dx:
        cast(dx.reshape(-1), total.reshape(-1))


def _copy_skip(skip, x):
    """rmsnorm_matmul_forward's residual copy, where asked."""
    if skip is not None:
        skip[...] = x


def _physical_warps(virtual, blocks, kern):
    """The warps a block of matmul_small (up to 8 rows, a block a tile of w), each running virtual / that many
    of the row's virtual warps in turn (the same bits whatever the count): the most that divide `virtual`, at
    most MATMUL_FEW_WARPS[1] where the product's blocks fill every SM at that size (a large product: more
    blocks resident an SM, one's loads overlapping another's sums), else at most MATMUL_FEW_WARPS[0] (a small
    one: fewer turns a block)."""
    registers = cupy.cuda.Device().attributes["MaxRegistersPerMultiprocessor"]
    most = lambda cap: max(d for d in range(1, min(virtual, cap) + 1) if virtual % d == 0)
    small = most(MATMUL_FEW_WARPS[1])
    resident = sm_count() * (registers // (32 * small * kern.num_regs))
    return small if blocks >= resident else most(MATMUL_FEW_WARPS[0])


def _rows_smem(tiles, warps, stages=MATMUL_ROWS_STAGES, per_warp=MATMUL_ROWS_NT):
    """Bytes of dynamic shared memory of a matmul_rows (or matmul_split) block of `warps` warps, each taking
    per_warp tiles of w, on `tiles` tiles of 16 rows of x: `stages` stages of x's rows, the gain and the block's
    tiles of w, in 16-byte chunks."""
    stage = (tiles * MATMUL_SMALL_LOADS * 64 + MATMUL_SMALL_LOADS * 4
             + warps * per_warp * MATMUL_SMALL_LOADS * 32)
    return stages * 16 * stage


def _rows_blocks(groups, kern, warps, smem):
    """The blocks of matmul_rows (kern: `warps` warps, smem bytes of shared memory a block) for `groups` groups of
    tiles of w: a block a group where they are all resident at once, else as many as are, each walking its groups
    in turn (blockIdx.x, + gridDim.x, ...) with its stages' pipeline running on from one group's last stage into
    the next one's first, so that no block starts or ends a wave. The same bits whichever."""
    device = cupy.cuda.Device()
    per_sm = cupy.cuda.runtime.deviceGetAttribute(81, device.id)  # cudaDevAttrMaxSharedMemoryPerMultiprocessor
    registers = device.attributes["MaxRegistersPerMultiprocessor"]
    resident = min(per_sm // (smem + 1024),  # + the block's reserved shared memory
                   registers // (32 * warps * -(-kern.num_regs // 8) * 8),  # registers go to a warp 256 at a time
                   cupy.cuda.runtime.deviceGetAttribute(39, device.id) // (32 * warps))  # threads an SM
    return min(groups, sm_count() * max(1, resident))


def _split_group(tiles, tiles_of_w, O, I, vwarps, pack, N):
    """The virtual warps a block of matmul_split_t<tiles> takes (consecutive ones; grid.y their groups), or 0
    where the product does not split: up to 8 rows, products under MATMUL_SPLIT_MIN_WEIGHTS weights (the tile
    kernels keep them), those with the tiles of w for matmul_rows, and a scratch over MATMUL_SPLIT_BYTES. Else
    the fewest that let all the blocks be resident at once (MATMUL_SPLIT_BLOCKS an SM where the shared memory
    of their stages allows): every block reads x's rows for its virtual warps once, and the scratch holds each
    virtual warp's sums whatever the split. The same bits whichever (matmul_split_finish adds them in order)."""
    width = 8 * tiles_of_w
    if (not tiles or O * I < MATMUL_SPLIT_MIN_WEIGHTS or tiles_of_w >= MATMUL_ROWS_MIN_TILES
            or 4 * vwarps * N * (width + 1) > MATMUL_SPLIT_BYTES):
        return 0
    rounds = -(-I // (vwarps * MATMUL_SMALL_LOADS * 4 * pack))
    tile_blocks = _blocks(tiles_of_w, MATMUL_SPLIT_WARPS * MATMUL_SPLIT_NT)
    device = cupy.cuda.Device().id
    per_sm = cupy.cuda.runtime.deviceGetAttribute(81, device)  # cudaDevAttrMaxSharedMemoryPerMultiprocessor
    for group in range(1, vwarps + 1):
        smem = _rows_smem(tiles, MATMUL_SPLIT_WARPS, min(MATMUL_ROWS_STAGES, group * rounds),
                          MATMUL_SPLIT_NT) + 1024  # + reserved
        if tile_blocks * _blocks(vwarps, group) <= sm_count() * min(MATMUL_SPLIT_BLOCKS, per_sm // smem):
            return group
    return vwarps


def _rows_x_groups(tiles):
    """The groups a block of matmul_rows_t<tiles> splits its warps in, each taking its share of x's tiles
    (matmul.cu's RowsSplit): MATMUL_ROWS_XSPLIT at 4 tiles, else 1; a block's warps are a multiple of it."""
    return MATMUL_ROWS_XSPLIT if tiles == 4 else 1


def _rows_warps(tiles_of_w, tiles):
    """The warps a block of matmul_rows (each MATMUL_ROWS_NT tiles of w) for a product of tiles_of_w tiles of w
    and `tiles` tiles of x: the most, up to MATMUL_ROWS_WARPS and a multiple of x's groups (_rows_x_groups), whose
    stages fit a block's shared memory on this GPU and that still give nearly every SM a block (each block reads
    all of x's rows from L2 once); 0 where none fits (the tile kernels then). The same bits whichever."""
    limit = cupy.cuda.runtime.deviceGetAttribute(97, cupy.cuda.Device().id)  # cudaDevAttrMaxSharedMemoryPerBlockOptin
    fits = [w for w in (MATMUL_ROWS_WARPS, MATMUL_ROWS_WARPS // 2, MATMUL_ROWS_WARPS // 4, 1)
            if _rows_smem(tiles, w) + 64 * 4 <= limit  # and the rows' sums of squares (static)
            and w % _rows_x_groups(tiles) == 0]
    filling = [w for w in fits if _blocks(tiles_of_w, w * MATMUL_ROWS_NT) >= 0.9 * sm_count()]
    return filling[0] if filling else (fits[-1] if fits else 0)


def _product_split(tiles, tiles_of_w, warps, kernel_of):
    """(x's tiles of 16 rows a block, w's tiles a warp's at once, units of those a block) for a product of
    `tiles` tiles of x (0: up to 8 rows) in blocks of `warps` warps; kernel_of(row tiles, tiles a warp) the
    kernel. A row's arithmetic is the same whichever. Many rows: a warp takes MATMUL_PAIR tiles of w at once
    where its block is small enough to hold their registers (x's fragments loaded once for both); a block
    takes such units in turn, as many as make one wave, rereading x from L1; where there are few of them, x's
    rows are split over blocks, as finely as keeps them all resident at once."""
    if tiles == 0:
        return 0, 1, 1
    per_warp = MATMUL_PAIR if warps <= MATMUL_PAIR_WARPS else 1
    units = _blocks(tiles_of_w, per_warp)
    registers = cupy.cuda.Device().attributes["MaxRegistersPerMultiprocessor"]  # blocks an SM: by their registers
    resident = lambda row_tiles: sm_count() * (registers // (32 * warps * kernel_of(row_tiles, per_warp).num_regs))
    groups = min(8, _blocks(units, resident(tiles)))
    row_tiles = next((n for n in range(1, tiles) if _blocks(units, groups) * -(-tiles // n) <= resident(n)), tiles)
    return row_tiles, groups, per_warp


# --------------------------------------------------------------------------------------------- rmsnorm
def _rmsnorm_chunks(C, *arrays):
    """K of the rmsnorm kernels that hold a row in registers (kernels/rmsnorm.cu: lane l takes the 16-byte
    chunks l, l + 32, ... of a row, at most 32 elements a lane), or None where those do not apply (C not a
    multiple of 16 bytes of elements, an array not 16-byte aligned, C over 1024): the generic kernels."""
    pack = 16 // arrays[0].itemsize
    if C % pack or any(a.data.ptr % 16 for a in arrays):
        return None
    need = -(-C // (32 * pack))
    return next((k for k in rmsnorm_chunks(arrays[0].dtype == BF16) if k >= need), None)


def _rmsnorm_forward(out, rstd, x, w, eps, skip):
    """rmsnorm_forward, and with skip (N, C) a copy of x there (rmsnorm_matmul_forward)."""
    _check(out, x, w, act=x)
    _check(rstd)
    if skip is not None:
        _check(skip, act=x)
    N, C = x.shape
    K = _rmsnorm_chunks(C, out, x, w, *(() if skip is None else (skip,)))
    kernel("rmsnorm", "rmsnorm_forward" if K is None else f"rmsnorm_forward_k{K}", _act_defines(x))(
        (_blocks(N, 8),), (256,),
        (out, rstd, x, w, _i32(N), _i32(C), _f32(eps), np.uint64(0) if skip is None else skip))


def _norm_apart(w, x, xn):
    """Whether a large product of a few rows (decoding's gate|up and head) takes its normed input from
    rmsnorm_rows rather than folding the norm in: folded, each of the product's many blocks also sums the squares
    of x and multiplies its w by the gain, which costs a product of NORM_APART_WEIGHTS or more more than a kernel
    of its own does (docs/decoding.md has both measured). The choice follows the shape alone, never the rows."""
    return (xn is None and x.shape[0] <= FEW_ROWS and w.shape[0] * w.shape[1] >= NORM_APART_WEIGHTS
            and (x.dtype == BF16 or not isinstance(w, quantized.QuantizedMatrix)))


def _normed_rows(rstd, x, norm_w, eps, skip):
    """Decoding's normed rows: rmsnorm(x (N, C)) * norm_w into a kept buffer (quantized.scratch: graphs replay
    it), a block a row (rmsnorm_rows, dependent launch) where C and the pointers allow, else the generic kernel;
    either way a row's bits depend on C alone. skip as rmsnorm_matmul_forward."""
    _check(x, norm_w, act=x)
    _check(rstd)
    xn = quantized.scratch(x.shape, x.dtype)
    N, C = x.shape
    pack = 16 // x.itemsize
    if C % pack or C > RMSNORM_ROWS_THREADS * RMSNORM_ROWS_CHUNKS * pack or any(
            a.data.ptr % 16 for a in (xn, x, norm_w)):
        _rmsnorm_forward(xn, rstd, x, norm_w, eps, skip)
        return xn
    _copy_skip(skip, x)
    threads = min(RMSNORM_ROWS_THREADS, (C // pack + 31) // 32 * 32)
    launch(kernel("rmsnorm", "rmsnorm_rows", _act_defines(x)), (N,), (threads,),
           (xn, rstd, x, norm_w, _i32(C), _f32(eps)))
    return xn


def _bias_add(out, bias):
    """out (N, O) += bias (O,) (kernels/bias.cu), 4 columns a thread where O and the pointers allow."""
    _check(out, bias, act=out)
    N, O = out.shape
    vec = int(O % 4 == 0 and all(a.data.ptr % (4 * a.itemsize) == 0 for a in (out, bias)))
    kernel("bias", "bias_add", _act_defines(out))((_blocks(N * O // (4 if vec else 1), 256),), (256,),
                                                   (out, bias, _i32(N), _i32(O), _i32(vec)))


# ------------------------------------------------------------------------------------------------ rope
def _rope(qkv, cos, sin, n_rot_heads, pos, sign):
    """rope_rotate_rows (a row of threads per (b, t) row, 16-byte accesses, cos and sin read once for
    ROPE_HEADS heads) where D/2 is a multiple of 16 bytes of elements and the arrays are 16-byte aligned;
    rope_rotate (a thread per 4 pairs, or 1) otherwise."""
    _check(qkv, act=qkv)
    _check(cos, sin)
    B, T, NH, D = qkv.shape
    assert pos.size in (1, B), (pos.shape, B)
    half, pack = D // 2, 16 // qkv.itemsize
    args = (qkv, cos, sin)
    where = (_position(pos), _i32(pos.size > 1), _f32(sign))  # a position for all, or one a sequence
    threads = half // pack * -(-n_rot_heads // ROPE_HEADS)  # a (b, t) row's
    if half % pack == 0 and all(a.data.ptr % 16 == 0 for a in args) and 0 < threads <= 256:
        rows = 256 // threads
        kernel("rope", "rope_rotate_rows", _act_defines(qkv))(
            (_blocks(B * T, rows),), (threads, rows),
            args + (_i32(B * T), _i32(T), _i32(NH), _i32(n_rot_heads), _i32(D)) + where)
        return
    n = B * T * n_rot_heads * half
    kernel("rope", "rope_rotate", _act_defines(qkv))(
        (_blocks(n // _vec(half), 256),), (256,),
        args + (_i32(B), _i32(T), _i32(NH), _i32(n_rot_heads), _i32(D)) + where)


# ------------------------------------------------------------------------------------------- attention
def _attention_defines(a, tf32):
    """bf16 or float32 operands; float32 operands without tf32 (precision fp32) take the 3xTF32 (float32-accurate)
    path."""
    return _act_defines(a) + (() if tf32 else ("ATT_PRECISE=1",))


@functools.lru_cache(maxsize=None)
def _attention_launch(D, defines):
    """What attention.cu derives from its tile layout (attention_launch_d<D>): the forward's threads a block, the
    dK/dV, the dQ and the forward's dynamic shared memory in bytes. A GPU whose blocks cannot take that much is
    refused in one line (ValueError)."""
    shape = runtime.module("attention", defines).get_global(f"attention_launch_d{D}")
    launch_shape = tuple(int(v) for v in cupy.ndarray((4,), np.int32, memptr=shape).get())
    limit = cupy.cuda.runtime.deviceGetAttribute(97, cupy.cuda.Device().id)  # cudaDevAttrMaxSharedMemoryPerBlockOptin
    if max(launch_shape[1:]) > limit:
        raise ValueError(f"head_dim {D} in this precision takes {max(launch_shape[1:])} bytes of shared memory a "
                         f"block; this GPU's blocks take {limit}: use --precision bf16 or --device cpu")
    return launch_shape


# --------------------------------------------------------------------------------------- cross-entropy
def _ce_threads(V):
    return min(256, 32 * _blocks(V, 32))


def _ce_chunks(logits, V):
    """16-byte pieces of a row a thread when the rows split evenly into 1, 2 or 4 of them (crossentropy.cu
    then holds a row in registers), else 0."""
    piece = 16 // logits.itemsize * _ce_threads(V)
    chunks = V // piece if V % piece == 0 and logits.data.ptr % 16 == 0 else 0
    return chunks if chunks in (1, 2, 4) else 0


# -------------------------------------------------------------------------------------------- decoding
def _argmax_slices(V):
    """The blocks a row of argmax_rows: each thread of a block reads about ARGMAX_LOADS logits."""
    return max(1, min(1024, _blocks(V, ARGMAX_THREADS * ARGMAX_LOADS)))


@functools.lru_cache(maxsize=None)
def _argmax_scratch(device, R, nb):
    """argmax_rows's slices' results and a row's count of finished blocks (zero between launches): allocated on
    the first (unrecorded) run of a step and kept, so the recorded graphs that use them find them."""
    return cupy.empty(R * nb, np.float32), cupy.empty(R * nb, np.int32), cupy.zeros(R, np.uint32)


@functools.lru_cache(maxsize=None)
def _sample_scratch(device, R):
    """The sample_* kernels' scratch for R rows, in the state they leave it in after each step (allocated on the
    first, unrecorded, run of a step and kept): a RowState a row (decoding.cu: 16 words, key_lo and best all
    ones), the count and mass histograms (zeros), the list of a bucket's keys and weights."""
    state = np.zeros((R, 16), np.uint32)
    state[:, 6] = state[:, 12] = state[:, 13] = 0xFFFFFFFF  # key_lo, best
    return (cupy.asarray(state), cupy.zeros(R * SAMPLE_BUCKETS, np.uint32), cupy.zeros(R * SAMPLE_BUCKETS, np.uint64),
            cupy.empty(R * SAMPLE_LIST, np.uint32), cupy.empty(R * SAMPLE_LIST, np.float32))


# ---------------------------------------------------------------------------------------------- layers
class Layers:
    """One engine's GPU layers: the CPU module's layer functions as methods, in its order, launching on the
    current device and stream. precision (PRECISIONS) sets how float32 operands multiply: on the TF32 tensor
    cores (tf32, bf16) or in full float32 (fp32: FP32 cuBLAS, 3xTF32 attention); bf16 arrays are bf16 anyway.
    batch_invariant: the products of at most FEW_ROWS rows take the row-invariant kernels (a row's bits are the
    same whatever the other rows) or, off, cuBLAS, whose rounding depends on the row count (faster for many
    rows; docs/decoding.md)."""

    def __init__(self, precision, batch_invariant):
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}")
        self.precision, self.batch_invariant = precision, bool(batch_invariant)
        self.tf32 = precision != "fp32"  # float32 operands on the TF32 tensor cores

    def activation_dtype(self, dtype):
        """The element type of activations and of the weights' compute copy."""
        if np.dtype(dtype) != F32:
            raise ValueError("the GPU engine computes in float32 or bfloat16, not float64")
        return BF16 if self.precision == "bf16" else F32

    # ------------------------------------------------------------------------------------------ matmul
    def matmul_forward(self, out, x, w, accumulate=False):
        """out (N, O) = x (N, I) @ w (O, I).T, += when accumulate. Row-major out is column-major out.T, so
        cuBLAS computes out.T (O, N) = w (O, I) @ x.T (I, N). out may be float32 for bf16 x, w. At most FEW_ROWS
        rows (decoding) take the matrix-vector kernel, in float32 arithmetic whatever the precision. A quantized w
        (quantized_matrix) takes gpu/quantized.py's products, or of more rows its dequantized copy (_dequantized),
        a slice of rows at a time where it is larger than one (_sliced_forward)."""
        w = _dequantized(w, x)
        if isinstance(w, quantized.QuantizedMatrix):
            if x.shape[0] > FEW_ROWS:
                _sliced_forward(out, x, w, accumulate, self.tf32)
            else:
                quantized.matmul(out, x, w, accumulate, self.tf32)
            return
        _check(x, w, act=x)
        assert out.flags.c_contiguous and out.dtype in (F32, x.dtype)
        (N, I), O = x.shape, w.shape[0]
        if N > FEW_ROWS or not self.batch_invariant:
            runtime.gemm(True, False, O, N, I, w, I, x, I, out, O, accumulate, self.tf32)
        else:
            _matmul_small(out, x, w, accumulate)

    def matmul_backward(self, dx, dw, dout, x, w, dbias=None):
        """dx (N, I) = dout (N, O) @ w; dw (O, I) += dout.T @ x (dw float32, the others activations; None: not
        computed; a QuantizedMatrix w, frozen, is dequantized into one scratch of the activations' type shared by
        every such product, then cuBLAS: bf16 rounds the dequantized weights to bf16; a slice of rows at a time
        where it is larger than one: _sliced_backward); where given, dbias (O,) float32 += the column sums of
        dout, as the product of dout.T with a column of ones."""
        if isinstance(w, quantized.QuantizedMatrix):  # a frozen quantized base (QLoRA): its input gradient alone
            assert dw is None, "a quantized matrix is frozen"
            if len(quantized.row_slices(w)) > 1:
                _sliced_backward(dx, dout, w, self.tf32, self.cast_params)
                w = None  # dx done
            else:
                w = quantized.dequantize(w, dout.dtype, quantized.dequantized_scratch(w.shape, dout.dtype))
        _check(dx, dout, x, act=x)
        if dw is not None:
            _check(dw)
        (N, I), O = x.shape, dout.shape[1]
        if w is not None:
            _check(w, act=x)
            runtime.gemm(False, False, I, N, O, w, I, dout, O, dx, I, False, self.tf32)
        if dw is not None:  # None: a frozen weight (LoRA's base), whose input gradient alone is wanted
            runtime.gemm(False, True, I, O, N, x, I, dout, O, dw, I, True, self.tf32)
        if dbias is not None:
            _check(dbias)
            ones = cupy.full(N, 0x3F80, dtype=BF16) if dout.dtype == BF16 else cupy.ones(N, dtype=F32)  # bf16 1.0
            runtime.gemm(False, True, 1, O, N, ones, 1, dout, O, dbias, 1, True, self.tf32)

    @staticmethod
    def quantized_matrix(qt):
        """A host QuantizedTensor in the layout the quantized products read (gpu/quantized.py), on the device."""
        try:
            return quantized.QuantizedMatrix.of(qt)
        except ValueError as e:
            raise UserError(str(e)) from None

    def _apart_product(self, out, normed, w, glu_out=None):
        """out (N, O) = normed (N, C) @ w.T (then SwiGLU into glu_out, where given): the product after a norm
        apart (_norm_apart), on the few-row kernels of w's kind."""
        if isinstance(w, quantized.QuantizedMatrix):
            quantized.matmul(out, normed, w, False, self.tf32, glu_out=glu_out)
        else:
            _check(w, act=normed)
            _matmul_small(out, normed, w, False, glu_out=glu_out)

    def rmsnorm_matmul_forward(self, out, rstd, x, norm_w, w, eps, xn, skip=None):
        """out (N, O) = rmsnorm(x (N, C)) * norm_w @ w (O, C).T, rstd (N,); xn (N, C) receives the normed input
        (what the backward multiplies with), or is None where nobody reads it. skip (N, C), where given, receives
        a copy of x: the next buffer of the residual stream, which the sublayer's output is then added to; the copy
        rides on the norm's read of x. A few rows without xn (decoding) take one kernel that normalises its input
        on the way, or for a large w (_norm_apart: the head) the norm's kernel, then the product; else the norm
        into xn, then the product (a quantized w of more than FEW_ROWS rows: its dequantized copy's,
        _dequantized)."""
        w = _dequantized(w, x)
        packed = isinstance(w, quantized.QuantizedMatrix)
        if _norm_apart(w, x, xn):  # decoding's head: the norm a kernel of its own, as gate|up's
            self._apart_product(out, _normed_rows(rstd, x, norm_w, eps, skip), w)
            return
        if _folds_quantized(w, x, xn):  # one kernel, the norm folded in
            _copy_skip(skip, x)
            quantized.matmul(out, x, w, False, self.tf32, gain=norm_w, rstd=rstd, eps=eps)
            return
        if x.shape[0] > FEW_ROWS or xn is not None or packed:
            if xn is None:  # a step of more rows than a graph takes: a temporary (quantized: kept, graphs take it)
                xn = quantized.scratch(x.shape, x.dtype) if packed else cupy.empty_like(x)
            _rmsnorm_forward(xn, rstd, x, norm_w, eps, skip)
            self.matmul_forward(out, xn, w)
            return
        _check(x, norm_w, w, act=x)
        _check(rstd)
        _matmul_small(out, x, w, False, norm_w, rstd, eps, skip=skip)

    def rmsnorm_matmul_rope_forward(self, qkv, rstd, x, norm_w, w, eps, xn, cos, sin, n_rot_heads, pos, skip=None,
                                    bias=None):
        """The attention's input: qkv (B, T, H+2G, D) = rmsnorm(x (B*T, C)) * norm_w @ w.T (+ bias (H+2G)*D, where
        given), then the rotary embedding of its first n_rot_heads heads at positions pos[0] + t (or pos[b] + t: a
        position a sequence, decoding's few rows only); xn, skip as rmsnorm_matmul_forward. A few rows (decoding)
        take one kernel."""
        B, T, NH, D = qkv.shape
        assert pos.size in (1, B), (pos.shape, B)
        w = _dequantized(w, x)
        if _folds_quantized(w, x, xn):
            _copy_skip(skip, x)
            quantized.matmul(qkv.reshape(B * T, -1), x, w, False, self.tf32, gain=norm_w, rstd=rstd, eps=eps,
                             rope=(cos, sin, _position(pos), T, n_rot_heads * D, D // 2), bias=bias)
            return
        if B * T > FEW_ROWS or xn is not None or isinstance(w, quantized.QuantizedMatrix):
            self.rmsnorm_matmul_forward(qkv.reshape(B * T, -1), rstd, x, norm_w, w, eps, xn, skip)
            if bias is not None:
                _bias_add(qkv.reshape(B * T, -1), bias)
            self.rope_forward(qkv, cos, sin, n_rot_heads, pos)
            return
        _check(qkv, x, norm_w, w, act=x)
        _check(rstd, cos, sin)
        if bias is not None:
            _check(bias, act=x)
        _matmul_small(qkv.reshape(B * T, -1), x, w, False, norm_w, rstd, eps,
                      rope=(cos, sin, _position(pos), T, n_rot_heads * D, D // 2), skip=skip, bias=bias)

    def rmsnorm_matmul_swiglu_forward(self, out, gate_up, rstd, x, norm_w, w, eps, xn, skip=None):
        """The feed-forward's first half: gate_up (N, 2F) = rmsnorm(x) * norm_w @ w (2F, C).T, out (N, F) =
        silu(gate) * up; xn, skip as rmsnorm_matmul_forward. A few rows without xn (decoding) take two kernels: the
        norm (_normed_rows), then the product and SwiGLU."""
        w = _dequantized(w, x)
        if _norm_apart(w, x, xn):
            _check(out, gate_up, act=x)
            self._apart_product(gate_up, _normed_rows(rstd, x, norm_w, eps, skip), w, glu_out=out)
            return
        if _folds_quantized(w, x, xn):
            _copy_skip(skip, x)
            quantized.matmul(gate_up, x, w, False, self.tf32, gain=norm_w, rstd=rstd, eps=eps, glu_out=out)
            return
        if x.shape[0] > FEW_ROWS or xn is not None or isinstance(w, quantized.QuantizedMatrix):
            self.rmsnorm_matmul_forward(gate_up, rstd, x, norm_w, w, eps, xn, skip)
            self.swiglu_forward(out, gate_up)
            return
        _check(out, gate_up, x, norm_w, w, act=x)
        _check(rstd)
        _matmul_small(gate_up, x, w, False, norm_w, rstd, eps, glu_out=out, skip=skip)

    # --------------------------------------------------------------------------------------- embedding
    def embedding_forward(self, out, tokens, emb):
        """out (N, C) = emb (V, C)[tokens (N,)] (dependent launch: a recorded decoding step's first kernel lets
        the first product load its weights meanwhile)"""
        _check(out, emb, act=emb)
        N, C = out.shape
        tokens = cupy.ascontiguousarray(tokens, dtype=np.int32)
        launch(kernel("embedding", "embedding_forward", _act_defines(emb)), (_blocks(N * C, 256),), (256,),
               (out, tokens, emb, _i32(N), _i32(C)))

    def embedding_backward(self, demb, dout, tokens):
        """demb (V, C) += dout (N, C) scattered by token; each token's rows summed in position order in pieces
        of at most EMB_SEGMENT, the pieces' sums added in order (the sort is a deterministic radix sort), so the
        result is the same on every run."""
        _check(demb)
        _check(dout, act=dout)
        N, C = dout.shape
        tokens = cupy.ascontiguousarray(tokens, dtype=np.int32)
        order = cupy.argsort(tokens).astype(np.int32)
        sorted_tokens = tokens[order]
        segments = _blocks(N, EMB_SEGMENT)
        partial = cupy.empty((segments, C), dtype=np.float32)
        defines, threads = _act_defines(dout), (min(256, 32 * _blocks(C, 32)),)
        kernel("embedding", "embedding_backward_segments", defines)(
            (segments,), threads, (partial, dout, order, sorted_tokens, _i32(N), _i32(C)))
        kernel("embedding", "embedding_backward", defines)(
            (N,), threads, (demb, dout, order, sorted_tokens, partial, _i32(N), _i32(C)))

    # ----------------------------------------------------------------------------------------- rmsnorm
    def rmsnorm_forward(self, out, rstd, x, w, eps):
        """out (N, C) = x / sqrt(mean(x^2) + eps) * w; rstd (N,)"""
        _rmsnorm_forward(out, rstd, x, w, eps, None)

    def rmsnorm_backward(self, dx, dw, dout, x, w, rstd):
        """dx (N, C) += input gradient (the residual stream's); dw (C,) += weight gradient (float32), summed
        over per-block partials in a fixed order: no atomics, the same bits on every run."""
        _check(dx, dout, x, w, act=x)
        _check(dw, rstd)
        N, C = x.shape
        K = _rmsnorm_chunks(C, dx, dout, x, w)
        per_sm = 2 if K is None else rmsnorm_backward_blocks(K, x.dtype == BF16)  # the kernel's __launch_bounds__
        grid, smem = min(_blocks(N, 8), per_sm * sm_count()), 4 * 8 * C
        partial = cupy.empty((grid, C), dtype=np.float32)
        defines = _act_defines(x)
        name = "rmsnorm_backward" if K is None else f"rmsnorm_backward_k{K}"
        kernel("rmsnorm", name, defines, smem)(
            (grid,), (256,), (dx, partial, dout, x, w, rstd, _i32(N), _i32(C)), shared_mem=smem)
        kernel("rmsnorm", "rmsnorm_dw_reduce", defines)((_blocks(C, 32),), (32, 32), (dw, partial, _i32(grid), _i32(C)))

    # -------------------------------------------------------------------------------------------- rope
    def rope_forward(self, qkv, cos, sin, n_rot_heads, pos):
        """In place on the first n_rot_heads heads of qkv (B, T, H+2G, D), positions pos[0] + t, or pos[b] + t
        where pos holds one position a sequence (int32 on the device)."""
        _rope(qkv, cos, sin, n_rot_heads, pos, 1.0)

    def rope_backward(self, dqkv, cos, sin, n_rot_heads, pos):
        """In place: the inverse rotation."""
        _rope(dqkv, cos, sin, n_rot_heads, pos, -1.0)

    # --------------------------------------------------------------------------------------- attention
    def attention_forward(self, out, lse, qkv, n_heads, n_kv_heads):
        """Causal GQA FlashAttention over qkv (B, T, H+2G, D): out (B, T, H, D), lse (B, H, T)."""
        _check(out, qkv, act=qkv)
        _check(lse)
        B, T, NH, D = qkv.shape
        assert out.shape == (B, T, n_heads, D) and lse.shape == (B, n_heads, T), (out.shape, lse.shape)
        defines = _attention_defines(qkv, self.tf32)
        launch_shape = _attention_launch(D, defines)
        threads, smem = launch_shape[0], launch_shape[3]
        kernel("attention", f"attention_forward_d{D}", defines, smem)(
            (n_heads, B, _blocks(T, ATT_TILE)), (threads,),
            (out, lse, qkv, _i32(T), _i32(n_heads), _i32(n_kv_heads), _f32(1.0 / math.sqrt(D))), shared_mem=smem)

    def attention_cached(self, out, lse, qkv, cache, n_heads, n_kv_heads, pos, slots=None):
        """Decoding: qkv (B, n, H+2G, D)'s k and v heads (k rotated already) into the KV cache (S, context, 2G, D)
        at positions p.., and attention of its queries to the cache's positions 0..p+t, where p is pos[0] (every
        sequence) or pos[b] (a position a sequence) and sequence b's cache row is slots[b] (b where slots is
        None). out (B, n, H, D), lse (B, H, n). One kernel, a block a query row and head (a few rows) or a query
        row and kv head (many rows: its query heads share the key and value loads), whose warps split the keys."""
        _check(out, qkv, cache, act=qkv)
        _check(lse)
        B, n, NH, D = qkv.shape
        S = cache.shape[1]
        assert cache.shape[2:] == (2 * n_kv_heads, D) and out.shape == (B, n, n_heads, D), (cache.shape, out.shape)
        assert pos.size in (1, B) and (cache.shape[0] == B if slots is None else slots.shape == (B,))
        if slots is not None:
            assert slots.dtype == np.int32 and slots.flags.c_contiguous
        # a few rows: a block a query head, all its warps (latency); many: a block a kv head's query heads, which
        # share the loads of its keys and values, fewer warps (throughput). The same bits either way.
        # A 128-wide head: no grouped kernel (it would spill), blocks of fewer warps (registers), the same bits.
        grouped = B * n > ATT_CACHED_FEW_ROWS and n_heads // n_kv_heads <= ATT_CACHED_GROUP and D <= 64
        warps = ATT_WARPS if B * n <= ATT_CACHED_FEW_ROWS else ATT_CACHED_WARPS_MANY
        if D > 64:
            warps = min(warps, ATT_WARPS_D128)
        launch(kernel("attention", f"attention_cached{'_group' if grouped else ''}_d{D}", _act_defines(qkv)),
            (n_kv_heads if grouped else n_heads, B * n), (32 * warps,),
            (out, lse, qkv, cache, _position(pos), _i32(pos.size > 1), np.uint64(0) if slots is None else slots,
             _i32(n), _i32(S), _i32(n_heads), _i32(n_kv_heads), _f32(1.0 / math.sqrt(D))))

    def attention_backward(self, dqkv, dout, out, lse, qkv, n_heads, n_kv_heads, cos=None, sin=None):
        """dqkv (B, T, H+2G, D) overwritten with dq, dk, dv from dout (B, T, H, D); training layout (q_start 0).
        dK and dV come from one kernel (a block per kv head and key tile, looping over its query heads), dQ from
        another (a block per query head and query tile): every element is written once, with no atomics. With
        the rotary tables cos, sin, dq and dk are the gradients of the unrotated q and k (rope_backward folded
        into the kernels' stores, positions 0..T-1)."""
        _check(dqkv, dout, out, qkv, act=qkv)
        _check(lse)
        B, T, NH, D = qkv.shape
        defines, scale = _attention_defines(qkv, self.tf32), _f32(1.0 / math.sqrt(D))
        delta = cupy.empty((B, n_heads, T), dtype=np.float32)
        kernel("attention", "attention_backward_delta", defines)(
            (_blocks(B * T * n_heads, 8),), (256,), (delta, dout, out, _i32(B), _i32(T), _i32(n_heads), _i32(D)))
        if cos is not None:
            _check(cos, sin)
        null = np.uint64(0)
        args = (dqkv, dout, lse, delta, qkv, _i32(T), _i32(n_heads), _i32(n_kv_heads), scale,
                null if cos is None else cos, null if sin is None else sin)
        smem_dkdv, smem_dq = _attention_launch(D, defines)[1:3]
        kernel("attention", f"attention_backward_dkdv_d{D}", defines, smem_dkdv)(
            (n_kv_heads, B, _blocks(T, ATT_TILE)), (ATT_THREADS,), args, shared_mem=smem_dkdv)
        kernel("attention", f"attention_backward_dq_d{D}", defines, smem_dq)(
            (n_heads, B, _blocks(T, ATT_TILE)), (ATT_THREADS,), args, shared_mem=smem_dq)

    # ------------------------------------------------------------------------------------------ swiglu
    def swiglu_forward(self, out, gate_up):
        """out (N, F) = silu(gate) * up from gate_up (N, 2F)"""
        _check(out, gate_up, act=gate_up)
        N, F = out.shape
        kernel("swiglu", "swiglu_forward", _act_defines(gate_up))((_blocks(N * F // _vec(F), 256),), (256,),
                                                                  (out, gate_up, _i32(N), _i32(F)))

    def swiglu_backward(self, dgate_up, dout, gate_up):
        """dgate_up (N, 2F) overwritten"""
        _check(dgate_up, dout, gate_up, act=gate_up)
        N, F = dout.shape
        kernel("swiglu", "swiglu_backward", _act_defines(gate_up))((_blocks(N * F // _vec(F), 256),), (256,),
                                                                   (dgate_up, dout, gate_up, _i32(N), _i32(F)))

    # -------------------------------------------------------------------------------------------- LoRA
    def lora_forward(self, out, h, x, a, b, scale):
        """h (N, r) = x (N, I) @ a (r, I).T, then out (N, O) += scale * h @ b (O, r).T, both on cuBLAS (the
        scale its alpha); out may be a column slice of a wider product (its rows' stride is cuBLAS's ldc), h a
        column slice of the kept low-rank products, or out None: h alone; x None: h as it is (kept from the
        forward pass)."""
        _check(a, b, *(() if x is None else (x,)), act=h)
        ldh = _row_stride(h, h.dtype)
        N, (r, I), O = h.shape[0], a.shape, b.shape[0]
        if x is not None:
            runtime.gemm(True, False, r, N, I, a, I, x, I, h, ldh, False, self.tf32)
        if out is None:
            return
        ldo = _row_stride(out, h.dtype)
        runtime.gemm(True, False, O, N, r, b, r, h, ldh, out, ldo, True, self.tf32, alpha=scale)

    def lora_backward(self, dx, da, db, dh, dout, x, h, a, b, scale, accumulate):
        """Given dout (N, O) (a column slice where the forward's out was): db (O, r) += scale * dout.T @ h;
        dh (N, r) = scale * dout @ b; da (r, I) += dh.T @ x; dx (N, I) += dh @ a (= without accumulate). da, db
        float32, the others activations; four cuBLAS products."""
        _check(dx, dh, x, a, b, act=x)
        _check(da, db)
        ldd, ldh = _row_stride(dout, x.dtype), _row_stride(h, x.dtype)
        (N, I), r, O = x.shape, a.shape[0], b.shape[0]
        runtime.gemm(False, True, r, O, N, h, ldh, dout, ldd, db, r, True, self.tf32, alpha=scale)
        runtime.gemm(False, False, r, N, O, b, r, dout, ldd, dh, r, False, self.tf32, alpha=scale)
        runtime.gemm(False, True, I, r, N, x, I, dh, r, da, I, True, self.tf32)
        runtime.gemm(False, False, I, N, r, a, I, dh, r, dx, I, accumulate, self.tf32)

    def lora_forward_group(self, outs, h, x, a, b, scale):
        """The updates of k targets sharing the input x (q, k, v; gate, up) with one pass over it: h (N, k r) =
        x (N, I) @ a (k r, I).T, a their A matrices stacked; then outs[j] (N, O_j) += scale * h_j @ b[j] (O_j,
        r).T, h_j h's columns j r..(j + 1) r (h a column slice of the kept low-rank products, outs column
        slices of a wider product); 1 + k cuBLAS products. x None: h as it is (kept from the forward pass), a
        unused: the k updates alone."""
        _check(*b, act=h)
        ldh = _row_stride(h, h.dtype)
        N, r = h.shape[0], b[0].shape[1]
        if x is not None:
            _check(x, a, act=h)
            (_, I), R = x.shape, a.shape[0]
            runtime.gemm(True, False, R, N, I, a, I, x, I, h, ldh, False, self.tf32)
        for j, (out, bj) in enumerate(zip(outs, b)):
            runtime.gemm(True, False, bj.shape[0], N, r, bj, r, h[:, j * r:], ldh, out, _row_stride(out, h.dtype),
                         True, self.tf32, alpha=scale)

    def lora_backward_group(self, dx, da, db, dh, douts, x, h, a, b, scale):
        """lora_forward_group's backward pass, one pass over x and one over dx for the k targets: for each j,
        db[j] (O_j, r) += scale * douts[j].T @ h_j and dh_j = scale * douts[j] @ b[j] (dh (N, k r)); then da
        (k r, I) += dh.T @ x and dx (N, I) += dh @ a. da, db float32, the others activations; 2 k + 2 cuBLAS
        products."""
        _check(dx, dh, x, a, *b, act=x)
        _check(da, *db)
        ldh = _row_stride(h, x.dtype)
        (N, I), R, r = x.shape, a.shape[0], b[0].shape[1]
        for j, (dout, bj, dbj) in enumerate(zip(douts, b, db)):
            ldd, O = _row_stride(dout, x.dtype), bj.shape[0]
            runtime.gemm(False, True, r, O, N, h[:, j * r:], ldh, dout, ldd, dbj, r, True, self.tf32, alpha=scale)
            runtime.gemm(False, False, r, N, O, bj, r, dout, ldd, dh[:, j * r:], R, False, self.tf32, alpha=scale)
        runtime.gemm(False, True, I, R, N, x, I, dh, R, da, I, True, self.tf32)
        runtime.gemm(False, False, I, N, R, a, I, dh, R, dx, I, True, self.tf32)

    def dropout_forward(self, out, x, p, key, accumulate):
        """out (N, I) = x * keep / (1 - p) (+= with accumulate), keep from a hash of (key, the element's flat
        index): the CPU layer's mask, bit for bit (kernels/lora.cu)."""
        _check(out, x, act=x)
        n = x.size
        threshold = np.uint32(min(1 << 24, round(p * (1 << 24))))
        kernel("lora", "dropout_forward", _act_defines(x))(
            (min(_blocks(n, 256), 65535 * 8),), (256,),
            (out, x, np.int64(n), np.uint64(key), threshold, _f32(1.0 / (1.0 - p)), _i32(accumulate)))

    def bias_add(self, out, bias):
        """out (N, O) += bias (O,)"""
        _bias_add(out, bias)

    # ----------------------------------------------------------------------------------- cross-entropy
    def crossentropy_forward(self, losses, logits, targets):
        """losses (K, N) from logits (N, K*V) and targets (K, N), -1 ignored."""
        _check(losses)
        _check(logits, act=logits)
        K, N = targets.shape
        V = logits.shape[1] // K
        targets = cupy.ascontiguousarray(targets, dtype=np.int32)
        kernel("crossentropy", "crossentropy_forward", _act_defines(logits))(
            (N, K), (_ce_threads(V),),
            (losses, logits, targets, _i32(N), _i32(K), _i32(V), _i32(_ce_chunks(logits, V))))

    def crossentropy_forward_backward(self, losses, logits, targets, dscale):
        """As crossentropy_forward, then logits := d loss / d logits = (softmax - onehot) * dscale[k, n], dscale
        (K, N) float32."""
        _check(losses, dscale)
        _check(logits, act=logits)
        K, N = targets.shape
        if dscale.shape != (K, N):
            raise ValueError(f"dscale {dscale.shape} must be (K, N) = {(K, N)}")
        V = logits.shape[1] // K
        targets = cupy.ascontiguousarray(targets, dtype=np.int32)
        kernel("crossentropy", "crossentropy_forward_backward", _act_defines(logits))(
            (N, K), (_ce_threads(V),),
            (losses, logits, targets, dscale, _i32(N), _i32(K), _i32(V), _i32(_ce_chunks(logits, V))))

    # ------------------------------------------------------------------------------------------- adamw
    def adamw_update(self, params, grads, m, v, decay_mask, lr, beta1, beta2, eps, weight_decay, grad_scale, step,
                     compute_copy=None, squares=None, grad_clip=0.0):
        """One AdamW step over the flat buffers in one launch (see the CPU layer for the formula); when given,
        compute_copy (the bf16 weights the layers read) is rewritten from the updated weights in the same pass.
        decay_mask: uint8, 1 where the weight decays. squares (a float64 device scalar, the global gradient's sum
        of squares): the clip factor is computed from it in the kernel, in place of grad_scale."""
        _check(params, grads, m, v)
        assert decay_mask.dtype == np.uint8, decay_mask.dtype
        assert squares is None or (squares.dtype == np.float64 and squares.size == 1), squares
        n = params.size
        grid = min(_blocks(n, 256), 32 * sm_count())
        defines = () if compute_copy is None else _act_defines(compute_copy)
        copy = np.uint64(0) if compute_copy is None else compute_copy
        kernel("adamw", "adamw_update", defines)(
            (grid,), (256,), (params, grads, m, v, decay_mask, np.int64(n), np.float64(lr), np.float64(beta1),
                              np.float64(beta2), np.float64(eps), np.float64(weight_decay), np.float64(grad_scale),
                              np.uint64(0) if squares is None else squares, np.float64(grad_clip),
                              np.float64(CLIP_EPS), np.float64(1.0 - beta1 ** step), np.float64(1.0 - beta2 ** step),
                              copy))

    def cast_params(self, dst, src):
        """dst (n,) = src (n,) rounded to dst's dtype: the compute copy of the master weights."""
        _check(src)
        assert dst.size == src.size and dst.flags.c_contiguous
        kernel("adamw", "cast_params", _act_defines(dst))((min(_blocks(src.size, 256), 32 * sm_count()),), (256,),
                                                          (dst, src, np.int64(src.size)))

    def sum_squares(self, x, on_device=False):
        """sum(x^2) of a flat buffer, accumulated in float64 (for the global gradient norm): a float, or with
        on_device a 0-d device array (the host does not wait)."""
        _check(x)
        grid = max(1, min(_blocks(x.size, 256), 1024))
        partial = cupy.empty(grid, dtype=np.float64)
        kernel("adamw", "sum_squares")((grid,), (256,), (partial, x, np.int64(x.size)))
        return partial.sum() if on_device else float(partial.sum())

    def add_sum_squares(self, out, a, b):
        """out = a + b (out may be a) and sum(out^2) in float64, in one pass: the ranks' gradients summed and the
        norm's squares taken (train/distributed.py). Returns the squares as a 0-d device array, the bits of
        sum_squares(out)."""
        _check(out, a, b)
        assert out.size == a.size == b.size
        grid = max(1, min(_blocks(out.size, 256), 1024))
        partial = cupy.empty(grid, dtype=np.float64)
        kernel("adamw", "add_sum_squares")((grid,), (256,), (out, a, b, partial, np.int64(out.size)))
        return partial.sum()

    # ---------------------------------------------------------------------------------------- decoding
    def argmax(self, ids, logits, log=None, pos=None, advance=0):
        """ids (R,) int32 = the index of each row's largest logit (the first of equal ones); logits (R, V) float32.
        With log (S, R) int32 and pos, also log[pos[0]] = ids; then pos[0] += advance (a greedy step's end: one
        row's last block does it, so a step of one row has no advance_position kernel)."""
        _check(logits)
        assert ids.dtype == np.int32 and ids.shape == logits.shape[:1]
        assert pos is not None or (log is None and not advance)
        null = np.uint64(0)
        (R, V), nb = logits.shape, _argmax_slices(logits.shape[1])
        part_v, part_i, done = _argmax_scratch(cupy.cuda.Device().id, R, nb)
        folded = advance if R == 1 else 0  # more rows: their blocks read the position, so it moves after them
        launch(kernel("decoding", "argmax_rows"), (nb, R), (ARGMAX_THREADS,),
               (ids, logits, _i32(V), null if log is None else log, null if pos is None else _position(pos),
                part_v, part_i, done, _i32(folded)))
        if advance and not folded:
            self.advance_position(pos, advance)

    def advance_position(self, pos, n):
        """pos[0] += n on the device: the KV cache's position after a decoding step of n tokens."""
        launch(kernel("decoding", "advance_position"), (1,), (1,), (_position(pos), _i32(n)))

    def accept_drafts(self, tokens, ids, log, pos):
        """The end of a greedy speculative step of one sequence (see the CPU layer): tokens (K,) int32 in and the
        next step's out, ids (K * K,) every head's argmax at each row, log (S + K, 2) int32, pos advanced."""
        K = tokens.size
        assert tokens.dtype == ids.dtype == log.dtype == np.int32 and ids.size == K * K
        launch(kernel("decoding", "accept_drafts"), (1,), (1,), (tokens, ids, log, _position(pos), _i32(K)))

    def sample_rows(self, ids, logits, top_k, temperature, top_p, seed_lo, seed_hi, index):
        """ids (R,) int32: a token drawn from each row of logits (R, V) float32 with the row's own settings (see the
        CPU layer: the same weights, masses, cuts and noise, so the same draws); top_k, index int32, temperature,
        top_p float32, seed_lo, seed_hi uint32, (R,) each. argmax_rows, then decoding.cu's sample_histogram,
        sample_refine (top-k, then top-p) and sample_draw, blocks (slices of the row, R)."""
        _check(logits)
        R, V = logits.shape
        assert ids.dtype == np.int32 and ids.shape == (R,)
        for a, dtype in ((top_k, np.int32), (temperature, F32), (top_p, F32), (seed_lo, np.uint32),
                         (seed_hi, np.uint32), (index, np.int32)):
            assert a.dtype == dtype and a.shape == (R,) and a.flags.c_contiguous, (a.dtype, a.shape)
        self.argmax(ids, logits)  # every row's argmax first: the greedy rows' draws, the others' largest logit
        state, counts, masses, keys, weights = _sample_scratch(cupy.cuda.Device().id, R)
        grid = (_blocks(V, SAMPLE_THREADS * SAMPLE_LOADS), R)  # slices fixed by V
        settings = (ids, logits, _i32(V), top_k, temperature, top_p)
        launch(kernel("decoding", "sample_histogram"), grid, (SAMPLE_THREADS,), settings + (state, counts, masses))
        for round in (1, 2):
            launch(kernel("decoding", "sample_refine"), grid, (SAMPLE_THREADS,),
                   settings + (state, masses, keys, weights, _i32(round)))
        launch(kernel("decoding", "sample_draw"), grid, (SAMPLE_THREADS,),
               settings + (seed_lo, seed_hi, index, state, counts, masses))

    def feed_back(self, tokens, ids, pos, index, log, counter, context):
        """After a batched step of one token a sequence (see the CPU layer): ids become the next inputs, positions
        (at most context - 1) and token indices move on, log[counter[0]] = ids, counter[0] += 1."""
        B = ids.size
        assert tokens.size == pos.size == index.size == B and log.shape[1] == B and B <= 1024
        launch(kernel("decoding", "feed_back"), (1,), (B,),
               (tokens, ids, pos, index, log, counter, _i32(context)))

    def graph(self, step):
        """step (a decoding step) as a function that replays it as one CUDA graph (runtime.graph: the first call
        runs and records it, kernels with programmatic dependent launch; cuBLAS's products are recorded too)."""
        return runtime.graph(step)
