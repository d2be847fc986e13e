"""The model side of `nanoeuler serve`: continuous batching of every request's generation on one thread.

The engines are not thread-safe, so one thread (the one that loaded the model) runs all model work, and the
HTTP handlers talk to it through this module: `Scheduler.submit` hands it a `Job` (tokenized prompts, choices
a prompt, settings) from any thread, and the job reports back through its `send` callback. Each choice of a
job is one sequence of a `batch.BatchGenerator`: every step of the loop advances all active sequences by one
token in one batched forward, new sequences join at step boundaries (their prefill in chunks, inside the
generator's steps, so a long prompt never stops the others for long), and a finished or cancelled one leaves
its row at once for the next. Admission is first come, first served: at most `rows` sequences generate, the
jobs beyond wait in arrival order, up to `queue` of them; beyond that `submit` refuses (the server's 429).

Scoring (echo with logprobs: the log-probability of each prompt token, what loglikelihood evaluation asks
for) runs a full forward of the prompts (`Engine.logits`), a bounded piece of them between two decoding
steps, so it stalls the decoding rows no longer than one step of prefill would.

Text: each choice decodes its tokens through an incremental UTF-8 decoder, cuts at the first stop string, and
holds back text that could be the start of one until the next token decides.
"""
import codecs
import collections
import itertools
import sys
import threading
import traceback
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from nanoeuler.infer.batch import BatchGenerator, Request
from nanoeuler.model.decoding import CHAINED
from nanoeuler.model.losses import log_softmax

SCORE_TOKENS = 4096  # positions (rows x padded length) a scoring piece runs in one forward
FREE_CHAIN_SECONDS = 0.004  # while rows are free, chains of about this long: the most a newcomer then waits


class Overloaded(Exception):
    """Every row is busy and the waiting queue is full."""


@dataclass(frozen=True)
class SamplingSettings:
    """One request's generation settings, already validated (serve.py checks ranges and types)."""
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int = 0
    seed: int | None = None
    stop: tuple = ()  # strings: generation ends where the text first contains one, which is cut off
    logprobs: int | None = None  # None: none; 0: each token's own; n: also the n likeliest at its position


# One token's log-probability as the API reports it: its text (or "bytes:\\x.." where its bytes are not UTF-8
# alone), its bytes, its log-probability (None for a prompt's first token), the likeliest tokens at its
# position as (text, bytes, log-probability), and its offset in characters from the start of its text.
LogProb = collections.namedtuple("LogProb", "token bytes logprob top offset")


class Job:
    """One request: prompts (lists of token ids) with n choices each, choice i continuing prompt i // n.
    score_prompts: report each prompt token's log-probability first. `send(event)` is called on the model
    thread, must not block, and receives, for each choice index:
        ("prompt", index, [LogProb])        with score_prompts, before anything else of that choice
        ("text", index, delta, [LogProb])   new text, and the log-probabilities of the tokens it completes
        ("done", index, finish_reason)      "stop" (an end id, as </s>, or a stop string) or "length"
    then ("end", usage) once, or instead of all that ("error", message) or ("cancelled",)."""

    def __init__(self, prompts, n, settings, send, score_prompts=False):
        self.prompts, self.n, self.settings, self.send = prompts, n, settings, send
        self.score_prompts = score_prompts
        self.cancelled = False  # set from any thread; the model thread drops the job at its next step
        self.wake = lambda: None  # the scheduler's, once submitted: a cancel is seen at once
        # the model thread's bookkeeping
        self.scored = 0  # prompts scored
        self.choices = None  # every Choice, made when the first one starts
        self.unstarted = None  # the choices waiting for a row
        self.open = 0  # choices not finished
        self.queued = True  # counted in Scheduler.queued: some choice has not started
        n_prompt = sum(map(len, prompts))
        self.usage = {"prompt_tokens": n_prompt, "completion_tokens": 0, "total_tokens": n_prompt}

    def cancel(self):
        self.cancelled = True
        self.wake()


