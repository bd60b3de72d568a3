"""Each op (and phase) against its roofline, where no earlier finding explains its time: fp32
matmuls with TF32 off (one switch fixes them all), ops below their ceiling (the roofline's
headroom), short kernels far from both ceilings, and the casts autocast inserts (an Inductor
kernel named for a cast is a fused kernel with the cast folded in: a row like any other)."""

from __future__ import annotations

from perfloop.analysis import attribution as attr
from perfloop.analysis.bound import Bound
from perfloop.analysis.capture import Capture
from perfloop.analysis.causes import (
    attention,
    conv_layout,
    data_prep,
    decode_weights,
    fusion,
    kv_cat,
    layout,
    pageable,
    sdpa_math,
)
from perfloop.analysis.causes.base import Findings
from perfloop.analysis.findings import Finding, Kind, Site, count_words
from perfloop.analysis.inductor import COMPILED_OP
from perfloop.analysis.patterns import ADVICE, chain_kind, where_any
from perfloop.harness.measurement import fmt_ms, matmul_ceiling

BATCH_NORM = (
    "channels_last (model.to(memory_format=torch.channels_last) and the input batch): cuDNN's NHWC "
    "batch norm, with no transposes around the convolutions; torch.compile fuses it with the "
    "activation after it; for inference, fold it into the convolution before it"
)


def kept(c: Capture, ceilings: dict) -> list:
    """The items no earlier finding explains: not the written-out attention's, the fused runs',
    the optimizer's, the pageable or the layout copies', the convolutions' transposes, a decode
    step's fp32 weight matmuls, SDPA's math backend, a KV cache's growing cats, the batch's
    preparation."""
    taken = attention.covered(c) | fusion.covered(c, ceilings)
    moved = pageable.copies(c) + layout.copies(c, ceilings) + conv_layout.transposes(c)
    moved += decode_weights.matmuls(c) + sdpa_math.math_calls(c) + kv_cat.cats(c) + data_prep.items(c.items)
    taken_items = {id(i) for i in moved}
    return [
        i
        for i in c.items
        if (i.module, i.phase, i.op) not in taken and i.phase != "optimizer" and id(i) not in taken_items
    ]


def rows(c: Capture, ceilings: dict) -> list:
    """The op/phase rows of the kept items, with their work against the ceilings."""
    return attr.group(kept(c, ceilings), "op/phase", work=c.work, ceilings=ceilings, l2_bytes=c.l2_bytes)


def top_row(c: Capture, ceilings: dict):
    """The heaviest kept row, or None."""
    return max(rows(c, ceilings), key=lambda r: r.device_ms, default=None)


def find(c: Capture, ceilings: dict) -> list[Finding]:
    f = Findings(c, ceilings)
    left = kept(c, ceilings)
    casts, fp32 = 0.0, []
    sites = _row_sites(left)
    for row in attr.group(left, "op/phase", work=c.work, ceilings=ceilings, l2_bytes=c.l2_bytes):
        cat = attr.category(row.name.rsplit(" (", 1)[0])
        if cat == "dtype cast/copy" and not row.name.startswith(COMPILED_OP):
            casts += row.device_ms / c.calls
        elif _tf32_off(f, row, cat):
            fp32.append(row)
        else:
            _below_ceiling(f, row, cat, sites.get(row.name))
    if fp32:
        _fp32_matmuls(f, fp32, sites)
    if casts:
        eager = [i for i in left if not i.op.startswith(COMPILED_OP)]
        n = sum(1 for i in eager if attr.category(i.op or i.kernel) == "dtype cast/copy") // c.calls
        f.add(
            Kind.DTYPE_CAST,
            f"dtype casts and copies: {n} per call",
            casts,
            Bound.MEMORY,
            f"{fmt_ms(casts)} per call in copy kernels (autocast casts each weight on every use)",
            "keep the weights in the compute dtype (bf16 parameters with an fp32 master copy), or "
            "torch.compile, which folds the casts into the kernels that use them",
        )
    return f.found


def _row_sites(kept: list) -> dict:
    """op/phase row name -> the Site of its heaviest placed module (compiled code's kernels and
    extern calls carry the line they came from)."""
    ms: dict = {}
    for i in kept:
        if i.line:
            key = (attr.key_of(i, "op/phase"), i.module, i.line)
            ms[key] = ms.get(key, 0.0) + i.ms
    out: dict = {}
    for (name, module, line), _ms in sorted(ms.items(), key=lambda kv: kv[1]):
        out[name] = Site(module, line)  # the heaviest last
    return out


def _faster_ceiling(f: Findings) -> float:
    return max(
        filter(None, [f.ceilings.get("matmul_tf32_tflops"), f.ceilings.get("matmul_bf16_tflops")]), default=0
    )


def _tf32_off(f: Findings, row, cat: str) -> bool:
    """Whether a row is an fp32 matmul where a TF32 or bf16 ceiling is much higher."""
    fp32 = matmul_ceiling(f.ceilings, "fp32") or 0
    return bool(
        cat == "matmul" and row.dtype == "fp32" and row.flops and fp32 and _faster_ceiling(f) > 1.5 * fp32
    )


