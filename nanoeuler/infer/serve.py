"""`nanoeuler serve`: an OpenAI-compatible HTTP server for a checkpoint, and a web chat page.

    pip install -e '.[serve]'
    nanoeuler serve --ckpt nanoeuler_chat.bin [--host 127.0.0.1] [--port 8000] [--device auto|cpu|gpu]
                    [--api-key KEY] [--cors-origin ORIGIN] [--served-model-name NAME] [--slots 64] [--queue 256]
                    [--context N] [--no-batch-invariance]

    GET  /                      the web chat page (nanoeuler/infer/web/index.html: one file, no network)
    GET  /v1/models             the one model, named after the checkpoint file (`nanoeuler_chat`) or --served-model-name
    POST /v1/completions        continue prompts (any checkpoint); echo and log-probabilities for scoring
    POST /v1/chat/completions   answer a conversation rendered in the chat template (chat checkpoints: the
                                model's own template when it brings one, else data/template.py's)
    POST /tokenize, /detokenize, GET /tokenizer_info   the tokenizer, as vLLM serves it (lm-eval reads these)
    GET  /health                active and waiting requests

Any OpenAI client works against http://HOST:PORT/v1 (`openai.OpenAI(base_url=..., api_key=KEY or "any")`),
and so does lm-evaluation-harness's `local-completions`. docs/serve.md lists every field and error. Requests
the server cannot honour (a `logit_bias`, penalties, `tools`, a `response_format`, `best_of` other than `n`)
are a 400 naming the parameter, never silently ignored; a prompt longer than the context is a 400 with code
`context_length_exceeded`. The context is the positions a slot of the KV cache holds: the model's, or fewer
where slots x the model's context does not fit the memory (kv_budget.py; --context, --slots).

Threads: the model stays on the main thread, which loaded it, and runs the scheduler (scheduler.py: every
active request advances one token per batched step); the HTTP server (Starlette on uvicorn) runs its event
loop on a second thread, validates a request, tokenizes it on a third (so a long prompt never holds up the
event loop or the model) and hands it to the scheduler, whose events come back through an asyncio queue.
SIGTERM or Ctrl-C stops accepting connections, lets the requests in flight finish, then exits; a second
Ctrl-C exits at once.
"""
import asyncio
import concurrent.futures
import gc
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

from nanoeuler.errors import UserError, require

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.requests import ClientDisconnect
    from starlette.responses import HTMLResponse, JSONResponse, StreamingResponse
    from starlette.routing import Route
except ImportError:
    require("uvicorn", "starlette", what="nanoeuler serve")  # one line naming the one that is missing
    raise

from nanoeuler.data import jinja_template
from nanoeuler.data.template import conversation_ids, own_template
from nanoeuler.infer import kv_budget
from nanoeuler.infer.generate import start_ids
from nanoeuler.infer.scheduler import Job, Overloaded, SamplingSettings, Scheduler
from nanoeuler.io.checkpoint import load_model
from nanoeuler.model.limits import DECODE_ROWS

MAX_BODY = 1 << 20  # bytes of a request body
MAX_TOKENS = 4096  # the largest max_tokens a request may ask for
DEFAULT_MAX_TOKENS = 256
MAX_STOPS = 4  # as OpenAI
MAX_N = 128  # choices a prompt, as OpenAI
MAX_CHOICES = 256  # prompts x n in one request
MAX_LOGPROBS = 20  # alternatives a position (OpenAI: 5 for completions, 20 for chat)
LAST_EVENTS = ("end", "error", "cancelled")  # a job's events after which its stream ends
SYSTEM_ROLES = ("system", "developer")
ROLES = (*SYSTEM_ROLES, "user", "assistant")

# Parameters the server cannot honour: any value but these defaults is a 400 naming the parameter.
UNSUPPORTED = {
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "suffix": (None, ""),
}


class ApiError(Exception):
    """A request the server refuses: its HTTP status and OpenAI's error fields."""

    def __init__(self, status, message, param=None, code=None, kind="invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def error_body(message, kind="invalid_request_error", param=None, code=None):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status, message, param=None, code=None, kind="invalid_request_error"):
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


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


def _refuse_unsupported(body):
    for name, defaults in UNSUPPORTED.items():
        if body.get(name) not in defaults:
            raise ApiError(400, f"{name} is not supported by this server", name, "unsupported_parameter")


def _text(content, where):
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts, joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(c, dict) and c.get("type") == "text"
                                         and isinstance(c.get("text"), str) for c in content):
        return "".join(c["text"] for c in content)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts", where)


