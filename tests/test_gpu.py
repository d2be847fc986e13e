"""The GPU engine. The CUDA sources must compile with nvcc (runs wherever the CUDA toolkit is, GPU or not,
as in CI); everything else needs a CUDA GPU and is skipped without one: each kernel against its CPU layer in
every precision, the whole model's gradients against the CPU engine's, determinism, a few training steps on
both engines, and bit-exact repeat and resume of GPU training runs."""
import ast
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

import nanoeuler.model
import nanoeuler.model.gpu
from nanoeuler.model.gpu.constants import KERNELS, module_defines, module_variants
from nanoeuler.check.gpu import (BF16_MODEL_TOL, FP32_TOL, KERNEL_CHECKS, QUANT_CONFIG, TF32_TOL, _Case,
                                 lora_model_check, model_check)
from conftest import sharp_params
from test_train import HYPER, _interrupt_at, _log, _train
from nanoeuler.model.decoding import decoder_of
from nanoeuler.model.optimizer import AdamW
from nanoeuler.model.losses import cross_entropy_backward

needs_gpu = pytest.mark.skipif(not nanoeuler.model.gpu.available(),
                               reason="needs a CUDA GPU (compute capability 8.0+) and cupy")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (the CUDA toolkit) is not installed")
def test_cuda_sources_compile(tmp_path):
    """Every kernel file, in each variant layers.py builds (float32 and bf16 elements; attention also with
    3xTF32) and with the defines layers.py gives it, compiles for sm_80 (the oldest GPU the tensor-core
    instructions run on) and sm_89 (Ada, the RTX 4070 the original targets); without the numbers it shares
    with Python it does not compile (it has no fallback values of its own)."""
    jobs = []
    for src in sorted(KERNELS.glob("*.cu")):
        base = ["nvcc", "-cubin", "--std=c++17", f"-I{KERNELS}", str(src)]
        for arch in ("sm_80", "sm_89"):
            for i, variant in enumerate(module_variants(src.stem)):
                cmd = base + [f"-arch={arch}", *(f"-D{d}" for d in module_defines(src.stem, variant)),
                              "-o", str(tmp_path / f"{src.stem}{arch}{i}.cubin")]
                jobs.append((cmd, True, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                         text=True)))
        if module_defines(src.stem) != ():
            cmd = base + ["-arch=sm_80", "-o", str(tmp_path / f"{src.stem}_bare.cubin")]
            jobs.append((cmd, False, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                      text=True)))
    for cmd, compiles, proc in jobs:
        output = proc.communicate()[0]
        assert (proc.returncode == 0) == compiles, f"{' '.join(cmd)}\n{output}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("check,precision", [(check, precision) for check in KERNEL_CHECKS
                                             for precision in check.precisions],
                         ids=lambda v: v if isinstance(v, str) else v.__name__[len("check_"):])
def test_kernel_matches_cpu_layer(check, precision):
    from nanoeuler.model.cpu.layers import Layers as CPULayers
    from nanoeuler.model.gpu.layers import Layers as GPULayers

    gpu_layers, cpu_layers = GPULayers(precision, batch_invariant=True), CPULayers("fp32", batch_invariant=True)
    for label, err, tol in check(_Case(np.random.default_rng(11), precision), gpu_layers, cpu_layers):
        assert err <= tol, f"{label}: {err:.2e} > {tol:.0e}"


def test_gpu_layers_mirror_the_cpu_layers():
    """gpu/layers.py's Layers has the methods of cpu/layers.py's, in the same order (cast_params, which writes
    the bf16 compute copy, is the GPU's alone); read with ast, so it runs without a GPU."""
    def methods(module):
        tree = ast.parse((pathlib.Path(nanoeuler.model.__file__).parent / module).read_text())
        layers = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Layers")
        # in the order of the class body: methods (def) and the module's functions bound as they are (name = ...)
        names = [node.name if isinstance(node, ast.FunctionDef) else node.targets[0].id for node in layers.body
                 if isinstance(node, (ast.FunctionDef, ast.Assign))]
        return [name for name in names if not name.startswith("_")]

    cpu, gpu = methods("cpu/layers.py"), methods("gpu/layers.py")
    assert [name for name in gpu if name != "cast_params"] == cpu
    assert "matmul_forward" in cpu and cpu[-1] == "graph"


