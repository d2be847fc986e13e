"""Tied embeddings (config `tied`: head 0 is `tok_emb`, one tensor): the layout without `heads.0`, the engine's
gradient of the one tensor (the head's product's plus the embedding's scatter-add), AdamW and data parallelism
over it, checkpoints, `import --hf` (which models are tied, as transformers decides it), `export --hf` and
`export --gguf`, and the commands on a tied model, on the CPU. The GPU engine against the CPU engine on a tied
model is at the end, marked gpu."""
import dataclasses
import json
import re

import numpy as np
import pytest
from safetensors import safe_open

import nanoeuler.model.gpu
from conftest import run_cli, sharp_params
from nanoeuler.check.gradients import CHECK_CONFIGS
from nanoeuler.check.problems import random_problem
from nanoeuler.io import checkpoint
from nanoeuler.io.hf_import import TIE_DEFAULTS, read_tensors, tied_embeddings
from nanoeuler.model.config import Config, flops_per_token, init_params, param_count, param_layout, views
from nanoeuler.model.engine import make_engine
from nanoeuler.model.losses import cross_entropy_backward
from nanoeuler.model.optimizer import AdamW, decay_mask

needs_gpu = pytest.mark.skipif(not nanoeuler.model.gpu.available(),
                               reason="needs a CUDA GPU (compute capability 8.0+) and cupy")


def tied_config(vocab_size=300, gpu=False):
    """A tiny tied model; gpu: heads of 32, the narrowest the GPU attention kernels take."""
    heads = dict(dim=64, n_heads=2, n_kv_heads=1) if gpu else dict(dim=32, n_heads=4, n_kv_heads=2)
    return Config(**heads, n_layers=2, hidden=64, vocab_size=vocab_size, context=32, mtp_heads=1, tied=True)


def untied_twin(cfg, flat):
    """The untied model (config and flat parameters) computing what the tied one does: heads.0 a copy of
    tok_emb."""
    untied = dataclasses.replace(cfg, tied=False)
    out = np.empty(param_count(untied), dtype=np.asarray(flat).dtype)
    mine, theirs = views(flat, cfg), views(out, untied)
    for name, view in mine.items():
        theirs[name][...] = view
    theirs["heads.0"][...] = mine["tok_emb"]
    return untied, out


# ------------------------------------------------------------------------------------------ the layout
def test_the_layout_has_no_head_0_and_the_config_says_tied_only_when_it_is():
    cfg = tied_config()
    untied = dataclasses.replace(cfg, tied=False)
    layout, total = param_layout(cfg)
    assert "heads.0" not in layout and "heads.0" in param_layout(untied)[0]
    assert total == param_count(untied) - cfg.vocab_size * cfg.dim
    assert flops_per_token(cfg) == flops_per_token(untied)  # the head's product is computed all the same
    assert json.loads(cfg.to_json())["tied"] is True and "tied" not in json.loads(untied.to_json())
    assert Config.from_json(untied.to_json()) == untied and Config.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="tied embeddings take one prediction head"):
        dataclasses.replace(cfg, mtp_heads=2)
    mask, untied_mask = decay_mask(cfg), decay_mask(untied)  # tok_emb decays, once
    head = param_layout(untied)[0]["heads.0"][0]
    assert np.array_equal(mask, untied_mask[:head]) and mask[:cfg.vocab_size * cfg.dim].all()


def test_the_engines_head_is_the_embeddings_memory():
    eng = make_engine(tied_config())
    for buffers in (eng.p, eng.g):
        assert np.shares_memory(buffers["heads"], buffers["tok_emb"])
        assert buffers["heads"].shape == buffers["heads.0"].shape == buffers["tok_emb"].shape
    assert eng.gradient_offsets()[-1] == 0 and eng.gradient_offsets()[0] == param_layout(eng.cfg)[0]["final_norm"][0]


# ----------------------------------------------------------------------------------------- gradients
def test_nanoeuler_check_covers_a_tied_model():
    assert any(cfg.tied for cfg in CHECK_CONFIGS)  # test_engine runs the gradient check on each of them


