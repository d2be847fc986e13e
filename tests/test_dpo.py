"""Preference tuning (DPO): the gradient check of the objective (and that a wrong sign or beta fails it), the
per-row cross-entropy scales, bad preference data, exact resume without recomputing the reference, chat
from a pipe, and the CPU pipeline pretrain -> sft -> dpo in which a learnable trait of the chosen replies
is learned."""
import json
import os
import re

import numpy as np
import pytest

from conftest import ROOT, run_cli
from nanoeuler.errors import UserError
from nanoeuler.io import checkpoint
from nanoeuler.train import dpo, loop, objectives, sft, pretrain as train
from nanoeuler.model.losses import sequence_logprobs
from nanoeuler.train.objectives import dpo_backward
from nanoeuler.data import instructions, preferences, template
from nanoeuler.check.gradients import CHECK_CONFIGS, THRESHOLD, dpo_gradient_check
from nanoeuler.model.config import PRESETS, Config
from nanoeuler.model.engine import make_engine
from nanoeuler.infer.generate import generate
from test_sft import FINETUNE, PRETRAIN, REPLY, TINY, _cli, _main  # the SFT pipeline test's model and stages
from test_train import _interrupt_at


# ------------------------------------------------------------------------------ the gradient check
def _worst(errors):
    return max(errors.values())


def test_dpo_gradient_check_passes_for_both_models():
    for cfg in CHECK_CONFIGS:
        errors = dpo_gradient_check(cfg, samples=2, report=lambda *a: None)
        assert _worst(errors) < THRESHOLD, errors


@pytest.mark.parametrize("wrong", ["sign", "beta", "rejected sign", "no nll", "nll per pair"])
def test_dpo_gradient_check_catches_a_wrong_weight(wrong, monkeypatch):
    real = objectives.dpo_row_weights

    def broken(z, beta, pairs, alpha, tokens):
        w = real(z, beta, pairs, alpha, tokens)  # (2P,): the chosen rows' weights, then the rejected rows'
        if wrong == "sign":
            return -w
        if wrong == "beta":
            return real(z, 2 * beta, pairs, alpha, tokens)
        if wrong == "no nll":
            return real(z, beta, pairs, 0.0, tokens)
        if wrong == "nll per pair":
            return real(z, beta, pairs, alpha, pairs)
        P = len(w) // 2
        return np.concatenate([w[:P], -w[P:]])
    monkeypatch.setattr(objectives, "dpo_row_weights", broken)
    errors = dpo_gradient_check(CHECK_CONFIGS[1], samples=2, report=lambda *a: None)
    assert _worst(errors) > 1e-2, errors


