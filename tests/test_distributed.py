"""Data-parallel training (docs/multi-gpu.md) on the CPU: the rank environment, what each rank draws, the key
arithmetic (two ranks at batch B train exactly like one at batch 2B, with and without ZeRO-1) over the real
shared-memory communicator, checkpoints that move between world sizes, and the launcher's environment, Ctrl-C
forwarding and failure handling. The NCCL path needs two GPUs: those tests are marked `gpu` and skip."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import ROOT, tiny_config
from nanoeuler.parallel import launch
from nanoeuler.train import pretrain as train
from nanoeuler.train.loop import Hyperparameters
from nanoeuler.train.objectives import CrossEntropy
from nanoeuler.data.corpus import RandomWindows
from nanoeuler.parallel.comm import SharedMemoryCommunicator, World, heartbeat
from nanoeuler.train.distributed import DataParallel
from nanoeuler.errors import UserError
from nanoeuler.model.engine import make_engine, to_numpy
from nanoeuler.model.optimizer import AdamW
from nanoeuler.data.instructions import ExampleBatches
from test_train import _log, _train

ENV = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")


def test_world_from_the_environment():
    assert World.from_env({}) == World() and World().is_main
    assert World.from_env(ENV) == World(1, 2, 1, "10.0.0.1", 29500, "env") and not World.from_env(ENV).is_main
    assert World.from_env({**ENV, "LOCAL_RANK": ""}).local_rank == 1  # defaults to RANK: one host
    assert World.from_env({"RANK": "0", "WORLD_SIZE": "1"}) == World()
    for change, message in ((dict(RANK="x"), "RANK='x' is not an integer"),
                            (dict(RANK="2"), "RANK=2 must be below WORLD_SIZE=2"),
                            (dict(WORLD_SIZE="0"), "WORLD_SIZE=0 must be at least 1"),
                            (dict(MASTER_ADDR=""), "WORLD_SIZE=2 needs MASTER_ADDR"),
                            (dict(MASTER_PORT="70000"), "MASTER_PORT=70000 is not a port number")):
        with pytest.raises(UserError, match=message):
            World.from_env({**ENV, **change})
    with pytest.raises(UserError, match="RANK is not set"):
        World.from_env({"WORLD_SIZE": "2"})


def test_each_launcher_is_read_from_its_own_variables():
    """torchrun's (as `--gpus` and a hand-set run), Open MPI's, MPICH/PMI's and Slurm's variables each give the
    world; the rendezvous address comes from MASTER_ADDR/PORT or, under Slurm, the step's first node and a
    port of the job."""
    assert World.from_env({**ENV, "TORCHELASTIC_RUN_ID": "x"}).launcher == "torchrun"
    assert World.from_env({**ENV, "NANOEULER_LAUNCHER": "1"}).launcher == "env"
    ompi = dict(OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="1")
    assert World.from_env(ompi) == World(3, 4, 1, "", 0, "mpi")  # mpi4py's own broadcast: no address
    assert World.from_env({**ompi, "MASTER_ADDR": "h0", "MASTER_PORT": "29400"}) == World(3, 4, 1, "h0", 29400, "mpi")
    assert World.from_env(dict(PMI_RANK="1", PMI_SIZE="2", MPI_LOCALRANKID="0")) == World(1, 2, 0, "", 0, "mpi")
    slurm = dict(SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="1", SLURM_JOB_ID="123456",
                 SLURM_STEP_NODELIST="gpu[007-008,010],login2")
    assert World.from_env(slurm) == World(5, 8, 1, "gpu007", 20000 + 123456 % 20000, "slurm")
    assert World.from_env({**slurm, "SLURM_STEP_NUM_TASKS": "6"}).world_size == 6
    assert World.from_env({**slurm, "MASTER_ADDR": "h1", "MASTER_PORT": "1234"}).master_addr == "h1"
    assert World.from_env({"SLURM_NTASKS": "8", "SLURM_JOB_ID": "1"}) == World()  # a batch script, not a task
    # srun --mpi=pmi2 sets both, in agreement; torchrun's and --gpus' workers keep their own whatever Slurm says
    assert World.from_env({**slurm, "PMI_RANK": "5", "PMI_SIZE": "8"}).launcher == "mpi"
    assert World.from_env({**ENV, **slurm, "TORCHELASTIC_RUN_ID": "x"}).rank == 1


def test_launchers_that_disagree_or_lack_a_value_are_one_line_errors():
    slurm = dict(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_JOB_NODELIST="n1")
    with pytest.raises(UserError, match=r"^the launchers' variables disagree: RANK=1 of WORLD_SIZE=2 but "
                                        r"SLURM_PROCID=0 of SLURM_NTASKS=2; unset one$"):
        World.from_env({**ENV, **slurm})
    with pytest.raises(UserError, match="^OMPI_COMM_WORLD_RANK=4 must be below OMPI_COMM_WORLD_SIZE=4$"):
        World.from_env(dict(OMPI_COMM_WORLD_RANK="4", OMPI_COMM_WORLD_SIZE="4"))
    with pytest.raises(UserError, match="^PMI_SIZE is not set$"):
        World.from_env(dict(PMI_RANK="0"))
    with pytest.raises(UserError, match="^WORLD_SIZE=2 needs MASTER_ADDR"):
        World.from_env(dict(SLURM_PROCID="1", SLURM_NTASKS="2"))  # no node list, no address


def test_slurm_host_lists_give_their_first_host():
    from nanoeuler.parallel.world import first_host
    assert first_host("node[01-04,07],other") == "node01"
    assert first_host("a1,a2") == "a1" and first_host("single") == "single" and first_host(None) is None
    assert first_host("rack[3-4]-gpu") == "rack3-gpu"


def test_the_bucket_plan_reduces_final_gradients_in_pieces_that_every_rank_can_split():
    """Buckets close at the offsets where the backward pass has finished everything after them, rounded up to
    a multiple of the ranks, merged up to the minimum size; they tile the padded buffer from its end, and
    ZeRO-1's pieces of them tile each rank's shard."""
    from nanoeuler.train.distributed import bucket_plan, shard_pieces
    cfg = tiny_config(300)
    eng = make_engine(cfg, seed=1)
    offsets, total = eng.gradient_offsets(), eng.params.size
    assert offsets[-1] == 0 and offsets == sorted(offsets, reverse=True)
    for ranks in (1, 2, 3, 8):
        for minimum in (0, 1000, 10 ** 9):
            buckets = bucket_plan(offsets, total, ranks, minimum)
            padded = -(-total // ranks) * ranks
            assert buckets[0][1] == padded and buckets[-1][0] == 0
            assert all(upper[0] == lower[1] for upper, lower in zip(buckets, buckets[1:]))  # contiguous, from the end
            assert all((end - start) % ranks == 0 and end > start for start, end in buckets)
            assert all(end - start >= minimum for start, end in buckets[:-1])
            # a bucket holds only gradients final at the offset that closes it
            assert all(any(o <= start for o in offsets) for start, _ in buckets)
            if minimum == 0:
                assert len(buckets) == len({-(-o // ranks) * ranks for o in offsets})
            if minimum == 10 ** 9:
                assert buckets == [(0, padded)]
            seen = np.zeros(padded, int)
            for rank in range(ranks):
                pieces = shard_pieces(buckets, rank, ranks)
                sizes = [end - start for start, end, _ in pieces]
                assert [at for *_, at in pieces] == list(np.cumsum([0] + sizes)[:-1])
                for start, end, _ in pieces:
                    seen[start:end] += 1
            assert (seen == 1).all()


def test_ranks_draw_their_own_slices_of_one_global_batch():
    tokens = np.arange(5000) % 297
    one = RandomWindows(tokens, 6, 8, 2, seed=3)
    ranks = [RandomWindows(tokens, 3, 8, 2, seed=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        inputs, targets = one.next()
        (i0, t0), (i1, t1) = (r.next() for r in ranks)
        assert not np.array_equal(i0, i1)  # different windows on different ranks ...
        np.testing.assert_array_equal(np.concatenate([i0, i1]), inputs)  # ... which make up the global batch
        np.testing.assert_array_equal(np.concatenate([t0, t1], axis=1), targets)
    assert ranks[0].state() == ranks[1].state() == one.state()  # one state, whatever the world size
    again = RandomWindows(tokens, 3, 8, 2, seed=3, rank=1, world_size=2)
    np.testing.assert_array_equal(again.next()[0], RandomWindows(tokens, 3, 8, 2, 3, 1, 2).next()[0])
    # SFT: the next 2 x B examples of the epoch's order, B per rank, across epoch ends
    examples = [([i, i + 1, i + 2], 1) for i in range(7)]
    one = ExampleBatches(examples, 4, 8, 1, seed=5)
    ranks = [ExampleBatches(examples, 2, 8, 1, seed=5, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        assert ranks[0].picks() + ranks[1].picks() == one.picks()
    assert ranks[0].state() == one.state()


class _TakingTurns:
    """A rank's communicator in a test that runs the ranks as threads of one process: the ranks' engines
    take turns (numba's workqueue thread pool, where a user picks it, must not be entered by two threads at
    once), and a rank lets the other run while it waits in a collective."""

    def __init__(self, comm, lock):
        self.comm, self.lock = comm, lock
        self.rank, self.world_size = comm.rank, comm.world_size

    def __getattr__(self, name):
        collective = getattr(self.comm, name)

        def call(*args):
            self.lock.release()
            try:
                return collective(*args)
            finally:
                self.lock.acquire()
        return call


def _run_ranks(n, work):
    """work(comm) on n ranks, threads of this process with real SharedMemoryCommunicators; their results."""
    port, lock, results, errors = launch.free_port(), threading.Lock(), [None] * n, []

    def rank(r):
        lock.acquire()
        try:
            comm = SharedMemoryCommunicator(World(r, n, r, "127.0.0.1", port), wait=60)
            try:
                results[r] = work(_TakingTurns(comm, lock))
            finally:
                comm.close()
        except BaseException as error:
            errors.append(error)
        finally:
            lock.release()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


STEPS, LR = 4, 3e-3


def _train_steps(batch, comm=None, zero=False, device="cpu", min_bucket=None):
    """STEPS optimizer steps of the tiny model; (losses, grad norms, last gradients, final weights)."""
    cfg = tiny_config(300, gpu=device == "gpu")
    eng = make_engine(cfg, device=device, seed=1, precision="fp32")
    rank, world = (comm.rank, comm.world_size) if comm else (0, 1)
    source = RandomWindows(np.random.default_rng(0).integers(0, 300, 20000), batch, cfg.context, cfg.mtp_heads,
                           seed=7, rank=rank, world_size=world)
    hp = Hyperparameters(steps=STEPS, batch_size=batch, lr=LR, warmup=1, eval_every=9, sample_every=9, ckpt_every=9,
                         grad_accum=2 if world == 1 else 1)  # one rank in 2 passes: the accumulation path too
    parallel = DataParallel(eng, AdamW(eng, hp.beta1, hp.beta2), comm, zero=zero, min_bucket=min_bucket)
    objective = CrossEntropy(parallel.comm)  # comm, or the world of one DataParallel makes of None
    losses, norms = [], []
    for _ in range(STEPS):
        shares, tokens = objective.train_step(eng, source.next(), hp)
        norm, totals = parallel.step(LR, hp.weight_decay, hp.grad_clip, [shares["loss"], shares["loss_all_heads"],
                                                                         tokens])
        losses.append(tuple(totals))
        norms.append(norm)
    assert parallel.any(rank == 1) == (world > 1)
    grads = to_numpy(eng.grads).copy() if not parallel.zero else None  # the last step's, all-reduced
    return losses, norms, grads, eng.params_numpy(), parallel.opt_state_numpy()


@pytest.mark.parametrize("min_bucket", [None, 0], ids=["one-bucket", "a-bucket-a-layer"])
@pytest.mark.parametrize("zero", [False, True], ids=["replicated", "zero1"])
@pytest.mark.parametrize("ranks", [2, 3])  # 3: the flat buffer is padded (the tiny model's size is odd)
def test_ranks_train_exactly_like_one_rank_at_their_batches_together(zero, min_bucket, ranks):
    """Data parallelism's arithmetic: targets counted over every rank, gradients summed, the same AdamW step (or
    ZeRO-1's shards of it): N ranks at batch 4 follow 1 rank at batch 4N on the same windows to float32
    rounding, step after step."""
    ref = _train_steps(4 * ranks)
    got = _run_ranks(ranks, lambda comm: _train_steps(4, comm, zero, min_bucket=min_bucket))
    for losses, norms, grads, params, (m, v) in got:
        np.testing.assert_allclose(losses, ref[0], rtol=1e-5)
        assert [tokens for *_, tokens in losses] == [4 * ranks * 32] * STEPS
        np.testing.assert_allclose(norms, ref[1], rtol=1e-5)
        if grads is not None:
            np.testing.assert_allclose(grads, ref[2], rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(params, ref[3], rtol=0, atol=1e-5)
        np.testing.assert_allclose(m, ref[4][0], rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(v, ref[4][1], rtol=1e-3, atol=1e-10)
    np.testing.assert_array_equal(got[0][3], got[1][3])  # the ranks' weights are the same bits
    np.testing.assert_array_equal(got[0][4][0], got[1][4][0])


def test_the_nccl_id_travels_between_processes_in_every_form_cupy_gives_it(monkeypatch):
    """CuPy 14's get_unique_id gives 128 bytes, earlier versions a tuple of signed ints, and NcclCommunicator
    takes back only its own kind: rank 0 (this process) serves every form through the real rendezvous, and
    rank 1, another process, gets each back as it was and meets rank 0 at the barrier."""
    from nanoeuler.parallel.world import rendezvous
    raw = bytes(np.random.default_rng(3).integers(0, 256, 128).tolist())
    ids = (raw, tuple(b - 256 if b > 127 else b for b in raw), tuple(raw))
    port, key = launch.free_port(), "a key of this test"
    monkeypatch.setenv("NANOEULER_RDZV_KEY", key)
    meeting = rendezvous(World(0, 2, 0, "127.0.0.1", port), 60, ids)
    assert meeting.value is ids
    rank1 = subprocess.Popen(
        [sys.executable, "-c", "from nanoeuler.parallel.world import World, rendezvous\n"
         f"meeting = rendezvous(World(1, 2, 1, '127.0.0.1', {port}), 60)\nmeeting.wait(60)\n"
         "print(repr(meeting.value))"],
        env=dict(os.environ, NANOEULER_RDZV_KEY=key), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    meeting.wait(60)
    assert rank1.communicate(timeout=60)[0].strip() == repr(ids) and rank1.returncode == 0


def test_a_rendezvous_without_rank_0_and_bad_numbers_are_one_line_errors(monkeypatch):
    from nanoeuler.parallel.comm import heartbeat, timeout
    from nanoeuler.parallel.world import rendezvous
    with pytest.raises(UserError, match=r"^rank 1: rank 0 did not open 127.0.0.1:\d+ in 0.2 s$"):
        rendezvous(World(1, 2, 1, "127.0.0.1", launch.free_port()), 0.2)
    for name, call in (("NANOEULER_TIMEOUT", timeout), ("NANOEULER_HEARTBEAT_FD", heartbeat)):
        monkeypatch.setenv(name, "soon")
        with pytest.raises(UserError, match=f"^{name}='soon' is not an integer$"):
            call()
    monkeypatch.setenv("NANOEULER_TIMEOUT", "0")
    with pytest.raises(UserError, match="^NANOEULER_TIMEOUT=0 must be at least 1$"):
        timeout()


def test_gathering_pieces_of_different_lengths():
    """all_gather_ranges (ZeRO-1's bf16 weights, whose last piece is cut at the end of the parameters)."""
    ranges = [(0, 4), (4, 7), (7, 7)]

    def work(comm):
        buffer = np.full(7, -1.0, dtype=np.float32)
        start, end = ranges[comm.rank]
        buffer[start:end] = np.arange(start, end) * 10
        comm.all_gather_ranges(buffer, ranges)
        return buffer
    for got in _run_ranks(3, work):
        np.testing.assert_array_equal(got, np.arange(7) * 10.0)


def test_shared_memory_collectives_grow_and_keep_rank_order():
    def work(comm):
        r = comm.rank
        small = comm.all_reduce_sum(np.array([r + 1.0, 10.0 * r]))
        big = comm.all_reduce_sum(np.full(100_000, r + 1, np.float32))  # grows the segment
        shard = np.empty(3, np.float32)
        comm.reduce_scatter_sum(np.arange(9, dtype=np.float32) * (r + 1), shard)
        gathered = np.empty(6, np.int64)
        comm.all_gather(np.array([r, r, r], np.int64), gathered)
        value = comm.broadcast(np.array([r + 5], np.int64), 1)
        comm.barrier()
        return small, big[[0, -1]], shard, gathered, value
    (s0, b0, sh0, g0, v0), (s1, b1, sh1, g1, v1) = _run_ranks(2, work)
    assert s0.tolist() == s1.tolist() == [3.0, 10.0] and b0.tolist() == b1.tolist() == [3.0, 3.0]
    assert sh0.tolist() == [0, 3, 6] and sh1.tolist() == [9, 12, 15]
    assert g0.tolist() == g1.tolist() == [0, 0, 0, 1, 1, 1] and v0[0] == v1[0] == 6


def test_a_rank_that_stops_answering_breaks_the_barrier_with_an_error():
    port = launch.free_port()
    comm = SharedMemoryCommunicator(World(0, 2, 0, "127.0.0.1", port), wait=0.3)
    t0 = time.monotonic()
    with pytest.raises(UserError, match="rank 0: the other ranks did not answer within 0.3 s"):
        comm.barrier()
    assert time.monotonic() - t0 < 5


# ------------------------------------------------------------------------------- runs and checkpoints
# A worker of the tiny preset: the tests' tiny model and hyperparameters, then the command line as usual.
WORKER = """
import sys
sys.path.insert(0, {tests!r})
from conftest import tiny_config
from nanoeuler import cli
from nanoeuler.train import pretrain as train
from nanoeuler.train.loop import Hyperparameters
from nanoeuler.model.config import PRESETS
PRESETS["small"] = tiny_config({vocab}, gpu={gpu})
train.PRESET_HYPER["small"] = Hyperparameters(**{hyper!r})
cli.main(sys.argv[1:])
"""
# a constant learning rate after the warmup: runs of 4 and 6 steps take the same first 4 steps
HYPER = Hyperparameters(steps=6, batch_size=4, lr=3e-3, warmup=2, eval_every=3, sample_every=100, ckpt_every=100,
                        eval_batches=2, min_lr_ratio=1.0, sample_tokens=4)


def _tiny_runs(monkeypatch, tokenizer, corpus, tokenizer_file, gpu):
    """(run in this process, run as 2 ranks): `nanoeuler train ARGS` on the tiny preset (heads of 32 for the
    GPU)."""
    import dataclasses
    from nanoeuler.model.config import PRESETS
    monkeypatch.setitem(PRESETS, "small", tiny_config(tokenizer.vocab_size, gpu))
    monkeypatch.setitem(train.PRESET_HYPER, "small", HYPER)
    script = WORKER.format(tests=os.path.join(ROOT, "tests"), vocab=tokenizer.vocab_size, gpu=gpu,
                           hyper=dataclasses.asdict(HYPER))
    common = ["--data", str(corpus), "--tokenizer", str(tokenizer_file), "--device", "cpu"]

    def one(*args):
        return _train(*common, *args)

    def two(*args, nodes=False):
        """2 ranks: of one launcher (--gpus 2), or of two launchers as two hosts would run them (--nnodes 2)."""
        command = [sys.executable, "-c", script, "train", *common, *map(str, args)]
        if not nodes:
            return launch.launch(command + ["--gpus", "2"], 2)
        port = launch.free_port()
        node = ("import sys\nfrom nanoeuler.parallel import launch\n"
                "sys.exit(launch.launch({command!r}, 1, nodes=launch.Nodes(2, {rank}, '127.0.0.1', {port})))")
        hosts = [subprocess.Popen([sys.executable, "-c", node.format(
            command=command + ["--gpus", "1", "--nnodes", "2"], rank=rank, port=port)], cwd=ROOT) for rank in (0, 1)]
        return max(host.wait(timeout=300) for host in hosts)
    return one, two


@pytest.fixture
def tiny_runs(monkeypatch, tokenizer, corpus, tokenizer_file):
    return _tiny_runs(monkeypatch, tokenizer, corpus, tokenizer_file, gpu=False)


@pytest.fixture
def tiny_gpu_runs(monkeypatch, tokenizer, corpus, tokenizer_file):
    return _tiny_runs(monkeypatch, tokenizer, corpus, tokenizer_file, gpu=True)


@pytest.mark.parametrize("sharded, resumed_zero", [((), 1), (("--zero", 3, "--recompute"), 2)])
def test_checkpoints_move_between_world_sizes(tiny_runs, tmp_path, sharded, resumed_zero):
    """2 ranks at batch 2 train like 1 rank at batch 4; a 2-rank checkpoint (ZeRO-1, the default, or ZeRO-3
    with --recompute, written from its shards) resumes on 1 rank and a 1-rank checkpoint on 2 ranks with
    ZeRO-1 or ZeRO-2 (the global batch kept), continuing the uninterrupted run's losses."""
    one, two = tiny_runs
    assert one("--out", tmp_path / "ref.bin") == 0
    ref = _log(tmp_path / "ref.jsonl")

    assert two("--batch-size", 2, "--steps", 4, *sharded, "--out", tmp_path / "a.bin") == 0
    assert one("--resume", "--steps", 6, "--out", tmp_path / "a.bin") == 0
    assert one("--steps", 4, "--out", tmp_path / "b.bin") == 0
    assert two("--resume", "--steps", 6, "--zero", resumed_zero, "--out", tmp_path / "b.bin") == 0
    for name in "ab":
        log = _log(tmp_path / f"{name}.jsonl")
        assert [r["step"] for r in log] == list(range(1, 7))
        for key in ("loss", "loss_all_heads", "grad_norm"):
            np.testing.assert_allclose([r[key] for r in log], [r[key] for r in ref], rtol=1e-5, err_msg=name)
        for r, want in zip(log, ref):  # the same validation windows, batched per rank; ZeRO-3's on gathered weights
            if "val_loss" in want:
                assert r["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5), (name, r["step"])
    from nanoeuler.io import checkpoint
    ck = checkpoint.load(tmp_path / "b.bin", with_opt=True)
    assert ck.train_state["world_size"] == 2 and ck.train_state["hyper"]["batch_size"] == 2
    np.testing.assert_allclose(ck.params, checkpoint.load(tmp_path / "ref.bin").params, atol=1e-5)


def test_two_launchers_as_two_hosts_train_like_one_launcher(tiny_runs, tmp_path):
    """--nnodes 2: one launcher a host, each starting its rank, meeting at node 0's rendezvous."""
    _, two = tiny_runs
    assert two("--batch-size", 2, "--out", tmp_path / "a.bin") == 0
    assert two("--batch-size", 2, "--out", tmp_path / "b.bin", nodes=True) == 0
    assert [r["loss"] for r in _log(tmp_path / "b.jsonl")] == [r["loss"] for r in _log(tmp_path / "a.jsonl")]


def test_nodes_need_their_place_and_rank_0s_address():
    from nanoeuler.cli import build_parser, launch_nodes
    parser, _ = build_parser()
    for flags, message in ((["--nnodes", "2"], "--nnodes 2 needs --node-rank 0..1"),
                           (["--nnodes", "2", "--node-rank", "2"], "--nnodes 2 needs --node-rank 0..1"),
                           (["--nnodes", "2", "--node-rank", "1"], "--nnodes 2 needs --master-addr"),
                           (["--gpus", "2", "--node-rank", "1"], "--node-rank needs --nnodes")):
        with pytest.raises(UserError, match=message):
            launch_nodes(parser.parse_args(["train", *flags]))
    nodes = launch_nodes(parser.parse_args(["train", "--nnodes", "2", "--node-rank", "1", "--master-addr", "h0"]))
    assert (nodes.count, nodes.rank, nodes.master_addr, nodes.master_port) == (2, 1, "h0", 29500)


def test_gpus_must_agree_with_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(UserError, match="--gpus 3 but WORLD_SIZE is 1"):
        _train("--gpus", 3, "--out", tmp_path / "x.bin")


# ------------------------------------------------------------------------------------------ the launcher
def _fake_ranks(body, n=2, timeout=None):
    """launch() over `python -c` workers: `rank` is theirs, beat() sends a heartbeat."""
    script = ("import os, signal, sys, time\nrank = int(os.environ['RANK'])\n"
              "def beat():\n    os.write(int(os.environ['NANOEULER_HEARTBEAT_FD']), b'.')\n" + body)
    return launch.launch([sys.executable, "-c", script], n, step_timeout=timeout)


def test_launcher_gives_each_rank_its_environment(tmp_path):
    assert _fake_ranks(f"""
import json
keys = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'NCCL_NVLS_ENABLE', 'NANOEULER_RDZV_KEY',
        'PYTHONWARNINGS')
json.dump({{k: os.environ[k] for k in keys}}, open({str(tmp_path)!r} + f'/{{rank}}.json', 'w'))
""", n=3) == 0
    envs = [json.load(open(tmp_path / f"{r}.json")) for r in range(3)]
    assert ([(env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) for env in envs]
            == [(str(r), str(r), "3") for r in range(3)])
    assert len({(env["MASTER_ADDR"], env["MASTER_PORT"], env["NANOEULER_RDZV_KEY"]) for env in envs}) == 1
    assert envs[0]["MASTER_ADDR"] == "127.0.0.1" and int(envs[0]["MASTER_PORT"]) > 0
    assert all(env["NCCL_NVLS_ENABLE"] == "0" for env in envs)
    # the resource tracker of a stopped CPU rank removes its shared memory without a warning on the terminal
    assert all(env["PYTHONWARNINGS"].endswith("ignore:resource_tracker:UserWarning") for env in envs)


def test_a_failing_rank_ends_the_run_with_its_name():
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"^rank 1 exited with status 3; the other ranks were stopped"):
        _fake_ranks("beat()\nif rank == 1:\n    sys.exit(3)\ntime.sleep(60)")
    assert time.monotonic() - t0 < 10


def test_the_error_starts_a_line_below_a_progress_bar(capfd):
    """Rank 0 draws its bar with \\r and no newline; the launcher's error must not land on the bar's line."""
    with pytest.raises(UserError):
        _fake_ranks("beat()\nif rank == 0:\n    sys.stderr.write('\\r  5%|#  | 5/100'); sys.stderr.flush()\n"
                    "if rank == 1:\n    time.sleep(0.5); sys.exit(3)\ntime.sleep(60)")
    assert capfd.readouterr().err.endswith("5/100\n")


def test_a_rank_that_takes_no_step_ends_the_run():
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"^rank 1 took no training step for 1 s"):
        _fake_ranks("while True:\n    beat()\n    time.sleep(0.1 if rank == 0 else 60)", timeout=1)
    assert time.monotonic() - t0 < 10


