"""`nanoeuler serve`: real servers on 127.0.0.1 (subprocesses of the tiny checkpoints) driven by the official
OpenAI client, raw HTTP for bad input, and a headless Chromium for the web page. Every expected output is
computed here with `sample.generate` on the same checkpoint, so "correct" means token for token."""
import concurrent.futures
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
from nanoeuler.infer.scheduler import held_back, stop_at
from nanoeuler.data.template import render_prompt

from conftest import ROOT, run_cli, tiny_config

openai = pytest.importorskip("openai")


class Server:
    """`python -m nanoeuler serve` on a free port of 127.0.0.1, its output in a file."""

    def __init__(self, ckpt, log, *flags):
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "nanoeuler", "serve", "--ckpt", str(ckpt),
                                          "--device", "cpu", "--port", "0", *map(str, flags)],
                                         cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not (m := re.search(r"on http://127\.0\.0\.1:(\d+)/ ", self.output())):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()
            time.sleep(0.05)
        self.port = int(m.group(1))
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", max_retries=0,
                                    timeout=60)

    def output(self):
        with open(self.log, errors="replace") as f:
            return f.read()

    def request(self, method, path, body=None, headers=None):
        """(status, parsed JSON) of one raw HTTP request; body: bytes, or an object sent as JSON."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        conn.request(method, path, data, headers or {"Content-Type": "application/json"})
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
    """The tiny model again, marked as a chat checkpoint (as `nanoeuler sft` writes)."""
    cfg = tiny_config(tokenizer.vocab_size)
    path = tmp_path_factory.mktemp("chat") / "tinychat.bin"
    checkpoint.save(path, cfg, init_params(cfg, seed=3), tokenizer.to_json(), step=0, chat=True)
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


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    eng, tok, _ = load_model(tiny_ckpt, "cpu")
    return eng, tok


def expected(model, prompt, max_tokens, temperature=0.0, top_p=1.0, seed=None, stop=()):
    """(text, finish_reason, prompt_tokens, completion_tokens) that the server must answer."""
    eng, tok = model
    ids = start_ids(tok, prompt)[-eng.cfg.context:]
    out = list(generate(eng, ids, max_tokens, temperature, 0, top_p, np.random.default_rng(seed),
                        stop_ids=(tok.eos_id,)))
    eos = out[-1] == tok.eos_id
    text = tok.decode(out[:-1] if eos else out).decode("utf-8", errors="replace")
    cut = stop_at(text, stop, 0)
    if cut >= 0:
        return text[:cut], "stop", len(ids), len(out)
    return text, "stop" if eos else "length", len(ids), len(out)


def streamed(stream):
    """(text, finish_reason, usage) of a streamed completion or chat completion."""
    text, reason, usage = [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text.append((choice.delta.content or "") if hasattr(choice, "delta") else choice.text)
            reason = choice.finish_reason or reason
    return "".join(text), reason, usage


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


def test_streaming_seed_stop_and_long_prompts(base, model):
    c = base.client
    text, reason, usage = streamed(c.completions.create(model="tiny", prompt="KING:", max_tokens=30, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
    assert (text, reason, usage.prompt_tokens, usage.completion_tokens) == expected(model, "KING:", 30)
    # a seed repeats a sample, exactly as generate() with that seed draws it
    sample = dict(model="tiny", prompt="Now", max_tokens=25, temperature=1.0, top_p=0.9, seed=11)
    a, b = (c.completions.create(**sample).choices[0].text for _ in range(2))
    assert a == b == expected(model, "Now", 25, 1.0, 0.9, 11)[0]
    # stop strings end the text where one first appears, cut, streamed or not
    stop = [text[7:10], "\x00never"]
    for stream in (False, True):
        r = c.completions.create(model="tiny", prompt="KING:", max_tokens=30, temperature=0, stop=stop, stream=stream)
        got = streamed(r)[:2] if stream else (r.choices[0].text, r.choices[0].finish_reason)
        assert got == (text[:text.find(stop[0])], "stop") == expected(model, "KING:", 30, stop=stop)[:2]
    # a prompt longer than the context keeps its last tokens
    long = "To be, or not to be, that is the question. " * 40
    r = c.completions.create(model="tiny", prompt=long, max_tokens=10, temperature=0)
    assert r.usage.prompt_tokens == 32 and r.choices[0].text == expected(model, long, 10)[0]


def test_chat_completions_are_nanoeuler_chat(chat, base, model, chat_ckpt):
    question = "Name a colour."
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": question}]
    r = chat.client.chat.completions.create(model="tinychat", messages=messages, max_tokens=12, temperature=0)
    want = expected(model, render_prompt(question), 12)
    assert (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.prompt_tokens,
            r.usage.completion_tokens) == want and r.choices[0].message.role == "assistant"
    text, reason, usage = streamed(chat.client.chat.completions.create(
        model="tinychat", messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert (text, reason, usage.completion_tokens) == (want[0], want[1], want[3])
    repl = run_cli("chat", "--ckpt", chat_ckpt, "--device", "cpu", "--temperature", 0, "--max-new-tokens", 12,
                   input=question + "\n")
    assert repl.returncode == 0 and f"> {want[0]}" in repl.stdout, repl.stdout
    with pytest.raises(openai.BadRequestError, match="base"):
        base.client.chat.completions.create(model="tiny", messages=messages[-1:])


def test_16_concurrent_clients_are_all_answered_correctly(base, model):
    def ask(i):
        prompt = f"Client {i} says:"
        kw = dict(model="tiny", prompt=prompt, max_tokens=20 + i, temperature=0.0 if i % 2 else 0.9,
                  top_p=1.0, seed=i)
        if i % 4 < 2:
            r = base.client.completions.create(**kw)
            return r.choices[0].text, r.choices[0].finish_reason
        return streamed(base.client.completions.create(**kw, stream=True))[:2]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    for i, answer in enumerate(answers):
        assert answer == expected(model, f"Client {i} says:", 20 + i, 0.0 if i % 2 else 0.9, 1.0, i)[:2], i


BAD = [  # (route, body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"\xff\xfe", 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
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
    ("/v1/completions", {"prompt": "a", "n": 3}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "a", "model": 3}, 400, "model"),
    ("/v1/completions", b"x" * ((1 << 20) + 1), 413, None),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -5},
     400, "max_completion_tokens"),
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


def _open_stream(server, max_tokens):
    """A raw streamed completion whose first event has arrived: (connection, response)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "ROMEO:", "max_tokens": max_tokens, "temperature": 0, "stream": True}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")
    return conn, r


