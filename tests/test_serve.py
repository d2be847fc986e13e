"""`nanoeuler serve`: real servers on 127.0.0.1 (subprocesses of the tiny checkpoints) driven by the official
OpenAI client, raw HTTP for bad input, and a headless Chromium for the web page. Every expected output is
computed here with `sample.generate` on the same checkpoint, so "correct" means token for token."""
import concurrent.futures
import dataclasses
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from nanoeuler.io import checkpoint
from nanoeuler.model.config import init_params
from nanoeuler.infer.generate import generate, start_ids
from nanoeuler.io.checkpoint import load_model
from nanoeuler.infer.scheduler import Job, SamplingSettings, Scheduler, held_back, stop_at
from nanoeuler.model.decoding import CHAINED
from nanoeuler.data import template

from conftest import ROOT, run_cli, sharp_params, tiny_config

openai = pytest.importorskip("openai")


class Server:
    """`python -m nanoeuler serve` on a free port of 127.0.0.1, its output in a file."""

    def __init__(self, ckpt, log, *flags, key="x"):
        self.log, self.key = log, key
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "nanoeuler", "serve", "--ckpt", str(ckpt),
                                          "--device", "cpu", "--port", "0", *map(str, flags)],
                                         cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not (m := re.search(r"on http://127\.0\.0\.1:(\d+)/ ", self.output())):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()
            time.sleep(0.05)
        self.port = int(m.group(1))
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key, max_retries=0,
                                    timeout=60)

    def output(self):
        with open(self.log, errors="replace") as f:
            return f.read()

    def request(self, method, path, body=None, headers=None):
        """(status, parsed JSON) of one raw HTTP request; body: bytes, or an object sent as JSON."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        if headers is None:
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"}
        conn.request(method, path, data, headers)
        r = conn.getresponse()
        status, raw = r.status, r.read()
        conn.close()
        return status, json.loads(raw)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)


@pytest.fixture(scope="module")
def chat_ckpt(tokenizer, tmp_path_factory):
    """The tiny model with a context of 512 (room for a conversation in the template) and sharp logits (its
    replies depend on what it was shown), marked as a chat checkpoint (as `nanoeuler sft` writes)."""
    cfg = dataclasses.replace(tiny_config(tokenizer.vocab_size), context=512)
    path = tmp_path_factory.mktemp("chat") / "tinychat.bin"
    checkpoint.save(path, cfg, sharp_params(cfg, seed=3, scale=0.3), tokenizer.to_json(), step=0, chat=True)
    return path


@pytest.fixture(scope="module")
def base(tiny_ckpt, tmp_path_factory):
    server = Server(tiny_ckpt, tmp_path_factory.mktemp("serve") / "base.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def chat(chat_ckpt, tmp_path_factory):
    server = Server(chat_ckpt, tmp_path_factory.mktemp("serve") / "chat.log")
    yield server
    server.stop()


def _model(ckpt):
    eng, tok, _ = load_model(ckpt, "cpu")
    return eng, tok


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return _model(tiny_ckpt)


@pytest.fixture(scope="module")
def chat_model(chat_ckpt):
    return _model(chat_ckpt)


def expected(model, prompt, max_tokens, temperature=0.0, top_p=1.0, seed=None, stop=()):
    """(text, finish_reason, prompt_tokens, completion_tokens) that the server must answer: what generate()
    gives the prompt (text or ids) alone."""
    eng, tok = model
    ids = prompt if isinstance(prompt, list) else start_ids(tok, prompt)
    out = list(generate(eng, ids, max_tokens, temperature, 0, top_p, seed=seed, stop_ids=(tok.eos_id,)))
    eos = out[-1] == tok.eos_id
    text = tok.decode(out[:-1] if eos else out).decode("utf-8", errors="replace")
    cut = stop_at(text, stop, 0)
    if cut >= 0:
        return text[:cut], "stop", len(ids), len(out)
    return text, "stop" if eos else "length", len(ids), len(out)


def streamed(stream):
    """(text, finish_reason, usage) of a streamed completion or chat completion (one choice)."""
    text, reason, usage = [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text.append((choice.delta.content or "") if hasattr(choice, "delta") else choice.text)
            reason = choice.finish_reason or reason
    return "".join(text), reason, usage


def token_bytes(token):
    """The bytes of a token as the API names it: its text, or "bytes:\\xNN..." where it is part of a character."""
    return bytes.fromhex(token[6:].replace("\\x", "")) if token.startswith("bytes:") else token.encode()


def test_stop_strings_are_found_across_pieces_and_held_back():
    assert stop_at("abcSTOPd", ("STOP",), 5) == 3 and stop_at("abcST", ("STOP",), 3) == -1
    assert stop_at("x\n\ny", ("\n\n", "y"), 0) == 1
    assert held_back("hello S", ("STOP",)) == 1 and held_back("hello ST", ("STOP", "TX")) == 2
    assert held_back("hello", ("STOP",)) == 0 and held_back("abc", ()) == 0


def test_models_and_the_page(base, chat):
    [card] = base.client.models.list().data
    assert card.id == "tiny" and card.owned_by == "nanoeuler" and card.model_extra["chat"] is False
    assert chat.client.models.retrieve("tinychat").model_extra["chat"] is True
    conn = http.client.HTTPConnection("127.0.0.1", base.port, timeout=30)
    conn.request("GET", "/")
    page = conn.getresponse().read().decode()
    assert "<script>" in page and not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # works offline


def test_greedy_completion_is_nanoeuler_infer(base, model, tiny_ckpt):
    r = base.client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=20, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.prompt_tokens,
            r.usage.completion_tokens) == expected(model, "ROMEO:", 20)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    infer = subprocess.run([sys.executable, "-m", "nanoeuler", "infer", "ROMEO:", "--ckpt", str(tiny_ckpt),
                            "--temperature", "0", "--max-new-tokens", "20", "--device", "cpu"],
                           cwd=ROOT, capture_output=True, timeout=120, env=dict(os.environ, PYTHONIOENCODING="utf-8"))
    assert infer.stdout.decode() == "ROMEO:" + r.choices[0].text + "\n"
    # sampled with a seed: the server's choice j is `nanoeuler infer --seed S + j`
    sampled = dict(temperature=1.0, top_p=0.9)
    r = base.client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=20, seed=7, n=2, **sampled)
    for j, choice in enumerate(r.choices):
        infer = subprocess.run([sys.executable, "-m", "nanoeuler", "infer", "ROMEO:", "--ckpt", str(tiny_ckpt),
                                "--temperature", "1.0", "--top-p", "0.9", "--seed", str(7 + j), "--max-new-tokens",
                                "20", "--device", "cpu"], cwd=ROOT, capture_output=True, timeout=120,
                               env=dict(os.environ, PYTHONIOENCODING="utf-8"))
        assert infer.stdout.decode() == "ROMEO:" + choice.text + "\n", j


def test_streaming_seed_stop_and_too_long_prompts(base, model):
    client = base.client
    text, reason, usage = streamed(client.completions.create(model="tiny", prompt="KING:", max_tokens=20,
                                                             temperature=0, stream=True,
                                                             stream_options={"include_usage": True}))
    assert (text, reason, usage.prompt_tokens, usage.completion_tokens) == expected(model, "KING:", 20)
    # a seed repeats a sample, exactly as generate() with that seed draws it
    sample = dict(model="tiny", prompt="Now", max_tokens=25, temperature=1.0, top_p=0.9, seed=11)
    first, second = (client.completions.create(**sample).choices[0].text for _ in range(2))
    assert first == second == expected(model, "Now", 25, 1.0, 0.9, 11)[0]
    # stop strings end the text where one first appears, cut, streamed or not
    stop = [text[7:10], "\x00never"]
    for stream in (False, True):
        r = client.completions.create(model="tiny", prompt="KING:", max_tokens=20, temperature=0, stop=stop,
                                      stream=stream)
        got = streamed(r)[:2] if stream else (r.choices[0].text, r.choices[0].finish_reason)
        assert got == (text[:text.find(stop[0])], "stop") == expected(model, "KING:", 20, stop=stop)[:2]
    # a prompt longer than the context is refused (the CLI keeps its last tokens instead)
    long = "To be, or not to be, that is the question. " * 40
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt=long, max_tokens=10)
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "prompt"
    # generation ends at the end of the context
    ids = start_ids(model[1], long)[:28]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=100, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 32 - 28 + 1


def test_list_prompts_n_and_token_ids(base, model):
    eng, tok = model
    prompts = ["ROMEO:", tok.encode("JULIET: O"), "Now is the"]
    r = base.client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=12, temperature=0.9, top_p=1.0,
                                       seed=5)
    assert [c.index for c in r.choices] == list(range(6))
    for c in r.choices:  # choice j of a prompt draws with seed + j
        prompt, j = prompts[c.index // 2], c.index % 2
        assert (c.text, c.finish_reason) == expected(model, prompt, 12, 0.9, 1.0, 5 + j)[:2], c.index
    assert r.choices[0].text != r.choices[1].text
    assert r.usage.prompt_tokens == sum(len(start_ids(tok, p) if isinstance(p, str) else p) for p in prompts)
    r = base.client.completions.create(model="tiny", prompt=[tok.encode("To be"), tok.encode("or not")],
                                       max_tokens=5, temperature=0)
    assert [c.text for c in r.choices] == [expected(model, tok.encode(p), 5)[0] for p in ("To be", "or not")]


def test_echo_and_logprobs_score_the_prompt(base, model):
    """max_tokens 0 with echo and logprobs: each prompt token's log-probability (what loglikelihood
    evaluation reads), equal to minus the engine's cross-entropy at that position."""
    eng, tok = model
    prompts = ["To be, or not to be", "ROMEO: caf\u00e9"]
    r = base.client.completions.create(model="tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=3)
    for choice, prompt in zip(r.choices, prompts):
        ids = start_ids(tok, prompt)
        lp = choice.logprobs
        assert choice.text == prompt and choice.finish_reason == "length"
        assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        targets = np.array([ids[1:] + [-1]] * eng.cfg.mtp_heads, dtype=np.int32).reshape(-1, 1, len(ids))
        cross_entropy = np.asarray(eng.forward(np.array([ids]), targets))[0, :-1]
        assert np.allclose(lp.token_logprobs[1:], -cross_entropy, atol=1e-4)
        for logprob, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert len(top) == 3 and max(top.values()) >= logprob - 1e-9
        assert lp.text_offset[0] == 0 and ("".join(lp.tokens) == prompt or "bytes:" in "".join(lp.tokens))
    # lm-eval's request: echo, logprobs 1 and one new token; the new token's entry comes last
    ids = tok.encode("To be, or not")
    r = base.client.completions.create(model="tiny", prompt=[ids], max_tokens=1, echo=True, logprobs=1,
                                       temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and r.choices[0].text.startswith("To be, or not")
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())  # greedy: the likeliest token
    # generated tokens' logprobs, streamed
    chunks = list(base.client.completions.create(model="tiny", prompt="KING:", max_tokens=6, temperature=0,
                                                 logprobs=2, stream=True))
    tokens = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    want = generate(eng, start_ids(tok, "KING:"), 6, 0, seed=0, stop_ids=(tok.eos_id,))
    assert b"".join(map(token_bytes, tokens)) == tok.decode(list(want))


def test_chat_sees_the_whole_conversation_as_nanoeuler_chat_does(chat, chat_model, chat_ckpt):
    eng, tok = chat_model
    first, question = "Hi", "Name a colour."
    system = {"role": "system", "content": "Be brief."}

    def ask(messages, **kw):
        return chat.client.chat.completions.create(model="tinychat", messages=messages, max_tokens=12,
                                                   temperature=0, **kw)

    alone = ask([{"role": "user", "content": question}])
    assert alone.choices[0].message.content == expected(chat_model, template.prompt_ids(tok, question), 12)[0]
    # the REPL: two lines, the second answered with the first turn in view
    repl = run_cli("chat", "--ckpt", chat_ckpt, "--device", "cpu", "--temperature", 0, "--max-new-tokens", 12,
                   input=f"{first}\n{question}\n")
    replies = re.findall(r"> (.+)\n", repl.stdout)
    assert repl.returncode == 0 and len(replies) == 2, repl.stdout
    history = [{"role": "user", "content": first}, {"role": "assistant", "content": replies[0]},
               {"role": "user", "content": question}]
    r = ask(history)
    ids = template.conversation_ids(tok, [(first, replies[0]), (question, None)])
    want = expected(chat_model, ids, 12)
    assert (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.prompt_tokens) == (
        want[0], want[1], len(ids)) and r.choices[0].message.content == replies[1]
    assert replies[1] != alone.choices[0].message.content  # the history changed the reply
    # a system message leads the conversation; streamed with logprobs
    chunks = list(ask([system] + history, stream=True, logprobs=True, top_logprobs=2))
    text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    ids = template.conversation_ids(tok, [(first, replies[0]), (question, None)], "Be brief.")
    assert text == expected(chat_model, ids, 12)[0]
    entries = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert all(len(e.top_logprobs) == 2 and e.logprob == e.top_logprobs[0].logprob for e in entries)
    assert bytes(b for e in entries for b in e.bytes).decode("utf-8", "replace").startswith(text)


def test_64_concurrent_requests_each_equal_to_its_solo_run(base, model):
    """Different prompt lengths and max_tokens, greedy and seeded sampling, streamed or not, all at once: each
    answer is token for token what generate() gives that request alone."""
    eng, tok = model
    text = tok.encode("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer")

    def case(i):  # 1 to 24 prompt tokens, 1 to what fits the context of 32 new ones
        n = 1 + (i * 5) % 24
        return dict(prompt=text[i % 8:i % 8 + n], max_tokens=1 + (i * 7) % (32 - n),
                    temperature=0.0 if i % 2 else 0.9, top_p=1.0, seed=100 + i)

    def ask(i):
        kw = case(i)
        if i % 4 < 2:
            r = base.client.completions.create(model="tiny", **kw)
            return r.choices[0].text, r.choices[0].finish_reason
        return streamed(base.client.completions.create(model="tiny", stream=True, **kw))[:2]

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(ask, range(64)))
    for i, answer in enumerate(answers):
        kw = case(i)
        assert answer == expected(model, kw["prompt"], kw["max_tokens"], kw["temperature"], 1.0, kw["seed"])[:2], i


