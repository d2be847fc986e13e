"""Which rank this process is, read from whichever launcher started it, and where the ranks meet.

    world = World.from_env()          # a world of one when no launcher is found
    meeting = rendezvous(world, wait, value)   # every rank: .value is rank 0's value; .wait(timeout) a barrier

Launchers, in the order they are looked for (the first found decides; docs/multi-gpu.md):

| launcher | rank, ranks, GPU of the host | where rank 0 is reached |
|---|---|---|
| `--gpus N` (parallel/launch.py), torchrun, hand-set | RANK, WORLD_SIZE, LOCAL_RANK | MASTER_ADDR, MASTER_PORT |
| Open MPI (`mpirun`, `mpiexec`) | OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK | MPI itself (mpi4py), else MASTER_ADDR/PORT |
| MPICH, Intel MPI, PMI (`srun --mpi=pmi2`) | PMI_RANK, PMI_SIZE, MPI_LOCALRANKID | MPI itself (mpi4py), else MASTER_ADDR/PORT |
| Slurm (`srun`) | SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID | MASTER_ADDR (default: the step's first node), MASTER_PORT (default: from the job id) |

A process started under torchrun (TORCHELASTIC_RUN_ID) or by `--gpus` (NANOEULER_LAUNCHER) takes RANK and
friends alone: Slurm's and MPI's variables there describe the agents, not the workers. Elsewhere every
launcher's variables that are present must agree on the rank and the number of ranks, or the run stops with a
one-line error naming both.

The rendezvous passes rank 0's value (the NCCL unique id) to every rank and gives a barrier, through what the
launcher provides: torchrun's own store (torch.distributed's TCPStore, which its agent already serves at
MASTER_PORT), MPI's broadcast and barrier under mpirun (when mpi4py is installed and MASTER_ADDR is not set),
else a manager of the standard library's multiprocessing served by rank 0 at MASTER_ADDR:MASTER_PORT.
"""
import dataclasses
import os
import re
import threading
import time

from tqdm import tqdm

from nanoeuler.env import env_int
from nanoeuler.errors import UserError

# Slurm's rendezvous port when MASTER_PORT is not set: from the job id, so that two jobs sharing a node differ
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 20000


@dataclasses.dataclass(frozen=True)
class World:
    """This process's place in the run: rank (0..world_size-1), local_rank (its GPU on this host), the
    rendezvous address of rank 0 and the launcher that said so ("env", "torchrun", "mpi", "slurm")."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    launcher: str = None

    @property
    def is_main(self):
        """Rank 0 alone prints, plots, samples and writes checkpoints and the metrics log."""
        return self.rank == 0

    @classmethod
    def from_env(cls, env=None):
        """The world that the launcher's variables describe (the table above); a world of one without any. A
        missing, malformed or contradictory value is a one-line UserError."""
        env = os.environ if env is None else env
        found = [world for world in (_env_world(env), _mpi_world(env), _slurm_world(env)) if world is not None]
        if not found:
            return cls()
        first = found[0]
        if first.launcher in ("torchrun", "launcher"):
            found = found[:1]
        for other in found[1:]:
            if (other.rank, other.world_size) != (first.rank, first.world_size):
                raise UserError(f"the launchers' variables disagree: {first.says} but {other.says}; unset one")
        if first.world_size == 1:
            return cls()
        addr, port = first.address(env)
        return cls(first.rank, first.world_size, first.local_rank, addr, port,
                   "env" if first.launcher == "launcher" else first.launcher)


def world_of(gpus=None, nnodes=None):
    """This process's World, from the variables that `--gpus N` (parallel/launch.py), torchrun, srun or mpirun
    set, else a world of one; --gpus (x --nnodes), when given, must agree with it."""
    world = World.from_env()
    nodes = nnodes or 1
    if gpus is not None and gpus * nodes != world.world_size:
        hosts = f" x --nnodes {nodes}" if nodes > 1 else ""
        raise UserError(f"--gpus {gpus}{hosts} but WORLD_SIZE is {world.world_size}")
    return world


def printer(rank):
    """The one way a command prints on N ranks: `print` on rank 0 (through tqdm.write, which moves a progress
    bar on the terminal out of the way instead of writing through it), nothing on the others."""
    if rank != 0:
        return lambda *values, **options: None

    def say(*values, file=None, end="\n"):
        tqdm.write(" ".join(map(str, values)), file=file, end=end)
    return say


@dataclasses.dataclass
class _Claim:
    """What one launcher's variables say; `says` quotes them for an error."""
    launcher: str
    rank: int
    world_size: int
    local_rank: int
    says: str
    first_node: str = None
    default_port: int = None

    def address(self, env):
        """(MASTER_ADDR, MASTER_PORT) of rank 0's rendezvous; under MPI with mpi4py none is needed."""
        addr = env.get("MASTER_ADDR") or self.first_node
        if self.launcher == "mpi" and not env.get("MASTER_ADDR"):
            return "", 0  # MPI's own broadcast (rendezvous); checked there
        if not addr:
            raise UserError(f"WORLD_SIZE={self.world_size} needs MASTER_ADDR, the address of rank 0's host")
        port = env_int("MASTER_PORT", self.default_port, minimum=1, env=env)
        if port > 65535:
            raise UserError(f"MASTER_PORT={port} is not a port number")
        return addr, port


