"""Many sequences decoded together: continuous batching over the decoder's batched steps (model/decoding.py).

    gen = BatchGenerator(eng, rows=64)               # context=N: slots of N positions (default the model's)
    a = gen.add(Request(prompt_ids=(1, 2, 3), max_new_tokens=20))
    b = gen.add(Request(prompt_ids=(4, 5), max_new_tokens=50, temperature=0.8, top_p=0.95, seed=7))
    while gen.busy():
        for token in gen.step():      # one decoding step for every active sequence
            ...                       # token.sequence, token.id, token.logprob, token.finish_reason

Each sequence has a row (slot) of the KV cache from its first prefill chunk to its end, at its own position.
A step prefills, in forwards of at most one chunk's worth (prefill_chunk rows) each, the next chunk of one
joining sequence, or the waiting one-chunk prompts: those that fit a chunk together (each padded to the
longest), then the next such group, up to CHAINED groups while rows are free, so that a burst of requests
starts decoding together; then it decodes one token for every sequence that was decoding. Joiners hold the
others up for at most CHAINED chunks (as long as a newcomer may wait for a chain of steps), a long prompt for
one chunk a step. Rows leave when their sequence ends (or is cancelled) and new sequences take them.

Batch invariance: a sequence's tokens are a pure function of (model, prompt, settings, seed), whatever else is
in the batch and wherever its row sits: every kernel of a step computes a row in an order set by that row
alone (the engines' row-invariant products, attention a row at a time), prefill chunks start at position 0 at
fixed multiples of prefill_chunk, and a draw's randomness is a hash of (seed, token index, id) (sample_rows).
`nanoeuler infer` runs a batch of one through the same steps, so its output is a request's output here.
"""
import dataclasses
import heapq
import secrets
import time
from collections import deque

import numpy as np

from nanoeuler.model.decoding import CHAINED, batch_state, decoder_of
from nanoeuler.model.limits import DECODE_ROWS, FEW_ROWS
from nanoeuler.model.losses import log_softmax

@dataclasses.dataclass(frozen=True)
class Request:
    prompt_ids: tuple          # token ids, 1 to context - 1 of them
    max_new_tokens: int        # at least 1
    temperature: float = 0.0   # 0: greedy
    top_k: int = 0             # 0: off
    top_p: float = 1.0         # 1: off; 0: the likeliest token
    seed: int | None = None    # None: a fresh random seed; with a seed the tokens are a pure function of the rest
    stop_ids: tuple = ()       # token ids that end generation; the stop id is not emitted
    logprobs: int | None = None  # None: none; 0: the chosen token's log-probability; n > 0: also the top n
    first_index: int = 0       # the token index of the first new token's draw (a continuation goes on drawing)


@dataclasses.dataclass(eq=False)
class Sequence:
    """A request's progress: ids generated so far (a stop id is not among them), and why it ended (None while
    it runs; "stop", "length", or "cancelled")."""
    request: Request
    ids: list = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_id: int | None = None  # the stop id drawn, where one ended it
    seed: int = 0
    slot: int | None = None
    prefilled: int = 0  # prompt tokens in the cache
    settings: tuple = ()  # a step's per-row fields from the request: top_k, temperature, top_p, seed_lo, seed_hi


@dataclasses.dataclass(slots=True)
class Token:
    """One step's output for a sequence: the id drawn (None for a stop id, which ends the sequence without
    being emitted: Sequence.stop_id has it), its log-probability under the model (softmax of the raw logits)
    and the top n (id, log-probability) pairs where the request asked (a stop id's too), and finish_reason
    where this token ends the sequence."""
    sequence: Sequence
    id: int | None
    logprob: float | None = None
    top_logprobs: list | None = None
    finish_reason: str | None = None


def decode_buckets(rows):
    """The batch sizes a decoding step runs at (a step's live rows padded up to one): powers of two up to
    rows, and rows itself; on the GPU each is a recorded CUDA graph."""
    sizes, b = [], 1
    while b < rows:
        sizes.append(b)
        b *= 2
    return sizes + [rows]


