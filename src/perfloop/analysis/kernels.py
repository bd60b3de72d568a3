"""Kernel names and the per-kernel table of a profile: a readable name for each kernel, and its
calls, time and share."""

from __future__ import annotations

import re
from dataclasses import dataclass

_WRAPPERS = {"AUnary", "BUnary", "Binary", "CUDA", "Unary", "Compare", "Opmath"}


def short_name(name: str) -> str:
    """A readable kernel name. ATen's templated elementwise kernels become
    'elementwise[mul]' / 'elementwise[add, scalar]' / 'elementwise[tanh]' (from the
    functor or lambda inside); Triton, cuBLAS and other kernels keep their stem."""
    m = re.search(r"at::native::(?:\w+::)*?(\w*?(elementwise|reduce|softmax|gemm)\w*?_kernel)\b", name)
    if m:
        kind = {"elementwise": "elementwise", "reduce": "reduce", "softmax": "softmax"}.get(
            m.group(2), m.group(1)
        )
        ops = [f for f in re.findall(r"(\w+?)Functor\b", name) if f not in _WRAPPERS]
        ops += re.findall(r"CUDAFunctor(?:OnSelf|OnOther)?_(\w+?)\b", name)
        ops += re.findall(r"(\w+?)_kernel_(?:cuda|impl)\b", name)
        ops += re.findall(r"::(\w+?)_kernel_cuda\b", name)
        scalar = bool(re.search(r"AUnaryFunctor|BUnaryFunctor|FunctorOnSelf|FunctorOnOther", name))
        if ops:
            op = ops[0].split("::")[-1].lower()
            return f"{kind}[{op}{', scalar' if scalar else ''}]"
        return kind
    m = re.search(r"at::native::(?:\w+::)*(\w+)", name.replace("(anonymous namespace)::", ""))
    if m:
        return m.group(1)
    if not re.search(r"[<(]|^void ", name):
        return name[:60]  # already plain: aten::mul, triton_poi_..., nvjet_...
    name = re.sub(r"^void\s+", "", name.replace("(anonymous namespace)::", ""))
    name = name.split("<", 1)[0].split("(", 1)[0]
    return name.rsplit("::", 1)[-1][:60]


@dataclass(frozen=True)
class KernelStat:
    name: str
    short: str
    calls: int
    total_ms: float
    share: float

    @property
    def mean_us(self) -> float:
        return self.total_ms * 1e3 / self.calls if self.calls else 0.0


def union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3  # us -> ms


def kernel_table(items: list[tuple]) -> list[KernelStat]:
    """Per name: calls, total ms and share of the total, largest first."""
    agg: dict[str, list] = {}
    for name, s, e in items:
        a = agg.setdefault(name, [0, 0.0])
        a[0] += 1
        a[1] += (e - s) / 1e3
    total = sum(v[1] for v in agg.values()) or 1e-12
    stats = (
        KernelStat(name=n, short=short_name(n), calls=c, total_ms=t, share=t / total)
        for n, (c, t) in agg.items()
    )
    return sorted(stats, key=lambda k: -k.total_ms)