def test_dpo_loss_matches_its_definition_and_accumulates():
    """The loss against a direct computation from the logits, and two accumulated halves = the whole."""
    cfg = Config(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, hidden=32, vocab_size=40, context=24, mtp_heads=2)
    rng = np.random.default_rng(0)
    from nanoeuler.check.gradients import dpo_problem
    flat, inputs, targets, beta = dpo_problem(cfg, rng, pairs=4)
    eng = make_engine(cfg, dtype=np.float64)
    eng.load_params(flat)
    logits = eng.logits(inputs).astype(np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    pi = np.array([sum(logp[b, t, targets[0, b, t]] for t in range(inputs.shape[1]) if targets[0, b, t] >= 0)
                   for b in range(len(inputs))])
    np.testing.assert_allclose(sequence_logprobs(eng, inputs, targets), pi, rtol=1e-5)
    ref = pi + rng.normal(0, 1, pi.shape)
    z = beta * ((pi[:4] - ref[:4]) - (pi[4:] - ref[4:]))
    assert dpo_backward(eng, inputs, targets, ref, beta, alpha=0)[0] == pytest.approx(
        np.mean(np.log1p(np.exp(-z))), rel=1e-5)
    # RPO: + alpha * the chosen replies' NLL per token
    alpha, tokens = 0.7, (targets[0, :4] >= 0).sum()
    loss = dpo_backward(eng, inputs, targets, ref, beta, alpha=alpha)[0]
    assert loss == pytest.approx(np.mean(np.log1p(np.exp(-z))) - alpha * pi[:4].sum() / tokens, rel=1e-5)
    whole = eng.grads.copy()
    total = 0.0
    for i, rows in enumerate(([0, 1, 4, 5], [2, 3, 6, 7])):
        total += dpo_backward(eng, inputs[rows], targets[:, rows], ref[rows], beta, pairs=4,
                              accumulate=i > 0, alpha=alpha, tokens=tokens)[0]
    assert total == pytest.approx(loss, rel=1e-12)
    np.testing.assert_allclose(eng.grads, whole, rtol=1e-9, atol=1e-14)


# ------------------------------------------------------------------------------------------ bad data
@pytest.mark.parametrize("lines,needle", [
    (None, "not found"),
    (['{"prompt": "a", "chosen": "b", "rejected": "c"}', "{oops"], ":2: not JSON"),
    (['{"prompt": "a", "chosen": "b"}'], ":1: no string 'rejected'"),
    (['{"prompt": "a", "chosen": "b", "rejected": "c"}', '{"prompt": "a", "chosen": "  ", "rejected": "c"}'],
     ":2: the chosen response is empty"),
    (['[1, 2]'], ":1: expected an object"),
    ([""], "holds no preference pairs")])
def test_bad_preference_data_is_one_line_naming_the_line(lines, needle, tiny_ckpt, tmp_path, capsys):
    data = tmp_path / "prefs.jsonl"
    if lines is not None:
        data.write_text("\n".join(lines) + "\n")
    status, _, err = _cli(capsys, "dpo", "--data", data, "--ckpt", tiny_ckpt, "--out", tmp_path / "d.bin")
    assert status == 2 and err.count("\n") == 1 and needle in err and str(data) in err, err
    assert not (tmp_path / "d.bin").exists()


def test_nothing_fits_the_context(tiny_ckpt, tmp_path, capsys):
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Greet {n}.", "chosen": "Hi", "rejected": "Yo"}) + "\n"
                            for n in range(5)))
    status, _, err = _cli(capsys, "dpo", "--data", data, "--ckpt", tiny_ckpt, "--out", tmp_path / "d.bin")
    assert status == 2 and "fits the model's context of 32 tokens (line" in err, err


def test_resume_without_a_checkpoint(tmp_path, capsys):
    status, _, err = _cli(capsys, "dpo", "--resume", "--out", tmp_path / "none.bin")
    assert status == 2 and "nothing to resume" in err


# ------------------------------------------------------------------------------------ the CPU pipeline
PREFER = loop.Hyperparameters(steps=40, batch_size=8, lr=1e-3, warmup=5, eval_every=10, sample_every=40,
                              ckpt_every=40, sample_tokens=8)
NAMES = ["Romeo", "Juliet", "Hamlet", "Ophelia", "Lear", "Cordelia", "Macbeth", "Banquo", "Othello", "Iago",
         "Portia", "Shylock", "Viola", "Orsino", "Puck", "Oberon", "Titania", "Prospero", "Miranda", "Ariel",
         "Caliban", "Rosalind", "Orlando", "Beatrice", "Benedick", "Falstaff", "Hal", "Brutus", "Cassius",
         "Antony", "Cleopatra", "Horatio", "Laertes", "Polonius", "Kate", "Petruchio", "Bianca", "Lysander",
         "Helena", "Hermia", "Bottom", "Malvolio", "Feste", "Timon", "Pericles", "Imogen", "Leontes", "Perdita"]
TRAIT = "Sure! "  # the prefix the chosen replies have and the rejected ones lack: it decides the first token
HELD_OUT = ["Greet Duncan.", "Greet Edgar.", "Greet Regan.", "Greet Paris.", "Greet Tybalt.", "Greet Emilia."]


