"""ZeRO stages 2 and 3: the gradients (2), and the weights too (3), sharded over the ranks, a unit at a time.

    engine = make_engine(cfg, device="gpu", zero=3, ranks=comm.world_size)           # no whole buffers
    parallel = Sharded(engine, comm, stage=3, weights=ck.params)   # instead of DataParallel; its shard alone read
    ...the objective's passes: the engine asks for each unit's weights and hands over its gradients...
    numbers = parallel.start_step(lr, weight_decay, grad_clip, values)              # as DataParallel's

The plan (ShardPlan): the engine's units (Engine.units(): the embedding, each layer, the head), each padded
with zeros to a multiple of the N ranks and cut into N equal pieces; rank r owns the r-th piece of every
unit, one after another in its shard. Per rank, with Ψ parameters:

- the shard's float32 master weights, gradients and AdamW moments and its decay mask (17 Ψ / N bytes), and
  in bf16 the shard's compute copy (2 Ψ / N): the AdamW kernel updates the shard and rewrites that copy in
  the same pass;
- ZeRO-2: the whole compute weights (2 Ψ in bf16, 4 Ψ in fp32), all-gathered a unit at a time after each
  update; ZeRO-3: none; each unit's are all-gathered into a buffer of the unit just before its forward and
  again before its backward (the recomputed forward of --recompute included), and freed after. The gather of
  the unit the pass reaches next is started as soon as a unit is gathered (prefetched: on the GPU it runs on
  NCCL's stream beside the unit's products), so two units' weights are held at a time; none is prefetched
  across the optimizer step (the forward pass ends at the head, the backward pass at the first layer);
- the gradients of one unit at a time (two for a tied head, whose head 0 is the embedding): the backward
  pass writes a unit's gradients into a zeroed buffer of the unit, which is reduce-scattered into the
  shard's gradients (added to them on a gradient-accumulation pass after the first) and freed once the unit
  is done.

The start holds what the steps hold, never the whole model's buffers: the engine is made without the
buffers kept here in shards (make_engine's zero: no whole gradients or master weights, in ZeRO-3 no whole
weights at all), and nothing whole is broadcast. Each rank takes its shard of the float32 weights from the
weights it is given, a unit's piece at a time: a checkpoint's read from the file (checkpoint.StoredFlat,
the rows that hold the piece), a fresh model's drawn a tensor at a time (config.InitialWeights); rounds the
shard's compute copy from it (bf16); and in ZeRO-2 all-gathers the whole compute weights a unit at a time. A
resumed run's moments and the decay mask are taken the same way. An engine made whole (the tests') gives
its own weights, and its whole buffers are handed back (Engine.release_whole). The step: the squares of the
shard's gradients summed over the ranks with the step's numbers (one collective), one AdamW kernel over the
shard, clipped on the device, then (ZeRO-2) the all-gather of the compute weights.

Evaluation, sampling and the closing work read the whole model on rank 0: `evaluating()` (every rank)
gathers ZeRO-3's compute weights whole on every rank for its length. Checkpoints are written from the shards
(checkpoint.save with `Streamed` buffers): the tensors go into rank 0's file in the file's order, each
unit's pieces all-gathered when its first tensor is written, so no rank holds more than one unit of the
weights or of a moment beyond its shard; the file is the unsharded run's, which any number of ranks resumes.

Every collective but the prefetched gathers is ordered on the compute stream (the caller waits on the device
for it, not the host), so a unit's buffers can be freed as soon as the pass leaves it: the reduce-scatters do
not overlap the passes' products yet.
"""
import contextlib
import dataclasses

import numpy as np

