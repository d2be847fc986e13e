"""Decoding with a KV cache: the training forward run over new tokens that attend to the cached ones.

    dec = decoder_of(eng)                            # the engine's Decoder (made once, kept on the engine)
    cache = dec.new_cache(rows=1)
    logits = dec.logits(cache, tokens)               # (B, V): head 0 at each sequence's last new position
    ids = dec.greedy(cache, next_ids, steps=8)       # (B, 8): 8 greedy steps, each fed the last one's id
    kept, accepted, following = dec.verify(cache, tokens, steps=8)   # speculative decoding's rounds
    step = dec.batch_step(cache, B, T)               # batched decoding: sequences in their own slots
    dec.release(cache)

One cache, `KVCache`: the keys and values of `rows` sequences, a slot each. One step machine, `Step`: a step
kind of one shape over one cache, the model's forward over the step's own buffers, then the heads' product
and the kind's end:
- logits: the logits, read back as float32 (head 0 at the last position, or all K heads at every new
  position with all_heads: what speculative sampling drafts and verifies with);
- greedy: the argmax found on the device, one id a row read back instead of V logits (all_heads: every
  head's at every position). A step of one token a sequence writes its ids over its own input, so the next
  step reads them there, and logs them by position: `steps` such steps run back to back and are read once;
- verify: greedy self-speculative decoding's round for one sequence: the next token and K - 1 drafts in,
  the drafts head 0 agrees with kept, the cache moved past them, and the next round's tokens found, all on
  the device (the layers' accept_drafts), so rounds too chain without the host;
- sample (batched decoding, infer/batch.py drives it): B sequences of T new tokens each, each in its own
  slot at its own position, one id a sequence drawn on the device (layers.sample_rows), its settings and
  positions uploaded with the tokens as one buffer; steps of one token a sequence feed their ids back and
  chain, as greedy steps do.
The first three kinds put every sequence of the cache at one position, the cache's; a sample step's
sequences each have theirs, in its uploaded state. In every kind the logits of the ids from the config's
tokenizer_vocab on (an import's padding rows, Qwen2's) are -inf: no kind ever produces them.

A step of at most limits.FEW_ROWS rows (batch x new tokens) keeps its buffers in the cache, and on the GPU is
recorded as a CUDA graph by its first call and replayed after (`graphs`): one launch a token. Positions live
in device memory (KVCache.position, a sample step's state), so one recording serves every position.
"""
import functools
import numpy as np

from nanoeuler.model.engine import to_float32, to_numpy
from nanoeuler.model.limits import FEW_ROWS

CHAINED = 16  # the most one-token batched steps run back to back between two reads of their ids


def decoder_of(eng):
    """The engine's Decoder, made on first use and kept on the engine: the caches it gets back keep their
    recorded steps for the next generation."""
    if getattr(eng, "_decoder", None) is None:
        eng._decoder = Decoder(eng)
    return eng._decoder


def kv_cache_bytes(cfg, positions, rows, itemsize):
    """The bytes of a KV cache of `rows` slots of `positions` each: layers x (K and V) x kv heads x head_dim x
    positions x rows x bytes an element (the engine's activation type: bf16 on the GPU, float32 on the CPU).
    The one place the cache's size is computed (KVCache allocates it; serve sizes its cache by it)."""
    return cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * int(positions) * int(rows) * int(itemsize)


def cache_positions(needed, context):
    """The positions a one-sequence generation's cache holds: the power of two at or above `needed` (the
    prompt and its new tokens; few sizes, so released caches and their recorded steps are reused), at most
    the model's context."""
    return min(context, 1 << max(int(needed) - 1, 1).bit_length())


