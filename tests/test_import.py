"""`nanoeuler import --hf DIR --out F`: a Hugging Face LlamaForCausalLM (random weights, saved by transformers,
its byte-level BPE trained by `tokenizers` with special tokens first, so its ids are not in our order) becomes a
checkpoint that computes what transformers computes, tokenizes as its tokenizer does, and exports back."""
import json
import os

import numpy as np
import pytest

from conftest import ROOT, run_cli
from nanoeuler.infer.generate import generate
from nanoeuler.io import checkpoint
from nanoeuler.io.hf_import import read_tensors
from nanoeuler.model.config import views
from nanoeuler.model.engine import make_engine

TEXTS = ["ROMEO: But soft, what light through yonder window breaks?", "  two  spaces, tabs\tand\nnewlines\n\n",
         "caf\u00e9 \u2603 \U0001f600 \u65e5\u672c\u8a9e", "don't we'll 1234567", ""]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def hf_tokenizer(corpus, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus.read_bytes().decode("utf-8", "replace")], trainer)  # it takes UTF-8 only
    return tok


def save_llama(folder, torch, transformers, tokenizer, dtype="float32", far_from_init=True, **overrides):
    """A random LlamaForCausalLM of a few thousand parameters (overrides: other shapes), far_from_init: with
    weights N(0, 0.3) and norm gains N(1, 0.3), so that a wrong mapping shows; saved with its tokenizer as
    save_pretrained writes them."""
    settings = dict(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rope_theta=50000.0,
                    rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=0, bos_token_id=0)
    settings.update(overrides)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters() if far_from_init else ():
            p.copy_(torch.randn(p.shape) * 0.3 + (1.0 if name.endswith("norm.weight") else 0.0))
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=SPECIALS[0]).save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def imported(corpus, torch, transformers, tmp_path_factory):
    d = tmp_path_factory.mktemp("import")
    model = save_llama(d / "hf", torch, transformers, hf_tokenizer(corpus, 400))
    r = run_cli("import", "--hf", d / "hf", "--out", d / "m.bin")
    assert r.returncode == 0, r.stderr
    return model, d


def test_config_and_tokenizer(imported, transformers):
    _, d = imported
    ck = checkpoint.load(d / "m.bin")
    cfg = ck.cfg
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.hidden, cfg.context, cfg.mtp_heads) == \
        (64, 2, 4, 2, 96, 128, 1)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.vocab_size) == (50000.0, 1e-6, 400)
    tok = ck.tokenizer()
    theirs = transformers.AutoTokenizer.from_pretrained(d / "hf")
    assert tok.special_tokens == {s: i for i, s in enumerate(SPECIALS)} and tok.eos_id == theirs.eos_token_id == 0
    for text in TEXTS:
        assert tok.encode(text) == theirs.encode(text), text
        assert tok.decode(tok.encode(text)) == text.encode()
    assert tok.encode("a<|im_start|>b", allow_special=True) == theirs.encode("a<|im_start|>b")


def all_in_float64(torch, model, inv_freq=None):
    """transformers computes RMSNorm and RoPE's angles in float32 even in a float64 model (relative errors of
    2e-6 in these logits): this makes its norms and its rotary module compute in float64, with the plain
    frequencies of its theta or the float64 `inv_freq` given (a scaled RoPE's)."""
    if inv_freq is None:
        cfg = model.config
        hd = cfg.hidden_size // cfg.num_attention_heads
        theta = cfg.rope_parameters["rope_theta"] if hasattr(cfg, "rope_parameters") else cfg.rope_theta  # 5.x, 4.x
        inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)

    def rotary(x, position_ids):
        angles = position_ids[..., None].double() * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    model.model.rotary_emb.forward = rotary
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):  # Llama's, Mistral's, Qwen2's
            module.forward = lambda x, m=module: m.weight * x * torch.rsqrt(
                x.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)


