"""The few collectives that data-parallel work needs, over N ranks: training's gradient sums (train/
distributed.py), evaluation's gathered scores (eval/), a rank 0's text sent to all.

    world = World.from_env()                    # parallel/world.py: which rank this process is
    comm = make_communicator(world, device)     # SingleProcess, SharedMemoryCommunicator or NcclCommunicator

A communicator has exactly the collectives the callers use, called by every rank in the same order:
all_reduce_sum (in place: device arrays, or small float64 host arrays of counts, losses and scores),
reduce_scatter_sum and all_gather (the two halves of an all-reduce), all_gather_ranges (pieces of different
lengths), broadcast and barrier; and start_all_reduce / start_reduce_scatter / start_all_gather with join(),
which let reductions run beside other work (start_all_gather returns a handle that wait_for(handle) waits for
alone: ZeRO-3's prefetched weights). On device arrays a collective is ordered on the GPU (what is
queued after it sees its result), on host arrays it returns with the result. Three implementations:

- SingleProcess: a world of one; every collective is the identity, so a one-process run computes bit for bit
  what it computes without data parallelism.
- SharedMemoryCommunicator: CPU ranks on one host (the CPU engine with --gpus N). Each rank writes its
  buffer into its slot of a shared-memory segment and reads the others'; the rendezvous's barrier orders the
  steps. It exists so that the whole data-parallel path (launcher, rendezvous, buckets, sums, ZeRO shards,
  checkpoints) runs and is tested without a GPU; its "started" reductions are done at once.
- NcclCommunicator: one GPU per rank, NCCL over device pointers (cupy.cuda.nccl) on a stream of its own, so
  that reductions can overlap the compute stream's work; the NCCL unique id travels through the rendezvous.
  cupy is imported only here, only for GPU ranks.

Within one host, NcclCommunicator.copy_engine_reduction gives training's reduce-scatter a path with no kernel
on the multiprocessors (CopyEngineReduction): each rank copies the other ranks' pieces of a gradient bucket
straight into their memory (CUDA IPC, the GPUs' copy engines over NVLink or PCIe) as the backward pass finishes
the bucket, and each rank sums what it received in rank order.

Every rank sums in the same order, so all ranks hold bit-identical sums.
"""
import atexit
import collections
import os
import sys
import threading
import time

import numpy as np

from nanoeuler.env import env_int
from nanoeuler.errors import UserError
from nanoeuler.parallel.world import World, rendezvous  # noqa: F401  (World: the callers' one import)

MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: unified addressing tells where each address is

# A collective that does not complete in this many seconds means a rank died or hangs; the run ends with an
# error instead of waiting forever. Evaluation, sampling and checkpoints run on rank 0 while the others wait
# in their next collective, so it must cover the longest of those.
DEFAULT_TIMEOUT = 1800


def timeout():
    """NANOEULER_TIMEOUT (seconds) or DEFAULT_TIMEOUT."""
    return env_int("NANOEULER_TIMEOUT", DEFAULT_TIMEOUT, minimum=1)


def heartbeat():
    """Tell the launcher (nanoeuler/parallel/launch.py) that this rank finished a step: one byte down the pipe it
    passed in NANOEULER_HEARTBEAT_FD. Nothing without a launcher. A pipe nobody reads any more means the launcher
    was killed (SIGKILL: it could not stop the ranks): the rank stops rather than train on, unwatched."""
    fd = env_int("NANOEULER_HEARTBEAT_FD", -1)
    if fd >= 0:
        try:
            os.write(fd, b".")
        except BrokenPipeError:
            raise UserError("the launcher of this run is gone (killed?): this rank stops") from None


# ------------------------------------------------------------------------------------------ communicators
class _Synchronous:
    """Reductions "started" are done at once: a communicator with no stream to run them on."""

    def start_all_reduce(self, a):
        self.all_reduce_sum(a)

    def start_reduce_scatter(self, src, dst):
        self.reduce_scatter_sum(src, dst)

    def start_all_gather(self, src, dst):
        self.all_gather(src, dst)

    def join(self):
        pass

    def wait_for(self, handle):
        pass