class KVCache:
    """Keys and values kv (L, rows, context, 2G, D) of up to `rows` sequences, sequence b's in slot kv[:, b]:
    the G k heads (rotated), then the G v heads (the queries are not kept: nothing reads them again).
    The logits, greedy and verify steps keep every sequence at one position: on the host (`pos`) and where the
    kernels read it (`position`, int32 on the device); a step's kernels advance the device copy and the step
    then `advanced` the host one. `rewind` moves both back: later positions are overwritten. Batched (sample)
    steps carry a position and a slot a sequence in their own state instead. `steps` keeps the steps run on
    this cache (their buffers and graphs), by kind and shape. `context`: the positions a slot holds (default
    the model's; fewer where the model's would not fit, at most the model's: its rotary tables end there)."""

    def __init__(self, xp, cfg, rows, dtype, context=None):
        context = cfg.context if context is None else int(context)
        if not 1 <= context <= cfg.context:
            raise ValueError(f"a KV cache of {context} positions: 1 to the model's {cfg.context} expected")
        self.kv = xp.empty((cfg.n_layers, rows, context, 2 * cfg.n_kv_heads, cfg.head_dim), dtype=dtype)
        self.context = context
        self.position = xp.zeros(1, dtype=np.int32)
        self._pos = 0
        self.steps = {}

    @property
    def rows(self):
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

    def new_cache(self, rows=1, context=None):
        """An empty KV cache of `rows` slots of `context` positions (default the model's): a released one of
        that size when there is one (its steps are recorded already), else a new one."""
        context = self.eng.cfg.context if context is None else int(context)
        for i, cache in enumerate(self._spare):
            if cache.rows == rows and cache.context == context:
                cache = self._spare.pop(i)
                cache.rewind(0)
                return cache
        return KVCache(self.eng.xp, self.eng.cfg, rows, self.eng.act, context)

    def release(self, cache):
        """Hand back a cache no longer used, for new_cache to reuse."""
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

    def batch_step(self, cache, B, T):
        """The sample step of B sequences of T new tokens each over cache, each in the slot and at the position
        its state says (made, and on the GPU recorded, on first use): call it with a state from `batch_state`."""
        if B * T > FEW_ROWS:
            raise ValueError(f"a batched step takes at most {FEW_ROWS} rows, not {B} x {T}")
        return self._step(cache, "sample", B, T, False)

    def _check(self, cache, tokens, steps):
        tokens = np.asarray(tokens, dtype=np.int32)
        if tokens.ndim != 2 or tokens.shape[1] < 1:
            raise ValueError(f"tokens of shape {tokens.shape}: (batch, n) expected")
        if tokens.shape[1] * steps > cache.free:
            raise ValueError(f"the KV cache holds {cache.context} positions; {cache.pos} + "
                             f"{tokens.shape[1] * steps} do not fit")
        return tokens

    def _step(self, cache, kind, B, T, all_heads):
        """The cache's step of this kind and shape: kept (and recorded) when it has at most FEW_ROWS rows."""
        key = (kind, B, T, all_heads, self.graphs)
        step = cache.steps.get(key)
        if step is None:
            few = B * T <= FEW_ROWS
            step = Step(self.eng, cache, kind, B, T, all_heads, self.graphs and few)
            if few:
                cache.steps[key] = step
        return step

    def _run(self, cache, kind, tokens, all_heads, steps):
        B, n = tokens.shape
        return self._step(cache, kind, B, n, all_heads)(tokens.reshape(-1), steps)


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


# A sample step's state after its tokens: a (B,) array a field (float32 or uint32 where VIEWS says), then the
# chained steps' count so far.
FIELDS = ("slot", "position", "index", "top_k", "temperature", "top_p", "seed_lo", "seed_hi", "last")
VIEWS = {"temperature": np.float32, "top_p": np.float32, "seed_lo": np.uint32, "seed_hi": np.uint32}


def _state_size(kind, B, T):
    return B * T + (len(FIELDS) * B + 1 if kind == "sample" else 0)


def _views(kind, state, B, T):
    """Named views of a step's state buffer: tokens (B, T), then for a sample step each of FIELDS and counter
    (1,)."""
    out = {"tokens": state[:B * T].reshape(B, T)}
    if kind != "sample":
        return out
    at = B * T
    for name in FIELDS:
        part = state[at:at + B]
        out[name] = part.view(VIEWS[name]) if name in VIEWS else part
        at += B
    out["counter"] = state[at:at + 1]
    return out


