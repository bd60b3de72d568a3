"""fp32 weights in a generation step: a decode step reads every weight once to make one token a
sequence, so its matmuls run at the copy rate and their time is the weights' bytes; bf16 halves
them (int8/int4 weight-only quantization more). Read from the models the step ran (their
weights' dtypes) and its forward matmuls; a training step or a prefill (many tokens a step:
compute-bound) is not one."""

from __future__ import annotations

from perfloop.analysis.attribution import REPLAY_OP, category
from perfloop.analysis.bound import Bound
from perfloop.analysis.capture import Capture
from perfloop.analysis.causes.base import Findings, by_module
from perfloop.analysis.findings import Finding, Kind
from perfloop.analysis.inductor import COMPILED_OP
from perfloop.analysis.tokens import tokens_per_step
from perfloop.harness.measurement import fmt_ms

WEIGHT_OPS = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul")
MAX_TOKENS = 64  # tokens a step at most for a step to read as a decode step
ADVICE = (
    "keep the weights in bf16 for generation (model.to(torch.bfloat16)): a decode step reads each "
    "weight once a token, so half the bytes is about half the matmul time; weight-only int8/int4 "
    "quantization (torchao) reads less still"
)


def generation_tokens(c: Capture) -> int | None:
    """The tokens a step takes in where it is a generation step (inference, few tokens), else None."""
    found = tokens_per_step(c)
    if found is None or found[0] > MAX_TOKENS or any(i.phase == "backward" for i in c.items):
        return None
    return found[0]


def _fp32_bytes(c: Capture) -> int:
    """The fp32 weights' bytes of a generation step whose weights are mostly fp32, else 0."""
    model = c.model or {}
    fp32 = (model.get("dtypes") or {}).get("float32", 0)
    if generation_tokens(c) is None or not model.get("weights") or fp32 < 0.5 * model["weights"]:
        return 0
    return fp32


def matmuls(c: Capture) -> list:
    """The forward's weight matmuls this finding explains (the ops finding leaves them out);
    none where it does not apply."""
    if not _fp32_bytes(c):
        return []
    return [i for i in c.items if i.phase not in ("backward", "optimizer") and _weight_matmul(i)]


def _weight_matmul(i) -> bool:
    """A forward matmul of the weights: by its op, or (compiled code, a graph's replay no compiled
    graph said the call of) by its kernel's name."""
    if i.op in WEIGHT_OPS or i.outer_op in WEIGHT_OPS:
        return True
    return (not i.op or i.op.startswith((COMPILED_OP, REPLAY_OP))) and category(i.kernel) == "matmul"


def find(c: Capture, ceilings: dict) -> list[Finding]:
    fp32, tokens, model = _fp32_bytes(c), generation_tokens(c), c.model or {}
    if not fp32:
        return []
    mms = matmuls(c)
    mm_ms = sum(i.ms for i in mms) / c.calls
    share = fp32 / model["weights"]
    f = Findings(c, ceilings)
    where = ", ".join(m for m, _ in by_module(mms, c.calls)[:3] if m)
    f.add(
        Kind.DECODE_WEIGHTS,
        f"fp32 weights read for {tokens} token(s) a step",
        mm_ms * share / 2,
        Bound.MEMORY,
        f"{fp32 / 1e6:,.1f} MB of fp32 weights ({share:.0%} of the weights) read each step; the forward's "
        f"matmuls take {fmt_ms(mm_ms)} of it",
        ADVICE,
        where,
        fp32_bytes=fp32,
        matmul_ms=mm_ms,
        tokens=tokens,
    )
    return f.found
