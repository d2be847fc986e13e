"""Llama 3's RoPE scaling ("llama3": Llama 3.1 and 3.2): a random LlamaForCausalLM of Llama-3.2-1B's head size, theta
and rope_scaling dict (two layers, hidden 256, 4/2 heads, untied, a small vocabulary) imports, computes the logits
transformers computes over 200 positions and exports back. original_max_position_embeddings is 64 (Llama's is
8192) so that 200 positions reach all three bands: of the 32 frequencies, wavelengths under 64 / high_freq_factor
= 16 are kept (3), over 64 / low_freq_factor = 64 divided by factor (26), those between interpolated (3)."""
import dataclasses
import json
import math

import numpy as np
import pytest

from conftest import run_cli
from nanoeuler.infer.generate import generate
from nanoeuler.io import checkpoint
from nanoeuler.io.hf_import import read_tensors
from nanoeuler.model.config import PRESETS, Config, rope_inv_freq, rope_tables
from nanoeuler.model.engine import make_engine
from test_import import SPECIALS, all_in_float64, hf_tokenizer

SCALING = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 64,
           "rope_type": "llama3"}
THETA, D, T = 500000.0, 64, 200


@pytest.fixture(scope="module")
def imported(corpus, torch, transformers, tmp_path_factory):
    d = tmp_path_factory.mktemp("llama3")
    tokenizer = hf_tokenizer(corpus, 400)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=D, max_position_embeddings=256, rope_theta=THETA,
        rope_scaling=dict(SCALING), rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=0, bos_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # far from the initialisation (N(0, 0.02)) so that a wrong rotation shows
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape) * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))
    model.save_pretrained(d / "hf")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=SPECIALS[0]).save_pretrained(d / "hf")
    r = run_cli("import", "--hf", d / "hf", "--out", d / "m.bin")
    assert r.returncode == 0, r.stderr
    assert "llama3 scaling x32 beyond 64 positions" in r.stdout, r.stdout
    return model, d


