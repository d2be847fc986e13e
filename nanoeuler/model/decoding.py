"""Decoding with a KV cache: the training forward run over new tokens that attend to the cached ones.

    cache = eng.decoder.new_cache(batch=1)
    logits = eng.decoder.logits(cache, tokens)          # (B, V): head 0 at each sequence's last new position
    ids = eng.decoder.greedy(cache, next_ids, steps=8)  # (B, 8): 8 greedy steps, each fed the last one's id
    kept, accepted, following = eng.decoder.verify(cache, tokens, steps=8)   # speculative decoding's rounds
    eng.decoder.release(cache)

Three step kinds share one run (the model's forward over the step's own buffers, then the heads' product):
- logits: the logits, read back as float32 (head 0 at the last position, or all K heads at every new
  position with all_heads: what speculative sampling drafts and verifies with);
- greedy: the argmax found on the device, one id a row read back instead of V logits (all_heads: every
  head's at every position). A step of one token a sequence writes its ids over its own input, so the next
  step reads them there, and logs them by position: `steps` such steps run back to back and are read once;
- verify: greedy self-speculative decoding's round for one sequence: the next token and K - 1 drafts in,
  the drafts head 0 agrees with kept, the cache moved past them, and the next round's tokens found, all on
  the device (the layers' accept_drafts), so rounds too chain without the host.

Batched decoding (infer/batch.py drives it): `Slots` is a KV cache of many sequences, each in its own row
(slot) at its own position; `slots.step(B, T)` runs B sequences of T new tokens each, wherever their slots,
and draws one id a sequence on the device (layers.sample_rows), its settings and positions uploaded with the
tokens as one buffer; steps of one token a sequence feed their ids back and chain, as greedy steps do.

A step of at most limits.FEW_ROWS rows (batch x new tokens) keeps its buffers in the cache, and on the GPU is
recorded as a CUDA graph by its first call and replayed after (`graphs`): one launch a token. Positions live
in device memory (KVCache.position), so one recording serves every position.
"""
import numpy as np

from nanoeuler.model.engine import to_float32, to_numpy
from nanoeuler.model.limits import FEW_ROWS

CHAINED = 16  # the most one-token batched steps run back to back between two reads of their ids


class KVCache:
    """Keys and values kv (L, B, context, 2G, D) of positions 0..pos-1 of B sequences: the G k heads (rotated),
    then the G v heads (the queries are not kept: nothing reads them again). Its position lives on the host
    (`pos`) and where the kernels read it (`position`, int32 on the device); a step's kernels advance the
    device copy and the decoder then `advanced` the host one. `rewind` moves both back: later positions are
    overwritten. `steps` keeps the buffers (and graphs) of the decoding steps run on this cache, by kind and
    shape."""

    def __init__(self, xp, cfg, batch, dtype):
        self.kv = xp.empty((cfg.n_layers, batch, cfg.context, 2 * cfg.n_kv_heads, cfg.head_dim), dtype=dtype)
        self.context = cfg.context
        self.position = xp.zeros(1, dtype=np.int32)
        self.slots = None  # sequence b's keys and values are kv[:, b]
        self._pos = 0
        self.steps = {}

    @property
    def batch(self):
        return self.kv.shape[1]

    @property
    def pos(self):
        return self._pos

    @property
    def free(self):
        """Positions left."""
        return self.context - self._pos

    def rewind(self, pos):
        """Back to position pos (0: empty): what follows is forgotten."""
        if not 0 <= pos <= self._pos:
            raise ValueError(f"cannot rewind a cache at {self._pos} to {pos}")
        self._pos = int(pos)
        self.position[...] = self._pos

    def advanced(self, n):
        """The host's record that a step's kernels moved the device position n forward."""
        self._pos += n


