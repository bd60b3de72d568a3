"""The patterns a step's ranking looks for, on the profile's items and the counted call's
records: runs of memory-bound ops in one module (fusable chains), attention written out op by
op, and where in the user's code each is called (nn.plan.plan's sites); with the advice each
pattern's fix gets."""

from __future__ import annotations

import re
from collections import defaultdict

from perfloop.analysis import attribution as attr

CHAIN_MIN = 3
NOT_FUSABLE = {"matmul", "attention", "optimizer", "communication", "memcpy/memset"}

ADVICE = {
    "normalization": "a fused norm kernel (x and dy read once, dx written once, the weight "
    "gradients reduced in the same pass): pl.patch(model, batch) swaps in perfloop.nn's for "
    "nn.LayerNorm/RMSNorm modules and F.layer_norm/F.rms_norm calls in forward where it checks "
    "equal; or torch.compile on the module",
    "elementwise": "fuse it into its neighbours: torch.compile, or a Triton kernel",
    "reduction": "fuse the reduction with the ops around it (torch.compile), or a Triton kernel "
    "that keeps each row in registers",
    "attention": "F.scaled_dot_product_attention with a flash backend (bf16/fp16, head dim <= 256)",
    "optimizer": "a fused optimizer: torch.optim.AdamW(..., fused=True)",
    "other": "look at its kernels (perfloop asm, ncu)",
}


def chains(records, b_items, a_ms: dict) -> list[dict]:
    """Runs of consecutive memory-bound ops in one module and phase (from the counted call),
    timed from the timed calls: each (module, phase, op)'s time per call in `a_ms`, shared
    among the counted ops behind it."""
    info: dict[int, dict] = {}
    for it in b_items:
        for m in it.markers:
            d = info.setdefault(
                m,
                {
                    "kernels": 0,
                    "module": it.module,
                    "phase": it.phase,
                    "op": it.op,
                    "layout": (it.outer_op or it.op) in LAYOUT_OPS,
                },
            )
            d["kernels"] += 1
    per_key: dict = defaultdict(int)
    for d in info.values():
        per_key[(d["module"], d["phase"], d["op"])] += 1
    last_read: dict = {}
    for r in records:
        if r is not None:
            for k, _ in r.reads:
                last_read[k] = r.index
    runs, cur = [], []

    def close():
        if len(cur) >= CHAIN_MIN:
            runs.append(list(cur))
        cur.clear()

    for m in sorted(info):
        r, d = records[m] if m < len(records) else None, info[m]
        if r is None:  # a view or an allocation: no data moved, the run goes on
            continue
        if r.flops or attr.category(r.op) in NOT_FUSABLE or d["phase"] == "optimizer" or d["layout"]:
            close()  # a layout copy is its own opportunity
            continue
        if cur and (info[cur[-1]]["module"], info[cur[-1]]["phase"]) != (d["module"], d["phase"]):
            close()
        cur.append(m)
    close()
    out = []
    for run in runs:
        produced: dict = {}
        seen: set = set()
        ext_read = 0.0
        for m in run:
            for k, b in records[m].reads:
                if k not in produced and k not in seen:
                    seen.add(k)
                    ext_read += b
            for k, b in records[m].writes:
                produced[k] = b
        last_writes = {k for k, _ in records[run[-1]].writes}
        ext_write = sum(b for k, b in produced.items() if last_read.get(k, -1) > run[-1] or k in last_writes)
        keys = [(info[m]["module"], info[m]["phase"], info[m]["op"]) for m in run]
        out.append(
            {
                "module": info[run[0]]["module"],
                "phase": info[run[0]]["phase"],
                "ms": sum(a_ms.get(k, 0.0) / per_key[k] for k in keys),
                "kernels": sum(info[m]["kernels"] for m in run),
                "bytes": sum(records[m].bytes for m in run),
                "ideal_bytes": ext_read + ext_write,
                "ops": [records[m].op.split("::")[-1] for m in run],
                "keys": set(keys),
            }
        )
    return merged(out)


LAYOUT_OPS = ("aten::contiguous", "aten::clone")
SOFTMAX_OPS = ("aten::softmax", "aten::_softmax", "aten::_safe_softmax", "aten::log_softmax")

SDPA = "aten::scaled_dot_product_attention"


def written_attention_modules(items) -> dict:
    """{module pattern: (modules, ms of their ops but the matmuls, distinct such ops)} for the
    modules that compute attention by hand: in their own forward two or more matmuls and a
    softmax, and no fused attention kernel. What scaled_dot_product_attention ran (its math
    backend) is not written out: that is the SDPA finding's."""
    by_module: dict = defaultdict(list)
    for i in items:
        if SDPA not in (i.outer_op, i.op):
            by_module[i.module].append(i)
    found: dict = {}
    for module, its in by_module.items():
        forward = [i for i in its if i.phase == "forward"]
        matmuls = sum(1 for i in forward if attr.category(i.op or i.kernel) == "matmul")
        fused = any(attr.category(i.op or i.kernel) == "attention" for i in its)
        if fused or matmuls < 2 or not any(i.op in SOFTMAX_OPS for i in forward):
            continue
        rest = [i for i in its if attr.category(i.op or i.kernel) != "matmul"]
        pattern = re.sub(r"\.\d+(?=\.|$)", ".*", module)
        mods, ms, ops = found.get(pattern, (set(), 0.0, set()))
        ops |= {(i.phase, i.op) for i in rest}
        found[pattern] = (mods | {module}, ms + sum(i.ms for i in rest), ops)
    return {k: (mods, ms, len(ops)) for k, (mods, ms, ops) in found.items()}


