"""Captured FX graphs: what a node calls, the example value Dynamo traced it with, the values
some nodes take on the capture's inputs, and what a rewrite found."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node

CASTS = ("float", "half", "bfloat16", "to", "type_as", "type")  # the Tensor methods that cast


def calls(n: Any, *targets) -> bool:
    """Whether n is a call of one of these functions or (by name) methods."""
    return isinstance(n, Node) and n.op in ("call_function", "call_method") and n.target in targets


def example(n: Any) -> torch.Tensor | None:
    """The tensor Dynamo traced n with (a fake tensor: its shape, dtype, device), or None."""
    v = n.meta.get("example_value") if isinstance(n, Node) else None
    return v if isinstance(v, torch.Tensor) else None


@dataclass
class Found:
    """One written-out form found in a captured graph: whether it was replaced, and how or why not."""

    line: str  # an attention's: file:line of its softmax in the user's code (the others: "")
    replaced: bool
    reason: str = ""
    form: dict = field(default_factory=dict)  # what it became: is_causal, attn_mask, ...; a RoPE's layout
    pattern: str = ""  # the kind: "attention written out", ...


def values_of(gm: GraphModule, inputs: list, wanted: list) -> dict:
    """The values of these nodes on the capture's inputs (only what they need is computed)."""
    need: set = set()
    todo = [n for n in wanted if isinstance(n, Node)]
    while todo:
        n = todo.pop()
        if n not in need:
            need.add(n)
            todo.extend(n.all_input_nodes)

    class Part(Interpreter):
        def run_node(self, n):
            if n.op == "placeholder" or n in need:
                return super().run_node(n)
            return None

    part = Part(gm, garbage_collect_values=False)
    devices = [t.device for t in inputs if isinstance(t, torch.Tensor) and t.device.type == "cuda"][:1]
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        part.run(*inputs)
    return {n: part.env.get(n) for n in wanted if isinstance(n, Node)}