class Decoder:
    def __init__(self, eng):
        self.eng = eng
        self.graphs = True  # replay small steps as CUDA graphs (GPU); off to measure the difference
        self._spare = []  # released caches, kept with their recorded steps

    def new_cache(self, batch=1):
        """An empty KV cache for `batch` sequences: a released one of that size when there is one (its steps
        are recorded already), else a new one."""
        for i, cache in enumerate(self._spare):
            if isinstance(cache, KVCache) and cache.batch == batch:
                cache = self._spare.pop(i)
                cache.rewind(0)
                return cache
        return KVCache(self.eng.xp, self.eng.cfg, batch, self.eng.act)

    def slots(self, rows):
        """An empty batched KV cache of `rows` slots (Slots): a released one of that size when there is one."""
        for i, cache in enumerate(self._spare):
            if isinstance(cache, Slots) and cache.rows == rows:
                return self._spare.pop(i)
        return Slots(self.eng, rows)

    def release(self, cache):
        """Hand back a cache (KVCache or Slots) no longer used, for new_cache or slots to reuse."""
        if all(c is not cache for c in self._spare):
            self._spare.append(cache)

    # ------------------------------------------------------------------------------------ the step kinds
    def logits(self, cache, tokens, all_heads=False):
        """Append tokens (B, n) at the cache's position and run them. Head-0 logits (B, V) of each sequence's
        last new position, or with all_heads every head's at every new position, (B, n, K, V): float32."""
        tokens = self._check(cache, tokens, 1)
        return self._run(cache, "logits", tokens, all_heads, 1)

    def greedy(self, cache, tokens, steps=1, all_heads=False):
        """As logits, the argmax instead: ids (B,), or (B, n, K) with all_heads. steps > 1 (one token a sequence,
        head 0): that many steps, each fed the ids of the one before on the device, ids (B, steps)."""
        tokens = self._check(cache, tokens, steps)
        if steps > 1 and (tokens.shape[1] != 1 or all_heads):
            raise ValueError("greedy steps > 1 take one token a sequence and head 0")
        return self._run(cache, "greedy", tokens, all_heads, steps)

    def verify(self, cache, tokens, steps=1):
        """Greedy self-speculative rounds chained on the device, one sequence: tokens (1, K) are the next token
        and K - 1 drafts after it. A round runs them over the cache, keeps the drafts head 0's argmax agrees
        with, and moves the cache past them and the first token; head 0's next id and heads 1..K-1's drafts at
        the last kept row are the next round's tokens. Returns (the kept ids, the accepted drafts of each
        round, the next round's tokens (K,)): one read back for all the rounds."""
        K = self.eng.cfg.mtp_heads
        tokens = np.asarray(tokens, dtype=np.int32).reshape(1, K)
        if K * steps > cache.free:
            raise ValueError(f"the KV cache holds {cache.context} positions; {cache.pos} + {K} x {steps} may not "
                             "fit")
        return self._run(cache, "verify", tokens, True, steps)

    def _check(self, cache, tokens, steps):
        tokens = np.asarray(tokens, dtype=np.int32)
        if tokens.ndim != 2 or tokens.shape[1] < 1:
            raise ValueError(f"tokens of shape {tokens.shape}: (batch, n) expected")
        if tokens.shape[1] * steps > cache.free:
            raise ValueError(f"the KV cache holds {cache.context} positions; {cache.pos} + "
                             f"{tokens.shape[1] * steps} do not fit")
        return tokens

    def _run(self, cache, kind, tokens, all_heads, steps):
        B, n = tokens.shape
        key = (kind, B, n, all_heads, self.graphs)
        step = cache.steps.get(key)
        if step is None:
            step = _Step(self.eng, cache, kind, B, n, all_heads, self.graphs and B * n <= FEW_ROWS)
            if B * n <= FEW_ROWS:
                cache.steps[key] = step
        with self.eng.mode():
            return step(tokens, steps)


def _activations(eng, B, n):
    """A decoding step's activations, B sequences of n new tokens: one buffer a kind for all layers, the
    residual stream x updated in place (Engine.forward_layers); `last` takes each sequence's last row."""
    cfg, xp = eng.cfg, eng.xp
    N, C, H, G, D, F = B * n, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden
    e = lambda *shape: xp.empty(shape, dtype=eng.act)
    f = lambda *shape: xp.empty(shape, dtype=eng.dtype)
    x, rstd = e(N, C), f(N)
    layers = cfg.n_layers
    # Batch-invariant: no normed inputs kept (xn None), and the GPU folds the norms into its products. Else the
    # norms write xn, which BLAS's products read (a buffer of the step's own: a graph may not use temporaries).
    xn = None if eng.batch_invariant else e(N, C)
    return dict(in_place=True, resid=[x] * (layers + 1), resid_mid=[x] * layers, xn1=[xn] * layers,
                xn2=[xn] * layers, xnf=xn, rstd1=[rstd] * layers, rstd2=[rstd] * layers,
                qkv=[e(B, n, H + 2 * G, D)] * layers, att=[e(B, n, H, D)] * layers,
                lse=[f(B, H, n)] * layers, gate_up=[e(N, 2 * F)] * layers, sw=[e(N, F)] * layers,
                rstdf=f(N), last=e(B, C))


def _head(eng, a, logits, w, x):
    """logits = the final norm of rows x of the residual stream, then the head product with w: one product,
    into which the GPU folds the norm (Engine.forward_layers leaves the final norm to decoding)."""
    rows = x.shape[0]
    eng.layers.rmsnorm_matmul_forward(logits, a["rstdf"][:rows], x, eng.p["final_norm"], w, eng.cfg.norm_eps,
                                      None if a["xnf"] is None else a["xnf"][:rows])