def test_full_server_503_disconnect_frees_the_slot_and_sigterm_finishes_requests(tiny_ckpt, tmp_path):
    server = Server(tiny_ckpt, tmp_path / "one.log", "--slots", 1, "--queue", 0)
    try:
        conn, _ = _open_stream(server, 4096)  # holds the one slot for seconds
        assert _health(server, active=1)["active"] == 1
        status, answer = server.request("POST", "/v1/completions", {"prompt": "b", "max_tokens": 2})
        assert status == 503 and answer["error"]["code"] == "overloaded"
        conn.close()  # the client leaves mid-stream: its request is dropped at its next turn
        assert _health(server, active=0)["active"] == 0
        conn, r = _open_stream(server, 600)
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
    assert r.returncode == 2 and r.stderr.strip() == ("nanoeuler: error: nanoeuler serve needs its extra: "
                                                      "pip install '.[serve]'")
    r = run_cli("serve", "--ckpt", tiny_ckpt, "--port", base.port)
    assert r.returncode == 2 and "cannot listen on 127.0.0.1" in r.stderr and len(r.stderr.splitlines()) == 1
    for flags in (["--port", "70000"], ["--slots", "0"], ["--queue", "-1"]):
        r = run_cli("serve", "--ckpt", tiny_ckpt, *flags)
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and flags[0] in r.stderr, r.stderr


CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


@pytest.mark.skipif(CHROMIUM is None, reason="no system Chromium (apt-get install chromium)")
@pytest.mark.parametrize("kind", ["chat", "base"])
def test_web_page_streams_a_reply_in_a_real_browser(kind, request, model, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    server = request.getfixturevalue(kind)
    message = "Name a colour." if kind == "chat" else "ROMEO:"
    want = (expected(model, render_prompt(message), 20)[0] if kind == "chat"
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