@pytest.mark.gpu
@needs_gpu
def test_two_gpu_engines_of_different_precision_do_not_interfere():
    """Each engine's layers carry its precision: an fp32 engine's logits are the same bits before and after a
    tf32 engine ran in between, and the tf32 engine's differ (its products round to TF32)."""
    from nanoeuler.check.gpu import MODEL_CONFIG
    from nanoeuler.check.problems import random_problem
    from nanoeuler.model.engine import make_engine

    flat, inputs, _ = random_problem(MODEL_CONFIG, np.random.default_rng(3), batch=2)
    fp32, tf32 = (make_engine(MODEL_CONFIG, device="gpu", precision=precision) for precision in ("fp32", "tf32"))
    fp32.load_params(flat)
    tf32.load_params(flat)
    before = fp32.logits(inputs)
    fast = tf32.logits(inputs)
    assert np.array_equal(fp32.logits(inputs), before) and not np.array_equal(fast, before)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision,bound", [("fp32", FP32_TOL), ("tf32", TF32_TOL), ("bf16", BF16_MODEL_TOL)])
def test_model_gradients_match_cpu_engine(precision, bound):
    errors = model_check(seed=5, precision=precision, report=lambda line: None)
    worst = max(errors, key=errors.get)
    assert errors[worst] < bound, (worst, errors[worst])
    assert errors["determinism"] == 0.0


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision,bound", [("fp32", FP32_TOL), ("bf16", BF16_MODEL_TOL)])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_lora_gradients_match_cpu_engine(precision, bound, dropout):
    """LoRA on a frozen base, all seven targets, dropout off and on (the same mask on both engines): the
    adapters' gradients and the loss against the CPU engine's; --recompute's gradients the stored path's bits."""
    errors = lora_model_check(seed=5, precision=precision, report=lambda line: None, dropout=dropout)
    worst = max(errors, key=errors.get)
    assert errors[worst] < bound, (worst, errors[worst])
    assert errors["recompute"] == 0.0


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision,bound", [("fp32", FP32_TOL), ("bf16", BF16_MODEL_TOL)])
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_qlora_gradients_match_cpu_engine(precision, bound, quant):
    """QLoRA (check --gpu's rows): the base's matrices quantized in groups of 32, dropout 0.25; the products of
    3 x 100 rows on their dequantized copies (bf16: rounded to bf16) and cuBLAS, forward and backward."""
    errors = lora_model_check(seed=5, precision=precision, report=lambda line: None, cfg=QUANT_CONFIG,
                              dropout=0.25, quant=quant)
    worst = max(errors, key=errors.get)
    assert errors[worst] < bound, (worst, errors[worst])
    assert errors["recompute"] == 0.0


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision,bound", [("fp32", FP32_TOL), ("bf16", BF16_MODEL_TOL)])
def test_model_gradients_match_cpu_engine_at_head_size_128(precision, bound):
    """The model check's model with two 128-wide query heads on one kv head (Llama-3-8B's and Mistral-7B's head
    size): its gradients, loss and cached decoding against the CPU engine."""
    import dataclasses
    from nanoeuler.check.gpu import MODEL_CONFIG

    cfg = dataclasses.replace(MODEL_CONFIG, dim=256, n_heads=2, n_kv_heads=1)
    assert cfg.head_dim == 128
    errors = model_check(seed=5, precision=precision, report=lambda line: None, cfg=cfg)
    worst = max(errors, key=errors.get)
    assert errors[worst] < bound, (worst, errors[worst])
    assert errors["determinism"] == 0.0


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision,bound", [("fp32", FP32_TOL), ("bf16", BF16_MODEL_TOL)])
def test_logits_in_pieces_and_quantized_row_slices_match_cpu_engine(precision, bound, monkeypatch):
    """The logits a piece of 100 of the 300 rows at a time (the heads' product, the cross-entropy and the way back
    through the heads; the CPU engine's in pieces of 50), on the float model (K = 2 heads: every gradient, cached
    decoding) and on QLoRA's int4 base with every quantized matrix of more than 256 rows of 128 in row slices
    (gate|up, w_down and the head: its 600 rows in slices of 256) and its full forward's logits: within the
    bounds of the whole-logits checks; --recompute's and a second pass's gradients the same bits."""
    from nanoeuler.check.gpu import MODEL_CONFIG, quantized_model_check
    from nanoeuler.model import engine
    from nanoeuler.model.gpu import quantized
    itemsize = 2 if precision == "bf16" else 4
    monkeypatch.setattr(engine, "LOGITS_BYTES", 100 * MODEL_CONFIG.mtp_heads * MODEL_CONFIG.vocab_size * itemsize)
    monkeypatch.setattr(quantized, "SLICE_ELEMENTS", 256 * 128)
    monkeypatch.setattr(quantized, "_dequantized", {})
    errors = model_check(seed=5, precision=precision, report=lambda line: None)
    worst = max(errors, key=errors.get)
    assert errors[worst] < bound and errors["determinism"] == 0.0, (worst, errors[worst])
    errors = lora_model_check(seed=5, precision=precision, report=lambda line: None, cfg=QUANT_CONFIG,
                              dropout=0.25, quant="int4")
    worst = max(errors, key=errors.get)
    assert errors[worst] < bound and errors["recompute"] == 0.0, (worst, errors[worst])
    errors = quantized_model_check(0, "int4", 32, precision, report=lambda line: None)
    assert max(errors.values()) < bound, errors
    assert all(s.size <= 256 * 128 for s in quantized._dequantized.values())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision,tol", [("tf32", 2e-3), ("bf16", 2e-2)])