class SingleProcess(_Synchronous):
    """A world of one: every collective leaves its data as it is."""
    rank, world_size = 0, 1

    def all_reduce_sum(self, a):
        return a

    def reduce_scatter_sum(self, src, dst):
        dst[...] = src[:dst.size]

    def all_gather(self, src, dst):
        dst[:src.size] = src

    def all_gather_ranges(self, buffer, ranges):
        pass

    def broadcast(self, a, root=0):
        return a

    def barrier(self):
        pass


class SharedMemoryCommunicator(_Synchronous):
    """CPU ranks on one host. Buffers travel through a shared-memory segment of world_size slots (created by
    rank 0, grown when a larger buffer comes, its name derived from the rendezvous port); the rendezvous's
    barrier separates writing the slots from reading them. Each rank sums the slots in rank order itself, so
    every rank gets the same bits. A barrier that waits longer than the timeout breaks for every rank: a dead
    or hung rank ends the run with an error, never a hang."""

    def __init__(self, world, wait=None):
        self.rank, self.world_size, self.wait = world.rank, world.world_size, wait or timeout()
        self._prefix = f"nanoeuler{world.master_port}_"  # one run per rendezvous port at a time
        self._meeting = rendezvous(world, self.wait)
        self._shm, self._generation, self._slot_bytes = None, 0, 0
        atexit.register(self.close)  # rank 0 unlinks the segment when its process ends

    def barrier(self):
        try:
            self._meeting.wait(self.wait)
        except threading.BrokenBarrierError:
            raise UserError(f"rank {self.rank}: the other ranks did not answer within {self.wait} s (a rank "
                            f"died or hangs)") from None
        except (EOFError, OSError):
            raise UserError(f"rank {self.rank}: lost rank 0 (it exited or crashed)") from None

    def _slots(self, nbytes):
        """The segment as (world_size, slot bytes) uint8, grown first if a slot holds fewer than nbytes.
        Every rank calls this with the same sizes in the same order, so all grow it at the same call."""
        if nbytes > self._slot_bytes:
            from multiprocessing import shared_memory
            old, self._slot_bytes = self._shm, max(nbytes, 2 * self._slot_bytes)
            self._generation += 1
            name = f"{self._prefix}{self._generation}"
            if self.rank == 0:
                self._shm = shared_memory.SharedMemory(name, create=True, size=self.world_size * self._slot_bytes)
            self.barrier()
            if self.rank != 0:
                self._shm = _attach(name)
            if old is not None:
                old.close()
                if self.rank == 0:
                    old.unlink()
        return np.ndarray((self.world_size, self._slot_bytes), np.uint8, self._shm.buf)

    def _exchange(self, a):
        """Write a into this rank's slot, wait for every rank's; (world_size, a.size) views of all slots."""
        a = np.ascontiguousarray(a)
        slots = self._slots(a.nbytes)
        mine = slots[self.rank, :a.nbytes].view(a.dtype)
        mine[...] = a.reshape(-1)
        self.barrier()
        return slots[:, :a.nbytes].view(a.dtype)

    def all_reduce_sum(self, a):
        total = self._exchange(a).sum(axis=0, dtype=a.dtype)
        self.barrier()  # nobody writes a slot again before every rank has read them all
        a[...] = total.reshape(a.shape)
        return a

    def reduce_scatter_sum(self, src, dst):
        n = dst.size
        shard = self._exchange(src)[:, self.rank * n:(self.rank + 1) * n]
        dst[...] = shard.sum(axis=0, dtype=src.dtype)
        self.barrier()

    def all_gather(self, src, dst):
        gathered = self._exchange(src).reshape(-1)
        dst[...] = gathered
        self.barrier()

    def all_gather_ranges(self, buffer, ranges):
        """buffer[start:end] of rank q's range (ranges[q]) on every rank; the ranges may differ in length."""
        longest = max(end - start for start, end in ranges)
        mine = np.zeros(longest, dtype=buffer.dtype)
        start, end = ranges[self.rank]
        mine[:end - start] = buffer[start:end]
        every = self._exchange(mine)
        for q, (start, end) in enumerate(ranges):
            buffer[start:end] = every[q, :end - start]
        self.barrier()

    def broadcast(self, a, root=0):
        value = self._exchange(a)[root].copy()
        self.barrier()
        a[...] = value.reshape(a.shape)
        return a

    def close(self):
        if self._shm is not None:
            self._shm.close()
            if self.rank == 0:
                self._shm.unlink()
            self._shm = None


