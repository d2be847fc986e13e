"""Data-parallel training: which rank this process is, the few collectives training needs, and the optimizer
step of N ranks (`nanoeuler train|sft ... --gpus N`; docs/multi-gpu.md).

A run of N ranks is N processes. `--gpus N` starts them itself (nanoeuler/train/launch.py); any other launcher
(torchrun, Slurm, a script per host) starts them with the torchrun-style environment variables that
World.from_env reads: RANK, WORLD_SIZE, LOCAL_RANK (which GPU of its host; default RANK), MASTER_ADDR and
MASTER_PORT (where rank 0 holds the rendezvous). Without them the process is a world of one.

    world = World.from_env()
    comm = make_communicator(world, device)     # SingleProcess, SharedMemoryCommunicator or NcclCommunicator
    parallel = DataParallel(eng, AdamW(eng, hp.beta1, hp.beta2), comm, zero=True)
    grad_norm = parallel.step(lr, hp.weight_decay, hp.grad_clip)  # after every rank's backward pass

A communicator has exactly the collectives the training loop uses, all blocking, all called by every rank in
the same order: all_reduce_sum (in place; the flat float32 gradients, or small float64 host arrays of target
counts and losses), reduce_scatter_sum and all_gather (ZeRO-1's two halves of an all-reduce), broadcast and
barrier. Three implementations:

- SingleProcess: a world of one; every collective is the identity, so a one-process run computes bit for bit
  what it computed before data parallelism existed.
- SharedMemoryCommunicator: CPU ranks on one host (the CPU engine with --gpus N). Each rank writes its
  buffer into its slot of a shared-memory segment and reads the others'; the rendezvous's barrier orders the
  steps. It exists so that the whole data-parallel path (launcher, rendezvous, sums, ZeRO shards,
  checkpoints) runs and is tested without a GPU.
- NcclCommunicator: one GPU per rank, NCCL over device pointers (cupy.cuda.nccl); the NCCL unique id travels
  through the rendezvous. cupy is imported only here, only for GPU ranks. Run on one GPU, not yet on two
  (docs/multi-gpu.md lists what to run).

Both meet through rendezvous(): rank 0 serves a barrier and a value at MASTER_ADDR:MASTER_PORT over the
standard library's multiprocessing.managers.

Every rank sums in the same order, so all ranks hold bit-identical gradients, take bit-identical AdamW steps
and their weights never drift apart.
"""
import atexit
import dataclasses
import math
import os
import sys
import threading
import time

import numpy as np

from nanoeuler.env import env_int
from nanoeuler.errors import UserError
from nanoeuler.model.engine import to_numpy
from nanoeuler.model.optimizer import clip_scale

# A collective that does not complete in this many seconds means a rank died or hangs; the run ends with an
# error instead of waiting forever. Evaluation, sampling and checkpoints run on rank 0 while the others wait
# in their next collective, so it must cover the longest of those.
DEFAULT_TIMEOUT = 1800


def timeout():
    """NANOEULER_TIMEOUT (seconds) or DEFAULT_TIMEOUT."""
    return env_int("NANOEULER_TIMEOUT", DEFAULT_TIMEOUT, minimum=1)