class Choice:
    """One choice of a job: its request to the generator, its sequence there once started, and its text."""

    def __init__(self, job, index, end_ids):
        s = job.settings
        self.job, self.index = job, index
        seed = None if s.seed is None else s.seed + index % job.n  # choice 0 of a prompt: the request's seed
        self.request = Request(prompt_ids=tuple(job.prompts[index // job.n]), max_new_tokens=s.max_tokens,
                               temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=seed,
                               stop_ids=tuple(end_ids), logprobs=s.logprobs)
        self.sequence = None
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text, self.sent, self.pending = "", 0, []  # pending: LogProbs not yet sent with their text


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


def top_logprobs(lp, n):
    """The n likeliest (id, log-probability) pairs of log-probabilities lp (V,), ties to the lower id."""
    return [(int(i), float(lp[i])) for i in np.argsort(-lp, kind="stable")[:n]] if n else []


def prompt_logprobs(eng, prompts, top):
    """For each prompt (a list of ids): the log-probability of each of its tokens after the ones before it
    (None for the first) with the `top` likeliest tokens there, [(logprob, [(id, logprob)])]. One forward of
    all of them, padded at the end (positions after a prompt's own do not change it)."""
    T = max(map(len, prompts))
    inputs = np.zeros((len(prompts), T), dtype=np.int32)
    for row, ids in zip(inputs, prompts):
        row[:len(ids)] = ids
    logits = eng.logits(inputs)
    out = []
    for b, ids in enumerate(prompts):
        lp = log_softmax(logits[b, :len(ids)])
        scores = [(None, None)] + [(float(lp[t, i]), top_logprobs(lp[t], top)) for t, i in enumerate(ids[1:])]
        out.append(scores)
    return out


class Scheduler:
    def __init__(self, eng, tok, rows, queue, context=None):
        """rows: the KV cache's slots; context: the positions each holds (default the model's)."""
        self.eng, self.tok, self.rows, self.queue = eng, tok, rows, queue
        self.generator = BatchGenerator(eng, rows=rows, context=context)
        self.lock = threading.Condition()
        self.inbox = collections.deque()  # submitted jobs the model thread has not taken yet
        self.queued = 0  # jobs with choices not started yet (inbox included): what `queue` bounds
        self.jobs = []  # the model thread's jobs in flight, in arrival order
        self.active = {}  # sequence -> Choice, for the choices generating now
        self._texts = {}  # token id -> (text, bytes): the streams' bytes and the log-probabilities' text
        # steps run between two reads of their ids: on the GPU several (the host then waits for the device once
        # for them); on the CPU nothing waits for a device, so each step's tokens go out as soon as they exist
        self.chained = CHAINED if eng.xp is not np else 1

    # ---------------------------------------------------------------------------------- any thread
    def submit(self, job):
        """Queue a job; raises Overloaded when the waiting queue is full."""
        with self.lock:
            if self.queued >= self.queue + max(0, self.rows - len(self.active)):
                raise Overloaded()
            self.queued += 1
            job.wake = self._wake
            self.inbox.append(job)
            self.lock.notify()

    def _wake(self):
        with self.lock:
            self.lock.notify()

    def load(self):
        with self.lock:
            return {"active": len(self.active), "waiting": self.queued, "rows": self.rows, "queue": self.queue}

    # ---------------------------------------------------------------------------------- the model thread
    def warm_up(self):
        """Compile (or load) the kernels of a decoding step and of a scoring forward before serving."""
        eos = self.tok.eos_id
        self.generator.add(Request(prompt_ids=(eos, eos), max_new_tokens=2, logprobs=1))
        while self.generator.busy():
            self.generator.step()
        prompt_logprobs(self.eng, [[eos, eos]], 1)

    def run(self, serving):
        """The model thread's loop while serving() is true (and after, until nothing is left in flight)."""
        while serving() or self.jobs or self.inbox:
            with self.lock:
                self.jobs.extend(self.inbox)
                self.inbox.clear()
            for job in [j for j in self.jobs if j.cancelled]:
                self._drop(job, ("cancelled",))
            worked = self._score_piece()
            self._start_choices()
            if self.generator.busy():
                # chained steps unless a newcomer could join now (it waits for a free row otherwise, which
                # only a read of the steps gives back; the generator runs one step while a sequence is
                # joining or asked for logprobs): a newcomer waits at most that many steps
                waiting = self.inbox or any(job.queued for job in self.jobs)
                self._step(1 if waiting and len(self.active) < self.rows else self._chain())
            elif not worked:
                with self.lock:
                    if not self.inbox and not any(j.cancelled for j in self.jobs):
                        self.lock.wait(0.2)

    def _chain(self):
        """Steps a chain: `chained` while every row is busy (a newcomer waits for a row to free anyway); with
        rows free, as many as take about FREE_CHAIN_SECONDS at the last chain's pace, at least 2 (the host's
        work on a chain then still overlaps the next one), so that a newcomer joins that soon."""
        seconds = self.generator.step_seconds
        if len(self.active) >= self.rows or not seconds:
            return self.chained
        return min(self.chained, max(2, int(FREE_CHAIN_SECONDS / seconds)))

    def _guarded(self, job, work):
        """work() for a job; a bug in it costs that request (a 500 and a traceback on stderr), not the server."""
        try:
            work()
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            self._drop(job, ("error", f"generation failed: {type(e).__name__}: {e}"))

    def _drop(self, job, event):
        """End a job early: free its rows, and send its final event."""
        for sequence, choice in list(self.active.items()):
            if choice.job is job:
                self.generator.cancel(sequence)
                del self.active[sequence]
        if job in self.jobs:
            self.jobs.remove(job)
        self._dequeue(job)
        job.send(event)

    def _dequeue(self, job):
        """The job has no choice waiting any more: it leaves the count that `queue` bounds."""
        if job.queued:
            job.queued = False
            with self.lock:
                self.queued -= 1

    def _token_text(self, token_id):
        if token_id not in self._texts:
            raw = self.tok.decode([token_id])
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: OpenAI's way of showing raw bytes
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._texts[token_id] = (text, raw)
        return self._texts[token_id]

    def _logprob(self, token_id, logprob, top, offset):
        """The LogProb of token_id; top: its position's likeliest (id, logprob) pairs (None: none asked)."""
        alternatives = None if logprob is None else [(*self._token_text(i), lp) for i, lp in top or ()]
        return LogProb(*self._token_text(token_id), logprob, alternatives, offset)

    def _generated_logprob(self, token, offset):
        """The LogProb of a generated token, or of the stop id that ended its sequence (token.id None)."""
        token_id = token.sequence.stop_id if token.id is None else token.id
        return self._logprob(token_id, token.logprob, token.top_logprobs, offset)

    # ----------------------------------------------------------------------------------- scoring
    def _score_piece(self):
        """Score the next prompts that wait for it, SCORE_TOKENS positions at most (at least one prompt);
        False when none waits."""
        piece = []  # (job, prompt index)
        for job in self.jobs:
            if not job.score_prompts:
                continue
            for p in range(job.scored, len(job.prompts)):
                longest = max([len(job.prompts[p])] + [len(j.prompts[q]) for j, q in piece])
                if piece and longest * (len(piece) + 1) > SCORE_TOKENS:
                    break
                piece.append((job, p))
            else:
                continue
            break
        if not piece:
            return False
        top = lambda job: job.settings.logprobs
        try:
            scores = prompt_logprobs(self.eng, [j.prompts[p] for j, p in piece], max(top(j) for j, _ in piece))
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            for job in {j for j, _ in piece}:
                self._drop(job, ("error", f"scoring failed: {type(e).__name__}: {e}"))
            return True
        for (job, p), score in zip(piece, scores):
            entries, offset = [], 0
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            for token_id, (logprob, alternatives) in zip(job.prompts[p], score):
                entries.append(self._logprob(token_id, logprob, None if logprob is None else
                                             alternatives[:top(job)], offset))
                offset += len(decoder.decode(self.tok.decode([token_id])))
            for index in range(p * job.n, (p + 1) * job.n):
                job.send(("prompt", index, entries))
            job.scored = p + 1
        return True

    # ----------------------------------------------------------------------------------- generation
    def _start_choices(self):
        """Give free rows to the choices of the jobs in arrival order (a job's once its prompts are scored)."""
        for job in list(self.jobs):
            if job.score_prompts and job.scored < len(job.prompts):
                return  # later jobs wait behind it: first come, first served
            if job.choices is None:
                job.choices = [Choice(job, i, self.tok.end_ids) for i in range(len(job.prompts) * job.n)]
                job.unstarted = collections.deque(job.choices)
                job.open = len(job.choices)
            while job.unstarted and (job.settings.max_tokens == 0 or len(self.active) < self.rows):
                choice = job.unstarted.popleft()
                if job.settings.max_tokens == 0:  # echo only: the prompt is the whole answer
                    choice.sequence = ()
                    self._finish(choice, "length")
                    continue
                self._guarded(job, lambda: self._add(choice))
                if job.cancelled or job not in self.jobs:
                    break
            if not job.unstarted:
                self._dequeue(job)
            if len(self.active) >= self.rows:
                return

    def _add(self, choice):
        choice.sequence = self.generator.add(choice.request)
        self.active[choice.sequence] = choice

    def _step(self, steps):
        try:
            tokens = self.generator.step(steps)
        except Exception as e:  # a bug in the step: every request in it fails, the server goes on
            traceback.print_exc(file=sys.stderr)
            for job in {c.job for c in self.active.values()}:
                self._drop(job, ("error", f"generation failed: {type(e).__name__}: {e}"))
            return
        by_choice = {}  # each choice's tokens of the step, in order: its new text goes out as one event
        for sequence, run in itertools.groupby(tokens, key=attrgetter("sequence")):  # the generator's runs
            choice = self.active.get(sequence)
            if choice is not None:
                by_choice.setdefault(id(choice), (choice, []))[1].extend(run)
        for choice, its_tokens in by_choice.values():
            self._guarded(choice.job, lambda: self._tokens(choice, its_tokens))

    def _tokens(self, choice, tokens):
        """A choice's new tokens of one step: its text, its end, and the event that sends them."""
        job = choice.job
        job.usage["completion_tokens"] += len(tokens)  # a stop id too: the model generated it
        job.usage["total_tokens"] += len(tokens)
        if job.settings.logprobs is not None:  # token by token: where each one starts
            if any(self._token(choice, token) for token in tokens):
                return
        else:  # the common case: their bytes decoded at once, the new text searched once for a stop string
            last = tokens[-1].finish_reason
            searched = len(choice.text)
            pieces = [self._token_text(t.id)[1] for t in tokens if t.id is not None]
            choice.text += choice.decoder.decode(b"".join(pieces), final=last is not None)
            cut = stop_at(choice.text, job.settings.stop, searched) if job.settings.stop else -1
            if cut >= 0:
                choice.text = choice.text[:cut]
                if last is None:
                    self.generator.cancel(choice.sequence)
                return self._finish(choice, "stop")
            if last is not None:
                return self._finish(choice, last)
        self._send_ready(choice)

    def _token(self, choice, token):
        """One new token of a choice with log-probabilities (and maybe stop strings); True when it ends the
        choice."""
        job = choice.job
        last = token.finish_reason is not None
        searched = len(choice.text)
        if job.settings.logprobs is not None:
            choice.pending.append(self._generated_logprob(token, searched))
        choice.text += choice.decoder.decode(b"" if token.id is None else self._token_text(token.id)[1], final=last)
        cut = stop_at(choice.text, job.settings.stop, searched)
        if cut >= 0:
            choice.text = choice.text[:cut]
            choice.pending = [e for e in choice.pending if e.offset < cut]
            if not last:
                self.generator.cancel(choice.sequence)
            self._finish(choice, "stop")
            return True
        if last:
            self._finish(choice, token.finish_reason)
        return last

    def _send_ready(self, choice):
        """Send the choice's new text but what could begin a stop string."""
        ready = len(choice.text) - held_back(choice.text, choice.job.settings.stop)
        if ready > choice.sent:
            choice.job.send(("text", choice.index, choice.text[choice.sent:ready], choice.pending))
            choice.sent, choice.pending = ready, []

    def _finish(self, choice, reason):
        job = choice.job
        self.active.pop(choice.sequence, None)
        if len(choice.text) > choice.sent or choice.pending:
            job.send(("text", choice.index, choice.text[choice.sent:], choice.pending))
        job.send(("done", choice.index, reason))
        job.open -= 1
        if job.open == 0:
            self.jobs.remove(job)
            job.send(("end", dict(job.usage)))