class _Step:
    """One step kind of one shape over one cache: its buffers, its run (recorded as a CUDA graph when
    `graph`), and how its result is read back."""

    def __init__(self, eng, cache, kind, B, n, all_heads, graph):
        cfg, xp = eng.cfg, eng.xp
        self.eng, self.cache, self.kind, self.B, self.n = eng, cache, kind, B, n
        self.heads = cfg.mtp_heads if all_heads else 1
        self.rows = B * n if all_heads else B  # the rows that get logits: every position's, or each sequence's last
        self.a = _activations(eng, B, n)
        self.a.update(logits=xp.empty((self.rows, self.heads * cfg.vocab_size), dtype=eng.dtype),
                      tokens=xp.empty((B, n), dtype=np.int32))
        # a greedy step of one token a sequence writes its ids over its own input and logs them by position
        self.feeds_back = kind == "greedy" and not all_heads and n == 1
        self.ids = (self.a["tokens"].reshape(B) if self.feeds_back
                    else xp.empty(self.rows * self.heads, dtype=np.int32))
        self.log = None
        if self.feeds_back:
            self.log = xp.empty((cfg.context, B), dtype=np.int32)
        elif kind == "verify":  # (kept id, accepted drafts of the round starting there) by position
            self.log = xp.zeros((cfg.context + n, 2), dtype=np.int32)
        self.held = None  # the host copy of what a["tokens"] holds
        self.run = eng.layers.graph(self._run) if graph else self._run

    def _run(self):
        eng, a, L, cache = self.eng, self.a, self.eng.layers, self.cache
        eng.forward_layers(a["tokens"], a, self.B, self.n, cache)
        x = a["resid"][-1]
        if self.rows != self.B * self.n:  # each sequence's last new row
            a["last"][...] = x.reshape(self.B, self.n, -1)[:, -1]
            x = a["last"]
        _head(eng, a, a["logits"], eng.p["heads"] if self.heads > 1 else eng.p["heads.0"], x)
        V = eng.cfg.vocab_size
        if self.kind == "verify":
            L.argmax(self.ids, a["logits"].reshape(-1, V))
            L.accept_drafts(a["tokens"].reshape(self.n), self.ids, self.log, cache.position)
            return
        if self.kind == "greedy":
            L.argmax(self.ids, a["logits"].reshape(-1, V), self.log, cache.position)
        L.advance_position(cache.position, self.n)

    def __call__(self, tokens, steps):
        if not np.array_equal(self.held, tokens):
            if self.eng.xp is np:
                self.a["tokens"][...] = tokens
            else:
                self.a["tokens"].set(tokens)  # one copy to the device, no temporary
        start = self.cache.pos
        for _ in range(steps):
            self.run()
        if self.kind == "verify":
            return self._read_verify(start, steps)
        if self.feeds_back:
            self.cache.advanced(steps)
            ids = to_numpy(self.log[start:start + steps]).T  # (B, steps)
            self.held = ids[:, -1:].copy()
            return ids if steps > 1 else ids[:, 0]
        self.cache.advanced(self.n)
        self.held = tokens.copy()
        shape = (self.B, self.n, self.heads) if self.heads > 1 else (self.B,)
        if self.kind == "greedy":
            return to_numpy(self.ids).reshape(shape)
        V = self.eng.cfg.vocab_size
        return to_numpy(to_float32(self.a["logits"])).reshape(shape + (V,))

    def _read_verify(self, start, steps):
        """The rounds kept 1 to n ids each: walk their accepted counts from the start."""
        n = self.n
        span = to_numpy(self.log[start:start + n * steps + n])
        end, accepted = 0, []
        for _ in range(steps):
            accepted.append(int(span[end, 1]))
            end += accepted[-1] + 1
        following = span[end:end + n, 0].copy()
        self.cache.advanced(end)
        self.held = following[None]
        return span[:end, 0].tolist(), accepted, following


# ---------------------------------------------------------------------------------------- batched decoding
class Slots:
    """The KV cache of up to `rows` sequences, each in its own slot at its own position: kv (L, rows + 1,
    context, 2G, D), the last slot a scratch one that a step's padding rows write to. Positions and slots live
    in each step's uploaded state (the host keeps the record); `steps` keeps the steps run on it, by shape."""

    def __init__(self, eng, rows):
        cfg = eng.cfg
        self.eng, self.rows, self.context = eng, rows, cfg.context
        self.scratch = rows
        self.kv = eng.xp.empty((cfg.n_layers, rows + 1, cfg.context, 2 * cfg.n_kv_heads, cfg.head_dim),
                               dtype=eng.act)
        self.steps = {}

    def step(self, B, T):
        """The step of B sequences of T new tokens each (made, and on the GPU recorded, on first use)."""
        if B * T > FEW_ROWS:
            raise ValueError(f"a batched step takes at most {FEW_ROWS} rows, not {B} x {T}")
        key = (B, T, self.eng.decoder.graphs)
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = SampleStep(self.eng, self, B, T)
        return step


