"""The model's forward under autocast to bfloat16, where the script runs fp32: opt-in
(`--allow-numerics`), because it changes what the model computes, not only low bits."""

from perfloop.analysis.findings import Kind
from perfloop.workflows.tune.candidates.base import Candidate, Numerics
from perfloop.workflows.tune.sites import Site


def _apply(child) -> None:
    def wrap(model, args, kwargs) -> None:
        import torch

        model.forward = torch.autocast("cuda", dtype=torch.bfloat16)(model.forward)

    child.on_model(wrap, order=30)


AUTOCAST_BF16 = Candidate(
    name="autocast-bf16",
    what="the forward under torch.autocast('cuda', dtype=torch.bfloat16)",
    lines=("with torch.autocast('cuda', dtype=torch.bfloat16):  # around the forward and the loss",),
    apply=_apply,
    at=Site.CALL,
    numerics=Numerics.BF16,
    advised_by=(Kind.PRECISION, Kind.ROOFLINE),
    needs_cuda=True,
    opt_in=True,
)
