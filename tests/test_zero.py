"""ZeRO-2 and ZeRO-3 (train/sharded.py) on CPU ranks: the shard plan, the order in which ZeRO-3 gathers and
frees each unit's weights and reduces its gradients, N ranks training like one rank at their global batch for
ZeRO 1, 2 and 3, checkpoints written from the shards (the file an unsharded writer makes) and resumed on
another number of ranks and stage, the default stage of the command line, and the start from shards: what a
rank reads of a checkpoint (or draws of a fresh model) and holds when it starts, from a resumed run, a fresh
one and `train|sft --ckpt`, and the memory check of a rank's share."""
import dataclasses
import json
import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from conftest import ROOT, tiny_config
from nanoeuler.data.corpus import RandomWindows
from nanoeuler.errors import UserError
from nanoeuler.io import checkpoint
from nanoeuler.model import memory
from nanoeuler.model.config import Config, InitialWeights, init_params, param_count, param_layout
from nanoeuler.model.engine import make_engine
from nanoeuler.model.optimizer import AdamW, DecayMask, decay_mask
from nanoeuler.parallel import launch
from nanoeuler.parallel.comm import SingleProcess
from nanoeuler.train.distributed import DataParallel
from nanoeuler.train.loop import Hyperparameters
from nanoeuler.train.objectives import CrossEntropy
from nanoeuler.train.sharded import ShardPlan, Sharded, plan_of
from test_distributed import _run_ranks
from test_train import _log

STEPS, LR = 4, 3e-3


def test_the_shard_plan_pads_each_unit_and_tiles_the_buffer():
    """Every unit padded to a multiple of the ranks and cut into equal pieces; each rank's pieces sit one after
    another in its shard, all shards one size; together they hold every element exactly once."""
    eng = make_engine(tiny_config(300), seed=1)
    units = eng.units()
    assert [u for u, _, _ in units] == ["embedding", 0, 1, "head"]
    assert units[0][1] == 0 and units[-1][2] == eng.params.size
    assert all(a[2] == b[1] for a, b in zip(units, units[1:]))
    odd = ShardPlan((("a", 0, 1), ("b", 1, 6), ("c", 6, 13)), 3)  # sizes 1, 5, 7 over 3 ranks
    assert odd.pieces == (1, 2, 3) and odd.at == (0, 1, 3) and odd.shard_size == 6
    assert odd.ranges(0) == [(0, 1, 0), (1, 3, 1), (6, 9, 3)]
    assert odd.ranges(2) == [(1, 1, 0), (5, 6, 1), (12, 13, 3)]  # unit a's padding is all rank 2 gets of it
    assert odd.unit_ranges(1) == [(1, 3), (3, 5), (5, 6)]
    for plan in [odd] + [plan_of(eng, n) for n in (1, 2, 3, 8)]:
        n, total = plan.world_size, plan.total
        flat = np.arange(1, total + 1, dtype=np.float32)
        seen = np.zeros(total, int)
        for rank in range(n):
            shard = plan.take(flat, rank)
            assert shard.size == plan.shard_size
            for lo, hi, at in plan.ranges(rank):
                seen[lo:hi] += 1
                np.testing.assert_array_equal(shard[at:at + hi - lo], flat[lo:hi])
            assert (shard == 0).sum() == plan.shard_size - sum(hi - lo for lo, hi, _ in plan.ranges(rank))
        assert (seen == 1).all()
        assert n * plan.shard_size - total == sum(n * p - (end - start)
                                                  for p, (_, start, end) in zip(plan.pieces, plan.units))
        for k, (_, start, end) in enumerate(plan.units):
            assert plan.unit_ranges(k)[0][0] == start and plan.unit_ranges(k)[-1][1] == end


