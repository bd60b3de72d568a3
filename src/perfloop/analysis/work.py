"""What each aten op had to do: FLOPs and bytes moved, estimated from the tensors it was given.

`WorkCounter` is a dispatch mode: it sees every aten op below autograd (forward, backward and
optimizer alike) with its real tensors, and records for each

- FLOPs from torch's own formulas (`torch.utils.flop_counter.flop_registry`: matmuls,
  convolutions, attention), with the CPU attention kernels added and causal attention counted
  for the half of the score matrix it computes;
- bytes: every tensor read once plus every tensor written once, where a tensor's bytes are its
  distinct elements (a broadcast operand counts once, not once per use); views move nothing;
  an op that writes into an argument counts it written (and read, unless it only overwrites:
  copy_, fill_, zero_, ...); gathers (embedding, index_select, nll_loss) read the rows they
  take, not the whole table;
- the dtype that sets its ceiling (an fp32 matmul with TF32 allowed is "tf32");
- for a call that makes the host wait for the device (.item(), nonzero, a copy to the CPU),
  the user's source line that made it.

Each recorded op runs inside a profiler range "pl.op#<index>", so a profile taken meanwhile
ties each kernel to the record of the op that launched it.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import torch
from torch._C._profiler import _RecordFunctionFast
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

MARKER = "pl.op#"

OVERWRITES = {
    "copy_",
    "fill_",
    "zero_",
    "normal_",
    "uniform_",
    "random_",
    "bernoulli_",
    "exponential_",
    "index_put_",
    "masked_fill_",
    "scatter_",
    "set_",
}
NO_DATA = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "resize_",
    "_unsafe_view",
    "_local_scalar_dense",
    "lift_fresh",
    "detach",
    "alias",
}
SYNCS = {
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "unique_consecutive",
    "_unique2",
    "item",
    "equal",
    "is_nonzero",
}
_DTYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float64: "fp64",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8",
}


@dataclass
class OpWork:
    index: int
    op: str  # "aten::addmm"
    flops: float
    bytes: float
    dtype: str  # "bf16", "fp32", "tf32", ...
    flops_from: str  # "formula" or "" (no arithmetic counted)
    reads: tuple  # ((storage key, bytes), ...)
    writes: tuple
    site: str = ""  # "train.py:88" for an op that synchronizes the host


def footprint(t: torch.Tensor) -> int:
    """Bytes of a tensor's distinct elements: broadcast (stride 0) dimensions count once."""
    if t.numel() == 0:
        return 0
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _key(t: torch.Tensor):
    try:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
    except (RuntimeError, NotImplementedError):
        return (id(t),)


def _bound(func, args, kwargs) -> dict:
    names = [a.name for a in func._schema.arguments]
    out = dict(zip(names, args, strict=False))  # trailing arguments left to their defaults
    out.update(kwargs)
    return out


def _causal_fraction(q: torch.Tensor, k: torch.Tensor) -> float:
    """Share of the score matrix a causal kernel computes (the lower triangle)."""
    sq, sk = q.shape[-2], k.shape[-2]
    if sq == 0 or sk == 0:
        return 1.0
    kept = sum(min(sk, max(0, sk - sq + i + 1)) for i in range(sq)) if sq < 4096 else sq * (sk - (sq - 1) / 2)
    return kept / (sq * sk)


def _flops(func, args, kwargs, out) -> float | None:
    packet = func._overloadpacket
    name = func._schema.name.split("::")[-1]
    b = _bound(func, args, kwargs)
    if name == "_scaled_dot_product_flash_attention_for_cpu":
        f = sdpa_flop_count(b["query"].shape, b["key"].shape, b["value"].shape)
    elif name == "_scaled_dot_product_flash_attention_for_cpu_backward":
        f = sdpa_backward_flop_count(b["grad_out"].shape, b["query"].shape, b["key"].shape, b["value"].shape)
    elif packet in flop_registry:
        f = flop_registry[packet](*args, **kwargs, out_val=out)
    else:
        return None
    if b.get("is_causal") and "query" in b and "key" in b:
        f *= _causal_fraction(b["query"], b["key"])
    return float(f)


def _bytes(func, name: str, args, kwargs, out) -> tuple[tuple, tuple]:
    """(reads, writes): ((storage key, bytes), ...) for the tensors the op reads and writes."""
    schema = func._schema
    b = _bound(func, args, kwargs)
    if name in NO_DATA:
        return (), ()
    outs = list(_tensors(out))
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if not mutated and any(r.alias_info is not None for r in schema.returns):
        return (), ()  # a view: no data moves
    written = [t for n in mutated for t in _tensors(b.get(n))]
    if name in ("embedding", "index_select", "gather"):
        index = b.get("indices", b.get("index"))
        reads = [(_key(index), footprint(index))] + [(("rows", id(t)), footprint(t)) for t in outs]
    elif name == "nll_loss_forward":
        target = b["target"]
        reads = [
            (_key(target), footprint(target)),
            (_key(b["self"]), target.numel() * b["self"].element_size()),
        ]
    elif name == "nll_loss_backward":
        reads = [(_key(t), footprint(t)) for t in (b["grad_output"], b["target"])]
    elif name == "embedding_dense_backward":
        reads = [(_key(t), footprint(t)) for t in (b["grad_output"], b["indices"])]
    else:
        skip = {id(t) for t in written} if name in OVERWRITES else set()
        reads = [
            (_key(t), footprint(t))
            for a in schema.arguments
            for t in _tensors(b.get(a.name))
            if id(t) not in skip
        ]
    written_ids = {id(t) for t in written}
    fresh = [t for t in outs if id(t) not in written_ids and not any(t is w for w in written)]
    writes = [(_key(t), footprint(t)) for t in written + fresh]
    return tuple(reads), tuple(writes)