@pytest.mark.parametrize("accumulate", [False, True], ids=["one-pass", "two-passes"])
def test_the_tied_gradient_is_the_embeddings_plus_the_heads(accumulate):
    """With equal values in tok_emb and heads.0, the untied model computes the same function: the tied model's
    loss is its loss, its tok_emb gradient the sum of the untied tok_emb and heads.0 gradients, every other
    gradient the same (float64). Two accumulated passes add up, so neither product overwrites the other's."""
    cfg = tied_config()
    flat, inputs, targets = random_problem(cfg, np.random.default_rng(4), batch=4)
    untied, untied_flat = untied_twin(cfg, flat)
    losses = []
    for c, f in ((cfg, flat), (untied, untied_flat)):
        eng = make_engine(c, dtype=np.float64)
        eng.load_params(f)
        if accumulate:  # the whole batch's counts: the two halves' losses and gradients add up to the batch's
            counts = (targets >= 0).reshape(1, -1).sum(axis=1).astype(np.float64)
            first = cross_entropy_backward(eng, inputs[:2], targets[:, :2], counts=counts, final=False)
            second = cross_entropy_backward(eng, inputs[2:], targets[:, 2:], counts=counts, accumulate=True)
            losses.append(np.add(first, second))
        else:
            losses.append(cross_entropy_backward(eng, inputs, targets))
        if c.tied:
            tied_grads = views(eng.grads.copy(), c)
        else:
            untied_grads = views(eng.grads.copy(), c)
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-13)
    expected = untied_grads["tok_emb"] + untied_grads["heads.0"]
    for part in ("tok_emb", "heads.0"):  # either product alone (an overwrite) would not pass
        assert not np.allclose(expected, untied_grads[part], rtol=1e-3), part
    np.testing.assert_allclose(tied_grads["tok_emb"], expected, rtol=1e-11, atol=1e-15)
    for name, grad in tied_grads.items():
        if name != "tok_emb":
            np.testing.assert_allclose(grad, untied_grads[name], rtol=1e-11, atol=1e-15, err_msg=name)


