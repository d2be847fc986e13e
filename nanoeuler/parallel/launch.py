"""The launcher of `nanoeuler train|sft|dpo|eval ... --gpus N`: N worker processes running the same command,
one per GPU (or, with the CPU engine, per CPU rank), watched until they end.

    nanoeuler train base --gpus 2     # two workers: `nanoeuler train base --gpus 2` with RANK=0 and RANK=1
    # two hosts of 8 GPUs, one launcher on each (node rank 0 on host0, 1 on host1):
    nanoeuler train base --gpus 8 --nnodes 2 --node-rank 0 --master-addr host0 --master-port 29500

Each worker gets the torchrun-style variables that world.World reads (RANK = node rank x N + local rank,
WORLD_SIZE = nodes x N, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK = the node rank, MASTER_ADDR and MASTER_PORT:
127.0.0.1 and a free port on one node), NANOEULER_LAUNCHER=1 (these variables, not Slurm's or MPI's, say
which rank it is), NANOEULER_RDZV_KEY (a random key for the rendezvous on one node; across nodes the user's
own or the default), NCCL_NVLS_ENABLE=0 unless it is set (docs/multi-gpu.md), and NANOEULER_HEARTBEAT_FD,
the write end of a pipe down which it sends a byte after every training step (comm.heartbeat).

Workers run in sessions of their own, so a Ctrl-C at the terminal reaches the launcher alone, which forwards
it to every rank: they agree on the step to stop after, rank 0 saves, all exit 130. A second Ctrl-C is
forwarded too, and aborts them. A SIGTERM to the launcher (a scheduler's time limit, `kill`, `timeout`) acts as
a Ctrl-C; a launcher killed outright (SIGKILL) leaves each rank to stop at its next heartbeat, which finds the
pipe unread. When a rank exits with an error or is killed, or a rank that has begun
training takes no step for NANOEULER_STEP_TIMEOUT seconds, the launcher stops the others (SIGTERM, then
SIGKILL) and the run ends with a one-line error naming the rank; the last checkpoint (written atomically)
is kept. On several nodes each launcher watches its own ranks; a rank lost on another node ends this node's
through NCCL's timeout (NANOEULER_TIMEOUT) or the peers' errors.
"""
import dataclasses
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import time

from nanoeuler.env import env_int
from nanoeuler.errors import UserError

STEP_TIMEOUT = 1800  # seconds without a step, once training began: evaluation and saving on rank 0 included
GRACE = 10           # seconds between SIGTERM and SIGKILL when stopping ranks


def free_port():
    """A TCP port free on this host now (for rank 0's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_self(n, argv, nodes=None):
    """Run `python -m nanoeuler ARGV` as n ranks (on this node of `nodes`); the exit status of the run."""
    return launch([sys.executable, "-m", "nanoeuler", *argv], n, nodes=nodes)


@dataclasses.dataclass(frozen=True)
class Nodes:
    """Several hosts, one launcher on each: how many, which one this is, and where rank 0's rendezvous is."""
    count: int = 1
    rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = None


@dataclasses.dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen
    fd: int            # the read end of its heartbeat pipe; None once it closed
    beat: float = None  # when its last step ended (monotonic); None before the first