def chat_messages(messages):
    """A chat request's messages as [{"role", "content"}], validated: content as one string, a developer
    message as a system one, an assistant message without text (another server's tool call) left out; an
    assistant message must follow a user message, and the last message must be the user's."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"{where} must be an object with a role among {', '.join(ROLES)}", where)
        role = m["role"]
        if role == "assistant" and m.get("content") is None:  # a tool-call turn of another server: no text
            continue
        if role == "assistant" and not any(o["role"] == "user" for o in out):
            raise ApiError(400, f"{where}: an assistant message must follow a user message", where)
        out.append({"role": "system" if role in SYSTEM_ROLES else role, "content": _text(m.get("content"), where)})
    if not out or out[-1]["role"] != "user":
        raise ApiError(400, "the last message must be the user's", "messages")
    return out


def conversation(messages):
    """(system text, turns) of a chat request's messages for our Alpaca template: turns are (instruction,
    reply) pairs, the last reply None. Consecutive messages of one role are joined by a blank line; system
    and developer messages make the system text, wherever they stand."""
    system, turns = [], []
    for m in chat_messages(messages):
        role, text = m["role"], m["content"]
        if role == "system":
            system.append(text)
        elif role == "user":
            if turns and turns[-1][1] is None:
                turns[-1][0] += "\n\n" + text
            else:
                turns.append([text, None])
        else:
            turns[-1][1] = text if turns[-1][1] is None else turns[-1][1] + "\n\n" + text
    return "\n\n".join(system), [tuple(t) for t in turns]


def _prompts(body, vocab):
    """A completions request's prompts: each a string or a list of token ids (OpenAI's four forms)."""
    prompt = body.get("prompt", "")
    ids = lambda p: isinstance(p, list) and p and all(type(t) is int and 0 <= t < vocab for t in p)
    if isinstance(prompt, str) or ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or ids(p) for p in prompt):
        return prompt
    raise ApiError(400, "prompt must be a string, a list of strings, a non-empty list of token ids (each 0 to "
                        f"{vocab - 1}) or a list of such lists", "prompt")


class Parsed:
    """A validated request: its prompts (strings or token ids for completions; for chat one (system, turns)
    conversation), choices per prompt, sampling settings, and how to answer."""

    def __init__(self, body, chat, model):
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        name = body.get("model")
        if name is not None and name != model.id:
            if not isinstance(name, str):
                raise ApiError(400, "model must be a string", "model")
            raise ApiError(404, f"the model {name!r} does not exist; this server has {model.id!r}", "model",
                           "model_not_found")
        _refuse_unsupported(body)
        self.chat = chat
        self.n = _number(body, "n", 1, MAX_N, 1, integer=True)
        best_of = _number(body, "best_of", 1, MAX_N, self.n, integer=True)
        if best_of != self.n:
            raise ApiError(400, f"best_of must equal n ({self.n}): the server returns every choice it generates, "
                                f"got {best_of}", "best_of")
        if chat:
            if not model.chat:
                raise ApiError(400, f"{model.id} is a base (pretrained) checkpoint, not a chat one: use "
                                    "/v1/completions", "messages", "not_a_chat_model")
            messages = chat_messages(body.get("messages"))  # the model's own template takes them as they are
            self.prompts, self.echo = [messages if model.own_template else conversation(messages)], False
            wants = _flag(body, "logprobs")
            top = _number(body, "top_logprobs", 0, MAX_LOGPROBS, None, integer=True)
            if top is not None and not wants:
                raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            logprobs = (top or 0) if wants else None
            limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
            lowest = 1
        else:
            self.prompts, self.echo = _prompts(body, model.vocab), _flag(body, "echo")
            logprobs = _number(body, "logprobs", 0, MAX_LOGPROBS, None, integer=True)
            limit, lowest = "max_tokens", 0 if self.echo else 1
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise ApiError(400, f"at most {MAX_CHOICES} choices a request (prompts x n), got "
                                f"{len(self.prompts)} x {self.n}", "n")
        max_tokens = _number(body, limit, lowest, MAX_TOKENS, DEFAULT_MAX_TOKENS, integer=True)
        self.settings = SamplingSettings(max_tokens=max_tokens,
                                         temperature=_number(body, "temperature", 0, 2, 0.8),
                                         top_p=_number(body, "top_p", 0, 1, 0.95),
                                         top_k=_number(body, "top_k", 0, model.vocab, 0, integer=True),
                                         seed=_number(body, "seed", 0, 2**63 - 1, None, integer=True),
                                         stop=_stops(body), logprobs=logprobs)
        self.stream = _flag(body, "stream")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object", "stream_options")
        self.include_usage = _flag(options or {}, "include_usage")

    def token_ids(self, tok, context, model_context=None):
        """Each prompt's token ids (run off the event loop: a long prompt takes a while), or ApiError for one
        longer than the context (the server's: the model's context, or a KV cache slot's where that is fewer)."""
        if self.chat:
            try:
                if own_template(tok):
                    prompts = [jinja_template.prompt_ids(tok, self.prompts[0])]
                else:
                    system, turns = self.prompts[0]
                    prompts = [conversation_ids(tok, turns, system)]
            except UserError as e:  # the model's template refuses the conversation
                raise ApiError(400, str(e), "messages", "chat_template_error") from None
        else:
            prompts = [p if isinstance(p, list) else start_ids(tok, p) for p in self.prompts]
        # a new token needs a position of its own after the prompt; scoring alone (max_tokens 0) does not
        room = context - (self.settings.max_tokens > 0)
        for i, ids in enumerate(prompts):
            if len(ids) > room:
                what = "the conversation" if self.chat else "the prompt" if len(prompts) == 1 else f"prompt {i}"
                whose = "model" if model_context in (None, context) else "server"
                raise ApiError(400, f"this {whose}'s context is {context} tokens; {what} has {len(ids)}"
                               + (", and a new token needs one more" if len(ids) == context else ""),
                               "messages" if self.chat else "prompt", "context_length_exceeded")
        return prompts


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

    def __init__(self, ckpt, ck, name=None, tok=None, context=None):
        self.id = name or os.path.splitext(os.path.basename(ckpt))[0]
        self.created = int(os.path.getmtime(ckpt))
        self.chat, self.vocab = ck.chat, ck.cfg.vocab_size
        # the context served (a KV cache slot's positions) and the model's own
        self.model_context = ck.cfg.context
        self.context = ck.cfg.context if context is None else context
        self.own_template = own_template(tok)  # an imported chat model: its messages go to its template as they are

    def card(self):
        # `chat` and `context` are ours (OpenAI clients ignore them): the web page reads them;
        # `max_model_len` is vLLM's name for the context, which some clients read
        return {"id": self.id, "object": "model", "created": self.created, "owned_by": "nanoeuler",
                "chat": self.chat, "context": self.context, "max_model_len": self.context}


def completion_logprobs(entries):
    """OpenAI's completions `logprobs` object of LogProb entries."""
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.top is None else {t: lp for t, _, lp in e.top} for e in entries],
            "text_offset": [e.offset for e in entries]}