def test_adamw_decays_the_tied_tensor_once():
    """One AdamW step of a tied model is the formula with the tied gradient and one weight decay of tok_emb."""
    cfg = tied_config()
    flat, inputs, targets = random_problem(cfg, np.random.default_rng(6))
    eng = make_engine(cfg, dtype=np.float64)
    eng.load_params(flat)
    cross_entropy_backward(eng, inputs, targets)
    p0, g = eng.params.copy(), eng.grads.copy()
    AdamW(eng).step(eng, lr=1e-2, weight_decay=0.1, grad_clip=0.0)
    update = g / (np.abs(g) + 1e-8)  # the first step's m / sqrt(v), bias-corrected
    decay = decay_mask(cfg).astype(np.float64)
    np.testing.assert_allclose(eng.params, p0 - 1e-2 * (update + 0.1 * decay * p0), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("zero", [False, True], ids=["replicated", "zero1"])
def test_two_ranks_train_a_tied_model_like_one_rank_at_twice_the_batch(zero):
    """The bucket plan's gradient offsets hold for a tied model: the head's gradient lands in tok_emb, which is
    final only at the end of the backward pass, and is reduced with the embedding's."""
    from nanoeuler.data.corpus import RandomWindows
    from nanoeuler.train.distributed import DataParallel
    from nanoeuler.train.loop import Hyperparameters
    from nanoeuler.train.objectives import CrossEntropy
    from test_distributed import _run_ranks

    def steps(batch, comm=None):
        cfg = tied_config()
        eng = make_engine(cfg, seed=1)
        rank, world = (comm.rank, comm.world_size) if comm else (0, 1)
        source = RandomWindows(np.random.default_rng(0).integers(0, 300, 20000), batch, cfg.context, 1, seed=7,
                               rank=rank, world_size=world)
        hp = Hyperparameters(steps=3, batch_size=batch, lr=3e-3, warmup=1, eval_every=9, sample_every=9,
                             ckpt_every=9)
        parallel = DataParallel(eng, AdamW(eng), comm, zero=zero, min_bucket=0)  # a bucket a layer
        objective = CrossEntropy(parallel.comm)
        losses = []
        for _ in range(3):
            shares, tokens = objective.train_step(eng, source.next(), hp)
            losses.append(parallel.step(3e-3, hp.weight_decay, hp.grad_clip, [shares["loss"]])[1][0])
        return losses, parallel.params_numpy()

    ref_losses, ref_params = steps(8)
    for losses, params in _run_ranks(2, lambda comm: steps(4, comm)):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        np.testing.assert_allclose(params, ref_params, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def tied_ckpt(tokenizer, tmp_path_factory):
    """A tied checkpoint with weights far from init (a wrong mapping shows) and its parameters."""
    cfg = tied_config(tokenizer.vocab_size)
    flat = sharp_params(cfg, seed=2, scale=0.3)
    path = tmp_path_factory.mktemp("tied") / "tied.bin"
    checkpoint.save(path, cfg, flat, tokenizer.to_json(), step=0)
    return cfg, flat, path


def tensor_names(path):
    with safe_open(path, framework="numpy") as f:
        return set(f.keys()), json.loads(f.metadata()["config"])


def test_the_checkpoint_stores_the_tied_tensor_once(tied_ckpt, tmp_path):
    cfg, flat, path = tied_ckpt
    names, config = tensor_names(path)
    assert config["tied"] is True and "tok_emb" in names and not any(n.startswith("heads.") for n in names)
    opt = (np.arange(flat.size, dtype=np.float32), np.ones(flat.size, dtype=np.float32))
    checkpoint.save(tmp_path / "o.bin", cfg, flat, checkpoint.load(path).tokenizer_json, 3, opt=opt)
    names, _ = tensor_names(tmp_path / "o.bin")
    assert "opt.m.tok_emb" in names and not any(".heads." in n for n in names)
    ck = checkpoint.load(tmp_path / "o.bin", with_opt=True)
    assert ck.cfg == cfg and np.array_equal(ck.params, flat) and np.array_equal(ck.opt[0], opt[0])


def test_a_file_that_disagrees_with_its_tying_is_a_one_line_error(tied_ckpt, tmp_path):
    """A tied config beside a heads.0 tensor, or an untied one without it, does not load."""
    from safetensors.numpy import save_file
    cfg, flat, path = tied_ckpt
    with safe_open(path, framework="numpy") as f:
        meta, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    save_file({**tensors, "heads.0": tensors["tok_emb"]}, tmp_path / "extra.bin", metadata=meta)
    r = run_cli("infer", "x", "--ckpt", tmp_path / "extra.bin", "--device", "cpu")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "heads.0 does not belong" in r.stderr, r.stderr
    untied = dict(meta, config=dataclasses.replace(cfg, tied=False).to_json())
    save_file(tensors, tmp_path / "missing.bin", metadata=untied)
    r = run_cli("infer", "x", "--ckpt", tmp_path / "missing.bin", "--device", "cpu")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no tensor heads.0" in r.stderr, r.stderr


# ------------------------------------------------------------------------------------- the commands
def test_infer_eval_train_and_resume_on_a_tied_model(tied_ckpt, corpus, tmp_path):
    """Sampling, bits per byte, continued pretraining and its resume keep the model tied (sft of a tied import:
    test_import.test_imported_model_trains_on)."""
    cfg, flat, path = tied_ckpt
    r = run_cli("infer", "ROMEO:", "--ckpt", path, "--max-new-tokens", 6, "--temperature", 0, "--device", "cpu")
    assert r.returncode == 0, r.stderr
    r = run_cli("eval", "--task", "bpb", "--data", corpus, "--ckpt", path, "--json", tmp_path / "b.json",
                "--batch-size", 4, "--limit", 2, "--device", "cpu")
    assert r.returncode == 0 and json.loads((tmp_path / "b.json").read_text())["bpb"] > 0, r.stderr
    run = ("--data", corpus, "--out", tmp_path / "more.bin", "--batch-size", 2, "--lr", 1e-3, "--device", "cpu",
           "--eval-every", 2, "--sample-every", 4, "--ckpt-every", 2)
    r = run_cli("train", "--ckpt", path, "--steps", 2, *run)
    assert r.returncode == 0, r.stderr
    assert "tied to the embedding" in r.stdout and f"{param_count(cfg) / 1e6:.2f}M parameters" in r.stdout
    r = run_cli("train", "--resume", "--steps", 4, *run)
    assert r.returncode == 0, r.stderr
    ck = checkpoint.load(tmp_path / "more.bin", with_opt=True)
    assert ck.cfg == cfg and ck.step == 4 and not np.array_equal(ck.params, flat)
    names, _ = tensor_names(tmp_path / "more.bin")
    assert not any("heads" in n for n in names)


# -------------------------------------------------------------------------------------- Hugging Face
def test_which_imports_are_tied_is_what_transformers_loads(transformers):
    """config.json's tie_word_embeddings, else the architecture's default; a tied config whose lm_head.weight
    differs loads untied, an untied one without lm_head.weight ties (with a note each)."""
    for model_type, default in TIE_DEFAULTS.items():
        assert transformers.AutoConfig.for_model(model_type).tie_word_embeddings == default, model_type
    emb = np.arange(12.0).reshape(4, 3)
    with_head = {"model.embed_tokens.weight": emb, "lm_head.weight": emb + 1}
    copy_head = {"model.embed_tokens.weight": emb, "lm_head.weight": emb.copy()}
    no_head = {"model.embed_tokens.weight": emb}
    llama = {"model_type": "llama"}
    cases = [({**llama, "tie_word_embeddings": True}, no_head, True, None),
             ({**llama, "tie_word_embeddings": True}, copy_head, True, None),
             ({**llama, "tie_word_embeddings": True}, with_head, False, "differs"),
             ({**llama, "tie_word_embeddings": False}, with_head, False, None),
             ({**llama, "tie_word_embeddings": False}, no_head, True, "no lm_head.weight"),
             (llama, with_head, False, None),  # LlamaConfig's default: untied
             (llama, no_head, True, "no tie_word_embeddings")]
    for hf, tensors, tied, note in cases:
        got, said = tied_embeddings(hf, tensors)
        assert got == tied and (said is None if note is None else note in said), (hf, sorted(tensors), said)


@pytest.fixture(scope="module")
def hf_tied(corpus, torch, transformers, tmp_path_factory):
    """A tied LlamaForCausalLM saved by transformers, and its import."""
    from test_import import hf_tokenizer, save_llama
    d = tmp_path_factory.mktemp("hf_tied")
    model = save_llama(d / "hf", torch, transformers, hf_tokenizer(corpus, 300), tie_word_embeddings=True)
    r = run_cli("import", "--hf", d / "hf", "--out", d / "m.bin")
    assert r.returncode == 0, r.stderr
    return model, d, r.stdout


def test_a_tied_import_stays_tied_and_counts_its_parameters_once(hf_tied):
    model, d, stdout = hf_tied
    ck = checkpoint.load(d / "m.bin")
    assert ck.cfg.tied and ck.cfg.mtp_heads == 1
    assert sum(p.numel() for p in model.parameters()) == param_count(ck.cfg)  # transformers counts it once too
    printed = float(re.search(r"([0-9.]+)M parameters \(embedding tied", stdout).group(1))
    assert printed == round(param_count(ck.cfg) / 1e6, 2)
    names, _ = tensor_names(d / "m.bin")
    assert "heads.0" not in names
    state = {k: t.float().numpy() for k, t in model.state_dict().items()}
    assert np.array_equal(views(ck.params, ck.cfg)["tok_emb"], state["model.embed_tokens.weight"])


def test_a_tied_config_with_a_different_lm_head_imports_untied(hf_tied, tmp_path):
    from safetensors.numpy import save_file
    _, d, _ = hf_tied
    (tmp_path / "hf").mkdir()
    for f in (d / "hf").iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    tensors = read_tensors(d / "hf")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] * 2
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    r = run_cli("import", "--hf", tmp_path / "hf", "--out", tmp_path / "m.bin")
    assert r.returncode == 0 and "differs" in r.stderr, r.stderr
    ck = checkpoint.load(tmp_path / "m.bin")
    assert not ck.cfg.tied and np.array_equal(views(ck.params, ck.cfg)["heads.0"], tensors["lm_head.weight"])


def test_export_writes_a_tied_model_that_transformers_ties_and_that_imports_back(tied_ckpt, tokenizer, torch,
                                                                                  transformers, tmp_path):
    cfg, flat, path = tied_ckpt
    r = run_cli("export", "--hf", tmp_path / "hf", "--ckpt", path)
    assert r.returncode == 0 and "tied" in r.stdout, r.stderr
    assert "lm_head.weight" not in read_tensors(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is True
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    eng = make_engine(cfg)
    eng.load_params(flat)
    ids = np.array([tokenizer.encode("ROMEO: But soft, what light through yonder window breaks?")[:cfg.context]],
                   dtype=np.int32)
    with torch.no_grad():
        theirs = model(torch.from_numpy(ids).long()).logits.numpy()
    assert np.linalg.norm(eng.logits(ids) - theirs) / np.linalg.norm(theirs) < 1e-5
    r = run_cli("import", "--hf", tmp_path / "hf", "--out", tmp_path / "back.bin")
    assert r.returncode == 0 and "lm_head" not in r.stderr, r.stderr
    back = checkpoint.load(tmp_path / "back.bin")
    assert back.cfg.tied and np.array_equal(back.params, flat)


def test_gguf_of_a_tied_model_has_no_output_tensor(tied_ckpt, tmp_path):
    """llama.cpp takes token_embd as the output where output.weight is missing, as for tied Llamas."""
    gguf = pytest.importorskip("gguf")
    from nanoeuler.io.gguf import read_params
    cfg, flat, path = tied_ckpt
    r = run_cli("export", "--gguf", tmp_path / "m.gguf", "--ckpt", path, "--type", "f32")
    assert r.returncode == 0, r.stderr
    names = {t.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert "token_embd.weight" in names and "output.weight" not in names and "output_norm.weight" in names
    assert np.array_equal(read_params(tmp_path / "m.gguf", cfg, flat), flat)


# -------------------------------------------------------------------------------------- the GPU engine
@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_gpu_tied_model_matches_the_cpu_engine(precision):
    """nanoeuler check --gpu's model check on its tied model: every gradient, the loss, the decode logits and
    argmax against the CPU engine (float64), and a second backward pass bit-identical."""
    from nanoeuler.check.gpu import BF16_MODEL_TOL, FP32_TOL, TF32_TOL, TIED_CONFIG, model_check
    errors = model_check(seed=5, precision=precision, report=lambda line: None, cfg=TIED_CONFIG)
    assert "tok_emb" in errors and "heads.0" not in errors
    worst = max(errors, key=errors.get)
    assert errors[worst] < {"fp32": FP32_TOL, "tf32": TF32_TOL, "bf16": BF16_MODEL_TOL}[precision], (worst, errors)
    assert errors["determinism"] == 0.0


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_tied_gradient_is_the_embeddings_plus_the_heads(precision):
    """On the GPU too (in bf16 through the compute copy, whose head 0 is its embedding), the tied model's tok_emb
    gradient is the untied twin's tok_emb + heads.0 gradients, the others the same."""
    cfg = tied_config(gpu=True)
    flat, inputs, targets = random_problem(cfg, np.random.default_rng(4), batch=4, scale=0.05)
    flat = flat.astype(np.float32)
    untied, untied_flat = untied_twin(cfg, flat)
    grads = {}
    for c, f in ((cfg, flat), (untied, untied_flat)):
        eng = make_engine(c, device="gpu", precision=precision)
        eng.load_params(f)
        if c.tied:
            assert eng.p["heads"].data.ptr == eng.p["tok_emb"].data.ptr
            assert eng.g["heads"].data.ptr == eng.g["tok_emb"].data.ptr
        cross_entropy_backward(eng, inputs, targets)
        grads[c.tied] = views(eng.grads.get().astype(np.float64), c)
    tol = 1e-5 if precision == "fp32" else 2e-2
    expected = grads[False]["tok_emb"] + grads[False]["heads.0"]
    assert np.linalg.norm(grads[True]["tok_emb"] - expected) <= tol * np.linalg.norm(expected)
    for name, grad in grads[True].items():
        if name != "tok_emb":
            assert np.linalg.norm(grad - grads[False][name]) <= tol * np.linalg.norm(grads[False][name]), name


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision,tol", [("tf32", 2e-3), ("bf16", 2e-2)])
def test_gpu_tied_training_steps_agree_across_engines(precision, tol):
    """AdamW steps of a tied model (its one tensor decayed once, the bf16 compute copy rewritten in the same
    pass) track the CPU engine's."""
    from nanoeuler.check.gpu import TIED_CONFIG
    rng = np.random.default_rng(8)
    cpu, gpu = make_engine(TIED_CONFIG, device="cpu"), make_engine(TIED_CONFIG, device="gpu", precision=precision)
    gpu.load_params(init_params(TIED_CONFIG, seed=0))
    cpu.load_params(init_params(TIED_CONFIG, seed=0))
    optimizers = {cpu: AdamW(cpu), gpu: AdamW(gpu)}
    for step in range(4):
        _, inputs, targets = random_problem(TIED_CONFIG, rng, batch=4)
        losses = []
        for eng, opt in optimizers.items():
            losses.append(cross_entropy_backward(eng, inputs, targets)[0])
            opt.step(eng, lr=3e-3, weight_decay=0.1, grad_clip=1.0)
        assert abs(losses[1] - losses[0]) < tol * losses[0], (step, losses)
    assert gpu.p["heads"].data.ptr == gpu.p["tok_emb"].data.ptr  # the compute copy's head is still the embedding
