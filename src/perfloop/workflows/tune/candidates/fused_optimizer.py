"""The optimizer's update as one fused kernel per parameter group (`fused=True`) instead of a
loop of small kernels per tensor (the OPTIMIZER finding)."""

from perfloop.analysis.findings import Kind
from perfloop.workflows.tune.candidates.base import Candidate, Numerics
from perfloop.workflows.tune.sites import Site

FUSABLE = ("Adam", "AdamW", "SGD", "Adagrad")


def _apply(child) -> None:
    import torch

    for name in FUSABLE:
        cls = getattr(torch.optim, name, None)
        if cls is not None:
            cls.__init__ = _fused_init(cls.__init__, child)


def _fused_init(init, child):
    def __init__(self, params, *args, **kwargs):
        params = list(params)
        try:
            init(self, params, *args, **{**kwargs, "fused": True, "foreach": None})
        except (RuntimeError, ValueError) as exc:  # a device or dtype fused kernels do not take
            child.note(f"fused=True refused by {type(self).__name__} ({exc}): foreach=True instead")
            init(self, params, *args, **{**kwargs, "fused": None, "foreach": True})

    return __init__


FUSED_OPTIMIZER = Candidate(
    name="fused-optimizer",
    what="the optimizer's update fused (fused=True)",
    lines=(
        "fused=True  # in the optimizer's constructor, e.g. torch.optim.AdamW(params, lr=lr, fused=True)",
    ),
    apply=_apply,
    at=Site.OPTIMIZER,
    numerics=Numerics.REORDERED,
    advised_by=(Kind.OPTIMIZER,),
)
