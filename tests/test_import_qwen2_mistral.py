"""`import --hf` of Qwen2ForCausalLM (q/k/v biases, an embedding padded past the tokenizer) and MistralForCausalLM
(head 128, a sliding window): random models of Qwen2.5-0.5B's and Mistral-7B's configurations at 2 layers
(Mistral also narrowed to 4 heads of 128, and both with a 400-token vocabulary: Qwen2's embedding padded to 448
rows as Qwen2.5's 151,936 are for 151,665 tokens) give transformers' logits and greedy tokens; padding ids are
never generated; the window clamps the context; export --hf gives the tensors and the architecture back; sft
trains a Qwen2-shaped import. The GPU engine on q/k/v biases is at the end, marked gpu."""
import json

import numpy as np
import pytest

import nanoeuler.model.gpu
from conftest import run_cli
from nanoeuler.errors import UserError
from nanoeuler.infer.generate import generate
from nanoeuler.io import checkpoint
from nanoeuler.io.hf_import import config_from_hf, read_tensors
from nanoeuler.model.config import Config, views
from nanoeuler.model.engine import make_engine
from nanoeuler.model.optimizer import decay_mask
from test_import import SPECIALS, TEXTS, all_in_float64, hf_tokenizer

needs_gpu = pytest.mark.skipif(not nanoeuler.model.gpu.available(),
                               reason="needs a CUDA GPU (compute capability 8.0+) and cupy")
TOKENS = 400  # the tokenizer's vocabulary
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                  max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  use_sliding_window=False, sliding_window=32768, max_window_layers=24)
MISTRAL_7B = dict(hidden_size=512, intermediate_size=1792, num_attention_heads=4, num_key_value_heads=1,
                  max_position_embeddings=32768, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  sliding_window=4096)  # Mistral-7B-v0.1's but 4 heads of 128 (its 32 x 128) sharing one kv head