class _CacheView:
    """What Engine.forward_layers reads of a cache: kv, a position a sequence, the slot of each."""

    def __init__(self, kv, position, slots):
        self.kv, self.position, self.slots = kv, position, slots


class SampleStep:
    """B sequences of up to T new tokens each over Slots: the forward, head 0's logits (B, V) float32 at each
    one's last new token (its row `last` of T: a shorter chunk is padded after its end, rows whose keys and
    values a later step overwrites before any row reads them), and an id drawn from them a sequence
    (layers.sample_rows). Its inputs are one int32 buffer, `state` (layout: `views`), uploaded at once; a step
    of one token a sequence (T = 1) then feeds its ids back (layers.feed_back), so `steps` of them chain on
    the device and log their ids by step."""

    FIELDS = ("slot", "position", "index", "top_k", "temperature", "top_p", "seed_lo", "seed_hi", "last")
    VIEWS = {"temperature": np.float32, "top_p": np.float32, "seed_lo": np.uint32, "seed_hi": np.uint32}

    def __init__(self, eng, cache, B, T):
        xp, cfg = eng.xp, eng.cfg
        self.eng, self.cache, self.B, self.T = eng, cache, B, T
        self.state = xp.zeros(self.size(B, T), dtype=np.int32)
        v = self.views(self.state, B, T)
        self.tokens, self.counter = v["tokens"], v["counter"]
        self.fields = v
        self.view = _CacheView(cache.kv, v["position"], v["slot"])
        self.a = _activations(eng, B, T)
        self.logits = xp.empty((B, cfg.vocab_size), dtype=eng.dtype)
        self.ids = xp.empty(B, dtype=np.int32)
        self.log = xp.empty((CHAINED, B), dtype=np.int32)
        self.first_rows = xp.arange(0, B * T, T, dtype=np.int32)  # sequence b's rows start at b * T
        self.last_rows = xp.empty(B, dtype=np.int32)
        graph = eng.decoder.graphs and B * T <= FEW_ROWS
        self.run = eng.layers.graph(self._run) if graph else self._run

    @staticmethod
    def size(B, T):
        return B * T + len(SampleStep.FIELDS) * B + 1

    @classmethod
    def views(cls, state, B, T):
        """Named views of a state buffer: tokens (B, T), then a (B,) array for each of FIELDS (float32 or
        uint32 where VIEWS says), then counter (1,): the chained steps' count so far."""
        out = {"tokens": state[:B * T].reshape(B, T)}
        at = B * T
        for name in cls.FIELDS:
            part = state[at:at + B]
            out[name] = part.view(cls.VIEWS[name]) if name in cls.VIEWS else part
            at += B
        out["counter"] = state[at:at + 1]
        return out

    def _run(self):
        eng, a, L, B, T = self.eng, self.a, self.eng.layers, self.B, self.T
        f = self.fields
        eng.forward_layers(self.tokens, a, B, T, self.view)
        x = a["resid"][-1]
        if T > 1:  # each sequence's last new token: row last[b] of its T
            eng.xp.add(self.first_rows, f["last"], out=self.last_rows)
            eng.xp.take(x, self.last_rows, axis=0, out=a["last"])
            x = a["last"]
        _head(eng, a, self.logits, eng.p["heads.0"], x)
        L.sample_rows(self.ids, self.logits, f["top_k"], f["temperature"], f["top_p"], f["seed_lo"], f["seed_hi"],
                      f["index"])
        if T == 1:
            L.feed_back(self.tokens, self.ids, f["position"], f["index"], self.log, self.counter,
                        self.cache.context)

    def __call__(self, state, steps=1):
        """Upload state (a host buffer of `size`, filled through `views`) and run `steps` steps (T = 1 only
        chains): the drawn ids (steps, B). The last step's logits stay in `logits`."""
        self.launch(state, steps)
        return self.read(steps)

    def launch(self, state, steps):
        """Upload state (None: go on from where the last steps left it, the log from its first row) and queue
        `steps` steps on the device without waiting for them: the host can work meanwhile, then `read`."""
        if steps > 1 and (self.T != 1 or steps > CHAINED):
            raise ValueError(f"{steps} chained steps: at most {CHAINED}, of one token a sequence")
        if state is None:
            self.counter[...] = 0
        elif self.eng.xp is np:
            self.state[...] = state
        else:
            self.state.set(state)
        with self.eng.mode():
            for _ in range(steps):
                self.run()

    def read(self, steps):
        """The ids (steps, B) of the steps launched last (waits for them)."""
        if self.T == 1:
            return to_numpy(self.log[:steps])
        return to_numpy(self.ids)[None]
