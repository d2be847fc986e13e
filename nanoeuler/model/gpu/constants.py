"""The numbers the GPU layers and their CUDA kernels share, and the defines each kernel file is compiled with.

Python owns every such number: a kernel file gets it as a compile-time define (-DNAME=value, module_defines)
and has no value of its own, so compiling it without the define is an error. Imports neither CuPy nor a GPU
(the nvcc test of tests/test_gpu.py builds the kernels from it on machines without either).
"""
import pathlib

from nanoeuler.model.limits import FEW_ROWS, SAMPLE_EXP2, SAMPLE_LN, SAMPLE_WEIGHT_BITS

KERNELS = pathlib.Path(__file__).parent / "kernels"

# matmul.cu, the products of at most FEW_ROWS rows (matmul_small)
MATMUL_SMALL_WARPS = 16  # the most warps a block; layers.py gives a short row fewer
MATMUL_SMALL_LOADS = 4   # the 16-byte loads of w a thread has in flight at once
MATMUL_PAIR = 2          # many rows: tiles of w a warp takes at once (x's fragments loaded once for all)
MATMUL_PAIR_WARPS = 6    # ... in blocks of at most this many warps (rows up to 768), two of which an SM can hold
# ... 9 to 64 rows of a product of at least MATMUL_ROWS_MIN_TILES tiles of 8 rows of w (matmul_rows_t*: x's rows
# in shared memory, shared by a block's tiles): the most warps a block, the tiles of w a warp, and the stages of
# x's rows and w's tiles in shared memory (a round of a virtual warp each), all but one in flight. 16 warps of
# one tile (at most 128 registers a thread) rather than 8 of two: each warp waits on its own latency chains, so
# more of them fill a scheduler's issue slots (docs/decoding.md has the profile)
MATMUL_ROWS_MIN_TILES = 1024
MATMUL_ROWS_WARPS = 16
MATMUL_ROWS_NT = 1
MATMUL_ROWS_STAGES = 3
# ... and at 4 tiles of x's rows (49 to 64 rows) a block's warps in this many groups, each warp taking its share
# of x's tiles (4 groups: one tile) against MATMUL_ROWS_NT x this many tiles of w (fewer shared-memory reads a
# stage than a warp taking all of x's tiles); matmul_split_t* too
MATMUL_ROWS_XSPLIT = 4
# ... a product of at least MATMUL_SPLIT_MIN_WEIGHTS weights whose tiles of w are too few for matmul_rows (9 to 64
# rows) splits a row's virtual warps over blocks (matmul_split_t*: each group's sums into a scratch of at most
# MATMUL_SPLIT_BYTES, added in virtual-warp order by matmul_split_finish, MATMUL_FINISH_THREADS a block), in blocks
# of MATMUL_SPLIT_WARPS warps of MATMUL_SPLIT_NT tiles of w; a split block's registers allow MATMUL_SPLIT_BLOCKS of
# them an SM (layers._split_group)
MATMUL_SPLIT_MIN_WEIGHTS = 1 << 22
MATMUL_SPLIT_BYTES = 1 << 25
MATMUL_SPLIT_BLOCKS = 2
MATMUL_SPLIT_WARPS = 8
MATMUL_SPLIT_NT = 2
MATMUL_FINISH_THREADS = 256
# ... up to 8 rows (matmul_small): the physical warps a block, at most, for a product whose blocks would not fill
# the SMs at the second number, and for one whose blocks do (a row's k-split stays that of its virtual warps,
# MATMUL_SMALL_WARPS at most, set by the row length; a physical warp runs several in turn): small blocks, many
# resident an SM, keep the weights streaming (layers._physical_warps)
MATMUL_FEW_WARPS = (8, 4)
# embedding.cu: the most rows of one token a block of the backward pass sums (longer runs are cut in pieces)
EMB_SEGMENT = 32

