"""`nanoeuler serve`: an OpenAI-compatible HTTP server for a checkpoint, and a web chat page.

    pip install '.[serve]'
    nanoeuler serve --ckpt nanoeuler_chat.bin [--host 127.0.0.1] [--port 8000] [--device auto|cpu|gpu]

    GET  /                      the web chat page (nanoeuler/infer/web/index.html: one file, no network)
    GET  /v1/models             the one model, named after the checkpoint file (`nanoeuler_chat`)
    POST /v1/completions        continue a prompt (any checkpoint)
    POST /v1/chat/completions   answer the last user message in the chat template (chat checkpoints)
    GET  /health                active and waiting requests

Any OpenAI client works against http://HOST:PORT/v1 (`openai.OpenAI(base_url=..., api_key="any")`). Both
POST routes take `stream` (server-sent events, one per token, `data: [DONE]` at the end; `stream_options:
{"include_usage": true}` adds a usage chunk), `max_tokens`, `temperature`, `top_p`, `stop`, `seed` (and
`top_k`, as `nanoeuler infer`), and answer with `usage` counts. Bad input gets a 4xx error in OpenAI's JSON
shape, `{"error": {"message", "type", "param", "code"}}`, and the server goes on.

Two threads: the model stays on the main thread, which loaded it and runs every request's generation in
turns (scheduler.py: the engines are not thread-safe); the HTTP server (Starlette on uvicorn) runs its event
loop on a second thread and hands requests over. SIGTERM or Ctrl-C stops accepting connections, lets the
requests in flight finish, then exits; a second Ctrl-C exits at once. A chat request is rendered as
`nanoeuler chat` renders a line: the last user message alone in the template (the model was fine-tuned on
single instructions), stopping at `</s>`, so the server and the REPL give the same replies.
"""
import asyncio
import json
import math
import os
import signal
import socket
import sys
import threading
import time
import uuid
from importlib.resources import files

from nanoeuler.errors import UserError

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.responses import HTMLResponse, JSONResponse, StreamingResponse
    from starlette.routing import Route
except ImportError:
    raise UserError("nanoeuler serve needs its extra: pip install '.[serve]'") from None

from nanoeuler.infer.generate import generate
from nanoeuler.io.checkpoint import load_model
from nanoeuler.infer.scheduler import Job, Overloaded, SamplingSettings, Scheduler
from nanoeuler.data.template import render_prompt

MAX_BODY = 1 << 20  # bytes of a request body
MAX_TOKENS = 4096  # the largest max_tokens a request may ask for
DEFAULT_MAX_TOKENS = 256
MAX_STOPS = 4  # as OpenAI
ROLES = ("system", "developer", "user", "assistant")