@pytest.mark.parametrize("dtype, tolerance", [(np.float64, 1e-7), (np.float32, 2e-5)])
def test_logits_and_greedy_match_transformers(imported, torch, dtype, tolerance):
    """float64: the engine's logits come back as float32, the tolerance's floor."""
    model, d = imported
    ck = checkpoint.load(d / "m.bin")
    eng, tok = make_engine(ck.cfg, dtype=dtype), ck.tokenizer()
    eng.load_params(ck.params)
    ids = np.array([tok.encode(TEXTS[0] * 3)[:64]], dtype=np.int32)
    model = model.to(torch.float64 if dtype == np.float64 else torch.float32)
    if dtype == np.float64:
        all_in_float64(torch, model)
    with torch.no_grad():
        theirs = model(torch.from_numpy(ids).long()).logits.numpy()
    assert np.linalg.norm(eng.logits(ids) - theirs) / np.linalg.norm(theirs) < tolerance
    with torch.no_grad():
        hf_ids = model.generate(torch.from_numpy(ids[:, :8]).long(), max_new_tokens=12, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, 8:].tolist()
    assert hf_ids == list(generate(eng, ids[0, :8], 12, temperature=0))


def test_export_gives_back_the_same_tensors(imported):
    _, d = imported
    r = run_cli("export", "--hf", d / "back", "--ckpt", d / "m.bin")
    assert r.returncode == 0, r.stderr
    original, back = read_tensors(d / "hf"), read_tensors(d / "back")
    assert set(back) == set(original) and "lm_head.weight" not in back  # tied weights come back tied
    for name, tensor in original.items():
        assert np.array_equal(back[name], tensor), name
    config = json.loads((d / "back" / "config.json").read_text())
    assert (config["rope_theta"], config["rms_norm_eps"], config["eos_token_id"]) == (50000.0, 1e-6, 0)
    assert config["tie_word_embeddings"] is True