class BatchGenerator:
    """Continuous batching of Requests over one engine (module docstring)."""

    def __init__(self, eng, rows=64, prefill_chunk=FEW_ROWS, context=None):
        if not 1 <= rows <= DECODE_ROWS:
            raise ValueError(f"rows must be 1..{DECODE_ROWS}, not {rows}")
        if not 1 <= prefill_chunk <= FEW_ROWS:
            raise ValueError(f"prefill_chunk must be 1..{FEW_ROWS}, not {prefill_chunk}")
        self.eng, self.rows, self.chunk = eng, rows, prefill_chunk
        # the positions a slot holds: the model's context, or fewer (serve's --context, a short generation's)
        self.context = eng.cfg.context if context is None else context
        self.decoder = decoder_of(eng)
        # a slot a sequence, and a last, scratch one that a step's padding rows write to
        self.cache = self.decoder.new_cache(rows + 1, self.context)
        self.scratch = rows
        self.buckets = decode_buckets(rows)
        self.free = list(range(rows))  # a heap: the lowest free slot first
        self.queue = deque()
        self.joining = None  # the sequence being prefilled
        self.decoding = {}   # slot -> sequence
        self.inflight = None  # (step, sequences, steps) of chained steps launched and not read yet
        self.retiring = []   # slots of sequences that ended while steps over them were in flight
        # seconds a step of the last chain read (from its launch to its ids read: the device's time where the
        # host waited for it), and when the chain in flight was launched
        self.step_seconds = None
        self.launched_at = None

    def close(self):
        """Hand the KV cache (and its recorded steps) back to the engine's decoder for the next generator."""
        self.decoder.release(self.cache)

    def add(self, request):
        """Queue a request; it joins at a step boundary. Returns its Sequence."""
        n = len(request.prompt_ids)
        if not 1 <= n <= self.context - 1:
            raise ValueError(f"a prompt of {n} tokens: 1 to {self.context - 1} fit the context")
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, not {request.max_new_tokens}")
        if request.temperature < 0 or not 0 <= request.top_p <= 1 or request.top_k < 0:
            raise ValueError("temperature >= 0, 0 <= top_p <= 1 and top_k >= 0 expected")
        seed = (request.seed if request.seed is not None else secrets.randbits(64)) % (1 << 64)
        seq = Sequence(request, seed=seed, settings=(request.top_k, request.temperature, request.top_p,
                                                     seed & 0xFFFFFFFF, seed >> 32))
        self.queue.append(seq)
        return seq

    def cancel(self, seq):
        """End a sequence now (finish_reason "cancelled"); its row is free for the next step."""
        if seq.finish_reason is not None:
            return
        if seq in self.queue:
            self.queue.remove(seq)
        self._finish(seq, "cancelled")

    def busy(self):
        return bool(self.queue or self.joining or self.decoding or self.inflight)

    def can_admit(self):
        """Whether admit() has a prompt to prefill: one half in, or one waiting and a row free."""
        return self.joining is not None or bool(self.queue and self.free)

    def admit(self):
        """Prefill without decoding the others, for a caller that wants every sequence in before decoding
        (generate() over a list: throughput before latency): `_joiners` with up to FEW_ROWS tokens. Returns the
        Tokens of the sequences whose prompt is then in (their first ids)."""
        group = self._joiners(FEW_ROWS)
        return self._prefill(group) if group else []

    def _joiners(self, tokens):
        """The sequences whose prompts the next step prefills, each given a row: the joining sequence's next
        chunk; else the waiting prompts at the head of the queue that are one chunk each, together (as many as
        rows are free and, each padded to the longest, fit `tokens` rows); else the first chunk of a longer
        prompt, which then joins chunk by chunk. First come, first served: a group stops at the first prompt
        that does not fit."""
        if self.joining is not None:
            return [self.joining]
        group, longest = [], 0
        while self.queue and len(group) < len(self.free):
            n = len(self.queue[0].request.prompt_ids)
            if n > self.chunk or (len(group) + 1) * max(longest, n) > tokens:
                break
            group.append(self.queue.popleft())
            longest = max(longest, n)
        if not group and self.queue and self.free:  # a prompt of several chunks: chunk by chunk
            self.joining = self.queue.popleft()
            group = [self.joining]
        for seq in group:
            seq.slot = heapq.heappop(self.free)
        return group

    def step(self, steps=1):
        """One step: the prefill of the joiners (`_joiners`, group after group of one-chunk prompts, at most
        CHAINED; their first tokens when their prompts are in), then one decoding step for each sequence decoding
        before it. Returns the Tokens, each sequence's in order.

        steps > 1 (at most CHAINED), for throughput: when no sequence is joining or could join (waiting with a
        row free) and none asked for logprobs, that many decoding steps back to back on the device, read once
        (a sequence's tokens after its end are dropped), and pipelined: the call returns the tokens of the
        steps launched by the call before, after launching the next ones, so the host's work on them overlaps
        the device's."""
        out = []
        if self.inflight is not None:
            out += self._collect()
            if self.inflight is not None:
                return out
        decoding = sorted(self.decoding.items())  # those decoding before this step's prefill
        # one-chunk prompts join group after group before the decoding step (a burst of requests then decodes
        # together), at most CHAINED groups; a longer prompt joins a chunk a step
        for _ in range(CHAINED):
            joiners = self._joiners(self.chunk)
            if not joiners:
                break
            out += self._prefill(joiners)
            if self.joining is not None:
                break
        if decoding:
            # one step while a sequence is joining or could join (a row is free for it): it waits no longer
            waiting = self.joining is not None or (self.queue and self.free)
            if waiting or any(s.request.logprobs is not None for _, s in decoding):
                steps = 1
            out += self._decode([s for _, s in decoding], steps)
        return out

    def _collect(self):
        """Read the steps in flight; unless sequences joined, ended, or wait with a row free, launch the next ones
        over the same rows at once (the device goes on from its own state); then the Tokens of those read."""
        step, seqs, steps = self.inflight
        self.inflight = None
        ids = step.read(steps).tolist()
        self.step_seconds = (time.perf_counter() - self.launched_at) / steps
        self.free += self.retiring
        heapq.heapify(self.free)
        self.retiring = []
        same = (not (self.queue and self.free) and self.joining is None and len(self.decoding) == len(seqs)
                and all(s.finish_reason is None for s in seqs))
        # after the steps read: the positions left in the context, the most tokens a sequence still wants
        room = min(self.context - (len(s.request.prompt_ids) + len(s.ids) - 1 + steps) for s in seqs)
        wanted = max(s.request.max_new_tokens - len(s.ids) - steps for s in seqs)
        if same and min(room, wanted) > 0:
            self.inflight = (step, seqs, min(steps, room, wanted))
            step.launch(None, self.inflight[2])
            self.launched_at = time.perf_counter()
        return self._emit_steps(seqs, ids, steps, step)

    # ------------------------------------------------------------------------------------------ steps
    def _prefill(self, seqs):
        """The next prompt chunk of each of seqs in one step: chunks padded after their end to the longest (a
        sequence's logits come from its own last token), sequences padded up to a bucket where that fits a step
        (fewer step shapes to record: padding sequences write the scratch slot)."""
        start = [seq.prefilled for seq in seqs]
        chunks = [seq.request.prompt_ids[p:p + self.chunk] for seq, p in zip(seqs, start)]
        T = max(map(len, chunks))
        B = next((b for b in self.buckets if b >= len(seqs) and b * T <= FEW_ROWS), len(seqs))
        step = self.decoder.batch_step(self.cache, B, T)
        state, v = batch_state(B, T)
        v["slot"][:] = self.scratch
        for r, (seq, chunk, p) in enumerate(zip(seqs, chunks, start)):
            v["tokens"][r, :len(chunk)] = chunk
            v["last"][r] = len(chunk) - 1
            self._settings(v, r, seq, seq.slot, p)
        ids = step(state)
        out = []
        for r, (seq, chunk) in enumerate(zip(seqs, chunks)):
            seq.prefilled += len(chunk)
            if seq.prefilled < len(seq.request.prompt_ids):
                continue
            if seq is self.joining:
                self.joining = None
            self.decoding[seq.slot] = seq
            out.append(self._emit(seq, int(ids[0, r]), step.logits, r))
        return out

    def _decode(self, seqs, steps):
        n = len(seqs)
        B = next(b for b in self.buckets if b >= n)
        positions = [len(s.request.prompt_ids) + len(s.ids) - 1 for s in seqs]  # where each next input goes
        steps = max(1, min([steps, CHAINED] + [self.context - p for p in positions]))
        step = self.decoder.batch_step(self.cache, B, 1)
        state, v = batch_state(B, 1)
        v["slot"][:] = self.scratch  # padding rows
        v["slot"][:n] = [s.slot for s in seqs]
        v["position"][:n] = positions
        v["tokens"][:n, 0] = [s.ids[-1] for s in seqs]
        v["index"][:n] = [s.request.first_index + len(s.ids) for s in seqs]
        for name, column in zip(self.SETTINGS, zip(*[s.settings for s in seqs])):
            v[name][:n] = column
        if steps > 1:  # pipelined: the tokens come with the next call
            step.launch(state, steps)
            self.inflight = (step, seqs, steps)
            self.launched_at = time.perf_counter()
            return []
        return self._emit_steps(seqs, step(state, steps).tolist(), steps, step)

    def _emit_steps(self, seqs, ids, steps, step):
        """The Tokens of `steps` steps' ids (steps, B) over seqs, a sequence's in order, sequence after sequence."""
        if steps == 1:
            return [self._emit(seq, ids[0][r], step.logits, r) for r, seq in enumerate(seqs)
                    if seq.finish_reason is None]
        out = []  # chained steps (no logprobs): a row's run of ids at once
        for seq, run in zip(seqs, zip(*ids)):
            if seq.finish_reason is not None:
                continue
            room = self._room(seq)
            run = run[:room]
            stops = [run.index(i) for i in seq.request.stop_ids if i in run]
            stop = min(stops) if stops else None
            kept = run if stop is None else run[:stop]
            seq.ids += kept
            out += [Token(seq, i) for i in kept]
            if stop is not None:
                seq.stop_id = run[stop]
                self._finish(seq, "stop")
                out.append(Token(seq, None, finish_reason="stop"))
            elif len(run) == room:
                self._finish(seq, "length")
                out[-1].finish_reason = "length"
        return out

    SETTINGS = ("top_k", "temperature", "top_p", "seed_lo", "seed_hi")

    def _settings(self, v, r, seq, slot, position):
        v["slot"][r], v["position"][r] = slot, position
        v["index"][r] = seq.request.first_index + len(seq.ids)
        for name, value in zip(self.SETTINGS, seq.settings):
            v[name][r] = value

    def _emit(self, seq, token, logits, row):
        """The Token for id `token` drawn for seq (logits: the step's, row `row`), and seq's end if it is one."""
        q = seq.request
        logprob = top = None
        if q.logprobs is not None:
            logprob, top = log_probabilities(logits[row], token, q.logprobs)
        if token in q.stop_ids:  # not emitted, but its log-probability is (OpenAI's logprobs list the end token)
            seq.stop_id = token
            self._finish(seq, "stop")
            return Token(seq, None, logprob, top, "stop")
        seq.ids.append(token)
        if self._room(seq) == 0:
            self._finish(seq, "length")
        return Token(seq, token, logprob, top, seq.finish_reason)

    def _room(self, seq):
        """The ids seq may still take: up to its max_new_tokens, and before the context ends (the next input
        would sit at position len(prompt) + len(ids) - 1)."""
        q = seq.request
        return min(q.max_new_tokens - len(seq.ids), self.context + 1 - len(q.prompt_ids) - len(seq.ids))

    def _finish(self, seq, reason):
        seq.finish_reason = reason
        if seq is self.joining:
            self.joining = None
        if seq.slot is not None:
            self.decoding.pop(seq.slot, None)
            if self.inflight is not None and seq in self.inflight[1]:
                self.retiring.append(seq.slot)  # steps in flight still write it
            else:
                heapq.heappush(self.free, seq.slot)
            seq.slot = None


def log_probabilities(logits, token, n):
    """(log p(token), the n likeliest (id, log p) pairs) under softmax(logits (V,)), in float64."""
    z = log_softmax(logits)
    top = None
    if n > 0:
        ids = np.argsort(-z, kind="stable")[:n]
        top = [(int(i), float(z[i])) for i in ids]
    return float(z[token]), top