def matches(pattern: str, modules: set) -> bool:
    rx = re.compile("^" + re.escape(pattern).replace(r"\.\*", r"\.\d+") + "$")
    return any(rx.match(m) or m == pattern for m in modules)


def merged(chains: list[dict]) -> list[dict]:
    """Chains of the same ops in modules that differ only in their layer numbers, as one."""
    out: dict = {}
    for c in chains:
        pattern = re.sub(r"\.\d+(?=\.|$)", ".*", c["module"])
        k = (pattern, c["phase"], tuple(c["ops"]))
        if k not in out:
            out[k] = dict(c, module=pattern, count=1)
            continue
        m = out[k]
        m["count"] += 1
        m["keys"] = m["keys"] | c["keys"]
        for f in ("ms", "kernels", "bytes", "ideal_bytes"):
            m[f] += c[f]
    return list(out.values())


def chain_advice(ops: list[str], kind: str | None = None) -> str:
    kind = kind or chain_kind(ops)
    if kind == "cross_entropy":
        return (
            "a fused cross-entropy: the loss from one read of the logits, their gradient from "
            "one more, in the logits' dtype: pl.patch(model, batch) swaps it in for an "
            "nn.CrossEntropyLoss or an F.cross_entropy call in forward where it checks equal; or "
            "torch.compile"
        )
    if kind == "normalization":
        return ADVICE["normalization"]
    if kind == "gelu":
        return (
            "a fused GELU (one kernel each way, the slope recomputed): pl.patch(model, batch) swaps it "
            "in where it checks equal; or torch.compile"
        )
    if kind == "rope":
        return (
            "a fused rotary embedding (one kernel each way, fp32 math): pl.patch(model, batch) swaps "
            "it in where it checks equal; or torch.compile"
        )
    return "torch.compile on the module, or one Triton kernel for the run"


def chain_kind(ops: list[str]) -> str | None:
    """What a run of ops computes, where it is one of the kinds pl.patch knows: by the ops
    only that kind makes (a loss's log_softmax, a norm's rsqrt, GELU's tanh or erf, RoPE's stack
    of the rotated pairs or the negated half it concatenates)."""
    if any("nll_loss" in o or "log_softmax" in o or "cross_entropy" in o for o in ops):
        return "cross_entropy"
    names = {o.removeprefix("aten::") for o in ops}
    if any(
        n.removeprefix("native_").startswith(("layer_norm", "rms_norm", "_fused_rms_norm")) for n in names
    ) or (names & {"var", "var_mean", "rsqrt"}):
        return "normalization"
    if names & {"tanh", "erf", "tanh_backward", "gelu", "gelu_backward"}:
        return "gelu"
    if "stack" in names or {"cat", "neg"} <= names or "view_as_complex" in names:
        return "rope"
    return None


def chain_kinds(found: list[dict]) -> list[str | None]:
    """Each chain's kind (chain_kind); a backward chain that names none is the backward of the
    chain its module ran forward, where that module ran one kind."""
    forward: dict = {}
    for c in found:
        if c["phase"] == "forward" and (k := chain_kind(c["ops"])):
            forward.setdefault(c["module"], set()).add(k)
    out = []
    for c in found:
        k = chain_kind(c["ops"])
        if k is None and c["phase"] == "backward" and len(forward.get(c["module"], ())) == 1:
            k = next(iter(forward[c["module"]]))
        out.append(k)
    return out


def where_called(pattern: str, kind: str | None, sites: dict | None) -> str:
    """The call sites of this kind in the modules a chain's pattern names (from nn.plan.plan,
    run where the model was at hand), or why pl.patch does not reach the chain."""
    if sites is None or kind is None:
        return ""
    rx = re.compile("^" + re.escape(pattern).replace(r"\.\*", r"\.\d+") + "$")
    found = [sites[m][kind] for m in sites if rx.match(m) and kind in sites[m]]
    if not found:
        what = {
            "cross_entropy": "cross entropy call",
            "normalization": "norm",
            "rope": "rotary embedding",
        }.get(kind, kind)
        return (
            f"no {what} pl.patch can reach in {pattern}: no fusable module there and no F call in its "
            "forward's own code (computed elsewhere?)"
        )
    first = found[0]
    return first + (f" (x{len(found)} modules)" if len(found) > 1 else "")


def where_any(kind: str | None, sites: dict | None) -> str:
    """The call sites of this kind anywhere in the model (an op's row spans its modules)."""
    if sites is None or kind is None:
        return ""
    counts: dict = {}
    for kinds in sites.values():
        if kind in kinds:
            counts[kinds[kind]] = counts.get(kinds[kind], 0) + 1
    if not counts:
        return where_called("the model", kind, {})
    return "; ".join(w + (f" (x{n} modules)" if n > 1 else "") for w, n in counts.items())


def ops_list(ops: list[str]) -> str:
    head = ", ".join(ops[:6])
    return head + (f", ... ({len(ops)} ops)" if len(ops) > 6 else "")
