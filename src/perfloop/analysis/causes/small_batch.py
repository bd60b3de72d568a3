"""A generation step that makes few tokens where its device has room for many: a decode step reads
every weight once however many sequences it serves, so at batch 1 it is bound by that read, and
up to the napkin math's batch (tokens.batch_bound: where the matmuls' FLOPs reach the read's time)
more sequences a step cost little more time -- tokens/s grows about as the batch.

Told where the step already runs near its read bound (its must-read bytes at MIN_SHARE of the
copy ceiling or more, over the step's wall time: an eager decode waiting on its launches, or a
graphed one stalled by syncs, has those to fix first) and its weights are not fp32 (halving their
bytes comes first: decode_weights). The batch it proposes is the largest power of two up to a
quarter of the napkin batch, which keeps the matmuls well under their compute time; the step at
that batch is predicted from the bytes it must read (the same weights, the KV cache once a
sequence) at the rate the step reads now, no faster than the matmuls' FLOPs allow; the saving is
what a step's tokens cost now less what they would cost in the larger step."""

from __future__ import annotations

from perfloop.analysis.bound import Bound
from perfloop.analysis.capture import Capture
from perfloop.analysis.causes import decode_weights
from perfloop.analysis.causes.base import Findings
from perfloop.analysis.findings import Finding, Kind
from perfloop.analysis.tokens import read, weights_matmul
from perfloop.harness.measurement import fmt_ms

MIN_SHARE = 0.5  # of the copy ceiling: below it the step is held by something other than the read
QUARTER = 4  # the batch proposed: at most the napkin batch over this
ADVICE = (
    "serve more sequences in each step: batch the requests (one prompt tensor of B rows, a KV cache "
    "of batch B; or a server that batches continuously: vLLM, SGLang, TGI); each token still reads "
    "the weights once a step, so the step grows little and tokens/s about as the batch, up to the "
    "batch where the matmuls' FLOPs take over"
)


def proposed(tokens: int, bound: float) -> int | None:
    """The tokens a step proposed: the largest power of two up to bound / QUARTER, where that is
    at least twice `tokens`, else None (the step has no such room)."""
    n = 1
    while n * 2 <= bound / QUARTER:
        n *= 2
    return n if n >= 2 * tokens else None


def find(c: Capture, ceilings: dict) -> list[Finding]:
    t = read(c, ceilings or {})
    if t is None or decode_weights.generation_tokens(c) is None or decode_weights.matmuls(c):
        return []
    if not t.batch_bound or t.share is None or t.share < MIN_SHARE or not t.weights_bytes:
        return []
    n = proposed(t.per_step, t.batch_bound)
    if n is None:
        return []
    grow = n / t.per_step  # the sequences a step serves grow by this
    cache = t.cache_bytes or 0
    read_now, read_then = t.weights_bytes + cache, t.weights_bytes + cache * grow
    itemsize, tflops = weights_matmul(c.model or {}, ceilings)  # known: t.batch_bound is
    flops_ms = 2 * t.weights_bytes / itemsize * n / (tflops * 1e12) * 1e3
    then_ms = max(t.step_ms * read_then / read_now, flops_ms)
    saves = t.step_ms - then_ms / grow
    f = Findings(c, ceilings)
    seqs = (t.sequences or 1) * grow
    f.add(
        Kind.SMALL_BATCH,
        f"{t.per_step} token(s) a step, bound by reading the weights: {n} would take "
        f"~{then_ms / t.step_ms:.1f}x the step, {grow:g}x the tokens",
        saves,
        Bound.MEMORY,
        f"the step reads {read_now / 1e9:.3g} GB (weights and KV cache) at {t.share:.0%} of the copy "
        f"ceiling for {t.per_step} token(s): {t.tokens_per_s:,.0f} tokens/s; the matmuls' FLOPs reach "
        f"that read at ~{t.batch_bound:,.0f} tokens a step (napkin math); at {n} tokens a step "
        f"({seqs:g} sequences, KV cache {cache * grow / 1e9:.3g} GB) it reads {read_then / 1e9:.3g} GB: "
        f"~{fmt_ms(then_ms)} a step, {fmt_ms(then_ms / n)} a token, ~{n / then_ms * 1e3:,.0f} tokens/s",
        ADVICE,
        tokens=t.per_step,
        batch=n,
        batch_bound=t.batch_bound,
        step_ms_then=then_ms,
        tokens_per_s=t.tokens_per_s,
        tokens_per_s_then=n / then_ms * 1e3,
        share=t.share,
    )
    return f.found