def test_training_steps_agree_across_engines(precision, tol):
    """Same init, same batches, same AdamW steps: the losses track each other to the precision's rounding."""
    from nanoeuler.check.gpu import MODEL_CONFIG
    from nanoeuler.model.engine import make_engine
    from nanoeuler.check.problems import random_problem

    rng = np.random.default_rng(8)
    cpu, gpu = make_engine(MODEL_CONFIG, device="cpu"), make_engine(MODEL_CONFIG, device="gpu", precision=precision)
    optimizers = {cpu: AdamW(cpu), gpu: AdamW(gpu)}
    for step in range(4):
        _, inputs, targets = random_problem(MODEL_CONFIG, rng, batch=4)
        losses = []
        for eng, opt in optimizers.items():
            losses.append(cross_entropy_backward(eng, inputs, targets)[0])
            opt.step(eng, lr=3e-3, weight_decay=0.1, grad_clip=1.0)
        assert abs(losses[1] - losses[0]) < tol * losses[0], (step, losses)


@pytest.mark.gpu
@needs_gpu
def test_grad_accumulation_matches_one_large_batch():
    """Four micro-batches of 2 with the global target counts give the gradients of one batch of 8."""
    from nanoeuler.check.gpu import MODEL_CONFIG
    from nanoeuler.model.engine import make_engine
    from nanoeuler.check.problems import random_problem

    _, inputs, targets = random_problem(MODEL_CONFIG, np.random.default_rng(4), batch=8)
    eng = make_engine(MODEL_CONFIG, device="gpu", precision="fp32")
    loss = cross_entropy_backward(eng, inputs, targets)[0]
    whole = eng.grads.get()
    counts = (targets >= 0).reshape(MODEL_CONFIG.mtp_heads, -1).sum(axis=1)
    total = 0.0
    for i in range(4):
        sl = slice(2 * i, 2 * i + 2)
        total += cross_entropy_backward(eng, inputs[sl], targets[:, sl], counts, accumulate=i > 0)[0]
    assert abs(total - loss) < 1e-5 * loss
    np.testing.assert_allclose(eng.grads.get(), whole, rtol=0, atol=1e-5 * np.abs(whole).max())


