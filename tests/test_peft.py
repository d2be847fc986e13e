"""PEFT's LoRA files (io/peft.py) both ways, checked by PEFT itself: our adapters loaded with
`PeftModel.from_pretrained` on the `export --hf` base give our logits, and an adapter PEFT made loads into our
engine with PEFT's logits; adapter checkpoints (io/checkpoint.py) read as their base merged."""
import json

import numpy as np
import pytest

from conftest import run_cli, sharp_params, tiny_config
from nanoeuler.errors import UserError
from nanoeuler.io import checkpoint, peft as peft_io
from nanoeuler.model import lora
from nanoeuler.model.config import Config
from nanoeuler.model.engine import make_engine


@pytest.fixture(scope="module")
def peft():
    return pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base(tokenizer, tmp_path_factory):
    """(config, weights, checkpoint path, its export --hf folder, token ids)."""
    cfg = tiny_config(tokenizer.vocab_size)
    cfg = Config(**{**cfg.__dict__, "mtp_heads": 1})
    flat = sharp_params(cfg, 5, 0.3)
    d = tmp_path_factory.mktemp("peft")
    checkpoint.save(d / "base.bin", cfg, flat, tokenizer.to_json(), step=3)
    r = run_cli("export", "--hf", d / "hf", "--ckpt", d / "base.bin")
    assert r.returncode == 0, r.stderr
    ids = np.array([tokenizer.encode("ROMEO: But soft, what light through yonder window breaks? " * 2)[:20]],
                   dtype=np.int32)
    return cfg, flat, d / "base.bin", d / "hf", ids


def _random_adapters(cfg, spec, seed):
    return np.random.default_rng(seed).normal(0, 0.2, lora.adapter_layout(cfg, spec)[1]).astype(np.float32)


def _peft_logits(torch, transformers, peft, hf, adapter_dir, ids):
    model = transformers.LlamaForCausalLM.from_pretrained(hf, torch_dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).logits.numpy()


@pytest.mark.parametrize("targets", [lora.TARGETS, ("q", "v")])
def test_our_adapters_load_in_peft_with_our_logits(base, tmp_path, torch, transformers, peft, targets):
    cfg, flat, _, hf, ids = base
    spec = lora.make_spec(cfg, 4, 6.0, 0.05, targets)
    values = _random_adapters(cfg, spec, 1)
    peft_io.write(tmp_path / "adapter", cfg, spec, values, base=str(hf))
    names = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"]
    assert names == [peft_io.MODULES[t].split(".")[1] for t in targets]
    eng = make_engine(cfg, training=False)
    eng.load_params(flat)
    ad = lora.attach(eng, spec, values)
    ad.dropout_on = False  # inference, as PEFT's eval()
    ours = eng.logits(ids)
    theirs = _peft_logits(torch, transformers, peft, hf, tmp_path / "adapter", ids)
    ad.enabled = False
    assert np.linalg.norm(eng.logits(ids) - theirs) > 0.1 * np.linalg.norm(theirs)  # the adapter matters
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 1e-5
    spec_back, values_back = peft_io.read(tmp_path / "adapter", cfg)
    assert spec_back == spec and np.array_equal(values_back, values)


@pytest.mark.parametrize("rslora", [False, True])
def test_an_adapter_made_by_peft_loads_with_its_logits(base, tmp_path, torch, transformers, peft, rslora):
    cfg, flat, path, hf, ids = base
    model = transformers.LlamaForCausalLM.from_pretrained(hf, torch_dtype=torch.float32)
    conf = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                           use_rslora=rslora, layers_to_transform=[1], task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, conf)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(tmp_path / "made")
    model.eval()
    with torch.no_grad():
        theirs = model(torch.from_numpy(ids).long()).logits.numpy()
    ck = peft_io.apply(checkpoint.load(path), tmp_path / "made")  # what --adapter DIR runs
    eng = make_engine(cfg, training=False)
    eng.load_params(ck.params)
    assert np.linalg.norm(eng.logits(ids) - theirs) / np.linalg.norm(theirs) < 1e-5
    spec, _ = peft_io.read(tmp_path / "made", cfg)
    assert spec.targets == ("q", "v", "down") and spec.rank == 4


def test_adapters_for_another_base_are_refused(base, tmp_path):
    cfg, *_ = base
    spec = lora.make_spec(cfg, 4)
    peft_io.write(tmp_path / "a", cfg, spec, _random_adapters(cfg, spec, 2))
    wider = Config(**{**cfg.__dict__, "hidden": cfg.hidden + 8})
    with pytest.raises(UserError, match="another base"):
        peft_io.read(tmp_path / "a", wider)
    deeper_only = Config(**{**cfg.__dict__, "n_layers": 1})
    with pytest.raises(UserError, match="another base"):
        peft_io.read(tmp_path / "a", deeper_only)
    conf = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**conf, "use_dora": True}))
    with pytest.raises(UserError, match="DoRA"):
        peft_io.read(tmp_path / "a", cfg)
    with pytest.raises(UserError, match="no adapter_config.json"):
        peft_io.read(tmp_path, cfg)


def test_adapter_checkpoint_reads_as_its_merged_base(base, tokenizer, tmp_path):
    cfg, flat, path, _, ids = base
    spec = lora.make_spec(cfg, 4, 8.0)
    values = _random_adapters(cfg, spec, 4)
    out = tmp_path / "adapters.bin"
    checkpoint.save_adapters(out, cfg, spec, values, path, checkpoint.adapter_fingerprint(flat), tokenizer.to_json(), step=7,
                  opt=(values * 0, values * 0 + 1), train_state={"x": 1})
    assert out.stat().st_size < 0.5 * path.stat().st_size  # the adapters alone
    ack = checkpoint.load_adapters(out, with_opt=True)
    assert ack.spec == spec and np.array_equal(ack.params, values) and ack.train_state == {"x": 1}
    merged = checkpoint.load(out)
    assert merged.step == 7 and np.allclose(merged.params, lora.merge(cfg, flat, spec, values))
    with pytest.raises(UserError, match="resume it with --lora"):
        checkpoint.load(out, with_opt=True)
    other = tmp_path / "other.bin"
    checkpoint.save(other, cfg, flat * 1.01, tokenizer.to_json(), step=1)
    checkpoint.save_adapters(out, cfg, spec, values, other, checkpoint.adapter_fingerprint(flat), tokenizer.to_json(), step=7)
    with pytest.raises(UserError, match="not the base"):
        checkpoint.load(out)