def launch(command, n, step_timeout=None, nodes=None):
    """Run `command` as this node's n ranks (ranks 0..n-1 on one node) and watch them (see the module's
    docstring). Returns 0 when every rank finished, 130 when they stopped on Ctrl-C; raises UserError naming
    the rank that failed or hung."""
    step_timeout = step_timeout or env_int("NANOEULER_STEP_TIMEOUT", STEP_TIMEOUT, minimum=1)
    nodes = nodes or Nodes()
    if nodes.count == 1:
        port, key = nodes.master_port or free_port(), secrets.token_hex(16)
    else:  # every node's launcher must name the same place, and the same key
        port, key = nodes.master_port, os.environ.get("NANOEULER_RDZV_KEY", "nanoeuler")
    ranks = []
    try:
        for local in range(n):
            read, write = os.pipe()
            rank = nodes.rank * n + local
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n * nodes.count), LOCAL_RANK=str(local),
                       LOCAL_WORLD_SIZE=str(n), GROUP_RANK=str(nodes.rank), MASTER_ADDR=nodes.master_addr,
                       MASTER_PORT=str(port), NANOEULER_RDZV_KEY=key, NANOEULER_LAUNCHER="1",
                       NANOEULER_HEARTBEAT_FD=str(write))
            env.setdefault("NCCL_NVLS_ENABLE", "0")
            # CPU ranks stopped mid-run leave their shared-memory segment to Python's resource tracker, which
            # removes it with a warning that would come between the progress bar and the one-line error
            env["PYTHONWARNINGS"] = ",".join(filter(None, (os.environ.get("PYTHONWARNINGS"),
                                                           "ignore:resource_tracker:UserWarning")))
            try:
                proc = subprocess.Popen(command, env=env, pass_fds=(write,), start_new_session=True)
            finally:
                os.close(write)
            ranks.append(_Rank(rank, proc, read))
        return _supervise(ranks, step_timeout)
    except UserError:
        _stop(ranks)
        # rank 0's progress bar leaves its line open (it redraws with \r): the error starts a line of its own
        sys.stderr.write("\n")
        raise
    finally:
        _stop(ranks)
        for r in ranks:
            if r.fd is not None:
                os.close(r.fd)


def _supervise(ranks, step_timeout):
    interrupts = 0

    def forward(signum, frame):
        nonlocal interrupts
        interrupts += 1
        for r in ranks:
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGINT)

    # SIGTERM (a scheduler's time limit, `kill`, `timeout`) as Ctrl-C: the ranks, in sessions of their own, would
    # otherwise outlive a launcher that the default action ends at once
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            fds = [r.fd for r in ranks if r.fd is not None]
            ready = select.select(fds, [], [], 0.2)[0] if fds else time.sleep(0.2) or []
            now = time.monotonic()
            for r in ranks:
                if r.fd is not None and r.fd in ready:
                    if os.read(r.fd, 4096):
                        r.beat = now
                    else:  # the rank closed its end: it is exiting
                        os.close(r.fd)
                        r.fd = None
            codes = [r.proc.poll() for r in ranks]
            for r, code in zip(ranks, codes):
                if code not in (None, 0) and not (interrupts and code == 130):
                    raise UserError(f"rank {r.rank} {_ended(code)}; the other ranks were stopped (the last "
                                    f"checkpoint is kept)")
            late = [r for r, code in zip(ranks, codes)
                    if code is None and r.beat is not None and now - r.beat > step_timeout]
            if late:  # the others wait for it in a collective: name a stopped rank first, else the longest silent
                r = min(late, key=lambda r: (not _stopped(r.proc.pid), r.beat))
                raise UserError(f"rank {r.rank} took no training step for {step_timeout} s (hung?); the ranks "
                                f"were stopped (the last checkpoint is kept)")
            if all(code is not None for code in codes):
                return 130 if 130 in codes else 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stopped(pid):
    """Whether the process is stopped (SIGSTOP, a debugger): its state in /proc; False where there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _ended(code):
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _stop(ranks):
    """Stop the ranks still running, each with everything it started (its session): SIGTERM, then SIGKILL."""
    live = [r for r in ranks if r.proc.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for r in live:
            try:
                os.killpg(r.proc.pid, sig)
                if sig == signal.SIGTERM:
                    os.killpg(r.proc.pid, signal.SIGCONT)  # a stopped rank (SIGSTOP) acts on it only once continued
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + GRACE
        while time.monotonic() < deadline and any(r.proc.poll() is None for r in live):
            time.sleep(0.05)
        live = [r for r in live if r.proc.poll() is None]
        if not live:
            return