@pytest.fixture
def gpu_preset(monkeypatch, tokenizer):
    """A tiny `small` whose head size the GPU attention kernels take (32)."""
    from nanoeuler.train import pretrain as train
    from nanoeuler.model.config import PRESETS, Config

    cfg = Config(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, hidden=128, vocab_size=tokenizer.vocab_size,
                 context=32, mtp_heads=2)
    monkeypatch.setitem(PRESETS, "small", cfg)
    monkeypatch.setitem(train.PRESET_HYPER, "small", HYPER)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_gpu_training_repeats_and_resumes_bit_for_bit(gpu_preset, corpus, tokenizer_file, tmp_path, monkeypatch,
                                                      precision):
    """Two GPU runs from one seed log identical losses; Ctrl-C during step 7 and --resume give them too."""
    common = ["--data", corpus, "--tokenizer", tokenizer_file, "--device", "gpu", "--precision", precision]
    assert _train(*common, "--out", tmp_path / "a.bin") == 0
    assert _train(*common, "--out", tmp_path / "b.bin") == 0
    with monkeypatch.context() as m:
        _interrupt_at(m, 7)
        assert _train(*common, "--out", tmp_path / "c.bin") == 130
    assert _train("--resume", "--out", tmp_path / "c.bin", "--device", "gpu", "--precision", precision) == 0
    runs = [_log(tmp_path / f"{n}.jsonl") for n in "abc"]
    for key in ("loss", "loss_all_heads", "grad_norm", "val_loss"):
        values = [[r.get(key) for r in run] for run in runs]
        assert values[0] == values[1] == values[2], key


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_gpu_a_verifying_step_gives_single_steps_bits(precision):
    """A position decoded in a step of 4 rows (speculative verification) gets the logits, to the bit, that it
    gets in a step of its own, for rows of odd and even length past one warp's loads: speculative greedy
    decoding can only then be plain greedy decoding on any model (base's shapes, a few layers)."""
    from nanoeuler.model.config import Config
    from nanoeuler.model.engine import make_engine

    cfg = Config(dim=768, n_layers=2, n_heads=12, n_kv_heads=4, hidden=2048, vocab_size=300, context=64,
                 mtp_heads=4)
    eng = make_engine(cfg, device="gpu", precision=precision)
    eng.load_params(sharp_params(cfg, seed=5, scale=0.05))
    ids = np.random.default_rng(6).integers(0, cfg.vocab_size, 13).astype(np.int32)
    dec = decoder_of(eng)
    one, four = dec.new_cache(1), dec.new_cache(1)
    for cache in (one, four):
        dec.logits(cache, ids[None, :9])
    singles = np.stack([dec.logits(one, ids[None, t:t + 1], all_heads=True)[0, 0] for t in range(9, 13)])
    together = dec.logits(four, ids[None, 9:13], all_heads=True)[0]
    assert np.array_equal(singles, together)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_gpu_engine_for_decoding_holds_the_compute_weights_alone(precision):
    """make_engine(training=False): no gradients, and in bf16 no float32 weights (params None), the bf16 ones
    loaded a piece at a time (pieces smaller than the model here) with the bits of a training engine's copy;
    its logits and greedy tokens are the training engine's."""
    from nanoeuler.model import engine as engine_module
    from nanoeuler.model.config import Config
    from nanoeuler.model.engine import make_engine
    from nanoeuler.infer.generate import generate

    cfg = Config(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, hidden=96, vocab_size=50, context=40, mtp_heads=3)
    flat = sharp_params(cfg, seed=1, scale=0.5, same_heads=True)
    trainer = make_engine(cfg, device="gpu", precision=precision)
    trainer.load_params(flat)
    piece = engine_module.LOAD_PIECE
    engine_module.LOAD_PIECE = 1000  # several pieces, the last a short one
    try:
        decoder = make_engine(cfg, device="gpu", precision=precision, training=False)
        decoder.load_params(flat)
    finally:
        engine_module.LOAD_PIECE = piece
    assert decoder.grads is None and (decoder.params is None) == (precision == "bf16")
    assert np.array_equal(decoder.weights.get(), trainer.weights.get())
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 30)).astype(np.int32)
    targets = np.stack([ids] * cfg.mtp_heads)
    assert np.array_equal(decoder.forward(ids, targets).get(), trainer.forward(ids, targets).get())
    assert list(generate(decoder, [1, 2, 3], 40, temperature=0)) == list(generate(trainer, [1, 2, 3], 40, temperature=0))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_gpu_decoding_graphs_and_speculation_agree(precision):
    """On the GPU: decoding steps replayed as CUDA graphs give the logits of the same steps launched kernel by
    kernel, bit for bit; greedy generation through window slides is the same with and without graphs, and with
    --speculative, its steps chained on the device or not (a tiny model with sharp logits, K = 3, heads 1-2
    copies of head 0 so that some drafts are accepted, context 40: 100 tokens slide the window)."""
    from nanoeuler.model.config import Config
    from nanoeuler.model.engine import make_engine
    from nanoeuler.infer.generate import generate

    cfg = Config(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, hidden=96, vocab_size=50, context=40, mtp_heads=3)
    eng = make_engine(cfg, device="gpu", precision=precision)
    eng.load_params(sharp_params(cfg, seed=1, scale=0.5, same_heads=True))
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, 30).astype(np.int32)
    steps = {}
    dec = decoder_of(eng)
    for graphs in (True, False):
        dec.graphs = graphs
        cache = dec.new_cache(1)
        out = [dec.logits(cache, ids[None, :10])]
        out += [dec.logits(cache, ids[None, t:t + 1]) for t in range(10, 30)]
        steps[graphs] = np.stack(out)
        dec.release(cache)
    assert np.array_equal(steps[True], steps[False])
    runs, stats = [], {}
    for graphs, speculative in ((True, False), (False, False), (True, True), (False, True)):
        dec.graphs = graphs
        runs.append(list(generate(eng, [1, 2, 3], 100, temperature=0, speculative=speculative, stats=stats)))
    assert runs[0] == runs[1] == runs[2] == runs[3]
    assert 0 < stats["accepted"] < stats["drafted"], stats


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_gpu_batched_requests_are_each_request_alone(precision, monkeypatch):
    """64 requests of prompts of 1 to 90 tokens (the longest prefilled in two chunks) and 1 to 60 new tokens,
    greedy and sampled with a seed (top-k, top-p), through 64 rows and through 24 (rows leave, are reused and
    joined while others decode): each request's tokens are those of generate() of its prompt alone, to the
    token, on base's widths (a few layers), with matmul_rows and the split over blocks at 9 to 64 rows."""
    from nanoeuler.model.config import Config
    from nanoeuler.model.engine import make_engine
    from nanoeuler.infer.batch import BatchGenerator, Request
    from nanoeuler.infer.generate import generate
    from nanoeuler.model.gpu import layers as gpu_layers

    cfg = Config(dim=768, n_layers=2, n_heads=12, n_kv_heads=4, hidden=2048, vocab_size=4096, context=160,
                 mtp_heads=1)  # 90 + 60 fit: no window slides alone
    # gate|up's and the head's 512 tiles of w take matmul_rows at 9 to 64 rows, the others (qkv, wo, down) the
    # split over blocks (matmul_split_t*)
    monkeypatch.setattr(gpu_layers, "MATMUL_ROWS_MIN_TILES", 512)
    monkeypatch.setattr(gpu_layers, "MATMUL_SPLIT_MIN_WEIGHTS", 1 << 19)
    eng = make_engine(cfg, device="gpu", precision=precision)
    eng.load_params(sharp_params(cfg, seed=5, scale=0.05))
    rng = np.random.default_rng(8)
    requests = []
    for i in range(64):
        prompt = tuple(int(t) for t in rng.integers(0, cfg.vocab_size, int(rng.integers(1, 91))))
        sampled = i % 3 != 0
        requests.append(Request(prompt, int(rng.integers(1, 61)), temperature=0.9 if sampled else 0.0,
                                top_k=50 if i % 3 == 1 else 0, top_p=0.9 if i % 3 == 2 else 1.0, seed=i))
    alone = [list(generate(eng, list(r.prompt_ids), r.max_new_tokens, r.temperature, r.top_k, r.top_p, seed=r.seed))
             for r in requests]
    for rows in (64, 24):
        gen = BatchGenerator(eng, rows=rows)
        seqs = [gen.add(r) for r in requests]
        while gen.busy():
            gen.step()
        assert [s.ids for s in seqs] == alone
        assert all(len(s.ids) == r.max_new_tokens for s, r in zip(seqs, requests))
        gen.close()
    assert len({tuple(a) for a in alone}) == 64


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_gpu_few_row_products_do_not_depend_on_the_physical_warps(precision, monkeypatch):
    """matmul_small's blocks run a row's virtual warps (its k-split, set by the row length) on as many physical
    warps as the product's size picks: every count gives the bits of a physical warp a virtual warp, plain and
    with the norm folded in, for rows of 1 to 4 rounds, an odd length and one not split evenly into 16."""
    import cupy
    from nanoeuler.model.gpu import layers as gpu_layers

    layers = gpu_layers.Layers(precision, batch_invariant=True)
    rng = np.random.default_rng(3)

    def dev(*shape):
        a = rng.standard_normal(shape).astype(np.float32)
        return cupy.asarray((a.view(np.uint32) >> 16).astype(np.uint16) if precision == "bf16" else a)

    for N, I, O in ((1, 2048, 264), (3, 8192, 40), (8, 1001, 72), (2, 768, 4096)):
        x, w, gain = dev(N, I), dev(O, I), dev(I)
        results = []
        for cap in ((16, 16), (8, 4), (2, 2), (1, 1)):
            monkeypatch.setattr(gpu_layers, "MATMUL_FEW_WARPS", cap)
            plain, normed = cupy.zeros((N, O), np.float32), cupy.zeros((N, O), np.float32)
            layers.matmul_forward(plain, x, w)
            layers.rmsnorm_matmul_forward(normed, cupy.zeros(N, np.float32), x, gain, w, 1e-5, None)
            results.append((plain.get(), normed.get()))
        for got in results[1:]:
            assert all(np.array_equal(a, b) for a, b in zip(results[0], got)), (N, I, O)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_gpu_products_of_many_rows_give_the_bits_of_few(precision, monkeypatch):
    """matmul_rows (9 to 64 rows, x's rows in shared memory, many tiles of w a block) in blocks of 16, 8, 4, 2, 1
    warps (and blocks walking several groups of tiles of w in turn), the tile kernels (matmul_small_t*) and the
    split over blocks (matmul_split_t*: 1, 3 and 16 virtual warps a block), give every row the bits matmul_small
    gives it in steps of at most 8 rows: plain with float32 output accumulated onto, plain with a bias, the norm
    folded in with SwiGLU, and with the rotary embedding (a position a row) and a bias; odd row counts, odd widths
    (loaded an element at a time) and rows of several rounds. Outputs start poisoned (NaN) where not accumulated
    onto, so an element left unwritten fails too."""
    import cupy
    from nanoeuler.model.gpu import layers as gpu_layers

    rng = np.random.default_rng(5)
    act = np.uint16 if precision == "bf16" else np.float32

    def dev(*shape, scale=1.0):
        a = (rng.standard_normal(shape) * scale).astype(np.float32)
        return cupy.asarray((a.view(np.uint32) >> 16).astype(np.uint16) if precision == "bf16" else a)

    def poisoned(shape, dtype):
        return cupy.full(shape, 0x7FC0 if dtype == np.uint16 else np.nan, dtype=dtype)

    S, D = 96, 64
    cos, sin = (cupy.asarray(f(rng.uniform(0, 6, (S, D // 2))).astype(np.float32)) for f in (np.cos, np.sin))
    # (what is folded in, O, I): plain f32 accumulate, plain + bias, norm + SwiGLU, norm + bias + rope
    cases = (("accumulate", 263, 1001), ("bias", 520, 2048), ("glu", 406, 776), ("glu", 2 * 203, 1001),
             ("rope", 6 * D, 4104), ("rope", 6 * D, 8192))
    for kind, O, I in cases:
        for N in (9, 17, 33, 64):
            x, w = dev(N, I), dev(O, I, scale=0.05)
            gain = dev(I) if kind in ("glu", "rope") else None
            bias = dev(O) if kind in ("bias", "rope") else None
            out_dtype = np.float32 if kind == "accumulate" else act
            prior = cupy.asarray(rng.standard_normal((N, O)).astype(np.float32))
            pos = cupy.asarray(rng.integers(0, S, N).astype(np.int32))

            def run(rows):  # out, rstd, glu_out of the rows taken in steps of `rows`
                out = prior.copy() if kind == "accumulate" else poisoned((N, O), out_dtype)
                rstd, glu = cupy.full(N, np.nan, np.float32), poisoned((N, O // 2), act)
                for r in range(0, N, rows):
                    e = min(N, r + rows)
                    rope = (cos, sin, pos[r:e], 1, 4 * D, D // 2) if kind == "rope" else None
                    gpu_layers._matmul_small(out[r:e], x[r:e], w, kind == "accumulate", gain,
                                             rstd[r:e] if gain is not None else None, 1e-5,
                                             glu[r:e] if kind == "glu" else None, rope, None, bias)
                return out.get(), rstd.get() if gain is not None else None, glu.get() if kind == "glu" else None

            few = run(8)
            as_float = few[0] if out_dtype == np.float32 else (few[0].astype(np.uint32) << 16).view(np.float32)
            assert not np.isnan(as_float).any()
            # matmul_rows in blocks of 16, 8, 4, 2 and 1 warps (a block a group of tiles of w, or 8 warps and 2
            # blocks walking all the groups), the tile kernels (matmul_small_t*), then a row's virtual warps split
            # over blocks of 1, 3 and 16 of them (matmul_split_t*, matmul_split_finish)
            for min_tiles, warps, split, blocks in ((0, 16, 0, None), (0, 8, 0, None), (0, 8, 0, 2), (0, 4, 0, None),
                                                    (0, 2, 0, None), (0, 1, 0, None), (1 << 30, None, 0, None),
                                                    (1 << 30, None, 1, None), (1 << 30, None, 3, None),
                                                    (1 << 30, None, 16, None)):
                monkeypatch.setattr(gpu_layers, "MATMUL_ROWS_MIN_TILES", min_tiles)
                monkeypatch.setattr(gpu_layers, "_rows_warps", lambda tiles_of_w, tiles: warps)
                monkeypatch.setattr(gpu_layers, "_split_group", lambda *shape: split)
                monkeypatch.setattr(gpu_layers, "_rows_blocks", lambda groups, *kernel: min(groups, blocks or groups))
                got = run(N)
                for a, b, name in zip(few, got, ("out", "rstd", "glu_out")):
                    assert a is None or np.array_equal(a.view(np.uint8), b.view(np.uint8)), (kind, O, I, N, warps,
                                                                                             split, blocks, name)
            monkeypatch.undo()


@pytest.mark.gpu
@needs_gpu
def test_gpu_without_batch_invariance_gives_the_same_greedy_tokens():
    """make_engine(batch_invariant=False): a batched step's products on cuBLAS (recorded into the step's CUDA
    graph through our own handle), its norms, SwiGLU and rotary embedding (a position a sequence) as their own
    kernels. In fp32, 24 prompts of 1 to 90 tokens decoded together give the invariant engine's greedy
    tokens, and so does one prompt alone (a few layers of base's widths, sharp logits)."""
    from nanoeuler.model.config import Config
    from nanoeuler.model.engine import make_engine
    from nanoeuler.infer.generate import generate

    cfg = Config(dim=768, n_layers=2, n_heads=12, n_kv_heads=4, hidden=2048, vocab_size=4096, context=160,
                 mtp_heads=1)
    params = sharp_params(cfg, seed=5, scale=0.05)
    rng = np.random.default_rng(9)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, int(rng.integers(1, 91)))] for _ in range(24)]
    out = {}
    for invariant in (True, False):
        eng = make_engine(cfg, device="gpu", precision="fp32", batch_invariant=invariant)
        eng.load_params(params)
        alone = list(generate(eng, prompts[3], 40, temperature=0))
        out[invariant] = (generate(eng, prompts, 40, temperature=0), alone)
    assert out[True] == out[False]
    assert len({tuple(a) for a in out[True][0]}) == 24
