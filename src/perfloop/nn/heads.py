"""Attention written as one module per head, merged: the heads' key, query and value Linears
read as one projection and the heads' attentions as one SDPA call.

The lecture-style GPT keeps each head in its own module (its own key/query/value Linears and
causal mask), calls them one by one and concatenates their outputs: 3 small matmuls, a
softmax chain and a matmul per head, 36 heads a step in a 6-layer model. `find(model)` finds a
ModuleList of such heads (2 or more of one class, each with bias-free Linears named key, query
and value of one shape); `MergedHeads` computes all of them at once -- the heads' weights
concatenated (a copy per call: the parameters, their names and the optimizer stay the
model's), one `F.linear`, one `F.scaled_dot_product_attention` -- and each head's forward
returns its slice. The first head's call computes all, the others read what it left.

Which scale and mask the heads use is not read from their code: `pl.patch` checks the merged
forms (scale 1/sqrt(head size) or 1/sqrt(model width), causal or not) against the parent
module's own output and gradients on the example batch, and keeps the one that matches.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

KIND = "attention heads merged"
NAMES = (("query", "key", "value"), ("q", "k", "v"), ("q_proj", "k_proj", "v_proj"))


def _qkv(head: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear] | None:
    for names in NAMES:
        lin = [getattr(head, n, None) for n in names]
        if (
            all(isinstance(m, nn.Linear) and m.bias is None for m in lin)
            and len({(m.in_features, m.out_features) for m in lin}) == 1
        ):
            return tuple(lin)
    return None


def heads_of(parent: nn.Module) -> list[nn.Module] | None:
    """The parent's one-per-head attention modules: its first ModuleList of 2 or more modules of
    one class, each with bias-free query/key/value Linears of one shape; None if it has none."""
    for child in parent.children():
        if (
            isinstance(child, nn.ModuleList)
            and len(child) >= 2
            and len({type(h) for h in child}) == 1
            and all(_qkv(h) is not None for h in child)
            and len({_qkv(h)[0].in_features for h in child}) == 1
        ):
            return list(child)
    return None


def find(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, parent) of each module in `model` that holds one-per-head attention modules."""
    return [(name, m) for name, m in model.named_modules() if heads_of(m) is not None]


def merge(parent: nn.Module, scale: str, causal: bool) -> MergedHeads:
    """The parent's heads computed at once from now on (their forwards replaced)."""
    m = MergedHeads(heads_of(parent), scale, causal)
    m.install()
    return m


def unmerge(module: nn.Module) -> None:
    """Each head under `module` (or `module` itself) back to its own forward."""
    for h in module.modules():
        if getattr(h.__dict__.get("forward"), "merged_by", None) is not None:
            del h.forward


class MergedHeads:
    """All heads' attention at once; installed as each head's forward (`install`), taken out by
    `remove`. `scale`: "head" (1/sqrt(head size)) or "width" (1/sqrt(the input's width))."""

    def __init__(self, heads: list[nn.Module], scale: str, causal: bool):
        self.heads, self.scale, self.causal = heads, scale, causal
        self._left: tuple | None = None  # (the input, its outputs by head) the first head computed

    def dropout_p(self) -> float:
        h = self.heads[0]
        drops = [m.p for m in h.modules() if isinstance(m, nn.Dropout)]
        return drops[0] if drops and h.training else 0.0

    def all_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, head size): every head's attention of x."""
        qkv = [_qkv(h) for h in self.heads]
        w = torch.cat([torch.cat([lin[i].weight for lin in qkv]) for i in range(3)])
        *lead, t, width = x.shape
        hs = qkv[0][0].out_features
        y = F.linear(x, w).view(*lead, t, 3, len(self.heads), hs)
        q, k, v = (y.select(-3, i).transpose(-3, -2) for i in range(3))
        scale = hs**-0.5 if self.scale == "head" else width**-0.5
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=self.causal, dropout_p=self.dropout_p(), scale=scale
        )

    def forward_of(self, i: int):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if i == 0 or self._left is None or self._left[0] is not x:
                self._left = (x, self.all_heads(x).unbind(-3))
            out = self._left[1][i]
            if i == len(self.heads) - 1:
                self._left = None
            return out

        forward.merged_by = self
        return forward

    def install(self) -> None:
        for i, h in enumerate(self.heads):
            h.forward = self.forward_of(i)

    def said(self) -> str:
        scale = "1/sqrt(head size)" if self.scale == "head" else "1/sqrt(model width)"
        mask = ", is_causal=True" if self.causal else ""
        return (
            f"{len(self.heads)} heads' key/query/value Linears -> one projection; their attentions -> "
            f"one F.scaled_dot_product_attention(q, k, v{mask}, scale={scale})"
        )


FORMS = [("head", True), ("width", True), ("head", False), ("width", False)]