def test_chained_steps_while_requests_wait_for_rows_each_equal_to_its_solo_run(model):
    """The scheduler as on the GPU (chained, pipelined steps), on the CPU engine, with more requests than rows:
    while newcomers wait for a row the steps chain, and each answer is still what generate() gives alone, stop
    strings included."""
    eng, tok = model
    text = tok.encode("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer")
    scheduler = Scheduler(eng, tok, rows=3, queue=16)
    scheduler.chained = CHAINED
    chains = []  # the steps of each decode, and whether a request was waiting for a row then

    def decode(seqs, steps, run=scheduler.generator._decode):
        chains.append((steps, any(job.queued for job in scheduler.jobs)))
        return run(seqs, steps)

    scheduler.generator._decode = decode
    cases = [dict(ids=text[i % 5:i % 5 + 1 + (i * 3) % 9], max_tokens=4 + (i * 7) % 20,
                  temperature=0.0 if i % 2 else 0.9, seed=50 + i, stop=("\x13y", "fa") if i % 3 == 0 else ())
             for i in range(10)]
    answers = [{"text": "", "reason": None} for _ in cases]

    def send(answer):
        def on(event):
            if event[0] == "text":
                answer["text"] += event[2]
            elif event[0] == "done":
                answer["reason"] = event[2]
        return on

    for case, answer in zip(cases, answers):
        settings = SamplingSettings(max_tokens=case["max_tokens"], temperature=case["temperature"], top_p=1.0,
                                    seed=case["seed"], stop=case["stop"])
        scheduler.submit(Job([case["ids"]], 1, settings, send(answer)))
    scheduler.run(lambda: False)
    assert any(steps > 1 and waiting for steps, waiting in chains), chains
    for case, answer in zip(cases, answers):
        want = expected(model, case["ids"], case["max_tokens"], case["temperature"], 1.0, case["seed"],
                        case["stop"])[:2]
        assert (answer["text"], answer["reason"]) == want, case
    # stop strings found inside a chain's text (a run of tokens searched at once)
    assert any(case["stop"] and answer["reason"] == "stop" for case, answer in zip(cases, answers))