from nanoeuler.model.engine import to_numpy
from nanoeuler.model.optimizer import AdamW, DecayMask
from nanoeuler.train.distributed import DataParallel


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """units: [(unit, start, end)] tiling the flat buffer [0, total); world_size: N. Unit k is padded to
    N * piece[k] elements; rank r owns its elements [r * piece[k], (r + 1) * piece[k]), at offset at[k] of the
    rank's shard."""
    units: tuple
    world_size: int

    @property
    def total(self):
        return self.units[-1][2]

    @property
    def pieces(self):
        """Each unit's piece: its size over N, rounded up."""
        n = self.world_size
        return tuple(-(-(end - start) // n) for _, start, end in self.units)

    @property
    def at(self):
        """Where each unit's piece starts in a shard."""
        return tuple(int(a) for a in np.cumsum((0,) + self.pieces)[:-1])

    @property
    def shard_size(self):
        return sum(self.pieces)

    def index(self, unit):
        return [u for u, _, _ in self.units].index(unit)

    def ranges(self, rank):
        """[(flat start, flat end, offset in the shard)] of rank's elements of the buffer, unit by unit (empty
        where a unit's padding is all that falls to the rank)."""
        out = []
        for (_, start, end), piece, at in zip(self.units, self.pieces, self.at):
            lo, hi = min(start + rank * piece, end), min(start + (rank + 1) * piece, end)
            out.append((lo, hi, at))
        return out

    def unit_ranges(self, k):
        """Every rank's part of unit k: [(flat start, flat end)] (all_gather_ranges's)."""
        _, start, end = self.units[k]
        piece = self.pieces[k]
        return [(min(start + q * piece, end), min(start + (q + 1) * piece, end)) for q in range(self.world_size)]

    def take(self, flat, rank, xp=np, out=None):
        """Rank's shard of a whole flat buffer (zeros in the padding), as an array of xp (or into `out`); from a
        buffer with read(start, end) (checkpoint.StoredFlat: a checkpoint's weights or moments; the initial
        weights, config.InitialWeights; the decay mask, optimizer.DecayMask) only the shard's elements are
        read, a unit's piece at a time, in ascending order."""
        shard = xp.zeros(self.shard_size, dtype=flat.dtype) if out is None else out
        if out is not None:
            shard.fill(0)
        for lo, hi, at in self.ranges(rank):
            if hi > lo:
                shard[at:at + hi - lo] = xp.asarray(flat.read(lo, hi) if hasattr(flat, "read") else flat[lo:hi])
        return shard


def plan_of(eng, world_size):
    return ShardPlan(tuple(eng.units()), world_size)


class Streamed:
    """A flat float32 buffer held as shards (the master weights, a moment): what checkpoint.save writes a tensor
    at a time. read(start, end) is a collective: every rank calls it in the same order (checkpoint.save's on
    rank 0, checkpoint.read_along's on the others); the unit holding [start, end) is all-gathered when a
    read leaves the unit gathered last."""

    def __init__(self, parallel, shard):
        self.parallel, self.shard, self.size = parallel, shard, parallel.plan.total
        self._unit = None  # (index, its whole elements on the host)

    def read(self, start, end):
        plan = self.parallel.plan
        if self._unit is None or not plan.units[self._unit[0]][1] <= start < plan.units[self._unit[0]][2]:
            k = next(k for k, (_, a, b) in enumerate(plan.units) if a <= start < b)
            self._unit = None  # the last one freed first
            self._unit = (k, to_numpy(self.parallel.gather_unit(self.shard, k)))
        k, whole = self._unit
        a = plan.units[k][1]
        assert end <= plan.units[k][2], "a tensor within one unit"
        return whole[start - a:end - a]


class Sharded(DataParallel):
    """ZeRO-2 (stage 2) or ZeRO-3 (stage 3) over the ranks of comm (the module's docstring); the engine's
    sharding (Engine.units). Its interface is DataParallel's: start_step/step, sum/any, optimizer (the
    shard's), state for checkpoints (`streamed`) and device_memory. weights: the float32 weights to start
    from, whole (a host array) or read a range at a time (checkpoint.StoredFlat, config.InitialWeights), of
    which this rank reads its shard alone; every rank must be given the same. None: the engine's own, where it
    was made whole (its whole buffers are then dropped: Engine.release_whole). moments: the whole (m, v,
    steps) to start from (host arrays, or StoredFlat buffers read a shard at a time), or None. log: a list
    that records ('gather'|'release'|'reduce', unit) as they happen."""

    def __init__(self, eng, comm, stage, beta1=0.9, beta2=0.95, moments=None, log=None, weights=None):
        assert stage in (2, 3)  # a world of one works too (the tests' single GPU); training takes it plain
        self.eng, self.comm, self.stage, self.zero = eng, comm, stage, True
        self.copies, self.log = None, log
        n, r, xp = comm.world_size, comm.rank, eng.xp
        self.plan = plan_of(eng, n)
        self.mine = self.plan.ranges(r)
        if weights is None:
            assert eng.zero == 0, "an engine made for ZeRO holds no weights to start from: pass them"
            weights = eng.params
        self.master = self.plan.take(weights, r, xp)
        del weights
        eng.release_whole(stage)  # an engine made whole hands its whole buffers back; one made for ZeRO has none
        self.compute = None
        if eng.act != eng.dtype:  # bf16: the shard's compute copy, rounded as the engine rounds its own
            self.compute = xp.empty(self.plan.shard_size, dtype=eng.act)
            eng.layers.cast_params(self.compute, self.master)
        self.grads = xp.zeros(self.plan.shard_size, dtype=eng.dtype)
        self.optimizer = AdamW(eng, beta1, beta2, mask=self.plan.take(DecayMask(eng.cfg), r, xp))
        if moments is not None:  # read into the shard's moments: no second copy
            m, v, self.optimizer.steps = moments
            self.plan.take(m, r, xp, out=self.optimizer.m)
            self.plan.take(v, r, xp, out=self.optimizer.v)
        self._held, self._open = {}, {}  # unit -> [its buffer, its names, users]; unit -> [buffer, names]
        self._prefetched = {}  # unit -> (its buffer, the handle of its started all-gather)
        names = [u for u, _, _ in self.plan.units]
        self._next = {False: dict(zip(names, names[1:])),  # the unit each pass reaches after a unit
                      True: dict(zip(["head", *reversed(names[1:-1])], reversed(names[1:-1])))}
        eng.sharding = self
        if stage == 2:  # the whole compute weights, gathered from the shards a unit at a time
            self._gather_weights(eng.weights)

    # ------------------------------------------------------------------------------- the engine's hooks
    def _needs(self, unit):
        """The units whose tensors a unit's passes read: a tied model's head reads the embedding's too."""
        return [unit, "embedding"] if unit == "head" and self.eng.cfg.tied else [unit]

    def _record(self, what, unit):
        if self.log is not None:
            self.log.append((what, unit))

    def gather_unit(self, shard, k, out=None):
        """Unit k's elements, whole, from every rank's piece of `shard` (a collective): a new array of the
        unit's padded size (or `out`) on the engine's device; the unit is its first end - start elements."""
        piece, at = self.plan.pieces[k], self.plan.at[k]
        out = self.eng.xp.empty(piece * self.comm.world_size, dtype=shard.dtype) if out is None else out
        self.comm.all_gather(shard[at:at + piece], out)
        return out

    def gather(self, unit, backward=False):
        """ZeRO-3: the unit's compute weights all-gathered into a buffer of its own (or the prefetched one, once
        its gather is done), their views into the engine's `p`; then the gather of the unit the pass reaches
        next (backward: the pass from the head down) is started. ZeRO-2 holds them all: nothing to do."""
        if self.stage != 3:
            return
        self._record("gather", unit)
        source = self.compute if self.compute is not None else self.master
        for u in self._needs(unit):
            if u in self._held:
                self._held[u][2] += 1
                continue
            k = self.plan.index(u)
            _, start, end = self.plan.units[k]
            if u in self._prefetched:
                whole, handle = self._prefetched.pop(u)
                self.comm.wait_for(handle)
            else:
                whole = self.gather_unit(source, k)
            views = self.eng.unit_views(whole[:end - start], start, end)
            self.eng.p.update(views)
            self._held[u] = [whole, list(views), 1]
        after = self._next[backward].get(unit)
        if after is not None and after not in self._held and after not in self._prefetched:
            self._record("prefetch", after)
            k = self.plan.index(after)
            piece, at = self.plan.pieces[k], self.plan.at[k]
            whole = self.eng.xp.empty(piece * self.comm.world_size, dtype=source.dtype)
            self._prefetched[after] = (whole, self.comm.start_all_gather(source[at:at + piece], whole))

    def release(self, unit):
        """ZeRO-3: the unit's views out of `p`, its buffer freed once no pass still reads it."""
        if self.stage != 3:
            return
        self._record("release", unit)
        for u in self._needs(unit):
            held = self._held[u]
            held[2] -= 1
            if held[2] == 0:
                for name in held[1]:
                    del self.eng.p[name]
                del self._held[u]

    def open_grads(self, unit):
        """A zeroed gradient buffer of the unit (and a tied head's embedding), its views into the engine's `g`."""
        for u in self._needs(unit):
            if u in self._open:
                continue
            k = self.plan.index(u)
            _, start, end = self.plan.units[k]
            buffer = self.eng.xp.zeros(self.plan.pieces[k] * self.comm.world_size, dtype=self.eng.dtype)
            views = self.eng.unit_views(buffer[:end - start], start, end)
            self.eng.g.update(views)
            self._open[u] = [buffer, list(views)]

    def reduce(self, unit, accumulate):
        """The unit's gradients, final: reduce-scattered into this rank's piece of the shard's gradients
        (added to them with accumulate), the unit's buffer freed."""
        self._record("reduce", unit)
        buffer, names = self._open.pop(unit)
        for name in names:
            del self.eng.g[name]
        k = self.plan.index(unit)
        piece, at = self.plan.pieces[k], self.plan.at[k]
        mine = self.grads[at:at + piece]
        if accumulate:
            summed = self.eng.xp.empty(piece, dtype=self.eng.dtype)
            self.comm.reduce_scatter_sum(buffer, summed)
            mine += summed
        else:
            self.comm.reduce_scatter_sum(buffer, mine)

    # ----------------------------------------------------------------------------------------- the step
    def start_step(self, lr, weight_decay, grad_clip, values=()):
        """DataParallel.start_step's, over the shard: its gradients were reduce-scattered by the backward pass."""
        eng, comm, opt = self.eng, self.comm, self.optimizer
        squares = opt.squared_norm(self.grads, on_device=True)
        both = comm.all_reduce_sum(self._step_values(squares, values))
        opt.update(self.master, self.grads, lr, weight_decay, 1.0, self.compute, squares=both[0],
                   grad_clip=grad_clip)
        if self.stage == 2:
            self._gather_weights(eng.weights)
        return self._numbers(both)

    def _gather_weights(self, weights):
        """Every unit's compute weights, whole, into `weights` (in place: this rank's pieces, then every rank's)."""
        source = self.compute if self.compute is not None else self.master
        for k, (lo, hi, at) in enumerate(self.mine):
            weights[lo:hi] = source[at:at + hi - lo]
            self.comm.all_gather_ranges(weights, self.plan.unit_ranges(k))

    @contextlib.contextmanager
    def evaluating(self):
        """Every rank: ZeRO-3's compute weights gathered whole for the evaluation, sampling or closing work
        inside (rank 0's), with the sharding off; freed after. ZeRO-2 holds them: nothing to do."""
        eng = self.eng
        if self.stage != 3:
            yield
            return
        weights = eng.xp.empty(self.plan.total, dtype=eng.act)
        self._gather_weights(weights)
        eng.weights, eng.p, eng.sharding = weights, eng._fused_views(weights), None
        if self.compute is None:
            eng.params = weights  # fp32: the compute weights are the weights
        # decoding's recorded steps (CUDA graphs) read the weights where they were: not kept across gathers
        eng._decoder = None
        try:
            yield
        finally:
            eng.weights = eng.params = eng._decoder = None
            eng.p, eng.sharding = {}, self

    # ------------------------------------------------------------------------------------ checkpoints
    def streamed(self):
        """(master weights, (m, v)) as Streamed buffers, for checkpoint.save."""
        opt = self.optimizer
        return Streamed(self, self.master), (Streamed(self, opt.m), Streamed(self, opt.v))

    def whole(self, shard):
        """A shard's whole flat buffer (every rank: a collective), as a float32 host array (tests, small models)."""
        out = np.empty(self.plan.total, dtype=np.float32)
        for k, (_, start, end) in enumerate(self.plan.units):
            out[start:end] = to_numpy(self.gather_unit(shard, k))[:end - start]
        return out

    def params_numpy(self):
        return self.whole(self.master)

    def opt_state_numpy(self):
        return self.whole(self.optimizer.m), self.whole(self.optimizer.v)

    def device_memory(self):
        return 0
