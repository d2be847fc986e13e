"""`nanoeuler eval`: batched multiple-choice scoring against a brute-force forward per choice, lm-eval's token
split, bad items, HellaSwag's preprocessing, bits per byte, and the HellaSwag fetcher against a local
fault-injecting server."""
import argparse
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, run_cli, sharp_params, tiny_config
from nanoeuler.errors import UserError
from nanoeuler.eval.scoring import encode_pair, loglikelihoods
from nanoeuler.data.hellaswag import read_hellaswag
from nanoeuler.data.mc_items import read_mc
from nanoeuler.eval.tasks import score_choices
from nanoeuler.io import checkpoint
from nanoeuler.model.engine import make_engine

FIXTURE = os.path.join(ROOT, "tests", "data", "hellaswag_fixture.jsonl")
ITEMS = [  # trailing spaces, an empty context, non-ASCII, 2 to 4 choices, a context longer than the model's
    {"context": "ROMEO: But soft, what light", "choices": [" through yonder window", "caf\u00e9 \u2603", "x"],
     "label": 0},
    {"context": "Her answer was short:  ", "choices": ["no.", "maybe.", "yes, my lord."], "label": 2},
    {"context": "", "choices": ["To be", "or not"], "label": 1},
    {"context": "The king " * 30 + "and then", "choices": ["he spoke.", "the castle fell down the hill.",
                                                          "\u65e5\u672c", "ah"], "label": 1},
    {"context": "Pick a word, my lord:", "choices": ["the", "and", "to", "a"], "label": 1},  # one token each
]


def engine(tokenizer, device="cpu", gpu=False):
    cfg = tiny_config(tokenizer.vocab_size, gpu=gpu)
    eng = make_engine(cfg, device=device, precision="fp32")
    eng.load_params(sharp_params(cfg, seed=5, scale=0.2))  # logits far from flat: choices differ clearly
    return eng


def brute_force(eng, tok, item, choice):
    """log p(choice | context) from one unbatched, unpadded forward: lm-eval's split and left truncation."""
    context_ids, continuation_ids = encode_pair(tok, item["context"], " " + choice)
    window = (context_ids + continuation_ids)[-(eng.cfg.context + 1):]
    logits = eng.logits(np.array([window[:-1]], dtype=np.int32))[0].astype(np.float64)
    top = logits.max(1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(1, keepdims=True))
    n = len(continuation_ids)
    positions = np.arange(len(window) - 1 - n, len(window) - 1)
    return float(logp[positions, window[-n:]].sum())


def check_against_brute_force(eng, tok, batch_size):
    result = score_choices(eng, tok, ITEMS, batch_size=batch_size, progress=False)
    assert result["truncated"] >= 1  # the long context really was cut
    for item, pred in zip(ITEMS, result["predictions"]):
        expected = [brute_force(eng, tok, item, c) for c in item["choices"]]
        np.testing.assert_allclose(pred["logprobs"], expected, rtol=2e-4, atol=2e-4)
        lengths = np.array([len(c) for c in item["choices"]], dtype=float)  # characters, not bytes
        assert pred["pred"] == int(np.argmax(expected))
        assert pred["pred_norm"] == int(np.argmax(np.array(expected) / lengths))
    hits = [p["pred"] == i["label"] for p, i in zip(result["predictions"], ITEMS)]
    assert result["acc"] == np.mean(hits) and result["n"] == len(ITEMS)


@pytest.mark.parametrize("batch_size", [1, 3, 32])
def test_mc_scoring_equals_a_forward_per_choice(tokenizer, batch_size):
    check_against_brute_force(engine(tokenizer), tokenizer, batch_size)


@pytest.mark.gpu
def test_mc_scoring_on_the_gpu_equals_a_forward_per_choice(tokenizer):
    from nanoeuler.model.gpu import available
    if not available():
        pytest.skip("no CUDA GPU")
    check_against_brute_force(engine(tokenizer, "gpu", gpu=True), tokenizer, 3)


def test_token_split_is_lm_evals(tokenizer):
    """Trailing spaces of the context move into the continuation; the continuation is the whole's tail."""
    context_ids, continuation_ids = encode_pair(tokenizer, "Her answer was short:  ", " yes")
    assert context_ids == tokenizer.encode("Her answer was short:")
    assert context_ids + continuation_ids == tokenizer.encode("Her answer was short:   yes")
    assert encode_pair(tokenizer, "", " To be") == ([tokenizer.eos_id], tokenizer.encode(" To be"))
    assert encode_pair(tokenizer, " \n", " To be") == ([tokenizer.eos_id], tokenizer.encode(" \n To be"))


def counting(eng):
    """Record the rows of each forward and each logits call of eng."""
    calls = {"forward": [], "logits": []}
    forward, logits = eng.forward, eng.logits
    eng.forward = lambda inputs, targets: calls["forward"].append(len(inputs)) or forward(inputs, targets)
    eng.logits = lambda inputs: calls["logits"].append(len(inputs)) or logits(inputs)
    return calls