def test_a_stopped_rank_is_named_before_the_ranks_that_wait_for_it():
    """SIGSTOP on rank 1; rank 0 then waits for it (here: sleeps) and takes no step either."""
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"^rank 1 took no training step for 1 s"):
        _fake_ranks("beat()\nif rank == 1:\n    time.sleep(0.2)\n    os.kill(os.getpid(), signal.SIGSTOP)\n"
                    "time.sleep(60)", timeout=1)
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_reaches_every_rank_once(sig):
    """The terminal's Ctrl-C goes to the launcher (the ranks have sessions of their own); it forwards it, the
    ranks save and exit 130, and so does the run. A SIGTERM to the launcher (a scheduler's, `timeout`'s) the
    same: never ranks left running without it."""
    timer = threading.Timer(1.5, os.kill, (os.getpid(), sig))
    timer.start()
    try:
        assert _fake_ranks("""
got = []
signal.signal(signal.SIGINT, lambda *a: got.append(1))
beat()
while not got:
    time.sleep(0.02)
time.sleep(0.3)
sys.exit(130 if len(got) == 1 else 5)
""") == 130
    finally:
        timer.cancel()


def test_a_rank_whose_launcher_was_killed_stops(monkeypatch):
    """SIGKILL leaves the launcher no time to stop its ranks: their next heartbeat finds the pipe unread."""
    read, write = os.pipe()
    os.close(read)
    monkeypatch.setenv("NANOEULER_HEARTBEAT_FD", str(write))
    try:
        with pytest.raises(UserError, match="launcher of this run is gone"):
            heartbeat()
    finally:
        os.close(write)