def save_model(folder, torch, transformers, kind, tokenizer, **settings):
    """A random Qwen2ForCausalLM or MistralForCausalLM of 2 layers, weights N(0, 1/fan_in), biases N(0, 0.5),
    norm gains N(1, 0.3), saved with its tokenizer as save_pretrained writes them."""
    config_class, model_class = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                                 "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[kind]
    torch.manual_seed(0)
    model = model_class(config_class(num_hidden_layers=2, eos_token_id=0, bos_token_id=0, **settings)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape))
            else:
                p.copy_(torch.randn(p.shape) / (p.shape[1] ** 0.5 if "embed" not in name else 1.0))
    model.save_pretrained(folder)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=SPECIALS[0]).save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def qwen2(corpus, torch, transformers, tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2")
    model = save_model(d / "hf", torch, transformers, "qwen2", hf_tokenizer(corpus, TOKENS), vocab_size=448,
                       **QWEN25_05B)
    r = run_cli("import", "--hf", d / "hf", "--out", d / "m.bin")
    assert r.returncode == 0, r.stderr
    return model, d, r


@pytest.fixture(scope="module")
def mistral(corpus, torch, transformers, tmp_path_factory):
    d = tmp_path_factory.mktemp("mistral")
    model = save_model(d / "hf", torch, transformers, "mistral", hf_tokenizer(corpus, TOKENS), vocab_size=TOKENS,
                       **MISTRAL_7B)
    r = run_cli("import", "--hf", d / "hf", "--out", d / "m.bin")
    assert r.returncode == 0, r.stderr
    return model, d, r


def in_float64(torch, model):
    """The model in float64, its RMSNorms and rotary angles too (transformers computes those in float32)."""
    model = model.to(torch.float64)
    all_in_float64(torch, model)
    return model


def compare(torch, model, d, dtype, tolerance):
    ck = checkpoint.load(d / "m.bin")
    eng, tok = make_engine(ck.cfg, dtype=dtype), ck.tokenizer()
    eng.load_params(ck.params)
    ids = np.array([tok.encode(TEXTS[0] * 3)[:48]], dtype=np.int32)
    model = in_float64(torch, model) if dtype == np.float64 else model.to(torch.float32)
    with torch.no_grad():
        theirs = model(torch.from_numpy(ids).long()).logits.numpy()
    assert np.linalg.norm(eng.logits(ids) - theirs) / np.linalg.norm(theirs) < tolerance
    with torch.no_grad():  # transformers' greedy with the padding ids suppressed, as ours never produces them
        hf_ids = model.generate(torch.from_numpy(ids[:, :8]).long(), max_new_tokens=10, do_sample=False,
                                eos_token_id=None, pad_token_id=0,
                                suppress_tokens=list(range(TOKENS, ck.cfg.vocab_size)) or None)[0, 8:].tolist()
    assert hf_ids == list(generate(eng, ids[0, :8], 10, temperature=0))


FLOATS = pytest.mark.parametrize("dtype, tolerance", [(np.float64, 1e-7), (np.float32, 1e-5)])


@FLOATS
def test_qwen2_logits_and_greedy_match_transformers(qwen2, torch, dtype, tolerance):
    model, d, _ = qwen2
    compare(torch, model, d, dtype, tolerance)


@FLOATS
def test_mistral_logits_and_greedy_match_transformers(mistral, torch, dtype, tolerance):
    model, d, _ = mistral
    compare(torch, model, d, dtype, tolerance)


def test_qwen2_config_biases_and_padding(qwen2):
    model, d, r = qwen2
    cfg = checkpoint.load(d / "m.bin").cfg
    assert (cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden, cfg.rope_theta, cfg.norm_eps) == \
        (896, 14, 2, 64, 4864, 1e6, 1e-6)
    assert cfg.qkv_bias and cfg.tied and cfg.architecture == "Qwen2ForCausalLM" and cfg.sliding_window is None
    assert (cfg.vocab_size, cfg.tokenizer_vocab, cfg.context) == (448, TOKENS, 32768)
    assert "q/k/v biases" in r.stdout and "ids 400..447 are padding" in r.stdout
    mask, layout = decay_mask(cfg), views(np.arange(decay_mask(cfg).size), cfg)
    for name in ("bq", "bk", "bv"):
        assert not mask[layout[f"layers.1.{name}"]].any()  # biases do not decay
    assert mask[layout["layers.1.wq"]].all()


def test_padding_ids_are_never_generated(qwen2):
    """Padding rows made to win every argmax: greedy and sampled decoding still produce tokenizer ids only."""
    _, d, _ = qwen2
    ck = checkpoint.load(d / "m.bin")
    params = ck.params.copy()
    emb = views(params, ck.cfg)["tok_emb"]
    emb[TOKENS:] = 100 * np.random.default_rng(0).normal(size=emb[TOKENS:].shape)
    eng = make_engine(ck.cfg)
    eng.load_params(params)
    prompt = np.array(ck.tokenizer().encode(TEXTS[0])[:8], dtype=np.int32)
    assert (eng.logits(prompt[None]).argmax(-1) >= TOKENS).all()  # unmasked, padding would win
    for temperature in (0, 1.0):
        ids = list(generate(eng, prompt, 12, temperature=temperature, seed=1))
        assert len(ids) == 12 and max(ids) < TOKENS, ids


def test_mistral_window_clamps_the_context(mistral):
    _, d, r = mistral
    cfg = checkpoint.load(d / "m.bin").cfg
    assert cfg.head_dim == 128 and not cfg.qkv_bias and not cfg.tied and cfg.architecture == "MistralForCausalLM"
    assert (cfg.context, cfg.sliding_window, cfg.tokenizer_vocab) == (4096, 4096, None)
    assert "clamped to the sliding window, 4096" in r.stderr
    r = run_cli("import", "--hf", d / "hf", "--out", d / "big.bin", "--context", 8192)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "sliding window (4096 positions)" in r.stderr
    r = run_cli("import", "--hf", d / "hf", "--out", d / "short.bin", "--context", 256)
    assert r.returncode == 0 and checkpoint.load(d / "short.bin").cfg.context == 256, r.stderr


def test_config_from_hf_architectures():
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=100, max_position_embeddings=512)
    mistral = config_from_hf({**base, "architectures": ["MistralForCausalLM"], "sliding_window": None})
    assert mistral.context == 512 and mistral.sliding_window is None  # null: no window
    qwen = config_from_hf({**base, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 128})
    assert qwen.qkv_bias and qwen.context == 128 and qwen.sliding_window == 128
    llama = config_from_hf({**base, "architectures": ["LlamaForCausalLM"], "sliding_window": 128})
    assert llama.context == 512 and not llama.qkv_bias and llama.architecture == "LlamaForCausalLM"
    for hf, needle in [({**base, "architectures": ["GPT2LMHeadModel"]}, "is not one of"),
                       ({**base, "architectures": ["LlamaForCausalLM"], "attention_bias": True}, "q, k and v only")]:
        with pytest.raises(UserError, match=needle):
            config_from_hf(hf)
    assert json.loads(Config().to_json()) == json.loads(Config(qkv_bias=False).to_json())
    assert not {"qkv_bias", "sliding_window", "tokenizer_vocab", "architecture"} & set(json.loads(Config().to_json()))


def test_a_bias_elsewhere_is_refused(qwen2, tmp_path):
    _, d, _ = qwen2
    import shutil
    from safetensors.numpy import save_file
    hf = tmp_path / "hf"
    shutil.copytree(d / "hf", hf)
    tensors = read_tensors(hf)
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(896, np.float32)
    save_file(tensors, hf / "model.safetensors")
    r = run_cli("import", "--hf", hf, "--out", tmp_path / "m.bin")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "o_proj.bias has no place" in r.stderr, r.stderr