def test_untied_bf16_weights(corpus, torch, transformers, tmp_path):
    """An untied lm_head becomes head 0; bfloat16 weights (what published checkpoints hold) read exactly."""
    model = save_llama(tmp_path / "hf", torch, transformers, hf_tokenizer(corpus, 300), "bfloat16",
                       tie_word_embeddings=False, num_key_value_heads=4)
    r = run_cli("import", "--hf", tmp_path / "hf", "--out", tmp_path / "m.bin")
    assert r.returncode == 0, r.stderr
    ck = checkpoint.load(tmp_path / "m.bin")
    v = views(ck.params, ck.cfg)
    state = {k: t.float().numpy() for k, t in model.state_dict().items()}
    assert np.array_equal(v["heads.0"], state["lm_head.weight"])
    assert np.array_equal(v["layers.1.wk"], state["model.layers.1.self_attn.k_proj.weight"])
    assert ck.cfg.n_kv_heads == 4


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention biases"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope scaling"),
    ({"hidden_act": "gelu"}, "activation gelu"),
    ({"head_dim": 32}, "head_dim 32"),
])
def test_what_we_do_not_compute_is_refused_in_one_line(imported, tmp_path, change, message):
    _, d = imported
    (tmp_path / "hf").mkdir()
    for f in (d / "hf").iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    config = json.loads((d / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    r = run_cli("import", "--hf", tmp_path / "hf", "--out", tmp_path / "m.bin")
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    assert not (tmp_path / "m.bin").exists()


def test_a_tokenizer_we_do_not_run_is_refused(imported, tmp_path):
    _, d = imported
    tokenizer = json.loads((d / "hf" / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": False}, tokenizer["pre_tokenizer"]]}  # digit runs: not a rule we have
    (tmp_path / "hf").mkdir()
    for f in (d / "hf").iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps(tokenizer))
    r = run_cli("import", "--hf", tmp_path / "hf", "--out", tmp_path / "m.bin")
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "Sequence of Digits, ByteLevel" in r.stderr, r.stderr
    r = run_cli("import", "--hf", d / "hf", "--out", d / "m.bin")  # an existing --out is kept
    assert r.returncode != 0 and "--overwrite" in r.stderr


def test_imported_model_trains_on(imported, corpus, tmp_path):
    """Continued pretraining (train --ckpt) and fine-tuning (sft) of an import keep its tokenizer's ids."""
    _, d = imported
    r = run_cli("train", "--ckpt", d / "m.bin", "--data", corpus, "--out", tmp_path / "more.bin", "--steps", 2,
                "--batch-size", 2, "--lr", 1e-4, "--device", "cpu", "--eval-every", 2, "--sample-every", 2)
    assert r.returncode == 0, r.stderr
    examples = [{"instruction": f"Say {w}.", "input": "", "output": w} for w in ("yes", "no", "maybe", "never") * 8]
    (tmp_path / "sft.json").write_text(json.dumps(examples))
    r = run_cli("sft", "--ckpt", tmp_path / "more.bin", "--data", tmp_path / "sft.json", "--out", tmp_path / "c.bin",
                "--steps", 2, "--batch-size", 2, "--device", "cpu", "--eval-every", 2, "--sample-every", 2,
                "--val-examples", 4)
    assert r.returncode == 0, r.stderr
    before, after = checkpoint.load(d / "m.bin"), checkpoint.load(tmp_path / "c.bin")
    assert after.chat and after.tokenizer().to_json() == before.tokenizer().to_json()
    assert after.cfg == before.cfg


def test_vocabulary_entries_no_merge_makes_decode(imported, tmp_path):
    """A tokenizer.json entry that no merge makes is never produced by encode, and decode reads it."""
    from nanoeuler.tokenizer.bpe import Tokenizer
    _, d = imported
    tokenizer = json.loads((d / "hf" / "tokenizer.json").read_text())
    n = len(tokenizer["model"]["vocab"])
    tokenizer["model"]["vocab"]["zqzq"] = n
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    tok = Tokenizer.load(tmp_path / "tokenizer.json")
    assert tok.vocab_size == n + 1 and tok.decode([n]) == b"zqzq" and n not in tok.encode("zqzq zqzq")
    again = Tokenizer.from_json(tok.to_json())
    assert again.decode([n]) == b"zqzq" and again.encode(TEXTS[0]) == tok.encode(TEXTS[0])


def _hub_cache(cache, repo, folder, revision="0123456789abcdef0123456789abcdef01234567", extra=()):
    """A Hugging Face cache as snapshot_download leaves it: models--owner--name/snapshots/REV/* and refs/main."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for f in list(folder.iterdir()) + list(extra):
        (snapshot / f.name).write_bytes(f.read_bytes())
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(revision)
    return snapshot


def test_a_hub_id_imports_from_the_cache_offline(imported, tmp_path, monkeypatch):
    """`--hf owner/name[@rev]` is a Hub id, found in HF_HUB_CACHE with HF_HUB_OFFLINE=1 (no network here): the
    same checkpoint as the folder's; a repo not in the cache, a bad string and a missing folder: one line each."""
    pytest.importorskip("huggingface_hub")
    _, d = imported
    revision = "0123456789abcdef0123456789abcdef01234567"
    _hub_cache(tmp_path / "cache", "TestOwner/Tiny-Llama", d / "hf", revision)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for source in ("TestOwner/Tiny-Llama", f"TestOwner/Tiny-Llama@{revision}"):
        r = run_cli("import", "--hf", source, "--out", tmp_path / "m.bin", "--overwrite", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert f"imported {source} into" in r.stdout
        ours, theirs = checkpoint.load(tmp_path / "m.bin"), checkpoint.load(d / "m.bin")
        assert np.array_equal(ours.params, theirs.params) and ours.cfg == theirs.cfg
    for source, message in [("TestOwner/Absent", "TestOwner/Absent is not in the Hugging Face cache"),
                            ("TestOwner/Tiny-Llama@v9", "TestOwner/Tiny-Llama at revision v9 is not in the"),
                            ("no_such_folder", "--hf no_such_folder is not a directory")]:
        r = run_cli("import", "--hf", source, "--out", tmp_path / "x.bin", cwd=tmp_path)
        assert r.returncode != 0 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
        assert "HF_HUB_OFFLINE=1" in r.stderr or "/" not in source
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "no_hub"), ROOT]))  # no huggingface_hub
    (tmp_path / "no_hub" / "huggingface_hub").mkdir(parents=True)
    (tmp_path / "no_hub" / "huggingface_hub" / "__init__.py").write_text("raise ImportError('absent')")
    r = run_cli("import", "--hf", "TestOwner/Tiny-Llama", "--out", tmp_path / "x.bin", cwd=tmp_path)
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "needs huggingface_hub, which does not import (absent): pip install -e '.[hub]'" in r.stderr, r.stderr
    r = run_cli("import", "--hf", d / "hf", "--out", tmp_path / "y.bin", cwd=tmp_path)  # a folder needs no hub
    assert r.returncode == 0, r.stderr
