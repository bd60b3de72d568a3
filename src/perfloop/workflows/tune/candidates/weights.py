"""The model's weights (and floating buffers: a KV cache) in bfloat16 where a generation step
reads them in fp32: opt-in (`--allow-numerics`), because bf16 weights change what the model
computes; the greedy tokens say whether it still generates the same text."""

from perfloop.analysis.findings import Kind
from perfloop.workflows.tune.candidates.base import Candidate, Numerics
from perfloop.workflows.tune.sites import Site


def _apply(child) -> None:
    def cast(model, args, kwargs) -> None:
        import torch

        with torch.no_grad():  # floating tensors only: complex RoPE tables and integer buffers keep theirs
            for t in [*model.parameters(), *model.buffers()]:
                if t.dtype == torch.float32:
                    t.data = t.data.to(torch.bfloat16)

    child.on_model(cast, order=20)


BF16_WEIGHTS = Candidate(
    name="bf16-weights",
    what="the model's fp32 weights and floating buffers (KV cache) in bfloat16",
    lines=("model = model.to(torch.bfloat16)  # before its caches are set up",),
    apply=_apply,
    at=Site.MODEL,
    numerics=Numerics.BF16,
    advised_by=(Kind.DECODE_WEIGHTS,),
    opt_in=True,
)