@pytest.mark.parametrize("which", ["qwen2", "mistral"])
def test_export_gives_back_the_tensors_and_architecture(which, request, torch, transformers, tmp_path):
    model, d, _ = request.getfixturevalue(which)
    r = run_cli("export", "--hf", tmp_path / "back", "--ckpt", d / "m.bin")
    assert r.returncode == 0, r.stderr
    original, back = read_tensors(d / "hf"), read_tensors(tmp_path / "back")
    original.pop("lm_head.weight", None) if which == "qwen2" else None
    assert sorted(original) == sorted(back)
    for name in original:
        assert np.array_equal(original[name], back[name]), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(again) is type(model)
    ids = torch.arange(1, 30)[None]
    with torch.no_grad():
        assert torch.allclose(again(ids).logits, model.to(torch.float32)(ids).logits, atol=1e-4)
    if which == "qwen2":  # llama.cpp's qwen2 architecture, the biases f32 (tests/test_gguf_llamacpp.py runs it)
        from nanoeuler.io.gguf import read_params
        r = run_cli("export", "--gguf", tmp_path / "m.gguf", "--ckpt", d / "m.bin", "--type", "f32")
        assert r.returncode == 0 and "architecture qwen2" in r.stdout, r.stderr
        ck = checkpoint.load(d / "m.bin")
        assert np.array_equal(read_params(tmp_path / "m.gguf", ck.cfg, ck.params), ck.params)


def test_sft_on_a_qwen2_shaped_import(corpus, torch, transformers, tmp_path):
    """A narrow Qwen2 (biases, tied, a padded embedding) fine-tunes on the CPU with its loss falling."""
    save_model(tmp_path / "hf", torch, transformers, "qwen2", hf_tokenizer(corpus, TOKENS), vocab_size=448,
               hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, tie_word_embeddings=True)
    r = run_cli("import", "--hf", tmp_path / "hf", "--out", tmp_path / "m.bin")
    assert r.returncode == 0, r.stderr
    examples = [{"instruction": f"Say {w}.", "input": "", "output": w} for w in ("yes", "no", "maybe", "never") * 8]
    (tmp_path / "sft.json").write_text(json.dumps(examples))
    r = run_cli("sft", "--ckpt", tmp_path / "m.bin", "--data", tmp_path / "sft.json", "--out", tmp_path / "c.bin",
                "--steps", 8, "--batch-size", 8, "--lr", 3e-3, "--device", "cpu", "--eval-every", 8,
                "--sample-every", 8, "--val-examples", 4, "--log", tmp_path / "log.jsonl")
    assert r.returncode == 0, r.stderr
    losses = [json.loads(line)["loss"] for line in (tmp_path / "log.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert losses[-1] < losses[0], losses
    before, after = checkpoint.load(tmp_path / "m.bin"), checkpoint.load(tmp_path / "c.bin")
    assert after.cfg == before.cfg and after.cfg.qkv_bias
    moved = [not np.array_equal(views(before.params, before.cfg)[f"layers.0.{n}"],
                                views(after.params, after.cfg)[f"layers.0.{n}"]) for n in ("bq", "bk", "bv")]
    assert all(moved)


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@needs_gpu
def test_gpu_engine_with_biases_matches_the_cpu_engine():
    """fp32 GPU engine against the CPU engine on a tied model with q/k/v biases and padding ids: logits,
    gradients (the biases' included), and greedy decoding through the fused few-row product."""
    from nanoeuler.check.problems import random_problem
    from nanoeuler.model.losses import cross_entropy_backward
    cfg = Config(dim=128, n_layers=2, n_heads=2, n_kv_heads=1, hidden=128, vocab_size=96, context=64, mtp_heads=1,
                 tied=True, qkv_bias=True, tokenizer_vocab=80)
    flat, inputs, targets = random_problem(cfg, np.random.default_rng(3), scale=0.05)
    engines = [make_engine(cfg, device=device, precision="fp32") for device in ("cpu", "gpu")]
    grads = []
    for eng in engines:
        eng.load_params(flat.astype(np.float32))
        cross_entropy_backward(eng, inputs, targets)
        grads.append(np.asarray(eng.grads.get() if hasattr(eng.grads, "get") else eng.grads))
    cpu, gpu = (eng.logits(inputs) for eng in engines)
    assert np.abs(gpu - cpu).max() < 1e-4 * np.abs(cpu).max()
    for name in ("layers.0.bq", "layers.1.bk", "layers.1.bv", "layers.0.wq"):
        a, b = views(grads[0], cfg)[name], views(grads[1], cfg)[name]
        assert np.abs(a - b).max() < 1e-3 * np.abs(a).max(), name
    prompt = inputs[0, :8]
    greedy = [list(generate(eng, prompt, 16, temperature=0)) for eng in engines]
    assert greedy[0] == greedy[1] and max(greedy[0]) < 80