def _dtype(func, args, kwargs, flops: float | None) -> str:
    ts = [t for t in _tensors(list(args) + list(kwargs.values())) if t.is_floating_point()]
    if not ts:
        return ""
    t = ts[0] if flops else max(ts, key=lambda t: t.numel())
    name = _DTYPES.get(t.dtype, str(t.dtype).replace("torch.", ""))
    if name == "fp32" and flops and t.is_cuda and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return name


_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def user_site() -> str:
    """file:line of the innermost frame outside torch, perfloop and the standard library."""
    f = sys._getframe(1)
    std = os.path.dirname(os.__file__)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if not path.startswith((_HERE, _TORCH, std)) and not path.startswith("<"):
            return f"{os.path.relpath(path) if path.startswith(os.getcwd()) else path}:{f.f_lineno}"
        f = f.f_back
    return ""


class WorkCounter(TorchDispatchMode):
    """Records an OpWork for each aten op that runs within (views and allocations excepted),
    each op inside a profiler range named MARKER + its index."""

    def __init__(self):
        super().__init__()
        self.records: list[OpWork] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Compiled code runs compiled within (else Dynamo runs it eager under a mode): the mode
        sees the aten ops it calls (extern matmuls, attention), not its generated kernels."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        index = len(self.records)
        with _RecordFunctionFast(f"{MARKER}{index}"):
            out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        reads, writes = _bytes(func, name, args, kwargs, out)
        try:
            flops = _flops(func, args, kwargs, out)
        except Exception:  # a formula that does not take these arguments: count no arithmetic
            flops = None
        moving = reads or writes or flops
        to_host = (
            name in ("_to_copy", "copy_")
            and any(t.device.type == "cpu" for t in _tensors(out))
            and any(t.is_cuda for t in _tensors(list(args)))
        )
        if moving or name in SYNCS:
            self.records.append(
                OpWork(
                    index=index,
                    op=func._schema.name,
                    flops=flops or 0.0,
                    bytes=float(sum(n for _, n in reads) + sum(n for _, n in writes)),
                    dtype=_dtype(func, args, kwargs, flops),
                    flops_from="formula" if flops else "",
                    reads=reads,
                    writes=writes,
                    site=user_site() if (name in SYNCS or to_host) else "",
                )
            )
        else:
            self.records.append(None)  # keeps indices equal to the markers' numbers
        return out


def count(fn, *args, **kwargs) -> list[OpWork]:
    """The work of one call of fn(*args, **kwargs), op by op."""
    with WorkCounter() as wc:
        fn(*args, **kwargs)
    return [r for r in wc.records if r is not None]


def total_flops(records) -> float:
    return math.fsum(r.flops for r in records)


TYPE_BYTES = {
    "float": 4,
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "double": 8,
    "long int": 8,
    "int": 4,
    "bool": 1,
    "unsigned char": 1,
    "signed char": 1,
    "short int": 2,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
}
TYPE_NAMES = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16", "double": "fp64"}


def shape_work(name: str, shapes, types) -> tuple[float, float, str]:
    """(FLOPs, bytes, dtype) of a call from the shapes and type names the profiler recorded of
    its arguments (record_shapes): each tensor argument's bytes once, and a matmul's FLOPs."""
    tensors = [
        (d, t)
        for d, t in zip(shapes, types, strict=False)
        if t in TYPE_BYTES and isinstance(d, (list, tuple)) and all(isinstance(n, int) for n in d)
    ]
    nbytes = float(sum(math.prod(d) * TYPE_BYTES[t] for d, t in tensors))
    op = name.split("::")[-1]
    dims = [d for d, _ in tensors]
    first = {"mm": 0, "bmm": 0, "addmm": 1, "baddbmm": 1}.get(op)  # the out= variant adds the output last
    flops = 0.0
    if first is not None and len(dims) >= first + 2:
        a, b = dims[first], dims[first + 1]
        if len(a) == len(b) == (3 if op.startswith("b") else 2) and a[-1] == b[-2]:
            flops = 2.0 * math.prod(a) * b[-1]
    return flops, nbytes, TYPE_NAMES.get(tensors[0][1], "") if tensors else ""
