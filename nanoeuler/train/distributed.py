"""Data-parallel training: the optimizer step of N ranks, with the gradients reduced in buckets as the
backward pass finishes them (`nanoeuler train|sft|dpo ... --gpus N`; docs/multi-gpu.md).

Which rank this process is and how the ranks meet is parallel/world.py; the collectives are
parallel/comm.py's communicators.

    parallel = DataParallel(eng, AdamW(eng, hp.beta1, hp.beta2), comm, zero=True)
    ...a step's forward and backward passes (the last with final=True: its buckets are reduced as it goes)
    numbers = parallel.start_step(lr, hp.weight_decay, hp.grad_clip, [loss, tokens, ...])  # queued on the GPU
    ...the next step queued...
    grad_norm, totals = numbers()  # waits for that step alone
"""
import math

import numpy as np

from nanoeuler.env import env_float
from nanoeuler.model.engine import to_numpy
from nanoeuler.parallel.comm import SingleProcess

# ------------------------------------------------------------------------------------- the optimizer step
def bucket_elements():
    """Float32 elements of an NCCL gradient bucket at least: NANOEULER_BUCKET_MB MiB when it is set (several
    buckets, each reduced beside the rest of the backward pass), else the whole buffer, one bucket reduced at
    the pass's end: what measured fastest on 2 GPUs over NVLink and over sockets (docs/multi-gpu.md). The copy
    engines' reduction takes one bucket, sent a layer at a time."""
    megabytes = env_float("NANOEULER_BUCKET_MB", 0.0, minimum=0.0)
    return megabytes * 2 ** 20 / 4 if megabytes else float("inf")


