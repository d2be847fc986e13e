"""Log-likelihoods of continuations given contexts, batched, on either engine: what multiple-choice scoring
(HellaSwag, the user's own items) is made of.

    requests = [encode_pair(tok, context, " " + choice) for ...]    # (context ids, continuation ids)
    logprobs = loglikelihoods(eng, requests, batch_size=64)          # (N,) float64: sum of log p(token)

The token split is lm-evaluation-harness's (HFLM._encode_pair, causal models): spaces that end the context
move to the front of the continuation, the whole text (context + continuation) is encoded once, and the
continuation's tokens are the whole's past the length of the context's own encoding. An empty context is
the end-of-text token, as lm-eval's prefix token (BOS, else EOS). A sequence longer than the model's context
keeps its last tokens: the row is the last context + 1 tokens of context + continuation, less the final one
(lm-eval's left truncation), so the continuation is always scored whole.

Batching: rows are sorted by length, longest first (as lm-eval does: the first batch shows at once whether
memory suffices), cut into batches of `batch_size` rows padded to a multiple of PAD_MULTIPLE tokens (so the
engine's buffers, made per batch shape, are reused across batches), and one Engine.forward per batch gives
head 0's cross-entropy at every position: targets are -1 everywhere but the continuation's tokens, so a row's
summed losses are minus its continuation's log-probability. Requests whose rows are identical (the same
context and continuation) are computed once, and contexts shared by several one-token continuations
(choices among single tokens, as "A"/"B"/"C"/"D" after a question) are run once for all of them, each
choice's log-probability read off the logits of the context's last position, as lm-eval's logits cache
does. Choices of several tokens each need their own row: a causal forward cannot hold two continuations of
one context without a mask between them.
"""
import numpy as np
from tqdm import tqdm

from nanoeuler.errors import UserError
from nanoeuler.model.engine import to_numpy
from nanoeuler.model.losses import log_softmax

PAD_MULTIPLE = 16  # row lengths rounded up to this: few distinct batch shapes, little padding
LOGITS_BUDGET = 1 << 25  # floats of logits a batch of shared contexts reads back (128 MiB)


def encode_pair(tok, context, continuation):
    """(context ids, continuation ids) as lm-evaluation-harness splits them for a causal model; a context of
    whitespace alone counts as empty (its spaces join the continuation), so that every request has a context."""
    if not context.strip():
        return [tok.eos_id], tok.encode(context + continuation)
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tok.encode(context + continuation)
    context_ids = tok.encode(context)
    return context_ids, whole[len(context_ids):]


def scoring_row(context_ids, continuation_ids, max_tokens):
    """(input ids, number of scored positions at the row's end): the last max_tokens + 1 tokens of context +
    continuation, less the final one; its targets are the same tokens shifted by one."""
    whole = list(context_ids) + list(continuation_ids)
    window = whole[-(max_tokens + 1):]
    return window, len(continuation_ids)


def loglikelihoods(eng, requests, batch_size, progress=True, desc="scoring", comm=None):
    """(N,) float64: for each (context ids, continuation ids), the sum of head 0's log-probabilities of the
    continuation's tokens given what precedes them. Continuations longer than the model's context cannot be
    scored whole, nor empty ones: a ValueError names the first. With comm (N ranks, `eval --gpus N`), rank r
    scores every N-th of the batches one process makes, and the ranks' sum (zeros elsewhere) gives every rank
    all the scores: the numbers of one process."""
    C = eng.cfg.context
    rows, index = {}, np.empty(len(requests), dtype=np.int64)
    for i, (context_ids, continuation_ids) in enumerate(requests):
        if not 1 <= len(continuation_ids) <= C:
            raise ValueError(f"request {i}: a continuation of {len(continuation_ids)} tokens cannot be scored "
                             f"with a context of {C}")
        window, scored = scoring_row(context_ids, continuation_ids, C)
        index[i] = rows.setdefault((tuple(window), scored), len(rows))
    unique = list(rows)
    by_input = {}  # one-token continuations by their input row: the same context
    for r, (window, scored) in enumerate(unique):
        if scored == 1:
            by_input.setdefault(window[:-1], []).append(r)
    shared = [members for members in by_input.values() if len(members) > 1]
    alone = sorted(set(range(len(unique))) - {r for members in shared for r in members})
    scores = np.zeros(len(unique), dtype=np.float64)
    share = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    with tqdm(total=len(unique), desc=desc, unit=" rows", disable=not progress or share[0] > 0,
              dynamic_ncols=True) as bar:
        _score_rows(eng, unique, alone, batch_size, scores, bar, share)
        _score_shared(eng, unique, shared, batch_size, scores, bar, share)
    if share[1] > 1:
        scores = comm.all_reduce_sum(scores)
    return scores[index]