# quantized products (kernels/quantized.cu): the most warps splitting a row's records (a block's warps; a
# matrix's split set by its shape alone: the most, up to QUANT_SPLIT, that keep its warps within about one wave
# of QUANT_WAVE_WARPS), the records a warp has in flight a type (cp.async stages: int4's records hold 4 chunks,
# int8's 2, so int8 wants more of them in flight; docs/experiments.md has the sweep), the records a stage (a
# wait and a __syncwarp each, their chains interleaved; those in flight a multiple of it) by the tiles of x's
# rows a block (quant_matmul_*_t0: one row, t1, t2, t4: 2 records a stage where they fit the registers without
# spills in the loop), and the blocks of 32 x QUANT_SPLIT threads an SM must hold (the registers a thread:
# 65,536 / that many threads)
QUANT_SPLIT = 8
QUANT_WAVE_WARPS = 2048
QUANT_LOADS = {"int4": 6, "int8": 10}
QUANT_STAGE_RECORDS = {0: 2, 1: 2, 2: 1, 4: 1}
QUANT_BLOCKS = 2
# ... products of more than 16 rows take 4 tiles of x a block (quant_matmul_*_t4: 32 rows), int4 only where at least
# this many warps split a row (measured on an H200, docs/quantization.md: int4's t4, at 128 registers with
# spills, is slower than blocks of 2 tiles where a warp walks a long row: gate|up, the head; faster for wo, down)
QUANT_T4_INT4_SPLIT = 8
# rope.cu: the heads a thread of rope_rotate_rows rotates, reading the position's cos and sin once for them
ROPE_HEADS = 4
# attention.cu
ATT_TILE = 64      # the rows of a query or key tile
ATT_THREADS = 128  # a training block: a warp per 16 rows of a tile
ATT_WARPS = 16     # an attention_cached block (one query row), its warps splitting the keys
# ... for steps of more than ATT_CACHED_FEW_ROWS rows, a block a kv head's query heads (at most
# ATT_CACHED_GROUP), which share its key and value loads, of ATT_CACHED_WARPS_MANY warps, each taking the work
# of ATT_WARPS / that many (the same bits): more blocks resident where many rows make many blocks
ATT_CACHED_FEW_ROWS = 8
ATT_CACHED_GROUP = 4
ATT_CACHED_WARPS_MANY = 4
# ... and head size 128's attention_cached_d128 blocks at most this many (up to 255 registers a thread: a lane
# holds a 128-wide key row and 4 dims of 32 value rows)
ATT_WARPS_D128 = 8
# decoding.cu: argmax_rows: a block's threads, and the logits each reads (a row's blocks: V / both)
ARGMAX_THREADS = 256
ARGMAX_LOADS = 8
# ... the sample_* kernels: a block's threads and the logits each reads (a row's slices, fixed by V), the
# buckets of a row's mass histogram (over t in [-SAMPLE_WEIGHT_BITS, 0]), and the most tokens of the bucket a
# cut falls in that a row's list holds (more: the search reads the row itself)
SAMPLE_THREADS = 256
SAMPLE_LOADS = 16
SAMPLE_BUCKETS = 2048
SAMPLE_LIST = 16384
# rmsnorm.cu: the K of the kernels that hold a row in registers (K 16-byte chunks a lane, at most 32 elements)
RMSNORM_CHUNKS = (1, 2, 3, 4, 6, 8)
# ... and rmsnorm_rows (decoding's normed rows, a block a row): it takes the norm of a gate|up or head product
# of at least NORM_APART_WEIGHTS weights (Python's choice alone: a folded norm costs a product a share of its time, a
# kernel of its own a few microseconds, so small products keep it folded)
NORM_APART_WEIGHTS = 1 << 24
# rmsnorm_rows: a block's threads, and the 16-byte chunks a
# thread holds (rows up to RMSNORM_ROWS_THREADS x RMSNORM_ROWS_CHUNKS x 16 bytes; longer ones take the generic
# kernel)
RMSNORM_ROWS_THREADS = 256
RMSNORM_ROWS_CHUNKS = 4

assert len(SAMPLE_EXP2) == 7 and len(SAMPLE_LN) == 9, "decoding.cu names each polynomial's coefficients"
assert SAMPLE_BUCKETS % SAMPLE_THREADS == 0 and SAMPLE_THREADS % 256 == 0 and SAMPLE_THREADS <= 1024, \
    "block_first gives a thread whole runs of the 2^8 digits and the buckets"
assert FEW_ROWS <= 64, "matmul_small_t<n>_*, matmul_rows_t<n> take x's rows as up to 4 tiles of the mma's 16 rows"
assert MATMUL_ROWS_STAGES >= 2, "a stage in use while the next ones land"
assert all(n % r == 0 and n >= 2 * r for n in QUANT_LOADS.values() for r in QUANT_STAGE_RECORDS.values()), \
    "quant_matmul's stages hold QUANT_STAGE_RECORDS[tiles] records each, one in use while the next ones land"
assert ATT_THREADS == 32 * ATT_TILE // 16, "a warp of the training attention kernels owns 16 rows of a tile"
assert ATT_WARPS % ATT_CACHED_WARPS_MANY == 0 and ATT_CACHED_WARPS_MANY >= 2, "warp 1 appends k and v"
assert ATT_WARPS % ATT_WARPS_D128 == 0 and ATT_WARPS_D128 >= 2, "virtual warps split evenly; warp 1 appends"