def batch_state(B, T):
    """A host state buffer of a sample step of B sequences of T tokens (int32, zeros), and its named views
    (tokens, slot, position, index, top_k, temperature, top_p, seed_lo, seed_hi, last, counter) to fill."""
    state = np.zeros(_state_size("sample", B, T), dtype=np.int32)
    return state, _views("sample", state, B, T)


class Step:
    """One step kind of one shape over one cache (module docstring): its buffers, its run (recorded as a CUDA
    graph when `graph`), and how its result is read back. Its inputs are one int32 buffer, `state`: the tokens
    (B, T), and a sample step's per-sequence fields (`batch_state`), uploaded at once where they changed. It is
    also what Engine.forward_layers reads of the cache: kv, the position(s), the slot of each sequence (None:
    sequence b in slot b)."""

    def __init__(self, eng, cache, kind, B, T, all_heads, graph):
        cfg, xp = eng.cfg, eng.xp
        self.eng, self.cache, self.kind, self.B, self.T = eng, cache, kind, B, T
        self.heads = cfg.mtp_heads if all_heads else 1
        self.rows = B * T if all_heads else B  # the rows that get logits: every position's, or each sequence's last
        self.state = xp.zeros(_state_size(kind, B, T), dtype=np.int32)
        self.fields = _views(kind, self.state, B, T)
        self.tokens = self.fields["tokens"]
        self.kv = cache.kv
        self.position = self.fields.get("position", cache.position)
        self.slots = self.fields.get("slot")
        self.a = _activations(eng, B, T)
        self.logits = xp.empty((self.rows, self.heads * cfg.vocab_size), dtype=eng.dtype)
        # a greedy step of one token a sequence writes its ids over its own input and logs them by position
        self.feeds_back = kind == "greedy" and not all_heads and T == 1
        self.ids = (self.tokens.reshape(B) if self.feeds_back
                    else xp.empty(self.rows * self.heads, dtype=np.int32))
        self.log = None
        if self.feeds_back:
            self.log = xp.empty((cache.context, B), dtype=np.int32)
        elif kind == "verify":  # (kept id, accepted drafts of the round starting there) by position
            self.log = xp.zeros((cache.context + T, 2), dtype=np.int32)
        elif kind == "sample":  # the ids of the chained steps, by step
            self.log = xp.empty((CHAINED, B), dtype=np.int32)
            self.first_rows = xp.arange(0, B * T, T, dtype=np.int32)  # sequence b's rows start at b * T
            self.last_rows = xp.empty(B, dtype=np.int32)
        self.held = None  # the host copy of what state holds, where the host knows it
        self.graph, self.runs = graph, {}
        self.run = self._recorded(True)

    def _recorded(self, sampling):
        """The step's run, recorded on first use where `graph`. sampling False: a sample step whose rows are all
        greedy, which takes the argmax alone (no sampling kernels to launch)."""
        if sampling not in self.runs:
            run = functools.partial(self._run, sampling)
            self.runs[sampling] = self.eng.layers.graph(run) if self.graph else run
        return self.runs[sampling]

    def _run(self, sampling=True):
        eng, a, layers, B, T = self.eng, self.a, self.eng.layers, self.B, self.T
        eng.forward_layers(self.tokens, a, B, T, self)
        x = a["resid"][-1]
        if self.rows != B * T:  # each sequence's last new row
            if self.kind == "sample":  # row last[b] of its T: a shorter chunk is padded after its end
                eng.xp.add(self.first_rows, self.fields["last"], out=self.last_rows)
                eng.xp.take(x, self.last_rows, axis=0, out=a["last"])
            else:
                a["last"][...] = x.reshape(B, T, -1)[:, -1]
            x = a["last"]
        # the final norm of the rows, then the head product (Engine.forward_layers leaves the final norm to
        # decoding)
        w = eng.p["heads"] if self.heads > 1 else eng.p["heads.0"]
        layers.rmsnorm_matmul_forward(self.logits, a["rstdf"][:x.shape[0]], x, eng.p["final_norm"], w,
                                      eng.cfg.norm_eps, None if a["xnf"] is None else a["xnf"][:x.shape[0]])
        V, f = eng.cfg.vocab_size, self.fields
        if eng.cfg.tokenizer_vocab is not None:  # rows past the tokenizer's vocabulary (padding) are never generated
            self.logits.reshape(self.rows, self.heads, V)[:, :, eng.cfg.tokenizer_vocab:] = -np.inf
        if self.kind == "sample":
            if sampling:
                layers.sample_rows(self.ids, self.logits, f["top_k"], f["temperature"], f["top_p"], f["seed_lo"],
                                   f["seed_hi"], f["index"])
            else:  # every row greedy: sample_rows's draws are the argmax
                layers.argmax(self.ids, self.logits)
            if T == 1:
                layers.feed_back(self.tokens, self.ids, f["position"], f["index"], self.log, f["counter"],
                                 self.cache.context)
            return
        if self.kind == "verify":
            layers.argmax(self.ids, self.logits.reshape(-1, V))
            layers.accept_drafts(self.tokens.reshape(T), self.ids, self.log, self.position)
            return
        if self.kind == "greedy":  # the position moves on with the argmax (one row: in its kernel)
            layers.argmax(self.ids, self.logits.reshape(-1, V), self.log, self.position, T)
            return
        layers.advance_position(self.position, T)

    def __call__(self, state, steps=1):
        """Upload state (the host's, flat: the tokens, or `batch_state`'s buffer) and run `steps` steps, then
        read their result (`read`)."""
        start = self.cache.pos
        self.launch(state, steps)
        return self.read(steps, start, state)

    def launch(self, state, steps):
        """Upload state where it differs from what the device holds (None: go on from where the last steps left
        it, a sample step's log from its first row) and queue `steps` steps on the device without waiting for
        them: the host can work meanwhile, then `read`. Steps chain only where the step feeds its ids back."""
        if steps > 1 and self.kind == "sample" and (self.T != 1 or steps > CHAINED):
            raise ValueError(f"{steps} chained steps: at most {CHAINED}, of one token a sequence")
        if state is None:
            self.fields["counter"][...] = 0
        elif not np.array_equal(self.held, state):
            if self.eng.xp is np:
                self.state[...] = state
            else:
                self.state.set(state)  # one copy to the device, no temporary
        self.held = None  # a sample step's state moves on on the device: uploaded every call
        if state is not None and self.kind == "sample":
            self.run = self._recorded(bool((_views("sample", state, self.B, self.T)["temperature"] > 0).any()))
        for _ in range(steps):
            self.run()

    def read(self, steps, start=None, state=None):
        """The result of the steps launched last (waits for them): a sample step's ids (steps, B); else, from
        the cache's position `start` they ran at with tokens `state`, the kind's (Decoder.logits, greedy,
        verify), the cache's host position moved on."""
        if self.kind == "sample":
            return to_numpy(self.log[:steps]) if self.T == 1 else to_numpy(self.ids)[None]
        if self.kind == "verify":
            return self._read_verify(start, steps)
        B, T = self.B, self.T
        if self.feeds_back:
            self.cache.advanced(steps)
            ids = to_numpy(self.log[start:start + steps]).T  # (B, steps)
            self.held = ids[:, -1].copy()
            return ids if steps > 1 else ids[:, 0]
        self.cache.advanced(T)
        self.held = state.copy()
        shape = (B, T, self.heads) if self.heads > 1 else (B,)
        if self.kind == "greedy":
            return to_numpy(self.ids).reshape(shape)
        V = self.eng.cfg.vocab_size
        return to_numpy(to_float32(self.logits)).reshape(shape + (V,))

    def _read_verify(self, start, steps):
        """The rounds kept 1 to n ids each: walk their accepted counts from the start."""
        n = self.T
        span = to_numpy(self.log[start:start + n * steps + n])
        end, accepted = 0, []
        for _ in range(steps):
            accepted.append(int(span[end, 1]))
            end += accepted[-1] + 1
        following = span[end:end + n, 0].copy()
        self.cache.advanced(end)
        self.held = following
        return span[:end, 0].tolist(), accepted, following