def _fp32_matmuls(f: Findings, rows: list, sites: dict) -> None:
    """The fp32 matmul rows with TF32 off, as one finding: one switch fixes them all. Each saves
    its time less its time at the faster ceiling (or at the copy rate, where that is longer)."""
    faster = _faster_ceiling(f)
    rows = sorted(rows, key=lambda r: -r.device_ms)
    at = [max(f.at_copy_ms(r.bytes), r.flops / (faster * 1e12) * 1e3) for r in rows]
    saves = sum(r.device_ms - t for r, t in zip(rows, at, strict=True)) / f.c.calls
    each = "; ".join(f"{r.name}: {r.calls // f.c.calls} call(s), {r.tflops:.1f} TFLOP/s" for r in rows[:3])
    site = sites.get(rows[0].name)
    f.add(
        Kind.PRECISION,
        f"{rows[0].name}{f' and {len(rows) - 1} more' if len(rows) > 1 else ''}: fp32 matmuls with TF32 off",
        saves,
        Bound.PRECISION,
        f"{each}; the TF32 ceiling is {faster:.0f}",
        "torch.backends.cuda.matmul.allow_tf32 = True (torch.set_float32_matmul_precision('high')), "
        "or bf16 autocast",
        str(site or ""),
        site,
        tflops=rows[0].tflops,
        tf32_ceiling_tflops=faster,
    )


def _below_ceiling(f: Findings, row, cat: str, site: Site | None = None) -> None:
    if row.headroom_ms is None or row.bound is None:
        return
    of = row.of_matmul if row.bound == Bound.COMPUTE else row.of_copy
    ceiling = "matmul" if row.bound == Bound.COMPUTE else "copy"
    calls = count_words(row.calls // f.c.calls, "call", "calls")
    ev = f"{calls}, {fmt_ms(row.device_ms / f.c.calls)} per call" + (
        f", {of:.0%} of the {ceiling} ceiling" if of is not None else ""
    )
    if row.bound == Bound.LATENCY:
        short = "the GPU" if f.c.device == "cuda" else "the CPU's threads, its dispatch a large share"
        ev += f", mean {row.device_ms * 1e3 / row.calls:.1f} us: too short to fill {short}"
    latency = (
        "fewer, larger launches: fuse (torch.compile) or batch them; CUDA graphs"
        if f.c.device == "cuda"
        else "fewer, larger ops: fuse (torch.compile) or batch them"
    )
    advice = ADVICE.get(cat, ADVICE["other"]) if row.bound != Bound.LATENCY else latency
    if cat == "matmul" and row.bound != Bound.LATENCY:
        dims = matmul_dims(f.c, row.name)
        advice = _matmul_advice(f, row, dims)
        if advice is None:  # aligned, in the fastest dtype measured: no fix of a matmul's claims the gap
            return
        ev += "".join(f", {m}x{n}x{k} (MxNxK)" for m, n, k in sorted(dims)[:3])
    if (
        cat == "normalization" and "batch_norm" in row.name and row.bound != Bound.LATENCY
    ):  # not perfloop.nn's
        advice = BATCH_NORM
    if cat == "attention" and row.name.startswith("aten::") and "attention" in row.name:  # already fused
        advice = (
            "already scaled_dot_product_attention: only another backend measured faster at this "
            "shape helps (perfloop bench attention, with torch.nn.attention.sdpa_kernel to pick it)"
        )
    f.add(
        Kind.LATENCY if row.bound == Bound.LATENCY else Kind.ROOFLINE,
        f"{row.name} below its ceiling",
        row.headroom_ms / f.c.calls,
        row.bound,
        ev,
        advice,
        str(site) if site else where_any(chain_kind([row.name.rsplit(" (", 1)[0]]), f.c.sites),
        site,
    )


TILE = 64  # a dimension this large fills a matmul kernel's tiles whole where it is a multiple of it
VECTOR = 8  # ... a smaller one its vector loads


def matmul_dims(c: Capture, row: str) -> set[tuple[int, int, int]]:
    """The (M, N, K) of the counted matmuls behind op/phase row `row` (empty where the step's
    work was not counted): from the shapes of the two matrices each record read."""
    out: set = set()
    records = c.records or ()
    for i in c.counted_items or ():
        if attr.key_of(i, "op/phase") != row:
            continue
        for m in i.markers:
            r = records[m] if m < len(records) else None
            mats = [k[2] for k, _ in r.reads if len(k) == 3 and len(k[2]) >= 2] if r and r.flops else []
            if len(mats) >= 2 and mats[-2][-1] == mats[-1][-2]:
                a, b = mats[-2], mats[-1]
                out.add((a[-2], b[-1], a[-1]))
    return out


def off_tile(dims: set) -> list[str]:
    """The N and K (the weights' dimensions, the operands' leading ones) that are no multiple of
    the tile (of the vector width, below a tile), each with the size it pads to."""
    said = set()
    for _, n, k in dims:
        for name, d in (("N", n), ("K", k)):
            unit = TILE if d >= TILE else VECTOR
            if d >= VECTOR and d % unit:
                said.add(f"{name}={d} to {-(-d // unit) * unit}")
    return sorted(said)


def _faster_dtype(f: Findings, row) -> str:
    """The narrower operands' advice, where a much faster matmul ceiling was measured for them."""
    own = (matmul_ceiling(f.ceilings, row.dtype) or 0) if row.dtype in ("fp32", "tf32") else 0
    half = f.ceilings.get("matmul_bf16_tflops") or 0
    if not own or half <= 1.5 * own:
        return ""
    return f"bf16/fp16 operands (autocast): the measured bf16 ceiling is {half:.0f} TFLOP/s against {own:.0f}"


def _matmul_advice(f: Findings, row, dims: set) -> str | None:
    """What closes a matmul's gap to its ceiling, only what applies to its shapes and dtype: the
    dimensions off the tile padded, narrower operands; None where neither does."""
    off = off_tile(dims)
    parts = [f"pad {', '.join(off)}: shapes in multiples of {TILE} fill the kernels' tiles"] if off else []
    if not dims:  # not counted: the shapes are not known here
        parts.append(f"where a dimension is not a multiple of {TILE} (or 128), pad it")
    if faster := _faster_dtype(f, row):
        parts.append(faster)
    return "; ".join(parts) or None