@dataclasses.dataclass(frozen=True)
class World:
    """This process's place in the run: rank (0..world_size-1), local_rank (its GPU on this host) and the
    rendezvous address of rank 0."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    @property
    def is_main(self):
        """Rank 0 alone prints, plots, samples and writes checkpoints and the metrics log."""
        return self.rank == 0

    @classmethod
    def from_env(cls, env=None):
        """The world of the torchrun-style variables; a world of one when neither RANK nor WORLD_SIZE is set.
        A missing or malformed value is a one-line UserError."""
        env = os.environ if env is None else env
        if "RANK" not in env and "WORLD_SIZE" not in env:
            return cls()
        size = env_int("WORLD_SIZE", minimum=1, env=env)
        rank = env_int("RANK", env=env)
        if rank >= size:
            raise UserError(f"RANK={rank} must be below WORLD_SIZE={size}")
        local = env_int("LOCAL_RANK", default=rank, env=env)
        if size == 1:
            return cls(rank, size, local)
        addr = env.get("MASTER_ADDR")
        if not addr:
            raise UserError(f"WORLD_SIZE={size} needs MASTER_ADDR, the address of rank 0's host")
        port = env_int("MASTER_PORT", minimum=1, env=env)
        if port > 65535:
            raise UserError(f"MASTER_PORT={port} is not a port number")
        return cls(rank, size, local, addr, port)


def heartbeat():
    """Tell the launcher (nanoeuler/train/launch.py) that this rank finished a step: one byte down the pipe it
    passed in NANOEULER_HEARTBEAT_FD. Nothing without a launcher."""
    fd = env_int("NANOEULER_HEARTBEAT_FD", -1)
    if fd >= 0:
        try:
            os.write(fd, b".")
        except OSError:
            pass  # the launcher is gone; it stops the ranks itself when it can


def rendezvous(world, wait, value=None):
    """Meet every rank at rank 0's MASTER_ADDR:MASTER_PORT; returns (a barrier of all ranks, rank 0's value).

    Rank 0 serves a threading.Barrier and `value` (any picklable object, e.g. the NCCL unique id) over the
    standard library's multiprocessing.managers, authenticated with NANOEULER_RDZV_KEY (the launcher draws
    one at random), from a daemon thread that lives as long as its process; the others connect, retrying
    until rank 0 listens. A rank 0 that never listens, or is gone, is a one-line UserError."""
    from multiprocessing.managers import BarrierProxy, BaseManager, DictProxy

    address = (world.master_addr, world.master_port)
    key = os.environ.get("NANOEULER_RDZV_KEY", "nanoeuler").encode()

    class Rendezvous(BaseManager):
        pass

    if world.is_main:
        barrier, shared = threading.Barrier(world.world_size), {"value": value}
        Rendezvous.register("barrier", callable=lambda: barrier, proxytype=BarrierProxy)
        Rendezvous.register("shared", callable=lambda: shared, proxytype=DictProxy)
        try:
            server = Rendezvous(address=address, authkey=key).get_server()
        except OSError as e:
            raise UserError(f"rank 0 cannot listen on {address[0]}:{address[1]}: {e.strerror or e}") from None
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return barrier, value
    Rendezvous.register("barrier", proxytype=BarrierProxy)
    Rendezvous.register("shared", proxytype=DictProxy)
    client = Rendezvous(address=address, authkey=key)
    deadline = time.monotonic() + wait
    while True:
        try:
            client.connect()
            break
        except (ConnectionRefusedError, FileNotFoundError):
            if time.monotonic() > deadline:
                raise UserError(f"rank {world.rank}: rank 0 did not open {address[0]}:{address[1]} in "
                                f"{wait} s") from None
            time.sleep(0.05)
        except (ConnectionError, EOFError):  # rank 0 opened it and went away (it failed first)
            raise UserError(f"rank {world.rank}: lost rank 0 (it exited or crashed)") from None
    try:
        return client.barrier(), client.shared()["value"]
    except (ConnectionError, EOFError):
        raise UserError(f"rank {world.rank}: lost rank 0 (it exited or crashed)") from None


# ------------------------------------------------------------------------------------------ communicators
class SingleProcess:
    """A world of one: every collective leaves its data as it is."""
    rank, world_size = 0, 1

    def all_reduce_sum(self, a):
        return a

    def reduce_scatter_sum(self, src, dst):
        dst[...] = src[:dst.size]

    def all_gather(self, src, dst):
        dst[:src.size] = src

    def broadcast(self, a, root=0):
        return a

    def barrier(self):
        pass


class SharedMemoryCommunicator:
    """CPU ranks on one host. Buffers travel through a shared-memory segment of world_size slots (created by
    rank 0, grown when a larger buffer comes, its name derived from the rendezvous port); the rendezvous's
    barrier separates writing the slots from reading them. Each rank sums the slots in rank order itself, so
    every rank gets the same bits. A barrier that waits longer than the timeout breaks for every rank: a dead
    or hung rank ends the run with an error, never a hang."""

    def __init__(self, world, wait=None):
        self.rank, self.world_size, self.wait = world.rank, world.world_size, wait or timeout()
        self._prefix = f"nanoeuler{world.master_port}_"  # one run per rendezvous port at a time
        self._barrier, _ = rendezvous(world, self.wait)
        self._shm, self._generation, self._slot_bytes = None, 0, 0
        atexit.register(self.close)  # rank 0 unlinks the segment when its process ends

    def barrier(self):
        try:
            self._barrier.wait(self.wait)
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
    """One GPU per rank over NCCL (cupy.cuda.nccl.NcclCommunicator on device pointers, the current stream).

    Rank 0 draws the NCCL unique id and hands it to the others through rendezvous(), as get_unique_id gave
    it (CuPy 14 gives bytes, earlier versions a tuple of ints: NcclCommunicator takes back its own kind).
    Host arrays (target counts, losses) are copied to the GPU and back. Waiting for a collective polls its
    completion and ncclCommGetAsyncError; past the timeout the communicator is aborted and the run ends with
    a one-line error naming this rank. NVLink multicast (NVLS) is off unless NCCL_NVLS_ENABLE says otherwise
    (docs/multi-gpu.md, which also says what has run on GPUs and what has not)."""

    def __init__(self, world, wait=None):
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        import cupy
        from cupy.cuda import nccl

        self.rank, self.world_size, self.wait = world.rank, world.world_size, wait or timeout()
        self._cupy, self._nccl = cupy, nccl
        self._types = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
                       np.dtype(np.int32): nccl.NCCL_INT32, np.dtype(np.int64): nccl.NCCL_INT64,
                       np.dtype(np.uint8): nccl.NCCL_UINT8}
        if world.local_rank >= cupy.cuda.runtime.getDeviceCount():
            raise UserError(f"rank {world.rank} needs GPU {world.local_rank} (LOCAL_RANK), but this host has "
                            f"{cupy.cuda.runtime.getDeviceCount()}")
        _, uid = rendezvous(world, self.wait, nccl.get_unique_id() if world.is_main else None)
        cupy.cuda.Device(world.local_rank).use()
        self._comm = nccl.NcclCommunicator(world.world_size, uid, world.rank)
        self._flag = cupy.zeros(1, dtype=np.float32)

    def _on_device(self, a):
        return (a, False) if isinstance(a, self._cupy.ndarray) else (self._cupy.asarray(a), True)

    def _args(self, a):
        if a.dtype not in self._types or not a.flags.c_contiguous:
            raise TypeError(f"NCCL buffer of {a.dtype}, contiguous {a.flags.c_contiguous}")
        return self._types[a.dtype], self._cupy.cuda.get_current_stream().ptr

    def _wait(self, what):
        """Block until the collectives queued so far are done; abort and raise past the timeout or on an
        asynchronous NCCL error."""
        event = self._cupy.cuda.Event(block=False, disable_timing=True)
        event.record()
        deadline = time.monotonic() + self.wait
        while not event.done:
            try:
                self._comm.check_async_error()
            except self._nccl.NcclError as e:
                self._comm.abort()
                raise UserError(f"rank {self.rank}: NCCL {what} failed: {e}") from None
            if time.monotonic() > deadline:
                self._comm.abort()
                raise UserError(f"rank {self.rank}: NCCL {what} did not complete in {self.wait} s (a rank died "
                                f"or hangs)")
            time.sleep(1e-4)

    # The sums wait for their result (polled, see _wait): the step reads it on the host right after anyway
    # (the gradient norm), and a dead peer is caught here instead of hanging that read.
    def all_reduce_sum(self, a):
        d, host = self._on_device(a)
        dtype, stream = self._args(d)
        self._comm.allReduce(d.data.ptr, d.data.ptr, d.size, dtype, self._nccl.NCCL_SUM, stream)
        self._wait("all-reduce")
        if host:
            a[...] = d.get().reshape(a.shape)
        return a

    def reduce_scatter_sum(self, src, dst):
        dtype, stream = self._args(src)
        self._comm.reduceScatter(src.data.ptr, dst.data.ptr, dst.size, dtype, self._nccl.NCCL_SUM, stream)
        self._wait("reduce-scatter")

    def all_gather(self, src, dst):
        dtype, stream = self._args(src)
        self._comm.allGather(src.data.ptr, dst.data.ptr, src.size, dtype, stream)

    def broadcast(self, a, root=0):
        d, host = self._on_device(a)
        dtype, stream = self._args(d)
        self._comm.broadcast(d.data.ptr, d.data.ptr, d.size, dtype, root, stream)
        if host:
            self._wait("broadcast")
            a[...] = d.get().reshape(a.shape)
        return a

    def barrier(self):
        self.all_reduce_sum(self._flag)

    def close(self):
        self._comm.destroy()


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


# ------------------------------------------------------------------------------------- the optimizer step
class DataParallel:
    """The parts of a training step that change with N ranks, around an engine and an optimizer that know
    nothing of them.

    Without ZeRO every rank all-reduces the flat gradient buffer and takes the same AdamW step over all the
    weights. With zero (ZeRO stage 1), rank r keeps only shard r of the AdamW moments (1/N of their memory,
    AdamW.shard): the gradients are reduce-scattered, each rank updates its shard of the weights, and an
    all-gather hands every rank all the updated weights. The clipping norm is the global one (an all-reduce
    of the shards' sums of squares). In a world of one this is exactly AdamW.step."""

    def __init__(self, eng, optimizer, comm=None, zero=False):
        self.eng, self.comm = eng, comm or SingleProcess()
        n, r = self.comm.world_size, self.comm.rank
        self.zero = zero and n > 1
        if n > 1:  # every rank starts from rank 0's weights, whatever it loaded
            self.comm.broadcast(eng.params, 0)
            eng.sync_weights()
        self.optimizer = optimizer
        if self.zero:
            eng.pad_buffers(n)
            self.optimizer = optimizer.shard(eng, r, n)  # the full moments are dropped: that is the memory saved
            size = self.optimizer.m.size
            self.shard = slice(r * size, (r + 1) * size)
            self.grad_shard = eng.xp.empty(size, dtype=eng.dtype)
            if eng.device_memory() is not None:
                eng.xp.get_default_memory_pool().free_all_blocks()  # so that CuPy's pool hands it back

    def any(self, flag):
        """True on every rank when flag is true on any (a Ctrl-C that reached the ranks at different steps)."""
        return bool(self.comm.all_reduce_sum(np.array([float(flag)]))[0])

    def step(self, lr, weight_decay, grad_clip):
        """Sum the ranks' gradients, clip to the global norm, one AdamW step; returns the norm."""
        eng, comm, opt = self.eng, self.comm, self.optimizer
        if not self.zero:
            comm.all_reduce_sum(eng.grads)
            return opt.step(eng, lr, weight_decay, grad_clip)
        comm.reduce_scatter_sum(eng.grads_padded, self.grad_shard)
        norm = math.sqrt(comm.all_reduce_sum(np.array([opt.squared_norm(self.grad_shard)]))[0])
        mine = eng.params_padded[self.shard]
        opt.update(mine, self.grad_shard, lr, weight_decay, clip_scale(norm, grad_clip))
        comm.all_gather(mine, eng.params_padded)
        eng.sync_weights()
        return norm

    def opt_state_numpy(self):
        """The full AdamW moments (m, v) as float32 host arrays, for a checkpoint that any number of ranks (or
        the CPU) resumes; with ZeRO a collective: every rank must call it."""
        if not self.zero:
            return self.optimizer.state()
        full = self.eng.xp.empty(self.eng.params_padded.size, dtype=self.eng.dtype)
        out = []
        for shard in (self.optimizer.m, self.optimizer.v):
            self.comm.all_gather(shard, full)
            out.append(to_numpy(full[:self.eng.params.size]).astype(np.float32))
        return tuple(out)