def _attach(name):
    """Open an existing shared-memory segment without handing it to this process's resource tracker, which
    would unlink it (and warn) when this process exits, while rank 0 still owns it (Python < 3.13 has no
    track=False)."""
    from multiprocessing import resource_tracker, shared_memory
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name, track=False)
    shm = shared_memory.SharedMemory(name)
    resource_tracker.unregister(shm._name, "shared_memory")
    return shm


class NcclCommunicator:
    """One GPU per rank over NCCL (cupy.cuda.nccl.NcclCommunicator on device pointers).

    Every collective runs on the communicator's own stream (non-blocking, so the legacy default stream on
    which the engine computes does not serialise with it): it starts after the work queued so far on the
    caller's stream, and the caller's stream waits for it before what comes next (at once, or at join() for
    the started ones). Rank 0 draws the NCCL unique id and hands it to the others through the rendezvous, as
    get_unique_id gave it (CuPy 14 gives bytes, earlier versions a tuple of ints). Host arrays (target counts,
    losses) are copied to the GPU and back, and the host waits for them.

    A watchdog thread follows every collective: one not done within the timeout (or an asynchronous NCCL
    error) ends the process at once with a one-line error naming this rank and the collective, exit status 2;
    so does a collective that hangs because a peer died, whatever the host waits in. NVLink multicast (NVLS)
    is off unless NCCL_NVLS_ENABLE says otherwise (docs/multi-gpu.md)."""

    def __init__(self, world, wait=None):
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        import cupy
        from cupy.cuda import nccl

        self.rank, self.world_size, self.wait = world.rank, world.world_size, wait or timeout()
        self._cupy, self._nccl = cupy, nccl
        self._types = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
                       np.dtype(np.int32): nccl.NCCL_INT32, np.dtype(np.int64): nccl.NCCL_INT64,
                       np.dtype(np.uint8): nccl.NCCL_UINT8,
                       np.dtype(np.uint16): nccl.NCCL_FLOAT16}  # bf16 weights: only moved, never summed
        count = cupy.cuda.runtime.getDeviceCount()
        bound = count == 1 and os.environ.get("CUDA_VISIBLE_DEVICES")  # a launcher gave this rank its one GPU
        if world.local_rank >= count and not bound:
            raise UserError(f"rank {world.rank} needs GPU {world.local_rank} (its local rank), but this host has "
                            f"{count}")
        self.device = 0 if bound else world.local_rank
        meeting = rendezvous(world, self.wait, nccl.get_unique_id() if world.is_main else None)
        cupy.cuda.Device(self.device).use()
        self._comm = nccl.NcclCommunicator(world.world_size, meeting.value, world.rank)
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._flag = cupy.zeros(1, dtype=np.float32)
        self._started = None  # the event of the last started collective not yet joined
        self._pending = collections.deque()  # (event, since, what) of collectives the watchdog follows
        self._closed = False
        threading.Thread(target=self._watchdog, daemon=True).start()

    def _args(self, a):
        if a.dtype not in self._types or not a.flags.c_contiguous:
            raise TypeError(f"NCCL buffer of {a.dtype}, contiguous {a.flags.c_contiguous}")
        return self._types[a.dtype]

    def _run(self, what, collective):
        """collective(stream pointer) on the communicator's stream after the caller's queued work; its event."""
        cupy = self._cupy
        caller = cupy.cuda.get_current_stream()
        ready = cupy.cuda.Event(block=False, disable_timing=True)
        ready.record(caller)
        self._stream.wait_event(ready)
        collective(self._stream.ptr)
        done = cupy.cuda.Event(block=False, disable_timing=True)
        done.record(self._stream)
        self._pending.append((done, time.monotonic(), what))
        return done

    def _watchdog(self):
        """Ends the process when the oldest collective is not done within the timeout, or NCCL reports an error."""
        self._cupy.cuda.Device(self.device).use()
        period = min(1.0, self.wait / 10)
        while not self._closed:
            while self._pending and self._pending[0][0].done:
                self._pending.popleft()
            if self._pending:
                _, since, what = self._pending[0]
                problem = None
                try:
                    self._comm.check_async_error()
                except self._nccl.NcclError as e:
                    problem = f"NCCL {what} failed: {e}"
                if problem is None and time.monotonic() - since > self.wait:
                    problem = f"NCCL {what} did not complete in {self.wait} s (a rank died or hangs)"
                if problem and not self._closed:
                    os.write(2, f"nanoeuler: error: rank {self.rank}: {problem}\n".encode())
                    os._exit(2)
            time.sleep(period)

    def _ordered(self, done):
        self._cupy.cuda.get_current_stream().wait_event(done)

    def all_reduce_sum(self, a):
        host = not isinstance(a, self._cupy.ndarray)
        d = self._cupy.asarray(a) if host else a
        dtype = self._args(d)
        done = self._run("all-reduce", lambda stream: self._comm.allReduce(d.data.ptr, d.data.ptr, d.size, dtype,
                                                                          self._nccl.NCCL_SUM, stream))
        self._ordered(done)
        if host:
            a[...] = d.get().reshape(a.shape)
        return a

    def reduce_scatter_sum(self, src, dst):
        self._ordered(self._reduce_scatter(src, dst))

    def _reduce_scatter(self, src, dst):
        dtype = self._args(src)
        return self._run("reduce-scatter", lambda stream: self._comm.reduceScatter(
            src.data.ptr, dst.data.ptr, dst.size, dtype, self._nccl.NCCL_SUM, stream))

    def all_gather(self, src, dst):
        """dst (world_size x src.size) from every rank's src; src may be dst's rank-th piece (in place)."""
        dtype = self._args(src)
        self._ordered(self._run("all-gather", lambda stream: self._comm.allGather(
            src.data.ptr, dst.data.ptr, src.size, dtype, stream)))

    def all_gather_ranges(self, buffer, ranges):
        """buffer[start:end] of rank q's range (ranges[q]) on every rank, in place; the ranges may differ in
        length (one broadcast from each rank, grouped into one launch)."""
        dtype, nccl = self._args(buffer), self._nccl

        def gather(stream):
            nccl.groupStart()
            for root, (start, end) in enumerate(ranges):
                piece = buffer[start:end]
                self._comm.broadcast(piece.data.ptr, piece.data.ptr, piece.size, dtype, root, stream)
            nccl.groupEnd()
        self._ordered(self._run("all-gather", gather))

    def start_all_gather(self, src, dst):
        """all_gather, started: join() or wait_for(the returned handle) orders the caller's stream after it."""
        dtype = self._args(src)
        self._started = self._run("all-gather", lambda stream: self._comm.allGather(
            src.data.ptr, dst.data.ptr, src.size, dtype, stream))
        return self._started

    def wait_for(self, handle):
        """The caller's stream waits for the started collective of `handle` (and those before it) alone."""
        self._ordered(handle)

    def start_all_reduce(self, a):
        dtype = self._args(a)
        self._started = self._run("all-reduce", lambda stream: self._comm.allReduce(
            a.data.ptr, a.data.ptr, a.size, dtype, self._nccl.NCCL_SUM, stream))

    def start_reduce_scatter(self, src, dst):
        self._started = self._reduce_scatter(src, dst)

    def join(self):
        """The caller's stream waits for every started collective (they run in order on one stream)."""
        if self._started is not None:
            self._ordered(self._started)
            self._started = None

    def broadcast(self, a, root=0):
        host = not isinstance(a, self._cupy.ndarray)
        d = self._cupy.asarray(a) if host else a
        dtype = self._args(d)
        self._ordered(self._run("broadcast", lambda stream: self._comm.broadcast(
            d.data.ptr, d.data.ptr, d.size, dtype, root, stream)))
        if host:
            a[...] = d.get().reshape(a.shape)
        return a

    def barrier(self):
        self.all_reduce_sum(self._flag)
        self._flag.get()  # the host waits here (the watchdog ends a barrier that never opens)

    def copy_engine_reduction(self, shard_size, share=False):
        """A CopyEngineReduction of float32 shards of shard_size elements (share: see there) where every rank
        can reach every other's memory (one host, CUDA IPC, NCCL's peer-to-peer not disabled, NANOEULER_REDUCE
        not `nccl`); else None. Every rank gets the same answer (a collective: every rank calls it)."""
        wanted = os.environ.get("NANOEULER_REDUCE", "copy")
        if wanted not in ("copy", "nccl"):
            raise UserError(f"NANOEULER_REDUCE={wanted} must be copy or nccl")
        usable = wanted != "nccl" and os.environ.get("NCCL_P2P_DISABLE", "0") in ("", "0")
        host = np.zeros(64, np.uint8)  # this host's identity: ranks of other hosts cannot map each other's memory
        name = (_boot_id() + os.uname().nodename).encode()[:64]
        host[:len(name)] = np.frombuffer(name, np.uint8)
        hosts = self._cupy.zeros(self.world_size * 64, np.uint8)
        self.all_gather(self._cupy.asarray(host), hosts)
        usable = usable and bool((hosts.reshape(self.world_size, 64) == hosts[:64]).all())
        reduction = None
        if usable:
            try:
                reduction = CopyEngineReduction(self, shard_size, share)
            except self._cupy.cuda.runtime.CUDARuntimeError:
                reduction = None  # no peer access between these GPUs: NCCL's kernels then
        if self.all_reduce_sum(np.array([0.0 if reduction else 1.0]))[0] > 0:
            if reduction:
                reduction.close()
            return None
        return reduction

    def close(self):
        self._closed = True
        self._cupy.cuda.get_current_stream().synchronize()
        self._comm.destroy()