BAD = [  # (route, body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"\xff\xfe", 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, -1]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**6]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", 3]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1] * 600}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 10**12}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "10"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": 2.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "temperature": -0.1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "top_p": -1}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "seed": -3}, 400, "seed"),
    ("/v1/completions", {"prompt": "a", "stop": 7}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 100}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "n": 2, "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "a", "frequency_penalty": 1}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "a", "suffix": "b"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "a", "model": 3}, 400, "model"),
    ("/v1/completions", b"x" * ((1 << 20) + 1), 413, None),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x"}]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 600}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -5},
     400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("/v1/nope", {}, 404, None),
]


def test_bad_input_gets_a_4xx_json_error_and_the_server_goes_on(chat):
    for route, body, status, param in BAD:
        got, answer = chat.request("POST", route, body)
        assert got == status and answer["error"]["param"] == param, (route, body, answer)
        assert answer["error"]["message"] and answer["error"]["type"] == "invalid_request_error"
    got, answer = chat.request("GET", "/v1/chat/completions")
    assert got == 405 and answer["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        chat.client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="context is 512"):
        chat.client.chat.completions.create(model="tinychat", messages=[{"role": "user", "content": "y " * 600}])
    r = chat.client.chat.completions.create(model="tinychat", messages=[{"role": "user", "content": "x"}],
                                            max_tokens=3)
    assert r.usage.completion_tokens >= 1 and chat.proc.poll() is None
    assert "Traceback" not in chat.output()


def _health(server, **want):
    deadline = time.monotonic() + 20
    while True:
        status, load = server.request("GET", "/health")
        if all(load[k] == v for k, v in want.items()) or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


def _open_stream(server, max_tokens, stream=True):
    """A raw completion whose request is sent (streamed: and its first event arrived): (connection, response)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "ROMEO:", "max_tokens": max_tokens,
                                                        "temperature": 0, "stream": stream}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {server.key}"})
    if not stream:
        return conn, None
    r = conn.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")
    return conn, r


def test_key_name_cors_429_disconnects_free_rows_and_sigterm_finishes_requests(chat_ckpt, tmp_path):
    server = Server(chat_ckpt, tmp_path / "one.log", "--slots", 1, "--queue", 0, "--api-key", "sesame",
                    "--served-model-name", "nano/chat-1", "--cors-origin", "http://example.test", key="sesame")
    try:
        assert [m.id for m in server.client.models.list().data] == ["nano/chat-1"]
        client = openai.OpenAI(base_url=server.client.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="nano/chat-1", prompt="a", max_tokens=1)
        status, answer = server.request("POST", "/v1/completions", {"prompt": "a"}, {})  # no key at all
        assert status == 401 and answer["error"]["code"] == "invalid_api_key"
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("OPTIONS", "/v1/completions", headers={"Origin": "http://example.test",
                                                            "Access-Control-Request-Method": "POST"})
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("access-control-allow-origin") == "http://example.test"
        conn, _ = _open_stream(server, 250)  # holds the one row for a while
        assert _health(server, active=1)["active"] == 1
        status, answer = server.request("POST", "/v1/completions", {"prompt": "b", "max_tokens": 2})
        assert status == 429 and answer["error"]["code"] == "overloaded"
        conn.close()  # the client leaves mid-stream: its row is freed at once
        assert _health(server, active=0)["active"] == 0
        conn, _ = _open_stream(server, 250, stream=False)  # a whole answer's client leaves too
        assert _health(server, active=1)["active"] == 1
        conn.close()
        assert _health(server, active=0)["active"] == 0
        r = server.client.completions.create(model="nano/chat-1", prompt="x", max_tokens=2)  # answered after all
        assert r.usage.completion_tokens >= 1
        conn, r = _open_stream(server, 250)
        server.proc.send_signal(signal.SIGTERM)  # finishes this request, then exits
        rest = r.read().decode()
        assert rest.rstrip().endswith("data: [DONE]") and '"finish_reason": "length"' in rest
        assert server.proc.wait(30) == 0
        with pytest.raises(ConnectionRefusedError):
            server.request("GET", "/health")
        assert "finishing the requests in flight" in server.output()
    finally:
        server.stop()


def test_missing_extra_busy_port_and_bad_flags_are_one_line_errors(tiny_ckpt, tmp_path, base):
    (tmp_path / "uvicorn.py").write_text("raise ImportError('no uvicorn here')\n")
    r = run_cli("serve", "--ckpt", tiny_ckpt, env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert r.returncode == 2 and r.stderr.strip() == ("nanoeuler: error: nanoeuler serve needs uvicorn, which does "
                                                      "not import (no uvicorn here): pip install -e '.[serve]'")
    r = run_cli("serve", "--ckpt", tiny_ckpt, "--port", base.port)
    assert r.returncode == 2 and "cannot listen on 127.0.0.1" in r.stderr and len(r.stderr.splitlines()) == 1
    for flags in (["--port", "70000"], ["--slots", "0"], ["--slots", "65"], ["--queue", "-1"]):
        r = run_cli("serve", "--ckpt", tiny_ckpt, *flags)
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and flags[0] in r.stderr, r.stderr


CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on PATH (chromium, chromium-browser, google-chrome); "
                    "installed by `apt-get install chromium` (make test runs it when root)")
@pytest.mark.parametrize("kind", ["chat", "base"])
def test_web_page_streams_a_reply_in_a_real_browser(kind, request, model, chat_model, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    server = request.getfixturevalue(kind)
    message = "Name a colour." if kind == "chat" else "ROMEO:"
    want = (expected(chat_model, template.prompt_ids(chat_model[1], message), 20)[0] if kind == "chat"
            else expected(model, message + "\n", 20, stop=("\n\n",))[0])
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 900, "height": 560})
            page.goto(f"http://127.0.0.1:{server.port}/")
            sync_api.expect(page.locator("#model")).to_contain_text(f"{kind} checkpoint")
            page.fill("#temperature", "0")
            page.fill("#max-tokens", "20")
            page.fill("#input", message)
            page.press("#input", "Enter")
            reply = page.locator(".msg.assistant").last
            sync_api.expect(reply).not_to_have_class(re.compile("streaming"), timeout=30_000)
            assert reply.text_content() == want
            sync_api.expect(page.locator("#stats")).to_contain_text("tokens/s")
            assert page.locator(".msg.user").last.text_content() == message
            page.screenshot(path=tmp_path / f"{kind}.png")
        finally:
            browser.close()


def test_chat_repl_keeps_the_conversation_and_drops_its_oldest_turns(tokenizer, monkeypatch):
    """`nanoeuler chat` with a chat checkpoint: each line is answered with the conversation so far in view,
    as the server renders messages; when it would leave no room for a reply, the oldest turns go; /reset
    starts afresh."""
    from types import SimpleNamespace

    from nanoeuler.infer import chat

    tok, context, max_new = tokenizer, 300, 8  # room for two turns of these, not three
    given, lines = [], iter(["Name a colour.", "And another?", "One more, please.", "/reset", "Hi"])

    def fake_generate(eng, ids, *args, **kwargs):
        given.append(list(ids))
        yield from tok.encode("Blue.")
        yield tok.eos_id

    def fake_input(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None
    eng = SimpleNamespace(cfg=SimpleNamespace(context=context))
    monkeypatch.setattr(chat, "load_model", lambda ckpt, device, **_: (eng, tok, SimpleNamespace(chat=True, step=0)))
    monkeypatch.setattr(chat, "generate", fake_generate)
    monkeypatch.setattr("builtins.input", fake_input)
    args = SimpleNamespace(ckpt="c.bin", device="cpu", speculative=0, seed=0, max_new_tokens=max_new,
                           temperature=0, top_k=0, top_p=1.0, stats=False)
    assert chat.main(args) == 0
    first, second, third = ("Name a colour.", "Blue."), ("And another?", "Blue."), ("One more, please.", None)
    assert given[0] == template.conversation_ids(tok, [(first[0], None)])
    assert given[1] == template.conversation_ids(tok, [first, (second[0], None)])  # the first turn in view
    assert given[2] == template.conversation_ids(tok, [second, third])  # the first turn dropped
    assert len(given[2]) <= context - max_new < len(template.conversation_ids(tok, [first, second, third]))
    assert given[3] == template.conversation_ids(tok, [("Hi", None)])  # after /reset