def chat_logprobs(entries):
    """OpenAI's chat `logprobs` object of LogProb entries."""
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes),
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)} for t, b, lp in e.top or ()]}
                        for e in entries], "refusal": None}


class Reply:
    """The response objects of one request, in OpenAI's shapes for completions and chat completions."""

    def __init__(self, model, parsed):
        self.chat, self.model, self.logprobs = parsed.chat, model.id, parsed.settings.logprobs is not None
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _object(self, kind, choices, **extra):
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def _logprobs(self, entries):
        if not self.logprobs:
            return None
        return chat_logprobs(entries) if self.chat else completion_logprobs(entries)

    def whole(self, choices, usage):
        """choices: per index, (text, LogProb entries, finish_reason)."""
        out = []
        for index, (text, entries, reason) in sorted(choices.items()):
            logprobs = self._logprobs(entries)
            if self.chat:
                out.append({"index": index, "message": {"role": "assistant", "content": text},
                            "logprobs": logprobs, "finish_reason": reason})
            else:
                out.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason})
        return self._object("chat.completion" if self.chat else "text_completion", out, usage=usage)

    def chunk(self, index, text=None, entries=(), reason=None, first=False):
        logprobs = self._logprobs(entries) if entries else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            return self._object("chat.completion.chunk", [choice])
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        return self._object("text_completion", [choice])

    def usage_chunk(self, usage):
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage)


class JobStream(StreamingResponse):
    """Server-sent events of a job; however the response ends (done, or the client gone, even before the first
    event), the job is cancelled, which frees its rows if it is still generating. The client's leaving is
    watched by a plain task, which cancels the job (the scheduler then ends the stream), rather than by
    Starlette's task group a response, which costs the event loop more (docs/serve.md)."""

    def __init__(self, job, events):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send):
        async def watch():  # the body is read, so the next message is the client leaving
            while (await receive())["type"] != "http.disconnect":
                pass
            self.job.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await self.stream_response(send)
        except OSError:
            raise ClientDisconnect() from None
        finally:
            watcher.cancel()
            self.job.cancel()


