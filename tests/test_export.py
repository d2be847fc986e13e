"""`nanoeuler export --hf DIR`: transformers loads the folder and computes what we compute."""
import json

import numpy as np
import pytest

from conftest import run_cli, tiny_config
from nanoeuler.io import checkpoint
from nanoeuler.model.config import init_params, views
from nanoeuler.model.engine import make_engine
from nanoeuler.infer.generate import generate

TEXTS = ["ROMEO: But soft, what light through yonder window breaks?", "  two  spaces, tabs\tand\nnewlines\n\n",
         "caf\u00e9 \u2603 \U0001f600 \u65e5\u672c\u8a9e", "don't we'll 1234567", ""]


@pytest.fixture(scope="module")
def exported(tokenizer, tmp_path_factory):
    cfg = tiny_config(tokenizer.vocab_size)
    flat = init_params(cfg, seed=1)
    rng = np.random.default_rng(4)
    for name, view in views(flat, cfg).items():  # weights far from init, so a wrong mapping shows
        view[...] = rng.normal(1 if name.endswith("norm") else 0, 0.3, view.shape)
    d = tmp_path_factory.mktemp("export")
    checkpoint.save(d / "m.bin", cfg, flat, tokenizer.to_json(), step=5)
    r = run_cli("export", "--hf", d / "hf", "--ckpt", d / "m.bin")
    assert r.returncode == 0, r.stderr
    eng = make_engine(cfg)
    eng.load_params(flat)
    return eng, d / "hf"


def test_logits_match_transformers(exported, tokenizer, torch, transformers):
    eng, out = exported
    model = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert not model.config.tie_word_embeddings
    ids = np.array([tokenizer.encode(TEXTS[0] * 3)[:eng.cfg.context]], dtype=np.int32)
    with torch.no_grad():
        theirs = model(torch.from_numpy(ids).long()).logits.numpy()
    ours = eng.logits(ids)
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 1e-5
    with torch.no_grad():
        hf_ids = model.generate(torch.from_numpy(ids[:, :8]).long(), max_new_tokens=12, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, 8:].tolist()
    assert hf_ids == list(generate(eng, ids[0, :8], 12, temperature=0))


def test_tokenizer_gives_our_ids(exported, tokenizer, transformers):
    _, out = exported
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert fast.encode(text) == tokenizer.encode(text), text
        assert auto.encode(text) == tokenizer.encode(text), text
    # transformers always reads special tokens written in the text, like our encode(allow_special=True)
    assert fast.encode("x</s>y") == tokenizer.encode("x</s>y", allow_special=True)
    assert auto.eos_token_id == tokenizer.eos_id
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == tokenizer.eos_id and config["rms_norm_eps"] == 1e-5


def test_export_into_a_file_path_fails_cleanly(tiny_ckpt, tmp_path):
    target = tmp_path / "a_file"
    target.write_text("keep me")
    r = run_cli("export", "--hf", target, "--ckpt", tiny_ckpt)
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert target.read_text() == "keep me"


def test_chat_template_renders_our_template(tokenizer, tmp_path, transformers):
    """A chat checkpoint's export carries the chat template: apply_chat_template gives the prompt our chat gives
    the model, as text and as ids, for one turn and for a conversation with a system text."""
    from nanoeuler.data.template import conversation_ids, prompt_ids, render_prompt
    cfg = tiny_config(tokenizer.vocab_size)
    checkpoint.save(tmp_path / "chat.bin", cfg, init_params(cfg, seed=2), tokenizer.to_json(), step=3, chat=True)
    r = run_cli("export", "--hf", tmp_path / "hf", "--ckpt", tmp_path / "chat.bin")
    assert r.returncode == 0, r.stderr
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    one = [{"role": "user", "content": "Name a colour."}]
    assert auto.apply_chat_template(one, tokenize=False, add_generation_prompt=True) == render_prompt("Name a colour.")
    ids = auto.apply_chat_template(one, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == prompt_ids(tokenizer, "Name a colour.")
    turns = [("Name a colour.", "Red."), ("And another?", None)]
    many = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."},
            {"role": "user", "content": "And another?"}]
    ids = auto.apply_chat_template(many, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == conversation_ids(tokenizer, turns)
    card = (tmp_path / "hf" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers") and "apply_chat_template" in card
    assert "step 3, chat template" in card
    assert "chat_template" not in json.loads((exported_plain(tokenizer, tmp_path) / "tokenizer_config.json").read_text())


def exported_plain(tokenizer, tmp_path):
    cfg = tiny_config(tokenizer.vocab_size)
    checkpoint.save(tmp_path / "plain.bin", cfg, init_params(cfg, seed=2), tokenizer.to_json(), step=3)
    assert run_cli("export", "--hf", tmp_path / "plain", "--ckpt", tmp_path / "plain.bin").returncode == 0
    return tmp_path / "plain"