def _batches(items, length, batch_size, context, share=(0, 1)):
    """items sorted longest first, cut into batches, each with its padded length (a multiple of PAD_MULTIPLE);
    share (rank, ranks): this rank's, every ranks-th batch from the rank-th."""
    items = sorted(items, key=lambda item: -length(item))
    rank, ranks = share
    for start in range(rank * batch_size, len(items), batch_size * ranks):
        batch = items[start:start + batch_size]
        yield batch, min(context, -(-length(batch[0]) // PAD_MULTIPLE) * PAD_MULTIPLE)


def _score_rows(eng, unique, rows, batch_size, scores, bar, share=(0, 1)):
    """One Engine.forward a batch: targets -1 but at the continuation, so a row's summed losses are minus its
    log-probability."""
    K = eng.cfg.mtp_heads
    for batch, T in _batches(rows, lambda r: len(unique[r][0]) - 1, batch_size, eng.cfg.context, share):
        inputs = np.zeros((len(batch), T), dtype=np.int32)
        targets = np.full((K, len(batch), T), -1, dtype=np.int32)
        for b, r in enumerate(batch):
            window, scored = unique[r]
            n = len(window) - 1
            inputs[b, :n] = window[:-1]
            targets[0, b, n - scored:n] = window[n - scored + 1:]
        losses = eng.forward(inputs, targets)[0].reshape(len(batch), T).sum(axis=1)
        scores[batch] = -to_numpy(losses).astype(np.float64)
        bar.update(len(batch) * share[1])


def _score_shared(eng, unique, groups, batch_size, scores, bar, share=(0, 1)):
    """Groups of one-token continuations of one context (multiple choice among single tokens): one forward of the
    context for the whole group, every member's log-probability read off its last position's logits. Batches
    are capped so that their logits stay under LOGITS_BUDGET floats."""
    V = eng.cfg.vocab_size
    rows = max(1, min(batch_size, LOGITS_BUDGET // (eng.cfg.context * V)))
    for batch, T in _batches(groups, lambda g: len(unique[g[0]][0]) - 1, rows, eng.cfg.context, share):
        inputs = np.zeros((len(batch), T), dtype=np.int32)
        for b, members in enumerate(batch):
            window = unique[members[0]][0]
            inputs[b, :len(window) - 1] = window[:-1]
        logits = eng.logits(inputs)
        for b, members in enumerate(batch):
            logp = log_softmax(logits[b, len(unique[members[0]][0]) - 2])
            for r in members:
                scores[r] = logp[unique[r][0][-1]]
            bar.update(len(members) * share[1])


def choice_requests(tok, items, delimiter=" "):
    """The requests of multiple-choice items (dicts with context, choices): one per choice, the choice
    following the context after `delimiter` (lm-eval's target_delimiter, a space by default); and each
    item's first request's index."""
    requests, first = [], []
    for item in items:
        first.append(len(requests))
        requests.extend(encode_pair(tok, item["context"], delimiter + choice) for choice in item["choices"])
    return requests, first


def check_requests(items, requests, first, context):
    """A one-line UserError naming the first item with a choice that cannot be scored: one with no token of its
    own (the tokenizer merged it into the context) or longer alone than the model's context."""
    for i, item in enumerate(items):
        for j in range(len(item["choices"])):
            n = len(requests[first[i] + j][1])
            if not 1 <= n <= context:
                why = ("has no token of its own" if n == 0
                       else f"is {n} tokens, more than the model's context of {context}")
                raise UserError(f"{item.get('where', f'item {i + 1}')}: choice {j} {why}; it cannot be scored")