def bucket_plan(ready_offsets, total, world_size, min_elements):
    """The gradient buckets, [(start, end)] of the flat buffer padded to a multiple of world_size, in the order
    they are reduced. ready_offsets are where the backward pass has made every gradient final from the offset
    to the end, in the order it gets there (descending, the last 0: Engine.gradient_offsets). A bucket closes
    at the first of them, rounded up to a multiple of world_size, that leaves it min_elements or more; so
    every bucket's size is a multiple of world_size (each splits into world_size equal pieces) and holds only
    final gradients when it is reduced."""
    end = -(-total // world_size) * world_size
    buckets = []
    for offset in ready_offsets:
        start = -(-offset // world_size) * world_size
        if start < end and (end - start >= min_elements or offset == 0):
            buckets.append((start, end))
            end = start
    return buckets


def shard_pieces(buckets, rank, world_size):
    """The pieces of `rank`: the rank-th of the world_size equal pieces of every bucket, [(flat start, flat end,
    offset in the shard)], in the order of the buckets; every rank's shard has the same size, their sum."""
    pieces, offset = [], 0
    for start, end in buckets:
        size = (end - start) // world_size
        pieces.append((start + rank * size, start + (rank + 1) * size, offset))
        offset += size
    return pieces


class DataParallel:
    """The parts of a training step that change with N ranks, around an engine and an optimizer that know
    nothing of them. Each of the N ranks owns the rank-th of N equal pieces of every gradient bucket
    (bucket_plan, shard_pieces). A step:

    1. The gradients are summed as soon as the backward pass has made them final (Engine.gradients_ready).
       Where the ranks share a host, through the GPUs' copy engines (parallel/comm.py's CopyEngineReduction),
       sent a layer at a time beside the rest of the pass and added up at its end: a reduce-scatter (each rank
       receives the others' gradients of its piece of the one bucket and sums them). Otherwise through NCCL on
       the communicator's stream, a reduce-scatter of one bucket (the default) at the pass's end, or of several
       (NANOEULER_BUCKET_MB) beside the rest of the pass (without ZeRO these buckets are all-reduced instead).
    2. The global gradient norm for clipping: each rank's sum of squares of its pieces (after an all-reduce,
       rank 0's of all of them), summed over the ranks in one collective together with the step's losses,
       tokens and Ctrl-C flags (`values`), on the device; the update computes the clip factor from it there.
       The host waits for none of it: start_step returns a function that reads the step's numbers, which the
       training loop calls once the next step is queued.
    3. The AdamW update:
       - without ZeRO every rank holds all the moments and takes the same update of all the weights; after a
         reduce-scatter, its own pieces first, while the others' summed gradients arrive (the copy engines copy
         each rank's summed piece into the others' gradient buffers; else an NCCL all-gather), then the rest;
       - with zero (ZeRO stage 1) rank r holds the moments of its pieces only (1/N of their memory,
         AdamW.shard) and updates those pieces of the weights (the float32 master weights, and in bf16 the
         compute copy in the same pass); then an all-gather hands every rank the updated compute weights: in
         bf16 the bf16 copy only (half the bytes), so another rank's pieces of the float32 master weights are
         stale, and a checkpoint gathers them (params_numpy, a collective).
    In a world of one this is exactly AdamW.step."""

    def __init__(self, eng, optimizer, comm=None, zero=False, min_bucket=None):
        self.eng, self.comm = eng, comm or SingleProcess()
        n, r = self.comm.world_size, self.comm.rank
        self.zero = zero and n > 1
        self.optimizer = optimizer
        self._launched, self.buckets, self.bf16_gather, self.copies, self._sent = 0, [], False, None, 0
        self._squares = None  # the squares of this rank's summed range, where the copy engines' sum took them
        if n == 1:
            return
        self.comm.broadcast(eng.params, 0)  # every rank starts from rank 0's weights, whatever it loaded
        eng.sync_weights()
        if hasattr(self.comm, "copy_engine_reduction") and eng.dtype == np.float32:
            # without ZeRO every rank needs every sum: each rank's summed shard is copied into the others'
            # gradient buffers, which the reduction allocates so that they can map it
            self.copies = self.comm.copy_engine_reduction(-(-eng.params.size // n), share=not self.zero)
        eng.pad_buffers(n, grads=self.copies.grads if self.copies is not None else None)
        if self.copies is not None:  # one bucket: its shards are sent a layer at a time
            minimum = float("inf")
        else:
            minimum = bucket_elements() if min_bucket is None else min_bucket
        self.buckets = bucket_plan(eng.gradient_offsets(), eng.params.size, n, minimum)
        self.all_reduced = not self.zero and self.copies is None and len(self.buckets) > 1
        # even one bucket starts from the backward pass's end, before the host waits for the step's losses
        eng.gradients_ready = self._gradients_ready
        self.pieces = [shard_pieces(self.buckets, q, n) for q in range(n)]
        self.mine = self.pieces[r]
        self.bf16_gather = self.zero and eng.weights is not eng.params
        if self.zero:
            # the full moments are dropped: that is the memory saved
            self.optimizer = optimizer.shard(eng, [(start, end) for start, end, _ in self.mine])

    def _gradients_ready(self, offset):
        """Start the reduction of every bucket whose gradients are all final (from `offset` on)."""
        grads = self.eng.grads_padded
        if self.copies is not None:
            if self._launched == 0:  # the layers final since the last call (from the padded end at first)
                self.copies.send(grads, offset, self._sent or grads.size)
                self._sent = offset
                if offset == 0:  # summed as soon as the pass ends, with the squares of the sum in the same pass
                    self._squares = self.copies.finish(grads, self.eng.layers.add_sum_squares)
                    self._launched, self._sent = 1, 0
            return
        while self._launched < len(self.buckets) and self.buckets[self._launched][0] >= offset:
            start, end = self.buckets[self._launched]
            if self.all_reduced:
                self.comm.start_all_reduce(grads[start:end])
            else:
                mine, mine_end, _ = self.mine[self._launched]
                self.comm.start_reduce_scatter(grads[start:end], grads[mine:mine_end])
            self._launched += 1

    def device_memory(self):
        """Bytes held on the GPU beside the engine's pool: the copy engines' allocation (the inbox, and without
        ZeRO the gradients)."""
        return 0 if self.copies is None else self.copies.nbytes

    def sum(self, values):
        """Every rank's values (floats) summed, as a list of floats."""
        return [float(v) for v in self.comm.all_reduce_sum(np.array(values, dtype=np.float64))]

    def any(self, flag):
        """True on every rank when flag is true on any (a Ctrl-C that reached the ranks at different steps)."""
        return self.sum([float(flag)])[0] > 0

    def _step_values(self, squares, values):
        """[squares, *values] as one float64 vector on the engine's device; squares and values are floats or
        scalars on the device that the host has not waited for."""
        xp = self.eng.xp
        on_device = [xp is not np and isinstance(v, xp.ndarray) for v in values]
        both = xp.asarray(np.array([0.0] + [0.0 if d else float(v) for v, d in zip(values, on_device)]))
        both[0] = squares
        for i, (v, d) in enumerate(zip(values, on_device)):
            if d:
                both[i + 1] = v
        return both

    def _numbers(self, both):
        """A function that waits for the step's [squares, *values] and returns (the norm, values as floats)."""
        read = self.eng.read_later(both)

        def numbers():
            squares, *values = read()
            return math.sqrt(squares), [float(v) for v in values]
        return numbers

    def step(self, lr, weight_decay, grad_clip, values=()):
        """start_step, waited for: (the norm, `values` summed over the ranks)."""
        return self.start_step(lr, weight_decay, grad_clip, values)()

    def start_step(self, lr, weight_decay, grad_clip, values=()):
        """Sum the ranks' gradients, clip to the global norm, one AdamW step: all of it queued on the engine's
        device, none of it waited for by the host (the clip factor is computed on the device from the squares).
        `values` (floats, or scalars on the device: the step's losses, tokens, Ctrl-C flags) ride on the
        collective of the norm's squares. Returns a function that waits for the step's numbers and returns
        (the norm, `values` summed over the ranks): called after the next step is queued, the GPU never waits
        for the host between steps."""
        eng, comm, opt = self.eng, self.comm, self.optimizer
        copy = None if eng.weights is eng.params else eng.weights
        if comm.world_size == 1:
            both = self._step_values(opt.squared_norm(eng.grads, on_device=True), values)
            opt.update(eng.params, eng.grads, lr, weight_decay, 1.0, copy, squares=both[0], grad_clip=grad_clip)
            return self._numbers(both)
        grads = eng.grads_padded
        self._gradients_ready(0)  # started by the backward pass: what it did not start, then all of it joined
        comm.join()
        self._launched = 0
        squares, self._squares = self._squares, None  # the copy engines' sum took its shard's squares
        if self.all_reduced:  # every rank has every sum, the same bits: rank 0's squares are the norm's
            squares = opt.squared_norm(eng.grads, on_device=True) if comm.rank == 0 else 0.0
            both = comm.all_reduce_sum(self._step_values(squares, values))
            opt.update(eng.params, eng.grads, lr, weight_decay, 1.0, copy, squares=both[0], grad_clip=grad_clip)
            return self._numbers(both)
        if squares is None:
            squares = sum(opt.squared_norm(grads[start:end], on_device=True) for start, end, _ in self.mine)
        if self.copies is not None and not self.zero:  # its summed shard to the others, beside the update below
            self.copies.share(grads)
        both = comm.all_reduce_sum(self._step_values(squares, values))
        clip = dict(squares=both[0], grad_clip=grad_clip)
        if not self.zero:  # the others' pieces of the summed gradients arrive while this rank updates its own
            if self.copies is None:
                for (start, end), (mine, mine_end, _) in zip(self.buckets, self.mine):
                    comm.start_all_gather(grads[mine:mine_end], grads[start:end])
            own, others = self._own_and_others()
            opt.update_pieces(eng.params_padded, grads, own, lr, weight_decay, 1.0, copy, **clip)
            if self.copies is None:
                comm.join()
            else:
                self.copies.wait_shared()
            opt.update_pieces(eng.params_padded, grads, others, lr, weight_decay, 1.0, copy, count=False, **clip)
            return self._numbers(both)
        opt.update_pieces(eng.params_padded, grads, self.mine, lr, weight_decay, 1.0, copy, **clip)
        if self.bf16_gather:
            for index in range(len(self.buckets)):
                comm.all_gather_ranges(eng.weights, self._ranges(index))
        else:
            for (start, end), (mine, mine_end, _) in zip(self.buckets, self.mine):
                comm.all_gather(eng.params_padded[mine:mine_end], eng.params_padded[start:end])
        return self._numbers(both)

    def _own_and_others(self):
        """Without ZeRO (every rank holds all the moments): this rank's pieces and the others', as
        update_pieces takes them."""
        total = self.eng.params.size  # the moments are not padded

        def unpadded(pieces):
            return [(a, min(b, total), a) for a, b, _ in pieces if a < total]
        others = [piece for q, pieces in enumerate(self.pieces) if q != self.comm.rank for piece in pieces]
        return unpadded(self.mine), unpadded(others)

    def _ranges(self, index):
        """Every rank's piece of bucket `index`, cut at the end of the (unpadded) parameters."""
        total = self.eng.params.size
        return [(min(start, total), min(end, total)) for start, end, _ in (p[index] for p in self.pieces)]

    def params_numpy(self):
        """The float32 weights as a host array, for a checkpoint; with ZeRO in bf16 a collective (every rank
        must call it): the other ranks' pieces of the master weights are gathered."""
        if self.bf16_gather:
            for index in range(len(self.buckets)):
                self.comm.all_gather_ranges(self.eng.params, self._ranges(index))
        return self.eng.params_numpy()

    def opt_state_numpy(self):
        """The full AdamW moments (m, v) as float32 host arrays, for a checkpoint that any number of ranks (or
        the CPU) resumes; with ZeRO a collective: every rank must call it."""
        if not self.zero:
            return self.optimizer.state()
        n, size, total = self.comm.world_size, self.optimizer.m.size, self.eng.params.size
        gathered = self.eng.xp.empty(n * size, dtype=self.eng.dtype)
        out = []
        for shard in (self.optimizer.m, self.optimizer.v):
            self.comm.all_gather(shard, gathered)
            every = to_numpy(gathered).reshape(n, size)
            full = np.empty(self.eng.params_padded.size, dtype=np.float32)
            for rank in range(n):
                for start, end, at in self.pieces[rank]:
                    full[start:end] = every[rank, at:at + end - start]
            out.append(full[:total])
        return tuple(out)