def _steps(batch, comm=None, stage=0, recompute=False, cfg=None, grad_accum=None, log=None, device="cpu",
           precision="fp32", weights=None):
    """STEPS optimizer steps of the tiny model (fp32 unless asked); (losses and norms, final weights, moments,
    the DataParallel or Sharded). weights (ZeRO-2/3): the weights to start from, the engine made without its
    whole buffers; else the engine's own (seed 1), made whole."""
    cfg = cfg or tiny_config(300, gpu=device == "gpu")
    rank, world = (comm.rank, comm.world_size) if comm else (0, 1)
    eng = make_engine(cfg, device=device, seed=1, precision=precision, zero=stage if weights is not None else 0,
                      ranks=world)
    eng.recompute = recompute
    source = RandomWindows(np.random.default_rng(0).integers(0, 300, 20000), batch, cfg.context, cfg.mtp_heads,
                           seed=7, rank=rank, world_size=world)
    hp = Hyperparameters(steps=STEPS, batch_size=batch, lr=LR, warmup=1, eval_every=9, sample_every=9, ckpt_every=9,
                         grad_accum=grad_accum or (2 if world == 1 else 1))  # one rank in 2 passes
    if stage >= 2:
        parallel = Sharded(eng, comm or SingleProcess(), stage, hp.beta1, hp.beta2, log=log, weights=weights)
    else:
        parallel = DataParallel(eng, AdamW(eng, hp.beta1, hp.beta2), comm, zero=stage == 1)
    objective = CrossEntropy(parallel.comm)
    numbers = []
    for _ in range(STEPS):
        shares, tokens = objective.train_step(eng, source.next(), hp)
        norm, (loss, total) = parallel.step(LR, hp.weight_decay, hp.grad_clip, [shares["loss"], tokens])
        assert total == batch * world * cfg.context
        numbers.append((loss, norm))
    return numbers, parallel.params_numpy(), parallel.opt_state_numpy(), parallel


@pytest.mark.parametrize("stage, recompute", [(1, False), (2, False), (3, False), (3, True)],
                         ids=["zero1", "zero2", "zero3", "zero3-recompute"])
@pytest.mark.parametrize("ranks", [2, 3])  # 3: every unit is padded (the tiny model's sizes are odd)
def test_ranks_train_like_one_rank_at_their_global_batch(stage, recompute, ranks):
    """N ranks at batch 4 follow 1 rank at batch 4N in fp32, step after step: losses and norms to rounding, the
    weights and moments gathered from the shards to a few ulps of AdamW's first steps."""
    ref = _steps(4 * ranks)
    got = _run_ranks(ranks, lambda comm: _steps(4, comm, stage, recompute))
    for numbers, params, (m, v), _ in got:
        np.testing.assert_allclose(numbers, ref[0], rtol=1e-5)
        np.testing.assert_allclose(params, ref[1], rtol=0, atol=1e-5)
        np.testing.assert_allclose(m, ref[2][0], rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(v, ref[2][1], rtol=1e-3, atol=1e-10)
    np.testing.assert_array_equal(got[0][1], got[-1][1])  # the ranks hold one model


def test_gradient_accumulation_and_a_tied_head_shard_like_the_replicated_update():
    """Two passes a step on each rank (ZeRO-2/3 reduce-scatter each pass's gradients and add them), and a tied
    model (its head reads and trains the embedding, gathered and reduced with it): ZeRO-2 and ZeRO-3 follow the
    replicated update on the same ranks."""
    tied = dataclasses.replace(tiny_config(300), mtp_heads=1, tied=True)
    for cfg in (tiny_config(300), tied):
        ref = _run_ranks(2, lambda comm: _steps(4, comm, 0, cfg=cfg, grad_accum=2))[0]
        for stage in (2, 3):
            numbers, params, (m, _), _ = _run_ranks(2, lambda comm: _steps(4, comm, stage, cfg=cfg, grad_accum=2))[1]
            np.testing.assert_allclose(numbers, ref[0], rtol=1e-5)
            np.testing.assert_allclose(params, ref[1], rtol=0, atol=1e-5)
            np.testing.assert_allclose(m, ref[2][0], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_world_of_one_through_the_sharding_is_the_plain_update(stage):
    """One rank through ZeRO-2/3's units (each unit's gradients in a buffer of its own, ZeRO-3's weights
    gathered and freed a unit at a time) computes the plain update's losses, norms and weights."""
    ref = _steps(4, grad_accum=2)
    got = _steps(4, stage=stage, grad_accum=2, recompute=stage == 3)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], ref[1], rtol=0, atol=1e-6)