def test_identical_requests_are_computed_once(tokenizer):
    eng = engine(tokenizer)
    calls = counting(eng)
    request = encode_pair(tokenizer, "To be, or not", " to be")
    scores = loglikelihoods(eng, [request, request, request], batch_size=8, progress=False)
    assert calls == {"forward": [1], "logits": []} and scores[0] == scores[1] == scores[2]


def test_one_token_choices_share_their_context(tokenizer):
    """Single-token choices after one context: one row for all of them, read off its last logits."""
    eng = engine(tokenizer)
    item = ITEMS[-1]
    requests = [encode_pair(tokenizer, item["context"], " " + c) for c in item["choices"]]
    assert all(len(continuation) == 1 for _, continuation in requests)
    calls = counting(eng)
    scores = loglikelihoods(eng, requests + [encode_pair(tokenizer, "Other", " words here")], 8, progress=False)
    assert calls == {"forward": [1], "logits": [1]}
    np.testing.assert_allclose(scores[:4], [brute_force(eng, tokenizer, item, c) for c in item["choices"]],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("line, message", [
    ("not json", "line 2: not JSON"),
    ('["a", "b"]', "line 2: expected a JSON object"),
    ('{"context": "a", "choices": ["x", "y"]}', "line 2: missing label"),
    ('{"context": 3, "choices": ["x", "y"], "label": 0}', "line 2: context must be a string"),
    ('{"context": "a", "choices": ["x"], "label": 0}', "line 2: choices must be a list of at least 2"),
    ('{"context": "a", "choices": ["x", ""], "label": 0}', "line 2: choices must be a list of at least 2"),
    ('{"context": "a", "choices": ["x", "y"], "label": 2}', "line 2: label must be an integer index"),
    ('{"context": "a", "choices": ["x", "y"], "label": true}', "line 2: label must be an integer index"),
])
def test_bad_items_name_their_line(tmp_path, line, message):
    path = tmp_path / "items.jsonl"
    path.write_text('{"context": "ok", "choices": ["a", "b"], "label": 0}\n' + line + "\n")
    with pytest.raises(UserError, match=message):
        read_mc(path)


def test_cli_bad_item_is_one_line_and_good_run_writes_json_and_predictions(tiny_ckpt, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": ["x", "y"], "label": 5}\n')
    r = run_cli("eval", "--task", "mc", "--data", bad, "--ckpt", tiny_ckpt)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "line 1: label must be an integer index" in r.stderr
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    r = run_cli("eval", "--task", "mc", "--data", good, "--ckpt", tiny_ckpt, "--json", tmp_path / "s.json",
                "--predictions", tmp_path / "p.jsonl", "--batch-size", "2")
    assert r.returncode == 0, r.stderr
    assert "longer than the model's context" in r.stderr and "acc_norm" in r.stdout
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["task"] == "mc" and summary["n"] == len(ITEMS) and 0 <= summary["acc_norm"] <= 1
    predictions = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [p["index"] for p in predictions] == list(range(len(ITEMS)))
    assert all(set(p) == {"index", "pred", "pred_norm", "logprobs"} for p in predictions)
    assert np.mean([p["pred"] == i["label"] for p, i in zip(predictions, ITEMS)]) == summary["acc"]


def test_eval_on_two_ranks_gives_the_numbers_of_one(tiny_ckpt, tmp_path):
    """eval --gpus 2 (two CPU ranks here): each scores every other batch, the scores are gathered, and the
    predictions, their log-probabilities and bits per byte are those of one process, bit for bit."""
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    got = {}
    for ranks in ("1", "2"):
        mc = run_cli("eval", "--task", "mc", "--data", good, "--ckpt", tiny_ckpt, "--batch-size", "1", "--gpus", ranks,
                     "--device", "cpu", "--predictions", tmp_path / f"p{ranks}.jsonl")
        bpb = run_cli("eval", "--task", "bpb", "--data", text, "--ckpt", tiny_ckpt, "--batch-size", "1", "--gpus", ranks,
                      "--device", "cpu", "--json", tmp_path / f"b{ranks}.json")
        assert mc.returncode == 0 and bpb.returncode == 0, mc.stderr + bpb.stderr
        assert mc.stdout.count("acc_norm") == 1  # rank 0 alone prints
        got[ranks] = ((tmp_path / f"p{ranks}.jsonl").read_text(),
                      json.loads((tmp_path / f"b{ranks}.json").read_text())["bpb"])
    assert got["1"] == got["2"]


def test_missing_hellaswag_names_its_fetcher(tiny_ckpt, tmp_path):
    r = run_cli("eval", "--task", "hellaswag", "--ckpt", tiny_ckpt, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "data/hellaswag_val.jsonl not found (download it with `python -m nanoeuler.data.hellaswag`" in r.stderr


def test_hellaswag_rows_become_lm_evals_items():
    items = read_hellaswag(FIXTURE)
    assert len(items) == 12
    assert items[0]["context"] == "Making a sandwich: A man lays two slices of bread on a wooden board. He"
    # WikiHow rows: " [title]" -> ". ", other brackets dropped, double spaces collapsed, ctx_b empty
    assert items[2]["context"] == ("Home and Garden: How to water a houseplant. Check the soil first. Push a finger "
                                   "into the soil up to the first knuckle.")
    assert items[2]["choices"][0] == " If it feels wet, sing to the plant."
    assert items[5]["choices"][1] == " Pour the water over a tea bag in a cup. Steep for three minutes."


def test_bpb_is_trainings_final_evaluation(tiny_ckpt, corpus, tokenizer, tmp_path):
    from nanoeuler.data.corpus import eval_batches, open_corpus
    from nanoeuler.model.losses import bits_per_byte
    r = run_cli("eval", "--task", "bpb", "--data", corpus, "--ckpt", tiny_ckpt, "--json", tmp_path / "b.json",
                "--batch-size", "8", "--limit", "3")
    assert r.returncode == 0, r.stderr
    got = json.loads((tmp_path / "b.json").read_text())
    ck = checkpoint.load(tiny_ckpt)
    eng = make_engine(ck.cfg)
    eng.load_params(ck.params)
    opened = open_corpus(corpus, tokenizer, progress=False)
    # consecutive windows
    batches = eval_batches(opened.tokens, opened.byte_len, 8, ck.cfg.context, ck.cfg.mtp_heads)[:3]
    loss, bpb = bits_per_byte(eng, batches)
    assert got["bpb"] == pytest.approx(bpb, rel=1e-9) and got["n"] == 3 * 8 * ck.cfg.context


# ------------------------------------------------------------------------------------------ the fetcher
def test_hellaswag_fetcher_retries_resumes_and_checks_the_digest(tmp_path):
    from test_fetch import Server
    body = open(FIXTURE, "rb").read() * 40  # large enough that a dropped transfer leaves a part to resume
    server = Server()
    try:
        server.files["/hellaswag_val.jsonl"] = body
        server.faults["/hellaswag_val.jsonl"] = ["503", "drop"]
        url = server.url + "/hellaswag_val.jsonl"
        env = dict(os.environ, NANOEULER_FETCH_BACKOFF="0", NANOEULER_FETCH_TIMEOUT="5")
        out, cache = tmp_path / "hellaswag_val.jsonl", tmp_path / "cache"
        args = ("-m", "nanoeuler.data.hellaswag", "--url", url, "--out", out, "--cache-dir", cache)
        run = lambda *extra: subprocess.run([sys.executable, *map(str, args + extra)], cwd=ROOT, env=env,
                                            capture_output=True, text=True, timeout=60)
        r = run("--sha256", "0" * 64)  # a digest the file does not have: refused, nothing written
        assert r.returncode == 2 and "is not the pinned" in r.stderr and not out.exists()
        assert any(e["range"] for e in server.requests())  # the dropped transfer was resumed with a Range
        r = run("--sha256", hashlib.sha256(body).hexdigest())
        assert r.returncode == 0, r.stderr
        assert out.read_bytes() == body and "480 items" in r.stderr
        side = json.loads(open(str(out) + ".source.json").read())
        assert side["sources"][0]["url"] == url and side["sources"][0]["verified"] == "sha256"
        n = len(server.requests())
        assert run("--sha256", hashlib.sha256(body).hexdigest()).returncode == 0
        assert len(server.requests()) == n  # the cached download is not fetched again
        server.files["/bad.jsonl"] = b'{"not": "hellaswag"}\n'
        r = subprocess.run([sys.executable, "-m", "nanoeuler.data.hellaswag", "--url", server.url + "/bad.jsonl",
                            "--out", str(tmp_path / "bad.jsonl"), "--cache-dir", str(cache)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60)
        last = r.stderr.strip().splitlines()[-1]  # after the download's progress bar: one line
        assert r.returncode == 2 and last.startswith("nanoeuler: error: ") and "is not HellaSwag data" in last
    finally:
        server.close()


def test_the_default_source_is_pinned():
    from nanoeuler.data.hellaswag import COMMIT, HELLASWAG
    assert COMMIT in HELLASWAG.url and len(HELLASWAG.git_blob) == 40 and HELLASWAG.url.startswith("https://")


def test_chat_scoring_goes_through_the_template(tokenizer, tiny_ckpt, tmp_path):
    from nanoeuler.data.template import prompt_ids
    from nanoeuler.eval.main import main
    from nanoeuler.eval.tasks import chat_requests
    requests, first = chat_requests(tokenizer, ITEMS[:2])
    assert first == [0, 3] and requests[4] == (prompt_ids(tokenizer, ITEMS[1]["context"]), tokenizer.encode("maybe."))
    items = tmp_path / "items.jsonl"
    items.write_text(json.dumps(ITEMS[0]) + "\n")
    args = dict(task="mc", data=str(items), ckpt=str(tiny_ckpt), limit=None, batch_size=None, json=None,
                predictions=None, chat=True, precision=None, device="cpu")
    with pytest.raises(UserError, match="is not a chat checkpoint"):
        main(argparse.Namespace(**args))