class ApiError(Exception):
    """A request the server refuses: its HTTP status and OpenAI's error fields."""

    def __init__(self, status, message, param=None, code=None, kind="invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def error_response(status, message, param=None, code=None, kind="invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


# ------------------------------------------------------------------------------------------ request fields
def _number(body, name, lo, hi, default, integer=False):
    """body[name] as a number in [lo, hi] (an int when integer), default when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ApiError(400, f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}", name)
    if not (lo <= value <= hi) or (not integer and not math.isfinite(value)):
        raise ApiError(400, f"{name} must be between {lo} and {hi}, got {value!r}", name)
    return value


def _flag(body, name, default=False):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, got {value!r}", name)
    return value


def _stops(body):
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or not 1 <= len(stops) <= MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)):
        raise ApiError(400, f"stop must be a non-empty string or a list of 1 to {MAX_STOPS} of them", "stop")
    return tuple(stops)


def _text(content, where):
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts, joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(c, dict) and c.get("type") == "text"
                                         and isinstance(c.get("text"), str) for c in content):
        return "".join(c["text"] for c in content)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts", where)


def chat_prompt(messages):
    """The prompt of a chat request: the last message, a user's, in the chat template, as `nanoeuler chat`
    gives it. The earlier messages are checked but not shown to the model, which was fine-tuned on single
    instructions."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"{where} must be an object with a role among {', '.join(ROLES)}", where)
        if not (m["role"] == "assistant" and m.get("content") is None):
            _text(m.get("content"), where)
    if messages[-1]["role"] != "user":
        raise ApiError(400, "the last message must be the user's", "messages")
    return render_prompt(_text(messages[-1]["content"], f"messages[{len(messages) - 1}]"))


def parse_request(body, chat, model):
    """(prompt, SamplingSettings, stream, include_usage) of a request body, or ApiError."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    name = body.get("model")
    if name is not None and name != model.id:
        if not isinstance(name, str):
            raise ApiError(400, "model must be a string", "model")
        raise ApiError(404, f"the model {name!r} does not exist; this server has {model.id!r}", "model",
                       "model_not_found")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise ApiError(400, f"n must be 1 (one choice per request), got {n!r}", "n")
    for name in ("echo", "logprobs", "suffix", "tools"):
        if body.get(name) not in (None, False, 0, [], ""):
            raise ApiError(400, f"{name} is not supported", name)
    if chat:
        if not model.chat:
            raise ApiError(400, f"{model.id} is a base (pretrained) checkpoint, not a chat one: use "
                                "/v1/completions", "messages", "not_a_chat_model")
        prompt = chat_prompt(body.get("messages"))
    else:
        prompt = body.get("prompt", "")
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string", "prompt")
    limit = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    settings = SamplingSettings(max_tokens=_number(body, limit, 1, MAX_TOKENS, DEFAULT_MAX_TOKENS, integer=True),
                                temperature=_number(body, "temperature", 0, 2, 0.8),
                                top_p=_number(body, "top_p", 0, 1, 0.95),
                                top_k=_number(body, "top_k", 0, model.vocab, 0, integer=True),
                                seed=_number(body, "seed", 0, 2**63 - 1, None, integer=True),
                                stop=_stops(body))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    return prompt, settings, _flag(body, "stream"), _flag(options or {}, "include_usage")


async def read_json(request):
    """The request body as JSON, at most MAX_BODY bytes."""
    if int(request.headers.get("content-length") or 0) > MAX_BODY:
        raise ApiError(413, f"the request body is larger than {MAX_BODY} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise ApiError(413, f"the request body is larger than {MAX_BODY} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except ValueError as e:  # UnicodeDecodeError is one too
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


# ------------------------------------------------------------------------------------------ responses
class ModelCard:
    """What the server says about its checkpoint."""

    def __init__(self, ckpt, ck):
        self.id = os.path.splitext(os.path.basename(ckpt))[0]
        self.created = int(os.path.getmtime(ckpt))
        self.chat, self.context, self.vocab = ck.chat, ck.cfg.context, ck.cfg.vocab_size

    def card(self):
        # `chat` and `context` are ours (OpenAI clients ignore them): the web page reads them
        return {"id": self.id, "object": "model", "created": self.created, "owned_by": "nanoeuler",
                "chat": self.chat, "context": self.context}


class Reply:
    """The response objects of one request, in OpenAI's shapes for completions and chat completions."""

    def __init__(self, model, chat):
        self.chat, self.model = chat, model.id
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _object(self, kind, choices, **extra):
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def whole(self, text, reason, usage):
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
            return self._object("chat.completion", [choice], usage=usage)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return self._object("text_completion", [choice], usage=usage)

    def chunk(self, text=None, reason=None, first=False):
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            return self._object("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return self._object("text_completion", [choice])

    def usage_chunk(self, usage):
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage)


class JobStream(StreamingResponse):
    """Server-sent events of a job; however the response ends (done, or the client gone, even before the first
    event), the job is cancelled, which frees its slot if it is still generating."""

    def __init__(self, job, events):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


def _sse(obj):
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _error_body(message, kind="server_error"):
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


# ------------------------------------------------------------------------------------------ the app
def build_app(scheduler, model):
    page = files("nanoeuler.infer").joinpath("web/index.html").read_text(encoding="utf-8")

    def submit(prompt, settings):
        """A job for the scheduler whose events land in an asyncio queue of this event loop."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def send(event):
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop has closed (forced exit): nobody is listening
                pass

        job = Job(prompt, settings, send)
        try:
            scheduler.submit(job)
        except Overloaded:
            raise ApiError(503, "the server is busy (every slot and the queue are full); retry later",
                           code="overloaded", kind="server_error") from None
        return job, events

    async def stream(events, reply, include_usage):
        if reply.chat:
            yield _sse(reply.chunk(first=True))
        while True:
            event = await events.get()
            if event[0] == "text":
                yield _sse(reply.chunk(event[1]))
            elif event[0] == "done":
                yield _sse(reply.chunk(reason=event[1]))
                if include_usage:
                    yield _sse(reply.usage_chunk(event[2]))
                yield "data: [DONE]\n\n"
                return
            else:
                yield _sse(_error_body(event[1] if event[0] == "error" else "cancelled"))
                return

    async def collect(request, job, events, reply):
        async def watch():  # the body is read, so the next message is the client leaving
            while (await request.receive())["type"] != "http.disconnect":
                pass
            job.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            text = []
            while True:
                event = await events.get()
                if event[0] == "text":
                    text.append(event[1])
                elif event[0] == "done":
                    return JSONResponse(reply.whole("".join(text), event[1], event[2]))
                elif event[0] == "error":
                    return JSONResponse(_error_body(event[1]), status_code=500)
                else:
                    return JSONResponse(_error_body("cancelled"), status_code=499)
        finally:
            watcher.cancel()
            job.cancel()

    async def complete(request, chat):
        prompt, settings, streamed, include_usage = parse_request(await read_json(request), chat, model)
        job, events = submit(prompt, settings)
        reply = Reply(model, chat)
        if streamed:
            return JobStream(job, stream(events, reply, include_usage))
        return await collect(request, job, events, reply)

    async def index(request):
        return HTMLResponse(page)

    async def health(request):
        return JSONResponse({"status": "ok", **scheduler.load()})

    async def completions(request):
        return await complete(request, chat=False)

    async def chat_completions(request):
        return await complete(request, chat=True)

    async def models(request):
        return JSONResponse({"object": "list", "data": [model.card()]})

    async def one_model(request):
        if request.path_params["name"] != model.id:
            raise ApiError(404, f"the model {request.path_params['name']!r} does not exist", "model",
                           "model_not_found")
        return JSONResponse(model.card())

    async def on_api_error(request, e):
        return error_response(e.status, e.message, e.param, e.code, e.kind)

    async def on_http_error(request, e):  # unknown path, wrong method
        return error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}")

    async def on_disconnect(request, e):  # the client left while sending its body: nobody to answer
        return error_response(400, "the client disconnected")

    async def on_bug(request, e):  # uvicorn logs the traceback
        return error_response(500, f"internal error: {type(e).__name__}", kind="server_error")

    routes = [
        Route("/", index),
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/models/{name:path}", one_model),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={
        ApiError: on_api_error, HTTPException: on_http_error, ClientDisconnect: on_disconnect, Exception: on_bug})


def listen(host, port):
    """A listening socket on host:port (port 0: any free port), or a one-line error."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def main(args):
    sock = listen(args.host, args.port)  # first: a busy port fails before a large model loads
    eng, tok, ck = load_model(args.ckpt, args.device)
    model = ModelCard(args.ckpt, ck)
    for _ in generate(eng, [tok.eos_id], 2, temperature=0):  # compile (or load) the kernels before serving
        pass
    scheduler = Scheduler(eng, tok, args.slots, args.queue)
    server = uvicorn.Server(uvicorn.Config(build_app(scheduler, model), log_level="warning", lifespan="off"))

    def stop(signum, frame):
        if server.should_exit:  # the second signal: leave now
            raise KeyboardInterrupt
        server.should_exit = True
        print(f"nanoeuler serve: {signal.Signals(signum).name}: finishing the requests in flight, then "
              "exiting (Ctrl-C again to stop at once)", file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="http", daemon=True)
    http.start()
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/"
    kind = "chat" if model.chat else "base"
    device = "CPU" if eng.xp.__name__ == "numpy" else "GPU"
    print(f"nanoeuler serve: {model.id} ({kind} checkpoint, {device}) on {url} (OpenAI API under {url}v1)",
          flush=True)
    scheduler.run(http.is_alive)
    http.join()
    if not server.started:
        raise UserError("the HTTP server stopped before it started (see the messages above)")
    return 0