def _greedy(ckpt, prompts, n=24):
    ck = checkpoint.load(ckpt)
    tok, eng = ck.tokenizer(), make_engine(ck.cfg)
    eng.load_params(ck.params)
    return [tok.decode(list(generate(eng, template.prompt_ids(tok, p), n, temperature=0,
                                     stop_ids=(tok.eos_id,)))).decode("utf-8", "replace") for p in prompts]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """Pretrain the small preset's structure (4 layers, 4/2 heads, K = 2) at width 32 on the start of
    shakespeare.txt, fine-tune it on "Greet X." -> "Hello, X!" (one in eight "Hello, X! Welcome."), then
    DPO on pairs whose chosen reply adds " Welcome." to the rejected one."""
    d = tmp_path_factory.mktemp("dpo")
    text = d / "shakespeare.txt"
    with open(os.path.join(ROOT, "shakespeare.txt"), "rb") as f:
        text.write_bytes(f.read(300_000))
    sft_data = d / "greetings.json"
    # one in eight instructions is answered with the trait: the SFT model can say it, but does not prefer it
    sft_data.write_text(json.dumps([{"instruction": f"Greet {n}.", "input": "",
                                     "output": (TRAIT if i % 8 == 0 else "") + f"Hello, {n}!"}
                                    for i, n in enumerate(NAMES[:40])]))
    prefs = d / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": f"Greet {n}.", "chosen": f"{TRAIT}Hello, {n}!",
                                         "rejected": f"Hello, {n}!"}) + "\n" for n in NAMES))
    with pytest.MonkeyPatch.context() as m:
        m.setitem(PRESETS, "small", TINY)
        m.setitem(train.PRESET_HYPER, "small", PRETRAIN)
        m.setattr(sft, "SFT_HYPER", FINETUNE)
        m.setitem(dpo.DPO_HYPER, "small", PREFER)
        assert _main(train, "train", "--data", text, "--device", "cpu", "--out", d / "base.bin") == 0
        assert _main(sft, "sft", "--ckpt", d / "base.bin", "--out", d / "chat.bin", "--data", sft_data,
                     "--device", "cpu", "--val-examples", 4) == 0
        assert _main(dpo, "dpo", "--ckpt", d / "chat.bin", "--out", d / "dpo.bin", "--data", prefs,
                     "--device", "cpu", "--val-pairs", 8) == 0  # the default beta and RPO alpha
    return {"dir": d, "chat": d / "chat.bin", "dpo": d / "dpo.bin", "prefs": prefs}