def _hex_floats(name, values):
    """float32 values as defines name_0, name_1, ... of exact C hex literals (nvcc splits a define's value at
    commas, so no list in one)."""
    return {f"{name}_{i}": f"{v.hex()}f" for i, v in enumerate(values)}


def rmsnorm_chunks(bf16):
    """The K of rmsnorm.cu's register kernels in the bf16 (8 elements a chunk) or float32 (4) build."""
    return tuple(k for k in RMSNORM_CHUNKS if k * (8 if bf16 else 4) <= 32)


def rmsnorm_backward_blocks(K, bf16):
    """Blocks an SM of rmsnorm_backward_k{K}, its __launch_bounds__ and its grid: 2 (at most 128 registers a
    thread) where ptxas fits that without spills, bf16 up to K = 3 and float32 up to K = 4, else 1."""
    return 2 if K <= (3 if bf16 else 4) else 1


def module_variants(name):
    """The define sets kernels/<name>.cu is compiled with (layers.py picks, runtime.py compiles), besides its
    constants: one per element type (ACT_BF16=1: bf16 activations), and for attention.cu also the 3xTF32
    kernels (ATT_PRECISE=1)."""
    if name == "decoding":  # float32 logits and int32 ids only
        return ((),)
    variants = ((), ("ACT_BF16=1",))
    if name == "attention":
        variants += (("ATT_PRECISE=1",), ("ACT_BF16=1", "ATT_PRECISE=1"))
    return variants


def module_defines(name, variant=()):
    """Every define ("NAME=value") kernels/<name>.cu is compiled with in `variant` (one of module_variants):
    the numbers it shares with Python, then the variant's."""
    bf16 = "ACT_BF16=1" in variant
    shared = {
        "matmul": {"FEW_ROWS": FEW_ROWS, "MATMUL_SMALL_WARPS": MATMUL_SMALL_WARPS,
                   "MATMUL_SMALL_LOADS": MATMUL_SMALL_LOADS,
                   "MATMUL_PAIR": MATMUL_PAIR, "MATMUL_PAIR_WARPS": MATMUL_PAIR_WARPS,
                   "MATMUL_ROWS_WARPS": MATMUL_ROWS_WARPS, "MATMUL_ROWS_NT": MATMUL_ROWS_NT,
                   "MATMUL_ROWS_STAGES": MATMUL_ROWS_STAGES, "MATMUL_ROWS_XSPLIT": MATMUL_ROWS_XSPLIT,
                   "MATMUL_SPLIT_BLOCKS": MATMUL_SPLIT_BLOCKS, "MATMUL_SPLIT_WARPS": MATMUL_SPLIT_WARPS,
                   "MATMUL_SPLIT_NT": MATMUL_SPLIT_NT,
                   "MATMUL_FINISH_THREADS": MATMUL_FINISH_THREADS},
        "rope": {"ROPE_HEADS": ROPE_HEADS},
        "embedding": {"EMB_SEGMENT": EMB_SEGMENT},
        "attention": {"ATT_TILE": ATT_TILE, "ATT_THREADS": ATT_THREADS, "ATT_WARPS": ATT_WARPS,
                      "ATT_CACHED_GROUP": ATT_CACHED_GROUP, "ATT_CACHED_WARPS_MANY": ATT_CACHED_WARPS_MANY,
                      "ATT_WARPS_D128": ATT_WARPS_D128},
        "decoding": {"SAMPLE_LOADS": SAMPLE_LOADS, "SAMPLE_BUCKETS": SAMPLE_BUCKETS, "SAMPLE_LIST": SAMPLE_LIST,
                     "SAMPLE_WEIGHT_BITS": SAMPLE_WEIGHT_BITS, **_hex_floats("SAMPLE_EXP2", SAMPLE_EXP2),
                     **_hex_floats("SAMPLE_LN", SAMPLE_LN)},
        "quantized": {"QUANT_SPLIT": QUANT_SPLIT, "QUANT_BLOCKS": QUANT_BLOCKS,
                      **{f"QUANT_STAGE_RECORDS_T{tiles}": n for tiles, n in QUANT_STAGE_RECORDS.items()},
                      **{f"QUANT_LOADS_{kind.upper()}": n for kind, n in QUANT_LOADS.items()}},
        "rmsnorm": {"RMSNORM_ROWS_CHUNKS": RMSNORM_ROWS_CHUNKS,
                    **{f"RMSNORM_BACKWARD_BLOCKS_K{k}": rmsnorm_backward_blocks(k, bf16) for k in rmsnorm_chunks(bf16)}},
    }.get(name, {})
    return tuple(f"{key}={value}" for key, value in shared.items()) + tuple(variant)
