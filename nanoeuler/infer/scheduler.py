"""The model side of `nanoeuler serve`: every request's generation, on one thread, in turns.

The engines are not thread-safe, so one thread (the one that loaded the model) runs all model work, and the
HTTP handlers talk to it through this module: `Scheduler.submit` hands it a `Job` from any thread, and the job
reports back through its `send` callback (text deltas, then one final event). Each job keeps its own
`sample.generate` generator, so its own KV cache, random generator and context window; a turn advances one
job by one token, and the active jobs take turns round-robin, so concurrent requests progress together and
none waits for another to finish. At most `slots` jobs are active (each holds a KV cache); up to `queue` more
wait in arrival order; beyond that `submit` refuses. A cancelled job (its client went away) is dropped at its
next turn, which frees its slot.

Batching several jobs into one forward would need a KV cache with a position per row (`Engine.decode` takes
one position for the whole batch), so each turn is one job's decode step.
"""
import codecs
import collections
import sys
import threading
import traceback
from dataclasses import dataclass

import numpy as np

from nanoeuler.infer.generate import generate, start_ids


class Overloaded(Exception):
    """Every slot is busy and the waiting queue is full."""


@dataclass(frozen=True)
class SamplingSettings:
    """One request's generation settings, already validated (serve.py checks ranges and types)."""
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int = 0
    seed: int | None = None
    stop: tuple = ()  # strings: generation ends where the text first contains one, which is cut off


class Job:
    """One request. `send(event)` is called on the model thread, must not block, and receives
    ("text", delta) for each new piece of text, then exactly one of ("done", finish_reason, usage),
    ("error", message) or ("cancelled",)."""

    def __init__(self, prompt, settings, send):
        self.prompt, self.settings, self.send = prompt, settings, send
        self.cancelled = False  # set from any thread; the model thread drops the job at its next turn
        self.tokens = None  # the generate() iterator, from the job's first turn on

    def cancel(self):
        self.cancelled = True


def stop_at(text, stops, start):
    """The index in text of the first stop string found at or after start (or overlapping it), else -1."""
    hits = [i for s in stops if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
    return min(hits, default=-1)


def held_back(text, stops):
    """How many characters at the end of text could be the start of a stop string: they are not sent until
    the next tokens show whether the stop string completes."""
    longest = max(map(len, stops), default=0)
    for k in range(min(longest - 1, len(text)), 0, -1):
        if any(len(s) > k and text.endswith(s[:k]) for s in stops):
            return k
    return 0


class Scheduler:
    def __init__(self, eng, tok, slots, queue):
        self.eng, self.tok, self.slots, self.queue = eng, tok, slots, queue
        self.lock = threading.Condition()
        self.waiting = collections.deque()
        self.active = []

    def submit(self, job):
        """Queue a job (any thread); raises Overloaded when slots and queue are full."""
        with self.lock:
            if len(self.active) + len(self.waiting) >= self.slots + self.queue:
                raise Overloaded()
            self.waiting.append(job)
            self.lock.notify()

    def load(self):
        with self.lock:
            return {"active": len(self.active), "waiting": len(self.waiting), "slots": self.slots,
                    "queue": self.queue}

    def run(self, serving):
        """The model thread's loop: turns round-robin over the active jobs while serving() is true."""
        while serving():
            with self.lock:
                while self.waiting and len(self.active) < self.slots:
                    self.active.append(self.waiting.popleft())
                if not self.active:
                    self.lock.wait(0.2)
                    continue
                turn = list(self.active)
            for job in turn:
                if not self._turn(job):
                    with self.lock:
                        self.active.remove(job)

    def _turn(self, job):
        """Advance job by one token; False when it is finished (its final event sent)."""
        if job.cancelled:
            if job.tokens is not None:
                job.tokens.close()
            job.send(("cancelled",))
            return False
        try:
            if job.tokens is None:
                self._start(job)
            return self._step(job)
        except Exception as e:  # a bug must cost one request, not the server
            traceback.print_exc(file=sys.stderr)
            job.send(("error", f"generation failed: {type(e).__name__}: {e}"))
            return False

    def _start(self, job):
        """Tokenize the prompt (keeping its last `context` tokens, as `nanoeuler infer` does) and set up the
        job's generator."""
        p, ctx = job.settings, self.eng.cfg.context
        ids = start_ids(self.tok, job.prompt)[-ctx:]
        job.usage = {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
        job.tokens = generate(self.eng, ids, p.max_tokens, p.temperature, p.top_k, p.top_p,
                              np.random.default_rng(p.seed), stop_ids=(self.tok.eos_id,))
        job.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        job.text, job.sent = "", 0

    def _step(self, job):
        token = next(job.tokens)
        job.usage["completion_tokens"] += 1
        job.usage["total_tokens"] += 1
        eos = token == self.tok.eos_id
        last = eos or job.usage["completion_tokens"] == job.settings.max_tokens
        searched = len(job.text)
        job.text += job.decoder.decode(b"" if eos else self.tok.decode([token]), final=last)
        cut = stop_at(job.text, job.settings.stop, searched)
        if cut >= 0:
            job.text = job.text[:cut]
            return self._finish(job, "stop")
        if last:
            return self._finish(job, "stop" if eos else "length")
        ready = len(job.text) - held_back(job.text, job.settings.stop)
        if ready > job.sent:
            job.send(("text", job.text[job.sent:ready]))
            job.sent = ready
        return True

    def _finish(self, job, reason):
        job.tokens.close()
        if len(job.text) > job.sent:
            job.send(("text", job.text[job.sent:]))
        job.send(("done", reason, dict(job.usage)))
        return False