def test_inverse_frequencies_are_transformers(transformers, torch):
    """Our float64 frequencies against transformers' own _compute_llama3_parameters (float32) and the bands."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=D, rope_theta=THETA,
                                      rope_scaling=dict(SCALING), max_position_embeddings=256)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = rope_inv_freq(D, THETA, SCALING)
    assert np.allclose(ours, theirs.double().numpy(), rtol=1e-6, atol=0)
    plain = rope_inv_freq(D, THETA)
    ratio = plain / ours
    wavelen = 2 * math.pi / plain
    kept, divided = wavelen < 16, wavelen > 64
    assert (kept.sum(), divided.sum(), (~kept & ~divided).sum()) == (3, 26, 3)
    assert np.all(ratio[kept] == 1) and np.allclose(ratio[divided], 32)
    assert np.all((ratio[~kept & ~divided] > 1) & (ratio[~kept & ~divided] < 32))
    # default and absent are the unscaled tables, bit for bit
    assert all(np.array_equal(a, b) for a, b in zip(rope_tables(D, 8, THETA, np.float64, {"rope_type": "default"}),
                                                    rope_tables(D, 8, THETA, np.float64)))


def test_config_keeps_the_dict_and_our_json_is_unchanged(imported):
    _, d = imported
    cfg = checkpoint.load(d / "m.bin").cfg
    assert cfg.rope_scaling == SCALING and cfg.rope_theta == THETA and cfg.head_dim == D
    assert Config.from_json(cfg.to_json()) == cfg
    assert "rope_scaling" not in PRESETS["small"].to_json()
    with pytest.raises(ValueError, match="'linear'"):
        Config(rope_scaling={"rope_type": "linear", "factor": 2.0})


@pytest.mark.parametrize("dtype, tolerance", [(np.float64, 1e-6), (np.float32, 1e-4)])
def test_logits_and_greedy_match_transformers(imported, corpus, torch, transformers, dtype, tolerance):
    """float64: transformers made float64 throughout (test_import.all_in_float64, with our llama3 frequencies, checked against
    transformers' in test_inverse_frequencies_are_transformers); float32: transformers as it is, its own llama3
    rotary module. Errors relative to the largest logit (the engine's logits come back as float32)."""
    model, d = imported
    ck = checkpoint.load(d / "m.bin")
    eng, tok = make_engine(ck.cfg, dtype=dtype), ck.tokenizer()
    eng.load_params(ck.params)
    ids = np.array([tok.encode(corpus.read_bytes()[:4000].decode("utf-8", "replace"))[:T]], dtype=np.int32)
    assert ids.shape == (1, T)
    model = transformers.LlamaForCausalLM.from_pretrained(d / "hf", torch_dtype=torch.float32).eval()
    if dtype == np.float64:
        model = model.double()
        all_in_float64(torch, model, torch.from_numpy(rope_inv_freq(D, THETA, SCALING)))
    with torch.no_grad():
        theirs = model(torch.from_numpy(ids).long()).logits.double().numpy()
    ours = eng.logits(ids).astype(np.float64)
    err = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"{np.dtype(dtype).name}: max abs error {np.abs(ours - theirs).max():.3g}, relative to the largest logit "
          f"{err:.3g}, norm-relative {np.linalg.norm(ours - theirs) / np.linalg.norm(theirs):.3g}")
    assert err < tolerance
    # without the scaling the late positions differ: the test sees the rotation
    plain = make_engine(dataclasses.replace(ck.cfg, rope_scaling=None), dtype=dtype)
    plain.load_params(ck.params)
    assert np.abs(plain.logits(ids)[0, 100:] - theirs[0, 100:]).max() / np.abs(theirs).max() > 100 * tolerance
    prompt = ids[:, :180]  # decoding far past original_max_position_embeddings
    with torch.no_grad():
        hf_ids = model.generate(torch.from_numpy(prompt).long(), max_new_tokens=16, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, prompt.shape[1]:].tolist()
    assert hf_ids == list(generate(eng, prompt[0], 16, temperature=0))


def test_export_gives_back_the_scaling_and_the_tensors(imported, transformers):
    _, d = imported
    r = run_cli("export", "--hf", d / "back", "--ckpt", d / "m.bin")
    assert r.returncode == 0, r.stderr
    config = json.loads((d / "back" / "config.json").read_text())
    assert config["rope_scaling"] == SCALING and config["rope_theta"] == THETA
    original, back = read_tensors(d / "hf"), read_tensors(d / "back")
    assert set(back) == set(original)
    assert all(np.array_equal(back[name], tensor) for name, tensor in original.items())
    # transformers reads it as the llama3 RoPE it was
    params = transformers.AutoConfig.from_pretrained(d / "back").rope_parameters
    assert {k: v for k, v in params.items() if k != "rope_theta"} == SCALING and params["rope_theta"] == THETA
    # and the export imports to the same checkpoint config
    r = run_cli("import", "--hf", d / "back", "--out", d / "again.bin")
    assert r.returncode == 0, r.stderr
    assert checkpoint.load(d / "again.bin").cfg == checkpoint.load(d / "m.bin").cfg


def test_gguf_carries_llama_cpps_rope_freqs(imported, tmp_path):
    """The factors convert_hf_to_gguf.py computes for llama3 scaling, in its own words."""
    gguf = pytest.importorskip("gguf")
    _, d = imported
    r = run_cli("export", "--gguf", tmp_path / "m.gguf", "--ckpt", d / "m.bin", "--type", "f32")
    assert r.returncode == 0, r.stderr
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    factors = np.array(tensors["rope_freqs.weight"].data, dtype=np.float64)
    expected = []
    for freq in 1.0 / THETA ** (np.arange(0, D, 2) / D):
        wavelen = 2 * math.pi / freq
        if wavelen < 64 / 4.0:
            expected.append(1.0)
        elif wavelen > 64 / 1.0:
            expected.append(32.0)
        else:
            smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
            expected.append(1 / ((1 - smooth) / 32.0 + smooth))
    assert np.allclose(factors, expected, rtol=1e-6)
    from nanoeuler.io.gguf import read_params
    ck = checkpoint.load(d / "m.bin")
    assert np.array_equal(read_params(tmp_path / "m.gguf", ck.cfg, ck.params), ck.params)


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "yarn", "factor": 4.0}, "rope scaling type 'yarn' (nanoeuler computes 'default' and 'llama3'"),
    ({"type": "linear", "factor": 2.0}, "rope scaling type 'linear'"),
    ({"rope_type": "llama3", "factor": 8.0}, "llama3 rope scaling without a number for low_freq_factor"),
])
def test_other_rope_types_are_refused_in_one_line(imported, tmp_path, scaling, message):
    _, d = imported
    (tmp_path / "hf").mkdir()
    for f in (d / "hf").iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    config = json.loads((d / "hf" / "config.json").read_text())
    config.pop("rope_parameters", None)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "rope_scaling": scaling}))
    r = run_cli("import", "--hf", tmp_path / "hf", "--out", tmp_path / "m.bin")
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