def _claim(env, launcher, rank_var, size_var, local_var, **extra):
    """A launcher's claim from its variables, or None when neither the rank nor the size variable is set."""
    if rank_var not in env and size_var not in env:
        return None
    size = env_int(size_var, minimum=1, env=env)
    rank = env_int(rank_var, env=env)
    if rank >= size:
        raise UserError(f"{rank_var}={rank} must be below {size_var}={size}")
    local = env_int(local_var, default=rank, env=env)
    return _Claim(launcher, rank, size, local, f"{rank_var}={rank} of {size_var}={size}", **extra)


def _env_world(env):
    launcher = "torchrun" if env.get("TORCHELASTIC_RUN_ID") else "launcher" if env.get("NANOEULER_LAUNCHER") else "env"
    return _claim(env, launcher, "RANK", "WORLD_SIZE", "LOCAL_RANK")


def _mpi_world(env):
    return (_claim(env, "mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
            or _claim(env, "mpi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"))


def _slurm_world(env):
    """srun's task variables (a batch script alone, with no SLURM_PROCID, is no world)."""
    if "SLURM_PROCID" not in env:
        return None
    size_var = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    job = env_int("SLURM_JOB_ID", 0, env=env)
    return _claim(env, "slurm", "SLURM_PROCID", size_var, "SLURM_LOCALID", first_node=first_host(nodes),
                  default_port=SLURM_PORT_BASE + job % SLURM_PORT_SPAN)


def first_host(nodelist):
    """The first host of a Slurm host list: 'gpu[003-010,012],cpu1' -> 'gpu003'; None for None."""
    if not nodelist:
        return None
    match = re.match(r"([^,\[]*)(?:\[([^\],-]+)[^\]]*\])?([^,]*)", nodelist.strip())
    prefix, first, suffix = match.groups()
    return prefix + (first or "") + suffix


# -------------------------------------------------------------------------------------- the rendezvous
class Meeting:
    """What rendezvous() returns: rank 0's `value` and `wait(timeout)`, a barrier of every rank that raises
    threading.BrokenBarrierError past its timeout."""

    def __init__(self, value, barrier):
        self.value, self._barrier = value, barrier

    def wait(self, timeout):
        self._barrier(timeout)


def rendezvous(world, wait, value=None):
    """Meet every rank of `world` through what its launcher provides (the module's docstring); rank 0 passes
    `value` (picklable) to all. A rank 0 that never comes is a one-line UserError after `wait` seconds."""
    kind = os.environ.get("NANOEULER_RENDEZVOUS") or (
        "torch" if world.launcher == "torchrun" else "mpi" if world.launcher == "mpi" and not world.master_port
        else "tcp")
    if kind == "torch":
        return _torch_rendezvous(world, wait, value)
    if kind == "mpi":
        return _mpi_rendezvous(world, value)
    if kind != "tcp":
        raise UserError(f"NANOEULER_RENDEZVOUS={kind!r}: expected torch, mpi or tcp")
    return _tcp_rendezvous(world, wait, value)


def _torch_rendezvous(world, wait, value):
    """torchrun's store (its agent serves it at MASTER_PORT: the workers are its clients)."""
    import pickle
    from datetime import timedelta

    import torch.distributed as dist
    store, _, _ = next(dist.rendezvous("env://", world.rank, world.world_size, timeout=timedelta(seconds=wait)))
    prefix = f"nanoeuler/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    store = dist.PrefixStore(prefix, store)
    if world.is_main:
        store.set("value", pickle.dumps(value))
    else:
        try:
            value = pickle.loads(store.get("value"))
        except RuntimeError:
            raise UserError(f"rank {world.rank}: rank 0 did not come to torchrun's store in {wait} s") from None
    rounds = iter(range(1 << 62))

    def barrier(timeout):
        key = f"barrier{next(rounds)}"
        if store.add(key, 1) == world.world_size:
            store.set(key + "/open", b"1")
        try:
            store.wait([key + "/open"], timedelta(seconds=timeout))
        except RuntimeError:
            raise threading.BrokenBarrierError from None
    return Meeting(value, barrier)


def _mpi_rendezvous(world, value):
    """MPI's own broadcast and barrier (mpirun started the ranks; mpi4py initialises MPI)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise UserError("started by mpirun, but mpi4py is not installed (pip install mpi4py), and MASTER_ADDR "
                        "and MASTER_PORT are not set for the TCP rendezvous") from None
    comm = MPI.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (world.rank, world.world_size):
        raise UserError(f"MPI says rank {comm.Get_rank()} of {comm.Get_size()}, the environment rank {world.rank} of "
                        f"{world.world_size}: mpi4py's MPI is not the launcher's; set MASTER_ADDR and MASTER_PORT")
    return Meeting(comm.bcast(value, root=0), lambda timeout: comm.Barrier())


def _tcp_rendezvous(world, wait, value):
    """Rank 0 serves a threading.Barrier and `value` over the standard library's multiprocessing.managers,
    authenticated with NANOEULER_RDZV_KEY (the launcher draws one at random), from a daemon thread that lives
    as long as its process; the others connect, retrying until rank 0 listens."""
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
        return Meeting(value, _barrier_waiting(barrier, world.rank))
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
        return Meeting(client.shared()["value"], _barrier_waiting(client.barrier(), world.rank))
    except (ConnectionError, EOFError):
        raise UserError(f"rank {world.rank}: lost rank 0 (it exited or crashed)") from None


def _barrier_waiting(barrier, rank):
    def wait(timeout):
        try:
            barrier.wait(timeout)
        except (EOFError, OSError):
            raise UserError(f"rank {rank}: lost rank 0 (it exited or crashed)") from None
    return wait