def _gpus():
    import nanoeuler.model.gpu
    return nanoeuler.model.gpu.available()


@pytest.mark.gpu
@pytest.mark.skipif(not _gpus(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_gpu_through_the_sharding_over_nccl_is_the_plain_update(precision, tmp_path):
    """What one GPU shows of ZeRO-2/3's GPU path: the GPU engine's passes a unit at a time, NCCL's all-gather and
    reduce-scatter of a world of one, the AdamW kernel over the shard (in bf16 rewriting the shard's bf16
    copy), ZeRO-3's whole weights gathered for an evaluation, and a checkpoint streamed from the shard."""
    from nanoeuler.parallel.comm import NcclCommunicator, World
    from nanoeuler.parallel.launch import free_port
    comm = NcclCommunicator(World(0, 1, 0, "127.0.0.1", free_port()), wait=60)
    try:
        ref = _steps(8, device="gpu", precision=precision)
        for stage in (2, 3):
            numbers, params, _, parallel = _steps(8, comm, stage, recompute=stage == 3, device="gpu",
                                                  precision=precision)
            # in bf16 a clip factor rounded otherwise (the norm's squares summed a unit at a time) may move a
            # weight's bf16 copy by an ulp
            loose = precision == "bf16"
            np.testing.assert_allclose(numbers, ref[0], rtol=1e-3 if loose else 1e-5)
            np.testing.assert_allclose(params, ref[1], rtol=0, atol=1e-4 if loose else 1e-5)
            with parallel.evaluating():  # ZeRO-3 gathers whole weights; ZeRO-2 holds them, sharded updates on
                assert parallel.eng.weights is not None
                assert parallel.eng.sharding is (None if stage == 3 else parallel)
            assert parallel.eng.sharding is parallel and (stage == 2 or parallel.eng.p == {})
            _save(tmp_path / "streamed.bin", parallel, True)
            _save(tmp_path / "whole.bin", parallel, False)
            assert (tmp_path / "streamed.bin").read_bytes() == (tmp_path / "whole.bin").read_bytes()
    finally:
        comm.close()


@pytest.mark.parametrize("recompute", [False, "layer", "products", "mlp"],
                         ids=["kept", "recompute-layer", "recompute-products", "recompute-mlp"])
@pytest.mark.parametrize("tied", [False, True], ids=["heads", "tied"])
def test_zero3_gathers_each_unit_before_its_passes_and_frees_it_after(recompute, tied):
    """A step's forward gathers and frees each unit in order, the backward each again from the head down (the
    recomputed forward inside the gather) and reduces its gradients as it frees it; each gather starts the
    next unit's within its pass (two units held at a time); the embedding's gradients (a tied head's with
    them) are reduced last, and the embedding needs no gather for them. Between the passes the engine holds
    no weight and no gradient."""
    cfg = dataclasses.replace(tiny_config(300), mtp_heads=1, tied=True) if tied else tiny_config(300)
    logs = [[], []]
    got = _run_ranks(2, lambda comm: _steps(4, comm, 3, recompute, cfg=cfg, log=logs[comm.rank]))
    order = ["embedding", *range(cfg.n_layers), "head"]
    forward = []
    for unit, after in zip(order, order[1:] + [None]):  # each gather starts the next unit's (prefetch)
        forward += [("gather", unit)] + [("prefetch", after)] * (after is not None) + [("release", unit)]
    backward, down = [], ["head", *reversed(range(cfg.n_layers))]
    for unit, after in zip(down, down[1:] + [None]):  # none past the first layer: the step comes next
        backward += [("gather", unit)] + [("prefetch", after)] * (after is not None) + [("release", unit),
                                                                                        ("reduce", unit)]
    backward += [("reduce", "embedding")]
    assert logs[0] == logs[1] == (forward + backward) * STEPS
    for *_, parallel in got:
        assert parallel.eng.p == {} and parallel.eng.g == {} and parallel.eng.weights is None
        assert parallel._held == {} and parallel._open == {} and parallel._prefetched == {}


def _save(path, parallel, streamed):
    """A checkpoint of the run's weights and moments: from the shards (streamed), or gathered whole first."""
    cfg, rank = parallel.eng.cfg, parallel.comm.rank
    if streamed:
        params, moments = parallel.streamed()
    else:
        params, moments = parallel.params_numpy(), parallel.opt_state_numpy()
    if rank == 0:
        checkpoint.save(path, cfg, params, "{}", 4, opt=moments, train_state={"kind": "test"})
    elif streamed:
        checkpoint.read_along(cfg, params, moments)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_from_shards_is_the_whole_models(tmp_path, stage):
    """Written from the shards a unit at a time through rank 0, the checkpoint is byte for byte the one
    written from the gathered whole buffers, and holds the one-rank run's weights and moments (to rounding)."""
    ref = _steps(12)

    def work(comm):
        *_, parallel = _steps(4, comm, stage)
        _save(tmp_path / "streamed.bin", parallel, True)
        _save(tmp_path / "whole.bin", parallel, False)
    _run_ranks(3, work)
    assert (tmp_path / "streamed.bin").read_bytes() == (tmp_path / "whole.bin").read_bytes()
    ck = checkpoint.load(tmp_path / "streamed.bin", with_opt=True)
    np.testing.assert_allclose(ck.params, ref[1], rtol=0, atol=1e-5)
    np.testing.assert_allclose(ck.opt[0], ref[2][0], rtol=1e-4, atol=1e-7)


def test_zero_1_is_the_default_of_full_training_and_lora_keeps_its_adapters_whole():
    from nanoeuler.train.run import zero_stage
    from nanoeuler.train.options import FineTuneOptions
    assert zero_stage(FineTuneOptions(), lora=False) == 1
    assert zero_stage(FineTuneOptions(), lora=True) == 0
    assert zero_stage(FineTuneOptions(zero=0), lora=False) == 0
    assert zero_stage(FineTuneOptions(zero=3), lora=False) == 3
    from nanoeuler.cli import build_parser
    parser, _ = build_parser()
    assert parser.parse_args(["train", "--zero", "3"]).zero == 3 and parser.parse_args(["train"]).zero is None
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--zero", "4"])


def test_a_resumed_runs_moments_are_read_a_shard_at_a_time(tmp_path):
    """stored_opt: the moments stay in the file and each rank reads its shard's elements alone (ranges that
    cut rows and span tensors), equal to the eagerly read ones; whole, they are the eager arrays."""
    cfg = tiny_config(300)
    rng = np.random.default_rng(0)
    total = make_engine(cfg).params.size
    params, m, v = (rng.standard_normal(total).astype(np.float32) for _ in range(3))
    checkpoint.save(tmp_path / "c.bin", cfg, params, "{}", 3, opt=(m, v), train_state={})
    stored = checkpoint.load(tmp_path / "c.bin", with_opt=True, stored_opt=True).opt
    np.testing.assert_array_equal(np.asarray(stored[0]), m)
    for start, end in ((0, 1), (5, 4000), (total - 7, total), (1234, 1235)):
        np.testing.assert_array_equal(stored[1].read(start, end), v[start:end])
    plan = plan_of(make_engine(cfg), 3)
    for rank in range(3):
        np.testing.assert_array_equal(plan.take(stored[1], rank), plan.take(v, rank))


# --------------------------------------------------------------------------------- the start from shards
DEEP = Config(dim=64, n_layers=8, n_heads=4, n_kv_heads=2, hidden=128, vocab_size=300, context=32, mtp_heads=2)


def _held_bytes(eng, parallel):
    """The bytes of the distinct arrays that a rank's engine, sharding and optimizer hold (views counted once, by
    the buffer they view)."""
    arrays = {}

    def visit(value):
        if isinstance(value, np.ndarray):
            base = value
            while base.base is not None and isinstance(base.base, np.ndarray):
                base = base.base
            arrays[id(base)] = base.nbytes
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
    for owner in (eng, parallel, parallel.optimizer):
        visit(vars(owner))
    return sum(arrays.values())


@pytest.mark.parametrize("stage", [2, 3])
def test_a_rank_starts_from_its_shard_not_the_whole_model(tmp_path, stage):
    """4 ranks resume ZeRO-2/3 from a checkpoint: each reads its shard of the weights and moments from the file
    (its elements and a few cut rows: a quarter of the file's bytes, not all of them), never holds a whole
    gradient or master buffer (ZeRO-3: no whole weights either), holds its shards (float32 master weights,
    gradients and moments, the decay mask: 17 bytes a parameter over N; ZeRO-2 the whole compute weights too,
    4 bytes a parameter in fp32), and held no more than that and a unit's buffers at any moment of the start:
    the peak of every allocation the 4 ranks made (traced), over 4. The whole engine they used to start from
    held 8 bytes a parameter (weights and gradients) on every rank at once."""
    n, total = 4, param_count(DEEP)
    rng = np.random.default_rng(0)
    params, m, v = (rng.standard_normal(total).astype(np.float32) for _ in range(3))
    checkpoint.save(tmp_path / "c.bin", DEEP, params, "{}", 3, opt=(m, v), train_state={})
    del params, m, v

    def start(comm):
        ck = checkpoint.load(tmp_path / "c.bin", with_opt=True, stored_opt=True, stored_params=True)
        eng = make_engine(DEEP, zero=stage, ranks=comm.world_size)
        parallel = Sharded(eng, comm, stage, moments=(*ck.opt, 3), weights=ck.params)
        return [stored.bytes_read for stored in (ck.params, *ck.opt)], _held_bytes(eng, parallel), parallel
    _run_ranks(n, start)  # imports and first calls out of the count
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        got = _run_ranks(n, start)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        if not tracing:
            tracemalloc.stop()
    plan = got[0][2].plan
    largest_unit = max(end - start for _, start, end in plan.units)
    longest_row = max(int(np.prod(shape[1:])) for _, (_, shape) in param_layout(DEEP)[0].items())
    compute = 4 * total if stage == 2 else 0  # ZeRO-2's whole compute weights (float32 on the CPU)
    for rank, (read, held, parallel) in enumerate(got):
        eng = parallel.eng
        assert eng.grads is None and eng.g == {} and eng.zero == stage
        assert (eng.params is None and eng.weights is None and eng.p == {}) if stage == 3 else \
            (eng.weights.size == total and eng.params is eng.weights)
        mine = sum(hi - lo for lo, hi, _ in plan.ranges(rank))
        for bytes_read in read:  # the weights', m's and v's: its elements, and at most 2 cut rows a unit
            assert 4 * mine <= bytes_read <= 4 * (mine + 2 * longest_row * len(plan.units)) < 4 * total / 3
        tables = eng.cos.nbytes + eng.sin.nbytes + eng.zero_position.nbytes
        assert held - tables == 17 * plan.shard_size + compute
    steady = 17 * plan.shard_size + compute
    assert peak / n <= steady + 2 * 4 * largest_unit
    if stage == 3:
        assert peak / n < 8 * total * 0.6


def test_a_fresh_models_weights_and_the_decay_mask_are_read_a_range_at_a_time():
    """A fresh ZeRO-2/3 run's ranks draw the initial weights a tensor at a time (config.InitialWeights) and keep
    their shard: init_params's values, in ranges that cut tensors and span several; the draws go forward only.
    The decay mask's ranges are decay_mask's."""
    cfg = tiny_config(300)
    whole, mask = init_params(cfg, seed=5), decay_mask(cfg)
    plan = plan_of(make_engine(cfg), 3)
    for rank in range(3):
        np.testing.assert_array_equal(plan.take(InitialWeights(cfg, seed=5), rank), plan.take(whole, rank))
        np.testing.assert_array_equal(plan.take(DecayMask(cfg), rank), plan.take(mask, rank))
    stream = InitialWeights(cfg, seed=5)
    cuts = [0, 3, 7000, 7001, 9999, whole.size]
    for start, end in zip(cuts, cuts[1:]):
        np.testing.assert_array_equal(stream.read(start, end), whole[start:end])
    with pytest.raises(ValueError, match="ascending"):
        stream.read(0, 1)


def test_a_checkpoints_weights_read_a_shard_at_a_time_are_checked_finite(tmp_path):
    """stored_params: the weights stay in the file and a rank's shard is what it reads; a non-finite value in
    what a rank reads is a one-line error, as load's whole check is."""
    cfg = tiny_config(300)
    params = np.random.default_rng(1).standard_normal(make_engine(cfg).params.size).astype(np.float32)
    checkpoint.save(tmp_path / "c.bin", cfg, params, "{}", 0)
    stored = checkpoint.load(tmp_path / "c.bin", stored_params=True).params
    assert isinstance(stored, checkpoint.StoredFlat) and stored.bytes_read == 0
    plan = plan_of(make_engine(cfg), 2)
    np.testing.assert_array_equal(plan.take(stored, 1), plan.take(params, 1))
    params[-3] = np.nan  # in rank 1's piece of the head
    checkpoint.save(tmp_path / "bad.bin", cfg, params, "{}", 0)
    bad = checkpoint.load(tmp_path / "bad.bin", stored_params=True).params
    plan.take(bad, 0)
    with pytest.raises(UserError, match="holds non-finite weights"):
        plan.take(bad, 1)
    with pytest.raises(UserError, match="holds non-finite weights"):
        checkpoint.load(tmp_path / "bad.bin")


def test_the_memory_check_counts_a_ranks_share(monkeypatch):
    """make_engine with zero checks a rank's share against the free memory: the shard's 19 bytes a parameter over
    N in bf16 (17 in fp32), ZeRO-2's whole compute weights beside them; Llama-3-8B's ZeRO-3 share on 8 ranks."""
    n = 8_030_261_248
    assert memory.sharded_bytes(n, 8, 3, 4, 2) == 19 * n // 8
    assert memory.sharded_bytes(n, 8, 2, 4, 2) == 19 * n // 8 + 2 * n
    assert memory.sharded_bytes(10, 4, 3, 4, 4) == 17 * 3  # the shard rounded up, no copy in fp32
    cfg = tiny_config(300)
    total = make_engine(cfg).params.size
    share = {3: 17 * -(-total // 4), 2: 17 * -(-total // 4) + 4 * total}
    for stage in (2, 3):
        monkeypatch.setenv("NANOEULER_MEMORY_AVAILABLE", str(share[stage]))
        make_engine(cfg, zero=stage, ranks=4)
        monkeypatch.setenv("NANOEULER_MEMORY_AVAILABLE", str(share[stage] - 1))
        with pytest.raises(UserError, match=f"ZeRO-{stage} share over 4 ranks .* or more ranks$"):
            make_engine(cfg, zero=stage, ranks=4)


# each rank of a command line records what its checkpoint.StoredFlat buffers read, as [prefix, bytes], at its exit
READS_WORKER = """
import atexit, dataclasses, json, os, sys
from nanoeuler import cli
from nanoeuler.io import checkpoint
from nanoeuler.train import pretrain, sft
from nanoeuler.train.loop import Hyperparameters
pretrain.PRESET_HYPER["base"] = sft.SFT_HYPER = Hyperparameters(**{hyper!r})
stored, made = [], checkpoint.StoredFlat.__init__
def record(self, *args, **kwargs):
    made(self, *args, **kwargs)
    stored.append(self)
checkpoint.StoredFlat.__init__ = record
atexit.register(lambda: open(os.path.join({out!r}, "reads%s.json" % os.environ.get("RANK", "0")), "w").write(
    json.dumps([[s.prefix, s.bytes_read] for s in stored])))
cli.main(sys.argv[1:])
"""
CKPT_HYPER = Hyperparameters(steps=4, batch_size=2, lr=3e-3, warmup=1, eval_every=2, sample_every=100,
                             ckpt_every=100, eval_batches=2, final_eval_batches=2, min_lr_ratio=1.0, sample_tokens=4)


def _ckpt_runs(tmp_path, corpus, tokenizer, command, stage, ranks, device="cpu"):
    """`COMMAND --ckpt` of a tiny model on `ranks` ranks with ZeRO `stage` (batch 2 a rank) and in one process
    at their global batch: each rank's bytes read of the checkpoint's weights and moments, and the two runs'
    metrics logs and final checkpoints, after checking that the one process read nothing stored."""
    gpu = device == "gpu"
    cfg = dataclasses.replace(tiny_config(tokenizer.vocab_size, gpu), context=256)  # room for the chat template
    checkpoint.save(tmp_path / "start.bin", cfg, init_params(cfg, seed=3), tokenizer.to_json(), step=0)
    data = ["--data", corpus] if command == "train" else ["--data", os.path.join(ROOT, "tests", "data",
                                                                                  "sft_greetings.json"),
                                                           "--val-examples", 4]
    common = [command, "--ckpt", tmp_path / "start.bin", *data, "--device", device] + ["--precision", "fp32"] * gpu

    def run(name, n, *flags):
        (tmp_path / name).mkdir()
        script = READS_WORKER.format(hyper=dataclasses.asdict(CKPT_HYPER), out=str(tmp_path / name))
        argv = [sys.executable, "-c", script, *map(str, common + list(flags)), "--out", str(tmp_path / name / "c.bin")]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        code = launch.launch(argv + ["--gpus", str(n)], n) if n > 1 else subprocess.run(argv, cwd=ROOT, env=env,
                                                                                           timeout=300).returncode
        assert code == 0
        return [json.loads((tmp_path / name / f"reads{r}.json").read_text()) for r in range(n)]
    assert run("one", 1, "--batch-size", 2 * ranks) == [[]]  # a whole load: nothing left in the file
    reads = run("sharded", ranks, "--batch-size", 2, "--zero", stage)
    total = 4 * make_engine(cfg).params.size
    weights = [sum(b for prefix, b in mine if prefix == "") for mine in reads]
    assert all(total / ranks <= b < 1.1 * total / ranks for b in weights[:-1]), (weights, total)
    assert total <= sum(weights) < 1.05 * total, (weights, total)
    ref, got = _log(tmp_path / "one" / "c.jsonl"), _log(tmp_path / "sharded" / "c.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, 5))
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in got], [r[key] for r in ref], rtol=1e-5, err_msg=key)
    # AdamW's first steps take an element whose gradient is near 0 most of a step either way: rounding moves it
    np.testing.assert_allclose(checkpoint.load(tmp_path / "sharded" / "c.bin").params,
                               checkpoint.load(tmp_path / "one" / "c.bin").params, rtol=0, atol=CKPT_HYPER.lr / 30)


@pytest.mark.parametrize("command, stage, ranks", [("train", 3, 2), ("sft", 2, 3)])
def test_a_checkpoint_given_with_ckpt_starts_each_rank_from_its_shard(tmp_path, corpus, tokenizer, command, stage,
                                                                       ranks):
    """`train --ckpt` (ZeRO-3, 2 ranks) and `sft --ckpt` (ZeRO-2, 3 ranks): each rank reads its shard of the
    checkpoint's weights alone (the ranks' reads, counted in their processes, cover the file's weights once
    and a few cut rows), and the run follows one process at the global batch (which reads the weights whole,
    nothing stored): its losses and norms to rounding, its weights to AdamW's rounding."""
    _ckpt_runs(tmp_path, corpus, tokenizer, command, stage, ranks)


def _gpu_count():
    if not _gpus():
        return 0
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("stage", [2, 3])
def test_two_gpus_start_from_their_shard_of_a_checkpoint(tmp_path, corpus, tokenizer, stage):
    """`train --ckpt` on 2 GPUs in fp32 with ZeRO-2/3: each rank reads its shard of the weights onto its GPU,
    and the run follows one GPU at the global batch (as the CPU ranks above)."""
    _ckpt_runs(tmp_path, corpus, tokenizer, "train", stage, 2, device="gpu")


@pytest.mark.parametrize("stage", [2, 3])
def test_the_start_from_shards_trains_as_the_whole_start_bit_for_bit(tmp_path, stage):
    """3 ranks (every unit padded) whose engine is never whole, each reading its shard of the weights from a
    checkpoint (or drawing it: a fresh model's InitialWeights), log the losses and norms and end with the
    weights and moments of ranks that start from a whole engine of those weights, to the bit."""
    cfg, ranks = tiny_config(300), 3
    checkpoint.save(tmp_path / "c.bin", cfg, init_params(cfg, seed=1), "{}", 0)
    whole = _run_ranks(ranks, lambda comm: _steps(4, comm, stage))
    for weights in (lambda: checkpoint.load(tmp_path / "c.bin", stored_params=True).params,
                    lambda: InitialWeights(cfg, seed=1)):
        got = _run_ranks(ranks, lambda comm: _steps(4, comm, stage, weights=weights()))
        for (numbers, params, (m, v), _), ref in zip(got, whole):
            assert numbers == ref[0]
            for a, b in ((params, ref[1]), (m, ref[2][0]), (v, ref[2][1])):
                np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpus(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_gpu_starts_from_a_checkpoints_shard_as_from_the_whole_engine(precision, tmp_path):
    """The GPU engine made without its whole buffers (ZeRO-2: the whole compute weights alone; ZeRO-3: none),
    its shard of the float32 weights read from a checkpoint onto the GPU and its bf16 copy rounded there,
    ZeRO-2's compute weights all-gathered over NCCL: the losses, norms, weights and moments of the whole
    engine's start, to the bit."""
    from nanoeuler.parallel.comm import NcclCommunicator, World
    from nanoeuler.parallel.launch import free_port
    cfg = tiny_config(300, gpu=True)
    checkpoint.save(tmp_path / "c.bin", cfg, init_params(cfg, seed=1), "{}", 0)
    comm = NcclCommunicator(World(0, 1, 0, "127.0.0.1", free_port()), wait=60)
    try:
        for stage in (2, 3):
            ref = _steps(8, comm, stage, recompute=stage == 3, device="gpu", precision=precision)
            stored = checkpoint.load(tmp_path / "c.bin", stored_params=True).params
            numbers, params, (m, _), parallel = _steps(8, comm, stage, recompute=stage == 3, device="gpu",
                                                       precision=precision, weights=stored)
            assert numbers == ref[0]
            np.testing.assert_array_equal(params, ref[1])
            np.testing.assert_array_equal(m, ref[2][0])
            eng = parallel.eng
            assert eng.grads is None and eng.zero == stage and (stage == 2) == (eng.weights is not None)
            assert stored.bytes_read == 4 * params.size  # a world of one: its shard is every element
    finally:
        comm.close()