def _sse(obj):
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ApiKey:
    """ASGI middleware: every route but the page and /health needs `Authorization: Bearer KEY` (a 401 in
    OpenAI's shape otherwise)."""

    OPEN = ("/", "/health")

    def __init__(self, app, key):
        self.app, self.key = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.OPEN:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if given.strip() != self.key:
                what = "a wrong API key" if given else "no API key (Authorization: Bearer KEY)"
                response = error_response(401, f"this server needs its API key; the request has {what}",
                                          code="invalid_api_key")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


# ------------------------------------------------------------------------------------------ the app
def build_app(scheduler, model, tok, api_key=None, cors_origins=()):
    page = files("nanoeuler.infer").joinpath("web/index.html").read_text(encoding="utf-8")
    # the tokenizer keeps a cache that is not thread-safe: one thread does all encoding, off the event loop
    tokenizing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    # the model thread's events for every job, handed to the event loop in one wake-up a batch: a step's
    # events for all its rows cost one cross-thread call, not one each
    outbox, outbox_lock = [], threading.Lock()

    def deliver():
        with outbox_lock:
            batch = outbox[:]
            outbox.clear()
        for events, event in batch:
            events.put_nowait(event)

    async def submit(parsed):
        """A job for the scheduler whose events land in an asyncio queue of this event loop."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        prompts = await loop.run_in_executor(tokenizing, parsed.token_ids, tok, model.context,
                                             model.model_context)

        def send(event):
            with outbox_lock:
                outbox.append((events, event))
                if len(outbox) > 1:  # a delivery is already on its way
                    return
            try:
                loop.call_soon_threadsafe(deliver)
            except RuntimeError:  # the event loop has closed (forced exit): nobody is listening
                pass

        scored = parsed.echo and parsed.settings.logprobs is not None  # the prompt's own log-probabilities
        job = Job(prompts, parsed.n, parsed.settings, send, score_prompts=scored)
        try:
            scheduler.submit(job)
        except Overloaded:
            raise ApiError(429, "the server is busy (every row and the waiting queue are full); retry later",
                           code="overloaded", kind="rate_limit_exceeded") from None
        return job, events, prompts

    def echoes(parsed, prompts):
        """The text each choice starts with: its prompt with echo on (as given, or the text of its ids), else
        nothing."""
        texts = [p if isinstance(p, str) else tok.decode(ids).decode("utf-8", errors="replace")
                 for p, ids in zip(parsed.prompts, prompts)] if parsed.echo else [""] * len(prompts)
        return [text for text in texts for _ in range(parsed.n)]

    def shifted(entries, echo):
        """Generated tokens' LogProb entries with their offsets counted from the start of the echoed prompt."""
        return [e._replace(offset=e.offset + len(echo)) for e in entries] if echo else entries

    def sse(event, echoes, reply, include_usage):
        """The server-sent events of one of the job's events."""
        kind = event[0]
        if kind == "prompt":  # echo with logprobs: the prompt's text and its tokens' log-probabilities
            return _sse(reply.chunk(event[1], echoes[event[1]], event[2]))
        if kind == "text":
            return _sse(reply.chunk(event[1], event[2], shifted(event[3], echoes[event[1]])))
        if kind == "done":
            return _sse(reply.chunk(event[1], reason=event[2]))
        if kind == "end":
            return (_sse(reply.usage_chunk(event[1])) if include_usage else "") + "data: [DONE]\n\n"
        return _sse(error_body(event[1] if kind == "error" else "cancelled", "server_error"))

    async def stream(job, events, echoes, reply, include_usage):
        """The job's server-sent events; those that have arrived together go out in one write (a choice's text
        with its end, the usage and [DONE]), since each write costs the event loop more than its events do."""
        opening = "".join(_sse(reply.chunk(index, first=True)) if reply.chat else _sse(reply.chunk(index, echo))
                          for index, echo in enumerate(echoes) if reply.chat or (echo and not job.score_prompts))
        if opening:
            yield opening
        while True:
            ready = [await events.get()]
            while not events.empty() and ready[-1][0] not in LAST_EVENTS:
                ready.append(events.get_nowait())
            yield "".join(sse(event, echoes, reply, include_usage) for event in ready)
            if ready[-1][0] in LAST_EVENTS:
                return

    async def collect(request, job, events, echoes, reply):
        async def watch():  # the body is read, so the next message is the client leaving
            while (await request.receive())["type"] != "http.disconnect":
                pass
            job.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            choices = {i: [echo, [], None] for i, echo in enumerate(echoes)}
            while True:
                event = await events.get()
                kind = event[0]
                if kind == "prompt":
                    choices[event[1]][1][:0] = event[2]
                elif kind == "text":
                    choices[event[1]][0] += event[2]
                    choices[event[1]][1] += shifted(event[3], echoes[event[1]])
                elif kind == "done":
                    choices[event[1]][2] = event[2]
                elif kind == "end":
                    return JSONResponse(reply.whole({i: tuple(c) for i, c in choices.items()}, event[1]))
                elif kind == "error":
                    return JSONResponse(error_body(event[1], "server_error"), status_code=500)
                else:
                    return JSONResponse(error_body("cancelled", "server_error"), status_code=499)
        finally:
            watcher.cancel()
            job.cancel()

    async def complete(request, chat):
        parsed = Parsed(await read_json(request), chat, model)
        job, events, prompts = await submit(parsed)
        reply, texts = Reply(model, parsed), echoes(parsed, prompts)
        if parsed.stream:
            return JobStream(job, stream(job, events, texts, reply, parsed.include_usage))
        return await collect(request, job, events, texts, reply)

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

    async def tokenize(request):
        """vLLM's /tokenize: special tokens written in the text are theirs, as a Hugging Face tokenizer reads
        them (lm-eval finds the end-of-text id this way)."""
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            raise ApiError(400, "the body must be {\"prompt\": TEXT}", "prompt")
        ids = await asyncio.get_running_loop().run_in_executor(
            tokenizing, lambda: tok.encode(body["prompt"], allow_special=True))
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": model.context})

    async def detokenize(request):
        body = await read_json(request)
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < model.vocab for t in ids):
            raise ApiError(400, f"the body must be {{\"tokens\": [ids 0 to {model.vocab - 1}]}}", "tokens")
        # the ids begin a text: the space a SentencePiece encoder put in front goes, as its decoder drops it
        return JSONResponse({"prompt": tok.decode(ids, text_start=True).decode("utf-8", errors="replace")})

    async def tokenizer_info(request):
        named = tok.named_tokens
        return JSONResponse({"eos_token": tok.decode([tok.eos_id]).decode(), "bos_token": named.get("bos_token"),
                             "pad_token": named.get("pad_token"),
                             "model_max_length": model.context, "tokenizer_class": "nanoeuler-bpe"})

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
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info),
    ]
    middleware = []
    if cors_origins:  # outermost: a browser's preflight request carries no key
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"],
                                     allow_headers=["*"]))
    if api_key:
        middleware.append(Middleware(ApiKey, key=api_key))
    return Starlette(routes=routes, middleware=middleware, exception_handlers={
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


def kv_cache_plan(eng, slots, context, gpu_memory=None):
    """The KV cache's slots and positions for this engine (kv_budget.plan over the memory left after the
    weights, or within gpu_memory bytes in all: --gpu-memory), and the startup line that says so."""
    gpu = eng.xp.__name__ != "numpy"
    plan = kv_budget.plan(eng.cfg, eng.act.itemsize, kv_budget.available(eng.cfg, gpu, gpu_memory), slots, context)
    name = {"bfloat16": "bf16"}.get(eng.act.name, eng.act.name)
    return plan, kv_budget.describe(plan, name, eng.cfg.context)


def main(args):
    slots, context = args.slots, getattr(args, "context", None)
    if slots is not None and slots > DECODE_ROWS:
        raise UserError(f"--slots must be 1 to {DECODE_ROWS} (rows of one decoding batch), got {slots}")
    sock = listen(args.host, args.port)  # first: a busy port fails before a large model loads
    eng, tok, ck = load_model(args.ckpt, args.device, not args.no_batch_invariance,
                             adapter=getattr(args, "adapter", None))
    plan, line = kv_cache_plan(eng, slots, context, getattr(args, "gpu_memory", None))
    print(f"nanoeuler serve: {line}", flush=True)
    model = ModelCard(args.ckpt, ck, args.served_model_name, tok, plan.context)
    scheduler = Scheduler(eng, tok, plan.slots, args.queue, plan.context)
    scheduler.warm_up()  # compile (or load) the kernels before serving
    # what is loaded stays: out of the garbage collector's sight, whose full passes over it (the engine's and
    # the compilers' objects) would otherwise stall serving for tens of milliseconds at a time
    gc.collect()
    gc.freeze()
    # the model thread, back from waiting for the device, launches the next steps as soon as it holds the
    # interpreter lock: while the event loop is busy, Python hands the lock over after at most this (5 ms by
    # default: a device idle that long a chain at 64 clients)
    sys.setswitchinterval(0.0005)
    app = build_app(scheduler, model, tok, args.api_key, args.cors_origin or ())
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))

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