def test_the_command_line_starts_the_launcher(tmp_path):
    """`nanoeuler train --gpus 2` with a missing corpus: every rank fails, the launcher names one, once."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "nanoeuler", "train", "--gpus", "2", "--device", "cpu",
                           "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o.bin")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert "corpus" in lines[0] and "not found" in lines[0]
    assert lines[-1].startswith("nanoeuler: error: rank ") and "exited with status 2" in lines[-1]
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- GPUs (run on 2 GPUs later)
def _gpus():
    import nanoeuler.model.gpu
    if not nanoeuler.model.gpu.available():
        return 0
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")
def test_nccl_world_of_one_trains_like_a_single_process():
    """What one GPU can show of the NCCL path: the rendezvous and a communicator of one rank, each
    collective on host and device buffers (with one rank each is a copy), and the tiny model's steps through
    DataParallel over NCCL giving a single process's losses and weights: to the bit with the all-reduce, and
    with ZeRO-1 (the AdamW kernel over the shard, the all-gather of the weights) to float32 rounding (its
    gradient norm sums the padded shard)."""
    import cupy
    from nanoeuler.parallel.comm import NcclCommunicator
    comm = NcclCommunicator(World(0, 1, 0, "127.0.0.1", launch.free_port()), wait=60)
    try:
        host = np.array([1.5, -2.0, 3.25])
        assert comm.all_reduce_sum(host.copy()).tolist() == host.tolist()
        dev = cupy.arange(1000, dtype=np.float32)
        out = cupy.full(1000, np.nan, dtype=np.float32)
        comm.reduce_scatter_sum(dev, out)
        assert cupy.array_equal(out, dev)
        out[...] = np.nan
        comm.all_gather(dev, out)
        assert cupy.array_equal(out, dev)
        assert comm.broadcast(np.array([7, 8], np.int64)).tolist() == [7, 8]
        comm.barrier()
        ref = _train_steps(8, device="gpu")
        got = _train_steps(8, comm, device="gpu")
        assert got[0] == ref[0] and got[1] == ref[1]
        np.testing.assert_array_equal(got[3], ref[3])
        got = _train_steps(8, comm, zero=True, device="gpu")
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
        np.testing.assert_allclose(got[3], ref[3], rtol=0, atol=1e-6)
    finally:
        comm.close()


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("reduce", ["copy", "nccl"])
def test_two_gpus_train_like_one_gpu_at_twice_the_batch(tiny_gpu_runs, tmp_path, monkeypatch, zero, reduce):
    """The tiny preset in fp32 on 2 GPUs at batch 2 against 1 GPU at batch 4, 6 steps: the gradients summed
    through the copy engines (the default on one host; without ZeRO an all-reduce, with it a reduce-scatter)
    and through NCCL's kernels (ZeRO-2/3 always reduce a unit at a time through NCCL)."""
    monkeypatch.setenv("NANOEULER_REDUCE", reduce)
    one, two = tiny_gpu_runs
    gpu = ["--device", "gpu", "--precision", "fp32"]
    assert one(*gpu, "--out", tmp_path / "ref.bin") == 0
    assert two(*gpu, "--batch-size", 2, "--zero", zero, "--out", tmp_path / "a.bin") == 0
    ref, got = _log(tmp_path / "ref.jsonl"), _log(tmp_path / "a.jsonl")
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-5)