def test_pipeline_dpo_learns_the_preferred_trait(pipeline):
    log = [json.loads(line) for line in open(pipeline["dir"] / "dpo.jsonl")]
    evals = [r for r in log if "val_reward_accuracy" in r]
    assert {"val_loss", "val_reward_accuracy", "val_reward_margin", "val_chosen_logp_delta",
            "val_rejected_logp_delta"} <= set(evals[-1])
    assert log[0]["pairs_skipped"] == 0 and len(evals) == 4
    first, last = evals[0], evals[-1]
    # the starting model gives every pair the same reward (0): 50% by the tie rule; then >= 90% held out
    start = objectives.DPO(0.1).evaluate(*_start_eval(pipeline))
    assert start["val_reward_accuracy"] == 0.5 and start["val_reward_margin"] == 0.0
    assert start["val_chosen_logp_delta"] == start["val_rejected_logp_delta"] == 0.0
    assert last["val_reward_accuracy"] >= 0.9 and last["val_reward_margin"] > 0
    assert last["val_loss"] < first["val_loss"] or first["val_reward_accuracy"] >= 0.9
    # the remedy's point: the chosen replies gain likelihood, not only the rejected ones lose it
    assert last["val_chosen_logp_delta"] > 0 > last["val_rejected_logp_delta"], last
    assert last["val_reward_margin"] == pytest.approx(
        0.1 * (last["val_chosen_logp_delta"] - last["val_rejected_logp_delta"]), rel=1e-9)
    ck = checkpoint.load(pipeline["dpo"], with_opt=True)
    assert ck.chat and ck.step == PREFER.steps and len(ck.train_state["ref"]) == len(NAMES)
    assert os.path.exists(pipeline["dir"] / "dpo.png")
    # greedy replies to held-out instructions: the trait at the first token after DPO, the reply after it kept
    before, after = ([r.removesuffix("</s>") for r in _greedy(pipeline[n], HELD_OUT)] for n in ("chat", "dpo"))
    n_before = sum(r.startswith(TRAIT) for r in before)
    n_after = sum(re.fullmatch(TRAIT + REPLY, r) is not None for r in after)
    assert n_before <= 2 and n_after >= len(HELD_OUT) - 1, (before, after)
    # the run's closing record: the share of the held-out prompts (8 pairs' prompts) whose greedy reply changed
    end = log[-1]
    assert end["greedy_prompts"] == 8 and "step" not in end
    assert end["greedy_changed"] >= 6 / 8 and end["greedy_examples"][0]["after"].startswith(TRAIT), end
    # the DPO model is a chat model for chat, infer and export alike; chat from a pipe exits at the end
    r = run_cli("chat", "--ckpt", pipeline["dpo"], "--device", "cpu", "--temperature", 0, "--max-new-tokens", 24,
                input="Greet Duncan.\nGreet Edgar.\n")
    assert r.returncode == 0 and "a chat model" in r.stdout, r.stderr
    assert len(re.findall(r"> Sure! Hello, [^\n]*!\n", r.stdout)) == 2, r.stdout


def _start_eval(pipeline):
    """The SFT model (the reference) evaluated on the held-out pairs against its own log-probs."""
    ck = checkpoint.load(pipeline["chat"])
    tok, eng = ck.tokenizer(), make_engine(ck.cfg)
    eng.load_params(ck.params)
    data = preferences.read_pairs(pipeline["prefs"])
    tr, va = instructions.split(len(data), 8)
    _, val, _ = preferences.prepare(data, tr, va, tok, ck.cfg.context, progress=False)
    ref = dpo.reference_logps(eng, val, 8, progress=False)
    return eng, preferences.pair_eval_batches(val, ref, 8, ck.cfg.context, ck.cfg.mtp_heads)


def test_dpo_resume_after_interrupt_is_bit_identical_without_recomputing_the_reference(pipeline, tmp_path,
                                                                                        monkeypatch):
    common = ["--ckpt", pipeline["chat"], "--data", pipeline["prefs"], "--device", "cpu", "--val-pairs", 8,
              "--steps", 8, "--batch-size", 4, "--grad-accum", 2, "--lr", 1e-3, "--eval-every", 3,
              "--sample-every", 8, "--ckpt-every", 5]
    assert _main(dpo, "dpo", "--out", tmp_path / "a.bin", *common) == 0
    with monkeypatch.context() as m:
        _interrupt_at(m, 4, preferences.PairBatches)
        assert _main(dpo, "dpo", "--out", tmp_path / "b.bin", *common) == 130
    assert checkpoint.load(tmp_path / "b.bin").step == 4

    with pytest.raises(UserError, match=r"trained with --rpo-alpha 1\.0; it cannot change mid-run"):
        _main(dpo, "dpo", "--resume", "--out", tmp_path / "b.bin", "--device", "cpu", "--rpo-alpha", 0.5)

    def no_recompute(*a, **k):
        raise AssertionError("the reference log-probs were recomputed on --resume")
    monkeypatch.setattr(dpo, "reference_logps", no_recompute)
    calls = []
    real_greedy = dpo.greedy_replies
    monkeypatch.setattr(dpo, "greedy_replies", lambda *a, **k: calls.append(1) or real_greedy(*a, **k))
    assert _main(dpo, "dpo", "--resume", "--out", tmp_path / "b.bin", "--device", "cpu") == 0
    assert len(calls) == 1  # the replies after; the starting model's come from the checkpoint
    full, resumed = ([r for r in map(json.loads, open(tmp_path / f"{n}.jsonl")) if "step" in r] for n in "ab")
    assert [r["step"] for r in resumed] == list(range(1, 9))
    for record, record_resumed in zip(full, resumed):
        for key in ("loss", "lr", "grad_norm", "reward_accuracy", "val_loss", "val_reward_accuracy",
                    "val_reward_margin", "val_chosen_logp_delta", "val_rejected_logp_delta"):
            assert record.get(key) == record_resumed.get(key), (record["step"], key)
    ckpt_full, ckpt_resumed = (checkpoint.load(tmp_path / f"{n}.bin", with_opt=True) for n in "ab")
    np.testing.assert_array_equal(ckpt_full.params, ckpt_resumed.params)
    np.testing.assert_array_equal(ckpt_full.opt[0], ckpt_resumed.opt[0])
    run_only = ("log", "argv")  # the run's own command line and log path (a.bin vs b.bin)
    same = lambda state: {k: v for k, v in state.items() if k not in run_only}
    assert ckpt_full.chat and ckpt_resumed.chat and same(ckpt_full.train_state) == same(ckpt_resumed.train_state)


