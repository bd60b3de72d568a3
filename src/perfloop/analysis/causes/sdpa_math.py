"""scaled_dot_product_attention run by its math backend: the call is written as SDPA, but it ran
as matmuls and a softmax with the scores through memory, because a backend was forced
(`sdpa_kernel(SDPBackend.MATH)`, `enable_flash_sdp(False)`) or the fused kernels refused the
inputs (a dtype, a head size, a mask's layout). Read from the ops each SDPA call ran: a fused
backend shows as one op (`_scaled_dot_product_flash_attention`, `_efficient_attention_forward`,
`_scaled_dot_product_cudnn_attention`, `..._for_cpu`), the math one as bmm and softmax.

The saving is the math path's time less what a fused kernel needs: its inputs and output once
at the copy ceiling, or its FLOPs at the matmul ceiling of q, k and v's dtype (the math path
upcasts 16-bit ones; half the FLOPs where it built a causal mask, is_causal=True: a fused kernel
skips the masked blocks), whichever is longer."""

from __future__ import annotations

import re

from perfloop.analysis.bound import Bound
from perfloop.analysis.capture import Capture
from perfloop.analysis.causes.base import Findings, by_module
from perfloop.analysis.findings import Finding, Kind
from perfloop.analysis.patterns import SDPA
from perfloop.harness.measurement import fmt_ms, matmul_ceiling

FUSED = re.compile(r"_scaled_dot_product_(flash|efficient|cudnn|fused)|_(flash|efficient)_attention")
MATH = re.compile(r"softmax")
ADVICE = (
    "let scaled_dot_product_attention pick a fused kernel: drop the forced backend "
    "(sdpa_kernel(SDPBackend.MATH), torch.backends.cuda.enable_flash_sdp(False) / "
    "enable_mem_efficient_sdp(False)); if nothing forces it, the fused kernels refused the inputs: "
    "bf16/fp16 q, k, v, a head size of at most 256, a contiguous last dimension, is_causal=True "
    "instead of a causal mask (torch warns why with TORCH_LOGS=+sdpa or under sdpa_kernel(FLASH_ATTENTION))"
)


def _sdpa(i) -> bool:
    return i.outer_op == SDPA or i.op == SDPA


def _records(c: Capture, items) -> list:
    """The counted op records behind the items, in the order they ran."""
    records = c.records or ()
    marks = sorted({m for i in items for m in i.markers if m < len(records) and records[m] is not None})
    return [records[m] for m in marks]


def _names(c: Capture, items) -> set[str]:
    """The ops an SDPA call ran: its items' own ops and the counted records behind them."""
    return {i.op for i in items} | {r.op for r in _records(c, items)}


def _counted(c: Capture) -> list:
    """The counted call's SDPA items (markers tie them to their ops' records)."""
    return [i for i in (c.counted_items or c.items) if _sdpa(i)]


def math_calls(c: Capture) -> list:
    """The step's SDPA items where the counted call ran the math backend, else none (the ops
    finding leaves them to this one)."""
    counted = _counted(c)
    if not counted:
        return []
    names = _names(c, counted)
    if any(FUSED.search(n) for n in names) or not any(MATH.search(n) for n in names):
        return []
    return [i for i in c.items if _sdpa(i)]


def _fused_ms(f: Findings, c: Capture, counted: list) -> tuple[float, float, float]:
    """(ms, bytes, FLOPs) a fused kernel needs for the counted call's SDPA: the storages the math
    path read before writing them (q, k, v, a mask) and its last output, once; its matmuls' FLOPs."""
    ran = _records(c, counted)
    written: set = set()
    read_bytes, flops, last_write = 0.0, 0.0, 0.0
    for r in ran:
        read_bytes += sum(b for k, b in r.reads if k[:2] not in written)  # (storage, offset): any view
        written |= {k[:2] for k, _ in r.writes}
        flops += r.flops if "mm" in r.op else 0.0
        last_write = sum(b for _, b in r.writes) or last_write
    nbytes = read_bytes + last_write
    if any(r.op == "aten::tril" for r in ran):  # is_causal: a fused kernel skips the masked half
        flops /= 2
    # the math path upcasts 16-bit q, k, v to fp32 for its matmuls: a fused kernel keeps their dtype
    dtype = next((d for d in ("bf16", "fp16") if any(r.dtype == d for r in ran)), None)
    dtype = dtype or next((r.dtype for r in ran if "mm" in r.op), None)
    tflops = matmul_ceiling(f.ceilings, dtype)
    ms = max(f.at_copy_ms(nbytes), flops / (tflops * 1e12) * 1e3 if tflops else 0.0)
    return ms, nbytes, flops


def find(c: Capture, ceilings: dict) -> list[Finding]:
    items = math_calls(c)
    if not items:
        return []
    f = Findings(c, ceilings)
    math_ms = sum(i.ms for i in items) / c.calls
    fused_ms, nbytes, flops = _fused_ms(f, c, _counted(c))
    where = ", ".join(m for m, _ in by_module(items, c.calls)[:3] if m)
    f.add(
        Kind.SDPA_MATH,
        "scaled_dot_product_attention ran its math backend: the scores go through memory",
        max(math_ms - fused_ms, 0.0),
        Bound.MEMORY,
        f"SDPA ran as matmuls and a softmax, {fmt_ms(math_ms)} a step; a fused kernel needs about "
        f"{fmt_ms(fused_ms)} ({nbytes / 1e6:,.1f} MB in and out once, {flops / 1e9:,.2f} GFLOP)",
        ADVICE,
        where,
        math_ms=math_ms,
        fused_ms=fused_ms,
    )
    return f.found