def _boot_id():
    """This boot of this machine (two containers may share a host name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class CopyEngineReduction:
    """Gradient sums through the GPUs' copy engines, for the ranks of one host.

    Each rank owns the q-th of N equal shards of the flat gradient buffer. As the backward pass finishes each
    layer, send() copies the layer's gradients that fall in another rank's shard into that rank's inbox:
    cudaMemcpyAsync to memory of the other rank's that this rank mapped with CUDA IPC, which the copy engines
    carry over NVLink (or PCIe) with no kernel on the multiprocessors, so the backward pass's matrix products
    run at full speed beside it (NCCL's reduction kernels, overlapped so, slowed them by as much as they hid).
    finish(), at the pass's end: a one-element NCCL all-reduce queued after this rank's copies is the barrier
    (it completes on a rank only when every rank has reached it, so after every rank's copies), then each rank
    adds its shard to what it received in rank order, g0 + g1 + ... + g(N-1) whatever the rank, taking the
    sum's squares (the gradient norm's) in the same pass: the sum of one process accumulating the ranks'
    batches one after another. That is a reduce-scatter (ZeRO-1 then updates its shard only). Without ZeRO
    every rank needs every sum: share() copies this rank's summed shard into the same place of every other
    rank's gradient buffer (which this object allocates, so that the other ranks can map it), beside the
    update of the rank's own shard, and wait_shared() is the barrier after those copies. Every rank then holds
    the same bits of every sum, having received (N-1)/N of the gradients' bytes during the pass and as much
    after it, and added only its own shard (an all-reduce of whole copies: N-1 times the bytes, all added).

    Memory a rank: the inbox of N-1 shards (`base` on 2 GPUs: 208 MB) beside the gradient buffer. A rank
    overwrites another's inbox only in the next step's backward pass, after a collective that follows the sums
    (the all-gather of the update, or the sum of the step's norm and losses) has taken that rank's
    contribution, so after its sums have read the inbox. share() writes the part of another rank's gradients
    that rank sent away during the pass (final there since the barrier, not read by its sum), and the other
    rank reads it, or writes its gradients again, only after wait_shared(). (With ZeRO-1 the gradients stay
    in the engine's pool: nothing writes into them from outside.)"""

    def __init__(self, comm, shard_size, share=False):
        """shard_size: the padded flat buffer's elements over N; share: allocate the gradient buffer too, which
        share() writes into on the other ranks (the engine then uses it: self.grads)."""
        cupy = comm._cupy
        self.comm, self._cupy, self.shard_size = comm, cupy, shard_size
        n, runtime = comm.world_size, cupy.cuda.runtime
        # one allocation of its own (not the pool's: an IPC handle names a whole allocation), the inbox first
        elements = ((n - 1) + (n if share else 0)) * shard_size
        self._memory = cupy.cuda.memory.Memory(elements * 4)
        whole = cupy.ndarray((elements,), np.float32, cupy.cuda.MemoryPointer(self._memory, 0))
        self.inbox = whole[:(n - 1) * shard_size].reshape(n - 1, shard_size)
        # the engine's padded gradient buffer (Engine.pad_buffers), where share() is to reach it
        self.grads = whole[(n - 1) * shard_size:] if share else None
        handle = np.frombuffer(runtime.ipcGetMemHandle(self._memory.ptr), np.uint8)
        handles = cupy.zeros(n * handle.size, np.uint8)
        comm.all_gather(cupy.asarray(handle), handles)
        handles = handles.get().reshape(n, handle.size)
        self._peers = {}  # other rank -> the device address of its allocation, mapped here
        try:
            for q in range(n):
                if q != comm.rank:
                    self._peers[q] = runtime.ipcOpenMemHandle(handles[q].tobytes())
        except runtime.CUDARuntimeError:
            self.close()
            raise
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._flag = cupy.zeros(1, np.float32)

    @property
    def nbytes(self):
        """Bytes of the allocation: the inbox (and the gradient buffer, with share)."""
        return self._memory.size

    def _after_caller(self):
        """The copy stream waits for the work queued so far on the caller's stream."""
        ready = self._cupy.cuda.Event(block=False, disable_timing=True)
        ready.record(self._cupy.cuda.get_current_stream())
        self._stream.wait_event(ready)

    def _copy(self, address, source, count):
        self._cupy.cuda.runtime.memcpyAsync(address, source, count * 4, MEMCPY_DEFAULT, self._stream.ptr)

    def send(self, grads, start, end):
        """Copy grads[start:end] (final once the work queued so far on the caller's stream is done) to the
        ranks whose shards hold them."""
        rank, size = self.comm.rank, self.shard_size
        self._after_caller()
        for q, peer in self._peers.items():
            lo, hi = max(start, q * size), min(end, (q + 1) * size)
            if lo < hi:
                slot = rank if rank < q else rank - 1  # this rank's part of q's inbox
                self._copy(peer + (slot * size + lo - q * size) * 4, grads[lo:hi].data.ptr, hi - lo)

    def _barrier(self):
        """A one-element all-reduce after the copies queued so far: done on a rank once every rank's are."""
        done = self._cupy.cuda.Event(block=False, disable_timing=True)
        with self._stream:
            self.comm.all_reduce_sum(self._flag)
        done.record(self._stream)
        return done

    def finish(self, grads, add_sum_squares):
        """This rank's shard of grads summed over the ranks, in place, ordered on the caller's stream, with
        add_sum_squares(out, a, b) (the engine layers': out = a + b and sum(out^2) in one pass). Returns the
        squares of the sum (a scalar on the device)."""
        self._cupy.cuda.get_current_stream().wait_event(self._barrier())
        rank, size = self.comm.rank, self.shard_size
        mine = grads[rank * size:(rank + 1) * size]
        ordered = list(self.inbox[:rank]) + [mine] + list(self.inbox[rank:])
        total = mine if rank <= 1 else ordered[0]  # a + b == b + a: ranks 0 and 1 sum into their own shard
        squares = add_sum_squares(total, ordered[0], ordered[1])
        for part in ordered[2:]:
            squares = add_sum_squares(total, total, part)
        if total is not mine:
            mine[...] = total
        return squares

    def share(self, grads):
        """Copy this rank's summed shard (once the caller's queued work is done) into every other rank's
        gradient buffer, on the copy stream. Call after finish(), then wait_shared() after the collectives
        that must not wait for these copies (the barrier queues behind them)."""
        rank, size = self.comm.rank, self.shard_size
        offset = ((self.comm.world_size - 1) * size + rank * size) * 4  # this shard in a peer's allocation
        self._after_caller()
        for peer in self._peers.values():
            self._copy(peer + offset, grads[rank * size:(rank + 1) * size].data.ptr, size)

    def wait_shared(self):
        """The caller's stream waits until every rank's shared shard is in this rank's gradient buffer."""
        self._cupy.cuda.get_current_stream().wait_event(self._barrier())

    def close(self):
        for address in self._peers.values():
            self._cupy.cuda.runtime.ipcCloseMemHandle(address)
        self._peers = {}


def make_communicator(world, device):
    """The communicator for this world on this device."""
    if world.world_size == 1:
        return SingleProcess()
    return NcclCommunicator(world) if device == "gpu" else SharedMemoryCommunicator(world)


def broadcast_text(comm, text):
    """rank 0's text on every rank (others pass None): what rank 0 alone computed, e.g. a new tokenizer."""
    data = np.frombuffer(text.encode(), np.uint8).copy() if comm.rank == 0 else None
    size = comm.broadcast(np.array([0 if data is None else data.size], np.int64))[0]
    data = comm.broadcast(data if data is not None else np.zeros(int(size), np.uint8))
    return data.tobytes().decode()