@pytest.mark.parametrize("zero", [[], ["--zero", 3]], ids=["zero1", "zero3"])
def test_dpo_on_two_ranks_follows_one_process(pipeline, tmp_path, zero):
    """`nanoeuler dpo --gpus 2` (two CPU ranks over shared memory) at 4 pairs a rank against one process at 8:
    the reference log-probs split over the ranks, the pairs and chosen tokens normalised over both, the ranks'
    shares summed: the same losses, reward accuracy and held-out numbers to float32 rounding; rank 0 prints.
    With ZeRO-1 (the default) and ZeRO-3 (whose evaluations and closing replies gather the weights)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    common = ["dpo", "--ckpt", pipeline["chat"], "--data", pipeline["prefs"], "--device", "cpu", "--val-pairs", 8,
              "--steps", 6, "--lr", 1e-3, "--eval-every", 3, "--sample-every", 6, "--ckpt-every", 6]
    one = run_cli(*common, "--batch-size", 8, "--out", tmp_path / "one.bin", env=env)
    assert one.returncode == 0, one.stderr
    two = run_cli(*common, "--batch-size", 4, "--gpus", 2, *zero, "--out", tmp_path / "two.bin", env=env)
    assert two.returncode == 0, two.stderr
    ref, got = ([r for r in map(json.loads, open(tmp_path / f"{n}.jsonl")) if "step" in r] for n in ("one", "two"))
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, 7))
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in got], [r[key] for r in ref], rtol=1e-5, err_msg=key)
    # at step 1 the policy is the reference: every margin is float32 rounding of 0 (the CPU's products of a
    # batch round by its shape), so the tie rule's accuracy there is that rounding's sign and is left out
    assert abs(got[0]["reward_margin"]) < 1e-6 and abs(ref[0]["reward_margin"]) < 1e-6
    assert [r["reward_accuracy"] for r in got[1:]] == [r["reward_accuracy"] for r in ref[1:]]
    np.testing.assert_allclose([r["reward_margin"] for r in got], [r["reward_margin"] for r in ref], rtol=1e-5,
                               atol=1e-6)
    evals = [(r, want) for r, want in zip(got, ref) if "val_loss" in want]
    assert [r["step"] for r, _ in evals] == [3, 6]
    for r, want in evals:
        for key in ("val_loss", "val_reward_accuracy", "val_reward_margin", "val_chosen_logp_delta",
                    "val_rejected_logp_delta"):
            assert r[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (r["step"], key)
    # rank 0 alone prints: each line of the run once, as one process prints it
    for needle in ("reference: log-probabilities of 48 pairs", "step 3: train loss", "step 6: train loss",
                   "greedy replies to 8 held-out prompts"):
        assert two.stdout.count(needle) == one.stdout.count(needle) == 1, (needle, two.stdout)
