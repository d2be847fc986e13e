"""How large serve's KV cache is: slots x positions that fit the memory left after the model.

The cache holds `slots` sequences of `context` positions each, plus one scratch slot that a step's padding rows
write to; its bytes are decoding.kv_cache_bytes (layers x K and V x kv heads x head_dim x positions x slots x
bytes an element: bf16 on the GPU, float32 on the CPU). The memory it may take:
the free memory of the device once the weights are loaded (nanoeuler/model/memory.py; NANOEULER_MEMORY_AVAILABLE
replaces it), minus a margin for the steps' activations, the scoring forward and workspace.

The choice (`plan`): the model's context for every slot where that fits. Else, with neither --context nor
--slots given, the largest power of two of positions, at least MIN_CONTEXT (or the model's context where
that is smaller), that fits the default slots; where even MIN_CONTEXT does not, MIN_CONTEXT with as many slots
as fit. A --context or --slots given is kept and the other one chosen the same way; given values that do not
fit are refused in one line naming the bytes needed and available.
"""
from dataclasses import dataclass

from nanoeuler.errors import UserError
from nanoeuler.infer.scheduler import SCORE_TOKENS  # positions of one scoring forward (its float32 logits)
from nanoeuler.model.decoding import kv_cache_bytes
from nanoeuler.model.memory import GiB, free_bytes, gpu_in_use, size_text

MIN_CONTEXT = 2048  # the fewest positions a slot gets unless asked (or the model has fewer)


@dataclass(frozen=True)
class CachePlan:
    slots: int
    context: int
    bytes: int        # of slots + 1 rows (the scratch one included)
    reason: str       # why, for the startup line: "" where the model's context fits every slot


def margin(cfg):
    """Memory kept out of the cache: 1 GiB of activations and workspace, and twice a scoring forward's float32
    logits (SCORE_TOKENS positions x vocab)."""
    return GiB + 2 * SCORE_TOKENS * cfg.vocab_size * 4


def available(cfg, gpu, limit=None):
    """The bytes the cache may take on this engine: the free memory (or NANOEULER_MEMORY_AVAILABLE) minus the
    margin, at least 0; with limit (serve --gpu-memory: all the GPU memory the server may hold, weights
    included), no more than limit less the memory in use now (memory.gpu_in_use) and the margin."""
    room = free_bytes(gpu) - margin(cfg)
    if limit is not None and gpu:
        room = min(room, limit - gpu_in_use() - margin(cfg))
    return max(0, room)


def plan(cfg, itemsize, budget, slots=None, context=None, default_slots=64):
    """The CachePlan for a model config, the cache's bytes an element, `budget` bytes it may take, and the
    --slots / --context given (None: not given); UserError where what was given cannot fit."""
    model = cfg.context
    need = lambda s, c: kv_cache_bytes(cfg, c, s + 1, itemsize)
    if context is not None and not 2 <= context <= model:
        raise UserError(f"--context must be 2 to the model's context {model:,}, got {context:,}")

    def refuse(s, c):
        raise UserError(f"a KV cache of {s} slot{'s' if s != 1 else ''} x {c:,} positions needs {need(s, c):,} bytes "
                        f"({size_text(need(s, c))}); {budget:,} bytes ({size_text(budget)}) are available after the "
                        f"model and a margin of {size_text(margin(cfg))}: lower --slots or --context")

    if slots is not None and context is not None:
        if need(slots, context) > budget:
            refuse(slots, context)
        return CachePlan(slots, context, need(slots, context), "")
    s = default_slots if slots is None else slots
    if context is not None:  # slots chosen: as many as fit, at most the default
        if need(1, context) > budget:
            refuse(1, context)
        fit = s
        while fit > 1 and need(fit, context) > budget:
            fit -= 1
        reason = "" if fit == s else f"{s} slots of {context:,} positions do not fit {size_text(budget)}"
        return CachePlan(fit, context, need(fit, context), reason)
    if need(s, model) <= budget:
        return CachePlan(s, model, need(s, model), "")
    floor = min(MIN_CONTEXT, model)
    c = 1 << (model.bit_length() - 1)  # the largest power of two at or below the model's context
    while c > floor and need(s, c) > budget:
        c //= 2
    c = max(c, floor)
    if need(s, c) <= budget:
        return CachePlan(s, c, need(s, c), f"the model allows {model:,}")
    if slots is not None:  # the slots given: not even the smallest context fits them
        refuse(slots, floor)
    fit = s
    while fit > 1 and need(fit, floor) > budget:
        fit -= 1
    if need(fit, floor) > budget:
        refuse(1, floor)
    return CachePlan(fit, floor, need(fit, floor),
                     f"the model allows {model:,}; {s} slots of {floor:,} positions do not fit {size_text(budget)}")


def describe(p, dtype_name, model_context):
    """The startup line's account of the cache."""
    line = f"KV cache: {p.slots} slot{'s' if p.slots != 1 else ''} x {p.context:,} positions ({dtype_name}, {size_text(p.bytes)}"
    if p.reason:
        line += f"; {p.reason}: --context/--slots to change"
    return line + ")"
