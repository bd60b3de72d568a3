"""A KV cache grown by torch.cat in a generation step: each token the past keys and values are read
and written whole into a new tensor one position longer (hand-written decoders, transformers'
DynamicCache), so the copy grows with the context and the shapes change every token (no CUDA
graph, a recompile per length). A preallocated cache (gpt-fast's KVCache, transformers'
StaticCache) writes only the new token's keys and values.

Read from the step's eager `aten::cat` calls whose counted inputs are one large piece (the past)
and small ones (the new token's): the saving is their time less the new pieces written once at
the copy ceiling. Compiled code's cat is fused into Inductor's kernels and is not read here."""

from __future__ import annotations

from perfloop.analysis.bound import Bound
from perfloop.analysis.capture import Capture
from perfloop.analysis.causes.base import Findings, by_module
from perfloop.analysis.causes.decode_weights import generation_tokens
from perfloop.analysis.findings import Finding, Kind
from perfloop.harness.measurement import fmt_ms

CAT = "aten::cat"
GROWN = 8.0  # the past at least this many times the new piece: a cache grown by a token or a few
ADVICE = (
    "preallocate the KV cache to the longest sequence and write each token's keys and values into "
    "it in place (k_cache[:, :, pos] = k, or index_copy_; gpt-fast's KVCache, transformers' "
    "cache_implementation='static'), attending over the whole cache with a mask that hides the "
    "unfilled part (not a slice of it: a slice is a new shape every token, which SDPA's cuDNN backend "
    "plans anew); the step then copies one token, keeps its shapes, and can be compiled once and "
    "replayed as a CUDA graph"
)


def _grown(record) -> tuple[float, float] | None:
    """(the past's bytes, the new pieces' bytes) of a cat that grows one large floating-point
    input by small ones (keys and values; a generate loop's token ids are not a cache), else None."""
    if not record.dtype.startswith(("fp", "bf", "tf")):
        return None
    sizes = sorted((b for _, b in record.reads), reverse=True)
    if len(sizes) < 2 or not sizes[-1] or sizes[0] < GROWN * sum(sizes[1:]):
        return None
    return float(sizes[0]), float(sum(sizes[1:]))


def _grown_cats(c: Capture) -> list[tuple[object, float, float]]:
    """(item, the past's bytes, the new pieces' bytes) of each of the counted call's cats that
    grows a cache, where the step is a generation step, else []."""
    if generation_tokens(c) is None:
        return []
    records, found = c.records or (), []
    for i in c.counted_items or ():
        if i.op != CAT:
            continue
        got = [_grown(records[m]) for m in i.markers if m < len(records) and records[m] is not None]
        if got and all(got):
            found.append((i, max(p for p, _ in got), sum(n for _, n in got)))
    return found


def _explained(c: Capture, counted: list) -> list:
    modules = {i.module for i, _, _ in counted}
    return [i for i in c.items if i.op == CAT and i.module in modules]


def cats(c: Capture) -> list:
    """The step's cat items this finding explains (the ops finding leaves them out)."""
    return _explained(c, _grown_cats(c))


def find(c: Capture, ceilings: dict) -> list[Finding]:
    counted = _grown_cats(c)
    items = _explained(c, counted)
    if not items:
        return []
    f = Findings(c, ceilings)
    new, past = sum(n for _, _, n in counted), max(p for _, p, _ in counted)
    cat_ms = sum(i.ms for i in items) / c.calls
    keep_ms = f.at_copy_ms(new)  # a static cache still writes the new token's keys and values
    where = ", ".join(m for m, _ in by_module(items, c.calls)[:3] if m)
    f.add(
        Kind.KV_CAT,
        f"KV cache grown by torch.cat: {len(counted)} cat(s) a step copy the past keys and values",
        max(cat_ms - keep_ms, 0.0),
        Bound.MEMORY,
        f"{len(counted)} cat(s) a step each copy a past {past / 1e6:,.2f} MB to add "
        f"{new / len(counted) / 1e3:,.1f} kB; {fmt_ms(cat_ms)} a step, growing with the context",
        ADVICE,
        where,
        cats=len(counted),
        cat_ms=cat_ms,
        new_bytes=new,
    )
    return f.found
